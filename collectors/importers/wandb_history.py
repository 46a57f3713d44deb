"""Weights & Biases run history exports: CSV (``run.history().to_csv()``, or a chart's "Export CSV") and JSON lines.

A history row has W&B's own ``_step`` counter, ``_runtime`` (seconds since the run started)
and ``_timestamp`` (unix seconds), plus the logged keys. The step is the trainer's own
counter when logged (``train/global_step`` from the Hugging Face callback,
``trainer/global_step`` from Lightning's logger), else ``_step``. ``_runtime`` (else
``_timestamp``) gives each point its seconds per step. NaN/Infinity may be numbers or the
strings ``"NaN"``/``"Infinity"``; both are kept as floats.

A chart's CSV export names columns ``<run name> - <metric>`` (with ``__MIN``/``__MAX``
companions, ignored) and the step ``Step``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from trainhealth.collectors.importers import _table
from trainhealth.exceptions import InputFormatError
from trainhealth.logpoint import LogPoint

CANDIDATES = {"step": ("train/global_step", "trainer/global_step", "global_step", "_step", "Step"),
              **_table.COMMON, "elapsed": ("_runtime",), "wall_time": ("_timestamp",), "eval_loss": _table.EVAL_LOSS}
SYSTEM = ("_step", "_runtime", "_timestamp")


def sniff_columns(columns: list[str]) -> bool:
    """W&B's own history keys, or a chart export (``Step`` + ``<run> - <metric>`` columns)."""
    if any(c in columns for c in SYSTEM):
        return True
    return "Step" in columns and any(" - " in c for c in columns)


def _chart_columns(path: Path, header: list[str], mapped: bool) -> dict[str, str]:
    """Chart-export column → metric name (``run - train/loss`` → ``train/loss``).

    Several runs in one export need a mapping naming the run's columns (then nothing is renamed).
    """
    rename: dict[str, str] = {}
    runs: set[str] = set()
    for c in header:
        run, sep, metric = c.partition(" - ")
        if not sep or metric.endswith(("__MIN", "__MAX")):
            continue
        runs.add(run)
        rename[c] = metric
    if len(runs) > 1:
        if mapped:
            return {}
        raise InputFormatError(f"{path}: line 1: a chart export of {len(runs)} runs ({', '.join(sorted(runs))}); "
                               "export one run, or name its columns with mapping={'loss': '<run> - <metric>', …}")
    return rename


def read_csv(path: str | Path, mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint]:
    """Yield the training steps of a W&B history CSV.

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    >>> _ = f.write(",_step,_runtime,train/loss,train/global_step\\n0,0,20.0,2.5,10\\n1,1,30.0,NaN,20\\n"); f.close()
    >>> [(p.step, p.loss, p.step_seconds) for p in read_csv(f.name)]
    [(10, 2.5, 2.0), (20, nan, 1.0)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    mapping = _table.check_mapping(mapping, "wandb_csv")
    header, rows = _table.read_csv(path)
    rename = {} if any(c in header for c in SYSTEM) else _chart_columns(path, header, bool(mapping))
    if rename:  # resolve on the metric names, then read the run's original columns
        back = {metric: col for col, metric in rename.items()}
        names = [rename.get(c, c) for c in header]
        mapped = {f: (rename.get(v, v) if v else v) for f, v in mapping.items()}
        cols = {f: back.get(c, c) for f, c in _table.resolve(path, names, CANDIDATES, mapped).items()}
    else:
        cols = _table.resolve(path, header, CANDIDATES, mapping)
    _table.require(path, cols, CANDIDATES)
    yield from _table.points(path, rows, cols)


def read_jsonl(path: str | Path, mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint]:
    """Yield the training steps of W&B history JSON lines (``wandb-history.jsonl``, ``scan_history()`` dumps).

    A torn line is skipped with one warning; a non-numeric metric is an InputFormatError.
    """
    yield from _table.jsonl_points(Path(path), "wandb_jsonl", CANDIDATES, mapping)
