"""Was it out of memory? The verdict on a rank that died (or a job that restarted), from its last memory samples."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainhealth import defaults
from trainhealth.text import fmt_bytes


@dataclass(frozen=True)
class MemoryVerdict:
    """What a rank's last memory samples say about its death.

    Attributes
    ----------
    likely_oom : bool
        It died at or near its memory's limit.
    where : str
        ``cuda`` or ``host``.
    why : str
        The numbers, in words ("CUDA reserved 78.9 GiB of 80.0 GiB, 3 allocation retries in its last 60 s").
    sample : dict
        The last sample (as the collector sent it).
    """

    likely_oom: bool
    where: str
    why: str
    sample: dict

    def to_dict(self) -> dict[str, Any]:
        return {"likely_oom": self.likely_oom, "where": self.where, "why": self.why, "last_sample": self.sample}


class MemoryHistory:
    """The recent memory samples of each rank (from its heartbeats), to judge a death by them.

    Parameters
    ----------
    keep_s : float
        Seconds of samples kept per rank (the pressure rule looks back ``recent_s``).
    frac, recent_s : float
        :data:`~trainhealth.defaults.MEMORY_PRESSURE_FRAC` and :data:`~trainhealth.defaults.MEMORY_PRESSURE_RECENT_S`.

    Rules, on the rank's newest sample and those of the ``recent_s`` before it:

    - CUDA: an out-of-memory error was raised (``num_ooms`` grew) — the job caught it or died of it; or the
      allocator reserved at least ``frac`` of the device and had to flush its cache and retry an allocation
      (``num_alloc_retries`` grew: PyTorch's own sign of memory pressure, "CUDA semantics — memory management").
      A high ``reserved`` alone is not pressure: the caching allocator keeps what it once used.
    - Host: the process's anonymous RSS is at least ``frac`` of the memory it may use (its cgroup's limit or the
      machine's): the kernel's OOM killer ends such a process with SIGKILL, which leaves no last word.

    Examples
    --------
    >>> h = MemoryHistory()
    >>> GiB = 2**30
    >>> cuda = {"device": 0, "total": 80 * GiB, "alloc": 70 * GiB, "reserved": 78 * GiB, "retries": 4, "ooms": 0}
    >>> h.add(5, 100.0, {"rss": GiB, "rss_anon": GiB, "host_total": 512 * GiB, "cuda": cuda})
    >>> h.add(5, 105.0, {"rss": GiB, "rss_anon": GiB, "host_total": 512 * GiB, "cuda": {**cuda, "retries": 7}})
    >>> h.verdict(5).why
    'CUDA reserved 78.0 GiB of 80.0 GiB (98%) and 3 allocation retries (cache flushes) in its last 5 s'
    >>> h.verdict(4) is None
    True
    """

    def __init__(self, keep_s: float = 300.0, frac: float = defaults.MEMORY_PRESSURE_FRAC,
                 recent_s: float = defaults.MEMORY_PRESSURE_RECENT_S) -> None:
        self.keep_s = keep_s
        self.frac = frac
        self.recent_s = recent_s
        self._samples: dict[int, tuple[float | None, deque[tuple[float, dict]]]] = {}
        self._previous: dict[int, deque[tuple[float, dict]]] = {}  # the samples of a rank's previous incarnation

    def add(self, rank: int, t: float, sample: Mapping[str, Any], inc: float | None = None) -> None:
        """Keep ``sample`` of ``rank`` (incarnation ``inc``) taken at unix time ``t`` (one not newer than the last is
        ignored). A new incarnation keeps the previous one's samples for :meth:`verdict` (``previous=True``)."""
        cur = self._samples.get(rank)
        if cur is None or (inc is not None and cur[0] is not None and inc != cur[0]):
            if cur is not None and cur[1]:
                self._previous[rank] = cur[1]
            cur = (inc, deque())
            self._samples[rank] = cur
        q = cur[1]
        if q and t <= q[-1][0]:
            return
        q.append((t, dict(sample)))
        while q and t - q[0][0] > self.keep_s:
            q.popleft()

    def last(self, rank: int) -> dict | None:
        """The newest sample of ``rank``."""
        cur = self._samples.get(rank)
        return cur[1][-1][1] if cur and cur[1] else None

    def verdict(self, rank: int, previous: bool = False) -> MemoryVerdict | None:
        """The verdict on ``rank``'s death by its samples (``previous``: those of its incarnation before the
        current one, for a restart), None without samples or without pressure."""
        q = self._previous.get(rank) if previous else (self._samples.get(rank) or (None, None))[1]
        if not q:
            return None
        t_last, last = q[-1]
        base = next((s for t, s in q if t_last - t <= self.recent_s), last)
        t_base = next((t for t, _ in q if t_last - t <= self.recent_s), t_last)
        span = f"its last {t_last - t_base:.0f} s" if t_last > t_base else "its last sample"
        cuda, cuda0 = last.get("cuda"), base.get("cuda")
        if isinstance(cuda, dict) and cuda.get("total"):
            total = float(cuda["total"])
            reserved = float(cuda.get("reserved") or 0)
            ooms = int(cuda.get("ooms") or 0) - (int(cuda0.get("ooms") or 0) if isinstance(cuda0, dict) else 0)
            retries = (int(cuda.get("retries") or 0)
                       - (int(cuda0.get("retries") or 0) if isinstance(cuda0, dict) else 0))
            share = f"CUDA reserved {fmt_bytes(reserved)} of {fmt_bytes(total)} ({reserved / total:.0%})"
            if ooms > 0:
                return MemoryVerdict(True, "cuda", f"{ooms} CUDA out-of-memory error{'s' if ooms > 1 else ''} in "
                                                   f"{span}; {share}", last)
            if retries > 0 and reserved >= self.frac * total:
                return MemoryVerdict(True, "cuda", f"{share} and {retries} allocation retr"
                                                   f"{'ies' if retries > 1 else 'y'} (cache flushes) in {span}", last)
        anon, limit = last.get("rss_anon"), last.get("host_total")
        numbers = isinstance(anon, (int, float)) and isinstance(limit, (int, float))
        if numbers and limit > 0 and anon >= self.frac * limit:
            return MemoryVerdict(True, "host", f"host memory {fmt_bytes(anon)} of the {fmt_bytes(limit)} it may use "
                                               f"({anon / limit:.0%}): the kernel's OOM killer ends such a process "
                                               "with SIGKILL", last)
        return None
