"""The ``trainhealth`` command: demo, serve, dashboard, replay, doctor, redis."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from trainhealth import __version__, config, defaults
from trainhealth.exceptions import TrainHealthError

log = logging.getLogger("trainhealth")

DASHBOARD_APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"


def _redact(url: str) -> str:
    """The URL without its password, for printing."""
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _resolve(args: argparse.Namespace, start: bool = True):
    from trainhealth.server import resolve_url

    url, embedded = resolve_url(getattr(args, "redis_url", None), start=start)
    if embedded is not None:
        state = "started" if embedded.started else "reusing"
        print(f"Redis: {state} embedded redis-server at {url} (data in {embedded.directory})", flush=True)
    else:
        print(f"Redis: {_redact(url)}", flush=True)
    return url, embedded


def dashboard_command(url: str, port: int, headless: bool = True) -> list[str]:
    """The streamlit command line of the dashboard (usage statistics off: no calls home)."""
    return [sys.executable, "-m", "streamlit", "run", str(DASHBOARD_APP), "--server.port", str(port),
            "--server.headless", "true" if headless else "false", "--browser.gatherUsageStats", "false",
            "--server.address", "127.0.0.1", "--theme.base", "light"]


def _child_env(url: str) -> dict[str, str]:
    env = dict(os.environ)
    env[defaults.REDIS_URL_ENV] = url
    return env


# -- commands -----------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from detectors.hang import HangDetector
    from detectors.service import DetectorService
    from trainhealth.server import connect

    url, _ = _resolve(args)
    floor = args.hang_floor
    service = DetectorService(connect(url), consumer=args.consumer,
                              hang_factory=lambda: HangDetector(floor_s=floor))
    service.install_signal_handlers()
    service.run_forever()
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    url, _ = _resolve(args)
    print(f"Dashboard: http://127.0.0.1:{args.port}/", flush=True)
    return subprocess.call(dashboard_command(url, args.port), env=_child_env(url))


def cmd_replay(args: argparse.Namespace) -> int:
    from trainhealth.replay import replay
    from trainhealth.server import connect

    url, _ = _resolve(args)
    client = connect(url)
    for path in args.paths:
        res = replay(path, client, run=args.run if len(args.paths) == 1 else None, speed=args.speed,
                     step_seconds=args.step_seconds)
        print(f"replayed {res.points} steps and {res.evals} evaluations of {path} as run {res.run!r} "
              f"(synthetic span {res.span_s:.0f} s)" + ("" if res.delivered else " — NOT all delivered"))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import redis

    from trainhealth.keys import RUNS, SERVICE_HEARTBEAT_PATTERN

    url = config.redis_url(args.redis_url)
    if url is None:
        print("Redis: none configured (TRAINHEALTH_REDIS_URL unset, no embedded server running)")
        return 1
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        info = client.info("server")
    except redis.RedisError as exc:
        print(f"Redis: {_redact(url)} UNREACHABLE ({exc})")
        return 1
    print(f"Redis: {_redact(url)} ok (redis {info.get('redis_version')})")
    services = [json.loads(client.get(k) or "{}") for k in client.scan_iter(SERVICE_HEARTBEAT_PATTERN)]
    if services:
        for s in services:
            print(f"Detector service: pid {s.get('pid')} on {s.get('host')}, {s.get('runs')} runs, "
                  f"heartbeat {time.time() - s.get('t', 0):.0f} s ago")
    else:
        print("Detector service: NOT RUNNING (no heartbeat): start `trainhealth serve`")
    print(f"Runs: {client.zcard(RUNS)}")
    return 0 if services else 1


def cmd_redis(args: argparse.Namespace) -> int:
    from trainhealth.server import EmbeddedRedis

    emb = EmbeddedRedis.default()
    if args.action == "start":
        print(emb.ensure_running())
    elif args.action == "stop":
        emb.stop()
        print("stopped")
    else:
        url = emb.running_url()
        print(url or "not running")
        return 0 if url else 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from trainhealth.demo import DemoConfig, run_job
    from trainhealth.keys import run_keys
    from trainhealth.server import connect

    url, embedded = _resolve(args)
    run = args.run or time.strftime("demo-%Y%m%d-%H%M%S")
    cfg = DemoConfig(run=run, ranks=args.ranks, steps=args.steps)
    env = _child_env(url)
    children: list[subprocess.Popen] = []
    children.append(subprocess.Popen([sys.executable, "-m", "trainhealth.cli", "serve", "--hang-floor", "30"],
                                     env=env))
    if not args.no_dashboard:
        children.append(subprocess.Popen(dashboard_command(url, args.port), env=env,
                                         stdout=subprocess.DEVNULL))
        print(f"\nDashboard: http://127.0.0.1:{args.port}/?run={run}\n", flush=True)
    print(f"Demo job: run {run!r}, {cfg.ranks} ranks, {cfg.steps} steps; straggler rank {cfg.straggler_rank} "
          f"(steps {cfg.straggler_from}-{cfg.straggler_to}), loss spike at step {cfg.spike_step}, "
          f"crash after step {cfg.crash_step} and resume from checkpoint. Ctrl-C stops everything.", flush=True)

    def _stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        connect(url).hset(run_keys(run).meta, "source", "demo")
        restarts = run_job(cfg, url, config.home_dir() / "demo")
        print(f"Demo job finished ({restarts} restart). Dashboard and detectors stay up; Ctrl-C to stop.",
              flush=True)
        while all(c.poll() is None for c in children):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        print("\nStopping…", flush=True)
        return 0
    finally:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in children:
            try:
                c.wait(10)
            except subprocess.TimeoutExpired:
                c.kill()
        if embedded is not None and embedded.started:
            embedded.stop()
            print("Stopped the embedded redis-server (data kept in", embedded.directory, ")")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainhealth", description="Live training-health monitor: goodput, "
                                "loss spikes, stragglers, hangs, restarts.")
    p.add_argument("--version", action="version", version=f"trainhealth {__version__}")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = p.add_subparsers(dest="command", required=True)

    def with_url(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--redis-url", help="redis://, rediss:// or unix:// URL (default: $TRAINHEALTH_REDIS_URL, "
                        "else the embedded server, started if needed)")
        return sp

    d = with_url(sub.add_parser("demo", help="embedded Redis + detectors + dashboard + a simulated 8-rank job"))
    d.add_argument("--ranks", type=int, default=8)
    d.add_argument("--steps", type=int, default=1500)
    d.add_argument("--port", type=int, default=defaults.DASHBOARD_PORT)
    d.add_argument("--run", help="run id (default demo-<time>)")
    d.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard")
    d.set_defaults(func=cmd_demo)

    s = with_url(sub.add_parser("serve", help="run the detector service"))
    s.add_argument("--consumer", help="consumer name in the group (default: host name)")
    s.add_argument("--hang-floor", type=float, default=defaults.HANG_FLOOR_S,
                   help=f"minimum seconds without progress before a hang (default {defaults.HANG_FLOOR_S:.0f})")
    s.set_defaults(func=cmd_serve)

    b = with_url(sub.add_parser("dashboard", help="run the Streamlit dashboard"))
    b.add_argument("--port", type=int, default=defaults.DASHBOARD_PORT)
    b.set_defaults(func=cmd_dashboard)

    r = with_url(sub.add_parser("replay", help="push a log (HF trainer_state.json) through the collectors"))
    r.add_argument("paths", nargs="+")
    r.add_argument("--run", help="run id (default replay-<file name>)")
    r.add_argument("--speed", type=float, default=0.0, help="pace factor; 0 = as fast as possible (default)")
    r.add_argument("--step-seconds", type=float, default=1.0, help="assumed seconds per step (logs have no times)")
    r.set_defaults(func=cmd_replay)

    o = with_url(sub.add_parser("doctor", help="check Redis and the detector service"))
    o.set_defaults(func=cmd_doctor)

    e = sub.add_parser("redis", help="manage the embedded redis-server")
    e.add_argument("action", choices=["start", "stop", "url"])
    e.set_defaults(func=cmd_redis)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except TrainHealthError as exc:
        print(f"trainhealth: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
