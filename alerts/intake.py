"""Intake: every run's ``anomaly_log`` → the grouping engine → the outbox, exactly once.

For each run of ``th:runs`` the intake reads ``th:{run}:anomaly_log`` with the consumer group ``th-alerts``
(created at id 0, so transitions written before the worker noticed the run are not missed). A batch of
transitions is applied to the :class:`~trainhealth.alerts.grouping.Grouper` in event-time order (each
transition's ``last_seen``, the detector service's clock), then the engine is advanced to the wall clock.
The changed groups, the per-run cursor (last applied entry id) and the due notifications' outbox entries
are written in **one** ``MULTI/EXEC`` on the ``{alerts}`` keys; the entries are acknowledged after it.

Restart safety: on start the worker reloads the groups and cursors and claims every pending entry of the
group (``XAUTOCLAIM``). Entries at or below a run's cursor were applied (the crash came between the
commit and the ``XACK``) and are only acknowledged; later ones are applied now. So a notification is
enqueued once, with the sequence number, hence the idempotency key, it had to have.

On its very first start (no ``epoch`` in ``th:{alerts}:state``) the worker records the time and ignores
transitions older than ``epoch - backfill`` (default 1 h), so enabling alerts on an old Redis does not
page for last month's anomalies.

**Catch-up window** (``catch_up``, :data:`trainhealth.defaults.ALERT_CATCHUP_S`, ``trainhealth alerts
--catch-up``). The consumer group remembers how far the worker read each log, so a worker that was stopped
for an hour, or one that meets a run for the first time (a replay pushed while no worker ran, the runs of an
earlier ``trainhealth demo`` on the same Redis), reads a backlog. A transition whose stream entry was written
more than ``catch_up`` seconds before the intake (re)loaded its state (at start, after a takeover or a Redis
error) is **stale**; both times are Redis's clock (the entry id's milliseconds, ``TIME``), so no clock skew
between hosts counts. A stale transition is applied to the alert groups quietly
(:meth:`~trainhealth.alerts.grouping.Grouper.observe` with ``quiet=True``: the group knows the alert, so its
later ``updated`` is no news, but nothing is notified for it) and counted; one INFO line says how many and
why. Entries written after a saved position younger than the window are never stale, so a restart within
the window holds nothing back. A resolve of an alert that was notified as firing still goes out.

**Runs that are over** are not paged at all: a run whose ``th:{run}:meta`` ``status`` is set and is not
``running`` and whose newest ``anomaly_log`` entry is older than the window (or the longest ``group_wait``, if
longer) mutes its alerts (:attr:`~trainhealth.alerts.grouping.Grouper.ended_runs`): no notification, no
``repeat_interval`` reminder every 4 h for a divergence that will never resolve because the job is gone.
Checked for the runs the groups hold every :data:`WATCHDOG_EVERY_S`. ``catch_up = 0`` turns both off.

**Alertmanager sinks** are fed from here too, not through the grouping engine: every alert state is applied to the
:class:`~trainhealth.alerts.forwarding.ForwardState` (routing only; a stale point event dropped, a run that is over
closed), whose changes are written in the same ``MULTI/EXEC``; :attr:`Intake.on_forward` then wakes the forwarder.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import redis

from trainhealth import defaults
from trainhealth.alert_store import prune_silences
from trainhealth.alerts.config import AlertsConfig
from trainhealth.alerts.forwarding import ForwardState, alertmanager_sinks
from trainhealth.alerts.grouping import Grouper
from trainhealth.alerts.notification import FIRING, Alert, Notification
from trainhealth.alerts.outbox import claim_all, enqueue
from trainhealth.alerts.watchdog import SERVICE_DOWN_KEY, check_service, service_down_alert
from trainhealth.anomaly import SEVERITIES, RecommendationRef
from trainhealth.connection import read_groups
from trainhealth.keys import ALERTS_GROUPS, ALERTS_SILENCES, ALERTS_STATE, RUNS, run_keys, run_of
from trainhealth.silences import Silence
from trainhealth.text import fmt_duration

log = logging.getLogger(__name__)

#: Seconds between detector-service liveness checks (the ``service_down`` watchdog).
WATCHDOG_EVERY_S = 10.0
#: Timestamps further than this in the future (unix s) are invalid input, not clock skew.
MAX_FUTURE_S = 365 * 86400.0
TRANSITIONS = ("opened", "updated", "resolved")
STATUSES = ("active", "resolved")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad_time(v: Any, now: float) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return True
    # NaN/Inf, or so large that ``t + group_interval == t``: the grouping engine's timers would never move.
    return not math.isfinite(v) or v < 0 or v > now + MAX_FUTURE_S


def anomaly_problem(anomaly: Any, now: float) -> tuple[str, Any] | None:
    """``(field, value)`` of the first field of an ``anomaly_log`` JSON that the worker cannot use, else None.

    Checked against what grouping, the labels and every sink read (``detectors/anomaly.py`` writes them):
    ``id``, ``kind`` non-empty strings; ``severity`` one of ``info``/``warning``/``critical``; ``status``
    ``active``/``resolved``; ``step``/``end_step`` int or null; ``ranks`` ints and ``hosts`` strings (list
    or null); ``evidence`` an object or null; ``message``/``run`` string or null; ``first_seen``/``last_seen``
    finite unix seconds, not negative nor more than :data:`MAX_FUTURE_S` ahead of ``now``, or null.
    """
    if not isinstance(anomaly, dict):
        return "json", anomaly
    checks: tuple[tuple[str, Any], ...] = (
        ("id", lambda v: isinstance(v, str) and v != ""),
        ("kind", lambda v: isinstance(v, str) and v != ""),
        ("severity", lambda v: v in SEVERITIES),
        ("status", lambda v: v is None or v in STATUSES),
        ("step", lambda v: v is None or _int(v)),
        ("end_step", lambda v: v is None or _int(v)),
        ("ranks", lambda v: v is None or (isinstance(v, list) and all(_int(x) for x in v))),
        ("hosts", lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v))),
        ("evidence", lambda v: v is None or isinstance(v, dict)),
        ("message", lambda v: v is None or isinstance(v, str)),
        ("run", lambda v: v is None or isinstance(v, str)),
        ("first_seen", lambda v: v is None or not _bad_time(v, now)),
        ("last_seen", lambda v: v is None or not _bad_time(v, now)),
    )
    for name, ok in checks:
        value = anomaly.get(name)
        if not ok(value):
            return name, value
    return None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _sid(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _redis_time(reply: Any) -> float:
    """Unix seconds from a ``TIME`` reply (redis-py: ``(seconds, microseconds)``)."""
    return int(reply[0]) + int(reply[1]) / 1e6


def load_silences(client: redis.Redis) -> list[Silence]:
    """Every stored silence (malformed records are skipped with a warning)."""
    out = []
    for sid, raw in client.hgetall(ALERTS_SILENCES).items():
        try:
            out.append(Silence.from_dict(json.loads(raw)))
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("ignoring malformed silence %s: %s", _s(sid), exc)
    return out



class AlertRecommendation(RecommendationRef, total=False):
    """An alert's copy of its anomaly's recommendation: the stable part the anomaly carries, and the recommendation's
    summary the intake adds for the sinks (:meth:`Intake._enrich`; display only, never stored with the anomaly).

    Attributes
    ----------
    id : str
        ``rec:<anomaly id>``: the field of ``th:{run}:recommendations`` holding the whole recommendation.
    action : str
        What to do (``rollback``, ``wait``, ``restart``, ...).
    checkpoint_step : int | None
        Checkpoint to restart from.
    skip_steps : list[int] | None
        Inclusive ``[first, last]`` range of steps whose batches to skip after restarting.
    summary : str
        The advice in one paragraph, with its figures (the stored recommendation's ``summary``).
    """

    summary: str

class Intake:
    """The grouping stage of the alert worker (see the module doc).

    Parameters
    ----------
    client : redis.Redis
    config : AlertsConfig
    consumer : str
        Consumer name in ``th-alerts``.
    clock : callable
        Unix time; tests pass a fake one.
    group : str
        Consumer group name.
    count : int
        Entries read per stream per ``XREADGROUP``.
    catch_up : float
        Catch-up window in seconds (see the module doc); 0 notifies every transition read, however old.
    """

    def __init__(self, client: redis.Redis, config: AlertsConfig, *, consumer: str,
                 clock: Callable[[], float] = time.time, group: str = defaults.ALERT_CONSUMER_GROUP,
                 count: int = 1000, catch_up: float = defaults.ALERT_CATCHUP_S) -> None:
        if not (math.isfinite(catch_up) and catch_up >= 0):
            raise ValueError(f"catch_up={catch_up!r} must be a finite number of seconds >= 0")
        self.client = client
        self.config = config
        self.consumer = consumer
        self.clock = clock
        self.group = group
        self.count = count
        self.catch_up = float(catch_up)
        #: Entries written before this unix time (s) are stale (set by :meth:`setup`; -inf without a window).
        self.stale_before = -math.inf
        #: Stale transitions applied without notifying, in total (the heartbeat's ``stale_entries``).
        self.stale = 0
        self._stale_batch: dict[str, int] = {}
        self._last_ended = -1e18
        self._checked: set[str] = set()
        self.grouper = Grouper(config.route, config.inhibit_rules)
        #: What the ``alertmanager`` sinks must know (empty without one).
        self.forward = ForwardState(config.route, alertmanager_sinks(config), config.dashboard_url)
        #: Called after a commit that changed :attr:`forward` (the worker wakes its forwarder).
        self.on_forward: Callable[[], None] | None = None
        self.runs: set[str] = set()
        self.cursors: dict[str, str] = {}
        self.epoch = 0.0
        self.ready = False
        self.enqueued = 0
        #: anomaly_log entries skipped as malformed (each logged with run, entry id, field and value).
        self.skipped = 0
        self.last_ok: float | None = None
        self._last_watchdog = -1e18
        self.service_down = False
        #: Entries read plus notifications made by the last :meth:`run_once` (0: it found nothing to do).
        self.last_work = 0

    # -- state --------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Load grouping state and cursors from Redis (first start: record the epoch)."""
        now = self.clock()
        self.client.hsetnx(ALERTS_STATE, "epoch", repr(now))
        # Where the last leader read its config, for `trainhealth doctor` once no heartbeat is left.
        path = self.config.path
        self.client.hset(ALERTS_STATE, mapping={"config": os.path.abspath(path) if os.path.exists(path) else path,
                                                "started_at": repr(now)})
        state = {_s(k): _s(v) for k, v in self.client.hgetall(ALERTS_STATE).items()}
        self.epoch = float(state["epoch"])
        self.cursors = {k.split(":", 1)[1]: v for k, v in state.items() if k.startswith("cursor:")}
        # A first start replays the backfill window in event time, from its beginning.
        start = float(state.get("now", self.epoch - self.config.backfill))
        self.grouper = Grouper(self.config.route, self.config.inhibit_rules, now=start)
        groups = {}
        for k, raw in self.client.hgetall(ALERTS_GROUPS).items():
            try:
                groups[_s(k)] = json.loads(raw)
            except ValueError:
                log.warning("dropping unreadable alert group state %s", _s(k))
        self.grouper.load(groups)
        self.forward.load(self.client)
        self.runs.clear()
        self.service_down = any(a.key == SERVICE_DOWN_KEY and a.status == FIRING for _, a in self.grouper.alerts())
        # Redis's clock, which also stamps the entry ids: no skew between the worker's host and Redis's counts.
        self.stale_before = _redis_time(self.client.time()) - self.catch_up if self.catch_up > 0 else -math.inf
        self._stale_batch.clear()
        self._last_ended = -1e18
        self._checked = set()
        self.ready = True
        log.info("intake: %d alert groups restored, %d run cursors", len(self.grouper.groups), len(self.cursors))

    def _attach(self, run: str) -> list[tuple[str, str, dict]]:
        """Ensure our consumer group on the run's log; return its pending entries (claimed) to re-examine."""
        stream = run_keys(run).anomaly_log
        try:
            self.client.xgroup_create(stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        # Trimmed entries come back without fields ({}): skipped as malformed, and acknowledged.
        return [(run, eid, fields or {}) for eid, fields in claim_all(self.client, stream, self.group, self.consumer)]

    def discover(self) -> list[tuple[str, str, dict]]:
        """Attach new runs of ``th:runs``; returns their claimed pending entries."""
        pending: list[tuple[str, str, dict]] = []
        for raw in self.client.zrange(RUNS, 0, -1):
            run = _s(raw)
            if run in self.runs:
                continue
            try:
                run_keys(run)
            except ValueError:
                continue
            pending += self._attach(run)
            self.runs.add(run)
        return pending

    # -- one iteration ------------------------------------------------------------------------------------
    def run_once(self, block_ms: int = 0) -> list[Notification]:
        """Discover runs, read and apply transitions, advance to now, commit; returns the notifications enqueued."""
        if not self.ready:
            self.setup()
        self.grouper.silences = load_silences(self.client)
        entries = self.discover()
        backlog = False  # some log returned a full batch: more of a catch-up may follow
        streams = {run_keys(r).anomaly_log: ">" for r in sorted(self.runs)}
        if streams:
            nxt = self.grouper.next_due()
            if nxt is not None:
                block_ms = max(0, min(block_ms, int((nxt - self.clock()) * 1000)))
            # One XREADGROUP over every run's log; on Redis Cluster one per run's slot (connection.read_groups).
            reply = read_groups(self.client, self.group, self.consumer, streams, count=self.count, block_ms=block_ms)
            for stream_raw, items in reply or []:
                run = run_of(stream_raw)
                entries += [(run, _s(i), f) for i, f in items]
                backlog = backlog or len(items) >= self.count
        self._check_ended(entries, self.clock())
        notes = self._apply(entries, self.clock())
        if self._stale_batch and not backlog:
            self._log_stale()
        now = self.clock()
        if now - self._last_watchdog >= WATCHDOG_EVERY_S:
            self._last_watchdog = now
            prune_silences(self.client, now)
            if self.config.watchdog.service_down:
                notes += self._watch(now)
        notes += self.grouper.advance(now)
        self._commit(notes, entries, now)
        self.last_ok = now
        self.last_work = len(entries) + len(notes)
        return notes

    def _apply(self, entries: list[tuple[str, str, dict]], now: float) -> list[Notification]:
        todo: list[tuple[float, str, tuple[int, int], str, Alert]] = []
        cutoff = self.epoch - self.config.backfill
        for run, eid, raw in entries:
            cursor = self.cursors.get(run)
            if cursor is not None and _sid(eid) <= _sid(cursor):
                continue  # applied before a crash, only the XACK was missing
            self.cursors[run] = eid if cursor is None or _sid(eid) > _sid(cursor) else cursor
            # Any exception here would fail the whole batch, which is then re-read forever: one bad entry
            # is logged, counted and skipped (acknowledged with the batch) instead.
            try:
                fields = {_s(k): _s(v) for k, v in raw.items()}
                if "json" not in fields:
                    self._skip(run, eid, "json", None)
                    continue
                try:
                    anomaly = json.loads(fields["json"])
                except ValueError:
                    self._skip(run, eid, "json", fields["json"])
                    continue
                transition = fields.get("transition", "updated")
                if transition not in TRANSITIONS:
                    self._skip(run, eid, "transition", transition)
                    continue
                problem = anomaly_problem(anomaly, now)
                if problem is not None:
                    self._skip(run, eid, *problem)
                    continue
                t = float(anomaly.get("last_seen") or _sid(eid)[0] / 1000.0)
                alert = Alert.from_transition(run, transition, anomaly)
            except Exception:  # a case the checks above missed: still only this entry is lost
                self.skipped += 1
                log.exception("run %s: skipping anomaly_log entry %s that cannot be read", run, eid)
                continue
            if t < cutoff:
                continue  # older than the backfill window of the first start
            todo.append((t, run, _sid(eid), eid, alert))
        todo.sort(key=lambda x: (x[0], x[1], x[2]))
        self._enrich([x[4] for x in todo])
        notes: list[Notification] = []
        for t, run, sid, eid, alert in todo:
            # Stale: written (the entry id's time, Redis's clock) before the catch-up window of this start.
            stale = sid[0] / 1000.0 < self.stale_before
            if stale:
                self.stale += 1
                self._stale_batch[run] = self._stale_batch.get(run, 0) + 1
            elif run in self.grouper.ended_runs:  # a fresh transition: the run is not quiet any more
                self.grouper.ended_runs = self.grouper.ended_runs - {run}
            try:
                # Ahead of the wall clock (a skewed detector host): observed now, or the engine's clock
                # would run ahead and hold back every group's flush until the wall clock caught up.
                notes += self.grouper.observe(alert, min(t, now), quiet=stale)
            except Exception:  # one odd anomaly must not stop alerting on all the others
                self.skipped += 1
                log.exception("run %s: skipping anomaly_log entry %s that the grouping engine refused", run, eid)
            try:
                self.forward.observe(alert, min(t, now), stale=stale, over=run in self.grouper.ended_runs)
            except Exception:
                log.exception("run %s: anomaly_log entry %s could not be forwarded to Alertmanager", run, eid)
        return notes

    def _log_stale(self) -> None:
        """The one INFO line of a catch-up: how many transitions were applied without notifying, and why."""
        runs = sorted(self._stale_batch)
        n = sum(self._stale_batch.values())
        shown = ", ".join(runs[:5]) + (f" and {len(runs) - 5} more" if len(runs) > 5 else "")
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.stale_before))
        log.info("intake: catch-up: %d anomaly transition%s of %d run%s (%s) not notified as stale: written before "
                 "%s, more than the %s catch-up window (--catch-up) before this worker started; their alerts are "
                 "tracked, later changes notify", n, "s" if n != 1 else "", len(runs), "s" if len(runs) != 1 else "",
                 shown, when, fmt_duration(self.catch_up, minute_digits=0))
        self._stale_batch.clear()

    def _check_ended(self, entries: list[tuple[str, str, dict]], now: float) -> None:
        """Refresh :attr:`Grouper.ended_runs`: runs whose meta ``status`` is set and not ``running`` and whose
        newest anomaly_log entry is older than the window (see the module doc). Every :data:`WATCHDOG_EVERY_S`,
        and at once for runs not checked yet (restored groups at start, a batch's runs)."""
        if self.catch_up <= 0:
            return
        runs = {a.run for _, a in self.grouper.alerts()} | {run for run, _, _ in entries}
        runs.discard("*")  # the watchdog's own service_down alert
        if now - self._last_ended < WATCHDOG_EVERY_S and runs <= self._checked:
            return
        window = max([self.catch_up] + [r.timers.group_wait for r in self.config.route.walk()])
        order = sorted(runs)
        # Entry ids are Redis's clock: compare them with Redis's now (not in the pipeline: a cluster's pipeline
        # takes only commands with keys).
        redis_now = _redis_time(self.client.time())
        pipe = self.client.pipeline(transaction=False)
        for run in order:
            keys = run_keys(run)
            pipe.hget(keys.meta, "status")
            pipe.xrevrange(keys.anomaly_log, count=1)
        replies = pipe.execute()
        ended: set[str] = set()
        for i, run in enumerate(order):
            status, last = replies[2 * i], replies[1 + 2 * i]
            status = _s(status) if status is not None else "running"  # as the detector service reads it
            last_t = _sid(_s(last[0][0]))[0] / 1000.0 if last else -math.inf
            # A crashed job is not over: it waits for someone to relaunch it, and its page keeps repeating.
            if status not in ("running", "crashed") and last_t < redis_now - window:
                ended.add(run)
        newly = sorted(ended - self.grouper.ended_runs)
        self.forward.close_runs(newly, now)
        if newly:
            log.info("intake: not paging the alerts of %d run%s that are over (meta status not running or crashed, "
                     "no anomaly transition for %s): %s", len(newly), "s" if len(newly) > 1 else "",
                     fmt_duration(window, minute_digits=0), ", ".join(newly))
        self.grouper.ended_runs = frozenset(ended)
        self._checked = runs
        self._last_ended = now

    def _skip(self, run: str, eid: str, name: str, value: Any) -> None:
        self.skipped += 1
        text = repr(value)
        log.warning("run %s: skipping malformed anomaly_log entry %s: field %s = %s", run, eid, name,
                    text if len(text) <= 200 else text[:199] + "…")

    def _enrich(self, alerts: list[Alert]) -> None:
        """Add the stored recommendation's ``summary`` (costs, skip range in words) to the anomaly's
        ``recommendation``, which carries only its stable part (docs/advisor.md). Display only."""
        wanted = [(a, a.anomaly["recommendation"]) for a in alerts
                  if isinstance(a.anomaly.get("recommendation"), dict) and a.anomaly["recommendation"].get("id")
                  and "summary" not in a.anomaly["recommendation"]]
        if not wanted:
            return
        pipe = self.client.pipeline(transaction=False)
        for a, rec in wanted:
            pipe.hget(run_keys(a.run).recommendations, str(rec["id"]))
        for (a, rec), raw in zip(wanted, pipe.execute(), strict=True):
            try:
                summary = json.loads(raw).get("summary") if raw else None
            except (ValueError, AttributeError):
                summary = None
            if summary:
                enriched: AlertRecommendation = {**rec, "summary": summary}
                a.anomaly["recommendation"] = enriched

    def _watch(self, now: float) -> list[Notification]:
        check = check_service(self.client, now, self.config.watchdog.service_stale)
        if check.down == self.service_down:
            return []
        self.service_down = check.down
        first = next((a.starts_at for _, a in self.grouper.alerts() if a.key == SERVICE_DOWN_KEY), None)
        alert = service_down_alert(check, now, first_seen=first)
        (log.error if check.down else log.info)("watchdog: %s", alert.anomaly["message"])
        self.forward.observe(alert, now)
        return self.grouper.observe(alert, now)

    def _commit(self, notes: list[Notification], entries: list[tuple[str, str, dict]], now: float) -> None:
        upserts, deleted = self.grouper.take_changes()
        forwarded = 0
        if notes or upserts or deleted or entries or self.forward.pending:
            pipe = self.client.pipeline(transaction=True)
            forwarded = self.forward.write(pipe)
            for k, st in upserts.items():
                pipe.hset(ALERTS_GROUPS, k, json.dumps(st, separators=(",", ":")))
            if deleted:
                pipe.hdel(ALERTS_GROUPS, *deleted)
            state = {"now": repr(self.grouper.now)}
            state.update({f"cursor:{r}": c for r, c in self.cursors.items()})
            pipe.hset(ALERTS_STATE, mapping=state)
            for n in notes:
                self.enqueued += enqueue(pipe, n, self.config.sinks, now)
            pipe.execute()
        if forwarded and self.on_forward is not None:
            self.on_forward()
        if entries:  # after the commit: a crash in between only leaves entries the cursor already covers
            pipe = self.client.pipeline(transaction=False)
            by_run: dict[str, list[str]] = {}
            for run, eid, _ in entries:
                by_run.setdefault(run, []).append(eid)
            for run, ids in by_run.items():
                pipe.xack(run_keys(run).anomaly_log, self.group, *ids)
            pipe.execute()
        for n in notes:
            receivers = [r for r in n.receivers if r not in self.forward.sinks]  # those are sent alerts, not this
            log.info("notification #%d of %s (%s): %d firing, %d resolved -> %s", n.seq, n.group_key, n.reason,
                     len(n.firing), len(n.resolved), ", ".join(receivers) or "(no receivers)")
