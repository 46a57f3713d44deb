"""Hot-path cost of the collector, per call, against baselines and peers measured in the same run.

Run: ``.venv/bin/python bench/collector_hotpath.py`` (starts its own redis-server; the
sender thread is live and draining into it while the training thread is timed).

Prints the median and p99 nanoseconds per call over batches of 1,000 calls, for:
``Monitor.log_step``, one ``step()`` block with three ``section()`` blocks inside, and the
baselines ``deque.append`` (the floor: what the hot path is built on), ``queue.Queue.put_nowait``
(the standard library's bounded queue), and the peers recording the same five metrics of a
step when installed (``pip install -e '.[bench]'``): ``prometheus_client`` ``Gauge.set`` x5,
``trainpulse`` ``Monitor.log`` x5 (one call per metric) and W&B offline ``run.log``.
"""

from __future__ import annotations

import platform
import queue
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainhealth import Monitor
from trainhealth.embedded_redis import EmbeddedRedis, free_port

BATCH = 1_000
BATCHES = 300


def measure(fn, batches: int = BATCHES) -> tuple[float, float]:
    """Median and p99 ns per call of ``fn(i)`` over ``batches`` batches of BATCH calls."""
    per_call = []
    pc = time.perf_counter_ns
    for _b in range(batches):
        t0 = pc()
        for i in range(BATCH):
            fn(i)
        per_call.append((pc() - t0) / BATCH)
    per_call.sort()
    return statistics.median(per_call), per_call[int(0.99 * (len(per_call) - 1))]


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    emb = EmbeddedRedis(tmp, port=free_port())
    url = emb.ensure_running()
    try:
        rows: list[tuple[str, float, float]] = []
        dq: deque = deque(maxlen=100_000)
        rows.append(("deque.append (floor)", *measure(lambda i: dq.append(("steps", {"step": i})))))
        q: queue.Queue = queue.Queue(maxsize=10_000_000)
        rows.append(("queue.Queue.put_nowait", *measure(lambda i: q.put_nowait(("steps", {"step": i})))))
        # Peers, each recording the same 5 metrics of one step (installed with the `bench` extra).
        try:
            from prometheus_client import CollectorRegistry, Gauge

            reg = CollectorRegistry()
            gs = [Gauge(n, n, registry=reg) for n in ("loss", "grad_norm", "lr", "tokens", "step")]

            def prom(i: int) -> None:
                for g in gs:
                    g.set(2.5)

            rows.append(("prometheus_client Gauge.set x5", *measure(prom)))
        except ImportError:
            print("(prometheus_client not installed: pip install -e '.[bench]')")
        try:
            from trainpulse import Monitor as PulseMonitor

            pulse = PulseMonitor()

            def tp(i: int) -> None:
                pulse.log("loss", i, 2.5)
                pulse.log("grad_norm", i, 1.0)
                pulse.log("learning_rate", i, 3e-4)
                pulse.log("tokens", i, 4096.0)
                pulse.log("step_time", i, 0.1)

            rows.append(("trainpulse Monitor.log x5", *measure(tp, batches=50)))
        except ImportError:
            print("(trainpulse not installed: pip install -e '.[bench]')")
        try:
            import os

            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            run = wandb.init(mode="offline", dir=str(tmp), project="bench")
            rows.append(("wandb offline run.log (5 metrics)", *measure(
                lambda i: run.log({"loss": 2.5, "grad_norm": 1.0, "lr": 3e-4, "tokens": 4096, "step": i}),
                batches=10)))
            run.finish()
        except ImportError:
            print("(wandb not installed: pip install -e '.[bench]')")
        t_start = time.perf_counter()
        mon = Monitor("bench", redis_url=url, rank=0, world_size=1, buffer_records=1_000_000, close_timeout=120)
        rows.append(("Monitor.log_step (5 metrics)",
                     *measure(lambda i: mon.log_step(i, loss=2.5, grad_norm=1.0, lr=3e-4, tokens=4096))))
        mon2 = Monitor("bench2", redis_url=url, rank=0, world_size=1, buffer_records=1_000_000, close_timeout=120)
        sec_d, sec_f, sec_o = mon2.section("data"), mon2.section("forward_backward"), mon2.section("optimizer")

        def step_block(i: int) -> None:
            with mon2.step(i):
                with sec_d:
                    pass
                with sec_f:
                    pass
                with sec_o:
                    pass
            mon2.log_step(i, loss=2.5, grad_norm=1.0, lr=3e-4, tokens=4096)

        rows.append(("step() + 3 sections + log_step", *measure(step_block)))

        def one_section(i: int) -> None:
            with mon2.section("data"):
                pass

        rows.append(("section() enter+exit (name lookup)", *measure(one_section)))
        t_end = time.perf_counter()
        ok = mon.close() and mon2.close()
        drain_s = time.perf_counter() - t_end
        span_s = time.perf_counter() - t_start
        floor = rows[0][1]
        print(f"python {platform.python_version()} on {platform.machine()}, {BATCHES}x{BATCH} calls each")
        print(f"{'call':40s} {'median ns':>10s} {'p99 ns':>10s} {'x floor':>8s}")
        for name, med, p99 in rows:
            print(f"{name:40s} {med:10.0f} {p99:10.0f} {med / floor:8.1f}")
        sent = mon._sender.sent + mon2._sender.sent
        print(f"{sent:,} records delivered to Redis, all: {ok}; sender rate {sent / span_s:,.0f} records/s "
              f"(final drain after the loops {drain_s:.2f} s)")
    finally:
        emb.stop()


if __name__ == "__main__":
    main()
