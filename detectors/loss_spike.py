"""Loss spikes against a robust trailing baseline, classified by how they recover (fast, slow, not at all)."""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from detectors.aggregate import StepAggregate
from detectors.anomaly import RESOLVED, Anomaly
from trainhealth import defaults
from trainhealth.text import plural

#: Consistency constant making the MAD estimate the standard deviation of normal data (Rousseeuw & Croux 1993).
MAD_TO_SIGMA = 1.4826
#: Expected range of n = 2..20 standard normal draws, d2(n) (control-chart constants; ASTM STP 15D,
#: D. C. Montgomery, "Introduction to Statistical Quality Control", table VI): sigma ~ range / d2(n).
D2 = (1.128, 1.693, 2.059, 2.326, 2.534, 2.704, 2.847, 2.970, 3.078, 3.173, 3.258, 3.336, 3.407, 3.472, 3.532,
      3.588, 3.640, 3.689, 3.735)
#: Small windows: the z a new point must exceed for a one-sided 1e-4 false-alarm rate when the scale itself is
#: estimated from n points, the Student-t prediction bound t_{n-1}(1 - 1e-4) * sqrt(1 + 1/n) (n = 3..9; from 10
#: points on it is below LOSS_SPIKE_Z_OPEN). Values from scipy.stats.t.ppf.
SMALL_SAMPLE_Z = {3: 81.64, 4: 24.82, 5: 14.28, 6: 10.45, 7: 8.58, 8: 7.49, 9: 6.79}
#: Recovery classes, in ``evidence["recovery_class"]``.
FAST, SLOW, NOT_RECOVERED = "fast", "slow", "not_recovered"


