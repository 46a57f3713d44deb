"""The ``trainhealth`` commands: the top floor, the only place that wires the parts together.

One module per command; :func:`main` (the ``trainhealth`` console script and ``python -m trainhealth``)
parses the command line and runs one. Nothing else in the package imports from here.
"""

from __future__ import annotations

from trainhealth.commands.cli import main

__all__ = ["main"]
