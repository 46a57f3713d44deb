"""The collector's background sender: drains the bounded buffer into Redis in pipelined batches.

Wire format: consecutive step records of one rank go into one ``th:{run}:steps`` entry
(``rank``, ``n``, ``recs`` = a JSON list of records), so Redis and the detector service
handle one entry per batch instead of one per record; events are one entry each.

Like sentry-python's transport worker, it is the only place that does I/O: the training
thread only appends to a ``collections.deque(maxlen=N)`` (an atomic, bounded, lock-free
append; the oldest record is dropped when full and the drop counted by the caller).
On a Redis error the current batch is kept and retried after a capped exponential
back-off, so nothing is lost unless the buffer itself overflows.

The training thread must never wait on this one (issue 15), and in CPython it does whenever this thread holds the
GIL: a thread that wants it back gets it when the holder blocks, or after the 5 ms switch interval, and not at all
inside one long C call (``json.dumps`` of a whole batch, a garbage collection). So the sender

- encodes, spills and reads the spill one record at a time, and every :data:`SLICE_S` of that work sleeps
  :data:`PAUSE_S`, long enough for a waiting thread to take the GIL (a ``sleep(0)`` lets this thread take it
  straight back); no single C call handles more than one record;
- keeps no object the garbage collector tracks per record: a step record waits as its dict alone (a dict of
  numbers is untracked; a ``(stream, fields)`` tuple holding it is always tracked), and is sent, and spilled, as its
  JSON text. A backlog of 100,000 tracked tuples made each full collection take tens of ms, paid by whichever
  thread triggered it: during an outage, the training loop;
- never touches ``sys.setswitchinterval`` or ``gc``'s settings: both belong to the training program.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any

import redis

from trainhealth import defaults
from trainhealth.collectors.spill import STEP_LINE_PREFIX, Spill, record_line
from trainhealth.connection import REDIS_DOWN
from trainhealth.keys import RUNS, RunKeys
from trainhealth.loop import Backoff
from trainhealth.text import show
from trainhealth.warn_once import WarnOnce
from trainhealth.wire import DROP_CAUSES, encode_indices, encode_value

log = logging.getLogger(__name__)

#: A record: (stream, fields). ``stream`` is "steps" or "events".
Record = tuple[str, dict[str, Any]]
#: A buffered record: a step record's fields dict alone (see :meth:`Sender.put_step`), anything else a Record.
Item = dict[str, Any] | Record
#: A record ready to send: a step record as its JSON text, an event as ("events", fields of str and int).
Encoded = str | Record

#: Longest stretch (s) of the sender's per-record work (encoding, spilling, reading the spill) between two pauses.
SLICE_S = 0.0002
#: Each pause (s): a real sleep, so that a thread waiting for the GIL wakes and takes it (Linux adds its 50 µs
#: timer slack). Costs the sender about a third of its speed while it works through a backlog.
PAUSE_S = 0.00005
_STEP_LINE_START = len(STEP_LINE_PREFIX)
#: Encodes a step record as the sender sends it: the same bytes as one element of ``json.dumps(list)``.
_dumps = json.JSONEncoder(separators=(",", ":")).encode  # NaN/Infinity kept as JSON5-style tokens


_PLAIN = frozenset({int, float, bool, type(None)})
#: Integer fields of a step record (``trainhealth.wire``: rank, step and ``_STEP_INTS``). The detector
#: service refuses a record whose value there is not a finite number; the ledger keeps them as int64.
INT_FIELDS = ("rank", "step", "tokens", "samples", "consumed_samples", "batch_index", "skipped", "loss_missing")
#: Float fields a caller can fill (sections and ``dur`` are floats by construction, ``inc`` is checked).
_FLOAT_FIELDS = ("t", "loss", "grad_norm", "lr", "step_s", "loss_scale")
_INT_SET = frozenset(INT_FIELDS)
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1
_FLOAT_MAX = sys.float_info.max
_NON_NUMERIC, _TOO_BIG_INT, _TOO_BIG_FLOAT = "has non-numeric value", "is not an integer within ±2**63", \
    "is too large for a float"




def _as_number(v: Any) -> float | None:
    if isinstance(v, str):
        return None  # a string in a metric is a caller's mistake: never guess
    try:
        return float(v)
    except Exception:  # TypeError/ValueError, OverflowError, or whatever a foreign __float__ raises
        return None


def _in_range(fields: dict[str, Any]) -> bool:
    """Whether a step record of plain values (ints, floats, bools, None) is all valid on the wire."""
    get = fields.get
    for k in INT_FIELDS:
        v = get(k)
        if v is not None and not _INT_MIN <= v <= _INT_MAX:  # NaN and ±Inf fail too
            return False
    for k in _FLOAT_FIELDS:
        v = get(k)
        if v is not None and type(v) is not float and (type(v) is bool or not -_FLOAT_MAX <= v <= _FLOAT_MAX):
            return False
    return True


#: Number fields of an event (``trainhealth.wire.decode_event``), True for the integer ones: any other
#: value there would make the service skip the event.
_EVENT_NUMBERS = {"rank": True, "step": True, "t": False, "inc": False, "seconds": False}


def _event_value(k: str, v: Any) -> tuple[Any, str]:
    """One event field as sent (see :func:`encode_value`), or ``(None, why)``."""
    integer = _EVENT_NUMBERS.get(k)
    if integer is None:
        return encode_value(v), _NON_NUMERIC
    if isinstance(v, str):  # the sender's own fields come encoded
        try:
            (int if integer else float)(v)
        except ValueError:
            return None, _NON_NUMERIC
        return v, ""
    e, why = _step_value("step" if integer else "t", v)
    if integer and type(e) is float:
        if not e.is_integer():
            return None, _NON_NUMERIC
        e = int(e)
    return (None, why) if e is None else (encode_value(e), "")


def _step_value(k: str, v: Any) -> tuple[Any, str]:
    """One step-record value as sent, or ``(None, why)``: NaN/Inf stay in float fields (the NaN detector
    needs them); an int field takes a finite integer within int64, a float field a value ``float()`` takes."""
    if k in _INT_SET:
        if type(v) is not int and type(v) is not bool:
            try:
                v = v.__index__()  # numpy and tensor integers, exactly
            except Exception:
                v = _as_number(v)
                if v is None:
                    return None, _NON_NUMERIC
        return (v, "") if _INT_MIN <= v <= _INT_MAX else (None, _TOO_BIG_INT)
    if type(v) is float:
        return v, ""
    if type(v) is bool or isinstance(v, str):
        return None, _NON_NUMERIC
    try:
        return float(v), ""
    except OverflowError:
        return None, _TOO_BIG_FLOAT
    except Exception:
        return None, _NON_NUMERIC


class Sender(threading.Thread):
    """Daemon thread that moves queued records to Redis.

    Parameters
    ----------
    connect : callable returning a ``redis.Redis``
        Called on start and after errors; may raise.
    keys : RunKeys
        The run's keys.
    buffer_records : int
        Bound of the buffer the training thread appends to (:meth:`put`); beyond it the oldest records are
        dropped and counted (:attr:`overflowed`).
    heartbeat : callable returning ``(rank, json_str)`` or None
        Called every ``heartbeat_interval`` seconds.
    registry : dict
        Run metadata fields written (``HSET``; ``started_at`` with ``HSETNX``) on each connect.

    The sender owns the buffer and every count of what it lost (:attr:`dropped_total`, reported as a
    ``collector_drops`` event), as sentry-python's ``BackgroundWorker`` owns its queue.
    """

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        keys: RunKeys,
        buffer_records: int,
        heartbeat: Callable[[], tuple[int, str]],
        registry: dict[str, Any],
        *,
        batch: int = defaults.COLLECTOR_BATCH_RECORDS,
        flush_interval: float = defaults.COLLECTOR_FLUSH_INTERVAL_S,
        heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL_S,
        retention: int = defaults.STEPS_RETENTION_RECORDS,
        retention_bytes: int = defaults.STEPS_RETENTION_BYTES,
        events_retention: int = defaults.EVENTS_RETENTION_ENTRIES,
        spill: Spill | None = None,
    ) -> None:
        super().__init__(name=f"trainhealth-sender-{keys.run}", daemon=True)
        self._connect = connect
        self._keys = keys
        self._buffer: deque[Item] = deque(maxlen=buffer_records)
        #: Records the buffer dropped, oldest first, because it was full.
        self.overflowed = 0
        self._heartbeat = heartbeat
        self._registry = registry
        self.batch = batch
        self.flush_interval = flush_interval
        self.heartbeat_interval = heartbeat_interval
        self._maxlen = {"steps": retention, "events": events_retention}
        self._max_bytes = retention_bytes
        self._client: redis.Redis | None = None
        self._inflight: list[Encoded] = []
        self._inflight_from_spill = 0  # lines of the spill the in-flight batch came from (committed once sent)
        #: Records taken from the buffer or the spill and not yet in the in-flight batch or the spill: counted as
        #: pending, so that a flush() never sees them nowhere.
        self._moving = 0
        self._slice_end = 0.0  # perf_counter() at which the current stretch of work must pause
        self._spill = spill
        self._next_attempt = 0.0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._idle = threading.Event()
        self._reported_drops = 0
        self._reported_by_cause: dict[str, int] = {}
        self._spill_failed = 0
        self._unsendable = 0  # records that could not be encoded (no valid step or time, or worse)
        self._next_hb = 0.0
        self._backoff = Backoff()
        # Internal errors, once each with their traceback: the sender must never die or flood the job's log.
        self._log_once = WarnOnce(log, level=logging.ERROR)
        self._warn_once = WarnOnce(log, "trainhealth collector: ")  # values the wire format cannot carry
        #: Records delivered to Redis, and whether the last attempt reached it.
        self.sent = 0
        # Step records this sender has written to Redis (acknowledged), and the count as the pipeline being built
        # will leave it: each steps entry carries the first as ``seq``, so the service can tell records Redis
        # trimmed before it read them (a gap in one sender's seq) from records never sent.
        self._seq = 0
        self._seq_build = 0
        self.connected = False
        #: Set by :meth:`Monitor.goodput_metrics`: read the run's latest ledger snapshot with each heartbeat into
        #: :attr:`ledger` (the decoded ``th:{run}:ledger:latest``; None until the service wrote one).
        self.want_ledger = False
        self.ledger: dict[str, Any] | None = None
        #: The run's active incidents (decoded ``th:{run}:incidents`` values), critical first, read with the ledger.
        self.incidents: list[dict[str, Any]] = []
        #: CPU seconds this thread has used, and those it had used once first connected (start-up).
        self.cpu_s = 0.0
        self.cpu_startup_s: float | None = None

    # -- called from other threads ------------------------------------------------------
    def wake(self) -> None:
        """Ask for an immediate flush."""
        self._wake.set()

    def put(self, stream: str, fields: dict[str, Any]) -> None:
        """Queue one record for ``stream`` (``steps`` or ``events``), from the training thread.

        O(1) and lock-free (``deque.append``); when the buffer is full the oldest record is dropped and
        counted, never raised.
        """
        if stream == "steps" and type(fields) is dict:
            self.put_step(fields)
            return
        buf = self._buffer
        if len(buf) == buf.maxlen:
            self.overflowed += 1  # deque drops the oldest on append
        buf.append((stream, fields))

    def put_step(self, fields: dict[str, Any]) -> None:
        """Queue one step record (a dict): the training thread's call per step, as :meth:`put`.

        The dict is queued alone: one of plain numbers is not tracked by the garbage collector, so a backlog of
        them adds nothing to the collections the training thread pays for.
        """
        buf = self._buffer
        if len(buf) == buf.maxlen:
            self.overflowed += 1  # deque drops the oldest on append
        buf.append(fields)

    def start(self) -> None:
        """Start the thread; never raises: a thread that cannot start (at interpreter shutdown, or out of
        threads) is logged once, and the records stay buffered until the process ends (as sentry-python's
        worker does)."""
        try:
            super().start()
        except RuntimeError as exc:  # "can't create new thread at interpreter shutdown", "can't start new thread"
            log.warning("trainhealth collector: cannot start the sender thread (%s); nothing will be sent", exc)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until everything queued so far is sent; True if it was."""
        deadline = time.monotonic() + timeout
        while (self._buffer or self._inflight or self._moving or (self._spill is not None and len(self._spill))
               or (self.connected and self.dropped_total > self._reported_drops)):  # the drops are reported too
            self._idle.clear()
            self._wake.set()
            left = deadline - time.monotonic()
            if left <= 0 or not self.is_alive():
                return False
            self._idle.wait(min(left, 0.05))
        return True

    def wait_sent(self, timeout: float) -> bool:
        """:meth:`flush` for a signal handler: waits up to ``timeout`` seconds for everything queued to be sent
        without taking any lock (no Event is set or waited on), so a handler that interrupted :meth:`flush` inside
        an Event's lock cannot deadlock on it; the thread sends within its ``flush_interval`` on its own."""
        deadline = time.monotonic() + timeout
        while self._buffer or self._inflight or self._moving or (self._spill is not None and len(self._spill)):
            if time.monotonic() >= deadline or not self.is_alive():
                return False
            time.sleep(0.01)
        return True

    @property
    def pending(self) -> int:
        """Records not delivered yet: the buffer, the batch in flight and the spill (a batch in flight
        that was read from the spill is counted once)."""
        spill = self._spill
        n = len(self._buffer) + len(self._inflight) + self._moving
        return n + len(spill) - spill.peeked if spill is not None else n

    def stop(self, timeout: float) -> bool:
        """Flush within ``timeout`` seconds, then stop the thread; True if all was sent."""
        ok = self.flush(timeout)
        self._stopping.set()
        self._wake.set()
        if self.is_alive():  # a thread that never started cannot be joined
            self.join(max(0.0, min(timeout, 1.0)))
        return ok

    # -- the thread ----------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stopping.is_set():
            self._pause()
            if self.connected or time.monotonic() >= self._next_attempt:
                try:
                    self._cycle()
                    self._backoff.reset()
                except (redis.RedisError, OSError, *REDIS_DOWN) as exc:
                    self._on_error(exc)
                except Exception:  # never let the thread die: log and keep going
                    if not self._salvage():
                        log.exception("trainhealth collector: unexpected error in sender (records kept)")
                        self._stopping.wait(1.0)
                        self._slice_end = perf_counter() + SLICE_S
            if not self.connected:
                try:
                    self._spill_overflow()
                except Exception:  # never let the thread die
                    log.exception("trainhealth collector: unexpected error while spilling")
            self.cpu_s = time.thread_time()
            if self.cpu_startup_s is None and self.connected:
                self.cpu_startup_s = self.cpu_s
            if not self._buffer and not self._inflight and not (self._spill is not None and len(self._spill)):
                self._idle.set()
            if len(self._buffer) < self.batch:
                # While disconnected keep waking at the flush interval: the buffer may need spilling.
                self._wake.wait(self.flush_interval)
                self._wake.clear()
                self._slice_end = perf_counter() + SLICE_S  # the GIL was free while this thread waited
        if self._spill is not None:
            self._spill.close()  # only this thread touches the spill: close it here, once stopped

    def _pause(self) -> None:
        """Called between records of the sender's long loops: once :data:`SLICE_S` of work is done, sleep
        :data:`PAUSE_S` so that a thread waiting for the GIL (the training loop) takes it within that time, not
        after the interpreter's 5 ms switch interval."""
        if perf_counter() >= self._slice_end:
            time.sleep(PAUSE_S)
            self._slice_end = perf_counter() + SLICE_S

    def _spill_overflow(self) -> None:
        """Redis is away: move the buffer to disk once it is half full, oldest first, in order, a batch of
        records at a time (what the training loop appends meanwhile waits for the next time)."""
        spill, buf = self._spill, self._buffer
        if spill is None or len(buf) < (buf.maxlen or 0) // 2:
            return
        popleft, prepare, pause = buf.popleft, self._prepare, self._pause
        left = len(buf)  # only this thread takes from the buffer: these many are there to take
        while left:
            n = min(left, self.batch)
            left -= n
            self._moving += n  # before taking them: a flush() must always see them somewhere
            lines: list[str] = []
            for _ in range(n):
                item = prepare(popleft())
                if item is not None:
                    lines.append(_line_of(item))
                pause()
            try:
                spill.append(lines, pause)
            except OSError as exc:
                for _ in range(left):  # the rest of this move goes too, as one loss (one warning)
                    popleft()
                self._spill_failed += len(lines) + left
                self._moving = 0
                log.warning("trainhealth collector: cannot spill to %s (%s); dropping %d records",
                            spill.directory, exc, len(lines) + left)
                return
            self._moving -= n

    def _read_ledger(self, client: redis.Redis) -> None:
        """The run's latest ledger snapshot into :attr:`ledger` and its active incidents into :attr:`incidents` (a
        GET and an HGETALL of the run's slot per heartbeat, only once asked for)."""
        try:
            pipe = client.pipeline(transaction=False)
            pipe.get(self._keys.ledger_latest)
            pipe.hgetall(self._keys.incidents)
            raw, incs = pipe.execute()
            snap = json.loads(raw) if raw else None
            self.ledger = snap if isinstance(snap, dict) else None
            active = []
            for v in (incs or {}).values():
                try:
                    d = json.loads(v)
                except ValueError:
                    continue
                if isinstance(d, dict) and d.get("status") == "active":
                    active.append(d)
            self.incidents = sorted(active, key=lambda d: (str(d.get("severity")) != "critical",
                                                           d.get("onset_step") or 0))
        except (redis.RedisError, ValueError, TypeError):
            pass  # the next heartbeat tries again; a connection error shows on the next batch

    def _on_error(self, exc: BaseException) -> None:
        if self.connected or self._backoff.delay == 0.0:
            log.warning(
                "trainhealth collector: Redis unreachable (%s); buffering up to %d records, retrying",
                exc, self._buffer.maxlen,
            )
        self.connected = False
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        self._next_attempt = time.monotonic() + self._backoff.failed()

    def _cycle(self) -> None:
        if self._client is None:
            self._client = self._connect()
            self._client.ping()
            if not self.connected:
                log.info("trainhealth collector: connected to Redis for run %s", self._keys.run)
            self._register(self._client)
            self.connected = True
        client = self._client
        first = True
        # Oldest first: the batch that failed, then the spill, then the in-memory buffer. The heartbeat and the
        # drop count ride along with whichever batch is sent when they are due, so a backlog that takes
        # minutes to drain never starves them (a live rank must not look dead because it logs fast).
        while True:
            if not self._inflight:
                self._next_batch()
            batch = self._inflight
            now = time.time()
            hb_due = now >= self._next_hb
            drops = self.dropped_total - self._reported_drops  # after taking the batch: encoding may drop some
            by_cause = self.drops_by_cause()
            new_by_cause = {k: v - self._reported_by_cause.get(k, 0) for k, v in by_cause.items()}
            if not batch and not (first and (hb_due or drops > 0)):
                return
            # One MULTI/EXEC per batch: a batch lands whole or not at all, so a retry after a
            # dropped connection does not write part of it twice.
            pipe = client.pipeline(transaction=True)
            self._seq_build = self._seq
            self._add_batch(pipe, batch)
            if drops > 0:
                ev = self._clean("events", {"kind": "collector_drops", "count": drops,
                                            **{k: v for k, v in new_by_cause.items() if v > 0},
                                            **self._registry_event_fields()})
                self._add_batch(pipe, [("events", ev)])  # type: ignore[list-item]
            if hb_due:
                try:
                    self._register(client, pipe)
                    rank, body = self._heartbeat()
                    pipe.hset(self._keys.heartbeats, str(rank), body)
                except Exception:  # a heartbeat that cannot be built must not hold the records back
                    self._log_once("heartbeat", "trainhealth collector: cannot build the heartbeat", exc_info=True)
            if len(pipe):
                pipe.execute()
            if hb_due:
                # Outside the MULTI/EXEC: th:runs is not in the run's slot (Redis Cluster refuses a transaction
                # over two slots); ZADD NX is idempotent, so a failure here only waits for the next heartbeat.
                client.zadd(RUNS, self._registry_entry(), nx=True)
                if self.want_ledger:
                    self._read_ledger(client)
            self.sent += len(batch)
            self._seq = self._seq_build
            if self._inflight_from_spill:
                self._spill.commit(self._inflight_from_spill)  # type: ignore[union-attr]
                self._inflight_from_spill = 0
            self._inflight = []
            if drops > 0:
                self._reported_drops += drops
                self._reported_by_cause = by_cause
                log.warning("trainhealth collector: %d records were dropped (%s); reported as a collector_drops "
                            "event", drops, ", ".join(f"{v} {DROP_CAUSES[k]}" for k, v in new_by_cause.items()
                                                      if v > 0))
            if hb_due:
                self._next_hb = now + self.heartbeat_interval
            if not batch:
                return
            first = False
            self._pause()

    def _next_batch(self) -> None:
        """Take the next batch to send, oldest first: from the spill (already encoded: a step record's line
        holds its JSON, passed on as it is), else from the buffer, encoded now, once (a batch retried after a
        Redis error is not encoded again). Pauses between records (:meth:`_pause`)."""
        spill, buf, pause = self._spill, self._buffer, self._pause
        if self._inflight:
            return
        items: list[Encoded] = []
        if spill is not None and len(spill):
            lines = spill.peek_lines(self.batch, pause)
            self._moving = len(lines)  # peeked: no longer counted in the spill's share of pending
            for line in lines:
                if line.startswith(STEP_LINE_PREFIX):
                    items.append(line[_STEP_LINE_START:-2])  # '["steps",' + JSON + ']\n'
                else:
                    item = self._event_of_line(line)
                    if item is not None:
                        items.append(item)
                pause()
            self._inflight, self._inflight_from_spill = items, len(lines)
            self._moving = 0
            return
        popleft, prepare = buf.popleft, self._prepare
        n = min(self.batch, len(buf))
        self._moving = n  # before taking them: a flush() must always see them somewhere
        for _ in range(n):
            item = prepare(popleft())
            if item is not None:
                items.append(item)
            pause()
        self._inflight, self._inflight_from_spill = items, 0
        self._moving = 0

    def _event_of_line(self, line: str) -> Record | None:
        """A spilled event's line as a Record, or None (dropped and counted) for a line that is not one."""
        try:
            stream, fields = json.loads(line)
            if type(stream) is not str or type(fields) is not dict:
                raise ValueError(f"not a [stream, fields] record: {show(line)}")
        except Exception:
            self._log_once("spill_line", "trainhealth collector: a spilled record cannot be read; dropped "
                           "(further ones counted as dropped)", exc_info=True)
            self._unsendable += 1
            return None
        return stream, fields

    def _prepare(self, item: Item) -> Encoded | None:
        """A buffered record ready to send (see :meth:`_clean`): a step record as its JSON text, an event as
        ``("events", fields)``; None, dropped and counted, for one that cannot be."""
        stream = "steps"
        try:
            if type(item) is dict:
                rec = self._clean(stream, item)
            else:
                stream, fields = item
                rec = self._clean(stream, fields)
        except Exception:  # a value nothing can encode must not jam the sender: drop that record only
            self._log_once("encode", "trainhealth collector: a %s record cannot be encoded; dropped "
                           "(further ones counted as dropped)", stream, exc_info=True)
            rec = None
        if rec is None:
            self._unsendable += 1
            return None
        if stream != "steps":
            return stream, rec
        try:
            return _dumps(rec)
        except Exception:  # a key JSON cannot carry (not a str): the record cannot go on the wire
            self._log_once("salvage", "trainhealth collector: a %s record cannot be sent; dropped "
                           "(further ones counted as dropped)", stream, exc_info=True)
            self._unsendable += 1
            return None

    def _encode(self, records: list[Item]) -> list[Encoded]:
        """``records`` ready to send (see :meth:`_prepare`); one that cannot be is dropped and counted."""
        out: list[Encoded] = []
        for item in records:
            enc = self._prepare(item)
            if enc is not None:
                out.append(enc)
        return out

    def _salvage(self) -> bool:
        """After an unexpected error sending the batch in flight: drop the records in it that cannot be
        sent (counted, logged once) and keep the rest; True when some were dropped (worth a retry now)."""
        good: list[Encoded] = []
        for item in self._inflight:
            if type(item) is not str:  # a step record's JSON text was made once and for all: it goes as it is
                stream, rec = item
                try:
                    json.dumps(rec, separators=(",", ":"))
                    if stream != "steps" and not all(type(k) is str and type(v) in (str, int)
                                                     for k, v in rec.items()):
                        raise TypeError(f"event field values must be str or int: {show(rec)}")
                except Exception:
                    self._log_once("salvage", "trainhealth collector: a %s record cannot be sent; dropped "
                                   "(further ones counted as dropped)", stream, exc_info=True)
                    continue
            good.append(item)
        bad = len(self._inflight) - len(good)
        if not bad:
            return False
        if self._inflight_from_spill:  # gone from the spill: sent from memory, as a batch whose segment was dropped
            self._spill.commit(self._inflight_from_spill)  # type: ignore[union-attr]
            self._inflight_from_spill = 0
        self._inflight = good
        self._unsendable += bad
        return True

    def _add_batch(self, pipe: Any, records: list[Encoded] | list[Item], clean: bool = False) -> None:
        """Queue encoded ``records`` (with ``clean``, raw ones, encoded first) on ``pipe``: each run of
        consecutive step records becomes one entry (``rank``, ``n``, ``recs`` = JSON list), each event
        its own entry, so entry ids keep the order."""
        if clean:
            records = self._encode(records)  # type: ignore[arg-type]
        steps: list[str] = []
        for item in records:
            if type(item) is str:
                steps.append(item)
                continue
            stream, rec = item  # type: ignore[misc]
            if stream == "steps":  # a cleaned step record given as a Record
                steps.append(_dumps(rec))
                continue
            if steps:
                self._xadd_steps(pipe, steps)
                steps = []
            pipe.execute_command("XADD", self._keys.events, "MAXLEN", "~", self._maxlen["events"], "*",
                                 *[x for kv in rec.items() for x in kv])
        if steps:
            self._xadd_steps(pipe, steps)

    def _xadd_steps(self, pipe: Any, steps: list[str]) -> None:
        body = "[" + ",".join(steps) + "]"  # the records' JSON texts: what json.dumps(list) would give
        # A backstop for when no detector service reads the stream; the service trims it to the bound exactly once
        # it has read the entries (detectors/retention.py, RawWindow). The stream is shared by every rank, and an
        # entry holds one record or a backlog of a thousand, so this trim counts each entry as one record of this
        # entry's mean size: it never removes a record the bound keeps (a MAXLEN of the bound over this entry's
        # records would remove the other ranks' small entries by the thousand), and keeps up to k times the bound
        # where entries hold k records. Approximate trimming (whole radix-tree nodes of 100 entries) overshoots by
        # up to a node: exact up to 10 nodes, where that would be 10 % or more.
        maxlen = max(1, min(self._maxlen["steps"], self._max_bytes * len(steps) // len(body)))
        pipe.execute_command("XADD", self._keys.steps, "MAXLEN", "~" if maxlen > 1000 else "=", maxlen, "*",
                             "rank", self._registry["_rank"], "n", len(steps), "seq", self._seq_build, "recs", body)
        self._seq_build += len(steps)

    def drops_by_cause(self) -> dict[str, int]:
        """Records lost so far by cause (the keys of :data:`DROP_CAUSES`); they sum to :attr:`dropped_total`."""
        return {"buffer": self.overflowed,
                "spill": (self._spill.dropped if self._spill is not None else 0) + self._spill_failed,
                "unencodable": self._unsendable}

    @property
    def dropped_total(self) -> int:
        """Records lost so far: buffer overflow, spill bound exceeded, spill write failures, records that
        could not be encoded."""
        return (self.overflowed + (self._spill.dropped if self._spill is not None else 0) + self._spill_failed
                + self._unsendable)

    def _registry_event_fields(self) -> dict[str, Any]:
        return {"rank": self._registry["_rank"], "t": repr(time.time()), "inc": self._registry["_inc"]}

    def _clean(self, stream: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        """A record ready to send: step records keep numbers only (JSON-encoded later), event fields
        become strings/ints. A value the detector service would refuse is left out, with one warning per
        field: in a step record, a value that is not a number, an int field's value that is not a finite
        integer within int64, a float field's value beyond a float (NaN/Inf stay: the NaN detector needs
        them); tensors and numpy scalars become Python numbers. None (with one warning) for a step record
        left without a valid ``step`` or ``t``, which the service would refuse whole."""
        numeric = stream == "steps"
        if numeric and _PLAIN.issuperset(map(type, fields.values())) and _in_range(fields):
            return {k: v for k, v in fields.items() if v is not None}  # the usual case, cheap
        out: dict[str, Any] = {}
        for k, v in fields.items():
            if v is None:
                continue
            if numeric and k == "sample_indices":
                try:
                    out[k] = encode_indices(v, pause=self._pause)
                except ValueError as exc:
                    self._warn_once(k, "log_step(sample_indices=...): %s; not recorded", exc)
                continue
            if numeric:
                e, why = _step_value(k, v)
            else:
                e, why = _event_value(k, v)
            if e is None:
                self._warn_once(k, "field %r %s %s; not recorded", k, why,
                                show(v) if why == _NON_NUMERIC else f"({show(v)})")
                continue
            out[k] = e
        if numeric and ("step" not in out or "t" not in out):
            self._warn_once("record", "a step record without a valid step number or time was dropped (step=%s); "
                            "further ones counted as dropped", show(fields.get("step")))
            return None
        return out

    def _registry_entry(self) -> dict[str, float]:
        """The run's member of ``th:runs`` and its score (the run's start, unix s; now when this rank does not
        know it)."""
        return {self._keys.run: float(self._registry.get("started_at") or time.time())}

    def _register(self, client: redis.Redis, pipe: Any = None) -> None:
        """Put the run's metadata in ``th:{run}:meta`` and, without ``pipe``, the run in the registry ``th:runs``:
        on (re)connect, written over; with ``pipe`` (every heartbeat's transaction, where the caller adds the run to
        the registry after it: another slot on Redis Cluster), only what is missing — a Redis that restarted
        without its data behind a connection redis-py re-opened by itself gets the run back within one heartbeat
        interval, and nothing another writer set (rank 0's final status) is overwritten."""
        meta = {k: v for k, v in self._registry.items() if not k.startswith("_") and v is not None}
        missing_only = pipe is not None
        if pipe is None:
            pipe = client.pipeline(transaction=False)  # not a transaction: its keys may be in two slots
        started = meta.pop("started_at", None)
        if started is not None:
            pipe.hsetnx(self._keys.meta, "started_at", repr(float(started)))
        fields = {k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in meta.items()}
        if missing_only:
            for k, v in fields.items():
                pipe.hsetnx(self._keys.meta, k, v)
            return
        if fields:
            pipe.hset(self._keys.meta, mapping=fields)
        # After the meta: a service that finds the run finds what it needs to build its detectors.
        pipe.zadd(RUNS, self._registry_entry(), nx=True)
        pipe.execute()


def _line_of(item: Encoded) -> str:
    """A record ready to send as its spill line (see :func:`~trainhealth.collectors.spill.record_line`): a step
    record's JSON text wrapped as is, without encoding it again."""
    if type(item) is str:
        return STEP_LINE_PREFIX + item + "]\n"
    return record_line(*item)  # type: ignore[misc]
