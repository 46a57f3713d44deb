"""The loss family (nan_inf, skipped_steps, loss_spike, grad_norm_spike, divergence, grad_norm_explosion) on the
real logs of ../shared/real_logs, through the whole offline pipeline, and on seeded synthetic curves."""

from __future__ import annotations

import doctest
import importlib
import math
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from trainhealth.anomaly import Anomaly
from trainhealth.commands.replay import read_points
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.divergence import DivergenceDetector
from trainhealth.detectors.grad_norm_explosion import GradNormExplosionDetector
from trainhealth.detectors.grad_norm_spike import GradNormSpikeDetector
from trainhealth.detectors.loss_spike import LossSpikeDetector
from trainhealth.detectors.nan_inf import NanInfDetector
from trainhealth.detectors.offline import OfflineRun
from trainhealth.detectors.skipped_steps import SkippedStepsDetector

LOSS_FAMILY = {"nan_inf", "skipped_steps", "loss_spike", "grad_norm_spike", "divergence", "grad_norm_explosion"}


def offline(path: Path) -> dict[tuple[str, int], Anomaly]:
    """The loss family's anomalies of a real log, by (kind, onset step); the other families are not judged here."""
    run = OfflineRun().feed_all(read_points(path))
    found = {(a.kind, a.step): a for a in run.anomalies.values() if a.kind in LOSS_FAMILY}
    assert len(found) == len([a for a in run.anomalies.values() if a.kind in LOSS_FAMILY])  # one per onset
    return found


# -- real logs -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hf_tinyllama_sft_healthy.trainer_state.json",
                                  "lightning_slm_wikitext103.metrics.csv",
                                  "llamafactory_mistral7b_translator.trainer_log.jsonl"])
def test_healthy_real_logs_flag_nothing(real_logs: Path, name: str) -> None:
    assert offline(real_logs / name) == {}


def test_trocr_one_loss_spike_at_682_with_its_grad_norm_jump(real_logs: Path) -> None:
    # grad norm 1e5-4e6 all run: no explosion, and no grad-norm spike on its own (its 8-14x swings elsewhere are
    # routine here); at 682 it jumps 12x *with* the loss spike, so it is reported with it
    found = offline(real_logs / "hf_trocr_large_gradnorm.trainer_state.json")
    assert sorted(found) == [("grad_norm_spike", 682), ("loss_spike", 682)]
    ev = found["loss_spike", 682].evidence
    assert (ev["loss"], ev["recovery_class"], ev["recovery_steps"], round(ev["partner_z"], 1)) == (
        0.4896, "fast", 2, 5.4)
    gn = found["grad_norm_spike", 682].evidence
    assert (gn["grad_norm"], round(gn["rise"], 1), round(gn["z"], 1), round(gn["partner_z"], 1)) == (
        1894075.125, 13.0, 5.4, 6.7)


def test_t5_exactly_two_grad_norm_spikes(real_logs: Path) -> None:
    found = offline(real_logs / "tensorboard_t5_summarization")
    assert sorted(found) == [("grad_norm_spike", 164000), ("grad_norm_spike", 190000)]
    assert [round(found[k].evidence["grad_norm"], 1) for k in sorted(found)] == [13.2, 35.6]


def test_mixtral_golden_values_two_spikes_only(real_logs: Path) -> None:
    # +39 % and +26 %; the next largest one-point rises (3800 +14 %, 2830 +12 %, 2360 +11 %) stay under 1.2x
    found = offline(real_logs / "megatron_mixtral8x7b_h100.golden_values.json")
    assert sorted(found) == [("loss_spike", 3850), ("loss_spike", 4260)]
    assert [(a.end_step, a.evidence["recovery_class"], a.evidence["recovery_steps"]) for a in found.values()] == [
        (3855, "fast", 10), (4260, "fast", 5)]


