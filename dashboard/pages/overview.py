"""Overview page: open rollback recommendations, a banner while the job is hung, crashed or just restarted, KPIs,
loss/grad-norm curves with anomaly markers, goodput over time, badput."""

from __future__ import annotations

import math
import time

import pandas as pd
import redis
import streamlit as st

from trainhealth.dashboard import cards, charts, data
from trainhealth.dashboard.common import (
    GOODPUT_TIME,
    GOODPUT_TIME_HELP,
    GOODPUT_TOKENS,
    GOODPUT_TOKENS_HELP,
    THROUGHPUT_HELP,
    TOKEN_GAP_NOTE,
    URL_KEY,
    anomaly_delta,
    client,
    get_client,
    redis_trouble,
    show_problems,
    viewer_tz,
)
from trainhealth.dashboard.frame import page_run
from trainhealth.defaults import DASHBOARD_REFRESH_S, DASHBOARD_STEPS
from trainhealth.job import JobState
from trainhealth.text import fmt_duration, fmt_int, fmt_pct, fmt_rate, fmt_usd, plural

#: Slow-moving reads (checkpoint markers, hour-long ledger history) are re-read at most this
#: often (s) instead of on every 2 s refresh; the KPIs and loss curve stay fully live.
SLOW_TTL_S = 10


@st.cache_data(ttl=SLOW_TTL_S, show_spinner=False)
def _checkpoints(url: str, run: str) -> pd.DataFrame:
    return data.events(get_client(url), run)


@st.cache_data(ttl=SLOW_TTL_S, show_spinner=False)
def _ledger_history(url: str, run: str) -> tuple[pd.DataFrame, list[str]]:
    problems: list[str] = []  # cached with the frame: the warnings must outlive the read
    return data.ledger_history(get_client(url), run, problems=problems), problems


def _at_step(step: int | None) -> str:
    return f"at step {fmt_int(step)}" if step is not None else "before the first step"


def _dash(message: str) -> str:
    """`` — message`` (its trailing full stop dropped: a sentence follows), or nothing."""
    message = message.strip().rstrip(".")
    return f" — {message}" if message else ""


def _lead(head: str, state: JobState) -> str:
    """``head — message``; a message that starts with the state's own word (the service's ``crashed at step 190,
    rank 1 first (host n1, pid 7): …``) already says what the head would, so it leads alone, capitalised."""
    message = state.message.strip().rstrip(".")
    if message.lower().startswith(state.state + " "):
        return message[0].upper() + message[1:]
    return head + _dash(message)


def job_banner_text(state: JobState | None, now: float) -> str | None:
    """The banner for a hung, crashed or restarted job (:func:`trainhealth.dashboard.data.job_state`), else None."""
    if state is None or state.state not in ("hung", "crashed", "restarted"):
        return None
    c = state.culprit
    age = fmt_duration(now - state.since)
    if state.state == "hung":
        # Always our own head: the hang detector's message ("rank 2 has not completed a step for 300 s") has no age.
        text = f"Hung for {age} {_at_step(state.step)}{_dash(state.message)}."
        if c is not None:
            why = c.why.strip().rstrip(".")
            text += f" Culprit: {c.name()} stopped first" + (f": {why}." if why else ".")
            if c.pid is not None:
                where = f"host {c.host}" if c.host else "its host"
                text += f" See where it is stuck: `py-spy dump --pid {c.pid}` on {where}."
        return text
    if state.state == "crashed":
        first = (f", rank {c.rank} first" + (f" (host {c.host})" if c.host else "")) if c is not None else ""
        return _lead(f"Crashed {_at_step(state.step)}{first}", state) + f". Last heard from {age} ago."
    gen = f" (restart generation {state.gen})" if state.gen else ""
    head = f"Restarted at step {fmt_int(state.step)}" if state.step is not None else "Restarted"
    return _lead(head, state) + f". It came back {age} ago{gen}."


def job_banner(state: JobState | None) -> None:
    """A red banner while the job is hung or crashed, a yellow one for a while after it restarted."""
    text = job_banner_text(state, time.time())
    if text is None:
        return
    if state is not None and state.state == "restarted":
        st.warning(text, icon=":material/restart_alt:")
    else:
        st.error(text, icon=":material/error:")


