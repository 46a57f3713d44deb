"""Each detector on exact inputs with exact expected outputs."""

from __future__ import annotations

import json
import math
import random

import pytest

from trainhealth import defaults
from trainhealth.detectors.aggregate import StepAggregate, StepAggregator
from trainhealth.detectors.dead_rank import DeadRankDetector
from trainhealth.detectors.divergence import DivergenceDetector
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.ledger import CATEGORIES, GoodputLedger
from trainhealth.detectors.loss_spike import LossSpikeDetector
from trainhealth.detectors.nan_inf import NanInfDetector
from trainhealth.detectors.straggler import StragglerDetector
from trainhealth.wire import Event, StepRecord, decode_steps


def agg(step: int, loss: float | None = 1.0, *, gen: int = 0, busy: tuple = (), gn: float | None = 1.0,
        t_end: float | None = None, t_start: float | None = None, tokens: int | None = None, inc: float = 0.0,
        data_s: float = 0.0) -> StepAggregate:
    bad = () if (loss is None or math.isfinite(loss)) and (gn is None or math.isfinite(gn)) else (0,)
    return StepAggregate(step, gen, inc, t_start, float(step) if t_end is None else t_end, loss, gn, None, tokens,
                         None, max(1, len(busy)), busy, data_s, bad)


def run(det, aggs) -> list[tuple]:
    out = []
    for a in aggs:
        out += [(x.kind, x.status, x.step, x.end_step, x.severity) for x in det.update(a)]
    return out


# -- aggregator --------------------------------------------------------------------------------------
def test_aggregator_waits_for_all_ranks_and_separates_generations() -> None:
    ag = StepAggregator(world_size=2)
    assert ag.add(StepRecord(0, 1, 100.0, 10.0, dur=1.0, loss=2.0, tokens=10, sections={"data": 0.2, "fb": 0.5})) == []
    [a] = ag.add(StepRecord(1, 1, 100.0, 10.4, dur=1.2, loss=4.0, tokens=10, sections={"data": 0.3, "fb": 0.6}))
    assert (a.step, a.gen, a.loss, a.tokens, a.n_ranks, a.t_start, a.t_end) == (1, 0, 3.0, 20, 2, 9.0, 10.4)
    assert a.busy == (0.7, 0.8999999999999999) and a.data_s == 0.3
    # Rank 1 restarts (new incarnation) at step 1: a new generation, not a merge with the old step 1.
    ag.add(StepRecord(0, 2, 100.0, 11.0, loss=1.0))
    assert ag.add(StepRecord(1, 1, 200.0, 30.0, loss=5.0)) == [
        a2 := ag._build((0, 2), {0: StepRecord(0, 2, 100.0, 11.0, loss=1.0)})]  # the old step 2 closes partial
    assert a2.n_ranks == 1
    [b] = ag.add(StepRecord(0, 1, 200.0, 30.5, loss=5.0))
    assert (b.step, b.gen, b.inc) == (1, 1, 200.0)
    # A record from before the restart is late and ignored.
    assert ag.add(StepRecord(0, 3, 100.0, 12.0)) == [] and ag.late == 1


def test_aggregator_nan_on_one_rank_makes_the_step_nan() -> None:
    ag = StepAggregator(world_size=2)
    ag.add(StepRecord(0, 5, 0.0, 1.0, loss=2.0, grad_norm=1.0))
    [a] = ag.add(StepRecord(1, 5, 0.0, 1.0, loss=float("nan"), grad_norm=1.0))
    assert math.isnan(a.loss) and a.bad_ranks == (1,)


def test_aggregator_stale_step_closes_with_the_ranks_it_has_once_the_job_went_on() -> None:
    ag = StepAggregator(world_size=4, stale_s=30.0)
    ag.add(StepRecord(0, 7, 0.0, 100.0, loss=1.0))
    assert ag.flush_stale(129.0) == []
    assert ag.flush_stale(131.0) == []  # no rank got further: a frozen rank's record may still come
    for s in range(8, 12):
        ag.add(StepRecord(0, s, 0.0, 131.5, loss=1.0))
    # A few steps ahead: the others wait for a rank frozen mid-step whose last records are unsent in its collector.
    assert ag.flush_stale(132.0) == []
    ag.add(StepRecord(0, 7 + defaults.AGG_WENT_ON_STEPS, 0.0, 132.5, loss=1.0))
    [a] = ag.flush_stale(133.0)  # far past it: the job went on without ranks 1-3
    assert (a.step, a.n_ranks) == (7, 1)


