"""A run's own detector settings: checked where the job gives them (Monitor, init()'s environment), carried in the
run's meta, and the detector service building that run's detectors with them — on a real redis-server."""

from __future__ import annotations

import json
import logging
import math
import random

import pytest
import redis

from trainhealth import Monitor, init, tuning
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.pipeline import RunPipeline
from trainhealth.detectors.plateau import PlateauDetector
from trainhealth.detectors.service import DetectorService
from trainhealth.exceptions import ConfigError

T0 = 1_800_000_000.0
#: A plateau judged on a short stretch, and a straggler only below a score of 0.4.
TUNED = {"plateau": {"min_steps": 100, "min_points": 30, "run_fraction": 0.25}, "straggler": {"threshold": 0.4}}


def write_run(client: redis.Redis, run: str, settings: dict | None, steps: int = 400) -> None:
    """Two ranks through real Monitors: a loss flat at 2.0 (0.5 % noise) at a held learning rate from the start,
    rank 1's section twice rank 0's (score 0.5); 1-s steps from T0 + 10."""
    mons = [Monitor(run, client=client, rank=r, world_size=2, host=f"node-{r}", started_at=T0, flush_interval=0.01,
                    detector_settings=settings) for r in range(2)]
    rng = random.Random(3)
    for s in range(steps):
        loss = 2.0 * math.exp(rng.gauss(0.0, 0.005))
        for r, mon in enumerate(mons):
            mon._sections = {"data": 0.01, "forward_backward": 0.1 * (r + 1)}  # as timed by mon.section()
            mon.log_step(s, loss=loss, grad_norm=1.0, lr=3e-4, tokens=1000, timestamp=T0 + 10 + s)
    for mon in mons:
        assert mon.flush(10)
        mon._sender.stop(1)


def drain(service: DetectorService, rounds: int = 50) -> None:
    for _ in range(rounds):
        if service.run_once(block_ms=20) == 0:
            break


def anomalies(r: redis.Redis, run: str) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in r.hgetall(f"th:{{{run}}}:anomalies").items()}


def service(r: redis.Redis, clock: list[float]) -> DetectorService:
    return DetectorService(r, consumer="t", clock=lambda: clock[0], hang_factory=lambda: HangDetector(floor_s=1e9))


def test_the_service_builds_a_runs_detectors_with_its_own_settings(r: redis.Redis, caplog) -> None:
    write_run(r, "tuned", TUNED)
    write_run(r, "plain", None)
    # Rank 0's settings, as checked, in the run's meta; a run without any has no such field.
    assert json.loads(r.hget("th:{tuned}:meta", "detector_settings")) == {
        "plateau": {"min_steps": 100, "min_points": 30, "run_fraction": 0.25}, "straggler": {"threshold": 0.4}}
    assert r.hget("th:{plain}:meta", "detector_settings") is None
    clock = [T0 + 500]
    with caplog.at_level(logging.INFO, logger="trainhealth.detectors.service"):
        drain(service(r, clock))
    said = [m.getMessage() for m in caplog.records if "own settings" in m.getMessage()]
    assert said == ["run tuned: detectors built with the run's own settings: plateau.min_steps=100 (default 500), "
                    "plateau.min_points=30 (default 100), plateau.run_fraction=0.25 (default 0.333333), "
                    "straggler.threshold=0.4 (default 0.8)"]
    # The defaults: rank 1 at half rank 0's speed is a straggler; 400 flat steps are too few for a plateau (500).
    assert sorted(anomalies(r, "plain")) == ["straggler:1:0:0"]
    # Tuned: a score of 0.5 is above 0.4, no straggler; the flat loss is a plateau on a 100-step stretch.
    tuned = anomalies(r, "tuned")
    assert sorted(tuned) == ["plateau:*:24:0"]
    p = tuned["plateau:*:24:0"]
    assert (p["status"], p["evidence"]["first_step"], p["evidence"]["last_step"]) == ("active", 299, 399)
    assert (p["evidence"]["points"], p["evidence"]["min_gain"]) == (101, 0.01)


