"""The whole run on the Overview's step charts (issue 16): reduced with MinMaxLTTB on the server, a step range read
again at full resolution, a refresh that reads only the new entries, and two runs compared by step and by tokens.

The runs are written with raw ``XADD`` as the detector service writes ``th:{run}:agg`` (entry id
``<gen + 1>-<step>``, the fields of ``detectors.pipeline.agg_fields``), so the dashboard is checked against the
documented schema. The last test drags across the chart in a real headless Chromium.
"""

from __future__ import annotations

import base64
import json
import math
import re
import runpy
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from streamlit.testing.v1 import AppTest

from trainhealth.dashboard import charts, data
from trainhealth.keys import RUNS, run_keys, service_heartbeat

pytestmark = pytest.mark.usefixtures("fresh_streamlit_caches")

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
T0 = 1796000000.0
RUN = "long-run"
STEPS = 100_000
SPIKE_STEP, SPIKE_LOSS = 20_000, 9.5
NAN_STEP = 50_000
TOKENS = 4096
_BROWSER = runpy.run_path(str(Path(__file__).with_name("test_dashboard_browser.py")))


def loss_at(step: int) -> float:
    """The seeded loss of a step: a slow decline with a little deterministic wobble, one spike, one NaN."""
    if step == SPIKE_STEP:
        return SPIKE_LOSS
    if step == NAN_STEP:
        return math.nan
    return round(3.0 - step * 1e-5 + 0.01 * ((step * 7919) % 13) / 13, 6)


def agg_entry(step: int, gen: int = 0, loss: float | None = None, tokens: int | None = TOKENS,
              step_s: float | None = None, ranks: int = 4) -> dict:
    """The fields ``agg_fields`` writes for a step (loss/grad norm as repr, or ``nan``/``inf``)."""
    loss = loss_at(step) if loss is None else loss
    t_start = T0 + step
    d = {"step": step, "gen": gen, "t_start": repr(t_start), "t_end": repr(t_start + 0.9), "dur": repr(0.9),
         "n_ranks": ranks, "data_s": "0.01", "busy": json.dumps([0.8] * ranks),
         "loss": repr(loss) if math.isfinite(loss) else str(loss), "grad_norm": repr(1.0 + step % 5 / 10),
         "lr": "0.0003", "samples": 8}
    if tokens is not None:
        d["tokens"] = tokens
    if step_s is not None:
        d["step_s"] = repr(step_s)
    return d


def register(r: redis.Redis, run: str, started: float = T0, world: int = 4) -> None:
    r.zadd(RUNS, {run: started})
    r.hset(run_keys(run).meta, mapping={"name": run, "world_size": str(world), "status": "running",
                                        "started_at": repr(started)})


def seed_long(r: redis.Redis, run: str = RUN, steps: int = STEPS, ranks: int = 4) -> None:
    """``steps`` steps of generation 0, pipelined (about 3 s for 100,000)."""
    register(r, run, world=ranks)
    key = run_keys(run).agg
    for start in range(1, steps + 1, 10_000):
        pipe = r.pipeline(transaction=False)
        for s in range(start, min(steps, start + 9_999) + 1):
            pipe.xadd(key, agg_entry(s, ranks=ranks), id=f"1-{s}")
        pipe.execute()



