"""``trainhealth replay``: push a log file through the collectors into Redis, as if live."""

from __future__ import annotations

import itertools
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from trainhealth.collectors import importers
from trainhealth.collectors.monitor import Monitor
from trainhealth.detectors.offline import arrange, step_seconds_error
from trainhealth.exceptions import ConfigError, InputFormatError
from trainhealth.keys import validate_run_id
from trainhealth.logpoint import LogPoint
from trainhealth.text import fmt_duration

log = logging.getLogger(__name__)


#: Run status a replay stopped by Ctrl-C leaves (not "running": the service then stops the ledger's clock
#: at the last replayed step and skips the hang check; the dashboard shows the status as it is).
INTERRUPTED = "interrupted"
#: Longest real sleep between progress callbacks of a paced replay (s): a log's steps may be hours apart.
PROGRESS_TICK_S = 1.0
#: ``timeline`` meta values: every train point's step time from the log, some, or none.
TIMELINES = ("logged", "partly assumed", "assumed")


@dataclass(frozen=True)
class ReplayResult:
    """What a replay pushed: run id, train points (per-rank records of a per-rank log), eval intervals,
    the synthetic span (s), whether everything was delivered, and the ranks of a per-rank log (else empty).

    ``total`` is the train points the log holds (``points`` of them were pushed), ``offset_s`` the seconds
    of the log's timeline replayed, ``timeline`` one of :data:`TIMELINES`, ``interrupted`` whether Ctrl-C
    stopped the replay."""

    run: str
    points: int
    evals: int
    span_s: float
    delivered: bool
    ranks: tuple[int, ...] = ()
    total: int = 0
    offset_s: float = 0.0
    timeline: str = "logged"
    interrupted: bool = False


class ReplayInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :func:`replay`; its Monitors were closed with status :data:`INTERRUPTED`.

    A :class:`KeyboardInterrupt`, so a caller that does not handle it still stops; ``result`` says how far
    the replay got."""

    def __init__(self, result: ReplayResult) -> None:
        super().__init__(f"replay of run {result.run!r} interrupted after {result.points} of {result.total}")
        self.result = result


@dataclass(frozen=True)
class ReplayPlan:
    """What :func:`replay` will push for a parsed log: train points (per-rank records of a per-rank log),
    evaluations, the ranks of a per-rank log, the timeline's span (s) and :data:`TIMELINES` value."""

    points: int
    evals: int
    ranks: tuple[int, ...]
    span_s: float
    timeline: str


def timeline_kind(timed: int, points: int) -> str:
    """``logged`` when all ``points`` train points have the log's step time, ``assumed`` when none,
    else ``partly assumed`` (as ``trainhealth analyze`` words its "timings" line).

    >>> timeline_kind(19, 19), timeline_kind(3, 19), timeline_kind(0, 19)
    ('logged', 'partly assumed', 'assumed')
    """
    if points and timed >= points:
        return "logged"
    return "partly assumed" if timed else "assumed"


def plan(points: Sequence[LogPoint], step_seconds: float = 1.0) -> ReplayPlan:
    """The :class:`ReplayPlan` of parsed ``points`` (placed as :func:`replay` places them)."""
    arranged = arrange(points, step_seconds)
    placed = list(arranged.points)
    train = [tp for tp in placed if not tp.point.is_eval]
    return ReplayPlan(points=len(train), evals=len(placed) - len(train), ranks=arranged.ranks,
                      span_s=max((tp.offset for tp in placed), default=0.0),
                      timeline=timeline_kind(sum(tp.timed for tp in train), len(train)))


