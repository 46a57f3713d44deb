"""nanoGPT ``train.py`` stdout: ``iter N: loss X, time Yms, mfu Z%`` (some forks add ``, lr L``).

``time`` is the wall time of that one iteration (nanoGPT's ``dt``), read as the seconds per
step; ``mfu -100.00%`` on the first iterations is nanoGPT's "not measured yet". The loss is
``loss.item() * gradient_accumulation_steps`` of the last micro-batch, as printed (``nan`` kept).
Evaluation lines (``step N: train loss X, val loss Y``) carry no duration and are not steps.
A line that starts with ``iter N:`` but does not parse is skipped, with one warning for all.

A file cut mid-line (a crash, a copy of a log being written): a last line without its line end is
left out with a warning naming its line and byte offset, when it does not parse (cut anywhere but
right after a field: ``iter 30: loss 7.43, time 409.75ms, mf``) or when it parses but lacks the
field the ``iter`` line before it ends with (cut right before ``, mfu``: no ``mfu``). A cut inside
the last value is not seen; a complete last line without a line end is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from trainhealth.collectors.importers._common import BadLines, Lines, reason, show, step_of, to_float
from trainhealth.logpoint import LogPoint

START = re.compile(r"^iter (\d+):")
LINE = re.compile(r"^iter (\d+): loss (\S+?)(?:, lr (\S+?))?, time (\S+?)ms(?:, mfu (\S+?)%)?\s*$")
#: The fields on a line, in line order, by (has its lr, has its mfu): for BadLines.cut_short.
FIELDS = {(False, False): ("loss", "time"), (False, True): ("loss", "time", "mfu"),
          (True, False): ("loss", "lr", "time"), (True, True): ("loss", "lr", "time", "mfu")}


def sniff_line(line: str) -> bool:
    return LINE.match(line) is not None


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield one point per ``iter`` line.

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("step 0: train loss 10.9, val loss 10.9\\niter 0: loss 10.9321, time 3012.50ms, mfu -100.00%\\n"
    ...             "iter 10: loss 9.1000, time 250.00ms, mfu 12.50%\\n"); f.close()
    >>> [(p.step, p.loss, p.step_seconds) for p in read(f.name)]
    [(0, 10.9321, 3.0125), (10, 9.1, 0.25)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    lines = Lines(path)
    bad = BadLines(path, "nanoGPT iter", lines=lines)
    good = 0
    last: int | None = None
    for lineno, text in lines:
        if not START.match(text):
            continue
        m = LINE.match(text)
        if m is None:
            bad.add(lineno, f"not 'iter N: loss X, time Yms, mfu Z%': {text[:80]!r}")
            continue
        try:
            step = step_of(m.group(1))  # 400 digits would overflow the timeline
        except ValueError as exc:
            bad.add(lineno, f"field 'iter' is {exc}: {show(m.group(1))}")
            continue
        vals: dict[str, float | None] = {}
        err = None
        for name, value in (("loss", m.group(2)), ("lr", m.group(3)), ("time", m.group(4))):
            try:
                vals[name] = to_float(value)
            except ValueError as exc:
                err = f"field {name!r} is {reason(exc)}: {show(value)}"
                break
        if err is not None:
            bad.add(lineno, err)
            continue
        if bad.cut_short(lineno, FIELDS[m.group(3) is not None, m.group(5) is not None], step=step):
            continue  # the file's torn last line, cut right before its ", mfu"
        ms = vals["time"]
        good += 1
        last = lineno
        yield LogPoint(step=step, loss=vals["loss"], lr=vals["lr"], step_seconds=None if ms is None else ms / 1000.0,
                       source_line=lineno)
    bad.finish(good, last)
