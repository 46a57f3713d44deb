"""trainhealth on a local Redis Cluster (3 primaries, 3 replicas) and behind Sentinel: runs on every primary through
the detector service, the dashboard's reads and the alert worker's intake; a primary failing over mid-run (a
coordinated ``CLUSTER FAILOVER`` and a SIGKILL) loses no record a Monitor reported delivered, and none is read twice.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from trainhealth import Monitor
from trainhealth.alerts.config import AlertsConfig, parse
from trainhealth.alerts.intake import Intake
from trainhealth.connection import connect, is_cluster, read_groups
from trainhealth.dashboard import data
from trainhealth.detectors.service import DetectorService
from trainhealth.keys import ALERTS_OUTBOX, RUNS, run_keys

PYTHON = sys.executable
T0 = 1_800_000_000.0


def runs_on_each_primary(client: Any, prefix: str) -> list[str]:
    """Three run ids whose keys live on three different primaries, in the order of their primaries' ports."""
    by_port: dict[int, str] = {}
    for i in range(1000):
        run = f"{prefix}-{i}"
        by_port.setdefault(client.get_node_from_key(run_keys(run).steps).port, run)
        if len(by_port) == 3:
            return [by_port[p] for p in sorted(by_port)]
    raise AssertionError("no run ids found on 3 primaries")


def write_run(url: str, run: str, steps: range, *, spike_at: int | None = None, slow_rank: int | None = None) -> None:
    """A scripted 2-rank run through real Monitors on ``url`` (each builds its own client from it), 1 s steps."""
    mons = [Monitor(run, redis_url=url, rank=r, world_size=2, host=f"node-{r}", started_at=T0, flush_interval=0.01)
            for r in range(2)]
    for s in steps:
        for r, mon in enumerate(mons):
            loss = 9.0 if s == spike_at else 3.0 + 0.001 * ((s * 7 + r) % 5)
            mon._sections = {"data": 0.01, "forward_backward": 0.2 if r == slow_rank else 0.1}
            mon.log_step(s, loss=loss, grad_norm=1.0, lr=1e-4, tokens=1000, timestamp=T0 + 10 + s)
    for mon in mons:
        assert mon.flush(20)
        mon._sender.stop(1)


def learning(step: int, rank: int) -> float:
    """A loss that goes down as a healthy run's does, with a little noise: no detector has anything to say."""
    return 4.0 * 0.999 ** step + 0.001 * ((step * 7 + rank) % 5)


def alerts_config() -> AlertsConfig:
    os.environ["TH_TEST_WEBHOOK_SECRET"] = "whsec-cluster"
    return parse({"route": {"receivers": ["bot"]},
                  "sinks": {"bot": {"type": "webhook", "url": "http://127.0.0.1:9/hook",
                                    "secret_env": "TH_TEST_WEBHOOK_SECRET"}}}, "test.toml")


def ledger_steps(client: Any, run: str) -> int:
    raw = client.get(run_keys(run).ledger_latest)
    return json.loads(raw)["steps_done"] if raw else 0


def agg_ids(client: Any, run: str) -> list[str]:
    return [i.decode() for i, _ in client.xrange(run_keys(run).agg)]


@pytest.fixture
def cluster(cluster_url: str) -> Iterator[Any]:
    client = connect(cluster_url)
    yield client
    client.close()


