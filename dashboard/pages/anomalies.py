"""Anomalies page: every anomaly of the run in one full-height table, the evidence of the selected one beside it.

Sorted active first, then by severity, then newest (:func:`trainhealth.dashboard.data.anomalies`); the kind in
words (:func:`trainhealth.dashboard.common.kind_words`). The filters (status, severity, kind, rank) are kept in the
URL (``?status=active&severity=critical,warning&kind=straggler&rank_filter=3``). A link's step and rank (an
alert's ``?step=250-800&rank=5``) select the anomaly there (:func:`trainhealth.dashboard.data.match_anomaly`);
selecting another row makes its steps and ranks the link's.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import redis
import streamlit as st

from trainhealth.dashboard import data, incidents
from trainhealth.dashboard.charts import SEVERITY_COLORS
from trainhealth.dashboard.common import (
    KIND_WORDS,
    anomaly_focus,
    client,
    current_focus,
    kind_words,
    redis_trouble,
    select_table,
    set_focus,
    show_problems,
    to_datetime,
    url_multiselect,
    viewer_tz,
)
from trainhealth.dashboard.frame import page_run
from trainhealth.defaults import DASHBOARD_REFRESH_S
from trainhealth.text import plural

TABLE_COLUMNS = ["severity", "kind", "status", "step", "end_step", "message", "ranks", "hosts", "first_seen",
                 "last_seen", "id"]
#: Shown columns, each wide enough for its longest value on one line ("Grad-norm explosion", "100,000"), together
#: 512 px (+ the selection column) so the table fits beside the evidence at 1,366 px: the message, the times and
#: the id stay in the data and are shown beside the table for the selected row.
SHOWN_COLUMNS = ["severity", "kind", "status", "step", "end_step", "ranks", "hosts"]
COLUMNS = {
    "severity": st.column_config.TextColumn("severity", width=64),
    "kind": st.column_config.TextColumn("kind", width=128),
    "status": st.column_config.TextColumn("status", width=60),
    "step": st.column_config.NumberColumn("step", format="%d", width=56, help="Onset step."),
    "end_step": st.column_config.NumberColumn("end step", format="%d", width=60,
                                              help="Last step showing it, once resolved."),
    "ranks": st.column_config.TextColumn("ranks", width=56),
    "hosts": st.column_config.TextColumn("hosts", width=88),
}
#: Table : evidence widths.
LAYOUT = [5, 3]
_LIST_LIMIT = 16
#: Session-state keys: ``(run, anomaly id)`` picked by a click or a link; ``(run, Focus)`` last matched.
CHOSEN_KEY, MATCHED_KEY = "anomaly_chosen", "anomaly_matched"
#: Streamlit markdown colours of the severities (as :data:`~trainhealth.dashboard.charts.SEVERITY_COLORS`).
SEVERITY_MARKDOWN = {"critical": "red", "warning": "orange", "info": "blue"}


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


def filtered(frame: pd.DataFrame, kinds: list[str], severities: list[str], statuses: list[str],
             ranks: list[int] | None = None) -> pd.DataFrame:
    """Rows matching the filters (``ranks``: naming one of them); an empty filter means all."""
    keep = pd.Series(True, index=frame.index)
    for col, wanted in (("kind", kinds), ("severity", severities), ("status", statuses)):
        if wanted:
            keep &= frame[col].isin(wanted)
    if ranks:
        keep &= data.names_ranks(frame, ranks)
    return frame[keep]


def table(frame: pd.DataFrame, tz: str) -> pd.DataFrame:
    """Display form: the kind in words, lists joined, unix seconds as datetimes in the viewer's zone."""
    out = frame.copy()
    out["kind"] = out["kind"].map(kind_words)
    out["ranks"] = [_join(r) for r in out["ranks"]]
    out["hosts"] = [_join(h) for h in out["hosts"]]
    for c in ("first_seen", "last_seen"):
        out[c] = to_datetime(out[c], tz)
    return out[TABLE_COLUMNS].reset_index(drop=True)


def _steps(a: dict) -> str:
    start, end = a["step"], a["end_step"]
    if pd.isna(start):
        return "step ?"
    if pd.isna(end):
        return f"since step {start:,}"
    return f"step {start:,}" if end == start else f"steps {start:,}–{end:,}"