def test_modded_nanogpt_one_step_spikes_all_fast(real_logs: Path) -> None:
    # The MANIFEST names 919, 947 and 1106. 1106 (+16 %, 6.4 robust SDs) is below the 1.2x floor and smaller than
    # the ~15 later one-step blips of +20-27 % (7-13 SDs) of this heavy-tailed run; the noise tail fitted on the
    # run itself (1e-4 per step) keeps most of those quiet. What passes: 919 (+33 %), 947 (+42 %), 1760
    # (3.44 -> 4.49 -> 3.57, +30 %) and three blips within 3 % of the tail level (3361, 3656, 5452): the data do not
    # separate those from the MANIFEST's spikes.
    found = offline(real_logs / "modded_nanogpt_soap.log")
    assert sorted(found) == [("loss_spike", s) for s in (919, 947, 1760, 3361, 3656, 5452)]
    assert [(a.end_step, a.evidence["recovery_class"], a.evidence["recovery_steps"]) for a in found.values()] == [
        (919, "fast", 1), (947, "fast", 1), (1760, "fast", 1), (3361, "fast", 1), (3656, "fast", 1),
        (5454, "fast", 3)]


def test_bloom_176b_excerpt_spike_found_with_six_points_of_history(real_logs: Path) -> None:
    # 31216 (+17 %) and 31218 (+6 %) are the run-up; the spike opens at 31219 (2.2x), is still up at 31222 and
    # back at the next logged point, 31250: 31 steps, fast.
    found = offline(real_logs / "megatron_deepspeed_bloom176b_excerpt.log")
    assert sorted(found) == [("loss_spike", 31219)]
    a = found["loss_spike", 31219]
    assert (a.end_step, a.evidence["peak"], a.evidence["recovery_class"], a.evidence["recovery_steps"]) == (
        31222, 5.098124, "fast", 31)


def test_104b_excerpt_divergence_with_overflow_skips(real_logs: Path) -> None:
    found = offline(real_logs / "megatron_deepspeed_104b_overflow_excerpt.log")
    assert sorted(found) == [("divergence", 17062), ("loss_spike", 17062), ("skipped_steps", 17062)]
    div, spike, skips = found["divergence", 17062], found["loss_spike", 17062], found["skipped_steps", 17062]
    assert (div.severity, div.status, div.evidence["reason"], round(div.evidence["baseline"], 2)) == (
        "critical", "active", "overflow_skips", 2.67)
    assert (spike.severity, spike.end_step, spike.evidence["recovery_class"], spike.evidence["skipped_run"]) == (
        "critical", 17064, "not_recovered", 3)
    # DeepSpeed's OVERFLOW lines: 17062-17065 skipped (a run of 4), 17066 applied, 17067-17068 skipped again:
    # ...one episode: the overflows resume one applied step later, and the log ends inside it.
    assert (skips.status, skips.end_step, skips.evidence["steps"], skips.evidence["last_step"]) == (
        "active", None, 6, 17068)


def test_deepspeed_single_overflow_is_one_info_skipped_step(real_logs: Path) -> None:
    # MANIFEST: one fp16 overflow (loss scale 2048 -> 1024), one skipped step, info; the bar's step 249 took 132 s.
    run = OfflineRun().feed_all(read_points(real_logs / "deepspeed_overflow_tqdm_hf.log"))
    [a] = run.anomalies.values()  # and nothing else: no throughput drop, no hang
    assert (a.kind, a.severity, a.status, a.step, a.end_step) == ("skipped_steps", "info", "resolved", 249, 249)
    assert a.evidence == {"steps": 1, "first_step": 249, "last_step": 249, "runs": 1, "calibrating": False,
                          "lost_s": 132.0}
    assert run.pipeline.ledger.snapshot(run.pipeline.ledger.last_activity)["seconds"]["skipped_steps"] == 132.0


def test_whisper_sparse_rise_is_divergence_from_step_1000(real_logs: Path) -> None:
    # train loss 1.24 (500) -> 2.03 (1000) -> 2.16 -> 1.98 (2000) -> 1.79: confirmed at the third elevated point
    found = offline(real_logs / "hf_whisper_small_lr_too_high.trainer_state.json")
    assert sorted(found) == [("divergence", 1000)]
    ev = found["divergence", 1000].evidence
    assert (ev["reason"], ev["baseline"], ev["baseline_step"], ev["steps_elevated"], ev["peak_step"]) == (
        "sustained_rise", 1.2366, 500, 1000, 1500)


