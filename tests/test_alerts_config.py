"""The alerting config: the documented example loads, and every error names the file, the key and the value
(never a secret's value)."""

from __future__ import annotations

import copy
import logging
import textwrap
from pathlib import Path

import pytest

from trainhealth.alerts.config import load, parse
from trainhealth.alerts.inhibition import DEFAULT_RULES
from trainhealth.alerts.secrets import Secret, redact
from trainhealth.exceptions import ConfigError
from trainhealth.text import parse_duration

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "alerts.example.toml"
SLACK_URL = "https://hooks.slack.com/services/T000/B000/SECRETSECRET"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("TH_SLACK_WEBHOOK_URL", SLACK_URL)
    monkeypatch.setenv("TH_WEBHOOK_SECRET", "whsec-123")
    monkeypatch.setenv("TH_PAGERDUTY_ROUTING_KEY", "R" * 32)
    monkeypatch.setenv("TH_DEADMAN_URL", "https://hc-ping.com/abc-uuid")
    return tmp_path


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "alerts.toml"
    p.write_text(textwrap.dedent(text))
    return p


MINIMAL = """
    [route]
    receivers = ["s"]
    [sinks.s]
    type = "slack"
    url_env = "TH_SLACK_WEBHOOK_URL"
"""


def test_the_documented_example_loads_with_its_routes_sinks_and_secrets(env: Path, tmp_path: Path) -> None:
    secret_file = tmp_path / "slack-ml"
    secret_file.write_text("https://hooks.slack.com/services/T1/B1/FILESECRET\n")
    text = EXAMPLE.read_text().replace("/run/secrets/slack-ml-webhook", str(secret_file))
    cfg = load(write(tmp_path, text))
    assert [r.id for r in cfg.route.walk()] == ["root", "archive", "page", "restarts", "default"]
    page = cfg.route.routes[1]
    assert (page.receivers, page.timers.group_wait, page.timers.group_interval, page.timers.repeat_interval) == (
        ("pagerduty", "oncall-slack"), 10.0, 300.0, 3600.0)
    assert cfg.route.timers.group_wait == 30.0 and cfg.route.routes[0].group_by == ("...",)
    assert sorted(cfg.sinks) == ["incident-bot", "ml-slack", "oncall-slack", "pagerduty"]
    assert cfg.sinks["ml-slack"].url.reveal() == "https://hooks.slack.com/services/T1/B1/FILESECRET"
    assert cfg.sinks["oncall-slack"].url.reveal() == SLACK_URL
    assert cfg.sinks["pagerduty"].url.reveal() == "https://events.pagerduty.com/v2/enqueue"
    assert cfg.sinks["incident-bot"].timeout == 5.0
    assert cfg.inhibit_rules == DEFAULT_RULES  # the example spells out the built-in rules
    assert (cfg.delivery.max_attempts, cfg.delivery.backoff_max, cfg.delivery.jitter) == (12, 300.0, 0.5)
    assert cfg.deadman is not None and cfg.deadman.interval == 60.0
    described = cfg.describe()
    for secret in (SLACK_URL, "whsec-123", "R" * 32, "FILESECRET", "abc-uuid"):
        assert secret not in described
    assert "url from env TH_SLACK_WEBHOOK_URL" in described and "routing_key from env TH_PAGERDUTY_ROUTING_KEY" in \
        described


def test_defaults_are_alertmanagers(env: Path) -> None:
    cfg = load(write(env, MINIMAL))
    t = cfg.route.timers
    assert (t.group_wait, t.group_interval, t.repeat_interval) == (30.0, 300.0, 14400.0)
    assert cfg.route.group_by == ("run", "kind") and cfg.inhibit_rules == DEFAULT_RULES
    assert cfg.sinks["s"].send_resolved is True and cfg.sinks["s"].timeout == 10.0
    assert load(write(env, "inhibit_rules = []\n" + MINIMAL)).inhibit_rules == ()


