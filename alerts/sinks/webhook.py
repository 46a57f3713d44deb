"""Generic JSON webhook sink: a documented, versioned payload, an idempotency key and an HMAC signature.

Request (documented in ``docs/alerts.md``, "JSON webhook")::

    POST <url>
    Content-Type: application/json; charset=utf-8
    Idempotency-Key: <32 hex>                      (same on every retry of this notification to this sink)
    X-Trainhealth-Signature: t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>
    X-Trainhealth-Payload-Version: 1

Body: :func:`webhook_payload` (``"version": "1"``). Receivers verify the signature over the raw body
(:func:`trainhealth.alerts.signing.verify`), reject stale timestamps, and drop a request whose
``Idempotency-Key`` they already processed: delivery is at-least-once, so a retry after a lost response
or a worker crash re-sends the same key and body.
"""

from __future__ import annotations

from typing import Any

from trainhealth.alerts.notification import Alert, Notification, dashboard_link
from trainhealth.alerts.secrets import Secret
from trainhealth.alerts.signing import HEADER, sign
from trainhealth.alerts.sinks.base import Sink

PAYLOAD_VERSION = "1"
IDEMPOTENCY_HEADER = "Idempotency-Key"
VERSION_HEADER = "X-Trainhealth-Payload-Version"


def alert_json(alert: Alert, dashboard_url: str) -> dict[str, Any]:
    """One alert of the v1 payload."""
    run = alert.run
    return {"key": alert.key, "status": alert.status, "point_event": alert.point, "labels": dict(alert.labels),
            "starts_at": alert.starts_at, "ends_at": alert.ends_at,
            "dashboard_url": dashboard_link(dashboard_url, run, alert.anomaly) if run != "*" else None,
            "anomaly": alert.anomaly}


def webhook_payload(n: Notification, key: str, receiver: str, dashboard_url: str) -> dict[str, Any]:
    """The v1 JSON document (field by field in ``docs/alerts.md``)."""
    return {
        "version": PAYLOAD_VERSION,
        "idempotency_key": key,
        "receiver": receiver,
        "status": n.status,
        "reason": n.reason,
        "group_key": n.group_key,
        "sequence": n.seq,
        "notified_at": n.at,
        "group_labels": dict(n.group_labels),
        "common_labels": n.common_labels(),
        "alerts": [alert_json(a, dashboard_url) for a in n.alerts],
    }


class WebhookSink(Sink):
    """POSTs :func:`webhook_payload`, signed with ``secret`` (env or file), with an ``Idempotency-Key``."""

    type = "webhook"

    def __init__(self, name: str, url: Secret, *, secret: Secret, **kw: Any) -> None:
        super().__init__(name, url, **kw)
        self.secret = secret

    def secrets(self) -> tuple[Secret, ...]:
        return (self.url, self.secret)

    def payload(self, n: Notification, key: str) -> dict[str, Any]:
        return webhook_payload(n, key, self.name, self.dashboard_url)

    def headers(self, body: bytes, key: str, now: float) -> dict[str, str]:
        h = super().headers(body, key, now)
        h[IDEMPOTENCY_HEADER] = key
        h[VERSION_HEADER] = PAYLOAD_VERSION
        h[HEADER] = sign(body, self.secret.reveal().encode(), int(now))
        return h

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["secrets"]["secret"] = self.secret.source
        return d