def test_aggregator_stale_step_closes_when_a_missing_rank_moved_on() -> None:
    ag = StepAggregator(world_size=2, stale_s=30.0)
    ag.add(StepRecord(0, 7, 0.0, 100.0, loss=1.0))
    ag.add(StepRecord(1, 8, 0.0, 101.0, loss=1.0))  # rank 1's record of step 7 was lost (dropped while Redis was away)
    [a] = ag.flush_stale(131.0)
    assert (a.step, a.n_ranks) == (7, 1)


def test_aggregator_late_record_of_a_resumed_rank_joins_its_step() -> None:
    # Rank 2 froze (SIGSTOP) before its sender flushed step 66; the others completed it and block in step 67.
    ag = StepAggregator(world_size=4, stale_s=30.0)
    for rank in (0, 1, 3):
        assert ag.add(StepRecord(rank, 66, 0.0, 100.0, dur=0.035, loss=1.0)) == []
    assert ag.flush_stale(400.0) == []  # 300 s frozen: the step waits for it
    [a] = ag.add(StepRecord(2, 66, 0.0, 400.1, dur=300.1, loss=1.0))
    assert (a.step, a.n_ranks, ag.late) == (66, 4, 0)
    assert ag.last_steps() == {0: 66, 1: 66, 2: 66, 3: 66}


# -- NaN/Inf -----------------------------------------------------------------------------------------------
def test_nan_inf_grad_overflow_is_warning_and_nan_loss_escalates() -> None:
    det = NanInfDetector()
    seq = [agg(0), agg(1, gn=float("inf")), agg(2, loss=float("nan"), gn=float("nan")), agg(3), agg(4)]
    assert run(det, seq) == [
        ("nan_inf", "active", 1, None, "warning"),
        ("nan_inf", "active", 1, None, "critical"),
        ("nan_inf", "resolved", 1, 2, "critical"),
    ]


# -- loss spike -------------------------------------------------------------------------------------------------
def healthy_curve(n: int, seed: int = 3) -> list[float]:
    rng = random.Random(seed)
    return [2.0 + 6.0 * math.exp(-s / 150) + rng.gauss(0, 0.03) for s in range(n)]


def test_loss_spike_quiet_on_a_noisy_decaying_curve() -> None:
    det = LossSpikeDetector()
    assert run(det, [agg(s, x) for s, x in enumerate(healthy_curve(3000))]) == []


def test_loss_spike_opens_once_and_resolves_with_exact_steps() -> None:
    losses = healthy_curve(600)
    for k in range(5):
        losses[400 + k] += 2.0 * 0.5 ** k  # 2.0, 1.0, 0.5, 0.25, 0.125 over a baseline of ~2.4
    det = LossSpikeDetector()
    got = []
    for s, x in enumerate(losses):
        got += det.update(agg(s, x))
    assert [(a.kind, a.status, a.step, a.end_step) for a in got] == [
        ("loss_spike", "active", 400, None), ("loss_spike", "resolved", 400, 404)]
    # the detrended baseline is tight: step 404 (+0.125) is still elevated, step 405 is back
    assert got[1].evidence["peak_step"] == 400 and got[1].evidence["recovery_steps"] == 5


def test_loss_that_never_recovers_becomes_divergence() -> None:
    # The spike detector classifies the spike not_recovered; the divergence detector reports the divergence.
    losses = healthy_curve(500)
    losses[300:] = [x + 1.5 for x in losses[300:]]
    det, div = LossSpikeDetector(divergence_steps=100), DivergenceDetector(steps=100)
    got = []
    for s, x in enumerate(losses):
        got += det.update(agg(s, x)) + div.update(agg(s, x))
    assert [(a.kind, a.status, a.step, a.end_step, a.severity) for a in got] == [
        ("loss_spike", "active", 300, None, "warning"),
        ("loss_spike", "resolved", 300, 400, "critical"),
        ("divergence", "active", 300, None, "critical"),
    ]
    assert got[1].evidence["recovered"] is False and got[1].evidence["recovery_class"] == "not_recovered"
    assert got[2].evidence["reason"] == "spike_not_recovered"


