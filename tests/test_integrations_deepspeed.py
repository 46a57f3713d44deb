"""DeepSpeed: a real DeepSpeedEngine (CPU accelerator, gloo) watched by trainhealth.collectors.integrations.deepspeed,
its records in a real Redis exactly as the engine ran: one per optimizer step over the accumulated micro-batches,
the loss as the mean of the micro-batches' losses, DeepSpeed's learning rate, the forward section. The fp16 loss
scaler's skipped steps need a GPU (DeepSpeed refuses fp16 on the CPU): that test runs where one is present."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import deepspeed
    from trainhealth.collectors import Monitor
    from trainhealth.collectors.integrations.deepspeed import watch

    fp16 = sys.argv[1] == "fp16"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    # ZeRO stage 1: DeepSpeed computes the global grad norm (the plain optimizer path reports None).
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                          "warmup_num_steps": 4}}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 40}  # overflows until the scale comes down
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    mon = Monitor(sys.argv[2], rank=0, world_size=1, flush_interval=0.05)
    watch(engine, mon, tokens_per_step=64)
    device = engine.device
    micro, lrs, norms = [], [], []
    for i in range(12):  # 6 optimizer steps of 2 micro-batches
        x = torch.randn(4, 8, device=device)
        if fp16:
            x = x.half()
        loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        micro.append(float(loss))
        if engine.is_gradient_accumulation_boundary():
            engine.step()
            lrs.append(engine.get_lr()[0])
            gn = engine.get_global_grad_norm()
            norms.append(None if gn is None else float(gn))
        else:
            engine.step()
    mon.close()
    print("RESULT", json.dumps({"micro": micro, "lrs": lrs, "norms": norms, "skipped": int(engine.skipped_steps),
                                "global_steps": int(engine.global_steps)}))
""")


def run(tmp_path: Path, redis_url: str, mode: str, run_id: str) -> dict:
    script = tmp_path / "ds_job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29600 + os.getpid() % 300), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "OMP_NUM_THREADS": "1", "DS_BUILD_OPS": "0"}
    out = subprocess.run([sys.executable, str(script), mode, run_id], capture_output=True, text=True, env=env,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def records(r: redis.Redis, run: str) -> list[dict]:
    return [rec for _, f in r.xrange(f"th:{{{run}}}:steps") for rec in json.loads(f[b"recs"])]


def test_a_deepspeed_engine_is_recorded_step_by_step(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    got = run(tmp_path, redis_url, "fp32", "ds-cpu")
    recs = records(r, "ds-cpu")
    assert [x["step"] for x in recs] == [1, 2, 3, 4, 5, 6] == list(range(1, got["global_steps"] + 1))
    for i, x in enumerate(recs):
        a, b = got["micro"][2 * i], got["micro"][2 * i + 1]
        assert x["loss"] == (a + b) / 2
        assert x["lr"] == got["lrs"][i]
        assert x["tokens"] == 64 and x["skipped"] is False
        assert 0 < x["sec.forward"] < x["dur"]
        assert x["grad_norm"] == got["norms"][i] > 0  # DeepSpeed's own global norm (unclipped)


def test_fp16_skipped_steps_where_a_gpu_is_present(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("DeepSpeed refuses fp16 on the CPU: the loss scaler's skipped steps run where a GPU is present")
    got = run(tmp_path, redis_url, "fp16", "ds-fp16")
    recs = records(r, "ds-fp16")
    assert sum(x["skipped"] for x in recs) == got["skipped"] > 0
