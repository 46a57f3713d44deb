"""Dashboard tests against a real Redis: data.py reads with exact values, charts, and each page
rendered with Streamlit's AppTest (no browser; see test_dashboard_browser.py for that).

The seeded run is written with raw redis-py commands following docs/architecture.md, so the
test checks the dashboard against the documented schema, not against another module's writer.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import redis
import streamlit as st
from streamlit.testing.v1 import AppTest

from dashboard import charts, data
from dashboard.common import fmt_age, fmt_pct, fmt_rate, fmt_usd, redact_url
from trainhealth.keys import RUNS, run_keys
from trainhealth.server import free_port

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
T0 = 1796000000.0  # 2026-11-30 00:53:20 UTC
RUN = "llama-7b"
HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
#: Per-rank busy seconds: rank 3 is the straggler; gen 1 (after the restart) is slower overall.
BUSY_GEN0 = [0.10, 0.11, 0.12, 0.30]
BUSY_GEN1 = [0.2, 0.2, 0.2, 0.4]
SECONDS = {"productive": 71.5, "program_startup": 2.0, "data_loading": 5.0, "checkpoint_save": 6.0,
           "checkpoint_restore": 1.0, "wasted_progress_from_disruption": 8.0,
           "infrastructure_recovery_from_disruption": 4.5, "idle": 2.0, "custom": 0.0}


def _snapshot(t: float, wall: float, thr: float, good: float, pct: float, last_step: int, done: int,
              good_steps: int, restarts: int, seconds: dict[str, float]) -> dict:
    price, world = 2.5, 4
    cost = {k: v * world * price / 3600 for k, v in seconds.items()}
    return {"t": t, "started_at": T0, "wall_s": wall, "world_size": world, "gpu_hour_usd": price,
            "last_step": last_step, "steps_done": done, "steps_good": good_steps, "restarts": restarts,
            "tokens_total": done * 4096, "tokens_good": good_steps * 4096, "throughput_tok_s": thr,
            "goodput_tok_s": good, "goodput_pct": pct, "seconds": seconds,
            "gpu_hours": {k: v * world / 3600 for k, v in seconds.items()}, "cost_usd": cost,
            "badput_cost_usd": sum(v for k, v in cost.items() if k != "productive")}


def seed_run(r: redis.Redis) -> None:
    """A 4-rank run: steps 1-10 (gen 0), a restart from the step-8 checkpoint, steps 9-12 (gen 1).

    Plus an empty run and an older finished run in the registry.
    """
    k = run_keys(RUN)
    r.zadd(RUNS, {RUN: T0, "empty-run": T0 - 3600, "old-run": T0 - 86400})
    r.hset(k.meta, mapping={"name": RUN, "world_size": "4", "started_at": repr(T0), "gpu_hour_usd": "2.5",
                            "status": "running", "updated_at": repr(T0 + 100), "source": "demo"})
    r.hset(run_keys("empty-run").meta, mapping={"name": "empty-run", "world_size": "8", "status": "running",
                                                "started_at": repr(T0 - 3600)})
    r.hset(run_keys("old-run").meta, mapping={"name": "old-run", "world_size": "2", "status": "finished",
                                              "started_at": repr(T0 - 86400), "ended_at": repr(T0 - 80000)})

    i = 0
    for gen, steps in ((0, range(1, 11)), (1, range(9, 13))):
        for s in steps:
            busy: list[float | None] = list(BUSY_GEN0 if gen == 0 else BUSY_GEN1)
            n_ranks = 4
            if gen == 0 and s == 7:
                busy[2], n_ranks = None, 3
            t_start = T0 + 2 + 6 * i
            r.xadd(k.agg, {
                "step": s, "gen": gen, "t_start": repr(t_start), "t_end": repr(t_start + 5.0), "dur": "5.0",
                "loss": "nan" if (gen, s) == (0, 5) else repr(round(3.0 - 0.1 * s + 0.01 * gen, 4)),
                "grad_norm": "inf" if (gen, s) == (0, 6) else repr(1.0 + s / 10),
                "lr": "0.0003", "tokens": 4096, "samples": 8, "n_ranks": n_ranks, "busy": json.dumps(busy),
                "data_s": "0.05",
            })
            i += 1

    def ev(kind: str, rank: int, t: float, inc: float, **extra: object) -> None:
        r.xadd(k.events, {"kind": kind, "rank": rank, "t": repr(t), "inc": repr(inc),
                          **{name: str(v) for name, v in extra.items()}})

    for rank in range(4):
        ev("run_start", rank, T0, T0, host=HOSTS[rank], pid=100 + rank, world_size=4, local_rank=rank % 2,
           config="{}")
    for rank, sec in enumerate((1.5, 1.6, 1.5, 1.7)):
        ev("checkpoint_save", rank, T0 + 50 + rank * 0.01, T0, step=8, seconds=sec)
    ev("badput", 0, T0 + 55, T0, name="eval", seconds=3.0)
    ev("collector_drops", 1, T0 + 56, T0, count=12)
    for rank in range(4):  # the restart: rank 3 came back on another node
        ev("run_start", rank, T0 + 70, T0 + 70, host="node-c" if rank == 3 else HOSTS[rank], pid=200 + rank,
           world_size=4, local_rank=rank % 2, config="{}")
    for rank in range(4):
        extra = {} if rank == 0 else {"seconds": 2.0}
        ev("checkpoint_load", rank, T0 + 75 + rank * 0.01, T0 + 70, step=8, **extra)
    for rank in range(4):
        ev("checkpoint_save", rank, T0 + 98, T0 + 70, step=12, seconds=1.0)
    r.hset(k.heartbeats, "0", json.dumps({"t": T0 + 100, "step": 12, "step_t": T0 + 98, "phase": "train",
                                          "host": "hb-host", "pid": 200, "inc": T0 + 70}))

    anomalies = [
        {"id": "hang:2:12:1", "kind": "hang", "severity": "critical", "status": "active", "step": 12,
         "end_step": None, "ranks": [2], "hosts": ["node-b"], "evidence": {"stalled_s": 300.0, "threshold_s": 120.0},
         "message": "rank 2 has not completed a step for 300 s", "first_seen": T0 + 99, "last_seen": T0 + 100},
        {"id": "straggler:3:4:0", "kind": "straggler", "severity": "warning", "status": "active", "step": 4,
         "end_step": None, "ranks": [3], "hosts": ["node-b"], "evidence": {"score": 0.38, "threshold": 0.7},
         "message": "rank 3 is 2.6x slower than the median rank", "first_seen": T0 + 30, "last_seen": T0 + 100},
        {"id": "restart:*:10:1", "kind": "restart", "severity": "warning", "status": "resolved", "step": 10,
         "end_step": 10, "ranks": [0, 1, 2, 3], "hosts": ["node-a", "node-b", "node-c"],
         "evidence": {"resumed_from": 8}, "message": "all ranks restarted; resumed from the checkpoint of step 8",
         "first_seen": T0 + 70, "last_seen": T0 + 70},
        {"id": "nan_inf:*:5:0", "kind": "nan_inf", "severity": "critical", "status": "resolved", "step": 5,
         "end_step": 6, "ranks": [], "hosts": [], "evidence": {"loss": float("nan")},
         "message": "loss is NaN at step 5", "first_seen": T0 + 27, "last_seen": T0 + 33},
    ]
    for a in anomalies:
        r.hset(k.anomalies, a["id"], json.dumps({"run": RUN, **a}))

    snaps = [
        _snapshot(T0 + 60, 60.0, 546.13, 546.13, 80.0, 8, 8, 8, 0,
                  {**SECONDS, "productive": 48.0, "wasted_progress_from_disruption": 0.0}),
        _snapshot(T0 + 80, 80.0, 563.2, 460.8, 70.0, 10, 11, 9, 1, {**SECONDS, "productive": 56.0}),
        _snapshot(T0 + 100, 100.0, 573.44, 491.52, 71.5, 12, 14, 12, 1, SECONDS),
    ]
    for snap in snaps:
        r.xadd(k.ledger, {"json": json.dumps(snap)})
    r.set(k.ledger_latest, json.dumps(snaps[-1]))


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    # cache_resource/cache_data are process-global: a client or frame cached for one test's
    # Redis URL must not answer the next test.
    st.cache_resource.clear()
    st.cache_data.clear()
    yield
    st.cache_resource.clear()
    st.cache_data.clear()


@pytest.fixture
def seeded(r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> redis.Redis:
    seed_run(r)
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    return r


@pytest.fixture
def dr(redis_url: str) -> Iterator[redis.Redis]:
    """A client with ``decode_responses=True``: data.py must read str and bytes alike."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def app(**query: str) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update(query)
    return at.run()


