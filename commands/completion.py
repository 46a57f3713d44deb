"""``trainhealth completion SHELL``: the shell completion script of every command and option, generated from the
parser itself (shtab), so it never falls behind the commands."""

from __future__ import annotations

import argparse
from typing import Any

from trainhealth.commands._shared import command

SHELLS = ("bash", "zsh", "tcsh")


def register(sub: Any) -> None:
    """Add ``completion`` to the ``trainhealth`` sub-parsers."""
    c = command(sub, "completion", "Print the shell completion script: `eval \"$(trainhealth completion bash)\"` "
                                   "in ~/.bashrc; `trainhealth completion zsh > \"${fpath[1]}/_trainhealth\"` for zsh.")
    c.add_argument("shell", choices=SHELLS)
    c.set_defaults(func=run, extra="server")


def run(args: argparse.Namespace) -> int:
    """Print the script for ``args.shell``; 0."""
    import shtab

    from trainhealth.commands import build_parser

    print(shtab.complete(build_parser(), shell=args.shell))
    return 0
