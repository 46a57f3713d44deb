"""Collectors against a real redis-server: batching, record shapes, reconnect, bounds, fork, close."""

from __future__ import annotations

import logging
import os
import time
from typing import ClassVar

import pytest
import redis

from collectors import Monitor, detect_rank
from trainhealth.events import decode_event, decode_steps
from trainhealth.exceptions import ConfigError


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
    assert [e.seconds for e in events_of(r, "run-d") if e.kind == "checkpoint_save"] == [-1.0]
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
    client.xadd("th:{run-e}:steps", {"rank": 0, "n": 1, "recs": '[{"rank":0,"step":-1,"inc":0,"t":0}]'})  # marker
    assert mon.flush(40), "buffer not delivered after Redis came back"
    mon.close()
    steps = [x.step for x in steps_of(client, "run-e")]
    assert steps[0] == -1
    # every step logged while Redis was down arrives once, in order (one may have been in flight)
    tail = [s for s in steps[1:] if s >= 100]
    assert tail == list(range(100, 300))
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
    assert [d.extra["count"] for d in drops] == ["71"]


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
    from collectors.spill import Spill

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
    return "import logging, sys, time\nlogging.basicConfig()\nfrom collectors import Monitor\n" + body


def test_interpreter_exit_flushes_without_close(r: redis.Redis, redis_url: str) -> None:
    import subprocess
    import sys

    body = (f"mon = Monitor('run-exit', redis_url={redis_url!r}, rank=0, world_size=1)\n"
            "for s in range(500):\n    mon.log_step(s, loss=1.0)\n")
    out = subprocess.run([sys.executable, "-c", _script(body)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [x.step for x in steps_of(r, "run-exit")] == list(range(500))
    # no run_end: an exit without close() may be a crash, so the run is not marked finished
    assert [e.kind for e in events_of(r, "run-exit")] == ["run_start"]


def test_exit_with_redis_unreachable_never_hangs_the_job(tmp_path) -> None:
    import subprocess
    import sys

    from trainhealth.server import free_port

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