def test_word_lm_all_nan_is_one_nan_inf_from_the_first_step(real_logs: Path) -> None:
    found = offline(real_logs / "pytorch_word_lm_all_nan.log")
    assert sorted(found) == [("nan_inf", 200)]
    assert (found["nan_inf", 200].severity, found["nan_inf", 200].evidence["steps"]) == ("critical", 70)


# -- synthetic curves ----------------------------------------------------------------------------------------------
def agg(step: int, loss: float | None, gn: float | None = None, *, skipped: bool = False, gen: int = 0
        ) -> StepAggregate:
    bad = () if all(v is None or math.isfinite(v) for v in (loss, gn)) else (0,)
    return StepAggregate(step, gen, 0.0, None, float(step), loss, gn, None, None, None, 1, (None,), 0.0, bad,
                         skipped=skipped)


def curve(n: int, seed: int, noise: float = 0.02, every: int = 1, warmup: int = 200) -> Iterator[tuple[int, float]]:
    """A pretraining-like loss: linear LR warm-up then cosine decay to 10 %; the loss falls as a power law of the
    LR integral (steep while the LR warms up, then slower), with multiplicative Gaussian noise."""
    rng, progress = random.Random(seed), 0.0
    for s in range(n):
        progress += min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / n)))
        loss = (2.0 + 8.0 * (1 + progress / 100) ** -0.7) * math.exp(rng.gauss(0, noise))
        if s % every == 0:
            yield s, loss


def grad_norms(n: int, seed: int, level: float = 1.0, noise: float = 0.25) -> list[float]:
    rng = random.Random(seed + 1000)
    return [level * (1 + 3 * math.exp(-s / 300)) * math.exp(rng.gauss(0, noise)) for s in range(n)]


def feed(dets: Iterable, aggs: Iterable[StepAggregate]) -> list[Anomaly]:
    dets, out = list(dets), []
    for a in aggs:
        for d in dets:
            out += d.update(a)
    return out


def family() -> list:
    return [NanInfDetector(), SkippedStepsDetector(), LossSpikeDetector(), GradNormSpikeDetector(),
            DivergenceDetector(), GradNormExplosionDetector()]


@pytest.mark.parametrize(("seed", "noise", "every"), [(1, 0.02, 1), (2, 0.05, 1), (3, 0.03, 5), (4, 0.08, 50)])
def test_noisy_healthy_curve_with_warmup_and_decay_flags_nothing(seed: int, noise: float, every: int) -> None:
    n = 6000 * every if every > 1 else 6000
    gns = grad_norms(n, seed, level=10 ** (seed - 2))  # 0.1 ... 100: every level is someone's normal
    aggs = [agg(s, x, gns[s]) for s, x in curve(n, seed, noise, every)]
    assert feed(family(), aggs) == []


def spiked(shape: dict[int, float], n: int = 2000, seed: int = 7, noise: float = 0.02) -> list[StepAggregate]:
    """The healthy curve with the loss multiplied by ``shape[step]`` at those steps."""
    return [agg(s, x * shape.get(s, 1.0)) for s, x in curve(n, seed, noise)]


def states(got: list[Anomaly]) -> list[tuple]:
    return [(a.kind, a.status, a.step, a.end_step, a.evidence.get("recovery_class")) for a in got]


def test_one_step_spike_is_fast() -> None:
    got = feed([LossSpikeDetector(), DivergenceDetector()], spiked({1200: 1.6}))
    assert states(got) == [("loss_spike", "active", 1200, None, None), ("loss_spike", "resolved", 1200, 1200, "fast")]
    assert (got[1].evidence["recovery_steps"], got[1].evidence["elevated_steps"]) == (1, 1)


