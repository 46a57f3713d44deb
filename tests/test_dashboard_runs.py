"""Issue 16: the Runs page, deep links (``run``, ``step``/``step_from``/``step_to``, ``rank``) on every page, the
Anomalies page's order, filters and evidence, and the Ranks page's one meaning of "flagged".

Against a real Redis, rendered with AppTest; the runs are written with raw redis-py commands following
docs/architecture.md (the 4-rank ``llama-7b`` of tests/test_dashboard.py, and ``deep`` below).
"""

from __future__ import annotations

import json
import re
import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pandas as pd
import pytest
import redis
import streamlit as st
from streamlit.testing.v1 import AppTest

from trainhealth.alerts.notification import dashboard_link
from trainhealth.dashboard import data
from trainhealth.dashboard.common import Focus, kind_words, parse_focus
from trainhealth.keys import RUNS, run_keys

pytestmark = pytest.mark.usefixtures("fresh_streamlit_caches")

_BASE = runpy.run_path(str(Path(__file__).with_name("test_dashboard.py")))
seed_run, service_beat, T0, RUN, APP = (_BASE[n] for n in ("seed_run", "service_beat", "T0", "RUN", "APP"))
DEEP = "deep"
DEEP_HOSTS = {0: "n-a", 1: "n-a", 2: "n-b", 3: "n-b"}


def busy_of(step: int) -> list[float]:
    """Rank 1 straggles from step 30 (0.30 s); rank 3 is slow at steps 40-45 only (0.25 s); else 0.10-0.13 s."""
    busy = [0.10, 0.11, 0.12, 0.13]
    if step >= 30:
        busy[1] = 0.30
    if 40 <= step <= 45:
        busy[3] = 0.25
    return busy


#: The anomalies of ``deep``, in the order the page must list them: active first, then by severity, newest first.
#: The state line heading every page of the deep run: it has anomalies but no incidents (seeded as a service older
#: than them wrote), so its active anomalies give the state.
STATE_LINE = (":red-badge[:material/error: critical] · running · 3 active anomalies (1 critical): loss is NaN at step "
              "50; steps are 40 % slower since step 38 and 1 more · 3 resolved")
DEEP_ANOMALIES = [
    {"id": "nan_inf:*:50:0", "kind": "nan_inf", "severity": "critical", "status": "active", "step": 50,
     "end_step": None, "ranks": [], "hosts": [], "evidence": {"loss": "nan"}, "message": "loss is NaN at step 50",
     "first_seen": T0 + 50, "last_seen": T0 + 60},
    {"id": "throughput_drop:*:38:0", "kind": "throughput_drop", "severity": "warning", "status": "active",
     "step": 38, "end_step": None, "ranks": [], "hosts": [], "evidence": {"rel_change": 0.4},
     "message": "steps are 40 % slower since step 38", "first_seen": T0 + 38, "last_seen": T0 + 60},
    {"id": "straggler:1:30:0", "kind": "straggler", "severity": "warning", "status": "active", "step": 30,
     "end_step": None, "ranks": [1], "hosts": ["n-a"], "evidence": {"score": 0.33},
     "message": "rank 1 is 2.7x slower than the median rank", "first_seen": T0 + 30, "last_seen": T0 + 60},
    {"id": "loss_spike:*:40:0", "kind": "loss_spike", "severity": "critical", "status": "resolved", "step": 40,
     "end_step": 41, "ranks": [], "hosts": [], "evidence": {"z": 9.0}, "message": "loss spike at step 40",
     "first_seen": T0 + 40, "last_seen": T0 + 41},
    {"id": "rank_outlier:3:40:0", "kind": "rank_outlier", "severity": "warning", "status": "resolved", "step": 40,
     "end_step": 45, "ranks": [3], "hosts": ["n-b"], "evidence": {"score": 0.71},
     "message": "rank 3 was an outlier from step 40 to 45", "first_seen": T0 + 40.5, "last_seen": T0 + 46},
    {"id": "slow_step:*:20:0", "kind": "slow_step", "severity": "info", "status": "resolved", "step": 20,
     "end_step": 20, "ranks": [], "hosts": [], "evidence": {"ratio": 2.5}, "message": "step 20 took 2.5x the median",
     "first_seen": T0 + 20, "last_seen": T0 + 20},
]


