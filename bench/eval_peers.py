"""Peer rules for the detection evaluation: what other tools would have flagged on the same per-step values.

Each adapter is fed, step by step, the values our pipeline's aggregates carry (loss, global grad norm, seconds
per step) and returns the anomaly kinds its rule raised at that step. ``bench/detection_eval.py`` merges a
rule's alerts at consecutive fed points into one detection (onset = the first), since each of these rules
alerts once per step while a condition lasts and ours report one anomaly per condition.

* :class:`TrainpulsePeer` — ``trainpulse`` (installed), its ``Monitor`` with the default ``MonitorConfig``:
  NaN/Inf (any metric), loss > 5x the rolling mean of 50, grad norm > 100 ("gradient explosion"), step time
  > 3x the rolling mean of 20.
* :class:`LightningPeer` — Lightning's ``lightning.fabric.utilities.spike.SpikeDetection`` with its defaults
  (running mean of 10, ``rtol=2``, warm-up 1 batch, non-finite losses are spikes), run as is on a CPU
  ``Fabric``; its ``TrainingSpikeException`` is caught and the step recorded.
* :class:`LlmFoundryPeer` — a transcription of llm-foundry's ``KillLossSpike`` callback with its defaults.
* :class:`WandbZScorePeer` — W&B's run-metric z-score automation with its defaults (window 30, threshold 3).
"""

from __future__ import annotations

import math
import tempfile
from collections import deque
from typing import Any

#: Kind given to each rule's alerts (scored with the same compatibility table as our detectors).
PEER_KINDS = {
    "trainpulse": ("nan_inf", "loss_spike", "grad_norm_explosion", "slow_step"),
    "lightning": ("loss_spike",),
    "llm-foundry": ("loss_spike", "divergence"),
    "wandb-zscore": ("loss_spike", "grad_norm_spike", "slow_step"),
}


class TrainpulsePeer:
    """``trainpulse.Monitor`` with its default ``MonitorConfig``, fed ``loss``, ``grad_norm`` and ``step_time``.

    ``Monitor.log`` routes by metric name exactly as in a training loop (a NaN check on every metric, then the
    metric's own detector, which also sees the NaN). Alerts map to kinds by their ``detector`` field:
    ``nan_detector`` -> ``nan_inf``, ``loss_spike`` -> ``loss_spike``, ``gradient`` with "explosion" ->
    ``grad_norm_explosion`` (its vanishing-gradient alerts have no counterpart and are left out),
    ``step_time`` -> ``slow_step``; plateau and learning-rate alerts are left out. The monitor keeps every
    logged value in memory, so its history is cleared after each step (detector state is kept).

    References
    ----------
    trainpulse 0.4.0, ``trainpulse/monitor.py``, ``trainpulse/detectors.py``, ``trainpulse/_types.py``
    (``MonitorConfig``: ``loss_spike_threshold=5.0``, ``loss_spike_window=50``, ``grad_norm_threshold=100.0``,
    ``step_time_spike_threshold=3.0``, ``step_time_window=20``).

    Examples
    --------
    >>> p = TrainpulsePeer()
    >>> hits = [(s, p.feed(s, s, 8.0 if s == 60 else 1.0, 1.0, 0.5)) for s in range(70)]
    >>> [(s, k) for s, k in hits if k]
    [(60, ['loss_spike'])]
    """

    name = "trainpulse"

    def __init__(self) -> None:
        from trainpulse import Monitor, MonitorConfig

        self._mon = Monitor(MonitorConfig())

    def feed(self, i: int, step: int, loss: float | None, grad_norm: float | None,
             step_s: float | None) -> list[str]:
        """Feed one step's values; return the kinds alerted (one per metric at most)."""
        out: list[str] = []
        for name, v in (("loss", loss), ("grad_norm", grad_norm), ("step_time", step_s)):
            if v is None:
                continue
            for a in self._mon.log(name, step, float(v)):
                kind = {"nan_detector": "nan_inf", "loss_spike": "loss_spike", "step_time": "slow_step"}.get(
                    a.detector)
                if a.detector == "gradient" and "explosion" in a.message.lower():
                    kind = "grad_norm_explosion"
                if kind and kind not in out:
                    out.append(kind)
        self._mon._snapshots.clear()  # bounded memory; detectors keep their own state
        self._mon._alerts.clear()
        return out


_FABRIC: Any = None


