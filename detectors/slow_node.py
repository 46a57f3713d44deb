"""Slow nodes: most ranks of one host slow together, reported once for the host."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.persistence import Persistence


def busy_matrix(rows: Sequence[Sequence[float | None]]) -> np.ndarray:
    """Stack steps' per-rank busy seconds into a float array, ``None`` as NaN.

    Parameters
    ----------
    rows : sequence of sequences
        One ``StepAggregate.busy`` tuple per step (index = rank); lengths may differ when the
        world size grew.

    Returns
    -------
    np.ndarray
        Shape ``(steps, ranks)``, seconds; NaN where a rank did not report.

    Examples
    --------
    >>> busy_matrix([(0.1, None), (0.2, 0.3, 0.4)]).tolist()
    [[0.1, nan, nan], [0.2, 0.3, 0.4]]
    """
    width = max((len(r) for r in rows), default=0)
    if all(len(r) == width for r in rows):
        return np.array(rows, dtype=float).reshape(len(rows), width)
    return np.array([tuple(r) + (None,) * (width - len(r)) for r in rows], dtype=float)


def column_quantiles(b: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Quantiles of each column of ``b`` ignoring NaN (NumPy's default linear interpolation).

    One sort for all quantiles: ``np.nanpercentile`` loops over columns in Python, which costs
    ~150 ms on a 20 x 1,024 window; this takes ~1 ms.

    Parameters
    ----------
    b : np.ndarray
        Shape ``(steps, ranks)``; every column must hold at least one value.
    qs : sequence of float
        Quantiles in [0, 1].

    Returns
    -------
    np.ndarray
        Shape ``(len(qs), ranks)``.

    Examples
    --------
    >>> column_quantiles(np.array([[1.0, 4.0], [3.0, np.nan], [2.0, 2.0], [9.0, np.nan]]), [0.5, 0.25]).tolist()
    [[2.5, 3.0], [1.75, 2.5]]
    """
    srt = np.sort(b, axis=0)  # NaN last
    last = np.count_nonzero(~np.isnan(b), axis=0) - 1
    cols = np.arange(b.shape[1])
    out = np.empty((len(qs), b.shape[1]))
    for k, q in enumerate(qs):
        pos = q * last
        lo = np.floor(pos).astype(int)
        hi = np.minimum(lo + 1, last)
        out[k] = srt[lo, cols] + (pos - lo) * (srt[hi, cols] - srt[lo, cols])
    return out


def rank_medians(b: np.ndarray, min_count: int) -> tuple[np.ndarray, np.ndarray]:
    """Median of each rank's column of ``b`` (shape ``(steps, ranks)``), over ranks with at least
    ``min_count`` values; returns ``(ranks, medians)`` (int and float arrays, seconds)."""
    counts = np.count_nonzero(~np.isnan(b), axis=0)
    ranks = np.flatnonzero(counts >= max(min_count, 1))
    return ranks, column_quantiles(b[:, ranks], [0.5])[0] if ranks.size else np.empty(0)


