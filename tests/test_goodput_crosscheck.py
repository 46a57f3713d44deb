"""Cross-check of the goodput ledger against Google's ml-goodput-measurement definitions.

``google_productive_time`` transcribes the calculation of
``GoodputCalculator._get_current_productive_and_unproductive_time`` (AI-Hypercomputer/
ml-goodput-measurement, ``ml_goodput_measurement/src/goodput.py``): productive time is the
sum of step-start-to-next-step-start intervals of each launch (segment), minus the first
step's excess over the segment's average step time (``PROGRAM_STARTUP``); when a step number
is seen again, the time from the old start of that step to the new job start is
``WASTED_PROGRESS_FROM_DISRUPTION``; the last step counts up to the job's end. Goodput % is
productive / total job time minus the checkpoint-save share. The library itself needs Google
Cloud Logging, so its calculation is transcribed here rather than imported.
"""

from __future__ import annotations

import math

import pytest

from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.ledger import GoodputLedger
from trainhealth.wire import Event


def google_productive_time(events: list[dict]) -> tuple[float, dict[str, float]]:
    def segment(starts: dict[int, float], curr: int) -> tuple[float, float]:
        total, first, n, times = 0.0, 0.0, 0, []
        lo = min(starts)
        for step, t in starts.items():
            if step <= curr and step - 1 in starts:
                total += t - starts[step - 1]
                if step - 1 == lo:
                    first = total
                else:
                    times.append(t - starts[step - 1])
                n += 1
        if n <= 1:
            return total, 0.0
        avg = (total - first) / (n - 1)
        extra = first - avg if first > avg else 0.0
        return total - extra, extra

    productive, bad = 0.0, {"program_startup": 0.0, "wasted_progress_from_disruption": 0.0}
    starts: dict[int, float] = {}
    job_start = job_end = None
    for e in events:
        if "job_start_time" in e:
            job_start = e["job_start_time"]
        if "step_start_time" in e:
            step = e["step_count"]
            if step not in starts:
                starts[step] = e["step_start_time"]
            else:
                p, extra = segment(starts, step)
                productive += p
                bad["program_startup"] += extra
                bad["wasted_progress_from_disruption"] += job_start - starts[step]
                starts = {step: e["step_start_time"]}
        if "job_end_time" in e:
            job_end = e["job_end_time"]
    last = max(starts)
    p, extra = segment(starts, last)
    productive += p + (job_end - starts[last])
    bad["program_startup"] += extra
    return productive, bad


def test_productive_time_and_goodput_agree_with_googles_definitions() -> None:
    # Launch 1 at t=0: step 1 starts at 10 and takes 8 s (compilation), then 2 s steps back to back;
    # a crash during step 21 (steps 16-20 lost); launch 2 at t=100 loads the step-15 checkpoint
    # (4 s) and starts step 16 at 105 (first step 6 s), then 2 s steps to step 40; the job ends
    # when step 40 ends. (A checkpoint save between steps is where the two differ on purpose:
    # Google's first-step average includes the save's interval; see docs/goodput.md.)
    google: list[dict] = [{"job_start_time": 0.0}]
    led = GoodputLedger(world_size=8)
    led.note_start(0.0)
    t = 10.0

    def step(s: int, gen: int, inc: float, dur: float) -> None:
        nonlocal t
        google.append({"step_start_time": t, "step_count": s})
        led.add_step(StepAggregate(s, gen, inc, t, t + dur, 2.0, 1.0, None, 1000, None, 8, (), 0.0))
        t += dur

    for s in range(1, 21):
        step(s, 0, 0.0, 8.0 if s == 1 else 2.0)
    google.append({"step_start_time": t, "step_count": 21})  # step 21 starts, then the crash
    google.append({"job_start_time": 100.0})
    led.add_event(Event("checkpoint_load", 0, 105.0, 100.0, step=15, seconds=4.0))
    t = 105.0
    for s in range(16, 41):
        step(s, 1, 100.0, 6.0 if s == 16 else 2.0)
    google.append({"job_end_time": t})

    g_productive, g_bad = google_productive_time(google)
    snap = led.snapshot(now=t)
    sec, total = snap["seconds"], t - 0.0
    # 40 surviving steps of 2 s (steps 1-15, 16-40); both first steps' excess is start-up
    assert (g_productive, sec["productive"]) == (pytest.approx(2.0 * 40), pytest.approx(2.0 * 40))
    assert snap["goodput_pct"] == pytest.approx(100 * g_productive / total, abs=1e-6)  # rounded to 6 places
    # Its first-step excess is our program start-up beyond the launch gaps ...
    gaps = 10.0 + (105.0 - 100.0 - 4.0)  # run start -> step 1; launch 2 start -> step 16, minus the restore
    assert sec["program_startup"] == pytest.approx(g_bad["program_startup"] + gaps, abs=1e-9)
    # ... and its wasted progress (old start of step 16 -> launch 2) is our wasted steps + recovery
    assert sec["wasted_progress_from_disruption"] + sec["infrastructure_recovery_from_disruption"] == pytest.approx(
        g_bad["wasted_progress_from_disruption"], abs=1e-9)
    assert math.fsum(sec.values()) == pytest.approx(total, abs=1e-9)


def test_checkpoint_save_share_is_subtracted_like_google_does() -> None:
    # Steps of 2 s with a 3 s save after every 5th step, in one launch (no first-step excess).
    google: list[dict] = [{"job_start_time": 0.0}]
    led = GoodputLedger(world_size=1)
    led.note_start(0.0)
    t = 0.0
    for s in range(1, 21):
        google.append({"step_start_time": t, "step_count": s})
        led.add_step(StepAggregate(s, 0, 0.0, t, t + 2.0, 2.0, 1.0, None, 10, None, 1, (), 0.0))
        t += 2.0
        if s % 5 == 0 and s < 20:
            led.add_event(Event("checkpoint_save", 0, t + 3.0, 0.0, step=s, seconds=3.0))
            t += 3.0
    google.append({"job_end_time": t})
    g_productive, _ = google_productive_time(google)
    snap = led.snapshot(now=t)
    saves = 3 * 3.0
    # Google: step-start intervals include the saves; its goodput subtracts their share of the job time.
    # The first-step rule leaves nothing here (step 1's interval is not above the average).
    assert g_productive == pytest.approx(40.0 + saves)
    assert snap["seconds"]["productive"] == pytest.approx(g_productive - saves)
    assert snap["seconds"]["checkpoint_save"] == pytest.approx(saves)
    assert snap["goodput_pct"] == pytest.approx(100 * g_productive / t - 100 * saves / t)
