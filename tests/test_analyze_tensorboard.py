"""``trainhealth analyze --tensorboard DIR`` on real logs, read back with TensorBoard's own reader: the anomalies at
their steps (scalar and text), the ledger's figures at the last step, the same as the JSON report says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read(logdir: Path) -> EventAccumulator:
    ea = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})
    ea.Reload()
    return ea


def test_findings_land_in_tensorboard_as_the_report_says(real_logs: Path, tmp_path: Path) -> None:
    logs = [real_logs / "hf_trocr_large_gradnorm.trainer_state.json",
            real_logs / "megatron_deepspeed_104b_overflow_excerpt.log"]
    out = subprocess.run([sys.executable, "-m", "trainhealth", "analyze", *map(str, logs), "--json",
                          "--tensorboard", str(tmp_path / "tb")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr  # the 104B divergence is critical
    report = json.loads(out.stdout)
    files = {Path(f["path"]).name: f for f in report["files"]}
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["hf_trocr_large_gradnorm",
                                                                   "megatron_deepspeed_104b_overflow_excerpt"]
    for log in logs:
        rep = files[log.name]
        ea = read(tmp_path / "tb" / rep["run"])
        scalars = ea.Tags()["scalars"]
        want = {(f"trainhealth/anomaly/{a['kind']}", a["step"], {"info": 1, "warning": 2, "critical": 3}[a["severity"]])
                for a in rep["anomalies"]}
        got = {(t, e.step, int(e.value)) for t in scalars if t.startswith("trainhealth/anomaly/")
               for e in ea.Scalars(t)}
        assert got == want
        texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors("trainhealth/anomalies")]
        assert sorted(s for s, _ in texts) == sorted(a["step"] for a in rep["anomalies"])
        for a in rep["anomalies"]:
            assert any(s == a["step"] and a["message"] in t and a["kind"] in t for s, t in texts)
        [text] = ea.Tensors("trainhealth/report")
        assert text.tensor_proto.string_val[0].decode().startswith(f"```\n{log}")
        ledger = rep["goodput"]["ledger"]
        if ledger is None:  # no step times in the log: no figures, and why
            [note] = ea.Tensors("trainhealth/goodput")
            assert note.tensor_proto.string_val[0].decode() == f"goodput {rep['goodput']['note']}"
            assert not [t for t in scalars if t.startswith(("trainhealth/goodput", "trainhealth/badput"))]
            continue
        [goodput] = ea.Scalars("trainhealth/goodput_time_pct")
        assert goodput.step == rep["summary"]["last_step"]
        assert abs(goodput.value - ledger["goodput_pct"]) < 1e-3  # float32 in the event file
        for cause, seconds in ledger["seconds"].items():
            tag = f"trainhealth/badput_seconds/{cause}"
            if cause != "productive" and seconds > 0:
                assert abs(ea.Scalars(tag)[0].value - seconds) <= 1e-6 * seconds + 1e-3
            else:
                assert tag not in scalars
    # The 104B excerpt counts tokens: throughput and goodput tokens/s; the TrOCR state does not.
    assert "trainhealth/goodput_tok_s" in read(tmp_path / "tb" / "megatron_deepspeed_104b_overflow_excerpt").Tags()[
        "scalars"]
    assert "trainhealth/goodput_tok_s" not in read(tmp_path / "tb" / "hf_trocr_large_gradnorm").Tags()["scalars"]
    advice = read(tmp_path / "tb" / "megatron_deepspeed_104b_overflow_excerpt").Tensors("trainhealth/advice")
    assert advice and advice[0].tensor_proto.string_val[0].decode().startswith("**No checkpoint before step 17062")
