"""The JSON Schemas of docs/schemas/: generated from the code's types (trainhealth.commands.schemas), committed, and
strict enough that a document breaking its contract fails (unknown field, missing field, wrong type or value)."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from jsonschema import Draft202012Validator

from trainhealth import Monitor
from trainhealth.alerts.notification import Alert, Notification
from trainhealth.alerts.sinks.webhook import webhook_payload
from trainhealth.alerts.watchdog import ServiceCheck, service_down_alert
from trainhealth.anomaly import Anomaly
from trainhealth.commands import analyze_report, schemas
from trainhealth.detectors.incidents import IncidentGrouper
from trainhealth.job import Culprit, JobState
from trainhealth.recommendations import Recommendation

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "docs" / "schemas"
TROCR = "hf_trocr_large_gradnorm.trainer_state.json"
WORD_LM = "pytorch_word_lm_all_nan.log"


def errors(name: str, doc: Any) -> list[str]:
    schema = json.loads((SCHEMAS / f"{name}.json").read_text())
    return [f"{e.json_path}: {e.message}" for e in Draft202012Validator(schema).iter_errors(doc)]


def test_the_committed_schemas_are_the_generated_ones() -> None:
    """A change to a type (a field added, renamed, retyped, re-documented) fails here until the schemas are written
    again: `trainhealth schemas --write docs/schemas`."""
    assert schemas.stale(SCHEMAS) == []
    assert sorted(p.stem for p in SCHEMAS.glob("*.json")) == sorted(schemas.DOCUMENTS)


def test_a_changed_type_makes_them_stale(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    @dataclasses.dataclass(frozen=True)
    class JobState2(JobState):
        region: str = ""

    monkeypatch.setattr("trainhealth.job.JobState", JobState2)
    assert schemas.stale(SCHEMAS) == ["job-state.json"]
    # The command says so (exit 1, naming the file) and writes the new one.
    shutil.copytree(SCHEMAS, tmp_path / "s")
    (tmp_path / "s" / "event.json").write_text("{}\n")
    (tmp_path / "s" / "old.json").write_text("{}\n")
    out = subprocess.run([sys.executable, "-m", "trainhealth", "schemas", "--check", str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stdout.splitlines() == [f"{tmp_path / 's' / n}: not the generated schema (trainhealth schemas --write "
                                       f"{tmp_path / 's'})" for n in ("event.json", "old.json")]
    ok = subprocess.run([sys.executable, "-m", "trainhealth", "schemas", "--check", str(SCHEMAS)],
                        capture_output=True, text=True, timeout=120)
    assert (ok.returncode, ok.stdout) == (0, "")


@pytest.mark.parametrize("name", sorted(schemas.DOCUMENTS))
def test_each_schema_is_draft_2020_12_closed_and_describes_every_field(name: str) -> None:
    schema = json.loads((SCHEMAS / f"{name}.json").read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)
    undescribed, open_objects = [], []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "properties" in node:
                undescribed.extend(f"{path}.{k}" for k, v in node["properties"].items() if not v.get("description"))
                if "additionalProperties" not in node:
                    open_objects.append(path)
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(schema, name)
    assert (undescribed, open_objects) == ([], [])


# -- real documents, and broken copies of them ---------------------------------------------------------
def _anomaly_as_stored(a: Anomaly, rec: Recommendation | None = None) -> dict[str, Any]:
    """As the service stores it (detectors/service.py _write_anomaly)."""
    d = json.loads(a.to_json())
    if rec is not None:
        d["recommendation"] = {k: rec.to_dict()[k] for k in ("id", "action", "checkpoint_step", "skip_steps")}
    return {**d, "first_seen": 1.8e9, "last_seen": 1.8e9 + 5}


SPIKE = Anomaly("loss_spike", "warning", 400, "loss 6.0 at step 400", evidence={"z": 11.2, "loss": float("nan")},
                end_step=402, status="resolved")
REC = Recommendation(id=f"rec:{SPIKE.id}", run="r", anomaly_id=SPIKE.id, kind="loss_spike", action="rollback",
                     onset_step=400, current_step=420, checkpoint_step=300, skip_steps=(380, 402),
                     cost={"gpu_hours": 1.5, "usd": None}, reasoning=["why"], summary="Roll back.")


def _incident() -> dict[str, Any]:
    g = IncidentGrouper(lambda step: 1.8e9 + step, lambda step: {
        "step": step - 1, "consumed_samples": 100, "batch_index": None, "sample_indices": {"0": [[800, 804], 17],
                                                                                          "1": [[804, 808]]},
        "samples_entry": f"1-{step}"})
    inc = {"incident": SPIKE.id}
    (out,) = g.update([Anomaly("loss_spike", "warning", 400, "spike", evidence=inc)], [REC]).values()
    return {**out.to_dict(), "first_seen": 1.8e9, "last_seen": 1.8e9}


def _webhook() -> dict[str, Any]:
    alerts = (Alert.from_transition("r", "opened", _anomaly_as_stored(SPIKE, REC)),
              service_down_alert(ServiceCheck(down=True, service_age_s=75.0, runs_sending=("r",)), 1.8e9))
    n = Notification(group_key='root:{run="r"}', route="root", receivers=("hook",), group_labels={"run": "r"}, seq=1,
                     at=1.8e9, reason="new", firing=alerts)
    from trainhealth.alerts.sinks.base import dumps

    return json.loads(dumps(webhook_payload(n, n.idempotency_key("hook"), "hook", "http://dash:8501")))


def _monitor_records(r: redis.Redis) -> tuple[list[Any], list[dict[str, str]], list[bytes]]:
    """A real Monitor's step records, events and heartbeat."""
    mon = Monitor("schemas", client=r, rank=3, world_size=4, flush_interval=0.01, heartbeat_interval=0.05)
    for s in range(3):
        with mon.step(s), mon.section("data"):
            pass
        mon.log_step(s, loss=float("nan") if s == 2 else 2.5, tokens=512, skipped=s == 1, consumed_samples=8 * s)
    with mon.checkpoint_save(2):
        pass
    assert mon.flush(10)
    deadline = time.monotonic() + 10
    while not r.hget("th:{schemas}:hb", "3") and time.monotonic() < deadline:
        time.sleep(0.05)
    mon.close()
    recs = [f[b"recs"] for _, f in r.xrange("th:{schemas}:steps")]
    events = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange("th:{schemas}:events")]
    return recs, events, [r.hget("th:{schemas}:hb", "3")]


