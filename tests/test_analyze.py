"""``trainhealth analyze``: the offline post-mortem on real logs from ../shared/real_logs, its JSON schema,
its exit status, the HTML report and the bounded chart series."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from plotly.offline import get_plotlyjs

from trainhealth.collectors import importers
from trainhealth.commands.analyze_report import SCHEMA, SCHEMA_VERSION, ChartSeries, analyze_file
from trainhealth.detectors.offline import OfflineRun
from trainhealth.logpoint import LogEvent, LogPoint
from trainhealth.timeline import arrange, timeline

ROOT = Path(__file__).resolve().parent.parent
TROCR = "hf_trocr_large_gradnorm.trainer_state.json"
TINYLLAMA = "hf_tinyllama_sft_healthy.trainer_state.json"
WORD_LM = "pytorch_word_lm_all_nan.log"
NCCL = "nccl_watchdog_timeout_multirank.log"
ELASTIC = "torchelastic_worker_group_restart.log"

#: Per real log, what is stable while the detectors are being tuned: (training steps, first step, last step,
#: timeline, anomalies as (kind, severity, onset step, end step, status)). Add a row per log once its
#: expected findings are settled (docs/anomalies.md, MANIFEST.md of the real logs).
EXPECTED = {
    # The loss spike at 682 and, with it, the grad norm's 13x jump (alone it would be within this run's noise).
    TROCR: (700, 2, 1400, "assumed", [("loss_spike", "warning", 682, 682, "resolved"),
                                      ("grad_norm_spike", "warning", 682, 682, "resolved")]),
    TINYLLAMA: (186, 15, 2790, "assumed", []),
    WORD_LM: (70, 200, 14732, "logged", [("nan_inf", "critical", 200, None, "active")]),
    # Loss exactly 0 with a NaN grad norm on all 10 printed dicts: a collapse and a NaN update, one incident.
    "hf_stdout_loss_zero_gradnorm_nan.log": (10, 1, 10, "assumed", [("nan_inf", "critical", 1, None, "active"),
                                                                    ("loss_collapse", "critical", 1, None, "active")]),
    # 30 steps of a noisy excerpt: 5.128 at 13000 is 2.8x every earlier point, back at 13001.
    "tf_deeplab_steps_checkpoint.log": (30, 12972, 13001, "logged", [("loss_spike", "warning", 13000, 13000,
                                                                      "resolved")]),
    # Healthy: grad-norm blips that do not move the loss are info; the late flattening is the LR decaying to 0.
    "llmc_gpt2_124m_main.log": (19552, 0, 19551, "assumed", [
        ("grad_norm_spike", "info", 3843, 3843, "resolved"), ("grad_norm_spike", "info", 7689, 7690, "resolved"),
        ("grad_norm_spike", "info", 8715, 8716, "resolved"), ("grad_norm_spike", "info", 18658, 18658, "resolved")]),
    "megatron_bert_release_a100.golden_values.json": (4001, 1, 20000, "partial", []),
    # Six eval sets rising from 802-1203 on while the training loss falls: over-fitting, open to the end.
    "hf_overfit_30epochs.trainer_state.json": (30, 401, 12030, "assumed", [
        ("overfitting", "warning", 1203, None, "active")]),
    "llamafactory_luojiu7b_cpt.trainer_log.jsonl": (1742, 5, 8710, "logged", []),
    # Logs of events only (no training step): the onset is step 0, the start of their timeline.
    NCCL: (0, None, None, "assumed", [("hang", "critical", 0, None, "active")]),
    ELASTIC: (0, None, None, "assumed", [("restart", "warning", 0, 0, "resolved")]),
}

FILE_KEYS = ["path", "format", "run", "error", "summary", "anomalies", "recommendations", "goodput"]
SUMMARY_KEYS = ["steps", "evaluations", "first_step", "last_step", "restarts", "metrics", "non_finite", "timings",
                "timeline", "warnings", "anomalies", "critical"]
ANOMALY_KEYS = sorted(["kind", "severity", "step", "message", "evidence", "ranks", "hosts", "end_step", "status",
                       "gen", "id"])
RECOMMENDATION_KEYS = ["id", "run", "anomaly_id", "kind", "action", "onset_step", "current_step", "checkpoint_step",
                       "skip_steps", "skip_samples", "skip_batches", "recheck_step", "recompute_steps", "cost",
                       "continue_cost", "options", "reasoning", "summary", "commands", "exclude_hosts", "deadline_s"]
GOODPUT_KEYS = ["timeline", "timed_steps", "assumed_step_seconds", "note", "ledger"]


def values(v: list | dict) -> list:
    """A trace's array as a list (Plotly >= 6 writes numeric arrays as ``{"dtype", "bdata"}`` base64)."""
    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).tolist()
    return v


