"""Every real log in ../shared/real_logs through format detection and its importer: counts and exact values.

Values are the files' own (see ../shared/real_logs/MANIFEST.md); a file added there without
an entry in REAL below fails ``test_every_real_log_is_covered``.

The Kineto profiler traces and the all-reduce benchmark are per-rank logs (``LogPoint.rank`` set):
their values, and their analysis as multi-rank runs, are in tests/test_multirank_logs.py. The NCCL
watchdog and torchelastic logs hold no training steps, only events (``LogEvent``, :func:`read_items`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from trainhealth.collectors.importers import detect, read, read_items
from trainhealth.commands.replay import read_points, replay
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import DetectorService
from trainhealth.exceptions import InputFormatError
from trainhealth.logpoint import LogEvent, LogPoint

# file → (format, points read (train + eval)); None format = refused (the error's text instead).
REAL: dict[str, tuple[str | None, int | str]] = {
    "hf_tinyllama_sft_healthy.trainer_state.json": ("hf_trainer_state", 200),
    "hf_trocr_large_gradnorm.trainer_state.json": ("hf_trainer_state", 707),
    "hf_whisper_small_lr_too_high.trainer_state.json": ("hf_trainer_state", 25),
    "tensorboard_t5_summarization": ("tensorboard", 430),
    "lightning_slm_wikitext103.metrics.csv": ("lightning_csv", 2824),  # 2814 train rows, 10 validation rows
    "llamafactory_mistral7b_translator.trainer_log.jsonl": ("llamafactory", 866),
    "megatron_mixtral8x7b_h100.golden_values.json": ("megatron_golden", 4538),
    "modded_nanogpt_soap.log": ("modded_nanogpt", 6000),
    "megatron_deepspeed_bloom176b_excerpt.log": ("megatron", 18),
    "megatron_deepspeed_104b_overflow_excerpt.log": ("megatron", 19),
    "pytorch_word_lm_all_nan.log": ("word_lm", 70),
    "allreduce_bench_16ranks.log": ("allreduce_bench", 80),          # 16 ranks x 5 iterations
    "kineto_trace_rank0_ws128.json.gz": ("kineto_trace", 2),         # ProfilerStep#551, #552
    "kineto_trace_rank1_ws128.json.gz": ("kineto_trace", 2),
    "nccl_watchdog_timeout_multirank.log": ("nccl_watchdog", 0),     # events only (EVENTS)
    "torchelastic_worker_group_restart.log": ("torchelastic", 0),
    "megatron_bert_release_a100.golden_values.json": ("megatron_golden", 4001),  # steps 1, 5, …, 20000
    "llamafactory_luojiu7b_cpt.trainer_log.jsonl": ("llamafactory", 1742),     # steps 5-8710; the summary row is not
    "hf_overfit_30epochs.trainer_state.json": ("hf_trainer_state", 216),       # 30 train + 31 x 6 eval sets
    "llmc_gpt2_124m_main.log": ("llmc", 19632),                                # steps 0-19551 + 80 validations
    "deepspeed_overflow_tqdm_hf.log": ("hf_stdout", 17),                       # bar counters 243-259
    "hf_stdout_loss_zero_gradnorm_nan.log": ("hf_stdout", 10),                 # 10 whole dicts, the 11th cut
    "mmengine_text_loss_nan.log": ("mmengine", 1),
    "tf_deeplab_steps_checkpoint.log": ("text_kv", 30),                        # steps 12972-13001
}
#: file → events read (``read_items`` LogEvents), for the files that report any; 0 for the others.
EVENTS: dict[str, int] = {
    "nccl_watchdog_timeout_multirank.log": 5,  # 3 ranks' timeouts, 2 ranks' last enqueued / completed
    "torchelastic_worker_group_restart.log": 1,
    "tf_deeplab_steps_checkpoint.log": 1,  # "The checkpoint has been created." after step 12999
}


def steps(real_logs: Path, name: str) -> dict[int, LogPoint]:
    return {p.step: p for p in read(real_logs / name) if not p.is_eval}


def test_every_real_log_is_covered(real_logs: Path) -> None:
    assert sorted(p.name for p in real_logs.iterdir() if p.name != "MANIFEST.md") == sorted(REAL)


@pytest.mark.parametrize("name", sorted(REAL))
def test_detected_format_and_point_count(real_logs: Path, name: str) -> None:
    fmt, expected = REAL[name]
    if fmt is None:
        with pytest.raises(InputFormatError) as err:
            detect(real_logs / name)
        assert str(err.value).startswith(f"{real_logs / name}: {expected}")
        assert "supported formats: hf_trainer_state (" in str(err.value)
        return
    assert detect(real_logs / name) == fmt
    assert len(list(read(real_logs / name))) == expected
    items = list(read_items(real_logs / name))
    assert (len(items) - expected, sum(isinstance(i, LogEvent) for i in items)) == (EVENTS.get(name, 0),) * 2
    if expected:
        assert len(read_points(real_logs / name)) == expected
    else:  # replay pushes training steps: a log of events only has none to replay
        with pytest.raises(InputFormatError, match=f"no training steps to replay \\(read as {fmt}\\)"):
            read_points(real_logs / name)


def test_hf_trainer_state_files(real_logs: Path) -> None:
    tiny = list(read(real_logs / "hf_tinyllama_sft_healthy.trainer_state.json"))
    assert sum(p.is_eval for p in tiny) == 14
    train = [p for p in tiny if not p.is_eval]
    assert [p.step for p in train] == list(range(15, 2791, 15))
    assert (train[0].loss, train[0].tokens, train[-1].loss) == (2.0762, 61440, 1.025)
    trocr = steps(real_logs, "hf_trocr_large_gradnorm.trainer_state.json")
    assert sorted(trocr) == list(range(2, 1401, 2))
    assert (trocr[680].loss, trocr[682].loss, trocr[684].loss) == (0.1839, 0.4896, 0.1485)
    assert trocr[682].grad_norm == 1894075.125
    whisper = steps(real_logs, "hf_whisper_small_lr_too_high.trainer_state.json")
    assert [(s, p.loss) for s, p in whisper.items()] == [
        (500, 1.2366), (1000, 2.028), (1500, 2.157), (2000, 1.9848), (2500, 1.7866)]


def test_tensorboard_t5_grad_norm_spikes(real_logs: Path) -> None:
    tb = steps(real_logs, "tensorboard_t5_summarization")
    assert sorted(tb) == list(range(500, 215001, 500))
    assert tb[164000].grad_norm == pytest.approx(13.1679239, rel=1e-7)
    assert tb[190000].grad_norm == pytest.approx(35.5915413, rel=1e-7)
    assert max(p.grad_norm for s, p in tb.items() if s not in (164000, 190000)) == pytest.approx(5.8833156, rel=1e-7)
    assert (tb[164000].loss, tb[190000].loss) == (pytest.approx(1.7571, abs=1e-6), pytest.approx(1.7553, abs=1e-6))
    assert tb[500].loss == pytest.approx(1.9963, abs=1e-6)
    assert tb[215000].loss == pytest.approx(1.7423, abs=1e-6)
    assert tb[500].lr == pytest.approx(4.98839e-05, rel=1e-5)
    assert tb[500].step_seconds is None  # the first point has no previous wall time
    assert tb[190000].step_seconds == pytest.approx(0.2585730, rel=1e-6)  # wall-time difference / 500 steps


def test_lightning_metrics_csv(real_logs: Path) -> None:
    items = list(read(real_logs / "lightning_slm_wikitext103.metrics.csv"))
    evals = [p for p in items if p.is_eval]  # the 10 validation rows, one per epoch, val_loss falling
    assert len(evals) == 10 and all(p.eval_losses[0][0] == "val" for p in evals)
    val = [p.eval_losses[0][1] for p in evals]
    assert val == sorted(val, reverse=True)
    pts = [p for p in items if not p.is_eval]
    assert (pts[0].step, pts[0].loss, pts[0].source_line) == (49, 7.628580570220947, 2)
    assert (pts[-1].step, pts[-1].loss, pts[-1].source_line) == (140699, 3.565943479537964, 2833)
    assert [p.step for p in pts[:3]] == [49, 99, 149]
    # validation and epoch-end rows (val_loss, train_loss_epoch) are not steps: 2834 rows - 10 - 10
    assert all(p.lr is None and p.grad_norm is None and p.step_seconds is None for p in pts)
    assert (pts[281].step, pts[281].loss, pts[282].step) == (14099, 4.139174938201904, 14149)


def test_llamafactory_rows(real_logs: Path) -> None:
    pts = list(read(real_logs / "llamafactory_mistral7b_translator.trainer_log.jsonl"))
    assert [p.step for p in pts] == list(range(10, 8661, 10))
    assert (pts[0].loss, pts[0].lr, pts[0].step_seconds) == (2.4977, 5.773672055427253e-07, 2.4)  # 0:00:24 / 10
    assert (pts[-1].loss, pts[-1].lr, pts[-1].source_line) == (0.1333, 0.0, 866)
    # "throughput": "0.00" and "total_tokens": 0 on every row mean "not recorded"
    assert {p.tokens for p in pts} == {None}
    assert min(p.step_seconds for p in pts) == 2.0 and max(p.step_seconds for p in pts) == 2.7


def test_llamafactory_four_day_run_elapsed_in_days(real_logs: Path) -> None:
    pts = list(read(real_logs / "llamafactory_luojiu7b_cpt.trainer_log.jsonl"))
    # the last row (step 8712, "loss": null, "learning_rate": null) is the closing summary: not a step, not a NaN
    assert [p.step for p in pts] == list(range(5, 8711, 5))
    assert (pts[0].loss, pts[0].step_seconds, pts[-1].loss) == (1.7484, 41.8, 1.3703)  # "0:03:29" / 5 steps
    assert not any(math.isnan(p.loss) for p in pts)
    by_step = {p.step: p for p in pts}
    # "elapsed_time" crosses into days: "23:58:27" -> "1 day, 0:02:01", "1 day, 23:58:37" -> "2 days, 0:02:10"
    assert (by_step[2025].step_seconds, by_step[4050].step_seconds) == (pytest.approx(42.8), pytest.approx(42.6))
    seconds = [p.step_seconds for p in pts]  # ~213 s per 5 steps throughout
    assert (min(seconds), max(seconds)) == (41.0, 43.4)
    assert (by_step[5810].step_seconds, by_step[6625].step_seconds) == (41.0, 43.4)


def test_megatron_bert_golden_values(real_logs: Path) -> None:
    g = steps(real_logs, "megatron_bert_release_a100.golden_values.json")
    # lm loss every 5 steps to 20000 of a declared 25000: the "nan" strings after it are "not recorded"
    assert sorted(g) == [1, *range(5, 20001, 5)]
    assert (g[1].loss, g[20000].loss, g[19995].loss) == (10.51817, 4.81103, 4.30228)
    assert not any(math.isnan(p.loss) for p in g.values())
    # iteration-time only every 100th step ("nan" at the others: not recorded), warm-up at step 100
    assert [s for s, p in sorted(g.items()) if p.step_seconds is not None] == list(range(100, 20001, 100))
    assert (g[100].step_seconds, g[200].step_seconds, g[20000].step_seconds) == (0.89451, 0.3366, 0.33554)
    later = {s: p.step_seconds for s, p in g.items() if p.step_seconds is not None and s > 100}
    assert (min(later.values()), later[5300], max(later.values()), later[10800]) == (0.32662, 0.32662, 0.37022,
                                                                                     0.37022)
    assert {(p.grad_norm, p.lr) for p in g.values()} == {(None, None)}  # num-zeros, memory: not step metrics


def test_hf_trainer_state_with_six_eval_sets(real_logs: Path) -> None:
    pts = list(read(real_logs / "hf_overfit_30epochs.trainer_state.json"))
    train = [p for p in pts if not p.is_eval]
    assert [p.step for p in train] == list(range(401, 12031, 401))
    assert (train[0].loss, train[-1].loss, min(p.loss for p in train)) == (1.1074, 0.0549, 0.0531)  # never 0
    assert train[0].grad_norm == 5.49674654006958
    # one entry per eval set, eval_g0_runtime … eval_g5_runtime, at step 0 and after every epoch
    evals = [p for p in pts if p.is_eval]
    assert len(evals) == 186 and sorted({p.step for p in evals}) == [0, *range(401, 12031, 401)]
    assert [p.eval_seconds for p in evals[:7]] == [5.7095, 5.9196, 6.0146, 6.0628, 6.2888, 6.5105, 5.1178]
    assert math.fsum(p.eval_seconds for p in evals) == pytest.approx(1131.0613)


def test_megatron_golden_values(real_logs: Path) -> None:
    g = steps(real_logs, "megatron_mixtral8x7b_h100.golden_values.json")
    # steps 1-24000 every 5; "nan" strings (every step after 22685) = not recorded
    assert sorted(g) == [1, *range(5, 22686, 5)]
    assert (g[3845].loss, g[3850].loss, g[3855].loss) == (2.45451, 3.41116, 2.64597)
    assert (g[4255].loss, g[4260].loss, g[4265].loss) == (2.43455, 3.02472, 2.49236)
    assert (g[1].loss, g[1].step_seconds) == (12.66665, 92.35132)
    assert [g[s].step_seconds for s in (9870, 20020, 20455)] == [88.10275, 21.10315, 26.97059]
    assert (g[22685].loss, g[22685].step_seconds) == (1.9726, 8.73795)
    assert not any(math.isnan(p.loss) for p in g.values())


def test_modded_nanogpt_soap(real_logs: Path) -> None:
    m = steps(real_logs, "modded_nanogpt_soap.log")
    assert sorted(m) == list(range(1, 6001))
    assert (m[918].loss, m[919].loss, m[920].loss) == (3.8561, 5.0667, 3.783)
    assert (m[946].loss, m[947].loss, m[948].loss) == (3.6821, 5.2862, 3.8458)
    assert (m[1105].loss, m[1106].loss, m[1107].loss) == (3.6104, 4.3535, 3.5152)
    assert not any(math.isnan(p.loss) for p in m.values())  # step_avg:nanms is text, not a NaN loss
    # train_time is cumulative, stops during validation and restarts from 0 after step 10
    assert m[1].step_seconds == pytest.approx(23.874)  # 24179 ms - 305 ms (the step-0 validation line)
    assert m[11].step_seconds == pytest.approx(1.539)  # the reset: 1539 ms for step 11 alone
    assert (m[20].step_seconds, m[21].step_seconds, m[22].step_seconds) == (
        pytest.approx(0.253), pytest.approx(1.325), pytest.approx(0.251))  # every 10th step is slow
    assert [s for s, p in sorted(m.items()) if p.step_seconds > 1.0][:4] == [1, 11, 21, 31]
    assert m[6000].step_seconds == pytest.approx(0.256)


def test_bloom_176b_excerpt(real_logs: Path) -> None:
    b = steps(real_logs, "megatron_deepspeed_bloom176b_excerpt.log")
    assert sorted(b) == [12695, *range(31214, 31223), 31250, 31251, *range(42780, 42785), 45000]
    p = b[31219]
    assert (p.loss, p.grad_norm, p.lr, p.step_seconds, p.consumed_samples) == (
        5.098124, 960.351, 5.279e-05, 106.36, 47778736)
    assert [b[s].loss for s in (31214, 31216, 31219, 31220, 31250)] == [
        2.198845, 2.595213, 5.098124, 3.492029, 2.215699]
    # the hard-wrapped block: 'learning' / ' rate:' and 'number of nan' / 'iterations:' re-joined
    assert [(b[s].step_seconds, b[s].lr, b[s].loss) for s in (42782, 42783, 42784)] == [
        (106.25, 4.475e-05, 2.110646), (110.17, 4.475e-05, 2.12482), (111.14, 4.475e-05, 2.127643)]
    assert {q.skipped for q in b.values()} == {0}
    assert b[31219].tokens == 4194304  # consumed tokens 97850851328 - 97846657024
    assert b[12695].tokens == 20155564032  # the first line: everything consumed since the start


def test_megatron_104b_overflow_excerpt(real_logs: Path) -> None:
    m = steps(real_logs, "megatron_deepspeed_104b_overflow_excerpt.log")
    assert sorted(m) == [6502, 6503, 6504, 8600, 12000, 12001, 13251, 14000, 16800, 16801, *range(17060, 17069)]
    # DeepSpeed "OVERFLOW! Rank 0 Skipping step" lines while Megatron prints "skipped iterations: 0"
    assert [s for s, p in sorted(m.items()) if p.skipped] == [17062, 17063, 17064, 17065, 17067, 17068]
    assert {m[s].grad_norm for s in (17061, 17062, 17063, 17064, 17065)} == {464441.887}
    assert {m[s].grad_norm for s in (17066, 17067, 17068)} == {879946.622}
    assert [m[s].loss for s in (17060, 17061, 17062, 17068)] == [2.665295, 2.667121, 4.374269, 4.137348]
    assert (m[17062].step_seconds, m[17062].consumed_samples) == (pytest.approx(422.832), 8130784)
    w = m[13251]  # wrapped over three lines, "iteratio" / "ns:" split mid-word
    assert (w.loss, w.lr, w.grad_norm, w.skipped, w.step_seconds) == (
        2.924229, 5.996e-05, 122160.116, 0, pytest.approx(220.6319))


def test_word_lm_all_nan(real_logs: Path) -> None:
    pts = list(read(real_logs / "pytorch_word_lm_all_nan.log"))
    assert all(math.isnan(p.loss) for p in pts)
    assert [p.step for p in pts[:2]] == [200, 400]
    assert pts[14].step == 2983 + 200  # epoch 2: (epoch - 1) * 2983 batches + 200
    assert pts[-1].step == 4 * 2983 + 2800
    assert sorted({p.lr for p in pts}) == [0.3125, 1.25, 5.0, 20.0]
    assert min(p.step_seconds for p in pts) == pytest.approx(0.01115)
    assert max(p.step_seconds for p in pts) == pytest.approx(0.01161)


def test_nccl_watchdog_timeouts_of_several_ranks(real_logs: Path) -> None:
    """Ranks 0, 4 and 2 time out ALLREDUCE SeqNum 1580 (rank 2's line is cut after its WorkNCCL(...): its wait
    is not in the file); ranks 0 and 3 report their progress, in process group 1."""
    evs = list(read_items(real_logs / "nccl_watchdog_timeout_multirank.log"))
    work = (("op", "ALLREDUCE"), ("seq", 1580), ("timeout_s", 600.0), ("numel_in", 466119168),
            ("numel_out", 466119168))
    progress = (("seq", 1580), ("last_enqueued", 1582), ("last_completed", 1579), ("pg", "1"))
    assert evs == [
        LogEvent("collective_timeout", rank=0, seconds=600.06, fields=work, source_line=1),
        LogEvent("collective_timeout", rank=4, seconds=600.067, fields=work, source_line=2),
        LogEvent("collective_timeout", rank=0, fields=progress, source_line=3),
        LogEvent("collective_timeout", rank=3, fields=progress, source_line=4),
        LogEvent("collective_timeout", rank=2, seconds=None, fields=work, source_line=5),
    ]


def test_torchelastic_worker_group_restart(real_logs: Path) -> None:
    """'Worker group FAILED. 3/3 attempts left' then the rendezvous' restart_count=1 (line 5): one restart; the
    excerpt does not say which worker failed."""
    assert list(read_items(real_logs / "torchelastic_worker_group_restart.log")) == [
        LogEvent("worker_restart", fields=(("restart_count", 1), ("attempts_left", 3), ("max_restarts", 3),
                                           ("state", "FAILED"), ("role", "default")), source_line=5)]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "trainhealth.collectors.importers" and r.levelno == logging.WARNING]


def test_llmc_gpt2_124m(real_logs: Path) -> None:
    pts = list(read(real_logs / "llmc_gpt2_124m_main.log"))
    train = {p.step: p for p in pts if not p.is_eval}
    assert sorted(train) == list(range(19552))  # "s:N trl:…" for steps 0-19551: 19,552 steps
    # "s:N tel:…" validation losses every 250 steps and after the last: evaluations; "s:N eval:…" (HellaSwag) is not
    assert [p.step for p in pts if p.is_eval] == [*range(0, 19501, 250), 19552]
    assert (train[0].loss, train[0].lr, train[0].grad_norm) == (11.0116, 1e-06, 14.96)
    assert (train[19551].loss, train[19551].lr, train[19551].grad_norm) == (3.2813, 0.0, 0.23)
    # two isolated grad-norm blips: 8715 (4.29 against 0.28 / 0.41 around it) and 12008 (1.50)
    assert [(train[s].grad_norm, train[s].loss) for s in (8714, 8715, 8716)] == [
        (0.28, 3.468), (4.29, 3.5416), (0.41, 3.4668)]
    assert [(train[s].grad_norm, train[s].loss) for s in (12007, 12008, 12009)] == [
        (0.27, 3.3752), (1.5, 3.4027), (0.35, 3.3864)]
    assert sorted((p.grad_norm for s, p in train.items() if s > 2000), reverse=True)[:3] == [4.29, 1.5, 0.98]
    assert not any(math.isnan(p.loss) or math.isnan(p.grad_norm) for p in train.values())
    assert {p.step_seconds for p in train.values()} == {None}  # main.log has no times


def test_deepspeed_overflow_under_an_hf_progress_bar(real_logs: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = real_logs / "deepspeed_overflow_tqdm_hf.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        pts = {p.step: p for p in read(path)}
    assert sorted(pts) == list(range(243, 260))  # the redraw of 250 after the dict is no second point
    # "OVERFLOW! Rank 0 Skipping step" is printed after the bar drew 248 and before it drew 249: during the
    # optimizer step of step 249, which it skipped
    assert {s: p.skipped for s, p in pts.items() if p.skipped} == {249: 1}
    assert {p.skipped for s, p in pts.items() if s != 249} == {0}
    # the first line: the bar's rate; then the elapsed clock over each step (whole seconds: 132 or 133)
    assert pts[243].step_seconds == 132.68
    assert [pts[s].step_seconds for s in range(244, 260)] == [133.0, 133.0, 133.0, 132.0, 133.0, 132.0, 133.0, 133.0,
                                                              133.0, 133.0, 133.0, 132.0, 133.0, 133.0, 133.0, 132.0]
    # the log dict after 250/2724 is step 250's
    assert (pts[250].loss, pts[250].lr, pts[250].grad_norm) == (1.89, 0.00019920353585932578, None)
    assert [s for s, p in pts.items() if p.loss is not None] == [250]
    assert _warnings(caplog) == []  # the cut last bar "259/2724 [9:34:48<90:54:" still shows its counter and clock


def test_hf_stdout_loss_zero_and_nan_grad_norm(real_logs: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = real_logs / "hf_stdout_loss_zero_gradnorm_nan.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        pts = list(read(path))
    assert [p.step for p in pts] == list(range(1, 11))  # no bar: the ordinals of the dicts
    assert {(p.loss, p.lr) for p in pts} == {(0.0, 5e-05)}
    assert all(math.isnan(p.grad_norm) for p in pts)
    assert _warnings(caplog) == [
        f"{path}: no training progress bar before the log dicts: their steps are the ordinals of the training dicts "
        "(1, 2, 3, …), not the optimizer steps",
        f"{path}: ends mid-line: line 11 (from byte 1,370) has no line end and does not parse (not a complete flat "
        "dict: the line ends in the string at column 15); truncated? It is left out, the lines before it are read"]


def test_mmengine_loss_nan(real_logs: Path) -> None:
    (p,) = read(real_logs / "mmengine_text_loss_nan.log")
    # Epoch(train) [1][ 500/2931]: step (1 - 1) x 2931 + 500; "time: 0.0578" s per iteration
    assert (p.step, p.lr, p.step_seconds, p.grad_norm, p.source_line) == (500, 0.02, 0.0578, None, 1)
    assert math.isnan(p.loss)


def test_tf_deeplab_steps_and_a_checkpoint(real_logs: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = real_logs / "tf_deeplab_steps_checkpoint.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        items = list(read_items(path))
    pts = {i.step: i for i in items if isinstance(i, LogPoint)}
    assert sorted(pts) == list(range(12972, 13002))
    assert (pts[12972].loss, pts[12972].step_seconds) == (0.428, 1.019)
    assert (pts[13000].loss, pts[13000].step_seconds) == (5.128, 5.495)  # the step that saved the checkpoint
    assert (pts[13001].loss, pts[13001].step_seconds) == (0.86, 0.743)
    before = [p for s, p in pts.items() if s < 13000]
    assert statistics.median(p.loss for p in before) == 0.854
    assert (min(p.step_seconds for p in before), max(p.step_seconds for p in before)) == (0.981, 1.036)
    # "The checkpoint has been created." after step 12999's line
    assert [i for i in items if isinstance(i, LogEvent)] == [LogEvent("checkpoint_save", step=12999, source_line=29)]
    assert _warnings(caplog) == [f"{path}: ends mid-line: line 32 (from byte 1,353) has no line end and does not "
                                 "parse; truncated? It is left out, the lines before it are read"]  # "ste"


def _drain(client: redis.Redis) -> None:
    svc = DetectorService(client, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=60))
    for _ in range(1000):
        if svc.run_once(block_ms=20) == 0:
            break
    svc._tick(svc.clock() + 10)


def _anomalies(client: redis.Redis, run: str) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in client.hgetall(f"th:{{{run}}}:anomalies").items()}


def test_replay_of_megatron_104b_uses_logged_times_and_skips(r: redis.Redis, real_logs: Path) -> None:
    path = real_logs / "megatron_deepspeed_104b_overflow_excerpt.log"
    pts = read_points(path)
    res = replay(path, r, run="m104b", points=pts)
    assert res.points == 19
    # The timeline is the log's own elapsed time per iteration, not the assumed 1 s per step.
    # The first logged step takes one step's time (the excerpt's earlier steps are not on the timeline).
    prev, span = pts[0].step - 1, 0.0
    for p in pts:
        span += (p.step - prev) * p.step_seconds
        prev = p.step
    assert res.span_s == pytest.approx(span)
    _drain(r)
    snap = json.loads(r.get("th:{m104b}:ledger:latest"))
    skipped = [p.step_seconds for p in pts if p.skipped]
    assert snap["seconds"]["skipped_steps"] == pytest.approx(math.fsum(skipped), abs=1e-3)


def test_replay_of_real_logs_flags_what_current_detectors_can(r: redis.Redis, real_logs: Path) -> None:
    """The anomalies today's detectors already raise on these logs (the rest needs detector work)."""
    replay(real_logs / "pytorch_word_lm_all_nan.log", r, run="wlm")
    _drain(r)
    found = _anomalies(r, "wlm")
    assert sorted(found) == ["nan_inf:*:200:0"]
    assert (found["nan_inf:*:200:0"]["severity"], found["nan_inf:*:200:0"]["evidence"]["steps"]) == ("critical", 70)
    r.flushdb()
    replay(real_logs / "megatron_mixtral8x7b_h100.golden_values.json", r, run="mixtral")
    _drain(r)
    spikes = {a["evidence"]["peak_step"] for a in _anomalies(r, "mixtral").values() if a["kind"] == "loss_spike"}
    assert {3850, 4260} <= spikes
    r.flushdb()
    replay(real_logs / "modded_nanogpt_soap.log", r, run="modded")
    _drain(r)
    spikes = {a["evidence"]["peak_step"] for a in _anomalies(r, "modded").values() if a["kind"] == "loss_spike"}
    assert {919, 947} <= spikes


