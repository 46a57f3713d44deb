"""Bounds of the streams the detector service keeps: the ``MAXLEN`` of each ``XADD`` it writes, and the trim of the
raw step stream it reads once it has processed its entries.

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

from collections import deque
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


class RawWindow:
    """The newest processed entries of a run's raw step stream (``th:{run}:steps``) within ``max_records`` records
    and about ``max_bytes`` bytes: the ``MINID`` of the trim that drops the rest.

    The stream is shared by every rank's collector, and an entry holds one record or a backlog of a thousand, so no
    collector can size the stream from its own entries (a ``MAXLEN`` of the bound over one rank's 1,000-record
    entry removed the other ranks' one-record entries by the thousand). The service, which reads every entry in
    order, counts them here as it processes them and trims the oldest once the records or bytes it processed exceed
    the bound: what it has not read yet is never trimmed (``XTRIM … MINID`` removes only entries older than an id it
    processed), and a rank's records are kept as long as anyone's of the same age.

    Processed entries are counted in chunks of consecutive entries (``max_records // 1000`` records and
    ``max_bytes // 1000`` bytes at least), so the trim is exact to a thousandth of the bound while the count takes
    a few thousand chunks per run whatever the entries (a million one-record entries would be ~100 MB of tuples).

    Parameters
    ----------
    max_records : int
        Records kept at most (>= 1): ``$TRAINHEALTH_RETENTION``, or the run's own (``Monitor(retention=)``).
    max_bytes : int
        Bytes of entries kept, about (>= 1): :func:`entry_bytes` of each, ``$TRAINHEALTH_RETENTION_BYTES``.

    Raises
    ------
    ValueError
        When a bound is below 1.

    Examples
    --------
    Five records a rank-step in entries of one record, then a 1,000-record backlog of one rank, under a bound of
    10,000 records: nothing is trimmed until the records processed pass 10,000, then the oldest go, to the entry.

    >>> w = RawWindow(max_records=10_000, max_bytes=2**30)
    >>> for ms in range(5_000):
    ...     w.add((ms, 0), records=1, nbytes=300)
    >>> w.add((5_000, 0), records=1_000, nbytes=300_000)
    >>> w.trim(), w.records
    (None, 6000)
    >>> for ms in range(5_001, 10_001):
    ...     w.add((ms, 0), records=1, nbytes=300)
    >>> w.trim(), w.records
    (('1000-0', True), 10000)

    References
    ----------
    Redis ``XTRIM`` with ``MINID`` (Redis 6.2): https://redis.io/docs/latest/commands/xtrim/
    """

    __slots__ = ("_chunk_bytes", "_chunk_records", "_chunks", "_entries", "max_bytes", "max_records", "nbytes",
                 "records")

    def __init__(self, max_records: int, max_bytes: int) -> None:
        if max_records < 1 or max_bytes < 1:
            raise ValueError(f"a raw step window needs max_records >= 1 and max_bytes >= 1, not {max_records}, "
                             f"{max_bytes}")
        self.max_records, self.max_bytes = max_records, max_bytes
        self._chunk_records, self._chunk_bytes = max(1, max_records // 1000), max(1, max_bytes // 1000)
        #: [first entry id (ms, seq), records, bytes, entries] of each chunk, oldest first.
        self._chunks: deque[list[Any]] = deque()
        #: Records and bytes (:func:`entry_bytes`) of the entries counted and not trimmed.
        self.records = 0
        self.nbytes = 0
        self._entries = 0

    def add(self, entry_id: tuple[int, int], records: int, nbytes: int) -> None:
        """Count one processed entry: its id ``(ms, seq)`` (newer than every one counted before), its records and
        its bytes."""
        last = self._chunks[-1] if self._chunks else None
        if last is not None and last[1] < self._chunk_records and last[2] < self._chunk_bytes:
            last[1] += records
            last[2] += nbytes
            last[3] += 1
        else:
            self._chunks.append([entry_id, records, nbytes, 1])
        self.records += records
        self.nbytes += nbytes
        self._entries += 1

    def trim(self) -> tuple[str, bool] | None:
        """Drop the oldest chunks while the records or bytes counted exceed the bound (the newest chunk is always
        kept); return ``(MINID, approximate)`` for ``XTRIM`` — the id of the oldest entry kept, and whether the
        entries kept are many enough (over :data:`EXACT_TRIM_ENTRIES`) for Redis' trim of whole radix-tree nodes —
        or None when nothing is to be trimmed."""
        dropped = False
        while len(self._chunks) > 1 and (self.records > self.max_records or self.nbytes > self.max_bytes):
            _, records, nbytes, entries = self._chunks.popleft()
            self.records -= records
            self.nbytes -= nbytes
            self._entries -= entries
            dropped = True
        if not dropped:
            return None
        ms, seq = self._chunks[0][0]
        return f"{ms}-{seq}", self._entries > EXACT_TRIM_ENTRIES