class _RunningMean:
    """Drop-in for the callback's ``torchmetrics.wrappers.Running(MeanMetric(), window=10)``: the mean of the
    last ``window`` values it was updated with, as a float32 tensor (NaN before the first update).

    The torchmetrics wrapper costs ~1 ms a step (it merges ``window`` metric states on every ``compute``), too
    slow for hundreds of thousands of steps; the callback's decision code is used unchanged, and
    ``tests/test_detection_eval.py`` checks that both flag the same steps.
    """

    def __init__(self, window: int) -> None:
        import torch

        self._torch = torch
        self._w: deque[float] = deque(maxlen=window)

    def update(self, value: Any) -> None:
        self._w.append(float(value))

    def compute(self) -> Any:
        return self._torch.tensor(math.fsum(self._w) / len(self._w) if self._w else math.nan,
                                  dtype=self._torch.float32)

    def to(self, device: Any) -> _RunningMean:
        return self


class LightningPeer:
    """Lightning's ``SpikeDetection`` with default arguments, on a single-device CPU ``Fabric``.

    ``on_train_batch_end(fabric, loss, batch, batch_idx)`` is called with the loss as a float32 tensor and
    ``batch_idx`` = the number of losses fed before (Lightning counts batches from 0). When it raises
    ``TrainingSpikeException`` the step is recorded and feeding goes on, as if training had resumed with the
    two batches it lists skipped (the callback does not update its running mean with a spike). The list of
    batches to skip, rewritten to a temporary file at every spike, is emptied after each spike to keep that
    cheap. With ``fast=True`` (the evaluation's setting) its running mean is :class:`_RunningMean`.

    References
    ----------
    Lightning 2.x, ``lightning/fabric/utilities/spike.py`` (``mode="min", window=10, warmup=1, atol=None,
    rtol=2.0, finite_only=True``): a spike is a loss that is not lower than the previous one and exceeds the
    running mean by at least ``rtol`` x the running mean, or any non-finite loss.

    Examples
    --------
    >>> p = LightningPeer()
    >>> hits = [(s, p.feed(s, s, 5.0 if s == 30 else 1.0, None, None)) for s in range(40)]
    >>> [(s, k) for s, k in hits if k]
    [(30, ['loss_spike'])]
    """

    name = "lightning"

    def __init__(self, fast: bool = True) -> None:
        global _FABRIC
        import torch
        from lightning.fabric import Fabric
        from lightning.fabric.utilities.spike import SpikeDetection, TrainingSpikeException

        if _FABRIC is None:
            _FABRIC = Fabric(accelerator="cpu", devices=1)
        self._torch = torch
        self._exc = TrainingSpikeException
        self._dir = tempfile.TemporaryDirectory(prefix="th-eval-spike-")
        self._det = SpikeDetection(exclude_batches_path=self._dir.name)
        if fast:
            self._det.running_mean = _RunningMean(10)  # SpikeDetection's default window
        self._n = 0

    def feed(self, i: int, step: int, loss: float | None, grad_norm: float | None,
             step_s: float | None) -> list[str]:
        """Feed one step's loss; return ``["loss_spike"]`` when the callback raised."""
        if loss is None:
            return []
        idx, self._n = self._n, self._n + 1
        try:
            self._det.on_train_batch_end(_FABRIC, self._torch.tensor(float(loss)), None, idx)
        except self._exc:
            self._det.bad_batches.clear()
            return ["loss_spike"]
        return []


