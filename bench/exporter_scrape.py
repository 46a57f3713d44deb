"""What a Prometheus scrape of the exporter costs at 100 runs x 1,024 ranks, beside reading the per-rank records.

Run: ``.venv/bin/python bench/exporter_scrape.py`` (64, 1,024 and 4,096 ranks x 100 runs, about a minute);
``--ranks 1024 --runs 100 --incidents 20`` for one size.

Per rank count it starts its own redis-server on a free port (no persistence; never 6379) and writes, for each run,
the keys the detector service leaves mid-run, in its own formats (docs/architecture.md): the meta (running), a
ledger snapshot (the last 16 ranks with dropped records), ``--incidents`` incidents (a fifth of them active), the
job's state, ``--agg`` entries of ``th:{run}:agg`` each with a ``busy`` list of every rank, the input streams with
the service's consumer group 20 entries behind (one read and not acknowledged) and a heartbeat per rank. The
exporter's collector (``detectors/exporter.py``) is then scraped in this process through prometheus_client's
``generate_latest``, ``--repeats`` times; nothing else reads or writes Redis meanwhile.

Per scrape: wall time (median), bytes Redis sent (``INFO stats`` ``total_net_output_bytes`` before and after,
the INFO reply itself subtracted), Redis CPU (``used_cpu_user + used_cpu_sys``) and the exposition's size and
series. Beside it, in the same run on the same data:

- *floor*: one ``PING`` per run in one pipeline (the round trips any per-run read costs);
- *per-rank read*: the same facts read the way a reader of the records would (``dashboard/data.py``'s
  ``processing_state`` and Runs page do): per run ``HGETALL`` of the heartbeats, ``XREVRANGE … COUNT 1`` of
  ``agg`` (its ``busy`` list whole), ``GET`` of the ledger and ``HVALS`` of the incidents, decoded in Python.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import redis
from prometheus_client import CollectorRegistry, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_throughput import RedisProc

from trainhealth.detectors.exporter import ExporterCollector
from trainhealth.keys import RUNS, SERVICES, run_keys

T0 = 1_800_000_000.0
CATEGORIES = ("productive", "program_startup", "data_loading", "straggler_wait", "skipped_steps", "checkpoint_save",
              "checkpoint_restore", "wasted_progress_from_disruption", "wasted_progress_from_rollback",
              "infrastructure_recovery_from_disruption", "custom", "hang", "idle")
KINDS = ("straggler", "loss_spike", "slow_node", "throughput_drop", "hang", "restart", "grad_norm_spike")


def snapshot(world: int, rng: random.Random) -> dict:
    seconds = {c: round(rng.uniform(0, 500), 6) for c in CATEGORIES}
    wall = sum(seconds.values())
    return {"t": T0 + wall, "started_at": T0, "wall_s": wall, "world_size": world, "gpu_hour_usd": 2.5,
            "last_step": 100_000, "steps_done": 100_100, "steps_good": 100_000, "restarts": 2,
            "tokens_total": 100_100 * 4096 * world, "tokens_good": 100_000 * 4096 * world, "step_s": wall * 0.9,
            "throughput_tok_s": 1e6, "goodput_tok_s": 9e5, "goodput_pct": 100 * seconds["productive"] / wall,
            "rates": {w: {"throughput_tok_s": 1e6, "goodput_tok_s": 9e5} for w in ("60s", "600s", "3600s")},
            "seconds": seconds, "custom_by_name": {"evaluation": seconds["custom"]},
            "gpu_hours": {c: v * world / 3600 for c, v in seconds.items()},
            "cost_usd": {c: v * world / 3600 * 2.5 for c, v in seconds.items()}, "badput_cost_usd": 1.0,
            "records_dropped": {"total": 160, "buffer": 160, "by_rank": {str(r): 10 for r in range(16)}},
            "steps_partial": 3, "history_lost": None, "coverage_pct": 99.9}


def load(client: redis.Redis, runs: int, world: int, incidents: int, agg: int) -> None:
    rng = random.Random(world)
    busy_lists = [json.dumps([round(0.1 + rng.random() * 0.01, 6) for _ in range(world)]) for _ in range(8)]
    now_ms = int(time.time() * 1000)
    for i in range(runs):
        run = f"run-{i:03d}"
        k = run_keys(run)
        pipe = client.pipeline(transaction=False)
        pipe.zadd(RUNS, {run: T0 + i})
        pipe.hset(k.meta, mapping={"name": run, "world_size": world, "status": "running", "gpu_hour_usd": 2.5})
        pipe.set(k.ledger_latest, json.dumps(snapshot(world, rng)))
        for j in range(incidents):
            iid = f"inc:{KINDS[j % len(KINDS)]}:{j}:{j * 100}:0"
            pipe.hset(k.incidents, iid, json.dumps({
                "id": iid, "kind": KINDS[j % len(KINDS)], "title": f"Rank {j} is a straggler, costing throughput",
                "severity": ("warning", "critical")[j % 2], "status": "active" if j % 5 == 0 else "resolved",
                "onset_step": j * 100, "onset_t": T0 + j * 100, "end_step": None, "gen": 0, "ranks": [j],
                "hosts": [f"node-{j // 8}"], "anomalies": [iid[4:], f"throughput_drop:*:{j * 100}:0"],
                "recommendation": f"rec:{iid[4:]}", "badput_s": 120.5, "badput_s_per_hour": 360.0,
                "first_seen": T0, "last_seen": T0 + 3600}, sort_keys=True))
        pipe.set(k.state, json.dumps({"state": "running", "since": T0, "step": 100_000, "culprit": None,
                                      "message": "", "gen": 0}))
        for s in range(agg):
            step = 100_000 - agg + s + 1
            pipe.xadd(k.agg, {"step": step, "gen": 0, "t_start": repr(T0 + step), "t_end": repr(T0 + step + 0.9),
                              "dur": "0.9", "loss": "2.1", "tokens": 4096 * world, "n_ranks": world,
                              "busy": busy_lists[s % len(busy_lists)], "data_s": "0.01"}, id=f"1-{step}")
        for stream in k.input_streams:
            pipe.xgroup_create(stream, "th-detectors", id="0", mkstream=True)
        for s in range(40):
            pipe.xadd(k.steps, {"rank": s % world, "n": 1, "seq": s, "recs": "[]"}, id=f"{now_ms - 4000 + s}-0")
        hb = {str(r): json.dumps({"t": T0 + 100, "step": 100_000, "step_t": T0 + 99, "phase": "train",
                                  "host": f"node-{r // 8}", "pid": 1000 + r, "inc": T0}) for r in range(world)}
        pipe.hset(k.heartbeats, mapping=hb)
        pipe.execute()
        client.xreadgroup("th-detectors", "svc", {k.steps: ">"}, count=20)  # 20 read, not acknowledged; 20 unread
    client.zadd(SERVICES, {"svc": time.time()})


def net_out(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def measure(client: redis.Redis, proc: RedisProc, fn, repeats: int) -> dict:
    """Median wall ms, bytes Redis sent and Redis CPU ms per call of ``fn``."""
    fn()  # warm: scripts loaded, connections open
    a, b = net_out(client), net_out(client)
    info_bytes = b - a  # one INFO reply
    walls, sent = [], []
    cpu0 = proc.cpu_s(client)
    for _ in range(repeats):
        before = net_out(client)
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
        sent.append(net_out(client) - before - info_bytes)
    cpu = (proc.cpu_s(client) - cpu0) / repeats
    return {"wall_ms": 1000 * statistics.median(walls), "bytes": statistics.median(sent), "redis_cpu_ms": 1000 * cpu}


def per_rank_read(client: redis.Redis) -> None:
    runs = [r.decode() for r in client.zrange(RUNS, 0, -1)]
    pipe = client.pipeline(transaction=False)
    for run in runs:
        k = run_keys(run)
        pipe.hgetall(k.heartbeats)
        pipe.xrevrange(k.agg, count=1)
        pipe.get(k.ledger_latest)
        pipe.hvals(k.incidents)
    replies = pipe.execute()
    for i in range(len(runs)):
        beats, newest, ledger, incs = replies[4 * i:4 * i + 4]
        [json.loads(v) for v in beats.values()]
        json.loads(newest[0][1][b"busy"])
        json.loads(ledger)
        [json.loads(v) for v in incs]


def run_size(world: int, args: argparse.Namespace) -> None:
    proc = RedisProc(prefix="th-bench-exporter-")
    try:
        client = redis.Redis.from_url(proc.url)
        t = time.perf_counter()
        load(client, args.runs, world, args.incidents, args.agg)
        mem = client.info("memory")["used_memory"]
        print(f"\n{world:,} ranks x {args.runs} runs: loaded in {time.perf_counter() - t:.1f} s "
              f"({mem / 1e6:.0f} MB in Redis)")
        registry = CollectorRegistry()
        collector = ExporterCollector(client, slowest_ranks=args.k)
        registry.register(collector)
        text = generate_latest(registry)
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        rows = [
            ("floor: PING per run", measure(client, proc, lambda: _pings(client, args.runs), args.repeats)),
            ("per-rank read (heartbeats, newest agg)", measure(client, proc, lambda: per_rank_read(client),
                                                                args.repeats)),
            ("exporter scrape (generate_latest)", measure(client, proc, lambda: generate_latest(registry),
                                                           args.repeats)),
        ]
        evalsha = client.info("commandstats").get("cmdstat_evalsha", {})
        print(f"{'read':<42} {'wall ms':>9} {'Redis sent kB':>14} {'Redis CPU ms':>13}")
        for name, m in rows:
            print(f"{name:<42} {m['wall_ms']:>9.1f} {m['bytes'] / 1e3:>14.1f} {m['redis_cpu_ms']:>13.1f}")
        print(f"exposition: {len(text) / 1e3:.1f} kB, {series:,} samples ({series / args.runs:.0f} per run); "
              f"the run script in Redis: {evalsha.get('usec_per_call', float('nan')):.0f} us per run")
    finally:
        proc.stop()


def _pings(client: redis.Redis, runs: int) -> None:
    pipe = client.pipeline(transaction=False)
    for _ in range(runs):
        pipe.ping()
    pipe.execute()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,1024,4096", help="rank counts, comma-separated")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--incidents", type=int, default=20, help="incidents per run (a fifth active)")
    ap.add_argument("--agg", type=int, default=20, help="th:{run}:agg entries per run")
    ap.add_argument("--k", type=int, default=5, help="--slowest-ranks")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    for world in (int(x) for x in args.ranks.split(",")):
        run_size(world, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
