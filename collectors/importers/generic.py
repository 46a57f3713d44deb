"""Generic CSV (with a header) and JSON-lines logs: one row per logged step, columns named by common names or a mapping.

Step column: ``step``, ``global_step``, ``iteration``, ``iter``, … ; metric columns as in
:mod:`trainhealth.collectors.importers._table`; ``mapping={"loss": "my_loss", "step": "it"}`` names others.
Optional clocks: ``wall_time``/``timestamp`` (unix seconds) or ``elapsed`` (seconds since the start)
give each point its seconds per step.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from trainhealth.collectors.importers import _table
from trainhealth.logpoint import LogPoint

CANDIDATES = {"step": _table.GENERIC_STEP, **_table.COMMON, "wall_time": ("wall_time", "timestamp", "_timestamp"),
              "elapsed": ("elapsed", "elapsed_s", "_runtime")}


def read_csv(path: str | Path, mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint]:
    """Yield the training steps of a CSV log (rows with a loss, grad norm or learning rate).

    Raises
    ------
    InputFormatError
        For a missing step or metric column, a row with the wrong field count, or a non-numeric
        value (naming the file, line and column).

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    >>> _ = f.write("it,my_loss\\n1,2.5\\n2,nan\\n"); f.close()
    >>> [(p.step, p.loss) for p in read_csv(f.name, {"step": "it", "loss": "my_loss"})]
    [(1, 2.5), (2, nan)]
    >>> os.unlink(f.name)
    """
    yield from _table.csv_points(Path(path), "csv", CANDIDATES, mapping)


def read_jsonl(path: str | Path, mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint]:
    """Yield the training steps of a JSON-lines log (one object per line).

    A line that is not a JSON object (a torn last write) is skipped with one warning; a field
    that is not a number is an InputFormatError naming the file, line and field.
    """
    yield from _table.jsonl_points(Path(path), "jsonl", CANDIDATES, mapping)
