"""The goodput ledger: where every second of the run's wall time went.

Throughput counts all tokens processed; goodput counts only tokens of steps that survive in
the final lineage (a step recomputed after a restart or a rollback counts once, its
discarded attempt is badput). Category names follow Google's ``ml-goodput-measurement``
(``BadputType``) where one exists. Definitions: ``docs/goodput.md``.
"""

from __future__ import annotations

import bisect
import copy
import math
from collections import deque
from typing import Any

from trainhealth import defaults
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.progress import ProgressTimeout
from trainhealth.detectors.progress_rate import loss_progress
from trainhealth.goodput import (
    CATEGORIES,
    NOT_BADPUT,
    STEP_CATEGORIES,
    WINDOWS_S,
    LedgerSnapshot,
    Progress,
    RecordsDropped,
)
from trainhealth.wire import DROP_CAUSES, Event

# The categories and windows (CATEGORIES, STEP_CATEGORIES, NOT_BADPUT, WINDOWS_S, imported above and used here under
# these names) and the snapshot's type are the ground floor's, trainhealth/goodput.py: its readers share them.

#: Steps after a launch's first step whose mean step time tells its warm-up excess.
WARMUP_STEPS = 9
#: Steps of lineage kept in memory (a rollback further back than this is not re-attributed).
LINEAGE_STEPS = 200_000
#: Step increments whose most frequent is the run's usual one.
INCREMENT_WINDOW = 200


class _Increments:
    """The step increments between consecutive steps of a generation, over the last ``size`` intervals, and the
    usual one: the most frequent (the smallest of a tie), in O(distinct values). A run's increments take one or two
    values (1 for a collector recording every step, a log's cadence); not their median, which an excerpt of
    pasted blocks takes from its jumps (the 104B excerpt: 3 increments of 1 among 7, the median 749)."""

    def __init__(self, size: int = INCREMENT_WINDOW) -> None:
        self._size = size
        self._window: deque[int] = deque()
        self._counts: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._window)

    def add(self, k: int) -> None:
        self._window.append(k)
        self._counts[k] = self._counts.get(k, 0) + 1
        if len(self._window) > self._size:
            old = self._window.popleft()
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]

    def usual(self) -> int | None:
        """The most frequent increment (steps; the smallest of a tie), None before any."""
        if not self._counts:
            return None
        return min(self._counts, key=lambda k: (-self._counts[k], k))


