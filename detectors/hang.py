"""Hangs: no rank of the job completes a step, from the collectors' heartbeats."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.progress import ProgressTimeout
from trainhealth.job import Culprit


@dataclass(frozen=True)
class Beat:
    """One rank's latest heartbeat, judged at a time ``now``.

    Attributes
    ----------
    rank : int
        Global rank.
    step : int | None
        Last step it completed (None before its first step).
    idle_s : float
        Seconds since it completed that step; since its heartbeat when it has no step yet (a
        rank still starting up is not stalled).
    silent_s : float
        Seconds since its last heartbeat.
    phase : str
        ``train``, ``checkpoint_save``, ``checkpoint_load`` or ``badput`` (the phases
        ``trainhealth.Monitor`` sends: ``checkpoint_save()`` / ``checkpoint_load()`` and ``timed_badput()``,
        which the Lightning integration uses for validation).
    host : str | None
        Host name, as the collector reported it.
    pid : int | None
        Process id, as the collector reported it (``py-spy dump --pid`` on ``host``).
    inc : float | None
        The rank's incarnation (its Monitor's start, unix s).
    """

    rank: int
    step: int | None
    idle_s: float
    silent_s: float
    phase: str
    host: str | None
    pid: int | None = None
    inc: float | None = None

    @property
    def checkpointing(self) -> bool:
        """Saving or loading a checkpoint."""
        return self.phase.startswith("checkpoint")

    @property
    def declared(self) -> bool:
        """In a declared non-training phase: a checkpoint save or load, or badput (evaluation, profiling...).

        Any phase but ``train`` counts, so an integration naming its phase (``evaluation``) is covered too.
        """
        return self.phase != "train"


def read_beats(now: float, heartbeats: Mapping[int, Mapping[str, Any]]) -> list[Beat]:
    """Judge decoded ``th:{run}:hb`` heartbeats at unix time ``now`` (s); replayed logs are left out.

    >>> [(b.rank, b.idle_s, b.silent_s) for b in read_beats(100.0, {0: {"t": 95.0, "step": 3, "step_t": 60.0},
    ...                                                            1: {"t": 99.0, "phase": "replay"}})]
    [(0, 40.0, 5.0)]
    """
    out = []
    for rank, hb in heartbeats.items():
        if hb.get("phase") == "replay":
            continue  # a log being replayed has its own (past) timeline
        t = float(hb.get("t") or 0.0)
        step_t = hb.get("step_t")
        since = float(step_t) if step_t is not None else t
        pid, inc = hb.get("pid"), hb.get("inc")
        out.append(Beat(rank, hb.get("step"), now - since, now - t, str(hb.get("phase") or "train"), hb.get("host"),
                        pid if isinstance(pid, int) else None,
                        float(inc) if isinstance(inc, (int, float)) and not isinstance(inc, bool) else None))
    return out


def progress_limit(beats: Iterable[Beat], timeout_s: float, checkpoint_s: float, silence_s: float) -> float:
    """Seconds without a completed step that count as stalled: ``checkpoint_s`` while any rank still
    heard from is in a declared phase (:attr:`Beat.declared`: a checkpoint save or load, an evaluation
    or other ``timed_badput``; the others wait for it in the next collective, and a rank-0-only save or
    evaluation blocks every rank), else ``timeout_s``."""
    declared = any(b.declared and b.silent_s <= silence_limit(b, timeout_s, silence_s) for b in beats)
    return checkpoint_s if declared else timeout_s


def silence_limit(b: Beat, timeout_s: float, silence_s: float) -> float:
    """Seconds without a heartbeat after which rank ``b`` is gone: ``silence_s``, or, while it saves or loads a
    checkpoint, the longest of that, the progress timeout and ``defaults.CHECKPOINT_HEARTBEAT_ALLOWANCE_S``
    (pickling a large state can hold the GIL the collector's heartbeat thread needs). Not extended for badput
    phases: an evaluation does not starve the heartbeat thread, and a process dying during one should be named
    within ``silence_s``."""
    if b.checkpointing:
        return max(silence_s, timeout_s, defaults.CHECKPOINT_HEARTBEAT_ALLOWANCE_S)
    return silence_s


class HangDetector:
    """Flags the job when no rank completed a step for too long.

    Heartbeats are sent by the collector's background thread every ``heartbeat_interval``
    seconds and carry the rank's last completed step and when it completed, so a training
    thread stuck in a collective, the data loader or I/O shows as a fresh heartbeat with a stale
    step time. The job hangs when **every** rank's last step is older than the progress timeout
    (:class:`~trainhealth.detectors.progress.ProgressTimeout`: ``max(floor_s, step_multiple x`` the longest healthy
    interval between step completions seen so far``)``, ``initial_s`` before the first few) while **at least one**
    rank is still heard from. When every rank's heartbeat is gone the job is down, not hung: an open hang then
    resolves (``evidence["ended"] = "heartbeats lost"``) and the job state turns to crashed
    (:mod:`trainhealth.detectors.job_state`). Ranks still starting up (no step yet in their incarnation) neither count
    as progress nor prevent a hang, and before any rank completed a step nothing is judged.

    Declared phases: while any rank's heartbeat says it is in a declared non-training phase —
    ``phase=checkpoint_save`` / ``checkpoint_load``, or ``badput`` (``Monitor.timed_badput``:
    evaluation, profiling; the Lightning integration's validation) — the timeout is ``checkpoint_s``
    for every rank: the others wait for it in the next collective. The progress clock also restarts at the last
    heartbeat seen in a declared phase: the stall is measured from the later of the last completed step and the
    end of the phase.

    One anomaly (critical) per stall, onset at the earliest last-completed step, naming the culprit given by the
    caller (:func:`~trainhealth.detectors.culprit.judge`: the rank whose heartbeat stopped first, or the one behind);
    its duration and evidence are rewritten while it lasts (at most every ``update_s``); it resolves when a rank
    completes a step again (or enters a declared phase), keeping the culprit, with ``stalled_s`` the time from the
    last completion before the stall to the first one after it.

    Parameters
    ----------
    floor_s : float
        Minimum progress timeout (s).
    step_multiple : float
        Timeout as a multiple of the longest healthy interval between step completions.
    checkpoint_s : float
        Timeout while a rank is in a declared phase: saving or loading a checkpoint, or badput such as
        an evaluation (s).
    heartbeat_interval : float
        The collectors' heartbeat interval (s).
    missed_intervals : int
        Heartbeats missed before a rank counts as gone (reported in ``silent_ranks``).
    initial_s : float
        Timeout until a few healthy intervals were seen (s).
    update_s : float
        Seconds between rewrites of an open hang's growing duration.

    Evidence: ``timeout_s`` (the timeout applied), ``stalled_s`` (seconds judged: since any rank last completed
    a step or was last heard in a declared phase), ``idle_s`` (since any rank last completed a step),
    ``since_t`` (unix s of that completion), ``since_step`` (the newest step completed then),
    ``silent_ranks`` (ranks with a stale heartbeat), ``waiting_ranks``
    (ranks alive and waiting), ``culprit`` (:class:`~trainhealth.job.Culprit` as a dict, or None),
    ``median_step_s``; when resolved, ``resumed_t`` or ``ended``.

    Examples
    --------
    >>> det = HangDetector(floor_s=60, initial_s=60)
    >>> hb = {0: {"t": 1025.0, "step": 41, "step_t": 1000.0, "phase": "train"},
    ...       1: {"t": 1025.0, "step": 41, "step_t": 1000.0, "phase": "train"}}
    >>> det.check(1030.0, hb)
    []
    >>> hb[0] = {"t": 1095.0, "step": 42, "step_t": 1045.0, "phase": "train"}
    >>> hb[1] = {"t": 1095.0, "step": 41, "step_t": 1000.0, "phase": "train"}
    >>> det.check(1100.0, hb)  # rank 0 progressed 55 s ago: no hang
    []
    >>> [(a.kind, a.ranks, a.step, a.evidence["stalled_s"]) for a in det.check(1106.0, hb)]
    [('hang', (0, 1), 41, 61.0)]
    >>> hb[1] = {"t": 1110.0, "step": 42, "step_t": 1110.0, "phase": "train"}
    >>> [(a.status, a.end_step, a.evidence["stalled_s"]) for a in det.check(1111.0, hb)]
    [('resolved', 42, 65.0)]

    A 10-minute evaluation (``timed_badput``) is no hang, and the clock restarts when it ends:

    >>> hb = {r: {"t": 1700.0, "step": 42, "step_t": 1110.0, "phase": "badput"} for r in (0, 1)}
    >>> det.check(1705.0, hb)
    []
    >>> hb = {r: {"t": 1750.0, "step": 42, "step_t": 1110.0, "phase": "train"} for r in (0, 1)}
    >>> det.check(1755.0, hb)  # no step for 645 s, 55 s since the evaluation's last heartbeat
    []
    >>> [(a.kind, a.step, a.evidence["stalled_s"], a.evidence["idle_s"]) for a in det.check(1761.0, hb)]
    [('hang', 42, 61.0, 651.0)]

    References
    ----------
    NVIDIA Resiliency Extension fault tolerance (heartbeat and section timeouts, longer ones
    for checkpointing, timeouts computed from observed intervals x a safety factor); PyTorch ``init_process_group``
    ``timeout`` (a stuck collective is only noticed by the job after 10-30 min).
    """

    def __init__(
        self,
        floor_s: float = defaults.HANG_FLOOR_S,
        step_multiple: float = defaults.HANG_STEP_MULTIPLE,
        checkpoint_s: float = defaults.HANG_CHECKPOINT_S,
        heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL_S,
        missed_intervals: int = defaults.HEARTBEAT_MISSED_INTERVALS,
        initial_s: float = defaults.HANG_INITIAL_S,
        update_s: float = defaults.STALL_UPDATE_S,
    ) -> None:
        self.floor_s = floor_s
        self.step_multiple = step_multiple
        self.checkpoint_s = checkpoint_s
        self.heartbeat_interval = heartbeat_interval
        self.missed_intervals = missed_intervals
        self.initial_s = initial_s
        self.update_s = update_s
        #: The progress timeout, shared with the dead-rank detector and the goodput ledger (fed by the pipeline).
        self.progress = ProgressTimeout(floor_s, step_multiple, initial_s)
        self._step_s: deque[float] = deque(maxlen=200)
        self._open: Anomaly | None = None
        self._emitted = 0.0  # stalled_s of the open hang's last emitted state
        self._first_after: tuple[int, float] | None = None  # (step, unix s) of the first step to end after the stall
        self._gen = 0
        self._phase_t: float | None = None  # newest heartbeat time (unix s) seen in a declared phase

    def observe_step(self, seconds: float | None, gen: int = 0, step: int | None = None,
                     t_end: float | None = None) -> None:
        """Record a completed step's own time (s), for :attr:`median_step_s` (the advisors' step cost); ``step`` and
        ``t_end`` (unix s), when given, date the end of an open hang to the step that ended it (the heartbeats that
        show it come up to one interval later, the records that close it within a second)."""
        self._gen = gen
        if seconds is not None and seconds >= 0:
            self._step_s.append(seconds)
        cur = self._open
        if (cur is not None and step is not None and t_end is not None and self._first_after is None
                and step > cur.evidence["since_step"] and t_end > cur.evidence["since_t"]):
            self._first_after = (step, t_end)

    @property
    def timeout_s(self) -> float:
        """Current progress timeout (s), outside declared phases."""
        return self.progress.timeout_s

    @property
    def median_step_s(self) -> float | None:
        """Median of the last 200 step times (s), None before any."""
        return statistics.median(self._step_s) if self._step_s else None

    @property
    def open(self) -> Anomaly | None:
        """The open hang, if any."""
        return self._open

    def check(self, now: float, heartbeats: Mapping[int, Mapping[str, Any]],
              culprit: Culprit | None = None) -> list[Anomaly]:
        """Judge the heartbeats at time ``now`` (unix s); return anomaly states that changed.

        ``heartbeats`` maps rank to the decoded JSON of ``th:{run}:hb``; ``culprit`` is the rank that stopped first,
        when the caller knows (:func:`~trainhealth.detectors.culprit.judge`).
        """
        beats = read_beats(now, heartbeats)
        silence = self.missed_intervals * self.heartbeat_interval
        timeout = self.timeout_s
        limit = progress_limit(beats, timeout, self.checkpoint_s, silence)
        for b in beats:
            if b.declared and (self._phase_t is None or now - b.silent_s > self._phase_t):
                self._phase_t = now - b.silent_s
        since_phase = now - self._phase_t if self._phase_t is not None else float("inf")
        cur = self._open
        stepped = [b for b in beats if b.step is not None]  # ranks still starting up cannot tell
        if stepped and since_phase < min(b.idle_s for b in stepped) and limit == timeout:
            # Waiting for the first step after a declared phase: a step of its own kind (workers re-spawned).
            limit = self.progress.after_pause_timeout_s
        alive = [b for b in beats if b.silent_s <= silence_limit(b, timeout, silence)]
        progressing = not stepped or any(min(b.idle_s, since_phase) <= limit for b in stepped)
        if progressing or not alive:
            if cur is None:
                return []
            self._open = None
            return [self._resolved(cur, now, beats, progressing)]
        idle = min(b.idle_s for b in stepped)
        stalled = min(idle, since_phase)
        # The last step every live rank completed (a frozen rank's heartbeat, and records, lag behind its part).
        live_steps = [b.step for b in stepped if b.silent_s <= silence_limit(b, timeout, silence)]
        onset = min(live_steps or [b.step for b in stepped])
        ranks = tuple(sorted(b.rank for b in beats))
        silent = sorted(b.rank for b in beats if b.rank not in {a.rank for a in alive})
        if cur is not None and cur.evidence.get("culprit"):
            # The first rank to stop stays the culprit while the hang lasts: later ranks going silent, or a rank
            # whose heartbeat lags the first steps after the resume, are not its cause.
            culprit = Culprit.from_dict(cur.evidence["culprit"])
        waiting = sorted(b.rank for b in alive if culprit is None or b.rank != culprit.rank)
        who = "all ranks" if len(ranks) > 1 else f"rank {ranks[0]}"
        after = f" ({stalled:.0f} s since the last checkpoint/badput phase)" if stalled < idle else ""
        if culprit is not None:
            cause = (f"; {culprit.name()} stopped first at step {culprit.step} ({culprit.why}); "
                     + (f"rank{'s' if len(waiting) > 1 else ''} {_ranks(waiting)} alive and waiting for it"
                        if waiting else "no other rank is heard from"))
        else:
            cause = ("; every rank is alive and waits in the same step: stuck in a collective, the data loader or I/O "
                     "(py-spy dump the ranks)")
        msg = f"{who}: no step completed for {idle:.0f} s{after} (timeout {limit:.0f} s) after step {onset}{cause}"
        med = self.median_step_s
        ev = {"timeout_s": round(limit, 3), "stalled_s": round(stalled, 3), "idle_s": round(idle, 3),
              "since_t": round(now - idle, 3), "since_step": max(b.step for b in stepped),
              "silent_ranks": silent, "waiting_ranks": waiting,
              "culprit": culprit.to_dict() if culprit else None,
              "median_step_s": round(med, 6) if med is not None else None}
        if cur is None:
            self._open = Anomaly(kind="hang", severity="critical", step=onset, ranks=ranks, gen=self._gen,
                                 message=msg, evidence=ev, scope="*")
            self._emitted = stalled
            self._first_after = None
            return [self._open]
        new = replace(cur, ranks=tuple(sorted(set(cur.ranks) | set(ranks))), evidence=ev, message=msg)
        old = cur.evidence
        changed = (new.ranks != cur.ranks or ev["silent_ranks"] != old["silent_ranks"]
                   or ev["culprit"] != old.get("culprit") or stalled - self._emitted >= self.update_s)
        self._open = new
        if changed:
            self._emitted = stalled
        return [new] if changed else []

    def _resolved(self, cur: Anomaly, now: float, beats: list[Beat], progressing: bool) -> Anomaly:
        """The open hang, over: ``stalled_s`` from the last completion before it to the first one after it (or to the
        last heartbeat heard, when every rank went silent)."""
        since = cur.evidence["since_t"]
        steps = [b.step for b in beats if b.step is not None]
        # Completions after the last one before the stall (a rank whose heartbeat predates it still shows the old one).
        later = [b for b in beats if b.step is not None and now - b.idle_s > since + 1e-6]
        first, self._first_after = self._first_after, None
        end = first[0] if first else min(b.step for b in later) if later else max(steps, default=cur.step)
        ev = dict(cur.evidence)
        if progressing and (later or first):
            resumed = first[1] if first else min(now - b.idle_s for b in later)
            ev.update(stalled_s=round(max(resumed - since, 0.0), 3), resumed_t=round(resumed, 3))
            tail = f"; resumed at step {end} after {resumed - since:.0f} s"
        elif progressing:  # a declared phase began (a checkpoint save, an evaluation)
            ev.update(stalled_s=round(max(now - since, 0.0), 3), ended="declared phase")
            tail = f"; a checkpoint or badput phase began after {now - since:.0f} s"
        else:
            heard = max((now - b.silent_s for b in beats), default=now)
            ev.update(stalled_s=round(max(heard - since, 0.0), 3), ended="heartbeats lost")
            tail = f"; every rank's heartbeat then stopped ({heard - since:.0f} s after the last step): the job is down"
        base = cur.message.split("; resumed at step")[0]
        return replace(cur, status=RESOLVED, end_step=end, evidence=ev, message=base + tail)


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs[:16])) + (" …" if len(rs) > 16 else "")