class SlowNodeDetector(StepDetector):
    """Flags a host most of whose ranks are slow together, as one anomaly for the host.

    A slow node (GPU clocks throttled by heat or power, a degraded PCIe/NVLink switch, a busy
    host CPU or a noisy neighbour) makes all or most of its ranks slow at once; reporting the node
    instead of each of its ranks says where to act (drain it). Every ``window`` complete steps each
    rank gets the straggler detector's NVRx relative score ``score_r = min_k m_k / m_r`` (``m`` =
    the rank's median busy seconds in the window). A host with at least ``min_ranks`` ranks
    reporting is slow in the window when more than ``fraction`` of them score below
    ``threshold`` (and are ``min_excess_s`` slower than the best rank); after ``min_windows``
    slow windows in a row the anomaly (warning) opens with its onset at the first one's first
    step, and it resolves at the first window where the host is not slow. A second host with
    data is required: on a single host there is nothing to compare a node with.

    Interaction with :class:`~trainhealth.detectors.straggler.StragglerDetector`: it runs before the
    straggler detector, whose ``exclude`` is :meth:`covered_ranks` (the ranks of hosts with an
    open slow-node anomaly), so a slow node is one ``slow_node`` anomaly, not one ``straggler``
    per rank; with the same window and no more windows of persistence, the node opens in the
    window its ranks would have become stragglers. A rank that was already a straggler when its
    whole node became slow has its straggler anomaly resolved ("now part of a slow node").

    Parameters
    ----------
    hosts : Mapping[int, str] | None
        Rank -> host name; read at every window (the pipeline's live map from ``run_start``
        events). Ranks without a host are left to the straggler detector.
    window : int
        Steps per scoring window (as the straggler detector's, so their windows coincide).
    threshold : float
        Relative score below which a rank is slow: 0.8 (~1.25x slower than the fastest rank), stricter
        than NVRx / NeMo's default 0.7 (~1.43x) because a 30 % slower rank costs a synchronous job 30 %
        of its throughput (see ``trainhealth.defaults.STRAGGLER_THRESHOLD``).
    fraction : float
        A host is slow when more than this fraction of its reporting ranks are slow.
    min_ranks : int
        Ranks with data a host needs to be judged as a node.
    min_windows : int
        Consecutive slow windows before flagging.
    min_excess_s : float
        Minimum seconds a rank's median must exceed the best rank's to count as slow.

    Evidence: ``node_score`` (median score of the host's ranks), ``node_median_s`` (median of
    their medians), ``best_median_s``, ``typical_median_s`` (median over all ranks),
    ``slow_ranks`` / ``n_ranks`` (ranks slow / reporting), ``ranks`` and ``rank_scores`` (aligned
    lists), ``windows``.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(2)
    >>> hosts = {r: "node-a" if r < 8 else "node-b" for r in range(16)}
    >>> det = SlowNodeDetector(hosts)
    >>> for step in range(200):
    ...     busy = tuple(0.1 * (1.5 if r >= 8 and 40 <= step < 120 else 1.0) + rng.uniform(0, 0.005)
    ...                  for r in range(16))
    ...     a = StepAggregate(step, 0, 0.0, None, float(step), 1.0, 1.0, None, None, None, 16, busy, 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.status, an.id, an.step, an.end_step, round(an.evidence["node_score"], 2))
    slow_node active slow_node:node-b:40:0 40 None 0.66
    slow_node resolved slow_node:node-b:40:0 40 119 0.99

    References
    ----------
    NVIDIA Resiliency Extension, straggler detection usage guide (relative performance score;
    its reports name each straggler's rank and node); NeMo ``StragglerDetectionCallback``
    (``gpu_relative_perf_threshold``, default 0.7; ours 0.8, see ``threshold``).
    """

    def __init__(
        self,
        hosts: Mapping[int, str] | None = None,
        window: int = defaults.STRAGGLER_WINDOW_STEPS,
        threshold: float = defaults.STRAGGLER_THRESHOLD,
        fraction: float = defaults.SLOW_NODE_FRACTION,
        min_ranks: int = defaults.SLOW_NODE_MIN_RANKS,
        min_windows: int = defaults.SLOW_NODE_MIN_WINDOWS,
        min_excess_s: float = defaults.STRAGGLER_MIN_EXCESS_S,
    ) -> None:
        self.hosts = hosts if hosts is not None else {}
        self.window = window
        self.threshold = threshold
        self.fraction = fraction
        self.min_ranks = min_ranks
        self.min_windows = min_windows
        self.min_excess_s = min_excess_s
        self._rows: list[tuple[float | None, ...]] = []
        self._window_start = 0
        self._last_step_prev_window = 0
        self._persist: Persistence[str] = Persistence(min_windows)

    def finish(self, step: int) -> list[Anomaly]:
        """Every rank ended at ``step``: resolve the open slow nodes (:func:`trainhealth.anomaly.run_ended`)
        and start afresh."""
        out = self._persist.finish(step)
        self._rows.clear()
        return out

    def covered_ranks(self) -> frozenset[int]:
        """Ranks of the hosts with an open slow-node anomaly (for the straggler detector to skip)."""
        return frozenset(r for a in self._persist.open.values() for r in a.ranks)

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one complete step; return anomaly states that changed (at window ends only).

        Per step this only appends the busy tuple; the scoring is one NumPy pass per window.
        """
        if not self._rows:
            self._window_start = agg.step
        self._rows.append(agg.busy)
        if len(self._rows) < self.window:
            return []
        b = busy_matrix(self._rows)
        self._rows.clear()
        out = self._judge_window(b, agg)
        self._last_step_prev_window = agg.step
        return out

    def _judge_window(self, b: np.ndarray, agg: StepAggregate) -> list[Anomaly]:
        ranks, med = rank_medians(b, self.window // 2)
        if ranks.size < 2:
            return []
        best = float(med.min())
        scores = np.where(med > 0, best / np.where(med > 0, med, 1.0), 1.0)
        slow = ((scores < self.threshold) & (med - best >= self.min_excess_s)).tolist()
        nodes: dict[str, list[int]] = {}
        hosts = self.hosts
        for i, r in enumerate(ranks.tolist()):
            h = hosts.get(r)
            if h is not None:
                nodes.setdefault(h, []).append(i)
        if len(nodes) < 2:
            return []
        out: list[Anomaly] = []
        typical = float(np.median(med))
        for host in sorted(nodes):
            idx = nodes[host]
            if len(idx) < self.min_ranks:
                continue
            n_slow = sum(slow[i] for i in idx)
            is_slow = n_slow > self.fraction * len(idx)
            if not (is_slow or self._persist.counting(host)):
                continue  # nothing to start, extend or end: the common case costs no evidence
            sc = [float(scores[i]) for i in idx]
            ev = {
                "node_score": round(statistics.median(sc), 4),
                "node_median_s": round(statistics.median(float(med[i]) for i in idx), 6),
                "best_median_s": round(best, 6), "typical_median_s": round(typical, 6),
                "slow_ranks": n_slow, "n_ranks": len(idx),
                "ranks": [int(ranks[i]) for i in idx], "rank_scores": [round(x, 4) for x in sc],
            }
            out += self._judge(host, is_slow, ev, agg)
        return out

    def _judge(self, host: str, slow: bool, ev: dict, agg: StepAggregate) -> list[Anomaly]:
        if slow:
            return self._persist.flag(host, self._window_start, ev, lambda onset: Anomaly(
                kind="slow_node", severity="warning", step=onset, ranks=tuple(ev["ranks"]), gen=agg.gen,
                evidence=ev, scope=host,
                message=(f"node {host} is slow: {ev['slow_ranks']} of its {ev['n_ranks']} ranks score below "
                         f"{self.threshold} (node score {ev['node_score']:.2f}: sections take "
                         f"{ev['node_median_s'] * 1e3:.1f} ms vs {ev['best_median_s'] * 1e3:.1f} ms on the fastest "
                         f"rank) since step {onset}; a node-level cause (GPU clocks/thermals, PCIe/NVLink, host "
                         "CPU): the whole job waits for it, drain or replace the node")))
        cur = self._persist.clear(host)
        if cur is None:
            return []
        end = self._last_step_prev_window
        return [replace(cur, status=RESOLVED, end_step=end, evidence={**cur.evidence, "node_score": ev["node_score"]},
                        message=(f"node {host} was slow from step {cur.step} to {end}; back to node score "
                                 f"{ev['node_score']:.2f}"))]
