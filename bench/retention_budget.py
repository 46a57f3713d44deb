"""What one Redis holds for a 4,096-rank job running 30 days at one step per 2 s: Redis memory by key, bytes per
rank-step kept for the whole run, and the issue's targets (issue 17: <= 2 GB, <= 64 B a rank-step long-term).

    .venv/bin/python bench/retention_budget.py [--ranks 4096] [--days 30] [--step-s 2] [--json FILE]

A fresh redis-server (the embedded binary, free port, no persistence) holds one run. The 1,296,000 steps are
generated, not waited for, in three parts, each through the project's own code:

1. **The real path, until the raw stream is at its bound.** Every rank's records, shaped as a ``Monitor`` makes
   them (``t``, ``dur``, three ``sec.*``, loss, grad norm, lr, tokens, samples, consumed samples), go through the
   collectors' own encoder and ``XADD`` (``Sender._add_batch``: its JSON, its ``seq``, its record and byte trims),
   one record an entry as at a live job's pace (a rank flushes every 0.25 s, a step takes 2 s), for enough steps to
   pass the step stream's bound (``STEPS_RETENTION_RECORDS`` records, ~244 steps at 4,096 ranks); the real
   :class:`~trainhealth.detectors.service.DetectorService` (in this process, ``run_once`` between chunks, so it
   keeps up as it does live) aggregates them and writes the per-step aggregates, rollups, anomalies and ledger.
   Shortcut: one ``Sender`` object per rank in this one process (not started as threads) instead of 4,096
   processes; the records are stamped with the run's own times, so the service runs with its hang floor at 1e9 s.
2. **The rest of the 30 days, through the service's own writers.** Each further step is a
   :class:`~trainhealth.detectors.aggregate.StepAggregate` of every rank (its ``busy`` vector one of 16 per-rank
   vectors, cycled, with a straggler in some) handed to the service's ``_write``: the rollup levels get every step
   (their buckets written where the service writes them); the per-step ``agg`` entry (its JSON of every rank's busy
   seconds) is written, with the service's byte trim, for the last steps only (enough to fill its bound twice
   over), because the ones before would be trimmed anyway and building 1.3 M of them (1-2 ms each at 4,096 ranks)
   would take the bench an hour: the service's state says they were stored (``last_agg``), as after a rebuild.
   Checkpoints every 1,000 steps: the newest ones' events from every rank through the collectors' encoder (more
   than the events stream keeps, so it reaches its bound; the service reads them and merges each into its mark),
   the older marks written as the service stores them (``Checkpoint.to_json``, every rank reporting). Anomalies at a
   plausible rate, one every 2 h of the run (360: loss spikes, stragglers of one to eight ranks, slow steps,
   throughput drops), each opened, updated twice and resolved through the service's ``_write_anomaly`` (its
   ``anomalies`` hash and ``anomaly_log`` stream, with its byte trim). Not generated: incidents and recommendations
   (one each per root cause, the size of its anomaly's JSON again: counted below as an estimate equal to
   the anomalies hash).
3. **The ledger stream** gets a snapshot every 2 s of the run's last hours through the service's ``_snapshot``, more
   than it keeps (``LEDGER_RETENTION_ENTRIES``), so it reaches its bound. Its ledger was fed the real steps of part
   1 only: a snapshot's size follows the causes it names, not the steps it counts.

Heartbeats: every rank's, as a real ``Monitor`` writes it on this machine (no CUDA device: the ``cuda``/``gpu``
parts of a GPU node's heartbeat, ~300-500 B more, are missing here; the hash is a few MB either way).

Then ``MEMORY USAGE <key> SAMPLES 0`` of every key (exact for streams and hashes), ``INFO memory`` ``used_memory``
before and after, and per key class: the windows bounded by retention (raw records, per-step aggregates, events,
ledger, heartbeats), which stop growing once full, and what is kept for the whole run (rollups, anomalies and their
log, checkpoint marks), which grows with the run: bytes a rank-step of it, and per hour.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import redis

from trainhealth import Monitor, defaults
from trainhealth.anomaly import Anomaly
from trainhealth.collectors.sender import Sender
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.checkpoints import Checkpoint
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.pipeline import Output
from trainhealth.detectors.service import DetectorService
from trainhealth.embedded_redis import find_redis_server, free_port
from trainhealth.keys import RUNS, run_keys

RUN = "budget"
T0 = 1_796_000_000.0
CKPT_EVERY = 1_000
ANOMALY_EVERY_S = 7_200.0
VARIANTS = 16


def wait_ready(r: redis.Redis) -> None:
    for _ in range(400):
        try:
            r.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def record(rank: int, step: int, step_s: float, world: int) -> dict[str, Any]:
    """A rank's record of a step, with the fields (and the value shapes) a ``Monitor`` sends."""
    t = T0 + step * step_s + 1.9 + 0.01 * math.sin(rank + step)
    fwd = 1.2 + 0.05 * math.sin(rank * 7 + step)
    return {"rank": rank, "step": step, "inc": T0, "t": t, "dur": 1.9 + 0.001 * (rank % 13), "sec.data": 0.0123 + rank
            % 7 * 1e-4, "sec.forward": fwd, "sec.optimizer": 0.201 + 1e-4 * (step % 11),
            "loss": 2.5 - step * 1e-6 + 0.01 * math.sin(step), "grad_norm": 0.8 + 0.1 * math.cos(step), "lr": 3e-4,
            "tokens": 4096, "samples": 2, "consumed_samples": (step + 1) * 2 * world}


