"""The alert worker on a real redis-server: intake from the detector service's anomaly logs on a controllable
clock, restarts that neither lose nor repeat a notification, the service_down watchdog, the real detector
service end to end, the worker process killed mid-delivery and restarted, SIGTERM, doctor and the CLI."""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from trainhealth import alert_store as store
from trainhealth.alerts.config import AlertsConfig, parse
from trainhealth.alerts.health import doctor_report
from trainhealth.alerts.intake import Intake
from trainhealth.alerts.notification import idempotency_key
from trainhealth.alerts.outbox import Deliverer
from trainhealth.alerts.signing import verify
from trainhealth.alerts.worker import AlertWorker
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import DetectorService
from trainhealth.keys import (
    ALERTS_GROUPS,
    ALERTS_LEADER,
    ALERTS_OUTBOX,
    ALERTS_STATE,
    RUNS,
    alerts_worker_heartbeat,
    run_keys,
    service_heartbeat,
)

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
T = 1_800_000_000.0
SECRET = "whsec-worker"
_SERVICE = runpy.run_path(str(Path(__file__).with_name("test_service.py")))
write_run, T_SERVICE = _SERVICE["write_run"], _SERVICE["T0"]


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def anomaly(run: str = "r1", kind: str = "straggler", step: int = 250, ranks: tuple[int, ...] = (5,),
            severity: str = "warning", status: str = "active", end_step: int | None = None, first: float = T,
            last: float = T, **extra: Any) -> dict[str, Any]:
    who = "-".join(map(str, ranks)) or "*"
    return {"id": f"{kind}:{who}:{step}:0", "run": run, "kind": kind, "severity": severity, "status": status,
            "step": step, "end_step": end_step, "ranks": list(ranks), "hosts": [f"node-{r}" for r in ranks],
            "evidence": {"score": 0.6}, "message": f"{kind} since step {step}", "first_seen": first, "last_seen": last,
            **extra}


def log(r: redis.Redis, transition: str, a: dict[str, Any]) -> None:
    """An anomaly_log entry exactly as docs/architecture.md describes the detector service's."""
    r.zadd(RUNS, {a["run"]: T - 3600}, nx=True)
    r.xadd(run_keys(a["run"]).anomaly_log, {"id": a["id"], "transition": transition, "kind": a["kind"],
                                            "severity": a["severity"], "step": a["step"],
                                            "json": json.dumps(a, sort_keys=True)})


def config(url: str = "http://127.0.0.1:9/hook", **route: Any) -> AlertsConfig:
    os.environ["TH_TEST_WEBHOOK_SECRET"] = SECRET
    return parse({"dashboard_url": "http://dash:8501",
                  "route": {"receivers": ["bot"], **route},
                  "sinks": {"bot": {"type": "webhook", "url": url, "secret_env": "TH_TEST_WEBHOOK_SECRET",
                                    "timeout": 2}},
                  "delivery": {"backoff_base": "1s", "jitter": 0}}, "test.toml")


def outbox(r: redis.Redis) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(ALERTS_OUTBOX)]


def test_intake_turns_transitions_into_outbox_entries_on_the_group_timers(r: redis.Redis) -> None:
    clock = Clock(T)
    intake = Intake(r, config(), consumer="w1", clock=clock)
    log(r, "opened", anomaly())
    assert intake.run_once() == [] and outbox(r) == []
    clock.t = T + 29.9
    assert intake.run_once() == []
    clock.t = T + 30
    (n,) = intake.run_once()
    (entry,) = outbox(r)
    key = idempotency_key('root:{run="r1",kind="straggler"}', T, 1, "bot")
    assert (entry["sink"], entry["key"], entry["group"], entry["seq"]) == ("bot", key, n.group_key, "1")
    body = json.loads(entry["json"])
    assert (body["at"], body["reason"], [a["key"] for a in body["firing"]]) == (T + 30, "new",
                                                                               ["r1/straggler:5:250:0"])
    assert r.xpending(run_keys("r1").anomaly_log, "th-alerts")["pending"] == 0
    assert json.loads(r.hget(ALERTS_GROUPS, n.group_key))["seq"] == 1
    state = {k.decode(): v.decode() for k, v in r.hgetall(ALERTS_STATE).items()}
    assert state["epoch"] == repr(T) and state["now"] == repr(T + 30)
    assert state["cursor:r1"] == r.xrange(run_keys("r1").anomaly_log)[-1][0].decode()
    # a restarted worker does not notify again; the resolve continues the group's sequence
    clock.t = T + 200
    log(r, "resolved", anomaly(status="resolved", end_step=800, last=T + 200))
    again = Intake(r, config(), consumer="w2", clock=clock)
    assert again.run_once() == [] and len(outbox(r)) == 1
    clock.t = T + 330
    (n2,) = again.run_once()
    assert (n2.seq, n2.reason, n2.status) == (2, "resolved", "resolved")
    assert outbox(r)[1]["key"] == idempotency_key('root:{run="r1",kind="straggler"}', T, 2, "bot")
    assert r.hlen(ALERTS_GROUPS) == 0


