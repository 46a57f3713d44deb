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
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from trainhealth.server import free_port

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
# The same fully known run as the AppTest tests (loaded by path: tests are not a package).
_SEED = runpy.run_path(str(Path(__file__).with_name("test_dashboard.py")))
seed_run, RUN = _SEED["seed_run"], _SEED["RUN"]
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


@pytest.fixture
def dashboard(r: redis.Redis, redis_url: str, tmp_path: Path) -> Iterator[str]:
    """Base URL of the dashboard on the seeded test Redis."""
    _require_chromium()
    seed_run(r)
    with _streamlit(redis_url, tmp_path) as base:
        yield base


def _launch(pw: Any) -> Any:
    return pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def test_dashboard_in_chromium(dashboard: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = _launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1500}, timezone_id="UTC")
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.goto(f"{dashboard}/?run={RUN}")

            # KPIs: label → value, read from the rendered metric cards.
            values = page.locator('[data-testid="stMetricValue"]')
            expect(values).to_have_count(6)
            labels = page.locator('[data-testid="stMetricLabel"]').all_inner_texts()
            kpi = dict(zip([lbl.strip() for lbl in labels], [v.strip() for v in values.all_inner_texts()],
                           strict=True))
            assert kpi["Step"] == "12"
            assert kpi["Goodput %"] == "71.5%"
            assert kpi["Throughput"] == "573"
            assert kpi["Anomalies"] == "2"
            # Units and the critical count sit in the cards' grey/red sub-line.
            deltas = [d.strip() for d in page.locator('[data-testid="stMetricDelta"]').all_inner_texts()]
            assert deltas == ["restart gen 1", "tokens/s", "tokens/s", "of wall time", "active, 1 critical",
                              "at $2.5/GPU-h"]
            expect(page.locator(".js-plotly-plot")).to_have_count(3)
            expect(page.get_by_text("Throughput vs goodput (tokens/s, since start)")).to_be_visible()
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
            expect(page.get_by_text("4 of 4 anomalies shown · 2 active · times in UTC")).to_be_visible()
            page.wait_for_timeout(1000)
            page.screenshot(path=str(ARTIFACTS / "dashboard_anomalies.png"), full_page=True)
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
            expect(page.locator('[data-testid="stMetricValue"]').first).to_have_text("12")
            own_redis.stop()
            expect(page.get_by_text(re.compile(r"Redis is unreachable at .*Retrying on the next refresh"))
                   ).to_be_visible()
            own_redis.start()  # same port, empty (persistence off): reseed, as after a failover
            client = redis.Redis.from_url(own_redis.url)
            seed_run(client)
            client.close()
            expect(page.get_by_text("Redis is unreachable")).to_have_count(0)
            expect(page.locator('[data-testid="stMetricValue"]').first).to_have_text("12")
        finally:
            browser.close()
