"""Detector services share the runs evenly, rebalance as they join and leave, and fail over (issue 15)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import redis

from trainhealth.collectors import Monitor
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import DetectorService, fair_share

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_796_000_000.0


def _runs(r: redis.Redis, n: int) -> list[str]:
    names = [f"r{i:02d}" for i in range(n)]
    for run in names:
        mon = Monitor(run, client=r, rank=0, world_size=1, started_at=T0, flush_interval=0.01, spill_dir=False)
        for s in range(5):
            mon.log_step(s, loss=2.0, tokens=10)
        mon.close()
    return names


def _service(r: redis.Redis, name: str) -> DetectorService:
    return DetectorService(r, consumer=name, clock=lambda: T0 + 100, hang_factory=lambda: HangDetector(floor_s=1e9))


def _round(services: list[DetectorService]) -> None:
    for _ in range(3):
        for svc in services:
            svc.beat()
            svc.run_once(block_ms=5)


def _shares(r: redis.Redis, names: list[str]) -> dict[str, int]:
    return dict(sorted(Counter(v.decode() for v in r.mget([f"th:{{{n}}}:owner" for n in names])).items()))


def test_fair_share_splits_evenly_and_adds_up() -> None:
    assert [fair_share(16, ["a", "b", "c", "d", "e"], s) for s in "abcde"] == [4, 3, 3, 3, 3]
    assert sum(fair_share(7, list("abc"), s) for s in "abc") == 7
    assert fair_share(0, ["a"], "a") == 0
    with pytest.raises(ValueError):
        fair_share(4, ["a"], "b")


def test_four_services_share_sixteen_runs_and_rebalance_on_join_and_leave(r: redis.Redis) -> None:
    names = _runs(r, 16)
    first = _service(r, "svc-a")
    _round([first])
    assert _shares(r, names) == {"svc-a": 16}  # alone, it takes every run
    services = [first] + [_service(r, f"svc-{c}") for c in "bcd"]
    _round(services)
    assert _shares(r, names) == {"svc-a": 4, "svc-b": 4, "svc-c": 4, "svc-d": 4}
    assert sorted(r.zrange("th:services", 0, -1)) == [b"svc-a", b"svc-b", b"svc-c", b"svc-d"]
    assert sorted(run for svc in services for run in svc.runs) == names  # each run in one service, once
    services.append(_service(r, "svc-e"))
    _round(services)
    assert _shares(r, names) == {"svc-a": 4, "svc-b": 3, "svc-c": 3, "svc-d": 3, "svc-e": 3}
    # A clean stop hands its runs over at once and leaves the membership.
    services[0].stop()
    services[0].run_forever()
    assert r.zscore("th:services", "svc-a") is None
    _round(services[1:])
    assert _shares(r, names) == {"svc-b": 4, "svc-c": 4, "svc-d": 4, "svc-e": 4}
    assert sorted(run for svc in services[1:] for run in svc.runs) == names


def test_a_lease_is_renewed_by_the_heartbeat_not_only_by_the_loop(r: redis.Redis) -> None:
    names = _runs(r, 1)
    svc = _service(r, "svc-a")
    _round([svc])
    r.expire(f"th:{{{names[0]}}}:owner", 1)
    svc.beat()  # what the heartbeat thread does every 2 s, however long the loop's batch takes
    assert r.ttl(f"th:{{{names[0]}}}:owner") == 6
    # ... but never takes back a run the loop handed over
    r.delete(f"th:{{{names[0]}}}:owner")
    svc.runs.clear()
    svc.beat()
    assert r.exists(f"th:{{{names[0]}}}:owner") == 0


def test_real_services_fail_over_rebalance_and_process_each_step_once(tmp_path: Path) -> None:
    """bench/failover.py at a small size: real `trainhealth serve` processes, real collectors, a SIGKILL, a
    SIGTERM and a join; exact counts (the seconds are in BENCHMARKS.md, not asserted here)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import failover

    steps = 240
    out = failover.run(services=3, runs=6, ranks=2, step_s=0.15, steps=steps, log_dir=tmp_path)
    assert out["shares_start"] == {"svc-0": 2, "svc-1": 2, "svc-2": 2}
    assert out["kill"]["moved"] == 2 and out["kill"]["shares"] == {"svc-1": 3, "svc-2": 3}
    assert out["term"]["moved"] == 3 and out["term"]["shares"] == {"svc-2": 6}
    assert out["join"]["shares"] == {"svc-2": 3, "svc-3": 3} and out["join"]["moved"] == 3
    assert out["steps_missing"] == 0 and out["steps_extra"] == 0
    assert out["spikes_opened"] == [("loss_spike:*:200:0", 6), ("loss_spike:*:60:0", 6)]
    assert set(out["opened"].values()) == {1}
    for log in tmp_path.glob("svc-*.log"):
        assert "Traceback" not in log.read_text(), log.name
