"""Loss spikes against a robust trailing baseline, escalated to divergence when they do not recover."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import replace

from detectors.aggregate import StepAggregate
from detectors.anomaly import RESOLVED, Anomaly
from trainhealth import defaults

#: Consistency constant making the MAD estimate the standard deviation of normal data.
MAD_TO_SIGMA = 1.4826


class LossSpikeDetector:
    """Hampel-style loss spike detector on a trailing median/MAD window of log-loss.

    Loss noise is multiplicative (a spike doubles the loss whatever its level), so the
    statistics run on ``log(loss)`` while every loss seen is positive (cross-entropy), and on
    the loss itself otherwise. For each finite value ``x`` the baseline is the median ``m`` of
    the previous ``window`` non-spike values and the scale ``s = 1.4826 * MAD`` of them. A spike **opens** when
    ``z = (x - m) / s > z_open`` *and* the loss exceeds the median loss by ``min_rel_rise`` of it (so a very smooth curve's
    tiny MAD cannot turn noise into a spike). It stays open while ``z > z_close`` against the
    pre-spike baseline, and spike points never enter the window (the baseline is not dragged
    up by the spike itself, unlike a plain mean of a window). A falling loss curve only gives
    negative ``z``, so the natural decay never triggers. A spike still open after
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

    Evidence: ``loss``, ``baseline`` (median loss), ``z`` (robust z of the log-loss), ``peak``,
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
        self._hist: deque[float] = deque(maxlen=window)
        self._log = True
        self._spike: Anomaly | None = None
        self._base: tuple[float, float] = (0.0, 0.0)
        self._last_spike_step = 0
        self._divergence: Anomaly | None = None
        self._div_base: tuple[float, float] = (0.0, 0.0)

    def _t(self, loss: float) -> float:
        return math.log(loss) if self._log else loss

    def _inv(self, x: float) -> float:
        return math.exp(x) if self._log else x

    def _baseline(self) -> tuple[float, float]:
        m = statistics.median(self._hist)
        mad = statistics.median(abs(x - m) for x in self._hist)
        # A scale floor keeps z finite on a perfectly flat baseline; the relative-rise test decides there.
        return m, max(MAD_TO_SIGMA * mad, 1e-12 * max(1.0, abs(m)))

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed."""
        loss = agg.loss
        if loss is None or not math.isfinite(loss):
            return []
        if self._log and loss <= 0:
            # A non-positive loss: not cross-entropy; work on the raw values from here on.
            self._log = False
            self._hist = deque((math.exp(v) for v in self._hist), maxlen=self.window)
            self._spike = None
        x = self._t(loss)
        out: list[Anomaly] = []
        if self._divergence is not None:
            m0, s0 = self._div_base
            if (x - m0) / s0 <= self.z_close:
                self._divergence = replace(self._divergence, status=RESOLVED, end_step=agg.step,
                                           evidence={**self._divergence.evidence, "recovered_loss": loss})
                out.append(self._divergence)
                self._divergence = None
        if len(self._hist) < self.warmup:
            self._hist.append(x)
            return out
        if self._spike is None:
            m, s = self._baseline()
            z = (x - m) / s
            med = self._inv(m)
            if z > self.z_open and loss - med > self.min_rel_rise * abs(med):
                self._base = (m, s)
                self._last_spike_step = agg.step
                self._spike = Anomaly(
                    kind="loss_spike", severity="warning", step=agg.step, gen=agg.gen,
                    message=(f"loss {loss:.4g} at step {agg.step} is {loss / med:.2f}x the trailing median "
                             f"{med:.4g} ({z:.1f} robust SDs); watching whether it recovers"),
                    evidence={"loss": loss, "baseline": med, "z": z, "peak": loss, "peak_step": agg.step},
                )
                out.append(self._spike)
            else:
                self._hist.append(x)
            return out
        m, s = self._base
        z = (x - m) / s
        spike = self._spike
        if z > self.z_close:
            self._last_spike_step = agg.step
            ev = dict(spike.evidence)
            if loss > ev["peak"]:
                ev.update(peak=loss, peak_step=agg.step, z=z)
            open_for = agg.step - spike.step
            if open_for >= self.divergence_steps:
                # Not recovering: report divergence, restart the baseline at the new level.
                self._div_base = (m, s)
                self._divergence = Anomaly(
                    kind="divergence", severity="critical", step=spike.step, gen=spike.gen,
                    message=(f"loss has stayed above its pre-spike level {self._inv(m):.4g} for {open_for} steps "
                             f"since step {spike.step} (now {loss:.4g}): the run is diverging; roll back to "
                             f"a checkpoint before step {spike.step}"),
                    evidence={"baseline": self._inv(m), "loss": loss, "steps_elevated": open_for,
                              "peak": ev["peak"]},
                )
                out.append(self._divergence)
                ev["recovered"] = False
                self._spike = replace(spike, status=RESOLVED, end_step=agg.step, severity="critical",
                                      evidence=ev, message=spike.message.split(";")[0] + "; did not recover")
                out.append(self._spike)
                self._spike = None
                self._hist.clear()
                self._hist.append(x)
            else:
                self._spike = replace(spike, evidence=ev)  # kept, sent with the next transition
            return out
        ev = {**spike.evidence, "recovery_steps": agg.step - spike.step, "recovered": True}
        self._spike = None
        self._hist.append(x)
        out.append(replace(spike, status=RESOLVED, end_step=self._last_spike_step, evidence=ev,
                           message=spike.message.split(";")[0]
                           + f"; recovered after {agg.step - spike.step} steps"))
        return out