def metrics(at: AppTest) -> dict[str, tuple[str, str | None]]:
    return {m.label: (m.value, m.proto.delta or None) for m in at.metric}


def figures(at: AppTest) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def arr(v: list | dict) -> list:
    """A Plotly JSON array: a list, or a base64 typed array ``{"dtype", "bdata"}``."""
    if isinstance(v, dict):
        flat = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        shape = [int(n) for n in str(v.get("shape", len(flat))).split(",")]
        return flat.reshape(shape).tolist()
    return list(v)


# --- data.py -------------------------------------------------------------------------------

@pytest.mark.parametrize("decoded", [False, True])
def test_list_runs_newest_first_with_meta(seeded: redis.Redis, dr: redis.Redis, decoded: bool) -> None:
    runs = data.list_runs(dr if decoded else seeded)
    assert list(runs["run"]) == [RUN, "empty-run", "old-run"]
    assert list(runs["status"]) == ["running", "running", "finished"]
    assert list(runs["world_size"]) == [4, 8, 2]
    assert runs.loc[0, "started_at"] == T0
    assert runs.loc[0, "gpu_hour_usd"] == 2.5
    assert runs.loc[0, "source"] == "demo"
    assert runs.loc[2, "ended_at"] == T0 - 80000
    assert data.run_exists(seeded, "old-run") and not data.run_exists(seeded, "nope")