# -- straggler -------------------------------------------------------------------------------------------------
def busy_rows(n: int, ranks: int, slow: dict[int, tuple[int, int, float]], seed: int = 5) -> list[tuple]:
    rng = random.Random(seed)
    rows = []
    for s in range(n):
        row = []
        for r in range(ranks):
            f = 1.0
            if r in slow and slow[r][0] <= s < slow[r][1]:
                f = slow[r][2]
            row.append(0.05 * f * rng.uniform(0.95, 1.05))
        rows.append(tuple(row))
    return rows


def test_straggler_flags_the_slow_rank_only_while_slow() -> None:
    det = StragglerDetector()
    rows = busy_rows(300, 16, {11: (100, 200, 1.8)})
    assert run(det, [agg(s, busy=b) for s, b in enumerate(rows)]) == [
        ("straggler", "active", 100, None, "warning"), ("straggler", "resolved", 100, 199, "warning")]


def test_straggler_judges_a_relaunch_after_every_rank_ended_mid_window() -> None:
    # Every rank ended 10 steps into a 20-step window (a crash, a clean end before a relaunch); the relaunch's rank 11
    # is slow from its first step: judged on the relaunch's own windows (finish() left the step of each busy value
    # behind: the relaunch's first window failed on the mismatch, and the detector with it).
    det = StragglerDetector()
    rows = busy_rows(130, 16, {})
    assert run(det, [agg(s, busy=b) for s, b in enumerate(rows)]) == []
    assert det.finish(129) == []
    rows = busy_rows(100, 16, {11: (0, 100, 1.8)}, seed=6)
    assert run(det, [agg(120 + s, busy=b) for s, b in enumerate(rows)]) == [("straggler", "active", 120, None,
                                                                             "warning")]


def test_straggler_ignores_jitter_and_a_single_slow_window() -> None:
    det = StragglerDetector()
    rows = busy_rows(400, 8, {3: (120, 140, 3.0)})  # one window only: not persistent
    assert run(det, [agg(s, busy=b) for s, b in enumerate(rows)]) == []


# -- hang ------------------------------------------------------------------------------------------------------
def test_hang_timeout_learns_from_step_intervals_and_spares_checkpoints() -> None:
    det = HangDetector(floor_s=60, step_multiple=20)
    assert det.timeout_s == 600.0  # HANG_INITIAL_S until 5 healthy intervals were seen
    for i in range(50):
        det.progress.step(0, 10.0 * i, paused=False)
    assert det.timeout_s == 200.0  # 20 x the longest interval, 10 s
    hb = {0: {"t": 1000.0, "step": 9, "step_t": 850.0, "phase": "train"},
          1: {"t": 1000.0, "step": 9, "step_t": 850.0, "phase": "checkpoint_save"}}
    assert det.check(1001.0, hb) == []  # 151 s < 200 s
    # 201.5 s > 200 s, but rank 1 is saving a checkpoint: rank 0 waits for it at the next collective.
    assert det.check(1051.0 + 0.5, {**hb, 0: {**hb[0], "t": 1050.0}, 1: {**hb[1], "t": 1050.0}}) == []
    # The save is over (back to train): the clock restarts at the save's last heartbeat (t = 1050). The first step
    # after a pause is judged on its own (workers re-spawned, caches cold): HANG_INITIAL_S until one was seen.
    after = {0: {**hb[0], "t": 1645.0}, 1: {**hb[1], "t": 1645.0, "phase": "train"}}
    assert det.check(1061.0, after) == [] and det.check(1649.0, after) == []
    [a] = det.check(1651.0, after)
    assert (a.kind, a.ranks, a.step, a.evidence["timeout_s"], a.evidence["stalled_s"], a.evidence["idle_s"]) == (
        "hang", (0, 1), 9, 600.0, 601.0, 801.0)
    assert a.message.startswith("all ranks: no step completed for 801 s (601 s since the last checkpoint/badput "
                                "phase) (timeout 600 s) after step 9")
    # Once a first step after a pause was seen (12 s of its own), the next one gets 20 x that (this detector's
    # multiple), at least the timeout.
    det.progress.step(0, 2000.0, paused=True, own_s=12.0)
    assert det.progress.after_pause_timeout_s == 240.0 and det.timeout_s == 200.0
    det.progress.step(0, 2100.0, paused=True, own_s=50.0)
    assert det.progress.after_pause_timeout_s == 1000.0


