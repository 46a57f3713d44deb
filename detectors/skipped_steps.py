"""Runs of skipped optimizer steps (fp16 loss-scale overflow)."""

from __future__ import annotations

from dataclasses import replace

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.throughput import step_seconds
from trainhealth.text import fmt_duration


class SkippedStepsDetector(StepDetector):
    """One ``skipped_steps`` anomaly per run of consecutive skipped optimizer steps of ``min_steps`` or more.

    With fp16 dynamic loss scaling an overflowing step is skipped and the loss scale lowered; DeepSpeed
    and Megatron-LM lower it only after ``hysteresis`` (default 2) consecutive overflows, so one or two
    skips in a row are the scaler working. ``min_steps`` in a row mean lowering the scale did not stop
    the overflow: the gradients are growing. At the start of a generation, before any step has been
    applied, the scaler calibrates its initial scale by halving once per overflow; up to ``initial``
    skips are normal then (more: no scale works). Steps are counted as logged: consecutive aggregates
    with ``skipped`` set (a sparse log's point counts once, whatever the steps since the previous one).

    The anomaly opens (``warning``) when the run reaches the threshold and then covers the whole
    episode: further skips extend it even after a few applied steps (a burst where a third to a half
    of the steps overflow is one condition, not one anomaly per run of three), and it is updated when
    its count of skipped steps doubles. It resolves after ``quiet_steps`` applied steps in a row
    (``end_step`` = the last skipped step); a restart or rollback ends it too.

    Fewer skips in a row (one or two, after a step was applied) are the scaler doing its job, and cost
    one or two steps' time: an ``info`` point event (created resolved, like a slow step) when the next
    applied step ends them. Later short runs before ``quiet_steps`` applied steps in a row have passed
    update that same anomaly (its ``steps`` and ``end_step``), so a scaler that overflows now and then is
    one line, not a stream. Not during calibration (before the first applied step of a generation).

    Parameters
    ----------
    min_steps : int
        Consecutive skipped steps that make an anomaly once a step has been applied.
    initial : int
        Consecutive skipped steps tolerated before the first applied step of a generation.
    quiet_steps : int
        Applied steps in a row that end an episode, warning or info (a judgement: ten times the scalers'
        hysteresis of 2).

    Evidence: ``steps`` (skipped so far in the run), ``first_step``, ``last_step``, ``calibrating``
    (no step applied yet in this generation); on an ``info`` one also ``lost_s`` (the skipped steps' own
    seconds, when they were timed: the badput they caused).

    Examples
    --------
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> def agg(step, skipped):
    ...     return StepAggregate(step, 0, 0.0, None, float(step), 2.0, 1.0, None, None, None, 1, (None,), 0.0,
    ...                          skipped=skipped)
    >>> det = SkippedStepsDetector()
    >>> skipped = {0, 1, 2, 3, 40, 41, 70, 71, 72, 73}  # calibration at the start, a pair, then a run of 4
    >>> for step in range(100):
    ...     for a in det.update(agg(step, step in skipped)):
    ...         print(a.kind, a.severity, a.status, a.step, a.end_step, a.evidence["steps"])
    skipped_steps info resolved 40 41 2
    skipped_steps warning active 70 None 3
    skipped_steps warning resolved 70 73 4

    One overflow now and then (the loss scaler probing a higher scale) is one ``info`` line per cluster:

    >>> det = SkippedStepsDetector()
    >>> for step in range(300):
    ...     for a in det.update(agg(step, step in {100, 110, 250})):
    ...         print(a.kind, a.severity, a.status, a.step, a.end_step, a.evidence["steps"])
    skipped_steps info resolved 100 100 1
    skipped_steps info resolved 100 110 2
    skipped_steps info resolved 250 250 1

    A burst with applied steps in between is one anomaly:

    >>> det = SkippedStepsDetector()
    >>> burst = {100, 101, 102, 104, 105, 107, 110, 111, 112, 113, 120}
    >>> for step in range(200):
    ...     for a in det.update(agg(step, step in burst)):
    ...         print(a.kind, a.severity, a.status, a.step, a.end_step, a.evidence["steps"])
    skipped_steps warning active 100 None 3
    skipped_steps warning active 100 None 6
    skipped_steps warning resolved 100 120 11

    References
    ----------
    P. Micikevicius et al., "Mixed Precision Training", ICLR 2018 (dynamic loss scaling skips overflowing
    steps); DeepSpeed fp16 config (``hysteresis``, default 2; ``initial_scale_power``); Megatron-LM
    ``--hysteresis`` (default 2) and ``--initial-loss-scale`` (default 2**32).
    """

    KIND = "skipped_steps"

    def __init__(self, min_steps: int = defaults.SKIPPED_STEPS_MIN,
                 initial: int = defaults.SKIPPED_STEPS_INITIAL,
                 quiet_steps: int = defaults.SKIPPED_STEPS_QUIET) -> None:
        self.min_steps = min_steps
        self.initial = initial
        self.quiet_steps = quiet_steps
        self._streak: tuple[int, int, int] | None = None  # the current run of consecutive skips
        self._quiet = 0  # applied steps in a row since the open episode's last skip
        self._gen: int | None = None
        self._applied = False
        self._run: tuple[int, int, int] | None = None  # first step, last step, count
        self._open: Anomaly | None = None
        self._reported = 0
        self._prev_step: int | None = None
        self._info: Anomaly | None = None  # the info episode of short runs, until quiet_steps applied steps
        self._info_quiet = 0
        self._streak_s = 0.0  # seconds of the current streak's timed steps

    def _close(self) -> list[Anomaly]:
        cur, run = self._open, self._run
        self._open, self._run = None, None
        if cur is None:
            return []
        first, last, n = run
        return [replace(cur, status=RESOLVED, end_step=last,
                        evidence={**cur.evidence, "steps": n, "last_step": last},
                        message=_message(first, last, n, cur.evidence["calibrating"], done=True))]

    def _short(self, gen: int) -> Anomaly:
        """The info episode with the short run that just ended: created, or updated with it."""
        first, last, n = self._streak
        prev = self._info
        if prev is not None:
            start, total = prev.step, prev.evidence["steps"] + n
            runs, lost = prev.evidence["runs"] + 1, prev.evidence["lost_s"] + self._streak_s
        else:
            start, total, runs, lost = first, n, 1, self._streak_s
        self._info = Anomaly(kind=self.KIND, severity="info", step=start, end_step=last, status=RESOLVED, gen=gen,
                             message=_short_message(start, last, total, runs, lost),
                             evidence={"steps": total, "first_step": start, "last_step": last, "runs": runs,
                                       "calibrating": False, "lost_s": round(lost, 6)})
        return self._info

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed (opened, grown, resolved)."""
        out: list[Anomaly] = []
        if agg.gen != self._gen or (self._prev_step is not None and agg.step <= self._prev_step):
            out += self._close()  # a restart or rollback ends the episode; a new generation calibrates again
            self._streak = None
            if agg.gen != self._gen:
                self._gen, self._applied, self._info = agg.gen, False, None
        self._prev_step = agg.step
        if not agg.skipped:
            if self._streak is not None and self._applied and self._open is None:
                out.append(self._short(agg.gen))  # one or two skips after applied steps: the scaler at work
            self._streak, self._applied = None, True
            if self._info is not None:
                self._info_quiet += 1
                if self._info_quiet >= self.quiet_steps:
                    self._info = None
            if self._open is not None:
                self._quiet += 1
                if self._quiet >= self.quiet_steps:
                    out += self._close()
            return out
        self._info_quiet = 0
        if self._open is not None:  # the open episode goes on
            first, _, n = self._run
            self._run, self._quiet = (first, agg.step, n + 1), 0
            if n + 1 >= 2 * self._reported:
                self._reported = n + 1
                self._open = replace(self._open, message=_message(first, agg.step, n + 1, not self._applied,
                                                                  done=False),
                                     evidence={**self._open.evidence, "steps": n + 1, "last_step": agg.step,
                                               **_scale(agg)})
                out.append(self._open)
            return out
        if self._streak is None:
            self._streak_s = 0.0
        first, _, n = self._streak if self._streak is not None else (agg.step, agg.step, 0)
        n += 1
        self._streak = (first, agg.step, n)
        self._streak_s += step_seconds(agg) or 0.0
        limit = self.min_steps if self._applied else self.initial + 1
        if n >= limit:
            self._info = None  # the warning episode takes over; short runs after it form a new info episode
            self._run, self._reported, self._quiet = self._streak, n, 0
            self._open = Anomaly(kind=self.KIND, severity="warning", step=first, gen=agg.gen,
                                 message=_message(first, agg.step, n, not self._applied, done=False),
                                 evidence={"steps": n, "first_step": first, "last_step": agg.step,
                                           "calibrating": not self._applied, **_scale(agg)})
            out.append(self._open)
        return out


def _scale(agg: StepAggregate) -> dict[str, float]:
    """``{"loss_scale": …}``: the loss scale the ranks reported after the step, when they do (the scaler halves it
    at each overflow: how far it fell shows how hard the gradients overflow)."""
    return {} if agg.loss_scale is None else {"loss_scale": agg.loss_scale}


def _message(first: int, last: int, n: int, calibrating: bool, done: bool) -> str:
    span = f"steps {first}-{last}" if last != first else f"step {first}"
    if calibrating:
        return (f"the optimizer skipped all {n} steps since the start ({span}, fp16 loss-scale overflow): no loss "
                f"scale stops the overflow; check the initial loss scale, the data and the learning rate")
    tail = "" if done else " so far"
    how = f"{n} steps in a row" if n == last - first + 1 else f"{n} of the {last - first + 1} steps"
    return (f"the optimizer skipped {how}{tail} ({span}, fp16 loss-scale overflow): the gradients kept "
            f"overflowing after the loss scale was lowered; look for a loss or grad-norm spike")


def _short_message(first: int, last: int, n: int, runs: int, lost_s: float) -> str:
    span = f"step {first}" if last == first else f"steps {first}-{last}"
    what = f"skipped {n} steps in {runs} short runs, {span}" if runs > 1 else f"skipped {span}"
    cost = f"; {fmt_duration(lost_s)} lost" if lost_s > 0 else ""
    return (f"the optimizer {what} (fp16 loss-scale overflow{cost}): the loss scaler lowered its scale, as it "
            f"does after an overflow; worth a look only if it keeps happening")
