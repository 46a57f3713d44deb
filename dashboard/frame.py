"""The frame around every page: navigation, the Redis connection and the run picker.

``app.py`` calls :func:`navigation` and :func:`sidebar` and then runs the selected page. A
page file starts with :func:`page_run`, which returns the selected run and, when the page
was executed *without* ``app.py``, builds the frame itself. That happens because a
``pages/`` directory next to the entry point switches Streamlit to its legacy multipage
mode until the first ``st.navigation`` call of the server process (so for the first
request after start, e.g. a bookmarked ``/ranks?run=x``) and in every ``AppTest`` run:
Streamlit then executes ``pages/<name>.py`` directly for the URL path ``<name>``.

Either way :func:`sidebar` runs first, and it starts with :func:`access`: with ``[auth]`` in Streamlit's
secrets nothing else renders before the user has logged in, and a read-only dashboard says so on top of
every page (docs/security.md).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import redis
import streamlit as st
from streamlit.errors import StreamlitAuthError
from streamlit.navigation.page import StreamlitPage

from trainhealth.config import redact_url
from trainhealth.dashboard import data
from trainhealth.dashboard.common import (
    FOCUS_KEY,
    FOCUS_PARAMS,
    NO_RUNS,
    READ_ONLY_NOTE,
    RUN_KEY,
    STATUS_SEEN_KEY,
    URL_KEY,
    Focus,
    actor,
    client,
    current_focus,
    current_run,
    get_client,
    logged_in,
    login_configured,
    parse_focus,
    read_only,
    resolve_url,
    set_focus,
    status_moved,
)
from trainhealth.defaults import DASHBOARD_REFRESH_S
from trainhealth.exceptions import ConfigError
from trainhealth.keys import RUNS, validate_run_id
from trainhealth.text import fmt_duration, fmt_int, plural

HERE = Path(__file__).resolve().parent
_PICKER = "th_run_picker"
#: Set by app.py right before it runs a page, consumed by the page's :func:`page_run`.
_FRAMED = "th_framed"
#: Session-state key of the landing page (``runs`` or ``overview``), decided at the session's first page.
_LANDING = "th_landing"
#: The detector-service banner re-checks this often (s); its two reads are cached as long, so
#: every open page together costs one SCAN + MGET (+ one HGETALL/XREVRANGE per run) per period.
SERVICE_CHECK_S = 5.0
LOGIN_REQUIRED = "This dashboard requires a login: changes made here are recorded under your identity."
SERVICE_DOWN = ("Detector service not running: anomalies and goodput are not updating — start "
                "`trainhealth serve`.")


def page_config() -> None:
    """Wide layout and the tab title (may be called more than once per run)."""
    # An emoji icon is drawn in place (an inline SVG); a Material one is fetched from fonts.gstatic.com, which an
    # air-gapped cluster's browser cannot reach.
    st.set_page_config(layout="wide", page_title="trainhealth", page_icon="🩺")


def _run_count() -> int | None:
    """Runs in the registry (one ``ZCARD``), None when Redis cannot say."""
    try:
        url = resolve_url()
        return int(get_client(url).zcard(RUNS)) if url else None
    except (ConfigError, redis.RedisError):
        return None


def landing() -> str:
    """The page at ``/``: ``runs`` when the registry has more than one run and the session's first URL names
    none, else ``overview``. Decided once per session (a run starting later does not move a user off the
    Overview), and not before the user has logged in."""
    if _LANDING not in st.session_state:
        if login_configured() and not logged_in():
            return "overview"
        if st.query_params.get("run"):
            st.session_state[_LANDING] = "overview"
        else:
            count = _run_count()
            if count is None:
                return "overview"  # decided once Redis answers
            st.session_state[_LANDING] = "runs" if count > 1 else "overview"
    return st.session_state[_LANDING]


def navigation() -> StreamlitPage:
    """Declare the pages (the :func:`landing` page is the default, at ``/``); returns the selected one. Hidden
    until the user has logged in when a login is configured (:func:`access`)."""
    hidden = login_configured() and not logged_in()
    home = landing()
    return st.navigation(position="hidden" if hidden else "sidebar", pages=[
        st.Page(HERE / "pages" / "runs.py", title="Runs", icon=":material/view_list:", default=home == "runs"),
        st.Page(HERE / "pages" / "overview.py", title="Overview", icon=":material/monitoring:",
                default=home == "overview"),
        st.Page(HERE / "pages" / "goodput.py", title="Goodput", icon=":material/savings:"),
        st.Page(HERE / "pages" / "ranks.py", title="Ranks", icon=":material/grid_view:"),
        st.Page(HERE / "pages" / "anomalies.py", title="Anomalies", icon=":material/warning:"),
        st.Page(HERE / "pages" / "alerts.py", title="Alerts", icon=":material/notifications:"),
    ])


def run_page(page: StreamlitPage) -> None:
    """Run the page ``navigation()`` selected, telling it the frame is already drawn."""
    st.session_state[_FRAMED] = True
    page.run()


def page_run(replay_note: bool = True) -> str | None:
    """First call of every page file: the selected run, or None when there is nothing to show.

    Also draws the detector-service banner (:func:`service_banner`) at the top of the page, and (unless
    ``replay_note`` is False: the Runs page is about every run) for a replayed run whose rates or timeline are
    not the log's measured ones the caveat of :func:`replay_banner`.
    """
    if st.session_state.pop(_FRAMED, False):
        run = current_run()
    else:
        # Executed directly by Streamlit's legacy pages/ mode: draw the frame here. Calling
        # st.navigation also ends that mode for the whole server process.
        page_config()
        navigation()
        run = current_run() if sidebar() else None
    if run:
        service_banner(run)
        if replay_note:
            replay_banner(run)
    return run


@st.cache_data(ttl=SERVICE_CHECK_S, show_spinner=False)
def _service_heartbeats(url: str) -> list[dict]:
    return data.service_heartbeats(get_client(url))


@st.cache_data(ttl=SERVICE_CHECK_S, show_spinner=False)
def _processing_state(url: str, run: str) -> dict:
    return data.processing_state(get_client(url), run)


def service_problem(beats: list[dict], state: dict, now: float, run: str = "") -> str | None:
    """The banner text for the service heartbeats and the run's processing state, None if healthy.

    Not running: no ``th:service:*`` heartbeat, or the newest older than
    :data:`trainhealth.dashboard.data.SERVICE_STALE_S`. Not processing: the ranks' heartbeats report steps
    completed well after the newest aggregate (:func:`trainhealth.dashboard.data.unprocessed_lag`).
    Detectors failing: a live service reports exceptions of ``run``'s detectors
    (:func:`trainhealth.dashboard.data.detector_errors`).
    """
    running = data.service_running(beats, now)
    lag = data.unprocessed_lag(state)
    failing = data.detector_errors(beats, run, now) if running else {}
    if running and lag is None and not failing:
        return None
    parts = []
    if failing:
        names = ", ".join(f"{name} ({plural(n, 'error')})" for name, n in sorted(failing.items()))
        parts.append(f"Detectors failing on this run: {names}. Their findings may be missing; the other "
                     f"detectors go on. The traceback is in the `trainhealth serve` log.")
    if not running:
        parts.append(SERVICE_DOWN)
        newest = beats[0] if beats and math.isfinite(beats[0]["t"]) else None
        if newest is not None:
            who = f"`{newest['consumer']}`" + (f" on {newest['host']}" if newest.get("host") else "")
            parts.append(f"Its last heartbeat ({who}) is {fmt_duration(now - newest['t'])} old.")
    if lag is not None:
        done = f"the ranks completed step {fmt_int(state['hb_step'])} ({fmt_duration(now - state['hb_step_t'])} ago)"
        if state.get("agg_step") is None:
            behind = "no step of this run has been aggregated"
        else:
            behind = (f"the newest aggregated step is {fmt_int(state['agg_step'])}, which ended "
                      f"{fmt_duration(lag)} before that")
        if running:
            parts.append(f"Steps arrive but the detector service is not processing this run: {done}, but "
                         f"{behind}. Check the `trainhealth serve` log (is it on this Redis?).")
        else:
            parts.append(f"Steps still arrive: {done}, but {behind}.")
    return " ".join(parts)


@st.fragment(run_every=SERVICE_CHECK_S)
def service_banner(run: str) -> None:
    """A warning on top of every page when the detector service is down or not processing ``run``."""
    url = st.session_state.get(URL_KEY, "")
    try:
        beats = _service_heartbeats(url)
        state = _processing_state(url, run)
    except redis.RedisError:
        return  # the page's own reads say that Redis is unreachable
    text = service_problem(beats, state, time.time(), run)
    if text:
        st.warning(text, icon=":material/sensors_off:")


@st.cache_data(ttl=SERVICE_CHECK_S, show_spinner=False)
def _replay_info(url: str, run: str) -> dict | None:
    return data.replay_info(get_client(url), run)


def replay_caveat(info: dict | None) -> str | None:
    """The caveat for a replayed run (:func:`trainhealth.dashboard.data.replay_info`), None when its figures are the
    log's.

    A paced replay (``speed`` k > 0, k != 1) stamps records with the real clock, so every rate is k times
    the log's; an assumed timeline (no step times in the log) makes goodput and rates an assumption.
    """
    if not info:
        return None
    src, k, tl = info["source"], info["speed"] or 0.0, info.get("timeline")
    parts = []
    if k > 0 and k != 1:
        own = f"{k:g}x lower" if k > 1 else f"{1 / k:.3g}x higher"
        span = f"{k:g}x shorter" if k > 1 else f"{1 / k:.3g}x longer"
        parts.append(f"Replayed from `{src}` at {k:g}x: rates are per second of replay (the log's own rates are "
                     f"{own}) and durations are replay time ({span} than in the log).")
    step = info.get("assumed_step_s")
    pace = f"{step:g} s per step" if step else "an assumed time per step"
    if tl in ("assumed", "partly assumed"):
        what = (f"the log has no step times: the timeline assumes {pace}, so goodput and rates are not measured."
                if tl == "assumed" else
                f"some of the log's steps have no step time: those assume {pace}, so goodput and rates are only "
                "partly measured.")
        parts.append(what[0].upper() + what[1:] if parts else f"Replayed from `{src}`; {what}")
    return " ".join(parts) or None


def replay_banner(run: str) -> None:
    """An info on top of every page when ``run`` is a replay whose rates or timeline are not the log's own."""
    try:
        info = _replay_info(st.session_state.get(URL_KEY, ""), run)
    except redis.RedisError:
        return  # the page's own reads say that Redis is unreachable
    text = replay_caveat(info)
    if text:
        st.info(text, icon=":material/history:")