def stalled_throughput(snap: dict, state: JobState | None) -> tuple[float | None, str, str] | None:
    """While the job is hung or crashed: the throughput card's value, sub-line and help prefix; None otherwise.

    The whole-run throughput (tokens ÷ seconds inside steps) does not move while no step runs, so
    during a hang it would still read the healthy rate, as if the job trained. The ledger's 60 s
    window is what the job does now (0 when no step completed in the last minute): that is shown,
    in red. A snapshot without that window shows the whole-run value, labelled as the rate before the stop.
    """
    if state is None or state.state not in ("hung", "crashed"):
        return None
    whole = snap.get("throughput_tok_s")
    window = ((snap.get("rates") or {}).get("60s") or {}).get("throughput_tok_s")
    if window is not None:
        return window, "tokens/s, last min", (
            f"The job is {state.state}: tokens/s of the steps completed in the last minute (0 when none); over the "
            f"whole run {fmt_rate(whole)} tokens/s. ")
    before = "before the hang" if state.state == "hung" else "before the crash"
    return whole, before, f"The job is {state.state}: the whole run's tokens/s up to the stop, {before}. "


def kpis(snap: dict | None, anomalies: pd.DataFrame, meta: dict, state: JobState | None = None) -> None:
    """The KPI strip: throughput, goodput (tokens/s and time), anomalies (active of total), badput cost.

    No step card: the status line right above names the newest step and restart generation, and
    the room goes to labels that say which goodput is which (``Goodput (tokens)`` and
    ``Goodput (time)`` with their help icons do not fit six cards at 1,366 px)."""
    active = anomalies[anomalies["status"] == "active"] if not anomalies.empty else anomalies
    n_crit = int((active["severity"] == "critical").sum()) if not active.empty else 0
    tokens = data.has_token_counts(snap)
    snap = snap or {}
    # Short labels and compact values so five cards fit a 1,366 px screen; units go in the
    # grey sub-line (the metric's delta slot, arrow off).
    unit = {"delta_color": "gray", "delta_arrow": "off", "border": True}
    cols = st.columns(5)
    no_tokens = "The run reported no token counts (e.g. a replayed log without them), so there is no tokens/s."
    # Hung or crashed: the last minute's rate (0 while nothing completes), not the frozen healthy whole-run value.
    stalled = stalled_throughput(snap, state) if tokens else None
    if stalled is not None:
        rate, sub, why = stalled
        cols[0].metric("Throughput", fmt_rate(rate), delta=sub, delta_color="red", delta_arrow="off", border=True,
                       help=why + THROUGHPUT_HELP)
    else:
        cols[0].metric("Throughput", fmt_rate(snap.get("throughput_tok_s")) if tokens else "n/a",
                       delta="tokens/s" if tokens else "no token counts", **unit,
                       help=THROUGHPUT_HELP + ("" if tokens else " " + no_tokens))
    cols[1].metric(GOODPUT_TOKENS, fmt_rate(snap.get("goodput_tok_s")) if tokens else "n/a",
                   delta="tokens/s" if tokens else "no token counts", **unit,
                   help=GOODPUT_TOKENS_HELP + ("" if tokens else " " + no_tokens))
    cols[2].metric(GOODPUT_TIME, fmt_pct(snap.get("goodput_pct")), delta="productive time", **unit,
                   help=GOODPUT_TIME_HELP)
    # "Active anomalies" fits a 1,366 px card only without a help icon. The total counts resolved
    # anomalies too, restarts included (they are recorded already resolved).
    total = len(anomalies)
    cols[3].metric("Active anomalies", str(len(active)), delta=anomaly_delta(total, n_crit),
                   delta_color="red" if n_crit else "gray", delta_arrow="off", border=True)
    cost = snap.get("badput_cost_usd")
    if cost is not None:
        price = snap.get("gpu_hour_usd") or meta.get("gpu_hour_usd")
        cols[4].metric("Badput cost", fmt_usd(cost), delta=f"at ${price:g}/GPU-h" if price else None, **unit,
                       help="USD spent on badput: non-productive wall time × ranks × the GPU-hour price.")
    else:
        badput_s = (snap.get("wall_s") or math.nan) - ((snap.get("seconds") or {}).get("productive") or 0.0)
        cols[4].metric("Badput time", fmt_duration(badput_s, minute_digits=0), delta="no price set", **unit,
                       help="Wall time not spent productively. Set `gpu_hour_usd` on the Monitor for USD cost.")


def shown_status(meta: dict, state: JobState | None) -> str:
    """The run's status: the detector service's judgement (hung, crashed, restarted, finished) over the meta's.

    The meta's ``status`` is what the ranks said (``running`` from their start until ``Monitor.close()``), so a
    hung or crashed job still says ``running`` there. A job state of ``running`` does not override the meta: a
    ``close(status=...)`` the service has not judged yet is newer.
    """
    if state is not None and state.state != "running":
        return state.state
    return meta.get("status") or "unknown"


