"""The report of ``trainhealth analyze PATH...``: a post-mortem of training logs, offline (no Redis).

Each file is parsed lazily (:func:`trainhealth.collectors.importers.read_items`) and its points — and the
events it reports (a collective timeout, a restart of the worker group), in file order among them —
are fed, as they are parsed, through the live detection pipeline
(:class:`trainhealth.detectors.offline.OfflineRun`: the same
detectors, goodput ledger and rollback advisor as ``trainhealth serve``, on the same synthetic
timeline as ``trainhealth replay``). Nothing grows with the length of the log except what the
pipeline itself keeps (bounded) and the anomalies found: the chart series are decimated on the
fly (:class:`ChartSeries`), so a 1,000,000-step log is analysed in bounded memory
(``bench/analyze_1m.py``).

Outputs: a human report (:func:`format_text`), a versioned JSON document (:func:`to_json`;
schema in ``docs/analyze.md``) and a standalone HTML report (:mod:`trainhealth.commands.analyze_html`).
The exit status gates a pipeline (:func:`exit_status`): 0 when nothing is critical, 1 when any
anomaly is critical, 2 when a file could not be read or parsed.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO, TypedDict

from trainhealth import __version__
from trainhealth.anomaly import Anomaly
from trainhealth.collectors import importers
from trainhealth.detectors.advisor import RollbackAdvisor
from trainhealth.detectors.ledger import NOT_BADPUT
from trainhealth.detectors.offline import OfflineRun
from trainhealth.exceptions import ConfigError, InputFormatError, TrainHealthError
from trainhealth.goodput import LedgerSnapshot
from trainhealth.logpoint import LogEvent, LogPoint
from trainhealth.recommendations import Recommendation
from trainhealth.text import category_label, fmt_duration
from trainhealth.timeline import arrange, step_seconds_error
from trainhealth.wire import EventKind

#: Name and version of the JSON document (``docs/analyze.md``); the version changes when a field
#: is renamed or removed or changes meaning (added fields do not change it).
SCHEMA = "trainhealth.analyze"
SCHEMA_VERSION = 1
#: Most buckets of a chart series. Each keeps at most 11 rows (first, last, and per value the
#: min, the max and the first non-finite one), so a chart holds at most ~11,000 points per file
#: whatever the log's length (a few hundred KB of JSON in the HTML report).
CHART_BUCKETS = 1000
#: Raw rows remembered so an anomaly's onset, end and peak steps are kept exactly on the charts
#: (detectors report an onset within a few steps of seeing it; a divergence 100 steps later).
PIN_WINDOW = 1024
#: Formats whose ``LogPoint.source_line`` is a line number: their progress bar counts lines.
LINE_FORMATS = frozenset({"megatron", "nanogpt", "modded_nanogpt", "word_lm", "csv", "jsonl", "lightning_csv",
                          "wandb_csv", "wandb_jsonl", "llamafactory", "allreduce_bench", "nccl_watchdog",
                          "torchelastic", "llmc", "hf_stdout", "mmengine", "text_kv"})
#: Fields of a train point counted in the run summary (``metrics``).
METRICS = ("loss", "grad_norm", "lr", "tokens", "consumed_samples", "skipped")

# -- the JSON document's types (docs/analyze.md; its JSON Schema: docs/schemas/analyze-report.json) ---------------
Timeline = Literal["logged", "partial", "assumed"]


class ReportSummary(TypedDict):
    """Over all the files analysed.

    Attributes
    ----------
    files : int
        Files given.
    failed : int
        Files with an ``error``.
    anomalies : int
        Anomalies over all files.
    critical : int
        Those of severity ``critical``.
    exit_status : int
        The process's exit status: 0 nothing critical, 1 some anomaly critical, 2 an input error and nothing
        critical.
    """

    files: int
    failed: int
    anomalies: int
    critical: int
    exit_status: Literal[0, 1, 2]


Metrics = TypedDict("Metrics", dict.fromkeys(METRICS, int))  # type: ignore[misc]
Metrics.__doc__ = ("Train points carrying each field (per-rank records for a per-rank log).\n\nAttributes\n----------\n"
                   + "".join(f"{m} : int\n    Points carrying ``{m}``.\n" for m in METRICS))


class NonFinite(TypedDict):
    """Train points whose value is NaN or ±Inf.

    Attributes
    ----------
    loss : int
        Points with a non-finite loss.
    grad_norm : int
        Points with a non-finite grad norm.
    """

    loss: int
    grad_norm: int


class Timings(TypedDict):
    """Which timings the log has.

    Attributes
    ----------
    step_seconds : int
        Train points whose step time the log gives (an iteration time, a timer, wall-clock stamps).
    eval_seconds : int
        Evaluations with a logged runtime.
    """

    step_seconds: int
    eval_seconds: int


class _FileSummary(TypedDict):
    steps: int
    evaluations: int
    first_step: int | None
    last_step: int | None
    restarts: int
    metrics: Metrics
    non_finite: NonFinite
    timings: Timings
    timeline: Timeline
    warnings: list[str]
    anomalies: int
    critical: int


class FileSummary(_FileSummary, total=False):
    """What was read from one file (or one ``--one-run`` group).

    Attributes
    ----------
    steps : int
        Training steps logged; for a per-rank log, the steps across ranks.
    ranks : list[int]
        Only for a per-rank log: the ranks seen.
    records : int
        Only for a per-rank log: per-rank points read (one per rank and step).
    evaluations : int
        Evaluation entries.
    events : dict[str, int]
        Only for a log that reports events: events read, by kind, in order of first appearance.
    first_step, last_step : int | None
        Smallest and largest step (null without steps).
    restarts : int
        Times the step went back in the file (a resumed run logged into the same file).
    metrics : Metrics
        Points carrying each field.
    non_finite : NonFinite
        Points whose loss or grad norm is NaN or ±Inf.
    timings : Timings
        Which timings the log has.
    timeline : str
        ``logged`` (every step timed by the log), ``partial``, or ``assumed`` (no step time: placed at
        ``--step-seconds``).
    warnings : list[str]
        The importers' warnings (malformed lines skipped, a file cut short).
    anomalies : int
        Anomalies of this file.
    critical : int
        Those of severity ``critical``.
    """

    ranks: list[int]
    records: int
    events: dict[EventKind, int]


class Goodput(TypedDict):
    """The goodput estimate of one file.

    Attributes
    ----------
    timeline : str
        As ``summary.timeline``.
    timed_steps : int
        As ``summary.timings.step_seconds``.
    assumed_step_seconds : float
        ``--step-seconds``: seconds per step assumed where the log has no step times.
    note : str
        One line: estimated from the log's step times, partly, or not estimated and why.
    ledger : LedgerSnapshot | None
        The goodput ledger's snapshot at the last step (seconds on the log's timeline, from 0); null when not
        estimated.
    """

    timeline: Timeline
    timed_steps: int
    assumed_step_seconds: float
    note: str
    ledger: LedgerSnapshot | None


class _FileEntry(TypedDict):
    path: str
    format: str | None
    run: str
    error: str | None
    summary: FileSummary
    anomalies: list[Anomaly]
    recommendations: list[Recommendation]
    goodput: Goodput


class FileEntry(_FileEntry, total=False):
    """One file of the report (one ``--one-run`` group), in the order given.

    Attributes
    ----------
    path : str
        As given on the command line (the first file of a ``--one-run`` group).
    paths : list[str]
        Only for a ``--one-run`` group: every file of the run, in the order given.
    format : str | None
        Importer format (``hf_trainer_state``, ``megatron``, ...); null when it could not be detected.
    run : str
        Run id used in the recommendations: the file name up to its first dot.
    error : str | None
        The one-line input error (file, place, field); null when the file was read to the end.
    summary : FileSummary
        What was read.
    anomalies : list[Anomaly]
        Each anomaly's final state, in onset order: ``Anomaly.to_dict()``, the form ``th:{run}:anomalies`` holds
        without the service's additions.
    recommendations : list[Recommendation]
        The rollback advisor's latest recommendation per anomaly that still needs action at the end of the log, in
        the anomalies' order: ``Recommendation.to_dict()``.
    goodput : Goodput
        The goodput estimate.
    """

    paths: list[str]


class AnalyzeReport(TypedDict):
    """The JSON report of ``trainhealth analyze --json`` (docs/analyze.md): a post-mortem of training logs.

    Attributes
    ----------
    schema : str
        The document's name, ``trainhealth.analyze``.
    schema_version : int
        Its version: changes when a field is removed, renamed or changes meaning (fields may be added within one).
    trainhealth_version : str
        The trainhealth that wrote it.
    summary : ReportSummary
        Over all the files.
    files : list[FileEntry]
        One per PATH (one per ``--one-run`` group), in the order given.
    """

    schema: Literal["trainhealth.analyze"]
    schema_version: Literal[1]
    trainhealth_version: str
    summary: ReportSummary
    files: list[FileEntry]


#: A chart row: (restart generation, step, loss, grad norm, step seconds or None).
Row = tuple[int, int, "float | None", "float | None", "float | None"]


# -- chart series -------------------------------------------------------------------------------
class _Bucket:
    __slots__ = ("bad", "first", "hi", "last", "lo", "n")

    def __init__(self, row: Row) -> None:
        self.n = 0
        self.first = self.last = row
        self.lo: list[Row | None] = [None, None, None]
        self.hi: list[Row | None] = [None, None, None]
        self.bad: list[Row | None] = [None, None, None]

    def rows(self) -> Iterator[Row]:
        yield self.first
        yield self.last
        for group in (self.lo, self.hi, self.bad):
            for r in group:
                if r is not None:
                    yield r

    def merge(self, other: _Bucket) -> None:
        """Absorb the next bucket (its rows all come after this one's)."""
        self.n += other.n
        self.last = other.last
        for i in range(3):
            o = other.lo[i]
            if o is not None and (self.lo[i] is None or o[2 + i] < self.lo[i][2 + i]):  # type: ignore[index,operator]
                self.lo[i] = o
            o = other.hi[i]
            if o is not None and (self.hi[i] is None or o[2 + i] > self.hi[i][2 + i]):  # type: ignore[index,operator]
                self.hi[i] = o
            if self.bad[i] is None:
                self.bad[i] = other.bad[i]


class ChartSeries:
    """Loss, grad norm and step time per step, decimated on the fly to a bounded number of rows.

    M4 aggregation (Jugel et al., "M4: A Visualization-Oriented Time Series Data Aggregation",
    PVLDB 7(10), 2014): consecutive points fall into buckets of ``width`` points; a bucket keeps
    its first and last row and, for each value, the row of its minimum and of its maximum — so a
    one-step spike survives any decimation — plus the first row where the value is NaN/±Inf (the
    charts draw a gap there). Whole rows are kept, so every kept row carries all three values and
    the curves share their x positions. When there are more than ``buckets`` buckets, neighbours
    merge pairwise and ``width`` doubles: memory is O(``buckets``) for any number of points.
    :meth:`pin` keeps chosen steps exactly (an anomaly's onset, peak and end), from the last
    :data:`PIN_WINDOW` rows.

    Parameters
    ----------
    buckets : int
        Most buckets kept (>= 2); at most ``11 x buckets`` rows come out of :meth:`rows`.

    Raises
    ------
    ValueError
        For ``buckets < 2``.

    Examples
    --------
    Ten thousand steps of a smooth loss with one spike at step 6,001, into 8 buckets:

    >>> s = ChartSeries(buckets=8)
    >>> for i in range(1, 10_001):
    ...     s.add(i, 5.0 if i == 6_001 else 2.0 - i / 10_000, 1.0, None)
    >>> rows = s.rows()
    >>> len(rows) <= 11 * 8, max(rows, key=lambda r: r[2])[1:3]
    (True, (6001, 5.0))
    """

    FIELDS = ("loss", "grad_norm", "step_seconds")

    def __init__(self, buckets: int = CHART_BUCKETS) -> None:
        if buckets < 2:
            raise ValueError(f"buckets={buckets!r} must be >= 2")
        self.buckets = buckets
        self._width = 1
        self._buckets: list[_Bucket] = []
        self._gen = 0
        self._last_step: int | None = None
        self._recent: deque[Row] = deque(maxlen=PIN_WINDOW)
        self._pinned: dict[tuple[int, int], Row] = {}

    @property
    def points(self) -> int:
        """Rows added so far."""
        return sum(b.n for b in self._buckets)

    def add(self, step: int, loss: float | None, grad_norm: float | None, step_seconds: float | None) -> None:
        """Add one train point (file order); a step at or below the previous one starts a new generation."""
        new_gen = self._last_step is not None and step <= self._last_step
        if new_gen:
            self._gen += 1
        self._last_step = step
        row: Row = (self._gen, step, loss, grad_norm, step_seconds)
        self._recent.append(row)
        b = self._buckets[-1] if self._buckets else None
        if b is None or b.n >= self._width or new_gen:
            b = _Bucket(row)
            self._buckets.append(b)
            if len(self._buckets) > self.buckets:
                self._compact()
        b.n += 1
        b.last = row
        for i, v in enumerate((loss, grad_norm, step_seconds)):
            if v is None:
                continue
            if not math.isfinite(v):
                if b.bad[i] is None:
                    b.bad[i] = row
                continue
            lo, hi = b.lo[i], b.hi[i]
            if lo is None or v < lo[2 + i]:  # type: ignore[operator]
                b.lo[i] = row
            if hi is None or v > hi[2 + i]:  # type: ignore[operator]
                b.hi[i] = row

    def _compact(self) -> None:
        merged = []
        for i in range(0, len(self._buckets) - 1, 2):
            a = self._buckets[i]
            a.merge(self._buckets[i + 1])
            merged.append(a)
        if len(self._buckets) % 2:
            merged.append(self._buckets[-1])
        self._buckets = merged
        self._width *= 2

    def pin(self, steps: Iterable[int | None]) -> None:
        """Keep the rows of ``steps`` (the newest occurrence among the last :data:`PIN_WINDOW` rows)."""
        wanted = {s for s in steps if s is not None}
        for row in reversed(self._recent):
            if row[1] in wanted:
                self._pinned.setdefault((row[0], row[1]), row)
                wanted.discard(row[1])
                if not wanted:
                    break

    def rows(self) -> list[Row]:
        """The kept rows, by generation then step, one per (generation, step)."""
        out = dict(self._pinned)
        for b in self._buckets:
            for r in b.rows():
                out.setdefault((r[0], r[1]), r)
        return [out[k] for k in sorted(out)]


# -- one file -----------------------------------------------------------------------------------
@dataclass
class FileReport:
    """What :func:`analyze_file` found in one log.

    Attributes
    ----------
    path : str
        As given.
    format : str | None
        Importer format name (None when it could not be detected).
    run : str
        Run id used in anomalies' recommendations (from the file name).
    error : str | None
        One line naming file, place and field when the file could not be read; the other
        fields then describe what was read before the error.
    steps, evals : int
        Train points and evaluations read.
    first_step, last_step : int | None
        Smallest and largest train step.
    restarts : int
        Times the step went back (a resumed run logged into the same file).
    metrics : dict[str, int]
        Train points carrying each of :data:`METRICS`.
    non_finite : dict[str, int]
        Train points whose loss / grad norm is NaN or ±Inf.
    timed_steps : int
        Train points whose step time the log gives (the rest are placed at ``step_seconds``).
    eval_timed : int
        Evaluations with a logged runtime.
    step_seconds : float
        Assumed seconds per step where the log has no times.
    warnings : list[str]
        The importers' warnings (malformed lines skipped).
    anomalies : list[Anomaly]
        Final state of every anomaly, in onset order.
    recommendations : list[Recommendation]
        The rollback advisor's latest recommendation per anomaly that has one, in onset order.
    ledger : dict | None
        ``GoodputLedger.snapshot()`` at the last step (seconds on the log's timeline).
    chart : ChartSeries | None
        The decimated series for the HTML report.
    paths : list[str]
        The files of a run given as several per-rank logs (``--one-run``); empty for one file.
    ranks : list[int]
        The ranks of a per-rank log (empty for a single-stream log). Then ``steps`` counts the steps
        (each across its ranks, as the pipeline aggregates them), ``records`` the per-rank points,
        and ``metrics``, ``non_finite`` and ``timed_steps`` count records.
    records : int
        Train points read (one per rank and step of a per-rank log; ``steps`` for a single stream).
    events : dict[str, int]
        Events the log reports (:class:`~trainhealth.logpoint.LogEvent`: ``collective_timeout``,
        ``worker_restart``), by kind in order of first appearance; empty for a log of steps only.
    """

    path: str
    format: str | None = None
    run: str = ""
    error: str | None = None
    steps: int = 0
    evals: int = 0
    first_step: int | None = None
    last_step: int | None = None
    restarts: int = 0
    metrics: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METRICS, 0))
    non_finite: dict[str, int] = field(default_factory=lambda: {"loss": 0, "grad_norm": 0})
    timed_steps: int = 0
    eval_timed: int = 0
    step_seconds: float = 1.0
    warnings: list[str] = field(default_factory=list)
    anomalies: list[Anomaly] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    ledger: dict[str, Any] | None = None
    chart: ChartSeries | None = None
    paths: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    records: int = 0
    events: dict[str, int] = field(default_factory=dict)

    @property
    def points(self) -> int:
        """What ``timed_steps`` and ``metrics`` count: per-rank records of a per-rank log, else steps."""
        return self.records if self.ranks else self.steps

    @property
    def timeline(self) -> str:
        """``logged`` (every step timed by the log), ``partial`` or ``assumed`` (no step time at all)."""
        if self.points and self.timed_steps >= self.points:
            return "logged"
        return "partial" if self.timed_steps else "assumed"

    @property
    def gaps(self) -> dict[str, Any] | None:
        """The stretches of steps the log does not cover (an excerpt's pasted blocks: a step jump over
        ``defaults.LEDGER_GAP_FACTOR`` x the log's usual interval), as the goodput ledger booked them
        (``unobserved_gaps``: ``count``, ``steps`` not logged, the ``largest`` [from, to]); None without any."""
        gaps = (self.ledger or {}).get("unobserved_gaps")
        return gaps if gaps and gaps.get("count") else None

    @property
    def critical(self) -> int:
        """Critical anomalies."""
        return sum(a.severity == "critical" for a in self.anomalies)

    def goodput(self) -> Goodput:
        """The ``goodput`` object of the JSON report (``docs/analyze.md``)."""
        tl = self.timeline
        few = self.steps < MIN_GOODPUT_STEPS
        if not self.steps and self.events:
            return {"timeline": tl, "timed_steps": 0, "assumed_step_seconds": self.step_seconds,
                    "note": "not estimated: the log has no training steps (events only)", "ledger": None}
        if tl == "assumed" or self.ledger is None or few:
            note = (f"not estimated: the log has no step times (the timeline is assumed at {self.step_seconds:g} s "
                    "per step)") if not few or tl == "assumed" else (
                    f"not estimated: {self.steps} steps are too few (the first step of a launch is its start-up; "
                    f"at least {MIN_GOODPUT_STEPS} are needed)")
            return {"timeline": tl, "timed_steps": self.timed_steps, "assumed_step_seconds": self.step_seconds,
                    "note": note, "ledger": None}
        elif tl == "partial":
            what = "per-rank records" if self.ranks else "logged steps"
            note = (f"estimated from {self.timed_steps} of {self.points} {what}' times; the others are assumed "
                    f"at {self.step_seconds:g} s per step")
        else:
            note = "estimated from the step times in the log"
        gaps = self.gaps
        if gaps:
            n, (a, b) = gaps["count"], gaps["largest"]
            note += (f"; the log skips {n} stretch{'es' if n > 1 else ''} of steps ({gaps['steps']:,} steps not "
                     f"logged, the largest {a:,} -> {b:,}): their time is unobserved, neither productive nor a hang, "
                     "and the tokens the log counts for them are left out of the rates")
        return {"timeline": tl, "timed_steps": self.timed_steps, "assumed_step_seconds": self.step_seconds,
                "note": note, "ledger": self.ledger}

    def to_dict(self) -> FileEntry:
        """The file's entry in the JSON report (``docs/analyze.md``).

        ``paths`` (after ``path``) only for a ``--one-run`` group, ``ranks`` and ``records`` (after
        ``steps``) only for a per-rank log, ``events`` (after ``evaluations``) only for a log that reports
        events: a single-stream file of steps has the keys it always had.
        """
        summary: FileSummary = {"steps": self.steps}
        if self.ranks:
            summary.update(ranks=list(self.ranks), records=self.records)
        summary["evaluations"] = self.evals
        if self.events:
            summary["events"] = dict(self.events)
        summary.update({
            "first_step": self.first_step,
            "last_step": self.last_step, "restarts": self.restarts, "metrics": dict(self.metrics),
            "non_finite": dict(self.non_finite),
            "timings": {"step_seconds": self.timed_steps, "eval_seconds": self.eval_timed},
            "timeline": self.timeline, "warnings": list(self.warnings),
            "anomalies": len(self.anomalies), "critical": self.critical,
        })
        d: FileEntry = {"path": self.path}
        if self.paths:
            d["paths"] = list(self.paths)
        d.update({
            "format": self.format, "run": self.run, "error": self.error, "summary": summary,
            "anomalies": [a.to_dict() for a in self.anomalies],
            "recommendations": [r.to_dict() for r in self.recommendations],
            "goodput": self.goodput(),
        })
        return d


