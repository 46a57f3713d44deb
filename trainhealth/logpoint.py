"""The normalised forms every importer yields: :class:`LogPoint` (a step or an evaluation) and :class:`LogEvent`."""

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
    eval_losses : tuple[tuple[str, float], ...]
        For an evaluation entry: ``(eval set name, loss)`` of each loss it reports — ``eval`` for HF's ``eval_loss``,
        ``eval_<set>`` for ``eval_<set>_loss`` (one per eval set), ``val`` for Lightning's ``val_loss``. Empty when it
        reports none. Sent as ``eval`` events (the over-fitting detector compares them with the training loss).
    source_line : int | None
        Where the point is in the file, for error messages: the 1-based line of a text, CSV or
        JSON-lines log, the ``log_history`` index of a ``trainer_state.json``, the record number
        of a TensorBoard event file, the ``traceEvents`` index of a profiler trace.
    step_seconds : float | None
        Seconds per optimizer step over the steps since the previous logged step, when the log
        carries times (Megatron's elapsed time per iteration, a per-step timer, wall-clock stamps);
        replay places the steps on that real timeline instead of an assumed pace.
    skipped : int | None
        Optimizer steps skipped (fp16 loss-scale overflow) since the previous logged step, as
        the log reports them; 0 when it reports none, None when it cannot tell.
    consumed_samples : int | None
        Global samples consumed so far (Megatron's data position), when logged.
    rank : int | None
        The global rank this point is from, for a per-rank log (a benchmark printing each rank's
        timings, one profiler trace per rank); None for the single stream of a one-rank log (every
        training log above: rank 0 logs for the job). Points of several ranks with the same
        ``step`` are that step on each rank: the offline pipeline and replay feed them as the
        ranks' records of one step (world size = highest rank + 1).
    host : str | None
        The node the rank ran on, when the log names it (for the slow-node detector).
    loss_missing : bool
        The log line of this logged iteration prints its other metrics (learning rate, grad norm, loss
        scale, counters) but not the loss, and nothing on the line accounts for it (no skipped iteration
        covering the interval, no NaN iteration counted). Megatron-LM prints a loss only when its average
        over the interval's applied iterations is a number >= 0 (``training_log``: ``if avg >= 0.0``, older
        versions and Megatron-DeepSpeed ``> 0.0``), so a NaN or infinite loss is left out of the line while
        its own ``number of nan iterations`` counter (which counts skipped iterations only) stays 0. ``loss``
        is then None (or NaN when the line counts NaN iterations).
    sections : tuple[tuple[str, float], ...]
        ``(name, seconds)`` the rank spent in named parts of the step, as the log times them; they
        become the record's ``sec.<name>`` times, whose sum is the rank's busy time that the
        straggler, slow-node and rank-outlier detectors compare across ranks. Empty when the log
        has none. A time that includes waiting in a collective (an all-reduce's duration, a whole
        profiler step) measures when the rank *arrived* as much as its work: the rank that waits
        longest is the early one. ``step_seconds`` of a per-rank point is that rank's own step time.
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int | None = None
    eval_seconds: float | None = None
    source_line: int | None = None
    step_seconds: float | None = None
    skipped: int | None = None
    consumed_samples: int | None = None
    rank: int | None = None
    host: str | None = None
    sections: tuple[tuple[str, float], ...] = ()
    loss_missing: bool = False
    eval_losses: tuple[tuple[str, float], ...] = ()

    @property
    def is_eval(self) -> bool:
        return self.eval_seconds is not None


@dataclass(frozen=True)
class LogEvent:
    """Something a log reports that is not one step's metrics: a collective that timed out, a restart.

    Readers yield these among their :class:`LogPoint` s, in file order
    (:func:`trainhealth.collectors.importers.read_items`);
    :func:`trainhealth.collectors.importers.read` leaves them out.

    Attributes
    ----------
    kind : str
        One of :data:`trainhealth.wire.EVENT_KINDS`: ``checkpoint_save`` (a save the log reports; ``seconds``
        it blocked when known), ``collective_timeout`` (a rank's watchdog timed out a collective),
        ``worker_restart`` (the launcher restarted the worker group).
    step : int | None
        The training step it happened at (or after), when the log says; None when the log has no steps.
    rank : int | None
        The global rank reporting it, when the log names one.
    seconds : float | None
        A duration the log gives (a checkpoint's save time, a collective's wait), in seconds.
    fields : tuple[tuple[str, object], ...]
        Further named values as the log gives them (e.g. ``("op", "ALLREDUCE")``, ``("seq", 1580)``).
    source_line : int | None
        The 1-based line of the file it was read from.
    """

    kind: str
    step: int | None = None
    rank: int | None = None
    seconds: float | None = None
    fields: tuple[tuple[str, object], ...] = ()
    source_line: int | None = None

    def get(self, name: str, default: object = None) -> object:
        """The value of ``fields`` entry ``name``, else ``default``."""
        for key, value in self.fields:
            if key == name:
                return value
        return default