def test_missing_keys_give_empty_frames_with_columns(r: redis.Redis) -> None:
    assert data.list_runs(r).empty and list(data.list_runs(r).columns) == data.RUN_COLUMNS
    assert data.run_meta(r, "ghost") == {}
    steps = data.recent_steps(r, "ghost")
    assert steps.empty and list(steps.columns) == [*data.STEP_COLUMNS, "busy"]
    assert str(steps["step"].dtype) == "Int64"
    assert data.rank_matrix(r, "ghost").shape == (0, 0)
    assert list(data.events(r, "ghost").columns) == data.EVENT_COLUMNS
    assert list(data.anomalies(r, "ghost").columns) == data.ANOMALY_COLUMNS
    assert data.ledger_latest(r, "ghost") is None
    history = data.ledger_history(r, "ghost")
    assert history.empty and "throughput_tok_s" in history.columns and "seconds.idle" in history.columns
    assert list(data.rank_hosts(r, "ghost").columns) == data.HOST_COLUMNS
    assert data.rank_summary(data.rank_matrix(r, "ghost")).empty
    assert data.badput_seconds(None).empty


def test_run_meta_typed(seeded: redis.Redis) -> None:
    meta = data.run_meta(seeded, RUN)
    assert meta == {"name": RUN, "world_size": 4, "started_at": T0, "gpu_hour_usd": 2.5, "status": "running",
                    "updated_at": T0 + 100, "source": "demo"}


