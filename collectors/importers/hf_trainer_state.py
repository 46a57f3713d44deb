"""Hugging Face Trainer ``trainer_state.json`` (its ``log_history``)."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from collectors.importers.base import LogPoint
from trainhealth.exceptions import InputFormatError


def _num(path: Path, i: int, entry: dict[str, Any], name: str) -> float | None:
    v = entry.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise InputFormatError(f"{path}: log_history[{i}] field {name!r} is not a number: {v!r}")
    try:
        return float(v)  # json gives NaN/Infinity as floats already; strings like "nan" too
    except ValueError:
        raise InputFormatError(f"{path}: log_history[{i}] field {name!r} is not a number: {v!r}") from None


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield the train and eval entries of a ``trainer_state.json`` in file order.

    Train entries (with ``loss``) give loss, ``grad_norm``, ``learning_rate`` and tokens as
    the difference of the cumulative ``num_tokens``/``num_input_tokens_seen``; eval entries
    (with ``eval_runtime``) give their runtime. Summary entries (``train_runtime``) are skipped.

    A gzip-compressed file is read transparently.

    Raises
    ------
    InputFormatError
        Naming the file, the entry index and the field, for invalid JSON, a missing
        ``log_history`` list, an entry without an integer ``step`` or a non-numeric metric.

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    >>> _ = f.write('{"log_history": [{"loss": 2.5, "grad_norm": NaN, "learning_rate": 1e-4, "step": 10},'
    ...             ' {"eval_loss": 2.4, "eval_runtime": 12.5, "step": 10}]}'); f.close()
    >>> [(p.step, p.loss, p.grad_norm, p.eval_seconds) for p in read(f.name)]
    [(10, 2.5, nan, None), (10, None, None, 12.5)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":  # gzip magic: trainer_state.json.gz
            raw = gzip.decompress(raw)
        doc = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise InputFormatError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except UnicodeDecodeError:
        raise InputFormatError(f"{path}: not a text JSON file (not UTF-8)") from None
    except (OSError, EOFError) as exc:
        raise InputFormatError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    history = doc.get("log_history") if isinstance(doc, dict) else None
    if not isinstance(history, list):
        raise InputFormatError(f"{path}: no 'log_history' list: not a Hugging Face trainer_state.json")
    seen_tokens: float | None = None
    for i, entry in enumerate(history):
        if not isinstance(entry, dict):
            raise InputFormatError(f"{path}: log_history[{i}] is not an object: {entry!r}")
        step = entry.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise InputFormatError(f"{path}: log_history[{i}] field 'step' is not an integer: {step!r}")
        if "loss" in entry:
            cum = _num(path, i, entry, "num_tokens")
            if cum is None:
                cum = _num(path, i, entry, "num_input_tokens_seen")
            tokens = None
            if cum is not None and math.isfinite(cum) and cum > 0:
                tokens = int(cum - (seen_tokens or 0.0))
                seen_tokens = cum
            yield LogPoint(step=step, loss=_num(path, i, entry, "loss"), grad_norm=_num(path, i, entry, "grad_norm"),
                           lr=_num(path, i, entry, "learning_rate"), tokens=tokens, source_line=i)
        elif "eval_runtime" in entry:
            yield LogPoint(step=step, eval_seconds=_num(path, i, entry, "eval_runtime"), source_line=i)
