"""Memory that keeps growing on a rank: a leak, found before it becomes an out-of-memory crash."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly, run_ended
from trainhealth.text import fmt_bytes, fmt_duration

#: What is followed per rank: the CUDA caching allocator's allocated bytes (live tensors: a leak of tensors kept
#: by reference shows there, while ``reserved`` only follows the cache), and the process's host RSS.
METRICS = {"cuda": "CUDA memory allocated", "host": "host memory (RSS)"}


@dataclass(frozen=True)
class Trend:
    """A rank's memory trend over the window: ``slope`` (bytes/s, Theil–Sen), ``rho`` (Spearman's rank correlation
    with time, -1..1), ``first``/``last`` (bytes, the trend line's values at the window's ends), ``span_s``."""

    slope: float
    rho: float
    first: float
    last: float
    span_s: float

    @property
    def growth(self) -> float:
        """Bytes gained over the window along the trend."""
        return self.last - self.first


def theil_sen(ts: list[float], ys: list[float]) -> tuple[float, float]:
    """``(slope, intercept)`` of the Theil–Sen line: the median of the pairwise slopes, the median of ``y - slope t``.
    Robust to outliers up to 29 % of the points (a GC pause, one sample taken mid-allocation).

    >>> theil_sen([0, 1, 2, 3, 4], [0, 2, 4, 100, 8])
    (2.0, 0.0)
    """
    slopes = sorted((ys[j] - ys[i]) / (ts[j] - ts[i]) for i in range(len(ts)) for j in range(i + 1, len(ts))
                    if ts[j] != ts[i])
    if not slopes:
        return 0.0, _median(ys)
    slope = _median(slopes)
    return slope, _median([y - slope * t for t, y in zip(ts, ys, strict=True)])


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank); 0.0 when either side is constant.

    >>> spearman([1, 2, 3, 4], [10, 20, 30, 25])
    0.8
    """
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return 0.0 if vx == 0 or vy == 0 else cov / math.sqrt(vx * vy)


