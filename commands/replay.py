"""``trainhealth replay``: push a log file through the collectors into Redis, as if live."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from trainhealth.collectors.importers.runs import log_stem, read_points, read_run
from trainhealth.collectors.monitor import Monitor
from trainhealth.commands._shared import (
    command,
    interrupt_on_signals,
    live_services,
    log_options,
    parse_map,
    resolve,
    with_url,
)
from trainhealth.exceptions import ConfigError
from trainhealth.keys import validate_run_id
from trainhealth.logpoint import LogPoint
from trainhealth.text import fmt_duration
from trainhealth.timeline import arrange, step_seconds_error

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


def default_run_id(path: Path | Sequence[Path]) -> str:
    """A run id from the file name(s): ``hf_x.trainer_state.json`` → ``replay-hf_x`` (see :func:`log_stem`)."""
    return "replay-" + log_stem(path)


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
    order their steps end (:func:`trainhealth.timeline.arrange`); a point's ``sections`` are that
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
                for name, loss in p.eval_losses:
                    mon.log_eval(p.step, loss, name=name, timestamp=ts)
                evals += 1
            else:
                if p.sections:
                    mon._sections = dict(p.sections)  # what section() would have timed: log_step attaches them
                # step_s: the log's own time per step, never the assumed pace (see TimedPoint.step_s).
                mon.log_step(p.step, loss=p.loss, grad_norm=p.grad_norm, lr=p.lr, tokens=p.tokens,
                             consumed_samples=p.consumed_samples, skipped=skip, timestamp=ts, step_s=tp.step_s,
                             loss_missing=p.loss_missing or None)
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


# -- the command ---------------------------------------------------------------------------------
def register(sub: Any) -> None:
    """Add ``replay`` to the ``trainhealth`` sub-parsers."""
    from trainhealth.collectors.importers import FORMATS

    r = with_url(command(sub, "replay", "Push a training log through the collectors into Redis, so the detectors "
                                        "and the dashboard act on it. Formats (detected, or --format): "
                                        + ", ".join(FORMATS) + "."))
    log_options(r)
    r.add_argument("--run", help="run id (default replay-<file name>; only with one PATH or --one-run)")
    r.add_argument("--speed", type=float, default=0.0, metavar="K",
                   help="0 (default): push the whole log at once, its records stamped on the log's own timeline "
                        "(ending now). K > 0: replay in real time at K times the log's pace, e.g. a log spanning "
                        "30 days takes 7.2 h at --speed 100; records then carry the real clock, so the dashboard's "
                        "rates are K times the log's. The line printed before pushing says how long it will take; "
                        "Ctrl-C stops it (the run is marked 'interrupted')")
    r.add_argument("--step-seconds", type=float, default=1.0,
                   help="assumed seconds per step for steps the log gives no time for (default 1.0)")
    r.set_defaults(func=run, extra="server")


def run(args: argparse.Namespace) -> int:
    """Parse every PATH, then push it into Redis as a run; 0, or 130 when interrupted."""
    from trainhealth.connection import connect

    check_speed(args.speed, "--speed")
    err = step_seconds_error(args.step_seconds, "--step-seconds")
    if err is not None:
        raise ConfigError(err)
    one_run = args.one_run and len(args.paths) > 1  # the per-rank logs of one job: one run
    if args.run is not None:
        if len(args.paths) > 1 and not one_run:  # it would name only one of the runs: refuse, do not ignore
            raise ConfigError(f"--run {args.run!r} names one run, but the {len(args.paths)} PATHs are replayed as "
                              f"{len(args.paths)} runs; give one PATH, or --one-run for the per-rank logs of one job")
        try:
            validate_run_id(args.run)
        except ConfigError as exc:
            raise ConfigError("--run " + str(exc).removeprefix("run=")) from None

    def progress_bar(span_s: float, total: int, what: str, run: str) -> tuple[Any, Any] | None:
        # Over the log's seconds, so tqdm's ETA is the real time left (steps may be unevenly spaced).
        try:
            from tqdm import tqdm
        except ImportError:  # the server extra brings tqdm; without it, no bar
            return None
        bar = tqdm(total=span_s, desc=f"{run[:40]}: 0/{total:,} {what}", file=sys.stderr, leave=False,
                   dynamic_ncols=True, mininterval=0.25, delay=0.5,
                   bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")

        def update(pushed: int, offset_s: float) -> None:
            bar.set_description_str(f"{run[:40]}: {pushed:,}/{total:,} {what}", refresh=False)
            bar.update(offset_s - bar.n)

        return bar, update

    runs = 1 if one_run else len(args.paths)
    done = 0  # runs replayed completely, for the Ctrl-C message
    interrupt_on_signals()  # SIGTERM too ends the run as "interrupted", not "running" for ever
    try:
        # Parse every file before touching Redis: a typo must not start a server or half-write a run.
        mapping = parse_map(args.map)
        if one_run:
            parsed = [(args.paths, read_run(args.paths, args.format, mapping)[0])]
        else:
            parsed = [(path, read_points(path, args.format, mapping)) for path in args.paths]
        plans = [plan(points, args.step_seconds) for _, points in parsed]
        for pl in plans:  # a --speed that paces some file over years: refuse before replaying any
            check_pace(pl.span_s, args.speed, "--speed")
        url, _ = resolve(args)
        client = connect(url)
        # A bar only where someone watches (as analyze does): a paced replay may wait hours between two steps.
        show = args.speed > 0 and sys.stderr.isatty()
        for (path, points), pl in zip(parsed, plans, strict=True):
            name = " + ".join(path) if isinstance(path, list) else path
            run = (args.run if args.run is not None
                   else default_run_id([Path(p) for p in path] if isinstance(path, list) else Path(path)))
            print(plan_line(pl, name, run, args.speed, args.step_seconds), flush=True)
            bar = progress_bar(pl.span_s, pl.points, "records" if pl.ranks else "steps", run) if show else None
            try:
                res = replay(path, client, run=run, speed=args.speed, step_seconds=args.step_seconds, points=points,
                             progress=bar[1] if bar else None)
            finally:
                if bar:
                    bar[0].close()
            what = (f"{res.points} per-rank records of {len(res.ranks)} ranks" if res.ranks else f"{res.points} steps")
            print(f"replayed {what} and {res.evals} evaluations of {name} as run {res.run!r} "
                  f"(synthetic span {res.span_s:.0f} s)" + ("" if res.delivered else " — NOT all delivered"),
                  flush=True)
            done += 1
        if not live_services(client):
            print("No detector service is running: start `trainhealth serve` to analyse the replayed run(s).")
    except ReplayInterrupted as exc:  # replay() closed the run as INTERRUPTED: say how far it got, no traceback
        res = exc.result
        left = runs - done - 1
        print(f"trainhealth: interrupted after {res.points:,} of {res.total:,} "
              f"{'per-rank records' if res.ranks else 'steps'} of run {res.run!r} "
              f"({fmt_duration(res.offset_s, day=' days')} of the log's {fmt_duration(res.span_s, day=' days')}); "
              f"run marked {INTERRUPTED!r}"
              + ("" if res.delivered else " (NOT all delivered)")
              + (f"; {left} more file{'s' if left > 1 else ''} not replayed" if left > 0 else ""),
              file=sys.stderr, flush=True)
        return 130
    except KeyboardInterrupt:  # while parsing, or between two runs
        print(f"trainhealth: interrupted after replaying {done} of {runs} run{'s' if runs > 1 else ''}",
              file=sys.stderr, flush=True)
        return 130
    return 0
