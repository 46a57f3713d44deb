"""The embedded Redis: a real redis-server started, reused and stopped by trainhealth."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import redis

from trainhealth import embedded_redis as server
from trainhealth.exceptions import RedisUnavailableError


def test_finds_a_real_binary() -> None:
    path = server.find_redis_server()
    assert os.access(path, os.X_OK)
    assert Path(path).name == "redis-server"


def test_embedded_start_reuse_persistence_and_stop(tmp_path: Path) -> None:
    emb = server.EmbeddedRedis(tmp_path / "redis", port=server.free_port())
    url = emb.ensure_running()
    try:
        assert emb.started is True
        info = json.loads((tmp_path / "redis" / "server.json").read_text())
        assert info["url"] == url and info["pid"] > 0
        c = redis.Redis.from_url(url)
        assert c.config_get("appendonly") == {"appendonly": "yes"}
        assert c.config_get("bind")["bind"] == "127.0.0.1"
        assert c.config_get("dir")["dir"] == str(tmp_path / "redis")
        c.set("kept", "1")
        again = server.EmbeddedRedis(tmp_path / "redis")
        assert again.ensure_running() == url
        assert again.started is False  # reused, not a second server
    finally:
        emb.stop()
    assert not server.ping(url)
    assert not (tmp_path / "redis" / "server.json").exists()
    # Persistence: a restart in the same directory has the data back.
    emb2 = server.EmbeddedRedis(tmp_path / "redis", port=server.free_port())
    url2 = emb2.ensure_running()
    try:
        assert redis.Redis.from_url(url2).get("kept") == b"1"
    finally:
        emb2.stop()


def test_resolve_url_prefers_environment(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    url, embedded = server.resolve_url()
    assert (url, embedded) == (redis_url, None)


def test_resolve_without_start_and_nothing_running_says_what_to_do() -> None:
    with pytest.raises(RedisUnavailableError, match="set TRAINHEALTH_REDIS_URL, or start the embedded one with "
                       "`trainhealth redis start`"):
        server.resolve_url(start=False)


def test_no_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RedisUnavailableError, match="no redis-server found"):
        server.find_redis_server()


def test_password_and_unix_socket_urls_work_for_collectors(tmp_path: Path) -> None:
    import subprocess
    import time

    from trainhealth import Monitor

    port, sock = server.free_port(), tmp_path / "r.sock"
    proc = subprocess.Popen([server.find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                             "--requirepass", "s3cret", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    try:
        tcp = f"redis://:s3cret@127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while not server.ping(tcp):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not server.ping(f"redis://127.0.0.1:{port}/0")  # the password is really required
        for url, run in ((tcp, "tcp-run"), (f"unix://{sock}?password=s3cret", "unix-run")):
            mon = Monitor(run, redis_url=url, rank=0, world_size=1)
            mon.log_step(1, loss=1.0)
            assert mon.close() is True
        c = redis.Redis.from_url(tcp)
        assert c.xlen("th:{tcp-run}:steps") == 1 and c.xlen("th:{unix-run}:steps") == 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_step_stream_is_trimmed_to_the_retention(r: redis.Redis, redis_url: str) -> None:
    from trainhealth import Monitor

    # one record per entry here (batch_records=1), so entries = steps
    mon = Monitor("trim", redis_url=redis_url, rank=0, world_size=1, retention=1000, batch_records=1,
                  close_timeout=60.0)  # 20,000 one-record XADDs: generous on a loaded CI machine
    for s in range(20_000):
        mon.log_step(s, loss=1.0)
    assert mon.close() is True
    n = r.xlen("th:{trim}:steps")
    assert n == 1000  # a retention under 10 radix-tree nodes is trimmed exactly
    last = r.xrevrange("th:{trim}:steps", count=1)[0][1]
    assert json.loads(last[b"recs"])[0]["step"] == 19999


def test_retention_bytes_env(monkeypatch) -> None:
    import pytest

    from trainhealth import config
    from trainhealth.exceptions import ConfigError

    assert config.retention_bytes() == 512 * 2**20
    monkeypatch.setenv("TRAINHEALTH_RETENTION_BYTES", str(64 * 2**20))
    assert config.retention_bytes() == 64 * 2**20
    monkeypatch.setenv("TRAINHEALTH_RETENTION_BYTES", "4096")
    with pytest.raises(ConfigError, match="TRAINHEALTH_RETENTION_BYTES='4096' must be an integer >= 1048576"):
        config.retention_bytes()
