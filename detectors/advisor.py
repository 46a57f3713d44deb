"""Rollback advisor: what to do about a loss spike, a divergence or NaNs, and what each option costs.

Pure logic on numbers: the pipeline gives it the anomaly, the checkpoints seen, the data
positions the collectors recorded and the run's step time, size and price; it returns a
:class:`Recommendation` (stored in ``th:{run}:recommendations``, sent with alerts, shown in the
dashboard and exported by ``trainhealth advise``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainhealth import defaults
from trainhealth.anomaly import Anomaly
from trainhealth.recommendations import Recommendation
from trainhealth.text import fmt_cost, fmt_duration


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint saved after ``step`` (its data position: samples consumed, batch index after it)."""

    step: int
    consumed_samples: int | None = None
    batch_index: int | None = None


class RollbackAdvisor:
    """Turns a loss anomaly into a costed recommendation.

    * A spike still open and younger than ``recheck_steps``: **wait**, re-check at onset +
      ``recheck_steps``; the rollback it would take is costed alongside.
    * Divergence, a spike that did not recover, or NaN/Inf in the loss: **rollback** to the
      newest checkpoint at least ``margin_steps`` before the onset whose preceding
      ``healthy_steps`` had no loss anomaly (PaLM restarted "about 100 steps before the spike"),
      and skip the batches from ``skip_before`` steps before the onset to ``skip_after`` steps
      after it (PaLM skipped "roughly 200-500 data batches"); without such a checkpoint, the
      newest one before the onset.
    * ``repeat_spikes`` or more spikes within ``repeat_window`` steps: add the usual levers as
      options (lower the peak learning rate, tighten gradient clipping).

    Parameters
    ----------
    margin_steps, healthy_steps, skip_before, skip_after, recheck_steps : int
        Steps (defaults in :mod:`trainhealth.defaults`).
    repeat_spikes, repeat_window : int
        Spikes and steps that make spikes "repeated".

    Examples
    --------
    >>> adv = RollbackAdvisor()
    >>> div = Anomaly("divergence", "critical", 1200, "loss diverging")
    >>> ckpts = [Checkpoint(s, consumed_samples=(s + 1) * 512, batch_index=s) for s in range(99, 1300, 100)]
    >>> rec = adv.advise(div, run="r", checkpoints=ckpts, current_step=1300, step_s=10.0, world_size=512,
    ...                  gpu_hour_usd=2.0, data_positions={}, history=[div])
    >>> rec.action, rec.checkpoint_step, rec.skip_steps, rec.recompute_steps, round(rec.cost["gpu_hours"], 1)
    ('rollback', 1099, (1100, 1400), 201, 285.9)
    >>> rec.skip_samples, rec.skip_batches
    ((563200, 717312), (1100, 1401))

    References
    ----------
    A. Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022, section 5.1
    (restart ~100 steps before a spike, skip ~200-500 batches); BigScience BLOOM-176B training
    chronicles (rollback and data skipping after spikes).
    """

    def __init__(
        self,
        margin_steps: int = defaults.ROLLBACK_MARGIN_STEPS,
        healthy_steps: int = defaults.ROLLBACK_HEALTHY_STEPS,
        skip_before: int = defaults.ROLLBACK_SKIP_BEFORE_STEPS,
        skip_after: int = defaults.ROLLBACK_SKIP_AFTER_STEPS,
        recheck_steps: int = defaults.ROLLBACK_RECHECK_STEPS,
        repeat_spikes: int = defaults.REPEAT_SPIKES,
        repeat_window: int = defaults.REPEAT_SPIKES_WINDOW_STEPS,
    ) -> None:
        self.margin_steps = margin_steps
        self.healthy_steps = healthy_steps
        self.skip_before = skip_before
        self.skip_after = skip_after
        self.recheck_steps = recheck_steps
        self.repeat_spikes = repeat_spikes
        self.repeat_window = repeat_window

    @staticmethod
    def concerns(a: Anomaly) -> bool:
        """Whether the advisor has something to say about ``a``: an open divergence, an open or
        unrecovered (and not rolled back) loss spike, or open NaN/Inf in the loss."""
        if a.kind == "loss_spike":
            return a.active or (a.evidence.get("recovered") is False and not a.evidence.get("rolled_back"))
        return a.active and (a.kind == "divergence" or (a.kind == "nan_inf" and a.severity == "critical"))

    def advise(
        self,
        anomaly: Anomaly,
        *,
        run: str,
        checkpoints: Iterable[Checkpoint],
        current_step: int,
        step_s: float | None,
        world_size: int,
        gpu_hour_usd: float | None,
        data_positions: Mapping[int, tuple[int | None, int | None]],
        history: Iterable[Anomaly],
        first_step: int | None = None,
    ) -> Recommendation | None:
        """The recommendation for ``anomaly`` now, or None when it needs none.

        ``data_positions`` maps a step to ``(consumed_samples, batch_index)`` after it;
        ``history`` is every anomaly of the run (for healthy windows and repeated spikes);
        ``step_s`` the median step time in seconds; ``first_step`` the run's first step seen: a
        condition there from the start had no healthy state and no data to blame, so the advice is
        to fix the configuration, not to skip batches.
        """
        if not self.concerns(anomaly):
            return None
        onset = anomaly.step
        loss_trouble = [a for a in history if a.kind in ("loss_spike", "divergence", "nan_inf")]
        reasoning = [f"{anomaly.kind} since step {onset} (now step {current_step}): {anomaly.message}"]
        ckpts = sorted(checkpoints, key=lambda c: c.step)
        chosen, why = self._checkpoint(ckpts, onset, loss_trouble)
        reasoning.append(why)
        step_s = step_s if step_s and step_s > 0 else None
        recompute = max(0, current_step - chosen.step) if chosen else max(0, current_step)
        cost = self._cost(recompute, step_s, world_size, gpu_hour_usd)
        wasted = max(0, current_step - onset + 1)
        burn = {"gpu_hours_per_hour": float(world_size),
                "usd_per_hour": world_size * gpu_hour_usd if gpu_hour_usd is not None else None}
        continue_cost = {"wasted_steps_so_far": wasted, **self._cost(wasted, step_s, world_size, gpu_hour_usd),
                         **burn}
        skip_from = max(onset - self.skip_before, (chosen.step + 1) if chosen else 0)
        skip_to = onset + self.skip_after
        samples, batches = self._data_range(skip_from, skip_to, ckpts, data_positions)
        reasoning.append(
            f"skip the batches of steps {skip_from}-{skip_to} ({skip_to - skip_from + 1} steps: "
            f"{self.skip_before} before the onset, {self.skip_after} after) so the data around the onset is not "
            "seen again" + (f"; samples [{samples[0]}, {samples[1]})" if samples else
                            "; no data positions recorded: pass consumed_samples= to log_step to get sample ranges"))
        step_txt = f"{step_s:.3g} s/step" if step_s else "unknown step time"
        reasoning.append(
            f"rollback recomputes {recompute} steps ({step_txt}, {world_size} GPUs): "
            f"{_fmt_cost(cost)}; continuing wastes every step from {onset} on ({wasted} so far, "
            f"{_fmt_cost(self._cost(wasted, step_s, world_size, gpu_hour_usd))}) and burns "
            f"{world_size} GPU-hours per hour"
            + (f" (${world_size * gpu_hour_usd:,.0f}/h)" if gpu_hour_usd is not None else ""))
        options = self._options(anomaly, loss_trouble, current_step)
        waiting = anomaly.kind == "loss_spike" and anomaly.active and current_step - onset < self.recheck_steps
        if first_step is not None and onset <= first_step and chosen is None:
            action, summary = "none_possible", (
                f"{anomaly.kind} from the run's first logged step ({onset}): there is no healthy state to roll back "
                "to and no data to skip; fix the configuration (learning rate, initialisation, loss scaling, data "
                "preprocessing) and restart from scratch")
            reasoning.append("the condition was there from the first step seen, before any data could have caused "
                             "it: skipping batches would not help")
        elif chosen is None:
            action, summary = "none_possible", (
                f"No checkpoint before step {onset}: restart from scratch or from the earliest checkpoint, "
                f"skipping steps {skip_from}-{skip_to}")
        elif waiting:
            action = "wait"
            summary = (f"Loss spike at step {onset} may still recover: wait and re-check at step "
                       f"{onset + self.recheck_steps}; if it has not recovered, roll back to the checkpoint of step "
                       f"{chosen.step} and skip steps {skip_from}-{skip_to} ({_fmt_cost(cost)})")
            reasoning.append(f"spike open for {current_step - onset} of {self.recheck_steps} steps: most spikes "
                             "recover by themselves within that")
        else:
            action = "rollback"
            summary = (f"Roll back to the checkpoint of step {chosen.step} and skip the batches of steps "
                       f"{skip_from}-{skip_to}: recomputes {recompute} steps ({_fmt_cost(cost)})")
        return Recommendation(
            id=f"rec:{anomaly.id}", run=run, anomaly_id=anomaly.id, kind=anomaly.kind, action=action,
            onset_step=onset, current_step=current_step, checkpoint_step=chosen.step if chosen else None,
            skip_steps=(skip_from, skip_to), skip_samples=samples, skip_batches=batches,
            recheck_step=onset + self.recheck_steps if action == "wait" else None, recompute_steps=recompute,
            cost=cost, continue_cost=continue_cost, options=options, reasoning=reasoning, summary=summary,
        )

    def _checkpoint(self, ckpts: list[Checkpoint], onset: int,
                    trouble: list[Anomaly]) -> tuple[Checkpoint | None, str]:
        before = [c for c in ckpts if c.step < onset]
        if not before:
            return None, f"no checkpoint was saved before step {onset}"

        def healthy(c: Checkpoint) -> bool:
            lo = c.step - self.healthy_steps
            return not any(lo <= a.step <= c.step or (a.step <= c.step and (a.end_step is None or a.end_step >= lo))
                           for a in trouble)

        for c in reversed(before):
            if c.step <= onset - self.margin_steps and healthy(c):
                return c, (f"checkpoint of step {c.step}: the newest at least {self.margin_steps} steps before the "
                           f"onset whose preceding {self.healthy_steps} steps were free of loss anomalies")
        c = before[-1]
        return c, (f"checkpoint of step {c.step}: the newest before the onset (none is {self.margin_steps} steps "
                   "earlier with a healthy window)")

    @staticmethod
    def _data_range(a: int, b: int, ckpts: list[Checkpoint],
                    positions: Mapping[int, tuple[int | None, int | None]]) -> tuple[Any, Any]:
        known = dict(positions)
        for c in ckpts:
            known.setdefault(c.step, (c.consumed_samples, c.batch_index))
        start, end = known.get(a - 1), known.get(b)
        if start is None or end is None:
            # Extrapolate from the nearest known positions at a constant global batch.
            pts = sorted((s, p) for s, p in known.items() if p[0] is not None)
            if len(pts) >= 2:
                (s0, p0), (s1, p1) = pts[-2], pts[-1]
                per = (p1[0] - p0[0]) / (s1 - s0) if s1 != s0 else None
                if per:
                    ref_s, ref = pts[-1]
                    start = start or (int(ref[0] + per * (a - 1 - ref_s)), None)
                    end = end or (int(ref[0] + per * (b - ref_s)), None)
        samples = (start[0], end[0]) if start and end and start[0] is not None and end[0] is not None else None
        batches = None
        if start and end and start[1] is not None and end[1] is not None:
            batches = (start[1] + 1, end[1] + 1)
        elif samples is not None:
            batches = (a, b + 1)
        return samples, batches

    @staticmethod
    def _cost(steps: int, step_s: float | None, world: int, price: float | None) -> dict[str, Any]:
        if step_s is None:
            return {"steps": steps, "wall_hours": None, "gpu_hours": None, "usd": None}
        hours = steps * step_s / 3600.0
        return {"steps": steps, "wall_hours": hours, "gpu_hours": hours * world,
                "usd": hours * world * price if price is not None else None}

    def _options(self, anomaly: Anomaly, trouble: list[Anomaly], current: int) -> list[str]:
        spikes = [a for a in trouble if a.kind == "loss_spike" and a.step >= current - self.repeat_window]
        if len(spikes) < self.repeat_spikes:
            return []
        return [
            f"option: {len(spikes)} spikes in the last {self.repeat_window} steps — lower the peak learning rate "
            "(e.g. by 30-50 %) when restarting",
            "option: tighten gradient clipping (e.g. max norm 1.0 → 0.3) to damp the updates that start spikes",
            "option: check the data around each spike (steps "
            + ", ".join(str(a.step) for a in spikes[-5:]) + ") for corrupt or duplicated shards",
        ]


def _fmt_cost(c: Mapping[str, Any]) -> str:
    if c.get("gpu_hours") is None:
        return f"{c.get('steps', 0)} steps (step time unknown)"
    wall_s = None if c.get("wall_hours") is None else c["wall_hours"] * 3600.0
    return f"{fmt_cost(c)}, {fmt_duration(wall_s)} of the run's time"
