"""The ``trainhealth`` command: demo, serve, dashboard, replay, analyze, doctor, redis."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from trainhealth import __version__, config, defaults
from trainhealth.exceptions import ConfigError, TrainHealthError

if TYPE_CHECKING:
    from trainhealth.embedded_redis import EmbeddedRedis

log = logging.getLogger("trainhealth")

#: A detector service heartbeat older than this (s) counts as a dead service.
SERVICE_STALE_S = 10.0

#: Streamlit runs the app as a file: wherever the package is installed, ``trainhealth.dashboard``'s app.py.
DASHBOARD_APP = Path(importlib.util.find_spec("trainhealth.dashboard").origin).parent / "app.py"


def _redact(url: str) -> str:
    """The URL without its password, for printing."""
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _resolve(args: argparse.Namespace, start: bool = True):
    from trainhealth.embedded_redis import resolve_url

    url, embedded = resolve_url(getattr(args, "redis_url", None), start=start)
    if os.environ.get(_CHILD_ENV):
        pass  # a child of `trainhealth demo`, which has said where Redis is
    elif embedded is not None:
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


def _interrupt_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so the command cleans up either way: SIGTERM's default
    kills at once, and a process started in the background (nohup, ``cmd &`` in a script) inherits SIGINT
    ignored."""
    def _stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)


#: Set in the environment of the processes a command starts (they need not say again where Redis is).
_CHILD_ENV = "TRAINHEALTH_CHILD"


def _child_env(url: str) -> dict[str, str]:
    env = dict(os.environ)
    env[defaults.REDIS_URL_ENV] = url
    env[_CHILD_ENV] = "1"
    return env


# -- commands -----------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from trainhealth.detectors.hang import HangDetector
    from trainhealth.detectors.service import DetectorService
    from trainhealth.embedded_redis import connect

    url, embedded = _resolve(args)
    floor = args.hang_floor
    service = DetectorService(connect(url), consumer=args.consumer,
                              hang_factory=lambda: HangDetector(floor_s=floor))
    service.install_signal_handlers()
    try:
        service.run_forever()
    finally:
        _release_embedded(embedded, url)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    _check_port(args.port)
    url, embedded = _resolve(args)
    print(f"Dashboard: http://127.0.0.1:{args.port}/", flush=True)
    proc = subprocess.Popen(dashboard_command(url, args.port), env=_child_env(url))
    _interrupt_on_signals()  # SIGTERM (systemd, kill, a supervisor) cleans up as Ctrl-C does, not orphaning Streamlit
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C in the terminal reached Streamlit too; a signal to this process alone did not.
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130
    finally:
        # A second signal must not skip the cleanup.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _release_embedded(embedded, url)


def _release_embedded(embedded: EmbeddedRedis | None, url: str, own_run: str = "") -> None:
    """Stop the embedded redis-server this command started, unless something else still uses it."""
    if embedded is None or not embedded.started:
        return
    others = _other_users(url, own_run)
    if others:
        print(f"Left the embedded redis-server running at {url}: {others} (`trainhealth redis stop` stops it).",
              flush=True)
    else:
        embedded.stop()
        print(f"Stopped the embedded redis-server (data kept in {embedded.directory}).", flush=True)