@pytest.mark.parametrize("decoded", [False, True])
def test_recent_steps_ascending_with_nan_inf_and_busy(seeded: redis.Redis, dr: redis.Redis, decoded: bool) -> None:
    steps = data.recent_steps(dr if decoded else seeded, RUN)
    assert list(steps["step"]) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 9, 10, 11, 12]
    assert list(steps["gen"]) == [0] * 10 + [1] * 4
    assert math.isnan(steps.loc[4, "loss"])  # step 5: "nan"
    assert steps.loc[5, "grad_norm"] == math.inf  # step 6: "inf"
    assert steps.loc[0, "loss"] == 2.9
    assert steps.loc[13, "loss"] == pytest.approx(1.81)
    assert steps.loc[0, "t_start"] == T0 + 2 and steps.loc[0, "t_end"] == T0 + 7 and steps.loc[0, "dur"] == 5.0
    assert steps.loc[0, "lr"] == 0.0003 and steps.loc[0, "data_s"] == 0.05
    assert int(steps["tokens"].sum()) == 14 * 4096
    assert steps.loc[6, "n_ranks"] == 3
    assert steps.loc[6, "busy"][:2] == [0.10, 0.11] and math.isnan(steps.loc[6, "busy"][2])
    # COUNT keeps the newest entries, still returned oldest first.
    tail = data.recent_steps(seeded, RUN, count=3)
    assert list(tail["step"]) == [10, 11, 12] and list(tail["gen"]) == [1, 1, 1]
    lean = data.recent_steps(seeded, RUN, with_busy=False)  # the overview skips the per-rank lists
    assert list(lean["busy"]) == [[]] * 14 and lean["loss"].equals(steps["loss"])


def test_rank_matrix_shape_cells_and_restart_replay(seeded: redis.Redis) -> None:
    m = data.rank_matrix(seeded, RUN)
    assert m.shape == (4, 12)  # 4 ranks × steps 1..12 (9 and 10 appear twice, newest kept)
    assert list(m.columns) == list(range(1, 13))
    assert m.loc[3, 4] == 0.30
    assert m.loc[0, 9] == 0.2  # gen 1's replay of step 9, not gen 0's 0.10
    assert math.isnan(m.loc[2, 7])  # rank 2 did not report step 7
    assert int(m.notna().sum().sum()) == 47


def test_rank_summary_ratio_and_hosts(seeded: redis.Redis) -> None:
    hosts = data.rank_hosts(seeded, RUN)
    # Newest run_start wins (rank 3 moved to node-c); the heartbeat's host does not override it.
    assert hosts.to_dict("records") == [{"rank": 0, "host": "node-a"}, {"rank": 1, "host": "node-a"},
                                        {"rank": 2, "host": "node-b"}, {"rank": 3, "host": "node-c"}]
    summary = data.rank_summary(data.rank_matrix(seeded, RUN), hosts)
    assert list(summary["rank"]) == [3, 2, 1, 0]
    assert list(summary["host"]) == ["node-c", "node-b", "node-a", "node-a"]
    assert list(summary["median_busy_s"]) == pytest.approx([0.30, 0.12, 0.11, 0.10])
    assert summary.loc[0, "ratio"] == pytest.approx(0.30 / 0.115)
    assert list(summary["steps"]) == [12, 11, 12, 12]


def test_rank_hosts_falls_back_to_heartbeat(r: redis.Redis) -> None:
    k = run_keys("hb-only")
    r.hset(k.heartbeats, mapping={"1": json.dumps({"t": T0, "step": 3, "host": "gpu-17"}), "0": "not json"})
    assert data.rank_hosts(r, "hb-only").to_dict("records") == [{"rank": 1, "host": "gpu-17"}]


