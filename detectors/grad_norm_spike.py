"""Grad-norm spikes: the early warning of loss spikes, relative to the run's own level."""

from __future__ import annotations

from trainhealth import defaults
from trainhealth.detectors.loss_spike import LossSpikeDetector


class GradNormSpikeDetector(LossSpikeDetector):
    """Relative spikes of the global grad norm, with the loss-spike detector's method.

    The same robust, detrended trailing median/MAD of the log, on ``grad_norm``: a run whose
    grad norm lives at 1e5-4e6 (fp16 scaling, some vision models) is judged against its own
    level, never against an absolute threshold; a grad-norm spike often comes a few steps
    before a loss spike (BLOOM, PaLM), and it is reported even when the loss does not react.
    A spike still open after ``divergence_steps`` settles as ``not_recovered`` and the baseline
    restarts at the new level; a lasting rise is
    :class:`~trainhealth.detectors.grad_norm_explosion.GradNormExplosionDetector`'s
    to report. Skipped steps do not decide anything here (the grad norm is not recomputed on them).

    Severity: ``info``. A grad-norm spike the loss does not follow costs no training — the optimizer clips it
    or absorbs it — so it is worth seeing, not paging (the MANIFEST's llm.c blips at 8715 and 12008, "info at
    most"; T5's at 164000 and 190000, with no loss reaction). When a loss anomaly (a loss spike, divergence,
    collapse or non-finite loss) shares its incident, :class:`~trainhealth.detectors.pipeline.RunPipeline`
    raises it to ``warning`` (TrOCR's step 682: 13x with the loss); one still up after ``divergence_steps``
    is ``not_recovered``, critical, as a loss spike's.

    Parameters are those of :class:`~trainhealth.detectors.loss_spike.LossSpikeDetector`, with ``z_open``
    from ``defaults.GRAD_NORM_SPIKE_Z_OPEN`` and ``min_rel_rise`` from
    ``defaults.GRAD_NORM_SPIKE_MIN_REL_RISE`` (a grad norm is noisier than a loss); the partner is the
    loss, and a loss spike at the same step (``partner_spike_z`` = the loss detector's ``z_open``) lets a
    grad-norm jump of at least 2x count at ``corroborate_z`` SDs. The loss detector's short-log record test
    (``record_ratio``) is off: a grad norm's tail is heavier (TrOCR's swings 8-14x within 50 points, and 2x its
    window's highest at steps 142 and 414 with no loss reaction).

    Evidence: ``grad_norm``, ``baseline`` (predicted), ``z``, ``rise``, ``threshold``, ``peak``, ``peak_step``,
    ``recovery_class``, ``recovery_steps``.

    Examples
    --------
    >>> import math, random
    >>> from trainhealth.detectors.aggregate import StepAggregate
    >>> rng = random.Random(2)
    >>> det = GradNormSpikeDetector()
    >>> for step in range(300):
    ...     gn = 2e5 * math.exp(rng.gauss(0, 0.1)) * (12.0 if step == 250 else 1.0)
    ...     a = StepAggregate(step, 0, 0.0, None, float(step), 1.0, gn, None, None, None, 1, (None,), 0.0)
    ...     for an in det.update(a):
    ...         print(an.kind, an.severity, an.status, an.step, an.end_step, an.evidence.get("recovery_class"))
    grad_norm_spike info active 250 None None
    grad_norm_spike info resolved 250 250 fast

    References
    ----------
    BigScience BLOOM-176B chronicles (grad-norm spikes before loss spikes); OLMo 2 (Team OLMo,
    arXiv:2501.00656, 2024: grad-norm spikes precede loss spikes); the Hampel filter references of
    :class:`~trainhealth.detectors.loss_spike.LossSpikeDetector`.
    """

    KIND = "grad_norm_spike"
    FIELD = "grad_norm"
    LABEL = "grad norm"
    PARTNER = "loss"
    #: Alone, a grad-norm spike that does not move the loss costs no training (llm.c GPT-2's blips at 8715 and 12008,
    #: T5's at 164000 and 190000: the MANIFEST's "info at most"); the pipeline raises it to warning when a loss
    #: anomaly shares its incident (TrOCR's step 682).
    SEVERITY = "info"

    def __init__(
        self,
        window: int = defaults.LOSS_SPIKE_WINDOW_STEPS,
        warmup: int = defaults.LOSS_SPIKE_WARMUP_STEPS,
        z_open: float = defaults.GRAD_NORM_SPIKE_Z_OPEN,
        z_close: float = defaults.LOSS_SPIKE_Z_CLOSE,
        min_rel_rise: float = defaults.GRAD_NORM_SPIKE_MIN_REL_RISE,
        partner_spike_z: float = defaults.LOSS_SPIKE_Z_OPEN,
        divergence_steps: int = defaults.DIVERGENCE_STEPS,
        order_jump: float | None = defaults.GRAD_NORM_SPIKE_ORDER_JUMP,
    ) -> None:
        super().__init__(window=window, warmup=warmup, z_open=z_open, z_close=z_close, min_rel_rise=min_rel_rise,
                         partner_spike_z=partner_spike_z, divergence_steps=divergence_steps, skipped_steps=0,
                         record_ratio=None, order_jump=order_jump)
