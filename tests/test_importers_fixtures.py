"""Hand-made fixtures (tests/data/importers/) for every format: exact values, exact errors and warnings."""

from __future__ import annotations

import gzip
import json
import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainhealth.collectors.importers import FORMATS, detect, read, read_items
from trainhealth.commands.replay import read_points
from trainhealth.exceptions import ConfigError, InputFormatError
from trainhealth.logpoint import LogEvent, LogPoint

DATA = Path(__file__).resolve().parent / "data" / "importers"
ROOT = DATA.parent.parent.parent


def rows(path: Path, *fields: str, **kw) -> list[tuple]:
    return [tuple(getattr(p, f) for f in ("step", *fields)) for p in read(path, **kw)]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "trainhealth.collectors.importers" and r.levelno == logging.WARNING]


@pytest.mark.parametrize(("name", "fmt"), [
    ("megatron_lm.log", "megatron"), ("megatron_lm_loss_missing.log", "megatron"), ("gpt_neox.log", "megatron"),
    ("nemo.log", "megatron"),
    ("megatron_deepspeed_overflow.log", "megatron"), ("megatron_wrapped_partly_bad.log", "megatron"),
    ("megatron_all_bad.log", "megatron"), ("nanogpt.log", "nanogpt"), ("nanogpt_partly_bad.log", "nanogpt"),
    ("modded_nanogpt.log", "modded_nanogpt"), ("modded_nanogpt_record_no_train_loss.log", "modded_nanogpt"),
    ("word_lm.log", "word_lm"), ("lightning_metrics.csv", "lightning_csv"),
    ("lightning_bad_value.csv", "lightning_csv"), ("lightning_bad_row.csv", "lightning_csv"),
    ("wandb_history.csv", "wandb_csv"),
    ("wandb_chart_export.csv", "wandb_csv"), ("wandb_chart_two_runs.csv", "wandb_csv"),
    ("wandb-history.jsonl", "wandb_jsonl"), ("wandb_bad_value.jsonl", "wandb_jsonl"),
    ("trainer_log.jsonl", "llamafactory"), ("llamafactory_bad_elapsed.trainer_log.jsonl", "llamafactory"),
    ("golden_values_dev_dgx_h100.json", "megatron_golden"), ("golden_values_bad.json", "megatron_golden"),
    ("nemo_expected.json", "megatron_golden"), ("metrics.jsonl", "jsonl"), ("bad_step.jsonl", "jsonl"),
    ("header_only.csv", "csv"),
    ("allreduce_bench.log", "allreduce_bench"), ("allreduce_bench_partly_bad.log", "allreduce_bench"),
    ("allreduce_bench_all_bad.log", "allreduce_bench"), ("kineto_rank3.pt.trace.json", "kineto_trace"),
    ("kineto_nodist_rank5.json.gz", "kineto_trace"), ("kineto_bad_dur.json", "kineto_trace"),
    ("nccl_watchdog_variants.log", "nccl_watchdog"), ("torchelastic_restarts.log", "torchelastic"),
    ("llmc_main.log", "llmc"), ("llmc_trl_only.log", "llmc"), ("llmc_train_time.log", "llmc"),
    ("hf_stdout_tqdm_eval.log", "hf_stdout"), ("hf_stdout_printer.log", "hf_stdout"), ("tqdm_postfix.log", "hf_stdout"),
    ("mmengine_iter.log", "mmengine"), ("mmcv_epoch.log", "mmengine"), ("mmcv_iter.log", "mmengine"),
    ("llmc_stdout.log", "text_kv"), ("kv_pairs.log", "text_kv"), ("kv_clock.log", "text_kv"),
])
def test_detect(name: str, fmt: str) -> None:
    assert detect(DATA / name) == fmt


def test_detect_by_content_alone(tmp_path: Path, real_logs: Path) -> None:
    """Renamed to a name that says nothing, every fixture and real log is still recognised."""
    cases = {p: detect(p) for p in DATA.iterdir() if p.name not in ("loss_log.csv", "broken.json")}
    cases.update({real_logs / n: detect(real_logs / n) for n in (
        "hf_trocr_large_gradnorm.trainer_state.json", "llamafactory_mistral7b_translator.trainer_log.jsonl",
        "megatron_mixtral8x7b_h100.golden_values.json")})
    for i, (path, fmt) in enumerate(cases.items()):
        neutral = tmp_path / f"file{i}"
        shutil.copy(path, neutral)
        assert detect(neutral) == fmt, path.name


def test_every_fixture_has_a_detection_case() -> None:
    listed = {"loss_log.csv", "broken.json"}  # undetectable on purpose: see test_unknown_formats
    src = Path(__file__).read_text()
    assert all(f'"{p.name}"' in src for p in DATA.iterdir() if p.name not in listed)


def test_unknown_formats(tmp_path: Path) -> None:
    with pytest.raises(InputFormatError) as err:
        detect(DATA / "loss_log.csv")  # no step column by a common name
    assert str(err.value).startswith(f"{DATA / 'loss_log.csv'}: unknown log format (no line of a known training log "
                                     "in its first 8 MiB); supported formats: hf_trainer_state (Hugging Face "
                                     "trainer_state.json), tensorboard (")
    assert all(f"{name} (" in str(err.value) for name in FORMATS)
    with pytest.raises(InputFormatError, match=r"broken\.json: not valid JSON \(line 1, column 11\): Invalid control"):
        detect(DATA / "broken.json")
    empty = tmp_path / "empty.log"
    empty.write_text("\n\n")
    with pytest.raises(InputFormatError, match=r"empty\.log: empty file; supported formats: "):
        detect(empty)
    with pytest.raises(InputFormatError, match=r"nope\.log: cannot read: No such file or directory"):
        detect(tmp_path / "nope.log")
    with pytest.raises(InputFormatError, match=r": a directory without TensorBoard event files"):
        detect(tmp_path)
    odd = tmp_path / "odd.json"
    odd.write_text('{"a": 1,\n "b": 2}\n')
    with pytest.raises(InputFormatError, match=r"odd\.json: a JSON document of unknown shape; supported"):
        detect(odd)


def test_read_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"fmt='parquet' is not a supported format; formats: hf_trainer_state, "):
        read(DATA / "metrics.jsonl", fmt="parquet")
    with pytest.raises(ConfigError, match=r"mapping is not supported for fmt='megatron'"):
        read(DATA / "megatron_lm.log", mapping={"loss": "x"})
    with pytest.raises(ConfigError, match=r"mapping key 'los' is not a field; fields: step \(the optimizer step"):
        list(read(DATA / "metrics.jsonl", mapping={"los": "x"}))
    with pytest.raises(ConfigError, match=r"mapping\['step'\] is not used for golden values"):
        list(read(DATA / "golden_values_dev_dgx_h100.json", mapping={"step": "x"}))


# --- Megatron-LM / Megatron-DeepSpeed / GPT-NeoX / NeMo text logs ----------------------------------------

def test_megatron_lm() -> None:
    pts = list(read(DATA / "megatron_lm.log"))
    assert [(p.step, p.loss, p.grad_norm, p.lr, p.skipped, p.consumed_samples, p.source_line) for p in pts[:3]] == [
        (1, 10.43863, 26.203, 6.976744e-08, 0, 128, 2),
        (2, 10.44022, 26.305, 1.395349e-07, 0, 256, 3),
        (12, 9.871234, 12.5, 8.372093e-07, 2, 1536, 5),
    ]
    assert [p.step_seconds for p in pts] == pytest.approx([19.1388, 12.9361, 13.1, 13.1])
    last = pts[3]  # every iteration of the interval NaN: Megatron omits the loss and counts them
    assert (last.step, math.isnan(last.loss), math.isnan(last.grad_norm), last.skipped) == (22, True, True, 10)
    assert {p.tokens for p in pts} == {None}  # no consumed tokens on Megatron-LM lines


