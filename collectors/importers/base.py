"""The normalised form every importer yields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LogPoint:
    """One logged training step, or one evaluation, from a log file.

    Attributes
    ----------
    step : int
        Optimizer step the log line reports.
    loss, grad_norm, lr : float | None
        Training metrics as logged (NaN/Inf kept); None when absent.
    tokens : int | None
        Tokens processed since the previous logged step (not cumulative), when known.
    eval_seconds : float | None
        For an evaluation entry: its runtime in seconds (a custom badput interval).
    source_line : int | None
        Line or entry number in the file, for error messages.
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int | None = None
    eval_seconds: float | None = None
    source_line: int | None = None

    @property
    def is_eval(self) -> bool:
        return self.eval_seconds is not None
