"""What the pipeline asks of a step detector: :meth:`update` on every complete step, :meth:`finish` at the end.

Like river's ``base.DriftDetector``: a detector stores its parameters under their public names, keeps its
state in ``_private`` attributes, and answers each input with what changed. The pipeline
(:class:`~trainhealth.detectors.pipeline.RunPipeline`) feeds every :class:`StepDetector` the same
:class:`~trainhealth.detectors.aggregate.StepAggregate` in order and, when every rank has ended, calls
:meth:`StepDetector.finish` on each.
"""

from __future__ import annotations

from trainhealth.anomaly import Anomaly
from trainhealth.detectors.aggregate import StepAggregate


class StepDetector:
    """Base of the detectors fed one complete step at a time.

    Subclasses implement :meth:`update`; those judging conditions of a live job (a slow rank, a slow node,
    a throughput drop), which cannot be observed once the job is over, override :meth:`finish`.
    """

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one complete step; return the anomaly states that changed (opened, grew, resolved)."""
        raise NotImplementedError

    def unsaid(self) -> list[Anomaly]:
        """States of open anomalies that changed since they were last returned: a detector that says a growing
        condition again only as it doubles (a NaN run, a frozen loss) gives its latest state here, at the end of a
        replayed file or of the run (default: none)."""
        return []

    def finish(self, step: int) -> list[Anomaly]:
        """Every rank ended at ``step``: the anomalies this ends (default: none, e.g. loss findings describe the
        model and stay)."""
        return []
