"""Alerts page: the alert worker and its sinks, recent notifications, silences (add / expire), dead letters.

Every Redis read and write goes through :mod:`trainhealth.alert_store` (the alerting keys are the alert
worker's, see docs/alerts.md); this page only lays them out. Silences added here mute matching alerts at
the worker's next flush; requeued dead letters are delivered again with their idempotency key.

A read-only dashboard (``--read-only``) has neither the silence forms nor the resend form, and says which
command does it instead. A silence added here is created by the logged-in user when a login is configured,
else by the name typed in "Your name" or, left empty, the OS user running the dashboard plus ``(no login)``
(:func:`trainhealth.dashboard.common.actor`, docs/security.md).
"""

from __future__ import annotations

import math
import time
from typing import Any

import pandas as pd
import redis
import streamlit as st

from trainhealth import alert_store as store
from trainhealth.anomaly import ALL_KINDS, SEVERITIES
from trainhealth.dashboard import data, incidents
from trainhealth.dashboard.common import actor, client, logged_in, read_only, redis_trouble, to_datetime, viewer_tz
from trainhealth.dashboard.frame import page_run
from trainhealth.matchers import INTERNAL_KINDS, MatcherError
from trainhealth.text import fmt_duration, parse_duration

#: Seconds between refreshes of the live parts of the page.
REFRESH_S = 5.0
#: Characters of an idempotency key shown.
KEY_SHOWN = 12
NOTIFICATION_COLUMNS = ["delivered_at", "status", "title", "sink", "reason", "seq", "attempts", "http_status", "key"]
SILENCE_COLUMNS = ["id", "state", "matchers", "starts_at", "ends_at", "created_by", "comment"]
DEAD_COLUMNS = ["dead_at", "sink", "group", "seq", "attempts", "status", "error", "id"]
SINK_COLUMNS = ["sink", "type", "state", "last_ok", "delivered", "dead", "last_error"]
DURATIONS = ("30m", "1h", "2h", "4h", "12h", "1d", "3d", "7d")
#: Where the forms would be on a read-only dashboard.
SILENCES_READ_ONLY = ("Read-only: add a silence with `trainhealth silence add`, end one with "
                      "`trainhealth silence expire ID`.")
DEAD_READ_ONLY = "Read-only: resend dead letters with `trainhealth deadletters requeue ID... | --all`."


def _times(s: pd.Series) -> pd.Series:
    """Unix seconds; anything else (garbage in the alert keys) is NaT rather than a traceback."""
    x = pd.to_numeric(s.map(lambda v: v if isinstance(v, (int, float)) and not isinstance(v, bool) else None),
                      errors="coerce").astype("float64")
    return x.where(x.abs() < data.MAX_TIME)


def notifications_frame(rows: list[dict[str, Any]], tz: str) -> pd.DataFrame:
    """Recent notifications for display (newest first)."""
    frame = pd.DataFrame(rows, columns=NOTIFICATION_COLUMNS)
    frame["delivered_at"] = to_datetime(_times(frame["delivered_at"]), tz)
    # The first 12 of the key's 32 hex digits tell notifications apart and fit the table beside the title.
    frame["key"] = [k[:KEY_SHOWN] + "…" if isinstance(k, str) and len(k) > KEY_SHOWN + 1 else k for k in frame["key"]]
    return frame


def silences_frame(silences: list, now: float, tz: str) -> pd.DataFrame:
    """Silences for display: state (active, pending, expired), matchers joined, times in ``tz``."""
    rows = [{"id": s.id, "state": "active" if s.active(now) else "pending" if s.starts_at > now else "expired",
             "matchers": " ".join(map(str, s.matchers)), "starts_at": s.starts_at, "ends_at": s.ends_at,
             "created_by": s.created_by, "comment": s.comment} for s in silences]
    frame = pd.DataFrame(rows, columns=SILENCE_COLUMNS)
    for c in ("starts_at", "ends_at"):
        frame[c] = to_datetime(frame[c].astype(float), tz)
    return frame


def dead_frame(rows: list[dict[str, Any]], tz: str) -> pd.DataFrame:
    """Dead letters for display (newest first)."""
    frame = pd.DataFrame(rows, columns=DEAD_COLUMNS)
    frame["dead_at"] = to_datetime(_times(frame["dead_at"]), tz)
    return frame


