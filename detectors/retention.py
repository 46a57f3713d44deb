"""Byte bounds of the streams the detector service writes: the ``MAXLEN`` of each ``XADD``.

A stream whose entries grow with the job (``th:{run}:agg`` carries every rank's busy seconds: ~10 B a rank, 40 kB
an entry at 4,096 ranks) cannot be bounded by a count of entries alone: 200,000 of them would be 8 GB. Each writer
therefore trims to the smaller of its entry bound and the entries that fit its byte bound, as the collectors trim
the step stream (``collectors/sender.py``): Redis ``XADD … MAXLEN``, exact (``=``) up to 1,000 entries and
approximate (``~``, whole radix-tree nodes) above, where an exact trim would buy nothing but work.

An entry's size is what Redis stores of it: its field names and values as bytes (Redis adds a few bytes a field and
~1-5 % per node; ``bench/retention_budget.py`` measures ``MEMORY USAGE`` against the bound). Entries of one stream
are alike (an ``agg`` entry's size follows the world size, a ledger snapshot's grows slowly with the causes it
names) but not equal (an anomaly's JSON varies with its evidence), so the entries kept are the bound divided by the
larger of the newest entry's size and the mean of the entries this writer added so far.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Above this many entries ``MAXLEN ~`` (trimming whole radix-tree nodes of up to 100 entries: at most ~10 % over);
#: at or below it ``MAXLEN =``, where a node would be a tenth or more of the stream.
EXACT_TRIM_ENTRIES = 1_000


def _size(x: Any) -> int:
    if isinstance(x, bytes):
        return len(x)
    text = x if isinstance(x, str) else str(x)
    return len(text) if text.isascii() else len(text.encode())


def entry_bytes(fields: Mapping[Any, Any]) -> int:
    """Bytes of a stream entry's field names and values as Redis stores them (ints and floats as their decimal
    text, str as UTF-8).

    >>> entry_bytes({"step": 12, "busy": "[0.5,0.25]", "loss": repr(2.5)})
    27
    """
    return sum(_size(k) + _size(v) for k, v in fields.items())


class StreamBound:
    """The ``MAXLEN`` that keeps one stream within ``max_entries`` entries and about ``max_bytes`` bytes.

    Parameters
    ----------
    max_entries : int
        Entries kept at most (>= 1).
    max_bytes : int
        Bytes of entries kept, about (>= 1): field names and values (:func:`entry_bytes`).

    Examples
    --------
    An ``agg`` entry of a 4,096-rank job (~40 kB) under a 1 MiB bound keeps 26 entries, exactly:

    >>> b = StreamBound(max_entries=200_000, max_bytes=2**20)
    >>> b.maxlen({"step": 7, "busy": "x" * 40_000})
    (26, False)
    >>> StreamBound(200_000, 2**30).maxlen({"step": 7, "busy": "x" * 400})
    (200000, True)
    """

    __slots__ = ("_count", "_total", "max_bytes", "max_entries")

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"a stream bound needs max_entries >= 1 and max_bytes >= 1, not {max_entries}, "
                             f"{max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._total, self._count = 0, 0

    def maxlen(self, fields: Mapping[Any, Any]) -> tuple[int, bool]:
        """``(MAXLEN, approximate)`` for the ``XADD`` of an entry of ``fields`` (at least 1 entry: the newest)."""
        size = max(1, entry_bytes(fields))
        self._total += size
        self._count += 1
        per = max(size, self._total / self._count)
        n = max(1, min(self.max_entries, int(self.max_bytes // per)))
        return n, n > EXACT_TRIM_ENTRIES
