"""Hugging Face Trainer ``trainer_state.json`` (its ``log_history``)."""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers._common import (
    NOT_A_NUMBER,
    STEP_RANGE,
    BadLines,
    HugeNumber,
    check_step,
    guarded_decoder,
    json_loads,
    log,
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


#: Where ``log_history``'s list starts, to recover the entries of a document cut mid-write.
_HISTORY = re.compile(r'"log_history"\s*:\s*\[')
#: What is left at a JSON error when the text was cut inside a literal or a number (``tru``, ``1.0e``).
_CUT_TOKEN = re.compile(r"[\w.+-]{0,24}")


def _runtime_key(entry: dict[str, Any]) -> str | None:
    """The runtime key of an evaluation entry: ``eval_runtime``, or ``eval_<set>_runtime`` for each of several
    eval sets (``metric_key_prefix``), ``test_runtime``; never the summary's ``train_runtime``."""
    if "eval_runtime" in entry:
        return "eval_runtime"
    return next((k for k in entry if k.endswith("_runtime") and k != "train_runtime"), None)


def _eval_losses(entry: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """``(set name, loss)`` of an evaluation entry's losses: ``eval_loss`` is set ``eval``, ``eval_<set>_loss`` set
    ``eval_<set>`` (the Trainer's ``metric_key_prefix``), ``test_loss`` set ``test``; a loss that is not a number is
    left out (the entry's runtime still counts)."""
    out = []
    for key in entry:
        if key.endswith("_loss") and key != "train_loss":
            try:
                value = _num(entry, key)
            except _BadEntry:
                continue
            if value is not None:
                out.append((key[:-len("_loss")], value))
    return tuple(out)


def _load(path: Path) -> tuple[Any, list[Any] | None]:
    """The document, or (when the file was cut mid-write) None and the complete ``log_history`` entries before the cut.

    Raises InputFormatError for invalid JSON that is not a cut document, or a cut before any entry.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if raw[:2] == b"\x1f\x8b":  # gzip magic: trainer_state.json.gz (a torn one: what decompresses)
        d = zlib.decompressobj(zlib.MAX_WBITS | 16)
        try:
            raw = d.decompress(raw)
        except zlib.error:
            raise InputFormatError(f"{path}: a gzip file that cannot be decompressed") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        if exc.reason != "unexpected end of data":
            raise InputFormatError(f"{path}: not a text JSON file (not UTF-8)") from None
        text = raw[:exc.start].decode("utf-8-sig")  # cut inside a multi-byte character
    try:
        return json_loads(text), None  # a BOM is dropped; huge numbers stay text (see _num)
    except json.JSONDecodeError as exc:
        cut = exc.msg.startswith("Unterminated string") or _CUT_TOKEN.fullmatch(text[exc.pos:].strip())
        if not cut:
            raise InputFormatError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}): "
                                   f"{exc.msg}") from None
    except RecursionError:
        raise InputFormatError(f"{path}: JSON nested too deeply to read") from None
    end = len(raw)
    m = _HISTORY.search(text)
    if m is None:
        raise InputFormatError(f"{path}: ends mid-document at byte {end:,} (truncated?), before its "
                               "'log_history' list")
    decoder, entries, pos = guarded_decoder(), [], m.end()
    ws = re.compile(r"\s*")
    while True:
        pos = ws.match(text, pos).end()
        if text.startswith("]", pos):
            break
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            break  # the entry the cut went through
        entries.append(entry)
        pos = ws.match(text, pos).end()
        if not text.startswith(",", pos):
            break
        pos += 1
    if not entries:
        raise InputFormatError(f"{path}: ends mid-document at byte {end:,} (truncated?), before the first "
                               "complete 'log_history' entry")
    log.warning("%s: ends mid-document at byte %s (truncated?): read the %d complete log_history entries "
                "before the cut", path, f"{end:,}", len(entries))
    return None, entries


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield the train and eval entries of a ``trainer_state.json`` in file order.

    Train entries (with ``loss``) give loss, ``grad_norm``, ``learning_rate`` and tokens as
    the difference of the cumulative ``num_tokens``/``num_input_tokens_seen``; eval entries
    (with ``eval_runtime``, or ``eval_<set>_runtime`` — one entry per eval set when the Trainer
    evaluates several — or ``test_runtime``) give their runtime and their losses (``eval_losses``: ``eval_loss`` as
    set ``eval``, ``eval_<set>_loss`` as ``eval_<set>``). Summary entries (``train_runtime``) are skipped.

    A file cut mid-write (a crash while saving; a copy of a file being written) is not valid JSON:
    when the JSON breaks off at its end (not in the middle), the complete ``log_history`` entries
    before the cut are read, with one warning naming the byte offset where the file ends; a cut
    before the first complete entry is an InputFormatError naming that offset.

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
    >>> [(p.step, p.loss, p.grad_norm, p.eval_seconds, p.eval_losses) for p in read(f.name)]
    [(10, 2.5, nan, None, ()), (10, None, None, 12.5, (('eval', 2.4),))]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    doc, history = _load(path)
    if history is None:
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
            elif (runtime := _runtime_key(entry)) is not None:
                point = LogPoint(step=step, eval_seconds=_num(entry, runtime), source_line=i,
                                 eval_losses=_eval_losses(entry))
            else:
                continue
        except _BadEntry as exc:
            bad.add(i, str(exc))
            continue
        good += 1
        yield point
    if bad.count:
        bad.finish(good)
