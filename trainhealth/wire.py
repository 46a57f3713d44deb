"""Record types carried by the streams, and their stream-field encoding (standard library only).

Collectors encode; the detector service and the dashboard decode. Field names and units
are the documented wire format (``docs/architecture.md``); floats are written with
``repr`` so NaN and ±Inf travel faithfully as ``nan``/``inf``/``-inf``.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, replace
from itertools import islice, repeat
from typing import Annotated, Any, Literal, TypedDict, get_args

from trainhealth.defaults import COMM_SECTIONS, SAMPLE_INDICES_MAX
from trainhealth.text import show

#: Event kinds written by collectors into ``th:{run}:events``.
EventKind = Literal[
    "run_start",        # a rank's Monitor started: host, pid, inc, world_size, config
    "run_end",          # a rank's Monitor closed cleanly
    "checkpoint_save",  # step, seconds the save blocked training
    "checkpoint_load",  # step, seconds the restore blocked training
    "badput",           # a custom unproductive interval: name, seconds (e.g. evaluation)
    "collector_drops",  # count of records the collector dropped while Redis was away
    "resume",           # the same process went back to an earlier step (in-process rollback): from_step
    "collective_timeout",  # a rank's watchdog timed out a collective: op, seq, seconds waited (read from logs)
    "worker_restart",   # the launcher (torchelastic) restarted the worker group: restart_count (read from logs)
    "rank_exit",        # a rank's interpreter exited without close(): reason, error, exit_code, step, phase
    "eval",             # an evaluation's loss on a held-out set: step, name (the eval set), loss
]
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)

#: Where records are lost, as a ``collector_drops`` event names them: the collector's in-memory buffer was full (the
#: sender could not keep up with the training loop, or Redis was away and no spill took the rest), its on-disk
#: spill reached its bound or could not be written, the record could not be encoded; or, reported by the detector
#: service (``by`` = ``service``), Redis trimmed the records (the stream's retention bound) before it read them.
DROP_CAUSES = {"buffer": "in the full in-memory buffer", "spill": "at the on-disk spill (bound reached or write "
               "failed)", "unencodable": "not encodable",
               "trimmed": "trimmed from Redis by the retention bound before the service read them"}


def encode_value(v: Any) -> str | int | None:
    """Encode one event field for XADD: ints as is, floats with ``repr`` (keeps nan/inf), strings as is. The
    collectors send this; the offline pipeline builds the same events from a log.

    Other values (tensors, numpy scalars) go through ``float()``; None when that fails, whatever it raises.
    """
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return v
    try:
        return repr(float(v))
    except Exception:  # OverflowError, or whatever a foreign __float__ raises
        return None


SECTION_PREFIX = "sec."
GPU_PREFIX = "gpu."

_STEP_FLOATS = ("t", "dur", "loss", "grad_norm", "lr", "step_s", "loss_scale")
_STEP_INTS = ("tokens", "samples", "consumed_samples", "batch_index", "skipped", "loss_missing")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# -- sample indices: ints and ranges ----------------------------------------------------------------------
#: A compact list of sample indices: each item one index, or a run of them as ``[start, stop]`` (every index from
#: ``start`` to ``stop - 1``) or ``[start, stop, step]`` (Python's ``range(start, stop, step)``, ``step`` > 0).
Indices = list[int | list[int]]
#: The largest index: what a double, hence every JSON reader, holds exactly.
MAX_INDEX = 2**53 - 1


def encode_indices(values: Iterable[Any], limit: int = SAMPLE_INDICES_MAX,
                   pause: Callable[[], None] = lambda: None) -> Indices:
    """``values`` (sample indices, in the order consumed) as a compact list: each run of three or more equally spaced
    increasing indices as one range, ``[start, stop]`` for consecutive ones, ``[start, stop, step]`` for a stride
    (a sampler hands out contiguous or strided blocks: ``DistributedSampler`` without shuffling gives rank ``r``
    indices ``r, r + W, r + 2W``...); other indices as they are.

    The collector's sender thread calls it with its ``pause``, called between passes over the indices: each pass is
    one C call (``map``, ``min``, ``list.index``; a Python step only per run), so the training thread waits for the
    GIL at most one pass (over at most 16,384 indices: 0.5 ms measured on a loaded 2-core machine), not the whole
    encoding.

    Raises ``ValueError`` naming the position and value of one that is not an integer in 0..2**53-1 (numpy and torch
    integers are taken, bools are not), or when there are more than ``limit``.

    >>> encode_indices([0, 1, 2, 3, 7, 12, 20, 28, 36, 5])
    [[0, 4], 7, [12, 44, 8], 5]
    >>> encode_indices(range(1024, 2048))
    [[1024, 2048]]
    """
    if type(values) is range and values.step > 0:  # a sampler's slice: O(1)
        r = values
        n = len(r)
        if n > limit:
            raise ValueError(f"{n:,} sample indices, more than the {limit:,} a rank logs per step")
        if n and not (r.start >= 0 and r[-1] <= MAX_INDEX):
            raise ValueError(f"sample indices {r} are not all in 0..{MAX_INDEX}")
        if n >= 3:
            return [[r.start, r.start + n * r.step] if r.step == 1 else [r.start, r.start + n * r.step, r.step]]
        return list(r)
    vals = values.tolist() if hasattr(values, "tolist") else values  # a numpy array or CPU tensor, at C speed
    vals = list(islice(vals, limit + 1))
    if len(vals) > limit:
        raise ValueError(f"more than the {limit:,} sample indices a rank logs per step")
    if not _ONLY_INT.issuperset(map(type, vals)):
        vals = [_index(i, v) for i, v in enumerate(vals)]
    pause()
    n = len(vals)
    if n and (min(vals) < 0 or max(vals) > MAX_INDEX):
        i, v = next((i, v) for i, v in enumerate(vals) if not 0 <= v <= MAX_INDEX)
        raise ValueError(f"sample index {i} is {show(v)}, not in 0..{MAX_INDEX}")
    if n < 3:
        return list(vals)
    pause()
    d = list(map(operator.sub, vals[1:], vals[:-1]))
    pause()
    # ok[m]: vals[m], vals[m + 1], vals[m + 2] are equally spaced and increasing (a run goes on through m + 2).
    ok = list(map(operator.and_, map(operator.eq, d[1:], d[:-1]), map(operator.gt, d, repeat(0))))
    out: Indices = []
    i = 0
    while True:
        try:
            j = ok.index(True, i)
        except ValueError:
            out.extend(vals[i:])
            return out
        out.extend(vals[i:j])
        pause()
        try:
            k = ok.index(False, j)
        except ValueError:
            k = len(ok)
        step, last = d[j], vals[k + 1]
        out.append([vals[j], last + step] if step == 1 else [vals[j], last + step, step])
        i = k + 2


_ONLY_INT = frozenset({int})


def _index(i: int, v: Any) -> int:
    """``v``, the ``i``-th sample index, as an int (numpy and torch integers), else ``ValueError`` naming it."""
    if type(v) is int:
        return v
    try:
        if isinstance(v, bool):
            raise TypeError
        return v.__index__()
    except Exception:
        raise ValueError(f"sample index {i} is {show(v)}, not an integer") from None


def count_indices(enc: Any) -> int:
    """How many indices a compact list (:func:`encode_indices`) holds, without expanding it.

    Raises ``ValueError`` naming the item of one that is not an index in 0..2**53-1 or a ``[start, stop(, step)]``
    with ``start < stop`` and ``step > 0``.

    >>> count_indices([[0, 4], 7, [12, 44, 8], 5])
    10
    """
    if type(enc) is not list:
        raise ValueError(f"sample indices {show(enc)} are not a list")
    n = 0
    for i, item in enumerate(enc):
        if type(item) is int:
            if not 0 <= item <= MAX_INDEX:
                raise ValueError(f"sample indices item {i} is {show(item)}, not in 0..{MAX_INDEX}")
            n += 1
            continue
        if (type(item) is not list or len(item) not in (2, 3) or any(type(x) is not int for x in item)
                or not 0 <= item[0] < item[1] <= MAX_INDEX + 1 or (len(item) == 3 and item[2] < 1)):
            raise ValueError(f"sample indices item {i} is {show(item)}, not an index or a [start, stop(, step)] "
                             f"range with 0 <= start < stop <= {MAX_INDEX + 1} and step >= 1")
        n += len(range(*item))
    return n


def expand_indices(enc: Indices) -> list[int]:
    """Every index of a compact list (:func:`encode_indices`), in order.

    >>> expand_indices([[0, 4], 7, [12, 44, 8], 5])
    [0, 1, 2, 3, 7, 12, 20, 28, 36, 5]
    """
    out: list[int] = []
    for item in enc:
        if type(item) is int:
            out.append(item)
        else:
            out.extend(range(*item))
    return out


@dataclass(frozen=True)
class StepRecord:
    """One rank's record of one step (a record in a ``th:{run}:steps`` entry's ``recs`` list).

    Attributes
    ----------
    rank : int
        Global rank.
    step : int
        Training step (optimizer step) number.
    inc : float
        Incarnation: the unix time (s) the rank's Monitor started; a new value for a rank
        means that rank's process restarted.
    t : float
        Unix time (s) the step ended on this rank.
    dur : float | None
        Step wall time on this rank (s), when the step was timed.
    loss : float | None
        The loss as logged; NaN/Inf kept as is.
    grad_norm : float | None
        The global gradient norm as logged (before clipping); NaN/Inf kept as is.
    lr : float | None
        The learning rate as logged.
    tokens : int | None
        Tokens this rank processed in the step.
    samples : int | None
        Samples this rank processed in the step.
    consumed_samples : int | None
        Data position after the step: global samples consumed (as Megatron counts them).
    batch_index : int | None
        Data position after the step: the data loader's batch index.
    skipped : int | None
        1 when the optimizer skipped this step (fp16 loss-scale overflow).
    loss_missing : int | None
        1 when the job's log printed this step's line without its loss, the other metrics there, and
        nothing on the line accounts for it (a replayed log: Megatron-LM prints a loss only when it is
        finite, see :attr:`trainhealth.logpoint.LogPoint.loss_missing`); None otherwise.
    sections : dict[str, float]
        Seconds per named section (``data``, ``forward_backward``, ...) before the collective.
    gpu : dict[str, float]
        GPU seconds of sections timed with CUDA events (``section(name, cuda=True)``).
    step_s : float | None
        Seconds per step as the job itself measured it, when trainhealth did not time the step
        (``log_step(step_s=...)``; a replayed log's time per iteration).
    loss_scale : float | None
        The fp16 loss scaler's scale after the step (DeepSpeed's, Megatron's, ``torch.amp.GradScaler.get_scale()``):
        it halves at each overflow, so a falling scale tells why steps are skipped.
    sample_indices : list | None
        The sample (document) indices this rank consumed in the step, in order (``log_step(sample_indices=)``), as a
        compact list: each item an index, or a run of them as ``[start, stop]`` (``start`` to ``stop - 1``) or
        ``[start, stop, step]`` (Python's ``range``); at most ``defaults.SAMPLE_INDICES_MAX`` indices.
    """

    rank: int
    step: int
    inc: float
    t: float
    dur: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int | None = None
    samples: int | None = None
    consumed_samples: int | None = None
    batch_index: int | None = None
    skipped: int | None = None
    sections: dict[str, float] = field(default_factory=dict)
    gpu: dict[str, float] = field(default_factory=dict)
    step_s: float | None = None
    loss_missing: int | None = None
    loss_scale: float | None = None
    sample_indices: Indices | None = None

    @property
    def busy_s(self) -> float | None:
        """Seconds this rank spent in its own sections: GPU time of CUDA-timed sections where
        there is one (the CPU only launched those kernels), CPU time of the others; None when
        nothing was timed."""
        if not self.sections and not self.gpu:
            return None
        return sum(self.gpu.values()) + sum(v for k, v in self.sections.items() if k not in self.gpu)


# The service decodes ~100,000 records a second: a record of plain numbers (as the collectors send)
# gets its StepRecord built directly, without the frozen dataclass __init__ (one object.__setattr__
# per field); anything else takes the checked path below. Both build equal records.
_FAST_TYPES = {**dict.fromkeys(("rank", "step"), int), "inc": float, **dict.fromkeys(_STEP_FLOATS, float),
               **dict.fromkeys(_STEP_INTS, int)}
_REQUIRED = ("rank", "step", "inc", "t")
_FIELDS = StepRecord.__dataclass_fields__
_SCALARS = {n: f for n, f in _FIELDS.items() if n not in ("sections", "gpu")}
_FAST = not hasattr(StepRecord, "__post_init__") and set(_FAST_TYPES) <= set(_SCALARS) and all(
    f.default_factory is MISSING and (f.default is not MISSING or n in _REQUIRED) for n, f in _SCALARS.items())
_new, _set = object.__new__, object.__setattr__


def _template() -> dict[str, Any]:
    # Every field, in __init__ order, at its default (None for the required ones): an instance's own
    # attribute dict, so that its copies share the class's keys (a record takes 200 bytes, not 460).
    proto = _new(StepRecord)
    for n, f in _FIELDS.items():
        _set(proto, n, None if f.default is MISSING else f.default)
    return proto.__dict__


_TEMPLATE = _template() if _FAST else {}


def _plain_step_record(d: Mapping[str, Any]) -> StepRecord | None:
    """The record when every field has the exact type the checked path would convert it to, else None."""
    ns = _TEMPLATE.copy()
    sections: dict[str, float] = {}
    gpu: dict[str, float] = {}
    kinds = _FAST_TYPES
    for k, v in d.items():
        kind = kinds.get(k)
        if kind is None:
            if type(k) is not str:
                return None
            if k == "sample_indices":
                if type(v) is not list or not _indices_ok(v):
                    return None  # the checked path says why
                ns[k] = v
            elif k.startswith(SECTION_PREFIX):
                if type(v) is not float:
                    return None
                sections[k[len(SECTION_PREFIX):]] = v
            elif k.startswith(GPU_PREFIX):
                if type(v) is not float:
                    return None
                gpu[k[len(GPU_PREFIX):]] = v
        elif v is not None:
            if type(v) is not kind:
                return None
            ns[k] = v
    if ns["rank"] is None or ns["step"] is None or ns["inc"] is None or ns["t"] is None:
        return None
    ns["sections"], ns["gpu"] = sections, gpu
    rec = _new(StepRecord)
    _set(rec, "__dict__", ns)
    return rec


def step_record(d: Mapping[str, Any]) -> StepRecord:
    """Build a :class:`StepRecord` from one decoded record.

    Raises ``KeyError`` for a missing ``rank``/``step``/``inc``/``t`` and ``ValueError`` for a value of
    the wrong type, both naming the field (and the value); never ``TypeError``.
    """
    if _FAST:
        rec = _plain_step_record(d)
        if rec is not None:
            return rec
    for name in _REQUIRED:
        if d.get(name) is None:
            raise KeyError(f"field {name!r} is missing")
    kw: dict[str, Any] = {}
    for name in ("inc", *_STEP_FLOATS):
        v = d.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"field {name!r} has non-numeric value {show(v)}")
            kw[name] = _float(name, v)
    for name in ("rank", "step", *_STEP_INTS):
        v = d.get(name)
        if v is not None:
            if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
                raise ValueError(f"field {name!r} has non-numeric value {show(v)}")
            kw[name] = int(v)
    if not 0 <= kw["rank"] < MAX_RANKS:
        raise ValueError(f"field 'rank' is {show(kw['rank'])}, not in 0..{MAX_RANKS - 1}")
    if d.get("sample_indices") is not None:
        kw["sample_indices"] = _checked_indices(d["sample_indices"])
    sections: dict[str, float] = {}
    gpu: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(k, str) and k.startswith((SECTION_PREFIX, GPU_PREFIX)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"field {k!r} has non-numeric value {show(v)}")
            if k.startswith(SECTION_PREFIX):
                sections[k[len(SECTION_PREFIX):]] = _float(k, v)
            else:
                gpu[k[len(GPU_PREFIX):]] = _float(k, v)
    return StepRecord(sections=sections, gpu=gpu, **kw)




def _checked_indices(v: Any) -> Indices:
    """A record's ``sample_indices``, checked; ``ValueError`` naming the field and what is wrong."""
    try:
        n = count_indices(v)
    except ValueError as exc:
        raise ValueError(f"field 'sample_indices': {exc}") from None
    if n > SAMPLE_INDICES_MAX:
        raise ValueError(f"field 'sample_indices' holds {n:,} indices, more than {SAMPLE_INDICES_MAX:,}")
    return v


def _indices_ok(v: Any) -> bool:
    try:
        _checked_indices(v)
    except ValueError:
        return False
    return True


def _float(name: str, v: int | float) -> float:
    try:
        return float(v)
    except OverflowError:  # an integer beyond a double
        raise ValueError(f"field {name!r} has out-of-range value {show(v)}") from None


def _records(fields: Mapping[Any, Any]) -> list[dict[str, Any]]:
    """The decoded ``recs`` list of a ``th:{run}:steps`` entry; raises ``KeyError``/``ValueError``."""
    body = fields.get(b"recs")  # as Redis returns it (bytes keys); other key types are normalised below
    if body is None or "recs" in fields:
        d = {_s(k): v for k, v in fields.items()}
        if "recs" not in d:
            raise KeyError("entry has no 'recs' field")
        body = d["recs"]
    try:
        if isinstance(body, bytes) and body[:2] == b"[{":
            recs = _fast_loads(body)
            if recs is None:
                # What json.loads does with these bytes (detect_encoding finds UTF-8), minus its checks.
                recs = _DECODER.decode(body.decode("utf-8", "surrogatepass"))
        else:
            recs = json.loads(body)
    except (ValueError, TypeError):
        raise ValueError("field 'recs' is not a JSON list of records") from None
    if not isinstance(recs, list) or not all(map(isinstance, recs, repeat(dict))):
        raise ValueError("field 'recs' is not a JSON list of records")
    return recs


def _checked(i: int, d: Mapping[str, Any]) -> StepRecord:
    try:
        return step_record(d)
    except KeyError as exc:
        raise KeyError(f"record {i}: {exc.args[0]}") from None
    except ValueError as exc:
        raise ValueError(f"record {i}: {exc.args[0]}") from None


def decode_steps(fields: Mapping[Any, Any]) -> list[StepRecord]:
    """Decode a ``th:{run}:steps`` entry (one rank's batch: ``rank``, ``n``, ``recs`` JSON list).

    Raises ``KeyError``/``ValueError`` naming the record (its index in ``recs``) and the field for a
    malformed entry.

    >>> [r.step for r in decode_steps({b"rank": b"0", b"n": b"2",
    ...   b"recs": b'[{"rank":0,"step":5,"inc":1.0,"t":2.0,"loss":NaN},{"rank":0,"step":6,"inc":1.0,"t":3.0}]'})]
    [5, 6]
    >>> decode_steps({b"recs": b'[{"rank":0,"step":5,"inc":1.0,"t":2.0},{"rank":0,"step":6,"inc":1.0}]'})
    Traceback (most recent call last):
    ...
    KeyError: "record 1: field 't' is missing"
    """
    return [_checked(i, r) for i, r in enumerate(_records(fields))]


# -- the detector service's decode: aggregator rows -----------------------------------------------
#: The fields of a step record in the order a row (see :func:`record_row`) holds them.
ROW_FIELDS = ("loss", "grad_norm", "t", "dur", "tokens", "samples", "inc", "lr", "consumed_samples",
              "batch_index", "skipped", "step_s", "rank", "step", "loss_missing", "loss_scale")
#: Indices of a row's columns that are not in :data:`ROW_FIELDS`: the busy seconds (the rank's own sections:
#: ``busy_s`` without the communication sections), data-loading seconds, communication seconds (sections named in
#: :data:`~trainhealth.defaults.COMM_SECTIONS`), and the record the row was made from (a :class:`StepRecord`, or the
#: decoded plain dict).
ROW_BUSY, ROW_DATA, ROW_COMM, ROW_SOURCE = (len(ROW_FIELDS), len(ROW_FIELDS) + 1, len(ROW_FIELDS) + 2,
                                           len(ROW_FIELDS) + 3)
_ROW_RANK = ROW_FIELDS.index("rank")
ROW_STEP = ROW_FIELDS.index("step")
#: Ranks above this are refused as malformed (the largest jobs run ~100,000 GPUs; the aggregator
#: and the rank detectors keep per-rank arrays of world-size length).
MAX_RANKS = 1 << 20
#: Steps beyond +-this are refused as malformed: the largest integer a double (and a JSON reader)
#: holds exactly, and far inside a Redis stream id's 64 bits, which the aggregate stream's ids use.
MAX_STEP = 2**53 - 1
_row_fields = operator.attrgetter(*ROW_FIELDS)


def record_row(rec: StepRecord, data_sections: tuple[str, ...]) -> tuple:
    """One rank's record as the step aggregator keeps it: a tuple of the :data:`ROW_FIELDS` values, then
    the rank's busy seconds (``rec.busy_s`` without the communication sections), the seconds in the sections named
    ``data_sections`` (their sum in the record's section order), the seconds in communication sections
    (:data:`~trainhealth.defaults.COMM_SECTIONS`, GPU time where timed with CUDA events) and ``rec`` itself.

    >>> record_row(StepRecord(rank=1, step=5, inc=0.0, t=9.0, loss=2.0, sections={"data": 0.5, "fwd": 1.0}),
    ...            ("data",))[:2] + record_row(StepRecord(rank=1, step=5, inc=0.0, t=9.0), ())[12:19]
    (2.0, None, 1, 5, None, None, None, 0, 0)
    >>> record_row(StepRecord(rank=0, step=5, inc=0.0, t=9.0, sections={"fwd": 1.0, "allreduce": 0.25}), ())[16:19]
    (1.0, 0, 0.25)
    """
    sec = rec.sections
    # busy_s is sum(gpu) + sum(CPU-only sections): with no GPU times that is the sum of the sections.
    busy = sum(sec.values()) if sec and not rec.gpu else rec.busy_s
    comm = 0
    for k in COMM_SECTIONS:
        if k in sec:
            comm += rec.gpu.get(k, sec[k])
    if comm:
        busy -= comm
    data, found = 0, 0  # sum(v for k, v in sec.items() if k in data_sections): 0 + v for one such section
    for k in data_sections:
        if k in sec:
            data, found = 0 + sec[k], found + 1
    if found > 1:  # the sum in the sections' order, as the definition adds them
        data = sum([v for k, v in sec.items() if k in data_sections])
    return (*_row_fields(rec), busy, data, comm, rec)


# Layouts of plain records by data sections, then (keys in order, value types): a collector sends the
# same layout step after step, so a record is checked and its sections found by one dict look-up.
_LAYOUTS: dict[tuple[str, ...], dict[tuple, tuple[tuple[str, ...], ...] | None]] = {}
_NONE = type(None)


def _layout(keys: tuple, types: tuple, data_sections: tuple[str, ...]
            ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...], bool] | None:
    """``(CPU-only section keys, GPU keys, data section keys, communication keys, timed)`` of a plain record with
    these keys and value types — every field of the type ``_plain_step_record`` takes, the required ones present,
    at most two data sections (their sum is then the same in any order) — else None. The busy keys (CPU-only and
    GPU) leave the communication sections out; their keys are the GPU time where there is one, else the CPU's."""
    if not _FAST or not all(type(k) is str for k in keys):
        return None
    kinds = dict(zip(keys, types, strict=True))
    for name, kind in _FAST_TYPES.items():
        t = kinds.get(name, _NONE)
        if t is not kind and (t is not _NONE or name in _REQUIRED):
            return None
    sec = tuple(k for k in keys if k.startswith(SECTION_PREFIX))
    gpu = tuple(k for k in keys if k.startswith(GPU_PREFIX))
    if any(kinds[k] is not float for k in sec + gpu):
        return None
    on_gpu = {k[len(GPU_PREFIX):] for k in gpu}
    comm_names = {k[len(SECTION_PREFIX):] for k in sec} & set(COMM_SECTIONS)
    comm = tuple(GPU_PREFIX + n if n in on_gpu else SECTION_PREFIX + n for n in COMM_SECTIONS if n in comm_names)
    cpu = tuple(k for k in sec if k[len(SECTION_PREFIX):] not in on_gpu and k[len(SECTION_PREFIX):] not in comm_names)
    gpu_busy = tuple(k for k in gpu if k[len(GPU_PREFIX):] not in comm_names)
    data = tuple(k for k in sec if k[len(SECTION_PREFIX):] in data_sections)
    if len(data) > 2:
        return None
    return cpu, gpu_busy, data, comm, bool(sec or gpu)


def decode_step_rows(fields: Mapping[Any, Any], data_sections: tuple[str, ...],
                     on_bad: Callable[[int, Exception], None] | None = None) -> list[tuple]:
    """Decode a ``th:{run}:steps`` entry into rows (:func:`record_row`), as the detector service feeds them.

    The same rows as ``[record_row(r, data_sections) for r in decode_steps(fields)]`` but for the
    last column, which holds the decoded dict of a plain record (collectors send only those) instead
    of a :class:`StepRecord`: at ~100,000 records/s no object is built per record
    (``bench/service_throughput.py``). Once an entry of a rank had one layout throughout, that rank's next
    entries are decoded by msgspec into typed records of that layout (the last column then holds one), where
    that gives the same rows; :func:`row_record` gives the :class:`StepRecord` of either.

    Raises as :func:`decode_steps`; with ``on_bad``, a bad record is instead passed to
    ``on_bad(index, error)`` and left out, and the entry's other records are kept (one bad value
    must not cost a rank up to 1,000 steps). An entry that is not a list of records still raises.

    >>> rows = decode_step_rows({b"recs": b'[{"rank":3,"step":5,"inc":1.0,"t":2.0,"sec.data":0.25,"sec.fwd":0.5}]'},
    ...                         ("data",))
    >>> [r[:ROW_SOURCE] == record_row(s, ("data",))[:ROW_SOURCE]
    ...  for r, s in zip(rows, decode_steps({b"recs": b'[{"rank":3,"step":5,"inc":1.0,"t":2.0,"sec.data":0.25,'
    ...                                                  b'"sec.fwd":0.5}]'}))]
    [True]
    """
    body = fields.get(b"recs")
    if _TYPED_FOR and type(body) is bytes and body[:2] == b"[{" and "recs" not in fields:
        sender = (data_sections, fields.get(b"rank"))
        typed = _TYPED_FOR.get(sender)
        if typed is not None:
            rows = typed.rows(body)
            if rows is not None:
                return rows
        elif sender[0] in _TYPED_LAST:  # a rank not seen yet: most likely of the layout the others send
            rows = _TYPED_LAST[sender[0]].rows(body)
            if rows is not None:
                _TYPED_FOR[sender] = _TYPED_LAST[sender[0]]
                return rows
    recs = _records(fields)
    layouts = _LAYOUTS.get(data_sections)
    if layouts is None or len(layouts) > 10_000:  # bounded, whatever the senders do
        layouts = _LAYOUTS[data_sections] = {}
    rows = []
    first: tuple | None = None  # the layout key of every record so far, while they share one
    for i, d in enumerate(recs):
        key = (*d, *map(type, d.values()))  # the keys in order, then the types of their values
        if i == 0:
            first = key
        elif first is not None and key != first:
            first = None
        layout = layouts.get(key, False)
        if layout is False:
            half = len(key) // 2
            layout = layouts[key] = _layout(key[:half], key[half:], data_sections)
        if layout is not None and "sample_indices" in d and not _indices_ok(d["sample_indices"]):
            layout = None  # the checked path refuses the record, naming what is wrong
        if layout is None:
            try:
                row = record_row(_checked(i, d), data_sections)
            except (KeyError, ValueError, TypeError) as exc:
                if on_bad is None:
                    raise
                on_bad(i, exc)
                continue
        else:
            cpu, gpu, data, comm, timed = layout
            get = d.__getitem__
            if not timed:
                busy = None
            elif gpu:
                busy = sum(map(get, gpu)) + sum(map(get, cpu))
            else:
                busy = sum(map(get, cpu))
            row = (*map(d.get, ROW_FIELDS), busy, sum(map(get, data)), sum(map(get, comm)) if comm else 0, d)
        # Ranks index per-rank arrays in the aggregator and detectors: a wild one must not size them.
        # Steps become stream ids of th:{run}:agg: one beyond 64 bits would make every write of the run fail.
        if not 0 <= row[_ROW_RANK] < MAX_RANKS or not -MAX_STEP <= row[ROW_STEP] <= MAX_STEP:
            exc = (ValueError(f"record {i}: field 'rank' is {show(row[_ROW_RANK])}, not in 0..{MAX_RANKS - 1}")
                   if not 0 <= row[_ROW_RANK] < MAX_RANKS else
                   ValueError(f"record {i}: field 'step' is {show(row[ROW_STEP])}, beyond +-{MAX_STEP:,}"))
            if on_bad is None:
                raise exc
            on_bad(i, exc)
            continue
        rows.append(row)
    if type(body) is bytes and body[:2] == b"[{" and _fast_loads is not _none and (
            first is None or len(rows) < len(recs) or not _learn(first, data_sections, fields.get(b"rank"))):
        _TYPED_FOR[(data_sections, fields.get(b"rank"))] = _UNTYPED  # not the others' layout either
    return rows


# -- the detector service's decode of a sender's steady layout: typed records (msgspec) ---------------
# A sender writes the same layout entry after entry: once a whole entry of one rank decoded with one layout (the
# dict path above), that rank's next entries are decoded by msgspec straight into a Struct of that layout (kw-only,
# unknown fields refused, never tracked by the cyclic collector): no dict, no key tuple, no look-up per field, at
# ~4 times the speed. Every check of the dict path holds, or the entry takes the dict path: a field missing or
# unknown, a value of another type, a rank or step out of range, a token msgspec refuses (NaN) fail the decode.
# Two differences are ruled out before use: msgspec gives an int in a float field as a float (the dict path sends
# such a record through record_row, whose busy differs where communication sections are subtracted: layouts with
# those are not typed), and a Struct does not keep its keys' order, in which the busy sum adds the sections
# (checked on the entry's bytes where three or more are added: two floats add the same in either order).
_TYPED_FOR: dict[tuple[tuple[str, ...], Any], _Typed | _Untyped] = {}  # (data sections, entry's rank) -> decoder
_TYPED: dict[tuple, _Typed | None] = {}  # (data sections, section keys in order, other keys) -> decoder, or None
_TYPED_LAST: dict[tuple[str, ...], _Typed] = {}  # data sections -> the decoder learnt last (tried for a new rank)
#: A CPU or GPU section's key in a ``recs`` body, as JSON: in a body the typed decode took, every string is a key
#: (the values are numbers) and no key holds a quote (no field's name does), so each match is one whole key.
_SECTION_KEYS = {p: re.compile(b'"' + re.escape(p.encode()) + b'[^"]*"') for p in (SECTION_PREFIX, GPU_PREFIX)}
_OTHER = None | bool | int | float  # a field the rows do not use: any number (a string could hide a key)
#: Wire keys of a typed record's fields, by its class: ``(attribute, key)`` pairs (see :func:`row_record`).
_WIRE_KEYS: dict[type, tuple[tuple[str, str], ...]] = {}


class _Typed:
    """A layout's typed decoder: :meth:`rows` gives an entry's rows as ``decode_step_rows``' dict path does."""

    __slots__ = ("_build", "_decode", "_order")

    def __init__(self, struct: type, order: tuple[tuple[re.Pattern[bytes], list[bytes]], ...],
                 cpu: tuple[str, ...], gpu: tuple[str, ...], data: tuple[str, ...], timed: bool) -> None:
        from msgspec.json import Decoder

        self._decode = Decoder(list[struct]).decode  # type: ignore[valid-type]
        self._order = order

        # The rows as the dict path computes them (busy: GPU time only where some is not communication), by code
        # written for this layout (as dataclasses and namedtuple do): plain attribute reads run ~3 times faster
        # than getters. Every name in it is an identifier made here (the sections' are s0, s1, ...).
        def total(attrs: tuple[str, ...]) -> str:
            return f"sum(({''.join(f'r.{a}, ' for a in attrs)}))"

        busy = "None" if not timed else f"{total(gpu)} + {total(cpu)}" if gpu else total(cpu)
        fields = "".join(f"r.{n}, " for n in ROW_FIELDS)
        namespace: dict[str, Any] = {}
        exec(f"def rows(recs):\n    return [({fields}{busy}, {total(data)}, 0, r) for r in recs]\n", namespace)
        self._build = namespace["rows"]

    def rows(self, body: bytes) -> list[tuple] | None:
        """The entry's rows, or None when one of its records is not of this layout."""
        from msgspec import DecodeError  # ValidationError's base

        try:
            recs = self._decode(body)
        except DecodeError:
            return None
        for keys, order in self._order:
            if keys.findall(body) != order * len(recs):
                return None  # sections in another order (or a key written with escapes): the dict path adds them
        return self._build(recs)


class _Untyped:
    """A sender whose last entry the typed decode could not take: its next one takes the dict path at once."""

    @staticmethod
    def rows(body: bytes) -> None:
        return None


_UNTYPED = _Untyped()


def _learn(key: tuple, data_sections: tuple[str, ...], rank_field: Any) -> bool:
    """Decode the sender's (``rank_field``'s) next entries with the typed decoder of layout ``key`` (every record of
    its last entry had it; see :func:`decode_step_rows`), where msgspec is installed and the layout can be typed;
    whether it can."""
    half = len(key) // 2
    keys, types = key[:half], key[half:]
    layout = _layout(keys, types, data_sections)
    if layout is None or _fast_loads is _none:
        return False
    sections = tuple(k for k in keys if k.startswith((SECTION_PREFIX, GPU_PREFIX)))
    others = frozenset(k for k in keys if k not in _FAST_TYPES and k not in sections)
    if any(t not in (_NONE, bool, int, float) for k, t in zip(keys, types, strict=True) if k in others):
        return False  # e.g. sample_indices (a list): the typed records hold numbers only
    tkey = (data_sections, sections, others)
    typed = _TYPED.get(tkey, False)
    if typed is False:
        if len(_TYPED) > 1_000:  # bounded, whatever the senders do
            _TYPED.clear()
        typed = _TYPED[tkey] = _typed(layout, sections, others)
    if len(_TYPED_FOR) > 100_000:
        _TYPED_FOR.clear()
    if typed is None:
        return False
    _TYPED_FOR[(data_sections, rank_field)] = _TYPED_LAST[data_sections] = typed
    return True


def _typed(layout: tuple, sections: tuple[str, ...], others: frozenset[str]) -> _Typed | None:
    cpu, gpu, data, comm, timed = layout
    if comm or any('"' in k or "\\" in k for k in (*sections, *others)):
        return None  # see above: an int in a float field would give another busy; a quote would hide a key
    try:
        import msgspec
    except ImportError:
        return None
    attr = {k: f"s{i}" for i, k in enumerate(sections)} | {k: f"x{i}" for i, k in enumerate(sorted(others))}
    specs: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for name, kind in _FAST_TYPES.items():
        if name == "rank":
            specs.append((name, Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]))
        elif name == "step":
            specs.append((name, Annotated[int, msgspec.Meta(ge=-MAX_STEP, le=MAX_STEP)]))
        elif name in _REQUIRED:
            specs.append((name, kind))
        else:
            specs.append((name, kind | None, None))
    specs += [(attr[k], float) for k in sections]
    specs += [(attr[k], _OTHER, None) for k in sorted(others)]
    struct = msgspec.defstruct("TypedStepRecord", specs, kw_only=True, forbid_unknown_fields=True, gc=False,
                               rename={a: k for k, a in attr.items()})
    _WIRE_KEYS[struct] = (*((n, n) for n in _FAST_TYPES), *((a, k) for k, a in attr.items()))
    # Where three or more sections are added, their order changes the sum's last bit: each record's must be this.
    order = tuple((_SECTION_KEYS[prefix], [json.dumps(k).encode() for k in sections if k.startswith(prefix)])
                  for prefix, added in ((SECTION_PREFIX, cpu), (GPU_PREFIX, gpu)) if len(added) >= 3)
    return _Typed(struct, order, tuple(attr[k] for k in cpu), tuple(attr[k] for k in gpu),
                  tuple(attr[k] for k in data), timed)