class _Collect(logging.Handler):
    """Collects the importers' warnings for the report (they still reach the normal log)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_id(path: str | Path) -> str:
    """A run id from the file name: ``hf_x.trainer_state.json`` → ``hf_x``."""
    stem = Path(path).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9._-]", "-", stem)[:100] or "log"


def count_lines(path: Path) -> int | None:
    """Newlines in a (possibly gzipped) file, for the progress bar's total; None when unreadable."""
    import gzip

    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        n = 0
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            while chunk := f.read(1 << 20):
                n += chunk.count(b"\n")
        return n
    except (OSError, EOFError):
        return None


def _progress(path: Path, fmt: str, show: bool | None) -> Any:
    """A tqdm bar on stderr: shown when ``show`` is True, or when None and stderr is a terminal and
    the file takes more than half a second (a small file never flashes a bar)."""
    from tqdm import tqdm

    enabled = show if show is not None else sys.stderr.isatty()
    lines = fmt in LINE_FORMATS
    total = count_lines(path) if enabled and lines and path.is_file() else None
    return tqdm(total=total, desc=path.name[:40], unit="line" if lines else "point", unit_scale=True,
                file=sys.stderr, disable=not enabled, delay=0.0 if show else 0.5, leave=False, dynamic_ncols=True,
                mininterval=0.25)