def test_megatron_lm_line_without_its_loss_is_a_missing_loss() -> None:
    # bf16 run, log interval 10: from iteration 1940 the lines print learning rate, grad norm (nan) and both
    # counters (0) but no "lm loss": Megatron-LM prints a loss only if its interval average is >= 0 (NaN is not)
    pts = list(read(DATA / "megatron_lm_loss_missing.log"))
    assert [(p.step, p.loss, p.grad_norm, p.skipped, p.loss_missing, p.source_line) for p in pts[:3]] == [
        (1910, 2.953117, 1.103, 0, False, 4), (1920, 2.948804, 1.087, 0, False, 5),
        (1930, 2.95126, 1.254, 0, False, 6)]
    assert [(p.step, p.loss, math.isnan(p.grad_norm), p.skipped, p.loss_missing, p.lr) for p in pts[3:]] == [
        (1940, None, True, 0, True, 7.897e-05), (1950, None, True, 0, True, 7.896e-05),
        (1960, None, True, 0, True, 7.895e-05)]


def test_megatron_line_without_loss_explained_by_its_counters(tmp_path: Path) -> None:
    head = " iteration {:8d}/    1000 | elapsed time per iteration (ms): 900.0 | learning rate: 1.000000E-04 | "
    tail = "loss scale: {} | grad norm: {} | number of skipped iterations: {:3d} | number of nan iterations: {:3d} |"
    lines = [head.format(10) + "lm loss: 7.100000E+00 | " + tail.format("65536.0", "3.100", 0, 0),
             head.format(20) + tail.format("32768.0", "inf", 10, 0),  # all 10 iterations skipped: nothing applied
             head.format(30) + "lm loss: 0.000000E+00 | " + tail.format("16384.0", "inf", 10, 0),  # newer Megatron
             head.format(40) + tail.format("16384.0", "nan", 10, 3),  # NaN iterations counted: a NaN loss
             head.format(50) + tail.format("16384.0", "nan", 4, 0)]  # 6 applied iterations, no loss printed
    path = tmp_path / "megatron.log"
    path.write_text("\n".join(lines) + "\n")
    got = [(p.step, None if p.loss is None else str(p.loss), p.skipped, p.loss_missing) for p in read(path)]
    assert got == [(10, "7.1", 0, False), (20, None, 10, False), (30, None, 10, False), (40, "nan", 10, False),
                   (50, None, 4, True)]


def test_gpt_neox_and_nemo() -> None:
    assert rows(DATA / "gpt_neox.log", "loss", "lr", "skipped") == [
        (100, 7.123456, 1.5e-05, 0), (200, 6.54321, 3e-05, 1)]
    assert [p.step_seconds for p in read(DATA / "gpt_neox.log")] == pytest.approx([2.5923, 2.5861])
    nemo = list(read(DATA / "nemo.log"))
    # the step is global_step (the "iteration" restarts each epoch)
    assert [(p.step, p.lr, p.step_seconds, p.consumed_samples) for p in nemo] == [
        (0, 1.499e-07, 61.94, 512), (1, 2.999e-07, 53.67, 1024), (5, 4.498e-07, 46.86, 3072)]
    assert [p.loss for p in nemo[:2]] == [11.03, 11.02] and math.isnan(nemo[2].loss)


def test_deepspeed_overflow_lines_count_as_skipped_steps() -> None:
    assert rows(DATA / "megatron_deepspeed_overflow.log", "loss", "skipped", "tokens", "consumed_samples") == [
        (10, 8.123456, 2, 1310720, 640),   # two OVERFLOW lines before it; Megatron says 0
        (20, 7.654321, 1, 1310720, 1280),  # the fused optimizer's "fp16 dynamic loss scale overflow!"
        (30, 7.345678, 0, 1310720, 1920),
    ]


