"""Loss collapse: the loss frozen at one exact value (0 included) on several logged points in a row."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.text import plural


class LossCollapseDetector(StepDetector):
    """A loss that stopped moving: bit-identical on consecutive logged points. One ``loss_collapse`` anomaly
    (critical) per run of them.

    A training loss is a mean over a fresh batch: it changes from one logged point to the next, by more than
    the log's printed precision on any run that learns or even just sees new data. When it prints the very same
    value point after point — most often exactly 0 (every label masked, a loss detached from the weights, a
    broken data pipeline feeding nothing) — training produces no learning signal, and every step from there on
    is lost compute (the badput is the whole rest of the run: critical).

    How many equal points are enough depends on how often this log repeats a value by chance: a loss printed
    to 2 decimals repeats often near a plateau, one printed to 6 almost never. The repeat rate ``p`` is
    estimated on the transitions between the last ``history`` logged points before the run (Laplace's rule,
    ``(repeats + 1) / (transitions + 2)``: 1/2 with no history), and a run of ``n`` equal points opens once
    ``p ** (n - 1) < risk`` (the chance that this log's own rounding made ``n - 1`` repeats in a row), and
    ``n >= min_points``. Near-zero but moving losses (a model memorising its data: two equal pairs among 30
    points, ``hf_overfit_30epochs``) and a loss falling by the last digits at the start (Megatron BERT
    10.5182, 10.5175, …) are not runs. With the grad norm NaN/Inf on every point of the run and the optimizer
    not reported skipping, ``min_points`` suffice whatever the history (a short excerpt): the update is NaN
    and the loss does not move, two independent signs that nothing trains.

    The anomaly is updated at each further frozen point and resolves at the first different finite loss
    (``end_step`` = the last frozen point); a NaN loss ends the run too (it is
    :class:`~trainhealth.detectors.nan_inf.NanInfDetector`'s).

    Parameters
    ----------
    min_points : int
        Fewest equal logged points in a row that can be a collapse (2 equal values in a row happen on real logs:
        hf_overfit_30epochs, LLaMA-Factory Mistral, T5, modded-nanogpt, llm.c; a third never does there).
    risk : float
        Largest chance of the run by this log's own repeat rate, per logged point (``defaults.LOSS_COLLAPSE_RISK``,
        1e-6: a critical finding spends a hundredth of the spike detectors' 1e-4 budget).
    history : int
        Logged points before the run whose transitions estimate the repeat rate.

    Evidence: ``value`` (the frozen loss), ``points`` (logged points in the run), ``first_step``, ``last_step``,
    ``grad_norm_nonfinite`` (points of the run whose grad norm is NaN/Inf), ``grad_norm_logged`` (points of the
    run with a grad norm), ``lr_min``/``lr_max`` (the learning rate over the run, None when not logged),
    ``repeat_rate`` (``p``), ``chance`` (``p ** (n - 1)``), ``history_points`` (logged points before the run:
    how much of the log backed ``p``).

    Examples
    --------
    >>> import random
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> rng = random.Random(3)
    >>> det, states = LossCollapseDetector(), []
    >>> for step in range(200):
    ...     loss = 0.0 if 150 <= step < 160 else round(2.0 * math.exp(-step / 300) + rng.gauss(0, 0.02), 4)
    ...     states += det.update(StepAggregate(step, 0, 0.0, None, float(step), loss, 1.0, 1e-4, None, None, 1,
    ...                                        (None,), 0.0))
    >>> for an in (states[0], states[-1]):  # opened at the 4th equal point, grown at each further one, resolved
    ...     print(an.kind, an.severity, an.status, an.step, an.end_step, an.evidence["points"],
    ...           f"{an.evidence['repeat_rate']:.4f} {an.evidence['chance']:.1e}")
    loss_collapse critical active 150 None 4 0.0066 2.8e-07
    loss_collapse critical resolved 150 159 10 0.0066 2.3e-20

    References
    ----------
    P. S. Laplace, "Essai philosophique sur les probabilités" (1814) (the rule of succession); Hugging Face
    Transformers ``Trainer`` (logs the loss rounded to 4 decimals: a value's precision is the log's);
    Time-MoE issue 31 (loss 0.0 with grad norm NaN on every logged line, the real case in
    ``shared/real_logs/hf_stdout_loss_zero_gradnorm_nan.log``).
    """

    KIND = "loss_collapse"

    def __init__(self, min_points: int = defaults.LOSS_COLLAPSE_MIN_POINTS,
                 risk: float = defaults.LOSS_COLLAPSE_RISK,
                 history: int = defaults.LOSS_COLLAPSE_HISTORY_POINTS) -> None:
        self.min_points = min_points
        self.risk = risk
        self.history = history
        # Transitions between consecutive logged points before the current run: True = the same value repeated.
        self._repeats: deque[bool] = deque(maxlen=max(history - 1, 0))
        self._seen = 0  # logged points with a finite loss so far (for history_points)
        self._run: dict | None = None  # the current run of equal values
        self._open: Anomaly | None = None
        self._said = 0  # points of the open collapse when its state was last returned
        self._prev_step: int | None = None

    def _rate(self) -> float:
        r = self._repeats
        return (sum(r) + 1) / (len(r) + 2)

    def _end_run(self, changed: bool) -> list[Anomaly]:
        """The run ends (``changed``: at a different finite value, which is a transition to count)."""
        run, out = self._run, []
        self._run = None
        if run is None:
            return out
        if self._open is not None:
            cur, self._open = self._open, None
            p = cur.evidence["repeat_rate"]
            ev = _evidence(run, p, p ** (run["n"] - 1))
            out.append(replace(cur, status=RESOLVED, end_step=run["last"], evidence=ev,
                               message=_message(run, ev) + f"; it moved again after step {run['last']}"))
        else:  # an ordinary run (a pair): this log's own rate of repeats
            self._repeats.extend([True] * (run["n"] - 1))
            if changed:
                self._repeats.append(False)
        return out

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed (opened, grown, resolved)."""
        out: list[Anomaly] = []
        if self._prev_step is not None and agg.step <= self._prev_step:
            out += self._end_run(changed=False)  # a rollback or restart: the timeline starts again
        self._prev_step = agg.step
        x = agg.loss
        if x is None:
            return out
        if not math.isfinite(x):
            return out + self._end_run(changed=False)
        run = self._run
        if run is not None and x == run["value"]:
            run["n"] += 1
            run["last"] = agg.step
        else:
            out += self._end_run(changed=run is not None)
            run = self._run = {"value": x, "first": agg.step, "last": agg.step, "n": 1, "gn_bad": 0, "gn": 0,
                               "lr": [], "history": self._seen, "gen": agg.gen}
        self._seen += 1
        gn = agg.grad_norm
        if gn is not None:
            run["gn"] += 1
            run["gn_bad"] += not math.isfinite(gn) and not agg.skipped
        if agg.lr is not None and math.isfinite(agg.lr):
            run["lr"].append(agg.lr)
        n = run["n"]
        if n < self.min_points:
            return out
        p = self._rate()
        chance = p ** (n - 1)
        if self._open is None:
            if run["gn_bad"] < n and chance >= self.risk:
                return out
            ev = _evidence(run, p, chance)
            self._open = Anomaly(kind=self.KIND, severity="critical", step=run["first"], gen=run["gen"],
                                 evidence=ev, message=_message(run, ev) + _advice(run))
            self._said = n
            return [*out, self._open]
        p = self._open.evidence["repeat_rate"]  # the rate the decision used (the history is not updated)
        ev = _evidence(run, p, p ** (n - 1))
        self._open = replace(self._open, evidence=ev, message=_message(run, ev) + _advice(run))
        if n >= 2 * self._said:  # said again as it doubles, not at every point (the end says the rest)
            self._said = n
            return [*out, self._open]
        return out

    def unsaid(self) -> list[Anomaly]:
        """The open collapse as it stands, when it grew since it was last returned (it stays open)."""
        if self._open is not None and self._open.evidence["points"] != self._said:
            self._said = self._open.evidence["points"]
            return [self._open]
        return []


def _evidence(run: dict, p: float, chance: float) -> dict:
    lrs = run["lr"]
    return {"value": run["value"], "points": run["n"], "first_step": run["first"], "last_step": run["last"],
            "grad_norm_nonfinite": run["gn_bad"], "grad_norm_logged": run["gn"],
            "lr_min": min(lrs) if lrs else None, "lr_max": max(lrs) if lrs else None,
            "repeat_rate": p, "chance": chance, "history_points": run["history"]}


def _message(run: dict, ev: dict) -> str:
    v = run["value"]
    what = "exactly 0" if v == 0 else f"frozen at exactly {v!r}"
    span = f"steps {run['first']}-{run['last']}" if run["last"] != run["first"] else f"step {run['first']}"
    gn = ""
    if ev["grad_norm_nonfinite"] == run["n"]:
        gn = ", with the grad norm NaN/Inf on every one of them"
    elif ev["grad_norm_nonfinite"]:
        gn = f", the grad norm NaN/Inf on {ev['grad_norm_nonfinite']} of them"
    lr = ""
    if ev["lr_min"] is not None and ev["lr_min"] == ev["lr_max"]:
        lr = f" at a constant learning rate {ev['lr_min']:.3g}"
    return f"loss is {what} on {plural(run['n'], 'logged point')} in a row ({span}){gn}{lr}"


def _advice(run: dict) -> str:
    cause = ("every label masked, or a loss detached from the model" if run["value"] == 0
             else "a loss detached from the model, or a data loader repeating one batch")
    return (f": the run is not learning ({cause}); check the labels, the loss and the data, then restart from a "
            f"checkpoint before step {run['first']}")
