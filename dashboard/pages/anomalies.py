"""Anomalies page: every anomaly of the run, filterable, with the evidence behind each."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import redis
import streamlit as st

from dashboard import data
from dashboard.charts import SEVERITY_COLORS
from dashboard.common import client, fmt_int, redis_trouble, to_datetime, viewer_tz
from dashboard.frame import page_run
from trainhealth.defaults import DASHBOARD_REFRESH_S

TABLE_COLUMNS = ["severity", "kind", "status", "step", "end_step", "message", "ranks", "hosts", "first_seen",
                 "last_seen", "id"]
#: Shown columns: the id (long, in the evidence expander) stays in the data for copy/export.
SHOWN_COLUMNS = TABLE_COLUMNS[:-1]
_LIST_LIMIT = 16


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


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def live(run: str, kinds: list[str], severities: list[str], statuses: list[str]) -> None:
    """The anomaly table, re-run alone every ``DASHBOARD_REFRESH_S`` seconds."""
    try:
        frame = data.anomalies(client(), run)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    if frame.empty:
        st.success("No anomalies detected for this run.", icon=":material/check_circle:")
        return
    rows = filtered(frame, kinds, severities, statuses)
    tz = viewer_tz()
    n_active = int((frame["status"] == "active").sum())
    st.caption(f"{len(rows)} of {len(frame)} anomalies shown · {n_active} active · times in {tz}")
    st.dataframe(
        table(rows, tz).style.map(_severity_style, subset=["severity"]).map(_status_style, subset=["status"]),
        hide_index=True, key="anomaly_table", column_order=SHOWN_COLUMNS, placeholder="—",
        column_config={
            "step": st.column_config.NumberColumn("step", format="%d"),
            "end_step": st.column_config.NumberColumn("end step", format="%d"),
            "message": st.column_config.TextColumn("message", width="large"),
            "first_seen": st.column_config.DatetimeColumn("first seen", format="MM-DD HH:mm:ss"),
            "last_seen": st.column_config.DatetimeColumn("last seen", format="MM-DD HH:mm:ss"),
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
        st.caption(f"id `{a['id']}` · ranks {_join(a['ranks']) or '—'} · hosts {_join(a['hosts']) or '—'}")


run = page_run()
if run:
    st.subheader(f"{run} · anomalies")
    c1, c2, c3 = st.columns(3)
    kinds = c1.multiselect("Kind", data.ANOMALY_KINDS, key="filter_kind", placeholder="All kinds")
    severities = c2.multiselect("Severity", data.SEVERITIES, key="filter_severity", placeholder="All severities")
    statuses = c3.multiselect("Status", data.ANOMALY_STATUSES, key="filter_status", placeholder="All statuses")
    live(run, kinds, severities, statuses)
    details(run)
