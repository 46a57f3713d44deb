"""The alerting commands: ``trainhealth alerts`` (the worker), ``silence`` and ``deadletters``."""

from __future__ import annotations

import argparse
import getpass
import json
import time
from collections.abc import Callable
from typing import Any

import redis

from trainhealth import alert_store as store
from trainhealth import defaults
from trainhealth.commands._shared import redis_client, with_url
from trainhealth.exceptions import ConfigError
from trainhealth.matchers import MatcherError
from trainhealth.text import parse_duration

_LABEL_FLAGS = ("run", "kind", "severity", "rank", "host")


def register(sub: Any) -> None:
    """Add ``alerts``, ``silence`` and ``deadletters`` to the ``trainhealth`` sub-parsers."""
    summary = ("Run the alert worker: anomaly transitions -> grouped, silenced, inhibited, routed notifications "
               "-> Slack, JSON webhooks, PagerDuty (docs/alerts.md). Stop with SIGTERM or Ctrl-C.")
    a = with_url(sub.add_parser("alerts", help=summary, description=summary), starts=False)
    a.add_argument("--config", required=True, metavar="FILE", help="alerting config (TOML; docs/alerts.example.toml)")
    a.add_argument("--check", action="store_true", help="validate the config, print its summary (no secrets), exit")
    a.add_argument("--consumer", help="consumer name (default: <host>-<pid>)")
    a.add_argument("--catch-up", default=f"{defaults.ALERT_CATCHUP_S:g}s", metavar="DURATION",
                   help="at start, anomaly transitions written longer ago than this are tracked but not notified, "
                        "and runs that are over (status not running, no transition for this long) are not paged "
                        f"(e.g. 10m, 1h; 0 = notify every backlog; default {defaults.ALERT_CATCHUP_S:g}s)")
    a.set_defaults(func=lambda args: run_alerts(args, lambda: redis_client(args)), extra="server")

    summary = "Silence alerts by run, kind, rank, host or severity for a while (Alertmanager-style silences)."
    s = sub.add_parser("silence", help=summary, description=summary)
    ss = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = with_url(ss.add_parser("add", help="add a silence", description="Add a silence; every given label must "
                                 "match."), starts=False)
    for flag in _LABEL_FLAGS:
        add.add_argument(f"--{flag}", help=f"{flag} to silence" + (" (any of the anomaly's ranks)"
                                                                  if flag == "rank" else ""))
    add.add_argument("--matcher", action="append", default=[], metavar="EXPR",
                     help="extra matcher, e.g. 'kind=~\"straggler|hang\"' (repeatable)")
    add.add_argument("--duration", default="2h", help="how long, e.g. 30m, 2h, 1d (default 2h)")
    add.add_argument("--comment", default="", help="why (shown with the silence)")
    add.add_argument("--author", default=None, help="who (default: the login name)")
    lst = with_url(ss.add_parser("list", help="list silences", description="List active and pending silences."),
                   starts=False)
    lst.add_argument("--all", action="store_true", help="include expired silences")
    exp = with_url(ss.add_parser("expire", help="end a silence now", description="End a silence now."),
                   starts=False)
    exp.add_argument("id", help="silence id (from `trainhealth silence list`)")
    s.set_defaults(func=lambda args: run_silence(args, lambda: redis_client(args)), extra=None)

    summary = "Notifications given up after the bounded number of tries (or refused): list them, or resend them."
    d = sub.add_parser("deadletters", help=summary, description=summary)
    ds = d.add_subparsers(dest="action", required=True, metavar="ACTION")
    dl = with_url(ds.add_parser("list", help="list dead letters, newest first"), starts=False)
    dl.add_argument("--limit", type=int, default=50, help="how many (default 50)")
    dl.add_argument("--json", action="store_true", help="print them as JSON lines")
    dr = with_url(ds.add_parser("requeue", help="put dead letters back in the outbox (same idempotency key)"),
                  starts=False)
    dr.add_argument("ids", nargs="*", metavar="ID", help="outbox entry ids (from `deadletters list`)")
    dr.add_argument("--all", action="store_true", help="requeue every dead letter")
    d.set_defaults(func=lambda args: run_deadletters(args, lambda: redis_client(args)), extra=None)


