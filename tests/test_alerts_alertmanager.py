"""The alertmanager sink against Debian's real Alertmanager (``prometheus-alertmanager``) on loopback: alerts appear
in its API with their labels, annotations and times, are grouped and inhibited by its route and rules (the ones
docs/alerts.md gives), stay active across re-sends, resolve, and expire when nobody re-sends them; basic auth against
its web config; what the worker keeps for it (ForwardState), and secrets kept out of logs."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from trainhealth.alerts.config import AlertsConfig, parse
from trainhealth.alerts.forwarding import Forwarder, ForwardState, alertmanager_sinks
from trainhealth.alerts.inhibition import DEFAULT_RULES
from trainhealth.alerts.intake import Intake
from trainhealth.alerts.notification import Alert
from trainhealth.alerts.sinks.alertmanager import AmAlert, fingerprint
from trainhealth.alerts.watchdog import ServiceCheck, service_down_alert
from trainhealth.alerts.worker import AlertWorker
from trainhealth.embedded_redis import free_port
from trainhealth.keys import ALERTS_OUTBOX, ALERTS_SINKS, RUNS, alerts_forward, run_keys

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "alerts.md").read_text()
#: ``trainhealth`` / ``am-pass-SECRET-7``, bcrypt cost 4, for Alertmanager's ``--web.config.file``.
PASSWORD = "am-pass-SECRET-7"
BCRYPT = "$2b$04$ylknkIuFdvVoZGVqITOUguq8qKEr8N4uYJNRTmp/iXkJDE29./NUm"
DASH = "http://dash:8501"


def iso(t: float) -> str:
    """RFC 3339 with milliseconds, as Alertmanager echoes it (computed here independently of the sink)."""
    return datetime.fromtimestamp(round(t, 3), timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def go(t: float) -> str:
    """As Alertmanager's webhook writes times (Go's RFC 3339 with the fraction's trailing zeros cut)."""
    day, _, frac = iso(t)[:-1].partition(".")
    frac = frac.rstrip("0")
    return f"{day}.{frac}Z" if frac else f"{day}Z"


def doc_block(tag: str) -> str:
    start = DOC.index(f"```{tag}\n") + len(f"```{tag}\n")
    return DOC[start:DOC.index("```", start)]


def am_binary() -> str:
    path = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
    if not os.access(path, os.X_OK):
        pytest.fail("prometheus-alertmanager not found: the alertmanager sink is tested against Debian's real "
                    "Alertmanager; install it with `apt-get install -y --no-install-recommends "
                    "prometheus-alertmanager` (scripts/bootstrap-tests does)")
    return path


class Alertmanager:
    """A real Alertmanager on a free loopback port, clustering off, its storage in a temporary folder."""

    def __init__(self, folder: Path, config: str, web_config: str | None = None) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (folder / "alertmanager.yml").write_text(config)
        self.args = [am_binary(), f"--config.file={folder / 'alertmanager.yml'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=",
                     f"--storage.path={folder / 'data'}"]
        self.auth: tuple[str, str] | None = None
        if web_config is not None:
            (folder / "web.yml").write_text(web_config)
            self.args.append(f"--web.config.file={folder / 'web.yml'}")
            self.auth = ("trainhealth", PASSWORD)
        self.log = folder / "alertmanager.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/-/ready", auth=self.auth, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"alertmanager did not start on {self.url}:\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def get(self, path: str, **params: Any) -> Any:
        resp = httpx.get(f"{self.url}/api/v2{path}", params=params, auth=self.auth, timeout=5)
        resp.raise_for_status()
        return resp.json()

    def alerts(self) -> dict[str, dict[str, Any]]:
        """Alertmanager's alerts by their ``anomaly`` label (severity added for the escalated one), without
        ``updatedAt`` (its receive time)."""
        out = {}
        for a in self.get("/alerts"):
            a.pop("updatedAt")
            out[f"{a['labels']['anomaly']}/{a['labels']['severity']}"] = a
        return out


def am_config(receiver: HTTPServer) -> str:
    """docs/alerts.md's Alertmanager config, its webhooks pointed at ``receiver`` and its timers at 1 s."""
    text = doc_block("yaml alertmanager-example")
    for old, new in (("http://alert-bridge.example:9000", receiver.url_for("").rstrip("/")),
                     ("group_wait: 30s", "group_wait: 1s"), ("group_interval: 5m", "group_interval: 1s")):
        assert old in text
        text = text.replace(old, new)
    return text