def test_settings_written_after_the_run_was_attached_rebuild_its_detectors(r: redis.Redis, caplog) -> None:
    # Another rank registered the run before rank 0 wrote its settings: the service took it with the defaults,
    # then finds them at its next look at the meta (every 5 s) and rebuilds the run from its streams.
    write_run(r, "late", None)
    clock = [T0 + 500]
    svc = service(r, clock)
    drain(svc)
    assert sorted(anomalies(r, "late")) == ["straggler:1:0:0"]
    r.hset("th:{late}:meta", "detector_settings", json.dumps(TUNED))
    clock[0] += 10
    with caplog.at_level(logging.INFO, logger="trainhealth.detectors.service"):
        drain(svc)
    assert "run late: its detector settings changed; rebuilding its state with them" in caplog.text
    assert svc.runs["late"].pipeline.settings == TUNED
    assert svc.runs["late"].pipeline.straggler.threshold == 0.4
    got = anomalies(r, "late")
    assert sorted(got) == ["plateau:*:24:0", "straggler:1:0:0"]
    assert got["plateau:*:24:0"]["status"] == "active"
    # The straggler the defaults found is resolved by the rebuild (the run's threshold never opens it).
    st = got["straggler:1:0:0"]
    assert (st["status"], st["end_step"]) == ("resolved", 399)
    assert st["message"].endswith("since step 0; every rank waits for it at the all-reduce; not found with the run's "
                                  "changed detector settings")
    assert [(f[b"transition"], f[b"id"]) for _, f in r.xrange("th:{late}:anomaly_log")][-1] == (
        b"resolved", b"straggler:1:0:0")


def test_settings_the_service_cannot_read_are_warned_once_and_the_defaults_apply(r: redis.Redis, caplog) -> None:
    write_run(r, "odd", None)
    r.hset("th:{odd}:meta", "detector_settings", '{"plateau": {"min_steps": -5}}')
    clock = [T0 + 500]
    svc = service(r, clock)
    with caplog.at_level(logging.WARNING, logger="trainhealth.detectors.service"):
        drain(svc)
        clock[0] += 10
        drain(svc)
    warned = [m.getMessage() for m in caplog.records if "detector settings" in m.getMessage()]
    assert warned == ["run odd: ignoring its detector settings, the defaults apply: th:{odd}:meta "
                      "detector_settings[\"plateau\"][\"min_steps\"]=-5 must be an integer in [10, 1000000000] "
                      "(fewest steps in the stretch (steps))"]
    assert svc.runs["odd"].pipeline.settings == {}
    assert sorted(anomalies(r, "odd")) == ["straggler:1:0:0"]