@pytest.mark.parametrize("decoded", [False, True])
def test_events_deduped_per_checkpoint(seeded: redis.Redis, dr: redis.Redis, decoded: bool) -> None:
    ev = data.events(dr if decoded else seeded, RUN)
    assert ev.to_dict("records") == [
        {"kind": "checkpoint_save", "step": 8, "t": T0 + 50, "seconds": 1.7, "n_ranks": 4},
        {"kind": "checkpoint_load", "step": 8, "t": T0 + 75, "seconds": 2.0, "n_ranks": 4},
        {"kind": "checkpoint_save", "step": 12, "t": T0 + 98, "seconds": 1.0, "n_ranks": 4},
    ]


def test_anomalies_active_first_then_newest(seeded: redis.Redis) -> None:
    an = data.anomalies(seeded, RUN)
    assert list(an["id"]) == ["hang:2:12:1", "straggler:3:4:0", "restart:*:10:1", "nan_inf:*:5:0"]
    assert list(an["status"]) == ["active", "active", "resolved", "resolved"]
    assert list(an["step"]) == [12, 4, 10, 5]
    assert an.loc[0, "end_step"] is pd.NA and an.loc[3, "end_step"] == 6
    assert an.loc[2, "ranks"] == [0, 1, 2, 3] and an.loc[1, "hosts"] == ["node-b"]
    assert an.loc[0, "evidence"] == {"stalled_s": 300.0, "threshold_s": 120.0}
    assert math.isnan(an.loc[3, "evidence"]["loss"])
    assert an.loc[0, "first_seen"] == T0 + 99


def test_ledger_latest_and_history(seeded: redis.Redis) -> None:
    snap = data.ledger_latest(seeded, RUN)
    assert snap is not None
    assert snap["goodput_pct"] == 71.5 and snap["last_step"] == 12 and snap["seconds"] == SECONDS
    assert snap["badput_cost_usd"] == pytest.approx(28.5 * 4 * 2.5 / 3600)
    hist = data.ledger_history(seeded, RUN)
    assert list(hist["t"]) == [T0 + 60, T0 + 80, T0 + 100]
    assert list(hist["throughput_tok_s"]) == [546.13, 563.2, 573.44]
    assert list(hist["goodput_tok_s"]) == [546.13, 460.8, 491.52]
    assert list(hist["seconds.productive"]) == [48.0, 56.0, 71.5]
    assert list(data.ledger_history(seeded, RUN, count=1)["t"]) == [T0 + 100]


def test_badput_breakdown_sorted_without_productive(seeded: redis.Redis) -> None:
    bd = data.badput_seconds(data.ledger_latest(seeded, RUN))
    assert list(bd["category"][:3]) == ["wasted_progress_from_disruption", "checkpoint_save", "data_loading"]
    assert list(bd["seconds"][:3]) == [8.0, 6.0, 5.0]
    assert "productive" not in set(bd["category"]) and len(bd) == 8
    assert bd.loc[0, "cost_usd"] == pytest.approx(8.0 * 4 * 2.5 / 3600)
    assert bd["seconds"].sum() == 28.5


# --- charts / helpers ----------------------------------------------------------------------

def test_training_curves_markers(seeded: redis.Redis) -> None:
    fig = charts.training_curves(data.recent_steps(seeded, RUN), data.anomalies(seeded, RUN),
                                 data.events(seeded, RUN))
    names = [t.name for t in fig.data]
    assert names == ["gen 0", "grad norm · gen 0", "gen 1", "grad norm · gen 1", "critical span", "warning span",
                     "events"]
    lane = fig.data[-1]
    assert list(lane.y) == ["anomaly", "anomaly", "restart", "anomaly", "checkpoint", "checkpoint", "checkpoint"]
    assert list(lane.x) == [12, 4, 10, 5, 8, 8, 12]
    assert "rank 2 has not completed a step for 300 s" in lane.hovertext[0]
    # Lane bars: hang 12 (active) and NaN 5-6 in red; the straggler from step 4 to the newest step.
    assert list(fig.data[4].x) == [11.5, 12.5, None, 4.5, 6.5, None]
    assert list(fig.data[5].x) == [3.5, 12.5, None]
    shapes = fig.layout.shapes
    # Only the loss-related NaN anomaly is shaded on the panels (×3), plus the restart line (×3).
    assert len(shapes) == 6
    assert [(s.type, s.x0, s.line.dash) for s in shapes[:3]] == [("line", 10.0, "dash")] * 3
    assert [(s.type, s.x0, s.x1, s.fillcolor) for s in shapes[3:]] == [("rect", 4.5, 6.5, "#d62728")] * 3
    assert fig.layout.yaxis2.type == "log"
    # inf grad norm and NaN loss become gaps, not points.
    assert math.isnan(fig.data[1].y[5]) and math.isnan(fig.data[0].y[4])


