"""Reads and writes of the alerting keys for the CLI and the dashboard (plain dicts, no Streamlit, no pandas).

Every function takes a ``redis.Redis`` client (``decode_responses`` on or off) and is bounded in cost:
streams are read newest-first with ``COUNT``, lists with ``LRANGE`` limits, hashes are small.

- silences: :func:`add_silence`, :func:`expire_silence`, :func:`list_silences`, :func:`prune_silences`
- notifications delivered: :func:`recent_notifications`
- dead letters: :func:`dead_letters`, :func:`requeue_dead`
- worker and sinks: :func:`workers`, :func:`sink_states`, :func:`outbox_stats`, :func:`alert_groups`
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from trainhealth.defaults import ALERT_DELIVERY_GROUP as DELIVERY_GROUP
from trainhealth.keys import (
    ALERTS_DEAD,
    ALERTS_GROUPS,
    ALERTS_OUTBOX,
    ALERTS_RETRY,
    ALERTS_SENT,
    ALERTS_SILENCES,
    ALERTS_SINKS,
    ALERTS_WORKER_HEARTBEAT_PATTERN,
)
from trainhealth.matchers import Matcher, MatcherError
from trainhealth.silences import Silence, silence_id

#: Expired silences are deleted this many seconds after they ended (7 days, as Alertmanager's retention).
SILENCE_RETENTION_S = 7 * 86400.0


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# -- silences ---------------------------------------------------------------------------------------------
def add_silence(client: redis.Redis, matchers: Sequence[str | Matcher], *, duration_s: float | None = None,
                ends_at: float | None = None, created_by: str = "", comment: str = "", now: float | None = None,
                starts_at: float | None = None) -> Silence:
    """Store a new silence and return it.

    Parameters
    ----------
    matchers : sequence of str or Matcher
        E.g. ``['run="llama"', 'kind="straggler"', 'rank="5"']`` (at least one).
    duration_s, ends_at : float
        How long (seconds from ``starts_at``) or until when (unix s); give one.
    starts_at : float, optional
        Default ``now``.

    Raises
    ------
    MatcherError
        Bad matcher, no matcher, or an end not after the start.
    """
    now = time.time() if now is None else now
    parsed = tuple(m if isinstance(m, Matcher) else Matcher.parse(m) for m in matchers)
    start = now if starts_at is None else starts_at
    if (duration_s is None) == (ends_at is None):
        raise MatcherError("give either a duration or an end time for the silence")
    end = start + float(duration_s) if duration_s is not None else float(ends_at)  # type: ignore[arg-type]
    s = Silence(id=silence_id(parsed, now, created_by), matchers=parsed, starts_at=start, ends_at=end,
                created_by=created_by, comment=comment, created_at=now)
    client.hset(ALERTS_SILENCES, s.id, json.dumps(s.to_dict()))
    return s


def list_silences(client: redis.Redis, now: float | None = None, include_expired: bool = False) -> list[Silence]:
    """Silences, active and pending first (by end time), expired ones only with ``include_expired``."""
    now = time.time() if now is None else now
    out = []
    for raw in client.hvals(ALERTS_SILENCES):
        try:
            s = Silence.from_dict(json.loads(raw))
        except (KeyError, ValueError, TypeError):
            continue
        if include_expired or s.ends_at > now:
            out.append(s)
    return sorted(out, key=lambda s: (s.ends_at <= now, s.ends_at, s.id))


def expire_silence(client: redis.Redis, sid: str, now: float | None = None) -> bool:
    """End silence ``sid`` now (kept, as expired, for the record). False when unknown or already over."""
    now = time.time() if now is None else now
    raw = client.hget(ALERTS_SILENCES, sid)
    if raw is None:
        return False
    d = json.loads(raw)
    if float(d["ends_at"]) <= now:
        return False
    d["ends_at"] = max(now, float(d["starts_at"]) + 1e-3)
    client.hset(ALERTS_SILENCES, sid, json.dumps(d))
    return True


def prune_silences(client: redis.Redis, now: float | None = None, keep_s: float = SILENCE_RETENTION_S) -> int:
    """Delete silences that ended more than ``keep_s`` seconds ago; returns how many."""
    now = time.time() if now is None else now
    old = [s.id for s in list_silences(client, now, include_expired=True) if s.ends_at < now - keep_s]
    if old:
        client.hdel(ALERTS_SILENCES, *old)
    return len(old)


# -- notifications and dead letters -------------------------------------------------------------------------
_SENT_FLOATS = ("at", "delivered_at")
_SENT_INTS = ("seq", "firing", "resolved", "attempts")


def recent_notifications(client: redis.Redis, limit: int = 100, run: str | None = None) -> list[dict[str, Any]]:
    """Delivered notifications, newest first: ``id``, ``sink``, ``key``, ``group``, ``seq``, ``status``,
    ``reason``, ``title``, ``runs`` (list), ``kinds`` (list), ``firing``, ``resolved``, ``at``,
    ``delivered_at`` (unix s), ``attempts``, ``http_status``. With ``run``, only those concerning it
    (scanning at most 10 x ``limit`` entries)."""
    out: list[dict[str, Any]] = []
    scan = limit * 10 if run else limit
    for eid, raw in client.xrevrange(ALERTS_SENT, count=scan):
        f = {_s(k): _s(v) for k, v in raw.items()}
        d: dict[str, Any] = {k: v for k, v in f.items() if k != "json"}
        d["id"] = _s(eid)
        d["runs"] = [x for x in f.get("runs", "").split(",") if x]
        d["kinds"] = [x for x in f.get("kinds", "").split(",") if x]
        for k in _SENT_FLOATS:
            d[k] = float(f[k]) if f.get(k) else None
        for k in _SENT_INTS:
            d[k] = int(f[k]) if f.get(k, "").isdigit() else None
        d["http_status"] = int(f["http_status"]) if f.get("http_status", "").isdigit() else None
        if run and run not in d["runs"]:
            continue
        out.append(d)
        if len(out) >= limit:
            break
    return out


def notification_json(client: redis.Redis, sent_id: str) -> dict[str, Any] | None:
    """The full notification (``Notification.to_dict``) of one ``recent_notifications`` entry."""
    rows = client.xrange(ALERTS_SENT, sent_id, sent_id)
    if not rows:
        return None
    raw = {_s(k): _s(v) for k, v in rows[0][1].items()}.get("json")
    return json.loads(raw) if raw else None


def dead_letters(client: redis.Redis, limit: int = 100) -> list[dict[str, Any]]:
    """Dead letters, newest first: ``id`` (outbox entry), ``sink``, ``key``, ``group``, ``seq``, ``attempts``,
    ``status`` (last HTTP status or None), ``error``, ``dead_at`` (unix s), ``notification`` (dict)."""
    out = []
    for raw in client.lrange(ALERTS_DEAD, 0, limit - 1):
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out


def requeue_dead(client: redis.Redis, ids: Iterable[str] | None = None, now: float | None = None) -> int:
    """Put dead letters back in the outbox (all of them when ``ids`` is None); returns how many.

    The new outbox entry keeps the idempotency key, so a receiver that did get the first try sees it once.
    """
    now = time.time() if now is None else now
    wanted = None if ids is None else set(ids)
    n = 0
    for raw in client.lrange(ALERTS_DEAD, 0, -1):
        try:
            d = json.loads(raw)
        except ValueError:
            continue
        if wanted is not None and d.get("id") not in wanted:
            continue
        if not d.get("notification") or not d.get("sink"):
            continue
        fields = {"sink": d["sink"], "key": d.get("key", ""), "group": d.get("group", ""), "seq": str(d.get("seq", "")),
                  "created": repr(now), "json": json.dumps(d["notification"], separators=(",", ":")),
                  "requeued_from": str(d.get("id", ""))}
        pipe = client.pipeline(transaction=True)
        pipe.lrem(ALERTS_DEAD, 1, raw)
        pipe.xadd(ALERTS_OUTBOX, fields)
        removed, _ = pipe.execute()
        n += int(removed > 0)
    return n


# -- worker, sinks, groups ----------------------------------------------------------------------------------
def workers(client: redis.Redis) -> list[dict[str, Any]]:
    """Heartbeats of alert workers whose key has not expired (TTL 30 s), leader first."""
    out = []
    for key in client.scan_iter(ALERTS_WORKER_HEARTBEAT_PATTERN, count=100):
        raw = client.get(key)
        if raw:
            try:
                d = json.loads(raw)
            except ValueError:
                continue
            d["consumer"] = _s(key).rsplit(":", 1)[1]
            out.append(d)
    return sorted(out, key=lambda d: (d.get("role") != "leader", d["consumer"]))


def sink_states(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """Sink name -> state (``last_ok_at``, ``last_error``, ``consecutive_failures``, ``paused_until``, counters)."""
    out = {}
    for k, v in client.hgetall(ALERTS_SINKS).items():
        try:
            out[_s(k)] = json.loads(v)
        except ValueError:
            continue
    return dict(sorted(out.items()))


def _unread(client: redis.Redis, cap: int = 10_000) -> int:
    """Outbox entries the delivery group has not read yet (all of them before a worker ever ran; capped)."""
    try:
        groups = client.xinfo_groups(ALERTS_OUTBOX)
    except redis.ResponseError:  # no outbox stream yet
        return 0
    last = next((_s(g["last-delivered-id"]) for g in groups if _s(g["name"]) == DELIVERY_GROUP), None)
    if last is None:
        return min(int(client.xlen(ALERTS_OUTBOX)), cap)
    return len(client.xrange(ALERTS_OUTBOX, f"({last}", "+", count=cap))


def outbox_stats(client: redis.Redis) -> dict[str, int]:
    """``pending`` (notifications not delivered yet: unread by the worker, or waiting for their next try),
    ``dead`` (dead letters), ``groups`` (alert groups), ``sent`` (delivery log length), ``silences``."""
    pipe = client.pipeline(transaction=False)
    pipe.zcard(ALERTS_RETRY)
    pipe.llen(ALERTS_DEAD)
    pipe.hlen(ALERTS_GROUPS)
    pipe.xlen(ALERTS_SENT)
    pipe.hlen(ALERTS_SILENCES)
    scheduled, dead, groups, sent, silences = pipe.execute()
    return {"pending": int(scheduled) + _unread(client), "dead": int(dead), "groups": int(groups), "sent": int(sent),
            "silences": int(silences)}


def alert_groups(client: redis.Redis) -> list[dict[str, Any]]:
    """The grouping engine's groups: ``key``, ``route``, ``labels``, ``alerts`` (count), ``firing``,
    ``next_flush``, ``last_notified_at`` (unix s) and ``seq``, by next flush."""
    out = []
    for k, raw in client.hgetall(ALERTS_GROUPS).items():
        try:
            g = json.loads(raw)
        except ValueError:
            continue
        alerts = g.get("alerts", [])
        out.append({"key": _s(k), "route": g.get("route"), "labels": g.get("labels", {}), "alerts": len(alerts),
                    "firing": sum(1 for a in alerts if a.get("status") == "firing"),
                    "next_flush": g.get("next_flush"), "last_notified_at": g.get("last_notified_at"),
                    "seq": g.get("seq", 0)})
    return sorted(out, key=lambda g: (g["next_flush"] or 0, g["key"]))
