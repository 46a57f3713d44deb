"""The dashboard in a real headless Chromium: a real ``streamlit run`` on the seeded test Redis.

Needs the Debian ``chromium`` package at /usr/bin/chromium (``playwright install`` cannot
download browsers in CI here): CI must ``apt-get install -y chromium``. Screenshots go to
``tests/artifacts/`` for a human look.
"""

from __future__ import annotations

import contextlib
import os
import re
import runpy
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from trainhealth.embedded_redis import free_port

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
# The same fully known run as the AppTest tests (loaded by path: tests are not a package).
_SEED = runpy.run_path(str(Path(__file__).with_name("test_dashboard.py")))
seed_run, RUN = _SEED["seed_run"], _SEED["RUN"]
seed_replay, REPLAY, service_beat = _SEED["seed_replay"], _SEED["REPLAY"], _SEED["service_beat"]
SERVICE_DOWN = ("Detector service not running: anomalies and goodput are not updating — start "
                "`trainhealth serve`.")
START_TIMEOUT_S = 60
UI_TIMEOUT_MS = 30_000


def _wait_healthy(base: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/_stcore/health", timeout=1) as resp:
                if resp.status == 200 and resp.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"streamlit did not serve within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _require_chromium() -> None:
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: CI must `apt-get install -y chromium` (Debian package) for the "
                    "dashboard browser test; `playwright install` cannot download browsers here.")


