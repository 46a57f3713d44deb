"""The grouping engine: alerts and a clock in, due notifications out. Pure logic, no I/O.

It follows Prometheus Alertmanager's aggregation groups and notification timers
(https://prometheus.io/docs/alerting/latest/configuration/#route, and Alertmanager's ``dispatch`` and
``notify`` dedup stage):

- An alert is routed (:class:`~trainhealth.alerts.routing.Route`) to one or more routes; in each it joins
  the group of its ``group_by`` label values (default ``run`` and ``kind``).
- A new group flushes first ``group_wait`` after it was created, then every ``group_interval``.
- At a flush, silenced and inhibited alerts are left out. A notification is emitted when the group has
  never notified and has firing alerts, when a firing alert is new or escalated in severity since the
  group's last notification, when alerts notified as firing have resolved, or when the firing group is
  unchanged but ``repeat_interval`` has passed since the last notification.
- Resolved alerts leave the group after the flush; an empty group is deleted.

Deliberate differences from Alertmanager, for training runs:

- **Flapping is suppressed**: an alert that resolves before it was ever notified as firing (e.g. it ends
  within ``group_wait``) is dropped silently; no "resolved" is ever sent for it.
- **A resolve always goes out**: an alert notified as firing is reported resolved even if a silence or
  an inhibition mutes it meanwhile (it closes PagerDuty incidents; a silence stops noise, not closure).
- **Point events** (``restart``: the anomaly is born resolved) are notified once as firing, never resolved.
- A severity **escalation** of a notified alert (``loss_spike`` warning → critical) counts as new.
- **Quiet observations** (:meth:`Grouper.observe` with ``quiet=True``; the worker's catch-up of stale
  transitions, :mod:`trainhealth.alerts.intake`): a firing alert joins its group as known but never notified
  (``Group.quiet``), so it makes no notification by itself, a later ``updated`` at the same severity is no
  news, and its later resolve is dropped like a flapping alert's. It is news again when it escalates above the
  severity it was observed at, and it is shown as firing in any notification its group sends for another
  reason (after which it counts as notified). A quiet point event is dropped; a quiet resolve is an ordinary
  one (the resolve of an alert notified as firing goes out).
- **Runs that are over** (:attr:`Grouper.ended_runs`, kept by the worker: the run's status is no longer
  ``running`` and it wrote no transition for a while) mute their alerts like a silence: no new notification,
  no repeat; a resolve of an alert notified as firing still goes out.

Time is whatever the caller passes (unix seconds): the worker passes each transition's ``last_seen``
and the wall clock; tests pass numbers. Flushes happen at their scheduled times, so the outcome is a
deterministic function of the inputs. When the engine is advanced past several ticks of a group at once
(a worker catching up after downtime) the group is flushed once, at the latest due tick.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainhealth.alerts.inhibition import InhibitRule, inhibited
from trainhealth.alerts.notification import FIRING, RESOLVED, Alert, Notification
from trainhealth.alerts.routing import Route
from trainhealth.silences import Silence, muted_by

log = logging.getLogger(__name__)

_SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


def _rank(severity: str | None) -> int:
    return _SEVERITY_RANK.get(severity or "", -1)


def _higher(old: str | None, new: str) -> str:
    """The higher of two severities (``new`` on a tie or when ``old`` is None)."""
    return new if _rank(new) >= _rank(old) else old  # type: ignore[return-value]


def _tick_after(ts: float, interval: float, t: float) -> float:
    """The first tick ``ts + k * interval`` (k >= 1) later than ``t``; the next float after ``t`` when rounding
    makes that tick equal to ``t`` or earlier."""
    nxt = ts + (math.floor((t - ts) / interval) + 1) * interval if interval > 0 else t
    return nxt if nxt > t else math.nextafter(t, math.inf)


def group_labels(route: Route, labels: Mapping[str, str], alert_key: str) -> dict[str, str]:
    """The labels that form an alert's group on ``route`` (``...``: every label plus the alert key as ``id``)."""
    if route.group_by == ("...",):
        return {**labels, "id": alert_key}
    return {k: labels.get(k, "") for k in route.group_by}


