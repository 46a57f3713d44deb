"""Redis memory per step record in the step stream, for the retention bound (``TRAINHEALTH_RETENTION``, in records).

Runs a ``Monitor`` against a fresh redis-server (the embedded binary, else ``redis-server`` on PATH) and logs timed
steps like ``examples/torchrun_gpt.py``'s (three sections; loss, grad norm, lr, tokens, samples, consumed samples),
once in the default 1,000-record entries and once at one record an entry (the baseline, in the same run), then
prints ``MEMORY USAGE`` of each stream per record, and checks the retention holds in records with batching.

    .venv/bin/python bench/stream_memory.py [--records 100000]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time

import redis

from trainhealth import Monitor
from trainhealth.embedded_redis import find_redis_server, free_port


def fill(url: str, run: str, records: int, batch: int, retention: int) -> None:
    mon = Monitor(run, redis_url=url, rank=0, world_size=1, batch_records=batch, buffer_records=records + 10,
                  retention=retention, close_timeout=300, spill_dir=False)
    for s in range(records):
        with mon.step(s):
            with mon.section("data"):
                pass
            with mon.section("forward"):
                pass
            with mon.section("optimizer"):
                pass
        mon.log_step(s, loss=2.0 + s * 1e-6, grad_norm=0.5, lr=3e-4, tokens=512, samples=8,
                     consumed_samples=(s + 1) * 32)
    mon.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=100_000, help="records per configuration")
    args = p.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        srv = subprocess.Popen([find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no",
                                "--dir", d], stdout=subprocess.DEVNULL)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            r = redis.Redis.from_url(url)
            while True:
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            print(f"{'records/entry':>14} {'records':>9} {'entries':>8} {'bytes':>12} {'B/record':>9}")
            for batch, n in ((1, min(args.records, 20_000)), (1000, args.records)):
                run = f"mem-{batch}"
                fill(url, run, n, batch, retention=10**9)
                key = f"th:{{{run}}}:steps"
                used = r.memory_usage(key, samples=0)
                print(f"{batch:>14} {n:>9,} {r.xlen(key):>8,} {used:>12,} {used / n:>9.1f}")
            # The retention counts records: 1,000-record entries against a 20,000-record bound.
            fill(url, "mem-trim", args.records, 1000, retention=20_000)
            entries = r.xrange("th:{mem-trim}:steps")
            kept = sum(int(f[b"n"]) for _, f in entries)
            print(f"retention 20,000 records, {args.records:,} logged in 1,000-record entries: kept {kept:,} "
                  f"records in {len(entries)} entries")
        finally:
            srv.terminate()
            srv.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
