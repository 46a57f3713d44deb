"""Ingest: step records per second from 64 simulated ranks into one Redis, against the XADD ceiling.

Run: ``.venv/bin/python bench/ingest.py [--ranks 64] [--steps 2000] [--procs 2]``

Starts its own redis-server (no persistence). The ceiling is ``redis-benchmark`` issuing
single-record ``XADD``s of the same 13 fields with 64 clients, pipelining 100 deep, against
the same server in the same run. Ours: ``--procs`` processes each host ``ranks / procs`` real
``trainhealth.Monitor`` objects (in a real job each rank is its own process with one sender
thread; many monitors in one process fight over its GIL, so use several processes), each
logging ``--steps`` points as fast as it can: one ``log_step`` per point, or with
``--instrumented`` a fully timed step (``step()`` + 3 sections + ``log_step``). Producers,
senders and the server share this machine's cores. The figure is records landed in
Redis per second, from the first record to the last one delivered; every record is counted
back from the stream afterwards.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from trainhealth.embedded_redis import EmbeddedRedis, free_port

FIELDS = ["rank", "3", "step", "12345", "inc", "1796011602.0115", "t", "1796011602.0127", "dur", "0.0612",
          "loss", "2.3857", "grad_norm", "0.924", "lr", "3e-05", "tokens", "8192", "samples", "4",
          "sec.data", "0.0088", "sec.forward_backward", "0.045", "sec.optimizer", "0.004"]


def ceiling(port: int, n: int) -> float:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return float("nan")
    out = subprocess.run([exe, "-p", str(port), "-c", "64", "-n", str(n), "-P", "100", "-q",
                          "XADD", "bench:ceiling", "MAXLEN", "~", "1000000", "*", *FIELDS],
                         capture_output=True, text=True, check=True).stdout
    m = re.findall(r"([\d.]+) requests per second", out)
    return float(m[-1])


def _producer(url: str, ranks: list[int], world: int, steps: int, instrumented: bool, ready, go, done) -> None:
    from trainhealth import Monitor

    mons = [Monitor("ingest", redis_url=url, rank=r, world_size=world, buffer_records=steps + 10,
                    spill_dir=False, close_timeout=300, heartbeat_interval=60) for r in ranks]
    ready.wait()
    go.wait()
    for step in range(steps):
        for mon in mons:
            if not instrumented:
                mon.log_step(step, loss=2.5, grad_norm=1.0, lr=3e-4, tokens=8192, samples=4)
                continue
            with mon.step(step):
                with mon.section("data"):
                    pass
                with mon.section("forward_backward"):
                    pass
                with mon.section("optimizer"):
                    pass
            mon.log_step(step, loss=2.5, grad_norm=1.0, lr=3e-4, tokens=8192, samples=4)
    ok = all(m.close() for m in mons)
    done.put((time.time(), ok))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--instrumented", action="store_true",
                    help="each point is a fully timed step (step() + 3 sections + log_step), not one log_step")
    args = ap.parse_args()
    emb = EmbeddedRedis(Path(tempfile.mkdtemp()), port=free_port())
    url = emb.ensure_running()
    client = redis.Redis.from_url(url)
    client.config_set("appendonly", "no")
    client.config_set("save", "")
    try:
        ceil = ceiling(emb_port(url), 1_000_000)
        client.flushall()
        ctx = mp.get_context("spawn")
        ready = ctx.Barrier(args.procs + 1)
        go = ctx.Event()
        done = ctx.Queue()
        per = [list(range(i, args.ranks, args.procs)) for i in range(args.procs)]
        procs = [ctx.Process(target=_producer,
                             args=(url, rs, args.ranks, args.steps, args.instrumented, ready, go, done))
                 for rs in per]
        for p in procs:
            p.start()
        ready.wait()
        t0 = time.time()
        go.set()
        ends = [done.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        t1 = max(t for t, _ in ends)
        total = 0
        for _, fields in client.xrange("th:{ingest}:steps"):
            total += int(fields[b"n"])
        entries = client.xlen("th:{ingest}:steps")
        rate = total / (t1 - t0)
        expected = args.ranks * args.steps
        print(f"redis-server {client.info('server')['redis_version']}, {args.procs} producer processes, "
              f"{args.ranks} ranks x {args.steps} steps, "
              f"{'step()+3 sections+log_step' if args.instrumented else 'log_step'} per point")
        print(f"ceiling: redis-benchmark XADD (13 fields, 64 clients, pipeline 100): {ceil:,.0f} entries/s")
        print(f"ours: {total:,} of {expected:,} records delivered in {t1 - t0:.2f} s = {rate:,.0f} records/s "
              f"in {entries:,} entries ({total / max(entries, 1):.0f} records/entry); all closed ok: "
              f"{all(ok for _, ok in ends)}")
        print(f"ratio to ceiling: {rate / ceil:.2f}")
        print(json.dumps({"ceiling_entries_s": ceil, "records_s": rate, "ratio": rate / ceil}))
    finally:
        emb.stop()


def emb_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


if __name__ == "__main__":
    main()
