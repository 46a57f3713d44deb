"""The anomaly record every detector returns, and its stable kinds and severities.

Users route alerts on ``kind`` and ``severity``; both are documented in ``docs/anomalies.md``
and must not be renamed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, TypedDict, get_args

#: The detectors' stable snake_case kinds.
DetectorKind = Literal[
    "nan_inf", "skipped_steps", "loss_spike", "grad_norm_spike", "divergence", "grad_norm_explosion",
    "straggler", "slow_node", "rank_outlier", "hang", "dead_rank", "throughput_drop", "slow_step",
    "restart", "restart_storm", "loss_collapse", "plateau", "memory_growth",
    "network_slow", "memory_imbalance",
]
#: Kinds the detection pipeline itself records, not a detector: ``data_loss`` (records lost before the service read
#: them, detectors/pipeline.py). Routable and silenceable like the detectors' kinds.
RecordKind = Literal["data_loss"]
#: Every kind an anomaly can have.
Kind = Literal[DetectorKind, RecordKind]
Severity = Literal["info", "warning", "critical"]
Status = Literal["active", "resolved"]
KINDS: tuple[str, ...] = get_args(DetectorKind)
RECORD_KINDS: tuple[str, ...] = get_args(RecordKind)
ALL_KINDS = KINDS + RECORD_KINDS
SEVERITIES: tuple[str, ...] = get_args(Severity)
ACTIVE, RESOLVED = get_args(Status)


@dataclass(frozen=True)
class Anomaly:
    """One detected condition, in its current state.

    A detector returns a new ``Anomaly`` with the same :attr:`id` each time the condition
    changes (it grows, ends), so one ongoing condition is one anomaly, not one per step.

    Attributes
    ----------
    kind : str
        One of :data:`ALL_KINDS` (docs/anomalies.md).
    severity : str
        ``info``, ``warning`` or ``critical``.
    step : int
        Onset step (the first step showing the condition).
    message : str
        One line for a human on call.
    evidence : dict
        The numbers the decision used (names documented per detector).
    ranks, hosts : tuple
        Ranks and hosts involved (empty when the whole job is concerned).
    end_step : int | None
        Last step showing the condition, once it is over.
    status : str
        ``active`` or ``resolved``.
    gen : int
        Restart generation the onset belongs to (0 = first launch).
    scope : str
        Overrides the ranks part of :attr:`id` (e.g. ``*`` for a job-wide hang whose rank set grows).
    """

    kind: Kind
    severity: Severity
    step: int
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    end_step: int | None = None
    status: Status = ACTIVE
    gen: int = 0
    scope: str = ""

    @property
    def id(self) -> str:
        """Deterministic id: ``kind:scope-or-ranks:onset step:generation``."""
        who = self.scope or ("-".join(map(str, self.ranks)) if self.ranks else "*")
        return f"{self.kind}:{who}:{self.step}:{self.gen}"

    @property
    def active(self) -> bool:
        return self.status == ACTIVE

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (with ``id``), the form stored in ``th:{run}:anomalies``."""
        d = asdict(self)
        d["ranks"], d["hosts"] = list(self.ranks), list(self.hosts)
        d["id"] = self.id
        d.pop("scope")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=True)


class RecommendationRef(TypedDict):
    """The stable part of an anomaly's recommendation (:class:`trainhealth.recommendations.Recommendation`), carried
    in the anomaly's stored JSON and so in its alerts; its fields mean what the recommendation's do.

    Attributes
    ----------
    id : str
        ``rec:<anomaly id>``: the field of ``th:{run}:recommendations`` holding the whole recommendation.
    action : str
        What to do (``rollback``, ``wait``, ``restart``, ...).
    checkpoint_step : int | None
        Checkpoint to restart from.
    skip_steps : list[int] | None
        Inclusive ``[first, last]`` range of steps whose batches to skip after restarting.
    """

    id: str
    action: str
    checkpoint_step: int | None
    skip_steps: list[int] | None


class Seen(TypedDict):
    """When the detector service first and last wrote a record (its own clock): added to an anomaly and an incident
    as it stores them (``th:{run}:anomalies``, ``th:{run}:incidents``).

    Attributes
    ----------
    first_seen : float
        Unix s the service first wrote it.
    last_seen : float
        Unix s the service last wrote it (the record changed then).
    """

    first_seen: float
    last_seen: float


class StoredFields(Seen, total=False):
    """What the detector service adds to :meth:`Anomaly.to_dict` as it stores an anomaly in ``th:{run}:anomalies``
    (and in the ``json`` of its ``th:{run}:anomaly_log`` transitions).

    Attributes
    ----------
    first_seen : float
        Unix s the service first wrote the anomaly.
    last_seen : float
        Unix s the service last wrote it (the anomaly changed then).
    recommendation : RecommendationRef
        The stable part of the anomaly's recommendation, when it has one (the whole record is the field
        ``rec:<anomaly id>`` of ``th:{run}:recommendations``); absent otherwise.
    """

    recommendation: RecommendationRef


def run_ended(a: Anomaly, step: int) -> Anomaly:
    """``a`` resolved because every rank of the run ended (at ``step``, the last step seen).

    For conditions of a live job (a straggler, a slow node, a throughput drop): once the job is over
    they can no longer be observed, and left active they would keep firing alerts for a finished
    run. ``evidence["run_ended"]`` is set; ``end_step`` is ``step`` (not before the onset).
    """
    return replace(a, status=RESOLVED, end_step=max(step, a.step), evidence={**a.evidence, "run_ended": True},
                   message=f"{a.message}; still so when the run ended at step {step}")
