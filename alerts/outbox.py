"""The outbox: notifications waiting for delivery, and the delivery loop that loses nothing.

The intake writes one entry per (notification, sink) to the stream ``th:{alerts}:outbox`` in the same
``MULTI/EXEC`` as the grouping state that produced it (:func:`enqueue`). The :class:`Deliverer` reads it
with the consumer group ``th-alerts-delivery``:

- every entry read is scheduled in the sorted set ``th:{alerts}:retry`` (score: unix s of the next try)
  with its bookkeeping in the hash ``th:{alerts}:attempts``; it stays in the group's pending list until done;
  a try is counted there before its request goes out, so tries cut short by a crash count too;
- a due entry is sent (:meth:`~trainhealth.alerts.sinks.base.Sink.send`); success acknowledges it, removes
  its schedule and logs it in ``th:{alerts}:sent``, in one ``MULTI/EXEC``;
- a retryable failure (timeout, connection error, 408/425/429/5xx) schedules the next try after
  :func:`backoff_delay` (exponential, capped, with jitter) or after the server's ``Retry-After`` (capped
  at ``retry_after_max``); a 429 also pauses the whole sink for that long (Slack rate-limits per webhook);
- after ``max_attempts`` tries, or at once for a non-retryable answer (400, 403, 404, 410...), the entry
  moves to the dead-letter list ``th:{alerts}:dead`` (acknowledged, JSON with the last error), from where
  ``trainhealth deadletters requeue`` or the dashboard puts it back.

**At-least-once with an idempotency key.** If the worker dies after the receiver got a request but
before the acknowledgement, the entry is still pending and scheduled: the next worker (which claims every
pending entry on start, :meth:`Deliverer.setup`) sends it again with the same ``Idempotency-Key`` and the
same body, so a receiver that remembers keys shows it once; that resend is try 2 (or later) in the log,
in ``th:{alerts}:sent`` and against ``max_attempts``. Nothing is lost: an entry leaves the pending
list only in the transaction that records its delivery or its dead letter.

**Order within a group.** Deliveries of one (sink, group) pair go out in sequence order: a later
notification waits while an earlier one of the same group and sink is pending (a "resolved" never
overtakes its "firing" at PagerDuty).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import redis

from trainhealth import defaults
from trainhealth.alerts.config import DeliveryConfig
from trainhealth.alerts.notification import Notification
from trainhealth.alerts.sinks.base import SendResult, Sink
from trainhealth.alerts.text import title
from trainhealth.keys import (
    ALERTS_ATTEMPTS,
    ALERTS_DEAD,
    ALERTS_OUTBOX,
    ALERTS_RETRY,
    ALERTS_SENT,
    ALERTS_SINKS,
)

log = logging.getLogger(__name__)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _sid(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def claim_all(client: redis.Redis, stream: str, group: str, consumer: str) -> list[tuple[str, dict | None]]:
    """Take over every pending entry of ``group`` on ``stream`` (``XAUTOCLAIM`` with min-idle 0, paged).

    Returns ``(entry id, fields)`` in id order; fields are None for an entry trimmed from the stream.
    """
    out: list[tuple[str, dict | None]] = []
    start = "0-0"
    while True:
        reply = client.xautoclaim(stream, group, consumer, 0, start_id=start, count=1000)
        out += [(_s(item[0]), item[1] or None) for item in reply[1] if item and item[0] is not None]
        start = _s(reply[0])
        if start == "0-0":
            break
    return sorted(out, key=lambda x: _sid(x[0]))


def backoff_delay(attempt: int, base: float, cap: float, jitter: float, u: float) -> float:
    """Seconds to wait after the ``attempt``-th failed try (1, 2, ...): exponential, capped, with jitter.

    ``d = min(cap, base * 2 ** (attempt - 1))``, returned as ``d * (1 - jitter * u)`` with ``u`` uniform in
    [0, 1): ``jitter = 1`` is "full jitter", ``0.5`` (the default) keeps the delay in ``(d/2, d]`` (AWS
    Architecture Blog, "Exponential Backoff And Jitter", 2015).

    >>> [backoff_delay(n, 1.0, 300.0, 0.5, 0.0) for n in (1, 2, 3, 10)]
    [1.0, 2.0, 4.0, 300.0]
    >>> backoff_delay(3, 1.0, 300.0, 0.5, 0.5)
    3.0
    """
    d = min(cap, base * 2.0 ** max(0, attempt - 1))
    return d * (1.0 - jitter * u)


def outbox_fields(n: Notification, sink: str, now: float) -> dict[str, str]:
    """The stream fields of one outbox entry: ``sink``, ``key``, ``group``, ``seq``, ``created``, ``json``."""
    return {"sink": sink, "key": n.idempotency_key(sink), "group": n.group_key, "seq": str(n.seq),
            "created": repr(now), "json": json.dumps(n.to_dict(), separators=(",", ":"))}


def enqueue(pipe: Any, n: Notification, sinks: Mapping[str, Sink], now: float) -> int:
    """Add the outbox entries of ``n`` (one per receiver that wants it) to ``pipe``; returns how many.

    A receiver with ``send_resolved = false`` gets the notification without its resolved alerts, and
    nothing when only resolved alerts are left.
    """
    added = 0
    for name in n.receivers:
        sink = sinks.get(name)
        view = sink.visible(n) if sink is not None else n
        if view is None:
            continue
        pipe.xadd(ALERTS_OUTBOX, outbox_fields(view, name, now), maxlen=defaults.ALERT_OUTBOX_RETENTION_ENTRIES,
                  approximate=True)
        added += 1
    return added


@dataclass
class SinkState:
    """What the worker knows about one sink (stored as JSON in ``th:{alerts}:sinks``, read by doctor)."""

    type: str = ""
    last_attempt_at: float | None = None
    last_ok_at: float | None = None
    last_error_at: float | None = None
    last_error: str = ""
    last_status: int | None = None
    consecutive_failures: int = 0
    paused_until: float = 0.0
    delivered: int = 0
    failed_attempts: int = 0
    dead: int = 0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: Any) -> SinkState:
        try:
            d = json.loads(raw)
        except (TypeError, ValueError):
            return cls()
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


class Deliverer:
    """Delivers outbox entries through the sinks (see the module doc).

    Parameters
    ----------
    client : redis.Redis
    sinks : mapping of name to Sink
    delivery : DeliveryConfig
        Tries, backoff (seconds), jitter, ``Retry-After`` cap.
    consumer : str
        Consumer name in ``th-alerts-delivery``.
    clock : callable
        Unix time (tests pass a fake).
    rand : callable
        Uniform [0, 1) source for the jitter (tests pass a constant).
    http : httpx.Client, optional
        Reused for every request (connection pooling); one is created when omitted.
    batch : int
        Entries read and tried per :meth:`run_once`.
    """

    def __init__(self, client: redis.Redis, sinks: Mapping[str, Sink], delivery: DeliveryConfig, *, consumer: str,
                 clock: Callable[[], float] = time.time, rand: Callable[[], float] = random.random,
                 http: httpx.Client | None = None, group: str = defaults.ALERT_DELIVERY_GROUP,
                 batch: int = 100) -> None:
        self.client = client
        self.sinks = dict(sinks)
        self.cfg = delivery
        self.consumer = consumer
        self.clock = clock
        self.rand = rand
        self.http = http or httpx.Client(follow_redirects=False)
        self.group = group
        self.batch = batch
        self.ready = False
        #: (sink, group key) -> pending entry ids in stream order: deliveries of a lane go out in order.
        self.lanes: dict[tuple[str, str], list[str]] = {}
        self.states: dict[str, SinkState] = {}
        self.sent = 0
        self.last_ok: float | None = None
        #: Unix time the loop last made progress (an iteration or an attempt finished), for the heartbeat.
        self.last_loop_ok: float | None = None
        #: Entries read plus tries made by the last :meth:`run_once` (0: it found nothing to do).
        self.last_work = 0

    # -- setup --------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Create the consumer group, take over every pending entry, and rebuild schedules and lanes."""
        try:
            self.client.xgroup_create(ALERTS_OUTBOX, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        pending = [eid for eid, _ in claim_all(self.client, ALERTS_OUTBOX, self.group, self.consumer)]
        self.lanes.clear()
        raw_states = self.client.hgetall(ALERTS_SINKS)
        self.states = {_s(k): SinkState.from_json(v) for k, v in raw_states.items()}
        now = self.clock()
        if pending:
            infos = self.client.hmget(ALERTS_ATTEMPTS, pending)
            scores = [self.client.zscore(ALERTS_RETRY, i) for i in pending]
            pipe = self.client.pipeline(transaction=False)
            for eid, info, score in sorted(zip(pending, infos, scores, strict=True), key=lambda x: _sid(x[0])):
                if info is None:  # read but never scheduled (a crash right after reading): look it up
                    entry = self.client.xrange(ALERTS_OUTBOX, eid, eid)
                    fields = {_s(k): _s(v) for k, v in entry[0][1].items()} if entry else {}
                    book = {"sink": fields.get("sink", ""), "group": fields.get("group", ""), "attempts": 0}
                    pipe.hset(ALERTS_ATTEMPTS, eid, json.dumps(book))
                else:
                    book = json.loads(info)
                if score is None:
                    pipe.zadd(ALERTS_RETRY, {eid: now})
                self.lanes.setdefault((book["sink"], book["group"]), []).append(eid)
            pipe.execute()
            log.info("delivery: took over %d pending outbox entries", len(pending))
        self.ready = True

    # -- the loop -------------------------------------------------------------------------------------------
    def run_once(self, block_ms: int = 0) -> int:
        """Read new outbox entries (blocking up to ``block_ms`` when nothing is due), try the due ones.

        Returns the number of delivery attempts made.
        """
        if not self.ready:
            self.setup()
        now = self.clock()
        head = self.client.zrange(ALERTS_RETRY, 0, 0, withscores=True)
        if head:
            block_ms = max(0, min(block_ms, int((head[0][1] - now) * 1000)))
        read = self._read_new(block_ms)
        tried = 0
        for _ in range(10):  # again while deliveries free the next entry of their lane
            due = self.client.zrangebyscore(ALERTS_RETRY, "-inf", self.clock(), start=0, num=self.batch)
            progress = 0
            for raw in due:
                progress += self._attempt(_s(raw))
                self.last_loop_ok = self.clock()
            tried += progress
            if not progress or tried >= self.batch:
                break
        self.last_loop_ok = self.clock()
        self.last_work = read + tried
        return tried

    def _read_new(self, block_ms: int) -> int:
        reply = self.client.xreadgroup(self.group, self.consumer, {ALERTS_OUTBOX: ">"}, count=self.batch,
                                       block=block_ms or None)
        now = self.clock()
        pipe = self.client.pipeline(transaction=False)
        n = 0
        for _, entries in reply or []:
            for eid_raw, raw_fields in entries:
                eid = _s(eid_raw)
                fields = {_s(k): _s(v) for k, v in raw_fields.items()}
                book = {"sink": fields.get("sink", ""), "group": fields.get("group", ""), "attempts": 0}
                pipe.hset(ALERTS_ATTEMPTS, eid, json.dumps(book))
                pipe.zadd(ALERTS_RETRY, {eid: now})
                self.lanes.setdefault((book["sink"], book["group"]), []).append(eid)
                n += 1
        if n:
            pipe.execute()
        return n

    def _state(self, sink: Sink | None, name: str) -> SinkState:
        st = self.states.setdefault(name, SinkState())
        if sink is not None:
            st.type = sink.type
        return st

    def _attempt(self, eid: str) -> int:
        info = self.client.hget(ALERTS_ATTEMPTS, eid)
        book = json.loads(info) if info else {"sink": "", "group": "", "attempts": 0}
        entry = self.client.xrange(ALERTS_OUTBOX, eid, eid)
        if not entry:
            self._dead(eid, book, {}, None, "the outbox entry was trimmed before delivery")
            return 0
        fields = {_s(k): _s(v) for k, v in entry[0][1].items()}
        name = fields.get("sink", "")
        sink = self.sinks.get(name)
        if sink is None:
            self._dead(eid, book, fields, None, f"no sink named {name!r} in the config (renamed or removed?)")
            return 0
        lane = self.lanes.setdefault((name, fields.get("group", "")), [])
        if eid not in lane:
            lane.append(eid)
            lane.sort(key=_sid)
        now = self.clock()
        if lane[0] != eid:  # an earlier notification of this group to this sink is still pending: after it
            head_at = self.client.zscore(ALERTS_RETRY, lane[0])
            if head_at is None:  # never leave a lane's head unscheduled
                self.client.zadd(ALERTS_RETRY, {lane[0]: now})
            self.client.zadd(ALERTS_RETRY, {eid: max(now, head_at or now) + 0.001})
            return 0
        st = self._state(sink, name)
        if st.paused_until > now:  # rate-limited sink (429): wait for its Retry-After
            self.client.zadd(ALERTS_RETRY, {eid: st.paused_until})
            return 0
        try:
            n = Notification.from_dict(json.loads(fields["json"]))
        except (KeyError, ValueError, TypeError) as exc:
            self._dead(eid, book, fields, None, f"malformed outbox entry: {type(exc).__name__}: {exc}")
            return 0
        key = fields.get("key") or n.idempotency_key(name)
        try:
            req = sink.request(n, key, now)
        except Exception as exc:  # a notification the sink cannot render would block its lane forever
            log.exception("sink %s: cannot render notification %s of %s", name, n.seq, n.group_key)
            self._dead(eid, book, fields, None, f"cannot render for this sink: {type(exc).__name__}: {exc}")
            return 0
        # The try is counted before it is made: a worker killed during the request leaves it counted, so the
        # next worker's resend of the pending entry is logged, recorded and bounded as try 2, not try 1 again.
        attempts = int(book.get("attempts", 0)) + 1
        book["attempts"] = attempts
        self.client.hset(ALERTS_ATTEMPTS, eid, json.dumps(book))
        result = sink.send(self.http, req, now)
        now = self.clock()
        st.last_attempt_at, st.last_status = now, result.status
        if result.ok:
            self._done(eid, book, fields, n, result, now)
        elif result.retryable and attempts < self.cfg.max_attempts:
            self._retry(eid, book, sink, result, now)
        else:
            why = result.error if not result.retryable else f"gave up after {attempts} tries: {result.error}"
            self._dead(eid, book, fields, result.status, why)
        return 1

    # -- outcomes -------------------------------------------------------------------------------------------
    def _release(self, eid: str, fields: Mapping[str, str], book: Mapping[str, Any]) -> None:
        lane_key = (fields.get("sink", book.get("sink", "")), fields.get("group", book.get("group", "")))
        lane = self.lanes.get(lane_key)
        if lane and eid in lane:
            lane.remove(eid)
            if not lane:
                del self.lanes[lane_key]
            else:  # the next notification of the group goes now (it waited behind this one)
                now = self.clock()
                nxt = self.client.zscore(ALERTS_RETRY, lane[0])
                if nxt is None or nxt > now:
                    self.client.zadd(ALERTS_RETRY, {lane[0]: now})

    def _done(self, eid: str, book: dict[str, Any], fields: Mapping[str, str], n: Notification,
              result: SendResult, now: float) -> None:
        name = fields["sink"]
        st = self._state(self.sinks.get(name), name)
        st.last_ok_at, st.consecutive_failures, st.delivered = now, 0, st.delivered + 1
        runs = sorted({a.run for a in n.alerts})
        kinds = sorted({a.labels["kind"] for a in n.alerts})
        sent = {"sink": name, "key": fields.get("key", ""), "group": n.group_key, "seq": str(n.seq),
                "status": n.status, "reason": n.reason, "title": title(n, emoji=False), "runs": ",".join(runs),
                "kinds": ",".join(kinds), "firing": str(len(n.firing)), "resolved": str(len(n.resolved)),
                "at": repr(n.at), "delivered_at": repr(now), "attempts": str(book["attempts"]),
                "http_status": str(result.status), "json": fields.get("json", "")}
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(ALERTS_OUTBOX, self.group, eid)
        pipe.zrem(ALERTS_RETRY, eid)
        pipe.hdel(ALERTS_ATTEMPTS, eid)
        pipe.xadd(ALERTS_SENT, sent, maxlen=defaults.ALERT_SENT_RETENTION_ENTRIES, approximate=True)
        pipe.hset(ALERTS_SINKS, name, st.to_json())
        pipe.execute()
        self._release(eid, fields, book)
        self.sent += 1
        self.last_ok = now
        log.info("delivered notification #%s of %s to sink %s (try %d)", n.seq, n.group_key, name, book["attempts"])

    def _retry(self, eid: str, book: dict[str, Any], sink: Sink, result: SendResult, now: float) -> None:
        attempts = book["attempts"]
        if result.retry_after is not None:
            delay = min(max(0.0, result.retry_after), self.cfg.retry_after_max)
        else:
            delay = backoff_delay(attempts, self.cfg.backoff_base, self.cfg.backoff_max, self.cfg.jitter, self.rand())
        st = self._state(sink, sink.name)
        st.last_error_at, st.last_error = now, result.error
        st.consecutive_failures += 1
        st.failed_attempts += 1
        if result.status == 429:
            st.paused_until = max(st.paused_until, now + delay)
        book.update(last_error=result.error, last_status=result.status, next_at=now + delay)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(ALERTS_ATTEMPTS, eid, json.dumps(book))
        pipe.zadd(ALERTS_RETRY, {eid: now + delay})
        pipe.hset(ALERTS_SINKS, sink.name, st.to_json())
        pipe.execute()
        log.warning("sink %s: try %d of %d failed (%s); next in %.1f s", sink.name, attempts, self.cfg.max_attempts,
                    result.error, delay)

    def _dead(self, eid: str, book: dict[str, Any], fields: Mapping[str, str], status: int | None,
              error: str) -> None:
        now = self.clock()
        name = fields.get("sink", book.get("sink", ""))
        sink = self.sinks.get(name)
        st = self._state(sink, name)
        st.dead += 1
        st.last_error_at, st.last_error = now, error
        if status is not None or sink is not None:
            st.consecutive_failures += 1
        try:
            notification = json.loads(fields["json"]) if fields.get("json") else None
        except ValueError:
            notification = None
        letter = {"id": eid, "sink": name, "key": fields.get("key", ""), "group": fields.get("group", ""),
                  "seq": fields.get("seq", ""), "created": fields.get("created", ""),
                  "attempts": int(book.get("attempts", 0)), "status": status, "error": error, "dead_at": now,
                  "notification": notification}
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(ALERTS_OUTBOX, self.group, eid)
        pipe.zrem(ALERTS_RETRY, eid)
        pipe.hdel(ALERTS_ATTEMPTS, eid)
        pipe.lpush(ALERTS_DEAD, json.dumps(letter))
        pipe.ltrim(ALERTS_DEAD, 0, defaults.ALERT_DEAD_RETENTION_ENTRIES - 1)
        if name:
            pipe.hset(ALERTS_SINKS, name, st.to_json())
        pipe.execute()
        self._release(eid, fields, book)
        log.error("sink %s: notification %s of %s moved to the dead-letter list: %s", name or "?",
                  fields.get("seq", "?"), fields.get("group", "?"), error)

    # -- status ---------------------------------------------------------------------------------------------
    def pending(self) -> int:
        """Outbox entries scheduled and not yet delivered or dead."""
        return int(self.client.zcard(ALERTS_RETRY))

    def close(self) -> None:
        self.http.close()
