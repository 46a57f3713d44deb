"""``trainhealth redis start|stop|url``: the embedded redis-server (data in ``~/.trainhealth/redis``)."""

from __future__ import annotations

import argparse
from typing import Any

from trainhealth.commands._shared import command


def register(sub: Any) -> None:
    """Add ``redis`` to the ``trainhealth`` sub-parsers."""
    e = command(sub, "redis",
                "Manage the embedded redis-server (data in ~/.trainhealth/redis, or $TRAINHEALTH_HOME/redis).")
    e.add_argument("action", choices=["start", "stop", "url"], help="start it, stop it, or print its URL")
    e.set_defaults(func=run, extra=None)


def run(args: argparse.Namespace) -> int:
    """Start (prints the URL), stop, or print the URL (exit 1 when it is not running)."""
    from trainhealth.embedded_redis import EmbeddedRedis

    emb = EmbeddedRedis.default()
    if args.action == "start":
        print(emb.ensure_running())
    elif args.action == "stop":
        print("stopped" if emb.stop() else f"not running (nothing to stop in {emb.directory})")
    else:
        url = emb.running_url()
        print(url or "not running")
        return 0 if url else 1
    return 0
