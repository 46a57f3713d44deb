"""Ranks page: per-rank busy-time heatmap and the ranks sorted by how slow they are, with hosts."""

from __future__ import annotations

import pandas as pd
import redis
import streamlit as st

from trainhealth.dashboard import charts, data
from trainhealth.dashboard.common import URL_KEY, client, get_client, redis_trouble, show_problems
from trainhealth.dashboard.frame import page_run
from trainhealth.defaults import DASHBOARD_REFRESH_S, DASHBOARD_STEPS, STRAGGLER_THRESHOLD
from trainhealth.text import plural

#: Hosts change only when ranks restart: re-read at most this often (s).
HOSTS_TTL_S = 30
WINDOWS = (100, 500, DASHBOARD_STEPS)
MODES = ("busy seconds", "ratio to step median")
#: Anomaly kinds about particular ranks or nodes, shown on this page, with their headings.
RANK_KINDS = {"straggler": "Straggler", "slow_node": "Slow node", "rank_outlier": "Rank outlier",
              "dead_rank": "Dead rank"}
NO_TIMINGS = ("No per-rank section timings in this run (a replayed log / untimed steps), so ranks cannot be "
              "compared. Time each step with `with mon.step(step):` and its work with `mon.section(...)` to see "
              "every rank's busy time here.")


@st.cache_data(ttl=HOSTS_TTL_S, show_spinner=False)
def _hosts(url: str, run: str) -> pd.DataFrame:
    return data.rank_hosts(get_client(url), run)


def window_text(recent: pd.DataFrame, onset: int | None) -> str:
    """Which steps the rank table covers, for its caption."""
    first, last, n = int(recent.columns[0]), int(recent.columns[-1]), recent.shape[1]
    span = f"step {first:,}" if n == 1 else f"steps {first:,}–{last:,}"
    if onset is not None:
        return f"since the active straggler's onset ({span}, {plural(n, 'step')})"
    return f"over the last {plural(n, 'step')} ({span})"


def _highlight(row: pd.Series) -> list[str]:
    style = "background-color: rgba(214, 39, 40, 0.18)" if row["straggler"] or row.get("culprit", False) else ""
    return [style] * len(row)


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def live(run: str, window: int, relative: bool) -> None:
    """Heatmap and rank table, re-run alone every ``DASHBOARD_REFRESH_S`` seconds."""
    problems: list[str] = []
    try:
        cl = client()
        matrix = data.rank_matrix(cl, run, window, problems)
        anomalies = data.anomalies(cl, run, problems)
        state = data.job_state(cl, run, problems)
        hosts = _hosts(st.session_state.get(URL_KEY, ""), run)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    show_problems(problems)

    active = anomalies[(anomalies["status"] == "active") & anomalies["kind"].isin(RANK_KINDS)] \
        if not anomalies.empty else anomalies
    straggler_ranks = sorted({int(r) for ranks in active["ranks"] for r in ranks}) if not active.empty else []
    for a in active.itertuples(index=False):
        where = ", ".join(f"rank {r}" for r in a.ranks) or "ranks ?"
        on = f" on {', '.join(a.hosts)}" if a.hosts else ""
        since = f" since step {a.step}" if pd.notna(a.step) else ""
        st.warning(f"**{RANK_KINDS[a.kind]}**: {where}{on}{since} — {a.message}", icon=":material/slow_motion_video:")
    # The rank that stopped first while the job is hung or crashed (the Overview's banner says the rest).
    culprit = None
    if state is not None and state.state in ("hung", "crashed") and state.culprit is not None:
        culprit = state.culprit
        why = culprit.why.strip().rstrip(".")
        st.error(f"**Job {state.state}**: {culprit.name()} stopped first" + (f" — {why}" if why else ""),
                 icon=":material/error:")

    if matrix.shape[1] == 0:
        st.info("No aggregated steps yet for this run.", icon=":material/hourglass_empty:")
        return
    if not data.has_rank_timings(matrix):
        st.info(NO_TIMINGS, icon=":material/timer_off:")
        return
    st.plotly_chart(charts.rank_heatmap(matrix, relative=relative, highlight=straggler_ranks).update_layout(
        uirevision=run), config={"displaylogo": False}, key="heatmap")

    recent, onset = data.rank_table_window(matrix, anomalies)
    summary = data.rank_summary(recent, hosts)
    summary["straggler"] = summary["rank"].isin(straggler_ranks)
    if culprit is not None:
        summary["culprit"] = summary["rank"] == culprit.rank
    st.markdown("##### Ranks, slowest first")
    st.caption("Busy = seconds a rank spends in its own timed sections before the collective; a slow rank "
               "makes all others wait. Ratio = the rank's median busy time / the median rank's; score = the "
               "fastest rank's median / this rank's (NVIDIA's relative score, which the straggler detector "
               f"flags below {STRAGGLER_THRESHOLD:g}), " + window_text(recent, onset) + ".")
    st.dataframe(
        summary.style.apply(_highlight, axis=1), hide_index=True, key="rank_table",
        column_config={
            "rank": st.column_config.NumberColumn("rank", format="%d"),
            "host": st.column_config.TextColumn("host"),
            "median_busy_s": st.column_config.NumberColumn("median busy (s)", format="%.3f"),
            "ratio": st.column_config.NumberColumn("ratio vs median rank", format="%.2f×"),
            "score": st.column_config.NumberColumn("score", format="%.2f",
                                                   help="Fastest rank's median busy time / this rank's."),
            "steps": st.column_config.NumberColumn("steps reported", format="%d"),
            "straggler": st.column_config.CheckboxColumn("flagged", help="In an active straggler, slow-node, "
                                                         "rank-outlier or dead-rank anomaly."),
            "culprit": st.column_config.CheckboxColumn("stopped first", help="The culprit of the hang or crash: "
                                                       "the rank the detector service saw stop first."),
        },
    )


run = page_run()
if run:
    st.subheader(f"{run} · ranks")
    c1, c2 = st.columns(2)
    window = c1.segmented_control("Steps shown", WINDOWS, default=500, format_func=lambda n: f"last {n:,}",
                                  key="ranks_window") or 500
    mode = c2.segmented_control("Colour", MODES, default=MODES[0], key="ranks_mode") or MODES[0]
    live(run, int(window), mode == MODES[1])