def plan_line(pl: ReplayPlan, name: str, run: str, speed: float, step_seconds: float = 1.0) -> str:
    """The one line ``trainhealth replay`` prints before pushing a file: what, the log's span, the pace
    and the real time it takes.

    >>> print(plan_line(ReplayPlan(19, 0, (), 2542707.4, "logged"), "x.log", "mega104", 100))
    replaying 19 steps of x.log as run 'mega104': the log spans 29.4 days; at 100x that takes 7.1 h (Ctrl-C stops \
it; --speed 0 replays at once)
    >>> print(plan_line(ReplayPlan(700, 7, (), 1512.8, "assumed"), "t.json", "t", 0))
    replaying 700 steps and 7 evaluations of t.json as run 't': the log spans 25.2 min (no step times in the log: \
timeline assumed at 1 s per step); pushed at once (--speed 0)
    """
    what = f"{pl.points:,} per-rank records of {len(pl.ranks)} ranks" if pl.ranks else f"{pl.points:,} steps"
    if pl.evals:
        what += f" and {pl.evals:,} evaluations"
    span = f"the log spans {fmt_duration(pl.span_s, day=' days')}"
    if pl.timeline == "assumed":
        span += f" (no step times in the log: timeline assumed at {step_seconds:g} s per step)"
    elif pl.timeline == "partly assumed":
        span += f" (some steps without step times: assumed at {step_seconds:g} s per step)"
    pace = (f"at {speed:g}x that takes {fmt_duration(pl.span_s / speed, day=' days')} (Ctrl-C stops it; --speed 0 "
            "replays at once)" if speed > 0 else "pushed at once (--speed 0)")
    return f"replaying {what} of {name} as run {run!r}: {span}; {pace}"


def log_stem(paths: Path | Sequence[Path]) -> str:
    """The run's name from its file name(s): ``hf_x.trainer_state.json`` → ``hf_x``; for several files
    (the ranks of one run) the names' common start without a trailing ``rank``:
    ``trace_rank0.json.gz`` + ``trace_rank1.json.gz`` → ``trace``.

    >>> log_stem([Path("kineto_trace_rank0_ws128.json.gz"), Path("kineto_trace_rank1_ws128.json.gz")])
    'kineto_trace'
    """
    names = [p.name.split(".")[0] for p in ([paths] if isinstance(paths, Path) else paths)]
    stem = names[0]
    if len(names) > 1:
        same = itertools.takewhile(lambda c: len(set(c)) == 1, zip(*names, strict=False))  # up to the shortest
        common = "".join(c[0] for c in same)
        common = re.sub(r"(?i)[-_.]*(rank)?[-_.]*$", "", common)
        stem = common or stem
    return re.sub(r"[^A-Za-z0-9._-]", "-", stem)[:100] or "log"


def default_run_id(path: Path | Sequence[Path]) -> str:
    """A run id from the file name(s): ``hf_x.trainer_state.json`` → ``replay-hf_x`` (see :func:`log_stem`)."""
    return "replay-" + log_stem(path)


def read_points(path: str | Path, fmt: str | None = None,
                mapping: Mapping[str, str | None] | None = None) -> list[LogPoint]:
    """Parse a supported training log (format detected, or ``fmt``; see :mod:`trainhealth.collectors.importers`).

    Raises :class:`InputFormatError` when it cannot be parsed or holds no training step.
    """
    fmt = fmt or importers.detect(path)
    points = list(importers.read(path, fmt, mapping))
    if not any(not p.is_eval for p in points):
        if fmt == "hf_trainer_state":
            raise InputFormatError(f"{path}: no training steps (log_history entries with 'loss') to replay")
        raise InputFormatError(f"{path}: no training steps to replay (read as {fmt})")
    return points


def read_run(paths: Sequence[str | Path], fmt: str | None = None,
             mapping: Mapping[str, str | None] | None = None,
             formats: Sequence[str] | None = None) -> tuple[list[LogPoint], list[str]]:
    """Parse per-rank logs of one job (one file per rank or group of ranks) into one run's points.

    Returns the points of every file (file order) and each file's format (``formats``, when the
    caller detected them already; else ``fmt`` or detected). ``--one-run`` of
    ``trainhealth analyze`` and ``trainhealth replay``.

    Raises
    ------
    InputFormatError
        When a file cannot be parsed or holds no training step, is a single-stream log (its points
        have no rank), or holds a rank another file also holds.
    """
    points: list[LogPoint] = []
    found: list[str] = []
    owner: dict[int, str | Path] = {}
    for i, path in enumerate(paths):
        f = formats[i] if formats is not None else fmt or importers.detect(path)
        pts = read_points(path, f, mapping)
        found.append(f)
        if any(p.rank is None for p in pts):
            why = (" without distributedInfo.rank or 'rank<N>' in its name" if f == "kineto_trace" else "")
            raise InputFormatError(f"{path}: a {f} log{why} has no rank: --one-run joins per-rank logs of one job "
                                   f"(formats {', '.join(sorted(importers.PER_RANK_FORMATS))})")
        for r in sorted({p.rank for p in pts if p.rank is not None}):
            if r in owner:
                raise InputFormatError(f"{path}: rank {r} is also in {owner[r]}: --one-run joins different ranks of "
                                       "one job")
            owner[r] = path
        points += pts
    return points, found


