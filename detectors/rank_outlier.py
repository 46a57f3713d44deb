"""Rank outliers: a rank unlike the others in several ways at once (Isolation Forest over per-rank features)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace

import numpy as np

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.persistence import Persistence
from trainhealth.detectors.robust import MAD_TO_SIGMA
from trainhealth.detectors.slow_node import busy_matrix, column_quantiles
from trainhealth.wire import StepRecord

#: Per-rank features of a window, all oriented so that larger is worse.
FEATURES = ("busy_rel", "busy_iqr_rel", "data_share", "missing_rate")


def window_features(b: np.ndarray, data_s: np.ndarray, min_count: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank features of one window.

    Parameters
    ----------
    b : np.ndarray
        Busy seconds, shape ``(steps, ranks)``, NaN where a rank did not report.
    data_s : np.ndarray
        Seconds each rank spent in data-loading sections over the window, shape ``(ranks,)``.
    min_count : int
        Steps a rank must have reported to get features.

    Returns
    -------
    ranks : np.ndarray
        The ranks with features (int, shape ``(n,)``).
    x : np.ndarray
        Shape ``(n, 4)``, columns :data:`FEATURES`: median busy relative to the median rank's
        (0.1 = 10 % slower), the IQR of its busy seconds over their median (step-to-step
        variability), the fraction of its busy time in data loading, and the fraction of the
        window's steps it is missing from. Steps most ranks did not time are left out.

    Examples
    --------
    >>> b = np.array([[1.0, 1.0, 2.0], [1.0, np.nan, 2.0], [1.0, 1.0, 2.0], [1.0, 1.0, 2.0]])
    >>> ranks, x = window_features(b, np.array([0.4, 0.3, 0.8]))
    >>> ranks.tolist(), x.round(2).tolist()
    ([0, 1, 2], [[0.0, 0.0, 0.1, 0.0], [0.0, 0.0, 0.1, 0.25], [1.0, 0.0, 0.1, 0.0]])
    """
    active = np.count_nonzero(~np.isnan(b), axis=0) > 0
    n_active = int(active.sum())
    if n_active == 0:
        return np.empty(0, dtype=int), np.empty((0, len(FEATURES)))
    rows = np.count_nonzero(~np.isnan(b[:, active]), axis=1) * 2 >= n_active
    b = b[rows]
    counts = np.count_nonzero(~np.isnan(b), axis=0)
    ranks = np.flatnonzero(counts >= max(min_count, 1))
    if ranks.size == 0:
        return ranks, np.empty((0, len(FEATURES)))
    sub = b[:, ranks]
    med, q75, q25 = column_quantiles(sub, [0.5, 0.75, 0.25])
    total = np.nansum(sub, axis=0)
    typical = float(np.median(med))
    data = np.zeros(ranks.size)
    known = ranks < data_s.size
    data[known] = data_s[ranks[known]]
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.column_stack([
            med / typical - 1.0 if typical > 0 else np.zeros(ranks.size),
            np.where(med > 0, (q75 - q25) / med, 0.0),
            np.where(total > 0, data / total, 0.0),
            1.0 - counts[ranks] / max(b.shape[0], 1),
        ])
    return ranks, x


#: Steps of data-loading seconds held ahead of their window, in windows (1,280 steps at the default 20; only steps
#: with data-loading time are held): beyond it, the oldest half is dropped (steps that never closed: a crash).
_DATA_STEPS_KEPT = 64