def _picked() -> None:
    st.session_state[RUN_KEY] = st.session_state[_PICKER]
    set_focus(st.session_state[RUN_KEY], Focus())  # a link's step and rank were about the other run


def _run_label(runs: dict[str, dict], run: str) -> str:
    """``running · llama-7b``: the status first, so that a long run id is what the narrow sidebar cuts (the
    ranks are in the status line under the picker)."""
    info = runs.get(run) or {}
    return f"{info.get('status') or '?'} · {run}"


def sync_focus(run: str, link_run: str | None) -> Focus:
    """The deep link's focus (``step``/``step_from``/``step_to``, ``rank``) for ``run``, kept in the session.

    The session's first page takes it from the URL (each value that is not a step or rank is ignored with a
    warning; a link whose run is not the one shown points nowhere), and so does a later page whose URL's ``step``
    names another focus for the same run (a link inside the app: an incident's "Evidence"), in canonical form
    (:meth:`trainhealth.dashboard.common.Focus.params`); every later full run writes it back so (a page switch
    clears the query string; the Overview then replaces it by its own step range, which its link opens). Another
    run drops it.
    """
    stored = st.session_state.get(FOCUS_KEY)
    given = {k: st.query_params[k] for k in FOCUS_PARAMS if k in st.query_params}
    if stored is None or ("step" in given and stored[0] == run and given != stored[1].params()):
        # The session's first page, or a link inside the app (an incident's "Evidence", in a link's ``step=``
        # form) that names another focus: the URL's is taken. Else the URL and the session agree, a page switch
        # cleared the URL, or it holds the Overview's own chart range (``step_from``/``step_to``).
        focus, problems = parse_focus(given)
        for text in problems:
            st.warning(text, icon=":material/link_off:")
        set_focus(run, focus if not link_run or link_run == run else Focus())
    elif stored[0] != run:
        set_focus(run, Focus())
    else:
        canonical = stored[1].params()
        for name in FOCUS_PARAMS:
            if name in canonical and st.query_params.get(name) != canonical[name]:
                st.query_params[name] = canonical[name]
            elif name not in canonical and name in st.query_params:
                del st.query_params[name]
    return current_focus(run)


