"""Network trouble on one node: its ranks spend a larger share of the step in communication than the other nodes'."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.persistence import Persistence
from trainhealth.detectors.slow_node import busy_matrix, rank_medians
from trainhealth.text import fmt_pct, fmt_ranks


def collective_seconds(busy: np.ndarray, comm: np.ndarray, step_s: np.ndarray) -> np.ndarray:
    """Each rank's seconds in the collective itself, per step: its time outside its own sections less its wait for
    the slowest rank.

    Parameters
    ----------
    busy : np.ndarray
        Shape ``(steps, ranks)``: seconds in the rank's own sections, the collective left out
        (:attr:`StepAggregate.busy`); NaN where the rank did not report.
    comm : np.ndarray
        Same shape: seconds in the rank's communication sections (:attr:`StepAggregate.comm`,
        :data:`~trainhealth.defaults.COMM_SECTIONS`); NaN where the rank did not time its collective.
    step_s : np.ndarray
        Shape ``(steps,)``: the step's wall time (s); NaN when unknown.

    Returns
    -------
    np.ndarray
        Shape ``(steps, ranks)``, seconds, NaN where unknown. The straggler wait of rank ``r`` is the slowest rank's
        busy seconds minus its own (it reaches the collective that much earlier and waits there). A rank that timed
        its collective: that section's seconds minus the wait (at least 0). A rank that did not: the rest of the
        step, ``step_s - busy - wait = step_s - slowest busy`` (at least 0), the same for every such rank: the job's
        collective, which names no node.

    Examples
    --------
    Rank 1 is 0.3 s slower: rank 0 waits 0.3 s of its 0.5 s collective section, rank 1 none of its 0.2 s; rank 2
    did not time its collective (step 1.0 s, the slowest rank's sections 0.8 s):

    >>> collective_seconds(np.array([[0.5, 0.8, 0.6]]), np.array([[0.5, 0.2, np.nan]]), np.array([1.0])).round(3)
    array([[0.2, 0.2, 0.2]])
    """
    with np.errstate(invalid="ignore"):
        slowest = np.nanmax(np.where(np.isnan(busy), -np.inf, busy), axis=1, keepdims=True)
        slowest = np.where(np.isfinite(slowest), slowest, np.nan)
        wait = np.clip(slowest - busy, 0.0, None)
        timed = np.clip(comm - np.nan_to_num(wait, nan=0.0), 0.0, None)
        rest = np.clip(step_s[:, None] - slowest, 0.0, None) + np.zeros_like(busy)
        rest = np.where(np.isnan(busy), np.nan, rest)
    return np.where(np.isnan(comm), rest, timed)


class NetworkDetector(StepDetector):
    """Flags a node whose ranks spend a larger share of the step in communication than the other nodes' ranks: its
    network (NIC, InfiniBand/RoCE link, switch port) is slow.

    Per step and rank, the time outside the rank's own timed sections splits into the wait for the slowest rank
    (straggler wait: the slowest rank's sections minus its own) and the collective itself, the rest
    (:func:`collective_seconds`: the rank's timed communication sections less its wait, or, for a rank that does not
    time its collective, the step's time less the slowest rank's sections). A slow rank makes the others wait, not
    communicate: its wait is taken out, so a straggler or slow node is never a network anomaly. Every ``window``
    complete steps each rank gets its median communication share (collective seconds / step seconds); a node's share
    is the median of its ranks'. A rank is high when its share is at least ``ratio`` times the median share of the
    other nodes and ``min_excess`` of the step above it; a node with at least ``min_ranks`` ranks reporting, more
    than ``fraction`` of them high, is flagged in the window, and after ``min_windows`` windows in a row the anomaly
    opens (onset: the first such window's first step). It resolves at the first window where the node is not
    flagged.

    The reference is the other nodes: a rise every node shares (the whole job's collectives slower: a congested
    fabric, a larger model, a changed NCCL setting) is not this node's, and not flagged here; its cost shows as a
    longer step, which :class:`~trainhealth.detectors.throughput.ThroughputDropDetector` reports. Nor is a job on
    one node judged (nothing to compare with), nor ranks without a host. A collective that every rank waits
    through alike (one ring over all nodes) shows on all nodes: the node is told apart when its own ranks' timed
    collectives take longer — their sends through its NIC, hierarchical collectives whose inter-node step its ranks
    do, CUDA-event timings of their NCCL kernels. Ranks that do not time their collective all get the job's rest of
    the step, which names no node.

    Severity follows the badput: every rank waits for the slowest collective, so the node costs the job its excess
    share of each step (``excess_share`` = node share - others' share): ``warning`` from ``warning_share``, else
    ``info`` (re-judged while open; a change of severity is a transition).

    Parameters
    ----------
    hosts : Mapping[int, str] | None
        Rank -> host name, read at every window (the pipeline's live map from ``run_start`` events).
    window : int
        Steps per scoring window (the straggler detector's).
    ratio : float
        A rank's share at least this times the other nodes' median share is high.
    min_excess : float
        ...and at least this much of the step (a fraction) above it.
    fraction : float
        A node is flagged when more than this fraction of its reporting ranks are high.
    min_ranks : int
        Ranks with data a node needs to be judged.
    min_windows : int
        Consecutive flagged windows before opening.
    warning_share : float
        Excess share of the step (the job's time lost) from which the anomaly is a warning.

    Evidence: ``node_share``, ``others_share`` (fractions of the step), ``excess_share``, ``node_comm_s``,
    ``others_comm_s`` (median seconds in the collective a step), ``step_s`` (median step seconds), ``high_ranks`` /
    ``n_ranks``, ``ranks`` and ``rank_shares`` (aligned), ``timed_ranks`` (of the node's ranks, those that time
    their collective), ``windows``; once resolved, the last flagged window's, with ``recovered_share`` and
    ``recovered_others_share`` (the shares of the window it was back in).

    Examples
    --------
    16 ranks on two nodes, 1 s steps; node-b's collective takes 0.4 s instead of 0.1 s from step 40 to 119:

    >>> hosts = {r: "node-a" if r < 8 else "node-b" for r in range(16)}
    >>> det = NetworkDetector(hosts)
    >>> for step in range(200):
    ...     busy = tuple(0.8 + 0.001 * ((step * 7 + r) % 5) for r in range(16))
    ...     comm = tuple((0.4 if r >= 8 and 40 <= step < 120 else 0.1) + 0.004 + max(busy) - b
    ...                  for r, b in enumerate(busy))
    ...     a = StepAggregate(step, 0, 0.0, step - 1.0, float(step), None, None, None, None, None, 16, busy, 0.0,
    ...                       comm=comm)
    ...     for an in det.update(a):
    ...         print(an.kind, an.severity, an.status, an.id, an.step, an.end_step,
    ...               round(an.evidence["node_share"], 3), round(an.evidence["others_share"], 3))
    network_slow warning active network_slow:node-b:40:0 40 None 0.404 0.104
    network_slow warning resolved network_slow:node-b:40:0 40 119 0.404 0.104

    References
    ----------
    Jiang et al., "MegaScale: Scaling Large Language Model Training to More Than 10,000 GPUs", NSDI 2024 (sec. 4:
    network faults localised to a node by comparing nodes' communication timings and NCCL tests between neighbours).
    NVIDIA Resiliency Extension, straggler detection usage guide (the relative score whose 0.8 threshold gives
    ``ratio``). The straggler wait as the ledger books it:
    :meth:`trainhealth.detectors.ledger.GoodputLedger._split_step`.
    """

    def __init__(
        self,
        hosts: Mapping[int, str] | None = None,
        window: int = defaults.STRAGGLER_WINDOW_STEPS,
        ratio: float = defaults.NETWORK_RATIO,
        min_excess: float = defaults.NETWORK_MIN_EXCESS,
        fraction: float = defaults.SLOW_NODE_FRACTION,
        min_ranks: int = defaults.SLOW_NODE_MIN_RANKS,
        min_windows: int = defaults.NETWORK_MIN_WINDOWS,
        warning_share: float = defaults.THROUGHPUT_WARNING_LOSS,
    ) -> None:
        self.hosts = hosts if hosts is not None else {}
        self.window = window
        self.ratio = ratio
        self.min_excess = min_excess
        self.fraction = fraction
        self.min_ranks = min_ranks
        self.min_windows = min_windows
        self.warning_share = warning_share
        self._reset()

    def _reset(self) -> None:
        self._busy: list[tuple[float | None, ...]] = []
        self._comm: list[tuple[float | None, ...]] = []
        self._step_s: list[float] = []
        self._gen = 0
        self._window_start = 0
        self._last_step_prev_window = 0
        self._persist: Persistence[str] = Persistence(self.min_windows)

    def _clear_window(self) -> None:
        self._busy.clear()
        self._comm.clear()
        self._step_s.clear()

    @property
    def open(self) -> list[Anomaly]:
        """The open anomalies."""
        return list(self._persist.open.values())

    def finish(self, step: int) -> list[Anomaly]:
        """Every rank ended at ``step``: resolve the open anomalies (:func:`trainhealth.anomaly.run_ended`) and start
        afresh."""
        out = self._persist.finish(step)
        self._reset()
        return out

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one complete step; return the anomaly states that changed (at window ends only).

        A step a declared pause fell in (a checkpoint save, an evaluation) is left out: its time is the pause's.
        """
        if agg.gen != self._gen:  # a restart: the new launch's steps are a new window
            self._clear_window()
            self._gen = agg.gen
        if agg.pause is not None:
            return []
        dur = agg.dur if agg.dur is not None else agg.step_s
        if not self._busy:
            self._window_start = agg.step
        self._busy.append(agg.busy)
        self._comm.append(agg.comm)  # () when no rank timed a collective: NaN at the window
        self._step_s.append(dur if dur is not None and dur > 0 else np.nan)
        if len(self._busy) < self.window:
            return []
        b = busy_matrix(self._busy)
        c = busy_matrix([row or (None,) * b.shape[1] for row in self._comm]) if any(self._comm) else \
            np.full(b.shape, np.nan)
        width = max(b.shape[1], c.shape[1])
        b, c = _widen(b, width), _widen(c, width)
        d = np.array(self._step_s, dtype=float)
        self._clear_window()
        out = self._judge_window(b, c, d, agg)
        self._last_step_prev_window = agg.step
        return out

    def _judge_window(self, b: np.ndarray, c: np.ndarray, d: np.ndarray, agg: StepAggregate) -> list[Anomaly]:
        if np.isnan(d).all():
            return []
        coll = collective_seconds(b, c, d)
        ranks, shares = rank_medians(coll / d[:, None], self.window // 2)
        if ranks.size < 2:
            return []
        _, secs = rank_medians(coll[:, ranks], self.window // 2)
        timed = np.count_nonzero(~np.isnan(c[:, ranks]), axis=0) > 0
        nodes: dict[str, list[int]] = {}
        for i, r in enumerate(ranks.tolist()):
            h = self.hosts.get(r)
            if h is not None:
                nodes.setdefault(h, []).append(i)
        nodes = {h: idx for h, idx in nodes.items() if len(idx) >= self.min_ranks}
        if len(nodes) < 2:
            return self._resolve_all(nodes)
        # Plain floats and one sort: a 1,024-rank job has 128 nodes to compare each with the 127 others.
        sh, se = shares.tolist(), secs.tolist()
        node_share = {h: statistics.median([sh[i] for i in idx]) for h, idx in nodes.items()}
        node_secs = {h: statistics.median([se[i] for i in idx]) for h, idx in nodes.items()}
        shares_sorted, secs_sorted = sorted(node_share.values()), sorted(node_secs.values())
        step_s = float(np.nanmedian(d))
        out: list[Anomaly] = []
        for host in sorted(nodes):
            idx = nodes[host]
            others = _median_without(shares_sorted, node_share[host])
            high = [sh[i] >= self.ratio * others and sh[i] - others >= self.min_excess for i in idx]
            flagged = sum(high) > self.fraction * len(idx)
            if not (flagged or self._persist.counting(host)):
                continue
            ev = {
                "node_share": round(node_share[host], 4), "others_share": round(others, 4),
                "excess_share": round(node_share[host] - others, 4),
                "node_comm_s": round(node_secs[host], 6),
                "others_comm_s": round(_median_without(secs_sorted, node_secs[host]), 6),
                "step_s": round(step_s, 6), "high_ranks": sum(high), "n_ranks": len(idx),
                "ranks": [int(ranks[i]) for i in idx], "rank_shares": [round(sh[i], 4) for i in idx],
                "timed_ranks": int(sum(bool(timed[i]) for i in idx)),
            }
            out += self._judge(host, flagged, ev, agg)
        return out

    def _severity(self, ev: dict) -> str:
        return "warning" if ev["excess_share"] >= self.warning_share else "info"

    def _judge(self, host: str, flagged: bool, ev: dict, agg: StepAggregate) -> list[Anomaly]:
        if flagged:
            before = self._persist.open.get(host)
            out = self._persist.flag(host, self._window_start, ev, lambda onset: Anomaly(
                kind="network_slow", severity=self._severity(ev), step=onset, ranks=tuple(ev["ranks"]), gen=agg.gen,
                evidence=ev, scope=host, message=self._message(host, ev, onset)))
            if before is not None and before.severity != self._severity(ev):
                cur = self._persist.open[host]
                cur = self._persist.open[host] = replace(cur, severity=self._severity(ev),
                                                         message=self._message(host, ev, cur.step))
                out.append(cur)
            return out
        cur = self._persist.clear(host)
        if cur is None:
            return []
        end = self._last_step_prev_window
        # The evidence stays the last flagged window's (what it cost); the shares it came back to beside it.
        ev_end = {**cur.evidence, "recovered_share": ev["node_share"], "recovered_others_share": ev["others_share"]}
        return [replace(cur, status=RESOLVED, end_step=end, evidence=ev_end, message=(
            f"{host}'s ranks spent more of the step in communication than the other nodes' from step {cur.step} to "
            f"{end}; back to {fmt_pct(100 * ev['node_share'])} vs {fmt_pct(100 * ev['others_share'])} on the other "
            "nodes"))]

    def _resolve_all(self, nodes: Mapping[str, list[int]]) -> list[Anomaly]:
        # Fewer than two nodes left to compare (ranks stopped reporting): what is open cannot be judged any more.
        out = []
        for host in self._persist.tracked():
            cur = self._persist.clear(host)
            if cur is not None:
                out.append(replace(cur, status=RESOLVED, end_step=self._last_step_prev_window,
                                   message=f"{cur.message}; no other node to compare with any more"))
        return out

    @staticmethod
    def _message(host: str, ev: dict, onset: int) -> str:
        lost_ms = (ev["node_comm_s"] - ev["others_comm_s"]) * 1e3
        untimed = ev["n_ranks"] - ev["timed_ranks"]
        note = (f" ({untimed} of its ranks do not time their collective: theirs is the rest of the step)"
                if untimed else "")
        return (f"{host} (ranks {fmt_ranks(ev['ranks'])}): {fmt_pct(100 * ev['node_share'])} of step time in "
                f"communication vs {fmt_pct(100 * ev['others_share'])} on the other nodes since step {onset} "
                f"({ev['high_ranks']} of its {ev['n_ranks']} ranks; {lost_ms:.1f} ms more a step, "
                f"{fmt_pct(100 * ev['excess_share'])} of the job's time: every rank waits for the slowest "
                f"collective){note}; its network, not its GPUs: check the node's NIC / InfiniBand link (`ibstat`: "
                "state Active, the expected rate; `ibv_devinfo`, link error counters), rerun with NCCL_DEBUG=INFO to "
                "see the transport it picked (a fall-back to sockets or a missing GPUDirect RDMA), and compare "
                f"`ib_write_bw` from {host} with a healthy node's")


def _widen(m: np.ndarray, width: int) -> np.ndarray:
    """``m`` padded with NaN columns to ``width`` (the world grew within the window)."""
    if m.shape[1] >= width:
        return m
    return np.hstack([m, np.full((m.shape[0], width - m.shape[1]), np.nan)])


def _median_without(values: list[float], v: float) -> float:
    """The median of sorted ``values`` with one occurrence of ``v`` (one of them) left out: the other nodes' median.

    >>> _median_without([1.0, 2.0, 3.0, 10.0], 10.0), _median_without([1.0, 2.0, 3.0, 10.0], 2.0)
    (2.0, 3.0)
    """
    k = bisect.bisect_left(values, v)
    n = len(values) - 1

    def at(i: int) -> float:
        return values[i] if i < k else values[i + 1]

    m = n // 2
    return at(m) if n % 2 else (at(m - 1) + at(m)) / 2
