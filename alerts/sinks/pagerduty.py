"""PagerDuty Events API v2 sink: ``trigger`` while a group fires, ``resolve`` when it has resolved.

Event shape (https://developer.pagerduty.com/docs/events-api-v2/trigger-events/, the ``PagerDuty/api-schema``
OpenAPI of ``POST https://events.pagerduty.com/v2/enqueue``): ``routing_key`` (the integration key, a
secret), ``event_action`` (``trigger``/``resolve``), ``dedup_key`` (≤ 255 chars), and for a trigger a
``payload`` with ``summary`` (≤ 1024 chars), ``source``, ``severity`` (``critical``, ``error``,
``warning``, ``info``), ``timestamp``, ``component``, ``group``, ``class``, ``custom_details``, plus
``client``, ``client_url`` and ``links``.

One PagerDuty alert per alert group, as Alertmanager's PagerDuty receiver does: ``dedup_key`` is the group
key (its sha256 when longer than 255 chars), so every notification of a group updates the same alert,
a retry is harmless (PagerDuty de-duplicates on the key) and the resolve closes it. A ``restart`` point
event triggers an alert that nobody resolves automatically: route restarts elsewhere if that is unwanted.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from trainhealth.alerts.notification import FIRING, Alert, Notification, dashboard_link, json_safe, step_range
from trainhealth.alerts.secrets import Secret
from trainhealth.alerts.sinks.base import Sink
from trainhealth.alerts.text import recommendation_text, summary, top_severity

DEFAULT_URL = "https://events.pagerduty.com/v2/enqueue"
DEDUP_MAX = 255


def dedup_key(group_key: str) -> str:
    """The group key, or its sha256 hex when longer than PagerDuty's 255 characters."""
    return group_key if len(group_key) <= DEDUP_MAX else hashlib.sha256(group_key.encode()).hexdigest()


def _detail(a: Alert) -> dict[str, Any]:
    d = {"status": a.status, "kind": a.labels["kind"], "severity": a.severity, "steps": step_range(a.anomaly),
         "ranks": a.anomaly.get("ranks") or [], "hosts": a.anomaly.get("hosts") or [],
         "message": a.anomaly.get("message", ""), "evidence": json_safe(a.anomaly.get("evidence") or {})}
    rec = recommendation_text(a.anomaly.get("recommendation"))
    if rec:
        d["recommendation"] = rec
    return d


def pagerduty_event(n: Notification, routing_key: str, dashboard_url: str) -> dict[str, Any]:
    """The Events API v2 JSON for notification ``n`` (``routing_key`` revealed by the caller only)."""
    event: dict[str, Any] = {"routing_key": routing_key, "dedup_key": dedup_key(n.group_key),
                             "event_action": "trigger" if n.status == FIRING else "resolve"}
    if n.status != FIRING:
        return event
    first = n.firing[0]
    run = first.run
    hosts = first.anomaly.get("hosts") or []
    event["payload"] = {
        "summary": summary(n, limit=1024),
        "source": str(hosts[0]) if hosts else f"trainhealth/{run}",
        "severity": top_severity(n.firing),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(n.at)),
        "component": ",".join(f"rank {r}" for r in first.anomaly.get("ranks") or []) or "all ranks",
        "group": run,
        "class": first.labels["kind"],
        "custom_details": {"group_labels": dict(n.group_labels), "notification": n.seq, "reason": n.reason,
                           "firing": [_detail(a) for a in n.firing], "resolved": [_detail(a) for a in n.resolved]},
    }
    event["client"] = "trainhealth"
    if run != "*":
        link = dashboard_link(dashboard_url, run, first.anomaly)
        event["client_url"] = link
        event["links"] = [{"href": link, "text": "Open in the trainhealth dashboard"}]
    return event


class PagerDutySink(Sink):
    """Sends :func:`pagerduty_event` to the Events API v2 (``url`` defaults to :data:`DEFAULT_URL`)."""

    type = "pagerduty"

    def __init__(self, name: str, url: Secret, *, routing_key: Secret, **kw: Any) -> None:
        super().__init__(name, url, **kw)
        self.routing_key = routing_key

    def secrets(self) -> tuple[Secret, ...]:
        return (self.url, self.routing_key)

    def payload(self, n: Notification, key: str) -> dict[str, Any]:
        return pagerduty_event(n, self.routing_key.reveal(), self.dashboard_url)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["secrets"]["routing_key"] = self.routing_key.source
        return d