def _clear_focus() -> None:
    set_focus(st.session_state[RUN_KEY], Focus())


def access() -> None:
    """The login gate and the read-only note, before anything reads Redis.

    With ``[auth]`` in the secrets, a session that has not logged in sees only a "Log in" button and the
    script stops there (every page, however it was opened); a logged-in one sees who it is and "Log out" in
    the sidebar. A read-only dashboard (:func:`trainhealth.dashboard.common.read_only`) says so on top.
    """
    if login_configured():
        if not logged_in():
            st.info(LOGIN_REQUIRED, icon=":material/lock:")
            if st.button("Log in", icon=":material/login:", type="primary", key="th_login"):
                try:
                    st.login()  # a redirect to the identity provider
                except StreamlitAuthError as exc:  # [auth] incomplete, Authlib missing: say so, stay locked
                    st.error(f"Login is not set up correctly: {exc}", icon=":material/error:")
            st.stop()
        st.sidebar.caption(f"Logged in as **{actor()}**")
        if st.sidebar.button("Log out", icon=":material/logout:", key="th_logout"):
            st.logout()
    if read_only():
        st.caption(READ_ONLY_NOTE)


def sidebar() -> bool:
    """Check access (:func:`access`), connect, pick the run; True when a run is selected and the page can render."""
    access()
    try:
        url = resolve_url()
    except ConfigError as exc:
        st.error(str(exc), icon=":material/error:")
        return False
    if not url:
        st.error("No Redis configured: set `TRAINHEALTH_REDIS_URL` or start the embedded one with "
                 "`trainhealth serve` (or `trainhealth demo`).", icon=":material/error:")
        return False
    st.session_state[URL_KEY] = url
    shown_url = redact_url(url)
    client = get_client(url)

    wanted = st.query_params.get("run")
    problems: list[str] = []
    try:
        runs = data.list_runs(client, problems=problems)
        if RUN_KEY not in st.session_state and wanted:
            # First load of this session: a ?run= link picks the run, if it exists.
            try:
                validate_run_id(wanted)
            except ConfigError as exc:
                st.warning(f"The link's run is not valid: {exc}. Showing the newest run.",
                           icon=":material/link_off:")
            else:
                if wanted in set(runs["run"]) or data.run_exists(client, wanted):
                    st.session_state[RUN_KEY] = wanted
                else:
                    st.warning(f"Run `{wanted}` from the link is not in Redis; showing the newest run.",
                               icon=":material/link_off:")
        selected = st.session_state.get(RUN_KEY)
        extra = None  # meta of a selected run beyond the picker's list (opened by an old link)
        if selected and selected not in set(runs["run"]) and data.run_exists(client, selected):
            extra = data.run_meta(client, selected)
    except redis.RedisError as exc:
        st.sidebar.caption(f"Redis: `{shown_url}`")
        st.error(f"Redis is unreachable at `{shown_url}`: {exc}\n\nIs it running? `trainhealth serve` starts "
                 "the embedded server; `TRAINHEALTH_REDIS_URL` points at another one.",
                 icon=":material/cloud_off:")
        return False

    if runs.empty and extra is None:
        for text in problems:
            st.sidebar.warning(text, icon=":material/report:")
        st.sidebar.caption(f"Redis: `{shown_url}`")
        st.info(NO_RUNS, icon=":material/hourglass_empty:")
        return False

    info = {row["run"]: row for row in runs.to_dict("records")}
    options = list(runs["run"])
    if extra is not None and selected:
        # An old run opened by link (beyond the picker's RUNS_LIMIT newest): keep it selectable.
        info[selected] = {"run": selected, **extra}
        options.append(selected)
    if selected not in options:
        selected = options[0]
    info[selected] = {**info[selected], **_job_status(selected)}
    st.session_state[RUN_KEY] = selected
    # Re-seed the widget from our own key each run: a new run appearing in the list (or a
    # page switch) must never silently move the picker to another run.
    st.session_state[_PICKER] = selected

    sb = st.sidebar
    for text in problems:  # invalid ids in the registry: skipped, and said so
        sb.warning(text, icon=":material/report:")
    sb.selectbox("Run", options, key=_PICKER, on_change=_picked, format_func=lambda r: _run_label(info, r),
                 help="Newest first. The URL's `?run=` follows the selection, so links open this run.")
    st.query_params["run"] = selected
    focus = sync_focus(selected, wanted)
    # A full run: the picker was just drawn from fresh meta; the status fragment's first read is the baseline.
    st.session_state.pop(STATUS_SEEN_KEY, None)
    with sb:
        run_status(selected, info[selected])
    if not focus.empty:
        sb.caption(f"Link: {focus.describe()}", help="The link's step and rank: the Ranks page drills down to them, "
                   "the Anomalies page selects the anomaly there, the charts open around the step.")
        sb.button("Clear the link", key="th_focus_clear", on_click=_clear_focus, icon=":material/link_off:",
                  type="tertiary", help="Forget the link's step and rank.")
    sb.divider()
    sb.caption(f"Redis: `{shown_url}`")
    return True


