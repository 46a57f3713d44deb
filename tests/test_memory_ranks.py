"""Memory per rank through the real detector service on a real redis-server: one rank's peak far above the others'
(``memory_imbalance``) and the bounded per-rank memory history it keeps for the dashboard (``th:{run}:mem``)."""

from __future__ import annotations

import json

import redis

from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.memory_imbalance import MemoryImbalanceDetector
from trainhealth.detectors.service import DetectorService

T0 = 1_800_000_000.0
GiB, MiB = 2**30, 2**20
WORLD = 8


def host(r: int) -> str:
    return "node-a" if r < 4 else "node-b"


def start(client: redis.Redis, run: str) -> None:
    client.hset(f"th:{{{run}}}:meta", mapping={"world_size": WORLD, "status": "running"})
    client.zadd("th:runs", {run: T0})
    for r in range(WORLD):
        client.xadd(f"th:{{{run}}}:events", {"kind": "run_start", "rank": r, "t": T0, "inc": T0, "host": host(r),
                                              "pid": 100 + r, "world_size": WORLD})


def beat(client: redis.Redis, run: str, t: float, step: int, peak: dict[int, float]) -> None:
    """Every rank's step record of ``step`` and its heartbeat at ``t``: 40 GiB allocated (peak ``peak[r]``, else
    40 GiB + r MiB), 45 GiB reserved, of 80 GiB; 3 GiB of host RSS."""
    for r in range(WORLD):
        client.xadd(f"th:{{{run}}}:steps", {"rank": r, "n": 1, "recs": json.dumps(
            [{"rank": r, "step": step, "inc": T0, "t": t - 1, "loss": 3.0 + 0.01 * ((step + r) % 7)}])})
        cuda = {"device": r % 4, "total": 80 * GiB, "alloc": 40 * GiB + r * MiB,
                "alloc_peak": peak.get(r, 40 * GiB + r * MiB), "reserved": 45 * GiB, "reserved_peak": 46 * GiB,
                "retries": 0, "ooms": 0}
        client.hset(f"th:{{{run}}}:hb", str(r), json.dumps({
            "t": t, "step": step, "step_t": t - 1, "phase": "train", "host": host(r), "pid": 100 + r, "inc": T0,
            "mem": {"rss": 3 * GiB, "rss_anon": 3 * GiB, "host_total": 512 * GiB, "cuda": cuda}, "gpu": None}))


def test_one_ranks_peak_far_above_the_others_is_a_memory_imbalance_and_memory_is_kept_per_rank(
        r: redis.Redis, valid_run) -> None:
    start(r, "mi")
    svc = DetectorService(r, consumer="mem", clock=lambda: T0, hang_factory=lambda: HangDetector(floor_s=1e9))
    for i in range(10):
        now = T0 + 100 + 5 * i
        # Rank 3 peaks at 74 GiB (92 % of its device) from its third heartbeat to its seventh.
        beat(r, "mi", now, 10 * i, {3: 74 * GiB} if 2 <= i < 7 else {})
        svc.clock = lambda now=now: now
        for _ in range(5):
            if svc.run_once(block_ms=10) == 0:
                break
        svc._tick(now)
    log = [(f[b"transition"].decode(), json.loads(f[b"json"])) for _, f in r.xrange("th:{mi}:anomaly_log")]
    assert [(t, a["id"], a["severity"], a["step"], a["end_step"]) for t, a in log] == [
        ("opened", "memory_imbalance:3:20:0", "warning", 20, None),
        ("resolved", "memory_imbalance:3:20:0", "warning", 20, 70)]
    opened = log[0][1]
    assert opened["hosts"] == ["node-a"] and opened["evidence"] == {
        "peak": 74 * GiB, "median_peak": 40 * GiB + round(4.5 * MiB), "excess": 34 * GiB - round(4.5 * MiB),
        "capacity": 80 * GiB, "z": 9392.14, "n_ranks": 8, "samples": 3}  # MAD 2.5 MiB: 0.6745 x 34811.5 / 2.5
    assert opened["message"] == (
        "rank 3 (node-a): peak CUDA allocation 74.0 GiB vs 40.0 GiB on the median of 8 ranks, 34.0 GiB more of its "
        "80.0 GiB device; modified z 9392.1: it runs out of memory first; it holds what the others do not (rank 0 "
        "gathering metrics or a full state dict, an uneven pipeline split, a larger embedding or expert shard): "
        "record its allocations (torch.cuda.memory._record_memory_history) and balance them")
    inc = json.loads(r.hget("th:{mi}:incidents", "inc:memory_imbalance:3:20:0"))
    assert inc["title"] == "Rank 3 (node-a) peaks at 74.0 GiB of memory, the other ranks at 40.0 GiB"
    # The memory history: one entry every 30 s of ticks (T0+100, +130), lists of MiB by rank.
    entries = [f for _, f in r.xrange("th:{mi}:mem")]
    assert [(f[b"t"], f[b"step"], f[b"n"]) for f in entries] == [
        (repr(T0 + 100).encode(), b"0", b"8"), (repr(T0 + 130).encode(), b"60", b"8")]
    assert json.loads(entries[1][b"alloc"]) == [40960 + r for r in range(WORLD)]
    assert json.loads(entries[1][b"reserved"]) == [46080] * WORLD and json.loads(entries[1][b"rss"]) == [3072] * WORLD
    valid_run(r, "mi")


def test_ranks_that_agree_are_not_an_imbalance_nor_are_too_few() -> None:
    det = MemoryImbalanceDetector()
    # A pipeline-free data-parallel job: peaks within a GiB of each other (2 % of the device): none flagged.
    assert [det.update({r: (100.0 + i, (40 + 0.125 * r) * GiB, 80 * GiB) for r in range(8)}, step=i)
            for i in range(5)] == [[]] * 5
    # Three ranks (fewer than MEMORY_IMBALANCE_MIN_RANKS) say nothing, however far apart.
    three = {0: (1.0, 70 * GiB, 80 * GiB), 1: (1.0, 10 * GiB, 80 * GiB), 2: (1.0, 10 * GiB, 80 * GiB)}
    assert det.update(three, step=0) == []
