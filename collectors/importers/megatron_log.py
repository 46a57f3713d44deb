"""Megatron-LM, Megatron-DeepSpeed, GPT-NeoX and NeMo stdout: an ``iteration N/ M | key: value |`` line per interval.

Megatron-LM / Megatron-DeepSpeed / GPT-NeoX::

     iteration     6502/  159576 | consumed samples: 216960 | elapsed time per iteration (ms): 31074.1 |
     learning rate: 5.997E-05 | global batch size: 80 | lm loss: 3.876781E+00 | loss scale: 4096.0 |
     grad norm: 3246.595 | number of skipped iterations: 0 | number of nan iterations: 0 |

(one line; GPT-NeoX starts with ``samples/sec: … |`` and names the loss ``lm_loss``; newer
Megatron-LM prefixes a ``[date time]``; launchers may prefix ``[default7]:``). NeMo 2::

    Training epoch 0, iteration 9/99 | lr: 1.5e-05 | global_batch_size: 32 | global_step: 9 |
    reduced_train_loss: 11.03 | train_step_timing in s: 0.52 | consumed_samples: 320

(one line; the step is ``global_step``, ``iteration`` counts within the epoch).

Read: the step, loss (``lm loss``/``lm_loss``/``reduced_train_loss``), ``grad norm``, learning
rate, elapsed time per iteration (ms or s; NeMo's ``train_step_timing in s``) as seconds per
step, consumed samples, consumed tokens (cumulative → tokens since the previous line), and the
skipped and NaN iteration counts.

A Megatron line without its loss: Megatron-LM's ``training_log`` (``megatron/training/training.py``)
adds an iteration's loss to the interval's sum only when the iteration was not skipped, and prints
a loss key only ``if avg >= 0.0`` (Megatron-DeepSpeed and older Megatron-LM: ``> 0.0``), so a NaN or
infinite loss is left out of the line while ``number of nan iterations`` — which counts *skipped*
iterations with a non-finite loss — stays 0. Read as: with NaN iterations counted, the loss is NaN;
with skipped iterations covering the whole interval since the previous line (or any skipped on the
first line, whose interval is unknown), the loss is absent because nothing was applied (also when
newer Megatron-LM prints that interval's empty sum as ``lm loss: 0.000000E+00``); otherwise
``LogPoint.loss_missing`` is set: the loss was not finite on an applied iteration. NeMo lines are
read as they are.

DeepSpeed's ``OVERFLOW! Rank 0 Skipping step. Attempted loss scale: …`` lines (fp16 dynamic loss
scaling, also ``fp16 dynamic loss scale overflow! Skipping step``) precede the iteration line of
the step they skipped and are counted into its ``skipped`` (Megatron's own counter stays 0 when
DeepSpeed's engine does the skipping; the larger of the two counts is kept).

Excerpts pasted into documents survive: a Megatron line hard-wrapped onto up to three more lines
is re-joined (its keys are matched ignoring whitespace, so ``number of skipped iteratio`` +
``ns: 0`` reads right); ``#`` comment lines, ``...``/``[...]`` elisions, blank lines and any other
output are ignored. A Megatron line that still does not end with ``|`` (torn by a crash) or whose
known field is not a number is skipped, with one warning for all of them naming the first.

A file cut mid-line (a crash, a copy of a log being written): a last line without its line end that
does not end with ``|``, or that does but lacks the key the iteration line before it ends with (cut
right after a ``|``: ``number of nan iterations``, ``TFLOPs``), is left out with a warning naming its
line, its byte offset and the missing keys; booked, it would be a step with fields missing (a loss
"left out by Megatron" where the cut took it). A complete last line without a line end is read.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from trainhealth.collectors.importers._common import (
    NOT_A_NUMBER,
    BadLines,
    CumulativeTokens,
    Lines,
    reason,
    show,
    step_of,
    to_float,
    to_step,
)
from trainhealth.logpoint import LogPoint

START = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)")
RECORD = re.compile(r"\biteration\s+\d+\s*/\s*\d+\s*\|")
NEMO = re.compile(r"\bTraining epoch\s+\d+,\s*iteration\s+\d+\s*/\s*\d+\s*\|")
OVERFLOW = re.compile(r"overflow!\s*(?:rank\s+(\d+)\s+)?skipping step", re.IGNORECASE)
MAX_WRAPPED = 3

# Key (lower case, all whitespace removed) → (field, scale).
KEYS: dict[str, tuple[str, float]] = {
    "lmloss": ("loss", 1.0), "lm_loss": ("loss", 1.0), "reduced_train_loss": ("loss", 1.0), "loss": ("loss", 1.0),
    "gradnorm": ("grad_norm", 1.0), "grad_norm": ("grad_norm", 1.0),
    "learningrate": ("lr", 1.0), "lr": ("lr", 1.0),
    "elapsedtimeperiteration(ms)": ("step_seconds", 1e-3), "elapsedtimeperiteration(s)": ("step_seconds", 1.0),
    "train_step_timingins": ("step_seconds", 1.0),
    "consumedsamples": ("consumed_samples", 1.0), "consumed_samples": ("consumed_samples", 1.0),
    "consumedtokens": ("tokens_total", 1.0),
    "numberofskippediterations": ("skipped", 1.0), "numberofnaniterations": ("nan", 1.0),
    "global_step": ("step", 1.0),
}


def sniff_line(line: str) -> bool:
    return RECORD.search(line) is not None and ":" in line


#: Fields that are counts: a NaN or infinite count is not a count (and ``int()`` of it raises).
COUNTS = ("consumed_samples", "tokens_total", "skipped", "nan")


def _parse(text: str, nemo: bool) -> tuple[dict[str, float], int, str | None, list[str]]:
    """Fields and step of one (re-joined) record, or the reason it is malformed; and every key on it, in order."""
    if not nemo and not text.rstrip().endswith("|"):
        return {}, 0, "the line ends before its closing '|' (torn or wrapped beyond repair)", []
    m = START.search(text)
    assert m is not None
    try:
        step = step_of(m.group(1))  # 400 digits would overflow the timeline
    except ValueError as exc:
        return {}, 0, f"field 'iteration' is {exc}: {show(m.group(1))}", []
    fields: dict[str, float] = {}
    keys: list[str] = []  # known or not: a line cut after a '|' lacks the last ones (BadLines.cut_short)
    for seg in text[m.end():].split("|"):
        key, sep, value = seg.rpartition(":")
        if not sep:
            continue
        keys.append(key)
        known = KEYS.get(re.sub(r"\s+", "", key).lower())
        if known is None:
            continue
        name, scale = known
        v = value.strip()
        shown = " ".join(key.split())
        try:
            if name == "step":  # NeMo's global_step
                step = to_step(v)
                continue
            x = to_float(v)
            if x is None:
                raise ValueError(NOT_A_NUMBER)
        except ValueError as exc:
            return {}, 0, f"field {shown!r} is {reason(exc)}: {show(v)}", []
        if name in COUNTS and not math.isfinite(x):
            return {}, 0, f"field {shown!r} is not a finite count: {show(v)}", []
        fields[name] = x * scale
    if not any(k in fields for k in ("loss", "grad_norm", "lr")):
        return {}, 0, "no loss, grad norm or learning rate on the line", []
    return fields, step, None, keys


def read(path: str | Path) -> Iterator[LogPoint]:
    """Yield one point per iteration line, in file order.

    Raises
    ------
    InputFormatError
        When no iteration line can be read (naming the first malformed one, if any).

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write(" iteration 10/ 100 | consumed samples: 80 | elapsed time per iteration (ms): 1500.0 | "
    ...             "learning rate: 1.0E-04 | global batch size: 8 | lm loss: 7.5E+00 | loss scale: 1.0 | "
    ...             "grad norm: 2.5 | number of skipped iterations: 0 | number of nan iterations: 0 |\\n"); f.close()
    >>> [(p.step, p.loss, p.grad_norm, p.step_seconds, p.skipped, p.consumed_samples) for p in read(f.name)]
    [(10, 7.5, 2.5, 1.5, 0, 80)]
    >>> os.unlink(f.name)
    """
    path = Path(path)
    source = Lines(path)
    bad = BadLines(path, "iteration", lines=source)
    tokens = CumulativeTokens()
    overflows: Counter[int] = Counter()
    lines = iter(source)
    held: list[tuple[int, str]] = []
    good = 0
    last: int | None = None  # the last line of the last record read
    prev_step: int | None = None  # the iteration of the previous record read

    def next_line() -> tuple[int, str] | None:
        return held.pop() if held else next(lines, None)

    while (cur := next_line()) is not None:
        lineno, text = cur
        o = OVERFLOW.search(text)
        if o:
            overflows[int(o.group(1)) if o.group(1) else -1] += 1
            last = lineno
            continue
        if START.search(text) is None or text.lstrip().startswith("#"):
            continue
        nemo = NEMO.search(text) is not None
        parts, end = [text], lineno
        while not nemo and len(parts) <= MAX_WRAPPED and not parts[-1].rstrip().endswith("|"):
            peek = next_line()
            if peek is None:
                break
            s = peek[1].strip()
            if not s or s[0] in "#[" or START.search(peek[1]) or OVERFLOW.search(peek[1]):
                held.append(peek)
                break
            parts.append(peek[1])
            end = peek[0]
        fields, step, err, keys = _parse("".join(parts), nemo)
        if err is not None:
            bad.add(end if end == source.torn else lineno, err)  # a record cut by the file's end: truncated
            continue
        if bad.cut_short(lineno, keys, end, step):  # cut right after a '|': it parses, its last fields missing
            continue
        last = end
        skipped = fields.get("skipped")
        seen = max(overflows.values(), default=0)
        overflows.clear()
        if seen:
            skipped = max(skipped or 0.0, float(seen))
        loss, missing = fields.get("loss"), False
        if not nemo:
            # Skipped iterations covering the interval since the previous line (any, on the first line: its
            # interval is unknown) applied nothing: no loss to print (newer Megatron-LM prints the empty sum, 0).
            all_skipped = bool(skipped) and (prev_step is None or skipped >= step - prev_step)
            if loss == 0.0 and all_skipped:
                loss = None
            if loss is None:
                if fields.get("nan", 0.0) > 0:
                    loss = math.nan  # the line counts the NaN iterations itself
                elif not all_skipped:
                    missing = True  # an applied iteration's loss was not finite: Megatron left it out
        prev_step = step
        good += 1
        yield LogPoint(
            step=step, loss=loss, grad_norm=fields.get("grad_norm"),
            lr=fields.get("lr"), tokens=tokens.delta(fields.get("tokens_total")), source_line=lineno,
            step_seconds=fields.get("step_seconds"), skipped=None if skipped is None else int(skipped),
            consumed_samples=int(fields["consumed_samples"]) if "consumed_samples" in fields else None,
            loss_missing=missing)
    bad.finish(good, last)