def seed_deep(r: redis.Redis) -> None:
    """``deep``: 4 ranks on two hosts, steps 1-60 (one generation), the anomalies above, newest in the registry."""
    k = run_keys(DEEP)
    r.zadd(RUNS, {DEEP: T0 + 1000})
    r.hset(k.meta, mapping={"name": DEEP, "world_size": "4", "status": "running", "started_at": repr(T0)})
    pipe = r.pipeline()
    for step in range(1, 61):
        pipe.xadd(k.agg, {"step": step, "gen": 0, "t_start": repr(T0 + step - 1), "t_end": repr(T0 + step - 0.5),
                          "dur": "0.5", "loss": "2.0", "tokens": 1000, "n_ranks": 4, "busy": json.dumps(busy_of(step))},
                  id=f"1-{step}")
    for rank, host in DEEP_HOSTS.items():
        pipe.xadd(k.events, {"kind": "run_start", "rank": rank, "t": repr(T0), "inc": repr(T0), "host": host,
                             "pid": 10 + rank, "world_size": 4, "local_rank": rank % 2, "config": "{}"})
    for a in DEEP_ANOMALIES:
        pipe.hset(k.anomalies, a["id"], json.dumps({"run": DEEP, **a}))
    pipe.execute()



@pytest.fixture
def seeded(r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> redis.Redis:
    """The three runs of tests/test_dashboard.py, a second heartbeat of llama-7b and a stale one of the ended
    old-run, with a live detector service."""
    seed_run(r)
    r.hset(run_keys(RUN).heartbeats, "1", json.dumps({"t": T0 + 104.5, "step": 12, "step_t": T0 + 98,
                                                      "phase": "train", "host": "node-a", "pid": 201}))
    r.hset(run_keys("old-run").heartbeats, "0", json.dumps({"t": T0 - 80000, "step": 5, "host": "x"}))
    # Its two active anomalies are one incident (as the service groups them); an older one is over.
    r.hset(run_keys(RUN).incidents, mapping={
        "inc:hang:*:12:0": json.dumps({"id": "inc:hang:*:12:0", "status": "active", "severity": "critical"}),
        "inc:slow_step:*:3:0": json.dumps({"id": "inc:slow_step:*:3:0", "status": "resolved", "severity": "info"})})
    service_beat(r)
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    return r


@pytest.fixture
def deep(seeded: redis.Redis) -> redis.Redis:
    seed_deep(seeded)
    return seeded


def app(page: str | None = None, **query: str) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update(query)
    at.run()
    if page:
        at.switch_page(page).run()
    assert not at.exception
    return at


def selected_rows(at: AppTest, i: int) -> list[int]:
    return at.session_state[at.dataframe[i].key]["selection"]["rows"]


def select_row(at: AppTest, i: int, row: int) -> AppTest:
    """Click row ``row`` of the ``i``-th table (AppTest writes the grid's selection state)."""
    at.session_state[at.dataframe[i].key] = {"selection": {"rows": [row], "columns": [], "cells": []}}
    at.run()
    assert not at.exception
    return at


# --- the Runs page ---------------------------------------------------------------------------------

@pytest.mark.parametrize("decoded", [False, True])
def test_run_board_reads_every_run_in_one_pipeline(seeded: redis.Redis, redis_url: str, decoded: bool) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=decoded)
    calls: list[str] = []
    plain, pipeline = client.execute_command, client.pipeline

    def command(*args: Any, **kw: Any) -> Any:
        calls.append(str(args[0]))
        return plain(*args, **kw)

    def counted_pipeline(*args: Any, **kw: Any) -> Any:
        pipe = pipeline(*args, **kw)
        run = pipe.execute

        def execute(*a: Any, **k: Any) -> Any:
            calls.append(f"pipeline of {len(pipe.command_stack)}")
            return run(*a, **k)

        pipe.execute = execute
        return pipe

    client.execute_command, client.pipeline = command, counted_pipeline
    board = data.run_board(client)
    # Two round trips for three runs: the registry, then 6 reads per run in one pipeline.
    assert calls == ["ZREVRANGE", "pipeline of 18"]
    assert board.astype(object).where(board.notna(), None).to_dict("records") == [
        {"run": RUN, "status": "running", "step": 12, "throughput_tok_s": pytest.approx(14 * 4096 / 84.5),
         "goodput_pct": 71.5, "active_incidents": 1, "active_anomalies": 2, "worst_severity": "critical",
         "heartbeat_t": T0 + 104.5,  # the newest of the two ranks' heartbeats
         "started_at": T0, "world_size": 4, "name": RUN},
        {"run": "empty-run", "status": "running", "step": None, "throughput_tok_s": None, "goodput_pct": None,
         "active_incidents": 0, "active_anomalies": 0, "worst_severity": None, "heartbeat_t": None,
         "started_at": T0 - 3600,
         "world_size": 8, "name": "empty-run"},
        # Ended: its stale heartbeat is not looked at (the script returns at once for an ended run).
        {"run": "old-run", "status": "finished", "step": None, "throughput_tok_s": None, "goodput_pct": None,
         "active_incidents": 0, "active_anomalies": 0, "worst_severity": None, "heartbeat_t": None,
         "started_at": T0 - 86400,
         "world_size": 2, "name": "old-run"},
    ]
    client.close()


