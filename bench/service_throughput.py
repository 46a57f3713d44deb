"""Detector service: rank-step records per second for a 1,024-rank run, and push-to-anomaly latency.

Run: ``.venv/bin/python bench/service_throughput.py`` (about 6 minutes; ``--skip-latency`` /
``--skip-throughput`` for one part, ``--profile FILE`` for a cProfile of the first service pass).
The JSON parser of step batches is printed: the standard library's, or msgspec's when it is
installed (``pip install msgspec``; see ``trainhealth.wire.decode_steps``).

Starts its own redis-server on a free port (no persistence). Two parts:

1. **Throughput.** ``--steps`` steps of ``--ranks`` ranks are pre-loaded into the run's streams
   with the collectors' own encoding (the ``XADD`` commands ``trainhealth.collectors.sender.Sender._add_batch``
   queues: one entry per batch of a rank's consecutive records, ``rank``/``n``/``recs`` JSON
   list), each entry with the id its flush would get, each record as ``Monitor`` makes a timed
   step (``t``, ``dur``, ``sec.data``, ``sec.forward_backward``, ``sec.optimizer``, ``loss``,
   ``grad_norm``, ``lr``, ``tokens``, ``samples``, ``consumed_samples``, ``batch_index``), with
   ``run_start`` and ``checkpoint_save`` events of every rank, a straggler rank (steps 100-199),
   a loss spike (150) and a NaN loss (250). ``--batch`` records per entry (default: 25, then 1):
   a sender flushes every 0.25 s, so at the target rate (100,000 records/s from 1,024 ranks, a
   step every ~10 ms) an entry holds ~25 records; at a real job's pace (steps of 0.25 s and more)
   one. Then, on the same entries, each with its own consumer group: two baselines —
   ``XREADGROUP`` + ``json.loads`` + ``XACK`` (the least a consumer does; "raw"), the same with
   ``trainhealth.wire.decode_steps`` (the wire decode into ``StepRecord`` objects) — and the
   real :class:`trainhealth.detectors.service.DetectorService` in this process (``run_once`` until the
   streams are drained: aggregation, every step detector of the pipeline, ledger, rollback
   advisor, the ``MULTI`` write-back of aggregates, anomalies, ledger snapshots and ``XACK``).
   Records/s is records drained per wall second; CPU is this process's CPU time per record
   (the service's) and redis-server's (``INFO cpu``).

2. **Latency.** ``trainhealth serve`` runs as its own process; ``--lat-procs`` producer processes
   (niced) host ``--ranks`` real :class:`trainhealth.Monitor` objects (default sender: 0.25 s flush
   interval) stepping every ``--step-s`` seconds: ``step()`` with three ``section()`` blocks and
   ``log_step()``. Every ``--every`` steps one anomaly is injected: a NaN loss on one rank, or a
   loss spike on every rank, alternately; each opens an anomaly at that step and resolves it at
   the next. A step's anomaly can exist only once every rank reported the step, so its latency
   runs from the step's completion on the collectors — the latest ``t`` of its records, stamped
   when the record entered the collector's buffer (the aggregate's ``t_end``) — to the
   ``anomaly_log`` entry's id (the Redis server's clock, ms). Split: log → ``XADD`` of the
   step's last entry (the collectors' flush interval; on this machine also the 1,024 simulated
   senders' share of its cores) and ``XADD`` → anomaly in Redis (the service).

3. **Beside another version** (``--compare REV``: a git revision of this repository, e.g. ``main``, or a
   checkout's directory). For each size of ``--compare-ranks`` the run is pre-loaded once (as in part 1,
   ``--steps`` steps, ``--batch``'s first size) and kept aside in Redis (``COPY``); then, ``--repeat`` times,
   alternately, each version's :class:`DetectorService` drains a fresh copy of it in its own process (the
   version's code imported from its directory), with a clock that starts an hour before the records and
   advances one second per ``run_once`` (every batch ticks: stale steps, ledger snapshots), the same for both.
   Printed per pass: records/s, CPU µs per record of the service process (``time.process_time``) and of
   redis-server (``INFO cpu``), and the load average; then each version's medians. After each pass every
   key the service wrote (aggregates, rollups, anomalies and their log, recommendations, incidents,
   checkpoints, ledger, job state; of the input streams, their length and consumer group state) is read
   back: the pass fails unless all are byte-identical to the first pass's (stream ids included where the
   service chose them: the aggregates'; the server's own ids of the anomaly log and ledger are left out, and
   the run's lease, which expires in wall-clock time).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import importlib
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from trainhealth.collectors.sender import Sender
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import _LAZY_IMPORTS, DetectorService
from trainhealth.embedded_redis import find_redis_server, free_port, ping
from trainhealth.keys import RUNS, run_keys
from trainhealth.wire import decode_steps

T0 = 1_800_000_000.0
FLUSH_S = 0.25        # the collectors' flush interval (defaults.COLLECTOR_FLUSH_INTERVAL_S)
SLOW_RANK = 777       # straggler in the pre-loaded run, steps 100-199
SPIKE_STEP = 150      # loss x3 on every rank
NAN_STEP = 250        # NaN loss on rank 3
SECTIONS = ("data", "forward_backward", "optimizer")


class RedisProc:
    """A redis-server child process on a free port (never 6379), no persistence; ``maxclients`` connections."""

    def __init__(self, maxclients: int = 10_000, prefix: str = "th-bench-") -> None:
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.port = free_port()
        assert self.port != 6379
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--maxclients", str(maxclients)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not ping(self.url, timeout=0.2):
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    def cpu_s(self, client: redis.Redis) -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- part 1: throughput ------------------------------------------------------------------------------
def record(rank: int, step: int, world: int, step_s: float, rng: random.Random) -> dict[str, Any]:
    """One rank's record of one timed step, with the keys and None values ``Monitor`` gives the sender."""
    slow = 2.0 if rank == SLOW_RANK and 100 <= step < 200 else 1.0
    fb = step_s * (0.6 * slow + rng.uniform(0.0, 0.01))
    data, opt = step_s * (0.05 + rng.uniform(0.0, 0.02)), step_s * (0.1 + rng.uniform(0.0, 0.01))
    t = T0 + 10 + (step + 1) * step_s + rng.uniform(0.0, step_s / 100)
    loss = 2.0 + 1.5 * math.exp(-step / 300) + rng.gauss(0, 0.01)
    if step == SPIKE_STEP:
        loss *= 3
    if step == NAN_STEP and rank == 3:
        loss = float("nan")
    rec: dict[str, Any] = {"rank": rank, "step": step, "inc": T0, "t": t, "dur": step_s * 0.99}
    rec.update({"sec.data": data, "sec.forward_backward": fb, "sec.optimizer": opt})
    rec.update({"loss": loss, "grad_norm": 0.8 + rng.uniform(0.0, 0.05), "lr": 3e-4 * min(1.0, (step + 1) / 100),
                "tokens": 8192, "samples": 4, "consumed_samples": (step + 1) * 4 * world, "batch_index": step,
                "skipped": None})
    return rec


