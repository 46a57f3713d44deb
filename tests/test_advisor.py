"""Rollback advisor: exact recommendations on scripted runs, stored in Redis with their lifecycle."""

from __future__ import annotations

import json

import pytest
import redis

from trainhealth import Monitor, recommendations
from trainhealth.anomaly import Anomaly
from trainhealth.detectors.advisor import Checkpoint, RollbackAdvisor
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import DetectorService
from trainhealth.exceptions import ConfigError
from trainhealth.text import fmt_cost, fmt_gpu_hours, fmt_usd

CKPTS = [Checkpoint(s, consumed_samples=(s + 1) * 256, batch_index=s) for s in range(199, 3000, 200)]


def advise(anomaly: Anomaly, current: int, history: list[Anomaly] | None = None, **kw):
    return RollbackAdvisor(**kw).advise(anomaly, run="r", checkpoints=CKPTS, current_step=current, step_s=4.0,
                                        world_size=1024, gpu_hour_usd=2.5, data_positions={},
                                        history=history or [anomaly])


def test_young_open_spike_waits_then_rolls_back() -> None:
    spike = Anomaly("loss_spike", "warning", 2510, "loss 6.1 at step 2510", evidence={"peak": 6.1})
    wait = advise(spike, 2520)
    assert (wait.action, wait.recheck_step, wait.checkpoint_step, wait.skip_steps) == ("wait", 2560, 2399, (2410, 2710))
    assert wait.summary.startswith("Loss spike at step 2510 may still recover: wait and re-check at step 2560")
    late = advise(spike, 2560)
    assert (late.action, late.recompute_steps, late.recheck_step) == ("rollback", 161, None)
    # 161 steps x 4 s x 1024 GPUs = 183.2 GPU-hours; x $2.5
    assert late.cost == pytest.approx({"steps": 161, "wall_hours": 161 * 4 / 3600,
                                       "gpu_hours": 161 * 4 / 3600 * 1024, "usd": 161 * 4 / 3600 * 1024 * 2.5})
    assert late.continue_cost["wasted_steps_so_far"] == 51 and late.continue_cost["usd_per_hour"] == 2560.0
    # data positions: samples after step 2409 and after step 2710, extrapolated from the checkpoints
    assert late.skip_samples == (2410 * 256, 2711 * 256) and late.skip_batches == (2410, 2711)


def test_cost_texts_use_one_format_for_small_and_large_costs() -> None:
    # 1 GPU at $2/h, 1 s steps: 251 steps = 0.0697 GPU-hours = $0.139 (was "0.1 GPU-hours, $0").
    rec = RollbackAdvisor().advise(Anomaly("divergence", "critical", 400, "d"), run="r",
                                   checkpoints=[Checkpoint(299)], current_step=550, step_s=1.0, world_size=1,
                                   gpu_hour_usd=2.0, data_positions={}, history=[])
    assert rec.summary.endswith("recomputes 251 steps (0.07 GPU-hours, $0.14, 4.2 min of the run's time)")
    assert rec.reasoning[-1].startswith("rollback recomputes 251 steps (1 s/step, 1 GPUs): 0.07 GPU-hours, $0.14, "
                                        "4.2 min of the run's time; continuing wastes every step from 400 on (151 so "
                                        "far, 0.04 GPU-hours, $0.08, 2.5 min of the run's time)")
    assert [fmt_gpu_hours(x) for x in (0.0, 0.00022, 0.0042, 0.0375, 0.5, 9.071, 12.34, 1234.6, None)] == [
        "0.00", "0.00022", "0.0042", "0.04", "0.50", "9.07", "12.3", "1,235", "—"]
    assert [fmt_usd(x) for x in (0.00056, 0.0939, 12.3, 1234.5, 123_456.0, float("nan"))] == [
        "$0.00056", "$0.09", "$12.30", "$1,234", "$123k", "—"]
    assert fmt_cost({"gpu_hours": 183.2, "usd": 458.0}) == "183.2 GPU-hours, $458.00"
    assert fmt_cost({"gpu_hours": 0.0375, "usd": None}, unit="GPU-h", sep=" · ") == "0.04 GPU-h"


def test_checkpoint_near_an_earlier_spike_is_passed_over() -> None:
    earlier = Anomaly("loss_spike", "warning", 2190, "old", end_step=2195, status="resolved",
                      evidence={"recovered": True})
    div = Anomaly("divergence", "critical", 2350, "diverging")
    rec = advise(div, 2400, history=[earlier, div])
    # 2199 is >= 100 steps before 2350 but the spike at 2190 is in its 50-step window: take 1999
    assert (rec.action, rec.checkpoint_step) == ("rollback", 1999)
    assert "free of loss anomalies" in rec.reasoning[1]


