"""Every docstring example of the installed package runs and prints what it shows.

The parts live in their own folders (``collectors/``, ``detectors/``, ``alerts/``, ``dashboard/``,
``commands/``) but are installed under ``trainhealth``; the modules are found and imported by those
installed names, so each doctest runs against the same module objects the product uses.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest

PARTS = ("trainhealth", "trainhealth.collectors", "trainhealth.detectors", "trainhealth.alerts",
         "trainhealth.dashboard", "trainhealth.commands")
#: Scripts, not libraries: importing them runs them.
SCRIPTS = {"trainhealth.__main__", "trainhealth.dashboard.app"}


def modules() -> list[str]:
    names = set(PARTS)
    for part in PARTS:
        pkg = importlib.import_module(part)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=part + "."):
            names.add(info.name)
    return sorted(names - SCRIPTS)


def with_examples() -> list[str]:
    finder = doctest.DocTestFinder()
    return [m for m in modules() if any(t.examples for t in finder.find(importlib.import_module(m)))]


def test_every_part_is_found() -> None:
    found = modules()
    for name in ("trainhealth.keys", "trainhealth.collectors.monitor", "trainhealth.collectors.importers.megatron_log",
                 "trainhealth.detectors.loss_spike", "trainhealth.alerts.worker", "trainhealth.alerts.sinks.slack",
                 "trainhealth.dashboard.data", "trainhealth.commands.analyze"):
        assert name in found


@pytest.mark.parametrize("name", with_examples())
def test_doctests(name: str) -> None:
    module = importlib.import_module(name)
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(module):
        runner.run(test, out=out.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, out.getvalue()
