"""``trainhealth demo``: embedded Redis, the detector service, the alert worker, the dashboard and a simulated
multi-rank training job (also used by the end-to-end tests).

Each rank is its own process, as under ``torchrun``, instrumented with
:class:`trainhealth.Monitor` exactly as a real job would be. Each node's ranks time their node's own
collective as the ``allreduce`` section; a shared barrier stands in for the gradient sync across nodes, so every
rank's step takes as long as the slowest rank's, and a straggler shows only in its own section times.
Scripted faults: one slow rank for a span of steps, a loss spike, a crash of the whole job followed by a relaunch that
resumes from the last checkpoint (as ``torchrun --max-restarts`` would), one rank whose host memory grows step after
step (a leak), a node whose collective slows (a slow link: the other nodes' ranks wait for it at the sync), and a
loss that stops improving at a held learning rate (a plateau). The run tunes the memory-growth and plateau detectors
(:mod:`trainhealth.tuning`) so a two-minute demo shows what takes them tens of minutes of evidence on a real job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainhealth import config, defaults
from trainhealth.commands._shared import (
    check_port,
    child_env,
    command,
    dashboard_command,
    ignore_signals,
    interrupt_on_signals,
    release_embedded,
    resolve,
    with_url,
)
from trainhealth.exceptions import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    """The simulated job. Times in seconds, steps as optimizer steps.

    ``fb_s`` is a healthy rank's forward+backward time; the straggler's is ``straggler_factor``
    times longer for steps in ``[straggler_from, straggler_to)``. The job crashes right after
    step ``crash_step`` (set < 0 for no crash) and is relaunched ``restart_delay_s`` later from
    the newest checkpoint (one every ``ckpt_every`` steps, blocking ``ckpt_s``).

    Rank ``leak_rank`` (< 0: none) keeps ``leak_kib`` KiB of host memory more after every step, up to ``leak_max_mib``
    MiB per process (a relaunch starts from nothing again). The ranks of node ``comm_slow_node`` (< 0: none) spend
    ``comm_slow_s`` more in their node's collective (``comm_s`` each step, timed as ``allreduce``) for steps in
    ``[comm_slow_from, comm_slow_to)``: the other nodes' ranks wait for them at the barrier (the gradient sync,
    untimed), as data-parallel ranks wait for a tensor-parallel group whose link is slow. From step
    ``plateau_from`` the loss stays at its level then (the learning rate is held after its warm-up: a plateau, not a
    schedule's end). ``detector_settings`` are the run's own (:mod:`trainhealth.tuning`); None:
    :func:`demo_detector_settings`.
    """

    run: str
    ranks: int = 8
    ranks_per_node: int = 4
    steps: int = 1500
    data_s: float = 0.008
    fb_s: float = 0.045
    optim_s: float = 0.004
    spike_step: int = 450
    straggler_rank: int = 5
    straggler_from: int = 250
    straggler_to: int = 800
    straggler_factor: float = 2.0
    crash_step: int = 620
    ckpt_every: int = 100
    ckpt_s: float = 0.5
    load_s: float = 1.0
    restart_delay_s: float = 3.0
    tokens_per_rank: int = 8192
    gpu_hour_usd: float = 2.5
    heartbeat_interval: float = 1.0
    seed: int = 0
    leak_rank: int = 2
    leak_kib: int = 256
    leak_max_mib: int = 384
    comm_s: float = 0.004
    comm_slow_node: int = 1
    comm_slow_from: int = 1000
    comm_slow_to: int = 1300
    comm_slow_s: float = 0.03
    plateau_from: int = 1000
    detector_settings: dict[str, dict[str, float]] | None = field(default=None, hash=False)

    def host(self, rank: int) -> str:
        """Simulated node name of ``rank``."""
        return f"demo-node-{rank // self.ranks_per_node}"

    def loss(self, step: int, rank: int) -> float:
        """Deterministic loss curve: decay (held from ``plateau_from``) + noise, plus the injected spike."""
        rng = random.Random(self.seed * 1_000_003 + step)
        s = min(step, self.plateau_from)
        x = 2.1 + 8.0 * math.exp(-s / 160.0) + 0.4 * math.exp(-s / 2000.0) + rng.gauss(0.0, 0.02)
        x += random.Random(step * 131 + rank).gauss(0.0, 0.005)
        if self.spike_step <= step < self.spike_step + 8:
            x += 3.2 * 0.65 ** (step - self.spike_step)
        return x

    def grad_norm(self, step: int) -> float:
        rng = random.Random(self.seed * 7 + step)
        g = 0.9 + 1.5 * math.exp(-step / 200.0) + abs(rng.gauss(0.0, 0.05))
        if self.spike_step - 2 <= step < self.spike_step + 4:
            g *= 25.0
        return g

    def lr(self, step: int) -> float:
        """Linear warm-up over 100 steps, then held (a constant schedule: a flat loss is then a plateau)."""
        warm = 100
        return 3e-4 * (step + 1) / warm if step < warm else 3e-4

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def comm_extra_s(self, step: int, rank: int) -> float:
        """Seconds the slow network adds to ``rank``'s all-reduce at ``step``."""
        slow = self.node(rank) == self.comm_slow_node and self.comm_slow_from <= step < self.comm_slow_to
        return self.comm_slow_s if slow else 0.0

    def settings(self) -> dict[str, dict[str, float]]:
        """The run's detector settings: ``detector_settings``, else :func:`demo_detector_settings`."""
        return demo_detector_settings() if self.detector_settings is None else self.detector_settings


#: Growth of the leaking rank's memory that the demo's memory-growth detector opens on (bytes): about 15 s of its leak.
DEMO_LEAK_SEEN_BYTES = 48 * 2**20


def demo_detector_settings(host_total: int | None = None) -> dict[str, dict[str, float]]:
    """The demo run's detector settings (:mod:`trainhealth.tuning`): a memory trend judged on 20 s (2-s floors,
    a minute's window) instead of 10 min, opening at :data:`DEMO_LEAK_SEEN_BYTES` of growth (as a fraction of this
    machine's memory, ``host_total`` bytes, default the collectors' reading); a plateau on a stretch of 200 steps
    and 15 % of the run instead of 500 and a third.

    >>> demo_detector_settings(64 * 2**30)["memory_growth"]["min_growth_frac"]
    0.000732421875
    """
    if host_total is None:
        from trainhealth.collectors.memory import MemorySampler

        host_total = MemorySampler(0).sample()["host_total"] or 64 * 2**30
    return {"memory_growth": {"window_s": 60.0, "min_span_s": 20.0, "min_samples": 15, "bucket_s": 2.0,
                              "min_growth_frac": min(1.0, max(1e-4, DEMO_LEAK_SEEN_BYTES / host_total))},
            "plateau": {"min_steps": 200, "min_points": 60, "run_fraction": 0.15}}


def _rank_main(cfg: DemoConfig, rank: int, start: int, barrier, url: str, ckpt_file: str, crash: bool,
               settings: dict) -> None:
    # Runs in a spawned process: one rank of the job. The terminal's Ctrl-C reaches every rank too: a demo the user
    # stopped ends its ranks quietly (their last word says so), not with a traceback per rank.
    with contextlib.suppress(KeyboardInterrupt):
        _rank_loop(cfg, rank, start, barrier, url, ckpt_file, crash, settings)


def _rank_loop(cfg: DemoConfig, rank: int, start: int, barrier, url: str, ckpt_file: str, crash: bool,
               settings: dict) -> None:
    from trainhealth import Monitor

    logging.basicConfig(level=logging.WARNING)
    mon = Monitor(cfg.run, redis_url=url, rank=rank, world_size=cfg.ranks, host=cfg.host(rank),
                  gpu_hour_usd=cfg.gpu_hour_usd, heartbeat_interval=cfg.heartbeat_interval,
                  run_config={"demo": True, "ranks": cfg.ranks, "steps": cfg.steps}, detector_settings=settings)
    # The leak: what a loop keeping each step's outputs alive does (losses appended without .item(), a cache).
    kept: list[bytes] = []
    leak = cfg.leak_kib * 1024 if rank == cfg.leak_rank else 0
    leak_max = cfg.leak_max_mib * 2**20 // max(leak, 1)
    if start > 0:
        with mon.checkpoint_load(start - 1):
            time.sleep(cfg.load_s)
    barrier.wait()
    jitter = random.Random(rank * 7919 + start)
    for step in range(start, cfg.steps):
        slow = rank == cfg.straggler_rank and cfg.straggler_from <= step < cfg.straggler_to
        with mon.step(step):
            with mon.section("data"):
                time.sleep(cfg.data_s * jitter.uniform(0.9, 1.1))
            with mon.section("forward_backward"):
                time.sleep(cfg.fb_s * (cfg.straggler_factor if slow else 1.0) * jitter.uniform(0.97, 1.03))
            with mon.section("allreduce"):  # the node's own (tensor-parallel) collective, timed by the job
                time.sleep(cfg.comm_s + cfg.comm_extra_s(step, rank))  # a slow link: this node's takes longer
            barrier.wait()  # the data-parallel gradient sync, untimed: everyone waits for the slowest rank
            with mon.section("optimizer"):
                time.sleep(cfg.optim_s)
            if leak and len(kept) < leak_max:
                kept.append(bytes([step & 0xFF]) * leak)  # written, so resident: a leak the RSS shows
        mon.log_step(step, loss=cfg.loss(step, rank), grad_norm=cfg.grad_norm(step), lr=cfg.lr(step),
                     tokens=cfg.tokens_per_rank, samples=cfg.tokens_per_rank // 2048)
        if crash and step == cfg.crash_step:
            mon.flush(2.0)
            os._exit(17)  # a node failure takes the whole job down, with no clean shutdown
        if (step + 1) % cfg.ckpt_every == 0:
            with mon.checkpoint_save(step):
                time.sleep(cfg.ckpt_s)
                if rank == 0:
                    Path(ckpt_file).write_text(json.dumps({"step": step}))
            barrier.wait()
    mon.close()


def run_job(cfg: DemoConfig, url: str, workdir: Path, max_restarts: int = 3,
            watch: Callable[[], None] | None = None) -> int:
    """Launch the ranks, relaunch from the last checkpoint after a crash; return restarts done.

    Blocks until the job finishes, calling ``watch()`` every half second (it may raise to stop
    the job). Raises ``RuntimeError`` when the job fails more than ``max_restarts`` times.
    """
    ctx = mp.get_context("spawn")
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt_file = workdir / f"{cfg.run}.ckpt.json"
    ckpt_file.unlink(missing_ok=True)
    restarts, start = 0, 0
    settings = cfg.settings()
    while True:
        barrier = ctx.Barrier(cfg.ranks, timeout=120)
        procs = [ctx.Process(target=_rank_main, name=f"rank{r}",
                             args=(cfg, r, start, barrier, url, str(ckpt_file), restarts == 0 and cfg.crash_step >= 0,
                                   settings))
                 for r in range(cfg.ranks)]
        for p in procs:
            p.start()
        try:
            while any(p.is_alive() for p in procs):
                mp.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=0.5)
                if watch is not None:
                    watch()
        except BaseException:
            for p in procs:
                p.terminate()
            for p in procs:
                p.join(5)  # gone before the caller marks the run: a rank's heartbeat must not write it running again
            raise
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return restarts
        if restarts >= max_restarts:
            raise RuntimeError(f"demo job failed {restarts + 1} times (exit codes {codes})")
        restarts += 1
        last = json.loads(ckpt_file.read_text())["step"] if ckpt_file.exists() else -1
        start = last + 1
        log.warning("job crashed (exit codes %s); relaunching in %.0f s from the checkpoint of step %d",
                     sorted(set(codes)), cfg.restart_delay_s, last)
        time.sleep(cfg.restart_delay_s)


def config_json(cfg: DemoConfig) -> str:
    return json.dumps(asdict(cfg))


def start_alert_receiver(print_fn: Callable[[str], None] = print):
    """A local HTTP endpoint standing in for the on-call's webhook receiver in the demo.

    Receives the alert worker's signed JSON webhook (docs/alerts.md) on 127.0.0.1 and prints one
    line per alert. Returns ``(server, url)``; ``server.shutdown()`` stops it.
    """
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                doc = json.loads(body)
                for a in doc.get("alerts", []):
                    labels, anomaly = a.get("labels", {}), a.get("anomaly") or {}
                    # Each alert's own state: a point event (a restart, over when first seen) never resolves.
                    state = "EVENT" if a.get("point_event") else str(a.get("status") or doc.get("status", "?")).upper()
                    print_fn(f"ALERT [{state}] {labels.get('severity', '')} "
                             f"{labels.get('kind', '')} · run {labels.get('run', '')}: {anomaly.get('message', '')}")
            except (ValueError, AttributeError):
                pass
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass  # no access log on the demo's console

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="demo-alert-receiver", daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/alerts"


def alerts_config(url: str, dashboard_url: str) -> str:
    """The demo's alerting config: every warning and critical anomaly to the local receiver at once.

    ``group_wait = "0s"``: the demo's loss spike is over in half a second, which the usual 30 s
    would (rightly, for flapping) never notify; here every anomaly should show. ``info`` anomalies
    (single slow steps) stay on the dashboard: nobody is woken for them. Throughput drops wait 60 s:
    the simulated ranks share a laptop's cores, whose load moves the step time by a few percent for
    seconds at a time; a drop that lasts a minute still notifies.
    """
    return f'''# Written by `trainhealth demo`: alerts go to a local receiver that prints them.
version = 1
dashboard_url = "{dashboard_url}"

[route]
receivers = []
group_by = ["run", "kind"]
group_wait = "0s"
group_interval = "30s"
repeat_interval = "4h"

[[route.routes]]
name = "throughput"
matchers = ['kind="throughput_drop"']
receivers = ["demo"]
group_wait = "60s"

[[route.routes]]
name = "notify"
matchers = ['severity=~"warning|critical"']
receivers = ["demo"]

[sinks.demo]
type = "webhook"
url = "{url}"
secret_env = "TRAINHEALTH_DEMO_WEBHOOK_SECRET"
'''


# -- the command ---------------------------------------------------------------------------------
def register(sub: Any) -> None:
    """Add ``demo`` to the ``trainhealth`` sub-parsers."""
    d = with_url(command(sub, "demo", "Embedded Redis, detector service, dashboard and a simulated multi-rank job "
                                      "with a straggler, a loss spike, a crash + restart, a memory leak, a slow "
                                      "all-reduce on one node and a loss plateau."))
    d.add_argument("--ranks", type=int, default=8, help="ranks (processes) of the simulated job, 2-64 (default 8)")
    d.add_argument("--steps", type=int, default=1500, help="training steps (default 1500, about 2 minutes)")
    d.add_argument("--port", type=int, default=defaults.DASHBOARD_PORT,
                   help=f"dashboard port on 127.0.0.1 (default {defaults.DASHBOARD_PORT})")
    d.add_argument("--run", help="run id (default demo-<date>-<time>)")
    d.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard")
    d.set_defaults(func=run, extra="server")


def run(args: argparse.Namespace) -> int:
    """Run the demo until Ctrl-C or SIGTERM (0), or until one of its processes exits (1)."""
    import secrets

    import streamlit  # noqa: F401 - fail here, with the extra to install, not in a child process

    from trainhealth.connection import connect
    from trainhealth.keys import run_keys

    if not 2 <= args.ranks <= 64:
        raise ConfigError(f"--ranks={args.ranks} must be between 2 and 64 (each rank is a process)")
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps} must be >= 1")
    if not args.no_dashboard:
        check_port(args.port)
    url, embedded = resolve(args)
    run_id = args.run or time.strftime("demo-%Y%m%d-%H%M%S")
    cfg = DemoConfig(run=run_id, ranks=args.ranks, steps=args.steps, straggler_rank=min(5, args.ranks - 1),
                     leak_rank=min(2, args.ranks - 1))
    env = child_env(url)
    children: dict[str, subprocess.Popen] = {}
    receiver = None
    job_running = False
    # Explicitly for SIGINT too: Python leaves it ignored when started with it ignored (nohup, some launchers).
    interrupt_on_signals()

    def watch() -> None:
        for name, child in children.items():
            if child.poll() is not None:
                raise RuntimeError(f"the {name} exited (code {child.returncode}); stopping the demo")

    try:
        children["detector service"] = subprocess.Popen(
            [sys.executable, "-m", "trainhealth", "serve", "--hang-floor", "30"], env=env)
        # Alerts: the worker sends to a local receiver that prints them here, as a webhook would.
        receiver, hook_url = start_alert_receiver()
        alerts_toml = config.home_dir() / "demo" / "alerts.toml"
        alerts_toml.parent.mkdir(parents=True, exist_ok=True)
        alerts_toml.write_text(alerts_config(hook_url, f"http://127.0.0.1:{args.port}"))
        children["alert worker"] = subprocess.Popen(
            [sys.executable, "-m", "trainhealth", "--log-level", "WARNING", "alerts", "--config",
             str(alerts_toml)], env={**env, "TRAINHEALTH_DEMO_WEBHOOK_SECRET": secrets.token_hex(16)})
        if not args.no_dashboard:
            children["dashboard"] = subprocess.Popen(dashboard_command(url, args.port), env=env,
                                                     stdout=subprocess.DEVNULL)
            _wait_for_dashboard(args.port, children["dashboard"])
            print(f"\nDashboard: http://127.0.0.1:{args.port}/?run={run_id}\n", flush=True)
        print(f"Demo job: run {run_id!r}, {cfg.ranks} ranks, {cfg.steps} steps; {_faults(cfg)}. "
              "Ctrl-C stops everything.", flush=True)
        connect(url).hset(run_keys(run_id).meta, "source", "demo")
        job_running = True
        restarts = run_job(cfg, url, config.home_dir() / "demo", watch=watch)
        job_running = False
        up = "Detectors" if args.no_dashboard else "Dashboard and detectors"
        print(f"Demo job finished ({restarts} restart{'s' if restarts != 1 else ''}). {up} stay up; Ctrl-C to "
              "stop.", flush=True)
        while True:
            watch()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nStopping…", flush=True)
        if job_running:
            # Stopped by its user, not crashed: as a replay stopped by Ctrl-C, the run is marked so (the service
            # stops its clock and checks no hang or crash for it; a later service shows it as it was).
            with contextlib.suppress(Exception):
                connect(url).hset(run_keys(run_id).meta, mapping={"status": "interrupted",
                                                                  "ended_at": repr(time.time())})
        return 0
    except RuntimeError as exc:
        print(f"trainhealth demo: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        ignore_signals()  # a second Ctrl-C must not interrupt the cleanup and leave servers behind
        if receiver is not None:
            receiver.shutdown()
        # A Ctrl-C in the terminal reached the whole process group: the children are already stopping on it, and
        # a SIGTERM now would be their second signal (stop at once, mid-batch). Only the ones still up after a
        # moment (the demo alone was signalled) get one.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(c.poll() is None for c in children.values()):
            time.sleep(0.1)
        for c in children.values():
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in children.values():
            try:
                c.wait(10)
            except subprocess.TimeoutExpired:
                c.kill()
        release_embedded(embedded, url, run_id)


def _faults(cfg: DemoConfig) -> str:
    parts = []
    if cfg.straggler_from < cfg.steps:
        parts.append(f"straggler rank {cfg.straggler_rank} (steps {cfg.straggler_from}-"
                     f"{min(cfg.straggler_to, cfg.steps)})")
    if cfg.spike_step < cfg.steps:
        parts.append(f"loss spike at step {cfg.spike_step}")
    if 0 <= cfg.crash_step < cfg.steps - 1:
        parts.append(f"crash after step {cfg.crash_step} and resume from the last checkpoint")
    if 0 <= cfg.leak_rank < cfg.ranks and cfg.leak_kib > 0:
        parts.append(f"rank {cfg.leak_rank}'s host memory grows {cfg.leak_kib} KiB a step (up to "
                     f"{cfg.leak_max_mib} MiB)")
    if cfg.comm_slow_from < cfg.steps and 0 <= cfg.comm_slow_node < math.ceil(cfg.ranks / cfg.ranks_per_node):
        parts.append(f"slow all-reduce on demo-node-{cfg.comm_slow_node} (+{cfg.comm_slow_s * 1000:.0f} ms, steps "
                     f"{cfg.comm_slow_from}-{min(cfg.comm_slow_to, cfg.steps)})")
    if cfg.plateau_from < cfg.steps:
        parts.append(f"loss plateau from step {cfg.plateau_from} at a held learning rate")
    return ", ".join(parts) if parts else "too few steps for the scripted faults (use --steps 1500)"


def _wait_for_dashboard(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the dashboard exited (code {proc.returncode}) before serving on port {port}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as resp:
                if resp.read() == b"ok":
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the dashboard did not answer on port {port} within {timeout:.0f} s")
