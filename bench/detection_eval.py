"""Detection evaluation: every detector kind, and peer rules, scored on a labelled corpus.

Run: ``.venv/bin/python bench/detection_eval.py [--quick] [--json] [--per-scenario] [--save PATH] [--jobs N]
[--only REGEX] [--no-real] [--no-peers] [--lofo]`` (full: ~330,000 steps, about 3 CPU-minutes; ``--quick``: ~45,000).

The corpus (``bench/eval_corpus.py``): seeded synthetic runs with exact ground truth — dev seeds and held-out
seeds, reported separately — and the real logs of ``shared/real_logs`` labelled in ``bench/labels.toml``. Each
run goes through the live pipeline (:class:`trainhealth.detectors.pipeline.RunPipeline`, heartbeat checks every 5 s of
simulated time, as the service does; real logs through :class:`trainhealth.detectors.offline.OfflineRun`) and, in the
same
pass, through the peer rules of ``bench/eval_peers.py`` fed the same per-step values (the aggregates' loss, grad
norm and seconds per step). Whatever kinds the pipeline produces are scored, so new detectors are picked up.

Scoring, per kind and system
----------------------------
* A detection (an anomaly's onset step; for a peer, the first of consecutive alerted points) **matches** a label
  of the same kind when the onset falls in the label's range extended by its tolerance (``[start - before,
  end + after]``, set per label: see ``eval_corpus.py`` and ``labels.toml``) and, for a label naming ranks or
  hosts, the detection's ranks (or hosts) are among them. A label is matched once (the earliest-starting free
  label wins); further detections on a matched label are **duplicates**, counted apart (neither hit nor false
  alarm). **Detection delay** = onset - label start, in steps.
* A detection matching no label of its kind but falling in a label listed in :data:`ACCEPT` for its kind, or in
  an ``ignore`` label, is **ignored** (a right call under another name, or an ambiguous stretch).
* Any other detection is a **false alarm**. Healthy steps of a kind = steps (complete step aggregates) of the
  runs that carry that kind's input (:data:`COVERS`: a loss for the loss kinds, step times for the timing kinds,
  per-rank sections for the rank kinds, heartbeats for hangs), outside every label of the kind or accepted by it.
* precision = TP / (TP + FA); recall = TP / labels; F1; median and p90 (nearest rank) delay; false alarms per
  10,000 healthy steps.

The real-log split is printed first: it is the headline (the synthetic corpus tests what no real log shows yet).
``--lofo`` adds the leave-one-file-out evaluation of the real logs (``bench/lofo.py``): every parameter chosen on
real logs chosen again without the file being scored.

Targets (printed PASS/FAIL per split): F1 >= 0.9; <= 1 false alarm per 10,000 healthy steps; F1 above every
peer rule that covers the kind on the same data (equal F1 passes only with fewer false alarms per 10,000 steps).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing as mp
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_corpus import (
    Label,
    Source,
    excluded_logs,
    real_logs_dir,
    real_sources,
    synthetic_sources,
)
from eval_peers import PEER_KINDS, make_peers

from trainhealth.anomaly import KINDS, SEVERITIES

#: Label kinds on which a detection of the key kind is a right call under another name (neither hit nor
#: false alarm): a spike detector firing on a divergence (an unrecovered rise is first a spike) or on a NaN
#: loss (Lightning counts non-finite losses as spikes); a grad-norm spike at the start of an explosion or on a
#: NaN grad norm; NaN steps are skipped steps too; a slow rank on a slow node is a straggler and an outlier, an
#: outlier rank that is also slow is a straggler; stragglers and slow nodes slow every step (throughput drop,
#: slow steps); a throughput drop starts with slow steps; a dead rank hangs the job. Divergence labels are matched
#: by ``divergence`` only: a spike that never recovers carries both labels (see ``eval_corpus``).
ACCEPT: dict[str, frozenset[str]] = {
    "loss_spike": frozenset({"divergence", "nan_inf"}),
    "grad_norm_spike": frozenset({"grad_norm_explosion", "nan_inf"}),
    "grad_norm_explosion": frozenset({"nan_inf"}),
    "skipped_steps": frozenset({"nan_inf"}),
    "straggler": frozenset({"slow_node", "rank_outlier"}),
    "rank_outlier": frozenset({"straggler", "slow_node"}),
    "throughput_drop": frozenset({"straggler", "slow_node"}),
    "slow_step": frozenset({"throughput_drop", "straggler", "slow_node"}),
    "hang": frozenset({"dead_rank"}),
}

#: Input a run must carry for a kind to be evaluated on it (its steps count as healthy steps of the kind).
COVERS = {
    "nan_inf": ("loss", "grad_norm"), "loss_spike": ("loss",), "divergence": ("loss",),
    "grad_norm_spike": ("grad_norm",), "grad_norm_explosion": ("grad_norm",), "skipped_steps": ("skip",),
    "throughput_drop": ("timed",), "slow_step": ("timed",), "straggler": ("ranks",), "slow_node": ("ranks",),
    "rank_outlier": ("ranks",), "dead_rank": ("ranks",), "hang": ("heartbeats",),
}

TARGET_F1 = 0.9
TARGET_FA_PER_10K = 1.0
SPLITS = ("dev", "heldout", "real", "all")


@dataclass(frozen=True)
class Det:
    """One detection: kind, onset step, the ranks / hosts it names, and its (highest) severity (a peer rule's
    alerts count as warnings)."""

    kind: str
    step: int
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    severity: str = "warning"


@dataclass
class Score:
    """Counts of one (kind, system) on some runs; :meth:`add` sums them."""

    labels: int = 0
    tp: int = 0
    fa: int = 0
    dup: int = 0
    ignored: int = 0
    healthy: int = 0
    delays: list[int] = field(default_factory=list)
    missed: list[Label] = field(default_factory=list)
    fa_steps: list[int] = field(default_factory=list)

    @property
    def fn(self) -> int:
        return self.labels - self.tp

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fa) if self.tp + self.fa else None

    @property
    def recall(self) -> float | None:
        return self.tp / self.labels if self.labels else None

    @property
    def f1(self) -> float | None:
        if not self.labels:
            return None
        p, r = self.precision or 0.0, self.recall or 0.0
        return 2 * p * r / (p + r) if p + r else 0.0

    @property
    def fa_per_10k(self) -> float | None:
        if self.healthy:
            return 1e4 * self.fa / self.healthy
        return None if not self.fa else math.inf

    @property
    def delay_median(self) -> float | None:
        d = sorted(self.delays)
        if not d:
            return None
        n = len(d)
        return float(d[n // 2]) if n % 2 else (d[n // 2 - 1] + d[n // 2]) / 2

    @property
    def delay_p90(self) -> int | None:
        d = sorted(self.delays)
        return d[math.ceil(0.9 * len(d)) - 1] if d else None

    def add(self, o: Score) -> None:
        self.labels += o.labels
        self.tp += o.tp
        self.fa += o.fa
        self.dup += o.dup
        self.ignored += o.ignored
        self.healthy += o.healthy
        self.delays += o.delays
        self.missed += o.missed
        self.fa_steps += o.fa_steps

    def row(self) -> dict[str, Any]:
        r = {k: getattr(self, k) for k in ("labels", "tp", "fn", "fa", "dup", "ignored", "healthy")}
        for k in ("precision", "recall", "f1", "fa_per_10k", "delay_median", "delay_p90"):
            v = getattr(self, k)
            r[k] = None if v is None else (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v)
        r["healthy_steps"] = r.pop("healthy")
        return r


def ranks_ok(d: Det, lab: Label) -> bool:
    """A rank-scoped label needs the detection's ranks (else hosts) among its own; a job-wide one takes any."""
    if not lab.ranks and not lab.hosts:
        return True
    if d.ranks:
        return set(d.ranks) <= set(lab.ranks)
    if d.hosts:
        return bool(lab.hosts) and set(d.hosts) <= set(lab.hosts)
    return True


