"""PyTorch ``examples/word_language_model`` stdout: ``| epoch E | B/ N batches | lr L | ms/batch T | loss X | ppl P``.

The step is the global batch index ``(E - 1) * N + B`` (``B`` counts the epoch's batches, ``N``
is its batch count); ``ms/batch`` (the mean over the log interval) gives the seconds per step;
``loss`` is the mean over the interval, ``nan`` kept. ``| end of epoch …`` (validation) and
``| End of training …`` lines carry no step and are ignored. A line that starts with
``| epoch`` but does not parse is skipped, with one warning for all.

A file cut mid-line (a crash, a copy of a log being written): a last line without its line end
that lacks the field the ``| epoch`` line before it ends with (``… | loss   nan | pp``: no ``ppl``)
is left out with a warning naming its line, its byte offset and the missing fields, as one that
does not parse (cut before its loss). A cut inside the last value is not seen (the digits left
read as a number); a complete last line without a line end is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from trainhealth.collectors.importers._common import BadLines, Lines, check_step, reason, show, step_of, to_float
from trainhealth.logpoint import LogPoint

START = re.compile(r"^\|\s*epoch\s+\d")
LINE = re.compile(r"^\|\s*epoch\s+(\d+)\s*\|\s*(\d+)\s*/\s*(\d+)\s+batches\s*\|(.*)$")
KEYS = {"lr": "lr", "ms/batch": "ms", "loss": "loss", "ppl": "ppl"}


def sniff_line(line: str) -> bool:
    return LINE.match(line) is not None


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield one point per ``| epoch … batches …`` line.

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("| epoch   1 |   200/ 2983 batches | lr 20.00 | ms/batch 11.61 | loss  6.50 | ppl   665.14\\n"
    ...             "| epoch   2 |   200/ 2983 batches | lr 20.00 | ms/batch 11.49 | loss   nan | ppl      nan\\n")
    >>> f.close()
    >>> [(p.step, p.loss, p.lr, round(p.step_seconds, 6)) for p in read(f.name)]
    [(200, 6.5, 20.0, 0.01161), (3183, nan, 20.0, 0.01149)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    lines = Lines(path)
    bad = BadLines(path, "'| epoch'", lines=lines)
    good = 0
    last: int | None = None
    for lineno, text in lines:
        if not START.match(text):
            continue
        m = LINE.match(text)
        if m is None:
            bad.add(lineno, f"not '| epoch E | B/ N batches | …': {text[:80]!r}")
            continue
        try:  # each below MAX_STEP, and so the step they make (400 digits would overflow the timeline)
            epoch, batch, per_epoch = (step_of(m.group(i)) for i in (1, 2, 3))
            step = check_step((epoch - 1) * per_epoch + batch)
        except ValueError as exc:
            bad.add(lineno, f"field 'epoch'/'batches' is {exc}: {show(m.group(0)[:60])}")
            continue
        vals: dict[str, float] = {}
        keys: list[str] = []  # known or not, in line order: a line cut short lacks the last ones
        err = None
        for seg in m.group(4).split("|"):
            key, sep, value = seg.strip().rpartition(" ")
            key = key.strip()
            if sep:
                keys.append(key)
            name = KEYS.get(key)
            if name is None:
                continue
            try:
                x = to_float(value)
            except ValueError as exc:
                err = f"field {key!r} is {reason(exc)}: {show(value)}"
                break
            if x is not None:
                vals[name] = x
        if err is None and "loss" not in vals:
            err = "no loss on the line"
        if err is not None:
            bad.add(lineno, err)
            continue
        if bad.cut_short(lineno, keys, step=step):
            continue  # the file's torn last line, its last fields cut off
        good += 1
        last = lineno
        ms = vals.get("ms")
        yield LogPoint(step=step, loss=vals["loss"], lr=vals.get("lr"),
                       step_seconds=None if ms is None else ms / 1000.0, source_line=lineno)
    bad.finish(good, last)
