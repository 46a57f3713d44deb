"""Hugging Face ``transformers.Trainer`` → :class:`trainhealth.Monitor`, as a ``TrainerCallback``.

::

    from trainhealth.collectors.integrations.hf import TrainHealthCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[TrainHealthCallback(gpu_hour_usd=2.5)])
    trainer.train()

The Trainer runs callbacks on every process, so every rank gets its own Monitor (rank and
world size from ``args.process_index`` / ``args.world_size``). Mapping, per hook (source:
``Trainer._run_epoch`` and ``_maybe_log_save_evaluate``, checked against transformers 5.24):

- ``on_step_begin`` → ``on_step_end``: one **optimizer** step, timed with ``Monitor.step``.
  With ``gradient_accumulation_steps=n`` it spans the n forward/backward passes. The n
  micro-batches are fetched *before* ``on_step_begin`` (``get_batch_samples``), so the step
  starts at the previous hook (``on_step_end``, ``on_log``, ``on_evaluate`` or ``on_save``)
  and that wait is its section ``data`` (``Monitor.step(data_from=...)``): the goodput ledger
  counts a slow data loader as data loading, not idle time. Step numbers are
  ``state.global_step`` after the step (1-based), the numbers HF logs.
- Section ``forward``: the model's forward passes of the step (forward pre/post hooks on
  the model, summed over micro-batches). This is the rank's own work before the gradient
  all-reduce, which under DDP overlaps backward, so a slow rank shows here and the
  straggler detector can name it. ``time_forward=False`` turns the hooks off (they are off
  under ``torch_compile``).
- ``on_log`` (every ``logging_steps``): ``loss``, ``grad_norm``, ``learning_rate`` of
  ``state.global_step``, exactly as logged: the loss is HF's mean over the steps since the
  previous log and over ranks, recorded at the step where HF logs it; steps in between carry
  timing only. ``num_input_tokens_seen`` (with ``include_num_input_tokens_seen``) is global
  and cumulative: its increase since the previous log is recorded as that step's tokens,
  split evenly over the ranks (rank 0 takes the remainder) so the sum over ranks is exact.
- ``on_save``: HF calls it *after* the checkpoint is written, so the save time is the gap
  since the previous hook of that step (``on_step_end``, ``on_log`` or ``on_evaluate``).
- ``on_evaluate``: ``badput("evaluation", eval_runtime)``; on rank 0, ``log_eval`` of each eval set's loss
  (``eval_loss`` as set ``eval``, ``eval_<set>_loss`` as ``eval_<set>``).
- ``on_train_begin`` with ``state.global_step > 0`` (``resume_from_checkpoint``):
  ``checkpoint_loaded(global_step)``; the restore itself happens before any hook, so its
  seconds are unknown.
- ``on_train_end``: ``close()`` of a Monitor the callback created (a Monitor passed in is
  the caller's to close).

Every hook swallows its own errors (logged once per hook): monitoring never stops training.
"""

from __future__ import annotations

import sys
from pathlib import Path
from time import perf_counter
from typing import Any

from transformers import TrainerCallback

from trainhealth.collectors.integrations._common import guarded, run_id
from trainhealth.collectors.monitor import Monitor

__all__ = ["TrainHealthCallback"]