def group_key(route: Route, glabels: Mapping[str, str]) -> str:
    """``<route id>:{run="r",kind="k"}``: Alertmanager's group key form, labels in ``group_by`` order."""
    inner = ",".join(f"{k}={json.dumps(v)}" for k, v in glabels.items())
    return f"{route.id}:{{{inner}}}"


@dataclass
class Group:
    """State of one aggregation group (see the module doc); all times unix seconds."""

    key: str
    route: Route
    labels: dict[str, str]
    created_at: float
    next_flush: float
    alerts: dict[str, Alert] = field(default_factory=dict)
    last_notified_at: float | None = None
    #: Alert key -> highest severity notified as firing (the alerts a later "resolved" must report).
    notified: dict[str, str] = field(default_factory=dict)
    seq: int = 0
    #: Alert key -> highest severity observed quietly (stale at the worker's start), never notified: no news
    #: until it escalates above it; its resolve is not reported. Disjoint from :attr:`notified`.
    quiet: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "route": self.route.id, "labels": self.labels, "created_at": self.created_at,
                "next_flush": self.next_flush, "alerts": [a.to_dict() for a in self.alerts.values()],
                "last_notified_at": self.last_notified_at, "notified": self.notified, "seq": self.seq,
                "quiet": self.quiet}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], route: Route) -> Group:
        alerts = [Alert.from_dict(a) for a in d.get("alerts", [])]
        return cls(key=d["key"], route=route, labels=dict(d["labels"]), created_at=float(d["created_at"]),
                   next_flush=float(d["next_flush"]), alerts={a.key: a for a in alerts},
                   last_notified_at=None if d.get("last_notified_at") is None else float(d["last_notified_at"]),
                   notified=dict(d.get("notified", {})), seq=int(d.get("seq", 0)), quiet=dict(d.get("quiet", {})))