def row_record(src: Any) -> StepRecord:
    """The :class:`StepRecord` of a row's record (its :data:`ROW_SOURCE` column: a :class:`StepRecord`, the decoded
    dict, or a typed record of :func:`decode_step_rows`)."""
    if isinstance(src, StepRecord):
        return src
    wire = _WIRE_KEYS.get(type(src))
    if wire is not None:
        src = {k: getattr(src, a) for a, k in wire}
    return step_record(src)


_DECODER = json.JSONDecoder()  # json.loads's own default decoder
#: The JSON parser of step batches: the standard library's, or msgspec's when it is installed.
JSON_DECODER = "json (standard library)"


def _fast_loads(body: bytes) -> list | None:
    """``body`` parsed by msgspec's JSON decoder (when installed), else None.

    It parses these batches 3-5x faster than the standard library (the JSON float parsing is half
    of the detector service's time) and to the same values: floats correctly rounded, ints of any
    size, the last of duplicate keys. What it refuses (NaN/Infinity tokens, numbers beyond a double,
    lone surrogates, invalid UTF-8) returns None, for the standard library to decide.
    """
    global _fast_loads, JSON_DECODER
    try:
        from msgspec import DecodeError
        from msgspec.json import Decoder
    except ImportError:
        _fast_loads = _none  # the module keeps to the standard library
        return None
    decode = Decoder().decode

    def loads(body: bytes) -> list | None:
        try:
            return decode(body)
        except DecodeError:
            return None

    _fast_loads, JSON_DECODER = loads, "msgspec"
    return loads(body)


