"""Per-step cost of the step detectors: the offline pipeline on the real logs, and each detector class alone.

Run: ``.venv/bin/python bench/detector_steps.py [--steps 200000] [--repeat 5] [--json]``

1. **Real logs** (``$TRAINHEALTH_REAL_LOGS`` or ``shared/real_logs`` beside the repository): every file
   :func:`trainhealth.commands.replay.read_points` parses is fed through
   :class:`trainhealth.detectors.offline.OfflineRun` (what
   ``trainhealth analyze`` runs per logged step), parsed once beforehand so only the pipeline is timed. The
   baseline, measured in the same run on the same points, is the same pipeline with no step detectors
   (aggregation, goodput ledger, hang bookkeeping, rollback advisor); the detectors' share is the difference,
   reported as steps/s (``steps / (t_full - t_base)``) and as the ratio ``t_full / t_base``. The total is also given
   for the pipeline with its :class:`~trainhealth.detectors.divergence.DivergenceDetector` built on the pipeline's own
   :class:`~trainhealth.detectors.loss_spike.LossSpikeDetector` (``shared=True``) instead of a private copy of it:
   the same
   anomalies without running the loss-spike detector twice (a wiring ``detectors/pipeline.py`` could adopt).
2. **Each detector class alone** on one seeded synthetic stream of ``--steps`` one-rank step aggregates (a
   decaying log-normal loss with one-step spikes and a plateau, a grad norm with its own spikes, step times with a
   periodic slow step, isolated hiccups and a 30 % throughput drop, bursts of skipped steps): microseconds per
   ``update`` and steps/s, next to the baseline's microseconds per step on the real logs (``x base``: how much
   one detector adds to a step relative to aggregation + ledger).

Every figure is the best of ``--repeat`` runs of this process's CPU time (``time.process_time``: the machine is
shared, and CPU time with the minimum over runs is the least disturbed by other work).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainhealth.detectors.aggregate import StepAggregate  # noqa: E402
from trainhealth.detectors.divergence import DivergenceDetector  # noqa: E402
from trainhealth.detectors.grad_norm_explosion import GradNormExplosionDetector  # noqa: E402
from trainhealth.detectors.grad_norm_spike import GradNormSpikeDetector  # noqa: E402
from trainhealth.detectors.loss_spike import LossSpikeDetector  # noqa: E402
from trainhealth.detectors.offline import OfflineRun  # noqa: E402
from trainhealth.detectors.pipeline import RunPipeline  # noqa: E402
from trainhealth.detectors.skipped_steps import SkippedStepsDetector  # noqa: E402
from trainhealth.detectors.slow_step import SlowStepDetector  # noqa: E402
from trainhealth.detectors.throughput import ThroughputDropDetector  # noqa: E402

DETECTORS: dict[str, Callable[[], Any]] = {
    "LossSpikeDetector": LossSpikeDetector,
    "GradNormSpikeDetector": GradNormSpikeDetector,
    "DivergenceDetector": DivergenceDetector,
    "GradNormExplosionDetector": GradNormExplosionDetector,
    "SkippedStepsDetector": SkippedStepsDetector,
    "ThroughputDropDetector": ThroughputDropDetector,
    "SlowStepDetector": SlowStepDetector,
}


def real_logs_dir() -> Path:
    return Path(os.environ.get("TRAINHEALTH_REAL_LOGS") or ROOT.parent / "shared" / "real_logs")


def real_logs() -> list[tuple[str, list[Any]]]:
    """(name, parsed points) of every log in the folder (and its subfolders) that the importers read."""
    from trainhealth.commands.replay import read_points
    from trainhealth.exceptions import InputFormatError

    out = []
    for path in sorted(p for p in real_logs_dir().rglob("*") if p.is_file() and p.suffix != ".md"):
        try:
            pts = list(read_points(path))
        except InputFormatError:
            continue  # not a training log (a benchmark's output, a profiler trace): nothing to time
        out.append((path.name, pts))
    return out


def _best(fn: Callable[[], None], repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def _no_step_detectors() -> RunPipeline:
    pipe = RunPipeline(1, run="offline")
    pipe.step_detectors = []
    return pipe


def _shared_divergence() -> RunPipeline:
    pipe = RunPipeline(1, run="offline")
    dets = pipe.step_detectors
    loss = next(d for d in dets if type(d) is LossSpikeDetector)
    i = next(i for i, d in enumerate(dets) if type(d) is DivergenceDetector)
    dets[i] = DivergenceDetector(spikes=loss, shared=True)  # after `loss` in the list: it is fed first
    return pipe


def bench_logs(repeat: int) -> list[dict[str, Any]]:
    """Full pipeline, the no-detector baseline and the shared-divergence wiring on each real log (seconds, the best
    of ``repeat``)."""
    rows = []
    for name, pts in real_logs():
        steps = sum(not p.is_eval for p in pts)
        full = _best(lambda pts=pts: OfflineRun().feed_all(pts), repeat)
        base = _best(lambda pts=pts: OfflineRun(pipeline=_no_step_detectors()).feed_all(pts), repeat)
        try:
            shared = _best(lambda pts=pts: OfflineRun(pipeline=_shared_divergence()).feed_all(pts), repeat)
        except TypeError:  # a DivergenceDetector without ``shared`` (this script run on older code)
            shared = math.nan
        rows.append({"log": name, "steps": steps, "full_s": full, "base_s": base, "shared_s": shared})
    return rows


def synthetic_stream(n: int, seed: int = 0) -> list[StepAggregate]:
    """``n`` one-rank aggregates with the faults the detectors look for (see the module docstring)."""
    rng = random.Random(seed)
    out = []
    drop0, drop1 = int(n * 0.55), int(n * 0.6)
    for step in range(1, n + 1):
        loss = (2.0 + 6.0 * math.exp(-step / (n / 10))) * math.exp(rng.gauss(0.0, 0.02))
        gn = 0.8 * math.exp(rng.gauss(0.0, 0.15))
        if step % 20_011 == 0:
            loss *= 2.0  # one-step loss spike, with the grad norm
            gn *= 15.0
        elif step % 33_331 == 0:
            gn *= 12.0  # grad-norm spike alone
        if step % 70_001 < 40:
            loss *= 1.6  # a plateau
        sec = 0.25 * math.exp(rng.gauss(0.0, 0.02))
        if step % 10 == 1:
            sec *= 5.0  # periodic slow step (the rhythm)
        if step % 9_973 == 0:
            sec *= 8.0  # an isolated hiccup
        if drop0 <= step < drop1:
            sec *= 1.3  # a throughput drop
        skipped = step % 50_000 < 5 and step > 1000
        out.append(StepAggregate(step, 0, 0.0, None, float(step), loss, gn, 3e-4, None, None, 1, (None,), 0.0,
                                 skipped=skipped, step_s=sec))
    return out


def bench_classes(aggs: list[StepAggregate], repeat: int) -> dict[str, float]:
    """Seconds per run of each detector class over ``aggs`` (best of ``repeat``, a fresh detector each run)."""

    def run(make: Callable[[], Any], aggs: Iterable[StepAggregate] = aggs) -> None:
        update = make().update
        for a in aggs:
            update(a)

    return {name: _best(lambda make=make: run(make), repeat) for name, make in DETECTORS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200_000, help="steps of the synthetic stream per detector class")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement (the best is kept)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)

    rows = bench_logs(args.repeat)
    steps = sum(r["steps"] for r in rows)
    full = sum(r["full_s"] for r in rows)
    base = sum(r["base_s"] for r in rows)
    shared = sum(r["shared_s"] for r in rows)
    base_us = base / steps * 1e6
    aggs = synthetic_stream(args.steps)
    classes = bench_classes(aggs, args.repeat)
    if args.json:
        print(json.dumps({"logs": rows, "total": {"steps": steps, "full_s": full, "base_s": base, "shared_s": shared},
                          "classes": {k: {"steps": len(aggs), "s": v} for k, v in classes.items()}}, indent=1))
        return 0

    def share(f: float, b: float, n: int) -> str:
        return f"{n / (f - b):>12,.0f}" if f > b else f"{'-':>12}"

    print(f"Offline pipeline on the real logs (best of {args.repeat}); baseline = the same pipeline without step "
          f"detectors")
    print(f"{'log':52} {'steps':>7} {'steps/s':>10} {'base st/s':>10} {'detectors st/s':>14} {'x base':>7}")
    for r in rows:
        print(f"{r['log'][:52]:52} {r['steps']:>7,} {r['steps'] / r['full_s']:>10,.0f} "
              f"{r['steps'] / r['base_s']:>10,.0f}   {share(r['full_s'], r['base_s'], r['steps'])} "
              f"{r['full_s'] / r['base_s']:>7.2f}")
    print(f"{'total':52} {steps:>7,} {steps / full:>10,.0f} {steps / base:>10,.0f}   {share(full, base, steps)} "
          f"{full / base:>7.2f}")
    if not math.isnan(shared):
        print(f"{'total, divergence sharing the loss-spike detector':52} {steps:>7,} {steps / shared:>10,.0f} "
              f"{steps / base:>10,.0f}   {share(shared, base, steps)} {shared / base:>7.2f}")
    print()
    print(f"Each detector class alone on a {len(aggs):,}-step synthetic stream (best of {args.repeat}); "
          f"x base = its us/step over the baseline's {base_us:.2f} us/step above")
    print(f"{'detector':28} {'us/step':>8} {'steps/s':>12} {'x base':>7}")
    for name, s in classes.items():
        us = s / len(aggs) * 1e6
        print(f"{name:28} {us:>8.2f} {len(aggs) / s:>12,.0f} {us / base_us:>7.2f}")
    total = sum(classes.values())
    print(f"{'all seven':28} {total / len(aggs) * 1e6:>8.2f} {len(aggs) / total:>12,.0f} "
          f"{total / len(aggs) * 1e6 / base_us:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
