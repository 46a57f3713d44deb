"""Small text helpers shared by the detectors' messages, the reports and the dashboard."""

from __future__ import annotations

from typing import Any


def plural(n: Any, word: str, many: str | None = None) -> str:
    """``plural(1, "rank")`` → ``1 rank``, ``plural(1400, "step")`` → ``1,400 steps``;
    ``many`` for irregular plurals (``plural(3, "anomaly", "anomalies")``).

    ``n`` is anything :func:`int` takes (a float is truncated); raises :class:`ValueError` /
    :class:`TypeError` as :func:`int` does.
    """
    count = int(n)
    return f"{count:,} {word if count == 1 else (many or word + 's')}"
