"""Shared helpers of the importers: opening files, numbers, bad-line accounting, timelines."""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers.tail import following
from trainhealth.exceptions import InputFormatError
from trainhealth.logpoint import LogEvent
from trainhealth.wire import MAX_STEP

log = logging.getLogger("trainhealth.collectors.importers")

GZIP_MAGIC = b"\x1f\x8b"


def open_text(path: Path, newline: str | None = None) -> io.TextIOBase:
    """Open ``path`` as UTF-8 text (undecodable bytes replaced), gunzipping a gzip file transparently.

    A leading UTF-8 byte-order mark (Excel's "CSV UTF-8", PowerShell's ``Out-File``) is dropped: left
    in, it would glue itself to the first column name (``\ufeffstep``) or break the first JSON line.

    Raises :class:`InputFormatError` when it cannot be opened.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic == GZIP_MAGIC:
            return gzip.open(path, "rt", encoding="utf-8-sig", errors="replace", newline=newline)  # type: ignore[return-value]
        return open(path, encoding="utf-8-sig", errors="replace", newline=newline)
    except OSError as exc:
        raise InputFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line without its end)`` of a text log; read errors become InputFormatError."""
    return iter(Lines(path))


class Lines:
    """The lines of a text log, ``(1-based line number, line without its end)``, remembering a torn last line.

    Lines end at ``\\n``, ``\\r\\n`` or a lone ``\\r`` (universal newlines: a progress bar's carriage-return
    redraws are lines of their own). While the last line is handed out, :attr:`torn` is its number when it
    has no line end and is not blank — a file cut mid-write, an excerpt cut mid-line — else None.
    Read errors become :class:`InputFormatError`.

    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("step 1\\rstep 2\\nste"); f.close()
    >>> lines = Lines(Path(f.name))
    >>> list(lines), lines.torn, lines.torn_offset()
    ([(1, 'step 1'), (2, 'step 2'), (3, 'ste')], 3, 14)
    >>> os.unlink(f.name)
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.torn: int | None = None

    def __iter__(self) -> Iterator[tuple[int, str]]:
        self.torn = None
        follow = following.get()
        if follow is not None and follow.matches(self.path) and follow.begin_pass():
            # trainhealth follow: the reader's last pass waits for the lines still to be written (no torn line:
            # a line without its end is held until it has one).
            yield from follow.lines()
            return
        f = open_text(self.path)
        try:
            with f:
                for i, line in enumerate(f, 1):
                    if not line.endswith("\n") and line.strip():  # only the last line can lack its end
                        self.torn = i
                    yield i, line.rstrip("\r\n")
        except (OSError, EOFError) as exc:  # a truncated .gz, a vanished file
            raise InputFormatError(f"{self.path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None

    def torn_offset(self) -> int | None:
        """The byte offset (of the uncompressed text) where the torn last line starts; None if unreadable."""
        try:
            with open(self.path, "rb") as f:
                if f.read(2) != GZIP_MAGIC:
                    pos = f.seek(0, io.SEEK_END)
                    while pos > 0:  # backwards from the end to the last line end
                        n = min(1 << 16, pos)
                        pos -= n
                        f.seek(pos)
                        chunk = f.read(n)
                        i = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
                        if i >= 0:
                            return pos + i + 1
                    return 0
            start = pos = 0
            with gzip.open(self.path, "rb") as g:
                while chunk := g.read(1 << 20):
                    i = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
                    if i >= 0:
                        start = pos + i + 1
                    pos += len(chunk)
            return start
        except (OSError, EOFError, zlib.error):
            return None

    def where_torn(self) -> str:
        """``line N (from byte B)`` of the torn last line, for messages."""
        off = self.torn_offset()
        return f"line {self.torn}" + ("" if off is None else f" (from byte {off:,})")


#: Largest step accepted is :data:`trainhealth.wire.MAX_STEP`, the wire's own (2**53 - 1: the largest integer a
#: float holds exactly; the timeline computes in floats and JSON readers of the reports lose integers beyond it).
#: Largest rank accepted: rank ids index the per-rank columns (world size = highest rank + 1), so a
#: garbled rank must not make a run millions of ranks wide.
MAX_RANK = 2**20 - 1

# Why a value was refused: ``str()`` of the ValueError the converters raise, put into messages as
# "field 'loss' is <reason>: <value>".
NOT_A_NUMBER = "not a number"
NUMBER_RANGE = "out of range for a number (beyond 1.8e308)"
NOT_A_STEP = "not an integer step"
STEP_RANGE = f"out of range for a step (above {MAX_STEP:,})"
_REASONS = frozenset({NOT_A_NUMBER, NUMBER_RANGE, NOT_A_STEP, STEP_RANGE})


def reason(exc: BaseException, default: str = NOT_A_NUMBER) -> str:
    """The reason phrase of a converter's error (``default`` for any other ValueError/OverflowError)."""
    msg = str(exc)
    return msg if msg in _REASONS else default


