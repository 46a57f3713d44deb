"""TensorBoard event files (``events.out.tfevents.*``), read with tensorboard's own event-file loader.

Needs the ``tensorboard`` package (``pip install 'trainhealth[logs]'``), imported only here, when
such a file is read. Every record is read (no reservoir sampling, unlike ``EventAccumulator``),
in file order; a directory is read as its event files in name (= creation time) order.

Scalar tags map to fields by common names — ``train/loss``, ``loss``, ``lm loss`` (Megatron),
``train/lm_loss`` (GPT-NeoX), ``reduced_train_loss`` (NeMo); ``train/grad_norm``, ``grad-norm``;
``train/learning_rate``, ``learning-rate``, ``lr``; ``iteration-time`` (seconds per iteration) …
(see :mod:`trainhealth.collectors.importers._table`) — or by ``mapping={"loss": "my/tag", …}``. The values
logged at one step (consecutive records with the same step) make one point; a step is a
training step when its loss, grad norm or learning rate is there. The records' wall times give
the seconds per step between points when no iteration-time tag is mapped.

A file cut short (a crash while writing, a copy taken mid-write, a partial download) is read up to
the last whole record, as TensorBoard does, and a warning on the ``trainhealth.collectors.importers``
logger names the file, the byte offset of the cut and the steps read before it. The records are
TFRecord frames (``uint64`` data length, ``uint32`` masked CRC-32C of the length, the data, ``uint32``
masked CRC-32C of the data): the reader stops where the file ends inside a frame, or where a frame
fails its CRC check. A CRC failure stops the file too, not only that record: TensorBoard's reader
(and TensorFlow's) stops there, so skipping it would show steps TensorBoard does not, and a length
that fails its check leaves no trustworthy place to resume from.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers import _table
from trainhealth.collectors.importers._common import MAX_STEP, STEP_RANGE, CumulativeTokens, Timeline, log
from trainhealth.exceptions import InputFormatError
from trainhealth.logpoint import LogPoint

CANDIDATES = dict(_table.COMMON)
MAGIC = b"brain.Event:"
#: The TFRecord frame around each event: ``uint64`` length + ``uint32`` CRC of it (the header), then after the
#: data its ``uint32`` CRC.
HEADER = 12
FRAME = HEADER + 4


def sniff(head: bytes) -> bool:
    """The first record of an event file is its ``file_version`` event: ``brain.Event:2``."""
    return MAGIC in head[:128]


def event_files(path: Path) -> list[Path]:
    """The event files to read for ``path`` (a file, or a run directory). Raises InputFormatError otherwise."""
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.glob("*tfevents*") if p.is_file())
    if not files:
        files = sorted(p for p in path.rglob("*tfevents*") if p.is_file())
        dirs = sorted({p.parent for p in files})
        if len(dirs) > 1:
            shown = ", ".join(str(d.relative_to(path)) for d in dirs[:10])
            raise InputFormatError(f"{path}: event files of {len(dirs)} runs ({shown}); replay one run directory")
    if not files:
        raise InputFormatError(f"{path}: a directory without TensorBoard event files (events.out.tfevents.*)")
    return files


def _loader() -> tuple[Any, Any, Any]:
    """tensorboard's event-file loader (counting the bytes it reads), ``tensor_util`` and ``masked_crc32c``."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader, RawEventFileLoader
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
        from tensorboard.util import tensor_util
    except ImportError:
        raise InputFormatError("reading TensorBoard event files needs the 'tensorboard' package: "
                               "pip install 'trainhealth[logs]'") from None

    class Counting(RawEventFileLoader):  # type: ignore[misc]
        """Counts the bytes of the whole records read: where the reader stopped, which its Load() does not say."""

        end = 0

        def Load(self) -> Iterator[bytes]:  # tensorboard's name
            for record in super().Load():
                self.end += len(record) + FRAME
                yield record

    # EventFileLoader's parsing and compat layers over the counted raw records (MRO: EventFileLoader,
    # LegacyEventFileLoader, Counting, RawEventFileLoader): the events are exactly what TensorBoard reads.
    class Loader(EventFileLoader, Counting):  # type: ignore[misc]
        pass

    return Loader, tensor_util, masked_crc32c


def _stop(f: Path, end: int, masked_crc32c: Any) -> tuple[str, str] | None:
    """Why reading ``f`` stopped at byte ``end`` (the end of its last whole record), or None at the file's end.

    ``(kind, text)``: kind ``"header"`` or ``"cut"`` (text "truncated at byte N (…)") when the file ends
    inside a record's header or after it, ``"corrupt"`` ("corrupt at byte N (…)") when the record there
    fails its CRC check. None also when a whole, valid record is there (the file grew while it was read),
    and for an unreadable file: the reader has already said why it stopped.
    """
    try:
        with open(f, "rb") as fh:
            size = fh.seek(0, 2)
            if end >= size:
                return None
            fh.seek(end)
            head = fh.read(HEADER)
            if len(head) < HEADER:
                return "header", (f"truncated at byte {end:,} (a record's {HEADER}-byte header cut off after "
                                  f"{len(head)} byte{'s' if len(head) != 1 else ''})")
            (n,) = struct.unpack("<Q", head[:8])
            if masked_crc32c(head[:8]) != struct.unpack("<I", head[8:])[0]:
                return "corrupt", f"corrupt at byte {end:,} (a record's length fails its CRC check)"
            total = n + FRAME
            if size - end < total:
                return "cut", f"truncated at byte {end:,} (a record of {total:,} bytes cut off after {size - end:,})"
            data = fh.read(n)
            (crc,) = struct.unpack("<I", fh.read(4))
    except OSError:
        return None
    if masked_crc32c(data) != crc:
        return "corrupt", f"corrupt at byte {end:,} (a record of {total:,} bytes fails its CRC check)"
    return None


