"""Leave-one-file-out evaluation on the real logs: every parameter chosen on real logs, chosen again without the
file that is scored.

Run: ``.venv/bin/python bench/lofo.py [--json] [--kinds loss_spike,slow_step]`` (about 2-4 CPU-minutes).

Some detector parameters were set by looking at real logs (``trainhealth/defaults.py`` says which: the loss
spike's 1.2x floor from modded-nanogpt and Mixtral, the divergence's 20 % from the healthy logs, …). Scored on
those same logs they flatter. Here, for every real log ``f`` of ``bench/labels.toml`` and every kind, each such
parameter (:data:`TUNABLES`) is chosen again from its grid by the F1 of that kind on **the other real logs**
(ties: fewer false alarms, then the value nearest the default), and ``f`` is then run once with the chosen values
of every kind and scored. The table sums those held-out scores over the files, beside the in-sample figures (the
defaults, scored on every file) and the peer rules on the same files (their own fixed settings). A kind whose
held-out F1 falls well below its in-sample F1 was fitted to the files it was tuned on.

Parameters are set on the pipeline's detector objects after they are built (they read their public parameters
at every step, river-style), nested detectors included (the divergence detector's private loss-spike detector
gets the loss-spike values). The synthetic corpus plays no part here: ``bench/detection_eval.py`` reports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import detection_eval as de
from eval_corpus import real_sources


@dataclass(frozen=True)
class Tunable:
    """A detector parameter chosen on real logs: ``cls.attr`` over ``grid`` (its default among them), scored on
    ``kind``."""

    kind: str
    cls: str
    attr: str
    grid: tuple[float, ...]

    @property
    def name(self) -> str:
        return f"{self.cls}.{self.attr}"


#: The parameters set by looking at real logs (trainhealth/defaults.py), each with a grid around its default.
TUNABLES: tuple[Tunable, ...] = (
    Tunable("loss_spike", "LossSpikeDetector", "z_open", (5.0, 5.5, 6.0, 6.5, 7.0, 8.0)),
    Tunable("loss_spike", "LossSpikeDetector", "min_rel_rise", (0.1, 0.15, 0.2, 0.3, 0.5)),
    Tunable("loss_spike", "LossSpikeDetector", "record_ratio", (1.5, 2.0, 3.0, 5.0)),
    Tunable("grad_norm_spike", "GradNormSpikeDetector", "z_open", (6.0, 7.0, 8.0, 9.0, 10.0)),
    Tunable("grad_norm_spike", "GradNormSpikeDetector", "min_rel_rise", (0.5, 1.0, 1.5, 2.0)),
    Tunable("grad_norm_spike", "GradNormSpikeDetector", "order_jump", (5.0, 10.0, 20.0, 50.0)),
    Tunable("loss_collapse", "LossCollapseDetector", "min_points", (2, 3, 5, 8)),
    Tunable("divergence", "DivergenceDetector", "min_rise", (0.1, 0.15, 0.2, 0.3)),
    Tunable("grad_norm_explosion", "GradNormExplosionDetector", "factor", (5.0, 10.0, 20.0)),
    Tunable("throughput_drop", "ThroughputDropDetector", "min_rel_change", (0.02, 0.03, 0.05, 0.08)),
    Tunable("throughput_drop", "ThroughputDropDetector", "hold_steps", (10, 25, 50, 100)),
    Tunable("slow_step", "SlowStepDetector", "ratio", (1.5, 2.0, 2.5, 3.0)),
)


def detectors_of(obj: Any, seen: set[int] | None = None) -> Iterable[Any]:
    """Every detector object reachable from the pipeline's detectors (their attributes, one level of nesting)."""
    seen = set() if seen is None else seen
    for det in getattr(obj, "step_detectors", []):
        for d in (det, *vars(det).values()):
            if id(d) not in seen and type(d).__name__.endswith("Detector"):
                seen.add(id(d))
                yield d


def setter(values: dict[tuple[str, str], float]) -> Any:
    """A ``setup`` for :func:`detection_eval.run_source` setting ``values`` (``(class name, attr) -> value``)."""
    def setup(pipe: Any) -> None:
        for det in detectors_of(pipe):
            for (cls, attr), v in values.items():
                if type(det).__name__ == cls:
                    if not hasattr(det, attr):
                        raise AttributeError(f"{cls} has no parameter {attr!r}")
                    setattr(det, attr, v)
    return setup


def default_of(t: Tunable) -> float:
    from trainhealth.detectors import pipeline

    pipe = pipeline.RunPipeline()
    for det in detectors_of(pipe):
        if type(det).__name__ == t.cls:
            return getattr(det, t.attr)
    raise LookupError(f"no {t.cls} in the pipeline")


def run_all(sources: list[Any], values: dict[tuple[str, str], float], peers: bool = False) -> list[de.RunResult]:
    return [de.run_source(src, peers=peers, setup=setter(values)) for src in sources]


def scores(results: list[de.RunResult], kind: str, system: str = "ours") -> list[de.Score]:
    return [de.score(r.dets.get(system, []), r.labels, r.steps, kind, r.covered(kind)) for r in results]


def total(parts: Iterable[de.Score]) -> de.Score:
    out = de.Score()
    for p in parts:
        out.add(p)
    return out


