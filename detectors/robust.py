"""Rolling robust statistics shared by the loss, grad-norm, timing and rank detectors.

Every detector judges each step against medians and MADs of a trailing window of 50-2000 points; the helpers
here give the same floats, bit for bit, as :mod:`statistics` on the whole window, from a window kept sorted as
it slides (recomputing them, a sort per statistic per step, was most of the pipeline's cost per step).

- :class:`SortedWindow`: a sliding window with O(1) median and O(log n) MAD.
- :func:`robust_scale`, :func:`robust_scale_sorted`: 1.4826 x MAD, floored by range / d2(n) on few points.
- :class:`Baseline`, :func:`fit_baseline`, :class:`History`: a detrended trailing level and noise scale.
- :class:`Tail`: the peaks-over-threshold level a stream of residuals exceeds with a given probability.

References
----------
.. [1] P. J. Rousseeuw and C. Croux, "Alternatives to the median absolute deviation", JASA 88, 1993.
.. [2] A. Siffer et al., "Anomaly Detection in Streams with Extreme Value Theory", KDD 2017.
.. [3] J. W. Tukey, "Exploratory Data Analysis", 1977 (the resistant line).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

#: Consistency constant making the MAD estimate the standard deviation of normal data (Rousseeuw & Croux 1993).
MAD_TO_SIGMA = 1.4826
#: Expected range of n = 2..20 standard normal draws, d2(n) (control-chart constants; ASTM STP 15D,
#: D. C. Montgomery, "Introduction to Statistical Quality Control", table VI): sigma ~ range / d2(n).
D2 = (1.128, 1.693, 2.059, 2.326, 2.534, 2.704, 2.847, 2.970, 3.078, 3.173, 3.258, 3.336, 3.407, 3.472, 3.532,
      3.588, 3.640, 3.689, 3.735)
#: The z a new point must exceed for a one-sided 1e-4 false-alarm rate when the scale itself is estimated from n
#: points (n = 3..50, the loss-spike window's sizes): the Student-t prediction bound t_{n-1}(1 - 1e-4) * sqrt(1 + 1/n).
#: Values from scipy.stats.t.ppf; beyond 50 points, STUDENT_Z_LIMIT (the normal quantile, 3.72).
STUDENT_Z = {3: 81.64, 4: 24.82, 5: 14.28, 6: 10.45, 7: 8.58, 8: 7.49, 9: 6.79, 10: 6.3, 11: 5.95, 12: 5.68,
             13: 5.46, 14: 5.29, 15: 5.15, 16: 5.03, 17: 4.93, 18: 4.84, 19: 4.77, 20: 4.7, 21: 4.65, 22: 4.59,
             23: 4.55, 24: 4.51, 25: 4.47, 26: 4.43, 27: 4.4, 28: 4.37, 29: 4.35, 30: 4.32, 31: 4.3, 32: 4.28,
             33: 4.26, 34: 4.24, 35: 4.23, 36: 4.21, 37: 4.2, 38: 4.18, 39: 4.17, 40: 4.16, 41: 4.14, 42: 4.13,
             43: 4.12, 44: 4.11, 45: 4.1, 46: 4.09, 47: 4.08, 48: 4.08, 49: 4.07, 50: 4.06}
STUDENT_Z_LIMIT = 3.72
#: Small windows: STUDENT_Z for n = 3..9, where it is above LOSS_SPIKE_Z_OPEN (from 10 points on it is below).
SMALL_SAMPLE_Z = {n: z for n, z in STUDENT_Z.items() if n <= 9}


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


class Tail:
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

    @property
    def ready(self) -> bool:
        """Whether ``min_points`` residuals are in (before that :meth:`level` is None: the stream's tail is unknown)."""
        return len(self._vals) >= self.min_points

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


class History:
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


def resistant_slope(steps: list[int], ys: list[float], first: int = 0) -> float:
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
    slope = min(0.0, resistant_slope(steps, ys, first))
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


class FitMemo:
    """The last few baselines fitted from log values, by the window's content.

    The pipeline's :class:`LossSpikeDetector` and the private one inside
    :class:`~trainhealth.detectors.divergence.DivergenceDetector` see the same loss window at every step: the
    second gets the first's fit instead of repeating it (two entries: the loss window and the grad-norm one, fitted in
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


_FITS = FitMemo()