@pytest.mark.parametrize(("toml", "message"), [
    ('[route]\nreceivers = ["s"]\ngroup_wait = "30x"\n[sinks.s]\ntype = "slack"\nurl_env = "TH_SLACK_WEBHOOK_URL"',
     'route.group_wait = "30x": not a duration (use e.g. 30s, 5m, 4h, 1h30m, 1d, or a number of seconds)'),
    ('[route]\nreceivers = ["nope"]\n',
     'route.receivers[0] = "nope": no sink of this name (sinks: none)'),
    ('[route]\nreceivers = []\ngroup_by = ["run", "node"]\n',
     'route.group_by[1] = "node": not an alert label (labels: run, kind, severity, rank, host; '
     'or ["..."] for one group per anomaly)'),
    ('[route]\nreceivers = []\n[[route.routes]]\nmatchers = [\'kind="stragler"\']\n',
     "route.routes[0].matchers[0] = \"kind=\\\"stragler\\\"\": kind 'stragler' is unknown (kinds: nan_inf, "
     "skipped_steps, loss_spike, grad_norm_spike, divergence, grad_norm_explosion, straggler, slow_node, "
     "rank_outlier, hang, dead_rank, throughput_drop, slow_step, restart, restart_storm, loss_collapse, plateau, "
     "memory_growth, network_slow, memory_imbalance, data_loss, service_down)"),
    ('[route]\nreceivers = []\n[[route.routes]]\nmatchers = [\'severity="high"\']\n',
     "route.routes[0].matchers[0] = \"severity=\\\"high\\\"\": severity 'high' is unknown (severities: info, "
     "warning, critical)"),
    ('[route]\nreceivers = []\n[[route.routes]]\nmatchers = [\'run=~"(unclosed"\']\n',
     "route.routes[0].matchers[0] = \"run=~\\\"(unclosed\\\"\": '(unclosed' is not a valid regular expression: "
     "missing ), unterminated subpattern at position 0"),
    ('[route]\nreceivers = []\ngroup_interval = 0\n', "route.group_interval = 0: must be > 0 s"),
    ('[route]\nreceivers = []\ngroup_wait = inf\n',
     "route.group_wait = inf: not a duration (use e.g. 30s, 5m, 4h, 1h30m, 1d, or a number of seconds)"),
    ('[route]\nreceivers = []\nrepeat_interval = "99999999999999999999d"\n',
     'route.repeat_interval = "99999999999999999999d": must be at most 366 days'),
    ('[route]\nreceivers = []\nfoo = 1\n',
     "route.foo: unknown key (expected one of: name, receivers, group_by, group_wait, group_interval, "
     "repeat_interval, routes)"),
    ('[route]\nreceivers = []\n[sinks.s]\ntype = "sms"\n', 'sinks.s.type = "sms": must be one of slack, webhook, '
     'pagerduty, alertmanager'),
    ('[route]\nreceivers = []\n[sinks.s]\ntype = "slack"\n',
     "sinks.s: missing url_env (environment variable) or url_file (file holding it)"),
    ('[route]\nreceivers = []\n[sinks.s]\ntype = "webhook"\nurl = "ftp://x/y"\nsecret_env = "TH_WEBHOOK_SECRET"\n',
     'sinks.s.url = "ftp://x/y": not an http:// or https:// URL'),
    ('[route]\nreceivers = []\n[sinks.s]\ntype = "webhook"\nurl = "https://x/y"\n',
     "sinks.s: missing secret_env (environment variable) or secret_file (file holding it)"),
    ('[route]\nreceivers = []\n[sinks.s]\ntype = "slack"\nurl_env = "TH_SLACK_WEBHOOK_URL"\nmax_alerts = 9\n',
     "sinks.s.max_alerts = 9: must be an integer from 1 to 7 (Slack allows 50 blocks)"),
    ('[route]\nreceivers = []\n[sinks.s]\ntype = "slack"\nurl_env = "TH_SLACK_WEBHOOK_URL"\nsend_resolved = "yes"\n',
     'sinks.s.send_resolved = "yes": must be true or false'),
    ('[route]\nreceivers = []\n[delivery]\njitter = 2\n',
     "delivery.jitter = 2: must be a number from 0 (none) to 1 (full jitter)"),
    ('[route]\nreceivers = []\n[delivery]\nbackoff_base = "10s"\nbackoff_max = "5s"\n',
     'delivery.backoff_max = "5s": must be >= 10 s'),
    ('[route]\nreceivers = []\n[[inhibit_rules]]\nsource_matchers = [\'kind="hang"\']\n',
     "inhibit_rules[0]: needs non-empty source_matchers and target_matchers"),
    ('receivers = []\n', "receivers: unknown key (expected one of: version, dashboard_url, backfill, route, "
     "inhibit_rules, sinks, delivery, watchdog, deadman)"),
    ('dashboard_url = "localhost:8501"\n[route]\nreceivers = []\n',
     'dashboard_url = "localhost:8501": must be an http:// or https:// URL'),
    ("[route]\nreceivers = []\n[[route.routes]]\nname = \"a\"\n[[route.routes]]\nname = \"a\"\n",
     'route.routes[1].name = "a": another route has this name'),
])
def test_errors_name_file_key_and_value(env: Path, toml: str, message: str) -> None:
    path = write(env, toml)
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value) == f"{path}: {message}"


