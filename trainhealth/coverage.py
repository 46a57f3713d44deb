"""What a run's figures rest on: records the collectors lost, steps closed without every rank, history gone.

Read from a goodput ledger snapshot (``th:{run}:ledger:latest``, written by
:meth:`trainhealth.detectors.ledger.GoodputLedger.snapshot`): its ``records_dropped`` (``total``, by cause —
the keys of :data:`trainhealth.wire.DROP_CAUSES` — and ``by_rank``), ``steps_partial``, ``coverage_pct`` and
``history_lost``. One reading and one sentence for the dashboard's Goodput page and ``trainhealth doctor``.
A value of the wrong type reads as none (snapshots written before these fields had none).

>>> snap = {"records_dropped": {"total": 1200, "buffer": 1000, "spill": 200, "by_rank": {"3": 1200}},
...         "steps_partial": 4, "coverage_pct": 98.5, "history_lost": None}
>>> for part in data_lost_text(snap).split("; "):
...     print(part)
the collectors dropped 1,200 records on rank 3 (1,000 in the full in-memory buffer, 200 at the on-disk spill \
(bound reached or write failed))
4 steps closed without every rank's record. The figures rest on 98.5% of the rank-steps.
>>> data_lost_text({"records_dropped": {"total": 0}, "steps_partial": 0}) is None
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trainhealth.text import fmt_int, fmt_pct, plural
from trainhealth.wire import DROP_CAUSES


def history_lost_before(snap: Mapping[str, Any]) -> int | None:
    """The step before which the run's history is gone (the snapshot's ``history_lost.before_step``), or None."""
    lost = snap.get("history_lost")
    step = lost.get("before_step") if isinstance(lost, Mapping) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def data_quality(snap: Mapping[str, Any]) -> tuple[dict[str, int], list[int], int, float | None]:
    """What a ledger snapshot rests on: ``(records dropped by cause, ranks that dropped some, steps closed
    without every rank's record, coverage in % of rank-steps or None)``, from its ``records_dropped``,
    ``steps_partial`` and ``coverage_pct``; a value of the wrong type reads as none (snapshots before these
    fields had none)."""
    raw = snap.get("records_dropped")
    drops: dict[str, int] = {}
    ranks: list[int] = []
    if isinstance(raw, Mapping):
        for cause, n in raw.items():
            if cause not in ("total", "by_rank") and isinstance(n, int) and not isinstance(n, bool) and n > 0:
                drops[str(cause)] = n
        by_rank = raw.get("by_rank")
        if isinstance(by_rank, Mapping):
            ranks = sorted(int(r) for r, n in by_rank.items() if str(r).isdigit() and isinstance(n, int) and n > 0)
    partial = snap.get("steps_partial")
    cov = snap.get("coverage_pct")
    return (drops, ranks, partial if isinstance(partial, int) and not isinstance(partial, bool) else 0,
            float(cov) if isinstance(cov, (int, float)) and not isinstance(cov, bool) and math.isfinite(cov)
            else None)


def data_lost_text(snap: dict) -> str | None:
    """One sentence when the figures rest on less than every record: the history gone, records the collectors
    dropped (by cause and rank), steps closed without every rank's record, the share of rank-steps the ledger saw
    (plain text, no markup); None when nothing was lost."""
    drops, ranks, partial, coverage = data_quality(snap)
    before = history_lost_before(snap)
    if not drops and not partial and before is None:
        return None
    parts = []
    if before is not None:
        by_collector = snap["history_lost"].get("cause") == "collector"
        how = ("was dropped by the collectors" if by_collector else
               "is not in Redis (it restarted without its data, or trimmed it)")
        parts.append(f"the run's history before step {fmt_int(before)} {how}: the figures cover the run from there")
    if drops:
        total = sum(drops.values())
        how = ", ".join(f"{fmt_int(n)} {DROP_CAUSES.get(c, 'for a cause not reported')}" for c, n in drops.items())
        who = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:16]))}" if ranks else ""
        lead = (f"the collectors dropped {plural(total, 'record')}" if "trimmed" not in drops else
                f"{plural(total, 'record')} {'was' if total == 1 else 'were'} lost")
        parts.append(f"{lead}{who} ({how})")
    if partial:
        parts.append(f"{plural(partial, 'step')} closed without every rank's record")
    text = "; ".join(parts)
    if coverage is not None:
        text += f". The figures rest on {fmt_pct(coverage)} of the rank-steps."
    return text