#: Per document: a real one, and where a mutation breaks it: the path of a closed object, of a required key and of
#: a value given a wrong type or value.
CASES: dict[str, tuple[Callable[..., Any], tuple, tuple, tuple, Any]] = {
    "anomaly": (lambda: _anomaly_as_stored(SPIKE, REC), (), ("first_seen",), ("severity",), "major"),
    "recommendation": (lambda: {**REC.to_dict(), "status": "proposed", "created_at": 1.8e9, "updated_at": 1.8e9,
                                "history": [{"t": 1.8e9, "status": "proposed", "by": "", "note": ""}]},
                       ("history", 0), ("action",), ("status",), "done"),
    "incident": (_incident, ("data_position",), ("anomalies",), ("kind",), "loss_spikes"),
    "job-state": (lambda: json.loads(JobState("hung", 1.8e9, 29, Culprit(3, "n-1", 42, 29, "stopped"), "hung",
                                              0).to_json()), ("culprit",), ("since",), ("state",), "stuck"),
    "webhook-payload": (_webhook, ("alerts", 0, "labels"), ("idempotency_key",), ("alerts", 1, "anomaly", "kind"),
                        "service_up"),
}


def _at(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _broken(doc: Any, closed: tuple, required: tuple, wrong: tuple, value: Any) -> list[tuple[str, Any]]:
    extra = copy.deepcopy(doc)
    _at(extra, closed)["not_in_the_schema"] = 1
    missing = copy.deepcopy(doc)
    del _at(missing, required[:-1])[required[-1]]
    bad = copy.deepcopy(doc)
    _at(bad, wrong[:-1])[wrong[-1]] = value
    retyped = copy.deepcopy(doc)
    _at(retyped, wrong[:-1])[wrong[-1]] = [value]
    return [("an unknown field", extra), ("a required field missing", missing), (f"{wrong[-1]}={value!r}", bad),
            (f"{wrong[-1]} a list", retyped)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_documents_of_the_code_validate_and_broken_copies_do_not(name: str) -> None:
    make, *where = CASES[name]
    doc = make()
    assert errors(name, doc) == []
    for what, broken in _broken(doc, *where):
        assert errors(name, broken), f"{name} with {what} passes its schema"


def test_analyze_reports_validate_and_broken_copies_do_not(real_logs: Path) -> None:
    reports = analyze_report.analyze_paths([real_logs / TROCR, real_logs / WORD_LM])
    doc = json.loads(analyze_report.to_json(reports))
    assert errors("analyze-report", doc) == []
    assert doc["files"][1]["goodput"]["ledger"] is not None  # the ledger snapshot is checked too
    assert errors("ledger-snapshot", doc["files"][1]["goodput"]["ledger"]) == []
    for what, broken in _broken(doc, ("files", 0, "summary"), ("files", 1, "goodput"),
                                ("files", 0, "anomalies", 0, "severity"), "loud"):
        assert errors("analyze-report", broken), what
    for what, broken in _broken(doc["files"][1]["goodput"]["ledger"], ("seconds",), ("seconds", "hang"),
                                ("records_dropped", "total"), "none"):
        assert errors("ledger-snapshot", broken), what


def test_a_monitors_records_validate_and_broken_copies_do_not(r: redis.Redis) -> None:
    recs, events, beats = _monitor_records(r)
    assert [json.loads(b) for b in recs] and beats[0] is not None
    for body in recs:
        assert errors("step-records", json.loads(body)) == []
    assert [e["kind"] for e in events] == ["run_start", "checkpoint_save", "run_end"]
    for e in events:
        assert errors("event", e) == []
    beat = json.loads(beats[0])
    assert errors("heartbeat", beat) == []
    rec = json.loads(recs[0])
    for what, broken in [*_broken(rec, (0,), (0, "t"), (0, "rank"), -1),
                         ("a section that is not a number", [{**rec[0], "sec.data": "fast"}]),
                         ("a null value (the wire leaves it out)", [{**rec[0], "loss": None}]),
                         ("skipped=2", [{**rec[0], "skipped": 2}])]:
        assert errors("step-records", broken), what
    for what, broken in [*_broken(events[1], (), ("kind",), ("kind",), "checkpoint"),
                         ("a time that is not a number", {**events[1], "t": "yesterday"})]:
        assert errors("event", broken), what
    for what, broken in [*_broken(beat, ("mem",), ("pid",), ("phase",), "eval"),
                         ("both cuda and cuda_absent", {**beat, "mem": {**beat["mem"], "cuda": {"device": 0,
                                                                                               "total": 1},
                                                                    "cuda_absent": "no CUDA device"}}),
                         ("a GPU sample with neither device nor absent", {**beat, "gpu": {"temp_c": 80}})]:
        assert errors("heartbeat", broken), what
