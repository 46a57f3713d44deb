"""Timing detectors (throughput_drop, slow_step): the step time they see, real logs, seeded streams, Redis."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from trainhealth import Monitor, defaults
from trainhealth.anomaly import Anomaly
from trainhealth.collectors.importers import read_items
from trainhealth.commands.replay import read_points, replay
from trainhealth.detectors.aggregate import StepAggregate, StepAggregator
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.offline import OfflineRun
from trainhealth.detectors.pipeline import RunPipeline
from trainhealth.detectors.service import DetectorService
from trainhealth.detectors.slow_step import SlowStepDetector
from trainhealth.detectors.throughput import ThroughputDropDetector, goodput_step_deviation, step_seconds
from trainhealth.logpoint import LogPoint
from trainhealth.timeline import timeline
from trainhealth.wire import Event, StepRecord, decode_steps

TIMING = ("throughput_drop", "slow_step")
MIXTRAL = "megatron_mixtral8x7b_h100.golden_values.json"
BLOOM = "megatron_deepspeed_bloom176b_excerpt.log"


# -- helpers -----------------------------------------------------------------------------------------
def agg(step: int, seconds: float | None, gen: int = 0, tokens: int | None = None) -> StepAggregate:
    """A one-rank aggregate whose step time is the job's own ``step_s`` (as a replayed log gives it)."""
    return StepAggregate(step, gen, 0.0, None, float(step), 1.0, 1.0, None, tokens, None, 1, (None,), 0.0,
                         step_s=seconds)


def detect(stream: Iterable[StepAggregate]) -> list[Anomaly]:
    """Latest state of every timing anomaly, in onset order."""
    dets = [ThroughputDropDetector(), SlowStepDetector()]
    found: dict[str, Anomaly] = {}
    for a in stream:
        for d in dets:
            for an in d.update(a):
                found[an.id] = an
    return sorted(found.values(), key=lambda an: (an.step, an.kind))


def kinds_steps(anomalies: Iterable[Anomaly]) -> list[tuple[str, int, int | None, str]]:
    return [(a.kind, a.step, a.end_step, a.status) for a in anomalies if a.kind in TIMING]


def noisy(rng: random.Random, sd: float) -> float:
    return math.exp(rng.gauss(0.0, sd))


def offline(path: Path) -> OfflineRun:
    return OfflineRun().feed_all(read_points(path))


# -- the step time the detectors judge --------------------------------------------------------------
def test_step_s_travels_in_the_record_json_and_aggregates_as_the_max_over_ranks() -> None:
    [rec] = decode_steps({b"rank": b"1", b"n": b"1",
                          b"recs": b'[{"rank":1,"step":4,"inc":1.0,"t":9.0,"step_s":2.5,"loss":1.0}]'})
    assert (rec.step, rec.step_s, rec.dur) == (4, 2.5, None)
    ag = StepAggregator(world_size=2)
    assert ag.add(StepRecord(0, 4, 1.0, 9.0, loss=1.0)) == []
    assert ag.add(StepRecord(0, 4, 1.0, 9.1, step_s=2.0)) == []  # the same rank and step again: merged
    [a] = ag.add(StepRecord(1, 4, 1.0, 9.0, step_s=2.5))
    assert (a.step_s, a.dur, a.loss, a.n_ranks) == (2.5, None, 1.0, 2)
    assert step_seconds(a) == 2.5


def test_a_timed_step_wins_and_gaps_between_untimed_records_are_never_a_step_time() -> None:
    ag = StepAggregator(world_size=1)
    [timed] = ag.add(StepRecord(0, 1, 0.0, 10.0, dur=0.5, step_s=3.0))
    [untimed] = ag.add(StepRecord(0, 2, 0.0, 400.0))  # 390 s after the previous step: a checkpoint, say
    assert step_seconds(timed) == 0.5
    assert step_seconds(untimed) is None
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert step_seconds(agg(3, bad)) is None


def test_timeline_passes_the_logs_own_step_time_only() -> None:
    pts = [LogPoint(1, loss=2.0, step_seconds=1.5), LogPoint(2, loss=2.0),           # 2: no time in the log
           LogPoint(2, eval_seconds=30.0), LogPoint(3, loss=2.0, step_seconds=31.0),  # measured across the eval
           LogPoint(4, loss=2.0, step_seconds=1.4)]
    assert [tp.step_s for tp in timeline(pts, step_seconds=7.0)] == [1.5, None, None, None, 1.4]


