"""Lightning (``lightning.pytorch``) → :class:`trainhealth.Monitor`, as a ``Callback``.

::

    from trainhealth.collectors.integrations.lightning import TrainHealthCallback

    trainer = L.Trainer(callbacks=[TrainHealthCallback(run="llama-8b-sft", gpu_hour_usd=2.5)], ...)
    trainer.fit(model, datamodule)

Lightning calls callback hooks on every rank, so every rank gets its own Monitor (rank
and world size from ``trainer.global_rank`` / ``trainer.world_size``). Mapping, per hook
(source: ``lightning.pytorch`` ``loops/training_epoch_loop.py``,
``loops/optimization/automatic.py``, ``plugins/precision/precision.py``, checked against lightning 2.6):

- ``on_train_batch_start`` → ``on_train_batch_end``: one **optimizer** step, timed with
  ``Monitor.step``. With ``accumulate_grad_batches=n`` the step opens at the first batch of
  the window and closes at the batch where ``trainer.global_step`` advanced. Step numbers
  are ``trainer.global_step`` after the step (1-based). Each batch is fetched before
  ``on_train_batch_start``: the time since the previous hook (``on_train_batch_end``, the end
  of validation or of a checkpoint save) is section ``data``, and a step starts when its first
  batch's fetch did (``Monitor.step(data_from=...)``), so the goodput ledger counts a slow
  data loader as data loading, not idle time.
- Section ``forward``: ``on_train_batch_start`` → ``on_before_backward`` (``training_step``
  and ``zero_grad``), summed over the window: the rank's own work before the gradient
  all-reduce, which under DDP overlaps backward, so a slow rank shows here.
- Loss: ``outputs["loss"]`` of ``on_train_batch_end``, this rank's loss. Lightning divides
  it by ``accumulate_grad_batches``, so the sum over the window is the step's mean loss.
- Grad norm: in ``on_before_optimizer_step`` — after backward (and the DDP all-reduce),
  after AMP unscaling, **before** gradient clipping — with
  :func:`trainhealth.collectors.integrations.torch.global_grad_norm` (``grad_norm=False`` skips it; it
  costs one pass over the gradients and a GPU sync). Learning rate: the first optimizer's
  first param group, read there too (before the scheduler steps).
- Checkpoint save: ``on_save_checkpoint`` runs while the checkpoint dict is built, before
  the write and the barrier, so it cannot time the save. Instead ``trainer.save_checkpoint``
  (which ``ModelCheckpoint`` calls on every rank) is wrapped for the duration of ``fit``:
  ``Monitor.checkpoint_save(global_step)`` around the whole blocking save.
- Resume (``fit(ckpt_path=...)``): ``checkpoint_loaded(global_step)`` at ``on_train_start``,
  with the seconds from the end of ``setup`` to ``on_load_checkpoint`` (reading the file and
  restoring the weights; optimizer state is restored after that and not counted).
- Validation during fit: ``badput("evaluation", seconds)`` from ``on_validation_start`` to
  ``on_validation_end`` (the sanity check before training is start-up, not recorded).
- ``on_train_end``: ``close()``; ``on_exception``: ``close("failed")`` — for a Monitor the
  callback created (a Monitor passed in is the caller's to close).

Every hook swallows its own errors (logged once per hook): monitoring never stops training.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from lightning.pytorch import Callback

from trainhealth.collectors.integrations._common import guarded, run_id
from trainhealth.collectors.integrations.torch import global_grad_norm
from trainhealth.collectors.monitor import Monitor

__all__ = ["TrainHealthCallback"]


class TrainHealthCallback(Callback):
    """Feed a Lightning ``Trainer.fit`` run to trainhealth, on every rank.

    Parameters
    ----------
    monitor : trainhealth.Monitor, optional
        Use this Monitor (the caller closes it). Default: one is created in ``setup("fit")``
        and closed at ``on_train_end``.
    run : str, optional
        Run id for the created Monitor; default the name of ``trainer.default_root_dir``
        made a valid run id (see :func:`trainhealth.collectors.integrations._common.run_id`). Every rank
        must get the same id.
    grad_norm : bool
        Compute the global gradient norm in ``on_before_optimizer_step``.
    count_tokens : callable, optional
        ``count_tokens(batch) -> int``: tokens in one batch on this rank, summed over the
        step's micro-batches and recorded as the step's ``tokens`` (e.g.
        ``lambda b: b["input_ids"].numel()``). Lightning has no notion of tokens.
    log_goodput : bool
        On global rank 0, every ``log_every_n_steps`` steps, log the run's goodput as the detector service last
        booked it (:meth:`trainhealth.Monitor.goodput_metrics`: ``trainhealth/goodput_pct``, tokens/s,
        ``trainhealth/badput_s/<cause>``) to the trainer's loggers — W&B, TensorBoard, CSV, MLflow — beside the
        loss. No Redis I/O in the hook: the collector's thread reads the snapshot with its heartbeats.
    **monitor_kwargs
        Passed to :class:`trainhealth.Monitor` (``redis_url``, ``gpu_hour_usd``, ``host``...);
        ``rank``/``world_size`` default to ``trainer.global_rank``/``trainer.world_size``.

    Notes
    -----
    The loss and grad norm are read as Python floats once per optimizer step, at
    ``on_train_batch_end``: one GPU sync per step, after the optimizer step was queued.
    """

    def __init__(self, monitor: Monitor | None = None, run: str | None = None, *, grad_norm: bool = True,
                 count_tokens: Callable[[Any], int] | None = None, log_goodput: bool = True,
                 **monitor_kwargs: Any) -> None:
        self.run = run
        self.log_goodput = log_goodput
        self.monitor = monitor
        self.grad_norm = grad_norm
        self.count_tokens = count_tokens
        self.monitor_kwargs = monitor_kwargs
        self._owns = monitor is None
        self._active = False  # from setup("fit") to on_train_end / on_exception
        self._step: Any = None  # the open Monitor.step() context
        self._gs0 = 0  # trainer.global_step when the open step began
        self._fwd_open = False
        self._val: Any = None  # the open timed_badput("evaluation") context
        self._loss: torch.Tensor | None = None
        self._gn: float | None = None
        self._lr: float | None = None
        self._tokens: int | None = None
        self._t_setup: float | None = None
        self._load_s: float | None = None
        self._save_wrapper: Callable[..., Any] | None = None
        self._failed_hooks: set[str] = set()
        self._t_mark = perf_counter()  # when the previous hook ended: the next batch's fetch starts here

    # -- lifecycle -------------------------------------------------------------------------------
    @guarded
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self._owns:
            kw = dict(self.monitor_kwargs)
            kw.setdefault("rank", int(trainer.global_rank))
            kw.setdefault("world_size", int(trainer.world_size))
            kw.setdefault("run_config", {"framework": "lightning", "max_steps": trainer.max_steps,
                                         "accumulate_grad_batches": trainer.accumulate_grad_batches,
                                         "world_size": trainer.world_size})
            self.monitor = Monitor(self.run or run_id(Path(trainer.default_root_dir).name, default="lightning"),
                                   **kw)
        self._active = self.monitor is not None
        self._wrap_save(trainer)
        self._t_setup = perf_counter()  # the checkpoint (if any) is read right after setup hooks

    @guarded
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self._t_setup is not None:
            self._load_s = perf_counter() - self._t_setup

    @guarded
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._active and trainer.global_step > 0:
            self.monitor.checkpoint_loaded(int(trainer.global_step), self._load_s)
        self._t_mark = perf_counter()

    @guarded
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish("finished")

    @guarded
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish("failed")
        self._unwrap_save(trainer)

    @guarded
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._unwrap_save(trainer)

    def _finish(self, status: str) -> None:
        if not self._active:
            return
        self._active = False
        self._step = None
        if self._owns and self.monitor is not None:
            self.monitor.close(status)

    # -- steps -----------------------------------------------------------------------------------
    @guarded
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._active:
            return
        mon = self.monitor
        if self._step is None:  # first micro-batch of an optimizer step
            self._gs0 = int(trainer.global_step)
            self._step = mon.step(self._gs0 + 1, data_from=self._t_mark)
            self._step.__enter__()
            self._loss, self._gn, self._lr = None, None, None
            self._tokens = 0 if self.count_tokens is not None else None
        else:  # a later micro-batch: its fetch is inside the open step
            mon.add_section("data", perf_counter() - self._t_mark)
        if self.count_tokens is not None:
            self._tokens = (self._tokens or 0) + int(self.count_tokens(batch))
        mon.section("forward").__enter__()
        self._fwd_open = True

    @guarded
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._end_forward()

    @guarded
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._active:
            return
        if self.grad_norm:
            self._gn = global_grad_norm(pl_module.parameters())
        opts = trainer.optimizers
        if opts and opts[0].param_groups:
            self._lr = float(opts[0].param_groups[0]["lr"])

    @guarded
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._end_forward()
        self._t_mark = perf_counter()
        st = self._step
        if not self._active or st is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
        step = int(trainer.global_step)
        if step <= self._gs0:
            return  # accumulating: the optimizer has not stepped yet
        self._step = None
        st.step = step
        st.__exit__(None, None, None)
        self.monitor.log_step(step, loss=None if self._loss is None else float(self._loss), grad_norm=self._gn,
                              lr=self._lr, tokens=self._tokens)
        every = int(getattr(trainer, "log_every_n_steps", 50) or 50)
        if self.log_goodput and trainer.is_global_zero and step % every == 0 and trainer.loggers:
            metrics = self.monitor.goodput_metrics()
            for logger in trainer.loggers if metrics else ():
                logger.log_metrics(metrics, step=step)

    def _end_forward(self) -> None:
        if self._fwd_open:
            self._fwd_open = False
            self.monitor.section("forward").__exit__(None, None, None)

    # -- validation and checkpoints ------------------------------------------------------------------
    @guarded
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._active and not trainer.sanity_checking:
            self._val = self.monitor.timed_badput("evaluation", step=int(trainer.global_step))
            self._val.__enter__()

    @guarded
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        val, self._val = self._val, None
        if val is not None:
            val.__exit__(None, None, None)
        self._t_mark = perf_counter()

    def _wrap_save(self, trainer: Any) -> None:
        if self._save_wrapper is not None:
            return
        original = trainer.save_checkpoint

        @functools.wraps(original)
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            mon = self.monitor if self._active else None
            if mon is None:
                return original(*args, **kwargs)
            # Heartbeats say phase=checkpoint_save meanwhile; recorded only if the save succeeds.
            try:
                with mon.checkpoint_save(int(trainer.global_step)):
                    return original(*args, **kwargs)
            finally:
                self._t_mark = perf_counter()  # the save is not the next batch's data wait

        trainer.save_checkpoint = save_checkpoint
        self._save_wrapper = save_checkpoint

    def _unwrap_save(self, trainer: Any) -> None:
        wrapper, self._save_wrapper = self._save_wrapper, None
        if wrapper is not None and trainer.__dict__.get("save_checkpoint") is wrapper:
            del trainer.__dict__["save_checkpoint"]  # back to Trainer.save_checkpoint
