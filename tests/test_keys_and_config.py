from __future__ import annotations

import dataclasses

import pytest
from redis.crc import key_slot

from trainhealth import Monitor, config, keys
from trainhealth.exceptions import ConfigError


def test_run_keys_literal_strings() -> None:
    k = keys.run_keys("llama-70b.v2_run")
    assert k.meta == "th:{llama-70b.v2_run}:meta"
    assert k.steps == "th:{llama-70b.v2_run}:steps"
    assert k.events == "th:{llama-70b.v2_run}:events"
    assert k.heartbeats == "th:{llama-70b.v2_run}:hb"
    assert k.agg == "th:{llama-70b.v2_run}:agg"
    assert k.memory == "th:{llama-70b.v2_run}:mem"
    assert k.agg_rollup == "th:{llama-70b.v2_run}:agg:rollup"
    assert k.checkpoints == "th:{llama-70b.v2_run}:checkpoints"
    assert k.samples == "th:{llama-70b.v2_run}:samples"
    assert k.anomalies == "th:{llama-70b.v2_run}:anomalies"
    assert k.incidents == "th:{llama-70b.v2_run}:incidents"
    assert k.anomaly_log == "th:{llama-70b.v2_run}:anomaly_log"
    assert k.ledger == "th:{llama-70b.v2_run}:ledger"
    assert k.ledger_latest == "th:{llama-70b.v2_run}:ledger:latest"
    assert k.state == "th:{llama-70b.v2_run}:state"
    assert keys.RUNS == "th:runs"
    assert keys.service_heartbeat("host-a") == "th:service:host-a"
    assert keys.alerts_worker_heartbeat("host-a-42") == "th:{alerts}:worker:host-a-42"
    assert keys.alerts_forward("team-am") == "th:{alerts}:forward:team-am"


def test_every_key_of_a_run_is_in_the_slot_of_its_hash_tag_and_the_alert_keys_share_one() -> None:
    # Redis Cluster hashes only the text between the first { and }: a run's MULTI/EXEC and scripts stay on one node.
    for run in ("llama-70b.v2_run", "r", "x" * 128):
        k = keys.run_keys(run)
        names = [f.name for f in dataclasses.fields(k)]
        props = [n for n, v in vars(keys.RunKeys).items() if isinstance(v, property) and not n.startswith("_")]
        run_keys = [getattr(k, p) for p in props if p != "input_streams"] + list(k.input_streams)
        # its 17 keys (th:{run}:checkpoints, th:{run}:mem and th:{run}:samples too), and the 2 input streams again
        assert names == ["run"] and len(run_keys) == 19
        assert {key_slot(key.encode()) for key in run_keys} == {key_slot(run.encode())}
    alert_keys = [keys.ALERTS_OUTBOX, keys.ALERTS_DEAD, keys.ALERTS_SENT, keys.ALERTS_SILENCES, keys.ALERTS_GROUPS,
                  keys.ALERTS_STATE, keys.ALERTS_RETRY, keys.ALERTS_ATTEMPTS, keys.ALERTS_SINKS, keys.ALERTS_LEADER,
                  keys.alerts_worker_heartbeat("host-1"), keys.alerts_forward("team-am")]
    assert {key_slot(key.encode()) for key in alert_keys} == {key_slot(b"alerts")} == {4569}
    # The global keys are one key each, written one command at a time (never in a run's transaction).
    assert (keys.RUNS, keys.SERVICES, keys.SERVICE_HEARTBEAT_PATTERN) == ("th:runs", "th:services", "th:service:*")


@pytest.mark.parametrize(("url", "kind", "nodes", "service", "db", "tls"), [
    ("redis+sentinel://:pw@s1,s2:26380,[::1]:26381/mymaster/2", "sentinel",
     (("s1", 26379), ("s2", 26380), ("::1", 26381)), "mymaster", 2, False),
    ("rediss+sentinel://ops:pw@sentinel.internal/cache", "sentinel", (("sentinel.internal", 26379),), "cache", 0, True),
    ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001", "cluster", (("10.0.0.1", 7000), ("10.0.0.2", 7001)), "", 0, False),
    ("rediss+cluster://:pw@redis.internal/0?socket_timeout=3", "cluster", (("redis.internal", 6379),), "", 0, True),
    ("redis://:pw@cache:6380/2", "server", (), "", 0, False),
    ("unix:///run/redis.sock?db=1", "server", (), "", 0, False),
])
def test_one_url_selects_a_server_sentinel_or_cluster(url: str, kind: str, nodes: tuple, service: str, db: int,
                                                      tls: bool) -> None:
    t = config.parse_redis_url(url)
    assert (t.kind, t.nodes, t.service, t.db, t.tls) == (kind, nodes, service, db, tls)
    assert config.redis_url(url) == url
    assert "pw" not in repr(t)  # the password is left out of the target's repr


