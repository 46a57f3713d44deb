"""What the entry point and the pages share: the Redis client, the selected run, access, formatting."""

from __future__ import annotations

import getpass
import math
import os
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pandas as pd
import redis
import streamlit as st

from trainhealth import config, connection
from trainhealth.config import redact_url
from trainhealth.dashboard import data
from trainhealth.text import fmt_rate

#: Session-state key of the selected run id (set by ``app.py``, read by every page).
RUN_KEY = "th_run"
#: Session-state key of the resolved Redis URL (set by ``app.py``).
URL_KEY = "th_redis_url"
#: Session-state key: ``(run, status)`` as :func:`follow_run_status` last read it.
STATUS_SEEN_KEY = "th_status_seen"
#: Session-state key of the deep link's focus: ``(run, Focus)`` (set by the frame, read by the pages).
FOCUS_KEY = "th_focus"

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
    return connection.connect(url, socket_connect_timeout=2.0, socket_timeout=5.0)


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
                   "waits, skipped steps and steps later redone included): the tokens/s a framework prints. Tokens "
                   "counted for time with no step time in the records (an untimed first step, skipped stretches "
                   "of a log) are left out of both rates.")
#: Under the throughput-vs-goodput chart: what its shaded gap is, and what it leaves out.
TOKEN_GAP_NOTE = ("Shaded gap = tokens recomputed or discarded (redone, rolled-back, skipped steps) and time "
                  "outside steps (start-up, checkpoints, restarts, hangs, idle). Straggler wait and data loading "
                  "slow both curves alike, so they are not in the gap: see Goodput (time) and the badput by cause.")

RATE_ROWS = {"throughput": "throughput_tok_s", "goodput": "goodput_tok_s"}
RATE_HEADERS = {"60s": "last 1 min", "600s": "last 10 min", "3600s": "last 1 h"}
#: Marks a window longer than the run so far (its figure covers the whole run): one character in the header, and
#: :data:`RATE_YOUNGER_HELP` under the table says what it means.
RATE_YOUNGER = "*"
#: Markdown (the mark escaped: a leading "*" would make a bullet list of the caption).
RATE_YOUNGER_HELP = "\\* The run is younger than this window: the figure covers the whole run."


def rates_table(snap: dict) -> pd.DataFrame:
    """Throughput and goodput (tokens/s, formatted) for the whole run and the ledger's rolling windows; a window
    longer than the run so far is headed with :data:`RATE_YOUNGER` (``last 10 min*``)."""
    rates = snap.get("rates") or {}
    wall = snap.get("wall_s") or 0.0
    headers = {w: h + (RATE_YOUNGER if wall < float(w.rstrip("s")) else "") for w, h in RATE_HEADERS.items()}
    rows = {}
    for label, key in RATE_ROWS.items():
        row = {"whole run": fmt_rate(snap.get(key))}
        for w, header in headers.items():
            row[header] = fmt_rate((rates.get(w) or {}).get(key))
        rows[label] = row
    return pd.DataFrame.from_dict(rows, orient="index")


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|])")


