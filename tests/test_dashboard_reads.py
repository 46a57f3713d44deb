"""The dashboard's reads at scale: what each refresh asks Redis for, and how many bytes come back (issue 16).

Each reduction that runs in Redis (a read-only Lua script) is checked for its exact result against the same data
read whole, and for the bytes it sends (``INFO stats`` ``total_net_output_bytes`` around the call), on a real
redis-server.
"""

from __future__ import annotations

import json

import redis

from trainhealth.dashboard import data
from trainhealth.keys import run_keys

T0 = 1796000000.0


def out_bytes(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def measured(r: redis.Redis, fn) -> tuple[object, int]:
    """``fn()`` and the bytes Redis sent meanwhile (its own INFO reply subtracted)."""
    a, b = out_bytes(r), out_bytes(r)
    info = b - a
    start = out_bytes(r)
    value = fn()
    return value, out_bytes(r) - start - info


def beat(rank: int, step: object, step_t: object, inc: object, host: str = "node-0001") -> str:
    """A collector heartbeat as the sender writes it (~180 B)."""
    return json.dumps({"t": T0 + 700.0 + rank / 1000, "step": step, "step_t": step_t, "phase": "train",
                       "host": host, "pid": 40_000 + rank, "inc": inc})


def test_processing_state_reduces_1024_heartbeats_in_redis(r: redis.Redis) -> None:
    k = run_keys("wide")
    beats = {str(rank): beat(rank, 1_000 + rank % 7, T0 + 600.0 + rank % 7 * 0.5, T0 + 10.0 + rank % 3)
             for rank in range(1_024)}
    beats["1024"] = beat(1024, 1_010, T0 + 605.25, T0 + 3.5)  # the newest step and the earliest start: one rank
    beats["1025"] = beat(1025, "1011", "nan", None)  # a string step counts as _num reads it; NaN and null do not
    beats["1026"] = "not json"
    beats["1027"] = json.dumps([1, 2, 3])
    beats["1028"] = beat(1028, float("inf"), T0 + 1.0, "x")
    r.hset(k.heartbeats, mapping=beats)
    r.xadd(k.agg, {"step": 998, "gen": 0, "t_end": repr(T0 + 599.125), "busy": json.dumps([0.83] * 1024)})
    state, sent = measured(r, lambda: data.processing_state(r, "wide"))
    assert state == {"hb_step": 1_011, "hb_step_t": T0 + 605.25, "agg_step": 998, "agg_t_end": T0 + 599.125,
                     "inc": T0 + 3.5}
    assert sent < 200  # five numbers (and, the first time, NOSCRIPT before the script is sent)
    assert measured(r, lambda: data.processing_state(r, "wide"))[1] < 120  # not ~180 kB of heartbeats + ~6 kB of busy
    _, whole = measured(r, lambda: r.hgetall(k.heartbeats))
    assert whole > 150_000
    assert data.processing_state(r, "nothing") == {"hb_step": None, "hb_step_t": None, "agg_step": None,
                                                   "agg_t_end": None, "inc": None}