def test_run_board_status_is_the_services_judgement(seeded: redis.Redis) -> None:
    seeded.set(run_keys("empty-run").state, json.dumps({"state": "hung", "since": T0, "step": 3, "culprit": None,
                                                        "message": "hung", "gen": 0}))
    seeded.set(run_keys("old-run").ledger_latest, "{not json")
    problems: list[str] = []
    board = data.run_board(seeded, problems=problems)
    assert list(board["status"]) == ["running", "hung", "finished"]
    assert problems == ["Some runs' keys are unreadable, shown as missing (1; first: th:{old-run}:ledger:latest: "
                        "not JSON)"]


def test_runs_page_is_the_landing_page_with_several_runs(seeded: redis.Redis) -> None:
    at = app()
    assert [h.value for h in at.subheader] == ["Runs"]
    table = at.dataframe[0].value
    assert list(table.columns) == ["run", "status", "step", "throughput_tok_s", "goodput_pct", "active_incidents",
                                   "active_anomalies", "worst_severity", "heartbeat", "world_size", "started"]
    assert list(table["run"]) == [RUN, "empty-run", "old-run"]
    assert list(table["status"]) == ["running", "running", "finished"]
    assert table.loc[0, "step"] == 12 and table["step"].iloc[1:].isna().all()
    assert table.loc[0, "throughput_tok_s"] == 679.0  # 14 × 4,096 tokens / 84.5 s, as the Overview's card
    assert table.loc[0, "goodput_pct"] == 71.5
    assert list(table["active_incidents"]) == [1, 0, 0]
    assert list(table["active_anomalies"]) == [2, 0, 0]
    assert list(table["worst_severity"].fillna("")) == ["critical", "", ""]
    assert table.loc[0, "heartbeat"] == pd.Timestamp(T0 + 104.5, unit="s", tz="UTC")
    assert table["heartbeat"].iloc[1:].isna().all()
    assert list(table["world_size"]) == [4, 8, 2]
    assert table.loc[2, "started"] == pd.Timestamp(T0 - 86400, unit="s", tz="UTC")
    assert at.main.caption[0].value == ("3 of 3 runs shown, newest first (a click on a header sorts) · select a "
                                        "row to open the run · times in UTC")
    config = json.loads(at.dataframe[0].proto.columns)
    assert config["heartbeat"]["type_config"]["format"] == "distance"  # "2 minutes ago"
    assert not at.warning and not at.info  # no replay caveat about the picker's run on the page of all runs


