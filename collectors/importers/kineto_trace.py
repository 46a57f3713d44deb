"""PyTorch profiler (Kineto) traces: Chrome trace-event JSON (``.json`` or ``.json.gz``), one file per rank.

``torch.profiler.profile(schedule=..., on_trace_ready=tensorboard_trace_handler(dir))`` writes one
trace per rank and profiling window; ``prof.step()`` marks each training step as a complete event
(``"ph": "X"``) named ``ProfilerStep#N`` on the CPU thread that called it. A point per such slice:
step ``N``, ``step_seconds`` = its ``dur`` (microseconds in the Chrome trace-event format), and the
same seconds as the section ``profiler_step``: the only per-rank step time a trace gives without
interpreting its kernels. It is the whole step on the CPU, collectives' waits included. The GPU's
copies of the annotation (``"cat": "gpu_user_annotation"``, newer PyTorch) are not steps.

Rank: ``distributedInfo.rank`` (Kineto writes ``{"backend", "rank", "world_size"}`` when
``torch.distributed`` is initialised), else ``rank<N>`` / ``rank-<N>`` / ``rank_<N>`` in the file
name, else None (a one-rank trace). Traces of several ranks of one job are analysed or replayed
together as one run (``trainhealth analyze --one-run``, ``trainhealth replay --one-run``).

Errors (the whole document must parse, so nothing is skipped): not JSON, no ``traceEvents`` list, a
``distributedInfo`` rank or world size that is not an integer (or a rank not below the world size),
a ``ProfilerStep#`` slice whose step, ``ts`` or ``dur`` is not a number, the same step twice, or no
step slice at all; each names the file, the ``traceEvents`` index and the field.

References
----------
Chrome "Trace Event Format" (complete events ``ph: X``, ``ts`` / ``dur`` in microseconds);
``torch.profiler.profile.step`` (the ``ProfilerStep#N`` record_function); HolisticTraceAnalysis
(``hta.common.trace``) reads the same ``distributedInfo.rank``.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers._common import (
    GZIP_MAGIC,
    MAX_RANK,
    NUMBER_RANGE,
    json_loads,
    show,
    step_of,
    to_float,
)
from trainhealth.exceptions import InputFormatError
from trainhealth.logpoint import LogPoint

STEP = re.compile(r"^ProfilerStep#(\d+)$")
#: ``rank0``, ``rank-1``, ``rank_12`` in a file name (HTA's ``sampled_rank-0.json.gz``).
NAME_RANK = re.compile(r"(?:^|[^a-z])rank[-_]?(\d+)", re.IGNORECASE)
SECTION = "profiler_step"
#: Microseconds per second (the trace-event format's time unit).
US = 1e6


def load(path: Path) -> dict[str, Any]:
    """The trace document (gunzipped when gzip).

    Raises
    ------
    InputFormatError
        When it cannot be read, is not JSON, or is not an object with a ``traceEvents`` list.
    """
    try:
        raw = path.read_bytes()
        if raw[:2] == GZIP_MAGIC:
            raw = gzip.decompress(raw)
        doc = json_loads(raw.decode("utf-8-sig"))  # a BOM is dropped; huge numbers stay text
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # BadGzipFile is an OSError: first
        raise InputFormatError(f"{path}: a gzip file that cannot be decompressed: {exc}") from None
    except OSError as exc:
        raise InputFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InputFormatError(f"{path}: not UTF-8 JSON: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputFormatError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except RecursionError:
        raise InputFormatError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise InputFormatError(f"{path}: not a Chrome trace: no 'traceEvents' list")
    return doc


def rank_of(path: Path, doc: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(rank, world size)`` from ``distributedInfo``, else the rank from the file name (world size None).

    Raises
    ------
    InputFormatError
        For a ``distributedInfo`` rank / world size that is not a non-negative integer, or a rank
        not below the world size.
    """
    info = doc.get("distributedInfo")
    if isinstance(info, dict) and "rank" in info:
        rank, world = info.get("rank"), info.get("world_size")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InputFormatError(f"{path}: distributedInfo.rank is not a non-negative integer: {show(rank)}")
        if rank > MAX_RANK:  # rank ids index the per-rank columns: a garbled one must not make a huge run
            raise InputFormatError(f"{path}: distributedInfo.rank is out of range (above {MAX_RANK:,}): {show(rank)}")
        if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
            raise InputFormatError(f"{path}: distributedInfo.world_size is not a positive integer: {show(world)}")
        if world is not None and rank >= world:
            raise InputFormatError(f"{path}: distributedInfo.rank {rank} is not below its world_size {world}")
        return rank, world
    m = NAME_RANK.search(path.name)
    if m and (len(m.group(1)) > len(str(MAX_RANK)) or int(m.group(1)) > MAX_RANK):
        raise InputFormatError(f"{path}: the rank in the file name is out of range (above {MAX_RANK:,}): "
                               f"{show(m.group(1))}")
    return (int(m.group(1)) if m else None), None


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield one point per ``ProfilerStep#N`` slice on the CPU, in time order.

    Examples
    --------
    >>> import tempfile, os, json
    >>> d = tempfile.mkdtemp()
    >>> p = os.path.join(d, "trace.json")
    >>> ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 1, "tid": 1, "ts": 100,
    ...        "dur": 250000},
    ...       {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#7", "pid": 0, "tid": 7, "ts": 120,
    ...        "dur": 240000}]
    >>> _ = open(p, "w").write(json.dumps({"distributedInfo": {"rank": 3, "world_size": 8}, "traceEvents": ev}))
    >>> [(pt.rank, pt.step, pt.step_seconds, pt.sections, pt.source_line) for pt in read(p)]
    [(3, 7, 0.25, (('profiler_step', 0.25),), 0)]

    Raises
    ------
    InputFormatError
        See the module doc.
    """
    path = Path(path)
    doc = load(path)
    rank, _ = rank_of(path, doc)
    found: dict[int, tuple[float, float, int]] = {}  # step -> (ts, dur, traceEvents index)
    for i, ev in enumerate(doc["traceEvents"]):
        if not isinstance(ev, dict):
            continue
        name = ev.get("name")
        if not isinstance(name, str) or not name.startswith("ProfilerStep#"):
            continue
        if ev.get("ph") != "X" or ev.get("cat") == "gpu_user_annotation":
            continue
        where = f"{path}: traceEvents[{i}] ({name[:40]})"
        m = STEP.match(name)
        if m is None:
            raise InputFormatError(f"{where}: field 'name' has no step number after 'ProfilerStep#'")
        try:
            step = step_of(m.group(1))  # 400 digits would overflow the timeline
        except ValueError as exc:
            raise InputFormatError(f"{where}: field 'name' step is {exc}") from None
        vals = []
        for key in ("ts", "dur"):
            v = ev.get(key)
            try:
                x = to_float(v)
            except ValueError as exc:
                if str(exc) == NUMBER_RANGE:  # a 400-digit number: say so, not 'not a number'
                    raise InputFormatError(f"{where}: field {key!r} is {exc}: {show(v)}") from None
                x = None
            if x is None or not math.isfinite(x) or (key == "dur" and x < 0):
                what = "a non-negative number of microseconds" if key == "dur" else "a number of microseconds"
                raise InputFormatError(f"{where}: field {key!r} is not {what}: {show(v)}")
            vals.append(x)
        if step in found:
            raise InputFormatError(f"{where}: step {step} again (first at traceEvents[{found[step][2]}])")
        found[step] = (vals[0], vals[1], i)
    if not found:
        raise InputFormatError(f"{path}: no 'ProfilerStep#N' slices on a CPU thread (a trace recorded without "
                               "torch.profiler's step(), or not a PyTorch profiler trace)")
    for step, (_, dur, i) in sorted(found.items(), key=lambda kv: (kv[1][0], kv[0])):
        seconds = dur / US
        yield LogPoint(step=step, step_seconds=seconds, source_line=i, rank=rank, sections=((SECTION, seconds),))
