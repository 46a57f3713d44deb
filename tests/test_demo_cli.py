"""`trainhealth demo` as a user runs it: embedded Redis, service, dashboard, job; Ctrl-C stops all."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis

from trainhealth.embedded_redis import free_port, ping


def test_demo_starts_everything_and_ctrl_c_stops_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    env = {**os.environ, "TRAINHEALTH_HOME": str(home)}
    env.pop("TRAINHEALTH_REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "trainhealth", "demo", "--steps", "120", "--ranks", "4",
                             "--port", str(port), "--run", "cli-demo"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Demo job finished" in line:
                break
        out = "".join(lines)
        m = re.search(r"Redis: started embedded redis-server at (redis://127\.0\.0\.1:\d+/0)", out)
        assert m, out
        assert out.count("Redis: ") == 1, out  # said once, not again by each child process
        url = m.group(1)
        assert f"Dashboard: http://127.0.0.1:{port}/?run=cli-demo" in out
        assert "Demo job finished (0 restarts)" in out
        assert json.loads((home / "redis" / "server.json").read_text())["url"] == url
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=30) as resp:
            assert resp.read() == b"ok"
        c = redis.Redis.from_url(url)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            raw = c.get("th:{cli-demo}:ledger:latest")
            if raw and json.loads(raw)["steps_done"] == 120:
                break
            time.sleep(0.2)
        snap = json.loads(c.get("th:{cli-demo}:ledger:latest"))
        assert (snap["steps_done"], snap["world_size"], snap["tokens_total"]) == (120, 4, 120 * 4 * 8192)
        assert c.hget("th:{cli-demo}:meta", "source") == b"demo"
        assert c.config_get("appendonly")["appendonly"] == "yes"
        c.close()  # a connected client would keep the server up (test below)
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "Stopped the embedded redis-server" in rest
    assert not ping(url)
    assert not (home / "redis" / "server.json").exists()


def test_demo_and_replay_reject_bad_arguments_before_starting_anything(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "TRAINHEALTH_HOME": str(home)}
    env.pop("TRAINHEALTH_REDIS_URL", None)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [
        (["demo", "--ranks", "1"], "--ranks=1 must be between 2 and 64"),
        (["demo", "--steps", "0"], "--steps=0 must be >= 1"),
        (["demo", "--port", "70000"], "--port=70000 is not a TCP port (1-65535)"),
        (["demo", "--port", str(busy.getsockname()[1])], "is already in use on 127.0.0.1: pass another --port"),
        (["replay", str(tmp_path / "missing.json")], "missing.json: cannot read: No such file or directory"),
        (["replay", "--speed", "-2", "x.json"], "--speed=-2.0 must be >= 0"),
    ]
    gz = tmp_path / "state.json.gz"
    gz.write_bytes(gzip.compress(b'{"log_history": []}'))
    cases.append((["replay", str(gz)], "no training steps (log_history entries with 'loss') to replay"))
    bad = tmp_path / "binary.json"
    bad.write_bytes(b"\x00\xff\xfe")
    cases.append((["replay", str(bad)], "binary.json: a binary file of unknown format; supported formats: "))
    try:
        for argv, message in cases:
            out = subprocess.run([sys.executable, "-m", "trainhealth", *argv], env=env, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 2, (argv, out.stdout, out.stderr)
            assert message in out.stderr, (argv, out.stderr)
            assert "Traceback" not in out.stderr
    finally:
        busy.close()
    assert not (home / "redis").exists()  # nothing was started for a command that could not run


def _dashboard(home: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "TRAINHEALTH_HOME": str(home)}
    env.pop("TRAINHEALTH_REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "trainhealth", "dashboard", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as resp:
                if resp.read() == b"ok":
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(proc.communicate()[0])


def test_dashboard_stops_the_embedded_redis_it_started_unless_someone_else_uses_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    proc = _dashboard(home, port)
    url = json.loads((home / "redis" / "server.json").read_text())["url"]
    proc.send_signal(signal.SIGTERM)  # to this process alone, as a supervisor sends it: Streamlit goes too
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 8
    assert f"Stopped the embedded redis-server (data kept in {home / 'redis'})." in out
    assert not ping(url)
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # nothing serves the dashboard's port any more
    # Started again, and a client (here a redis-cli-like connection) still connected at Ctrl-C: left running.
    proc = _dashboard(home, free_port())
    url = json.loads((home / "redis" / "server.json").read_text())["url"]
    other = redis.Redis.from_url(url)
    other.ping()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert (f"Left the embedded redis-server running at {url}: 1 other client is connected (`trainhealth redis "
            "stop` stops it).") in out
    assert ping(url)
    other.close()
    stop = [sys.executable, "-m", "trainhealth", "redis", "stop"]
    env = {**os.environ, "TRAINHEALTH_HOME": str(home)}
    assert subprocess.run(stop, check=True, capture_output=True, text=True, env=env).stdout == "stopped\n"
    assert not ping(url)
    # Nothing left to stop: said so, not "stopped".
    assert subprocess.run(stop, check=True, capture_output=True, text=True, env=env).stdout == (
        f"not running (nothing to stop in {home / 'redis'})\n")


def test_demo_alert_routes_wait_a_minute_for_throughput_drops(monkeypatch) -> None:
    import tomllib

    from trainhealth.alerts.config import parse
    from trainhealth.commands.demo import alerts_config

    monkeypatch.setenv("TRAINHEALTH_DEMO_WEBHOOK_SECRET", "s3cret")
    cfg = parse(tomllib.loads(alerts_config("http://127.0.0.1:9/alerts", "http://127.0.0.1:8501")))

    def routed(kind: str, severity: str) -> list[tuple[str, float]]:
        labels = {"run": "r", "kind": kind, "severity": severity, "rank": "", "host": ""}
        return [(r.id, r.timers.group_wait) for r in cfg.route.match(labels) if r.receivers]

    assert routed("throughput_drop", "warning") == [("throughput", 60.0)]
    assert routed("loss_spike", "warning") == [("notify", 0.0)]
    assert routed("nan_inf", "critical") == [("notify", 0.0)]
    assert routed("slow_step", "info") == []


def test_demo_receiver_prints_each_alerts_own_state() -> None:
    import httpx

    from trainhealth.commands.demo import start_alert_receiver

    lines: list[str] = []
    server, url = start_alert_receiver(lines.append)
    try:
        def alert(kind: str, status: str, point: bool) -> dict:
            return {"status": status, "point_event": point, "labels": {"severity": "warning", "kind": kind,
                                                                      "run": "r"}, "anomaly": {"message": kind}}
        doc = {"status": "firing", "alerts": [alert("straggler", "firing", False),
                                              alert("restart", "resolved", True),
                                              alert("loss_spike", "resolved", False)]}
        assert httpx.post(url, json=doc).status_code == 200
    finally:
        server.shutdown()
    assert lines == ["ALERT [FIRING] warning straggler · run r: straggler",
                     "ALERT [EVENT] warning restart · run r: restart",
                     "ALERT [RESOLVED] warning loss_spike · run r: loss_spike"]


def test_ctrl_c_in_the_middle_of_the_job_stops_it_and_marks_the_run_interrupted(r: redis.Redis, redis_url: str,
                                                                                  tmp_path: Path) -> None:
    # As in a terminal: SIGINT to the whole process group (the demo, its services and its ranks), mid-job. Every
    # process ends within the bound (a rank's collector once hung on its own lock here), and the run is left
    # 'interrupted', not 'running' for a later service to call crashed.
    env = {**os.environ, "TRAINHEALTH_HOME": str(tmp_path / "home"), "TRAINHEALTH_REDIS_URL": redis_url}
    proc = subprocess.Popen([sys.executable, "-m", "trainhealth", "demo", "--steps", "3000", "--ranks", "4",
                             "--no-dashboard", "--run", "cli-stop"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not r.hexists("th:{cli-stop}:hb", "3"):
            time.sleep(0.2)
        time.sleep(3.0)  # steps under way
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, rest[-3000:]
    assert "Stopping…" in rest and "Traceback" not in rest
    assert r.hget("th:{cli-stop}:meta", "status") == b"interrupted"
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker ends once the demo has
    while subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout and time.monotonic() < deadline:
        time.sleep(0.2)
    assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout == b""  # nothing left
