"""Table-shaped logs (CSV with a header, JSON lines): column names → LogPoint fields, rows → points.

The same common-name lists serve TensorBoard tags. A ``mapping`` (field → column or tag name,
or None to ignore a field) overrides the defaults of any table-shaped format.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers._common import (
    NOT_A_STEP,
    BadLines,
    CumulativeTokens,
    Lines,
    Timeline,
    json_loads,
    open_text,
    reason,
    show,
    to_float,
    to_seconds,
    to_step,
)
from trainhealth.exceptions import ConfigError, InputFormatError
from trainhealth.logpoint import LogPoint

#: What a mapping may name: the LogPoint fields plus the clocks and counters they are derived from.
FIELDS = ("step", "loss", "grad_norm", "lr", "step_seconds", "tokens", "tokens_total", "consumed_samples",
          "skipped", "wall_time", "elapsed")
_FIELD_HELP = {
    "step": "the optimizer step (an integer)",
    "loss": "training loss", "grad_norm": "global gradient norm", "lr": "learning rate",
    "step_seconds": "seconds per step", "tokens": "tokens since the previous row",
    "tokens_total": "cumulative tokens", "consumed_samples": "cumulative samples",
    "skipped": "skipped optimizer steps", "wall_time": "unix time of the row",
    "elapsed": "seconds since the start (or H:MM:SS)",
}

# Common names, most specific first. A training loss column, never an epoch aggregate or a validation loss.
LOSS = ("train/loss", "loss", "train_loss", "train_loss_step", "train/loss_step", "loss_step", "training_loss",
        "train/lm_loss", "lm_loss", "lm loss", "lm-loss", "reduced_train_loss", "train/reduced_train_loss")
GRAD_NORM = ("train/grad_norm", "grad_norm", "train/grad-norm", "grad-norm", "grad norm", "train/gradient_norm",
             "gradient_norm", "grad_norm_step", "train/grad_norm_step", "grad_2.0_norm_total")
LR = ("train/learning_rate", "learning_rate", "train/lr", "lr", "learning-rate", "learning rate",
      "trainer/learning_rate", "lr-AdamW", "lr-Adam", "lr-SGD")
LR_PREFIX = "lr-"  # Lightning's LearningRateMonitor: lr-<Optimizer>[/pg<n>]
STEP_SECONDS = ("step_seconds", "iteration-time", "iteration_time", "runtime/iteration_time",
                "train_step_timing in s", "train_step_timing", "train/step_time", "step_time")
TOKENS_TOTAL = ("num_input_tokens_seen", "train/num_input_tokens_seen", "num_tokens", "train/num_tokens",
                "total_tokens", "consumed_tokens", "consumed-tokens", "consumed tokens")
CONSUMED = ("consumed_samples", "consumed-samples", "consumed samples", "train/consumed_samples")
COMMON: dict[str, tuple[str, ...]] = {
    "loss": LOSS, "grad_norm": GRAD_NORM, "lr": LR, "step_seconds": STEP_SECONDS,
    "tokens_total": TOKENS_TOTAL, "consumed_samples": CONSUMED,
}
GENERIC_STEP = ("step", "global_step", "train/global_step", "trainer/global_step", "iteration", "iter", "_step",
                "Step", "current_steps")
METRICS = ("loss", "grad_norm", "lr")
#: An evaluation's loss (field ``eval_loss``): HF/LLaMA-Factory's ``eval_loss``, Lightning's ``val_loss``, W&B's
#: ``eval/loss``. A row with one is an evaluation point of set ``eval`` (``val`` for ``val_loss``); its time is not
#: in the row (0 s of evaluation badput).
EVAL_LOSS = ("eval_loss", "eval/loss", "val_loss", "val/loss", "validation_loss")


def check_mapping(mapping: Mapping[str, str | None] | None, fmt: str) -> dict[str, str | None]:
    """Validate a user mapping (field → column/tag name or None). Raises ConfigError naming the bad entry."""
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"mapping must be a dict of field → column name, not {type(mapping).__name__}")
    for k, v in mapping.items():
        if k not in FIELDS:
            raise ConfigError(f"mapping key {k!r} is not a field; fields: "
                              + ", ".join(f"{f} ({h})" for f, h in _FIELD_HELP.items()))
        if v is not None and (not isinstance(v, str) or not v):
            raise ConfigError(f"mapping[{k!r}]={v!r} must be a column name (or None to ignore {k})")
    if fmt == "tensorboard" and "step" in mapping:
        raise ConfigError("mapping['step'] is not used for TensorBoard: event files carry the step")
    return dict(mapping)


def resolve(path: Path, columns: Sequence[str], candidates: Mapping[str, Sequence[str]],
            mapping: Mapping[str, str | None], what: str = "column") -> dict[str, str]:
    """Field → column: the mapping's choice, else the first common name present.

    Raises InputFormatError when a mapped name is not among ``columns``.
    """
    present = set(columns)
    out: dict[str, str] = {}
    for field, names in candidates.items():
        if field in mapping:
            continue
        hit = next((n for n in names if n in present), None)
        if hit is None and field == "lr":
            hit = next((c for c in columns if c.startswith(LR_PREFIX)), None)
        if hit is not None:
            out[field] = hit
    for field, name in mapping.items():
        if name is None:
            continue
        if name not in present:
            shown = ", ".join(repr(c) for c in list(columns)[:40]) + (", …" if len(columns) > 40 else "")
            raise InputFormatError(f"{path}: {what} {name!r} (mapped to {field}) not found; {what}s: {shown}")
        out[field] = name
    return out


def require(path: Path, cols: Mapping[str, str], candidates: Mapping[str, Sequence[str]], what: str = "column",
            where: str = "line 1: ") -> None:
    """A step column and at least one of loss / grad norm / learning rate, or an InputFormatError saying which."""
    if "step" in candidates and "step" not in cols:
        names = ", ".join(repr(n) for n in candidates["step"])
        raise InputFormatError(f"{path}: {where}no step {what} (looked for {names}); "
                               f"pass mapping={{'step': NAME}}")
    if not any(f in cols for f in METRICS):
        names = ", ".join(repr(n) for f in METRICS for n in candidates.get(f, ())[:4])
        raise InputFormatError(f"{path}: {where}no loss, grad norm or learning-rate {what} (looked for {names}, …); "
                               f"pass mapping={{'loss': NAME}}")


def points(path: Path, rows: Iterable[tuple[int, Mapping[str, Any]]], cols: Mapping[str, str], *,
           missing: Callable[[str, Any], bool] | None = None, where: str = "line") -> Iterator[LogPoint]:
    """Rows (line number, column → value) to LogPoints; a row without loss, grad norm or lr is not a step.

    ``missing(field, value)`` marks format-specific "not recorded" values (e.g. LLaMA-Factory's 0 tokens).
    Raises InputFormatError naming the file, line and column for a non-numeric value or step.
    """
    clock = Timeline(elapsed="elapsed" in cols)
    clock_field = "elapsed" if "elapsed" in cols else "wall_time" if "wall_time" in cols else None
    tokens_total = CumulativeTokens()
    for line, row in rows:
        vals: dict[str, float | None] = {}
        for field, col in cols.items():
            if field == "step":
                continue
            v = row.get(col)
            if missing is not None and missing(field, v):
                v = None
            try:
                if field == "elapsed":
                    vals[field] = to_seconds(v)
                elif field == "skipped" and isinstance(v, bool):
                    vals[field] = float(v)
                else:
                    vals[field] = to_float(v)
            except (ValueError, TypeError, OverflowError) as exc:
                raise InputFormatError(f"{path}: {where} {line} field {col!r} is {reason(exc)}: {show(v)}") from None
        ev_loss = vals.get("eval_loss")
        if all(vals.get(f) is None for f in METRICS) and ev_loss is None:
            continue  # an epoch-summary or other row: not a training step
        v = row.get(cols["step"])
        if v is None or v == "":
            raise InputFormatError(f"{path}: {where} {line} field {cols['step']!r} (the step) is empty")
        try:
            step = to_step(v)
        except (ValueError, TypeError, OverflowError) as exc:
            raise InputFormatError(f"{path}: {where} {line} field {cols['step']!r} is {reason(exc, NOT_A_STEP)}: "
                                   f"{show(v)}") from None
        if all(vals.get(f) is None for f in METRICS):  # an evaluation row
            name = "val" if cols["eval_loss"].startswith("val") else "eval"
            yield LogPoint(step=step, eval_seconds=0.0, eval_losses=((name, ev_loss),), source_line=line)
            continue
        per = vals.get("step_seconds")
        from_clock = clock.per_step(step, vals.get(clock_field)) if clock_field else None
        if per is None:
            per = from_clock
        tokens = _int(vals.get("tokens"))
        if tokens is None:
            tokens = tokens_total.delta(vals.get("tokens_total"))
        else:
            tokens_total.delta(vals.get("tokens_total"))
        yield LogPoint(step=step, loss=vals.get("loss"), grad_norm=vals.get("grad_norm"), lr=vals.get("lr"),
                       tokens=tokens, source_line=line, step_seconds=per, skipped=_int(vals.get("skipped")),
                       consumed_samples=_int(vals.get("consumed_samples")))
        if ev_loss is not None:  # a train row that carries an evaluation too
            name = "val" if cols["eval_loss"].startswith("val") else "eval"
            yield LogPoint(step=step, eval_seconds=0.0, eval_losses=((name, ev_loss),), source_line=line)


def _int(x: float | None) -> int | None:
    return int(x) if x is not None and math.isfinite(x) else None


def read_csv(path: Path) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    """The header and an iterator of (line, row dict); a row with the wrong field count is an InputFormatError."""
    f = open_text(path, newline="")
    reader = csv.reader(f)
    try:
        header = next(reader, None)
    except (csv.Error, OSError, EOFError) as exc:
        f.close()
        raise InputFormatError(f"{path}: line 1: not a readable CSV header: {exc}") from None
    if not header:
        f.close()
        raise InputFormatError(f"{path}: line 1: empty file, no CSV header")
    header = [h.strip() for h in header]

    def rows() -> Iterator[tuple[int, dict[str, str]]]:
        with f:
            try:
                for row in reader:
                    if not row or all(not c.strip() for c in row):
                        continue
                    if len(row) != len(header):
                        raise InputFormatError(f"{path}: line {reader.line_num}: {len(row)} fields, the header has "
                                               f"{len(header)}")
                    yield reader.line_num, dict(zip(header, row, strict=True))
            except csv.Error as exc:
                raise InputFormatError(f"{path}: line {reader.line_num}: not valid CSV: {exc}") from None
            except (OSError, EOFError) as exc:
                raise InputFormatError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None

    return header, rows()


def iter_jsonl(path: Path, bad: BadLines | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """JSON-object lines as (line, dict), lazily; a torn or non-object line is counted in ``bad`` (skipped).

    A last line cut mid-write (no line end, not valid JSON) is not counted as malformed: ``bad`` warns that
    the file ends mid-line (see :class:`~trainhealth.collectors.importers._common.BadLines`).
    """
    lines = Lines(path)
    if bad is not None:
        bad.lines = lines
    for line, text in lines:
        s = text.strip()
        if not s:
            continue
        try:
            obj = json_loads(s)  # a 5,000-digit number stays text: refused with its line and field
        except json.JSONDecodeError as exc:
            if bad is not None:
                bad.add(line, f"not valid JSON (column {exc.colno}): {exc.msg}")
            continue
        except RecursionError:
            if bad is not None:
                bad.add(line, "JSON nested too deeply to read")
            continue
        if not isinstance(obj, dict):
            if bad is not None:
                bad.add(line, f"not a JSON object: {s[:60]!r}")
            continue
        yield line, obj


def jsonl_rows(path: Path, bad: BadLines) -> tuple[list[str], Iterator[tuple[int, dict[str, Any]]]]:
    """The keys of every JSON-object line (in order of first appearance), and the rows again, lazily.

    Two passes over the file, so memory does not grow with its length: JSON lines are sparse
    (a key may first appear on line 10,000), so the columns are known only after one full read.
    ``bad`` counts malformed lines (first pass) and ``bad.finish`` is called before returning.
    """
    seen: dict[str, None] = {}
    good = 0
    for _, row in iter_jsonl(path, bad):
        good += 1
        for k in row:
            seen.setdefault(k, None)
    bad.finish(good)
    return list(seen), iter_jsonl(path)


def csv_points(path: Path, fmt: str, candidates: Mapping[str, Sequence[str]],
               mapping: Mapping[str, str | None] | None) -> Iterator[LogPoint]:
    """The whole read of a CSV whose columns map to fields: check the mapping, resolve, require, yield."""
    mapping = check_mapping(mapping, fmt)
    header, rows = read_csv(path)
    cols = resolve(path, header, candidates, mapping)
    require(path, cols, candidates)
    yield from points(path, rows, cols)


def jsonl_points(path: Path, fmt: str, candidates: Mapping[str, Sequence[str]],
                 mapping: Mapping[str, str | None] | None) -> Iterator[LogPoint]:
    """The same for JSON lines (torn lines skipped with one warning)."""
    mapping = check_mapping(mapping, fmt)
    columns, rows = jsonl_rows(path, BadLines(path, "JSON"))
    cols = resolve(path, columns, candidates, mapping, what="field")
    require(path, cols, candidates, what="field", where="")
    yield from points(path, rows, cols)