def test_a_short_anomaly_is_never_notified_and_transitions_are_ordered_by_event_time(r: redis.Redis) -> None:
    clock = Clock(T + 100)
    intake = Intake(r, config(), consumer="w1", clock=clock)
    log(r, "opened", anomaly(kind="loss_spike", ranks=(), step=80, first=T + 10, last=T + 10))
    log(r, "resolved", anomaly(kind="loss_spike", ranks=(), step=80, status="resolved", end_step=80,
                               first=T + 10, last=T + 25))
    assert intake.run_once() == [] and outbox(r) == [] and r.hlen(ALERTS_GROUPS) == 0


def test_crash_after_commit_before_ack_does_not_notify_twice(r: redis.Redis) -> None:
    class DiesBeforeAck(Intake):
        def _commit(self, notes: list, entries: list, now: float) -> None:
            super()._commit(notes, [], now)  # the MULTI/EXEC happens, the XACK does not
            raise KeyboardInterrupt("killed")

    clock = Clock(T + 30)
    log(r, "opened", anomaly())
    with pytest.raises(KeyboardInterrupt):
        DiesBeforeAck(r, config(), consumer="dies", clock=clock).run_once()
    # the notification was due at once (the transition is 30 s old): committed with its outbox entry
    assert len(outbox(r)) == 1 and r.xpending(run_keys("r1").anomaly_log, "th-alerts")["pending"] == 1
    intake = Intake(r, config(), consumer="next", clock=clock)
    assert intake.run_once() == [] and len(outbox(r)) == 1
    assert r.xpending(run_keys("r1").anomaly_log, "th-alerts")["pending"] == 0


def test_crash_before_commit_is_redone_with_the_same_key(r: redis.Redis) -> None:
    class DiesBeforeCommit(Intake):
        def _commit(self, notes: list, entries: list, now: float) -> None:
            raise KeyboardInterrupt("killed")

    clock = Clock(T + 30)
    log(r, "opened", anomaly())
    with pytest.raises(KeyboardInterrupt):
        DiesBeforeCommit(r, config(), consumer="dies", clock=clock).run_once()
    assert outbox(r) == [] and r.hlen(ALERTS_GROUPS) == 0
    (n,) = Intake(r, config(), consumer="next", clock=clock).run_once()
    assert [e["key"] for e in outbox(r)] == [idempotency_key(n.group_key, T, 1, "bot")]


def test_first_start_ignores_history_older_than_the_backfill(r: redis.Redis) -> None:
    log(r, "opened", anomaly(step=10, first=T - 7200, last=T - 7200))
    log(r, "opened", anomaly(step=20, ranks=(6,), first=T - 600, last=T - 600))
    notes = Intake(r, config(), consumer="w", clock=Clock(T)).run_once()
    assert [[a.key for a in n.firing] for n in notes] == [["r1/straggler:6:20:0"]]