def test_megatron_wrapped_comments_and_bad_lines(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "megatron_wrapped_partly_bad.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        got = rows(path, "loss", "lr", "grad_norm", "skipped", "tokens", "source_line")
    assert got == [
        (8600, 3.407058, 6e-05, 3035.816, 0, None, 3),
        (13251, 2.924229, 5.996e-05, 122160.116, 0, 4779704320, 6),  # wrapped over 3 lines
        (13253, 2.910001, 5.996e-05, 101234.5, 0, 3276800, 10),     # [default7]: prefix, wrapped over 3 lines
    ]
    # ONE warning: the letter O in a number (line 9) and the line torn by the crash (line 14)
    assert warnings_of(caplog) == [f"{path}: skipped 2 malformed iteration line(s); the first: line 9: "
                                   "field 'lm loss' is not a number: '2.9O1234E+00'"]


def test_megatron_nothing_good_is_an_error() -> None:
    path = DATA / "megatron_all_bad.log"
    with pytest.raises(InputFormatError) as err:
        list(read(path))
    assert str(err.value) == f"{path}: line 1: the line ends before its closing '|' (torn or wrapped beyond repair)"
    with pytest.raises(InputFormatError, match=r"nanogpt\.log: no iteration lines found"):
        list(read(DATA / "nanogpt.log", fmt="megatron"))


# --- nanoGPT, modded-nanogpt, word_language_model ------------------------------------------------------

def test_nanogpt(caplog: pytest.LogCaptureFixture) -> None:
    pts = list(read(DATA / "nanogpt.log"))
    assert [(p.step, p.source_line) for p in pts] == [(0, 4), (10, 5), (20, 6), (30, 7)]
    assert [p.loss for p in pts[:3]] == [10.9321, 9.6543, 8.1234] and math.isnan(pts[3].loss)
    assert [p.step_seconds for p in pts] == pytest.approx([30.72883, 0.4125, 0.41025, 0.40975])
    path = DATA / "nanogpt_partly_bad.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        assert rows(path, "loss", "lr") == [(0, 10.9321, 6e-06), (10, 9.6543, 6e-05)]
    assert warnings_of(caplog) == [f"{path}: skipped 2 malformed nanoGPT iter line(s); the first: line 3: "
                                   "not 'iter N: loss X, time Yms, mfu Z%': 'iter 20: loss 8.12'"]


def test_modded_nanogpt() -> None:
    pts = list(read(DATA / "modded_nanogpt.log"))  # the source code printed first does not match
    assert [(p.step, p.source_line) for p in pts] == [(1, 9), (2, 10), (3, 11), (4, 13), (5, 14)]
    assert [p.loss for p in pts if p.step != 4] == [11.0091, 11.0001, 10.984, 10.9001]
    assert math.isnan(pts[3].loss)  # train_loss:nan is a NaN loss; step_avg:nanms is not
    # 24179 - 305 (the val line); a reset to 0 (1539 alone); 1795 - 1539; 2100 - 1800 (the val line); 2355 - 2100
    assert [p.step_seconds for p in pts] == pytest.approx([23.874, 1.539, 0.256, 0.3, 0.255])
    newer = list(read(DATA / "modded_nanogpt_record_no_train_loss.log"))
    assert [(p.step, p.loss) for p in newer] == [(1, None), (2, None), (3, None)]
    assert [p.step_seconds for p in newer] == pytest.approx([0.142, 0.06, 0.06])


def test_word_lm(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "word_lm.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        pts = list(read(path))
    assert [(p.step, p.lr, p.source_line) for p in pts] == [(200, 20.0, 2), (400, 20.0, 3), (3183, 5.0, 7)]
    assert [p.loss for p in pts[:2]] == [7.63, 6.85] and math.isnan(pts[2].loss)
    assert [p.step_seconds for p in pts] == pytest.approx([0.04512, 0.04498, 0.04501])
    assert warnings_of(caplog) == [f"{path}: skipped 1 malformed '| epoch' line(s); the first: line 8: "
                                   "field 'ms/batch' is not a number: '45.0x'"]


# --- CSV: Lightning, W&B, generic --------------------------------------------------------------------

def test_lightning_csv() -> None:
    items = list(read(DATA / "lightning_metrics.csv"))
    # the val_loss row is an evaluation of set "val"; the train_loss_epoch row is not a step; lr from lr-AdamW
    assert [(p.step, p.eval_losses, p.eval_seconds, p.source_line) for p in items if p.is_eval] == [
        (99, (("val", 2.1),), 0.0, 4)]
    pts = [p for p in items if not p.is_eval]
    assert [(p.step, p.lr, p.source_line) for p in pts] == [(49, 0.001, 2), (99, 0.001, 3), (149, 0.0005, 6)]
    assert [p.loss for p in pts[:2]] == [2.5, 2.25] and math.isnan(pts[2].loss)


def test_lightning_csv_errors() -> None:
    with pytest.raises(InputFormatError) as err:
        list(read(DATA / "lightning_bad_value.csv"))
    path = DATA / "lightning_bad_value.csv"
    assert str(err.value) == f"{path}: line 3 field 'train_loss_step' is not a number: 'two'"
    with pytest.raises(InputFormatError) as err:
        list(read(DATA / "lightning_bad_row.csv"))
    assert str(err.value) == f"{DATA / 'lightning_bad_row.csv'}: line 3: 2 fields, the header has 3"


def test_wandb_history_csv() -> None:
    items = list(read(DATA / "wandb_history.csv"))
    # the step is train/global_step (not W&B's _step); the eval row is an evaluation; "NaN"/"Infinity" strings
    assert [(p.step, p.eval_losses, p.source_line) for p in items if p.is_eval] == [(20, (("eval", 2.4),), 4)]
    pts = [p for p in items if not p.is_eval]
    assert [(p.step, p.loss, p.lr, p.source_line) for p in pts] == [
        (10, 2.75, 1e-05, 2), (20, 2.5, 2e-05, 3), (30, 2.25, 3e-05, 5)]
    assert pts[0].grad_norm == 1.5 and math.isnan(pts[1].grad_norm) and pts[2].grad_norm == math.inf
    assert [p.step_seconds for p in pts] == pytest.approx([4.55, 2.0, 2.0])  # _runtime 45.5 / 10, then differences


def test_wandb_chart_export() -> None:
    assert rows(DATA / "wandb_chart_export.csv", "loss", "source_line") == [(100, 3.25, 2), (200, 3.0, 3)]
    path = DATA / "wandb_chart_two_runs.csv"
    with pytest.raises(InputFormatError) as err:
        list(read(path))
    assert str(err.value) == (f"{path}: line 1: a chart export of 2 runs (run-a, run-b); export one run, or name its "
                              "columns with mapping={'loss': '<run> - <metric>', …}")
    assert rows(path, "loss", fmt="wandb_csv", mapping={"loss": "run-b - train/loss"}) == [(100, 3.5)]


def test_wandb_jsonl(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "wandb-history.jsonl"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        items = list(read(path))
    assert [(p.step, p.eval_losses) for p in items if p.is_eval] == [(99, (("val", 7.1),))]
    pts = [p for p in items if not p.is_eval]
    assert [(p.step, p.lr) for p in pts] == [(49, 0.001), (99, 0.001), (149, 0.0005)]  # trainer/global_step
    assert pts[0].loss == 7.5 and math.isnan(pts[1].loss) and pts[2].loss == 7.25
    assert [p.step_seconds for p in pts] == pytest.approx([12.0 / 49, 0.2, 0.2])
    assert warnings_of(caplog) == [f"{path}: skipped 1 malformed JSON line(s); the first: line 5: not valid JSON "
                                   "(column 54): Expecting ',' delimiter"]
    with pytest.raises(InputFormatError) as err:
        list(read(DATA / "wandb_bad_value.jsonl"))
    assert str(err.value) == f"{DATA / 'wandb_bad_value.jsonl'}: line 2 field 'train/loss' is not a number: 'abc'"


def test_generic_csv_and_jsonl_with_mapping() -> None:
    path = DATA / "loss_log.csv"
    got = list(read(path, fmt="csv", mapping={"step": "it", "loss": "my_loss", "grad_norm": "gnorm",
                                              "wall_time": "wall"}))
    assert [(p.step, p.loss, p.grad_norm, p.step_seconds) for p in got] == [
        (100, 3.5, 1.25, None), (200, 3.25, 1.5, 0.5), (300, 3.0, None, 0.5)]
    with pytest.raises(InputFormatError) as err:
        list(read(path, fmt="csv"))
    assert str(err.value) == (f"{path}: line 1: no step column (looked for 'step', 'global_step', 'train/global_step', "
                              "'trainer/global_step', 'iteration', 'iter', '_step', 'Step', 'current_steps'); "
                              "pass mapping={'step': NAME}")
    with pytest.raises(InputFormatError) as err:
        list(read(path, fmt="csv", mapping={"step": "it", "loss": "loss"}))
    assert str(err.value) == (f"{path}: column 'loss' (mapped to loss) not found; columns: 'it', 'my_loss', 'gnorm', "
                              "'wall'")
    assert rows(DATA / "metrics.jsonl", "loss", "grad_norm", "lr", "source_line") == [
        (1, 4.5, 2.0, 0.0001, 1), (2, 4.25, None, 0.0001, 3)]
    with pytest.raises(InputFormatError) as err:
        list(read(DATA / "bad_step.jsonl"))
    assert str(err.value) == f"{DATA / 'bad_step.jsonl'}: line 2 field 'global_step' is not an integer step: 'two'"
    assert list(read(DATA / "header_only.csv")) == []
    with pytest.raises(InputFormatError, match=r"header_only\.csv: no training steps to replay \(read as csv\)"):
        read_points(DATA / "header_only.csv")


# --- LLaMA-Factory, Megatron golden values -------------------------------------------------------------

def test_llamafactory() -> None:
    items = list(read(DATA / "trainer_log.jsonl"))
    # the eval_loss row is an evaluation of set "eval"; the closing summary row is not a step; total_tokens cumulative
    assert [(p.step, p.eval_losses, p.source_line) for p in items if p.is_eval] == [(10, (("eval", 1.7),), 3)]
    pts = [p for p in items if not p.is_eval]
    assert [(p.step, p.loss, p.lr, p.tokens, p.source_line) for p in pts] == [
        (5, 1.8, 1e-05, 20480, 1), (10, 1.6, 2e-05, 20480, 2), (20, 1.2, 0.0, 40960, 4)]
    # elapsed_time "0:00:10" / 5 steps; 10 s / 5 steps; "1 day, 0:00:46" - 20 s over 10 steps
    assert [p.step_seconds for p in pts] == pytest.approx([2.0, 2.0, 8642.6])
    path = DATA / "llamafactory_bad_elapsed.trainer_log.jsonl"
    with pytest.raises(InputFormatError) as err:
        list(read(path))
    assert str(err.value) == f"{path}: line 2 field 'elapsed_time' is not a number: 'ten seconds'"


def test_megatron_golden_values() -> None:
    pts = list(read(DATA / "golden_values_dev_dgx_h100.json"))
    # "nan" strings (steps 15, 20) = not recorded; a JSON NaN (step 10) is a real NaN loss
    assert [(p.step, p.step_seconds) for p in pts] == [(1, 92.5), (5, 9.25), (10, 9.5)]
    assert [p.loss for p in pts[:2]] == [10.85, 10.12] and math.isnan(pts[2].loss)
    # the older list form (NeMo's expected_json): step = start_step + i * step_interval
    assert rows(DATA / "nemo_expected.json", "loss") == [(0, 11.01242), (5, 9.50525), (10, 8.83931), (15, 8.48559)]
    with pytest.raises(InputFormatError) as err:
        list(read(DATA / "golden_values_bad.json"))
    path = DATA / "golden_values_bad.json"
    assert str(err.value) == f"{path}: metric 'lm loss' value at step 5 is not a number: 'ten'"


# --- TensorBoard (event files written here with tensorboard's own writer) -----------------------------

def _write_events(logdir: Path, events: list[tuple[int, float, dict[str, object]]]) -> Path:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tensorboard.util import tensor_util

    w = EventFileWriter(str(logdir))
    for step, wall, values in events:
        vals = []
        for tag, v in values.items():
            if isinstance(v, str):
                vals.append(summary_pb2.Summary.Value(tag=tag, tensor=tensor_util.make_tensor_proto(v)))
            elif isinstance(v, tuple):  # a one-element tensor (how HF's writer logs scalars)
                vals.append(summary_pb2.Summary.Value(tag=tag, tensor=tensor_util.make_tensor_proto(v[0])))
            else:
                vals.append(summary_pb2.Summary.Value(tag=tag, simple_value=v))
        w.add_event(event_pb2.Event(step=step, wall_time=wall, summary=summary_pb2.Summary(value=vals)))
    w.close()
    (f,) = logdir.glob("events.out.tfevents.*")
    return f


def test_tensorboard(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    f = _write_events(run, [
        (0, 1000.0, {"args/text_summary": "lr=1e-4"}),
        (10, 1020.0, {"train/loss": 2.5, "train/grad_norm": 1.25, "train/learning_rate": (1e-4,)}),
        (20, 1030.0, {"train/loss": (2.25,), "train/grad_norm": 35.5, "train/learning_rate": 2e-4}),
        (20, 1031.0, {"train/epoch": 1.0}),
        (30, 1040.0, {"train/loss": float("nan"), "train/epoch": 1.5}),
    ])
    assert detect(f) == "tensorboard" and detect(run) == "tensorboard"
    pts = list(read(run))
    assert [(p.step, p.grad_norm, p.lr, p.step_seconds) for p in pts] == [
        (10, 1.25, pytest.approx(1e-4), None), (20, 35.5, pytest.approx(2e-4), 1.0), (30, None, None, 1.0)]
    assert [p.loss for p in pts[:2]] == [2.5, 2.25] and math.isnan(pts[2].loss)
    # detection by content when the name says nothing
    plain = tmp_path / "scalars.bin"
    shutil.copy(f, plain)
    assert detect(plain) == "tensorboard"
    # a torn last record (a crash while writing): the records before it stand
    torn = tmp_path / "torn" / f.name
    torn.parent.mkdir()
    torn.write_bytes(f.read_bytes()[:-7])
    assert [p.step for p in read(torn)] == [10, 20]


def test_tensorboard_megatron_tags_and_mapping(tmp_path: Path) -> None:
    f = _write_events(tmp_path, [
        (1, 0.0, {"lm loss": 10.5, "grad-norm": 20.0, "learning-rate": 1e-6, "iteration-time": 92.0}),
        (2, 0.0, {"lm loss": 10.25, "grad-norm": 18.0, "learning-rate": 2e-6, "iteration-time": 11.5,
                  "my/loss": 3.0}),
    ])
    assert rows(f, "loss", "grad_norm", "step_seconds") == [(1, 10.5, 20.0, 92.0), (2, 10.25, 18.0, 11.5)]
    assert rows(f, "loss", mapping={"loss": "my/loss", "grad_norm": None}) == [(1, None), (2, 3.0)]
    with pytest.raises(InputFormatError, match=r"tag 'nope' \(mapped to loss\) not found; tags: 'lm loss', "):
        list(read(f, mapping={"loss": "nope"}))
    with pytest.raises(ConfigError, match=r"mapping\['step'\] is not used for TensorBoard"):
        list(read(f, mapping={"step": "x"}))


def test_tensorboard_errors(tmp_path: Path) -> None:
    f = _write_events(tmp_path, [(1, 0.0, {"accuracy": 0.5})])
    with pytest.raises(InputFormatError) as err:
        list(read(f))
    assert str(err.value).startswith(f"{f}: no loss, grad norm or learning-rate tag (looked for 'train/loss', 'loss', "
                                     "'lm loss', 'train/grad_norm', 'train/learning_rate', …); scalar tags: 'accuracy'")
    junk = tmp_path / "events.out.tfevents.junk"
    junk.write_bytes(b"this is not an event file at all")
    with pytest.raises(InputFormatError, match=r"tfevents\.junk: no TensorBoard event records \(empty, or not"):
        list(read(junk))
    two = tmp_path / "runs"
    for sub in ("a", "b"):
        (two / sub).mkdir(parents=True)
        _write_events(two / sub, [(1, 0.0, {"loss": 1.0})])
    with pytest.raises(InputFormatError, match=r"runs: event files of 2 runs \(a, b\); replay one run directory"):
        detect(two)


# --- event logs: NCCL watchdog, torchelastic --------------------------------------------------------------

def test_nccl_watchdog_line_variants(caplog: pytest.LogCaptureFixture) -> None:
    """The forms of several PyTorch versions: WorkNCCL without SeqNum (TensorShape), without NumelIn, with; the
    glog prefix with or without torchrun's [rankN]:; the process group prefixes; the progress lines, the dump
    signal of a rank told by another; repeats, the periodic INFO line and a wrapped timeout."""
    path = DATA / "nccl_watchdog_variants.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        evs = list(read_items(path))
    ev = lambda rank, line, seconds=None, **f: LogEvent(  # noqa: E731
        "collective_timeout", rank=rank, seconds=seconds, fields=tuple(f.items()), source_line=line)
    assert evs == [
        ev(1, 1, 1804.406, op="BROADCAST", timeout_s=1800.0, tensor_shape="[1024, 1024]"),  # PyTorch 1.9
        ev(0, 2, 1800.745, op="ALLREDUCE", seq=6, timeout_s=1800.0),  # 1.10-1.13: no NumelIn
        # rank 1 of process group 2 is global rank 5 (torchrun's [rank5]: prefix)
        ev(5, 4, 600.031, op="_ALLGATHER_BASE", seq=31, timeout_s=600.0, numel_in=1024, numel_out=16384, group_rank=1),
        ev(5, 5, seq=31, last_enqueued=58, last_completed=30, pg="2", group_rank=1),
        # line 6 ("Timeout at NCCL work") and line 7 (the exception re-raised) repeat rank 5's reports: left out
        ev(2, 8, seq=1, last_enqueued=1, pg="0"),  # last completed 76280750235782912 > last enqueued: uninitialised
        ev(4, 9, last_enqueued=56118, last_completed=56118, pg="0"),  # told by rank 7; line 10 is the periodic INFO
        ev(6, 11, 600.012, op="REDUCE_SCATTER", seq=12, timeout_s=600.0, numel_in=2048, numel_out=256, pg="0"),
        # lines 11-13 are one wrapped timeout; line 14 names no rank; line 15 ends within "ran for 6000…"
        ev(7, 15, op="REDUCE_SCATTER", seq=12, timeout_s=600.0, numel_in=2048, numel_out=256),
    ]
    assert warnings_of(caplog) == [
        f"{path}: skipped 1 malformed NCCL watchdog timeout line(s); the first: line 14: a collective timeout with "
        "no rank before it: 'Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, "
        "NumelIn=1, Numel… (174 characters)"]
    assert list(read(path)) == []  # no training step


def test_nccl_watchdog_file_without_a_report_is_an_error(tmp_path: Path) -> None:
    log = tmp_path / "nccl.log"
    log.write_text("[E ProcessGroupNCCL.cpp:607] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
                   "OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600001 milliseconds before timing out.\n")
    with pytest.raises(InputFormatError, match=r"nccl\.log: line 1: a collective timeout with no rank before it"):
        list(read_items(log, fmt="nccl_watchdog"))
    log.write_text("[rank0]:[E ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: "
                   "WorkNCCL(SeqNum=1, Timeout(ms)=600000) ran for 600001 milliseconds before timing out.\n")
    with pytest.raises(InputFormatError, match=r"line 1: rank 0's WorkNCCL\(...\) has no OpType or Timeout\(ms\)"):
        list(read_items(log, fmt="nccl_watchdog"))


def test_torchelastic_restarts_failures_and_bad_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Restart 1 after local rank 1 (global rank 5 of the node's first rendezvous) was killed (-9); restart 2
    decided (UNHEALTHY, 2/3 left) without its rendezvous in the log; the final ChildFailedError is no restart."""
    path = DATA / "torchelastic_restarts.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        evs = list(read_items(path))
    assert evs == [
        LogEvent("worker_restart", fields=(
            ("restart_count", 1), ("attempts_left", 3), ("max_restarts", 3), ("state", "FAILED"), ("role", "trainer"),
            ("failed_rank", 5), ("failed_local_rank", 1), ("exitcode", -9), ("signal", "SIGKILL"), ("pid", 76626)),
            source_line=18),
        LogEvent("worker_restart", fields=(
            ("restart_count", 2), ("attempts_left", 2), ("max_restarts", 3), ("state", "UNHEALTHY"),
            ("role", "trainer")), source_line=29),  # line 31's restart_count=1 is one already seen: not its own
    ]
    assert warnings_of(caplog) == [
        f"{path}: skipped 2 malformed torchelastic worker group restart line(s); the first: line 30: not '[role] "
        "Worker group STATE. N/M attempts left; will restart worker group': '[trainer] Worker group FAILED. 9/3 "
        "attempts left; will restart worker group'"]


def test_torchelastic_excerpts(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    # The rendezvous of a restart whose FAILED line is before the excerpt; the table names the failed rank.
    log.write_text("  restart_count=2\n  master_addr=a\n")
    assert [e.fields for e in read_items(log, fmt="torchelastic")] == [(("restart_count", 2),)]
    log.write_text("INFO:torch.distributed.elastic.agent.server.api:[default] Rendezvous complete for workers. "
                   "Result:\n  restart_count=0\n  master_addr=a\n")
    with pytest.raises(InputFormatError, match=r"agent\.log: no torchelastic worker group restart lines found"):
        list(read_items(log))  # a start, no restart
    log.write_text("Root Cause (first observed failure):\n[0]:\n  rank      : 3 (local_rank: 3)\n"
                   "  exitcode  : -6 (pid: 7)\n  traceback : Signal 6 (SIGABRT) received by PID 7\n"
                   "=====\n  restart_count=1\n")
    assert [e.fields for e in read_items(log, fmt="torchelastic")] == [(
        ("restart_count", 1), ("failed_rank", 3), ("failed_local_rank", 3), ("exitcode", -6), ("signal", "SIGABRT"),
        ("pid", 7))]


# --- generic behaviour ---------------------------------------------------------------------------------

def test_gzip_is_read_transparently(tmp_path: Path) -> None:
    for name in ("megatron_lm.log", "trainer_log.jsonl", "lightning_metrics.csv", "hf_stdout_tqdm_eval.log"):
        gz = tmp_path / (name + ".gz")
        gz.write_bytes(gzip.compress((DATA / name).read_bytes()))
        assert [repr(p) for p in read(gz)] == [repr(p) for p in read(DATA / name)], name  # repr: nan == nan


def test_logpoint_keeps_its_positional_fields() -> None:
    p = LogPoint(3, 1.5, 0.5, 1e-4, 100, None, 7)
    assert (p.step, p.loss, p.grad_norm, p.lr, p.tokens, p.eval_seconds, p.source_line) == (3, 1.5, 0.5, 1e-4, 100,
                                                                                          None, 7)
    assert (p.step_seconds, p.skipped, p.consumed_samples, p.is_eval) == (None, None, None, False)


def test_collectors_import_stays_standard_library_plus_redis() -> None:
    code = ("import sys, collectors, trainhealth.collectors.importers; "
            "heavy = {'tensorboard', 'numpy', 'pandas', 'torch', 'google.protobuf'} & set(sys.modules); "
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# --- huge numbers, byte-order marks, bad trainer_state entries ------------------------------------------

BIG = "9" * 5000  # beyond int()'s 4,300-digit limit: json.loads alone raises a ValueError naming nothing
STEP400 = "9" * 400  # an int, but no float holds it: the timeline overflowed


def test_huge_numbers_are_refused_naming_file_line_and_field(tmp_path: Path) -> None:
    step_range = "out of range for a step (above 9,007,199,254,740,991)"
    num_range = "out of range for a number (beyond 1.8e308)"
    cases = {  # file name, content → the error (formats whose well-formed rows are all-or-nothing)
        "big.jsonl": ('{"step":1,"loss":1.0}\n{"step":2,"loss":' + BIG + '}\n',
                      f"line 2 field 'loss' is {num_range}: {'9' * 40}… (5,000 characters)"),
        "bigstep.jsonl": ('{"step":1,"loss":1.0}\n{"step":' + STEP400 + ',"loss":2.0}\n',
                          f"line 2 field 'step' is {step_range}: an integer of 400 digits"),
        "bigstep.csv": (f"step,loss\n1,1.0\n{STEP400},2.0\n",
                        f"line 3 field 'step' is {step_range}: '{'9' * 39}… (402 characters)"),
        "hugestep.csv": (f"step,loss\n1,1.0\n{BIG},2.0\n",
                         f"line 3 field 'step' is {step_range}: '{'9' * 39}… (5,002 characters)"),
        "bigloss.csv": (f"step,loss\n1,1.0\n2,{STEP400}\n", f"line 3 field 'loss' is {num_range}: '{'9' * 39}… "
                                                            "(402 characters)"),
        "x.golden_values.json": ('{"lm loss": {"start_step": 1, "step_interval": 1, "values": {"1": 2.0, "2": '
                                 + BIG + "}}}", f"metric 'lm loss' value at step 2 is {num_range}: {'9' * 40}… (5,000 "
                                        "characters)"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(InputFormatError) as err:
            list(read(path))
        assert str(err.value) == f"{path}: {message}", name
    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text('{"traceEvents": [{"ph": "X", "name": "ProfilerStep#' + STEP400 + '", "ts": 1, "dur": 2}]}')
    with pytest.raises(InputFormatError) as err:
        list(read(trace))
    assert str(err.value) == f"{trace}: traceEvents[0] (ProfilerStep#{'9' * 27}): field 'name' step is {step_range}"
    # A big number on the first line must not break format detection either.
    first = tmp_path / "first.jsonl"
    first.write_text('{"step":1,"loss":' + BIG + '}\n{"step":2,"loss":1.0}\n')
    assert detect(first) == "jsonl"


def test_huge_numbers_in_text_logs_and_trainer_state_skip_the_entry(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    step_range = "out of range for a step (above 9,007,199,254,740,991)"
    state = tmp_path / "trainer_state.json"
    state.write_text('{"log_history": [{"step": 1, "loss": 1.0}, {"step": 2, "loss": ' + BIG + '}, {"step": '
                     + STEP400 + ', "loss": 1.0}, {"step": 4, "loss": 0.5}]}')
    megatron = tmp_path / "megatron.log"
    megatron.write_text(f" iteration {STEP400}/ 100 | lm loss: 2.0 |\n iteration 2/ 100 | lm loss: 1.0E+400 |\n"
                        " iteration 3/ 100 | lm loss: 1.5 | consumed samples: nan |\n"
                        " iteration 4/ 100 | lm loss: 1.25 |\n")
    nanogpt = tmp_path / "nanogpt.log"
    nanogpt.write_text(f"iter {BIG}: loss 2.0, time 100.00ms, mfu 1.00%\niter 1: loss 1.5, time 100.00ms, mfu 1.00%\n")
    word = tmp_path / "word.log"
    word.write_text(f"| epoch {STEP400} |   200/ 2983 batches | lr 20.00 | ms/batch 11.61 | loss  6.50 | ppl 665\n"
                    "| epoch   1 |   400/ 2983 batches | lr 20.00 | ms/batch 11.61 | loss  6.25 | ppl 518\n")
    bench = tmp_path / "bench.log"
    bench.write_text(f"{BIG}:\n duration: 1.0 sec\n0:\n duration: 0.5 sec\n")
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        assert rows(state, "loss", "source_line") == [(1, 1.0, 0), (4, 0.5, 3)]
        assert rows(megatron, "loss") == [(4, 1.25)]
        assert rows(nanogpt, "loss") == [(1, 1.5)]
        assert rows(word, "loss") == [(400, 6.25)]
        assert rows(bench, "rank", "step_seconds") == [(1, 0, 0.5)]
    assert warnings_of(caplog) == [
        f"{state}: skipped 2 malformed log_history entry(s); the first: log_history[1] field 'loss' is out of range "
        f"for a number (beyond 1.8e308): {'9' * 40}… (5,000 characters)",
        f"{megatron}: skipped 3 malformed iteration line(s); the first: line 1: field 'iteration' is {step_range}: "
        f"'{'9' * 39}… (402 characters)",
        f"{nanogpt}: skipped 1 malformed nanoGPT iter line(s); the first: line 1: field 'iter' is {step_range}: "
        f"'{'9' * 39}… (5,002 characters)",
        f"{word}: skipped 1 malformed '| epoch' line(s); the first: line 1: field 'epoch'/'batches' is {step_range}: "
        f"'| epoch {'9' * 31}… (62 characters)",
        f"{bench}: skipped 2 malformed all-reduce benchmark duration line(s); the first: line 1: rank "
        f"'{'9' * 39}… (5,002 characters) is out of range (above 1,048,575)",
    ]
    with pytest.raises(InputFormatError) as err:  # the huge step as the only entry: an error naming it
        state.write_text('{"log_history": [{"step": ' + STEP400 + ', "loss": 1.0}]}')
        list(read(state))
    assert str(err.value) == f"{state}: log_history[0] field 'step' is {step_range}: an integer of 400 digits"


def test_trainer_state_skips_a_bad_entry_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "trainer_state.json"
    state.write_text('{"log_history": [{"step": 1, "loss": 1.0, "num_tokens": 100}, {"step": 2, "loss": "abc"},'
                     ' {"step": "3", "loss": 0.9}, [1], {"step": 4, "loss": 0.8, "num_tokens": 400},'
                     ' {"step": 4, "eval_runtime": 2.5}]}')
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        assert rows(state, "loss", "tokens", "eval_seconds", "source_line") == [
            (1, 1.0, 100, None, 0), (4, 0.8, 300, None, 4), (4, None, None, 2.5, 5)]
    assert warnings_of(caplog) == [f"{state}: skipped 3 malformed log_history entry(s); the first: log_history[1] "
                                   "field 'loss' is not a number: 'abc'"]


def test_a_utf8_byte_order_mark_is_ignored(tmp_path: Path) -> None:
    bom = b"\xef\xbb\xbf"
    cases = {
        "bom.csv": (b"step,loss\n1,1.0\n2,0.5\n", [(1, 1.0), (2, 0.5)]),
        "bom.jsonl": (b'{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n', [(1, 1.0), (2, 0.5)]),
        "metrics.csv": (b"epoch,step,train_loss_step\n0,49,2.5\n", [(49, 2.5)]),
        "trainer_state.json": (b'{"log_history": [{"step": 3, "loss": 0.25}]}', [(3, 0.25)]),
        "nanogpt.log": (b"iter 0: loss 10.5, time 30.00ms, mfu -100.00%\n", [(0, 10.5)]),
        "golden_values.json": (b'{"lm loss": {"start_step": 1, "step_interval": 1, "values": {"1": 2.0}}}', [(1, 2.0)]),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / name
        path.write_bytes(bom + text)
        assert rows(path, "loss") == expected, name
        gz = tmp_path / (name + ".gz")
        gz.write_bytes(gzip.compress(bom + text))
        assert rows(gz, "loss", fmt=detect(path)) == expected, name


# --- files cut mid-write ---------------------------------------------------------------------------------

def test_a_last_line_cut_mid_write_is_left_out_with_one_warning(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    cases = {  # name: (text, steps read, the torn line, its first byte, why it does not parse)
        "metrics.jsonl": ('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n{"step": 3, "lo', [1, 2], 3, 50,
                          "not valid JSON (column 13): Unterminated string starting at"),
        "trainer_log.jsonl": ('{"current_steps": 5, "total_steps": 9, "loss": 1.0}\r\n{"current_steps": 9, "tot',
                              [5], 2, 53, "not valid JSON (column 22): Unterminated string starting at"),
        "nanogpt.log": ("iter 0: loss 10.9, time 30.00ms, mfu -100.00%\niter 10: loss 9",
                        [0], 2, 46, "not 'iter N: loss X, time Yms, mfu Z%': 'iter 10: loss 9'"),
        "megatron.log": (" iteration 1/ 9 | lm loss: 2.0 |\n iteration 2/ 9 | lm loss: 1.5 | grad n", [1], 2, 33,
                         "the line ends before its closing '|' (torn or wrapped beyond repair)"),
        "modded.log": ("step:1/9 train_loss:2.0 train_time:100ms step_avg:nanms\nstep:2/", [1], 2, 56, None),
    }
    for name, (text, steps, line, byte, why) in cases.items():
        path = tmp_path / name
        path.write_bytes(text.encode())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
            assert [p.step for p in read(path)] == steps, name
        because = "" if why is None else f" ({why})"
        assert warnings_of(caplog) == [f"{path}: ends mid-line: line {line} (from byte {byte}) has no line end and "
                                       f"does not parse{because}; truncated? It is left out, the lines before it "
                                       "are read"], name
    whole = tmp_path / "whole.log"  # a last line without its end that parses is read, without a warning
    whole.write_text("iter 0: loss 10.9, time 30.00ms, mfu -100.00%\niter 10: loss 9.5, time 31.00ms, mfu 1.00%")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        assert rows(whole, "loss") == [(0, 10.9), (10, 9.5)]
    assert warnings_of(caplog) == []
    only = tmp_path / "only.log"
    only.write_text("iter 0: loss 10.9, ti")
    with pytest.raises(InputFormatError) as err:
        list(read(only, fmt="nanogpt"))
    assert str(err.value) == (f"{only}: ends mid-line: line 1 (from byte 0) has no line end and does not parse (not "
                              "'iter N: loss X, time Yms, mfu Z%': 'iter 0: loss 10.9, ti'); truncated? No nanoGPT "
                              "iter line before it")


def _trainer_state(entries: int) -> bytes:
    """A trainer_state.json as the Trainer writes it (indent 2, sorted keys): ``entries`` train logs, one eval."""
    hist: list[dict] = [{"epoch": i / 10, "grad_norm": 1.5, "learning_rate": 1e-4, "loss": 2.0 - i / 10, "step": 10 * i}
                        for i in range(1, entries + 1)]
    hist.insert(2, {"epoch": 0.2, "eval_loss": 2.5, "eval_runtime": 3.25, "step": 20})
    doc = {"best_metric": None, "epoch": entries / 10, "global_step": 10 * entries, "is_hyper_param_search": False,
           "log_history": hist, "logging_steps": 10, "max_steps": 100, "total_flos": 1.0}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def test_a_trainer_state_cut_mid_write_keeps_the_entries_before_the_cut(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    full = _trainer_state(5)
    path = tmp_path / "trainer_state.json"
    cut = full.index(b'"step": 40') + 4  # inside the fifth entry (train step 40)
    path.write_bytes(full[:cut])
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        assert rows(path, "loss", "eval_seconds") == [(10, 1.9, None), (20, 1.8, None), (20, None, 3.25),
                                                      (30, 1.7, None)]
    assert warnings_of(caplog) == [f"{path}: ends mid-document at byte {cut:,} (truncated?): read the 4 complete "
                                   "log_history entries before the cut"]
    gz = tmp_path / "trainer_state.json.gz"  # a gzip file cut short: what decompresses
    gz.write_bytes(gzip.compress(full[:cut])[:-8])
    assert [p.step for p in read(gz)] == [10, 20, 20, 30]
    neutral = tmp_path / "state"  # found by content too
    neutral.write_bytes(full[:cut])
    assert detect(neutral) == "hf_trainer_state"
    after = full.index(b'"logging_steps"')  # cut after the list: every entry
    path.write_bytes(full[:after])
    assert len(list(read(path))) == 6
    for at, message in ((full.index(b'"log_history"'), "before its 'log_history' list"),
                        (full.index(b'"step": 10'), "before the first complete 'log_history' entry")):
        path.write_bytes(full[:at])
        with pytest.raises(InputFormatError) as err:
            list(read(path))
        assert str(err.value) == f"{path}: ends mid-document at byte {at:,} (truncated?), {message}"
    path.write_bytes(full.replace(b'"loss": 1.8', b'"loss": 1.8}', 1))  # broken in the middle: not a cut
    with pytest.raises(InputFormatError, match=r"trainer_state\.json: not valid JSON \(line 19, column 13\): "
                                               r"Expecting ',' delimiter$"):
        list(read(path))


def test_trainer_state_evaluations_of_several_eval_sets(tmp_path: Path) -> None:
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": [
        {"epoch": 1.0, "loss": 1.1, "step": 401},
        {"epoch": 1.0, "eval_g0_loss": 1.2, "eval_g0_runtime": 5.25, "step": 401},
        {"epoch": 1.0, "eval_g1_loss": 1.5, "eval_g1_runtime": 6.5, "step": 401},
        {"epoch": 1.0, "step": 401, "train_loss": 1.0, "train_runtime": 99.0},
    ]}))
    assert rows(state, "loss", "eval_seconds") == [(401, 1.1, None), (401, None, 5.25), (401, None, 6.5)]


# --- llm.c main.log ----------------------------------------------------------------------------------------

def test_llmc(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "llmc_main.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        pts = list(read(path))
    # "tel" (validation loss) lines are evaluations, not timed; "eval" (HellaSwag) lines are not points at all
    assert [(p.step, p.is_eval, p.source_line) for p in pts] == [
        (0, True, 1), (0, False, 2), (1, False, 3), (2, False, 4), (4, False, 7), (4, True, 8)]
    assert {p.eval_seconds for p in pts if p.is_eval} == {0.0}
    train = [p for p in pts if not p.is_eval]
    assert [(p.loss, p.lr) for p in train[:3]] == [(11.0116, 1e-06), (10.9586, 2e-06), (10.8579, 3e-06)]
    assert train[0].grad_norm == 14.96 and math.isnan(train[1].grad_norm) and train[2].grad_norm == math.inf
    assert math.isnan(train[3].loss) and {p.step_seconds for p in train} == {None}
    assert warnings_of(caplog) == [f"{path}: skipped 1 malformed llm.c s:N line(s); the first: line 5: field 'trl' is "
                                   "not a number: '10.7l18'"]
    # the older form: the loss alone
    assert [(p.step, p.loss, p.lr, p.grad_norm) for p in read(DATA / "llmc_trl_only.log") if not p.is_eval] == [
        (0, 11.0012, None, None), (1, 10.9017, None, None), (2, 10.8125, None, None)]
    # train_gpt2.py's cumulative train_time: differences; it restarts from 0 after the first steps (250 ms for step 2)
    timed = [p for p in read(DATA / "llmc_train_time.log") if not p.is_eval]
    assert [p.step for p in timed] == [0, 1, 2, 3, 5]
    assert [p.step_seconds for p in timed] == [None, pytest.approx(21.0), pytest.approx(0.25), pytest.approx(0.25),
                                               pytest.approx(0.255)]


# --- Hugging Face Trainer stdout: log dicts, tqdm bars, DeepSpeed overflows ---------------------------------

def test_hf_stdout_bar_dicts_evals_overflows_and_a_checkpoint(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "hf_stdout_tqdm_eval.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        items = list(read_items(path))
    pts = [i for i in items if isinstance(i, LogPoint)]
    # The step bar is the Trainer's (n/30; its first draw 0/30 is no step): not "Loading checkpoint shards" (2/2),
    # not "Map" (examples/s), not the evaluation's bar (n/4). Carriage-return redraws are lines; a counter drawn
    # twice is one point. Its rate is the step time (the clock's whole seconds span under a minute here).
    assert [(p.step, p.step_seconds, p.skipped, p.source_line) for p in pts if not p.is_eval] == [
        (1, 2.43, 0, 4), (2, 2.27, 0, 5), (3, 2.21, 0, 7),
        (4, 2.17, 1, 9),   # "[deepspeed] OVERFLOW! Skipping step" after 3/30: step 4 was skipped
        (5, 2.16, 2, 14),  # two more (the same line printed by two ranks is one): 32768 -> 16384 -> 8192
        (6, 2.19, 0, 24), (10, 2.2, 0, 27)]
    five, ten = pts[4], pts[-1]  # the dicts logged at 5 and 10 are on the bar's points
    assert (five.loss, five.grad_norm, five.lr, five.tokens) == (2.345, 1.25, 4.5e-05, 20480)  # '%.4g' strings
    assert (ten.loss, ten.grad_norm, ten.tokens) == (1.9, 0.9, 61440)  # tokens since step 5's dict
    assert pts[6].loss is None  # step 6's dict does not parse
    assert [(p.step, p.eval_seconds, p.source_line) for p in pts if p.is_eval] == [(5, 0.4461, 20)]
    # "Saving model checkpoint to out/checkpoint-5": a save at step 5, after its evaluation; the summary is no step
    assert items[6] == LogEvent("checkpoint_save", step=5, source_line=22)
    assert [type(i).__name__ for i in items].count("LogEvent") == 1
    assert warnings_of(caplog) == [f"{path}: skipped 1 malformed Trainer log dict line(s); the first: line 25: not a "
                                   "flat dict of numbers and strings: key 'device' at column 113"]


def test_hf_stdout_without_a_bar_numbers_the_dicts(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "hf_stdout_printer.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        pts = list(read(path))
    # PrinterCallback (no bar): the steps are the ordinals of the training dicts; the bad third still counts
    assert [(p.step, p.is_eval, p.source_line) for p in pts] == [(1, False, 3), (2, False, 4), (2, True, 5),
                                                                 (4, False, 7)]
    assert (pts[0].loss, pts[0].grad_norm, pts[1].loss) == (2.5, math.inf, -math.inf) and math.isnan(pts[1].grad_norm)
    assert (pts[2].eval_seconds, pts[3].loss, pts[3].lr) == (3.5, 2.0, 4.8e-05)
    assert {p.skipped for p in pts} == {None}  # no overflow lines in this log: unknown, not 0
    assert warnings_of(caplog) == [
        f"{path}: no training progress bar before the log dicts: their steps are the ordinals of the training dicts "
        "(1, 2, 3, …), not the optimizer steps",
        f"{path}: skipped 1 malformed Trainer log dict line(s); the first: line 6: field 'learning_rate' is not a "
        "number: 'five'"]


def test_a_tqdm_bar_alone_with_its_postfix() -> None:
    pts = list(read(DATA / "tqdm_postfix.log"))  # a custom loop's bar: "Steps: …, 1.17it/s, loss=0.398, lr=1e-05]"
    assert [(p.step, p.loss, p.lr, p.skipped) for p in pts[:2]] == [(1, 0.412, 1e-05, None), (2, 0.398, 1e-05, None)]
    assert pts[2].step == 3 and math.isnan(pts[2].loss)
    assert [p.step_seconds for p in pts] == pytest.approx([1.67, 1 / 1.17, 1 / 1.49])  # s/it, then 1 / it/s


def test_a_slow_bar_times_steps_by_its_clock(tmp_path: Path) -> None:
    path = tmp_path / "slow.log"  # 70-80 s per step: the elapsed clock's differences, not tqdm's smoothed rate
    path.write_text(" 0%|  | 10/100 [11:40<1:45:00, 70.00s/it]\n 0%|  | 11/100 [13:00<1:44:00, 71.00s/it]\n"
                    " 0%|  | 13/100 [15:20<1:43:00, 71.50s/it]\n 0%|  | 14/100 [15:50<1:43:00, 70.00s/it]\n")
    assert [(p.step, p.step_seconds) for p in read(path)] == [(10, 70.0), (11, 80.0), (13, 70.0), (14, 70.0)]


# --- mmengine / mmcv 1.x -----------------------------------------------------------------------------------

def test_mmengine_iteration_based(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "mmengine_iter.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        items = list(read_items(path))
    pts = [i for i in items if isinstance(i, LogPoint)]
    # lr, not base_lr; the total loss, not decode.loss_ce; time: seconds per iteration
    assert [(p.step, p.loss, p.grad_norm, p.lr, p.step_seconds) for p in pts if not p.is_eval] == [
        (50, 3.2, 2.5, 0.01, 0.5012), (100, 2.9, math.inf, 0.0099, 0.4988), (200, 2.6, 2.3, 0.0097, 0.505)]
    # the validation's progress line is no step; its summary is an evaluation of 500 x 0.0910 s at step 100
    assert [(p.step, p.eval_seconds, p.source_line) for p in pts if p.is_eval] == [(100, pytest.approx(45.5), 5)]
    assert items[2] == LogEvent("checkpoint_save", step=100, source_line=3)  # "Saving checkpoint at 100 iterations"
    assert warnings_of(caplog) == [f"{path}: skipped 1 malformed mmengine/mmcv training line(s); the first: line 6: "
                                   "field 'loss' is not a number: '2.7O00'"]
    assert rows(DATA / "mmengine_iter.log", "source_line")[-1] == (200, 7)


def test_mmcv_epoch_and_iteration_based() -> None:
    items = list(read_items(DATA / "mmcv_epoch.log"))
    pts = [i for i in items if isinstance(i, LogPoint)]
    # Epoch [e][i/N]: the step is (e - 1) x N + i; lr_backbone (the first group's) when there is no lr
    assert [(p.step, p.loss, p.grad_norm, p.lr, p.step_seconds) for p in pts[:2]] == [
        (50, 1.5, 12.3456, 0.01, 0.6), (100, 1.2, 10.0, 0.01, 0.58)]
    assert (pts[3].step, pts[3].lr, pts[3].step_seconds) == (150, 0.001, 0.59)
    assert math.isnan(pts[3].loss) and math.isnan(pts[3].grad_norm)
    assert (pts[2].step, pts[2].eval_seconds) == (100, 0.0)  # Epoch(val) [1][25]: an evaluation, not timed
    assert items[2] == LogEvent("checkpoint_save", step=100, source_line=3)  # "Saving checkpoint at 1 epochs"
    assert rows(DATA / "mmcv_iter.log", "loss", "step_seconds", "eval_seconds") == [
        (20, 0.9, 0.6, None), (40, 0.85, 0.59, None), (40, None, None, 0.0)]


# --- generic text logs: a step counter and key/value pairs -------------------------------------------------

def test_text_kv_llmc_stdout() -> None:
    pts = list(read(DATA / "llmc_stdout.log"))  # "step 1/74 | loss … | norm … | lr … | 1234.56 ms | …"
    assert [(p.step, p.loss, p.grad_norm, p.lr) for p in pts] == [
        (1, 11.01, 15.4212, 8.57e-07), (2, 10.902, 14.2001, 1.71e-06), (3, 10.801, 13.0, 2.57e-06)]
    assert [p.step_seconds for p in pts] == pytest.approx([1.23456, 0.25625, 0.25575])  # "val loss" is no step


def test_text_kv_pairs_units_and_checkpoints(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "kv_pairs.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        items = list(read_items(path))
    pts = [i for i in items if isinstance(i, LogPoint)]
    # train_loss, not val_loss; grad_norm, not param_norm; 250ms, 0.26s, "time (ms): 240", 4.00 it/s; tensor(2.1875)
    assert [(p.step, p.loss, p.grad_norm, p.lr, p.step_seconds) for p in pts[:3]] == [
        (100, 2.31, 0.92, 3e-4, 0.25), (200, 2.25, 0.88, 3e-4, 0.26), (400, 2.1875, 0.8, 2.9e-4, 0.24)]
    assert (pts[3].step, pts[3].step_seconds) == (500, 0.25) and math.isnan(pts[3].loss)
    # "saving checkpoint at iteration 400" then "successfully saved checkpoint …": one save, at step 400
    assert [i for i in items if isinstance(i, LogEvent)] == [LogEvent("checkpoint_save", step=400, source_line=6)]
    assert warnings_of(caplog) == [f"{path}: skipped 1 malformed step line(s); the first: line 4: field "
                                   "'train_loss' is not a number: 'abc'"]


def test_text_kv_elapsed_clock_and_tensorflow_lines() -> None:
    items = list(read_items(DATA / "kv_clock.log"))
    pts = [i for i in items if isinstance(i, LogPoint)]
    # global_step, lm loss, learning rate; elapsed 0:05:00 / 300 steps, then differences ("1 day, 0:10:30" too)
    assert [(p.step, p.loss, p.lr, p.step_seconds) for p in pts] == [
        (300, 3.25, 1e-4, 1.0), (600, 3.125, 1e-4, 1.1), (900, 3.0, 9e-5, 288.0), (1000, 2.875, None, None)]
    assert items[-1] == LogEvent("checkpoint_save", step=1000, source_line=6)  # "Checkpoint saved to …"


def test_text_kv_is_the_last_text_format_tried(tmp_path: Path) -> None:
    path = tmp_path / "mixed.log"
    lines = [f"step {i} loss = {3 - i / 10}" for i in range(1, 20)]
    path.write_text("\n".join([*lines, "iter 20: loss 1.0, time 250.00ms, mfu 30.00%"]) + "\n")
    assert detect(path) == "nanogpt"  # one line of a known format outweighs any number of generic ones
    assert [p.step for p in read(path, fmt="text_kv")] == list(range(1, 21))
    path.write_text("\n".join(lines) + "\n")
    assert detect(path) == "text_kv"
