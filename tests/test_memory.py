"""Memory per rank: the collector's sample (real /proc, a real Monitor's heartbeat in a real Redis), the growth
detector on synthetic leaks and healthy series, and "likely out of memory" on a dead rank and its restart."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import pytest
import redis

from trainhealth.collectors import Monitor
from trainhealth.collectors.memory import MemorySampler, cgroup_limit
from trainhealth.detectors.memory_growth import MemoryGrowthDetector
from trainhealth.detectors.pipeline import RunPipeline
from trainhealth.wire import Event, StepRecord

GiB, MiB = 2**30, 2**20
T0 = 1_796_000_000.0


def test_the_sample_of_this_process(tmp_path: Path) -> None:
    s = MemorySampler(0).sample()
    statm = Path("/proc/self/statm").read_text().split()
    assert abs(s["rss"] - int(statm[1]) * 4096) < 64 * MiB  # read a moment apart
    assert 0 < s["rss_anon"] <= s["rss"] <= s["host_total"]
    # torch imported, CUDA never initialised (a CPU build here): the CUDA part says so, and is not initialised by it.
    torch = pytest.importorskip("torch")
    s = MemorySampler(0).sample()
    if not torch.cuda.is_available():
        assert s["cuda_absent"] == "CUDA not initialised" and "cuda" not in s
        assert not torch.cuda.is_initialized()


@pytest.mark.parametrize(("text", "limit"), [(b"max\n", None), (b"1073741824\n", GiB),
                                             (b"9223372036854771712\n", None), (b"garbage", None)])
def test_cgroup_limit(tmp_path: Path, text: bytes, limit: int | None) -> None:
    f = tmp_path / "memory.max"
    f.write_bytes(text)
    assert cgroup_limit((str(tmp_path / "missing"), str(f))) == limit


def test_a_monitors_heartbeat_carries_its_memory(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("mem-hb", redis_url=redis_url, rank=0, world_size=1, heartbeat_interval=0.1)
    try:
        deadline = time.monotonic() + 10
        while not r.hexists("th:{mem-hb}:hb", "0") and time.monotonic() < deadline:
            time.sleep(0.05)
        hb = json.loads(r.hget("th:{mem-hb}:hb", "0"))
    finally:
        mon.close()
    assert set(hb["mem"]) == {"rss", "rss_anon", "host_total", "cuda_absent"}
    assert hb["mem"]["rss"] > 10 * MiB and hb["mem"]["cuda_absent"] in ("torch not imported", "CUDA not initialised")


def test_cuda_counters_where_a_gpu_is_present() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: the CUDA path runs where a GPU is present")
    torch.cuda.init()
    before = MemorySampler(0).sample()["cuda"]
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    after = MemorySampler(0).sample()["cuda"]
    assert after["alloc"] - before["alloc"] == 256 * MiB
    assert after["total"] == torch.cuda.get_device_properties(0).total_memory
    del x


# -- the growth detector -------------------------------------------------------------------------------------------
def feed(det: MemoryGrowthDetector, series, metric: str = "cuda", capacity: float = 80 * GiB, rank: int = 3,
         inc: float = 1.0, every: float = 5.0) -> list:
    """What ``det`` returned, with the sample index it returned it at: ``[(i, anomaly), ...]``."""
    out = []
    for i, v in enumerate(series):
        out += [(i, a) for a in det.update(rank, "node-a", T0 + every * i, step=i, inc=inc, metric=metric, value=v,
                                           capacity=capacity)]
    return out


def test_a_leak_opens_and_its_severity_follows_the_time_left() -> None:
    det = MemoryGrowthDetector()
    rng = random.Random(5)
    # 30 GiB of weights and optimizer states, activations 0-8 GiB sampled at a random point of the step, plus a
    # leak of 100 MiB a minute; after 3 h it leaks 2 GiB a minute (e.g. a list growing with every batch).
    series = [30 * GiB + rng.uniform(0, 8) * GiB + i * 5 * 100 * MiB / 60 for i in range(2160)]
    series += [series[-1] + j * 5 * 2 * GiB / 60 for j in range(1, 200)]
    got = [(i, a.severity, a.step, a.status) for i, a in feed(det, series)]
    # 100 MiB/min is 5.9 GiB/h under 8 GiB of saw-tooth: the per-minute floors show it as soon as 10 minutes are in
    # (sample 120): 9 h to the device's end, a warning. The fast leak makes it critical 6 min after it starts.
    assert got == [(120, "warning", 120, "active"), (2233, "critical", 120, "active")]
    a = det.open[0]
    assert a.evidence["metric"] == "cuda" and a.evidence["eta_s"] < 3600
    assert a.message.startswith("rank 3 (node-a): CUDA memory allocated grows ")


def test_healthy_series_raise_nothing() -> None:
    rng = random.Random(11)
    det = MemoryGrowthDetector()
    saw = [30 * GiB + rng.uniform(0, 8) * GiB for _ in range(3000)]  # 4 h of a caching allocator's saw-tooth
    assert feed(det, saw) == []
    det = MemoryGrowthDetector()
    warm = [10 * GiB] * 12 + [30 * GiB + rng.uniform(0, 1) * GiB for _ in range(3000)]  # optimizer state at minute 1
    assert feed(det, warm) == []
    det = MemoryGrowthDetector()
    # Host RSS of a job with 8 data-loader workers: up and down by 2 GiB, no trend, on a 512 GiB host.
    host = [20 * GiB + 2 * GiB * math.sin(i / 40) + rng.uniform(0, 0.2) * GiB for i in range(3000)]
    assert feed(det, host, metric="host", capacity=512 * GiB) == []


def test_a_restart_or_the_runs_end_closes_it() -> None:
    det = MemoryGrowthDetector()
    leak = [10 * GiB + i * 5 * 200 * MiB / 60 for i in range(400)]
    [(_, opened)] = feed(det, leak)
    [closed] = det.update(3, "node-a", T0 + 5 * 400, step=400, inc=2.0, metric="cuda", value=10 * GiB,
                          capacity=80 * GiB)
    assert (closed.id, closed.status, closed.end_step) == (opened.id, "resolved", 400)
    assert closed.message.endswith("; the process restarted")
    feed(det, leak, inc=3.0)
    [ended] = det.finish(450)
    assert ended.status == "resolved" and ended.evidence["run_ended"] is True


# -- out of memory at death ------------------------------------------------------------------------------------------
def hb(t: float, step: int, host: str, mem: dict | None, inc: float = T0) -> dict:
    return {"t": t, "step": step, "step_t": t - 0.5, "phase": "train", "host": host, "pid": 7, "inc": inc, "mem": mem}


def cuda_mem(reserved: float, retries: int, ooms: int = 0) -> dict:
    return {"rss": 9 * GiB, "rss_anon": 8 * GiB, "host_total": 512 * GiB,
            "cuda": {"device": 0, "total": 80 * GiB, "alloc": reserved - GiB, "alloc_peak": reserved,
                     "reserved": reserved, "reserved_peak": reserved, "retries": retries, "ooms": ooms}}


def run_job(mem_of_rank1: list[dict]) -> tuple[RunPipeline, list]:
    """A 2-rank job, 60 steps; rank 1's heartbeats carry ``mem_of_rank1`` (one per 5 s), then it dies silently
    (the CUDA OOM killed it, or the kernel's OOM killer) and rank 0 dies of the closed connection."""
    pipe = RunPipeline(2)
    for r in range(2):
        pipe.feed_event(Event("run_start", r, T0, T0, extra={"host": f"node-{r}", "pid": "7"}))
    for s in range(60):
        for r in range(2):
            pipe.feed_step(StepRecord(rank=r, step=s, inc=T0, t=T0 + s + 1, dur=1.0, sections={"forward": 0.5}))
    found = []
    for i, mem in enumerate(mem_of_rank1):
        t = T0 + 5 * (i + 1)
        found += pipe.check_heartbeats(t, {0: hb(t, 59, "node-0", cuda_mem(40 * GiB, 0)),
                                           1: hb(t, 59, "node-1", mem)}).anomalies
    end = T0 + 5 * len(mem_of_rank1)
    pipe.feed_event(Event("rank_exit", 0, end + 1, T0, step=59,
                          extra={"reason": "exception", "error": "RuntimeError: Connection closed by peer"}))
    beats = {0: hb(end + 1, 59, "node-0", cuda_mem(40 * GiB, 0)), 1: hb(end, 59, "node-1", mem_of_rank1[-1])}
    for dt in (10, 20, 50):
        found += pipe.check_heartbeats(end + dt, beats).anomalies
    return pipe, found


def test_a_rank_dying_with_its_device_full_and_flushing_is_likely_out_of_memory() -> None:
    mems = [cuda_mem(60 * GiB, 0), cuda_mem(70 * GiB, 0), cuda_mem(78 * GiB, 2), cuda_mem(78.5 * GiB, 9)]
    pipe, found = run_job(mems)
    dead = [a for a in found if a.kind == "dead_rank"][-1]
    assert dead.ranks == (1,)
    assert dead.message.endswith("; likely out of memory on rank 1: CUDA reserved 78.5 GiB of 80.0 GiB (98%) and "
                                 "9 allocation retries (cache flushes) in its last 15 s")
    assert dead.evidence["memory"]["likely_oom"] is True and dead.evidence["memory"]["where"] == "cuda"
    # Relaunched: the restart's evidence says so too.
    relaunch = T0 + 400
    for r in range(2):
        pipe.feed_event(Event("run_start", r, relaunch, relaunch, extra={"host": f"node-{r}", "pid": "8"}))
    got = []
    for s in range(50, 53):
        for r in range(2):
            got += pipe.feed_step(StepRecord(rank=r, step=s, inc=relaunch, t=relaunch + 10 + s, dur=1.0,
                                             sections={"forward": 0.5})).anomalies
    [restart] = [a for a in got if a.kind == "restart"]
    assert restart.evidence["memory"]["rank"] == 1
    assert "likely out of memory on rank 1: CUDA reserved 78.5 GiB" in restart.message


def test_a_host_oom_kill_and_a_death_without_pressure() -> None:
    host_full = {"rss": 250 * GiB, "rss_anon": 245 * GiB, "host_total": 256 * GiB, "cuda_absent": "no CUDA device"}
    _, found = run_job([host_full] * 4)
    dead = [a for a in found if a.kind == "dead_rank"][-1]
    assert dead.evidence["memory"]["where"] == "host"
    assert dead.message.endswith("likely out of memory on rank 1: host memory 245 GiB of the 256 GiB it may use "
                                 "(96%): the kernel's OOM killer ends such a process with SIGKILL")
    # 78 GiB reserved is the caching allocator's habit: without retries or OOMs it is no verdict.
    _, found = run_job([cuda_mem(78 * GiB, 5)] * 4)
    dead = [a for a in found if a.kind == "dead_rank"][-1]
    assert "memory" not in dead.evidence and "out of memory" not in dead.message