def test_recommendation_summary_is_fetched_for_the_notification(r: redis.Redis) -> None:
    rec = {"id": "rec:loss_spike:*:80:0", "action": "rollback", "checkpoint_step": 50, "skip_steps": [0, 280]}
    r.hset(run_keys("r1").recommendations, rec["id"], json.dumps({**rec, "summary": "Roll back to step 50 ($3)"}))
    log(r, "opened", anomaly(kind="loss_spike", ranks=(), step=80, severity="critical", recommendation=rec))
    log(r, "opened", anomaly(kind="hang", ranks=(), step=90, severity="critical"))  # no recommendation: fine
    notes = Intake(r, config(), consumer="w", clock=Clock(T + 30)).run_once()
    recs = {n.firing[0].labels["kind"]: n.firing[0].anomaly.get("recommendation") for n in notes}
    assert recs == {"loss_spike": {**rec, "summary": "Roll back to step 50 ($3)"}, "hang": None}


def test_watchdog_raises_and_resolves_service_down(r: redis.Redis) -> None:
    clock = Clock(T)
    r.zadd(RUNS, {"job": T})
    r.hset(run_keys("job").heartbeats, "0", json.dumps({"t": T - 5, "step": 10}))
    intake = Intake(r, config(), consumer="w", clock=clock)
    intake.run_once()
    assert intake.service_down
    clock.t = T + 30
    (n,) = intake.run_once()
    a = n.firing[0]
    assert (n.group_key, a.severity, a.anomaly["evidence"]) == ('root:{run="*",kind="service_down"}', "critical",
                                                               {"service_heartbeat_age_s": None,
                                                                "runs_sending": ["job"]})
    assert a.anomaly["message"].startswith("Anomaly detection is down: no detector service heartbeat at all while "
                                           "run(s) job send data.")
    r.set(service_heartbeat("svc-1"), json.dumps({"t": T + 35}))
    clock.t = T + 40
    assert intake.run_once() == [] and not intake.service_down
    clock.t = T + 330
    (n,) = intake.run_once()
    assert (n.reason, [x.key for x in n.resolved]) == ("resolved", ["*/service_down:*:0:0"])


