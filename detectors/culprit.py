"""Which rank stopped first: the culprit of a hang or a crash, and the ranks that only stopped after it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from trainhealth.detectors.hang import Beat, silence_limit
from trainhealth.job import Culprit

#: An error a rank raises because *another* rank went away: the collective backends' and the rendezvous store's
#: messages (gloo's "Connection closed by peer", NCCL's watchdog timeouts and aborts, torch's DistBackendError and
#: DistNetworkError, the TCPStore's broken connections). A rank dying of one of these is a victim.
COMM_ERROR = re.compile(
    r"connection (closed|reset) by peer|broken pipe|DistBackendError|DistNetworkError|DistStoreError|"
    r"ProcessGroup(NCCL|Gloo)|NCCL (error|communicator)|ncclRemoteError|ncclSystemError|Watchdog caught collective|"
    r"collective operation timeout|gloo/transport|TCPStore|Socket Timeout|recvBytes|sendBytes|"
    r"Timed out waiting|heartbeat monitor", re.IGNORECASE)


@dataclass(frozen=True)
class LastWord:
    """A rank's ``rank_exit`` event: it saw its own end (an exception, ``sys.exit``, the script's end).

    Attributes: ``t`` (unix s), ``reason`` (``exception`` or ``exit``), ``error`` (``"Type: message"``), ``inc`` (the
    incarnation that sent it).
    """

    t: float
    reason: str
    error: str
    inc: float

    @property
    def victim(self) -> bool:
        """It died of another rank's disappearance (:data:`COMM_ERROR`) or was stopped from outside (a SIGTERM: the
        launcher tearing the group down, a preemption)."""
        return self.reason == "signal" or (bool(self.error) and COMM_ERROR.search(self.error) is not None)


@dataclass(frozen=True)
class Verdict:
    """Who is gone, who is alive, who stopped first.

    Attributes
    ----------
    gone : tuple[int, ...]
        Ranks without a heartbeat for longer than their silence limit.
    alive : tuple[int, ...]
        The other ranks.
    dead : tuple[int, ...]
        The ranks to name as dead: the gone ranks that did not die of another rank's end (no last word, or their
        own error), or, when nothing tells them apart and no rank is alive, the culprit alone.
    victims : tuple[int, ...]
        The other ranks of a stalled or stopped job: alive and waiting, or exited after the culprit.
    culprit : Culprit | None
        The rank that stopped first (None when every rank is alive and none is behind).
    """

    gone: tuple[int, ...] = ()
    alive: tuple[int, ...] = ()
    dead: tuple[int, ...] = ()
    victims: tuple[int, ...] = ()
    culprit: Culprit | None = None


def judge(beats: Iterable[Beat], timeout_s: float, silence_s: float, last_steps: Mapping[int, int] | None = None,
          words: Mapping[int, LastWord] | None = None) -> Verdict:
    """Judge the heartbeats (:func:`~trainhealth.detectors.hang.read_beats`) of a job.

    Rules, in order:

    1. Ranks whose heartbeat stopped (beyond :func:`~trainhealth.detectors.hang.silence_limit`) are gone. Among them,
       the ones with no last word, or whose last word is their own error, come first: a rank killed (SIGKILL, the
       OOM killer), crashed natively, frozen (SIGSTOP) or cut off with its node leaves none, while the ranks blocked
       on it die of a communication error (:data:`COMM_ERROR`) and say so. The culprit is the first of those whose
       heartbeat stopped earliest (then the lowest last step, then the lowest rank). When no rank is alive, a rank
       without a last word whose heartbeat went on for more than ``silence_s`` after the culprit's stopped is a
       victim too: blocked in a collective, it could not run its SIGTERM handler and the launcher's SIGKILL ended it
       (torchrun sends it 30 s after the SIGTERM).
    2. No rank gone, but one behind: every rank alive and stalled, some at a lower last step than the others — in
       a synchronous job the others completed the next step and wait for it in a collective.
    3. Otherwise no culprit: every rank waits in the same step.

    ``last_steps`` maps a rank to its last step seen in its records (the heartbeat's step can be up to one interval
    old); ``words`` maps a rank to the last word of its current incarnation.

    Examples
    --------
    Rank 1 was SIGKILLed; the others died of the closed connection 2 s later and said so:

    >>> from trainhealth.detectors.hang import read_beats
    >>> hb = {r: {"t": 100.0, "step": 190, "step_t": 99.0, "host": "n1", "pid": 10 + r} for r in range(4)}
    >>> hb[1] = {**hb[1], "t": 97.0}
    >>> words = {r: LastWord(101.0, "exception", "RuntimeError: Connection closed by peer", 0.0) for r in (0, 2, 3)}
    >>> v = judge(read_beats(130.0, hb), 30.0, 15.0, {1: 190}, words)
    >>> v.dead, v.victims, v.culprit.rank, v.culprit.step, v.culprit.pid
    ((1,), (0, 2, 3), 1, 190, 11)

    Rank 2 was blocked in the all-reduce and SIGKILLed silently by the launcher 30 s later: still a victim.

    >>> hb[2] = {**hb[2], "t": 127.0}
    >>> del words[2]
    >>> v = judge(read_beats(160.0, hb), 30.0, 15.0, {1: 190}, words)
    >>> v.dead, v.victims, v.culprit.rank
    ((1,), (0, 2, 3), 1)
    >>> v.culprit.why.split(" or ")[-1]
    'went silent up to 30 s after it (killed by the launcher while blocked in a collective)'
    """
    beats = list(beats)
    words = words or {}
    last_steps = last_steps or {}

    def step_of(b: Beat) -> int | None:
        known = [s for s in (b.step, last_steps.get(b.rank)) if s is not None]
        return max(known) if known else None

    gone = [b for b in beats if b.silent_s > silence_limit(b, timeout_s, silence_s)]
    gone_ranks = {b.rank for b in gone}
    alive = [b for b in beats if b.rank not in gone_ranks]
    rank_sort = tuple(sorted(b.rank for b in alive))
    if gone:
        def said(b: Beat) -> LastWord | None:
            w = words.get(b.rank)
            return w if w is not None and (b.inc is None or w.inc == b.inc) else None

        first = [b for b in gone if not (said(b) and said(b).victim)]
        if not first and not alive and all(said(b) and said(b).reason == "signal" for b in gone):
            # Every rank was stopped by a signal: preempted or cancelled, no rank is to blame.
            return Verdict(tuple(sorted(gone_ranks)), (), (), tuple(sorted(gone_ranks)), None)

        def earliest(pool: list[Beat]) -> Beat:
            # Earliest last heartbeat (largest silence), then the lowest last step, then the lowest rank.
            return min(pool, key=lambda b: (-b.silent_s, step_of(b) if step_of(b) is not None else -1, b.rank))

        late: list[Beat] = []
        if first and not alive:
            # A rank blocked inside a collective cannot run its SIGTERM handler: the launcher's SIGKILL ends it
            # silently (torchrun waits 30 s). Its heartbeat thread beat on while the first silent rank was already
            # gone by the silence limit: it outlived the culprit, it did not stop with it.
            t0 = earliest(first).silent_s
            late = [b for b in first if t0 - b.silent_s > silence_s]
            first = [b for b in first if b not in late]
        split = bool(first) and len(first) < len(gone)
        pool = first or gone
        c = earliest(pool)
        w = said(c)
        # In a synchronous job another rank completes a step only with the culprit in its collectives: a step the
        # others completed is one the culprit took part in too (its own records of it are held in its frozen sender,
        # or died with it). Every rank gone: the newest any of them completed; others alive: the one they all did.
        others = [s for s in (step_of(b) for b in beats if b.rank != c.rank) if s is not None]
        theirs = (min(others) if alive else max(others)) if others else None
        c_step = max([s for s in (step_of(c), theirs) if s is not None], default=None)
        if alive:
            why = "its heartbeat stopped while the other ranks' continued"
            dead = sorted(b.rank for b in pool)
        elif split:
            others_said = [said(b) for b in gone if b not in pool and b not in late]
            how = _how_they_ended([x for x in others_said if x is not None],
                                  max((c.silent_s - b.silent_s for b in late), default=None))
            why = (f"no last word (killed, crashed, frozen or lost its node) while the others {how}" if w is None
                   else f"its own error ({w.error}) while the others {how}")
            dead = sorted(b.rank for b in pool)
        else:
            why = "its heartbeat stopped first"
            dead = [c.rank]
        victims = tuple(sorted(b.rank for b in beats if b.rank not in dead))
        culprit = Culprit(c.rank, c.host, c.pid, c_step, why)
        return Verdict(tuple(sorted(gone_ranks)), rank_sort, tuple(dead), victims, culprit)
    steps = {b.rank: step_of(b) for b in alive if step_of(b) is not None}
    if len(steps) >= 2 and len(set(steps.values())) > 1:
        low = min(steps.values())
        behind = sorted(r for r, s in steps.items() if s == low)
        if len(behind) < len(steps):
            b = next(x for x in alive if x.rank == behind[0])
            top = max(steps.values())
            culprit = Culprit(b.rank, b.host, b.pid, low, f"behind: its last step is {low} while the others completed "
                                                             f"step {top} and wait for it")
            return Verdict((), rank_sort, (), tuple(r for r in rank_sort if r not in behind), culprit)
    return Verdict((), rank_sort)


def _how_they_ended(words: list[LastWord], silent_after_s: float | None = None) -> str:
    """How the victims ended, in words: ``exited after it with a communication error``, ``were stopped by the
    launcher (SIGTERM) after it``, both, and/or ``went silent up to N s after it`` (ranks without a last word that
    beat on past the culprit's silence limit: killed by the launcher while blocked in a collective)."""
    parts = []
    if words:
        signals = sum(w.reason == "signal" for w in words)
        if signals == len(words):
            parts.append("were stopped by a SIGTERM (the launcher tearing the group down) after it")
        elif signals == 0:
            parts.append("exited after it with a communication error")
        else:
            parts.append("exited after it with a communication error or were stopped by the launcher's SIGTERM")
    if silent_after_s is not None:
        parts.append(f"went silent up to {silent_after_s:.0f} s after it (killed by the launcher while blocked in "
                     "a collective)")
    return " or ".join(parts)