class HugeNumber(str):
    """A JSON number no Python int or float holds (5,000 digits, ``1e999``), kept as its text.

    ``json`` refuses integers over 4,300 digits with a ValueError naming no line or field, and turns
    ``1e999`` into infinity, which the log never wrote; kept as text, the converters below refuse it
    with the file, line and field.
    """

    def __repr__(self) -> str:
        return str.__str__(self)


def _json_int(text: str) -> int | HugeNumber:
    try:
        return int(text)
    except ValueError:  # beyond sys.get_int_max_str_digits()
        return HugeNumber(text)


def _json_float(text: str) -> float | HugeNumber:
    x = float(text)
    return HugeNumber(text) if math.isinf(x) else x  # "Infinity" is a constant, not parsed here


def json_loads(text: str | bytes) -> Any:
    """``json.loads`` keeping out-of-range numbers as :class:`HugeNumber` (the converters refuse them).

    A flat object (a JSON-lines row) is parsed by the plain C decoder first and re-parsed with the
    guards only when that raised (an integer of over 4,300 digits) or gave an infinity (``1e999``, or
    a literal ``Infinity``, which the guarded parse keeps): the guards' per-number callbacks cost a
    third of the parse rate of a million-row log (``bench/analyze_1m.py``).
    """
    try:
        doc = json.loads(text)
    except ValueError:
        return _guarded_loads(text)  # raises again if the text is not JSON at all
    if type(doc) is dict:
        values = doc.values()
        kinds = set(map(type, values))  # C-level: no Python frame per value
        if dict not in kinds and list not in kinds:
            return _guarded_loads(text) if (math.inf in values or -math.inf in values) else doc
    return _guarded_loads(text)


def _guarded_loads(text: str | bytes) -> Any:
    return json.loads(text, parse_int=_json_int, parse_float=_json_float)


def guarded_decoder() -> json.JSONDecoder:
    """A decoder with :func:`json_loads`' guards, for ``raw_decode`` of one value at a time."""
    return json.JSONDecoder(parse_int=_json_int, parse_float=_json_float)