def markdown_table(header: Sequence[Any], rows: Iterable[Sequence[Any]], right: Sequence[bool] = ()) -> str:
    """A GitHub-flavoured markdown table for ``st.markdown``: ``header`` and each row's cells as text, markdown's
    special characters escaped (a title with ``|`` or ``*`` stays one cell, as written) and line breaks flattened;
    ``right[i]`` right-aligns column ``i`` (figures).

    For small tables that need no sorting or selection: ``st.dataframe`` loads Streamlit's data-grid JavaScript
    (Arrow, the canvas grid) as soon as its element arrives, even inside a collapsed expander, and a page's first
    chart waited ~0.3 s behind it in headless Chromium (BENCHMARKS.md, issue 16).

    >>> print(markdown_table(["kind", "tokens/s"], [["a | b", "1,024"]], right=[False, True]))
    | kind | tokens/s |
    |---|---:|
    | a \\| b | 1,024 |
    """
    def cell(value: Any) -> str:
        return _MD_SPECIAL.sub(r"\\\1", str(value)).replace("\r", " ").replace("\n", " ")

    aligns = ["---:" if i < len(right) and right[i] else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def status_moved(seen: tuple[str, str] | None, run: str, status: str) -> bool:
    """True when ``run``'s status differs from the one ``seen`` since the last full run (same run)."""
    return seen is not None and seen[0] == run and seen[1] != status


# --- what a refresh that finds nothing new need not build again ---------------------------------------------------

_T = TypeVar("_T")
#: Session-state key prefix of :func:`reuse`'s values.
REUSE_PREFIX = "th_reuse:"


def reuse(name: str, signature: Hashable, build: Callable[[], _T]) -> _T:
    """``build()``, or what it returned on this session's previous call under ``name`` if ``signature`` (what the
    value is made of: entry ids, counts, the choices shown) is the same.

    Every live fragment rebuilds its charts every 2 s, and a Plotly figure of a whole run takes 10-40 ms to make;
    a refresh that finds no new step (a hung or stopped job, a job whose steps take longer than the refresh) keeps
    them. One value per name and session; callers keep ``build`` free of side effects.
    """
    key = REUSE_PREFIX + name
    kept = st.session_state.get(key)
    if kept is not None and kept[0] == signature:
        return kept[1]
    value = build()
    st.session_state[key] = (signature, value)
    return value


def frame_signature(frame: pd.DataFrame, columns: Sequence[str]) -> tuple:
    """The values of ``columns`` of a small frame (anomalies, checkpoints) as a hashable tuple, for :func:`reuse`."""
    if frame.empty:
        return ()
    return tuple(zip(*(map(repr, frame[c].tolist()) for c in columns), strict=True))


# --- anomaly kinds in words --------------------------------------------------------------------

#: Every anomaly kind (docs/anomalies.md) as the pages say it; :func:`kind_words` falls back for a new one.
KIND_WORDS = {
    "nan_inf": "NaN/Inf", "skipped_steps": "Skipped steps", "loss_spike": "Loss spike",
    "grad_norm_spike": "Grad-norm spike", "divergence": "Divergence", "grad_norm_explosion": "Grad-norm explosion",
    "straggler": "Straggler", "slow_node": "Slow node", "rank_outlier": "Rank outlier", "hang": "Hang",
    "dead_rank": "Dead rank", "data_loss": "Data loss", "throughput_drop": "Throughput drop",
    "slow_step": "Slow step", "restart": "Restart", "restart_storm": "Restart storm",
    "loss_collapse": "Loss collapse", "plateau": "Plateau", "memory_growth": "Memory growth",
    "network_slow": "Network (node)", "memory_imbalance": "Memory imbalance",
    "overfitting": "Over-fitting",
}


def kind_words(kind: Any) -> str:
    """``throughput_drop`` → ``Throughput drop``; an unknown kind in the same style, a missing one as ``?``."""
    if not isinstance(kind, str) or not kind:
        return "?"
    return KIND_WORDS.get(kind) or kind.replace("_", " ").capitalize()


# --- the deep link's focus: a step (range) and ranks ---------------------------------------------
# Alerts link to ``/anomalies?run=R&step=250-800&rank=5,6`` (trainhealth.alerts.notification.dashboard_link:
# ``step=START`` while the anomaly is open, no ``rank`` for a job-wide one). The frame parses the session's first
# URL into a :class:`Focus`, writes it back in canonical form (``step=N``, or ``step_from=A&step_to=B`` as the
# Overview's range reads it) and restores it after every page switch (Streamlit clears the query string then).

#: URL parameters of a focus.
FOCUS_PARAMS = ("step", "step_from", "step_to", "rank")
#: Most ranks a focus names (a restart names every rank of the job: no rank is meant then).
FOCUS_MAX_RANKS = 16
_STEP_RE = re.compile(r"^\s*(\d{1,16})\s*(?:([-–])\s*(\d{0,16})\s*)?$")
_MAX_STEP = 2**53


@dataclass(frozen=True)
class Focus:
    """Where a link points inside a run: steps ``step_from``–``step_to`` (inclusive; equal for one step, ``step_to``
    None for an open range) and ``ranks``; all empty when the link points nowhere in particular."""

    step_from: int | None = None
    step_to: int | None = None
    ranks: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return self.step_from is None and self.step_to is None and not self.ranks

    @property
    def has_step(self) -> bool:
        return self.step_from is not None or self.step_to is not None

    def bounds(self) -> tuple[int, int] | None:
        """``(first, last)`` step, an open end taken as the other end; None without steps."""
        lo = self.step_from if self.step_from is not None else self.step_to
        hi = self.step_to if self.step_to is not None else lo
        return None if lo is None or hi is None else (lo, hi)

    def params(self) -> dict[str, str]:
        """The canonical URL parameters: ``step=40`` for one step, ``step_from``/``step_to`` for a range,
        ``rank=3,5``."""
        out: dict[str, str] = {}
        if self.step_from is not None and self.step_from == self.step_to:
            out["step"] = str(self.step_from)
        else:
            if self.step_from is not None:
                out["step_from"] = str(self.step_from)
            if self.step_to is not None:
                out["step_to"] = str(self.step_to)
        if self.ranks:
            out["rank"] = ",".join(str(r) for r in self.ranks)
        return out

    def describe(self) -> str:
        """``step 40 · rank 3``, ``steps 250–800 · ranks 5, 6``, ``steps from 250``."""
        bits = []
        lo, hi = self.step_from, self.step_to
        if lo is not None and lo == hi:
            bits.append(f"step {lo:,}")
        elif lo is not None and hi is not None:
            bits.append(f"steps {lo:,}–{hi:,}")
        elif lo is not None:
            bits.append(f"steps from {lo:,}")
        elif hi is not None:
            bits.append(f"steps up to {hi:,}")
        if self.ranks:
            bits.append(("rank " if len(self.ranks) == 1 else "ranks ") + ", ".join(str(r) for r in self.ranks))
        return " · ".join(bits)


def parse_focus(params: Mapping[str, str]) -> tuple[Focus, list[str]]:
    """The :class:`Focus` of a link's query parameters, and one sentence per value ignored.

    ``step``: ``40``, ``250-800`` (or with an en dash) or ``250-`` (open); ``step_from`` / ``step_to`` set either end
    (over ``step``'s); a range given backwards is turned round. ``rank``: ``3`` or ``5,6``.

    >>> parse_focus({"step": "250-800", "rank": "5,6"})
    (Focus(step_from=250, step_to=800, ranks=(5, 6)), [])
    >>> parse_focus({"step": "40", "step_to": "x"})[0].params()
    {'step': '40'}
    """
    problems: list[str] = []
    lo = hi = None
    raw = params.get("step")
    if raw is not None:
        m = _STEP_RE.match(raw)
        if m is None or int(m[1]) > _MAX_STEP or (m[3] and int(m[3]) > _MAX_STEP):
            problems.append(f"The link's step {raw!r} is not a step or a step range (e.g. 40 or 250-800); ignored.")
        else:
            lo = int(m[1])
            hi = (int(m[3]) if m[3] else None) if m[2] else lo
    for name in ("step_from", "step_to"):
        raw = params.get(name)
        if raw is None:
            continue
        if not raw.strip().isdigit() or int(raw) > _MAX_STEP:
            problems.append(f"The link's {name} {raw!r} is not a step number; ignored.")
        elif name == "step_from":
            lo = int(raw)
        else:
            hi = int(raw)
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    ranks: list[int] = []
    raw = params.get("rank")
    if raw is not None:
        bad = [p for p in raw.split(",") if not p.strip().isdigit() or int(p) >= 2**20]
        if bad:
            problems.append(f"The link's rank {raw!r} is not a rank or a list of ranks (e.g. 3 or 5,6); "
                            + ("ignored." if len(bad) == len(raw.split(",")) else f"{', '.join(bad)} ignored."))
        ranks = sorted({int(p) for p in raw.split(",") if p.strip().isdigit() and int(p) < 2**20})
        if len(ranks) > FOCUS_MAX_RANKS:
            ranks = []
    return Focus(lo, hi, tuple(ranks)), problems


def current_focus(run: str | None = None) -> Focus:
    """The focus of the selected run (of ``run``, when given): empty when the link pointed nowhere or at
    another run."""
    stored = st.session_state.get(FOCUS_KEY)
    if not stored or (run is not None and stored[0] != run):
        return Focus()
    return stored[1]


def set_focus(run: str, focus: Focus) -> None:
    """Make ``focus`` the run's (a page picked an anomaly or a rank): in the session and the URL."""
    st.session_state[FOCUS_KEY] = (run, focus)
    for name in FOCUS_PARAMS:
        st.query_params.pop(name, None)
    for name, value in focus.params().items():
        st.query_params[name] = value


def anomaly_focus(step: Any, end_step: Any, ranks: Sequence[int]) -> Focus:
    """The focus of one anomaly: its steps (the onset alone while it is open, as an alert links it) and its
    ranks (none beyond :data:`FOCUS_MAX_RANKS`)."""
    lo = None if step is None or pd.isna(step) else int(step)
    hi = lo if end_step is None or pd.isna(end_step) else int(end_step)
    named = tuple(sorted(int(r) for r in ranks)) if len(ranks) <= FOCUS_MAX_RANKS else ()
    return Focus(lo, hi, named)


# --- page state kept in the URL --------------------------------------------------------------------

def _keep_choice(key: str, param: str) -> None:
    """A URL-kept widget changed: mirror its value in ``?param=`` and in the session (for page switches)."""
    value = st.session_state.get(key)
    text = ",".join(str(v) for v in value) if isinstance(value, list) else (value or "").strip()
    st.session_state[f"{key}:kept"] = text
    if text:
        st.query_params[param] = text
    else:
        st.query_params.pop(param, None)


def _kept_text(key: str, param: str) -> str:
    """The widget's value as the URL says it, else as it was before a page switch cleared the URL (written back)."""
    text = st.query_params.get(param)
    if text is None:
        text = st.session_state.get(f"{key}:kept", "")
        if text:
            st.query_params[param] = text
    st.session_state[f"{key}:kept"] = text
    return text


def url_multiselect(where: Any, label: str, options: Sequence[Any], *, param: str, key: str,
                    format_func: Callable[[Any], str] = str, placeholder: str | None = None) -> list[Any]:
    """A multiselect whose choice is kept in the URL as ``?param=a,b`` (so a link opens it) and across page
    switches; values of the URL that are no option are ignored. Returns the chosen options."""
    by_text = {str(o): o for o in options}
    chosen = [by_text[v] for v in dict.fromkeys(_kept_text(key, param).split(",")) if v in by_text]
    if st.session_state.get(key) != chosen:
        st.session_state[key] = chosen
    where.multiselect(label, list(options), key=key, format_func=format_func, placeholder=placeholder,
                      on_change=_keep_choice, args=(key, param))
    return chosen


def url_text_input(where: Any, label: str, *, param: str, key: str, placeholder: str | None = None) -> str:
    """A text input kept in the URL as ``?param=`` and across page switches. Returns the text, stripped."""
    text = _kept_text(key, param)
    if st.session_state.get(key) != text:
        st.session_state[key] = text
    where.text_input(label, key=key, placeholder=placeholder, on_change=_keep_choice, args=(key, param))
    return text.strip()


def select_table(data: Any, ids: Sequence[Any], chosen: Any, key: str, **kwargs: Any) -> tuple[Any, bool]:
    """``st.dataframe(data, **kwargs)`` with exactly one row selected: the row of ``chosen`` (``ids`` names each
    row), the first when ``chosen`` is not among them. Returns the id of the selected row (None without rows)
    and whether the user just clicked it.

    The grid keeps its selection by position, so when ``chosen``'s row moves (new rows on a refresh, other
    filters) the grid is drawn anew (its key changes) with that row selected.
    """
    ids = list(ids)
    pos = ids.index(chosen) if chosen in ids else (0 if ids else None)
    epoch, seen = f"{key}:epoch", f"{key}:pos"
    if st.session_state.get(seen) != (pos, len(ids)):
        st.session_state[epoch] = st.session_state.get(epoch, 0) + 1
        st.session_state[seen] = (pos, len(ids))
    event = st.dataframe(data, key=f"{key}:{st.session_state[epoch]}", on_select="rerun",
                         selection_mode="single-row-required",
                         selection_default={"selection": {"rows": [pos]}} if pos is not None else None, **kwargs)
    rows = [r for r in event.selection.rows if r < len(ids)]
    if rows and rows[0] != pos:
        st.session_state[seen] = (rows[0], len(ids))
        return ids[rows[0]], True
    return (None if pos is None else ids[pos]), False


# --- wall-clock charts opened around the link's steps ----------------------------------------------

#: Wall time shown either side of the link's steps on a wall-clock chart (s), at least.
FOCUS_PAD_S = 300.0
#: The steps' times are re-read at most this often (s): they do not change.
STEP_TIMES_TTL_S = 60


@st.cache_data(ttl=STEP_TIMES_TTL_S, show_spinner=False)
def _step_times(url: str, run: str, lo: int, hi: int) -> tuple[float, float] | None:
    return data.step_times(get_client(url), run, lo, hi)


def zoom_to_focus(fig: Any, run: str, tz: str, shown_t: pd.Series) -> Any:
    """A wall-clock chart (``shown_t``: the unix times it draws) opened around the link's steps: from the first
    one's start to the last one's end, ± max(:data:`FOCUS_PAD_S`, their span / 2), when the run has those steps
    and the chart covers that time. The user's zoom is kept across refreshes (``uirevision`` per link)."""
    bounds = current_focus(run).bounds()
    if bounds is None or shown_t.empty:
        return fig
    try:
        times = _step_times(st.session_state.get(URL_KEY, ""), run, *bounds)
    except redis.RedisError:
        return fig  # the page's own reads say that Redis is unreachable
    if times is None:
        return fig
    pad = max(FOCUS_PAD_S, (times[1] - times[0]) / 2)
    lo, hi = times[0] - pad, times[1] + pad
    if hi < float(shown_t.min()) or lo > float(shown_t.max()):
        return fig  # the chart's window does not reach the link's steps

    def local(t: float) -> str:  # Plotly draws wall-clock strings in the viewer's zone (charts._local_times)
        return pd.Timestamp(t, unit="s", tz="UTC").tz_convert(tz).tz_localize(None).isoformat()

    fig.update_xaxes(range=[local(lo), local(hi)])
    fig.update_layout(uirevision=f"{fig.layout.uirevision}|steps {bounds[0]}-{bounds[1]}")
    return fig