#: Longest real time a paced replay may take (a year): a ``speed`` that stretches the log's timeline
#: further is a typo (``1e-300`` would sleep beyond what ``time.sleep`` accepts).
MAX_PACED_SECONDS = 366 * 86400.0


def check_speed(speed: float, name: str = "speed") -> None:
    """Raise :class:`ConfigError` naming ``name`` (an argument or option) unless ``speed`` is 0 or a finite
    pace factor > 0."""
    if not speed >= 0:
        raise ConfigError(f"{name}={speed!r} must be >= 0 (0 = as fast as possible)")
    if not math.isfinite(speed):
        raise ConfigError(f"{name}={speed!r} must be a finite pace factor (0 = as fast as possible)")


def check_pace(span_s: float, speed: float, name: str = "speed") -> None:
    """Raise :class:`ConfigError` when pacing a ``span_s``-second timeline at ``speed`` would take over a year."""
    if speed > 0 and span_s / speed > MAX_PACED_SECONDS:
        raise ConfigError(f"{name}={speed!r} would take {span_s / speed:.3g} s to replay the log's {span_s:.3g} s "
                          f"timeline (more than a year); use a larger {name}, or 0 for as fast as possible")


def replay_span(points: Sequence[LogPoint], step_seconds: float = 1.0) -> float:
    """Seconds the log spans on the synthetic timeline (what ``speed`` paces)."""
    return max((tp.offset for tp in arrange(points, step_seconds).points), default=0.0)