def test_dead_rank_is_reported_as_silent() -> None:
    # Since issue 4 a silent rank is a dead_rank (detectors/dead_rank.py); hang means no rank progresses.
    hb = {0: {"t": 1000.0, "step": 3, "step_t": 999.0}, 1: {"t": 979.0, "step": 3, "step_t": 978.0}}
    assert HangDetector(floor_s=60, heartbeat_interval=5, missed_intervals=4).check(1000.0, hb) == []
    [a] = DeadRankDetector(heartbeat_interval=5, missed_intervals=4).check(1000.0, hb, timeout_s=60.0)
    assert (a.kind, a.ranks, a.step, a.evidence["silent_ranks"]) == ("dead_rank", (1,), 3, [1])
    assert a.message == ("no heartbeat from rank 1 since step 3 (21 s): the process stopped, froze or lost its node; "
                         "rank 0 alive and waiting for it")


# -- ledger ---------------------------------------------------------------------------------------------------------
def test_ledger_scripted_run_with_restart_sums_to_wall_time_exactly() -> None:
    led = GoodputLedger(world_size=4, gpu_hour_usd=2.0)
    led.note_start(1000.0)
    # startup 1000 -> 1010; steps of 2 s (0.5 s data) 1..10 ending 1012..1030
    for s in range(1, 11):
        led.add_step(agg(s, t_start=1010.0 + 2 * (s - 1), t_end=1010.0 + 2 * s, tokens=4000, data_s=0.5))
        if s == 5:
            led.add_event(Event("checkpoint_save", 0, 1023.0, 1000.0, step=5, seconds=3.0))
            led.add_event(Event("checkpoint_save", 1, 1023.0, 1000.0, step=5, seconds=2.5))  # same ckpt, rank 1
    # A 3 s save after step 5 shifts steps 6..10 by... they were scripted back-to-back, so no gap there:
    # the save is only accounted where a gap exists; here the gap is 0, so it stays pending for the next gap.
    # Crash after step 10 (t=1030). New processes start at 1050, load the step-5 checkpoint in 4 s,
    # and redo steps 6..10 from 1060.
    led.add_event(Event("checkpoint_load", 0, 1056.0, 1050.0, step=5, seconds=4.0))
    for s in range(6, 11):
        led.add_step(agg(s, gen=1, inc=1050.0, t_start=1060.0 + 2 * (s - 6), t_end=1062.0 + 2 * (s - 6),
                         tokens=4000, data_s=0.5))
    snap = led.snapshot(now=1080.0)
    sec = snap["seconds"]
    assert sec == {
        "productive": 15.0,                                  # 10 surviving steps x 1.5 s
        "program_startup": 16.0,                             # 1000->1010, and 1050->1060 minus 4 s restore
        "data_loading": 5.0,                                 # 10 x 0.5 s
        "straggler_wait": 0.0,
        "communication": 0.0,                                # no collective timed
        "skipped_steps": 0.0,
        "checkpoint_save": 0.0,                              # no gap to put it in (see above)
        "checkpoint_restore": 4.0,
        "wasted_progress_from_disruption": 10.0,             # first attempts of steps 6..10: after checkpoint 5
        "wasted_progress_from_rollback": 0.0,
        "infrastructure_recovery_from_disruption": 20.0,     # 1030 -> 1050
        "custom": 0.0,
        "hang": 0.0,
        "idle": 10.0,                                        # 1070 -> 1080, no step (under the hang threshold)
        "unobserved": 0.0,                                   # the records cover every step
    }
    assert set(sec) == set(CATEGORIES)
    assert math.fsum(sec.values()) == snap["wall_s"] == 80.0
    assert (snap["tokens_total"], snap["tokens_good"], snap["steps_done"], snap["steps_good"]) == (60000, 40000, 15, 10)
    # throughput: 60,000 tokens over 30 s inside steps (15 productive + 5 data + 10 wasted);
    # goodput: 40,000 kept tokens over 80 s of wall time
    assert snap["step_s"] == 30.0 and snap["throughput_tok_s"] == 2000.0 and snap["goodput_tok_s"] == 500.0
    # last 60 s (1020-1080): the first attempts of steps 6-10 (discarded) and their redo
    # (5 kept steps in it: too few for a loss-progress figure)
    assert snap["rates"]["60s"] == {"throughput_tok_s": 2000.0, "goodput_tok_s": 20000 / 60,
                                    "loss_drop_per_gpu_hour": None, "loss_drop_per_btok": None}
    assert snap["goodput_pct"] == 18.75
    assert snap["gpu_hours"]["idle"] == 10.0 * 4 / 3600
    assert snap["cost_usd"]["wasted_progress_from_disruption"] == 10.0 * 4 / 3600 * 2.0
    assert snap["badput_cost_usd"] == pytest.approx((80.0 - 15.0) * 4 / 3600 * 2.0, rel=1e-12)


