"""Chaos (issue 15): a scripted 2-rank job run clean and then with every fault — the detector service and the
alert worker SIGKILLed, the webhook receiver answering 500, 429 and holding a request past a worker's death,
redis-server SIGKILLed mid-run, a lossy run with a tiny buffer, a job logging as fast as it can — against real
password-protected redis-server, ``trainhealth serve`` and ``trainhealth alerts`` processes and a local HTTP
receiver whose webhook URLs carry a token (``bench/chaos.py``, run here at its default sizes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import chaos  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return chaos.run(log_dir=tmp_path_factory.mktemp("chaos"))


def test_every_exact_check_holds(result: dict) -> None:
    assert [name for name, ok in result["checks"].items() if not ok] == []


def test_the_faults_happened(result: dict) -> None:
    ch = result["chaos"]
    # The receiver answered 500, 500, 429 (Retry-After) and 503 to the request held past the worker's SIGKILL.
    assert {code: n for code, n in ch["answers"].items() if code != 200} == {500: 2, 429: 1, 503: 1}
    assert ch["resent_keys"] >= 1 and ch["resends_identical"]
    assert ch["serve_restart_s"] < 10.0 and ch["redis_resumed_s"] < 10.0
    lossy = ch["collectors"][f"{chaos.LOSSY}/0"]
    assert lossy["dropped"] > 0 and lossy["logged"] == lossy["stored"] + lossy["dropped"]
    assert ch["fast"]["dropped"] > 0  # the fast job outran its sender: counted, and no page for it
    assert ch["logs"]["files"] >= 6 and ch["logs"]["tracebacks"] == {}


def test_the_same_anomalies_and_notifications_as_the_clean_run(result: dict) -> None:
    plan = result["plan"]
    expected = [(f"loss_spike:*:{plan['spike']}:0", "loss_spike", "warning", plan["spike"], "resolved"),
                (f"nan_inf:*:{plan['nan']}:0", "nan_inf", "critical", plan["nan"], "resolved"),
                ("straggler:1:0:0", "straggler", "warning", 0, "resolved")]
    for phase in ("reference", "chaos"):
        assert [tuple(a) for a in result[phase]["anomalies"][chaos.JOB]] == expected
        # one firing and one resolved per anomaly to the every-alert sink, the critical one to the pager too
        assert [(*k, n) for k, n in result[phase]["received_ok"]] == [
            ("hook", chaos.JOB, kind, transition, 1) for kind in ("loss_spike", "nan_inf", "straggler")
            for transition in ("firing", "resolved")] + [
            ("page", chaos.JOB, "nan_inf", transition, 1) for transition in ("firing", "resolved")]
