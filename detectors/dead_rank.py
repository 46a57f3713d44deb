"""Dead ranks: a rank whose heartbeat stopped, or that completes no step while the others do."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.culprit import Verdict, judge
from trainhealth.detectors.hang import Beat, progress_limit, read_beats
from trainhealth.job import Culprit


class DeadRankDetector:
    """Names the ranks that dropped out of the job.

    Two signs, from the heartbeats the collector's background thread sends every
    ``heartbeat_interval`` seconds (see :class:`~trainhealth.detectors.hang.HangDetector`):

    * **gone**: no heartbeat for ``missed_intervals`` intervals (15 s by default): the process stopped (SIGSTOP, a
      debugger), was killed (OOM killer, segfault) or lost its node; the words say so, since from outside these look
      the same. While the rank's last heartbeat said it was saving or loading a checkpoint the allowance is the
      progress timeout instead, since a large save can starve the heartbeat thread. Of the gone ranks only the ones
      that stopped first are named dead (:func:`~trainhealth.detectors.culprit.judge`): when every rank of a job
      stops, the ranks that died of the culprit's end (their last word a communication error) are its ``victims``.
    * **stuck alone**: its heartbeat is fresh but its last step is older than the progress
      timeout while another rank completed a step within it and is at least two steps past it, **and** its own
      heartbeat, written at least ``evidence_intervals`` heartbeat intervals (10 s by default) after another live
      rank was first seen two steps past it, still shows the old step. Each rank's heartbeat thread writes every
      ``heartbeat_interval`` seconds at its own offset, so when the first step after a long pause (a
      hang that resumes, an evaluation, a checkpoint) completes, the ranks whose latest heartbeat
      predates it still show the pre-pause step: they are lagging, not stuck; and a rank frozen between its
      all-reduce and its ``log_step`` leaves the others one step ahead, blocked on it. The time another rank was
      first seen past it is remembered across checks (the heartbeat carries only a rank's latest step).

    The progress timeout is the hang detector's (:class:`~trainhealth.detectors.progress.ProgressTimeout`,
    ``checkpoint_s`` while any rank saves); a rank that has not completed a step since it (re)started is never
    stuck. All dead ranks of one incident form one anomaly (critical; onset = the culprit's last completed step;
    its rank set grows; its silence and idle time are rewritten while it lasts, at most every ``update_s``); it
    resolves, keeping the culprit, when every one of them is heard from again, e.g. after SIGCONT or a relaunch.
    ``hang`` is the other case, no progress on any rank: when a rank dies in a synchronous job
    the others block on it, so ``dead_rank`` opens first (within 20 s) naming it, and ``hang``
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
    update_s : float
        Seconds between rewrites of an open anomaly's growing silence.

    Evidence: ``silent_ranks`` (gone) and ``stuck_ranks`` (alive, not stepping),
    ``last_steps`` (aligned with the anomaly's ranks), ``silent_s`` (longest time without a
    heartbeat), ``idle_s`` (longest time without a step), ``behind_s`` (longest time a stuck rank's
    heartbeat postdates the others' progress past its step), ``timeout_s``, ``silence_s``, ``culprit``
    (:class:`~trainhealth.job.Culprit` as a dict), ``victims`` (ranks that wait for it or stopped after it),
    ``alive_ranks``, ``job_state``; ``resumed`` once resolved.

    Examples
    --------
    >>> det = DeadRankDetector()
    >>> hb = {r: {"t": 1000.0, "step": 50, "step_t": 999.0, "host": "node-a"} for r in range(4)}
    >>> det.check(1001.0, hb, timeout_s=120.0)
    []
    >>> # The others completed step 51, in a synchronous job with rank 3 in its collectives: its last step is 51.
    >>> hb = {**hb, 0: {"t": 1030.0, "step": 51, "step_t": 1029.0}, 1: {"t": 1030.0, "step": 51, "step_t": 1029.0},
    ...       2: {"t": 1030.0, "step": 51, "step_t": 1029.0}}
    >>> [(a.kind, a.ranks, a.step, a.evidence["silent_ranks"]) for a in det.check(1031.0, hb, timeout_s=120.0)]
    [('dead_rank', (3,), 51, [3])]
    >>> print(det.open.message)  # doctest: +NORMALIZE_WHITESPACE
    no heartbeat from rank 3 (host node-a) since step 51 (31 s): the process stopped, froze or lost its node;
    ranks 0, 1, 2 alive and waiting for it

    >>> hb = {r: {"t": 1200.0, "step": None, "step_t": None} for r in range(4)}  # relaunched, starting up
    >>> [(a.status, a.end_step) for a in det.check(1201.0, hb, timeout_s=120.0)]
    [('resolved', 51)]

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
        update_s: float = defaults.STALL_UPDATE_S,
    ) -> None:
        self.checkpoint_s = checkpoint_s
        self.heartbeat_interval = heartbeat_interval
        self.missed_intervals = missed_intervals
        self.evidence_intervals = evidence_intervals
        self.update_s = update_s
        self._open: Anomaly | None = None
        self._emitted = 0.0  # the longest silence or idle time of the open anomaly's last emitted state
        # rank -> (its last step, unix time another live rank was first seen two steps past it)
        self._passed: dict[int, tuple[int, float]] = {}

    @property
    def open(self) -> Anomaly | None:
        """The open anomaly, if any."""
        return self._open

    def check(self, now: float, heartbeats: Mapping[int, Mapping[str, Any]], timeout_s: float,
              gen: int = 0, verdict: Verdict | None = None, *, job_state: str = "running",
              current_step: int | None = None) -> list[Anomaly]:
        """Judge the heartbeats at ``now`` (unix s) with progress timeout ``timeout_s`` (s).

        ``heartbeats`` maps rank to the decoded JSON of ``th:{run}:hb``; ``gen`` is the current
        restart generation; ``verdict`` who is gone and who stopped first (:func:`~trainhealth.detectors.culprit.judge`;
        judged from the heartbeats alone when None); ``job_state`` the job's state (``crashed`` words the message so);
        ``current_step`` the run's last completed step (the onset when no dead rank's step is known). Returns the
        anomaly states that changed.
        """
        beats = read_beats(now, heartbeats)
        silence = self.missed_intervals * self.heartbeat_interval
        limit = progress_limit(beats, timeout_s, self.checkpoint_s, silence)
        if verdict is None:
            verdict = judge(beats, timeout_s, silence)
        by_rank = {b.rank: b for b in beats}
        gone = {r: by_rank[r] for r in verdict.dead if r in by_rank}
        alive_ranks = set(verdict.alive)
        alive = [b for b in beats if b.rank in alive_ranks]
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
            end = min(steps) if steps else cur.step
            return [replace(cur, status=RESOLVED, end_step=end, evidence={**cur.evidence, "resumed": True},
                            message=cur.message + f"; heard from again (step {end})")]
        culprit = verdict.culprit if verdict.culprit is not None and verdict.culprit.rank in dead else None
        if culprit is None and stuck:
            b = min(stuck.values(), key=lambda x: (x.step if x.step is not None else -1, x.rank))
            culprit = Culprit(b.rank, b.host, b.pid, b.step, "alive but no step completed while the other ranks "
                                                             "progress")
        if culprit is None and cur is not None:
            culprit = Culprit.from_dict(cur.evidence.get("culprit"))
        # A rank named while its last word or its late heartbeat was still on the way (a starved heartbeat thread,
        # a rank the launcher killed after the culprit) leaves the list once the verdict shows it stopped after it.
        after = set(verdict.victims) & set(verdict.gone)
        ranks = tuple(sorted((set(cur.ranks if cur else ()) - after) | set(dead)))
        last = [by_rank[r].step if r in by_rank else None for r in ranks]
        victims = [r for r in verdict.victims if r not in dead]
        ev = {"silent_ranks": sorted(gone), "stuck_ranks": sorted(stuck), "last_steps": last,
              "silent_s": round(max((b.silent_s for b in gone.values()), default=0.0), 3),
              "idle_s": round(max(b.idle_s for b in dead.values()), 3),
              "behind_s": round(max((behind[r] for r in stuck), default=0.0), 3),
              "timeout_s": round(limit, 3), "silence_s": silence,
              "culprit": culprit.to_dict() if culprit else None, "victims": victims,
              "alive_ranks": list(verdict.alive), "job_state": job_state}
        steps = [b.step for b in dead.values() if b.step is not None]
        onset = (culprit.step if culprit is not None and culprit.step is not None else
                 min(steps) if steps else current_step if current_step is not None else 0)
        if cur is not None:
            onset = cur.step  # the onset of an open anomaly does not move
        msg = self._message(gone, stuck, limit, culprit, victims, verdict.alive, job_state)
        if cur is None:
            self._open = Anomaly(kind="dead_rank", severity="critical", step=onset, ranks=ranks, gen=gen,
                                 message=msg, evidence=ev, scope="*")
            self._emitted = max(ev["silent_s"], ev["idle_s"])
            return [self._open]
        new = replace(cur, ranks=ranks, evidence=ev, message=msg)
        self._open = new
        old = cur.evidence
        # A crashed job's silence grows without news: the job state says crashed; no rewrite every 10 s.
        grown = job_state != "crashed" and max(ev["silent_s"], ev["idle_s"]) - self._emitted >= self.update_s
        changed = (new.ranks != cur.ranks or ev["silent_ranks"] != old["silent_ranks"]
                   or ev["stuck_ranks"] != old["stuck_ranks"] or ev["culprit"] != old.get("culprit")
                   or ev["job_state"] != old.get("job_state") or ev["victims"] != old.get("victims") or grown)
        if changed:
            self._emitted = max(ev["silent_s"], ev["idle_s"])
        return [new] if changed else []

    def _behind(self, now: float, alive: list[Beat]) -> dict[int, float]:
        """Seconds each live rank's latest heartbeat postdates the time another live rank was first seen two steps
        past its step (negative: written before that), for the ranks some other rank is two steps past.

        Two steps: in a synchronous job a rank frozen between its all-reduce and its ``log_step`` leaves the others
        one step ahead, blocked in the next collective; only a rank that others got well past is stuck alone."""
        done = [(b.step, now - b.idle_s) for b in alive if b.step is not None]
        if not done:
            self._passed.clear()
            return {}
        # The earliest time of any rank at or past each step, from the top down: one sort, then a bisect per rank
        # (a scan of every rank per rank cost ~0.1 s a check at 1,024 ranks, a second at 4,096).
        done.sort()
        steps = [s for s, _ in done]
        earliest = [t for _, t in done]
        for i in range(len(earliest) - 2, -1, -1):
            earliest[i] = min(earliest[i], earliest[i + 1])
        top = steps[-1]
        passed: dict[int, tuple[int, float]] = {}
        out: dict[int, float] = {}
        for b in alive:
            if b.step is None or b.step + 2 > top:
                continue
            first = earliest[bisect.bisect_left(steps, b.step + 2)]
            prev = self._passed.get(b.rank)
            if prev is not None and prev[0] == b.step:
                first = min(first, prev[1])
            passed[b.rank] = (b.step, first)
            out[b.rank] = (now - b.silent_s) - first
        self._passed = passed
        return out

    @staticmethod
    def _message(gone: dict, stuck: dict, limit: float, culprit: Culprit | None, victims: list[int],
                 alive: tuple[int, ...], job_state: str) -> str:
        def names(bs: dict) -> str:
            rs = sorted(bs)
            hosts = sorted({b.host for b in bs.values() if b.host})
            s = f"rank{'s' if len(rs) > 1 else ''} " + _ranks(rs)
            return s + (f" (host{'s' if len(hosts) > 1 else ''} {', '.join(hosts[:8])})" if hosts else "")

        parts = []
        if gone:
            worst = max(b.silent_s for b in gone.values())
            step = culprit.step if culprit is not None and culprit.rank in gone else None
            if step is None:
                step = min((b.step for b in gone.values() if b.step is not None), default=None)
            since = f" since step {step}" if step is not None else " since before its first step"
            text = (f"no heartbeat from {names(gone)}{since} ({worst:.0f} s): the process stopped, froze or lost its "
                    "node")
            others = [r for r in victims if r not in gone]
            if others and set(others) <= set(alive):
                text += f"; rank{'s' if len(others) > 1 else ''} {_ranks(others)} alive and waiting for it"
            elif others:
                text += f"; rank{'s' if len(others) > 1 else ''} {_ranks(others)} stopped after it"
            parts.append(text)
        if stuck:
            worst = max(b.idle_s for b in stuck.values())
            parts.append(f"{names(stuck)}: alive but no step completed for {worst:.0f} s (timeout {limit:.0f} s) "
                         "while the other ranks progress: stuck in I/O or the data loader (py-spy dump it)")
        text = "; ".join(parts)
        if job_state == "crashed" and culprit is not None:
            text = f"job crashed at step {culprit.step}, rank {culprit.rank} first: " + text
        return text


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs[:16])) + (" …" if len(rs) > 16 else "")