def replay(
    path: str | Path | Sequence[str | Path],
    client: redis.Redis,
    *,
    run: str | None = None,
    speed: float = 0.0,
    step_seconds: float = 1.0,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    points: list[LogPoint] | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> ReplayResult:
    """Replay ``path`` into Redis as run ``run`` through :class:`trainhealth.Monitor` (rank 0 of 1).

    Step ``s`` is placed after the previous logged step by the seconds per step the log gives
    for it (:attr:`LogPoint.step_seconds`: Megatron's elapsed time per iteration, a per-step
    timer, wall-clock stamps), else by the assumed ``step_seconds``; evaluations take their
    logged ``eval_runtime``. Skipped-step counts and consumed samples are passed on: a point
    is marked skipped when every step since the previous logged one was skipped.
    ``speed=0`` pushes as fast as possible on that synthetic timeline, ending now;
    ``speed=k`` paces the pushes in real time at ``k`` x the synthetic pace. ``points`` may
    carry the file already parsed with :func:`read_points` (the CLI parses every file before
    it touches Redis).

    A per-rank log (``LogPoint.rank`` set; or a list of paths, the per-rank logs of one job read
    with :func:`read_run`) goes through one Monitor per rank (``rank=r``, ``world_size`` = highest
    rank + 1, ``host`` where the log names it), each rank on its own timeline, pushed in the
    order their steps end (:func:`trainhealth.detectors.offline.arrange`); a point's ``sections`` are that
    rank's section times of the step (``sec.<name>``), so the service compares the ranks.

    The run's meta gets ``source``, ``replay_speed`` (``speed``) and ``timeline`` (:func:`timeline_kind`;
    with ``assumed_step_s`` unless every step time is the log's): a paced replay stamps records with the
    real clock, so its rates are ``speed`` x the log's, and an assumed timeline measures nothing; the
    dashboard says so. ``progress(pushed, offset_s)`` is called after each point and, while a paced
    replay waits, at least every :data:`PROGRESS_TICK_S` s (``offset_s``: seconds of the log replayed).

    Ctrl-C closes the Monitors with status :data:`INTERRUPTED` (another exception: ``failed``), not
    leaving the run "running" forever, and raises :class:`ReplayInterrupted` with how far it got.

    Raises
    ------
    ConfigError
        For a ``speed`` that is negative, not finite, or would pace the replay over more than a year
        (:data:`MAX_PACED_SECONDS`); a ``step_seconds`` outside (0, one day]; an invalid ``run`` id.
    InputFormatError
        When the file cannot be parsed (naming file, entry and field).
    ReplayInterrupted
        On Ctrl-C (a :class:`KeyboardInterrupt`), after closing the run as :data:`INTERRUPTED`.
    """
    check_speed(speed)
    err = step_seconds_error(step_seconds)
    if err is not None:
        raise ConfigError(err)
    if run is not None:
        validate_run_id(run)  # '' is not "the default": say so instead of ignoring it
    paths = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]  # type: ignore[arg-type]
    if points is None:
        points = read_points(paths[0]) if len(paths) == 1 else read_run(paths)[0]
    run = run if run is not None else default_run_id(paths)
    arranged = arrange(points, step_seconds)
    placed = list(arranged.points)
    span = max((tp.offset for tp in placed), default=0.0)
    check_pace(span, speed)  # before any Monitor writes to Redis
    train = [tp for tp in placed if not tp.point.is_eval]
    timeline = timeline_kind(sum(tp.timed for tp in train), len(train))
    live = speed > 0
    start = clock() if live else clock() - span
    if arranged.ranks:
        mons = {r: Monitor(run, client=client, rank=r, world_size=arranged.world_size, host=arranged.hosts.get(r),
                           started_at=start) for r in arranged.ranks}
    else:
        mons = {0: Monitor(run, client=client, rank=0, world_size=1, started_at=start)}
    for m in mons.values():
        m._phase = "replay"  # the hang detector skips a replayed timeline
    mon = next(iter(mons.values()))
    meta = {"source": "replay:" + "+".join(p.name for p in paths), "replay_speed": repr(float(speed)),
            "timeline": timeline}
    if timeline != "logged":
        meta["assumed_step_s"] = repr(float(step_seconds))
    client.hset(mon.keys.meta, mapping=meta)
    if timeline == "logged":
        client.hdel(mon.keys.meta, "assumed_step_s")  # a run id replayed before from another log
    evals = n = 0
    off = 0.0
    try:
        for tp in placed:
            p, skip = tp.point, tp.skipped
            mon = mons[p.rank or 0]
            if live:
                # Sleep in ticks: a log's steps may be hours apart at this pace; report progress meanwhile.
                while (wait := start + tp.offset / speed - clock()) > 0:
                    sleep(min(wait, PROGRESS_TICK_S) if progress is not None else wait)
                    if progress is not None:
                        progress(n, min(tp.offset, max(off, (clock() - start) * speed)))
            off = tp.offset
            ts = clock() if live else start + off
            if p.is_eval:
                mon.badput("evaluation", p.eval_seconds or 0.0, step=p.step, timestamp=ts)
                evals += 1
            else:
                if p.sections:
                    mon._sections = dict(p.sections)  # what section() would have timed: log_step attaches them
                # step_s: the log's own time per step, never the assumed pace (see TimedPoint.step_s).
                mon.log_step(p.step, loss=p.loss, grad_norm=p.grad_norm, lr=p.lr, tokens=p.tokens,
                             consumed_samples=p.consumed_samples, skipped=skip, timestamp=ts, step_s=tp.step_s)
                n += 1
            if progress is not None:
                progress(n, off)
    except KeyboardInterrupt:
        ok = all([m.close(INTERRUPTED) for m in mons.values()])  # a list: close every rank
        res = ReplayResult(run=run, points=n, evals=evals, span_s=span, delivered=ok, ranks=arranged.ranks,
                           total=len(train), offset_s=off, timeline=timeline, interrupted=True)
        raise ReplayInterrupted(res) from None
    except Exception:
        for m in mons.values():
            m.close("failed")
        raise
    ok = all([m.close("finished") for m in mons.values()])  # a list: close every rank
    log.debug("replayed %d steps and %d evaluations of %s as run %s", n, evals, path, run)
    return ReplayResult(run=run, points=n, evals=evals, span_s=span, delivered=ok, ranks=arranged.ranks,
                        total=len(train), offset_s=off, timeline=timeline)
