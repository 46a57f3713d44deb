"""The goodput the detector service books, written into the tools people already read: Monitor.goodput_metrics,
the Lightning callback through the trainer's loggers (a real CSVLogger), the HF callback into the job's W&B run
(a real wandb, offline)."""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import pytest
import redis

from trainhealth.collectors import Monitor

# A ledger snapshot as the service writes th:{run}:ledger:latest (the fields goodput_metrics reads, and more).
SNAPSHOT = {"t": 1_796_000_000.0, "wall_s": 3600.0, "goodput_pct": 71.5, "throughput_tok_s": 41_600.0,
            "goodput_tok_s": 29_744.0, "tokens_total": 1_000_000, "tokens_good": 900_000, "badput_cost_usd": 12.5,
            "seconds": {"productive": 2574.0, "straggler_wait": 720.0, "checkpoint_save": 306.0, "hang": 0.0}}
EXPECTED = {"trainhealth/goodput_pct": 71.5, "trainhealth/throughput_tok_s": 41_600.0,
            "trainhealth/goodput_tok_s": 29_744.0, "trainhealth/badput_usd": 12.5,
            "trainhealth/goodput_tokens_pct": 90.0, "trainhealth/badput_s/straggler_wait": 720.0,
            "trainhealth/badput_s/checkpoint_save": 306.0, "trainhealth/incidents_active": 2.0,
            "trainhealth/incidents_critical": 1.0}
# Incidents as the service writes th:{run}:incidents (the fields read here): two active, one resolved.
INCIDENTS = {
    "inc:straggler:13:200:0": {"id": "inc:straggler:13:200:0", "title": "Rank 13 (node-b) is a straggler, costing "
                               "throughput", "severity": "warning", "status": "active", "onset_step": 200},
    "inc:hang:*:900:0": {"id": "inc:hang:*:900:0", "title": "Job hung at step 900, waiting on rank 1 (node-a)",
                         "severity": "critical", "status": "active", "onset_step": 900},
    "inc:loss_spike:*:400:0": {"id": "inc:loss_spike:*:400:0", "title": "Loss spike at step 400",
                               "severity": "warning", "status": "resolved", "onset_step": 400},
}
TITLES = ["CRITICAL: Job hung at step 900, waiting on rank 1 (node-a)",
          "WARNING: Rank 13 (node-b) is a straggler, costing throughput"]


def seed(r: redis.Redis, run: str) -> None:
    r.set(f"th:{{{run}}}:ledger:latest", json.dumps(SNAPSHOT))
    r.hset(f"th:{{{run}}}:incidents", mapping={k: json.dumps(v) for k, v in INCIDENTS.items()})


def test_goodput_metrics_follow_the_services_snapshot(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("gp-metrics", redis_url=redis_url, rank=0, world_size=1, heartbeat_interval=0.1)
    try:
        assert mon.goodput_metrics() == {}  # asks the sender to read it from now on; no I/O here
        time.sleep(0.5)
        assert mon.goodput_metrics() == {}  # the service has written nothing yet
        seed(r, "gp-metrics")
        deadline = time.monotonic() + 10
        while not mon.goodput_metrics().get("trainhealth/goodput_pct") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mon.goodput_metrics() == EXPECTED
        assert [d["id"] for d in mon.incidents()] == ["inc:hang:*:900:0", "inc:straggler:13:200:0"]
        assert mon.goodput_metrics(prefix="th.")["th.goodput_pct"] == 71.5
    finally:
        mon.close()


def test_lightning_logs_the_goodput_to_its_loggers(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from trainhealth.collectors.integrations.lightning import TrainHealthCallback

    seed(r, "pl-goodput")

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(0.03)  # a few heartbeats over the run
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(160, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    cb = TrainHealthCallback(run="pl-goodput", redis_url=redis_url, heartbeat_interval=0.1)
    trainer = pl.Trainer(max_steps=40, accelerator="cpu", devices=1, logger=CSVLogger(str(tmp_path), name="csv"),
                         log_every_n_steps=5, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb], default_root_dir=str(tmp_path))
    trainer.fit(Net(), loader)
    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    logged = [row for row in rows if row.get("trainhealth/goodput_pct")]
    assert logged, rows[:3]
    assert {int(row["step"]) % 5 for row in logged} == {0}  # every log_every_n_steps
    for row in logged:
        assert {k: float(row[k]) for k in EXPECTED} == EXPECTED


def test_hf_trainer_puts_the_goodput_into_the_jobs_wandb_run(r: redis.Redis, redis_url: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    wandb = pytest.importorskip("wandb")
    import runpy

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "trainhealth-test")
    helpers = runpy.run_path(str(Path(__file__).with_name("test_integrations.py")))
    trainer, cb = helpers["_hf_trainer"](tmp_path / "out", redis_url, delay_s=0.02)
    trainer.args.report_to = ["wandb"]
    from transformers.integrations import WandbCallback

    trainer.add_callback(WandbCallback)  # as report_to=["wandb"] in TrainingArguments adds it
    trainer.callback_handler.callbacks.sort(key=lambda c: not isinstance(c, WandbCallback))  # reporters first
    cb.monitor_kwargs["heartbeat_interval"] = 0.1
    run_id = "hf-tiny-gpt2"  # run_name "hf tiny/gpt2" made a run id
    seed(r, run_id)
    try:
        trainer.train()
        summary = dict(wandb.run.summary)
    finally:
        if wandb.run is not None:
            wandb.finish()
    assert {k: summary[k] for k in EXPECTED} == EXPECTED
    assert list(summary["trainhealth/incidents"]) == TITLES
    assert os.path.isdir(tmp_path / "wandb")
