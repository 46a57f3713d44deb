"""Throughput drops: a sustained rise of the step time, found with Page's CUSUM."""

from __future__ import annotations

import math
import operator
import statistics
from dataclasses import replace
from typing import NamedTuple

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly, run_ended
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.robust import SortedWindow


def step_seconds(agg: StepAggregate) -> float | None:
    """The duration (s) the timing detectors judge for one step, or None.

    The step's own wall time when the ranks timed it (``mon.step()``: ``agg.dur``), else the
    job's own measurement (``log_step(step_s=...)``, a replayed log's time per iteration:
    ``agg.step_s``). Never the gap between two untimed records — it holds checkpoint saves,
    evaluations and, in a replay of a log without times, an assumed pace. Non-finite or
    non-positive values count as missing.

    >>> a = StepAggregate(7, 0, 0.0, None, 10.0, None, None, None, None, None, 1, (None,), 0.0, step_s=2.5)
    >>> step_seconds(a), step_seconds(replace(a, step_s=None)), step_seconds(replace(a, t_start=9.0))
    (2.5, None, 1.0)
    """
    d = agg.dur
    if d is not None and math.isfinite(d) and d > 0:
        return d
    s = agg.step_s
    if s is not None and math.isfinite(s) and s > 0:
        return s
    return None


class _Point(NamedTuple):
    step: int
    t: float  # seconds
    y: float  # log(seconds)
    tps: float | None  # tokens per step, when known
    end: float  # unix s the step ended (the aggregate's t_end)


_y = operator.attrgetter("y")  # a point's log step time (C-level: the sorted windows call it at every step)


def _percentile(values: list[float], q: float) -> float:
    # Linear interpolation between closest ranks, as ml-goodput-measurement's compute_percentile.
    v = sorted(values)
    i = (len(v) - 1) * q / 100.0
    lo = int(i)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (i - lo)


def goodput_step_deviation(baseline: list[float], recent: list[float]) -> tuple[float, float]:
    """Step-time deviation as Google's ml-goodput-measurement reports it: ``(ideal_s, deviation_s)``.

    The ideal step time is the mean of the baseline step times at most median + 3 x MAD
    (``compute_ideal_step_time``, raw MAD); each step's deviation is ``|t - ideal|``; the
    reported value is the 90th percentile of the recent deviations minus the median of the
    baseline ones (``compute_step_deviation_from_baseline``, cumulative mode; the library's
    windows are the last 100 steps and the 1,000 before them, ours the detector's windows).
    Seconds; both lists must be non-empty.

    >>> goodput_step_deviation([10.0, 10.2, 9.8, 10.0, 30.0], [12.0, 12.2, 11.8])
    (10.0, 1.96)
    """
    med = statistics.median(baseline)
    mad = statistics.median(abs(t - med) for t in baseline)
    normal = [t for t in baseline if t <= med + 3 * mad]
    ideal = statistics.fmean(normal)
    base_dev = statistics.median(abs(t - ideal) for t in baseline)
    return ideal, round(_percentile([abs(t - ideal) for t in recent], 90) - base_dev, 6)


def _highest_median(values: list[float], n: int) -> float:
    """The highest median of ``n`` consecutive values (``1 <= n <= len(values)``), from one sorted window slid
    along them: ``max(statistics.median(values[i:i + n]) for i in range(len(values) - n + 1))``, exactly."""
    win = SortedWindow(n)
    win.extend(values[:n])
    best = win.median()
    for v in values[n:]:
        win.append(v)
        best = max(best, win.median())
    return best


