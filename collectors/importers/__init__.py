"""Readers of the logs training stacks already write, into :class:`LogPoint` s and :class:`LogEvent` s.

``detect(path)`` names a file's format from its name and content; ``read(path, fmt=None,
mapping=None)`` yields its logged training steps (and, for ``trainer_state.json``, evaluations);
``read_items(path, fmt=None, mapping=None)`` yields those and the events the log reports (a collective
timeout, a restart of the worker group), in file order.
Standard library only, except TensorBoard event files: their reader imports ``tensorboard``
when one is read (the ``logs`` extra).

Formats (name: what — how :func:`detect` recognises it; the file name first, then the content):

- ``hf_trainer_state``: Hugging Face Trainer ``trainer_state.json`` (.gz too) — name
  ``*trainer_state.json[.gz]``, or a JSON object with ``log_history``.
- ``tensorboard``: a TensorBoard event file, or a run directory of them — name ``*tfevents*``, a
  directory holding them, or ``brain.Event:`` in the first record.
- ``lightning_csv``: PyTorch Lightning ``CSVLogger`` ``metrics.csv`` — a CSV header with ``epoch``
  and ``step``.
- ``wandb_csv``: W&B run history CSV, or a chart's CSV export — a CSV header with ``_step``,
  ``_runtime`` or ``_timestamp``, or ``Step`` and ``<run> - <metric>`` columns.
- ``wandb_jsonl``: W&B run history JSON lines — name ``wandb-history.jsonl``, or JSON lines with
  ``_step``, ``_runtime`` or ``_timestamp``.
- ``llamafactory``: LLaMA-Factory ``trainer_log.jsonl`` — that name, or JSON lines with
  ``current_steps`` and ``total_steps``.
- ``megatron_golden``: Megatron-LM functional-test golden values — name ``*golden_values*.json``,
  or a JSON object of ``{"values": …, "step_interval"/"start_step": …}`` metrics.
- ``megatron``: Megatron-LM / Megatron-DeepSpeed / GPT-NeoX / NeMo stdout — lines
  ``iteration N/ M | key: value |``.
- ``nanogpt``: nanoGPT stdout — lines ``iter N: loss X, time Yms, mfu Z%``.
- ``modded_nanogpt``: modded-nanogpt stdout (its source code first) — lines ``step:N/M train_loss:…``.
- ``word_lm``: PyTorch ``word_language_model`` stdout — lines ``| epoch E | B/ N batches |``.
- ``llmc``: llm.c ``main.log`` — lines ``s:N trl:X lr:Y norm:Z`` (train), ``s:N tel:X`` (validation:
  evaluations), ``s:N eval:X`` (HellaSwag: skipped).
- ``hf_stdout``: Hugging Face Trainer stdout — its printed log dicts ``{'loss': 0.0, 'grad_norm': nan, …}``
  and tqdm bar lines ``N/M [elapsed<remaining, rate]`` (the step: the bar's counter, else the dict's
  ordinal), DeepSpeed ``OVERFLOW! … Skipping step`` lines (skipped steps), checkpoint saves.
- ``mmengine``: mmengine / mmcv 1.x text logs — lines ``Epoch(train) [e][i/N] lr: … time: … loss: …``,
  ``Iter(train) [i/N]``, mmcv's ``Epoch [e][i/N]``/``Iter [i/N]`` (validation summaries: evaluations).
- ``text_kv``: any other text log with a step counter and ``key: value``/``key = value``/``key=value``
  pairs (``step 12972 \t loss = 0.854, (1.013 sec/step)``): loss, grad norm, learning rate and step
  time found by name — only when no line of the formats above is found.
- ``csv``: any CSV with a header holding a step column (``step``, ``global_step``, ``iteration``, …).
- ``jsonl``: any JSON lines with a step field.

Per-rank logs (their points carry ``LogPoint.rank``; see :mod:`trainhealth.logpoint`):

- ``kineto_trace``: PyTorch profiler (Kineto) Chrome trace, one rank per file — name
  ``*.pt.trace.json[.gz]``, or a JSON object with ``traceEvents``.
- ``allreduce_bench``: all-reduce benchmark stdout, every rank interleaved — lines
  `` duration: S sec`` (each after a ``<rank>:`` line).

Event logs (no training steps; :class:`LogEvent` s only, see :func:`read_items`):

- ``nccl_watchdog``: PyTorch ``ProcessGroupNCCL`` watchdog lines of several ranks — lines
  ``Watchdog caught collective operation timeout: WorkNCCL(…)`` and ``… last enqueued NCCL work: E,
  last completed NCCL work: C`` (events ``collective_timeout``).
- ``torchelastic``: ``torch.distributed.elastic`` agent log (``torchrun``) — lines ``Worker group FAILED.
  N/M attempts left; will restart worker group``, ``Rendezvous complete for workers. Result:``,
  ``restart_count=K`` (events ``worker_restart``).

For text logs the format whose line pattern matches the most lines of the first 8 MiB wins (a tie goes to
the format listed first: a training log before an event log); ``text_kv`` only when none does. Text readers
also report what a log says besides its steps as :class:`LogEvent` s (:func:`read_items`): checkpoint saves
(``checkpoint_save``, at the last step logged before the save line).
Table-shaped formats (CSV, JSON lines, TensorBoard, golden values) take ``mapping={field: name}``
to name their columns/tags/metrics (fields: ``step``, ``loss``, ``grad_norm``, ``lr``,
``step_seconds``, ``tokens``, ``tokens_total``, ``consumed_samples``, ``skipped``, ``wall_time``,
``elapsed``; a None value ignores a field).

Errors: a file that cannot be parsed raises :class:`~trainhealth.exceptions.InputFormatError`
naming the file, the line (or entry, metric, record) and the field. Where lines stand alone —
text logs, and torn (not valid JSON) lines of a JSON-lines log — skipping a malformed line
misreads nothing else, so such lines are skipped with ONE warning on the
``trainhealth.collectors.importers`` logger, counting them and naming the first; a file with no good line
is an error naming its first bad line. The entries of a ``trainer_state.json`` are
independent records with their own step and fixed keys: a bad entry is skipped the same way.
A well-formed row whose field is not a number (CSV, a valid JSON line, golden values,
TensorBoard) means the columns are not what the reader thinks: an error, never a skip.
A number written out in full that no float holds (``1e999``, a 400-digit integer) and a step
beyond ±2**53 - 1 are "out of range" (an error or a skipped line as above); a UTF-8 BOM is ignored.

Files cut mid-write (a crash, a copy of a file being written, an excerpt): a text or JSON-lines log
whose last line has no line end and does not parse gets a warning of its own naming that line and
its byte offset ("ends mid-line … truncated?"), and the lines before it are read; a
``trainer_state.json`` whose JSON breaks off at its end gives the complete ``log_history`` entries
before the cut, with a warning naming the byte offset (an error naming it when none is complete).
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers import (
    allreduce_bench,
    generic,
    hf_stdout,
    hf_trainer_state,
    kineto_trace,
    lightning_csv,
    llamafactory,
    llmc_log,
    megatron_golden,
    megatron_log,
    mmengine_log,
    modded_nanogpt_log,
    nanogpt_log,
    nccl_watchdog,
    tensorboard,
    text_kv,
    torchelastic,
    wandb_history,
    word_lm_log,
)
from trainhealth.collectors.importers._common import GZIP_MAGIC, json_loads
from trainhealth.exceptions import ConfigError, InputFormatError
from trainhealth.logpoint import LogEvent, LogPoint

__all__ = ["FORMATS", "PER_RANK_FORMATS", "InputFormatError", "LogEvent", "LogPoint", "detect", "read", "read_items"]

Reader = Callable[..., Iterator[LogPoint | LogEvent]]

#: Format name → (reader, takes a mapping, one-line description).
FORMATS: dict[str, tuple[Reader, bool, str]] = {
    "hf_trainer_state": (lambda p, m=None: hf_trainer_state.read(p), False, "Hugging Face trainer_state.json"),
    "tensorboard": (tensorboard.read, True, "TensorBoard event file or run directory"),
    "lightning_csv": (lightning_csv.read, True, "PyTorch Lightning CSVLogger metrics.csv"),
    "wandb_csv": (wandb_history.read_csv, True, "W&B run history CSV export"),
    "wandb_jsonl": (wandb_history.read_jsonl, True, "W&B run history JSON lines"),
    "llamafactory": (llamafactory.read, True, "LLaMA-Factory trainer_log.jsonl"),
    "megatron_golden": (megatron_golden.read, True, "Megatron-LM golden values JSON"),
    "megatron": (lambda p, m=None: megatron_log.read(p), False,
                 "Megatron-LM / Megatron-DeepSpeed / GPT-NeoX / NeMo training log"),
    "nanogpt": (lambda p, m=None: nanogpt_log.read(p), False, "nanoGPT training log"),
    "modded_nanogpt": (lambda p, m=None: modded_nanogpt_log.read(p), False, "modded-nanogpt training log"),
    "word_lm": (lambda p, m=None: word_lm_log.read(p), False, "PyTorch word_language_model log"),
    "llmc": (lambda p, m=None: llmc_log.read(p), False, "llm.c main.log"),
    "hf_stdout": (lambda p, m=None: hf_stdout.read(p), False,
                  "Hugging Face Trainer stdout (log dicts, tqdm bar, DeepSpeed overflows)"),
    "mmengine": (lambda p, m=None: mmengine_log.read(p), False, "mmengine / mmcv 1.x (OpenMMLab) text log"),
    "text_kv": (lambda p, m=None: text_kv.read(p), False, "plain text log with a step counter and key: value pairs"),
    "csv": (generic.read_csv, True, "generic CSV with a step column"),
    "jsonl": (generic.read_jsonl, True, "generic JSON lines with a step field"),
    "kineto_trace": (lambda p, m=None: kineto_trace.read(p), False, "PyTorch profiler (Kineto) trace, one rank"),
    "allreduce_bench": (lambda p, m=None: allreduce_bench.read(p), False, "all-reduce benchmark log, per rank"),
    "nccl_watchdog": (lambda p, m=None: nccl_watchdog.read(p), False,
                      "PyTorch ProcessGroupNCCL watchdog log (collective timeouts)"),
    "torchelastic": (lambda p, m=None: torchelastic.read(p), False,
                     "torch.distributed.elastic agent log (worker group restarts)"),
}
#: Formats whose points are per rank (``LogPoint.rank`` set): several files of one job form one run.
PER_RANK_FORMATS = frozenset({"kineto_trace", "allreduce_bench"})

TEXT_FORMATS: dict[str, Callable[[str], bool]] = {
    "megatron": megatron_log.sniff_line,
    "nanogpt": nanogpt_log.sniff_line,
    "modded_nanogpt": modded_nanogpt_log.sniff_line,
    "word_lm": word_lm_log.sniff_line,
    "llmc": llmc_log.sniff_line,
    "hf_stdout": hf_stdout.sniff_line,
    "mmengine": mmengine_log.sniff_line,
    "allreduce_bench": allreduce_bench.sniff_line,
    # Last: a training log that also holds a few of these lines (a run under torchrun) stays a training log.
    "nccl_watchdog": nccl_watchdog.sniff_line,
    "torchelastic": torchelastic.sniff_line,
}
#: Text formats tried only when no line of a :data:`TEXT_FORMATS` format is found: the generic reader.
FALLBACK_TEXT_FORMATS: dict[str, Callable[[str], bool]] = {"text_kv": text_kv.sniff_line}
SNIFF_BYTES = 8 << 20
#: A Chrome trace's key, looked for before parsing a large JSON document whole.
_TRACE_KEY = re.compile(rb'"traceEvents"\s*:')
#: A trainer_state.json's history, looked for in a JSON document that does not parse (cut mid-write).
_HISTORY_KEY = re.compile(rb'"log_history"\s*:\s*\[')


def supported() -> str:
    return ", ".join(f"{name} ({desc})" for name, (_, _, desc) in FORMATS.items())


def _unknown(path: Path, why: str) -> InputFormatError:
    return InputFormatError(f"{path}: {why}; supported formats: {supported()}")


def _head(path: Path, limit: int) -> bytes:
    """Up to ``limit`` bytes of the file, gunzipped when it is gzip."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit)
    except OSError as exc:
        raise InputFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if raw[:2] == GZIP_MAGIC:
        try:
            with gzip.open(path, "rb") as g:
                return g.read(limit)
        except (OSError, EOFError, zlib.error):
            d = zlib.decompressobj(zlib.MAX_WBITS | 16)  # a torn .gz: what decompresses
            try:
                return d.decompress(raw, limit)
            except zlib.error:
                raise InputFormatError(f"{path}: a gzip file that cannot be decompressed") from None
    return raw


