"""OpenMMLab text logs: mmengine's ``LogProcessor`` lines and mmcv 1.x's ``TextLoggerHook`` lines.

mmengine (MMDetection 3, MMSegmentation 1, …), one line per logging interval::

    08/03 22:09:24 - mmengine - INFO - Epoch(train)  [1][ 500/2931]  lr: 2.0000e-02  eta: 0:39:15  time: 0.0578
        data_time: 0.0017  memory: 2389  grad_norm: 3.2  loss: nan  loss_rpn_cls: nan  loss_bbox: nan
    … - Iter(train) [ 500/90000]  base_lr: 1.0000e-02 lr: 1.0000e-02  eta: …  time: 0.5012  …  loss: 1.2345
    … - Epoch(val)  [1][ 100/5000]    eta: 0:03:11  time: 0.0386  data_time: 0.0017  memory: 1234
    … - Epoch(val) [1][5000/5000]    coco/bbox_mAP: 0.3740  …  data_time: 0.0021  time: 0.0412

mmcv 1.x (MMDetection 2, …), a tab after the header::

    … - mmdet - INFO - Epoch [1][500/2931]<TAB>lr: 2.000e-02, eta: 0:39:15, time: 0.578, data_time: 0.017,
        memory: 2389, loss_rpn_cls: 0.0123, loss: 0.5, grad_norm: 3.2
    Iter [500/90000]<TAB>lr: 1.000e-02, …
    Epoch(val) [1][5000]<TAB>bbox_mAP: 0.3740, …

(each one line). Read from a training line: ``loss`` (the total; the ``loss_*`` terms are not),
``grad_norm``, ``lr`` (mmcv's per-group ``lr_<group>`` when there is no ``lr``: the first), and
``time`` — seconds per iteration, the mean over the logging window — as the seconds per step.
The step of an epoch-based log is the global iteration ``(epoch - 1) x N + i`` (``[epoch][i/N]``:
``i`` restarts each epoch, ``N`` is the epoch's iteration count); of an iteration-based log, ``i``.
A validation/test summary (mmengine's ``Epoch(val) [e][N/N]`` without an ``eta``; mmcv's
``Epoch(val) [e][N]``) is an evaluation at the last training step, lasting ``N x time`` when it gives
the mean ``time`` (else 0.0: not timed); the progress lines within a validation are not steps.
``Saving checkpoint at 1 epochs`` / ``… at 5000 iterations`` (CheckpointHook) is a ``checkpoint_save``
event at the last training step logged. A training line whose value is not a number, or with no
loss, grad norm or learning rate, is skipped with one warning for all.

A file cut mid-line (a crash, a copy of a log being written): a last line without its line end is
left out with a warning naming its line and byte offset, when it does not parse, or when it is a
training line lacking the key the training line before it ends with (``… loss: 2.6000  decode.loss_c``:
no ``decode.loss_ce``); booked, it would be a step with the cut fields missing. A cut inside the last
value is not seen, nor is a cut first training line (nothing to compare it with) or a cut validation
line; a complete last line without a line end is read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

from trainhealth.collectors.importers._common import (
    BadLines,
    Checkpoints,
    Lines,
    check_step,
    reason,
    show,
    step_of,
    to_float,
)
from trainhealth.logpoint import LogEvent, LogPoint

#: ``Epoch(train) [e][i/N]``, ``Iter(train) [i/N]``, mmcv's ``Epoch [e][i/N]`` / ``Iter [i/N]``, and the
#: validation/test forms ``Epoch(val) [e][i/N]``, ``Epoch(test) [i/N]``, ``Epoch(val) [e][N]``, ``Iter(val) [N]``.
HEADER = re.compile(r"\b(?P<kind>Epoch|Iter)(?:\((?P<mode>train|val|test)\))?\s*(?:\[\s*(?P<epoch>\d+)\s*\])?"
                    r"\[\s*(?P<i>\d+)\s*(?:/\s*(?P<n>\d+)\s*)?\]")
PAIR = re.compile(r"(?<![\w./-])([A-Za-z_][\w./-]*):\s*([^\s,]+)")


def sniff_line(line: str) -> bool:
    if "Epoch" not in line and "Iter" not in line:
        return False
    m = HEADER.search(line)
    return (m is not None and m.group("mode") in (None, "train") and m.group("n") is not None
            and ("lr" in line[m.end():] or "loss" in line[m.end():]))


def _pairs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in PAIR.findall(text):
        out.setdefault(key, value)
    return out


def read(path: str | Path) -> Iterator[LogPoint | LogEvent]:
    """Yield one point per training line, an evaluation per validation/test summary, and checkpoint saves.

    Raises
    ------
    InputFormatError
        When no training line can be read (naming the first malformed one, if any).

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("Epoch(train)  [1][ 500/2931]  lr: 2.0000e-02  eta: 0:39:15  time: 0.0578  data_time: 0.0017  "
    ...             "memory: 2389  loss: nan  loss_rpn_cls: nan\\n"
    ...             "Epoch [2][100/2931]\\tlr: 1.000e-02, eta: 1 day, 2:03:04, time: 0.512, loss: 0.8123, "
    ...             "grad_norm: 3.5\\n"
    ...             "Epoch(val) [2][50/50]    coco/bbox_mAP: 0.3740  data_time: 0.0021  time: 0.0400\\n"); f.close()
    >>> [(p.step, p.loss, p.grad_norm, p.lr, p.step_seconds, p.eval_seconds) for p in read(f.name)]
    [(500, nan, None, 0.02, 0.0578, None), (3031, 0.8123, 3.5, 0.01, 0.512, None), (3031, None, None, None, None, 2.0)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    lines = Lines(path)
    bad = BadLines(path, "mmengine/mmcv training", lines=lines)
    checkpoints = Checkpoints()
    good = 0
    last: int | None = None
    step: int | None = None  # the last training step logged
    for lineno, text in lines:
        m = HEADER.search(text) if ("Epoch" in text or "Iter" in text) else None
        if m is None:
            event = checkpoints.event(text, lineno, step)
            if event is not None:
                last = lineno
                yield event
            continue
        mode = m.group("mode") or "train"
        fields = _pairs(text[m.end():])
        if mode != "train":
            if m.group("n") is not None and (m.group("i") != m.group("n") or "eta" in fields):
                last = lineno
                continue  # a progress line within the validation
            count, t = m.group("n") or m.group("i"), fields.get("time")
            try:
                per = to_float(t)
            except ValueError:
                per = None
            seconds = int(count) * per if per is not None and math.isfinite(per) and per >= 0 and len(count) < 16 \
                else 0.0
            good += 1
            last = lineno
            yield LogPoint(step=0 if step is None else step, eval_seconds=seconds, source_line=lineno)
            continue
        if m.group("n") is None:
            bad.add(lineno, f"no iteration count: {m.group(0)!r}")
            continue
        try:  # each below MAX_STEP, and so the step they make
            i, n = step_of(m.group("i")), step_of(m.group("n"))
            if m.group("kind") == "Epoch":
                if m.group("epoch") is None:
                    raise ValueError("an epoch-based line without its epoch")
                this = check_step((step_of(m.group("epoch")) - 1) * n + i)
            else:
                this = i
        except ValueError as exc:
            bad.add(lineno, f"field {m.group(0)!r} is {exc}")
            continue
        lr_key = "lr" if "lr" in fields else next((k for k in fields if k.startswith("lr_")), None)
        vals: dict[str, float | None] = {}
        err = None
        for name, key in (("loss", "loss"), ("grad_norm", "grad_norm"), ("lr", lr_key), ("time", "time")):
            if key is None or key not in fields:
                continue
            try:
                vals[name] = to_float(fields[key])
            except ValueError as exc:
                err = f"field {key!r} is {reason(exc)}: {show(fields[key])}"
                break
        if err is None and all(vals.get(f) is None for f in ("loss", "grad_norm", "lr")):
            err = "no loss, grad_norm or lr on the line"
        if err is not None:
            bad.add(lineno, err)
            continue
        if bad.cut_short(lineno, list(fields), step=this):
            continue  # the file's torn last line, its last keys cut off (compared with the training line before)
        good += 1
        last = lineno
        step = this
        yield LogPoint(step=this, loss=vals.get("loss"), grad_norm=vals.get("grad_norm"), lr=vals.get("lr"),
                       step_seconds=vals.get("time"), source_line=lineno)
    bad.finish(good, last)
