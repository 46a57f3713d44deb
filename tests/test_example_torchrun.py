"""End to end with real PyTorch: examples/torchrun_gpt.py under torchrun (4 CPU ranks, gloo, DDP) →
Redis → `trainhealth serve` → anomalies naming the slow rank and its host, and a crash + relaunch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import redis

from trainhealth.wire import decode_event, decode_steps

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torchrun_gpt.py"
_TORCHRUN = Path(sys.executable).with_name("torchrun")
TORCHRUN = [str(_TORCHRUN)] if _TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
TOKENS_PER_RANK_STEP = 8 * 64  # --batch-size 8 x --seq-len 64 (the example's defaults)


def torchrun(redis_url: str, *args: str, restarts: int = 0, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node", "4", "--max-restarts", str(restarts), str(EXAMPLE),
           "--log-every", "1000", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def ledger_with(r: redis.Redis, run: str, steps_done: int) -> Callable[[], dict | None]:
    def done() -> dict | None:
        raw = r.get(f"th:{{{run}}}:ledger:latest")
        snap = json.loads(raw) if raw else None
        return snap if snap and snap["steps_done"] == steps_done else None
    return done


def anomalies_of(r: redis.Redis, run: str) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in r.hgetall(f"th:{{{run}}}:anomalies").items()}


def test_slow_rank_is_named_with_its_host(r: redis.Redis, redis_url: str, serve: subprocess.Popen, wait_for) -> None:
    # The straggler detector scores 20-step windows and flags after 2 slow ones: 60 steps leave a margin.
    torchrun(redis_url, "--run-id", "gpt-straggler", "--steps", "60", "--slow-rank", "2", "--slow-ms", "40",
             "--ckpt-every", "0")
    snap = wait_for(ledger_with(r, "gpt-straggler", 60), 30, "the service to process the 60 steps")
    anomalies = anomalies_of(r, "gpt-straggler")
    slow = [a for a in anomalies.values() if a["kind"] == "straggler" and a["ranks"] == [2]]
    assert len(slow) == 1, anomalies
    a = slow[0]
    assert a["hosts"] == [socket.gethostname()]  # every rank runs on this machine
    # Slow from the first window to the end; the job then ended on every rank, which resolved it.
    assert (a["step"], a["status"], a["end_step"], a["evidence"]["run_ended"]) == (0, "resolved", 59, True)
    assert a["evidence"]["rank_median_s"] >= 0.040 > a["evidence"]["best_median_s"]  # it sleeps 40 ms in forward
    assert a["evidence"]["score"] < 0.7

    recs = [x for _, f in r.xrange("th:{gpt-straggler}:steps") for x in decode_steps(f)]
    assert sorted({x.rank for x in recs}) == [0, 1, 2, 3] and len(recs) == 4 * 60
    for x in recs:
        assert set(x.sections) == {"data", "forward", "optimizer"}
        assert x.loss is not None and x.grad_norm is not None and x.lr is not None
        assert (x.tokens, x.samples, x.consumed_samples) == (TOKENS_PER_RANK_STEP, 8, (x.step + 1) * 8 * 4)
    # DDP: every rank's gradients are the all-reduced ones, so the global grad norm agrees across ranks.
    norms: dict[int, set[float]] = {}
    for x in recs:
        norms.setdefault(x.step, set()).add(x.grad_norm)
    assert all(len(v) == 1 for v in norms.values())
    assert snap["tokens_total"] == 60 * 4 * TOKENS_PER_RANK_STEP and snap["restarts"] == 0
    assert r.hget("th:{gpt-straggler}:meta", "status") == b"finished"


def test_crash_and_torchrun_relaunch_resume_from_checkpoint(r: redis.Redis, redis_url: str, tmp_path: Path,
                                                           serve: subprocess.Popen, wait_for) -> None:
    ckpt = tmp_path / "ckpt"
    torchrun(redis_url, "--run-id", "gpt-crash", "--steps", "40", "--ckpt-every", "10", "--crash-step", "25",
             "--ckpt-dir", str(ckpt), restarts=1)
    # First launch: steps 0-25, checkpoints after 9 and 19; relaunch from step 19's: steps 20-39.
    snap = wait_for(ledger_with(r, "gpt-crash", 26 + 20), 30, "the service to process all 46 step attempts")
    restarts = [a for a in anomalies_of(r, "gpt-crash").values() if a["kind"] == "restart"]
    assert len(restarts) == 1
    ev = restarts[0]["evidence"]
    assert (ev["last_step"], ev["resume_step"], ev["steps_recomputed"]) == (25, 20, 6)  # resume = checkpoint + 1
    assert (snap["steps_good"], snap["restarts"], snap["last_step"]) == (40, 1, 39)
    assert snap["tokens_good"] == 40 * 4 * TOKENS_PER_RANK_STEP

    events = [decode_event(f) for _, f in r.xrange("th:{gpt-crash}:events")]
    loads = [e for e in events if e.kind == "checkpoint_load"]
    assert sorted(e.rank for e in loads) == [0, 1, 2, 3] and {e.step for e in loads} == {19}
    assert all(e.seconds > 0 for e in loads)
    saves = sorted((e.step, e.rank) for e in events if e.kind == "checkpoint_save")
    assert saves == [(s, rank) for s in (9, 19, 29, 39) for rank in range(4)]
    assert sorted(p.name for p in ckpt.iterdir()) == [f"ckpt-{s:08d}.pt" for s in (9, 19, 29, 39)]
    assert sorted(e.rank for e in events if e.kind == "run_start") == [0, 0, 1, 1, 2, 2, 3, 3]  # 2 launches
    assert sorted(e.rank for e in events if e.kind == "run_end") == [0, 1, 2, 3]  # only the relaunch ends cleanly


def test_a_frozen_model_at_a_held_learning_rate_is_a_plateau(r: redis.Redis, redis_url: str,
                                                              serve: subprocess.Popen, wait_for) -> None:
    # --plateau-from 100: a constant learning rate after warm-up, no update from step 100 on; the run's detector
    # settings judge a 50-step stretch against a 5 % gain (the frozen model's loss moves ~3 % with each batch).
    torchrun(redis_url, "--run-id", "gpt-plateau", "--steps", "200", "--plateau-from", "100", "--ckpt-every", "0")
    wait_for(ledger_with(r, "gpt-plateau", 200), 30, "the service to process the 200 steps")
    assert json.loads(r.hget("th:{gpt-plateau}:meta", "detector_settings")) == {
        "plateau": {"min_steps": 50, "min_points": 25, "run_fraction": 0.25, "min_gain": 0.05}}
    plateaus = {k: a for k, a in anomalies_of(r, "gpt-plateau").items() if a["kind"] == "plateau"}
    assert list(plateaus) == ["plateau:*:99:0"]
    ev = plateaus["plateau:*:99:0"]["evidence"]
    assert (plateaus["plateau:*:99:0"]["status"], ev["first_step"], ev["last_step"], ev["points"]) == (
        "active", 149, 199, 51)
    assert (ev["lr_min"], ev["lr_max"], ev["lr_peak"], ev["gpus"]) == (3e-3, 3e-3, 3e-3, 4)
    assert abs(ev["gain"]) < 0.05 < ev["median_before"]


def test_a_slow_link_within_one_node_is_a_network_anomaly_on_that_node(r: redis.Redis, redis_url: str,
                                                                        serve: subprocess.Popen, wait_for) -> None:
    # 4 ranks as 2 simulated nodes of 2; node 1's all-reduce within the node 40 ms slower for steps 40-99 of 140:
    # the other node's ranks wait for it in the untimed all-reduce across nodes.
    torchrun(redis_url, "--run-id", "gpt-net", "--steps", "140", "--slow-comm-node", "1", "--ranks-per-node", "2",
             "--slow-comm-ms", "40", "--slow-comm-from", "40", "--slow-comm-to", "100", "--ckpt-every", "0")
    wait_for(ledger_with(r, "gpt-net", 140), 30, "the service to process the 140 steps")
    anomalies = anomalies_of(r, "gpt-net")
    # Whether a straggler is flagged beside it is not asserted here: 4 CPU ranks share 2 cores, and a rank's compute
    # is now and then starved into a straggler by that contention alone (seen on node 1's ranks and on the others).
    # That a slow link is no straggler is tested where the timings are exact (tests/test_network.py) and on the
    # demo's job (tests/test_e2e.py).
    [net] = [a for a in anomalies.values() if a["kind"] == "network_slow"]
    assert (net["ranks"], net["hosts"], net["status"]) == ([2, 3], [f"{socket.gethostname()}-node1"], "resolved")
    # Judged on 20-step windows: the stretch's own, 40-99 (on these 2 cores the window before it, 20-39, sometimes
    # reads as high from the contention's noise and opens it one window early).
    onset = net["step"]
    assert (net["id"], onset in (20, 40), net["end_step"]) == (
        "network_slow:" + net["hosts"][0] + f":{onset}:0", True, 99), net
    assert net["message"].startswith(f"{net['hosts'][0]}'s ranks spent more of the step in communication than the "
                                     f"other nodes' from step {onset} to 99")


def test_a_rank_whose_memory_grows_is_a_memory_growth_anomaly_on_it(r: redis.Redis, redis_url: str,
                                                                   serve: subprocess.Popen, wait_for) -> None:
    # Rank 1 keeps 512 KiB of tensors more every step (bounded at 384 MiB); the run's own settings judge the trend on
    # 30 s of 1-s heartbeats and open at 48 MiB of growth. Steps of at least 90 ms: 700 steps last 63 s or more on any
    # machine (unpaced they took 35-45 s on 2 cores, and the service may restart the trend once, up to 5 s in, when
    # rank 0's detector settings arrive after another rank registered the run: too thin a margin over 30 s).
    torchrun(redis_url, "--run-id", "gpt-leak", "--steps", "700", "--leak-rank", "1", "--leak-kib", "512",
             "--min-step-ms", "90", "--ckpt-every", "0", timeout=300)
    wait_for(ledger_with(r, "gpt-leak", 700), 30, "the service to process the 700 steps")
    leaks = [a for a in anomalies_of(r, "gpt-leak").values() if a["kind"] == "memory_growth"]
    # On failure: rank 1's RSS (MiB) over time as the service saw it (th:{run}:mem, one entry every few seconds).
    seen = [(round(float(f[b"t"]), 1), int(f[b"step"]), json.loads(f[b"rss"])[1:2])
            for _, f in r.xrange("th:{gpt-leak}:mem")]
    assert len(leaks) == 1, (leaks, seen)
    [leak] = leaks
    ev = leak["evidence"]
    assert (leak["ranks"], ev["metric"], leak["status"], ev["run_ended"], leak["end_step"]) == (
        [1], "host", "resolved", True, 699)
    # Opened once 30 s of samples showed it, after at least 48 MiB of growth along a steady trend.
    assert ev["span_s"] >= 30.0 and ev["last"] - ev["first"] >= 48 * 2**20 and ev["rho"] >= 0.9
    assert leak["message"].startswith(f"rank 1 ({leak['hosts'][0]}): host memory (RSS) grows ")
