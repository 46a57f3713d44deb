"""``trainhealth follow``: a growing log read as it is written — through rotation, truncation and lines written in
pieces — into Redis, and the detector service acting on it live.

The logs written are the real ones of ../shared/real_logs, appended a piece at a time by a writer thread (or the
test itself) while the follower reads; every step the file holds must arrive once, in order.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from trainhealth.collectors.importers import read, read_items
from trainhealth.collectors.importers.tail import Follow, following, line_start
from trainhealth.collectors.monitor import Monitor
from trainhealth.commands import follow as follow_cmd
from trainhealth.logpoint import LogEvent, LogPoint

MEGATRON = "megatron_deepspeed_104b_overflow_excerpt.log"


def follow_items(path: Path, fmt: str, until: Callable[[list], bool], *, start: int = 0, start_line: int = 0,
                 passes: int = 1, timeout: float = 20.0) -> tuple[list[LogPoint | LogEvent], Follow]:
    """What the reader of ``fmt`` yields from ``path`` while it is followed, until ``until(items)`` holds."""
    items: list[LogPoint | LogEvent] = []
    deadline = time.monotonic() + timeout
    fol = Follow(path, start=start, start_line=start_line, passes=passes, poll_s=0.02,
                 stop=lambda: until(items) or time.monotonic() > deadline)
    token = following.set(fol)
    try:
        for item in read_items(path, fmt):
            items.append(item)
            if until(items):
                break
    finally:
        following.reset(token)
    return items, fol


def write_slowly(path: Path, data: bytes, pieces: int, pause: float = 0.01) -> threading.Thread:
    """Append ``data`` to ``path`` in ``pieces`` cuts (mid-line ones too) from a thread."""
    def run() -> None:
        step = max(1, len(data) // pieces)
        for i in range(0, len(data), step):
            with open(path, "ab") as f:
                f.write(data[i:i + step])
            time.sleep(pause)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_every_step_of_a_log_written_in_pieces_arrives_once_in_order(real_logs: Path, tmp_path: Path) -> None:
    src = real_logs / MEGATRON
    expected = [p.step for p in read(src)]
    path = tmp_path / "train.log"
    writer = write_slowly(path, src.read_bytes(), pieces=97)  # cuts land mid-line, mid-\r\n, mid-number
    items, fol = follow_items(path, "megatron", lambda got: len(got) >= len(expected))
    writer.join()
    assert [p.step for p in items] == expected
    assert [p.loss for p in items] == [p.loss for p in read(src)]
    assert fol.offset == path.stat().st_size  # every complete line read; the last one ends the file


def test_rotation_and_truncation_are_followed(real_logs: Path, tmp_path: Path) -> None:
    lines = (real_logs / MEGATRON).read_bytes().splitlines(keepends=True)
    steps = [re.search(rb"iteration\s+(\d+)/", ln) for ln in lines]
    iters = [ln for ln, m in zip(lines, steps, strict=True) if m and ln.rstrip().endswith(b"|")]  # whole lines
    a, b, c = iters[:6], iters[6:12], iters[12:18]
    path = tmp_path / "train.log"
    path.write_bytes(b"".join(a[:2]))
    want = [int(re.search(rb"iteration\s+(\d+)/", ln).group(1)) for ln in a + b + c]

    def writer() -> None:
        time.sleep(0.2)
        with open(path, "ab") as f:
            f.write(b"".join(a[2:]))
        time.sleep(0.2)
        os.rename(path, tmp_path / "train.log.1")  # logrotate: renamed away, a new file under the name
        time.sleep(0.2)
        path.write_bytes(b"".join(b))
        time.sleep(0.3)
        with open(path, "r+b") as f:  # copytruncate: the same file emptied, then written again
            f.truncate(0)
        time.sleep(0.2)
        with open(path, "ab") as f:
            f.write(b"".join(c))

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    items, fol = follow_items(path, "megatron", lambda got: len(got) >= len(want))
    t.join()
    assert [p.step for p in items] == want
    assert (fol.rotations, fol.truncations) == (1, 1)


def test_following_from_the_end_reads_only_new_lines_with_their_numbers(real_logs: Path, tmp_path: Path) -> None:
    src = (real_logs / MEGATRON).read_bytes()
    cut = len(src) // 2
    path = tmp_path / "train.log"
    path.write_bytes(src[:cut])  # the middle of a line: that line is read whole once it is complete
    start, before = line_start(path, cut)
    assert src[:start].endswith(b"\n") and before == src[:start].count(b"\n")
    want = [p for p in read(real_logs / MEGATRON) if p.source_line > before]
    writer = write_slowly(path, src[cut:], pieces=10)
    items, _ = follow_items(path, "megatron", lambda got: len(got) >= len(want), start=start,
                            start_line=before)
    writer.join()
    assert [(p.step, p.source_line) for p in items] == [(p.step, p.source_line) for p in want]


def test_a_json_lines_log_is_scanned_then_followed(real_logs: Path, tmp_path: Path) -> None:
    src = (real_logs / "llamafactory_luojiu7b_cpt.trainer_log.jsonl").read_bytes().splitlines(keepends=True)[:40]
    path = tmp_path / "trainer_log.jsonl"
    path.write_bytes(b"".join(src[:5]))
    writer = write_slowly(path, b"".join(src[5:]), pieces=13)
    items, _ = follow_items(path, "llamafactory", lambda got: len(got) >= 40, passes=2)
    writer.join()
    assert [p.step for p in items] == [json.loads(x)["current_steps"] for x in src]


def test_a_torchelastic_restart_arrives_as_an_event(real_logs: Path, tmp_path: Path) -> None:
    path = tmp_path / "agent.log"
    path.write_bytes(b"")
    writer = write_slowly(path, (real_logs / "torchelastic_worker_group_restart.log").read_bytes(), pieces=7)
    items, _ = follow_items(path, "torchelastic", lambda got: len(got) >= 1)
    writer.join()
    [ev] = items
    assert isinstance(ev, LogEvent) and ev.kind == "worker_restart"
    assert (ev.get("restart_count"), ev.get("attempts_left")) == (1, 3)


# -- the command, against a real redis-server and detector service ------------------------------------------------
def start_follow(redis_url: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    return subprocess.Popen([sys.executable, "-m", "trainhealth", "follow", *args, "--poll", "0.05"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_follow_command_sends_each_step_live_and_marks_the_run_stopped(r: redis.Redis, redis_url: str,
                                                                       real_logs: Path, tmp_path: Path,
                                                                       wait_for) -> None:
    src = real_logs / MEGATRON
    path = tmp_path / "train.log"
    path.write_bytes(b"")
    proc = start_follow(redis_url, str(path), "--format", "megatron", "--run", "fol-104b")
    try:
        wait_for(lambda: r.hexists("th:{fol-104b}:hb", "0"), 20, "the follower's first heartbeat")
        data = src.read_bytes()
        with open(path, "ab") as f:
            f.write(data[: len(data) // 2])
        expected = [p.step for p in read(src)]
        written = [p.step for p in read(path)]
        got = wait_for(lambda: (s := steps(r, "fol-104b")) and len(s) == len(written) and s, 20, "the first half")
        assert got == written
        with open(path, "ab") as f:
            f.write(data[len(data) // 2:])
        got = wait_for(lambda: (s := steps(r, "fol-104b")) and len(s) == len(expected) and s, 20, "every step")
        assert got == expected
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert out.startswith(f"Redis: {redis_url}\nfollowing {path} (megatron) as run 'fol-104b' (new: all of it)")
    assert err.strip().endswith(f"{len(expected)} steps and 0 events of {path} sent as run 'fol-104b'; run marked "
                                "'stopped'")
    meta = {k.decode(): v.decode() for k, v in r.hgetall("th:{fol-104b}:meta").items()}
    assert (meta["status"], meta["source"], meta["world_size"]) == ("stopped", "follow:train.log", "1")



@contextlib.contextmanager
def followed(monkeypatch: pytest.MonkeyPatch, path: Path, fmt: str, mon: Monitor) -> Iterator[None]:
    """``trainhealth follow``'s Follower on ``path`` in a thread, into ``mon``, re-reading every 0.05 s; stopped,
    and ``mon`` closed as the command does, on the way out."""
    monkeypatch.setattr(follow_cmd, "REREAD_EVERY_S", 0.05)
    stop = threading.Event()
    fol = follow_cmd.Follower(path, fmt, mon, poll_s=0.05, stop=stop.is_set)
    t = threading.Thread(target=fol.run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)
        mon.close("stopped")

def steps(r: redis.Redis, run: str) -> list[int]:
    out = []
    for _, f in r.xrange(f"th:{{{run}}}:steps"):
        out += [rec["step"] for rec in json.loads(f[b"recs"])]
    return out


def test_a_nan_written_to_a_followed_log_is_a_live_critical_anomaly(r: redis.Redis, redis_url: str, real_logs: Path,
                                                                    tmp_path: Path, serve: subprocess.Popen,
                                                                    wait_for) -> None:
    path = tmp_path / "mmdet.log"
    nan_line = (real_logs / "mmengine_text_loss_nan.log").read_text()
    healthy = [re.sub(r"\[ 500/2931\]", f"[{i:4d}/2931]", nan_line).replace("loss: nan", f"loss: {2.0 - i / 1000:.4f}")
               for i in range(50, 500, 50)]
    path.write_text("\n".join(healthy[:3]) + "\n")
    proc = start_follow(redis_url, str(path), "--run", "fol-nan", "--from-start")
    try:
        with open(path, "a") as f:
            f.write("\n".join(healthy[3:]) + "\n" + nan_line + "\n")
        nan = wait_for(lambda: next((a for a in map(json.loads, r.hvals("th:{fol-nan}:anomalies"))
                                     if a["kind"] == "nan_inf"), None), 60, "the NaN anomaly")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    assert (nan["severity"], nan["step"], nan["status"]) == ("critical", 500, "active")
    assert steps(r, "fol-nan") == [*range(50, 500, 50), 500]


def test_follow_refuses_what_it_cannot_follow(redis_url: str, real_logs: Path, tmp_path: Path) -> None:
    cases = {
        str(real_logs / "megatron_bert_release_a100.golden_values.json"):
            "(megatron_golden) cannot be followed: it is written once, complete (a test's golden values, a profiler "
            "trace, a benchmark's output); use `trainhealth replay`.",
        str(real_logs / "kineto_trace_rank0_ws128.json.gz"):
            "is gzip-compressed; a gzip stream cannot be followed while it is written",
    }
    for path, words in cases.items():
        proc = start_follow(redis_url, path)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 2 and words in err, (path, err)
        assert "Traceback" not in err


def test_hf_stdout_bars_and_overflows_are_followed(real_logs: Path, tmp_path: Path) -> None:
    src = real_logs / "deepspeed_overflow_tqdm_hf.log"
    expected = [(p.step, p.skipped) for p in read(src)]
    data = src.read_bytes()
    path = tmp_path / "stdout.log"
    path.write_bytes(data[:200])
    writer = write_slowly(path, data[200:], pieces=9)
    items, _ = follow_items(path, "hf_stdout", lambda got: len([p for p in got if isinstance(p, LogPoint)])
                            >= len(expected) - 1, passes=2)
    writer.join()
    # The scan saw no overflow line yet: skipped steps are unknown (None) until the first one is read; the bar's
    # last step is sent when the next one is drawn (here: none yet).
    first = next(i for i, (_, n) in enumerate(expected) if n)
    want = [(s, None) for s, _ in expected[:first]] + expected[first:-1]
    assert [(p.step, p.skipped) for p in items if isinstance(p, LogPoint)] == want


def test_a_followed_restart_and_watchdog_timeout_reach_the_events_stream(r: redis.Redis, real_logs: Path,
                                                                         tmp_path: Path) -> None:
    from trainhealth.commands.follow import Follower

    for name, fmt, kind in (("torchelastic_worker_group_restart.log", "torchelastic", "worker_restart"),
                            ("nccl_watchdog_timeout_multirank.log", "nccl_watchdog", "collective_timeout")):
        path = tmp_path / name
        path.write_bytes((real_logs / name).read_bytes())
        want = [e for e in read_items(path, fmt) if isinstance(e, LogEvent)]
        run = f"fol-{fmt.replace('_', '-')}"
        mon = Monitor(run, client=r, rank=0, world_size=1)
        fol = Follower(path, fmt, mon, from_start=True, poll_s=0.02, stop=lambda: True)  # reads to the end, stops
        fol.run()
        assert mon.close("stopped")
        got = [f for _, f in r.xrange(f"th:{{{run}}}:events") if f[b"kind"] == kind.encode()]
        assert fol.events == len(want) == len(got) > 0
        for ev, f in zip(want, got, strict=True):
            assert int(f[b"rank"]) == (ev.rank if ev.rank is not None else 0)
            for key, value in ev.fields:
                assert f[key.encode()].decode() == str(value), (key, f)


def test_a_trainer_state_rewritten_at_each_save_sends_only_its_new_steps(r: redis.Redis, real_logs: Path,
                                                                         tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's trainer_state.json is written whole at each save: the follow re-reads it when it changes and sends the
    steps beyond the last it sent; a job resumed from an earlier checkpoint writes it back to that step, then on."""

    state = json.loads((real_logs / "hf_tinyllama_sft_healthy.trainer_state.json").read_text())
    train = [e for e in state["log_history"] if "loss" in e]
    path = tmp_path / "trainer_state.json"

    def save(entries: list[dict]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**state, "log_history": entries}))
        os.replace(tmp, path)  # as the Trainer saves it: a new file under the name

    save(train[:10])
    mon = Monitor("fol-state", client=r, rank=0, world_size=1, flush_interval=0.01)
    with followed(monkeypatch, path, "hf_trainer_state", mon):
        time.sleep(0.5)
        save(train[:25])            # a save: steps 11-25 are new
        time.sleep(0.5)
        save(train[:20])            # resumed from the checkpoint of entry 20: the file goes back
        time.sleep(0.5)
        save(train[:20] + train[20:30])  # and on
        deadline = time.monotonic() + 10
        want = [e["step"] for e in train[10:25]] + [train[19]["step"]] + [e["step"] for e in train[20:30]]
        while steps(r, "fol-state") != want and time.monotonic() < deadline:
            time.sleep(0.05)
    assert steps(r, "fol-state") == want
    # The step the file went back to is a resume of the same process (the Monitor says so), not a new run.
    resumes = [f for _, f in r.xrange("th:{fol-state}:events") if f[b"kind"] == b"resume"]
    assert [(int(f[b"step"]), int(f[b"from_step"])) for f in resumes] == [(train[19]["step"], train[24]["step"])]