@pytest.fixture
def receiver(httpserver: HTTPServer) -> HTTPServer:
    """The webhook receiver Alertmanager notifies (``/ml-oncall``, ``/ml-pager``)."""
    httpserver.expect_request("/ml-oncall", method="POST").respond_with_data("ok")
    httpserver.expect_request("/ml-pager", method="POST").respond_with_data("ok")
    return httpserver


@pytest.fixture
def alertmanager(tmp_path: Path, receiver: HTTPServer) -> Iterator[Alertmanager]:
    am = Alertmanager(tmp_path, am_config(receiver))
    am.start()
    yield am
    am.stop()


def notified(server: HTTPServer) -> list[tuple[str, dict[str, Any]]]:
    """(path, JSON body) of every webhook Alertmanager sent, in order."""
    return [(req.path, json.loads(req.get_data())) for req, _ in server.log]


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t

    def now(self) -> float:
        self.t = time.time()
        return self.t


def anomaly(run: str, kind: str, step: int, ranks: tuple[int, ...], severity: str, first: float,
            status: str = "active", end_step: int | None = None, last: float | None = None,
            scope: str | None = None, **extra: Any) -> dict[str, Any]:
    who = scope or ("-".join(map(str, ranks)) or "*")
    return {"id": f"{kind}:{who}:{step}:0", "run": run, "kind": kind, "severity": severity, "status": status,
            "step": step, "end_step": end_step, "ranks": list(ranks), "hosts": [f"node-{r}" for r in ranks],
            "evidence": {"score": round(0.5 + step / 10000, 4)}, "message": f"{kind} since step {step}",
            "first_seen": first, "last_seen": first if last is None else last, **extra}


def log(r: redis.Redis, transition: str, a: dict[str, Any]) -> None:
    """An anomaly_log entry as the detector service writes it (docs/architecture.md)."""
    r.zadd(RUNS, {a["run"]: a["first_seen"] - 3600}, nx=True)
    r.xadd(run_keys(a["run"]).anomaly_log, {"id": a["id"], "transition": transition, "kind": a["kind"],
                                            "severity": a["severity"], "step": a["step"],
                                            "json": json.dumps(a, sort_keys=True)})


def config(url: str, **sink: Any) -> AlertsConfig:
    return parse({"dashboard_url": DASH, "route": {"receivers": ["am"]},
                  "sinks": {"am": {"type": "alertmanager", "url": url, "resend_interval": 1, "timeout": 5,
                                   "labels": {"team": "ml-infra"}, **sink}},
                  "delivery": {"backoff_base": "1s", "jitter": 0}}, "test.toml")


def forwarded(r: redis.Redis, sink: str = "am") -> dict[str, AmAlert]:
    return {k.decode(): AmAlert.from_json(v) for k, v in r.hgetall(alerts_forward(sink)).items()}