class ThroughputDropDetector(StepDetector):
    """A sustained step-time level shift (a throughput drop), one anomaly per shift.

    Works on ``y = log(step time)`` (see :func:`step_seconds`), so a shift is relative. The
    first ``warmup`` timed steps of each generation are skipped (compilation, cache and
    data-loader warm-up), and so is a step a declared pause fell in (``agg.pause``: a checkpoint
    save or load, an evaluation; the goodput ledger books its time); the next ``min_reference``
    form the reference, which then trails
    the last ``window`` steps judged normal: its median ``mu`` and robust SD
    ``s = max(1.4826 x MAD, min_scale)``. Each later step feeds Page's one-sided CUSUM

        ``S = max(0, S + clip((y - mu) / s, -clip, clip) - k)``

    tuned to a shift of ``2k`` robust SDs; steps inside an excursion (``S > 0``) stay out of
    the reference. When ``S > h`` the change point is the first step of the excursion (the
    CUSUM estimate, Basseville & Nikiforov sec. 2.2), refined to the maximum-likelihood split
    of the excursion (Hinkley 1970). A ``throughput_drop`` opens at it when

    - the median log step time since then is above ``mu`` by at least ``min_shift_sd`` robust
      SDs and ``min_rel_change`` (a smaller move is the workload's own variation);
    - the reference never had a level that high over as many steps (a step time that wanders
      with the data, as in fine-tuning, is not a drop when it wanders);
    - it has held over ``min_steps`` steps by step number (a shorter burst is a slow step), and
      over ``hold_steps`` steps or ``hold_s`` seconds of wall time: it lasts (CPU contention on a
      shared machine slows steps by a few percent for seconds at a time, and a slowdown gone that soon
      is not one anyone can act on), and the median of its latest ``min_steps`` steps is still above
      the midpoint of the two levels (a burst and the normal steps after it are not a level);
    - when the records carry tokens, the time per token rose as much (a bigger batch is not
      a drop).

    Severity follows the badput: ``warning`` when the drop costs at least ``warning_loss`` of the
    run's time (``1 - before / after``), else ``info``; an info drop whose shifted level grows past it
    becomes a warning.

    Winsorising (Lucas & Crosier's robust CUSUM) caps what one step adds at ``clip - k``: a
    single slow step, or a periodic one, cannot raise an alarm alone. While the drop is open
    the reference is frozen and a second CUSUM, tuned to the observed shift (Page's statistic
    for the change back, with the midpoint of the two levels as reference), watches for the
    return; the drop resolves when it crosses ``h`` (``end_step`` = the last step of the
    shifted level). A new generation (restart, rollback) resolves an open drop and starts a
    fresh reference: a relaunch may run on other nodes, at another world size.

    Parameters
    ----------
    window : int
        Normal timed steps in the trailing reference.
    warmup : int
        Timed steps skipped at the start of each generation.
    min_reference : int
        Reference steps needed before judging.
    k, h : float
        CUSUM reference value and decision interval, in robust SDs.
    clip : float
        Winsorising bound of the standardised log step time.
    min_shift_sd : float
        Smallest shift reported, in robust SDs of log step time.
    min_rel_change : float
        Smallest rise of the median step time reported (fraction).
    min_steps : int
        Steps (by number, onset to latest) the shift must have held.
    min_scale : float
        Floor of the robust SD of log step time.
    hold_steps : int
        Steps (by number) the shift must have held, unless it held ``hold_s``.
    hold_s : float
        Seconds of wall time (the records' ``t``) that make a shift last, however few its steps.
    warning_loss : float
        Fraction of the time lost (``1 - before / after``) from which a drop is a warning.

    Evidence: ``before_s``, ``after_s`` (median step times of the reference and since the
    onset), ``rel_change``, ``lost_fraction`` (``1 - before_s / after_s``: the share of the time the drop
    costs), ``cusum``, ``points``, ``span_steps``, ``held_s``, ``sd_log`` (robust SD of log
    step time), ``ideal_step_s`` and ``goodput_step_deviation_s`` (Google's step-time deviation,
    :func:`goodput_step_deviation`), ``tokens_per_s_before`` / ``_after`` when tokens are logged;
    on resolution ``recovered_s`` (or ``restarted``).

    Examples
    --------
    >>> import random
    >>> rng = random.Random(4)
    >>> det = ThroughputDropDetector()
    >>> for step in range(400):
    ...     t = 0.5 * (1.3 if 200 <= step < 300 else 1.0) * math.exp(rng.gauss(0, 0.03))
    ...     a = StepAggregate(step, 0, 0.0, step - t, float(step), 1.0, 1.0, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.severity, an.status, an.step, an.end_step, round(an.evidence["rel_change"], 2))
    throughput_drop warning active 200 None 0.3
    throughput_drop warning resolved 200 299 0.3

    CPU contention: bursts of 20 steps 6 % slower every 150 steps, on 60 ms steps with 2 % noise (the
    demo on a loaded machine), are no drop; the same 6 % held for 300 steps is one, a warning (5.6 % of
    the time lost):

    >>> rng, det = random.Random(5), ThroughputDropDetector()
    >>> for step in range(1500):
    ...     slower = (step < 900 and step % 150 < 20) or 1000 <= step < 1300
    ...     t = 0.06 * (1.06 if slower else 1.0) * math.exp(rng.gauss(0, 0.02))
    ...     a = StepAggregate(step, 0, 0.0, step - t, float(step), 1.0, 1.0, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.severity, an.status, an.step, an.end_step, an.evidence["lost_fraction"])
    throughput_drop warning active 1000 None 0.0562
    throughput_drop warning resolved 1000 1299 0.0562

    References
    ----------
    E. S. Page, "Continuous inspection schemes", Biometrika 41 (1954); M. Basseville and
    I. V. Nikiforov, *Detection of Abrupt Changes: Theory and Application* (1993), ch. 2;
    J. M. Lucas and R. B. Crosier, "Robust CUSUM", Commun. Statist. A 11 (1982);
    D. V. Hinkley, "Inference about the change-point in a sequence of random variables",
    Biometrika 57 (1970);
    D. Siegmund, *Sequential Analysis* (1985) (the run-length approximation used for ``h``);
    Google ml-goodput-measurement, ``goodput_utils.compute_ideal_step_time`` and
    ``compute_step_deviation_from_baseline`` (step-time deviation);
    A. Grattafiori et al., "The Llama 3 Herd of Models", arXiv:2407.21783 (2024), sec. 3.3.4 (a diurnal 1-2 %
    throughput variation of a 16k-GPU run: the scale ``warning_loss`` is set against).
    """

    KIND = "throughput_drop"

    def __init__(
        self,
        window: int = defaults.THROUGHPUT_WINDOW_STEPS,
        warmup: int = defaults.THROUGHPUT_WARMUP_STEPS,
        min_reference: int = defaults.THROUGHPUT_MIN_REFERENCE_STEPS,
        k: float = defaults.THROUGHPUT_CUSUM_K,
        h: float = defaults.THROUGHPUT_CUSUM_H,
        clip: float = defaults.THROUGHPUT_CLIP,
        min_shift_sd: float = defaults.THROUGHPUT_MIN_SHIFT_SD,
        min_rel_change: float = defaults.THROUGHPUT_MIN_REL_CHANGE,
        min_steps: int = defaults.THROUGHPUT_MIN_STEPS,
        min_scale: float = defaults.TIMING_MIN_SCALE,
        hold_steps: int = defaults.THROUGHPUT_HOLD_STEPS,
        hold_s: float = defaults.THROUGHPUT_HOLD_S,
        warning_loss: float = defaults.THROUGHPUT_WARNING_LOSS,
    ) -> None:
        self.window = window
        self.warmup = warmup
        self.min_reference = min_reference
        self.k = k
        self.h = h
        self.clip = clip
        self.min_shift_sd = min_shift_sd
        self.min_rel_change = min_rel_change
        self.min_steps = min_steps
        self.min_scale = min_scale
        self.hold_steps = hold_steps
        self.hold_s = hold_s
        self.warning_loss = warning_loss
        self._gen: int | None = None
        self._seen = 0  # timed steps in this generation
        self._prev_step: int | None = None
        # Windows of points with their log step times kept sorted: the reference's median and MAD, and the
        # shifted level's median, are read in O(log n) at every step instead of sorted again.
        self._ref = SortedWindow(window, _y)
        self._s = 0.0
        self._pending: list[_Point] = []  # the current excursion (S > 0)
        self._open: Anomaly | None = None
        self._base: tuple[float, float] = (0.0, 1.0)  # frozen (mu, s) while open
        self._shifted = SortedWindow(window, _y)
        self._d = 0.0
        self._back: list[_Point] = []  # the current return excursion while open

    def finish(self, step: int) -> list[Anomaly]:
        """Every rank ended at ``step``: resolve an open drop (:func:`trainhealth.anomaly.run_ended`); the next
        step, of a relaunch, is judged afresh as after a restart."""
        out = [run_ended(self._open, step)] if self._open is not None else []
        self._open = None
        self._shifted.clear()
        self._back.clear()
        self._d = 0.0
        self._gen = None
        return out

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed."""
        out: list[Anomaly] = []
        if agg.gen != self._gen:
            if self._open is not None:
                out.append(self._resolve(agg, restarted=True))
            self._gen, self._seen, self._prev_step = agg.gen, 0, None
            self._ref.clear()
            self._reset()
        tps = None
        if agg.tokens and self._prev_step is not None and agg.step > self._prev_step:
            # A replayed log's tokens cover the steps since the previous record.
            tps = agg.tokens / (agg.step - self._prev_step)
        self._prev_step = agg.step
        t = step_seconds(agg)
        if t is None or agg.pause is not None:
            return out  # untimed, or a declared pause (checkpoint, evaluation) fell in it: not a step time
        self._seen += 1
        if self._seen <= self.warmup:
            return out
        p = _Point(agg.step, t, math.log(t), tps, agg.t_end)
        if self._open is not None:
            return out + self._track(p, agg)
        if len(self._ref) < self.min_reference:
            self._ref.append(p)
            return out
        mu = self._median()
        if self._s == 0.0 and p.y <= mu and self.k >= 0 and self.min_scale > 0:
            # No excursion under way and a step at or below the median: z <= 0 <= k whatever the robust SD (> 0
            # with the floor), so the CUSUM stays exactly 0.0 and the MAD (the costly part) is not needed.
            s = None
        else:
            s = self._scale()
            z = min(max((p.y - mu) / s, -self.clip), self.clip)
            self._s = max(0.0, self._s + z - self.k)
        if self._s == 0.0:
            # The excursion was noise: its steps join the reference.
            self._ref.extend(self._pending)
            self._ref.append(p)
            self._pending.clear()
            return out
        self._pending.append(p)
        if self._s > self.h:
            assert s is not None  # the CUSUM only grows from a step whose SD was computed
            opened = self._judge(agg, mu, s)
            if opened is not None:
                out.append(opened)
            elif len(self._pending) >= self.window:
                # A long excursion too small to report: the level moved, the reference follows.
                self._ref.extend(self._pending)
                self._reset()
        return out

    def _reset(self) -> None:
        self._s = 0.0
        self._pending.clear()

    def _median(self) -> float:
        """Median ``mu`` of the reference's log step times, cached until the reference changes."""
        return self._ref.cached_median()

    def _scale(self) -> float:
        """Robust SD ``s = max(1.4826 x MAD, min_scale)`` of the reference, cached until it changes."""
        return self._ref.cached_scale(self.min_scale)

    def _judge(self, agg: StepAggregate, mu: float, s: float) -> Anomaly | None:
        pend = self._onset_trimmed(mu)
        before = statistics.median(p.t for p in self._ref)
        after = statistics.median(p.t for p in pend)
        rel = after / before - 1.0
        shift = statistics.median(p.y for p in pend) - mu
        # Held from the onset to the latest step still above the midpoint of the two levels: at least min_steps
        # steps, and hold_steps steps or hold_s seconds (a burst of contention on a shared machine lasts seconds).
        last = max((p for p in pend if p.y > mu + shift / 2), key=lambda p: p.step)
        span = last.step - pend[0].step + 1
        held_s = last.end - (pend[0].end - pend[0].t)
        if rel < self.min_rel_change or shift < self.min_shift_sd * s or span < self.min_steps or (
                span < self.hold_steps and held_s < self.hold_s):
            return None
        # ...and still there: the latest min_steps steps are above the midpoint too (a burst followed by normal
        # steps keeps the CUSUM up for a while, and the median of burst and tail together is not a level).
        if statistics.median(p.y for p in pend[-self.min_steps:]) <= mu + shift / 2:
            return None
        # The reference's own level must never have been this high over as many steps: a workload
        # whose step time wanders (sequence lengths in fine-tuning) is not a drop when it wanders.
        ref_t, n = [p.t for p in self._ref], len(pend)
        if n < len(ref_t) and after <= _highest_median(ref_t, n):
            return None
        ev: dict[str, float | int] = {
            "before_s": before, "after_s": after, "rel_change": round(rel, 4), "cusum": round(self._s, 2),
            "points": len(pend), "span_steps": span, "held_s": round(held_s, 3), "sd_log": round(s, 5),
            "shift_sd": round(shift / s, 2), "lost_fraction": round(1.0 - before / after, 4),
        }
        tok_before = self._tokens(self._ref)
        tok_after = self._tokens(pend)
        if tok_before is not None and tok_after is not None:
            if (after / tok_after) / (before / tok_before) - 1.0 < self.min_rel_change:
                return None  # more tokens per step: a larger batch, not a slower job
            ev["tokens_per_s_before"] = round(tok_before / before, 3)
            ev["tokens_per_s_after"] = round(tok_after / after, 3)
        ideal, dev = goodput_step_deviation([p.t for p in self._ref], [p.t for p in pend[-self.window:]])
        ev["ideal_step_s"] = round(ideal, 6)
        ev["goodput_step_deviation_s"] = dev
        onset = pend[0].step
        self._open = Anomaly(kind=self.KIND, severity=self._severity(before, after), step=onset, gen=agg.gen,
                             evidence=ev, message=_message(onset, ev))
        self._base = (mu, s)
        self._ref.extend(self._pending[:len(self._pending) - len(pend)])  # before the change point
        self._shifted.clear()
        self._shifted.extend(pend)
        self._d = 0.0
        self._back.clear()
        self._reset()
        return self._open

    def _onset_trimmed(self, mu: float) -> list[_Point]:
        """The excursion from its most likely change point: the CUSUM's start, moved to the
        maximum-likelihood onset of a mean shift from ``mu`` to the excursion's median (the
        split maximising the summed excess over their midpoint; Hinkley 1970), so noise that
        happened to start the excursion a few steps early is not counted as the drop."""
        pend = self._pending
        mid = (mu + statistics.median(p.y for p in pend)) / 2.0
        best, acc, start = 0.0, 0.0, 0
        for i in range(len(pend) - 1, -1, -1):
            acc += pend[i].y - mid
            if acc >= best:
                best, start = acc, i
        return pend[start:]

    def _severity(self, before: float, after: float) -> str:
        """``warning`` when the drop costs at least ``warning_loss`` of the run's time (``1 - before / after``),
        else ``info``: severity follows the badput."""
        return "warning" if 1.0 - before / after >= self.warning_loss else "info"

    @staticmethod
    def _tokens(points: list[_Point] | SortedWindow) -> float | None:
        known = [p.tps for p in points if p.tps is not None]
        return statistics.median(known) if known and 2 * len(known) >= len(points) else None

    def _track(self, p: _Point, agg: StepAggregate) -> list[Anomaly]:
        """While a drop is open: watch for the return below the midpoint of the two levels."""
        mu0, s0 = self._base
        mu1 = self._shifted.median()
        mid = (mu0 + mu1) / 2.0
        z = min(max((mid - p.y) / s0, -self.clip), self.clip)
        self._d = max(0.0, self._d + z)
        if self._d == 0.0:
            self._shifted.extend(self._back)
            self._shifted.append(p)
            self._back.clear()
            return self._escalate()
        self._back.append(p)
        if self._d <= self.h:
            return []
        return [self._resolve(agg, restarted=False)]

    def _escalate(self) -> list[Anomaly]:
        """An ``info`` drop whose shifted level has grown to cost ``warning_loss`` of the time: now a warning."""
        a = self._open
        if a is None or a.severity != "info" or len(self._shifted) % self.min_steps:
            return []  # judged every min_steps shifted steps: the median of a sorted window, not per step
        before = a.evidence["before_s"]
        after = math.exp(self._shifted.median())
        if self._severity(before, after) != "warning":
            return []
        ev = {**a.evidence, "after_s": after, "rel_change": round(after / before - 1.0, 4),
              "lost_fraction": round(1.0 - before / after, 4)}
        self._open = replace(a, severity="warning", evidence=ev, message=_message(a.step, ev))
        return [self._open]

    def _resolve(self, agg: StepAggregate, restarted: bool) -> Anomaly:
        a = self._open
        assert a is not None
        end = self._shifted[-1].step if self._shifted else a.step
        ev = dict(a.evidence)
        ev["after_s"] = statistics.median(q.t for q in self._shifted) if self._shifted else ev["after_s"]
        head = a.message.split(";")[0]
        if restarted:
            ev["restarted"] = True
            msg = f"{head}; ended by a restart (generation {agg.gen}), judged afresh from there"
        else:
            back = statistics.median(q.t for q in self._back)
            ev["recovered_s"] = back
            msg = f"{head}; back to {back:.4g} s per step after step {end}"
            # The level returned: the frozen reference holds again, with the return steps.
            self._ref.extend(self._back)
        self._open = None
        self._shifted.clear()
        self._back.clear()
        self._d = 0.0
        self._reset()
        return replace(a, status=RESOLVED, end_step=end, evidence=ev, message=msg)


def _message(onset: int, ev: dict[str, float | int]) -> str:
    before, after, rel = ev["before_s"], ev["after_s"], ev["rel_change"]
    tok = (f"; tokens/s {ev['tokens_per_s_before']:,.0f} -> {ev['tokens_per_s_after']:,.0f}"
           if "tokens_per_s_after" in ev else "")
    return (f"throughput dropped {ev['lost_fraction']:.1%} from step {onset}: median step time {before:.4g} s -> "
            f"{after:.4g} s (+{rel:.1%}){tok}; look for a slow node, thermal throttling or a changed input "
            "pipeline")