class LlmFoundryPeer:
    """A transcription of llm-foundry's ``KillLossSpike`` callback, default arguments.

    Every batch: once the window of the last ``window_size`` losses is full, its mean is the running average;
    a loss ``>= outlier_multiplier x`` that average is an outlier, and more than ``patience`` outliers in a row
    is a loss spike (``LossSpikeError`` / the ``loss_spike`` metadata; here kind ``loss_spike``); otherwise, from
    batch ``2 x window_size`` on, at least half the window above ``loss_cap`` is "persistently high loss"
    (``HighLossError``; here kind ``divergence``). The loss is then appended to the window (outliers included;
    a NaN makes the mean NaN, as ``numpy.mean`` does, until it leaves the window). The batch number is the
    logged step.

    References
    ----------
    mosaicml/llm-foundry, ``llmfoundry/callbacks/kill_loss_spike_callback.py`` (commit 03826b58):
    ``log_only=True, patience=4, outlier_multiplier=2, window_size=100, loss_cap=10``.

    Examples
    --------
    >>> p = LlmFoundryPeer()
    >>> hits = [(s, p.feed(s, s, 3.0 if 150 <= s < 160 else 1.0, None, None)) for s in range(170)]
    >>> [s for s, k in hits if k == ["loss_spike"]]
    [154, 155, 156, 157, 158, 159]
    """

    name = "llm-foundry"

    def __init__(self, patience: int = 4, outlier_multiplier: float = 2, window_size: int = 100,
                 loss_cap: float = 10) -> None:
        import numpy as np

        self._np = np
        self.patience = patience
        self.outlier_multiplier = outlier_multiplier
        self.window_size = window_size
        self.loss_cap = loss_cap
        self.outlier_counter = 0
        self.loss_window: deque[float] = deque(maxlen=window_size)

    def _detect_loss_spike(self, train_loss: float, running_loss_avg: float) -> bool:
        if train_loss >= running_loss_avg * self.outlier_multiplier:
            self.outlier_counter += 1
            if self.outlier_counter > self.patience:
                return True
        elif self.outlier_counter > 0:
            self.outlier_counter = 0
        return False

    def _detect_high_losses(self, current_step: int) -> bool:
        return (current_step >= self.window_size * 2) and (
            sum(1 for loss in self.loss_window if loss > self.loss_cap) >= self.window_size / 2)

    def feed(self, i: int, step: int, loss: float | None, grad_norm: float | None,
             step_s: float | None) -> list[str]:
        """Feed one step's loss; return the kind raised, if any."""
        if loss is None:
            return []
        out: list[str] = []
        if len(self.loss_window) == self.window_size:
            running_loss_avg = float(self._np.mean(self.loss_window))
            if self._detect_loss_spike(loss, running_loss_avg):
                out.append("loss_spike")
            elif self._detect_high_losses(step):
                out.append("divergence")
        self.loss_window.append(loss)
        return out


class WandbZScorePeer:
    """W&B's run-metric z-score automation with its defaults, on ``loss``, ``grad_norm`` and step time.

    W&B evaluates the rule on its servers and does not publish the formula beyond "the z-score of the metric
    over a window"; here ``z = (x - mean) / std`` of the previous ``window`` values (population SD, the current
    value excluded), evaluated once the window is full, skipping non-finite values and ``std == 0``. The
    direction is "increase" (``zscore > +threshold``), the one an alert on loss, grad norm or step time uses
    (the default ``ANY`` would also fire on every epoch-boundary loss drop). Kinds: loss -> ``loss_spike``,
    grad norm -> ``grad_norm_spike``, step time -> ``slow_step``.

    References
    ----------
    W&B docs, ``wandb.automations.MetricZScoreFilter`` (https://docs.wandb.ai/models/ref/python/automations/
    metriczscorefilter: ``window=30, threshold=3.0, change_dir=ANY``); "Automations"
    (https://docs.wandb.ai/models/automations: a run metric's z-score deviating from the mean by a given amount).

    Examples
    --------
    >>> p = WandbZScorePeer()
    >>> hits = [(s, p.feed(s, s, 1.0 + 0.01 * (s % 3) + (1.0 if s == 40 else 0.0), None, None)) for s in range(50)]
    >>> [(s, k) for s, k in hits if k]
    [(40, ['loss_spike'])]
    """

    name = "wandb-zscore"

    def __init__(self, window: int = 30, threshold: float = 3.0) -> None:
        self.window = window
        self.threshold = threshold
        self._win = {k: deque(maxlen=window) for k in ("loss_spike", "grad_norm_spike", "slow_step")}

    def feed(self, i: int, step: int, loss: float | None, grad_norm: float | None,
             step_s: float | None) -> list[str]:
        """Feed one step's values; return the kinds whose z-score exceeded the threshold."""
        out: list[str] = []
        for kind, v in (("loss_spike", loss), ("grad_norm_spike", grad_norm), ("slow_step", step_s)):
            if v is None or not math.isfinite(v):
                continue
            w = self._win[kind]
            if len(w) == self.window:
                mean = math.fsum(w) / self.window
                sd = math.sqrt(math.fsum((x - mean) ** 2 for x in w) / self.window)
                if sd > 0 and (v - mean) / sd > self.threshold:
                    out.append(kind)
            w.append(v)
        return out


PEERS = (TrainpulsePeer, LightningPeer, LlmFoundryPeer, WandbZScorePeer)


def make_peers() -> list[Any]:
    """A fresh instance of every peer rule (one set per run of the corpus)."""
    return [cls() for cls in PEERS]
