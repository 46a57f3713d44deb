"""Restarts and rollbacks: a new generation of the run's ranks."""

from __future__ import annotations

from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.text import plural


class RestartDetector(StepDetector):
    """Reports each restart (new processes) or rollback (step number going back) once.

    The aggregator starts a new generation when ranks restart or rewind; the first step of
    a new generation is where training resumed. The anomaly is a point event (created
    ``resolved``) of severity ``warning``.

    Evidence: ``last_step`` (before the restart), ``resume_step``, ``steps_recomputed``
    (``last_step - resume_step + 1`` when positive), ``downtime_s`` (last step end to
    the first new step's end, s).

    Examples
    --------
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> det = RestartDetector()
    >>> steps = [(10, 0, 100.0), (11, 0, 101.0), (12, 0, 102.0), (8, 1, 130.0), (9, 1, 131.0)]
    >>> for step, gen, t in steps:
    ...     a = StepAggregate(step, gen, 0.0, None, t, 1.0, 1.0, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.step, an.evidence["steps_recomputed"], an.evidence["downtime_s"])
    restart 8 5 28.0
    """

    def __init__(self) -> None:
        self._gen = 0
        self._last: StepAggregate | None = None

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return a restart anomaly on the first step of a new generation."""
        last, self._last = self._last, agg
        if agg.gen <= self._gen or last is None:
            self._gen = max(self._gen, agg.gen)
            return []
        self._gen = agg.gen
        redo = max(0, last.step - agg.step + 1)
        down = agg.t_end - last.t_end
        return [Anomaly(
            kind="restart", severity="warning", step=agg.step, end_step=agg.step, status=RESOLVED, gen=agg.gen,
            evidence={"last_step": last.step, "resume_step": agg.step, "steps_recomputed": redo,
                      "downtime_s": round(down, 3), "generation": agg.gen},
            message=(f"run restarted (generation {agg.gen}): resumed at step {agg.step} after reaching step "
                     f"{last.step}; {plural(redo, 'step')} recomputed, {down:.0f} s from the last step before to the "
                     "first step after"),
        )]
