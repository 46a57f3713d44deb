"""Plateau: the loss stopped improving for a long stretch while the learning rate is held, not decayed."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.robust import MAD_TO_SIGMA, resistant_slope
from trainhealth.text import fmt_gpu_hours, fmt_usd, plural

#: Asymptotic efficiency factor of the median: its standard error is 1.2533 sigma / sqrt(n) on normal data.
_MEDIAN_SE = 1.2533


class PlateauDetector(StepDetector):
    """The loss has not improved over the last part of the run, at a learning rate that is not being decayed.
    One ``plateau`` anomaly (warning) per episode.

    Every ``check_every`` logged points (positive losses, on ``log(loss)``: a gain is relative) the stretch is the
    last ``run_fraction`` of the steps since the first logged one (at least ``min_steps`` steps and ``min_points``
    points). Its *gain* is the median of its first third minus the median of its last third; the noise scale
    ``s`` is 1.4826 x MAD of its points around Tukey's resistant line (a trend does not inflate it, a slow wander
    does), and the gain's standard error ``SE = 1.2533 s sqrt(2 / k)`` (two medians of ``k`` points). The stretch
    is a plateau when the loss is shown to stay within ``min_gain`` both ways (two one-sided tests): the upper bound
    ``gain + z * SE`` below ``log(1 + min_gain)`` — it improved by less than that — and the lower bound
    ``gain - z * SE`` above ``-log(1 + min_gain)`` — it did not rise either (a rising loss is
    :class:`~trainhealth.detectors.divergence.DivergenceDetector`'s, a level shift a spike's). A noisy log, whose
    SE is large, is never called flat: absence of evidence of progress is not evidence of a plateau.

    Only at a held learning rate: every point of the stretch must log one, and all of them at least
    ``lr_fraction`` of the highest the run reached. The flattening at the end of a decaying schedule (llm.c GPT-2's
    last thousands of steps as its LR goes to 0, a cosine or linear decay's tail) is the schedule, not a plateau;
    a log without learning rates cannot tell the two apart and gets no finding.

    The anomaly's onset is the stretch's first step; it is updated at each check while the stretch stays flat and
    resolved when the gain is again above ``min_gain`` with the same confidence (``gain - z * SE``), or when the
    learning rate starts to decay (the schedule takes over).

    What the plateau costs is in the evidence and the message: the wall time of the stretch (from the job's step
    times; unknown when the log has none), the loss gained per hour and, where the ranks reporting give the GPU count
    (more than one), the stretch's GPU-hours (hours x GPUs), its money (GPU-hours x ``gpu_hour_usd``, when the run
    has a price) and the gain per GPU-hour; otherwise the message says the GPU count is unknown.

    Parameters
    ----------
    min_points : int
        Fewest logged points in the stretch (a third of them backs each median).
    min_steps : int
        Fewest steps in the stretch.
    run_fraction : float
        The stretch is this fraction of the steps since the first logged one.
    min_gain : float
        A relative loss improvement over the stretch below this is no progress.
    z : float
        Standard errors of the confidence bounds.
    lr_fraction : float
        The learning rate must stay at least this fraction of the run's highest over the whole stretch.
    check_every : int
        Logged points between two checks (at least 1 % of the points seen so far).
    max_points : int
        Points kept (thinned to every other one when full: the whole run at a coarser grain).
    gpu_hour_usd : float | None
        Price of one GPU-hour (USD), for the stretch's cost; None: GPU-hours only. The pipeline sets the run's.

    Evidence: ``first_step``, ``last_step`` (the stretch judged), ``points``, ``median_before``, ``median_after``
    (loss medians of its first and last thirds), ``gain`` (relative improvement, negative for a rise),
    ``gain_upper``, ``gain_lower`` (its confidence bounds), ``min_gain``, ``noise`` (robust per-point SD of log-loss),
    ``lr_min``, ``lr_max`` (over the stretch), ``lr_peak`` (the run's highest), ``hours`` (wall time of the stretch,
    None when unknown), ``gpus`` (None when unknown), ``gpu_hours`` (hours x gpus: what the stalled stretch cost;
    None when unknown), ``cost_usd`` (gpu_hours x gpu_hour_usd; None without a price), ``gain_per_hour``,
    ``gain_per_gpu_hour`` (loss units; None when unknown), ``history_points`` (points the decision had).

    Examples
    --------
    >>> import random
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> rng = random.Random(4)
    >>> det, states = PlateauDetector(), []
    >>> for step in range(0, 6000, 5):  # a constant LR; the loss levels off at 2.3 from about step 2000
    ...     loss = (2.3 + 3.0 * math.exp(-step / 400)) * math.exp(rng.gauss(0, 0.01))
    ...     states += det.update(StepAggregate(step, 0, 0.0, None, float(step), loss, 1.0, 3e-4, None, None, 1,
    ...                                        (None,), 0.0))
    >>> for an in (states[0], states[-1]):  # opened, then still so at the last check
    ...     ev = an.evidence
    ...     print(an.kind, an.severity, an.status, an.step, ev["first_step"], ev["last_step"],
    ...           f"{ev['gain']:+.4f} {ev['gain_upper']:+.4f}", ev["hours"])
    plateau warning active 1915 1915 2870 +0.0025 +0.0099 None
    plateau warning active 1915 4000 5995 -0.0043 +0.0002 None

    References
    ----------
    J. Kaplan et al., "Scaling Laws for Neural Language Models", arXiv:2001.08361 (2020) (L ~ C^-0.050: a run on
    the compute frontier gains ~2 % over its last third of compute, 1.5x); J. W. Tukey, "Exploratory Data Analysis"
    (1977) (the resistant line); D. J. Schuirmann, J. Pharmacokinet. Biopharm. 15 (1987) (two one-sided tests:
    flatness is shown by confidence bounds inside a margin, not by a failed test of a difference).
    """

    KIND = "plateau"

    def __init__(
        self,
        min_points: int = defaults.PLATEAU_MIN_POINTS,
        min_steps: int = defaults.PLATEAU_MIN_STEPS,
        run_fraction: float = defaults.PLATEAU_RUN_FRACTION,
        min_gain: float = defaults.PLATEAU_MIN_GAIN,
        z: float = defaults.DIVERGENCE_Z,
        lr_fraction: float = defaults.PLATEAU_LR_FRACTION,
        check_every: int = defaults.PLATEAU_CHECK_POINTS,
        max_points: int = defaults.PLATEAU_MAX_POINTS,
        gpu_hour_usd: float | None = None,
    ) -> None:
        self.min_points = min_points
        self.min_steps = min_steps
        self.run_fraction = run_fraction
        self.min_gain = min_gain
        self.z = z
        self.lr_fraction = lr_fraction
        self.check_every = check_every
        self.max_points = max_points
        self.gpu_hour_usd = gpu_hour_usd
        # (step, log loss, lr or None, seconds since the previous point or None), steps increasing.
        self._pts: list[tuple[int, float, float | None, float | None]] = []
        self._stride = 1  # keep every stride-th point once thinned
        self._skip = 0
        self._first: int | None = None
        self._lr_peak: float | None = None
        self._positive = True
        self._ranks = 1
        self._since = 0
        self._seen = 0  # positive losses fed
        self._prev_step: int | None = None
        self._open: Anomaly | None = None

    def _rewind(self, step: int) -> list[Anomaly]:
        while self._pts and self._pts[-1][0] >= step:
            self._pts.pop()
        cur = self._open
        if cur is None or step > cur.step:
            return []
        self._open = None
        return [replace(cur, status=RESOLVED, end_step=cur.evidence["last_step"],
                        evidence={**cur.evidence, "rolled_back": True},
                        message=cur.message.split(";")[0] + f"; training rolled back to step {step}")]

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed (opened, updated at a check, resolved)."""
        out: list[Anomaly] = []
        prev = self._prev_step
        if prev is not None and agg.step <= prev:
            out += self._rewind(agg.step)
            prev = self._pts[-1][0] if self._pts else None
        self._prev_step = agg.step
        loss = agg.loss
        if loss is None or not math.isfinite(loss):
            return out
        if loss <= 0:
            self._positive = False  # not a cross-entropy: no relative gain to judge
        if not self._positive:
            return out
        if self._first is None:
            self._first = agg.step
        lr = agg.lr if agg.lr is not None and math.isfinite(agg.lr) else None
        if lr is not None and (self._lr_peak is None or lr > self._lr_peak):
            self._lr_peak = lr
        self._ranks = max(self._ranks, agg.n_ranks)
        per = agg.step_s if agg.step_s is not None else agg.dur
        secs = per * (agg.step - prev) if per is not None and prev is not None and agg.step > prev else None
        self._skip += 1
        if self._skip >= self._stride:
            self._skip = 0
            self._pts.append((agg.step, math.log(loss), lr, secs))
            if len(self._pts) > self.max_points:  # thin to every other point: the run at a coarser grain
                self._pts = self._pts[1::2]
                self._stride *= 2
        self._since += 1
        self._seen += 1
        # Checked every check_every points, and at least every 1 % of the points so far (a check sorts thousands of
        # points: a million-step run is checked a few hundred times, a plateau of a third of it is found as soon).
        if self._since < max(self.check_every, self._seen // 100):
            return out
        self._since = 0
        return out + self._check(agg)

    def _check(self, agg: StepAggregate) -> list[Anomaly]:
        pts, last = self._pts, agg.step
        span = max(self.min_steps, self.run_fraction * (last - self._first))
        lo = last - span
        window = [p for p in pts if p[0] >= lo]
        if len(window) < self.min_points or window[-1][0] - window[0][0] < self.min_steps:
            return []
        lrs = [p[2] for p in window]
        cur = self._open
        if any(v is None for v in lrs) or self._lr_peak is None:
            return []  # a decaying schedule cannot be told from a plateau without the learning rate
        if min(lrs) < self.lr_fraction * self._lr_peak:
            if cur is None:
                return []
            return [self._close(cur, last, f"the learning rate is now decayed to {lrs[-1]:.3g} (the schedule's)")]
        k = len(window) // 3
        ys = [p[1] for p in window]
        before, after = statistics.median(ys[:k]), statistics.median(ys[-k:])
        gain = before - after
        steps = [p[0] for p in window]
        slope = resistant_slope(steps, ys)
        mid_s, mid_y = statistics.median(steps), statistics.median(ys)
        resid = [y - mid_y - slope * (s - mid_s) for s, y in zip(steps, ys, strict=True)]
        med_r = statistics.median(resid)
        noise = MAD_TO_SIGMA * statistics.median(abs(r - med_r) for r in resid)
        se = _MEDIAN_SE * noise * math.sqrt(2.0 / k)
        floor = math.log1p(self.min_gain)
        secs = [p[3] for p in window[1:]]
        hours = sum(secs) / 3600.0 if secs and all(v is not None for v in secs) else None
        ev = self._evidence(window, before, after, gain, gain + self.z * se, gain - self.z * se, noise, lrs, hours)
        if cur is None:
            if gain + self.z * se >= floor or gain - self.z * se <= -floor:
                return []  # not shown within +-min_gain: improving, rising (divergence's), or too noisy to tell
            self._open = Anomaly(kind=self.KIND, severity="warning", step=window[0][0], gen=agg.gen, evidence=ev,
                                 message=self._message(ev) + self._advice())
            return [self._open]
        if gain - self.z * se > floor:
            change = ev["median_after"] / ev["median_before"] - 1.0
            return [self._close(cur, last, f"improving again: {change * 100:+.2f} % over steps "
                                           f"{ev['first_step']}-{ev['last_step']}")]
        self._open = replace(cur, evidence=ev, message=self._message(ev, onset=cur.step) + self._advice())
        return [self._open]

    def _close(self, cur: Anomaly, step: int, note: str) -> Anomaly:
        self._open = None
        return replace(cur, status=RESOLVED, end_step=step, message=cur.message.split(";")[0] + f"; {note}")

    def _evidence(self, window: list, before: float, after: float, gain: float, upper: float, lower: float,
                  noise: float, lrs: list[float], hours: float | None) -> dict:
        gain_loss = math.exp(before) - math.exp(after)  # in loss units
        gpus = self._ranks if self._ranks > 1 else None
        per_hour = gain_loss / hours if hours else None
        gpu_hours = hours * gpus if hours is not None and gpus else None
        price = self.gpu_hour_usd
        return {"first_step": window[0][0], "last_step": window[-1][0], "points": len(window),
                "median_before": math.exp(before), "median_after": math.exp(after), "gain": math.expm1(gain),
                "gain_upper": math.expm1(upper), "gain_lower": math.expm1(lower), "min_gain": self.min_gain,
                "noise": noise,
                "lr_min": min(lrs), "lr_max": max(lrs), "lr_peak": self._lr_peak, "hours": hours, "gpus": gpus,
                "gpu_hours": gpu_hours,
                "cost_usd": gpu_hours * price if gpu_hours is not None and price is not None else None,
                "gain_per_hour": per_hour,
                "gain_per_gpu_hour": per_hour / gpus if per_hour is not None and gpus else None,
                "history_points": len(self._pts) * self._stride}

    def _message(self, ev: dict, onset: int | None = None) -> str:
        held = (f"a learning rate held at {ev['lr_min']:.3g}" if ev["lr_min"] == ev["lr_max"]
                else f"a learning rate of {ev['lr_min']:.3g}-{ev['lr_max']:.3g}")
        change = ev["median_after"] / ev["median_before"] - 1.0
        text = (f"loss has not improved over steps {ev['first_step']}-{ev['last_step']} "
                f"({plural(ev['points'], 'logged point')}): median {ev['median_before']:.4g} -> "
                f"{ev['median_after']:.4g} ({change * 100:+.2f} %, {ev['gain_lower'] * 100:+.2f} to "
                f"{ev['gain_upper'] * 100:+.2f} % gained at {self.z:g} SEs, inside the +-{self.min_gain * 100:g} % "
                f"that is progress or a rise) at {held} (not a decaying schedule)")
        if ev["hours"] is None:
            cost = ", over an unknown wall time (the log has no step times)"
        elif ev["gpus"] is None:
            cost = (f", {ev['hours']:.3g} h for a gain of {ev['gain_per_hour']:.3g} per hour (GPU count unknown: one "
                    f"stream of the job)")
        else:
            money = f" ({fmt_usd(ev['cost_usd'])})" if ev.get("cost_usd") is not None else ""
            cost = (f", the stalled stretch cost {fmt_gpu_hours(ev['gpu_hours'])} GPU-hours{money} "
                    f"({ev['hours']:.3g} h on {ev['gpus']} GPUs) for a gain of {ev['gain_per_gpu_hour']:.3g} per "
                    f"GPU-hour")
        return text + cost

    @staticmethod
    def _advice() -> str:
        return ("; the run is spending compute without learning: check the learning rate (too low, or too high to "
                "descend), frozen or unconnected layers and the data; decay the learning rate or stop early")