def preload(client: redis.Redis, run: str, world: int, steps: int, batch: int) -> tuple[int, int]:
    """Write the run's meta, run_start/checkpoint events and step records; returns (records, entries).

    Each rank's sender flushes every FLUSH_S seconds with ``batch`` records, so the simulated step
    time is FLUSH_S / batch; the commands are the sender's own (``Sender._add_batch``), each ``XADD``
    given the id its flush would get (ms of the flush time), so entries spread over milliseconds as
    a live job's do.
    """
    keys = run_keys(run)
    step_s = FLUSH_S / batch
    client.hset(keys.meta, mapping={"name": run, "world_size": world, "started_at": repr(T0), "status": "running",
                                    "gpu_hour_usd": "2.5"})
    client.zadd(RUNS, {run: T0})
    senders = [Sender(lambda: client, keys, 1, lambda: (0, "{}"), {"_rank": r, "_inc": repr(T0)})
               for r in range(world)]
    rngs = [random.Random(r) for r in range(world)]
    cmds: list[tuple[float, int, tuple]] = []  # (flush time, order, XADD args)
    scratch = client.pipeline(transaction=False)

    def capture(snd: Sender, recs: list[tuple[str, dict[str, Any]]], at: float) -> None:
        scratch.command_stack.clear()
        snd._add_batch(scratch, recs, clean=True)
        cmds.extend((at, len(cmds), args) for args, _ in scratch.command_stack)

    for r, snd in enumerate(senders):
        capture(snd, [("events", {"kind": "run_start", "rank": r, "t": T0, "inc": T0, "step": None, "seconds": None,
                                  "host": f"node-{r // 8}", "pid": 1000 + r, "world_size": world,
                                  "local_rank": r % 8, "config": None})], T0 + rngs[r].uniform(0, 1))
    records = 0
    for start in range(0, steps, batch):
        for r, snd in enumerate(senders):
            recs: list[tuple[str, dict[str, Any]]] = []
            for s in range(start, min(start + batch, steps)):
                recs.append(("steps", record(r, s, world, step_s, rngs[r])))
                if s % 100 == 99:  # every rank reports the checkpoint save after step s
                    recs.append(("events", {"kind": "checkpoint_save", "rank": r, "inc": T0, "step": s,
                                            "t": recs[-1][1]["t"] + 0.001, "seconds": 0.001}))
            capture(snd, recs, recs[-1][1]["t"] + rngs[r].uniform(0.0, step_s))
            records += sum(1 for stream, _ in recs if stream == "steps")
    cmds.sort()
    last: dict[str, tuple[int, int]] = {}
    pipe = client.pipeline(transaction=False)
    for at, _, args in cmds:
        ms, prev = int(at * 1000), last.get(args[1], (0, -1))
        sid = (ms, 0) if ms > prev[0] else (prev[0], prev[1] + 1)
        last[args[1]] = sid
        assert args[0] == "XADD" and args[5] == "*"
        pipe.execute_command(*args[:5], f"{sid[0]}-{sid[1]}", *args[6:])
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()
    return records, len(cmds)


