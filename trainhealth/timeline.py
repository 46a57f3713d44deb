"""The synthetic timeline of a parsed log: when each logged step (and evaluation) ended, in seconds from the start.

``trainhealth analyze`` (through :class:`trainhealth.detectors.offline.OfflineRun`) and ``trainhealth replay``
place a log's points with the same :func:`timeline` (:func:`arrange` for a per-rank log), so a log analysed
offline and the same log replayed into the live service see the same steps at the same times and produce the
same anomalies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from trainhealth.logpoint import LogEvent, LogPoint
from trainhealth.text import show
from trainhealth.wire import MAX_STEP

#: Largest assumed seconds per step (``--step-seconds``): one day. Beyond it the value is a typo, and an
#: infinite one makes every time on the timeline infinite (records with ``"inc": -Infinity, "t": NaN``).
MAX_STEP_SECONDS = 86400.0


def step_seconds_error(value: object, name: str = "step_seconds") -> str | None:
    """Why ``value`` is not a usable assumed pace, as one line naming ``name`` (an option or argument); else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_STEP_SECONDS:
        return f"{name}={value!r} must be a number of seconds > 0 and at most {MAX_STEP_SECONDS:g} (one day)"
    return None


def check_step_seconds(value: float) -> None:
    """Raise :class:`ValueError` with :func:`step_seconds_error`'s text unless ``value`` is a usable pace."""
    err = step_seconds_error(value)
    if err is not None:
        raise ValueError(err)


@dataclass(frozen=True)
class TimedPoint:
    """A log point (or event) placed on the synthetic timeline.

    Attributes
    ----------
    point : LogPoint | LogEvent
        As parsed.
    offset : float
        Seconds from the run's start at which the point (step or evaluation) ended; for an event, the
        offset of the point before it in the file (0 before any).
    skipped : bool | None
        For a train point: whether every step since the previous logged one was skipped
        (fp16 overflow); None when the log cannot tell.
    timed : bool
        Whether the log gave this point's step time (else the assumed pace placed it).
    step_s : float | None
        The log's own seconds per step for a train point, for the timing detectors: None when the
        pace was assumed, or when an evaluation was logged since the previous train point (a time
        taken from wall-clock stamps would then include the evaluation, which is not a step).
    """

    point: LogPoint | LogEvent
    offset: float
    skipped: bool | None
    timed: bool
    step_s: float | None = None

    @property
    def is_event(self) -> bool:
        return isinstance(self.point, LogEvent)


def timeline(points: Iterable[LogPoint | LogEvent], step_seconds: float = 1.0) -> Iterator[TimedPoint]:
    """Place points on a timeline, lazily (a generator: a million-step log is never in memory).

    Step ``s`` ends after the previous logged step by ``(s - previous) x`` the seconds per step
    the log gives for it (:attr:`LogPoint.step_seconds`), else ``step_seconds`` (assumed);
    an evaluation takes its logged ``eval_seconds``. The first logged step takes one step's time:
    the steps before it are not on this timeline (a log starting at step 12,695 is an excerpt or a
    resumed run; and the first step of a launch counts in the goodput ledger from its end anyway,
    as its start-up, so nothing productive is lost).

    >>> [round(tp.offset) for tp in timeline([LogPoint(12695), LogPoint(12696), LogPoint(12700)])]
    [1, 2, 6]
    >>> [round(tp.offset) for tp in timeline([LogPoint(15), LogPoint(30)])]
    [1, 16]

    An event takes no time: it is where the file has it, at the end of the point before it.

    >>> [(tp.is_event, tp.offset) for tp in timeline([LogEvent("worker_restart"), LogPoint(15), LogEvent("x")])]
    [(True, 0.0), (False, 1.0), (True, 1.0)]

    A time the log gives that would make the timeline infinite (a step time of ``1e300`` s; an
    infinite evaluation runtime) is not used: the step is placed at the assumed pace, the
    evaluation takes no time.

    Raises
    ------
    ValueError
        For a ``step_seconds`` outside (0, :data:`MAX_STEP_SECONDS`], or a step beyond ±``MAX_STEP``
        (2**53 - 1; the importers refuse such steps, naming file and line).
    """
    check_step_seconds(step_seconds)
    cursor, prev_step, after_eval = 0.0, None, False
    for p in points:
        if isinstance(p, LogEvent):
            yield TimedPoint(p, cursor, None, False)
            continue
        skip, timed, own = None, False, None
        if p.is_eval:
            e = p.eval_seconds
            if e is not None and e > 0 and math.isfinite(cursor + e):
                cursor += e
            timed = after_eval = True
        else:
            if abs(p.step) > MAX_STEP:  # a float timeline cannot hold it (OverflowError on a 400-digit step)
                raise ValueError(f"step {show(p.step)} (line/entry {p.source_line}) is beyond ±{MAX_STEP:,}")
            per = p.step_seconds
            first, steps = prev_step is None, 1 if prev_step is None else max(p.step - prev_step, 1)
            timed = per is not None and math.isfinite(per) and per > 0 and math.isfinite(cursor + steps * per)
            if not timed:
                per = step_seconds
            cursor += steps * per
            prev_step = p.step
            if p.skipped is not None:
                # The first point's count covers an interval of unknown length: only "none" is certain.
                skip = (False if p.skipped == 0 else None) if first else p.skipped >= steps
            own = per if timed and not after_eval else None
            after_eval = False
        yield TimedPoint(p, cursor, skip, timed, own)