def test_replay_carries_a_megatron_line_without_its_loss_to_the_service(r: redis.Redis) -> None:
    # the same anomaly as `trainhealth analyze` (tests/test_loss_detectors.py): the missing loss travels the wire
    path = Path(__file__).parent / "data" / "importers" / "megatron_lm_loss_missing.log"
    replay(path, r, run="lossless")
    _drain(r)
    found = _anomalies(r, "lossless")
    assert sorted(found) == ["nan_inf:*:1940:0"]
    a = found["nan_inf:*:1940:0"]
    assert (a["severity"], a["evidence"]["reason"], a["evidence"]["loss_missing"]) == ("critical", "loss_missing", 3)


def test_cli_replays_a_megatron_log(r: redis.Redis, redis_url: str, real_logs: Path) -> None:
    path = real_logs / "megatron_deepspeed_bloom176b_excerpt.log"
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    out = subprocess.run([sys.executable, "-m", "trainhealth", "replay", str(path), "--run", "bloom"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert "replayed 18 steps and 0 evaluations" in out.stdout
    assert r.hget("th:{bloom}:meta", "source") == b"replay:megatron_deepspeed_bloom176b_excerpt.log"
    assert r.xlen("th:{bloom}:steps") >= 1


def test_cli_refuses_a_broken_profiler_trace_before_touching_redis() -> None:
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": "redis://127.0.0.1:1/0"}  # never reached
    path = Path(__file__).parent / "data" / "importers" / "kineto_bad_dur.json"
    out = subprocess.run([sys.executable, "-m", "trainhealth", "replay", str(path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr == (f"trainhealth: error: {path}: traceEvents[1] (ProfilerStep#2): field 'dur' is not a "
                          "non-negative number of microseconds: 'abc'\n")
