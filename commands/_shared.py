"""What several commands share: where Redis is, the processes they start, the options of log commands.

Only the command modules import this.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainhealth import defaults
from trainhealth.config import redact_url
from trainhealth.exceptions import ConfigError

if TYPE_CHECKING:
    import redis

    from trainhealth.embedded_redis import EmbeddedRedis

#: A detector service heartbeat older than this (s) counts as a dead service.
SERVICE_STALE_S = 10.0
#: Set in the environment of the processes a command starts (they need not say again where Redis is).
CHILD_ENV = "TRAINHEALTH_CHILD"
#: Streamlit runs the app as a file: wherever the package is installed, ``trainhealth.dashboard``'s app.py.
DASHBOARD_APP = Path(importlib.util.find_spec("trainhealth.dashboard").origin).parent / "app.py"


def with_url(sp: argparse.ArgumentParser, starts: bool = True) -> argparse.ArgumentParser:
    """Add ``--redis-url`` to ``sp`` (``starts``: the command starts the embedded server when none is given)."""
    sp.add_argument("--redis-url", help="redis://, rediss://, unix://, redis+sentinel://host,host/<service> or "
                    "redis+cluster://host,host URL (default: $TRAINHEALTH_REDIS_URL, else the embedded server"
                    + (", started if needed)" if starts else ")"))
    return sp


def command(sub: Any, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand parser whose help and description are ``summary``."""
    return sub.add_parser(name, help=summary, description=summary)


def resolve(args: argparse.Namespace, start: bool = True) -> tuple[str, EmbeddedRedis | None]:
    """The Redis URL of ``args.redis_url`` (else the environment, else the embedded server, started when
    ``start``), said on stdout once (the password hidden); returns ``(url, embedded server or None)``."""
    from trainhealth.embedded_redis import resolve_url

    url, embedded = resolve_url(getattr(args, "redis_url", None), start=start)
    if os.environ.get(CHILD_ENV):
        pass  # a child of `trainhealth demo`, which has said where Redis is
    elif embedded is not None:
        state = "started" if embedded.started else "reusing"
        print(f"Redis: {state} embedded redis-server at {url} (data in {embedded.directory})", flush=True)
    else:
        print(f"Redis: {redact_url(url)}", flush=True)
    return url, embedded


def child_env(url: str) -> dict[str, str]:
    """The environment of a process a command starts: this one's, with the Redis URL set."""
    env = dict(os.environ)
    env[defaults.REDIS_URL_ENV] = url
    env[CHILD_ENV] = "1"
    return env


#: Streamlit options of the dashboard beyond the address: no usage statistics (no calls home), Streamlit's own "You
#: can now view…" lines hidden (the command prints the one address to open, with its ``?run=``), and no full garbage
#: collection after every script run (``runner.postScriptGC``): each page refreshes three or four fragments every
#: 2 s, and a ``gc.collect(2)`` of the server's heap after each took ~70 ms, most of a refresh cycle's server time at
#: 1,024 ranks (BENCHMARKS.md, issue 16). Python's own generational collection still runs.
DASHBOARD_OPTIONS = ("--browser.gatherUsageStats", "false", "--theme.base", "light", "--logger.hideWelcomeMessage",
                     "true", "--runner.postScriptGC", "false")


def dashboard_command(url: str, port: int, headless: bool = True) -> list[str]:
    """The streamlit command line of the dashboard (:data:`DASHBOARD_OPTIONS`) on 127.0.0.1:``port``."""
    return [sys.executable, "-m", "streamlit", "run", str(DASHBOARD_APP), "--server.port", str(port),
            "--server.headless", "true" if headless else "false", "--server.address", "127.0.0.1",
            *DASHBOARD_OPTIONS]


def interrupt_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so the command cleans up either way: SIGTERM's default
    kills at once, and a process started in the background (nohup, ``cmd &`` in a script) inherits SIGINT
    ignored."""
    def _stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)


def ignore_signals() -> None:
    """From here on SIGINT and SIGTERM are ignored: a second Ctrl-C must not interrupt a cleanup."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def check_port(port: int) -> None:
    """Raise :class:`ConfigError` naming ``--port`` unless it is a TCP port free on 127.0.0.1."""
    from trainhealth.embedded_redis import free_port

    if not 1 <= port <= 65535:
        raise ConfigError(f"--port={port} is not a TCP port (1-65535)")
    if free_port(port) != port:
        raise ConfigError(f"--port={port} is already in use on 127.0.0.1: pass another --port")