def cli(*args: str | Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRAINHEALTH_REDIS_URL"}  # analyze needs no Redis
    return subprocess.run([sys.executable, "-m", "trainhealth", "analyze", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)


def live_anomalies(path: Path) -> list[dict]:
    """What the live pipeline writes for the log (``Anomaly.to_dict()``), in onset order."""
    run = OfflineRun().feed_all(importers.read_items(path))
    return [a.to_dict() for a in sorted(run.anomalies.values(), key=lambda a: (a.gen, a.step))]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_log_findings(real_logs: Path, name: str) -> None:
    steps, first, last, tl, expected = EXPECTED[name]
    rep = analyze_file(real_logs / name)
    assert (rep.steps, rep.first_step, rep.last_step, rep.timeline, rep.error) == (steps, first, last, tl, None)
    assert [(a.kind, a.severity, a.step, a.end_step, a.status) for a in rep.anomalies] == expected


def test_trocr_json_has_the_spike_at_682_as_the_live_detectors_write_it(real_logs: Path, valid) -> None:
    out = cli(real_logs / TROCR, "--json")
    doc = valid("analyze-report", out.stdout)
    (f,) = doc["files"]
    a, gn = f["anomalies"]
    assert (gn["kind"], gn["step"], gn["end_step"], gn["evidence"]["grad_norm"]) == (
        "grad_norm_spike", 682, 682, 1894075.125)
    assert (a["kind"], a["step"], a["end_step"], a["status"]) == ("loss_spike", 682, 682, "resolved")
    assert (a["evidence"]["loss"], a["evidence"]["peak"], a["evidence"]["peak_step"]) == (0.4896, 0.4896, 682)
    assert f["anomalies"] == live_anomalies(real_logs / TROCR)  # kind, severity, evidence, message: exactly
    assert out.returncode == (1 if a["severity"] == "critical" else 0), out.stderr
    assert doc["summary"]["exit_status"] == out.returncode
    # The spike recovered at once: the advice given while it was open is dropped, as the service dismisses it.
    assert f["recommendations"] == []
    summary = f["summary"]
    assert (summary["steps"], summary["evaluations"], summary["timings"]) == (
        700, 7, {"step_seconds": 0, "eval_seconds": 7})
    assert summary["metrics"] == {"loss": 700, "grad_norm": 700, "lr": 700, "tokens": 0, "consumed_samples": 0,
                                  "skipped": 0}
    # No step times: the goodput is not estimated, and says why.
    assert f["goodput"]["timeline"] == "assumed" and f["goodput"]["ledger"] is None
    assert f["goodput"]["note"] == "not estimated: the log has no step times (the timeline is assumed at 1 s per step)"


def test_nccl_watchdog_excerpt_is_one_critical_hang_naming_the_collective(real_logs: Path, valid) -> None:
    """Ranks 0, 2, 4 time out ALLREDUCE SeqNum 1580 (rank 2's wait is cut from the excerpt); ranks 0 and 3 last
    completed 1579 and enqueued 1582: nobody is behind, so no straggler or culprit is named."""
    out = cli(real_logs / NCCL, "--json")
    assert out.returncode == 1, out.stderr
    doc = valid("analyze-report", out.stdout)
    (f,) = doc["files"]
    assert (f["format"], f["error"], doc["summary"]["exit_status"]) == ("nccl_watchdog", None, 1)
    assert f["anomalies"] == [{
        "kind": "hang", "severity": "critical", "step": 0,
        "message": "ranks 0, 2, 4 timed out ALLREDUCE SeqNum 1580 after 600.1 s (timeout 600 s); last completed "
                   "1579, last enqueued 1582 on ranks 0, 3 (PG 1); no rank is behind (no straggler or culprit in the "
                   "log: every reporting rank waits on the same collective with the same progress)",
        "evidence": {
            "source": "nccl_watchdog", "op": "ALLREDUCE", "seq": 1580, "pg": None, "timeout_s": 600.0,
            "waited_s": 600.067, "min_waited_s": 600.06, "waited_s_by_rank": {"0": 600.06, "4": 600.067},
            "numel_in": 466119168, "numel_out": 466119168, "timed_out_ranks": [0, 2, 4], "progress_ranks": [0, 3],
            "last_completed": 1579, "last_enqueued": 1582, "behind_ranks": [], "behind": [], "other_timeouts": [],
            "reporting_ranks": [0, 2, 3, 4]},
        "ranks": [0, 2, 3, 4], "hosts": [], "end_step": None, "status": "active", "gen": 0,
        "id": "hang:collective:0:0"}]
    assert f["anomalies"] == live_anomalies(real_logs / NCCL)
    summary = f["summary"]
    assert (summary["steps"], summary["evaluations"], summary["events"], summary["first_step"]) == (
        0, 0, {"collective_timeout": 5}, None)
    assert list(summary)[:3] == ["steps", "evaluations", "events"]
    assert f["goodput"] == {"timeline": "assumed", "timed_steps": 0, "assumed_step_seconds": 1.0,
                            "note": "not estimated: the log has no training steps (events only)", "ledger": None}
    assert f["recommendations"] == []
    text = cli(real_logs / NCCL).stdout
    assert text == (
        f"{real_logs / NCCL}\n"
        "  format     PyTorch ProcessGroupNCCL watchdog log (collective timeouts) (nccl_watchdog)\n"
        "  run        no training steps: the log reports events only\n"
        "  events     collective timeout 5\n"
        "  anomalies  1 (1 critical)\n"
        "    CRITICAL hang             (no steps) (active)\n"
        f"             {f['anomalies'][0]['message']}\n"
        "  goodput    not estimated: the log has no training steps (events only)\n\n"
        "1 file(s) analysed: 1 anomaly, 1 critical → exit 1\n")


def test_torchelastic_excerpt_is_one_restart(real_logs: Path, valid) -> None:
    out = cli(real_logs / ELASTIC, "--json")
    assert out.returncode == 0, out.stderr
    (f,) = valid("analyze-report", out.stdout)["files"]
    assert (f["format"], f["error"], f["summary"]["events"]) == ("torchelastic", None, {"worker_restart": 1})
    assert f["anomalies"] == [{
        "kind": "restart", "severity": "warning", "step": 0,
        "message": "the launcher (torchelastic) restarted the worker group after it FAILED: restart 1 of at most 3; "
                   "which rank failed, and how, is not in the log",
        "evidence": {"source": "torchelastic", "restart_count": 1, "max_restarts": 3, "attempts_left": 3,
                     "state": "FAILED", "role": "default", "failed_rank": None, "failed_local_rank": None,
                     "exitcode": None, "signal": None, "host": None},
        "ranks": [], "hosts": [], "end_step": 0, "status": "resolved", "gen": 0, "id": "restart:launcher-1:0:0"}]
    assert f["anomalies"] == live_anomalies(real_logs / ELASTIC)
    assert not [a for a in f["anomalies"] if a["severity"] in ("warning", "critical") and a["kind"] != "restart"]


def test_events_alone_are_analysed_but_a_log_with_neither_steps_nor_events_is_an_error(tmp_path: Path, valid) -> None:
    log = tmp_path / "agent.log"
    log.write_text("[default] Worker group FAILED. 3/3 attempts left; will restart worker group\n")
    out = cli(log, "--json")  # the restart decided counts, though its rendezvous is not in the log
    assert out.returncode == 0, out.stderr
    (a,) = valid("analyze-report", out.stdout)["files"][0]["anomalies"]
    assert (a["id"], a["evidence"]["restart_count"]) == ("restart:launcher-1:0:0", 1)
    state = tmp_path / "trainer_state.json"
    state.write_text('{"log_history": [{"step": 4, "eval_runtime": 2.5, "eval_loss": 1.0}]}')
    out = cli(state)
    assert out.returncode == 2
    assert out.stderr == f"trainhealth: error: {state}: no training steps to analyse (read as hf_trainer_state)\n"


def test_events_keep_their_place_among_the_points() -> None:
    """An event is fed where the file has it, at the end of the step before it: a collective timeout after
    step 3 is a hang from step 3, over when step 4 completes; in a per-rank log it joins its rank's timeline."""
    timeout = LogEvent("collective_timeout", rank=0, seconds=600.0, fields=(("op", "ALLREDUCE"), ("seq", 7),
                                                                             ("timeout_s", 600.0)), source_line=4)
    items = [LogPoint(1, loss=2.0), LogPoint(2, loss=2.0), LogPoint(3, loss=2.0), timeout, LogPoint(4, loss=2.0)]
    assert [(tp.is_event, tp.offset) for tp in timeline(items)] == [
        (False, 1.0), (False, 2.0), (False, 3.0), (True, 3.0), (False, 4.0)]
    run = OfflineRun().feed_all(items)
    (a,) = run.anomalies.values()
    assert (a.id, a.status, a.step, a.end_step, run.steps, run.events) == (
        "hang:collective:3:0", "resolved", 3, 4, 4, {"collective_timeout": 1})
    per_rank = [LogPoint(1, rank=1, step_seconds=2.0), LogEvent("worker_restart"),
                LogPoint(1, rank=0, step_seconds=1.0), timeout, LogPoint(2, rank=0, step_seconds=1.0),
                LogPoint(2, rank=1, step_seconds=0.5)]
    arr = arrange(per_rank)
    assert arr.ranks == (0, 1)
    assert [(type(tp.point).__name__, tp.point.rank, tp.offset) for tp in arr.points] == [
        ("LogEvent", None, 0.0), ("LogPoint", 0, 1.0), ("LogEvent", 0, 1.0), ("LogPoint", 1, 2.0),
        ("LogPoint", 0, 2.0), ("LogPoint", 1, 2.5)]


def test_healthy_tinyllama_exits_0_with_no_anomalies(real_logs: Path) -> None:
    out = cli(real_logs / TINYLLAMA)
    assert out.returncode == 0, out.stderr
    assert "  anomalies  0\n" in out.stdout
    assert "timeline ASSUMED at 1 s per step" in out.stdout
    assert out.stdout.endswith("1 file(s) analysed: 0 anomalies, 0 critical → exit 0\n")


def test_all_nan_word_lm_is_critical_and_exits_1(real_logs: Path, valid) -> None:
    out = cli(real_logs / WORD_LM, "--json")
    assert out.returncode == 1, out.stderr
    (f,) = valid("analyze-report", out.stdout)["files"]
    (a,) = f["anomalies"]
    assert (a["kind"], a["severity"], a["step"], a["evidence"]["steps"]) == ("nan_inf", "critical", 200, 70)
    assert f["summary"]["non_finite"] == {"loss": 70, "grad_norm": 0}
    # ms/batch is logged: the ledger runs on the log's own timeline, ending where the last step ends.
    g = f["goodput"]
    end = [tp.offset for tp in timeline(importers.read(real_logs / WORD_LM))][-1]
    assert (g["timeline"], g["timed_steps"]) == ("logged", 70)
    assert g["ledger"]["wall_s"] == pytest.approx(end, abs=1e-6)
    assert math.fsum(g["ledger"]["seconds"].values()) == pytest.approx(end, abs=1e-4)
    rec = f["recommendations"][0]
    assert rec["anomaly_id"] == a["id"] == "nan_inf:*:200:0"
    # NaN from the first logged step on: no data to blame, so no batches to skip.
    assert (rec["action"], rec["summary"]) == ("none_possible", (
        "nan_inf from the run's first logged step (200): there is no healthy state to roll back to and no data to "
        "skip; fix the configuration (learning rate, initialisation, loss scaling, data preprocessing) and restart "
        "from scratch"))


def test_bad_file_exits_2_with_one_line_naming_file_entry_and_field(tmp_path: Path, real_logs: Path, valid) -> None:
    bad = tmp_path / "trainer_state.json"
    bad.write_text('{"log_history": [{"loss": "x", "step": 1}, {"loss": "y", "step": 2}]}')  # no good entry
    out = cli(bad)
    assert out.returncode == 2
    assert out.stderr == f"trainhealth: error: {bad}: log_history[0] field 'loss' is not a number: 'x'\n"
    jsonl = tmp_path / "run.jsonl"
    jsonl.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": "x"}\n')
    out = cli(jsonl, real_logs / TINYLLAMA, tmp_path / "missing.log", "--json")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"trainhealth: error: {jsonl}: line 2 field 'loss' is not a number: 'x'",
        f"trainhealth: error: {tmp_path / 'missing.log'}: cannot read: No such file or directory",
    ]
    doc = valid("analyze-report", out.stdout)  # the good file is still analysed and reported
    assert [f["error"] is None for f in doc["files"]] == [False, True, False]
    assert (doc["summary"]["failed"], doc["summary"]["exit_status"]) == (2, 2)
    # A critical finding in another file wins: the gate must not read it as a mere input error.
    out = cli(jsonl, real_logs / WORD_LM)
    assert out.returncode == 1
    assert out.stdout.endswith("1 file(s) analysed: 1 anomaly, 1 critical; 1 file(s) not readable → exit 1\n")
    # the reason is said once, on stderr; the report names the file and says it was not read
    assert out.stdout.count(f"{jsonl}\n  format     generic JSON lines with a step field (jsonl)\n"
                            "  ERROR      partly read (the reason is on stderr)\n") == 1
    assert "is not a number" not in out.stdout and out.stderr.count("is not a number") == 1
    # Usage errors: a malformed --map, an unknown format.
    out = cli(real_logs / TINYLLAMA, "--map", "loss")
    assert (out.returncode, out.stderr) == (2, "trainhealth: error: --map 'loss' is not FIELD=COLUMN (e.g. "
                                               "loss=train/loss)\n")
    assert cli(real_logs / TINYLLAMA, "--format", "nope").returncode == 2


def test_json_schema_fields_exactly(real_logs: Path, tmp_path: Path, valid) -> None:
    dest = tmp_path / "report.json"
    out = cli(real_logs / TROCR, real_logs / WORD_LM, "--json-file", dest)
    assert out.returncode == 1
    assert out.stdout.startswith(f"{real_logs / TROCR}\n")  # the text report still goes to stdout
    doc = valid("analyze-report", dest.read_text())
    assert list(doc) == ["schema", "schema_version", "trainhealth_version", "summary", "files"]
    assert (doc["schema"], doc["schema_version"]) == (SCHEMA, SCHEMA_VERSION) == ("trainhealth.analyze", 1)
    assert doc["summary"] == {"files": 2, "failed": 0, "anomalies": 3, "critical": 1, "exit_status": 1}
    for f in doc["files"]:
        assert list(f) == FILE_KEYS
        assert list(f["summary"]) == SUMMARY_KEYS
        assert list(f["summary"]["metrics"]) == ["loss", "grad_norm", "lr", "tokens", "consumed_samples", "skipped"]
        assert list(f["summary"]["timings"]) == ["step_seconds", "eval_seconds"]
        assert list(f["goodput"]) == GOODPUT_KEYS
        for a in f["anomalies"]:
            assert sorted(a) == ANOMALY_KEYS
        for r in f["recommendations"]:
            assert list(r) == RECOMMENDATION_KEYS
    assert [f["format"] for f in doc["files"]] == ["hf_trainer_state", "word_lm"]
    ledger = doc["files"][1]["goodput"]["ledger"]
    assert {"wall_s", "seconds", "goodput_pct", "tokens_total", "throughput_tok_s", "goodput_tok_s"} <= set(ledger)


def test_several_paths_report_each_file_in_order(real_logs: Path) -> None:
    out = cli(real_logs / TROCR, real_logs / TINYLLAMA, real_logs / WORD_LM)
    assert out.returncode == 1
    heads = [line for line in out.stdout.splitlines() if line.startswith(str(real_logs))]
    assert heads == [str(real_logs / n) for n in (TROCR, TINYLLAMA, WORD_LM)]
    assert "    WARNING  loss_spike       steps 682–682 (recovered fast)\n" in out.stdout
    assert "    CRITICAL nan_inf          steps 200–… (active)\n" in out.stdout
    assert out.stdout.endswith("3 file(s) analysed: 3 anomalies, 1 critical → exit 1\n")


def test_a_spike_that_did_not_recover_reads_so_beside_its_divergence(real_logs: Path) -> None:
    out = cli(real_logs / "megatron_deepspeed_104b_overflow_excerpt.log")
    assert out.returncode == 1
    assert [line for line in out.stdout.splitlines() if re.match(r"    (CRITICAL|WARNING) ", line)] == [
        "    CRITICAL loss_spike       steps 17062–17064 (over, loss not recovered)",
        "    CRITICAL divergence       steps 17062–… (active)",
        "    WARNING  skipped_steps    steps 17062–… (active)"]


def test_html_report_is_standalone_with_the_figures(real_logs: Path, tmp_path: Path) -> None:
    dest = tmp_path / "report.html"
    out = cli(real_logs / TROCR, real_logs / WORD_LM, "--html", dest)
    assert out.returncode == 1, out.stderr
    page = dest.read_text()
    assert re.findall(r"<script[^>]*\bsrc\s*=", page) == [] and "<link" not in page  # nothing loaded from outside
    assert page.count(get_plotlyjs()) == 1  # plotly.js embedded once
    figures = re.findall(r'Plotly\.newPlot\(\s*"([^"]+)"', page)
    assert figures == ["curves-0", "curves-1", "steptime-1", "goodput-1"]  # TrOCR has no step times
    data = json.loads(re.search(r'Plotly\.newPlot\(\s*"curves-0",\s*(\[.*?\]),\s*\{', page, re.S).group(1))
    loss = next(t for t in data if t.get("name") == "loss")
    x, y = values(loss["x"]), values(loss["y"])
    assert len(x) == 700 and x[340] == 682 and y[340] == 0.4896  # every step: 700 is below the chart's cap
    marker = next(t for t in data if t.get("name") == "warning anomaly")
    assert values(marker["x"]) == [682.0, 682.0] and "loss 0.4896 at step 682" in marker["hovertext"][0]
    assert "not estimated: the log has no step times" in page


def test_progress_bar_only_when_asked_or_on_a_terminal(real_logs: Path) -> None:
    log = real_logs / "modded_nanogpt_soap.log"
    shown = cli(log, "--progress", "always", "--json")
    assert "modded_nanogpt_soap.log" in shown.stderr and "line" in shown.stderr
    assert cli(log, "--json").stderr == ""  # stderr is a pipe here: no bar


def test_an_error_late_in_a_file_keeps_what_was_found_before(tmp_path: Path, valid) -> None:
    rows = [{"step": s, "loss": 3.0 - s / 1000 + (0.01 if s % 2 else -0.01)} for s in range(1, 301)]
    rows[199]["loss"] = 9.0  # a one-step loss spike at step 200
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 301, "loss": "oops"}\n')
    out = cli(path, "--json")
    assert out.returncode == 2
    assert out.stderr == f"trainhealth: error: {path}: line 301 field 'loss' is not a number: 'oops'\n"
    (f,) = valid("analyze-report", out.stdout)["files"]
    assert f["error"] == f"{path}: line 301 field 'loss' is not a number: 'oops'"
    assert f["summary"]["steps"] == 300
    assert [(a["kind"], a["step"]) for a in f["anomalies"]] == [("loss_spike", 200)]