def _none(body: bytes) -> None:
    return None


@dataclass(frozen=True)
class Event:
    """One entry of ``th:{run}:events``.

    ``kind`` is one of :data:`EVENT_KINDS`; ``t`` unix seconds; ``step`` and ``seconds``
    where the kind has them; everything else in ``extra``, as strings (numbers too: a ``rank_exit``'s
    ``exit_code`` 3 is ``extra["exit_code"] == "3"``).

    Attributes
    ----------
    kind : str
        What happened (:data:`EVENT_KINDS`; the fields of each kind: docs/architecture.md).
    rank : int
        Global rank that sent it.
    t : float
        Unix s it happened.
    inc : float
        Incarnation of the sending rank's Monitor (unix s it started).
    step : int | None
        The step it concerns, where the kind has one.
    seconds : float | None
        Seconds it blocked training (a checkpoint save or load, a custom badput interval, a collective's wait).
    extra : dict[str, str]
        The kind's other fields.
    """

    kind: EventKind
    rank: int
    t: float
    inc: float
    step: int | None = None
    seconds: float | None = None
    extra: dict[str, str] = field(default_factory=dict)


def decode_event(fields: Mapping[Any, Any]) -> Event:
    """Decode a ``th:{run}:events`` entry.

    Raises ``KeyError`` (a required field — ``kind``, ``rank``, ``t`` — missing) or ``ValueError``
    whose message names the field and value: a rank outside 0..MAX_RANKS-1, a step beyond
    +-MAX_STEP, a time that is not finite. ``seconds`` that are not a finite duration >= 0 read
    as unknown (None; the raw text stays in ``extra["seconds_invalid"]``): the event itself — a
    checkpoint of that step — still counts, but an infinite save must not swallow the ledger.
    """
    d = {_s(k): _s(v) for k, v in fields.items()}
    for name in ("kind", "rank", "t"):
        if name not in d:
            raise KeyError(f"field {name!r} is missing")
    step = d.pop("step", None)
    seconds = d.pop("seconds", None)
    rank = _event_num(d, "rank", d.pop("rank"), int)
    if not 0 <= rank < MAX_RANKS:
        raise ValueError(f"field 'rank' is {show(rank)}, not in 0..{MAX_RANKS - 1}")
    ev = Event(
        kind=d.pop("kind"),
        rank=rank,
        t=_event_num(d, "t", d.pop("t"), float),
        inc=_event_num(d, "inc", d.pop("inc", "0"), float),
        step=_event_num(d, "step", step, int) if step not in (None, "") else None,
        seconds=_seconds_of(seconds),
        extra=d,
    )
    if not (math.isfinite(ev.t) and math.isfinite(ev.inc)):
        raise ValueError(f"field {'t' if not math.isfinite(ev.t) else 'inc'!r} is not a finite time")
    if ev.step is not None and not -MAX_STEP <= ev.step <= MAX_STEP:
        raise ValueError(f"field 'step' is {show(ev.step)}, beyond +-{MAX_STEP:,}")
    if ev.seconds is not None and not 0 <= ev.seconds < math.inf:
        ev.extra["seconds_invalid"] = str(seconds)
        return replace(ev, seconds=None)
    return ev


