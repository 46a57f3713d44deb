"""The ``trainhealth`` commands: the top floor, the only place that wires the parts together.

One module per command (``demo``, ``serve``, ``dashboard``, ``exporter``, ``replay``, ``follow``, ``analyze``,
``doctor``, ``redis``, ``advise``, ``alerts``/``silence``/``deadletters``, ``schemas``, ``completion``), each with
``register(sub)`` adding its parser and the function it runs. :func:`main` is the ``trainhealth`` console
script and ``python -m trainhealth``. Nothing else in the package imports from here.

A command imports the parts it needs when it runs, so the base install (``pip install trainhealth``: the
collectors and redis-py) has a working CLI: a command that needs an extra says which one to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys

import redis

from trainhealth import __version__
from trainhealth.commands import (
    advise,
    alerts,
    analyze,
    completion,
    dashboard,
    demo,
    doctor,
    exporter,
    follow,
    redis_server,
    replay,
    schemas,
    serve,
)
from trainhealth.exceptions import TrainHealthError

__all__ = ["EXTRAS", "build_parser", "main"]

#: The third-party modules of each optional extra (pyproject.toml), checked before a command that needs the
#: extra runs, and used to name the extra when one of them is missing.
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("numpy", "pandas", "sklearn", "streamlit", "plotly", "tsdownsample", "msgspec", "httpx", "tqdm",
               "prometheus_client"),
    "logs": ("tensorboard",),
    "torch": ("torch",),
    "hf": ("transformers",),
    "lightning": ("lightning",),
}
_EXTRA_OF = {module: extra for extra, modules in EXTRAS.items() for module in modules} | {
    "tomli": "server", "hiredis": "server", "pythonjsonlogger": "server", "shtab": "server"}


def build_parser() -> argparse.ArgumentParser:
    """The ``trainhealth`` argument parser, every command registered."""
    p = argparse.ArgumentParser(prog="trainhealth", description="Live training-health monitor: goodput, "
                                "loss spikes, stragglers, hangs, restarts.")
    p.add_argument("--version", action="version", version=f"trainhealth {__version__}")
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), help="logging level (default INFO)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text (default), or json: one JSON object per line (timestamp, level, logger, message, "
                        "exc_info) for a log shipper (Loki, Elasticsearch, Cloud Logging)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, serve, dashboard, exporter, replay, follow, analyze, doctor, redis_server, advise,
                   alerts, schemas, completion):
        module.register(sub)
    return p


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, a module without a spec
        return False


def _missing_extra(command: str, extra: str, module: str) -> str:
    return (f"trainhealth {command}: needs the '{extra}' extra (the module {module!r} is not installed): "
            f"pip install '.[{extra}]' in the trainhealth repository (or '<its path>[{extra}]')")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the command; returns the exit status.

    0 success; 1 as each command documents (something down, something critical); 2 an error
    (bad input, a missing extra), printed as one line on stderr; 130 interrupted; 141 the reader of
    stdout left (``| head``).
    """
    args = build_parser().parse_args(argv)
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    if args.log_format == "json":
        try:
            from pythonjsonlogger.json import JsonFormatter
        except ModuleNotFoundError:
            print(_missing_extra(args.command, "server", "pythonjsonlogger"), file=sys.stderr)
            return 2
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter("%(levelname)s %(name)s %(message)s", timestamp=True,
                                           rename_fields={"levelname": "level", "name": "logger"}))
        logging.basicConfig(level=level, handlers=[handler])
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    extra = getattr(args, "extra", None)
    if extra is not None:
        missing = [m for m in EXTRAS[extra] if not _installed(m)]
        if missing:
            print(_missing_extra(args.command, extra, missing[0]), file=sys.stderr)
            return 2
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return status
    except TrainHealthError as exc:
        print(f"trainhealth: error: {exc}", file=sys.stderr)
        return 2
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"trainhealth {args.command}: Redis is unreachable ({exc})", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in _EXTRA_OF:
            raise
        print(_missing_extra(args.command, _EXTRA_OF[top], top), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C where a command has nothing of its own to clean up (analyze, doctor, a start-up): one line, no
        # traceback, the shell's status for SIGINT.
        print(f"trainhealth {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `trainhealth advise --json | head`: the reader left; end quietly, as Unix tools do
        # (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
