"""Small text helpers shared by the detectors' messages, the reports and the dashboard."""

from __future__ import annotations

import math
from typing import Any


def plural(n: Any, word: str, many: str | None = None) -> str:
    """``plural(1, "rank")`` → ``1 rank``, ``plural(1400, "step")`` → ``1,400 steps``;
    ``many`` for irregular plurals (``plural(3, "anomaly", "anomalies")``).

    ``n`` is anything :func:`int` takes (a float is truncated); raises :class:`ValueError` /
    :class:`TypeError` as :func:`int` does.
    """
    count = int(n)
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def fmt_age(seconds: float, day: str = " d") -> str:
    """A span for a person: ``42 s``, ``12.5 min``, ``7.1 h``, ``29.4 d`` (``day=" days"``: ``29.4 days``).

    Negative spans count as 0; a non-finite one is ``—``.

    >>> fmt_age(42.2), fmt_age(750), fmt_age(25427.07), fmt_age(2542707.4, day=" days"), fmt_age(math.nan)
    ('42 s', '12.5 min', '7.1 h', '29.4 days', '—')
    """
    if not math.isfinite(seconds):
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f}{day}"


#: Ledger categories whose name alone misleads: NaN/Inf steps are booked with the skipped ones.
_CATEGORY_LABELS = {"skipped_steps": "skipped or NaN steps"}


def category_label(category: str) -> str:
    """A goodput-ledger category for people: ``checkpoint_save`` → ``checkpoint save``,
    ``skipped_steps`` → ``skipped or NaN steps`` (steps whose update was skipped or whose loss or
    grad norm was NaN/Inf; docs/goodput.md).

    >>> category_label("checkpoint_save"), category_label("skipped_steps")
    ('checkpoint save', 'skipped or NaN steps')
    """
    return _CATEGORY_LABELS.get(category, category.replace("_", " "))


def show(v: Any) -> str:
    """``repr(v)`` for a log line or an error message, at most 60 characters; never raises (a broken
    ``__repr__`` gives ``<type>``). Used by the wire decoders and the collectors' warnings.

    >>> show("zero"), show(10**70)[-12:], show(type("Bad", (), {"__repr__": lambda self: 1 / 0})())
    ("'zero'", '000000000...', '<Bad>')
    """
    try:
        r = repr(v)
    except Exception:
        r = f"<{type(v).__name__}>"
    return r if len(r) <= 60 else r[:57] + "..."
