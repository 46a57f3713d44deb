"""Longest hot-path calls of the collector across a Redis outage and reconnect (issue 15).

Run: ``.venv/bin/python bench/collector_outage.py`` (about 2 minutes; ``--help`` for the phase
lengths, rates and scenarios). It starts its own redis-server (``EmbeddedRedis`` on a
``free_port``, persistence on) from a helper process, so stopping and restarting the server
never forks the measured process.

A training-like thread runs, per step, ``with mon.step(i): with mon.section("fwd"): <work>``
then ``mon.log_step(i, ...)``, then a CONTROL operation (a dict of the record's 15 fields built and
appended to a bounded deque, as the hot path does; nothing of the collector), then sleeps until the
next step is due. The work holds the GIL (a Python spin loop, like a framework dispatching ops)
for ``--gil-frac`` of the step period; the sleep releases it (like waiting on the GPU or a
collective). Every call is timed with ``time.perf_counter_ns``: the section block is the
collector's part of it (entering the step and the section, leaving both; the work excluded),
``log_step`` the call, the control its own build + append. ``sleep+`` is how late each sleep
returned (the OS wake-up plus the wait for the GIL: it shows another thread holding the GIL, the
sender's long stretches in particular).

Phases of each scenario: ``up`` (Redis up, warm), ``down`` (Redis shut down: the sender buffers,
and with a spill moves the buffer to disk once half full), ``drain`` (from the restart until the
backlog is sent: the reconnect back-off, the reconnect and the drain), ``after`` (the rest of the
window after the restart). Default scenarios: ``fast-spill`` (``--rate`` steps/s, spill on),
``fast-nospill`` (same, ``spill_dir=False``), ``slow-spill`` (``--slow-rate`` steps/s, spill on).

Prints, per scenario and phase, n and the p50, p99, p99.9, p99.99 and max in microseconds of the
section block, ``log_step``, the control and ``sleep+``, and the garbage collections in that phase
(count, longest, which thread paid); then the records put vs stored in Redis plus the drops counted
(they must balance) and whether every stored step arrived once, in order.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from trainhealth import Monitor  # noqa: E402
from trainhealth.embedded_redis import free_port  # noqa: E402

PHASES = ("up", "down", "drain", "after")
OPS = ("section block", "log_step", "control", "sleep+")
QUANTILES = (0.5, 0.99, 0.999, 0.9999)

# The redis-server is stopped and started from this helper process (one line per command on stdin,
# one line of reply): the measured process never forks or waits on a subprocess during a phase.
_HELPER = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from trainhealth.embedded_redis import EmbeddedRedis
emb = EmbeddedRedis(Path(sys.argv[1]), port=int(sys.argv[2]))
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "start":
        print(emb.ensure_running(), flush=True)
    elif cmd == "stop":
        emb.stop()
        print("stopped", flush=True)
emb.stop()
"""


class RedisControl:
    """A redis-server on a fixed port that can be shut down and restarted (with its data: AOF + RDB)."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self._proc = subprocess.Popen([sys.executable, "-c", _HELPER, str(directory), str(self.port), str(ROOT)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.url = self._ask("start")
        if not self.url.endswith(f":{self.port}/0"):
            raise RuntimeError(f"redis-server came up on {self.url}, not port {self.port}")

    def _ask(self, cmd: str) -> str:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(cmd + "\n")
        self._proc.stdin.flush()
        return self._proc.stdout.readline().strip()

    def stop(self) -> None:
        """Shut the server down (``SHUTDOWN SAVE``: every acknowledged write is kept)."""
        self._ask("stop")

    def start(self) -> None:
        """Start it again on the same port; returns once it answers PING."""
        if self._ask("start") != self.url:
            raise RuntimeError("redis-server did not come back on the same port")

    def close(self) -> None:
        """Stop the server and the helper."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(30)


@dataclass
class State:
    """Shared between the controller (main thread) and the training thread: plain attributes, read per step."""

    phase: int = 0
    stop: bool = False
    starts: list[float] = field(default_factory=list)  # time.monotonic() each phase began, and the end
    steps: int = 0
    gcs: list[tuple[int, int, int, bool]] = field(default_factory=list)  # (phase, generation, ns, in trainer)


