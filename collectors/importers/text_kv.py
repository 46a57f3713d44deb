"""Plain-text training logs of no known format: a step counter and ``key: value`` / ``key = value`` / ``key=value``.

The fallback text format: :func:`~trainhealth.collectors.importers.detect` picks it only when no line of a
specific text format is found. A line is a step when it has a step counter and a metric::

    step 12972 \\t loss = 0.854, (1.013 sec/step)                    (TensorFlow-style scripts)
    step    1/74 | loss 11.010 (+nanz)| norm 15.4 (+nanz)| lr 8.57e-07 | 1234.56 ms | 42.1% bf16 MFU
    [iter 500] train_loss=2.31 grad_norm=0.92 lr=3.0e-4 step_time=0.25s
    global_step: 300, lm loss: 3.25, learning rate: 1e-4, elapsed: 0:05:00

Found by name, case and ``_``/``-``/space ignored (``grad_norm`` = ``grad norm`` = ``Grad-Norm``), with
``:``, ``=`` or a space between key and value:

- the step: ``global_step``, ``step``, ``iteration`` or ``iter``, the first on the line (``N/M`` reads
  N). A counter that restarts each epoch is read as it is.
- loss: ``loss``, ``train_loss``, ``training loss``, ``lm loss``, ``total loss`` — not ``val``/``eval``/
  ``test``/``dev`` ones, not ``loss_scale``, not ``loss_<term>``; ``tensor(2.3)`` reads 2.3.
- grad norm: ``grad_norm``, ``gradient norm``, ``gnorm``, ``norm`` (not ``param``/``weight``/``update`` norms).
- learning rate: ``lr``, ``learning_rate`` (not ``base_lr``).
- seconds per step: a rate ``1.013 sec/step``, ``250ms/step``, ``132.6s/it`` or ``4.5 it/s``; else a
  named step time (``step_time``, ``time/iter``, ``iter_time``, ``batch_time``, ``ms/batch``, ``time``,
  …) with its unit — on the value (``250ms``, ``0.25s``) or the key (``time (ms)``, ``step_time_ms``),
  else seconds; else a table cell holding only a duration (``| 1234.56 ms |``); else a cumulative
  clock (``elapsed``, ``elapsed_time``, ``train_time``, ``total_time``: seconds, a unit, or
  ``H:MM:SS``): its difference over the steps since the previous reading (the first reading over its
  step count). A bare ``time`` is the step's own time (nanoGPT, mmengine print it so); a cumulative
  one must be named as a clock.

``NaN``/``inf`` are kept. A line with a step but no metric (``Saving checkpoint at step 1000``) is
not a step; save lines (``The checkpoint has been created.``, ``Saving checkpoint …``, ``saved
checkpoint``) are ``checkpoint_save`` events at the last step logged before them. A step line whose
loss, grad norm or learning rate after ``:``/``=`` is not a number, or whose step is out of range,
is skipped with one warning for all of them. A last line without its line end that lacks the metric
the step line before it ends with (``step 13001 \\t loss = 0.86`` after ``… (1.0 sec/step)``) was cut
mid-write: it is left out with a warning naming its line and byte offset, as a line that does not parse.
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
    Timeline,
    reason,
    show,
    step_of,
    to_float,
    to_seconds,
)
from trainhealth.logpoint import LogEvent, LogPoint


def _alternatives(names: list[str]) -> str:
    return "|".join(re.escape(n).replace(r"\ ", "[ _-]?") for n in sorted(names, key=len, reverse=True))


#: Step names.
STEP_NAMES = ("global step", "step", "iteration", "iter")
STEP = re.compile(rf"(?<![\w/.-])(?P<key>{_alternatives(list(STEP_NAMES))})(?![\w/-])\s*(?:[:=#]\s*|\s+)\[?\s*"
                  r"(?P<n>\d+)(?![\d.]*\d)(?:\s*(?:/|of)\s*\d+)?", re.IGNORECASE)
#: Metric names → field, preferred first within a field.
NAMES: dict[str, tuple[str, ...]] = {
    "loss": ("train loss", "training loss", "train/loss", "lm loss", "total loss", "loss"),
    "grad_norm": ("grad norm", "gradient norm", "global grad norm", "grad norm total", "gnorm", "norm"),
    "lr": ("learning rate", "lr"),
    "time": ("elapsed time per iteration", "step time", "time per step", "time/step", "iter time", "iteration time",
             "time per iteration", "time per iter", "time/iter", "time/iteration", "batch time", "time/batch",
             "step duration", "time"),
    "clock": ("elapsed time", "time elapsed", "elapsed", "train time", "training time", "total time"),
    "ms": ("ms/step", "ms/iter", "ms/it", "ms/iteration", "ms/batch"),
    "s": ("s/step", "sec/step", "s/it", "s/iter", "sec/it", "s/batch"),
}
_FIELD_OF = {re.sub(r"[ _-]", "", n.lower()): (f, i) for f, names in NAMES.items() for i, n in enumerate(names)}
KEY = re.compile(rf"(?<![A-Za-z0-9.])(?P<key>{_alternatives([n for names in NAMES.values() for n in names])})"
                 r"(?P<unit>\s*\((?:ms|s|sec)\)|_ms|_sec|_s|\s*\[(?:ms|s)\])?(?![\w-])"
                 r"\s*(?P<sep>[:=]\s*|\s+)(?P<val>[^\s,;|)\]}]+\)?)", re.IGNORECASE)
#: The word just before a metric's name (``val`` of ``val_loss``, ``val loss``, ``val/loss``).
PRE = re.compile(r"([A-Za-z]+)([ _/-]?)$")
#: Words before a metric's name that make it another metric: a validation loss, a parameter norm, a base lr.
NOT_TRAIN = frozenset({"val", "valid", "validation", "eval", "evaluation", "test", "dev", "param", "parameter",
                       "params", "weight", "weights", "update", "base", "act", "activation", "embedding"})
RATE = re.compile(r"(?<![\w.])(?P<v>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)\s*(?:(?P<u>ms|msec|s|sec|secs|seconds?)\s*/\s*"
                  r"(?:step|it|iter|iteration|batch)|(?P<inv>it|its|iters?|iterations?|steps?|batch(?:es)?)\s*/\s*"
                  r"(?:s|sec|second))\b", re.IGNORECASE)
DAYS = re.compile(r"-?\d+ days?, \d+:\d\d:\d\d(?:\.\d+)?")
#: A table cell that is only a duration (llm.c's stdout: ``| lr 8.57e-07 | 1234.56 ms | 42.1% bf16 MFU |``).
BARE = re.compile(r"\|\s*(\d+(?:\.\d*)?)\s*(ms|s)\s*(?=\|)")
NUMBER = re.compile(r"([-+]?(?:nan|inf(?:inity)?|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))(ms|msec|s|sec|secs|seconds)?",
                    re.IGNORECASE)


def sniff_line(line: str) -> bool:
    low = line.lower()
    if "step" not in low and "iter" not in low:
        return False
    if STEP.search(line) is None:
        return False
    return any(_FIELD_OF.get(_norm(m.group("key")), ("",))[0] in ("loss", "grad_norm", "lr")
               for m in KEY.finditer(line)) or RATE.search(line) is not None


def _norm(key: str) -> str:
    return re.sub(r"[ _-]", "", key.lower())


def _seconds(value: str, unit: str | None, scale: float) -> float | None:
    """A time value with its unit (on the value, else ``unit`` from the key, else ``scale``); None if not one."""
    m = NUMBER.fullmatch(value)
    if m is None:
        return None
    x = float(m.group(1))
    u = (m.group(2) or unit or "").lower()
    return x / 1000.0 if u in ("ms", "msec") else x if u else x * scale


#: The fields as a warning names them.
SHOWN = {"loss": "loss", "grad_norm": "grad norm", "lr": "learning rate", "time": "step time", "clock": "elapsed time"}


def _parse(text: str) -> tuple[dict[str, float | None], str | None]:
    """The metrics on a step line, in the order they are on it, or the reason it is malformed."""
    best: dict[str, tuple[float, float | None, int]] = {}  # field → (name priority, value, where on the line)
    for m in KEY.finditer(text):
        field, rank = _FIELD_OF[_norm(m.group("key"))]
        pre = PRE.search(text, max(0, m.start() - 24), m.start())
        if pre is not None:
            if pre.group(1).lower() in NOT_TRAIN:
                continue
            rank += 0.5 if pre.group(2) in ("_", "/", "-") else 0  # rpn_loss: after a plain loss
        value = m.group("val")
        if field in ("loss", "grad_norm", "lr"):
            v = value[7:].rstrip(")") if value.lower().startswith("tensor(") else value.rstrip(")")
            strict = m.group("sep").strip() != ""
            number = NUMBER.fullmatch(v)
            if number is None or number.group(2) is not None:  # not a number, or a time ("5s")
                if strict:
                    return {}, f"field {m.group('key')!r} is not a number: {show(value)}"
                continue
            try:
                x = to_float(v)
            except ValueError as exc:
                return {}, f"field {m.group('key')!r} is {reason(exc)}: {show(value)}"
        else:
            unit = (m.group("unit") or "").strip(" ()[]_").lower() or None
            if field == "clock":
                days = DAYS.match(text, m.start("val"))  # str(timedelta) of a day or more: "1 day, 0:10:30"
                if days is not None:
                    value = days.group(0)
                try:
                    x = to_seconds(value) if ":" in value else _seconds(value, unit, 1.0)
                except ValueError:
                    x = None
            else:
                x = _seconds(value.rstrip(")"), unit, 1e-3 if field == "ms" else 1.0)
                field = "time"
            if x is None or not math.isfinite(x) or x < 0:
                continue
        if field not in best or rank < best[field][0]:
            best[field] = (rank, x, m.start())
    r = RATE.search(text)
    if r is not None:
        x = float(r.group("v"))
        if r.group("inv"):
            best["time"] = (0, 1.0 / x if x > 0 else None, r.start())
        else:
            best["time"] = (0, x / 1000.0 if r.group("u").lower() in ("ms", "msec") else x, r.start())
    elif "time" not in best and "|" in text and (b := BARE.search(text)) is not None:
        best["time"] = (0, float(b.group(1)) / (1000.0 if b.group(2) == "ms" else 1.0), b.start())
    return {f: v for f, (_, v, _) in sorted(best.items(), key=lambda kv: kv[1][2])}, None


def read(path: str | Path) -> Iterator[LogPoint | LogEvent]:
    """Yield one point per step line (a step counter and a metric), and the checkpoint saves, in file order.

    Raises
    ------
    InputFormatError
        When no step line can be read (naming the first malformed one, if any).

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("step 12999 \\t loss = 0.915, (1.017 sec/step)\\nThe checkpoint has been created.\\n"
    ...             "step 13000 \\t loss = 5.128, (5.495 sec/step)\\n"
    ...             "[iter 13001] train_loss=nan val_loss=0.9 grad_norm=1.5 lr=3e-4 time/iter: 740ms\\n"); f.close()
    >>> for item in read(f.name):
    ...     print(item)  # doctest: +ELLIPSIS
    LogPoint(step=12999, loss=0.915, ..., source_line=1, step_seconds=1.017, ...)
    LogEvent(kind='checkpoint_save', step=12999, rank=None, seconds=None, fields=(), source_line=2)
    LogPoint(step=13000, loss=5.128, ..., source_line=3, step_seconds=5.495, ...)
    LogPoint(step=13001, loss=nan, grad_norm=1.5, lr=0.0003, ..., source_line=4, step_seconds=0.74, ...)
    >>> os.unlink(f.name)
    """
    path = Path(path)
    lines = Lines(path)
    bad = BadLines(path, "step", lines=lines)
    checkpoints = Checkpoints()
    clock = Timeline(elapsed=True)
    good = 0
    last: int | None = None
    step: int | None = None  # the last step logged
    for lineno, text in lines:
        m = STEP.search(text) if ("tep" in text or "ter" in text or "TEP" in text or "TER" in text) else None
        if m is not None:
            vals, err = _parse(text)
            if err is None and not vals.keys() & {"loss", "grad_norm", "lr", "time"}:
                m = None  # a step but no metric: not a step line
            elif err is None:
                try:
                    this = step_of(m.group("n"))
                except ValueError as exc:
                    err = f"field {m.group('key')!r} is {exc}: {show(m.group('n'))}"
            if err is not None:
                bad.add(lineno, err)
                continue
            if bad.cut_short(lineno, [SHOWN[f] for f in vals], step=this):  # its last metrics cut off
                continue
        if m is None:
            event = checkpoints.event(text, lineno, step)
            if event is not None:
                last = lineno
                yield event
            continue
        per = vals.get("time")
        from_clock = clock.per_step(this, vals.get("clock")) if "clock" in vals else None
        good += 1
        last = lineno
        step = this
        yield LogPoint(step=this, loss=vals.get("loss"), grad_norm=vals.get("grad_norm"), lr=vals.get("lr"),
                       step_seconds=per if per is not None else from_clock, source_line=lineno)
    bad.finish(good, last)
