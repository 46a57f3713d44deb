"""Network anomaly per node (detectors/network.py) through the real detector service on a real redis-server: the
exact onset and end of one node's slow collective, and no finding for a straggler, a whole-job communication rise or
a job on one node."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import redis

from trainhealth.anomaly import Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.incidents import badput
from trainhealth.detectors.network import NetworkDetector, collective_seconds
from trainhealth.detectors.service import DetectorService

T0 = 1_800_000_000.0
#: Seconds of the step outside sections and collective (optimizer, launch gaps).
REST_S = 0.05


def two_nodes(r: int) -> str:
    return "node-a" if r < 8 else "node-b"


def push(client: redis.Redis, run: str, world: int, host: Callable[[int], str], steps: int,
         busy: Callable[[int, int], float], collective: Callable[[int, int], float | None]) -> None:
    """Write a run as its collectors would: each rank's ``run_start`` (with its host), then its step records, 5 to
    an entry. Rank ``r`` at step ``s`` spends ``busy(r, s)`` s in its sections and ``collective(r, s)`` s in the
    collective itself (None: it does not time one); its timed ``allreduce`` section also holds its wait for the
    slowest rank; every rank's step lasts the slowest rank's sections plus the longest collective plus
    :data:`REST_S`."""
    client.hset(f"th:{{{run}}}:meta", mapping={"world_size": world, "status": "running"})
    client.zadd("th:runs", {run: T0})
    for r in range(world):
        client.xadd(f"th:{{{run}}}:events", {"kind": "run_start", "rank": r, "t": T0 + r * 1e-3, "inc": T0,
                                              "host": host(r), "pid": 100 + r, "world_size": world},
                    id=f"1-{r + 1}")
    t, recs = T0 + 10.0, {r: [] for r in range(world)}
    seq = 2
    for s in range(steps):
        b = [busy(r, s) for r in range(world)]
        c = [collective(r, s) for r in range(world)]
        dur = max(b) + max(x or 0.0 for x in c) + REST_S
        t += dur
        for r in range(world):
            rec = {"rank": r, "step": s, "inc": T0, "t": round(t, 6), "dur": round(dur, 6),
                   "sec.forward_backward": round(b[r], 6), "loss": 3.0 + 0.01 * ((s * 13 + r) % 7), "tokens": 1000}
            if c[r] is not None:
                rec["sec.allreduce"] = round(c[r] + max(b) - b[r], 6)
            recs[r].append(rec)
        if len(recs[0]) == 5 or s == steps - 1:
            for r in range(world):
                client.xadd(f"th:{{{run}}}:steps", {"rank": r, "n": len(recs[r]), "recs": json.dumps(recs[r])},
                            id=f"{seq}-{r}")
                recs[r] = []
            seq += 1


def serve(client: redis.Redis) -> None:
    svc = DetectorService(client, consumer="net", clock=lambda: T0 + 100_000,
                          hang_factory=lambda: HangDetector(floor_s=1e9))
    for _ in range(200):
        if svc.run_once(block_ms=20) == 0:
            break


def stored(client: redis.Redis, run: str, key: str) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in client.hgetall(f"th:{{{run}}}:{key}").items()}


def jitter(r: int, s: int) -> float:
    """A deterministic few milliseconds, different per rank and step."""
    return 0.001 * ((s * 7 + r * 3) % 5)


def test_one_nodes_slow_collective_is_a_network_anomaly_on_that_node(r: redis.Redis, valid_run) -> None:
    push(r, "net", 16, two_nodes, 200, busy=lambda rk, s: 0.8 + jitter(rk, s),
         collective=lambda rk, s: (0.4 if rk >= 8 and 40 <= s < 120 else 0.1) + jitter(rk, s + 1))
    serve(r)
    anomalies = stored(r, "net", "anomalies")
    # Every rank waits for node-b's collectives: the job's steps are longer, a throughput drop it causes.
    assert sorted(anomalies) == ["network_slow:node-b:40:0", "throughput_drop:*:40:0"]
    a = anomalies["network_slow:node-b:40:0"]
    assert (a["kind"], a["severity"], a["status"], a["step"], a["end_step"], a["ranks"], a["hosts"]) == (
        "network_slow", "warning", "resolved", 40, 119, list(range(8, 16)), ["node-b"])
    ev = a["evidence"]
    # Node-b's collective 0.402 s (median) of a 1.258 s step (0.804 s sections, 0.404 s slowest collective, 0.05 s
    # rest), node-a's 0.102 s: exactly the collective each was given, the wait for the slowest rank taken out.
    assert {k: ev[k] for k in ("node_share", "others_share", "excess_share", "node_comm_s", "others_comm_s",
                               "step_s", "high_ranks", "n_ranks", "timed_ranks", "windows", "recovered_share",
                               "recovered_others_share")} == {
        "node_share": 0.3196, "others_share": 0.0811, "excess_share": 0.2385, "node_comm_s": 0.402,
        "others_comm_s": 0.102, "step_s": 1.258, "high_ranks": 8, "n_ranks": 8, "timed_ranks": 8, "windows": 4,
        "recovered_share": 0.1065, "recovered_others_share": 0.1065}
    log = [(f[b"transition"].decode(), f[b"id"].decode(), json.loads(f[b"json"])["message"])
           for _, f in r.xrange("th:{net}:anomaly_log")]
    assert [x[:2] for x in log if x[1].startswith("network")] == [
        ("opened", "network_slow:node-b:40:0"), ("resolved", "network_slow:node-b:40:0")]
    net = [x[2] for x in log if x[1].startswith("network")]
    assert net[0] == (
        "node-b (ranks 8–15): 32.0% of step time in communication vs 8.1% on the other nodes since step 40 (8 of "
        "its 8 ranks; 300.0 ms more a step, 23.8% of the job's time: every rank waits for the slowest collective); "
        "its network, not its GPUs: check the node's NIC / InfiniBand link (`ibstat`: state Active, the expected "
        "rate; `ibv_devinfo`, link error counters), rerun with NCCL_DEBUG=INFO to see the transport it picked (a "
        "fall-back to sockets or a missing GPUDirect RDMA), and compare `ib_write_bw` from node-b with a healthy "
        "node's")
    assert net[1] == ("node-b's ranks spent more of the step in communication than the other nodes' from step 40 "
                         "to 119; back to 10.7% vs 10.7% on the other nodes")
    incidents = stored(r, "net", "incidents")
    # The drop it causes joins its incident (priced by the drop: 0.3 s a step over steps 40-119).
    assert sorted(incidents) == ["inc:network_slow:node-b:40:0"]
    inc = incidents["inc:network_slow:node-b:40:0"]
    assert (inc["title"], inc["severity"], inc["status"], inc["anomalies"], inc["badput_s"]) == (
        "Network slow on node node-b (ranks 8–15), costing throughput", "warning", "resolved",
        ["network_slow:node-b:40:0", "throughput_drop:*:40:0"], 24.0)
    # Its advice: replace node-b (a restart without it pays back in at least 0.35 h), dismissed once it recovered.
    rec = stored(r, "net", "recommendations")[inc["recommendation"]]
    assert (inc["recommendation"], rec["action"], rec["exclude_hosts"], rec["cost"]["break_even_h"],
            rec["status"], rec["history"][-1]["note"]) == (
        "rec:network_slow:node-b:40:0", "replace_node", ["node-b"], 0.35, "dismissed",
        "the network_slow is over (step 119)")
    valid_run(r, "net")


def test_a_straggler_makes_the_others_wait_it_is_no_network_anomaly(r: redis.Redis) -> None:
    push(r, "strag", 16, two_nodes, 200, busy=lambda rk, s: (1.2 if rk == 5 and 40 <= s < 120 else 0.8) + jitter(rk, s),
         collective=lambda rk, s: 0.1 + jitter(rk, s + 1))
    serve(r)
    # Its cost is the straggler's (the throughput drop it causes), not the network's.
    assert sorted(stored(r, "strag", "anomalies")) == ["straggler:5:40:0", "throughput_drop:*:40:0"]


def test_a_rise_on_every_node_is_the_whole_jobs_not_a_nodes(r: redis.Redis) -> None:
    push(r, "alln", 16, two_nodes, 200, busy=lambda rk, s: 0.8 + jitter(rk, s),
         collective=lambda rk, s: (0.4 if 40 <= s < 120 else 0.1) + jitter(rk, s + 1))
    serve(r)
    found = stored(r, "alln", "anomalies")
    assert not [i for i in found if i.startswith("network_slow")]
    # The job-wide slowdown is the throughput detector's.
    assert [(a["kind"], a["step"]) for a in found.values()] == [("throughput_drop", 40)]


def test_a_job_on_one_node_is_not_judged(r: redis.Redis) -> None:
    push(r, "one", 8, lambda rk: "node-a", 200, busy=lambda rk, s: 0.8 + jitter(rk, s),
         collective=lambda rk, s: (0.4 if rk >= 4 and 40 <= s < 120 else 0.1) + jitter(rk, s + 1))
    serve(r)
    assert not [i for i in stored(r, "one", "anomalies") if i.startswith("network_slow")]


def test_untimed_collectives_are_the_rest_of_the_step_and_name_no_node() -> None:
    """Without a timed collective every rank's is the step less the slowest rank's sections: the same on every node,
    so a longer step flags no node."""
    hosts = {rk: two_nodes(rk) for rk in range(16)}
    det = NetworkDetector(hosts)
    found = []
    for s in range(200):
        busy = tuple(0.8 + jitter(rk, s) for rk in range(16))
        dur = max(busy) + (0.4 if 40 <= s < 120 else 0.1)
        found += det.update(StepAggregate(s, 0, T0, T0 + s, T0 + s + dur, None, None, None, None, None, 16, busy, 0.0))
    assert found == []
    b = np.array([[0.8, 0.9]])
    assert collective_seconds(b, np.full((1, 2), np.nan), np.array([1.25])).round(6).tolist() == [[0.35, 0.35]]


def test_severity_follows_the_share_of_the_job_lost() -> None:
    """Below THROUGHPUT_WARNING_LOSS (4 %) of the step lost the node is info; growing past it, a warning (a
    transition)."""
    hosts = {rk: two_nodes(rk) for rk in range(16)}
    det = NetworkDetector(hosts)
    got = []
    for s in range(140):
        extra = 0.0 if s < 40 else (0.035 if s < 80 else 0.2)
        busy = tuple(0.8 + jitter(rk, s) for rk in range(16))
        comm = tuple(0.1 + (extra if rk >= 8 else 0.0) + max(busy) - b for rk, b in enumerate(busy))
        dur = max(busy) + 0.1 + extra
        got += [(a.severity, a.status, a.step, a.evidence["excess_share"]) for a in det.update(
            StepAggregate(s, 0, T0, 0.0, dur, None, None, None, None, None, 16, busy, 0.0, comm=comm))]
    # 0.035 s more of a 0.939 s step; then 0.2 s more of a 1.104 s step (node-a's 0.1 s a step less).
    assert got == [("info", "active", 40, 0.0373), ("warning", "active", 40, 0.1812)]
    assert badput(det.open, step=139) == (20.0, round(0.1812 * 3600, 1))
    assert badput([Anomaly("network_slow", "warning", 40, "", end_step=59,
                           evidence={"node_comm_s": 0.3, "others_comm_s": 0.1, "excess_share": 0.2})]) == (4.0, 720.0)