def test_secret_errors_never_show_the_secret(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(env, '[route]\nreceivers = []\n[sinks.s]\ntype = "slack"\n' f'url = "{SLACK_URL}"\n')
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value) == (f"{path}: sinks.s.url: is a secret and must not be written in the file: set url_env "
                              "or url_file instead (value not shown)")
    assert "SECRETSECRET" not in str(err.value)
    monkeypatch.setenv("TH_SLACK_WEBHOOK_URL", "not-a-url-SECRETSECRET")
    with pytest.raises(ConfigError) as err:
        load(write(env, MINIMAL))
    assert str(err.value) == (f"{path}: sinks.s.url_env (from env TH_SLACK_WEBHOOK_URL; value not shown): "
                              "not an http:// or https:// URL")
    monkeypatch.delenv("TH_SLACK_WEBHOOK_URL")
    with pytest.raises(ConfigError) as err:
        load(path := write(env, MINIMAL))
    assert str(err.value) == f"{path}: sinks.s.url_env: environment variable TH_SLACK_WEBHOOK_URL is not set (or empty)"
    missing = env / "nope"
    with pytest.raises(ConfigError) as err:
        load(path := write(env, MINIMAL.replace('url_env = "TH_SLACK_WEBHOOK_URL"', f'url_file = "{missing}"')))
    assert str(err.value) == (f"{path}: sinks.s.url_file: cannot read secret file '{missing}' "
                              "(No such file or directory)")


def test_toml_syntax_and_missing_file(env: Path) -> None:
    path = write(env, "[route\nreceivers = []\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}: not valid TOML: ") and "line 1" in str(err.value)
    with pytest.raises(ConfigError, match=r"cannot read the alerts config \(No such file or directory\)"):
        load(env / "absent.toml")


def test_secrets_never_print_and_are_redacted_from_text(caplog: pytest.LogCaptureFixture) -> None:
    s = Secret(SLACK_URL, "env X")
    logging.getLogger("test").warning("posting to %s failed", s)
    assert SLACK_URL not in caplog.text and "posting to *** failed" in caplog.text
    assert (str(s), repr(s), f"{s}", f"{s:>40}") == ("***", "Secret('***' from env X)", "***", "***")
    text = f"ConnectError: cannot reach {SLACK_URL} (hooks.slack.com/services/T000/B000/SECRETSECRET)"
    assert redact(text, [s]) == "ConnectError: cannot reach *** (***)"
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(s)


def test_durations() -> None:
    assert [parse_duration(v) for v in ("0", "500ms", "1d", "1w", "2h30m", "90", 45, 1.5)] == [
        0.0, 0.5, 86400.0, 604800.0, 9000.0, None, 45.0, 1.5]
    assert [parse_duration(v) for v in ("", "1x", "-5s", -1, True, None, float("inf"), float("nan"))] == [None] * 8


