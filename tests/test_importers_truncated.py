"""Files cut short (issue 15, item 8): real logs of ../shared/real_logs truncated in tmp_path, read by the importers
and by ``trainhealth analyze``. What came before the cut is kept; a warning names the file and where it was cut."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from trainhealth.collectors.importers import read
from trainhealth.logpoint import LogPoint

TB = "tensorboard_t5_summarization/events.out.tfevents.1742826235.workstation.0"
MEGATRON = "megatron_deepspeed_bloom176b_excerpt.log"
DEEPLAB = "tf_deeplab_steps_checkpoint.log"
MODDED = "modded_nanogpt_soap.log"
LLMC = "llmc_gpt2_124m_main.log"
WORD_LM = "pytorch_word_lm_all_nan.log"
MMENGINE = "mmengine_text_loss_nan.log"
HF_TQDM = "deepspeed_overflow_tqdm_hf.log"
LLAMAFACTORY = "llamafactory_mistral7b_translator.trainer_log.jsonl"
#: The repository's own format samples, for formats ../shared/real_logs has no (long enough) log of.
FIXTURES = Path(__file__).resolve().parent / "data" / "importers"
TB_SIZE = 163_974
#: Record 1000 of the event file (a 94-byte frame: 12-byte header, 78 bytes of event, 4-byte CRC).
TB_RECORD = 97_188


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "trainhealth.collectors.importers" and r.levelno == logging.WARNING]


def _read(path: Path, caplog: pytest.LogCaptureFixture, fmt: str | None = None) -> tuple[list[LogPoint], list[str]]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        pts = [p for p in read(path, fmt) if isinstance(p, LogPoint)]
    return pts, _warnings(caplog)


def _cut(tmp_path: Path, src: Path, data: bytes, sub: str) -> Path:
    out = tmp_path / sub / src.name  # the real name: the format is detected as for the real file
    out.parent.mkdir(parents=True)
    out.write_bytes(data)
    return out


def _record_starts(data: bytes) -> list[int]:
    """The byte offsets of the TFRecord frames (uint64 length, uint32 CRC, data, uint32 CRC) of a whole file."""
    starts, off = [], 0
    while off < len(data):
        starts.append(off)
        off += struct.unpack("<Q", data[off:off + 8])[0] + 16
    assert off == len(data)
    return starts


# --- TensorBoard -----------------------------------------------------------------------------------------------

def test_tensorboard_whole_file_gives_no_warning(real_logs: Path, caplog: pytest.LogCaptureFixture) -> None:
    pts, warnings = _read(real_logs / TB, caplog)
    assert (len(pts), pts[0].step, pts[-1].step) == (430, 500, 215_000)
    assert warnings == []


def test_tensorboard_cut_at_half_its_size_keeps_208_steps_and_says_where(
        real_logs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / TB
    data = src.read_bytes()
    assert len(data) == TB_SIZE and TB_SIZE // 2 == 81_987
    assert 81_910 in _record_starts(data)  # the cut falls 77 bytes into the 102-byte record there
    cut = _cut(tmp_path, src, data[:TB_SIZE // 2], "half")
    whole, _ = _read(src, caplog)
    pts, warnings = _read(cut, caplog)
    assert (len(pts), pts[0].step, pts[-1].step) == (208, 500, 104_000)
    assert pts[:-1] == whole[:207]  # the steps before the cut, as in the whole file
    # the last step's learning-rate record was the one cut: its loss and grad norm were written before it
    assert (pts[-1].loss, pts[-1].grad_norm, pts[-1].lr) == (whole[207].loss, whole[207].grad_norm, None)
    assert warnings == [f"{cut}: truncated at byte 81,910 (a record of 102 bytes cut off after 77): read 208 "
                        "training steps before it; the rest of the run is missing"]


def test_tensorboard_cut_inside_a_record_header(real_logs: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / TB
    data = src.read_bytes()
    starts = _record_starts(data)
    assert starts.index(TB_RECORD) == 1000
    cut = _cut(tmp_path, src, data[:TB_RECORD + 5], "header")
    pts, warnings = _read(cut, caplog)
    assert (len(pts), pts[-1].step) == (250, 125_000)
    assert warnings == [f"{cut}: truncated at byte 97,188 (a record's 12-byte header cut off after 5 bytes): read "
                        "250 training steps before it; the rest of the run is missing"]
    # cut exactly between two records: nothing tells it from a whole file (the same 250 steps, no warning)
    boundary = _cut(tmp_path, src, data[:TB_RECORD], "boundary")
    pts, warnings = _read(boundary, caplog)
    assert (len(pts), pts[-1].step, warnings) == (250, 125_000, [])


def test_tensorboard_crc_mismatch_mid_file_stops_reading_there(real_logs: Path, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / TB
    data = bytearray(src.read_bytes())
    data[TB_RECORD + 20] ^= 0x01  # one bit of record 1000's event data: its data CRC fails
    bad = _cut(tmp_path, src, bytes(data), "data-crc")
    pts, warnings = _read(bad, caplog)
    assert (len(pts), pts[-1].step) == (250, 125_000)  # stopped, as TensorBoard does: steps after it are not read
    assert warnings == [f"{bad}: corrupt at byte 97,188 (a record of 94 bytes fails its CRC check): read 250 "
                        "training steps before it; the rest of the file is not read (TensorBoard stops there too)"]
    data = bytearray(src.read_bytes())
    data[TB_RECORD + 2] ^= 0x01  # the record's length: its header CRC fails, no trustworthy length to skip by
    bad = _cut(tmp_path, src, bytes(data), "length-crc")
    pts, warnings = _read(bad, caplog)
    assert (len(pts), pts[-1].step) == (250, 125_000)
    assert warnings == [f"{bad}: corrupt at byte 97,188 (a record's length fails its CRC check): read 250 "
                        "training steps before it; the rest of the file is not read (TensorBoard stops there too)"]


def test_tensorboard_run_directory_with_a_cut_first_file(real_logs: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    data = (real_logs / TB).read_bytes()
    run = tmp_path / "run"
    run.mkdir()
    first = run / "events.out.tfevents.1.host.0"  # a crashed run, resumed into a second event file
    first.write_bytes(data[:TB_SIZE // 2])
    (run / "events.out.tfevents.2.host.0").write_bytes(data)
    pts, warnings = _read(run, caplog)
    assert (len(pts), pts[207].step, pts[208].step, pts[-1].step) == (638, 104_000, 500, 215_000)
    assert warnings == [f"{first}: truncated at byte 81,910 (a record of 102 bytes cut off after 77): read 208 "
                        "training steps before it; the rest of this file is missing; the next event file is read"]


# --- line-based logs ---------------------------------------------------------------------------------------------

def test_megatron_cut_right_after_a_bar_is_not_booked_as_a_step(real_logs: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / MEGATRON
    data = src.read_bytes()
    whole, warnings = _read(src, caplog)
    assert (len(whole), whole[-1].step, whole[-1].source_line, warnings) == (18, 45_000, 32, [])
    assert data[6_388:].startswith(b"[default7]: iteration    45000/")  # line 32
    # cut after "num zeros: 0.0 | ": the line still ends with '|' and parses, its last fields are missing
    assert data[:6_650].endswith(b"grad norm: 0.139 | num zeros: 0.0 | ")
    cut = _cut(tmp_path, src, data[:6_650], "after-bar")
    pts, warnings = _read(cut, caplog)
    assert pts == whole[:17] and pts[-1].step == 42_784
    assert warnings == [f"{cut}: ends mid-line: line 32 (from byte 6,388) has no line end and is cut short (no "
                        "'number of skipped iterations', 'number of naniterations', 'samples per second', 'TFLOPs', "
                        "which line 28 has); truncated? Step 45000 on it is incomplete and left out, the lines "
                        "before it are read"]
    # cut inside a value: the line does not end with its '|'
    assert data[:6_603].endswith(b"lm loss: 2.11")
    cut = _cut(tmp_path, src, data[:6_603], "mid-value")
    pts, warnings = _read(cut, caplog)
    assert pts == whole[:17]
    assert warnings == [f"{cut}: ends mid-line: line 32 (from byte 6,388) has no line end and does not parse (the "
                        "line ends before its closing '|' (torn or wrapped beyond repair)); truncated? It is left "
                        "out, the lines before it are read"]


def test_a_complete_last_line_without_its_line_end_is_read_without_a_warning(
        real_logs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / MEGATRON
    data = src.read_bytes()
    assert data[:6_763].endswith(b"TFLOPs: 141.26 |") and data[6_763:6_764] == b"\n"
    cut = _cut(tmp_path, src, data[:6_763], "complete")
    whole, _ = _read(src, caplog)
    pts, warnings = _read(cut, caplog)
    assert (pts, warnings) == (whole, [])
    src = real_logs / DEEPLAB
    data = src.read_bytes()
    assert data[:1_352].endswith(b"step 13001 \t loss = 0.860, (0.743 sec/step)")
    cut = _cut(tmp_path, src, data[:1_352], "complete-text")
    pts, warnings = _read(cut, caplog)
    assert (len(pts), pts[-1].step, pts[-1].loss, pts[-1].step_seconds, warnings) == (30, 13_001, 0.86, 0.743, [])


def test_generic_text_log_cut_before_its_step_time(real_logs: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / DEEPLAB
    data = src.read_bytes()
    assert data[:1_335].endswith(b"\nstep 13001 \t loss = 0.860,")
    cut = _cut(tmp_path, src, data[:1_335], "no-time")
    pts, warnings = _read(cut, caplog)
    assert (len(pts), pts[0].step, pts[-1].step) == (29, 12_972, 13_000)
    assert warnings == [f"{cut}: ends mid-line: line 31 (from byte 1,309) has no line end and is cut short (no "
                        "'step time', which line 30 has); truncated? Step 13001 on it is incomplete and left out, "
                        "the lines before it are read"]


def _cut_warning(path: Path, line: int, byte: str, missing: str, ref: int, step: int | None) -> str:
    record = "Its record" if step is None else f"Step {step} on it"
    return (f"{path}: ends mid-line: line {line} (from byte {byte}) has no line end and is cut short (no {missing}, "
            f"which line {ref} has); truncated? {record} is incomplete and left out, the lines before it are read")


def _torn_warning(path: Path, line: int, byte: str, why: str) -> str:
    return (f"{path}: ends mid-line: line {line} (from byte {byte}) has no line end and does not parse ({why}); "
            "truncated? It is left out, the lines before it are read")


def test_modded_nanogpt_cut_in_its_last_field_name(real_logs: Path, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / MODDED
    data = src.read_bytes()
    whole, warnings = _read(src, caplog)
    assert (len(whole), whole[0].step, whole[-1].step, warnings) == (6000, 1, 6000, [])
    assert data[:473_108].endswith(b"\nstep:5998/6000 train_loss:3.2500 train_time:2175880ms step_avg:363.37ms\n")
    assert data[:473_169].endswith(b"\nstep:5999/6000 train_loss:3.0936 train_time:2176134ms step_av")  # line 6965
    cut = _cut(tmp_path, src, data[:473_169], "train")
    pts, warnings = _read(cut, caplog)
    assert (len(pts), pts[-1].step) == (5998, 5998)
    assert pts == whole[:5998]  # step 5998 and its step time as in the whole file
    assert warnings == [_cut_warning(cut, 6965, "473,108", "'step_avg'", 6964, 5999)]
    # the closing validation line: not a step, but a timer reading; left out the same way. Compared with the training
    # line before it, it lacks that line's 'train_loss' too (it has its 'val_loss' instead): named with the cut one
    assert data[:473_252].endswith(b"\nstep:6000/6000 train_loss:3.4305 train_time:2176390ms step_avg:363.34ms\n")
    assert data[:473_309].endswith(b"\nstep:6000/6000 val_loss:3.2763 train_time:2176424ms step_")  # line 6967
    cut = _cut(tmp_path, src, data[:473_309], "val")
    pts, warnings = _read(cut, caplog)
    assert pts == whole
    assert warnings == [_cut_warning(cut, 6967, "473,252", "'train_loss', 'step_avg'", 6966, None)]


def test_nanogpt_cut_before_its_mfu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = FIXTURES / "nanogpt.log"  # no nanoGPT log among the real ones: the repository's sample
    data = src.read_bytes()
    whole, warnings = _read(src, caplog)
    assert ([p.step for p in whole], warnings) == ([0, 10, 20, 30], [])
    assert data[:293].endswith(b"\niter 20: loss 8.1234, time 410.25ms, mfu 31.02%\n")
    # cut right after "ms": the line still matches (its ", mfu Z%" is optional), but the line before has an mfu
    assert data[:325].endswith(b"\niter 30: loss nan, time 409.75ms")  # line 7
    cut = _cut(tmp_path, src, data[:325], "no-mfu")
    pts, warnings = _read(cut, caplog)
    assert pts == whole[:3] and pts[-1].step == 20
    assert warnings == [_cut_warning(cut, 7, "293", "'mfu'", 6, 30)]
    # cut in the name "mfu": the line does not match, and is left out as a torn line
    assert data[:329].endswith(b"409.75ms, mf")
    cut = _cut(tmp_path, src, data[:329], "mf")
    pts, warnings = _read(cut, caplog)
    assert pts == whole[:3]
    assert warnings == [_torn_warning(cut, 7, "293", "not 'iter N: loss X, time Yms, mfu Z%': "
                                                     "'iter 30: loss nan, time 409.75ms, mf'")]


def test_llmc_cut_in_its_norm_is_compared_with_the_training_line_before(
        real_logs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / LLMC
    data = src.read_bytes()
    whole, warnings = _read(src, caplog)
    train = [p for p in whole if not p.is_eval]
    assert (len(train), train[-1].step, len(whole) - len(train), warnings) == (19_552, 19_551, 80, [])
    assert data[:793_469].endswith(b"\ns:19550 trl:3.2447 lr:0.000000 norm:0.25\n")
    assert data[:793_502].endswith(b"\ns:19551 trl:3.2813 lr:0.000000 no")  # line 19709
    cut = _cut(tmp_path, src, data[:793_502], "norm")
    pts, warnings = _read(cut, caplog)
    assert pts == whole[:19_630]  # 19,551 training steps (0–19,550) and the 79 validations before the cut
    assert (len([p for p in pts if not p.is_eval]), pts[-1].step) == (19_551, 19_550)
    assert warnings == [_cut_warning(cut, 19_709, "793,469", "'norm'", 19_708, 19_551)]
    # step 19500 follows its validation (line 19656) and HellaSwag (19657) lines: the training line before is 19655
    assert data[:791_339].endswith(b"\ns:19499 trl:3.2477 lr:0.000000 norm:0.22\n")
    assert data[791_339:791_378] == b"s:19500 tel:3.2731\ns:19500 eval:0.3050\n"
    assert data[:791_411].endswith(b"\ns:19500 trl:3.3518 lr:0.000000 no")  # line 19658
    cut = _cut(tmp_path, src, data[:791_411], "after-validation")
    pts, warnings = _read(cut, caplog)
    assert (len([p for p in pts if not p.is_eval]), pts[-1].step, pts[-1].is_eval) == (19_500, 19_500, True)
    assert warnings == [_cut_warning(cut, 19_658, "791,378", "'norm'", 19_655, 19_500)]
    # the same line complete, without its line end: read, with no warning (a validation line is no reference)
    assert data[:791_418].endswith(b"\ns:19500 trl:3.3518 lr:0.000000 norm:0.23") and data[791_418:791_419] == b"\n"
    cut = _cut(tmp_path, src, data[:791_418], "complete")
    pts, warnings = _read(cut, caplog)
    assert (len([p for p in pts if not p.is_eval]), pts[-1].step, pts[-1].grad_norm, warnings) == (
        19_501, 19_500, 0.23, [])


def test_word_language_model_cut_in_its_ppl(real_logs: Path, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / WORD_LM
    data = src.read_bytes()
    whole, warnings = _read(src, caplog)
    assert (len(whole), whole[-2].step, whole[-1].step, warnings) == (70, 14_532, 14_732, [])
    assert data[:7_649].endswith(b"\n| epoch   5 |  2600/ 2983 batches | lr 0.3125 | ms/batch 11.42 | loss   nan | "
                                 b"ppl      nan\n")
    assert data[:7_729].endswith(b"\n| epoch   5 |  2800/ 2983 batches | lr 0.3125 | ms/batch 11.43 | loss   nan | "
                                 b"pp")  # line 83
    cut = _cut(tmp_path, src, data[:7_729], "ppl")
    pts, warnings = _read(cut, caplog)
    assert [(p.step, p.step_seconds, p.lr) for p in pts] == [(p.step, p.step_seconds, p.lr) for p in whole[:69]]
    assert (len(pts), pts[-1].step, pts[-1].step_seconds) == (69, 14_532, 0.01142)
    assert warnings == [_cut_warning(cut, 83, "7,649", "'ppl'", 82, 14_732)]


def test_mmengine_cut_in_its_last_key(real_logs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = FIXTURES / "mmengine_iter.log"  # the real mmengine log is one line: the repository's sample
    data = src.read_bytes()
    whole, warnings = _read(src, caplog)
    assert [p.step for p in whole if not p.is_eval] == [50, 100, 200]  # line 6 (step 150) reads 'loss: 2.7O00'
    assert data[:251].endswith(b"  loss: 3.2000  decode.loss_ce: 3.1000  decode.acc_seg: 12.5000\n")
    assert data[:487].endswith(b"  loss: 2.9000  decode.loss_ce: 2.8000  decode.acc_s")  # line 2
    cut = _cut(tmp_path, src, data[:487], "acc-seg")
    pts, warnings = _read(cut, caplog)
    assert pts == whole[:1] and pts[0].step == 50
    assert warnings == [_cut_warning(cut, 2, "251", "'decode.acc_seg'", 1, 100)]
    # the real one-line log, cut in its last key: the first record has nothing to compare with, so it is read
    src = real_logs / MMENGINE
    data = src.read_bytes()
    assert len(data) == 234 and data.endswith(b"  acc: 0.0000  loss_bbox: nan")  # itself without a line end
    whole, warnings = _read(src, caplog)
    assert ([(p.step, p.step_seconds) for p in whole], warnings) == ([(500, 0.0578)], [])
    cut = _cut(tmp_path, src, data[:227], "first")
    assert data[:227].endswith(b"  loss_bb")
    pts, warnings = _read(cut, caplog)
    assert ([(p.step, p.step_seconds) for p in pts], warnings) == ([(500, 0.0578)], [])


def test_hf_stdout_bar_cut_before_a_rate_it_needs(real_logs: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    src = real_logs / HF_TQDM
    data = src.read_bytes()
    whole, warnings = _read(src, caplog)
    # its own last line, " 10%|▉         | 259/2724 [9:34:48<90:54:", has no rate: its clock times it (132 s)
    assert ([p.step for p in whole], whole[-1].step_seconds, warnings) == (list(range(243, 260)), 132.0, [])
    assert data[1_229:1_288] == "  9%|▉         | 258/2724 [9:32:36<90:57:16, 132.78s/it]\n".encode()  # line 21
    assert data[1_170:1_229].endswith(b" 257/2724 [9:30:23<90:59:24, 132.78s/it]\n")  # line 20
    # cut in the rate's unit: as the file's own last line, the clock times the step (9:32:36 - 9:30:23)
    for end, sub in ((1_284, "rate"), (1_285, "unit")):
        assert data[:1_285].endswith(b"132.78s/i")
        cut = _cut(tmp_path, src, data[:end], sub)
        pts, warnings = _read(cut, caplog)
        assert pts[:-1] == whole[:15] and (len(pts), pts[-1].step, pts[-1].step_seconds, warnings) == (
            16, 258, 133.0, [])
    # cut in the clock: "[9:32:3" reads 9:32 (before 9:30:23): nothing times the step, it has no rate
    assert data[:1_264].endswith(b" 258/2724 [9:32:3")
    cut = _cut(tmp_path, src, data[:1_264], "clock")
    pts, warnings = _read(cut, caplog)
    assert pts == whole[:15] and pts[-1].step == 257
    assert warnings == [_cut_warning(cut, 21, "1,229", "'rate'", 20, 258)]
    # steps of a few seconds (the repository's sample): the clock does not time them, the rate does
    src = FIXTURES / "hf_stdout_tqdm_eval.log"
    data = src.read_bytes()
    assert data[:1_728].endswith(b"Configuration saved in out/checkpoint-5/config.json\n")
    assert data[:1_775].endswith(" 20%|██        | 6/30 [00:13<00:52,  2.19s/".encode())  # line 24
    assert data[1_079:1_130] == " 17%|█▋        | 5/30 [00:10<00:54,  2.16s/it]\n".encode()  # line 13
    cut = _cut(tmp_path, src, data[:1_775], "fast")
    pts, warnings = _read(cut, caplog)
    assert [(p.step, p.loss, p.is_eval) for p in pts] == [
        (1, None, False), (2, None, False), (3, None, False), (4, None, False), (5, 2.345, False), (5, None, True)]
    assert warnings == [_cut_warning(cut, 24, "1,728", "'rate'", 13, 6)]
    # a postfix cut in its last value: "lr=1e-" is no number
    src = FIXTURES / "tqdm_postfix.log"
    data = src.read_bytes()
    assert data[126:204] == b"Steps:   0%|          | 2/1000 [00:01<14:10,  1.17it/s, loss=0.398, lr=1e-05]\r"
    assert data[:276].endswith(b"| 3/1000 [00:02<11:10,  1.49it/s, loss=nan, lr=1e-")  # line 4
    cut = _cut(tmp_path, src, data[:276], "postfix")
    pts, warnings = _read(cut, caplog)
    assert [(p.step, p.loss, p.lr) for p in pts] == [(1, 0.412, 1e-05), (2, 0.398, 1e-05)]
    assert warnings == [_cut_warning(cut, 4, "204", "'lr'", 3, 3)]


def test_hf_stdout_dict_cut_mid_line_does_not_parse(real_logs: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A Trainer log dict ends with its '}': cut anywhere before it, it does not parse (no cut-short check needed)."""
    src = real_logs / HF_TQDM
    data = src.read_bytes()
    whole, _ = _read(src, caplog)
    assert data[685:756] == b"{'loss': 1.89, 'learning_rate': 0.00019920353585932578, 'epoch': 0.18}\n"  # line 11
    assert data[:745].endswith(b", 'epo")
    cut = _cut(tmp_path, src, data[:745], "dict")
    pts, warnings = _read(cut, caplog)
    assert [p.step for p in pts] == list(range(243, 251))
    assert (pts[-1].loss, pts[-1].lr, whole[7].loss) == (None, None, 1.89)  # step 250 without the cut dict's loss
    assert warnings == [_torn_warning(cut, 11, "685", "not a complete flat dict: the line ends in the string at "
                                                      "column 57")]