def show(v: Any, limit: int = 40) -> str:
    """``repr(v)`` for a one-line message, cut to ``limit`` characters (a 5,000-digit value must not flood it)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 4 * limit:
        return f"an integer of {len(str(v)) if v.bit_length() < 14000 else 'over 4,300'} digits"
    text = repr(v)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def _is_inf_text(s: str) -> bool:
    return s.lower().lstrip("+-") in ("inf", "infinity")


def to_float(v: Any) -> float | None:
    """A logged number: int/float as is, a numeric string parsed (``nan``/``inf`` kept); None/"" → None.

    Raises ValueError (``str()`` = :data:`NOT_A_NUMBER`) for anything else (booleans, non-numeric
    strings, containers), and (:data:`NUMBER_RANGE`) for a number written out in full that no float
    holds (a 400-digit integer, ``1e999``): the log did not say infinity.
    """
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError(NOT_A_NUMBER)
    if isinstance(v, int):
        try:
            return float(v)
        except OverflowError:
            raise ValueError(NUMBER_RANGE) from None
    if isinstance(v, float):
        return v
    if isinstance(v, str):
        s = v.strip()
        if not s:
            return None
        try:
            x = float(s)
        except ValueError:
            raise ValueError(NOT_A_NUMBER) from None
        if math.isinf(x) and not _is_inf_text(s):
            raise ValueError(NUMBER_RANGE)
        return x
    raise ValueError(NOT_A_NUMBER)


def check_step(n: int) -> int:
    """``n`` if it is within ±:data:`MAX_STEP`, else ValueError(:data:`STEP_RANGE`)."""
    if abs(n) > MAX_STEP:
        raise ValueError(STEP_RANGE)
    return n


def step_of(digits: str) -> int:
    """A step matched as a digit string by a text log's pattern; ValueError(:data:`STEP_RANGE`) when too large.

    The length is checked first: ``int()`` of over 4,300 digits raises a ValueError of its own.
    """
    if len(digits.lstrip("+-0")) > len(str(MAX_STEP)):
        raise ValueError(STEP_RANGE)
    return check_step(int(digits))


_INT_TEXT = re.compile(r"^[+-]?\d+$")


def to_step(v: Any) -> int:
    """A step number: an int, an integral float (``49.0``) or a string of one.

    Raises ValueError: :data:`NOT_A_STEP`, or :data:`STEP_RANGE` beyond ±:data:`MAX_STEP`.
    """
    if isinstance(v, bool):
        raise ValueError(NOT_A_STEP)
    if isinstance(v, int):
        return check_step(v)
    if isinstance(v, float):
        if math.isfinite(v) and v == int(v):
            return check_step(int(v))
        raise ValueError(NOT_A_STEP)
    if isinstance(v, str):
        s = v.strip()
        if _INT_TEXT.match(s):
            return step_of(s)
        try:
            f = float(s)
        except ValueError:
            raise ValueError(NOT_A_STEP) from None
        if math.isinf(f) and not _is_inf_text(s):
            raise ValueError(STEP_RANGE)
        if math.isfinite(f) and f == int(f):
            return check_step(int(f))
    raise ValueError(NOT_A_STEP)


_DAYS = re.compile(r"^\s*(-?\d+) days?, (.*)$")


def to_seconds(v: Any) -> float | None:
    """Elapsed time as seconds: a number, or ``str(timedelta)`` text (``5:39:46``, ``1 day, 2:03:04``).

    Raises ValueError as :func:`to_float` does.
    """
    if isinstance(v, str) and ":" in v:
        try:
            days = 0
            m = _DAYS.match(v)
            if m:
                days, v = int(m.group(1)), m.group(2)
            parts = v.strip().split(":")
            if len(parts) != 3:
                raise ValueError(NOT_A_NUMBER)
            h, mi, s = int(parts[0]), int(parts[1]), float(parts[2])
            total = days * 86400.0 + h * 3600.0 + mi * 60.0 + s
        except OverflowError:  # an hour count of 400 digits
            raise ValueError(NUMBER_RANGE) from None
        except ValueError as exc:
            raise ValueError(reason(exc)) from None
        if math.isinf(total):
            raise ValueError(NUMBER_RANGE)
        return total
    return to_float(v)


def finite_positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def _fold(name: str) -> str:
    return "".join(name.split()).lower()


#: ``BadLines.finish(last=…)`` not given: the reader does not say which line it read last.
_UNTRACKED = -1


class BadLines:
    """Counts malformed lines (or entries) of a log; one warning at the end, naming the first.

    ``place`` formats a line number (or entry index) into the message: ``"line {}: "`` for lines,
    ``"log_history[{}] "`` for the entries of a ``trainer_state.json``.
    ``finish(good)`` raises :class:`InputFormatError` for the first bad line when nothing good was read.

    With ``lines`` (the :class:`Lines` being read), a torn last line (no line end) that does not parse
    is not counted as malformed: it gets a warning of its own, "ends mid-line … truncated?", naming its
    line and byte offset — the file was cut, the lines before it stand. It does not parse when it was
    :meth:`add` ed, or, if the reader passes ``finish(good, last=…)`` (the line of the last record it
    read, None for none), when it is not that line. A torn last line that parses but is cut short — it
    lacks the last field of the complete record before it, see :meth:`cut_short` — is left out the same
    way, with a warning naming the missing fields and the step it would have booked: a record read
    up to the cut would be a step with missing values (a "missing" loss reads as a NaN one).
    """

    def __init__(self, path: Path, what: str, place: str = "line {}: ", unit: str = "line",
                 lines: Lines | None = None) -> None:
        self.path = path
        self.what = what
        self.place = place
        self.unit = unit
        self.lines = lines
        self.count = 0
        self.first: tuple[int, str] | None = None
        self.torn: tuple[int, str | None] | None = None
        self.cut: str | None = None  # the torn line parses but is cut short: why, for the warning
        self.whole: tuple[int, Sequence[str]] | None = None  # the last complete record: its line, its fields

    def add(self, line: int, reason: str) -> None:
        if self.lines is not None and line == self.lines.torn:
            self.torn = (line, reason)
            return
        self.count += 1
        if self.first is None:
            self.first = (line, reason)

    def cut_short(self, line: int, fields: Sequence[str], end: int | None = None, step: int | None = None) -> bool:
        """Whether a record that parsed is the torn last line cut short; if so it is held for :meth:`finish`'s warning.

        ``fields``: the record's field names in line order, as written (the message shows them with each run of
        whitespace made one space); ``line``/``end``: its first/last line (``end`` defaults to ``line``);
        ``step``: its step, for the message. Cut short means: its last line is the file's torn last line (no
        line end) and it lacks the field the complete record before it ended with (a log prints its fields in
        a fixed order and a cut removes the last ones; a field missing mid-line is what the log chose to print,
        as Megatron leaves out a NaN loss). Names are compared ignoring case and whitespace (a hard-wrapped
        excerpt loses or adds spaces). The first record has nothing to compare with, so it is never cut short;
        a cut inside the last field's value is not seen either (the digits left read as a number).
        Call it for every record that parsed, in file order; when it returns True, do not book the record.
        """
        end = line if end is None else end
        if self.lines is None or end != self.lines.torn:
            self.whole = (line, fields)
            return False
        have = {_fold(f) for f in fields}
        if self.whole is None or not self.whole[1] or _fold(self.whole[1][-1]) in have:
            return False
        ref, ref_fields = self.whole
        missing = ", ".join(repr(" ".join(f.split())) for f in ref_fields if _fold(f) not in have)
        self.torn = (end, None)
        self.cut = (f"is cut short (no {missing}, which line {ref} has); truncated? "
                    + ("Its record" if step is None else f"Step {step} on it") + " is incomplete and left out")
        return True

    def finish(self, good: int, last: int | None = _UNTRACKED) -> None:
        if (self.torn is None and last != _UNTRACKED and self.lines is not None and self.lines.torn is not None
                and last != self.lines.torn):
            self.torn = (self.lines.torn, None)
        if self.cut is not None and self.lines is not None:
            log.warning("%s: ends mid-line: %s has no line end and %s, the lines before it are read",
                        self.path, self.lines.where_torn(), self.cut)
        elif self.torn is not None and self.lines is not None:
            why = "" if self.torn[1] is None else f" ({self.torn[1]})"
            where = self.lines.where_torn()
            if good == 0 and self.first is None:
                raise InputFormatError(f"{self.path}: ends mid-line: {where} has no line end and does not "
                                       f"parse{why}; truncated? No {self.what} {self.unit} before it")
            log.warning("%s: ends mid-line: %s has no line end and does not parse%s; truncated? "
                        "It is left out, the lines before it are read", self.path, where, why)
        if self.first is None:
            if good == 0:
                raise InputFormatError(f"{self.path}: no {self.what} {self.unit}s found")
            return
        line, reason = self.first
        where = self.place.format(line)
        if good == 0:
            raise InputFormatError(f"{self.path}: {where}{reason}")
        log.warning("%s: skipped %d malformed %s %s(s); the first: %s%s",
                    self.path, self.count, self.what, self.unit, where, reason)


class Timeline:
    """Seconds per step between logged points, from a wall clock or an elapsed-since-start clock.

    ``wall`` readings give ``(t - t_prev) / (step - step_prev)`` (None for the first point);
    ``elapsed`` readings (seconds since the start of training) also give the first point
    ``elapsed / step``. A clock that goes back (a restart) or a step that does not advance gives None,
    unless ``resets``: a cumulative timer that restarts at 0 with the process (llm.c's and modded-nanogpt's
    ``train_time``), whose reading after going back is the time since the restart.

    >>> clock = Timeline(elapsed=False, resets=True)
    >>> [clock.per_step(s, t) for s, t in ((0, 0.3), (1, 24.3), (2, 1.5), (3, 1.75))]
    [None, 24.0, 1.5, 0.25]
    """

    def __init__(self, elapsed: bool, resets: bool = False) -> None:
        self.elapsed = elapsed
        self.resets = resets
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
        if dt < 0 and self.resets:
            dt = t
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


# --- lines several text logs share: progress bars, fp16 overflows, checkpoint saves ------------------------

#: A tqdm progress bar (``tqdm.format_meter``): ``[desc: ][ 9%|▉    | ]243/2724 [8:57:06<91:26:08, 132.61s/it[, k=v]]``,
#: or ``243it [8:57:06, 132.61s/it]`` without a total. Elapsed and remaining are ``[H:]MM:SS`` (hours may pass 24);
#: the rate is ``s/<unit>`` below one unit per second, else ``<unit>/s`` (``?`` before the second update).
TQDM = re.compile(
    r"(?<![\w.])(?P<n>\d+)(?:/(?P<total>\d+)|it)\s?\[(?P<elapsed>(?:\d+:)?\d{1,2}:\d\d)"
    r"(?:<(?P<remaining>(?:\d+:)?\d{1,2}:\d\d|\?))?"
    r"(?:,\s*(?P<rate>\d+(?:\.\d+)?[kMG]?|\?)\s?(?P<unit>s/[A-Za-z]+|[A-Za-z]+/s))?")
_BAR_PREFIX = re.compile(r"\s*\d{1,3}%\|[^|]*\|\s*$")
_SCALE = {"k": 1e3, "M": 1e6, "G": 1e9}


@dataclass(frozen=True)
class Bar:
    """One tqdm progress-bar line: counter ``n`` of ``total``, ``elapsed`` seconds since the bar started, the
    bar's own (smoothed) ``seconds_per_unit`` when it shows a rate, its ``unit`` (``it`` unless set) and the
    description before it (``""`` for the Hugging Face Trainer's bar; ``"Map"``, ``"Loading checkpoint shards:"``)."""

    n: str  # the digits (see :func:`step_of`)
    total: int | None
    elapsed: float
    seconds_per_unit: float | None
    unit: str
    desc: str
    started: bool  # the bar's first draw (``?`` rate at 00:00): nothing done yet


def _clock(text: str) -> float:
    parts = [int(x) for x in text.split(":")]
    return float(parts[-1] + 60 * parts[-2] + (3600 * parts[-3] if len(parts) == 3 else 0))


def parse_bar(line: str) -> Bar | None:
    """The tqdm bar on ``line`` (the first one), or None.

    >>> b = parse_bar("  9%|▉         | 243/2724 [8:59:24<91:26:08, 132.68s/it]")
    >>> (b.n, b.total, b.elapsed, b.seconds_per_unit, b.unit, b.desc)
    ('243', 2724, 32364.0, 132.68, 'it', '')
    >>> parse_bar("Map: 100%|██████████| 1000/1000 [00:01<00:00, 8000.00 examples/s]").unit
    'examples'
    >>> parse_bar("Steps:  50%|█████     | 5/10 [00:02<00:02,  2.50it/s, loss=0.5]").seconds_per_unit
    0.4
    """
    if "[" not in line:
        return None
    m = TQDM.search(line)
    if m is None:
        return None
    per, unit = None, "it"
    if m.group("unit") is not None:
        u = m.group("unit")
        inverse = u.startswith("s/")
        unit = u[2:] if inverse else u[:-2]
        rate = m.group("rate")
        if rate != "?":
            x = float(rate.rstrip("kMG")) * _SCALE.get(rate[-1], 1.0)
            per = x if inverse else (1.0 / x if x > 0 else None)
    desc = _BAR_PREFIX.sub("", line[:m.start()]).strip()
    total = m.group("total")
    elapsed = _clock(m.group("elapsed"))
    return Bar(m.group("n"), None if total is None else int(total) if len(total) < 20 else None, elapsed, per, unit,
               desc, elapsed == 0 and m.group("rate") == "?")


#: An fp16 loss-scale overflow that skipped the optimizer step: DeepSpeed's ``[deepspeed] OVERFLOW! Rank 0 Skipping
#: step. Attempted loss scale: 2048, reducing to 1024``, its older ``OVERFLOW! Skipping step. Attempted loss scale:
#: 4294967296`` and the fused optimizer's ``fp16 dynamic loss scale overflow! Skipping step``.
OVERFLOW = re.compile(r"overflow!\s*(?:rank\s+(\d+)\s+)?skipping step\.?(?:\s*attempted loss scale:\s*([\d.]+))?",
                      re.IGNORECASE)


class Overflows:
    """The overflow lines since the last :meth:`take`: the optimizer steps they skipped.

    Each rank that prints them counts on its own and the most any rank reports is kept (every rank
    of the older optimizers prints each overflow); one rank's overflows are told apart by their
    attempted loss scale, which halves at each one (the same line printed twice is one overflow).
    """

    def __init__(self) -> None:
        self.ranks: dict[int, tuple[set[str], list[int]]] = {}

    def add(self, text: str) -> bool:
        """Count ``text`` if it is an overflow line; True if it is."""
        if "verflow!" not in text and "VERFLOW!" not in text:
            return False
        m = OVERFLOW.search(text)
        if m is None:
            return False
        scales, plain = self.ranks.setdefault(int(m.group(1)) if m.group(1) else -1, (set(), [0]))
        if m.group(2):
            scales.add(m.group(2).rstrip("."))
        else:
            plain[0] += 1
        return True

    def take(self) -> int:
        """The skipped steps counted since the last call (0 for none), and start counting again."""
        n = max((len(scales) + plain[0] for scales, plain in self.ranks.values()), default=0)
        self.ranks.clear()
        return n


#: A line a training script prints when it saves a checkpoint: ``The checkpoint has been created.``,
#: ``Saving model checkpoint to out/checkpoint-500`` (Hugging Face), ``Saving checkpoint at 5000 iterations``
#: (mmengine), ``saved checkpoint``, ``Checkpoint saved to …``. Not ``Loading checkpoint shards``, not a setting.
CHECKPOINT_SAVE = re.compile(
    r"\b(?:(?:saving|saved)\s+(?:the\s+|a\s+|model\s+)*checkpoints?"
    r"|checkpoints?\b[^.\n]{0,20}?\b(?:has|have|was|were|is)\s+(?:been\s+)?(?:created|saved|written)"
    r"|checkpoints?\s+(?:created|saved|written))\b", re.IGNORECASE)


class Checkpoints:
    """``checkpoint_save`` :class:`LogEvent` s from a text log's save lines, at the last step logged before them.

    Consecutive save lines with no step logged between them are one save (``saving checkpoint …`` then
    ``successfully saved checkpoint …``).
    """

    def __init__(self) -> None:
        self.at: object = self  # the step of the last event (self: none yet)

    def event(self, text: str, lineno: int, step: int | None) -> LogEvent | None:
        """The event ``text`` reports, if it is a save line not already reported at ``step``."""
        if "heckpoint" not in text and "HECKPOINT" not in text:
            return None
        if CHECKPOINT_SAVE.search(text) is None or step == self.at:
            return None
        self.at = step
        return LogEvent("checkpoint_save", step=step, source_line=lineno)
