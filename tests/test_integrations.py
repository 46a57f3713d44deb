"""Framework integrations against real parts: torch's clip_grad_norm_, a real transformers.Trainer and a real
Lightning Trainer on tiny CPU models, each writing to the test redis-server through trainhealth.Monitor."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

from trainhealth.wire import Event, StepRecord, decode_event, decode_steps

ROOT = Path(__file__).resolve().parent.parent


def steps_of(r: redis.Redis, run: str) -> list[StepRecord]:
    return [rec for _, f in r.xrange(f"th:{{{run}}}:steps") for rec in decode_steps(f)]


def events_of(r: redis.Redis, run: str, kind: str | None = None) -> list[Event]:
    evs = [decode_event(f) for _, f in r.xrange(f"th:{{{run}}}:events")]
    return [e for e in evs if kind is None or e.kind == kind]


# -- import isolation ----------------------------------------------------------------------------------
def test_importing_collectors_and_integrations_loads_no_framework() -> None:
    code = ("import sys, collectors, trainhealth.collectors.integrations, trainhealth.collectors.integrations._common; "
            "print(sorted(m for m in ('torch', 'transformers', 'lightning', 'pytorch_lightning', 'numpy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


# -- torch helpers ----------------------------------------------------------------------------------------
def _model_with_grads() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    frozen = torch.nn.Linear(3, 3)  # parameters without a gradient are skipped, as clip_grad_norm_ does
    model.add_module("frozen", frozen)
    x = torch.randn(64, 16)
    (model[2](model[1](model[0](x))) ** 2).mean().backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_global_grad_norm_equals_clip_grad_norm(norm_type: float) -> None:
    from trainhealth.collectors.integrations.torch import _total_norm, global_grad_norm

    model = _model_with_grads()
    ours = global_grad_norm(model.parameters(), norm_type)
    fallback = float(_total_norm([p.grad for p in model.parameters() if p.grad is not None], norm_type))  # older torch
    reference = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3, norm_type=norm_type))
    assert ours == pytest.approx(reference, rel=1e-6, abs=1e-6)
    assert fallback == pytest.approx(reference, rel=1e-6, abs=1e-6)
    assert ours > 0


def test_global_grad_norm_does_not_clip_and_handles_no_grads() -> None:
    from trainhealth.collectors.integrations.torch import global_grad_norm

    model = _model_with_grads()
    with_grad = [p for p in model.parameters() if p.grad is not None]
    before = [p.grad.clone() for p in with_grad]
    global_grad_norm(model.parameters())
    assert all(torch.equal(a, p.grad) for a, p in zip(before, with_grad, strict=True))
    assert global_grad_norm(torch.nn.Linear(2, 2).parameters()) == 0.0
    w = torch.nn.Parameter(torch.zeros(3))
    w.grad = torch.tensor([1.0, float("nan"), 2.0])
    assert global_grad_norm(w) != global_grad_norm(w)  # NaN is reported, not hidden


def test_grad_norm_value() -> None:
    from trainhealth.collectors.integrations.torch import grad_norm_value

    model = _model_with_grads()
    returned = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert grad_norm_value(returned) == returned.item()
    assert grad_norm_value(1.25) == 1.25 and grad_norm_value(None) is None
    with pytest.raises(ValueError, match="2 elements"):
        grad_norm_value(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="str"):
        grad_norm_value("1.0")


# -- Hugging Face Trainer -------------------------------------------------------------------------------------
class _TokenData(torch.utils.data.Dataset):
    """Random token sequences; the labels are the inputs (causal LM)."""

    def __init__(self, n: int, seq: int = 16, vocab: int = 64, seed: int = 0, delay_s: float = 0.0) -> None:
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow data loader
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _hf_trainer(out: Path, redis_url: str, callbacks: list | None = None, delay_s: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from trainhealth.collectors.integrations.hf import TrainHealthCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(
        output_dir=str(out), run_name="hf tiny/gpt2", max_steps=10, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, logging_steps=2, save_steps=5, eval_strategy="steps", eval_steps=5,
        per_device_eval_batch_size=8, report_to=[], use_cpu=True, include_num_input_tokens_seen="all",
        disable_tqdm=True, learning_rate=1e-3, seed=0, dataloader_num_workers=0,
    )
    cb = TrainHealthCallback(redis_url=redis_url, heartbeat_interval=0.5)
    trainer = Trainer(model=model, args=args, train_dataset=_TokenData(200, delay_s=delay_s),
                      eval_dataset=_TokenData(16, seed=1),
                      callbacks=[cb, *(callbacks or [])])
    return trainer, cb


def test_hf_trainer_run_is_recorded_exactly(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    trainer, cb = _hf_trainer(tmp_path / "out", redis_url)
    trainer.train()
    run = "hf-tiny-gpt2"  # args.run_name made a run id
    assert cb.monitor.run == run
    recs = steps_of(r, run)
    assert [x.step for x in recs] == list(range(1, 11))  # one record per optimizer step, numbered as HF logs
    assert len({x.inc for x in recs}) == 1
    for x in recs:
        assert x.rank == 0 and x.dur is not None and x.dur > 0
        # the forward passes of the step's 2 micro-batches, and the fetch of its batches before on_step_begin
        assert set(x.sections) == {"forward", "data"} and 0 < x.sections["forward"] < x.dur
        assert 0 < x.sections["data"] < x.dur - x.sections["forward"]

    train_logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(train_logs) == [2, 4, 6, 8, 10]
    by_step = {x.step: x for x in recs}
    for step, h in train_logs.items():
        x = by_step[step]
        assert (x.loss, x.grad_norm, x.lr) == (h["loss"], h["grad_norm"], h["learning_rate"])
        assert x.tokens == 2 * 2 * 4 * 16  # 2 steps since the last log x 2 micro-batches x 4 sequences x 16 tokens
    for step in (1, 3, 5, 7, 9):  # no log at these steps: timing only, nothing invented
        assert (by_step[step].loss, by_step[step].grad_norm, by_step[step].lr, by_step[step].tokens) == (
            None, None, None, None)

    evals = {h["step"]: h["eval_runtime"] for h in trainer.state.log_history if "eval_runtime" in h}
    bad = events_of(r, run, "badput")
    assert [(e.step, e.extra["name"], e.seconds) for e in bad] == [(5, "evaluation", evals[5]),
                                                                    (10, "evaluation", evals[10])]
    # Each evaluation's loss, as the Trainer logged it, for the over-fitting detector.
    eval_losses = [(h["step"], repr(h["eval_loss"])) for h in trainer.state.log_history if "eval_loss" in h]
    assert [(e.step, e.extra["loss"]) for e in events_of(r, run, "eval") if e.extra["name"] == "eval"] == eval_losses
    assert len(eval_losses) == 2
    saves = events_of(r, run, "checkpoint_save")
    assert [e.step for e in saves] == [5, 10] and all(e.seconds > 0 for e in saves)
    assert (tmp_path / "out" / "checkpoint-5").is_dir()
    kinds = [e.kind for e in events_of(r, run)]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    start = events_of(r, run, "run_start")[0]
    assert json.loads(start.extra["config"])["gradient_accumulation_steps"] == 2
    assert r.hget(f"th:{{{run}}}:meta", "status") == b"finished"


def test_hf_slow_data_loader_is_data_loading_not_idle(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """HF fetches a step's micro-batches before on_step_begin: that wait is the step's ``data`` section and
    the ledger's data loading. 8 samples per step (2 micro-batches x 4) at >= 5 ms each: >= 40 ms per step."""
    trainer, _ = _hf_trainer(tmp_path / "out", redis_url, delay_s=0.005)
    trainer.train()
    assert _data_wait_booked(steps_of(r, "hf-tiny-gpt2"), steps=10, min_wait_s=8 * 0.005)


