"""Overview page: open rollback recommendations, KPIs, loss/grad-norm curves with anomaly markers,
goodput over time, badput."""

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


def kpis(snap: dict | None, anomalies: pd.DataFrame, meta: dict) -> None:
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


def status_line(steps: pd.DataFrame, meta: dict) -> None:
    """How fresh the data is: an on-call's first question."""
    bits = [f"status **{meta.get('status') or 'unknown'}**"]
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
def live(run: str) -> None:
    """Everything that updates: re-run alone every ``DASHBOARD_REFRESH_S`` seconds."""
    url = st.session_state.get(URL_KEY, "")
    problems: list[str] = []
    try:
        cl = client()
        meta = data.run_meta(cl, run, problems)
        steps = data.recent_steps(cl, run, DASHBOARD_STEPS, with_busy=False, problems=problems)
        snap = data.ledger_latest(cl, run, problems)
        anomalies = data.anomalies(cl, run, problems)
        checkpoints = _checkpoints(url, run)
        history, history_problems = _ledger_history(url, run)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return

    status_line(steps, meta)
    show_problems([*problems, *history_problems])
    kpis(snap, anomalies, meta)

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
    cards.recommendation_cards(run, "overview")
    live(run)
