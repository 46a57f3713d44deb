"""llm.c ``main.log`` (its ``Logger``, ``llmc/logger.h``): one ``s:N key:value …`` line per logged event.

The lines ``logger_log_train``, ``logger_log_val`` and ``logger_log_eval`` write::

    s:0 tel:11.0095
    s:0 trl:11.0116 lr:0.000001 norm:14.96
    s:19552 eval:0.3054

- ``s:N trl:X lr:Y norm:Z`` — training step N: its loss ``trl``, learning rate ``lr`` and global
  gradient norm ``norm`` (``%.4f``, ``%.6f``, ``%.2f``; ``nan``/``inf`` kept). Older ``train_gpt2.cu``
  prints ``s:N trl:X`` alone (no learning rate or norm: None). The PyTorch ``train_gpt2.py`` of llm.c
  and early modded-nanogpt append ``train_time:Tms step_avg:Ams``: ``train_time`` is cumulative
  training time, and the seconds per step are its difference over the steps since the previous
  reading (after a reset — the reading goes down — the new reading itself), as
  :mod:`~trainhealth.collectors.importers.modded_nanogpt_log` reads it. Without it, no step times (llm.c's
  ``main.log`` has none).
- ``s:N tel:X`` — the validation loss at step N: an evaluation point, as ``trainer_state.json``'s
  ``eval_loss`` entries are. The log does not time it: ``eval_seconds`` is 0.0 (an evaluation, with
  no time of its own on the timeline); the loss itself is not kept (a LogPoint has no field for it).
- ``s:N eval:X`` — the HellaSwag accuracy: not a step, skipped without a warning.

A ``s:N`` line of another shape, or whose value is not a number, is skipped, with one warning for
all of them naming the first.

A file cut mid-line (a crash, a copy of a log being written): a last line without its line end is
left out with a warning naming its line and byte offset, when it does not parse (``s:19552 te``) or
when it is a training line lacking the field the training line before it ends with (``s:19551
trl:3.2813 lr:0.000000 no``: no ``norm``); booked, it would be a step with its gradient norm
missing. A cut inside the last value is not seen (the digits left read as a number); a complete
last line without a line end is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from trainhealth.collectors.importers._common import BadLines, Lines, Timeline, reason, show, step_of, to_float
from trainhealth.logpoint import LogPoint

START = re.compile(r"^s:(\d+)\s")
SNIFF = re.compile(r"^s:\d+ (?:trl|tel|eval):\S")
FIELD = re.compile(r"(\w+):(\S+)")
#: Key → LogPoint field (``train_time`` is the cumulative timer, in ms).
KEYS = {"trl": "loss", "tel": "val_loss", "lr": "lr", "norm": "grad_norm", "train_time": "train_time"}


def sniff_line(line: str) -> bool:
    return line.startswith("s:") and SNIFF.match(line) is not None


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield one point per ``trl`` line (a training step) and one evaluation point per ``tel`` line, in file order.

    Raises
    ------
    InputFormatError
        When no ``trl``/``tel`` line can be read (naming the first malformed one, if any).

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("s:0 tel:11.0095\\ns:0 trl:11.0116 lr:0.000001 norm:14.96\\ns:1 trl:10.9586 lr:0.000002 norm:nan\\n"
    ...             "s:1 eval:0.2500\\n"); f.close()
    >>> [(p.step, p.loss, p.lr, p.grad_norm, p.is_eval) for p in read(f.name)]
    [(0, None, None, None, True), (0, 11.0116, 1e-06, 14.96, False), (1, 10.9586, 2e-06, nan, False)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    lines = Lines(path)
    bad = BadLines(path, "llm.c s:N", lines=lines)
    good = 0
    last: int | None = None
    clock = Timeline(elapsed=False, resets=True)  # train_time: cumulative ms, restarting with the process
    for lineno, text in lines:
        m = START.match(text)
        if m is None:
            continue
        fields = dict(FIELD.findall(text[m.end():]))
        if "eval" in fields and "trl" not in fields and "tel" not in fields:
            last = lineno  # HellaSwag accuracy: not a step
            continue
        if "trl" not in fields and "tel" not in fields:
            bad.add(lineno, f"no 'trl:', 'tel:' or 'eval:' value: {text[:80]!r}")
            continue
        try:
            step = step_of(m.group(1))  # 400 digits would overflow the timeline
        except ValueError as exc:
            bad.add(lineno, f"field 's' is {exc}: {show(m.group(1))}")
            continue
        vals: dict[str, float] = {}
        err = None
        for key, name in KEYS.items():
            if key not in fields:
                continue
            value = fields[key].removesuffix("ms") if key == "train_time" else fields[key]
            try:
                x = to_float(value)
            except ValueError as exc:
                err = f"field {key!r} is {reason(exc)}: {show(fields[key])}"
                break
            if x is not None:
                vals[name] = x
        if err is not None:
            bad.add(lineno, err)
            continue
        if "trl" in fields and bad.cut_short(lineno, list(fields), step=step):
            continue  # the file's torn last line, its last fields cut off (compared with the training line before)
        t_ms = vals.get("train_time")
        per = None if t_ms is None else clock.per_step(step, t_ms / 1000.0)
        good += 1
        last = lineno
        if "trl" in fields:
            yield LogPoint(step=step, loss=vals.get("loss"), grad_norm=vals.get("grad_norm"), lr=vals.get("lr"),
                           step_seconds=per, source_line=lineno)
        else:
            val = vals.get("val_loss")
            yield LogPoint(step=step, eval_seconds=0.0, source_line=lineno,
                           eval_losses=(("val", val),) if val is not None else ())
    bad.finish(good, last)