class GoodputLedger:
    """Incremental goodput/badput accounting over a run's steps and events.

    Feed steps in completion order with :meth:`add_step` and events with :meth:`add_event`;
    :meth:`snapshot` returns the totals at any time. Each step accounts exactly for the
    interval from the previous step's end to its own end, so the categories always sum to
    the wall time (run start to ``now``). Time before a step whose number jumped far past the usual
    increment (records lost, a log's pasted blocks) is ``unobserved``, neither productive nor badput;
    tokens count with the step time they were processed in, so goodput never exceeds throughput
    (``docs/goodput.md``).

    Parameters
    ----------
    world_size : int
        Ranks (GPUs), for GPU-hours.
    gpu_hour_usd : float | None
        Price of one GPU-hour, for costs.
    hang_floor_s, hang_step_multiple : float
        The progress timeout's floor and multiple (:class:`~trainhealth.detectors.progress.ProgressTimeout`), when
        the ledger keeps its own.
    progress : ProgressTimeout | None
        The progress timeout to share with the hang detector (the pipeline passes the hang detector's); the ledger
        feeds it every step. An interval between two step completions longer than it, with nothing declared, is
        ``hang`` — also when the step that contained the stall completes, so time frozen in a hang stays hang:
        the interval minus the usual step (the median healthy interval, at most the step's own time). A shorter
        undeclared gap is ``idle``.

    Examples
    --------
    A run starts at t=0, does steps of 1 s (0.25 s of it data wait) from t=5, saves a 2 s
    checkpoint after step 3, crashes after step 5, restarts at t=20, loads the checkpoint
    (1 s) and redoes steps 4-5:

    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> from trainhealth.wire import DROP_CAUSES, Event
    >>> led = GoodputLedger(world_size=8)
    >>> led.note_start(0.0)
    >>> def step(s, gen, inc, end):
    ...     return StepAggregate(s, gen, inc, end - 1.0, end, 2.0, 1.0, None, 1000, None, 8, (), 0.25)
    >>> for s, end in [(1, 6.0), (2, 7.0), (3, 8.0)]:
    ...     led.add_step(step(s, 0, 0.0, end))
    >>> led.add_event(Event("checkpoint_save", 0, 10.0, 0.0, step=3, seconds=2.0))
    >>> for s, end in [(4, 11.0), (5, 12.0)]:
    ...     led.add_step(step(s, 0, 0.0, end))
    >>> led.add_event(Event("checkpoint_load", 0, 24.0, 20.0, step=3, seconds=1.0))
    >>> for s, end in [(4, 26.0), (5, 27.0)]:
    ...     led.add_step(step(s, 1, 20.0, end))
    >>> snap = led.snapshot(now=30.0)
    >>> {k: v for k, v in snap["seconds"].items() if v}  # doctest: +NORMALIZE_WHITESPACE
    {'productive': 3.75, 'program_startup': 9.0, 'data_loading': 1.25, 'checkpoint_save': 2.0,
     'checkpoint_restore': 1.0, 'wasted_progress_from_disruption': 2.0,
     'infrastructure_recovery_from_disruption': 8.0, 'idle': 3.0}
    >>> snap["rates"]["60s"]["throughput_tok_s"], snap["rates"]["60s"]["goodput_tok_s"]
    (1000.0, 166.66666666666666)
    >>> sum(snap["seconds"].values()), snap["tokens_total"], snap["tokens_good"], snap["goodput_pct"]
    (30.0, 7000, 5000, 12.5)
    """

    def __init__(self, world_size: int = 1, gpu_hour_usd: float | None = None,
                 hang_floor_s: float = defaults.HANG_FLOOR_S,
                 hang_step_multiple: float = defaults.HANG_STEP_MULTIPLE,
                 progress: ProgressTimeout | None = None) -> None:
        self.world_size = world_size
        self.gpu_hour_usd = gpu_hour_usd
        self.hang_floor_s = hang_floor_s
        self.hang_step_multiple = hang_step_multiple
        self.progress = progress if progress is not None else ProgressTimeout(hang_floor_s, hang_step_multiple)
        self._durs: deque[float] = deque(maxlen=200)
        self._first: tuple[dict[str, float], float, list[float]] | None = None
        self._ckpts: list[int] = []
        # Rolling windows: one entry per step attempt [t_end, tokens, good tokens, dur, step, alive, loss (None when
        # not finite), kept tokens of the run up to it].
        self._recent: deque[list[Any]] = deque()
        self._start: float | None = None
        self._last_end: float | None = None
        self._last_t = 0.0
        self._gen = 0
        self._sec = dict.fromkeys(CATEGORIES, 0.0)
        # Surviving lineage, ascending by step: (step, good tokens, {category: seconds}, whether its loss is finite).
        self._lineage: deque[tuple[int, int, dict[str, float], bool]] = deque(maxlen=LINEAGE_STEPS)
        # The whole run's learning progress (progress_rate.loss_progress): the lineage's steps with a finite loss, the
        # first and the newest PROGRESS_POINTS of them as (step, t_end, loss, kept tokens of the run up to it).
        self._loss_n = 0
        self._loss_head: list[tuple[int, float, float, int]] = []
        self._loss_tail: deque[tuple[int, float, float, int]] = deque(maxlen=defaults.PROGRESS_POINTS)
        self._tokens_total = 0
        self._tokens_good = 0
        self._tokens_unobserved = 0  # tokens reported for time not booked as step time
        # Step increments (the usual one tells a jump), the newest step seen (gen, step), steps held until the
        # usual increment is known, whether any step arrived; stretches of steps not covered (count, steps, largest).
        self._incs = _Increments()
        self._prev_seen: tuple[int, int] | None = None
        self._held: list[tuple[StepAggregate, int | None]] = []
        self._received = False
        self._gaps = self._gap_steps = 0
        self._gap_largest: tuple[int, int] | None = None
        self._steps_done = 0
        self._restarts = 0
        # Declared badput not yet placed in a gap: (kind, step, name) -> (seconds, unix s it ended).
        self._pending: dict[tuple[str, Any, str], tuple[float, float]] = {}
        self._custom_by_name: dict[str, float] = {}
        self._applied: deque[tuple[str, Any, str]] = deque(maxlen=4096)
        # Records the collectors reported lost, by cause and by rank; rank records the steps were built from.
        self._drops: dict[str, int] = {}
        self._drops_by_rank: dict[int, int] = {}
        self._collector_drops: dict[int, int] = {}  # of those, reported by the rank's collector itself
        self._rank_steps = 0
        self._partial_steps = 0
        #: Set by :meth:`note_lost_history`: the run's history before its first step seen is gone.
        self.history_lost: dict[str, Any] | None = None
        self._first_startup = 0.0  # seconds booked as start-up before the first step seen
        #: Seconds the newest restart took from the last step before it to the first step's start (s; None before
        #: any): the measured cost of a relaunch, for the recovery advice.
        self.restart_s: float | None = None

    # -- input -------------------------------------------------------------------------------
    def note_start(self, t: float) -> None:
        """The run (or its first process) started at unix time ``t``; the earliest value wins."""
        if not self._received and (self._start is None or t < self._start):
            self._start = t

    def add_event(self, ev: Event) -> None:
        """Account a ``checkpoint_save``/``checkpoint_load``/``badput`` event (others are ignored).

        Every rank reports the same checkpoint: per (kind, step, name) the longest report counts.
        """
        if ev.kind == "run_start":
            self.note_start(ev.t)
            return
        if ev.kind == "collector_drops":
            self._note_drops(ev)
            return
        if ev.kind not in ("checkpoint_save", "checkpoint_load", "badput") or ev.seconds is None:
            return
        if ev.kind == "checkpoint_save" and ev.step is not None and (not self._ckpts or ev.step > self._ckpts[-1]):
            self._ckpts.append(ev.step)
        key = (ev.kind, ev.step, ev.extra.get("name", ""))
        if key in self._applied:
            return
        secs = max(0.0, ev.seconds)
        old_s, old_t = self._pending.get(key, (0.0, ev.t))
        self._pending[key] = (max(old_s, secs), max(old_t, ev.t))
        self._last_t = max(self._last_t, ev.t)

    def note_lost_history(self, step: int, t: float, ranks: list[int], cause: str = "redis") -> None:
        """The records before ``step`` (of ``ranks``, first seen at unix time ``t``) are gone: Redis lost them
        (restarted without its data) or trimmed them (``cause`` ``"redis"``), or the collectors dropped them and
        said so (``"collector"``). The ledger then starts at the first step seen — the time before it is not
        booked as start-up, which it was not — and its snapshots say so (``history_lost``)."""
        if self.history_lost is not None:
            return
        self.history_lost = {"before_step": step, "first_seen_t": t, "ranks": sorted(ranks), "cause": cause}
        if self._last_end is not None and self._first_startup > 0 and self._start is not None:
            self._sec["program_startup"] -= self._first_startup
            self._start += self._first_startup
            self._first_startup = 0.0

    def drops_of(self, rank: int) -> int:
        """Records the collector of ``rank`` reported dropped so far (its ``collector_drops`` events; not the
        records the service found trimmed)."""
        return self._collector_drops.get(rank, 0)

    def _note_drops(self, ev: Event) -> None:
        """A collector's ``collector_drops`` event: records it lost, in total and by cause (events of collectors
        before the causes were reported count as ``unknown``)."""
        try:
            total = int(ev.extra.get("count", "0"))
        except ValueError:
            return
        causes = {}
        for cause in DROP_CAUSES:
            try:
                causes[cause] = max(0, int(ev.extra.get(cause, "0")))
            except ValueError:
                causes[cause] = 0
        causes["unknown"] = max(0, total - sum(causes.values()))
        for cause, n in causes.items():
            self._drops[cause] = self._drops.get(cause, 0) + n
        self._drops_by_rank[ev.rank] = self._drops_by_rank.get(ev.rank, 0) + max(total, 0)
        if ev.extra.get("by") != "service":
            self._collector_drops[ev.rank] = self._collector_drops.get(ev.rank, 0) + max(total, 0)

    def _take(self, kind: str, limit: float, before: float) -> float:
        """Consume the pending seconds of ``kind`` that ended before ``before`` (unix s), at most
        ``limit`` in total (custom badput kept by name too).

        A step closes only once its slowest rank reported, so events of later gaps may already be
        pending: each belongs to the gap before the first step that ends after it.
        """
        took = self._split(kind, limit, before)
        for key in [k for k, (_, t) in self._pending.items() if k[0] == kind and t < before]:
            self._pending.pop(key)
            self._applied.append(key)
        if kind == "badput":
            for name, v in took.items():
                self._custom_by_name[name] = self._custom_by_name.get(name, 0.0) + v
        return sum(took.values())

    def _split(self, kind: str, limit: float, before: float = math.inf) -> dict[str, float]:
        """Pending seconds of ``kind`` ended before ``before``, by name, oldest first, capped at ``limit``."""
        left = max(0.0, limit)
        out: dict[str, float] = {}
        for key, (v, t) in self._pending.items():
            if key[0] != kind or t >= before:
                continue
            part = min(v, left)
            left -= part
            out[key[2] or kind] = out.get(key[2] or kind, 0.0) + part
        return out

    def add_step(self, agg: StepAggregate) -> None:
        """Account one completed step (steps in completion order).

        A step more than ``defaults.LEDGER_GAP_FACTOR`` x the run's usual step increment (the most frequent of the
        last 200 between consecutive steps of a generation) past the previous step of its generation skipped steps
        the records do not cover: the time before its own is ``unobserved`` (see :meth:`_book`). The usual
        increment needs a few increments to be known: until ``defaults.LEDGER_MIN_INCREMENTS`` are, steps after the
        run's first are held (at most ``defaults.LEDGER_HOLD_STEPS``) and booked in order once they are; a
        :meth:`snapshot` meanwhile books them on a copy. The progress timeout the ledger feeds (shared with the hang
        detector) sees them then too: the first few steps of a run, while its timeout is the initial one anyway.
        """
        self._received = True
        self._last_t = max(self._last_t, agg.t_end)
        inc = None
        prev = self._prev_seen
        if prev is not None and prev[0] == agg.gen and agg.step > prev[1]:
            inc = agg.step - prev[1]
            self._incs.add(inc)
        if prev is None or prev[0] != agg.gen or agg.step > prev[1]:
            self._prev_seen = (agg.gen, agg.step)
        if self._held or (inc is not None and len(self._incs) < defaults.LEDGER_MIN_INCREMENTS):
            self._held.append((agg, inc))
            if len(self._incs) >= defaults.LEDGER_MIN_INCREMENTS or len(self._held) >= defaults.LEDGER_HOLD_STEPS:
                self._release()
            return
        # A jump needs an increment over GAP_FACTOR x the usual one, which is at least 1: most steps skip the count.
        usual = self._incs.usual() if inc is not None and inc > defaults.LEDGER_GAP_FACTOR else None
        self._book(agg, inc, usual)

    def _release(self) -> None:
        """Book the held steps, judged against the usual increment known now."""
        usual = self._incs.usual()
        held, self._held = self._held, []
        for agg, inc in held:
            self._book(agg, inc, usual)

    def _own_s(self, agg: StepAggregate, usual: int, span: float) -> float:
        """Seconds of an untimed step that follows a jump, at most ``span``: its usual increment of steps at the
        job's own seconds per step (``step_s``), else the median of the recent steps' booked times, else 0 (not
        known: the whole interval is unobserved)."""
        per = agg.step_s
        if per is not None and math.isfinite(per) and per > 0:
            own = usual * per
        elif self._durs:
            own = sorted(self._durs)[len(self._durs) // 2]
        else:
            own = 0.0
        return max(0.0, min(own, span))

    def _book(self, agg: StepAggregate, inc: int | None, usual: int | None) -> None:
        """Book one step: the interval from the previous step's end to its own end.

        ``inc`` is its step increment over the previous step of its generation (None for the first of one), and
        ``usual`` the run's usual increment (None when not needed: ``inc`` is no jump). After a jump (``inc`` over
        ``defaults.LEDGER_GAP_FACTOR`` x ``usual``) the step's own time is its timed time, or (untimed)
        :meth:`_own_s`; declared checkpoint and custom seconds before it are booked as such, the rest of the
        interval is ``unobserved`` — the steps ran, as the step numbers say, but no record says how (the hang and
        idle rules, which judge time the records cover, do not apply) — and the share of an untimed step's tokens
        for that time (its count covers the steps since the previous record) is ``tokens_unobserved``.
        """
        if self._start is None:
            self._start = min(agg.inc, agg.t_start if agg.t_start is not None else agg.t_end)
        last = self._last_end if self._last_end is not None else self._start
        end = max(agg.t_end, last)
        jump = (inc is not None and usual is not None and inc > defaults.LEDGER_GAP_FACTOR * usual
                and self._last_end is not None and agg.gen == self._gen)
        if agg.t_start is not None:
            start = min(max(agg.t_start, last), end)
        elif self._last_end is None or agg.gen != self._gen:
            # An untimed (log-only) first step of a launch: its compute time is unknown, so it
            # counts from its end (the wait before it is start-up or recovery, not progress).
            start = end
        elif jump:
            start = end - self._own_s(agg, usual or 1, end - last)  # usual is set: a jump
        else:
            # An untimed step: declared badput since the last step came first, then the step.
            start = min(last + sum(v for v, t in self._pending.values() if t < agg.t_end), end)
        gap = start - last
        sec = self._sec
        unobserved = 0.0
        if self._last_end is None:
            if self.history_lost is not None:  # the time before this step is not known: not booked at all
                self._start, gap = start, 0.0
            restore = self._take("checkpoint_load", gap, end)
            sec["checkpoint_restore"] += restore
            sec["program_startup"] += gap - restore
            self._first_startup = gap - restore
        elif agg.gen != self._gen:
            self._restarts += 1
            self.restart_s = start - last  # recovery, start-up and restore: what the next relaunch will cost
            self._discard(agg.step, same_process=agg.inc <= last)
            launched = min(max(agg.inc, last), start)  # new processes started here (inc = process start)
            sec["infrastructure_recovery_from_disruption"] += launched - last
            rest = start - launched
            restore = self._take("checkpoint_load", rest, end)
            sec["checkpoint_restore"] += restore
            # New processes spend the rest starting up; an in-process rollback just waited.
            sec["program_startup" if agg.inc > last else "idle"] += rest - restore
            self._take("checkpoint_save", 0.0, end)  # saves of the discarded timeline are not in this gap
            self._take("badput", 0.0, end)
        else:
            save = self._take("checkpoint_save", gap, end)
            custom = self._take("badput", gap - save, end)
            restore = self._take("checkpoint_load", gap - save - custom, end)
            sec["checkpoint_save"] += save
            sec["custom"] += custom
            sec["checkpoint_restore"] += restore
            rest = gap - save - custom - restore
            if jump:
                unobserved = rest
                sec["unobserved"] += rest
                self._note_gap(agg.step - (inc or 0), agg.step, (inc or 0) - (usual or 0))
            elif agg.pause is None and rest + (end - start) > self.progress.timeout_s:
                # A stall longer than the progress timeout: hang, in the gap and in the step that held it (a rank
                # frozen mid-step, the others blocked in its collective); the step keeps its usual length.
                usual_s = min(self.progress.median_s or 0.0, end - start)
                hang = rest + (end - start) - usual_s
                sec["hang"] += hang
                start = min(start + max(hang - rest, 0.0), end)
            else:
                sec["idle"] += rest
        new_launch = self._last_end is None or agg.gen != self._gen
        self._gen = agg.gen
        dur = end - start
        parts = self._split_step(agg, dur)
        for cat, v in parts.items():
            sec[cat] += v
        if agg.pause is not None:
            self._book_pause(agg.pause, parts, dur)
        # Tokens go with the step time they were processed in: none for a step booked without any (an untimed
        # launch's first step, whose time is start-up), and an untimed step's count after a jump (the steps
        # since the previous record) only for its own share of the interval.
        tokens = agg.tokens or 0
        if dur <= 0:
            counted = 0
        elif unobserved > 0 and agg.t_start is None:
            counted = round(tokens * dur / (dur + unobserved))
        else:
            counted = tokens
        self._tokens_unobserved += tokens - counted
        good = 0 if parts.get("skipped_steps") else counted
        self._rank_steps += agg.n_ranks
        if agg.n_ranks < self.world_size:
            self._partial_steps += 1  # closed with the ranks it had: the others' records were lost
        loss = agg.loss if agg.loss is not None and math.isfinite(agg.loss) else None
        self._lineage.append((agg.step, good, parts, loss is not None))
        self._tokens_total += counted
        self._tokens_good += good
        if loss is not None:
            point = (agg.step, end, loss, self._tokens_good)
            self._loss_n += 1
            if len(self._loss_head) < defaults.PROGRESS_POINTS:
                self._loss_head.append(point)
            self._loss_tail.append(point)
        self._steps_done += 1
        self._last_end = end
        self._last_t = max(self._last_t, end)
        if dur > 0 and agg.pause is None:  # a pause step is not a usual step time
            self._durs.append(dur)
        self.progress.step(agg.gen, end, agg.pause is not None, dur)
        self._recent.append([end, counted, good, dur, agg.step, True, loss, self._tokens_good])
        while self._recent and self._recent[0][0] < end - WINDOWS_S[-1]:
            self._recent.popleft()
        self._warmup(parts, dur, new_launch)

    def _note_gap(self, before: int, step: int, missing: int) -> None:
        """A stretch of steps the records do not cover: from step ``before`` to ``step``, ``missing`` steps."""
        self._gaps += 1
        self._gap_steps += max(missing, 0)
        if self._gap_largest is None or step - before > self._gap_largest[1] - self._gap_largest[0]:
            self._gap_largest = (before, step)

    def _warmup(self, parts: dict[str, float], dur: float, new_launch: bool) -> None:
        """The first step of a launch is slow (compilation, allocator and autotuning warm-up): once
        ``WARMUP_STEPS`` more steps show the launch's usual step time, its excess over their mean is
        start-up, not progress — as Google's goodput library counts it (``PROGRAM_STARTUP``)."""
        if new_launch:
            self._first = (parts, dur, [])
            return
        if self._first is None:
            return
        first_parts, first_dur, later = self._first
        if dur <= 0:
            return  # a step booked without time (its tokens neither) says nothing of the launch's usual step
        later.append(dur)
        if len(later) < WARMUP_STEPS:
            return
        self._first = None
        excess = min(first_dur - sum(later) / len(later), first_parts.get("productive", 0.0))
        if excess > 0 and any(p is first_parts for _, _, p, _ in reversed(self._lineage)):
            first_parts["productive"] -= excess
            self._sec["productive"] -= excess
            self._sec["program_startup"] += excess

    def _book_pause(self, pause: str, parts: dict[str, float], dur: float) -> None:
        """A step a declared pause fell in (:attr:`StepAggregate.pause`): its time above the median of the
        recent steps is the pause's (``checkpoint_save``, ``checkpoint_restore``, or ``custom`` under the
        badput's name), not progress. A log that times the step whole (TF's ``sec/step`` of the step after
        "The checkpoint has been created.") measured the save only there; a pause whose seconds were declared
        was booked in the gap before the step already, and the step itself is then about as long as usual."""
        if not self._durs:
            return
        extra = min(dur - sorted(self._durs)[len(self._durs) // 2], parts.get("productive", 0.0))
        if extra <= 0:
            return
        parts["productive"] -= extra
        sec = self._sec
        sec["productive"] -= extra
        if pause in ("checkpoint_save", "checkpoint_load"):
            sec["checkpoint_save" if pause == "checkpoint_save" else "checkpoint_restore"] += extra
        else:
            sec["custom"] += extra
            self._custom_by_name[pause] = self._custom_by_name.get(pause, 0.0) + extra

    def _split_step(self, agg: StepAggregate, dur: float) -> dict[str, float]:
        """A step's seconds by category: data wait, straggler wait, communication, then productive or skipped.

        Communication, when the ranks time their collective (a section named in
        :data:`~trainhealth.defaults.COMM_SECTIONS`): the slowest rank's seconds in it — it arrives last and waits
        for nobody, so its time in the collective is the collective's own (the others' hold their wait for it,
        booked as straggler wait): the time the step spent moving gradients rather than computing (exposed, not
        overlapped, communication).

        Straggler wait, per synchronous step: the slowest rank's section seconds minus the **median of the other
        ranks'** (``agg.busy``; at most the step's time besides its data wait). Every rank waits at the collective
        for the slowest; what the slowest adds to the step is what a typical rank waits for it. The reference
        leaves the slowest rank out: the median of all ranks, used before, is the slowest rank itself in a 2-rank
        job (its "median" of two was taken as the upper one), which booked 0 s for any 2-rank straggler; the other
        rank is the reference there. Not the fastest rank: with many ranks it is an extreme, and the slowest minus
        the fastest grows with the ranks' ordinary jitter (the expected range of N samples grows like
        sqrt(2 ln N) standard deviations), so a 1,024-rank job would book its noise as waiting. Not the next
        slowest: the 8 equally slow ranks of a slow node would book nothing. The best rank stays the reference
        where a rank is *named* slow (:class:`~trainhealth.detectors.straggler.StragglerDetector`, NVIDIA
        Resiliency Extension's relative performance score); the cost of an incident is priced against the typical
        rank as here (:func:`trainhealth.detectors.incidents.badput`).

        >>> led = GoodputLedger(world_size=2)
        >>> a = StepAggregate(1, 0, 0.0, 0.0, 2.0, 2.0, 1.0, None, 10, None, 2, (0.5, 1.5), 0.0)
        >>> led._split_step(a, 2.0)
        {'data_loading': 0.0, 'straggler_wait': 1.0, 'productive': 1.0}

        References
        ----------
        NVIDIA Resiliency Extension, straggler detection usage guide (relative performance score: the best rank as
        reference, for naming a slow rank). Order statistics: the expected range of N normal samples (Tippett, 1925).
        """
        data = min(max(agg.data_s, 0.0), dur)
        busy = sorted(agg.busy) if None not in agg.busy else sorted(b for b in agg.busy if b is not None)
        wait = 0.0
        if len(busy) >= 2:
            # Synchronous step: everyone waits at the collective for the slowest rank's sections.
            others = len(busy) - 1
            mid = others // 2
            typical = busy[mid] if others % 2 else (busy[mid - 1] + busy[mid]) / 2
            wait = min(max(busy[-1] - typical, 0.0), dur - data)
        comm = min(max(_collective_s(agg), 0.0), dur - data - wait)
        rest = dur - data - wait - comm
        skipped = agg.skipped or bool(agg.bad_ranks)
        out = {"data_loading": data, "straggler_wait": wait}
        if comm > 0:
            out["communication"] = comm
        out["skipped_steps" if skipped else "productive"] = rest
        return out

    def _gap_kind(self, seconds: float) -> str:
        return "hang" if seconds > self.progress.timeout_s else "idle"

    def _discard(self, resume: int, same_process: bool) -> None:
        """Training resumed at step ``resume``: the later attempts leave the lineage.

        Steps after the newest checkpoint saved before the failure were lost to it
        (``wasted_progress_from_disruption``); steps before that checkpoint were discarded by
        choosing an older one, as a rollback does (``wasted_progress_from_rollback``); an
        in-process rewind (same processes) is a rollback entirely.
        """
        sec = self._sec
        newest = max((c for c in self._ckpts if c < (self._lineage[-1][0] if self._lineage else 0)), default=None)
        while self._lineage and self._lineage[-1][0] >= resume:
            step, good, parts, lossy = self._lineage.pop()
            self._tokens_good -= good
            self._loss_n -= lossy
            for cat, v in parts.items():
                sec[cat] -= v
            lost = not same_process and (newest is None or step > newest)
            sec["wasted_progress_from_disruption" if lost else "wasted_progress_from_rollback"] += sum(parts.values())
        self._loss_head = [p for p in self._loss_head if p[0] < resume]
        while self._loss_tail and self._loss_tail[-1][0] >= resume:
            self._loss_tail.pop()
        for entry in reversed(self._recent):
            if entry[4] < resume and entry[5]:
                break
            if entry[4] >= resume:
                entry[5] = False

    def _rates(self, now: float, wall: float) -> dict[str, dict[str, float]]:
        """Throughput (tokens per step-second) and goodput (kept tokens per wall second) over the last ``w`` s.

        A step attempt counts with the share of its step time inside the window (its tokens and its seconds alike:
        a 106 s step of which 60 s are in the last minute counts 60/106 of its tokens), so a window's goodput is at
        most its throughput: the step times counted lie in the window, disjoint, so they are at most its wall time.
        """
        n = len(WINDOWS_S)
        los = [now - w for w in WINDOWS_S]  # ascending windows: descending lower bounds
        sums: list[tuple[float, float, float]] = []  # (tokens, step seconds, kept tokens) per window
        tok = busy = good = 0.0  # of the attempts wholly inside the smallest window not closed yet
        i, lo = 0, los[0]
        for t_end, tokens, good_tokens, d, _, alive, *_ in reversed(self._recent):
            if t_end - d >= lo and t_end > lo:  # wholly inside this window, and so inside the larger ones
                if d > 0:
                    tok, busy, good = tok + tokens, busy + d, good + (good_tokens if alive else 0)
                continue
            kept = good_tokens if alive else 0
            while i < n:
                if t_end <= lo:  # ended before the window: it is complete
                    sums.append((tok, busy, good))
                elif d <= 0:  # booked without step time: no tokens counted either
                    break
                elif t_end - d >= lo:
                    tok, busy, good = tok + tokens, busy + d, good + kept
                    break
                else:  # straddles the window's start: its share inside; the larger windows look again
                    f = (t_end - lo) / d
                    sums.append((tok + tokens * f, busy + d * f, good + kept * f))
                i += 1
                lo = los[i] if i < n else math.inf
            if i == n:
                break
        sums += [(tok, busy, good)] * (n - len(sums))
        # Learning progress: the kept steps with a finite loss that ended in each window (oldest first).
        kept = [(e[0], e[6], e[7]) for e in self._recent if e[5] and e[6] is not None and e[0] > now - WINDOWS_S[-1]]
        out = {}
        for w, (tok_w, busy_w, good_w) in zip(WINDOWS_S, sums, strict=True):
            span = min(w, wall)
            prog = loss_progress(kept[bisect.bisect_right(kept, now - w, key=lambda p: p[0]):], self.world_size)
            out[f"{w}s"] = {"throughput_tok_s": tok_w / busy_w if busy_w > 0 else 0.0,
                            "goodput_tok_s": good_w / span if span > 0 else 0.0,
                            "loss_drop_per_gpu_hour": prog["loss_drop_per_gpu_hour"] if prog else None,
                            "loss_drop_per_btok": prog["loss_drop_per_btok"] if prog else None}
        return out

    def _progress(self) -> Progress | None:
        """Learning progress over the whole run's kept steps (:func:`~.progress_rate.loss_progress`): the first and the
        newest ``PROGRESS_POINTS`` of its steps with a finite loss. After a rollback the newest are the ones kept since
        (fewer until that many steps were redone: the blocks are as long as both ends hold)."""
        head, tail = self._loss_head, self._loss_tail
        if not head or not tail:
            return None
        joined = head + [p for p in tail if p[0] > head[-1][0]]
        points = [(t, x, c) for _, t, x, c in joined]
        most = min(defaults.PROGRESS_POINTS, len(head), len(tail))
        return loss_progress(points, self.world_size, most=most, n=max(self._loss_n, len(points)))

    # -- output -----------------------------------------------------------------------------------
    @property
    def last_activity(self) -> float | None:
        """Unix time of the newest step end or event seen."""
        return max(self._last_t, self._last_end or 0.0) or None

    def snapshot(self, now: float) -> LedgerSnapshot:
        """Totals at unix time ``now`` (use :attr:`last_activity` for an ended run).

        Returns a JSON-ready dict: ``wall_s``; ``seconds``, ``gpu_hours`` and ``cost_usd`` per
        category (:data:`CATEGORIES`, summing to ``wall_s``); ``observed_s`` = wall_s minus ``unobserved``;
        ``tokens_total``/``tokens_good``: the tokens of the step time booked (``tokens_unobserved``: the tokens
        reported for time that is not, see :meth:`_book`); ``throughput_tok_s`` = tokens_total / step_s, the speed
        while stepping as frameworks report it (``step_s`` = time inside step attempts, :data:`STEP_CATEGORIES`);
        ``goodput_tok_s`` = tokens_good / wall_s, progress kept per wall-clock second; ``goodput_pct`` = 100 ·
        productive / wall_s (unobserved time is not known to be productive); ``rates`` per window
        (:meth:`_rates`); ``unobserved_gaps``: the stretches of steps the records skipped (``count``, ``steps``
        not covered, the ``largest`` as [from step, to step]); ``badput_cost_usd`` sums every category but
        :data:`NOT_BADPUT`; ``custom_by_name`` splits ``custom`` by the names given to ``Monitor.badput``
        (``evaluation``...); step and restart counts; what the figures rest on (:meth:`_data_quality`: records the
        collectors dropped, steps missing ranks, coverage). Goodput is never above throughput, whole run or window.
        """
        if self._held:  # steps waiting for the usual increment: booked on a copy, as they will be
            led = copy.deepcopy(self)
            led._release()
            return led.snapshot(now)
        start = self._start if self._start is not None else now
        end = max(now, self._last_end or start)
        sec = dict(self._sec)
        last = self._last_end if self._last_end is not None else start
        tail = end - last
        # Time since the last step: declared checkpoint/custom time first, the rest idle.
        pend = {k: sum(v for key, (v, _) in self._pending.items() if key[0] == k)
                for k in ("checkpoint_save", "badput", "checkpoint_load")}
        save = min(pend["checkpoint_save"], tail)
        tail_custom = self._split("badput", tail - save)
        custom = sum(tail_custom.values())
        restore = min(pend["checkpoint_load"], tail - save - custom)
        by_name = dict(self._custom_by_name)
        for name, v in tail_custom.items():
            by_name[name] = by_name.get(name, 0.0) + v
        sec["checkpoint_save"] += save
        sec["custom"] += custom
        sec["checkpoint_restore"] += restore
        rest = tail - save - custom - restore
        sec["program_startup" if self._last_end is None else self._gap_kind(rest)] += rest
        wall = end - start
        step_raw = sum(sec[k] for k in STEP_CATEGORIES)  # unrounded: a rate's denominator
        sec = {k: round(v, 6) for k, v in sec.items()}
        gh = {k: v * self.world_size / 3600.0 for k, v in sec.items()}
        price = self.gpu_hour_usd
        cost = {k: v * price for k, v in gh.items()} if price is not None else None
        largest = self._gap_largest
        snap: LedgerSnapshot = {
            "t": end, "started_at": start, "wall_s": round(wall, 6), "world_size": self.world_size,
            "gpu_hour_usd": price,
            "last_step": self._lineage[-1][0] if self._lineage else None,
            "steps_done": self._steps_done, "steps_good": len(self._lineage), "restarts": self._restarts,
            "tokens_total": self._tokens_total, "tokens_good": self._tokens_good,
            "tokens_unobserved": self._tokens_unobserved,
            "step_s": round(step_raw, 6), "observed_s": round(wall - sec["unobserved"], 6),
            "throughput_tok_s": self._tokens_total / step_raw if step_raw > 0 else 0.0,
            "goodput_tok_s": self._tokens_good / wall if wall > 0 else 0.0,
            "goodput_pct": round(100.0 * sec["productive"] / wall, 6) if wall > 0 else 0.0,
            "rates": self._rates(end, wall),
            "progress": self._progress(),
            "seconds": sec, "custom_by_name": {k: round(v, 6) for k, v in by_name.items()},
            "gpu_hours": gh, "cost_usd": cost,
            "badput_cost_usd": (sum(v for k, v in cost.items() if k not in NOT_BADPUT) if cost else None),
            "unobserved_gaps": {"count": self._gaps, "steps": self._gap_steps,
                                "largest": list(largest) if largest is not None else None},
            **self._data_quality(),
        }
        return snap

    def _data_quality(self) -> dict[str, Any]:
        """What the figures rest on: ``records_dropped`` (``total`` and by cause — ``buffer``, ``spill``,
        ``unencodable``, ``trimmed``, ``unknown`` — and ``by_rank``, from the ``collector_drops`` events of the
        collectors and, for ``trimmed``, of the service),
        ``steps_partial`` (steps closed without every rank's record) and ``coverage_pct``: the rank records the
        steps were built from, per cent of those there should have been — world size x steps, or the records seen
        plus the records dropped when more (a dropped record may be one a partial step misses: not counted twice).
        Records dropped count step records and events alike, so the share is a lower bound."""
        drops = {k: v for k, v in self._drops.items() if v}
        expected = max(self.world_size * self._steps_done, self._rank_steps + sum(drops.values()))
        dropped: RecordsDropped = {"total": sum(drops.values()), **drops,
                                   "by_rank": {str(r): n for r, n in sorted(self._drops_by_rank.items()) if n}}
        return {
            "records_dropped": dropped,
            "steps_partial": self._partial_steps,
            "history_lost": self.history_lost,
            "coverage_pct": round(100.0 * min(self._rank_steps, expected) / expected, 3) if expected else None,
        }


def _collective_s(agg: StepAggregate) -> float:
    """Seconds of a step's timed collective that were not waiting for a rank: the slowest rank's (by its own
    sections) time in communication sections; without section times, the least any rank spent there (the one that
    waited least). 0.0 when no rank timed a collective.

    >>> a = StepAggregate(1, 0, 0.0, 0.0, 1.0, None, None, None, None, None, 2, (0.5, 0.8), 0.0, comm=(0.4, 0.1))
    >>> _collective_s(a)
    0.1
    """
    timed = [(b, c) for b, c in zip(agg.busy, agg.comm, strict=False) if c is not None]
    if not timed:
        return 0.0
    with_busy = [(b, c) for b, c in timed if b is not None]
    return max(with_busy)[1] if with_busy else min(c for _, c in timed)
