"""Merge the ranks' records of one step into a :class:`StepAggregate`.

Each rank writes its own record; a step is complete when ``world_size`` ranks reported it.
A rank whose incarnation (``inc``, its Monitor's start time) changes has restarted: its
records start a new *generation*, so a step recomputed after a restart is a separate
aggregate from the first attempt, as the goodput ledger needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainhealth import defaults
from trainhealth.events import StepRecord


@dataclass(frozen=True)
class StepAggregate:
    """One step across ranks.

    Attributes
    ----------
    step, gen : int
        Step number and restart generation.
    inc : float
        Earliest incarnation (process start, unix s) among the reporting ranks.
    t_start : float | None
        Earliest rank start (unix s) when steps were timed, else None.
    t_end : float
        Latest rank end (unix s).
    loss : float | None
        Mean over ranks that logged one; NaN/Inf if any rank's was.
    grad_norm : float | None
        Max over ranks (the global norm: ranks agree); NaN/Inf if any rank's was.
    lr : float | None
        Lowest rank's learning rate.
    tokens, samples : int | None
        Sums over ranks.
    consumed_samples, batch_index : int | None
        Data position after the step: the highest any rank reported.
    skipped : bool
        Whether any rank reported the optimizer step as skipped (fp16 overflow).
    n_ranks : int
        Ranks that reported.
    busy : tuple[float | None, ...]
        Per-rank seconds in sections (index = rank), None where missing.
    data_s : float
        Max over ranks of seconds in data-loading sections.
    bad_ranks : tuple[int, ...]
        Ranks whose loss or grad norm was NaN/Inf.
    """

    step: int
    gen: int
    inc: float
    t_start: float | None
    t_end: float
    loss: float | None
    grad_norm: float | None
    lr: float | None
    tokens: int | None
    samples: int | None
    n_ranks: int
    busy: tuple[float | None, ...]
    data_s: float
    bad_ranks: tuple[int, ...] = ()
    consumed_samples: int | None = None
    batch_index: int | None = None
    skipped: bool = False

    @property
    def dur(self) -> float | None:
        """Step wall time across ranks (s), when timed."""
        return None if self.t_start is None else self.t_end - self.t_start


def _merge(a: StepRecord, b: StepRecord) -> StepRecord:
    # Same rank, same step, two records (timing, then metrics): keep what each has.
    kw = {f: getattr(b, f) if getattr(b, f) is not None else getattr(a, f)
          for f in ("dur", "loss", "grad_norm", "lr", "tokens", "samples", "consumed_samples", "batch_index",
                    "skipped")}
    return StepRecord(rank=a.rank, step=a.step, inc=a.inc, t=max(a.t, b.t),
                      sections={**a.sections, **b.sections}, gpu={**a.gpu, **b.gpu}, **kw)


class StepAggregator:
    """Groups per-rank :class:`~trainhealth.events.StepRecord` into per-step aggregates.

    Parameters
    ----------
    world_size : int
        Ranks expected per step.
    stale_s : float
        A step still missing ranks this many seconds after its first record is closed with
        the ranks it has (:meth:`flush_stale`).
    data_sections : tuple[str, ...]
        Section names counted as data-loading wait.

    Examples
    --------
    >>> agg = StepAggregator(world_size=2)
    >>> agg.add(StepRecord(rank=0, step=1, inc=0.0, t=10.0, dur=1.0, loss=2.0, tokens=100))
    []
    >>> [(a.step, a.loss, a.tokens, a.t_start) for a in
    ...  agg.add(StepRecord(rank=1, step=1, inc=0.0, t=10.5, dur=1.0, loss=3.0, tokens=100))]
    [(1, 2.5, 200, 9.0)]
    """

    def __init__(
        self,
        world_size: int,
        stale_s: float = defaults.AGG_STALE_S,
        data_sections: tuple[str, ...] = defaults.DATA_SECTIONS,
    ) -> None:
        self.world_size = world_size
        self.stale_s = stale_s
        self.data_sections = data_sections
        self._rank_inc: dict[int, float] = {}
        self._rank_gen: dict[int, int] = {}
        self._rank_last: dict[int, int] = {}
        self._gen = 0
        self._pending: dict[tuple[int, int], dict[int, StepRecord]] = {}
        self._first_seen: dict[tuple[int, int], float] = {}
        self._done: dict[int, int] = {}  # gen -> highest step emitted
        #: Records that arrived for a step already closed (late ranks), counted.
        self.late = 0

    @property
    def generation(self) -> int:
        """Current restart generation."""
        return self._gen

    def add(self, rec: StepRecord) -> list[StepAggregate]:
        """Add one rank's record; return the steps it completes, in step order."""
        out: list[StepAggregate] = []
        prev = self._rank_inc.get(rec.rank)
        if prev is None:
            self._rank_inc[rec.rank] = rec.inc
            self._rank_gen[rec.rank] = self._gen
        elif rec.inc < prev:
            self.late += 1  # a record from before this rank restarted: that attempt is closed
            return out
        elif rec.inc > prev or rec.step < self._rank_last[rec.rank]:
            # The rank restarted (new process) or rewound in-process (rollback to a checkpoint):
            # a new generation, shared by the other ranks that restart with it.
            self._rank_inc[rec.rank] = rec.inc
            gen = self._rank_gen[rec.rank] + 1
            self._rank_gen[rec.rank] = gen
            if gen > self._gen:
                self._gen = gen
                out += self._close(lambda key: key[0] < gen)
        self._rank_last[rec.rank] = rec.step
        gen = self._rank_gen[rec.rank]
        key = (gen, rec.step)
        if key not in self._pending and rec.step <= self._done.get(gen, -1):
            self.late += 1  # this step was already closed without this rank
            return out
        recs = self._pending.setdefault(key, {})
        if not recs:
            self._first_seen[key] = rec.t
        recs[rec.rank] = _merge(recs[rec.rank], rec) if rec.rank in recs else rec
        if len(recs) >= self.world_size:
            # Complete: close it and any earlier step of this generation still waiting for ranks.
            out += self._close(lambda k: k[0] == gen and k[1] <= rec.step)
        return out

    def flush_stale(self, now: float) -> list[StepAggregate]:
        """Close steps whose first record is older than ``stale_s`` (ranks died mid-step)."""
        return self._close(lambda key: now - self._first_seen[key] > self.stale_s)

    def flush(self) -> list[StepAggregate]:
        """Close every pending step (end of input)."""
        return self._close(lambda key: True)

    def _close(self, which) -> list[StepAggregate]:
        keys = sorted(k for k in self._pending if which(k))
        out = []
        for key in keys:
            recs = self._pending.pop(key)
            self._first_seen.pop(key, None)
            self._done[key[0]] = max(self._done.get(key[0], -1), key[1])
            out.append(self._build(key, recs))
        return out

    def _build(self, key: tuple[int, int], recs: dict[int, StepRecord]) -> StepAggregate:
        gen, step = key
        rs = [recs[r] for r in sorted(recs)]
        losses = [r.loss for r in rs if r.loss is not None]
        norms = [r.grad_norm for r in rs if r.grad_norm is not None]
        bad = tuple(r.rank for r in rs if any(v is not None and not math.isfinite(v)
                                              for v in (r.loss, r.grad_norm)))
        loss = next((x for x in losses if not math.isfinite(x)), None) if bad else None
        if loss is None and losses:
            loss = sum(losses) / len(losses)
        gn = next((x for x in norms if not math.isfinite(x)), None)
        if gn is None and norms:
            gn = max(norms)
        starts = [r.t - r.dur for r in rs if r.dur is not None]
        tokens = [r.tokens for r in rs if r.tokens is not None]
        samples = [r.samples for r in rs if r.samples is not None]
        width = max(self.world_size, rs[-1].rank + 1)
        busy: list[float | None] = [None] * width
        data = 0.0
        for r in rs:
            busy[r.rank] = r.busy_s
            data = max(data, sum(v for k, v in r.sections.items() if k in self.data_sections))
        return StepAggregate(
            step=step, gen=gen, inc=min(r.inc for r in rs),
            t_start=min(starts) if starts else None, t_end=max(r.t for r in rs),
            loss=loss, grad_norm=gn, lr=next((r.lr for r in rs if r.lr is not None), None),
            tokens=sum(tokens) if tokens else None, samples=sum(samples) if samples else None,
            n_ranks=len(rs), busy=tuple(busy), data_s=data, bad_ranks=bad,
            consumed_samples=max((r.consumed_samples for r in rs if r.consumed_samples is not None), default=None),
            batch_index=max((r.batch_index for r in rs if r.batch_index is not None), default=None),
            skipped=any(r.skipped for r in rs),
        )
