"""Watching the watchers: a dead detector service raises an alert; a dead alert worker stops a ping.

Two dead-man's switches:

- **service_down** (checked by the alert worker): some run's ranks sent heartbeats in the last
  ``service_stale`` seconds, but no detector service wrote its ``th:service:<consumer>`` heartbeat in
  that time. Training data then flows with nobody looking at it: the worker raises a critical alert of
  kind ``service_down`` (run label ``*``), resolved when a service heartbeat is back. It is routed,
  silenced and inhibited like any alert (``kind="service_down"``). Only live training jobs count: a run
  whose ``th:{run}:meta`` ``status`` is set and is not ``running`` (finished, failed, stopped, crashed...) left
  its ranks' last heartbeats behind, and a replay (``source`` ``replay:...``) is a log pushed into Redis that
  the service processes whenever it comes back; neither raises ``service_down``.
- **deadman ping** (``[deadman]`` in the config, done by :mod:`trainhealth.alerts.worker`): while the worker
  is healthy and the detector service is up, the worker POSTs to an external dead-man's-switch URL
  (healthchecks.io, Dead Man's Snitch, a PagerDuty heartbeat...) every ``interval``. When the worker, its
  Redis or the service dies the pings stop and the external service pages, the way Alertmanager's
  always-firing ``Watchdog`` alert is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import redis

from trainhealth.alerts.notification import FIRING, RESOLVED, Alert
from trainhealth.anomaly import Status
from trainhealth.keys import RUNS, SERVICE_HEARTBEAT_PATTERN, run_keys

SERVICE_DOWN_KEY = "*/service_down:*:0:0"
#: Newest runs of ``th:runs`` whose rank heartbeats are examined.
RUNS_EXAMINED = 50


@dataclass(frozen=True)
class ServiceCheck:
    """Result of :func:`check_service`: ``down`` and the numbers behind it (ages in seconds)."""

    down: bool
    service_age_s: float | None
    runs_sending: tuple[str, ...]


def _t(raw: Any) -> float | None:
    try:
        return float(json.loads(raw).get("t"))
    except (TypeError, ValueError, AttributeError):
        return None


def check_service(client: redis.Redis, now: float, stale_s: float) -> ServiceCheck:
    """Is a detector service alive while ranks send data? (see the module doc; reads only)."""
    ages = []
    for key in client.scan_iter(SERVICE_HEARTBEAT_PATTERN, count=100):
        t = _t(client.get(key))
        if t is not None:
            ages.append(now - t)
    age = min(ages, default=None)
    if age is not None and age < stale_s:
        return ServiceCheck(False, age, ())
    sending = []
    for raw in client.zrevrange(RUNS, 0, RUNS_EXAMINED - 1):
        run = raw.decode() if isinstance(raw, bytes) else str(raw)
        try:
            keys = run_keys(run)
        except ValueError:
            continue
        if any((t := _t(b)) is not None and now - t < stale_s for b in client.hvals(keys.heartbeats)) and \
                live_job(client.hmget(keys.meta, ["status", "source"])):
            sending.append(run)
    return ServiceCheck(bool(sending), age, tuple(sorted(sending)))


def live_job(meta: list[Any]) -> bool:
    """Whether a run's ``[status, source]`` meta fields (bytes, str or None) are a live training job's:
    status unset or ``running``, and not a replay (``source`` ``replay:...``).

    >>> live_job([b"running", b"demo"]), live_job([None, None]), live_job(["finished", None])
    (True, True, False)
    >>> live_job(["running", "replay:train.log"])
    False
    """
    status, source = (v.decode() if isinstance(v, bytes) else v for v in meta)
    return status in (None, "running") and not (source or "").startswith("replay:")


class ServiceDownEvidence(TypedDict):
    """What the ``service_down`` alert rests on.

    Attributes
    ----------
    service_heartbeat_age_s : float | None
        Seconds since the newest detector service heartbeat (null: none at all).
    runs_sending : list[str]
        The live runs whose ranks sent heartbeats meanwhile.
    """

    service_heartbeat_age_s: float | None
    runs_sending: list[str]


class ServiceDownAnomaly(TypedDict):
    """The ``service_down`` alert's anomaly, shaped like a stored one (``th:{run}:anomalies``) for the sinks: raised by
    the alert worker itself when no detector service heartbeat is fresh while runs send data.

    Attributes
    ----------
    id : str
        ``service_down:*:0:0``.
    run : str
        ``*``: every run.
    kind : str
        ``service_down``.
    severity : str
        ``critical``.
    status : str
        ``active`` while no service is up, ``resolved`` once a heartbeat is back.
    step, end_step : None
        No step: the condition is the service's, not a run's.
    ranks, hosts : list
        Empty.
    evidence : ServiceDownEvidence
        The numbers it rests on.
    message : str
        One line for a human on call.
    first_seen, last_seen : float
        Unix s the worker first and last saw it.
    """

    id: Literal["service_down:*:0:0"]
    run: Literal["*"]
    kind: Literal["service_down"]
    severity: Literal["critical"]
    status: Status
    step: None
    end_step: None
    ranks: list[int]
    hosts: list[str]
    evidence: ServiceDownEvidence
    message: str
    first_seen: float
    last_seen: float


def service_down_alert(check: ServiceCheck, now: float, first_seen: float | None = None) -> Alert:
    """The ``service_down`` alert for ``check`` (firing when down, else resolved)."""
    age = check.service_age_s
    if age is None:
        why = "no detector service heartbeat at all"
    else:
        why = f"the last detector service heartbeat is {age:.0f} s old"
    runs = ", ".join(check.runs_sending) or "-"
    anomaly: ServiceDownAnomaly = {
        "id": "service_down:*:0:0", "run": "*", "kind": "service_down", "severity": "critical",
        "status": "active" if check.down else "resolved", "step": None, "end_step": None, "ranks": [], "hosts": [],
        "evidence": {"service_heartbeat_age_s": None if age is None else round(age, 1),
                     "runs_sending": list(check.runs_sending)},
        "message": (f"Anomaly detection is down: {why} while run(s) {runs} send data. "
                    "Start `trainhealth serve` (check `trainhealth doctor`)." if check.down
                    else "A detector service heartbeat is back: anomaly detection runs again."),
        "first_seen": first_seen if first_seen is not None else now, "last_seen": now,
    }
    return Alert(key=SERVICE_DOWN_KEY, labels={"run": "*", "kind": "service_down", "severity": "critical",
                                               "rank": "", "host": ""},
                 anomaly=anomaly, status=FIRING if check.down else RESOLVED)
