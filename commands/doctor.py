"""``trainhealth doctor``: is Redis reachable, is a detector service running, are the alert sinks well.

The alerting lines come from :func:`trainhealth.alerts.health.doctor_report`: a missing alert worker fails the
check only where alerting is configured (an alert worker has run on this Redis), so a deployment without alerting
can gate on ``doctor`` too.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from trainhealth import config
from trainhealth.commands._shared import SERVICE_STALE_S, command, live_services, with_url


def register(sub: Any) -> None:
    """Add ``doctor`` to the ``trainhealth`` sub-parsers."""
    summary = ("Check Redis, the detector service and, where alerting is configured, the alert worker and its "
               "sinks; exit 1 when something is down.")
    o = with_url(command(sub, "doctor", summary), starts=False)
    o.set_defaults(func=run, extra=None)


#: The newest runs whose losses doctor reports.
DATA_RUNS = 50


def data_lines(client: Any, newest: int = DATA_RUNS) -> list[str]:
    """One line per run, among the ``newest`` registered (by start time), whose figures rest on less than every
    record (:func:`trainhealth.coverage.data_lost_text` of its ``ledger:latest`` snapshot); one line saying
    nothing was lost otherwise. Informational: losses do not fail the check (nothing is down)."""
    import json

    from trainhealth.coverage import data_lost_text
    from trainhealth.keys import RUNS, run_keys

    runs = [r.decode() if isinstance(r, bytes) else r for r in client.zrevrange(RUNS, 0, newest - 1)]
    pipe = client.pipeline(transaction=False)
    for run in runs:
        pipe.get(run_keys(run).ledger_latest)
    lines = []
    for run, raw in zip(runs, pipe.execute() if runs else [], strict=True):
        try:
            snap = json.loads(raw) if raw else None
        except ValueError:
            snap = None
        text = data_lost_text(snap) if isinstance(snap, dict) else None
        if text:
            lines.append(f"Data lost: run {run}: {text}")
    if not lines:
        lines.append(f"Data: nothing lost in the {len(runs)} newest run{'s' if len(runs) != 1 else ''}"
                     if runs else "Data: no runs yet")
    return lines


def run(args: argparse.Namespace) -> int:
    """Print one line per component; returns 0 when all are up, else 1."""
    import redis

    from trainhealth.alerts.health import doctor_report
    from trainhealth.keys import RUNS

    url = config.redis_url(args.redis_url)
    if url is None:
        print("Redis: none configured (TRAINHEALTH_REDIS_URL unset, no embedded server running): "
              "`trainhealth serve` or `trainhealth demo` starts the embedded one")
        return 1
    shown = config.redact_url(url)
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        info = client.info("server")
    except redis.RedisError as exc:
        print(f"Redis: {shown} UNREACHABLE ({exc})")
        return 1
    print(f"Redis: {shown} ok (redis {info.get('redis_version')})")
    live = live_services(client)
    for s in live:
        print(f"Detector service: pid {s.get('pid')} on {s.get('host')}, {s.get('runs')} runs, "
              f"heartbeat {time.time() - s.get('t', 0):.0f} s ago")
    if not live:
        print(f"Detector service: NOT RUNNING (no heartbeat in the last {SERVICE_STALE_S:.0f} s): "
              "start `trainhealth serve`")
    print(f"Runs: {client.zcard(RUNS)}")
    print("\n".join(data_lines(client)))
    alert_lines, alerts_ok = doctor_report(client)
    print("\n".join(alert_lines))
    return 0 if live and alerts_ok else 1
