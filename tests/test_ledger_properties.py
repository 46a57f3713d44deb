"""Property tests of the goodput ledger over randomly generated runs (hypothesis).

A run is a script of steps (timed by the ranks or untimed, 1-3 ranks with their own section times, some skipped),
gaps (short idle ones and long stalls), jumps in the step numbers (records the stream does not have), checkpoint
saves, evaluations, in-process rewinds and crashes relaunched from the newest checkpoint. Whatever the script:

- the categories sum to the wall time, and none is negative;
- goodput never exceeds throughput, whole run or rolling window, in tokens/s and as a share (kept tokens among the
  tokens counted, productive time within the step time);
- every token reported is counted once: with step time (``tokens_total``) or without (``tokens_unobserved``);
- the detector service fed the same records through a real redis-server writes the same snapshot as the pipeline
  run in-process, and ``trainhealth replay`` of a log through the service the same as ``analyze``'s offline run.

Examples stay small (at most 30 actions, a few ranks) so the file runs in seconds.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainhealth.commands.replay import replay
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.ledger import CATEGORIES, STEP_CATEGORIES
from trainhealth.detectors.offline import OfflineRun
from trainhealth.detectors.pipeline import RunPipeline
from trainhealth.detectors.service import DetectorService
from trainhealth.keys import RUNS, run_keys
from trainhealth.logpoint import LogPoint
from trainhealth.wire import Event, StepRecord

T0 = 1_800_000_000.0
#: Relative slack for comparing rates built from sums of floats.
EPS = 1e-9
ACTIONS = ["step"] * 10 + ["gap", "stall", "jump", "save", "eval", "rewind", "restart"]
quarters = st.integers(0, 40).map(lambda q: q / 4)  # 0-10 s in quarter seconds: no float noise in the script


@dataclass
class Script:
    """A generated run: records and events in the order a service reads them, and what was reported."""

    world: int
    actions: list[str] = field(default_factory=list)  # the script, for a failure's report
    items: list[StepRecord | Event] = field(default_factory=list)
    tokens: int = 0
    end: float = T0


@st.composite
def scripts(draw: st.DrawFn, max_actions: int = 30) -> Script:
    world = draw(st.integers(1, 3))
    timed = draw(st.booleans())
    own_step_s = draw(st.booleans())  # an untimed job that reports its own seconds per step
    sc = Script(world)
    inc = t = T0
    step = draw(st.integers(0, 50))
    first = step
    ckpt: int | None = None
    done = False  # a step completed since the (re)start
    logged = step  # the newest step recorded

    def starts(at: float) -> None:
        sc.items += [Event("run_start", r, at, at) for r in range(world)]

    starts(inc)
    t += draw(quarters)  # start-up
    sc.actions = draw(st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=max_actions))
    for action in sc.actions:
        if action == "step":
            dur = draw(st.integers(1, 16).map(lambda q: q / 4))
            skipped = draw(st.sampled_from([False] * 7 + [True]))
            for r in range(world):
                end_r = t + dur - draw(st.integers(0, 3)) * dur / 8  # ranks end at the collective, about
                busy = draw(st.integers(0, 8)) * (end_r - t) / 8
                data = draw(st.integers(0, 4)) * (end_r - t - busy) / 8
                tokens = draw(st.integers(0, 4096))
                sc.tokens += tokens
                sc.items.append(StepRecord(
                    r, step, inc, end_r, dur=(end_r - t) if timed else None, loss=2.0, grad_norm=1.0, tokens=tokens,
                    skipped=1 if skipped else None, sections={"data": data, "fb": busy},
                    step_s=None if timed or not own_step_s else dur))
            t += dur
            logged, step = step, step + 1
            done = True
        elif action == "gap":
            t += draw(quarters)
        elif action == "stall":
            t += draw(st.integers(40, 900))  # past the progress timeout's floor, and at times its initial 600 s
        elif action == "jump":  # steps nobody records: the next step number is 12-60 further, their time passes
            k = draw(st.integers(12, 60))
            t += (k - 1) * draw(st.integers(1, 16).map(lambda q: q / 4))
            step += k - 1
        elif action == "save" and done:
            secs = draw(quarters)
            t += secs
            ckpt = step - 1
            sc.items += [Event("checkpoint_save", r, t, inc, step=ckpt, seconds=secs) for r in range(world)]
        elif action == "eval" and done:
            secs = draw(quarters)
            t += secs
            sc.items.append(Event("badput", 0, t, inc, step=step - 1, seconds=secs, extra={"name": "evaluation"}))
        elif action == "rewind" and done and logged > first:  # an in-process rollback to an earlier step
            step = draw(st.integers(first, logged - 1))
        elif action == "restart" and done:  # a crash, new processes, the newest checkpoint loaded
            t += draw(quarters)
            inc = t
            starts(inc)
            load = draw(quarters)
            t += load
            if ckpt is not None:
                sc.items += [Event("checkpoint_load", r, t, inc, step=ckpt, seconds=load) for r in range(world)]
            t += draw(quarters)
            step = ckpt + 1 if ckpt is not None else first
            done = False
    sc.end = t
    return sc


def feed(sc: Script) -> RunPipeline:
    pipe = RunPipeline(sc.world, hang=HangDetector(floor_s=30.0))
    for item in sc.items:
        if isinstance(item, Event):
            pipe.feed_event(item)
        else:
            pipe.feed_step(item)
    pipe.flush()
    return pipe


def check_invariants(snap: dict) -> None:
    sec = snap["seconds"]
    assert set(sec) == set(CATEGORIES)
    assert min(sec.values()) >= 0, sec
    assert math.fsum(sec.values()) == pytest.approx(snap["wall_s"], abs=1e-5 * len(sec))
    assert snap["observed_s"] == pytest.approx(snap["wall_s"] - sec["unobserved"], abs=1e-5)
    assert snap["step_s"] == pytest.approx(math.fsum(sec[c] for c in STEP_CATEGORIES), abs=1e-5)
    # Goodput never above throughput: in tokens/s, and as a share (kept tokens, productive time).
    assert 0 <= snap["tokens_good"] <= snap["tokens_total"]
    assert sec["productive"] <= snap["step_s"] + 1e-6
    assert snap["goodput_pct"] <= 100 * snap["step_s"] / snap["wall_s"] + 1e-4 if snap["wall_s"] > 0 else True
    assert snap["goodput_tok_s"] <= snap["throughput_tok_s"] * (1 + EPS), snap
    for w, rate in snap["rates"].items():
        assert 0 <= rate["goodput_tok_s"] <= rate["throughput_tok_s"] * (1 + EPS), (w, snap["rates"])


@settings(max_examples=300, deadline=None)
@given(scripts())
def test_every_snapshot_of_a_random_run_keeps_the_invariants(sc: Script) -> None:
    pipe = RunPipeline(sc.world, hang=HangDetector(floor_s=30.0))
    ledger = pipe.ledger
    for item in sc.items:
        if isinstance(item, Event):
            pipe.feed_event(item)
        else:
            pipe.feed_step(item)
        if ledger.last_activity is not None:  # mid-run, steps held for the usual increment included
            check_invariants(ledger.snapshot(ledger.last_activity))
    pipe.flush()
    if ledger.last_activity is None:
        return
    for later in (0.0, 7.5, 4000.0):  # at the last step, then idle, then hung since
        check_invariants(ledger.snapshot(ledger.last_activity + later))
    snap = ledger.snapshot(ledger.last_activity)
    assert snap["tokens_total"] + snap["tokens_unobserved"] == sc.tokens  # every token once
    assert snap["wall_s"] == pytest.approx(sc.end - T0, abs=1e-6) if snap["t"] == sc.end else True


# -- the same figures live (the service through Redis) and offline -------------------------------------------------

def push(client: redis.Redis, run: str, sc: Script) -> None:
    """The script's records and events as the collectors write them, one stream entry each, in its order."""
    keys = run_keys(run)
    client.hset(keys.meta, mapping={"world_size": sc.world, "status": "running"})
    client.zadd(RUNS, {run: T0})
    seq: dict[int, int] = {}
    for i, item in enumerate(sc.items):
        eid = f"{1_000 + i}-0"
        if isinstance(item, Event):
            fields = {"kind": item.kind, "rank": item.rank, "t": repr(item.t), "inc": repr(item.inc),
                      **({"step": item.step} if item.step is not None else {}),
                      **({"seconds": repr(item.seconds)} if item.seconds is not None else {}), **item.extra}
            client.xadd(keys.events, fields, id=eid)
            continue
        rec = {"rank": item.rank, "step": item.step, "inc": item.inc, "t": item.t, "dur": item.dur,
               "loss": item.loss, "grad_norm": item.grad_norm, "tokens": item.tokens, "skipped": item.skipped,
               "step_s": item.step_s, **{f"sec.{k}": v for k, v in item.sections.items()}}
        rec = {k: v for k, v in rec.items() if v is not None}
        n = seq.get(item.rank, 0)
        seq[item.rank] = n + 1
        client.xadd(keys.steps, {"rank": item.rank, "n": 1, "seq": n, "recs": json.dumps([rec])}, id=eid)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scripts(max_actions=20))
