"""The job's state (``th:{run}:state``, :mod:`trainhealth.job`) on the dashboard, against a real Redis.

A hung or crashed job gets a red banner on the Overview naming the rank that stopped first, the
status says so instead of ``running``, and the throughput card shows the ledger's last-minute rate
instead of the run's healthy average; the Ranks page marks the culprit. The run is seeded with raw
redis-py commands following docs/architecture.md, the job state with :meth:`JobState.to_json`
(the record the detector service writes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
from streamlit.testing.v1 import AppTest

from trainhealth.dashboard import data
from trainhealth.job import Culprit, JobState
from trainhealth.keys import RUNS, run_keys, service_heartbeat

pytestmark = pytest.mark.usefixtures("fresh_streamlit_caches")

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
T0 = 1796000000.0  # 2026-11-30 00:53:20 UTC
RUN = "llama-70b"
HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
BUSY = [0.50, 0.51, 0.52, 0.53]
TOKENS_PER_STEP = 4 * 8192
#: The run's healthy throughput (tokens ÷ seconds inside steps) — what the card used to show during a hang.
WHOLE_RUN = 68_233.0
#: An age whose ``fmt_duration`` stays "3.0 h" for minutes (the page reads the clock a second or two later).
HOURS_3 = 3 * 3600 + 60.0
HOURS_2 = 2 * 3600 + 60.0
HUNG = JobState("hung", 0.0, step=12, message="no step completed for 3.0 h (timeout 10 min)",
                culprit=Culprit(2, "node-b", 4242, 12, "its heartbeat stopped while the others' continued"))
CRASHED = JobState("crashed", 0.0, step=12, message="every rank's heartbeat is gone; no relaunch within 2 min",
                   culprit=Culprit(1, "node-a", 101, 12, "its heartbeat stopped 40 s before the others'"))
HUNG_BANNER = ("Hung for 3.0 h at step 12 — no step completed for 3.0 h (timeout 10 min). Culprit: rank 2 "
               "(host node-b, pid 4242) stopped first: its heartbeat stopped while the others' continued. See where "
               "it is stuck: `py-spy dump --pid 4242` on host node-b.")
CRASHED_BANNER = ("Crashed at step 12, rank 1 first (host node-a) — every rank's heartbeat is gone; no relaunch "
                  "within 2 min. Last heard from 2.0 h ago.")


def snapshot(rate_60s: float | None) -> dict:
    """The newest ledger snapshot as docs/goodput.md lays it out; ``rates`` only when ``rate_60s`` is given."""
    wall, world, price = 12_000.0, 4, 2.5
    seconds = {c: 0.0 for c in data.LEDGER_CATEGORIES}
    seconds.update({"productive": 5.76, "program_startup": 30.0, "hang": 11_964.24})
    done = 12
    snap = {"t": T0 + wall, "started_at": T0, "wall_s": wall, "world_size": world, "gpu_hour_usd": price,
            "last_step": done, "steps_done": done, "steps_good": done, "restarts": 0,
            "tokens_total": done * TOKENS_PER_STEP, "tokens_good": done * TOKENS_PER_STEP,
            "step_s": done * TOKENS_PER_STEP / WHOLE_RUN, "throughput_tok_s": WHOLE_RUN,
            "goodput_tok_s": done * TOKENS_PER_STEP / wall, "goodput_pct": 100.0 * seconds["productive"] / wall,
            "seconds": seconds, "custom_by_name": {},
            "gpu_hours": {k: v * world / 3600 for k, v in seconds.items()},
            "cost_usd": {k: v * world * price / 3600 for k, v in seconds.items()},
            "badput_cost_usd": sum(v for k, v in seconds.items() if k != "productive") * world * price / 3600}
    if rate_60s is not None:
        snap["rates"] = {w: {"throughput_tok_s": rate_60s if w == "60s" else WHOLE_RUN,
                             "goodput_tok_s": rate_60s if w == "60s" else WHOLE_RUN}
                         for w in data.RATE_WINDOWS}
    return snap


def seed_run(r: redis.Redis, rate_60s: float | None = 0.0) -> None:
    """A 4-rank run: steps 1-12 with per-rank busy times, the ranks' hosts and pids, and the newest ledger snapshot."""
    k = run_keys(RUN)
    r.zadd(RUNS, {RUN: T0})
    r.hset(k.meta, mapping={"name": RUN, "world_size": "4", "started_at": repr(T0), "gpu_hour_usd": "2.5",
                            "status": "running", "updated_at": repr(T0 + 100), "source": "demo"})
    for s in range(1, 13):
        t_start = T0 + 30 + 0.5 * (s - 1)
        r.xadd(k.agg, {"step": s, "gen": 0, "t_start": repr(t_start), "t_end": repr(t_start + 0.48), "dur": "0.48",
                       "loss": repr(3.0 - 0.05 * s), "grad_norm": "1.0", "lr": "0.0003", "tokens": TOKENS_PER_STEP,
                       "samples": 32, "n_ranks": 4, "busy": json.dumps(BUSY), "data_s": "0.01"})
    for rank in range(4):
        r.xadd(k.events, {"kind": "run_start", "rank": rank, "t": repr(T0), "inc": repr(T0), "host": HOSTS[rank],
                          "pid": str(100 + rank), "world_size": "4", "local_rank": str(rank % 2), "config": "{}"})
    snap = json.dumps(snapshot(rate_60s))
    r.xadd(k.ledger, {"json": snap})
    r.set(k.ledger_latest, snap)