def test_one_run_or_a_run_link_lands_on_the_overview(r: redis.Redis, redis_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    r.zadd(RUNS, {"solo": T0})
    r.hset(run_keys("solo").meta, mapping={"name": "solo", "status": "running", "world_size": "1"})
    assert [h.value for h in app().subheader] == ["solo · overview"]
    r.zadd(RUNS, {"second": T0 + 1})
    st.cache_resource.clear()
    assert [h.value for h in app().subheader] == ["Runs"]
    assert [h.value for h in app(run="solo").subheader] == ["solo · overview"]  # the link names the run


def test_selecting_a_run_opens_its_overview(seeded: redis.Redis) -> None:
    # (AppTest gives a widget of the landing page another id on its second run: select on the page's own.)
    at = select_row(app("pages/runs.py"), 0, 2)
    assert at.session_state["th_run"] == "old-run" and at.query_params["run"] == "old-run"
    assert [h.value for h in at.subheader] == ["old-run · overview"]
    assert at.sidebar.selectbox[0].value == "old-run"


def test_runs_filters_are_kept_in_the_url(seeded: redis.Redis) -> None:
    at = app(run_status="finished")
    assert list(at.dataframe[0].value["run"]) == ["old-run"]
    assert at.multiselect(key="runs_status").value == ["finished"]
    at.multiselect(key="runs_status").unselect("finished").run()
    at.text_input(key="runs_find").input("LLAMA").run()
    assert list(at.dataframe[0].value["run"]) == [RUN]  # any case
    assert at.query_params["find"] == "LLAMA" and "run_status" not in at.query_params
    assert at.main.caption[0].value.startswith("1 of 3 runs shown")
    # A page switch clears the query string: the filter comes back with the page.
    at.switch_page("pages/anomalies.py").run()
    at.query_params.clear()
    at.switch_page("pages/runs.py").run()
    assert at.query_params["find"] == "LLAMA" and list(at.dataframe[0].value["run"]) == [RUN]


# --- deep links --------------------------------------------------------------------------------------

def test_parse_focus_accepts_what_alerts_link_and_says_what_it_ignores() -> None:
    assert parse_focus({"step": "40"}) == (Focus(40, 40), [])
    assert parse_focus({"step": "250-800", "rank": "5,6"}) == (Focus(250, 800, (5, 6)), [])
    assert parse_focus({"step": "250–"}) == (Focus(250, None), [])
    assert parse_focus({"step_from": "900", "step_to": "100"}) == (Focus(100, 900), [])  # turned round
    focus, problems = parse_focus({"step": "soon", "rank": "3,x"})
    assert focus == Focus(None, None, (3,))
    assert problems == ["The link's step 'soon' is not a step or a step range (e.g. 40 or 250-800); ignored.",
                        "The link's rank '3,x' is not a rank or a list of ranks (e.g. 3 or 5,6); x ignored."]
    assert Focus(250, 800, (5,)).params() == {"step_from": "250", "step_to": "800", "rank": "5"}
    assert Focus(40, 40, (3, 5)).describe() == "step 40 · ranks 3, 5"


def test_link_selects_rank_3_on_ranks_and_the_step_40_anomaly_on_anomalies(deep: redis.Redis) -> None:
    at = app("pages/ranks.py", run=DEEP, rank="3", step="40")
    ranks = at.dataframe[1].value
    # Flagged = the detector's verdict: the active straggler (rank 1) only. Rank 3 was slow at steps 40-45 and
    # its rank_outlier is resolved: slower than the median rank, not flagged.
    assert list(ranks["rank"]) == [1, 3, 2, 0]
    assert list(ranks["flagged"]) == [True, False, False, False]
    assert list(ranks["verdict"].fillna("")) == ["Straggler", "", "", ""]
    assert selected_rows(at, 1) == [1]  # rank 3, the link's (not the flagged rank 1, the default)
    assert "##### Rank 3 · n-b: section timeline" in [m.value for m in at.main.markdown]
    timeline = json.loads(at.get("plotly_chart")[1].proto.spec)
    bars = timeline["data"][0]
    assert bars["name"] == "rank 3"
    steps = _arr(bars["x"])
    assert steps == list(range(1, 61))  # steps 0-90 around step 40: all of this run's
    assert _arr(bars["y"])[39:45] == [0.25] * 6 and _arr(bars["y"])[38] == 0.13
    assert [(s["x0"], s["x1"]) for s in timeline["layout"]["shapes"]] == [(39.5, 40.5)]
    assert at.main.caption[-2].value.endswith("steps 1–60 around the link's step 40. Select another row above to "
                                              "see another rank.")
    assert at.main.caption[-1].value.startswith("No memory samples for this run yet")  # the Memory section's
    # Nodes: n-a holds the straggler; no slow-node anomaly, so neither node is called slow.
    nodes = at.dataframe[0].value
    assert list(nodes["host"]) == ["n-a", "n-b"] and list(nodes["flagged_ranks"]) == [1, 0]
    assert list(nodes["slow_node"]) == [False, False]

    at.switch_page("pages/anomalies.py").run()
    table = at.dataframe[0].value
    # Active first, then by severity, then newest; the kind in words.
    assert list(table["id"]) == [a["id"] for a in DEEP_ANOMALIES]
    assert list(table["kind"]) == ["NaN/Inf", "Throughput drop", "Straggler", "Loss spike", "Rank outlier",
                                   "Slow step"]
    assert selected_rows(at, 0) == [4]  # rank_outlier:3:40:0 — step 40 and rank 3 (the loss spike is rank-less)
    assert json.loads(at.json[0].value) == {"score": 0.71}
    assert [m.value for m in at.main.markdown][:4] == [
        STATE_LINE, "#### Rank outlier", ":orange[**warning**] · resolved · steps 40–45",
        "rank 3 was an outlier from step 40 to 45"]
    assert at.query_params["step"] == "40" and at.query_params["rank"] == "3"
    assert at.sidebar.caption[1].value == "Link: step 40 · rank 3"


def test_the_alerts_link_opens_its_anomaly(deep: redis.Redis) -> None:
    anomaly = next(a for a in DEEP_ANOMALIES if a["id"] == "rank_outlier:3:40:0")
    url = dashboard_link("http://dash:8501", DEEP, anomaly)
    assert url == "http://dash:8501/anomalies?run=deep&step=40-45&rank=3"
    at = app("pages/anomalies.py", **dict(parse_qsl(urlsplit(url).query)))
    assert selected_rows(at, 0) == [4]
    # In the canonical form the Overview's step range reads too.
    assert {k: at.query_params.get(k) for k in ("step", "step_from", "step_to", "rank")} == {
        "step": None, "step_from": "40", "step_to": "45", "rank": "3"}
    # An open anomaly's link names its onset only.
    assert dashboard_link("http://dash:8501", DEEP, DEEP_ANOMALIES[2]).endswith("/anomalies?run=deep&step=30&rank=1")
    at = app("pages/anomalies.py", run=DEEP, step="30", rank="1")
    assert selected_rows(at, 0) == [2]


def test_focus_survives_page_switches_and_follows_a_pick(deep: redis.Redis) -> None:
    at = app("pages/anomalies.py", run=DEEP, rank="3", step="40")
    at.query_params.clear()  # a sidebar page switch clears the URL's query string
    at.switch_page("pages/ranks.py").run()
    assert {k: at.query_params.get(k) for k in ("run", "step", "rank")} == {"run": DEEP, "step": "40", "rank": "3"}
    assert selected_rows(at, 1) == [1]
    # Another rank picked on Ranks: the link's rank follows, its step stays.
    select_row(at, 1, 0)
    assert (at.query_params["rank"], at.query_params["step"]) == ("1", "40")
    assert "##### Rank 1 · n-a: section timeline" in [m.value for m in at.main.markdown]
    # Another anomaly picked on Anomalies: its steps and ranks become the link's.
    at.switch_page("pages/anomalies.py").run()
    assert selected_rows(at, 0) == [2]  # the straggler: it names rank 1 and is open over step 40
    select_row(at, 0, 0)  # the NaN at step 50, job-wide
    assert at.query_params["step"] == "50" and "rank" not in at.query_params
    assert json.loads(at.json[0].value) == {"loss": "nan"}
    at.switch_page("pages/ranks.py").run()
    assert selected_rows(at, 1) == [0]  # no rank linked: the flagged rank 1
    # Clearing the link (sidebar) forgets it; picking another run does too.
    at.sidebar.button(key="th_focus_clear").click().run()
    assert "step" not in at.query_params and "rank" not in at.query_params
    at.sidebar.selectbox[0].select(RUN).run()
    assert "step" not in at.query_params


def test_link_of_another_run_or_with_garbage_points_nowhere(deep: redis.Redis) -> None:
    at = app("pages/anomalies.py", run="nope", step="40", rank="3")
    assert at.session_state["th_run"] == DEEP  # the newest run
    assert "step" not in at.query_params and "rank" not in at.query_params
    at = app(run=DEEP, step="forty")  # said on the first page the link opens
    assert "The link's step 'forty' is not a step or a step range (e.g. 40 or 250-800); ignored." in [
        w.value for w in at.warning]
    at.switch_page("pages/anomalies.py").run()
    assert selected_rows(at, 0) == [0] and "step" not in at.query_params


def test_step_times_and_busy_around_read_steps_by_number(deep: redis.Redis) -> None:
    # deep's entries have the service's ids, <gen + 1>-<step>: step 40 ran T0+39 to T0+39.5.
    assert data.step_times(deep, DEEP, 40, 45) == (T0 + 39, T0 + 44.5)
    assert data.step_times(deep, DEEP, 100, 200) is None
    around = data.busy_around(deep, DEEP, 44, 46)
    assert list(around.columns) == [44, 45, 46] and around[45].tolist() == [0.10, 0.30, 0.12, 0.25]
    # llama-7b's were written with automatic ids (not the service's): its newest entries are searched instead;
    # steps 9-12 ran twice (generations 0 and 1), the newest kept.
    assert data.step_times(deep, RUN, 8, 8) == (T0 + 44, T0 + 49)
    assert data.step_times(deep, RUN, 9, 9) == (T0 + 50, T0 + 67)  # the first run's start, the redo's end
    assert data.busy_around(deep, RUN, 8, 9)[9].tolist() == [0.2, 0.2, 0.2, 0.4]


def test_wall_clock_charts_open_around_the_linked_step(seeded: redis.Redis) -> None:
    # Step 8 ran 00:54:04-00:54:09 (T0+44 to T0+49): ± 5 min.
    window = ["2026-11-30T00:49:04", "2026-11-30T00:59:09"]
    at = app("pages/goodput.py", run=RUN, step="8")
    breakdown, tokens = (json.loads(c.proto.spec) for c in at.get("plotly_chart")[:2])
    assert breakdown["layout"]["xaxis"]["range"] == window and tokens["layout"]["xaxis"]["range"] == window
    at.switch_page("pages/overview.py").run()
    goodput = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                   if "throughput" in [t.get("name") for t in json.loads(c.proto.spec)["data"]])
    assert goodput["layout"]["xaxis"]["range"] == window
    at = app("pages/goodput.py", run=RUN)  # no link: the whole history
    assert "range" not in json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]["xaxis"]