def test_heatmap_single_trace_for_1024_ranks() -> None:
    matrix = pd.DataFrame(np.random.default_rng(0).random((1024, 2000)), index=pd.Index(range(1024), name="rank"),
                          columns=pd.Index(range(1, 2001), name="step"))
    fig = charts.rank_heatmap(matrix, highlight=[7])
    assert len(fig.data) == 1 and fig.data[0].type == "heatmap"
    z = np.asarray(fig.data[0].z)
    assert z.shape == (1024, 223)  # 2000 steps in bins of 9 ≤ 250,000 cells
    assert z.shape[0] * z.shape[1] <= charts.HEATMAP_MAX_CELLS
    assert z[0, 0] == pytest.approx(matrix.iloc[0, :9].mean())
    assert fig.data[0].x[0] == 9 and fig.data[0].x[-1] == 2000
    assert len(fig.layout.shapes) == 1 and fig.layout.shapes[0].y0 == 6.5


def test_downsample_keeps_small_matrix_and_ignores_nan() -> None:
    m = pd.DataFrame([[1.0, np.nan, 3.0, 5.0]], index=pd.Index([0], name="rank"),
                     columns=pd.Index([1, 2, 3, 4], name="step"))
    assert charts.downsample_steps(m) is m
    out = charts.downsample_steps(m, max_cells=2)
    assert list(out.columns) == [2, 4] and list(out.iloc[0]) == [1.0, 4.0]


def test_compact_formats() -> None:
    assert [fmt_rate(x) for x in (573.44, 41_600.0, 804_817.0, 2_500_000.0, None, math.nan)] == [
        "573", "41,600", "804.8k", "2.50M", "—", "—"]
    assert [fmt_usd(x) for x in (0.0791, 12.3, 1234.5, 123_456.0, None)] == ["$0.08", "$12.30", "$1,234", "$123k", "—"]
    assert [fmt_pct(x) for x in (71.5, 100.0, None)] == ["71.5%", "100.0%", "—"]
    assert [fmt_age(x) for x in (42.0, 210.0, 7300.0, 200_000.0)] == ["42 s", "3.5 min", "2.0 h", "2.3 d"]


def test_redact_url() -> None:
    assert redact_url("redis://:s3cret@db.example:6380/2") == "redis://:***@db.example:6380/2"
    assert redact_url("rediss://ops:pw@h/0") == "rediss://ops:***@h/0"
    assert redact_url("redis://127.0.0.1:6390/0") == "redis://127.0.0.1:6390/0"


# --- pages, rendered with AppTest ------------------------------------------------------------

