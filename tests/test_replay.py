"""Replaying real Hugging Face logs from ../shared/real_logs through collectors → Redis → detectors."""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import redis

from trainhealth.commands.replay import ReplayInterrupted, plan, plan_line, read_points, replay
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import DetectorService
from trainhealth.exceptions import ConfigError, InputFormatError
from trainhealth.logpoint import LogPoint
from trainhealth.wire import decode_steps

ROOT = Path(__file__).resolve().parent.parent
TROCR = "hf_trocr_large_gradnorm.trainer_state.json"
TINYLLAMA = "hf_tinyllama_sft_healthy.trainer_state.json"


def drain(client: redis.Redis) -> DetectorService:
    svc = DetectorService(client, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=60))
    for _ in range(100):
        if svc.run_once(block_ms=20) == 0:
            break
    svc._tick(svc.clock() + 10)
    return svc


def anomalies(client: redis.Redis, run: str) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in client.hgetall(f"th:{{{run}}}:anomalies").items()}


def test_cli_replay_of_trocr_flags_the_one_spike_at_step_682(r: redis.Redis, redis_url: str, real_logs: Path) -> None:
    trocr = real_logs / TROCR
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    out = subprocess.run([sys.executable, "-m", "trainhealth", "replay", str(trocr), "--run", "trocr"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "replayed 700 steps and 7 evaluations" in out.stdout
    drain(r)
    found = anomalies(r, "trocr")
    # the loss spike, and the grad norm's 13x jump at the same step (reported with it: corroborated)
    assert sorted(found) == ["grad_norm_spike:*:682:0", "loss_spike:*:682:0"]
    a = found["loss_spike:*:682:0"]
    assert (a["status"], a["end_step"], a["evidence"]["loss"], a["evidence"]["peak_step"]) == (
        "resolved", 682, 0.4896, 682)
    assert r.hget("th:{trocr}:meta", "source") == b"replay:hf_trocr_large_gradnorm.trainer_state.json"
    assert r.hget("th:{trocr}:meta", "status") == b"finished"
    # Ledger on the synthetic timeline (1 s per step, evaluations for their logged runtime).
    evals = [e["eval_runtime"] for e in json.loads(trocr.read_text())["log_history"] if "eval_runtime" in e]
    snap = json.loads(r.get("th:{trocr}:ledger:latest"))
    sec = snap["seconds"]
    assert sec["program_startup"] == 1.0           # the first logged step (2) takes one step: its launch
    assert sec["productive"] == pytest.approx(1398.0, abs=1e-6)  # steps 3-1400
    assert sec["custom"] == pytest.approx(math.fsum(evals), abs=1e-6)
    assert snap["wall_s"] == pytest.approx(1399.0 + math.fsum(evals), abs=1e-6)
    assert sum(sec.values()) == pytest.approx(snap["wall_s"], abs=1e-6)


def test_healthy_tinyllama_replay_flags_nothing(r: redis.Redis, real_logs: Path) -> None:
    res = replay(real_logs / TINYLLAMA, r, run="tiny")
    assert (res.points, res.evals) == (186, 14)
    drain(r)
    assert anomalies(r, "tiny") == {}
    snap = json.loads(r.get("th:{tiny}:ledger:latest"))
    # tokens come from the cumulative num_tokens: the last train entry's value, of which the first entry's (its
    # 15 steps, booked as the replay's start-up) go with no step time and so not into the rates
    assert snap["tokens_total"] + snap["tokens_unobserved"] == 11424256
    assert snap["tokens_unobserved"] == 61440


def test_replay_bad_input_is_a_clear_error(tmp_path: Path, r: redis.Redis, real_logs: Path) -> None:
    bad = tmp_path / "trainer_state.json"
    bad.write_text('{"log_history": [{"loss": "x", "step": 2}]}')  # no good entry (one bad entry is skipped)
    with pytest.raises(InputFormatError, match=r"log_history\[0\] field 'loss' is not a number: 'x'"):
        replay(bad, r)
    bad.write_text('{"log_history": [{"loss": 1.0, "step": "3"}]}')
    with pytest.raises(InputFormatError, match=r"log_history\[0\] field 'step' is not an integer: '3'"):
        replay(bad, r)
    bad.write_text("{not json")
    with pytest.raises(InputFormatError, match=r"not valid JSON \(line 1, column 2\)"):
        replay(bad, r)
    with pytest.raises(ConfigError, match=r"speed=-1 must be >= 0"):
        replay(real_logs / TROCR, r, speed=-1)
    assert r.keys("*") == []  # nothing half-written


def test_cli_errors_are_one_line_with_exit_2(redis_url: str, real_logs: Path) -> None:
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": "http://nope"}
    out = subprocess.run([sys.executable, "-m", "trainhealth", "replay", str(real_logs / TROCR)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == ("trainhealth: error: TRAINHEALTH_REDIS_URL='http://nope' is not a Redis URL: "
                                  "expected redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://, "
                                  "redis+cluster:// or rediss+cluster://")


def test_doctor_reports_redis_and_missing_service(redis_url: str) -> None:
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    out = subprocess.run([sys.executable, "-m", "trainhealth", "doctor"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert f"Redis: {redis_url} ok" in out.stdout
    assert "Detector service: NOT RUNNING" in out.stdout
    assert "Data: no runs yet" in out.stdout.splitlines()


def test_cli_replay_of_a_generic_csv_with_a_column_mapping(r: redis.Redis, redis_url: str) -> None:
    data = ROOT / "tests" / "data" / "importers" / "loss_log.csv"
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    out = subprocess.run([sys.executable, "-m", "trainhealth", "replay", str(data), "--run", "csvrun", "--format",
                          "csv", "--map", "step=it", "--map", "loss=my_loss", "--map", "grad_norm=gnorm"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    steps = [rec for _, f in r.xrange("th:{csvrun}:steps") for rec in json.loads(f[b"recs"])]
    assert [(d["step"], d.get("loss"), d.get("grad_norm")) for d in steps][:2] == [(100, 3.5, 1.25), (200, 3.25, 1.5)]
    bad = subprocess.run([sys.executable, "-m", "trainhealth", "replay", str(data), "--map", "loss"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--map 'loss' is not FIELD=COLUMN" in bad.stderr


def test_tensorboard_t5_replay_flags_exactly_its_two_grad_norm_spikes(r: redis.Redis, real_logs: Path) -> None:
    # MANIFEST: two isolated grad-norm spikes with no loss reaction, steps 164000 (13.2) and 190000 (35.6)
    res = replay(real_logs / "tensorboard_t5_summarization", r, run="t5")
    assert res.points == 430
    drain(r)
    found = anomalies(r, "t5")
    assert sorted(found) == ["grad_norm_spike:*:164000:0", "grad_norm_spike:*:190000:0"]
    assert [round(found[k]["evidence"]["grad_norm"], 1) for k in sorted(found)] == [13.2, 35.6]
    assert all(a["status"] == "resolved" for a in found.values())


def test_replay_options_are_refused_with_one_line_naming_option_and_value(tmp_path: Path) -> None:
    ok = tmp_path / "ok.csv"
    ok.write_text("step,loss\n" + "".join(f"{i},{3 - i / 100}\n" for i in range(1, 20)))
    other = tmp_path / "other.csv"
    other.write_text("step,loss\n1,2.0\n2,1.9\n")
    env = {k: v for k, v in os.environ.items() if k != "TRAINHEALTH_REDIS_URL"}  # refused before Redis is touched
    cases = [
        (["--speed", "1e-300", ok], "--speed=1e-300 would take 1.9e+301 s to replay the log's 19 s timeline (more "
                                    "than a year); use a larger --speed, or 0 for as fast as possible"),
        (["--speed", "inf", ok], "--speed=inf must be a finite pace factor (0 = as fast as possible)"),
        (["--step-seconds", "inf", ok], "--step-seconds=inf must be a number of seconds > 0 and at most 86400 "
                                        "(one day)"),
        (["--step-seconds", "1e308", ok], "--step-seconds=1e+308 must be a number of seconds > 0 and at most 86400 "
                                          "(one day)"),
        (["--run", "ok3", ok, other], "--run 'ok3' names one run, but the 2 PATHs are replayed as 2 runs; give one "
                                      "PATH, or --one-run for the per-rank logs of one job"),
        (["--run", "", ok], "--run '' is not a valid run id: use 1-128 letters, digits, '.', '_' or '-', starting "
                            "with a letter or digit"),
        # --one-run makes the PATHs one run, so --run names it: here the logs are not per-rank, which is refused
        (["--one-run", "--run", "ok3", ok, other], f"{ok}: a csv log has no rank: --one-run joins per-rank logs of "
                                                   "one job (formats allreduce_bench, kineto_trace)"),
    ]
    for args, message in cases:
        out = subprocess.run([sys.executable, "-m", "trainhealth", "replay", *map(str, args)], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stderr, out.stdout) == (2, f"trainhealth: error: {message}\n", ""), args


def test_replay_api_refuses_a_pace_of_over_a_year_and_an_empty_run(tmp_path: Path, r: redis.Redis) -> None:
    ok = tmp_path / "ok.csv"
    ok.write_text("step,loss\n1,2.0\n11,1.9\n")
    with pytest.raises(ConfigError, match=r"^speed=1e-09 would take 1.1e\+10 s to replay the log's 11 s timeline"):
        replay(ok, r, speed=1e-9)
    with pytest.raises(ConfigError, match=r"^step_seconds=nan must be a number of seconds > 0 and at most 86400"):
        replay(ok, r, step_seconds=math.nan)
    with pytest.raises(ConfigError, match=r"^run='' is not a valid run id"):
        replay(ok, r, run="")
    assert r.keys("*") == []


# --- paced replays: what happens, progress, Ctrl-C, and what the run's meta says --------------------------------

def _untimed_csv(path: Path, steps: int) -> Path:
    """A loss log with no step times: the replay's timeline is assumed (1 s per step)."""
    path.write_text("step,loss\n" + "".join(f"{i},{3 - i / 10_000}\n" for i in range(1, steps + 1)))
    return path


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_paced_replay_says_what_happens_and_ctrl_c_ends_it_as_interrupted(
        tmp_path: Path, r: redis.Redis, redis_url: str, sig: int) -> None:
    log = _untimed_csv(tmp_path / "slow.csv", 1000)
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    # Started with SIGINT ignored, as `nohup` or `cmd &` in a script start it: both signals must still stop it.
    proc = subprocess.Popen([sys.executable, "-m", "trainhealth", "replay", str(log), "--run", "paced",
                             "--speed", "10"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while r.xlen("th:{paced}:steps") < 3:  # a few steps pushed (at 10 per second): then Ctrl-C
            assert time.monotonic() < deadline and proc.poll() is None, "the replay did not start"
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert out.splitlines()[1] == (
        f"replaying 1,000 steps of {log} as run 'paced': the log spans 16.7 min (no step times in the log: timeline "
        "assumed at 1 s per step); at 10x that takes 100 s (Ctrl-C stops it; --speed 0 replays at once)")
    assert "%|" not in err  # stderr is no terminal here: no progress bar
    said = [line for line in err.splitlines() if line.startswith("trainhealth:")]
    assert len(said) == 1
    m = re.fullmatch(r"trainhealth: interrupted after (\d+) of 1,000 steps of run 'paced' \((\d+) s of the log's "
                     r"16.7 min\); run marked 'interrupted'", said[0])
    assert m, said
    pushed = [rec["step"] for _, f in r.xrange("th:{paced}:steps") for rec in json.loads(f[b"recs"])]
    assert pushed == list(range(1, int(m[1]) + 1)) and int(m[2]) == int(m[1])  # step s ends at s seconds
    meta = {k.decode(): v.decode() for k, v in r.hgetall("th:{paced}:meta").items()}
    assert (meta["status"], meta["replay_speed"], meta["timeline"], meta["assumed_step_s"]) == (
        "interrupted", "10.0", "assumed", "1.0")


def test_an_interrupted_replay_stops_the_ledger_at_its_last_step(tmp_path: Path, r: redis.Redis) -> None:
    # A Ctrl-C in the 4th wait: three steps pushed, then the run must not stay "running" (charged as a hang).
    log = _untimed_csv(tmp_path / "slow.csv", 10)
    now = [1_000.0]

    def sleep(s: float) -> None:
        if now[0] > 1_000.25:
            raise KeyboardInterrupt
        now[0] += s

    with pytest.raises(ReplayInterrupted) as info:
        replay(log, r, run="cut", speed=10, clock=lambda: now[0], sleep=sleep)
    assert isinstance(info.value, KeyboardInterrupt)
    res = info.value.result
    assert (res.points, res.total, res.offset_s, res.interrupted, res.delivered) == (3, 10, 3.0, True, True)
    assert r.hget("th:{cut}:meta", "status") == b"interrupted"
    last_t = max(rec["t"] for _, f in r.xrange("th:{cut}:steps") for rec in json.loads(f[b"recs"]))
    assert last_t == pytest.approx(1_000.3)
    svc = drain(r)
    svc._tick(time.time() + 600)  # ten minutes on: the ledger must not charge the time since as a hang
    snap = json.loads(r.get("th:{cut}:ledger:latest"))
    assert snap["t"] == pytest.approx(last_t)
    assert snap["seconds"].get("hang", 0.0) == 0.0
    assert anomalies(r, "cut") == {}


def test_a_paced_replay_waiting_between_pushes_is_not_charged_as_a_hang(tmp_path: Path, r: redis.Redis) -> None:
    # The service looks while the replay waits (status still "running"): the ledger ends at the replay's last
    # record, not at the service's clock, so its pacing never shows as idle or hang time of the job.
    log = _untimed_csv(tmp_path / "slow.csv", 6)
    now = [1_000.0]
    seen: list[dict] = []

    def sleep(s: float) -> None:
        if now[0] > 1_000.25 and not seen:
            # The sender flushes every 0.25 s; on a loaded machine later: wait for the three records sent so far.
            deadline = time.monotonic() + 30
            while sum(len(decode_steps(f)) for _, f in r.xrange("th:{paced2}:steps")) < 3:
                assert time.monotonic() < deadline, "the replay's first three records never reached Redis"
                time.sleep(0.05)
            svc = drain(r)
            svc._tick(time.time() + 600)
            seen.append(json.loads(r.get("th:{paced2}:ledger:latest")))
        now[0] += s

    replay(log, r, run="paced2", speed=10, clock=lambda: now[0], sleep=sleep)
    (snap,) = seen
    assert snap["t"] == pytest.approx(1_000.3)  # the third record's end (0.1 s per assumed step at 10x)
    assert (snap["seconds"].get("hang", 0.0), snap["seconds"].get("idle", 0.0)) == (0.0, 0.0)


def test_paced_replay_reports_progress_while_it_waits(tmp_path: Path, r: redis.Redis) -> None:
    log = tmp_path / "gap.csv"
    log.write_text("step,loss\n1,3.0\n2,2.9\n100,2.5\n")  # steps 1, 2 and 100 end at 1, 2 and 100 s (assumed)
    now = [0.0]  # multiples of 1/8 s: exact in binary, so the ticks below are exact

    def sleep(s: float) -> None:
        now[0] += s

    calls: list[tuple[int, float]] = []
    res = replay(log, r, run="ticks", speed=8, clock=lambda: now[0], sleep=sleep,
                 progress=lambda n, off: calls.append((n, off)))
    assert (res.points, res.total, res.offset_s, res.interrupted) == (3, 3, 100.0, False)
    # after each wait and each point; the 98 s gap (12.25 s at 8x) reports every second of real time
    assert calls == [(0, 1.0), (1, 1.0), (1, 2.0), (2, 2.0), *[(2, 2.0 + 8 * i) for i in range(1, 13)],
                     (2, 100.0), (3, 100.0)]


def test_paced_replay_shows_a_progress_bar_on_a_terminal(tmp_path: Path, r: redis.Redis, redis_url: str) -> None:
    log = _untimed_csv(tmp_path / "short.csv", 20)
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty has 0 columns
    try:
        proc = subprocess.Popen([sys.executable, "-m", "trainhealth", "replay", str(log), "--run", "bar",
                                 "--speed", "10"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(master)
    assert proc.returncode == 0
    assert "replayed 20 steps and 0 evaluations" in out
    bar = re.findall(r"\rbar: (\d+)/20 steps +(\d+)%\|[^|]*\| \[00:0\d<00:0\d\]", seen.decode())
    # step n ends at n of the log's 20 s: the bar (over the log's seconds) is between steps n and n + 1
    assert len(bar) >= 2 and all(int(n) * 5 <= int(pct) <= int(n) * 5 + 5 for n, pct in bar), seen


def test_replay_records_its_pace_and_timeline_in_the_run_meta(r: redis.Redis, real_logs: Path) -> None:
    mega = real_logs / "megatron_deepspeed_104b_overflow_excerpt.log"
    replay(mega, r, run="mega")  # Megatron logs its elapsed time per iteration: every step's time is the log's
    meta = r.hgetall("th:{mega}:meta")
    assert (meta[b"replay_speed"], meta[b"timeline"], meta.get(b"assumed_step_s")) == (b"0.0", b"logged", None)
    assert plan(read_points(mega)).timeline == "logged"
    partly = [LogPoint(1, loss=2.0, step_seconds=2.0), LogPoint(2, loss=1.9)]
    res = replay(mega, r, run="partly", points=partly, step_seconds=3.0)
    assert res.timeline == "partly assumed"
    meta = r.hgetall("th:{partly}:meta")
    assert (meta[b"replay_speed"], meta[b"timeline"], meta[b"assumed_step_s"]) == (b"0.0", b"partly assumed", b"3.0")


def test_plan_line_of_the_104b_excerpt_at_100x(real_logs: Path) -> None:
    mega = real_logs / "megatron_deepspeed_104b_overflow_excerpt.log"
    assert plan_line(plan(read_points(mega)), mega.name, "mega104", 100) == (
        "replaying 19 steps of megatron_deepspeed_104b_overflow_excerpt.log as run 'mega104': the log spans 29.4 "
        "days; at 100x that takes 7.1 h (Ctrl-C stops it; --speed 0 replays at once)")