def _inside(d: Det, lab: Label) -> bool:
    return lab.lo <= d.step <= lab.hi and ranks_ok(d, lab)


def _excused(d: Det, lab: Label) -> bool:
    """Inside an ambiguous stretch, and no louder than it allows (``max_severity``)."""
    return _inside(d, lab) and (lab.max_severity is None
                                or SEVERITIES.index(d.severity) <= SEVERITIES.index(lab.max_severity))


def healthy_steps(steps: list[int], labels: list[Label], kind: str) -> int:
    """Steps (sorted, repeats kept) outside every label of ``kind`` or of a kind it accepts, tolerance included."""
    kinds = {kind} | ACCEPT.get(kind, frozenset())
    spans = sorted((lab.lo, lab.hi) for lab in labels if lab.kind in kinds)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    inside = sum(bisect.bisect_right(steps, hi) - bisect.bisect_left(steps, lo) for lo, hi in merged)
    return len(steps) - inside


def score(dets: list[Det], labels: list[Label], steps: list[int], kind: str, covered: bool = True) -> Score:
    """Score one run's detections of ``kind`` against its labels.

    Parameters
    ----------
    dets : list[Det]
        Detections (any kinds; those of ``kind`` are scored).
    labels : list[Label]
        The run's labels.
    steps : list[int]
        Sorted step numbers of the run's complete steps (restarted steps repeat).
    kind : str
        Kind scored.
    covered : bool
        Whether the run carries the kind's input; if not, its steps are not counted as healthy steps (false
        alarms still are).

    Returns
    -------
    Score
    """
    accept = ACCEPT.get(kind, frozenset())
    targets = [lab for lab in labels if lab.kind == kind and not lab.ignore]
    soft = [lab for lab in labels if (lab.kind == kind and lab.ignore) or lab.kind in accept]
    matched = [False] * len(targets)
    sc = Score(labels=len(targets), healthy=healthy_steps(steps, labels, kind) if covered else 0)
    for d in sorted((d for d in dets if d.kind == kind), key=lambda d: d.step):
        cands = [j for j, lab in enumerate(targets) if _inside(d, lab)]
        free = [j for j in cands if not matched[j]]
        if free:
            j = min(free, key=lambda j: (targets[j].start, j))
            matched[j] = True
            sc.tp += 1
            sc.delays.append(d.step - targets[j].start)
        elif cands:
            sc.dup += 1
        elif any(_excused(d, lab) for lab in soft):
            sc.ignored += 1
        else:
            sc.fa += 1
            sc.fa_steps.append(d.step)
    sc.missed = [lab for j, lab in enumerate(targets) if not matched[j]]
    return sc