class RankOutlierDetector(StepDetector):
    """Flags a rank that differs from the others in several ways at once, none enough for its own alarm.

    Every ``window`` complete steps each rank gets the features of :func:`window_features`
    (relative section time, its variability, data-loading share, missing steps). Each feature is
    put on a robust scale across ranks, ``z = (x - median) / max(1.4826 x MAD, floor)``, the floor
    keeping a job whose ranks are nearly identical from turning timer noise into large z. A rank
    is a candidate when it is worse than the median by ``z`` or more in at least
    ``min_features`` features; an Isolation Forest (scikit-learn, ``random_state`` fixed) fitted on
    the ranks' z vectors must confirm it, with an anomaly score ``s >= score`` (Liu et al.: ``s``
    near 1 is an anomaly, ``s <= 0.5`` everywhere means no distinct anomaly; scikit-learn's
    ``contamination="auto"`` cuts at 0.5). The forest is what judges the combination: a rank that
    belongs to a group of similar ranks is not isolated quickly and scores low. After
    ``min_windows`` flagged windows in a row the anomaly (warning) opens with its onset at the
    first one's first step; it stays open while the rank is still worse by ``z_close`` in
    ``min_features`` features (hysteresis, as the loss-spike detector's open/close thresholds) and
    resolves at the first window where it is not.

    An Isolation Forest always ranks some rank lowest, even in a perfectly healthy job: the
    false-alarm guard is the materiality gate (floors, several features, one-sided) plus
    persistence, not the forest's score alone. It needs ``min_ranks`` ranks (default 8) besides
    the excluded ones: a median, a MAD and a forest over fewer points are noise. Cost: one tuple
    append per step and a few dict look-ups per record; per window one NumPy pass (about 4 ms
    for 1,024 ranks). The forest (about 0.1 s for 100 trees) is fitted only when a new candidate
    appears, which a healthy job almost never has; its confirmation lasts while the rank stays a
    candidate (one fit per incident), and after a fit that leaves a candidate unconfirmed (a group
    of similar ranks) the next one waits ``min_windows`` windows.

    Parameters
    ----------
    window : int
        Steps per window.
    min_ranks : int
        Ranks with features needed to judge a window.
    z : float
        Robust z a feature must reach (in the worse direction) to count.
    z_close : float
        Robust z that keeps an open anomaly open.
    min_features : int
        Features that must reach ``z`` at once.
    floors : tuple of 4 floats
        Minimum scale of each feature (see :data:`FEATURES`): relative time, IQR/median, share,
        missing fraction.
    score : float
        Isolation Forest anomaly score ``s`` (``-score_samples``) a new candidate must reach.
    min_windows : int
        Consecutive flagged windows before opening.
    n_estimators, random_state : int
        Trees of the forest, and its fixed seed (deterministic replays).
    data_sections : tuple[str, ...]
        Section names counted as data loading.
    exclude : callable, optional
        Returns ranks already explained by another anomaly (open stragglers, ranks of slow
        nodes): left out of the window, and an open outlier anomaly of such a rank is resolved.

    Evidence: ``score`` (the isolation score ``s`` that confirmed the rank),
    ``z``, ``values`` and ``typical`` (per feature: robust z, the rank's value, the median rank's),
    ``n_ranks``, ``windows``.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(3)
    >>> det = RankOutlierDetector()
    >>> for step in range(200):
    ...     odd = step >= 60
    ...     busy = []
    ...     for r in range(16):
    ...         mild = odd and r == 13
    ...         fwd = 0.09 * (1.05 if mild else 1.0) * (1 + rng.gauss(0, 0.12 if mild else 0.03))
    ...         data = 0.01 * (2.0 if mild else 1.0) * (1 + rng.gauss(0, 0.1))
    ...         det.observe(StepRecord(rank=r, step=step, inc=0.0, t=float(step),
    ...                                sections={"data": data, "forward": fwd}))
    ...         busy.append(data + fwd)
    ...     a = StepAggregate(step, 0, 0.0, None, float(step), 1.0, 1.0, None, None, None, 16, tuple(busy), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.status, an.ranks, an.step, [f for f, v in an.evidence["z"].items() if v >= 3])
    rank_outlier active (13,) 60 ['busy_rel', 'busy_iqr_rel', 'data_share']

    References
    ----------
    F. T. Liu, K. M. Ting, Z.-H. Zhou, "Isolation Forest", ICDM 2008 (anomaly score
    ``s = 2^(-E[h(x)]/c(n))``); scikit-learn ``sklearn.ensemble.IsolationForest`` (``score_samples``
    is ``-s``; ``contamination="auto"`` uses the paper's 0.5 offset); C. Leys et al., "Detecting
    outliers: Do not use standard deviation around the mean, use absolute deviation around the
    median", J. Exp. Soc. Psychol. 2013 (MAD cut-offs 2.5-3).
    """

    def __init__(
        self,
        window: int = defaults.RANK_OUTLIER_WINDOW_STEPS,
        min_ranks: int = defaults.RANK_OUTLIER_MIN_RANKS,
        z: float = defaults.RANK_OUTLIER_Z,
        z_close: float = defaults.RANK_OUTLIER_Z_CLOSE,
        min_features: int = defaults.RANK_OUTLIER_MIN_FEATURES,
        floors: tuple[float, ...] = defaults.RANK_OUTLIER_FLOORS,
        score: float = defaults.RANK_OUTLIER_SCORE,
        min_windows: int = defaults.RANK_OUTLIER_MIN_WINDOWS,
        n_estimators: int = defaults.RANK_OUTLIER_TREES,
        random_state: int = defaults.RANK_OUTLIER_SEED,
        data_sections: tuple[str, ...] = defaults.DATA_SECTIONS,
        exclude: Callable[[], Collection[int]] | None = None,
    ) -> None:
        if len(floors) != len(FEATURES):
            raise ValueError(f"floors needs {len(FEATURES)} values ({', '.join(FEATURES)}), got {len(floors)}")
        self.window = window
        self.min_ranks = min_ranks
        self.z = z
        self.z_close = z_close
        self.min_features = min_features
        self.floors = floors
        self.score = score
        self.min_windows = min_windows
        self.n_estimators = n_estimators
        self.random_state = random_state
        self.data_sections = data_sections
        self.exclude = exclude
        self._rows: list[tuple[float | None, ...]] = []
        # step -> per-rank data-loading seconds of that step's records: a record is counted in its own step's window
        # whenever it arrives (the fast ranks' next steps arrive before the slow rank closes a step, and a service
        # catching up on a backlog reads one rank's many steps before another's).
        self._data: dict[int, list[float]] = {}
        self._window_start = 0
        self._last_step_prev_window = 0
        self._persist: Persistence[int] = Persistence(min_windows)
        self._confirmed: dict[int, float] = {}  # candidate rank -> isolation score that confirmed it
        self._cooldown = 0
        #: Windows in which the forest was fitted (a cost figure for benchmarks).
        self.forest_fits = 0

    def finish(self, step: int) -> list[Anomaly]:
        """Every rank ended at ``step``: resolve the open rank outliers (:func:`trainhealth.anomaly.run_ended`)
        and start afresh."""
        out = self._persist.finish(step)
        self._confirmed.clear()
        self._rows.clear()
        self._data.clear()
        return out

    def observe(self, rec: StepRecord) -> None:
        """Add one rank's record's data-loading seconds (the aggregate keeps only the max over ranks)."""
        sec = rec.sections
        d = 0.0
        for name in self.data_sections:
            v = sec.get(name)
            if v is not None:
                d += v
        self.observe_data(rec.rank, d, rec.step)

    def observe_data(self, rank: int, seconds: float, step: int) -> None:
        """Add seconds ``rank`` spent in data-loading sections in its record of ``step``, as :meth:`observe` sums
        them (the detector service passes the sum the aggregator's row already holds: the same number when a
        record has at most two such sections, as two floats add the same in either order)."""
        if seconds:
            per_rank = self._data.get(step)
            if per_rank is None:
                if len(self._data) >= _DATA_STEPS_KEPT * self.window:  # steps that never closed (a crash)
                    for k in sorted(self._data)[: len(self._data) // 2]:
                        del self._data[k]
                per_rank = self._data[step] = []
            if rank >= len(per_rank):
                per_rank += [0.0] * (rank + 1 - len(per_rank))
            per_rank[rank] += seconds

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one complete step; return anomaly states that changed (at window ends only)."""
        if not self._rows:
            self._window_start = agg.step
        self._rows.append(agg.busy)
        if len(self._rows) < self.window:
            return []
        b = busy_matrix(self._rows)
        # The window's steps' data seconds (those of later steps wait for their window; older ones are dropped).
        mine = [v for k, v in self._data.items() if self._window_start <= k <= agg.step]
        data = np.zeros(max((len(v) for v in mine), default=0))
        for v in mine:
            data[: len(v)] += v
        self._data = {k: v for k, v in self._data.items() if k > agg.step}
        self._rows.clear()
        out = self._judge_window(b, data, agg)
        self._last_step_prev_window = agg.step
        return out

    def _judge_window(self, b: np.ndarray, data: np.ndarray, agg: StepAggregate) -> list[Anomaly]:
        out: list[Anomaly] = []
        skip = frozenset(self.exclude()) if self.exclude is not None else frozenset()
        for r in [r for r in self._persist.tracked() if r in skip]:
            out += self._clear(r, "now explained by another anomaly (straggler or slow node)")
        if skip:
            keep = np.ones(b.shape[1], dtype=bool)
            keep[[r for r in skip if r < b.shape[1]]] = False
            b = np.where(keep, b, np.nan)
        ranks, x = window_features(b, data, max(3, self.window // 4))
        if ranks.size < self.min_ranks:
            return out
        med = np.median(x, axis=0)
        mad = np.median(np.abs(x - med), axis=0)
        z = (x - med) / np.maximum(MAD_TO_SIGMA * mad, np.asarray(self.floors, dtype=float))
        cand = np.count_nonzero(z >= self.z, axis=1) >= self.min_features
        still = np.count_nonzero(z >= self.z_close, axis=1) >= self.min_features
        idx = {int(r): i for i, r in enumerate(ranks.tolist())}
        # A forest confirmation lasts while the rank stays a candidate: one fit per incident, not per window.
        self._confirmed = {r: v for r, v in self._confirmed.items() if r in idx and cand[idx[r]]}
        opened = self._persist.open
        new = [r for r, i in idx.items() if cand[i] and r not in opened and r not in self._confirmed]
        if self._cooldown:
            self._cooldown -= 1
        elif new:
            from sklearn.ensemble import IsolationForest  # imported on first use: the service starts faster

            forest = IsolationForest(n_estimators=self.n_estimators, random_state=self.random_state)
            s = -forest.fit(z).score_samples(z)
            self.forest_fits += 1
            self._confirmed.update((r, round(float(s[idx[r]]), 4)) for r in new if s[idx[r]] >= self.score)
            if any(r not in self._confirmed for r in new):
                # Candidates the forest does not isolate (a group of similar ranks): do not refit every
                # window for them; retry after min_windows windows.
                self._cooldown = self.min_windows - 1
        flagged = {r for r, i in idx.items() if (still[i] if r in opened else r in self._confirmed)}
        for r in [r for r in self._persist.tracked() if r not in flagged]:
            out += self._clear(r, "back in line with the other ranks")
        for r in sorted(flagged):
            i = idx[r]
            ev = {"score": self._confirmed.get(r, opened[r].evidence["score"] if r in opened else None),
                  "z": {f: round(float(z[i, k]), 2) for k, f in enumerate(FEATURES)},
                  "values": {f: round(float(x[i, k]), 4) for k, f in enumerate(FEATURES)},
                  "typical": {f: round(float(med[k]), 4) for k, f in enumerate(FEATURES)},
                  "n_ranks": int(ranks.size)}
            out += self._persist.flag(r, self._window_start, ev, lambda onset, r=r, ev=ev: Anomaly(
                kind="rank_outlier", severity="warning", step=onset, ranks=(r,), gen=agg.gen, evidence=ev,
                message=self._message(r, onset, ev)))
        return out

    def _message(self, r: int, onset: int, ev: dict) -> str:
        v, t, z = ev["values"], ev["typical"], ev["z"]
        words = {
            "busy_rel": f"sections {v['busy_rel'] * 100:+.0f}% vs the median rank",
            "busy_iqr_rel": f"step-to-step spread {v['busy_iqr_rel']:.2f} vs {t['busy_iqr_rel']:.2f} (IQR/median)",
            "data_share": f"data loading {v['data_share'] * 100:.0f}% of its time vs {t['data_share'] * 100:.0f}%",
            "missing_rate": f"missing from {v['missing_rate'] * 100:.0f}% of steps vs {t['missing_rate'] * 100:.0f}%",
        }
        odd = "; ".join(words[f] for f in FEATURES if z[f] >= self.z)
        return (f"rank {r} differs from the other {ev['n_ranks'] - 1} ranks in several ways at once since step "
                f"{onset} (isolation score {ev['score']:.2f}): {odd}; none alone is a straggler: check its data "
                "loader, CPU affinity and GPU")

    def _clear(self, r: int, why: str) -> list[Anomaly]:
        cur = self._persist.clear(r)
        if cur is None:
            return []
        end = self._last_step_prev_window
        return [replace(cur, status=RESOLVED, end_step=end,
                        message=f"rank {r} was an outlier from step {cur.step} to {end}; {why}")]
