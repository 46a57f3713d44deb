"""Drops and losses are first-class: what the collectors lost, and steps missing ranks, reach the ledger, the
Goodput page and its numbers (issue 15)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import redis

from trainhealth.collectors import Monitor
from trainhealth.coverage import data_lost_text
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.ledger import GoodputLedger
from trainhealth.detectors.service import DetectorService
from trainhealth.text import fmt_pct
from trainhealth.wire import Event

T0 = 1_796_000_000.0


def test_ledger_counts_drops_by_cause_and_rank_and_steps_missing_ranks() -> None:
    led = GoodputLedger(world_size=4)
    led.note_start(T0)
    for s in range(10):
        n = 3 if s in (4, 5) else 4  # rank 2's records of steps 4-5 were lost
        led.add_step(StepAggregate(s, 0, T0, T0 + s, T0 + s + 1.0, 2.0, 1.0, None, 100 * n, None, n, (None,) * 4, 0.0))
    led.add_event(Event("collector_drops", 2, T0 + 7, T0, extra={"count": "2", "buffer": "2"}))
    led.add_event(Event("collector_drops", 3, T0 + 8, T0, extra={"count": "5", "unencodable": "1"}))  # 4 unsaid
    snap = led.snapshot(T0 + 11)
    assert snap["records_dropped"] == {"total": 7, "buffer": 2, "unencodable": 1, "unknown": 4,
                                       "by_rank": {"2": 2, "3": 5}}
    assert snap["steps_partial"] == 2
    assert snap["coverage_pct"] == round(100 * 38 / 45, 3)  # 38 records seen; 38 + 7 dropped > 4 x 10
    clean = GoodputLedger(world_size=2).snapshot(T0)
    assert (clean["records_dropped"], clean["steps_partial"], clean["coverage_pct"]) == (
        {"total": 0, "by_rank": {}}, 0, None)


def test_records_a_full_buffer_dropped_reach_the_ledger(own_redis) -> None:
    own_redis.stop()  # Redis away: the 50-record buffer keeps the newest records only
    mon = Monitor("run-drop", redis_url=own_redis.url, rank=0, world_size=1, buffer_records=50, flush_interval=0.01,
                  spill_dir=False)
    for s in range(120):
        mon.log_step(s, loss=1.0, tokens=10)
    own_redis.start()
    assert mon.flush(40)
    mon.close()
    client = redis.Redis.from_url(own_redis.url)
    svc = DetectorService(client, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(5):
        svc.run_once(block_ms=10)
    snap = json.loads(client.get("th:{run-drop}:ledger:latest"))
    # run_start plus steps 0-69 were dropped in the buffer; steps 70-119 arrived whole.
    assert (snap["steps_done"], snap["records_dropped"], snap["steps_partial"]) == (
        50, {"total": 71, "buffer": 71, "by_rank": {"0": 71}}, 0)
    assert snap["coverage_pct"] == round(100 * 50 / 121, 3)
    # ... and `trainhealth doctor` says so (informational: its exit code is about what is down)
    out = subprocess.run([sys.executable, "-m", "trainhealth", "doctor"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TRAINHEALTH_REDIS_URL": own_redis.url})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("Data")]
    assert lines == ["Data lost: run run-drop: the run's history before step 70 was dropped by the collectors: the "
                     "figures cover the run from there; the collectors dropped 71 records on rank 0 (71 in the full "
                     "in-memory buffer). The figures rest on 41.3% of the rank-steps."]
    assert snap["history_lost"] == {"before_step": 70, "first_seen_t": snap["history_lost"]["first_seen_t"],
                                    "ranks": [0], "cause": "collector"}
    assert not [a for a in client.hvals("th:{run-drop}:anomalies") if b"data_loss" in a]  # not a Redis loss


def test_a_redis_restarted_without_its_data_is_a_data_loss_not_start_up(own_redis) -> None:
    # Steps 0-99 reach Redis; Redis restarts empty (no persistence); the job goes on with steps 100-149.
    mon = Monitor("run-wipe", redis_url=own_redis.url, rank=0, world_size=1, flush_interval=0.01, spill_dir=False,
                  heartbeat_interval=0.2)
    for s in range(100):
        mon.log_step(s, loss=2.0 - s / 200 + 0.01 * (s % 7), tokens=10)
    assert mon.flush(20)
    own_redis.stop()
    own_redis.start()
    for s in range(100, 150):
        mon.log_step(s, loss=2.0 - s / 200 + 0.01 * (s % 7), tokens=10)
    time.sleep(0.5)  # a heartbeat puts what is missing of the registry back (redis-py reconnected by itself)
    assert mon.flush(40)
    client = redis.Redis.from_url(own_redis.url)
    svc = DetectorService(client, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(5):
        svc.run_once(block_ms=10)
    [loss] = [json.loads(v) for v in client.hgetall("th:{run-wipe}:anomalies").values()]
    assert (loss["kind"], loss["severity"], loss["step"], loss["status"], loss["ranks"]) == (
        "data_loss", "info", 100, "resolved", [0])
    assert loss["message"].startswith("the run's history before step 100 is not in Redis (rank 0 sent records of "
                                      "step 100 on, but their start is missing)")
    snap = json.loads(client.get("th:{run-wipe}:ledger:latest"))
    assert snap["history_lost"]["before_step"] == 100 and snap["steps_done"] == 50
    assert snap["seconds"]["program_startup"] == 0.0  # the unknown time before step 100 is not start-up
    assert snap["started_at"] > mon.inc  # the ledger starts at the first step seen, not at the process start
    assert client.zscore("th:runs", "run-wipe") is not None and client.hget("th:{run-wipe}:meta", "world_size") == b"1"
    mon.close()


def test_a_run_that_kept_its_history_has_no_data_loss(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("run-kept", redis_url=redis_url, rank=0, world_size=1, flush_interval=0.01, spill_dir=False)
    for s in range(50):
        mon.log_step(s, loss=2.0 - s / 200 + 0.01 * (s % 7), tokens=10)
    mon.close()
    svc = DetectorService(r, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(3):
        svc.run_once(block_ms=10)
    assert not [a for a in r.hvals("th:{run-kept}:anomalies") if b"data_loss" in a]
    assert json.loads(r.get("th:{run-kept}:ledger:latest"))["history_lost"] is None


def test_a_relaunch_without_run_start_after_history_seen_is_no_data_loss() -> None:
    """Only the run's first records judge the history: a later incarnation without its run_start (an older
    collector, records pushed by hand) follows history that is there, however the reads cut the stream."""
    from trainhealth.detectors.pipeline import RunPipeline

    p = RunPipeline(1, hang=HangDetector(floor_s=1e9), run="x")
    p.feed_event(Event(kind="run_start", rank=0, step=0, t=T0, inc=T0))
    for s in range(20):
        p.feed_step(_rec(s, T0 + 1 + s, T0))
    assert p.check_history().anomalies == []
    for s in range(20, 40):  # a relaunch at step 20 whose run_start never came
        p.feed_step(_rec(s, T0 + 100 + s, T0 + 90))
    assert p.check_history().anomalies == []
    assert p.ledger.snapshot(T0 + 200)["history_lost"] is None


def test_first_records_past_step_zero_without_run_start_are_one_data_loss() -> None:
    from trainhealth.detectors.pipeline import RunPipeline

    p = RunPipeline(2, hang=HangDetector(floor_s=1e9), run="x")
    assert p.check_history().anomalies == []  # nothing read yet: not judged
    for s in range(3729, 3740):
        for rank in (0, 1):
            p.feed_step(_rec(s, T0 + s, T0, rank))
    (a,) = p.check_history().anomalies
    assert (a.kind, a.severity, a.step, a.ranks, a.evidence["before_step"]) == ("data_loss", "info", 3729, (0, 1),
                                                                                3729)
    for s in range(3740, 3745):  # judged once
        p.feed_step(_rec(s, T0 + s, T0 + 1, 0))
    assert p.check_history().anomalies == []


def _rec(step: int, t: float, inc: float, rank: int = 0):
    from trainhealth.wire import StepRecord

    return StepRecord(rank=rank, step=step, inc=inc, t=t, dur=1.0, loss=2.0, tokens=10)


def test_records_redis_trimmed_before_the_service_read_them_are_counted_once(r: redis.Redis, redis_url: str,
                                                                           caplog) -> None:
    # One record per entry (a flush per step), retention 100 records: the stream keeps the newest 100 entries.
    mon = Monitor("run-trim", redis_url=redis_url, rank=0, world_size=1, flush_interval=0.01, spill_dir=False,
                  retention=100)
    svc = DetectorService(r, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=1e9))
    for s in range(350):
        mon.log_step(s, loss=2.0 - s / 400 + 0.01 * (s % 7), tokens=10)
        assert mon.flush(5)
        if s == 49:  # the service reads steps 0-49, then lags while steps 50-249 are written and trimmed
            for _ in range(3):
                svc.run_once(block_ms=10)
    mon.close()
    entries = r.xrange("th:{run-trim}:steps")
    assert [(f[b"seq"], f[b"n"]) for _, f in entries[:2]] == [(b"250", b"1"), (b"251", b"1")]
    assert len(entries) == 100
    with caplog.at_level("WARNING", logger="trainhealth.detectors.service"):
        for _ in range(5):
            svc.run_once(block_ms=10)
    assert [m for m in caplog.messages if "trimmed" in m] == [
        "run run-trim: 200 step records of rank 0 were trimmed from Redis before this service read them (the "
        "collectors' retention, $TRAINHEALTH_RETENTION); counted as dropped"]
    snap = json.loads(r.get("th:{run-trim}:ledger:latest"))
    assert snap["records_dropped"] == {"total": 200, "trimmed": 200, "by_rank": {"0": 200}}
    assert snap["history_lost"] is None  # the run's start was read: only the middle is gone
    assert data_lost_text(snap) == ("200 records were lost on rank 0 (200 trimmed from Redis by the retention bound "
                                    "before the service read them). The figures rest on "
                                    f"{fmt_pct(snap['coverage_pct'])} of the rank-steps.")
    assert snap["coverage_pct"] == round(100 * 150 / 350, 3)
    # A rebuild (a restarted service) reads the count back from the events stream and reports nothing twice.
    svc2 = DetectorService(r, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(3):
        svc2.run_once(block_ms=10)
    assert json.loads(r.get("th:{run-trim}:ledger:latest"))["records_dropped"] == snap["records_dropped"]
    service_events = [f for _, f in r.xrange("th:{run-trim}:events") if f.get(b"by") == b"service"]
    assert [(f[b"kind"], f[b"count"], f[b"trimmed"], f[b"rank"]) for f in service_events] == [
        (b"collector_drops", b"200", b"200", b"0")]
