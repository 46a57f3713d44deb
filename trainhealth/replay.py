"""``trainhealth replay``: push a log file through the collectors into Redis, as if live."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from collectors.importers import hf_trainer_state
from collectors.importers.base import LogPoint
from collectors.monitor import Monitor
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


def read_points(path: str | Path) -> list[LogPoint]:
    """Parse a supported log (Hugging Face ``trainer_state.json`` for now).

    Raises :class:`InputFormatError` when it cannot be parsed or holds no training step.
    """
    points = list(hf_trainer_state.read(path))
    if not any(not p.is_eval for p in points):
        raise InputFormatError(f"{path}: no training steps (log_history entries with 'loss') to replay")
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

    The log has no wall times, so step ``s`` is placed ``step_seconds`` per step after the
    previous logged step, with evaluations taking their logged ``eval_runtime``.
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
    # Synthetic timeline: seconds from the start at which each point ends.
    offsets: list[float] = []
    cursor, prev_step = 0.0, 0
    for p in points:
        if p.is_eval:
            cursor += max(p.eval_seconds or 0.0, 0.0)
        else:
            cursor += max(p.step - prev_step, 1) * step_seconds
            prev_step = p.step
        offsets.append(cursor)
    span = cursor
    live = speed > 0
    start = clock() if live else clock() - span
    mon = Monitor(run, client=client, rank=0, world_size=1, started_at=start)
    mon._phase = "replay"  # the hang detector skips a replayed timeline
    client.hset(mon.keys.meta, "source", f"replay:{path.name}")
    evals = n = 0
    for p, off in zip(points, offsets, strict=True):
        if live:
            wait = start + off / speed - clock()
            if wait > 0:
                sleep(wait)
        ts = clock() if live else start + off
        if p.is_eval:
            mon.badput("evaluation", p.eval_seconds or 0.0, step=p.step, timestamp=ts)
            evals += 1
        else:
            mon.log_step(p.step, loss=p.loss, grad_norm=p.grad_norm, lr=p.lr, tokens=p.tokens, timestamp=ts)
            n += 1
    ok = mon.close("finished")
    log.debug("replayed %d steps and %d evaluations of %s as run %s", n, evals, path, run)
    return ReplayResult(run=run, points=n, evals=evals, span_s=span, delivered=ok)
