"""The Goodput page and the recommendation card, against a real Redis.

The run is seeded as the detector service writes it (docs/architecture.md): ledger snapshots as
``XADD th:{run}:ledger json=<snapshot>`` plus ``SET th:{run}:ledger:latest``, and
recommendations from the real :class:`trainhealth.detectors.advisor.RollbackAdvisor` stored as
``Recommendation.to_dict()`` + ``status``/``created_at``/``updated_at`` in
``th:{run}:recommendations``. The pages are rendered with AppTest; the last test drives a real
``streamlit run`` in headless Chromium and saves screenshots under ``tests/artifacts/``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import runpy
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import redis
from streamlit.testing.v1 import AppTest

from trainhealth.anomaly import Anomaly
from trainhealth.dashboard import cards, charts, data
from trainhealth.dashboard.common import RATE_YOUNGER_HELP, markdown_table, os_user, rates_table
from trainhealth.detectors.advisor import Checkpoint, RollbackAdvisor
from trainhealth.keys import RUNS, run_keys, service_heartbeat
from trainhealth.recommendations import Recommendation

pytestmark = pytest.mark.usefixtures("fresh_streamlit_caches")

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
#: Who a change made from the dashboard is recorded as, without a login (docs/security.md).
ACTOR = f"{os_user()} (no login)"
T0 = 1796000000.0  # 2026-11-30 00:53:20 UTC
RUN = "gpt-13b"
WORLD = 64
PRICE = 2.5
TOKENS_PER_STEP = 524_288  # 64 ranks x 8,192 tokens
#: Cumulative seconds per ledger category at T0 + 1200, + 2400 and + 3600 (each sums to the wall time).
SECONDS = [
    {"productive": 900.0, "program_startup": 120.0, "data_loading": 60.0, "checkpoint_save": 30.0, "custom": 40.0,
     "idle": 50.0},
    {"productive": 1840.0, "program_startup": 120.0, "data_loading": 120.0, "checkpoint_save": 60.0,
     "wasted_progress_from_rollback": 80.0, "custom": 110.0, "idle": 70.0},
    {"productive": 2710.0, "program_startup": 120.0, "data_loading": 180.0, "checkpoint_save": 90.0,
     "checkpoint_restore": 30.0, "wasted_progress_from_rollback": 240.0, "custom": 150.0, "idle": 80.0},
]
CUSTOM_BY_NAME = [{"evaluation": 40.0}, {"evaluation": 80.0, "profiling": 30.0},
                  {"evaluation": 110.0, "profiling": 40.0}]
#: (steps done, steps kept): 10 s steps; 8 then 24 steps were discarded by rollbacks.
STEPS = [(96, 96), (204, 196), (313, 289)]
RATES = [
    {"60s": (52_428.8, 52_428.8), "600s": (52_428.8, 41_000.0), "3600s": (52_428.8, 41_943.04)},
    {"60s": (52_428.8, 0.0), "600s": (52_428.8, 40_000.0), "3600s": (52_428.8, 42_000.0)},
    {"60s": (51_200.0, 26_214.4), "600s": (52_000.0, 38_010.88), "3600s": (52_428.8, 42_088.675556)},
]
ZERO = ["straggler_wait", "communication", "skipped_steps", "wasted_progress_from_disruption",
        "infrastructure_recovery_from_disruption", "hang"]


def snapshot(i: int, price: float | None = PRICE, t0: float = T0) -> dict:
    """Snapshot ``i`` exactly as ``GoodputLedger.snapshot`` lays it out (docs/goodput.md)."""
    wall = 1200.0 * (i + 1)
    sec = {c: SECONDS[i].get(c, 0.0) for c in data.LEDGER_CATEGORIES}
    done, kept = STEPS[i]
    step_s = sum(sec[c] for c in ("productive", "data_loading", "straggler_wait", "skipped_steps",
                                  "wasted_progress_from_disruption", "wasted_progress_from_rollback"))
    gh = {k: v * WORLD / 3600.0 for k, v in sec.items()}
    cost = {k: v * price for k, v in gh.items()} if price is not None else None
    return {"t": t0 + wall, "started_at": t0, "wall_s": wall, "world_size": WORLD, "gpu_hour_usd": price,
            "last_step": kept, "steps_done": done, "steps_good": kept, "restarts": 1 if i else 0,
            "tokens_total": done * TOKENS_PER_STEP, "tokens_good": kept * TOKENS_PER_STEP, "step_s": step_s,
            "throughput_tok_s": done * TOKENS_PER_STEP / step_s, "goodput_tok_s": kept * TOKENS_PER_STEP / wall,
            "goodput_pct": round(100.0 * sec["productive"] / wall, 6),
            "rates": {w: {"throughput_tok_s": thr, "goodput_tok_s": good} for w, (thr, good) in RATES[i].items()},
            "seconds": sec, "custom_by_name": CUSTOM_BY_NAME[i], "gpu_hours": gh, "cost_usd": cost,
            "badput_cost_usd": sum(v for k, v in cost.items() if k != "productive") if cost else None}


def advice_anomalies() -> list[Anomaly]:
    """Two recovered spikes, the open spike at 250 (50 steps: roll back), the young one at 290 (wait), a NaN."""
    old = [Anomaly("loss_spike", "warning", s, f"loss spike at step {s}", end_step=s + 3, status="resolved",
                   evidence={"recovered": True}) for s in (60, 180)]
    return [*old, Anomaly("loss_spike", "warning", 250, "loss 5.20 at step 250 is 9.1 MADs above the median 2.31"),
            Anomaly("loss_spike", "warning", 290, "loss 4.70 at step 290 is 7.3 MADs above the median 2.30"),
            Anomaly("nan_inf", "critical", 20, "loss is NaN at step 20")]


def advice() -> dict[str, Recommendation]:
    """Recommendations from the real advisor: a rollback, a younger spike to wait on, a NaN without checkpoint."""
    adv = RollbackAdvisor()
    ckpts = [Checkpoint(s, consumed_samples=(s + 1) * 512, batch_index=s) for s in (49, 99, 149, 199, 249)]
    *old, spike, young, nan = advice_anomalies()
    kw = {"run": RUN, "checkpoints": ckpts, "current_step": 300, "step_s": 10.0, "world_size": WORLD,
          "gpu_hour_usd": PRICE, "data_positions": {}}
    history = [*old, spike, young]
    return {"rollback": adv.advise(spike, history=history, **kw), "wait": adv.advise(young, history=history, **kw),
            "none": adv.advise(nan, history=[nan], **kw)}


def store(r: redis.Redis, rec: Recommendation, status: str, created: float, updated: float,
          history: list[dict] | None = None) -> None:
    """Write ``rec`` as the detector service does (``DetectorService._write_recommendation``)."""
    d = rec.to_dict()
    d["status"] = status
    if history:
        d["history"] = history
    d["created_at"], d["updated_at"] = created, updated
    r.hset(run_keys(rec.run).recommendations, rec.id, json.dumps(d, sort_keys=True))


def seed_steps(r: redis.Redis, t0: float) -> None:
    """Aggregated steps 1-300 (10 s each from t0 + 120) with the loss spikes the advice is about, and the anomalies."""
    k = run_keys(RUN)
    for s in range(1, 301):
        bump = {60: 1.2, 61: 0.8, 62: 0.3, 180: 1.0, 181: 0.5}.get(s, 0.0)
        bump += 2.6 if 250 <= s < 290 else 0.0
        bump += 1.9 if s >= 290 else 0.0
        loss = 1.5 + 3.0 * math.exp(-s / 120) + 0.02 * math.sin(s) + bump
        t_start = t0 + 120 + 10 * (s - 1)
        r.xadd(k.agg, {"step": s, "gen": 0, "t_start": repr(t_start), "t_end": repr(t_start + 10.0), "dur": "10.0",
                       "loss": repr(round(loss, 4)), "grad_norm": repr(round(0.8 + bump, 3)), "lr": "0.0003",
                       "tokens": TOKENS_PER_STEP, "samples": 512, "n_ranks": WORLD, "data_s": "0.5"},
               id=f"1-{s}")
    for a in advice_anomalies():
        if a.kind == "nan_inf":  # over by now (the advice about it was dismissed)
            a = dataclasses.replace(a, status="resolved", end_step=21)
        d = json.loads(a.to_json())
        d.update({"run": RUN, "first_seen": t0 + 120 + 10 * a.step, "last_seen": t0 + 3100})
        r.hset(k.anomalies, a.id, json.dumps(d))


def seed(r: redis.Redis, price: float | None = PRICE, recs: bool = True, t0: float = T0,
         steps: bool = False) -> dict[str, Recommendation]:
    """The run: meta, three ledger snapshots, and (with ``recs``) the three recommendations; with
    ``steps`` also the aggregated steps and anomalies (for the Overview's charts). ``t0`` = run start."""
    k = run_keys(RUN)
    r.zadd(RUNS, {RUN: t0})
    meta = {"name": RUN, "world_size": str(WORLD), "started_at": repr(t0), "status": "running",
            "updated_at": repr(t0 + 3600)}
    if price is not None:
        meta["gpu_hour_usd"] = repr(price)
    r.hset(k.meta, mapping=meta)
    snaps = [snapshot(i, price, t0) for i in range(3)]
    for snap in snaps:
        body = json.dumps(snap)
        r.xadd(k.ledger, {"t": repr(snap["t"]), "json": body})
    r.set(k.ledger_latest, json.dumps(snaps[-1]))
    if steps:
        seed_steps(r, t0)
    out = advice()
    if recs:
        store(r, out["rollback"], "proposed", t0 + 3000, t0 + 3590)
        store(r, out["wait"], "proposed", t0 + 3500, t0 + 3595)
        store(r, out["none"], "dismissed", t0 + 300, t0 + 400,
              history=[{"t": t0 + 400, "status": "dismissed", "by": "alice", "note": "bad batch, fixed"}])
    return out


def service_beat(r: redis.Redis, consumer: str = "svc-1") -> None:
    r.set(service_heartbeat(consumer), json.dumps({"pid": 1, "host": "h", "t": time.time(), "runs": 1}), ex=30)



@pytest.fixture
def seeded(r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Recommendation]:
    out = seed(r)
    service_beat(r)
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    return out


def app(page: str | None = None) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params["run"] = RUN
    at.run()
    if page:
        at.switch_page(page).run()
    assert not at.exception, at.exception
    return at


def goodput_page() -> AppTest:
    return app("pages/goodput.py")


def metrics(at: AppTest) -> dict[str, tuple[str, str | None]]:
    return {m.label: (m.value, m.proto.delta or None) for m in at.metric}


def figures(at: AppTest) -> dict[str, dict]:
    """Plotly figures by their widget key (the element id ends with ``-<key>``)."""
    return {el.proto.id.rsplit("-", 1)[-1]: json.loads(el.proto.spec) for el in at.get("plotly_chart")}


def arr(v: list | dict) -> list:
    """A Plotly JSON array: a list, or a base64 typed array ``{"dtype", "bdata"}``."""
    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def markdowns(at: AppTest) -> list[str]:
    return [m.value for m in at.markdown]


def stored(r: redis.Redis, rec_id: str) -> dict:
    return json.loads(r.hget(run_keys(RUN).recommendations, rec_id))


def badput_s(i: int = 2) -> dict[str, float]:
    return {c: v for c, v in SECONDS[i].items() if c != "productive"}


#: The caption under each throughput-vs-goodput chart.
GAP_NOTE = ("Shaded gap = tokens recomputed or discarded (redone, rolled-back, skipped steps) and time outside "
            "steps (start-up, checkpoints, restarts, hangs, idle). Straggler wait and data loading slow both curves "
            "alike, so they are not in the gap: see Goodput (time) and the badput by cause.")
GPU_H_PER_S = WORLD / 3600.0
#: The final snapshot's causes of badput, most expensive first (custom split into its names).
CAUSES = [("wasted_progress_from_rollback", "wasted_progress_from_rollback", 240.0),
          ("data_loading", "data_loading", 180.0), ("program_startup", "program_startup", 120.0),
          ("evaluation", "custom", 110.0), ("checkpoint_save", "checkpoint_save", 90.0), ("idle", "idle", 80.0),
          ("profiling", "custom", 40.0), ("checkpoint_restore", "checkpoint_restore", 30.0)]


# --- data.py -------------------------------------------------------------------------------

def test_ledger_history_has_every_category_and_the_rolling_rates(seeded: dict, r: redis.Redis) -> None:
    hist = data.ledger_history(r, RUN)
    assert list(hist["t"]) == [T0 + 1200, T0 + 2400, T0 + 3600]
    assert list(hist["wall_s"]) == [1200.0, 2400.0, 3600.0]
    for c in data.LEDGER_CATEGORIES:
        assert list(hist[f"seconds.{c}"]) == [SECONDS[i].get(c, 0.0) for i in range(3)], c
    assert list(hist["rate.60s.throughput_tok_s"]) == [52_428.8, 52_428.8, 51_200.0]
    assert list(hist["rate.60s.goodput_tok_s"]) == [52_428.8, 0.0, 26_214.4]
    assert list(hist["rate.600s.goodput_tok_s"]) == [41_000.0, 40_000.0, 38_010.88]
    assert list(hist["rate.3600s.goodput_tok_s"]) == [41_943.04, 42_000.0, 42_088.675556]
    assert list(hist["goodput_tok_s"]) == pytest.approx([96 * 524_288 / 1200, 196 * 524_288 / 2400,
                                                        289 * 524_288 / 3600])
    # Thinned to two points: the oldest and the newest snapshot.
    assert list(data.ledger_history(r, RUN, max_points=2)["t"]) == [T0 + 1200, T0 + 3600]


def test_long_history_is_one_window_thinned_evenly(r: redis.Redis) -> None:
    k = run_keys("long")
    for i in range(1000):
        wall = 2.0 * (i + 1)
        r.xadd(k.ledger, {"json": json.dumps({"t": T0 + wall, "wall_s": wall, "seconds": {"productive": wall}})})
    hist = data.ledger_history(r, "long", count=1000, max_points=100)
    assert len(hist) == 100
    assert (hist["t"].iloc[0], hist["t"].iloc[-1]) == (T0 + 2.0, T0 + 2000.0)
    assert set((hist["t"].diff().dropna()).round(6)) == {20.0, 22.0}  # evenly spaced: every 10th or 11th
    assert list(hist["seconds.productive"]) == list(hist["wall_s"])  # cumulative values kept exactly
    # COUNT bounds the read to the newest entries.
    recent = data.ledger_history(r, "long", count=500, max_points=100)
    assert (recent["t"].iloc[0], recent["t"].iloc[-1], len(recent)) == (T0 + 1002.0, T0 + 2000.0, 100)
    assert len(data.ledger_history(r, "long", count=50, max_points=100)) == 50


def test_with_latest_appends_a_newer_snapshot_and_new_categories(seeded: dict, r: redis.Redis) -> None:
    hist = data.ledger_history(r, RUN, count=2)
    assert data.with_latest(hist, snapshot(2)) is hist  # the same snapshot: nothing to add
    assert data.with_latest(hist, None) is hist
    newer = snapshot(2)
    newer.update(t=T0 + 3602.0, wall_s=3602.0, seconds={**newer["seconds"], "new_kind": 2.0})
    out = data.with_latest(hist, newer)
    assert list(out["t"]) == [T0 + 2400, T0 + 3600, T0 + 3602]
    assert list(out["seconds.new_kind"]) == [0.0, 0.0, 2.0]  # 0 s before the category existed
    assert list(out["rate.60s.goodput_tok_s"]) == [0.0, 26_214.4, 26_214.4]
    assert charts.ledger_categories(out)[-1] == "new_kind"


def test_badput_by_cause_in_usd_and_gpu_hours(seeded: dict, r: redis.Redis) -> None:
    snap = data.ledger_latest(r, RUN)
    causes = data.badput_by_cause(snap)
    assert list(causes.columns) == data.CAUSE_COLUMNS
    lost = causes[causes["seconds"] > 0]
    assert list(zip(lost["category"], lost["ledger_category"], lost["seconds"], strict=True)) == CAUSES
    assert list(lost["gpu_hours"]) == pytest.approx([s * GPU_H_PER_S for *_, s in CAUSES])
    assert list(lost["cost_usd"]) == pytest.approx([s * GPU_H_PER_S * PRICE for *_, s in CAUSES])
    assert list(causes.loc[causes["seconds"] == 0, "category"]) == ZERO
    assert causes["cost_usd"].sum() == pytest.approx(snap["badput_cost_usd"]) == pytest.approx(890 * 64 / 3600 * 2.5)
    assert causes["gpu_hours"].sum() == pytest.approx(890 * 64 / 3600)
    # The overview's breakdown is the same rows without the GPU-hours.
    assert data.badput_seconds(snap).equals(causes[["category", "seconds", "cost_usd"]])
    # No price: GPU-hours stay, USD is NaN; no gpu_hours written: recomputed from seconds × world size.
    bare = {**snapshot(2, price=None), "gpu_hours": None}
    free = data.badput_by_cause(bare)
    assert free["cost_usd"].isna().all()
    assert list(free["gpu_hours"][:8]) == pytest.approx([s * GPU_H_PER_S for *_, s in CAUSES])


def test_recommendations_read_and_open_ones_newest_proposal_first(seeded: dict, r: redis.Redis) -> None:
    recs = data.recommendations(r, RUN)
    ids = {k: v.id for k, v in seeded.items()}
    assert [d["id"] for d in recs] == [ids["wait"], ids["rollback"], ids["none"]]  # newest update first
    assert recs[0] == {**seeded["wait"].to_dict(), "status": "proposed", "created_at": T0 + 3500,
                       "updated_at": T0 + 3595}
    assert [d["id"] for d in data.open_recommendations(recs)] == [ids["wait"], ids["rollback"]]
    # The service refreshes the figures of the older one: it is updated last, still shown second.
    store(r, seeded["rollback"], "acknowledged", T0 + 3000, T0 + 3700)
    recs = data.recommendations(r, RUN)
    assert [d["id"] for d in recs][:2] == [ids["rollback"], ids["wait"]]
    assert [d["id"] for d in data.open_recommendations(recs)] == [ids["wait"], ids["rollback"]]
    # An undecodable value does not hide the others.
    r.hset(run_keys(RUN).recommendations, "rec:broken", "{not json")
    assert [d["id"] for d in data.recommendations(r, RUN)] == [ids["rollback"], ids["wait"], ids["none"]]
    assert data.recommendations(r, "ghost") == []


# --- the card's parts ------------------------------------------------------------------------

def test_card_facts_status_line_and_exports(seeded: dict) -> None:
    rb = {**seeded["rollback"].to_dict(), "status": "acknowledged", "created_at": T0 + 3000, "updated_at": T0 + 3590,
          "history": [{"t": T0 + 3300, "status": "acknowledged", "by": "dashboard", "note": ""}]}
    assert cards.facts(rb) == [
        "**Checkpoint**  \nload step 149",
        "**Skip** (inclusive)  \nsteps 150–450 (301)  \nsamples 76,800–230,911  \nbatches 150–450",
        "**Rolling back costs**  \n151 steps recomputed  \n26.8 GPU-h · $67.11  \n25.2 min of the run's time",
        "**Continuing costs**  \n51 steps wasted so far  \n9.07 GPU-h · $22.67  \nthen 64 GPU-h · $160 per hour"]
    # 151 steps x 10 s x 64 GPUs / 3600 = 26.84 GPU-hours, x $2.5 = $67.11; 51 steps = 9.07 GPU-h = $22.67.
    assert rb["cost"]["gpu_hours"] == pytest.approx(151 * 10 * 64 / 3600)
    assert rb["continue_cost"]["usd"] == pytest.approx(51 * 10 * 64 / 3600 * 2.5)
    assert cards.status_line(rb, "UTC", T0 + 3600) == (
        "Status **acknowledged** · proposed 11-30 01:43:20 → acknowledged by dashboard 11-30 01:48:20 (UTC) · "
        "figures of step 300, updated 10 s ago")
    wait = seeded["wait"].to_dict()
    assert cards.facts(wait)[0] == "**Checkpoint**  \nload step 149  \nre-check at step 340"
    assert cards.facts(wait)[2].startswith("**If rolled back**  \n151 steps recomputed")
    megatron, skip = cards.exports(rb)
    assert megatron == "--ckpt-step 149 --train-range-to-skip 150 450 --iterations-to-skip " + " ".join(
        str(i) for i in range(150, 451))
    assert skip == {"version": 1, "run": RUN, "resume_from_step": 149, "skip_steps": [150, 450],
                    "skip_batches": [150, 451], "skip_samples": [76_800, 230_912]}
    none = seeded["none"].to_dict()
    assert none["action"] == "none_possible" and cards.facts(none)[0] == "**Checkpoint**  \nnone before the onset"
    assert cards.exports(none)[0] is None  # nothing to load: no Megatron arguments
    # Without a price: GPU-hours only; without a step time: said so.
    assert cards._cost_line({"gpu_hours": 2.0, "usd": None}) == "2.00 GPU-h"
    assert cards._cost_line({"steps": 3, "gpu_hours": None}) == "step time unknown"


def test_card_headline_and_facts_format_a_small_cost_alike(r: redis.Redis, redis_url: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A demo-sized rollback (8 GPUs, 0.1 s steps): the headline said 0.0 GPU-hours, $0 beside 0.04 GPU-h · $0.09."""
    spike = Anomaly("divergence", "critical", 200, "diverging")
    rec = RollbackAdvisor().advise(spike, run=RUN, checkpoints=[Checkpoint(99)], current_step=268, step_s=0.1,
                                   world_size=8, gpu_hour_usd=PRICE, data_positions={}, history=[spike])
    # 169 steps x 0.1 s x 8 GPUs / 3600 = 0.0376 GPU-hours, x $2.5 = $0.094; 69 wasted = 0.015 GPU-h = $0.038.
    assert rec.summary == ("Roll back to the checkpoint of step 99 and skip the batches of steps 100-400: "
                           "recomputes 169 steps (0.04 GPU-hours, $0.09, 17 s of the run's time)")
    facts = cards.facts(rec.to_dict())
    assert facts[2] == ("**Rolling back costs**  \n169 steps recomputed  \n0.04 GPU-h · $0.09  \n"
                        "17 s of the run's time")
    assert facts[3].split("  \n")[2] == "0.02 GPU-h · $0.04"
    # Below a hundredth: two significant digits instead of 0.00 (1 step of 0.1 s on 8 GPUs).
    assert cards._cost_line({"gpu_hours": 8 * 0.1 / 3600, "usd": 8 * 0.1 / 3600 * PRICE}) == "0.00022 GPU-h · $0.00056"
    store(r, rec, "proposed", T0 + 3000, T0 + 3590)
    r.zadd(RUNS, {RUN: T0})
    r.hset(run_keys(RUN).meta, mapping={"name": RUN, "world_size": "8", "status": "running", "started_at": repr(T0)})
    service_beat(r)
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    at = goodput_page()
    assert card_summaries(at) == [rec.summary]
    assert facts[2] in markdowns(at) and facts[3] in markdowns(at)  # the card shows the same figures


# --- the Goodput page (AppTest) ----------------------------------------------------------------

def test_goodput_page_kpis_rates_and_summary(seeded: dict) -> None:
    at = goodput_page()
    assert at.session_state["th_run"] == RUN and at.query_params["run"] == RUN
    # 2,710 of 3,600 s productive; 313 steps x 524,288 tokens in 3,130 s of steps; 289 kept in 3,600 s;
    # 890 s of badput x 64 GPUs / 3600 = 15.8 GPU-h, x $2.5 = $39.56.
    assert metrics(at) == {
        "Goodput (time)": ("75.3%", "productive time"),
        "Goodput (tokens)": ("42,089", "tokens/s · whole run"),
        "Throughput": ("52,429", "tokens/s · whole run"),
        "Badput cost": ("$39.56", "at $2.5/GPU-h"),
        "Badput GPU-h": ("15.8", "of 64.0 GPU-h"),
    }
    # Each says what it is: the time share, the kept tokens per wall second, and what the gap leaves out.
    helps = {m.label: m.help for m in at.metric}
    assert helps["Goodput (time)"] == (
        "Goodput (time) = productive seconds ÷ wall seconds since the run started: the productive share of wall "
        "time, as Google's ML goodput counts it. Every kind of badput lowers it, waits inside steps (straggler wait, "
        "data loading) included; the breakdown of wall time shows which.")
    assert helps["Goodput (tokens)"] == (
        "Goodput tokens/s = tokens of the steps the model keeps ÷ wall seconds since the run started. Throughput − "
        "goodput is tokens recomputed or discarded (redone, rolled-back or skipped steps) plus time outside steps "
        "(start-up, checkpoints, restarts, hangs, idle). Badput inside steps (straggler wait, data loading) slows "
        "throughput and goodput alike, so it is not in that gap: it shows in Goodput (time) and the breakdown of "
        "wall time.")
    assert helps["Throughput"] == (
        "Throughput tokens/s = all tokens processed ÷ seconds spent inside steps (straggler and data waits, skipped "
        "steps and steps later redone included): the tokens/s a framework prints. Tokens counted for time with no "
        "step time in the records (an untimed first step, skipped stretches of a log) are left out of both rates.")
    # A markdown table (the data grid's JavaScript would hold back the charts below it), figures right-aligned.
    assert [m.value for m in at.main.markdown if m.value.startswith("| tokens/s")] == [
        "| tokens/s | whole run | last 1 min | last 10 min | last 1 h |\n"
        "|---|---:|---:|---:|---:|\n"
        "| throughput | 52,429 | 51,200 | 52,000 | 52,429 |\n"
        "| goodput | 42,089 | 26,214 | 38,011 | 42,089 |"]
    assert RATE_YOUNGER_HELP not in [c.value for c in at.main.caption]  # every window is within the run's hour
    assert [list(d.value.columns)[:2] for d in at.dataframe] == [["status", "action"]]  # closed advice only
    summary = next(c.value for c in at.main.caption if c.value.startswith("wall time"))
    assert summary.startswith("wall time 60 min · productive 45 min · badput 15 min · 64 GPUs at $2.5/GPU-hour · "
                              "1 restart · ledger snapshot ")
    assert not at.warning  # the service heartbeat is fresh: no banner


def test_goodput_page_charts(seeded: dict) -> None:
    at = goodput_page()
    figs = figures(at)
    assert list(figs) == ["breakdown", "tokens", "cost"]

    area = figs["breakdown"]
    # Categories at 0 s in every snapshot are left out; productive first (the bottom band), in green.
    assert [t["name"] for t in area["data"]] == [
        "productive", "program startup", "data loading", "checkpoint save", "checkpoint restore",
        "wasted progress from rollback", "custom (evaluation, profiling)", "idle"]
    assert {t["stackgroup"] for t in area["data"]} == {"ledger"}
    assert [t["fillcolor"] for t in area["data"]] == [
        "#2ca02c", "#9467bd", "#1f77b4", "#17becf", "#9edae5", "#ff9896", "#e7ba52", "#b0b0b0"]
    shares = {t["name"]: arr(t["y"]) for t in area["data"]}
    assert shares["productive"] == pytest.approx([75.0, 1840 / 24, 2710 / 36])
    assert shares["wasted progress from rollback"] == pytest.approx([0.0, 80 / 24, 240 / 36])
    assert shares["checkpoint restore"] == pytest.approx([0.0, 0.0, 30 / 36])
    assert [sum(v) for v in zip(*shares.values(), strict=True)] == pytest.approx([100.0, 100.0, 100.0])
    assert arr(area["data"][0]["customdata"]) == [900.0, 1840.0, 2710.0]  # seconds, for the hover
    # Productive never drops below 75 %: the axis starts at 60 % so the badput bands get room.
    assert area["layout"]["yaxis"]["range"] == [60.0, 100]
    assert area["layout"]["yaxis"]["title"]["text"] == "% of wall time (axis from 60 %)"
    assert area["data"][0]["x"][-1] == "2026-11-30T01:53:20.000000"  # T0 + 3600 s, in UTC

    tokens = figs["tokens"]
    assert [t["name"] for t in tokens["data"]] == [
        "throughput · since start", "goodput · since start", "gap = discarded tokens + pauses",
        "throughput · last 1 min", "goodput · last 1 min"]
    assert arr(tokens["data"][3]["y"]) == [52_428.8, 52_428.8, 51_200.0]
    assert arr(tokens["data"][4]["y"]) == [52_428.8, 0.0, 26_214.4]
    assert arr(tokens["data"][1]["y"]) == pytest.approx([96 * TOKENS_PER_STEP / 1200, 196 * TOKENS_PER_STEP / 2400,
                                                         289 * TOKENS_PER_STEP / 3600])

    assert GAP_NOTE in [c.value for c in at.main.caption]  # under the token chart
    cost = figs["cost"]["data"][0]
    # Most expensive on top (Plotly draws the first bar at the bottom); custom split into its names.
    assert cost["y"] == [charts.label(c) for c, *_ in reversed(CAUSES)]
    assert arr(cost["x"]) == pytest.approx([s * GPU_H_PER_S * PRICE for *_, s in reversed(CAUSES)])
    assert cost["text"][::-1] == ["$10.67 · 4.27 GPU-h", "$8.00 · 3.20 GPU-h", "$5.33 · 2.13 GPU-h",
                                  "$4.89 · 1.96 GPU-h", "$4.00 · 1.60 GPU-h", "$3.56 · 1.42 GPU-h",
                                  "$1.78 · 0.71 GPU-h", "$1.33 · 0.53 GPU-h"]
    assert cost["marker"]["color"][::-1] == [charts.CATEGORY_COLORS[lc] for _, lc, _ in CAUSES]
    assert figs["cost"]["layout"]["title"]["text"] == "Money lost per cause (USD since start)"
    assert at.main.caption[-1].value == ("Nothing lost to straggler wait, communication, skipped or NaN steps, wasted "
                                         "progress from disruption, infrastructure recovery from disruption, hang.")
    charts_caption = "the last 1 h of ledger snapshots (times in UTC); each snapshot covers the run since it started."
    assert [c.value for c in at.main.caption if c.value.startswith("Charts:")] == [f"Charts: {charts_caption}"]

    # The 6 h window: another (cached longer) read of the same stream; three snapshots either way.
    at.segmented_control(key="goodput_window").select("6 h").run()
    assert not at.exception
    assert [c.value for c in at.main.caption if c.value.startswith("Charts:")] == [
        "Charts: " + charts_caption.replace("1 h", "6 h")]
    assert arr(figures(at)["breakdown"]["data"][0]["customdata"]) == [900.0, 1840.0, 2710.0]


def is_card_head(text: str) -> bool:
    """A recommendation card's heading: its status badge (the run's state line has badges too)."""
    return re.search(r"-badge\[(proposed|acknowledged|applied|dismissed)\]", text) is not None


def card_summaries(at: AppTest) -> list[str]:
    """The summaries shown, in card order (the markdown right after each card's heading)."""
    texts = markdowns(at)
    return [texts[i + 1] for i, t in enumerate(texts) if is_card_head(t)]


def test_goodput_page_cards_and_acknowledge(seeded: dict, r: redis.Redis) -> None:
    at = goodput_page()
    wait, rollback = seeded["wait"], seeded["rollback"]
    # Open recommendations, newest proposal first; the dismissed one has no card.
    assert card_summaries(at) == [wait.summary, rollback.summary]
    assert rollback.summary == ("Roll back to the checkpoint of step 149 and skip the batches of steps 150-450: "
                                "recomputes 151 steps (26.8 GPU-hours, $67.11, 25.2 min of the run's time)")
    heads = [t for t in markdowns(at) if is_card_head(t)]
    assert heads == [
        ":orange-badge[:material/hourglass_top: Wait] :blue-badge[proposed] **Loss spike at step 290** · now step 300",
        ":red-badge[:material/history: Roll back] :blue-badge[proposed] **Loss spike at step 250** · now step 300"]
    assert [(b.label, b.disabled) for b in at.button] == [("Acknowledge", False), ("Mark applied", False),
                                                         ("Dismiss", False)] * 2
    assert [c.value for c in at.get("code")][2] == seeded["rollback"].megatron_args()
    assert json.loads([c.value for c in at.get("code")][3]) == seeded["rollback"].lightning_skip()
    reasoning = [t for t in markdowns(at) if t.startswith("1. loss_spike since step 250")]
    assert reasoning == ["\n".join(f"{i}. {line}" for i, line in enumerate(rollback.reasoning, 1))]
    options = [t for t in markdowns(at) if t.startswith("**Options**")]
    assert len(options) == 2 and options[1].splitlines()[2] == (
        "- 4 spikes in the last 5000 steps — lower the peak learning rate (e.g. by 30-50 %) when restarting")

    before = time.time()
    at.button(key=cards.button_key("goodput", "acknowledged", rollback.id)).click().run()
    assert not at.exception
    d = stored(r, rollback.id)
    assert d["status"] == "acknowledged"
    assert d["history"][-1]["by"] == ACTOR and d["history"][-1]["status"] == "acknowledged"
    assert before <= d["history"][-1]["t"] <= time.time()
    assert stored(r, wait.id)["status"] == "proposed"  # the other card is untouched
    # The card re-read Redis: still shown, now acknowledged, its Acknowledge button disabled.
    assert card_summaries(at) == [wait.summary, rollback.summary]
    assert [b.disabled for b in at.button] == [False, False, False, True, False, False]
    assert ":violet-badge[acknowledged]" in [t for t in markdowns(at) if is_card_head(t)][1]
    assert [t.value for t in at.toast] == ["Recommendation acknowledged."]
    status = [c.value for c in at.caption if c.value.startswith("Status **acknowledged**")]
    assert len(status) == 1 and f" → acknowledged by {ACTOR} " in status[0]


def test_dismissed_and_applied_recommendations_leave(seeded: dict, r: redis.Redis) -> None:
    wait, rollback = seeded["wait"], seeded["rollback"]
    at = app()  # the Overview: the cards sit on top
    assert card_summaries(at) == [wait.summary, rollback.summary]
    at.button(key=cards.button_key("overview", "dismissed", wait.id)).click().run()
    assert not at.exception
    assert stored(r, wait.id)["status"] == "dismissed"
    assert stored(r, wait.id)["history"][-1]["by"] == ACTOR
    assert card_summaries(at) == [rollback.summary]
    assert [b.label for b in at.button] == ["Acknowledge", "Mark applied", "Dismiss"]

    at.switch_page("pages/goodput.py").run()
    assert card_summaries(at) == [rollback.summary]
    at.button(key=cards.button_key("goodput", "applied", rollback.id)).click().run()
    assert stored(r, rollback.id)["status"] == "applied"
    assert card_summaries(at) == [] and not at.button
    # Both now listed with the dismissed one from before, newest decision first.
    closed = at.dataframe[0].value
    assert list(closed["status"]) == ["applied", "dismissed", "dismissed"]
    assert list(closed["summary"]) == [rollback.summary, wait.summary, seeded["none"].summary]
    assert list(closed["by"]) == [ACTOR, ACTOR, "alice"]
    assert at.expander[-1].label == "Closed recommendations (3)"
    assert closed["decided"].iloc[2] == pd.Timestamp(T0 + 400, unit="s", tz="UTC")  # alice's, from the seed
    assert closed["decided"].iloc[0] >= closed["decided"].iloc[1] > pd.Timestamp(T0 + 400, unit="s", tz="UTC")

    at.switch_page("pages/overview.py").run()
    assert card_summaries(at) == [] and not at.button


def test_a_failed_click_says_why(seeded: dict, r: redis.Redis) -> None:
    at = goodput_page()
    rollback = seeded["rollback"]
    r.hdel(run_keys(RUN).recommendations, rollback.id)  # removed meanwhile (a run cleaned up)
    at.button(key=cards.button_key("goodput", "dismissed", rollback.id)).click().run()
    assert not at.exception
    assert [e.value for e in at.error] == [
        f"Could not set `{rollback.id}` to dismissed: recommendation id={rollback.id!r} does not exist in run "
        f"{RUN!r}"]
    assert card_summaries(at) == [seeded["wait"].summary]


def test_goodput_page_without_a_price_shows_gpu_hours(r: redis.Redis, redis_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    seed(r, price=None, recs=False)
    service_beat(r)
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    at = goodput_page()
    assert metrics(at)["Badput cost"] == ("n/a", "no price set")
    assert metrics(at)["Badput GPU-h"] == ("15.8", "of 64.0 GPU-h")
    cost = figures(at)["cost"]
    assert cost["layout"]["title"]["text"] == "GPU-hours lost per cause (no GPU-hour price set)"
    assert arr(cost["data"][0]["x"]) == pytest.approx([s * GPU_H_PER_S for *_, s in reversed(CAUSES)])
    assert cost["data"][0]["text"][-1] == "4.27 GPU-h"
    assert "no GPU-hour price set" in at.main.caption[0].value
    assert not at.button  # no recommendation: no card


def test_goodput_page_before_the_first_snapshot(r: redis.Redis, redis_url: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    seed(r)
    r.delete(run_keys(RUN).ledger, run_keys(RUN).ledger_latest)
    service_beat(r)
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    at = goodput_page()
    assert [i.value for i in at.info] == [
        "No goodput ledger snapshot yet for this run. The detector service (`trainhealth serve`) writes one "
        "every 2 s once steps arrive."]
    assert not at.metric and not at.get("plotly_chart")
    assert len(at.button) == 6  # the recommendations are shown all the same


def test_goodput_page_is_listed_after_overview() -> None:
    import trainhealth.dashboard.frame as frame
    source = Path(frame.__file__).read_text()
    pages = [line.split('"pages" / "')[1].split('"')[0] for line in source.splitlines() if '"pages" / "' in line]
    assert pages[:3] == ["runs.py", "overview.py", "goodput.py"]  # Runs first (issue 16)


# --- in a real browser ---------------------------------------------------------------------------

_BROWSER = runpy.run_path(str(Path(__file__).with_name("test_dashboard_browser.py")))
ARTIFACTS: Path = _BROWSER["ARTIFACTS"]


def _fit_and_shoot(page: Any, name: str) -> None:
    """Grow the viewport to the page's content (Streamlit scrolls inside its main section, so a
    full-page screenshot would stop at the viewport) and save ``tests/artifacts/<name>``."""
    page.mouse.move(1, 1)  # no tooltip of the last button clicked in the picture
    page.wait_for_timeout(1000)  # let Plotly finish laying out
    height = page.evaluate("document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
    page.set_viewport_size({"width": page.viewport_size["width"], "height": int(height) + 40})
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def _wait_stored(r: redis.Redis, rec_id: str, status: str, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        d = stored(r, rec_id)
        if d["status"] == status or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def test_goodput_page_and_recommendation_card_in_chromium(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """The Goodput page and the Overview's card in headless Chromium; a click moves the stored status."""
    from playwright.sync_api import expect, sync_playwright

    _BROWSER["_require_chromium"]()
    recs = seed(r, t0=time.time() - 3600, steps=True)  # a run that started an hour ago, snapshots up to now
    rollback, wait = recs["rollback"], recs["wait"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with (_BROWSER["_service_alive"](r), _BROWSER["_streamlit"](redis_url, tmp_path) as base,
          sync_playwright() as pw):
        browser = _BROWSER["_launch"](pw)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1400}, timezone_id="UTC")
            page.set_default_timeout(_BROWSER["UI_TIMEOUT_MS"])
            page.goto(f"{base}/goodput?run={RUN}")
            expect(page.locator('[data-testid="stMetricValue"]')).to_have_count(5)
            assert _BROWSER["_kpis"](page) == {"Goodput (time)": "75.3%", "Goodput (tokens)": "42,089",
                                               "Throughput": "52,429", "Badput cost": "$39.56", "Badput GPU-h": "15.8"}
            assert _BROWSER["_overflowing"](
                page, '[data-testid="stMetricValue"] div, [data-testid="stMetricDelta"] div') == []
            nav = page.locator('[data-testid="stSidebarNav"] a').all_inner_texts()
            # the last word of each entry: its title after the icon
            assert [n.split()[-1] for n in nav] == ["Runs", "Overview", "Goodput", "Ranks", "Anomalies", "Alerts"]
            expect(page.locator(".js-plotly-plot")).to_have_count(3)
            for entry in ("productive", "custom (evaluation, profiling)", "wasted progress from rollback",
                          "throughput · last 1 min", "goodput · since start"):
                expect(page.locator("text.legendtext", has_text=entry)).to_have_count(1)
            expect(page.locator("g.ytick text", has_text="evaluation")).to_have_count(1)  # a cost bar
            expect(page.get_by_text("Money lost per cause (USD since start)")).to_be_visible()
            expect(page.get_by_text("Detector service not running")).to_have_count(0)
            card = page.locator(f".st-key-{cards.card_key('goodput', rollback.id)}")
            expect(card.get_by_text(rollback.summary)).to_be_visible()
            card.get_by_text("Why: the reasoning and options").click()
            card.get_by_text("Export for the launcher").click()
            expect(card.get_by_text("Options", exact=True)).to_be_visible()
            expect(card.locator("code", has_text="--train-range-to-skip 150 450")).to_be_visible()
            _fit_and_shoot(page, "dashboard_goodput.png")

            page.set_viewport_size({"width": 1440, "height": 1400})
            page.locator('[data-testid="stSidebarNav"]').get_by_text("Overview", exact=True).click()
            shown = page.locator('[class*="st-key-rec-card-overview-"]')
            expect(shown).to_have_count(2)
            card = page.locator(f".st-key-{cards.card_key('overview', rollback.id)}")
            card.get_by_role("button", name="Acknowledge").click()
            d = _wait_stored(r, rollback.id, "acknowledged")
            assert d["status"] == "acknowledged" and d["history"][-1]["by"] == ACTOR
            expect(card.get_by_role("button", name="Acknowledge")).to_be_disabled()
            expect(card.locator(".stMarkdownBadge", has_text="acknowledged")).to_be_visible()  # the status badge
            expect(page.locator(".js-plotly-plot")).to_have_count(3)
            _fit_and_shoot(page, "dashboard_overview_recommendation.png")

            page.locator(f".st-key-{cards.card_key('overview', wait.id)}").get_by_role("button", name="Dismiss").click()
            assert _wait_stored(r, wait.id, "dismissed")["status"] == "dismissed"
            expect(shown).to_have_count(1)
        finally:
            browser.close()


def test_run_picker_follows_the_page_when_the_run_ends_in_chromium(r: redis.Redis, redis_url: str,
                                                                   tmp_path: Path) -> None:
    """A run that ends while watched: the picker's label says finished with the page, no page switch needed
    (the picker is drawn on full runs only, the page's status by its 2 s live fragment)."""
    from playwright.sync_api import expect, sync_playwright

    _BROWSER["_require_chromium"]()
    seed(r, t0=time.time() - 3600, recs=False)
    with (_BROWSER["_service_alive"](r), _BROWSER["_streamlit"](redis_url, tmp_path) as base,
          sync_playwright() as pw):
        browser = _BROWSER["_launch"](pw)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000}, timezone_id="UTC")
            page.set_default_timeout(_BROWSER["UI_TIMEOUT_MS"])
            page.goto(f"{base}/?run={RUN}")
            picker = page.locator('[data-testid="stSidebar"] input[aria-label="Run"]')
            status = page.locator('[data-testid="stMain"] [data-testid="stCaptionContainer"]').first
            expect(status).to_contain_text("status running")
            expect(picker).to_have_value(f"running · {RUN}")
            r.hset(run_keys(RUN).meta, "status", "finished")
            expect(status).to_contain_text("status finished")
            expect(picker).to_have_value(f"finished · {RUN}")
            expect(page.locator('[data-testid="stSidebar"] [data-testid="stCaptionContainer"]').first).to_contain_text(
                "finished · 64 ranks")
            # On the Goodput page too (it shows no status line: the picker follows the run's meta).
            page.locator('[data-testid="stSidebarNav"]').get_by_text("Goodput", exact=True).click()
            expect(page.locator('[data-testid="stMetricValue"]')).to_have_count(5)
            r.hset(run_keys(RUN).meta, "status", "crashed")
            expect(picker).to_have_value(f"crashed · {RUN}")
        finally:
            browser.close()


def test_status_moved_only_for_a_change_of_the_same_run() -> None:
    from trainhealth.dashboard.common import status_moved

    assert [status_moved(None, RUN, "finished"), status_moved((RUN, "running"), RUN, "running"),
            status_moved((RUN, "running"), RUN, "finished"), status_moved(("other", "running"), RUN, "finished")] == [
        False, False, True, False]


def test_pages_note_the_status_the_picker_was_drawn_with(seeded: dict) -> None:
    at = goodput_page()
    assert at.session_state["th_status_seen"] == (RUN, "running")
    assert at.sidebar.selectbox[0].options == [f"running · {RUN}"]


def test_rates_table_says_when_a_window_is_longer_than_the_run() -> None:
    snap = {"wall_s": 300.0, "throughput_tok_s": 1000.0, "goodput_tok_s": 900.0,
            "rates": {"60s": {"throughput_tok_s": 1100.0, "goodput_tok_s": 1000.0},
                      "600s": {"throughput_tok_s": 1000.0, "goodput_tok_s": 900.0},
                      "3600s": {"throughput_tok_s": 1000.0, "goodput_tok_s": 900.0}}}
    table = rates_table(snap)
    # A one-character mark (the 96 px headers cut "last 10 min (run younger: whole run)"); its help says it.
    assert list(table.columns) == ["whole run", "last 1 min", "last 10 min*", "last 1 h*"]
    assert table.loc["goodput"].tolist() == ["900", "1,000", "900", "900"]
    # On the page, the mark is escaped (a markdown "*" would start emphasis) and its meaning said under the table.
    assert markdown_table(["tokens/s", *table.columns], [["goodput", *table.loc["goodput"]]]).splitlines()[0] == (
        "| tokens/s | whole run | last 1 min | last 10 min\\* | last 1 h\\* |")


def test_goodput_page_says_what_data_was_lost(r: redis.Redis, seeded: dict) -> None:
    # A run whose collectors dropped records (issue 15): the page must not read as if nothing was lost.
    k = run_keys(RUN)
    snap = json.loads(r.get(k.ledger_latest))
    assert not [w for w in goodput_page().warning if "Data lost" in w.value]  # a clean snapshot: no warning
    snap.update(records_dropped={"total": 1234, "buffer": 1200, "unencodable": 34, "by_rank": {"3": 1200, "5": 34}},
                steps_partial=12, coverage_pct=97.5)
    r.set(k.ledger_latest, json.dumps(snap))
    [warning] = [w.value for w in goodput_page().warning if "Data lost" in w.value]
    assert warning == ("**Data lost**: the collectors dropped 1,234 records on ranks 3, 5 (1,200 in the full "
                       "in-memory buffer, 34 not encodable); 12 steps closed without every rank's record. The figures "
                       "rest on 97.5% of the rank-steps.")
    snap.update(records_dropped={"total": 0, "by_rank": {}}, steps_partial=0, coverage_pct=100.0,
                history_lost={"before_step": 3729, "first_seen_t": T0, "ranks": [0, 1]})
    r.set(k.ledger_latest, json.dumps(snap))
    [warning] = [w.value for w in goodput_page().warning if "Data lost" in w.value]
    assert warning == ("**Data lost**: the run's history before step 3,729 is not in Redis (it restarted without its "
                       "data, or trimmed it): the figures cover the run from there. The figures rest on 100% of "
                       "the rank-steps.")


def test_goodput_page_shows_unobserved_time_apart_from_badput(r: redis.Redis, seeded: dict) -> None:
    # 30 min of steps the records skipped (a log's pasted blocks, records lost) on top of the seeded hour: a band
    # of its own in the breakdown, but no cause of badput and no cost.
    k = run_keys(RUN)
    snap = json.loads(r.get(k.ledger_latest))
    sec = {**snap["seconds"], "unobserved": 1800.0}
    gh = {c: v * WORLD / 3600.0 for c, v in sec.items()}
    snap.update(wall_s=5400.0, seconds=sec, gpu_hours=gh, cost_usd={c: v * PRICE for c, v in gh.items()},
                observed_s=3600.0, unobserved_gaps={"count": 2, "steps": 180, "largest": [120, 260]})
    r.set(k.ledger_latest, json.dumps(snap))
    r.xadd(k.ledger, {"t": repr(T0 + 5400.0), "json": json.dumps({**snap, "t": T0 + 5400.0})})
    at = goodput_page()
    assert metrics(at)["Badput GPU-h"] == ("15.8", "of 96.0 GPU-h")  # 890 s of badput; the 1,800 s are not
    assert metrics(at)["Badput cost"] == ("$39.56", "at $2.5/GPU-h")
    [note] = [i.value for i in at.info if "Unobserved" in i.value]
    assert note == ("**Unobserved**: 30 min (33.3% of the wall time) passed over 2 stretches of steps (180 steps) the "
                    "records do not cover (records lost, or a log's skipped stretches): the steps ran, but nothing "
                    "says how, so that time is neither productive nor badput. Of the 60 min the records cover, 75.3% "
                    "was productive.")
    summary = next(c.value for c in at.main.caption if c.value.startswith("wall time"))
    assert summary.startswith("wall time 90 min · productive 45 min · badput 15 min · unobserved 30 min · ")
    figs = figures(at)
    assert "unobserved" not in [y.strip() for y in figs["cost"]["data"][0]["y"]]
    band = next(tr for tr in figs["breakdown"]["data"] if tr["name"] == "unobserved")
    assert band["fillcolor"] == charts.CATEGORY_COLORS["unobserved"]
    assert arr(band["y"])[-1] == pytest.approx(100 * 1800 / 5400)
    assert "unobserved" not in set(data.badput_by_cause(snap)["category"])