def baseline(client: redis.Redis, run: str, group: str, decode: bool, total: int) -> tuple[float, float, int]:
    """XREADGROUP (+ json.loads or decode_steps) + XACK of every entry; returns (wall s, cpu s, records)."""
    keys = run_keys(run)
    for s in keys.input_streams:
        client.xgroup_create(s, group, id="0")
    n = 0
    w0, c0 = time.perf_counter(), time.process_time()
    while n < total:
        reply = client.xreadgroup(group, "b", {s: ">" for s in keys.input_streams}, count=5000, block=100)
        for stream, entries in reply or []:
            if stream.endswith(b":steps"):
                for _, f in entries:
                    n += len(decode_steps(f)) if decode else len(json.loads(f[b"recs"]))
            client.xack(stream, group, *[i for i, _ in entries])
    return time.perf_counter() - w0, time.process_time() - c0, n


def service_pass(client: redis.Redis, entries: int, profile: str | None) -> tuple[float, float]:
    """The real service in this process, ``run_once`` until every entry is read; (wall s, CPU s)."""
    svc = DetectorService(client, consumer="bench-service", hang_factory=lambda: HangDetector(floor_s=1e9))
    for module in _LAZY_IMPORTS:  # what run_forever imports before its first batch (scikit-learn: 1-3 s)
        importlib.import_module(module)
    prof = cProfile.Profile() if profile else None
    w0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    while svc.processed < entries:
        svc.run_once(block_ms=100)
    if prof:
        prof.disable()
        prof.dump_stats(profile)
    return time.perf_counter() - w0, time.process_time() - c0


