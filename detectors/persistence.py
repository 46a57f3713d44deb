"""Persistence across scoring windows: flagged for ``min_windows`` windows in a row → open; kept; resolved.

The bookkeeping the window-scored detectors share (straggler, slow node, rank outlier): each judges its
keys (ranks, hosts) once per scoring window, and a key must be flagged in ``min_windows`` consecutive
windows before an anomaly opens, with its onset at the first of them. While open, every flagged window
refreshes the anomaly's evidence (sent with its next transition); the first window that does not flag it
ends it. Each detector builds its own opening and resolving messages.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any, Generic, TypeVar

from trainhealth.anomaly import Anomaly, run_ended

K = TypeVar("K", bound=Hashable)


class Persistence(Generic[K]):
    """Consecutive flagged windows per key, and the anomalies open for them.

    Parameters
    ----------
    min_windows : int
        Consecutive flagged windows before an anomaly opens (>= 1).

    Examples
    --------
    Rank 5 flagged in the windows starting at steps 100, 150 and 200, then not at 250:

    >>> from trainhealth.anomaly import Anomaly
    >>> p = Persistence(min_windows=2)
    >>> build = lambda onset: Anomaly("straggler", "warning", onset, "rank 5 is slow", ranks=(5,))
    >>> p.flag(5, 100, {"score": 0.5}, build), p.flag(5, 150, {"score": 0.4}, build)[0].step
    ([], 100)
    >>> p.flag(5, 200, {"score": 0.3}, build), p.open[5].evidence
    ([], {'score': 0.3, 'windows': 3})
    >>> p.clear(5).step, p.open
    (100, {})
    """

    def __init__(self, min_windows: int) -> None:
        self.min_windows = min_windows
        self._count: dict[K, int] = {}
        self._first: dict[K, int] = {}
        #: The open anomaly of each key, in opening order.
        self.open: dict[K, Anomaly] = {}

    def flag(self, key: K, window_start: int, evidence: dict[str, Any],
             build: Callable[[int], Anomaly]) -> list[Anomaly]:
        """``key`` is flagged in the window starting at step ``window_start``.

        ``evidence`` gets ``windows`` (consecutive flagged windows so far). Returns ``[build(onset)]`` when the
        anomaly opens now (``onset``: the first step of the first flagged window in a row), else ``[]``; an
        open anomaly takes ``evidence`` without a transition.
        """
        n = self._count.get(key, 0) + 1
        self._count[key] = n
        onset = self._first.setdefault(key, window_start)
        evidence["windows"] = n
        cur = self.open.get(key)
        if cur is not None:
            self.open[key] = replace(cur, evidence=evidence)
            return []
        if n < self.min_windows:
            return []
        self.open[key] = build(onset)
        return [self.open[key]]

    def clear(self, key: K) -> Anomaly | None:
        """``key`` is not flagged (or no longer judged): forget its run of windows; returns its open anomaly, now
        closed here (the caller resolves it with its own message), or None."""
        self._count.pop(key, None)
        self._first.pop(key, None)
        return self.open.pop(key, None)

    def counting(self, key: K) -> bool:
        """Whether ``key`` has a run of flagged windows that has not opened an anomaly yet, or an open one."""
        return key in self._count or key in self.open

    def tracked(self) -> list[K]:
        """Every key with a run of flagged windows or an open anomaly (each once)."""
        return list(dict.fromkeys([*self._count, *self.open]))

    def finish(self, step: int) -> list[Anomaly]:
        """Every rank ended at ``step``: the open anomalies resolved (:func:`trainhealth.anomaly.run_ended`);
        everything forgotten."""
        out = [run_ended(a, step) for a in self.open.values()]
        self.open.clear()
        self._count.clear()
        self._first.clear()
        return out
