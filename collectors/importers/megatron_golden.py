"""Megatron-LM (and NeMo) functional-test golden values: ``{metric: {start_step, end_step, step_interval, values}}``.

``values`` is either ``{"<step>": value}`` (current Megatron-LM) or a list, one value per
``step_interval`` from ``start_step`` (older files, NeMo's ``expected_json``). The string
``"nan"`` means "not recorded at that step" (e.g. every step after the run's last logged one),
not a numerical NaN; a JSON ``NaN`` number is kept as NaN. Metrics read: ``lm loss`` (or
``reduced_train_loss``), ``grad norm``/``grad-norm``, ``learning-rate``/``lr`` and
``iteration-time`` (seconds per iteration); ``num-zeros``, memory and validation metrics are
not step metrics. A step without a recorded loss, grad norm or learning rate is not yielded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers import _table
from trainhealth.collectors.importers._common import NOT_A_STEP, json_loads, open_text, reason, show, to_float, to_step
from trainhealth.exceptions import ConfigError, InputFormatError
from trainhealth.logpoint import LogPoint

CANDIDATES = {"loss": ("lm loss", "reduced_train_loss", "loss", "train_loss"),
              "grad_norm": ("grad norm", "grad-norm", "grad_norm"),
              "lr": ("learning-rate", "learning rate", "lr", "learning_rate"),
              "step_seconds": ("iteration-time", "iteration_time", "train_step_timing in s")}


def sniff(doc: Any) -> bool:
    """A JSON object with at least one metric entry shaped ``{"values": …, "step_interval"/"start_step": …}``."""
    return isinstance(doc, dict) and any(
        isinstance(v, dict) and "values" in v and ("step_interval" in v or "start_step" in v) for v in doc.values())


def _series(path: Path, name: str, entry: Any) -> dict[int, float | None]:
    where = f"{path}: metric {name!r}"
    if not isinstance(entry, dict) or "values" not in entry:
        raise InputFormatError(f"{where} has no 'values'")
    values = entry["values"]
    out: dict[int, float | None] = {}
    if isinstance(values, dict):
        items = list(values.items())
    elif isinstance(values, list):
        try:
            start, every = to_step(entry.get("start_step", 0)), to_step(entry.get("step_interval", 1))
        except (ValueError, TypeError) as exc:
            raise InputFormatError(f"{where} field 'start_step'/'step_interval' is {reason(exc, NOT_A_STEP)}: "
                                   f"{show(entry.get('start_step'))}/{show(entry.get('step_interval'))}") from None
        items = [(start + i * every, v) for i, v in enumerate(values)]  # each step range-checked below
    else:
        raise InputFormatError(f"{where} field 'values' is neither an object nor a list: {type(values).__name__}")
    for k, v in items:
        try:
            step = to_step(k)
        except (ValueError, TypeError) as exc:
            what = "not an integer" if reason(exc, NOT_A_STEP) == NOT_A_STEP else reason(exc)
            raise InputFormatError(f"{where} step {show(k)} is {what}") from None
        if isinstance(v, str) and v.strip().lower() == "nan":
            out[step] = None  # not recorded
            continue
        try:
            out[step] = to_float(v)
        except (ValueError, TypeError) as exc:
            raise InputFormatError(f"{where} value at step {step} is {reason(exc)}: {show(v)}") from None
    return out


def read(path: str | Path, mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint]:
    """Yield one point per step at which a loss, grad norm, learning rate or iteration time was recorded.

    Raises
    ------
    InputFormatError
        For invalid JSON, no known metric, or a non-numeric value (naming the metric and step).

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    >>> _ = f.write('{"lm loss": {"start_step": 1, "end_step": 10, "step_interval": 5, '
    ...             '"values": {"1": 10.5, "5": 9.8, "10": "nan"}}, "iteration-time": {"start_step": 1, '
    ...             '"end_step": 10, "step_interval": 5, "values": {"1": 92.3, "5": 11.4, "10": "nan"}}}'); f.close()
    >>> [(p.step, p.loss, p.step_seconds) for p in read(f.name)]
    [(1, 10.5, 92.3), (5, 9.8, 11.4)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    mapping = _table.check_mapping(mapping, "megatron_golden")
    if "step" in mapping:
        raise ConfigError("mapping['step'] is not used for golden values: they carry their steps")
    try:
        with open_text(path) as f:
            doc = json_loads(f.read())  # huge numbers stay text: refused with their metric and step
    except json.JSONDecodeError as exc:
        raise InputFormatError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except RecursionError:
        raise InputFormatError(f"{path}: JSON nested too deeply to read") from None
    except (OSError, EOFError) as exc:
        raise InputFormatError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(doc, dict):
        raise InputFormatError(f"{path}: not a JSON object of metrics: not Megatron golden values")
    metrics = [k for k, v in doc.items() if isinstance(v, dict)]
    cols = _table.resolve(path, metrics, CANDIDATES, mapping, what="metric")
    if not any(f in cols for f in ("loss", "grad_norm", "lr")):
        raise InputFormatError(f"{path}: no loss, grad norm or learning-rate metric (looked for 'lm loss', "
                               f"'grad norm', 'learning-rate', …); metrics: {', '.join(map(repr, metrics))}")
    series = {f: _series(path, name, doc[name]) for f, name in cols.items()}
    for step in sorted({s for ser in series.values() for s in ser}):
        vals = {f: ser.get(step) for f, ser in series.items()}
        if all(vals.get(f) is None for f in ("loss", "grad_norm", "lr")):
            continue
        yield LogPoint(step=step, loss=vals.get("loss"), grad_norm=vals.get("grad_norm"), lr=vals.get("lr"),
                       step_seconds=vals.get("step_seconds"))