def decoder_name() -> str:
    import trainhealth.wire as ev

    ev.decode_steps({b"recs": b'[{"rank":0,"step":0,"inc":0.0,"t":0.0}]'})  # the parser is chosen on first use
    return getattr(ev, "JSON_DECODER", "json (standard library)")


def throughput(args: argparse.Namespace, rp: RedisProc, batch: int, profile: str | None) -> dict[str, Any]:
    client = redis.Redis.from_url(rp.url)
    client.flushall()
    run = "bench-svc"
    w0 = time.perf_counter()
    records, _ = preload(client, run, args.ranks, args.steps, batch)
    load_s = time.perf_counter() - w0
    keys = run_keys(run)
    n_entries = sum(client.xlen(s) for s in keys.input_streams)
    print(f"\nthroughput: {records:,} records ({args.ranks} ranks x {args.steps} steps of "
          f"{FLUSH_S / batch * 1e3:g} ms) in {client.xlen(keys.steps):,} step entries ({batch} records/entry) "
          f"+ {client.xlen(keys.events):,} events, loaded in {load_s:.1f} s "
          f"({client.info('memory')['used_memory_human']} in Redis)", flush=True)
    rows = []
    for name, decode in (("XREADGROUP + json.loads + XACK (raw)", False), ("raw + decode_steps (StepRecords)", True)):
        r0 = rp.cpu_s(client)
        wall, cpu, n = baseline(client, run, f"bench-{int(decode)}", decode, records)
        rows.append((name, n, wall, cpu, rp.cpu_s(client) - r0))
    r0 = rp.cpu_s(client)
    wall, cpu = service_pass(client, n_entries, profile)
    rows.append(("DetectorService (detect, ledger, write-back)", records, wall, cpu, rp.cpu_s(client) - r0))
    anomalies = sorted(k.decode() for k in client.hkeys(keys.anomalies))
    n_agg = client.xlen(keys.agg)
    raw = rows[0][1] / rows[0][2]
    print(f"{'consumer':<46} {'records/s':>10} {'wall s':>7} {'CPU µs/rec':>10} {'redis CPU s':>11} {'x raw':>6}")
    for name, n, wall_s, cpu_s, rcpu in rows:
        print(f"{name:<46} {n / wall_s:>10,.0f} {wall_s:>7.2f} {1e6 * cpu_s / n:>10.1f} {rcpu:>11.2f} "
              f"{(n / wall_s) / raw:>6.2f}")
    rate = records / rows[-1][2]
    print(f"service: {n_agg} step aggregates; anomalies {', '.join(anomalies)}")
    return {"records": records, "batch": batch, "ranks": args.ranks, "service_records_s": rate,
            "service_cpu_us_per_record": 1e6 * rows[-1][3] / records, "raw_records_s": raw,
            "decode_records_s": rows[1][1] / rows[1][2], "ratio_to_raw": rate / raw, "aggregates": n_agg,
            "anomalies": anomalies}


# -- part 3: beside another version --------------------------------------------------------------------
#: Run in a new interpreter before the bench module: imports ``trainhealth`` from the directory in argv[1] (its
#: pyproject.toml's package-dir), then runs one pass (``measure_pass``) with the arguments after it.
_PASS = """
import importlib.abc, importlib.util, json, os, runpy, sys
try:
    import tomllib
except ImportError:
    import tomli as tomllib
root, bench = sys.argv[1], sys.argv[2]
with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        d = dirs.get(name)
        if d is None:
            return None
        d = os.path.join(root, d)
        return importlib.util.spec_from_file_location(name, os.path.join(d, "__init__.py"),
                                                      submodule_search_locations=[d])
sys.meta_path.insert(0, Finder())
mod = runpy.run_path(bench, run_name="service_pass")
print(json.dumps(mod["measure_pass"](*sys.argv[3:])))
"""
PRISTINE = "pristine"  # the pre-loaded run's input keys are kept as th:{run}:pristine:<name>


