"""Rollups of the step aggregates per 10, 100 and 1,000 steps: what the dashboard's whole-run charts read on a long run.

A month-long run has millions of steps; the per-step stream ``th:{run}:agg`` carries every rank's busy seconds and is
bounded (``defaults.AGG_RETENTION_ENTRIES``), so it neither fits a whole-run chart's read nor holds the run's start.
The detector service folds each generation's steps into buckets of :data:`~trainhealth.defaults.ROLLUP_STEPS` steps
and writes one ``th:{run}:agg:rollup`` entry per bucket (docs/architecture.md): the extremes and mean of the loss
and grad norm with the steps they were at (so a min/max-preserving reducer keeps every spike, as on the raw
steps), the tokens and the time the steps took, the last learning rate, how many values were NaN/inf, and the
ranks' busy-time distribution (each rank's mean busy seconds a step over the bucket: median, 99th percentile, max and
the rank at the max: a whole-run straggler view that the per-step stream, bounded, cannot give). Pure logic, no
I/O: :class:`StepRollup` takes aggregates and returns the buckets they complete; :class:`Rollups` runs one per level
(``defaults.ROLLUP_LEVELS``: 10, 100 and 1,000 steps; each its own stream, ``RunKeys.rollup(every)``).

A bucket ends at its last step (``first // every * every + every - 1``) or when a step of another bucket or
generation arrives (a restart ends the generation's last bucket, short); it is emitted once, complete as far as the
steps seen go. Steps arrive in order within a generation (:class:`~trainhealth.detectors.aggregate.Aggregator`); one
that goes back (a replayed step) starts a new bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainhealth.defaults import ROLLUP_LEVELS, ROLLUP_STEPS


@dataclass(frozen=True)
class Bucket:
    """One rollup entry: the steps ``first``-``last`` of generation ``gen`` (``n`` of them seen).

    Attributes
    ----------
    gen, first, last, n : int
        Restart generation, first and last step (inclusive), steps aggregated.
    t_start, t_end : float
        Unix s: the first step's start (its end when unknown) and the last step's end.
    loss_min, loss_max, loss_mean : float | None
        Over the finite losses (None when none); ``loss_min_step``/``loss_max_step`` where the extremes were.
    loss_nonfinite : int
        Steps whose loss was NaN or ±inf; ``loss_nonfinite_step`` the first of them (None when none).
    grad_norm_min, grad_norm_max, grad_norm_mean, grad_norm_min_step, grad_norm_max_step, grad_norm_nonfinite :
        The same for the grad norm.
    lr : float | None
        The last step's learning rate.
    tokens : int | None
        Tokens of the steps (None when no step reported any).
    dur_s : float | None
        Seconds the steps took (their ``t_end - t_start``, or ``step_s``), over ``timed`` steps (None when none).
    busy_p50, busy_p99, busy_max : float | None
        Seconds: over the ranks, the median, 99th percentile (linear interpolation) and largest of each rank's mean
        busy seconds a step in the bucket (the steps it reported; None when no rank timed a section).
    busy_max_rank : int | None
        The rank with ``busy_max`` (the lowest such rank).
    every : int
        Steps per bucket of the level it belongs to (not a field of the entry: its stream says it).
    """

    gen: int
    first: int
    last: int
    n: int
    t_start: float
    t_end: float
    loss_min: float | None = None
    loss_max: float | None = None
    loss_mean: float | None = None
    loss_min_step: int | None = None
    loss_max_step: int | None = None
    loss_nonfinite: int = 0
    loss_nonfinite_step: int | None = None
    grad_norm_min: float | None = None
    grad_norm_max: float | None = None
    grad_norm_mean: float | None = None
    grad_norm_min_step: int | None = None
    grad_norm_max_step: int | None = None
    grad_norm_nonfinite: int = 0
    grad_norm_nonfinite_step: int | None = None
    lr: float | None = None
    tokens: int | None = None
    dur_s: float | None = None
    timed: int = 0
    busy_p50: float | None = None
    busy_p99: float | None = None
    busy_max: float | None = None
    busy_max_rank: int | None = None
    every: int = ROLLUP_STEPS

    @property
    def entry_id(self) -> str:
        """The stream entry id, ``<gen + 1>-<last>``: ordered as the per-step stream's ids (``<gen + 1>-<step>``)."""
        return f"{self.gen + 1}-{self.last}"

    def fields(self) -> dict[str, Any]:
        """The stream entry's fields: numbers as their ``repr`` (floats) or ints; a None is left out."""
        out: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if value is None or name == "every":
                continue
            out[name] = repr(value) if isinstance(value, float) else value
        return out