def test_llamafactory_cut_mid_line_does_not_parse(real_logs: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A JSON line ends with its '}': cut anywhere before it, it is no JSON (no cut-short check needed)."""
    src = real_logs / LLAMAFACTORY
    data = src.read_bytes()
    whole, warnings = _read(src, caplog)
    assert (len(whole), whole[0].step, whole[-1].step, warnings) == (866, 10, 8_660, [])
    assert data[:214_010].endswith(b', "throughput": "0.00", "total_tokens": 0}\n')
    assert data[214_010:].startswith(b'{"current_steps": 8650, "total_steps": 8660, "loss": 0.1166,')  # line 865
    assert data[:214_249].endswith(b'"throughput": "0.00", "total_tok')  # its opening quote is column 230
    cut = _cut(tmp_path, src, data[:214_249], "name")
    pts, warnings = _read(cut, caplog)
    assert pts == whole[:864] and pts[-1].step == 8_640
    assert warnings == [_torn_warning(cut, 865, "214,010", "not valid JSON (column 230): Unterminated string "
                                                           "starting at")]


def test_the_real_logs_give_no_false_truncation_warning(real_logs: Path, caplog: pytest.LogCaptureFixture) -> None:
    found: dict[str, list[str]] = {}
    for path in sorted(real_logs.iterdir()):
        if path.name == "MANIFEST.md":
            continue
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
            for _ in read(path):
                pass
        if w := [m for m in _warnings(caplog) if "mid-line" in m or "truncated" in m or "corrupt" in m]:
            found[path.name] = w
    # the two files MANIFEST.md describes as cut: an issue-thread excerpt, and a log pasted up to "ste"
    assert found == {
        "hf_stdout_loss_zero_gradnorm_nan.log": [
            f"{real_logs / 'hf_stdout_loss_zero_gradnorm_nan.log'}: ends mid-line: line 11 (from byte 1,370) has no "
            "line end and does not parse (not a complete flat dict: the line ends in the string at column 15); "
            "truncated? It is left out, the lines before it are read"],
        DEEPLAB: [f"{real_logs / DEEPLAB}: ends mid-line: line 32 (from byte 1,353) has no line end and does not "
                  "parse; truncated? It is left out, the lines before it are read"],
    }


# --- through the CLI -------------------------------------------------------------------------------------------

def test_analyze_shows_the_warnings_and_exits_0(real_logs: Path, tmp_path: Path) -> None:
    tb = _cut(tmp_path, real_logs / TB, (real_logs / TB).read_bytes()[:TB_SIZE // 2], "tb")
    meg = _cut(tmp_path, real_logs / MEGATRON, (real_logs / MEGATRON).read_bytes()[:6_650], "megatron")
    tb_warning = (f"{tb}: truncated at byte 81,910 (a record of 102 bytes cut off after 77): read 208 training "
                  "steps before it; the rest of the run is missing")
    meg_warning = (f"{meg}: ends mid-line: line 32 (from byte 6,388) has no line end and is cut short (no 'number of "
                   "skipped iterations', 'number of naniterations', 'samples per second', 'TFLOPs', which line 28 "
                   "has); truncated? Step 45000 on it is incomplete and left out, the lines before it are read")
    cmd = [sys.executable, "-m", "trainhealth", "analyze", "--progress", "never", str(tb), str(meg)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"  warning    {tb_warning}" in lines and f"  warning    {meg_warning}" in lines
    assert "  run        208 logged training steps (steps 500–104,000), 0 evaluations" in lines
    assert "  run        17 logged training steps (steps 12,695–42,784), 0 evaluations" in lines
    assert tb_warning in done.stderr and meg_warning in done.stderr  # the log, as `replay` shows it too
    done = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [(f["summary"]["steps"], f["summary"]["warnings"]) for f in report["files"]] == [
        (208, [tb_warning]), (17, [meg_warning])]
    assert report["summary"]["exit_status"] == 0
