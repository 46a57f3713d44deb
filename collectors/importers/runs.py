"""A log file, or the per-rank log files of one job, as one run's points; and the run's name from its files.

``trainhealth replay`` and ``trainhealth analyze`` read their PATHs through here.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from trainhealth.collectors import importers
from trainhealth.exceptions import InputFormatError
from trainhealth.logpoint import LogPoint


def log_stem(paths: Path | Sequence[Path]) -> str:
    """The run's name from its file name(s): ``hf_x.trainer_state.json`` → ``hf_x``; for several files
    (the ranks of one run) the names' common start without a trailing ``rank``:
    ``trace_rank0.json.gz`` + ``trace_rank1.json.gz`` → ``trace``.

    >>> log_stem([Path("kineto_trace_rank0_ws128.json.gz"), Path("kineto_trace_rank1_ws128.json.gz")])
    'kineto_trace'
    """
    names = [p.name.split(".")[0] for p in ([paths] if isinstance(paths, Path) else paths)]
    stem = names[0]
    if len(names) > 1:
        same = itertools.takewhile(lambda c: len(set(c)) == 1, zip(*names, strict=False))  # up to the shortest
        common = "".join(c[0] for c in same)
        common = re.sub(r"(?i)[-_.]*(rank)?[-_.]*$", "", common)
        stem = common or stem
    return re.sub(r"[^A-Za-z0-9._-]", "-", stem)[:100] or "log"


def read_points(path: str | Path, fmt: str | None = None,
                mapping: Mapping[str, str | None] | None = None) -> list[LogPoint]:
    """Parse a supported training log (format detected, or ``fmt``; see :mod:`trainhealth.collectors.importers`).

    Raises :class:`InputFormatError` when it cannot be parsed or holds no training step.
    """
    fmt = fmt or importers.detect(path)
    points = list(importers.read(path, fmt, mapping))
    if not any(not p.is_eval for p in points):
        if fmt == "hf_trainer_state":
            raise InputFormatError(f"{path}: no training steps (log_history entries with 'loss') to replay")
        raise InputFormatError(f"{path}: no training steps to replay (read as {fmt})")
    return points


def read_run(paths: Sequence[str | Path], fmt: str | None = None,
             mapping: Mapping[str, str | None] | None = None,
             formats: Sequence[str] | None = None) -> tuple[list[LogPoint], list[str]]:
    """Parse per-rank logs of one job (one file per rank or group of ranks) into one run's points.

    Returns the points of every file (file order) and each file's format (``formats``, when the
    caller detected them already; else ``fmt`` or detected). ``--one-run`` of
    ``trainhealth analyze`` and ``trainhealth replay``.

    Raises
    ------
    InputFormatError
        When a file cannot be parsed or holds no training step, is a single-stream log (its points
        have no rank), or holds a rank another file also holds.
    """
    points: list[LogPoint] = []
    found: list[str] = []
    owner: dict[int, str | Path] = {}
    for i, path in enumerate(paths):
        f = formats[i] if formats is not None else fmt or importers.detect(path)
        pts = read_points(path, f, mapping)
        found.append(f)
        if any(p.rank is None for p in pts):
            why = (" without distributedInfo.rank or 'rank<N>' in its name" if f == "kineto_trace" else "")
            raise InputFormatError(f"{path}: a {f} log{why} has no rank: --one-run joins per-rank logs of one job "
                                   f"(formats {', '.join(sorted(importers.PER_RANK_FORMATS))})")
        for r in sorted({p.rank for p in pts if p.rank is not None}):
            if r in owner:
                raise InputFormatError(f"{path}: rank {r} is also in {owner[r]}: --one-run joins different ranks of "
                                       "one job")
            owner[r] = path
        points += pts
    return points, found