def _ranks(v: list[float]) -> list[float]:
    order = sorted(range(len(v)), key=v.__getitem__)
    out = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def _median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class MemoryGrowthDetector:
    """Flags a rank whose CUDA-allocated or host memory rises steadily over a window: a leak (tensors kept alive
    by a list of losses, a growing cache, a Python object graph), seen while there is still time to act.

    Fed the memory samples the collectors send with their heartbeats (every 5 s, :mod:`trainhealth.collectors.memory`)
    through :meth:`update`. Per rank and metric (:data:`METRICS`), over the last ``window_s`` seconds (at least
    ``min_span_s`` and ``min_samples`` samples), on the floor of each ``bucket_s`` bucket (its lowest sample: a
    sample lands anywhere in a step, on top of that step's activations; a leak raises what stays between steps):
    the trend's slope (Theil–Sen, on at most ``max_points`` floors evenly thinned) and its steadiness (Spearman's
    rho with time). It opens when the trend gained at least
    ``min_growth_frac`` of the capacity (the device's total, the host's physical memory) over the window and
    ``rho >= min_rho`` — steady growth, not the saw-tooth of a caching allocator or a data loader's buffers. Its
    severity follows the time left: ``critical`` when, at that slope, the capacity is reached within
    ``critical_within_s``, ``warning`` within ``warning_within_s``, else ``info`` (re-judged as it grows). It
    resolves when the window's growth falls under a third of the opening threshold (the leak stopped, or the
    process restarted: a new incarnation starts a new series).

    Parameters
    ----------
    window_s, min_span_s : float
        The trend's window and the shortest span judged (s).
    min_samples, max_points : int
        Fewest samples judged; most floors the trend is fitted on (Theil–Sen is quadratic in them).
    bucket_s : float
        Seconds of samples whose lowest is one floor (12 heartbeats).
    min_growth_frac : float
        Growth over the window, as a fraction of capacity, that opens (0.01: 819 MiB of an 80 GiB H100 in 30 min).
    min_rho : float
        Steadiness required (Spearman's rho of memory with time).
    critical_within_s, warning_within_s : float
        Capacity reached within this many seconds at the current slope: critical, warning (else info).

    Evidence: ``metric`` (``cuda``/``host``), ``slope_bytes_per_h``, ``rho``, ``first``/``last``/``current``/
    ``capacity`` (bytes), ``span_s``, ``eta_s`` (seconds to capacity at the slope; None when not rising).

    Examples
    --------
    Rank 3 leaks 40 MiB a minute on an 80 GiB device from 30 GiB; a sample every 5 s:

    >>> det = MemoryGrowthDetector()
    >>> GiB = 2**30
    >>> for i in range(600):
    ...     t, used = 1000.0 + 5 * i, 30 * GiB + i * 5 * 40 * 2**20 / 60
    ...     for a in det.update(3, "node-a", t, step=i, inc=1.0, metric="cuda", value=used, capacity=80 * GiB):
    ...         print(a.kind, a.severity, a.step, a.ranks, round(a.evidence["slope_bytes_per_h"] / GiB, 2))
    memory_growth warning 252 (3,) 2.34

    It opens once the window holds 0.01 x 80 GiB = 819 MiB of steady growth, 21 minutes in (sample 252); at
    2.34 GiB/h the device is full in 21 h: a warning.

    References
    ----------
    Sen, P. K. (1968), "Estimates of the regression coefficient based on Kendall's tau", JASA 63(324); Spearman
    (1904). PyTorch "CUDA semantics — memory management" (``memory_allocated`` vs ``memory_reserved``; the caching
    allocator keeps freed blocks reserved). Thresholds: judgement, checked on the synthetic leaks and healthy
    saw-tooth series of tests/test_memory.py.
    """

    def __init__(self, window_s: float = defaults.MEMORY_WINDOW_S, min_span_s: float = defaults.MEMORY_MIN_SPAN_S,
                 min_samples: int = defaults.MEMORY_MIN_SAMPLES, max_points: int = defaults.MEMORY_MAX_POINTS,
                 min_growth_frac: float = defaults.MEMORY_GROWTH_FRAC, min_rho: float = defaults.MEMORY_MIN_RHO,
                 critical_within_s: float = defaults.MEMORY_CRITICAL_WITHIN_S,
                 warning_within_s: float = defaults.MEMORY_WARNING_WITHIN_S,
                 bucket_s: float = defaults.MEMORY_BUCKET_S) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.min_samples = min_samples
        self.max_points = max_points
        self.min_growth_frac = min_growth_frac
        self.min_rho = min_rho
        self.critical_within_s = critical_within_s
        self.warning_within_s = warning_within_s
        self.bucket_s = bucket_s
        # (rank, metric) -> (incarnation, samples (t, bytes))
        self._series: dict[tuple[int, str], tuple[float, deque[tuple[float, float]]]] = {}
        self._open: dict[tuple[int, str], Anomaly] = {}

    @property
    def open(self) -> list[Anomaly]:
        """The open anomalies."""
        return list(self._open.values())

    def update(self, rank: int, host: str | None, t: float, *, step: int, inc: float, metric: str, value: float,
               capacity: float | None, gen: int = 0) -> list[Anomaly]:
        """Feed one sample of ``metric`` (bytes) of ``rank`` at unix time ``t`` (its step then, its incarnation);
        return the anomaly states that changed. Samples not newer than the last are ignored (a heartbeat read
        twice); a new incarnation starts the series again (and ends an open anomaly: the process restarted)."""
        key = (rank, metric)
        out: list[Anomaly] = []
        cur = self._series.get(key)
        if cur is None or cur[0] != inc:
            if key in self._open:
                out.append(self._close(key, step, "the process restarted"))
            cur = (inc, deque())
            self._series[key] = cur
        samples = cur[1]
        if samples and t <= samples[-1][0]:
            return out
        if not (math.isfinite(value) and value >= 0):
            return out
        samples.append((t, float(value)))
        while samples and t - samples[0][0] > self.window_s:
            samples.popleft()
        trend = self._trend(samples)
        if trend is None or not capacity or capacity <= 0:
            return out
        opened = self._open.get(key)
        grows = trend.growth >= self.min_growth_frac * capacity and trend.rho >= self.min_rho
        if opened is None:
            if grows:
                a = Anomaly(kind="memory_growth", severity=self._severity(trend, value, capacity), step=step,
                            ranks=(rank,), hosts=(host,) if host else (), gen=gen,
                            evidence=self._evidence(metric, trend, value, capacity),
                            message=self._message(rank, host, metric, trend, value, capacity))
                self._open[key] = a
                out.append(a)
            return out
        if trend.growth < self.min_growth_frac * capacity / 3:
            out.append(self._close(key, step, f"stopped growing ({fmt_bytes(trend.growth)} over the last "
                                              f"{fmt_duration(trend.span_s)})"))
            return out
        sev = self._severity(trend, value, capacity)
        if sev != opened.severity:  # rewritten when it matters to the on-call, not at every sample
            a = replace(opened, severity=sev, evidence=self._evidence(metric, trend, value, capacity),
                        message=self._message(rank, host, metric, trend, value, capacity))
            self._open[key] = a
            out.append(a)
        return out

    def finish(self, step: int) -> list[Anomaly]:
        """Every rank ended (or the job crashed) at ``step``: the open anomalies end with it (a memory trend cannot
        be observed any more)."""
        out = [run_ended(a, step) for a in self._open.values()]
        self._open.clear()
        self._series.clear()
        return out

    def _close(self, key: tuple[int, str], step: int, why: str) -> Anomaly:
        a = self._open.pop(key)
        return replace(a, status=RESOLVED, end_step=max(step, a.step), message=f"{a.message}; {why}")

    def _trend(self, samples: deque[tuple[float, float]]) -> Trend | None:
        if len(samples) < self.min_samples or samples[-1][0] - samples[0][0] < self.min_span_s:
            return None
        # The floor of each bucket: a sample lands anywhere in a step, on top of that step's activations (GiBs of
        # saw-tooth); what a leak raises is the memory left between steps, the bucket's minimum.
        floors: dict[int, tuple[float, float]] = {}
        t0 = samples[0][0]
        for t, v in samples:
            b = int((t - t0) // self.bucket_s)
            if b not in floors or v < floors[b][1]:
                floors[b] = (t0 + (b + 0.5) * self.bucket_s, v)
        pts = [floors[b] for b in sorted(floors)]
        if len(pts) < 3:
            return None
        if len(pts) > self.max_points:
            k = (len(pts) - 1) / (self.max_points - 1)
            pts = [pts[round(i * k)] for i in range(self.max_points)]
        ts = [p[0] - pts[0][0] for p in pts]
        ys = [p[1] for p in pts]
        slope, icpt = theil_sen(ts, ys)
        return Trend(slope, spearman(ts, ys), icpt, icpt + slope * ts[-1], ts[-1])

    def _eta(self, trend: Trend, value: float, capacity: float) -> float | None:
        return max(0.0, capacity - value) / trend.slope if trend.slope > 0 else None

    def _severity(self, trend: Trend, value: float, capacity: float) -> str:
        eta = self._eta(trend, value, capacity)
        if eta is None or eta > self.warning_within_s:
            return "info"
        return "critical" if eta <= self.critical_within_s else "warning"

    def _evidence(self, metric: str, trend: Trend, value: float, capacity: float) -> dict:
        eta = self._eta(trend, value, capacity)
        return {"metric": metric, "slope_bytes_per_h": round(trend.slope * 3600), "rho": round(trend.rho, 3),
                "first": round(trend.first), "last": round(trend.last), "current": round(value),
                "capacity": round(capacity), "span_s": round(trend.span_s, 1),
                "eta_s": None if eta is None else round(eta, 1)}

    def _message(self, rank: int, host: str | None, metric: str, trend: Trend, value: float,
                 capacity: float) -> str:
        eta = self._eta(trend, value, capacity)
        where = f"rank {rank}" + (f" ({host})" if host else "")
        end = (f"; at this rate it reaches the {fmt_bytes(capacity)} {'device' if metric == 'cuda' else 'host'} "
               f"in {fmt_duration(eta)}" if eta is not None else "")
        return (f"{where}: {METRICS[metric]} grows {fmt_bytes(trend.slope * 3600)}/h "
                f"({fmt_bytes(trend.first)} → {fmt_bytes(trend.last)} over {fmt_duration(trend.span_s)}, steadily: "
                f"rho {trend.rho:.2f}){end}: a leak (tensors kept alive, e.g. losses appended without .item(), a "
                "growing cache); take a memory snapshot (torch.cuda.memory._record_memory_history) before it "
                "crashes")