def _data_wait_booked(recs: list, steps: int, min_wait_s: float) -> bool:
    """Each step's data section holds its loader wait, and the ledger counts exactly that as data loading."""
    from trainhealth.detectors.pipeline import RunPipeline

    assert [x.step for x in recs] == list(range(1, steps + 1))
    for x in recs:
        assert min_wait_s <= x.sections["data"] < x.dur - x.sections["forward"]
    pipe = RunPipeline(1)
    for x in recs:
        pipe.feed_step(x)
    snap = pipe.ledger.snapshot(recs[-1].t)
    assert snap["seconds"]["data_loading"] == pytest.approx(sum(x.sections["data"] for x in recs), abs=1e-6)
    return snap["seconds"]["data_loading"] >= steps * min_wait_s


def test_hf_trainer_resume_records_checkpoint_load(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    first, _ = _hf_trainer(tmp_path / "out", redis_url)
    first.train()
    run = "hf-tiny-gpt2"
    inc0 = steps_of(r, run)[0].inc
    resumed, _ = _hf_trainer(tmp_path / "out", redis_url)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-5"))

    loads = events_of(r, run, "checkpoint_load")
    assert [(e.step, e.seconds) for e in loads] == [(5, None)]  # HF restores before any hook: seconds unknown
    assert loads[0].inc != inc0  # a new incarnation: the service sees a restart
    new = [x for x in steps_of(r, run) if x.inc == loads[0].inc]
    assert [x.step for x in new] == [6, 7, 8, 9, 10]
    logs = {h["step"]: h for h in resumed.state.log_history if "loss" in h and h["step"] > 5}
    assert {x.step: x.loss for x in new if x.loss is not None} == {s: h["loss"] for s, h in logs.items()}
    assert {x.step: x.tokens for x in new if x.tokens is not None} == {6: 128, 8: 256, 10: 256}


def test_hf_hook_errors_never_reach_training(caplog: pytest.LogCaptureFixture, redis_url: str,
                                            tmp_path: Path) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from trainhealth.collectors.integrations.hf import TrainHealthCallback

    cb = TrainHealthCallback(redis_url=redis_url, run="hf-broken")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    cb.on_train_begin(args, TrainerState(), TrainerControl())
    caplog.set_level(logging.ERROR, logger="trainhealth.collectors.integrations")
    for _ in range(3):  # a state without global_step: the hook fails inside, training goes on
        assert cb.on_step_begin(args, object(), TrainerControl()) is None
    errors = [rec for rec in caplog.records if "on_step_begin failed" in rec.getMessage()]
    assert len(errors) == 1  # logged once, then counted silently
    cb.on_train_end(args, TrainerState(), TrainerControl())


# -- Lightning ---------------------------------------------------------------------------------------------
class _Slow(torch.utils.data.Dataset):
    """A dataset whose every item takes ``delay_s`` to load."""

    def __init__(self, inner: torch.utils.data.Dataset, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return self.inner[i]


def _lightning_parts(tmp_path: Path, redis_url: str, max_steps: int, delay_s: float = 0.0):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainhealth.collectors.integrations.lightning import TrainHealthCallback

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.batch_losses: list[tuple[int, torch.Tensor]] = []
            self.step_norms: dict[int, float] = {}
            self.step_lrs: dict[int, float] = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.batch_losses.append((self.trainer.global_step + 1, loss.detach().clone()))
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:
            # Runs after the callbacks' hook, on the same unclipped gradients (max_norm=inf: no clipping).
            step = self.trainer.global_step + 1
            self.step_norms[step] = float(torch.nn.utils.clip_grad_norm_(self.parameters(), float("inf")))
            self.step_lrs[step] = optimizer.param_groups[0]["lr"]

        def validation_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(_Slow(data, delay_s) if delay_s else data, batch_size=4)
    torch.manual_seed(0)
    cb = TrainHealthCallback(run="pl-tiny", redis_url=redis_url, count_tokens=lambda b: b[0].numel(),
                             heartbeat_interval=0.5)
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accumulate_grad_batches=2, val_check_interval=4, limit_val_batches=2,
        num_sanity_val_steps=0, default_root_dir=str(tmp_path),
        callbacks=[cb, ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)],
    )
    return trainer, Regressor(), loader, cb


