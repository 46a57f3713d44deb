"""``trainhealth analyze`` on a 1,000,000-step log: parse rate, parse+analyze rate, and bounded memory.

Run: ``.venv/bin/python bench/analyze_1m.py [--steps 1000000] [--small 100000] [--formats megatron,jsonl]
[--no-tracemalloc]``

Writes synthetic logs to a temp dir (deleted afterwards): a Megatron-LM stdout log (one
``iteration N/ M | ... |`` line per step, with elapsed time per iteration, so the goodput
ledger runs on real timings) and/or a generic JSON-lines log, each with injected anomalies —
a one-step loss spike (x2.5) at 37 % of the run with its grad-norm spike, 3 NaN-loss steps at
83 %, and 50 steps 4x slower at 60 %. Each measurement runs in a fresh child process:

- ``parse``: iterate :func:`trainhealth.collectors.importers.read` only (steps/s);
- ``analyze``: :func:`trainhealth.commands.analyze.analyze_file` — parse + the full offline pipeline
  (detectors, goodput ledger, rollback advisor) + the decimated chart series (steps/s); the
  child's peak RSS (``ru_maxrss``) after it, and its RSS after imports only (the baseline);
- ``traced``: the same under ``tracemalloc`` (slower): peak Python heap during the analysis.

The same at ``--small`` steps shows what grows with the log: the ratio of the peaks. The
pipeline's own state is capped (the ledger keeps the newest 200,000 steps of lineage, the data
positions 100,000), so memory grows up to that cap and stays flat after it. The Megatron reader
streams; the generic JSON-lines reader (``collectors/importers/_table.py``) reads every row
before yielding the first, so the JSONL figures include the whole file's rows in memory.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPIKE_AT, NAN_AT, SLOW_AT = 0.37, 0.83, 0.60


def _values(n: int, seed: int = 0):
    """(step, loss, grad norm, lr, seconds per step) of a synthetic run with the injected faults."""
    rng = random.Random(seed)
    spike, nan0, slow0 = int(n * SPIKE_AT), int(n * NAN_AT), int(n * SLOW_AT)
    for i in range(1, n + 1):
        loss = (2.0 + 8.0 * math.exp(-i / (n / 20))) * math.exp(rng.gauss(0.0, 0.01))
        gn = 0.5 * math.exp(rng.gauss(0.0, 0.05))
        sec = 0.3 * (1.0 + rng.gauss(0.0, 0.01))
        if i == spike:
            loss, gn = loss * 2.5, gn * 20
        if nan0 <= i < nan0 + 3:
            loss = math.nan
        if slow0 <= i < slow0 + 50:
            sec *= 4
        lr = 3e-4 * min(1.0, i / 2000)
        yield i, loss, gn, lr, sec


def write_megatron(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i, loss, gn, lr, sec in _values(n):
            loss_s = "nan" if math.isnan(loss) else f"{loss:.6E}"
            f.write(f" iteration {i:>9}/ {n:>9} | consumed samples: {i * 512:>12} | elapsed time per iteration (ms): "
                    f"{sec * 1e3:.1f} | learning rate: {lr:.3E} | global batch size:   512 | lm loss: {loss_s} | "
                    f"loss scale: 1.0 | grad norm: {gn:.3f} | number of skipped iterations:   0 | "
                    f"number of nan iterations:   {int(math.isnan(loss))} |\n")


def write_jsonl(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i, loss, gn, lr, sec in _values(n):
            f.write(json.dumps({"step": i, "loss": loss, "grad_norm": gn, "lr": lr, "step_seconds": round(sec, 5)})
                    + "\n")


WRITERS = {"megatron": (write_megatron, "log"), "jsonl": (write_jsonl, "jsonl")}


def child(mode: str, path: str) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    from trainhealth.collectors import importers
    from trainhealth.commands.analyze_report import analyze_file

    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: dict = {"mode": mode, "baseline_rss_mb": base_kb / 1024}
    t0 = time.perf_counter()
    if mode == "parse":
        n = sum(1 for _ in importers.read(path))
        out.update(steps=n)
    else:
        if mode == "traced":
            import tracemalloc

            tracemalloc.start()
        rep = analyze_file(path, progress=False)
        if mode == "traced":
            out["tracemalloc_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
        out.update(steps=rep.steps, chart_rows=len(rep.chart.rows()), timeline=rep.timeline,
                   anomalies=[f"{a.severity} {a.kind}@{a.step}" for a in rep.anomalies],
                   goodput_pct=rep.ledger["goodput_pct"] if rep.ledger else None)
    out["seconds"] = time.perf_counter() - t0
    out["steps_per_s"] = out["steps"] / out["seconds"]
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def measure(mode: str, path: Path) -> dict:
    res = subprocess.run([sys.executable, __file__, "--child", mode, str(path)], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=100_000)
    ap.add_argument("--formats", default="megatron,jsonl", help=f"comma-separated, of {', '.join(WRITERS)}")
    ap.add_argument("--no-tracemalloc", action="store_true", help="skip the (slow) tracemalloc runs")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    modes = ["parse", "analyze"] + ([] if args.no_tracemalloc else ["traced"])
    with tempfile.TemporaryDirectory(prefix="th-analyze-bench-") as tmp:
        for fmt in args.formats.split(","):
            write, ext = WRITERS[fmt]
            rows = {}
            for n in (args.small, args.steps):
                path = Path(tmp) / f"run_{n}.{ext}"
                t0 = time.perf_counter()
                write(path, n)
                size = path.stat().st_size / 2**20
                print(f"[{fmt}] wrote {n:,} steps ({size:,.0f} MiB) in {time.perf_counter() - t0:.1f} s", flush=True)
                rows[n] = {m: measure(m, path) for m in modes}
                r = rows[n]
                line = (f"[{fmt}] {n:>9,} steps: parse {r['parse']['steps_per_s']:>8,.0f} steps/s | "
                        f"parse+analyze {r['analyze']['steps_per_s']:>7,.0f} steps/s "
                        f"({r['analyze']['seconds']:.1f} s) | peak RSS {r['analyze']['peak_rss_mb']:.0f} MB "
                        f"(after imports {r['analyze']['baseline_rss_mb']:.0f} MB)")
                if "traced" in r:
                    line += f" | tracemalloc peak {r['traced']['tracemalloc_peak_mb']:.1f} MB"
                print(line, flush=True)
                print(f"[{fmt}]     chart rows {r['analyze']['chart_rows']:,}, timeline {r['analyze']['timeline']}, "
                      f"goodput {r['analyze']['goodput_pct']}%, anomalies: {', '.join(r['analyze']['anomalies'])}",
                      flush=True)
                path.unlink()
            big, small = rows[args.steps], rows[args.small]
            grow_rss = (big["analyze"]["peak_rss_mb"] - big["analyze"]["baseline_rss_mb"]) / max(
                small["analyze"]["peak_rss_mb"] - small["analyze"]["baseline_rss_mb"], 1e-9)
            ratio = f"[{fmt}] {args.steps // args.small}x the steps → RSS above imports x{grow_rss:.2f}"
            if "traced" in big:
                ratio += (f", tracemalloc peak x"
                          f"{big['traced']['tracemalloc_peak_mb'] / small['traced']['tracemalloc_peak_mb']:.2f}")
            print(ratio, flush=True)


if __name__ == "__main__":
    main()