def test_real_detector_service_to_signed_webhook(r: redis.Redis, httpserver: HTTPServer, valid) -> None:
    """Steps through real Monitors → DetectorService → anomaly_log → intake → outbox → HTTP."""
    write_run(r, "e2e", range(0, 120), spike_at=80, nan_at=100, slow_rank=1)
    svc = DetectorService(r, consumer="svc", clock=lambda: T_SERVICE + 200,
                          hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(50):
        if svc.run_once(block_ms=20) == 0:
            break
    received: list[dict] = []
    clock = Clock(T_SERVICE + 200)

    def hook(req: Request) -> Response:
        verify(req.get_data(), req.headers["X-Trainhealth-Signature"], SECRET.encode(), now=clock.t)
        received.append(json.loads(req.get_data()))
        return Response("ok")

    httpserver.expect_request("/hook").respond_with_handler(hook)
    cfg = config(httpserver.url_for("/hook"))
    intake = Intake(r, cfg, consumer="w", clock=clock)
    deliver = Deliverer(r, cfg.sinks, cfg.delivery, consumer="w", clock=clock, http=httpx.Client())
    intake.run_once()
    clock.t += 30
    intake.run_once()
    deliver.run_once()
    # the straggler notifies; the loss spike and the NaN were over within group_wait (flapping suppressed)
    assert [(p["group_key"], p["status"], [a["key"] for a in p["alerts"]]) for p in received] == [
        ('root:{run="e2e",kind="straggler"}', "firing", ["e2e/straggler:1:0:0"])]
    assert received[0]["alerts"][0]["dashboard_url"] == "http://dash:8501/anomalies?run=e2e&step=0&rank=1"
    assert received[0]["alerts"][0]["labels"]["host"] == "node-1"
    valid("webhook-payload", received[0])  # the detector service's anomaly, as the receiver gets it


# -- the worker process ---------------------------------------------------------------------------------------
def _toml(tmp_path: Path, url: str, **extra: str) -> Path:
    p = tmp_path / "alerts.toml"
    p.write_text(f"""
dashboard_url = "http://dash:8501"
[route]
receivers = ["bot"]
group_wait = "0s"
group_interval = "2s"
[sinks.bot]
type = "webhook"
url = "{url}"
secret_env = "TH_TEST_WEBHOOK_SECRET"
timeout = "{extra.get('timeout', '20s')}"
""")
    return p


@pytest.fixture
def worker_env(redis_url: str) -> dict[str, str]:
    return {**os.environ, "TH_TEST_WEBHOOK_SECRET": SECRET, "TRAINHEALTH_REDIS_URL": redis_url}


def _start(cfg: Path, env: dict[str, str], tmp_path: Path, name: str) -> subprocess.Popen:
    out = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen([PYTHON, "-m", "trainhealth", "alerts", "--config", str(cfg), "--consumer", name],
                            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait(cond: Any, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_worker_killed_mid_delivery_resends_the_same_key_once(r: redis.Redis, httpserver: HTTPServer,
                                                              worker_env: dict[str, str], tmp_path: Path,
                                                              procs: list[subprocess.Popen]) -> None:
    arrived, release = threading.Event(), threading.Event()
    requests: list[tuple[str, bytes]] = []
    processed: dict[str, dict] = {}

    def hook(req: Request) -> Response:
        body = req.get_data()
        verify(body, req.headers["X-Trainhealth-Signature"], SECRET.encode())
        key = req.headers["Idempotency-Key"]
        requests.append((key, body))
        processed.setdefault(key, json.loads(body))  # the receiver de-duplicates on the key
        if len(requests) == 1:
            arrived.set()
            release.wait(30)  # hold the first answer until the worker is dead
        return Response("ok")

    httpserver.expect_request("/hook").respond_with_handler(hook)
    cfg = _toml(tmp_path, httpserver.url_for("/hook"))
    now = time.time()
    log(r, "opened", anomaly(first=now, last=now))
    first = _start(cfg, worker_env, tmp_path, "first")
    procs.append(first)
    assert arrived.wait(30), (tmp_path / "first.log").read_text()
    first.send_signal(signal.SIGKILL)  # dies between sending and acknowledging
    first.wait(10)
    release.set()
    assert r.xpending(ALERTS_OUTBOX, "th-alerts-delivery")["pending"] == 1
    r.delete(ALERTS_LEADER)  # as if its lease had run out (15 s), to keep the test short
    second = _start(cfg, worker_env, tmp_path, "second")
    procs.append(second)
    _wait(lambda: len(requests) >= 2 and r.xpending(ALERTS_OUTBOX, "th-alerts-delivery")["pending"] == 0,
          what="the second worker to deliver")
    assert len(requests) == 2 and requests[0] == requests[1]  # same key, same body
    assert len(processed) == 1 and r.xlen(ALERTS_OUTBOX) == 1
    assert store.recent_notifications(r)[0]["key"] == requests[0][0]
    # the resend is the second try: the killed worker's try was counted before its request went out
    assert store.recent_notifications(r)[0]["attempts"] == 2
    assert 'delivered notification #1 of root:{run="r1",kind="straggler"} to sink bot (try 2)' in \
        (tmp_path / "second.log").read_text()
    # SIGTERM: clean stop, heartbeat removed, lease released at once
    _wait(lambda: r.exists(alerts_worker_heartbeat("second")), what="the heartbeat")
    second.send_signal(signal.SIGTERM)
    assert second.wait(30) == 0
    assert not r.exists(alerts_worker_heartbeat("second")) and not r.exists(ALERTS_LEADER)
    text = (tmp_path / "second.log").read_text()
    assert "alert worker second stopped (0 notifications enqueued, 1 delivered)" in text
    assert SECRET not in text and SECRET not in (tmp_path / "first.log").read_text()


def test_standby_worker_takes_over_and_doctor_reports(r: redis.Redis, httpserver: HTTPServer,
                                                      tmp_path: Path) -> None:
    httpserver.expect_request("/hook").respond_with_data("down", status=503)
    cfg = config(httpserver.url_for("/hook"))
    a = AlertWorker(r, cfg, consumer="a", clock=Clock(T), block_ms=10)
    b = AlertWorker(r, cfg, consumer="b", clock=Clock(T), block_ms=10)
    a.tick()
    b.tick()
    assert (a.is_leader, b.is_leader) == (True, False)
    beats = {w["consumer"]: w["role"] for w in store.workers(r)}
    assert beats == {"a": "leader", "b": "standby"}
    log(r, "opened", anomaly(first=T - 60, last=T - 60))
    a.intake.run_once()
    a.delivery.run_once()
    a.tick()
    lines, ok = doctor_report(r, now=T + 5)
    assert not ok
    assert lines == [
        f"Alert worker: leader pid {os.getpid()} on {os.uname().nodename}, heartbeat 5 s ago, 1 groups, 0 delivered",
        f"Alert worker: standby pid {os.getpid()} on {os.uname().nodename}, heartbeat 5 s ago, 0 groups, 0 delivered",
        "Sink bot (webhook): FAILING (1 in a row: HTTP 503: down); last success never, 0 delivered, 0 dead",
        "Outbox: 1 pending, 0 dead letters, 1 alert groups"]
    r.delete(ALERTS_LEADER)
    b.tick()
    assert b.is_leader and not b.intake.ready


def test_doctor_without_alerting_is_not_a_failure(r: redis.Redis) -> None:
    assert doctor_report(r, now=T) == (["Alert worker: not configured (no heartbeat, no alert state): "
                                        "`trainhealth alerts --config FILE`"], True)


def test_cli_silences_deadletters_check_and_doctor(r: redis.Redis, redis_url: str, tmp_path: Path,
                                                   worker_env: dict[str, str]) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, "-m", "trainhealth", *args], cwd=ROOT, env=worker_env,
                              capture_output=True, text=True, timeout=60)

    out = cli("silence", "add", "--run", "r1", "--kind", "straggler", "--rank", "5", "--duration", "2h",
              "--comment", "node 7 is being drained", "--author", "ana")
    assert out.returncode == 0, out.stderr
    (s,) = store.list_silences(r)
    assert [str(m) for m in s.matchers] == ['run="r1"', 'kind="straggler"', 'rank="5"']
    assert (s.created_by, s.comment, round(s.ends_at - s.starts_at)) == ("ana", "node 7 is being drained", 7200)
    assert f"silence {s.id}: run=\"r1\" kind=\"straggler\" rank=\"5\" until " in out.stdout
    listed = cli("silence", "list")
    assert f"{s.id}  active " in listed.stdout and "by ana: node 7 is being drained" in listed.stdout
    bad = cli("silence", "add", "--kind", "stragler")
    assert bad.returncode == 2 and "kind 'stragler' is unknown" in bad.stderr
    assert cli("silence", "expire", s.id).stdout.strip().endswith(f"silence {s.id} expired")
    assert store.list_silences(r) == [] and cli("silence", "expire", s.id).returncode == 2
    r.lpush("th:{alerts}:dead", json.dumps({"id": "1-0", "sink": "bot", "key": "k", "group": "g", "seq": "1",
                                            "attempts": 12, "status": 500, "error": "HTTP 500: x", "dead_at": T,
                                            "notification": {"seq": 1}}))
    listed = cli("deadletters", "list")
    assert "1-0  2027-01-15 08:00:00 UTC  sink bot  #1 of g  after 12 tries: HTTP 500: x" in listed.stdout
    assert cli("deadletters", "requeue", "--all").stdout.strip().endswith("requeued 1 dead letter")
    assert r.llen("th:{alerts}:dead") == 0 and outbox(r)[0]["key"] == "k"
    cfg = _toml(tmp_path, "https://hooks.example/x")
    check = cli("alerts", "--config", str(cfg), "--check")
    assert check.returncode == 0 and "sink bot: webhook" in check.stdout and SECRET not in check.stdout
    missing = cli("alerts", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "nope.toml: cannot read the alerts config" in missing.stderr
    doctor = cli("doctor")
    assert doctor.returncode == 1  # no detector service, no alert worker while alert state exists
    assert "Alert worker: NOT RUNNING (no live heartbeat)" in doctor.stdout
    r.hset("th:{alerts}:sinks", "bot", json.dumps({"type": "webhook", "consecutive_failures": 0, "delivered": 3}))
    assert "Sink bot (webhook): ok when a worker last sent; last success never, 3 delivered, 0 dead" in cli(
        "doctor").stdout
    assert "Outbox: 1 pending, 0 dead letters, 0 alert groups" in doctor.stdout  # the requeued one


def test_deadman_switch_is_pinged_only_while_healthy(r: redis.Redis, httpserver: HTTPServer) -> None:
    httpserver.expect_request("/ping", method="POST").respond_with_data("OK")
    cfg = config()
    cfg = AlertsConfig(**{**cfg.__dict__, "deadman": parse({
        "route": {"receivers": []}, "deadman": {"url": httpserver.url_for("/ping"), "interval": "1m"}},
        "t.toml").deadman})
    clock = Clock(T)
    w = AlertWorker(r, cfg, consumer="a", clock=clock, block_ms=10)
    w.tick()  # becomes the leader, but no loop has run yet: no ping
    assert w.is_leader and w.last_ping_ok is False and len(httpserver.log) == 0
    w.intake.run_once()
    w.delivery.run_once()
    clock.t = T + 60
    w.intake.run_once()
    w.delivery.run_once()
    w.tick()
    assert w.last_ping_ok is True
    assert [json.loads(req.get_data()) for req, _ in httpserver.log] == [{"worker": "a", "t": T + 60}]
    # ranks send data but no detector service heartbeats: stop vouching for the monitoring
    r.zadd(RUNS, {"job": T})
    r.hset(run_keys("job").heartbeats, "0", json.dumps({"t": T + 115, "step": 10}))
    clock.t = T + 120
    w.intake.run_once()
    w.delivery.run_once()
    w.tick()
    assert w.intake.service_down and w.last_ping_ok is False and len(httpserver.log) == 1
    assert json.loads(r.get(alerts_worker_heartbeat("a")))["deadman_ok"] is False


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("json", "[1, 2, 3]", "[1, 2, 3]"),
    ("json", "{not json", "'{not json'"),
    ("first_seen", "yesterday", "'yesterday'"),
    ("last_seen", 1e308, "1e+308"),
    ("last_seen", float("nan"), "nan"),
    ("last_seen", T + 400 * 86400, repr(T + 400 * 86400)),
    ("last_seen", True, "True"),
    ("kind", ["hang"], "['hang']"),
    ("kind", "", "''"),
    ("severity", "fatal", "'fatal'"),
    ("severity", None, "None"),
    ("status", 1, "1"),
    ("step", "250", "'250'"),
    ("end_step", 1.5, "1.5"),
    ("ranks", 5, "5"),
    ("ranks", [{"r": 5}], "[{'r': 5}]"),
    ("hosts", "node-1", "'node-1'"),
    ("evidence", [0.6], "[0.6]"),
    ("message", {"m": 1}, "{'m': 1}"),
    ("run", 7, "7"),
    ("id", None, "None"),
    ("transition", "exploded", "'exploded'"),
])
def test_a_malformed_entry_is_skipped_with_one_warning_and_other_runs_still_notify(
        r: redis.Redis, caplog: pytest.LogCaptureFixture, field: str, value: Any, shown: str) -> None:
    bad = anomaly(run="bad", last=T + 1)
    entry = {"id": bad["id"], "transition": "opened", "json": json.dumps(bad)}
    if field == "json":
        entry["json"] = value
    elif field == "transition":
        entry["transition"] = value
    else:
        entry["json"] = json.dumps({**bad, field: value})
    r.zadd(RUNS, {"bad": T - 3600})
    eid = r.xadd(run_keys("bad").anomaly_log, entry).decode()
    log(r, "opened", anomaly(run="good", kind="hang", ranks=(), severity="critical", last=T + 2))
    intake = Intake(r, config(), consumer="w1", clock=Clock(T + 60))
    out: list[list[Any]] = []
    with caplog.at_level("WARNING", logger="trainhealth.alerts.intake"):
        # in a thread: before the fix, last_seen = 1e308 made the grouping engine spin forever
        t = threading.Thread(target=lambda: out.append(intake.run_once()), daemon=True)
        t.start()
        t.join(10.0)
    assert not t.is_alive() and len(out) == 1, "the intake stalled"
    (n,) = out[0]
    assert [a.key for a in n.firing] == ["good/hang:*:250:0"] and len(outbox(r)) == 1
    assert [rec.getMessage() for rec in caplog.records] == [
        f"run bad: skipping malformed anomaly_log entry {eid}: field {field} = {shown}"]
    assert intake.skipped == 1 and r.xpending(run_keys("bad").anomaly_log, "th-alerts")["pending"] == 0
    assert intake.grouper.now == T + 60  # the engine's clock followed the wall clock, not the bad entry