def _number(v: Any) -> float:
    """A stored number, 0 when missing or not a number (alert state written by another version)."""
    x = data._num(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else math.nan
    return x if math.isfinite(x) else 0.0


def _count(v: Any) -> int:
    return int(_number(v))


def sinks_frame(states: dict[str, dict[str, Any]], now: float) -> pd.DataFrame:
    """One row per sink: failing or ok, last success age, counters, last error (secrets already removed)."""
    rows = []
    for name, st_ in states.items():
        if not isinstance(st_, dict):  # garbage in the sinks hash: a row that says so, not a traceback
            rows.append({"sink": name, "state": f"unreadable state: {data.show_value(st_)}"})
            continue
        fails = _count(st_.get("consecutive_failures"))
        paused = _number(st_.get("paused_until"))
        state = "ok" if not fails else f"failing ({fails} in a row)"
        if paused > now:
            state += f", rate-limited {paused - now:.0f} s"
        last_ok = _number(st_.get("last_ok_at"))
        rows.append({"sink": name, "type": str(st_.get("type", "")), "state": state,
                     "last_ok": f"{fmt_duration(now - last_ok)} ago" if last_ok else "never",
                     "delivered": _count(st_.get("delivered")), "dead": _count(st_.get("dead")),
                     "last_error": str(st_.get("last_error", "")) if fails else ""})
    return pd.DataFrame(rows, columns=SINK_COLUMNS)


@st.fragment(run_every=REFRESH_S)
def live(run: str | None) -> None:
    """Worker status, sinks, recent notifications and dead letters, refreshed every ``REFRESH_S`` seconds."""
    try:
        c = client()
        now = time.time()
        beats = store.workers(c)
        stats = store.outbox_stats(c)
        sinks = store.sink_states(c)
        only_run = st.session_state.get("alerts_only_run", True) and bool(run)
        sent = store.recent_notifications(c, 200, run=run if only_run else None)
        dead = [d for d in store.dead_letters(c, 200) if isinstance(d, dict)]  # JSON that is no object: left out
        n_silences = sum(1 for s in store.list_silences(c, now) if s.active(now))
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        # trainhealth.alert_store parses the alert keys strictly: say which read failed, not a traceback.
        st.warning(f"The alert worker's state in Redis (`th:{{alerts}}:*`) is unreadable: {exc!r}",
                   icon=":material/report:")
        return
    tz = viewer_tz()
    leader = next((b for b in beats if b.get("role") == "leader"), None)
    leader_t = _number(leader.get("t")) if leader else 0.0
    m1, m2, m3, m4 = st.columns(4)
    m1.metric("Alert worker", "running" if leader else "down",
              f"heartbeat {fmt_duration(now - leader_t)} ago" if leader else "start `trainhealth alerts`",
              delta_color="off" if leader else "inverse")
    m2.metric("Pending deliveries", f"{stats['pending']:,}")
    resend = "resend with the CLI" if read_only() else "resend below"
    m3.metric("Dead letters", f"{stats['dead']:,}", resend if stats["dead"] else None, delta_color="off")
    m4.metric("Active silences", f"{n_silences:,}")
    if leader and leader.get("service_down"):
        st.error("The alert worker raised **service_down**: ranks send data but no detector service runs.",
                 icon=":material/heart_broken:")
    if sinks:
        st.dataframe(sinks_frame(sinks, now), hide_index=True, key="alerts_sinks")
    st.markdown("##### Recent notifications" + (f" · run `{run}`" if only_run else " · all runs"))
    if sent:
        st.dataframe(notifications_frame(sent, tz), hide_index=True, key="alerts_sent", column_config={
            "delivered_at": st.column_config.DatetimeColumn("delivered", format="MM-DD HH:mm:ss"),
            "title": st.column_config.TextColumn("notification", width="large"),
            "key": st.column_config.TextColumn("key", help="The start of the idempotency key the receiver sees "
                                               "(`Idempotency-Key` header), enough to find it in the receiver's logs."),
            "seq": st.column_config.NumberColumn("#", format="%d"),
        })
    else:
        st.caption("No notification delivered yet.")
    st.markdown("##### Dead letters")
    if dead:
        st.dataframe(dead_frame(dead, tz), hide_index=True, key="alerts_dead", column_config={
            "dead_at": st.column_config.DatetimeColumn("given up", format="MM-DD HH:mm:ss"),
            "error": st.column_config.TextColumn("last error", width="large"),
        })
    else:
        st.caption("No dead letters: every notification was delivered or is still being tried.")


def silences(run: str | None) -> None:
    """The silences table, the add form (prefilled with the selected run) and the expire form."""
    st.markdown("##### Silences")
    try:
        c = client()
        now = time.time()
        rows = store.list_silences(c, now, include_expired=st.session_state.get("alerts_expired", False))
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    if rows:
        st.dataframe(silences_frame(rows, now, viewer_tz()), hide_index=True, key="alerts_silences", column_config={
            "starts_at": st.column_config.DatetimeColumn("from", format="MM-DD HH:mm"),
            "ends_at": st.column_config.DatetimeColumn("until", format="MM-DD HH:mm"),
        })
    else:
        st.caption("No silences.")
    st.checkbox("Show expired silences", key="alerts_expired")
    if read_only():
        st.caption(SILENCES_READ_ONLY)
        return
    left, right = st.columns(2)
    with left.form("add_silence", clear_on_submit=False):
        st.markdown("**Add a silence** (every filled field must match)")
        f_run = st.text_input("Run", value=run or "", key="sil_run")
        f_kind = st.selectbox("Kind", ["(any)", *ALL_KINDS, *INTERNAL_KINDS], key="sil_kind")
        f_sev = st.selectbox("Severity", ["(any)", *SEVERITIES], key="sil_severity")
        f_rank = st.text_input("Rank", key="sil_rank", help="matches anomalies involving this rank")
        f_host = st.text_input("Host", key="sil_host")
        f_dur = st.selectbox("For", DURATIONS, index=2, key="sil_duration")
        f_comment = st.text_input("Comment", key="sil_comment")
        if logged_in():  # the identity provider says who: no name to type
            st.caption(f"Created by **{actor()}**")
            f_by = ""
        else:
            f_by = st.text_input("Your name", key="sil_by", help=f"left empty: {actor()}")
        if st.form_submit_button("Add silence", icon=":material/notifications_off:"):
            matchers = [f'{label}="{value.strip()}"' for label, value in
                        (("run", f_run), ("rank", f_rank), ("host", f_host)) if value.strip()]
            matchers += [f'{label}="{value}"' for label, value in (("kind", f_kind), ("severity", f_sev))
                         if value != "(any)"]
            try:
                s = store.add_silence(c, matchers, duration_s=parse_duration(f_dur),
                                      created_by=f_by.strip() or actor(), comment=f_comment.strip())
            except MatcherError as exc:
                st.error(f"Not added: {exc}", icon=":material/error:")
            except redis.RedisError as exc:
                redis_trouble(exc)
            else:
                st.success(f"Silence `{s.id}` added: {' '.join(map(str, s.matchers))} for {f_dur}.",
                           icon=":material/check_circle:")
    active = [s for s in rows if s.ends_at > now]
    with right.form("expire_silence"):
        st.markdown("**Expire a silence**")
        chosen = st.selectbox("Silence", [s.id for s in active], key="sil_expire",
                              format_func=lambda i: next(f"{i} · {' '.join(map(str, s.matchers))}"
                                                         for s in active if s.id == i))
        if st.form_submit_button("Expire now", icon=":material/notifications_active:", disabled=not active):
            try:
                done = store.expire_silence(c, chosen) if chosen else False
            except redis.RedisError as exc:
                redis_trouble(exc)
            else:
                (st.success if done else st.warning)(f"Silence `{chosen}` expired." if done else
                                                     f"Silence `{chosen}` was already over.")


def dead_actions() -> None:
    """Requeue dead letters (all, or one) into the outbox."""
    try:
        c = client()
        dead = store.dead_letters(c, 200)
    except redis.RedisError as exc:
        redis_trouble(exc)
        return
    if not dead:
        return
    if read_only():
        st.caption(DEAD_READ_ONLY)
        return
    with st.form("requeue_dead"):
        # .get: a dead letter missing a field (written by hand or another version) must not break the form.
        by_id = {str(d.get("id")): d for d in dead if isinstance(d, dict) and d.get("id") is not None}
        chosen = st.multiselect("Dead letters to resend", list(by_id), key="dead_pick",
                                format_func=lambda i: f"{i} · {by_id[i].get('sink')} · #{by_id[i].get('seq')} "
                                                      f"{by_id[i].get('group')}")
        c1, c2 = st.columns(2)
        one = c1.form_submit_button("Resend selected", icon=":material/send:")
        every = c2.form_submit_button("Resend all", icon=":material/forward_to_inbox:")
        if one or every:
            try:
                n = store.requeue_dead(c, None if every else chosen)
            except redis.RedisError as exc:
                redis_trouble(exc)
            else:
                st.success(f"{n} notification{'s' if n != 1 else ''} back in the outbox.",
                           icon=":material/check_circle:")


run = page_run()
st.subheader("Alerts" + (f" · {run}" if run else ""))
if run:
    incidents.header(run, "alerts")
st.toggle("Only notifications of the selected run", value=True, key="alerts_only_run", disabled=not run)
live(run)
dead_actions()
silences(run)