def test_ledger_checkpoint_save_in_a_gap_and_hang_tail() -> None:
    led = GoodputLedger(world_size=1)
    led.note_start(0.0)
    led.add_step(agg(1, t_start=0.0, t_end=1.0, tokens=10))
    led.add_event(Event("checkpoint_save", 0, 4.0, 0.0, step=1, seconds=3.0))
    led.add_event(Event("badput", 0, 9.0, 0.0, step=1, seconds=4.0, extra={"name": "evaluation"}))
    led.add_step(agg(2, t_start=10.0, t_end=11.0, tokens=10))
    snap = led.snapshot(now=41.0)
    assert {k: v for k, v in snap["seconds"].items() if v} == {
        "productive": 2.0, "checkpoint_save": 3.0, "custom": 4.0, "idle": 32.0}
    assert snap["custom_by_name"] == {"evaluation": 4.0}
    assert snap["wall_s"] == 41.0


def test_restart_rewinds_the_loss_baseline_and_a_rollback_closes_the_spike() -> None:
    losses = healthy_curve(400)
    det = LossSpikeDetector()
    got = [a for s in range(0, 300) for a in det.update(agg(s, losses[s]))]
    # resume from step 250 (the curve is higher there than at 299): not a spike
    got += [a for s in range(250, 310) for a in det.update(agg(s, losses[s], gen=1))]
    assert got == []
    # a spike at 310, then a rollback to 300 before it recovers
    got = [a for a in det.update(agg(310, losses[310] + 3.0, gen=1))]
    got += det.update(agg(300, losses[300], gen=2))
    assert [(a.status, a.step, a.end_step, a.evidence.get("rolled_back")) for a in got] == [
        ("active", 310, None, None), ("resolved", 310, 310, True)]


def test_ledger_straggler_wait_skipped_steps_hang_and_rollback_vs_disruption() -> None:
    led = GoodputLedger(world_size=4, hang_floor_s=60.0)
    led.note_start(0.0)
    # step 1: ranks busy 0.5, 0.5, 0.5, 1.5 s of a 2 s step: all wait 1.0 s for the slow one
    led.add_step(agg(1, t_start=0.0, t_end=2.0, tokens=100, busy=(0.5, 0.5, 0.5, 1.5)))
    # step 2: fp16 overflow, the optimizer skipped it
    led.add_step(StepAggregate(2, 0, 0.0, 2.0, 4.0, 1.0, float("inf"), None, 100, None, 4, (), 0.0, (), None, None,
                               True))
    led.add_event(Event("checkpoint_save", 0, 4.0, 0.0, step=2, seconds=0.0))
    for s in range(3, 7):  # steps 3..6, 2 s each, from t=4
        led.add_step(agg(s, t_start=4.0 + 2 * (s - 3), t_end=6.0 + 2 * (s - 3), tokens=100))
    led.add_event(Event("checkpoint_save", 0, 12.0, 0.0, step=6, seconds=0.0))
    led.add_step(agg(7, t_start=12.0, t_end=14.0, tokens=100))
    # a 100 s stall (over the 60 s hang floor), then step 8
    led.add_step(agg(8, t_start=114.0, t_end=116.0, tokens=100))
    # crash; relaunched at t=120 from the step-2 checkpoint although step 6's existed: a rollback
    led.add_step(agg(3, gen=1, inc=120.0, t_start=121.0, t_end=123.0, tokens=100))
    sec = led.snapshot(now=123.0)["seconds"]
    assert {k: v for k, v in sec.items() if v} == {
        "productive": 3.0,                         # step 1 (1.0 s besides the wait) + step 3's redo (2.0 s)
        "straggler_wait": 1.0,
        "skipped_steps": 2.0,
        "wasted_progress_from_disruption": 4.0,    # steps 7, 8: after checkpoint 6, lost to the crash
        "wasted_progress_from_rollback": 8.0,      # steps 3-6: discarded by resuming from checkpoint 2
        "infrastructure_recovery_from_disruption": 4.0,  # 116 -> 120
        "program_startup": 1.0,                    # 120 -> 121
        "hang": 100.0,                             # 14 -> 114
    }
    assert math.fsum(sec.values()) == 123.0


