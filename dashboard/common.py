"""What the entry point and the pages share: the Redis client, the selected run, access, formatting."""

from __future__ import annotations

import getpass
import math
import os
from typing import Any

import pandas as pd
import redis
import streamlit as st

from trainhealth import config
from trainhealth.config import redact_url
from trainhealth.text import fmt_rate

#: Session-state key of the selected run id (set by ``app.py``, read by every page).
RUN_KEY = "th_run"
#: Session-state key of the resolved Redis URL (set by ``app.py``).
URL_KEY = "th_redis_url"
#: Session-state key: ``(run, status)`` as :func:`follow_run_status` last read it.
STATUS_SEEN_KEY = "th_status_seen"

#: Set (to ``1``) by ``trainhealth dashboard --read-only``: no button that writes to Redis. Read by
#: :func:`read_only` only.
READ_ONLY_ENV = "TRAINHEALTH_DASHBOARD_READ_ONLY"
#: Shown on top of every page of a read-only dashboard.
READ_ONLY_NOTE = (":material/lock: Read-only dashboard: silences, dead-letter resends and recommendation decisions "
                  "are made with the `trainhealth` commands (`silence`, `deadletters requeue`, `advise --set`).")
#: Appended to the OS user in the actor of a change made without a login (:func:`actor`).
NO_LOGIN = "(no login)"

NO_RUNS = ("No runs yet — start `trainhealth demo` or instrument a job with `trainhealth.Monitor` "
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


def read_only() -> bool:
    """True when the dashboard runs read-only (``$TRAINHEALTH_DASHBOARD_READ_ONLY``, set by ``--read-only``).

    Unset, empty, ``0``, ``false``, ``no`` and ``off`` mean writable; any other value read-only, so a typo
    errs on the safe side.
    """
    return os.environ.get(READ_ONLY_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def login_configured() -> bool:
    """True when Streamlit's secrets have an ``[auth]`` section: every page then requires ``st.login()``.

    A secrets file that exists but does not parse counts too: the dashboard stays locked rather than open
    (``trainhealth dashboard`` refuses to start with one).
    """
    try:
        return bool(st.secrets.get("auth"))
    except FileNotFoundError:  # StreamlitSecretNotFoundError: no secrets file, or one that does not parse
        from streamlit import config

        return any(os.path.isfile(p) for p in config.get_option("secrets.files"))


def logged_in() -> bool:
    """True when a login is configured and this session's user has logged in."""
    return login_configured() and bool(st.user.get("is_logged_in"))


def os_user() -> str:
    """The login name of the account the dashboard process runs as (``uid N`` when it has none)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry nor $USER
        return f"uid {os.getuid()}"


def actor() -> str:
    """Who makes a change from this session, as recorded in Redis (silence ``created_by``, recommendation
    history ``by``).

    With a login: the identity provider's e-mail of the logged-in user, else their name, else the OIDC
    subject. Without one: the OS user running the dashboard plus ``(no login)``, e.g. ``root (no login)`` —
    the dashboard cannot know who clicked, only that nobody logged in (docs/security.md).
    """
    if logged_in():
        user = st.user
        for claim in ("email", "name", "sub"):
            value = user.get(claim)
            if value:
                return str(value)
    return f"{os_user()} {NO_LOGIN}"


def current_run() -> str | None:
    """The run selected in the sidebar (shared by all pages through session state)."""
    return st.session_state.get(RUN_KEY)


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


def anomaly_delta(total: int, n_crit: int) -> str:
    """Sub-line of the active-anomalies card: ``of 3 total`` / ``of 4 · 1 critical`` (≤ 18 characters fit)."""
    if not n_crit:
        return f"of {total:,} total"
    text = f"of {total:,} · {n_crit:,} critical"
    return text if len(text) <= 18 else f"of {total:,} · {n_crit:,} crit."


def show_problems(problems: list[str]) -> None:
    """One warning per unreadable key (:mod:`trainhealth.dashboard.data` readers' ``problems``), each once."""
    for text in dict.fromkeys(problems):
        st.warning(text, icon=":material/report:")


def redis_trouble(exc: Exception) -> None:
    """Tell the user Redis went away mid-session; the live fragments retry on their own."""
    url = st.session_state.get(URL_KEY) or ""
    st.warning(f"Redis is unreachable at `{redact_url(url)}` ({exc}). Retrying on the next refresh.",
               icon=":material/cloud_off:")


# Three numbers answer "how good is this run" and on-call compared them as if they were one: the
# KPI labels, tooltips and the token chart say which is which (definitions: docs/goodput.md).
#: KPI label of ``goodput_pct``: the time-based goodput of Google's ML goodput.
GOODPUT_TIME = "Goodput (time)"
#: KPI label of ``goodput_tok_s`` (its delta slot says tokens/s).
GOODPUT_TOKENS = "Goodput (tokens)"
GOODPUT_TIME_HELP = ("Goodput (time) = productive seconds ÷ wall seconds since the run started: the productive "
                     "share of wall time, as Google's ML goodput counts it. Every kind of badput lowers it, waits "
                     "inside steps (straggler wait, data loading) included; the breakdown of wall time shows which.")
GOODPUT_TOKENS_HELP = ("Goodput tokens/s = tokens of the steps the model keeps ÷ wall seconds since the run started. "
                       "Throughput − goodput is tokens recomputed or discarded (redone, rolled-back or skipped steps) "
                       "plus time outside steps (start-up, checkpoints, restarts, hangs, idle). Badput inside steps "
                       "(straggler wait, data loading) slows throughput and goodput alike, so it is not in that gap: "
                       "it shows in Goodput (time) and the breakdown of wall time.")
THROUGHPUT_HELP = ("Throughput tokens/s = all tokens processed ÷ seconds spent inside steps (straggler and data "
                   "waits, skipped steps and steps later redone included): the tokens/s a framework prints.")
#: Under the throughput-vs-goodput chart: what its shaded gap is, and what it leaves out.
TOKEN_GAP_NOTE = ("Shaded gap = tokens recomputed or discarded (redone, rolled-back, skipped steps) and time "
                  "outside steps (start-up, checkpoints, restarts, hangs, idle). Straggler wait and data loading "
                  "slow both curves alike, so they are not in the gap: see Goodput (time) and the badput by cause.")

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


def status_moved(seen: tuple[str, str] | None, run: str, status: str) -> bool:
    """True when ``run``'s status differs from the one ``seen`` since the last full run (same run)."""
    return seen is not None and seen[0] == run and seen[1] != status
