"""PyTorch ``ProcessGroupNCCL`` watchdog lines: collective timeouts and the progress of each rank.

When a collective does not finish within the process group's timeout (``init_process_group(timeout=…)``,
10 min for NCCL by default), the watchdog thread of every rank stuck in it logs, through glog
(``[E… ProcessGroupNCCL.cpp:N]``; under ``torchrun`` each line of rank N is prefixed ``[rankN]:``)::

    [rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation
    timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000)
    ran for 600060 milliseconds before timing out.
    [rank0]:[E321 02:07:08.465150152 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 0] Exception (either an error or
    timeout) detected by watchdog at work: 1580, last enqueued NCCL work: 1582, last completed NCCL work: 1579.

(each one line in the log). The forms of the PyTorch versions, all read:

- the work: ``WorkNCCL(OpType=…, [TensorShape=[…], ]Timeout(ms)=…)`` (1.8–1.9),
  ``WorkNCCL(SeqNum=…, OpType=…, [TensorShape=[…], ]Timeout(ms)=…)`` (1.10–1.13),
  ``WorkNCCL(SeqNum=…, OpType=…, NumelIn=…, NumelOut=…, Timeout(ms)=…)`` (2.x);
  ``Watchdog caught collective operation timeout:``, or ``Caught collective operation timeout:``
  (``TORCH_NCCL_BLOCKING_WAIT``);
- the rank's prefix: ``[Rank N]``, ``[PG 1 Rank N]``, ``[PG 0 (default_pg) Rank N]``,
  ``[PG ID 2 PG GUID 3 Rank N]``, ``[PG ID 0 PG GUID 0(default_pg) Rank N]``;
- the progress: ``Exception (either an error or timeout) detected by watchdog at work: W, last enqueued
  NCCL work: E, last completed NCCL work: C.``, ``Timeout at NCCL work: W, last enqueued …, last
  completed ….`` (``ProcessGroupNCCL.cpp`` ``watchdogHandler``), and ``Received a dump signal due to a
  collective timeout from rank R … Last enqueued NCCL work: E, last completed NCCL work: C.`` (a rank
  told by another one's timeout: its progress, no work of its own).

Each report is one :class:`~trainhealth.logpoint.LogEvent` of kind ``collective_timeout``, in
file order (the lines of one rank are not merged here: the detector,
:class:`trainhealth.detectors.collective_timeout.CollectiveTimeoutDetector`, merges them per rank, as it does
live):

- a timeout: ``seconds`` = ``ran for`` ms / 1000 (None when the line is cut before ``milliseconds``),
  fields ``op``, ``seq`` (when logged), ``timeout_s``, ``numel_in`` / ``numel_out`` or
  ``tensor_shape`` (when logged), ``pg`` (when the prefix names the process group);
- a progress report: fields ``seq`` (the work the watchdog failed on, when given), ``last_enqueued``,
  ``last_completed`` (-1: none yet), ``pg``; ``last_completed`` is left out when it exceeds
  ``last_enqueued`` (an uninitialised counter some versions print before the first completion).

``rank`` is the global rank of the ``[rankN]:`` prefix when there is one, else the ``Rank N`` of the
watchdog's own prefix — the rank *in that process group*, the global rank for the default group
(``group_rank`` is added when the two differ). The same report repeated on a rank (the exception
re-raised: ``Process group watchdog thread terminated with exception: [Rank 2] Watchdog caught …``,
``DistBackendError: …``) is yielded once. A line may hold several reports (log collectors that join
lines), and a timeout hard-wrapped over up to three lines is joined. An excerpt may start or end
mid-line: a fragment without the message's start is ignored; a timeout cut after its ``WorkNCCL(…)``
still counts (its wait unknown). A timeout or progress line whose rank, ``OpType`` or closing
parenthesis cannot be read is skipped, with one warning for all; a file with none good is an error.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from trainhealth.collectors.importers._common import MAX_RANK, BadLines, read_lines, show
from trainhealth.logpoint import LogEvent

KIND = "collective_timeout"
TIMEOUT = re.compile(r"(?:Watchdog caught|Caught) collective operation timeout:\s*")
WORK = re.compile(r"WorkNCCL\((?P<body>(?:[^()]|\(ms\))*)\)")
RAN_FOR = re.compile(r"\s*ran for (\d+) milliseconds")
#: A progress report of a timeout (not the periodic INFO ``NCCL Work update periodically: last enqueued …``).
PROGRESS = re.compile(
    r"(?:(?:Exception (?:\(either an error or timeout\) )?detected by watchdog at work|Timeout at NCCL work): "
    r"(?P<work>-?\d+), last|Last) enqueued NCCL work: (?P<enq>-?\d+), last completed NCCL work: (?P<comp>-?\d+)")
DUMP = "Received a dump signal"
#: The watchdog's own prefix just before a message: ``[Rank 0] ``, ``[PG ID 2 PG GUID 3 Rank 3] ``.
PREFIX = re.compile(r"\[(?:PG (?:ID )?(?P<pg>\d+)[^\]]*? )?Rank (?P<rank>\d+)\]\s*$")
#: torchrun's per-rank line prefix (``--log-line-prefix-template`` default / ``--tee``): ``[rank3]:``.
GLOBAL_RANK = re.compile(r"\[rank(\d+)\]:")
SNIFF = re.compile(r"collective operation timeout: WorkNCCL\(|(?:detected by watchdog at work|Timeout at NCCL "
                   r"work): -?\d+, last enqueued NCCL work: ")
KEYS = {"SeqNum": "seq", "OpType": "op", "NumelIn": "numel_in", "NumelOut": "numel_out", "Timeout(ms)": "timeout_ms"}
BODY_KEY = re.compile(r"(SeqNum|OpType|NumelIn|NumelOut|Timeout\(ms\))=([^,\s]+)")
BODY_START = re.compile(r"(?:SeqNum|OpType|NumelIn|NumelOut|Timeout\(ms\)|TensorShape)=")
SHAPE = re.compile(r"TensorShape=(\[[^\]]*\])")
INT = re.compile(r"-?\d{1,19}")
#: Physical lines a hard-wrapped timeout may span.
MAX_WRAP = 3


def sniff_line(line: str) -> bool:
    return SNIFF.search(line) is not None


def _ranks(line: str, start: int) -> tuple[int | None, int | None, str | None]:
    """``(global rank, rank in the process group, pg)`` of the message starting at ``line[start]``."""
    m = PREFIX.search(line, 0, start)
    group_rank = int(m.group("rank")) if m is not None and len(m.group("rank")) <= 7 else None
    pg = m.group("pg") if m is not None else None
    prefixes = [g for g in GLOBAL_RANK.finditer(line, 0, start) if len(g.group(1)) <= 7]
    rank = int(prefixes[-1].group(1)) if prefixes else group_rank
    return (rank if rank is None or rank <= MAX_RANK else None), group_rank, pg


def _wanting(text: str) -> str | None:
    """What the last timeout report of ``text`` lacks when it was hard-wrapped at the line's end: ``work``
    (the line ends after ``timeout:``), ``body`` (inside ``WorkNCCL(…``), ``ran`` (no ``ran for`` yet); else None."""
    starts = list(TIMEOUT.finditer(text))
    if not starts:
        return None
    m = starts[-1]
    rest = text[m.end():].rstrip()
    if not rest:
        return "work"
    work = WORK.match(rest)
    if rest.startswith("WorkNCCL(") and work is None:
        return "body"
    return "ran" if work is not None and not rest[work.end():].strip() else None


def _continues(wanting: str, line: str) -> bool:
    """Whether ``line`` (stripped) continues a timeout report wanting ``wanting``."""
    if wanting == "work":
        return line.startswith("WorkNCCL(")
    if wanting == "body":
        return BODY_START.match(line) is not None
    return line.startswith("ran for ")


def _joined(path: Path) -> Iterator[tuple[int, str]]:
    """``(first line number, text)``: the lines of the log, a timeout hard-wrapped over up to :data:`MAX_WRAP`
    lines joined into one."""
    pending: tuple[int, str, int, str] | None = None  # (first line, text so far, lines joined, wanting)
    for lineno, text in read_lines(path):
        if pending is not None:
            first, acc, n, wanting = pending
            pending = None
            cont = text.strip()
            if _continues(wanting, cont):
                acc = acc.rstrip() + ("" if wanting == "body" and acc.endswith("(") else " ") + cont
                more = _wanting(acc)
                if more is not None and n + 1 < MAX_WRAP:
                    pending = (first, acc, n + 1, more)
                else:
                    yield first, acc
                continue
            yield first, acc
        wanting = _wanting(text)
        if wanting is not None:
            pending = (lineno, text, 1, wanting)
            continue
        yield lineno, text
    if pending is not None:
        yield pending[0], pending[1]


def read(path: str | Path) -> Iterator[LogEvent]:
    """Yield one ``collective_timeout`` event per report (timeout or progress), in file order.

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("[rank4]:[E321 02:07:08.414 ProcessGroupNCCL.cpp:607] [Rank 4] Watchdog caught collective "
    ...             "operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=8, NumelOut=8, "
    ...             "Timeout(ms)=600000) ran for 600067 milliseconds before timing out.\\n"
    ...             "[rank3]:[E321 02:07:08.465 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 3] Exception (either an error "
    ...             "or timeout) detected by watchdog at work: 1580, last enqueued NCCL work: 1582, last completed "
    ...             "NCCL work: 1579.\\n"); f.close()
    >>> for ev in read(f.name):
    ...     print(ev.kind, ev.rank, ev.seconds, ev.fields, ev.source_line)
    collective_timeout 4 600.067 (('op', 'ALLREDUCE'), ('seq', 1580), ('timeout_s', 600.0), ('numel_in', 8), \
('numel_out', 8)) 1
    collective_timeout 3 None (('seq', 1580), ('last_enqueued', 1582), ('last_completed', 1579), ('pg', '1')) 2
    >>> os.unlink(f.name)

    Raises
    ------
    InputFormatError
        When the file cannot be read or holds no readable report (naming its first bad line).
    """
    path = Path(path)
    bad = BadLines(path, "NCCL watchdog timeout")
    seen: set[tuple] = set()
    good = 0
    for lineno, text in _joined(path):
        found = [(m.start(), *_timeout(text, m, lineno)) for m in TIMEOUT.finditer(text)]
        found += [(m.start(), *_progress(text, m, lineno)) for m in PROGRESS.finditer(text)]
        for _, ev, why in sorted(found, key=lambda f: f[0]):
            if ev is None:
                bad.add(lineno, why)
                continue
            key = (ev.rank, ev.seconds, ev.fields)
            if key in seen:  # the same report again on that rank: the exception re-raised and logged
                continue
            seen.add(key)
            good += 1
            yield ev
    bad.finish(good)


def _timeout(text: str, m: re.Match[str], lineno: int) -> tuple[LogEvent | None, str]:
    rank, group_rank, pg = _ranks(text, m.start())
    if rank is None:
        return None, f"a collective timeout with no rank before it: {show(text[m.start():], 100)}"
    work = WORK.match(text, m.end())
    if work is None:
        return None, f"rank {rank}'s collective timeout has no complete WorkNCCL(...): {show(text[m.end():], 100)}"
    vals: dict[str, str] = {}
    for key, value in BODY_KEY.findall(work.group("body")):
        vals.setdefault(KEYS[key], value)
    op, timeout_ms = vals.get("op", ""), vals.get("timeout_ms", "")
    if not re.fullmatch(r"\w+", op) or not INT.fullmatch(timeout_ms):
        return None, f"rank {rank}'s WorkNCCL(...) has no OpType or Timeout(ms): {show(work.group(0), 80)}"
    ints = {k: int(v) for k, v in vals.items() if k in ("seq", "numel_in", "numel_out") and INT.fullmatch(v)}
    fields: list[tuple[str, object]] = [("op", op)]
    if "seq" in ints:
        fields.append(("seq", ints["seq"]))
    fields.append(("timeout_s", int(timeout_ms) / 1000.0))
    fields += [(k, ints[k]) for k in ("numel_in", "numel_out") if k in ints]
    shape = SHAPE.search(work.group("body"))
    if shape is not None:
        fields.append(("tensor_shape", shape.group(1)))
    _extra(fields, rank, group_rank, pg)
    ran = RAN_FOR.match(text, work.end())
    seconds = int(ran.group(1)) / 1000.0 if ran is not None and len(ran.group(1)) <= 15 else None
    return LogEvent(KIND, rank=rank, seconds=seconds, fields=tuple(fields), source_line=lineno), ""


def _progress(text: str, m: re.Match[str], lineno: int) -> tuple[LogEvent | None, str]:
    dump = text.rfind(DUMP, 0, m.start()) if m.group("work") is None else -1
    rank, group_rank, pg = _ranks(text, dump if dump >= 0 else m.start())
    if rank is None:
        return None, f"a watchdog progress report with no rank before it: {show(m.group(0), 100)}"
    work, enq, comp = (None if g is None or not INT.fullmatch(g) else int(g) for g in m.group("work", "enq", "comp"))
    if enq is None:
        return None, f"rank {rank}'s last enqueued work is not a counter: {show(m.group('enq'), 40)}"
    fields: list[tuple[str, object]] = [] if work is None else [("seq", work)]
    fields.append(("last_enqueued", enq))
    if comp is not None and comp <= enq:  # else an uninitialised counter (before the first completion)
        fields.append(("last_completed", comp))
    _extra(fields, rank, group_rank, pg)
    return LogEvent(KIND, rank=rank, fields=tuple(fields), source_line=lineno), ""


def _extra(fields: list[tuple[str, object]], rank: int, group_rank: int | None, pg: str | None) -> None:
    if pg is not None:
        fields.append(("pg", pg))
    if group_rank is not None and group_rank != rank:
        fields.append(("group_rank", group_rank))