def test_overview_kpis_and_charts(seeded: redis.Redis, redis_url: str) -> None:
    at = app()
    assert not at.exception
    assert at.session_state["th_run"] == RUN
    assert at.query_params["run"] == RUN
    assert metrics(at) == {
        "Step": ("12", "restart gen 1"),
        "Throughput": ("573", "tokens/s"),
        "Goodput": ("492", "tokens/s"),
        "Goodput %": ("71.5%", "of wall time"),
        "Anomalies": ("2", "active, 1 critical"),
        "Badput cost": ("$0.08", "at $2.5/GPU-h"),
    }
    figs = figures(at)
    assert len(figs) == 3
    curves, goodput, badput = figs
    assert [t["name"] for t in curves["data"]][-1] == "events"
    assert [t["name"] for t in goodput["data"]] == ["goodput", "throughput (gap = badput)"]
    assert arr(goodput["data"][0]["y"]) == [546.13, 460.8, 491.52]
    assert arr(goodput["data"][1]["y"]) == [546.13, 563.2, 573.44]
    assert goodput["data"][0]["x"][-1] == "2026-11-30T00:55:00.000000"  # T0 + 100 s, UTC in AppTest
    assert arr(curves["data"][2]["x"]) == [9, 10, 11, 12]  # gen 1 replays from the step-8 checkpoint
    assert badput["data"][0]["y"][-1] == "wasted progress from disruption"  # largest on top
    sidebar = [c.value for c in at.sidebar.caption]
    assert sidebar[-1] == f"Redis: `{redis_url}`"
    assert sidebar[0].startswith("**running** · 4 ranks · started ") and sidebar[0].endswith(" · source `demo`")
    assert at.sidebar.selectbox[0].options == ["llama-7b · running · 4 ranks", "empty-run · running · 8 ranks",
                                               "old-run · finished · 2 ranks"]


def test_ranks_page_heatmap_table_and_straggler(seeded: redis.Redis) -> None:
    at = app()
    at.switch_page("pages/ranks.py").run()
    assert not at.exception
    assert at.session_state["th_run"] == RUN and at.query_params["run"] == RUN
    assert at.sidebar.selectbox[0].value == RUN  # the frame is drawn on every page
    figs = figures(at)
    assert len(figs) == 1 and figs[0]["data"][0]["type"] == "heatmap"
    assert len(figs[0]["layout"]["shapes"]) == 1  # the active straggler's outline (rank 3)
    table = at.dataframe[0].value
    assert list(table["rank"]) == [3, 2, 1, 0]
    assert list(table["host"]) == ["node-c", "node-b", "node-a", "node-a"]
    assert list(table["straggler"]) == [True, False, False, False]
    assert table.loc[0, "ratio"] == pytest.approx(2.6087, abs=1e-4)
    assert [w.value for w in at.warning] == [
        "**Straggler**: rank 3 on node-b since step 4 — rank 3 is 2.6x slower than the median rank"]
    heat = figs[0]["data"][0]
    assert "zmid" not in heat and heat["colorbar"]["title"]["text"] == "s"  # seconds, Viridis
    assert arr(heat["x"]) == list(range(1, 13)) and arr(heat["y"]) == [0, 1, 2, 3]

    at.segmented_control(key="ranks_mode").select("ratio to step median").run()
    at.segmented_control(key="ranks_window").select(100).run()
    assert not at.exception
    heat = figures(at)[0]["data"][0]
    assert heat["zmid"] == 1.0 and heat["colorbar"]["title"]["text"] == "× step median"
    # Step 4: busy [0.10, 0.11, 0.12, 0.30], median 0.115 → rank 3 at 0.30 / 0.115.
    z = np.array(arr(heat["z"]))
    assert z.shape == (4, 12) and z[3, 3] == pytest.approx(0.30 / 0.115) and z[0, 3] == pytest.approx(0.10 / 0.115)