def test_the_service_through_redis_books_what_the_pipeline_books(r: redis.Redis, sc: Script) -> None:
    r.flushdb()
    now = sc.end + 3.0  # the service's clock: the job is still running, 3 s after its last activity
    push(r, "prop", sc)
    svc = DetectorService(r, consumer="prop", clock=lambda: now, snapshot_interval=0.0,
                          hang_factory=lambda: HangDetector(floor_s=30.0))
    for _ in range(20):
        if svc.run_once(block_ms=10) == 0:
            break
    svc._tick(now)
    raw = r.get(run_keys("prop").ledger_latest)
    pipe = feed(sc)
    if pipe.ledger.last_activity is None:
        assert raw is None
        return
    live = json.loads(raw)
    offline = json.loads(json.dumps(pipe.ledger.snapshot(now)))
    check_invariants(live)
    assert live == offline


# -- analyze (offline) and replay (live) of a log with jumps -------------------------------------------------------

@st.composite
def logs(draw: st.DrawFn) -> list[LogPoint]:
    """A Megatron-like log: steps with the job's own seconds per iteration, a cumulative token counter (each
    point's tokens cover the steps since the previous one), a logging cadence, blocks pasted far apart."""
    every = draw(st.sampled_from([1, 1, 5, 20]))
    step = draw(st.integers(1, 20_000))
    per_step = draw(st.integers(1, 8)) * 1024
    pts, prev = [], None
    for action in ["log", *draw(st.lists(st.sampled_from(["log"] * 6 + ["jump"]), max_size=40)), "log"]:
        if action == "jump":
            step += every * draw(st.integers(11, 3_000))
            continue
        step += every
        tokens = per_step * (step if prev is None else step - prev)  # the counter since the previous line
        pts.append(LogPoint(step, loss=2.0, tokens=tokens, step_seconds=draw(st.integers(4, 480)) / 4))
        prev = step
    return pts


