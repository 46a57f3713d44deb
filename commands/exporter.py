"""``trainhealth exporter``: the Prometheus exporter on its own; :func:`start_metrics` also serves it inside
``trainhealth serve --metrics-port``.

The metrics (docs/metrics.md) are read from Redis at each scrape (``detectors/exporter.py``), so the exporter
needs no detector service of its own: run it beside Prometheus, or let the service serve it.
"""

from __future__ import annotations

import argparse
import threading
from typing import TYPE_CHECKING, Any

from trainhealth import defaults
from trainhealth.commands._shared import command, interrupt_on_signals, resolve, with_url
from trainhealth.exceptions import ConfigError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    import redis

#: The default listening address: this machine only (``--host 0.0.0.0`` lets a Prometheus elsewhere scrape).
DEFAULT_HOST = "127.0.0.1"


def add_exporter_options(sp: argparse.ArgumentParser, prefix: str = "") -> None:
    """Add the exporter's ``--slowest-ranks`` and ``--keep-ended`` (``--metrics-…`` with ``prefix="metrics-"``)."""
    sp.add_argument(f"--{prefix}slowest-ranks", type=int, default=defaults.EXPORTER_SLOWEST_RANKS, metavar="K",
                    help="per run, export the straggler score of the newest step's K slowest ranks "
                         f"(0-100, default {defaults.EXPORTER_SLOWEST_RANKS}; 0: none)")
    sp.add_argument(f"--{prefix}keep-ended", type=float, default=defaults.EXPORTER_ENDED_KEEP_S, metavar="S",
                    help="keep exporting an ended run for S seconds after it ended "
                         f"(default {defaults.EXPORTER_ENDED_KEEP_S:.0f})")


def register(sub: Any) -> None:
    """Add ``exporter`` to the ``trainhealth`` sub-parsers."""
    e = with_url(command(sub, "exporter", "Serve every run's goodput, badput, incidents and detector lag as "
                                          "Prometheus metrics (/metrics), read from Redis at each scrape."),
                 starts=False)
    e.add_argument("--port", type=int, default=defaults.EXPORTER_PORT,
                   help=f"TCP port (default {defaults.EXPORTER_PORT})")
    e.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only; 0.0.0.0 lets a "
                        "Prometheus on another machine scrape it)")
    add_exporter_options(e)
    e.set_defaults(func=run, extra="server")


def start_metrics(client: redis.Redis, host: str, port: int, slowest_ranks: int, keep_ended: float,
                  flag: str = "--port") -> tuple[WSGIServer, threading.Thread]:
    """Serve the exporter's metrics (and this process's ``process_*`` and ``python_info``) on ``host:port``
    from a daemon thread; returns prometheus_client's ``(server, thread)`` (``server.shutdown()`` stops it).

    Raises :class:`ConfigError` naming ``flag`` for a port outside 0-65535 (0: one the OS picks), a bad
    ``--…slowest-ranks`` or ``--…keep-ended``, or an address it cannot listen on (in use, not this machine's).
    """
    from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, start_http_server

    from trainhealth.detectors.exporter import ExporterCollector

    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag}={port} is not a TCP port (1-65535, or 0 for one the OS picks)")
    prefix = "--metrics-" if flag.startswith("--metrics") else "--"
    try:
        collector = ExporterCollector(client, slowest_ranks=slowest_ranks, ended_keep_s=keep_ended)
    except ValueError as exc:
        name = "slowest-ranks" if "slowest_ranks" in str(exc) else "keep-ended"
        raise ConfigError(f"{prefix}{name}: {exc}") from None
    registry = CollectorRegistry()
    registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    try:
        return start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"{flag}={port}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None


def metrics_url(server: WSGIServer, host: str) -> str:
    """The address to scrape, with the port the server got (``--port 0``: one the OS picked)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{server.server_port}/metrics"


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; returns 0."""
    from trainhealth.connection import connect

    url, _ = resolve(args, start=False)
    server, _thread = start_metrics(connect(url), args.host, args.port, args.slowest_ranks, args.keep_ended)
    print(f"Metrics: {metrics_url(server, args.host)}", flush=True)
    interrupt_on_signals()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0
