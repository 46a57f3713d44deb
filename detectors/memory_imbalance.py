"""Memory imbalance: one rank's peak CUDA allocation far above the other ranks', the rank that runs out of memory
first."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from statistics import median

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly, run_ended
from trainhealth.text import fmt_bytes


class MemoryImbalanceDetector:
    """Flags a rank whose peak CUDA allocation stands out above the other ranks': in data-parallel training every
    rank holds the same model and batch shapes, so one rank far above the rest holds something the others do not
    (rank 0 gathering metrics or a full state dict, an uneven pipeline split, a bigger embedding shard) and is the
    one that runs out of memory while the others have room.

    Fed every rank's newest heartbeat sample (:mod:`trainhealth.collectors.memory`: ``cuda.alloc_peak``, the caching
    allocator's peak of live tensors, and ``cuda.total``) through :meth:`update`. With at least ``min_ranks`` ranks
    reporting, a rank is flagged when its peak is above the ranks' median by at least ``frac`` of its device and its
    modified z-score ``0.6745 (peak - median) / MAD`` exceeds ``z`` (any excess counts when the MAD is 0: the other
    ranks agree to the byte). ``min_samples`` new samples of the rank in a row flagged open the anomaly (its onset:
    the step when the first was seen); the first new sample not flagged resolves it (the others caught up, or the
    process restarted and its peak with it). Severity: ``warning`` when the rank's peak is at least ``pressure_frac``
    of its device (near its limit), else ``info``; a change is a transition.

    Parameters
    ----------
    z : float
        Modified z-score above which a rank's peak is an outlier.
    frac : float
        Least excess over the median, as a fraction of the rank's device memory.
    min_ranks : int
        Ranks with a sample needed to judge.
    min_samples : int
        Consecutive new samples flagged before opening.
    pressure_frac : float
        Share of the device the rank's peak reaches for a warning.

    Evidence: ``peak``, ``median_peak``, ``excess``, ``capacity`` (bytes), ``z`` (None when the MAD is 0),
    ``n_ranks``, ``samples``.

    Examples
    --------
    Eight ranks peak at 40 GiB of 80 GiB; rank 0 at 52 GiB from its third heartbeat on (the others differ by a few
    MiB); then it frees its extra 12 GiB and the allocator's peak is reset:

    >>> GiB, MiB = 2**30, 2**20
    >>> det = MemoryImbalanceDetector()
    >>> for i in range(8):
    ...     peaks = {r: (100.0 + 5 * i, 40 * GiB + r * 3 * MiB + (12 * GiB if r == 0 and 2 <= i < 6 else 0), 80 * GiB)
    ...              for r in range(8)}
    ...     for a in det.update(peaks, step=10 * i):
    ...         print(a.kind, a.severity, a.status, a.id, a.end_step, round(a.evidence["excess"] / GiB, 2))
    memory_imbalance info active memory_imbalance:0:20:0 None 11.99
    memory_imbalance info resolved memory_imbalance:0:20:0 60 11.99

    References
    ----------
    Iglewicz, B. and Hoaglin, D. C. (1993), "How to Detect and Handle Outliers" (the modified z-score, 3.5). PyTorch
    "CUDA semantics — memory management" (``max_memory_allocated``: the peak of live tensors). The 10 % of the device:
    the headroom :data:`~trainhealth.defaults.MEMORY_PRESSURE_FRAC` leaves.
    """

    def __init__(self, z: float = defaults.MEMORY_IMBALANCE_Z, frac: float = defaults.MEMORY_IMBALANCE_FRAC,
                 min_ranks: int = defaults.MEMORY_IMBALANCE_MIN_RANKS,
                 min_samples: int = defaults.MEMORY_IMBALANCE_MIN_SAMPLES,
                 pressure_frac: float = defaults.MEMORY_PRESSURE_FRAC) -> None:
        self.z = z
        self.frac = frac
        self.min_ranks = min_ranks
        self.min_samples = min_samples
        self.pressure_frac = pressure_frac
        self._reset()

    def _reset(self) -> None:
        self._seen: dict[int, float] = {}  # rank -> time (unix s) of the newest sample judged
        self._count: dict[int, tuple[int, int]] = {}  # rank -> (flagged samples in a row, step of the first)
        self._open: dict[int, Anomaly] = {}

    @property
    def open(self) -> list[Anomaly]:
        """The open anomalies."""
        return list(self._open.values())

    def update(self, peaks: Mapping[int, tuple[float, float, float]], *, step: int, gen: int = 0,
               hosts: Mapping[int, str] | None = None) -> list[Anomaly]:
        """Judge every rank's newest sample: ``peaks`` maps rank -> ``(unix s of the sample, peak allocated bytes,
        device bytes)``; ``step`` is the run's step now. Returns the anomaly states that changed; a rank whose sample
        is not newer than the one judged before is not judged again."""
        valid = {r: v for r, v in peaks.items() if v[2] > 0 and math.isfinite(v[1]) and v[1] >= 0}
        if len(valid) < self.min_ranks:
            return []
        values = [v[1] for v in valid.values()]
        mid = median(values)
        mad = median(abs(x - mid) for x in values)
        out: list[Anomaly] = []
        for r in sorted(valid):
            t, peak, cap = valid[r]
            if t <= self._seen.get(r, -math.inf):
                continue
            self._seen[r] = t
            excess = peak - mid
            z = 0.6745 * excess / mad if mad > 0 else None
            flagged = excess >= self.frac * cap and (z is None or z > self.z) and excess > 0
            if not flagged:
                self._count.pop(r, None)
                cur = self._open.pop(r, None)
                if cur is not None:
                    out.append(replace(cur, status=RESOLVED, end_step=max(step, cur.step), message=(
                        f"{cur.message}; back to {fmt_bytes(peak)} vs {fmt_bytes(mid)} on the median rank")))
                continue
            n, first = self._count.get(r, (0, step))
            self._count[r] = (n + 1, first)
            ev = {"peak": round(peak), "median_peak": round(mid), "excess": round(excess), "capacity": round(cap),
                  "z": None if z is None else round(z, 2), "n_ranks": len(valid), "samples": n + 1}
            sev = "warning" if peak >= self.pressure_frac * cap else "info"
            host = (hosts or {}).get(r)
            cur = self._open.get(r)
            if cur is None and n + 1 >= self.min_samples:
                cur = self._open[r] = Anomaly(kind="memory_imbalance", severity=sev, step=first, ranks=(r,),
                                              hosts=(host,) if host else (), gen=gen, evidence=ev,
                                              message=self._message(r, host, ev))
                out.append(cur)
            elif cur is not None:
                self._open[r] = replace(cur, severity=sev, evidence=ev, message=self._message(r, host, ev))
                if sev != cur.severity:
                    out.append(self._open[r])
        return out

    def finish(self, step: int) -> list[Anomaly]:
        """Every rank ended (or the job crashed) at ``step``: the open anomalies end with it."""
        out = [run_ended(a, step) for a in self._open.values()]
        self._reset()
        return out

    @staticmethod
    def _message(rank: int, host: str | None, ev: dict) -> str:
        where = f"rank {rank}" + (f" ({host})" if host else "")
        z = f"; modified z {ev['z']:.1f}" if ev["z"] is not None else ""
        return (f"{where}: peak CUDA allocation {fmt_bytes(ev['peak'])} vs {fmt_bytes(ev['median_peak'])} on the "
                f"median of {ev['n_ranks']} ranks, {fmt_bytes(ev['excess'])} more of its "
                f"{fmt_bytes(ev['capacity'])} device{z}: it runs out of memory first; it holds what the others do not "
                "(rank 0 gathering metrics or a full state dict, an uneven pipeline split, a larger embedding or "
                "expert shard): record its allocations (torch.cuda.memory._record_memory_history) and balance them")