def test_ledger_tells_unobserved_time_from_a_hang_a_restart_and_a_checkpoint() -> None:
    led = GoodputLedger(world_size=1, hang_floor_s=60.0)
    led.note_start(0.0)
    t = 0.0

    def steps(first: int, n: int, *, gen: int = 0, inc: float = 0.0, every: int = 1) -> None:
        nonlocal t
        for s in range(first, first + n * every, every):
            led.add_step(agg(s, gen=gen, inc=inc, t_start=t, t_end=t + 2.0, tokens=100))
            t += 2.0

    steps(1, 10)                 # t 0-20
    t += 100.0                   # a 100 s stall, the step counter at its usual increment: hang
    steps(11, 5)                 # t 120-130
    t += 3000.0                  # 3,000 steps nobody recorded (records lost), of which 2 s of a checkpoint save
    led.add_event(Event("checkpoint_save", 0, t - 500.0, 0.0, step=1500, seconds=2.0))
    steps(3016, 5)               # t 3130-3140: step 3016 follows 15
    inc = t + 5.0                # a crash: new processes at 3145 restore step 3020's checkpoint in 1 s
    led.add_event(Event("checkpoint_load", 0, inc + 1.0, inc, step=3020, seconds=1.0))
    t = inc + 2.0
    steps(3021, 3, gen=1, inc=inc)  # t 3147-3153
    snap = led.snapshot(now=t)
    assert {k: v for k, v in snap["seconds"].items() if v} == {
        "productive": 46.0,                                 # 23 steps of 2 s
        "hang": 100.0,
        "checkpoint_save": 2.0,
        "unobserved": 2998.0,                               # the jump's 3,000 s less the declared save
        "infrastructure_recovery_from_disruption": 5.0,     # 3140 -> 3145
        "checkpoint_restore": 1.0,
        "program_startup": 1.0,
    }
    assert snap["unobserved_gaps"] == {"count": 1, "steps": 3000, "largest": [15, 3016]}
    assert (snap["observed_s"], snap["wall_s"]) == (155.0, 3153.0)
    assert snap["tokens_total"] == 2300 and snap["tokens_unobserved"] == 0  # timed steps: their own tokens


def test_ledger_books_straggler_wait_against_the_median_of_the_other_ranks() -> None:
    # 2 ranks: the other rank is the reference (the "median" of both used to be the slower rank: 0 s booked).
    led = GoodputLedger(world_size=2)
    led.note_start(0.0)
    for s in range(1, 13):
        led.add_step(agg(s, t_start=float(s - 1), t_end=float(s), tokens=100, busy=(0.4, 0.9)))
    assert led.snapshot(now=12.0)["seconds"]["straggler_wait"] == pytest.approx(12 * 0.5)
    # 4 ranks, one slow: it against the median of the other three (0.5 s), not the fastest (0.3 s).
    led = GoodputLedger(world_size=4)
    led.note_start(0.0)
    led.add_step(agg(1, t_start=0.0, t_end=2.0, tokens=100, busy=(0.3, 0.5, 0.6, 1.5)))
    assert led.snapshot(now=2.0)["seconds"]["straggler_wait"] == pytest.approx(1.0)


def test_ledger_places_an_early_checkpoint_event_in_the_right_gap() -> None:
    # Step 10 closes only when its slowest rank reports, after a fast rank's checkpoint event of
    # the save that follows step 10 was already processed: the save belongs to the 10 -> 11 gap.
    led = GoodputLedger(world_size=2)
    led.note_start(0.0)
    led.add_step(agg(9, t_start=0.0, t_end=9.0, tokens=1))
    led.add_event(Event("checkpoint_save", 0, 10.5, 0.0, step=10, seconds=0.5))
    led.add_step(agg(10, t_start=9.0, t_end=10.0, tokens=1))
    led.add_step(agg(11, t_start=10.6, t_end=11.6, tokens=1))
    sec = led.snapshot(now=11.6)["seconds"]
    assert {k: round(v, 9) for k, v in sec.items() if v} == {"productive": 11.0, "checkpoint_save": 0.5, "idle": 0.1}