def cmd_replay(args: argparse.Namespace) -> int:
    from typing import Any

    from trainhealth.commands.replay import (
        INTERRUPTED,
        ReplayInterrupted,
        check_pace,
        check_speed,
        default_run_id,
        plan,
        plan_line,
        read_points,
        read_run,
        replay,
    )
    from trainhealth.detectors.offline import step_seconds_error
    from trainhealth.embedded_redis import connect
    from trainhealth.keys import validate_run_id
    from trainhealth.text import fmt_duration

    check_speed(args.speed, "--speed")
    err = step_seconds_error(args.step_seconds, "--step-seconds")
    if err is not None:
        raise ConfigError(err)
    one_run = args.one_run and len(args.paths) > 1  # the per-rank logs of one job: one run
    if args.run is not None:
        if len(args.paths) > 1 and not one_run:  # it would name only one of the runs: refuse, do not ignore
            raise ConfigError(f"--run {args.run!r} names one run, but the {len(args.paths)} PATHs are replayed as "
                              f"{len(args.paths)} runs; give one PATH, or --one-run for the per-rank logs of one job")
        try:
            validate_run_id(args.run)
        except ConfigError as exc:
            raise ConfigError("--run " + str(exc).removeprefix("run=")) from None

    def progress_bar(span_s: float, total: int, what: str, run: str) -> tuple[Any, Any] | None:
        # Over the log's seconds, so tqdm's ETA is the real time left (steps may be unevenly spaced).
        try:
            from tqdm import tqdm
        except ImportError:  # the server extra brings tqdm; without it, no bar
            return None
        bar = tqdm(total=span_s, desc=f"{run[:40]}: 0/{total:,} {what}", file=sys.stderr, leave=False,
                   dynamic_ncols=True, mininterval=0.25, delay=0.5,
                   bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")

        def update(pushed: int, offset_s: float) -> None:
            bar.set_description_str(f"{run[:40]}: {pushed:,}/{total:,} {what}", refresh=False)
            bar.update(offset_s - bar.n)

        return bar, update

    runs = 1 if one_run else len(args.paths)
    done = 0  # runs replayed completely, for the Ctrl-C message
    _interrupt_on_signals()  # SIGTERM too ends the run as "interrupted", not "running" for ever
    try:
        # Parse every file before touching Redis: a typo must not start a server or half-write a run.
        mapping = parse_map(args.map)
        if one_run:
            parsed = [(args.paths, read_run(args.paths, args.format, mapping)[0])]
        else:
            parsed = [(path, read_points(path, args.format, mapping)) for path in args.paths]
        plans = [plan(points, args.step_seconds) for _, points in parsed]
        for pl in plans:  # a --speed that paces some file over years: refuse before replaying any
            check_pace(pl.span_s, args.speed, "--speed")
        url, _ = _resolve(args)
        client = connect(url)
        # A bar only where someone watches (as analyze does): a paced replay may wait hours between two steps.
        show = args.speed > 0 and sys.stderr.isatty()
        for (path, points), pl in zip(parsed, plans, strict=True):
            name = " + ".join(path) if isinstance(path, list) else path
            run = (args.run if args.run is not None
                   else default_run_id([Path(p) for p in path] if isinstance(path, list) else Path(path)))
            print(plan_line(pl, name, run, args.speed, args.step_seconds), flush=True)
            bar = progress_bar(pl.span_s, pl.points, "records" if pl.ranks else "steps", run) if show else None
            try:
                res = replay(path, client, run=run, speed=args.speed, step_seconds=args.step_seconds, points=points,
                             progress=bar[1] if bar else None)
            finally:
                if bar:
                    bar[0].close()
            what = (f"{res.points} per-rank records of {len(res.ranks)} ranks" if res.ranks else f"{res.points} steps")
            print(f"replayed {what} and {res.evals} evaluations of {name} as run {res.run!r} "
                  f"(synthetic span {res.span_s:.0f} s)" + ("" if res.delivered else " — NOT all delivered"),
                  flush=True)
            done += 1
        if not _live_services(client):
            print("No detector service is running: start `trainhealth serve` to analyse the replayed run(s).")
    except ReplayInterrupted as exc:  # replay() closed the run as INTERRUPTED: say how far it got, no traceback
        res = exc.result
        left = runs - done - 1
        print(f"trainhealth: interrupted after {res.points:,} of {res.total:,} "
              f"{'per-rank records' if res.ranks else 'steps'} of run {res.run!r} "
              f"({fmt_duration(res.offset_s, day=' days')} of the log's {fmt_duration(res.span_s, day=' days')}); "
              f"run marked {INTERRUPTED!r}"
              + ("" if res.delivered else " (NOT all delivered)")
              + (f"; {left} more file{'s' if left > 1 else ''} not replayed" if left > 0 else ""),
              file=sys.stderr, flush=True)
        return 130
    except KeyboardInterrupt:  # while parsing, or between two runs
        print(f"trainhealth: interrupted after replaying {done} of {runs} run{'s' if runs > 1 else ''}",
              file=sys.stderr, flush=True)
        return 130
    return 0


def parse_map(items: list[str] | None) -> dict[str, str | None] | None:
    """``--map FIELD=COLUMN`` options (replay, analyze) as an importer mapping; ``FIELD=`` ignores a field."""
    if not items:
        return None
    mapping: dict[str, str | None] = {}
    for item in items:
        field, sep, column = item.partition("=")
        if not sep or not field:
            raise ConfigError(f"--map {item!r} is not FIELD=COLUMN (e.g. loss=train/loss)")
        mapping[field] = column or None
    return mapping


def cmd_analyze(args: argparse.Namespace) -> int:
    from trainhealth.commands.analyze import analyze_paths, exit_status, format_text, to_json, write_text

    progress = {"always": True, "never": False}.get(args.progress)  # auto: when stderr is a terminal
    reports = analyze_paths(args.paths, args.format, parse_map(args.map), step_seconds=args.step_seconds,
                            progress=progress, on_error=lambda msg: print(f"trainhealth: error: {msg}",
                                                                          file=sys.stderr, flush=True),
                            one_run=args.one_run)
    if args.json_file:
        write_text(to_json(reports), args.json_file, sys.stdout)
    if args.html:
        from trainhealth.commands.report_html import render

        write_text(render(reports), args.html, sys.stdout)
    if args.json:
        sys.stdout.write(to_json(reports))
    else:
        sys.stdout.write(format_text(reports))
    return exit_status(reports)


def _live_services(client) -> list[dict]:
    """Heartbeats of detector services seen in the last 10 s."""
    from trainhealth.keys import SERVICE_HEARTBEAT_PATTERN

    now = time.time()
    beats = [json.loads(client.get(k) or "{}") for k in client.scan_iter(SERVICE_HEARTBEAT_PATTERN)]
    return [b for b in beats if now - float(b.get("t", 0)) < SERVICE_STALE_S]


def _check_port(port: int) -> None:
    from trainhealth.embedded_redis import free_port

    if not 1 <= port <= 65535:
        raise ConfigError(f"--port={port} is not a TCP port (1-65535)")
    if free_port(port) != port:
        raise ConfigError(f"--port={port} is already in use on 127.0.0.1: pass another --port")


def cmd_doctor(args: argparse.Namespace) -> int:
    import redis

    from trainhealth.keys import RUNS

    url = config.redis_url(args.redis_url)
    if url is None:
        print("Redis: none configured (TRAINHEALTH_REDIS_URL unset, no embedded server running): "
              "`trainhealth serve` or `trainhealth demo` starts the embedded one")
        return 1
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        info = client.info("server")
    except redis.RedisError as exc:
        print(f"Redis: {_redact(url)} UNREACHABLE ({exc})")
        return 1
    print(f"Redis: {_redact(url)} ok (redis {info.get('redis_version')})")
    live = _live_services(client)
    for s in live:
        print(f"Detector service: pid {s.get('pid')} on {s.get('host')}, {s.get('runs')} runs, "
              f"heartbeat {time.time() - s.get('t', 0):.0f} s ago")
    if not live:
        print(f"Detector service: NOT RUNNING (no heartbeat in the last {SERVICE_STALE_S:.0f} s): "
              "start `trainhealth serve`")
    print(f"Runs: {client.zcard(RUNS)}")
    from trainhealth.alerts.health import doctor_report

    alert_lines, alerts_ok = doctor_report(client)
    print("\n".join(alert_lines))
    return 0 if live and alerts_ok else 1


def cmd_advise(args: argparse.Namespace) -> int:
    from trainhealth.commands.advise import run_advise
    from trainhealth.embedded_redis import connect, resolve_url

    url, _ = resolve_url(args.redis_url, start=False)
    return run_advise(connect(url), args)


def cmd_redis(args: argparse.Namespace) -> int:
    from trainhealth.embedded_redis import EmbeddedRedis

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
    import secrets

    from trainhealth.commands.demo import DemoConfig, alerts_config, run_job, start_alert_receiver
    from trainhealth.embedded_redis import connect
    from trainhealth.keys import run_keys

    if not 2 <= args.ranks <= 64:
        raise ConfigError(f"--ranks={args.ranks} must be between 2 and 64 (each rank is a process)")
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps} must be >= 1")
    if not args.no_dashboard:
        _check_port(args.port)
    url, embedded = _resolve(args)
    run = args.run or time.strftime("demo-%Y%m%d-%H%M%S")
    cfg = DemoConfig(run=run, ranks=args.ranks, steps=args.steps, straggler_rank=min(5, args.ranks - 1))
    env = _child_env(url)
    children: dict[str, subprocess.Popen] = {}
    receiver = None

    def _stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    # Explicitly: Python leaves SIGINT ignored when started with it ignored (nohup, some launchers).
    signal.signal(signal.SIGINT, _stop)

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
            print(f"\nDashboard: http://127.0.0.1:{args.port}/?run={run}\n", flush=True)
        print(f"Demo job: run {run!r}, {cfg.ranks} ranks, {cfg.steps} steps; {_faults(cfg)}. "
              "Ctrl-C stops everything.", flush=True)
        connect(url).hset(run_keys(run).meta, "source", "demo")
        restarts = run_job(cfg, url, config.home_dir() / "demo", watch=watch)
        print(f"Demo job finished ({restarts} restart{'s' if restarts != 1 else ''}). Dashboard and detectors "
              "stay up; Ctrl-C to stop.", flush=True)
        while True:
            watch()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nStopping…", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"trainhealth demo: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # A second Ctrl-C must not interrupt the cleanup and leave servers behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if receiver is not None:
            receiver.shutdown()
        for c in children.values():
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in children.values():
            try:
                c.wait(10)
            except subprocess.TimeoutExpired:
                c.kill()
        _release_embedded(embedded, url, run)


