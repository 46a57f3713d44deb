"""What every Redis loop shares (trainhealth.loop): the backoff, the lease scripts, the two-stage stop."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import redis

from trainhealth.loop import LEASE_LUA, RELEASE_LUA, Backoff, stop_on_signals


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff(0.5, 30.0)
    assert [b.failed() for _ in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    b.reset()
    assert (b.delay, b.failed()) == (0.0, 0.5)


def test_lease_is_held_by_one_owner_and_released_only_by_it(r: redis.Redis) -> None:
    lease, release = r.register_script(LEASE_LUA), r.register_script(RELEASE_LUA)
    assert lease(keys=["th:{x}:owner"], args=["a", 10]) == 1
    assert lease(keys=["th:{x}:owner"], args=["b", 10]) == 0  # held by a
    assert lease(keys=["th:{x}:owner"], args=["a", 10]) == 1  # renewed
    assert release(keys=["th:{x}:owner"], args=["b"]) == 0 and r.get("th:{x}:owner") == b"a"
    assert release(keys=["th:{x}:owner"], args=["a"]) == 1 and r.get("th:{x}:owner") is None
    assert lease(keys=["th:{x}:owner"], args=["b", 10]) == 1


def test_first_signal_asks_for_a_warm_stop_the_second_exits(caplog: pytest.LogCaptureFixture) -> None:
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    asked = []
    try:
        with caplog.at_level(logging.INFO, logger="test.loop"):
            stop_on_signals(lambda: asked.append(True), logging.getLogger("test.loop"), "worker w1")
            os.kill(os.getpid(), signal.SIGTERM)
            assert asked == [True]
            with pytest.raises(SystemExit) as exc:
                os.kill(os.getpid(), signal.SIGINT)
        assert exc.value.code == 1 and asked == [True]
        assert [r.getMessage() for r in caplog.records] == [
            "worker w1: SIGTERM, stopping after the current batch (send it again to stop now)",
            "worker w1: second SIGINT, stopping now"]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
