"""`trainhealth demo` as a user runs it: embedded Redis, service, dashboard, job; Ctrl-C stops all."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis

from trainhealth.server import free_port, ping


def test_demo_starts_everything_and_ctrl_c_stops_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    env = {**os.environ, "TRAINHEALTH_HOME": str(home)}
    env.pop("TRAINHEALTH_REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "trainhealth.cli", "demo", "--steps", "120", "--ranks", "4",
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
        url = m.group(1)
        assert f"Dashboard: http://127.0.0.1:{port}/?run=cli-demo" in out
        assert "Demo job finished (0 restart)" in out
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
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "Stopped the embedded redis-server" in rest
    assert not ping(url)
    assert not (home / "redis" / "server.json").exists()
