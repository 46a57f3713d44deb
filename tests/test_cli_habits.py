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


def test_bad_input_is_one_line_naming_it_and_no_secret(tmp_path: Path, real_logs: Path) -> None:
    cases = [
        # redis-py would raise for these options only at the first command, inside a collector's thread
        (["doctor", "--redis-url", "redis://ops:s3cret-pw@127.0.0.1:1/0?socket_timeout=abc"],
         "trainhealth: error: redis_url='redis://ops:***@127.0.0.1:1/0?socket_timeout=abc' is not a Redis URL: "
         "option: Invalid value for 'socket_timeout' in connection URL."),
        (["doctor", "--redis-url", "redis://127.0.0.1:1/0?ssl_cert_reqs=none"],
         "is not a Redis URL: option: AbstractConnection.__init__() got an unexpected keyword argument "
         "'ssl_cert_reqs'"),
        # a password pasted where the URL goes is not echoed whole; a host:port is
        (["doctor", "--redis-url", "s3cret-pw"], "redis_url='s3c'… (9 characters) is not a Redis URL"),
        (["doctor", "--redis-url", "localhost:6379"], "redis_url='localhost:6379' is not a Redis URL"),
        (["--log-level", "bogus", "doctor"], "argument --log-level: invalid choice: 'BOGUS'"),
        (["analyze", "--tensorboard", str(tmp_path / "afile"), str(real_logs / "mmengine_text_loss_nan.log")],
         f"trainhealth: error: --tensorboard {tmp_path / 'afile'}: cannot write: Not a directory"),
    ]
    (tmp_path / "afile").write_text("")
    for args, words in cases:
        out = cli(*args)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr and "s3cret-pw" not in out.stdout + out.stderr


def test_an_alert_sink_url_of_another_scheme_is_shown_without_its_password(tmp_path: Path) -> None:
    config = tmp_path / "alerts.toml"
    config.write_text('[route]\nreceivers = ["s"]\n[sinks.s]\ntype = "webhook"\n'
                      'url = "ftp://user:hunter2SECRET@example.com/x"\n')
    out = cli("alerts", "--config", str(config), "--check")
    assert out.returncode == 2 and "hunter2SECRET" not in out.stdout + out.stderr
    assert 'sinks.s.url = "ftp://user:***@example.com/x": not an http:// or https:// URL' in out.stderr