@dataclass
class Arranged:
    """A log's points placed on the timeline, in the order to feed them.

    Attributes
    ----------
    points : Iterable[TimedPoint]
        A lazy iterator for a single-stream log; a list for a per-rank log.
    ranks : tuple[int, ...]
        The ranks of a per-rank log, ascending; empty for a single-stream (one-rank) log.
    hosts : dict[int, str]
        Rank -> host, where the log names them.
    """

    points: Iterable[TimedPoint]
    ranks: tuple[int, ...] = ()
    hosts: dict[int, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Ranks per step: highest rank + 1 (rank ids index the per-rank columns), 1 for a single stream."""
        return self.ranks[-1] + 1 if self.ranks else 1


def arrange(points: Iterable[LogPoint | LogEvent], step_seconds: float = 1.0) -> Arranged:
    """Place a log's points: a single stream lazily with :func:`timeline`; a per-rank log rank by rank.

    A log whose first point has no rank (every training-log importer) passes through
    :func:`timeline` untouched and unread (the events before that point are held until it is seen; a
    log of events only is a single stream). A per-rank log (``LogPoint.rank`` set: a benchmark's
    interleaved ranks, several ranks' profiler traces) is read whole (such logs are small), each
    rank is placed on its own timeline from the run's start, and the points come out in the
    order their steps ended on that synthetic clock (ties by step, then rank): what a live service would
    have received, so each step's records are together. There an event goes on the timeline of its
    rank (``LogEvent.rank``, else 0), right after the point of that rank before it in the file.

    >>> pts = [LogPoint(1, rank=1, step_seconds=2.0), LogPoint(1, rank=0, step_seconds=1.0),
    ...        LogPoint(2, rank=0, step_seconds=1.0), LogPoint(2, rank=1, step_seconds=0.5)]
    >>> arr = arrange(pts)
    >>> arr.ranks, arr.world_size, [(tp.point.step, tp.point.rank, tp.offset) for tp in arr.points]
    ((0, 1), 2, [(1, 0, 1.0), (1, 1, 2.0), (2, 0, 2.0), (2, 1, 2.5)])

    Raises
    ------
    ValueError
        For a ``step_seconds`` outside (0, :data:`MAX_STEP_SECONDS`], or a log mixing per-rank points
        with rank-less ones.
    """
    check_step_seconds(step_seconds)
    it = iter(points)
    held: list[LogEvent] = []
    first = next(it, None)
    while isinstance(first, LogEvent):
        held.append(first)
        first = next(it, None)
    if first is None:
        return Arranged(timeline(held, step_seconds))
    if first.rank is None:
        return Arranged(timeline(itertools.chain(held, (first,), it), step_seconds))
    by_rank: dict[int, list[LogPoint | LogEvent]] = {}
    hosts: dict[int, str] = {}
    for p in itertools.chain(held, (first,), it):
        if isinstance(p, LogEvent):
            by_rank.setdefault(p.rank or 0, []).append(p)
            continue
        if p.rank is None:
            raise ValueError(f"step {p.step} has no rank in a per-rank log (line/entry {p.source_line})")
        by_rank.setdefault(p.rank, []).append(p)
        if p.host:
            hosts.setdefault(p.rank, p.host)
    keyed = []
    for rank, items in by_rank.items():
        step = -math.inf  # an event sorts with the point of its rank before it
        for tp in timeline(items, step_seconds):
            if not tp.is_event:
                step = tp.point.step
            keyed.append(((tp.offset, step, rank), tp))
    keyed.sort(key=lambda kt: kt[0])  # stable: a rank's order is kept
    ranks = tuple(sorted(r for r, items in by_rank.items() if any(isinstance(p, LogPoint) for p in items)))
    return Arranged([tp for _, tp in keyed], ranks, hosts)
