"""The dashboard's Alerts page (dashboard/pages/alerts.py) with Streamlit's AppTest on a real Redis: worker
status, sinks, recent notifications, dead letters, and the forms that add and expire silences and resend
dead letters."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
import redis
from pytest_httpserver import HTTPServer
from streamlit.testing.v1 import AppTest

from trainhealth import alert_store as store
from trainhealth.alerts.config import DeliveryConfig
from trainhealth.alerts.notification import Alert, Notification
from trainhealth.alerts.outbox import Deliverer, enqueue
from trainhealth.alerts.secrets import Secret
from trainhealth.alerts.sinks import SlackSink
from trainhealth.keys import ALERTS_DEAD, ALERTS_OUTBOX, RUNS, alerts_worker_heartbeat, run_keys

PAGE = Path(__file__).resolve().parent.parent / "dashboard" / "pages" / "alerts.py"


def seed(r: redis.Redis, httpserver: HTTPServer) -> None:
    now = time.time()
    r.zadd(RUNS, {"r1": now - 600, "r2": now - 300})
    for run in ("r1", "r2"):
        r.hset(run_keys(run).meta, mapping={"name": run, "world_size": "8", "status": "running"})
    httpserver.expect_request("/hook").respond_with_data("ok")
    sinks = {"slack": SlackSink("slack", Secret(httpserver.url_for("/hook")))}
    pipe = r.pipeline()
    for run in ("r1", "r2"):
        a = Alert.from_transition(run, "opened", {
            "id": "straggler:5:250:0", "run": run, "kind": "straggler", "severity": "warning", "status": "active",
            "step": 250, "end_step": None, "ranks": [5], "hosts": ["n0"], "evidence": {"score": 0.6},
            "message": "rank 5 is slow", "first_seen": now - 100, "last_seen": now - 100})
        enqueue(pipe, Notification(group_key=f'root:{{run="{run}",kind="straggler"}}', route="root",
                                   receivers=("slack",), group_labels={"run": run, "kind": "straggler"}, seq=1,
                                   at=now - 70, reason="new", firing=(a,), group_started=now - 100), sinks, now)
    pipe.execute()
    with httpx.Client() as http:
        Deliverer(r, sinks, DeliveryConfig(), consumer="w", http=http).run_once()
    r.set(alerts_worker_heartbeat("host-1"), json.dumps({"role": "leader", "t": now - 2, "pid": 1, "host": "h"}),
          ex=30)
    r.lpush(ALERTS_DEAD, json.dumps({"id": "5-0", "sink": "slack", "key": "k5", "group": 'root:{run="r1"}',
                                     "seq": "3", "attempts": 12, "status": 500, "error": "gave up after 12 tries",
                                     "dead_at": now - 50, "notification": {"seq": 3}}))
    store.add_silence(r, ['run="r2"'], duration_s=3600, created_by="bo", comment="maintenance")


@pytest.fixture
def page(r: redis.Redis, redis_url: str, httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    seed(r, httpserver)
    at = AppTest.from_file(str(PAGE), default_timeout=30)
    at.query_params["run"] = "r1"
    return at.run()


def _button(at: AppTest, label: str):
    return next(b for b in at.button if b.label == label)


def test_alerts_page_shows_worker_sinks_notifications_dead_letters_and_silences(page: AppTest) -> None:
    at = page
    assert not at.exception
    assert at.session_state["th_run"] == "r1"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics == {"Alert worker": "running", "Pending deliveries": "0", "Dead letters": "1",
                       "Active silences": "1"}
    sinks, sent, dead, silences = (df.value for df in at.dataframe)
    assert list(sinks["sink"]) == ["slack"] and list(sinks["state"]) == ["ok"] and list(sinks["delivered"]) == [2]
    assert list(sent["title"]) == ["WARNING · straggler · run r1"]  # only the selected run's by default
    assert list(sent["sink"]) == ["slack"] and list(sent["attempts"]) == [1]
    assert re.fullmatch(r"[0-9a-f]{12}…", sent["key"][0])  # the start of the 32-hex idempotency key
    assert list(dead["id"]) == ["5-0"] and list(dead["error"]) == ["gave up after 12 tries"]
    assert list(silences["matchers"]) == ['run="r2"'] and list(silences["state"]) == ["active"]
    at.toggle(key="alerts_only_run").set_value(False).run()
    assert sorted(at.dataframe[1].value["title"]) == ["WARNING · straggler · run r1", "WARNING · straggler · run r2"]


def test_silence_form_adds_and_expires(page: AppTest, r: redis.Redis) -> None:
    at = page
    assert at.text_input(key="sil_run").value == "r1"  # prefilled with the selected run
    at.selectbox(key="sil_kind").select("straggler")
    at.text_input(key="sil_rank").input("5")
    at.selectbox(key="sil_duration").select("4h")
    at.text_input(key="sil_comment").input("draining node 7")
    at.text_input(key="sil_by").input("ana")
    _button(at, "Add silence").click().run()
    assert not at.exception
    added = [s for s in store.list_silences(r) if s.created_by == "ana"]
    assert len(added) == 1
    s = added[0]
    assert [str(m) for m in s.matchers] == ['run="r1"', 'rank="5"', 'kind="straggler"']
    assert (round(s.ends_at - s.starts_at), s.comment) == (4 * 3600, "draining node 7")
    assert at.success[0].value == f'Silence `{s.id}` added: run="r1" rank="5" kind="straggler" for 4h.'
    at.run()  # the next refresh lists it
    at.selectbox(key="sil_expire").select(s.id)
    _button(at, "Expire now").click().run()
    assert not at.exception and at.success[0].value == f"Silence `{s.id}` expired."
    assert [str(x.matchers[0]) for x in store.list_silences(r)] == ['run="r2"']


def test_dead_letters_can_be_resent(page: AppTest, r: redis.Redis) -> None:
    at = page
    _button(at, "Resend all").click().run()
    assert not at.exception
    assert r.llen(ALERTS_DEAD) == 0
    assert [f[b"key"] for _, f in r.xrange(ALERTS_OUTBOX)][-1] == b"k5"