def test_monitor_log_step_sends_step_s_and_never_raises(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("run-t", redis_url=redis_url, rank=0, world_size=1)
    mon.log_step(1, loss=2.0, step_s=1.25)
    mon.log_step(2, loss=2.0, step_s="slow")  # not a number: dropped with a warning, no exception
    with mon.step(3):
        pass
    mon.log_step(3, loss=2.0, step_s=9.0)  # a step() time and the job's own: both kept, dur preferred
    assert mon.close() is True
    recs = [rec for _, f in r.xrange("th:{run-t}:steps") for rec in decode_steps(f)]
    assert [(x.step, x.step_s) for x in recs] == [(1, 1.25), (2, None), (3, 9.0)]
    assert recs[2].dur is not None and recs[2].dur < 1.0


# -- real logs (../shared/real_logs, MANIFEST.md) ---------------------------------------------------
def test_mixtral_golden_values_slow_steps_and_nothing_else(real_logs: Path) -> None:
    # MANIFEST: iteration-time median ~9 s; step 1 is 92 s (warm-up); ~87-88 s at 9870, 11285, 14145, 19855;
    # 21 s at 20020 (15.3 s at 20025, the next logged step: one run), 27 s at 20455.
    run = offline(real_logs / MIXTRAL)
    found = [a for a in run.anomalies.values() if a.kind in TIMING]
    assert kinds_steps(found) == [
        ("slow_step", 9870, 9870, "resolved"), ("slow_step", 11285, 11285, "resolved"),
        ("slow_step", 14145, 14145, "resolved"), ("slow_step", 19855, 19855, "resolved"),
        ("slow_step", 20020, 20025, "resolved"), ("slow_step", 20455, 20455, "resolved")]
    times = {p.step: p.step_seconds for p in read_points(real_logs / MIXTRAL) if not p.is_eval}
    by_step = {a.step: a for a in found}
    for step in (9870, 11285, 14145, 19855, 20455):
        assert by_step[step].evidence["step_s"] == times[step]
        assert by_step[step].severity == "info"
    assert by_step[20020].evidence["steps"] == 2 and by_step[20020].evidence["peak_step"] == 20020
    assert 9.0 < by_step[9870].evidence["ratio"] < 10.0  # 88.1 s against a ~8.9 s median


def test_bloom_excerpt_throughput_drop_at_42783_from_its_sparse_points(real_logs: Path) -> None:
    # 18 points in pasted blocks; the drop is 42783 (110.17 s), 42784 (111.14 s) and, 2,216 iterations later,
    # 45000 (111.00 s): three points, the fewest the winsorised CUSUM can ever alarm on.
    pts = [p for p in read_points(real_logs / BLOOM) if not p.is_eval]
    run = OfflineRun().feed_all(pts)
    [drop] = [a for a in run.anomalies.values() if a.kind in TIMING]
    assert (drop.kind, drop.step, drop.status, drop.severity) == ("throughput_drop", 42783, "active", "warning")
    ref = [p.step_seconds for p in pts[defaults.THROUGHPUT_WARMUP_STEPS:] if p.step < 42783]
    after = [p.step_seconds for p in pts if p.step >= 42783]
    ev = drop.evidence
    assert (ev["before_s"], ev["after_s"], ev["points"], ev["span_steps"]) == (
        statistics.median(ref), statistics.median(after), 3, 45000 - 42783 + 1)
    assert ev["rel_change"] == round(statistics.median(after) / statistics.median(ref) - 1, 4) == 0.0445
    # 4.26 % of the time lost, above the 4 % of a warning (defaults.THROUGHPUT_WARNING_LOSS); held 2,218 steps
    assert ev["lost_fraction"] == round(1 - statistics.median(ref) / statistics.median(after), 4) == 0.0426
    assert drop.message.startswith("throughput dropped 4.3% from step 42783: median step time 106.3 s -> 111 s")
    assert ev["tokens_per_s_before"] == round(2048 * 2048 / statistics.median(ref), 3)  # 2048 samples x 2048 tokens
    assert (ev["ideal_step_s"], ev["goodput_step_deviation_s"]) == (
        round(goodput_step_deviation(ref, after)[0], 6), goodput_step_deviation(ref, after)[1])


@pytest.mark.parametrize("name", [
    "modded_nanogpt_soap.log",                              # every 10th step ~5x: the run's rhythm
    "llamafactory_luojiu7b_cpt.trainer_log.jsonl",          # 41.0-43.4 s per step from elapsed_time, 1,742 rows
    "megatron_bert_release_a100.golden_values.json",        # iteration-time every 100th step, 0.327-0.370 s
    "deepspeed_overflow_tqdm_hf.log",                       # 132.6-132.8 s/it, one overflow skip (not a timing fault)
    "tf_deeplab_steps_checkpoint.log",                      # 13000: 5.5 s right after a checkpoint save
    "llamafactory_mistral7b_translator.trainer_log.jsonl",  # step time wanders 2.0-2.7 s with the data
    "tensorboard_t5_summarization",                         # wall-clock step times, steady
    "megatron_deepspeed_104b_overflow_excerpt.log",         # pasted blocks during batch-size ramp-up
    "pytorch_word_lm_all_nan.log",
])
def test_timed_logs_without_a_timing_fault_flag_nothing(real_logs: Path, name: str) -> None:
    run = offline(real_logs / name)
    assert run.timed_steps > 0
    assert kinds_steps(run.anomalies.values()) == []


@pytest.mark.parametrize("name", [
    "hf_tinyllama_sft_healthy.trainer_state.json", "hf_trocr_large_gradnorm.trainer_state.json",
    "hf_whisper_small_lr_too_high.trainer_state.json", "lightning_slm_wikitext103.metrics.csv",
])
def test_logs_without_step_times_are_never_judged_on_the_assumed_pace(real_logs: Path, name: str) -> None:
    run = offline(real_logs / name)
    assert run.timed_steps == 0
    assert kinds_steps(run.anomalies.values()) == []


# -- seeded streams ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("factor", "seed"), [(1.1, 11), (1.3, 12), (2.0, 13)])
def test_level_shift_is_one_drop_with_the_exact_onset_resolved_when_the_level_returns(factor: float,
                                                                                      seed: int) -> None:
    rng = random.Random(seed)
    found = detect(agg(s, 0.8 * noisy(rng, 0.02) * (factor if 500 <= s < 800 else 1.0)) for s in range(1200))
    assert kinds_steps(found) == [("throughput_drop", 500, 799, "resolved")]
    ev = found[0].evidence
    assert abs(ev["rel_change"] - (factor - 1)) < 0.02
    assert ev["recovered_s"] == pytest.approx(0.8, rel=0.03)


def test_noisy_healthy_run_flags_nothing_in_20000_steps() -> None:
    rng = random.Random(21)
    assert detect(agg(s, 2.0 * noisy(rng, 0.05)) for s in range(20_000)) == []


def test_periodic_slow_steps_are_the_rhythm_and_a_one_off_is_still_flagged() -> None:
    # modded-nanogpt's SOAP run: ~255 ms steps, every 10th (11, 21, ...) ~1325 ms.
    rng = random.Random(31)

    def t(s: int) -> float:
        base = 0.255 * noisy(rng, 0.005)
        return base * (5.2 if s % 10 == 1 else 1.0) * (8.0 if s == 1234 else 1.0)

    found = detect(agg(s, t(s)) for s in range(1, 3001))
    assert kinds_steps(found) == [("slow_step", 1234, 1234, "resolved")]
    assert found[0].evidence["steps"] == 1 and found[0].severity == "info"


def test_warm_up_of_each_generation_is_not_flagged() -> None:
    rng = random.Random(41)
    warm = [40.0, 3.0, 2.0, 1.5, 1.3, 1.2, 1.1]

    def gen_steps(first: int, last: int, gen: int) -> list[StepAggregate]:
        return [agg(s, 1.0 * noisy(rng, 0.02) * (warm[s - first] if s - first < len(warm) else 1.0), gen=gen)
                for s in range(first, last)]

    # A crash after step 899 and a relaunch from the step-700 checkpoint: warm-up again.
    assert detect(gen_steps(0, 900, 0) + gen_steps(700, 1500, 1)) == []


def test_drop_open_at_a_restart_is_resolved_by_it() -> None:
    rng = random.Random(42)
    stream = [agg(s, noisy(rng, 0.02) * (1.5 if s >= 300 else 1.0)) for s in range(400)]
    stream += [agg(s, noisy(rng, 0.02), gen=1) for s in range(350, 500)]
    [drop] = detect(stream)
    assert (drop.kind, drop.step, drop.end_step, drop.status, drop.evidence["restarted"]) == (
        "throughput_drop", 300, 399, "resolved", True)


def test_checkpoint_pause_between_timed_steps_is_not_a_slow_step() -> None:
    # Live records: mon.step() times each step; the save after step 500 blocks for 120 s between steps.
    rng = random.Random(51)
    pipe = RunPipeline(1)
    t, found = 1000.0, []
    for s in range(1000):
        dur = 1.0 * noisy(rng, 0.02)
        t += dur
        found += pipe.feed_step(StepRecord(0, s, 0.0, t, dur=dur, loss=2.0)).anomalies
        if s == 500:
            pipe.feed_event(Event("checkpoint_save", 0, t + 120.0, 0.0, step=500, seconds=120.0))
            t += 120.0
    assert kinds_steps(found) == []
    # The same pause inside a timed step is one.
    rng = random.Random(51)
    found = detect(StepAggregate(s, 0, 0.0, 0.0, 1.0 * noisy(rng, 0.02) + (120.0 if s == 500 else 0.0), 2.0, 1.0,
                                 None, None, None, 1, (None,), 0.0) for s in range(1000))
    assert kinds_steps(found) == [("slow_step", 500, 500, "resolved")]


def test_untimed_live_records_with_pauses_are_not_judged() -> None:
    pipe = RunPipeline(1)
    found = []
    for s in range(600):
        t = 1000.0 + s + (300.0 if s > 250 else 0.0)  # a 300 s gap: an evaluation between steps 250 and 251
        found += pipe.feed_step(StepRecord(0, s, 0.0, t, loss=2.0)).anomalies
    assert kinds_steps(found) == []


# -- pauses: checkpoint saves and evaluations in a step -------------------------------------------------
def test_tf_checkpoint_step_is_booked_as_checkpoint_save_not_judged(real_logs: Path) -> None:
    # "The checkpoint has been created." after step 12999 (LogEvent checkpoint_save, step 12999, no seconds): step
    # 13000 takes 5.495 s against ~1.0 s; it is the checkpoint's step, and its time above the usual is the save.
    path = real_logs / "tf_deeplab_steps_checkpoint.log"
    run = OfflineRun().feed_all(read_items(path))
    assert run.events == {"checkpoint_save": 1}
    assert kinds_steps(run.anomalies.values()) == []
    times = {p.step: p.step_seconds for p in read_points(path) if not p.is_eval}
    usual = statistics.median(times[s] for s in range(12973, 13000))  # the first step counts from its end
    sec = run.pipeline.ledger.snapshot(run.pipeline.ledger.last_activity)["seconds"]
    assert (usual, sec["checkpoint_save"]) == (1.008, round(5.495 - 1.008, 6)) == (1.008, 4.487)
    assert sec["productive"] == round(sum(times[s] for s in range(12973, 13002)) - 4.487, 6)


def _pause_stream(event: Event | None, slow_s: float = 5.0) -> tuple[list[Anomaly], RunPipeline]:
    """600 timed 1 s steps (2 % noise) through a pipeline; step 401 takes ``slow_s`` more, ``event`` comes after
    step 400's record."""
    rng = random.Random(52)
    pipe = RunPipeline(1)
    t, found = 1000.0, []
    for s in range(600):
        dur = noisy(rng, 0.02) + (slow_s if s == 401 else 0.0)
        t += dur
        found += pipe.feed_step(StepRecord(0, s, 0.0, t, dur=dur, loss=2.0)).anomalies
        if s == 400 and event is not None:
            pipe.feed_event(replace(event, t=t))
    return [a for a in found if a.kind in TIMING], pipe


def test_a_save_or_evaluation_measured_inside_the_next_step_makes_it_a_pause_step() -> None:
    # No event: step 401 (6 s against 1 s) is a slow step.
    found, pipe = _pause_stream(None)
    assert kinds_steps(found) == [("slow_step", 401, 401, "resolved")]
    # A save of step 400 without seconds (a log's "checkpoint saved" line): 401 is the checkpoint's step.
    found, pipe = _pause_stream(Event("checkpoint_save", 0, 0.0, 0.0, step=400))
    assert found == []
    snap = pipe.ledger.snapshot(pipe.ledger.last_activity)
    assert round(snap["seconds"]["checkpoint_save"], 3) == 5.006  # 6.006 s against a 1.000 s median
    # An evaluation (a badput event, no step: after the last completed step): booked under its name.
    found, pipe = _pause_stream(Event("badput", 0, 0.0, 0.0, seconds=None, extra={"name": "evaluation"}))
    assert found == []
    snap = pipe.ledger.snapshot(pipe.ledger.last_activity)
    assert (round(snap["seconds"]["custom"], 3), round(snap["custom_by_name"]["evaluation"], 3)) == (5.006, 5.006)
    # A late event (it names step 300, long done) marks nothing.
    found, _ = _pause_stream(Event("checkpoint_save", 0, 0.0, 0.0, step=300))
    assert kinds_steps(found) == [("slow_step", 401, 401, "resolved")]


def test_pause_step_of_a_multi_rank_job_is_the_step_after_the_saved_one() -> None:
    # Rank 0 reports the save of step 10 before rank 1's record of step 10: the pause still falls in step 11.
    pipe = RunPipeline(2)
    aggs = []
    for s in range(13):
        aggs += pipe.feed_step(StepRecord(0, s, 0.0, float(s), dur=1.0)).aggs
        if s == 10:
            pipe.feed_event(Event("checkpoint_save", 0, 10.5, 0.0, step=10, seconds=3.0))
        aggs += pipe.feed_step(StepRecord(1, s, 0.0, float(s), dur=1.0)).aggs
    assert [(a.step, a.pause) for a in aggs if a.pause] == [(11, "checkpoint_save")]


# -- throughput drops: large against the run's noise, lasting, severity by the time lost ------------------
def _contention(rng: random.Random, s: int) -> float:
    """A 60 ms step of the demo on a loaded machine: 2 % noise, and every 120 steps a burst of 25 steps 4-8 %
    slower (another process took the core), with one-step hiccups of 1.3-1.8x one step in 50."""
    t = 0.060 * noisy(rng, 0.02)
    if s % 120 < 25:
        t *= 1.04 + 0.04 * ((s // 120) % 3) / 2
    if rng.random() < 0.02:
        t *= rng.uniform(1.3, 1.8)
    return t


def live(times: Iterable[float]) -> list[StepAggregate]:
    """Timed aggregates (t_start, t_end) of consecutive steps of these durations."""
    out, t = [], 0.0
    for s, d in enumerate(times):
        t += d
        out.append(StepAggregate(s, 0, 0.0, t - d, t, 1.0, 1.0, None, None, None, 8, (None,), 0.0))
    return out


def test_contention_like_jitter_is_no_drop_and_a_sustained_10_percent_drop_is() -> None:
    rng = random.Random(91)
    jitter = [_contention(rng, s) for s in range(3000)]
    assert detect(live(jitter)) == []
    # The 10-step rule of before reported the bursts: 20 of the 25.
    old = [ThroughputDropDetector(hold_steps=10)]
    bursts = {an.id for a in live(jitter) for an in old[0].update(a)}
    assert len(bursts) == 20
    # The same run, 10 % slower from step 1500 to the end: one drop at 1500, a warning (8 % of the time lost against
    # a reference that holds the bursts).
    rng = random.Random(91)
    slower = [_contention(rng, s) * (1.10 if s >= 1500 else 1.0) for s in range(3000)]
    [drop] = detect(live(slower))
    assert (drop.kind, drop.step, drop.status, drop.severity) == ("throughput_drop", 1500, "active", "warning")
    assert (drop.evidence["lost_fraction"], drop.evidence["span_steps"]) == (0.08, 50)


def test_demo_step_times_under_load_give_only_the_stragglers_drop() -> None:
    # Step times of `trainhealth demo` on the 2-core machine with a busy loop on one core (bench/demo_under_load.py
    # --dump): 60 ms steps; the straggler from 250 makes every step ~104 ms until 800 (a crash after 620 and a
    # relaunch from 600 in between); contention slows steps 4-6 % for 10-30 steps at a time.
    rows = json.loads((Path(__file__).parent / "data" / "timing" / "demo_under_load_step_times.json").read_text())
    aggs, t = [], 0.0
    for step, gen, ms in rows["steps"]:
        t += ms / 1000
        aggs.append(StepAggregate(step, gen, 0.0, t - ms / 1000, t, 1.0, 1.0, None, None, None, 8, (None,), 0.0))
    [drop] = detect(aggs)
    assert (drop.kind, drop.step, drop.end_step, drop.severity, drop.evidence["restarted"]) == (
        "throughput_drop", 250, 620, "warning", True)
    assert drop.evidence["lost_fraction"] == 0.4247  # 60 -> 104 ms: every rank waits for the straggler
    # What the 10-step rule made of the same steps: four contention bursts as warnings besides.
    det = ThroughputDropDetector(hold_steps=10)
    found = {an.id: an for a in aggs for an in det.update(a)}
    assert sorted((a.step, a.severity) for a in found.values()) == [
        (156, "warning"), (250, "warning"), (619, "warning"), (653, "warning"), (999, "warning")]


def test_severity_follows_the_time_lost_and_an_info_drop_grows_into_a_warning() -> None:
    # 3.5 % slower for 400 steps on a very steady run (0.5 % noise): found, 3.5 % of the time lost: info.
    rng = random.Random(93)
    [small] = detect(agg(s, noisy(rng, 0.005) * (1.035 if 500 <= s < 900 else 1.0)) for s in range(1200))
    assert (small.step, small.end_step, small.severity, small.evidence["lost_fraction"]) == (500, 899, "info", 0.0352)
    # 3.5 % from 500, then 8 % from 700: the open info drop turns into a warning as its level rises.
    rng = random.Random(94)
    det, states = ThroughputDropDetector(), []
    for s in range(1200):
        factor = 1.0 if s < 500 else 1.035 if s < 700 else 1.08
        states += det.update(agg(s, noisy(rng, 0.005) * factor))
    assert [(a.step, a.status, a.severity) for a in states] == [(500, "active", "info"), (500, "active", "warning")]
    assert states[1].evidence["lost_fraction"] == 0.0401


def test_a_bigger_batch_is_not_a_drop_but_fewer_tokens_per_second_is() -> None:
    rng = random.Random(61)
    # Batch-size ramp-up: tokens per step and step time double together; tokens/s unchanged.
    ramp = [agg(s, noisy(rng, 0.02) * (2.0 if s >= 500 else 1.0), tokens=8192 * (2 if s >= 500 else 1))
            for s in range(1000)]
    assert detect(ramp) == []
    slower = [agg(s, noisy(rng, 0.02) * (1.3 if s >= 500 else 1.0), tokens=8192) for s in range(1000)]
    [drop] = detect(slower)
    assert (drop.kind, drop.step, drop.status) == ("throughput_drop", 500, "active")
    assert drop.evidence["tokens_per_s_before"] / drop.evidence["tokens_per_s_after"] == pytest.approx(1.3, rel=0.02)


def test_shift_below_three_percent_is_not_reported_however_steady_the_run() -> None:
    rng = random.Random(71)
    assert detect(agg(s, noisy(rng, 0.001) * (1.02 if s >= 500 else 1.0)) for s in range(1500)) == []


@pytest.mark.parametrize(("length", "step_s", "expected"), [
    (9, 1.0, [("slow_step", 500, 508, "resolved")]),          # up to 9 steps: a burst of slow steps
    (30, 1.0, []),                                            # 10-49 steps and under 600 s: a transient
    (50, 1.0, [("throughput_drop", 500, 549, "resolved")]),   # 50 steps: it lasts, a level shift
    (10, 60.0, [("throughput_drop", 500, 509, "resolved")]),  # 10 steps of 3 min: 30 min, it lasts too
])
def test_a_burst_is_a_slow_step_and_a_longer_one_a_drop_never_both(length: int, step_s: float,
                                                                   expected: list) -> None:
    rng = random.Random(81)

    def a(s: int) -> StepAggregate:  # t_end on a clock of step_s-second steps (3x slower in the burst)
        slow = 500 <= s < 500 + length
        t = step_s * noisy(rng, 0.03) * (3.0 if slow else 1.0)
        end = step_s * (s + 2 * max(0, min(s + 1, 500 + length) - 500))
        return StepAggregate(s, 0, 0.0, None, end, 1.0, 1.0, None, None, None, 1, (None,), 0.0, step_s=t)

    found = detect(a(s) for s in range(1000))
    assert kinds_steps(found) == expected


# -- end to end through Redis -----------------------------------------------------------------------
def test_replayed_bloom_log_shows_the_drop_in_the_anomalies_hash(r: redis.Redis, real_logs: Path) -> None:
    res = replay(real_logs / BLOOM, r, run="bloom")
    assert res.points == 18
    sent = [rec for _, f in r.xrange("th:{bloom}:steps") for rec in decode_steps(f)]
    assert [(x.step, x.step_s) for x in sent][-3:] == [(42783, 110.17), (42784, 111.14), (45000, 111.0)]
    svc = DetectorService(r, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=60))
    for _ in range(100):
        if svc.run_once(block_ms=20) == 0:
            break
    found = {k.decode(): json.loads(v) for k, v in r.hgetall("th:{bloom}:anomalies").items()}
    timing = {k: v for k, v in found.items() if v["kind"] in TIMING}
    assert sorted(timing) == ["throughput_drop:*:42783:0"]
    a = timing["throughput_drop:*:42783:0"]
    # Open at the log's end; the replay then ends every rank, which resolves it (a finished run does not fire).
    assert (a["status"], a["severity"], a["evidence"]["after_s"], a["evidence"]["run_ended"], a["end_step"]) == (
        "resolved", "warning", 111.0, True, 45000)
    log = [json.loads(f[b"json"]) for _, f in r.xrange("th:{bloom}:anomaly_log") if f[b"kind"] == b"throughput_drop"]
    assert [x["status"] for x in log] == ["active", "resolved"]
    # The job's own step time reaches the aggregate stream, for the dashboard and other readers.
    agg = [(int(f[b"step"]), float(f[b"step_s"])) for _, f in r.xrange("th:{bloom}:agg")]
    assert agg[-3:] == [(42783, 110.17), (42784, 111.14), (45000, 111.0)]


def test_sorted_window_caches_median_and_scale_until_its_values_change() -> None:
    from trainhealth.detectors.robust import SortedWindow

    w = SortedWindow(3)
    w.extend([1.0, 2.0, 4.0])
    assert (w.cached_median(), w.cached_scale(0.0)) == (2.0, 1.4826)
    w.append(10.0)  # 1.0 leaves: values 2, 4, 10
    assert (w.cached_median(), w.cached_scale(0.0)) == (4.0, 2 * 1.4826)
    w.pop()
    assert (w.cached_median(), w.cached_scale(5.0)) == (3.0, 5.0)  # the floor
    w.clear()
    w.extend([7.0])
    assert (w.cached_median(), w.cached_scale(0.0)) == (7.0, 0.0)


def test_slow_steps_of_one_freeze_count_its_time_once() -> None:
    # Rank 2 froze for 42 s in step 100 after its all-reduce: its step 100 and the others' step 101 (blocked in the
    # collective) both span the freeze; the time lost is the freeze's, not twice it.
    from trainhealth.detectors.aggregate import StepAggregate
    from trainhealth.detectors.slow_step import SlowStepDetector

    det = SlowStepDetector()
    found = []
    t = 1000.0
    for step in range(200):
        dur = 0.035 * (1 + 0.01 * (step % 5))
        start = t
        if step == 100:
            dur = 42.035
        if step == 101:
            start, dur = t - 41.99, 42.025  # began before step 100 ended: blocked on rank 2 since the freeze
        t = start + dur
        found += det.update(StepAggregate(step, 0, 0.0, start, t, 1.0, 1.0, None, None, None, 4, (None,) * 4, 0.0))
    [a] = found
    assert (a.step, a.end_step, a.evidence["steps"]) == (100, 101, 2)
    assert abs(a.evidence["lost_s"] - 42.0) < 0.1