def measure_pass(url: str, run: str, entries: str, clock0: str) -> dict[str, Any]:
    """One version's service drains the run (in its own process): wall s, CPU s (its own and redis-server's)."""
    import trainhealth.detectors.service as service_module

    client = redis.Redis.from_url(url)
    now = [float(clock0)]
    svc = DetectorService(client, consumer="bench-service", clock=lambda: now[0],
                          hang_factory=lambda: HangDetector(floor_s=1e9))
    for module in _LAZY_IMPORTS:
        importlib.import_module(module)
    info = client.info("cpu")
    r0 = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    w0, c0 = time.perf_counter(), time.process_time()
    while svc.processed < int(entries):
        now[0] += 1.0
        svc.run_once(block_ms=100)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    info = client.info("cpu")
    redis_cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"]) - r0
    now[0] += 1.0
    svc.run_once(block_ms=1)  # the tick after the last batch: its ledger snapshot
    return {"wall_s": wall, "cpu_s": cpu, "redis_cpu_s": redis_cpu, "code": service_module.__file__}


def _restore(client: redis.Redis, run: str) -> None:
    """Every key but the kept input deleted, the input copied back: the run as pre-loaded, never read."""
    keys = run_keys(run)
    keep = f"th:{{{run}}}:{PRISTINE}:"
    for key in list(client.scan_iter(count=1000)):
        if not key.decode().startswith(keep):
            client.delete(key)
    for name in (keys.meta, keys.steps, keys.events):
        client.copy(keep + name.rsplit(":", 1)[1], name)
    client.zadd(RUNS, {run: T0})


