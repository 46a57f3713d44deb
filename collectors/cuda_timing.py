"""Asynchronous GPU timing of sections with CUDA events: no ``synchronize()`` on the hot path.

CPU wall time of a section is misleading on a GPU: kernel launches return at once and the
work runs later. A CUDA event pair recorded around the section measures the GPU's own time.
Reading it needs the events to have completed, so a step's record waits in a short queue and
is sent once ``Event.query()`` (non-blocking) says its events are done — usually one or two
steps later. Records stay in step order; if events stay incomplete for ``max_wait_steps``
steps the oldest record is sent without GPU times (counted). Only ``close()``/``flush()``
wait for events (``Event.synchronize()``), never the training loop.

References: PyTorch ``torch.cuda.Event`` (``enable_timing=True``, ``record``, ``query``,
``elapsed_time`` in milliseconds); NVIDIA Resiliency Extension's straggler detector times
CUDA kernels the same way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

GPU_PREFIX = "gpu."


def torch_event_factory() -> Callable[[], Any]:
    """``torch.cuda.Event(enable_timing=True)`` as a factory.

    Raises
    ------
    RuntimeError
        When torch is missing or has no CUDA device (the caller falls back to CPU timing).
    """
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("torch is not installed") from exc
    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA device")
    return lambda: torch.cuda.Event(enable_timing=True)


class GpuTimer:
    """Records CUDA event pairs around sections and resolves them later, in step order.

    Parameters
    ----------
    event_factory : callable
        Returns a new event with ``record()``, ``query()``, ``elapsed_time(end)`` (ms) and
        ``synchronize()``, as ``torch.cuda.Event(enable_timing=True)``.
    max_wait_steps : int
        Records waiting for their events at most; beyond it the oldest goes without GPU times.
    """

    def __init__(self, event_factory: Callable[[], Any], max_wait_steps: int = 16) -> None:
        self._factory = event_factory
        self.max_wait_steps = max_wait_steps
        self._pool: list[Any] = []
        self._pending: list[tuple[str, Any, Any]] = []
        self._waiting: deque[tuple[dict[str, Any], list[tuple[str, Any, Any]]]] = deque()
        #: Records sent without their GPU times because the events took too long.
        self.unresolved = 0

    def _event(self) -> Any:
        ev = self._pool.pop() if self._pool else self._factory()
        ev.record()
        return ev

    def start(self) -> Any:
        """Record a start event on the current stream; returns it for :meth:`stop`."""
        return self._event()

    def stop(self, name: str, start: Any) -> None:
        """Record the end event of section ``name``."""
        self._pending.append((name, start, self._event()))

    def take_pending(self) -> list[tuple[str, Any, Any]]:
        """The event pairs recorded since the last call (they belong to the step ending now)."""
        pending, self._pending = self._pending, []
        return pending

    def submit(self, rec: dict[str, Any], events: list[tuple[str, Any, Any]]) -> list[dict[str, Any]]:
        """Queue ``rec`` behind earlier ones; return the records now complete, in order."""
        self._waiting.append((rec, events))
        return self._ready(block=False)

    def drain(self) -> list[dict[str, Any]]:
        """Wait for every queued record's events (close/flush only) and return them all."""
        return self._ready(block=True)

    def _ready(self, block: bool) -> list[dict[str, Any]]:
        out = []
        waiting = self._waiting
        while waiting:
            rec, events = waiting[0]
            if block:
                for _, _, end in events:
                    end.synchronize()
            elif not all(end.query() for _, _, end in events):
                if len(waiting) <= self.max_wait_steps:
                    break
                waiting.popleft()
                self.unresolved += 1
                out.append(rec)
                continue
            waiting.popleft()
            for name, start, end in events:
                key = GPU_PREFIX + name
                rec[key] = rec.get(key, 0.0) + start.elapsed_time(end) / 1000.0
                self._pool += (start, end)
            out.append(rec)
        return out
