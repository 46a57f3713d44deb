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