@settings(max_examples=150, deadline=None)
@given(logs())
def test_analyze_of_a_log_with_jumps_keeps_the_invariants(pts: list[LogPoint]) -> None:
    run = OfflineRun().feed_all(pts)
    snap = run.pipeline.ledger.snapshot(run.pipeline.ledger.last_activity)
    check_invariants(snap)
    assert snap["tokens_total"] + snap["tokens_unobserved"] == sum(p.tokens for p in pts)
    # Nothing declared, nothing skipped: the steps' own time, the first one's launch, stalls (a step far slower
    # than the log's usual: the job's own time says it held), and the jumps.
    assert {k for k, v in snap["seconds"].items() if v} <= {"productive", "program_startup", "hang", "unobserved"}
    # A jump's time beyond the record's own steps is unobserved: a step more than 10x the usual increment past the
    # previous one, the usual being the most frequent so far (the smallest of a tie), of the first 3 until 3 are in.
    incs = [b.step - a.step for a, b in itertools.pairwise(pts)]

    def usual(seen: list[int]) -> int:
        return min(seen, key=lambda k: (-seen.count(k), k))

    jumps = []
    for i, (k, p) in enumerate(zip(incs, pts[1:], strict=True)):
        u = usual(incs[:max(i + 1, 3)])
        if k > 10 * u:
            jumps.append((k - u) * p.step_seconds)
    assert snap["seconds"]["unobserved"] == pytest.approx(math.fsum(jumps), abs=1e-6)
    assert snap["unobserved_gaps"]["count"] == len(jumps)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pts=logs())
def test_replay_through_the_service_books_what_analyze_books(r: redis.Redis, pts: list[LogPoint]) -> None:
    r.flushdb()
    replay("generated.log", r, run="plog", points=pts)
    svc = DetectorService(r, consumer="plog", snapshot_interval=0.0, hang_factory=lambda: HangDetector())
    for _ in range(50):
        if svc.run_once(block_ms=10) == 0:
            break
    svc._tick(svc.clock() + 10)
    live = json.loads(r.get(run_keys("plog").ledger_latest))
    ledger = OfflineRun().feed_all(pts).pipeline.ledger
    offline = ledger.snapshot(ledger.last_activity)
    check_invariants(live)
    for k in ("steps_done", "steps_good", "tokens_total", "tokens_good", "tokens_unobserved", "unobserved_gaps"):
        assert live[k] == offline[k], k
    for k in ("wall_s", "observed_s", "step_s", "throughput_tok_s", "goodput_tok_s", "goodput_pct"):
        assert live[k] == pytest.approx(offline[k], rel=1e-9, abs=1e-5), k
    assert live["seconds"] == pytest.approx(offline["seconds"], abs=1e-5)
    for w in live["rates"]:
        got, want = live["rates"][w], offline["rates"][w]
        assert [k for k, v in got.items() if v is None] == [k for k, v in want.items() if v is None], w
        assert {k: v for k, v in got.items() if v is not None} == pytest.approx(
            {k: v for k, v in want.items() if v is not None}, rel=1e-6, abs=1e-6), w
    assert (live["progress"] is None) == (offline["progress"] is None)
    if live["progress"] is not None:
        assert live["progress"]["loss_drop"] == offline["progress"]["loss_drop"]
        assert live["progress"]["tokens_good"] == offline["progress"]["tokens_good"]
