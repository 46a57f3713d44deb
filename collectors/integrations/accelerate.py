"""Hugging Face Accelerate: trainhealth as one of the ``Accelerator``'s trackers.

::

    from accelerate import Accelerator
    from trainhealth.collectors.integrations.accelerate import TrainHealthTracker

    accelerator = Accelerator(log_with=["wandb", TrainHealthTracker("llama-sft", gpu_hour_usd=2.5)])
    ...
    accelerator.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0], "grad_norm": gn}, step=step)

Each ``accelerator.log`` becomes a ``log_step`` on every process (the tracker is not main-process-only: every rank
sends its own record); ``accelerator.end_training()`` closes the run. The metrics are found by their usual names
(:data:`NAMES`). Accelerate's trackers do not time steps: wrap the step in ``tracker.monitor.step(step)`` for step
times and section times; a ``Trainer`` (which runs on Accelerate) has its own callback
(:mod:`trainhealth.collectors.integrations.hf`).
"""

from __future__ import annotations

from typing import Any

from accelerate.tracking import GeneralTracker

from trainhealth.collectors.monitor import Monitor

__all__ = ["NAMES", "TrainHealthTracker"]

#: ``log_step`` argument -> the names it is logged under, first match wins.
NAMES = {
    "loss": ("loss", "train_loss", "train/loss"),
    "grad_norm": ("grad_norm", "train/grad_norm", "gradient_norm"),
    "lr": ("lr", "learning_rate", "train/learning_rate"),
    "tokens": ("tokens", "num_tokens", "ntokens"),
    "consumed_samples": ("consumed_samples",),
}


class TrainHealthTracker(GeneralTracker):
    """An Accelerate tracker feeding a :class:`~trainhealth.collectors.Monitor` (see the module doc).

    Parameters
    ----------
    run : str, optional
        Run id; default the one :func:`trainhealth.init` finds in the environment.
    monitor : Monitor, optional
        Use this Monitor (the caller closes it).
    **monitor_kwargs
        Passed to the Monitor (``redis_url``, ``gpu_hour_usd``...); rank and world size come from the launcher's
        environment (``accelerate launch`` sets ``RANK``/``WORLD_SIZE``).
    """

    name = "trainhealth"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, run: str | None = None, *, monitor: Monitor | None = None, **monitor_kwargs: Any) -> None:
        super().__init__()
        self.run = run
        self._owns = monitor is None
        self.monitor = monitor
        self._kwargs = monitor_kwargs
        self._config: dict[str, Any] | None = None

    @property
    def tracker(self) -> Monitor | None:
        return self.monitor

    def start(self) -> None:
        if self.monitor is None:
            from trainhealth.collectors.environment import init

            self.monitor = init(self.run, **self._kwargs)

    def store_init_configuration(self, values: dict) -> None:
        """Accelerate's ``init_trackers(config=...)``: kept with the run (its ``run_start`` already went out)."""
        self._config = dict(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """One record of ``step`` with the metrics found in ``values`` (nothing without a step)."""
        if self.monitor is None:
            self.start()
        if step is None or self.monitor is None:
            return
        found: dict[str, Any] = {}
        for arg, names in NAMES.items():
            for n in names:
                if n in values and values[n] is not None:
                    found[arg] = values[n]
                    break
        self.monitor.log_step(int(step), **found)

    def finish(self) -> None:
        """``accelerator.end_training()``: close the run (only a Monitor this tracker made)."""
        if self._owns and self.monitor is not None:
            self.monitor.close()
