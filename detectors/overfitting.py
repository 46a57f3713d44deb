"""Over-fitting: an eval loss rising while the training loss falls."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import replace
from itertools import pairwise

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector


class OverfittingDetector(StepDetector):
    """The eval loss of a held-out set rises while the training loss falls. One ``overfitting`` anomaly (warning) per
    episode for the run, naming the eval sets that over-fit.

    Fed the training steps (:meth:`update`: the training loss) and each evaluation (:meth:`evaluate`: an ``eval``
    event's set name and loss). Per eval set, at each evaluation ``t``: Prechelt's *generalization loss*
    ``GL(t) = 100 (E_va(t) / E_opt(t) - 1)``, the per cent the eval loss stands above the lowest it has been
    (``E_opt``), and his *UP* criterion, the eval loss higher than at the evaluation before at each of the last
    ``rises`` evaluations. A set over-fits when ``GL(t) > gl_pct``, it rose at each of the last ``rises``
    evaluations, **and** the training loss fell over the same evaluations: the median of its last ``train_points``
    logged points now is below that median when the first of those evaluations came. An eval loss rising with the
    training loss is a failing run (a learning rate too high), not over-fitting; one that rises once and falls back
    is noise. Non-finite eval losses are left out (a NaN training loss is ``nan_inf``'s).

    The anomaly opens at the evaluation where a set first over-fits (its ``step``), is updated when another set
    starts to over-fit or the largest GL doubles (its latest state at the end: :meth:`unsaid`), and is resolved when
    every set that over-fitted is back within ``gl_pct`` of its best (a new best, or training resumed from the best
    checkpoint: a rollback before its best forgets the later evaluations). Severity ``warning``: the steps after the
    best evaluation spend compute making the model worse on held-out data, and the job keeps running.

    Parameters
    ----------
    gl_pct : float
        Generalization loss above which a set may over-fit, per cent of its best eval loss.
    rises : int
        Evaluations in a row at which the eval loss must have risen (and over which the training loss must fall).
    train_points : int
        Logged training losses whose median is the training loss at an evaluation.

    Evidence: ``name`` (the eval set that decided), ``eval_loss``, ``best_eval_loss``, ``best_step``, ``gl_pct`` (its
    generalization loss, %), ``threshold_pct``, ``rises``, ``rise_from_step`` (the evaluation the rise is counted
    from), ``train_before``, ``train_after`` (training-loss medians then and now), ``sets`` (every set over-fitting:
    name -> its GL, %), ``evals`` (evaluations of the deciding set so far).

    Examples
    --------
    The training loss falls every step; the eval loss (every 100 steps) reaches 2.0 at step 300, bumps to 2.15 at 400
    (7.5 % above its best, once: noise), then rises at 600 and 700:

    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> det, found = OverfittingDetector(), []
    >>> evals = {100: 2.6, 200: 2.2, 300: 2.0, 400: 2.15, 500: 2.05, 600: 2.2, 700: 2.4}
    >>> for step in range(1, 701):
    ...     _ = det.update(StepAggregate(step, 0, 0.0, None, float(step), 3.0 - step / 400, None, None, None, None, 1,
    ...                                  (None,), 0.0))
    ...     if step in evals:
    ...         found += det.evaluate(step, "eval", evals[step], gen=0)
    >>> [(a.kind, a.severity, a.step, a.evidence["best_step"], round(a.evidence["gl_pct"], 2)) for a in found]
    [('overfitting', 'warning', 700, 300, 20.0)]
    >>> round(found[0].evidence["train_before"], 4), round(found[0].evidence["train_after"], 4)
    (1.7525, 1.2525)

    References
    ----------
    L. Prechelt, "Early Stopping — But When?", in G. B. Orr and K.-R. Müller (eds.), Neural Networks: Tricks of the
    Trade, LNCS 1524, Springer (1998), pp. 55-69 (the generalization loss GL and the UP_s criterion; GL_5 is the
    slowest GL criterion he compares). The threshold and the ``rises`` were chosen on two real logs and reported on
    others (docs/anomalies.md).
    """

    KIND = "overfitting"

    def __init__(self, gl_pct: float = defaults.OVERFIT_GL_PCT, rises: int = defaults.OVERFIT_RISES,
                 train_points: int = defaults.OVERFIT_TRAIN_POINTS) -> None:
        self.gl_pct = gl_pct
        self.rises = rises
        self.train_points = train_points
        self._reset()

    def _reset(self) -> None:
        # The newest training losses: (step, loss).
        self._train: deque[tuple[int, float]] = deque(maxlen=self.train_points)
        # Per eval set: its evaluations in step order, (step, eval loss, training-loss median then or None).
        self._evals: dict[str, list[tuple[int, float, float | None]]] = {}
        self._flagged: dict[str, float] = {}  # sets that over-fitted in the open episode -> their latest GL (%)
        self._open: Anomaly | None = None
        self._said: Anomaly | None = None  # the open anomaly's state last returned
        self._prev_step: int | None = None

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step (its training loss); a step back (a rollback or restart) forgets what came after it."""
        out: list[Anomaly] = []
        if self._prev_step is not None and agg.step <= self._prev_step:
            out += self._rewind(agg.step)
        self._prev_step = agg.step
        if agg.loss is not None and math.isfinite(agg.loss):
            self._train.append((agg.step, agg.loss))
        return out

    def _rewind(self, step: int) -> list[Anomaly]:
        while self._train and self._train[-1][0] >= step:
            self._train.pop()
        for hist in self._evals.values():
            while hist and hist[-1][0] > step:
                hist.pop()
        return self._settle(step, "training rolled back")

    def evaluate(self, step: int, name: str, loss: float, gen: int) -> list[Anomaly]:
        """Feed one evaluation of set ``name`` after ``step`` (loss as logged); return the anomaly states it changed.

        Raises
        ------
        ValueError
            When ``name`` is empty.
        """
        if not name:
            raise ValueError(f"eval set name is {name!r}: give the set a name ('eval')")
        if not math.isfinite(loss):
            return []
        train = statistics.median(x for _, x in self._train) if self._train else None
        hist = self._evals.setdefault(name, [])
        hist.append((step, loss, train))
        best_step, best, _ = min(hist, key=lambda e: e[1])
        gl = 100.0 * (loss / best - 1.0) if best > 0 else 0.0
        if name in self._flagged:
            self._flagged[name] = gl
        recent = hist[-self.rises - 1:]
        rising = len(recent) == self.rises + 1 and all(b[1] > a[1] for a, b in pairwise(recent))
        before = recent[0][2]
        fell = rising and train is not None and before is not None and train < before
        if gl > self.gl_pct and fell:
            self._flagged[name] = gl
            ev = {"name": name, "eval_loss": loss, "best_eval_loss": best, "best_step": best_step, "gl_pct": gl,
                  "threshold_pct": self.gl_pct, "rises": self.rises, "rise_from_step": recent[0][0],
                  "train_before": before, "train_after": train,
                  "sets": dict(sorted(self._flagged.items())), "evals": len(hist)}
            msg = self._message(ev)
            if self._open is None:
                self._open = Anomaly(kind=self.KIND, severity="warning", step=step, gen=gen, evidence=ev, message=msg)
                return self._say()
            said = self._said.evidence if self._said is not None else ev
            self._open = replace(self._open, evidence=ev, message=msg)
            # Said again when another set joins or the worst GL doubled, not at every evaluation (six sets a
            # epoch would write six transitions); the latest state is in unsaid() at the end.
            if set(ev["sets"]) != set(said["sets"]) or max(ev["sets"].values()) >= 2 * max(said["sets"].values()):
                return self._say()
            return []
        return self._settle(step, f"eval loss back within {self.gl_pct:g} % of its best")

    def _say(self) -> list[Anomaly]:
        self._said = self._open
        return [self._open] if self._open is not None else []

    def unsaid(self) -> list[Anomaly]:
        """The open anomaly's latest state when it changed since it was last returned."""
        return self._say() if self._open is not None and self._open is not self._said else []

    def _settle(self, step: int, why: str) -> list[Anomaly]:
        """Resolve the open anomaly when every set that over-fitted is back within ``gl_pct`` of its best."""
        cur = self._open
        if cur is None:
            return []
        for name in list(self._flagged):
            hist = self._evals.get(name)
            if hist:
                best = min(e[1] for e in hist)
                self._flagged[name] = 100.0 * (hist[-1][1] / best - 1.0) if best > 0 else 0.0
            else:
                self._flagged[name] = 0.0
        if any(gl > self.gl_pct for gl in self._flagged.values()):
            return []
        self._open, self._said, self._flagged = None, None, {}
        return [replace(cur, status=RESOLVED, end_step=step, message=cur.message.split(";")[0] + f"; {why}")]

    def _message(self, ev: dict) -> str:
        others = [n for n in ev["sets"] if n != ev["name"]]
        also = f" (also {', '.join(others)})" if others else ""
        return (f"eval loss on '{ev['name']}'{also} is {ev['gl_pct']:.1f} % above its best "
                f"({ev['best_eval_loss']:.4g} at step {ev['best_step']}) at {ev['eval_loss']:.4g}, rising at each of "
                f"the last {ev['rises']} evaluations while the training loss fell {ev['train_before']:.4g} -> "
                f"{ev['train_after']:.4g}: the model is over-fitting; the best checkpoint is the one near step "
                f"{ev['best_step']}: stop early, or add data or regularisation")
