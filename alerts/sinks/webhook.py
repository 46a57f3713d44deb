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

from typing import Annotated, Any, Literal, TypedDict

from msgspec import Meta

from trainhealth.alerts.notification import Alert, AlertStatus, Notification, Reason, dashboard_link
from trainhealth.alerts.secrets import Secret
from trainhealth.alerts.signing import HEADER, sign
from trainhealth.alerts.sinks.base import Sink
from trainhealth.matchers import AlertLabels, Label

PAYLOAD_VERSION = "1"
IDEMPOTENCY_HEADER = "Idempotency-Key"
VERSION_HEADER = "X-Trainhealth-Payload-Version"


class WebhookAlert(TypedDict):
    """One alert of the payload: one anomaly of one run.

    Attributes
    ----------
    key : str
        ``<run>/<anomaly id>``.
    status : str
        ``firing`` while the anomaly is active, ``resolved`` once over.
    point_event : bool
        The anomaly was first seen already over (a ``restart``): notified once as firing, never resolved.
    labels : AlertLabels
        The alert's labels.
    starts_at : float | None
        Unix s the detector service first saw the anomaly (its ``first_seen``).
    ends_at : float | None
        Unix s it was seen over (its ``last_seen`` once resolved); null while it fires.
    dashboard_url : str | None
        The dashboard's Anomalies page on the run, the step range and the ranks; null for ``service_down``.
    anomaly : dict
        The anomaly's full JSON as ``th:{run}:anomalies`` stores it (or the ``service_down`` alert's own), NaN/Inf as
        the strings ``"nan"``, ``"inf"``, ``"-inf"``.
    """

    key: str
    status: AlertStatus
    point_event: bool
    labels: AlertLabels
    starts_at: float | None
    ends_at: float | None
    dashboard_url: str | None
    anomaly: dict[str, Any]


class WebhookPayload(TypedDict):
    """The JSON webhook's body, payload version 1 (docs/alerts.md, "JSON webhook"): one flush of one alert group to
    one receiver. Fields are only ever added within a version.

    Attributes
    ----------
    version : str
        ``"1"``.
    idempotency_key : str
        As the ``Idempotency-Key`` header: identical on every retry and re-send of this notification to this
        receiver.
    receiver : str
        The sink's name.
    status : str
        ``firing`` (some alert fires) or ``resolved``.
    reason : str
        Why it was sent: ``new`` (first of its group), ``update`` (the group changed), ``resolved`` (only resolved
        alerts), ``repeat`` (the unchanged firing group after ``repeat_interval``).
    group_key : str
        ``<route>:{run="...",kind="..."}``.
    sequence : int
        1, 2, ... within the group's life.
    notified_at : float
        Unix s of the flush.
    group_labels : dict[str, str]
        The group's labels (the route's ``group_by``).
    common_labels : dict[str, str]
        The labels equal on every alert.
    alerts : list[WebhookAlert]
        The group's firing alerts, then those resolved since last notified.
    """

    version: Literal["1"]
    idempotency_key: Annotated[str, Meta(pattern="^[0-9a-f]{32}$")]
    receiver: str
    status: AlertStatus
    reason: Reason
    group_key: str
    sequence: Annotated[int, Meta(ge=1)]
    notified_at: float
    group_labels: dict[Label, str]
    common_labels: dict[Label, str]
    alerts: list[WebhookAlert]


def alert_json(alert: Alert, dashboard_url: str) -> WebhookAlert:
    """One alert of the v1 payload."""
    run = alert.run
    return {"key": alert.key, "status": alert.status, "point_event": alert.point, "labels": dict(alert.labels),
            "starts_at": alert.starts_at, "ends_at": alert.ends_at,
            "dashboard_url": dashboard_link(dashboard_url, run, alert.anomaly) if run != "*" else None,
            "anomaly": alert.anomaly}


def webhook_payload(n: Notification, key: str, receiver: str, dashboard_url: str) -> WebhookPayload:
    """The v1 JSON document (field by field in ``docs/alerts.md``; JSON Schema: docs/schemas/webhook-payload.json)."""
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
