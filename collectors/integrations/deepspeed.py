"""DeepSpeed: watch a ``DeepSpeedEngine`` without touching the training loop.

::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)
    mon = trainhealth.init()                      # or trainhealth.Monitor("run", ...)
    watch(engine, mon, tokens_per_step=seq_len * micro_batch * grad_accum)

``watch`` wraps the engine's own ``forward``, ``backward`` and ``step`` (the loop calls them as before):

- one :meth:`Monitor.step` per optimizer step, from the first micro-batch's forward after the previous optimizer
  step to the gradient-accumulation boundary's ``engine.step()``, numbered by ``engine.global_steps`` after it;
  the forwards are its ``forward`` section (each rank's own compute, before the gradient all-reduce that
  ``backward``/``step`` wait in);
- ``log_step`` at the boundary: the loss (the mean of the micro-batches' losses given to ``engine.backward``, read
  as floats there: one device sync per micro-batch, as ``loss.item()`` in a loop), the global grad norm
  (``engine.get_global_grad_norm()``, when DeepSpeed computed one), the learning rate (``engine.get_lr()``), and
  ``skipped=True`` when DeepSpeed's fp16 loss scaler skipped the step (``engine.skipped_steps`` grew) and the
  scaler's scale after it (``loss_scale``: it halves at each overflow);
- each step's ``tokens`` on this rank when ``tokens_per_step`` says how many (DeepSpeed has no notion of tokens).

Errors inside the wrappers are logged once and never reach training; the engine's own methods always run.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from trainhealth.collectors.monitor import Monitor

__all__ = ["watch"]

log = logging.getLogger(__name__)


class _Watcher:
    """The wrappers' state: the open step and section, the micro-batches' losses, the skip counter."""

    def __init__(self, engine: Any, monitor: Monitor, tokens_per_step: int | None) -> None:
        self.engine = engine
        self.monitor = monitor
        self.tokens_per_step = tokens_per_step
        self.step_cm: Any = None
        self.fwd_cm: Any = None
        self.losses: list[float] = []
        self.skipped = int(getattr(engine, "skipped_steps", 0) or 0)
        self.failed: set[str] = set()

    def _failed(self, where: str) -> None:
        if where not in self.failed:
            self.failed.add(where)
            log.exception("trainhealth: the DeepSpeed %s wrapper failed (training continues; later errors there "
                          "are not logged)", where)

    def before_forward(self) -> None:
        try:
            if not self.engine.module.training:
                return  # an evaluation's forward is not a step's
            if self.step_cm is None:
                self.step_cm = self.monitor.step(int(self.engine.global_steps) + 1)
                self.step_cm.__enter__()
            self.fwd_cm = self.monitor.section("forward")
            self.fwd_cm.__enter__()
        except Exception:
            self._failed("forward")

    def after_forward(self) -> None:
        try:
            if self.fwd_cm is not None:
                cm, self.fwd_cm = self.fwd_cm, None
                cm.__exit__(None, None, None)
        except Exception:
            self._failed("forward")

    def on_backward(self, loss: Any) -> None:
        try:
            self.losses.append(float(loss.detach().float().item()) if hasattr(loss, "detach") else float(loss))
        except Exception:
            self._failed("backward")

    def after_step(self, boundary: bool) -> None:
        try:
            if not boundary or self.step_cm is None:
                return
            eng = self.engine
            step = int(eng.global_steps)
            cm, self.step_cm = self.step_cm, None
            cm.step = step
            cm.__exit__(None, None, None)
            skipped_now = int(getattr(eng, "skipped_steps", 0) or 0)
            skipped = skipped_now > self.skipped
            self.skipped = skipped_now
            gn = eng.get_global_grad_norm() if hasattr(eng, "get_global_grad_norm") else None
            lrs = eng.get_lr() if hasattr(eng, "get_lr") else None
            loss = sum(self.losses) / len(self.losses) if self.losses else None
            self.losses = []
            self.monitor.log_step(step, loss=loss, grad_norm=None if gn is None else float(gn),
                                  lr=float(lrs[0]) if lrs else None, tokens=self.tokens_per_step, skipped=skipped,
                                  loss_scale=loss_scale(eng))
        except Exception:
            self._failed("step")


def loss_scale(engine: Any) -> float | None:
    """The fp16 loss scaler's current scale: ``cur_scale`` of DeepSpeed's FP16 optimizers, ``loss_scale`` of its
    ZeRO optimizers; None without loss scaling (fp32, bf16)."""
    opt = getattr(engine, "optimizer", None)
    if not getattr(engine, "fp16_enabled", lambda: False)():
        return None
    for name in ("cur_scale", "loss_scale"):
        v = getattr(opt, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def watch(engine: Any, monitor: Monitor, *, tokens_per_step: int | None = None) -> Any:
    """Wrap ``engine``'s ``forward``, ``backward`` and ``step`` to feed ``monitor`` (see the module doc); returns
    the engine. Watching an engine twice is a no-op.

    Parameters
    ----------
    engine : deepspeed.DeepSpeedEngine
        From ``deepspeed.initialize``.
    monitor : trainhealth.Monitor
        This rank's collector.
    tokens_per_step : int, optional
        Tokens this rank processes per optimizer step (micro-batch x sequence length x accumulation steps).
    """
    if getattr(engine, "_trainhealth_watcher", None) is not None:
        return engine
    w = _Watcher(engine, monitor, tokens_per_step)
    forward, backward, step = engine.forward, engine.backward, engine.step

    @functools.wraps(forward)
    def watched_forward(*args: Any, **kwargs: Any) -> Any:
        w.before_forward()
        try:
            return forward(*args, **kwargs)
        finally:
            w.after_forward()

    @functools.wraps(backward)
    def watched_backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
        out = backward(loss, *args, **kwargs)
        w.on_backward(loss)
        return out

    @functools.wraps(step)
    def watched_step(*args: Any, **kwargs: Any) -> Any:
        try:
            boundary = bool(engine.is_gradient_accumulation_boundary())
        except Exception:
            boundary = True
        out = step(*args, **kwargs)
        w.after_step(boundary)
        return out

    engine.forward, engine.backward, engine.step = watched_forward, watched_backward, watched_step
    engine._trainhealth_watcher = w
    return engine
