"""Accelerate: trainhealth as one of an Accelerator's trackers, on a real Accelerator (CPU), records in a real Redis."""

from __future__ import annotations

import json

import pytest
import redis

pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")


def test_accelerator_log_becomes_a_step_record(r: redis.Redis, redis_url: str) -> None:
    from accelerate import Accelerator

    from trainhealth.collectors.integrations.accelerate import TrainHealthTracker

    tracker = TrainHealthTracker("acc-tiny", redis_url=redis_url, gpu_hour_usd=1.5)
    acc = Accelerator(cpu=True, log_with=[tracker])
    acc.init_trackers("acc-tiny", config={"lr": 0.1})
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    logged = []
    for step in range(1, 6):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        values = {"train_loss": loss.item(), "learning_rate": 0.1, "num_tokens": 32, "epoch": 0}
        logged.append(values)
        acc.log(values, step=step)
    acc.end_training()
    recs = [x for _, f in r.xrange("th:{acc-tiny}:steps") for x in json.loads(f[b"recs"])]
    assert [(x["step"], x["loss"], x["lr"], x["tokens"]) for x in recs] == [
        (s, v["train_loss"], 0.1, 32) for s, v in zip(range(1, 6), logged, strict=True)]
    meta = {k.decode(): v.decode() for k, v in r.hgetall("th:{acc-tiny}:meta").items()}
    assert (meta["status"], meta["gpu_hour_usd"]) == ("finished", "1.5")