def test_anomalies_page_table_filters_and_evidence(seeded: redis.Redis) -> None:
    at = app()
    at.switch_page("pages/anomalies.py").run()
    assert not at.exception
    table = at.dataframe[0].value
    assert list(table["id"]) == ["hang:2:12:1", "straggler:3:4:0", "restart:*:10:1", "nan_inf:*:5:0"]
    assert list(table["severity"]) == ["critical", "warning", "warning", "critical"]
    assert list(table["kind"]) == ["hang", "straggler", "restart", "nan_inf"]
    assert list(table["status"]) == ["active", "active", "resolved", "resolved"]
    assert list(table["step"]) == [12, 4, 10, 5]
    assert list(table["ranks"]) == ["2", "3", "0, 1, 2, 3", ""]
    assert table.loc[2, "hosts"] == "node-a, node-b, node-c"
    assert table.loc[0, "message"] == "rank 2 has not completed a step for 300 s"
    assert table.loc[0, "first_seen"] == pd.Timestamp("2026-11-30 00:54:59", tz="UTC")
    assert table.loc[3, "last_seen"] == pd.Timestamp("2026-11-30 00:53:53", tz="UTC")
    assert pd.isna(table.loc[0, "end_step"]) and table.loc[3, "end_step"] == 6
    assert at.json[0].value == json.dumps({"stalled_s": 300.0, "threshold_s": 120.0})

    at.multiselect(key="filter_severity").select("critical").run()
    at.multiselect(key="filter_status").select("resolved").run()
    assert list(at.dataframe[0].value["id"]) == ["nan_inf:*:5:0"]
    assert "1 of 4 anomalies shown · 2 active · times in UTC" in [c.value for c in at.main.caption]

    at.selectbox(key="anomaly_detail").select("straggler:3:4:0").run()
    assert json.loads(at.json[0].value) == {"score": 0.38, "threshold": 0.7}
    at.selectbox(key="anomaly_detail").select("nan_inf:*:5:0").run()
    assert json.loads(at.json[0].value) == {"loss": "nan"}  # NaN evidence shown as text, valid JSON
    assert "loss is NaN at step 5" in [m.value for m in at.main.markdown]


def test_run_link_picker_and_page_switch_keep_the_run(seeded: redis.Redis) -> None:
    at = app(run="old-run")
    assert not at.exception
    assert at.session_state["th_run"] == "old-run"
    assert at.sidebar.selectbox[0].value == "old-run"
    assert any("No aggregated steps yet" in i.value for i in at.info)
    at.sidebar.selectbox[0].select("empty-run").run()
    assert at.session_state["th_run"] == "empty-run" and at.query_params["run"] == "empty-run"
    assert metrics(at)["Step"] == ("—", None)
    assert metrics(at)["Badput time"] == ("—", "no GPU price set")
    at.query_params.clear()  # a sidebar page switch clears the URL's query string
    at.switch_page("pages/anomalies.py").run()
    assert not at.exception
    assert at.session_state["th_run"] == "empty-run" and at.query_params["run"] == "empty-run"
    assert at.success[0].value == "No anomalies detected for this run."


def test_unknown_run_link_falls_back_to_newest(seeded: redis.Redis) -> None:
    at = app(run="nope")
    assert not at.exception
    assert at.warning[0].value == "Run `nope` from the link is not in Redis; showing the newest run."
    assert at.session_state["th_run"] == RUN and at.query_params["run"] == RUN


def test_no_runs_message(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    at = app()
    assert not at.exception
    assert [i.value for i in at.info] == [
        "No runs yet — start `trainhealth demo` or instrument a job with `collectors.Monitor` "
        "(and run `trainhealth serve` to aggregate it)."]
    assert not at.metric and not at.get("plotly_chart")


def test_redis_unreachable_message(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()  # nothing listens there
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", f"redis://:hunter2@127.0.0.1:{port}/0")
    at = app()
    assert not at.exception
    assert len(at.error) == 1
    text = at.error[0].value
    assert text.startswith(f"Redis is unreachable at `redis://:***@127.0.0.1:{port}/0`: ")
    assert "`trainhealth serve` starts the embedded server" in text
    assert "hunter2" not in text and all("hunter2" not in c.value for c in at.sidebar.caption)
    assert not at.get("plotly_chart")


def test_no_redis_configured_message() -> None:
    at = app()  # conftest removes TRAINHEALTH_REDIS_URL and isolates TRAINHEALTH_HOME
    assert not at.exception
    assert at.error[0].value.startswith("No Redis configured: set `TRAINHEALTH_REDIS_URL`")