class Grouper:
    """Alertmanager-style grouping, silencing and inhibition over a caller-driven clock.

    Parameters
    ----------
    root : Route
        The routing tree.
    inhibit_rules : sequence of InhibitRule
        Evaluated at each flush against every firing alert the engine holds.
    silences : sequence of Silence
        Replace :attr:`silences` whenever they change (the worker reloads them every second).
    now : float
        Initial clock (unix seconds); it only moves forward.

    :attr:`ended_runs` (run ids) mutes the alerts of runs that are over, as a silence would; the worker
    replaces it as runs end (:mod:`trainhealth.alerts.intake`).

    Use :meth:`observe` for each alert state change and :meth:`advance` for the passage of time; both
    return the notifications that became due, in flush order. :meth:`take_changes` tells which groups
    changed, for persisting them (:meth:`dump`, :meth:`load`).
    """

    def __init__(self, root: Route, inhibit_rules: Sequence[InhibitRule] = (), silences: Sequence[Silence] = (),
                 now: float = 0.0) -> None:
        self.root = root
        self.inhibit_rules = tuple(inhibit_rules)
        self.silences: Sequence[Silence] = tuple(silences)
        self.ended_runs: frozenset[str] = frozenset()
        self.now = float(now)
        self.groups: dict[str, Group] = {}
        self._routes = {r.id: r for r in root.walk()}
        self._changed: set[str] = set()

    # -- input ------------------------------------------------------------------------------------------
    def observe(self, alert: Alert, t: float, quiet: bool = False) -> list[Notification]:
        """Apply one alert state at time ``t`` (clamped to the engine's clock); returns notifications due by then.

        Groups due at or before ``t`` are flushed first, so an alert arriving exactly at a flush time
        joins the next flush.

        Parameters
        ----------
        alert : Alert
            The alert's new state.
        t : float
            Event time (unix seconds).
        quiet : bool
            Track the alert without notifying it (see the module doc, "Quiet observations"): a firing alert
            joins its group as known, a point event is dropped, a resolve is applied as usual.

        Returns
        -------
        list of Notification
            The flushes due by ``t``, in time order.
        """
        out = self.advance(t)
        if quiet and alert.point:
            return out  # a stale point event is history: nothing to track, nothing to resolve later
        targets: dict[str, tuple[Route, dict[str, str]]] = {}
        for route in self.root.match(alert.labels):
            gl = group_labels(route, alert.labels, alert.key)
            targets[group_key(route, gl)] = (route, gl)
        for gk, g in self.groups.items():  # re-routed (e.g. escalated to another route): leave the old group
            if alert.key in g.alerts and gk not in targets:
                del g.alerts[alert.key]
                g.notified.pop(alert.key, None)
                g.quiet.pop(alert.key, None)
                self._changed.add(gk)
        for gk, (route, gl) in targets.items():
            g = self.groups.get(gk)
            existing = g.alerts.get(alert.key) if g else None
            if existing is not None and existing.point:
                continue  # a point event's later transitions change nothing
            if existing is None and alert.status == RESOLVED and not alert.point:
                continue  # a resolved alert the group does not hold: nothing to tell anyone
            if g is None:
                g = Group(key=gk, route=route, labels=gl, created_at=self.now,
                          next_flush=self.now + route.timers.group_wait)
                self.groups[gk] = g
            g.alerts[alert.key] = alert
            if quiet and alert.status == FIRING:
                if alert.key in g.notified:  # a stale escalation of a notified alert: absorbed, not news
                    g.notified[alert.key] = _higher(g.notified[alert.key], alert.severity)
                else:
                    g.quiet[alert.key] = _higher(g.quiet.get(alert.key), alert.severity)
            self._changed.add(gk)
        return out

    def advance(self, t: float) -> list[Notification]:
        """Move the clock to ``t`` (never backwards) and flush every group due by then, in time order."""
        t = max(float(t), self.now)
        if not math.isfinite(t):
            raise ValueError(f"time {t!r} is not a finite unix time")
        out: list[Notification] = []
        while True:
            due = [g for g in self.groups.values() if g.next_flush <= t]
            if not due:
                break
            g = min(due, key=lambda g: (g.next_flush, g.key))
            ts = g.next_flush
            interval = g.route.timers.group_interval
            if interval > 0 and t - ts >= interval:  # catching up: one flush at the latest due tick
                ts += math.floor((t - ts) / interval) * interval
            n = self._flush(g, ts)
            if n is not None:
                out.append(n)
            if g.key in self.groups and g.next_flush <= t:
                # ``ts + interval`` did not move past ``t`` (float rounding: at 1e16 s and beyond ``ts + 1 == ts``):
                # the next tick is the first one after ``t``, so each group flushes at most once here.
                g.next_flush = _tick_after(ts, interval, t)
        self.now = t
        return out

    # -- the flush ----------------------------------------------------------------------------------------
    def _firing_everywhere(self) -> list[tuple[str, Mapping[str, str]]]:
        seen: dict[str, Mapping[str, str]] = {}
        for g in self.groups.values():
            for a in g.alerts.values():
                if a.status == FIRING and not a.point:
                    seen.setdefault(a.key, a.labels)
        return list(seen.items())

    def muted(self, alert: Alert, t: float) -> str | None:
        """Why ``alert`` is muted at ``t``: ``"silence <id>"``, ``"run over"``, ``"inhibited by <key>"``, or None."""
        s = muted_by(self.silences, alert.labels, t)
        if s is not None:
            return f"silence {s.id}"
        if alert.labels.get("run") in self.ended_runs:
            return "run over"
        src = inhibited(self.inhibit_rules, alert.key, alert.labels, self._firing_everywhere())
        return f"inhibited by {src}" if src else None

    def _flush(self, g: Group, ts: float) -> Notification | None:
        self._changed.add(g.key)
        timers = g.route.timers
        live = [a for a in g.alerts.values() if a.status == FIRING or a.point]
        muted = {a.key for a in live if self.muted(a, ts)}
        order = sorted(g.alerts.values(), key=lambda a: (a.starts_at or 0.0, a.key))
        firing = [a for a in order if (a.status == FIRING or a.point) and a.key not in muted]
        resolved = [a for a in order if a.status == RESOLVED and not a.point and a.key in g.notified]
        changed = any(self._news(g, a) for a in firing)
        reason = ""
        if g.last_notified_at is None:
            reason = "new" if changed else ""
        elif changed:
            reason = "update"
        elif resolved:
            reason = "update" if firing else "resolved"
        elif firing and ts - g.last_notified_at >= timers.repeat_interval:
            reason = "repeat"
        note = None
        if reason:
            g.seq += 1
            g.last_notified_at = ts
            note = Notification(group_key=g.key, route=g.route.id, receivers=g.route.receivers,
                                group_labels=dict(g.labels), seq=g.seq, at=ts, reason=reason,
                                firing=tuple(firing), resolved=tuple(resolved), group_started=g.created_at)
            notified: dict[str, str] = {}
            for a in g.alerts.values():
                if a.status != FIRING or a.point:
                    continue
                if a.key not in muted:  # shown as firing now (a quiet one too): its resolve must be reported
                    old = g.notified.get(a.key)
                    notified[a.key] = a.severity if _rank(a.severity) >= _rank(old) else old  # type: ignore[assignment]
                    g.quiet.pop(a.key, None)
                elif a.key in g.notified:  # muted meanwhile: keep, so that its resolve still goes out
                    notified[a.key] = g.notified[a.key]
            g.notified = notified
        # Resolved alerts leave (reported now, or never notified: flapping), and point events leave once
        # flushed (notified now, or muted).
        for a in list(g.alerts.values()):
            if a.status == RESOLVED or a.point:
                del g.alerts[a.key]
        g.notified = {k: v for k, v in g.notified.items() if k in g.alerts}
        g.quiet = {k: v for k, v in g.quiet.items() if k in g.alerts and k not in g.notified}
        g.next_flush = ts + timers.group_interval
        if not g.alerts:
            del self.groups[g.key]
        return note

    @staticmethod
    def _news(g: Group, a: Alert) -> bool:
        """Whether firing alert ``a`` is news for group ``g``: a point event, an alert never notified nor
        observed quietly, or one whose severity rose above what was notified (or observed quietly)."""
        if a.point:
            return True
        if a.key in g.quiet:
            return _rank(a.severity) > _rank(g.quiet[a.key])
        if g.last_notified_at is None:
            return True
        return _rank(a.severity) > _rank(g.notified.get(a.key))

    # -- state --------------------------------------------------------------------------------------------
    def alerts(self) -> Iterable[tuple[Group, Alert]]:
        """Every (group, alert) the engine holds."""
        for g in self.groups.values():
            for a in g.alerts.values():
                yield g, a

    def holds(self, alert_key: str) -> bool:
        """True when some group holds the alert ``alert_key``."""
        return any(alert_key in g.alerts for g in self.groups.values())

    def next_due(self) -> float | None:
        """Unix time of the next scheduled flush, or None without groups."""
        return min((g.next_flush for g in self.groups.values()), default=None)

    def take_changes(self) -> tuple[dict[str, dict[str, Any]], set[str]]:
        """Groups changed since the last call: ``(key -> state dict for live groups, keys of deleted groups)``."""
        upserts = {k: self.groups[k].to_dict() for k in self._changed if k in self.groups}
        deleted = {k for k in self._changed if k not in self.groups}
        self._changed.clear()
        return upserts, deleted

    def dump(self) -> dict[str, dict[str, Any]]:
        """Every group's state (JSON-ready)."""
        return {k: g.to_dict() for k, g in self.groups.items()}

    def load(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the groups with persisted states. A group whose route no longer exists (the config
        changed) is dropped with a warning; its alerts rejoin through the new routes on their next change."""
        self.groups.clear()
        for key, d in states.items():
            route = self._routes.get(d.get("route", ""))
            if route is None:
                log.warning("dropping alert group %s: its route %r is no longer in the config", key, d.get("route"))
                self._changed.add(key)
                continue
            self.groups[key] = Group.from_dict(d, route)
