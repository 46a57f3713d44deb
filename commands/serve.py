"""``trainhealth serve``: the detector service (every run's streams → anomalies, goodput ledger, advice)."""

from __future__ import annotations

import argparse
from typing import Any

from trainhealth import defaults
from trainhealth.commands._shared import command, release_embedded, resolve, with_url
from trainhealth.commands.exporter import DEFAULT_HOST, add_exporter_options, metrics_url, start_metrics


def register(sub: Any) -> None:
    """Add ``serve`` to the ``trainhealth`` sub-parsers."""
    s = with_url(command(sub, "serve", "Run the detector service: reads every run's streams, writes anomalies and "
                                       "the goodput ledger. Stop with SIGTERM or Ctrl-C."))
    s.add_argument("--consumer", help="consumer name in the group (default: <host>-<pid>)")
    s.add_argument("--hang-floor", type=float, default=defaults.HANG_FLOOR_S,
                   help=f"minimum seconds without progress before a hang (default {defaults.HANG_FLOOR_S:.0f})")
    s.add_argument("--linger", type=_linger, default=defaults.READ_LINGER_S, metavar="SECONDS",
                   help=f"seconds (0 to {defaults.MAX_READ_LINGER_S:g}) to wait after catching up before reading "
                        "again, so the next read takes the records written meanwhile in one batch "
                        f"(default {defaults.READ_LINGER_S}; 0: at once)")
    s.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="also serve the Prometheus metrics (docs/metrics.md) on this port, as `trainhealth "
                        "exporter` does (default: not served)")
    s.add_argument("--metrics-host", default=DEFAULT_HOST,
                   help=f"address of --metrics-port (default {DEFAULT_HOST}: this machine only; 0.0.0.0 lets a "
                        "Prometheus on another machine scrape it)")
    add_exporter_options(s, prefix="metrics-")
    s.set_defaults(func=run, extra="server")


def _linger(text: str) -> float:
    """``--linger``'s value: seconds from 0 to ``defaults.MAX_READ_LINGER_S`` (argparse names the flag and exits 2
    otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= defaults.MAX_READ_LINGER_S:
        raise argparse.ArgumentTypeError(f"{text} must be seconds between 0 and {defaults.MAX_READ_LINGER_S:g}")
    return value


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C (with the metrics on ``--metrics-port`` when given); returns 0."""
    from trainhealth.connection import connect
    from trainhealth.detectors.hang import HangDetector
    from trainhealth.detectors.service import DetectorService

    url, embedded = resolve(args)
    floor = args.hang_floor
    client = connect(url)
    service = DetectorService(client, consumer=args.consumer, hang_factory=lambda: HangDetector(floor_s=floor),
                              linger_s=args.linger)
    metrics = None
    try:
        if args.metrics_port is not None:
            metrics, _ = start_metrics(client, args.metrics_host, args.metrics_port, args.metrics_slowest_ranks,
                                       args.metrics_keep_ended, flag="--metrics-port")
            print(f"Metrics: {metrics_url(metrics, args.metrics_host)}", flush=True)
        service.install_signal_handlers()
        service.run_forever()
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        release_embedded(embedded, url)
    return 0