def test_runs_on_every_primary_through_the_service_the_dashboard_reads_and_the_alert_intake(
        cluster_url: str, cluster: Any) -> None:
    assert is_cluster(cluster) and len(cluster.get_primaries()) == 3
    spiky, slow, calm = runs_on_each_primary(cluster, "job")
    write_run(cluster_url, spiky, range(90), spike_at=70)
    write_run(cluster_url, slow, range(90), slow_rank=1)
    write_run(cluster_url, calm, range(90))
    service = DetectorService(connect(cluster_url), consumer="cl", block_ms=20)
    for _ in range(50):
        if service.run_once(block_ms=20) == 0:
            break
    service.beat()
    for run in (spiky, slow, calm):
        assert agg_ids(cluster, run) == [f"1-{s}" for s in range(90)]
        assert json.loads(cluster.get(run_keys(run).ledger_latest))["steps_done"] == 90
    anomalies = {run: sorted(k.decode() for k in cluster.hkeys(run_keys(run).anomalies)) for run in (spiky, slow, calm)}
    assert anomalies == {spiky: ["loss_spike:*:70:0"], slow: ["straggler:1:0:0"], calm: []}

    # The dashboard's reads: the run board (a script per run in one pipeline), heartbeats scanned on every primary.
    board = data.run_board(cluster)
    assert sorted(board["run"]) == sorted([spiky, slow, calm]) and set(board["step"]) == {89}
    assert [b["consumer"] for b in data.service_heartbeats(cluster)] == ["cl"]
    assert list(data.recent_steps(cluster, slow, count=200)["step"]) == list(range(90))
    assert list(data.anomalies(cluster, spiky)["id"]) == ["loss_spike:*:70:0"]

    # The alert worker's intake reads the three runs' logs (three slots) and commits to the {alerts} slot.
    now = time.time()
    clock = [now]
    intake = Intake(cluster, alerts_config(), consumer="w1", clock=lambda: clock[0])
    assert intake.run_once() == []
    clock[0] = now + 31  # past the group's group_wait
    (note,) = intake.run_once()
    assert [a.key for a in note.firing] == [f"{slow}/straggler:1:0:0"]
    (entry,) = cluster.xrange(ALERTS_OUTBOX)
    assert entry[1][b"sink"] == b"bot"
    for run in (spiky, slow, calm):
        assert cluster.xpending(run_keys(run).anomaly_log, "th-alerts")["pending"] == 0
    assert set(intake.cursors) == {spiky, slow}


def test_read_groups_reads_streams_of_many_slots_and_waits_for_the_first_entry(cluster: Any) -> None:
    streams = {run_keys(f"rg-{i}").events: ">" for i in range(6)}
    for s in streams:
        cluster.xgroup_create(s, "g", id="0", mkstream=True)
    assert len({cluster.keyslot(s) for s in streams}) == 6
    t = time.monotonic()
    assert read_groups(cluster, "g", "c", streams, count=10, block_ms=300) == []
    assert 0.3 <= time.monotonic() - t < 1.0  # waited for the whole block, polling

    def later() -> None:
        time.sleep(0.2)
        cluster.xadd(run_keys("rg-4").events, {"k": "v"})

    threading.Thread(target=later).start()
    t = time.monotonic()
    reply = read_groups(cluster, "g", "c", streams, count=10, block_ms=5000)
    assert time.monotonic() - t < 1.0
    assert [(s.decode(), [f for _, f in e]) for s, e in reply] == [(run_keys("rg-4").events, [{b"k": b"v"}])]


