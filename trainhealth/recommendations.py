"""Recommendations: the record the advisor writes to ``th:{run}:recommendations``, and its lifecycle.

The detector service writes them; people move them: ``proposed`` → ``acknowledged`` →
``applied`` or ``dismissed`` (from ``trainhealth advise`` or the dashboard). A change of
advice (another checkpoint or skip range) starts again at ``proposed``. The service closes
advice nobody needs any more, saying why in the history (``by`` = ``trainhealth``): ``dismissed``
when its anomaly is over or the run ended, ``superseded`` when a later stage of the same
incident got the incident's one recommendation (a divergence's rollback after the spike's wait;
:mod:`trainhealth.detectors.incidents`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypedDict, get_args

import redis

from trainhealth.anomaly import Kind
from trainhealth.exceptions import ConfigError
from trainhealth.keys import run_keys

#: Lifecycle of a recommendation, in order; ``superseded``: replaced by a later stage's of its incident.
Status = Literal["proposed", "acknowledged", "applied", "dismissed", "superseded"]
STATUSES: tuple[str, ...] = get_args(Status)
#: What a recommendation says to do: the rollback advisor's (loss anomalies), then the recovery advisor's.
Action = Literal["wait", "rollback", "none_possible", "dump_stacks", "check_process", "restart", "replace_node", "keep"]
ACTIONS: tuple[str, ...] = get_args(Action)
#: The statuses of advice still waiting for a decision.
OPEN_STATUSES = ("proposed", "acknowledged")


@dataclass(frozen=True)
class Recommendation:
    """What to do about one anomaly, with the numbers behind it.

    Attributes
    ----------
    id : str
        ``rec:<anomaly id>``: one recommendation per anomaly, updated as the anomaly evolves.
    run : str
        The run's id.
    anomaly_id : str
        The anomaly it is about (a field of ``th:{run}:anomalies``).
    kind : str
        That anomaly's kind.
    onset_step : int
        That anomaly's onset step.
    current_step : int
        The newest step when the advice was computed.
    action : str
        From the rollback advisor (loss anomalies): ``rollback`` (restart from ``checkpoint_step``
        skipping the data range), ``wait`` (a spike that may recover: re-check at ``recheck_step``)
        or ``none_possible``. From the recovery advisor (hangs, dead ranks, slow ranks and nodes):
        ``dump_stacks`` (run ``commands`` to see where the job is stuck; restart if nothing moved
        by ``deadline_s``), ``check_process`` (a rank's heartbeat stopped while the others wait: see with
        ``commands`` whether its process is stopped, stuck or gone; restart if nothing moved by ``deadline_s``),
        ``restart`` (relaunch from ``checkpoint_step``, without
        ``exclude_hosts``), ``replace_node`` (a restart without the slow node pays for itself soon)
        or ``keep`` (it does not: carry on with the slow node).
    checkpoint_step : int | None
        Checkpoint to restart from.
    skip_steps : tuple[int, int] | None
        Inclusive range of steps whose batches to skip after restarting.
    skip_samples, skip_batches : tuple[int, int] | None
        The same range as half-open ``[first, end)`` consumed-sample and batch-index ranges,
        when the collectors recorded data positions.
    recheck_step : int | None
        For ``wait``: the step at which to look again (None otherwise).
    recompute_steps : int | None
        Steps that a rollback or restart discards and trains again (None: unknown, no checkpoint
        was reported).
    cost : dict
        ``gpu_hours`` and ``usd`` (None without a price) of the rollback's recomputation, and
        ``wall_hours`` of the run's time it takes; for a restart also ``restart_s`` (s of relaunch
        overhead) and ``recompute_s``, and ``gpu_hours`` None when the recomputation is unknown.
    continue_cost : dict
        What not acting costs: ``wasted_steps_so_far`` and ``gpu_hours_per_hour`` (``usd_per_hour``)
        burnt while the run trains on a diverged model (for a hang or a slow node: the GPU-hours
        lost so far and per hour of waiting or of keeping the node).
    options : list[str]
        Other levers (lower learning rate, tighter clipping), labelled as options.
    reasoning : list[str]
        The steps of the decision, in words, with the numbers used.
    summary : str
        The advice in one paragraph, with its figures.
    commands : list[str]
        Shell commands to run, in order (``py-spy dump --pid 4242``; a trailing ``# ...`` says
        where or for which scheduler); empty when there is nothing to run.
    exclude_hosts : list[str]
        Hosts to leave out of the relaunch (a node that failed twice, a slow node).
    deadline_s : float | None
        Seconds after the onset at which the advice changes: restart if nothing moved by then.
    """

    id: str
    run: str
    anomaly_id: str
    kind: Kind
    action: Action
    onset_step: int
    current_step: int
    checkpoint_step: int | None = None
    skip_steps: tuple[int, int] | None = None
    skip_samples: tuple[int, int] | None = None
    skip_batches: tuple[int, int] | None = None
    recheck_step: int | None = None
    recompute_steps: int | None = 0
    cost: dict[str, Any] = field(default_factory=dict)
    continue_cost: dict[str, Any] = field(default_factory=dict)
    options: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    summary: str = ""
    commands: list[str] = field(default_factory=list)
    exclude_hosts: list[str] = field(default_factory=list)
    deadline_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples as lists)."""
        d = asdict(self)
        for k in ("skip_steps", "skip_samples", "skip_batches"):
            d[k] = list(d[k]) if d[k] is not None else None
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recommendation:
        """Rebuild from a stored dict (extra keys such as ``status`` and ``history`` are ignored; a record
        stored before ``commands``, ``exclude_hosts`` and ``deadline_s`` existed gets their defaults)."""
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        for k in ("skip_steps", "skip_samples", "skip_batches"):
            if kw.get(k) is not None:
                kw[k] = tuple(kw[k])
        for k in ("commands", "exclude_hosts"):
            if k in kw:
                kw[k] = list(kw[k] or [])
        return cls(**kw)

    def megatron_args(self) -> str | None:
        """``--train-range-to-skip FIRST LAST`` (Megatron-DeepSpeed; inclusive iterations) and
        ``--iterations-to-skip`` (Megatron-LM; the iterations listed), plus the load step."""
        if self.skip_steps is None or self.checkpoint_step is None:
            return None
        a, b = self.skip_steps
        return (f"--ckpt-step {self.checkpoint_step} --train-range-to-skip {a} {b} "
                f"--iterations-to-skip {' '.join(str(i) for i in range(a, b + 1))}")

    def lightning_skip(self) -> dict[str, Any] | None:
        """The ``skip_batches.json`` document: checkpoint, and the batch/sample/step ranges to skip."""
        if self.skip_steps is None:
            return None
        return {"version": 1, "run": self.run, "resume_from_step": self.checkpoint_step,
                "skip_steps": list(self.skip_steps),
                "skip_batches": list(self.skip_batches) if self.skip_batches else None,
                "skip_samples": list(self.skip_samples) if self.skip_samples else None}


