"""Alerts (one anomaly of one run, as the grouping engine sees it) and notifications (one group flush).

An :class:`Alert` is built from an ``anomaly_log`` transition. A :class:`Notification` is what the grouping
engine emits when a group is due: its firing and resolved alerts, the group labels, the route's receivers
and a per-group sequence number. Each (notification, sink) pair has a stable idempotency key
(:meth:`Notification.idempotency_key`) that receivers use to de-duplicate at-least-once deliveries.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args
from urllib.parse import urlencode

from trainhealth.matchers import LABELS, labels_of

#: An alert's and a notification's status: some alert fires, or all are resolved.
AlertStatus = Literal["firing", "resolved"]
FIRING, RESOLVED = get_args(AlertStatus)
#: Why a notification was sent: first of its group, the group changed (new or escalated alerts, or
#: resolved ones), only resolved alerts, or the unchanged firing group after ``repeat_interval``.
Reason = Literal["new", "update", "resolved", "repeat"]
REASONS: tuple[str, ...] = get_args(Reason)


def json_safe(value: Any) -> Any:
    """``value`` with NaN/±Inf floats as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON has none).

    >>> json_safe({"loss": float("nan"), "z": [1.5, float("-inf")]})
    {'loss': 'nan', 'z': [1.5, '-inf']}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def step_range(anomaly: Mapping[str, Any], dash: str = "–") -> str:
    """``"450–800"``, ``"450"`` (a one-step anomaly) or ``"450–"`` while it is still open.

    >>> step_range({"step": 450, "end_step": 800}), step_range({"step": 7, "end_step": None})
    ('450–800', '7–')
    """
    start, end = anomaly.get("step"), anomaly.get("end_step")
    if start is None:
        return ""
    if end is None:
        return f"{start}{dash}"
    return f"{start}" if end == start else f"{start}{dash}{end}"


def dashboard_link(base: str, run: str, anomaly: Mapping[str, Any]) -> str:
    """Link opening the dashboard's Anomalies page on the run, the step range and the ranks.

    ``?run=`` selects the run (read by the dashboard's frame); ``&step=START-END`` (``START`` while the
    anomaly is open) and ``&rank=R1,R2`` (omitted for job-wide anomalies) locate it.

    >>> dashboard_link("http://dash:8501/", "llama", {"step": 250, "end_step": 800, "ranks": [5]})
    'http://dash:8501/anomalies?run=llama&step=250-800&rank=5'
    """
    query: dict[str, str] = {"run": run}
    steps = step_range(anomaly, dash="-").rstrip("-")
    if steps:
        query["step"] = steps
    ranks = anomaly.get("ranks") or []
    if ranks:
        query["rank"] = ",".join(str(r) for r in ranks)
    return f"{base.rstrip('/')}/anomalies?{urlencode(query, safe=',-')}"


@dataclass
class Alert:
    """One anomaly of one run as an alert.

    Attributes
    ----------
    key : str
        ``<run>/<anomaly id>`` (anomaly ids are unique within a run only).
    labels : dict[str, str]
        :data:`~trainhealth.matchers.LABELS`.
    anomaly : dict
        The anomaly's full JSON as ``th:{run}:anomalies`` stores it (``id``, ``kind``, ``severity``, ``status``,
        ``step``, ``end_step``, ``ranks``, ``hosts``, ``evidence``, ``message``, ``gen``, ``first_seen``,
        ``last_seen``, maybe ``recommendation``; docs/schemas/anomaly.json).
    status : str
        ``firing`` while the anomaly is active, ``resolved`` once over.
    point : bool
        A point event: the anomaly was first seen already over (``restart``). It is notified once as
        firing and never resolved.
    """

    key: str
    labels: dict[str, str]
    anomaly: dict[str, Any]
    status: str = FIRING
    point: bool = False

    @classmethod
    def from_transition(cls, run: str, transition: str, anomaly: Mapping[str, Any]) -> Alert:
        """The alert of an ``anomaly_log`` entry (``transition`` is ``opened``, ``updated`` or ``resolved``)."""
        resolved = anomaly.get("status") == "resolved"
        return cls(key=f"{run}/{anomaly.get('id', '')}", labels=labels_of(run, anomaly), anomaly=dict(anomaly),
                   status=RESOLVED if resolved else FIRING, point=transition == "opened" and resolved)

    @property
    def run(self) -> str:
        return self.labels["run"]

    @property
    def severity(self) -> str:
        return self.labels["severity"]

    @property
    def starts_at(self) -> float | None:
        v = self.anomaly.get("first_seen")
        return float(v) if v is not None else None

    @property
    def ends_at(self) -> float | None:
        """When the anomaly was seen over (its ``last_seen`` once resolved), else None."""
        if self.status != RESOLVED and not self.point:
            return None
        v = self.anomaly.get("last_seen")
        return float(v) if v is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "labels": dict(self.labels), "anomaly": self.anomaly, "status": self.status,
                "point": self.point}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Alert:
        return cls(key=d["key"], labels={k: str(d["labels"].get(k, "")) for k in LABELS}, anomaly=dict(d["anomaly"]),
                   status=d.get("status", FIRING), point=bool(d.get("point", False)))


