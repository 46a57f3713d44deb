"""The dashboard's reads at scale: what each refresh asks Redis for, and how many bytes come back (issue 16).

Each reduction that runs in Redis (a read-only Lua script) is checked for its exact result against the same data
read whole, and for the bytes it sends (``INFO stats`` ``total_net_output_bytes`` around the call), on a real
redis-server.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
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


# --- the ledger history, sampled and projected in Redis ----------------------------------------------------------

def snapshot(i: int) -> dict:
    """A ledger snapshot as the service writes it (~2 kB with the GPU-hours and costs), 2 s apart."""
    wall = 2.0 * (i + 1)
    seconds = {c: wall * share for c, share in (("productive", 0.8125), ("data_loading", 0.0625),
                                                ("straggler_wait", 0.125))}
    return {"t": T0 + wall, "started_at": T0, "wall_s": wall, "world_size": 1024, "gpu_hour_usd": 2.5,
            "last_step": i, "steps_done": i + 1, "steps_good": i + 1, "restarts": 0, "tokens_total": 16_384 * (i + 1),
            "tokens_good": 16_384 * (i + 1), "throughput_tok_s": 16_384 / 1.75 + i / 7,
            "goodput_tok_s": 16_384 / 2 + i / 3, "goodput_pct": 81.25, "badput_cost_usd": 0.01 * i,
            "seconds": {**seconds, "checkpoint_save": 0.0, "hang": math.nan if i == 3 else 0.0},
            "gpu_hours": {c: v * 1024 / 3600 for c, v in seconds.items()},
            "cost_usd": {c: v * 1024 / 3600 * 2.5 for c, v in seconds.items()},
            "rates": {w: {"throughput_tok_s": 9_000.0 + i, "goodput_tok_s": -math.inf if i == 5 else 8_000.5}
                      for w in ("60s", "600s", "3600s")},
            "custom_by_name": {}, "padding": "x" * 1_000}


def seed_ledger(r: redis.Redis, run: str, n: int) -> None:
    key = run_keys(run).ledger
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(key, {"t": repr(T0 + 2.0 * (i + 1)), "json": json.dumps(snapshot(i))},
                  id=f"{int((T0 + 2.0 * (i + 1)) * 1000)}-0")
    pipe.execute()


def python_history(r: redis.Redis, run: str, entries: list) -> pd.DataFrame:
    """The history frame of ``entries`` read whole, decoded in Python (the reference)."""
    return data._ledger_frame(run_keys(run).ledger, entries, None)


def test_whole_history_sampled_in_redis_is_the_python_sample_exactly(r: redis.Redis) -> None:
    seed_ledger(r, "led", 3_000)
    key = run_keys("led").ledger
    every = r.xrange(key)
    # The Python reference: the first entry at or after each of 100 evenly spaced times, and the newest.
    t0, t1 = int(every[0][0].split(b"-")[0]), int(every[-1][0].split(b"-")[0])
    ids = [int(e[0].split(b"-")[0]) for e in every]
    picked = sorted({next(k for k, ms in enumerate(ids) if ms >= round(t0 + (t1 - t0) * i / 99)) for i in range(99)}
                    | {len(every) - 1})
    expected = python_history(r, "led", [every[k] for k in picked])
    got, sent = measured(r, lambda: data.ledger_history_whole(r, "led", max_points=100))
    pd.testing.assert_frame_equal(got, expected)
    assert len(got) == 100 and got["t"].iloc[-1] == T0 + 6_000.0
    assert math.isnan(got["seconds.hang"].iloc[2]) is False  # entry 3 is not among the sampled ones
    # The drawn paths only: ~110 bytes a snapshot instead of ~2.4 kB.
    drawn, few = measured(r, lambda: data.ledger_history_whole(r, "led", 100, paths=("t", "throughput_tok_s",
                                                                                      "goodput_tok_s")))
    assert list(drawn["t"]) == list(expected["t"]) and list(drawn["goodput_tok_s"]) == list(expected["goodput_tok_s"])
    assert drawn["wall_s"].isna().all() and drawn["seconds.productive"].isna().all()
    _, whole = measured(r, lambda: r.xrange(key, count=100))
    assert whole > 100 * 2_000 and sent < 100 * 900 and few < 100 * 130


def test_newest_history_thinned_in_redis_is_the_python_thinning_exactly(r: redis.Redis) -> None:
    seed_ledger(r, "led", 1_900)
    key = run_keys("led").ledger
    newest = list(reversed(r.xrevrange(key, count=1_800)))
    for points in (600, 7, 2, 1, 2_000):
        expected = python_history(r, "led", [newest[k] for k in data._thin(len(newest), points)])
        got = data.ledger_history(r, "led", count=1_800, max_points=points)
        pd.testing.assert_frame_equal(got, expected)
    short = data.ledger_history(r, "led", count=8, paths=("t", "seconds", "rates.60s"))
    assert list(short["t"]) == [T0 + 2.0 * (i + 1) for i in range(1_892, 1_900)]
    assert list(short["seconds.productive"]) == [2.0 * (i + 1) * 0.8125 for i in range(1_892, 1_900)]
    assert list(short["rate.60s.throughput_tok_s"]) == [9_000.0 + i for i in range(1_892, 1_900)]
    assert short["rate.600s.throughput_tok_s"].isna().all() and short["wall_s"].isna().all()
    # NaN and infinities go through as Python's json writes them.
    first = data.ledger_history(r, "led", count=1_900)
    assert math.isnan(first["seconds.hang"].iloc[3]) and first["rate.60s.goodput_tok_s"].iloc[5] == -math.inf


def test_unreadable_snapshots_are_reported_as_before(r: redis.Redis) -> None:
    key = run_keys("bad").ledger
    r.xadd(key, {"json": "garbage"}, id="1-0")
    r.xadd(key, {"t": "1"}, id="2-0")
    r.xadd(key, {"json": "[1, 2]"}, id="3-0")
    r.xadd(key, {"json": "[]"}, id="4-0")
    r.xadd(key, {"json": json.dumps({"t": T0, "wall_s": "long", "seconds": {"productive": "x"}})}, id="5-0")
    r.xadd(key, {"json": json.dumps({"t": T0 + 2, "wall_s": 2.0, "seconds": [1]})}, id="6-0")
    expected: list[str] = []
    reference = data._ledger_frame(key, r.xrange(key), expected)  # read whole, decoded in Python
    for read in (lambda p: data.ledger_history(r, "bad", problems=p),
                 lambda p: data.ledger_history_whole(r, "bad", problems=p)):
        problems: list[str] = []
        pd.testing.assert_frame_equal(read(problems), reference)
        assert problems == expected
    assert expected == [
        "4 snapshots in th:{bad}:ledger are unreadable (first: entry 1-0: not JSON ('garbage'))",
        "2 snapshots in th:{bad}:ledger have unreadable values, shown as missing (first: entry 5-0: wall_s 'long' is "
        "not a number; seconds.productive 'x' is not a number)"]


# --- the Ranks page's window of busy lists, within a budget of values ---------------------------------------------

def busy_entry(step: int, ranks: int) -> dict:
    """An ``agg`` entry whose busy seconds say their rank and step (rank r of step s: s + r / 10,000)."""
    return {"step": step, "gen": 0, "t_start": repr(T0 + step), "t_end": repr(T0 + step + 0.9), "n_ranks": ranks,
            "busy": json.dumps([round(step + r / 10_000, 6) for r in range(ranks)]), "loss": "2.0"}


def seed_busy(r: redis.Redis, run: str, steps: range, ranks: int) -> None:
    pipe = r.pipeline(transaction=False)
    for s in steps:
        pipe.xadd(run_keys(run).agg, busy_entry(s, ranks), id=f"1-{s}")
    pipe.execute()


def test_rank_window_within_a_budget_keeps_the_newest_steps_and_every_nth_before(r: redis.Redis) -> None:
    seed_busy(r, "wide", range(1, 601), 1024)
    window, cold = measured(r, lambda: data.RankWindow("wide", 500, values=131_072).refresh(r))
    # 131,072 values at 1,024 ranks: 128 entries, the newest 100 whole and every ceil(400 / 28) = 15th step before.
    assert window.stride == 15 and window.reads == [("+", "-", 127)]
    older = list(range(105, 501, 15))
    assert list(window.matrix.columns) == older + list(range(501, 601))
    whole = data.rank_matrix(r, "wide", 500)
    assert window.matrix.equals(whole[window.matrix.columns])
    assert window.matrix.loc[1023, 600] == 600.1023
    _, all_of_it = measured(r, lambda: r.xrevrange(run_keys("wide").agg, count=500))
    assert cold < 0.27 * all_of_it  # 127 entries of 500

    _, idle = measured(r, lambda: window.refresh(r))
    assert window.reads == [] and idle < 120  # the newest entry's id and ranks, not its ~10 kB busy list
    seed_busy(r, "wide", range(601, 604), 1024)
    window.refresh(r)
    # Steps 501-503 left the newest 100 and are no multiples of 15: dropped; 105 is still within 603 - 500.
    assert window.reads == [("(1-600", "1-603", 3)]
    assert list(window.matrix.columns) == older + list(range(504, 604))
    assert window.matrix.equals(data.rank_matrix(r, "wide", 500)[window.matrix.columns])

    # Within the budget (64 ranks x 500 steps): every step, as without one.
    seed_busy(r, "narrow", range(1, 601), 64)
    narrow = data.RankWindow("narrow", 500, values=131_072).refresh(r)
    assert narrow.stride == 1 and narrow.matrix.equals(data.rank_matrix(r, "narrow", 500))


def test_busy_lists_read_fast_are_the_standard_librarys_floats() -> None:
    full = json.dumps([round(0.8 + r / 9_973, 6) for r in range(1024)])
    assert data._busy_list(full) == json.loads(full) and data._busy_list(full.encode()) == json.loads(full)
    assert data._busy_list("[1, 0.5, 2e-3]") == [1.0, 0.5, 0.002]
    with_gaps = data._busy_list("[0.5, null, NaN, 1e400]")  # nulls and tokens msgspec refuses: the slow path
    assert with_gaps[0] == 0.5 and math.isnan(with_gaps[1]) and math.isnan(with_gaps[2]) and with_gaps[3] == math.inf
    for bad in ("[0.8, oops", "{}", '"x"'):
        with pytest.raises(ValueError):
            data._busy_list(bad)
