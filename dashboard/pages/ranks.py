"""Ranks page: per-rank busy-time heatmap, the nodes and the ranks sorted by how slow they are, and one rank's
section seconds per step; then every rank's memory over time (CUDA allocated or reserved, or host RSS, from the
service's ``th:{run}:mem``) and, in the drill-down, the chosen rank's memory beside the others' with its newest
heartbeat's figures.

"Flagged" means one thing here: the detectors' verdict, an active straggler, slow-node or rank-outlier anomaly
naming the rank (:func:`trainhealth.dashboard.data.rank_verdicts`); the heatmap outlines those ranks and the tables
say so. A link's rank (``?rank=3``) is the one drilled down to, around the link's step (``?step=40``); selecting
another row of the rank table makes it the link's rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import redis
import streamlit as st

from trainhealth.dashboard import charts, data, incidents
from trainhealth.dashboard.common import (
    URL_KEY,
    Focus,
    client,
    current_focus,
    frame_signature,
    get_client,
    kind_words,
    redis_trouble,
    reuse,
    select_table,
    set_focus,
    show_problems,
    viewer_tz,
)
from trainhealth.dashboard.frame import page_run
from trainhealth.defaults import DASHBOARD_REFRESH_S, DASHBOARD_STEPS, MEMORY_HISTORY_S, STRAGGLER_THRESHOLD
from trainhealth.text import fmt_duration, plural

#: Hosts change only when ranks restart: re-read at most this often (s).
HOSTS_TTL_S = 30
#: A drill-down around a linked step of long ago (beyond the heatmap's steps) is re-read at most this often (s).
AROUND_TTL_S = 10
#: Session-state key of the rank window read so far (:func:`rank_window`).
WINDOW_KEY = "th_rank_window"
WINDOWS = (100, 500, DASHBOARD_STEPS)
#: Busy values (ranks x steps) the window reads at most: beyond, its newest ``data.RANK_TABLE_STEPS`` steps are read
#: whole and only every n-th older one (data.RankWindow). 131,072: 500 steps whole up to 256 ranks; at 1,024 ranks
#: the newest 100 and every 15th before (~1.6 MB read once instead of ~6.5 MB), which the heatmap draws in
#: ~64 columns anyway (charts.HEATMAP_MAX_CELLS).
WINDOW_VALUES = 131_072
MODES = ("busy seconds", "ratio to step median")
#: Anomaly kinds about particular ranks or nodes, each shown as a warning on top: the flagging ones
#: (:data:`trainhealth.dashboard.data.FLAGGED_KINDS`) and a dead rank (its job is hung or crashed).
RANK_KINDS = (*data.FLAGGED_KINDS, "dead_rank", "network_slow", "memory_imbalance")
#: The memory lists of th:{run}:mem the page draws, in words; the session-state key of the one chosen.
MEMORY_LABELS = {"alloc": "CUDA allocated", "reserved": "CUDA reserved", "rss": "host RSS"}
MEMORY_KEY = "ranks_memory_metric"
#: The memory window is re-read at most this often (s): the service adds an entry every MEMORY_HISTORY_S.
MEMORY_TTL_S = MEMORY_HISTORY_S / 3
NO_MEMORY = ("No memory samples for this run yet: the detector service keeps every rank's heartbeat memory every "
             f"{MEMORY_HISTORY_S:.0f} s (CUDA allocator figures from ranks that use CUDA, host RSS from all).")
#: Steps drawn either side of a linked step (range) in the drill-down.
AROUND_STEPS = 50
NO_TIMINGS = ("No per-rank section timings in this run (a replayed log / untimed steps), so ranks cannot be "
              "compared. Time each step with `with mon.step(step):` and its work with `mon.section(...)` to see "
              "every rank's busy time here.")
FLAGGED_HELP = ("The detectors' verdict: named by an active straggler, slow-node or rank-outlier anomaly "
                "(the Anomalies page has each one's evidence).")
RANK_COLUMNS = ["rank", "host", "flagged", "verdict", "median_busy_s", "ratio", "score", "steps", "culprit"]
RANK_CONFIG = {
    "rank": st.column_config.NumberColumn("rank", format="%d"),
    "host": st.column_config.TextColumn("host"),
    "flagged": st.column_config.CheckboxColumn("flagged", help=FLAGGED_HELP),
    "verdict": st.column_config.TextColumn("verdict", help="The anomalies that flag the rank."),
    "median_busy_s": st.column_config.NumberColumn("median busy (s)", format="%.3f"),
    "ratio": st.column_config.NumberColumn("ratio vs median rank", format="%.2f×"),
    "score": st.column_config.NumberColumn("score", format="%.2f",
                                           help="Fastest rank's median busy time / this rank's."),
    "steps": st.column_config.NumberColumn("steps reported", format="%d"),
    "culprit": st.column_config.CheckboxColumn("stopped first", help="The culprit of the hang or crash: "
                                               "the rank the detector service saw stop first."),
}
NODE_CONFIG = {
    "host": st.column_config.TextColumn("node"),
    "ranks": st.column_config.NumberColumn("ranks", format="%d"),
    "rank_list": st.column_config.TextColumn("which"),
    "median_busy_s": st.column_config.NumberColumn("median busy (s)", format="%.3f",
                                                   help="Median of its ranks' median busy seconds."),
    "ratio": st.column_config.NumberColumn("ratio vs median node", format="%.2f×"),
    "slowest_rank": st.column_config.NumberColumn("slowest rank", format="%d"),
    "flagged_ranks": st.column_config.NumberColumn("flagged ranks", format="%d", help=FLAGGED_HELP),
    "slow_node": st.column_config.CheckboxColumn("slow node", help="The slow-node detector's verdict: an active "
                                                 "slow_node anomaly names this host."),
}
#: What of the anomalies the rank and node tables read (verdicts, the straggler's onset, slow nodes).
ANOMALY_SIGNATURE = ("id", "kind", "status", "step", "ranks", "hosts")
#: Session-state keys: ``(run, rank)`` picked by a click or a link; ``(run, Focus)`` last applied.
CHOSEN_KEY, APPLIED_KEY = "ranks_chosen", "ranks_applied"


@st.cache_data(ttl=HOSTS_TTL_S, show_spinner=False)
def _hosts(url: str, run: str) -> pd.DataFrame:
    return data.rank_hosts(get_client(url), run)


@st.cache_data(ttl=MEMORY_TTL_S, show_spinner=False)
def _memory(url: str, run: str, metric: str) -> tuple[pd.DataFrame, list[str]]:
    problems: list[str] = []
    return data.memory_matrix(get_client(url), run, metric, problems=problems), problems


@st.cache_data(ttl=AROUND_TTL_S, show_spinner=False)
def _around(url: str, run: str, lo: int, hi: int) -> tuple[pd.DataFrame, list[str]]:
    problems: list[str] = []  # cached with the matrix: the warnings must outlive the read
    return data.busy_around(get_client(url), run, lo, hi, problems), problems


def window_text(recent: pd.DataFrame, onset: int | None) -> str:
    """Which steps the rank table covers, for its caption."""
    first, last, n = int(recent.columns[0]), int(recent.columns[-1]), recent.shape[1]
    span = f"step {first:,}" if n == 1 else f"steps {first:,}–{last:,}"
    if onset is not None:
        return f"since the active straggler's onset ({span}, {plural(n, 'step')})"
    return f"over the last {plural(n, 'step')} ({span})"


def table_caption(recent: pd.DataFrame, onset: int | None) -> str:
    return ("Busy = seconds a rank spends in its own timed sections before the collective; a slow rank makes all "
            "others wait. Ratio = the rank's median busy time / the median rank's; score = the fastest rank's "
            "median / this rank's (NVIDIA's relative score), " + window_text(recent, onset) + ". Flagged = the "
            "detectors' verdict, not these figures: named by an active straggler, slow-node or rank-outlier "
            f"anomaly (the straggler detector flags a score below {STRAGGLER_THRESHOLD:g} held over 2 windows of "
            "20 steps).")


def rank_table(summary: pd.DataFrame, verdicts: pd.DataFrame, culprit_rank: int | None) -> pd.DataFrame:
    """The rank table: :func:`~trainhealth.dashboard.data.rank_summary` with the verdict of each rank (a merge,
    no per-row Python) and, while the job is hung or crashed, the rank that stopped first."""
    words = verdicts.assign(verdict=[", ".join(kind_words(k) for k in kinds) for kinds in verdicts["kinds"]])
    out = summary.merge(words[["rank", "verdict"]], on="rank", how="left")
    out["flagged"] = out["verdict"].notna()
    out["verdict"] = out["verdict"].astype(object).where(out["flagged"], None)
    out["culprit"] = out["rank"] == culprit_rank if culprit_rank is not None else False
    return out[RANK_COLUMNS if culprit_rank is not None else RANK_COLUMNS[:-1]]


def warnings(active: pd.DataFrame) -> None:
    """One warning per active anomaly about ranks or nodes: what, where, since when."""
    for a in active.itertuples(index=False):
        if a.kind in ("slow_node", "network_slow"):
            where = (", ".join(a.hosts) or "node ?") + (f" (ranks {data.rank_ranges(a.ranks)})" if a.ranks else "")
        else:
            where = (", ".join(f"rank {r}" for r in a.ranks) or "ranks ?") + (f" on {', '.join(a.hosts)}"
                                                                             if a.hosts else "")
        since = f" since step {a.step}" if pd.notna(a.step) else ""
        st.warning(f"**{kind_words(a.kind)}**: {where}{since} — {a.message}", icon=":material/slow_motion_video:")


def chosen_rank(run: str, ranks: list[int], flagged: list[int]) -> int | None:
    """The rank drilled down to: the link's (or the last clicked), else the first flagged, else the slowest."""
    focus = current_focus(run)
    if st.session_state.get(APPLIED_KEY) != (run, focus):
        st.session_state[APPLIED_KEY] = (run, focus)
        if focus.ranks:
            st.session_state[CHOSEN_KEY] = (run, focus.ranks[0])
    picked = st.session_state.get(CHOSEN_KEY)
    if picked and picked[0] == run and picked[1] in ranks:
        return picked[1]
    listed = [r for r in flagged if r in ranks]
    return listed[0] if listed else (ranks[0] if ranks else None)