def _seconds_of(value: str | None) -> float | None:
    if value in (None, ""):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan  # not a number: unknown, as an out-of-range duration


def _event_num(d: dict[str, str], name: str, value: str, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"field {name!r} has non-numeric value {show(value)}") from None


def finite(x: float | None) -> bool:
    """True when ``x`` is a real number (not None, NaN or ±Inf)."""
    return x is not None and math.isfinite(x)


# -- heartbeats: th:{run}:hb ----------------------------------------------------------------------------
#: What a rank is doing when its heartbeat is built: training, or inside a blocking phase (the hang detector waits
#: longer then).
Phase = Literal["train", "checkpoint_save", "checkpoint_load", "badput"]


class _CudaDevice(TypedDict):
    device: int
    total: int


class CudaMemory(_CudaDevice, total=False):
    """The CUDA caching allocator's counters of the rank's device (``torch.cuda.memory_stats``; each left out where
    the allocator does not report it).

    Attributes
    ----------
    device : int
        CUDA device index.
    total : int
        The device's memory, bytes.
    alloc : int
        Bytes allocated to tensors now.
    alloc_peak : int
        Most bytes allocated to tensors since the process started.
    reserved : int
        Bytes the caching allocator holds from the device now.
    reserved_peak : int
        Most bytes it held since the process started.
    retries : int
        Allocations retried after freeing the cache (count).
    ooms : int
        Out-of-memory errors the allocator raised (count).
    """

    alloc: int
    alloc_peak: int
    reserved: int
    reserved_peak: int
    retries: int
    ooms: int


