"""``trainhealth analyze PATH...``: a post-mortem of training logs, offline (no Redis).

The report itself (text, JSON, exit status) is :mod:`trainhealth.commands.analyze_report`; the standalone
HTML page :mod:`trainhealth.commands.analyze_html`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from trainhealth.commands._shared import command, log_options, parse_map
from trainhealth.exceptions import ConfigError


def register(sub: Any) -> None:
    """Add ``analyze`` to the ``trainhealth`` sub-parsers."""
    n = command(sub, "analyze", "Post-mortem of training logs, offline (no Redis): the live detectors, goodput ledger "
                                "and rollback advisor run over each file. Exit 0 when nothing is critical, 1 when an "
                                "anomaly is critical, 2 when a file cannot be read. A file cut short (truncated, "
                                "ending mid-line) is analysed up to the cut with a warning naming where; it does "
                                "not change the exit status. Formats as for replay.")
    log_options(n)
    n.add_argument("--json", action="store_true", help="print the JSON report (docs/analyze.md) instead of the text")
    n.add_argument("--json-file", metavar="FILE", help="also write the JSON report to FILE")
    n.add_argument("--html", metavar="FILE", help="also write a standalone HTML report with charts to FILE")
    n.add_argument("--tensorboard", metavar="DIR",
                   help="also write the findings as TensorBoard scalars and text, one run directory per file under "
                        "DIR (anomalies at their steps, goodput and badput by cause, the advice; the logs extra)")
    n.add_argument("--step-seconds", type=float, default=1.0,
                   help="assumed seconds per step where the log has no step times (default 1.0)")
    n.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                   help="progress bars on stderr (default auto: when stderr is a terminal and a file takes > 0.5 s)")
    n.set_defaults(func=run, extra="server")


def run(args: argparse.Namespace) -> int:
    """Analyse every PATH; print the text or JSON report; returns :func:`exit_status`."""
    from trainhealth.commands.analyze_report import analyze_paths, exit_status, format_text, to_json, write_text

    progress = {"always": True, "never": False}.get(args.progress)  # auto: when stderr is a terminal
    reports = analyze_paths(args.paths, args.format, parse_map(args.map), step_seconds=args.step_seconds,
                            progress=progress, on_error=lambda msg: print(f"trainhealth: error: {msg}",
                                                                          file=sys.stderr, flush=True),
                            one_run=args.one_run)
    if args.json_file:
        write_text(to_json(reports), args.json_file, sys.stdout)
    if args.html:
        from trainhealth.commands.analyze_html import render

        write_text(render(reports), args.html, sys.stdout)
    if args.tensorboard:
        from trainhealth.commands.analyze_report import format_file
        from trainhealth.commands.analyze_tensorboard import write

        try:
            files = write(reports, args.tensorboard, format_file)
        except OSError as exc:  # as --json-file and --html say a path they cannot write
            raise ConfigError(f"--tensorboard {args.tensorboard}: cannot write: {exc.strerror or exc}") from None
        for f in files:
            print(f"TensorBoard: {f}", file=sys.stderr)
    if args.json:
        sys.stdout.write(to_json(reports))
    else:
        sys.stdout.write(format_text(reports))
    return exit_status(reports)