def evidence(a: dict, tz: str) -> None:
    """The selected anomaly: what, where, since when, its message and the detector's numbers."""
    color = SEVERITY_MARKDOWN.get(a["severity"], "gray")
    st.markdown(f"#### {kind_words(a['kind'])}")
    st.markdown(f":{color}[**{a['severity'] or '?'}**] · {a['status'] or '?'} · {_steps(a)}")
    st.markdown(a["message"])
    st.json(_displayable(a["evidence"]))
    seen = " → ".join(f"{t:%Y-%m-%d %H:%M:%S}" for t in (to_datetime(a["first_seen"], tz),
                                                        to_datetime(a["last_seen"], tz)) if t is not None)
    st.caption(f"id `{a['id']}` · ranks {_join(a['ranks']) or '—'} · hosts {_join(a['hosts']) or '—'}"
               + (f" · seen {seen} ({tz})" if seen else ""))


def chosen_id(run: str, frame: pd.DataFrame) -> str | None:
    """The anomaly picked last: by a click, or the one a new link (focus) points at."""
    focus = current_focus(run)
    if st.session_state.get(MATCHED_KEY) != (run, focus):
        st.session_state[MATCHED_KEY] = (run, focus)
        linked = data.match_anomaly(frame, focus.step_from, focus.step_to, focus.ranks)
        if linked is not None:
            st.session_state[CHOSEN_KEY] = (run, linked)
    picked = st.session_state.get(CHOSEN_KEY)
    return picked[1] if picked and picked[0] == run else None


def filters(frame: pd.DataFrame) -> tuple[list[str], list[str], list[str], list[int]]:
    """The four filters, kept in the URL; the rank filter offers the ranks the anomalies name."""
    c1, c2, c3, c4 = st.columns(4)
    statuses = url_multiselect(c1, "Status", data.ANOMALY_STATUSES, param="status", key="filter_status",
                               placeholder="All statuses")
    severities = url_multiselect(c2, "Severity", data.SEVERITIES, param="severity", key="filter_severity",
                                 placeholder="All severities")
    kinds = [*KIND_WORDS, *sorted({k for k in frame["kind"] if isinstance(k, str)} - set(KIND_WORDS))]
    kinds = url_multiselect(c3, "Kind", kinds, param="kind", key="filter_kind", format_func=kind_words,
                            placeholder="All kinds")
    named = sorted({int(r) for ranks in frame["ranks"] for r in ranks})
    ranks = url_multiselect(c4, "Rank", named, param="rank_filter", key="filter_rank", placeholder="All ranks")
    return kinds, severities, statuses, ranks


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def live(run: str) -> None:
    """Filters, table and evidence, re-run alone every ``DASHBOARD_REFRESH_S`` seconds."""
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
    kinds, severities, statuses, ranks = filters(frame)
    rows = filtered(frame, kinds, severities, statuses, ranks)
    tz = viewer_tz()
    n_active = int((frame["status"] == "active").sum())
    st.caption(f"{len(rows)} of {plural(len(frame), 'anomaly', 'anomalies')} shown · {n_active} active · active "
               f"first, then by severity, newest first · times in {tz} · select a row to see its evidence")
    if rows.empty:
        st.info("No anomaly matches these filters.", icon=":material/filter_alt_off:")
        return
    shown = table(rows, tz)
    left, right = st.columns(LAYOUT)
    with left:
        styled = shown.style.map(_severity_style, subset=["severity"]).map(_status_style, subset=["status"])
        picked, clicked = select_table(styled, shown["id"], chosen_id(run, frame), "anomaly_table", hide_index=True,
                                       column_order=SHOWN_COLUMNS, column_config=COLUMNS, placeholder="—",
                                       height="content")
    a = rows[rows["id"] == picked].iloc[0].to_dict()
    if clicked:  # the row's steps and ranks become the link's (the Ranks page drills down to them)
        focus = anomaly_focus(a["step"], a["end_step"], a["ranks"])
        set_focus(run, focus)
        st.session_state[CHOSEN_KEY] = (run, picked)
        st.session_state[MATCHED_KEY] = (run, focus)
    with right:
        evidence(a, tz)


run = page_run()
if run:
    st.subheader(f"{run} · anomalies")
    incidents.header(run, "anomalies")
    live(run)