class _HostMemory(TypedDict):
    rss: int
    rss_anon: int
    host_total: int


class MemorySample(_HostMemory, total=False):
    """A rank's memory when its heartbeat was built (``collectors/memory.py``): host RSS, and ``cuda`` or
    ``cuda_absent`` (exactly one of them).

    Attributes
    ----------
    rss : int
        Resident set size, bytes.
    rss_anon : int
        Resident bytes not backed by a file (what a leak grows).
    host_total : int
        The memory the process may use, bytes: the machine's, or its cgroup's limit when lower.
    cuda : CudaMemory
        The CUDA allocator's counters, where the job uses CUDA.
    cuda_absent : str
        Why there are none: ``torch not imported``, ``CUDA not initialised``, ``no CUDA device``, or
        ``CUDA memory unreadable: <error type>``.
    """

    cuda: CudaMemory
    cuda_absent: str


class GpuSample(TypedDict, total=False):
    """A rank's GPU health from NVML (``collectors/gpu_health.py``, the ``gpu`` extra): ``device`` and what the device
    reports (each left out where it does not), or only ``absent``.

    Attributes
    ----------
    device : int | str
        The NVML device: an index, or a UUID from ``CUDA_VISIBLE_DEVICES``.
    sm_clock_mhz : int
        SM clock now, MHz.
    sm_clock_max_mhz : int
        The SM clock's maximum, MHz.
    power_w : float
        Power draw, W.
    power_limit_w : float
        The enforced power limit, W.
    temp_c : int
        GPU temperature, °C.
    util_pct : int
        GPU utilisation, %.
    throttle_bits : int
        NVML's clock event reasons, as a bit mask.
    throttle : list[str]
        The same reasons in words (``thermal slowdown (hardware)``, ...).
    ecc_uncorrected : int
        Uncorrected ECC errors since the driver loaded (volatile count).
    absent : str
        Why there is no sample (``nvidia-ml-py not installed``, ``NVML unavailable: ...``, ``no GPU``, ...).
    """

    device: int | str
    sm_clock_mhz: int
    sm_clock_max_mhz: int
    power_w: float
    power_limit_w: float
    temp_c: int
    util_pct: int
    throttle_bits: int
    throttle: list[str]
    ecc_uncorrected: int
    absent: str