# ---------------------------------------------------------------------------------------------------------------
# Running the corpus
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """What one run of the corpus produced."""

    name: str
    split: str
    family: str
    labels: list[Label]
    steps: list[int]
    dets: dict[str, list[Det]]
    inputs: set[str]
    seconds: float
    note: str = ""

    def covered(self, kind: str) -> bool:
        need = COVERS.get(kind, ())
        return not need or any(x in self.inputs for x in need)


class _Feeder:
    """Collects a run's steps, our anomalies and the peers' merged alerts."""

    def __init__(self, peers: bool) -> None:
        self.peers = make_peers() if peers else []
        self.steps: list[int] = []
        self.anomalies: dict[str, Any] = {}
        #: Ranks and hosts an anomaly named when it opened (its rank set may grow later), by id.
        self.first: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
        #: The loudest severity each anomaly reached (a spike escalating to critical is scored as critical).
        self.loudest: dict[str, str] = {}
        self.peer_dets: dict[str, list[Det]] = {p.name: [] for p in self.peers}
        self._last: dict[tuple[str, str], int] = {}
        self.inputs: set[str] = set()
        self.timed = 0
        self._i = 0

    def agg(self, agg: Any, step_s: float | None) -> None:
        self.steps.append(agg.step)
        if agg.loss is not None:
            self.inputs.add("loss")
        if agg.grad_norm is not None:
            self.inputs.add("grad_norm")
        if sum(b is not None for b in agg.busy) >= 2:
            self.inputs.add("ranks")
        self.timed += step_s is not None
        i, self._i = self._i, self._i + 1
        for p in self.peers:
            for kind in p.feed(i, agg.step, agg.loss, agg.grad_norm, step_s):
                key = (p.name, kind)
                if self._last.get(key) != i - 1:  # consecutive alerts are one detection
                    self.peer_dets[p.name].append(Det(kind, agg.step))
                self._last[key] = i

    def out(self, out: Any, step_s_of: Any = None) -> None:
        for agg in out.aggs:
            self.agg(agg, step_s_of(agg) if step_s_of else agg.dur)
        self.keep(out.anomalies)

    def keep(self, anomalies: Any) -> None:
        for a in anomalies:
            self.first.setdefault(a.id, (tuple(a.ranks), tuple(a.hosts)))
            self.anomalies[a.id] = a
            if SEVERITIES.index(a.severity) > SEVERITIES.index(self.loudest.get(a.id, "info")):
                self.loudest[a.id] = a.severity
            else:
                self.loudest.setdefault(a.id, a.severity)

    def result(self, src: Source, seconds: float) -> RunResult:
        if self.steps and self.timed >= 0.5 * len(self.steps):
            self.inputs.add("timed")
        ours = [Det(a.kind, a.step, *self.first.get(i, (tuple(a.ranks), tuple(a.hosts))),
                    severity=self.loudest.get(i, a.severity)) for i, a in self.anomalies.items()]
        return RunResult(src.name, src.split, src.family, list(src.labels), sorted(self.steps),
                         {"ours": ours, **self.peer_dets}, self.inputs, seconds, src.note)


