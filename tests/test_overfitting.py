"""Over-fitting (detectors/overfitting.py): eval losses from the wire, the importers and the detector, on real logs."""

from __future__ import annotations

import json
import math

import pytest
import redis

from trainhealth import Monitor
from trainhealth.collectors.importers import read_items
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.offline import OfflineRun, arrange
from trainhealth.detectors.overfitting import OverfittingDetector
from trainhealth.detectors.service import DetectorService
from trainhealth.wire import decode_event

T0 = 1_800_000_000.0


def _agg(step: int, loss: float) -> StepAggregate:
    return StepAggregate(step, 0, 0.0, None, float(step), loss, None, None, None, None, 1, (None,), 0.0)


def _run(det: OverfittingDetector, train: dict[int, float], evals: dict[int, float], name: str = "eval") -> list:
    found = []
    for step in sorted(set(train) | set(evals)):
        if step in train:
            found += det.update(_agg(step, train[step]))
        if step in evals:
            found += det.evaluate(step, name, evals[step], gen=0)
    return found


def test_rising_eval_with_falling_train_opens_and_resolves_back_within_5_percent() -> None:
    det = OverfittingDetector()
    train = {s: 3.0 - s / 1000 for s in range(10, 1001, 10)}
    evals = {100: 2.5, 200: 2.0, 300: 2.06, 400: 2.2, 500: 2.3, 600: 2.15, 700: 2.08, 800: 1.9}
    found = _run(det, train, evals)
    # 400: 10 % above the best (2.0 at 200), risen at 300 and 400; 500 (15 %) and 600 (7.5 %) keep it open, said
    # once; 700 is 4 % above: resolved there.
    assert [(a.status, a.step, a.end_step) for a in found] == [("active", 400, None), ("resolved", 400, 700)]
    ev = found[0].evidence
    assert (ev["best_step"], ev["best_eval_loss"], ev["rise_from_step"], ev["evals"]) == (200, 2.0, 200, 4)
    assert ev["gl_pct"] == pytest.approx(10.0) and ev["sets"] == {"eval": pytest.approx(10.0)}
    assert (ev["train_before"], ev["train_after"]) == (pytest.approx(2.81), pytest.approx(2.61))
    assert found[0].severity == "warning"
    assert found[1].message.endswith("; eval loss back within 5 % of its best")


def test_silent_when_the_train_loss_rises_too_or_the_eval_rises_once() -> None:
    both = _run(OverfittingDetector(), {s: 1.0 + s / 1000 for s in range(10, 801, 10)},
                {100: 2.0, 200: 2.3, 300: 2.6, 400: 3.0})
    assert both == []  # a failing run (the learning rate), not over-fitting
    bump = _run(OverfittingDetector(), {s: 3.0 - s / 1000 for s in range(10, 801, 10)},
                {100: 2.0, 200: 2.3, 300: 1.9, 400: 2.1, 500: 1.8})
    assert bump == []  # rose at one evaluation at a time
    nan = _run(OverfittingDetector(), {s: 3.0 - s / 1000 for s in range(10, 801, 10)},
               {100: 2.0, 200: math.nan, 300: 2.2, 400: math.inf})
    assert nan == []
    with pytest.raises(ValueError, match="eval set name is ''"):
        OverfittingDetector().evaluate(1, "", 1.0, gen=0)


def test_a_rollback_before_the_rise_resolves_it() -> None:
    det = OverfittingDetector()
    found = _run(det, {s: 3.0 - s / 1000 for s in range(10, 501, 10)}, {100: 2.0, 200: 2.2, 300: 2.4})
    assert [(a.status, a.step) for a in found] == [("active", 300)]
    back = det.update(_agg(150, 2.85))  # resumed from the checkpoint of step 149
    assert [(a.status, a.end_step) for a in back] == [("resolved", 150)]
    assert back[0].message.endswith("; training rolled back")


def _overfitting_states(path: str) -> list:
    run, states = OfflineRun(), []
    arranged = arrange(read_items(path), 1.0)
    run.expect_ranks(arranged)
    for tp in arranged.points:
        states += [a for a in run.feed(tp).anomalies if a.kind == "overfitting"]
    states += [a for a in run.finish().anomalies if a.kind == "overfitting"]
    return states