class _Stat:
    """Min, max (with their steps), sum and count of the finite values; count and first step of the others."""

    __slots__ = ("bad", "bad_step", "count", "hi", "hi_step", "lo", "lo_step", "total")

    def __init__(self) -> None:
        self.lo = self.hi = math.nan
        self.lo_step = self.hi_step = self.bad_step = None
        self.total, self.count, self.bad = 0.0, 0, 0

    def add(self, value: float | None, step: int) -> None:
        if value is None:
            return
        if not math.isfinite(value):
            self.bad += 1
            if self.bad_step is None:
                self.bad_step = step
            return
        if self.count == 0 or value < self.lo:
            self.lo, self.lo_step = value, step
        if self.count == 0 or value > self.hi:
            self.hi, self.hi_step = value, step
        self.total += value
        self.count += 1

    def out(self, name: str) -> dict[str, Any]:
        some = self.count > 0
        return {f"{name}_min": self.lo if some else None, f"{name}_max": self.hi if some else None,
                f"{name}_mean": self.total / self.count if some else None,
                f"{name}_min_step": self.lo_step, f"{name}_max_step": self.hi_step,
                f"{name}_nonfinite": self.bad, f"{name}_nonfinite_step": self.bad_step}


class StepRollup:
    """Folds step aggregates into buckets of ``every`` steps (module docstring).

    Parameters
    ----------
    every : int
        Steps per bucket (default :data:`~trainhealth.defaults.ROLLUP_STEPS`, 100: a 1,000,000-step run is 10,000
        entries, which the charts reduce to 2,000 points per curve).

    Examples
    --------
    Steps 0-249 of a run whose loss spikes at step 120, then a restart at step 230 (generation 1):

    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> def agg(step, gen=0, loss=None):
    ...     return StepAggregate(step=step, gen=gen, inc=0.0, t_start=float(step), t_end=step + 0.5,
    ...                          loss=3.0 - step / 1000 if loss is None else loss, grad_norm=1.0, lr=3e-4,
    ...                          tokens=4096, samples=8, consumed_samples=None, batch_index=None, skipped=False,
    ...                          step_s=None, n_ranks=4, busy=(), data_s=0.0, bad_ranks=())
    >>> r = StepRollup(every=100)
    >>> done = [b for s in range(240) for b in r.update(agg(s, loss=9.5 if s == 120 else None))]
    >>> done += r.update(agg(230, gen=1))
    >>> [(b.gen, b.first, b.last, b.n, b.loss_max, b.loss_max_step, b.tokens, b.dur_s) for b in done]
    [(0, 0, 99, 100, 3.0, 0, 409600, 50.0), (0, 100, 199, 100, 9.5, 120, 409600, 50.0), \
(0, 200, 239, 40, 2.8, 200, 163840, 20.0)]
    """

    def __init__(self, every: int = ROLLUP_STEPS) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1 step, not {every}")
        self.every = every
        self._open: dict[str, Any] | None = None

    def update(self, agg: Any, busy: np.ndarray | None = None) -> list[Bucket]:
        """Add one :class:`~trainhealth.detectors.aggregate.StepAggregate`; returns the buckets it completes (the
        open one when ``agg`` starts another bucket or generation, or when it is the bucket's last step).

        ``busy`` is ``agg.busy`` as float64 with NaN for a missing rank, when the caller has it already
        (:class:`Rollups` converts it once for every level)."""
        out: list[Bucket] = []
        cur = self._open
        if cur is not None and (agg.gen != cur["gen"] or agg.step <= cur["last"]
                                or agg.step // self.every != cur["first"] // self.every):
            out.append(self._close())
            cur = None
        if cur is None:
            cur = self._open = {"gen": agg.gen, "first": agg.step, "last": agg.step, "n": 0,
                                "t_start": agg.t_start if agg.t_start is not None else agg.t_end,
                                "t_end": agg.t_end, "loss": _Stat(), "grad_norm": _Stat(), "lr": None,
                                "tokens": None, "dur_s": 0.0, "timed": 0, "busy_sum": None, "busy_n": None}
        cur["last"], cur["t_end"], cur["n"] = agg.step, agg.t_end, cur["n"] + 1
        cur["loss"].add(agg.loss, agg.step)
        cur["grad_norm"].add(agg.grad_norm, agg.step)
        if agg.lr is not None:
            cur["lr"] = agg.lr
        if agg.tokens is not None:
            cur["tokens"] = (cur["tokens"] or 0) + agg.tokens
        dur = (agg.t_end - agg.t_start) if agg.t_start is not None else agg.step_s
        if dur is not None and math.isfinite(dur) and dur >= 0:
            cur["dur_s"] += dur
            cur["timed"] += 1
        if len(agg.busy):  # a tuple, or already an array (Rollups)
            b = _busy_array(agg.busy) if busy is None else busy
            total, n = cur["busy_sum"], cur["busy_n"]
            if total is None:
                total, n = np.zeros(len(b)), np.zeros(len(b))
            elif len(total) < len(b):  # the world grew
                pad = np.zeros(len(b) - len(total))
                total, n = np.concatenate([total, pad]), np.concatenate([n, pad])
            seen = np.isfinite(b)
            total[:len(b)] += np.where(seen, b, 0.0)
            n[:len(b)] += seen
            cur["busy_sum"], cur["busy_n"] = total, n
        if (agg.step + 1) % self.every == 0:
            out.append(self._close())
        return out

    def flush(self) -> list[Bucket]:
        """The open bucket, short (the run ended); empty when none is open."""
        return [self._close()] if self._open is not None else []

    def _close(self) -> Bucket:
        cur, self._open = self._open, None
        assert cur is not None
        busy: dict[str, Any] = {}
        if cur["busy_n"] is not None and cur["busy_n"].any():
            seen = cur["busy_n"] > 0
            ranks = np.flatnonzero(seen)
            mean = cur["busy_sum"][seen] / cur["busy_n"][seen]
            top = int(np.argmax(mean))
            p50, p99 = np.percentile(mean, (50, 99))
            busy = {"busy_p50": round(float(p50), 6), "busy_p99": round(float(p99), 6),
                    "busy_max": round(float(mean[top]), 6), "busy_max_rank": int(ranks[top])}
        return Bucket(gen=cur["gen"], first=cur["first"], last=cur["last"], n=cur["n"], t_start=cur["t_start"],
                      t_end=cur["t_end"], **cur["loss"].out("loss"), **cur["grad_norm"].out("grad_norm"),
                      lr=cur["lr"], tokens=cur["tokens"], dur_s=cur["dur_s"] if cur["timed"] else None,
                      timed=cur["timed"], every=self.every, **busy)


def _busy_array(busy: Any) -> np.ndarray:
    """A step's per-rank busy seconds (None for a missing rank) as float64, NaN where missing."""
    return np.array(busy, dtype=np.float64)


class Rollups:
    """One :class:`StepRollup` per level (``every`` steps a bucket), fed the same aggregates.

    Parameters
    ----------
    levels : tuple of int
        Steps per bucket of each level (default :data:`~trainhealth.defaults.ROLLUP_LEVELS`: 10, 100, 1,000).

    Examples
    --------
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> r = Rollups((10, 100))
    >>> done = [b for s in range(100) for b in r.update(StepAggregate(
    ...     step=s, gen=0, inc=0.0, t_start=float(s), t_end=s + 0.5, loss=2.0, grad_norm=1.0, lr=3e-4, tokens=8,
    ...     samples=1, consumed_samples=None, batch_index=None, skipped=False, step_s=None, n_ranks=4,
    ...     busy=(0.4, 0.4, None if s == 50 else 0.9, 0.4), data_s=0.0, bad_ranks=()))]
    >>> [(b.every, b.first, b.last) for b in done][-3:]
    [(10, 80, 89), (10, 90, 99), (100, 0, 99)]
    >>> b = done[-1]
    >>> (b.busy_p50, b.busy_max, b.busy_max_rank)
    (0.4, 0.9, 2)
    """

    def __init__(self, levels: tuple[int, ...] = ROLLUP_LEVELS) -> None:
        self.levels = {every: StepRollup(every) for every in levels}

    def update(self, agg: Any) -> list[Bucket]:
        """The buckets of every level that ``agg`` completes (finest level first)."""
        busy = _busy_array(agg.busy) if len(agg.busy) else None
        out: list[Bucket] = []
        for rollup in self.levels.values():
            out += rollup.update(agg, busy)
        return out

    def flush(self) -> list[Bucket]:
        """The open bucket of every level, short (the run ended)."""
        return [b for rollup in self.levels.values() for b in rollup.flush()]