def drill_window(matrix: pd.DataFrame, focus: Focus, run: str) -> tuple[pd.DataFrame, list[str]]:
    """The steps of the drill-down: :data:`AROUND_STEPS` either side of the link's steps (read from the stream
    when the heatmap's steps do not hold them all), else the heatmap's."""
    bounds = focus.bounds()
    if bounds is None:
        return matrix, []
    lo, hi = max(0, bounds[0] - AROUND_STEPS), bounds[1] + AROUND_STEPS
    if matrix.shape[1] and int(matrix.columns[0]) <= lo and hi <= int(matrix.columns[-1]):
        return matrix.loc[:, (matrix.columns >= lo) & (matrix.columns <= hi)], []
    return _around(st.session_state.get(URL_KEY, ""), run, lo, hi)


def timeline_figure(timeline: pd.DataFrame, rank: int, focus: Focus) -> go.Figure:
    """The rank's busy seconds per step (bars) beside the step's median and fastest rank (lines); the link's steps
    shaded."""
    fig = go.Figure([
        go.Bar(x=timeline["step"], y=timeline["busy_s"], name=f"rank {rank}", marker_color="#d62728",
               hovertemplate="step %{x}<br>rank " + str(rank) + ": %{y:.3f} s<extra></extra>"),
        go.Scatter(x=timeline["step"], y=timeline["median_s"], name="median rank", mode="lines",
                   line={"color": "#1f77b4", "width": 2}, hovertemplate="median rank: %{y:.3f} s<extra></extra>"),
        go.Scatter(x=timeline["step"], y=timeline["fastest_s"], name="fastest rank", mode="lines",
                   line={"color": "#2ca02c", "width": 1, "dash": "dot"},
                   hovertemplate="fastest rank: %{y:.3f} s<extra></extra>"),
    ])
    bounds = focus.bounds()
    if bounds is not None:
        fig.add_vrect(x0=bounds[0] - 0.5, x1=bounds[1] + 0.5, fillcolor="rgba(255,127,14,0.18)", line_width=0,
                      annotation_text="link", annotation_position="top left")
    fig.update_layout(height=300, margin={"l": 10, "r": 10, "t": 40, "b": 10}, bargap=0.1,
                      title={"text": f"Rank {rank}: section seconds per step", "x": 0, "font": {"size": 14}},
                      xaxis_title="step", yaxis_title="s", legend={"orientation": "h", "y": 1.12, "x": 1,
                                                                   "xanchor": "right"})
    return fig


