"""``trainhealth.init()``: the run id from the launcher, settings from ``TRAINHEALTH_*``, ``TRAINHEALTH_MODE=disabled``
— with a real torchrun job and a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis

from trainhealth.collectors import environment
from trainhealth.collectors.environment import init
from trainhealth.embedded_redis import free_port
from trainhealth.exceptions import ConfigError


@pytest.fixture(autouse=True)
def _no_current() -> None:
    # Each test starts without a Monitor made by an earlier one.
    environment._current = None


def test_every_rank_of_a_torchrun_job_names_the_same_run(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        import trainhealth
        mon = trainhealth.init()
        for step in range(3):
            mon.log_step(step, loss=2.0 - step / 10, tokens=128)
        # One write of a line under PIPE_BUF: the two workers share torchrun's stdout, and print()'s pieces
        # interleaved there: "RUNRUN <id> 1 2", then " <id> 0 2".
        os.write(1, f"RUN {mon.run} {mon.rank} {mon.world_size}\\n".encode())
        mon.close()
    """))
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINHEALTH_", "SLURM_", "TORCHELASTIC_"))}
    env.update(TRAINHEALTH_REDIS_URL=redis_url, TRAINHEALTH_GPU_HOUR_USD="3.25", OMP_NUM_THREADS="1")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(script)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    # A worker's line may come with torchrun's "[rankN]:" prefix (its log-line prefix template).
    said = sorted(line.partition("RUN ")[2].split() for line in out.stdout.splitlines() if "RUN " in line)
    assert len(said) == 2, f"stdout: {out.stdout[-2000:]!r}\nstderr: {out.stderr[-3000:]}"
    [run] = {s[0] for s in said}  # torchrun --standalone gives both ranks one fresh UUID
    assert [s[1:] for s in said] == [["0", "2"], ["1", "2"]]
    meta = {k.decode(): v.decode() for k, v in r.hgetall(f"th:{{{run}}}:meta").items()}
    assert (meta["world_size"], meta["gpu_hour_usd"]) == ("2", "3.25")
    ends = sorted((int(f[b"rank"]), f[b"status"]) for _, f in r.xrange(f"th:{{{run}}}:events")
                  if f[b"kind"] == b"run_end")
    assert ends == [(0, b"finished"), (1, b"finished")]
    recs = [rec for _, f in r.xrange(f"th:{{{run}}}:steps") for rec in json.loads(f[b"recs"])]
    assert sorted((rec["rank"], rec["step"]) for rec in recs) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_slurm_array_task_and_settings_from_the_environment(r: redis.Redis, redis_url: str) -> None:
    env = {"SLURM_JOB_ID": "48213", "SLURM_ARRAY_JOB_ID": "48200", "SLURM_ARRAY_TASK_ID": "13",
           "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "TRAINHEALTH_REDIS_URL": redis_url,
           "TRAINHEALTH_HEARTBEAT_INTERVAL": "0.2", "TRAINHEALTH_BUFFER_RECORDS": "5000"}
    mon = init(env=env, rank=3)  # an argument wins over the environment
    try:
        assert (mon.run, mon.rank, mon.world_size) == ("48200_13", 3, 8)
        assert init(env=env) is mon  # a second call: the same Monitor
        with pytest.raises(ConfigError, match=r"init\(run='other'\): this process already monitors run "
                                              r"'48200_13'; close\(\) it first"):
            init("other", env=env)
        deadline = time.monotonic() + 10
        while not r.hexists("th:{48200_13}:hb", "3") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(r.hget("th:{48200_13}:hb", "3"))["step"] is None
    finally:
        assert mon.close()
    assert init(env=env) is not mon  # closed: the next call makes a new one
    environment._current.close()


def test_disabled_mode_checks_settings_then_does_nothing(tmp_path: Path) -> None:
    port = free_port(0)  # nothing listens there: a connection attempt would show as a sender thread retrying
    env = {"TORCHELASTIC_RUN_ID": "gpt-7b", "TRAINHEALTH_MODE": "disabled",
           "TRAINHEALTH_REDIS_URL": f"redis://127.0.0.1:{port}/0"}
    threads = threading.active_count()
    mon = init(env=env)
    with mon.step(1), mon.section("forward"):
        pass
    mon.log_step(1, loss=float("nan"))
    mon.checkpoint_saved(1, 3.0)
    assert threading.active_count() == threads and not mon.connected and mon.buffered == 0
    assert (mon.flush(), mon.close()) == (False, False)
    with pytest.raises(ConfigError, match=r"rank=9 .*world_size"):
        init(env={**env, "RANK": "9", "WORLD_SIZE": "4"})  # still checked when disabled


@pytest.mark.parametrize(("env", "message"), [
    ({}, "no run id: pass init(run=...) or set one of TRAINHEALTH_RUN_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID"),
    ({"TORCHELASTIC_RUN_ID": "none"}, "no run id"),
    ({"SLURM_JOB_ID": "job 7"}, "environment SLURM_JOB_ID: run='job 7'"),
    ({"TRAINHEALTH_RUN_ID": "a", "TRAINHEALTH_MODE": "offline"},
     "environment TRAINHEALTH_MODE='offline' is not one of online, disabled, off"),
    ({"TRAINHEALTH_RUN_ID": "a", "TRAINHEALTH_GPU_HOUR_USD": "2,5"},
     "environment TRAINHEALTH_GPU_HOUR_USD='2,5' is not a number (gpu_hour_usd)"),
    ({"TRAINHEALTH_RUN_ID": "a", "TRAINHEALTH_BUFFER_RECORDS": "1e5"},
     "environment TRAINHEALTH_BUFFER_RECORDS='1e5' is not an integer (buffer_records)"),
    ({"TRAINHEALTH_RUN_ID": "a", "TRAINHEALTH_GPU_HOUR_USD": "-1"},
     "environment TRAINHEALTH_GPU_HOUR_USD='-1': gpu_hour_usd=-1.0 must be a number >= 0"),
    ({"TRAINHEALTH_RUN_ID": "a", "TRAINHEALTH_HEARTBEAT_INTERVAL": "0"},
     "environment TRAINHEALTH_HEARTBEAT_INTERVAL='0': heartbeat_interval=0.0 must be a finite number of seconds > 0"),
])
def test_bad_environment_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        init(env={**env, "TRAINHEALTH_MODE": env.get("TRAINHEALTH_MODE", "disabled")})
    assert message in str(err.value)