def _written(client: redis.Redis, run: str) -> dict[str, str]:
    """Every key but the kept input, as text: the input streams' length and consumer groups, everything else
    whole (the ids of streams the server numbers left out)."""
    keys = run_keys(run)
    server_ids = (keys.anomaly_log, keys.ledger)
    out = {}
    for raw in sorted(client.scan_iter(count=1000)):
        key = raw.decode()
        if key.startswith(f"th:{{{run}}}:{PRISTINE}:") or key == keys.owner:
            continue  # the kept input; the lease, which expires in wall-clock time
        kind = client.type(key).decode()
        if key in keys.input_streams:
            groups = [{k: v for k, v in g.items() if k != "lag"} for g in client.xinfo_groups(key)]
            consumers = [[{k: v for k, v in c.items() if k not in ("idle", "inactive")}
                          for c in client.xinfo_consumers(key, g["name"])] for g in groups]
            value: Any = [client.xlen(key), groups, consumers]
        elif kind == "stream":
            value = [(None if key in server_ids else i, f) for i, f in client.xrange(key)]
        elif kind == "hash":
            value = sorted(client.hgetall(key).items())
        elif kind == "string":
            value = client.get(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            value = sorted(client.smembers(key))
        else:
            value = client.lrange(key, 0, -1)
        out[key] = repr((kind, value))
    return out


def _checkout(rev: str) -> tuple[str, str]:
    """(directory, description) of the code of ``rev``: a directory as is, else the git revision of this
    repository extracted (``git archive``) into a temporary directory."""
    if Path(rev, "pyproject.toml").is_file():
        head = subprocess.run(["git", "-C", rev, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return str(Path(rev).resolve()), f"{rev} (checkout at {head.stdout.strip() or '?'})"
    repo = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    out = tempfile.mkdtemp(prefix=f"th-bench-{commit}-")
    archive = subprocess.run(["git", "-C", str(repo), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return out, f"{rev} ({commit})"


def compare(args: argparse.Namespace, rp: RedisProc) -> dict[str, Any]:
    """Part 3: the service of ``--compare``'s version and this checkout's on the same entries, alternately."""
    base_dir, base_name = _checkout(args.compare)
    here = str(Path(__file__).resolve().parent.parent)
    versions = [(f"before: {base_name}", base_dir), ("after: this checkout", here)]
    client = redis.Redis.from_url(rp.url)
    run, batch = "bench-svc", int(args.batch.split(",")[0])
    result: dict[str, Any] = {"baseline": base_name, "sizes": []}
    try:
        for ranks in (int(x) for x in args.compare_ranks.split(",")):
            client.flushall()
            records, _ = preload(client, run, ranks, args.steps, batch)
            keys = run_keys(run)
            entries = sum(client.xlen(s) for s in keys.input_streams)
            for name in (keys.meta, keys.steps, keys.events):
                client.rename(name, f"th:{{{run}}}:{PRISTINE}:{name.rsplit(':', 1)[1]}")
            print(f"\ncompare: {records:,} records ({ranks} ranks x {args.steps} steps, {batch} records/entry) in "
                  f"{entries:,} entries; {args.repeat} passes of each version, alternately", flush=True)
            print(f"{'version':<34} {'pass':>4} {'records/s':>10} {'wall s':>7} {'CPU µs/rec':>10} "
                  f"{'redis µs/rec':>12} {'load 1m':>7}  outputs")
            first: dict[str, str] | None = None
            rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in versions}
            for i in range(args.repeat):
                for name, code in versions:
                    _restore(client, run)
                    load = os.getloadavg()[0]
                    proc = subprocess.run([sys.executable, "-c", _PASS, code, str(Path(__file__).resolve()), rp.url,
                                           run, str(entries), repr(T0 - 3600.0)],
                                          capture_output=True, text=True, check=False)
                    if proc.returncode:
                        raise RuntimeError(f"{name}: pass failed:\n{proc.stderr[-3000:]}")
                    res = json.loads(proc.stdout.strip().splitlines()[-1])
                    if not res["code"].startswith(code):
                        raise RuntimeError(f"{name}: ran the code of {res['code']}, not of {code}")
                    written = _written(client, run)
                    if first is None:
                        first, same = written, "reference"
                    else:
                        diff = sorted(k for k in set(first) | set(written) if first.get(k) != written.get(k))
                        if diff:
                            k = diff[0]
                            raise RuntimeError(f"{name}, pass {i + 1}: keys differ from the first pass's: {diff}; "
                                               f"{k} was {first.get(k, '')[:2000]}\nand is {written.get(k, '')[:2000]}"
                                               f"\n(the pass's log: {proc.stderr[-3000:]})")
                        same = "identical"
                    digest = hashlib.sha256("".join(f"{k}={v}" for k, v in written.items()).encode()).hexdigest()
                    row = {"records_s": records / res["wall_s"], "cpu_us": 1e6 * res["cpu_s"] / records,
                           "redis_us": 1e6 * res["redis_cpu_s"] / records, "wall_s": res["wall_s"], "load": load,
                           "keys": len(written), "sha256": digest}
                    rows[name].append(row)
                    print(f"{name:<34} {i + 1:>4} {row['records_s']:>10,.0f} {row['wall_s']:>7.2f} "
                          f"{row['cpu_us']:>10.2f} {row['redis_us']:>12.2f} {load:>7.2f}  {same} "
                          f"({len(written)} keys, sha256 {digest[:12]})", flush=True)
            size: dict[str, Any] = {"ranks": ranks, "records": records, "entries": entries}
            for name, _ in versions:
                med = {k: statistics.median(r[k] for r in rows[name]) for k in ("records_s", "cpu_us", "redis_us")}
                size[name] = {"passes": rows[name], "median": med}
                print(f"{name:<34} {'med':>4} {med['records_s']:>10,.0f} {'':>7} {med['cpu_us']:>10.2f} "
                      f"{med['redis_us']:>12.2f}")
            result["sizes"].append(size)
    finally:
        if base_dir != args.compare:
            shutil.rmtree(base_dir, ignore_errors=True)
    return result


# -- part 2: latency -----------------------------------------------------------------------------------
def _ranks(url: str, run: str, ranks: list[int], world: int, steps: int, step_s: float, every: int, warmup: int,
           t0_box, ready, go, done) -> None:
    """A producer process: real Monitors for ``ranks``, one timed step every ``step_s`` seconds from t0."""
    from trainhealth import Monitor

    # 1,024 ranks' senders share this machine's cores with the service here (on a cluster each rank has
    # its own): they yield to it, so the service part of the latency is not inflated by our simulation.
    os.nice(19)
    mons = [Monitor(run, redis_url=url, rank=r, world_size=world, host=f"node-{r // 8}", spill_dir=False,
                    close_timeout=60) for r in ranks]
    ready.wait()
    go.wait()
    t0 = t0_box.value
    for s in range(steps):
        time.sleep(max(0.0, t0 + s * step_s - time.time()))
        inject = s >= warmup and (s - warmup) % every == 0
        kind = (s - warmup) // every % 2  # 0: NaN loss on one rank, 1: loss spike on every rank
        rng = random.Random(s)
        base = 2.0 + 1.5 * math.exp(-s / 300) + rng.gauss(0, 0.01)
        for mon in mons:
            with mon.step(s):
                for name in SECTIONS:
                    with mon.section(name):
                        pass
                # What the sections of a step_s-second step measure (as the project's tests set them):
                # timing 1,024 ranks' real work here would take 1,024 x step_s.
                mon._sections = {name: step_s * (share + 0.01 * rng.random())
                                 for name, share in zip(SECTIONS, (0.05, 0.6, 0.1), strict=True)}
                loss = base
                if inject and kind == 1:
                    loss *= 3
                if inject and kind == 0 and mon.rank == (s * 7919) % world:
                    loss = float("nan")
                mon.log_step(s, loss=loss, grad_norm=0.8 + rng.uniform(0, 0.05), lr=3e-4, tokens=8192, samples=4)
    done.put(all(m.close() for m in mons))


def _pcts(xs: list[float]) -> tuple[int, float, float, float, float]:
    if not xs:
        return 0, math.nan, math.nan, math.nan, math.nan
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return len(xs), q[49], q[89], q[98], xs[-1]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def latency(args: argparse.Namespace, rp: RedisProc) -> dict[str, Any]:
    client = redis.Redis.from_url(rp.url)
    client.flushall()
    run, world = "bench-lat", args.ranks
    keys = run_keys(run)
    path = os.pathsep.join(filter(None, (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": rp.url, "PYTHONPATH": path}
    service = subprocess.Popen([sys.executable, "-m", "trainhealth", "serve"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx = mp.get_context("spawn")
    ready, go, done, t0_box = ctx.Barrier(args.lat_procs + 1), ctx.Event(), ctx.Queue(), ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_ranks, args=(rp.url, run, list(range(i, world, args.lat_procs)), world,
                                              args.lat_steps, args.step_s, args.every, args.warmup, t0_box, ready,
                                              go, done))
             for i in range(args.lat_procs)]
    try:
        for pr in procs:
            pr.start()
        ready.wait(timeout=600)  # every Monitor is created
        t0_box.value = time.time() + 2.0  # ... and connected (run_start sent) before the first step
        go.set()
        cpu0, w0 = _cpu_s(service.pid), time.time()
        closed = [done.get(timeout=args.lat_steps * args.step_s + 600) for _ in procs]
        for pr in procs:
            pr.join()
        deadline = time.time() + 60  # the service drains the last steps
        while time.time() < deadline and client.xlen(keys.agg) < args.lat_steps:
            time.sleep(0.2)
        cpu, wall = _cpu_s(service.pid) - cpu0, time.time() - w0
    finally:
        service.terminate()
        service.wait(30)
        for pr in procs:
            if pr.is_alive():
                pr.terminate()
    # When each step was complete on the collectors (its latest record's t, the aggregate's t_end), and
    # when the last of its entries landed in Redis (entry id ms).
    t_end = {int(f[b"step"]): float(f[b"t_end"]) for _, f in client.xrange(keys.agg)}
    landed: dict[int, float] = {}
    for i, f in client.xrange(keys.steps):
        ms = int(i.split(b"-")[0]) / 1000
        for rec in json.loads(f[b"recs"]):
            landed[rec["step"]] = max(landed.get(rec["step"], 0.0), ms)
    injected = len(range(args.warmup, args.lat_steps, args.every))
    lat: dict[str, list[float]] = {}
    for i, f in client.xrange(keys.anomaly_log):
        kind, transition = f[b"kind"].decode(), f[b"transition"].decode()
        a = json.loads(f[b"json"])
        # Openings, and the end of a NaN run (the next step with a finite loss resolves it; a loss spike
        # resolves only once its recovery is classified, some steps later: not a latency).
        if transition == "opened" and kind in ("nan_inf", "loss_spike"):
            step, what = a["step"], "anomaly opened"
        elif transition == "resolved" and kind == "nan_inf":
            step, what = a["end_step"] + 1, "nan_inf resolved"
        else:
            continue
        at = int(i.split(b"-")[0]) / 1000
        if step in t_end:
            lat.setdefault(f"log_step -> {what}", []).append(at - t_end[step])
            lat.setdefault(f"XADD -> {what}", []).append(at - landed[step])
    found = len(lat.get("log_step -> anomaly opened", []))
    print(f"\nlatency: trainhealth serve + {world} real Monitors in {args.lat_procs} processes, a step every "
          f"{args.step_s} s ({world / args.step_s:,.0f} records/s), {args.lat_steps} steps; "
          f"{injected} anomalies injected (NaN loss on one rank / loss spike on all, alternately), "
          f"{found} opened; all records delivered: {all(closed)}; service CPU {100 * cpu / wall:.1f} % of a core")
    print(f"{'from -> to':<36} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    rows = {}
    for name in sorted(lat, key=lambda k: ("resolved" in k, not k.startswith("log"))):
        n, p50, p90, p99, mx = _pcts(lat[name])
        rows[name] = {"n": n, "p50_s": p50, "p90_s": p90, "p99_s": p99, "max_s": mx}
        print(f"{name:<36} {n:>4} {p50 * 1e3:>8.0f} {p90 * 1e3:>8.0f} {p99 * 1e3:>8.0f} {mx * 1e3:>8.0f}")
    return {"injected": injected, "opened": found, "service_cpu_pct": 100 * cpu / wall, "latency": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300, help="pre-loaded steps (throughput part)")
    ap.add_argument("--batch", default="25,1", help="records per steps entry (throughput part), comma-separated")
    ap.add_argument("--profile", help="write a cProfile of the (first) service pass to this file")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--lat-steps", type=int, default=200, help="steps of the live run (latency part)")
    ap.add_argument("--step-s", type=float, default=1.0, help="seconds per step of the live run")
    ap.add_argument("--every", type=int, default=2, help="inject an anomaly every N steps")
    ap.add_argument("--warmup", type=int, default=30, help="steps before the first injection")
    ap.add_argument("--lat-procs", type=int, default=8, help="processes hosting the live run's Monitors")
    ap.add_argument("--compare", metavar="REV", help="measure the service of this git revision (or checkout "
                    "directory) beside this checkout's on the same entries (part 3 only)")
    ap.add_argument("--compare-ranks", default="1024,4096", help="world sizes of --compare, comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="passes of each version (--compare)")
    args = ap.parse_args()
    rp = RedisProc()
    result: dict[str, Any] = {}
    try:
        client = redis.Redis.from_url(rp.url)
        print(f"redis-server {client.info('server')['redis_version']} on port {rp.port}; {os.cpu_count()} CPUs; "
              f"load average {os.getloadavg()[0]:.2f}; JSON decoder: {decoder_name()}")
        if args.compare:
            result["compare"] = compare(args, rp)
        elif not args.skip_throughput:
            result["throughput"] = [throughput(args, rp, int(b), args.profile if i == 0 else None)
                                    for i, b in enumerate(args.batch.split(","))]
        if not args.skip_latency and not args.compare:
            result["latency"] = latency(args, rp)
        print(json.dumps(result))
    finally:
        rp.stop()


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()