def drill_down(run: str, matrix: pd.DataFrame, rank: int, host: str | None, version: Hashable = None) -> None:
    """One rank's section seconds per step, around the link's step when there is one. ``version`` names the
    matrix's content (its newest entry): the same again, the timeline and its chart are kept (common.reuse)."""
    focus = current_focus(run)
    steps, problems = drill_window(matrix, focus, run)
    show_problems(problems)
    timeline = reuse("rank_timeline", (run, version, rank, focus, steps.shape), lambda: data.rank_timeline(steps, rank))
    st.markdown(f"##### Rank {rank}" + (f" · {host}" if host else "") + ": section timeline")
    if timeline["busy_s"].notna().sum() == 0:
        st.info(f"Rank {rank} reported no section time in these steps.", icon=":material/timer_off:")
        return
    fig = reuse("rank_timeline_figure", (run, version, rank, focus, steps.shape),
                lambda: timeline_figure(timeline, rank, focus).update_layout(uirevision=f"{run}:{rank}"))
    st.plotly_chart(fig, config={"displaylogo": False}, key="rank_timeline")
    first, last = int(timeline["step"].iloc[0]), int(timeline["step"].iloc[-1])
    around = f" around the link's {focus.describe().split(' · ')[0]}" if focus.has_step else ""
    st.caption(f"Seconds rank {rank} spent in its timed sections (their sum: the service keeps one figure per rank "
               f"and step) against the step's median and fastest rank, steps {first:,}–{last:,}{around}. Select "
               "another row above to see another rank.")
    rank_memory(run, rank)


