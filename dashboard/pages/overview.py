"""Overview page: the run's state and incident cards (:mod:`trainhealth.dashboard.incidents`), KPIs, loss/grad-norm
curves over the whole run with anomaly markers, goodput over time, badput."""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import pandas as pd
import redis
import streamlit as st

from trainhealth.dashboard import charts, data, incidents
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
    current_focus,
    frame_signature,
    get_client,
    redis_trouble,
    reuse,
    show_problems,
    viewer_tz,
    zoom_to_focus,
)
from trainhealth.dashboard.frame import page_run
from trainhealth.dashboard.incidents import shown_status
from trainhealth.defaults import DASHBOARD_REFRESH_S
from trainhealth.job import JobState
from trainhealth.text import fmt_duration, fmt_int, fmt_pct, fmt_rate, fmt_usd, plural

#: Slow-moving reads (checkpoint markers, the sampled ledger history) are re-read at most this
#: often (s) instead of on every 2 s refresh; the KPIs and loss curve stay fully live.
SLOW_TTL_S = 10
#: Ledger snapshots drawn on the goodput chart: the whole run, sampled evenly in time (one per ~1.5 px of its ~900).
#: Each sample costs Redis a ~2 kB JSON decode (data.LEDGER_SAMPLE_SCRIPT, ~30 us): 600 are ~20 ms every SLOW_TTL_S;
#: the since-start curves it draws move by at most 1/600 of their range between two samples.
LEDGER_POINTS = 600
#: What the goodput chart draws of each snapshot (since-start tokens/s): Redis sends only these.
LEDGER_PATHS = ("t", "throughput_tok_s", "goodput_tok_s", data.PROGRESS_COLUMN)
#: Session-state key of the step series read so far: ``{(run, step_from, step_to): data.StepSeries}``, so a
#: refresh reads only the entries added since the last one.
SERIES_KEY = "th_series"
#: Series kept per session, least recently shown dropped first (whole run and a zoomed range, of this run and
#: of the compared one: 100,000 steps are ~7 MB).
SERIES_KEPT = 4
#: Session-state keys of the step range (None: the run's first / newest step), mirrored in the URL as
#: ``?step_from=&step_to=``; a ``?step=`` link opens :data:`STEP_LINK_STEPS` steps either side of its step.
FROM_KEY, TO_KEY, RANGE_RUN_KEY = "th_step_from", "th_step_to", "th_range_run"
STEP_LINK_STEPS = 100
#: Session-state keys (and URL parameters ``compare``, ``align``) of the run comparison.
COMPARE_KEY, ALIGN_KEY = "th_compare", "th_align"
NO_COMPARE = "—"  # no run id looks like this (trainhealth.keys.validate_run_id)
# These keys hold the choices themselves; each input is drawn from them with a key naming the value it shows
# (``th_step_from.w:19900``) and copies a change back (:func:`_chosen`). So a drag on the chart or "Whole run"
# redraws the inputs, and a page whose widgets get new ids between runs keeps the choice.
ALIGNMENTS = {"step": "step", "tokens": "tokens trained"}
#: What of the anomalies the curves draw (markers, spans, hover text): a change makes them again.
CURVE_ANOMALY_COLUMNS = ("id", "kind", "severity", "status", "step", "end_step", "ranks", "message")


@st.cache_data(ttl=SLOW_TTL_S, show_spinner=False)
def _checkpoints(url: str, run: str) -> tuple[pd.DataFrame, list[str]]:
    problems: list[str] = []  # cached with the frame: the warnings must outlive the read
    return data.checkpoints(get_client(url), run, problems), problems


@st.cache_data(ttl=SLOW_TTL_S, show_spinner=False)
def _run_ids(url: str) -> list[str]:
    return list(data.list_runs(get_client(url))["run"])


#: Said under the throughput/goodput chart when it draws learning progress (docs/goodput.md).
PROGRESS_NOTE = (" Progress per GPU-hour (right axis, dashed): the loss decrease per GPU-hour over the kept steps "
                 "since the run started, median of the first points against the newest; below 0 the loss rose.")


@st.cache_data(ttl=SLOW_TTL_S, show_spinner=False)
def _ledger_history(url: str, run: str) -> tuple[pd.DataFrame, list[str]]:
    problems: list[str] = []  # cached with the frame: the warnings must outlive the read
    return data.ledger_history_whole(get_client(url), run, LEDGER_POINTS, problems=problems,
                                   paths=LEDGER_PATHS), problems


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
                       help="USD spent on badput: non-productive wall time (unobserved time aside) × ranks × "
                            "the GPU-hour price.")
    else:
        seconds = snap.get("seconds") or {}
        badput_s = (snap.get("wall_s") or math.nan) - sum(seconds.get(c) or 0.0 for c in data.NOT_BADPUT)
        cols[4].metric("Badput time", fmt_duration(badput_s, minute_digits=0), delta="no price set", **unit,
                       help="Wall time not spent productively (unobserved time aside: steps the records do not "
                            "cover). Set `gpu_hour_usd` on the Monitor for USD cost.")