def train(mon: Monitor, state: State, rate: float, gil_frac: float,
          rec: list[tuple[array, array, array, array]]) -> None:
    """The training-like loop; appends each call's duration (ns) to ``rec[phase]`` (section, log_step,
    control, sleep overshoot). ``array('q')`` keeps no object per sample: the bench adds no GC pressure."""
    pc = time.perf_counter_ns
    sleep = time.sleep
    period = 1e9 / rate
    work_ns = int(period * gil_frac)
    ctl: deque[dict[str, Any]] = deque(maxlen=1000)
    step, section, log_step = mon.step, mon.section, mon.log_step
    i = 0
    next_t = float(pc())
    while not state.stop:
        sec_a, log_a, ctl_a, slp_a = rec[state.phase]
        t0 = pc()
        with step(i), section("fwd"):
            t1 = pc()
            end = t1 + work_ns
            while pc() < end:  # the step's GIL-holding work, not timed
                pass
            t2 = pc()
        t3 = pc()
        log_step(i, loss=2.5, grad_norm=1.0, lr=3e-4, tokens=4096)
        t4 = pc()
        ctl.append({"rank": 0, "step": i, "inc": 1.0, "t": 1.0, "dur": 1.0, "sec.fwd": 1.0, "loss": 2.5,
                    "grad_norm": 1.0, "lr": 3e-4, "tokens": 4096, "samples": None, "consumed_samples": None,
                    "batch_index": None, "skipped": None, "step_s": None})
        t5 = pc()
        sec_a.append(t1 - t0 + t3 - t2)
        log_a.append(t4 - t3)
        ctl_a.append(t5 - t4)
        i += 1
        state.steps = i
        next_t += period
        wait = next_t - t5
        if wait > 0:
            sleep(wait / 1e9)
            slp_a.append(int(pc() - t5 - wait))
        elif wait < -50 * period:  # far behind (descheduled): start the schedule again rather than burst
            next_t = float(t5)


def quantile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank quantile of sorted values (ns)."""
    return float(sorted_ns[max(0, math.ceil(q * len(sorted_ns)) - 1)])


def run_scenario(name: str, ctl: RedisControl, args: argparse.Namespace, spill: Path | None, rate: float) -> bool:
    """One warm → outage → restart run; prints its table; returns whether the records balance."""
    run = f"outage-{name}-{os.getpid()}"
    state = State()
    rec = [(array("q"), array("q"), array("q"), array("q")) for _ in PHASES]
    mon = Monitor(run, redis_url=ctl.url, rank=0, world_size=1, spill_dir=spill if spill is not None else False,
                  buffer_records=args.buffer_records, retention=10**9, close_timeout=300)
    if not mon.flush(10):
        raise RuntimeError("the collector did not connect")
    trainer = threading.Thread(target=train, args=(mon, state, rate, args.gil_frac, rec), name="trainer")
    pc = time.perf_counter_ns

    def on_gc(stage: str, info: dict[str, Any]) -> None:
        nonlocal gc_t0
        if stage == "start":
            gc_t0 = pc()
        else:
            state.gcs.append((state.phase, info["generation"], pc() - gc_t0, threading.current_thread() is trainer))

    gc_t0 = 0
    gc.collect()
    gc.callbacks.append(on_gc)
    try:
        state.starts.append(time.monotonic())
        trainer.start()
        time.sleep(args.warm)
        state.starts.append(time.monotonic())
        state.phase = 1
        ctl.stop()
        t_down = time.monotonic()
        peak = spilled = 0
        while time.monotonic() - t_down < args.outage:
            time.sleep(0.1)
            peak = max(peak, mon.buffered)
            sp = mon._sender._spill
            spilled = max(spilled, len(sp) if sp is not None else 0)
        state.starts.append(time.monotonic())
        state.phase = 2
        ctl.start()
        t_up = time.monotonic()
        t_conn = t_drained = None
        while time.monotonic() - t_up < args.after:
            time.sleep(0.02)
            now = time.monotonic()
            if t_conn is None and mon.connected:
                t_conn = now
            sp = mon._sender._spill
            if t_conn is not None and t_drained is None and mon.buffered <= rate and not (sp is not None and len(sp)):
                t_drained = now
                state.starts.append(now)
                state.phase = 3
        state.stop = True
        trainer.join()
        if t_drained is None:
            state.starts.append(time.monotonic())  # the drain phase ran to the end: no "after"
        state.starts.append(time.monotonic())
    finally:
        gc.callbacks.remove(on_gc)
    ok_close = mon.close()
    def since(t: float | None) -> str:
        return "never" if t is None else f"{t - t_up:.1f} s"

    print(f"\n== {name}: {rate:g} steps/s, GIL held {args.gil_frac:.0%} of each step, spill "
          f"{'on' if spill is not None else 'off'}, buffer {args.buffer_records:,} records; outage {args.outage:g} s; "
          f"reconnected {since(t_conn)} and drained {since(t_drained)} after the restart; "
          f"backlog peak {peak:,} records ({spilled:,} on disk)")
    print_table(state, rec)
    return check_delivery(ctl.url, mon, state.steps, ok_close)


def print_table(state: State, rec: list[tuple[array, array, array, array]]) -> None:
    """Per phase and call: n and quantiles in µs; then the phase's garbage collections."""
    print(f"{'phase':7s} {'call':14s} {'n':>8s} {'p50':>8s} {'p99':>8s} {'p99.9':>8s} {'p99.99':>8s} {'max':>8s}  µs")
    for p, phase in enumerate(PHASES):
        if rec[p][0]:
            secs = state.starts[p + 1] - state.starts[p]
            print(f"{phase:7s} {secs:.1f} s, {len(rec[p][0]) / secs:,.0f} steps/s")
        for op, samples in zip(OPS, rec[p], strict=True):
            if not samples:
                continue
            s = sorted(samples)
            qs = " ".join(f"{quantile(s, q) / 1e3:8.1f}" for q in QUANTILES)
            print(f"{phase:7s} {op:14s} {len(s):8,d} {qs} {s[-1] / 1e3:8.1f}")
        gcs = [g for g in state.gcs if g[0] == p]
        if gcs:
            worst = max(gcs, key=lambda g: g[2])
            full = sum(1 for g in gcs if g[1] == 2)
            print(f"{phase:7s} gc: {len(gcs):,} collections ({full} full), {sum(g[3] for g in gcs):,} in the trainer; "
                  f"longest {worst[2] / 1e3:.0f} µs (gen {worst[1]}, {'trainer' if worst[3] else 'other thread'})")