def test_alerts_reach_alertmanager_grouped_inhibited_kept_alive_by_resends_resolved_and_expire(
        r: redis.Redis, alertmanager: Alertmanager, receiver: HTTPServer, wait_for) -> None:
    clock = Clock()
    cfg = config(alertmanager.url)
    intake = Intake(r, cfg, consumer="w1", clock=clock)
    fwd = Forwarder(r, alertmanager_sinks(cfg), cfg.delivery, clock=clock, rand=lambda: 0.0)
    intake.on_forward = fwd.wake.set  # as the worker wires them

    def keep_sending(pred=lambda: True, seconds: float = 0.0, what: str = "") -> None:
        """Re-send as the worker would (every resend interval) until ``pred()`` and ``seconds`` have passed."""
        stop = time.monotonic() + seconds
        deadline = time.monotonic() + 15
        while not (pred() and time.monotonic() >= stop):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            clock.now()
            fwd.run_once()
            time.sleep(0.2)

    # Onsets within Alertmanager's group_wait (1 s here) of the send: an older alert is flushed at once, before
    # the inhibitor has seen its source (Alertmanager's own behaviour for alerts that arrive late).
    t0 = round(clock.now() - 0.6, 1)
    rec = {"id": "rec:loss_spike:*:400:0", "action": "wait", "checkpoint_step": 300}
    a = anomaly("llama", "straggler", 250, (5,), "warning", t0)
    b = anomaly("llama", "straggler", 260, (6,), "warning", t0 + 0.1)
    c = anomaly("llama", "loss_spike", 400, (), "warning", t0 + 0.2, recommendation=rec)
    d = anomaly("other", "dead_rank", 500, (3,), "critical", t0 + 0.3, scope="*")
    e = anomaly("other", "hang", 500, (0, 1, 2), "critical", t0 + 0.4, scope="*")
    f = anomaly("third", "straggler", 90, (1,), "warning", t0 + 0.5)
    for x in (a, b, c, d, e, f):
        log(r, "opened", x)
    intake.run_once()
    assert r.xlen(ALERTS_OUTBOX) == 0  # the worker's grouped notifications are not for Alertmanager, which groups
    clock.now()
    assert fwd.run_once() == 1  # one POST, at once (no group_wait of the worker's)
    sent_at = clock.t

    # In Alertmanager's API: the labels, annotations, onset and validity (4 resend intervals) sent.
    got = alertmanager.alerts()
    assert sorted(got) == ["dead_rank:*:500:0/critical", "hang:*:500:0/critical", "loss_spike:*:400:0/warning",
                           "straggler:1:90:0/warning", "straggler:5:250:0/warning", "straggler:6:260:0/warning"]
    labels_a = {"alertname": "straggler", "run": "llama", "severity": "warning", "anomaly": "straggler:5:250:0",
                "rank": "5", "host": "node-5", "team": "ml-infra"}
    assert got["straggler:5:250:0/warning"] == {
        "labels": labels_a,
        "annotations": {"summary": "straggler in run llama: rank 5 on node-5, from step 250",
                        "description": "straggler since step 250",
                        "dashboard": f"{DASH}/anomalies?run=llama&step=250&rank=5", "steps": "from step 250",
                        "ranks": "5", "hosts": "node-5", "evidence": "score=0.525"},
        "startsAt": iso(t0), "endsAt": iso(sent_at + 4), "generatorURL": f"{DASH}/anomalies?run=llama&step=250&rank=5",
        "fingerprint": fingerprint(labels_a), "receivers": [{"name": "ml-oncall"}],
        "status": {"state": "active", "silencedBy": [], "inhibitedBy": []}}
    assert got["loss_spike:*:400:0/warning"]["labels"] == {
        "alertname": "loss_spike", "run": "llama", "severity": "warning", "anomaly": "loss_spike:*:400:0",
        "team": "ml-infra"}  # a job-wide anomaly: no rank, no host label
    assert got["loss_spike:*:400:0/warning"]["annotations"] == {
        "summary": "loss_spike in run llama: all ranks, from step 400", "description": "loss_spike since step 400",
        "recommendation": "Wait: the loss spike may still recover; if it does not, roll back to the checkpoint of "
                          "step 300", "dashboard": f"{DASH}/anomalies?run=llama&step=400", "steps": "from step 400",
        "evidence": "score=0.54"}
    # what the worker keeps is keyed by Alertmanager's own fingerprints
    assert sorted(forwarded(r)) == sorted(x["fingerprint"] for x in got.values())

    # Grouped by the documented route (run, alertname; criticals to the pager), and inhibited by its rules: the
    # hang waits on the dead rank.
    fp_d = got["dead_rank:*:500:0/critical"]["fingerprint"]
    wait_for(lambda: alertmanager.alerts()["hang:*:500:0/critical"]["status"] == {
        "state": "suppressed", "silencedBy": [], "inhibitedBy": [fp_d]}, 10, "the hang inhibited by the dead rank")
    groups = sorted((g["labels"]["run"], g["labels"]["alertname"], g["receiver"]["name"],
                     sorted(x["labels"]["anomaly"] for x in g["alerts"])) for g in alertmanager.get("/alerts/groups"))
    assert groups == [("llama", "loss_spike", "ml-oncall", ["loss_spike:*:400:0"]),
                      ("llama", "straggler", "ml-oncall", ["straggler:5:250:0", "straggler:6:260:0"]),
                      ("other", "dead_rank", "ml-pager", ["dead_rank:*:500:0"]),
                      ("other", "hang", "ml-pager", ["hang:*:500:0"]),
                      ("third", "straggler", "ml-oncall", ["straggler:1:90:0"])]
    keep_sending(lambda: len(notified(receiver)) >= 4, 1.5, "Alertmanager's first notifications")
    # (and nothing more comes: the hang is inhibited)
    first = notified(receiver)
    assert sorted((p, n["groupKey"], n["status"]) for p, n in first) == [
        ("/ml-oncall", '{}:{alertname="loss_spike", run="llama"}', "firing"),
        ("/ml-oncall", '{}:{alertname="straggler", run="llama"}', "firing"),
        ("/ml-oncall", '{}:{alertname="straggler", run="third"}', "firing"),
        ("/ml-pager", '{}/{severity="critical"}:{alertname="dead_rank", run="other"}', "firing")]
    strag = next(n for _, n in first if n["groupKey"] == '{}:{alertname="straggler", run="llama"}')
    assert (strag["receiver"], strag["groupLabels"], strag["commonLabels"], strag["truncatedAlerts"]) == (
        "ml-oncall", {"alertname": "straggler", "run": "llama"},
        {"alertname": "straggler", "run": "llama", "severity": "warning", "team": "ml-infra"}, 0)
    assert [(x["status"], x["labels"]["anomaly"], x["startsAt"], x["endsAt"], x["generatorURL"])
            for x in sorted(strag["alerts"], key=lambda x: x["labels"]["anomaly"])] == [
        ("firing", "straggler:5:250:0", go(t0), "0001-01-01T00:00:00Z", f"{DASH}/anomalies?run=llama&step=250&rank=5"),
        ("firing", "straggler:6:260:0", go(t0 + 0.1), "0001-01-01T00:00:00Z",
         f"{DASH}/anomalies?run=llama&step=260&rank=6")]

    # Re-sent every second for 6 s, longer than one send's validity (4 s): still active, the onset kept, the
    # validity moved on, and Alertmanager notifies nobody again.
    keep_sending(seconds=6.0)
    last_sync = fwd.next_at["am"] - 1.0
    got = alertmanager.alerts()
    assert len(got) == 6 and {x["status"]["state"] for k, x in got.items() if not k.startswith("hang")} == {"active"}
    assert got["straggler:5:250:0/warning"]["startsAt"] == iso(t0)
    assert {x["endsAt"] for x in got.values()} == {iso(last_sync + 4)}
    assert len(notified(receiver)) == 4

    # Resolved: the two stragglers end (endsAt = when they ended); the loss spike escalates to critical: a new
    # alert for the pager, the warning one resolved.
    clock.now()
    ended = round(clock.t) - 2.0
    log(r, "resolved", {**a, "status": "resolved", "end_step": 800, "last_seen": ended})
    log(r, "resolved", {**b, "status": "resolved", "end_step": 810, "last_seen": ended + 0.5})
    log(r, "updated", {**c, "severity": "critical", "last_seen": clock.t - 1})
    intake.run_once()
    assert fwd.run_once() == 1
    escalated_at = clock.t - 1  # the update's last_seen
    keep_sending(lambda: len(notified(receiver)) >= 7, 1.5, "the resolved and escalated notifications")
    later = notified(receiver)[4:]
    assert sorted((p, n["groupKey"], n["status"], sorted((x["labels"]["severity"], x["status"], x["endsAt"])
                                                         for x in n["alerts"])) for p, n in later) == [
        ("/ml-oncall", '{}:{alertname="loss_spike", run="llama"}', "resolved",
         [("warning", "resolved", go(escalated_at))]),
        ("/ml-oncall", '{}:{alertname="straggler", run="llama"}', "resolved",
         sorted([("warning", "resolved", go(ended)), ("warning", "resolved", go(ended + 0.5))])),
        ("/ml-pager", '{}/{severity="critical"}:{alertname="loss_spike", run="llama"}', "firing",
         [("critical", "firing", "0001-01-01T00:00:00Z")])]
    # the closed alerts were told and leave the worker's state; the firing ones stay
    assert sorted(x.labels["anomaly"] + "/" + x.labels["severity"] for x in forwarded(r).values()) == [
        "dead_rank:*:500:0/critical", "hang:*:500:0/critical", "loss_spike:*:400:0/critical",
        "straggler:1:90:0/warning"]

    # A worker that stops sending: Alertmanager resolves its alerts by itself 4 intervals after the last send.
    last_sync = fwd.next_at["am"] - 1.0
    wait_for(lambda: any(n["groupKey"] == '{}:{alertname="straggler", run="third"}' and n["status"] == "resolved"
                         for _, n in notified(receiver)), 12, "the unsent straggler expiring")
    expired = next(n for _, n in notified(receiver)
                   if n["groupKey"] == '{}:{alertname="straggler", run="third"}' and n["status"] == "resolved")
    assert [x["endsAt"] for x in expired["alerts"]] == [go(last_sync + 4)]
    assert time.time() >= last_sync + 4