def analyze_file(path: str | Path, fmt: str | None = None, mapping: Mapping[str, str | None] | None = None, *,
                 step_seconds: float = 1.0, progress: bool | None = False,
                 chart_buckets: int = CHART_BUCKETS) -> FileReport:
    """Parse ``path`` lazily and run the detection pipeline over it, offline.

    Parameters
    ----------
    path : str or Path
        A log file (or TensorBoard run directory) in a format of :data:`trainhealth.collectors.importers.FORMATS`.
    fmt : str | None
        Force the format (default: detected).
    mapping : Mapping | None
        Field → column/tag for table-shaped formats (as ``trainhealth replay --map``).
    step_seconds : float
        Assumed seconds per step where the log gives no step time.
    progress : bool | None
        Progress bar on stderr: True always, False never, None when stderr is a terminal.
    chart_buckets : int
        Buckets of the decimated chart series (:class:`ChartSeries`).

    Returns
    -------
    FileReport
        With ``error`` None.

    Raises
    ------
    InputFormatError
        The file cannot be read or parsed, or holds no training step (naming file, place, field).
    ConfigError
        ``fmt`` or ``mapping`` is not valid for the file, or ``step_seconds`` is not in (0, one day].
    """
    rep = FileReport(path=str(path), run=run_id(path), step_seconds=step_seconds)
    _analyze(rep, fmt, mapping, progress, chart_buckets)
    return rep