def test_lightning_run_is_recorded_exactly(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    trainer, model, loader, _ = _lightning_parts(tmp_path, redis_url, max_steps=6)
    trainer.fit(model, loader, loader)
    recs = steps_of(r, "pl-tiny")
    assert [x.step for x in recs] == [1, 2, 3, 4, 5, 6]  # optimizer steps of 2 accumulated batches each
    for x in recs:
        micro = [loss for step, loss in model.batch_losses if step == x.step]
        assert len(micro) == 2
        # Lightning divides each micro-batch loss by accumulate_grad_batches; their sum is the step's mean loss.
        assert x.loss == float(micro[0] / 2 + micro[1] / 2)
        assert x.grad_norm == model.step_norms[x.step]
        assert x.lr == model.step_lrs[x.step] == pytest.approx(0.1 * 0.9 ** (x.step - 1))
        assert x.tokens == 2 * 4 * 8
        # Forward passes, and the fetch of both batches: the first before the step's hook, the second inside it.
        assert set(x.sections) == {"forward", "data"} and 0 < x.sections["forward"] < x.dur
        assert 0 < x.sections["data"] < x.dur - x.sections["forward"]
    saves = events_of(r, "pl-tiny", "checkpoint_save")
    assert [e.step for e in saves] == [3, 6] and all(e.seconds > 0 for e in saves)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"]
    evals = events_of(r, "pl-tiny", "badput")
    assert [(e.step, e.extra["name"]) for e in evals] == [(2, "evaluation"), (4, "evaluation"), (6, "evaluation")]
    assert all(e.seconds > 0 for e in evals)
    assert [e.kind for e in events_of(r, "pl-tiny")][-1] == "run_end"
    assert "save_checkpoint" not in vars(trainer)  # the save wrapper is gone after fit


def test_lightning_slow_data_loader_is_data_loading_not_idle(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """Each batch is fetched before on_train_batch_start: 2 batches of 4 samples at >= 5 ms each per step."""
    trainer, model, loader, _ = _lightning_parts(tmp_path, redis_url, max_steps=6, delay_s=0.005)
    trainer.fit(model, loader)
    assert _data_wait_booked(steps_of(r, "pl-tiny"), steps=6, min_wait_s=8 * 0.005)


def test_lightning_resume_records_checkpoint_load(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    trainer, model, loader, _ = _lightning_parts(tmp_path, redis_url, max_steps=6)
    trainer.fit(model, loader, loader)
    inc0 = steps_of(r, "pl-tiny")[0].inc
    trainer2, model2, loader2, _ = _lightning_parts(tmp_path, redis_url, max_steps=6)
    trainer2.fit(model2, loader2, loader2, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))
    loads = events_of(r, "pl-tiny", "checkpoint_load")
    assert [e.step for e in loads] == [3] and loads[0].seconds > 0
    new = [x for x in steps_of(r, "pl-tiny") if x.inc != inc0]
    assert [x.step for x in new] == [4, 5, 6]
    assert [x.loss for x in new] == [float(a / 2 + b / 2) for a, b in (
        [loss for step, loss in model2.batch_losses if step == s] for s in (4, 5, 6))]