def check_delivery(url: str, mon: Monitor, n_steps: int, ok_close: bool) -> bool:
    """Print records put vs stored + dropped; True when they balance, the drops were reported and the
    stored steps are in order, each once."""
    client = redis.Redis.from_url(url)
    steps: list[int] = []
    last = "-"
    while True:
        entries = client.xrange(mon.keys.steps, min=f"({last}" if last != "-" else "-", count=500)
        if not entries:
            break
        for eid, f in entries:
            steps.extend(r["step"] for r in json.loads(f[b"recs"]))
            last = eid.decode()
    kinds: dict[str, int] = {}
    drop_count = 0
    for _, f in client.xrange(mon.keys.events):
        kind = f[b"kind"].decode()
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "collector_drops":
            drop_count += int(f[b"count"])
    client.close()
    events = sum(v for k, v in kinds.items() if k != "collector_drops")
    put = n_steps + 2  # every step's record, run_start and run_end
    stored, dropped = len(steps) + events, mon.dropped_total
    in_order = all(b > a for a, b in itertools.pairwise(steps))
    ok = put == stored + dropped and in_order and drop_count == dropped and ok_close
    print(f"records put {put:,} ({n_steps:,} steps + 2 events); stored {stored:,} ({len(steps):,} steps + "
          f"{events} events); dropped and counted {dropped:,} (collector_drops events: {drop_count:,}); "
          f"{'balanced' if put == stored + dropped else 'NOT BALANCED'}; steps "
          f"{'once each, in order' if in_order else 'OUT OF ORDER OR TWICE'}; close() delivered all: {ok_close}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=4000, help="steps/s of the fast scenarios (default 4000)")
    ap.add_argument("--slow-rate", type=float, default=100, help="steps/s of the slow scenario (default 100)")
    ap.add_argument("--gil-frac", type=float, default=0.5,
                    help="fraction of each step period spent holding the GIL in the fwd section (default 0.5)")
    ap.add_argument("--warm", type=float, default=5, help="seconds with Redis up before the outage (default 5)")
    ap.add_argument("--outage", type=float, default=15,
                    help="seconds Redis is down (default 15: the collector's back-off retries at 15.5 s)")
    ap.add_argument("--after", type=float, default=20, help="seconds measured after the restart (default 20)")
    ap.add_argument("--buffer-records", type=int, default=100_000, help="Monitor buffer_records (default 100,000)")
    ap.add_argument("--scenarios", default="fast-spill,fast-nospill,slow-spill",
                    help="comma-separated, of fast-spill, fast-nospill, slow-spill, slow-nospill")
    args = ap.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; switch interval {sys.getswitchinterval() * 1e3:g} ms")
    tmp = Path(tempfile.mkdtemp(prefix="th-outage-"))
    ctl = RedisControl(tmp / "redis")
    ok = True
    try:
        for name in args.scenarios.split(","):
            speed, _, sp = name.partition("-")
            rate = args.rate if speed == "fast" else args.slow_rate
            spill = tmp / f"spill-{name}" if sp == "spill" else None
            ok = run_scenario(name, ctl, args, spill, rate) and ok
            gc.collect()
    finally:
        ctl.close()
    print(f"\nall scenarios balanced: {ok}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