def memory_metric() -> str:
    """The memory list chosen (the Memory section's control; CUDA allocated until one is chosen)."""
    chosen = st.session_state.get(MEMORY_KEY)
    return chosen if chosen in MEMORY_LABELS else "alloc"


def rank_memory(run: str, rank: int) -> None:
    """The drill-down's memory: the rank's chosen memory over time beside the median and highest other rank (the
    Memory section's read, cached: nothing more is read for it), and its newest heartbeat's figures (one field)."""
    metric = memory_metric()
    try:
        matrix, _ = _memory(st.session_state.get(URL_KEY, ""), run, metric)
        beats = data.rank_heartbeats(client(), run, [rank])
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    words = incidents.memory_words(beats[rank]) if rank in beats else None
    gpu = incidents.gpu_words(beats[rank]) if rank in beats else None
    if rank in matrix.index and matrix.loc[rank].notna().any():
        label, tz = MEMORY_LABELS[metric], viewer_tz()
        fig = reuse("rank_memory_figure", (run, rank, metric, matrix.shape, tuple(matrix.columns[-1:])),
                    lambda: charts.rank_memory_figure(matrix, rank, label, tz).update_layout(
                        uirevision=f"{run}:{rank}:mem"))
        st.plotly_chart(fig, config={"displaylogo": False}, key="rank_memory")
    if words or gpu:
        st.caption(f"Rank {rank}'s newest heartbeat: " + "; GPU ".join(w for w in (words, gpu) if w) + ".")