class Heartbeat(TypedDict):
    """A rank's heartbeat: the value of its field in ``th:{run}:hb`` (the rank), rewritten every 5 s by the collector's
    background thread, so a hung training thread shows as a fresh ``t`` with a stale ``step_t``, and a dead process
    as a stale ``t``.

    Attributes
    ----------
    t : float
        Unix s it was sent.
    step : int | None
        The last completed step (null before the first).
    step_t : float | None
        Unix s that step completed.
    phase : str
        ``train``, or the blocking phase the rank is in (``checkpoint_save``, ``checkpoint_load``, ``badput``).
    host : str
        The rank's host name.
    pid : int
        The rank's process id.
    inc : float
        Incarnation: unix s the rank's Monitor started (a new value: the process restarted).
    mem : MemorySample | None
        The rank's memory (null when it could not be sampled).
    gpu : GpuSample | None
        The rank's GPU health (null when it could not be sampled).
    """

    t: float
    step: int | None
    step_t: float | None
    phase: Phase
    host: str
    pid: int
    inc: float
    mem: MemorySample | None
    gpu: GpuSample | None


#: The per-rank lists of a ``th:{run}:mem`` entry (:func:`memory_entry`) and what each heartbeat value they hold.
MEMORY_FIELDS = {"alloc": ("cuda", "alloc"), "reserved": ("cuda", "reserved"), "rss": (None, "rss")}