def test_the_worker_forwards_within_a_second_and_its_notifications_skip_the_alertmanager_sink(
        r: redis.Redis, alertmanager: Alertmanager, receiver: HTTPServer, wait_for,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TH_TEST_WEBHOOK_SECRET", "whsec-am")
    cfg = parse({"dashboard_url": DASH, "route": {"receivers": ["am", "bot"]},
                 "sinks": {"am": {"type": "alertmanager", "url": alertmanager.url, "resend_interval": 1},
                           "bot": {"type": "webhook", "url": receiver.url_for("/bot"),
                                   "secret_env": "TH_TEST_WEBHOOK_SECRET"}}}, "test.toml")
    worker = AlertWorker(r, cfg, consumer="w-am", block_ms=200)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        wait_for(lambda: worker.is_leader and worker.forwarder.ready, 10, "the worker to lead")
        t0 = time.time()
        a = anomaly("llama", "straggler", 250, (5,), "warning", t0)
        log(r, "opened", a)
        wait_for(lambda: alertmanager.get("/alerts"), 5, "the alert in Alertmanager")
        took = time.time() - t0
        assert took < 3.0, took  # at once, not after the worker's 30 s group_wait
        assert r.xlen(ALERTS_OUTBOX) == 0  # the worker's own notification is due only after its group_wait
        # (a resolve before Alertmanager's first notification would never be notified: its group_wait drops it)
        wait_for(lambda: notified(receiver), 10, "Alertmanager's firing notification")
        log(r, "resolved", {**a, "status": "resolved", "end_step": 300, "last_seen": time.time()})
        wait_for(lambda: any(n["status"] == "resolved" for _, n in notified(receiver)), 10,
                 "Alertmanager's resolved notification")
        assert r.hlen(alerts_forward("am")) == 0
    finally:
        worker.stop()
        thread.join(20)
    assert not thread.is_alive()
    # the heartbeat's counters and the sink state doctor reads
    st = json.loads(r.hget(ALERTS_SINKS, "am"))
    assert (st["type"], st["consecutive_failures"], st["last_status"]) == ("alertmanager", 0, 200)


def test_basic_auth_against_alertmanagers_web_config_and_the_password_never_logged(
        tmp_path: Path, receiver: HTTPServer, r: redis.Redis, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.DEBUG)
    am = Alertmanager(tmp_path, am_config(receiver), web_config=f"basic_auth_users:\n  trainhealth: {BCRYPT}\n")
    am.start()
    try:
        clock = Clock()
        monkeypatch.setenv("TH_AM_PASSWORD", PASSWORD)
        good = config(am.url, username="trainhealth", password_env="TH_AM_PASSWORD")
        intake = Intake(r, good, consumer="w1", clock=clock)
        log(r, "opened", anomaly("llama", "straggler", 250, (5,), "warning", clock.now() - 5))
        intake.run_once()
        fwd = Forwarder(r, alertmanager_sinks(good), good.delivery, clock=clock, rand=lambda: 0.0)
        assert fwd.run_once() == 1 and fwd.failures["am"] == 0
        assert list(am.alerts()) == ["straggler:5:250:0/warning"]
        # a wrong password: refused, reported, retried after the backoff; the password nowhere
        monkeypatch.setenv("TH_AM_PASSWORD", "wrong-SECRET-pw")
        bad = config(am.url, username="trainhealth", password_env="TH_AM_PASSWORD")
        fwd = Forwarder(r, alertmanager_sinks(bad), bad.delivery, clock=clock, rand=lambda: 0.0)
        assert fwd.run_once() == 1
        st = json.loads(r.hget(ALERTS_SINKS, "am"))
        assert (st["consecutive_failures"], st["last_status"], st["last_error"]) == (1, 401, "HTTP 401: Unauthorized")
        assert fwd.next_at["am"] == clock.t + 1.0  # backoff_base, no jitter
        assert fwd.run_once() == 0  # backing off
        described = bad.describe()
        assert "password from env TH_AM_PASSWORD" in described
        for text in (caplog.text, described, json.dumps(st), (tmp_path / "alertmanager.log").read_text()):
            for secret in ("wrong-SECRET-pw", PASSWORD, base64.b64encode(b"trainhealth:wrong-SECRET-pw").decode(),
                           base64.b64encode(f"trainhealth:{PASSWORD}".encode()).decode()):
                assert secret not in text
        assert "sending 1 alert to Alertmanager failed (HTTP 401: Unauthorized; 1 in a row); next try in 1.0 s" in \
            caplog.text
    finally:
        am.stop()


def test_a_bearer_token_is_sent_and_scrubbed_from_errors_that_echo_it(
        httpserver: HTTPServer, r: redis.Redis, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.DEBUG)
    token = "tok-SECRET-4242"
    seen: list[str | None] = []

    def echo(req: Request) -> Response:  # a misbehaving proxy that quotes the request's credentials
        seen.append(req.headers.get("Authorization"))
        return Response(f"denied: {req.headers.get('Authorization')} ({token})", status=503,
                        headers={"Retry-After": "7"})

    httpserver.expect_request("/api/v2/alerts", method="POST").respond_with_handler(echo)
    monkeypatch.setenv("TH_AM_TOKEN", token)
    cfg = config(httpserver.url_for("/"), bearer_token_env="TH_AM_TOKEN")
    clock = Clock()
    intake = Intake(r, cfg, consumer="w1", clock=clock)
    log(r, "opened", anomaly("llama", "hang", 500, (0,), "critical", clock.now() - 5, scope="*"))
    intake.run_once()
    fwd = Forwarder(r, alertmanager_sinks(cfg), cfg.delivery, clock=clock, rand=lambda: 0.0)
    assert fwd.run_once() == 1
    assert seen == [f"Bearer {token}"]
    st = json.loads(r.hget(ALERTS_SINKS, "am"))
    assert (st["last_status"], st["last_error"]) == (503, "HTTP 503: denied: Bearer *** (***)")
    assert fwd.next_at["am"] == clock.t + 7.0  # Retry-After
    assert token not in caplog.text and token not in json.dumps(st)
    assert r.hlen(alerts_forward("am")) == 1  # nothing lost: the next sync sends it


def test_forward_state_labels_escalation_routes_and_runs_over() -> None:
    cfg = parse({"dashboard_url": DASH,
                 "route": {"receivers": [], "routes": [{"matchers": ['severity="critical"'], "receivers": ["am"]}]},
                 "sinks": {"am": {"type": "alertmanager", "url": "http://am:9093"}}}, "t.toml")
    st = ForwardState(cfg.route, alertmanager_sinks(cfg), DASH)
    hang = anomaly("llama", "hang", 500, (3,), "critical", 100.0, scope="*")
    st.observe(Alert.from_transition("llama", "opened", hang), 100.0)
    (am,) = st.firing["am"].values()
    assert am.labels == {"alertname": "hang", "run": "llama", "severity": "critical", "anomaly": "hang:*:500:0",
                         "rank": "3", "host": "node-3"}
    assert (am.starts_at, am.ends_at, am.generator_url) == (100.0, None,
                                                            f"{DASH}/anomalies?run=llama&step=500&rank=3")
    # the hang spreads to 12 ranks: labels kept (another label set would be another alert), annotations follow
    grown = {**hang, "ranks": list(range(12)), "hosts": [f"node-{i}" for i in range(12)], "last_seen": 110.0}
    st.observe(Alert.from_transition("llama", "updated", grown), 110.0)
    (am2,) = st.firing["am"].values()
    assert am2.labels == am.labels and am2.fp == am.fp and am2.annotations["ranks"] == "0,1,2,3,4,5,6,7,8,9,10,11"
    assert "rank" not in st._alert(Alert.from_transition("llama", "opened", grown), st.sinks["am"], None, 0).labels
    writes = dict(st._writes)
    assert st.pending == 1 and list(writes) == [("am", am.fp)]
    # a warning is not routed to the sink; escalated, it is; back down to warning it is routed away: closed
    spike = anomaly("llama", "loss_spike", 400, (), "warning", 120.0)
    st.observe(Alert.from_transition("llama", "opened", spike), 120.0)
    assert len(st.firing["am"]) == 1
    st.observe(Alert.from_transition("llama", "updated", {**spike, "severity": "critical"}), 130.0)
    crit = st.firing["am"]["llama/loss_spike:*:400:0"]
    assert (crit.labels["severity"], crit.starts_at) == ("critical", 120.0)
    st.observe(Alert.from_transition("llama", "updated", {**spike, "last_seen": 140.0}), 140.0)
    assert "llama/loss_spike:*:400:0" not in st.firing["am"]
    assert (st._writes[("am", crit.fp)].ends_at, st._writes[("am", crit.fp)].closed_at) == (140.0, 140.0)
    # the run is over: its firing alerts are closed, and not forwarded again while it is
    st.close_runs(["llama"], 150.0)
    assert st.firing["am"] == {} and st._writes[("am", am.fp)].ends_at == 150.0
    st.observe(Alert.from_transition("llama", "updated", grown), 160.0, over=True)
    assert st.firing["am"] == {}
    # a point event is sent valid for 4 resend intervals; a stale one is dropped
    st._writes.clear()
    restart = anomaly("llama", "restart", 700, (), "critical", 200.0, status="resolved", end_step=700)
    st.observe(Alert.from_transition("llama", "opened", restart), 200.0, stale=True)
    assert st.pending == 0
    st.observe(Alert.from_transition("llama", "opened", restart), 200.0)
    ((_, point),) = st._writes.items()
    assert (point.starts_at, point.ends_at, point.closed_at) == (200.0, 440.0, 200.0)
    # the worker's own service_down alert: run "*", no dashboard link
    down = service_down_alert(ServiceCheck(True, None, ("llama",)), 300.0)
    st.observe(down, 300.0)
    sd = st.firing["am"]["*/service_down:*:0:0"]
    assert sd.labels == {"alertname": "service_down", "run": "*", "severity": "critical",
                         "anomaly": "service_down:*:0:0"}
    assert sd.generator_url == "" and "dashboard" not in sd.annotations
    assert sd.annotations["summary"].startswith("Anomaly detection is down: no detector service heartbeat at all")


def test_forwarder_drops_expired_closed_alerts_and_keeps_one_the_intake_rewrote(
        httpserver: HTTPServer, r: redis.Redis) -> None:
    bodies: list[list[dict[str, Any]]] = []

    def ok(req: Request) -> Response:
        bodies.append(json.loads(req.get_data()))
        return Response("", status=200)

    httpserver.expect_request("/api/v2/alerts", method="POST").respond_with_handler(ok)
    cfg = config(httpserver.url_for("/"))
    sink = cfg.sinks["am"]
    labels = {"alertname": "straggler", "run": "r", "severity": "warning"}
    expired = AmAlert("r/x", {**labels, "anomaly": "x"}, {}, 100.0, ends_at=150.0, closed_at=150.0)  # 4 s ago+
    closed = AmAlert("r/y", {**labels, "anomaly": "y"}, {}, 100.0, ends_at=190.0, closed_at=195.0)
    firing = AmAlert("r/z", {**labels, "anomaly": "z"}, {"summary": "z"}, 100.0)
    key = alerts_forward("am")
    for am in (expired, closed, firing):
        r.hset(key, am.fp, am.to_json())
    clock = Clock()
    clock.t = 197.0
    fwd = Forwarder(r, {"am": sink}, cfg.delivery, clock=clock)
    assert fwd.run_once() == 1
    assert bodies == [sorted([
        {"labels": closed.labels, "annotations": {}, "startsAt": iso(100.0), "endsAt": iso(190.0)},
        {"labels": firing.labels, "annotations": {"summary": "z"}, "startsAt": iso(100.0), "endsAt": iso(201.0)}],
        key=lambda x: fingerprint(x["labels"]))]
    assert sorted(forwarded(r)) == [firing.fp]
    # a wake-up (the intake wrote a change) sends only what changed; the resend interval everything again
    other = AmAlert("r/w", {**labels, "anomaly": "w"}, {}, 100.0)
    r.hset(key, other.fp, other.to_json())
    fwd.wake.set()
    assert fwd.run_once() == 1 and [x["labels"]["anomaly"] for x in bodies[-1]] == ["w"]
    fwd.wake.set()
    assert fwd.run_once() == 0 and len(bodies) == 2
    clock.t = fwd.next_at["am"]
    assert fwd.run_once() == 1 and sorted(x["labels"]["anomaly"] for x in bodies[-1]) == ["w", "z"]
    assert {x["endsAt"] for x in bodies[-1]} == {iso(clock.t + 4)}
    # nothing to tell: the periodic sync still checks the way there (an empty list), a wake-up does not
    r.delete(key)
    fwd.wake.set()
    assert fwd.run_once() == 0
    clock.t = fwd.next_at["am"]
    assert fwd.run_once() == 1 and bodies[-1] == [] and len(bodies) == 4
    assert json.loads(r.hget(ALERTS_SINKS, "am"))["delivered"] == 4
    # a closed alert the intake rewrites (it fires again) while a sync is under way is not deleted by that sync
    reopened = AmAlert("r/y", closed.labels, {}, 100.0)
    r.hset(key, closed.fp, reopened.to_json())
    fwd._delete(keys=[key], args=[closed.fp, closed.to_json()])
    assert forwarded(r)[closed.fp] == reopened


def test_the_documented_alertmanager_config_has_the_workers_built_in_inhibition_and_passes_amtool(
        tmp_path: Path) -> None:
    text = doc_block("yaml alertmanager-example")
    rules = text[text.index("inhibit_rules:\n") + len("inhibit_rules:\n"):]
    expected = "".join(
        f"  - source_matchers: [{', '.join(str(m).replace('kind', 'alertname', 1) for m in rule.source_matchers)}]\n"
        f"    target_matchers: [{', '.join(str(m).replace('kind', 'alertname', 1) for m in rule.target_matchers)}]\n"
        f"    equal: [{', '.join(rule.equal)}]\n" for rule in DEFAULT_RULES)
    assert rules == expected
    amtool = shutil.which("amtool") or "/usr/bin/amtool"
    if not os.access(amtool, os.X_OK):
        pytest.fail("amtool not found: it comes with Debian's prometheus-alertmanager (scripts/bootstrap-tests)")
    (tmp_path / "am.yml").write_text(text)
    out = subprocess.run([amtool, "check-config", str(tmp_path / "am.yml")], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and "SUCCESS" in out.stdout and "5 inhibit rules" in out.stdout, out.stdout + out.stderr


def test_intake_forwards_stale_active_alerts_but_not_runs_that_are_over_nor_stale_point_events(
        r: redis.Redis) -> None:
    """The catch-up window is the worker's own paging policy: Alertmanager is told what is active, however old
    the transition, but not the alerts of a run that is over (closed once it is found over) nor a stale restart."""
    sec, usec = r.time()
    hour_ago = sec + usec / 1e6 - 3600

    def old(transition: str, a: dict[str, Any]) -> None:
        stream = run_keys(a["run"]).anomaly_log
        r.zadd(RUNS, {a["run"]: a["first_seen"]}, nx=True)
        r.xadd(stream, {"id": a["id"], "transition": transition, "kind": a["kind"], "severity": a["severity"],
                        "step": a["step"], "json": json.dumps(a, sort_keys=True)},
               id=f"{int(hour_ago * 1000)}-{r.xlen(stream)}")

    t = 1_800_000_000.0
    old("opened", anomaly("live", "divergence", 700, (), "critical", t))
    old("opened", anomaly("live", "restart", 720, (), "warning", t, status="resolved", end_step=720))
    old("opened", anomaly("done", "divergence", 700, (), "critical", t))
    r.hset(run_keys("done").meta, "status", "finished")
    clock = Clock()
    clock.t = t + 60
    intake = Intake(r, config("http://127.0.0.1:9"), consumer="w1", clock=clock)
    intake.run_once()
    assert intake.stale == 3 and intake.grouper.ended_runs == frozenset({"done"})
    (am,) = forwarded(r).values()
    assert (am.key, am.labels["severity"], am.starts_at, am.ends_at) == ("live/divergence:*:700:0", "critical", t,
                                                                        None)
    # the live run ends: found over at the next check, its divergence is closed (resolved in Alertmanager)
    r.hset(run_keys("live").meta, "status", "finished")
    clock.t += 11
    intake.run_once()
    (closed,) = forwarded(r).values()
    assert (closed.fp, closed.ends_at, closed.closed_at) == (am.fp, t + 71, t + 71)
    assert intake.forward.firing == {"am": {}}
