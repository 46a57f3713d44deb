"""The detector service on a real redis-server: consumer groups, write-back, restart without duplicates."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import redis

from trainhealth import Monitor
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import DetectorService

T0 = 1_800_000_000.0


def write_run(client: redis.Redis, run: str, steps: range, *, world: int = 2, spike_at: int | None = None,
              nan_at: int | None = None, slow_rank: int | None = None) -> None:
    """Push a scripted run through real Monitors (one per rank), steps of 1 s from T0 + 10."""
    mons = [Monitor(run, client=client, rank=r, world_size=world, host=f"node-{r}", started_at=T0,
                    flush_interval=0.01, gpu_hour_usd=1.0) for r in range(world)]
    for s in steps:
        for r, mon in enumerate(mons):
            loss = 3.0 + 0.001 * ((s * 7 + r) % 5)
            if s == spike_at:
                loss = 9.0
            if s == nan_at:
                loss = float("nan")
            busy = 0.2 if r == slow_rank else 0.1
            mon._sections = {"data": 0.01, "forward_backward": busy}  # as timed by mon.section()
            mon.log_step(s, loss=loss, grad_norm=1.0, lr=1e-4, tokens=1000, timestamp=T0 + 10 + s)
    for mon in mons:
        assert mon.flush(10)
        mon._sender.stop(1)


def drain(service: DetectorService, rounds: int = 50) -> None:
    for _ in range(rounds):
        if service.run_once(block_ms=20) == 0:
            break


def log_entries(r: redis.Redis, run: str) -> list[tuple[str, str]]:
    return [(f[b"transition"].decode(), f[b"id"].decode()) for _, f in r.xrange(f"th:{{{run}}}:anomaly_log")]


def test_service_writes_aggregates_anomalies_ledger_and_heartbeat(r: redis.Redis, valid_run) -> None:
    write_run(r, "svc", range(0, 120), spike_at=80, nan_at=100, slow_rank=1)
    svc = DetectorService(r, consumer="test", clock=lambda: T0 + 200, snapshot_interval=0.0,
                          hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    # one aggregate per step, both ranks merged
    aggs = r.xrange("th:{svc}:agg")
    assert len(aggs) == 120
    f = aggs[5][1]
    assert (f[b"step"], f[b"n_ranks"], f[b"tokens"], json.loads(f[b"busy"])) == (b"5", b"2", b"2000", [0.11, 0.21])
    anomalies = {k.decode(): json.loads(v) for k, v in r.hgetall("th:{svc}:anomalies").items()}
    assert sorted(anomalies) == ["loss_spike:*:80:0", "nan_inf:*:100:0", "straggler:1:0:0"]
    st = anomalies["straggler:1:0:0"]
    assert (st["status"], st["ranks"], st["hosts"], round(st["evidence"]["score"], 3)) == (
        "active", [1], ["node-1"], round(0.11 / 0.21, 3))
    spike = anomalies["loss_spike:*:80:0"]
    assert (spike["status"], spike["end_step"], spike["evidence"]["peak"]) == ("resolved", 80, 9.0)
    nan = anomalies["nan_inf:*:100:0"]
    assert (nan["severity"], nan["status"], nan["end_step"], nan["ranks"]) == ("critical", "resolved", 100, [0, 1])
    assert log_entries(r, "svc") == [
        ("opened", "straggler:1:0:0"), ("opened", "loss_spike:*:80:0"), ("resolved", "loss_spike:*:80:0"),
        ("opened", "nan_inf:*:100:0"), ("resolved", "nan_inf:*:100:0")]
    snap = json.loads(r.get("th:{svc}:ledger:latest"))
    # The first untimed step's time is start-up, so its tokens are not throughput: 119 steps' are.
    assert (snap["steps_done"], snap["tokens_total"], snap["last_step"]) == (120, 238_000, 119)
    assert snap["tokens_unobserved"] == 2_000
    assert snap["seconds"]["program_startup"] == 10.0  # T0 -> first step start (untimed steps start at the last end)
    assert abs(sum(snap["seconds"].values()) - snap["wall_s"]) < 1e-6
    svc.beat()  # the heartbeat thread's write (run_forever starts it)
    assert r.ttl("th:service:test") > 0
    beat = json.loads(r.get("th:service:test"))
    assert (beat["runs"], beat["processed"], beat["progress_t"] is not None) == (1, 4, True)  # 4 stream entries
    assert r.xpending("th:{svc}:steps", "th-detectors")["pending"] == 0
    # Every record the collectors and the service wrote is a document of its published schema.
    counts = valid_run(r, "svc")
    assert counts["anomaly"] == 3 + 5 and counts["incident"] >= 3 and counts["recommendation"] >= 1
    assert counts["step-records"] >= 2 and counts["event"] == 2 and counts["ledger-snapshot"] >= 2


def test_restarted_service_resumes_without_duplicate_alerts(r: redis.Redis) -> None:
    write_run(r, "rs", range(0, 90), spike_at=70)
    svc = DetectorService(r, consumer="a", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    assert log_entries(r, "rs") == [("opened", "loss_spike:*:70:0"), ("resolved", "loss_spike:*:70:0")]
    n_agg = r.xlen("th:{rs}:agg")
    # The service dies. More steps arrive; a new service process takes over.
    write_run(r, "rs", range(90, 150), spike_at=130)
    svc2 = DetectorService(r, consumer="a", clock=lambda: T0 + 300, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc2)
    assert log_entries(r, "rs") == [
        ("opened", "loss_spike:*:70:0"), ("resolved", "loss_spike:*:70:0"),
        ("opened", "loss_spike:*:130:0"), ("resolved", "loss_spike:*:130:0")]
    assert n_agg == 90
    assert [int(f[b"step"]) for _, f in r.xrange("th:{rs}:agg")] == list(range(150))


def test_crash_between_read_and_ack_is_processed_once(r: redis.Redis) -> None:
    write_run(r, "cr", range(0, 100), spike_at=60)
    # A service read everything (delivered, pending) and died before writing or acknowledging.
    for key in ("th:{cr}:steps", "th:{cr}:events"):
        with contextlib.suppress(redis.ResponseError):
            r.xgroup_create(key, "th-detectors", id="0")
        r.xreadgroup("th-detectors", "dead", {key: ">"}, count=10_000)
    assert r.xpending("th:{cr}:steps", "th-detectors")["pending"] == 2  # one batch entry per rank
    svc = DetectorService(r, consumer="b", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    assert r.xpending("th:{cr}:steps", "th-detectors")["pending"] == 0
    assert log_entries(r, "cr") == [("opened", "loss_spike:*:60:0"), ("resolved", "loss_spike:*:60:0")]
    assert r.xlen("th:{cr}:agg") == 100
    # And once more, after b's lease expired: a third service process changes nothing.
    r.delete("th:{cr}:owner")
    svc3 = DetectorService(r, consumer="c", clock=lambda: T0 + 250, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc3)
    assert len(log_entries(r, "cr")) == 2 and r.xlen("th:{cr}:agg") == 100


def test_hang_from_heartbeats_and_finished_run_is_left_alone(r: redis.Redis, valid_run) -> None:
    write_run(r, "hg", range(0, 30), world=1)
    now = T0 + 1000.0
    r.hset("th:{hg}:hb", "0", json.dumps({"t": now - 2, "step": 29, "step_t": T0 + 39, "phase": "train",
                                          "host": "node-0", "pid": 1, "inc": T0, "mem": None, "gpu": None}))
    svc = DetectorService(r, consumer="h", clock=lambda: now, hang_factory=lambda: HangDetector(floor_s=60))
    drain(svc)
    svc._tick(now)
    a = json.loads(r.hget("th:{hg}:anomalies", "hang:*:29:0"))
    assert (a["kind"], a["severity"], a["ranks"], a["hosts"], a["evidence"]["stalled_s"]) == (
        "hang", "critical", [0], ["node-0"], 961.0)
    counts = valid_run(r, "hg")
    assert (counts["job-state"], counts["heartbeat"]) == (1, 1)


def test_two_services_split_runs_by_lease_and_hand_over_without_duplicates(r: redis.Redis) -> None:
    write_run(r, "one", range(0, 80), spike_at=50)
    a = DetectorService(r, consumer="a", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    b = DetectorService(r, consumer="b", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(a)
    drain(b)
    assert list(a.runs) == ["one"] and list(b.runs) == []  # one owner per run
    assert r.get("th:{one}:owner") == b"a"
    write_run(r, "two", range(0, 80), spike_at=60)
    drain(b)  # b sees the new run first and takes it
    drain(a)
    assert list(a.runs) == ["one"] and list(b.runs) == ["two"]
    # a shuts down and releases its lease; b takes "one" over and rebuilds it: no second alert
    a.stop()
    a.run_forever()
    assert r.exists("th:{one}:owner") == 0
    write_run(r, "one", range(80, 100))
    drain(b)
    assert sorted(b.runs) == ["one", "two"]
    assert log_entries(r, "one") == [("opened", "loss_spike:*:50:0"), ("resolved", "loss_spike:*:50:0")]
    assert r.xlen("th:{one}:agg") == 100
    # a lease taken by someone else is noticed at the next tick
    r.set("th:{two}:owner", "intruder")
    b._tick(T0 + 201)
    assert sorted(b.runs) == ["one"]


def test_service_survives_a_run_deleted_under_its_blocking_read(r: redis.Redis, redis_url: str) -> None:
    import threading

    write_run(r, "gone", range(0, 30))
    svc = DetectorService(redis.Redis.from_url(redis_url), consumer="g", block_ms=2000,
                          hang_factory=lambda: HangDetector(floor_s=1e9))
    t = threading.Thread(target=svc.run_forever, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while r.xlen("th:{gone}:agg") < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    r.flushdb()  # an operator wipes the run while the service blocks on its streams
    time.sleep(0.5)
    write_run(r, "again", range(0, 20))
    deadline = time.monotonic() + 15
    while r.xlen("th:{again}:agg") < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    svc.stop()
    t.join(10)
    assert r.xlen("th:{again}:agg") == 20
    assert not t.is_alive()


def varied_entries(world: int = 16, steps: int = 240) -> list[dict[bytes, bytes]]:
    """Step entries (5 records per rank per entry, the collectors' JSON) exercising every decode path: plain
    records, GPU-timed sections (rank 5), integer-valued floats (rank 6, the checked path), two records per
    step (rank 7: timing, then metrics, merged), three data sections (rank 8), NaN losses (step 100, rank 3:
    the standard library's parser), a rank outlier (13, from step 60), a loss spike (150), a restart of every
    rank at step 200 (new incarnation, back to step 190) and a late record (rank 3's step 199 after it)."""
    import random

    rng = random.Random(11)
    out = []
    for start in range(0, steps, 5):
        for r in range(world):
            recs = []
            for s in range(start, start + 5):
                inc, step = (T0, s) if s < 200 else (T0 + 500, s - 10)
                odd = s >= 60 and r == 13
                fwd = 0.09 * (1.05 if odd else 1.0) * (1 + rng.gauss(0, 0.12 if odd else 0.03))
                data = 0.01 * (2.0 if odd else 1.0) * (1 + rng.gauss(0, 0.1))
                rec = {"rank": r, "step": step, "inc": inc, "t": T0 + 10 + s + rng.uniform(0, 0.01), "dur": 0.2,
                       "sec.data": data, "sec.forward_backward": fwd,
                       "loss": (9.0 if s == 150 else 3.0 + rng.gauss(0, 0.01)), "grad_norm": 1.0, "lr": 1e-4,
                       "tokens": 1000, "samples": 2, "consumed_samples": (s + 1) * 2 * world, "batch_index": s,
                       "skipped": None}
                if s == 100 and r == 3:
                    rec["loss"] = float("nan")
                if r == 5:
                    rec["gpu.forward_backward"] = fwd * 0.9
                if r == 6:
                    rec.update(t=int(rec["t"]), loss=3, dur=None)
                if r == 8:
                    rec.update({"sec.data_loading": data / 3, "sec.dataloader": data / 7})
                if r == 7:
                    timing = {k: rec.pop(k) for k in ("dur", "sec.data", "sec.forward_backward")}
                    recs.append({"rank": r, "step": step, "inc": inc, "t": rec["t"] - 0.001, **timing})
                recs.append(rec)
                if r == 3 and s == 200:
                    recs.append({**rec, "step": 199, "inc": T0})
            out.append({b"rank": str(r).encode(), b"n": str(len(recs)).encode(), b"recs": json.dumps(recs).encode()})
    return out


def test_service_rows_match_the_step_record_pipeline(r: redis.Redis) -> None:
    """The service decodes straight into aggregator rows (no StepRecord per record): its aggregates and
    anomalies equal those of a pipeline fed the StepRecords of decode_steps (the reference)."""
    from trainhealth.detectors.pipeline import RunPipeline, agg_fields
    from trainhealth.wire import decode_steps

    entries = varied_entries()
    ref = RunPipeline(16, hang=HangDetector(floor_s=1e9))
    aggs, anomalies = [], {}
    for fields in entries:
        for rec in decode_steps(fields):
            out = ref.feed_step(rec)
            aggs += out.aggs
            anomalies.update((a.id, a) for a in out.anomalies)
    assert sorted(anomalies) == ["loss_spike:*:150:0", "nan_inf:*:100:0", "rank_outlier:13:60:0", "restart:*:190:1",
                                 "straggler:13:160:0"]
    assert ref.aggregator.late == 1
    # The same entries through Redis and the service, one millisecond apart (the order above).
    r.hset("th:{eq}:meta", mapping={"world_size": 16, "status": "running"})
    r.zadd("th:runs", {"eq": T0})
    for i, fields in enumerate(entries):
        r.xadd("th:{eq}:steps", fields, id=f"{1_000 + i}-0")
    svc = DetectorService(r, consumer="eq", clock=lambda: T0 + 300, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    want = [{k.encode(): str(v).encode() for k, v in agg_fields(a).items()} for a in aggs if a.step >= 0]
    got = [f for _, f in r.xrange("th:{eq}:agg")]
    assert len(got) == len(aggs) == 240 and got == want
    stored = {k.decode(): json.loads(v) for k, v in r.hgetall("th:{eq}:anomalies").items()}
    assert {i: {k: v for k, v in a.items() if k not in ("first_seen", "last_seen", "recommendation")}
            for i, a in stored.items()} == {i: json.loads(a.to_json()) for i, a in anomalies.items()}


def test_malformed_entries_are_logged_counted_and_skipped(r: redis.Redis, caplog) -> None:
    """Bad input never stops the service: a malformed entry between good ones is logged (run, entry id,
    record, field and value), counted in the service heartbeat, acknowledged and skipped."""
    import logging

    write_run(r, "bad", range(0, 10))
    bad = [(r.xadd("th:{bad}:steps", {"rank": 0, "n": 1, "recs": json.dumps(recs)}).decode(), why) for recs, why in (
        ([{"rank": 0, "step": 10, "inc": T0, "loss": 1.0}], "record 0: field 't' is missing"),
        ([{"rank": 0, "step": 10, "inc": T0, "t": T0 + 20}, {"rank": "zero", "step": 11, "inc": T0, "t": T0 + 21}],
         "record 1: field 'rank' has non-numeric value 'zero'"),
        ([{"rank": 0, "step": 10, "inc": T0, "t": T0 + 20, "sec.data": [0.1]}],
         "record 0: field 'sec.data' has non-numeric value [0.1]"),
        ([{"rank": 10**9, "step": 10, "inc": T0, "t": T0 + 20, "loss": 1.0}],
         "record 0: field 'rank' is 1000000000, not in 0..1048575"),
        ([{"rank": -1, "step": 10, "inc": T0, "t": T0 + 20, "loss": 1.0, "sec.data": 1}],
         "record 0: field 'rank' is -1, not in 0..1048575"),
    )]
    r.xadd("th:{bad}:steps", {"rank": 0, "n": 1, "recs": "not json"})
    write_run(r, "bad", range(10, 20))
    svc = DetectorService(r, consumer="m", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    with caplog.at_level(logging.WARNING, logger="trainhealth.detectors.service"):
        drain(svc)
    assert [int(f[b"step"]) for _, f in r.xrange("th:{bad}:agg")] == list(range(20))
    assert r.xpending("th:{bad}:steps", "th-detectors")["pending"] == 0
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    for entry_id, why in bad:
        assert f"run bad: skipping malformed record in entry {entry_id} in th:{{bad}}:steps: {why}" in warnings
    assert sum("field 'recs' is not a JSON list of records" in w for w in warnings) == 1
    assert svc.malformed == 6
    svc.beat(T0 + 201)  # what the heartbeat thread writes
    assert json.loads(r.get("th:service:m"))["malformed"] == 6


def test_a_failing_detector_is_isolated_counted_and_survives_a_rebuild(r: redis.Redis, caplog, monkeypatch) -> None:
    """A bug in one detector (here the grad-norm explosion detector raising on two steps) skips those steps for that
    detector only: the others, the aggregates and the ledger go on, the service keeps running (also when a
    restart replays the same entries), and the heartbeat reports the errors per run for the dashboard."""
    import logging

    from trainhealth.detectors.grad_norm_explosion import GradNormExplosionDetector

    real = GradNormExplosionDetector.update

    def buggy(self, agg):  # type: ignore[no-untyped-def]
        if agg.step in (50, 51):
            raise ZeroDivisionError("float division by zero")
        return real(self, agg)

    monkeypatch.setattr(GradNormExplosionDetector, "update", buggy)
    write_run(r, "bug", range(0, 120), spike_at=80, nan_at=100)
    svc = DetectorService(r, consumer="b", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    with caplog.at_level(logging.ERROR, logger="trainhealth.detectors.pipeline"):
        drain(svc)
    assert len(r.xrange("th:{bug}:agg")) == 120
    assert sorted(k.decode() for k in r.hgetall("th:{bug}:anomalies")) == ["loss_spike:*:80:0", "nan_inf:*:100:0"]
    errors = [rec for rec in caplog.records if rec.name == "trainhealth.detectors.pipeline"]
    assert [rec.getMessage() for rec in errors] == [
        "run bug: GradNormExplosionDetector failed at step 50 (error 1); the other detectors go on"]
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is ZeroDivisionError
    svc.beat(T0 + 201)  # what the heartbeat thread writes
    assert json.loads(r.get("th:service:b"))["detector_errors"] == {"bug": {"GradNormExplosionDetector": 2}}
    # A restarted service replays the same entries into a new pipeline: same errors, no crash, no duplicates.
    before = r.xlen("th:{bug}:anomaly_log")
    svc2 = DetectorService(r, consumer="b2", clock=lambda: T0 + 300, hang_factory=lambda: HangDetector(floor_s=1e9))
    r.delete("th:{bug}:owner")
    r.zrem("th:services", "b")  # b is gone: its beat would otherwise count it among the live services
    drain(svc2)
    assert svc2.runs["bug"].pipeline.detector_errors == {"GradNormExplosionDetector": 2}
    assert r.xlen("th:{bug}:anomaly_log") == before


def test_one_bad_record_costs_only_itself_not_its_entry(r: redis.Redis, caplog) -> None:
    """A collector batches up to 1,000 records of a rank in one entry: a record with a bad value (here
    tokens NaN, as an older collector sent it) is left out, the entry's other records are processed."""
    import logging

    recs = [{"rank": 0, "step": s, "inc": T0, "t": T0 + 10 + s, "loss": 2.0, "tokens": 1000} for s in range(6)]
    recs[3]["tokens"] = float("nan")
    entry = r.xadd("th:{one}:steps", {"rank": 0, "n": len(recs), "recs": json.dumps(recs)}).decode()
    r.zadd("th:runs", {"one": T0})
    r.hset("th:{one}:meta", mapping={"world_size": 1, "status": "running"})
    svc = DetectorService(r, consumer="o", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    with caplog.at_level(logging.WARNING, logger="trainhealth.detectors.service"):
        drain(svc)
    assert [int(f[b"step"]) for _, f in r.xrange("th:{one}:agg")] == [0, 1, 2, 4, 5]
    assert [rec.getMessage() for rec in caplog.records if rec.name == "trainhealth.detectors.service"] == [
        f"run one: skipping malformed record in entry {entry} in th:{{one}}:steps: record 3: field 'tokens' has "
        "non-numeric value nan"]
    assert svc.malformed == 1


def test_garbage_in_a_runs_keys_never_stops_the_service(r: redis.Redis, caplog) -> None:
    """Garbage meta fields, heartbeats and stored anomalies are warned about once and ignored; steps beyond
    2^53 are malformed records (they would be stream ids the agg stream refuses); the run is still processed."""
    import logging

    write_run(r, "junk", range(0, 30))
    r.hset("th:{junk}:meta", mapping={"world_size": "eight", "gpu_hour_usd": "two dollars", "started_at": "x"})
    r.hset("th:{junk}:hb", mapping={"0": "[1,2]", "1": '{"t": "yesterday"}'})
    r.hset("th:{junk}:anomalies", "x:1", "{not json")
    big = r.xadd("th:{junk}:steps", {"rank": 0, "n": 1, "recs": json.dumps(
        [{"rank": 0, "step": 10**30, "inc": T0, "t": T0 + 50}])}).decode()
    r.zadd("th:runs", {"ünïcode run": T0})
    svc = DetectorService(r, consumer="j", clock=lambda: T0 + 45, hang_factory=lambda: HangDetector(floor_s=1e9))
    with caplog.at_level(logging.WARNING, logger="trainhealth.detectors.service"):
        drain(svc)
        svc._tick(T0 + 46)
        svc._tick(T0 + 52)
        drain(svc)
    assert [int(f[b"step"]) for _, f in r.xrange("th:{junk}:agg")] == list(range(30))
    assert svc.broken == {} and "junk" in svc.runs
    msgs = [rec.getMessage() for rec in caplog.records if rec.name == "trainhealth.detectors.service"]
    for want in (
        "run junk: ignoring field 'world_size' = 'eight' of th:{junk}:meta (not a valid value)",
        "run junk: ignoring field 'gpu_hour_usd' = 'two dollars' of th:{junk}:meta (not a valid value)",
        "run junk: entry 'x:1' of th:{junk}:anomalies is not a JSON object; it is rewritten if the run still has it",
        "run junk: ignoring heartbeat '0' = '[1,2]' of th:{junk}:hb (not a JSON object with a time 't')",
        f"run junk: skipping malformed record in entry {big} in th:{{junk}}:steps: record 0: field 'step' is "
        "1000000000000000000000000000000, beyond +-9,007,199,254,740,991",
        "ignoring run with invalid id 'ünïcode run' in th:runs",
    ):
        assert msgs.count(want) == 1, (want, msgs)


def test_a_run_whose_processing_raises_is_set_aside_and_the_others_go_on(r: redis.Redis, caplog,
                                                                         monkeypatch) -> None:
    import logging

    from trainhealth.detectors.aggregate import StepAggregator

    real = StepAggregator.add_row

    def buggy(self, row):  # type: ignore[no-untyped-def]
        if self.world_size == 3:  # only the run "sick" has 3 ranks
            raise RuntimeError("aggregator bug")
        return real(self, row)

    monkeypatch.setattr(StepAggregator, "add_row", buggy)
    write_run(r, "sick", range(0, 10), world=3)
    write_run(r, "well", range(0, 10))
    svc = DetectorService(r, consumer="q", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    with caplog.at_level(logging.ERROR, logger="trainhealth.detectors.service"):
        drain(svc)
    assert r.xlen("th:{well}:agg") == 10 and r.xlen("th:{sick}:agg") == 0
    assert "sick" not in svc.runs and svc.broken["sick"][1] == 1
    (err,) = [rec for rec in caplog.records
              if rec.name == "trainhealth.detectors.service" and rec.levelno == logging.ERROR]
    assert err.getMessage().startswith("run sick: error while ")
    assert err.getMessage().endswith(": aggregator bug; set aside, retried in 60 s from its streams; the other "
                                     "runs go on")
    assert r.xpending("th:{sick}:steps", "th-detectors")["pending"] > 0  # kept for the retry, not acknowledged
    svc.beat(T0 + 201)  # what the heartbeat thread writes
    assert json.loads(r.get("th:service:q"))["detector_errors"] == {"sick": {"DetectorService": 1}}
    # Fixed (a new release) and retried: rebuilt from the streams, nothing lost.
    monkeypatch.setattr(StepAggregator, "add_row", real)
    svc.broken["sick"] = (0.0, 1)
    drain(svc)
    assert r.xlen("th:{sick}:agg") == 10 and r.xpending("th:{sick}:steps", "th-detectors")["pending"] == 0
    assert svc.broken == {}


def test_event_decode_errors_name_the_field_and_value() -> None:
    import math

    import pytest

    from trainhealth.wire import decode_event

    base = {"kind": "checkpoint_save", "rank": "0", "t": "100.0", "step": "5", "seconds": "2.5"}
    assert decode_event(base).seconds == 2.5
    for change, message in (
        ({"rank": "zero"}, "field 'rank' has non-numeric value 'zero'"),
        ({"rank": "-1"}, "field 'rank' is -1, not in 0..1048575"),
        ({"t": "inf"}, "field 't' is not a finite time"),
        ({"step": str(10**30)}, "field 'step' is 1000000000000000000000000000000, beyond +-9,007,199,254,740,991"),
        ({"step": "5.5"}, "field 'step' has non-numeric value '5.5'"),
    ):
        with pytest.raises(ValueError) as err:
            decode_event({**base, **change})
        assert str(err.value) == message
    with pytest.raises(KeyError, match="field 'kind' is missing"):
        decode_event({k: v for k, v in base.items() if k != "kind"})
    # An unusable duration is unknown, not an error: the checkpoint of step 5 still counts.
    for bad in ("inf", "-1", "nan", "soon"):
        ev = decode_event({**base, "seconds": bad})
        assert (ev.step, ev.seconds, ev.extra["seconds_invalid"]) == (5, None, bad)
    assert math.isfinite(decode_event(base).t)


def test_collective_timeout_events_on_the_stream_give_the_hang_live(r: redis.Redis, valid_run) -> None:
    """What a log reader or launcher wrapper beside the job sends: the watchdog's report per rank, as events
    (on the job's own clock: after its last steps)."""
    now = time.time()
    mons = [Monitor("nccl", client=r, rank=k, world_size=2, host=f"node-{k}", started_at=now - 100,
                    flush_interval=0.01) for k in range(2)]
    for s in range(20):
        for mon in mons:
            mon.log_step(s, loss=3.0, timestamp=now - 60 + s)
    assert all(mon.flush(10) for mon in mons)
    for k, mon in enumerate(mons):
        mon._event("collective_timeout", seconds=600.0 + k, op="ALLREDUCE", seq=88, timeout_s=600.0)
        assert mon.flush(10)
        mon._sender.stop(1)
    svc = DetectorService(r, consumer="test", clock=lambda: now + 1, snapshot_interval=0.0,
                          hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    anomalies = {k.decode(): json.loads(v) for k, v in r.hgetall("th:{nccl}:anomalies").items()}
    assert sorted(anomalies) == ["hang:collective:19:0"]
    hang = anomalies["hang:collective:19:0"]
    assert (hang["severity"], hang["status"], hang["ranks"], hang["hosts"]) == (
        "critical", "active", [0, 1], ["node-0", "node-1"])
    assert hang["message"] == ("ranks 0, 1 timed out ALLREDUCE SeqNum 88 after 600.0–601.0 s (timeout 600 s); "
                               "no rank is behind (no straggler or culprit in the log: every reporting rank waits on "
                               "the same collective with the same progress)")
    assert ("opened", "hang:collective:19:0") in log_entries(r, "nccl")
    assert valid_run(r, "nccl")["event"] == 2 + 2  # run_start and collective_timeout of each rank


def test_the_heartbeat_is_written_before_the_first_batch_and_during_a_long_one(r: redis.Redis,
                                                                                 monkeypatch) -> None:
    """doctor and the alert watchdog read the heartbeat: a starting service (importing scikit-learn) or one in a
    long catch-up batch is alive, and must not read as down."""
    import threading

    svc = DetectorService(r, consumer="slow")
    started = threading.Event()

    def long_batch(block_ms: int = 0) -> int:
        started.set()
        svc._stop.wait(3.0)  # a batch that takes longer than the heartbeat interval
        return 0

    monkeypatch.setattr(svc, "run_once", long_batch)
    loop = threading.Thread(target=svc.run_forever)
    loop.start()
    try:
        assert started.wait(10)
        first = json.loads(r.get("th:service:slow"))
        assert first["progress_t"] is None  # alive, no batch done yet
        time.sleep(2.5)
        later = json.loads(r.get("th:service:slow"))
        assert later["t"] > first["t"] and r.ttl("th:service:slow") > 0
    finally:
        svc.stop()
        loop.join(15)
    assert not loop.is_alive() and r.exists("th:service:slow") == 0


def test_a_cold_stop_mid_batch_leaves_no_live_looking_heartbeat(r: redis.Redis, monkeypatch) -> None:
    """A second SIGTERM raises SystemExit wherever the loop is: the heartbeat key must still go, or doctor and the
    demo read a dead service as alive (and the embedded redis-server is kept for it)."""
    import threading

    svc = DetectorService(r, consumer="cold")
    beating = threading.Event()

    def batch(block_ms: int = 0) -> int:
        beating.wait(5)
        raise SystemExit(1)  # what stop_on_signals raises on the second signal

    real_beat = svc.beat
    monkeypatch.setattr(svc, "beat", lambda now=None: (real_beat(now), beating.set()))
    monkeypatch.setattr(svc, "run_once", batch)
    with pytest.raises(SystemExit):
        svc.run_forever()
    assert beating.is_set() and r.exists("th:service:cold") == 0


def _reads(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0))


def test_a_caught_up_service_lingers_so_a_read_takes_what_came_meanwhile(r: redis.Redis, redis_url: str) -> None:
    """At a live job's pace every flush arrives on its own; a read that caught up is followed by the linger, not by
    the next read at once, so each read (and its fixed costs) takes the records of the linger, not one flush's."""
    import threading

    svc = DetectorService(r, consumer="linger", linger_s=0.1, snapshot_interval=0.0,
                          hang_factory=lambda: HangDetector(floor_s=1e9))
    mon = Monitor("paced", redis_url=redis_url, rank=0, world_size=1, flush_interval=0.005, spill_dir=False)
    mon.log_step(0, loss=2.0, tokens=10)
    assert mon.flush(10)
    loop = threading.Thread(target=svc.run_forever)
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while not r.exists("th:{paced}:ledger:latest") and time.monotonic() < deadline:  # the run is attached
            time.sleep(0.05)
        before, t0 = _reads(r), time.monotonic()
        for s in range(1, 300):  # 299 steps of ~5 ms, each flushed on its own: ~1.5 s
            mon.log_step(s, loss=2.0, tokens=10)
            time.sleep(0.005)
        assert mon.close() is True
        reads, elapsed = _reads(r) - before, time.monotonic() - t0
        while time.monotonic() < deadline:
            snap = r.get("th:{paced}:ledger:latest")
            if snap and json.loads(snap)["steps_done"] == 300:
                break
            time.sleep(0.05)
    finally:
        svc.stop()
        loop.join(15)
    assert json.loads(r.get("th:{paced}:ledger:latest"))["steps_done"] == 300
    entries = r.xlen("th:{paced}:steps")
    # At most one read per linger while the steps came (a read returns as soon as an entry is there), against one
    # per flush without it (~300 here): each read took ~20 entries.
    assert entries >= 100 and reads <= elapsed / 0.1 + 2, (reads, entries, elapsed)


def test_the_linger_is_checked() -> None:
    from trainhealth.exceptions import ConfigError

    with pytest.raises(ConfigError, match=r"linger_s=-1 must be seconds between 0 and 10"):
        DetectorService(redis.Redis(), linger_s=-1)
    # The command names its flag, before it connects anywhere.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "trainhealth", "serve", "--linger", "-1", "--redis-url",
                          "redis://127.0.0.1:1/0"], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr.splitlines()[-1]) == (
        2, "", "trainhealth serve: error: argument --linger: -1 must be seconds between 0 and 10")


def rollups(r: redis.Redis, run: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} | {"id": i.decode()}
            for i, f in r.xrange(f"th:{{{run}}}:agg:rollup")]


def test_rollup_buckets_are_written_once_and_refilled_by_a_rebuild(r: redis.Redis) -> None:
    write_run(r, "ro", range(0, 150), spike_at=70, nan_at=120)
    svc = DetectorService(r, consumer="a", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    # Steps 0-99 are one bucket, closed by its last step; 100-149 is still open (the dashboard reads those steps).
    (first,) = rollups(r, "ro")
    assert first == {
        "id": "1-99", "gen": "0", "first": "0", "last": "99", "n": "100",
        "t_start": repr(T0 + 10), "t_end": repr(T0 + 10 + 99),  # untimed steps: their ends
        "loss_min": first["loss_min"], "loss_max": "9.0", "loss_mean": first["loss_mean"], "loss_min_step": "0",
        "loss_max_step": "70", "loss_nonfinite": "0",
        "grad_norm_min": "1.0", "grad_norm_max": "1.0", "grad_norm_mean": "1.0", "grad_norm_min_step": "0",
        "grad_norm_max_step": "0", "grad_norm_nonfinite": "0",
        "lr": "0.0001", "tokens": "200000", "timed": "0",  # steps without a start or step_s: not timed
        # each rank's busy seconds a step (data 0.01 + forward_backward 0.1): both alike, the lower rank named
        "busy_p50": "0.11", "busy_p99": "0.11", "busy_max": "0.11", "busy_max_rank": "0"}
    # the mean of the 100 step losses (rank means), the spike included
    losses = [9.0 if s == 70 else 3.0 + 0.001 * (((s * 7) % 5) + ((s * 7 + 1) % 5)) / 2 for s in range(100)]
    assert float(first["loss_mean"]) == pytest.approx(sum(losses) / 100, abs=1e-12)
    assert float(first["loss_min"]) == pytest.approx(min(losses), abs=1e-12) and min(losses) == 3.0005

    # The service dies; steps 150-259 arrive; a new service rebuilds from the streams and goes on.
    write_run(r, "ro", range(150, 260), nan_at=None)
    svc2 = DetectorService(r, consumer="a", clock=lambda: T0 + 300, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc2)
    got = rollups(r, "ro")
    assert [(b["id"], b["first"], b["last"], b["n"]) for b in got] == [("1-99", "0", "99", "100"),
                                                                     ("1-199", "100", "199", "100")]
    assert got[0] == first  # not written again
    # The open bucket 100-149 was filled again by the rebuild's replay: every step of it is there, the NaN too.
    assert (got[1]["loss_nonfinite"], got[1]["loss_nonfinite_step"], got[1]["tokens"]) == ("1", "120", "200000")


def test_a_batch_written_twice_after_a_lost_reply_is_read_once(r: redis.Redis) -> None:
    # A collector that loses the reply to its MULTI/EXEC (a primary failing over under it) sends the batch again:
    # the same entry twice in the stream. Fed again, its older steps would look like a rollback of rank 0.
    write_run(r, "twice", range(0, 30))
    entries = r.xrange("th:{twice}:steps")
    fields = next(f for _, f in entries if f[b"rank"] == b"0" and b'"step":20' in f[b"recs"])
    r.xadd("th:{twice}:steps", fields)
    write_run(r, "twice", range(30, 40))  # a second Monitor of the same ranks and incarnation: newer records, read
    svc = DetectorService(r, consumer="a", clock=lambda: T0 + 100, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    assert svc.repeated == 1
    aggs = r.xrange("th:{twice}:agg")
    assert [i.decode() for i, _ in aggs] == [f"1-{s}" for s in range(40)]
    assert {f[b"n_ranks"] for _, f in aggs} == {b"2"}
    assert r.hkeys("th:{twice}:anomalies") == []
    # A rebuild replays the stream (here with the steps' aggregates gone) and leaves the repeat out again.
    r.delete("th:{twice}:agg", "th:{twice}:owner")
    svc2 = DetectorService(r, consumer="b", clock=lambda: T0 + 100, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc2)
    assert [i.decode() for i, _ in r.xrange("th:{twice}:agg")] == [f"1-{s}" for s in range(40)]
    assert r.hkeys("th:{twice}:anomalies") == []


def checkpoint_marks(r: redis.Redis, run: str) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in r.hgetall(f"th:{{{run}}}:checkpoints").items()}


def test_checkpoints_are_merged_over_ranks_and_kept_through_a_rebuild(r: redis.Redis) -> None:
    mons = [Monitor("ck", client=r, rank=rank, world_size=3, host=f"node-{rank}", started_at=T0, flush_interval=0.01)
            for rank in range(3)]
    for s in range(0, 30):
        for mon in mons:
            mon.log_step(s, loss=3.0, grad_norm=1.0, tokens=100, timestamp=T0 + 10 + s)
        if s in (9, 19):
            for rank, mon in enumerate(mons):
                mon.checkpoint_saved(s, 1.0 + rank / 4 + s / 100)
    for mon in mons:
        assert mon.flush(10)
    svc = DetectorService(r, consumer="a", clock=lambda: T0 + 100, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    marks = checkpoint_marks(r, "ck")
    assert sorted(marks) == ["checkpoint_save:19", "checkpoint_save:9"]
    events = [f for _, f in r.xrange("th:{ck}:events") if f[b"kind"] == b"checkpoint_save"]
    first_t = {s: min(float(f[b"t"]) for f in events if int(f[b"step"]) == s) for s in (9, 19)}
    assert marks["checkpoint_save:9"] == {"kind": "checkpoint_save", "step": 9, "t": first_t[9], "seconds": 1.59,
                                          "n_ranks": 3}
    assert marks["checkpoint_save:19"] == {"kind": "checkpoint_save", "step": 19, "t": first_t[19], "seconds": 1.69,
                                           "n_ranks": 3}
    # Two of step 9's reports are trimmed from the events stream; a new service rebuilds from what is left: the
    # stored count stands, and a rank's late second report of step 19 counts once.
    for entry_id, f in r.xrange("th:{ck}:events"):
        if f[b"kind"] == b"checkpoint_save" and f[b"step"] == b"9" and f[b"rank"] != b"0":
            r.xdel("th:{ck}:events", entry_id)
    mons[2].checkpoint_saved(19, 0.5)
    assert mons[2].flush(10)
    svc2 = DetectorService(r, consumer="a", clock=lambda: T0 + 200, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc2)
    assert checkpoint_marks(r, "ck") == marks
    for mon in mons:
        mon._sender.stop(1)


def test_agg_and_ledger_streams_are_bounded_in_bytes(r: redis.Redis) -> None:
    from trainhealth.detectors.retention import entry_bytes

    # 300 steps of 2 ranks: ~180-byte agg entries, 53 kB in all, against a bound of 20,000 bytes; the ledger's
    # snapshots (~1.5 kB) against 6,000 bytes. Both bounds are under 1,000 entries: trimmed exactly, at each XADD,
    # to the entries of the newest one's size (or the mean so far, when larger) that fit.
    write_run(r, "bytes", range(0, 300))
    svc = DetectorService(r, consumer="a", clock=lambda: T0 + 400, hang_factory=lambda: HangDetector(floor_s=1e9),
                          retention_bytes={"agg": 20_000, "ledger": 6_000})
    assert svc.retention_bytes == {"agg": 20_000, "ledger": 6_000, "anomaly_log": 64 * 2**20}
    drain(svc)
    for i in range(30):
        svc._tick(T0 + 400 + 2 * i)
    agg = r.xrange("th:{bytes}:agg")
    sizes = [entry_bytes(f) for _, f in agg]
    # The entries differ by a few bytes (the mean loss's digits): as many are kept as fit at a size between theirs.
    assert (min(sizes), max(sizes)) == (101, 114) and sum(sizes) <= 20_000
    assert 20_000 // 114 <= len(agg) <= 20_000 // 101 and agg[-1][0] == b"1-299" and len(agg) < 300
    ledger = r.xrange("th:{bytes}:ledger")
    sizes = [entry_bytes(f) for _, f in ledger]
    assert min(sizes) > 1_000 and sum(sizes) <= 6_000 and 6_000 // max(sizes) <= len(ledger) <= 6_000 // min(sizes)


def test_service_retention_bytes_env(monkeypatch) -> None:
    from trainhealth import config
    from trainhealth.exceptions import ConfigError

    assert config.service_retention_bytes() == {"agg": 256 * 2**20, "ledger": 64 * 2**20, "anomaly_log": 64 * 2**20}
    monkeypatch.setenv("TRAINHEALTH_AGG_RETENTION_BYTES", str(2**30))
    monkeypatch.setenv("TRAINHEALTH_ANOMALY_LOG_RETENTION_BYTES", str(2**21))
    assert config.service_retention_bytes() == {"agg": 2**30, "ledger": 64 * 2**20, "anomaly_log": 2**21}
    monkeypatch.setenv("TRAINHEALTH_LEDGER_RETENTION_BYTES", "64MB")
    with pytest.raises(ConfigError, match="TRAINHEALTH_LEDGER_RETENTION_BYTES='64MB' must be an integer >= 1048576"):
        config.service_retention_bytes()


def test_rollup_levels_of_10_100_and_1000_steps_through_the_service(r: redis.Redis) -> None:
    # 1,050 steps of 2 ranks, rank 1 twice as busy in its forward/backward, a loss spike at step 470.
    write_run(r, "lv", range(0, 1_050), spike_at=470, slow_rank=1)
    svc = DetectorService(r, consumer="a", clock=lambda: T0 + 1_100, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    levels = {every: [{k.decode(): v.decode() for k, v in f.items()} | {"id": i.decode()} for i, f in r.xrange(key)]
              for every, key in ((10, "th:{lv}:agg:rollup:10"), (100, "th:{lv}:agg:rollup"),
                                 (1000, "th:{lv}:agg:rollup:1000"))}
    # Each level's buckets closed by their last step; 1,040-1,049 ends a 10-step bucket, not a 100- or 1,000-step one.
    assert [(b["first"], b["last"]) for b in levels[10]] == [(str(s), str(s + 9)) for s in range(0, 1_050, 10)]
    assert [b["id"] for b in levels[100]] == [f"1-{s + 99}" for s in range(0, 1_000, 100)]
    assert [(b["id"], b["first"], b["last"], b["n"]) for b in levels[1000]] == [("1-999", "0", "999", "1000")]
    (whole,) = levels[1000]
    assert whole["tokens"] == str(1_000 * 2 * 1_000) == str(sum(int(b["tokens"]) for b in levels[100]))
    assert (whole["loss_max"], whole["loss_max_step"]) == ("9.0", "470")
    assert [(b["first"], b["loss_max"]) for b in levels[10] if b["loss_max"] == "9.0"] == [("470", "9.0")]
    assert whole["loss_min"] == min((b["loss_min"] for b in levels[100]), key=float)
    # The ranks' busy seconds a step: 0.11 and 0.21 (rank 1): median 0.16, 99th percentile 0.209, max rank 1's.
    for b in (whole, levels[100][4], levels[10][0]):
        assert (b["busy_p50"], b["busy_p99"], b["busy_max"], b["busy_max_rank"]) == ("0.16", "0.209", "0.21", "1")


def test_typed_decode_gives_the_rows_of_the_dict_path() -> None:
    """Once a rank's whole entry decoded with one layout, its next entries are decoded into typed records
    (msgspec): their rows equal the dict path's, and every entry the typed decode cannot take exactly — sections
    in another order (three added: another last bit), an int in a float field beside a communication section, a
    NaN, a missing or unknown field, a rank out of range — gets the dict path's rows and errors."""
    from trainhealth import wire
    from trainhealth.wire import ROW_SOURCE, decode_step_rows, decode_steps, record_row, row_record

    ds = ("data",)

    def rec(step: int, **kw) -> dict:
        return {"rank": 4, "step": step, "inc": T0, "t": T0 + step, "dur": 0.5, "sec.data": 0.1,
                "sec.forward_backward": 0.2, "sec.optimizer": 0.3, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-4,
                "tokens": 100, "samples": 2, "skipped": None, **kw}

    def entry(recs: list[dict]) -> dict[bytes, bytes]:
        return {b"rank": b"4", b"n": str(len(recs)).encode(), b"recs": json.dumps(recs).encode()}

    def dict_path(fields: dict[bytes, bytes]) -> tuple[list[tuple], list[str]]:
        saved = dict(wire._TYPED_FOR), dict(wire._TYPED_LAST)
        forget()
        try:
            return decode(fields)
        finally:
            forget()
            wire._TYPED_FOR.update(saved[0])
            wire._TYPED_LAST.update(saved[1])

    def forget() -> None:
        wire._TYPED_FOR.clear()
        wire._TYPED_LAST.clear()

    def decode(fields: dict[bytes, bytes]) -> tuple[list[tuple], list[str]]:
        bad: list[str] = []
        rows = decode_step_rows(fields, ds, lambda i, exc: bad.append(f"{i}: {exc}"))
        return rows, bad

    forget()
    first = entry([rec(s) for s in range(3)])
    rows, _ = decode(first)
    assert all(type(r[ROW_SOURCE]) is dict for r in rows)  # the dict path, which learns the layout
    typed, _ = decode(entry([rec(s) for s in range(3, 6)]))
    assert [type(r[ROW_SOURCE]).__name__ for r in typed] == ["TypedStepRecord"] * 3
    want = [record_row(s, ds) for s in decode_steps(entry([rec(s) for s in range(3, 6)]))]
    assert [r[:ROW_SOURCE] for r in typed] == [w[:ROW_SOURCE] for w in want]
    assert [row_record(r[ROW_SOURCE]) for r in typed] == [w[ROW_SOURCE] for w in want]
    assert typed[0][16] == 0 + 0.1 + 0.2 + 0.3 == 0.6000000000000001  # busy: the sections in the record's order
    other_rank = decode({**entry([rec(s) for s in range(3)]), b"rank": b"5"})[0]  # the layout the others send
    assert [type(r[ROW_SOURCE]).__name__ for r in other_rank] == ["TypedStepRecord"] * 3

    permuted = {k: v for k, v in rec(7).items() if k != "sec.data"} | {"sec.data": 0.1}  # adds to 0.6
    cases = {
        "sections in another order": [rec(6), permuted],
        "an int in a float field": [rec(6), rec(7, loss=3)],
        "a NaN loss": [rec(6), rec(7, loss=float("nan"))],
        "a missing section": [rec(6), {k: v for k, v in rec(7).items() if k != "sec.optimizer"}],
        "an unknown section": [rec(6), rec(7, **{"sec.eval": 0.5})],
        "a string where a number goes": [rec(6), rec(7, tokens="100")],
        "a rank out of range": [rec(6), rec(7, rank=2**20)],
        "a step out of range": [rec(6), {**rec(7), "step": 2**53}],
        "a boolean rank": [rec(6), rec(7, rank=True)],
    }
    for what, recs in cases.items():
        decode(first)  # learnt again: the odd entry before left the dict path to the rank's next one
        got, want_rows = decode(entry(recs)), dict_path(entry(recs))
        assert [r[:ROW_SOURCE] for r in got[0]] == [r[:ROW_SOURCE] for r in want_rows[0]], what
        assert got[1] == want_rows[1], what
    decode(first)
    assert decode(entry([rec(6), permuted]))[0][1][16] == 0.6
    decode(first)
    assert decode(entry([rec(6), rec(7, rank=2**20)]))[1] == ["1: record 1: field 'rank' is 1048576, not in 0..1048575"]

    # Other layouts (each rank's own): GPU-timed sections, no sections (an untimed step), four sections.
    for rank, extra, drop in ((b"6", {"gpu.forward_backward": 0.15, "gpu.optimizer": 0.25}, ()),
                              (b"7", {}, ("dur", "sec.data", "sec.forward_backward", "sec.optimizer")),
                              (b"8", {"sec.data_loading": 0.07}, ())):
        recs = [{k: v for k, v in rec(s, **extra).items() if k not in drop} for s in range(3)]
        decode({**entry(recs), b"rank": rank})
        got = decode({**entry(recs), b"rank": rank})[0]
        assert {type(r[ROW_SOURCE]).__name__ for r in got} == {"TypedStepRecord"}, rank
        assert [r[:ROW_SOURCE] for r in got] == [r[:ROW_SOURCE] for r in dict_path({**entry(recs), b"rank": rank})[0]]
    assert got[0][16:18] == (0 + 0.1 + 0.2 + 0.3 + 0.07, 0.1)  # rank 8: four sections, one of them data

    # A communication section is subtracted from the busy time: such a layout keeps the dict path.
    comm = [rec(s, **{"sec.allreduce": 0.05}) for s in range(8, 10)]
    decode(entry(comm))
    rows, _ = decode(entry(comm))
    assert all(type(r[ROW_SOURCE]) is dict for r in rows)
