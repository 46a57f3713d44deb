"""Goodput page: where the run's wall time and money went, from the goodput ledger (docs/goodput.md).

KPIs (goodput as a share of time, goodput and throughput tokens/s for the whole run and the last 1 min /
10 min / 1 h, badput cost in USD and GPU-hours), the breakdown of wall time by ledger
category over time, throughput vs goodput over time, and what each cause of badput cost;
and the rollback advisor's open recommendations (:mod:`trainhealth.dashboard.cards`) under the KPIs.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pandas as pd
import redis
import streamlit as st

from trainhealth.coverage import data_lost_text
from trainhealth.dashboard import charts, data, incidents
from trainhealth.dashboard.common import (
    GOODPUT_TIME,
    GOODPUT_TIME_HELP,
    GOODPUT_TOKENS,
    GOODPUT_TOKENS_HELP,
    RATE_YOUNGER,
    RATE_YOUNGER_HELP,
    THROUGHPUT_HELP,
    TOKEN_GAP_NOTE,
    URL_KEY,
    client,
    current_focus,
    get_client,
    markdown_table,
    rates_table,
    redis_trouble,
    reuse,
    show_problems,
    to_datetime,
    viewer_tz,
    zoom_to_focus,
)
from trainhealth.dashboard.frame import page_run
from trainhealth.defaults import DASHBOARD_REFRESH_S
from trainhealth.text import fmt_duration, fmt_gpu_hours, fmt_int, fmt_pct, fmt_rate, fmt_usd, plural

#: History windows offered (label → ledger snapshots read: one per 2 s, None: the whole retained stream,
#: sampled evenly in time) and how long a read is reused (s): the charts' history is one read per period,
#: the KPIs stay live.
WINDOWS = {"1 h": (1_800, 10), "6 h": (10_800, 60), "whole run": (None, 60)}
WHOLE_RUN = "whole run"
DEFAULT_WINDOW = "1 h"
#: Rolling-rate lines drawn per window: the 1 min rates, or the 1 h ones over the whole run (sampled about a
#: minute apart on an 11 h ledger, 1 min rates would be noise).
RATE_WINDOW = {"1 h": "60s", "6 h": "60s", WHOLE_RUN: "3600s"}
#: Snapshots drawn at most; a longer history is thinned evenly (snapshots are cumulative).
MAX_POINTS = 600
#: Rows of the rates table: label → snapshot key.
#: Bars shown only for causes that display as at least 0.1 s.
MIN_BAR_S = 0.05
CLOSED_COLUMNS = ["status", "action", "kind", "onset_step", "checkpoint_step", "summary", "by", "decided"]


#: The snapshot paths the charts draw (:func:`history_paths`): the wall time and its breakdown, the since-start
#: tokens/s; with the one rolling-rate window of the chosen history.
DRAWN_PATHS = ("t", "wall_s", "throughput_tok_s", "goodput_tok_s", "seconds")


def history_paths(window: str) -> tuple[str, ...]:
    """The ledger snapshot paths the charts of ``window`` draw: Redis sends only these (``data.ledger_history``)."""
    return (*DRAWN_PATHS, f"rates.{RATE_WINDOW.get(window, '60s')}")


def _read_history(url: str, run: str, count: int | None, paths: tuple[str, ...]) -> tuple[pd.DataFrame, list[str]]:
    problems: list[str] = []  # cached with the frame: the warnings must outlive the read
    if count is None:
        return data.ledger_history_whole(get_client(url), run, MAX_POINTS, problems=problems, paths=paths), problems
    return data.ledger_history(get_client(url), run, count=count, max_points=MAX_POINTS, problems=problems,
                               paths=paths), problems


@st.cache_data(ttl=WINDOWS["1 h"][1], show_spinner=False)
def _history_short(url: str, run: str, count: int, paths: tuple[str, ...]) -> tuple[pd.DataFrame, list[str]]:
    return _read_history(url, run, count, paths)


@st.cache_data(ttl=WINDOWS["6 h"][1], show_spinner=False)
def _history_long(url: str, run: str, count: int | None, paths: tuple[str, ...]) -> tuple[pd.DataFrame, list[str]]:
    return _read_history(url, run, count, paths)


def history(url: str, run: str, window: str) -> tuple[pd.DataFrame, list[str]]:
    """The ledger history of ``window`` (thinned to :data:`MAX_POINTS`, only the drawn paths), cached per its
    period, and what of it could not be read."""
    count, ttl = WINDOWS.get(window, WINDOWS[DEFAULT_WINDOW])
    return (_history_short if ttl <= WINDOWS["1 h"][1] else _history_long)(url, run, count, history_paths(window))


def badput_gpu_hours(snap: dict) -> tuple[float, float]:
    """(badput GPU-hours, total GPU-hours) of a snapshot: every category but productive and unobserved
    (:data:`~trainhealth.dashboard.data.NOT_BADPUT`), and all."""
    hours = snap.get("gpu_hours") or {}
    vals = {k: float(v) for k, v in hours.items() if v is not None}
    if not vals and snap.get("world_size"):  # not written: the same definition from the seconds
        vals = {k: float(v) * snap["world_size"] / 3600.0 for k, v in (snap.get("seconds") or {}).items()}
    return sum(v for k, v in vals.items() if k not in data.NOT_BADPUT), sum(vals.values())


def unobserved_note(snap: dict) -> str | None:
    """What the ``unobserved`` time is, when a snapshot has any (shown as at least 1 s): steps the records do not
    cover, so neither productive nor badput; with the productive share of the time they do cover. None otherwise."""
    seconds = snap.get("seconds") or {}
    unobserved, wall = seconds.get("unobserved") or 0.0, snap.get("wall_s") or 0.0
    if unobserved < 0.5 or wall <= 0:
        return None
    gaps = snap.get("unobserved_gaps") or {}
    what = (f"{plural(gaps['count'], 'stretch', 'stretches')} of steps ({fmt_int(gaps.get('steps') or 0)} steps) "
            if gaps.get("count") else "steps ")
    text = (f"**Unobserved**: {fmt_duration(unobserved, minute_digits=0)} ({fmt_pct(100 * unobserved / wall)} of "
            f"the wall time) passed over {what}the records do not cover (records lost, or a log's skipped "
            "stretches): the steps ran, but nothing says how, so that time is neither productive nor badput.")
    observed = wall - unobserved
    if observed > 0:
        text += (f" Of the {fmt_duration(observed, minute_digits=0)} the records cover, "
                 f"{fmt_pct(100 * (seconds.get('productive') or 0.0) / observed)} was productive.")
    return text


def kpis(snap: dict, meta: dict) -> None:
    """Goodput (time), goodput and throughput (tokens/s, whole run), badput cost (USD) and GPU-hours."""
    tokens = data.has_token_counts(snap)
    unit = {"delta_color": "gray", "delta_arrow": "off", "border": True}
    no_tokens = " The run reported no token counts, so there is no tokens/s."
    cols = st.columns(5)
    cols[0].metric(GOODPUT_TIME, fmt_pct(snap.get("goodput_pct")), delta="productive time", **unit,
                   help=GOODPUT_TIME_HELP)
    cols[1].metric(GOODPUT_TOKENS, fmt_rate(snap.get("goodput_tok_s")) if tokens else "n/a",
                   delta="tokens/s · whole run" if tokens else "no token counts", **unit,
                   help=GOODPUT_TOKENS_HELP + ("" if tokens else no_tokens))
    cols[2].metric("Throughput", fmt_rate(snap.get("throughput_tok_s")) if tokens else "n/a",
                   delta="tokens/s · whole run" if tokens else "no token counts", **unit,
                   help=THROUGHPUT_HELP + ("" if tokens else no_tokens))
    price = snap.get("gpu_hour_usd") or meta.get("gpu_hour_usd")
    cost = snap.get("badput_cost_usd")
    if cost is not None:
        cols[3].metric("Badput cost", fmt_usd(cost), delta=f"at ${price:g}/GPU-h" if price else None, **unit,
                       help="USD spent on badput: non-productive wall time (unobserved time aside) × GPUs × the "
                            "GPU-hour price.")
    else:
        cols[3].metric("Badput cost", "n/a", delta="no price set", **unit,
                       help="Set `gpu_hour_usd` on the Monitor to get USD figures.")
    bad, total = badput_gpu_hours(snap)
    cols[4].metric("Badput GPU-h", fmt_gpu_hours(bad), delta=f"of {fmt_gpu_hours(total)} GPU-h", **unit,
                   help="GPU-hours of non-productive wall time (unobserved time aside): seconds × GPUs / 3600.")


def summary_line(snap: dict, meta: dict, now: float) -> str:
    """Wall time, productive and badput time, GPUs and price, restarts, and how old the snapshot is."""
    wall = snap.get("wall_s") or 0.0
    productive = (snap.get("seconds") or {}).get("productive") or 0.0
    unobserved = (snap.get("seconds") or {}).get("unobserved") or 0.0
    bits = [f"wall time {fmt_duration(wall, minute_digits=0)}",
            f"productive {fmt_duration(productive, minute_digits=0)}",
            f"badput {fmt_duration(max(0.0, wall - productive - unobserved), minute_digits=0)}"]
    if unobserved >= 0.5:
        bits.append(f"unobserved {fmt_duration(unobserved, minute_digits=0)}")
    world = snap.get("world_size") or meta.get("world_size")
    if world:
        price = snap.get("gpu_hour_usd") or meta.get("gpu_hour_usd")
        bits.append(plural(world, "GPU") + (f" at ${price:g}/GPU-hour" if price else ", no GPU-hour price set"))
    if snap.get("restarts") is not None:
        bits.append(plural(snap["restarts"], "restart"))
    t = snap.get("t")
    if isinstance(t, (int, float)) and math.isfinite(t):
        bits.append(f"ledger snapshot {fmt_duration(now - t)} old")
    return " · ".join(bits)


def closed_recommendations(recs: list[dict[str, Any]], tz: str) -> pd.DataFrame:
    """Applied or dismissed recommendations with who decided and when, newest decision first."""
    rows = []
    for d in recs:
        if d.get("status") not in ("applied", "dismissed"):
            continue
        last = (d.get("history") or [{}])[-1]
        t = last.get("t", d.get("updated_at"))
        rows.append({"status": d.get("status"), "action": d.get("action"), "kind": d.get("kind"),
                     "onset_step": d.get("onset_step"), "checkpoint_step": d.get("checkpoint_step"),
                     "summary": d.get("summary"), "by": last.get("by") or None,
                     "_t": float(t) if isinstance(t, (int, float)) else math.nan})
    frame = pd.DataFrame(rows, columns=[*CLOSED_COLUMNS[:-1], "_t"])
    frame = frame.sort_values("_t", ascending=False, kind="stable", na_position="last").reset_index(drop=True)
    frame["decided"] = to_datetime(frame["_t"].astype("float64"), tz)
    return frame[CLOSED_COLUMNS]


def charts_section(hist: pd.DataFrame, snap: dict, tz: str, run: str, rate_window: str = "60s") -> None:
    """Breakdown over time (full width), then throughput vs goodput and the cost per cause side by side."""
    if hist.empty:
        st.info("No goodput ledger history yet.", icon=":material/hourglass_empty:")
        return
    # Each chart is made again only when the history, the snapshot or the choices changed (common.reuse).
    custom = list(snap.get("custom_by_name") or {})
    drawn = (run, tz, rate_window, len(hist), float(hist["t"].iloc[0]), float(hist["t"].iloc[-1]), tuple(custom),
             current_focus(run))

    def breakdown() -> Any:
        fig = charts.wall_time_breakdown(hist, tz, custom_names=custom)
        fig.update_layout(uirevision=run)  # keep the user's zoom across refreshes
        return zoom_to_focus(fig, run, tz, hist["t"])  # a link's step: open around its time

    st.plotly_chart(reuse("breakdown", drawn, breakdown), config={"displaylogo": False}, key="breakdown")
    left, right = st.columns([3, 2])
    with left:
        if data.has_token_counts(snap):
            def tokens() -> Any:
                fig = charts.goodput_over_time(hist, tz, rate_window=rate_window).update_layout(uirevision=run)
                return zoom_to_focus(fig, run, tz, hist["t"])

            st.plotly_chart(reuse("tokens", drawn, tokens), config={"displaylogo": False}, key="tokens")
            st.caption(TOKEN_GAP_NOTE)
        else:
            st.info("No token counts in this run, so there is no throughput or goodput in tokens/s; the "
                    "breakdown of wall time above still applies.", icon=":material/info:")
    with right:
        causes = data.badput_by_cause(snap)
        shown = causes[causes["seconds"] >= MIN_BAR_S]
        if shown.empty:
            st.info("No badput so far: all wall time was productive.", icon=":material/check_circle:")
        else:
            priced = snap.get("badput_cost_usd") is not None
            fig = reuse("cost", (run, snap.get("t"), snap.get("wall_s"), priced, tuple(shown["seconds"])),
                        lambda: charts.badput_cost_bar(shown, priced, snap.get("wall_s")))
            st.plotly_chart(fig, config={"displaylogo": False}, key="cost")
            rest = [charts.label(c) for c in causes.loc[causes["seconds"] < MIN_BAR_S, "category"]]
            if rest:
                st.caption("Nothing lost to " + ", ".join(rest) + ".")


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def live(run: str) -> None:
    """KPIs, rates, charts and past recommendations, re-run alone every ``DASHBOARD_REFRESH_S`` seconds."""
    url = st.session_state.get(URL_KEY, "")
    window = st.session_state.get("goodput_window") or DEFAULT_WINDOW
    problems: list[str] = []
    latest_problems: list[str] = []
    try:
        cl = client()
        meta = data.run_meta(cl, run, problems)
        snap = data.ledger_latest(cl, run, latest_problems)
        hist, history_problems = history(url, run, window)
        hist = data.with_latest(hist, snap)
        recs = data.recommendations(cl, run)  # unreadable ones: the page's header says so
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    show_problems([*latest_problems, *problems, *history_problems])
    if not snap:
        if not latest_problems:  # an unreadable snapshot is not "none yet": its warning says so
            st.info("No goodput ledger snapshot yet for this run. The detector service (`trainhealth serve`) "
                    "writes one every 2 s once steps arrive.", icon=":material/hourglass_empty:")
        return
    tz = viewer_tz()
    st.caption(summary_line(snap, meta, time.time()))
    lost = data_lost_text(snap)
    if lost:
        st.warning(f"**Data lost**: {lost}", icon=":material/database_off:")
    gap = unobserved_note(snap)
    if gap:
        st.info(gap, icon=":material/visibility_off:")
    kpis(snap, meta)
    if data.has_token_counts(snap):
        # A markdown table: the data grid's JavaScript would hold back the charts below (common.markdown_table).
        rates = rates_table(snap)
        rows = ([label, *row] for label, row in zip(rates.index, rates.itertuples(index=False, name=None), strict=True))
        st.markdown(markdown_table(["tokens/s", *rates.columns], rows, right=[False, *[True] * len(rates.columns)]))
        if any(c.endswith(RATE_YOUNGER) for c in rates.columns):
            st.caption(RATE_YOUNGER_HELP)
    head, pick = st.columns([3, 1.4], vertical_alignment="bottom")
    span = (f"the whole run (up to {MAX_POINTS} ledger snapshots, evenly spaced in time)" if window == WHOLE_RUN
            else f"the last {window} of ledger snapshots")
    head.caption(f"Charts: {span} (times in {tz}); each snapshot covers the run since it started.")
    pick.segmented_control("History", list(WINDOWS), default=DEFAULT_WINDOW, key="goodput_window",
                           label_visibility="collapsed")
    charts_section(hist, snap, tz, run, RATE_WINDOW.get(window, "60s"))
    closed = closed_recommendations(recs, tz)
    if not closed.empty:
        with st.expander(f"Closed recommendations ({len(closed)})", icon=":material/history:"):
            st.dataframe(closed, hide_index=True, key="closed_recs", column_config={
                "onset_step": st.column_config.NumberColumn("onset step", format="%d"),
                "checkpoint_step": st.column_config.NumberColumn("checkpoint", format="%d"),
                "decided": st.column_config.DatetimeColumn("decided", format="MM-DD HH:mm:ss"),
            })


run = page_run()
if run:
    st.subheader(f"{run} · goodput")
    incidents.header(run, "goodput")
    live(run)
