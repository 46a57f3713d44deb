from __future__ import annotations

import pytest

from trainhealth import Monitor, config, keys
from trainhealth.exceptions import ConfigError


def test_run_keys_literal_strings() -> None:
    k = keys.run_keys("llama-70b.v2_run")
    assert k.meta == "th:{llama-70b.v2_run}:meta"
    assert k.steps == "th:{llama-70b.v2_run}:steps"
    assert k.events == "th:{llama-70b.v2_run}:events"
    assert k.heartbeats == "th:{llama-70b.v2_run}:hb"
    assert k.agg == "th:{llama-70b.v2_run}:agg"
    assert k.agg_rollup == "th:{llama-70b.v2_run}:agg:rollup"
    assert k.checkpoints == "th:{llama-70b.v2_run}:checkpoints"
    assert k.anomalies == "th:{llama-70b.v2_run}:anomalies"
    assert k.incidents == "th:{llama-70b.v2_run}:incidents"
    assert k.anomaly_log == "th:{llama-70b.v2_run}:anomaly_log"
    assert k.ledger == "th:{llama-70b.v2_run}:ledger"
    assert k.ledger_latest == "th:{llama-70b.v2_run}:ledger:latest"
    assert k.state == "th:{llama-70b.v2_run}:state"
    assert keys.RUNS == "th:runs"
    assert keys.service_heartbeat("host-a") == "th:service:host-a"


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
                                      "rediss:// or unix://"),
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
