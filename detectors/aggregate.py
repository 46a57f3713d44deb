"""Merge the ranks' records of one step into a :class:`StepAggregate`.

Each rank writes its own record; a step is complete when ``world_size`` ranks reported it.
A rank whose incarnation (``inc``, its Monitor's start time) changes has restarted: its
records start a new *generation*, so a step recomputed after a restart is a separate
aggregate from the first attempt, as the goodput ledger needs.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

from trainhealth import defaults
from trainhealth.wire import ROW_SOURCE, StepRecord, record_row, row_record


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
    step_s : float | None
        Seconds per step as the job measured it (``StepRecord.step_s``), max over ranks; None when
        no rank gave one.
    n_ranks : int
        Ranks that reported.
    busy : tuple[float | None, ...]
        Per-rank seconds in sections (index = rank), None where missing.
    data_s : float
        Max over ranks of seconds in data-loading sections.
    bad_ranks : tuple[int, ...]
        Ranks whose loss or grad norm was NaN/Inf.
    loss_missing : bool
        Whether any rank's record says its log printed the step without its loss (``StepRecord.loss_missing``:
        a replayed Megatron-LM line whose loss was left out because it was not finite).
    pause : str | None
        A declared pause fell in this step, set by the pipeline
        (:meth:`~trainhealth.detectors.pipeline.RunPipeline.feed_event`): ``checkpoint_save``,
        ``checkpoint_load``, or the name of a ``badput`` event (``evaluation``, ``profiling``...) reported
        since the step before it. The timing detectors do not judge such a step (its time holds the pause
        when the log measured it whole: TF's ``sec/step`` after "The checkpoint has been created."), and the
        goodput ledger books its time above the usual step time as that pause. None otherwise.
    comm : tuple[float | None, ...]
        Per-rank seconds in communication sections (index = rank, as ``busy``; :data:`~trainhealth.defaults.
        COMM_SECTIONS`: a collective the job timed, each rank's including its wait for the slowest rank); empty when
        no rank timed one.
    loss_scale : float | None
        The lowest fp16 loss scale any rank reported after the step; None when none did.
    sample_indices : dict[int, list] | None
        Rank -> the sample indices it consumed in the step (``StepRecord.sample_indices``, a compact list), for the
        ranks that logged them; None when none did.
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
    step_s: float | None = None
    loss_missing: bool = False
    pause: str | None = None
    comm: tuple[float | None, ...] = ()
    loss_scale: float | None = None
    sample_indices: dict[int, list] | None = field(default=None, hash=False)

    @property
    def dur(self) -> float | None:
        """Step wall time across ranks (s), when timed."""
        return None if self.t_start is None else self.t_end - self.t_start


def _by_rank(order: list[int], values: tuple, width: int) -> tuple:
    """``values`` (in ``order``'s rank order) placed at their ranks in a tuple of ``width`` (None where missing)."""
    if order[0] == 0 and len(order) == width:
        return tuple(values)
    out: list[Any] = [None] * width
    for r, v in zip(order, values, strict=True):
        out[r] = v
    return tuple(out)


def _merge(a: StepRecord, b: StepRecord) -> StepRecord:
    # Same rank, same step, two records (timing, then metrics): keep what each has.
    kw = {f: getattr(b, f) if getattr(b, f) is not None else getattr(a, f)
          for f in ("dur", "loss", "grad_norm", "lr", "tokens", "samples", "consumed_samples", "batch_index",
                    "skipped", "step_s", "loss_missing", "sample_indices")}
    return StepRecord(rank=a.rank, step=a.step, inc=a.inc, t=max(a.t, b.t),
                      sections={**a.sections, **b.sections}, gpu={**a.gpu, **b.gpu}, **kw)


def _present(column: tuple) -> tuple | list:
    """The values of a column of ranks' values that are not None, in rank order (the column itself when it has no
    None: a step of 4,096 ranks is filtered at C speed)."""
    missing = column.count(None)
    if not missing:
        return column
    if missing == len(column):
        return ()
    return [x for x in column if x is not None]


def _indices(order: list[int], sources: tuple) -> dict[int, list] | None:
    """Rank -> ``sample_indices`` of the ranks whose record (a decoded dict, a StepRecord or a typed record) has them,
    else None (a typed record never has them: see trainhealth.wire._typed)."""
    out = None
    for r, src in zip(order, sources, strict=True):
        v = src.get("sample_indices") if type(src) is dict else getattr(src, "sample_indices", None)
        if v is not None:
            if out is None:
                out = {}
            out[r] = v
    return out


def _source(row: tuple) -> StepRecord:
    return row_record(row[ROW_SOURCE])


class StepAggregator:
    """Groups per-rank :class:`~trainhealth.wire.StepRecord` into per-step aggregates.

    Records are kept as rows (:func:`trainhealth.wire.record_row`): :meth:`add` takes a record,
    :meth:`add_row` a row (the detector service decodes its input straight into rows).

    Parameters
    ----------
    world_size : int
        Ranks expected per step.
    stale_s : float
        A step still missing ranks this many seconds after its first record is closed with
        the ranks it has once the job went on without them (:meth:`flush_stale`): a missing rank has a later
        record, or a rank is ``defaults.AGG_WENT_ON_STEPS`` steps past it. While no rank got that far (a rank frozen
        mid-step, the others blocked on it) the step waits, so a resumed rank's late records join it.
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
        self._rank_t: dict[int, float] = {}  # rank -> time (unix s) of its last record
        self._gen = 0
        # (gen, step) -> rank -> row: the values _build needs from each pending record, taken while the
        # record is fresh in the CPU cache (a step's 1,024 records arrive over many batches).
        self._pending: dict[tuple[int, int], dict[int, tuple]] = {}
        self._first_seen: dict[tuple[int, int], float] = {}
        self._done: dict[int, int] = {}  # gen -> highest step emitted
        self._seen: dict[int, int] = {}  # gen -> highest step with a record
        #: Records that arrived for a step already closed (late ranks), counted.
        self.late = 0
        #: ``(rank, inc, step, t)`` of each rank incarnation's first record, for the caller to take (and clear).
        self.first_rows: list[tuple[int, float, int, float]] = []

    @property
    def generation(self) -> int:
        """Current restart generation."""
        return self._gen

    def add(self, rec: StepRecord) -> list[StepAggregate]:
        """Add one rank's record; return the steps it completes, in step order."""
        return self.add_row(record_row(rec, self.data_sections))

    def add_row(self, row: tuple) -> list[StepAggregate]:
        """Add one rank's record as a row (:func:`~trainhealth.wire.record_row` with this aggregator's
        ``data_sections``); return the steps it completes, in step order."""
        out: list[StepAggregate] = []
        rank, step, inc = row[12], row[13], row[6]  # (called once per record: ~100,000 times a second)
        prev = self._rank_inc.get(rank)
        if prev is None or inc > prev:
            self.first_rows.append((rank, inc, step, row[2]))
        if prev is None:
            self._rank_inc[rank] = inc
            self._rank_gen[rank] = self._gen
        elif inc < prev:
            self.late += 1  # a record from before this rank restarted: that attempt is closed
            return out
        elif inc > prev or step < self._rank_last[rank]:
            # The rank restarted (new process) or rewound in-process (rollback to a checkpoint):
            # a new generation, shared by the other ranks that restart with it.
            self._rank_inc[rank] = inc
            gen = self._rank_gen[rank] + 1
            self._rank_gen[rank] = gen
            if gen > self._gen:
                self._gen = gen
                out += self._close(lambda key: key[0] < gen)
        self._rank_last[rank] = step
        self._rank_t[rank] = row[2]
        gen = self._rank_gen[rank]
        if step > self._seen.get(gen, -1):
            self._seen[gen] = step
        key = (gen, step)
        recs = self._pending.get(key)
        if recs is None:
            if step <= self._done.get(gen, -1):
                self.late += 1  # this step was already closed without this rank
                return out
            recs = self._pending[key] = {}
            self._first_seen[key] = row[2]  # t
        if rank in recs:
            row = record_row(_merge(_source(recs[rank]), _source(row)), self.data_sections)
        recs[rank] = row
        if len(recs) >= self.world_size:
            # Complete: close it and any earlier step of this generation still waiting for ranks.
            out += self._close(lambda k: k[0] == gen and k[1] <= step)
        return out

    def flush_stale(self, now: float) -> list[StepAggregate]:
        """Close steps whose first record is older than ``stale_s`` and that a later step of their generation
        passed (their missing ranks' records were lost: the job went on without them)."""
        return self._close(lambda key: now - self._first_seen[key] > self.stale_s and self._went_on(key))

    def _went_on(self, key: tuple[int, int]) -> bool:
        """Whether the job went on past pending step ``key`` without its missing ranks: one of them has a later record
        (its record of this step was lost), or some rank is ``defaults.AGG_WENT_ON_STEPS`` steps past it. Not a few
        steps: a frozen rank's records of the steps it completed before it froze wait in its sender (a quarter of a
        second of steps: several at fast steps) while the others are at most one step past its actual progress."""
        gen, step = key
        if self._seen.get(gen, -1) >= step + defaults.AGG_WENT_ON_STEPS:
            return True
        have = self._pending[key]
        return any(self._rank_gen.get(r) == gen and s > step for r, s in self._rank_last.items() if r not in have)

    def last_steps(self) -> dict[int, int]:
        """Each rank's last step in the current generation (from its records; ranks of an older one left out)."""
        return {r: s for r, s in self._rank_last.items() if self._rank_gen.get(r) == self._gen}

    def last_records(self) -> dict[int, tuple[int, float]]:
        """Each rank's ``(last step, its record's time in unix s)`` in the current generation."""
        return {r: (s, self._rank_t[r]) for r, s in self._rank_last.items() if self._rank_gen.get(r) == self._gen}

    def flush(self) -> list[StepAggregate]:
        """Close every pending step (end of input)."""
        return self._close(lambda key: True)

    def _close(self, which) -> list[StepAggregate]:
        keys = sorted(k for k in self._pending if which(k))
        out = []
        for key in keys:
            rows = self._pending.pop(key)
            self._first_seen.pop(key, None)
            self._done[key[0]] = max(self._done.get(key[0], -1), key[1])
            out.append(self._build(key, rows))
        return out

    def _build(self, key: tuple[int, int], rows: dict[int, tuple] | dict[int, StepRecord]) -> StepAggregate:
        gen, step = key
        order = sorted(rows)
        rs = [rows[r] for r in order]
        if not isinstance(rs[0], tuple):  # records (tests)
            rs = [record_row(r, self.data_sections) for r in rs]
        # Columns of the ranks' values in rank order (see record_row); each field computed as the
        # comment beside it says, from the ranks' records r.
        (loss_c, gn_c, t_c, dur_c, tokens_c, samples_c, inc_c, lr_c, consumed_c, batch_c, skipped_c, step_s_c,
         _rank_c, _step_c, missing_c, scale_c, busy_c, data_c, comm_c, _src_c) = zip(*rs, strict=True)
        losses = _present(loss_c)  # r.loss
        norms = _present(gn_c)  # r.grad_norm
        try:
            # A NaN/Inf loss or grad norm makes its sum non-finite: then find the bad ranks.
            finite = math.isfinite(sum(losses)) and math.isfinite(sum(norms))
        except OverflowError:
            finite = False
        if finite:
            bad: tuple[int, ...] = ()
            loss = sum(losses) / len(losses) if losses else None
            gn = max(norms) if norms else None
        else:
            bad = tuple(r for r, lo, g in zip(order, loss_c, gn_c, strict=True)  # r.rank, r.loss, r.grad_norm
                        if any(v is not None and not math.isfinite(v) for v in (lo, g)))
            loss = next((x for x in losses if not math.isfinite(x)), None) if bad else None
            if loss is None and losses:
                loss = sum(losses) / len(losses)
            gn = next((x for x in norms if not math.isfinite(x)), None)
            if gn is None and norms:
                gn = max(norms)
        if None in dur_c:
            starts = [t - d for t, d in zip(t_c, dur_c, strict=True) if d is not None]  # r.t - r.dur
        else:
            starts = list(map(operator.sub, t_c, dur_c))
        tokens = _present(tokens_c)
        samples = _present(samples_c)
        width = max(self.world_size, order[-1] + 1)
        if order[0] == 0 and len(rs) == width:  # ranks 0..width-1, all present
            busy: list[float | None] | tuple[float | None, ...] = busy_c  # busy[r.rank] = r.busy_s
        else:
            busy = [None] * width
            for r, b in zip(order, busy_c, strict=True):
                busy[r] = b
        return StepAggregate(
            step=step, gen=gen, inc=min(inc_c),
            t_start=min(starts) if starts else None, t_end=max(t_c),
            loss=loss, grad_norm=gn, lr=next((x for x in lr_c if x is not None), None),
            tokens=sum(tokens) if tokens else None, samples=sum(samples) if samples else None,
            n_ranks=len(rs), busy=tuple(busy), data_s=max((0.0, *data_c)), bad_ranks=bad,
            comm=_by_rank(order, comm_c, width) if any(comm_c) else (),
            loss_scale=min(_present(scale_c), default=None),
            consumed_samples=max(_present(consumed_c), default=None),
            batch_index=max(_present(batch_c), default=None),
            skipped=any(skipped_c),
            step_s=max(_present(step_s_c), default=None),
            loss_missing=any(missing_c),
            sample_indices=_indices(order, _src_c),
        )