def _analyze(rep: FileReport, fmt: str | None, mapping: Mapping[str, str | None] | None, progress: bool | None,
             chart_buckets: int) -> None:
    """Fill ``rep`` (what was read stays in it when this raises; see :func:`analyze_file`)."""
    if (err := step_seconds_error(rep.step_seconds)) is not None:
        raise ConfigError(err)
    path = Path(rep.path)
    rep.format = fmt = fmt or importers.detect(path)
    rep.chart = ChartSeries(chart_buckets)
    _feed(rep, importers.read_items(path, fmt, mapping), rep.step_seconds, _progress(path, fmt, progress))
    if not rep.steps and not rep.events:  # a log of events only (a collective timeout, a restart) is analysed
        raise InputFormatError(f"{path}: no training steps to analyse (read as {fmt})")


def _analyze_run(rep: FileReport, fmt: str | None, mapping: Mapping[str, str | None] | None,
                 progress: bool | None, chart_buckets: int) -> None:
    """Fill ``rep`` for the per-rank logs ``rep.paths`` of one job, as one run (``--one-run``)."""
    from trainhealth.collectors.importers.runs import read_run

    if (err := step_seconds_error(rep.step_seconds)) is not None:
        raise ConfigError(err)
    formats = [fmt or importers.detect(p) for p in rep.paths]
    rep.format = formats[0] if len(set(formats)) == 1 else "+".join(formats)
    rep.chart = ChartSeries(chart_buckets)

    def points() -> Iterator[LogPoint]:  # read inside _feed, so the importers' warnings reach the report
        yield from read_run(rep.paths, fmt, mapping, formats)[0]

    _feed(rep, points(), rep.step_seconds, _progress(Path(rep.paths[0]), rep.format, progress))
    if not rep.steps:
        raise InputFormatError(f"{rep.paths[0]}: no training steps to analyse (read as {rep.format})")