def _faults(cfg) -> str:
    parts = []
    if cfg.straggler_from < cfg.steps:
        parts.append(f"straggler rank {cfg.straggler_rank} (steps {cfg.straggler_from}-"
                     f"{min(cfg.straggler_to, cfg.steps)})")
    if cfg.spike_step < cfg.steps:
        parts.append(f"loss spike at step {cfg.spike_step}")
    if 0 <= cfg.crash_step < cfg.steps - 1:
        parts.append(f"crash after step {cfg.crash_step} and resume from the last checkpoint")
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


def _other_users(url: str, own_run: str) -> str:
    """Who else uses the embedded server: live detector services or runs with fresh heartbeats."""
    import redis

    from trainhealth.keys import RUNS, run_keys

    try:
        client = redis.Redis.from_url(url, socket_timeout=2)
        if _live_services(client):
            return "another detector service uses it"
        # Anyone else connected (a dashboard, a job's collectors, redis-cli): our own client is one.
        me = client.client_id()
        others = [c for c in client.client_list() if int(c["id"]) != me]
        if others:
            return f"{len(others)} other client{'s are' if len(others) != 1 else ' is'} connected"
        now = time.time()
        for raw in client.zrange(RUNS, 0, -1):
            run = raw.decode()
            if run == own_run:
                continue
            for body in client.hvals(run_keys(run).heartbeats):
                if now - float(json.loads(body).get("t", 0)) < SERVICE_STALE_S:
                    return f"run {run!r} is still sending to it"
    except (redis.RedisError, ValueError):
        return ""
    return ""


