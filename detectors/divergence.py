"""Divergence: the loss rises for good, or a loss spike never returns to its pre-spike trend."""

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
from trainhealth.detectors.loss_spike import NOT_RECOVERED, LossSpikeDetector
from trainhealth.detectors.robust import Baseline, SortedWindow, robust_scale_sorted
from trainhealth.text import plural

_second = operator.itemgetter(1)  # the value of a (step, value) point


class DivergenceDetector(StepDetector):
    """Training that stopped converging: one ``divergence`` anomaly (critical) per episode.

    Two ways in, both on ``log(loss)`` (the loss must be positive, as cross-entropy is):

    1. **A spike that does not recover.** A private :class:`~trainhealth.detectors.loss_spike.LossSpikeDetector`
       (the pipeline's settings) settles a spike as ``not_recovered``: still elevated
       ``divergence_steps`` after its onset, or the optimizer skipped a run of steps (fp16 overflow)
       while the loss was up. The divergence takes the spike's onset and its expected loss as the
       reference. PaLM (§5.1) rolled back when a spike did not recover within about 100 steps.
    2. **A sustained rise.** The loss stays above the best level the run has reached (the lowest
       median of the spike detector's trailing window so far: one lucky batch does not set it, and a
       median of 50 points is steady enough that its minimum over a long run is not biased low) by
       ``margin = max(log(1 + min_rise), z * s)`` (``s`` the robust per-point noise scale before the rise):
       a run of points begins with the first point above ``best + margin``, continues while the median
       of its last 5 points stays above ``best + margin / 2``, and is divergence once it has lasted
       ``steps`` steps and ``min_points`` logged points with its median above the best level by
       ``max(log(1 + min_rise), z * SE)``, ``SE = 1.2533 s sqrt(1/n_best + 1/n_run)`` the standard error of
       a difference of two medians (it matters when few points back either, on a sparse log; ``s`` from
       the run's own points if no scale was known before it). The onset is its first point. This catches
       a slow drift that never looks like a spike, and works on very sparse logs (5 points, one every
       500 steps) because it needs no warm-up: the first logged loss is a level to rise from.

    The anomaly resolves when the median of the last 3 points is back within ``margin / 2`` of the
    reference (``end_step`` is then the last point above that), or when training rolls back to the
    onset or before (``rolled_back``). A rollback or restart also takes the best level back to what it
    was at the resumed step (the discarded timeline's progress no longer counts). Non-finite losses are
    :class:`~trainhealth.detectors.nan_inf.NanInfDetector`'s.

    Parameters
    ----------
    min_rise : float
        Smallest sustained rise over the reference, as a fraction of it (0.2 = 20 %).
    steps : int
        Steps (by step number) the rise must last.
    min_points : int
        Logged points the rise must last.
    z : float
        The margin is at least this many robust per-point SDs of the loss.
    spikes : LossSpikeDetector | None
        The spike detector to build on (a fresh private one with the default settings if None); unless
        ``shared``, it must not be fed by anyone else.
    shared : bool
        ``spikes`` is fed by its owner, each step *before* this detector (the pipeline's own
        :class:`~trainhealth.detectors.loss_spike.LossSpikeDetector`, with the same settings: the same anomalies,
        without
        running a second copy of it). A step it was already fed (the same aggregate object, per
        :attr:`~trainhealth.detectors.loss_spike.LossSpikeDetector.last_update`) is not fed again: its output is
        reused; any
        other step is fed here.

    Evidence: ``reason`` (``spike_not_recovered``, ``overflow_skips``, ``sustained_rise``),
    ``baseline`` (reference loss), ``baseline_step`` (where the best level was reached, for a rise),
    ``loss`` (at detection), ``rise`` (its ratio to the reference), ``steps_elevated``, ``peak``,
    ``peak_step``; on resolution ``recovered_loss`` or ``rolled_back``.

    Examples
    --------
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> det = DivergenceDetector()
    >>> # the Whisper fine-tune with too high a learning rate: one train loss every 500 steps
    >>> for step, loss in [(500, 1.2366), (1000, 2.028), (1500, 2.157), (2000, 1.9848), (2500, 1.7866)]:
    ...     a = StepAggregate(step, 0, 0.0, None, float(step), loss, None, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.status, an.step, an.evidence["reason"], round(an.evidence["rise"], 2))
    divergence active 1000 sustained_rise 1.61

    References
    ----------
    A. Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", JMLR 24 (2023) §5.1;
    BigScience tr8b-104B chronicles (a loss jump 2.67 -> 4.37 that stayed, with fp16 overflow skips,
    later NaN); Meta OPT-175B logbook (runs that diverged after spikes, rolled back with a lower
    learning rate); P. J. Rousseeuw and C. Croux, JASA 88 (1993) (robust scale).
    """

    KIND = "divergence"

    def __init__(
        self,
        min_rise: float = defaults.DIVERGENCE_MIN_RISE,
        steps: int = defaults.DIVERGENCE_STEPS,
        min_points: int = defaults.DIVERGENCE_MIN_POINTS,
        z: float = defaults.DIVERGENCE_Z,
        spikes: LossSpikeDetector | None = None,
        shared: bool = False,
    ) -> None:
        self.min_rise = min_rise
        self.steps = steps
        self.min_points = min_points
        self.z = z
        self.shared = shared
        self._spikes = spikes if spikes is not None else LossSpikeDetector()
        self._best: float | None = None
        self._best_step = 0
        self._best_n = 0
        # (step, best, best step, points behind it) each time the best level fell by 1 %, for rollbacks.
        self._best_hist: list[tuple[int, float, int, int]] = []
        # A run of points above best + margin: onset step, generation, margin, the noise scale before it (None if
        # unknown), their (step, log-loss) with the log-losses kept sorted (its median at every step is O(1): a long
        # run that stays undecided costs O(n log n), not O(n^2)).
        self._cand: tuple[int, int, float, float | None, SortedWindow] | None = None
        self._open: Anomaly | None = None
        self._ref = 0.0
        self._margin = 0.0
        self._recent: deque[float] = deque(maxlen=3)
        self._last_elevated = 0
        self._prev_step: int | None = None

    def _margin_for(self, base: Baseline | None) -> float:
        return max(math.log1p(self.min_rise), self.z * (base.scale if base is not None else 0.0))

    def _start(self, step: int, gen: int, ref: float, margin: float, reason: str, now: StepAggregate,
               x: float, peak: float, peak_step: int, ref_text: str, extra: str) -> Anomaly:
        self._ref, self._margin = ref, margin
        self._recent.clear()
        self._last_elevated = now.step
        base = math.exp(ref)
        ev = {"reason": reason, "baseline": base, "loss": math.exp(x), "rise": math.exp(x - ref),
              "steps_elevated": now.step - step, "peak": peak, "peak_step": peak_step}
        if reason == "sustained_rise":
            ev["baseline_step"] = self._best_step
        self._open = Anomaly(
            kind=self.KIND, severity="critical", step=step, gen=gen, evidence=ev,
            message=(f"loss {math.exp(x):.4g} at step {now.step} is {math.exp(x - ref):.2f}x "
                     f"{ref_text.format(base=f'{base:.4g}')}, {plural(now.step - step, 'step')} after step "
                     f"{step}{extra}; "
                     f"the run is diverging: roll back to a checkpoint before step {step} and lower the learning "
                     f"rate or skip the data there"),
        )
        return self._open

    def _rewind(self, step: int) -> list[Anomaly]:
        # The discarded timeline's best level no longer applies: back to the best as of the resumed step.
        self._cand = None
        while self._best_hist and self._best_hist[-1][0] >= step:
            self._best_hist.pop()
        self._best, self._best_step, self._best_n = self._best_hist[-1][1:] if self._best_hist else (None, 0, 0)
        cur = self._open
        if cur is None or step > cur.step:
            return []
        self._open = None
        return [replace(cur, status=RESOLVED, end_step=self._last_elevated,
                        evidence={**cur.evidence, "rolled_back": True},
                        message=cur.message.split(";")[0] + f"; training rolled back to step {step}")]

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed (opened, resolved)."""
        out: list[Anomaly] = []
        if self._prev_step is not None and agg.step <= self._prev_step:
            out += self._rewind(agg.step)
        self._prev_step = agg.step
        # The noise scale from before this point joins the window (a rise must not widen its own margin).
        fed = self._spikes.last_update if self.shared else None
        if fed is not None and fed[0] is agg:  # its owner has already fed it this step
            margin, changes = self._margin_for(fed[1]), fed[2]
        else:
            margin = self._margin_for(self._spikes.baseline)
            changes = self._spikes.update(agg)
        loss = agg.loss
        if loss is None or not math.isfinite(loss) or loss <= 0 or not self._spikes.log_scale:
            return out  # NaN/Inf is nan_inf's; a non-positive loss has no relative rise
        x = math.log(loss)
        if self._open is None:
            for a in changes:
                if a.kind == LossSpikeDetector.KIND and a.evidence.get("recovery_class") == NOT_RECOVERED:
                    ev = a.evidence
                    skips = ev.get("skipped_run")
                    note = f", and the optimizer skipped {skips} steps in a row (fp16 overflow)" if skips else ""
                    self._cand = None
                    out.append(self._start(a.step, a.gen, math.log(ev["baseline"]), margin,
                                           "overflow_skips" if skips else "spike_not_recovered", agg, x,
                                           ev["peak"], ev["peak_step"], "its pre-spike level {base}", note))
                    return out
            return out + self._rise(agg, x, margin)
        return out + self._follow(agg, x)

    def _rise(self, agg: StepAggregate, x: float, margin: float) -> list[Anomaly]:
        """The sustained-rise test on one point (no divergence open); the margin is frozen at the run's start."""
        if self._cand is None:
            if self._best is not None and x - self._best > margin:
                base = self._spikes.baseline
                pts = SortedWindow(key=_second)
                pts.append((agg.step, x))
                self._cand = (agg.step, agg.gen, margin, base.scale if base is not None else None, pts)
                return []
            level = self._spikes.window_median
            if level is not None and not self._spikes.spike_open and (self._best is None or level < self._best):
                self._best, self._best_step, self._best_n = level, agg.step, self._spikes.window_points
                if not self._best_hist or level < self._best_hist[-1][1] - 0.01:  # every 1 %: a short list
                    self._best_hist.append((agg.step, level, agg.step, self._best_n))
            return []
        onset, gen, margin, scale, pts = self._cand
        pts.append((agg.step, x))
        if statistics.median(v for _, v in pts[-5:]) - self._best < margin / 2:
            self._cand = None  # back near the best level: a bump, not a divergence
            return []
        if agg.step - onset < self.steps or len(pts) < self.min_points:
            return []
        # The rise is a difference of two medians (of the points behind the best level and of the run's points);
        # its standard error 1.2533 s sqrt(1/n1 + 1/n2) matters when either is backed by few points (a sparse log).
        s = scale if scale is not None else robust_scale_sorted(pts.sorted)  # robust_scale of the run's points
        se = 1.2533 * s * math.sqrt(1.0 / max(self._best_n, 1) + 1.0 / len(pts))
        if pts.median() - self._best >= max(math.log1p(self.min_rise), self.z * se):
            self._cand = None
            peak_step, peak = max(pts, key=lambda p: p[1])
            return [self._start(onset, gen, self._best, margin, "sustained_rise", agg, x, math.exp(peak), peak_step,
                                f"the best level {{base}} it had reached (step {self._best_step})", "")]
        return []

    def _follow(self, agg: StepAggregate, x: float) -> list[Anomaly]:
        """One point while a divergence is open: still up, or back at the reference."""
        self._recent.append(x)
        cur = self._open
        if x - self._ref >= self._margin / 2:
            self._last_elevated = agg.step
        if statistics.median(self._recent) - self._ref < self._margin / 2:
            self._open = None
            return [replace(cur, status=RESOLVED, end_step=self._last_elevated,
                            evidence={**cur.evidence, "recovered_loss": math.exp(x)},
                            message=cur.message.split(";")[0] + f"; back at {math.exp(x):.4g} by step {agg.step}")]
        if math.exp(x) > cur.evidence["peak"]:
            self._open = replace(cur, evidence={**cur.evidence, "peak": math.exp(x), "peak_step": agg.step})
        return []