#: Fewer steps than this get no goodput estimate (a launch's first step counts as its start-up).
MIN_GOODPUT_STEPS = 10


def _feed(rep: FileReport, points: Iterable[LogPoint | LogEvent], step_seconds: float, bar: Any) -> None:
    """Feed every point and event through an :class:`OfflineRun`, filling ``rep`` as it goes.

    A per-rank log's points are placed rank by rank (:func:`trainhealth.timeline.arrange`); its chart
    rows are the pipeline's step aggregates (mean loss, max grad norm, the slowest rank's step time).
    """
    run = OfflineRun(run=rep.run, step_seconds=step_seconds)
    chart = rep.chart
    assert chart is not None
    metrics, non_finite = rep.metrics, rep.non_finite
    recs: dict[str, Recommendation] = {}
    catcher = _Collect()
    log = logging.getLogger("trainhealth.collectors.importers")
    log.addHandler(catcher)
    lo = hi = prev = None
    restarts = done = aggs = 0
    by_line = rep.format in LINE_FORMATS
    per_rank = False
    try:
        with bar:
            arranged = arrange(points, step_seconds)
            run.expect_ranks(arranged)
            per_rank = bool(arranged.ranks)
            rep.ranks = list(arranged.ranks)
            for tp in arranged.points:
                p = tp.point
                out = run.feed(tp)
                if isinstance(p, LogEvent):
                    pass  # counted by the run (run.events)
                elif p.is_eval:
                    rep.eval_timed += p.eval_seconds is not None
                else:
                    s = p.step
                    if prev is not None and s <= prev and not per_rank:
                        restarts += 1
                    prev = s
                    lo = s if lo is None or s < lo else lo
                    hi = s if hi is None or s > hi else hi
                    loss, gn = p.loss, p.grad_norm
                    if loss is not None:
                        metrics["loss"] += 1
                        if not math.isfinite(loss):
                            non_finite["loss"] += 1
                    if gn is not None:
                        metrics["grad_norm"] += 1
                        if not math.isfinite(gn):
                            non_finite["grad_norm"] += 1
                    metrics["lr"] += p.lr is not None
                    metrics["tokens"] += p.tokens is not None
                    metrics["consumed_samples"] += p.consumed_samples is not None
                    metrics["skipped"] += p.skipped is not None
                    if not per_rank:
                        chart.add(s, loss, gn, p.step_seconds if tp.timed else None)
                for agg in out.aggs if per_rank else ():
                    chart.add(agg.step, agg.loss, agg.grad_norm, agg.step_s)
                aggs += len(out.aggs)
                if out.anomalies:
                    chart.pin(x for a in out.anomalies for x in (a.step, a.end_step, a.evidence.get("peak_step")))
                recs.update(out.recommendations)
                done += 1
                if done & 1023 == 0:
                    bar.update(max((p.source_line or done) - bar.n, 0) if by_line else 1024)
            out = run.finish()
            for agg in out.aggs if per_rank else ():
                chart.add(agg.step, agg.loss, agg.grad_norm, agg.step_s)
            aggs += len(out.aggs)
            recs.update(out.recommendations)
    finally:
        log.removeHandler(catcher)
        rep.warnings = catcher.messages
        rep.steps, rep.evals, rep.timed_steps = run.steps, run.evals, run.timed_steps
        rep.records = run.steps
        rep.events = dict(run.events)
        if per_rank:  # a step is the aggregate of its ranks' records; a restart, a new generation of them
            rep.steps, restarts = aggs, run.pipeline.aggregator.generation
        rep.first_step, rep.last_step, rep.restarts = lo, hi, restarts
        rep.anomalies = sorted(run.anomalies.values(), key=lambda a: (a.gen, a.step))
        order = {a.id: i for i, a in enumerate(rep.anomalies)}
        # As the live service dismisses advice whose anomaly needs no action any more (the spike
        # recovered, the NaN run ended), keep only the advice that still stands at the end of the log.
        final = {a.id: a for a in rep.anomalies}
        rep.recommendations = sorted((r for r in recs.values() if r.anomaly_id in final
                                      and RollbackAdvisor.concerns(final[r.anomaly_id])),
                                     key=lambda r: order.get(r.anomaly_id, len(order)))
    ledger = run.pipeline.ledger
    if run.steps and ledger.last_activity is not None:
        rep.ledger = ledger.snapshot(ledger.last_activity)


