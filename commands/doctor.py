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
    o.add_argument("--json", action="store_true",
                   help="one JSON object instead of lines: ok, redis, services, runs, data_lost, alerting")
    o.set_defaults(func=run, extra=None)


#: The newest runs whose losses doctor reports.
DATA_RUNS = 50


def data_lost(client: Any, newest: int = DATA_RUNS) -> list[tuple[str, str]]:
    """``(run, what was lost)`` of each run, among the ``newest`` registered (by start time), whose figures rest on
    less than every record (:func:`trainhealth.coverage.data_lost_text` of its ``ledger:latest`` snapshot).
    Informational: losses do not fail the check (nothing is down)."""
    import json

    from trainhealth.coverage import data_lost_text
    from trainhealth.keys import RUNS, run_keys

    runs = [r.decode() if isinstance(r, bytes) else r for r in client.zrevrange(RUNS, 0, newest - 1)]
    pipe = client.pipeline(transaction=False)
    for run in runs:
        pipe.get(run_keys(run).ledger_latest)
    out = []
    for run, raw in zip(runs, pipe.execute() if runs else [], strict=True):
        try:
            snap = json.loads(raw) if raw else None
        except ValueError:
            snap = None
        text = data_lost_text(snap) if isinstance(snap, dict) else None
        if text:
            out.append((run, text))
    return out


def data_lines(client: Any, newest: int = DATA_RUNS) -> list[str]:
    """One line per run of :func:`data_lost`; one line saying nothing was lost otherwise."""
    from trainhealth.keys import RUNS

    lines = [f"Data lost: run {run}: {text}" for run, text in data_lost(client, newest)]
    if not lines:
        n = min(client.zcard(RUNS), newest)
        lines.append(f"Data: nothing lost in the {n} newest run{'s' if n != 1 else ''}" if n else "Data: no runs yet")
    return lines


def report(url: str | None, now: float | None = None) -> dict[str, Any]:
    """What ``doctor --json`` prints: ``ok`` (everything up), ``redis`` (``url`` with its password hidden, ``ok``,
    ``version`` or ``error``), ``services`` (each live detector service's ``pid``, ``host``, ``runs``,
    ``heartbeat_age_s``), ``runs`` (registered), ``data_lost`` (``run``, ``text``), ``alerting`` (``ok`` and its
    ``lines``, as the text report says them). No secret: the URL is redacted."""
    import redis

    from trainhealth.alerts.health import doctor_report
    from trainhealth.connection import REDIS_DOWN, connect
    from trainhealth.keys import RUNS

    now = time.time() if now is None else now
    if url is None:
        return {"ok": False, "redis": {"url": None, "ok": False, "error": "none configured"}}
    shown = config.redact_url(url)
    try:
        client = connect(url, socket_timeout=2, socket_connect_timeout=2)
        info = client.info("server")
    except (redis.RedisError, *REDIS_DOWN) as exc:
        return {"ok": False, "redis": {"url": shown, "ok": False, "error": config.redact_url(str(exc))}}
    services = [{"pid": s.get("pid"), "host": s.get("host"), "runs": s.get("runs"),
                 "heartbeat_age_s": round(now - float(s.get("t", 0)), 1)} for s in live_services(client)]
    alert_lines, alerts_ok = doctor_report(client)
    return {"ok": bool(services) and alerts_ok,
            "redis": {"url": shown, "ok": True, "version": info.get("redis_version")},
            "services": services, "runs": client.zcard(RUNS),
            "data_lost": [{"run": run, "text": text} for run, text in data_lost(client)],
            "data_lines": data_lines(client),
            "alerting": {"ok": alerts_ok, "lines": alert_lines}}


def run(args: argparse.Namespace) -> int:
    """Print one line per component (or the :func:`report` as JSON); returns 0 when all are up, else 1."""
    import json

    rep = report(config.redis_url(args.redis_url))
    if args.json:
        rep.pop("data_lines", None)
        print(json.dumps(rep, indent=2))
        return 0 if rep["ok"] else 1
    r = rep["redis"]
    if r["url"] is None:
        print("Redis: none configured (TRAINHEALTH_REDIS_URL unset, no embedded server running): "
              "`trainhealth serve` or `trainhealth demo` starts the embedded one")
        return 1
    if not r["ok"]:
        print(f"Redis: {r['url']} UNREACHABLE ({r['error']})")
        return 1
    print(f"Redis: {r['url']} ok (redis {r['version']})")
    for s in rep["services"]:
        print(f"Detector service: pid {s['pid']} on {s['host']}, {s['runs']} runs, "
              f"heartbeat {s['heartbeat_age_s']:.0f} s ago")
    if not rep["services"]:
        print(f"Detector service: NOT RUNNING (no heartbeat in the last {SERVICE_STALE_S:.0f} s): "
              "start `trainhealth serve`")
    print(f"Runs: {rep['runs']}")
    print("\n".join(rep["data_lines"]))
    print("\n".join(rep["alerting"]["lines"]))
    return 0 if rep["ok"] else 1