@pytest.fixture
def env(r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> redis.Redis:
    r.set(service_heartbeat("svc-1"), json.dumps({"pid": 1, "host": "h", "t": time.time(), "runs": 1}), ex=300)
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    return r


@pytest.fixture
def long_run(env: redis.Redis) -> redis.Redis:
    seed_long(env)
    return env


def app(**query: str) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update(query)
    return at.run()


def figures(at: AppTest) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def arr(v: list | dict) -> list:
    """A Plotly JSON array: a list, or a base64 typed array ``{"dtype", "bdata"}``."""
    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def trace(fig: dict, name: str) -> dict:
    return next(t for t in fig["data"] if t.get("name") == name)


def out_bytes(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def measured(r: redis.Redis, fn) -> tuple[object, int]:
    """``fn()`` and the bytes Redis sent meanwhile (its own INFO reply subtracted)."""
    a, b = out_bytes(r), out_bytes(r)
    info = b - a
    start = out_bytes(r)
    value = fn()
    return value, out_bytes(r) - start - info


# --- reduction ---------------------------------------------------------------------------------------------------

def test_reduce_line_keeps_the_spike_the_gap_and_both_ends() -> None:
    x = np.arange(1, STEPS + 1, dtype=np.int64)
    y = np.array([loss_at(int(s)) for s in x])
    nonfinite = np.isnan(y)
    idx = charts.reduce_line(x, y, 2000, nonfinite)
    assert len(idx) == 2001  # 2,000 finite points and the first (only) NaN: the gap
    assert (np.diff(idx) > 0).all() and idx[0] == 0 and idx[-1] == STEPS - 1
    assert y[x == SPIKE_STEP][0] == SPIKE_LOSS and SPIKE_STEP in x[idx]
    assert NAN_STEP in x[idx] and np.isnan(y[idx][x[idx] == NAN_STEP][0])
    # Short curves are drawn whole; inf counts as a gap, and absent values (NaN not stored as such) are joined.
    y2 = np.array([1.0, np.inf, 2.0, np.nan, 3.0])
    assert list(charts.reduce_line(np.arange(5), y2, 2000)) == [0, 1, 2, 3, 4]
    assert list(charts.reduce_line(np.arange(5), y2, 2000, np.array([False, True, False, False, False]))) == [
        0, 1, 2, 4]
    # A budget below LTTB's minimum of 3 points does not panic.
    assert len(charts.reduce_line(np.arange(10), np.arange(10.0), 2)) == 3


def test_nonfinite_runs_one_marker_per_run_and_per_pixel_column() -> None:
    bad = np.array([False, True, True, False, True, False, False, True, True, True])
    assert list(charts.nonfinite_runs(np.arange(10), bad)) == [1, 4, 7]
    every_other = np.arange(10_000) % 2 == 1
    starts = charts.nonfinite_runs(np.arange(10_000), every_other, max_points=100)
    assert len(starts) == 100 and starts[0] == 1


# --- data.StepSeries --------------------------------------------------------------------------------------------

def test_whole_run_series_reads_every_entry_with_only_the_drawn_fields(long_run: redis.Redis) -> None:
    series, cold = measured(long_run, lambda: data.StepSeries(RUN).refresh(long_run))
    frame = series.frame
    assert len(frame) == STEPS and list(frame.columns) == data.SERIES_COLUMNS
    assert frame["step"].tolist() == list(range(1, STEPS + 1))
    spike = frame[frame["step"] == SPIKE_STEP].iloc[0]
    assert (spike["loss"], spike["grad_norm"], spike["tokens"], spike["dur"]) == (SPIKE_LOSS, 1.0, TOKENS, 0.9)
    nan = frame[frame["step"] == NAN_STEP].iloc[0]
    assert math.isnan(nan["loss"]) and nan["loss_nonfinite"] and int(frame["loss_nonfinite"].sum()) == 1
    assert series.tail == {"id": "1-100000", "step": STEPS, "gen": 0, "n_ranks": 4, "t_end": T0 + STEPS + 0.9}
    # Chunks of 1,000 from the head to the newest entry, then nothing more.
    assert series.reads[0] == ("-", "1-100000", 1000) and series.reads[1] == ("(1-1000", "1-100000", 1000)
    assert len(series.reads) == 101 and series.reads[-1] == ("(1-100000", "1-100000", 0)
    # About 80 bytes an entry: a plain XRANGE of the same entries sends all 13 fields.
    _, plain = measured(long_run, lambda: long_run.xrange(run_keys(RUN).agg, count=10_000))
    assert cold < 90 * STEPS and cold < 0.35 * plain * (STEPS / 10_000)


def test_refresh_reads_only_the_entries_after_the_last_one_read(long_run: redis.Redis) -> None:
    series = data.StepSeries(RUN).refresh(long_run)
    _, idle = measured(long_run, lambda: series.refresh(long_run))
    assert series.reads == [] and idle < 100  # the newest entry's id and status fields only
    key = run_keys(RUN).agg
    for s in range(STEPS + 1, STEPS + 4):
        long_run.xadd(key, agg_entry(s, loss=2.0), id=f"1-{s}")
    _, fresh = measured(long_run, lambda: series.refresh(long_run))
    assert series.reads == [("(1-100000", "1-100003", 3)] and fresh < 500
    assert series.frame["step"].tolist()[-4:] == [STEPS, STEPS + 1, STEPS + 2, STEPS + 3]
    assert series.last_id == "1-100003" and series.tail["step"] == STEPS + 3
    # A restart: generation 1 replays from step 99,990; its ids sort after every generation-0 id.
    long_run.xadd(key, agg_entry(99_990, gen=1, loss=1.5), id="2-99990")
    series.refresh(long_run)
    assert series.reads == [("(1-100003", "2-99990", 1)]
    assert series.frame.iloc[-1][["step", "gen", "loss"]].tolist() == [99_990, 1, 1.5]
    # The stream deleted and written again (its newest id went back): read afresh.
    long_run.delete(key)
    long_run.xadd(key, agg_entry(1, loss=3.0), id="1-1")
    series.refresh(long_run)
    assert series.frame["step"].tolist() == [1] and series.reads == [("-", "1-1", 1)]


def test_a_step_range_is_read_per_generation_at_full_resolution(env: redis.Redis) -> None:
    register(env, RUN)
    key = run_keys(RUN).agg
    for s in range(1, 301):
        env.xadd(key, agg_entry(s), id=f"1-{s}")
    for s in range(251, 331):  # a restart from the step-250 checkpoint
        env.xadd(key, agg_entry(s, gen=1, loss=2.0), id=f"2-{s}")
    series = data.StepSeries(RUN, 240, 260).refresh(env)
    assert series.reads == [("1-240", "1-260", 21), ("2-240", "2-260", 10)]
    assert list(zip(series.frame["gen"], series.frame["step"], strict=True)) == (
        [(0, s) for s in range(240, 261)] + [(1, s) for s in range(251, 261)])
    # Open-ended (to the newest step), and new entries outside the range are read but not kept.
    live = data.StepSeries(RUN, 320, None).refresh(env)
    assert live.reads == [("1-320", "1-18446744073709551615", 0), ("2-320", "2-330", 11)]
    env.xadd(key, agg_entry(331, gen=1, loss=2.0), id="2-331")
    series.refresh(env)
    live.refresh(env)
    assert len(series.frame) == 31 and live.frame["step"].tolist() == list(range(320, 332))


def test_progress_keeps_the_generation_that_counted_and_counts_tokens(env: redis.Redis) -> None:
    register(env, "b")
    key = run_keys("b").agg
    for s in range(1, 6):
        env.xadd(key, agg_entry(s, loss=2.5 - 0.1 * s, tokens=8192), id=f"1-{s}")
    for s in (4, 5, 6):  # replayed after a restart from the step-3 checkpoint, with the job's own step time
        env.xadd(key, agg_entry(s, gen=1, loss=2.0 - 0.1 * s, tokens=8192, step_s=2.0), id=f"2-{s}")
    prog = data.progress(data.StepSeries("b").refresh(env).frame)
    assert prog["step"].tolist() == [1, 2, 3, 4, 5, 6]
    assert prog["loss"].tolist() == [2.4, 2.3, 2.2, 1.6, 1.5, 1.4]
    assert prog["tokens_seen"].tolist() == [8192.0 * s for s in range(1, 7)]
    assert prog["tok_s"].tolist() == [8192 / 0.9] * 3 + [4096.0] * 3  # dur 0.9 s, then step_s 2.0 s


# --- the Overview page ------------------------------------------------------------------------------------------

def test_overview_whole_run_has_the_spike_and_the_nan_and_a_range_has_every_step(long_run: redis.Redis) -> None:
    at = app()
    assert not at.exception
    curves = figures(at)[0]
    loss = trace(curves, "loss")
    x, y = arr(loss["x"]), arr(loss["y"])
    assert len(x) == 2001 and x[0] == 1 and x[-1] == STEPS  # 2,000 points and the NaN gap
    assert y[x.index(SPIKE_STEP)] == SPIKE_LOSS
    assert math.isnan(y[x.index(NAN_STEP)])
    nan = trace(curves, "loss NaN/inf")
    assert arr(nan["x"]) == [NAN_STEP] and arr(nan["y"]) == [loss_at(NAN_STEP - 1)]
    assert nan["hovertext"] == [f"<b>loss NaN</b> at step {NAN_STEP}"]
    assert len(arr(trace(curves, "grad norm")["x"])) == 2000
    assert curves["layout"]["title"]["text"] == ("Loss and grad norm per step (100,000 steps, each curve reduced to "
                                                 "2,000 points keeping its extremes)")
    assert curves["layout"]["dragmode"] == "select"
    assert any(c.value.startswith("Steps 1–100,000: 100,000 entries, each curve reduced to 2,000 points")
               for c in at.main.caption)

    # Steps 19,900-20,100 typed in the range inputs: all 201, exact, read with one XRANGE on the step ids.
    at.number_input(key="th_step_from.w:None").set_value(19_900)
    at.number_input(key="th_step_to.w:None").set_value(20_100).run()
    assert not at.exception
    assert (at.query_params["step_from"], at.query_params["step_to"]) == ("19900", "20100")
    loss = trace(figures(at)[0], "loss")
    x, y = arr(loss["x"]), arr(loss["y"])
    assert x == list(range(19_900, 20_101)) and y == [loss_at(s) for s in x]
    assert y[x.index(SPIKE_STEP)] == SPIKE_LOSS
    series = at.session_state[("th_series")][(RUN, 19_900, 20_100)]
    assert series.reads == [("1-19900", "1-20100", 201)]
    assert "Steps 19,900–20,100: 201 entries, every one drawn (full resolution)." in [c.value for c in at.main.caption]
    at.button(key="th_whole_run").click().run()
    assert len(arr(trace(figures(at)[0], "loss")["x"])) == 2001 and "step_from" not in at.query_params


def test_a_step_link_opens_its_range_and_a_refresh_reads_only_new_entries(long_run: redis.Redis) -> None:
    at = app(run=RUN, step=str(SPIKE_STEP))
    assert not at.exception
    x = arr(trace(figures(at)[0], "loss")["x"])
    assert x == list(range(19_900, 20_101))
    assert (at.query_params["step_from"], at.query_params["step_to"]) == ("19900", "20100")
    assert "step" not in at.query_params
    at.run()  # a refresh keeps the range (and reads nothing new)
    assert arr(trace(figures(at)[0], "loss")["x"]) == list(range(19_900, 20_101))
    assert at.session_state["th_series"][(RUN, 19_900, 20_100)].reads == []
    assert at.number_input(key="th_step_from.w:19900").value == 19_900

    at = app(run=RUN)  # whole run, then a refresh after three new steps
    key = run_keys(RUN).agg
    for s in range(STEPS + 1, STEPS + 4):
        long_run.xadd(key, agg_entry(s, loss=2.0), id=f"1-{s}")
    at.run()
    series = at.session_state["th_series"][(RUN, None, None)]
    assert series.reads == [("(1-100000", "1-100003", 3)]
    assert arr(trace(figures(at)[0], "loss")["x"])[-1] == STEPS + 3
    assert at.main.caption[0].value.startswith(f"status **running** · step {STEPS + 3:,} ended ")


def test_compare_two_runs_by_step_and_by_tokens(env: redis.Redis) -> None:
    register(env, "a", T0 + 10)
    register(env, "b", T0)
    for s in range(1, 11):  # 4,096 tokens a step in 2 s (the job's own step time)
        env.xadd(run_keys("a").agg, agg_entry(s, loss=3.0 - 0.1 * s, tokens=4096, step_s=2.0), id=f"1-{s}")
    for s in range(1, 6):  # twice the batch: 8,192 tokens a step, in 0.9 s (dur)
        env.xadd(run_keys("b").agg, agg_entry(s, loss=2.5 - 0.1 * s, tokens=8192), id=f"1-{s}")
    at = app(run="a")
    assert not at.exception and len(figures(at)) == 1  # no comparison until a run is picked
    assert at.selectbox(key="th_compare.w:—").options == ["—", "b"]
    at.selectbox(key="th_compare.w:—").select("b").run()
    assert not at.exception and at.query_params["compare"] == "b"
    fig = figures(at)[-1]
    assert fig["layout"]["title"]["text"] == "Loss and throughput by step"
    a_loss, a_rate, b_loss, b_rate = fig["data"]
    assert (a_loss["name"], b_loss["name"], a_rate["yaxis"], b_rate["yaxis"]) == ("a", "b", "y2", "y2")
    assert arr(a_loss["x"]) == list(range(1, 11)) and arr(a_loss["y"]) == [3.0 - 0.1 * s for s in range(1, 11)]
    assert arr(b_loss["x"]) == [1, 2, 3, 4, 5] and arr(b_loss["y"]) == [2.5 - 0.1 * s for s in range(1, 6)]
    assert arr(a_rate["y"]) == [2048.0] * 10 and arr(b_rate["y"]) == [8192 / 0.9] * 5

    at.segmented_control(key="th_align.w:step").set_value("tokens").run()
    assert not at.exception and at.query_params["align"] == "tokens"
    fig = figures(at)[-1]
    assert fig["layout"]["title"]["text"] == "Loss and throughput by tokens trained"
    a_loss, _, b_loss, _ = fig["data"]
    assert arr(a_loss["x"]) == [4096.0 * s for s in range(1, 11)]
    assert arr(b_loss["x"]) == [8192.0 * s for s in range(1, 6)]
    # At 40,960 tokens run a is at step 10 (loss 2.0) and run b at step 5 (loss 2.0): the same data seen.
    assert arr(a_loss["y"])[9] == pytest.approx(2.0) and arr(b_loss["y"])[4] == pytest.approx(2.0)
    assert fig["layout"]["xaxis2"]["title"]["text"] == "tokens trained (kept steps)"
    # The link says it all: another session opens the same comparison, and keeps it on a refresh.
    link = app(run="a", compare="b", align="tokens").run()
    assert not link.exception
    assert figures(link)[-1]["layout"]["title"]["text"] == "Loss and throughput by tokens trained"
    assert (link.selectbox(key="th_compare.w:b").value, link.segmented_control(key="th_align.w:tokens").value) == (
        "b", "tokens")


def test_series_bytes_at_1024_ranks_stay_those_of_the_drawn_fields(env: redis.Redis) -> None:
    seed_long(env, "wide", steps=2_000, ranks=1024)
    series, cold = measured(env, lambda: data.StepSeries("wide").refresh(env))
    _, plain = measured(env, lambda: env.xrange(run_keys("wide").agg))
    assert len(series.frame) == 2_000 and plain > 2_000 * 1024 * 4  # each entry carries ~5 kB of busy seconds
    assert cold < 90 * 2_000  # the series does not


def test_whole_ledger_history_is_sampled_evenly_in_time(env: redis.Redis) -> None:
    key = run_keys("led").ledger
    pipe = env.pipeline(transaction=False)
    for i in range(5_000):  # 2 s apart, ids in ms as XADD * writes them
        wall = 2.0 * (i + 1)
        pipe.xadd(key, {"json": json.dumps({"t": T0 + wall, "wall_s": wall, "seconds": {"productive": wall / 2}})},
                  id=f"{int((T0 + wall) * 1000)}-0")
    pipe.execute()
    hist, sent = measured(env, lambda: data.ledger_history_whole(env, "led", max_points=100))
    assert len(hist) == 100 and (hist["t"].iloc[0], hist["t"].iloc[-1]) == (T0 + 2.0, T0 + 10_000.0)
    gaps = set(hist["t"].diff().dropna().round(6))
    assert gaps <= {100.0, 102.0}  # every 50th or 51st snapshot: even in time
    assert list(hist["seconds.productive"]) == list(hist["wall_s"] / 2)  # cumulative values kept exactly
    assert sent < 100 * 200  # about 100 snapshots, whatever the stream's length
    assert len(data.ledger_history_whole(env, "led", max_points=6_000)) == 5_000  # short enough: read whole


def test_goodput_page_whole_run_window(env: redis.Redis) -> None:
    register(env, "led")
    k = run_keys("led")
    for i in range(3):
        wall = 600.0 * (i + 1)
        snap = {"t": T0 + wall, "wall_s": wall, "world_size": 4, "tokens_total": 1000 * (i + 1),
                "throughput_tok_s": 10.0, "goodput_tok_s": 8.0, "seconds": {"productive": wall},
                "rates": {w: {"throughput_tok_s": 10.0 + i, "goodput_tok_s": 8.0 + i} for w in ("60s", "3600s")}}
        env.xadd(k.ledger, {"json": json.dumps(snap)}, id=f"{int((T0 + wall) * 1000)}-0")
    env.set(k.ledger_latest, json.dumps(snap))
    at = app(run="led")
    at.switch_page("pages/goodput.py").run()
    at.segmented_control(key="goodput_window").select("whole run").run()
    assert not at.exception
    assert [c.value for c in at.main.caption if c.value.startswith("Charts:")] == [
        "Charts: the whole run (up to 600 ledger snapshots, evenly spaced in time) (times in UTC); each snapshot "
        "covers the run since it started."]
    tokens = next(f for f in figures(at) if f["layout"]["title"]["text"].startswith("Throughput vs goodput"))
    rates = [t for t in tokens["data"] if "last" in (t.get("name") or "")]
    assert [t["name"] for t in rates] == ["throughput · last 1 h", "goodput · last 1 h"]
    assert arr(rates[0]["y"]) == [10.0, 11.0, 12.0]


# --- in a real browser ------------------------------------------------------------------------------------------

def _chart_x(page, index: int = 0) -> list[float]:
    """The x values of the loss trace of the ``index``-th Plotly chart, as the browser holds them."""
    page.wait_for_function("i => document.querySelectorAll('.js-plotly-plot')[i]?._fullData", arg=index)
    return page.evaluate(
        """i => { const gd = document.querySelectorAll('.js-plotly-plot')[i];
                  const t = gd._fullData.find(d => d.name === 'loss'); return Array.from(t.x); }""", index)


def _spike_drawn(page) -> tuple[float, list[float]]:
    """The loss the browser holds at the spike's step and the range of the loss panel's y axis as drawn."""
    return page.evaluate(
        """s => { const gd = document.querySelectorAll('.js-plotly-plot')[0];
                  const t = gd._fullData.find(d => d.name === 'loss');
                  const axis = gd._fullLayout['yaxis' + (t.yaxis || 'y').slice(1)];
                  return [t.y[Array.from(t.x).indexOf(s)], axis.range.slice()]; }""", SPIKE_STEP)


def test_drag_across_the_chart_reads_that_range_at_full_resolution(long_run: redis.Redis, redis_url: str,
                                                                   tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    _BROWSER["_require_chromium"]()
    with (_BROWSER["_service_alive"](long_run), _BROWSER["_streamlit"](redis_url, tmp_path) as base,
          sync_playwright() as pw):
        browser = _BROWSER["_launch"](pw)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1400}, timezone_id="UTC")
            page.set_default_timeout(_BROWSER["UI_TIMEOUT_MS"])
            page.goto(f"{base}/?run={RUN}")
            expect(page.get_by_text(re.compile(r"^Steps 1–100,000: 100,000 entries"))).to_be_visible()
            x = _chart_x(page)
            assert len(x) == 2001 and SPIKE_STEP in x
            # The spike at step 20,000 of 100,000 is drawn at the whole-run zoom: its loss, inside the y axis.
            y, y_range = _spike_drawn(page)
            assert y == SPIKE_LOSS and y_range[0] < SPIKE_LOSS <= y_range[1]
            page.wait_for_timeout(500)
            page.screenshot(path=str(_BROWSER["ARTIFACTS"] / "dashboard_whole_run.png"), full_page=True)
            # Drag across the loss panel from 10 % to 30 % of its width: that range is read again.
            box = page.locator(".js-plotly-plot .nsewdrag").first.bounding_box()
            y = box["y"] + box["height"] / 2
            page.mouse.move(box["x"] + 0.1 * box["width"], y)
            page.mouse.down()
            page.mouse.move(box["x"] + 0.2 * box["width"], y, steps=5)
            page.mouse.move(box["x"] + 0.3 * box["width"], y, steps=5)
            page.mouse.up()
            page.wait_for_url(re.compile(r"step_from=\d+&step_to=\d+"))
            lo, hi = (int(v) for v in re.search(r"step_from=(\d+)&step_to=(\d+)", page.url).groups())
            assert 5_000 < lo < 15_000 and 25_000 < hi < 35_000
            expect(page.get_by_text(re.compile(rf"^Steps {lo:,}–{hi:,}: {hi - lo + 1:,} entries"))).to_be_visible()
            x = _chart_x(page)
            assert x[0] == lo and x[-1] == hi and SPIKE_STEP in x
            # A link to the spike's neighbourhood: every step, the spike among them.
            page.goto(f"{base}/?run={RUN}&step_from=19900&step_to=20100")
            expect(page.get_by_text("Steps 19,900–20,100: 201 entries, every one drawn (full resolution).")
                   ).to_be_visible()
            assert _chart_x(page) == list(range(19_900, 20_101))
            y, y_range = _spike_drawn(page)
            assert y == SPIKE_LOSS and y_range[0] < SPIKE_LOSS <= y_range[1]
            page.wait_for_timeout(500)
            page.screenshot(path=str(_BROWSER["ARTIFACTS"] / "dashboard_step_range.png"), full_page=True)
        finally:
            browser.close()


def test_cold_and_refresh_bytes_of_the_overview_at_100000_steps(long_run: redis.Redis) -> None:
    """The whole Overview page's reads, cold and on a refresh (reported; the step series' share asserted)."""
    at, cold = measured(long_run, app)
    _, idle = measured(long_run, at.run)
    long_run.xadd(run_keys(RUN).agg, agg_entry(STEPS + 1, loss=2.0), id=f"1-{STEPS + 1}")
    _, fresh = measured(long_run, at.run)
    print(f"Overview at {STEPS:,} steps: cold {cold:,} B, refresh {idle:,} B, refresh with a new step {fresh:,} B")
    assert cold < 90 * STEPS + 200_000 and idle < 20_000 and fresh < 20_000


# --- the Ranks page's window of busy lists -----------------------------------------------------------------------

def test_rank_window_reads_the_newest_steps_once_then_only_new_entries(env: redis.Redis) -> None:
    seed_long(env, "wide", steps=600, ranks=1024)
    key = run_keys("wide").agg
    window, cold = measured(env, lambda: data.RankWindow("wide", 500).refresh(env))
    assert window.reads == [("+", "-", 500)]
    expected = data.rank_matrix(env, "wide", 500)
    assert window.matrix.shape == (1024, 500) and window.matrix.equals(expected)
    assert list(window.matrix.columns[[0, -1]]) == [101, 600]

    _, idle = measured(env, lambda: window.refresh(env))
    assert window.reads == [] and idle < 12_000  # the newest entry only (~10 kB of busy seconds at 1,024 ranks)
    pipe = env.pipeline(transaction=False)
    for s in (601, 602, 603):
        pipe.xadd(key, agg_entry(s, ranks=1024), id=f"1-{s}")
    pipe.execute()
    _, fresh = measured(env, lambda: window.refresh(env))
    assert window.reads == [("(1-600", "1-603", 3)] and window.last_id == "1-603"
    assert fresh < 4 * 12_000 and 50 * fresh < cold  # the newest and the three new entries, not 500
    assert window.matrix.equals(data.rank_matrix(env, "wide", 500))
    assert list(window.matrix.columns[[0, -1]]) == [104, 603]

    # More new entries than the window holds: one read of the newest 500, as a cold one.
    pipe = env.pipeline(transaction=False)
    for s in range(604, 1_300):
        pipe.xadd(key, agg_entry(s, ranks=1024), id=f"1-{s}")
    pipe.execute()
    window.refresh(env)
    assert window.reads == [("(1-603", "1-1299", 500), ("+", "-", 500)]
    assert window.matrix.equals(data.rank_matrix(env, "wide", 500))

    # The stream deleted and written again (a run id reused): read afresh, nothing of the old one kept.
    env.delete(key)
    env.xadd(key, agg_entry(7, ranks=1024), id="1-7")
    window.refresh(env)
    assert window.reads == [("+", "-", 1)] and list(window.matrix.columns) == [7]
    env.delete(key)
    assert window.refresh(env).matrix.empty and window.last_id is None


def test_rank_window_reports_unreadable_entries_while_it_holds_them(env: redis.Redis) -> None:
    seed_long(env, "odd", steps=3, ranks=4)
    key = run_keys("odd").agg
    env.xadd(key, {**agg_entry(4), "busy": "[0.8, oops"}, id="1-4")
    env.xadd(key, {"gen": 0, "loss": "2.0"}, id="1-5")
    window = data.RankWindow("odd", 3)
    problems: list[str] = []
    window.refresh(env, problems)
    assert list(window.matrix.columns) == [3, 4] and window.matrix[4].isna().all()
    assert problems == [
        f"1 entry in {key} is unreadable (entry 1-5: no step)",
        f"1 entry in {key} has unreadable values, shown as missing (entry 1-4: busy '[0.8, oops' is not JSON)"]
    for s in (6, 7, 8):
        env.xadd(key, agg_entry(s), id=f"1-{s}")
    problems = []
    window.refresh(env, problems)
    assert problems == [] and list(window.matrix.columns) == [6, 7, 8]


# --- a long run's whole-run charts from the service's rollup ----------------------------------------------------

def seed_rollup(r: redis.Redis, run: str = RUN, steps: int = STEPS) -> int:
    """The ``agg:rollup`` buckets the service writes for :func:`seed_long`'s steps (its own StepRollup and
    encoding); returns how many."""
    from trainhealth.detectors.aggregate import StepAggregate
    from trainhealth.detectors.rollup import StepRollup

    rollup, pipe, n = StepRollup(), r.pipeline(transaction=False), 0
    for s in range(1, steps + 1):
        agg = StepAggregate(step=s, gen=0, inc=0.0, t_start=T0 + s, t_end=T0 + s + 0.9, loss=loss_at(s),
                            grad_norm=1.0 + s % 5 / 10, lr=3e-4, tokens=TOKENS, samples=8, consumed_samples=None,
                            batch_index=None, skipped=False, step_s=None, n_ranks=4, busy=(0.8,) * 4, data_s=0.01,
                            bad_ranks=())
        for bucket in rollup.update(agg):
            pipe.xadd(run_keys(run).agg_rollup, bucket.fields(), id=bucket.entry_id)
            n += 1
    pipe.execute()
    return n


def test_a_long_runs_whole_run_is_read_from_the_rollup_and_keeps_the_spike_and_the_nan(long_run: redis.Redis) -> None:
    assert seed_rollup(long_run) == 1_000  # steps 1-99, 100-199, …, 99,900-99,999; step 100,000 opens the next
    series, cold = measured(long_run, lambda: data.StepSeries(RUN).refresh(long_run))
    # The rollup in one read, then the steps after its newest bucket.
    assert series.reads == [("rollup:100 -", "+", 1_000), ("(1-99999", "1-100000", 1)]
    assert series.rolled_steps == 99_999
    frame = series.frame
    # Two rows a bucket (its extremes, in the order they happened), a third at a NaN step; the raw step after.
    assert len(frame) == 2 * 1_000 + 1 + 1 and frame["step"].tolist()[:4] == [1, 99, 100, 199]
    assert frame["step"].tolist()[-1] == STEPS
    spike = frame[frame["step"] == SPIKE_STEP].iloc[0]
    # The bucket's lowest grad norm (1.0) came at its first step, its highest (1.4) later: drawn at its last.
    assert (spike["loss"], spike["grad_norm"]) == (SPIKE_LOSS, 1.0)
    assert frame[frame["step"] == SPIKE_STEP + 99]["grad_norm"].tolist() == [1.4]
    nan = frame[frame["loss_nonfinite"]]
    assert nan["step"].tolist() == [NAN_STEP] and math.isnan(nan["loss"].iloc[0])
    first = frame.iloc[:2]
    assert first["loss"].tolist() == [max(loss_at(s) for s in range(1, 100)), min(loss_at(s) for s in range(1, 100))]
    # Tokens and seconds are the buckets': the kept trajectory counts every token of the run.
    assert data.progress(frame)["tokens_seen"].iloc[-1] == STEPS * TOKENS
    assert data.progress(frame)["tok_s"].iloc[0] == pytest.approx(TOKENS / 0.9)
    # ~700 bytes a bucket: a tenth of reading the 100,000 steps' drawn fields (~80 bytes each).
    assert cold < 800_000 and cold < 0.1 * 80 * STEPS


def test_an_unreadable_rollup_entry_is_named_under_the_rollup_key(long_run: redis.Redis) -> None:
    seed_rollup(long_run)
    key = run_keys(RUN).agg_rollup
    long_run.xadd(key, {"gen": 0, "n": 5}, id="1-99999999")  # no first/last: cannot be placed
    problems: list[str] = []
    series = data.StepSeries(RUN).refresh(long_run, problems)
    assert problems == [f"1 entry in {key} is unreadable (entry 1-99999999: no first/last step)"]
    assert len(series.frame) == 2 * 1_000 + 1 + 0  # the other buckets, the NaN mark; nothing after the bad id
    series.refresh(long_run, problems := [])
    assert problems == [f"1 entry in {key} is unreadable (entry 1-99999999: no first/last step)"]  # every refresh


def test_the_overview_draws_a_long_run_from_its_rollup_and_zooms_into_the_steps(long_run: redis.Redis) -> None:
    seed_rollup(long_run)
    at = app()
    assert not at.exception
    curves = figures(at)[0]
    loss = trace(curves, "loss")
    x, y = arr(loss["x"]), arr(loss["y"])
    assert x[0] == 1 and x[-1] == STEPS and y[x.index(SPIKE_STEP)] == SPIKE_LOSS
    assert arr(trace(curves, "loss NaN/inf")["x"]) == [NAN_STEP]
    assert any(c.value.startswith("Steps 1–100,000: 2,002 entries (up to step 99,999 the service's per-100-step "
                                  "rollup: each bucket's highest and lowest loss and grad norm and its mean "
                                  "tokens/s)") for c in at.main.caption)
    # A range is read step by step, at full resolution, as before.
    at.number_input(key="th_step_from.w:None").set_value(19_990)
    at.number_input(key="th_step_to.w:None").set_value(20_010).run()
    loss = trace(figures(at)[0], "loss")
    assert arr(loss["x"]) == list(range(19_990, 20_011)) and arr(loss["y"]) == [loss_at(s) for s in range(19_990,
                                                                                                          20_011)]


def seed_trimmed(r: redis.Redis, run: str, steps: int, kept_from: int) -> None:
    """``steps`` steps (0 to steps - 1) whose rollups of every level the service's own :class:`Rollups` wrote, and
    whose per-step entries are only those from ``kept_from`` on (the rest trimmed by the stream's byte bound)."""
    from trainhealth.detectors.aggregate import StepAggregate
    from trainhealth.detectors.rollup import Rollups

    register(r, run)
    rollups, pipe = Rollups(), r.pipeline(transaction=False)
    for s in range(steps):
        agg = StepAggregate(step=s, gen=0, inc=0.0, t_start=T0 + s, t_end=T0 + s + 0.9, loss=loss_at(s),
                            grad_norm=1.0 + s % 5 / 10, lr=3e-4, tokens=TOKENS, samples=8, consumed_samples=None,
                            batch_index=None, skipped=False, step_s=None, n_ranks=4, busy=(0.8,) * 4, data_s=0.01,
                            bad_ranks=())
        for bucket in rollups.update(agg):
            pipe.xadd(run_keys(run).rollup(bucket.every), bucket.fields(), id=bucket.entry_id)
        if s >= kept_from:
            pipe.xadd(run_keys(run).agg, agg_entry(s), id=f"1-{s}")
    pipe.execute()


def test_a_run_whose_first_steps_were_trimmed_is_drawn_from_the_finest_fitting_rollup_level(
        env: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    # 6,050 steps, the per-step stream holding 5,000-6,049: too few steps for the rollup by length (20,000), but the
    # run's start is only in the rollups. Levels: 605 buckets of 10 steps, 60 of 100, 6 of 1,000.
    seed_trimmed(env, "trim", 6_050, 5_000)
    monkeypatch.setattr(data, "ROLLUP_MAX_BUCKETS", 100)
    series = data.StepSeries("trim").refresh(env)
    assert series.reads == [("rollup:100 -", "+", 60), ("(1-5999", "1-6049", 50)]
    assert (series.rollup_every, series.rolled_steps) == (100, 5_999)
    steps = series.frame["step"].tolist()
    assert steps[:4] == [0, 99, 100, 199] and steps[-51:] == list(range(5_999, 6_050))
    assert data.progress(series.frame)["tokens_seen"].iloc[-1] == 6_050 * TOKENS
    monkeypatch.setattr(data, "ROLLUP_MAX_BUCKETS", 5)
    assert data.StepSeries("trim").refresh(env).rollup_every == 1_000  # none has 5 or fewer: the coarsest

    # A range reaching back before the per-step stream's oldest entry: that part from the finest level with at most
    # ROLLUP_MAX_BUCKETS buckets over the range (1,501 steps: 150 of 10, 15 of 100), the rest step by step.
    for max_buckets, every, rows in ((2_000, 10, 200), (100, 100, 20)):
        monkeypatch.setattr(data, "ROLLUP_MAX_BUCKETS", max_buckets)
        zoom = data.StepSeries("trim", 4_000, 5_500).refresh(env)
        assert zoom.reads == [(f"rollup:{every} 1-4000", "(1-5000", rows // 2), ("1-4000", "1-5500", 501)]
        steps = zoom.frame["step"].tolist()
        assert steps[:2] == [4_000, 4_000 + every - 1] and steps[rows - 1] == 4_999
        assert steps[rows:] == list(range(5_000, 5_501)) and zoom.rollup_every == every
        assert data.progress(zoom.frame)["tokens_seen"].iloc[-1] == 1_501 * TOKENS
    # Entirely within the per-step stream: step by step, no rollup read.
    zoom = data.StepSeries("trim", 5_100, 5_200).refresh(env)
    assert zoom.reads == [("1-5100", "1-5200", 101)] and zoom.rollup_every is None


def test_the_ranks_busy_time_over_the_whole_run_is_read_from_the_rollup(env: redis.Redis) -> None:
    from trainhealth.detectors.aggregate import StepAggregate
    from trainhealth.detectors.rollup import Rollups

    # 3,000 steps of 4 ranks; rank 2 is 50 % slower in steps 1,000-1,999 only; per-step entries only from 2,900 on.
    register(env, "busy")
    rollups, pipe = Rollups(), env.pipeline(transaction=False)
    for s in range(3_000):
        busy = (0.8, 0.8, 1.2 if 1_000 <= s < 2_000 else 0.8, 0.8)
        agg = StepAggregate(step=s, gen=0, inc=0.0, t_start=T0 + s, t_end=T0 + s + 0.9, loss=2.0, grad_norm=1.0,
                            lr=3e-4, tokens=TOKENS, samples=8, n_ranks=4, busy=busy, data_s=0.01)
        for bucket in rollups.update(agg):
            pipe.xadd(run_keys("busy").rollup(bucket.every), bucket.fields(), id=bucket.entry_id)
        if s >= 2_900:
            pipe.xadd(run_keys("busy").agg, agg_entry(s), id=f"1-{s}")
    pipe.execute()
    frame, every = data.busy_history(env, "busy")
    assert every == 10 and len(frame) == 300  # the finest level with at most 2,000 buckets
    slow = frame[(frame["first"] >= 1_000) & (frame["last"] < 2_000)]
    assert len(slow) == 100 and set(slow["busy_max_rank"]) == {2} and set(slow["busy_max"]) == {1.2}
    assert set(slow["busy_p50"]) == {0.8} and set(frame.drop(slow.index)["busy_max"]) == {0.8}
    # The Ranks page draws it below the recent steps' heatmap.
    at = app(run="busy")
    at.switch_page("pages/ranks.py").run()
    assert not at.exception
    fig = next(f for f in figures(at) if f["layout"]["title"]["text"].startswith("Whole run"))
    slowest = trace(fig, "slowest rank")
    assert max(arr(slowest["y"])) == 1.2 and len(arr(slowest["x"])) == 300
