"""Who can change what through the dashboard (docs/security.md), against a real Redis.

``--read-only`` leaves no button that writes on the recommendation cards, the silences and the dead
letters, and says so; without it the buttons are there. The actor recorded for an acknowledgement or a
silence is the logged-in user with ``[auth]`` configured (``st.user`` seeded through ``AppTest.user``), else
the OS user running the dashboard plus ``(no login)``; with ``[auth]`` and no login nothing but the login
button renders. ``trainhealth dashboard`` listens on 127.0.0.1 by default and warns on stderr when
``--host`` exposes it unprotected (``subprocess.Popen`` replaced: no server is started).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from streamlit.testing.v1 import AppTest

from trainhealth import alert_store as store
from trainhealth.anomaly import Anomaly
from trainhealth.commands import build_parser, main
from trainhealth.commands import dashboard as dashboard_cmd
from trainhealth.dashboard import cards
from trainhealth.dashboard.common import NO_LOGIN, READ_ONLY_ENV, READ_ONLY_NOTE, read_only
from trainhealth.dashboard.frame import LOGIN_REQUIRED
from trainhealth.detectors.advisor import Checkpoint, RollbackAdvisor
from trainhealth.embedded_redis import free_port
from trainhealth.keys import ALERTS_DEAD, RUNS, run_keys, service_heartbeat

pytestmark = pytest.mark.usefixtures("fresh_streamlit_caches")

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "dashboard" / "app.py"
ALERTS = ROOT / "dashboard" / "pages" / "alerts.py"
RUN = "r1"
OS_USER = "ops-bot"  # $LOGNAME, the first thing getpass.getuser() reads
CARD_BUTTONS = ["Acknowledge", "Mark applied", "Dismiss"]
ALERT_BUTTONS = ["Resend selected", "Resend all", "Add silence", "Expire now"]
#: A login configured for AppTest (placeholders: AppTest never talks to a provider).
AUTH = {"auth": {"redirect_uri": "http://localhost:8501/oauth2callback", "cookie_secret": "placeholder",
                 "client_id": "placeholder", "client_secret": "placeholder",
                 "server_metadata_url": "https://idp.example.com/.well-known/openid-configuration"}}
ANA = {"is_logged_in": True, "email": "ana@example.com", "name": "Ana"}


def _recommendation():
    spike = Anomaly("loss_spike", "warning", 250, "loss 5.20 at step 250 is 9.1 MADs above the median 2.31")
    ckpts = [Checkpoint(s, consumed_samples=(s + 1) * 512, batch_index=s) for s in (49, 99, 149, 199, 249)]
    return RollbackAdvisor().advise(spike, history=[spike], run=RUN, checkpoints=ckpts, current_step=300,
                                    step_s=10.0, world_size=8, gpu_hour_usd=2.5, data_positions={})


def seed(r: redis.Redis) -> str:
    """Run r1 with one proposed rollback recommendation, one dead letter and one silence; returns the rec id."""
    now = time.time()
    r.zadd(RUNS, {RUN: now - 600})
    r.hset(run_keys(RUN).meta, mapping={"name": RUN, "world_size": "8", "status": "running",
                                        "started_at": repr(now - 600)})
    rec = _recommendation()
    d = rec.to_dict()
    d.update({"status": "proposed", "created_at": now - 60, "updated_at": now - 5})
    r.hset(run_keys(RUN).recommendations, rec.id, json.dumps(d, sort_keys=True))
    r.set(service_heartbeat("svc-1"), json.dumps({"pid": 1, "host": "h", "t": now, "runs": 1}), ex=30)
    r.lpush(ALERTS_DEAD, json.dumps({"id": "5-0", "sink": "slack", "key": "k5", "group": 'root:{run="r1"}',
                                     "seq": "3", "attempts": 12, "status": 500, "error": "gave up after 12 tries",
                                     "dead_at": now - 50, "notification": {"seq": 3}}))
    store.add_silence(r, ['run="r2"'], duration_s=3600, created_by="bo", comment="maintenance")
    return rec.id



@pytest.fixture
def rec_id(r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    monkeypatch.setenv("LOGNAME", OS_USER)
    monkeypatch.delenv(READ_ONLY_ENV, raising=False)
    return seed(r)


def open_page(path: Path, user: dict | None = None, secrets: dict | None = None) -> AppTest:
    at = AppTest.from_file(str(path), default_timeout=30)
    at.query_params["run"] = RUN
    if user is not None:
        at.user = user
    if secrets is not None:
        at.secrets = secrets
    at.run()
    assert not at.exception, at.exception
    return at


def labels(at: AppTest) -> list[str]:
    return [b.label for b in at.button]


def stored(r: redis.Redis, rec_id: str) -> dict:
    return json.loads(r.hget(run_keys(RUN).recommendations, rec_id))


# --- read-only ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [("", False), ("0", False), ("false", False), ("No", False),
                                                 ("off", False), ("1", True), ("true", True), ("yes", True),
                                                 ("typo", True)])
def test_read_only_setting(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv(READ_ONLY_ENV, value)
    assert read_only() is expected
    monkeypatch.delenv(READ_ONLY_ENV)
    assert read_only() is False


def test_read_only_overview_shows_the_card_without_buttons(rec_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(READ_ONLY_ENV, "1")
    at = open_page(APP)
    assert at.main.caption[0].value == READ_ONLY_NOTE == (
        ":material/lock: Read-only dashboard: silences, dead-letter resends and recommendation decisions are made "
        "with the `trainhealth` commands (`silence`, `deadletters requeue`, `advise --set`).")
    heads = [m.value for m in at.markdown if ":blue-badge[proposed]" in m.value]
    assert heads == [":red-badge[:material/history: Roll back] :blue-badge[proposed] **Loss spike at step 250** · "
                     "now step 300"]
    assert labels(at) == []
    status = [c.value for c in at.caption if c.value.startswith("Status **proposed**")]
    assert len(status) == 1  # the card's status line stays
    at.switch_page("pages/goodput.py").run()
    assert not at.exception
    assert at.main.caption[0].value == READ_ONLY_NOTE and labels(at) == []


def test_read_only_alerts_page_has_no_silence_or_resend_form(rec_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(READ_ONLY_ENV, "1")
    at = open_page(ALERTS)
    assert labels(at) == []
    assert not [t for t in at.text_input if t.key == "sil_by"]
    captions = [c.value for c in at.main.caption]
    assert captions[0] == READ_ONLY_NOTE
    assert "Read-only: resend dead letters with `trainhealth deadletters requeue ID... | --all`." in captions
    assert ("Read-only: add a silence with `trainhealth silence add`, end one with `trainhealth silence expire ID`."
            in captions)
    assert {m.label: (m.value, m.proto.delta) for m in at.metric}["Dead letters"] == ("1", "resend with the CLI")
    silences = at.dataframe[-1].value  # still listed
    assert list(silences["matchers"]) == ['run="r2"'] and list(silences["created_by"]) == ["bo"]


def test_normal_mode_has_every_action_button(rec_id: str) -> None:
    at = open_page(APP)
    assert labels(at) == CARD_BUTTONS
    assert READ_ONLY_NOTE not in [c.value for c in at.caption]
    at = open_page(ALERTS)
    assert labels(at) == CARD_BUTTONS + ALERT_BUTTONS  # the open recommendation's card heads every page
    assert READ_ONLY_NOTE not in [c.value for c in at.caption]
    assert {m.label: m.proto.delta for m in at.metric}["Dead letters"] == "resend below"


# --- who is recorded ---------------------------------------------------------------------------------------

def test_ack_without_login_records_the_os_user(rec_id: str, r: redis.Redis) -> None:
    at = open_page(APP)
    at.button(key=cards.button_key("overview", "acknowledged", rec_id)).click().run()
    assert not at.exception
    d = stored(r, rec_id)
    assert d["status"] == "acknowledged"
    assert d["history"][-1]["by"] == "ops-bot (no login)" == f"{OS_USER} {NO_LOGIN}"
    status = [c.value for c in at.caption if c.value.startswith("Status **acknowledged**")]
    assert len(status) == 1 and " → acknowledged by ops-bot (no login) " in status[0]


def test_silence_without_login_and_without_a_name_records_the_os_user(rec_id: str, r: redis.Redis) -> None:
    at = open_page(ALERTS)
    assert at.text_input(key="sil_by").proto.help == "left empty: ops-bot (no login)"
    at.text_input(key="sil_comment").input("drain")
    next(b for b in at.button if b.label == "Add silence").click().run()
    assert not at.exception
    added = [s for s in store.list_silences(r) if s.comment == "drain"]
    assert [s.created_by for s in added] == ["ops-bot (no login)"]


def test_with_login_the_ack_and_the_silence_record_the_user(rec_id: str, r: redis.Redis) -> None:
    at = open_page(APP, user=ANA, secrets=AUTH)
    assert [b.label for b in at.sidebar.button] == ["Log out"] and [b.label for b in at.main.button] == CARD_BUTTONS
    assert "Logged in as **ana@example.com**" in [c.value for c in at.sidebar.caption]
    at.button(key=cards.button_key("overview", "dismissed", rec_id)).click().run()
    assert not at.exception
    d = stored(r, rec_id)
    assert (d["status"], d["history"][-1]["by"]) == ("dismissed", "ana@example.com")

    at = open_page(ALERTS, user=ANA, secrets=AUTH)
    assert not [t for t in at.text_input if t.key == "sil_by"]  # no name to type: the login says who
    assert "Created by **ana@example.com**" in [c.value for c in at.caption]
    at.text_input(key="sil_comment").input("drain")
    next(b for b in at.button if b.label == "Add silence").click().run()
    assert not at.exception
    assert [s.created_by for s in store.list_silences(r) if s.comment == "drain"] == ["ana@example.com"]


def test_login_name_when_the_provider_gives_no_email(rec_id: str, r: redis.Redis) -> None:
    at = open_page(APP, user={"is_logged_in": True, "name": "Ana Lima"}, secrets=AUTH)
    at.button(key=cards.button_key("overview", "applied", rec_id)).click().run()
    assert stored(r, rec_id)["history"][-1]["by"] == "Ana Lima"


@pytest.mark.parametrize("page", [APP, ALERTS])
def test_with_login_configured_nothing_renders_before_the_login(rec_id: str, r: redis.Redis, page: Path) -> None:
    at = open_page(page, user={"is_logged_in": False}, secrets=AUTH)
    assert [i.value for i in at.info] == [LOGIN_REQUIRED]
    assert labels(at) == ["Log in"]
    assert not at.metric and not at.dataframe and not at.selectbox and not at.markdown
    # The click starts Streamlit's login; without a usable provider it says why and stays locked.
    at.button(key="th_login").click().run()
    assert not at.exception
    assert len(at.error) == 1 and at.error[0].value.startswith("Login is not set up correctly: ")
    assert labels(at) == ["Log in"] and not at.metric
    assert stored(r, rec_id)["status"] == "proposed"


# --- trainhealth dashboard ---------------------------------------------------------------------------------

class FakeStreamlit:
    """Stands in for ``subprocess.Popen`` of the Streamlit child: records its command line and environment."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        FakeStreamlit.calls.append({"cmd": cmd, "env": env})

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def poll(self) -> int:
        return 0


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, Any]]:
    FakeStreamlit.calls = []
    monkeypatch.setattr(dashboard_cmd.subprocess, "Popen", FakeStreamlit)
    monkeypatch.setattr(dashboard_cmd, "interrupt_on_signals", lambda: None)  # leave pytest's handlers alone
    monkeypatch.setattr(dashboard_cmd, "ignore_signals", lambda: None)
    monkeypatch.setattr(dashboard_cmd, "secrets_files", lambda: [tmp_path / "secrets.toml"])
    monkeypatch.delenv(READ_ONLY_ENV, raising=False)
    return FakeStreamlit.calls


