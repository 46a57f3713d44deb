"""Load test: simulated ranks at a step rate with injected faults, through the real collectors and detector services,
against one Redis or a local Redis Cluster.

Run (about ``--duration`` seconds plus start-up and drain)::

    .venv/bin/python bench/load.py --ranks 1024 --step-s 1 --duration 120
    .venv/bin/python bench/load.py --ranks 4096 --step-s 2 --duration 120 --procs 16
    .venv/bin/python bench/load.py --runs 32 --ranks 256 --step-s 2 --duration 120 --services 2
    .venv/bin/python bench/load.py --ranks 1024 --step-s 1 --duration 120 --redis cluster

What runs:

- Redis: a redis-server of its own on a free port (no persistence), or with ``--redis cluster`` a local Redis
  Cluster of 3 primaries and 3 replicas on loopback ports (``tests/conftest.py``'s ``RedisClusterProcs``), the
  collectors and services given its ``redis+cluster://`` URL.
- ``--services`` ``trainhealth serve`` processes sharing the runs (their own leases and rebalancing).
- ``--procs`` producer processes hosting ``--runs`` x ``--ranks`` real :class:`trainhealth.Monitor` objects (each
  with its own sender thread and connection, as in a job), every rank stepping every ``--step-s`` seconds from a
  common start: ``step()`` with three sections and ``log_step()``. **Shortcuts**: the sections' seconds are given
  with ``add_section`` as a ``--step-s`` step would measure them (5 %, 60 % and 10 % of it, with noise) instead of
  being slept in — timing 1,024 ranks' real work on one machine would take 1,024 x the step; beyond 250 Monitors
  they flush every ``Monitors / 1,000`` s instead of 0.25 s (thousands of sender threads on 2 cores). Producers run
  at nice 19, so the services' share of the cores is not taken by the simulation (on a cluster each rank has its own
  host).
- Faults, in run 0 only (``--faults``, any of ``straggler,spike,hang``): rank ``ranks // 2 + 1`` is 2.5x slower in
  its forward/backward from 15 % to 55 % of the steps; every rank's loss is 3x at 60 %; and at 75 % every rank
  stops stepping for ``--hang-s`` seconds while its heartbeats go on (a hung collective), then resumes.

What is reported (and written as JSON with ``--json``):

- **ingest**: records logged by the producers and records in Redis per wall second; records dropped.
- **detector lag**: per aggregate, from the step's completion on the collectors (its latest record's ``t``, the
  aggregate's ``t_end``) to when the bench first sees the aggregate in ``th:{run}:agg`` (a thread polls every run's
  newest aggregates every 0.1 s, so the figure is up to 0.1 s late), p50/p99/max; and per injected fault, from the
  completion of the step it opened at to the anomaly's entry in ``th:{run}:anomaly_log`` (Redis' clock, ms).
- **Redis memory**: ``used_memory`` (summed over the primaries of a cluster) after the load minus before, per
  rank-step stored and per hour of the run (at this rate, before any retention bound is reached: see
  ``bench/retention_budget.py`` for the steady state).
- **service CPU**: the services' user+system CPU seconds (``/proc``) per record processed, and each service's
  share of a core.
- **dashboard**: with ``--dashboard``, Streamlit AppTest cold and refresh times of the Runs and Overview pages of
  run 0 after the load (``bench/dashboard_scale.py``'s harness).

The machine's load average is printed beside the figures: on a shared machine the lag and CPU figures include the
producers' work.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import redis  # noqa: E402
from service_throughput import RedisProc  # noqa: E402

from trainhealth import defaults  # noqa: E402
from trainhealth.connection import connect  # noqa: E402
from trainhealth.keys import run_keys  # noqa: E402

SECTIONS = ("data", "forward_backward", "optimizer")
SHARES = (0.05, 0.6, 0.1)


def run_name(i: int) -> str:
    """Run ids of the load: ``load-00``, ``load-01``, ..."""
    return f"load-{i:02d}"


class Faults:
    """Where the faults of run 0 are, in steps (and the hang's pause in seconds)."""

    def __init__(self, names: set[str], steps: int, ranks: int, hang_s: float) -> None:
        # The straggler detector scores windows of 20 steps and needs two slow ones in a row: 40 % of 120 steps.
        self.straggler = (ranks // 2 + 1, int(0.15 * steps), int(0.55 * steps)) if "straggler" in names else None
        self.spike = int(0.6 * steps) if "spike" in names else None
        self.hang = (int(0.75 * steps), hang_s) if "hang" in names else None

    def delay(self, run: int, step: int) -> float:
        """Seconds run ``run``'s step ``step`` starts later than its schedule (the hang's pause, once passed)."""
        if run == 0 and self.hang is not None and step >= self.hang[0]:
            return self.hang[1]
        return 0.0


def flush_interval(monitors: int) -> float:
    """The Monitors' flush interval: the default (0.25 s) up to 250 Monitors on this machine; beyond, so that their
    senders wake ~1,000 times a second in all (4.1 s at 4,096). Thousands of sender threads waking every 0.25 s on
    2 cores keep hundreds runnable, and Redis (one thread among them) answers after the collectors' socket timeout
    (bench/dashboard_scale.py measured it); on a cluster each rank has its own CPU."""
    return max(defaults.COLLECTOR_FLUSH_INTERVAL_S, monitors / 1_000)


def step_values(faults: Faults, run: int, rank: int, step: int, step_s: float, rng: random.Random,
                base: float) -> tuple[dict[str, float], dict[str, float]]:
    """What rank ``rank`` of run ``run`` logs for ``step``: its sections' seconds (as a ``step_s``-second step
    measures them, the straggler's forward/backward slower) and its metrics (the spike's loss 3x)."""
    st = faults.straggler
    slow = 2.5 if run == 0 and st is not None and rank == st[0] and st[1] <= step < st[2] else 1.0
    sections = {name: step_s * (share + 0.01 * rng.random()) * (slow if name != "data" else 1.0)
                for name, share in zip(SECTIONS, SHARES, strict=True)}
    metrics = {"loss": base * (3.0 if run == 0 and step == faults.spike else 1.0),
               "grad_norm": 0.8 + rng.uniform(0, 0.05), "lr": 3e-4, "tokens": 8192, "samples": 4}
    return sections, metrics


def _producer(url: str, pairs: list[tuple[int, int]], ranks: int, steps: int, step_s: float, faults: Faults,
              flush_s: float, ready: Any, go: Any, t0_box: Any, done: Any) -> None:
    """A producer process: a real Monitor per ``(run, rank)`` of ``pairs``, one step every ``step_s`` seconds."""
    from trainhealth import Monitor

    os.nice(19)
    # Hundreds of sender threads share this process's GIL; each waiting one re-checks every switch interval (5 ms).
    # They release the GIL on every Redis round trip, so a longer interval costs them nothing.
    sys.setswitchinterval(0.05)
    mons = [(run, Monitor(run_name(run), redis_url=url, rank=rank, world_size=ranks, host=f"node-{rank // 8:03d}",
                          spill_dir=False, close_timeout=300, flush_interval=flush_s)) for run, rank in pairs]
    ready.wait()
    go.wait()
    t0 = t0_box.value
    logged = 0
    parent = os.getppid()
    for s in range(steps):
        if os.getppid() != parent:  # the bench was killed: no orphans stepping on
            os._exit(1)
        rng = random.Random(s)
        base = 2.0 + 1.5 * math.exp(-s / 300) + rng.gauss(0, 0.01)
        for run, mon in mons:
            due = t0 + s * step_s + faults.delay(run, s)
            time.sleep(max(0.0, due - time.time()))
            sections, metrics = step_values(faults, run, mon.rank, s, step_s, rng, base)
            with mon.step(s):
                # What the sections of a step_s-second step measure: timing the real work of hundreds of ranks on
                # one machine would take hundreds of steps' time.
                for name, seconds in sections.items():
                    mon.add_section(name, seconds)
            mon.log_step(s, **metrics)
            logged += 1
    closed = [m.close() for _, m in mons]
    done.put({"logged": logged, "closed": all(closed), "dropped": sum(m.dropped_total for _, m in mons)})


def _lite_producer(url: str, pairs: list[tuple[int, int]], ranks: int, steps: int, step_s: float, faults: Faults,
                   flush_s: float, ready: Any, go: Any, t0_box: Any, done: Any) -> None:
    """``--collectors lite``: a producer process writing for every ``(run, rank)`` of ``pairs`` what its Monitor
    would, through the collectors' own :class:`~trainhealth.collectors.sender.Sender` (its registration, encoder,
    ``seq`` numbering and ``XADD`` trims), one Sender object per rank **not started as a thread**: the process
    itself writes each rank's step record as its own entry (what a rank's 0.25-s flush sends when a step takes
    longer), spread over the 0.25 s after the step as the ranks' flushes would be; a heartbeat per rank every
    ``HEARTBEAT_INTERVAL_S`` (the hang included: a hung job's heartbeat threads go on); ``run_start`` and
    ``run_end`` events. The record's fields and shapes are a Monitor's (``step()`` with three sections and
    ``log_step()``); its memory and GPU samples are absent (``null``), as on a machine without CUDA where the
    sample fails. The shortcut lets 4,096 ranks (and 32 x 256) be simulated on a few cores: 4,096 real Monitors'
    sender threads could not be scheduled here (the load average reached 670, see BENCHMARKS.md)."""
    from trainhealth.collectors.sender import Sender

    os.nice(19)
    client = connect(url)
    inc = time.time()
    pid = os.getpid()
    senders = []
    for run, rank in pairs:
        registry: dict[str, Any] = {"_rank": rank, "_inc": repr(inc), "status": "running", "world_size": ranks,
                                    "updated_at": repr(inc), "retention_records": defaults.STEPS_RETENTION_RECORDS,
                                    "retention_bytes": defaults.STEPS_RETENTION_BYTES}
        if rank == 0:
            registry.update(name=run_name(run), started_at=inc)
        snd = Sender(lambda: client, run_keys(run_name(run)), 1, lambda: (0, "{}"), registry)
        snd._register(client)
        senders.append((run, rank, f"node-{rank // 8:03d}", snd))
    pipe = client.pipeline(transaction=False)

    def event(snd: Sender, rank: int, kind: str, **extra: Any) -> None:
        snd._add_batch(pipe, [("events", {"kind": kind, "rank": rank, "t": time.time(), "inc": inc, **extra})],
                       clean=True)

    for _run, rank, host, snd in senders:
        event(snd, rank, "run_start", host=host, pid=pid, world_size=ranks, local_rank=rank % 8, config="{}")
    pipe.execute()
    last = {key: (-1, inc) for key in range(len(senders))}  # each rank's last step and its time
    has_run0 = any(run == 0 for run, *_ in senders)
    next_hb = [0.0]

    def heartbeats(now: float) -> None:
        if now < next_hb[0]:
            return
        next_hb[0] = now + defaults.HEARTBEAT_INTERVAL_S
        for i, (_run, rank, host, snd) in enumerate(senders):
            step, step_t = last[i]
            pipe.hset(snd._keys.heartbeats, str(rank), json.dumps(
                {"t": now, "step": step, "step_t": step_t, "phase": "train", "host": host, "pid": pid, "inc": inc,
                 "mem": None, "gpu": None}))
        pipe.execute()

    ready.wait()
    go.wait()
    t0 = t0_box.value
    logged = 0
    parent = os.getppid()
    chunks = 5  # the ranks' flushes over the 0.25 s after a step, in 5 bursts of this process's ranks
    for s in range(steps):
        if os.getppid() != parent:
            os._exit(1)
        rng = random.Random(s)
        base = 2.0 + 1.5 * math.exp(-s / 300) + rng.gauss(0, 0.01)
        # Run 0's hang holds every rank of this process, as in _producer (its Monitors step one after another).
        due = t0 + s * step_s + (faults.delay(0, s) if has_run0 else 0.0)
        while time.time() < due:  # a hang: the steps stop, the heartbeats go on
            heartbeats(time.time())
            time.sleep(min(0.05, max(0.0, due - time.time())))
        for c in range(chunks):
            time.sleep(max(0.0, due + c * defaults.COLLECTOR_FLUSH_INTERVAL_S / chunks - time.time()))
            for i in range(c, len(senders), chunks):
                run, rank, host, snd = senders[i]
                sections, metrics = step_values(faults, run, rank, s, step_s, rng, base)
                now = time.time()
                rec: dict[str, Any] = {"rank": rank, "step": s, "inc": inc, "t": now, "dur": step_s * 0.8,
                                       **{"sec." + name: v for name, v in sections.items()}, **metrics}
                snd._add_batch(pipe, [("steps", rec)], clean=True)
                last[i] = (s, now)
                logged += 1
            pipe.execute()
        heartbeats(time.time())
    for _run, rank, _host, snd in senders:
        event(snd, rank, "run_end", status="finished")
        if rank == 0:
            pipe.hset(snd._keys.meta, mapping={"status": "finished", "ended_at": repr(time.time())})
    pipe.execute()
    done.put({"logged": logged, "closed": True, "dropped": 0})


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pcts(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return {"n": len(xs), "p50": q[49], "p99": q[98], "max": xs[-1]}


class SingleRedis(RedisProc):
    """A redis-server of the bench's own on a free port (bench/service_throughput.py's)."""

    def nodes(self) -> list[redis.Redis]:
        return [redis.Redis(port=self.port)]

    def pids(self) -> list[int]:
        return [self.proc.pid]


class ClusterRedis:
    """The tests' local Redis Cluster (3 primaries, 3 replicas)."""

    def __init__(self, directory: Path) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import RedisClusterProcs

        self.c = RedisClusterProcs(directory)
        try:
            self.c.start()
        except BaseException:
            self.c.stop()
            raise
        self.url = self.c.url

    def nodes(self) -> list[redis.Redis]:
        return [self.c.node(p) for p in self.c.primaries()]

    def pids(self) -> list[int]:
        return [p.pid for p in self.c.procs.values()]

    def stop(self) -> None:
        self.c.stop()


def used_memory(server: Any) -> int:
    """Bytes Redis uses for data and overhead, summed over the primaries."""
    return sum(int(n.info("memory")["used_memory"]) for n in server.nodes())


class AggPoller(threading.Thread):
    """Notes when each run's aggregates first appear (the bench's clock), polling every ``every`` seconds."""

    def __init__(self, url: str, runs: int, every: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.client = connect(url)
        self.runs, self.every = runs, every
        self.seen: dict[tuple[int, int], tuple[float, float]] = {}  # (run, step) -> (seen at, t_end)
        self.stop = threading.Event()

    def run(self) -> None:
        keys = [run_keys(run_name(i)).agg for i in range(self.runs)]
        while not self.stop.wait(self.every):
            try:
                pipe = self.client.pipeline(transaction=False)
                for k in keys:
                    pipe.xrevrange(k, count=200)
                replies = pipe.execute()
            except redis.RedisError:
                continue
            now = time.time()
            for i, entries in enumerate(replies):
                for _, f in entries:
                    key = (i, int(f[b"step"]))
                    if key not in self.seen:
                        self.seen[key] = (now, float(f[b"t_end"]))

    def lags(self) -> list[float]:
        return [seen - t_end for seen, t_end in self.seen.values()]


def collect(client: Any, runs: int, faults: Faults, step_s: float) -> dict[str, Any]:
    """What the services wrote: stored records, aggregates, anomaly openings."""
    records = aggs = processed = 0
    found: dict[str, Any] = {}
    for i in range(runs):
        keys = run_keys(run_name(i))
        t_end: dict[int, float] = {}
        for _, f in client.xrange(keys.agg):
            t_end[int(f[b"step"])] = float(f[b"t_end"])
            processed += int(f[b"n_ranks"])
            aggs += 1
        for _, f in client.xrange(keys.steps):
            records += int(f.get(b"n", len(json.loads(f[b"recs"]))))
        if i != 0:
            continue
        for eid, f in client.xrange(keys.anomaly_log):
            if f[b"transition"] != b"opened":
                continue
            kind, a = f[b"kind"].decode(), json.loads(f[b"json"])
            at = int(eid.split(b"-")[0]) / 1000
            found.setdefault(kind, []).append({"step": a.get("step"), "at": at,
                                               "lag_s": at - t_end[a["step"]] if a.get("step") in t_end else None})
    return {"records_stored": records, "records_processed": processed, "aggregates": aggs, "opened": found}


def dashboard_times(url: str) -> dict[str, Any]:
    """AppTest cold and refresh ms of the Runs and Overview pages of run 0."""
    import dashboard_scale

    os.environ["TRAINHEALTH_REDIS_URL"] = url
    dashboard_scale.warm_up(run_name(0))
    out = {}
    for page in ("pages/runs.py", "pages/overview.py"):
        r = dashboard_scale.apptest(dashboard_scale.APP, page, run_name(0), None, 3)
        out[page] = {"cold_ms": r["cold"], "refresh_ms": r["refresh"], "errors": r["errors"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024, help="ranks per run")
    ap.add_argument("--runs", type=int, default=1, help="concurrent runs")
    ap.add_argument("--step-s", type=float, default=1.0, help="seconds per step of every rank")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of stepping (wall)")
    ap.add_argument("--procs", type=int, default=8, help="producer processes hosting the Monitors")
    ap.add_argument("--services", type=int, default=1, help="trainhealth serve processes")
    ap.add_argument("--redis", choices=("single", "cluster"), default="single")
    ap.add_argument("--faults", default="straggler,spike,hang", help="comma-separated; empty for none")
    ap.add_argument("--hang-s", type=float, default=90.0, help="the hang's pause (s)")
    ap.add_argument("--dashboard", action="store_true", help="AppTest times of Runs and Overview after the load")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--collectors", choices=("monitor", "lite"), default="monitor",
                    help="monitor: a real Monitor (and its sender thread) per rank; lite: the collectors' Sender "
                         "objects written by each producer process itself (see _lite_producer), for 4,096 ranks")
    ap.add_argument("--linger", type=float, help="the services' --linger (default: theirs); 0 reads again at once")
    ap.add_argument("--profile", help="run the first service under cProfile, its profile written to this file")
    args = ap.parse_args()
    steps = max(10, int(args.duration / args.step_s))
    names = {f for f in args.faults.split(",") if f}
    unknown = names - {"straggler", "spike", "hang"}
    if unknown:
        ap.error(f"--faults: unknown {sorted(unknown)} (known: straggler, spike, hang)")
    faults = Faults(names, steps, args.ranks, args.hang_s)
    tmp = Path(tempfile.mkdtemp(prefix="th-load-"))
    services: list[subprocess.Popen] = []
    procs: list[Any] = []
    server: Any = None
    try:
        server = SingleRedis(prefix="th-load-") if args.redis == "single" else ClusterRedis(tmp)
        client = connect(server.url)
        mem0 = used_memory(server)
        env = {**os.environ, "TRAINHEALTH_REDIS_URL": server.url,
               "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        linger = [] if args.linger is None else ["--linger", str(args.linger)]
        services = [subprocess.Popen([sys.executable, *(prof if i == 0 else []), "-m", "trainhealth", "serve",
                                      *linger], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for i in range(args.services)]
        ctx = mp.get_context("spawn")
        pairs = [(r, k) for r in range(args.runs) for k in range(args.ranks)]
        flush_s = flush_interval(len(pairs))
        ready, go, done, t0_box = ctx.Barrier(args.procs + 1), ctx.Event(), ctx.Queue(), ctx.Value("d", 0.0)
        target = _lite_producer if args.collectors == "lite" else _producer
        procs = [ctx.Process(target=target, args=(server.url, pairs[i::args.procs], args.ranks, steps, args.step_s,
                                                     faults, flush_s, ready, go, t0_box, done))
                 for i in range(args.procs)]
        for p in procs:
            p.start()
        ready.wait(timeout=900)
        t0_box.value = time.time() + 3.0
        go.set()
        poller = AggPoller(server.url, args.runs)
        poller.start()
        cpu0 = [_cpu_s(s.pid) for s in services]
        rcpu0 = sum(_cpu_s(p) for p in server.pids())
        w0 = time.time()
        results = [done.get(timeout=args.duration + args.hang_s + 900) for _ in procs]
        for p in procs:
            p.join()
        produced_s = time.time() - w0
        total_aggs = args.runs * steps
        deadline = time.time() + 300
        while time.time() < deadline:
            if sum(client.xlen(run_keys(run_name(i)).agg) for i in range(args.runs)) >= total_aggs:
                break
            time.sleep(0.5)
        wall = time.time() - w0
        time.sleep(0.3)
        poller.stop.set()
        poller.join()
        cpu = [_cpu_s(s.pid) - c for s, c in zip(services, cpu0, strict=True)]
        rcpu = sum(_cpu_s(p) for p in server.pids()) - rcpu0
        mem1 = used_memory(server)
        load = os.getloadavg()
        got = collect(client, args.runs, faults, args.step_s)
        dash = dashboard_times(server.url) if args.dashboard else None
    finally:
        for s in services:
            s.terminate()
        for s in services:
            try:
                s.wait(30)
            except subprocess.TimeoutExpired:
                s.kill()
        for p in procs:
            if p.is_alive():
                p.terminate()
        if server is not None:
            server.stop()
    logged = sum(r["logged"] for r in results)
    stored = got["records_processed"]
    figures = {
        "config": {k: getattr(args, k) for k in ("ranks", "runs", "step_s", "duration", "procs", "services", "redis",
                                                  "faults", "hang_s", "collectors", "linger")},
        "steps": steps, "logged": logged, "stored": stored, "in_stream": got["records_stored"],
        "all_delivered": all(r["closed"] for r in results),
        "dropped": sum(r["dropped"] for r in results),
        "ingest_records_per_s": stored / produced_s, "offered_records_per_s": args.runs * args.ranks / args.step_s,
        "aggregates": got["aggregates"], "aggregates_expected": total_aggs,
        "agg_lag_s": _pcts(poller.lags()), "opened": got["opened"],
        "redis_bytes": mem1 - mem0, "redis_bytes_per_rank_step": (mem1 - mem0) / max(1, stored),
        "redis_bytes_per_hour": (mem1 - mem0) / produced_s * 3600,
        "service_cpu_us_per_record": 1e6 * sum(cpu) / max(1, stored),
        "service_cpu_pct_of_core": [100 * c / wall for c in cpu],
        "redis_cpu_us_per_record": 1e6 * rcpu / max(1, stored),
        "load_average": load, "dashboard": dash,
    }
    report(figures, faults)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def report(f: dict[str, Any], faults: Faults) -> None:
    """Print the figures."""
    c = f["config"]
    print(f"\n{c['runs']} run(s) x {c['ranks']} ranks, a step every {c['step_s']} s for {f['steps']} steps "
          f"({f['offered_records_per_s']:,.0f} records/s offered), {c['services']} service(s), Redis {c['redis']}; "
          f"load average {' '.join(f'{x:.2f}' for x in f['load_average'])}")
    print(f"records logged {f['logged']:,}, aggregated by the service {f['stored']:,} ({f['in_stream']:,} still "
          f"in the steps streams at the end), dropped {f['dropped']:,} "
          f"(all delivered: {f['all_delivered']}); "
          f"ingest {f['ingest_records_per_s']:,.0f} records/s over the stepping (pauses included); "
          f"aggregates {f['aggregates']:,} of "
          f"{f['aggregates_expected']:,}")
    lag = f["agg_lag_s"]
    if lag["n"]:
        print(f"detector lag (step complete -> aggregate written): p50 {lag['p50'] * 1e3:,.0f} ms, "
              f"p99 {lag['p99'] * 1e3:,.0f} ms, max {lag['max'] * 1e3:,.0f} ms over {lag['n']:,} aggregates")
    expected = {"straggler": faults.straggler and faults.straggler[1], "loss_spike": faults.spike,
                "hang": faults.hang and faults.hang[0]}
    for kind, onset in expected.items():
        if onset is None:
            continue
        hits = f["opened"].get(kind, [])
        if hits:
            h = hits[0]
            lag_s = "" if h["lag_s"] is None else f", {h['lag_s']:.1f} s after its step completed"
            print(f"  {kind}: injected at step {onset}, opened at step {h['step']}{lag_s}")
        else:
            print(f"  {kind}: injected at step {onset}, NOT opened")
    others = sorted(k for k in f["opened"] if k not in expected)
    if others:
        print("  also opened: " + ", ".join(f"{k} x{len(f['opened'][k])}" for k in others))
    print(f"Redis memory +{f['redis_bytes'] / 2**20:,.1f} MiB: {f['redis_bytes_per_rank_step']:,.0f} bytes per "
          f"rank-step stored, {f['redis_bytes_per_hour'] / 2**30:,.2f} GiB per hour at this rate")
    print(f"service CPU {f['service_cpu_us_per_record']:.1f} us per record "
          f"({', '.join(f'{p:.0f} %' for p in f['service_cpu_pct_of_core'])} of a core); Redis CPU "
          f"{f['redis_cpu_us_per_record']:.1f} us per record")
    if f["dashboard"]:
        for page, d in f["dashboard"].items():
            print(f"dashboard {page}: AppTest cold {d['cold_ms']:.0f} ms, refresh {d['refresh_ms']:.0f} ms"
                  + (f", errors {d['errors']}" if d["errors"] else ""))


if __name__ == "__main__":
    main()