def test_multi_step_spike_decaying_over_several_steps_is_fast() -> None:
    # x2.5 decaying by 0.7 a step: +12 % at step 1207, +9 % at 1208 where noise (2 %) takes it under the close
    # bound (3 robust SDs = 6 %) for two points in a row: settled, 8 steps after the onset
    got = feed([LossSpikeDetector(), DivergenceDetector()], spiked({1200 + k: 1 + 1.5 * 0.7 ** k for k in range(40)}))
    assert states(got) == [("loss_spike", "active", 1200, None, None), ("loss_spike", "resolved", 1200, 1207, "fast")]
    assert (got[1].evidence["recovery_steps"], got[1].evidence["elevated_steps"], got[1].evidence["peak_step"]) == (
        8, 8, 1200)


def test_slow_recovery_is_slow_and_no_divergence() -> None:
    # x1.8 decaying 3 % a step: +8 % by step 1275 (0.8 x 0.97^75), under the close bound with the noise: settled
    # 75 steps after the onset, after the 50 of "fast", before the 100 of "not recovered"
    got = feed([LossSpikeDetector(), DivergenceDetector()], spiked({1200 + k: 1 + 0.8 * 0.97 ** k for k in range(300)}))
    assert states(got) == [("loss_spike", "active", 1200, None, None), ("loss_spike", "resolved", 1200, 1274, "slow")]
    assert got[1].evidence["recovery_steps"] == 75 and "recovered after 75 steps (slow: more than 50)" in got[1].message


def test_spike_that_never_recovers_is_not_recovered_and_divergence() -> None:
    got = feed([LossSpikeDetector(), DivergenceDetector()], spiked({s: 1.5 for s in range(1200, 2000)}))
    assert states(got) == [("loss_spike", "active", 1200, None, None),
                           ("loss_spike", "resolved", 1200, 1300, "not_recovered"),
                           ("divergence", "active", 1200, None, None)]
    assert (got[1].severity, got[2].severity, got[2].evidence["reason"]) == ("critical", "critical",
                                                                               "spike_not_recovered")
    assert "the run is diverging" in got[2].message


def test_slow_divergence_without_a_spike() -> None:
    # from step 1000 the loss drifts up 0.1 % a step (no single jump): 1.2x its best level by step ~1190 (1.001^190),
    # the first point above it at 1198, divergence once that has lasted 100 steps
    got = feed([LossSpikeDetector(), DivergenceDetector()], spiked({s: 1.001 ** (s - 1000) for s in range(1000, 3000)},
                                                                   n=3000))
    assert [(a.kind, a.status, a.step) for a in got] == [("divergence", "active", 1198)]
    ev = got[0].evidence
    assert (ev["reason"], ev["baseline_step"], ev["steps_elevated"], round(ev["rise"], 2)) == (
        "sustained_rise", 1008, 100, 1.27)


def test_divergence_resolves_on_recovery_and_on_rollback() -> None:
    aggs = spiked({s: 1.5 for s in range(1200, 1400)})
    got = feed([DivergenceDetector()], aggs)
    assert [(a.status, a.step, a.end_step) for a in got] == [("active", 1200, None), ("resolved", 1200, 1399)]
    assert got[1].evidence["recovered_loss"] == pytest.approx(aggs[1401].loss)
    det = DivergenceDetector()
    got = feed([det], spiked({s: 1.5 for s in range(1200, 1400)}, n=1350))
    got += det.update(agg(1150, 3.0, gen=1))  # rolled back to a checkpoint before the onset
    assert [(a.status, a.step, a.evidence.get("rolled_back")) for a in got] == [("active", 1200, None),
                                                                                ("resolved", 1200, True)]


def test_restart_from_an_early_checkpoint_is_not_a_rise() -> None:
    # at step 2000 (loss 3.2) the job restarts from the checkpoint of step 199 (loss 6.8): the best level reached
    # on the discarded timeline no longer counts (kept, it would make steps 200-... a sustained rise)
    pts = list(curve(3000, 9, 0.02))
    aggs = [agg(s, x) for s, x in pts[:2000]] + [agg(s, x, gen=1) for s, x in pts[200:]]
    assert feed(family(), aggs) == []