def address(cmd: list[str]) -> str:
    return cmd[cmd.index("--server.address") + 1]


def test_default_host_is_loopback(fake_run: list, redis_url: str, capsys: pytest.CaptureFixture) -> None:
    args = build_parser().parse_args(["dashboard"])
    assert (args.host, args.read_only, args.port) == ("127.0.0.1", False, 8501)
    port = free_port()
    assert main(["dashboard", "--port", str(port), "--redis-url", redis_url]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines() == [f"Redis: {redis_url}", f"Dashboard: http://127.0.0.1:{port}/",
                                "Access: no login (changes are recorded as the OS user running it, marked "
                                "'(no login)')"]
    (call,) = fake_run
    assert address(call["cmd"]) == "127.0.0.1" and call["cmd"][call["cmd"].index("--server.port") + 1] == str(port)
    assert READ_ONLY_ENV not in call["env"]


def test_run_option_prints_the_link_and_streamlit_prints_no_second_address(fake_run: list, redis_url: str,
                                                                            capsys: pytest.CaptureFixture) -> None:
    port = free_port()
    assert main(["dashboard", "--port", str(port), "--redis-url", redis_url, "--run", "gpt-demo"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"Dashboard: http://127.0.0.1:{port}/?run=gpt-demo"
    cmd = fake_run[0]["cmd"]
    assert cmd[cmd.index("--logger.hideWelcomeMessage") + 1] == "true"
    assert cmd[cmd.index("--runner.postScriptGC") + 1] == "false"  # no full collection after every fragment run
    fake_run.clear()
    assert main(["dashboard", "--port", str(port), "--redis-url", redis_url, "--run", "bad run"]) == 2
    assert "run='bad run' is not a valid run id" in capsys.readouterr().err and fake_run == []


def test_host_0000_prints_the_warning(fake_run: list, redis_url: str, capsys: pytest.CaptureFixture) -> None:
    port = free_port()
    assert main(["dashboard", "--host", "0.0.0.0", "--port", str(port), "--redis-url", redis_url]) == 0
    out, err = capsys.readouterr()
    assert err == (f"trainhealth dashboard: WARNING: listening on 0.0.0.0:{port} with no login and not read-only: "
                   "anyone who reaches it can add silences, resend dead letters and acknowledge, apply or dismiss "
                   "recommendations. Configure [auth] in .streamlit/secrets.toml, pass --read-only, or keep "
                   "--host 127.0.0.1 behind an authenticating proxy (docs/security.md).\n")
    assert address(fake_run[0]["cmd"]) == "0.0.0.0"
    assert out.splitlines()[1] == f"Dashboard: http://{dashboard_cmd.socket.gethostname()}:{port}/"


def test_host_0000_read_only_has_no_warning_and_tells_the_app(fake_run: list, redis_url: str,
                                                             capsys: pytest.CaptureFixture) -> None:
    port = free_port()
    assert main(["dashboard", "--host", "0.0.0.0", "--port", str(port), "--read-only", "--redis-url",
                 redis_url]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines()[2] == ("Access: no login (changes are recorded as the OS user running it, marked "
                                   "'(no login)'); read-only")
    assert fake_run[0]["env"][READ_ONLY_ENV] == "1" and address(fake_run[0]["cmd"]) == "0.0.0.0"


def test_exposure_warning_only_for_an_unprotected_outside_address() -> None:
    assert [dashboard_cmd.exposure_warning(h, 8501, False, False) is None
            for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "0.0.0.0", "::", "10.1.2.3", "dash.internal")] \
        == [True, True, True, True, False, False, False, False]
    assert dashboard_cmd.exposure_warning("10.1.2.3", 8600, True, False) is None  # read-only
    assert dashboard_cmd.exposure_warning("10.1.2.3", 8600, False, True) is None  # login configured
    assert dashboard_cmd.exposure_warning("10.1.2.3", 8600, False, False).startswith(
        "trainhealth dashboard: WARNING: listening on 10.1.2.3:8600 with no login and not read-only: ")


def test_auth_without_authlib_or_with_a_broken_file_refuses_to_start(fake_run: list, redis_url: str,
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    secrets = tmp_path / "secrets.toml"
    secrets.write_text('[auth]\nredirect_uri = "http://localhost:8501/oauth2callback"\ncookie_secret = "s3cret"\n'
                       'client_id = "id"\nclient_secret = "s3cret"\n'
                       'server_metadata_url = "https://idp.example.com/.well-known/openid-configuration"\n')
    assert main(["dashboard", "--port", str(free_port()), "--redis-url", redis_url]) == 2
    out, err = capsys.readouterr()
    assert err == (f"trainhealth: error: [auth] is set in {secrets}, but Streamlit's login needs Authlib>=1.3.2: "
                   "pip install 'streamlit[auth]'\n")
    secrets.write_text('[auth]\ncookie_secret = "s3cret\n')  # unterminated string
    assert main(["dashboard", "--port", str(free_port()), "--redis-url", redis_url]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"trainhealth: error: {secrets}: cannot read it as TOML (")
    assert err.endswith("); Streamlit would ignore its [auth] and the dashboard would run without a login\n")
    assert "s3cret" not in out + err and not fake_run  # nothing started, no secret shown


def test_incomplete_auth_names_the_missing_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("streamlit.auth_util.is_authlib_installed", lambda: True)
    path = tmp_path / "secrets.toml"
    with pytest.raises(dashboard_cmd.ConfigError) as exc:
        dashboard_cmd.check_auth({"redirect_uri": "http://localhost:8501/oauth2callback"}, path)
    assert str(exc.value) == (f"[auth] in {path} is missing cookie_secret, client_id, client_secret, "
                              "server_metadata_url (the dashboard logs in with the default provider, not an "
                              "[auth.<name>] table); see docs/security.md")
    dashboard_cmd.check_auth(AUTH["auth"], path)  # complete: no error
