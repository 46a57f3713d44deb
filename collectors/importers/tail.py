"""Following a log file as it grows (``tail -F``): the line source of ``trainhealth follow``.

The text and JSON-lines readers take their lines from :class:`~trainhealth.collectors.importers._common.Lines`.
While a :class:`Follow` is set in :data:`following` for a path, the reader's last pass over that path reads
from the follow's start offset and, at the end of the file, waits for more instead of ending: the reader then
yields each step as its line is written, with all its own parsing (wrapped Megatron lines, tqdm bars, cumulative
token counts) unchanged. Passes before the last (a reader's first scan for the JSON-lines columns or the
training bar) read the file as it is, to its current end.

What a tail must survive, as ``tail -F`` does:

- **rotation**: the path is renamed away and a new file is created under it (logrotate's default, a launcher
  starting ``train.log`` anew): what was still written to the old file is read to its end, then the new file
  from its start;
- **truncation**: the file shrinks below the read offset (logrotate's ``copytruncate``, a job reopening its log
  with ``"w"``): it is read again from its start;
- **a line being written**: a last line without its end is held until its end arrives (a writer's buffer
  flushes a line in pieces), so no half line is parsed;
- **the file missing**: before it is created, or between a rename and the new file, the tail waits.

gzip files cannot be followed (a gzip stream is unreadable until it is closed): :func:`check_followable` says so.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: The follow in force, read by ``Lines.__iter__`` (None: every read ends at the end of the file).
following: contextvars.ContextVar[Follow | None] = contextvars.ContextVar("trainhealth_following", default=None)

#: Bytes read at a time.
CHUNK = 1 << 16
#: Longest line held while its end has not arrived (bytes); longer, it is handed out as it is: a log line of
#: more than 16 MiB is not a training step, and the tail must not grow without bound.
MAX_LINE = 16 << 20
_GZIP_MAGIC = b"\x1f\x8b"


def check_followable(path: Path) -> str | None:
    """Why ``path`` cannot be followed (``None`` when it can, or does not exist yet): a directory, gzip."""
    try:
        if path.is_dir():
            return f"{path}: is a directory; follow takes one log file"
        with open(path, "rb") as f:
            if f.read(2) == _GZIP_MAGIC:
                return f"{path}: is gzip-compressed; a gzip stream cannot be followed while it is written"
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: cannot read: {exc.strerror or exc}"
    return None


@dataclass
class Follow:
    """How the reader's passes over ``path`` read it.

    Parameters
    ----------
    path : Path
        The followed file (compared by its absolute path).
    start : int
        Byte offset the last pass starts at: 0 to read the file's past too, its size when following began to
        read only what is written from then on (rounded back to a line start by the caller).
    passes : int
        How many times the format's reader reads the file; the last pass follows (1 for most; 2 for readers
        that scan the file once first: JSON-lines columns, the HF stdout training bar).
    poll_s : float
        Seconds between looks at a file that has not grown.
    stop : Callable[[], bool]
        Asked at every look: True ends the last pass as if the file had ended there (a last line without its
        end is then handed out as it is).
    idle : Callable[[], None] | None
        Called at every look that found nothing new (the command flushes what it holds there).
    start_line : int
        Line number of the line at ``start`` minus one (lines keep their numbers in messages).

    Attributes
    ----------
    rotations, truncations : int
        How many times the file was replaced under its path, or shrank below the read offset.
    offset : int
        Byte offset read up to in the current file (complete lines only).
    """

    path: Path
    start: int = 0
    passes: int = 1
    poll_s: float = 0.5
    stop: Callable[[], bool] = lambda: False
    idle: Callable[[], None] | None = None
    start_line: int = 0
    rotations: int = 0
    truncations: int = 0
    offset: int = 0
    _passes_begun: int = field(default=0, repr=False)

    def matches(self, path: Path) -> bool:
        """Whether ``path`` names the followed file."""
        return os.path.abspath(path) == os.path.abspath(self.path)

    def begin_pass(self) -> bool:
        """Count a pass of the reader; True when it is the last one (the one that follows)."""
        self._passes_begun += 1
        return self._passes_begun >= self.passes

    def lines(self) -> Iterator[tuple[int, str]]:
        """``(line number, line without its end)`` from :attr:`start`, following the file until :attr:`stop`.

        Lines end at ``\\n``, ``\\r\\n`` or a lone ``\\r``, as :class:`Lines` reads them; bytes that are not
        UTF-8 are replaced, a UTF-8 byte-order mark at the file's start is dropped.
        """
        lineno = self.start_line
        f, ident = self._open_wait()
        if f is None:
            return
        pos = self.start if ident is not None else 0
        f.seek(pos)
        buf = b""
        try:
            while True:
                chunk = f.read(CHUNK)
                if chunk:
                    if pos == 0 and not buf and chunk.startswith(b"\xef\xbb\xbf"):
                        chunk, pos = chunk[3:], 3
                    buf += chunk
                    lines, buf = _split(buf)
                    for raw in lines:
                        pos += len(raw)
                        lineno += 1
                        self.offset = pos
                        yield lineno, raw.rstrip(b"\r\n").decode("utf-8", errors="replace")
                    if len(buf) > MAX_LINE:  # a runaway line: hand it out rather than hold it for ever
                        pos += len(buf)
                        lineno += 1
                        self.offset = pos
                        yield lineno, buf.decode("utf-8", errors="replace")
                        buf = b""
                    continue
                # At the end of what is written: look again, unless told to stop.
                if buf.endswith(b"\r"):  # a lone \r ends a line (a progress bar's redraw) once nothing follows
                    pos += len(buf)
                    lineno += 1
                    self.offset = pos
                    yield lineno, buf.rstrip(b"\r").decode("utf-8", errors="replace")
                    buf = b""
                if self.idle is not None:
                    self.idle()
                if self.stop():
                    if buf:  # stopping: the file as it stands, its last line without an end too
                        self.offset = pos + len(buf)
                        yield lineno + 1, buf.rstrip(b"\r\n").decode("utf-8", errors="replace")
                    return
                time.sleep(self.poll_s)
                now = _ident(self.path)
                if now is not None and now[:2] != ident[:2]:
                    # Replaced under its path: the rest of the old file first (read above, it is at its end
                    # now unless written since), then the new file from its start.
                    rest = f.read()
                    if rest:
                        f.seek(pos + len(buf))  # read again through the loop, lines and all
                        continue
                    if buf:
                        lineno += 1
                        yield lineno, buf.rstrip(b"\r\n").decode("utf-8", errors="replace")
                    log.info("%s: replaced (rotated); following the new file from its start", self.path)
                    f.close()
                    f, ident = self._open_wait()
                    if f is None:
                        return
                    self.rotations += 1
                    pos, buf, lineno = 0, b"", 0
                elif now is not None and now[2] < pos + len(buf):
                    log.info("%s: truncated to %d bytes (was read to %d); reading it again from its start",
                             self.path, now[2], pos + len(buf))
                    self.truncations += 1
                    f.seek(0)
                    pos, buf, lineno = 0, b"", 0
        finally:
            if f is not None:
                f.close()

    def _open_wait(self) -> tuple[object, tuple[int, int, int]] | tuple[None, None]:
        """Open the path, waiting while it does not exist; ``(file, (dev, inode, size))``, or Nones on stop."""
        while True:
            try:
                f = open(self.path, "rb")  # noqa: SIM115 - closed by lines()
                st = os.fstat(f.fileno())
                return f, (st.st_dev, st.st_ino, st.st_size)
            except FileNotFoundError:
                if self.idle is not None:
                    self.idle()
                if self.stop():
                    return None, None
                time.sleep(self.poll_s)


def _ident(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size


def _split(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines of ``buf`` (each with its end) and the rest. A ``\\r`` at the very end is held: it may be
    the first half of a ``\\r\\n`` written in two pieces.

    >>> _split(b"a\\nb\\r\\nc\\rd")
    ([b'a\\n', b'b\\r\\n', b'c\\r'], b'd')
    >>> _split(b"a\\r")
    ([], b'a\\r')
    """
    out: list[bytes] = []
    i, n = 0, len(buf)
    while i < n:
        j_n = buf.find(b"\n", i)
        j_r = buf.find(b"\r", i)
        if j_r != -1 and (j_n == -1 or j_r < j_n):
            if j_r + 1 == n:
                break  # held: \r\n may be split across writes
            end = j_r + 2 if buf[j_r + 1:j_r + 2] == b"\n" else j_r + 1
        elif j_n != -1:
            end = j_n + 1
        else:
            break
        out.append(buf[i:end])
        i = end
    return out, buf[i:]