def analyze_paths(paths: Iterable[str | Path], fmt: str | None = None,
                  mapping: Mapping[str, str | None] | None = None, *, step_seconds: float = 1.0,
                  progress: bool | None = False, on_error: Any = None, one_run: bool = False) -> list[FileReport]:
    """:func:`analyze_file` on each path; a file that fails keeps what was read before the error,
    with ``error`` set, and the next file is analysed.

    ``one_run=True``: the paths are the per-rank logs of one job (e.g. one profiler trace per
    rank) and are analysed together as one multi-rank run, one report (see
    :func:`trainhealth.collectors.importers.runs.read_run` for what is refused).
    ``on_error(message)`` is called with each one-line error as it happens (the CLI prints it).
    A bad ``step_seconds`` (not in (0, one day]) raises :class:`ConfigError` before any file is read.
    """
    if (err := step_seconds_error(step_seconds, "--step-seconds")) is not None:
        raise ConfigError(err)
    paths = list(paths)
    if one_run and len(paths) > 1:
        from trainhealth.collectors.importers.runs import log_stem

        rep = FileReport(path=str(paths[0]), run=log_stem([Path(p) for p in paths]), step_seconds=step_seconds,
                         paths=[str(p) for p in paths])
        try:
            _analyze_run(rep, fmt, mapping, progress, CHART_BUCKETS)
        except TrainHealthError as exc:
            msg = str(exc)
            if not any(msg.startswith(p) for p in rep.paths):
                msg = f"{rep.paths[0]}: {msg}"
            rep.error = msg
            if on_error is not None:
                on_error(msg)
        return [rep]
    reports = []
    for path in paths:
        rep = FileReport(path=str(path), run=run_id(path), step_seconds=step_seconds)
        try:
            _analyze(rep, fmt, mapping, progress, CHART_BUCKETS)
        except TrainHealthError as exc:
            msg = str(exc)
            if not msg.startswith(str(path)):
                msg = f"{path}: {msg}"  # option errors (a --map the format does not take) name no file
            rep.error = msg
            if on_error is not None:
                on_error(msg)
        reports.append(rep)
    return reports


