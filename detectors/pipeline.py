"""One run's detection pipeline, without I/O: records in, aggregates, anomalies and ledger out.

The service (:mod:`detectors.service`) feeds it from Redis; ``trainhealth replay`` and the
tests feed it directly. Everything here is deterministic given the same input order, which
is what lets the service rebuild its state by replaying the streams after a restart.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from detectors.advisor import Checkpoint, Recommendation, RollbackAdvisor
from detectors.aggregate import StepAggregate, StepAggregator
from detectors.anomaly import Anomaly
from detectors.grad_norm_spike import GradNormSpikeDetector
from detectors.hang import HangDetector
from detectors.ledger import GoodputLedger
from detectors.loss_spike import LossSpikeDetector
from detectors.nan_inf import NanInfDetector
from detectors.restart import RestartDetector
from detectors.straggler import StragglerDetector
from trainhealth.events import Event, StepRecord


@dataclass
class Output:
    """What one input produced: completed step aggregates and changed anomaly states."""

    aggs: list[StepAggregate] = field(default_factory=list)
    anomalies: list[Anomaly] = field(default_factory=list)
    #: Recommendations (re)computed, by anomaly id.
    recommendations: dict[str, Recommendation] = field(default_factory=dict)

    def extend(self, other: Output) -> None:
        self.aggs += other.aggs
        self.anomalies += other.anomalies
        self.recommendations.update(other.recommendations)


class RunPipeline:
    """Aggregator, detectors and ledger of one run.

    Parameters
    ----------
    world_size : int
        Ranks per step.
    gpu_hour_usd : float | None
        Price per GPU-hour for the ledger.
    hang : HangDetector | None
        Override the hang detector's settings (e.g. a shorter floor for the demo).
    """

    def __init__(self, world_size: int = 1, gpu_hour_usd: float | None = None,
                 hang: HangDetector | None = None, run: str = "") -> None:
        self.aggregator = StepAggregator(world_size)
        self.ledger = GoodputLedger(world_size, gpu_hour_usd)
        self.hang = hang or HangDetector()
        self.step_detectors = [NanInfDetector(), RestartDetector(), LossSpikeDetector(), GradNormSpikeDetector(),
                               StragglerDetector()]
        #: rank -> host, from run_start events.
        self.hosts: dict[int, str] = {}
        self.ended_ranks: set[int] = set()
        self.run = run
        self.advisor = RollbackAdvisor()
        #: Latest state of every anomaly, by id (the advisor's history).
        self.anomalies: dict[str, Anomaly] = {}
        self.checkpoints: dict[int, Checkpoint] = {}
        # step -> (consumed_samples, batch_index) after it; the newest 100,000 steps.
        self.positions: OrderedDict[int, tuple[int | None, int | None]] = OrderedDict()
        self.current_step = 0
        self._last_advice = -(10**9)
        self._prev_end: tuple[int, float] | None = None

    @property
    def world_size(self) -> int:
        return self.aggregator.world_size

    def set_world_size(self, n: int) -> None:
        """Update the expected ranks per step (from the run's metadata)."""
        if n >= 1:
            self.aggregator.world_size = n
            self.ledger.world_size = n

    def feed_step(self, rec: StepRecord) -> Output:
        """Feed one rank's step record."""
        if rec.rank >= self.world_size:
            self.set_world_size(rec.rank + 1)
        return self._steps(self.aggregator.add(rec))

    def feed_event(self, ev: Event) -> Output:
        """Feed one event (run start/end, checkpoints, custom badput)."""
        if ev.kind == "run_start":
            host = ev.extra.get("host")
            if host:
                self.hosts[ev.rank] = host
            self.ended_ranks.discard(ev.rank)
        elif ev.kind == "run_end":
            self.ended_ranks.add(ev.rank)
        elif ev.kind == "checkpoint_save" and ev.step is not None and ev.step not in self.checkpoints:
            pos = self.positions.get(ev.step, (None, None))
            self.checkpoints[ev.step] = Checkpoint(ev.step, *pos)
        self.ledger.add_event(ev)
        return Output()

    def flush_stale(self, now: float) -> Output:
        """Close steps still missing ranks after the aggregator's stale timeout."""
        return self._steps(self.aggregator.flush_stale(now))

    def flush(self) -> Output:
        """Close every pending step (end of a replayed file)."""
        return self._steps(self.aggregator.flush())

    def check_heartbeats(self, now: float, heartbeats: Mapping[int, Mapping[str, Any]]) -> list[Anomaly]:
        """Hang check at unix time ``now``; ranks that ended cleanly are left out."""
        live = {r: hb for r, hb in heartbeats.items() if r not in self.ended_ranks}
        return [self._with_hosts(a) for a in self.hang.check(now, live)]

    def _steps(self, aggs: list[StepAggregate]) -> Output:
        out = Output(aggs=aggs)
        for agg in aggs:
            self.ledger.add_step(agg)
            dur = agg.dur
            prev = self._prev_end
            if dur is None and prev is not None and prev[0] == agg.gen:
                dur = agg.t_end - prev[1]  # an untimed step lasted since the previous one ended
            self.hang.observe_step(dur, agg.gen)
            self._prev_end = (agg.gen, agg.t_end)
            self.current_step = agg.step
            if agg.consumed_samples is not None or agg.batch_index is not None:
                self.positions[agg.step] = (agg.consumed_samples, agg.batch_index)
                if len(self.positions) > 100_000:
                    self.positions.popitem(last=False)
            changed = []
            for det in self.step_detectors:
                changed += [self._with_hosts(a) for a in det.update(agg)]
            out.anomalies += changed
            for a in changed:
                self.anomalies[a.id] = a
            # Advice on changes, and every 10 steps for open ones (a "wait" turns into "rollback").
            due = agg.step - self._last_advice >= 10
            candidates = {a.id: a for a in changed}
            if due:
                candidates.update((i, a) for i, a in self.anomalies.items() if a.active)
            for a in candidates.values():
                if RollbackAdvisor.concerns(a):
                    rec = self._advise(a)
                    if rec is not None:
                        out.recommendations[a.id] = rec
            if due:
                self._last_advice = agg.step
        return out

    def _advise(self, a: Anomaly) -> Recommendation | None:
        step_s = statistics.median(self.hang._step_s) if self.hang._step_s else None
        return self.advisor.advise(
            a, run=self.run, checkpoints=self.checkpoints.values(), current_step=self.current_step, step_s=step_s,
            world_size=self.world_size, gpu_hour_usd=self.ledger.gpu_hour_usd, data_positions=self.positions,
            history=self.anomalies.values(),
        )

    def _with_hosts(self, a: Anomaly) -> Anomaly:
        hosts = tuple(sorted({self.hosts[r] for r in a.ranks if r in self.hosts}))
        return replace(a, hosts=hosts) if hosts != a.hosts else a


def agg_fields(agg: StepAggregate) -> dict[str, Any]:
    """Stream fields of a ``th:{run}:agg`` entry (see docs/architecture.md)."""
    import json

    d: dict[str, Any] = {
        "step": agg.step, "gen": agg.gen, "t_end": repr(agg.t_end), "n_ranks": agg.n_ranks,
        "data_s": repr(agg.data_s),
        "busy": json.dumps([None if b is None else round(b, 6) for b in agg.busy]),
    }
    if agg.t_start is not None:
        d["t_start"] = repr(agg.t_start)
        d["dur"] = repr(agg.t_end - agg.t_start)
    for name in ("loss", "grad_norm", "lr"):
        v = getattr(agg, name)
        if v is not None:
            d[name] = repr(float(v)) if math.isfinite(v) else str(v)
    for name in ("tokens", "samples", "consumed_samples", "batch_index"):
        v = getattr(agg, name)
        if v is not None:
            d[name] = v
    if agg.skipped:
        d["skipped"] = 1
    return d