def rank_window(cl: Any, run: str, window: int, problems: list[str]) -> data.RankWindow:
    """The newest ``window`` steps' busy lists, kept in the session so a refresh reads only the new entries (at
    1,024 ranks 500 steps are ~5 MB of JSON: read once, not every 2 s)."""
    kept = st.session_state.get(WINDOW_KEY)
    if kept is None or (kept.run, kept.count) != (run, window):
        kept = st.session_state[WINDOW_KEY] = data.RankWindow(run, window, values=WINDOW_VALUES)
    return kept.refresh(cl, problems)


def sampled_note(kept: data.RankWindow, n_ranks: int) -> str | None:
    """What the heatmap and the drill-down show of a window read with a stride, None when every step is there."""
    if kept.stride <= 1:
        return None
    return (f"The newest {kept.full:,} steps are shown step by step; before them, every {kept.stride:,}th step (at "
            f"{plural(n_ranks, 'rank')}, the window reads at most {WINDOW_VALUES:,} busy values).")


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def live(run: str, window: int, relative: bool) -> None:
    """Heatmap, node and rank tables and the drill-down, re-run alone every ``DASHBOARD_REFRESH_S`` seconds."""
    problems: list[str] = []
    try:
        cl = client()
        kept = rank_window(cl, run, window, problems)
        matrix = kept.matrix
        anomalies = data.anomalies(cl, run, problems)
        state = data.job_state(cl, run)  # unreadable: the page's header says so
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    show_problems(problems)

    active = anomalies[(anomalies["status"] == "active") & anomalies["kind"].isin(RANK_KINDS)] \
        if not anomalies.empty else anomalies
    warnings(active)
    verdicts = data.rank_verdicts(anomalies)
    flagged = [int(r) for r in verdicts["rank"]]
    # The rank that stopped first while the job is hung or crashed, marked in the table (the banner of the page's
    # header names it: dashboard/incidents.py).
    culprit = state.culprit if state is not None and state.state in ("hung", "crashed") else None

    if matrix.shape[1] == 0:
        st.info("No aggregated steps yet for this run.", icon=":material/hourglass_empty:")
        return
    if not data.has_rank_timings(matrix):
        st.info(NO_TIMINGS, icon=":material/timer_off:")
        return
    # The window's newest entry names its content: a refresh that read nothing new keeps what it made (common.reuse).
    version = (kept.last_id, kept.count, kept.stride, matrix.shape)
    heatmap = reuse("heatmap", (run, version, relative, tuple(flagged)), lambda: charts.rank_heatmap(
        matrix, relative=relative, highlight=flagged).update_layout(uirevision=run))
    st.plotly_chart(heatmap, config={"displaylogo": False}, key="heatmap")
    note = sampled_note(kept, matrix.shape[0])
    if note:
        st.caption(note)

    try:  # read after the heatmap is drawn: the browser draws it meanwhile
        hosts = _hosts(st.session_state.get(URL_KEY, ""), run)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    culprit_rank = culprit.rank if culprit is not None else None

    def tables() -> tuple[pd.DataFrame, int | None, pd.DataFrame, pd.DataFrame]:
        recent, onset = data.rank_table_window(matrix, anomalies)
        summary = data.rank_summary(recent, hosts)
        return recent, onset, data.node_summary(summary, anomalies), rank_table(summary, verdicts, culprit_rank)

    recent, onset, nodes, ranks = reuse("rank_tables", (run, version, frame_signature(anomalies, ANOMALY_SIGNATURE),
                                                        frame_signature(hosts, data.HOST_COLUMNS), culprit_rank),
                                        tables)
    if len(nodes) > 1:
        st.markdown("##### Nodes, slowest first")
        st.caption("Each host's ranks together, over the same steps as the rank table: a node-level cause (clocks, "
                   "thermals, PCIe/NVLink, host CPU) slows all of them. Slow node = the slow-node detector's "
                   "verdict.")
        st.dataframe(nodes, hide_index=True, key="node_table", column_config=NODE_CONFIG)
    st.markdown("##### Ranks, slowest first")
    st.caption(table_caption(recent, onset))
    ids = [int(r) for r in ranks["rank"]]
    rank, clicked = select_table(ranks, ids, chosen_rank(run, ids, flagged), "rank_table", hide_index=True,
                                 column_config=RANK_CONFIG, placeholder="")
    if rank is None:
        return
    if clicked:  # the clicked rank becomes the link's (the Anomalies page then selects its anomaly)
        focus = dataclasses.replace(current_focus(run), ranks=(rank,))
        set_focus(run, focus)
        st.session_state[CHOSEN_KEY], st.session_state[APPLIED_KEY] = (run, rank), (run, focus)
    host = ranks.loc[ranks["rank"] == rank, "host"].iloc[0]
    drill_down(run, matrix, rank, host if isinstance(host, str) else None, version)


