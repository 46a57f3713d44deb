"""Straggler ranks from per-rank section times (the work a rank does before the collective)."""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import replace
from itertools import repeat

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.persistence import Persistence


class StragglerDetector(StepDetector):
    """Relative performance score per rank over fixed windows of steps, as NVIDIA's resiliency kit.

    In synchronous data parallelism the all-reduce makes every rank's whole step equally long,
    so the step time cannot name a slow rank; the time each rank spends in its own sections
    before the collective can. Every ``window`` complete steps, each rank's median busy
    seconds ``m_r`` is compared with the best rank's: ``score_r = min_k m_k / m_r`` (1.0 =
    as fast as the fastest rank, 0.5 = twice as slow). A rank is a straggler once its score
    is below ``threshold`` for ``min_windows`` windows in a row (and it is at least
    ``min_excess_s`` slower, to ignore timer jitter on tiny steps); the anomaly resolves at
    the first window where it is back above the threshold.

    Parameters
    ----------
    window : int
        Steps per scoring window.
    threshold : float
        Relative score below which a rank is slow: 0.8 (~1.25x slower than the fastest rank), stricter
        than NVRx / NeMo's default 0.7 (~1.43x) because a 30 % slower rank costs a synchronous job 30 %
        of its throughput (see ``trainhealth.defaults.STRAGGLER_THRESHOLD``).
    min_windows : int
        Consecutive slow windows before flagging (persistence, not one bad window).
    min_excess_s : float
        Minimum seconds a rank's median exceeds the best's.
    exclude : callable, optional
        Returns ranks not to judge in this window (the pipeline passes
        :meth:`trainhealth.detectors.slow_node.SlowNodeDetector.covered_ranks`: a slow node is reported once as
        ``slow_node``, not as a straggler per rank). Their counters restart; an open straggler
        anomaly of such a rank is resolved. They still count as the reference (best, typical).

    Evidence: ``score``, ``rank_median_s``, ``best_median_s``, ``typical_median_s`` (median
    over ranks), ``windows`` (consecutive slow windows).

    Examples
    --------
    >>> import random
    >>> rng = random.Random(1)
    >>> det = StragglerDetector()
    >>> for step in range(200):
    ...     busy = tuple(0.10 * (1.6 if r == 5 and 60 <= step < 140 else 1.0) + rng.uniform(0, 0.005)
    ...                  for r in range(8))
    ...     a = StepAggregate(step, 0, 0.0, None, float(step), 1.0, 1.0, None, None, None, 8, busy, 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.status, an.ranks, an.step, an.end_step, round(an.evidence["score"], 2))
    straggler active (5,) 60 None 0.63
    straggler resolved (5,) 60 139 0.99

    References
    ----------
    NVIDIA Resiliency Extension, straggler detection usage guide (relative performance
    score: best rank as reference); NeMo ``StragglerDetectionCallback``
    (``gpu_relative_perf_threshold``, default 0.7; ours 0.8, see ``threshold``).
    """

    def __init__(
        self,
        window: int = defaults.STRAGGLER_WINDOW_STEPS,
        threshold: float = defaults.STRAGGLER_THRESHOLD,
        min_windows: int = defaults.STRAGGLER_MIN_WINDOWS,
        min_excess_s: float = defaults.STRAGGLER_MIN_EXCESS_S,
        exclude: Callable[[], Collection[int]] | None = None,
    ) -> None:
        self.window = window
        self.threshold = threshold
        self.min_windows = min_windows
        self.min_excess_s = min_excess_s
        self.exclude = exclude
        self._busy: list[deque[float]] = []
        self._at: list[deque[int]] = []  # the step of each value in _busy
        self._prev: list[list[tuple[int, float]]] = []  # each rank's (step, busy) of the window before
        self._steps: deque[int] = deque(maxlen=window)
        self._n = 0
        self._persist: Persistence[int] = Persistence(min_windows)
        self._last_step_prev_window = 0

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one complete step; return anomaly states that changed (at window ends only)."""
        if len(self._busy) < len(agg.busy):
            more = len(agg.busy) - len(self._busy)
            self._busy += [deque(maxlen=self.window) for _ in range(more)]
            self._at += [deque(maxlen=self.window) for _ in range(more)]
            self._prev += [[] for _ in range(more)]
        if None in agg.busy:
            for r, b in enumerate(agg.busy):
                if b is not None:
                    self._busy[r].append(b)
                    self._at[r].append(agg.step)
        else:  # every rank's (4,096 appends a step): the loop in C
            deque(map(deque.append, self._busy, agg.busy), maxlen=0)
            deque(map(deque.append, self._at, repeat(agg.step, len(agg.busy))), maxlen=0)
        self._steps.append(agg.step)
        self._n += 1
        if self._n % self.window:
            return []
        window_start = self._steps[0]
        medians = {r: statistics.median(d) for r, d in enumerate(self._busy) if len(d) >= self.window // 2}
        out: list[Anomaly] = []
        if len(medians) >= 2:
            best = min(medians.values())
            typical = statistics.median(medians.values())
            skip = frozenset(self.exclude()) if self.exclude is not None else frozenset()
            for r, m in medians.items():
                if r in skip:
                    out += self._covered(r)
                    continue
                score = best / m if m > 0 else 1.0
                slow = score < self.threshold and m - best >= self.min_excess_s
                ev = {"score": score, "rank_median_s": m, "best_median_s": best, "typical_median_s": typical}
                onset = self._onset(r, (best + m) / 2, window_start) if slow else window_start
                out += self._judge(r, slow, ev, onset, agg)
        for r, (d, at) in enumerate(zip(self._busy, self._at, strict=True)):
            self._prev[r] = list(zip(at, d, strict=True))
            d.clear()
            at.clear()
        self._last_step_prev_window = agg.step
        return out

    def finish(self, step: int) -> list[Anomaly]:
        """Every rank ended at ``step``: resolve the open stragglers (:func:`trainhealth.anomaly.run_ended`)
        and start afresh."""
        out = self._persist.finish(step)
        # Each value and its step go together (a relaunch's first window zips them), and its windows start afresh.
        for d, at in zip(self._busy, self._at, strict=True):
            d.clear()
            at.clear()
        self._steps.clear()
        self._n = 0
        return out

    @property
    def open_ranks(self) -> frozenset[int]:
        """Ranks with an open straggler anomaly."""
        return frozenset(self._persist.open)

    def _onset(self, r: int, cut: float, window_start: int) -> int:
        """The step rank ``r`` turned slow, within a window judged slow: the first of two steps in a row above
        ``cut`` (halfway between the fastest rank's median and its own), extended back over a run of two or more such
        steps that ends the window before (one slowed too late in it for its median to tell); ``window_start`` when
        no two steps in a row are above it. The window's median alone dates a slowdown up to a window early or
        late."""
        here = list(zip(self._at[r], self._busy[r], strict=True))
        first = next((s for (s, b), (_, b2) in itertools.pairwise(here) if b > cut and b2 > cut), None)
        if first is None:
            return window_start
        if first == here[0][0]:
            run = list(itertools.takewhile(lambda sb: sb[1] > cut, reversed(self._prev[r])))
            if len(run) >= 2:  # two in a row, as within the window: one noisy step does not move the onset
                first = run[-1][0]
        return first

    def _covered(self, r: int) -> list[Anomaly]:
        # The rank's whole node is reported as slow: not judged on its own meanwhile.
        cur = self._persist.clear(r)
        if cur is None:
            return []
        end = self._last_step_prev_window
        return [replace(cur, status=RESOLVED, end_step=end,
                        message=(f"rank {r} was a straggler from step {cur.step} to {end}; its whole node is now "
                                 "slow (see the slow_node anomaly)"))]

    def _judge(self, r: int, slow: bool, ev: dict, window_start: int, agg: StepAggregate) -> list[Anomaly]:
        if slow:
            return self._persist.flag(r, window_start, ev, lambda onset: Anomaly(
                kind="straggler", severity="warning", step=onset, ranks=(r,), gen=agg.gen, evidence=ev,
                message=(f"rank {r} is a straggler: its sections take {ev['rank_median_s'] * 1e3:.1f} ms "
                         f"(median) vs {ev['best_median_s'] * 1e3:.1f} ms on the fastest rank "
                         f"(score {ev['score']:.2f} < {self.threshold}) since step {onset}; "
                         "every rank waits for it at the all-reduce")))
        cur = self._persist.clear(r)
        if cur is None:
            return []
        return [replace(cur, status=RESOLVED, end_step=self._last_step_prev_window,
                        evidence={**cur.evidence, "score": ev["score"]},
                        message=(f"rank {r} was a straggler from step {cur.step} to "
                                 f"{self._last_step_prev_window}; back to score {ev['score']:.2f}"))]
