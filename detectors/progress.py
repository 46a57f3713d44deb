"""The progress timeout: how long without a completed step counts as a hang, learned from the run's own steps."""

from __future__ import annotations

import statistics
from collections import deque

from trainhealth import defaults


class ProgressTimeout:
    """``max(floor_s, multiple x the longest healthy interval between step completions seen so far)``.

    An *interval* is the wall time from one completed step to the next of the same generation (s). It is
    *healthy* when no declared pause fell in it (a checkpoint save or load, an evaluation or other ``badput``
    event) and it was not itself longer than the timeout in force (a hang does not teach the timeout). The first
    step of each generation (start-up, compilation) has no interval. Until ``min_intervals`` healthy intervals
    were seen the timeout is ``initial_s``: a second step that recompiles must not page.

    The hang detector (live, from heartbeats), the dead-rank detector and the goodput ledger (which books an
    interval longer than the timeout as ``hang``) share one instance per run, so they agree.

    Parameters
    ----------
    floor_s : float
        Shortest timeout (s).
    multiple : float
        Timeout as a multiple of the longest healthy interval.
    initial_s : float
        Timeout before ``min_intervals`` healthy intervals were seen (s).
    min_intervals : int
        Healthy intervals needed before the learned timeout applies.

    Examples
    --------
    Steps every 35 ms: the floor applies; a 4 s hiccup is healthy (5 x 4 s = 20 s, still under the floor); an 80 s
    stall is a hang and teaches nothing:

    >>> p = ProgressTimeout()
    >>> for i in range(10):
    ...     _ = p.step(0, 100.0 + 0.035 * i, paused=False)
    >>> p.timeout_s, round(p.longest_s, 3)
    (30.0, 0.035)
    >>> p.step(0, 104.315, paused=False), p.timeout_s  # a 4 s step: healthy, under the timeout
    (4.0, 30.0)
    >>> p.step(0, 184.315, paused=False), p.timeout_s  # an 80 s stall: a hang, it teaches nothing
    (80.0, 30.0)

    References
    ----------
    NVIDIA Resiliency Extension, fault tolerance: heartbeat and section timeouts calculated from the observed
    maximum intervals times a safety factor (``safety_factor`` 5.0), with a longer initial timeout until the
    first ones are seen.
    """

    def __init__(self, floor_s: float = defaults.HANG_FLOOR_S, multiple: float = defaults.HANG_STEP_MULTIPLE,
                 initial_s: float = defaults.HANG_INITIAL_S,
                 min_intervals: int = defaults.HANG_MIN_INTERVALS) -> None:
        self.floor_s = floor_s
        self.multiple = multiple
        self.initial_s = initial_s
        self.min_intervals = min_intervals
        self._longest = 0.0
        self._healthy = 0
        self._recent: deque[float] = deque(maxlen=200)
        self._prev: tuple[int, float] | None = None  # (gen, t_end) of the last step
        self._after: list[float] = []  # own seconds of the longest first step after a pause (at most one kept)

    @property
    def timeout_s(self) -> float:
        """The timeout in force (s)."""
        if self._healthy < self.min_intervals:
            return max(self.initial_s, self.floor_s)
        return max(self.floor_s, self.multiple * self._longest)

    @property
    def after_pause_timeout_s(self) -> float:
        """The timeout while waiting for the first step after a declared pause (s)."""
        if not self._after:
            return max(self.initial_s, self.timeout_s)
        return max(self.timeout_s, self.multiple * self._after[0])

    @property
    def longest_s(self) -> float:
        """Longest healthy interval seen (s; 0 before any)."""
        return self._longest

    @property
    def median_s(self) -> float | None:
        """Median of the last 200 healthy intervals (s), None before any: a step's usual length."""
        return statistics.median(self._recent) if self._recent else None

    def step(self, gen: int, t_end: float, paused: bool, own_s: float | None = None) -> float | None:
        """A step of generation ``gen`` completed at unix time ``t_end`` (``paused``: a declared pause fell in
        it; ``own_s`` its own seconds, without the pause); returns its interval (s), None for the first step of a
        generation."""
        if paused and own_s is not None and own_s >= 0 and own_s <= self.after_pause_timeout_s:
            self._after = [max([own_s, *self._after])]
        prev, self._prev = self._prev, (gen, max(t_end, self._prev[1]) if self._prev and self._prev[0] == gen
                                        else t_end)
        if prev is None or prev[0] != gen:
            return None
        interval = max(0.0, t_end - prev[1])
        if not paused and interval <= self.timeout_s:
            self._healthy += 1
            self._longest = max(self._longest, interval)
            self._recent.append(interval)
        return interval