def run_source(src: Source, peers: bool = True, setup: Any = None) -> RunResult:
    """Feed one run through the pipeline (and the peer rules); return what was detected.

    A real log goes through :class:`trainhealth.detectors.offline.OfflineRun` point by point (what ``feed_all`` does,
    with each point's output kept for the peers); a synthetic run through a :class:`RunPipeline` of its world size,
    with ``flush_stale`` and ``check_heartbeats`` at every heartbeat check, as the service's tick does. ``setup``,
    when given, is called with the pipeline before the first input (to set detector parameters).
    """
    from trainhealth.collectors.importers import read_items
    from trainhealth.detectors.offline import OfflineRun
    from trainhealth.detectors.pipeline import RunPipeline
    from trainhealth.timeline import timeline

    t0 = time.perf_counter()
    fd = _Feeder(peers)
    if src.path is not None:
        run = OfflineRun(run=src.name)
        if setup is not None:  # e.g. bench/lofo.py setting a detector's parameter
            setup(run.pipeline)
        for tp in timeline(read_items(src.path), run.step_seconds):
            out = run.feed(tp)
            if tp.is_event:
                fd.out(out, lambda agg: None)
                continue
            if tp.point.skipped is not None:
                fd.inputs.add("skip")
            own = getattr(tp, "step_s", tp.point.step_seconds if tp.timed else None)
            fd.out(out, lambda agg, own=own: own)
        fd.out(run.finish(), lambda agg: None)
        fd.keep(run.anomalies.values())
    else:
        pipe = RunPipeline(world_size=src.world_size, run=src.name)
        if setup is not None:
            setup(pipe)
        for item in src.items():
            tag = item[0]
            if tag == "step":
                if item[1].skipped is not None:
                    fd.inputs.add("skip")
                fd.out(pipe.feed_step(item[1]))
            elif tag == "event":
                fd.out(pipe.feed_event(item[1]))
            else:
                now, hbs = item[1], item[2]
                fd.inputs.add("heartbeats")
                fd.out(pipe.flush_stale(now))
                fd.keep(pipe.check_heartbeats(now, hbs).anomalies)
        fd.out(pipe.flush())
    return fd.result(src, time.perf_counter() - t0)


_SOURCES: list[Source] = []
_PEERS = True


def _work(i: int) -> RunResult:
    return run_source(_SOURCES[i], _PEERS)


