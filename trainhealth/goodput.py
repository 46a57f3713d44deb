"""The goodput ledger's snapshot: the record of ``th:{run}:ledger`` (field ``json``) and ``th:{run}:ledger:latest``.

The detector service's ledger (:class:`trainhealth.detectors.ledger.GoodputLedger`) books every second of a run's
wall time into the :data:`CATEGORIES` and writes a :class:`LedgerSnapshot` every 2 s; the dashboard, the exporter,
the collectors' ``Monitor.goodput_metrics`` and ``trainhealth analyze`` (its ``goodput.ledger``) read it.
Definitions: docs/goodput.md. Standard library only.
"""

from __future__ import annotations

from typing import Any, TypedDict

#: Ledger categories, with what each books; their seconds sum to the wall time exactly. Names follow Google's
#: ``ml-goodput-measurement`` (``BadputType``) where one exists.
CATEGORY_MEANING = {
    "productive": "step time of surviving steps, minus the badput below",
    "program_startup": "process start (or run start) to its first step",
    "data_loading": "data-loading sections of surviving steps",
    "straggler_wait": "time all ranks waited for the slowest rank's sections",
    "communication": "collectives the job timed (COMM_SECTIONS), beyond the wait for the slowest rank",
    "skipped_steps": "steps whose update was skipped (fp16 overflow, NaN/Inf)",
    "checkpoint_save": "blocking checkpoint saves between steps",
    "checkpoint_restore": "checkpoint loads before resuming",
    "wasted_progress_from_disruption": "steps since the newest checkpoint, lost to a failure",
    "wasted_progress_from_rollback": "steps discarded by going back further (loss spike, divergence)",
    "infrastructure_recovery_from_disruption": "last step before a failure to the new processes' start",
    "custom": "user-declared badput (evaluation, profiling)",
    "hang": "gaps longer than the hang threshold with nothing declared",
    "idle": "shorter unattributed gaps",
    "unobserved": "steps the records do not cover: neither productive nor badput",
}
CATEGORIES = tuple(CATEGORY_MEANING)
#: Categories of time inside step attempts (``step_s``, the throughput's denominator).
STEP_CATEGORIES = ("productive", "data_loading", "straggler_wait", "communication", "skipped_steps",
                   "wasted_progress_from_disruption", "wasted_progress_from_rollback")
#: Categories that are not badput: the productive time, and the time nobody saw (not known to be lost).
NOT_BADPUT = ("productive", "unobserved")
#: Windows (s) of the rolling throughput and goodput rates.
WINDOWS_S = (60, 600, 3600)


def _per_category(name: str, unit: str, doc: str) -> Any:
    """A TypedDict with one number per category (every one present), documented per category."""
    td = TypedDict(name, dict.fromkeys(CATEGORIES, float))  # type: ignore[misc]
    td.__doc__ = (f"{doc}\n\nAttributes\n----------\n"
                  + "".join(f"{c} : float\n    {unit}: {m}.\n" for c, m in CATEGORY_MEANING.items()))
    return td


CategorySeconds = _per_category("CategorySeconds", "Seconds", "Seconds of the wall time per category; they sum to "
                                "``wall_s``.")
CategoryGpuHours = _per_category("CategoryGpuHours", "GPU-hours", "GPU-hours per category: seconds x world size / "
                                 "3600.")
CategoryCost = _per_category("CategoryCost", "USD", "Money per category: GPU-hours x ``gpu_hour_usd``.")


class WindowRates(TypedDict):
    """Throughput and goodput over a window: each step attempt counts with the share of its step time inside it.

    Attributes
    ----------
    throughput_tok_s : float
        Tokens/s: the tokens of the step attempts in the window over their seconds.
    goodput_tok_s : float
        Tokens/s: the kept tokens over the window's wall time.
    loss_drop_per_gpu_hour : float | None
        Loss decrease per GPU-hour over the kept steps that ended in the window (:class:`Progress`; negative: the
        loss rose); null with too few finite losses in it.
    loss_drop_per_btok : float | None
        Loss decrease per billion kept tokens, the same way; null also without token counts.
    """

    throughput_tok_s: float
    goodput_tok_s: float
    loss_drop_per_gpu_hour: float | None
    loss_drop_per_btok: float | None


class Progress(TypedDict):
    """Learning progress over a stretch of kept steps: the loss improvement per GPU-hour and per billion kept tokens
    (``trainhealth.detectors.progress_rate.loss_progress``).

    Attributes
    ----------
    points : int
        Kept steps with a finite loss in the stretch.
    block : int
        Points in each end block whose median is taken (at most 21 and a third of ``points``, odd).
    loss_from, loss_to : float
        Median loss of the first and of the last block.
    from_t, to_t : float
        Unix s the two medians' steps ended: the rate is measured between them.
    loss_drop : float
        ``loss_from - loss_to``, loss units (positive: the loss fell).
    gpu_hours : float
        ``(to_t - from_t) x world_size / 3600``: every GPU-second between them, badput included.
    tokens_good : int
        Kept tokens of the steps after the first median's up to the last median's.
    loss_drop_per_gpu_hour : float | None
        ``loss_drop / gpu_hours`` (null when no time passed).
    loss_drop_per_btok : float | None
        ``loss_drop`` per 1e9 kept tokens (null without token counts).
    """

    points: int
    block: int
    loss_from: float
    loss_to: float
    from_t: float
    to_t: float
    loss_drop: float
    gpu_hours: float
    tokens_good: int
    loss_drop_per_gpu_hour: float | None
    loss_drop_per_btok: float | None


