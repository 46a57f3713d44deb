"""Memory on the Ranks page (every rank over time, the drill-down's rank) and in the incident cards (the ranks'
memory and GPU health), in Streamlit's AppTest on a real redis-server."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from streamlit.testing.v1 import AppTest

from trainhealth.anomaly import Anomaly
from trainhealth.dashboard import data
from trainhealth.detectors.incidents import IncidentGrouper
from trainhealth.keys import RUNS, run_keys, service_heartbeat
from trainhealth.wire import memory_entry

pytestmark = pytest.mark.usefixtures("fresh_streamlit_caches")

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
RUN = "mem-run"
WORLD = 8
GiB, MiB = 2**30, 2**20
#: Rank 3's CUDA allocation grows 1,126 MiB in the hour of samples (1.10 GiB/h); the others hold 40 GiB + r MiB.
GROWTH_MIB = 1126
ENTRIES = 121  # every 30 s over 3,600 s


def alloc_mib(rank: int, i: int) -> int:
    return 71_782 + round(GROWTH_MIB * i / (ENTRIES - 1)) if rank == 3 else 40_960 + rank


def seed(r: redis.Redis) -> float:
    """A running 8-rank job: 30 timed steps, an hour of memory history ending now, every rank's heartbeat (rank 3's
    with its GPU held down by heat), and an active memory-imbalance incident on rank 3."""
    k = run_keys(RUN)
    now = time.time()
    r.zadd(RUNS, {RUN: now - 4000})
    r.hset(k.meta, mapping={"name": RUN, "world_size": WORLD, "started_at": repr(now - 4000), "status": "running"})
    for s in range(30):
        busy = [0.1 + 0.001 * rk for rk in range(WORLD)]
        r.xadd(k.agg, {"step": s, "gen": 0, "t_start": repr(now - 60 + s), "t_end": repr(now - 59 + s),
                       "dur": "1.0", "n_ranks": WORLD, "data_s": "0.0", "busy": json.dumps(busy)}, id=f"1-{s}")
    ms = int(now * 1000)
    for i in range(ENTRIES):
        t = now - 30.0 * (ENTRIES - 1 - i)
        beats = {rk: {"step": i, "mem": {"rss": 3 * GiB, "cuda": {"alloc": alloc_mib(rk, i) * MiB,
                                                                   "reserved": 75 * GiB}}} for rk in range(WORLD)}
        r.xadd(k.memory, memory_entry(beats, t), id=f"{ms - 30_000 * (ENTRIES - 1 - i)}-0")
    for rk in range(WORLD):
        cuda = {"device": rk, "total": 80 * GiB, "alloc": (71.2 * GiB if rk == 3 else 40 * GiB + rk * MiB),
                "alloc_peak": 74 * GiB if rk == 3 else 41 * GiB, "reserved": 75 * GiB, "reserved_peak": 76 * GiB,
                "retries": 0, "ooms": 0}
        gpu = {"device": rk, "sm_clock_mhz": 1210 if rk == 3 else 1980, "sm_clock_max_mhz": 1980,
               "temp_c": 87 if rk == 3 else 64, "power_w": 350.0, "power_limit_w": 400.0,
               "throttle": ["thermal slowdown (hardware)"] if rk == 3 else []}
        r.hset(k.heartbeats, str(rk), json.dumps({
            "t": now, "step": 29, "step_t": now - 1, "phase": "train", "host": "node-a" if rk < 4 else "node-b",
            "pid": 100 + rk, "inc": now - 4000,
            "mem": {"rss": 3 * GiB, "rss_anon": 3 * GiB, "host_total": 512 * GiB, "cuda": cuda}, "gpu": gpu}))
    a = Anomaly("memory_imbalance", "warning", 20, "rank 3 (node-a): peak CUDA allocation 74.0 GiB vs 41.0 GiB",
                ranks=(3,), hosts=("node-a",), evidence={"peak": 74 * GiB, "median_peak": 41 * GiB,
                                                         "excess": 33 * GiB, "capacity": 80 * GiB})
    grouper = IncidentGrouper()
    grouper.update([a])
    for iid, inc in grouper.incidents.items():
        r.hset(k.incidents, iid, json.dumps({**inc.to_dict(), "first_seen": now, "last_seen": now}))
    r.hset(k.anomalies, a.id, json.dumps({**a.to_dict(), "first_seen": now, "last_seen": now}))
    r.set(service_heartbeat("svc-1"), json.dumps({"pid": 1, "host": "h", "t": now, "runs": 1}), ex=60)
    return now


@pytest.fixture
def seeded(r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    return seed(r)


def arr(v: list | dict) -> list:
    """A Plotly JSON array: a list, or a base64 typed array ``{"dtype", "bdata", "shape"}``."""
    if isinstance(v, dict):
        flat = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        return flat.reshape([int(n) for n in str(v.get("shape", len(flat))).split(",")]).tolist()
    return list(v)


def ranks_page(**query: str) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update({"run": RUN, **query})
    at.run()
    at.switch_page("pages/ranks.py").run()
    assert not at.exception, at.exception
    return at


CARD = ("**Memory and GPUs** (newest heartbeats)  \n"
        "rank 3: 71.2 of 80.0 GiB allocated (peak 74.0 GiB, 75.0 GiB reserved), +1.10 GiB/h over the last 60.0 min"
        "  \nrank 3 GPU: SM clock 1,210 of 1,980 MHz, 87 °C, 350 of 400 W, held down by thermal slowdown (hardware)")


def test_ranks_page_draws_every_ranks_memory_over_time_and_the_drilled_ranks(seeded: float) -> None:
    at = ranks_page(rank="3")
    figs = {json.loads(f.proto.spec)["layout"]["title"]["text"]: json.loads(f.proto.spec)
            for f in at.get("plotly_chart")}
    heat = figs["CUDA allocated per rank (GiB)"]["data"][0]
    z = np.array(arr(heat["z"]), dtype=float)
    # 121 samples thinned in Redis to every 2nd (the newest kept): 61 columns of 8 ranks.
    assert z.shape == (8, 61)
    assert z[3, -1] == pytest.approx(72_908 / 1024, abs=1e-3) and z[3, 0] == pytest.approx(71_782 / 1024, abs=1e-3)
    assert z[0, -1] == pytest.approx(40.0, abs=1e-3)
    captions = [c.value for c in at.main.caption]
    assert captions[-1] == ("CUDA allocated in GiB of each rank, from the ranks' heartbeats: 61 samples over 60.0 min "
                            "(every 30 s, thinned to at most 120 columns). Newest: median 40.0 GiB, highest rank 3 at "
                            "71.2 GiB.")
    # The drill-down: rank 3 beside the others, and its newest heartbeat in words.
    lines = {t["name"]: t for t in figs["Rank 3: CUDA allocated (GiB)"]["data"]}
    assert list(lines) == ["rank 3", "median of the others", "highest of the others"]
    assert captions[-2] == ("Rank 3's newest heartbeat: 71.2 of 80.0 GiB allocated (peak 74.0 GiB, 75.0 GiB "
                            "reserved); GPU SM clock 1,210 of 1,980 MHz, 87 °C, 350 of 400 W, held down by thermal "
                            "slowdown (hardware).")
    # Host RSS instead: the same window, the other list.
    at.segmented_control(key="ranks_memory_metric").set_value("rss").run()
    captions = [c.value for c in at.main.caption]
    assert captions[-1] == ("Host RSS in GiB of each rank, from the ranks' heartbeats: 61 samples over 60.0 min (every "
                            "30 s, thinned to at most 120 columns). Newest: median 3.0 GiB, highest rank 0 at 3.0 GiB.")


def test_the_incident_card_shows_its_ranks_memory_and_gpu(seeded: float) -> None:
    at = ranks_page()
    texts = [m.value for m in at.main.markdown]
    head = next(i for i, t in enumerate(texts) if t.startswith(":orange-badge[warning] :gray-badge[Memory imbalance]"))
    assert texts[head] == (":orange-badge[warning] :gray-badge[Memory imbalance] **Rank 3 (node-a) peaks at 74.0 GiB "
                           "of memory, the other ranks at 41.0 GiB**")
    assert texts[head + 4] == CARD


def test_memory_reads_take_only_what_is_drawn(seeded: float, r: redis.Redis) -> None:
    matrix = data.memory_matrix(r, RUN, "alloc", columns=30)
    assert matrix.shape == (8, 25) and matrix.attrs["steps"][-1] == 120  # every 5th of 121, the newest kept
    rates = data.memory_rates(r, RUN, [3, 0, 9])
    assert {rk: (round(v[0] / GiB, 4), v[1]) for rk, v in rates.items()} == {
        0: (0.0, 3600.0), 3: (round(GROWTH_MIB / 1024, 4), 3600.0)}
    assert sorted(data.rank_heartbeats(r, RUN, [3, 11])) == [3]
    with pytest.raises(ValueError, match="metric='vram' is not a memory list"):
        data.memory_matrix(r, RUN, "vram")
    k = run_keys(RUN)
    r.xadd(k.memory, {"t": "1.0", "step": "1", "n": "1", "alloc": "[1,\"x\"]"})
    problems: list[str] = []
    # 122 entries: every 2nd (61, the newest the unreadable one) is read, 60 drawn.
    assert data.memory_matrix(r, RUN, "alloc", problems=problems).shape == (8, 60)
    assert len(problems) == 1 and problems[0].startswith("th:{mem-run}:mem: 1 entry unreadable (")