@pytest.mark.parametrize(("toml", "message"), [
    # several mistakes: the first in the order the checks run, wherever each is written in the file
    ('[route]\nreceivers = ["nope"]\ngroup_wait = true\n', 'route.receivers[0] = "nope": no sink of this name '
     "(sinks: none)"),
    ('[route]\ngroup_by = 3\nfoo = 1\nreceivers = []\n', "route.foo: unknown key (expected one of: name, receivers, "
     "group_by, group_wait, group_interval, repeat_interval, routes)"),
    ('[route]\nreceivers = 3\n[sinks.s]\ntype = "slack"\nsend_resolved = 1\n',
     "sinks.s.send_resolved = 1: must be true or false"),
    ('[route]\nreceivers = []\nrepeat_interval = 0\n[[route.routes]]\ncontinue = "yes"\n',
     "route.repeat_interval = 0: must be > 0 s"),
    ('[route]\nreceivers = []\n[[route.routes]]\ncontinue = "yes"\nfoo = 1\n',
     "route.routes[0].foo: unknown key (expected one of: name, matchers, receivers, group_by, group_wait, "
     "group_interval, repeat_interval, continue, routes)"),
    ('[route]\nreceivers = []\n[[route.routes]]\nname = "a"\n[[route.routes]]\nname = 3\n'
     '[[route.routes]]\nname = "a"\n', "route.routes[1].name = 3: route names are 1-64 letters, digits, '_', '.', '-'"),
    ('[route]\nreceivers = []\n[delivery]\nmax_attempts = 0\n[sinks.s]\ntype = "webhook"\nurl = "https://h/x"\n'
     'secret_env = 5\nmax_alerts = 3\n', "sinks.s.max_alerts: unknown key (expected one of: type, send_resolved, "
     "timeout, url, url_env, url_file, secret_env, secret_file)"),
    ('[route]\nreceivers = []\n[sinks.s]\ntype = "webhook"\nurl = "ftp://h/x"\nsecret_env = 5\n',
     'sinks.s.url = "ftp://h/x": not an http:// or https:// URL'),
    ('[route]\nreceivers = []\n[sinks.s]\nsecret_env = 5\ntype = "sms"\n',
     'sinks.s.type = "sms": must be one of slack, webhook, pagerduty, alertmanager'),
    ('[route]\nreceivers = []\n[deadman]\nurl_file = 3\nurl = "https://x/y"\n',
     "deadman: give only one of url, url_file"),
    # a sink type that is no string (this was a TypeError)
    ('[route]\nreceivers = []\n[sinks.s]\ntype = ["slack"]\n', "sinks.s.type = ['slack']: must be one of slack, "
     "webhook, pagerduty, alertmanager"),
    # a secret written in the file is never quoted, whatever is wrong with it
    ('[route]\nreceivers = []\n[sinks.s]\ntype = "slack"\nurl = 3\n', "sinks.s.url: must be a non-empty string"),
    ('[route]\nreceivers = []\n[sinks.s]\ntype = "webhook"\nurl = " "\nsecret_env = "X"\n',
     "sinks.s.url: must be a non-empty string"),
    ('[route]\nreceivers = []\n[deadman]\nurl_file = ""\n', 'deadman.url_file = "": must be a non-empty string'),
    ('version = 1.0\nbackfill = 1979-05-27\n[route]\nreceivers = []\n', "backfill = datetime.date(1979, 5, 27): not a "
     "duration (use e.g. 30s, 5m, 4h, 1h30m, 1d, or a number of seconds)"),
])
def test_the_first_error_is_the_first_checked(env: Path, toml: str, message: str) -> None:
    path = write(env, toml)
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value) == f"{path}: {message}"