def _scalars(files: list[Path], stops: dict[int, str]) -> Iterator[tuple[int, int, int, float, dict[str, float]]]:
    """(file number, record number, step, wall time, tag → value) per step group, across the event ``files``.

    ``stops`` gets, per file number, why its reading stopped before its end (see :func:`_stop`).
    """
    loader_cls, tensor_util, masked_crc32c = _loader()
    for n, f in enumerate(files):
        group: dict[str, float] = {}
        step = wall = rec = None
        records = 0
        loader = loader_cls(str(f))
        try:
            for i, ev in enumerate(loader.Load()):  # stops quietly at a cut or a failed CRC: _stop says which
                records += 1
                if not ev.HasField("summary"):
                    continue
                for v in ev.summary.value:
                    x = _value(v, tensor_util)
                    if x is None:
                        continue
                    if group and (ev.step != step or v.tag in group):
                        yield n, rec, step, wall, group  # type: ignore[misc]
                        group = {}
                    if not group:
                        step, wall, rec = ev.step, ev.wall_time, i
                    group[v.tag] = x
        except Exception as exc:  # protobuf decode errors and tensorboard's own reader errors
            raise InputFormatError(f"{f}: not a readable TensorBoard event file: {type(exc).__name__}: {exc}"
                                   ) from None
        stop = _stop(f, loader.end, masked_crc32c)
        if records == 0:  # a cut first record only when its length checks out: else more likely not an event file
            raise InputFormatError(f"{f}: {stop[1]}, before its first whole record" if stop and stop[0] == "cut"
                                   else f"{f}: no TensorBoard event records (empty, or not an event file)")
        if stop is not None:
            stops[n] = stop[1]
        if group:
            yield n, rec, step, wall, group  # type: ignore[misc]


def _cut_message(f: Path, why: str, steps: int, last: bool) -> str:
    """The warning for a file whose reading stopped early (``why`` from :func:`_stop`)."""
    if why.startswith("corrupt"):
        rest = "the rest of the file is not read (TensorBoard stops there too)"
    else:
        rest = "the rest of the run is missing" if last else "the rest of this file is missing"
    if not last:
        rest += "; the next event file is read"
    return f"{f}: {why}: read {steps:,} training step{'s' if steps != 1 else ''} before it; {rest}"


def _value(v: Any, tensor_util: Any) -> float | None:
    """A scalar summary value (simple_value or a one-element numeric tensor), else None (text, images, …)."""
    kind = v.WhichOneof("value")
    if kind == "simple_value":
        return float(v.simple_value)
    if kind != "tensor":
        return None
    try:
        arr = tensor_util.make_ndarray(v.tensor)
    except Exception:
        return None
    if arr.size != 1 or arr.dtype.kind not in "fiu":
        return None
    return float(arr.reshape(()).item())


def read(path: str | Path, mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint]:
    """Yield the training steps of a TensorBoard event file or run directory.

    ``source_line`` is the record number in its event file.

    Raises
    ------
    InputFormatError
        When tensorboard is not installed, a file is not an event file, a mapped tag is absent,
        or no loss / grad norm / learning-rate tag is found (the message lists the scalar tags).
    """
    path = Path(path)
    mapping = _table.check_mapping(mapping, "tensorboard")
    files = event_files(path)
    stops: dict[int, str] = {}
    groups = list(_scalars(files, stops))
    tags: dict[str, None] = {}
    for *_, g in groups:
        for t in g:
            tags.setdefault(t, None)
    try:
        cols = _table.resolve(path, list(tags), CANDIDATES, mapping, what="tag")
        if not any(f in cols for f in _table.METRICS):
            shown = ", ".join(repr(t) for t in list(tags)[:40]) or "none"
            raise InputFormatError(f"{path}: no loss, grad norm or learning-rate tag (looked for 'train/loss', "
                                   "'loss', 'lm loss', 'train/grad_norm', 'train/learning_rate', …); scalar tags: "
                                   f"{shown}; pass mapping={{'loss': TAG}}")
    except InputFormatError as exc:  # nothing to read: the cut, if any, is why
        if not stops:
            raise
        cuts = "; ".join(_cut_message(files[n], why, 0, n == len(files) - 1) for n, why in stops.items())
        raise InputFormatError(f"{exc} — {cuts}") from None
    steps = [g for g in groups if any(g[4].get(t) is not None for f, t in cols.items() if f in _table.METRICS)]
    for n, why in stops.items():  # said before the first point: a reader that stops early still hears it
        log.warning("%s", _cut_message(files[n], why, sum(g[0] == n for g in steps), n == len(files) - 1))
    clock = Timeline(elapsed=False)
    tokens_total = CumulativeTokens()
    for _, rec, step, wall, g in steps:
        vals = {f: g.get(t) for f, t in cols.items()}
        if abs(step) > MAX_STEP:  # an int64 step beyond what the timeline's floats hold exactly
            raise InputFormatError(f"{path}: record {rec} field 'step' is {STEP_RANGE}: {step}")
        per = vals.get("step_seconds")
        from_clock = clock.per_step(step, wall)
        if per is None:
            per = from_clock
        tokens = vals.get("tokens")
        cum = tokens_total.delta(vals.get("tokens_total"))
        yield LogPoint(step=step, loss=vals.get("loss"), grad_norm=vals.get("grad_norm"), lr=vals.get("lr"),
                       tokens=int(tokens) if tokens is not None and math.isfinite(tokens) else cum,
                       source_line=rec, step_seconds=per, skipped=_int(vals.get("skipped")),
                       consumed_samples=_int(vals.get("consumed_samples")))


def _int(x: float | None) -> int | None:
    return int(x) if x is not None and math.isfinite(x) else None
