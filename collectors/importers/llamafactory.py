"""LLaMA-Factory ``trainer_log.jsonl`` (its ``LogCallback``): one JSON object per Trainer log call.

Train rows carry ``current_steps``, ``loss``, the learning rate (``learning_rate`` in older
versions, ``lr`` in newer), ``elapsed_time`` (``H:MM:SS`` since training began: it gives the
seconds per step) and, when the Trainer counts input tokens, ``total_tokens`` (cumulative) and
``throughput``. Older versions write ``"throughput": "0.00"`` and ``"total_tokens": 0`` when tokens
are not counted: that means "not recorded", not a throughput collapse, so 0 tokens is read as
unknown. Rows without ``loss`` (the closing summary, prediction progress) are not training steps; a row with an
``eval_loss`` (not null) is an evaluation of set ``eval``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers import _table
from trainhealth.collectors.importers._common import BadLines
from trainhealth.logpoint import LogPoint

CANDIDATES = {"step": ("current_steps",), "loss": ("loss",), "grad_norm": ("grad_norm",),
              "lr": ("lr", "learning_rate"), "tokens_total": ("total_tokens",), "elapsed": ("elapsed_time",),
              "eval_loss": ("eval_loss",)}


def sniff(row: Mapping[str, Any]) -> bool:
    return "current_steps" in row and "total_steps" in row


def _not_recorded(field: str, v: Any) -> bool:
    return field == "tokens_total" and v in (0, "0", 0.0)


def read(path: str | Path, mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint]:
    """Yield the training steps of a ``trainer_log.jsonl``.

    A torn line is skipped with one warning; a non-numeric value is an InputFormatError naming
    the file, line and field.

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
    >>> _ = f.write('{"current_steps": 10, "total_steps": 20, "loss": 2.5, "learning_rate": 1e-6, '
    ...             '"elapsed_time": "0:00:24", "throughput": "0.00", "total_tokens": 0}\\n'
    ...             '{"current_steps": 20, "total_steps": 20, "loss": 2.4, "learning_rate": 2e-6, '
    ...             '"elapsed_time": "0:00:47", "throughput": "0.00", "total_tokens": 0}\\n'); f.close()
    >>> [(p.step, p.loss, p.tokens, p.step_seconds) for p in read(f.name)]
    [(10, 2.5, None, 2.4), (20, 2.4, None, 2.3)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    mapping = _table.check_mapping(mapping, "llamafactory")
    columns, rows = _table.jsonl_rows(path, BadLines(path, "JSON"))
    cols = _table.resolve(path, columns, CANDIDATES, mapping, what="field")
    _table.require(path, cols, CANDIDATES, what="field", where="")
    yield from _table.points(path, rows, cols, missing=_not_recorded)
