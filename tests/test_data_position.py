"""Data position everywhere: the sample indices each rank consumed, from ``log_step(sample_indices=)`` through the wire,
the detector service's ``th:{run}:samples`` and the incident's data position to a rollback's exact skip (``trainhealth
advise --format skip-json|indices``, the dashboard card's downloads); on a real redis-server."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import streamlit.testing.v1.app_test as app_test
from jsonschema import Draft202012Validator
from streamlit.runtime.media_file_manager import MediaFileManager
from streamlit.testing.v1 import AppTest

from trainhealth import Monitor, defaults
from trainhealth.detectors import pipeline
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.service import DetectorService
from trainhealth.exceptions import ConfigError
from trainhealth.keys import run_keys
from trainhealth.samples import dumps, skip_document
from trainhealth.wire import StepRecord, count_indices, decode_step_rows, decode_steps, encode_indices, expand_indices

T0 = 1_800_000_000.0
ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "dashboard" / "app.py"
DIV = "rec:divergence:*:400:0"


def drain(svc: DetectorService, rounds: int = 60) -> None:
    for _ in range(rounds):
        if svc.run_once(block_ms=10) == 0:
            break


def service(r: redis.Redis, consumer: str = "t") -> DetectorService:
    return DetectorService(r, consumer=consumer, clock=lambda: T0 + 1000,
                           hang_factory=lambda: HangDetector(floor_s=1e9))


def indices_of(step: int, rank: int) -> list[int] | None:
    """What rank ``rank`` consumed in ``step``: the step's 8 samples dealt out as ``DistributedSampler`` deals them to
    2 ranks (rank r takes every second one from r); rank 1 logs none at step 450."""
    if rank == 1 and step == 450:
        return None
    return [step * 8 + rank + 2 * j for j in range(4)]


def two_rank_run(r: redis.Redis, run: str, *, timestamps: bool = True) -> list[Monitor]:
    """Two ranks, 560 steps of 8 samples (4 a rank): the loss jumps from 3 to 6 at step 400 and stays (a divergence
    100 steps later); checkpoints after every 100th step; consumed samples, batch index and sample indices logged."""
    mons = [Monitor(run, client=r, rank=k, world_size=2, host=f"node-{k}", started_at=T0 if timestamps else None,
                    gpu_hour_usd=2.0, flush_interval=0.01) for k in range(2)]
    for s in range(560):
        loss = (3.0 if s < 400 else 6.0) + 0.001 * (s % 7)
        for k, mon in enumerate(mons):
            mon.log_step(s, loss=loss, tokens=1000, consumed_samples=(s + 1) * 8, batch_index=s,
                         sample_indices=indices_of(s, k), timestamp=T0 + 10 + s if timestamps else None)
            if (s + 1) % 100 == 0:
                mon.checkpoint_saved(s, 1.0)
    for mon in mons:
        assert mon.flush(10)
    return mons


def expected_skip(run: str) -> dict[str, Any]:
    """The exact skip of the divergence's rollback: checkpoint 299, steps 300-600 (the run reached 559)."""
    reached = range(300, 560)
    by_rank = {str(k): [i for s in reached for i in (indices_of(s, k) or [])] for k in range(2)}
    return {"version": 1, "run": run, "recommendation": DIV, "action": "rollback", "resume_from_step": 299,
            "skip_steps": [300, 600], "skip_samples": [2400, 4808], "skip_batches": [300, 601],
            "indices_steps": [300, 559], "sample_indices": sorted(by_rank["0"] + by_rank["1"]),
            "sample_indices_by_rank": by_rank, "steps_without_indices": [[450, 450]]}


