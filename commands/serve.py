"""``trainhealth serve``: the detector service (every run's streams → anomalies, goodput ledger, advice)."""

from __future__ import annotations

import argparse
from typing import Any

from trainhealth import defaults
from trainhealth.commands._shared import command, release_embedded, resolve, with_url


def register(sub: Any) -> None:
    """Add ``serve`` to the ``trainhealth`` sub-parsers."""
    s = with_url(command(sub, "serve", "Run the detector service: reads every run's streams, writes anomalies and "
                                       "the goodput ledger. Stop with SIGTERM or Ctrl-C."))
    s.add_argument("--consumer", help="consumer name in the group (default: <host>-<pid>)")
    s.add_argument("--hang-floor", type=float, default=defaults.HANG_FLOOR_S,
                   help=f"minimum seconds without progress before a hang (default {defaults.HANG_FLOOR_S:.0f})")
    s.set_defaults(func=run, extra="server")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; returns 0."""
    from trainhealth.connection import connect
    from trainhealth.detectors.hang import HangDetector
    from trainhealth.detectors.service import DetectorService

    url, embedded = resolve(args)
    floor = args.hang_floor
    service = DetectorService(connect(url), consumer=args.consumer,
                              hang_factory=lambda: HangDetector(floor_s=floor))
    service.install_signal_handlers()
    try:
        service.run_forever()
    finally:
        release_embedded(embedded, url)
    return 0
