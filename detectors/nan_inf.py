"""NaN/Inf in the loss or the global grad norm."""

from __future__ import annotations

import math

from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector


class NanInfDetector(StepDetector):
    """Flags steps whose loss or grad norm is NaN or ±Inf; one anomaly per consecutive run of them.

    A non-finite **loss** is ``critical`` (the weights are likely corrupted from here on).
    A non-finite **grad norm** with a finite loss is ``warning``: with fp16 dynamic loss
    scaling it is the usual overflow, and the optimizer skips that step (Micikevicius et
    al., 2018); many in a row are not usual and keep the anomaly open. When the step is
    marked ``skipped`` the overflow was handled and it is not reported here: runs of skipped
    steps are :class:`~trainhealth.detectors.skipped_steps.SkippedStepsDetector`'s.

    Evidence: ``loss``, ``grad_norm`` (as strings ``nan``/``inf`` when non-finite),
    ``steps`` (non-finite steps so far in this run of them).

    Examples
    --------
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> def agg(step, loss):
    ...     return StepAggregate(step, 0, 0.0, None, float(step), loss, 1.0, None, None, None, 1, (None,), 0.0,
    ...                          () if math.isfinite(loss) else (0,))
    >>> det = NanInfDetector()
    >>> stream = [2.1, 2.0, float("nan"), float("nan"), 1.9]
    >>> for s, x in enumerate(stream):
    ...     for a in det.update(agg(s, x)):
    ...         print(a.kind, a.severity, a.status, a.step, a.end_step, a.evidence["steps"])
    nan_inf critical active 2 None 1
    nan_inf critical active 2 None 2
    nan_inf critical resolved 2 3 2

    References
    ----------
    P. Micikevicius et al., "Mixed Precision Training", ICLR 2018 (loss scaling skips
    steps whose gradients overflow).
    """

    def __init__(self) -> None:
        self._open: Anomaly | None = None
        self._last_bad_step = 0

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed (opened, grown or resolved)."""
        loss_bad = agg.loss is not None and not math.isfinite(agg.loss)
        # A non-finite grad norm on a step the optimizer skipped is the fp16 overflow doing its job: runs of
        # those are SkippedStepsDetector's. One on an applied step (or when the log cannot tell) is reported.
        gn_bad = agg.grad_norm is not None and not math.isfinite(agg.grad_norm) and not agg.skipped
        cur = self._open
        if not (loss_bad or gn_bad):
            if cur is None:
                return []
            self._open = None
            done = Anomaly(**{**_fields(cur), "status": RESOLVED, "end_step": self._last_bad_step})
            return [done]
        self._last_bad_step = agg.step
        severity = "critical" if loss_bad or (cur is not None and cur.severity == "critical") else "warning"
        n = 1 if cur is None else cur.evidence["steps"] + 1
        what = "loss" if loss_bad else "grad norm"
        onset = agg.step if cur is None else cur.step
        msg = (f"{what} is {agg.loss if loss_bad else agg.grad_norm} at step {agg.step}"
               + (f" ({n} non-finite steps since {onset})" if n > 1 else "")
               + ("; check the data and learning rate, roll back if it persists" if loss_bad
                  else "; an fp16 overflow skips the step, many in a row are not normal"))
        ranks = tuple(sorted(set(agg.bad_ranks) | (set(cur.ranks) if cur else set())))
        self._open = Anomaly(
            kind="nan_inf", severity=severity, step=onset, message=msg, ranks=ranks, gen=agg.gen,
            evidence={"loss": _num(agg.loss), "grad_norm": _num(agg.grad_norm), "steps": n},
            scope="*",
        )
        return [self._open]


def _num(x: float | None) -> float | str | None:
    return x if x is None or math.isfinite(x) else str(x)


def _fields(a: Anomaly) -> dict:
    return {f: getattr(a, f) for f in a.__dataclass_fields__}