def test_chart_series_is_bounded_and_keeps_spikes_gaps_and_pinned_steps() -> None:
    s = ChartSeries(buckets=50)
    for i in range(1, 100_001):
        loss = 9.0 if i == 61_234 else math.nan if i == 80_000 else 2.0 + (i % 7) / 100
        s.add(i, loss, 1.0 + (i % 5) / 10, 0.3)
        if i == 61_240:
            s.pin([61_233])  # an anomaly's onset, reported a few steps later
    rows = s.rows()
    assert s.points == 100_000
    assert len(rows) <= 11 * 50
    steps = [r[1] for r in rows]
    assert steps == sorted(set(steps)) and steps[0] == 1 and steps[-1] == 100_000
    assert max((r for r in rows if math.isfinite(r[2])), key=lambda r: r[2])[1:3] == (61_234, 9.0)
    assert [r[1] for r in rows if math.isnan(r[2])] == [80_000]
    assert (0, 61_233, 2.0 + 61_233 % 7 / 100, 1.0 + 61_233 % 5 / 10, 0.3) in rows
    # A step going back (a resumed run in the same file) starts generation 1.
    s.add(50_000, 2.5, 1.0, 0.3)
    assert s.rows()[-1] == (1, 50_000, 2.5, 1.0, 0.3)
    with pytest.raises(ValueError, match="buckets=1 must be >= 2"):
        ChartSeries(buckets=1)