def test_sentinel_and_cluster_url_credentials_and_options() -> None:
    t = config.parse_redis_url("redis+sentinel://ops:p%40ss@s1/m/3?socket_timeout=2.5&sentinel_password=spw")
    assert (t.username, t.password, dict(t.options)) == ("ops", "p@ss", {"socket_timeout": 2.5,
                                                                          "sentinel_password": "spw"})
    t = config.parse_redis_url("redis+cluster://h1,h2?socket_keepalive=true&max_connections=64")
    assert (t.username, t.password, dict(t.options)) == (None, None, {"socket_keepalive": True, "max_connections": 64})


@pytest.mark.parametrize(("url", "why"), [
    ("redis+sentinel://:hunter2@s1:26379,s2:26379", "a Sentinel URL names the service and optionally the database: "
                                                   "/<service_name>[/<db>]"),
    ("redis+sentinel://:hunter2@s1:26379,s2:26379/m/x", "database 'x' is not a number"),
    ("redis+cluster://:hunter2@h1:7000,h2:7000/3", "Redis Cluster has only database 0"),
    ("redis+cluster://:hunter2@h1:7000,h2:99999", "host 'h2:99999' has no valid port (1-65535)"),
    ("redis+cluster://:hunter2@h1:7000,:7001", "host ':7001' of the list has no name"),
    ("redis+cluster://:hunter2@h1:7000,h2?read_from_replicas=yes", "unknown option 'read_from_replicas'"),
    ("redis+cluster://:hunter2@h1:7000,h2?socket_timeout=soon", "option socket_timeout='soon' is not valid"),
])
def test_a_bad_sentinel_or_cluster_url_is_refused_naming_the_problem_without_its_password(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.redis_url(url)
    shown = url.replace(":hunter2@", ":***@")
    assert str(err.value) == f"redis_url={shown!r} is not a Redis URL: {why}"
    with pytest.raises(ConfigError) as err:
        Monitor("r", redis_url=url, rank=0, world_size=1)
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize("bad", ["", "a{b}", "run:1", "-lead", "x" * 129, "sp ace", None, 12])
def test_invalid_run_ids_are_rejected_with_the_value(bad: object) -> None:
    with pytest.raises(ConfigError) as e:
        keys.run_keys(bad)  # type: ignore[arg-type]
    assert f"run={bad!r}" in str(e.value)


def test_redis_url_resolution_order(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert config.redis_url() is None  # nothing configured (TRAINHEALTH_HOME is a fresh tmp dir)
    (tmp_path / "th-home" / "redis").mkdir(parents=True)
    config.embedded_server_file().write_text('{"url": "redis://127.0.0.1:7777/0"}')
    assert config.redis_url() == "redis://127.0.0.1:7777/0"
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", "rediss://:secret@cache.internal:6380/2")
    assert config.redis_url() == "rediss://:secret@cache.internal:6380/2"
    assert config.redis_url("unix:///run/redis.sock") == "unix:///run/redis.sock"
    with pytest.raises(ConfigError, match=r"redis_url='http://x' is not a Redis URL"):
        config.redis_url("http://x")
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", "localhost:6379")
    with pytest.raises(ConfigError, match=r"TRAINHEALTH_REDIS_URL='localhost:6379'"):
        config.redis_url()


@pytest.mark.parametrize(("url", "message"), [
    ("http://:hunter2@cache:6379/0", "redis_url='http://:***@cache:6379/0' is not a Redis URL: expected redis://, "
                                      "rediss://, unix://, redis+sentinel://, rediss+sentinel://, redis+cluster:// "
                                      "or rediss+cluster://"),
    ("redis://:hunter2@cache:99999/0", "redis_url='redis://***@cache:99999/0' is not a Redis URL: Port out of range "
                                        "0-65535"),
    ("redis://ops:hunter2@cache:63x9/0", "redis_url='redis://***@cache:63x9/0' is not a Redis URL: Port could not be "
                                          "cast to integer value as '63x9'"),
])
def test_a_bad_redis_url_is_refused_without_its_password(url: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.redis_url(url)
    assert str(err.value) == message and "hunter2" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        Monitor("r", redis_url=url, rank=0, world_size=1)  # refused where the handle is made, not in the sender
    assert str(err.value) == message


def test_retention_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.retention_records() == 1_000_000
    monkeypatch.setenv("TRAINHEALTH_RETENTION", "5000")
    assert config.retention_records() == 5000
    monkeypatch.setenv("TRAINHEALTH_RETENTION", "12")
    with pytest.raises(ConfigError, match="TRAINHEALTH_RETENTION='12' must be an integer >= 1000"):
        config.retention_records()
