"""Grad-norm explosion: a sustained, order-of-magnitude rise of the grad norm over the run's own floor."""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from dataclasses import replace

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.robust import SortedWindow

_second = operator.itemgetter(1)  # the value of a (step, value) point


class GradNormExplosionDetector(StepDetector):
    """A grad norm that rises ``factor`` times above the run's own floor and stays there.

    Not a one-off spike (that is :class:`~trainhealth.detectors.grad_norm_spike.GradNormSpikeDetector`'s), and not a
    run that lives at a high grad norm from the start (fp16 without unscaling, some vision models at
    1e5-4e6): everything is relative to the run's own **floor**, the lowest median of the trailing
    ``window`` logged grad norms seen so far, established once ``min_points`` points are in. The floor is
    a minimum over time, so a slow drift up counts as well as a fast one.

    On ``log(grad_norm)``: a run of points begins with the first point above ``floor * factor``,
    continues while the median of its last 5 points stays above ``floor * sqrt(factor)`` (half the
    rise, in log), and is an explosion once it has lasted ``steps`` steps and ``min_sustain`` logged
    points with its median above ``floor * factor``, or sooner if it is still climbing: the median of its
    last ``min_sustain`` points ``factor`` times that of its first ``min_sustain`` (an exponential blow-up
    reaches NaN before 100 steps pass; a spike or a plateau, however high, does not keep growing). The
    onset is its first point. The anomaly
    resolves when the median of the last 5 points is back below ``floor * sqrt(factor)``, or when
    training rolls back to the onset or before. Non-finite grad norms are
    :class:`~trainhealth.detectors.nan_inf.NanInfDetector`'s and are skipped here.

    Parameters
    ----------
    factor : float
        Rise over the floor (10 = an order of magnitude).
    window : int
        Logged points in the trailing median.
    min_points : int
        Points needed before the floor exists.
    steps : int
        Steps (by step number) the rise must last.
    min_sustain : int
        Logged points the rise must last.

    Evidence: ``floor``, ``floor_step``, ``grad_norm`` (at detection), ``median`` (since the onset),
    ``ratio`` (median / floor), ``steps_elevated``, ``peak``, ``peak_step``; on resolution
    ``recovered_grad_norm`` or ``rolled_back``.

    Examples
    --------
    >>> import random
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> rng = random.Random(1)
    >>> det = GradNormExplosionDetector()
    >>> for step in range(700):  # ~0.3, then from step 400 growing 2 % a step up to 60x
    ...     gn = 0.3 * math.exp(rng.gauss(0, 0.3)) * min(1.02 ** max(step - 400, 0), 60.0)
    ...     a = StepAggregate(step, 0, 0.0, None, float(step), 2.0, gn, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.status, an.step, round(an.evidence["ratio"]))
    grad_norm_explosion active 507 23

    References
    ----------
    R. Pascanu, T. Mikolov and Y. Bengio, "On the difficulty of training recurrent neural networks",
    ICML 2013 (exploding gradients: norms growing by orders of magnitude); A. Defazio et al., "Why
    Gradients Rapidly Increase Near the End of Training" (2025) (a healthy rise of a few x).
    """

    KIND = "grad_norm_explosion"

    def __init__(
        self,
        factor: float = defaults.GRAD_NORM_EXPLOSION_FACTOR,
        window: int = defaults.LOSS_SPIKE_WINDOW_STEPS,
        min_points: int = defaults.GRAD_NORM_EXPLOSION_MIN_POINTS,
        steps: int = defaults.DIVERGENCE_STEPS,
        min_sustain: int = defaults.DIVERGENCE_MIN_POINTS,
    ) -> None:
        self.factor = factor
        self.window = window
        self.min_points = min_points
        self.steps = steps
        self.min_sustain = min_sustain
        self._win = SortedWindow(window)  # sorted too: its median after each point is O(1)
        self._floor: float | None = None
        self._floor_step = 0
        # A run of points above the floor: onset step, generation, their (step, log grad norm) with the values kept
        # sorted (a run that stays undecided costs O(n log n), not O(n^2)).
        self._cand: tuple[int, int, SortedWindow] | None = None
        self._open: Anomaly | None = None
        self._recent: deque[float] = deque(maxlen=5)
        self._last_elevated = 0
        self._prev_step: int | None = None

    def _rewind(self, step: int) -> list[Anomaly]:
        self._cand = None
        cur = self._open
        if cur is None or step > cur.step:
            return []
        self._open = None
        return [replace(cur, status=RESOLVED, end_step=self._last_elevated,
                        evidence={**cur.evidence, "rolled_back": True},
                        message=cur.message.split(";")[0] + f"; training rolled back to step {step}")]

    def _keep(self, step: int, x: float) -> None:
        """An ordinary point: into the trailing window, and the floor follows its median down."""
        self._win.append(x)
        if len(self._win) >= self.min_points:
            med = self._win.median()
            if self._floor is None or med < self._floor:
                self._floor, self._floor_step = med, step

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed (opened, resolved)."""
        out: list[Anomaly] = []
        if self._prev_step is not None and agg.step <= self._prev_step:
            out += self._rewind(agg.step)
        self._prev_step = agg.step
        gn = agg.grad_norm
        if gn is None or not math.isfinite(gn) or gn <= 0:
            return out
        x = math.log(gn)
        rise = math.log(self.factor)
        if self._open is not None:
            return out + self._follow(agg, x, rise)
        if self._cand is None:
            if self._floor is not None and x - self._floor > rise:
                pts = SortedWindow(key=_second)
                pts.append((agg.step, x))
                self._cand = (agg.step, agg.gen, pts)
            else:
                self._keep(agg.step, x)
            return out
        onset, gen, pts = self._cand
        pts.append((agg.step, x))
        if statistics.median(v for _, v in pts[-5:]) - self._floor < rise / 2:
            self._cand = None  # it came back down: a spike or a bump, not an explosion
            for st, v in pts:
                self._keep(st, v)
            return out
        med = pts.median()
        k = self.min_sustain
        lasted = agg.step - onset >= self.steps and len(pts) >= k and med - self._floor >= rise
        # Or still climbing: a further order of magnitude since the run of points began (the median of its last
        # k points over that of its first k). An exponential blow-up reaches NaN before 100 steps pass; a spike
        # or a plateau, however high, does not keep growing.
        climbing = (len(pts) >= 2 * k
                    and statistics.median(v for _, v in pts[-k:]) - statistics.median(v for _, v in pts[:k]) >= rise)
        if lasted or climbing:
            self._cand = None
            self._recent.clear()
            self._last_elevated = agg.step
            peak_step, peak = max(pts, key=lambda p: p[1])
            floor = math.exp(self._floor)
            self._open = Anomaly(
                kind=self.KIND, severity="warning", step=onset, gen=gen,
                message=(f"grad norm has stayed {math.exp(med - self._floor):.0f}x above the run's own level "
                         f"{floor:.3g} since step {onset} (median {math.exp(med):.3g}, now {gn:.3g} at step "
                         f"{agg.step}); the gradients are exploding: check the loss, lower the learning rate or "
                         f"tighten gradient clipping"),
                evidence={"floor": floor, "floor_step": self._floor_step, "grad_norm": gn, "median": math.exp(med),
                          "ratio": math.exp(med - self._floor), "steps_elevated": agg.step - onset,
                          "peak": math.exp(peak), "peak_step": peak_step},
            )
            out.append(self._open)
        return out

    def _follow(self, agg: StepAggregate, x: float, rise: float) -> list[Anomaly]:
        self._recent.append(x)
        cur = self._open
        if statistics.median(self._recent) - self._floor < rise / 2:
            self._open = None
            return [replace(cur, status=RESOLVED, end_step=self._last_elevated,
                            evidence={**cur.evidence, "recovered_grad_norm": math.exp(x)},
                            message=cur.message.split(";")[0] + f"; back to {math.exp(x):.3g} by step {agg.step}")]
        self._last_elevated = agg.step
        if x > math.log(cur.evidence["peak"]):
            self._open = replace(cur, evidence={**cur.evidence, "peak": math.exp(x), "peak_step": agg.step})
        return []