def test_excerpt_with_gaps_books_the_unlogged_steps_as_unobserved(real_logs: Path, valid) -> None:
    """BLOOM's excerpt: blocks pasted from a 115k-step run (12,695 -> 31,214 -> ... -> 45,000). The time of the steps
    between the blocks is unobserved, not a 39.7-day hang; each logged step is its own elapsed time per iteration,
    and its tokens are one step's (the cumulative counter's jump over a stretch is left out of the rates)."""
    path = real_logs / "megatron_deepspeed_bloom176b_excerpt.log"
    out = cli(path, "--json")
    (f,) = valid("analyze-report", out.stdout)["files"]
    assert f["goodput"]["note"] == (
        "estimated from the step times in the log; the log skips 4 stretches of steps (32,288 steps not logged, the "
        "largest 12,695 -> 31,214): their time is unobserved, neither productive nor a hang, and the tokens the log "
        "counts for them are left out of the rates")
    assert f["recommendations"] == []  # the spike at 31219 recovered by itself: no stale rollback advice
    pts = list(importers.read(path))
    first, rest = pts[0], pts[1:]
    jumps = [(b.step - a.step - 1) * b.step_seconds for a, b in zip(pts, rest, strict=False) if b.step - a.step > 10]
    led = f["goodput"]["ledger"]
    assert {k: v for k, v in led["seconds"].items() if v} == {
        "program_startup": pytest.approx(first.step_seconds),  # the first logged step: its launch
        "productive": pytest.approx(math.fsum(p.step_seconds for p in rest), abs=1e-5),
        "unobserved": pytest.approx(math.fsum(jumps), abs=1e-5)}
    assert led["unobserved_gaps"] == {"count": 4, "steps": 32_288, "largest": [12_695, 31_214]}
    assert led["observed_s"] == pytest.approx(led["wall_s"] - led["seconds"]["unobserved"], abs=1e-5)
    # 17 steps of 2,048 x 2,048 tokens; the rest of the counter's 155.65B is the stretches' and the history's.
    assert (led["tokens_total"], led["tokens_good"]) == (17 * 4_194_304, 17 * 4_194_304)
    assert led["tokens_total"] + led["tokens_unobserved"] == 155_652_554_752
    assert led["throughput_tok_s"] == pytest.approx(17 * 4_194_304 / led["seconds"]["productive"])
    assert led["goodput_tok_s"] == pytest.approx(17 * 4_194_304 / led["wall_s"])
    # The last step (45,000: 111 s) is all the last minute holds: goodput and throughput are its 37.8k tokens/s.
    assert led["rates"]["60s"] == {"throughput_tok_s": pytest.approx(4_194_304 / 111.0),
                                   "goodput_tok_s": pytest.approx(4_194_304 / 111.0),
                                   "loss_drop_per_gpu_hour": None, "loss_drop_per_btok": None}  # one step in it
    for rate in led["rates"].values():
        assert rate["goodput_tok_s"] <= rate["throughput_tok_s"]
    text = cli(path).stdout
    assert ("  goodput    0.1% of 39.7 d wall time productive; 39.7 d (99.9%) unobserved: steps the log does not "
            "cover\n             of the 32.1 min the log covers, 94.5% productive\n             badput (of the time "
            "the log covers): program startup 105 s (5.5%)\n             71,303,168 tokens; throughput 39,200 "
            "tokens/s, goodput 21 tokens/s (37,056 tokens/s over the time the log covers)\n") in text
    assert not re.search(r"\bhang\b", text.split("  goodput ")[1].split("  rollback")[0].replace("nor a hang", ""))