class TrainHealthCallback(TrainerCallback):
    """Feed a ``transformers.Trainer`` run to trainhealth, on every rank.

    Parameters
    ----------
    monitor : trainhealth.Monitor, optional
        Use this Monitor (the caller closes it). Default: one is created at
        ``on_train_begin`` and closed at ``on_train_end``.
    run : str, optional
        Run id for the created Monitor; default ``args.run_name``, else the name of
        ``args.output_dir``, made a valid run id (``[A-Za-z0-9._-]``, see
        :func:`trainhealth.collectors.integrations._common.run_id`).
        Every rank must get the same id.
    time_forward : bool
        Time the model's forward passes as section ``forward`` (module hooks; off under
        ``torch_compile``).
    log_goodput : bool
        On the main process, with each logged step, log the run's goodput as the detector service last booked it
        (:meth:`trainhealth.Monitor.goodput_metrics`) into the job's W&B run when there is one (``report_to``
        ``wandb``): ``trainhealth/goodput_pct``, tokens/s, ``trainhealth/badput_s/<cause>``, the incident counts beside
        the loss, and the active incidents in words in the run's summary (``trainhealth/incidents``).
    **monitor_kwargs
        Passed to :class:`trainhealth.Monitor` (``redis_url``, ``gpu_hour_usd``, ``host``...);
        ``rank``/``world_size`` default to ``args.process_index``/``args.world_size``.

    Notes
    -----
    Creating the Monitor validates its arguments; a bad value (e.g. ``redis_url``) is logged
    and the callback stays inactive rather than failing the job.
    """

    def __init__(self, monitor: Monitor | None = None, run: str | None = None, *, time_forward: bool = True,
                 log_goodput: bool = True, **monitor_kwargs: Any) -> None:
        self.monitor = monitor
        self.log_goodput = log_goodput
        self.run = run
        self.time_forward = time_forward
        self.monitor_kwargs = monitor_kwargs
        self._owns = monitor is None
        self._active = False  # between on_train_begin and on_train_end
        self._step: Any = None  # the open Monitor.step() context
        self._in_step = False
        self._fwd_open = False
        self._hooks: list[Any] = []
        self._t_last = 0.0  # perf_counter() when the previous hook of this step ran
        self._tokens_seen: int | None = None
        self._failed_hooks: set[str] = set()

    # -- lifecycle -----------------------------------------------------------------------------
    @guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._owns:
            kw = dict(self.monitor_kwargs)
            kw.setdefault("rank", int(args.process_index))
            kw.setdefault("world_size", int(args.world_size))
            kw.setdefault("run_config", {
                "framework": "transformers", "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "learning_rate": args.learning_rate, "max_steps": state.max_steps, "world_size": args.world_size,
            })
            self.monitor = Monitor(self.run or run_id(args.run_name, Path(args.output_dir or "").name,
                                                         default="hf-trainer"), **kw)
        self._active = self.monitor is not None
        self._tokens_seen = int(state.num_input_tokens_seen or 0)
        if state.global_step > 0:
            self.monitor.checkpoint_loaded(int(state.global_step))
        if self.time_forward and model is not None and not getattr(args, "torch_compile", False):
            self._hooks = [model.register_forward_pre_hook(self._forward_begin),
                           model.register_forward_hook(self._forward_end)]
        self._t_last = perf_counter()

    @guarded
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._active = False
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._owns and self.monitor is not None:
            self.monitor.close()

    # -- steps ---------------------------------------------------------------------------------
    @guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._active:
            return
        # global_step counts completed optimizer steps: this one will be logged as global_step + 1.
        self._step = self.monitor.step(int(state.global_step) + 1, data_from=self._t_last)
        self._step.__enter__()
        self._in_step = True

    @guarded
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        st, self._step, self._in_step = self._step, None, False
        if st is None:
            return
        if self._fwd_open:
            self._forward_end()
        st.step = int(state.global_step)
        st.__exit__(None, None, None)
        self._t_last = perf_counter()

    def _forward_begin(self, *_: Any) -> None:
        # Module hook: only forwards of a training step count (not evaluation's).
        try:
            if self._in_step:
                self.monitor.section("forward").__enter__()
                self._fwd_open = True
        except Exception:
            self._in_step = False

    def _forward_end(self, *_: Any) -> None:
        try:
            if self._fwd_open:
                self._fwd_open = False
                self.monitor.section("forward").__exit__(None, None, None)
        except Exception:
            self._in_step = False

    @guarded
    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self._active or not logs or "loss" not in logs:
            return  # evaluation logs (eval_*) and the end-of-training summary (train_loss) are not steps
        tokens = None
        seen = logs.get("num_input_tokens_seen")
        if seen is not None and self._tokens_seen is not None:
            delta, self._tokens_seen = int(seen) - self._tokens_seen, int(seen)
            world, rank = self.monitor.world_size, self.monitor.rank
            tokens = delta // world + (delta % world if rank == 0 else 0)
        self.monitor.log_step(int(state.global_step), loss=logs.get("loss"), grad_norm=logs.get("grad_norm"),
                              lr=logs.get("learning_rate"), tokens=tokens)
        self._t_last = perf_counter()
        if self.log_goodput and state.is_world_process_zero:
            self._goodput_to_wandb()

    def _goodput_to_wandb(self) -> None:
        # The Trainer's own WandbCallback logged this step already (reporting callbacks come before the user's):
        # the goodput goes into the job's W&B run with the next commit. No Redis I/O here (see goodput_metrics).
        wandb = sys.modules.get("wandb")
        if wandb is None or getattr(wandb, "run", None) is None:
            return
        metrics = self.monitor.goodput_metrics()
        if metrics:
            wandb.run.log(metrics, commit=False)
            # The active incidents in words, in the run's summary (its overview page), replaced as they change.
            wandb.run.summary["trainhealth/incidents"] = [
                f"{str(d.get('severity', '?')).upper()}: {d.get('title', d.get('id', '?'))}"
                for d in self.monitor.incidents()]

    # -- evaluation and checkpoints ------------------------------------------------------------------
    @guarded
    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None,
                    **kwargs: Any) -> None:
        if not self._active:
            return
        now = perf_counter()
        # HF's own timing of the evaluation loop: eval_runtime (eval_<name>_runtime per dataset).
        runtime = next((float(v) for k, v in (metrics or {}).items()
                        if k.startswith("eval") and k.endswith("_runtime")), None)
        self.monitor.badput("evaluation", runtime if runtime is not None else now - self._t_last,
                            step=int(state.global_step))
        # Its losses, per eval set (eval_loss, eval_<set>_loss), for the over-fitting detector; rank 0's are the job's.
        if self.monitor.rank == 0:
            for key, value in (metrics or {}).items():
                if key.endswith("_loss") and key != "train_loss" and isinstance(value, (int, float)):
                    self.monitor.log_eval(int(state.global_step), float(value), name=key[:-len("_loss")])
        self._t_last = now

    @guarded
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._active:
            return
        now = perf_counter()
        # on_save runs after Trainer._save_checkpoint returned: the save is the gap since the last hook.
        self.monitor.checkpoint_saved(int(state.global_step), now - self._t_last)
        self._t_last = now