@st.fragment(run_every=MEMORY_TTL_S)
def memory_section(run: str) -> None:
    """Every rank's memory over time: a heatmap of the chosen list of th:{run}:mem (its newest 24 h, at most
    ``data.MEMORY_COLUMNS`` samples, thinned in Redis), re-read every :data:`MEMORY_TTL_S` seconds."""
    st.markdown("##### Memory per rank")
    metric = st.segmented_control("Memory", list(MEMORY_LABELS), default="alloc", format_func=MEMORY_LABELS.get,
                                  key=MEMORY_KEY) or "alloc"
    try:
        matrix, problems = _memory(st.session_state.get(URL_KEY, ""), run, metric)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    show_problems(problems)
    if matrix.shape[1] == 0:
        st.caption(NO_MEMORY)
        return
    if not matrix.notna().to_numpy().any():
        st.caption(f"No rank reported {MEMORY_LABELS[metric]} in the samples kept (e.g. no rank uses CUDA).")
        return
    tz = viewer_tz()
    fig = reuse("memory_heatmap", (run, metric, matrix.shape, tuple(matrix.columns[-1:]), tz),
                lambda: charts.memory_heatmap(matrix, MEMORY_LABELS[metric], tz).update_layout(uirevision=run))
    st.plotly_chart(fig, config={"displaylogo": False}, key="memory_heatmap")
    newest = matrix.iloc[:, -1]
    top = int(newest.idxmax()) if newest.notna().any() else None
    span = matrix.columns[-1] - matrix.columns[0]
    label = MEMORY_LABELS[metric]
    st.caption(f"{label[0].upper()}{label[1:]} in GiB of each rank, from the ranks' heartbeats: "
               f"{plural(matrix.shape[1], 'sample')} over {fmt_duration(span) if span else 'one instant'} "
               f"(every {MEMORY_HISTORY_S:.0f} s, thinned to at most {data.MEMORY_COLUMNS} columns). Newest: median "
               f"{newest.median():.1f} GiB"
               + (f", highest rank {top} at {newest[top]:.1f} GiB." if top is not None else "."))


run = page_run()
if run:
    st.subheader(f"{run} · ranks")
    incidents.header(run, "ranks")
    c1, c2 = st.columns(2)
    window = c1.segmented_control("Steps shown", WINDOWS, default=500, format_func=lambda n: f"last {n:,}",
                                  key="ranks_window") or 500
    mode = c2.segmented_control("Colour", MODES, default=MODES[0], key="ranks_mode") or MODES[0]
    live(run, int(window), mode == MODES[1])
    memory_section(run)
