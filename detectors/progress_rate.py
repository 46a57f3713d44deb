"""Learning progress per GPU-hour: how much the loss improved per GPU-hour and per billion kept tokens.

Not the progress timeout of :mod:`trainhealth.detectors.progress` (when a job is hung): this is the rate at which
the compute spent buys a lower loss, beside the ledger's throughput and goodput (docs/goodput.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainhealth import defaults
from trainhealth.goodput import Progress


def block_size(n: int, most: int = defaults.PROGRESS_POINTS, least: int = defaults.PROGRESS_MIN_POINTS) -> int:
    """Points in each end block of a stretch of ``n`` finite losses: at most ``most`` and a third of ``n``, odd (its
    median is one point), 0 when that is under ``least`` (too few points for a figure).

    >>> [block_size(n) for n in (8, 9, 12, 30, 1000)]
    [0, 3, 3, 9, 21]
    """
    k = min(most, n // 3)
    if k % 2 == 0:
        k -= 1
    return k if k >= least else 0


def loss_progress(points: Sequence[tuple[float, float, float]], gpus: int,
                  most: int = defaults.PROGRESS_POINTS, n: int | None = None) -> Progress | None:
    """The loss improvement over a stretch of kept steps, per GPU-hour and per billion kept tokens.

    Parameters
    ----------
    points : sequence of (t, loss, kept tokens)
        The stretch's steps with a finite loss, in step order: when each ended (unix s), its loss, and the kept
        tokens of the run up to and including it (cumulative, so a difference is the tokens between two steps).
    gpus : int
        GPUs of the job: its ranks (one GPU per rank, as the ledger counts GPU-hours).
    most : int
        The most points of each end block (:func:`block_size`).
    n : int | None
        Points of the stretch when ``points`` holds only its two ends (at least ``most`` of each, in order); default
        ``len(points)``.

    Returns
    -------
    Progress | None
        ``loss_drop`` = median loss of the first block − median of the last (loss units; positive: the loss fell),
        measured between the two medians' points (``from_t`` → ``to_t``): ``gpu_hours`` = their wall seconds x
        ``gpus`` / 3600 (every second between them, badput included: what the compute bought), ``tokens_good`` the
        kept tokens between them. None with too few points (:func:`block_size`). The rates are None where their
        denominator is not positive (no time passed, no tokens counted).

    Medians of blocks rather than the first and last loss: one spike at either end (a loss spike the window ends on)
    would otherwise read as the whole stretch's regression; a least-squares slope would be pulled by it too.

    Examples
    --------
    Nine steps a minute apart on 8 GPUs, 1,000 kept tokens each, the loss falling 0.1 per step with a spike at the
    end: the medians of steps 0-2 (3.9, at step 1) and 6-8 (3.4, at step 7: not the spike's 9.0), 6 minutes apart:

    >>> losses = [4.0, 3.9, 3.8, 3.7, 3.6, 3.5, 3.4, 3.3, 9.0]
    >>> p = loss_progress([(60.0 * i, x, 1000 * (i + 1)) for i, x in enumerate(losses)], gpus=8)
    >>> round(p["loss_drop"], 6), p["gpu_hours"], p["tokens_good"], round(p["loss_drop_per_gpu_hour"], 6)
    (0.5, 0.8, 6000, 0.625)
    >>> round(p["loss_drop_per_btok"])
    83333
    """
    n = len(points) if n is None else n
    k = block_size(n, most)
    if not k:
        return None
    mid = k // 2
    first, last = points[:k], points[-k:]
    before = sorted(x for _, x, _ in first)[mid]
    after = sorted(x for _, x, _ in last)[mid]
    (t0, _, c0), (t1, _, c1) = first[mid], last[mid]
    gpu_hours = max(t1 - t0, 0.0) * gpus / 3600.0
    tokens = max(c1 - c0, 0)
    drop = before - after
    return {"points": n, "block": k, "loss_from": before, "loss_to": after, "from_t": t0, "to_t": t1,
            "loss_drop": drop, "gpu_hours": gpu_hours, "tokens_good": int(tokens),
            "loss_drop_per_gpu_hour": drop / gpu_hours if gpu_hours > 0 else None,
            "loss_drop_per_btok": drop / (tokens / 1e9) if tokens > 0 else None}