# -- events the job's logs report: collective timeouts, launcher restarts -----------------------------
def _event(kind: str, rank: int, t: float, seconds: float | None = None, **fields: object) -> Event:
    """An event as the detector service decodes it from the events stream: every field as text."""
    return Event(kind, rank, t, 0.0, seconds=seconds, extra={k: str(v) for k, v in fields.items()})


def test_collective_timeout_events_fed_to_the_pipeline_give_one_critical_hang() -> None:
    from trainhealth.detectors.pipeline import RunPipeline

    pipe = RunPipeline(4, run="r")
    for step in range(1, 6):
        for rank in range(4):
            pipe.feed_step(StepRecord(rank, step, 0.0, float(step), dur=1.0, loss=2.0, sections={"fb": 0.9}))
    found = []
    for rank in (0, 1, 2):
        found += pipe.feed_event(_event("collective_timeout", rank, 700.0, 600.0 + rank / 100, op="ALLREDUCE",
                                        seq=88, timeout_s=600.0, numel_in=1024, numel_out=1024)).anomalies
    for rank, done in ((0, 87), (1, 87), (3, 85)):
        found += pipe.feed_event(_event("collective_timeout", rank, 700.0, seq=88 if rank != 3 else "", pg=0,
                                        last_enqueued=88 if rank != 3 else 86, last_completed=done)).anomalies
    assert {a.id for a in found} == {"hang:collective:5:0"}  # one anomaly, updated as the ranks report
    a = pipe.anomalies["hang:collective:5:0"]
    assert (a.kind, a.severity, a.status, a.step, a.ranks) == ("hang", "critical", "active", 5, (0, 1, 2, 3))
    assert a.message == (
        "ranks 0–2 timed out ALLREDUCE SeqNum 88 after 600.0 s (timeout 600 s); last completed 85–87, "
        "last enqueued 86–88 on ranks 0, 1, 3 (PG 0); rank 3 is behind: last completed 85 while the others "
        "completed 87; rank 3 is behind: last enqueued 86, never reaching the work 88 the others are stuck in")
    ev = a.evidence
    assert (ev["behind_ranks"], ev["timed_out_ranks"], ev["waited_s"], ev["min_waited_s"]) == (
        [3], [0, 1, 2], 600.02, 600.0)
    assert [b["field"] for b in a.evidence["behind"]] == ["last_completed", "last_enqueued"]
    assert not any(x.kind == "straggler" for x in pipe.anomalies.values())
    # A step the ranks had completed before the timeout, closed late (its last record arrived after the events),
    # is no progress; the hang stays open.
    assert pipe.collective_timeout.update(agg(6, t_end=690.0)) == []
    # The job resumes (a restart: the ranks' new incarnation): the hang is over.
    out = pipe.feed_step(StepRecord(0, 4, 900.0, 901.0, dur=1.0, loss=2.0))
    out.extend(pipe.flush())
    (done,) = [x for x in out.anomalies if x.id == "hang:collective:5:0"]
    assert (done.status, done.end_step) == ("resolved", 4)


def test_collective_timeout_through_the_services_feed_path_and_a_bad_field() -> None:
    from trainhealth.detectors.pipeline import RunPipeline

    pipe = RunPipeline(2)
    evs = [_event("collective_timeout", 1, 5.0, 600.5, op="BROADCAST", seq="x", timeout_s="nan"),
           _event("collective_timeout", 0, 5.0, op="bad op!")]  # nothing usable: no anomaly
    outs = list(pipe.feed(evs))
    assert [a.message for o in outs for a in o.anomalies] == [
        "rank 1 timed out BROADCAST after 600.5 s; only rank 1 reported: the log does not show which rank held the "
        "others up"]
    assert pipe.detector_errors == {}