def test_a_bad_trainer_state_entry_is_skipped_and_the_rest_analysed(tmp_path: Path, valid) -> None:
    state = tmp_path / "trainer_state.json"
    hist = [{"step": s, "loss": 2.0 - s / 100} for s in range(1, 31)]
    hist[1]["loss"] = "abc"
    state.write_text(json.dumps({"log_history": hist}))
    out = cli(state, "--json")
    assert out.returncode == 0, out.stderr
    (f,) = valid("analyze-report", out.stdout)["files"]
    assert (f["error"], f["summary"]["steps"], f["summary"]["first_step"], f["summary"]["last_step"]) == (
        None, 29, 1, 30)
    assert f["summary"]["warnings"] == [f"{state}: skipped 1 malformed log_history entry(s); the first: "
                                        "log_history[1] field 'loss' is not a number: 'abc'"]


def test_huge_numbers_and_bad_step_seconds_are_one_line_errors(tmp_path: Path) -> None:
    big = tmp_path / "big.jsonl"
    big.write_text('{"step":1,"loss":1.0}\n{"step":2,"loss":%s}\n' % ("9" * 5000))
    step = tmp_path / "step.csv"
    step.write_text("step,loss\n1,1.0\n%s,2.0\n" % ("9" * 400))
    out = cli(big, step)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"trainhealth: error: {big}: line 2 field 'loss' is out of range for a number (beyond 1.8e308): "
        f"{'9' * 40}… (5,000 characters)",
        f"trainhealth: error: {step}: line 3 field 'step' is out of range for a step (above 9,007,199,254,740,991): "
        f"'{'9' * 39}… (402 characters)",
    ]
    for value in ("inf", "1e308", "nan", "0"):
        out = cli(step, "--step-seconds", value)
        shown = repr(float(value))
        assert (out.returncode, out.stdout, out.stderr) == (2, "", f"trainhealth: error: --step-seconds={shown} must "
                                                                   "be a number of seconds > 0 and at most 86400 (one "
                                                                   "day)\n")


def test_a_reader_that_left_ends_it_quietly(real_logs: Path) -> None:
    """`trainhealth analyze --json ... | head`: the pipe's reader is gone; no BrokenPipeError traceback."""
    import os

    r, w = os.pipe()
    os.close(r)
    try:
        out = subprocess.run([sys.executable, "-m", "trainhealth", "analyze", "--json", str(real_logs / TROCR)],
                             stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert (out.returncode, out.stderr) == (141, "")
