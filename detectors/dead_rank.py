"""Dead ranks: a rank whose heartbeat stopped, or that completes no step while the others do."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.hang import Beat, progress_limit, read_beats, silence_limit


class DeadRankDetector:
    """Names the ranks that dropped out of the job.

    Two signs, from the heartbeats the collector's background thread sends every
    ``heartbeat_interval`` seconds (see :class:`~trainhealth.detectors.hang.HangDetector`):

    * **gone**: no heartbeat for ``missed_intervals`` intervals (20 s by default): the process or
      its node is down (OOM kill, segfault, node failure). While the rank's last heartbeat said it
      was saving or loading a checkpoint the allowance is the progress timeout instead, since a
      large save can starve the heartbeat thread.
    * **stuck alone**: its heartbeat is fresh but its last step is older than the progress
      timeout while another rank completed a step within it, **and** its own heartbeat, written at
      least ``evidence_intervals`` heartbeat intervals (10 s by default) after another live rank was
      first seen past its step, still shows the old step. Each rank's heartbeat thread writes every
      ``heartbeat_interval`` seconds at its own offset, so when the first step after a long pause (a
      hang that resumes, an evaluation, a checkpoint) completes, the ranks whose latest heartbeat
      predates it still show the pre-pause step: they are lagging, not stuck. One interval covers
      that lag, a second one a rank finishing the same step a little after the others (pipeline
      stages, an uneven last micro-batch). The time another rank was first seen past it is remembered
      across checks (the heartbeat carries only a rank's latest step).

    The progress timeout is the hang detector's, learned from the step times
    (``max(floor, 20 x median step)``, ``checkpoint_s`` while any rank saves); a rank that has not
    completed a step since it (re)started is never stuck. All dead ranks of one incident form one
    anomaly (critical; onset = the earliest last step among them; its rank set grows); it
    resolves when every one of them is heard from and stepping again, e.g. after a restart.
    ``hang`` is the other case, no progress on any rank: when a rank dies in a synchronous job
    the others block on it, so ``dead_rank`` opens first (after 20 s) naming it, and ``hang``
    follows after the progress timeout.

    Parameters
    ----------
    checkpoint_s : float
        Progress timeout while a rank saves or loads a checkpoint (s).
    heartbeat_interval : float
        The collectors' heartbeat interval (s).
    missed_intervals : int
        Heartbeats missed before a rank counts as gone.
    evidence_intervals : float
        Heartbeat intervals a stuck rank's own heartbeat must postdate the others' progress by.

    Evidence: ``silent_ranks`` (gone) and ``stuck_ranks`` (alive, not stepping),
    ``last_steps`` (aligned with the anomaly's ranks), ``silent_s`` (longest time without a
    heartbeat), ``idle_s`` (longest time without a step), ``behind_s`` (longest time a stuck rank's
    heartbeat postdates the others' progress past its step), ``timeout_s``, ``silence_s``.

    Examples
    --------
    >>> det = DeadRankDetector()
    >>> hb = {r: {"t": 1000.0, "step": 50, "step_t": 999.0, "host": "node-a"} for r in range(4)}
    >>> det.check(1001.0, hb, timeout_s=120.0)
    []
    >>> hb = {**hb, 0: {"t": 1030.0, "step": 51, "step_t": 1029.0}, 1: {"t": 1030.0, "step": 51, "step_t": 1029.0},
    ...       2: {"t": 1030.0, "step": 51, "step_t": 1029.0}}
    >>> [(a.kind, a.ranks, a.step, a.evidence["silent_ranks"]) for a in det.check(1031.0, hb, timeout_s=120.0)]
    [('dead_rank', (3,), 50, [3])]
    >>> hb = {r: {"t": 1200.0, "step": None, "step_t": None} for r in range(4)}  # relaunched, starting up
    >>> [(a.status, a.end_step) for a in det.check(1201.0, hb, timeout_s=120.0)]
    [('resolved', 50)]

    A rank alive but stuck at step 60 while the others go on (progress timeout 120 s): named once its
    own heartbeat, 10 s after the others were seen past step 60, still says 60.

    >>> det = DeadRankDetector()
    >>> hb = {r: {"t": 1299.0, "step": 70, "step_t": 1298.0} for r in range(4)}
    >>> hb[2] = {"t": 1297.0, "step": 60, "step_t": 1150.0}
    >>> det.check(1300.0, hb, timeout_s=120.0)  # 150 s without a step, but no evidence yet
    []
    >>> hb = {**{r: {"t": 1309.0, "step": 79, "step_t": 1308.0} for r in range(4)}, 2: {"t": 1308.0, "step": 60,
    ...                                                                                   "step_t": 1150.0}}
    >>> [(a.ranks, a.step, a.evidence["stuck_ranks"], a.evidence["behind_s"]) for a in det.check(1310.0, hb, 120.0)]
    [((2,), 60, [2], 10.0)]

    References
    ----------
    NVIDIA Resiliency Extension fault tolerance (per-rank heartbeats; a rank missing its
    heartbeat timeout is reported and the job restarted); torchelastic's agent (a worker
    failure tears down and restarts the whole group).
    """

    def __init__(
        self,
        checkpoint_s: float = defaults.HANG_CHECKPOINT_S,
        heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL_S,
        missed_intervals: int = defaults.HEARTBEAT_MISSED_INTERVALS,
        evidence_intervals: float = defaults.DEAD_RANK_EVIDENCE_INTERVALS,
    ) -> None:
        self.checkpoint_s = checkpoint_s
        self.heartbeat_interval = heartbeat_interval
        self.missed_intervals = missed_intervals
        self.evidence_intervals = evidence_intervals
        self._open: Anomaly | None = None
        # rank -> (its last step, unix time another live rank was first seen past it)
        self._passed: dict[int, tuple[int, float]] = {}

    def check(self, now: float, heartbeats: Mapping[int, Mapping[str, Any]], timeout_s: float,
              gen: int = 0) -> list[Anomaly]:
        """Judge the heartbeats at ``now`` (unix s) with progress timeout ``timeout_s`` (s).

        ``heartbeats`` maps rank to the decoded JSON of ``th:{run}:hb``; ``gen`` is the current
        restart generation. Returns the anomaly states that changed.
        """
        beats = read_beats(now, heartbeats)
        silence = self.missed_intervals * self.heartbeat_interval
        limit = progress_limit(beats, timeout_s, self.checkpoint_s, silence)
        gone = {b.rank: b for b in beats if b.silent_s > silence_limit(b, timeout_s, silence)}
        alive = [b for b in beats if b.rank not in gone]
        behind = self._behind(now, alive)
        stepping = any(b.step is not None and b.idle_s <= limit for b in alive)
        margin = self.evidence_intervals * self.heartbeat_interval
        stuck = {b.rank: b for b in alive
                 if b.idle_s > limit and behind.get(b.rank, -1.0) >= margin} if stepping else {}
        dead = {**gone, **stuck}
        cur = self._open
        if not dead:
            if cur is None:
                return []
            self._open = None
            steps = [b.step for b in beats if b.rank in cur.ranks and b.step is not None]
            return [replace(cur, status=RESOLVED, end_step=min(steps) if steps else cur.step)]
        ranks = tuple(sorted(set(cur.ranks if cur else ()) | set(dead)))
        by_rank = {b.rank: b for b in beats}
        last = [by_rank[r].step if r in by_rank else None for r in ranks]
        ev = {"silent_ranks": sorted(gone), "stuck_ranks": sorted(stuck), "last_steps": last,
              "silent_s": round(max((b.silent_s for b in gone.values()), default=0.0), 3),
              "idle_s": round(max(b.idle_s for b in dead.values()), 3),
              "behind_s": round(max((behind[r] for r in stuck), default=0.0), 3),
              "timeout_s": round(limit, 3), "silence_s": silence}
        steps = [b.step for b in dead.values() if b.step is not None]
        onset = min(steps) if steps else -1
        msg = self._message(gone, stuck, limit, len(beats))
        if cur is None:
            self._open = Anomaly(kind="dead_rank", severity="critical", step=onset, ranks=ranks, gen=gen,
                                 message=msg, evidence=ev, scope="*")
            return [self._open]
        new = replace(cur, ranks=ranks, evidence=ev, message=msg)
        self._open = new
        old = cur.evidence
        changed = (new.ranks != cur.ranks or ev["silent_ranks"] != old["silent_ranks"]
                   or ev["stuck_ranks"] != old["stuck_ranks"])
        return [new] if changed else []

    def _behind(self, now: float, alive: list[Beat]) -> dict[int, float]:
        """Seconds each live rank's latest heartbeat postdates the time another live rank was first
        seen past its step (negative: written before that), for the ranks some other rank is past."""
        done = [(b.step, now - b.idle_s) for b in alive if b.step is not None]
        if not done:
            self._passed.clear()
            return {}
        top = max(s for s, _ in done)
        passed: dict[int, tuple[int, float]] = {}
        out: dict[int, float] = {}
        for b in alive:
            if b.step is None or b.step >= top:
                continue
            first = min(t for s, t in done if s > b.step)
            prev = self._passed.get(b.rank)
            if prev is not None and prev[0] == b.step:
                first = min(first, prev[1])
            passed[b.rank] = (b.step, first)
            out[b.rank] = (now - b.silent_s) - first
        self._passed = passed
        return out

    @staticmethod
    def _message(gone: dict, stuck: dict, limit: float, n: int) -> str:
        def names(bs: dict) -> str:
            rs = sorted(bs)
            hosts = sorted({b.host for b in bs.values() if b.host})
            s = f"rank{'s' if len(rs) > 1 else ''} " + ", ".join(map(str, rs[:16])) + (" …" if len(rs) > 16 else "")
            return s + (f" ({', '.join(hosts[:8])})" if hosts else "")

        parts = []
        if gone:
            worst = max(b.silent_s for b in gone.values())
            last = min((b.step for b in gone.values() if b.step is not None), default=None)
            every = " (every rank)" if len(gone) == n > 1 else ""
            parts.append(f"{names(gone)}{every}: no heartbeat for {worst:.0f} s"
                         + (f", last step {last}" if last is not None else "")
                         + ": process or node down; the other ranks block at the next collective")
        if stuck:
            worst = max(b.idle_s for b in stuck.values())
            parts.append(f"{names(stuck)}: alive but no step completed for {worst:.0f} s (timeout {limit:.0f} s) "
                         "while the other ranks progress: stuck in I/O or the data loader (py-spy dump it)")
        return "; ".join(parts)
