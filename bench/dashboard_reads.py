"""The dashboard's heavy reads at 1,024 ranks x 100,000 steps, each beside the plain reads it replaced.

Run: ``.venv/bin/python bench/dashboard_reads.py`` (about 5 minutes: the load is bench/dashboard_scale.py's, its
own redis-server on a free port); ``--ranks 64,4096`` for other sizes.

Per read, wall ms in this process, bytes Redis sent (``INFO stats`` ``total_net_output_bytes``) and ms Redis spent
executing it (``INFO commandstats`` ``usec``, summed): what the read costs the dashboard, the network, and the server
every collector and the detector service share. A read done in Redis (a read-only Lua script) sends few bytes but
takes Redis time (decoding JSON there): both are shown, so each choice can be checked. Medians of ``--repeats``
(the first call, which sends the script to Redis once, left out). The "plain" rows are the commands the dashboard
issued for the same figures before issue 16's last changes (commit 4cf3f77's ``dashboard/data.py``); the plain
rank-hosts read is the one it still uses (its reduction in Redis was measured slower, see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, run as scripts from here

import dashboard_scale
import redis

from trainhealth.dashboard import data
from trainhealth.keys import run_keys


class Existing(dashboard_scale.RedisProc):
    """A redis-server already running (``--redis-url``): its counters, never stopped here."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stats = redis.Redis.from_url(url)
        self.info_bytes = statistics.median(-self.out_bytes() + self.out_bytes() for _ in range(5))

    def stop(self) -> None:
        self.stats.close()


def measure(rp: dashboard_scale.RedisProc, client: redis.Redis, fn: Callable[[], Any],
            repeats: int) -> dict[str, float]:
    """Median wall ms, bytes sent and Redis ms of ``fn()`` (one unmeasured call first)."""
    fn()
    walls, sent, busy = [], [], []
    for _ in range(repeats):
        u0 = rp.busy_us()  # before the byte count starts: its own INFO reply is not the read's
        b0 = rp.out_bytes()
        t0 = time.perf_counter()
        fn()
        walls.append((time.perf_counter() - t0) * 1e3)
        sent.append(rp.sent_since(b0))
        busy.append((rp.busy_us() - u0) / 1e3)
    return {"ms": statistics.median(walls), "bytes": statistics.median(sent), "redis_ms": statistics.median(busy)}


def plain_ledger_whole(client: redis.Redis, key: str, points: int) -> list:
    """The former whole-run sample: one pipelined ``XRANGE <t> + COUNT 1`` per point, whole snapshots."""
    (first, _), = client.xrange(key, count=1)
    (last, _), = client.xrevrange(key, count=1)
    t0, t1 = (int(x.split(b"-")[0]) for x in (first, last))
    pipe = client.pipeline(transaction=False)
    for i in range(points - 1):
        pipe.xrange(key, min=str(round(t0 + (t1 - t0) * i / (points - 1))), count=1)
    pipe.xrevrange(key, count=1)
    return pipe.execute()


def reads(client: redis.Redis, run: str) -> list[tuple[str, str, Callable[[], Any]]]:
    """(what, how, read) of each measured read: the plain one, then the dashboard's."""
    k = run_keys(run)
    overview_paths = ("t", "throughput_tok_s", "goodput_tok_s")
    goodput_paths = ("t", "wall_s", "throughput_tok_s", "goodput_tok_s", "seconds", "rates.60s")

    def plain_state() -> list:
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(k.heartbeats)
        pipe.xrevrange(k.agg, count=1)
        return pipe.execute()

    return [
        ("service banner: processing state", "plain: HGETALL hb + XREVRANGE agg COUNT 1", plain_state),
        ("service banner: processing state", "PROCESSING_STATE_SCRIPT", lambda: data.processing_state(client, run)),
        ("Overview goodput chart (whole run)", "plain: 1,200 x XRANGE COUNT 1, whole snapshots",
         lambda: plain_ledger_whole(client, k.ledger, 1_200)),
        ("Overview goodput chart (whole run)", "LEDGER_SAMPLE_SCRIPT, 1,200 points, 3 paths",
         lambda: data.ledger_history_whole(client, run, 1_200, paths=overview_paths)),
        ("Overview goodput chart (whole run)", "LEDGER_SAMPLE_SCRIPT, 600 points, 3 paths (used)",
         lambda: data.ledger_history_whole(client, run, 600, paths=overview_paths)),
        ("Goodput charts (1 h)", "plain: XREVRANGE ledger COUNT 1,800",
         lambda: client.xrevrange(k.ledger, count=1_800)),
        ("Goodput charts (1 h)", "LEDGER_SAMPLE_SCRIPT, 600 of 1,800, 6 paths (used)",
         lambda: data.ledger_history(client, run, 1_800, 600, paths=goodput_paths)),
        ("Goodput charts (whole run)", "LEDGER_SAMPLE_SCRIPT, 600 points, 6 paths (used)",
         lambda: data.ledger_history_whole(client, run, 600, paths=goodput_paths)),
        ("Overview checkpoint markers", "plain: newest 10,000 events, decoded (data.events)",
         lambda: data.events(client, run)),
        ("Overview checkpoint markers", "th:{run}:checkpoints (data.checkpoints, used)",
         lambda: data.checkpoints(client, run)),
        ("Ranks window, cold", "plain: XREVRANGE agg COUNT 500 (data.RankWindow, no budget)",
         lambda: data.RankWindow(run, 500).refresh(client)),
        ("Ranks window, cold", "RankWindow 131,072 values (RANK_WINDOW_SCRIPT, used)",
         lambda: data.RankWindow(run, 500, values=131_072).refresh(client)),
        ("Ranks hosts", "plain: events pages + hb (data.rank_hosts, used)", lambda: data.rank_hosts(client, run)),
    ]


def main() -> int:
    """Load each size, measure every read, print a Markdown table per size."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1024", help="rank counts, comma-separated")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--redis-url", help="measure a run already loaded there (by this benchmark's load) instead")
    ap.add_argument("--run", default=None, help="with --redis-url: the run (default scale-<ranks>)")
    args = ap.parse_args()
    print(f"command: {' '.join(sys.argv)}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for world in (int(x) for x in args.ranks.split(",")):
        rp = Existing(args.redis_url) if args.redis_url else dashboard_scale.RedisProc()
        try:
            run = args.run or f"scale-{world}"
            if not args.redis_url:
                window = max(1, min(2_000, 4_100_000 // world, args.steps))
                plan = dashboard_scale.make_plan(world, args.steps, window, time.time())
                svc, _ = dashboard_scale.load_run(rp, plan, None)
                svc.beat()
                run = plan.run
            client = redis.Redis.from_url(rp.url)
            print(f"\n**{world:,} ranks x {args.steps:,} steps** (`{run}`)\n\n| read | how | ms | bytes | Redis ms |\n"
                  "|---|---|---|---|---|")
            for what, how, fn in reads(client, run):
                m = measure(rp, client, fn, args.repeats)
                print(f"| {what} | {how} | {m['ms']:,.1f} | {m['bytes']:,.0f} | {m['redis_ms']:,.1f} |", flush=True)
        finally:
            rp.stop()
    print(f"\nload average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    sys.exit(main())