def test_no_checkpoint_before_onset_and_repeated_spike_options() -> None:
    div = Anomaly("divergence", "critical", 150, "diverging")
    rec = advise(div, 300)
    assert (rec.action, rec.checkpoint_step) == ("none_possible", None)
    spikes = [Anomaly("loss_spike", "warning", s, "s", status="resolved", end_step=s + 2,
                      evidence={"recovered": s != 2900}) for s in (1000, 1800, 2500, 2900)]
    rec = advise(spikes[-1], 2950, history=spikes)
    assert rec.options[0].split(" — ")[0] == "option: 4 spikes in the last 5000 steps"
    assert rec.options[1].startswith("option: tighten gradient clipping")
    assert "1000, 1800, 2500, 2900" in rec.options[2]


def test_export_formats() -> None:
    rec = advise(Anomaly("divergence", "critical", 2600, "d"), 2700)
    assert rec.megatron_args() == ("--ckpt-step 2399 --train-range-to-skip 2500 2800 --iterations-to-skip "
                                   + " ".join(str(i) for i in range(2500, 2801)))
    assert rec.lightning_skip() == {"version": 1, "run": "r", "resume_from_step": 2399, "skip_steps": [2500, 2800],
                                    "skip_batches": [2500, 2801], "skip_samples": [2500 * 256, 2801 * 256]}


T0 = 1_800_000_000.0


def test_service_stores_advice_with_the_anomaly_and_keeps_the_users_status(r: redis.Redis) -> None:
    mon = Monitor("adv", client=r, rank=0, world_size=1, started_at=T0, gpu_hour_usd=2.0, flush_interval=0.01)
    step = 0

    def run_steps(n: int, level=lambda s: 3.0) -> None:
        nonlocal step
        for _ in range(n):
            loss = level(step) + 0.001 * (step % 7)
            mon.log_step(step, loss=loss, tokens=1000, consumed_samples=(step + 1) * 8, timestamp=T0 + 10 + step)
            if (step + 1) % 100 == 0:
                mon.checkpoint_saved(step, 1.0)
            step += 1

    run_steps(400)
    run_steps(150, level=lambda s: 6.0)  # the loss jumps at step 400 and stays: divergence after 100 steps
    assert mon.flush(10)
    svc = DetectorService(r, consumer="t", clock=lambda: T0 + 1000, hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(50):
        if svc.run_once(block_ms=20) == 0:
            break
    recs = {d["id"]: d for d in recommendations.load(r, "adv")}
    assert sorted(recs) == ["rec:divergence:*:400:0", "rec:loss_spike:*:400:0"]
    div = recs["rec:divergence:*:400:0"]
    assert (div["action"], div["checkpoint_step"], div["skip_steps"], div["status"]) == (
        "rollback", 299, [300, 600], "proposed")
    assert div["skip_samples"] == [300 * 8, 601 * 8]
    anomaly = json.loads(r.hget("th:{adv}:anomalies", "divergence:*:400:0"))
    assert anomaly["recommendation"] == {"id": "rec:divergence:*:400:0", "action": "rollback",
                                         "checkpoint_step": 299, "skip_steps": [300, 600]}
    # on-call acknowledges; the service goes on updating the figures but keeps the status
    recommendations.set_status(r, "adv", "rec:divergence:*:400:0", "acknowledged", by="sre", note="on it")
    run_steps(30, level=lambda s: 6.0)
    assert mon.flush(10)
    for _ in range(50):
        if svc.run_once(block_ms=20) == 0:
            break
    div = {d["id"]: d for d in recommendations.load(r, "adv")}["rec:divergence:*:400:0"]
    # figures refresh every 10 steps (last at step 570); the status and its history stay
    assert (div["status"], div["current_step"], div["history"][0]["by"]) == ("acknowledged", 570, "sre")
    with pytest.raises(ConfigError, match="status='done' is not one of proposed, acknowledged, applied, dismissed"):
        recommendations.set_status(r, "adv", "rec:divergence:*:400:0", "done")
    with pytest.raises(ConfigError, match="recommendation id='rec:nope' does not exist in run 'adv'"):
        recommendations.set_status(r, "adv", "rec:nope", "applied")
    mon.close()


def test_advice_for_a_spike_that_recovers_is_closed_by_itself(r: redis.Redis) -> None:
    mon = Monitor("rec-ok", client=r, rank=0, world_size=1, started_at=T0, flush_interval=0.01)
    for s in range(300):
        loss = 3.0 + 0.001 * (s % 7) + (3.0 if 200 <= s < 205 else 0.0)  # a 5-step spike that recovers
        mon.log_step(s, loss=loss, tokens=1000, timestamp=T0 + 10 + s)
        if (s + 1) % 100 == 0:
            mon.checkpoint_saved(s, 1.0)
    assert mon.flush(10)
    svc = DetectorService(r, consumer="t", clock=lambda: T0 + 1000, hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(50):
        if svc.run_once(block_ms=20) == 0:
            break
    [rec] = recommendations.load(r, "rec-ok")
    assert (rec["id"], rec["action"], rec["status"]) == ("rec:loss_spike:*:200:0", "wait", "dismissed")
    assert rec["history"][-1]["by"] == "trainhealth"
    assert rec["history"][-1]["note"] == "the loss recovered by itself (step 204)"
    mon.close()