@pytest.mark.parametrize("how", ["CLUSTER FAILOVER", "SIGKILL"])
def test_a_primary_failing_over_mid_run_loses_no_acknowledged_record_and_none_is_read_twice(
        how: str, own_cluster: Any) -> None:
    cluster = own_cluster
    serve = None
    try:
        url = cluster.url
        run, steps, world = "fo", 600, 2
        primary = cluster.primary_of(run_keys(run).steps)
        (replica,) = cluster.replicas_of(primary)
        serve = subprocess.Popen([PYTHON, "-m", "trainhealth", "serve", "--redis-url", url, "--consumer", "fo"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        mons = [Monitor(run, redis_url=url, rank=r, world_size=world, started_at=T0, flush_interval=0.01,
                        heartbeat_interval=0.5, close_timeout=60) for r in range(world)]
        progress = [0]

        def train() -> None:  # 200 steps/s: the failover lands in the middle of a stream of writes
            for s in range(steps):
                for r, mon in enumerate(mons):
                    mon.log_step(s, loss=learning(s, r), grad_norm=1.0, lr=1e-4, tokens=1000, timestamp=T0 + 10 + s)
                progress[0] = s
                time.sleep(0.005)

        job = threading.Thread(target=train)
        job.start()
        while progress[0] < steps // 3:
            time.sleep(0.01)
        t_fail = time.time()
        if how == "SIGKILL":
            cluster.procs[primary].kill()
        else:
            cluster.node(replica).execute_command("CLUSTER FAILOVER")
        deadline = time.monotonic() + 30
        while cluster.primary_of(run_keys(run).steps) != replica:
            assert time.monotonic() < deadline, "the replica never took over"
            time.sleep(0.05)
        t_promoted = time.time()
        job.join()
        assert [mon.close() for mon in mons] == [True] * world  # each Monitor: every record delivered
        t_closed = time.time()

        client = connect(url)
        deadline = time.monotonic() + 60
        while len(agg_ids(client, run)) < steps and time.monotonic() < deadline:
            time.sleep(0.05)
        t_done = time.time()
        while ledger_steps(client, run) < steps and time.monotonic() < deadline:  # snapshots every 2 s
            time.sleep(0.1)
        # Every step once, complete with both ranks, in the first generation: no record lost, none read twice (a
        # batch fed again would start a new generation as a rollback would, and count its tokens twice).
        aggs = client.xrange(run_keys(run).agg)
        assert [i.decode() for i, _ in aggs] == [f"1-{s}" for s in range(steps)]
        assert {f[b"n_ranks"] for _, f in aggs} == {str(world).encode()}
        snap = json.loads(client.get(run_keys(run).ledger_latest))
        # Every step's tokens but the first step's: its time is the launch's start-up (docs/goodput.md).
        assert (snap["steps_done"], snap["tokens_total"], snap["restarts"]) == (steps, (steps - 1) * world * 1000, 0)
        assert client.hkeys(run_keys(run).anomalies) == []
        # What the stream holds: every (rank, step) written; a batch re-sent after a lost reply shows twice here.
        written: dict[tuple[int, int], int] = {}
        times = []
        for eid, f in client.xrange(run_keys(run).steps):
            times.append(int(eid.split(b"-")[0]) / 1000)
            for rec in json.loads(f[b"recs"]):
                written[(rec["rank"], rec["step"])] = written.get((rec["rank"], rec["step"]), 0) + 1
        assert sorted(written) == [(r, s) for r in range(world) for s in range(steps)]
        gap = max(b - a for a, b in itertools.pairwise(times))
        print(f"\n{how}: replica primary after {t_promoted - t_fail:.2f} s; longest pause in the run's writes "
              f"{gap:.2f} s; Monitors closed {t_closed - t_fail:.2f} s and the service had every step "
              f"{t_done - t_fail:.2f} s after the failure; records written twice: "
              f"{sum(n - 1 for n in written.values())}")
        client.close()
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            out, _ = serve.communicate(timeout=30)
            assert serve.returncode == 0, out


def test_a_run_through_serve_behind_sentinel_survives_its_primary_dying(sentinel_setup: Any) -> None:
    sentinel = sentinel_setup
    serve = None
    try:
        url = sentinel.url
        client = connect(url)
        assert isinstance(client, redis.Redis) and client.ping()
        serve = subprocess.Popen([PYTHON, "-m", "trainhealth", "serve", "--redis-url", url, "--consumer", "sen"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run, steps = "sen", 400
        mons = [Monitor(run, redis_url=url, rank=r, world_size=2, started_at=T0, flush_interval=0.01,
                        heartbeat_interval=0.5, close_timeout=60) for r in range(2)]
        t_fail = None
        for s in range(steps):
            for r, mon in enumerate(mons):
                mon.log_step(s, loss=learning(s, r), grad_norm=1.0, lr=1e-4, tokens=1000, timestamp=T0 + 10 + s)
            if s == steps // 3:
                t_fail = time.time()
                sentinel.kill_primary()
            time.sleep(0.005)
        assert [mon.close() for mon in mons] == [True, True]
        assert sentinel.primary_port() == sentinel.ports[1]  # the replica took over
        deadline = time.monotonic() + 60
        while len(agg_ids(client, run)) < steps and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"\nSentinel, primary SIGKILLed: the service had every step {time.time() - t_fail:.2f} s after")
        assert agg_ids(client, run) == [f"1-{s}" for s in range(steps)]
        while ledger_steps(client, run) < steps and time.monotonic() < deadline:
            time.sleep(0.1)
        snap = json.loads(client.get(run_keys(run).ledger_latest))
        assert (snap["steps_done"], snap["restarts"]) == (steps, 0)
        assert client.zrange(RUNS, 0, -1) == [run.encode()]
        client.close()
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            out, _ = serve.communicate(timeout=30)
            assert serve.returncode == 0, out
