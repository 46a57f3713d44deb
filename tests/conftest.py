"""Test fixtures: a real redis-server per test session (never a mock).

``TRAINHEALTH_TEST_REDIS_URL`` points the tests at an existing server instead (its
database is flushed between tests). Otherwise a private redis-server is started on a free
port with persistence off, from the same binary the product uses.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from trainhealth.embedded_redis import find_redis_server, free_port, ping

ROOT = Path(__file__).resolve().parent.parent
#: The published JSON Schemas (``trainhealth schemas --write docs/schemas``; tests/test_schemas.py keeps them current).
SCHEMAS = ROOT / "docs" / "schemas"


@functools.cache
def _validator(name: str) -> Any:
    from jsonschema import Draft202012Validator

    schema = json.loads((SCHEMAS / f"{name}.json").read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def schema_errors(name: str, doc: Any) -> list[str]:
    """Where ``doc`` breaks the published schema ``docs/schemas/<name>.json`` (``$.path: message``), none when valid."""
    errors = sorted(_validator(name).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{e.json_path}: {e.message}" for e in errors]


def check_schema(name: str, doc: Any) -> Any:
    """``doc`` when it is a valid ``name`` document (docs/schemas/<name>.json), else an AssertionError naming where
    it breaks the schema. For a bytes or str ``doc``, its JSON is decoded first (NaN/Infinity accepted, as the
    writers of Redis records and ``analyze --json`` allow them)."""
    if isinstance(doc, (bytes, str)):
        doc = json.loads(doc)
    errors = schema_errors(name, doc)
    assert not errors, f"not a valid {name} document ({len(errors)} errors):\n" + "\n".join(errors[:20])
    return doc


def check_run_records(client: redis.Redis, run: str) -> dict[str, int]:
    """Validate every JSON record of ``run`` in Redis against its published schema: the step records of
    ``th:{run}:steps``, the events, the heartbeats, the anomalies and their log, the incidents, the recommendations,
    the job state and the ledger snapshots (docs/architecture.md). Returns how many of each were checked."""
    from trainhealth.keys import run_keys

    k = run_keys(run)
    counts = dict.fromkeys(("step-records", "event", "heartbeat", "anomaly", "incident", "recommendation",
                            "job-state", "ledger-snapshot"), 0)

    def check(name: str, doc: Any) -> None:
        check_schema(name, doc)
        counts[name] += 1

    for _, f in client.xrange(k.steps):
        check("step-records", f[b"recs"])
    for _, f in client.xrange(k.events):
        check("event", {key.decode(): v.decode() for key, v in f.items()})
    for name, key in (("heartbeat", k.heartbeats), ("anomaly", k.anomalies), ("incident", k.incidents),
                      ("recommendation", k.recommendations)):
        for raw in client.hvals(key):
            check(name, raw)
    for _, f in client.xrange(k.anomaly_log):
        check("anomaly", f[b"json"])
    state = client.get(k.state)
    if state is not None:
        check("job-state", state)
    for raw in [client.get(k.ledger_latest)] + [f[b"json"] for _, f in client.xrange(k.ledger)]:
        if raw is not None:
            check("ledger-snapshot", raw)
    return counts


@pytest.fixture
def valid_run() -> Callable[[redis.Redis, str], dict[str, int]]:
    """``valid_run(client, run)``: every JSON record of the run in Redis checked against its schema
    (:func:`check_run_records`); returns the counts checked."""
    return check_run_records


@pytest.fixture
def valid() -> Callable[[str, Any], Any]:
    """``valid(name, doc)``: ``doc`` (decoded when JSON text), asserted valid against docs/schemas/<name>.json.
    Every test that reads a document trainhealth writes (analyze --json, webhook payloads, Redis records) checks
    it with this."""
    return check_schema


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
