"""Slow steps: isolated one-off step-time outliers (a hiccup, not a slowdown)."""

from __future__ import annotations

import math
from collections import deque

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.robust import SortedWindow
from trainhealth.detectors.throughput import step_seconds


class SlowStepDetector(StepDetector):
    """Steps many times the recent normal while their neighbours are normal (severity ``info``).

    On ``y = log(step time)`` (see :func:`~trainhealth.detectors.throughput.step_seconds`) against the
    median ``m`` and robust SD ``s = max(1.4826 x MAD, min_scale)`` of the last ``window``
    normal timed steps (a Hampel identifier): a step **opens** a slow run when it takes at
    least ``ratio`` x the median and ``z = (y - m) / s >= z_open``; following steps at least
    ``close_ratio`` x and ``z_close`` SDs above continue the run (hysteresis). The run is
    reported when the next normal step arrives — one anomaly per run, created ``resolved`` (a
    point event, like a restart) with ``step`` = its first and ``end_step`` = its last step.
    A run longer than ``max_run`` steps is a level shift, left to
    :class:`~trainhealth.detectors.throughput.ThroughputDropDetector`. Not reported either:

    - the first ``warmup`` timed steps of each generation (compilation, warm-up);
    - a step a declared pause fell in (``agg.pause``: a checkpoint save or load, an evaluation or other
      badput event since the step before it; the goodput ledger books its extra time as that pause);
    - slow steps that are the run's rhythm: a slow step at ``s`` when slow steps were also seen
      at ``s - d`` and ``s - 2d`` (e.g. an optimizer refresh every 10 steps, as in
      modded-nanogpt's SOAP run). The rhythm is learnt during warm-up too, so a period of up to
      about ``warmup / 3`` steps is known before the first step is judged; a longer one is
      recognised from its third occurrence (its first two after warm-up are reported).

    Slow steps never enter the reference. Parameters are stored under the same names:
    ``window``, ``warmup``, ``min_reference`` (reference steps needed to judge), ``ratio``,
    ``z_open``, ``close_ratio``, ``z_close``, ``max_run`` and ``min_scale`` (floor of ``s``).

    Evidence: ``step_s`` (the slowest step's seconds), ``peak_step``, ``median_s``, ``ratio``,
    ``z``, ``steps`` (timed steps in the run), ``lost_s`` (seconds above the median, summed; at most the run's
    wall time minus its steps' median time: the steps of a stall overlap, a frozen rank's and the others' next one
    both spanning the freeze).

    Examples
    --------
    >>> import random
    >>> rng = random.Random(3)
    >>> det = SlowStepDetector()
    >>> for step in range(300):
    ...     t = 0.25 * math.exp(rng.gauss(0, 0.02)) * (5.0 if step % 10 == 1 else 1.0) * (8.0 if step == 123 else 1.0)
    ...     a = StepAggregate(step, 0, 0.0, step - t, float(step), 1.0, 1.0, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.severity, an.status, an.step, an.end_step, round(an.evidence["ratio"], 1))
    slow_step info resolved 123 123 7.9

    References
    ----------
    F. R. Hampel, "The influence curve and its role in robust estimation", JASA 69 (1974);
    R. K. Pearson, "Outliers in process modeling and identification", IEEE TCST 10 (2002)
    (the Hampel identifier); P. J. Rousseeuw and C. Croux, JASA 88 (1993) (1.4826).
    """

    KIND = "slow_step"

    def __init__(
        self,
        window: int = defaults.SLOW_STEP_WINDOW_STEPS,
        warmup: int = defaults.SLOW_STEP_WARMUP_STEPS,
        min_reference: int = defaults.SLOW_STEP_MIN_REFERENCE_STEPS,
        ratio: float = defaults.SLOW_STEP_RATIO,
        z_open: float = defaults.SLOW_STEP_Z,
        close_ratio: float = defaults.SLOW_STEP_CLOSE_RATIO,
        z_close: float = defaults.SLOW_STEP_Z_CLOSE,
        max_run: int = defaults.SLOW_STEP_MAX_RUN_STEPS,
        min_scale: float = defaults.TIMING_MIN_SCALE,
    ) -> None:
        self.window = window
        self.warmup = warmup
        self.min_reference = min_reference
        self.ratio = ratio
        self.z_open = z_open
        self.close_ratio = close_ratio
        self.z_close = z_close
        self.max_run = max_run
        self.min_scale = min_scale
        self._gen: int | None = None
        self._seen = 0
        # Log step times of normal steps, kept sorted too: median and MAD in O(log n) after each new one.
        self._ref = SortedWindow(window)
        self._slow: deque[int] = deque(maxlen=16)  # onset steps of recent slow runs (the rhythm)
        self._run: list[tuple[int, float, float]] = []  # (step, seconds, z) of the open run
        self._run_base: tuple[float, float] = (0.0, 1.0)
        # (start, end) unix s of the open run's wall time: steps of a stall overlap (a frozen rank's step and the
        # others' next one, blocked in its collective, both span the freeze), so its time lost is counted once.
        self._span = (0.0, 0.0)
        self._run_quiet = False  # the open run is warm-up or rhythm: not reported
        self._shifted = False  # inside a level shift (a run longer than max_run)

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return a ``slow_step`` anomaly when a slow run has ended."""
        if agg.gen != self._gen:
            self._gen, self._seen = agg.gen, 0
            self._ref.clear()
            self._run.clear()
            self._shifted = False
        t = step_seconds(agg)
        if t is None or agg.pause is not None:
            return []  # untimed, or a declared pause (checkpoint, evaluation) fell in it: not judged, not learnt
        self._seen += 1
        y = math.log(t)
        if len(self._ref) < self.min_reference:
            self._add(y)
            return []
        out: list[Anomaly] = []
        if self._run or self._shifted:
            m, s = self._run_base
            if t >= self.close_ratio * math.exp(m) and (y - m) / s >= self.z_close:
                self._continue(agg.step, t, y, (y - m) / s)
                self._span = (min(self._span[0], agg.t_end - t), max(self._span[1], agg.t_end))
                return []
            if self._run and not self._run_quiet:
                out = self._report()
            self._run.clear()
            self._shifted = False
            # This step is back to normal: judge it afresh below.
        m = self._median()
        slow = t >= self.ratio * math.exp(m)
        if slow or not self.min_scale > 0:
            # The robust SD (a MAD: the costly part) matters only for a step already ratio x the median (rare);
            # without a floor it may be 0, and z must then raise at every step as it always did.
            s = self._scale()
            z = (y - m) / s
            slow = slow and z >= self.z_open
        if slow:
            # The rhythm: earlier slow steps at s - d and s - 2d for some gap d >= 2.
            rhythm = any(2 * a - agg.step in self._slow for a in self._slow if agg.step - a >= 2)
            self._slow.append(agg.step)
            self._run = [(agg.step, t, z)]
            self._span = (agg.t_end - t, agg.t_end)
            self._run_base = (m, s)
            self._run_quiet = rhythm or self._seen <= self.warmup
        else:
            self._add(y)
        return out

    def _continue(self, step: int, t: float, y: float, z: float) -> None:
        if self._shifted:
            self._add(y)  # inside a level shift: the reference follows it
            return
        self._run.append((step, t, z))
        if len(self._run) > self.max_run:
            # Too long to be a hiccup: a level shift (the throughput detector's business).
            for _, tr, _ in self._run:
                self._add(math.log(tr))
            self._run.clear()
            self._shifted = True

    def _add(self, y: float) -> None:
        self._ref.append(y)

    def _median(self) -> float:
        """Median of the reference (log s), cached until it changes."""
        return self._ref.cached_median()

    def _scale(self) -> float:
        """Robust SD of the reference, ``max(1.4826 x MAD, min_scale)``, cached until it changes."""
        return self._ref.cached_scale(self.min_scale)

    def _report(self) -> list[Anomaly]:
        med = math.exp(self._run_base[0])
        first, last = self._run[0][0], self._run[-1][0]
        peak_step, peak, z = max(self._run, key=lambda r: r[1])
        lost = sum(tr - med for _, tr, _ in self._run)
        span = self._span[1] - self._span[0]
        if span > 0:
            lost = min(lost, span - len(self._run) * med)
        ev = {"step_s": peak, "peak_step": peak_step, "median_s": med, "ratio": round(peak / med, 3),
              "z": round(z, 1), "steps": len(self._run), "lost_s": round(lost, 6)}
        where = f"step {first}" if first == last else f"steps {first}-{last}"
        return [Anomaly(
            kind=self.KIND, severity="info", step=first, end_step=last, status=RESOLVED, gen=self._gen or 0,
            evidence=ev,
            message=(f"{where} took {peak:.4g} s, {peak / med:.1f}x the recent median {med:.4g} s "
                     f"({lost:.4g} s lost); the steps around were normal"),
        )]