def _json_kind(path: Path, doc: Any) -> str | None:
    if isinstance(doc, dict):
        if "log_history" in doc:
            return "hf_trainer_state"
        if "traceEvents" in doc:
            return "kineto_trace"
        if megatron_golden.sniff(doc):
            return "megatron_golden"
    return None


def _jsonl_kind(row: Mapping[str, Any]) -> str | None:
    if llamafactory.sniff(row):
        return "llamafactory"
    if wandb_history.sniff_columns(list(row)):
        return "wandb_jsonl"
    if any(k in row for k in generic.CANDIDATES["step"]):
        return "jsonl"
    return None


def detect(path: str | Path) -> str:
    """The format name of ``path`` (a key of :data:`FORMATS`), from its name, then its content.

    Raises
    ------
    InputFormatError
        When the file cannot be read or matches no supported format (the message lists them).

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> p = os.path.join(d, "train.log")
    >>> _ = open(p, "w").write("iter 0: loss 10.9, time 30.0ms, mfu -100.00%\\n")
    >>> detect(p)
    'nanogpt'
    >>> _ = open(p, "w").write("hello\\n")
    >>> detect(p)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainhealth.exceptions.InputFormatError: ...train.log: unknown log format (no line of a known ...
    """
    path = Path(path)
    name = path.name.lower()
    if path.is_dir():
        tensorboard.event_files(path)  # raises when there are none
        return "tensorboard"
    if not path.exists():
        raise InputFormatError(f"{path}: cannot read: No such file or directory")
    if "tfevents" in name:
        return "tensorboard"
    if name.endswith(("trainer_state.json", "trainer_state.json.gz")):
        return "hf_trainer_state"
    if name == "trainer_log.jsonl" or name.endswith(".trainer_log.jsonl"):
        return "llamafactory"
    if "golden_values" in name and name.endswith(".json"):
        return "megatron_golden"
    if name == "wandb-history.jsonl":
        return "wandb_jsonl"
    if name.endswith((".pt.trace.json", ".pt.trace.json.gz")):
        return "kineto_trace"
    head = _head(path, SNIFF_BYTES)
    if tensorboard.sniff(head):
        return "tensorboard"
    if not head.strip():
        raise _unknown(path, "empty file")
    if b"\x00" in head[:4096]:
        raise _unknown(path, "a binary file of unknown format")
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    stripped = text.lstrip()
    json_error = None
    if stripped.startswith(("{", "[")):
        first = stripped.split("\n", 1)[0].strip()
        try:
            row = json_loads(first)  # not json.loads: a 5,000-digit number must not raise a bare ValueError
        except (json.JSONDecodeError, RecursionError):
            row = None
        if isinstance(row, dict):
            kind = _json_kind(path, row)  # a one-line JSON document (golden values are one line)
            if kind is None:
                kind = _jsonl_kind(row)
            if kind is not None:
                return kind
            raise _unknown(path, "JSON lines without a step field (pass fmt='jsonl' and mapping={'step': FIELD})")
        if stripped.startswith("{") and _TRACE_KEY.search(head, 0, 1 << 20):
            return "kineto_trace"  # a profiler trace: hundreds of MB, not parsed whole just to detect it
        try:
            doc = json_loads(text) if len(head) < SNIFF_BYTES else _whole_json(path)
        except RecursionError:
            raise _unknown(path, "JSON nested too deeply to read") from None
        except json.JSONDecodeError as exc:
            if stripped.startswith("{") and _HISTORY_KEY.search(head, 0, 1 << 20):
                return "hf_trainer_state"  # cut mid-write: its reader recovers the entries before the cut
            doc = None  # maybe a text log whose first line starts with a bracket: sniff its lines below
            json_error = f"not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}"
        if doc is not None:
            kind = _json_kind(path, doc)
            if kind is not None:
                return kind
            raise _unknown(path, "a JSON document of unknown shape")
    first_line = text.split("\n", 1)[0]
    if "," in first_line and not first_line.lstrip().startswith("|"):
        header = [h.strip().strip('"') for h in first_line.rstrip("\r").split(",")]
        if wandb_history.sniff_columns(header):
            return "wandb_csv"
        if lightning_csv.sniff(header):
            return "lightning_csv"
        if any(h in generic.CANDIDATES["step"] for h in header):
            return "csv"
    counts = dict.fromkeys(TEXT_FORMATS, 0)
    for line in text.splitlines():
        for fmt, match in TEXT_FORMATS.items():
            if match(line):
                counts[fmt] += 1
    best = max(counts, key=lambda f: counts[f])
    if counts[best] > 0:
        return best
    for fmt, match in FALLBACK_TEXT_FORMATS.items():
        if any(match(line) for line in text.splitlines()):
            return fmt
    if json_error is not None and stripped.startswith("{"):
        raise _unknown(path, json_error)
    raise _unknown(path, "unknown log format (no line of a known training log in its first "
                         f"{SNIFF_BYTES >> 20} MiB)")


