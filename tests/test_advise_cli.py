"""`trainhealth advise`: recommendations for people and launchers, and their lifecycle, from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis

from trainhealth import Monitor
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import DetectorService

T0 = 1_800_000_000.0


def cli(redis_url: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    return subprocess.run([sys.executable, "-m", "trainhealth", "advise", *argv], env=env, capture_output=True,
                          text=True, timeout=60)


def test_advise_shows_exports_and_moves_a_recommendation(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    mon = Monitor("cli-adv", client=r, rank=0, world_size=1, started_at=T0, gpu_hour_usd=2.0, flush_interval=0.01)
    for s in range(560):
        loss = (3.0 if s < 400 else 6.0) + 0.001 * (s % 7)
        mon.log_step(s, loss=loss, tokens=1000, consumed_samples=(s + 1) * 8, timestamp=T0 + 10 + s)
        if (s + 1) % 100 == 0:
            mon.checkpoint_saved(s, 1.0)
    assert mon.flush(10)
    svc = DetectorService(r, consumer="t", clock=lambda: T0 + 1000, hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(50):
        if svc.run_once(block_ms=20) == 0:
            break

    out = cli(redis_url, "cli-adv", "--id", "rec:divergence:*:400:0")
    assert out.returncode == 0, out.stderr
    # 1 s steps, 1 GPU at $2/h: 251 steps to recompute (figures refreshed at step 550) = 0.07 GPU-hours
    assert out.stdout.splitlines()[:2] == [
        "[proposed] rec:divergence:*:400:0 — rollback",
        "  Roll back to the checkpoint of step 299 and skip the batches of steps 300-600: recomputes 251 steps "
        "(0.07 GPU-hours, $0.14, 4.2 min of the run's time)",
    ]

    out = cli(redis_url, "cli-adv", "--id", "rec:divergence:*:400:0", "--megatron")
    assert out.stdout.strip() == ("--ckpt-step 299 --train-range-to-skip 300 600 --iterations-to-skip "
                                  + " ".join(str(i) for i in range(300, 601)))
    skip = tmp_path / "skip_batches.json"
    out = cli(redis_url, "cli-adv", "--id", "rec:divergence:*:400:0", "--lightning", str(skip))
    assert json.loads(skip.read_text()) == {"version": 1, "run": "cli-adv", "resume_from_step": 299,
                                            "skip_steps": [300, 600], "skip_batches": [300, 601],
                                            "skip_samples": [2400, 4808]}

    out = cli(redis_url, "cli-adv", "--id", "rec:divergence:*:400:0", "--set", "applied", "--by", "sre")
    assert (out.returncode, out.stdout.strip()) == (0, "rec:divergence:*:400:0: applied")
    stored = json.loads(r.hget("th:{cli-adv}:recommendations", "rec:divergence:*:400:0"))
    assert stored["status"] == "applied" and stored["history"][-1]["by"] == "sre"

    out = cli(redis_url, "cli-adv", "--json")
    assert sorted(d["id"] for d in json.loads(out.stdout)) == ["rec:divergence:*:400:0", "rec:loss_spike:*:400:0"]

    bad = cli(redis_url, "nope")
    assert (bad.returncode, bad.stderr.strip()) == (2, "trainhealth: error: run='nope' is not in the run registry")
    bad = cli(redis_url, "cli-adv", "--id", "rec:x")
    assert bad.stderr.strip() == "trainhealth: error: --id='rec:x' is not a recommendation of run 'cli-adv'"
    mon.close()