def run_all(sources: list[Source], peers: bool = True, jobs: int = 1) -> list[RunResult]:
    """Run every source, in ``jobs`` processes (forked: the sources' generators are not picklable)."""
    global _SOURCES, _PEERS
    _SOURCES, _PEERS = sources, peers
    order = sorted(range(len(sources)), key=lambda i: sources[i].world_size, reverse=True)  # long runs first
    if jobs <= 1:
        res = {i: _work(i) for i in order}
    else:
        with mp.get_context("fork").Pool(jobs) as pool:
            res = dict(zip(order, pool.map(_work, order, chunksize=1), strict=True))
    return [res[i] for i in range(len(sources))]


# ---------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------
def kinds_of(results: list[RunResult]) -> list[str]:
    """Every kind in ``trainhealth.anomaly.KINDS``, then any other kind a detector produced."""
    seen = {d.kind for r in results for dets in r.dets.values() for d in dets}
    return list(KINDS) + sorted(seen - set(KINDS))


def systems_for(kind: str) -> list[str]:
    return ["ours"] + [p for p, ks in PEER_KINDS.items() if kind in ks]


def evaluate(results: list[RunResult]) -> dict[tuple[str, str, str], Score]:
    """Scores by (split, kind, system); split ``all`` sums the others."""
    table: dict[tuple[str, str, str], Score] = defaultdict(Score)
    for r in results:
        for kind in kinds_of(results):
            for system in systems_for(kind):
                if system not in r.dets:
                    continue
                sc = score(r.dets[system], r.labels, r.steps, kind, r.covered(kind))
                table[(r.split, kind, system)].add(sc)
                table[("all", kind, system)].add(sc)
    return table


def per_source(results: list[RunResult], system: str = "ours") -> list[dict[str, Any]]:
    """One entry per (run, kind) with labels, detections or false alarms: the breakdown behind the table."""
    out = []
    for r in results:
        for kind in kinds_of(results):
            sc = score(r.dets.get(system, []), r.labels, r.steps, kind, r.covered(kind))
            if not (sc.labels or sc.fa or sc.dup or sc.tp):
                continue
            out.append({"run": r.name, "split": r.split, "family": r.family, "kind": kind, **sc.row(),
                         "missed": [{"steps": [m.start, m.end], "why": m.why,
                                     "points_before": bisect.bisect_left(r.steps, m.start)} for m in sc.missed],
                         "fa_at": sc.fa_steps[:20]})
    return out


def check_targets(table: dict[tuple[str, str, str], Score], kinds: list[str]) -> list[dict[str, Any]]:
    """PASS/FAIL (None = not applicable) of the three targets, per split and kind, for our detectors."""
    out = []
    for split in SPLITS:
        for kind in kinds:
            ours = table.get((split, kind, "ours"), Score())
            f1, fa = ours.f1, ours.fa_per_10k
            beats = {}
            for peer in systems_for(kind)[1:]:
                p = table.get((split, kind, peer), Score())
                pfa, ofa = p.fa_per_10k or 0.0, fa or 0.0
                if f1 is None or p.f1 is None:
                    beats[peer] = None
                elif f1 != p.f1:
                    beats[peer] = f1 > p.f1
                else:  # equal F1: fewer false alarms decide; both equal is a tie
                    beats[peer] = True if ofa < pfa else ("tie" if ofa == pfa else False)
            out.append({"split": split, "kind": kind, "f1": f1, "fa_per_10k": fa,
                        "f1_ok": None if f1 is None else f1 >= TARGET_F1,
                        "fa_ok": None if fa is None else fa <= TARGET_FA_PER_10K,
                        "beats_peers": beats})
    return out


def _f(v: Any, nd: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.{nd}f}"
    return str(v)


def _pf(v: bool | str | None) -> str:
    return "n/a" if v is None else "TIE" if v == "tie" else ("PASS" if v else "FAIL")