def _whole_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
        if raw[:2] == GZIP_MAGIC:
            raw = gzip.decompress(raw)
        return json_loads(raw.decode("utf-8-sig"))
    except json.JSONDecodeError:
        raise
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as exc:
        raise _unknown(path, f"not readable JSON: {exc}") from None


def read(path: str | Path, fmt: str | None = None,
         mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint]:
    """Iterate the LogPoints of ``path`` in file order; ``fmt`` forces a format (default: :func:`detect`).

    The :class:`LogEvent` s a log also reports are left out: :func:`read_items` gives both.
    Arguments and errors are those of :func:`read_items`.
    """
    return (item for item in read_items(path, fmt, mapping) if isinstance(item, LogPoint))


def read_items(path: str | Path, fmt: str | None = None,
               mapping: Mapping[str, str | None] | None = None) -> Iterator[LogPoint | LogEvent]:
    """Iterate the LogPoints and LogEvents of ``path`` in file order; ``fmt`` forces a format (default: :func:`detect`).

    ``mapping`` (field → column/tag name) applies to table-shaped formats; see the module doc.
    Detection and option errors raise here; parse errors raise while iterating.

    Raises
    ------
    ConfigError
        For an unknown ``fmt``, or a ``mapping`` the format does not take or with an unknown field.
    InputFormatError
        For an unreadable or unsupported file (and, while iterating, a malformed one).
    """
    if fmt is None:
        fmt = detect(path)
    entry = FORMATS.get(fmt)
    if entry is None:
        raise ConfigError(f"fmt={fmt!r} is not a supported format; formats: {', '.join(FORMATS)}")
    reader, takes_mapping, _ = entry
    if mapping and not takes_mapping:
        raise ConfigError(f"mapping is not supported for fmt={fmt!r} (its lines have fixed names); "
                          f"formats that take one: {', '.join(f for f, e in FORMATS.items() if e[1])}")
    return reader(Path(path), mapping)

