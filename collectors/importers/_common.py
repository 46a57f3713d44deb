"""Shared helpers of the importers: opening files, numbers, bad-line accounting, timelines."""

from __future__ import annotations

import gzip
import io
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainhealth.exceptions import InputFormatError

log = logging.getLogger("collectors.importers")

GZIP_MAGIC = b"\x1f\x8b"


def open_text(path: Path, newline: str | None = None) -> io.TextIOBase:
    """Open ``path`` as UTF-8 text (undecodable bytes replaced), gunzipping a gzip file transparently.

    Raises :class:`InputFormatError` when it cannot be opened.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic == GZIP_MAGIC:
            return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline=newline)  # type: ignore[return-value]
        return open(path, encoding="utf-8", errors="replace", newline=newline)
    except OSError as exc:
        raise InputFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line without its end)`` of a text log; read errors become InputFormatError."""
    f = open_text(path)
    try:
        with f:
            for i, line in enumerate(f, 1):
                yield i, line.rstrip("\r\n")
    except (OSError, EOFError) as exc:  # a truncated .gz, a vanished file
        raise InputFormatError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None


def to_float(v: Any) -> float | None:
    """A logged number: int/float as is, a numeric string parsed (``nan``/``inf`` kept); None/"" → None.

    Raises ValueError for anything else (booleans, non-numeric strings, containers).
    """
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        s = v.strip()
        if not s:
            return None
        return float(s)
    raise ValueError(v)


def to_step(v: Any) -> int:
    """A step number: an int, an integral float (``49.0``) or a string of one. Raises ValueError otherwise."""
    if isinstance(v, bool):
        raise ValueError(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    if isinstance(v, str):
        s = v.strip()
        try:
            return int(s)
        except ValueError:
            f = float(s)
            if math.isfinite(f) and f == int(f):
                return int(f)
    raise ValueError(v)


_DAYS = re.compile(r"^\s*(-?\d+) days?, (.*)$")


def to_seconds(v: Any) -> float | None:
    """Elapsed time as seconds: a number, or ``str(timedelta)`` text (``5:39:46``, ``1 day, 2:03:04``)."""
    if isinstance(v, str) and ":" in v:
        days = 0
        m = _DAYS.match(v)
        if m:
            days, v = int(m.group(1)), m.group(2)
        parts = v.strip().split(":")
        if len(parts) != 3:
            raise ValueError(v)
        h, mi, s = int(parts[0]), int(parts[1]), float(parts[2])
        return days * 86400.0 + h * 3600.0 + mi * 60.0 + s
    return to_float(v)


def finite_positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


class BadLines:
    """Counts malformed lines of a line-oriented log; one warning at the end, naming the first.

    ``finish(good)`` raises :class:`InputFormatError` for the first bad line when nothing good was read.
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self.count = 0
        self.first: tuple[int, str] | None = None

    def add(self, line: int, reason: str) -> None:
        self.count += 1
        if self.first is None:
            self.first = (line, reason)

    def finish(self, good: int) -> None:
        if self.first is None:
            if good == 0:
                raise InputFormatError(f"{self.path}: no {self.what} lines found")
            return
        line, reason = self.first
        if good == 0:
            raise InputFormatError(f"{self.path}: line {line}: {reason}")
        log.warning("%s: skipped %d malformed %s line(s); the first: line %d: %s",
                    self.path, self.count, self.what, line, reason)


class Timeline:
    """Seconds per step between logged points, from a wall clock or an elapsed-since-start clock.

    ``wall`` readings give ``(t - t_prev) / (step - step_prev)`` (None for the first point);
    ``elapsed`` readings (seconds since the start of training) also give the first point
    ``elapsed / step``. A clock that goes back (a restart) or a step that does not advance gives None.
    """

    def __init__(self, elapsed: bool) -> None:
        self.elapsed = elapsed
        self.prev: tuple[int, float] | None = None

    def per_step(self, step: int, t: float | None) -> float | None:
        if t is None or not math.isfinite(t):
            return None
        prev, self.prev = self.prev, (step, t)
        if prev is None:
            if self.elapsed and step > 0 and t > 0:
                return t / step
            return None
        dstep, dt = step - prev[0], t - prev[1]
        if dstep <= 0 or dt <= 0:
            return None
        return dt / dstep


class CumulativeTokens:
    """Tokens since the previous logged step from a cumulative counter (as the HF importer counts them)."""

    def __init__(self) -> None:
        self.seen: float | None = None

    def delta(self, cum: float | None) -> int | None:
        if cum is None or not math.isfinite(cum) or cum <= 0:
            return None
        if self.seen is not None and cum < self.seen:  # the counter restarted: no delta for this point
            self.seen = cum
            return None
        tokens = int(cum - (self.seen or 0.0))
        self.seen = cum
        return tokens
