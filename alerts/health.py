"""``trainhealth doctor``'s alerting section: the alert worker's heartbeat and the sinks' states.

:func:`doctor_report` returns printable lines and whether alerting is healthy.

Alerting is *configured* on a Redis once an alert worker has run there: a live worker heartbeat, or what only a
worker (or a dead letter it made) leaves behind and keeps: ``th:{alerts}:state`` (written by every worker at
start, with the config path it read), sink states, alert groups, outbox entries, the delivery log, dead
letters. Silences are no sign of it: the dashboard and ``trainhealth silence`` store them on any Redis. There is
no default config file to look for: the worker reads only ``--config FILE``. Alerting that is not configured is
reported as such and is no failure (alerting is optional).

Configured alerting is *unhealthy* when no worker heartbeat is live, a worker reports loop errors, a sink's last
try failed, or dead letters exist.
"""

from __future__ import annotations

import time

import redis

from trainhealth import alert_store as store
from trainhealth.keys import ALERTS_STATE
from trainhealth.text import fmt_duration

#: A sink with this many failures in a row counts as failing.
FAILING_AFTER = 1


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _age(now: float, t: float | None) -> str:
    return "never" if t is None else f"{fmt_duration(now - float(t))} ago"


def doctor_report(client: redis.Redis, now: float | None = None) -> tuple[list[str], bool]:
    """Lines describing the alert worker(s), the sinks and the outbox, and True when all is well.

    Never prints secrets: sink states hold names, types, times, HTTP statuses and redacted errors only.
    """
    now = time.time() if now is None else now
    lines: list[str] = []
    ok = True
    beats = store.workers(client)
    sinks = store.sink_states(client)
    stats = store.outbox_stats(client)
    fields = ("epoch", "config", "started_at")
    state = {k: _s(v) for k, v in zip(fields, client.hmget(ALERTS_STATE, list(fields)), strict=True) if v is not None}
    in_use = bool(beats or state or sinks or any(v for k, v in stats.items() if k != "silences"))
    if not in_use:
        return ["Alert worker: not configured (no heartbeat, no alert state): `trainhealth alerts --config FILE`"], True
    leaders = [b for b in beats if b.get("role") == "leader"]
    for b in beats:
        errs = "; ".join(f"{k}: {v}" for k, v in (b.get("errors") or {}).items())
        lines.append(f"Alert worker: {b.get('role')} pid {b.get('pid')} on {b.get('host')}, heartbeat "
                     f"{_age(now, b.get('t'))}, {b.get('groups', 0)} groups, {b.get('delivered', 0)} delivered"
                     + (", DETECTOR SERVICE DOWN alert raised" if b.get("service_down") else "")
                     + (f", errors: {errs}" if errs else ""))
        if errs:
            ok = False
    if not leaders:
        ok = False
        last = ""
        if "started_at" in state:
            last = f"; the last one started {_age(now, float(state['started_at']))}"
            if state.get("config"):
                last += f" with --config {state['config']}"
        lines.append(f"Alert worker: NOT RUNNING (no live heartbeat{last}): notifications are not being sent; "
                     "start `trainhealth alerts --config FILE`")
    for name, st in sinks.items():
        fails = int(st.get("consecutive_failures") or 0)
        paused = float(st.get("paused_until") or 0)
        state = "ok" if fails < FAILING_AFTER else f"FAILING ({fails} in a row: {st.get('last_error', '')})"
        if not leaders:  # nothing is sending: the state is history, not health
            state = f"{state} when a worker last sent"
        if fails >= FAILING_AFTER:
            ok = False
        extra = f", rate-limited for {paused - now:.0f} s more" if paused > now else ""
        lines.append(f"Sink {name} ({st.get('type') or '?'}): {state}; last success {_age(now, st.get('last_ok_at'))}"
                     f", {st.get('delivered', 0)} delivered, {st.get('dead', 0)} dead{extra}")
    lines.append(f"Outbox: {stats['pending']} pending, {stats['dead']} dead letters, {stats['groups']} alert groups")
    if stats["dead"]:
        ok = False
        lines.append("Dead letters: inspect with `trainhealth deadletters list`, resend with "
                     "`trainhealth deadletters requeue --all`")
    return lines, ok