def _wrong_typed() -> list[tuple[str, dict]]:
    """Each key of each table the file declares, in a valid document, given a value of the wrong type."""
    import msgspec

    from trainhealth.alerts import config

    root = {"route": {"receivers": []}}
    rule = {"source_matchers": ['kind="hang"'], "target_matchers": ['kind="straggler"']}
    tables = [  # (key, declared type, a valid table, the document holding it)
        ("", config.RawConfig, root, lambda t: t),
        ("route", config.RawRoute, {"receivers": []}, lambda t: {"route": t}),
        ("route.routes[0]", config.RawChildRoute, {}, lambda t: {"route": {"receivers": [], "routes": [t]}}),
        ("inhibit_rules[0]", config.RawInhibitRule, rule, lambda t: {**root, "inhibit_rules": [t]}),
        ("delivery", config.RawDelivery, {}, lambda t: {**root, "delivery": t}),
        ("watchdog", config.RawWatchdog, {}, lambda t: {**root, "watchdog": t}),
        ("deadman", config.RawDeadman, {"url_env": "TH_DEADMAN_URL"}, lambda t: {**root, "deadman": t}),
    ]
    for sink in ({"type": "slack", "url_env": "TH_SLACK_WEBHOOK_URL"},
                 {"type": "webhook", "url": "https://hooks.example/x", "secret_env": "TH_WEBHOOK_SECRET"},
                 {"type": "pagerduty", "routing_key_env": "TH_PAGERDUTY_ROUTING_KEY"},
                 {"type": "alertmanager", "url": "http://alertmanager.example:9093"}):
        cls = next(c.cls for c in msgspec.inspect.type_info(config.RawSinkTable).types if c.tag == sink["type"])
        tables.append((f"sinks.{sink['type']}", cls, sink, lambda t, kind=sink["type"]: {**root, "sinks": {kind: t}}))
    out = []
    for key, cls, table, document in tables:
        for name in (f.encode_name for f in msgspec.structs.fields(cls)):
            group = name.removesuffix("_env").removesuffix("_file")  # one of x, x_env, x_file at a time
            t = {k: v for k, v in table.items() if k.removesuffix("_env").removesuffix("_file") != group}
            t[name] = 3 if name in ("route", "routes", "inhibit_rules", "sinks", "delivery", "watchdog", "deadman") \
                else {"x": 1}
            out.append((f"{key}.{name}" if key else name, copy.deepcopy(document(t))))
    return out


