"""The Redis key schema: every key trainhealth reads or writes is built here.

A run's keys share the hash tag ``{run}`` so that on Redis Cluster they live in one
slot and a MULTI/EXEC or pipeline over them stays on one node. See
``docs/architecture.md`` for each key's fields, units, writer and readers.

>>> run_keys("llama-70b").steps
'th:{llama-70b}:steps'
>>> RUNS
'th:runs'
>>> SERVICES
'th:services'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainhealth.exceptions import ConfigError

#: Sorted set of run ids scored by start time (unix seconds): the run registry index.
RUNS = "th:runs"

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")


def validate_run_id(run: str) -> str:
    """Return ``run`` if it is a valid run id, else raise :class:`ConfigError`.

    A run id is 1-128 characters of letters, digits, ``.``, ``_`` and ``-``, starting
    with a letter or digit (no ``{``, ``}`` or ``:``, which would break the key schema).
    """
    if not isinstance(run, str) or not _RUN_ID.match(run):
        raise ConfigError(
            f"run={run!r} is not a valid run id: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run


def service_heartbeat(consumer: str) -> str:
    """Key of a detector service process's heartbeat (string with TTL)."""
    return f"th:service:{consumer}"


SERVICE_HEARTBEAT_PATTERN = "th:service:*"

#: Sorted set of detector service consumers scored by their last heartbeat (Redis server time, unix s): the
#: services that share the runs. One key, written one member at a time (Redis Cluster safe).
SERVICES = "th:services"


@dataclass(frozen=True)
class RunKeys:
    """All keys of one run. Build with :func:`run_keys`."""

    run: str

    @property
    def _p(self) -> str:
        return f"th:{{{self.run}}}"

    @property
    def meta(self) -> str:
        """Hash: run metadata (name, world_size, started_at, gpu_hour_usd, status, ...)."""
        return f"{self._p}:meta"

    @property
    def steps(self) -> str:
        """Stream: one entry per rank per step, written by the collectors."""
        return f"{self._p}:steps"

    @property
    def events(self) -> str:
        """Stream: run start/end, checkpoint save/load, custom badput, collector drops."""
        return f"{self._p}:events"

    @property
    def heartbeats(self) -> str:
        """Hash: rank -> JSON heartbeat (time, last completed step and when, phase, host, pid)."""
        return f"{self._p}:hb"

    @property
    def memory(self) -> str:
        """Stream: every rank's newest memory sample each ``defaults.MEMORY_HISTORY_S`` seconds (lists of MiB by
        rank, :func:`trainhealth.wire.memory_entry`), the newest ``defaults.MEMORY_HISTORY_ENTRIES`` kept; written by
        the service from the heartbeats (which keep only the newest), read by the dashboard's Ranks page."""
        return f"{self._p}:mem"

    @property
    def agg(self) -> str:
        """Stream: one entry per completed step across ranks, written by the service."""
        return f"{self._p}:agg"

    @property
    def agg_rollup(self) -> str:
        """Stream: one entry per ``defaults.ROLLUP_STEPS`` steps of a generation (extremes, means, tokens, time),
        written by the service and kept for the whole run (detectors/rollup.py)."""
        return f"{self._p}:agg:rollup"

    @property
    def checkpoints(self) -> str:
        """Hash: ``<kind>:<step>`` -> JSON of one checkpoint save or load merged over the ranks that reported it
        (earliest time, longest block, how many ranks), written by the service (detectors/checkpoints.py)."""
        return f"{self._p}:checkpoints"

    @property
    def samples(self) -> str:
        """Stream: one entry per step whose ranks logged sample indices (``log_step(sample_indices=)``), each rank's
        as a compact list, written by the service and bounded in bytes (``defaults.SAMPLE_INDICES_RETENTION_BYTES``).
        """
        return f"{self._p}:samples"

    @property
    def anomalies(self) -> str:
        """Hash: anomaly id -> JSON of the anomaly's current state."""
        return f"{self._p}:anomalies"

    @property
    def recommendations(self) -> str:
        """Hash: recommendation id (``rec:<anomaly id>``) -> JSON with its lifecycle ``status``."""
        return f"{self._p}:recommendations"

    @property
    def incidents(self) -> str:
        """Hash: incident id (``inc:<root anomaly id>``) -> JSON of the incident's current state: one per root
        cause, its member anomalies and its one recommendation."""
        return f"{self._p}:incidents"

    @property
    def anomaly_log(self) -> str:
        """Stream: anomaly transitions (opened, updated, resolved), the alerting outbox's source."""
        return f"{self._p}:anomaly_log"

    @property
    def ledger(self) -> str:
        """Stream: goodput ledger snapshots over time."""
        return f"{self._p}:ledger"

    @property
    def ledger_latest(self) -> str:
        """String: JSON of the newest ledger snapshot."""
        return f"{self._p}:ledger:latest"

    @property
    def state(self) -> str:
        """String: JSON of the job's state as the detector service judges it (:mod:`trainhealth.job`): ``state``
        (running, hung, crashed, restarted, finished), ``since``, ``step``, ``culprit``, ``message``."""
        return f"{self._p}:state"

    @property
    def owner(self) -> str:
        """String with TTL: the consumer name of the detector service processing this run."""
        return f"{self._p}:owner"

    @property
    def input_streams(self) -> tuple[str, str]:
        """The streams the detector service consumes, in merge order."""
        return (self.steps, self.events)