def memory_entry(beats: Mapping[int, Mapping[str, Any]], t: float) -> dict[str, str] | None:
    """The fields of one ``th:{run}:mem`` entry (docs/architecture.md): every rank's newest memory sample (the ``mem``
    of its heartbeat, ``beats``: rank -> heartbeat) at unix time ``t``, None when no rank sent one.

    ``t`` (unix s), ``step`` (the newest step a heartbeat names, or ``-1``), ``n`` (ranks with a sample) and, for each
    of :data:`MEMORY_FIELDS`, a JSON list indexed by rank of MiB (integers: 1 MiB of 80 GiB is plenty to draw; a
    third of the bytes' text), ``null`` where the rank sent none: ``alloc`` and ``reserved`` are the CUDA caching
    allocator's, ``rss`` the host's resident set.

    >>> GiB = 2**30
    >>> beats = {0: {"step": 7, "mem": {"rss": 3 * GiB, "cuda": {"alloc": 71.2 * GiB, "reserved": 75 * GiB}}},
    ...          2: {"step": 8, "mem": {"rss": 2 * GiB, "cuda_absent": "no CUDA device"}}}
    >>> memory_entry(beats, 100.0)
    {'t': '100.0', 'step': '8', 'n': '2', 'alloc': '[72909,null,null]', 'reserved': '[76800,null,null]', \
'rss': '[3072,null,2048]'}
    """
    width = max(beats, default=-1) + 1
    lists: dict[str, list[int | None]] = {name: [None] * width for name in MEMORY_FIELDS}
    n, step = 0, -1
    for r, hb in beats.items():
        mem = hb.get("mem")
        if not isinstance(mem, Mapping):
            continue
        n += 1
        if isinstance(hb.get("step"), int):
            step = max(step, hb["step"])
        for name, (part, key) in MEMORY_FIELDS.items():
            src = mem.get(part) if part else mem
            v = src.get(key) if isinstance(src, Mapping) else None
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
                lists[name][r] = round(v / 2**20)
    if not n:
        return None
    return {"t": repr(float(t)), "step": str(step), "n": str(n),
            **{name: json.dumps(v, separators=(",", ":")) for name, v in lists.items()}}