def print_table(table: dict[tuple[str, str, str], Score], kinds: list[str], split: str) -> None:
    hdr = (f"{'kind':<20} {'system':<13} {'labels':>6} {'TP':>5} {'FN':>5} {'FA':>5} {'dup':>5} {'ign':>5} "
           f"{'P':>5} {'R':>5} {'F1':>5} {'d_med':>6} {'d_p90':>6} {'healthy':>9} {'FA/10k':>7}")
    print(f"\n== {split} ==")
    print(hdr)
    print("-" * len(hdr))
    for kind in kinds:
        for system in systems_for(kind):
            sc = table.get((split, kind, system))
            if sc is None:
                continue
            print(f"{kind if system == 'ours' else '':<20} {system:<13} {sc.labels:>6} {sc.tp:>5} {sc.fn:>5} "
                  f"{sc.fa:>5} {sc.dup:>5} {sc.ignored:>5} {_f(sc.precision):>5} {_f(sc.recall):>5} "
                  f"{_f(sc.f1):>5} {_f(sc.delay_median, 1):>6} {_f(sc.delay_p90):>6} {sc.healthy:>9} "
                  f"{_f(sc.fa_per_10k):>7}")


def print_targets(targets: list[dict[str, Any]], kinds: list[str]) -> None:
    print(f"\n== targets: F1 >= {TARGET_F1}, <= {TARGET_FA_PER_10K:g} false alarm / 10k healthy steps, "
          "F1 above every peer ==")
    print(f"{'kind':<20} " + " ".join(f"{s:^26}" for s in SPLITS))
    print(f"{'':<20} " + " ".join(f"{'F1':>8} {'FA':>8} {'peers':>8}" for _ in SPLITS))
    by = {(t["split"], t["kind"]): t for t in targets}
    for kind in kinds:
        cells = []
        for split in SPLITS:
            t = by[(split, kind)]
            vals = [v for v in t["beats_peers"].values() if v is not None]
            peers = None if not vals else False if False in vals else "tie" if "tie" in vals else True
            cells.append(f"{_pf(t['f1_ok']):>8} {_pf(t['fa_ok']):>8} {_pf(peers):>8}")
        print(f"{kind:<20} " + " ".join(cells))


def misses(table: dict[tuple[str, str, str], Score], results: list[RunResult], targets: list[dict[str, Any]],
           kinds: list[str]) -> list[str]:
    """One paragraph per kind of ours failing a target: where it misses and where it false-alarms."""
    lines = []
    failing = {t["kind"] for t in targets if t["split"] in ("heldout", "real", "all")
               and (t["f1_ok"] is False or t["fa_ok"] is False or False in t["beats_peers"].values())}
    for kind in kinds:
        if kind not in failing:
            continue
        fn: Counter[str] = Counter()
        fa: Counter[str] = Counter()
        notes: dict[str, str] = {}
        for r in results:
            sc = score(r.dets.get("ours", []), r.labels, r.steps, kind, r.covered(kind))
            key = r.family if r.split != "real" else r.name
            fn[key] += sc.fn
            fa[key] += sc.fa
            for m in sc.missed:
                if r.split == "real":
                    notes.setdefault(key, f"{m.start}-{m.end}: {bisect.bisect_left(r.steps, m.start)} logged "
                                          f"points before it; {m.why[:90]}")
                else:
                    notes.setdefault(key, m.why[:90])
        beaten = [f"{t['split']}: {p}" for t in targets if t["kind"] == kind
                  for p, ok in t["beats_peers"].items() if ok is False]
        parts = [f"- {kind}:"]
        if sum(fn.values()):
            parts.append("  misses " + "; ".join(f"{k} x{v} (e.g. {notes.get(k, '')})" for k, v in fn.most_common()
                                                  if v))
        if sum(fa.values()):
            parts.append("  false alarms " + ", ".join(f"{k} x{v}" for k, v in fa.most_common() if v))
        if beaten:
            parts.append("  peer with better F1: " + ", ".join(beaten))
        ours_all = table.get(("all", kind, "ours"), Score())
        if not ours_all.tp and not ours_all.fa and not ours_all.dup:
            parts.append("  (no detection of this kind at all: not implemented yet, or silent on this corpus)")
        lines.append("\n".join(parts))
    return lines