def test_sparse_log_spike_and_gap() -> None:
    # one point every 50 steps; a x1.8 point is a spike, fast (back at the next logged point)
    aggs = [agg(s, x * (1.8 if s == 30000 else 1.0)) for s, x in curve(60000, 5, 0.03, every=50)]
    got = feed([LossSpikeDetector()], aggs)
    assert states(got) == [("loss_spike", "active", 30000, None, None),
                           ("loss_spike", "resolved", 30000, 30000, "fast")]
    # a jump across a gap longer than the window (an excerpt's next block) is a level change, not a spike
    det = LossSpikeDetector()
    assert feed([det], [agg(s, 2.0 + 0.01 * (s % 3)) for s in range(100, 120)] + [agg(9000, 3.0), agg(9001, 3.01)]) \
        == []


def test_grad_norm_explosion_sustained_relative_rise() -> None:
    n = 1500
    base = grad_norms(n, 3, level=2e5)  # lives at ~2e5 from the start: its own normal
    exploding = [g * min(1.03 ** max(s - 800, 0), 40.0) for s, g in enumerate(base)]
    got = feed([GradNormExplosionDetector()], [agg(s, 2.0, g) for s, g in enumerate(exploding)])
    # 10x the floor (2.4e5 = 2e5 x 1.2, the early decay) from ~step 880 (1.03^78), 870 with the noise
    assert [(a.kind, a.status, a.step) for a in got] == [("grad_norm_explosion", "active", 870)]
    ev = got[0].evidence
    assert (round(ev["ratio"]), round(ev["floor"], -4), ev["floor_step"], ev["steps_elevated"]) == (
        29, 240000, 803, 100)
    # a one-off x50 spike and a 60-step x20 bump are not explosions
    bumpy = [g * (50 if s == 700 else 20 if 900 <= s < 960 else 1) for s, g in enumerate(base)]
    assert feed([GradNormExplosionDetector()], [agg(s, 2.0, g) for s, g in enumerate(bumpy)]) == []


def test_grad_norm_explosion_that_reaches_nan_within_100_steps() -> None:
    # x1000 over 60 steps from step 800, NaN from 860: confirmed while still climbing (the median of its last 3
    # points 10x that of its first 3), 17 steps before the NaN
    base = grad_norms(900, 4, level=1.0)
    r = math.log(1000) / 60
    aggs = [agg(s, math.nan, math.nan) if s >= 860 else agg(s, 2.0, g * math.exp(r * max(s - 800, 0)))
            for s, g in enumerate(base)]
    got = feed([GradNormExplosionDetector()], aggs)
    assert [(a.kind, a.status, a.step, a.evidence["steps_elevated"]) for a in got] == [
        ("grad_norm_explosion", "active", 819, 24)]


def test_skipped_steps_runs_calibration_and_restart() -> None:
    skipped = set(range(0, 20)) | {100, 101} | set(range(200, 207)) | set(range(300, 303))
    aggs = [agg(s, 2.0, 1.0, skipped=s in skipped) for s in range(400)]
    got = feed([SkippedStepsDetector()], aggs)
    # 20 skips while calibrating are normal and not reported; 2 in a row are the scaler's hysteresis: an info point
    # event (2 steps' time); 7 and 3 in a row are not normal: warnings
    assert [(a.severity, a.status, a.step, a.end_step, a.evidence["steps"]) for a in got] == [
        ("info", "resolved", 100, 101, 2),
        ("warning", "active", 200, None, 3), ("warning", "active", 200, None, 6), ("warning", "resolved", 200, 206, 7),
        ("warning", "active", 300, None, 3), ("warning", "resolved", 300, 302, 3)]
    det = SkippedStepsDetector()
    got = feed([det], [agg(s, 2.0, skipped=s >= 10) for s in range(14)] + [agg(5, 2.0, skipped=True, gen=1)])
    assert [(a.status, a.step, a.end_step) for a in got] == [("active", 10, None), ("resolved", 10, 13)]
    # never a step applied: more than 32 skips from the start is flagged as calibration failing
    got = feed([SkippedStepsDetector()], [agg(s, 2.0, skipped=True) for s in range(40)])
    assert [(a.step, a.evidence["steps"], a.evidence["calibrating"]) for a in got] == [(0, 33, True)]


