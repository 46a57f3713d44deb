"""Detector services sharing runs: even split, rebalancing as services join and leave, failover seconds.

Run: ``.venv/bin/python bench/failover.py`` (starts its own redis-server; about 70 s). Options:
``--services 4 --runs 16 --ranks 2 --step-s 0.2 --steps 300``.

Live runs are logged through the real collector (one :class:`~trainhealth.Monitor` per rank, in this
process) while ``trainhealth serve`` processes share them on one Redis. It starts the services a
second apart (each join rebalances), then SIGKILLs one (its leases expire: failover), SIGTERMs
another (a clean stop hands its runs over at once) and starts a new one (a join). For each it prints
the seconds until every run is held by a live service, shared evenly, and processed again (its
aggregate stream passed the step it had reached when the fault came). At the end it checks that no
step was lost or written twice and that each anomaly was opened exactly once, although the runs
moved between processes. A loss spike is logged in every run at steps 60 and 200: one before the
faults (the rebuilds must not reopen it), one after.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from trainhealth.collectors import Monitor
from trainhealth.detectors.service import fair_share
from trainhealth.embedded_redis import find_redis_server, free_port

SPIKES = (60, 200)


def _owners(r: redis.Redis, runs: list[str]) -> list[str | None]:
    raw = r.mget([f"th:{{{run}}}:owner" for run in runs])
    return [v.decode() if v else None for v in raw]


def _last_step(r: redis.Redis, run: str) -> int:
    last = r.xrevrange(f"th:{{{run}}}:agg", count=1)
    return int(last[0][0].decode().split("-")[1]) if last else -1


def _balanced(r: redis.Redis, runs: list[str], live: list[str]) -> bool:
    owners = _owners(r, runs)
    if any(o not in live for o in owners):
        return False
    got = Counter(owners)
    live = sorted(live)
    return all(got.get(s, 0) == fair_share(len(runs), live, s) for s in live)


def _wait(pred, timeout: float, poll: float = 0.05) -> float:
    """Seconds until ``pred()`` holds; raises TimeoutError after ``timeout`` s."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"not reached in {timeout:.0f} s")
        time.sleep(poll)
    return time.monotonic() - t0


class _Writers(threading.Thread):
    """Every run's ranks log one step per ``step_s`` seconds through real Monitors, a spike at SPIKES."""

    def __init__(self, url: str, runs: list[str], ranks: int, step_s: float, steps: int) -> None:
        super().__init__(daemon=True, name="writers")
        self.mons = [Monitor(run, redis_url=url, rank=k, world_size=ranks, host=f"node-{k}", flush_interval=0.05,
                             spill_dir=False) for run in runs for k in range(ranks)]
        self.step_s, self.steps = step_s, steps
        self.step = -1

    def run(self) -> None:
        t0 = time.monotonic()
        for s in range(self.steps):
            loss = 2.0 - s / 1000 + 0.01 * ((s * 7) % 5) + (3.0 if s in SPIKES else 0.0)
            for mon in self.mons:
                mon.log_step(s, loss=loss, grad_norm=1.0, tokens=4096)
            self.step = s
            time.sleep(max(0.0, t0 + (s + 1) * self.step_s - time.monotonic()))
        for mon in self.mons:
            mon.close()