def status_line(meta: dict, now: float) -> str:
    """The sidebar's one line about the selected run: status, ranks, age, source."""
    started = meta.get("started_at")
    bits = [f"**{meta.get('status') or 'unknown'}**"]
    if meta.get("world_size"):
        bits.append(plural(meta["world_size"], "rank"))
    if started:
        bits.append(f"started {fmt_duration(now - started)} ago")
    if meta.get("source"):
        bits.append(f"source `{meta['source']}`")
    return " · ".join(bits)


def _job_status(run: str) -> dict[str, str]:
    """``{"status": state}`` when the service judges the job hung, crashed or just restarted (its meta still says
    ``running``), else nothing: the picker and the status line say what the page's banner says."""
    try:
        state = data.job_state(client(), run)
    except redis.RedisError:
        return {}
    return {"status": state.state} if state is not None and state.state in ("hung", "crashed", "restarted") else {}


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def run_status(run: str, listed: dict) -> None:
    """The run's status line, re-read live (a run that crashes or ends changes status while watched).

    The picker's labels (``running · run``) are drawn on full runs only: when the status
    read here moves, the whole app reruns so that the picker says what the page says.
    """
    try:
        meta = {**listed, **data.run_meta(client(), run), **_job_status(run)}
    except redis.RedisError:
        meta = listed  # the page's own reads report the outage
    st.caption(status_line(meta, time.time()))
    status = meta.get("status") or "unknown"
    moved = status_moved(st.session_state.get(STATUS_SEEN_KEY), run, status)
    st.session_state[STATUS_SEEN_KEY] = (run, status)
    if moved:
        st.rerun(scope="app")