def run_alerts(args: argparse.Namespace, connect: Callable[[], redis.Redis]) -> int:
    """``trainhealth alerts --config FILE [--check]``."""
    from trainhealth.alerts.config import load

    cfg = load(args.config)
    catch_up = parse_duration(args.catch_up)
    if catch_up is None:
        raise ConfigError(f"--catch-up={args.catch_up!r} is not a duration (e.g. 10m, 1h, 0 to turn it off)")
    if args.check:
        print(cfg.describe())
        print(f"  catch-up: transitions older than {catch_up:g} s at start are not notified" if catch_up else
              "  catch-up: off (every transition read is notified, however old)")
        return 0
    from trainhealth.alerts.secrets import protect_logs
    from trainhealth.alerts.worker import AlertWorker

    protect_logs(cfg.secrets())  # webhook URLs and keys never reach a log line, whichever library writes it
    worker = AlertWorker(connect(), cfg, consumer=args.consumer, catch_up=catch_up)
    worker.install_signal_handlers()
    worker.run_forever()
    return 0


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def run_silence(args: argparse.Namespace, connect: Callable[[], redis.Redis]) -> int:
    """``trainhealth silence add|list|expire``."""
    if args.action == "add":
        matchers = [f"{f}={json.dumps(str(getattr(args, f)))}" for f in _LABEL_FLAGS if getattr(args, f) is not None]
        matchers += args.matcher
        if not matchers:
            raise ConfigError("give at least one of --run, --kind, --severity, --rank, --host or --matcher")
        secs = parse_duration(args.duration)
        if not secs:
            raise ConfigError(f"--duration={args.duration!r} is not a positive duration (e.g. 30m, 2h, 1d)")
        author = args.author if args.author is not None else getpass.getuser()
        try:
            s = store.add_silence(connect(), matchers, duration_s=secs, created_by=author, comment=args.comment)
        except MatcherError as exc:
            raise ConfigError(f"silence: {exc}") from None
        print(f"silence {s.id}: {' '.join(map(str, s.matchers))} until {_when(s.ends_at)}")
        return 0
    client = connect()
    if args.action == "list":
        now = time.time()
        rows = store.list_silences(client, now, include_expired=args.all)
        for s in rows:
            state = "active" if s.active(now) else "pending" if s.starts_at > now else "expired"
            print(f"{s.id}  {state:<7}  until {_when(s.ends_at)}  {' '.join(map(str, s.matchers))}  "
                  f"by {s.created_by or '-'}" + (f": {s.comment}" if s.comment else ""))
        if not rows:
            print("no silences")
        return 0
    if not store.expire_silence(client, args.id):
        raise ConfigError(f"silence id={args.id!r} does not exist or is already over")
    print(f"silence {args.id} expired")
    return 0


def run_deadletters(args: argparse.Namespace, connect: Callable[[], redis.Redis]) -> int:
    """``trainhealth deadletters list|requeue``."""
    client = connect()
    if args.action == "list":
        rows = store.dead_letters(client, args.limit)
        for d in rows:
            if args.json:
                print(json.dumps(d))
                continue
            print(f"{d.get('id')}  {_when(float(d.get('dead_at') or 0))}  sink {d.get('sink')}  "
                  f"#{d.get('seq')} of {d.get('group')}  after {d.get('attempts')} tries: {d.get('error')}")
        if not rows and not args.json:
            print("no dead letters")
        return 0
    if not args.ids and not args.all:
        raise ConfigError("give dead letter ids, or --all")
    n = store.requeue_dead(client, None if args.all else args.ids)
    print(f"requeued {n} dead letter{'s' if n != 1 else ''}")
    return 0 if n or args.all else 1