def choose(t: Tunable, per_value: dict[float, list[de.Score]], leave_out: int, default: float) -> float:
    """The grid value with the best F1 on every file but ``leave_out`` (ties: fewer false alarms, nearest the
    default); a value with no labels to score (F1 undefined) ranks by false alarms alone."""
    def key(v: float) -> tuple[float, float, float]:
        sc = total(s for i, s in enumerate(per_value[v]) if i != leave_out)
        return (sc.f1 if sc.f1 is not None else -1.0, -sc.fa, -abs(v - default))
    return max(per_value, key=key)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--kinds", help="comma-separated kinds to evaluate (default: every kind of TUNABLES)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    kinds = args.kinds.split(",") if args.kinds else sorted({t.kind for t in TUNABLES})
    tunables = [t for t in TUNABLES if t.kind in kinds]
    sources = real_sources()
    names = [s.name for s in sources]
    defaults = {t.name: default_of(t) for t in tunables}
    for t in tunables:
        if defaults[t.name] not in t.grid:
            raise ValueError(f"{t.name}: the default {defaults[t.name]} is not in its grid {t.grid}")
    base = run_all(sources, {}, peers=True)  # in-sample: defaults on every file, and the peers
    # One pass over the files per grid value of each parameter (the others at their defaults).
    grid: dict[str, dict[float, list[de.Score]]] = {}
    for t in tunables:
        grid[t.name] = {}
        for v in t.grid:
            res = base if v == defaults[t.name] else run_all(sources, {(t.cls, t.attr): v})
            grid[t.name][v] = scores(res, t.kind)
    chosen: list[dict[str, float]] = []
    held: dict[str, list[de.Score]] = {k: [] for k in kinds}
    for i, src in enumerate(sources):
        values = {t.name: choose(t, grid[t.name], i, defaults[t.name]) for t in tunables}
        chosen.append(values)
        res = de.run_source(src, peers=False, setup=setter({(t.cls, t.attr): values[t.name] for t in tunables}))
        for k in kinds:
            held[k].append(scores([res], k)[0])
    rows = []
    for k in kinds:
        ins, lofo = total(scores(base, k)), total(held[k])
        peers = {p: total(scores(base, k, p)) for p in de.systems_for(k)[1:]}
        beats = all(lofo.f1 is not None and (p.f1 is None or lofo.f1 > p.f1 or (lofo.f1 == p.f1 and
                    (lofo.fa_per_10k or 0) < (p.fa_per_10k or 0))) for p in peers.values())
        rows.append({"kind": k, "in_sample": ins.row(), "lofo": lofo.row(),
                     "peers": {p: sc.row() for p, sc in peers.items()},
                     # None: not applicable (no label of the kind in the real logs, or no healthy step to judge)
                     "targets": {"f1": None if lofo.f1 is None else lofo.f1 >= de.TARGET_F1,
                                 "fa": None if lofo.fa_per_10k is None else lofo.fa_per_10k <= de.TARGET_FA_PER_10K,
                                 "beats_peers": None if lofo.f1 is None else beats},
                     "missed": [f"{names[i]}@{m.start}" for i, sc in enumerate(held[k]) for m in sc.missed],
                     "false_alarms": [f"{names[i]}@{s}" for i, sc in enumerate(held[k]) for s in sc.fa_steps]})
    stability = {t.name: {"default": defaults[t.name],
                          "chosen": sorted({c[t.name] for c in chosen}),
                          "files_off_default": [names[i] for i, c in enumerate(chosen)
                                                if c[t.name] != defaults[t.name]]} for t in tunables}
    doc = {"files": names, "rows": rows, "parameters": stability, "seconds": round(time.perf_counter() - t0, 1)}
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
        return 0
    print(f"Leave-one-file-out on {len(names)} real logs ({doc['seconds']} s)")
    print(f"{'kind':22} {'labels':>6} {'in-sample F1':>12} {'FA/10k':>7} {'LOFO F1':>8} {'FA/10k':>7} {'targets':>8}  "
          "best peer F1")
    for row in rows:
        ins, lofo, tg = row["in_sample"], row["lofo"], row["targets"]
        peer = max((p["f1"] for p in row["peers"].values() if p["f1"] is not None), default=None)
        ok = "n/a" if all(v is None for v in tg.values()) else ("FAIL" if False in tg.values() else "PASS")
        print(f"{row['kind']:22} {lofo['labels']:>6} {de._f(ins['f1']):>12} {de._f(ins['fa_per_10k']):>7} "
              f"{de._f(lofo['f1']):>8} {de._f(lofo['fa_per_10k']):>7} {ok:>8}  {de._f(peer)}")
        if row["missed"]:
            print(f"    missed: {', '.join(row['missed'])}")
        if row["false_alarms"]:
            print(f"    false alarms: {', '.join(row['false_alarms'][:12])}")
    print("\nParameters (default; values chosen across the folds; files whose fold moved it):")
    for name, st in stability.items():
        off = st["files_off_default"]
        moved = f"{len(off)} of {len(names)} folds" + (f" ({', '.join(off[:3])}{', …' if len(off) > 3 else ''})"
                                                       if off else "")
        print(f"  {name:40} {st['default']:<6g} {', '.join(f'{v:g}' for v in st['chosen']):14} {moved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
