"""Overhead of trainhealth on a real training job: the torchrun example with monitoring on vs off.

Run: ``.venv/bin/python bench/example_overhead.py [--rounds 5] [--steps 300]`` (needs the
``torch`` extra). Starts its own redis-server and ``trainhealth serve`` (so the collectors'
records really flow), then runs ``examples/torchrun_gpt.py`` with 4 ranks (gloo, CPU)
alternately with and without monitoring, ``--rounds`` times each, and prints the training
loop time of each run (rank 0, between barriers) and the overhead: the median over rounds of
(on - off) / off. On this 2-core machine 4 ranks share 2 cores, so run-to-run noise is of the
order of percents; the per-round pairs and the spread are printed with the median.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainhealth.embedded_redis import EmbeddedRedis, free_port  # noqa: E402


def run_once(env: dict[str, str], steps: int, monitor: bool, run: str) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(ROOT / "examples" / "torchrun_gpt.py"), "--run-id", run, "--steps", str(steps), "--log-every", "100000",
           "--print-timing"]
    if not monitor:
        cmd.append("--no-monitor")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=1800).stdout
    m = re.search(r"RESULT loop_s=([\d.]+) steps=\d+ sender_cpu_s=([\d.]+)", out)
    return float(m.group(1)), float(m.group(2))


def hot_path_ns_per_step() -> float:
    """Median ns of one instrumented step's collector calls (as the example makes them), Redis unset."""
    import time

    from trainhealth import Monitor

    mon = Monitor("overhead-probe", rank=0, world_size=1, spill_dir=False, buffer_records=1_000_000)
    pc, samples = time.perf_counter_ns, []
    for b in range(200):
        t0 = pc()
        for i in range(500):
            with mon.step(b * 500 + i):
                with mon.section("data"):
                    pass
                with mon.section("forward"):
                    pass
                with mon.section("optimizer"):
                    pass
            mon.log_step(b * 500 + i, loss=2.5, grad_norm=1.0, lr=3e-4, tokens=512, samples=8, consumed_samples=i)
        samples.append((pc() - t0) / 500)
    mon._off = True
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    emb = EmbeddedRedis(Path(tempfile.mkdtemp()), port=free_port())
    url = emb.ensure_running()
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": url, "OMP_NUM_THREADS": "1"}
    serve = subprocess.Popen([sys.executable, "-m", "trainhealth", "serve"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run_once(env, 20, True, "warmup")  # imports, caches
        ratios, rows, sender_cpu = [], [], []
        for i in range(args.rounds):
            off, _ = run_once(env, args.steps, False, f"off-{i}")
            on, cpu = run_once(env, args.steps, True, f"on-{i}")
            ratios.append((on - off) / off)
            rows.append((off, on))
            sender_cpu.append(cpu)
            print(f"round {i}: off {off:.3f} s, on {on:.3f} s, overhead {100 * ratios[-1]:+.2f} %", flush=True)
        off_med = statistics.median(off for off, _ in rows)
        step_ms = off_med / args.steps * 1e3
        print(f"4 ranks x {args.steps} steps, median step {step_ms:.1f} ms (monitoring off)")
        print(f"A/B wall-clock overhead: median {100 * statistics.median(ratios):+.2f} %, "
              f"min {100 * min(ratios):+.2f} %, max {100 * max(ratios):+.2f} % over {args.rounds} rounds")
        # Accounting, far less noisy: what the collector itself costs a rank per step.
        hot = hot_path_ns_per_step()
        cpu_per_step = statistics.median(sender_cpu) / args.steps
        share = (hot * 1e-9 + cpu_per_step) / (off_med / args.steps)
        print(f"accounted: hot path {hot / 1e3:.1f} us/step (step() + 3 sections + log_step, measured here) + "
              f"sender thread {cpu_per_step * 1e6:.1f} us CPU/step (rank 0, thread_time after connecting) = "
              f"{100 * share:.3f} % of a {step_ms:.1f} ms step")
    finally:
        serve.terminate()
        serve.wait(10)
        emb.stop()


if __name__ == "__main__":
    main()
