"""The embedded Redis: a real redis-server started, reused and stopped by trainhealth."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import redis

from trainhealth import server
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
    with pytest.raises(RedisUnavailableError, match="set TRAINHEALTH_REDIS_URL or start one with `trainhealth serve`"):
        server.resolve_url(start=False)


def test_no_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RedisUnavailableError, match="no redis-server found"):
        server.find_redis_server()