@pytest.mark.parametrize(("settings", "message"), [
    ({"memory_growht": {"window_s": 60}},
     "detector_settings[\"memory_growht\"] is not a detector with tunable settings (one of hang, memory_growth, "
     "plateau, straggler)"),
    ({"memory_growth": {"window": 60}},
     "detector_settings[\"memory_growth\"][\"window\"] is not a tunable parameter of memory_growth (tunable: "
     "window_s, min_span_s, min_samples, bucket_s, min_growth_frac)"),
    ({"memory_growth": {"bucket_s": 0}},
     "detector_settings[\"memory_growth\"][\"bucket_s\"]=0 must be a number in [0.5, 86400] (seconds of samples "
     "whose lowest is one point of the trend (s))"),
    ({"memory_growth": {"window_s": float("nan")}},
     "detector_settings[\"memory_growth\"][\"window_s\"]=nan must be a number in [10, 604800] (window of the "
     "memory trend (s))"),
    ({"plateau": {"min_points": True}},
     "detector_settings[\"plateau\"][\"min_points\"]=True must be an integer in [9, 6000] (fewest logged points in "
     "the stretch)"),
    ({"straggler": {"threshold": "0.5"}},
     "detector_settings[\"straggler\"][\"threshold\"]='0.5' must be a number in [0.05, 0.99] (relative score "
     "(fastest rank's median section time / the rank's) below which a rank is slow; the slow node's too)"),
    ({"memory_growth": {"window_s": 60}},
     "detector_settings[\"memory_growth\"]: min_span_s=600 is above window_s=60: the trend could never be judged"),
    ({"hang": 30}, "detector_settings[\"hang\"]=30 must be a mapping: parameter -> value"),
    ([("hang", {})], "detector_settings=[('hang', {})] must be a mapping: detector -> {parameter: value}"),
])
def test_a_bad_setting_is_refused_at_monitor_creation_naming_field_and_value(settings, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        Monitor("bad-settings", rank=0, world_size=1, detector_settings=settings, enabled=False)
    assert str(e.value) == message


def test_init_reads_them_from_the_environment_and_names_the_variable() -> None:
    env = {"TRAINHEALTH_RUN_ID": "env-settings", "TRAINHEALTH_MODE": "disabled",
           "TRAINHEALTH_DETECTOR_SETTINGS": '{"hang": {"floor_s": 0.1}}'}
    with pytest.raises(ConfigError) as e:
        init(env=env)
    assert str(e.value) == ("environment TRAINHEALTH_DETECTOR_SETTINGS='{\"hang\": {\"floor_s\": 0.1}}': "
                            "detector_settings[\"hang\"][\"floor_s\"]=0.1 must be a number in [1, 604800] (shortest "
                            "progress timeout (s): no step completed for this long at the least)")
    with pytest.raises(ConfigError) as e:
        init(env={**env, "TRAINHEALTH_DETECTOR_SETTINGS": "{hang: 1}"})
    assert str(e.value).startswith("environment TRAINHEALTH_DETECTOR_SETTINGS='{hang: 1}' is not JSON (Expecting "
                                   "property name enclosed in double quotes")
    mon = init(env={**env, "TRAINHEALTH_DETECTOR_SETTINGS": '{"hang": {"floor_s": 45}}'})
    mon.close()
    # The argument wins over the environment, as every init() setting.
    mon = init(env=env, detector_settings={"hang": {"floor_s": 45}})
    mon.close()


def test_the_pipeline_builds_each_tunable_detector_with_its_settings() -> None:
    settings = tuning.validate({"memory_growth": {"window_s": 120, "min_span_s": 30, "min_samples": 10,
                                                  "bucket_s": 5, "min_growth_frac": 0.001},
                                "plateau": {"min_steps": 200, "min_points": 60, "run_fraction": 0.15,
                                            "min_gain": 0.02},
                                "straggler": {"threshold": 0.7, "window": 40, "min_windows": 3},
                                "hang": {"floor_s": 45}})
    pipe = RunPipeline(4, hang=HangDetector(floor_s=30.0, checkpoint_s=900.0), settings=settings)
    mg = pipe.memory_growth
    assert (mg.window_s, mg.min_span_s, mg.min_samples, mg.bucket_s, mg.min_growth_frac) == (120, 30, 10, 5, 0.001)
    [plateau] = [d for d in pipe.step_detectors if isinstance(d, PlateauDetector)]
    assert (plateau.min_steps, plateau.min_points, plateau.run_fraction, plateau.min_gain) == (200, 60, 0.15, 0.02)
    st, sn = pipe.straggler, pipe.slow_node
    assert (st.threshold, st.window, st.min_windows, sn.threshold, sn.window) == (0.7, 40, 3, 0.7, 40)
    # The run's floor over the service's (--hang-floor), the rest of the service's hang detector kept.
    assert (pipe.hang.floor_s, pipe.hang.checkpoint_s, pipe.hang.progress.floor_s) == (45.0, 900.0, 45.0)
    assert RunPipeline(4).settings == {} and RunPipeline(4).memory_growth.min_span_s == 600.0
