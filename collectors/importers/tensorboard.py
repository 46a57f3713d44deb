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
the seconds per step between points when no iteration-time tag is mapped. A truncated last
record (a crash while writing) ends the file, as in TensorBoard.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers import _table
from trainhealth.collectors.importers._common import MAX_STEP, STEP_RANGE, CumulativeTokens, Timeline
from trainhealth.exceptions import InputFormatError
from trainhealth.logpoint import LogPoint

CANDIDATES = dict(_table.COMMON)
MAGIC = b"brain.Event:"


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


def _loader() -> tuple[Any, Any]:
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError:
        raise InputFormatError("reading TensorBoard event files needs the 'tensorboard' package: "
                               "pip install 'trainhealth[logs]'") from None
    return EventFileLoader, tensor_util


def _scalars(path: Path) -> Iterator[tuple[int, int, float, dict[str, float]]]:
    """(record number, step, wall time, tag → value) per step group, across the event files of ``path``."""
    loader_cls, tensor_util = _loader()
    for f in event_files(path):
        group: dict[str, float] = {}
        step = wall = rec = None
        records = 0
        try:
            for i, ev in enumerate(loader_cls(str(f)).Load()):  # a torn last record ends the file quietly
                records += 1
                if not ev.HasField("summary"):
                    continue
                for v in ev.summary.value:
                    x = _value(v, tensor_util)
                    if x is None:
                        continue
                    if group and (ev.step != step or v.tag in group):
                        yield rec, step, wall, group  # type: ignore[misc]
                        group = {}
                    if not group:
                        step, wall, rec = ev.step, ev.wall_time, i
                    group[v.tag] = x
        except Exception as exc:  # protobuf decode errors and tensorboard's own reader errors
            raise InputFormatError(f"{f}: not a readable TensorBoard event file: {type(exc).__name__}: {exc}"
                                   ) from None
        if records == 0:
            raise InputFormatError(f"{f}: no TensorBoard event records (empty, or not an event file)")
        if group:
            yield rec, step, wall, group  # type: ignore[misc]


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
    groups = list(_scalars(path))
    tags: dict[str, None] = {}
    for *_, g in groups:
        for t in g:
            tags.setdefault(t, None)
    cols = _table.resolve(path, list(tags), CANDIDATES, mapping, what="tag")
    if not any(f in cols for f in _table.METRICS):
        shown = ", ".join(repr(t) for t in list(tags)[:40]) or "none"
        raise InputFormatError(f"{path}: no loss, grad norm or learning-rate tag (looked for 'train/loss', 'loss', "
                               f"'lm loss', 'train/grad_norm', 'train/learning_rate', …); scalar tags: {shown}; "
                               "pass mapping={'loss': TAG}")
    clock = Timeline(elapsed=False)
    tokens_total = CumulativeTokens()
    for rec, step, wall, g in groups:
        vals = {f: g.get(t) for f, t in cols.items()}
        if all(vals.get(f) is None for f in _table.METRICS):
            continue
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
