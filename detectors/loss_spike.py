"""Loss spikes against a robust trailing baseline, classified by how they recover (fast, slow, not at all)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from dataclasses import replace

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.robust import (
    SMALL_SAMPLE_Z,
    STUDENT_Z,
    STUDENT_Z_LIMIT,
    Baseline,
    History,
    Tail,
    fit_baseline,
)
from trainhealth.text import plural

#: Recovery classes, in ``evidence["recovery_class"]``.
FAST, SLOW, NOT_RECOVERED = "fast", "slow", "not_recovered"


class LossSpikeDetector(StepDetector):
    """Loss spikes on a detrended trailing window of log-loss, classified once they settle.

    Loss noise is multiplicative (a spike doubles the loss whatever its level), so the statistics
    run on ``log(loss)`` while every loss seen is positive (cross-entropy), and on the loss itself
    otherwise. The baseline is fitted on the previous ``window`` logged non-spike values (points, with
    their step numbers, so sparse and irregular logs work):

    * a falling trend, Tukey's resistant line over the newer half of the window (a loss curve is
      convex: the recent slope is the one to extrapolate); a rising trend is left in the level, so a
      slow divergence still shows;
    * the level, the median of the detrended newer half, at the newest point;
    * the noise scale ``s``, 1.4826 x MAD of the whole detrended window (points older than the
      trend's own span are detrended no further than it: across a log's gap the trend is unknown); for
      at most 20 points at least ``R / d2(n)`` (range over the expected range of n normal draws: the MAD
      of a few points can be near zero by chance).

    A spike **opens** when the excess ``e = x - level`` (the current level: extrapolating the trend to
    the new step would only lower the expectation, wrongly so while a steep early decay decelerates)
    passes all of

    * ``e > z_open * s``, a robust z-score (the Hampel filter; OLMo-core flags 6 SDs); with n <= 9 points
      in the window, at least the Student-t prediction bound for a scale estimated from n points
      (:data:`SMALL_SAMPLE_Z`);
    * ``e > log(1 + min_rel_rise)``: the value is at least ``1 + min_rel_rise`` times the expected one.
      A smaller one-point rise is within the ordinary batch-to-batch spread of real runs
      (modded-nanogpt's late phase: a +15 % blip every ~100 steps; Megatron Mixtral: +6-14 % blips) and
      not what the practitioner accounts call a spike (BLOOM-176B: 2.2 -> 5.1; PaLM §5.1; the OPT logbook);
    * ``e / s`` above the level the run's own normalised residuals exceed with probability
      ``tail_risk`` per step (extreme value theory: a generalised Pareto tail fitted on the last
      ``tail_points`` accepted points, once ``tail_min_points`` are in). On Gaussian noise this sits near
      4 SDs and changes nothing; on the heavy right tail of real losses (hard batches) it keeps the run's
      routine blips quiet. Waived when the partner signal (the grad norm for the loss) is at least
      ``corroborate_z`` robust SDs above its own median at the same step: two signals agreeing.

    A log too short for the tail fit (fewer than ``tail_min_points`` accepted points: an excerpt, a sparse log)
    has only the margin of ``z_open`` over the Student-t bound to stand for its unknown tail. There, a point at
    least ``record_ratio`` times *every* point of its window (log scale only) needs only the Student-t bound for
    the window's size (:data:`~trainhealth.detectors.robust.STUDENT_Z`) and the relative floor: a 2x jump over
    everything seen before is overwhelming however few points came before it (tf_deeplab's step 13000: 5.13 after
    28 points of 0.41-1.82).

    When the partner spikes at the same step (``partner_spike_z`` robust SDs, the partner detector's own
    threshold), this signal's excursion needs only ``corroborate_z`` SDs besides the relative floor: the
    grad norm that jumps 12x with a loss spike (TrOCR, step 682) is part of it, though alone it would be
    within that run's wide grad-norm swings. A hard batch raises both a little; this asks one of them to
    be a spike on its own.

    A point further from the window than the window is long (an excerpt's next block, a long logging
    gap) is not tested: the baseline does not describe its neighbourhood, and a jump there is a level
    change across the gap (:class:`~trainhealth.detectors.divergence.DivergenceDetector` judges lasting ones). The
    window starts again from it.

    A spike stays open while the loss is still elevated, ``e > max(z_close * s, log(1 + close_rel))``,
    against the frozen pre-spike baseline, its trend extrapolated (spike points never enter the window,
    so the baseline is not dragged up by the spike itself); it has settled when two logged points in a
    row are back (one noisy dip during a slow recovery is not the end) — on a log too short for the tail
    fit, already the first point back after a spike of one elevated point (there was no recovery to dip
    in, and an excerpt often ends right after its spike) —, ``recovery_steps`` counting to the first of
    them. Once settled it is classified:

    * ``fast``: back within ``fast_steps`` steps of the onset, or at the very next logged point (a
      sparse log cannot show a faster recovery);
    * ``slow``: back, later than that;
    * ``not_recovered``: still elevated ``divergence_steps`` steps after the onset (at a second
      elevated point), or a run of ``skipped_steps`` consecutive skipped optimizer steps (fp16
      overflow) while it is up: the weights are not being updated, so the loss cannot come back by
      training. :class:`~trainhealth.detectors.divergence.DivergenceDetector` reports these as ``divergence``;
      here the baseline restarts at the new level.

    Parameters
    ----------
    window : int
        Trailing logged points in the baseline.
    warmup : int
        Logged points needed before anything is flagged.
    z_open, z_close : float
        Robust z-scores that open a spike and bound its recovery (hysteresis).
    min_rel_rise : float
        Minimum rise over the expected value to open, as a fraction of it.
    close_rel : float
        The loss counts as recovered within this fraction of the expected value (or ``z_close``).
    tail_points, tail_min_points : int
        Accepted points kept for the tail fit, and needed before it is used.
    tail_quantile : float
        Residuals above this quantile are the peaks the tail is fitted on.
    tail_risk : float
        Probability per step that the run's own noise exceeds the tail threshold (1e-4: one false alarm
        per 10,000 healthy steps); times the log's interval per logged point.
    corroborate_z : float
        Robust z of the partner signal at the same step that waives the tail threshold.
    partner_spike_z : float
        Robust z of the partner signal at the same step that makes it a spike itself (the partner
        detector's ``z_open``); then this signal needs only ``corroborate_z`` SDs (and the relative floor).
    fast_steps : int
        Recovery within this many steps (from the onset) is ``fast``.
    divergence_steps : int
        Steps (by step number) a spike may stay open before it is ``not_recovered``.
    skipped_steps : int
        Consecutive skipped optimizer steps during an open spike that make it ``not_recovered``
        (0 disables).
    order_jump : float | None
        On a log too short for the noise tail, a point at least this many times the window's level opens whatever
        the window's spread (None: off; the grad-norm detector's ``GRAD_NORM_SPIKE_ORDER_JUMP``).
    record_ratio : float | None
        Before the tail fit, a point this many times every point of the window is judged at the Student-t bound
        (None disables).

    Evidence: ``loss`` (value at onset), ``baseline`` (expected value), ``z``, ``rise`` (ratio to the
    expected value), ``threshold`` (smallest ratio that would have opened), ``tail_z`` (the tail threshold
    in SDs, None before it exists), ``partner_z`` (None when the partner is not logged), ``peak``, ``peak_step``,
    ``history_points`` (points in the window the decision had: 3 on an excerpt's third point), ``record`` (the
    value over the window's highest point when the record test decided, else None);
    once settled ``recovery_class``, ``recovered``, ``recovery_steps`` (first step back at the
    baseline minus the onset; None if not recovered), ``elevated_steps``; ``skipped_run`` when
    skipped steps decided it; ``rolled_back`` when training went back past the onset.

    Examples
    --------
    >>> import random
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> rng = random.Random(0)
    >>> det = LossSpikeDetector()
    >>> for step in range(300):
    ...     loss = 3.0 * math.exp(-step / 400) + rng.gauss(0, 0.02) + (1.5 if 200 <= step < 204 else 0)
    ...     a = StepAggregate(step, 0, 0.0, None, float(step), loss, 1.0, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.status, an.step, an.end_step, an.evidence.get("recovery_class"))
    loss_spike active 200 None None
    loss_spike resolved 200 203 fast

    References
    ----------
    F. R. Hampel, "The influence curve and its role in robust estimation", JASA 69 (1974);
    R. K. Pearson, "Outliers in process modeling and identification", IEEE TCST 10 (2002)
    (the Hampel filter); P. J. Rousseeuw and C. Croux, "Alternatives to the median absolute
    deviation", JASA 88 (1993) (the 1.4826 consistency constant); J. W. Tukey, "Exploratory Data Analysis"
    (1977) (the resistant line); A. Siffer et al., "Anomaly Detection in Streams with Extreme Value
    Theory", KDD 2017 (SPOT); J. R. M. Hosking and J. R. Wallis, Technometrics 29 (1987) (the generalised
    Pareto by probability-weighted moments); OLMo-core ``StabilityMonitorCallback``
    (allenai/OLMo-core, src/olmo_core/train/callbacks/stability_monitor.py: a spike is > 6 SD above the
    trailing 128 values); A. Chowdhery et al., "PaLM", JMLR 24 (2023) §5.1
    (spikes that do not recover: restart ~100 steps before, skip 200-500 batches); BigScience
    BLOOM-176B chronicles (tr11-176B-ml/chronicles.md: a spike 2.2 -> 5.1 at iteration 31219, back
    within ~30 iterations) and tr8b-104B chronicles (a jump that stays, with fp16 overflow skips);
    Meta OPT-175B logbook (spikes followed by divergence, rolled back).
    """

    #: Anomaly kind, the aggregate's field watched, and its name in messages.
    KIND = "loss_spike"
    FIELD = "loss"
    LABEL = "loss"
    #: The other signal that corroborates a spike at the same step.
    PARTNER = "grad_norm"
    #: Severity of an open (or recovered) spike; ``not_recovered`` is critical.
    SEVERITY = "warning"

    def __init__(
        self,
        window: int = defaults.LOSS_SPIKE_WINDOW_STEPS,
        warmup: int = defaults.LOSS_SPIKE_WARMUP_STEPS,
        z_open: float = defaults.LOSS_SPIKE_Z_OPEN,
        z_close: float = defaults.LOSS_SPIKE_Z_CLOSE,
        min_rel_rise: float = defaults.LOSS_SPIKE_MIN_REL_RISE,
        close_rel: float = defaults.LOSS_SPIKE_CLOSE_REL,
        tail_points: int = defaults.LOSS_SPIKE_TAIL_POINTS,
        tail_quantile: float = defaults.LOSS_SPIKE_TAIL_QUANTILE,
        tail_risk: float = defaults.LOSS_SPIKE_TAIL_RISK,
        tail_min_points: int = defaults.LOSS_SPIKE_TAIL_MIN_POINTS,
        corroborate_z: float = defaults.LOSS_SPIKE_CORROBORATE_Z,
        partner_spike_z: float = defaults.GRAD_NORM_SPIKE_Z_OPEN,
        fast_steps: int = defaults.LOSS_SPIKE_FAST_STEPS,
        divergence_steps: int = defaults.DIVERGENCE_STEPS,
        skipped_steps: int = defaults.SKIPPED_STEPS_MIN,
        record_ratio: float | None = defaults.LOSS_SPIKE_RECORD_RATIO,
        order_jump: float | None = None,
    ) -> None:
        self.window = window
        self.warmup = warmup
        self.z_open = z_open
        self.z_close = z_close
        self.min_rel_rise = min_rel_rise
        self.close_rel = close_rel
        self.tail_points = tail_points
        self.tail_quantile = tail_quantile
        self.tail_risk = tail_risk
        self.tail_min_points = tail_min_points
        self.corroborate_z = corroborate_z
        self.partner_spike_z = partner_spike_z
        self.fast_steps = fast_steps
        self.divergence_steps = divergence_steps
        self.skipped_steps = skipped_steps
        self.record_ratio = record_ratio
        self.order_jump = order_jump
        self._hist = History(window)
        self._log = True
        self._spike: Anomaly | None = None
        self._base: Baseline | None = None
        self._last: Baseline | None = None
        # Normalised residuals (x - level) / scale of accepted points, for the extreme-value threshold.
        self._tail = Tail(tail_points, tail_quantile, tail_min_points)
        # The partner signal's (step, log value) at accepted points.
        self._partner: deque[tuple[int, float]] = deque(maxlen=window)
        self._last_elevated = 0
        self._elevated_points = 0
        self._back: int | None = None  # first step of the current run of points back at the baseline
        self._skip_run = 0
        self._prev_step: int | None = None
        self._last_update: tuple[StepAggregate, Baseline | None, list[Anomaly]] | None = None

    # -- public read-only state (DivergenceDetector builds on it) -----------------------------------------
    @property
    def baseline(self) -> Baseline | None:
        """The trailing baseline as of the last accepted point (None during warm-up)."""
        return self._last

    @property
    def window_median(self) -> float | None:
        """Median of the window's (transformed) values, not detrended: a steady, slightly lagging level
        (None before the first point)."""
        return self._hist.median() if self._hist else None

    @property
    def window_points(self) -> int:
        """Points in the trailing window."""
        return len(self._hist)

    @property
    def log_scale(self) -> bool:
        """Whether the statistics run on ``log(value)`` (every value seen was positive)."""
        return self._log

    @property
    def spike_open(self) -> bool:
        return self._spike is not None

    @property
    def last_update(self) -> tuple[StepAggregate, Baseline | None, list[Anomaly]] | None:
        """The latest aggregate fed, the baseline as of just before it, and what :meth:`update` returned for it
        (None before the first): lets a detector built on this one
        (:class:`~trainhealth.detectors.divergence.DivergenceDetector`)
        share it with the pipeline instead of feeding a copy of it."""
        return self._last_update

    # -- internals ------------------------------------------------------------------------------------------
    def _inv(self, x: float) -> float:
        return math.exp(x) if self._log else x

    def _rel(self, frac: float) -> float:
        """A relative rise ``frac`` in the transformed units (log ratio, or a fraction of the level)."""
        return math.log1p(frac) if self._log else frac

    def _fit(self) -> Baseline:
        return self._hist.fit(self._log)

    def _accept(self, agg: StepAggregate, x: float, base: Baseline | None) -> None:
        """Add a non-spike point to the window (its residual to the tail, its partner value to theirs)."""
        if base is not None:
            self._tail.add((x - base.level) / base.scale)
        v = getattr(agg, self.PARTNER)
        if v is not None and math.isfinite(v) and v > 0:
            self._partner.append((agg.step, math.log(v)))
        self._hist.append(agg.step, x)
        self._last = self._hist.fit(self._log) if len(self._hist) >= self.warmup else None  # self._fit(), inline

    def _interval(self) -> float:
        """Median steps between consecutive points of the window (the log's interval; at least 1)."""
        steps = self._hist.steps
        return max(float(statistics.median([b - a for a, b in itertools.pairwise(steps)])), 1.0) if len(steps) > 1 \
            else 1.0

    def _partner_z(self, agg: StepAggregate) -> float:
        """The partner signal's robust z at this step against its own baseline over the accepted points, fitted
        the same way (-inf if it is not logged or has too few points)."""
        v = getattr(agg, self.PARTNER)
        if v is None or not math.isfinite(v) or v <= 0 or len(self._partner) < self.warmup:
            return -math.inf
        base = fit_baseline([p[0] for p in self._partner], [p[1] for p in self._partner])
        # With few points, deflated as the partner's own test would be (its small-sample bound over its z_open).
        return (math.log(v) - base.level) / max(base.scale * max(1.0, SMALL_SAMPLE_Z.get(base.n, 0.0) / self.z_open),
                                                1e-12)

    def _rewind(self, step: int) -> list[Anomaly]:
        """Training went back to ``step`` (restart or rollback): forget the discarded timeline."""
        while self._hist and self._hist.steps[-1] >= step:
            self._hist.pop()
        self._last = self._fit() if len(self._hist) >= self.warmup else None
        self._skip_run = 0
        spike = self._spike
        if spike is None or step > spike.step:
            return []
        self._spike = None
        return [replace(spike, status=RESOLVED, end_step=self._last_elevated,
                        evidence={**spike.evidence, "recovered": False, "rolled_back": True},
                        message=spike.message.split(";")[0] + f"; training rolled back to step {step}")]

    def _settle(self, spike: Anomaly, cls: str, step: int, note: str, **extra) -> Anomaly:
        ev = {**spike.evidence, "recovery_class": cls, "recovered": cls != NOT_RECOVERED,
              "elevated_steps": self._last_elevated - spike.step + 1, **extra}
        sev = "critical" if cls == NOT_RECOVERED else spike.severity
        return replace(spike, status=RESOLVED, end_step=self._last_elevated if cls != NOT_RECOVERED else step,
                       severity=sev, evidence=ev, message=spike.message.split(";")[0] + "; " + note)

    # -- the detector ---------------------------------------------------------------------------------------
    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed (opened, settled)."""
        before = self._last
        out = self._update(agg)
        self._last_update = (agg, before, out)
        return out

    def _update(self, agg: StepAggregate) -> list[Anomaly]:
        out: list[Anomaly] = []
        if self._prev_step is not None and agg.step <= self._prev_step:
            out += self._rewind(agg.step)
        self._prev_step = agg.step
        self._skip_run = self._skip_run + 1 if agg.skipped else 0
        value = getattr(agg, self.FIELD)
        if value is None or not math.isfinite(value):
            return out
        if self._log and value <= 0:
            # A non-positive value: not cross-entropy; work on the raw values from here on.
            self._log = False
            old, self._hist = self._hist, History(self.window)
            for st, v in zip(old.steps, old.ys, strict=True):
                self._hist.append(st, math.exp(v))
            self._spike = None
            self._tail.clear()
            self._last = self._fit() if len(self._hist) >= self.warmup else None
        x = math.log(value) if self._log else value  # the transformed value
        if self._spike is None:
            base = self._last
            if base is not None and agg.step - base.last > base.last - self._hist.steps[0]:
                # A point further from the window than the window is long (an excerpt's next block, a long
                # logging gap): the window does not describe its neighbourhood, and a jump there is a level
                # change across the gap, not a spike. The window starts again from it (warm-up again).
                self._hist.clear()
                self._last = base = None
            if base is None:
                self._accept(agg, x, None)
                return out
            # Opening is judged against the current level, not the trend extrapolated to this step: the
            # extrapolation only ever lowers the expectation, and a steep early decay decelerates.
            pred = base.level
            e = x - pred
            floor = math.log1p(self.min_rel_rise) if self._log else self.min_rel_rise  # self._rel, inline
            # Every threshold below is at least the relative floor: a point not above it (nearly all of them) is
            # accepted without computing them. (`not e <= floor` keeps a NaN floor ignored, as max() ignores it.)
            if not e <= floor:
                small = SMALL_SAMPLE_Z.get(base.n, 0.0)
                need = max(max(self.z_open, small) * base.scale, floor)
                record, jump = None, False
                if self.record_ratio is not None and self._log and not self._tail.ready:
                    # A log too short to know its own noise tail (an excerpt): a point at least record_ratio times
                    # every point of the window needs only the Student-t bound for this many points, not the
                    # Hampel margin z_open that stands in for the tail.
                    over = x - self._hist.sorted[-1]
                    if over >= math.log(self.record_ratio):
                        record = math.exp(over)
                        need = min(need, max(STUDENT_Z.get(base.n, STUDENT_Z_LIMIT) * base.scale, floor))
                if (self.order_jump is not None and self._log and not self._tail.ready
                        and e >= math.log(self.order_jump)):
                    # An order of magnitude over the window's level on a log too short for a noise model (a few
                    # points of an excerpt): overwhelming whatever the few points' spread says.
                    jump = need > math.log(self.order_jump)  # it decides only where the spread would not
                    need = min(need, math.log(self.order_jump))
                tail, partner_z = None, -math.inf
                if e > max(max(self.corroborate_z, small) * base.scale, floor):
                    partner_z = self._partner_z(agg)
                    if partner_z >= self.partner_spike_z:
                        # The partner spikes at this very step (the grad norm with the loss, or the loss with the
                        # grad norm): this signal's own excursion needs only corroborate_z robust SDs to count with it.
                        need = max(max(self.corroborate_z, small) * base.scale, floor)
                    elif e > need:
                        # The alarm budget is per step: a point standing for several steps takes a larger share of it.
                        tail = self._tail.level(min(1.0, self.tail_risk * self._interval()))
                        if tail is not None and partner_z < self.corroborate_z:
                            need = max(need, tail * base.scale)
                if e > need:
                    self._open(agg, value, x, base, pred, need, tail, partner_z, record, jump)
                    out.append(self._spike)
                    return out
            self._accept(agg, x, base)
            return out
        return out + self._follow(agg, value, x)

    def _open(self, agg: StepAggregate, value: float, x: float, base: Baseline, pred: float, need: float,
              tail: float | None, partner_z: float, record: float | None = None, jump: bool = False) -> None:
        expected = self._inv(pred)
        z = (x - pred) / base.scale
        ratio = value / expected if self._log and expected > 0 else float("nan")
        self._base = base
        self._last_elevated = agg.step
        self._elevated_points = 1
        self._back = None
        how = f"{ratio:.2f}x the expected {expected:.4g}" if self._log else f"above the expected {expected:.4g}"
        self._spike = Anomaly(
            kind=self.KIND, severity=self.SEVERITY, step=agg.step, gen=agg.gen,
            message=(f"{self.LABEL} {value:.4g} at step {agg.step} is {how} ({min(z, 999.0):.1f} robust SDs"
                     + (f", {record:.2f}x the highest of the {base.n} logged points before it" if record else "")
                     + (f", over {self.order_jump:g}x the level of the {base.n} logged points before it: too few "
                        "to know its noise" if jump else "")
                     + "); watching whether it recovers"),
            evidence={self.FIELD: value, "baseline": expected, "z": z, "rise": ratio,
                      "threshold": math.exp(need) if self._log else need, "tail_z": tail,
                      "partner_z": partner_z if math.isfinite(partner_z) else None,
                      "peak": value, "peak_step": agg.step, "history_points": base.n, "record": record,
                      **({"order_jump": self.order_jump} if jump else {})},
        )

    def _follow(self, agg: StepAggregate, value: float, x: float) -> list[Anomaly]:
        """One step while a spike is open: still elevated, settled, or not recovered."""
        base, spike = self._base, self._spike
        e = x - base.predict(agg.step)
        if e > max(self.z_close * base.scale, self._rel(self.close_rel)):
            self._back = None
            self._last_elevated = agg.step
            self._elevated_points += 1
            ev = dict(spike.evidence)
            if value > ev["peak"]:
                ev.update(peak=value, peak_step=agg.step)
            self._spike = spike = replace(spike, evidence=ev)  # kept, sent with the next transition
            open_for = agg.step - spike.step
            skipped = self.skipped_steps and self._skip_run >= self.skipped_steps
            if open_for >= self.divergence_steps or skipped:
                if skipped:
                    note = (f"the optimizer skipped {self._skip_run} steps in a row while it was up (fp16 overflow): "
                            f"not recovered")
                    done = self._settle(spike, NOT_RECOVERED, agg.step, note, recovery_steps=None,
                                        skipped_run=self._skip_run)
                else:
                    done = self._settle(spike, NOT_RECOVERED, agg.step,
                                        f"not recovered after {plural(open_for, 'step')} (now {value:.4g})",
                                        recovery_steps=None)
                # Restart the baseline at the new level.
                self._spike = None
                self._hist.clear()
                self._accept(agg, x, None)
                return [done]
            return []
        # Back: settled once two logged points in a row are back (one dip of a slow recovery is not the end); on a log
        # too short for the tail fit, at once after a one-point spike (no recovery to dip in: an excerpt often ends
        # right after its spike).
        if self._back is None:
            self._back = agg.step
            if self._elevated_points > 1 or self._tail.ready:
                return []
        rec = self._back - spike.step
        if rec <= self.fast_steps:
            cls, note = FAST, f"recovered after {plural(rec, 'step')} (fast)"
        elif self._elevated_points == 1:  # a sparse log: back at the very next logged point
            cls, note = FAST, f"recovered at the next logged point, {plural(rec, 'step')} later (fast: one point up)"
        else:
            cls, note = SLOW, f"recovered after {plural(rec, 'step')} (slow: more than {self.fast_steps})"
        done = self._settle(spike, cls, agg.step, note, recovery_steps=rec)
        self._spike = None
        self._accept(agg, x, None)
        return [done]
