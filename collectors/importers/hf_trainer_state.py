"""Hugging Face Trainer ``trainer_state.json`` (its ``log_history``)."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers._common import (
    NOT_A_NUMBER,
    STEP_RANGE,
    BadLines,
    HugeNumber,
    check_step,
    json_loads,
    reason,
    show,
    to_float,
)
from trainhealth.exceptions import InputFormatError
from trainhealth.logpoint import LogPoint


class _BadEntry(ValueError):
    """One ``log_history`` entry that cannot be read: its message is the reason (field and value)."""


def _num(entry: dict[str, Any], name: str) -> float | None:
    v = entry.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise _BadEntry(f"field {name!r} is {NOT_A_NUMBER}: {show(v)}")
    try:
        return to_float(v)  # json gives NaN/Infinity as floats already; strings like "nan" too
    except ValueError as exc:
        raise _BadEntry(f"field {name!r} is {reason(exc)}: {show(v)}") from None


def _step(entry: dict[str, Any]) -> int:
    step = entry.get("step")
    if isinstance(step, HugeNumber):
        raise _BadEntry(f"field 'step' is {STEP_RANGE}: {show(step)}")
    if not isinstance(step, int) or isinstance(step, bool):
        raise _BadEntry(f"field 'step' is not an integer: {show(step)}")
    try:
        return check_step(step)
    except ValueError:
        raise _BadEntry(f"field 'step' is {STEP_RANGE}: {show(step)}") from None


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield the train and eval entries of a ``trainer_state.json`` in file order.

    Train entries (with ``loss``) give loss, ``grad_norm``, ``learning_rate`` and tokens as
    the difference of the cumulative ``num_tokens``/``num_input_tokens_seen``; eval entries
    (with ``eval_runtime``) give their runtime. Summary entries (``train_runtime``) are skipped.

    An entry that cannot be read (a field that is not a number, or out of range; a step that is
    not an integer) is skipped, with one warning for all of them naming the first: the entries
    are independent records, each with its own ``step``, written by the Trainer with fixed keys
    (no column guessing that a bad value could reveal as wrong), so skipping one misreads nothing
    else — the next entry's tokens then count since the last entry read. A file with no good
    entry is an error naming its first bad one. A gzip-compressed file is read transparently.

    Raises
    ------
    InputFormatError
        Naming the file (and entry and field), for invalid JSON, a missing ``log_history`` list,
        or when every entry that is not skipped as a summary is bad.

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
        doc = json_loads(raw.decode("utf-8-sig"))  # a BOM is dropped; huge numbers stay text (see _num)
    except json.JSONDecodeError as exc:
        raise InputFormatError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except UnicodeDecodeError:
        raise InputFormatError(f"{path}: not a text JSON file (not UTF-8)") from None
    except RecursionError:
        raise InputFormatError(f"{path}: JSON nested too deeply to read") from None
    except (OSError, EOFError) as exc:
        raise InputFormatError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    history = doc.get("log_history") if isinstance(doc, dict) else None
    if not isinstance(history, list):
        raise InputFormatError(f"{path}: no 'log_history' list: not a Hugging Face trainer_state.json")
    bad = BadLines(path, "log_history", place="log_history[{}] ", unit="entry")
    good = 0
    seen_tokens: float | None = None
    for i, entry in enumerate(history):
        try:
            if not isinstance(entry, dict):
                raise _BadEntry(f"is not an object: {show(entry)}")
            step = _step(entry)
            if "loss" in entry:
                cum = _num(entry, "num_tokens")
                if cum is None:
                    cum = _num(entry, "num_input_tokens_seen")
                loss, gn, lr = _num(entry, "loss"), _num(entry, "grad_norm"), _num(entry, "learning_rate")
                tokens = None
                if cum is not None and math.isfinite(cum) and cum > 0:  # only once the entry is known good
                    tokens = int(cum - (seen_tokens or 0.0))
                    seen_tokens = cum
                point = LogPoint(step=step, loss=loss, grad_norm=gn, lr=lr, tokens=tokens, source_line=i)
            elif "eval_runtime" in entry:
                point = LogPoint(step=step, eval_seconds=_num(entry, "eval_runtime"), source_line=i)
            else:
                continue
        except _BadEntry as exc:
            bad.add(i, str(exc))
            continue
        good += 1
        yield point
    if bad.count:
        bad.finish(good)
