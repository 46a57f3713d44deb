"""A job logging as fast as it can: does the detector service stay alive, bounded and caught up?

Run: ``.venv/bin/python bench/fast_job.py [--seconds 20]`` (starts its own redis-server; about 2 minutes).

One process runs a :class:`~trainhealth.Monitor` calling ``log_step`` in a tight loop for ``--seconds``
(the collector keeps what its sender can push and counts the rest as drops); a ``trainhealth serve``
process consumes it. Every 0.5 s the bench samples the service's resident memory (``/proc``), the age of
its heartbeat key and the entries its consumer group has not acknowledged; after the job ends it waits
until the service has aggregated the last step sent. It does this twice, in the same invocation:
with reads bounded in records (``READ_RECORDS``, the default) and with the earlier bound of
``READ_COUNT`` entries per read whatever they hold (``READ_RECORDS`` set out of reach), the baseline.
Prints per configuration: records sent and dropped, the service's peak RSS, the oldest heartbeat seen,
the peak unacknowledged entries, catch-up seconds after the job ended, and critical anomalies raised
(a live rank must raise none).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from trainhealth.embedded_redis import find_redis_server, free_port

JOB = textwrap.dedent("""
    import json, sys, time
    from trainhealth.collectors import Monitor
    mon = Monitor("fast", redis_url=sys.argv[1], rank=0, world_size=1, spill_dir=False)
    end, s = time.monotonic() + float(sys.argv[2]), 0
    while time.monotonic() < end:
        mon.log_step(s, loss=2.0 + 0.001 * (s % 7), grad_norm=1.0, tokens=1024)
        s += 1
    sender = mon._sender
    mon.close()
    print(json.dumps({"steps": s, "sent": sender.sent, "dropped": sender.dropped_total}))
""")

SERVE = textwrap.dedent("""
    import sys
    from trainhealth import defaults
    defaults.READ_RECORDS = int(sys.argv[2])
    from trainhealth.commands import main
    sys.exit(main(["serve", "--redis-url", sys.argv[1], "--consumer", "svc"]))
""")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _last_step(r: redis.Redis) -> int:
    last = r.xrevrange("th:{fast}:agg", count=1)
    return int(last[0][0].decode().split("-")[1]) if last else -1


def one(read_records: int, seconds: float) -> dict[str, Any]:
    """One configuration against a fresh redis-server; returns its figures."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with tempfile.TemporaryDirectory() as d:
        srv = subprocess.Popen([find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no",
                                "--dir", d], stdout=subprocess.DEVNULL)
        svc = job = None
        try:
            r = redis.Redis.from_url(url)
            for _ in range(100):
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            svc = subprocess.Popen([sys.executable, "-c", SERVE, url, str(read_records)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while not r.exists("th:service:svc"):
                time.sleep(0.1)
            time.sleep(2.0)  # its imports done
            job = subprocess.Popen([sys.executable, "-c", JOB, url, str(seconds)], stdout=subprocess.PIPE, text=True)
            rss = beat_age = pending = 0.0
            t_end = None
            done: dict[str, Any] = {}
            deadline = time.monotonic() + seconds + 600
            while time.monotonic() < deadline:
                rss = max(rss, _rss_mb(svc.pid))
                raw = r.get("th:service:svc")
                beat = json.loads(raw) if raw else None
                beat_age = max(beat_age, time.time() - beat["t"] if beat else float("inf"))
                with_group = r.exists("th:{fast}:steps") and r.xinfo_groups("th:{fast}:steps")
                if with_group:
                    pending = max(pending, with_group[0]["pending"])
                if t_end is None and job.poll() is not None:
                    t_end = time.monotonic()
                    done = json.loads(job.stdout.read())
                if t_end is not None and _caught_up(r):
                    break
                time.sleep(0.5)
            catch_up = time.monotonic() - t_end if t_end is not None else float("nan")
            critical = [json.loads(v) for v in r.hvals("th:{fast}:anomalies")]
            return {"read_records": read_records, "steps": done.get("steps"), "sent": done.get("sent"),
                    "dropped": done.get("dropped"), "rss_peak_mb": round(rss, 1), "heartbeat_age_max_s":
                    round(beat_age, 1), "pending_peak": int(pending), "catch_up_s": round(catch_up, 1),
                    "critical": sorted(a["kind"] for a in critical if a.get("severity") == "critical")}
        finally:
            for p in (job, svc):
                if p is not None and p.poll() is None:
                    p.terminate()
                    p.wait(30)
            srv.terminate()
            srv.wait(10)


def _caught_up(r: redis.Redis) -> bool:
    """Every entry of the run's steps stream delivered to the group and acknowledged."""
    groups = r.xinfo_groups("th:{fast}:steps")
    last = r.xrevrange("th:{fast}:steps", count=1)
    return bool(groups and last) and groups[0]["pending"] == 0 and groups[0]["last-delivered-id"] == last[0][0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="how long the job logs")
    args = p.parse_args()
    from trainhealth import defaults

    rows = [one(defaults.READ_RECORDS, args.seconds), one(10**12, args.seconds)]
    print(f"a job logging as fast as it can for {args.seconds:.0f} s, cpus {os.cpu_count()}")
    print(f"{'reads bounded by':>26} {'steps':>10} {'sent':>10} {'dropped':>10} {'RSS peak':>9} "
          f"{'beat age':>9} {'pending':>8} {'catch-up':>9}  critical")
    for row, label in zip(rows, (f"{defaults.READ_RECORDS:,} records", f"{defaults.READ_COUNT:,} entries (before)"),
                          strict=True):
        print(f"{label:>26} {row['steps']:>10,} {row['sent']:>10,} {row['dropped']:>10,} {row['rss_peak_mb']:>6.0f} MB "
              f"{row['heartbeat_age_max_s']:>7.1f} s {row['pending_peak']:>8,} {row['catch_up_s']:>7.1f} s  "
              f"{row['critical'] or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