def test_real_over_fitting_log_fires_at_step_1203(real_logs) -> None:
    """hf_overfit_30epochs: six eval sets rise from 802-1203 on while the train loss falls 1.107 -> 0.055."""
    states = _overfitting_states(str(real_logs / "hf_overfit_30epochs.trainer_state.json"))
    first = states[0]
    assert (first.id, first.severity, first.status) == ("overfitting:*:1203:0", "warning", "active")
    ev = first.evidence
    assert (ev["name"], ev["best_step"], ev["rise_from_step"], ev["evals"]) == ("eval_g0", 401, 401, 4)
    assert (round(ev["eval_loss"], 4), round(ev["best_eval_loss"], 4), round(ev["gl_pct"], 2)) == (
        1.3531, 1.1138, 21.49)
    assert (ev["train_before"], ev["train_after"]) == (1.1074, 0.5969)
    assert first.message.startswith("eval loss on 'eval_g0' is 21.5 % above its best (1.114 at step 401) at 1.353")
    # Said again as the other sets join and the worst GL doubles (6 times), not at each of the 180 evaluations, and
    # at the end of the file; open then with every set over-fitting, 116-139 % above its best.
    last = states[-1]
    assert len(states) == 8 and last.status == "active" and last.step == 1203
    assert sorted(last.evidence["sets"]) == [f"eval_g{i}" for i in range(6)]
    assert [round(v) for v in last.evidence["sets"].values()] == [129, 139, 132, 116, 123, 121]


@pytest.mark.parametrize("name", ["hf_tinyllama_sft_healthy.trainer_state.json",
                                  "hf_trocr_large_gradnorm.trainer_state.json",
                                  "hf_whisper_small_lr_too_high.trainer_state.json",
                                  "llamafactory_luojiu7b_cpt.trainer_log.jsonl",
                                  "lightning_slm_wikitext103.metrics.csv", "llmc_gpt2_124m_main.log"])
def test_real_logs_without_over_fitting_stay_silent(real_logs, name: str) -> None:
    assert _overfitting_states(str(real_logs / name)) == []


def test_log_eval_travels_as_an_event_and_the_service_finds_over_fitting(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("ovf", redis_url=redis_url, rank=0, world_size=1, started_at=T0, flush_interval=0.01)
    evals = {100: 2.0, 200: 2.1, 300: 2.3}
    for s in range(1, 301):
        mon.log_step(s, loss=3.0 - s / 1000, tokens=100, timestamp=T0 + s)
        if s in evals:
            mon.log_eval(s, evals[s], name="eval_wiki", timestamp=T0 + s + 0.5)
    mon.log_eval(300, "n/a")  # not a number: not sent
    mon.log_eval(300, 1.0, name="")  # no name: not sent
    assert mon.flush(10)
    mon.close()
    sent = [decode_event(f) for _, f in r.xrange("th:{ovf}:events")]
    got = [(e.step, e.t, e.extra) for e in sent if e.kind == "eval"]
    assert got == [(100, T0 + 100.5, {"name": "eval_wiki", "loss": "2.0"}),
                   (200, T0 + 200.5, {"name": "eval_wiki", "loss": "2.1"}),
                   (300, T0 + 300.5, {"name": "eval_wiki", "loss": "2.3"})]
    svc = DetectorService(r, consumer="t", clock=lambda: T0 + 400, snapshot_interval=0.0,
                          hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(50):
        if svc.run_once(block_ms=20) == 0:
            break
    stored = json.loads(r.hget("th:{ovf}:anomalies", "overfitting:*:300:0"))
    assert (stored["severity"], stored["status"], stored["evidence"]["name"]) == ("warning", "active", "eval_wiki")
    assert round(stored["evidence"]["gl_pct"], 6) == 15.0
    incident = json.loads(r.hget("th:{ovf}:incidents", "inc:overfitting:*:300:0"))
    assert incident["title"] == "Over-fitting from step 300: the eval loss rises while the training loss falls"