def status_line(tail: dict[str, Any] | None, meta: dict, state: JobState | None = None) -> None:
    """How fresh the data is: an on-call's first question. ``tail`` is the newest step (:attr:`StepSeries.tail`)."""
    bits = [f"status **{shown_status(meta, state)}**"]
    if tail is not None:
        if math.isfinite(tail["t_end"]) and tail["step"] is not None:
            bits.append(f"step {fmt_int(tail['step'])} ended {fmt_duration(time.time() - tail['t_end'])} ago")
        if tail["n_ranks"] is not None and meta.get("world_size"):
            bits.append(f"{tail['n_ranks']}/{plural(meta['world_size'], 'rank')} reported it")
        if tail["gen"]:
            bits.append(f"restart generation {tail['gen']}")
    if meta.get("gpu_hour_usd"):
        bits.append(f"${meta['gpu_hour_usd']:g}/GPU-hour")
    st.caption(" · ".join(bits) + f" · refreshes every {DASHBOARD_REFRESH_S:g} s")


# --- the step range, the series read so far, the comparison -------------------------------------------------

def _link_int(name: str) -> int | None:
    try:
        return max(0, int(st.query_params.get(name, "")))
    except ValueError:
        return None


def init_range(run: str) -> None:
    """Set the step range and comparison from the link on the session's first view of a run; another run picked
    later opens whole and alone."""
    if st.session_state.get(RANGE_RUN_KEY) == run:
        return
    first = RANGE_RUN_KEY not in st.session_state
    st.session_state[RANGE_RUN_KEY] = run
    lo = hi = None
    compare, align = NO_COMPARE, "step"
    if first:
        lo, hi, step = _link_int("step_from"), _link_int("step_to"), _link_int("step")
        if lo is None and hi is None and step is not None:
            lo, hi = max(0, step - STEP_LINK_STEPS), step + STEP_LINK_STEPS
        if lo is not None and hi is not None and hi < lo:
            lo, hi = hi, lo
        compare = st.query_params.get("compare") or NO_COMPARE
        align = st.query_params.get("align") if st.query_params.get("align") in ALIGNMENTS else "step"
    st.session_state[FROM_KEY], st.session_state[TO_KEY] = lo, hi
    st.session_state[COMPARE_KEY], st.session_state[ALIGN_KEY] = compare, align


def step_range() -> tuple[int | None, int | None]:
    """The chosen step range (inclusive; None: open), ordered, and mirrored in the URL."""
    lo, hi = st.session_state.get(FROM_KEY), st.session_state.get(TO_KEY)
    lo, hi = (None if v is None else int(v) for v in (lo, hi))
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    for name, v in (("step_from", lo), ("step_to", hi)):
        if v is None:
            st.query_params.pop(name, None)
        else:
            st.query_params[name] = str(v)
    st.query_params.pop("step", None)  # now said by the range
    return lo, hi


def step_series(cl: Any, run: str, lo: int | None, hi: int | None, problems: list[str]) -> data.StepSeries:
    """The run's series of steps ``lo``-``hi``, brought up to date: kept in the session between refreshes, so only
    entries added since the last refresh are read."""
    store = st.session_state.setdefault(SERIES_KEY, {})
    series = store.pop((run, lo, hi), None) or data.StepSeries(run, lo, hi)
    store[(run, lo, hi)] = series  # newest last
    while len(store) > SERIES_KEPT:
        store.pop(next(iter(store)))
    return series.refresh(cl, problems)


def _widget_key(state_key: str) -> str:
    return f"{state_key}.w:{st.session_state.get(state_key)}"


def _chosen(state_key: str, widget_key: str) -> None:
    """An input changed: its value becomes the choice (a segmented control clicked off keeps the choice)."""
    value = st.session_state.get(widget_key)
    if value is not None or state_key in (FROM_KEY, TO_KEY):
        st.session_state[state_key] = value


def _whole_run() -> None:
    st.session_state[FROM_KEY] = st.session_state[TO_KEY] = None


def _zoom_to_selection(chart_key: str) -> None:
    """A box dragged across the curves: read its steps at full resolution (Streamlit reports selections, not
    Plotly's zoom)."""
    event = st.session_state.get(chart_key)
    boxes = (event or {}).get("selection", {}).get("box") or []
    xs = [float(x) for x in (boxes[0].get("x") or [])] if boxes else []
    if len(xs) >= 2:
        lo, hi = math.ceil(max(0.0, min(xs))), math.floor(max(xs))
        if hi >= lo:
            st.session_state[FROM_KEY], st.session_state[TO_KEY] = lo, hi