def build_parser() -> argparse.ArgumentParser:
    from trainhealth.collectors.importers import FORMATS

    p = argparse.ArgumentParser(prog="trainhealth", description="Live training-health monitor: goodput, "
                                "loss spikes, stragglers, hangs, restarts.")
    p.add_argument("--version", action="version", version=f"trainhealth {__version__}")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_url(sp: argparse.ArgumentParser, starts: bool = True) -> argparse.ArgumentParser:
        sp.add_argument("--redis-url", help="redis://, rediss:// or unix:// URL (default: $TRAINHEALTH_REDIS_URL, "
                        "else the embedded server" + (", started if needed)" if starts else ")"))
        return sp

    def cmd(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=summary)

    d = with_url(cmd("demo", "Embedded Redis, detector service, dashboard and a simulated multi-rank job with "
                             "a straggler, a loss spike and a crash + restart."))
    d.add_argument("--ranks", type=int, default=8, help="ranks (processes) of the simulated job, 2-64 (default 8)")
    d.add_argument("--steps", type=int, default=1500, help="training steps (default 1500, about 2 minutes)")
    d.add_argument("--port", type=int, default=defaults.DASHBOARD_PORT,
                   help=f"dashboard port on 127.0.0.1 (default {defaults.DASHBOARD_PORT})")
    d.add_argument("--run", help="run id (default demo-<date>-<time>)")
    d.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard")
    d.set_defaults(func=cmd_demo)

    s = with_url(cmd("serve", "Run the detector service: reads every run's streams, writes anomalies and the "
                              "goodput ledger. Stop with SIGTERM or Ctrl-C."))
    s.add_argument("--consumer", help="consumer name in the group (default: <host>-<pid>)")
    s.add_argument("--hang-floor", type=float, default=defaults.HANG_FLOOR_S,
                   help=f"minimum seconds without progress before a hang (default {defaults.HANG_FLOOR_S:.0f})")
    s.set_defaults(func=cmd_serve)

    b = with_url(cmd("dashboard", "Run the Streamlit dashboard (usage statistics off)."))
    b.add_argument("--port", type=int, default=defaults.DASHBOARD_PORT,
                   help=f"port on 127.0.0.1 (default {defaults.DASHBOARD_PORT})")
    b.set_defaults(func=cmd_dashboard)

    def log_options(sp: argparse.ArgumentParser) -> None:
        # PATH..., --format and --map: the same for replay and analyze.
        sp.add_argument("paths", nargs="+", metavar="PATH", help="log file(s) (a TensorBoard run directory too)")
        sp.add_argument("--format", choices=FORMATS, help="the log's format (default: detected from name and content)")
        sp.add_argument("--map", action="append", metavar="FIELD=COLUMN",
                        help="map one of our fields (step, loss, grad_norm, lr, tokens, step_seconds, ...) to a "
                             "column or scalar tag of the log; repeatable")
        sp.add_argument("--one-run", action="store_true",
                        help="the PATHs are per-rank logs of one job (e.g. one profiler trace per rank): one "
                             "multi-rank run, not one run per file")

    r = with_url(cmd("replay", "Push a training log through the collectors into Redis, so the detectors and the "
                               "dashboard act on it. Formats (detected, or --format): "
                               + ", ".join(FORMATS) + "."))
    log_options(r)
    r.add_argument("--run", help="run id (default replay-<file name>; only with one PATH or --one-run)")
    r.add_argument("--speed", type=float, default=0.0, metavar="K",
                   help="0 (default): push the whole log at once, its records stamped on the log's own timeline "
                        "(ending now). K > 0: replay in real time at K times the log's pace, e.g. a log spanning "
                        "30 days takes 7.2 h at --speed 100; records then carry the real clock, so the dashboard's "
                        "rates are K times the log's. The line printed before pushing says how long it will take; "
                        "Ctrl-C stops it (the run is marked 'interrupted')")
    r.add_argument("--step-seconds", type=float, default=1.0,
                   help="assumed seconds per step for steps the log gives no time for (default 1.0)")
    r.set_defaults(func=cmd_replay)

    n = cmd("analyze", "Post-mortem of training logs, offline (no Redis): the live detectors, goodput ledger and "
                       "rollback advisor run over each file. Exit 0 when nothing is critical, 1 when an anomaly is "
                       "critical, 2 when a file cannot be read. Formats as for replay.")
    log_options(n)
    n.add_argument("--json", action="store_true", help="print the JSON report (docs/analyze.md) instead of the text")
    n.add_argument("--json-file", metavar="FILE", help="also write the JSON report to FILE")
    n.add_argument("--html", metavar="FILE", help="also write a standalone HTML report with charts to FILE")
    n.add_argument("--step-seconds", type=float, default=1.0,
                   help="assumed seconds per step where the log has no step times (default 1.0)")
    n.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                   help="progress bars on stderr (default auto: when stderr is a terminal and a file takes > 0.5 s)")
    n.set_defaults(func=cmd_analyze)

    o = with_url(cmd("doctor", "Check Redis and the detector service; exit 1 when something is down."),
                 starts=False)
    o.set_defaults(func=cmd_doctor)

    e = cmd("redis", "Manage the embedded redis-server (data in ~/.trainhealth/redis).")
    e.add_argument("action", choices=["start", "stop", "url"], help="start it, stop it, or print its URL")
    e.set_defaults(func=cmd_redis)

    from trainhealth.commands.advise import add_parser as add_advise

    with_url(add_advise(sub), starts=False).set_defaults(func=cmd_advise)

    from trainhealth.commands.alerts_cli import add_parsers as add_alert_parsers

    add_alert_parsers(sub, with_url, {"alerts": cmd_alerts, "silence": cmd_silence, "deadletters": cmd_deadletters})
    return p


def _alerts_client(args: argparse.Namespace):
    from trainhealth.embedded_redis import connect

    url, _ = _resolve(args, start=False)
    return connect(url)


def cmd_alerts(args: argparse.Namespace) -> int:
    from trainhealth.commands.alerts_cli import run_alerts

    return run_alerts(args, lambda: _alerts_client(args))


def cmd_silence(args: argparse.Namespace) -> int:
    from trainhealth.commands.alerts_cli import run_silence

    return run_silence(args, lambda: _alerts_client(args))


def cmd_deadletters(args: argparse.Namespace) -> int:
    from trainhealth.commands.alerts_cli import run_deadletters

    return run_deadletters(args, lambda: _alerts_client(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return status
    except TrainHealthError as exc:
        print(f"trainhealth: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `trainhealth advise --json | head`: the reader left; end quietly, as Unix tools do
        # (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