# --- the Anomalies page -------------------------------------------------------------------------------

def test_anomaly_filters_are_kept_in_the_url(deep: redis.Redis) -> None:
    at = app("pages/anomalies.py", run=DEEP, kind="straggler,rank_outlier", rank_filter="3")
    assert list(at.dataframe[0].value["id"]) == ["rank_outlier:3:40:0"]
    assert at.multiselect(key="filter_kind").value == ["straggler", "rank_outlier"]
    assert at.multiselect(key="filter_rank").value == [3]
    at.multiselect(key="filter_rank").unselect(3).run()
    assert list(at.dataframe[0].value["id"]) == ["straggler:1:30:0", "rank_outlier:3:40:0"]
    assert "rank_filter" not in at.query_params and at.query_params["kind"] == "straggler,rank_outlier"
    at.multiselect(key="filter_status").select("active").run()
    assert at.query_params["status"] == "active"
    assert list(at.dataframe[0].value["id"]) == ["straggler:1:30:0"]


def test_match_anomaly_prefers_the_exact_span_then_a_named_rank() -> None:
    frame = pd.DataFrame(DEEP_ANOMALIES)[["id", "step", "end_step", "ranks"]]
    assert data.match_anomaly(frame, 40, 45, [3]) == "rank_outlier:3:40:0"
    assert data.match_anomaly(frame, 40, 41, []) == "loss_spike:*:40:0"
    assert data.match_anomaly(frame, 40, 40, [3]) == "rank_outlier:3:40:0"
    assert data.match_anomaly(frame, 40, 40, []) == "loss_spike:*:40:0"  # first in the table's order
    assert data.match_anomaly(frame, 40, 40, [1]) == "straggler:1:30:0"  # the rank first: open over step 40
    assert data.match_anomaly(frame, 55, 55, [1]) == "straggler:1:30:0"  # open since 30, names rank 1
    assert data.match_anomaly(frame, 10, 10, []) is None
    assert data.match_anomaly(frame, None, None, [3]) == "rank_outlier:3:40:0"


