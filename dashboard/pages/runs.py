"""Runs page: every run at a glance, and a click opens one.

One row per run of the registry (newest first; a click on a header sorts): its status (the detector service's
hung / crashed / restarted over the meta's), newest step, tokens/s and goodput, active incidents and anomalies and
the worst of them, and how long ago a rank last sent a heartbeat. Filters (status, text in the run id) are kept in
the URL.
Selecting a row makes it the selected run and opens its Overview. The landing page when several runs exist
(:func:`trainhealth.dashboard.frame.landing`).
"""

from __future__ import annotations

import pandas as pd
import redis
import streamlit as st

from trainhealth.dashboard import data
from trainhealth.dashboard.common import (
    RUN_KEY,
    Focus,
    client,
    redis_trouble,
    set_focus,
    show_problems,
    to_datetime,
    url_multiselect,
    url_text_input,
    viewer_tz,
)
from trainhealth.dashboard.frame import page_run
from trainhealth.text import plural

#: The board is re-read this often (s): one pipeline for every run (:func:`trainhealth.dashboard.data.run_board`).
REFRESH_S = 5.0
#: Statuses the filter offers: the meta's (docs/architecture.md) and the detector service's judgements.
STATUSES = ("running", "hung", "crashed", "restarted", "finished", "failed", "stopped", "interrupted")
SHOWN = ["run", "status", "step", "throughput_tok_s", "goodput_pct", "active_incidents", "active_anomalies",
         "worst_severity", "heartbeat", "world_size", "started"]
TABLE_KEY = "runs_table"
COLUMNS = {
    "run": st.column_config.TextColumn("run", help="Select a row to open the run."),
    "status": st.column_config.TextColumn("status", help="The detector service's judgement (hung, crashed, "
                                          "restarted) over the status the ranks report."),
    "step": st.column_config.NumberColumn("step", format="localized", help="Newest step of the goodput ledger."),
    "throughput_tok_s": st.column_config.NumberColumn("tokens/s", format="localized",
                                                      help="Throughput over the whole run (as on the Overview)."),
    "goodput_pct": st.column_config.NumberColumn("goodput", format="%.1f%%",
                                                 help="Goodput (time): productive share of wall time."),
    "active_incidents": st.column_config.NumberColumn("active incidents", format="%d",
                                                      help="Root causes now active: the cards on the run's pages."),
    "active_anomalies": st.column_config.NumberColumn("active anomalies", format="%d"),
    "worst_severity": st.column_config.TextColumn("worst", help="Most severe of the active anomalies."),
    "heartbeat": st.column_config.DatetimeColumn("last heartbeat", format="distance",
                                                 help="Newest heartbeat of any rank (every 5 s while a rank "
                                                      "lives); blank once the run ended."),
    "world_size": st.column_config.NumberColumn("ranks", format="%d"),
    "started": st.column_config.DatetimeColumn("started", format="YYYY-MM-DD HH:mm"),
}


def filtered(board: pd.DataFrame, statuses: list[str], text: str) -> pd.DataFrame:
    """The runs of one of ``statuses`` whose id contains ``text`` (any case); an empty filter keeps all."""
    keep = pd.Series(True, index=board.index)
    if statuses:
        keep &= board["status"].isin(statuses)
    if text:
        keep &= board["run"].str.contains(text, case=False, regex=False)
    return board[keep]


def table(board: pd.DataFrame, tz: str) -> pd.DataFrame:
    """Display form: times as datetimes in the viewer's zone, tokens/s to the token."""
    out = board.assign(heartbeat=to_datetime(board["heartbeat_t"], tz), started=to_datetime(board["started_at"], tz),
                       throughput_tok_s=board["throughput_tok_s"].round(0))
    return out[SHOWN].reset_index(drop=True)


def open_run(run: str) -> None:
    """Make ``run`` the selected run and show its Overview."""
    st.session_state[RUN_KEY] = run
    set_focus(run, Focus())
    st.switch_page("pages/overview.py")


@st.fragment(run_every=REFRESH_S)
def live(statuses: list[str], text: str) -> None:
    """The board, re-read alone every :data:`REFRESH_S` seconds."""
    problems: list[str] = []
    try:
        board = data.run_board(client(), problems=problems)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    show_problems(problems)
    rows = filtered(board, statuses, text)
    tz = viewer_tz()
    st.caption(f"{len(rows)} of {plural(len(board), 'run')} shown, newest first (a click on a header sorts) · "
               f"select a row to open the run · times in {tz}")
    shown = table(rows, tz)
    event = st.dataframe(shown, hide_index=True, key=TABLE_KEY, on_select="rerun", selection_mode="single-row",
                         column_config=COLUMNS, placeholder="—", height="content")
    picked = [r for r in event.selection.rows if r < len(shown)]
    if picked:
        open_run(str(shown.loc[picked[0], "run"]))


if page_run(replay_note=False):
    st.subheader("Runs")
    c1, c2 = st.columns([1, 2])
    statuses = url_multiselect(c1, "Status", STATUSES, param="run_status", key="runs_status",
                               placeholder="All statuses")
    text = url_text_input(c2, "Run id contains", param="find", key="runs_find", placeholder="Filter by run id")
    live(statuses, text)