def idempotency_key(group_key: str, group_started: float, seq: int, sink: str) -> str:
    """Stable key of one notification to one sink (32 hex digits).

    sha256 of ``"<group key>\\n<group start, repr of unix s>\\n<seq>\\n<sink>"``. The group's start time
    tells apart two lives of a group (it is deleted once all its alerts resolved, and a later alert with
    the same labels starts it again at sequence 1). The same notification retried, or re-sent after a
    worker crash, keeps its key, so a receiver that remembers keys sees it once.

    >>> idempotency_key('root:{run="a",kind="hang"}', 1796000000.0, 1, "ops")
    '59dd2ffb6eb41bd452ae07ad46e68207'
    """
    return hashlib.sha256(f"{group_key}\n{group_started!r}\n{seq}\n{sink}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Notification:
    """One flush of one alert group that must reach the route's receivers.

    Attributes
    ----------
    group_key : str
        ``<route id>:{label="value",...}`` (Alertmanager's group key form).
    route : str
        Route id.
    receivers : tuple[str, ...]
        Sink names.
    group_labels : dict[str, str]
        The ``group_by`` labels and their values.
    seq : int
        1, 2, 3... per group: the notification's number within its group.
    group_started : float
        Unix seconds the group was created (its life; with ``group_key`` and ``seq`` it makes the key).
    at : float
        Unix seconds of the flush (the group's scheduled time, not the wall clock of the worker).
    reason : str
        One of :data:`REASONS`.
    firing, resolved : tuple[Alert, ...]
        The group's firing alerts (silenced/inhibited ones removed) and the alerts resolved since they
        were last notified as firing.
    """

    group_key: str
    route: str
    receivers: tuple[str, ...]
    group_labels: dict[str, str]
    seq: int
    at: float
    reason: str
    firing: tuple[Alert, ...] = ()
    resolved: tuple[Alert, ...] = ()
    group_started: float = 0.0

    @property
    def status(self) -> str:
        """``firing`` when any alert fires, else ``resolved`` (Alertmanager's webhook convention)."""
        return FIRING if self.firing else RESOLVED

    @property
    def alerts(self) -> tuple[Alert, ...]:
        return self.firing + self.resolved

    def idempotency_key(self, sink: str) -> str:
        """See :func:`idempotency_key`."""
        return idempotency_key(self.group_key, self.group_started, self.seq, sink)

    def common_labels(self) -> dict[str, str]:
        """Labels with the same value on every alert of the notification."""
        alerts = self.alerts
        if not alerts:
            return dict(self.group_labels)
        first = alerts[0].labels
        return {k: v for k, v in first.items() if all(a.labels.get(k) == v for a in alerts[1:])}

    def to_dict(self) -> dict[str, Any]:
        return {"group_key": self.group_key, "route": self.route, "receivers": list(self.receivers),
                "group_labels": dict(self.group_labels), "seq": self.seq, "at": self.at, "reason": self.reason,
                "firing": [a.to_dict() for a in self.firing], "resolved": [a.to_dict() for a in self.resolved],
                "group_started": self.group_started}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Notification:
        return cls(group_key=d["group_key"], route=d["route"], receivers=tuple(d["receivers"]),
                   group_labels=dict(d["group_labels"]), seq=int(d["seq"]), at=float(d["at"]), reason=d["reason"],
                   firing=tuple(Alert.from_dict(a) for a in d["firing"]),
                   resolved=tuple(Alert.from_dict(a) for a in d["resolved"]),
                   group_started=float(d.get("group_started", 0.0)))
