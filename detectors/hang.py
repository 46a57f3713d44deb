"""Hangs and silent ranks, from the collectors' heartbeats."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from detectors.anomaly import RESOLVED, Anomaly
from trainhealth import defaults


class HangDetector:
    """Flags ranks that completed no step for too long, or whose heartbeat stopped.

    Heartbeats are sent by the collector's background thread every ``heartbeat_interval``
    seconds and carry the rank's last completed step and when it completed. So:

    * fresh heartbeat, stale step time → the training thread is stuck (hang, deadlock in a
      collective, data-loader stall): no progress for ``now - step_t`` seconds;
    * stale heartbeat → the process (or node) is gone.

    The progress timeout is ``max(floor_s, step_multiple x median step time)`` with the
    median over the last 200 completed steps, so a job with 60 s steps is not flagged after
    2 minutes; a rank whose heartbeat says ``phase=checkpoint_save`` (or load) gets
    ``checkpoint_s`` instead. All hung ranks of one stall form one anomaly (critical), whose
    onset step is the earliest last-completed step among them; it resolves when they all
    progress again.

    Parameters
    ----------
    floor_s : float
        Minimum progress timeout (s).
    step_multiple : float
        Timeout as a multiple of the median step time.
    checkpoint_s : float
        Timeout while a rank is saving or loading a checkpoint (s).
    heartbeat_interval : float
        The collectors' heartbeat interval (s).
    missed_intervals : int
        Heartbeats missed before a rank counts as gone.

    Evidence: ``timeout_s``, ``stalled_s`` (longest no-progress time), ``silent_ranks``
    (ranks with a stale heartbeat), ``median_step_s``.

    Examples
    --------
    >>> det = HangDetector(floor_s=60)
    >>> hb = {0: {"t": 1025.0, "step": 41, "step_t": 1000.0, "phase": "train"},
    ...       1: {"t": 1025.0, "step": 41, "step_t": 1000.0, "phase": "train"}}
    >>> det.check(1030.0, hb)
    []
    >>> hb[1] = {"t": 1095.0, "step": 41, "step_t": 1000.0, "phase": "train"}
    >>> hb[0] = {"t": 1095.0, "step": 42, "step_t": 1090.0, "phase": "train"}
    >>> [(a.kind, a.ranks, a.step, a.evidence["stalled_s"]) for a in det.check(1100.0, hb)]
    [('hang', (1,), 41, 100.0)]
    >>> hb[1] = {"t": 1110.0, "step": 42, "step_t": 1110.0, "phase": "train"}
    >>> [(a.status, a.end_step) for a in det.check(1111.0, hb)]
    [('resolved', 42)]
    """

    def __init__(
        self,
        floor_s: float = defaults.HANG_FLOOR_S,
        step_multiple: float = defaults.HANG_STEP_MULTIPLE,
        checkpoint_s: float = defaults.HANG_CHECKPOINT_S,
        heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL_S,
        missed_intervals: int = defaults.HEARTBEAT_MISSED_INTERVALS,
    ) -> None:
        self.floor_s = floor_s
        self.step_multiple = step_multiple
        self.checkpoint_s = checkpoint_s
        self.heartbeat_interval = heartbeat_interval
        self.missed_intervals = missed_intervals
        self._step_s: deque[float] = deque(maxlen=200)
        self._open: Anomaly | None = None
        self._gen = 0

    def observe_step(self, seconds: float | None, gen: int = 0) -> None:
        """Record a completed step's wall time (s), for the learned timeout."""
        self._gen = gen
        if seconds is not None and seconds >= 0:
            self._step_s.append(seconds)

    @property
    def timeout_s(self) -> float:
        """Current progress timeout (s)."""
        med = statistics.median(self._step_s) if self._step_s else 0.0
        return max(self.floor_s, self.step_multiple * med)

    def check(self, now: float, heartbeats: Mapping[int, Mapping[str, Any]]) -> list[Anomaly]:
        """Judge the heartbeats at time ``now`` (unix s); return anomaly states that changed.

        ``heartbeats`` maps rank to the decoded JSON of ``th:{run}:hb``.
        """
        timeout = self.timeout_s
        hung: dict[int, tuple[float, int | None]] = {}
        silent: list[int] = []
        for rank, hb in heartbeats.items():
            if hb.get("phase") == "replay":
                continue  # a log being replayed has its own (past) timeline
            t = float(hb.get("t") or 0.0)
            step_t = hb.get("step_t")
            since = float(step_t) if step_t is not None else t
            limit = self.checkpoint_s if str(hb.get("phase", "train")).startswith("checkpoint") else timeout
            gone = now - t > self.missed_intervals * self.heartbeat_interval
            if gone:
                silent.append(rank)
            if gone or now - since > limit:
                hung[rank] = (now - since, hb.get("step"))
        cur = self._open
        if not hung:
            if cur is None:
                return []
            self._open = None
            steps = [hb.get("step") for hb in heartbeats.values() if hb.get("step") is not None]
            return [replace(cur, status=RESOLVED, end_step=min(steps) if steps else cur.step)]
        stalled = max(s for s, _ in hung.values())
        last_steps = [st for _, st in hung.values() if st is not None]
        onset = min(last_steps) if last_steps else -1
        ranks = tuple(sorted(hung))
        everyone = len(ranks) == len(heartbeats)
        who = "all ranks" if everyone and len(ranks) > 1 else f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(
            map(str, ranks[:16])) + (" …" if len(ranks) > 16 else "")
        msg = (f"{who}: no step completed for {stalled:.0f} s (timeout {timeout:.0f} s) after step {onset}"
               + (f"; heartbeat lost from rank(s) {', '.join(map(str, sorted(silent)[:16]))}: process or node down"
                  if silent else "; processes alive: stuck in a collective, the data loader or I/O "
                  "(py-spy dump the ranks)"))
        ev = {"timeout_s": round(timeout, 3), "stalled_s": round(stalled, 3), "silent_ranks": sorted(silent),
              "median_step_s": round(statistics.median(self._step_s), 6) if self._step_s else None}
        if cur is None:
            self._open = Anomaly(kind="hang", severity="critical", step=onset, ranks=ranks, gen=self._gen,
                                 message=msg, evidence=ev, scope="*")
            return [self._open]
        new = replace(cur, ranks=tuple(sorted(set(cur.ranks) | set(ranks))), evidence=ev, message=msg)
        changed = new.ranks != cur.ranks or ev["silent_ranks"] != cur.evidence["silent_ranks"]
        self._open = new
        return [new] if changed else []