def test_an_entry_ahead_of_the_wall_clock_is_observed_now(r: redis.Redis) -> None:
    # a skewed detector host: the engine's clock must not run ahead and hold back every other group's flush
    log(r, "opened", anomaly(run="skewed", first=T + 3600, last=T + 3600))
    log(r, "opened", anomaly(run="good", kind="hang", ranks=(), severity="critical"))
    clock = Clock(T)
    intake = Intake(r, config(), consumer="w1", clock=clock)
    assert intake.run_once() == []
    clock.t = T + 30
    assert sorted(n.group_key for n in intake.run_once()) == ['root:{run="good",kind="hang"}',
                                                              'root:{run="skewed",kind="straggler"}']


def test_worker_thread_keeps_notifying_after_a_malformed_entry(r: redis.Redis, httpserver: HTTPServer) -> None:
    got: list[dict[str, Any]] = []
    httpserver.expect_request("/hook", method="POST").respond_with_handler(
        lambda req: got.append(json.loads(req.get_data())) or Response("ok"))
    r.zadd(RUNS, {"bad": time.time() - 60})
    r.xadd(run_keys("bad").anomaly_log, {"id": "x", "transition": "opened", "json": "[1,2,3]"})
    r.xadd(run_keys("bad").anomaly_log, {"id": "y", "transition": "opened",
                                         "json": json.dumps(anomaly(run="bad", last=1e308))})
    now = time.time()
    log(r, "opened", anomaly(run="good", kind="hang", ranks=(), severity="critical", first=now - 60, last=now - 60))
    w = AlertWorker(r, config(httpserver.url_for("/hook"), group_wait="0s", group_interval="1s"), consumer="w1",
                    block_ms=100)
    t = threading.Thread(target=w.run_forever, daemon=True)
    t.start()
    try:
        _wait(lambda: got, 10.0, "the good run's notification")
        assert [a["key"] for a in got[0]["alerts"]] == ["good/hang:*:250:0"]
        assert w.intake.skipped == 2 and "intake" not in w.status(time.time())["errors"]
    finally:
        w.stop()
        t.join(10)