def test_every_kind_has_words_on_one_line() -> None:
    from trainhealth.anomaly import KINDS

    assert all(kind_words(k) != k for k in KINDS)
    assert kind_words("throughput_drop") == "Throughput drop" and kind_words("new_kind") == "New kind"
    assert max(len(kind_words(k)) for k in KINDS) == len("Grad-norm explosion")


# --- the Ranks page: one meaning of flagged, nodes, hosts without every event ----------------------------

def test_flagged_ranks_are_the_detectors_verdict(deep: redis.Redis) -> None:
    anomalies = data.anomalies(deep, DEEP)
    assert data.rank_verdicts(anomalies).to_dict("records") == [{"rank": 1, "kinds": ("straggler",)}]
    # A slow node names every rank of the host: all of them flagged, the node called slow.
    slow = {"id": "slow_node:n-b:50:0", "run": DEEP, "kind": "slow_node", "severity": "warning", "status": "active",
            "step": 50, "end_step": None, "ranks": [2, 3], "hosts": ["n-b"], "evidence": {}, "message": "n-b slow",
            "first_seen": T0 + 55, "last_seen": T0 + 60}
    deep.hset(run_keys(DEEP).anomalies, slow["id"], json.dumps(slow))
    at = app("pages/ranks.py", run=DEEP)
    ranks = at.dataframe[1].value
    assert dict(zip(ranks["rank"], ranks["flagged"], strict=True)) == {1: True, 3: True, 2: True, 0: False}
    assert dict(zip(ranks["rank"], ranks["verdict"].fillna(""), strict=True)) == {
        1: "Straggler", 3: "Slow node", 2: "Slow node", 0: ""}
    heatmap = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert sorted(s["y0"] + 0.5 for s in heatmap["layout"]["shapes"]) == [1, 2, 3]  # the flagged ranks outlined
    nodes = at.dataframe[0].value
    assert list(nodes["slow_node"]) == [False, True] and list(nodes["flagged_ranks"]) == [1, 2]
    assert "**Slow node**: n-b (ranks 2–3) since step 50 — n-b slow" in [w.value for w in at.warning]
    assert selected_rows(at, 1) == [0]  # no link: the first flagged rank


