"""Stale transitions at the alert worker's start (issue 15), on a real redis-server and a real local HTTP receiver.

A backlog written longer ago than the catch-up window (by Redis's clock: the stream entry ids) is tracked in the
alert groups but not notified; runs that are over are not paged (not even the 4 h repeat of a restored group);
finished runs and replays raise no ``service_down``; ``trainhealth doctor`` fails on a missing worker only where
alerting is configured; a notification resent after a crash during its request is try 2.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
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
from trainhealth import defaults
from trainhealth.alerts.config import AlertsConfig, DeliveryConfig, parse
from trainhealth.alerts.health import doctor_report
from trainhealth.alerts.intake import Intake
from trainhealth.alerts.notification import Alert, Notification
from trainhealth.alerts.outbox import Deliverer, enqueue
from trainhealth.alerts.signing import verify
from trainhealth.alerts.watchdog import ServiceCheck, check_service
from trainhealth.keys import ALERTS_GROUPS, ALERTS_OUTBOX, RUNS, run_keys, service_heartbeat

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
T = 1_800_000_000.0  # the worker's (fake) clock; staleness is measured on Redis's own clock
SECRET = "whsec-catchup"


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def anomaly(run: str, kind: str = "straggler", step: int = 250, ranks: tuple[int, ...] = (5,),
            severity: str = "warning", status: str = "active", last: float = T) -> dict[str, Any]:
    who = "-".join(map(str, ranks)) or "*"
    return {"id": f"{kind}:{who}:{step}:0", "run": run, "kind": kind, "severity": severity, "status": status,
            "step": step, "end_step": step + 10 if status == "resolved" else None, "ranks": list(ranks),
            "hosts": [f"node-{r}" for r in ranks], "evidence": {"score": 0.6}, "message": f"{kind} since step {step}",
            "first_seen": last, "last_seen": last}


def redis_now(r: redis.Redis) -> float:
    sec, usec = r.time()
    return sec + usec / 1e6


def log(r: redis.Redis, transition: str, a: dict[str, Any], written: float | None = None) -> str:
    """An anomaly_log entry as the detector service writes it; ``written`` (unix s, Redis's clock) sets the
    entry id's time, as if it had been written then (None: now)."""
    r.zadd(RUNS, {a["run"]: T - 3600}, nx=True)
    stream = run_keys(a["run"]).anomaly_log
    eid = "*"
    if written is not None:
        ms = int(written * 1000)
        last = r.xrevrange(stream, count=1)
        seq = int(last[0][0].decode().split("-")[1]) + 1 if last and last[0][0].decode().startswith(f"{ms}-") else 0
        eid = f"{ms}-{seq}"
    out = r.xadd(stream, {"id": a["id"], "transition": transition, "kind": a["kind"], "severity": a["severity"],
                          "step": a["step"], "json": json.dumps(a, sort_keys=True)}, id=eid)
    return out.decode()


def config(url: str = "http://127.0.0.1:9/hook", path: str = "test.toml", **route: Any) -> AlertsConfig:
    os.environ["TH_TEST_WEBHOOK_SECRET"] = SECRET
    return parse({"dashboard_url": "http://dash:8501", "route": {"receivers": ["bot"], **route},
                  "sinks": {"bot": {"type": "webhook", "url": url, "secret_env": "TH_TEST_WEBHOOK_SECRET",
                                    "timeout": 2}},
                  "delivery": {"backoff_base": "1s", "jitter": 0}}, path)


def summary(notes: list[Notification]) -> list[tuple]:
    return [(n.group_key, n.seq, n.reason, [a.key for a in n.firing], [a.key for a in n.resolved]) for n in notes]


def test_a_stale_backlog_is_tracked_but_not_notified(r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    hour_ago = redis_now(r) - 3600
    strag = anomaly("old-run", last=T - 1800)
    log(r, "opened", strag, written=hour_ago)
    spike = anomaly("old-run", kind="loss_spike", ranks=(), step=300, severity="critical", last=T - 1700)
    log(r, "opened", spike, written=hour_ago + 1)
    log(r, "resolved", {**spike, "status": "resolved", "end_step": 310, "last_seen": T - 1690}, written=hour_ago + 2)
    log(r, "opened", anomaly("new-run", kind="hang", ranks=(), step=900, severity="critical", last=T))  # fresh
    clock = Clock(T)
    intake = Intake(r, config(), consumer="w", clock=clock)
    with caplog.at_level(logging.INFO, logger="trainhealth.alerts.intake"):
        assert intake.run_once() == []
    assert intake.stale == 3
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(intake.stale_before))
    assert [m.getMessage() for m in caplog.records if "catch-up" in m.getMessage()] == [
        f"intake: catch-up: 3 anomaly transitions of 1 run (old-run) not notified as stale: written before {when}, "
        "more than the 10 min catch-up window (--catch-up) before this worker started; their alerts are tracked, "
        "later changes notify"]
    # the stale straggler is in its group, known but never notified; the stale spike came and went
    g = json.loads(r.hget(ALERTS_GROUPS, 'root:{run="old-run",kind="straggler"}'))
    assert (g["quiet"], g["notified"], g["seq"], g["last_notified_at"]) == (
        {"old-run/straggler:5:250:0": "warning"}, {}, 0, None)
    assert r.hlen(ALERTS_GROUPS) == 2  # the straggler's and the fresh hang's
    clock.t = T + 30
    assert summary(intake.run_once()) == [('root:{run="new-run",kind="hang"}', 1, "new",
                                           ["new-run/hang:*:900:0"], [])]
    # a fresh "updated" at the same severity is no news
    log(r, "updated", {**strag, "last_seen": T + 40})
    for t in (T + 40, T + 400):
        clock.t = t
        assert intake.run_once() == []
    # escalated now: news, the group's first notification (at its tick: created at T - 1800, every 300 s after
    # group_wait); its resolve is then reported
    log(r, "updated", {**strag, "severity": "critical", "last_seen": T + 500})
    clock.t = T + 500
    assert intake.run_once() == []
    clock.t = T + 630
    assert summary(intake.run_once()) == [('root:{run="old-run",kind="straggler"}', 1, "new",
                                           ["old-run/straggler:5:250:0"], [])]
    log(r, "resolved", {**strag, "severity": "critical", "status": "resolved", "end_step": 260, "last_seen": T + 700})
    clock.t = T + 700
    assert intake.run_once() == []
    clock.t = T + 930
    assert summary(intake.run_once()) == [('root:{run="old-run",kind="straggler"}', 2, "resolved", [],
                                           ["old-run/straggler:5:250:0"])]
    notes = [json.loads(f[b"json"]) for _, f in r.xrange(ALERTS_OUTBOX)]
    assert [(n["group_key"], n["seq"], n["reason"]) for n in notes] == [
        ('root:{run="new-run",kind="hang"}', 1, "new"), ('root:{run="old-run",kind="straggler"}', 1, "new"),
        ('root:{run="old-run",kind="straggler"}', 2, "resolved")]


def test_a_stale_alert_that_resolves_later_is_never_notified(r: redis.Redis) -> None:
    a = anomaly("r1", last=T - 1800)
    log(r, "opened", a, written=redis_now(r) - 3600)
    clock = Clock(T)
    intake = Intake(r, config(), consumer="w", clock=clock)
    assert intake.run_once() == [] and intake.stale == 1
    log(r, "resolved", {**a, "status": "resolved", "end_step": 260, "last_seen": T + 10})
    for t in (T + 10, T + 400):
        clock.t = t
        assert intake.run_once() == []
    assert r.xlen(ALERTS_OUTBOX) == 0 and r.hlen(ALERTS_GROUPS) == 0


def test_a_restart_within_the_window_and_a_zero_window_notify_as_before(r: redis.Redis) -> None:
    a = anomaly("r1", last=T)
    log(r, "opened", a, written=redis_now(r) - 599)  # younger than the window: not stale
    intake = Intake(r, config(), consumer="w", clock=Clock(T + 30))
    assert summary(intake.run_once()) == [('root:{run="r1",kind="straggler"}', 1, "new", ["r1/straggler:5:250:0"], [])]
    assert intake.stale == 0
    b = anomaly("r2", last=T)
    log(r, "opened", b, written=redis_now(r) - 86400)
    off = Intake(r, config(), consumer="w2", clock=Clock(T + 60), catch_up=0)
    assert summary(off.run_once()) == [('root:{run="r2",kind="straggler"}', 1, "new", ["r2/straggler:5:250:0"], [])]
    with pytest.raises(ValueError, match=r"catch_up=-1\.0 must be a finite number of seconds >= 0"):
        Intake(r, config(), consumer="w3", catch_up=-1.0)


def test_runs_that_are_over_are_not_paged_not_even_by_the_repeat_of_a_restored_group(
        r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    hour_ago = redis_now(r) - 3600
    done = anomaly("done", kind="divergence", ranks=(), step=700, severity="critical", last=T)
    live = anomaly("live", kind="divergence", ranks=(), step=700, severity="critical", last=T)
    down = anomaly("down", kind="dead_rank", ranks=(1,), step=700, severity="critical", last=T)
    log(r, "opened", done, written=hour_ago)
    log(r, "opened", live, written=hour_ago)
    log(r, "opened", down, written=hour_ago)
    # an earlier worker (no window) notified all three while the runs were running
    first = Intake(r, config(), consumer="first", clock=Clock(T + 30), catch_up=0)
    assert [n.seq for n in first.run_once()] == [1, 1, 1]
    r.hset(run_keys("done").meta, "status", "finished")
    r.hset(run_keys("live").meta, "status", "running")
    r.hset(run_keys("down").meta, "status", "crashed")  # waits for a relaunch: its page keeps repeating
    # four hours later a worker starts: the running run's divergence and the crash are repeated
    clock = Clock(T + 30 + defaults.ALERT_REPEAT_INTERVAL_S + 300)
    second = Intake(r, config(), consumer="second", clock=clock)
    with caplog.at_level(logging.INFO, logger="trainhealth.alerts.intake"):
        assert summary(second.run_once()) == [
            ('root:{run="down",kind="dead_rank"}', 2, "repeat", ["down/dead_rank:1:700:0"], []),
            ('root:{run="live",kind="divergence"}', 2, "repeat", ["live/divergence:*:700:0"], [])]
    assert [m.getMessage() for m in caplog.records if "over" in m.getMessage()] == [
        "intake: not paging the alerts of 1 run that are over (meta status not running or crashed, no anomaly "
        "transition for 10 min): done"]
    assert second.grouper.ended_runs == frozenset({"done"})
    # a late transition of the finished run: it is heard again, and the resolve closes what was paged
    log(r, "resolved", {**done, "status": "resolved", "end_step": 710, "last_seen": clock.t})
    second.run_once()
    clock.t += 300
    assert summary(second.run_once()) == [('root:{run="done",kind="divergence"}', 2, "resolved", [],
                                           ["done/divergence:*:700:0"])]
    assert second.grouper.ended_runs == frozenset()


def test_finished_runs_and_replays_raise_no_service_down(r: redis.Redis) -> None:
    now = T
    for run, meta in (("fin", {"status": "finished"}), ("rep", {"status": "running", "source": "replay:train.log"}),
                      ("crashed", {"status": "crashed"})):
        r.zadd(RUNS, {run: now - 100})
        r.hset(run_keys(run).meta, mapping=meta)
        r.hset(run_keys(run).heartbeats, "0", json.dumps({"t": now - 5, "step": 10}))
    assert check_service(r, now, 60.0) == ServiceCheck(False, None, ())
    clock = Clock(now)
    intake = Intake(r, config(), consumer="w", clock=clock)
    intake.run_once()
    clock.t = now + 30
    assert intake.run_once() == [] and not intake.service_down
    # a live job's ranks still count (meta without a status, as a job that has not written one yet)
    r.zadd(RUNS, {"job": now})
    r.hset(run_keys("job").heartbeats, "0", json.dumps({"t": now - 5, "step": 10}))
    assert check_service(r, now, 60.0) == ServiceCheck(True, None, ("job",))


# -- the worker process against a real HTTP receiver --------------------------------------------------------------
def _toml(tmp_path: Path, url: str) -> Path:
    p = tmp_path / "alerts.toml"
    p.write_text(f"""
dashboard_url = "http://dash:8501"
[route]
receivers = ["bot"]
group_wait = "0s"
group_interval = "1s"
[sinks.bot]
type = "webhook"
url = "{url}"
secret_env = "TH_TEST_WEBHOOK_SECRET"
timeout = "20s"
""")
    return p


@pytest.fixture
def worker_env(redis_url: str) -> dict[str, str]:
    return {**os.environ, "TH_TEST_WEBHOOK_SECRET": SECRET, "TRAINHEALTH_REDIS_URL": redis_url}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _wait(cond: Any, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "trainhealth", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_worker_started_on_an_old_redis_sends_only_the_fresh_notification(
        r: redis.Redis, httpserver: HTTPServer, worker_env: dict[str, str], tmp_path: Path,
        procs: list[subprocess.Popen]) -> None:
    received: list[dict] = []

    def hook(req: Request) -> Response:
        verify(req.get_data(), req.headers["X-Trainhealth-Signature"], SECRET.encode())
        received.append(json.loads(req.get_data()))
        return Response("ok")

    httpserver.expect_request("/hook").respond_with_handler(hook)
    now = time.time()
    hour_ago = redis_now(r) - 3600
    # what earlier sessions left: a finished job's divergence, and a replay that ended a moment ago with its
    # ranks' last heartbeats still fresh and no detector service running
    div = anomaly("old-job", kind="divergence", ranks=(), step=700, severity="critical", last=now - 1800)
    log(r, "opened", div, written=hour_ago)
    log(r, "opened", anomaly("old-job", ranks=(3,), last=now - 1790), written=hour_ago + 10)
    r.hset(run_keys("old-job").meta, "status", "finished")
    r.zadd(RUNS, {"replayed": now - 60})
    r.hset(run_keys("replayed").meta, mapping={"status": "finished", "source": "replay:train.log"})
    r.hset(run_keys("replayed").heartbeats, "0", json.dumps({"t": now - 5, "step": 99}))
    log(r, "opened", anomaly("fresh", kind="hang", ranks=(), step=50, severity="critical", last=now))
    cfg = _toml(tmp_path, httpserver.url_for("/hook"))
    out = (tmp_path / "w.log").open("w")
    w = subprocess.Popen([PYTHON, "-m", "trainhealth", "alerts", "--config", str(cfg), "--consumer", "w",
                          "--catch-up", "10m"], cwd=ROOT, env=worker_env, stdout=out, stderr=subprocess.STDOUT)
    procs.append(w)
    _wait(lambda: received, what="the fresh notification")
    time.sleep(3.0)  # three group intervals and a watchdog check: nothing else may come
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    assert [(p["group_key"], p["status"], [a["key"] for a in p["alerts"]]) for p in received] == [
        ('root:{run="fresh",kind="hang"}', "firing", ["fresh/hang:*:50:0"])]
    text = (tmp_path / "w.log").read_text()
    assert "catch-up window 600 s" in text
    assert "intake: catch-up: 2 anomaly transitions of 1 run (old-job) not notified as stale: written before " in text
    assert "intake: not paging the alerts of 1 run that are over (meta status not running or crashed, no anomaly " \
           "transition for 10 min): old-job" in text
    assert "service_down" not in text


def test_catch_up_flag_is_checked_and_shown(worker_env: dict[str, str], tmp_path: Path) -> None:
    cfg = _toml(tmp_path, "https://hooks.example/x")
    bad = _cli(worker_env, "alerts", "--config", str(cfg), "--catch-up", "ten minutes")
    assert bad.returncode == 2
    assert bad.stderr.strip().endswith("--catch-up='ten minutes' is not a duration (e.g. 10m, 1h, 0 to turn it off)")
    shown = _cli(worker_env, "alerts", "--config", str(cfg), "--check", "--catch-up", "1h")
    assert shown.returncode == 0
    assert shown.stdout.splitlines()[-1] == "  catch-up: transitions older than 3600 s at start are not notified"
    off = _cli(worker_env, "alerts", "--config", str(cfg), "--check", "--catch-up", "0")
    assert off.stdout.splitlines()[-1] == "  catch-up: off (every transition read is notified, however old)"
    default = _cli(worker_env, "alerts", "--config", str(cfg), "--check")
    assert default.stdout.splitlines()[-1] == "  catch-up: transitions older than 600 s at start are not notified"


# -- doctor ------------------------------------------------------------------------------------------------------
def test_doctor_passes_where_alerting_was_never_configured_even_with_silences(
        r: redis.Redis, worker_env: dict[str, str]) -> None:
    store.add_silence(r, ['run="r1"'], duration_s=3600, now=T)  # the dashboard stores silences on any Redis
    assert doctor_report(r, now=T) == (["Alert worker: not configured (no heartbeat, no alert state): "
                                        "`trainhealth alerts --config FILE`"], True)
    r.set(service_heartbeat("svc"), json.dumps({"t": time.time(), "pid": 1, "host": "h", "runs": 0}))
    out = _cli(worker_env, "doctor")
    assert out.returncode == 0, out.stdout
    assert "Alert worker: not configured" in out.stdout and "NOT RUNNING" not in out.stdout


def test_doctor_fails_once_a_worker_ran_here_even_if_it_left_nothing_else(r: redis.Redis, tmp_path: Path,
                                                                          worker_env: dict[str, str]) -> None:
    path = tmp_path / "alerts.toml"
    path.write_text("# the worker's config\n")
    Intake(r, config(path=str(path)), consumer="w", clock=Clock(T)).run_once()  # a worker ran; no anomaly yet
    assert doctor_report(r, now=T + 5) == ([
        f"Alert worker: NOT RUNNING (no live heartbeat; the last one started 5 s ago with --config {path}): "
        "notifications are not being sent; start `trainhealth alerts --config FILE`",
        "Outbox: 0 pending, 0 dead letters, 0 alert groups"], False)
    r.set(service_heartbeat("svc"), json.dumps({"t": time.time(), "pid": 1, "host": "h", "runs": 0}))
    out = _cli(worker_env, "doctor")
    assert out.returncode == 1 and "Alert worker: NOT RUNNING (no live heartbeat; the last one started " in out.stdout


# -- the try count of a resend after a crash ----------------------------------------------------------------------
def _note(group: str) -> Notification:
    a = Alert.from_transition("r1", "opened", anomaly("r1"))
    return Notification(group_key=group, route="root", receivers=("bot",), group_labels={"run": "r1"}, seq=1,
                        at=T + 30, reason="new", firing=(a,), resolved=(), group_started=T)


def test_a_resend_after_a_crash_is_counted_as_try_2(r: redis.Redis, httpserver: HTTPServer,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    statuses: list[int] = []
    keys: list[str] = []

    def hook(req: Request) -> Response:
        keys.append(req.headers["Idempotency-Key"])
        return Response("ok" if not statuses else "nope", statuses.pop(0) if statuses else 200)

    httpserver.expect_request("/hook").respond_with_handler(hook)
    cfg = config(httpserver.url_for("/hook"))

    def crash_after_sending(group: str) -> None:
        pipe = r.pipeline(transaction=True)
        enqueue(pipe, _note(group), cfg.sinks, T)
        pipe.execute()
        with httpx.Client() as http:
            dies = Deliverer(r, cfg.sinks, cfg.delivery, consumer="dies", clock=Clock(T), http=http)

            def killed(*_: Any) -> None:
                raise KeyboardInterrupt("killed after the POST, before the acknowledging transaction")

            dies._done = killed  # type: ignore[method-assign]
            with pytest.raises(KeyboardInterrupt):
                dies.run_once()

    crash_after_sending("g1")
    assert len(keys) == 1 and r.xpending(ALERTS_OUTBOX, "th-alerts-delivery")["pending"] == 1
    with httpx.Client() as http, caplog.at_level(logging.INFO, logger="trainhealth.alerts.outbox"):
        assert Deliverer(r, cfg.sinks, cfg.delivery, consumer="next", clock=Clock(T + 60), http=http).run_once() == 1
    assert [m.getMessage() for m in caplog.records if m.getMessage().startswith("delivered")] == [
        "delivered notification #1 of g1 to sink bot (try 2)"]
    assert len(keys) == 2 and keys[0] == keys[1]
    assert [(d["group"], d["attempts"]) for d in store.recent_notifications(r)] == [("g1", 2)]
    # the crashed try counts against max_attempts too: with 2 allowed, a 500 on the resend is the last try
    crash_after_sending("g2")
    statuses.append(500)
    two = DeliveryConfig(max_attempts=2, backoff_base=1.0, backoff_max=300.0, jitter=0.0, retry_after_max=3600.0)
    with httpx.Client() as http:
        assert Deliverer(r, cfg.sinks, two, consumer="next", clock=Clock(T + 60), http=http).run_once() == 1
    (letter,) = store.dead_letters(r)
    assert (letter["group"], letter["attempts"], letter["status"], letter["error"]) == (
        "g2", 2, 500, "gave up after 2 tries: HTTP 500: nope")
