"""``trainhealth replay``: push a log file through the collectors into Redis, as if live."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import redis

from collectors import importers
from collectors.importers.base import LogPoint
from collectors.monitor import Monitor
from detectors.offline import timeline
from trainhealth.exceptions import ConfigError, InputFormatError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayResult:
    """What a replay pushed: run id, train points, eval intervals, and the synthetic span (s)."""

    run: str
    points: int
    evals: int
    span_s: float
    delivered: bool


def default_run_id(path: Path) -> str:
    """A run id from the file name: ``hf_x.trainer_state.json`` → ``replay-hf_x``."""
    stem = path.name.split(".")[0]
    return "replay-" + (re.sub(r"[^A-Za-z0-9._-]", "-", stem)[:100] or "log")


def read_points(path: str | Path, fmt: str | None = None,
                mapping: Mapping[str, str | None] | None = None) -> list[LogPoint]:
    """Parse a supported training log (format detected, or ``fmt``; see :mod:`collectors.importers`).

    Raises :class:`InputFormatError` when it cannot be parsed or holds no training step.
    """
    fmt = fmt or importers.detect(path)
    points = list(importers.read(path, fmt, mapping))
    if not any(not p.is_eval for p in points):
        if fmt == "hf_trainer_state":
            raise InputFormatError(f"{path}: no training steps (log_history entries with 'loss') to replay")
        raise InputFormatError(f"{path}: no training steps to replay (read as {fmt})")
    return points


def replay(
    path: str | Path,
    client: redis.Redis,
    *,
    run: str | None = None,
    speed: float = 0.0,
    step_seconds: float = 1.0,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    points: list[LogPoint] | None = None,
) -> ReplayResult:
    """Replay ``path`` into Redis as run ``run`` through :class:`collectors.Monitor` (rank 0 of 1).

    Step ``s`` is placed after the previous logged step by the seconds per step the log gives
    for it (:attr:`LogPoint.step_seconds`: Megatron's elapsed time per iteration, a per-step
    timer, wall-clock stamps), else by the assumed ``step_seconds``; evaluations take their
    logged ``eval_runtime``. Skipped-step counts and consumed samples are passed on: a point
    is marked skipped when every step since the previous logged one was skipped.
    ``speed=0`` pushes as fast as possible on that synthetic timeline, ending now;
    ``speed=k`` paces the pushes in real time at ``k`` x the synthetic pace. ``points`` may
    carry the file already parsed with :func:`read_points` (the CLI parses every file before
    it touches Redis).

    Raises
    ------
    ConfigError
        For ``speed < 0`` or ``step_seconds <= 0``.
    InputFormatError
        When the file cannot be parsed (naming file, entry and field).
    """
    if not speed >= 0:
        raise ConfigError(f"speed={speed!r} must be >= 0 (0 = as fast as possible)")
    if not step_seconds > 0:
        raise ConfigError(f"step_seconds={step_seconds!r} must be > 0")
    path = Path(path)
    if points is None:
        points = read_points(path)
    run = run or default_run_id(path)
    placed = list(timeline(points, step_seconds))
    span = placed[-1].offset if placed else 0.0
    live = speed > 0
    start = clock() if live else clock() - span
    mon = Monitor(run, client=client, rank=0, world_size=1, started_at=start)
    mon._phase = "replay"  # the hang detector skips a replayed timeline
    client.hset(mon.keys.meta, "source", f"replay:{path.name}")
    evals = n = 0
    for tp in placed:
        p, off, skip = tp.point, tp.offset, tp.skipped
        if live:
            wait = start + off / speed - clock()
            if wait > 0:
                sleep(wait)
        ts = clock() if live else start + off
        if p.is_eval:
            mon.badput("evaluation", p.eval_seconds or 0.0, step=p.step, timestamp=ts)
            evals += 1
        else:
            # step_s: the log's own time per step, never the assumed pace (see TimedPoint.step_s).
            mon.log_step(p.step, loss=p.loss, grad_norm=p.grad_norm, lr=p.lr, tokens=p.tokens,
                         consumed_samples=p.consumed_samples, skipped=skip, timestamp=ts, step_s=tp.step_s)
            n += 1
    ok = mon.close("finished")
    log.debug("replayed %d steps and %d evaluations of %s as run %s", n, evals, path, run)
    return ReplayResult(run=run, points=n, evals=evals, span_s=span, delivered=ok)
