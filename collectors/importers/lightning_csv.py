"""PyTorch Lightning ``CSVLogger`` ``metrics.csv``: a sparse row per ``log()`` call; columns ``epoch``, ``step``, ….

A row with a training loss, grad norm or learning rate is a step (``train_loss_step``, ``train_loss``,
``loss``, ``lr-<Optimizer>``, … — see :mod:`trainhealth.collectors.importers._table`); validation and epoch-end
rows (``val_loss``, ``train_loss_epoch``) carry none of these and are not steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from trainhealth.collectors.importers import _table
from trainhealth.logpoint import LogPoint

CANDIDATES = {"step": ("step",), **_table.COMMON, "eval_loss": _table.EVAL_LOSS}


def sniff(header: list[str]) -> bool:
    """Lightning writes ``epoch`` and ``step`` columns in every metrics.csv."""
    return "step" in header and "epoch" in header


def read(path: str | Path, mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint]:
    """Yield the training steps of a Lightning ``metrics.csv`` in file order, and its validation rows (``val_loss``)
    as evaluations of set ``val``.

    Raises
    ------
    InputFormatError
        For a missing step or metric column, a row with the wrong field count, or a
        non-numeric value (naming the file, line and column).

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    >>> _ = f.write("epoch,step,train_loss_step,val_loss\\n0,49,7.6,\\n0,99,7.5,\\n0,99,,7.1\\n"); f.close()
    >>> [(p.step, p.loss, p.eval_losses) for p in read(f.name)]
    [(49, 7.6, ()), (99, 7.5, ()), (99, None, (('val', 7.1),))]
    >>> os.unlink(f.name)
    """
    yield from _table.csv_points(Path(path), "lightning_csv", CANDIDATES, mapping)