def live_services(client: redis.Redis) -> list[dict]:
    """Heartbeats of detector services seen in the last :data:`SERVICE_STALE_S` seconds."""
    from trainhealth.keys import SERVICE_HEARTBEAT_PATTERN

    now = time.time()
    beats = [json.loads(client.get(k) or "{}") for k in client.scan_iter(SERVICE_HEARTBEAT_PATTERN)]
    return [b for b in beats if now - float(b.get("t", 0)) < SERVICE_STALE_S]


def other_users(url: str, own_run: str) -> str:
    """Who else uses the embedded server: live detector services or runs with fresh heartbeats ("" if none)."""
    import redis

    from trainhealth.connection import connect
    from trainhealth.keys import RUNS, run_keys

    try:
        client = connect(url, socket_timeout=2)
        if live_services(client):
            return "another detector service uses it"
        # Anyone else connected (a dashboard, a job's collectors, redis-cli): our own client is one.
        me = client.client_id()
        others = [c for c in client.client_list() if int(c["id"]) != me]
        if others:
            return f"{len(others)} other client{'s are' if len(others) != 1 else ' is'} connected"
        now = time.time()
        for raw in client.zrange(RUNS, 0, -1):
            run = raw.decode()
            if run == own_run:
                continue
            for body in client.hvals(run_keys(run).heartbeats):
                if now - float(json.loads(body).get("t", 0)) < SERVICE_STALE_S:
                    return f"run {run!r} is still sending to it"
    except (redis.RedisError, ValueError):
        return ""
    return ""


def release_embedded(embedded: EmbeddedRedis | None, url: str, own_run: str = "") -> None:
    """Stop the embedded redis-server this command started, unless something else still uses it."""
    if embedded is None or not embedded.started:
        return
    others = other_users(url, own_run)
    if others:
        print(f"Left the embedded redis-server running at {url}: {others} (`trainhealth redis stop` stops it).",
              flush=True)
    else:
        embedded.stop()
        print(f"Stopped the embedded redis-server (data kept in {embedded.directory}).", flush=True)


def log_options(sp: argparse.ArgumentParser) -> None:
    """PATH..., ``--format``, ``--map`` and ``--one-run``: the same for replay and analyze."""
    from trainhealth.collectors.importers import FORMATS

    sp.add_argument("paths", nargs="+", metavar="PATH", help="log file(s) (a TensorBoard run directory too)")
    sp.add_argument("--format", choices=FORMATS, help="the log's format (default: detected from name and content)")
    sp.add_argument("--map", action="append", metavar="FIELD=COLUMN",
                    help="map one of our fields (step, loss, grad_norm, lr, tokens, step_seconds, ...) to a "
                         "column or scalar tag of the log; repeatable")
    sp.add_argument("--one-run", action="store_true",
                    help="the PATHs are per-rank logs of one job (e.g. one profiler trace per rank): one "
                         "multi-rank run, not one run per file")


def parse_map(items: list[str] | None) -> dict[str, str | None] | None:
    """``--map FIELD=COLUMN`` options (replay, analyze) as an importer mapping; ``FIELD=`` ignores a field.

    Raises :class:`ConfigError` naming the option that is not ``FIELD=COLUMN``.

    >>> parse_map(["loss=train/loss", "tokens="])
    {'loss': 'train/loss', 'tokens': None}
    """
    if not items:
        return None
    mapping: dict[str, str | None] = {}
    for item in items:
        field, sep, column = item.partition("=")
        if not sep or not field:
            raise ConfigError(f"--map {item!r} is not FIELD=COLUMN (e.g. loss=train/loss)")
        mapping[field] = column or None
    return mapping


def redis_client(args: argparse.Namespace) -> redis.Redis:
    """A client of the Redis the command's ``--redis-url`` names (never starts the embedded one)."""
    from trainhealth.connection import connect

    url, _ = resolve(args, start=False)
    return connect(url)
