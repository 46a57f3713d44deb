"""Prometheus Alertmanager sink: the alerts themselves, POSTed to Alertmanager's API v2, for a team that already
routes, groups, silences and inhibits there.

API (Alertmanager's OpenAPI spec ``api/v2/openapi.yaml``, ``POST /api/v2/alerts`` with a ``postableAlerts`` body): a
JSON list of alerts, each with ``labels`` (required: they *are* the alert's identity, Alertmanager fingerprints
them), ``annotations``, ``startsAt`` and ``endsAt`` (RFC 3339 date-times) and ``generatorURL``. Alertmanager answers
200; 400 naming the invalid alerts of the batch (it keeps the valid ones); 500. It drops labels with an empty value.
An alert is active until its ``endsAt``; one sent without ``endsAt`` until ``resolve_timeout`` (default 5 min)
after it was last received. So, as Prometheus does, an active alert is re-sent every ``resend_interval`` with
``endsAt`` = the send time + 4 intervals (:data:`~trainhealth.defaults.ALERT_AM_VALIDITY_FACTOR`), and an alert that
ended is sent with ``endsAt`` = when it ended; a worker that stops sending lets Alertmanager resolve its alerts.

This sink is no receiver of the worker's grouped notifications (:meth:`AlertmanagerSink.visible` is None for every
one, so none reaches the outbox): :mod:`trainhealth.alerts.forwarding` keeps what each Alertmanager must know and
sends it through :meth:`AlertmanagerSink.post`.

**Labels** (:func:`alert_labels`): ``alertname`` (the anomaly kind), ``run``, ``severity``, ``anomaly`` (the anomaly's
id: stable for its whole life, and what keeps two loss spikes of one run two alerts), ``rank`` and ``host``
(comma-joined, only for 1 to :data:`~trainhealth.defaults.ALERT_AM_MAX_LABEL_MEMBERS` members), then the sink's
own ``labels`` (``team``, ``cluster``). Never a value that changes between sends (a step, a loss, a score): those
are annotations. **Annotations** (:func:`alert_annotations`): ``summary``, ``description`` (the detector's message),
``recommendation`` (when there is one), ``dashboard`` (deep link), ``steps``, ``ranks``, ``hosts``, ``evidence``.
``generatorURL`` is the deep link too.

Credentials: HTTP basic auth (``username`` and a ``password`` secret) or a ``bearer_token`` secret, as Prometheus's
``alertmanager_config`` has them; both from the environment or a file, never logged.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

from trainhealth import defaults
from trainhealth.alerts.notification import Alert, Notification, dashboard_link
from trainhealth.alerts.secrets import Secret
from trainhealth.alerts.sinks.base import Request, SendResult, Sink
from trainhealth.alerts.text import evidence_items, recommendation_text, steps_words, where

API_PATH = "/api/v2/alerts"
#: Prometheus label names (Alertmanager rejects others); ``__``-prefixed names are reserved.
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
#: Labels every alert gets from the anomaly; a sink's own ``labels`` cannot redefine them.
ALERT_LABELS = ("alertname", "run", "severity", "anomaly", "rank", "host")
_SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


def api_url(base: str) -> str:
    """The alerts endpoint under an Alertmanager base URL (a URL already ending in it is kept).

    >>> api_url("http://am:9093"), api_url("https://h.example/alertmanager/")
    ('http://am:9093/api/v2/alerts', 'https://h.example/alertmanager/api/v2/alerts')
    >>> api_url("http://am:9093/api/v2/alerts")
    'http://am:9093/api/v2/alerts'
    """
    b = base.rstrip("/")
    return b if b.endswith(API_PATH) else b + API_PATH


def rfc3339(t: float) -> str:
    """Unix seconds as an RFC 3339 UTC date-time with milliseconds (Alertmanager's ``date-time``).

    >>> rfc3339(1800000000.0), rfc3339(1800000000.1236)
    ('2027-01-15T08:00:00.000Z', '2027-01-15T08:00:00.124Z')
    """
    sec, ms = divmod(round(t * 1000), 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)) + f".{ms:03d}Z"


def _members(values: Sequence[Any] | None) -> str:
    """Comma-joined ``values`` when there are 1 to ALERT_AM_MAX_LABEL_MEMBERS of them, else ``""`` (no label)."""
    values = list(values or ())
    return ",".join(map(str, values)) if 0 < len(values) <= defaults.ALERT_AM_MAX_LABEL_MEMBERS else ""


def higher_severity(a: str, b: str) -> str:
    """The more severe of two severities (``a`` on a tie)."""
    return b if _SEVERITY_RANK.get(b, -1) > _SEVERITY_RANK.get(a, -1) else a


def alert_labels(alert: Alert, extra: Mapping[str, str] | None = None, severity: str | None = None) -> dict[str, str]:
    """The Alertmanager labels of ``alert`` (see the module doc); labels with an empty value are left out.

    >>> a = Alert.from_transition("llama", "opened", {"id": "straggler:5:250:0", "kind": "straggler",
    ...                           "severity": "warning", "ranks": [5], "hosts": ["node-7"]})
    >>> alert_labels(a, {"team": "ml-infra"})
    {'alertname': 'straggler', 'run': 'llama', 'severity': 'warning', 'anomaly': 'straggler:5:250:0', 'rank': '5', \
'host': 'node-7', 'team': 'ml-infra'}
    """
    a = alert.anomaly
    labels = {"alertname": alert.labels["kind"], "run": alert.run, "severity": severity or alert.severity,
              "anomaly": str(a.get("id") or ""), "rank": _members(a.get("ranks")), "host": _members(a.get("hosts"))}
    labels.update(extra or {})
    return {k: v for k, v in labels.items() if v != ""}


_FNV_OFFSET, _FNV_PRIME = 14695981039346656037, 1099511628211


def fingerprint(labels: Mapping[str, str]) -> str:
    """Alertmanager's fingerprint of a label set, 16 hex digits: the ``fingerprint`` its API shows for the alert, and
    the alert's field in ``th:{alerts}:forward:<sink>``.

    FNV-1a 64 over the label names in sorted order, each followed by a 0xFF byte, its value and a 0xFF byte
    (``prometheus/common`` ``model.LabelSet.Fingerprint``).

    >>> fingerprint({"alertname": "straggler", "run": "r1", "severity": "warning"})
    '8712575810a1ec62'
    """
    h = _FNV_OFFSET
    for name in sorted(labels):
        for part in (name.encode(), b"\xff", labels[name].encode(), b"\xff"):
            for byte in part:
                h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def alert_annotations(alert: Alert, dashboard_url: str) -> dict[str, str]:
    """The annotations of ``alert``: what a human reads; free to change between sends (see the module doc)."""
    a = alert.anomaly
    kind, run = alert.labels["kind"], alert.run
    message = str(a.get("message") or kind)
    steps = steps_words(a)
    summary = message if run == "*" else f"{kind} in run {run}: {where(alert)}" + (f", {steps}" if steps else "")
    out = {"summary": summary, "description": message}
    rec = recommendation_text(a.get("recommendation"))
    if rec:
        out["recommendation"] = rec
    if run != "*":
        out["dashboard"] = dashboard_link(dashboard_url, run, a)
    if steps:
        out["steps"] = steps
    for name in ("ranks", "hosts"):
        if a.get(name):
            out[name] = ",".join(map(str, a[name]))
    evidence = evidence_items(a.get("evidence"))
    if evidence:
        out["evidence"] = ", ".join(f"{k}={v}" for k, v in evidence)
    return out


@dataclass
class AmAlert:
    """One alert as an Alertmanager sink must tell it, stored as JSON in ``th:{alerts}:forward:<sink>``.

    Attributes
    ----------
    key : str
        The worker's alert key, ``<run>/<anomaly id>``.
    labels, annotations : dict[str, str]
        As sent (:func:`alert_labels`, :func:`alert_annotations`).
    starts_at : float
        Unix s of the onset: the anomaly's ``first_seen``.
    ends_at : float or None
        None while it fires (each send says ``now + validity``); else unix s it ended, sent as is.
    closed_at : float or None
        Unix s the worker learnt it ended (resolved, routed elsewhere, its run over, replaced by a more severe
        label set), None while it fires: after ``closed_at + validity`` Alertmanager's copy has expired by itself.
    generator_url : str
        The dashboard deep link, "" for the worker's own ``service_down``.
    """

    key: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None = None
    closed_at: float | None = None
    generator_url: str = ""
    fp: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.fp = fingerprint(self.labels)

    @property
    def firing(self) -> bool:
        return self.ends_at is None

    @property
    def run(self) -> str:
        return self.labels.get("run", self.key.partition("/")[0])

    def closed(self, at: float, annotations: Mapping[str, str] | None = None) -> AmAlert:
        """This alert ended at unix s ``at`` (not before its start), learnt at ``at``."""
        return replace(self, ends_at=max(at, self.starts_at), closed_at=at,
                       annotations=dict(annotations) if annotations is not None else dict(self.annotations))

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("fp")
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> AmAlert:
        """Raises ValueError, KeyError or TypeError for a record that is not one."""
        d = json.loads(raw)
        labels, annotations = d["labels"], d["annotations"]
        if not (isinstance(labels, dict) and isinstance(annotations, dict)):
            raise TypeError("labels and annotations must be objects")
        ends, closed = d.get("ends_at"), d.get("closed_at")
        return cls(key=str(d["key"]), labels={str(k): str(v) for k, v in labels.items()},
                   annotations={str(k): str(v) for k, v in annotations.items()}, starts_at=float(d["starts_at"]),
                   ends_at=None if ends is None else float(ends), closed_at=None if closed is None else float(closed),
                   generator_url=str(d.get("generator_url") or ""))

    def postable(self, now: float, validity: float) -> dict[str, Any]:
        """The ``postableAlert`` JSON at unix s ``now``: a firing alert valid until ``now + validity``."""
        ends = self.ends_at if self.ends_at is not None else now + validity
        d: dict[str, Any] = {"labels": dict(self.labels), "annotations": dict(self.annotations),
                             "startsAt": rfc3339(self.starts_at), "endsAt": rfc3339(max(ends, self.starts_at))}
        if self.generator_url:
            d["generatorURL"] = self.generator_url
        return d


class AlertmanagerSink(Sink):
    """Sends alerts to an Alertmanager's ``POST /api/v2/alerts`` (see the module doc).

    Parameters
    ----------
    name, url
        As every sink; ``url`` is the Alertmanager's base URL (``http://am:9093``, with a path prefix if it has one);
        ``/api/v2/alerts`` is appended.
    username : str, optional
        HTTP basic auth user, with ``password``.
    password, bearer_token : Secret, optional
        Basic auth password, or a bearer token (``Authorization: Bearer``); at most one of them.
    resend_interval : float
        Seconds between re-sends of the active alerts (default 60, Prometheus's ``resend-delay``); each send is
        valid for :data:`~trainhealth.defaults.ALERT_AM_VALIDITY_FACTOR` intervals (:attr:`validity`).
    labels : mapping, optional
        Labels added to every alert (``team``, ``cluster``), like Prometheus's ``external_labels``.
    """

    type = "alertmanager"

    def __init__(self, name: str, url: Secret, *, username: str | None = None, password: Secret | None = None,
                 bearer_token: Secret | None = None,
                 resend_interval: float = defaults.ALERT_AM_RESEND_INTERVAL_S,
                 labels: Mapping[str, str] | None = None, **kw: Any) -> None:
        super().__init__(name, url, **kw)
        if (username is None) != (password is None):
            raise ValueError("basic auth needs both username and password")
        if password is not None and bearer_token is not None:
            raise ValueError("give basic auth or a bearer token, not both")
        if not resend_interval > 0:
            raise ValueError(f"resend_interval={resend_interval!r} must be > 0 s")
        self.username = username
        self.password = password
        self.bearer_token = bearer_token
        self.resend_interval = float(resend_interval)
        self.labels = dict(labels or {})
        #: Seconds each send keeps an active alert alive in Alertmanager (its ``endsAt`` minus the send time).
        self.validity = defaults.ALERT_AM_VALIDITY_FACTOR * self.resend_interval
        self.api = Secret(api_url(url.reveal()), url.source)

    def secrets(self) -> tuple[Secret, ...]:
        return tuple(s for s in (self.url, self.password, self.bearer_token) if s is not None)

    def visible(self, n: Notification) -> Notification | None:
        """None: the grouped notifications are not for Alertmanager, which groups by itself (module doc)."""
        return None

    def payload(self, n: Notification, key: str) -> dict[str, Any]:
        raise TypeError("an alertmanager sink is sent alerts by trainhealth.alerts.forwarding, not notifications")

    def headers(self, body: bytes, key: str, now: float) -> dict[str, str]:
        h = super().headers(body, key, now)
        if self.password is not None:
            pair = f"{self.username}:{self.password.reveal()}".encode()
            h["Authorization"] = "Basic " + base64.b64encode(pair).decode()
        elif self.bearer_token is not None:
            h["Authorization"] = f"Bearer {self.bearer_token.reveal()}"
        return h

    def body(self, alerts: Sequence[AmAlert], now: float) -> bytes:
        """The JSON list of ``alerts`` as Alertmanager takes it at unix s ``now``."""
        return json.dumps([a.postable(now, self.validity) for a in alerts], separators=(",", ":"),
                          ensure_ascii=False).encode()

    def post(self, client: httpx.Client, alerts: Sequence[AmAlert], now: float) -> SendResult:
        """POST ``alerts`` (one batch) at unix s ``now``; never raises for HTTP trouble (:meth:`Sink.send`)."""
        body = self.body(alerts, now)
        return self.send(client, Request(self.api, body, self.headers(body, "", now)), now)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if self.password is not None:
            d["secrets"]["password"] = self.password.source
        if self.bearer_token is not None:
            d["secrets"]["bearer_token"] = self.bearer_token.source
        d["resend_interval_s"] = self.resend_interval
        d["note"] = (f"sent the alerts themselves, re-sent every {self.resend_interval:g} s (valid {self.validity:g} "
                     "s): group_by, timers, silences and inhibition are Alertmanager's")
        return d
