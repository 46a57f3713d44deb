"""Progress per GPU-hour on the Overview's throughput/goodput chart, for a run written through the real service."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import redis
from streamlit.testing.v1 import AppTest

from trainhealth import Monitor
from trainhealth.dashboard import charts, data
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import DetectorService
from trainhealth.keys import run_keys

pytestmark = pytest.mark.usefixtures("fresh_streamlit_caches")

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
T0 = 1_800_000_000.0
RUN = "prog"


def arr(v: list | dict) -> list:
    """A Plotly JSON array: a list, or a base64 typed array ``{"dtype", "bdata"}``."""
    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def write_through_service(r: redis.Redis) -> list[dict]:
    """2 ranks, steps 0-59 ending 1 s apart, 1,000 tokens per rank, loss 3.0 - 0.01 s; the service reads the records in
    three batches (steps 0-19, 20-39, 40-59) and writes a ledger snapshot after each. Returns the snapshots."""
    mons = [Monitor(RUN, client=r, rank=k, world_size=2, started_at=T0, flush_interval=0.01) for k in range(2)]
    svc = DetectorService(r, consumer="t", clock=lambda: T0 + 100, snapshot_interval=0.0,
                          hang_factory=lambda: HangDetector(floor_s=1e9))
    for part in range(3):
        for s in range(20 * part, 20 * part + 20):
            for mon in mons:
                mon.log_step(s, loss=3.0 - 0.01 * s, tokens=1000, timestamp=T0 + 10 + s)
        for mon in mons:
            assert mon.flush(10)
        for _ in range(50):
            if svc.run_once(block_ms=20) == 0:
                break
    for mon in mons:
        mon.close()
    return [json.loads(f[b"json"]) for _, f in r.xrange(run_keys(RUN).ledger)]


def test_overview_draws_progress_per_gpu_hour_as_the_third_curve(r: redis.Redis, redis_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    snaps = write_through_service(r)
    progress = [s["progress"] for s in snaps]
    # After 20 steps: blocks of 5 (a third of 20, odd), medians at steps 2 and 17: 0.15 over 15 s on 2 GPUs;
    # after 40: blocks of 13, steps 6 and 33; after 60: blocks of 19, steps 9 and 50. A straight line: 18.0 each.
    assert [(p["points"], p["block"], round(p["loss_drop"], 9), p["tokens_good"]) for p in progress[-3:]] == [
        (20, 5, 0.15, 30_000), (40, 13, 0.27, 54_000), (60, 19, 0.41, 82_000)]
    assert [p["loss_drop_per_gpu_hour"] for p in progress[-3:]] == pytest.approx([18.0, 18.0, 18.0], rel=1e-9)
    assert [p["loss_drop_per_btok"] for p in progress[-3:]] == pytest.approx([5000.0] * 3, rel=1e-9)  # 0.01 a 2,000
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params["run"] = RUN
    at.run()
    assert not at.exception
    fig = next(json.loads(el.proto.spec) for el in at.get("plotly_chart")
               if json.loads(el.proto.spec)["layout"]["title"]["text"].startswith("Throughput vs goodput"))
    names = [t["name"] for t in fig["data"]]
    assert names == ["throughput", "goodput", "gap = discarded tokens + pauses", "progress per GPU-hour"]
    third = fig["data"][3]
    assert third["yaxis"] == "y2"
    assert arr(third["y"]) == [s["progress"]["loss_drop_per_gpu_hour"] for s in snaps]
    assert arr(third["y"])[-1] == pytest.approx(18.0, rel=1e-9)
    assert any(c.value.endswith(" Progress per GPU-hour (right axis, dashed): the loss decrease per GPU-hour over the "
                                "kept steps since the run started, median of the first points against the newest; "
                                "below 0 the loss rose.") for c in at.main.caption)
    axis = fig["layout"]["yaxis2"]
    assert (axis["title"]["text"], axis["side"], axis["overlaying"]) == ("loss decrease / GPU-hour", "right", "y")


def test_the_chart_leaves_progress_out_when_no_snapshot_has_it(r: redis.Redis) -> None:
    k = run_keys("noprog")
    for i in range(2):
        snap = {"t": T0 + 60 * (i + 1), "throughput_tok_s": 10.0, "goodput_tok_s": 8.0, "progress": None}
        r.xadd(k.ledger, {"json": json.dumps(snap)}, id=f"{int((T0 + 60 * (i + 1)) * 1000)}-0")
    hist = data.ledger_history(r, "noprog")
    assert hist[data.PROGRESS_COLUMN].isna().all()
    fig = charts.goodput_over_time(hist, "UTC")
    assert [t.name for t in fig.data] == ["throughput", "goodput", "gap = discarded tokens + pauses"]
    assert "yaxis2" not in fig.layout.to_plotly_json()