def test_desync_at_the_same_seqnum_is_named() -> None:
    from trainhealth.detectors.collective_timeout import CollectiveTimeoutDetector

    det = CollectiveTimeoutDetector()
    for rank, op, seq in ((0, "ALLREDUCE", 12), (1, "ALLREDUCE", 12), (2, "ALLGATHER", 12), (3, "ALLREDUCE", 9)):
        found = det.report(_event("collective_timeout", rank, 0.0, 600.0, op=op, seq=seq, timeout_s=600), step=3)
    assert found[0].message == (
        "ranks 0, 1 timed out ALLREDUCE SeqNum 12 after 600.0 s (timeout 600 s); rank 2 called a different collective "
        "at SeqNum 12: ALLGATHER while the others ALLREDUCE (the ranks' collectives do not match); rank 3 is behind: "
        "timed out at SeqNum 9 while the others were at 12")
    assert found[0].evidence["behind_ranks"] == [2, 3]


def test_worker_restart_event_gives_a_restart_merged_across_agents() -> None:
    from trainhealth.detectors.pipeline import RunPipeline

    pipe = RunPipeline(8)
    pipe.hosts[5] = "node-b"
    (a,) = pipe.feed_event(_event("worker_restart", 0, 10.0, restart_count=1, attempts_left=3, max_restarts=3,
                                  state="FAILED")).anomalies
    assert (a.id, a.kind, a.severity, a.status, a.ranks) == ("restart:launcher-1:0:0", "restart", "warning",
                                                           "resolved", ())
    assert a.message == ("the launcher (torchelastic) restarted the worker group after it FAILED: restart 1 of at "
                         "most 3; which rank failed, and how, is not in the log")
    # Another node's agent reports the same restart, knowing the failed worker.
    (b,) = pipe.feed_event(_event("worker_restart", 0, 11.0, restart_count=1, failed_rank=5, failed_local_rank=1,
                                  exitcode=-9, signal="SIGKILL")).anomalies
    assert (b.id, b.ranks, b.hosts) == (a.id, (5,), ("node-b",))
    assert b.message == ("the launcher (torchelastic) restarted the worker group after it FAILED: restart 1 of at "
                         "most 3; rank 5 (local rank 1) exited with code -9 (SIGKILL)")
    assert b.evidence == {"source": "torchelastic", "restart_count": 1, "max_restarts": 3, "attempts_left": 3,
                          "state": "FAILED", "role": None, "failed_rank": 5, "failed_local_rank": 1, "exitcode": -9,
                          "signal": "SIGKILL", "host": None}
    assert pipe.feed_event(_event("worker_restart", 0, 12.0, restart_count=1)).anomalies == []  # nothing new


def test_a_timed_collective_is_communication_and_not_the_ranks_own_work() -> None:
    """Ranks that time their all-reduce (``section("allreduce")``): rank 1 computes 0.8 s, rank 0 0.5 s; the
    collective takes 0.1 s once rank 1 arrives, so rank 0 spends 0.4 s in it (0.3 s waiting). The step takes
    1.0 s with 0.1 s of data loading: 0.3 s straggler wait, 0.1 s communication, the rest productive. Read as the
    service reads them (plain records through decode_step_rows) and as StepRecords, alike."""
    from trainhealth.detectors.aggregate import StepAggregator
    from trainhealth.wire import ROW_BUSY, ROW_COMM, decode_step_rows

    recs = [{"rank": r, "step": 1, "inc": 0.0, "t": 11.0, "dur": 1.0, "sec.data": 0.1,
             "sec.forward": (0.5, 0.8)[r], "sec.allreduce": (0.4, 0.1)[r]} for r in (0, 1)]
    rows = decode_step_rows({b"recs": json.dumps(recs).encode()}, defaults.DATA_SECTIONS)
    assert [(row[ROW_BUSY], row[ROW_COMM]) for row in rows] == [(0.6, 0.4), (0.9, 0.1)]  # data + forward
    for feed in ("rows", "records"):
        aggr = StepAggregator(2)
        if feed == "rows":
            [a] = [x for row in rows for x in aggr.add_row(row)]
        else:
            [a] = [x for rec in decode_steps({b"recs": json.dumps(recs).encode()}) for x in aggr.add(rec)]
        assert (a.busy, a.comm, a.data_s) == ((0.6, 0.9), (0.4, 0.1), 0.1)
        led = GoodputLedger(world_size=2)
        parts = led._split_step(a, 1.0)
        assert {k: round(v, 9) for k, v in parts.items()} == {
            "data_loading": 0.1, "straggler_wait": 0.3, "communication": 0.1, "productive": 0.5}