def range_picker(lo: int | None, hi: int | None) -> None:
    """``from step`` / ``to step`` inputs (empty: the run's first / newest step) and, on a range, "Whole run"."""
    cols = st.columns([1, 1, 1, 3], vertical_alignment="bottom")
    help_text = ("Reads these steps at full resolution (reduced again only beyond "
                 f"{charts.MAX_POINTS:,} points). Or drag across the chart. Empty: the run's {{}} step.")
    for col, label, state_key, placeholder in ((cols[0], "From step", FROM_KEY, "first"),
                                               (cols[1], "To step", TO_KEY, "newest")):
        key = _widget_key(state_key)
        col.number_input(label, min_value=0, step=1, value=st.session_state.get(state_key), key=key,
                         placeholder=placeholder, help=help_text.format(placeholder), on_change=_chosen,
                         args=(state_key, key))
    if lo is not None or hi is not None:
        cols[2].button("Whole run", on_click=_whole_run, icon=":material/zoom_out_map:", key="th_whole_run")


def curves_caption(series: data.StepSeries, reduced: bool) -> str | None:
    """What the curves show, when it is not simply every step of the run."""
    frame = series.frame
    if frame.empty or (series.whole_run and not reduced):
        return None
    first, last = int(frame["step"].min()), int(frame["step"].max())
    text = f"Steps {fmt_int(first)}–{fmt_int(last)}: {plural(len(frame), 'entry', 'entries')}"
    if series.rolled_steps is not None:
        text += (f" (up to step {fmt_int(series.rolled_steps)} the service's per-{fmt_int(series.rollup_every or 0)}"
                 "-step rollup: each bucket's highest and lowest loss and grad norm and its mean tokens/s)")
    if reduced:
        return text + (f", each curve reduced to {charts.MAX_POINTS:,} points keeping its spikes and dips (MinMaxLTTB)."
                       " Drag across the chart or set a step range to read that range at full resolution.")
    return text + ", every one drawn (full resolution)."


def curves(run: str, series: data.StepSeries, anomalies: pd.DataFrame, checkpoints: pd.DataFrame,
           lo: int | None, hi: int | None) -> None:
    """The loss / grad-norm chart of the series; dragging across it picks a step range. Made again only when the
    series, the anomalies or the checkpoints changed (:func:`~trainhealth.dashboard.common.reuse`)."""
    def build() -> Any:
        fig = charts.training_curves(series.frame, anomalies, checkpoints, max_points=charts.MAX_POINTS)
        # Keep the user's zoom across refreshes, not across ranges; dragging selects a step range (horizontal only).
        return fig.update_layout(uirevision=f"{run}:{lo}:{hi}", dragmode="select", selectdirection="h")

    fig = reuse("curves", (run, lo, hi, series.last_id, len(series.frame), series.rolled_steps,
                           frame_signature(anomalies, CURVE_ANOMALY_COLUMNS),
                           frame_signature(checkpoints, data.EVENT_COLUMNS)), build)
    reduced = "reduced" in (fig.layout.title.text or "")
    key = f"curves:{lo}:{hi}"  # a new range starts without the previous range's selection box
    st.plotly_chart(fig, config={"displaylogo": False}, key=key, on_select=functools.partial(_zoom_to_selection, key),
                    selection_mode="box")
    caption = curves_caption(series, reduced)
    if caption:
        st.caption(caption)


