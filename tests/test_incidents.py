"""Incidents: one per root cause with one recommendation, from scripted runs through the real detector service."""

from __future__ import annotations

import json
from typing import Any

import redis

from trainhealth import Monitor, recommendations
from trainhealth.anomaly import Anomaly
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.incidents import Incident, IncidentGrouper, group
from trainhealth.detectors.offline import OfflineRun
from trainhealth.detectors.service import DetectorService
from trainhealth.logpoint import LogPoint

T0 = 1_800_000_000.0
SUPERSEDED = ("superseded by rec:divergence:*:400:0 (the divergence at step 400), the one recommendation of incident "
              "inc:loss_spike:*:400:0")


class Clock:
    """A clock the test moves (the service reads the run's status every 5 s of it)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def drain(svc: DetectorService, rounds: int = 50) -> None:
    for _ in range(rounds):
        if svc.run_once(block_ms=10) == 0:
            break


def incidents(r: redis.Redis, run: str) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in r.hgetall(f"th:{{{run}}}:incidents").items()}


def recs(r: redis.Redis, run: str) -> dict[str, dict]:
    return {d["id"]: d for d in recommendations.load(r, run)}


def diverging_run(r: redis.Redis, run: str) -> Monitor:
    """One rank, 1 s steps: the loss jumps from 3 to 6 at step 400 with a 30x grad norm and stays (a divergence
    100 steps later); checkpoints after every 100th step."""
    mon = Monitor(run, client=r, rank=0, world_size=1, host="node-0", started_at=T0, gpu_hour_usd=2.0,
                  flush_interval=0.01)
    for s in range(560):
        loss = (3.0 if s < 400 else 6.0) + 0.001 * (s % 7)
        grad_norm = 30.0 if s == 400 else 1.0 + 0.01 * (s % 5)
        mon.log_step(s, loss=loss, grad_norm=grad_norm, tokens=1000, consumed_samples=(s + 1) * 8,
                     timestamp=T0 + 10 + s)
        if (s + 1) % 100 == 0:
            mon.checkpoint_saved(s, 1.0)
    assert mon.flush(10)
    return mon


LOSS_INCIDENT = {
    "id": "inc:loss_spike:*:400:0", "kind": "loss_spike", "title": "Loss spike at step 400 that became a divergence",
    "severity": "critical", "status": "active", "onset_step": 400, "onset_t": T0 + 410, "end_step": None, "gen": 0,
    "ranks": [], "hosts": [], "anomalies": ["loss_spike:*:400:0", "grad_norm_spike:*:400:0", "divergence:*:400:0"],
    "recommendation": "rec:divergence:*:400:0", "badput_s": None, "badput_s_per_hour": None,
    # Where the data was when step 400 began: after step 399, 8 samples a step (the job logs consumed_samples).
    "data_position": {"step": 399, "consumed_samples": 3200, "batch_index": None, "sample_indices": None,
                      "samples_entry": None},
    "first_seen": T0 + 1000, "last_seen": T0 + 1000,
}


def test_a_loss_spike_its_grad_norm_spike_and_the_divergence_are_one_incident_with_one_recommendation(
        r: redis.Redis, valid_run) -> None:
    mon = diverging_run(r, "div")
    svc = DetectorService(r, consumer="t", clock=Clock(T0 + 1000), hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    anomalies = {k.decode(): json.loads(v) for k, v in r.hgetall("th:{div}:anomalies").items()}
    assert sorted(anomalies) == ["divergence:*:400:0", "grad_norm_spike:*:400:0", "loss_spike:*:400:0"]
    assert incidents(r, "div") == {"inc:loss_spike:*:400:0": LOSS_INCIDENT}
    stored = recs(r, "div")
    assert sorted(stored) == ["rec:divergence:*:400:0", "rec:loss_spike:*:400:0"]
    div, spike = stored["rec:divergence:*:400:0"], stored["rec:loss_spike:*:400:0"]
    assert (div["action"], div["status"], div["current_step"], "history" in div) == ("rollback", "proposed", 550, False)
    # The spike's advice stopped at its last refresh before the divergence took over (step 490), superseded.
    assert (spike["action"], spike["status"], spike["current_step"]) == ("rollback", "superseded", 490)
    assert spike["history"] == [{"t": T0 + 1000, "status": "superseded", "by": "trainhealth", "note": SUPERSEDED}]
    mon._sender.stop(1)
    counts = valid_run(r, "div")  # every record as its published schema says
    assert (counts["incident"], counts["recommendation"], counts["anomaly"]) == (1, 2, 3 + 5)


def test_a_straggler_and_the_throughput_drop_it_causes_are_one_incident_naming_rank_and_host(
        r: redis.Redis, valid_run) -> None:
    world = 16
    mons = [Monitor("slow", client=r, rank=k, world_size=world, host="node-a" if k < 8 else "node-b", started_at=T0,
                    flush_interval=0.01, gpu_hour_usd=2.0) for k in range(world)]
    t = T0 + 10
    for s in range(400):
        slow = s >= 200  # rank 13's sections take 1.6x from step 200: every step waits for it, 30 % longer
        step_s = (0.26 if slow else 0.2) * (1 + 0.01 * ((s * 7) % 5))
        t += step_s
        for k, mon in enumerate(mons):
            mon._sections = {"data": 0.01,
                             "forward_backward": 0.1 * (1.6 if k == 13 and slow else 1.0) * (1 + 0.01 * ((s + k) % 3))}
            mon.log_step(s, loss=3.0 + 0.001 * ((s * 7 + k) % 5), tokens=1000, step_s=step_s, timestamp=t)
    for mon in mons:
        assert mon.flush(10)
        mon._sender.stop(1)
    svc = DetectorService(r, consumer="t", clock=Clock(T0 + 1000), hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    drop = json.loads(r.hget("th:{slow}:anomalies", "throughput_drop:*:200:0"))
    assert (drop["evidence"]["before_s"], drop["evidence"]["after_s"], drop["evidence"]["lost_fraction"]) == (
        0.20400000000000001, 0.2652, 0.2308)
    assert incidents(r, "slow") == {"inc:straggler:13:200:0": {
        "id": "inc:straggler:13:200:0", "kind": "straggler",
        "title": "Rank 13 (node-b) is a straggler, costing throughput",
        "severity": "warning", "status": "active", "onset_step": 200, "onset_t": 1800000051.0599992, "end_step": None,
        "gen": 0, "ranks": [13], "hosts": ["node-b"], "anomalies": ["straggler:13:200:0", "throughput_drop:*:200:0"],
        "recommendation": "rec:straggler:13:200:0",
        # (0.2652 - 0.204) s more per step over the drop's 191 steps so far (200 to 390: an open incident's cost
        # is brought up to date every 10 steps); 23.08 % of every hour
        "badput_s": 11.689, "badput_s_per_hour": 830.9, "data_position": None,
        "first_seen": T0 + 1000, "last_seen": T0 + 1000}}
    assert [(d["id"], d["action"], d["status"]) for d in recommendations.load(r, "slow")] == [
        ("rec:straggler:13:200:0", "replace_node", "proposed")]
    assert valid_run(r, "slow")["incident"] == 1


def test_a_throughput_drop_seen_before_the_straggler_causing_it_moves_into_its_incident(r: redis.Redis) -> None:
    """Rank 13 turns 10 % slower at step 200 (the job's steps too: a drop, but no straggler yet), then 60 % at 300."""
    world = 16
    # Each rank's records are sent only when flushed, rank after rank: the stream's order, and with it what the
    # detectors see first, is the same on any machine.
    mons = [Monitor("late", client=r, rank=k, world_size=world, host="node-a" if k < 8 else "node-b", started_at=T0,
                    flush_interval=600.0) for k in range(world)]
    clock = Clock(T0 + 1000)
    svc = DetectorService(r, consumer="t", clock=clock, hang_factory=lambda: HangDetector(floor_s=1e9))
    t = T0 + 10

    def steps(first: int, last: int) -> None:
        nonlocal t
        for s in range(first, last):
            f = 1.6 if s >= 300 else 1.1 if s >= 200 else 1.0
            step_s = 0.2 * (1 + 0.01 * ((s * 7) % 5)) * (1.0 if s < 200 else 1.1 if s < 300 else 1.3)
            t += step_s
            for k, mon in enumerate(mons):
                busy = 0.1 * (f if k == 13 else 1.0) * (1 + 0.01 * ((s + k) % 3))
                mon._sections = {"data": 0.01, "forward_backward": busy}
                mon.log_step(s, loss=3.0 + 0.001 * ((s * 7 + k) % 5), tokens=1000, step_s=step_s, timestamp=t)
        for mon in mons:
            assert mon.flush(10)
        drain(svc)

    try:
        _late_drop_moves(r, mons, svc, clock, steps)
    finally:  # a failure must not leave senders writing into the next test's database
        for mon in mons:
            mon._sender.stop(1)


def _late_drop_moves(r: redis.Redis, mons: list[Monitor], svc: DetectorService, clock: Clock, steps: Any) -> None:
    steps(0, 300)
    alone = incidents(r, "late")
    assert {k: (v["title"], v["anomalies"], v["badput_s"], v["badput_s_per_hour"]) for k, v in alone.items()} == {
        # 0.0204 s more per step over steps 200-290 (its cost brought up to date every 10 steps)
        "inc:throughput_drop:*:200:0": ("Throughput dropped 9.1% at step 200", ["throughput_drop:*:200:0"], 1.856,
                                        327.2)}
    clock.t += 10
    steps(300, 400)
    # The straggler opened at step 339 with its onset at 300, inside the open drop: the drop joined it, and its own
    # incident is gone.
    assert {k: (v["title"], v["anomalies"], v["onset_step"], v["first_seen"], v["last_seen"])
            for k, v in incidents(r, "late").items()} == {
        "inc:straggler:13:300:0": ("Rank 13 (node-b) is a straggler, costing throughput",
                                   ["straggler:13:300:0", "throughput_drop:*:200:0"], 200, T0 + 1010, T0 + 1010)}


def hang_run(r: redis.Redis, run: str) -> list[Monitor]:
    mons = [Monitor(run, client=r, rank=k, world_size=2, host=f"node-{k}", started_at=T0, flush_interval=0.01)
            for k in range(2)]
    for s in range(30):
        for mon in mons:
            mon.log_step(s, loss=3.0 + 0.01 * (s % 7), timestamp=T0 + 10 + s)
        if s == 19:
            for mon in mons:
                mon.checkpoint_saved(s, 1.0)
    for mon in mons:
        assert mon.flush(10)
    return mons


def heartbeat(r: redis.Redis, run: str, rank: int, t: float, step: int, step_t: float) -> None:
    """A collector's heartbeat (its memory and GPU not sampled)."""
    r.hset(f"th:{{{run}}}:hb", str(rank), json.dumps({"t": t, "step": step, "step_t": step_t, "phase": "train",
                                                      "host": f"node-{rank}", "pid": 100 + rank, "inc": T0,
                                                      "mem": None, "gpu": None}))


def test_a_stop_of_the_job_is_one_incident_and_its_advice_closes_when_the_job_recovers(r: redis.Redis,
                                                                                        valid_run) -> None:
    mons = hang_run(r, "hg")
    clock = Clock(T0 + 200)
    heartbeat(r, "hg", 0, clock.t - 2, 29, T0 + 39)  # rank 0 alive, waiting
    heartbeat(r, "hg", 1, T0 + 40, 29, T0 + 39)  # rank 1 silent since just after step 29
    svc = DetectorService(r, consumer="h", clock=clock, hang_factory=lambda: HangDetector(floor_s=60))
    drain(svc)
    svc._tick(clock.t)
    hung = {
        "id": "inc:hang:*:29:0", "kind": "hang", "title": "Job hung at step 29, waiting on rank 1 (node-1)",
        "severity": "critical", "status": "active", "onset_step": 29, "onset_t": T0 + 39, "end_step": None, "gen": 0,
        "ranks": [0, 1], "hosts": ["node-0", "node-1"], "anomalies": ["hang:*:29:0", "dead_rank:*:29:0"],
        "recommendation": "rec:hang:*:29:0", "badput_s": 161.0, "badput_s_per_hour": 3600.0,
        "data_position": None, "first_seen": T0 + 200, "last_seen": T0 + 200}
    assert incidents(r, "hg") == {"inc:hang:*:29:0": hung}
    assert valid_run(r, "hg")["job-state"] == 1
    assert [(d["id"], d["action"], d["status"]) for d in recommendations.load(r, "hg")] == [
        ("rec:hang:*:29:0", "dump_stacks", "proposed")]
    # Both ranks go on: the hang resolves at step 30, rank 1 is heard from again; the advice is closed, saying why.
    clock.t += 30
    for s in range(30, 40):
        for mon in mons:
            mon.log_step(s, loss=3.0 + 0.01 * (s % 7), timestamp=clock.t - 45 + s)
    for mon in mons:
        assert mon.flush(10)
        mon._sender.stop(1)
    for rank in (0, 1):
        heartbeat(r, "hg", rank, clock.t - 1, 39, clock.t - 6)
    drain(svc)
    svc._tick(clock.t)
    assert incidents(r, "hg") == {"inc:hang:*:29:0": {
        **hung, "status": "resolved", "end_step": 39, "badput_s": 176.0, "last_seen": T0 + 230}}
    [rec] = recommendations.load(r, "hg")
    assert (rec["id"], rec["status"], rec["history"]) == ("rec:hang:*:29:0", "dismissed", [
        {"t": T0 + 230, "status": "dismissed", "by": "trainhealth", "note": "the job recovered (step 30)"}])
    assert valid_run(r, "hg")["incident"] == 1


def test_when_the_run_ends_open_advice_is_dismissed_saying_so(r: redis.Redis, valid_run) -> None:
    mon = diverging_run(r, "end")
    clock = Clock(T0 + 1000)
    svc = DetectorService(r, consumer="t", clock=clock, hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    assert recs(r, "end")["rec:divergence:*:400:0"]["status"] == "proposed"
    mon.close()  # run_end, and the run's status "finished"
    clock.t += 10  # the service reads the status again
    drain(svc)
    stored = recs(r, "end")
    div = stored["rec:divergence:*:400:0"]
    assert (div["status"], div["history"]) == ("dismissed", [
        {"t": T0 + 1010, "status": "dismissed", "by": "trainhealth", "note": "the run ended at step 559 (finished)"}])
    spike = stored["rec:loss_spike:*:400:0"]
    assert (spike["status"], [h["status"] for h in spike["history"]]) == ("superseded", ["superseded"])
    # The divergence describes the model: it and its incident stay open; only the advice to act on the run is closed.
    assert incidents(r, "end") == {"inc:loss_spike:*:400:0": LOSS_INCIDENT}
    assert valid_run(r, "end")["recommendation"] == 2


def test_a_restarted_service_writes_no_duplicate_incident_and_keeps_the_statuses(r: redis.Redis, valid_run) -> None:
    mon = diverging_run(r, "rs")
    svc = DetectorService(r, consumer="a", clock=Clock(T0 + 1000), hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc)
    recommendations.set_status(r, "rs", "rec:divergence:*:400:0", "acknowledged", by="sre", note="on it")
    before = {key: r.hgetall(f"th:{{rs}}:{key}") for key in ("incidents", "recommendations", "anomalies")}
    log_len = r.xlen("th:{rs}:anomaly_log")
    # The service dies; another process takes the run over and rebuilds it from the streams, at a later time (any
    # rewrite would change a first_seen, last_seen or updated_at).
    r.delete("th:{rs}:owner")
    svc2 = DetectorService(r, consumer="b", clock=Clock(T0 + 2000), hang_factory=lambda: HangDetector(floor_s=1e9))
    drain(svc2)
    svc2._tick(T0 + 2000)
    assert list(svc2.runs) == ["rs"]
    assert {key: r.hgetall(f"th:{{rs}}:{key}") for key in before} == before
    assert r.xlen("th:{rs}:anomaly_log") == log_len
    assert incidents(r, "rs") == {"inc:loss_spike:*:400:0": LOSS_INCIDENT}
    assert {k: d["status"] for k, d in recs(r, "rs").items()} == {
        "rec:divergence:*:400:0": "acknowledged", "rec:loss_spike:*:400:0": "superseded"}
    mon._sender.stop(1)
    assert valid_run(r, "rs")["recommendation"] == 2  # a person's move (trainhealth advise) too


# -- the grouper alone ----------------------------------------------------------------------------------------
def test_other_anomalies_are_their_own_incidents_and_a_drop_after_its_straggler_ended_is_too() -> None:
    straggler = Anomaly("straggler", "warning", 100, "rank 3 is slow", ranks=(3,), hosts=("node-a",), end_step=180,
                        status="resolved")
    drop = Anomaly("throughput_drop", "info", 200, "throughput dropped",
                   evidence={"before_s": 1.0, "after_s": 1.03, "lost_fraction": 0.0291, "span_steps": 50})
    slow = Anomaly("slow_step", "info", 150, "step 150 was slow", end_step=151, status="resolved",
                   evidence={"lost_s": 4.5})
    storm = Anomaly("restart_storm", "critical", 900, "3 restarts in 1 h", gen=3)
    got = group([straggler, drop, slow, storm])
    assert {k: (i.kind, i.title, i.status, i.end_step, i.anomalies, i.badput_s, i.badput_s_per_hour)
            for k, i in got.items()} == {
        "inc:straggler:3:100:0": ("straggler", "Rank 3 (node-a) is a straggler, costing throughput", "resolved", 180,
                                  ("straggler:3:100:0", "slow_step:*:150:0"), 4.5, None),
        "inc:throughput_drop:*:200:0": ("throughput_drop", "Throughput dropped 2.9% at step 200", "active", None,
                                        ("throughput_drop:*:200:0",), 1.5, 104.8),
        "inc:restart_storm:*:900:3": ("restart_storm", "Restart storm at step 900", "active", None,
                                      ("restart_storm:*:900:3",), None, None),
    }


def test_an_effect_moves_to_the_cause_that_opens_over_it_and_its_own_incident_is_removed() -> None:
    g = IncidentGrouper(step_time={250: 1250.0}.get)
    drop = Anomaly("throughput_drop", "warning", 250, "throughput dropped",
                   evidence={"before_s": 1.0, "after_s": 1.25, "lost_fraction": 0.2, "span_steps": 60})
    assert list(g.update([drop], t=1300.0)) == ["inc:throughput_drop:*:250:0"]
    node = Anomaly("slow_node", "warning", 240, "node-b is slow", ranks=(8, 9), hosts=("node-b",), scope="node-b")
    assert g.update([node], t=1400.0) == {
        "inc:slow_node:node-b:240:0": Incident(
            id="inc:slow_node:node-b:240:0", kind="slow_node", title="Node node-b is slow, costing throughput",
            severity="warning", status="active", onset_step=240, onset_t=1400.0, end_step=None, gen=0, ranks=(8, 9),
            hosts=("node-b",), anomalies=("slow_node:node-b:240:0", "throughput_drop:*:250:0"), recommendation=None,
            badput_s=15.0, badput_s_per_hour=720.0),
        "inc:throughput_drop:*:250:0": None}
    # Later states keep the membership; the incident resolves with its last member (no change until then).
    assert g.update([Anomaly("slow_node", "warning", 240, "", ranks=(8, 9), hosts=("node-b",), scope="node-b",
                             status="resolved", end_step=400)]) == {}
    done = g.update([Anomaly("throughput_drop", "warning", 250, "", status="resolved", end_step=410,
                             evidence={"before_s": 1.0, "after_s": 1.25, "lost_fraction": 0.2, "span_steps": 60})])
    [(iid, inc)] = done.items()
    assert (iid, inc.status, inc.end_step, inc.badput_s) == ("inc:slow_node:node-b:240:0", "resolved", 410, 40.25)


def test_the_offline_pipeline_reports_the_same_incident() -> None:
    points = [LogPoint(step=s, loss=(3.0 if s < 400 else 6.0) + 0.001 * (s % 7),
                       grad_norm=30.0 if s == 400 else 1.0 + 0.01 * (s % 5)) for s in range(560)]
    run = OfflineRun("off").feed_all(points)
    assert {k: (i.title, i.anomalies, i.recommendation) for k, i in run.incidents.items()} == {
        "inc:loss_spike:*:400:0": ("Loss spike at step 400 that became a divergence",
                                   ("loss_spike:*:400:0", "grad_norm_spike:*:400:0", "divergence:*:400:0"),
                                   "rec:divergence:*:400:0")}