def test_rank_hosts_decodes_only_run_starts_and_stops_when_every_rank_has_one(deep: redis.Redis) -> None:
    k = run_keys(DEEP)
    pipe = deep.pipeline()
    for i in range(5000):  # later events of every rank, newer than the run_starts
        pipe.xadd(k.events, {"kind": "checkpoint_save", "rank": i % 4, "t": repr(T0 + i), "step": i, "seconds": "1"})
    pipe.xadd(k.events, {"kind": "run_start", "rank": 2, "t": repr(T0 + 9000), "host": "n-c"})  # rank 2 moved
    pipe.execute()
    assert data.rank_hosts(deep, DEEP).to_dict("records") == [
        {"rank": 0, "host": "n-a"}, {"rank": 1, "host": "n-a"}, {"rank": 2, "host": "n-c"}, {"rank": 3, "host": "n-b"}]
    # A page of 1,000 events reaches the oldest starts in 6 pages; with one page only they are beyond the scan.
    assert data.rank_hosts(deep, DEEP, count=1000, head=0, page=1000).to_dict("records") == [
        {"rank": 2, "host": "n-c"}]


def _arr(v: Any) -> list:
    return _BASE["arr"](v)


# --- in a real browser -------------------------------------------------------------------------------

_BROWSER = runpy.run_path(str(Path(__file__).with_name("test_dashboard_browser.py")))


