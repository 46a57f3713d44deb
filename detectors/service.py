"""The detector service: consumes every run's streams from Redis and writes results back.

Loop (like rq's worker): discover runs → blocking ``XREADGROUP`` over their ``steps`` and
``events`` streams → feed each run's :class:`~trainhealth.detectors.pipeline.RunPipeline` in entry-id
order → write aggregates, anomaly changes and the ``XACK`` in one ``MULTI/EXEC`` → hang
checks and ledger snapshots on a timer → heartbeat key with TTL. Connection errors back off
exponentially (capped); SIGTERM/SIGINT stop it after the current batch.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import json
import logging
import math
import operator
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import redis

from trainhealth import config, defaults, tuning
from trainhealth.anomaly import Anomaly
from trainhealth.connection import REDIS_DOWN, read_groups
from trainhealth.detectors.advisor import RollbackAdvisor
from trainhealth.detectors.checkpoints import CHECKPOINT_KINDS, Checkpoint, CheckpointLog
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.incidents import LABELS, Incident
from trainhealth.detectors.pipeline import Output, RunPipeline, agg_fields
from trainhealth.detectors.recovery_advisor import RecoveryAdvisor
from trainhealth.detectors.retention import RawWindow, StreamBound, entry_bytes
from trainhealth.detectors.rollup import Rollups
from trainhealth.exceptions import ConfigError
from trainhealth.job import JobState
from trainhealth.keys import RUNS, SERVICES, RunKeys, run_keys, run_of, service_heartbeat
from trainhealth.loop import LEASE_LUA, MEMBERS_LUA, RELEASE_LUA, RENEW_LUA, Backoff, stop_on_signals
from trainhealth.recommendations import OPEN_STATUSES, Recommendation
from trainhealth.warn_once import WarnOnce
from trainhealth.wire import MAX_RANKS, ROW_FIELDS, Event, decode_event, decode_step_rows, memory_entry

log = logging.getLogger(__name__)

_VOLATILE = ("first_seen", "last_seen")
#: Meta statuses of a run still going: any other (finished, failed, stopped, interrupted) is an ended run.
LIVE_STATUSES = ("running", "crashed")
#: Modules detectors import on first use, imported when the service starts (see run_forever).
_LAZY_IMPORTS = ("sklearn.ensemble",)
#: A run whose newest heartbeat or step is older than this is not watched for hangs any more.
RUN_INACTIVE_S = 6 * 3600.0
#: Errors that mean Redis itself is away (a failover under way too): the loop backs off and rebuilds, no run is to
#: blame.
_REDIS_DOWN = REDIS_DOWN


def _sid(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-" if isinstance(entry_id, bytes) else "-")
    return int(ms), int(seq or 0)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _entry_ms(e: tuple[tuple[int, int], str, dict]) -> int:
    return e[0][0]


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_t = operator.itemgetter(2)  # a row's t (trainhealth.wire.ROW_FIELDS)


def _time_order(group: list[tuple[int, list[Any]]]) -> list[Any]:
    """The records (rows, or events) of the entries ``(seq, records)`` of one millisecond, ordered
    (stably) by record time, then entry seq: entry ids of two streams are not comparable within one
    millisecond, there the records' own times decide. One entry whose records' times do not decrease
    (a collector writes them in time order) is already in that order."""
    if len(group) == 1:
        recs = group[0][1]
        if len(recs) < 2:
            return recs
        ts = list(map(_t, recs))  # an entry of several records is a steps entry: rows
        if all(map(operator.le, ts, ts[1:])):
            return recs
    # Sorted by (t, seq): a stable sort by t of the records in entry-seq order.
    group = sorted(group, key=_first)
    recs = list(chain.from_iterable(map(_second, group)))
    recs.sort(key=_t if all(not rs or type(rs[0]) is tuple for _, rs in group) else _any_t)
    return recs


def _any_t(r: tuple | Event) -> float:
    return r[2] if type(r) is tuple else r.t


#: Seconds between full collections of the objects batches left (see _gc_paused).
GC_FULL_INTERVAL_S = 60.0


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a batch is read and processed (reference counting
    still frees everything: decoded records, aggregates and outputs hold no cycles).

    A 1,024-rank run with 25 records per entry keeps up to 25 steps x 1,024 ranks of records
    pending in the aggregator; each full collection re-traversed them all, and the allocation
    rate of ~100,000 records/s triggered one every ~20,000 records: about a fifth of the service's
    CPU time (``bench/service_throughput.py``). What the batch leaves alive (the pending records,
    mostly) then goes to the permanent generation (``gc.freeze``) instead of being traversed by the
    next young collection (a sixth of the CPU time at 4,096 ranks); :func:`_gc_full` collects it
    every ``GC_FULL_INTERVAL_S``. A collector disabled by the caller stays so.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _gc_full() -> None:
    """Collect what the batches left (:func:`_gc_paused`): a cycle among it is freed at most a minute later."""
    if gc.isenabled():
        gc.unfreeze()
        gc.collect()


#: Entries decoded and fed at a time (more when they share a millisecond; see ``_process``).
_CHUNK_ENTRIES = 64
_ROW_RANK, _ROW_INC = ROW_FIELDS.index("rank"), ROW_FIELDS.index("inc")


@dataclass
class _Run:
    keys: RunKeys
    pipeline: RunPipeline
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
    stored_recs: dict[str, dict[str, Any]] = field(default_factory=dict)
    stored_incidents: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_agg: tuple[int, int] = (0, 0)
    #: The newest ``th:{run}:samples`` entry stored (its id).
    last_samples: tuple[int, int] = (0, 0)
    #: Folds the aggregates into the buckets of each rollup level; per level (steps a bucket) the newest bucket
    #: stored (its entry id).
    rollup: Rollups = field(default_factory=Rollups)
    last_rollup: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: The byte bounds of the streams the service writes (``agg``, ``ledger``, ``anomaly_log``; detectors/retention.py).
    bounds: dict[str, StreamBound] = field(default_factory=dict)
    #: The processed entries of the raw step stream it keeps, and the trim of the older ones (detectors/retention.py).
    raw: RawWindow = field(default_factory=lambda: RawWindow(defaults.STEPS_RETENTION_RECORDS,
                                                             defaults.STEPS_RETENTION_BYTES))
    last_snapshot: float = 0.0
    last_memory: float = 0.0  # unix s of the newest th:{run}:mem entry written
    status: str = "running"
    meta_checked: float = 0.0
    dirty: bool = True
    #: A replayed log (meta ``source`` = ``replay:…``): the wait between its paced pushes is not the job's.
    replay: bool = False
    #: The service marked the run crashed (meta ``status``); undone when the job comes back.
    crashed: bool = False
    #: The newest read of the run's events stream got all there was (so a record's run_start, if any, was fed);
    #: False from the rebuild until the first live read says so.
    events_caught_up: bool = False
    #: Per (rank, incarnation) of a sender: the ``seq`` its next steps entry should carry (see :meth:`_note_seq`).
    seq_next: dict[tuple[int, Any], int] = field(default_factory=dict)
    #: Per (rank, incarnation): the newest record time (unix s) read, to tell a batch written twice (see
    #: :meth:`_note_seq`).
    seq_newest_t: dict[tuple[int, Any], float] = field(default_factory=dict)
    #: The run's checkpoints merged over ranks (``th:{run}:checkpoints``), and those stored (field -> JSON).
    checkpoints: CheckpointLog = field(default_factory=CheckpointLog)
    stored_checkpoints: dict[str, str] = field(default_factory=dict)


def fair_share(runs: int, services: list[str], me: str) -> int:
    """How many of ``runs`` runs the service ``me`` holds when the sorted ``services`` share them evenly.

    Every service gets ``runs // len(services)``; the first ``runs % len(services)`` in sorted
    order one more, so the shares differ by at most one and add up to ``runs``. Each service
    computes its own from the same list, with no coordinator (the count-based split of rq's
    and Celery's workers, without their queue: a run is a sticky unit of state).

    >>> [fair_share(16, ["a", "b", "c", "d"], s) for s in "abcd"]
    [4, 4, 4, 4]
    >>> [fair_share(16, ["a", "b", "c"], s) for s in "abc"]
    [6, 5, 5]

    Raises ``ValueError`` if ``me`` is not in ``services``.
    """
    quotient, remainder = divmod(runs, len(services))
    return quotient + (1 if services.index(me) < remainder else 0)


class DetectorService:
    """Streams → detectors → Redis, for every run in the registry.

    Parameters
    ----------
    client : redis.Redis
        Connection (passed in, never global).
    consumer : str, optional
        Consumer name in the group; default ``<host>-<pid>``. A new process takes over the
        pending entries of a dead one when it rebuilds the run.
    group : str
        Consumer group name (``th-detectors``).
    block_ms, count : int
        ``XREADGROUP`` block time (ms) and entries per stream per read.
    snapshot_interval : float
        Seconds between ledger snapshots per active run.
    hang_factory : callable, optional
        Builds each run's :class:`HangDetector` (tests and the demo use a short floor).
    clock : callable
        Unix-time source (tests pass a fake).
    lease_s : int
        Each run is processed by one service at a time: the owner holds ``th:{run}:owner``
        (``SET NX EX``) and renews it every tick and every heartbeat; another service takes the
        run over once the lease expires, or at once when the owner stops cleanly. Several services
        on one Redis share the runs evenly (:func:`fair_share`): each counts the services heard
        from in ``th:services``, takes runs while it holds fewer than its share and hands over
        the excess when a service joins.
    retention_bytes : dict, optional
        Bytes kept per run in the streams the service writes, by name (``agg``, ``ledger``, ``anomaly_log``); the
        others from :func:`trainhealth.config.service_retention_bytes`.
    linger_s : float
        Seconds :meth:`run_forever` waits after a read that caught up before the next (``defaults.READ_LINGER_S``):
        batches at a live job's pace hold the records of that time instead of a few; 0 reads again at once.
    raw_retention : (int, int), optional
        The raw step stream's bound, ``(records, bytes)``: once the service has processed a run's entries it trims
        the older ones to it (:class:`~trainhealth.detectors.retention.RawWindow`), or to the run's own bound when
        that is smaller (``retention_records``/``retention_bytes`` in its meta, from its collectors'
        ``Monitor(retention=, retention_bytes=)`` or environment). Default: ``$TRAINHEALTH_RETENTION`` and
        ``$TRAINHEALTH_RETENTION_BYTES``, else ``defaults``.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        consumer: str | None = None,
        group: str = defaults.CONSUMER_GROUP,
        block_ms: int = defaults.READ_BLOCK_MS,
        count: int = defaults.READ_COUNT,
        snapshot_interval: float = defaults.LEDGER_SNAPSHOT_INTERVAL_S,
        hang_factory: Callable[[], HangDetector] | None = None,
        clock: Callable[[], float] = time.time,
        lease_s: int = defaults.RUN_LEASE_S,
        retention_bytes: dict[str, int] | None = None,
        raw_retention: tuple[int, int] | None = None,
        linger_s: float = defaults.READ_LINGER_S,
    ) -> None:
        self.client = client
        if isinstance(linger_s, bool) or not (isinstance(linger_s, (int, float))
                                              and 0 <= linger_s <= defaults.MAX_READ_LINGER_S):
            raise ConfigError(f"linger_s={linger_s!r} must be seconds between 0 and {defaults.MAX_READ_LINGER_S:g}")
        self.linger_s = float(linger_s)
        #: The newest read got fewer entries than it asked for from every stream: nothing was left behind.
        self.caught_up = True
        #: The raw step stream's bound (records, bytes), by default :func:`trainhealth.config.retention_records` and
        #: :func:`~trainhealth.config.retention_bytes`.
        self.raw_retention = raw_retention or (config.retention_records(), config.retention_bytes())
        #: Bytes kept per run in the streams it writes (``agg``, ``ledger``, ``anomaly_log``); by default
        #: :func:`trainhealth.config.service_retention_bytes` (the environment, else ``defaults``).
        self.retention_bytes = {**config.service_retention_bytes(), **(retention_bytes or {})}
        # Unique per process: two services must never share a consumer (they would split a run's entries).
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.lease_s = lease_s
        self._renew = client.register_script(LEASE_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._extend = client.register_script(RENEW_LUA)
        self._members = client.register_script(MEMBERS_LUA)
        self.group = group
        self.block_ms = block_ms
        self.count = count
        #: Records per steps entry lately (an exponential average; the worst case until the first read).
        self._per_entry = float(defaults.COLLECTOR_BATCH_RECORDS)
        self.snapshot_interval = snapshot_interval
        self.hang_factory = hang_factory or HangDetector
        self.clock = clock
        self.runs: dict[str, _Run] = {}
        self.processed = 0
        #: Entries skipped because they could not be decoded (logged, acknowledged; in the heartbeat).
        self.malformed = 0
        #: Steps entries left out as a batch written twice (:meth:`_note_seq`).
        self.repeated = 0
        self._stop = threading.Event()
        self._last_tick = 0.0
        self._gc_t = time.monotonic()  # the last full collection (_gc_full)
        #: When the last batch was processed (unix s; None before the first), in the heartbeat.
        self._progress_t: float | None = None
        self._heartbeat_thread: threading.Thread | None = None
        #: Runs whose processing raised (a bug, or garbage no decoder catches): run -> (retry at, errors).
        #: Quarantined alone, so every other run goes on; retried (rebuilt from the streams) after a while.
        self.broken: dict[str, tuple[float, int]] = {}
        self._warn_once = WarnOnce(log)  # garbage in Redis, each distinct problem once

    # -- lifecycle ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to stop after the current batch."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """Stop cleanly on SIGTERM and SIGINT, at once on a second one (:func:`trainhealth.loop.stop_on_signals`;
        main thread only)."""
        stop_on_signals(self.stop, log, f"detector service {self.consumer}")

    def run_forever(self) -> None:
        """Process until :meth:`stop`; back off exponentially (capped) while Redis is away."""
        backoff = Backoff()
        # Before the first batch: a starting service is alive.
        with contextlib.suppress(redis.RedisError, OSError, *_REDIS_DOWN):
            self.beat()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="trainhealth-service-heartbeat",
                                                  daemon=True)
        self._heartbeat_thread.start()
        log.info("detector service %s started", self.consumer)
        # Detectors import heavy libraries on first use (the rank-outlier forest: scikit-learn, 1-3 s):
        # import them now, not in the middle of a batch, where every anomaly behind it would wait.
        for module in _LAZY_IMPORTS:
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
        try:
            while not self._stop.is_set():
                try:
                    if self.run_once() and self.caught_up and self.linger_s:
                        self._stop.wait(self.linger_s)  # let the next read take what comes meanwhile at once
                    backoff.reset()
                except (*_REDIS_DOWN, OSError) as exc:
                    wait = backoff.failed()
                    log.warning("Redis unreachable (%s); retrying in %.1f s", exc, wait)
                    self.runs.clear()  # rebuild from the streams after reconnecting
                    self._stop.wait(wait)
                except redis.ResponseError as exc:
                    # E.g. a run's streams deleted under a blocking read ("UNBLOCKED ... no longer exists"):
                    # start over from what is stored rather than die.
                    wait = backoff.failed()
                    log.error("Redis refused a command (%s); rebuilding the runs' state in %.1f s", exc, wait)
                    self.runs.clear()
                    self._stop.wait(wait)
        finally:  # a cold stop (a second signal: SystemExit mid-batch) too must not leave a live-looking heartbeat
            self._stop.set()
            if self._heartbeat_thread is not None:  # its last beat must not land after the key is deleted
                self._heartbeat_thread.join(timeout=defaults.SERVICE_HEARTBEAT_INTERVAL_S + 5.0)
            with contextlib.suppress(redis.RedisError, *_REDIS_DOWN):
                self.client.delete(service_heartbeat(self.consumer))
                self.client.zrem(SERVICES, self.consumer)  # the others' shares grow at once
                for run in list(self.runs.values()):  # hand the runs over now instead of after the lease
                    self._release(keys=[run.keys.owner], args=[self.consumer])
        log.info("detector service %s stopped after %d entries", self.consumer, self.processed)

    def run_once(self, block_ms: int | None = None) -> int:
        """One iteration: discover runs, read and process a batch, then timed work. Returns entries read."""
        self.discover()
        with _gc_paused():
            n = self._read_batch(self.block_ms if block_ms is None else block_ms)
        if time.monotonic() - self._gc_t >= GC_FULL_INTERVAL_S:
            _gc_full()
            self._gc_t = time.monotonic()
        now = self.clock()
        if now - self._last_tick >= 1.0 or n == 0:
            self._tick(now)
            self._last_tick = now
        return n

    # -- runs -------------------------------------------------------------------------------------
    def live_services(self) -> list[str]:
        """Consumers of the services sharing the runs: heard from in ``th:services`` within
        ``SERVICE_LIVE_S`` seconds (Redis server time), and this one; sorted."""
        heard = self._members(keys=[SERVICES], args=["", defaults.SERVICE_LIVE_S, defaults.SERVICE_FORGET_S])
        return sorted({_s(m) for m in heard} | {self.consumer})

    def discover(self) -> None:
        """Share the runs of ``th:runs`` with the other live services: hand over the runs held beyond
        this service's :func:`fair_share`, and take runs nobody holds (rebuilding their state first)
        while below it."""
        registry = [_s(raw) for raw in self.client.zrange(RUNS, 0, -1)]
        target = fair_share(len(registry), self.live_services(), self.consumer)
        if len(self.runs) > target:
            # A service joined (or this one took runs before it heard of the others): the excess goes back;
            # a service below its share takes it at its next read. The newest-named go, so it is deterministic.
            for run_id in sorted(self.runs, reverse=True)[:len(self.runs) - target]:
                run = self.runs.pop(run_id)
                self._release(keys=[run.keys.owner], args=[self.consumer])
                log.info("run %s handed over: %d services share %d runs, this one's share is %d", run_id,
                         len(self.live_services()), len(registry), target)
            return
        for run in registry:
            if len(self.runs) >= target:
                break
            if run in self.runs or self.broken.get(run, (0.0, 0))[0] > time.monotonic():
                continue
            try:
                keys = run_keys(run)
            except ValueError:
                self._warn_once(f"id:{run}", "ignoring run with invalid id %r in %s", run, RUNS)
                continue
            if not self._renew(keys=[keys.owner], args=[self.consumer, self.lease_s]):
                continue  # another service processes this run
            try:
                self.runs[run] = self._attach(keys)
            except _REDIS_DOWN:
                raise
            except Exception as exc:
                self._quarantine(run, "rebuilding its state", exc)
            else:
                self.broken.pop(run, None)

    def _quarantine(self, run: str, doing: str, exc: Exception) -> None:
        """Set ``run`` aside after an unexpected error, so the other runs go on; retried later."""
        _, n = self.broken.get(run, (0.0, 0))
        self.broken[run] = (time.monotonic() + defaults.RUN_RETRY_S, n + 1)
        self.runs.pop(run, None)
        if n == 0 or (n + 1) % 10 == 0:  # the traceback once, then every 10th retry
            log.error("run %s: error while %s (%d so far): %s; set aside, retried in %.0f s from its streams; the "
                      "other runs go on", run, doing, n + 1, exc, defaults.RUN_RETRY_S, exc_info=exc)
        # Another service (a fixed version) may take it meanwhile.
        with contextlib.suppress(redis.RedisError, *_REDIS_DOWN):
            self._release(keys=[run_keys(run).owner], args=[self.consumer])

    def _meta_num(self, run: str, meta: dict[str, str], name: str, kind: type, ok: Callable[[Any], bool]) -> Any:
        """``meta[name]`` as ``kind`` when present and ``ok``; else None, warned once per run and field."""
        raw = meta.get(name)
        if not raw:
            return None
        try:
            v = kind(raw)
            if ok(v):
                return v
        except (TypeError, ValueError, OverflowError):
            pass
        self._warn_once(f"meta:{run}:{name}:{raw}", "run %s: ignoring field %r = %r of th:{%s}:meta (not a valid "
                        "value)", run, name, raw, run)
        return None

    def _settings(self, run: str, meta: dict[str, str]) -> tuning.Settings:
        """The run's own detector parameters (meta ``detector_settings``); the defaults, warned once, when they are
        not valid (a collector of another version may have written them)."""
        raw = meta.get(tuning.META_FIELD)
        if not raw:
            return {}
        try:
            return tuning.parse(raw, f"th:{{{run}}}:meta {tuning.META_FIELD}")
        except ConfigError as exc:
            self._warn_once(f"meta:{run}:{tuning.META_FIELD}:{raw}", "run %s: ignoring its detector settings, the "
                            "defaults apply: %s", run, exc)
            return {}

    def _retire_stale(self, run: _Run) -> None:
        """After a rebuild with changed detector settings: an anomaly stored active that the rebuilt detectors did
        not find (a straggler the defaults' threshold opened) is resolved, saying why, with its open advice."""
        pipe = self.client.pipeline(transaction=True)
        for aid, d in list(run.stored.items()):
            if d.get("status") != "active" or aid in run.pipeline.anomalies:
                continue
            try:
                _, *scope, _, _ = aid.split(":")
                a = Anomaly(kind=d["kind"], severity=d["severity"], step=int(d["step"]),
                            evidence=d.get("evidence") or {},
                            message=f"{d['message']}; not found with the run's changed detector settings",
                            ranks=tuple(d.get("ranks") or ()), hosts=tuple(d.get("hosts") or ()),
                            end_step=max(int(d["step"]), run.pipeline.current_step), status="resolved",
                            gen=int(d.get("gen") or 0), scope=":".join(scope))
            except (KeyError, TypeError, ValueError):
                continue  # not one this service wrote
            self._close_recommendation(run, a, pipe)
            self._write_anomaly(run, a, pipe)
        pipe.execute()

    def _attach(self, keys: RunKeys) -> _Run:
        meta = {_s(k): _s(v) for k, v in self.client.hgetall(keys.meta).items()}
        world = self._meta_num(keys.run, meta, "world_size", int, lambda v: 1 <= v <= MAX_RANKS)
        price = self._meta_num(keys.run, meta, "gpu_hour_usd", float, lambda v: 0 <= v < math.inf)
        settings = self._settings(keys.run, meta)
        if settings:
            log.info("run %s: detectors built with the run's own settings: %s", keys.run, tuning.describe(settings))
        pipeline = RunPipeline(world or 1, price, hang=self.hang_factory(), run=keys.run, settings=settings)
        run = _Run(keys, pipeline, status=meta.get("status", "running"),
                   replay=meta.get("source", "").startswith("replay:"))
        run.bounds = {name: StreamBound(entries, self.retention_bytes[name]) for name, entries in (
            ("agg", defaults.AGG_RETENTION_ENTRIES), ("ledger", defaults.LEDGER_RETENTION_ENTRIES),
            ("anomaly_log", defaults.EVENTS_RETENTION_ENTRIES))}
        records, nbytes = self.raw_retention
        own = (self._meta_num(keys.run, meta, "retention_records", int, lambda v: v >= 1),
               self._meta_num(keys.run, meta, "retention_bytes", int, lambda v: v >= 1))
        run.raw = RawWindow(min(records, own[0] or records), min(nbytes, own[1] or nbytes))
        started = self._meta_num(keys.run, meta, "started_at", float, math.isfinite)
        if started is not None:
            pipeline.ledger.note_start(started)
        # What is stored is compared with what the replay recomputes: an unreadable entry is rewritten.
        for store, key in ((run.stored, keys.anomalies), (run.stored_recs, keys.recommendations),
                           (run.stored_incidents, keys.incidents)):
            for field_, raw in self.client.hgetall(key).items():
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = None
                if isinstance(value, dict):
                    store[_s(field_)] = value
                else:
                    self._warn_once(f"stored:{key}:{_s(field_)}", "run %s: entry %r of %s is not a JSON object; "
                                    "it is rewritten if the run still has it", keys.run, _s(field_), key)
        for field_, raw in self.client.hgetall(keys.checkpoints).items():
            try:
                run.checkpoints.load(Checkpoint.from_json(raw))
                run.stored_checkpoints[_s(field_)] = _s(raw)
            except ValueError:  # rewritten from the events if the stream still has them
                self._warn_once(f"stored:{keys.checkpoints}:{_s(field_)}", "run %s: entry %r of %s is not a "
                                "checkpoint; it is rewritten if the run still has it", keys.run, _s(field_),
                                keys.checkpoints)
        last = self.client.xrevrange(keys.agg, count=1)
        if last:
            run.last_agg = _sid(last[0][0])
        last = self.client.xrevrange(keys.samples, count=1)
        if last:
            run.last_samples = _sid(last[0][0])
        for every in run.rollup.levels:
            last = self.client.xrevrange(keys.rollup(every), count=1)
            run.last_rollup[every] = _sid(last[0][0]) if last else (0, 0)
        delivered: dict[str, str] = {}
        for stream in keys.input_streams:
            try:
                self.client.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            for g in self.client.xinfo_groups(stream):
                if _s(g["name"]) == self.group:
                    delivered[stream] = _s(g["last-delivered-id"])
        # Rebuild: replay what the group already delivered; writes happen only where the
        # stored state differs, so a crash before XACK never duplicates an anomaly.
        replayed = 0
        final = Output()  # only the end state of each anomaly and recommendation is compared and written
        cursors = {s: "-" for s in keys.input_streams}
        while True:
            batch: list[tuple[tuple[int, int], str, dict]] = []
            for stream in keys.input_streams:
                end = delivered.get(stream, "0-0")
                if cursors[stream] is None or _sid(end) == (0, 0):
                    continue
                entries = self.client.xrange(stream, min=cursors[stream], max=end, count=self._read_count(1))
                if len(entries) < self._read_count(1):
                    cursors[stream] = None  # type: ignore[assignment]
                elif entries:
                    cursors[stream] = "(" + _s(entries[-1][0])
                batch += [(_sid(i), stream, f) for i, f in entries]
            if not batch:
                break
            pipe = self.client.pipeline(transaction=True)
            self._process(run, batch, pipe, final)
            pipe.execute()
            replayed += len(batch)
        # Everything up to last-delivered is now processed: write what differs, acknowledge what was pending.
        pipe = self.client.pipeline(transaction=True)
        final.anomalies = list({a.id: a for a in final.anomalies}.values())
        self._write(run, final, pipe)
        self._write_checkpoints(run, pipe)
        for stream, end in delivered.items():
            for p in self.client.xpending_range(stream, self.group, min="-", max=end, count=100_000):
                pipe.xack(stream, self.group, p["message_id"])
        pipe.execute()
        if replayed:
            log.info("run %s: rebuilt state from %d entries", keys.run, replayed)
        return run

    # -- reading and processing -------------------------------------------------------------------
    def _read_batch(self, block_ms: int) -> int:
        streams = {s: ">" for run in self.runs.values() for s in run.keys.input_streams}
        if not streams:
            self._stop.wait(block_ms / 1000.0)
            return 0
        count = self._read_count(len(self.runs))
        # One XREADGROUP over every run's streams; on Redis Cluster one per run's slot (connection.read_groups).
        reply = read_groups(self.client, self.group, self.consumer, streams, count=count, block_ms=block_ms)
        by_run: dict[str, list[tuple[tuple[int, int], str, dict]]] = {}
        ids: dict[str, list[bytes]] = {}
        n = 0
        for stream_raw, entries in reply or []:
            stream = _s(stream_raw)
            run = run_of(stream)
            by_run.setdefault(run, []).extend((_sid(i), stream, f) for i, f in entries)
            ids[stream] = [i for i, _ in entries]
            n += len(entries)
        for run in self.runs.values():
            # The events stream caught up when this read got fewer of its entries than asked for.
            run.events_caught_up = len(ids.get(run.keys.events, ())) < count
        self.caught_up = all(len(v) < count for v in ids.values())
        for run_id, batch in by_run.items():
            run = self.runs[run_id]
            pipe = self.client.pipeline(transaction=True)
            try:
                self._process(run, batch, pipe)
            except _REDIS_DOWN:
                raise
            except Exception as exc:
                # Not acknowledged: the entries stay pending and are replayed when the run is retried.
                self._quarantine(run_id, f"processing entries {batch[0][0][0]}-{batch[0][0][1]}..", exc)
                continue
            for stream in run.keys.input_streams:
                if ids.get(stream):
                    pipe.xack(stream, self.group, *ids[stream])
            try:
                pipe.execute()
            except redis.ResponseError as exc:
                # Our state no longer matches what is stored (e.g. another writer): rebuild the run.
                log.error("run %s: write failed (%s); rebuilding its state from the streams", run_id, exc)
                self.runs.pop(run_id, None)
        self.processed += n
        return n

    def _read_count(self, runs: int) -> int:
        """Entries per stream for the next read of ``runs`` runs: about ``READ_RECORDS`` records in all, at most
        ``count`` entries and at least one, from the records an entry held lately."""
        return max(1, min(self.count, int(defaults.READ_RECORDS / (self._per_entry * max(1, runs)))))

    def _process(self, run: _Run, batch: Iterable[tuple[tuple[int, int], str, dict]], pipe: Any,
                 collect: Output | None = None) -> None:
        # Records are fed in (entry ms, record time, entry seq) order, so records of different
        # milliseconds never interleave: the batch, ordered by ms, is decoded and fed in chunks cut
        # between milliseconds, in the same order as all at once (for any record times but NaN, which
        # no order holds), with one chunk's records in memory instead of the batch's (up to count x 1,000).
        entries = sorted(batch, key=_entry_ms)
        with _gc_paused():
            i = 0
            while i < len(entries):
                j = min(i + _CHUNK_ENTRIES, len(entries))
                while j < len(entries) and entries[j][0][0] == entries[j - 1][0][0]:
                    j += 1
                self._process_chunk(run, entries[i:j], pipe, collect)
                i = j
        run.dirty = True
        # Processed: the raw step stream's older entries beyond its bound go, in the transaction that acknowledges.
        trim = run.raw.trim()
        if trim is not None:
            pipe.xtrim(run.keys.steps, minid=trim[0], approximate=trim[1])

    def _process_chunk(self, run: _Run, chunk: list[tuple[tuple[int, int], str, dict]], pipe: Any,
                       collect: Output | None) -> None:
        keys = run.keys
        data_sections = run.pipeline.aggregator.data_sections
        ordered: list[tuple | Event] = []  # rows (trainhealth.wire.decode_step_rows) and events
        group: list[tuple[int, list[tuple] | list[Event]]] = []  # (seq, records) of one ms's entries
        group_ms = -1
        step_entries = step_records = 0
        marks: dict[str, Checkpoint] = {}  # checkpoints changed by this chunk's events, and those dropped
        gone: list[str] = []
        for sid, stream, fields in chunk:
            try:
                recs: list[tuple] | list[Event] = (
                    decode_step_rows(fields, data_sections, functools.partial(self._bad_record, keys.run, sid,
                                                                              stream, collect is None))
                    if stream == keys.steps else [decode_event(fields)])
            except (KeyError, ValueError, TypeError) as exc:
                # Bad input never stops the service: the entry is skipped (and acknowledged with its batch).
                self._bad_record(keys.run, sid, stream, collect is None, None, exc)
                continue
            if stream == keys.events and recs[0].kind in CHECKPOINT_KINDS:
                changed, dropped = run.checkpoints.update(recs[0])
                if collect is None:  # live; a rebuild writes what differs from the stored marks at its end
                    marks.update((c.field, c) for c in changed)
                    gone.extend(dropped)
            if stream == keys.steps:
                step_entries += 1
                step_records += len(recs)
                run.raw.add(sid, len(recs), entry_bytes(fields))
                if recs and not self._note_seq(run, fields, recs, pipe, collect is None):
                    continue  # a batch written twice: its records were read already
            if group and sid[0] != group_ms:
                ordered += _time_order(group)
                group = []
            group_ms = sid[0]
            group.append((sid[1], recs))
        if group:
            ordered += _time_order(group)
        changed = {f: c.to_json() for f, c in marks.items() if f not in gone}
        if changed:
            pipe.hset(keys.checkpoints, mapping=changed)
        if gone:
            pipe.hdel(keys.checkpoints, *gone)
        if step_entries:  # bigger entries shrink the next read at once; smaller ones grow it gradually
            avg = max(1.0, step_records / step_entries)
            self._per_entry = max(avg, 0.7 * self._per_entry + 0.3 * avg)
        # Only the records that complete a step (and events that produce something) give an output.
        for out in run.pipeline.feed(ordered):
            if collect is not None:
                collect.anomalies += out.anomalies
                collect.recommendations.update(out.recommendations)
                collect.incidents.update(out.incidents)
                out.anomalies, out.recommendations, out.incidents = [], {}, {}
            self._write(run, out, pipe)

    def _write_checkpoints(self, run: _Run, pipe: Any) -> None:
        """After a rebuild: the checkpoint marks that differ from the stored ones, and the stored ones dropped."""
        kept = {c.field: c.to_json() for c in run.checkpoints.marks}
        changed = {f: j for f, j in kept.items() if run.stored_checkpoints.get(f) != j}
        if changed:
            pipe.hset(run.keys.checkpoints, mapping=changed)
        gone = [f for f in run.stored_checkpoints if f not in kept]
        if gone:
            pipe.hdel(run.keys.checkpoints, *gone)
        run.stored_checkpoints = {}

    def _note_seq(self, run: _Run, fields: dict, rows: list[tuple], pipe: Any, live: bool) -> bool:
        """Records Redis trimmed before this service read them: a gap in one sender's ``seq``; and batches written
        twice. Returns False for an entry whose records were all read before (skipped), else True.

        A collector's sender numbers the step records it has written (acknowledged by Redis): each entry's
        ``seq`` is the count before its first record, ``n`` its records. An entry whose ``seq`` is beyond the
        previous entry's ``seq + n`` follows records that were written and are gone — trimmed by the
        retention bound while this service lagged (the stream is trimmed from its head only, so such a gap is
        seen once, live, never by a rebuild). They are reported as a ``collector_drops`` event with cause
        ``trimmed``, written with the read's acknowledgement, so the ledger counts them once and a rebuild
        reads the count back. The first entry seen of a sender is not judged: what came before it is the run's
        history (:meth:`~trainhealth.detectors.pipeline.RunPipeline.check_history`). An entry whose records all
        come before the expected ``seq`` and are no newer than the newest record read of that sender is a batch
        written twice — the sender retries a MULTI/EXEC whose reply it did not get, as when a primary fails over
        under it — and is left out: fed again, its older steps would look like a rollback. (A second ``Monitor``
        of the same rank and incarnation counts ``seq`` from 0 again, but its records are newer: they are read.)
        Entries without ``seq`` (older collectors, hand-written) are not judged.
        """
        raw = fields.get(b"seq")
        if raw is None:
            return True
        try:
            seq = int(raw)
            n = int(fields.get(b"n", len(rows)))
        except (TypeError, ValueError):
            return True
        first = rows[0]
        key = (first[_ROW_RANK], first[_ROW_INC])
        expected = run.seq_next.get(key)
        newest, seen = max(map(_t, rows)), run.seq_newest_t.get(key, -math.inf)
        run.seq_newest_t[key] = max(newest, seen)
        if expected is not None and n > 0 and seq + n <= expected and newest <= seen:
            if live:
                self.repeated += 1
                log.info("run %s: steps entry of rank %s (records %d-%d) repeats records already read (a batch "
                         "written again after its reply was lost); left out", run.keys.run, key[0], seq, seq + n - 1)
            return False
        run.seq_next[key] = max(expected or 0, seq + n)
        if expected is None or seq <= expected or not live:
            return True
        gap = seq - expected
        log.warning("run %s: %d step records of rank %s were trimmed from Redis before this service read them "
                    "(the collectors' retention, $%s); counted as dropped", run.keys.run, gap, key[0],
                    defaults.RETENTION_ENV)
        pipe.xadd(run.keys.events, {"kind": "collector_drops", "count": gap, "trimmed": gap, "rank": key[0],
                                    "t": repr(self.clock()), "inc": repr(key[1]), "by": "service"},
                  maxlen=defaults.EVENTS_RETENTION_ENTRIES, approximate=True)
        return True

    def _bad_record(self, run: str, sid: tuple[int, int], stream: str, count: bool, index: int | None,
                    exc: Exception) -> None:
        # A bad record is left out (the entry's other records are kept); a bad entry is skipped whole.
        if count:  # counted once, not again when a rebuild replays it
            self.malformed += 1
        what = "entry" if index is None else "record in entry"
        log.warning("run %s: skipping malformed %s %s-%s in %s: %s", run, what, *sid, stream,
                    exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)

    def _write(self, run: _Run, out: Output, pipe: Any) -> None:
        keys = run.keys
        for agg in out.aggs:
            # The entry id is (generation + 1)-(step): increasing in the order steps close, and the
            # same when a restarted service replays the streams, so rewritten steps are skipped.
            aid = (agg.gen + 1, agg.step)
            if agg.step < 0:
                continue
            # Every step feeds the rollup, those of a rebuild's replay too: its open bucket is filled again.
            for bucket in run.rollup.update(agg):
                bid = (bucket.gen + 1, bucket.last)
                if bid > run.last_rollup.get(bucket.every, (0, 0)):
                    pipe.xadd(keys.rollup(bucket.every), bucket.fields(), id=bucket.entry_id,
                              maxlen=defaults.ROLLUP_RETENTION_ENTRIES, approximate=True)
                    run.last_rollup[bucket.every] = bid
            if aid <= run.last_agg:
                continue
            fields = agg_fields(agg)
            maxlen, approx = run.bounds["agg"].maxlen(fields)
            pipe.xadd(keys.agg, fields, id=f"{aid[0]}-{aid[1]}", maxlen=maxlen, approximate=approx)
            run.last_agg = aid
        for gen, step, n_ranks, body in out.samples:
            sid = (gen + 1, step)
            if step < 0 or sid <= run.last_samples:  # a rebuild's replay: stored already
                continue
            # Bounded in bytes as the collectors bound the step stream: the entries like this one that fit.
            maxlen = max(1, min(defaults.SAMPLE_INDICES_RETENTION_ENTRIES,
                                defaults.SAMPLE_INDICES_RETENTION_BYTES // len(body)))
            pipe.xadd(keys.samples, {"step": step, "gen": gen, "n_ranks": n_ranks, "ranks": body},
                      id=f"{sid[0]}-{sid[1]}", maxlen=maxlen, approximate=maxlen > 1000)
            run.last_samples = sid
        if out.job is not None:
            self._write_job(run, out.job, pipe)
        for rec in out.recommendations.values():
            self._write_recommendation(run, rec, pipe)
        for a in out.anomalies:
            if a.id not in out.recommendations and not RollbackAdvisor.concerns(a) and not RecoveryAdvisor.concerns(a):
                self._close_recommendation(run, a, pipe)
            self._write_anomaly(run, a, pipe)
        for iid, inc in out.incidents.items():
            self._write_incident(run, iid, inc, pipe)

    def _close_recommendation(self, run: _Run, a: Anomaly, pipe: Any) -> None:
        """The anomaly needs no action any more (the spike recovered, the loss came back): an open
        recommendation for it is dismissed, saying why, so no stale advice stays on the dashboard."""
        ev = a.evidence
        why = ("the loss recovered by itself" if ev.get("recovered") else
               "training rolled back" if ev.get("rolled_back") else
               "the run ended" if ev.get("run_ended") else
               "the job recovered" if ev.get("resumed_t") is not None or ev.get("resumed") else f"the {a.kind} is over")
        self._move_recommendation(run, f"rec:{a.id}", OPEN_STATUSES, "dismissed", f"{why} (step {a.end_step})", pipe)

    def _move_recommendation(self, run: _Run, rid: str, when: tuple[str, ...], status: str, note: str,
                             pipe: Any) -> bool:
        """Move the service's recommendation ``rid`` to ``status`` (history: ``by`` trainhealth, ``note``) if its
        status is one of ``when``; whether it did.

        The figures are the newest the service wrote (in this very batch, maybe); the lifecycle is the stored one
        (a person may have moved it meanwhile) unless the advice changed since, which started it again at
        ``proposed``."""
        mine = run.stored_recs.get(rid)
        if mine is None or mine.get("status") not in when:
            return False  # not the service's, or decided already (kept in step with Redis below)
        raw = self.client.hget(run.keys.recommendations, rid)
        stored = json.loads(raw) if raw else None
        d = dict(mine)
        if isinstance(stored, dict) and all(stored.get(k) == mine.get(k)
                                            for k in ("action", "checkpoint_step", "skip_steps")):
            d["status"], d["history"] = stored.get("status"), list(stored.get("history") or [])
        if d.get("status") not in when:
            run.stored_recs[rid] = d  # a person decided: not read again
            return False
        now = self.clock()
        d["status"] = status
        d["history"] = [*(d.get("history") or []), {"t": now, "status": status, "by": "trainhealth", "note": note}]
        d["updated_at"] = now
        run.stored_recs[rid] = d
        pipe.hset(run.keys.recommendations, rid, json.dumps(d, sort_keys=True))
        return True

    def _write_incident(self, run: _Run, iid: str, inc: Incident | None, pipe: Any) -> None:
        """Store an incident's new state where it differs from the stored one (``None``: it moved into another and
        is deleted); the other recommendations of its members still ``proposed`` are ``superseded`` by its one."""
        if inc is None:
            if run.stored_incidents.pop(iid, None) is not None:
                pipe.hdel(run.keys.incidents, iid)
            return
        d = inc.to_dict()
        old = run.stored_incidents.get(iid)
        if old is not None and {k: v for k, v in old.items() if k not in _VOLATILE} == d:
            return
        now = self.clock()
        d["first_seen"] = old["first_seen"] if old and "first_seen" in old else now
        d["last_seen"] = now
        run.stored_incidents[iid] = d
        pipe.hset(run.keys.incidents, iid, json.dumps(d, sort_keys=True))
        if inc.recommendation is None:
            return
        chosen = inc.recommendation.removeprefix("rec:")
        by = run.pipeline.anomalies.get(chosen)
        stage = f" (the {LABELS.get(by.kind, by.kind).lower()} at step {by.step})" if by is not None else ""
        for aid in inc.anomalies:
            rid = f"rec:{aid}"
            if rid != inc.recommendation:
                self._move_recommendation(run, rid, ("proposed",), "superseded",
                                          f"superseded by {inc.recommendation}{stage}, the one recommendation of "
                                          f"incident {iid}", pipe)

    def _withdraw_advice(self, run: _Run, pipe: Any) -> None:
        """The run ended: no advice stays open (``proposed`` or ``acknowledged``) on the dashboard; each is
        dismissed, saying so."""
        note = f"the run ended at step {run.pipeline.current_step} ({run.status})"
        for rid, d in list(run.stored_recs.items()):
            if d.get("status") in OPEN_STATUSES:
                self._move_recommendation(run, rid, OPEN_STATUSES, "dismissed", note, pipe)

    def _write_recommendation(self, run: _Run, rec: Recommendation, pipe: Any) -> None:
        d = rec.to_dict()
        # Read the stored one: people change its status (trainhealth advise, the dashboard) meanwhile.
        raw = self.client.hget(run.keys.recommendations, rec.id)
        old = json.loads(raw) if raw else None
        same_advice = old is not None and all(old.get(k) == d[k] for k in ("action", "checkpoint_step", "skip_steps"))
        # The lifecycle is the user's: it survives updates of the figures, not a change of advice.
        d["status"] = old["status"] if same_advice else "proposed"
        if same_advice and "history" in old:
            d["history"] = old["history"]
        if old is not None and {k: v for k, v in old.items() if k not in ("created_at", "updated_at")} == d:
            return
        now = self.clock()
        d["created_at"] = old["created_at"] if same_advice else now
        d["updated_at"] = now
        run.stored_recs[rec.id] = d
        pipe.hset(run.keys.recommendations, rec.id, json.dumps(d, sort_keys=True))

    def _write_anomaly(self, run: _Run, a: Anomaly, pipe: Any) -> None:
        d = json.loads(a.to_json())
        rec = run.stored_recs.get(f"rec:{a.id}")
        if rec is not None:
            # The stable part of the advice travels with the anomaly (and so with its alerts).
            d["recommendation"] = {k: rec[k] for k in ("id", "action", "checkpoint_step", "skip_steps")}
        old = run.stored.get(a.id)
        if old is not None and {k: v for k, v in old.items() if k not in _VOLATILE} == d:
            return
        now = self.clock()
        d["first_seen"] = old["first_seen"] if old else now
        d["last_seen"] = now
        run.stored[a.id] = d
        body = json.dumps(d, sort_keys=True)
        pipe.hset(run.keys.anomalies, a.id, body)
        if old is None:
            # Every anomaly gets an "opened" transition, also one first seen already over.
            transitions = ["opened"] + (["resolved"] if d["status"] == "resolved" else [])
        elif d["status"] == "resolved" and old.get("status") != "resolved":
            transitions = ["resolved"]
        else:
            transitions = ["updated"]
        for transition in transitions:
            fields = {"id": a.id, "transition": transition, "kind": a.kind, "severity": a.severity, "step": a.step,
                      "json": body}
            maxlen, approx = run.bounds["anomaly_log"].maxlen(fields)
            pipe.xadd(run.keys.anomaly_log, fields, maxlen=maxlen, approximate=approx)
        log.info("run %s: %s %s %s", run.keys.run, transitions[-1], a.severity, a.message)

    # -- timed work ---------------------------------------------------------------------------------
    def _errors(self) -> dict[str, dict[str, int]]:
        """Per run: exceptions of its detectors, and of the service itself for a run set aside."""
        # Snapshots (list()): the heartbeat thread reads these while the loop changes them.
        out = {run_id: dict(run.pipeline.detector_errors) for run_id, run in list(self.runs.items())
               if run.pipeline.detector_errors}
        for run_id, (_, n) in list(self.broken.items()):
            out.setdefault(run_id, {})["DetectorService"] = n
        return out

    def beat(self, now: float | None = None) -> None:
        """Write the service's heartbeat ``th:service:{consumer}`` (TTL ``SERVICE_HEARTBEAT_TTL_S``): pid, host,
        ``t`` (now), ``progress_t`` (the end of the last batch processed: how far behind a live process is),
        runs, entries processed, malformed records and detector errors. Also marks it live in ``th:services``
        and extends its leases (renew only: a run the loop just handed over is not taken back)."""
        now = time.time() if now is None else now
        self._members(keys=[SERVICES], args=[self.consumer, defaults.SERVICE_LIVE_S, defaults.SERVICE_FORGET_S])
        for run in list(self.runs.values()):
            self._extend(keys=[run.keys.owner], args=[self.consumer, self.lease_s])
        self.client.set(service_heartbeat(self.consumer),
                        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "t": now,
                                    "progress_t": self._progress_t, "runs": len(self.runs),
                                    "processed": self.processed, "malformed": self.malformed,
                                    "detector_errors": self._errors()}),
                        ex=defaults.SERVICE_HEARTBEAT_TTL_S)

    def _heartbeat_loop(self) -> None:
        # Its own thread: the heartbeat says the process is alive however long a batch takes (progress_t says
        # how far it got). run_forever wrote the first one before starting it.
        while not self._stop.wait(defaults.SERVICE_HEARTBEAT_INTERVAL_S):
            try:
                self.beat()
            except (redis.RedisError, OSError, *_REDIS_DOWN):
                pass  # the main loop backs off and says so
            except Exception:  # e.g. a run dict changing size under the snapshot: the next beat is in 2 s
                log.debug("heartbeat not written", exc_info=True)

    def _tick(self, now: float) -> None:
        self._progress_t = now
        for run_id, run in list(self.runs.items()):
            if not self._renew(keys=[run.keys.owner], args=[self.consumer, self.lease_s]):
                log.warning("run %s: lease lost to another service; no longer processing it", run_id)
                self.runs.pop(run_id)
                continue
            try:
                self._tick_run(run, now)
            except _REDIS_DOWN:
                raise
            except Exception as exc:
                self._quarantine(run_id, "checking heartbeats and writing the ledger", exc)

    def _tick_run(self, run: _Run, now: float) -> None:
        if now - run.meta_checked >= 5.0:
            fields = ("status", "world_size", "gpu_hour_usd", "source", tuning.META_FIELD)
            meta = {k: _s(v) for k, v in zip(fields, self.client.hmget(run.keys.meta, fields), strict=False) if v}
            if self._settings(run.keys.run, meta) != run.pipeline.settings:
                # Written after the run was attached (rank 0 connected after another rank registered the run), or
                # changed by a relaunch: the run's detectors are rebuilt with them, from its streams (as after a
                # restart of the service), so their state never mixes two settings.
                log.info("run %s: its detector settings changed; rebuilding its state with them", run.keys.run)
                self.runs[run.keys.run] = rebuilt = self._attach(run.keys)
                self._retire_stale(rebuilt)
                return
            run.replay = run.replay or meta.get("source", "").startswith("replay:")
            if meta.get("status") and meta["status"] != run.status:
                run.status, run.dirty = meta["status"], True
            world = self._meta_num(run.keys.run, meta, "world_size", int, lambda v: 1 <= v <= MAX_RANKS)
            if world is not None:
                run.pipeline.set_world_size(world)
            price = self._meta_num(run.keys.run, meta, "gpu_hour_usd", float, lambda v: 0 <= v < math.inf)
            if price is not None:
                run.pipeline.set_gpu_hour_usd(price)
            run.meta_checked = now
        pipe = self.client.pipeline(transaction=True)
        out = run.pipeline.flush_stale(now)
        self._write(run, out, pipe)
        if run.events_caught_up and not run.replay:  # a replay pushes records without run_start events
            self._write(run, run.pipeline.check_history(), pipe)
        if run.status in ("running", "crashed"):  # a crashed job is watched for its relaunch
            hbs = {}
            for rank, raw in self.client.hgetall(run.keys.heartbeats).items():
                try:
                    r, hb = int(_s(rank)), json.loads(raw)
                    t = float(hb["t"])
                except (ValueError, TypeError, KeyError, OverflowError):
                    hb, t = None, math.nan
                if not (isinstance(hb, dict) and math.isfinite(t) and 0 <= r < MAX_RANKS):
                    self._warn_once(f"hb:{run.keys.run}:{_s(rank)}", "run %s: ignoring heartbeat %r = %r of %s (not "
                                    "a JSON object with a time 't')", run.keys.run, _s(rank), _s(raw)[:80],
                                    run.keys.heartbeats)
                    continue
                hbs[r] = {**hb, "t": t}
            newest = max((h["t"] for h in hbs.values()), default=0.0)
            if hbs and now - newest < RUN_INACTIVE_S:
                out = run.pipeline.check_heartbeats(now, hbs)
                self._write(run, out, pipe)
                self._write_memory(run, now, hbs, pipe)
                if out.job is not None:
                    run.last_snapshot = 0.0  # the ledger follows the job's state now (a crash stops it)
        if run.status not in LIVE_STATUSES:
            self._withdraw_advice(run, pipe)
        if (run.dirty or run.status == "running") and now - run.last_snapshot >= self.snapshot_interval:
            self._snapshot(run, now, pipe)
        pipe.execute()

    def _write_memory(self, run: _Run, now: float, hbs: dict[int, dict[str, Any]], pipe: Any) -> None:
        """Every ``defaults.MEMORY_HISTORY_S`` seconds, the ranks' newest memory samples as one ``th:{run}:mem``
        entry (the heartbeats hash keeps only the newest: the Ranks page draws memory over time from these)."""
        if now - run.last_memory < defaults.MEMORY_HISTORY_S:
            return
        fields = memory_entry({r: hb for r, hb in hbs.items() if r not in run.pipeline.ended_ranks}, now)
        if fields is not None:
            pipe.xadd(run.keys.memory, fields, maxlen=defaults.MEMORY_HISTORY_ENTRIES, approximate=True)
            run.last_memory = now

    def _write_job(self, run: _Run, job: JobState, pipe: Any) -> None:
        """Store the job's new state (``th:{run}:state``); a crash also shows in the run's ``status``, which
        goes back to ``running`` when the job comes back (the collectors of a relaunch write it too)."""
        pipe.set(run.keys.state, job.to_json())
        if job.state == "crashed":
            pipe.hset(run.keys.meta, mapping={"status": "crashed", "status_detail": job.message})
        elif run.crashed:
            pipe.hset(run.keys.meta, mapping={"status": "running", "status_detail": job.message})
        run.crashed = job.state == "crashed"
        run.dirty = True
        log.log(logging.WARNING if job.state in ("hung", "crashed") else logging.INFO, "run %s: job %s%s",
                run.keys.run, job.state, f": {job.message}" if job.message else "")

    def _snapshot(self, run: _Run, now: float, pipe: Any) -> None:
        ledger = run.pipeline.ledger
        if ledger.last_activity is None:
            return
        # A live job's ledger runs to now (an open gap is idle, then hang); a finished run's, and a replay's
        # (the wait between its paced pushes is the replay's pace, not the job's time), end at its last activity.
        at = now if run.status == "running" and not run.replay else ledger.last_activity
        job = run.pipeline.job.state
        if job is not None and job.state == "crashed":
            at = max(job.since, ledger.last_activity)  # the job is gone: its ledger stops where it was last heard
        elif run.pipeline.silent_since is not None:  # nobody heard from (not called crashed yet): no time after that
            at = max(min(at, run.pipeline.silent_since), ledger.last_activity)
        snap = ledger.snapshot(at)
        body = json.dumps(snap)
        pipe.set(run.keys.ledger_latest, body)
        fields = {"t": repr(snap["t"]), "json": body}
        maxlen, approx = run.bounds["ledger"].maxlen(fields)
        pipe.xadd(run.keys.ledger, fields, maxlen=maxlen, approximate=approx)
        run.last_snapshot = now
        run.dirty = False
