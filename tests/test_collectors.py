"""Collectors against a real redis-server: batching, record shapes, reconnect, bounds, fork, close."""

from __future__ import annotations

import logging
import os
import time
from typing import ClassVar

import pytest
import redis

from trainhealth.collectors import Monitor, detect_rank
from trainhealth.exceptions import ConfigError
from trainhealth.wire import decode_event, decode_steps


def steps_of(r: redis.Redis, run: str) -> list:
    return [rec for _, f in r.xrange(f"th:{{{run}}}:steps") for rec in decode_steps(f)]


def events_of(r: redis.Redis, run: str) -> list:
    return [decode_event(f) for _, f in r.xrange(f"th:{{{run}}}:events")]


def test_step_sections_and_metrics_make_one_record(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("run-a", redis_url=redis_url, rank=3, world_size=4, host="node-7", gpu_hour_usd=2.5)
    for step in range(1, 4):
        with mon.step(step):
            with mon.section("data"):
                time.sleep(0.002)
            for _ in range(2):  # gradient accumulation: the section is entered twice
                with mon.section("forward_backward"):
                    time.sleep(0.001)
        mon.log_step(step, loss=2.0 / step, grad_norm=1.5, lr=1e-4, tokens=4096, samples=2)
    assert mon.close() is True
    recs = steps_of(r, "run-a")
    assert [(x.rank, x.step, x.loss, x.grad_norm, x.lr, x.tokens, x.samples) for x in recs] == [
        (3, 1, 2.0, 1.5, 1e-4, 4096, 2), (3, 2, 1.0, 1.5, 1e-4, 4096, 2), (3, 3, 2.0 / 3, 1.5, 1e-4, 4096, 2)]
    for x in recs:
        assert set(x.sections) == {"data", "forward_backward"}
        assert 0.002 <= x.sections["data"] < 0.5
        assert 0.002 <= x.sections["forward_backward"] < 0.5  # two entries of >= 1 ms add up
        assert x.dur >= x.sections["data"] + x.sections["forward_backward"]
        assert x.inc == mon.inc
    evs = events_of(r, "run-a")
    assert [e.kind for e in evs] == ["run_start", "run_end"]
    assert evs[0].extra["host"] == "node-7" and evs[0].extra["world_size"] == "4"
    meta = {k.decode(): v.decode() for k, v in r.hgetall("th:{run-a}:meta").items()}
    assert meta["world_size"] == "4" and meta["status"] == "running"  # only rank 0 sets the run's status
    assert r.zscore("th:runs", "run-a") is not None


def test_rank0_registers_run_metadata(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("run-b", redis_url=redis_url, rank=0, world_size=2, gpu_hour_usd=3.0)
    mon.log_step(0, loss=1.0)
    mon.close()
    meta = {k.decode(): v.decode() for k, v in r.hgetall("th:{run-b}:meta").items()}
    assert meta["name"] == "run-b"
    assert meta["gpu_hour_usd"] == "3.0"
    assert meta["status"] == "finished"
    assert float(meta["started_at"]) == mon.inc
    assert float(meta["ended_at"]) >= mon.inc


def test_log_step_after_the_block_merges_and_outside_makes_its_own(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("run-c", redis_url=redis_url, rank=0, world_size=1)
    with mon.step(10):
        mon.log_step(10, loss=1.0)           # inside the block
    with mon.step(11):
        pass
    mon.log_step(11, loss=2.0)               # right after the block: same record
    with mon.step(12):
        pass                                 # never logged: sent when the next step starts
    mon.log_step(13, loss=4.0)               # no step block: metrics-only record
    mon.close()
    recs = steps_of(r, "run-c")
    assert [(x.step, x.loss, x.dur is not None) for x in recs] == [
        (10, 1.0, True), (11, 2.0, True), (12, None, True), (13, 4.0, False)]


def test_step_data_from_and_add_section(r: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """``step(data_from=)`` starts the step where its batch's fetch began and books that wait as ``data``;
    ``add_section`` adds time measured between hooks; bad values are ignored with one warning, never raised."""
    from time import perf_counter

    caplog.set_level(logging.WARNING)
    mon = Monitor("run-df", redis_url=redis_url, rank=0, world_size=1)
    t0 = perf_counter()
    time.sleep(0.01)  # the fetch, before the step is entered
    with mon.step(1, data_from=t0):
        mon.add_section("data", 0.25)
        with mon.section("forward"):
            time.sleep(0.002)
    with mon.step(2, data_from="soon"):
        pass
    later = perf_counter() + 60
    with mon.step(3, data_from=later):
        pass
    with mon.step(4, data_from=None):
        mon.add_section("data", -1.0)
        mon.add_section("data", float("nan"))
        mon.add_section("weird", "x")
    assert mon.close() is True
    recs = {x.step: x for x in steps_of(r, "run-df")}
    assert sorted(recs) == [1, 2, 3, 4]
    one = recs[1]
    assert 0.26 <= one.sections["data"] < 0.5 and one.dur >= one.sections["data"] - 0.25 + one.sections["forward"]
    assert one.dur >= 0.012
    assert [recs[s].sections for s in (2, 3, 4)] == [{}, {}, {}]
    msgs = [m.getMessage() for m in caplog.records]
    assert sum("step(data_from='soon'): not a time.perf_counter() value; ignored" in m for m in msgs) == 1
    assert sum("add_section('data', -1.0): not a duration >= 0 s; dropped" in m for m in msgs) == 1
    assert sum("add_section('weird', 'x'): not a duration >= 0 s; dropped" in m for m in msgs) == 1
    assert sum(f"step(data_from={later!r}): not a time.perf_counter() of the last 3600 s; ignored" in m
               for m in msgs) == 1


def test_bad_values_are_recorded_faithfully_or_dropped_with_one_warning(
    r: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    mon = Monitor("run-d", redis_url=redis_url, rank=0, world_size=1)
    mon.log_step(1, loss=float("nan"), grad_norm=float("inf"), bogus=3)
    mon.log_step(2, loss="not-a-number", grad_norm=1.0, bogus=4)
    mon.log_step(3, loss=object(), grad_norm=2.0)
    mon.checkpoint_saved(3, -1.0)
    mon.close()
    recs = steps_of(r, "run-d")
    assert str(recs[0].loss) == "nan" and recs[0].grad_norm == float("inf")
    assert [(x.step, x.loss) for x in recs[1:]] == [(2, None), (3, None)]
    assert [x.grad_norm for x in recs[1:]] == [1.0, 2.0]
    # Stored as given; read back as an unknown duration (the raw text kept), so it cannot skew the ledger.
    saves = [e for e in events_of(r, "run-d") if e.kind == "checkpoint_save"]
    assert [(e.step, e.seconds, e.extra["seconds_invalid"]) for e in saves] == [(3, None, "-1.0")]
    msgs = [m.getMessage() for m in caplog.records]
    assert sum("unknown keyword(s) ['bogus']" in m for m in msgs) == 1
    assert sum("field 'loss' has non-numeric value" in m for m in msgs) == 1
    assert sum("seconds=-1.0 is not a duration" in m for m in msgs) == 1


def test_construction_errors_name_field_and_value(redis_url: str) -> None:
    with pytest.raises(ConfigError, match=r"rank=4 must be an integer in \[0, world_size=4\)"):
        Monitor("x", redis_url=redis_url, rank=4, world_size=4)
    with pytest.raises(ConfigError, match=r"buffer_records=0 must be an integer >= 1"):
        Monitor("x", redis_url=redis_url, buffer_records=0)
    with pytest.raises(ConfigError, match=r"gpu_hour_usd=-2 must be a number >= 0"):
        Monitor("x", redis_url=redis_url, gpu_hour_usd=-2)
    with pytest.raises(ConfigError, match=r"run='bad run' is not a valid run id"):
        Monitor("bad run", redis_url=redis_url)


def test_rank_from_launcher_environment() -> None:
    assert detect_rank(env={"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}) == (5, 16, 1)
    assert detect_rank(env={"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}) == (2, 4, 0)
    assert detect_rank(env={}) == (0, 1, 0)
    with pytest.raises(ConfigError, match="environment RANK='x' is not an integer"):
        detect_rank(env={"RANK": "x"})


def test_redis_restart_mid_run_delivers_every_step_exactly_once(own_redis) -> None:
    client = redis.Redis.from_url(own_redis.url)
    mon = Monitor("run-e", redis_url=own_redis.url, rank=0, world_size=1, flush_interval=0.01)
    for s in range(100):
        mon.log_step(s, loss=1.0)
    assert mon.flush(5)
    own_redis.stop()
    t0 = time.perf_counter()
    for s in range(100, 300):  # Redis is down: the training loop must not notice
        mon.log_step(s, loss=1.0)
    assert time.perf_counter() - t0 < 0.5
    time.sleep(0.3)
    assert mon.connected is False and mon.buffered >= 199
    own_redis.start()  # same port; the data of the first 100 steps is gone (no persistence)
    assert mon.flush(40), "buffer not delivered after Redis came back"
    mon.close()
    # every step logged while Redis was down arrives once, in order; nothing sent before the restart survives it
    assert [x.step for x in steps_of(client, "run-e")] == list(range(100, 300))
    assert mon.dropped == 0


def test_full_buffer_drops_oldest_and_reports_the_count(own_redis) -> None:
    own_redis.stop()
    mon = Monitor("run-f", redis_url=own_redis.url, rank=0, world_size=1, buffer_records=50, flush_interval=0.01,
                  spill_dir=False)
    for s in range(120):
        mon.log_step(s, loss=1.0)
    # run_start plus 120 steps into a 50-record buffer: the oldest 71 (run_start, steps 0-69) are dropped
    assert mon.dropped == 71
    own_redis.start()
    assert mon.flush(40)
    mon.close()
    client = redis.Redis.from_url(own_redis.url)
    assert [x.step for x in steps_of(client, "run-f")] == list(range(70, 120))
    drops = [e for e in events_of(client, "run-f") if e.kind == "collector_drops"]
    assert [(d.extra["count"], d.extra["buffer"], "spill" in d.extra) for d in drops] == [("71", "71", False)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_forked_child_stays_quiet(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("run-g", redis_url=redis_url, rank=0, world_size=1)
    mon.log_step(1, loss=1.0)
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: logging here must neither send nor raise
        try:
            mon.log_step(99, loss=9.0)
            mon.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    mon.log_step(2, loss=1.0)
    mon.close()
    assert [x.step for x in steps_of(r, "run-g")] == [1, 2]


def test_no_redis_at_all_never_raises_and_close_returns_within_timeout(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    mon = Monitor("run-h", rank=0, world_size=1, close_timeout=0.5)  # nothing configured
    for s in range(10):
        with mon.step(s), mon.section("data"):
            pass
        mon.log_step(s, loss=1.0)
    t0 = time.perf_counter()
    assert mon.close() is False
    assert time.perf_counter() - t0 < 2.0
    assert any("no Redis configured" in m.getMessage() for m in caplog.records)


def test_spill_to_disk_while_redis_is_down_delivers_everything_in_order_once(own_redis, tmp_path) -> None:
    spill = tmp_path / "spill"
    mon = Monitor("run-s", redis_url=own_redis.url, rank=0, world_size=1, buffer_records=1000,
                  flush_interval=0.005, spill_dir=spill)
    mon.log_step(0, loss=1.0)
    assert mon.flush(5)
    own_redis.stop()
    for s in range(1, 20_001):
        mon.log_step(s, loss=1.0, consumed_samples=s * 8)
        if s % 200 == 0:
            time.sleep(0.02)  # a training step's worth of time: the sender moves the buffer to disk
    assert mon.dropped_total == 0
    deadline = time.monotonic() + 5  # the sender may be mid-way moving a batch to disk
    while mon.buffered != 20_000 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mon.buffered == 20_000
    pid = os.getpid()
    assert sorted(p.name for p in spill.iterdir()) == [f"run-s-r0-p{pid}-00000000.jsonl",
                                                       f"run-s-r0-p{pid}-00000001.jsonl"]
    own_redis.start()
    assert mon.flush(60)
    mon.close()
    client = redis.Redis.from_url(own_redis.url)
    recs = steps_of(client, "run-s")
    assert [x.step for x in recs] == list(range(1, 20_001))  # the server restarted empty: step 0 is gone
    assert recs[-1].consumed_samples == 160_000
    assert list(spill.iterdir()) == []  # delivered segments are deleted
    assert not [e for e in events_of(client, "run-s") if e.kind == "collector_drops"]


def test_spill_bound_drops_oldest_segments_and_counts_them(tmp_path) -> None:
    from trainhealth.collectors.spill import Spill

    sp = Spill(tmp_path, "p", max_bytes=5_000, segment_records=100)
    sp.write([("steps", {"step": i, "loss": "1.0"}) for i in range(1000)])
    line = len('["steps",{"step":999,"loss":"1.0"}]\n')
    kept = len(sp)
    # within the bound, and never more than one segment (an eighth of the bound, plus a line) below it
    assert 5_000 - (5_000 // 8 + line) <= sp.bytes <= 5_000
    assert sp.dropped == 1000 - kept
    got = []
    while len(sp):
        batch = sp.peek(64)
        got += [f["step"] for _, f in batch]
        sp.commit(len(batch))
    assert got == list(range(1000 - kept, 1000))  # the newest survive, in order
    assert sorted(tmp_path.iterdir()) == []


def test_drops_beyond_buffer_and_spill_are_reported_as_an_event(own_redis, tmp_path) -> None:
    own_redis.stop()
    mon = Monitor("run-x", redis_url=own_redis.url, rank=0, world_size=1, buffer_records=100,
                  flush_interval=0.005, spill_dir=tmp_path, spill_bytes=2_000)
    for s in range(3000):
        mon.log_step(s, loss=1.0)
        if s % 40 == 0:
            time.sleep(0.01)
    assert mon.dropped_total > 0
    own_redis.start()
    assert mon.flush(60)
    mon.close()
    lost = mon.dropped_total
    client = redis.Redis.from_url(own_redis.url)
    evs = events_of(client, "run-x")
    drops = [int(e.extra["count"]) for e in evs if e.kind == "collector_drops"]
    starts = [e for e in evs if e.kind == "run_start"]
    steps = [x.step for x in steps_of(client, "run-x")]
    assert sum(drops) == lost
    assert len(starts) + len(steps) + lost == 3001  # run_start + 3000 steps: each arrived or was counted
    assert steps == sorted(steps) and steps[-1] == 2999


def test_in_process_rollback_is_recorded_as_a_resume_event(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("run-r", redis_url=redis_url, rank=0, world_size=1)
    for s in (1, 2, 3, 4, 2, 3):
        mon.log_step(s, loss=1.0)
    mon.close()
    resumes = [(e.step, e.extra["from_step"]) for e in events_of(r, "run-r") if e.kind == "resume"]
    assert resumes == [(2, "4")]


def _script(body: str) -> str:
    return "import logging, sys, time\nlogging.basicConfig()\nfrom trainhealth import Monitor\n" + body


def test_interpreter_exit_flushes_without_close(r: redis.Redis, redis_url: str) -> None:
    import subprocess
    import sys

    body = (f"mon = Monitor('run-exit', redis_url={redis_url!r}, rank=0, world_size=1)\n"
            "for s in range(500):\n    mon.log_step(s, loss=1.0)\n")
    out = subprocess.run([sys.executable, "-c", _script(body)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [x.step for x in steps_of(r, "run-exit")] == list(range(500))
    # no run_end: an exit without close() may be a crash, so the run is not marked finished; its last word says how
    # it ended (tests/test_last_word.py)
    assert [e.kind for e in events_of(r, "run-exit")] == ["run_start", "rank_exit"]


def test_exit_with_redis_unreachable_never_hangs_the_job(tmp_path) -> None:
    import subprocess
    import sys

    from trainhealth.embedded_redis import free_port

    body = (f"mon = Monitor('run-dead', redis_url='redis://127.0.0.1:{free_port()}/0', rank=0, world_size=1,"
            f" close_timeout=1.0, spill_dir={str(tmp_path)!r})\n"
            "for s in range(1000):\n    mon.log_step(s, loss=1.0)\nt0 = time.monotonic()\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _script(body)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 10  # interpreter start + at most the 1 s close timeout
    assert "Redis unreachable" in out.stderr


class ScriptedEvent:
    """Stands in for ``torch.cuda.Event(enable_timing=True)``: this machine has no GPU.

    ``record()`` stamps the scripted GPU clock; ``query()`` reports completion once the GPU
    clock has passed the stamp (the GPU runs behind the CPU), as CUDA events do.
    """

    gpu_clock: ClassVar[list[float]] = [0.0]
    done_until: ClassVar[list[float]] = [0.0]

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = ScriptedEvent.gpu_clock[0]

    def query(self) -> bool:
        return self.t <= ScriptedEvent.done_until[0]

    def elapsed_time(self, end: ScriptedEvent) -> float:
        return (end.t - self.t) * 1000.0  # milliseconds, as torch

    def synchronize(self) -> None:
        ScriptedEvent.done_until[0] = max(ScriptedEvent.done_until[0], self.t)


def test_cuda_section_times_are_resolved_later_in_order_without_blocking(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("run-gpu", redis_url=redis_url, rank=0, world_size=1)
    mon._enable_gpu(ScriptedEvent)
    clock, done = ScriptedEvent.gpu_clock, ScriptedEvent.done_until
    for s in range(4):
        done[0] = clock[0]  # the GPU runs one step behind: the previous step's work is done now
        with mon.step(s):
            with mon.section("data"):
                pass
            with mon.section("forward_backward", cuda=True):
                clock[0] += 0.25 * (s + 1)  # GPU work queued: 0.25 s, 0.5 s, ...
        mon.log_step(s, loss=1.0)
        assert [rec["step"] for rec, _ in mon._gpu._waiting] == [s]  # only step s still waits for its events
    mon.close()  # drains: waits for the remaining events
    recs = steps_of(r, "run-gpu")
    assert [x.step for x in recs] == [0, 1, 2, 3]
    assert [x.gpu["forward_backward"] for x in recs] == [0.25, 0.5, 0.75, 1.0]
    assert recs[0].busy_s == 0.25 + recs[0].sections["data"]  # GPU time replaces the CPU launch time


def test_cuda_section_without_cuda_falls_back_to_cpu_with_one_warning(
    r: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    mon = Monitor("run-nogpu", redis_url=redis_url, rank=0, world_size=1)
    for s in range(3):
        with mon.step(s), mon.section("forward_backward", cuda=True):
            pass
        mon.log_step(s, loss=1.0)
    mon.close()
    recs = steps_of(r, "run-nogpu")
    assert [(x.step, set(x.sections), x.gpu) for x in recs] == [(s, {"forward_backward"}, {}) for s in range(3)]
    assert sum("section(cuda=True)" in m.getMessage() for m in caplog.records) == 1


# -- robustness: values that the detector service would refuse, values that raise, bad settings ------------------
class _FloatRaises:
    """A metric whose ``__float__`` raises something else than TypeError/ValueError."""

    def __float__(self) -> float:
        raise RuntimeError("device lost")


def test_int_fields_must_be_finite_int64_and_float_fields_fit_a_float(
    r: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from fractions import Fraction

    from trainhealth.collectors.sender import INT_FIELDS
    from trainhealth.wire import _STEP_INTS

    assert set(INT_FIELDS) == {"rank", "step", *_STEP_INTS}  # the collector knows the wire format's int fields
    caplog.set_level(logging.WARNING)
    mon = Monitor("run-range", redis_url=redis_url, rank=0, world_size=1)
    mon.log_step(1, loss=float("nan"), grad_norm=float("inf"), tokens=float("nan"), samples=float("inf"))
    mon.log_step(2, loss=10**400, grad_norm=Fraction(10**400, 1), tokens=4096, consumed_samples=10**400,
                 batch_index=-(2**63) - 1, skipped=float("nan"))
    mon.log_step(3, loss=-10**400, tokens=float("-inf"), samples=2**63 - 1, batch_index=-(2**63))
    mon.log_step(float("nan"), loss=1.0)  # no valid step: the service would refuse the record, so it is dropped
    mon.log_step(4, loss=1.0, tokens=8, step_s=10**400)
    assert mon.close() is True
    recs = steps_of(r, "run-range")  # decodes: no record the service would refuse
    got = [(x.step, str(x.loss), x.grad_norm, x.tokens, x.samples, x.consumed_samples, x.batch_index, x.skipped,
            x.step_s) for x in recs]
    assert got == [(1, "nan", float("inf"), None, None, None, None, None, None),
                   (2, "None", None, 4096, None, None, None, None, None),
                   (3, "None", None, None, 2**63 - 1, None, -(2**63), None, None),
                   (4, "1.0", None, 8, None, None, None, None, None)]
    assert mon.dropped_total == 1
    assert [e.extra["count"] for e in events_of(r, "run-range") if e.kind == "collector_drops"] == ["1"]
    msgs = [m.getMessage() for m in caplog.records]
    for field, why in (("tokens", "is not an integer within ±2**63 (nan)"),
                       ("samples", "is not an integer within ±2**63 (inf)"),
                       ("consumed_samples", "is not an integer within ±2**63 (1000"),
                       ("batch_index", "is not an integer within ±2**63 (-9223372036854775809)"),
                       ("skipped", "is not an integer within ±2**63 (nan)"),
                       ("loss", "is too large for a float (1000"),
                       ("grad_norm", "is too large for a float (Fraction(1000"),
                       ("step_s", "is too large for a float (1000")):
        assert sum(f"field {field!r} " in m for m in msgs) == 1, field
        assert sum(f"field {field!r} {why}" in m for m in msgs) == 1, field
    assert sum("a step record without a valid step number or time was dropped (step=nan)" in m for m in msgs) == 1


def test_a_value_whose_float_raises_never_jams_the_sender(
    r: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from fractions import Fraction

    caplog.set_level(logging.WARNING)
    mon = Monitor("run-jam", redis_url=redis_url, rank=0, world_size=1, flush_interval=0.01)
    mon.log_step(1, loss=Fraction(10**400, 1), grad_norm=_FloatRaises())
    mon.log_step(2, loss=2.0, lr=_FloatRaises())
    mon.badput("eval", _FloatRaises(), step=2)
    for s in range(3, 6):
        mon.log_step(s, loss=float(s))
    assert mon.close() is True
    assert [(x.step, x.loss, x.grad_norm, x.lr) for x in steps_of(r, "run-jam")] == [
        (1, None, None, None), (2, 2.0, None, None), (3, 3.0, None, None), (4, 4.0, None, None), (5, 5.0, None, None)]
    assert [(e.step, e.seconds, e.extra["name"]) for e in events_of(r, "run-jam") if e.kind == "badput"] == [
        (2, None, "eval")]
    msgs = [m.getMessage() for m in caplog.records]
    assert not [m for m in msgs if "unexpected error" in m]
    assert sum("field 'grad_norm' has non-numeric value <tests.test_collectors._FloatRaises object" in m
               for m in msgs) == 1
    assert sum("field 'lr' has non-numeric value" in m for m in msgs) == 1


def test_a_record_the_sender_cannot_encode_is_dropped_counted_and_the_rest_delivered(
    r: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Defence in depth, below the public API: records no conversion can fix must not hold back the others.
    caplog.set_level(logging.WARNING)
    mon = Monitor("run-enc", redis_url=redis_url, rank=0, world_size=1, flush_interval=0.01)
    mon.log_step(1, loss=1.0)
    mon._put("steps", None)  # not a record at all: cannot be encoded
    mon._put("steps", {"rank": 0, "step": 2, "inc": mon.inc, "t": time.time(), ("not", "a str"): 1.0})  # no JSON
    mon.log_step(3, loss=3.0)
    assert mon.close() is True
    assert [x.step for x in steps_of(r, "run-enc")] == [1, 3]
    assert mon.dropped_total == 2
    assert [(e.extra["count"], e.extra["unencodable"]) for e in events_of(r, "run-enc")
            if e.kind == "collector_drops"] == [("2", "2")]
    msgs = [m.getMessage() for m in caplog.records]
    assert sum("a steps record cannot be encoded; dropped" in m for m in msgs) == 1
    assert sum("a steps record cannot be sent; dropped" in m for m in msgs) == 1
    assert not [m for m in msgs if "unexpected error" in m]


def test_a_value_whose_float_raises_never_kills_the_sender_while_spilling(own_redis, tmp_path) -> None:
    from fractions import Fraction

    own_redis.stop()
    mon = Monitor("run-sj", redis_url=own_redis.url, rank=0, world_size=1, buffer_records=10, flush_interval=0.005,
                  spill_dir=tmp_path)
    for s in range(40):
        mon.log_step(s, loss=Fraction(10**400, 1) if s == 5 else 1.0, grad_norm=_FloatRaises() if s == 6 else 1.0)
        time.sleep(0.002)
    deadline = time.monotonic() + 5
    while len(mon._sender._spill) < 35 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mon._sender.is_alive()
    assert len(mon._sender._spill) >= 35  # moved to disk, the bad records with the others
    own_redis.start()
    assert mon.flush(30)
    mon.close()
    recs = steps_of(redis.Redis.from_url(own_redis.url), "run-sj")
    assert [(x.step, x.loss, x.grad_norm) for x in recs] == [
        (s, None if s == 5 else 1.0, None if s == 6 else 1.0) for s in range(40)]
    assert mon.dropped_total == 0


def test_public_methods_never_raise_on_huge_ints_or_wrong_types(
    r: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import json

    import numpy as np

    caplog.set_level(logging.WARNING)
    mon = Monitor("run-types", redis_url=redis_url, rank=0, world_size=1, close_timeout=5, heartbeat_interval=0.02,
                  flush_interval=0.01)
    t0 = time.time()
    with mon.step(1, data_from=10**400):
        with mon.section(["x"]), mon.section("data", cuda=[True]):
            pass
        mon.add_section("fwd", 10**400)
        mon.add_section("fwd", _FloatRaises())
        mon.add_section(["a"], 0.5)  # a name that is not a str: its str() names the section
    mon.log_step(1, loss=1.0)
    mon.log_step(2, loss=2.0, timestamp=10**400)  # not a time: now instead
    mon.checkpoint_saved(1, 10**400)
    mon.checkpoint_loaded(1, "soon")
    mon.badput("eval", 1.0, step=1, timestamp="yesterday")
    assert mon.flush("x") is True
    assert mon.flush(float("nan")) is True
    assert mon.flush(10**400) is True
    mon.log_step(np.int64(7), loss=np.float32(0.5), tokens=np.int64(2**62 + 1))
    assert mon.flush(5) is True
    deadline = time.monotonic() + 5  # a numpy step must not break the heartbeat
    while json.loads(r.hget("th:{run-types}:hb", "0") or "{}").get("step") != 7:
        assert time.monotonic() < deadline, "no heartbeat with step 7"
        time.sleep(0.01)
    assert mon.close(status=5) is True
    recs = steps_of(r, "run-types")
    assert [(x.step, x.loss, x.tokens, x.sections) for x in recs] == [(1, 1.0, None, {"['a']": 0.5}),
                                                                      (2, 2.0, None, {}), (7, 0.5, 2**62 + 1, {})]
    assert t0 <= recs[1].t <= time.time()
    evs = events_of(r, "run-types")
    assert [(e.kind, e.step, e.seconds) for e in evs if e.kind in ("checkpoint_save", "badput")] == [
        ("checkpoint_save", 1, None), ("badput", 1, 1.0)]
    assert t0 <= next(e.t for e in evs if e.kind == "badput") <= time.time()
    assert [e.extra["status"] for e in evs if e.kind == "run_end"] == ["5"]
    msgs = [m.getMessage() for m in caplog.records]
    expected = ["step(data_from=1000", "section(['x'], cuda=False): not a section name; not timed",
                "add_section('fwd', 1000", "log_step(timestamp=1000", "field 'seconds' is too large for a float (1000",
                "badput(timestamp='yesterday'): not a finite unix time; now used instead",
                "flush(timeout='x'): not a number of seconds; 5 s used", "close(status=5): not a string"]
    for text in expected:
        assert sum(m.startswith("trainhealth collector: " + text) for m in msgs) == 1, text
    assert sum("add_section(" in m for m in msgs) == 1  # one warning per section name
    assert sum("section(" in m and "cuda=" in m for m in msgs) == 1
    assert sum("field 'seconds'" in m or "seconds=" in m for m in msgs) == 1  # one warning for both bad seconds
    assert not [m for m in msgs if "internal error" in m or "unexpected error" in m or "heartbeat" in m]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"started_at": float("nan")}, r"started_at=nan must be a finite unix time in seconds >= 0"),
    ({"started_at": float("inf")}, r"started_at=inf must be a finite unix time"),
    ({"started_at": "yesterday"}, r"started_at='yesterday' must be a finite unix time"),
    ({"started_at": 10**400}, r"started_at=1000.* must be a finite unix time"),
    ({"retention": -1}, r"retention=-1 must be an integer >= 1"),
    ({"retention": "x"}, r"retention='x' must be an integer >= 1"),
    ({"retention": True}, r"retention=True must be an integer >= 1"),
    ({"rank": True, "world_size": 2}, r"rank=True must be an integer, not a bool"),
    ({"world_size": True}, r"world_size=True must be an integer, not a bool"),
    ({"flush_interval": float("inf")}, r"flush_interval=inf must be a finite number of seconds > 0"),
    ({"flush_interval": 1e300}, r"flush_interval=1e\+300 must be a finite number of seconds > 0"),
    ({"heartbeat_interval": float("nan")}, r"heartbeat_interval=nan must be a finite number of seconds > 0"),
    ({"close_timeout": float("inf")}, r"close_timeout=inf must be a finite number of seconds > 0"),
    ({"close_timeout": True}, r"close_timeout=True must be a finite number of seconds > 0"),
    ({"gpu_hour_usd": float("nan")}, r"gpu_hour_usd=nan must be a number >= 0 \(finite; USD per GPU-hour\)"),
    ({"gpu_hour_usd": float("inf")}, r"gpu_hour_usd=inf must be a number >= 0"),
    ({"gpu_hour_usd": 10**400}, r"gpu_hour_usd=1000.* must be a number >= 0"),
    ({"buffer_records": True}, r"buffer_records=True must be an integer >= 1"),
    ({"buffer_records": 10**400}, r"buffer_records=1000.* must be an integer >= 1"),
    ({"batch_records": 1.5}, r"batch_records=1.5 must be an integer >= 1"),
    ({"spill_bytes": 0}, r"spill_bytes=0 must be an integer >= 1 \(bytes\)"),
    ({"host": 7}, r"host=7 must be a string"),
    ({"spill_dir": 7}, r"spill_dir=7 must be a path, True or False"),
    ({"client": "redis://x"}, r"client='redis://x' is not a redis-py client"),
])
def test_bad_constructor_arguments_raise_config_error_naming_field_and_value(
    redis_url: str, kwargs: dict, message: str
) -> None:
    import threading

    before = threading.active_count()
    with pytest.raises(ConfigError, match=message):
        Monitor("x", redis_url=redis_url, **kwargs)
    assert threading.active_count() == before  # raised before any sender started


def test_spill_over_warning_is_rate_limited_and_the_count_exact(
    tmp_path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainhealth.collectors import spill as spill_mod

    caplog.set_level(logging.WARNING)
    sp = spill_mod.Spill(tmp_path, "p", max_bytes=2_000, segment_records=10)
    for i in range(0, 2000, 10):  # Redis away: the sender spills a few records at a time
        sp.write([("steps", {"step": s}) for s in range(i, i + 10)])
    assert sp.dropped == 2000 - len(sp) and sp.dropped > 1500
    first = 10  # the first write beyond the bound drops one 10-record segment
    msgs = [m.getMessage() for m in caplog.records]
    assert msgs == [f"trainhealth collector: spill over 2000 bytes; dropped {first} oldest records ({first} in all "
                    "so far)"]
    monkeypatch.setattr(spill_mod, "DROP_WARN_INTERVAL_S", 0.0)
    sp.write([("steps", {"step": s}) for s in range(2000, 2010)])
    msgs = [m.getMessage() for m in caplog.records]
    assert len(msgs) == 2 and msgs[1] == (f"trainhealth collector: spill over 2000 bytes; dropped "
                                          f"{sp.dropped - first} oldest records ({sp.dropped} in all so far)")
    assert sp.dropped == 2010 - len(sp)


def test_close_counts_every_undelivered_record_in_buffer_flight_and_spill(
    own_redis, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    own_redis.stop()
    mon = Monitor("run-cl", redis_url=own_redis.url, rank=0, world_size=1, buffer_records=10, flush_interval=0.005,
                  spill_dir=tmp_path, close_timeout=0.3)
    for s in range(113):
        mon.log_step(s, loss=1.0)
        time.sleep(0.001)
    deadline = time.monotonic() + 5
    while len(mon._sender._spill) < 110 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mon.buffered == 114 and len(mon._sender._spill) >= 110  # run_start and 113 steps, mostly on disk
    assert mon.close() is False
    n_spill = len(mon._sender._spill)
    msgs = [m.getMessage() for m in caplog.records if "not delivered at close" in m.getMessage()]
    assert msgs == [f"trainhealth collector: 115 records not delivered at close ({n_spill} kept in the spill at "
                    f"{tmp_path})"]  # with run_end
    # the segments holding them stay on disk, every undelivered record in them
    mon._sender.join(5)
    lines = [ln for p in tmp_path.iterdir() for ln in p.read_text().splitlines()]
    assert len(lines) == n_spill


def test_close_with_one_record_left_says_record(own_redis, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    own_redis.stop()
    mon = Monitor("run-one", redis_url=own_redis.url, rank=0, world_size=1, buffer_records=1, spill_dir=False,
                  close_timeout=0.2)
    assert mon.close() is False  # run_end pushed run_start out of the one-record buffer
    assert [m.getMessage() for m in caplog.records if "at close" in m.getMessage()] == [
        "trainhealth collector: 1 record not delivered at close"]


def test_spill_batch_in_flight_when_its_segment_is_dropped_is_delivered_once_and_not_counted(tmp_path) -> None:
    from trainhealth.collectors.spill import Spill

    sp = Spill(tmp_path, "p", max_bytes=3_000, segment_records=10)
    sp.write([("steps", {"step": i}) for i in range(30)])
    flight = sp.peek(4)  # sent to Redis, which fails: kept in memory for a retry
    assert sp.peeked == 4
    sp.write([("steps", {"step": i}) for i in range(30, 200)])  # still away: the oldest segments go
    assert len(sp) + sp.dropped == 200 - 4  # the 4 in flight are neither on disk nor lost
    sp.commit(len(flight))  # the retry delivered them
    got = [f["step"] for _, f in flight]
    while len(sp):
        batch = sp.peek(7)
        got += [f["step"] for _, f in batch]
        sp.commit(len(batch))
    assert got == [0, 1, 2, 3, *range(200 - len(got) + 4, 200)]  # every record once, in order
    assert len(got) + sp.dropped == 200
    sp.close()
    assert list(tmp_path.iterdir()) == []


def test_spill_close_removes_delivered_segments_and_keeps_undelivered_ones(tmp_path) -> None:
    from trainhealth.collectors.spill import Spill

    sp = Spill(tmp_path, "p", max_bytes=1_000_000, segment_records=10)
    sp.write([("steps", {"step": i}) for i in range(25)])
    for _ in range(2):  # the first segment delivered, the second half of it
        batch = sp.peek(5)
        sp.commit(len(batch))
    sp.peek(10)
    sp.commit(5)
    (tmp_path / "p-99999999.jsonl").write_text("")  # an empty segment of ours (a write that failed)
    (tmp_path / "other-00000000.jsonl").write_text("x\n")  # another process's: not ours to touch
    sp.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-00000000.jsonl", "p-00000001.jsonl",
                                                          "p-00000002.jsonl"]
    while len(sp):
        sp.commit(len(sp.peek(10)))
    sp.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-00000000.jsonl"]


def test_a_backlog_does_not_starve_the_heartbeat(r: redis.Redis, redis_url: str) -> None:
    """A rank logging faster than the sender drains must keep heartbeating while the backlog drains: the service
    judges a rank dead from its heartbeat, and this one is alive."""
    import json

    n = 600_000
    mon = Monitor("run-backlog", redis_url=redis_url, rank=0, world_size=1, heartbeat_interval=0.2,
                  buffer_records=n)
    for step in range(n):  # ~1 s of the training loop, seconds of the sender's work
        mon.log_step(step, loss=1.0)
    seen = set()
    while mon.buffered:
        raw = r.hget("th:{run-backlog}:hb", "0")
        if raw is not None:
            seen.add(json.loads(raw)["t"])
        time.sleep(0.05)
    assert mon.close() is True
    assert r.xlen("th:{run-backlog}:steps") > 0 and mon.dropped_total == 0
    assert len(seen) >= 3  # written while draining, not only before and after


def test_a_sender_thread_that_cannot_start_never_reaches_the_training_loop(
    r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At interpreter shutdown (or out of threads) ``Thread.start`` raises: the job must not notice."""
    import threading

    from trainhealth.collectors.sender import Sender

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(Sender.__mro__[1], "start", refuse)  # threading.Thread.start, as Sender calls it
    caplog.set_level(logging.WARNING)
    mon = Monitor("run-nothread", redis_url=redis_url, rank=0, world_size=1, close_timeout=0.5)
    with mon.step(1), mon.section("forward"):
        pass
    mon.log_step(1, loss=2.0)
    t0 = time.monotonic()
    assert mon.close() is False and time.monotonic() - t0 < 2.0
    assert mon.buffered == 3 and r.xlen("th:{run-nothread}:steps") == 0
    assert [rec.getMessage() for rec in caplog.records] == [
        "trainhealth collector: cannot start the sender thread (can't create new thread at interpreter shutdown); "
        "nothing will be sent", "trainhealth collector: 3 records not delivered at close"]