@pytest.fixture
def served(r: redis.Redis, redis_url: str, tmp_path: Path) -> Iterator[str]:
    """The dashboard (``streamlit run``) on the three runs of test_dashboard.py, the replay and ``deep``, with a
    live service heartbeat."""
    _BROWSER["_require_chromium"]()
    seed_run(r)
    _BASE["seed_replay"](r)
    seed_deep(r)
    with _BROWSER["_service_alive"](r), _BROWSER["_streamlit"](redis_url, tmp_path) as base:
        yield base


def test_runs_landing_and_deep_links_in_chromium(served: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    artifacts: Path = _BROWSER["ARTIFACTS"]
    artifacts.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = _BROWSER["_launch"](pw)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 1000}, timezone_id="UTC")
            page.set_default_timeout(_BROWSER["UI_TIMEOUT_MS"])
            page.goto(served)  # no run named, five runs: the Runs page
            expect(page.get_by_text(re.compile(r"^5 of 5 runs shown"))).to_be_visible()
            picker = page.locator('[data-testid="stSidebar"] input[aria-label="Run"]')
            expect(picker).to_have_value(f"running · {DEEP}")
            # The picker's text is not cut by the sidebar ("…· runninç").
            assert picker.evaluate("e => e.scrollWidth <= e.clientWidth"), picker.input_value()
            page.wait_for_timeout(1000)
            page.screenshot(path=str(artifacts / "dashboard_runs.png"), full_page=True)
            # A click on the third row (llama-7b; rows of 35 px under a 35 px header) opens its Overview.
            grid = page.locator('[data-testid="stDataFrame"]').first
            expect(grid.locator("canvas").first).to_be_visible()
            box = grid.bounding_box()
            assert box is not None
            page.mouse.click(box["x"] + 16, box["y"] + 35 + 2 * 35 + 17)
            expect(page.get_by_text(f"{RUN} · overview")).to_be_visible()
            expect(picker).to_have_value(f"running · {RUN}")

            # An alert's link: the anomaly of step 40-45 on rank 3 is selected, its evidence beside the table.
            page.goto(f"{served}/anomalies?run={DEEP}&step=40-45&rank=3")
            expect(page.get_by_role("heading", name="Rank outlier")).to_be_visible()
            expect(page.get_by_text("rank 3 was an outlier from step 40 to 45")).to_be_visible()
            scroller = page.locator('[data-testid="stDataFrame"] .dvn-scroller').first
            widths = scroller.evaluate("e => [e.scrollWidth, e.clientWidth, e.scrollHeight, e.clientHeight]")
            assert widths[0] <= widths[1] and widths[2] <= widths[3], widths  # no scrolling box: every row shown
            page.wait_for_timeout(1000)
            page.screenshot(path=str(artifacts / "dashboard_anomalies_link.png"), full_page=True)
            # The link survives a page switch: Ranks drills down to rank 3 around step 40.
            page.locator('[data-testid="stSidebarNav"]').get_by_text("Ranks", exact=True).click()
            expect(page.get_by_text("Rank 3 · n-b: section timeline")).to_be_visible()
            linked = {"run": DEEP, "step_from": "40", "step_to": "45", "rank": "3"}
            page.wait_for_url(lambda url: urlsplit(url).path == "/ranks" and dict(parse_qsl(urlsplit(url).query))
                              == linked)
            page.wait_for_timeout(1000)
            page.screenshot(path=str(artifacts / "dashboard_ranks_link.png"), full_page=True)
        finally:
            browser.close()