# -- the encoding ------------------------------------------------------------------------------------------
def test_indices_are_encoded_as_ranges_where_equally_spaced_and_expand_back_exactly() -> None:
    shuffled = [9, 2, 7, 7, 0]
    assert encode_indices(shuffled) == [9, 2, 7, 7, 0]  # nothing to shorten: as given, order and repeats kept
    assert encode_indices([5, 6]) == [5, 6]  # two in a row: a range would not be shorter
    assert encode_indices([0, 1, 2, 10, 13, 16, 19, 4]) == [[0, 3], [10, 22, 3], 4]
    assert encode_indices(range(0, 10_000, 4)) == [[0, 10_000, 4]]
    assert encode_indices(np.arange(100, 164)) == [[100, 164]]
    assert encode_indices([np.int64(3), np.int32(4), np.int16(5)]) == [[3, 6]]
    for values in (shuffled, [0, 1, 2, 10, 13, 16, 19, 4], list(range(0, 10_000, 4)), [2**53 - 1, 0]):
        enc = encode_indices(values)
        assert expand_indices(enc) == values and count_indices(enc) == len(values)


def test_the_encoding_finds_the_same_runs_as_a_plain_left_to_right_scan() -> None:
    def scan(vals: list[int]) -> list:
        out: list = []
        i = 0
        while i < len(vals):
            if i + 2 < len(vals) and (d := vals[i + 1] - vals[i]) > 0 and vals[i + 2] - vals[i + 1] == d:
                j = i + 2
                while j + 1 < len(vals) and vals[j + 1] - vals[j] == d:
                    j += 1
                out.append([vals[i], vals[j] + d] if d == 1 else [vals[i], vals[j] + d, d])
                i = j + 1
            else:
                out.append(vals[i])
                i += 1
        return out

    rng = np.random.default_rng(7)
    for _ in range(5000):  # runs up, down, flat and lone indices, mixed
        vals: list[int] = []
        while len(vals) < rng.integers(0, 30):
            start, stride, length = int(rng.integers(0, 50)), int(rng.integers(-2, 4)), int(rng.integers(1, 7))
            vals += [start + stride * k for k in range(length) if start + stride * k >= 0]
        assert encode_indices(vals) == scan(vals)
        assert expand_indices(encode_indices(vals)) == vals