def run(services: int = 4, runs: int = 16, ranks: int = 2, step_s: float = 0.2, steps: int = 300,
        log_dir: Path | None = None) -> dict[str, Any]:
    """Run the scenario; return its figures (seconds, counts) and the exactly-once checks.

    Returns a dict: ``join_s`` (after the last start, until the runs are shared evenly), and for
    ``kill`` (SIGKILL), ``term`` (SIGTERM) and ``join`` (one more service): ``held_s`` (every run held
    by a live service, shared evenly) and ``resumed_s`` (every run the fault moved processed again);
    ``shares`` before and after each; ``steps_missing``/``steps_extra`` per run and ``opened`` (anomaly
    id -> times opened, over all runs) for the checks. Raises TimeoutError if a phase does not settle
    within 60 s.
    """
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    tmp = Path(tempfile.mkdtemp(prefix="th-failover-"))
    log_dir = log_dir or tmp
    srv = subprocess.Popen([find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no",
                            "--dir", str(tmp)], stdout=subprocess.DEVNULL)
    procs: dict[str, subprocess.Popen] = {}
    logs: list[Any] = []
    out: dict[str, Any] = {"services": services, "runs": runs, "ranks": ranks, "step_s": step_s}
    try:
        r = redis.Redis.from_url(url)
        _wait(lambda: _ping(r), 10)
        names = [f"run-{i:02d}" for i in range(runs)]

        def start(name: str) -> None:
            f = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed at the end
            logs.append(f)
            procs[name] = subprocess.Popen([sys.executable, "-m", "trainhealth", "serve", "--redis-url", url,
                                            "--consumer", name], stdout=f, stderr=subprocess.STDOUT)

        def live() -> list[str]:
            return sorted(n for n, p in procs.items() if p.poll() is None)

        writers = _Writers(url, names, ranks, step_s, steps)
        writers.start()
        for i in range(services):
            start(f"svc-{i}")
            time.sleep(1.0)
        out["join_s"] = round(_wait(lambda: _balanced(r, names, live()), 60), 2)
        out["shares_start"] = dict(sorted(Counter(_owners(r, names)).items()))

        def fault(label: str, act) -> None:
            before = dict(zip(names, _owners(r, names), strict=True))
            reached = {n: _last_step(r, n) for n in names}
            t0 = time.monotonic()
            act()
            held = _wait(lambda: _balanced(r, names, live()), 60)
            after = dict(zip(names, _owners(r, names), strict=True))
            moved = [n for n in names if after[n] != before[n]]
            _wait(lambda: all(_last_step(r, n) > reached[n] + 1 for n in moved), 60)
            out[label] = {"held_s": round(held, 2), "resumed_s": round(time.monotonic() - t0, 2),
                          "moved": len(moved), "shares": dict(sorted(Counter(after.values()).items()))}

        def stop(name: str, sig: int) -> None:
            procs[name].send_signal(sig)
            procs[name].wait(30)  # a clean stop's own seconds count too

        fault("kill", lambda: stop("svc-0", signal.SIGKILL))
        fault("term", lambda: stop("svc-1", signal.SIGTERM))
        fault("join", lambda: start(f"svc-{services}"))
        writers.join(timeout=steps * step_s + 60)
        # Every run's last step aggregated (the ranks' run_end closes it).
        _wait(lambda: all(_last_step(r, n) == steps - 1 for n in names), 60, poll=0.2)
        missing, extra, opened = {}, {}, Counter()
        for n in names:
            got = [int(i.decode().split("-")[1]) for i, _ in r.xrange(f"th:{{{n}}}:agg")]
            missing[n] = len(set(range(steps)) - set(got))
            extra[n] = len(got) - len(set(got))
            for _, f in r.xrange(f"th:{{{n}}}:anomaly_log"):
                if f[b"transition"] == b"opened":
                    opened[f"{n}/{f[b'id'].decode()}"] += 1
        out["steps_missing"] = sum(missing.values())
        out["steps_extra"] = sum(extra.values())
        out["opened"] = dict(opened)
        out["spikes_opened"] = sorted(Counter(k.split("/")[1] for k in opened if "loss_spike" in k).items())
        beats = [json.loads(v) for v in r.mget([f"th:service:{s}" for s in live()]) if v]
        out["processed"] = sum(b.get("processed", 0) for b in beats)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()
        srv.terminate()
        srv.wait(10)
    return out


def _ping(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.ConnectionError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--services", type=int, default=4)
    p.add_argument("--runs", type=int, default=16)
    p.add_argument("--ranks", type=int, default=2, help="ranks per run")
    p.add_argument("--step-s", type=float, default=0.2, help="seconds per step")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    out = run(args.services, args.runs, args.ranks, args.step_s, args.steps)
    print(f"{args.services} services, {args.runs} runs x {args.ranks} ranks, a step every {args.step_s} s")
    print(f"started a second apart: shared evenly {out['join_s']:.2f} s after the last start: {out['shares_start']}")
    for label, what in (("kill", "SIGKILL of one service"), ("term", "SIGTERM of another"),
                        ("join", "a new service joins")):
        f = out[label]
        print(f"{what:>24}: every run held, evenly, after {f['held_s']:5.2f} s; the {f['moved']} moved runs "
              f"processed again after {f['resumed_s']:5.2f} s; shares {f['shares']}")
    dup = sum(1 for v in out["opened"].values() if v > 1)
    print(f"steps lost {out['steps_missing']}, written twice {out['steps_extra']}; anomalies opened twice {dup} "
          f"of {len(out['opened'])}; loss spikes opened {out['spikes_opened']}")
    ok = out["steps_missing"] == out["steps_extra"] == dup == 0 and not math.isnan(out["join_s"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