def test_single_overflow_skips_are_one_info_per_cluster_with_the_time_they_cost() -> None:
    # One skip every ~10 steps over steps 1000-1040 (the scaler probing a higher scale and falling back), then
    # one more 500 steps later: two info anomalies, never a warning. Steps of 2 s: the badput is 2 s a skip.
    skipped = {1000, 1010, 1011, 1025, 1040, 1540}
    aggs = [StepAggregate(s, 0, 0.0, None, 2.0 * s, 2.0, 1.0, None, None, None, 1, (None,), 0.0, skipped=s in skipped,
                          step_s=2.0) for s in range(2000)]
    got = feed([SkippedStepsDetector()], aggs)
    assert [(a.severity, a.status, a.step, a.end_step, a.evidence["steps"], a.evidence["runs"], a.evidence["lost_s"])
            for a in got] == [
        ("info", "resolved", 1000, 1000, 1, 1, 2.0), ("info", "resolved", 1000, 1011, 3, 2, 6.0),
        ("info", "resolved", 1000, 1025, 4, 3, 8.0), ("info", "resolved", 1000, 1040, 5, 4, 10.0),
        ("info", "resolved", 1540, 1540, 1, 1, 2.0)]
    assert len({a.id for a in got}) == 2  # one anomaly per cluster, updated
    assert got[1].message == ("the optimizer skipped 3 steps in 2 short runs, steps 1000-1011 (fp16 loss-scale "
                              "overflow; 6 s lost): the loss scaler lowered its scale, as it does after an overflow; "
                              "worth a look only if it keeps happening")
    # A short run right before a run of 3 is its own info; the run of 3 the warning, which then takes the skips
    # that follow until 20 applied steps in a row end it.
    got = feed([SkippedStepsDetector()], [agg(s, 2.0, skipped=s in {100, 105, 106, 107, 110}) for s in range(200)])
    assert [(a.severity, a.status, a.step, a.end_step, a.evidence["steps"]) for a in got] == [
        ("info", "resolved", 100, 100, 1), ("warning", "active", 105, None, 3), ("warning", "resolved", 105, 110, 4)]


def test_nan_inf_ignores_an_overflow_the_optimizer_skipped() -> None:
    inf = float("inf")
    got = feed([NanInfDetector()], [agg(0, 2.0, 1.0), agg(1, 2.0, inf, skipped=True), agg(2, 2.0, 1.0),
                                    agg(3, 2.0, inf), agg(4, 2.0, 1.0)])
    assert [(a.status, a.step, a.end_step, a.severity) for a in got] == [("active", 3, None, "warning"),
                                                                         ("resolved", 3, 3, "warning")]


def test_overflow_skips_during_a_spike_make_it_divergence_at_once() -> None:
    aggs = spiked({s: 1.6 for s in range(1200, 1400)})
    aggs = [agg(a.step, a.loss, skipped=1200 <= a.step < 1204) for a in aggs]
    got = feed([LossSpikeDetector(), DivergenceDetector(), SkippedStepsDetector()], aggs)
    # the third skip in a row (step 1202) decides it: spike not recovered, divergence, and the skipped-steps run
    assert [(a.kind, a.status, a.step, a.end_step) for a in got] == [
        ("loss_spike", "active", 1200, None), ("loss_spike", "resolved", 1200, 1202),
        ("divergence", "active", 1200, None), ("skipped_steps", "active", 1200, None),
        ("skipped_steps", "resolved", 1200, 1203), ("divergence", "resolved", 1200, 1399)]
    assert (got[1].evidence["skipped_run"], got[2].evidence["reason"]) == (3, "overflow_skips")


@pytest.mark.parametrize("module", [f"trainhealth.detectors.{name}" for name in (
    "loss_spike", "grad_norm_spike", "divergence", "grad_norm_explosion", "skipped_steps", "nan_inf")])
def test_doctests(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
