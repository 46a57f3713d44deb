"""Memory of this rank, sampled off the hot path: host RSS, and the CUDA caching allocator's counters where the job
uses CUDA. Called from the sender thread when it builds the heartbeat (every ``heartbeat_interval``), so the
training thread never pays for it and the device is never synchronised.

Host: resident set size from ``/proc/self/statm`` (Linux; elsewhere the peak RSS from ``getrusage``) and the
machine's physical memory. CUDA: ``torch.cuda.memory_stats`` of the rank's device — host-side counters of the
caching allocator, read under its lock, no device synchronisation (PyTorch docs, "CUDA semantics: memory
management") — and the device's total memory. torch is never imported here: only a job that imported it and
initialised CUDA gets the CUDA part; otherwise it reports itself absent with the reason.
"""

from __future__ import annotations

import os
import resource
import sys

from trainhealth.wire import CudaMemory, MemorySample

#: ``torch.cuda.memory_stats`` keys sent, under their short names (bytes, or counts).
CUDA_STATS = {
    "allocated_bytes.all.current": "alloc",
    "allocated_bytes.all.peak": "alloc_peak",
    "reserved_bytes.all.current": "reserved",
    "reserved_bytes.all.peak": "reserved_peak",
    "num_alloc_retries": "retries",
    "num_ooms": "ooms",
}


#: Where a cgroup's memory limit is read: v2, then v1 ("max" or a huge number when unlimited).
CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_limit(files: tuple[str, ...] = CGROUP_LIMIT_FILES) -> int | None:
    """This process's cgroup memory limit in bytes, None when there is none (or it cannot be read)."""
    for path in files:
        try:
            with open(path, "rb") as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw == b"max":
            return None
        try:
            v = int(raw)
        except ValueError:
            continue
        return v if 0 < v < 2**60 else None  # cgroup v1 writes ~2**63 for "unlimited"
    return None


class MemorySampler:
    """One sample of this process's memory per call.

    Parameters
    ----------
    local_rank : int
        The rank's index on its node: its CUDA device is ``local_rank % device_count`` (torchrun's and SLURM's
        convention, ``torch.cuda.set_device(local_rank)``; a rank that sees one device — ``CUDA_VISIBLE_DEVICES``
        per rank — uses device 0).

    Examples
    --------
    >>> s = MemorySampler(0).sample()
    >>> s["rss"] > 0 and s["host_total"] >= s["rss"]
    True
    >>> "cuda" in s or s["cuda_absent"] in ("torch not imported", "CUDA not initialised", "no CUDA device")
    True
    """

    def __init__(self, local_rank: int = 0) -> None:
        self.local_rank = local_rank
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._host_total = os.sysconf("SC_PHYS_PAGES") * self._page
        except (ValueError, OSError, AttributeError):
            self._host_total = 0
        limit = cgroup_limit()
        if limit and (not self._host_total or limit < self._host_total):
            self._host_total = limit
        self._device_total: dict[int, int] = {}

    def sample(self) -> MemorySample:
        """``{"rss": bytes, "rss_anon": bytes, "host_total": bytes, "cuda": {...}}`` or, without CUDA,
        ``"cuda_absent": why``.

        ``rss_anon`` is the resident memory not backed by a file (``statm`` resident minus shared): what a leak
        grows and what the OOM killer weighs; a memory-mapped dataset's pages count in ``rss`` only.
        ``host_total`` is the memory this process may use: the machine's, or its cgroup's limit when lower (a
        container, a SLURM job with ``--mem``).

        The CUDA part: ``device`` (index), ``total`` (bytes), and :data:`CUDA_STATS` (bytes, or counts for
        ``retries`` and ``ooms``). Never raises: a part that cannot be read is left out.
        """
        rss, anon = self._rss()
        out: MemorySample = {"rss": rss, "rss_anon": anon, "host_total": self._host_total}
        cuda = self._cuda()
        if isinstance(cuda, str):
            out["cuda_absent"] = cuda
        else:
            out["cuda"] = cuda
        return out

    def _rss(self) -> tuple[int, int]:
        try:
            with open("/proc/self/statm", "rb") as f:
                fields = f.read().split()
            resident, shared = int(fields[1]) * self._page, int(fields[2]) * self._page
            return resident, max(0, resident - shared)
        except (OSError, ValueError, IndexError):
            try:  # not Linux: the peak RSS (kilobytes on Linux and BSD, bytes on macOS)
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                peak = peak if sys.platform == "darwin" else peak * 1024
                return peak, peak
            except (OSError, ValueError):
                return 0, 0

    def _cuda(self) -> CudaMemory | str:
        torch = sys.modules.get("torch")
        if torch is None:
            return "torch not imported"
        try:
            cuda = torch.cuda
            if not cuda.is_initialized():  # never initialise CUDA from this thread
                return "CUDA not initialised"
            n = cuda.device_count()
            if n < 1:
                return "no CUDA device"
            dev = self.local_rank % n
            stats = cuda.memory_stats(dev)
            total = self._device_total.get(dev)
            if total is None:
                total = self._device_total[dev] = int(cuda.get_device_properties(dev).total_memory)
        except Exception as exc:  # a broken torch, a lost device: memory is not worth an error in the job
            return f"CUDA memory unreadable: {type(exc).__name__}"
        out: CudaMemory = {"device": dev, "total": total}
        for key, name in CUDA_STATS.items():
            if key in stats:
                out[name] = int(stats[key])
        return out