def write_state(r: redis.Redis, state: JobState, age_s: float) -> None:
    """Write ``state`` as the detector service does, entered ``age_s`` ago."""
    r.set(run_keys(RUN).state, JobState(state.state, time.time() - age_s, state.step, state.culprit, state.message,
                                        state.gen).to_json())



@pytest.fixture
def seeded(r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> redis.Redis:
    """The seeded run (hung runs' ledger: nothing in the last minute) with a live detector service."""
    seed_run(r)
    r.set(service_heartbeat("svc-1"), json.dumps({"pid": 4242, "host": "host-1", "t": time.time(), "runs": 1,
                                                  "processed": 99}), ex=30)
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    return r


def app(page: str | None = None) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    if page:
        at.switch_page(page).run()
    assert not at.exception
    return at


def metrics(at: AppTest) -> dict[str, tuple[str, str | None]]:
    return {m.label: (m.value, m.proto.delta or None) for m in at.metric}


def status(at: AppTest) -> str:
    return at.main.caption[0].value.split(" · ")[0]


# --- data.job_state ------------------------------------------------------------------------

def test_job_state_reads_the_record_or_none(r: redis.Redis, redis_url: str) -> None:
    assert data.job_state(r, RUN) is None
    state = JobState("hung", T0 + 500.0, 12, HUNG.culprit, HUNG.message, 1)
    r.set(run_keys(RUN).state, state.to_json())
    problems: list[str] = []
    assert data.job_state(r, RUN, problems) == state and problems == []
    decoded = redis.Redis.from_url(redis_url, decode_responses=True)
    assert data.job_state(decoded, RUN) == state
    decoded.close()


@pytest.mark.parametrize(("raw", "problem"), [
    ("{not json", "th:{llama-70b}:state is unreadable: job state is not JSON: Expecting property name enclosed in "
                  "double quotes: line 1 column 2 (char 1)"),
    ('["hung"]', "th:{llama-70b}:state is unreadable: job state is not a JSON object: '[\"hung\"]'"),
    ('{"state": "hung"}', "th:{llama-70b}:state is unreadable: job state has no field 'since'"),
    ('{"state": "paused", "since": 1}', "th:{llama-70b}:state is unreadable: job state has a bad field: "
                                        "state='paused' is not one of running, hung, crashed, restarted, finished"),
])
def test_job_state_malformed_is_none_and_a_problem(r: redis.Redis, raw: str, problem: str) -> None:
    r.set(run_keys(RUN).state, raw)
    problems: list[str] = []
    assert data.job_state(r, RUN, problems) is None
    assert problems == [problem]


def test_job_state_wrongly_typed_fields_are_blanked(r: redis.Redis) -> None:
    r.set(run_keys(RUN).state, json.dumps({"state": "hung", "since": T0, "step": "twelve", "message": "stuck",
                                           "culprit": {"rank": 2, "host": 7, "pid": "4242x", "step": 11.0}}))
    problems: list[str] = []
    state = data.job_state(r, RUN, problems)
    assert state == JobState("hung", T0, None, Culprit(2, None, None, 11, ""), "stuck")
    assert problems == ["th:{llama-70b}:state has unreadable values, shown as missing: step 'twelve' is not a number; "
                        "culprit.host 7 is not a string; culprit.pid '4242x' is not a number"]


# --- the Overview ----------------------------------------------------------------------------

def test_hung_banner_status_and_last_minute_throughput(seeded: redis.Redis) -> None:
    write_state(seeded, HUNG, HOURS_3)
    at = app()
    assert [e.value for e in at.error] == [HUNG_BANNER]
    assert not at.warning
    assert status(at) == "status **hung**"
    # The sidebar says it too: the picker's label and the live status line (meta still says running).
    assert at.sidebar.selectbox[0].format_func(RUN) == f"hung · {RUN}"
    assert at.sidebar.caption[0].value.startswith("**hung**")
    # The 60 s window (no step completed in the last minute), not the run's healthy 68,233 tokens/s.
    thr = next(m for m in at.metric if m.label == "Throughput")
    assert (thr.value, thr.proto.delta) == ("0", "tokens/s, last min")
    assert thr.help.startswith("The job is hung: tokens/s of the steps completed in the last minute (0 when none); "
                               "over the whole run 68,233 tokens/s. Throughput tokens/s = ")


def test_hung_without_rate_windows_labels_the_last_value(seeded: redis.Redis) -> None:
    seeded.set(run_keys(RUN).ledger_latest, json.dumps(snapshot(None)))  # a ledger without rolling rates
    write_state(seeded, HUNG, HOURS_3)
    at = app()
    assert [e.value for e in at.error] == [HUNG_BANNER]
    assert metrics(at)["Throughput"] == ("68,233", "before the hang")


def test_hung_culprit_without_pid_or_why(seeded: redis.Redis) -> None:
    write_state(seeded, JobState("hung", 0.0, step=None, culprit=Culprit(3), message="no step yet after 15 min"),
                HOURS_3)
    at = app()
    assert [e.value for e in at.error] == [
        "Hung for 3.0 h before the first step — no step yet after 15 min. Culprit: rank 3 stopped first."]


def test_crashed_banner_and_last_minute_throughput(seeded: redis.Redis) -> None:
    seeded.set(run_keys(RUN).ledger_latest, json.dumps(snapshot(22_741.3)))  # steps ended within the last minute
    write_state(seeded, CRASHED, HOURS_2)
    at = app()
    assert [e.value for e in at.error] == [CRASHED_BANNER]
    assert status(at) == "status **crashed**"
    assert metrics(at)["Throughput"] == ("22,741", "tokens/s, last min")


def test_crashed_message_that_says_it_all_leads_alone(seeded: redis.Redis) -> None:
    # The service's own crash message starts with what the banner's head says: not said twice.
    write_state(seeded, JobState("crashed", 0.0, 1234, CRASHED.culprit, "crashed at step 1234, rank 1 first (host "
                                 "node-a, pid 101): its heartbeat stopped first; no relaunch within 120 s"), HOURS_2)
    at = app()
    assert [e.value for e in at.error] == [
        "Crashed at step 1234, rank 1 first (host node-a, pid 101): its heartbeat stopped first; no relaunch within "
        "120 s. Last heard from 2.0 h ago."]


def test_crashed_without_culprit(seeded: redis.Redis) -> None:
    write_state(seeded, JobState("crashed", 0.0, 12, message="no heartbeat from any rank"), HOURS_2)
    at = app()
    assert [e.value for e in at.error] == [
        "Crashed at step 12 — no heartbeat from any rank. Last heard from 2.0 h ago."]


@pytest.mark.parametrize(("message", "banner"), [
    ("all 4 ranks came back from the step-8 checkpoint.",
     "Restarted at step 8 — all 4 ranks came back from the step-8 checkpoint. It came back 3.0 h ago (restart "
     "generation 1)."),
    ("restarted at step 8 after rank 2 (host node-b, pid 4242) stopped at step 12",
     "Restarted at step 8 after rank 2 (host node-b, pid 4242) stopped at step 12. It came back 3.0 h ago (restart "
     "generation 1)."),
])
def test_restarted_warns_and_keeps_the_throughput(seeded: redis.Redis, message: str, banner: str) -> None:
    write_state(seeded, JobState("restarted", 0.0, step=8, gen=1, message=message, culprit=HUNG.culprit), HOURS_3)
    at = app()
    assert not at.error
    assert [w.value for w in at.warning] == [banner]
    assert status(at) == "status **restarted**"
    assert metrics(at)["Throughput"] == ("68,233", "tokens/s")


@pytest.mark.parametrize("state", ["finished", "running"])
def test_finished_or_running_no_banner(seeded: redis.Redis, state: str) -> None:
    write_state(seeded, JobState(state, 0.0, step=12, message="every rank ended cleanly"), HOURS_3)
    at = app()
    assert not at.error and not at.warning
    assert status(at) == f"status **{state}**"
    assert metrics(at)["Throughput"] == ("68,233", "tokens/s")


def test_no_state_key_no_banner(seeded: redis.Redis) -> None:
    at = app()
    assert not at.error and not at.warning
    assert status(at) == "status **running**"
    assert metrics(at)["Throughput"] == ("68,233", "tokens/s")


def test_malformed_state_is_reported_and_the_page_renders(seeded: redis.Redis) -> None:
    seeded.set(run_keys(RUN).state, "{not json")
    at = app()
    assert not at.error
    assert [w.value for w in at.warning] == [
        "th:{llama-70b}:state is unreadable: job state is not JSON: Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1)"]
    assert status(at) == "status **running**"
    assert metrics(at)["Throughput"] == ("68,233", "tokens/s")
    assert len(at.get("plotly_chart")) == 3  # curves, goodput over time, badput


# --- the Ranks page ---------------------------------------------------------------------------

def test_ranks_page_marks_the_culprit(seeded: redis.Redis) -> None:
    write_state(seeded, HUNG, HOURS_3)
    at = app("pages/ranks.py")
    # The header's banner, as on every page (the Overview's own test checks its text), names the culprit once.
    assert [e.value for e in at.error] == [
        "Hung for 3.0 h at step 12 — no step completed for 3.0 h (timeout 10 min). Culprit: rank 2 (host node-b, "
        "pid 4242) stopped first: its heartbeat stopped while the others' continued. See where it is stuck: "
        "`py-spy dump --pid 4242` on host node-b."]
    table = at.dataframe[1].value  # after the nodes table
    assert list(table["rank"]) == [3, 2, 1, 0]
    assert list(table["culprit"]) == [False, True, False, False]


def test_ranks_page_without_state_has_no_culprit_column(seeded: redis.Redis) -> None:
    at = app("pages/ranks.py")
    assert not at.error
    assert "culprit" not in at.dataframe[1].value.columns and "rank" in at.dataframe[1].value.columns


def test_a_recovery_card_shows_what_to_run_and_the_cost_of_waiting() -> None:
    from trainhealth.dashboard.cards import facts

    rec = {"kind": "hang", "action": "dump_stacks", "checkpoint_step": 59, "deadline_s": 600.0,
           "commands": ["py-spy dump --pid 4242  # on node-b"], "exclude_hosts": [],
           "cost": {"steps": 7, "gpu_hours": 2.0, "usd": None, "wall_hours": 0.25},
           "continue_cost": {"gpu_hours": 0.5, "usd": None, "gpu_hours_per_hour": 8.0, "usd_per_hour": None}}
    assert facts(rec) == [
        "**Restart from**  \ncheckpoint of step 59  \nrestart if no progress 10.0 min after the onset",
        "**Run**  \n`py-spy dump --pid 4242  # on node-b`",
        "**Restarting costs**  \n7 steps recomputed  \n2.00 GPU-h",
        "**Waiting costs**  \n0.50 GPU-h so far  \nthen 8 GPU-h per hour",
    ]
