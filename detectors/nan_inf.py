"""NaN/Inf in the loss or the global grad norm, and a loss the log left out of a logged step's line."""

from __future__ import annotations

import math

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector


class NanInfDetector(StepDetector):
    """Flags steps whose loss or grad norm is NaN or ±Inf, or whose loss the log left out; one anomaly per
    consecutive run of them.

    * A non-finite **loss** is ``critical`` (the weights are likely corrupted from here on).
    * A **missing loss** (``StepAggregate.loss_missing``: the log printed the step's line, learning rate, grad
      norm and counters included, without its loss, and no skipped iteration accounts for it) is ``critical``
      too: Megatron-LM prints a loss only when its average over the interval is a number >= 0
      (``megatron/training/training.py``, ``training_log``), so a NaN or infinite loss on an applied iteration
      is simply absent, while the line's ``number of nan iterations`` (which counts skipped iterations only)
      and ``number of skipped iterations`` both say 0. The message says the loss is missing from the line.
    * A non-finite **grad norm** with a finite loss is ``warning``: with fp16 dynamic loss scaling it is the
      usual overflow, and the optimizer skips that step (Micikevicius et al., 2018). When the step is marked
      ``skipped`` the overflow was handled and it is not reported here: runs of skipped steps are
      :class:`~trainhealth.detectors.skipped_steps.SkippedStepsDetector`'s. It turns ``critical`` when it is
      non-finite on ``persist_points`` logged points in a row none of which the optimizer skipped: the update
      applied is then NaN (or the scaler skips without saying so, and nothing trains). Two in a row can still
      be the scaler's hysteresis (DeepSpeed and Megatron-LM lower the loss scale after 2 overflows), a third
      cannot (``defaults.NAN_GRAD_NORM_POINTS``, the reasoning of ``SKIPPED_STEPS_MIN``). While the loss
      scale calibrates at the start of a generation — no finite grad norm seen yet, fewer than
      ``calibration_steps`` steps since its first (``SKIPPED_STEPS_INITIAL``, halving from 2^32) — a run stays
      a warning, unless the loss on those points is frozen at one exact value (a calibrating run's loss
      moves from batch to batch; one that does not move with a NaN grad norm is not training).

    Parameters
    ----------
    persist_points : int
        Consecutive logged points with a non-finite grad norm, none skipped, that make it critical.
    calibration_steps : int
        Steps from a generation's first during which, before any finite grad norm, a run is the loss scaler
        calibrating (warning).

    Evidence: ``loss``, ``grad_norm`` (as strings ``nan``/``inf`` when non-finite), ``steps`` (non-finite
    steps so far in this run of them), ``loss_missing`` (steps of the run whose line left the loss out),
    ``reason`` (``loss``, ``loss_missing``, ``grad_norm``, or ``grad_norm_persistent`` once a grad-norm run is
    critical), ``history_points`` (logged points of the generation before the onset: how much the log showed
    of the run before it).

    Examples
    --------
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> def agg(step, loss, gn=1.0):
    ...     bad = () if math.isfinite(loss) and math.isfinite(gn) else (0,)
    ...     return StepAggregate(step, 0, 0.0, None, float(step), loss, gn, None, None, None, 1, (None,), 0.0, bad)
    >>> det = NanInfDetector()
    >>> stream = [2.1, 2.0, float("nan"), float("nan"), 1.9]
    >>> for s, x in enumerate(stream):
    ...     for a in det.update(agg(s, x)):
    ...         print(a.kind, a.severity, a.status, a.step, a.end_step, a.evidence["steps"])
    nan_inf critical active 2 None 1
    nan_inf critical active 2 None 2
    nan_inf critical resolved 2 3 2
    >>> det = NanInfDetector()  # grad norm NaN on every point from step 40, nothing skipped: the updates are NaN
    >>> for s in range(0, 60, 5):
    ...     for a in det.update(agg(s, 2.0 - s / 100, float("nan") if s >= 40 else 1.0)):
    ...         print(a.severity, a.step, a.evidence["steps"], a.evidence["reason"])
    warning 40 1 grad_norm
    warning 40 2 grad_norm
    critical 40 3 grad_norm_persistent
    >>> [(a.severity, a.evidence["steps"]) for a in det.unsaid()]  # grown since; said again at 6, or at the end
    [('critical', 4)]

    References
    ----------
    P. Micikevicius et al., "Mixed Precision Training", ICLR 2018 (loss scaling skips steps whose gradients
    overflow); NVIDIA Megatron-LM, ``megatron/training/training.py`` ``training_log`` (a loss key is printed
    only ``if avg >= 0.0``; ``nan iterations`` counts skipped iterations with a non-finite loss).
    """

    KIND = "nan_inf"

    def __init__(self, persist_points: int = defaults.NAN_GRAD_NORM_POINTS,
                 calibration_steps: int = defaults.SKIPPED_STEPS_INITIAL) -> None:
        self.persist_points = persist_points
        self.calibration_steps = calibration_steps
        self._open: Anomaly | None = None
        self._last_bad_step = 0
        self._gen: int | None = None
        self._gen_first = 0  # first step of the current generation
        self._points = 0  # logged points of the generation so far
        self._finite_gn = False  # a finite grad norm was seen in this generation
        self._gn_run = 0  # consecutive points with a non-finite grad norm, none skipped
        self._losses: set[float] = set()  # the finite losses of the points of the current run
        self._loss_points = 0  # points of the current run with a finite loss
        self._missing = 0
        self._said = 0  # steps of the open anomaly when its state was last returned

    def unsaid(self) -> list[Anomaly]:
        """The open anomaly as it stands, when it grew since it was last returned (it stays open)."""
        if self._open is not None and self._open.evidence["steps"] != self._said:
            self._said = self._open.evidence["steps"]
            return [self._open]
        return []

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed (opened, grown, escalated or resolved)."""
        if agg.gen != self._gen:
            self._gen, self._gen_first, self._points, self._finite_gn = agg.gen, agg.step, 0, False
        self._points += 1
        loss, gn = agg.loss, agg.grad_norm
        loss_bad = loss is not None and not math.isfinite(loss)
        # The log printed the step without its loss and no skip explains it: not finite (Megatron-LM).
        missing = agg.loss_missing and not agg.skipped and not loss_bad
        # A non-finite grad norm on a step the optimizer skipped is the fp16 overflow doing its job: runs of
        # those are SkippedStepsDetector's. One on an applied step (or when the log cannot tell) is reported.
        gn_bad = gn is not None and not math.isfinite(gn) and not agg.skipped
        if gn is not None and math.isfinite(gn):
            self._finite_gn = True
        cur = self._open
        if not (loss_bad or missing or gn_bad):
            self._gn_run, self._losses, self._loss_points = 0, set(), 0
            if cur is None:
                return []
            self._open = None
            done = Anomaly(**{**_fields(cur), "status": RESOLVED, "end_step": self._last_bad_step})
            self._said = 0
            return [done]
        self._last_bad_step = agg.step
        if cur is None:
            self._gn_run, self._losses, self._loss_points, self._missing = 0, set(), 0, 0
            history = self._points - 1
        else:
            history = cur.evidence["history_points"]
        self._missing += missing
        if gn_bad:
            self._gn_run += 1
            if loss is not None and math.isfinite(loss):
                self._losses.add(loss)
                self._loss_points += 1
        else:
            self._gn_run, self._losses, self._loss_points = 0, set(), 0
        persistent = False
        if self._gn_run >= self.persist_points:
            calibrating = not self._finite_gn and agg.step - self._gen_first < self.calibration_steps
            frozen = len(self._losses) == 1 and self._loss_points >= self.persist_points
            persistent = not calibrating or frozen
        was_critical = cur is not None and cur.severity == "critical"
        critical = loss_bad or missing or persistent or was_critical
        n = 1 if cur is None else cur.evidence["steps"] + 1
        onset = agg.step if cur is None else cur.step
        since = f" ({n} non-finite steps since {onset})" if n > 1 else ""
        if loss_bad:
            reason = "loss"
            msg = (f"loss is {loss} at step {agg.step}{since}; check the data and learning rate, roll back if it "
                   f"persists")
        elif missing:
            reason = "loss_missing"
            msg = (f"the loss is missing from the log line of step {agg.step}{since}, which prints the learning "
                   f"rate, grad norm and counters: Megatron-LM leaves out a loss that is not finite (its nan and "
                   f"skipped counters do not count this); treat it as a NaN loss, roll back if it persists")
        elif persistent:
            reason = "grad_norm_persistent"
            msg = (f"grad norm is {gn} at step {agg.step}{since}, on {self._gn_run} logged points in a row that the "
                   f"optimizer did not skip: the updates are NaN (or the loss scaler skips every step), nothing "
                   f"is training; roll back and check the data, the learning rate and the loss scale")
        else:
            reason = cur.evidence["reason"] if was_critical else "grad_norm"
            msg = (f"grad norm is {gn} at step {agg.step}{since}; an fp16 overflow skips the step, many in a row "
                   f"are not normal")
        ranks = tuple(sorted(set(agg.bad_ranks) | (set(cur.ranks) if cur else set())))
        new = Anomaly(
            kind=self.KIND, severity="critical" if critical else "warning", step=onset, message=msg, ranks=ranks,
            gen=agg.gen, scope="*",
            evidence={"loss": _num(loss), "grad_norm": _num(gn), "steps": n, "loss_missing": self._missing,
                      "reason": reason, "history_points": history},
        )
        self._open = new
        # Said when it opens, escalates, changes reason or ranks, and as it doubles: a NaN run of 10,000 steps is 14
        # updates, not 10,000 (the resolved state carries the whole count).
        if (cur is None or new.severity != cur.severity or reason != cur.evidence["reason"] or ranks != cur.ranks
                or n >= 2 * self._said):
            self._said = n
            return [new]
        return []


def _num(x: float | None) -> float | str | None:
    return x if x is None or math.isfinite(x) else str(x)


def _fields(a: Anomaly) -> dict:
    return {f: getattr(a, f) for f in a.__dataclass_fields__}
