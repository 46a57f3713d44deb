"""Hugging Face Trainer stdout: the log dicts it prints, its tqdm progress bar, DeepSpeed's overflow lines.

The Trainer's ``ProgressCallback.on_log`` writes each log as ``str(dict)`` through its bar (``PrinterCallback``
prints it without one)::

     9%|▉         | 250/2724 [9:14:53<91:10:34, 132.67s/it]
    {'loss': 1.89, 'learning_rate': 0.00019920353585932578, 'epoch': 0.18}
    {'loss': 0.0, 'grad_norm': nan, 'learning_rate': 5e-05, 'epoch': 0.54}
    {'loss': '1.89', 'grad_norm': '0.52', 'learning_rate': '5e-05', 'epoch': '0.18'}
    {'eval_loss': 2.1, 'eval_runtime': 12.5, 'eval_samples_per_second': 8.0, 'epoch': 1.0}
    {'train_runtime': 3600.0, 'train_samples_per_second': 2.2, 'train_loss': 1.5, 'epoch': 3.0}

Python literal syntax, single quotes, bare ``nan``/``inf``/``-inf`` (newer versions print every float
as a ``'%.4g'`` string); parsed by a small tokenizer of flat dicts, never evaluated. Training dicts
(``loss``, ``grad_norm``, ``learning_rate``; ``num_input_tokens_seen`` cumulative → tokens) are
steps; evaluation dicts (``eval_runtime``, ``eval_<set>_runtime``, ``test_runtime``) are
evaluations lasting that runtime; the closing summary (``train_runtime``) is not a step.

The dicts carry no step. The step is the counter ``N`` of the training progress bar (``N/M [elapsed<
remaining, rate]``, tqdm's ``format_meter``) last drawn before the dict: the Trainer's bar counts
optimizer steps (``global_step``). Which bar is the training bar: the one the training dicts follow
(they are written through it); in a log without dicts, the bar with the most distinct counters
(others: ``Map``, ``Loading checkpoint shards``, evaluation bars); bars counting anything but ``it``
(``examples/s``, ``B/s``) never are. A log without a training bar (``disable_tqdm``, a pasted excerpt)
gets the **ordinal** of each training dict as its step (1, 2, 3, …), with a warning saying so; a
dict with its own ``step`` key keeps it.

Each training-bar counter is a step point too, deduplicated (the bar is redrawn at the same
counter after each dict and at every carriage return: one point per counter), with its seconds
per step: the difference of the bar's elapsed clock over the steps since the previous counter
when that is at least a minute (the clock shows whole seconds: under 2 % off), else the bar's own
rate (tqdm smooths it over recent updates; ``s/it``, or ``1 / it/s``). A training dict at that
counter adds its loss, grad norm and learning rate to the same point. A postfix on the bar
(``…, 2.50it/s, loss=0.5, lr=1e-4]``) is read the same way.

DeepSpeed's fp16 ``OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 2048, reducing to 1024``
(and the older forms, :data:`~trainhealth.collectors.importers._common.OVERFLOW`) is printed during the optimizer
step of the step in progress — after the bar showed the previous step, before it shows this one —
so it counts one skipped step (``LogPoint.skipped``) on the next counter the bar shows. In a log
that prints such lines, the other points have ``skipped`` 0; in one that does not, None (unknown).
Checkpoint saves (``Saving model checkpoint to …``) are ``checkpoint_save`` events at the current
step. A dict that does not parse, or whose field is not a number, is skipped with one warning for all.

A file cut mid-line (a crash, a copy of a log being written): a last line without its line end that
does not parse is left out with a warning naming its line and byte offset — a dict cut anywhere
before its closing ``}`` is one (``{'loss': 1.89, 'learning_rate': 0.0002, 'epo``). A training bar
on it that lacks what the training bar before it ends with — its rate (``6/30 [00:13<00:52,
2.19s/``), when its elapsed clock does not time the step (under a minute since the previous
counter; a cut clock reads short, ``[9:32:3`` as 9:32), or a postfix metric — is left out the same
way: booked, its step would have no time, or its postfix loss missing. A bar cut in its remaining
time or rate whose clock times the step (``259/2724 [9:34:48<90:54:``, 132 s after 258) is read.
A log with training-bar or dict lines among other text is this format; one whose metrics are printed
by other lines beside a bar is read with ``fmt="text_kv"``.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers._common import (
    NOT_A_STEP,
    BadLines,
    Checkpoints,
    CumulativeTokens,
    Lines,
    Overflows,
    log,
    parse_bar,
    reason,
    show,
    step_of,
    to_float,
    to_step,
)
from trainhealth.logpoint import LogEvent, LogPoint

#: A Trainer log dict: ``{`` then one of the keys the Trainer logs first.
DICT = re.compile(r"\{\s*(['\"])(?:loss|grad_norm|learning_rate|eval_[\w/.-]*|test_[\w/.-]*|train_runtime|"
                  r"train_loss|epoch|step)\1\s*:")
TRAIN_KEY = re.compile(r"['\"](?:loss|grad_norm|learning_rate)['\"]\s*:")
_TOKEN = re.compile(r"""\s*(?:(?P<s>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")"""
                    r"|(?P<n>[-+]?(?:nan|inf|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\w.]))"
                    r"|(?P<w>True|False|None)(?!\w)|(?P<p>[{}:,]))")
#: Dict key → LogPoint field (the first present wins).
FIELDS = {"loss": ("loss",), "grad_norm": ("grad_norm",), "lr": ("learning_rate", "lr"),
          "tokens_total": ("num_input_tokens_seen", "num_tokens")}
#: A bar postfix's ``key=value`` (tqdm's ``set_postfix``).
POSTFIX = re.compile(r"(?:^|,)\s*([\w/.-]+)=([^,\]]+)")
POSTFIX_KEYS = {"loss": "loss", "train_loss": "loss", "step_loss": "loss", "grad_norm": "grad_norm",
                "gnorm": "grad_norm", "lr": "lr", "learning_rate": "lr"}
MIN_CLOCK_SPAN = 60.0  # seconds of the bar's elapsed clock for its difference to be the step time


def parse_dict(text: str, start: int) -> dict[str, Any]:
    """The flat dict literal at ``text[start:]`` (strings, numbers, bare nan/inf, True/False/None).

    Numbers stay text (the converters read them); raises ValueError saying what is wrong.

    >>> parse_dict("{'loss': 0.0, 'grad_norm': nan, 'lr': '5e-05', 'x': -inf, 'ok': True}", 0)
    {'loss': '0.0', 'grad_norm': 'nan', 'lr': '5e-05', 'x': '-inf', 'ok': True}
    """
    out: dict[str, Any] = {}
    pos, expect = start, "{"
    key: str | None = None
    while True:
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            at = len(text) - len(text[pos:].lstrip()) + 1
            if pos >= len(text.rstrip()):
                raise ValueError(f"not a complete flat dict: the line ends at column {at}")
            if text[at - 1] in "'\"" and text[at - 1] not in text[at:]:
                raise ValueError(f"not a complete flat dict: the line ends in the string at column {at}")
            if expect == "value":
                raise ValueError(f"not a flat dict of numbers and strings: key {key!r} at column {at}")
            raise ValueError(f"not a flat dict: {text[at - 1:at + 19]!r} at column {at}")
        pos = m.end()
        tok, kind = m.group(m.lastgroup or "p"), m.lastgroup
        if expect == "{":
            if tok != "{":
                raise ValueError("not a dict")
            expect = "key"
        elif expect == "key":
            if tok == "}" and not out:
                return out
            if kind != "s":
                raise ValueError(f"not a flat dict: a key that is not a string at column {m.start() + 1}")
            key, expect = _string(tok), ":"
        elif expect == ":":
            if tok != ":":
                raise ValueError(f"not a flat dict: no ':' after key {key!r}")
            expect = "value"
        elif expect == "value":
            if kind == "s":
                out[key] = _string(tok)
            elif kind == "n":
                out[key] = tok
            elif kind == "w":
                out[key] = {"True": True, "False": False, "None": None}[tok]
            else:
                raise ValueError(f"not a flat dict of numbers and strings: key {key!r} at column {m.start() + 1}")
            expect = ","
        elif tok == "}":
            return out
        elif tok != ",":
            raise ValueError(f"not a flat dict: no ',' after key {key!r}")
        else:
            expect = "key"


def _string(tok: str) -> str:
    try:
        return ast.literal_eval(tok)  # a string literal only (the tokenizer matched one): safe
    except (ValueError, SyntaxError):
        raise ValueError(f"not a flat dict: an unreadable string {show(tok)}") from None


def _runtime_key(d: dict[str, Any]) -> str | None:
    if "eval_runtime" in d:
        return "eval_runtime"
    return next((k for k in d if k.endswith("_runtime") and k != "train_runtime"), None)


def sniff_line(line: str) -> bool:
    if "{" in line and DICT.search(line) is not None:
        return True
    bar = parse_bar(line)
    return bar is not None and bar.unit == "it"


@dataclass
class _Point:
    step: int
    line: int
    step_seconds: float | None = None
    skipped: int | None = None
    vals: dict[str, float | None] = field(default_factory=dict)
    merged: bool = False  # a training dict's values are in

    def point(self, tokens: CumulativeTokens) -> LogPoint:
        v = self.vals
        return LogPoint(step=self.step, loss=v.get("loss"), grad_norm=v.get("grad_norm"), lr=v.get("lr"),
                        tokens=tokens.delta(v.get("tokens_total")), source_line=self.line,
                        step_seconds=self.step_seconds, skipped=self.skipped)


def _scan(path: Path) -> tuple[tuple[str, int | None] | None, bool]:
    """First pass: the training bar's (description, total), and whether the log prints overflow lines."""
    stats: dict[tuple[str, int | None], list[Any]] = {}  # key → [training dicts after it, counters seen]
    last: tuple[str, int | None] | None = None
    overflows = False
    for _, text in Lines(path):
        bar = parse_bar(text)
        if bar is not None and bar.unit == "it":
            last = (bar.desc, bar.total)
            st = stats.setdefault(last, [0, set()])
            if len(st[1]) < 1_000_000:
                st[1].add(bar.n)
        if "{" in text and last is not None and DICT.search(text) and TRAIN_KEY.search(text):
            stats[last][0] += 1
        if not overflows and ("verflow!" in text or "VERFLOW!" in text):
            overflows = Overflows().add(text)
    if not stats:
        return None, overflows
    best = max(stats, key=lambda k: (stats[k][0], len(stats[k][1]), k[1] or 0))
    return best, overflows


def read(path: str | Path) -> Iterator[LogPoint | LogEvent]:
    """Yield the steps (training-bar counters and training dicts), evaluations and checkpoint saves, in file order.

    Raises
    ------
    InputFormatError
        When neither a training bar nor a log dict can be read (naming the first malformed dict, if any).

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write(" 9%|▉ | 9/100 [01:30<15:10, 10.00s/it]\\r 10%|█ | 10/100 [01:40<15:00, 10.00s/it]\\n"
    ...             "{'loss': 2.5, 'grad_norm': nan, 'learning_rate': 5e-05, 'epoch': 0.1}\\n"
    ...             " 10%|█ | 10/100 [01:40<15:00, 10.00s/it]\\n"
    ...             "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 2048, reducing to 1024\\n"
    ...             " 11%|█ | 11/100 [01:50<14:50, 10.00s/it]\\n"
    ...             "{'eval_loss': 2.75, 'eval_runtime': 4.5, 'epoch': 0.11}\\n"); f.close()
    >>> for p in read(f.name):
    ...     print(p.step, p.loss, p.grad_norm, p.step_seconds, p.skipped, p.eval_seconds)
    9 None None 10.0 0 None
    10 2.5 nan 10.0 0 None
    11 None None 10.0 1 None
    11 None None None None 4.5
    >>> os.unlink(f.name)
    """
    path = Path(path)
    step_bar, any_overflow = _scan(path)
    lines = Lines(path)
    bad = BadLines(path, "Trainer log dict", lines=lines)
    overflows, checkpoints, tokens = Overflows(), Checkpoints(), CumulativeTokens()
    good = 0
    last: int | None = None
    cur: int | None = None                       # the training bar's counter (the current step)
    clock: tuple[int, float] | None = None       # (counter, elapsed) of its first draw
    pending: _Point | None = None                # the point of the current counter, until the next one
    ordinal = 0                                  # training dicts so far (the step without a bar)
    told = False
    seen_overflow = False

    def skipped() -> int | None:
        n = overflows.take()
        # A followed log (trainhealth follow) was scanned before its first overflow line was written: one seen
        # since says the job prints them too.
        return n if any_overflow or seen_overflow else None

    for lineno, text in lines:
        bar = parse_bar(text)
        if bar is not None:
            last = lineno
            if step_bar is not None and (bar.desc, bar.total) == step_bar and (
                    bar.unit == "it" or (bar.unit == "i" and lineno == lines.torn)):  # "132.68s/i": its unit cut
                try:
                    n = step_of(bar.n)
                except ValueError as exc:
                    bad.add(lineno, f"the bar's counter is {exc}: {show(bar.n)}")
                    n = None
                if n is not None and n != cur and bar.started:
                    cur, clock = n, (n, bar.elapsed)  # the bar's first draw: no step done, none timed
                elif n is not None and n != cur:
                    per = bar.seconds_per_unit
                    if clock is not None and n > clock[0] and bar.elapsed - clock[1] >= MIN_CLOCK_SPAN:
                        per = (bar.elapsed - clock[1]) / (n - clock[0])
                    post, keys = _postfix(text)
                    # The file's torn last line, cut before its rate (and its clock does not time the step) or in
                    # its postfix: a step without its time or metrics. A rate the clock makes up for is not missed.
                    if not bad.cut_short(lineno, ["rate", *keys] if per is not None else keys, step=n):
                        if pending is not None:
                            yield pending.point(tokens)
                        pending = _Point(n, lineno, per, skipped(), post)
                        good += 1
                        cur, clock = n, (n, bar.elapsed)
        if overflows.add(text):
            last = lineno
            seen_overflow = True
            continue
        if "{" in text and (m := DICT.search(text)) is not None:
            try:
                d = parse_dict(text, m.start())
                kind, vals = _kind(d)
                explicit = _step(d)
            except ValueError as exc:
                bad.add(lineno, str(exc))
                if TRAIN_KEY.search(text) and "_runtime" not in text:
                    ordinal += 1  # a training dict all the same: the next one is the next step
                continue
            last = lineno
            if kind is None:
                continue  # the closing summary, or a dict of something else
            step = explicit if explicit is not None else cur if cur is not None else ordinal + (kind == "train")
            if kind == "train":
                ordinal += 1
                if explicit is None and cur is None and not told:
                    log.warning("%s: no training progress bar before the log dicts: their steps are the ordinals "
                                "of the training dicts (1, 2, 3, …), not the optimizer steps", path)
                    told = True
                good += 1
                if pending is not None and pending.step == step and not pending.merged:
                    pending.vals.update(vals)  # the dict logged at the bar's counter: one point
                    pending.line, pending.merged = lineno, True
                    continue
                if pending is not None:
                    yield pending.point(tokens)
                pending = _Point(step, lineno, None, skipped() if cur is None else None, vals, merged=True)
                continue
            if pending is not None:
                yield pending.point(tokens)
                pending = None
            good += 1
            yield LogPoint(step=step, eval_seconds=vals["eval_seconds"], source_line=lineno)
            continue
        event = checkpoints.event(text, lineno, cur if cur is not None else (ordinal or None))
        if event is not None:
            last = lineno
            if pending is not None:
                yield pending.point(tokens)
                pending = None
            yield event
    if pending is not None:
        yield pending.point(tokens)
    bad.finish(good, last)


def _step(d: dict[str, Any]) -> int | None:
    """A dict's own ``step``, if it has one (custom callbacks add it)."""
    if "step" not in d:
        return None
    try:
        return to_step(d["step"])
    except ValueError as exc:
        raise ValueError(f"field 'step' is {reason(exc, NOT_A_STEP)}: {show(d['step'])}") from None


def _kind(d: dict[str, Any]) -> tuple[str | None, dict[str, float | None]]:
    """``("train", fields)``, ``("eval", {"eval_seconds": s})`` or ``(None, {})`` for the summary and others."""
    if "train_runtime" in d:
        return None, {}
    runtime = _runtime_key(d)
    if runtime is not None or any(k.startswith("eval_") for k in d):
        try:
            s = to_float(d.get(runtime)) if runtime is not None else None
        except ValueError as exc:
            raise ValueError(f"field {runtime!r} is {reason(exc)}: {show(d.get(runtime))}") from None
        return "eval", {"eval_seconds": s if s is not None and math.isfinite(s) and s >= 0 else 0.0}
    vals: dict[str, float | None] = {}
    for name, keys in FIELDS.items():
        key = next((k for k in keys if k in d), None)
        if key is None:
            continue
        try:
            x = to_float(d[key])
        except ValueError as exc:
            raise ValueError(f"field {key!r} is {reason(exc)}: {show(d[key])}") from None
        vals[name] = x
    if not any(vals.get(f) is not None for f in ("loss", "grad_norm", "lr")):
        return None, {}
    return "train", vals


def _postfix(text: str) -> tuple[dict[str, float | None], list[str]]:
    """Metrics in the bar's postfix (``…, 2.50it/s, loss=0.5, lr=1e-4]``), unreadable values left out; and its keys.

    The postfix ends at the bar's closing ``]``, or at the line's end when it has none after the rate (a bar cut
    mid-line). The keys are in line order, all but those of a metric whose value is unreadable: a bar cut in
    ``lr=1e-`` lacks its ``lr`` (``BadLines.cut_short``).
    """
    start = text.find("/s,") if "/s," in text else text.find("/it,")
    if start < 0:
        return {}, []
    end = text.rfind("]")
    if end < start:
        end = len(text)
    out: dict[str, float | None] = {}
    keys: list[str] = []
    for key, value in POSTFIX.findall(text[text.index(",", start):end]):
        name = POSTFIX_KEYS.get(key)
        if name is None or name in out:
            keys.append(key)
            continue
        try:
            out[name] = to_float(value.strip())
        except ValueError:
            continue
        keys.append(key)
    return out, keys