# -- outputs ------------------------------------------------------------------------------------
def exit_status(reports: Iterable[FileReport]) -> int:
    """1 if any anomaly is critical (even when another file failed: the finding is what a gate must
    not miss), else 2 if a file failed, else 0."""
    reports = list(reports)
    if any(r.critical for r in reports):
        return 1
    return 2 if any(r.error for r in reports) else 0


def to_dict(reports: list[FileReport]) -> AnalyzeReport:
    """The whole JSON document (``docs/analyze.md``; JSON Schema: ``docs/schemas/analyze-report.json``)."""
    files = [r.to_dict() for r in reports]
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "trainhealth_version": __version__,
        "summary": {"files": len(reports), "failed": sum(r.error is not None for r in reports),
                    "anomalies": sum(len(r.anomalies) for r in reports),
                    "critical": sum(r.critical for r in reports), "exit_status": exit_status(reports)},
        "files": files,
    }


def to_json(reports: list[FileReport]) -> str:
    """:func:`to_dict` as JSON text (indented, keys in schema order, ``NaN`` as Python writes it)."""
    return json.dumps(to_dict(reports), indent=2, allow_nan=True) + "\n"


#: A settled loss spike's state by its recovery class: "resolved" beside "not recovered" read as a contradiction.
_RECOVERY_STATE = {"fast": "recovered fast", "slow": "recovered slowly", "not_recovered": "over, loss not recovered"}


def _state(a: Anomaly) -> str:
    """``active``/``resolved``, or for a settled loss spike how it ended."""
    cls = a.evidence.get("recovery_class") if a.status == "resolved" else None
    return _RECOVERY_STATE.get(cls, a.status) if isinstance(cls, str) else a.status


def _n(x: float | int | None) -> str:
    return "—" if x is None else f"{x:,}"