class HistoryEntry(TypedDict):
    """One move of a recommendation's lifecycle, in its ``history``.

    Attributes
    ----------
    t : float
        Unix s of the move.
    status : str
        The status it moved to.
    by : str
        Who moved it (``trainhealth`` for the detector service; a person's name from ``trainhealth advise`` or the
        dashboard, or empty).
    note : str
        Why, in words (empty when not given).
    """

    t: float
    status: Status
    by: str
    note: str


class _Lifecycle(TypedDict):
    status: Status
    created_at: float
    updated_at: float


class Lifecycle(_Lifecycle, total=False):
    """What the detector service and people add to :meth:`Recommendation.to_dict` in ``th:{run}:recommendations``:
    the lifecycle.

    Attributes
    ----------
    status : str
        ``proposed``, ``acknowledged``, ``applied``, ``dismissed`` or ``superseded`` (:data:`STATUSES`).
    created_at : float
        Unix s the service first wrote this advice (a change of advice starts again).
    updated_at : float
        Unix s of the last write (new figures or a move).
    history : list[HistoryEntry]
        Every move of the status, oldest first; absent until the first.
    """

    history: list[HistoryEntry]


def load(client: redis.Redis, run: str) -> list[dict[str, Any]]:
    """All recommendations of ``run``, newest update first (JSON dicts as stored)."""
    raw = client.hgetall(run_keys(run).recommendations)
    recs = [json.loads(v) for v in raw.values()]
    return sorted(recs, key=lambda d: d.get("updated_at", 0.0), reverse=True)


def set_status(client: redis.Redis, run: str, rec_id: str, status: str, *, by: str = "", note: str = "") -> dict:
    """Move recommendation ``rec_id`` of ``run`` to ``status``; returns the stored dict.

    The change is recorded in the recommendation's ``history`` (time, status, by, note).

    Raises
    ------
    ConfigError
        For an unknown ``status`` or ``rec_id`` (naming the value); nothing is changed then.
    """
    if status not in STATUSES:
        raise ConfigError(f"status={status!r} is not one of {', '.join(STATUSES)}")
    key = run_keys(run).recommendations
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)  # optimistic lock: the service may update the figures meanwhile
                raw = pipe.hget(key, rec_id)
                if raw is None:
                    raise ConfigError(f"recommendation id={rec_id!r} does not exist in run {run!r}")
                d = json.loads(raw)
                d["status"] = status
                entry: HistoryEntry = {"t": time.time(), "status": status, "by": by, "note": note}
                d.setdefault("history", []).append(entry)
                pipe.multi()
                pipe.hset(key, rec_id, json.dumps(d, sort_keys=True))
                pipe.execute()
                return d
            except redis.WatchError:
                continue