def comparison(cl: Any, url: str, series: data.StepSeries, problems: list[str]) -> None:
    """Overlay another run's loss and throughput, aligned by step (in the chosen range) or by tokens (whole runs:
    tokens count from each run's first step)."""
    run, lo, hi = series.run, series.step_from, series.step_to
    others = [r for r in _run_ids(url) if r != run]
    if st.session_state.get(COMPARE_KEY) not in (NO_COMPARE, *others):
        st.session_state[COMPARE_KEY] = NO_COMPARE
    if st.session_state.get(ALIGN_KEY) not in ALIGNMENTS:
        st.session_state[ALIGN_KEY] = "step"
    left, right = st.columns([2, 1], vertical_alignment="bottom")
    options = [NO_COMPARE, *others]
    key = _widget_key(COMPARE_KEY)
    other = left.selectbox("Compare with", options, index=options.index(st.session_state[COMPARE_KEY]), key=key,
                           on_change=_chosen, args=(COMPARE_KEY, key),
                           help="Overlay another run's loss and tokens/s on this one's.")
    other = None if other == NO_COMPARE else other
    key = _widget_key(ALIGN_KEY)
    align = right.segmented_control("Align by", list(ALIGNMENTS), default=st.session_state[ALIGN_KEY], key=key,
                                    on_change=_chosen, args=(ALIGN_KEY, key), format_func=ALIGNMENTS.get,
                                    help="Step: each run at its step numbers, in the chosen step range. Tokens "
                                         "trained: each run at the tokens of its kept steps so far (whole runs), "
                                         "so runs of different batch sizes line up by data seen.") or "step"
    for name, v in (("compare", other), ("align", None if align == "step" else align)):
        if v is None:
            st.query_params.pop(name, None)
        else:
            st.query_params[name] = v
    if other is None:
        return
    if align == "tokens":
        lo = hi = None
    own = series if (lo, hi) == (series.step_from, series.step_to) else step_series(cl, run, lo, hi, problems)
    runs = [(run, data.progress(own.frame)), (other, data.progress(step_series(cl, other, lo, hi, problems).frame))]
    fig = charts.run_comparison(runs, align)
    fig.update_layout(uirevision=f"{run}:{other}:{align}:{lo}:{hi}")
    st.plotly_chart(fig, config={"displaylogo": False}, key="compare")
    if align == "tokens" and runs[1][1]["tokens_seen"].isna().all():
        st.info(f"{other} reported no token counts, so it cannot be aligned by tokens.", icon=":material/info:")


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
    lo, hi = step_range()
    try:
        cl = client()
        meta = data.run_meta(cl, run, problems)
        series = step_series(cl, run, lo, hi, problems)
        snap = data.ledger_latest(cl, run, problems)
        state = data.job_state(cl, run)  # unreadable: the page's header says so
        anomalies = data.anomalies(cl, run, problems)
        checkpoints, checkpoint_problems = _checkpoints(url, run)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return

    status_line(series.tail, meta, state)
    show_problems([*problems, *checkpoint_problems])
    kpis(snap, anomalies, meta, state)

    if series.tail is None:
        st.info("No aggregated steps yet for this run. The detector service (`trainhealth serve`) writes "
                "them as the ranks report steps.", icon=":material/hourglass_empty:")
    else:
        range_picker(lo, hi)
        if series.frame.empty:
            st.info(f"No steps between {fmt_int(lo) if lo is not None else 'the first'} and "
                    f"{fmt_int(hi) if hi is not None else 'the newest'} in this run.", icon=":material/search_off:")
        else:
            curves(run, series, anomalies, checkpoints, lo, hi)

    # Read after the curves are drawn: the browser draws them meanwhile.
    try:
        history, history_problems = _ledger_history(url, run)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    show_problems(history_problems)
    left, right = st.columns([3, 2])
    with left:
        if history.empty:
            st.info("No goodput ledger snapshots yet.", icon=":material/hourglass_empty:")
        elif not data.has_token_counts(snap):
            st.info("No token counts in this run (e.g. a replayed log without them), so there is no "
                    "throughput or goodput in tokens/s. Goodput (time) and the badput breakdown still apply.",
                    icon=":material/info:")
        else:
            def goodput_figure() -> Any:
                fig = charts.goodput_over_time(history, viewer_tz()).update_layout(uirevision=run)
                return zoom_to_focus(fig, run, viewer_tz(), history["t"])  # a link's step: open around its time

            fig = reuse("goodput", (run, viewer_tz(), len(history), float(history["t"].iloc[0]),
                                    float(history["t"].iloc[-1]), current_focus(run)), goodput_figure)
            st.plotly_chart(fig, config={"displaylogo": False}, key="goodput")
            st.caption(TOKEN_GAP_NOTE + (PROGRESS_NOTE if history[data.PROGRESS_COLUMN].notna().any() else ""))
    with right:
        if snap:
            breakdown = data.badput_seconds(snap)
            # Bars only for categories that show as at least 0.1 s; the rest are named below.
            shown = breakdown[breakdown["seconds"] >= 0.05]
            if shown.empty:
                st.info("No badput so far: all wall time was productive.", icon=":material/check_circle:")
            else:
                fig = reuse("badput", (run, snap.get("t"), snap.get("wall_s"), tuple(shown["seconds"])),
                            lambda: charts.badput_bar(shown, snap.get("wall_s")))
                st.plotly_chart(fig, config={"displaylogo": False}, key="badput")
            caption = ledger_caption(snap)
            if caption:
                st.caption(caption)
            rest = [charts.label(c) for c in breakdown.loc[breakdown["seconds"] < 0.05, "category"]]
            if rest and not shown.empty:
                st.caption("0.0 s: " + ", ".join(rest))

    if series.tail is not None:
        compare_problems: list[str] = []
        try:
            comparison(cl, url, series, compare_problems)
        except redis.RedisError as exc:
            redis_trouble(exc)
        show_problems(compare_problems)


run = page_run()
if run:
    st.subheader(f"{run} · overview")
    incidents.header(run, "overview")
    init_range(run)
    live(run)
