"""Test fixtures: a real redis-server per test session (never a mock).

``TRAINHEALTH_TEST_REDIS_URL`` points the tests at an existing server instead (its
database is flushed between tests). Otherwise a private redis-server is started on a free
port with persistence off, from the same binary the product uses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from trainhealth.embedded_redis import find_redis_server, free_port, ping

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def real_logs() -> Path:
    """``../shared/real_logs`` beside the repository (CI lays it there), or ``$TRAINHEALTH_REAL_LOGS``."""
    path = Path(os.environ.get("TRAINHEALTH_REAL_LOGS") or ROOT.parent / "shared" / "real_logs")
    if not (path / "MANIFEST.md").is_file():
        pytest.fail(f"real training logs not found at {path}: clone beside shared/ or set TRAINHEALTH_REAL_LOGS")
    return path


class RedisServer:
    """A redis-server process the tests own; can be stopped and restarted on the same port."""

    def __init__(self, directory: Path) -> None:
        self.binary = find_redis_server()
        self.port = free_port()
        self.directory = directory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not ping(self.url, timeout=0.2):
            if time.monotonic() > deadline:
                raise RuntimeError(f"test redis-server did not start on {self.url}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer | None]:
    """The session's own redis-server, or None when TRAINHEALTH_TEST_REDIS_URL is set."""
    if os.environ.get("TRAINHEALTH_TEST_REDIS_URL"):
        yield None
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer | None) -> Iterator[str]:
    """URL of a clean Redis database for one test."""
    url = os.environ.get("TRAINHEALTH_TEST_REDIS_URL") or redis_server.url  # type: ignore[union-attr]
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    yield url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    """A redis-py client on the clean test database."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server for tests that stop and restart it."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never touch the user's ~/.trainhealth (embedded server files) from tests.
    monkeypatch.setenv("TRAINHEALTH_HOME", str(tmp_path / "th-home"))
    monkeypatch.delenv("TRAINHEALTH_REDIS_URL", raising=False)


PYTHON = sys.executable


def _wait_for(pred, timeout: float, what: str):
    """Poll ``pred()`` every 0.2 s until it returns something truthy (returned), or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def wait_for():
    """The polling helper of the end-to-end tests: ``wait_for(pred, timeout_s, what)``."""
    return _wait_for


@pytest.fixture
def serve(redis_url: str) -> Iterator[subprocess.Popen]:
    """`trainhealth serve` with its defaults as a subprocess on the test Redis, as a user runs it; stopped with
    SIGTERM (it must exit 0)."""
    proc = subprocess.Popen([sys.executable, "-m", "trainhealth", "serve", "--redis-url", redis_url,
                             "--consumer", "tests"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out


@pytest.fixture
def fresh_streamlit_caches() -> Iterator[None]:
    """Empty Streamlit's process-global caches around a test: a client or frame cached for one test's Redis URL
    must not answer the next. Dashboard test modules use it for every test (``pytestmark``)."""
    import streamlit as st

    st.cache_resource.clear()
    st.cache_data.clear()
    yield
    st.cache_resource.clear()
    st.cache_data.clear()