Rates = TypedDict("Rates", {f"{w}s": WindowRates for w in WINDOWS_S})  # type: ignore[misc]
Rates.__doc__ = ("The rates over the last 60 s, 600 s and 3,600 s of the run.\n\nAttributes\n----------\n"
                 + "".join(f"{w}s : WindowRates\n    Over the last {w:,} s.\n" for w in WINDOWS_S))


class UnobservedGaps(TypedDict):
    """The stretches of steps the records skipped (a step number that jumped more than 10x the run's usual increment),
    whose time is ``unobserved``.

    Attributes
    ----------
    count : int
        Stretches.
    steps : int
        Steps they skipped beyond the usual increment.
    largest : list[int] | None
        The largest as ``[from step, to step]``; null without any.
    """

    count: int
    steps: int
    largest: list[int] | None


class _Dropped(TypedDict):
    total: int
    by_rank: dict[str, int]


class RecordsDropped(_Dropped, total=False):
    """Records lost before the ledger saw them, from the ``collector_drops`` events (a lower bound: events count too).

    Attributes
    ----------
    total : int
        Records lost, all causes.
    by_rank : dict[str, int]
        Records lost per rank (the rank as a string key), ranks with none left out.
    buffer : int
        In the collector's full in-memory buffer (present when > 0, as each cause).
    spill : int
        At the collector's on-disk spill (its bound reached, or a write failed).
    unencodable : int
        Records the collector could not encode.
    trimmed : int
        Step records Redis trimmed by the retention bound before the service read them.
    unknown : int
        Drops a collector reported without a cause.
    """

    buffer: int
    spill: int
    unencodable: int
    trimmed: int
    unknown: int


class HistoryLost(TypedDict):
    """The run's history before its first step seen is missing; the ledger starts at that step.

    Attributes
    ----------
    before_step : int
        The first step seen.
    first_seen_t : float
        Unix s it was seen.
    ranks : list[int]
        The ranks whose history is missing.
    cause : str
        ``redis`` (not in Redis: a ``data_loss`` anomaly) or ``collector`` (those ranks' collectors reported drops).
    """

    before_step: int
    first_seen_t: float
    ranks: list[int]
    cause: str


class LedgerSnapshot(TypedDict):
    """The goodput ledger's totals at one time: where every second of the run's wall time went (docs/goodput.md).

    Attributes
    ----------
    t : float
        Unix s the snapshot runs to (a log's timeline for ``trainhealth analyze``).
    started_at : float
        Unix s the run started.
    wall_s : float
        Seconds from the start to ``t``.
    world_size : int
        Ranks (GPUs) of the job.
    gpu_hour_usd : float | None
        Price of a GPU-hour, USD (null when not set).
    last_step : int | None
        Newest step of the surviving lineage.
    steps_done : int
        Step attempts booked, discarded ones included.
    steps_good : int
        Steps in the surviving lineage.
    restarts : int
        Restarts seen.
    tokens_total : int
        Tokens of the step time booked (every attempt).
    tokens_good : int
        Tokens of surviving steps.
    tokens_unobserved : int
        Tokens the records report for time that is not observed (left out of the rates).
    step_s : float
        Seconds inside step attempts (the throughput's denominator).
    observed_s : float
        Wall seconds minus ``unobserved``.
    throughput_tok_s : float
        ``tokens_total / step_s``, tokens/s while stepping.
    goodput_tok_s : float
        ``tokens_good / wall_s``, tokens/s kept per wall-clock second.
    goodput_pct : float
        ``100 x productive / wall_s``, %.
    rates : Rates
        Throughput, goodput and learning progress over the last 60 s, 600 s and 3,600 s.
    progress : Progress | None
        Learning progress over the whole run's kept steps (null with fewer than 9 finite losses).
    seconds : CategorySeconds
        Seconds per category, summing to ``wall_s``.
    custom_by_name : dict[str, float]
        ``custom`` seconds split by the names given to ``Monitor.badput`` (``evaluation``...).
    gpu_hours : CategoryGpuHours
        GPU-hours per category.
    cost_usd : CategoryCost | None
        USD per category (null without a price).
    badput_cost_usd : float | None
        USD of every category but ``productive`` and ``unobserved`` (null without a price).
    unobserved_gaps : UnobservedGaps
        The stretches of steps the records skipped.
    records_dropped : RecordsDropped
        Records lost before the ledger saw them.
    steps_partial : int
        Steps closed without every rank's record.
    history_lost : HistoryLost | None
        Set when the run's history before its first step seen is missing.
    coverage_pct : float | None
        Rank records the steps were built from, % of those there should have been (null before any step).
    """

    t: float
    started_at: float
    wall_s: float
    world_size: int
    gpu_hour_usd: float | None
    last_step: int | None
    steps_done: int
    steps_good: int
    restarts: int
    tokens_total: int
    tokens_good: int
    tokens_unobserved: int
    step_s: float
    observed_s: float
    throughput_tok_s: float
    goodput_tok_s: float
    goodput_pct: float
    rates: Rates
    progress: Progress | None
    seconds: CategorySeconds
    custom_by_name: dict[str, float]
    gpu_hours: CategoryGpuHours
    cost_usd: CategoryCost | None
    badput_cost_usd: float | None
    unobserved_gaps: UnobservedGaps
    records_dropped: RecordsDropped
    steps_partial: int
    history_lost: HistoryLost | None
    coverage_pct: float | None