@pytest.mark.parametrize(("key", "data"), _wrong_typed(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_key_of_the_wrong_type_is_named(env: Path, key: str, data: dict) -> None:
    with pytest.raises(ConfigError) as err:
        parse(data, "alerts.toml")
    message = str(err.value)
    assert message.startswith(f"alerts.toml: {key} = ") or message == f"alerts.toml: {key}: must be a non-empty string"


AM = '[route]\nreceivers = ["am"]\n[sinks.am]\ntype = "alertmanager"\nurl = "http://am.example:9093"\n'


def test_the_documented_alertmanager_sink_loads(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (ROOT / "docs" / "alerts.md").read_text()
    start = doc.index("```toml alertmanager-example\n") + len("```toml alertmanager-example\n")
    monkeypatch.setenv("TH_ALERTMANAGER_PASSWORD", "am-SECRET-pw")
    cfg = load(write(env, doc[start:doc.index("```", start)]))
    am = cfg.sinks["team-am"]
    assert (am.type, am.api.reveal(), am.username, am.password.reveal(), am.bearer_token) == (
        "alertmanager", "http://alertmanager.example:9093/api/v2/alerts", "trainhealth", "am-SECRET-pw", None)
    assert (am.resend_interval, am.validity, am.labels, am.send_resolved, am.timeout) == (
        60.0, 240.0, {"team": "ml-infra", "cluster": "a100-east"}, True, 10.0)
    assert cfg.route.receivers == ("team-am",)
    described = cfg.describe()
    assert "sink team-am: alertmanager, send_resolved=true, timeout 10 s; url from config file, password from env " \
           "TH_ALERTMANAGER_PASSWORD; sent the alerts themselves, re-sent every 60 s (valid 240 s): group_by, " \
           "timers, silences and inhibition are Alertmanager's" in described and "am-SECRET-pw" not in described
    assert "am-SECRET-pw" not in repr(am.secrets()) and am.password in cfg.secrets()


def test_alertmanager_sink_defaults_and_a_bearer_token_from_a_file(env: Path) -> None:
    am = load(write(env, AM)).sinks["am"]
    assert (am.api.reveal(), am.resend_interval, am.validity, am.labels, am.username, am.password,
            am.bearer_token) == ("http://am.example:9093/api/v2/alerts", 60.0, 240.0, {}, None, None, None)
    (env / "token").write_text("tok-SECRET\n")
    am = load(write(env, AM + 'bearer_token_file = "token"\nresend_interval = "30s"\n')).sinks["am"]
    assert (am.bearer_token.reveal(), am.bearer_token.source, am.resend_interval, am.validity) == (
        "tok-SECRET", f"file {env / 'token'}", 30.0, 120.0)


@pytest.mark.parametrize(("extra", "message"), [
    ('username = "trainhealth"\n',
     'sinks.am.username = "trainhealth": basic auth needs the password too: set password_env or password_file'),
    ('password_env = "TH_WEBHOOK_SECRET"\n', "sinks.am: password_env / password_file is basic auth: set username too"),
    ('username = "a:b"\npassword_env = "TH_WEBHOOK_SECRET"\n',
     'sinks.am.username = "a:b": must be a user name without \':\' or blanks'),
    ('username = "u"\npassword_env = "TH_WEBHOOK_SECRET"\nbearer_token_env = "TH_WEBHOOK_SECRET"\n',
     "sinks.am: give basic auth (username, password_*) or bearer_token_*, not both"),
    ('bearer_token_env = "TH_WEBHOOK_SECRET"\nbearer_token_file = "x"\n',
     "sinks.am: give only one of bearer_token_env, bearer_token_file"),
    ('password = "hunter2"\n', "sinks.am.password: unknown key (expected one of: type, send_resolved, timeout, url, "
     "url_env, url_file, username, password_env, password_file, bearer_token_env, bearer_token_file, "
     "resend_interval, labels)"),
    ('bearer_token_env = "TH_NOT_SET_ANYWHERE"\n',
     "sinks.am.bearer_token_env: environment variable TH_NOT_SET_ANYWHERE is not set (or empty)"),
    ('resend_interval = "500ms"\n', 'sinks.am.resend_interval = "500ms": must be >= 1 s'),
    ('resend_interval = true\n',
     "sinks.am.resend_interval = true: not a duration (use e.g. 30s, 5m, 4h, 1h30m, 1d, or a number of seconds)"),
    ("send_resolved = false\n", "sinks.am.send_resolved = false: must be true for an alertmanager sink: a resolve is "
     "how Alertmanager learns an alert ended (choose send_resolved on Alertmanager's receivers instead)"),
    ('labels = { run = "x" }\n',
     'sinks.am.labels.run = "x": is set from the anomaly (alertname, run, severity, anomaly, rank, host)'),
    ('labels = { "9team" = "x" }\n', 'sinks.am.labels.9team = "x": not a label name (letters, digits and \'_\', not '
     "starting with a digit; '__' is reserved)"),
    ('labels = { __name__ = "x" }\n', 'sinks.am.labels.__name__ = "x": not a label name (letters, digits and \'_\', '
     "not starting with a digit; '__' is reserved)"),
    ('labels = { team = "" }\n', 'sinks.am.labels.team = "": must not be empty (Alertmanager drops empty labels)'),
    ('labels = { team = 3 }\n', "sinks.am.labels = {'team': 3}: must be a table of label names to string values"),
    ('labels = "team=ml"\n', 'sinks.am.labels = "team=ml": must be a table of label names to string values'),
])
def test_alertmanager_sink_errors_name_the_key_and_value(env: Path, extra: str, message: str) -> None:
    path = write(env, AM + extra)
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value) == f"{path}: {message}"
    assert "whsec-123" not in str(err.value)  # the secret in TH_WEBHOOK_SECRET


def test_alertmanager_url_is_required_and_checked(env: Path) -> None:
    path = write(env, '[route]\nreceivers = []\n[sinks.am]\ntype = "alertmanager"\n')
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value) == f"{path}: sinks.am: missing url_env (environment variable) or url_file (file holding it)"
    path = write(env, AM.replace("http://am.example:9093", "am.example:9093"))
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value) == f'{path}: sinks.am.url = "am.example:9093": not an http:// or https:// URL'
