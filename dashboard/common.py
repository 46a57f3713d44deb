"""What the entry point and the pages share: the Redis client, the selected run, formatting."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pandas as pd
import redis
import streamlit as st

from trainhealth import config
from trainhealth.text import plural  # noqa: F401 - re-exported: the pages import it from here

#: Session-state key of the selected run id (set by ``app.py``, read by every page).
RUN_KEY = "th_run"
#: Session-state key of the resolved Redis URL (set by ``app.py``).
URL_KEY = "th_redis_url"

NO_RUNS = ("No runs yet — start `trainhealth demo` or instrument a job with `collectors.Monitor` "
           "(and run `trainhealth serve` to aggregate it).")


@st.cache_resource(show_spinner=False)
def get_client(url: str) -> redis.Redis:
    """One pooled Redis client per URL for the whole server process (shared by all sessions).

    Short timeouts: a dashboard refresh should fail fast and say so rather than hang.
    """
    return redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=5.0,
                                health_check_interval=30)


def resolve_url() -> str | None:
    """Redis URL from ``TRAINHEALTH_REDIS_URL`` or the embedded server; None when neither."""
    return config.redis_url()


def client() -> redis.Redis:
    """The client of the URL ``app.py`` resolved for this run of the script."""
    url = st.session_state.get(URL_KEY) or resolve_url()
    if not url:
        raise redis.ConnectionError("no Redis URL configured")
    return get_client(url)


def current_run() -> str | None:
    """The run selected in the sidebar (shared by all pages through session state)."""
    return st.session_state.get(RUN_KEY)


def redact_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` → ``redis://user:***@host:6379/0`` (for display)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


def viewer_tz() -> str:
    """The browser's IANA time zone (``st.context.timezone``), UTC when unknown."""
    try:
        return st.context.timezone or "UTC"
    except Exception:  # older/embedded contexts without it: UTC is a safe, labelled default
        return "UTC"


def to_datetime(t: pd.Series | float | None, tz: str) -> Any:
    """Unix seconds → tz-aware datetime(s) in ``tz`` (NaT/None for missing)."""
    if isinstance(t, pd.Series):
        return pd.to_datetime(t, unit="s", utc=True).dt.tz_convert(tz)
    if t is None or (isinstance(t, float) and math.isnan(t)):
        return None
    return pd.Timestamp(t, unit="s", tz="UTC").tz_convert(tz)


def fmt_int(x: Any) -> str:
    """``1234`` → ``1,234``; missing → ``—``."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)) or x is pd.NA:
        return "—"
    return f"{int(x):,}"


def anomaly_delta(total: int, n_crit: int) -> str:
    """Sub-line of the active-anomalies card: ``of 3 total`` / ``of 4 · 1 critical`` (≤ 18 characters fit)."""
    if not n_crit:
        return f"of {total:,} total"
    text = f"of {total:,} · {n_crit:,} critical"
    return text if len(text) <= 18 else f"of {total:,} · {n_crit:,} crit."


def fmt_rate(x: Any) -> str:
    """Tokens/s, compact: ``573.4`` → ``573``, ``41600`` → ``41,600``, ``804817`` → ``804.8k``,
    ``2.5e6`` → ``2.50M``."""
    if x is None or not math.isfinite(float(x)):
        return "—"
    x = float(x)
    if abs(x) >= 1e6:
        return f"{x / 1e6:,.2f}M"
    if abs(x) >= 1e5:
        return f"{x / 1e3:,.1f}k"
    return f"{x:,.0f}"


def fmt_pct(x: Any) -> str:
    """``71.5`` → ``71.5%``; ``99.99`` → ``100%`` (six characters would not fit a KPI card)."""
    if x is None or not math.isfinite(float(x)):
        return "—"
    return "100%" if float(x) >= 99.95 else f"{float(x):.1f}%"


def fmt_usd(x: Any) -> str:
    """``12.3`` → ``$12.30``; from $1,000 without cents (``$1,235``), from $100k as ``$123k``."""
    if x is None or not math.isfinite(float(x)):
        return "—"
    x = float(x)
    if abs(x) >= 1e5:
        return f"${x / 1e3:,.0f}k"
    if abs(x) >= 1e3:
        return f"${x:,.0f}"
    return f"${x:,.2f}"


def fmt_gpu_hours(x: Any) -> str:
    """GPU-hours, compact: ``0.0312`` → ``0.03``, ``12.34`` → ``12.3``, ``1234.5`` → ``1,235``; missing → ``—``."""
    if x is None or not math.isfinite(float(x)):
        return "—"
    x = float(x)
    if abs(x) >= 1e3:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:,.1f}"
    return f"{x:,.2f}"


def fmt_age(seconds: float) -> str:
    """Seconds → ``42 s`` / ``3.5 min`` / ``2.0 h`` / ``3.1 d``."""
    if not math.isfinite(seconds):
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def fmt_duration(seconds: Any) -> str:
    """Seconds, short enough for a KPI card: ``115 s`` / ``84 min`` / ``2.3 h`` / ``3.1 d``."""
    if seconds is None or not math.isfinite(float(seconds)):
        return "—"
    seconds = max(0.0, float(seconds))
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def redis_trouble(exc: Exception) -> None:
    """Tell the user Redis went away mid-session; the live fragments retry on their own."""
    url = st.session_state.get(URL_KEY) or ""
    st.warning(f"Redis is unreachable at `{redact_url(url)}` ({exc}). Retrying on the next refresh.",
               icon=":material/cloud_off:")


RATE_ROWS = {"throughput": "throughput_tok_s", "goodput": "goodput_tok_s"}
RATE_HEADERS = {"60s": "last 1 min", "600s": "last 10 min", "3600s": "last 1 h"}


def rates_table(snap: dict) -> pd.DataFrame:
    """Throughput and goodput (tokens/s, formatted) for the whole run and the ledger's rolling windows."""
    rates = snap.get("rates") or {}
    wall = snap.get("wall_s") or 0.0
    # A window longer than the run so far covers the whole run: say so instead of implying a full window.
    headers = {w: h + (" (run younger: whole run)" if wall < float(w.rstrip("s")) else "")
               for w, h in RATE_HEADERS.items()}
    rows = {}
    for label, key in RATE_ROWS.items():
        row = {"whole run": fmt_rate(snap.get(key))}
        for w, header in headers.items():
            row[header] = fmt_rate((rates.get(w) or {}).get(key))
        rows[label] = row
    return pd.DataFrame.from_dict(rows, orient="index")
