"""The collector's background sender: drains the bounded buffer into Redis in pipelined batches.

Wire format: consecutive step records of one rank go into one ``th:{run}:steps`` entry
(``rank``, ``n``, ``recs`` = a JSON list of records), so Redis and the detector service
handle one entry per batch instead of one per record; events are one entry each.

Like sentry-python's transport worker, it is the only place that does I/O: the training
thread only appends to a ``collections.deque(maxlen=N)`` (an atomic, bounded, lock-free
append; the oldest record is dropped when full and the drop counted by the caller).
On a Redis error the current batch is kept and retried after a capped exponential
back-off, so nothing is lost unless the buffer itself overflows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from collectors.spill import Spill
from trainhealth import defaults
from trainhealth.keys import RUNS, RunKeys

log = logging.getLogger(__name__)

#: A queued record: (stream, fields). ``stream`` is "steps" or "events".
Record = tuple[str, dict[str, Any]]


def encode_value(v: Any) -> str | int | None:
    """Encode one event field for XADD: ints as is, floats with ``repr`` (keeps nan/inf), strings as is.

    Other values (tensors, numpy scalars) go through ``float()``; None when that fails.
    """
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return v
    try:
        return repr(float(v))
    except (TypeError, ValueError):
        return None


_PLAIN = frozenset({int, float, bool, type(None)})


def _as_number(v: Any) -> float | None:
    if isinstance(v, str):
        return None  # a string in a metric is a caller's mistake: never guess
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class Sender(threading.Thread):
    """Daemon thread that moves queued records to Redis.

    Parameters
    ----------
    connect : callable returning a ``redis.Redis``
        Called on start and after errors; may raise.
    keys : RunKeys
        The run's keys.
    buffer : deque
        The bounded buffer the training thread appends to.
    heartbeat : callable returning ``(rank, json_str)`` or None
        Called every ``heartbeat_interval`` seconds.
    registry : dict
        Run metadata fields written (``HSET``; ``started_at`` with ``HSETNX``) on each connect.
    dropped : callable returning int
        Number of records dropped so far (reported as a ``collector_drops`` event).
    """

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        keys: RunKeys,
        buffer: deque,
        heartbeat: Callable[[], tuple[int, str]],
        registry: dict[str, Any],
        dropped: Callable[[], int],
        *,
        batch: int = defaults.COLLECTOR_BATCH_RECORDS,
        flush_interval: float = defaults.COLLECTOR_FLUSH_INTERVAL_S,
        heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL_S,
        retention: int = defaults.STEPS_RETENTION_ENTRIES,
        events_retention: int = defaults.EVENTS_RETENTION_ENTRIES,
        spill: Spill | None = None,
    ) -> None:
        super().__init__(name=f"trainhealth-sender-{keys.run}", daemon=True)
        self._connect = connect
        self._keys = keys
        self._buffer = buffer
        self._heartbeat = heartbeat
        self._registry = registry
        self._dropped = dropped
        self.batch = batch
        self.flush_interval = flush_interval
        self.heartbeat_interval = heartbeat_interval
        self._maxlen = {"steps": retention, "events": events_retention}
        self._client: redis.Redis | None = None
        self._inflight: list[Record] = []
        self._inflight_spilled = False  # the in-flight batch came from the spill (commit it once sent)
        self._spill = spill
        self._next_attempt = 0.0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._idle = threading.Event()
        self._reported_drops = 0
        self._spill_failed = 0
        self._next_hb = 0.0
        self._backoff = 0.0
        self._warned: set[str] = set()
        #: Records delivered to Redis, and whether the last attempt reached it.
        self.sent = 0
        self.connected = False
        #: CPU seconds this thread has used, and those it had used once first connected (start-up).
        self.cpu_s = 0.0
        self.cpu_startup_s: float | None = None

    # -- called from other threads ------------------------------------------------------
    def wake(self) -> None:
        """Ask for an immediate flush."""
        self._wake.set()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until everything queued so far is sent; True if it was."""
        deadline = time.monotonic() + timeout
        while self._buffer or self._inflight or (self._spill is not None and len(self._spill)):
            self._idle.clear()
            self._wake.set()
            left = deadline - time.monotonic()
            if left <= 0 or not self.is_alive():
                return False
            self._idle.wait(min(left, 0.05))
        return True

    def stop(self, timeout: float) -> bool:
        """Flush within ``timeout`` seconds, then stop the thread; True if all was sent."""
        ok = self.flush(timeout)
        self._stopping.set()
        self._wake.set()
        self.join(max(0.0, min(timeout, 1.0)))
        return ok

    # -- the thread ----------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stopping.is_set():
            if self.connected or time.monotonic() >= self._next_attempt:
                try:
                    self._cycle()
                    self._backoff = 0.0
                except (redis.RedisError, OSError) as exc:
                    self._on_error(exc)
                except Exception:  # never let the thread die: log and keep going
                    log.exception("trainhealth collector: unexpected error in sender (records kept)")
                    self._stopping.wait(1.0)
            if not self.connected:
                self._spill_overflow()
            self.cpu_s = time.thread_time()
            if self.cpu_startup_s is None and self.connected:
                self.cpu_startup_s = self.cpu_s
            if not self._buffer and not self._inflight and not (self._spill is not None and len(self._spill)):
                self._idle.set()
            if len(self._buffer) < self.batch:
                # While disconnected keep waking at the flush interval: the buffer may need spilling.
                self._wake.wait(self.flush_interval)
                self._wake.clear()

    def _spill_overflow(self) -> None:
        """Redis is away: move the buffer to disk once it is half full, oldest first, in order."""
        spill, buf = self._spill, self._buffer
        if spill is None or len(buf) < (buf.maxlen or 0) // 2:
            return
        popleft = buf.popleft
        records = [popleft() for _ in range(len(buf))]
        encoded = [(stream, enc) for stream, fields in records if (enc := self._clean(stream, fields)) is not None]
        try:
            spill.write(encoded)
        except OSError as exc:
            log.warning("trainhealth collector: cannot spill to %s (%s); dropping %d records",
                        spill.directory, exc, len(encoded))
            self._spill_failed += len(encoded)

    def _on_error(self, exc: BaseException) -> None:
        if self.connected or self._backoff == 0.0:
            log.warning(
                "trainhealth collector: Redis unreachable (%s); buffering up to %d records, retrying",
                exc, self._buffer.maxlen,
            )
        self.connected = False
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        self._backoff = min(
            defaults.RECONNECT_BACKOFF_MAX_S, max(defaults.RECONNECT_BACKOFF_S, self._backoff * 2)
        )
        self._next_attempt = time.monotonic() + self._backoff

    def _cycle(self) -> None:
        if self._client is None:
            self._client = self._connect()
            self._client.ping()
            if not self.connected:
                log.info("trainhealth collector: connected to Redis for run %s", self._keys.run)
            self._register(self._client)
            self.connected = True
        client = self._client
        now = time.time()
        hb_due = now >= self._next_hb
        drops = self.dropped_total - self._reported_drops
        first = True
        # Oldest first: the batch that failed, then the spill, then the in-memory buffer.
        while True:
            if not self._inflight:
                if self._spill is not None and len(self._spill):
                    self._inflight = self._spill.peek(self.batch)
                    self._inflight_spilled = True
                elif self._buffer:
                    n = min(self.batch, len(self._buffer))
                    popleft = self._buffer.popleft
                    self._inflight = [popleft() for _ in range(n)]
                    self._inflight_spilled = False
            if not self._inflight and not first:
                return
            # One MULTI/EXEC per batch: a batch lands whole or not at all, so a retry after a
            # dropped connection does not write part of it twice.
            pipe = client.pipeline(transaction=True)
            self._add_batch(pipe, self._inflight, clean=not self._inflight_spilled)
            if first and drops > 0:
                ev = self._clean("events", {"kind": "collector_drops", "count": drops,
                                            **self._registry_event_fields()})
                self._add_batch(pipe, [("events", ev)], clean=False)
            if first and hb_due:
                rank, body = self._heartbeat()
                pipe.hset(self._keys.heartbeats, str(rank), body)
            if len(pipe):
                pipe.execute()
            self.sent += len(self._inflight)
            if self._inflight_spilled:
                self._spill.commit(len(self._inflight))  # type: ignore[union-attr]
            self._inflight = []
            if first and drops > 0:
                self._reported_drops += drops
                log.warning("trainhealth collector: %d records were dropped while Redis was away", drops)
            if first and hb_due:
                self._next_hb = now + self.heartbeat_interval
            first = False

    def _add_batch(self, pipe: Any, records: list[Record], clean: bool) -> None:
        """Queue ``records`` on ``pipe``: each run of consecutive step records becomes one entry
        (``rank``, ``n``, ``recs`` = JSON list), each event its own entry, so entry ids keep the order."""
        steps: list[dict[str, Any]] = []
        for stream, fields in records:
            rec = self._clean(stream, fields) if clean else fields
            if rec is None:
                continue
            if stream == "steps":
                steps.append(rec)
                continue
            if steps:
                self._xadd_steps(pipe, steps)
                steps = []
            pipe.execute_command("XADD", self._keys.events, "MAXLEN", "~", self._maxlen["events"], "*",
                                 *[x for kv in rec.items() for x in kv])
        if steps:
            self._xadd_steps(pipe, steps)

    def _xadd_steps(self, pipe: Any, steps: list[dict[str, Any]]) -> None:
        body = json.dumps(steps, separators=(",", ":"))  # NaN/Infinity kept as JSON5-style tokens
        pipe.execute_command("XADD", self._keys.steps, "MAXLEN", "~", self._maxlen["steps"], "*",
                             "rank", self._registry["_rank"], "n", len(steps), "recs", body)

    @property
    def dropped_total(self) -> int:
        """Records lost so far: buffer overflow, spill bound exceeded, spill write failures."""
        return self._dropped() + (self._spill.dropped if self._spill is not None else 0) + self._spill_failed

    def _registry_event_fields(self) -> dict[str, Any]:
        return {"rank": self._registry["_rank"], "t": repr(time.time()), "inc": self._registry["_inc"]}

    def _clean(self, stream: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        """A record ready to send: step records keep numbers only (JSON-encoded later), event fields
        become strings/ints. A value that cannot be a number in a step record is left out, with one
        warning per field; tensors and numpy scalars become Python floats."""
        if stream == "steps" and _PLAIN.issuperset(map(type, fields.values())):
            return {k: v for k, v in fields.items() if v is not None}  # the usual case, cheap
        numeric = stream == "steps"
        out: dict[str, Any] = {}
        for k, v in fields.items():
            if v is None:
                continue
            if numeric:
                e: Any = v if type(v) in _PLAIN else _as_number(v)
            else:
                e = encode_value(v)
            if e is None:
                if k not in self._warned:
                    self._warned.add(k)
                    log.warning("trainhealth collector: field %r has non-numeric value %r; not recorded", k, v)
                continue
            out[k] = e
        return out

    def _register(self, client: redis.Redis) -> None:
        meta = {k: v for k, v in self._registry.items() if not k.startswith("_") and v is not None}
        pipe = client.pipeline(transaction=False)
        pipe.zadd(RUNS, {self._keys.run: float(meta.get("started_at", time.time()))}, nx=True)
        started = meta.pop("started_at", None)
        if started is not None:
            pipe.hsetnx(self._keys.meta, "started_at", repr(float(started)))
        if meta:
            pipe.hset(self._keys.meta, mapping={k: json.dumps(v) if isinstance(v, dict) else str(v)
                                                for k, v in meta.items()})
        pipe.execute()