def test_a_webhook_url_holding_a_token_never_reaches_the_worker_log(r: redis.Redis, httpserver: HTTPServer,
                                                                    worker_env: dict[str, str], tmp_path: Path,
                                                                    procs: list[subprocess.Popen]) -> None:
    """httpx logs every request's full URL at INFO; a Slack webhook URL is itself the secret."""
    got: list[str] = []
    httpserver.expect_request("/hook").respond_with_handler(lambda req: got.append(req.full_path) or Response("ok"))
    token = "tok-7f3a9c"
    cfg = tmp_path / "alerts.toml"
    cfg.write_text("""
[route]
receivers = ["bot"]
group_wait = "0s"
[sinks.bot]
type = "webhook"
url_env = "TH_TEST_HOOK_URL"
secret_env = "TH_TEST_WEBHOOK_SECRET"
""")
    now = time.time()
    log(r, "opened", anomaly(first=now, last=now))
    env = {**worker_env, "TH_TEST_HOOK_URL": httpserver.url_for(f"/hook?token={token}")}
    proc = _start(cfg, env, tmp_path, "w")
    procs.append(proc)
    _wait(lambda: got, what="the delivery")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    text = (tmp_path / "w.log").read_text()
    assert got == [f"/hook?token={token}"] and "alert worker w stopped" in text
    assert token not in text and SECRET not in text
