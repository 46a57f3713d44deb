"""Text for people: the one formatter of each quantity (a span of time, a count, tokens/s, a percentage,
GPU-hours, money), plurals, category labels, and a safe repr for messages.

Shared by the detectors' messages, the alerts, the reports and the dashboard, so one figure reads the same
everywhere.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any


def plural(n: Any, word: str, many: str | None = None) -> str:
    """``plural(1, "rank")`` → ``1 rank``, ``plural(1400, "step")`` → ``1,400 steps``;
    ``many`` for irregular plurals (``plural(3, "anomaly", "anomalies")``).

    ``n`` is anything :func:`int` takes (a float is truncated); raises :class:`ValueError` /
    :class:`TypeError` as :func:`int` does.
    """
    count = int(n)
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def fmt_duration(seconds: Any, day: str = " d", minute_digits: int = 1) -> str:
    """A span of time (a duration or an age) for a person: ``42 s``, ``12.5 min``, ``7.1 h``, ``29.4 d``.

    The one format of seconds everywhere (messages, reports, the dashboard). Below 120 s whole
    seconds, below 2 h minutes, below 2 days hours, then days (``day=" days"`` spells them out);
    one decimal, but ``minute_digits`` for minutes (0 on a KPI card: ``84 min``). Negative spans
    count as 0; None or a non-finite one is ``—``.

    >>> fmt_duration(42.2), fmt_duration(750), fmt_duration(25427.07), fmt_duration(2542707.4, day=" days")
    ('42 s', '12.5 min', '7.1 h', '29.4 days')
    >>> fmt_duration(5060, minute_digits=0), fmt_duration(8280, minute_digits=0), fmt_duration(None)
    ('84 min', '2.3 h', '—')
    """
    if seconds is None or not math.isfinite(float(seconds)):
        return "—"
    seconds = max(0.0, float(seconds))
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.{minute_digits}f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f}{day}"


def fmt_int(x: Any) -> str:
    """A count: ``1234`` → ``1,234``; None, NaN or pandas' NA → ``—``.

    >>> fmt_int(1234), fmt_int(None), fmt_int(float("nan"))
    ('1,234', '—', '—')
    """
    if x is None or (isinstance(x, float) and not math.isfinite(x)) or type(x).__name__ == "NAType":
        return "—"
    return f"{int(x):,}"


def fmt_rate(x: Any) -> str:
    """Tokens per second, compact: ``573.4`` → ``573``, ``41600`` → ``41,600``, ``804817`` → ``804.8k``,
    ``2.5e6`` → ``2.50M``; missing → ``—``.

    >>> [fmt_rate(x) for x in (573.44, 41_600.0, 804_817.0, 2_500_000.0, None)]
    ['573', '41,600', '804.8k', '2.50M', '—']
    """
    if x is None or not math.isfinite(float(x)):
        return "—"
    x = float(x)
    if abs(x) >= 1e6:
        return f"{x / 1e6:,.2f}M"
    if abs(x) >= 1e5:
        return f"{x / 1e3:,.1f}k"
    return f"{x:,.0f}"


def fmt_ranks(ranks: Any) -> str:
    """Ranks as runs of consecutive numbers: ``[0, 1, 2, 3, 8]`` → ``0–3, 8``.

    >>> fmt_ranks([8, 0, 1, 2, 3]), fmt_ranks([5]), fmt_ranks([])
    ('0–3, 8', '5', '')
    """
    out: list[str] = []
    values = sorted(set(ranks))
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}–{values[j]}")
        i = j + 1
    return ", ".join(out)


def fmt_bytes(x: Any) -> str:
    """Bytes in binary units (memory as ``nvidia-smi`` and ``free -h`` show it): ``5e8`` → ``477 MiB``,
    ``8.6e10`` → ``80.1 GiB``, ``1.2e12`` → ``1.09 TiB``; missing → ``—``.

    >>> [fmt_bytes(x) for x in (512, 5e8, 8.6e10, 1.2e12, None)]
    ['512 B', '477 MiB', '80.1 GiB', '1.09 TiB', '—']
    """
    if x is None or not math.isfinite(float(x)):
        return "—"
    x = float(x)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            v = x / size
            return f"{v:.2f} {unit}" if abs(v) < 10 else f"{v:.1f} {unit}" if abs(v) < 100 else f"{v:,.0f} {unit}"
    return f"{x:.0f} B"


def fmt_pct(x: Any) -> str:
    """A percentage: ``71.5`` → ``71.5%``; ``99.99`` → ``100%`` (six characters would not fit a KPI card).

    >>> fmt_pct(71.5), fmt_pct(99.986), fmt_pct(None)
    ('71.5%', '100%', '—')
    """
    if x is None or not math.isfinite(float(x)):
        return "—"
    return "100%" if float(x) >= 99.95 else f"{float(x):.1f}%"


def _small(x: float, prefix: str = "") -> str:
    """Below 10: two decimals, or two significant digits where those would round to 0 (0.0042)."""
    if x == 0 or abs(x) >= 0.01:
        return f"{prefix}{x:,.2f}"
    return f"{prefix}{x:.{1 - math.floor(math.log10(abs(x)))}f}"


def fmt_gpu_hours(x: Any) -> str:
    """GPU-hours, compact: ``0.0042`` → ``0.0042``, ``0.0375`` → ``0.04``, ``12.34`` → ``12.3``,
    ``1234.6`` → ``1,235``; missing → ``—``. The one format of GPU-hours everywhere (headline,
    card, dashboard), so a tiny cost never reads as ``0.0`` next to ``0.04`` on the same card.

    >>> [fmt_gpu_hours(x) for x in (0.0042, 0.0375, 12.34, 1234.6, None)]
    ['0.0042', '0.04', '12.3', '1,235', '—']
    """
    if x is None or not math.isfinite(float(x)):
        return "—"
    x = float(x)
    if abs(x) >= 1e3:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:,.1f}"
    return _small(x)


def fmt_usd(x: Any) -> str:
    """US dollars, compact: ``0.0042`` → ``$0.0042``, ``0.09375`` → ``$0.09``, ``12.3`` → ``$12.30``, from
    $1,000 without cents (``$1,235``), from $100k as ``$123k``; missing → ``—``.

    >>> [fmt_usd(x) for x in (0.0042, 0.09375, 12.3, 1234.6, 123_456.0, None)]
    ['$0.0042', '$0.09', '$12.30', '$1,235', '$123k', '—']
    """
    if x is None or not math.isfinite(float(x)):
        return "—"
    x = float(x)
    if abs(x) >= 1e5:
        return f"${x / 1e3:,.0f}k"
    if abs(x) >= 1e3:
        return f"${x:,.0f}"
    return _small(x, "$")


def fmt_cost(c: Mapping[str, Any], unit: str = "GPU-hours", sep: str = ", ") -> str:
    """GPU-hours and USD of a cost dict (``{"gpu_hours": …, "usd": … or None}``): ``0.04 GPU-hours, $0.09``
    (``unit="GPU-h", sep=" · "`` on the dashboard card); GPU-hours only without a price.

    Raises :class:`KeyError` without ``gpu_hours``.

    >>> fmt_cost({"gpu_hours": 0.0375, "usd": 0.09375}), fmt_cost({"gpu_hours": 12.34, "usd": None})
    ('0.04 GPU-hours, $0.09', '12.3 GPU-hours')
    """
    usd = c.get("usd")
    return f"{fmt_gpu_hours(c['gpu_hours'])} {unit}" + (f"{sep}{fmt_usd(usd)}" if usd is not None else "")


#: Alertmanager's duration grammar (``1h30m``, ``500ms``; prometheus/common model.ParseDuration).
_DURATION = re.compile(r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")
_DURATION_UNITS = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


def parse_duration(value: Any) -> float | None:
    """Seconds from an Alertmanager duration (``1h30m``, ``500ms``, ``0``) or a number; None when invalid.

    The grammar of Prometheus and Alertmanager (``y w d h m s ms``, largest first, integers), so a
    setting copied from an Alertmanager config means the same here. Negative, infinite and NaN
    values, booleans and other types are invalid.

    >>> parse_duration("1h30m"), parse_duration("30s"), parse_duration(2.5), parse_duration("5 minutes")
    (5400.0, 30.0, 2.5, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if 0 <= value < math.inf else None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text == "0":
        return 0.0
    m = _DURATION.match(text)
    if not text or not m or not any(m.groups()):
        return None
    return float(sum(int(g) * u for g, u in zip(m.groups(), _DURATION_UNITS, strict=True) if g))


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