def test_a_lightning_csv_growing_and_rewritten_with_a_new_column_is_followed(r: redis.Redis, real_logs: Path,
                                                                            tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's CSVLogger appends rows, and writes the file whole again when a metric appears: both are
    followed, the steps beyond the last sent go out once."""

    lines = (real_logs / "lightning_slm_wikitext103.metrics.csv").read_text().splitlines(keepends=True)
    path = tmp_path / "metrics.csv"

    def steps_of(text: str) -> list[int]:
        part = tmp_path / "part.csv"
        part.write_text(text)
        return [p.step for p in read(part)]

    path.write_text("".join(lines[:40]))
    mon = Monitor("fol-csv", client=r, rank=0, world_size=1, flush_interval=0.01)
    with followed(monkeypatch, path, "lightning_csv", mon):
        time.sleep(0.5)
        with open(path, "a") as f:
            f.write("".join(lines[40:120]))  # appended rows
        time.sleep(0.5)
        # A new metric: the whole file again, one more column on every row, and more rows.
        rewritten = "".join(ln.rstrip("\n") + ("," + ("extra" if i == 0 else "1.0")) + "\n"
                            for i, ln in enumerate(lines[:200]))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(rewritten)
        os.replace(tmp, path)
        seen = max(steps_of("".join(lines[:40])))
        want = [s for s in steps_of(rewritten) if s > seen]
        deadline = time.monotonic() + 10
        while steps(r, "fol-csv") != want and time.monotonic() < deadline:
            time.sleep(0.05)
    assert steps(r, "fol-csv") == want and len(want) > 20


def test_a_tensorboard_run_directory_is_followed_as_it_grows(r: redis.Redis, real_logs: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An event file written record by record (TensorBoard's own writer) in a run directory: each re-read sends
    the steps beyond the last sent."""
    import shutil


    src = next((real_logs / "tensorboard_t5_summarization").iterdir())
    data = src.read_bytes()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = run_dir / src.name
    # Cut the file at a record boundary near its middle: TFRecord frames are length(8) crc(4) data crc(4).
    import struct
    pos, cut = 0, 0
    while pos < len(data):
        n = struct.unpack("<Q", data[pos:pos + 8])[0]
        pos += 12 + n + 4
        if pos <= len(data) // 2:
            cut = pos
    target.write_bytes(data[:cut])
    half = [p.step for p in read(run_dir)]
    mon = Monitor("fol-tb", client=r, rank=0, world_size=1, flush_interval=0.01)
    with followed(monkeypatch, run_dir, "tensorboard", mon):
        time.sleep(0.5)
        with open(target, "ab") as f:
            f.write(data[cut:])
        want = [p.step for p in read(src) if p.step > max(half)]
        deadline = time.monotonic() + 15
        while steps(r, "fol-tb") != want and time.monotonic() < deadline:
            time.sleep(0.05)
    shutil.rmtree(run_dir)
    assert steps(r, "fol-tb") == want and len(want) > 100


def test_follow_started_before_the_log_exists_waits_and_detects_it(r: redis.Redis, redis_url: str, real_logs: Path,
                                                                  tmp_path: Path, wait_for) -> None:
    path = tmp_path / "later.log"
    proc = start_follow(redis_url, str(path), "--run", "fol-later")
    try:
        time.sleep(1.0)
        assert proc.poll() is None  # waiting, not refusing
        path.write_bytes((real_logs / MEGATRON).read_bytes())
        want = [p.step for p in read(path)]
        got = wait_for(lambda: (s := steps(r, "fol-later")) and len(s) == len(want) and s, 30, "every step")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert got == want  # the file's lines were written after the follow started: all of them are new
    assert f"waiting for {path} to be written" in out and "following" in out and "(megatron)" in out


def test_a_trainer_state_s_evaluation_of_two_sets_sends_both_losses(r: redis.Redis, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``eval_dataset`` a dict, HF's Trainer logs one entry per eval set at the same step: each set's loss
    goes out once, also when the file is saved again with both."""
    path = tmp_path / "trainer_state.json"

    def save(entries: list[dict]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"global_step": entries[-1]["step"], "log_history": entries}))
        os.replace(tmp, path)

    train = [{"step": s, "loss": 3.0 - s / 100, "learning_rate": 1e-4, "epoch": s / 100} for s in range(1, 21)]
    evals = [{"step": 10, "epoch": 0.1, f"eval_{name}_loss": loss, f"eval_{name}_runtime": 1.5}
             for name, loss in (("wiki", 2.5), ("code", 1.75))]
    save(train[:5])
    mon = Monitor("fol-sets", client=r, rank=0, world_size=1, flush_interval=0.01)
    with followed(monkeypatch, path, "hf_trainer_state", mon):
        time.sleep(0.3)
        save(train[:10] + evals[:1])  # a save written between the two sets' entries
        time.sleep(0.3)
        save(train[:10] + evals + train[10:15])
        time.sleep(0.3)
        save(train[:10] + evals + train[10:20])  # and the next save has both again
        deadline = time.monotonic() + 10
        while steps(r, "fol-sets") != list(range(6, 21)) and time.monotonic() < deadline:
            time.sleep(0.05)
    got = [(f[b"name"], f[b"loss"], f[b"step"]) for _, f in r.xrange("th:{fol-sets}:events") if f[b"kind"] == b"eval"]
    assert got == [(b"eval_wiki", b"2.5", b"10"), (b"eval_code", b"1.75", b"10")]


def test_an_evaluation_followed_sends_its_badput_and_its_losses(r: redis.Redis) -> None:
    from trainhealth.logpoint import LogPoint

    mon = Monitor("fol-eval", client=r, rank=0, world_size=1, flush_interval=0.01)
    fol = follow_cmd.Follower(Path("unused.json"), "hf_trainer_state", mon, poll_s=0.05, stop=lambda: True)
    fol._push(LogPoint(step=40, eval_seconds=2.5, eval_losses=(("eval", 1.25), ("eval_wiki", 2.5))))
    assert mon.flush(10)
    mon.close("stopped")
    got = [(f[b"kind"], f.get(b"name"), f.get(b"loss"), f.get(b"seconds"))
           for _, f in r.xrange("th:{fol-eval}:events") if f[b"kind"] in (b"badput", b"eval")]
    assert got == [(b"badput", b"evaluation", None, b"2.5"), (b"eval", b"eval", b"1.25", None),
                   (b"eval", b"eval_wiki", b"2.5", None)]
