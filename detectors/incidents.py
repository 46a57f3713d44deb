"""Incidents: one per root cause, from a run's anomalies and their recommendations.

An on-call engineer must see one incident per root cause, not the list of anomalies it raised: a loss spike, its
grad-norm spike and the divergence it becomes are one thing to act on, with one recommendation. Pure logic, no I/O:
:class:`~trainhealth.detectors.pipeline.RunPipeline` feeds an :class:`IncidentGrouper` every anomaly state and
recommendation it produces and returns the incidents that changed in its ``Output``; the detector service stores
them in ``th:{run}:incidents`` (docs/architecture.md), ``trainhealth analyze`` keeps them with its anomalies.

Grouping rules (docs/anomalies.md, "Incidents"):

1. **The model's training signal** (:data:`INCIDENT_KINDS`): the anomalies sharing ``evidence["incident"]``, which
   :meth:`RunPipeline._incident <trainhealth.detectors.pipeline.RunPipeline._incident>` assigns — one generation,
   onsets within ``max(defaults.INCIDENT_STEPS, the log's interval)`` of a member's (BLOOM-176B's grad norm left its
   level 4 steps before its loss spiked; PaLM section 5.1 and OLMo 2 report grad-norm spikes shortly before loss
   spikes).
2. **A stop of the job** (:data:`JOB_KINDS`): the anomalies sharing ``evidence["incident"]`` from
   :meth:`RunPipeline._in_job_incident <trainhealth.detectors.pipeline.RunPipeline._in_job_incident>` — a dead
   rank, the hang of the ranks waiting for it, the restart that ends the generation.
3. **A slow rank or node and the throughput it costs**: a ``throughput_drop`` or ``slow_step``
   (:data:`EFFECT_KINDS`) joins the ``slow_node``, ``straggler``, ``rank_outlier`` or ``network_slow``
   (:data:`CAUSE_KINDS`) of its generation whose steps overlap its own (an open anomaly's reach to the present); of
   several, the first in that order of kinds, then the earliest onset. A synchronous job's every step waits for its
   slowest rank (the all-reduce; NVIDIA Resiliency Extension scores stragglers by the share of the step they cost),
   so a step-time rise while a rank is slow is that rank's cost. An effect seen before its cause is its own incident
   until the cause opens: it then moves to the cause's incident and its own is removed (reported as ``None``).
4. **Anything else** is its own incident.

An anomaly's incident, once given, is kept (a later state of it or of another anomaly never moves it, except an
effect's move of rule 3), so the incidents depend only on the order of the input, as the pipeline's anomalies do.

The root is the anomaly named by the incident's id (``inc:<root anomaly id>``): the loss family's and the job
stop's first anomaly, the cause of rule 3, the lone anomaly of rule 4. The incident's ``kind`` is the root's; its
severity the highest of its members'; it is active while any member is. Its one recommendation is the latest
stage's: of the members with a recommendation, the one whose kind is furthest along :data:`STAGES` (a divergence
after the loss spike it became; NaN after both), the latest to join among equals. The badput is what the members'
evidence says (:func:`badput`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

from trainhealth.anomaly import SEVERITIES, Anomaly, Kind, Severity, Status
from trainhealth.recommendations import Recommendation
from trainhealth.text import fmt_bytes, fmt_int, fmt_pct, fmt_ranks
from trainhealth.wire import Indices

#: Kinds that describe the model's training signal: anomalies of these kinds whose onsets are close are one
#: incident (rule 1).
INCIDENT_KINDS = frozenset({"loss_spike", "grad_norm_spike", "divergence", "grad_norm_explosion", "nan_inf",
                            "skipped_steps", "loss_collapse"})
#: Kinds of a stop of the job, one incident per stop (rule 2).
JOB_KINDS = frozenset({"hang", "dead_rank", "restart", "collective_timeout"})
#: A slow rank or node (rule 3), in the order an effect prefers them when several overlap it.
CAUSE_KINDS = ("slow_node", "straggler", "rank_outlier", "network_slow")
#: What a slow rank costs the whole job (rule 3).
EFFECT_KINDS = frozenset({"throughput_drop", "slow_step"})
#: How far along a loss incident a kind is: its latest stage gives the incident's recommendation and title.
STAGES = {"grad_norm_spike": 0, "skipped_steps": 1, "loss_spike": 2, "grad_norm_explosion": 3, "divergence": 4,
          "loss_collapse": 4, "nan_inf": 5}
#: Kinds whose cost grows with every step while open (:meth:`IncidentGrouper.advance`).
_GROWING = frozenset({"throughput_drop", "straggler", "slow_node", "network_slow"})
#: Seconds per hour: the badput rate of a stopped job.
HOUR_S = 3600.0
#: Recent causes and lone effects kept to match (rule 3): an overlap is between anomalies of the same few hours.
RECENT = 100

#: The kind in a title, at the start of a sentence.
LABELS = {"loss_spike": "Loss spike", "grad_norm_spike": "Grad-norm spike", "divergence": "Divergence",
          "grad_norm_explosion": "Grad-norm explosion", "nan_inf": "NaN/Inf", "skipped_steps": "Skipped steps",
          "loss_collapse": "Loss collapse", "plateau": "Loss plateau", "straggler": "Straggler",
          "slow_node": "Slow node", "rank_outlier": "Rank outlier", "hang": "Hang", "dead_rank": "Dead rank",
          "throughput_drop": "Throughput drop", "slow_step": "Slow step", "restart": "Restart",
          "restart_storm": "Restart storm", "data_loss": "Data loss",
          "network_slow": "Network", "memory_imbalance": "Memory imbalance"}
#: The kind a loss incident became, after "that became".
_BECAME = {"grad_norm_spike": "a grad-norm spike", "skipped_steps": "skipped steps", "loss_spike": "a loss spike",
           "grad_norm_explosion": "a grad-norm explosion", "divergence": "a divergence",
           "loss_collapse": "a loss collapse", "nan_inf": "NaN/Inf"}


class DataPosition(TypedDict):
    """Where the data stream was when an incident's onset step began, and what that step consumed.

    Attributes
    ----------
    step : int | None
        The last step before the onset whose data position the ranks logged (null when none did).
    consumed_samples : int | None
        Global samples consumed after that step (``log_step(consumed_samples=)``).
    batch_index : int | None
        The data loader's batch index after that step (``log_step(batch_index=)``).
    sample_indices : dict[str, list] | None
        Rank -> the sample indices it consumed in the onset step (``log_step(sample_indices=)``), each a compact
        list (an index, or ``[start, stop]`` / ``[start, stop, step]`` for a run of them); null when the onset step
        logged none, or when they take more than ``defaults.INCIDENT_SAMPLE_INDICES_BYTES`` of JSON (then read the
        entry ``samples_entry`` names).
    samples_entry : str | None
        The id of the ``th:{run}:samples`` entry holding every rank's indices of the onset step (``<gen + 1>-<step>``;
        ``XRANGE th:{run}:samples ID ID``), null when the onset step logged none.
    """

    step: int | None
    consumed_samples: int | None
    batch_index: int | None
    sample_indices: dict[str, Indices] | None
    samples_entry: str | None


@dataclass(frozen=True)
class Incident:
    """One root cause, in its current state: what ``th:{run}:incidents`` stores (docs/architecture.md).

    Attributes
    ----------
    id : str
        ``inc:<root anomaly id>``: stable, as the root anomaly's id is.
    kind : str
        The root anomaly's kind.
    title : str
        The incident in words, for a person on call.
    severity : str
        The highest of its members'.
    status : str
        ``active`` while any member is, else ``resolved``.
    onset_step : int
        The earliest onset of its members.
    onset_t : float | None
        Unix s: when that step ended, else when the incident was first seen (a data time, not a clock's).
    end_step : int | None
        The latest end of its members, once resolved.
    gen : int
        The root's restart generation.
    ranks, hosts : tuple
        Every member's, sorted (empty when the whole job is concerned).
    anomalies : tuple[str, ...]
        Member anomaly ids, the root first, then in the order they joined.
    recommendation : str | None
        The one recommendation (``rec:<anomaly id>``) of the latest stage, if a member has one.
    badput_s : float | None
        Seconds of the job's time it cost so far, where the evidence says (:func:`badput`).
    badput_s_per_hour : float | None
        Seconds of the job's time it costs per hour while it lasts (3,600 for a stopped job).
    data_position : dict | None
        Where the data stream was when the onset step began: ``step`` (the last step before the onset whose
        position the ranks logged), ``consumed_samples`` and ``batch_index`` after it (``log_step``'s
        ``consumed_samples``/``batch_index``), and what the onset step consumed: each rank's ``sample_indices``
        (``log_step(sample_indices=)``), or the ``samples_entry`` of ``th:{run}:samples`` holding them when large;
        None when the job logs no data position and no sample indices. What a rollback's skip range starts from,
        and what to look at in the data.
    """

    id: str
    kind: Kind
    title: str
    severity: Severity
    status: Status
    onset_step: int
    onset_t: float | None
    end_step: int | None
    gen: int
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    anomalies: tuple[str, ...]
    recommendation: str | None = None
    badput_s: float | None = None
    badput_s_per_hour: float | None = None
    data_position: DataPosition | None = None

    @property
    def root(self) -> str:
        """The root anomaly's id."""
        return self.id.removeprefix("inc:")

    @property
    def active(self) -> bool:
        return self.status == "active"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples as lists), the form stored in ``th:{run}:incidents``."""
        d = asdict(self)
        for k in ("ranks", "hosts", "anomalies"):
            d[k] = list(d[k])
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


class IncidentGrouper:
    """Groups a run's anomalies into incidents as they come (module docstring: the rules).

    Parameters
    ----------
    step_time : callable, optional
        ``step -> unix s`` the step ended, or None when unknown: gives :attr:`Incident.onset_t`.
    position : callable, optional
        ``onset step -> data position`` (see :attr:`Incident.data_position`), or None when unknown.

    Examples
    --------
    A loss spike at step 400 with a grad-norm spike at the same step, the divergence it becomes 100 steps
    later, and a straggler with the throughput drop it costs (the pipeline sets the loss family's
    ``evidence["incident"]``):

    >>> inc = {"incident": "loss_spike:*:400:0"}
    >>> spike = Anomaly("loss_spike", "warning", 400, "loss 6.0 at step 400", evidence=inc)
    >>> grad = Anomaly("grad_norm_spike", "warning", 400, "grad norm 30 at step 400", evidence=inc)
    >>> div = Anomaly("divergence", "critical", 400, "loss diverged", evidence=inc)
    >>> slow = Anomaly("straggler", "warning", 200, "rank 13 is slow", ranks=(13,), hosts=("node-b",))
    >>> drop = Anomaly("throughput_drop", "warning", 210, "throughput dropped",
    ...                evidence={"before_s": 0.2, "after_s": 0.25, "lost_fraction": 0.2, "span_steps": 50})
    >>> g = IncidentGrouper()
    >>> changed = g.update([spike, grad, slow, drop])
    >>> changed = g.update([div], [Recommendation("rec:divergence:*:400:0", "r", div.id, "divergence", "rollback",
    ...                                          400, 500)])
    >>> for i in g.incidents.values():
    ...     print(i.id, i.severity, i.status, i.anomalies, i.recommendation)
    ...     print("   ", i.title, i.badput_s, i.badput_s_per_hour)
    inc:loss_spike:*:400:0 critical active ('loss_spike:*:400:0', 'grad_norm_spike:*:400:0', 'divergence:*:400:0') \
