"""modded-nanogpt stdout: the training script's own source, then ``step:N/M train_loss:X train_time:Tms step_avg:Ams``.

``train_time`` is a cumulative timer of training only: it stops during validation
(``step:N/M val_loss:X train_time:Tms …`` lines, which update the timer reading but are not
steps) and is reset to 0 once after the first ~10 warm-up steps. The seconds per step are the
difference of consecutive readings over the steps between them; after a reset (the reading
goes down) the new reading itself, over the steps since the previous reading. ``step_avg`` is
not used: its ``nanms`` on early lines is the script's literal output (``timed_steps`` is NaN
while warming up), not a NaN loss. Newer records print train lines without ``train_loss``:
those give steps with a duration and no loss.

Source code lines never match (the f-strings in it hold ``{step}``, not digits). A
``step:N/M`` line that does not parse is skipped, with one warning for all.

A file cut mid-line (a crash, a copy of a log being written): a last line without its line end
that lacks the field the ``step:N/M`` line before it ends with (``step:5999/6000 train_loss:3.0936
train_time:2176134ms step_av``: no ``step_avg``) is left out with a warning naming its line, its
byte offset and the missing fields, as one that does not parse; booked, its step time or loss
would be missing where the cut took them. A cut inside the last value is not seen (the digits
left read as a number); a complete last line without a line end is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from trainhealth.collectors.importers._common import BadLines, Lines, Timeline, reason, show, step_of, to_float
from trainhealth.logpoint import LogPoint

START = re.compile(r"^step:(\d+)/(\d+)\s")
FIELD = re.compile(r"(\w+):(\S+)")


def sniff_line(line: str) -> bool:
    return START.match(line) is not None and ("train_time:" in line or "_loss:" in line)


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield one point per train line (``step:N/M train_loss:… train_time:…``).

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("step:0/3 val_loss:11.0 train_time:300ms step_avg:nanms\\n"
    ...             "step:1/3 train_loss:11.0 train_time:24300ms step_avg:nanms\\n"
    ...             "step:2/3 train_loss:10.9 train_time:1500ms step_avg:nanms\\n"
    ...             "step:3/3 train_loss:10.8 train_time:1750ms step_avg:875.00ms\\n"); f.close()
    >>> [(p.step, p.loss, p.step_seconds) for p in read(f.name)]
    [(1, 11.0, 24.0), (2, 10.9, 1.5), (3, 10.8, 0.25)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    lines = Lines(path)
    bad = BadLines(path, "step:N/M", lines=lines)
    good = 0
    last: int | None = None
    clock = Timeline(elapsed=False, resets=True)  # train_time: cumulative ms, restarting with the process
    for lineno, text in lines:
        m = START.match(text)
        if m is None:
            continue
        try:
            step = step_of(m.group(1))  # 400 digits would overflow the timeline
        except ValueError as exc:
            bad.add(lineno, f"field 'step' is {exc}: {show(m.group(1))}")
            continue
        fields = dict(FIELD.findall(text[m.end():]))
        nums: dict[str, float] = {}
        err = None
        for name in ("train_time", "train_loss", "val_loss"):
            if name in fields:
                try:
                    x = to_float(fields[name].removesuffix("ms") if name == "train_time" else fields[name])
                except ValueError as exc:
                    err = f"field {name!r} is {reason(exc)}: {show(fields[name])}"
                    break
                if x is not None:
                    nums[name] = x
        if err is not None:
            bad.add(lineno, err)
            continue
        t_ms, loss = nums.get("train_time"), nums.get("train_loss")
        if t_ms is None and loss is None and "val_loss" not in fields:
            bad.add(lineno, f"no train_loss, val_loss or train_time: {text[:80]!r}")
            continue
        if bad.cut_short(lineno, list(fields), step=None if "val_loss" in fields else step):
            continue  # the file's torn last line, its last fields cut off
        per = None if t_ms is None else clock.per_step(step, t_ms / 1000.0)
        last = lineno
        if "val_loss" in fields:
            continue  # a validation line: a timer reading, not a step
        good += 1
        yield LogPoint(step=step, loss=loss, step_seconds=per, source_line=lineno)
    bad.finish(good, last)
