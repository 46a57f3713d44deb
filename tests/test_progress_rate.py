"""Learning progress per GPU-hour in the goodput ledger (detectors/progress_rate.py, detectors/ledger.py)."""

from __future__ import annotations

import pytest

from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.ledger import GoodputLedger
from trainhealth.detectors.progress_rate import block_size, loss_progress


def _step(step: int, end: float, loss: float | None, tokens: int = 1000, gen: int = 0, inc: float = 0.0,
          skipped: bool = False) -> StepAggregate:
    return StepAggregate(step, gen, inc, end - 10.0, end, loss, None, None, tokens, None, 4, (), 0.0, skipped=skipped)


def _linear_run(spike_at_end: bool = False) -> GoodputLedger:
    """4 ranks, 90 steps of 10 s (step s ends at 10 s), 1,000 tokens each, loss 10 - 0.05 s."""
    led = GoodputLedger(world_size=4)
    led.note_start(0.0)
    for s in range(1, 91):
        led.add_step(_step(s, 10.0 * s, 50.0 if spike_at_end and s == 90 else 10.0 - 0.05 * s))
    return led


def test_progress_per_gpu_hour_over_the_run_and_the_windows() -> None:
    snap = _linear_run().snapshot(900.0)
    p = snap["progress"]
    # 90 points: blocks of 21, medians at steps 11 (9.45, t 110, 11,000 kept tokens) and 80 (6.0, t 800, 80,000).
    assert (p["points"], p["block"], p["from_t"], p["to_t"], p["tokens_good"]) == (90, 21, 110.0, 800.0, 69000)
    assert p["loss_from"] == pytest.approx(9.45, abs=1e-12) and p["loss_to"] == pytest.approx(6.0, abs=1e-12)
    # 690 s x 4 GPUs = 0.7667 GPU-hours; 0.05 per 10 s step on 4 GPUs is 4.5 per GPU-hour, 50,000 per 1e9 tokens.
    assert p["gpu_hours"] == pytest.approx(690 * 4 / 3600, rel=1e-12)
    assert p["loss_drop_per_gpu_hour"] == pytest.approx(4.5, rel=1e-12)
    assert p["loss_drop_per_btok"] == pytest.approx(50_000, rel=1e-12)
    rates = snap["rates"]
    # The last minute holds 6 steps (85-90): too few for two blocks of 3.
    assert rates["60s"]["loss_drop_per_gpu_hour"] is None and rates["60s"]["loss_drop_per_btok"] is None
    for w in ("600s", "3600s"):
        assert rates[w]["loss_drop_per_gpu_hour"] == pytest.approx(4.5, rel=1e-12), w
        assert rates[w]["loss_drop_per_btok"] == pytest.approx(50_000, rel=1e-12), w
    assert rates["600s"]["throughput_tok_s"] == 100.0  # beside the token rates, unchanged


def test_a_spike_at_the_end_moves_the_median_by_one_point_not_the_whole_run() -> None:
    p = _linear_run(spike_at_end=True).snapshot(900.0)["progress"]
    # Step 90's 50.0 is the last block's largest: its median is the 11th smallest of 5.55..6.5 and 50, 6.05.
    assert p["loss_to"] == pytest.approx(6.05, abs=1e-12)
    assert p["loss_drop"] == pytest.approx(3.4, abs=1e-12)


def test_progress_counts_only_kept_steps_and_kept_tokens() -> None:
    """Goodput in tokens counts only kept tokens (skipped steps, attempts a restart discarded), and so does progress:
    the discarded attempts' losses are left out too."""
    led = GoodputLedger(world_size=4)
    led.note_start(0.0)
    for s in range(1, 31):
        led.add_step(_step(s, 10.0 * s, 10.0 - 0.05 * s, skipped=s == 5))
    for s in range(31, 41):  # diverged, then crashed with no checkpoint after step 30's
        led.add_step(_step(s, 10.0 * s, 100.0))
    for s in range(31, 61):  # relaunched at t 500 from step 30's checkpoint: steps 31-60 again
        led.add_step(_step(s, 500.0 + 10.0 * (s - 30), 10.0 - 0.05 * s, gen=1, inc=490.0))
    snap = led.snapshot(800.0)
    assert snap["tokens_total"] == 70 * 1000
    assert snap["tokens_good"] == 59 * 1000  # 60 kept steps, step 5 skipped; the 10 discarded attempts not kept
    p = snap["progress"]
    # 60 kept losses: blocks of 19 (a third of 60, odd), medians at steps 10 (9.5) and 51 (7.45); no 100.0 in them.
    assert (p["points"], p["block"], p["from_t"], p["to_t"]) == (60, 19, 100.0, 710.0)
    assert p["loss_drop"] == pytest.approx(2.05, abs=1e-12)
    assert p["tokens_good"] == 41 * 1000  # steps 11-51 kept, step 5 is before them
    assert p["loss_drop_per_gpu_hour"] == pytest.approx(2.05 / (610 * 4 / 3600), rel=1e-12)


def test_block_size_and_too_few_points() -> None:
    assert [block_size(n) for n in (0, 8, 9, 11, 12, 63, 64, 10**6)] == [0, 0, 3, 3, 3, 21, 21, 21]
    assert loss_progress([(float(i), 1.0, i) for i in range(8)], gpus=1) is None
    flat = loss_progress([(float(i), 1.0, 0) for i in range(9)], gpus=1)
    assert flat is not None and flat["loss_drop"] == 0.0 and flat["loss_drop_per_btok"] is None
    assert loss_progress([(5.0, 2.0 - i, 0) for i in range(9)], gpus=2)["loss_drop_per_gpu_hour"] is None