rec:divergence:*:400:0
        Loss spike at step 400 that became a divergence None None
    inc:straggler:13:200:0 warning active ('straggler:13:200:0', 'throughput_drop:*:210:0') None
        Rank 13 (node-b) is a straggler, costing throughput 2.5 720.0
    """

    def __init__(self, step_time: Callable[[int], float | None] | None = None,
                 position: Callable[[int], DataPosition | None] | None = None) -> None:
        self.step_time = step_time
        self.position = position
        #: Latest state of every member, by anomaly id.
        self._states: dict[str, Anomaly] = {}
        self._of: dict[str, str] = {}  # anomaly id -> incident id
        self._members: dict[str, list[str]] = {}  # incident id -> member ids, in the order they joined
        self._recs: dict[str, str] = {}  # anomaly id -> its recommendation's id
        # incident id -> (onset step, its time, the data position when it began)
        self._onset: dict[str, tuple[int, float | None, DataPosition | None]] = {}
        self._first_t: dict[str, float | None] = {}  # incident id -> data time it was first seen
        self._causes: list[str] = []  # recent cause anomalies (rule 3)
        self._lone: list[str] = []  # recent effects in their own incident (rule 3)
        self._step: int | None = None  # the run's newest step (advance): the "so far" of open members' badput
        self._growing: set[str] = set()  # active incidents with an open member whose cost grows with the steps
        #: Current state of every incident, by id.
        self.incidents: dict[str, Incident] = {}

    def incident_of(self, anomaly_id: str) -> Incident | None:
        """The current incident of anomaly ``anomaly_id`` (None for one never fed)."""
        iid = self._of.get(anomaly_id)
        return None if iid is None else self.incidents.get(iid)

    def update(self, anomalies: Iterable[Anomaly], recommendations: Iterable[Recommendation] = (),
               t: float | None = None) -> dict[str, Incident | None]:
        """Feed anomaly states (in order) and the recommendations computed for them, at data time ``t`` (unix s);
        returns the incidents that changed, by id, ``None`` for one removed (an effect moved to its cause's)."""
        touched: dict[str, None] = {}
        for a in anomalies:
            self._states[a.id] = a
            iid = self._of.get(a.id)
            if iid is None:
                iid = self._join(a, touched, t)
            touched[iid] = None
        for rec in recommendations:
            iid = self._of.get(rec.anomaly_id)
            if iid is not None:
                self._recs[rec.anomaly_id] = rec.id
                touched[iid] = None
        changed: dict[str, Incident | None] = {}
        for iid in touched:
            new = self._build(iid) if iid in self._members else None
            self._note_growing(iid, new)
            if new != self.incidents.get(iid):
                changed[iid] = new
                if new is None:
                    del self.incidents[iid]
                else:
                    self.incidents[iid] = new
        return changed

    def _note_growing(self, iid: str, inc: Incident | None) -> None:
        if inc is not None and inc.active and any(
                self._states[m].active and self._states[m].kind in _GROWING for m in self._members[iid]):
            self._growing.add(iid)
        else:
            self._growing.discard(iid)

    def advance(self, step: int) -> dict[str, Incident]:
        """The run reached ``step``: the active incidents whose cost grows with the steps (an open throughput drop,
        straggler or slow node) are rebuilt with their badput so far; returns those that changed, by id."""
        self._step = step
        changed: dict[str, Incident] = {}
        for iid in sorted(self._growing):  # a few: not every incident of the run
            new = self._build(iid)
            if new != self.incidents[iid]:
                self.incidents[iid] = changed[iid] = new
        return changed

    # -- membership ---------------------------------------------------------------------------------
    def _join(self, a: Anomaly, touched: dict[str, None], t: float | None) -> str:
        root = a.evidence.get("incident")
        if a.kind in INCIDENT_KINDS | JOB_KINDS and isinstance(root, str):  # rules 1 and 2
            iid = "inc:" + root
        elif a.kind in EFFECT_KINDS and (cause := self._cause_of(a)) is not None:  # rule 3
            iid = self._of[cause]
        else:  # rule 4, and a cause or lone effect of rule 3
            iid = "inc:" + a.id
        self._add(a.id, iid, t)
        if a.kind in CAUSE_KINDS:
            self._causes.append(a.id)
            del self._causes[:-RECENT]
            for e in [e for e in self._lone if _overlap(self._states[e], a)]:
                old = self._of[e]
                del self._members[old]
                self._onset.pop(old, None)
                self._first_t.pop(old, None)
                self._lone.remove(e)
                self._members[iid].append(e)
                self._of[e] = iid
                touched[old] = None
        elif a.kind in EFFECT_KINDS and iid == "inc:" + a.id:
            self._lone.append(a.id)
            del self._lone[:-RECENT]
        return iid

    def _add(self, aid: str, iid: str, t: float | None) -> None:
        self._of[aid] = iid
        if iid not in self._members:
            self._members[iid] = []
            self._first_t[iid] = t
        self._members[iid].append(aid)

    def _cause_of(self, effect: Anomaly) -> str | None:
        """The recent cause anomaly an effect joins (rule 3), or None."""
        found = [self._states[c] for c in self._causes if _overlap(self._states[c], effect)]
        if not found:
            return None
        return min(found, key=lambda c: (CAUSE_KINDS.index(c.kind), c.step, c.id)).id

    # -- the incident ---------------------------------------------------------------------------------
    def _build(self, iid: str) -> Incident:
        ids = self._members[iid]
        members = [self._states[i] for i in ids]
        root = self._states.get(iid.removeprefix("inc:"), members[0])
        if root.id in ids and ids[0] != root.id:
            ids = [root.id] + [i for i in ids if i != root.id]
        active = any(m.active for m in members)
        onset = min(m.step for m in members)
        if self._onset.get(iid, (None,))[0] != onset:
            known = self.step_time(onset) if self.step_time is not None else None
            where = self.position(onset) if self.position is not None else None
            self._onset[iid] = (onset, known if known is not None else self._first_t[iid], where)
        with_rec = [(STAGES.get(m.kind, 0), n, m.id) for n, m in enumerate(members) if m.id in self._recs]
        rec = self._recs[max(with_rec)[2]] if with_rec else None
        latest = max(((STAGES.get(m.kind, 0), n, m) for n, m in enumerate(members)), key=lambda x: x[:2])[2]
        seconds, per_hour = badput(members, self._step)
        return Incident(
            id=iid, kind=root.kind, title=title(root, members, latest), severity=max(
                (m.severity for m in members), key=lambda s: SEVERITIES.index(s) if s in SEVERITIES else -1),
            status="active" if active else "resolved", onset_step=onset, onset_t=self._onset[iid][1],
            end_step=None if active else max(m.step if m.end_step is None else m.end_step for m in members),
            gen=root.gen, ranks=tuple(sorted({r for m in members for r in m.ranks})),
            hosts=tuple(sorted({h for m in members for h in m.hosts})), anomalies=tuple(ids), recommendation=rec,
            badput_s=seconds, badput_s_per_hour=per_hour, data_position=self._onset[iid][2])


def group(anomalies: Iterable[Anomaly], recommendations: Iterable[Recommendation] = ()) -> dict[str, Incident]:
    """The incidents of ``anomalies`` (fed in the order given, as the pipeline would) and their
    ``recommendations``, by id.

    >>> hang = Anomaly("hang", "critical", 66, "no progress for 240 s", ranks=(0, 1),
    ...                evidence={"incident": "hang:*:66:0", "stalled_s": 240.0,
    ...                          "culprit": {"rank": 1, "host": "node-7"}})
    >>> plateau = Anomaly("plateau", "warning", 5000, "the loss stopped improving")
    >>> [(i.id, i.kind, i.title, i.badput_s, i.badput_s_per_hour) for i in group([hang, plateau]).values()]
    [('inc:hang:*:66:0', 'hang', 'Job hung at step 66, waiting on rank 1 (node-7)', 240.0, 3600.0), \
('inc:plateau:*:5000:0', 'plateau', 'Loss plateau from step 5,000', None, None)]
    """
    grouper = IncidentGrouper()
    grouper.update(anomalies, recommendations)
    return dict(grouper.incidents)


def badput(members: Iterable[Anomaly], step: int | None = None) -> tuple[float | None, float | None]:
    """Seconds of the job's time an incident's members cost so far, and per hour while they last (None where no
    member's evidence says); ``step`` is the run's newest step, the "so far" of an open member.

    Per member: a ``hang`` its ``stalled_s``, a ``dead_rank`` the longer of ``silent_s`` and ``idle_s`` (the job
    is stopped: 3,600 s per hour), a ``restart`` its ``downtime_s``; a ``throughput_drop`` ``after_s - before_s``
    per step over its steps (onset to ``step`` while open — ``span_steps``, the steps it was judged on, without
    ``step`` — onset to end once over) at ``lost_fraction`` x 3,600 s per hour; a ``slow_step`` or
    ``skipped_steps`` its ``lost_s``. A ``straggler`` or ``slow_node`` whose incident has no throughput drop to
    say what it costs: what every other rank waits for it at the all-reduce, its median busy time above the
    typical rank's (``rank_median_s`` or ``node_median_s`` minus ``typical_median_s``) per step over its steps, at
    that share of its step per hour (NVIDIA Resiliency Extension's straggler score is that share); a ``network_slow``
    likewise, its ``node_comm_s`` above the other nodes' ``others_comm_s`` per step at ``excess_share`` x 3,600 s
    per hour (every rank waits for the slowest collective). The members of
    a stop of the job are one stretch of time (the longest counts); the others add up. The rate is the highest
    member's.

    >>> badput([Anomaly("throughput_drop", "warning", 100, "", end_step=199,
    ...                 evidence={"before_s": 0.2, "after_s": 0.25, "lost_fraction": 0.2})])
    (5.0, 720.0)
    >>> slow = Anomaly("straggler", "warning", 100, "", ranks=(5,),
    ...                evidence={"rank_median_s": 0.3, "typical_median_s": 0.2})
    >>> badput([slow], step=399)
    (30.0, 1200.0)
    """
    members = list(members)
    priced = any(a.kind == "throughput_drop" for a in members)
    stop, other, rates = 0.0, 0.0, []
    known = False
    for a in members:
        if a.kind in CAUSE_KINDS and priced:
            continue  # its cost is the throughput drop's: counted once
        s, rate = _member_badput(a, step)
        if s is not None:
            known = True
            if a.kind in JOB_KINDS:
                stop = max(stop, s)
            else:
                other += s
        if rate is not None:
            rates.append(rate)
    return (round(stop + other, 3) if known else None), (round(max(rates), 1) if rates else None)


def _steps_of(a: Anomaly, step: int | None) -> float | None:
    """Steps ``a`` spans so far: onset to end once over, onset to ``step`` while open (None when unknown)."""
    if a.end_step is not None:
        return float(a.end_step - a.step + 1)
    return float(step - a.step + 1) if step is not None and step >= a.step else None


def _member_badput(a: Anomaly, step: int | None = None) -> tuple[float | None, float | None]:
    ev = a.evidence
    if a.kind == "hang":
        return _num(ev.get("stalled_s")), HOUR_S
    if a.kind == "dead_rank":
        silent = [v for v in (_num(ev.get("silent_s")), _num(ev.get("idle_s"))) if v is not None]
        return (max(silent) if silent else None), HOUR_S
    if a.kind == "restart":
        return _num(ev.get("downtime_s")), None
    if a.kind == "throughput_drop":
        before, after, frac = _num(ev.get("before_s")), _num(ev.get("after_s")), _num(ev.get("lost_fraction"))
        steps = _steps_of(a, step)
        if steps is None:
            steps = _num(ev.get("span_steps"))
        seconds = (after - before) * steps if None not in (before, after, steps) else None
        return seconds, (frac * HOUR_S if frac is not None else None)
    if a.kind in ("straggler", "slow_node"):
        slow = _num(ev.get("rank_median_s" if a.kind == "straggler" else "node_median_s"))
        typical, steps = _num(ev.get("typical_median_s")), _steps_of(a, step)
        if slow is None or typical is None or slow <= typical:
            return None, None
        return ((slow - typical) * steps if steps is not None else None), (slow - typical) / slow * HOUR_S
    if a.kind == "network_slow":
        extra, frac = _num(ev.get("node_comm_s")), _num(ev.get("excess_share"))
        others, steps = _num(ev.get("others_comm_s")), _steps_of(a, step)
        if extra is None or others is None or extra <= others:
            return None, None
        return ((extra - others) * steps if steps is not None else None), (frac * HOUR_S if frac else None)
    if a.kind in ("slow_step", "skipped_steps"):
        return _num(ev.get("lost_s")), None
    return None, None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _overlap(a: Anomaly, b: Anomaly) -> bool:
    """Same generation, and their steps overlap (an open anomaly reaches to the present)."""
    return a.gen == b.gen and a.step <= _end(b) and b.step <= _end(a)


def _end(a: Anomaly) -> float:
    return math.inf if a.active or a.end_step is None else a.end_step


# -- titles ------------------------------------------------------------------------------------------
def title(root: Anomaly, members: list[Anomaly], latest: Anomaly) -> str:
    """The incident in words: its root, the stage it reached (a loss incident), what it costs (a slow rank), how
    the job's stop went on (a hang, a restart)."""
    kinds = {m.kind for m in members}
    step = fmt_int(root.step)
    if root.kind in INCIDENT_KINDS:
        became = (f" that became {_BECAME.get(latest.kind, latest.kind)}" if latest.kind != root.kind and
                  STAGES.get(latest.kind, 0) > STAGES.get(root.kind, 0) else "")
        return f"{LABELS[root.kind]} at step {step}{became}"
    if root.kind == "network_slow":
        node = ", ".join(root.hosts) or root.scope or "?"
        who = f" (ranks {fmt_ranks(root.ranks)})" if root.ranks else ""
        return f"Network slow on node {node}{who}" + (
            ", costing throughput" if kinds & EFFECT_KINDS else "")
    if root.kind in CAUSE_KINDS:
        what = {"straggler": "is a straggler", "rank_outlier": "is an outlier"}.get(root.kind)
        who = f"{_ranks(root)} {what}" if what else f"Node {', '.join(root.hosts) or root.scope or '?'} is slow"
        return who + (", costing throughput" if kinds & EFFECT_KINDS else "")
    if root.kind in JOB_KINDS:
        return _stop_title(root, kinds, step)
    if root.kind == "throughput_drop":
        frac = _num(root.evidence.get("lost_fraction"))
        if frac is not None:
            return f"Throughput dropped {fmt_pct(100 * frac)} at step {step}"
    if root.kind == "slow_step":
        end = root.end_step if root.end_step is not None else root.step
        return f"Step {step} was slow" if end == root.step else f"Steps {step}-{fmt_int(end)} were slow"
    if root.kind == "plateau":
        return f"Loss plateau from step {step}"
    if root.kind == "memory_imbalance":
        ev = root.evidence
        peak, mid = _num(ev.get("peak")), _num(ev.get("median_peak"))
        if peak is not None and mid is not None:
            return f"{_ranks(root)} peaks at {fmt_bytes(peak)} of memory, the other ranks at {fmt_bytes(mid)}"
    if root.kind == "data_loss":
        return f"History before step {step} lost from Redis"
    return f"{LABELS.get(root.kind, root.kind)} at step {step}"


def _stop_title(root: Anomaly, kinds: set[str], step: str) -> str:
    ev = root.evidence
    culprit = ev.get("culprit") if isinstance(ev.get("culprit"), Mapping) else None
    if root.kind == "restart":
        text = f"Run restarted at step {step}"
    elif ev.get("source") == "nccl_watchdog":
        text = f"Collective {ev.get('op') or 'operation'} timed out at step {step}"
    elif root.kind == "hang":
        text = f"Job hung at step {step}" + (f", waiting on {_rank(culprit)}" if culprit else "")
    elif ev.get("job_state") == "crashed":
        text = f"Job crashed at step {step}" + (f", {_rank(culprit)} first" if culprit else "")
    else:
        text = (f"{_rank(culprit).capitalize()} stopped at step {step}" if culprit else
                f"{_ranks(root)} stopped at step {step}")
        if "hang" in kinds:
            text += ", the job hung"
    if "restart" in kinds and root.kind != "restart":
        text += ", then restarted"
    return text


def _rank(culprit: Mapping[str, Any]) -> str:
    host = culprit.get("host")
    return f"rank {culprit.get('rank')}" + (f" ({host})" if host else "")


def _ranks(a: Anomaly) -> str:
    hosts = f" ({', '.join(a.hosts)})" if a.hosts else ""
    if len(a.ranks) == 1:
        return f"Rank {a.ranks[0]}{hosts}"
    return f"Ranks {', '.join(map(str, a.ranks))}{hosts}" if a.ranks else f"The job{hosts}"