# -- rolling robust statistics, shared by the loss, grad-norm and timing detectors ------------------------------
# Every detector judges each step against medians and MADs of a trailing window of 50-2000 points. Recomputing
# them (a sort per statistic per step) was most of the pipeline's cost per step; these helpers give the same
# floats, bit for bit, from a window kept sorted as it slides.
def median_sorted(s: Sequence[float]) -> float:
    """:func:`statistics.median` of values already in ascending order, without sorting them again.

    The same arithmetic as the standard library: the middle value, or ``(a + b) / 2`` of the two middle ones.

    Raises
    ------
    statistics.StatisticsError
        For no values.

    >>> median_sorted([1.0, 2.0, 4.0]), median_sorted([1, 2, 4, 8])
    (2.0, 3.0)
    """
    n = len(s)
    if n == 0:
        raise statistics.StatisticsError("no median for empty data")
    if n % 2 == 1:
        return s[n // 2]
    i = n // 2
    return (s[i - 1] + s[i]) / 2


def mad_sorted(s: Sequence[float], mid: float) -> float:
    """Median absolute deviation from ``mid`` of values already in ascending order, in O(log n).

    Exactly ``statistics.median([abs(v - mid) for v in s])``: the deviations of the values below ``mid`` (read
    leftwards from it) and of the others (read rightwards) are two ascending sequences, so the middle one(s) of
    their merge are found by a binary search on how many come from the first (the k-th smallest of two sorted
    arrays), computing only ~2 log2(n) deviations. Below ``mid`` a deviation is computed as ``mid - v``, which is
    ``abs(v - mid)`` bit for bit (IEEE subtraction is exactly antisymmetric); a zero result goes through ``abs``
    so that a ``-0.0`` value never makes a ``-0.0`` MAD where the original gives ``0.0``.

    Raises
    ------
    statistics.StatisticsError
        For no values.

    >>> v = [1.0, 2.0, 2.5, 7.0, 9.0]
    >>> mad_sorted(v, 2.5), statistics.median([abs(x - 2.5) for x in v])
    (1.5, 1.5)
    >>> import random
    >>> rng = random.Random(0)  # ties, signed zeros, odd and even counts, mid inside and outside the values
    >>> cases = [[round(rng.gauss(0, 1), 1) for _ in range(rng.randint(1, 40))] for _ in range(2000)]
    >>> all(repr(mad_sorted(sorted(v), m)) == repr(statistics.median([abs(x - m) for x in v]))
    ...     for v in cases for m in (statistics.median(v), round(rng.gauss(0, 1), 1), -0.0))
    True
    """
    n = len(s)
    if n == 0:
        raise statistics.StatisticsError("no median for empty data")
    p = bisect.bisect_left(s, mid)  # s[:p] < mid <= s[p:]
    na, nb = p, n - p  # deviations below: mid - s[p - 1 - i], i < na; above: s[p + j] - mid, j < nb
    k = (n - 1) // 2  # 0-based rank of the (lower) middle deviation
    # i = how many of the k + 1 smallest deviations lie below mid: the smallest i with below[i] >= above[k - i].
    lo, hi = max(0, k + 1 - nb), min(k + 1, na)
    q = p + k
    while lo < hi:
        i = (lo + hi) // 2
        if s[q - i] - mid > mid - s[p - 1 - i]:
            lo = i + 1
        else:
            hi = i
    i, j = lo, k + 1 - lo
    if i == 0:
        kth = s[p + j - 1] - mid
    elif j == 0:
        kth = mid - s[p - i]
    else:
        a, b = mid - s[p - i], s[p + j - 1] - mid
        kth = a if a > b else b
    if n % 2 == 1:
        return kth or abs(kth)  # abs turns a -0.0 into the 0.0 abs(v - mid) gives
    # The next deviation: the smaller of the next one on either side.
    if i == na:
        nxt = s[p + j] - mid
    elif j == nb:
        nxt = mid - s[p - 1 - i]
    else:
        a, b = mid - s[p - 1 - i], s[p + j] - mid
        nxt = a if a < b else b
    mad = (kth + nxt) / 2
    return mad or abs(mad)


class SortedWindow:
    """The last ``maxlen`` items in arrival order, with their values also kept in ascending order.

    ``sorted`` is always exactly ``sorted(map(key, items))`` of the stable sort, element for element (the same
    float objects, ties in arrival order): a value goes in by :func:`bisect.insort_right` (after the values equal
    to it, which arrived earlier) and leaves by identity (not merely an equal value: ``0.0 == -0.0``). Medians and
    MADs read from it are therefore bit-identical to recomputing them from the items, at O(1) and O(log n) instead
    of a sort per step (insertion and removal are O(log n) searches plus a C ``memmove``).

    Parameters
    ----------
    maxlen : int | None
        Items kept (the oldest leaves when a new one comes); None: unbounded.
    key : callable | None
        The value of an item (it must return the same object each time it is called on the same item, e.g. an
        attribute); None: the items are the values. Values must not be NaN (they are bisected).

    Attributes
    ----------
    items : list
        In arrival order (a list, for slicing).
    sorted : list[float]
        The values in ascending order.

    Examples
    --------
    >>> w = SortedWindow(3)
    >>> w.extend([5.0, 1.0, 4.0, 2.0])
    >>> w.items, w.sorted, w.median(), w.mad(w.median())
    ([1.0, 4.0, 2.0], [1.0, 2.0, 4.0], 2.0, 1.0)
    """

    __slots__ = ("_robust", "items", "key", "maxlen", "sorted")

    def __init__(self, maxlen: int | None = None, key: Callable[[Any], float] | None = None) -> None:
        self.maxlen = maxlen
        self.key = key
        self.items: list[Any] = []
        self.sorted: list[float] = []
        self._robust: list[float | None] | None = None  # [median, robust SD or None], until the values change

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __getitem__(self, i: int | slice) -> Any:
        return self.items[i]

    def append(self, item: Any) -> None:
        items = self.items
        if len(items) == self.maxlen:  # never for maxlen None
            if not items:
                return  # maxlen 0 keeps nothing (as a deque's)
            self._drop(items.pop(0))
        items.append(item)
        bisect.insort(self.sorted, item if self.key is None else self.key(item))
        self._robust = None

    def extend(self, items: Iterable[Any]) -> None:
        for item in items:
            self.append(item)

    def pop(self) -> Any:
        """Remove and return the newest item."""
        item = self.items.pop()
        self._drop(item)
        return item

    def clear(self) -> None:
        self.items.clear()
        self.sorted.clear()
        self._robust = None

    def median(self) -> float:
        """``statistics.median`` of the values."""
        return median_sorted(self.sorted)

    def mad(self, mid: float) -> float:
        """``statistics.median`` of the values' absolute deviations from ``mid``."""
        return mad_sorted(self.sorted, mid)

    def cached_median(self) -> float:
        """:meth:`median`, computed once until the values change (a detector reads it at every step)."""
        r = self._robust
        if r is None:
            r = self._robust = [median_sorted(self.sorted), None]
        return r[0]  # type: ignore[return-value]

    def cached_scale(self, min_scale: float = 0.0) -> float:
        """Robust SD ``max(1.4826 x MAD about the median, min_scale)``, computed once until the values change
        (the cache assumes one ``min_scale`` per window, as each detector has)."""
        mid = self.cached_median()
        r = self._robust
        if r[1] is None:  # type: ignore[index]
            r[1] = max(MAD_TO_SIGMA * mad_sorted(self.sorted, mid), min_scale)  # type: ignore[index]
        return r[1]  # type: ignore[index,return-value]

    def _drop(self, item: Any) -> None:
        _remove(self.sorted, item if self.key is None else self.key(item))
        self._robust = None


def _remove(s: list[float], v: float) -> None:
    """Remove the object ``v`` from the ascending list ``s`` (among the values equal to it, that very object)."""
    i = bisect.bisect_left(s, v)
    while s[i] is not v:
        i += 1
    del s[i]


class Baseline(NamedTuple):
    """Trailing baseline of the (log) series (immutable; a named tuple: fitted at every step, it is built three
    times faster than a frozen dataclass).

    Attributes
    ----------
    last : int
        Step of the newest point in the window.
    level : float
        Robust level (median of the detrended newer half of the window) at ``last``, in the transformed
        units (log of the value for a positive series).
    slope : float
        Falling trend per step (<= 0; a rising trend is left in the level).
    scale : float
        Robust noise scale of one point (:func:`robust_scale` of the detrended window).
    span : int
        Steps covered by the points the trend was fitted on (>= 1); it is extrapolated at most this far.
    n : int
        Points in the window.
    """

    last: int
    level: float
    slope: float
    scale: float
    span: int
    n: int

    def predict(self, step: int) -> float:
        """Expected (transformed) value at ``step``."""
        # Extrapolate the trend at most one window span ahead (a long spike must not chase it down).
        return self.level + self.slope * min(max(step - self.last, 0), self.span)


class _Tail:
    """Peaks-over-threshold estimate of the level a stream of normalised residuals exceeds with a given
    probability per point (extreme value theory, as in SPOT: A. Siffer et al., "Anomaly Detection in Streams
    with Extreme Value Theory", KDD 2017).

    The residuals above their ``quantile`` (the peaks) follow a generalised Pareto distribution
    (Pickands-Balkema-de Haan); its shape ``xi`` and scale ``beta`` are estimated by probability-weighted
    moments (J. R. M. Hosking and J. R. Wallis, Technometrics 29, 1987: steadier than plain moments on heavy
    tails), and the level exceeded with probability ``risk`` is ``t + beta / xi * ((risk * n / k) ** -xi - 1)``
    (``t`` the quantile, ``n`` residuals, ``k`` peaks). Refitted every ``refit`` new residuals; no level until
    ``min_points`` are in.

    The residuals are sorted only when a refit is due at a :meth:`level` call (a candidate spike: rare), not
    kept sorted as they arrive: adding one is O(1) at every step instead of two binary searches in a list of
    ``points`` floats. The stable sort gives exactly the list an insort-and-remove-the-oldest scheme would keep
    (equal values in arrival order), so the fit is the same.
    """

    def __init__(self, points: int, quantile: float, min_points: int, refit: int = 50) -> None:
        self.points, self.quantile, self.min_points, self.refit = points, quantile, min_points, refit
        self._vals: deque[float] = deque()
        self._since = refit
        self._fit: tuple[float, float, float, float] | None = None  # t, xi, beta, k / n

    def add(self, u: float) -> None:
        self._vals.append(u)
        if len(self._vals) > self.points:
            self._vals.popleft()
        self._since += 1

    def clear(self) -> None:
        self._vals.clear()
        self._since, self._fit = self.refit, None

    def level(self, risk: float) -> float | None:
        """The residual exceeded with probability ``risk`` per point (None while too few points)."""
        if len(self._vals) < self.min_points:
            return None
        if self._since >= self.refit:
            self._fit, self._since = self._estimate(), 0
        if self._fit is None:
            return None
        t, xi, beta, frac = self._fit
        p = risk / frac
        if p >= 1.0:
            return t
        if math.isinf(xi):
            return math.inf  # a tail too heavy for a finite mean: nothing stands out from it
        return t + (beta / xi * (p ** -xi - 1.0) if abs(xi) > 1e-9 else -beta * math.log(p))

    def _estimate(self) -> tuple[float, float, float, float] | None:
        vals = sorted(self._vals)
        n = len(vals)
        i0 = min(int(self.quantile * n), n - 1)
        t = vals[i0]
        peaks = [v - t for v in vals[i0 + 1:] if v > t]
        k = len(peaks)
        if k < 10:
            return None
        a0 = sum(peaks) / k
        a1 = sum((1.0 - (i + 0.65) / k) * y for i, y in enumerate(peaks)) / k  # ascending: p_i = (i + 1 - 0.35) / k
        if a0 - 2.0 * a1 <= 0:
            return t, math.inf, 0.0, k / n
        return t, 2.0 - a0 / (a0 - 2.0 * a1), 2.0 * a0 * a1 / (a0 - 2.0 * a1), k / n


class _History:
    """A detector's trailing window of (step, transformed value) points, steps increasing.

    ``steps`` and ``ys`` are lists in arrival order (for the slices of :func:`fit_baseline`), ``sorted`` the values
    in ascending order, maintained as :class:`SortedWindow` maintains its own (inlined here: this runs at every
    step), so the window's median is O(1) and a flat or rising window is fitted from the values already sorted.
    """

    __slots__ = ("maxlen", "sorted", "steps", "ys")

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self.steps: list[int] = []
        self.ys: list[float] = []
        self.sorted: list[float] = []

    def __len__(self) -> int:
        return len(self.steps)

    def append(self, step: int, y: float) -> None:
        steps = self.steps
        if len(steps) >= self.maxlen:
            if not steps:
                return  # maxlen 0 keeps nothing (as a deque's)
            del steps[0]
            _remove(self.sorted, self.ys.pop(0))
        steps.append(step)
        self.ys.append(y)
        bisect.insort(self.sorted, y)

    def pop(self) -> None:
        self.steps.pop()
        _remove(self.sorted, self.ys.pop())

    def clear(self) -> None:
        self.steps.clear()
        self.ys.clear()
        self.sorted.clear()

    def median(self) -> float:
        return median_sorted(self.sorted)

    def fit(self, logs: bool) -> Baseline:
        """The baseline of the window; ``logs``: the values are logs (floats, never ``-0.0``)."""
        if logs:
            return _FITS.fit(self.steps, self.ys, self.sorted)
        return fit_baseline(self.steps, self.ys)


class LossSpikeDetector:
    """Loss spikes on a detrended trailing window of log-loss, classified once they settle.

    Loss noise is multiplicative (a spike doubles the loss whatever its level), so the statistics
    run on ``log(loss)`` while every loss seen is positive (cross-entropy), and on the loss itself
    otherwise. The baseline is fitted on the previous ``window`` logged non-spike values (points, with
    their step numbers, so sparse and irregular logs work):

    * a falling trend, Tukey's resistant line over the newer half of the window (a loss curve is
      convex: the recent slope is the one to extrapolate); a rising trend is left in the level, so a
      slow divergence still shows;
    * the level, the median of the detrended newer half, at the newest point;
    * the noise scale ``s``, 1.4826 x MAD of the whole detrended window (points older than the
      trend's own span are detrended no further than it: across a log's gap the trend is unknown); for
      at most 20 points at least ``R / d2(n)`` (range over the expected range of n normal draws: the MAD
      of a few points can be near zero by chance).

    A spike **opens** when the excess ``e = x - level`` (the current level: extrapolating the trend to
    the new step would only lower the expectation, wrongly so while a steep early decay decelerates)
    passes all of

    * ``e > z_open * s``, a robust z-score (the Hampel filter; OLMo-core flags 6 SDs); with n <= 9 points
      in the window, at least the Student-t prediction bound for a scale estimated from n points
      (:data:`SMALL_SAMPLE_Z`);
    * ``e > log(1 + min_rel_rise)``: the value is at least ``1 + min_rel_rise`` times the expected one.
      A smaller one-point rise is within the ordinary batch-to-batch spread of real runs
      (modded-nanogpt's late phase: a +15 % blip every ~100 steps; Megatron Mixtral: +6-14 % blips) and
      not what the practitioner accounts call a spike (BLOOM-176B: 2.2 -> 5.1; PaLM §5.1; the OPT logbook);
    * ``e / s`` above the level the run's own normalised residuals exceed with probability
      ``tail_risk`` per step (extreme value theory: a generalised Pareto tail fitted on the last
      ``tail_points`` accepted points, once ``tail_min_points`` are in). On Gaussian noise this sits near
      4 SDs and changes nothing; on the heavy right tail of real losses (hard batches) it keeps the run's
      routine blips quiet. Waived when the partner signal (the grad norm for the loss) is at least
      ``corroborate_z`` robust SDs above its own median at the same step: two signals agreeing.

    When the partner spikes at the same step (``partner_spike_z`` robust SDs, the partner detector's own
    threshold), this signal's excursion needs only ``corroborate_z`` SDs besides the relative floor: the
    grad norm that jumps 12x with a loss spike (TrOCR, step 682) is part of it, though alone it would be
    within that run's wide grad-norm swings. A hard batch raises both a little; this asks one of them to
    be a spike on its own.

    A point further from the window than the window is long (an excerpt's next block, a long logging
    gap) is not tested: the baseline does not describe its neighbourhood, and a jump there is a level
    change across the gap (:class:`~detectors.divergence.DivergenceDetector` judges lasting ones). The
    window starts again from it.

    A spike stays open while the loss is still elevated, ``e > max(z_close * s, log(1 + close_rel))``,
    against the frozen pre-spike baseline, its trend extrapolated (spike points never enter the window,
    so the baseline is not dragged up by the spike itself); it has settled when two logged points in a
    row are back (one noisy dip during a slow recovery is not the end), ``recovery_steps`` counting to
    the first of them. Once settled it is classified:

    * ``fast``: back within ``fast_steps`` steps of the onset, or at the very next logged point (a
      sparse log cannot show a faster recovery);
    * ``slow``: back, later than that;
    * ``not_recovered``: still elevated ``divergence_steps`` steps after the onset (at a second
      elevated point), or a run of ``skipped_steps`` consecutive skipped optimizer steps (fp16
      overflow) while it is up: the weights are not being updated, so the loss cannot come back by
      training. :class:`~detectors.divergence.DivergenceDetector` reports these as ``divergence``;
      here the baseline restarts at the new level.

    Parameters
    ----------
    window : int
        Trailing logged points in the baseline.
    warmup : int
        Logged points needed before anything is flagged.
    z_open, z_close : float
        Robust z-scores that open a spike and bound its recovery (hysteresis).
    min_rel_rise : float
        Minimum rise over the expected value to open, as a fraction of it.
    close_rel : float
        The loss counts as recovered within this fraction of the expected value (or ``z_close``).
    tail_points, tail_min_points : int
        Accepted points kept for the tail fit, and needed before it is used.
    tail_quantile : float
        Residuals above this quantile are the peaks the tail is fitted on.
    tail_risk : float
        Probability per step that the run's own noise exceeds the tail threshold (1e-4: one false alarm
        per 10,000 healthy steps); times the log's interval per logged point.
    corroborate_z : float
        Robust z of the partner signal at the same step that waives the tail threshold.
    partner_spike_z : float
        Robust z of the partner signal at the same step that makes it a spike itself (the partner
        detector's ``z_open``); then this signal needs only ``corroborate_z`` SDs (and the relative floor).
    fast_steps : int
        Recovery within this many steps (from the onset) is ``fast``.
    divergence_steps : int
        Steps (by step number) a spike may stay open before it is ``not_recovered``.
    skipped_steps : int
        Consecutive skipped optimizer steps during an open spike that make it ``not_recovered``
        (0 disables).

    Evidence: ``loss`` (value at onset), ``baseline`` (expected value), ``z``, ``rise`` (ratio to the
    expected value), ``threshold`` (smallest ratio that would have opened), ``tail_z`` (the tail threshold
    in SDs, None before it exists), ``partner_z`` (None when the partner is not logged), ``peak``, ``peak_step``;
    once settled ``recovery_class``, ``recovered``, ``recovery_steps`` (first step back at the
    baseline minus the onset; None if not recovered), ``elevated_steps``; ``skipped_run`` when
    skipped steps decided it; ``rolled_back`` when training went back past the onset.

    Examples
    --------
    >>> import random
    >>> from detectors.aggregate import StepAggregate
    >>> rng = random.Random(0)
    >>> det = LossSpikeDetector()
    >>> for step in range(300):
    ...     loss = 3.0 * math.exp(-step / 400) + rng.gauss(0, 0.02) + (1.5 if 200 <= step < 204 else 0)
    ...     a = StepAggregate(step, 0, 0.0, None, float(step), loss, 1.0, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.status, an.step, an.end_step, an.evidence.get("recovery_class"))
    loss_spike active 200 None None
    loss_spike resolved 200 203 fast

    References
    ----------
    F. R. Hampel, "The influence curve and its role in robust estimation", JASA 69 (1974);
    R. K. Pearson, "Outliers in process modeling and identification", IEEE TCST 10 (2002)
    (the Hampel filter); P. J. Rousseeuw and C. Croux, "Alternatives to the median absolute
    deviation", JASA 88 (1993) (the 1.4826 consistency constant); J. W. Tukey, "Exploratory Data Analysis"
    (1977) (the resistant line); A. Siffer et al., "Anomaly Detection in Streams with Extreme Value
    Theory", KDD 2017 (SPOT); J. R. M. Hosking and J. R. Wallis, Technometrics 29 (1987) (the generalised
    Pareto by probability-weighted moments); OLMo-core ``StabilityMonitorCallback``
    (allenai/OLMo-core, src/olmo_core/train/callbacks/stability_monitor.py: a spike is > 6 SD above the
    trailing 128 values); A. Chowdhery et al., "PaLM", JMLR 24 (2023) §5.1
    (spikes that do not recover: restart ~100 steps before, skip 200-500 batches); BigScience
    BLOOM-176B chronicles (tr11-176B-ml/chronicles.md: a spike 2.2 -> 5.1 at iteration 31219, back
    within ~30 iterations) and tr8b-104B chronicles (a jump that stays, with fp16 overflow skips);
    Meta OPT-175B logbook (spikes followed by divergence, rolled back).
    """

    #: Anomaly kind, the aggregate's field watched, and its name in messages.
    KIND = "loss_spike"
    FIELD = "loss"
    LABEL = "loss"
    #: The other signal that corroborates a spike at the same step.
    PARTNER = "grad_norm"

    def __init__(
        self,
        window: int = defaults.LOSS_SPIKE_WINDOW_STEPS,
        warmup: int = defaults.LOSS_SPIKE_WARMUP_STEPS,
        z_open: float = defaults.LOSS_SPIKE_Z_OPEN,
        z_close: float = defaults.LOSS_SPIKE_Z_CLOSE,
        min_rel_rise: float = defaults.LOSS_SPIKE_MIN_REL_RISE,
        close_rel: float = defaults.LOSS_SPIKE_CLOSE_REL,
        tail_points: int = defaults.LOSS_SPIKE_TAIL_POINTS,
        tail_quantile: float = defaults.LOSS_SPIKE_TAIL_QUANTILE,
        tail_risk: float = defaults.LOSS_SPIKE_TAIL_RISK,
        tail_min_points: int = defaults.LOSS_SPIKE_TAIL_MIN_POINTS,
        corroborate_z: float = defaults.LOSS_SPIKE_CORROBORATE_Z,
        partner_spike_z: float = defaults.GRAD_NORM_SPIKE_Z_OPEN,
        fast_steps: int = defaults.LOSS_SPIKE_FAST_STEPS,
        divergence_steps: int = defaults.DIVERGENCE_STEPS,
        skipped_steps: int = defaults.SKIPPED_STEPS_MIN,
    ) -> None:
        self.window = window
        self.warmup = warmup
        self.z_open = z_open
        self.z_close = z_close
        self.min_rel_rise = min_rel_rise
        self.close_rel = close_rel
        self.tail_points = tail_points
        self.tail_quantile = tail_quantile
        self.tail_risk = tail_risk
        self.tail_min_points = tail_min_points
        self.corroborate_z = corroborate_z
        self.partner_spike_z = partner_spike_z
        self.fast_steps = fast_steps
        self.divergence_steps = divergence_steps
        self.skipped_steps = skipped_steps
        self._hist = _History(window)
        self._log = True
        self._spike: Anomaly | None = None
        self._base: Baseline | None = None
        self._last: Baseline | None = None
        # Normalised residuals (x - level) / scale of accepted points, for the extreme-value threshold.
        self._tail = _Tail(tail_points, tail_quantile, tail_min_points)
        # The partner signal's (step, log value) at accepted points.
        self._partner: deque[tuple[int, float]] = deque(maxlen=window)
        self._last_elevated = 0
        self._elevated_points = 0
        self._back: int | None = None  # first step of the current run of points back at the baseline
        self._skip_run = 0
        self._prev_step: int | None = None
        self._last_update: tuple[StepAggregate, Baseline | None, list[Anomaly]] | None = None

    # -- public read-only state (DivergenceDetector builds on it) -----------------------------------------
    @property
    def baseline(self) -> Baseline | None:
        """The trailing baseline as of the last accepted point (None during warm-up)."""
        return self._last

    @property
    def window_median(self) -> float | None:
        """Median of the window's (transformed) values, not detrended: a steady, slightly lagging level
        (None before the first point)."""
        return self._hist.median() if self._hist else None

    @property
    def window_points(self) -> int:
        """Points in the trailing window."""
        return len(self._hist)

    @property
    def log_scale(self) -> bool:
        """Whether the statistics run on ``log(value)`` (every value seen was positive)."""
        return self._log

    @property
    def spike_open(self) -> bool:
        return self._spike is not None

    @property
    def last_update(self) -> tuple[StepAggregate, Baseline | None, list[Anomaly]] | None:
        """The latest aggregate fed, the baseline as of just before it, and what :meth:`update` returned for it
        (None before the first): lets a detector built on this one (:class:`~detectors.divergence.DivergenceDetector`)
        share it with the pipeline instead of feeding a copy of it."""
        return self._last_update

    # -- internals ------------------------------------------------------------------------------------------
    def _inv(self, x: float) -> float:
        return math.exp(x) if self._log else x

    def _rel(self, frac: float) -> float:
        """A relative rise ``frac`` in the transformed units (log ratio, or a fraction of the level)."""
        return math.log1p(frac) if self._log else frac

    def _fit(self) -> Baseline:
        return self._hist.fit(self._log)

    def _accept(self, agg: StepAggregate, x: float, base: Baseline | None) -> None:
        """Add a non-spike point to the window (its residual to the tail, its partner value to theirs)."""
        if base is not None:
            self._tail.add((x - base.level) / base.scale)
        v = getattr(agg, self.PARTNER)
        if v is not None and math.isfinite(v) and v > 0:
            self._partner.append((agg.step, math.log(v)))
        self._hist.append(agg.step, x)
        self._last = self._hist.fit(self._log) if len(self._hist) >= self.warmup else None  # self._fit(), inline

    def _interval(self) -> float:
        """Median steps between consecutive points of the window (the log's interval; at least 1)."""
        steps = self._hist.steps
        return max(float(statistics.median([b - a for a, b in itertools.pairwise(steps)])), 1.0) if len(steps) > 1 \
            else 1.0

    def _partner_z(self, agg: StepAggregate) -> float:
        """The partner signal's robust z at this step against its own baseline over the accepted points, fitted
        the same way (-inf if it is not logged or has too few points)."""
        v = getattr(agg, self.PARTNER)
        if v is None or not math.isfinite(v) or v <= 0 or len(self._partner) < self.warmup:
            return -math.inf
        base = fit_baseline([p[0] for p in self._partner], [p[1] for p in self._partner])
        # With few points, deflated as the partner's own test would be (its small-sample bound over its z_open).
        return (math.log(v) - base.level) / max(base.scale * max(1.0, SMALL_SAMPLE_Z.get(base.n, 0.0) / self.z_open),
                                                1e-12)

    def _rewind(self, step: int) -> list[Anomaly]:
        """Training went back to ``step`` (restart or rollback): forget the discarded timeline."""
        while self._hist and self._hist.steps[-1] >= step:
            self._hist.pop()
        self._last = self._fit() if len(self._hist) >= self.warmup else None
        self._skip_run = 0
        spike = self._spike
        if spike is None or step > spike.step:
            return []
        self._spike = None
        return [replace(spike, status=RESOLVED, end_step=self._last_elevated,
                        evidence={**spike.evidence, "recovered": False, "rolled_back": True},
                        message=spike.message.split(";")[0] + f"; training rolled back to step {step}")]

    def _settle(self, spike: Anomaly, cls: str, step: int, note: str, **extra) -> Anomaly:
        ev = {**spike.evidence, "recovery_class": cls, "recovered": cls != NOT_RECOVERED,
              "elevated_steps": self._last_elevated - spike.step + 1, **extra}
        sev = "critical" if cls == NOT_RECOVERED else spike.severity
        return replace(spike, status=RESOLVED, end_step=self._last_elevated if cls != NOT_RECOVERED else step,
                       severity=sev, evidence=ev, message=spike.message.split(";")[0] + "; " + note)

    # -- the detector ---------------------------------------------------------------------------------------
    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one step; return the anomaly states that changed (opened, settled)."""
        before = self._last
        out = self._update(agg)
        self._last_update = (agg, before, out)
        return out

    def _update(self, agg: StepAggregate) -> list[Anomaly]:
        out: list[Anomaly] = []
        if self._prev_step is not None and agg.step <= self._prev_step:
            out += self._rewind(agg.step)
        self._prev_step = agg.step
        self._skip_run = self._skip_run + 1 if agg.skipped else 0
        value = getattr(agg, self.FIELD)
        if value is None or not math.isfinite(value):
            return out
        if self._log and value <= 0:
            # A non-positive value: not cross-entropy; work on the raw values from here on.
            self._log = False
            old, self._hist = self._hist, _History(self.window)
            for st, v in zip(old.steps, old.ys, strict=True):
                self._hist.append(st, math.exp(v))
            self._spike = None
            self._tail.clear()
            self._last = self._fit() if len(self._hist) >= self.warmup else None
        x = math.log(value) if self._log else value  # the transformed value
        if self._spike is None:
            base = self._last
            if base is not None and agg.step - base.last > base.last - self._hist.steps[0]:
                # A point further from the window than the window is long (an excerpt's next block, a long
                # logging gap): the window does not describe its neighbourhood, and a jump there is a level
                # change across the gap, not a spike. The window starts again from it (warm-up again).
                self._hist.clear()
                self._last = base = None
            if base is None:
                self._accept(agg, x, None)
                return out
            # Opening is judged against the current level, not the trend extrapolated to this step: the
            # extrapolation only ever lowers the expectation, and a steep early decay decelerates.
            pred = base.level
            e = x - pred
            floor = math.log1p(self.min_rel_rise) if self._log else self.min_rel_rise  # self._rel, inline
            # Every threshold below is at least the relative floor: a point not above it (nearly all of them) is
            # accepted without computing them. (`not e <= floor` keeps a NaN floor ignored, as max() ignores it.)
            if not e <= floor:
                small = SMALL_SAMPLE_Z.get(base.n, 0.0)
                need = max(max(self.z_open, small) * base.scale, floor)
                tail, partner_z = None, -math.inf
                if e > max(max(self.corroborate_z, small) * base.scale, floor):
                    partner_z = self._partner_z(agg)
                    if partner_z >= self.partner_spike_z:
                        # The partner spikes at this very step (the grad norm with the loss, or the loss with the
                        # grad norm): this signal's own excursion needs only corroborate_z robust SDs to count with it.
                        need = max(max(self.corroborate_z, small) * base.scale, floor)
                    elif e > need:
                        # The alarm budget is per step: a point standing for several steps takes a larger share of it.
                        tail = self._tail.level(min(1.0, self.tail_risk * self._interval()))
                        if tail is not None and partner_z < self.corroborate_z:
                            need = max(need, tail * base.scale)
                if e > need:
                    self._open(agg, value, x, base, pred, need, tail, partner_z)
                    out.append(self._spike)
                    return out
            self._accept(agg, x, base)
            return out
        return out + self._follow(agg, value, x)

    def _open(self, agg: StepAggregate, value: float, x: float, base: Baseline, pred: float, need: float,
              tail: float | None, partner_z: float) -> None:
        expected = self._inv(pred)
        z = (x - pred) / base.scale
        ratio = value / expected if self._log and expected > 0 else float("nan")
        self._base = base
        self._last_elevated = agg.step
        self._elevated_points = 1
        self._back = None
        how = f"{ratio:.2f}x the expected {expected:.4g}" if self._log else f"above the expected {expected:.4g}"
        self._spike = Anomaly(
            kind=self.KIND, severity="warning", step=agg.step, gen=agg.gen,
            message=(f"{self.LABEL} {value:.4g} at step {agg.step} is {how} ({min(z, 999.0):.1f} robust SDs); "
                     f"watching whether it recovers"),
            evidence={self.FIELD: value, "baseline": expected, "z": z, "rise": ratio,
                      "threshold": math.exp(need) if self._log else need, "tail_z": tail,
                      "partner_z": partner_z if math.isfinite(partner_z) else None,
                      "peak": value, "peak_step": agg.step},
        )

    def _follow(self, agg: StepAggregate, value: float, x: float) -> list[Anomaly]:
        """One step while a spike is open: still elevated, settled, or not recovered."""
        base, spike = self._base, self._spike
        e = x - base.predict(agg.step)
        if e > max(self.z_close * base.scale, self._rel(self.close_rel)):
            self._back = None
            self._last_elevated = agg.step
            self._elevated_points += 1
            ev = dict(spike.evidence)
            if value > ev["peak"]:
                ev.update(peak=value, peak_step=agg.step)
            self._spike = spike = replace(spike, evidence=ev)  # kept, sent with the next transition
            open_for = agg.step - spike.step
            skipped = self.skipped_steps and self._skip_run >= self.skipped_steps
            if open_for >= self.divergence_steps or skipped:
                if skipped:
                    note = (f"the optimizer skipped {self._skip_run} steps in a row while it was up (fp16 overflow): "
                            f"not recovered")
                    done = self._settle(spike, NOT_RECOVERED, agg.step, note, recovery_steps=None,
                                        skipped_run=self._skip_run)
                else:
                    done = self._settle(spike, NOT_RECOVERED, agg.step,
                                        f"not recovered after {plural(open_for, 'step')} (now {value:.4g})",
                                        recovery_steps=None)
                # Restart the baseline at the new level.
                self._spike = None
                self._hist.clear()
                self._accept(agg, x, None)
                return [done]
            return []
        # Back: settled once two logged points in a row are back (one dip of a slow recovery is not the end).
        if self._back is None:
            self._back = agg.step
            return []
        rec = self._back - spike.step
        if rec <= self.fast_steps:
            cls, note = FAST, f"recovered after {plural(rec, 'step')} (fast)"
        elif self._elevated_points == 1:  # a sparse log: back at the very next logged point
            cls, note = FAST, f"recovered at the next logged point, {plural(rec, 'step')} later (fast: one point up)"
        else:
            cls, note = SLOW, f"recovered after {plural(rec, 'step')} (slow: more than {self.fast_steps})"
        done = self._settle(spike, cls, agg.step, note, recovery_steps=rec)
        self._spike = None
        self._accept(agg, x, None)
        return [done]


def _slope(steps: list[int], ys: list[float], first: int = 0) -> float:
    """Robust trend per step of the points from index ``first`` on: Tukey's resistant line, the slope between
    the medians of the first and last thirds of the points, ``(med y_R - med y_L) / (med step_R - med step_L)``.

    Medians make it resistant to outliers (a third of the points may be wild); the long baseline between
    the thirds makes it steady on noisy curves (slopes between close points measure noise, and the slope
    is then multiplied by distances of tens of steps); using step numbers makes irregular logs work (an
    excerpt of blocks of consecutive iterations thousands of steps apart). 0.0 for fewer than two points
    or no distance between the thirds.
    """
    n = len(ys)
    if n - first < 2:
        return 0.0
    k = max(1, (n - first) // 3)
    # statistics.median of each third, inline (this runs at every step): the middle value, or the mean of two.
    h = k // 2
    a, b = sorted(steps[first:first + k]), sorted(steps[n - k:])
    if k % 2:
        dx = b[h] - a[h]
        if dx <= 0:
            return 0.0
        a, b = sorted(ys[first:first + k]), sorted(ys[n - k:])
        return (b[h] - a[h]) / dx
    dx = (b[h - 1] + b[h]) / 2 - (a[h - 1] + a[h]) / 2
    if dx <= 0:
        return 0.0
    a, b = sorted(ys[first:first + k]), sorted(ys[n - k:])
    return ((b[h - 1] + b[h]) / 2 - (a[h - 1] + a[h]) / 2) / dx


def robust_scale(values: list[float]) -> float:
    """Robust standard deviation of a few to many values: 1.4826 x MAD, and for at most 20 values at
    least range / d2(n) (their MAD can be near zero by chance; the range is the steadier estimate there,
    and an outlier only makes it conservative).
    0.0 for fewer than two values.
    """
    return robust_scale_sorted(sorted(values))


def robust_scale_sorted(s: list[float]) -> float:
    """:func:`robust_scale` of values already in ascending order (the same float, without sorting them)."""
    n = len(s)
    if n < 2:
        return 0.0
    h = n // 2
    scale = MAD_TO_SIGMA * mad_sorted(s, s[h] if n % 2 else (s[h - 1] + s[h]) / 2)
    if n < len(D2) + 2:
        scale = max(scale, (s[-1] - s[0]) / D2[n - 2])
    return scale


def fit_baseline(steps: list[int], ys: list[float], sorted_ys: list[float] | None = None) -> Baseline:
    """The trailing baseline of points ``(steps[i], ys[i])``, steps increasing (see :class:`LossSpikeDetector`).

    ``sorted_ys`` (optional) is ``sorted(ys)``, to pass only when every value is a float other than ``-0.0`` (logs
    are): a window without a falling trend (slope 0, about half the steps of a real run) is then fitted from it
    without detrending, since detrending by 0 leaves such values unchanged bit for bit. Medians are taken from
    sorted lists with :func:`statistics.median`'s arithmetic, so the result is the same float either way.

    >>> steps = list(range(100, 150))
    >>> rising, falling = [math.log(2 + 0.001 * s + 0.01 * (s % 7)) for s in steps], [-0.01 * s for s in steps]
    >>> fit_baseline(steps, rising).slope, fit_baseline(steps, rising, sorted(rising)) == fit_baseline(steps, rising)
    (0.0, True)
    >>> fit_baseline(steps, falling, sorted(falling)) == fit_baseline(steps, falling)
    True
    """
    n = len(ys)
    # Trend and level from the newer half of the window: a loss curve is convex, and a trend fitted
    # over the whole window overshoots the current slope during the steep early decay.
    first = n // 2 if n >= 16 else 0  # thirds of at least 2-3 points
    slope = min(0.0, _slope(steps, ys, first))
    last = steps[-1]
    # The trend is extrapolated at most as far as the points it was fitted on span; points older than
    # that are detrended no further (across a log's gap the trend is unknown).
    span = max(last - steps[first], 1)
    if slope == 0.0 and sorted_ys is not None:
        detrended_sorted = sorted_ys
        newer = sorted(ys[first:])
    else:
        k = bisect.bisect_left(steps, last - span)
        c = slope * last
        shift = slope * span
        detrended_sorted = [y + shift for y in ys[:k]]
        detrended_sorted += [y - slope * st + c for st, y in zip(steps[k:], ys[k:], strict=True)]
        newer = sorted(detrended_sorted[first:])
        detrended_sorted.sort()
    h = len(newer) // 2
    level = newer[h] if len(newer) % 2 else (newer[h - 1] + newer[h]) / 2
    # The noise scale from the whole window (twice the points: a steadier MAD). A floor keeps z finite on a
    # perfectly flat baseline; the relative test decides there.
    scale = max(robust_scale_sorted(detrended_sorted), 1e-12 * max(1.0, abs(level)))
    return Baseline(last, level, slope, scale, span, n)


class _FitMemo:
    """The last few baselines fitted from log values, by the window's content.

    The pipeline's :class:`LossSpikeDetector` and the private one inside
    :class:`~detectors.divergence.DivergenceDetector` see the same loss window at every step: the second gets
    the first's fit instead of repeating it (two entries: the loss window and the grad-norm one, fitted in
    between). Windows are compared by value (list equality: C-speed, and it stops
    at the first difference, so a miss costs little); log values are floats and never ``-0.0``, so equal windows
    are bit-identical inputs and a hit returns exactly what fitting would. :class:`Baseline` is immutable, so
    sharing one is safe. The entry list is replaced, never mutated, so concurrent readers stay consistent.
    """

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._entries: tuple[tuple[list[int], list[float], Baseline], ...] = ()

    def fit(self, steps: list[int], ys: list[float], sorted_ys: list[float]) -> Baseline:
        """:func:`fit_baseline` of log values (floats, none ``-0.0``), ``sorted_ys`` = ``sorted(ys)``."""
        entries = self._entries
        for e_steps, e_ys, base in entries:
            if e_ys == ys and e_steps == steps:
                return base
        base = fit_baseline(steps, ys, sorted_ys)
        self._entries = ((steps.copy(), ys.copy(), base), *entries[:self.size - 1])
        return base


_FITS = _FitMemo()
