"""All-reduce benchmark stdout: every rank prints ``<rank>:`` then `` duration: <s> sec`` per iteration.

The BigScience ``all_reduce_bench.py`` (``experiments/bandwidth/`` in bigscience-workshop/bigscience)
times ``TRIALS`` (5) ``dist.all_reduce`` calls of a 4 GB tensor on every rank and prints, per
call::

    <rank>:
     duration: 0.7080 sec
     algo throughput: 90399491760.9001 bps, 90.3995 Gbps
     busbw: 84.7495  Gbps

Iteration ``k`` of a rank is its ``k``-th duration (1-based): the log's steps are 1..TRIALS. A
point per (rank, iteration): ``rank``, ``step_seconds`` = the duration, and the same seconds as
the section ``trial`` (the only per-rank time the log has); ``host`` from NCCL's
``host:pid:tid [dev] NCCL INFO comm 0x… rank R nranks N … Init COMPLETE`` line for that rank,
when it was printed before (it is, with ``NCCL_DEBUG=INFO``).

The duration runs from just before the all-reduce to its end, so it includes **waiting for the
last rank to arrive**: the ranks that started early show the longest first iteration (warm-up
skew), not the slow ones.

Interleaving. The ranks' output is merged line by line, so two ranks' ``<rank>:`` lines can
precede their two duration lines (``0:``, ``11:``, ``duration: 1.0927``, ``duration: 1.8093``). A
duration goes to the **nearest** ``<rank>:`` line above it that has none yet. Which rank printed
which is not recoverable from the text; this rule keeps the pairs that are adjacent, and in the
one such case of ``allreduce_bench_16ranks.log`` it gives rank 0 (node ``r6i6n4``, whose other
ranks took 1.76–1.84 s) 1.8093 s and rank 11 (node ``r7i6n2``: 1.26–1.47 s) 1.0927 s, the
assignment that matches the nodes.

Malformed lines (a duration that is not a positive number, a duration with no ``<rank>:`` line
waiting, a ``<rank>:`` line never followed by a duration, a rank beyond NCCL's ``nranks``) are
skipped with one warning for all; the iteration of a malformed duration still counts, so the
rank's later iterations keep their numbers. A file with no good duration is an error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

from trainhealth.collectors.importers._common import MAX_RANK, BadLines, Lines, show
from trainhealth.logpoint import LogPoint

HEADER = re.compile(r"^\s*(\d+):\s*$")
DURATION_START = re.compile(r"^\s*duration:")
DURATION = re.compile(r"^\s*duration: (\S+) sec\s*$")
SNIFF = re.compile(r"^\s*duration: [0-9.]+ sec\s*$")
#: NCCL_DEBUG=INFO's communicator line: host, global rank, world size.
NCCL_RANK = re.compile(r"^([\w.-]+):\d+:\d+ \[\d+\] NCCL INFO comm \S+ rank (\d+) nranks (\d+)\b")
#: The section a trial's duration goes in: the rank's whole iteration, judged as its own time, so the rank detectors
#: weigh the ranks' arrival skew (the log has no other per-rank time). Not a communication section
#: (defaults.COMM_SECTIONS): in a training job a timed ``allreduce`` is the collective, left out of the rank's work.
SECTION = "trial"


def sniff_line(line: str) -> bool:
    return SNIFF.match(line) is not None


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield one point per rank and iteration, in the order the durations appear.

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("0:\\n duration: 1.5 sec\\n1:\\n duration: 0.9 sec\\n1:\\n0:\\n duration: 0.7 sec\\n"
    ...             " duration: 0.8 sec\\n"); f.close()
    >>> for p in read(f.name):
    ...     print(p.rank, p.step, p.step_seconds, p.sections)
    0 1 1.5 (('trial', 1.5),)
    1 1 0.9 (('trial', 0.9),)
    0 2 0.7 (('trial', 0.7),)
    1 2 0.8 (('trial', 0.8),)
    >>> os.unlink(f.name)

    Raises
    ------
    InputFormatError
        When the file cannot be read or has no good duration line (naming its first bad line).
    """
    path = Path(path)
    lines = Lines(path)
    bad = BadLines(path, "all-reduce benchmark duration", lines=lines)
    hosts: dict[int, str] = {}
    nranks: int | None = None
    iterations: dict[int, int] = {}
    waiting: list[tuple[int, int, int]] = []  # (rank, iteration, line) of '<rank>:' lines without a duration yet
    good = 0
    for lineno, text in lines:
        m = HEADER.match(text)
        if m is not None:
            if len(m.group(1)) > len(str(MAX_RANK)) or int(m.group(1)) > MAX_RANK:  # int() of 5,000 digits raises
                bad.add(lineno, f"rank {show(m.group(1))} is out of range (above {MAX_RANK:,})")
                continue
            rank = int(m.group(1))
            if nranks is not None and rank >= nranks:
                bad.add(lineno, f"rank {rank} is beyond NCCL's nranks {nranks}")
                continue
            it = iterations[rank] = iterations.get(rank, 0) + 1
            waiting.append((rank, it, lineno))
            continue
        if DURATION_START.match(text):
            if not waiting:
                bad.add(lineno, f"a 'duration:' line with no '<rank>:' line before it: {text.strip()[:80]!r}")
                continue
            rank, it, _ = waiting.pop()  # the nearest '<rank>:' line above (see the module doc)
            d = DURATION.match(text)
            try:
                seconds = float(d.group(1)) if d is not None else math.nan
            except ValueError:
                seconds = math.nan
            if not (math.isfinite(seconds) and seconds > 0):
                bad.add(lineno, f"field 'duration' of rank {rank} is not a positive number of seconds: "
                                f"{text.strip()[:80]!r}")
                continue
            good += 1
            yield LogPoint(step=it, step_seconds=seconds, source_line=lineno, rank=rank, host=hosts.get(rank),
                           sections=((SECTION, seconds),))
            continue
        m = NCCL_RANK.match(text)
        if m is not None and max(len(m.group(2)), len(m.group(3))) <= len(str(MAX_RANK)):  # else not NCCL's
            hosts[int(m.group(2))] = m.group(1)
            nranks = int(m.group(3))
    for rank, _, lineno in waiting:
        bad.add(lineno, f"rank {rank}'s '{rank}:' line has no 'duration:' line after it")
    bad.finish(good)