def drain(svc: DetectorService) -> None:
    while svc.run_once(block_ms=1):
        pass


def key_table(r: redis.Redis) -> list[dict[str, Any]]:
    rows = []
    for key in sorted(r.scan_iter(match=f"th:{{{RUN}}}:*", count=1000)):
        kind = r.type(key).decode()
        n = {"stream": r.xlen, "hash": r.hlen}.get(kind, lambda k: 1)(key)
        rows.append({"key": key.decode(), "type": kind, "entries": n, "bytes": r.memory_usage(key, samples=0)})
    for key in (RUNS,):
        rows.append({"key": key, "type": r.type(key).decode(), "entries": r.zcard(key),
                     "bytes": r.memory_usage(key, samples=0)})
    return rows


#: Keys kept for the whole run (they grow with it); every other key of the run is a window bounded by retention.
def long_term(key: str) -> bool:
    tail = key.split("}:", 1)[-1]
    return tail.startswith("agg:rollup") or tail in ("anomalies", "anomaly_log", "incidents", "recommendations",
                                                     "checkpoints", "meta")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--days", type=float, default=30.0)
    p.add_argument("--step-s", type=float, default=2.0, help="seconds per step")
    p.add_argument("--steps-retention", type=int, default=100_000,
                   help="the collectors' step-stream bound in records for the real path (default 100,000: a tenth of "
                        "the default, scaled to it in the totals; the memory of a record is the same at any bound)")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    world, step_s = args.ranks, args.step_s
    steps = round(args.days * 86_400 / step_s)
    real_steps = math.ceil(1.2 * args.steps_retention / world)
    keys = run_keys(RUN)
    started = time.monotonic()
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        srv = subprocess.Popen([find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no",
                                "--dir", d], stdout=subprocess.DEVNULL)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            r = redis.Redis.from_url(url)
            wait_ready(r)
            used_empty = r.info("memory")["used_memory"]
            # A real Monitor's heartbeat (rank 0), for every rank.
            mon = Monitor(RUN, redis_url=url, rank=0, world_size=world, started_at=T0, spill_dir=False)
            mon.close()
            hb = json.loads(r.hget(keys.heartbeats, "0"))
            r.hset(keys.meta, mapping={"status": "running"})
            pipe = r.pipeline(transaction=False)
            for rank in range(world):
                pipe.hset(keys.heartbeats, str(rank), json.dumps({**hb, "pid": 10_000 + rank,
                                                                  "host": f"node-{rank // 8:04d}"}))
            pipe.execute()

            clock = [T0]
            svc = DetectorService(r, consumer="budget", clock=lambda: clock[0],
                                  hang_factory=lambda: HangDetector(floor_s=1e9))
            svc.discover()
            # 1. The real path: the collectors' encoder and trims, the service reading as it goes.
            senders = [Sender(lambda: r, keys, 1, lambda: (0, "{}"), {"_rank": rank, "_inc": repr(T0)},
                              retention=args.steps_retention) for rank in range(world)]
            t1 = time.monotonic()
            for s in range(real_steps):
                for rank, snd in enumerate(senders):
                    snd._add_batch(pipe, [("steps", record(rank, s, step_s, world))], clean=True)
                pipe.execute()
                clock[0] = T0 + s * step_s + 2
                if s % 20 == 19 or s == real_steps - 1:
                    drain(svc)
            drain(svc)
            run = svc.runs[RUN]
            phase1_s = time.monotonic() - t1
            steps_entries = r.xlen(keys.steps)
            print(f"real path: {real_steps} steps x {world:,} ranks = {real_steps * world:,} records in "
                  f"{phase1_s:.0f} s; steps stream holds {steps_entries:,} entries; service malformed "
                  f"{svc.malformed}, agg {run.last_agg}", flush=True)

            # 2. The rest of the run through the service's writers.
            rng = np.random.default_rng(0)
            variants = []
            for v in range(VARIANTS):
                busy = 1.4 + 0.02 * rng.standard_normal(world)
                if v % 4 == 0:
                    busy[(v * 37) % world] *= 1.3  # a straggler in a quarter of the steps
                variants.append(busy)
            agg_bytes = len(json.dumps([round(float(b), 6) for b in variants[0]])) + 150
            tail = max(11 * defaults.AGG_RETENTION_BYTES // (10 * agg_bytes), 2_000)
            tail = min(tail, defaults.AGG_RETENTION_ENTRIES + 1_000, steps - real_steps)
            far_end = steps - tail - 1
            run.last_agg = (1, far_end)  # the steps before are "stored" (and would be trimmed): agg entry skipped
            t2 = time.monotonic()
            anomaly_steps = int(ANOMALY_EVERY_S / step_s)
            n_anomalies = 0
            kinds = ("loss_spike", "straggler", "slow_step", "throughput_drop")
            for s in range(real_steps, steps):
                t_start = T0 + s * step_s
                agg = StepAggregate(step=s, gen=0, inc=T0, t_start=t_start, t_end=t_start + 1.95,
                                    loss=2.5 - s * 1e-6 + 0.01 * math.sin(s), grad_norm=0.8 + 0.1 * math.cos(s),
                                    lr=3e-4, tokens=4096 * world, samples=2 * world, n_ranks=world,
                                    busy=variants[s % VARIANTS], data_s=0.0131, consumed_samples=(s + 1) * 2 * world)
                svc._write(run, Output(aggs=[agg]), pipe)
                if s % CKPT_EVERY == CKPT_EVERY - 1 and steps - s > 40 * CKPT_EVERY:
                    c = Checkpoint("checkpoint_save", s, t_start + 1.96, 12.5, world)
                    pipe.hset(keys.checkpoints, c.field, c.to_json())
                if s % anomaly_steps == anomaly_steps // 2:
                    kind = kinds[n_anomalies % len(kinds)]
                    ranks = tuple(sorted({(n_anomalies * 131 + i * 17) % world
                                          for i in range(1 + n_anomalies % 8)})) if kind == "straggler" else ()
                    ev = {"score": 0.71, "threshold": 0.8, "median_s": 1.4, "rank_s": 1.82, "windows": 3,
                          "badput_s_per_hour": 212.0, "step_s": 2.0, "median": 2.31, "mad": 0.012, "z": 9.4}
                    base = Anomaly(kind=kind, severity="warning", step=s, message=f"{kind} at step {s}: "
                                   "a message of the usual length for a human on call, naming what and where",
                                   evidence=ev, ranks=ranks, hosts=tuple(f"node-{x // 8:04d}" for x in ranks))
                    for i in range(3):
                        a = Anomaly(**{**base.__dict__, "evidence": {**ev, "update": i, "last_step": s + 10 * i}})
                        svc._write_anomaly(run, a, pipe)
                    a = Anomaly(**{**base.__dict__, "status": "resolved", "end_step": s + 40})
                    svc._write_anomaly(run, a, pipe)
                    n_anomalies += 1
                if len(pipe) >= 2_000:
                    pipe.execute()
                if s % 100_000 == 0:
                    print(f"  step {s:,} ({time.monotonic() - t2:.0f} s)", flush=True)
            pipe.execute()
            # The newest checkpoints: every rank's event through the collectors' encoder; the service merges them.
            newest = [c for c in range(CKPT_EVERY - 1, steps, CKPT_EVERY) if steps - c <= 40 * CKPT_EVERY]
            for c in newest:
                t = T0 + c * step_s + 1.96
                for rank, snd in enumerate(senders):
                    snd._add_batch(pipe, [("events", {"kind": "checkpoint_save", "rank": rank, "t": t, "inc": T0,
                                                      "step": c, "seconds": 12.5})], clean=True)
                pipe.execute()
                drain(svc)
            phase2_s = time.monotonic() - t2
            print(f"service writers: {steps - real_steps:,} steps, {n_anomalies} anomalies, {len(newest)} "
                  f"checkpoints' events in {phase2_s:.0f} s", flush=True)

            # 3. Ledger snapshots every 2 s of the run's last hours, past the stream's bound.
            t3 = time.monotonic()
            end_t = T0 + steps * step_s
            n_snap = defaults.LEDGER_RETENTION_ENTRIES + 1_000
            for i in range(n_snap):
                now = end_t - (n_snap - i) * defaults.LEDGER_SNAPSHOT_INTERVAL_S
                run.dirty = True
                svc._snapshot(run, now, pipe)
                if len(pipe) >= 2_000:
                    pipe.execute()
            pipe.execute()
            print(f"ledger: {n_snap:,} snapshots in {time.monotonic() - t3:.0f} s", flush=True)

            info = r.info("memory")
            rows = key_table(r)
            kept_records = sum(int(f[b"n"]) for _, f in r.xrange(keys.steps, count=10**7))
        finally:
            srv.terminate()
            srv.wait(10)
    rank_steps = world * steps
    hours = steps * step_s / 3600
    # The raw stream at the default bound: the same bytes a record (one an entry), for STEPS_RETENTION_RECORDS records
    # (or the byte bound, when that binds first).
    steps_row = next(x for x in rows if x["key"] == keys.steps)
    per_record = steps_row["bytes"] / kept_records
    json_per_record = per_record  # upper bound of the JSON text a record (Redis' bytes include the entry overhead)
    at_default = min(defaults.STEPS_RETENTION_RECORDS, defaults.STEPS_RETENTION_BYTES / json_per_record)
    steps_scaled = round(per_record * at_default)
    print(f"steps stream: {kept_records:,} records kept at the bench's bound of {args.steps_retention:,}, "
          f"{per_record:.1f} B a record; at the default bound ({at_default:,.0f} records) {steps_scaled:,} B")
    lt = sum(x["bytes"] for x in rows if long_term(x["key"]))
    est_incidents = next(x["bytes"] for x in rows if x["key"].endswith(":anomalies"))
    window = sum(x["bytes"] for x in rows if not long_term(x["key"])) - steps_row["bytes"] + steps_scaled
    used = info["used_memory"] - used_empty - steps_row["bytes"] + steps_scaled
    print(f"\n{world:,} ranks x {steps:,} steps ({args.days:g} days at {step_s:g} s a step): "
          f"{rank_steps:,} rank-steps; bench {time.monotonic() - started:.0f} s")
    print(f"{'key':<40} {'type':<7} {'entries':>10} {'bytes':>14} {'B/entry':>9}  kept")
    for x in rows:
        print(f"{x['key']:<40} {x['type']:<7} {x['entries']:>10,} {x['bytes']:>14,} "
              f"{x['bytes'] / max(1, x['entries']):>9.0f}  {'whole run' if long_term(x['key']) else 'window'}")
    print(f"windows bounded by retention (the steps stream scaled to its default bound): {window:,} B; "
          f"kept for the whole run: {lt:,} B "
          f"(+ incidents and recommendations, not generated, estimated as the anomalies hash: {est_incidents:,} B)")
    lt_all = lt + est_incidents
    print(f"long-term: {lt_all / rank_steps:.4f} B a rank-step (target <= 64), {lt_all / hours / 1e3:.1f} kB an hour")
    print(f"used_memory: {info['used_memory']:,} B; with the steps stream scaled, {used:,} over the empty server's "
          f"{used_empty:,}; "
          f"+ estimate {used + est_incidents:,} B = {(used + est_incidents) / 2**30:.2f} GiB (target <= 2 GB: "
          f"{'met' if used + est_incidents <= 2e9 else 'missed'})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "ranks": world, "steps": steps, "step_s": step_s, "real_steps": real_steps, "agg_tail": tail,
            "anomalies": n_anomalies, "keys": rows, "kept_records": kept_records,
            "steps_scaled": steps_scaled, "used_memory": info["used_memory"], "used_empty": used_empty,
            "long_term_bytes": lt, "incidents_estimate": est_incidents, "window_bytes": window,
            "phase_s": [phase1_s, phase2_s]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
