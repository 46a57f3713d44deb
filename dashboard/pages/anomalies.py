"""Anomalies page: every anomaly of the run, filterable, with the evidence behind each."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import redis
import streamlit as st

from trainhealth.dashboard import data
from trainhealth.dashboard.charts import SEVERITY_COLORS
from trainhealth.dashboard.common import client, redis_trouble, show_problems, to_datetime, viewer_tz
from trainhealth.dashboard.frame import page_run
from trainhealth.defaults import DASHBOARD_REFRESH_S
from trainhealth.text import fmt_int, plural

TABLE_COLUMNS = ["severity", "kind", "status", "step", "end_step", "message", "ranks", "hosts", "first_seen",
                 "last_seen", "id"]
#: Shown columns, narrow ones fixed so the message gets the width and every column fits a
#: 1,366 px screen; ``first_seen`` and the id stay in the data (and the evidence expander).
SHOWN_COLUMNS = ["severity", "kind", "status", "step", "end_step", "message", "ranks", "hosts", "last_seen"]
_LIST_LIMIT = 16
#: Width (px) of the message column; the fixed columns take 592 px, so the table fits the
#: ~905 px a 1,366 px screen leaves beside the sidebar (wider screens spread the rest).
MESSAGE_WIDTH = 300
#: Characters of a message per line of that column (about; proportional font).
LINE_CHARS = 44
#: Row heights (px) for 3 and 4 wrapped lines. Streamlit wraps cell text only in rows taller
#: than 4 rem (64 px); a longer message is cut after 4 lines (a click on the cell, or the
#: evidence expander, shows all of it).
ROW_HEIGHT_3_LINES = 72
ROW_HEIGHT_4_LINES = 92


def _join(values: list, limit: int = _LIST_LIMIT) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", … (+{len(values) - limit})" if len(values) > limit else "")


def _severity_style(severity: str) -> str:
    return f"color: {SEVERITY_COLORS.get(severity, 'inherit')}; font-weight: 600"


def _status_style(status: str) -> str:
    return "font-weight: 600" if status == "active" else "color: gray"


def _displayable(value: Any) -> Any:
    """Evidence with NaN/±inf as the strings ``"nan"``/``"inf"`` (browsers' JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _displayable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_displayable(v) for v in value]
    return value


def filtered(frame: pd.DataFrame, kinds: list[str], severities: list[str], statuses: list[str]) -> pd.DataFrame:
    """Rows matching the filters; an empty filter means all."""
    keep = pd.Series(True, index=frame.index)
    for col, wanted in (("kind", kinds), ("severity", severities), ("status", statuses)):
        if wanted:
            keep &= frame[col].isin(wanted)
    return frame[keep]


def table(frame: pd.DataFrame, tz: str) -> pd.DataFrame:
    """Display form: lists joined, unix seconds as datetimes in the viewer's zone."""
    out = frame.copy()
    out["ranks"] = [_join(r) for r in out["ranks"]]
    out["hosts"] = [_join(h) for h in out["hosts"]]
    for c in ("first_seen", "last_seen"):
        out[c] = to_datetime(out[c], tz)
    return out[TABLE_COLUMNS].reset_index(drop=True)


def row_height(shown: pd.DataFrame) -> int | None:
    """Rows tall enough to wrap the longest message (up to 4 lines); the default when all fit one line."""
    longest = max((len(m) for m in shown["message"]), default=0)
    hosts = max((len(h) for h in shown["hosts"]), default=0)
    if longest <= LINE_CHARS and hosts <= 16:
        return None
    return ROW_HEIGHT_3_LINES if longest <= 3 * LINE_CHARS else ROW_HEIGHT_4_LINES


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def live(run: str, kinds: list[str], severities: list[str], statuses: list[str]) -> None:
    """The anomaly table, re-run alone every ``DASHBOARD_REFRESH_S`` seconds."""
    problems: list[str] = []
    try:
        frame = data.anomalies(client(), run, problems)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    show_problems(problems)
    if frame.empty:
        if not problems:  # "none detected" would be wrong when some could not be read
            st.success("No anomalies detected for this run.", icon=":material/check_circle:")
        return
    rows = filtered(frame, kinds, severities, statuses)
    tz = viewer_tz()
    n_active = int((frame["status"] == "active").sum())
    st.caption(f"{len(rows)} of {plural(len(frame), 'anomaly', 'anomalies')} shown · {n_active} active · "
               f"times in {tz} · the full message and evidence of each are in the expander below")
    shown = table(rows, tz)
    st.dataframe(
        shown.style.map(_severity_style, subset=["severity"]).map(_status_style, subset=["status"]),
        hide_index=True, key="anomaly_table", column_order=SHOWN_COLUMNS, placeholder="—",
        row_height=row_height(shown),
        column_config={
            "severity": st.column_config.TextColumn("severity", width=68),
            "kind": st.column_config.TextColumn("kind", width=84),
            "status": st.column_config.TextColumn("status", width=68),
            "step": st.column_config.NumberColumn("step", format="%d", width=56),
            "end_step": st.column_config.NumberColumn("end step", format="%d", width=64),
            "message": st.column_config.TextColumn("message", width=MESSAGE_WIDTH),
            "ranks": st.column_config.TextColumn("ranks", width=56),
            "hosts": st.column_config.TextColumn("hosts", width=104),
            "first_seen": st.column_config.DatetimeColumn("first seen", format="MM-DD HH:mm:ss"),
            "last_seen": st.column_config.DatetimeColumn("last seen", format="MM-DD HH:mm", width=92,
                                                         help="Newest time the detector saw the anomaly "
                                                              "(seconds in the expander below)."),
        },
    )


def details(run: str) -> None:
    """Expander with the full JSON (evidence included) of one chosen anomaly."""
    try:
        frame = data.anomalies(client(), run)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    if frame.empty:
        return
    with st.expander("Evidence", icon=":material/data_object:"):
        by_id = {row["id"]: row for row in frame.to_dict("records")}
        chosen = st.selectbox("Anomaly", list(by_id), key="anomaly_detail",
                              format_func=lambda i: f"{by_id[i]['severity']} · {by_id[i]['kind']} · "
                                                    f"step {fmt_int(by_id[i]['step'])} · {by_id[i]['status']} · {i}")
        a = by_id[chosen]
        st.markdown(a["message"])
        st.json(_displayable(a["evidence"]))
        tz = viewer_tz()
        seen = " → ".join(f"{t:%Y-%m-%d %H:%M:%S}" for t in (to_datetime(a["first_seen"], tz),
                                                            to_datetime(a["last_seen"], tz)) if t is not None)
        st.caption(f"id `{a['id']}` · ranks {_join(a['ranks']) or '—'} · hosts {_join(a['hosts']) or '—'}"
                   + (f" · seen {seen} ({tz})" if seen else ""))


run = page_run()
if run:
    st.subheader(f"{run} · anomalies")
    c1, c2, c3 = st.columns(3)
    kinds = c1.multiselect("Kind", data.ANOMALY_KINDS, key="filter_kind", placeholder="All kinds")
    severities = c2.multiselect("Severity", data.SEVERITIES, key="filter_severity", placeholder="All severities")
    statuses = c3.multiselect("Status", data.ANOMALY_STATUSES, key="filter_status", placeholder="All statuses")
    live(run, kinds, severities, statuses)
    details(run)