@contextlib.contextmanager
def _streamlit(redis_url: str, tmp_path: Path) -> Iterator[str]:
    """Run ``streamlit run dashboard/app.py`` on ``redis_url``; yields its base URL, always terminates it."""
    port = free_port()
    log = tmp_path / "streamlit.log"
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", "dashboard/app.py", "--server.headless", "true",
             "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
             "--server.fileWatcherType", "none"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc, log)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def _service_alive(r: redis.Redis) -> Iterator[threading.Event]:
    """Refresh a detector-service heartbeat every 0.5 s, as ``trainhealth serve`` does; set the
    yielded event to stop (the key then ages out like a dead service's)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            service_beat(r, "browser-test")
            stop.wait(0.5)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(5)


@pytest.fixture
def dashboard(r: redis.Redis, redis_url: str, tmp_path: Path) -> Iterator[tuple[str, threading.Event]]:
    """Base URL of the dashboard on the seeded test Redis, with a live service heartbeat (and its stop)."""
    _require_chromium()
    seed_run(r)
    seed_replay(r)
    with _service_alive(r) as stop, _streamlit(redis_url, tmp_path) as base:
        yield base, stop


def _launch(pw: Any) -> Any:
    from playwright.sync_api import expect

    # expect() waits 5 s by default: too short for a cold first page load on a busy machine and for
    # the service banner, which re-checks every 5 s.
    expect.set_options(timeout=UI_TIMEOUT_MS)
    return pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def _kpis(page: Any) -> dict[str, str]:
    values = page.locator('[data-testid="stMetricValue"]')
    labels = page.locator('[data-testid="stMetricLabel"]').all_inner_texts()
    return dict(zip([lbl.strip() for lbl in labels], [v.strip() for v in values.all_inner_texts()], strict=True))


def _overflowing(page: Any, selector: str) -> list[str]:
    """Texts of the elements matching ``selector`` whose content is cut (wider than their box)."""
    return page.eval_on_selector_all(
        selector, "els => els.filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.innerText)")


def test_dashboard_in_chromium(dashboard: tuple[str, threading.Event], r: redis.Redis) -> None:
    from playwright.sync_api import expect, sync_playwright

    base, service = dashboard
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = _launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1500}, timezone_id="UTC")
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.goto(f"{base}/?run={RUN}")

            # KPIs: label → value, read from the rendered metric cards.
            expect(page.locator('[data-testid="stMetricValue"]')).to_have_count(5)
            assert _kpis(page) == {"Throughput": "679", "Goodput (tokens)": "492", "Goodput (time)": "71.5%",
                                   "Active anomalies": "2", "Badput cost": "$0.08"}
            # Units and the counts sit in the cards' grey/red sub-line.
            deltas = [d.strip() for d in page.locator('[data-testid="stMetricDelta"]').all_inner_texts()]
            assert deltas == ["tokens/s", "tokens/s", "productive time", "of 4 · 1 critical", "at $2.5/GPU-h"]
            # Nothing in a KPI card is cut off with an ellipsis.
            assert _overflowing(page, '[data-testid="stMetricValue"] div, [data-testid="stMetricDelta"] div') == []
            expect(page.locator(".js-plotly-plot")).to_have_count(3)
            expect(page.get_by_text("Throughput vs goodput (tokens/s, since start)")).to_be_visible()
            # Legends: the goodput chart's three entries, the checkpoint markers' entries on the curves.
            for name in ("throughput", "goodput", "gap = discarded tokens + pauses", "checkpoint save",
                         "checkpoint load", "restart", "critical anomaly", "warning anomaly"):
                entry = page.locator('text.legendtext, text.legend2text', has_text=re.compile(f"^{re.escape(name)}$"))
                expect(entry).to_have_count(1)
            expect(page.get_by_text("Detector service not running")).to_have_count(0)
            assert f"run={RUN}" in page.url
            page.wait_for_timeout(1000)  # let Plotly finish laying out before the picture
            page.screenshot(path=str(ARTIFACTS / "dashboard_overview.png"), full_page=True)

            page.locator('[data-testid="stSidebarNav"]').get_by_text("Ranks", exact=True).click()
            heatmap = page.locator(".js-plotly-plot g.hm image")  # Plotly draws a heatmap as one image
            expect(heatmap).to_have_count(1)
            expect(page.get_by_text("Ranks, slowest first")).to_be_visible()
            expect(page.get_by_text(re.compile(r"Straggler.*rank 3 on node-b"))).to_be_visible()
            page.wait_for_url(re.compile(rf"/ranks\?run={RUN}$"))  # the link still names the run
            page.wait_for_timeout(1000)
            page.screenshot(path=str(ARTIFACTS / "dashboard_ranks.png"), full_page=True)

            page.locator('[data-testid="stSidebarNav"]').get_by_text("Anomalies", exact=True).click()
            expect(page.get_by_text(re.compile(r"^4 of 4 anomalies shown · 2 active · active first, then by "
                                               r"severity, newest first · times in UTC"))).to_be_visible()
            # Every column, "last seen" included, fits the table: no horizontal scrolling at 1,440 px.
            scroller = page.locator('[data-testid="stDataFrame"] .dvn-scroller').first
            expect(scroller).to_be_visible()
            widths = scroller.evaluate("e => [e.scrollWidth, e.clientWidth]")
            assert widths[0] <= widths[1], widths
            page.wait_for_timeout(1000)
            page.screenshot(path=str(ARTIFACTS / "dashboard_anomalies.png"), full_page=True)

            # The detector service dies: its heartbeat key disappears and every page says so.
            service.set()
            r.delete("th:service:browser-test")
            expect(page.get_by_text(SERVICE_DOWN.replace("`", ""))).to_be_visible()
            page.locator('[data-testid="stSidebarNav"]').get_by_text("Overview", exact=True).click()
            expect(page.get_by_text(SERVICE_DOWN.replace("`", ""))).to_be_visible()
            page.wait_for_timeout(1000)
            page.screenshot(path=str(ARTIFACTS / "dashboard_service_down.png"), full_page=False)
        finally:
            browser.close()


def test_replayed_run_in_chromium(dashboard: tuple[str, threading.Event]) -> None:
    """A replayed log (one rank, no timings, no token counts) reads right at 1,366 px."""
    from playwright.sync_api import expect, sync_playwright

    base, _service = dashboard
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = _launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 1400}, timezone_id="UTC")
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.goto(f"{base}/?run={REPLAY}")
            expect(page.locator('[data-testid="stMetricValue"]')).to_have_count(5)
            assert _kpis(page) == {"Throughput": "n/a", "Goodput (tokens)": "n/a", "Goodput (time)": "92.4%",
                                   "Active anomalies": "0", "Badput time": "115 s"}
            assert _overflowing(page, '[data-testid="stMetricValue"] div, [data-testid="stMetricDelta"] div') == []
            expect(page.get_by_text("700 logged steps kept of 700 done")).to_be_visible()
            expect(page.locator("g.ytick text", has_text=re.compile("^evaluation$"))).to_have_count(1)
            # No anomaly or checkpoint in this run: the step axis under the curves is still drawn.
            expect(page.locator("g.x3tick text", has_text=re.compile("^1,?400$"))).to_have_count(1)
            page.wait_for_timeout(1000)
            page.screenshot(path=str(ARTIFACTS / "dashboard_replay_overview.png"), full_page=True)

            page.locator('[data-testid="stSidebarNav"]').get_by_text("Ranks", exact=True).click()
            expect(page.get_by_text(re.compile(r"^No per-rank section timings in this run"))).to_be_visible()
            expect(page.locator(".js-plotly-plot")).to_have_count(0)
            page.wait_for_timeout(500)
            page.screenshot(path=str(ARTIFACTS / "dashboard_replay_ranks.png"), full_page=True)
        finally:
            browser.close()


def test_live_refresh_survives_a_redis_restart(own_redis: Any, tmp_path: Path) -> None:
    """The 2 s fragment says so when Redis goes away and recovers by itself when it is back."""
    from playwright.sync_api import expect, sync_playwright

    _require_chromium()
    client = redis.Redis.from_url(own_redis.url)
    seed_run(client)
    client.close()
    with _streamlit(own_redis.url, tmp_path) as base, sync_playwright() as pw:
        browser = _launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 1000})
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.goto(f"{base}/?run={RUN}")
            expect(page.locator('[data-testid="stMetricValue"]').first).to_have_text("679")
            own_redis.stop()
            expect(page.get_by_text(re.compile(r"Redis is unreachable at .*Retrying on the next refresh"))
                   ).to_be_visible()
            own_redis.start()  # same port, empty (persistence off): reseed, as after a failover
            client = redis.Redis.from_url(own_redis.url)
            seed_run(client)
            client.close()
            expect(page.get_by_text("Redis is unreachable")).to_have_count(0)
            expect(page.locator('[data-testid="stMetricValue"]').first).to_have_text("679")
        finally:
            browser.close()
