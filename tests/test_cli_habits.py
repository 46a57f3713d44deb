"""CLI habits of a tool run by SREs: ``doctor --json``, ``--log-format json`` for the services, shell completion."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from trainhealth.embedded_redis import free_port


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainhealth", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_doctor_json_reports_each_component(r: redis.Redis, redis_url: str) -> None:
    r.zadd("th:runs", {"json-a": 1.0, "json-b": 2.0})
    out = cli("doctor", "--json", "--redis-url", redis_url)
    rep = json.loads(out.stdout)
    assert out.returncode == 1  # no detector service
    assert rep == {"ok": False, "redis": {"url": redis_url, "ok": True, "version": r.info()["redis_version"]},
                   "services": [], "runs": r.zcard("th:runs"), "data_lost": [],
                   "alerting": rep["alerting"]}
    assert rep["alerting"]["ok"] is True and rep["alerting"]["lines"][0].startswith("Alert worker: not configured")


def test_doctor_json_hides_the_password_of_an_unreachable_redis() -> None:
    url = f"redis://:s3cret-pw@127.0.0.1:{free_port(0)}/0"
    out = cli("doctor", "--json", "--redis-url", url)
    rep = json.loads(out.stdout)
    assert out.returncode == 1 and rep["ok"] is False and rep["redis"]["ok"] is False
    assert rep["redis"]["url"] == url.replace(":s3cret-pw@", ":***@")
    assert "s3cret" not in out.stdout + out.stderr


def test_services_log_one_json_object_per_line(redis_url: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "trainhealth", "--log-format", "json", "serve", "--redis-url",
                             redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(4.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    records = [json.loads(line) for line in err.splitlines() if line.strip()]  # every line is JSON
    assert records, err
    for rec in records:
        assert {"timestamp", "level", "logger", "message"} <= rec.keys(), rec
        assert rec["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    assert any(rec["logger"].startswith("trainhealth.") for rec in records)


def test_bash_completion_names_every_command_and_parses(tmp_path: Path) -> None:
    out = cli("completion", "bash")
    assert out.returncode == 0, out.stderr
    script = tmp_path / "trainhealth.bash"
    script.write_text(out.stdout)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    for name in ("demo", "serve", "dashboard", "replay", "follow", "analyze", "doctor", "advise", "alerts",
                 "completion", "--log-format", "--from-start"):
        assert name in out.stdout, name
