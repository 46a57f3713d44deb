"""The job's state — running, hung, crashed, restarted, finished — from the hang and dead-rank verdicts."""

from __future__ import annotations

from trainhealth import defaults
from trainhealth.anomaly import Anomaly
from trainhealth.detectors.culprit import Verdict
from trainhealth.job import Culprit, JobState


class JobStateTracker:
    """Turns each heartbeat check into the job's state (:class:`~trainhealth.job.JobState`).

    * ``finished`` when every rank ended cleanly;
    * ``crashed`` when no rank is heard from any more (every heartbeat older than the silence limit) and none came
      back within ``grace_s`` after that: a launcher that relaunches (torchrun ``--max-restarts``, an elastic agent)
      does so in seconds, and its new processes' heartbeats replace the old ones. ``since`` is the newest heartbeat
      heard, where the goodput ledger stops; a relaunch after it is booked as recovery;
    * ``hung`` while a hang is open (some rank heard from, no step completed for longer than the timeout);
    * ``restarted`` for ``hold_s`` after the first step of a new generation, naming the rank that stopped first
      before it when that is known;
    * ``running`` otherwise.

    Parameters
    ----------
    grace_s : float
        Seconds after the last heartbeat's silence limit before a job nobody hears from is crashed.
    hold_s : float
        Seconds a restart stays the state.

    Examples
    --------
    >>> from trainhealth.detectors.culprit import Verdict
    >>> from trainhealth.job import Culprit
    >>> js = JobStateTracker(grace_s=30)
    >>> js.update(100.0, Verdict(alive=(0, 1)), newest_hb_t=99.0, silence_s=15.0).state
    'running'
    >>> c = Culprit(1, "n1", 7, 190, "its heartbeat stopped first")
    >>> down = Verdict(gone=(0, 1), dead=(1,), victims=(0,), culprit=c)
    >>> js.update(130.0, down, newest_hb_t=99.0, silence_s=15.0) is None  # 31 s of silence: within the grace
    True
    >>> s = js.update(145.0, down, newest_hb_t=99.0, silence_s=15.0)
    >>> s.state, s.since, s.step
    ('crashed', 99.0, 190)
    >>> print(s.message)
    crashed at step 190, rank 1 first (host n1, pid 7): its heartbeat stopped first; no relaunch within 30 s
    """

    def __init__(self, grace_s: float = defaults.CRASH_GRACE_S, hold_s: float = defaults.RESTARTED_HOLD_S) -> None:
        self.grace_s = grace_s
        self.hold_s = hold_s
        self._state: JobState | None = None
        #: The culprit of the last hang or crash, kept for the restart that follows it.
        self.last_culprit: Culprit | None = None
        #: The rank that stopped first before the newest restart (named in the ``restarted`` state).
        self.restart_culprit: Culprit | None = None

    @property
    def state(self) -> JobState | None:
        """The latest state (None before the first check)."""
        return self._state

    def finish(self, t: float, step: int | None, gen: int = 0) -> JobState | None:
        """Every rank ended cleanly at unix time ``t`` (s): the state ``finished`` (None when it already was)."""
        if self._state is not None and self._state.state == "finished":
            return None
        self._state = JobState("finished", t, step, None, f"every rank ended cleanly at step {step}", gen)
        return self._state

    def update(self, now: float, verdict: Verdict, *, newest_hb_t: float, silence_s: float,
               hang: Anomaly | None = None, finished: bool = False, gen: int = 0, current_step: int | None = None,
               restart: tuple[float, int] | None = None) -> JobState | None:
        """Judge the job at unix time ``now``; return the new state when it changed (None otherwise).

        ``verdict`` is the heartbeat check's (:func:`~trainhealth.detectors.culprit.judge`); ``newest_hb_t`` the newest
        heartbeat time (unix s); ``hang`` the open hang; ``restart`` ``(unix s, resume step)`` of the newest restart.
        """
        if finished:
            new = JobState("finished", now, current_step, None, f"every rank ended cleanly at step {current_step}",
                           gen)
        elif not verdict.alive and verdict.gone and now - newest_hb_t > silence_s + self.grace_s:
            c = verdict.culprit
            self.last_culprit = c or self.last_culprit
            step = c.step if c is not None and c.step is not None else current_step
            where = c.name().partition(" (")[2] if c is not None else ""
            who = (f", rank {c.rank} first" + (f" ({where}" if where else "") + f": {c.why}") if c is not None else (
                "; every rank was stopped by a signal (preempted or cancelled)" if verdict.victims and not verdict.dead
                else "")
            new = JobState("crashed", newest_hb_t, step, c,
                           f"crashed at step {step}{who}; no relaunch within {self.grace_s:.0f} s", gen)
        elif hang is not None:
            c = Culprit.from_dict(hang.evidence.get("culprit"))
            self.last_culprit = c or self.last_culprit
            new = JobState("hung", float(hang.evidence.get("since_t", now)), hang.step, c, hang.message, gen)
        elif restart is not None and now - restart[0] < self.hold_s:
            c = self.restart_culprit
            who = f" after {c.name()} stopped at step {c.step}" if c is not None else ""
            new = JobState("restarted", restart[0], restart[1], c, f"restarted at step {restart[1]}{who}", gen)
        else:
            new = JobState("running", now, current_step, None, "", gen)
        old = self._state
        if old is not None and (old.state, old.culprit, old.gen) == (new.state, new.culprit, new.gen) and (
                old.step == new.step or new.state == "running"):  # a running job's step moves every second
            return None
        self._state = new
        return new