@pytest.mark.parametrize(("values", "message"), [
    ([1, 2.0], "sample index 1 is 2.0, not an integer"),
    ([True], "sample index 0 is True, not an integer"),
    ([4, -1], "sample index 1 is -1, not in 0..9007199254740991"),
    ([2**53], "sample index 0 is 9007199254740992, not in 0..9007199254740991"),
    (range(0, 16_385), "16,385 sample indices, more than the 16,384 a rank logs per step"),
    (list(range(16_385)), "more than the 16,384 sample indices a rank logs per step"),
])
def test_bad_indices_are_refused_naming_the_position_and_value(values: Any, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        encode_indices(values)
    assert str(exc.value) == message


def test_a_record_with_bad_indices_is_malformed_naming_the_field() -> None:
    good = {"rank": 0, "step": 1, "inc": 1.0, "t": 2.0, "sample_indices": [[0, 4], 9]}
    bad = {**good, "step": 2, "sample_indices": [[4, 0]]}
    huge = {**good, "step": 3, "sample_indices": [[0, 16_385]]}
    body = json.dumps([good, bad, huge]).encode()
    errors: list[tuple[int, str]] = []
    rows = decode_step_rows({b"recs": body}, ("data",), on_bad=lambda i, e: errors.append((i, str(e))))
    assert [row[-1]["sample_indices"] for row in rows] == [[[0, 4], 9]]
    assert errors == [
        (1, "record 1: field 'sample_indices': sample indices item 0 is [4, 0], not an index or a [start, stop(, "
            "step)] range with 0 <= start < stop <= 9007199254740992 and step >= 1"),
        (2, "record 2: field 'sample_indices' holds 16,385 indices, more than 16,384")]


# -- the collector --------------------------------------------------------------------------------------------
def test_monitor_sends_each_steps_indices_compactly_and_refuses_too_many_with_one_warning(
        r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    mon = Monitor("idx", client=r, rank=1, world_size=2, flush_interval=0.01)
    reused = [10, 11, 12, 40]
    mon.log_step(0, loss=1.0, sample_indices=range(64, 128))  # a sampler's contiguous slice
    mon.log_step(1, loss=1.0, sample_indices=reused)
    reused[:] = [0, 0, 0, 0]  # the caller reuses its list: what was logged stays
    mon.log_step(2, loss=1.0, sample_indices=np.array([1, 3, 5, 7, 100]))
    mon.log_step(3, loss=1.0, sample_indices=list(range(defaults.SAMPLE_INDICES_MAX + 1)))
    mon.log_step(4, loss=1.0, sample_indices=[1, "x"])
    mon.log_step(5, loss=1.0, sample_indices=[])
    with mon.step(6):
        mon.log_step(6, sample_indices=(8, 9, 10))  # inside a timed step: the same record
    assert mon.flush(10)
    mon.close()
    (_, entry), *_ = r.xrange("th:{idx}:steps")
    assert json.loads(entry[b"recs"])[0]["sample_indices"] == [[64, 128]]
    recs = [x for _, f in r.xrange("th:{idx}:steps") for x in decode_steps(f)]
    assert [(x.step, x.sample_indices) for x in recs] == [
        (0, [[64, 128]]), (1, [[10, 13], 40]), (2, [[1, 9, 2], 100]), (3, None), (4, None), (5, []), (6, [[8, 11]])]
    assert recs[6].dur is not None and recs[6].loss is None
    warnings = [m.getMessage() for m in caplog.records if "sample_indices" in m.getMessage()]
    assert warnings == [
        "trainhealth collector: log_step(step=3, sample_indices=...): 16385 indices, more than the 16384 a rank logs "
        "per step (sample_indices_max); not recorded for this step and further ones this large",
        "trainhealth collector: log_step(sample_indices=...): sample index 1 is 'x', not an integer; not recorded"]


def test_the_cap_is_set_and_checked_when_the_monitor_is_made(r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    for bad, why in ((0, "sample_indices_max=0 must be an integer >= 1"),
                     (True, "sample_indices_max=True must be an integer >= 1"),
                     (16_385, "sample_indices_max=16385 must be at most 16384 (the detector service refuses a step "
                              "record with more)")):
        with pytest.raises(ConfigError) as exc:
            Monitor("cap", client=r, rank=0, world_size=1, sample_indices_max=bad)
        assert str(exc.value) == why
    caplog.set_level(logging.WARNING)
    mon = Monitor("cap", client=r, rank=0, world_size=1, flush_interval=0.01, sample_indices_max=4)
    mon.log_step(0, sample_indices=[1, 2, 3, 4])
    mon.log_step(1, sample_indices=[1, 2, 3, 4, 5])
    assert mon.flush(10)
    mon.close()
    assert [(x.step, x.sample_indices) for _, f in r.xrange("th:{cap}:steps") for x in decode_steps(f)] == [
        (0, [[1, 5]]), (1, None)]
    assert [m.getMessage() for m in caplog.records] == [
        "trainhealth collector: log_step(step=1, sample_indices=...): 5 indices, more than the 4 a rank logs per step "
        "(sample_indices_max); not recorded for this step and further ones this large"]


# -- the service, the incident ---------------------------------------------------------------------------------
def test_the_service_keeps_every_ranks_indices_per_step_and_the_incident_names_its_onset_steps(
        r: redis.Redis, valid_run) -> None:
    mons = two_rank_run(r, "dp")
    drain(service(r))
    key = run_keys("dp").samples
    assert key == "th:{dp}:samples"
    assert r.xlen(key) == 560
    entries = {i.decode(): {k.decode(): v.decode() for k, v in f.items()} for i, f in r.xrange(key, "1-449", "1-451")}
    assert entries == {
        "1-449": {"step": "449", "gen": "0", "n_ranks": "2", "ranks": '{"0":[[3592,3600,2]],"1":[[3593,3601,2]]}'},
        "1-450": {"step": "450", "gen": "0", "n_ranks": "2", "ranks": '{"0":[[3600,3608,2]]}'},
        "1-451": {"step": "451", "gen": "0", "n_ranks": "2", "ranks": '{"0":[[3608,3616,2]],"1":[[3609,3617,2]]}'}}
    (incident,) = [json.loads(v) for v in r.hvals("th:{dp}:incidents")]
    assert (incident["id"], incident["recommendation"]) == ("inc:loss_spike:*:400:0", DIV)
    # Where the data was when step 400 began, and what each rank trained on in it.
    assert incident["data_position"] == {"step": 399, "consumed_samples": 3200, "batch_index": 399,
                                         "sample_indices": {"0": [[3200, 3208, 2]], "1": [[3201, 3209, 2]]},
                                         "samples_entry": "1-400"}
    # A rebuild (a new service replaying the streams) writes none again.
    drain(service(r))
    assert r.xlen(key) == 560
    for mon in mons:
        mon._sender.stop(1)
    assert valid_run(r, "dp")["incident"] == 1


def test_an_onset_names_its_indices_inline_while_recent_and_small_else_their_entry() -> None:
    p = pipeline.RunPipeline(world_size=2, run="mem")
    for s in range(pipeline.SAMPLE_BODIES_KEPT + 10):
        for k in range(2):
            p.feed_step(StepRecord(rank=k, step=s, inc=T0, t=T0 + s, loss=3.0, sample_indices=[s * 2 + k]))
    newest = pipeline.SAMPLE_BODIES_KEPT + 9
    # No consumed samples or batch index logged: only what the onset step consumed.
    assert p.position_before(newest) == {"step": None, "consumed_samples": None, "batch_index": None,
                                         "sample_indices": {"0": [newest * 2], "1": [newest * 2 + 1]},
                                         "samples_entry": f"1-{newest}"}
    # The first 10 steps' indices are no longer held (the newest 1,024 are): the entry still says where they are.
    assert p.position_before(9) == {"step": None, "consumed_samples": None, "batch_index": None,
                                    "sample_indices": None, "samples_entry": "1-9"}
    assert p.position_before(10)["sample_indices"] == {"0": [20], "1": [21]}
    assert p.position_before(newest + 1) is None  # nothing logged at or before it: no data position


def test_the_samples_stream_is_bounded_in_bytes_and_large_onsets_are_referenced(
        r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    body = len('{"0":[[3592,3600,2]],"1":[[3593,3601,2]]}')  # every step's entry is this long (41 bytes)
    monkeypatch.setattr(defaults, "SAMPLE_INDICES_RETENTION_BYTES", 50 * body + 10)
    monkeypatch.setattr(pipeline, "INCIDENT_SAMPLE_INDICES_BYTES", 10)  # the onset's indices are "large"
    mons = two_rank_run(r, "dpb")
    drain(service(r))
    ids = [i.decode() for i, _ in r.xrange("th:{dpb}:samples")]
    assert ids == [f"1-{s}" for s in range(510, 560)]  # the newest 50 entries fit the bound
    (incident,) = [json.loads(v) for v in r.hvals("th:{dpb}:incidents")]
    assert incident["data_position"] == {"step": 399, "consumed_samples": 3200, "batch_index": 399,
                                         "sample_indices": None, "samples_entry": "1-400"}
    # Step 400's entry was trimmed: the skip says the steps of the rollback whose indices are gone.
    doc = json.loads(advise(redis_url, "dpb", "--format", "skip-json").stdout)
    assert doc["steps_without_indices"] == [[300, 509]]
    assert doc["sample_indices_by_rank"]["1"][:3] == [4081, 4083, 4085]
    for mon in mons:
        mon._sender.stop(1)


def advise(redis_url: str, *argv: str) -> subprocess.CompletedProcess:
    """``trainhealth advise ARGV`` as a user runs it."""
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    return subprocess.run([sys.executable, "-m", "trainhealth", "advise", *argv], env=env, capture_output=True,
                          text=True, timeout=60)


# -- the export -----------------------------------------------------------------------------------------------
def test_skip_documents_validate_against_their_schema_and_broken_copies_do_not() -> None:
    schema = json.loads((ROOT / "docs" / "schemas" / "skip.json").read_text())
    validator = Draft202012Validator(schema)
    doc = json.loads(json.dumps(expected_skip("r")))
    assert list(validator.iter_errors(doc)) == []
    broken = [{**doc, "extra": 1}, {k: v for k, v in doc.items() if k != "sample_indices"},
              {**doc, "skip_steps": [300]}, {**doc, "action": "pray"}, {**doc, "version": 2},
              {**doc, "sample_indices_by_rank": {"0": [1.5]}}, {**doc, "steps_without_indices": [[1, 2, 3]]}]
    assert [bool(list(validator.iter_errors(b))) for b in broken] == [True] * len(broken)
    none_logged = skip_document({"id": DIV, "run": "r", "action": "none_possible", "checkpoint_step": None,
                                 "skip_steps": [0, 200], "current_step": 150}, {})
    assert json.loads(dumps(none_logged)) == {
        "version": 1, "run": "r", "recommendation": DIV, "action": "none_possible", "resume_from_step": None,
        "skip_steps": [0, 200], "skip_samples": None, "skip_batches": None, "indices_steps": [0, 150],
        "sample_indices": None, "sample_indices_by_rank": None, "steps_without_indices": [[0, 150]]}
    assert list(validator.iter_errors(json.loads(dumps(none_logged)))) == []


def test_two_ranks_through_serve_to_the_exact_skip_for_megatron_and_a_loader(
        r: redis.Redis, redis_url: str, serve: subprocess.Popen, wait_for, tmp_path: Path) -> None:
    """End to end: two real collectors → redis-server → ``trainhealth serve`` → the divergence's rollback, exported
    by ``trainhealth advise`` as Megatron arguments, the exact skip JSON and the loader's skip list."""
    mons = two_rank_run(r, "e2e-dp", timestamps=False)

    def advised() -> dict | None:
        raw = r.hget("th:{e2e-dp}:recommendations", DIV)
        d = json.loads(raw) if raw else None
        return d if d is not None and d["current_step"] == 550 and r.xlen("th:{e2e-dp}:samples") == 560 else None

    rec = wait_for(advised, 120, "the divergence's rollback at step 550")
    assert (rec["action"], rec["checkpoint_step"], rec["skip_steps"]) == ("rollback", 299, [300, 600])
    megatron = advise(redis_url, "e2e-dp", "--id", DIV, "--format", "megatron")
    assert megatron.stdout == ("--ckpt-step 299 --train-range-to-skip 300 600 --iterations-to-skip "
                               + " ".join(map(str, range(300, 601))) + "\n")
    out = advise(redis_url, "e2e-dp", "--id", DIV, "--format", "skip-json")
    assert out.returncode == 0, out.stderr
    expected = expected_skip("e2e-dp")
    assert json.loads(out.stdout) == expected
    assert out.stdout.splitlines()[:3] == ["{", '  "version": 1,', '  "run": "e2e-dp",']
    assert len(expected["sample_indices"]) == 260 * 8 - 4  # rank 1's 4 of step 450 were not logged
    path = tmp_path / "skip_indices.txt"
    out = advise(redis_url, "e2e-dp", "--id", DIV, "--format", "indices", "-o", str(path))
    assert (out.returncode, out.stdout) == (0, f"wrote {path}\n")
    assert path.read_text() == "".join(f"{i}\n" for i in expected["sample_indices"])
    assert path.read_text().splitlines()[:3] == ["2400", "2401", "2402"]
    spike = advise(redis_url, "e2e-dp", "--id", "rec:loss_spike:*:400:0", "--format", "indices")
    assert spike.stdout.splitlines()[:2] == ["2400", "2401"]  # the superseded stage's skip: the same steps
    bad = advise(redis_url, "e2e-dp", "--format", "text", "-o", str(path))
    assert (bad.returncode, bad.stderr.strip()) == (
        2, f"trainhealth: error: --output='{path}' takes --format json, megatron, skip-json or indices")
    for mon in mons:
        mon.close()


def test_indices_format_says_when_the_job_logged_none(r: redis.Redis, redis_url: str) -> None:
    mon = Monitor("noidx", client=r, rank=0, world_size=1, started_at=T0, flush_interval=0.01)
    for s in range(560):
        mon.log_step(s, loss=(3.0 if s < 400 else 6.0) + 0.001 * (s % 7), timestamp=T0 + 10 + s)
        if (s + 1) % 100 == 0:
            mon.checkpoint_saved(s, 1.0)
    assert mon.flush(10)
    drain(service(r))
    out = advise(redis_url, "noidx", "--id", DIV, "--format", "indices")
    assert (out.returncode, out.stdout, out.stderr.strip()) == (
        2, "", "trainhealth: error: run 'noidx' logged no sample indices for steps 300-600 (log_step(sample_indices=) "
               "records them); --format skip-json has the step, sample and batch ranges")
    doc = json.loads(advise(redis_url, "noidx", "--id", DIV, "--format", "skip-json").stdout)
    assert (doc["sample_indices"], doc["skip_samples"], doc["steps_without_indices"]) == (None, None, [[300, 550]])
    mon._sender.stop(1)


def test_the_recommendation_card_downloads_the_exact_skip_and_the_skip_list(
        r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch, fresh_streamlit_caches: None) -> None:
    mons = two_rank_run(r, "card-dp")
    drain(service(r))
    managers: list[MediaFileManager] = []

    class Recording(MediaFileManager):  # AppTest's own, kept to read what a click would download
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            managers.append(self)

    monkeypatch.setattr(app_test, "MediaFileManager", Recording)
    monkeypatch.setenv("TRAINHEALTH_REDIS_URL", redis_url)
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params["run"] = "card-dp"
    at.run()
    assert not at.exception, at.exception
    buttons = {b.label: b.proto for b in at.get("download_button")}
    assert sorted(buttons) == ["Download skip.json", "Download skip_batches.json", "Download skip_indices.txt"]
    json_button, txt_button = buttons["Download skip.json"], buttons["Download skip_indices.txt"]
    assert (json_button.id.endswith(f"rec-overview-skip-json-{DIV}"), txt_button.deferred_file_id != "") == (True, True)

    def clicked(proto: Any) -> bytes:
        """What the browser downloads on a click: the deferred body, generated then."""
        url = managers[-1].execute_deferred(proto.deferred_file_id)
        return managers[-1].read_file(url.rsplit("/", 1)[1].split(".")[0]).content

    expected = expected_skip("card-dp")
    body = clicked(json_button)
    assert body == dumps(skip_document(json.loads(r.hget("th:{card-dp}:recommendations", DIV)),
                                       {s: (2, {str(k): encode_indices(v) for k in range(2)
                                                if (v := indices_of(s, k)) is not None})
                                        for s in range(300, 560)})).encode()
    assert json.loads(body) == expected
    assert body.startswith(b'{\n  "version": 1,\n  "run": "card-dp",\n  "recommendation": "rec:divergence:*:400:0",\n')
    assert clicked(txt_button) == "".join(f"{i}\n" for i in expected["sample_indices"]).encode()
    captions = [c.value for c in at.caption]
    assert "`skip_indices.txt`: those sample indices, one a line, for a data loader's skip list." in captions
    for mon in mons:
        mon.close()
