"""``trainhealth dashboard``: the Streamlit dashboard on 127.0.0.1, usage statistics off."""

from __future__ import annotations

import argparse
import subprocess
from typing import Any

from trainhealth import defaults
from trainhealth.commands._shared import (
    check_port,
    child_env,
    command,
    dashboard_command,
    ignore_signals,
    interrupt_on_signals,
    release_embedded,
    resolve,
    with_url,
)


def register(sub: Any) -> None:
    """Add ``dashboard`` to the ``trainhealth`` sub-parsers."""
    b = with_url(command(sub, "dashboard", "Run the Streamlit dashboard (usage statistics off)."))
    b.add_argument("--port", type=int, default=defaults.DASHBOARD_PORT,
                   help=f"port on 127.0.0.1 (default {defaults.DASHBOARD_PORT})")
    b.set_defaults(func=run, extra="server")


def run(args: argparse.Namespace) -> int:
    """Run Streamlit until it exits, or until SIGTERM / Ctrl-C (130); returns its exit status."""
    import streamlit  # noqa: F401 - fail here, with the extra to install, not in the child process

    check_port(args.port)
    url, embedded = resolve(args)
    print(f"Dashboard: http://127.0.0.1:{args.port}/", flush=True)
    proc = subprocess.Popen(dashboard_command(url, args.port), env=child_env(url))
    interrupt_on_signals()  # SIGTERM (systemd, kill, a supervisor) cleans up as Ctrl-C does, not orphaning Streamlit
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C in the terminal reached Streamlit too; a signal to this process alone did not.
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130
    finally:
        ignore_signals()  # a second signal must not skip the cleanup
        release_embedded(embedded, url)
