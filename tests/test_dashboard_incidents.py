"""The head of every page: the run's state in one line and one card per active incident (dashboard/incidents.py).

The incidents are grouped by the real :class:`~trainhealth.detectors.incidents.IncidentGrouper` from anomalies like
the detectors raise, their recommendations made by the real advisors, and both stored as the detector service stores
them; the pages run in Streamlit's AppTest on a real redis-server.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path

import pytest
import redis
from streamlit.testing.v1 import AppTest

from trainhealth.anomaly import Anomaly
from trainhealth.dashboard import cards, incidents
from trainhealth.dashboard.common import os_user
from trainhealth.detectors.advisor import Checkpoint, RollbackAdvisor
from trainhealth.detectors.incidents import IncidentGrouper
from trainhealth.detectors.recovery_advisor import RecoveryAdvisor
from trainhealth.job import Culprit, JobState
from trainhealth.keys import RUNS, run_keys, service_heartbeat

pytestmark = pytest.mark.usefixtures("fresh_streamlit_caches")

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
RUN = "llama-8b"
WORLD, PRICE = 8, 2.5
ACTOR = f"{os_user()} (no login)"
PAGES = {"overview": None, "goodput": "pages/goodput.py", "ranks": "pages/ranks.py",
         "anomalies": "pages/anomalies.py", "alerts": "pages/alerts.py"}
T0 = 1_764_547_200.0  # 2025-12-01 00:00 UTC: steps end at T0 + step s (a data time, not the clock's)


def anomalies() -> dict[str, Anomaly]:
    """A straggler and the throughput drop it costs; a loss spike that became a divergence; an old restart; a loss
    plateau (info)."""
    inc = {"incident": "loss_spike:*:450:0"}
    return {
        "straggler": Anomaly("straggler", "warning", 240, "rank 5 is a straggler (score 0.52)", ranks=(5,),
                             hosts=("node-1",), evidence={"score": 0.52, "rank_median_s": 0.1,
                                                          "best_median_s": 0.05, "typical_median_s": 0.05}),
        "drop": Anomaly("throughput_drop", "warning", 250, "throughput dropped 42.4% from step 250",
                        evidence={"before_s": 0.06, "after_s": 0.1, "lost_fraction": 0.4, "span_steps": 300}),
        "spike": Anomaly("loss_spike", "warning", 450, "loss 6.1 at step 450", evidence=inc),
        "divergence": Anomaly("divergence", "critical", 450, "loss diverged from step 450", evidence=inc),
        "restart": Anomaly("restart", "warning", 100, "run restarted at step 100", status="resolved", end_step=100,
                           evidence={"downtime_s": 4.9}),
        "plateau": Anomaly("plateau", "info", 150, "the loss has not improved since step 150"),
    }


def seed(r: redis.Redis, status: str = "running", which: tuple[str, ...] | None = None) -> dict:
    """The run with the incidents of ``which`` (all by default) and their recommendations, stored as the service
    does; returns the incidents by id and the recommendations by name."""
    k = run_keys(RUN)
    r.zadd(RUNS, {RUN: T0})
    r.hset(k.meta, mapping={"name": RUN, "world_size": str(WORLD), "started_at": repr(T0), "status": status,
                            "gpu_hour_usd": repr(PRICE)})
    found = {n: a for n, a in anomalies().items() if which is None or n in which}
    ckpts = [Checkpoint(s) for s in (199, 399)]
    kw = {"run": RUN, "checkpoints": ckpts, "current_step": 600, "step_s": 0.1, "world_size": WORLD,
          "gpu_hour_usd": PRICE}
    recs = {}
    if "straggler" in found:
        recs["straggler"] = RecoveryAdvisor().advise(found["straggler"], history=[found["straggler"]], **kw)
    if "divergence" in found:
        recs["divergence"] = RollbackAdvisor().advise(found["divergence"], history=[found["divergence"]],
                                                      data_positions={}, **kw)
    grouper = IncidentGrouper(step_time=lambda s: T0 + s)
    grouper.update(list(found.values()), list(recs.values()))
    for _name, rec in recs.items():
        d = rec.to_dict()
        d.update(status="proposed", created_at=T0 + 600, updated_at=T0 + 601)
        r.hset(k.recommendations, rec.id, json.dumps(d, sort_keys=True))
    for iid, inc in grouper.incidents.items():
        d = inc.to_dict()
        d.update(first_seen=T0 + inc.onset_step, last_seen=T0 + 600)
        r.hset(k.incidents, iid, json.dumps(d, sort_keys=True))
    for a in found.values():
        d = json.loads(a.to_json())
        d.update(run=RUN, first_seen=T0 + a.step, last_seen=T0 + 600)
        r.hset(k.anomalies, a.id, json.dumps(d))
    r.set(service_heartbeat("svc-1"), json.dumps({"pid": 1, "host": "h", "t": time.time(), "runs": 1}), ex=60)
    return {"incidents": dict(grouper.incidents), "recs": recs}


@pytest.fixture
def seeded(r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    return seed(r)


def page(name: str = "overview", **query: str) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update({"run": RUN, **query})
    at.run()
    if PAGES[name]:
        at.switch_page(PAGES[name]).run()
    assert not at.exception, at.exception
    return at


def main_markdown(at: AppTest) -> list[str]:
    return [m.value for m in at.main.markdown]


STRAGGLER = "inc:straggler:5:240:0"
PLATEAU = "Loss plateau from step 150"
SPIKE = "inc:loss_spike:*:450:0"
STATE = (":red-badge[:material/error: critical] · running · 2 active incidents (1 critical): Loss spike at step 450 "
         "that became a divergence; Rank 5 (node-1) is a straggler, costing throughput · 1 minor (info) · 1 resolved")
OTHERS_TABLE = """\
| status | severity | incident | where | steps | badput | GPU-h | advice | onset |
|---|---|---|---|---:|---:|---:|---|---|
| active | info | Loss plateau from step 150 | the whole job | 150 |  |  |  | 12-01 00:02:30 |
| resolved | warning | Run restarted at step 100 | the whole job | 100 | 5 s | 0.01 |  | 12-01 00:01:40 |"""
SPIKE_HEAD = ":red-badge[critical] :gray-badge[Loss spike] **Loss spike at step 450 that became a divergence**"
STRAGGLER_HEAD = ":orange-badge[warning] :gray-badge[Straggler] **Rank 5 (node-1) is a straggler, costing throughput**"


def test_grouping_the_seed_is_what_the_pages_show(seeded: dict) -> None:
    incs = seeded["incidents"]
    assert list(incs) == ["inc:straggler:5:240:0", SPIKE, "inc:restart:*:100:0", "inc:plateau:*:150:0"]
    straggler = incs[STRAGGLER]
    assert straggler.anomalies == ("straggler:5:240:0", "throughput_drop:*:250:0")
    # 300 steps x 0.04 s lost so far; 40 % of each hour while it lasts
    assert (straggler.badput_s, straggler.badput_s_per_hour) == (12.0, 1440.0)
    assert incs[SPIKE].recommendation == seeded["recs"]["divergence"].id


@pytest.mark.parametrize("name", list(PAGES))
def test_every_page_opens_with_the_state_line_and_the_incident_cards(seeded: dict, name: str) -> None:
    at = page(name)
    texts = main_markdown(at)
    assert texts[0] == STATE
    # One card per active critical/warning incident, critical first; the info one and the resolved restart go to
    # the table below them.
    assert [t for t in texts if t.startswith((":red-badge[critical]", ":orange-badge[warning]"))] == [
        SPIKE_HEAD, STRAGGLER_HEAD]
    i = texts.index(STRAGGLER_HEAD)
    assert texts[i + 1: i + 4] == [
        "**Where**  \nrank 5 on node-1",
        "**Since**  \nstep 240 · 00:04:00 UTC (" + texts[i + 2].split("(")[1],
        "**Costs**  \n12 s of the job so far (0.03 GPU-h · $0.07)  \nthen 24.0 min per hour (3.20 GPU-h · $8.00 per "
        "hour)"]
    assert texts[i + 2].endswith(" ago)")
    # Its one recommendation, inside it, with the page's own button keys.
    rec = seeded["recs"]["straggler"]
    assert at.button(key=cards.button_key(name, "acknowledged", rec.id)).label == "Acknowledge"
    assert texts[i + 4].startswith(":orange-badge[:material/swap_horiz: Replace node] :blue-badge[proposed] "
                                   "**Straggler at step 240**")
    assert texts[i + 5] == rec.summary
    captions = [c.value for c in at.main.caption]
    assert "2 anomalies grouped as one root cause · `inc:straggler:5:240:0`" in captions
    assert "2 anomalies grouped as one root cause · `inc:loss_spike:*:450:0`" in captions  # spike, divergence
    others = next(e for e in at.expander if e.label.startswith("Other incidents"))
    assert others.label == "Other incidents (2: minor or resolved)"
    # A markdown table (the data grid's JavaScript would delay the page's first chart): GPU-h = 4.9 s x 8 GPUs.
    assert OTHERS_TABLE in main_markdown(at)
    assert not [d for d in at.dataframe if "incident" in d.value.columns]


def test_the_other_incidents_table_escapes_its_cells_and_counts_what_it_leaves_out() -> None:
    rows = [{"status": "resolved", "severity": "info", "title": f"a | b {n}", "id": f"inc:{n}", "onset_step": n,
             "end_step": n + 5, "badput_s": 7200.0, "onset_t": T0 + n} for n in (1, 2, 3)]
    rows[2]["onset_t"] = float("nan")  # unknown: a blank cell, not an error
    text = incidents.others_table(rows, {}, 2, "Europe/Paris", limit=2)
    assert text.splitlines() == [
        "| status | severity | incident | where | steps | badput | GPU-h | advice | onset |",
        "|---|---|---|---|---:|---:|---:|---|---|",
        "| resolved | info | a \\| b 1 | the whole job | 1–6 | 2.0 h | 4.00 |  | 12-01 01:00:01 |",
        "| resolved | info | a \\| b 2 | the whole job | 2–7 | 2.0 h | 4.00 |  | 12-01 01:00:02 |",
        "",
        "1 more incident: the Anomalies page lists every anomaly."]
    assert incidents.others_table(rows[2:], {}, None, "UTC").splitlines()[2] == (
        "| resolved | info | a \\| b 3 | the whole job | 3–8 | 2.0 h |  |  |  |")


def test_acknowledge_then_dismiss_inside_the_incident_card(seeded: dict, r: redis.Redis) -> None:
    rec = seeded["recs"]["straggler"]
    at = page("ranks")
    at.button(key=cards.button_key("ranks", "acknowledged", rec.id)).click().run()
    assert not at.exception
    d = json.loads(r.hget(run_keys(RUN).recommendations, rec.id))
    assert d["status"] == "acknowledged" and d["history"][-1]["by"] == ACTOR
    assert [t.value for t in at.toast] == ["Recommendation acknowledged."]
    at.button(key=cards.button_key("ranks", "dismissed", rec.id)).click().run()
    assert json.loads(r.hget(run_keys(RUN).recommendations, rec.id))["status"] == "dismissed"
    # The incident stays (it is still active), saying what became of its advice; no buttons for it any more.
    texts = main_markdown(at)
    assert STRAGGLER_HEAD in texts
    decided = [c.value for c in at.main.caption if c.value.startswith("Advice: Replace node")]
    assert len(decided) == 1 and decided[0].startswith(f"Advice: Replace node — dismissed by {ACTOR} ")
    with pytest.raises(KeyError):
        at.button(key=cards.button_key("ranks", "dismissed", rec.id))


def test_evidence_opens_the_anomalies_page_on_the_onset_and_rank(seeded: dict) -> None:
    at = page("overview")
    # The card's "Evidence" is a page link carrying the incident's focus (the browser follows it; AppTest cannot, so
    # the session opens the page it names with the query it carries, as the browser does).
    links = {e.proto.query_string: e.proto for e in at.main.get("page_link") if e.proto.label == "Evidence"}
    link = links[f"run={RUN}&step=240&rank=5"]  # the straggler's card's
    assert (link.page, len(links)) == ("anomalies", 2)  # one link per card (the critical and warning incidents)
    at.query_params.clear()
    at.query_params.update(dict(urllib.parse.parse_qsl(link.query_string)))
    at.switch_page(PAGES["anomalies"]).run()
    assert not at.exception
    assert at.query_params["step"] == "240" and at.query_params["rank"] == "5"
    assert "#### Straggler" in main_markdown(at)  # the Anomalies page, its root anomaly selected
    assert at.sidebar.caption[1].value == "Link: step 240 · rank 5"


def test_a_finished_run_is_healthy_and_lists_what_happened(r: redis.Redis, redis_url: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    seed(r, status="finished", which=("restart",))
    at = page("goodput")
    assert main_markdown(at)[0] == (":green-badge[:material/check_circle: healthy] · finished · no active incident · "
                                    "1 resolved")
    assert not [t for t in main_markdown(at) if t.startswith((":red-badge[critical]", ":orange-badge[warning]"))]
    assert [e.label for e in at.expander if e.label.startswith("Other")] == ["Other incidents (1: minor or resolved)"]


def test_a_hung_job_is_critical_on_every_page(r: redis.Redis, redis_url: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    seed(r, which=("plateau",))
    state = JobState("hung", time.time() - 600, 510, Culprit(3, "node-0", 77, 510, "its heartbeat stopped first"),
                     "no step completed for 10 min", 0)
    r.set(run_keys(RUN).state, state.to_json())
    at = page("alerts")
    assert next(e.value for e in at.error).startswith("Hung for 10.0 min at step 510 — no step completed for 10 min. "
                                                     "Culprit: rank 3 (host node-0, pid 77) stopped first")
    assert main_markdown(at)[0] == (":red-badge[:material/error: critical] · hung · no active incident · "
                                    "1 minor (info)")


def test_unreadable_incidents_are_named_and_the_others_shown(seeded: dict, r: redis.Redis) -> None:
    k = run_keys(RUN).incidents
    r.hset(k, "inc:bad", "{not json")
    raw = json.loads(r.hget(k, STRAGGLER))
    raw["ranks"] = "five"
    r.hset(k, STRAGGLER, json.dumps(raw))
    at = page("anomalies")
    warnings = [w.value for w in at.warning]
    assert any(f"{k}" in w and "'inc:bad'" in w and "not JSON" in w for w in warnings), warnings
    assert any("ranks 'five' is not a list of rank numbers" in w for w in warnings), warnings
    texts = main_markdown(at)
    assert texts[0] == STATE and STRAGGLER_HEAD in texts
    assert "**Where**  \nthe whole job" in texts  # its ranks unreadable: blank, the rest of the card shown


def test_state_line_words() -> None:
    line = incidents.state_line
    none = JobState("running", T0, 5, None, "", 0)
    assert line([], none, {"status": "running"}) == (":green-badge[:material/check_circle: healthy] · running · "
                                                     "no active incident")
    many = [{"status": "active", "severity": "warning", "title": f"T{i}"} for i in range(4)]
    assert line(many, None, {}) == (":orange-badge[:material/warning: degraded] · unknown · 4 active incidents: "
                                    "T0; T1 and 2 more")
    assert incidents.where_text({"ranks": [], "hosts": ["a", "b", "c", "d", "e"]}) == "hosts a, b, c, d and 1 more"
    assert incidents.cost_text({"badput_s": None, "status": "active"}, 8, None) == "not measured from its evidence"
    assert incidents.cost_text({"badput_s": 3600.0, "badput_s_per_hour": 3600.0, "status": "active"}, None, None) == (
        "60.0 min of the job so far  \nthen 60.0 min per hour")