def status_line(steps: pd.DataFrame, meta: dict, state: JobState | None = None) -> None:
    """How fresh the data is: an on-call's first question."""
    bits = [f"status **{shown_status(meta, state)}**"]
    if not steps.empty:
        last = steps.iloc[-1]
        if pd.notna(last["t_end"]):
            bits.append(f"step {fmt_int(last['step'])} ended {fmt_duration(time.time() - float(last['t_end']))} ago")
        if pd.notna(last["n_ranks"]) and meta.get("world_size"):
            bits.append(f"{int(last['n_ranks'])}/{plural(meta['world_size'], 'rank')} reported it")
        if pd.notna(last["gen"]) and int(last["gen"]) > 0:
            bits.append(f"restart generation {int(last['gen'])}")
    if meta.get("gpu_hour_usd"):
        bits.append(f"${meta['gpu_hour_usd']:g}/GPU-hour")
    st.caption(" · ".join(bits) + f" · refreshes every {DASHBOARD_REFRESH_S:g} s")


def ledger_caption(snap: dict) -> str | None:
    """Under the badput chart: productive seconds of wall time, restarts, logged steps kept of done."""
    productive = (snap.get("seconds") or {}).get("productive")
    if productive is None or not snap.get("wall_s"):
        return None
    bits = [f"Productive: {productive:,.1f} s of {snap['wall_s']:,.1f} s wall time"]
    if snap.get("restarts") is not None:
        bits.append(plural(snap["restarts"], "restart"))
    if snap.get("steps_good") is not None and snap.get("steps_done") is not None:
        # Counts of logged steps: a log that records every 2nd step has half as many as the step number.
        bits.append(f"{plural(snap['steps_good'], 'logged step')} kept of {fmt_int(snap['steps_done'])} done")
    return " · ".join(bits)


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def banner(run: str) -> None:
    """The job-state banner, first on the page (above the recommendation cards): a hung or crashed job is the news."""
    problems: list[str] = []
    try:
        state = data.job_state(client(), run, problems)
    except redis.RedisError:
        return  # the live part below says Redis is away
    job_banner(state)


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def live(run: str) -> None:
    """Everything that updates: re-run alone every ``DASHBOARD_REFRESH_S`` seconds."""
    url = st.session_state.get(URL_KEY, "")
    problems: list[str] = []
    try:
        cl = client()
        meta = data.run_meta(cl, run, problems)
        steps = data.recent_steps(cl, run, DASHBOARD_STEPS, with_busy=False, problems=problems)
        snap = data.ledger_latest(cl, run, problems)
        state = data.job_state(cl, run, problems)
        anomalies = data.anomalies(cl, run, problems)
        checkpoints = _checkpoints(url, run)
        history, history_problems = _ledger_history(url, run)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return

    status_line(steps, meta, state)
    show_problems([*problems, *history_problems])
    kpis(snap, anomalies, meta, state)

    if steps.empty:
        st.info("No aggregated steps yet for this run. The detector service (`trainhealth serve`) writes "
                "them as the ranks report steps.", icon=":material/hourglass_empty:")
    else:
        fig = charts.training_curves(steps, anomalies, checkpoints)
        fig.update_layout(uirevision=run)  # keep the user's zoom across refreshes
        st.plotly_chart(fig, config={"displaylogo": False}, key="curves")

    left, right = st.columns([3, 2])
    with left:
        if history.empty:
            st.info("No goodput ledger snapshots yet.", icon=":material/hourglass_empty:")
        elif not data.has_token_counts(snap):
            st.info("No token counts in this run (e.g. a replayed log without them), so there is no "
                    "throughput or goodput in tokens/s. Goodput (time) and the badput breakdown still apply.",
                    icon=":material/info:")
        else:
            fig = charts.goodput_over_time(history, viewer_tz())
            fig.update_layout(uirevision=run)
            st.plotly_chart(fig, config={"displaylogo": False}, key="goodput")
            st.caption(TOKEN_GAP_NOTE)
    with right:
        if snap:
            breakdown = data.badput_seconds(snap)
            # Bars only for categories that show as at least 0.1 s; the rest are named below.
            shown = breakdown[breakdown["seconds"] >= 0.05]
            if shown.empty:
                st.info("No badput so far: all wall time was productive.", icon=":material/check_circle:")
            else:
                fig = charts.badput_bar(shown, snap.get("wall_s"))
                st.plotly_chart(fig, config={"displaylogo": False}, key="badput")
            caption = ledger_caption(snap)
            if caption:
                st.caption(caption)
            rest = [charts.label(c) for c in breakdown.loc[breakdown["seconds"] < 0.05, "category"]]
            if rest and not shown.empty:
                st.caption("0.0 s: " + ", ".join(rest))


run = page_run()
if run:
    st.subheader(f"{run} · overview")
    banner(run)
    cards.recommendation_cards(run, "overview")
    live(run)
