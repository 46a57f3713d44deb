"""Restart storms: the run keeps restarting (too many generations within an hour of wall time)."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector


class RestartStormDetector(StepDetector):
    """Flags ``count`` or more restarts within ``window_s`` seconds of wall time, once per storm.

    A restart is the first step of a new generation (new processes, or a rollback to an earlier
    step: what :class:`~trainhealth.detectors.restart.RestartDetector` reports one by one), timed by when that
    step ended (unix s of the records, so a replay finds the same storm). Each restart costs the
    downtime plus the steps recomputed since the last checkpoint; a job failing more often than
    every ``window_s / count`` seconds spends much of its time restarting, and an automatic
    relauncher hides it (each restart alone is only a warning). When the ``count``-th restart
    within ``window_s`` arrives the anomaly opens (critical) with its onset at the first of them;
    further restarts update it; it resolves once ``window_s`` passes without a restart
    (``end_step`` = the last restart's resume step).

    Parameters
    ----------
    count : int
        Restarts within the window that make a storm.
    window_s : float
        Sliding window of wall time (s).

    Evidence: ``restarts`` (in the storm so far), ``window_s``, ``span_s`` (first to last restart,
    s), ``resume_steps`` and ``generations`` (aligned, per restart).

    Examples
    --------
    >>> det = RestartStormDetector(count=3, window_s=3600)
    >>> runs = [(0, 0, 1000.0), (1, 90, 1500.0), (2, 170, 2100.0), (3, 250, 2700.0), (4, 300, 3000.0),
    ...         (4, 500, 6700.0)]
    >>> for gen, step, t in runs:
    ...     a = StepAggregate(step, gen, 0.0, None, t, 1.0, 1.0, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.status, an.step, an.end_step, an.evidence["restarts"], an.evidence["span_s"])
    restart_storm active 90 None 3 1200.0
    restart_storm active 90 None 4 1500.0
    restart_storm resolved 90 300 4 1500.0

    The first launch (generation 0) is not a restart; the restarts at 1500, 2100 and 2700 s open
    the storm, the one at 3000 s extends it, and an hour without one ends it.

    References
    ----------
    Kubernetes pod lifecycle, CrashLoopBackOff (a container restarting repeatedly is backed off
    10 s, doubling to 5 min, reset after 10 min of running); PyTorch ``torchrun --max-restarts``
    (a budget of restarts before the elastic agent gives up).
    """

    def __init__(self, count: int = defaults.RESTART_STORM_COUNT,
                 window_s: float = defaults.RESTART_STORM_WINDOW_S) -> None:
        self.count = count
        self.window_s = window_s
        self._gen: int | None = None
        self._recent: deque[tuple[float, int, int]] = deque()  # (t, resume step, gen)
        self._storm: list[tuple[float, int, int]] = []
        self._open: Anomaly | None = None

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the storm's changed state (on restarts, and when it ends)."""
        t = agg.t_end
        if self._gen is None or agg.gen <= self._gen:
            self._gen = agg.gen if self._gen is None else self._gen
            return self._maybe_end(t)
        self._gen = agg.gen
        out = self._maybe_end(t)
        restart = (t, agg.step, agg.gen)
        self._recent.append(restart)
        while self._recent and t - self._recent[0][0] > self.window_s:
            self._recent.popleft()
        if self._open is not None:
            self._storm.append(restart)
            self._open = replace(self._open, evidence=self._evidence(), message=self._message())
            return [*out, self._open]
        if len(self._recent) >= self.count:
            self._storm = list(self._recent)
            first = self._storm[0]
            self._open = Anomaly(kind="restart_storm", severity="critical", step=first[1], gen=first[2],
                                 evidence=self._evidence(), message=self._message())
            out.append(self._open)
        return out

    def _maybe_end(self, t: float) -> list[Anomaly]:
        cur = self._open
        if cur is None or t - self._storm[-1][0] < self.window_s:
            return []
        self._open = None
        last = self._storm[-1]
        return [replace(cur, status=RESOLVED, end_step=last[1],
                        message=(f"restart storm over: {len(self._storm)} restarts from step {cur.step} to step "
                                 f"{last[1]}, none in the {self.window_s / 60:.0f} min since"))]

    def _evidence(self) -> dict:
        s = self._storm
        return {"restarts": len(s), "window_s": self.window_s, "span_s": round(s[-1][0] - s[0][0], 3),
                "resume_steps": [x[1] for x in s], "generations": [x[2] for x in s]}

    def _message(self) -> str:
        s = self._storm
        span = (s[-1][0] - s[0][0]) / 60
        return (f"restart storm: {len(s)} restarts in {span:.0f} min (threshold {self.count} within "
                f"{self.window_s / 60:.0f} min), resumed at steps {', '.join(map(str, [x[1] for x in s][:10]))}: "
                "the job keeps failing; find the cause (dead_rank, hang, nan_inf, logs) before the relauncher "
                "burns more time")
