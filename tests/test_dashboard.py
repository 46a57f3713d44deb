"""Dashboard tests against a real Redis: data.py reads with exact values, charts, and each page
rendered with Streamlit's AppTest (no browser; see test_dashboard_browser.py for that).

The seeded run is written with raw redis-py commands following docs/architecture.md, so the
test checks the dashboard against the documented schema, not against another module's writer.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import redis
import streamlit as st
from streamlit.testing.v1 import AppTest

from trainhealth.config import redact_url
from trainhealth.dashboard import charts, data, frame
from trainhealth.dashboard.common import anomaly_delta
from trainhealth.detectors.checkpoints import CheckpointLog
from trainhealth.embedded_redis import free_port
from trainhealth.keys import RUNS, run_keys, service_heartbeat
from trainhealth.text import fmt_duration, fmt_pct, fmt_rate, fmt_usd, plural
from trainhealth.wire import decode_event

pytestmark = pytest.mark.usefixtures("fresh_streamlit_caches")

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
T0 = 1796000000.0  # 2026-11-30 00:53:20 UTC
RUN = "llama-7b"
HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
#: Per-rank busy seconds: rank 3 is the straggler; gen 1 (after the restart) is slower overall.
BUSY_GEN0 = [0.10, 0.11, 0.12, 0.30]
BUSY_GEN1 = [0.2, 0.2, 0.2, 0.4]
SECONDS = {"productive": 71.5, "program_startup": 2.0, "data_loading": 5.0, "straggler_wait": 0.0,
           "skipped_steps": 0.0, "checkpoint_save": 5.0, "checkpoint_restore": 1.0,
           "wasted_progress_from_disruption": 8.0, "wasted_progress_from_rollback": 0.0,
           "infrastructure_recovery_from_disruption": 4.5, "custom": 3.0, "hang": 0.0, "idle": 0.0}
CUSTOM_BY_NAME = {"eval": 2.5, "profiling": 0.5}
#: Throughput and goodput of the three seeded snapshots (docs/goodput.md): tokens_total /
#: step_s (the time inside step attempts: here productive + data loading + wasted progress) and
#: tokens_good / wall_s.
THROUGHPUT = [8 * 4096 / 53.0, 11 * 4096 / 69.0, 14 * 4096 / 84.5]  # 618.26, 652.99, 678.63
GOODPUT = [8 * 4096 / 60.0, 9 * 4096 / 80.0, 12 * 4096 / 100.0]  # 546.13, 460.8, 491.52


def _snapshot(t: float, wall: float, last_step: int, done: int, good_steps: int, restarts: int,
              seconds: dict[str, float], custom_by_name: dict[str, float], world: int = 4,
              price: float | None = 2.5, tokens_per_step: int = 4096) -> dict:
    """A ledger snapshot as docs/goodput.md defines it (rates computed from the seconds)."""
    cost = {k: v * world * price / 3600 for k, v in seconds.items()} if price is not None else None
    step_s = sum(seconds.get(c, 0.0) for c in ("productive", "data_loading", "straggler_wait", "skipped_steps",
                                                "wasted_progress_from_disruption", "wasted_progress_from_rollback"))
    tokens_total, tokens_good = done * tokens_per_step, good_steps * tokens_per_step
    return {"t": t, "started_at": t - wall, "wall_s": wall, "world_size": world, "gpu_hour_usd": price,
            "last_step": last_step, "steps_done": done, "steps_good": good_steps, "restarts": restarts,
            "tokens_total": tokens_total, "tokens_good": tokens_good, "step_s": step_s,
            "throughput_tok_s": tokens_total / step_s if step_s > 0 else 0.0,
            "goodput_tok_s": tokens_good / wall, "goodput_pct": 100.0 * seconds["productive"] / wall,
            "seconds": seconds, "custom_by_name": custom_by_name,
            "gpu_hours": {k: v * world / 3600 for k, v in seconds.items()}, "cost_usd": cost,
            "badput_cost_usd": sum(v for k, v in cost.items() if k != "productive") if cost else None}


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

    marks = CheckpointLog()  # the detector service's merge of the checkpoint events (th:{run}:checkpoints)

    def ev(kind: str, rank: int, t: float, inc: float, **extra: object) -> None:
        fields = {"kind": kind, "rank": rank, "t": repr(t), "inc": repr(inc),
                  **{name: str(v) for name, v in extra.items()}}
        r.xadd(k.events, fields)
        for mark in marks.update(decode_event(fields))[0]:
            r.hset(k.checkpoints, mark.field, mark.to_json())

    for rank in range(4):
        ev("run_start", rank, T0, T0, host=HOSTS[rank], pid=100 + rank, world_size=4, local_rank=rank % 2,
           config="{}")
    for rank, sec in enumerate((1.5, 1.6, 1.5, 1.7)):
        ev("checkpoint_save", rank, T0 + 50 + rank * 0.01, T0, step=8, seconds=sec)
    ev("badput", 0, T0 + 55, T0, name="eval", seconds=2.5)
    ev("badput", 0, T0 + 58, T0, name="profiling", seconds=0.5)
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
        _snapshot(T0 + 60, 60.0, 8, 8, 8, 0, {**SECONDS, "productive": 48.0, "wasted_progress_from_disruption": 0.0},
                  CUSTOM_BY_NAME),
        _snapshot(T0 + 80, 80.0, 10, 11, 9, 1, {**SECONDS, "productive": 56.0}, CUSTOM_BY_NAME),
        _snapshot(T0 + 100, 100.0, 12, 14, 12, 1, SECONDS, CUSTOM_BY_NAME),
    ]
    for snap in snaps:
        r.xadd(k.ledger, {"json": json.dumps(snap)})
    r.set(k.ledger_latest, json.dumps(snaps[-1]))



def service_beat(r: redis.Redis, consumer: str = "svc-1", age_s: float = 0.0, host: str = "host-1") -> None:
    """Write a detector service heartbeat as the service does (``th:service:{consumer}``, TTL 30 s)."""
    r.set(service_heartbeat(consumer), json.dumps({"pid": 4242, "host": host, "t": time.time() - age_s,
                                                   "runs": 1, "processed": 99}), ex=30)


@pytest.fixture
def seeded(r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> redis.Redis:
    """The seeded run with a live detector service (a fresh ``th:service:svc-1`` heartbeat)."""
    seed_run(r)
    service_beat(r)
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
    assert runs.loc[1, "source"] is None and runs.loc[2, "source"] is None  # absent: None, not a truthy NaN
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
    # The detector service's marks (th:{run}:checkpoints) say the same, read without the events.
    pd.testing.assert_frame_equal(data.checkpoints(dr if decoded else seeded, RUN), ev)


def test_unreadable_checkpoint_marks_are_reported(r: redis.Redis) -> None:
    k = run_keys("ck")
    good = {"kind": "checkpoint_save", "step": 999, "t": T0, "seconds": None, "n_ranks": 8}
    r.hset(k.checkpoints, mapping={"a": "{nope", "b": json.dumps({**good, "kind": "badput"}),
                                   "c": json.dumps({**good, "step": "x"}), "d": json.dumps(good)})
    problems: list[str] = []
    frame = data.checkpoints(r, "ck", problems)
    assert frame.drop(columns="seconds").to_dict("records") == [{"kind": "checkpoint_save", "step": 999, "t": T0,
                                                                 "n_ranks": 8}]
    assert math.isnan(frame["seconds"][0])  # no rank said how long it blocked
    assert problems == ["3 checkpoints in th:{ck}:checkpoints are unreadable (first: field 'a': not JSON ('{nope'))"]
    assert list(data.checkpoints(r, "none").columns) == data.EVENT_COLUMNS


def test_anomalies_active_first_then_severity_then_newest(seeded: redis.Redis) -> None:
    an = data.anomalies(seeded, RUN)
    # Resolved: the critical NaN (step 5) above the newer restart (a warning).
    assert list(an["id"]) == ["hang:2:12:1", "straggler:3:4:0", "nan_inf:*:5:0", "restart:*:10:1"]
    assert list(an["status"]) == ["active", "active", "resolved", "resolved"]
    assert list(an["step"]) == [12, 4, 5, 10]
    assert an.loc[0, "end_step"] is pd.NA and an.loc[2, "end_step"] == 6
    assert an.loc[3, "ranks"] == [0, 1, 2, 3] and an.loc[1, "hosts"] == ["node-b"]
    assert an.loc[0, "evidence"] == {"stalled_s": 300.0, "threshold_s": 120.0}
    assert math.isnan(an.loc[2, "evidence"]["loss"])
    assert an.loc[0, "first_seen"] == T0 + 99


def test_ledger_latest_and_history(seeded: redis.Redis) -> None:
    snap = data.ledger_latest(seeded, RUN)
    assert snap is not None
    assert snap["goodput_pct"] == 71.5 and snap["last_step"] == 12 and snap["seconds"] == SECONDS
    assert snap["badput_cost_usd"] == pytest.approx(28.5 * 4 * 2.5 / 3600)
    assert snap["step_s"] == 84.5 and snap["custom_by_name"] == CUSTOM_BY_NAME
    hist = data.ledger_history(seeded, RUN)
    assert list(hist["t"]) == [T0 + 60, T0 + 80, T0 + 100]
    assert list(hist["throughput_tok_s"]) == pytest.approx([618.264151, 652.985507, 678.627219])
    assert list(hist["throughput_tok_s"]) == THROUGHPUT
    assert list(hist["goodput_tok_s"]) == pytest.approx([546.133333, 460.8, 491.52])
    # The new definition: throughput (per second inside steps) >= goodput (kept tokens per wall second).
    assert (hist["throughput_tok_s"] >= hist["goodput_tok_s"]).all()
    assert list(hist["seconds.productive"]) == [48.0, 56.0, 71.5]
    assert list(data.ledger_history(seeded, RUN, count=1)["t"]) == [T0 + 100]


def test_badput_breakdown_sorted_with_custom_split_by_name(seeded: redis.Redis) -> None:
    bd = data.badput_seconds(data.ledger_latest(seeded, RUN))
    # "custom" (3.0 s) is replaced by its names: eval 2.5 s and profiling 0.5 s.
    assert list(bd["category"]) == ["wasted_progress_from_disruption", "data_loading", "checkpoint_save",
                                    "infrastructure_recovery_from_disruption", "eval", "program_startup",
                                    "checkpoint_restore", "profiling", "straggler_wait", "communication",
                                    "skipped_steps", "wasted_progress_from_rollback", "hang", "idle"]
    assert list(bd["seconds"]) == [8.0, 5.0, 5.0, 4.5, 2.5, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert bd.loc[0, "cost_usd"] == pytest.approx(8.0 * 4 * 2.5 / 3600)
    assert bd.loc[4, "cost_usd"] == pytest.approx(2.5 * 4 * 2.5 / 3600)  # the custom cost split by seconds
    assert bd["seconds"].sum() == 28.5 and bd["cost_usd"].sum() == pytest.approx(28.5 * 4 * 2.5 / 3600)


def test_badput_custom_names_collision_remainder_and_old_snapshots() -> None:
    seconds = {**SECONDS, "custom": 4.0}
    snap = _snapshot(T0 + 100, 100.0, 12, 14, 12, 1, seconds, {"idle": 1.0, "evaluation": 2.0})
    bd = data.badput_seconds(snap).set_index("category")["seconds"].to_dict()
    # A name equal to a category is prefixed; the 1.0 s no name covers stays "custom".
    assert {k: bd[k] for k in ("evaluation", "custom: idle", "custom", "idle")} == {
        "evaluation": 2.0, "custom: idle": 1.0, "custom": 1.0, "idle": 0.0}
    old = data.badput_seconds(_snapshot(T0 + 100, 100.0, 12, 14, 12, 1, SECONDS, {}))  # no names written
    assert "custom" in set(old["category"]) and len(old) == 13  # every badput category (not productive, unobserved)
    extra = data.badput_seconds({"seconds": {"productive": 1.0, "new_kind": 2.0}})  # a category added later
    assert extra.loc[0].to_dict() == {"category": "new_kind", "seconds": 2.0, "cost_usd": pytest.approx(math.nan,
                                                                                                      nan_ok=True)}


# --- charts / helpers ----------------------------------------------------------------------

def test_training_curves_markers(seeded: redis.Redis) -> None:
    fig = charts.training_curves(data.recent_steps(seeded, RUN), data.anomalies(seeded, RUN),
                                 data.events(seeded, RUN))
    names = [t.name for t in fig.data]
    assert names == ["gen 0", "grad norm · gen 0", "gen 1", "grad norm · gen 1", "step axis", "critical span",
                     "warning span", "critical anomaly", "warning anomaly", "restart", "checkpoint save",
                     "checkpoint load"]
    # The lane always has data (so the shared step axis is drawn), an invisible point at each end.
    assert (list(fig.data[4].x), fig.data[4].marker.opacity, fig.data[4].showlegend) == ([1, 12], 0, False)
    # Every event-lane marker kind has its own entry in the second legend (top right).
    lane = {t.name: t for t in fig.data[7:]}
    assert all(t.legend == "legend2" and t.showlegend is not False for t in lane.values())
    assert fig.layout.legend2.x == 1 and fig.layout.legend2.xanchor == "right"
    assert [(n, list(t.x), list(t.y)) for n, t in lane.items()] == [
        ("critical anomaly", [12, 5], ["anomaly", "anomaly"]), ("warning anomaly", [4], ["anomaly"]),
        ("restart", [10], ["restart"]), ("checkpoint save", [8, 12], ["checkpoint", "checkpoint"]),
        ("checkpoint load", [8], ["checkpoint"])]
    assert (lane["checkpoint save"].marker.symbol, lane["checkpoint save"].marker.color[0]) == ("square", "#2ca02c")
    assert (lane["checkpoint load"].marker.symbol, lane["checkpoint load"].marker.color[0]) == ("diamond", "#17becf")
    assert lane["checkpoint load"].hovertext[0] == "<b>checkpoint load</b> of step 8, blocked 2.0 s (4 ranks)"
    assert "rank 2 has not completed a step for 300 s" in lane["critical anomaly"].hovertext[0]
    # Lane bars: hang 12 (active) and NaN 5-6 in red; the straggler from step 4 to the newest step.
    assert list(fig.data[5].x) == [11.5, 12.5, None, 4.5, 6.5, None]
    assert list(fig.data[6].x) == [3.5, 12.5, None]
    shapes = fig.layout.shapes
    # Only the loss-related NaN anomaly is shaded on the panels (×3), plus the restart line (×3).
    assert len(shapes) == 6
    assert [(s.type, s.x0, s.x1, s.fillcolor) for s in shapes[:3]] == [("rect", 4.5, 6.5, "#d62728")] * 3
    assert [(s.type, s.x0, s.line.dash) for s in shapes[3:]] == [("line", 10.0, "dash")] * 3
    assert fig.layout.yaxis2.type == "log"
    # inf grad norm and NaN loss become gaps, not points.
    assert math.isnan(fig.data[1].y[5]) and math.isnan(fig.data[0].y[4])


def test_heatmap_single_trace_for_1024_ranks() -> None:
    matrix = pd.DataFrame(np.random.default_rng(0).random((1024, 2000)), index=pd.Index(range(1024), name="rank"),
                          columns=pd.Index(range(1, 2001), name="step"))
    fig = charts.rank_heatmap(matrix, highlight=[7])
    assert len(fig.data) == 1 and fig.data[0].type == "heatmap"
    z = np.asarray(fig.data[0].z)
    assert z.shape == (1024, 63) and z.dtype == np.float32  # 2000 steps in bins of 32 ≤ 65,536 cells, 4 bytes each
    assert z.shape[0] * z.shape[1] <= charts.HEATMAP_MAX_CELLS
    assert z[0, 0] == pytest.approx(matrix.iloc[0, :32].mean(), rel=1e-6)
    assert fig.data[0].x[0] == 32 and fig.data[0].x[-1] == 2000
    assert len(fig.layout.shapes) == 1 and fig.layout.shapes[0].y0 == 6.5


def test_downsample_keeps_small_matrix_and_ignores_nan() -> None:
    m = pd.DataFrame([[1.0, np.nan, 3.0, 5.0]], index=pd.Index([0], name="rank"),
                     columns=pd.Index([1, 2, 3, 4], name="step"))
    assert charts.downsample_steps(m) is m
    out = charts.downsample_steps(m, max_cells=2)
    assert list(out.columns) == [2, 4] and list(out.iloc[0]) == [1.0, 4.0]


def test_goodput_chart_goodput_on_top_of_throughput(seeded: redis.Redis) -> None:
    fig = charts.goodput_over_time(data.ledger_history(seeded, RUN), "UTC")
    assert [t.name for t in fig.data] == ["throughput", "goodput", "gap = discarded tokens + pauses"]
    thr, good, band = fig.data
    # Goodput is drawn after (over) the wider throughput line and fills the gap down from it.
    assert (thr.line.width, good.line.width) == (4, 2) and good.fill == "tonexty" and thr.fill is None
    assert list(good.y) == GOODPUT and list(thr.y) == THROUGHPUT
    assert band.fill == "toself" and list(band.x) == [None] and band.fillcolor == good.fillcolor
    assert fig.layout.legend.traceorder == "normal"
    assert (thr.mode, good.mode) == ("lines", "lines")
    single = charts.goodput_over_time(data.ledger_history(seeded, RUN, count=1), "UTC")
    assert [t.mode for t in single.data[:2]] == ["lines+markers"] * 2  # one snapshot: a point, not nothing


def test_anomaly_card_sub_line_fits() -> None:
    assert [anomaly_delta(3, 0), anomaly_delta(4, 1), anomaly_delta(140, 12), anomaly_delta(1200, 0)] == [
        "of 3 total", "of 4 · 1 critical", "of 140 · 12 crit.", "of 1,200 total"]


def test_compact_formats() -> None:
    assert [fmt_rate(x) for x in (573.44, 41_600.0, 804_817.0, 2_500_000.0, None, math.nan)] == [
        "573", "41,600", "804.8k", "2.50M", "—", "—"]
    assert [fmt_usd(x) for x in (0.0791, 12.3, 1234.5, 123_456.0, None)] == ["$0.08", "$12.30", "$1,234", "$123k", "—"]
    assert [fmt_pct(x) for x in (71.5, 99.94, 99.986, 100.0, None)] == ["71.5%", "99.9%", "100%", "100%", "—"]
    assert [fmt_duration(x) for x in (42.0, 210.0, 7300.0, 200_000.0)] == ["42 s", "3.5 min", "2.0 h", "2.3 d"]
    assert [fmt_duration(x, minute_digits=0) for x in (114.9, 5060.0, 8280.0, 200_000.0, math.nan)] == [
        "115 s", "84 min", "2.3 h", "2.3 d", "—"]
    assert [plural(1, "rank"), plural(4, "rank"), plural(1400, "step"), plural(1, "anomaly", "anomalies"),
            plural(0, "anomaly", "anomalies")] == ["1 rank", "4 ranks", "1,400 steps", "1 anomaly", "0 anomalies"]


def test_redact_url() -> None:
    assert redact_url("redis://:s3cret@db.example:6380/2") == "redis://:***@db.example:6380/2"
    assert redact_url("rediss://ops:pw@h/0") == "rediss://ops:***@h/0"
    assert redact_url("redis://127.0.0.1:6390/0") == "redis://127.0.0.1:6390/0"
    # malformed ones keep no secret either: no "://", a port out of range, a password query parameter
    assert redact_url("rediss//:hunter2@db:6379") == "***@db:6379"
    assert redact_url("redis://:hunter2@db:99999/0") == "redis://***@db:99999/0"
    assert redact_url("redis://db:6379/0?password=hunter2&ssl_cert_reqs=none") == (
        "redis://db:6379/0?password=***&ssl_cert_reqs=none")


# --- pages, rendered with AppTest ------------------------------------------------------------

def test_overview_kpis_and_charts(seeded: redis.Redis, redis_url: str) -> None:
    at = app()  # three runs: the landing page is Runs (tests/test_dashboard_runs.py)
    at.switch_page("pages/overview.py").run()
    assert not at.exception
    assert at.session_state["th_run"] == RUN
    assert at.query_params["run"] == RUN
    assert metrics(at) == {
        "Throughput": ("679", "tokens/s"),  # 14 × 4,096 tokens / 84.5 s inside steps
        "Goodput (tokens)": ("492", "tokens/s"),  # 12 × 4,096 kept tokens / 100 s wall
        "Goodput (time)": ("71.5%", "productive time"),
        "Active anomalies": ("2", "of 4 · 1 critical"),
        "Badput cost": ("$0.08", "at $2.5/GPU-h"),
    }
    helps = {m.label: m.help for m in at.metric}
    assert helps["Goodput (time)"].startswith("Goodput (time) = productive seconds ÷ wall seconds since the run "
                                              "started: the productive share of wall time")
    assert helps["Goodput (tokens)"].startswith("Goodput tokens/s = tokens of the steps the model keeps ÷ wall "
                                                "seconds since the run started. Throughput − goodput is tokens "
                                                "recomputed or discarded")
    assert not at.warning  # the service heartbeat is fresh and every step is aggregated: no banner
    figs = figures(at)
    assert len(figs) == 3
    curves, goodput, badput = figs
    assert [t["name"] for t in curves["data"]][-2:] == ["checkpoint save", "checkpoint load"]
    assert [t["name"] for t in goodput["data"]] == ["throughput", "goodput", "gap = discarded tokens + pauses"]
    assert arr(goodput["data"][0]["y"]) == THROUGHPUT
    assert arr(goodput["data"][1]["y"]) == GOODPUT
    assert goodput["data"][1]["x"][-1] == "2026-11-30T00:55:00.000000"  # T0 + 100 s, UTC in AppTest
    assert arr(curves["data"][2]["x"]) == [9, 10, 11, 12]  # gen 1 replays from the step-8 checkpoint
    # Largest on top (plotly draws the first bar at the bottom); custom badput by its names; the
    # categories at 0 s are named in a caption instead of as empty bars.
    assert badput["data"][0]["y"] == ["profiling", "checkpoint restore", "program startup", "eval",
                                      "infrastructure recovery from disruption", "checkpoint save", "data loading",
                                      "wasted progress from disruption"]
    assert badput["layout"]["height"] == 330  # 8 bars
    assert [c.value for c in at.main.caption] == [
        "status **running** · step 12 ended " + at.main.caption[0].value.split(" ended ")[1].split(" ago")[0]
        + " ago · 4/4 ranks reported it · restart generation 1 · $2.5/GPU-hour · refreshes every 2 s",
        # Under the token chart: its gap is not all badput (straggler wait never shows in it).
        "Shaded gap = tokens recomputed or discarded (redone, rolled-back, skipped steps) and time outside steps "
        "(start-up, checkpoints, restarts, hangs, idle). Straggler wait and data loading slow both curves alike, "
        "so they are not in the gap: see Goodput (time) and the badput by cause.",
        "Productive: 71.5 s of 100.0 s wall time · 1 restart · 12 logged steps kept of 14 done",
        "0.0 s: straggler wait, communication, skipped or NaN steps, wasted progress from rollback, hang, idle"]
    sidebar = [c.value for c in at.sidebar.caption]
    assert sidebar[-1] == f"Redis: `{redis_url}`"
    assert sidebar[0].startswith("**running** · 4 ranks · started ") and sidebar[0].endswith(" · source `demo`")
    # The status first, so the narrow sidebar never cuts it ("…· runninç"); the ranks are in the line under it.
    assert at.sidebar.selectbox[0].options == ["running · llama-7b", "running · empty-run", "finished · old-run"]


def test_ranks_page_heatmap_table_and_straggler(seeded: redis.Redis) -> None:
    at = app()
    at.switch_page("pages/ranks.py").run()
    assert not at.exception
    assert at.session_state["th_run"] == RUN and at.query_params["run"] == RUN
    assert at.sidebar.selectbox[0].value == RUN  # the frame is drawn on every page
    figs = figures(at)
    assert len(figs) == 2 and figs[0]["data"][0]["type"] == "heatmap"  # and the flagged rank's timeline
    assert len(figs[0]["layout"]["shapes"]) == 1  # the active straggler's outline (rank 3)
    table = at.dataframe[1].value
    assert list(table["rank"]) == [3, 2, 1, 0]
    assert list(table["host"]) == ["node-c", "node-b", "node-a", "node-a"]
    assert list(table["flagged"]) == [True, False, False, False]  # the detector's verdict: the active straggler
    assert list(table["verdict"].fillna("")) == ["Straggler", "", "", ""]
    # Only the steps since the active straggler's onset (step 4): rank medians 0.30, 0.16, 0.11, 0.10.
    assert list(table["median_busy_s"]) == pytest.approx([0.30, 0.16, 0.11, 0.10])
    assert table.loc[0, "ratio"] == pytest.approx(0.30 / 0.135)
    assert list(table["score"]) == pytest.approx([0.10 / 0.30, 0.10 / 0.16, 0.10 / 0.11, 1.0])
    assert list(table["steps"]) == [9, 8, 9, 9]
    # Nodes first (two hosts per node here, one node per host: node-c holds rank 3 alone since the restart).
    nodes = at.dataframe[0].value
    assert list(nodes["host"]) == ["node-c", "node-b", "node-a"]
    assert list(nodes["rank_list"]) == ["3", "2", "0–1"] and list(nodes["slow_node"]) == [False, False, False]
    assert list(nodes["median_busy_s"]) == pytest.approx([0.30, 0.16, 0.105])
    assert at.main.caption[1].value == (
        "Busy = seconds a rank spends in its own timed sections before the collective; a slow rank makes all "
        "others wait. Ratio = the rank's median busy time / the median rank's; score = the fastest rank's "
        "median / this rank's (NVIDIA's relative score), since the active straggler's onset (steps 4–12, 9 "
        "steps). Flagged = the detectors' verdict, not these figures: named by an active straggler, slow-node or "
        "rank-outlier anomaly (the straggler detector flags a score below 0.8 held over 2 windows of 20 steps).")
    assert [w.value for w in at.warning] == [
        "**Straggler**: rank 3 on node-b since step 4 — rank 3 is 2.6x slower than the median rank"]
    heat = figs[0]["data"][0]
    assert "zmid" not in heat and heat["colorbar"]["title"]["text"] == "s"  # seconds, Viridis
    # From 0 s to the slowest cell (48 cells, no clipping): jitter between ranks stays one colour.
    assert (heat["zmin"], heat["zmax"]) == (0.0, pytest.approx(float(np.nanmax(np.array(arr(heat["z"]), float)))))
    assert arr(heat["x"]) == list(range(1, 13)) and arr(heat["y"]) == [0, 1, 2, 3]

    at.segmented_control(key="ranks_mode").select("ratio to step median").run()
    at.segmented_control(key="ranks_window").select(100).run()
    assert not at.exception
    heat = figures(at)[0]["data"][0]
    assert heat["zmid"] == 1.0 and heat["colorbar"]["title"]["text"] == "× step median"
    # At least 0.5x-1.5x of the step median; here the slowest cell (rank 3 at 0.30 s / 0.11 s) is above it.
    assert heat["zmin"] == 0.5 and heat["zmax"] == pytest.approx(0.30 / 0.11)
    # Step 4: busy [0.10, 0.11, 0.12, 0.30], median 0.115 → rank 3 at 0.30 / 0.115.
    z = np.array(arr(heat["z"]))
    assert z.shape == (4, 12) and z[3, 3] == pytest.approx(0.30 / 0.115) and z[0, 3] == pytest.approx(0.10 / 0.115)


def test_anomalies_page_table_filters_and_evidence(seeded: redis.Redis) -> None:
    at = app()
    at.switch_page("pages/anomalies.py").run()
    assert not at.exception
    table = at.dataframe[0].value
    # Active first, then by severity, then newest: the resolved critical NaN above the resolved restart.
    assert list(table["id"]) == ["hang:2:12:1", "straggler:3:4:0", "nan_inf:*:5:0", "restart:*:10:1"]
    assert list(table["severity"]) == ["critical", "warning", "critical", "warning"]
    assert list(table["kind"]) == ["Hang", "Straggler", "NaN/Inf", "Restart"]  # the kind in words (issue 16)
    assert list(table["status"]) == ["active", "active", "resolved", "resolved"]
    assert list(table["step"]) == [12, 4, 5, 10]
    assert list(table["ranks"]) == ["2", "3", "", "0, 1, 2, 3"]
    assert table.loc[3, "hosts"] == "node-a, node-b, node-c"
    assert table.loc[0, "message"] == "rank 2 has not completed a step for 300 s"
    assert table.loc[0, "first_seen"] == pd.Timestamp("2026-11-30 00:54:59", tz="UTC")
    assert table.loc[2, "last_seen"] == pd.Timestamp("2026-11-30 00:53:53", tz="UTC")
    assert pd.isna(table.loc[0, "end_step"]) and table.loc[2, "end_step"] == 6
    # Without a link, the first row is selected and its evidence is shown beside the table.
    assert at.json[0].value == json.dumps({"stalled_s": 300.0, "threshold_s": 120.0})
    # Layout (issue 16): a full-height table (no scrolling box) of one-line rows, the message in the evidence.
    grid = at.dataframe[0].proto
    assert list(grid.column_order) == ["severity", "kind", "status", "step", "end_step", "ranks", "hosts"]
    assert grid.row_height == 0  # one line per row: nothing wraps ("throughput_dro p")
    widths = {name: cfg.get("width") for name, cfg in json.loads(grid.columns).items()}
    assert widths["kind"] == 128  # "Grad-norm explosion" on one line
    assert at.main.caption[0].value == ("4 of 4 anomalies shown · 2 active · active first, then by severity, "
                                        "newest first · times in UTC · select a row to see its evidence")
    assert at.main.caption[1].value == ("id `hang:2:12:1` · ranks 2 · hosts node-b · seen 2026-11-30 00:54:59 → "
                                        "2026-11-30 00:55:00 (UTC)")
    assert "#### Hang" in [m.value for m in at.main.markdown]

    at.multiselect(key="filter_severity").select("critical").run()
    at.multiselect(key="filter_status").select("resolved").run()
    assert list(at.dataframe[0].value["id"]) == ["nan_inf:*:5:0"]
    assert at.main.caption[0].value.startswith("1 of 4 anomalies shown · 2 active · active first")
    assert (at.query_params["severity"], at.query_params["status"]) == ("critical", "resolved")  # kept in the URL
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
    assert "Step" not in metrics(at)  # the status line names the step: the room goes to the goodput labels
    assert metrics(at)["Badput time"] == ("—", "no price set")
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
        "No runs yet — start `trainhealth demo` or instrument a job with `trainhealth.Monitor` "
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


# --- detector service banner ---------------------------------------------------------------------

def test_service_heartbeats_newest_first_and_running(r: redis.Redis) -> None:
    now = time.time()
    assert data.service_heartbeats(r) == [] and not data.service_running([], now)
    service_beat(r, "old", age_s=25.0, host="node-x")
    service_beat(r, "new", age_s=1.0, host="node-y")
    r.set(service_heartbeat("broken"), "not json", ex=30)
    r.set("th:{run}:service:x", "{}")  # not a service key (the pattern is anchored at th:service:)
    beats = data.service_heartbeats(r)
    assert [(b["consumer"], b["host"], b["pid"], b["runs"], b["processed"]) for b in beats] == [
        ("new", "node-y", 4242, 1, 99), ("old", "node-x", 4242, 1, 99)]
    assert beats[0]["t"] == pytest.approx(now - 1.0, abs=1.0)
    assert data.service_running(beats, now) and not data.service_running(beats[1:], now)
    assert data.service_running(beats[1:], now, stale_s=30.0)


def test_processing_state_and_unprocessed_lag(r: redis.Redis) -> None:
    k = run_keys("lagging")
    for rank, (step, step_t) in enumerate(((1400, T0 + 700.0), (1399, T0 + 699.5))):
        r.hset(k.heartbeats, str(rank), json.dumps({"t": T0 + 701, "step": step, "step_t": step_t,
                                                    "phase": "train", "inc": T0 + rank}))
    assert data.processing_state(r, "lagging") == {"hb_step": 1400, "hb_step_t": T0 + 700.0, "agg_step": None,
                                                   "agg_t_end": None, "inc": T0}
    assert data.unprocessed_lag(data.processing_state(r, "lagging")) == 700.0  # nothing aggregated since start
    r.xadd(k.agg, {"step": 700, "gen": 0, "t_end": repr(T0 + 350.0), "busy": "[]"})
    state = data.processing_state(r, "lagging")
    assert (state["agg_step"], state["agg_t_end"]) == (700, T0 + 350.0)
    assert data.unprocessed_lag(state) == 350.0
    assert data.unprocessed_lag({**state, "agg_t_end": T0 + 660.0}) is None  # 40 s behind: within a minute
    assert data.unprocessed_lag({**state, "agg_step": 1400}) is None  # caught up
    # A replay's heartbeat names no step: nothing to compare.
    assert data.unprocessed_lag({"hb_step": None, "hb_step_t": None, "agg_step": 700, "agg_t_end": T0,
                                 "inc": T0}) is None


def test_service_problem_texts() -> None:
    now = T0 + 1000.0
    fresh = [{"consumer": "svc-1", "host": "host-1", "t": now - 1.0}]
    stale = [{"consumer": "svc-1", "host": "host-1", "t": now - 25.0}]
    ok = {"hb_step": 12, "hb_step_t": now - 5, "agg_step": 12, "agg_t_end": now - 6, "inc": T0}
    behind = {"hb_step": 1400, "hb_step_t": now - 10.0, "agg_step": 700, "agg_t_end": now - 610.0, "inc": T0}
    assert frame.service_problem(fresh, ok, now) is None
    assert frame.service_problem([], ok, now) == frame.SERVICE_DOWN == (
        "Detector service not running: anomalies and goodput are not updating — start `trainhealth serve`.")
    assert frame.service_problem(stale, ok, now) == frame.SERVICE_DOWN + (
        " Its last heartbeat (`svc-1` on host-1) is 25 s old.")
    assert frame.service_problem(fresh, behind, now) == (
        "Steps arrive but the detector service is not processing this run: the ranks completed step 1,400 (10 s "
        "ago), but the newest aggregated step is 700, which ended 10.0 min before that. Check the `trainhealth "
        "serve` log (is it on this Redis?).")
    assert frame.service_problem([], {**behind, "agg_step": None, "agg_t_end": None}, now) == frame.SERVICE_DOWN + (
        " Steps still arrive: the ranks completed step 1,400 (10 s ago), but no step of this run has been "
        "aggregated.")
    failing = [{**fresh[0], "detector_errors": {"r1": {"LossSpikeDetector": 3, "RollbackAdvisor": 1},
                                                "other": {"HangDetector": 9}}},
               {"consumer": "svc-0", "t": now - 40.0, "detector_errors": {"r1": {"HangDetector": 5}}},  # stale
               {"consumer": "svc-2", "t": now - 2.0, "detector_errors": {"r1": {"LossSpikeDetector": 1,
                                                                               "Bad": "x", "Neg": -1}}}]
    assert data.detector_errors(failing, "r1", now) == {"LossSpikeDetector": 4, "RollbackAdvisor": 1}
    assert frame.service_problem(failing, ok, now, "other") == (
        "Detectors failing on this run: HangDetector (9 errors). Their findings may be missing; the other "
        "detectors go on. The traceback is in the `trainhealth serve` log.")
    assert frame.service_problem(failing, ok, now, "r1").startswith(
        "Detectors failing on this run: LossSpikeDetector (4 errors), RollbackAdvisor (1 error). ")
    assert frame.service_problem(failing, ok, now, "r2") is None


@pytest.mark.parametrize("page", ["app.py", "pages/ranks.py", "pages/anomalies.py"])
def test_banner_when_no_service_heartbeat(seeded: redis.Redis, page: str) -> None:
    seeded.delete(service_heartbeat("svc-1"))
    at = app()
    if page != "app.py":
        at.switch_page(page).run()
    assert not at.exception
    banners = [w for w in at.warning if w.value.startswith("Detector service")]
    assert [w.value for w in banners] == [frame.SERVICE_DOWN]
    assert banners[0].proto.icon == ":material/sensors_off:"


def test_banner_when_service_heartbeat_is_stale(seeded: redis.Redis) -> None:
    seeded.delete(service_heartbeat("svc-1"))
    service_beat(seeded, "svc-2", age_s=20.0, host="gpu-host")  # still in Redis (TTL 30 s) but 20 s old
    at = app()
    assert not at.exception
    assert len(at.warning) == 1
    assert re.fullmatch(re.escape(frame.SERVICE_DOWN) + r" Its last heartbeat \(`svc-2` on gpu-host\) is 2[01] s old\.",
                        at.warning[0].value)


def test_no_banner_with_fresh_heartbeat_on_every_page(seeded: redis.Redis) -> None:
    at = app()
    assert not at.exception and not at.warning
    at.switch_page("pages/anomalies.py").run()
    assert not at.exception and not at.warning
    at.switch_page("pages/ranks.py").run()
    assert [w.value for w in at.warning] == [  # only the straggler, no service banner
        "**Straggler**: rank 3 on node-b since step 4 — rank 3 is 2.6x slower than the median rank"]


def test_banner_when_steps_arrive_but_are_not_processed(seeded: redis.Redis) -> None:
    # The service is alive, but rank 0 reports step 40 done 3 h ago... 10 min after the newest
    # aggregate (step 12, ended at T0 + 85): the service is not consuming this run.
    k = run_keys(RUN)
    step_t = time.time() - 3 * 3600
    seeded.hset(k.heartbeats, "0", json.dumps({"t": time.time(), "step": 40, "step_t": step_t, "phase": "train",
                                               "host": "node-a", "pid": 200, "inc": T0 + 70}))
    seeded.xadd(k.agg, {"step": 13, "gen": 1, "t_end": repr(step_t - 600.0), "busy": "[]"})
    at = app()
    assert not at.exception
    assert [w.value for w in at.warning] == [
        "Steps arrive but the detector service is not processing this run: the ranks completed step 40 (3.0 h "
        "ago), but the newest aggregated step is 13, which ended 10.0 min before that. Check the `trainhealth "
        "serve` log (is it on this Redis?)."]


# --- a replayed log: one rank, no section timings, no token counts ----------------------------------

REPLAY = "replay-trocr"


def seed_replay(r: redis.Redis) -> None:
    """Like ``trainhealth replay`` of a HF log logging every 2nd step: steps 2..1,400 (700 logged),
    rank 0 of 1, untimed (``busy`` [null]), no tokens, 7 evaluations (112.8 s of custom badput)."""
    k = run_keys(REPLAY)
    start = T0 + 500
    r.zadd(RUNS, {REPLAY: start})
    r.hset(k.meta, mapping={"name": REPLAY, "world_size": "1", "started_at": repr(start), "status": "finished",
                            "updated_at": repr(start), "ended_at": repr(start + 1512.8),
                            "source": "replay:hf_trocr_large_gradnorm.trainer_state.json"})
    pipe = r.pipeline()
    for i, step in enumerate(range(2, 1401, 2)):
        pipe.xadd(k.agg, {"step": step, "gen": 0, "t_end": repr(start + 2.0 * (i + 1)), "n_ranks": 1,
                          "busy": "[null]", "loss": repr(5.0 / (1 + i)), "grad_norm": "150000.0", "data_s": "0.0"})
    pipe.execute()
    r.hset(k.heartbeats, "0", json.dumps({"t": start + 1512.8, "step": None, "step_t": None, "phase": "replay",
                                          "host": "vm", "pid": 7, "inc": start}))
    seconds = {"productive": 1398.0, "program_startup": 2.0, "data_loading": 0.0, "checkpoint_save": 0.0,
               "checkpoint_restore": 0.0, "wasted_progress_from_disruption": 0.0,
               "infrastructure_recovery_from_disruption": 0.0, "idle": 0.0, "custom": 112.8}
    snap = _snapshot(start + 1512.8, 1512.8, 1400, 700, 700, 0, seconds, {"evaluation": 112.8}, world=1,
                     price=None, tokens_per_step=0)
    for t in (start + 1000.0, start + 1512.8):
        r.xadd(k.ledger, {"json": json.dumps({**snap, "t": t})})
    r.set(k.ledger_latest, json.dumps(snap))


def test_replayed_run_overview(seeded: redis.Redis) -> None:
    seed_replay(seeded)
    at = app(run=REPLAY)
    assert not at.exception
    assert metrics(at) == {
        "Throughput": ("n/a", "no token counts"),
        "Goodput (tokens)": ("n/a", "no token counts"),
        "Goodput (time)": ("92.4%", "productive time"),
        "Active anomalies": ("0", "of 0 total"),
        "Badput time": ("115 s", "no price set"),  # 1,512.8 - 1,398 s
    }
    assert [i.value for i in at.info] == [
        "No token counts in this run (e.g. a replayed log without them), so there is no throughput or goodput "
        "in tokens/s. Goodput (time) and the badput breakdown still apply."]
    assert not at.warning  # the service is up and a replay's heartbeat names no step to compare
    figs = figures(at)
    assert len(figs) == 2  # curves and badput: no tokens/s chart of zeros
    axis = [t for t in figs[0]["data"] if t["name"] == "step axis"]
    assert len(axis) == 1 and arr(axis[0]["x"]) == [2, 1400]  # the lane keeps the step axis drawn
    badput = figs[1]["data"][0]
    assert badput["y"] == ["program startup", "evaluation"]  # custom by name; the zero categories in a caption
    assert arr(badput["x"]) == [2.0, 112.8]
    assert figs[1]["layout"]["height"] == 200  # two bars: the chart shrinks instead of drawing giant bars
    captions = [c.value for c in at.main.caption]
    assert captions[0].endswith(" ago · 1/1 rank reported it · refreshes every 2 s")
    assert captions[1] == ("Productive: 1,398.0 s of 1,512.8 s wall time · 0 restarts · 700 logged steps kept of "
                           "700 done")
    assert at.sidebar.caption[0].value.startswith("**finished** · 1 rank · started ")
    assert at.sidebar.selectbox[0].options[0] == "finished · replay-trocr"


def test_replayed_run_ranks_page_says_there_are_no_timings(seeded: redis.Redis) -> None:
    seed_replay(seeded)
    at = app(run=REPLAY)
    at.switch_page("pages/ranks.py").run()
    assert not at.exception
    assert [i.value for i in at.info] == [
        "No per-rank section timings in this run (a replayed log / untimed steps), so ranks cannot be compared. "
        "Time each step with `with mon.step(step):` and its work with `mon.section(...)` to see every rank's "
        "busy time here."]
    assert not figures(at) and not at.dataframe  # no empty heatmap, no empty table


# --- the rank table's window -------------------------------------------------------------------------

LATE = "late-straggler"


def seed_late_straggler(r: redis.Redis, anomaly: bool) -> None:
    """428 steps of 4 ranks at 0.10 s busy; rank 2 at 0.20 s from step 400 (flagged at step 400)."""
    k = run_keys(LATE)
    r.zadd(RUNS, {LATE: T0 + 10_000})
    r.hset(k.meta, mapping={"name": LATE, "world_size": "4", "status": "running", "started_at": repr(T0)})
    pipe = r.pipeline()
    for step in range(1, 429):
        busy = [0.10, 0.10, 0.20 if step >= 400 else 0.10, 0.10]
        pipe.xadd(k.agg, {"step": step, "gen": 0, "t_end": repr(T0 + step), "n_ranks": 4, "busy": json.dumps(busy)})
    pipe.execute()
    if anomaly:
        r.hset(k.anomalies, "straggler:2:400:0", json.dumps({
            "id": "straggler:2:400:0", "run": LATE, "kind": "straggler", "severity": "warning", "status": "active",
            "step": 400, "end_step": None, "ranks": [2], "hosts": [], "evidence": {"score": 0.5},
            "message": "rank 2 is a straggler", "first_seen": T0 + 400, "last_seen": T0 + 428}))


def test_rank_table_window_since_onset_or_last_100(r: redis.Redis) -> None:
    seed_late_straggler(r, anomaly=True)
    matrix = data.rank_matrix(r, LATE)
    everything = data.rank_summary(matrix)
    assert everything.loc[everything["rank"] == 2, "ratio"].item() == 1.0  # diluted by 399 healthy steps
    recent, onset = data.rank_table_window(matrix, data.anomalies(r, LATE))
    assert onset == 400 and list(recent.columns) == list(range(400, 429))
    assert data.rank_summary(recent).loc[0].to_dict() == {"rank": 2, "host": None, "median_busy_s": 0.2,
                                                          "ratio": 2.0, "score": 0.5, "steps": 29}
    recent, onset = data.rank_table_window(matrix, None)
    assert onset is None and list(recent.columns) == list(range(329, 429))
    # An onset before the last 100 steps: the last 100 steps already show it undiluted.
    old = data.anomalies(r, LATE).assign(step=pd.array([300], dtype="Int64"))
    assert data.rank_table_window(matrix, old)[1] is None


@pytest.mark.parametrize("anomaly", [True, False])
def test_ranks_page_table_uses_a_recent_window(seeded: redis.Redis, anomaly: bool) -> None:
    seed_late_straggler(seeded, anomaly)
    at = app(run=LATE)
    at.switch_page("pages/ranks.py").run()
    assert not at.exception
    table = at.dataframe[0].value
    caption = at.main.caption[0].value
    rank2 = table[table["rank"] == 2].iloc[0]
    if anomaly:
        assert table.loc[0, "rank"] == 2 and bool(table.loc[0, "flagged"])
        assert (rank2["ratio"], rank2["steps"]) == (2.0, 29)
        assert "(NVIDIA's relative score), since the active straggler's onset (steps 400–428, 29 steps). " in caption
    else:
        # 29 slow steps of the last 100: the median is still the healthy one, but the window is stated.
        assert (rank2["ratio"], rank2["steps"]) == (1.0, 100)
        assert not table["flagged"].any()  # a slow rank the detector has not flagged is not called flagged
        assert "(NVIDIA's relative score), over the last 100 steps (steps 329–428). " in caption


# --- anomaly counts ---------------------------------------------------------------------------------

def test_anomalies_kpi_counts_resolved_restarts(seeded: redis.Redis) -> None:
    k = run_keys("empty-run")
    for i, step in enumerate((100, 250, 400)):  # restarts are written already resolved
        a = {"id": f"restart:*:{step}:{i + 1}", "run": "empty-run", "kind": "restart", "severity": "warning",
             "status": "resolved", "step": step, "end_step": step, "ranks": [], "hosts": [], "evidence": {},
             "message": f"all ranks restarted at step {step}", "first_seen": T0 + i, "last_seen": T0 + i}
        seeded.hset(k.anomalies, a["id"], json.dumps(a))
    at = app(run="empty-run")
    assert not at.exception
    assert metrics(at)["Active anomalies"] == ("0", "of 3 total")
    assert at.sidebar.selectbox[0].options[1] == "running · empty-run"


# --- the caveat of a paced replay or an assumed timeline ------------------------------------------------

PACED = ("Replayed from `megatron_deepspeed_104b_overflow_excerpt.log` at 100x: rates are per second of replay "
         "(the log's own rates are 100x lower) and durations are replay time (100x shorter than in the log).")


def test_replay_info_reads_pace_and_timeline(seeded: redis.Redis, dr: redis.Redis) -> None:
    seed_replay(seeded)
    assert data.replay_info(seeded, REPLAY) is None  # a replay from before these fields: nothing claimed
    assert data.replay_info(seeded, RUN) is None  # a live job
    seeded.hset(run_keys(REPLAY).meta, mapping={"replay_speed": "100.0", "timeline": "assumed",
                                                "assumed_step_s": "2.5"})
    expected = {"source": "hf_trocr_large_gradnorm.trainer_state.json", "speed": 100.0, "timeline": "assumed",
                "assumed_step_s": 2.5}
    assert data.replay_info(seeded, REPLAY) == expected
    assert data.replay_info(dr, REPLAY) == expected


def test_replay_caveat_texts() -> None:
    def info(speed: float, timeline: str, step: float | None = 1.0) -> dict:
        return {"source": "x.log", "speed": speed, "timeline": timeline, "assumed_step_s": step}

    assert frame.replay_caveat(None) is None
    assert frame.replay_caveat(info(0.0, "logged")) is None  # at once on the log's own timeline: its own rates
    assert frame.replay_caveat(info(1.0, "logged")) is None  # real time: the log's own rates too
    assert frame.replay_caveat(info(0.5, "logged")) == (
        "Replayed from `x.log` at 0.5x: rates are per second of replay (the log's own rates are 2x higher) and "
        "durations are replay time (2x longer than in the log).")
    assert frame.replay_caveat(info(0.0, "assumed")) == (
        "Replayed from `x.log`; the log has no step times: the timeline assumes 1 s per step, so goodput and "
        "rates are not measured.")
    assert frame.replay_caveat(info(10.0, "partly assumed", 2.0)) == (
        "Replayed from `x.log` at 10x: rates are per second of replay (the log's own rates are 10x lower) and "
        "durations are replay time (10x shorter than in the log). Some of the log's steps have no step time: "
        "those assume 2 s per step, so goodput and rates are only partly measured.")


@pytest.mark.parametrize("page", ["app.py", "pages/goodput.py", "pages/ranks.py", "pages/anomalies.py",
                                  "pages/alerts.py"])
def test_paced_replay_caveat_on_every_page(seeded: redis.Redis, page: str) -> None:
    # `trainhealth replay megatron_deepspeed_104b_overflow_excerpt.log --speed 100`: step times logged
    seed_replay(seeded)
    seeded.hset(run_keys(REPLAY).meta, mapping={"source": "replay:megatron_deepspeed_104b_overflow_excerpt.log",
                                                "replay_speed": "100.0", "timeline": "logged"})
    at = app(run=REPLAY)
    if page != "app.py":
        at.switch_page(page).run()
    assert not at.exception
    assert at.info[0].value == PACED
    assert at.info[0].proto.icon == ":material/history:"
    assert [i.value for i in at.info].count(PACED) == 1


def test_assumed_timeline_caveat_and_none_for_a_logged_replay_at_once(seeded: redis.Redis) -> None:
    seed_replay(seeded)
    k = run_keys(REPLAY)
    seeded.hset(k.meta, mapping={"replay_speed": "0.0", "timeline": "assumed", "assumed_step_s": "1.0"})
    at = app(run=REPLAY)
    assert not at.exception
    caveats = [i.value for i in at.info if i.value.startswith("Replayed from")]
    assert caveats == [
        "Replayed from `hf_trocr_large_gradnorm.trainer_state.json`; the log has no step times: the timeline "
        "assumes 1 s per step, so goodput and rates are not measured."]
    assert at.info[0].value == caveats[0]  # on top, before the page's own notes
    seeded.hset(k.meta, "timeline", "logged")
    seeded.hdel(k.meta, "assumed_step_s")
    st.cache_data.clear()
    at = app(run=REPLAY)
    assert not at.exception
    assert not [i.value for i in at.info if i.value.startswith("Replayed from")]


# --- garbage in Redis: a clear warning, never a traceback ---------------------------------------

GARB = "garb"
PAGES = ["pages/overview.py", "pages/goodput.py", "pages/ranks.py", "pages/anomalies.py", "pages/alerts.py"]


def _open(page: str, **query: str) -> AppTest:
    at = app(**query)
    if page != "app.py":
        at.switch_page(page).run()
    return at


def seed_garbage(r: redis.Redis) -> None:
    """Run ``garb``: newest in the registry, with garbage beside readable data in every key the pages read."""
    k = run_keys(GARB)
    r.zadd(RUNS, {GARB: T0 + 500})
    r.hset(k.meta, mapping={"status": "running", "world_size": "four", "started_at": "soon"})
    r.xadd(k.agg, {"foo": "bar"}, id="1-1000")  # no step
    r.xadd(k.agg, {"step": "7", "gen": "0", "t_start": str(T0), "t_end": str(T0 + 1), "loss": "2.5",
                   "busy": "[0.1, 0.2]"}, id="2-0")
    r.xadd(k.agg, {"step": "8", "gen": "0", "t_start": str(T0 + 1), "t_end": str(T0 + 2), "loss": "2.4",
                   "busy": "{nope"}, id="3-0")
    good = {"id": "ok:1", "kind": "straggler", "severity": "warning", "status": "active", "step": 7,
            "ranks": [1], "hosts": ["n"], "message": "rank 1 slow", "first_seen": T0, "last_seen": T0}
    r.hset(k.anomalies, mapping={"x:1": "{not json", "x:2": "[1,2]", "ok:1": json.dumps(good),
                                 "bad:1": json.dumps({**good, "id": "bad:1", "ranks": "x", "step": "seven"})})
    r.set(k.ledger_latest, "{not json")
    r.xadd(k.ledger, {"json": "garbage"}, id="1-0")
    r.hset(k.recommendations, "rec:x", json.dumps({"id": "rec:x", "status": "proposed", "onset_step": "soon"}))


def test_unreadable_values_are_reported_by_key_field_and_value(r: redis.Redis) -> None:
    seed_garbage(r)
    problems: list[str] = []
    steps = data.recent_steps(r, GARB, problems=problems)
    assert list(steps["step"]) == [7, 8] and list(steps["busy"]) == [[0.1, 0.2], []]
    frame = data.anomalies(r, GARB, problems)
    assert list(frame["id"]) == ["bad:1", "ok:1"] and frame.loc[0, "ranks"] == [] and pd.isna(frame.loc[0, "step"])
    assert data.ledger_latest(r, GARB, problems) is None
    assert data.ledger_history(r, GARB, problems=problems).empty
    assert data.recommendations(r, GARB, problems) == []
    assert data.run_meta(r, GARB, problems) == {"status": "running", "world_size": None, "started_at": None}
    assert problems == [
        "1 entry in th:{garb}:agg is unreadable (entry 1-1000: no step)",
        "1 entry in th:{garb}:agg has unreadable values, shown as missing (entry 3-0: busy '{nope' is not JSON)",
        "2 anomalies in th:{garb}:anomalies are unreadable (first: field 'x:1': not JSON)",
        "1 anomaly in th:{garb}:anomalies has unreadable values, shown as missing (field 'bad:1': ranks 'x' is not "
        "a list of rank numbers; step 'seven' is not a number)",
        "th:{garb}:ledger:latest is unreadable: not JSON ('{not json')",
        "1 snapshot in th:{garb}:ledger is unreadable (entry 1-0: not JSON ('garbage'))",
        "1 recommendation in th:{garb}:recommendations is unreadable (field 'rec:x': onset_step 'soon' is not a "
        "whole number)",
        "th:{garb}:meta has unreadable fields, shown as missing: world_size 'four' is not a number; started_at "
        "'soon' is not a number",
    ]


@pytest.mark.parametrize("page", PAGES)
def test_garbage_run_pages_warn_and_render_the_rest(seeded: redis.Redis, page: str) -> None:
    seed_garbage(seeded)
    at = _open(page)
    assert not at.exception
    assert at.session_state["th_run"] == GARB
    warnings = [w.value for w in at.warning]
    if page in ("pages/overview.py", "pages/anomalies.py"):
        assert "2 anomalies in th:{garb}:anomalies are unreadable (first: field 'x:1': not JSON)" in warnings
    if page == "pages/overview.py":
        assert "1 entry in th:{garb}:agg is unreadable (entry 1-1000: no step)" in warnings
        assert arr(figures(at)[0]["data"][0]["x"]) == [7, 8]  # the readable steps are drawn
    if page == "pages/anomalies.py":
        assert not at.success  # not "No anomalies detected": two of them could not be read
        assert any(c.value.startswith("2 of 2 anomalies shown") for c in at.main.caption)
    if page == "pages/goodput.py":
        assert "th:{garb}:ledger:latest is unreadable: not JSON ('{not json')" in warnings
        assert not [i for i in at.info if i.value.startswith("No goodput ledger snapshot yet")]
    # The other run is unaffected.
    other = _open(page, run=RUN)
    assert not other.exception and other.session_state["th_run"] == RUN
    assert not [w for w in other.warning if "th:{garb}" in w.value]


@pytest.mark.parametrize("bad_id", ["ünïcode-run", "bad id!", ""])
@pytest.mark.parametrize("page", [*PAGES, "pages/runs.py"])
def test_invalid_run_id_in_registry_is_skipped(seeded: redis.Redis, page: str, bad_id: str) -> None:
    seeded.zadd(RUNS, {bad_id: 1})
    at = _open(page)
    assert not at.exception
    assert at.session_state["th_run"] == RUN
    assert at.sidebar.selectbox[0].options == [f"running · {RUN}", "running · empty-run", "finished · old-run"]
    assert [w.value for w in at.sidebar.warning] == [f"th:runs lists 1 invalid run id, skipped: {bad_id!r}"]
    assert list(data.list_runs(seeded)["run"]) == [RUN, "empty-run", "old-run"]


def test_invalid_run_id_in_link_says_so(seeded: redis.Redis) -> None:
    at = app(run="bad id!")
    assert not at.exception
    assert at.warning[0].value == (
        "The link's run is not valid: run='bad id!' is not a valid run id: use 1-128 letters, digits, '.', '_' or "
        "'-', starting with a letter or digit. Showing the newest run.")
    assert at.session_state["th_run"] == RUN


@pytest.mark.parametrize(("snap", "expected"), [
    ({"wall_s": "x", "seconds": [1], "restarts": 1.5, "rates": {"60s": "y"}, "gpu_hours": {"hang": "z"}},
     "wall_s 'x' is not a number; restarts 1.5 is not a whole number; seconds [1] is not an object; "
     "gpu_hours.hang 'z' is not a number; rates.60s 'y' is not an object"),
    ({"seconds": {"productive": "lots"}, "badput_cost_usd": "free", "gpu_hour_usd": [], "custom_by_name": 3},
     "gpu_hour_usd [] is not a number; badput_cost_usd 'free' is not a number; seconds.productive 'lots' is not "
     "a number; custom_by_name 3 is not an object"),
])
@pytest.mark.parametrize("page", ["pages/overview.py", "pages/goodput.py"])
def test_ledger_snapshot_of_wrong_types(seeded: redis.Redis, page: str, snap: dict, expected: str) -> None:
    snapshot = _snapshot(T0 + 100, 100.0, 12, 14, 12, 1, SECONDS, CUSTOM_BY_NAME)
    seeded.set(run_keys(RUN).ledger_latest, json.dumps({**snapshot, **snap}))
    at = _open(page)
    assert not at.exception
    latest = [w.value for w in at.warning if w.value.startswith("th:{llama-7b}:ledger:latest")]
    assert latest == ["th:{llama-7b}:ledger:latest has unreadable values, shown as missing: " + expected]