def _ranks_text(ranks: list[int]) -> str:
    """Ranks as ranges: ``[0, 1, 2, 5]`` → ``0–2, 5``."""
    parts: list[str] = []
    for _, grp in itertools.groupby(enumerate(ranks), lambda ir: ir[1] - ir[0]):
        run = [r for _, r in grp]
        parts.append(f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(parts)


def _run_lines(rep: FileReport, events: str) -> list[str]:
    """The run, events, metrics and timings lines of a log with training steps."""
    span = f"steps {_n(rep.first_step)}–{_n(rep.last_step)}" if rep.first_step is not None else "no steps"
    n_ranks = len(rep.ranks)
    on = (f" on {n_ranks} rank{'s' if n_ranks > 1 else ''} ({_ranks_text(rep.ranks)}; {_n(rep.records)} per-rank "
          "records)" if rep.ranks else "")
    out = [f"  run        {_n(rep.steps)} logged training steps ({span}){on}, {_n(rep.evals)} evaluations"
           + (f", {rep.restarts} step regression(s) (resumed runs)" if rep.restarts else "")]
    if events:
        out.append(f"  events     {events}")
    what = "per-rank records" if rep.ranks else "steps"
    shown = [f"{k.replace('_', ' ')} {_n(v)}" for k, v in rep.metrics.items() if v]
    out.append("  metrics    " + (", ".join(shown) if shown else "none") + f" (of {_n(rep.points)} {what})"
               + "".join(f"; {v} non-finite {k.replace('_', ' ')}" for k, v in rep.non_finite.items() if v))
    tl = rep.timeline
    if tl == "logged":
        timing = "step times for every logged step"
    elif tl == "partial":
        timing = (f"step times for {_n(rep.timed_steps)} of {_n(rep.points)} logged {what} "
                  f"(the others assumed at {rep.step_seconds:g} s per step)")
    else:
        timing = f"no step times in the log: timeline ASSUMED at {rep.step_seconds:g} s per step"
    if rep.evals:
        timing += f"; runtimes for {_n(rep.eval_timed)} evaluations"
    out.append(f"  timings    {timing}")
    return out


def format_file(rep: FileReport) -> list[str]:
    """The human report of one file (or one ``--one-run`` group of files), as lines."""
    fmts = (rep.format or "").split("+")
    desc = (" + ".join(importers.FORMATS[f][2] for f in fmts) if all(f in importers.FORMATS for f in fmts)
            else "format unknown")
    out = [" + ".join(rep.paths) if rep.paths else f"{rep.path}",
           f"  format     {desc} ({rep.format})" if rep.format else "  format     —"]
    if rep.error:  # the reason itself went to stderr, as the file was read: said once
        out.append("  ERROR      not readable (the reason is on stderr)" if not rep.steps and not rep.events else
                   "  ERROR      partly read (the reason is on stderr)")
        if not rep.steps and not rep.events:
            return out
    events = ", ".join(f"{k.replace('_', ' ')} {_n(v)}" for k, v in rep.events.items())
    if rep.steps:
        out += _run_lines(rep, events)
    else:  # a log of events only: no step, metric or timing to speak of
        out += ["  run        no training steps: the log reports events only", f"  events     {events}"]
    for w in rep.warnings:
        out.append(f"  warning    {w}")
    crit = rep.critical
    out.append(f"  anomalies  {len(rep.anomalies)}" + (f" ({crit} critical)" if rep.anomalies else ""))
    for a in rep.anomalies:
        end = a.end_step if a.end_step is not None else "…"
        span = f"steps {a.step}–{end}" if rep.steps else "(no steps)"
        out.append(f"    {a.severity.upper():8} {a.kind:16} {span} ({_state(a)})")
        out.append(f"             {a.message}")
    tl = rep.timeline
    g = rep.goodput()
    snap = g["ledger"]
    if snap is None:
        out.append(f"  goodput    {g['note']}")
    else:
        wall = snap["wall_s"]
        unobserved = snap["seconds"].get("unobserved", 0.0)
        observed = wall - unobserved
        # Causes that would print as 0.0 s / 0.0 % are left out; unobserved time is no cause of badput: said apart.
        bad = sorted(((k, v) for k, v in snap["seconds"].items() if k not in NOT_BADPUT and v >= 0.05),
                     key=lambda kv: -kv[1])
        line = f"  goodput    {snap['goodput_pct']:.1f}% of {fmt_duration(wall)} wall time productive"
        if tl == "partial":
            line += " (partly on the assumed pace)"
        if unobserved >= 0.05:
            line += (f"; {fmt_duration(unobserved)} ({100 * unobserved / wall:.1f}%) unobserved: steps the log does "
                     "not cover")
        out.append(line)
        if unobserved >= 0.05 and observed > 0:
            out.append(f"             of the {fmt_duration(observed)} the log covers, "
                       f"{100 * snap['seconds']['productive'] / observed:.1f}% productive")
        if bad:
            # Shares of the time the figures rest on: the wall time, or the time the log covers when it skips some.
            skips = unobserved >= 0.05 and observed > 0
            base, of = (observed, " (of the time the log covers)") if skips else (wall, "")
            out.append(f"             badput{of}: " + ", ".join(
                f"{category_label(k)} {fmt_duration(v)} ({100 * v / base:.1f}%)" for k, v in bad[:5]))
        if snap.get("tokens_total"):
            line = (f"             {snap['tokens_total']:,} tokens; throughput {snap['throughput_tok_s']:,.0f} "
                    f"tokens/s, goodput {snap['goodput_tok_s']:,.0f} tokens/s")
            if unobserved >= 0.05 and observed > 0:
                line += f" ({snap['tokens_good'] / observed:,.0f} tokens/s over the time the log covers)"
            out.append(line)
        if rep.gaps:
            out.append("             note: " + g["note"][g["note"].index("the log skips"):])
    for r in rep.recommendations:
        out.append(f"  rollback   [{r.action}] {r.kind} at step {r.onset_step}: {r.summary}")
        for opt in r.options:
            out.append(f"             · {opt}")
    if rep.recommendations and tl == "assumed":
        out.append("             (costs in the recommendations use the assumed timeline)")
    return out


def format_text(reports: list[FileReport]) -> str:
    """The human report of every file, and a verdict line with the exit status."""
    lines: list[str] = []
    for rep in reports:
        lines += format_file(rep)
        lines.append("")
    if sum(bool(r.ranks) and not r.paths for r in reports) >= 2:
        lines += ["Several per-rank logs were analysed one by one; if they are ranks of one job, "
                  "`trainhealth analyze --one-run PATH...` analyses them together.", ""]
    n_anom = sum(len(r.anomalies) for r in reports)
    crit = sum(r.critical for r in reports)
    failed = sum(r.error is not None for r in reports)
    status = exit_status(reports)
    verdict = (f"{len(reports) - failed} file(s) analysed: {n_anom} anomal{'y' if n_anom == 1 else 'ies'}, "
               f"{crit} critical" + (f"; {failed} file(s) not readable" if failed else "") + f" → exit {status}")
    lines.append(verdict)
    return "\n".join(lines) + "\n"


def write_text(text: str, dest: str, stdout: TextIO) -> None:
    """Write ``text`` to ``dest`` (``-`` = ``stdout``); an unwritable file is a :class:`ConfigError`."""
    if dest == "-":
        stdout.write(text)
        return
    try:
        Path(dest).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{dest}: cannot write: {exc.strerror or exc}") from None
