"""Loss spikes against a robust trailing baseline, escalated to divergence when they do not recover."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, replace

from detectors.aggregate import StepAggregate
from detectors.anomaly import RESOLVED, Anomaly
from trainhealth import defaults

#: Consistency constant making the MAD estimate the standard deviation of normal data.
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class _Baseline:
    """Trailing baseline: ``level`` at step ``last``, falling ``slope`` per step, robust ``scale``."""

    last: int
    level: float
    slope: float
    scale: float
    span: int

    def predict(self, step: int) -> float:
        # Extrapolate the trend at most one window span ahead (a long spike must not chase it down).
        return self.level + self.slope * min(max(step - self.last, 0), self.span)

    def z(self, step: int, x: float) -> float:
        return (x - self.predict(step)) / self.scale


class LossSpikeDetector:
    """Hampel-style loss spike detector on a detrended trailing window of log-loss.

    Loss noise is multiplicative (a spike doubles the loss whatever its level), so the
    statistics run on ``log(loss)`` while every loss seen is positive (cross-entropy), and on
    the loss itself otherwise. The baseline is fitted on the previous ``window`` non-spike
    values: a robust falling trend (median of slopes between points an eighth of a window apart,
    a cheap Theil-Sen; rising trends are not removed, so slow divergence still shows), the
    median ``m`` of the detrended values and their scale ``s = 1.4826 * MAD``. A spike
    **opens** when ``z = (x - prediction) / s > z_open`` *and* the loss exceeds the predicted
    loss by at least ``min_rel_rise`` of it (so a very smooth curve's tiny MAD cannot turn
    noise into a spike). It stays open while ``z > z_close`` against the frozen pre-spike
    baseline; spike points never enter the window (the baseline is not dragged up by the
    spike itself, unlike a plain mean of a window). The steep early decay of a loss curve is
    removed by the trend instead of widening the scale. A spike still open after
    ``divergence_steps`` steps is also reported as ``divergence`` (critical) and the baseline
    restarts at the new level.

    Parameters
    ----------
    window : int
        Trailing losses in the baseline (steps with a logged loss).
    warmup : int
        Losses needed before anything is flagged.
    z_open, z_close : float
        Robust z-scores that open and close a spike (hysteresis).
    min_rel_rise : float
        Minimum rise over the baseline median, as a fraction of it.
    divergence_steps : int
        Steps (by step number) a spike may stay open before it counts as divergence.

    Evidence: ``loss``, ``baseline`` (predicted loss), ``z`` (robust z of the log-loss), ``peak``,
    ``peak_step``; on resolution ``recovery_steps`` and ``recovered``.

    Examples
    --------
    >>> import random
    >>> from detectors.aggregate import StepAggregate
    >>> rng = random.Random(0)
    >>> det = LossSpikeDetector()
    >>> for step in range(300):
    ...     loss = 3.0 * math.exp(-step / 400) + rng.gauss(0, 0.02) + (1.5 if 200 <= step < 204 else 0)
    ...     a = StepAggregate(step, 0, 0.0, None, float(step), loss, 1.0, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.status, an.step, an.end_step)
    loss_spike active 200 None
    loss_spike resolved 200 203

    References
    ----------
    F. R. Hampel, "The influence curve and its role in robust estimation", JASA 69 (1974);
    R. K. Pearson, "Outliers in process modeling and identification", IEEE TCST 10 (2002)
    (the Hampel filter); P. J. Rousseeuw and C. Croux, "Alternatives to the median absolute
    deviation", JASA 88 (1993) (the 1.4826 consistency constant).
    """

    #: Anomaly kind, the aggregate's field watched, and its name in messages.
    KIND = "loss_spike"
    FIELD = "loss"
    LABEL = "loss"

    def __init__(
        self,
        window: int = defaults.LOSS_SPIKE_WINDOW_STEPS,
        warmup: int = defaults.LOSS_SPIKE_WARMUP_STEPS,
        z_open: float = defaults.LOSS_SPIKE_Z_OPEN,
        z_close: float = defaults.LOSS_SPIKE_Z_CLOSE,
        min_rel_rise: float = defaults.LOSS_SPIKE_MIN_REL_RISE,
        divergence_steps: int = defaults.DIVERGENCE_STEPS,
    ) -> None:
        self.window = window
        self.warmup = warmup
        self.z_open = z_open
        self.z_close = z_close
        self.min_rel_rise = min_rel_rise
        self.divergence_steps = divergence_steps
        self._hist: deque[tuple[int, float]] = deque(maxlen=window)
        self._log = True
        self._spike: Anomaly | None = None
        self._base: _Baseline | None = None
        self._last_spike_step = 0
        self._divergence: Anomaly | None = None
        self._div_base: _Baseline | None = None

    def _t(self, loss: float) -> float:
        return math.log(loss) if self._log else loss

    def _inv(self, x: float) -> float:
        return math.exp(x) if self._log else x

    def _baseline(self) -> _Baseline:
        steps = [p[0] for p in self._hist]
        ys = [p[1] for p in self._hist]
        n, h = len(ys), max(1, len(ys) // 8)
        # Robust slope: median of the slopes between points an eighth of a window apart (a cheap
        # Theil-Sen). The short lag keeps a level shift inside the window (an epoch boundary)
        # from being read as a slope: few pairs straddle it. Only a falling trend is removed
        # (the natural decay); a rising one stays in the level, so slow divergence still shows.
        slopes = [(ys[i + h] - ys[i]) / (steps[i + h] - steps[i]) for i in range(n - h) if steps[i + h] > steps[i]]
        slope = min(0.0, statistics.median(slopes)) if slopes else 0.0
        last = steps[-1]
        detrended = [y - slope * (st - last) for st, y in zip(steps, ys, strict=True)]
        level = statistics.median(detrended)
        mad = statistics.median(abs(d - level) for d in detrended)
        # A scale floor keeps z finite on a perfectly flat baseline; the relative-rise test decides there.
        scale = max(MAD_TO_SIGMA * mad, 1e-12 * max(1.0, abs(level)))
        return _Baseline(last, level, slope, scale, max(last - steps[0], 1))

    def _rewind(self, step: int) -> list[Anomaly]:
        """Training went back to ``step`` (restart or rollback): forget the discarded timeline."""
        while self._hist and self._hist[-1][0] >= step:
            self._hist.pop()
        spike = self._spike
        if spike is None or step > spike.step:
            return []
        self._spike = None
        return [replace(spike, status=RESOLVED, end_step=self._last_spike_step,
                        evidence={**spike.evidence, "recovered": False, "rolled_back": True},
                        message=spike.message.split(";")[0] + f"; training rolled back to step {step}")]

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed."""
        loss = getattr(agg, self.FIELD)
        if loss is None or not math.isfinite(loss):
            return []
        if self._log and loss <= 0:
            # A non-positive loss: not cross-entropy; work on the raw values from here on.
            self._log = False
            self._hist = deque(((st, math.exp(v)) for st, v in self._hist), maxlen=self.window)
            self._spike = None
        x = self._t(loss)
        out: list[Anomaly] = []
        if self._hist and agg.step <= self._hist[-1][0]:
            out += self._rewind(agg.step)
        if self._divergence is not None and self._div_base.z(agg.step, x) <= self.z_close:
            self._divergence = replace(self._divergence, status=RESOLVED, end_step=agg.step,
                                       evidence={**self._divergence.evidence, "recovered_loss": loss})
            out.append(self._divergence)
            self._divergence = None
        if len(self._hist) < self.warmup:
            self._hist.append((agg.step, x))
            return out
        if self._spike is None:
            base = self._baseline()
            z = base.z(agg.step, x)
            med = self._inv(base.predict(agg.step))
            if z > self.z_open and loss - med > self.min_rel_rise * abs(med):
                self._base = base
                self._last_spike_step = agg.step
                self._spike = Anomaly(
                    kind=self.KIND, severity="warning", step=agg.step, gen=agg.gen,
                    message=(f"{self.LABEL} {loss:.4g} at step {agg.step} is {loss / med:.2f}x the expected "
                             f"{med:.4g} ({z:.1f} robust SDs); watching whether it recovers"),
                    evidence={self.FIELD: loss, "baseline": med, "z": z, "peak": loss, "peak_step": agg.step},
                )
                out.append(self._spike)
            else:
                self._hist.append((agg.step, x))
            return out
        base = self._base
        z = base.z(agg.step, x)
        spike = self._spike
        if z > self.z_close:
            self._last_spike_step = agg.step
            ev = dict(spike.evidence)
            if loss > ev["peak"]:
                ev.update(peak=loss, peak_step=agg.step, z=z)
            open_for = agg.step - spike.step
            if open_for >= self.divergence_steps:
                # Not recovering: report divergence, restart the baseline at the new level.
                self._div_base = base
                self._divergence = Anomaly(
                    kind="divergence", severity="critical", step=spike.step, gen=spike.gen,
                    message=(f"loss has stayed above its pre-spike level {spike.evidence['baseline']:.4g} for "
                             f"{open_for} steps "
                             f"since step {spike.step} (now {loss:.4g}): the run is diverging; roll back to "
                             f"a checkpoint before step {spike.step}"),
                    evidence={"baseline": spike.evidence["baseline"], "loss": loss, "steps_elevated": open_for,
                              "peak": ev["peak"]},
                )
                out.append(self._divergence)
                ev["recovered"] = False
                self._spike = replace(spike, status=RESOLVED, end_step=agg.step, severity="critical",
                                      evidence=ev, message=spike.message.split(";")[0] + "; did not recover")
                out.append(self._spike)
                self._spike = None
                self._hist.clear()
                self._hist.append((agg.step, x))
            else:
                self._spike = replace(spike, evidence=ev)  # kept, sent with the next transition
            return out
        ev = {**spike.evidence, "recovery_steps": agg.step - spike.step, "recovered": True}
        self._spike = None
        self._hist.append((agg.step, x))
        out.append(replace(spike, status=RESOLVED, end_step=self._last_spike_step, evidence=ev,
                           message=spike.message.split(";")[0]
                           + f"; recovered after {agg.step - spike.step} steps"))
        return out
