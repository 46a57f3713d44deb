"""Bounded on-disk spill for the collector: where records wait when Redis is away and memory is full.

Segments of JSON lines, oldest first; the total is bounded in bytes, and beyond it the
oldest segment is deleted and its records counted as dropped. Only the collector's sender
thread touches it, never the training loop.

Each line is one record, ``[stream, fields]`` as ``json.dumps`` writes it (ASCII: it escapes the rest, so a
line's length is its size in bytes). The oldest segment is read a line at a time as it is sent, never whole:
the sender can pause between lines (``pause``), and holds only the lines it is about to send.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: After the first "spill over" warning, at most one per this many seconds (with the running total):
#: while Redis stays away a small spill drops its oldest segment on nearly every write.
DROP_WARN_INTERVAL_S = 60.0
#: How a step record's line starts; the rest is the record's JSON and ``]`` (the sender passes it through).
STEP_LINE_PREFIX = '["steps",'


def record_line(stream: str, fields: dict[str, Any]) -> str:
    """One record's line: ``[stream, fields]`` in compact JSON and a newline."""
    return json.dumps([stream, fields], separators=(",", ":")) + "\n"


class Spill:
    """Append-only record spill in ``directory`` (segments named ``{prefix}-{n}.jsonl``).

    Parameters
    ----------
    directory : Path
        Created if missing. Leftover segments of this prefix are removed at start: they belong
        to a dead process of the same rank and incarnation, which cannot happen, or to a crash
        whose records are already lost to the ledger (documented, not replayed).
    prefix : str
        Unique per process (run, rank, pid).
    max_bytes : int
        Bound of all segments together (bytes).
    segment_records : int
        Records per segment at most; a segment also closes at an eighth of ``max_bytes``
        (segments are the unit in which the oldest records are dropped).

    Raises
    ------
    OSError
        When the directory cannot be created (the caller then spills nothing).
    """

    def __init__(self, directory: Path, prefix: str, max_bytes: int, segment_records: int = 10_000) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.segment_records = segment_records
        for old in self.directory.glob(f"{prefix}-*.jsonl"):
            old.unlink(missing_ok=True)
        # [path, records, bytes]; the last one is open for appending.
        self._segments: deque[list[Any]] = deque()
        self._n = 0
        self._file: Any = None
        # The oldest segment as it is read for sending: its records (and bytes) committed, its file open for
        # reading after them, and the lines read from it and not yet committed (the next ones to send).
        self._head_pos = 0
        self._head_off = 0
        self._reader: Any = None
        self._ahead: list[str] = []
        #: Records the last :meth:`peek` handed out and not yet committed (still counted in ``len``).
        self.peeked = 0
        # Records handed out by peek whose segment was then dropped for the bound: the sender holds
        # them in memory and delivers them; their commit must not consume the next segment's records.
        self._orphans = 0
        self._records = 0
        self._bytes = 0
        #: Records deleted because the spill bound was exceeded.
        self.dropped = 0
        self._warned_drops = 0  # ``dropped`` as of the last warning
        self._warned_at: float | None = None

    def __len__(self) -> int:
        return self._records

    @property
    def bytes(self) -> int:
        """Bytes on disk now."""
        return self._bytes

    def write(self, records: list[tuple[str, dict[str, Any]]]) -> None:
        """Append encoded records (stream, fields) after everything already spilled."""
        self.append([record_line(stream, fields) for stream, fields in records])

    def append(self, lines: list[str], pause: Callable[[], None] | None = None) -> None:
        """Append records already made lines (see :func:`record_line`) after everything already spilled;
        ``pause()`` is called after each line."""
        for line in lines:
            seg = self._segments[-1] if self._segments else None
            # Segments hold at most an eighth of the bound, so dropping the oldest keeps the bound.
            if self._file is None or seg[1] >= self.segment_records or seg[2] >= self.max_bytes // 8:
                self._rotate()
            self._file.write(line)
            seg = self._segments[-1]
            seg[1] += 1
            seg[2] += len(line)
            self._records += 1
            self._bytes += len(line)
            if pause is not None:
                pause()
        if self._file is not None:
            self._file.flush()
        while self._bytes > self.max_bytes and len(self._segments) > 1:
            self._drop_oldest()

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
        path = self.directory / f"{self.prefix}-{self._n:08d}.jsonl"
        self._n += 1
        # newline="\n": the reader counts bytes, which a platform's "\r\n" would change.
        self._file = open(path, "a", encoding="utf-8", newline="\n")  # noqa: SIM115 (kept open across calls)
        self._segments.append([path, 0, 0])

    def _drop_oldest(self) -> None:
        path, n, size = self._segments.popleft()
        # The head is this segment: its committed records are gone already, its peeked ones are in the
        # sender's hands (orphans: delivered from there, not dropped).
        sent, taken = self._head_pos, self.peeked
        if taken:
            self._orphans, self.peeked = taken, 0
        self._reset_head()
        path.unlink(missing_ok=True)
        self.dropped += n - sent - taken
        self._records -= n - sent
        self._bytes -= size
        self._warn_drops()

    def _warn_drops(self, final: bool = False) -> None:
        """Warn of the records dropped since the last warning: the first time, then at most once per
        :data:`DROP_WARN_INTERVAL_S` (and once more at :meth:`close`), with the running total."""
        new = self.dropped - self._warned_drops
        now = time.monotonic()
        if new <= 0 or not (final or self._warned_at is None or now - self._warned_at >= DROP_WARN_INTERVAL_S):
            return
        self._warned_at, self._warned_drops = now, self.dropped
        log.warning("trainhealth collector: spill over %d bytes; dropped %d oldest record%s (%d in all so far)",
                    self.max_bytes, new, "" if new == 1 else "s", self.dropped)

    def peek(self, n: int) -> list[tuple[str, dict[str, Any]]]:
        """Up to ``n`` oldest records, without removing them (see :meth:`commit`)."""
        return [tuple(json.loads(line)) for line in self.peek_lines(n)]  # type: ignore[misc]

    def peek_lines(self, n: int, pause: Callable[[], None] | None = None) -> list[str]:
        """Up to ``n`` oldest records as their lines, without removing them (see :meth:`commit`); reads only
        as many lines of the oldest segment as that, calling ``pause()`` after each."""
        if not self._segments:
            return []
        ahead = self._ahead
        if len(ahead) < n:
            f = self._reader
            if f is None:
                f = self._reader = open(self._segments[0][0], "rb")  # noqa: SIM115 (kept open across calls)
                f.seek(self._head_off)
            while len(ahead) < n:
                raw = f.readline()
                if not raw.endswith(b"\n"):  # the end (the oldest segment may also be the one appended to)
                    if raw:
                        f.seek(-len(raw), os.SEEK_CUR)
                    break
                ahead.append(raw.decode())
                if pause is not None:
                    pause()
        batch = ahead[:n]
        self.peeked = len(batch)
        return batch

    def commit(self, n: int) -> None:
        """The ``n`` records last peeked were delivered: forget them (deleting emptied segments)."""
        self.peeked = 0
        if self._orphans:  # their segment was dropped meanwhile: nothing left on disk to forget
            self._orphans = 0
            return
        done = self._ahead[:n]
        del self._ahead[:n]
        self._head_off += sum(map(len, done))
        self._head_pos += n
        self._records -= n
        seg = self._segments[0]
        if self._head_pos >= seg[1]:
            self._segments.popleft()
            if not self._segments and self._file is not None:
                self._file.close()
                self._file = None
            self._reset_head()
            seg[0].unlink(missing_ok=True)
            self._bytes -= seg[2]

    def _reset_head(self) -> None:
        """The oldest segment is gone (sent or dropped): the next one is read from its start."""
        if self._reader is not None:
            with contextlib.suppress(OSError):
                self._reader.close()
        self._reader, self._ahead, self._head_pos, self._head_off = None, [], 0, 0

    def close(self) -> None:
        """Close the open segment and delete the segments that hold nothing undelivered.

        Segments with undelivered records stay on disk (nothing replays them: a new process has
        another prefix, and the same prefix removes them at start), for a person to inspect.
        """
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self._reader is not None:  # read again from the last commit if peeked again
            with contextlib.suppress(OSError):
                self._reader.close()
            self._reader, self._ahead = None, []
        self._warn_drops(final=True)
        keep = {seg[0] for seg in self._segments if seg[1] > 0} if self._records > 0 else set()
        for path in self.directory.glob(f"{self.prefix}-*.jsonl"):
            if path not in keep:
                with contextlib.suppress(OSError):
                    path.unlink()
        head = self._segments[0][0] if self._segments else None
        self._segments = deque(seg for seg in self._segments if seg[0] in keep)
        if not self._segments or self._segments[0][0] != head:
            self._reset_head()


def default_directory() -> Path:
    """``$TRAINHEALTH_SPILL_DIR``, else ``<trainhealth home>/spill``."""
    from trainhealth import config

    env = os.environ.get("TRAINHEALTH_SPILL_DIR")
    return Path(env) if env else config.home_dir() / "spill"