def run_keys(run: str) -> RunKeys:
    """Return the :class:`RunKeys` of ``run``; raises :class:`ConfigError` for a bad run id."""
    return RunKeys(validate_run_id(run))


def run_of(key: str | bytes) -> str:
    """The run id in a run's key: the text of its hash tag (the inverse of :func:`run_keys`).

    Raises :class:`ConfigError` naming the key when it has no ``{run}`` tag.

    >>> run_of("th:{llama-70b}:steps"), run_of(b"th:{x}:anomaly_log")
    ('llama-70b', 'x')
    """
    text = key.decode() if isinstance(key, bytes) else key
    start, end = text.find("{"), text.find("}")
    if start < 0 or end < start:
        raise ConfigError(f"key={text!r} is not a run's key (no {{run}} hash tag)")
    return text[start + 1:end]


# --- Alerting (alerts/) ---------------------------------------------------------
# Global keys of the alert worker. They share the hash tag ``{alerts}`` so that on Redis Cluster they
# live in one slot, and the MULTI/EXEC that commits grouping state together with new outbox entries
# (or acknowledges a delivery together with its log entry) stays on one node. See docs/alerts.md.

#: Stream: one entry per (notification, sink) waiting to be delivered (consumer group ``th-alerts-delivery``).
ALERTS_OUTBOX = "th:{alerts}:outbox"
#: List (newest first): JSON of deliveries given up after the bounded number of tries, or refused (4xx).
ALERTS_DEAD = "th:{alerts}:dead"
#: Stream: one entry per delivered notification (the dashboard's "recent notifications").
ALERTS_SENT = "th:{alerts}:sent"
#: Hash: silence id -> JSON silence (matchers, starts_at, ends_at, created_by, comment).
ALERTS_SILENCES = "th:{alerts}:silences"
#: Hash: group key -> JSON of the grouping engine's state of that alert group.
ALERTS_GROUPS = "th:{alerts}:groups"
#: Hash: worker-wide state (``epoch``, ``now``, ``cursor:<run>`` = last applied anomaly_log entry id).
ALERTS_STATE = "th:{alerts}:state"
#: Sorted set: outbox entry id -> unix s of its next delivery attempt.
ALERTS_RETRY = "th:{alerts}:retry"
#: Hash: outbox entry id -> JSON delivery bookkeeping (sink, group, attempts, last error).
ALERTS_ATTEMPTS = "th:{alerts}:attempts"
#: Hash: sink name -> JSON state of the sink (last success/failure, paused_until, counters).
ALERTS_SINKS = "th:{alerts}:sinks"
#: String with TTL: consumer name of the alert worker that currently does the work (one at a time).
ALERTS_LEADER = "th:{alerts}:leader"
ALERTS_WORKER_HEARTBEAT_PATTERN = "th:{alerts}:worker:*"


def alerts_worker_heartbeat(consumer: str) -> str:
    """Key of an alert worker process's heartbeat (string with TTL), e.g. ``th:{alerts}:worker:host-42``."""
    return f"th:{{alerts}}:worker:{consumer}"


def alerts_forward(sink: str) -> str:
    """Key of what an ``alertmanager`` sink must tell its Alertmanager (hash: alert fingerprint -> JSON of the alert,
    firing or closed), e.g. ``th:{alerts}:forward:team-am``; see :mod:`trainhealth.alerts.forwarding`."""
    return f"th:{{alerts}}:forward:{sink}"