def print_per_scenario(rows: list[dict[str, Any]]) -> None:
    print("\n== per run (ours) ==")
    for row in rows:
        print(f"{row['run']:<48} {row['kind']:<20} TP {row['tp']}/{row['labels']} FA {row['fa']} dup {row['dup']} "
              f"ign {row['ignored']} delay {_f(row['delay_median'], 1)}")
        for m in row["missed"]:
            print(f"    missed {m['steps'][0]}-{m['steps'][1]} ({m['points_before']} points before): {m['why']}")
        if row["fa_at"]:
            print(f"    false alarms at {row['fa_at']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="one dev and one held-out seed, runs a quarter as long (a smoke test)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    ap.add_argument("--per-scenario", action="store_true", help="also give the per-run breakdown (ours)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--only", help="regular expression selecting synthetic scenarios")
    ap.add_argument("--no-real", action="store_true", help="leave the real logs out")
    ap.add_argument("--no-peers", action="store_true", help="leave the peer rules out")
    ap.add_argument("--save", metavar="PATH", help="also write the JSON document (with the per-run breakdown) here")
    ap.add_argument("--lofo", action="store_true",
                    help="then the leave-one-file-out evaluation of the real logs (bench/lofo.py; ~2 CPU-minutes)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    sources = synthetic_sources(args.quick, args.only)
    if not args.no_real:
        sources += real_sources()
    results = run_all(sources, peers=not args.no_peers, jobs=args.jobs)
    kinds = kinds_of(results)
    table = evaluate(results)
    targets = check_targets(table, kinds)
    elapsed = time.perf_counter() - t0
    meta = {"runs": len(results), "runs_by_split": dict(Counter(r.split for r in results)),
            "steps": sum(len(r.steps) for r in results),
            "steps_by_split": {s: sum(len(r.steps) for r in results if r.split == s) for s in SPLITS[:3]},
            "labels": sum(1 for r in results for lab in r.labels if not lab.ignore),
            "seconds": round(elapsed, 1), "quick": args.quick, "real_logs": str(real_logs_dir()),
            "cpu_seconds_by_family": {f: round(sum(r.seconds for r in results if r.family == f), 1)
                                      for f in sorted({r.family for r in results})},
            "excluded_logs": [{"file": f, "why": w} for f, w in excluded_logs()]}
    doc = {"meta": meta,
           "rows": [{"split": s, "kind": k, "system": m, **sc.row()} for (s, k, m), sc in sorted(table.items())],
           "targets": targets, "misses": misses(table, results, targets, kinds)}
    if args.per_scenario or args.save:
        doc["per_run"] = per_source(results)
    if args.save:
        Path(args.save).write_text(json.dumps(doc, indent=1, default=str))
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
        return 0
    print(f"detection evaluation: {meta['runs']} runs ({meta['runs_by_split']}), {meta['steps']:,} steps "
          f"({meta['steps_by_split']}), {meta['labels']} labels, {elapsed:.0f} s")
    print("peers: trainpulse = trainpulse 0.4.0 Monitor, default MonitorConfig; lightning = Lightning SpikeDetection "
          "defaults; llm-foundry = KillLossSpike defaults (transcribed); wandb-zscore = W&B z-score automation, "
          "window 30, threshold 3")
    # The real logs first: they are the headline; the synthetic splits follow.
    for split in ("real", *(s for s in SPLITS if s != "real")):
        print_table(table, kinds, split)
    print_targets(targets, kinds)
    lines = misses(table, results, targets, kinds)
    if lines:
        print("\n== where our detectors miss the targets (held-out, real, all) ==")
        print("\n".join(lines))
    if meta["excluded_logs"]:
        print("\nreal logs left out: " + "; ".join(f"{e['file']} ({e['why']})" for e in meta["excluded_logs"]))
    if args.per_scenario:
        print_per_scenario(per_source(results))
    if args.lofo:
        import lofo

        print()
        lofo.main([])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