def line_start(path: Path, offset: int) -> tuple[int, int]:
    """The start of the line holding byte ``offset`` of ``path`` and the number of lines before it:
    ``(byte offset, lines)``. Following from a file's end starts at its last complete line's end, so a line
    being written when following began is read whole."""
    lines = 0
    last_end = 0
    pos = 0
    with open(path, "rb") as f:
        while pos < offset:
            chunk = f.read(min(CHUNK * 16, offset - pos))
            if not chunk:
                break
            # \r\n counts once: count \n, and \r not followed by \n (a \r at the chunk's end is looked at below).
            lines += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
            i = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
            if i >= 0:
                last_end = pos + i + 1
            pos += len(chunk)
    if last_end and last_end == offset:
        with open(path, "rb") as f:
            f.seek(last_end - 1)
            if f.read(2) == b"\r\n":  # the \r of a \r\n at the boundary: its \n belongs to the same line end
                return last_end + 1, lines
    return last_end, lines


def wait_for(path: Path, stop: Callable[[], bool], poll_s: float = 0.5) -> bool:
    """Wait until ``path`` exists and is not empty; False when ``stop`` said to stop first."""
    while True:
        ident = _ident(path)
        if ident is not None and ident[2] > 0:
            return True
        if stop():
            return False
        time.sleep(poll_s)
