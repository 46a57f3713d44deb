"""GPU health (NVML, optional): absent without it, not an error; a straggler or slow node explains itself with its
GPUs' clocks, throttle reasons, heat and ECC errors beside the others'. The NVML path itself runs where a GPU is."""

from __future__ import annotations

import importlib.util
import json
import runpy
import time
from pathlib import Path

import pytest
import redis

from trainhealth.collectors import Monitor
from trainhealth.collectors.gpu_health import GpuHealthSampler
from trainhealth.detectors.pipeline import RunPipeline

_R = runpy.run_path(str(Path(__file__).with_name("test_rank_detectors.py")))
launch, host_of, healthy, run_steps, T0 = _R["launch"], _R["host_of"], _R["healthy"], _R["run_steps"], _R["T0"]

OK = {"device": 0, "sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980, "temp_c": 64, "power_w": 650.0,
      "power_limit_w": 700.0, "throttle": ["power cap (software)"], "throttle_bits": 4, "ecc_uncorrected": 0}
HOT = {**OK, "sm_clock_mhz": 1210, "temp_c": 88, "throttle": ["power cap (software)", "thermal slowdown (hardware)"],
       "throttle_bits": 0x44}


def test_without_nvml_the_sample_says_why_and_nothing_raises(r: redis.Redis, redis_url: str) -> None:
    s = GpuHealthSampler(0).sample()
    if importlib.util.find_spec("pynvml") is None:
        assert s == {"absent": "nvidia-ml-py not installed"}
    elif "absent" in s:  # the package without a driver: this machine
        assert s["absent"].startswith("NVML unavailable: ")
    else:
        pytest.skip("a GPU with NVML is present: the absent path is not reachable here")
    mon = Monitor("gpu-hb", redis_url=redis_url, rank=0, world_size=1, heartbeat_interval=0.1)
    try:
        deadline = time.monotonic() + 10
        while not r.hexists("th:{gpu-hb}:hb", "0") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(r.hget("th:{gpu-hb}:hb", "0"))["gpu"] == s
    finally:
        mon.close()


def test_nvml_where_a_gpu_is_present() -> None:
    if importlib.util.find_spec("pynvml") is None or "absent" in GpuHealthSampler(0).sample():
        pytest.skip("no NVML GPU on this machine: the NVML path runs where a GPU is present")
    s = GpuHealthSampler(0).sample()
    assert 0 < s["sm_clock_mhz"] <= s["sm_clock_max_mhz"] and 0 < s["temp_c"] < 120


def beats(now: float, world: int, hot: set[int]) -> dict[int, dict]:
    return {r: {"t": now, "step": 0, "step_t": now, "phase": "train", "host": host_of(8)(r), "pid": 1, "inc": T0,
                "gpu": HOT if r in hot else OK} for r in range(world)}


def test_a_straggler_whose_gpu_is_throttled_says_so() -> None:
    pipe = RunPipeline(16)
    launch(pipe, 16, host_of(8))
    pipe.check_heartbeats(T0, beats(T0, 16, hot={5}))
    base = healthy(16, seed=11)

    def busy(s: int, r: int) -> tuple[float, float]:
        fwd, data = base(s, r)
        return (fwd * 1.6 if r == 5 and 100 <= s < 220 else fwd), data
    got = run_steps(pipe, 16, range(300), busy)
    opened = next(a for a in got if a.kind == "straggler")
    assert opened.message.endswith("; rank 5: SM clock 1,210 MHz vs 1,980 MHz on the others, held down by thermal "
                                   "slowdown (hardware), 88 °C (others 64 °C)")
    assert opened.evidence["gpu"]["abnormal"] is True and opened.evidence["gpu"]["throttle"] == [
        "thermal slowdown (hardware)"]


def test_a_straggler_whose_gpu_looks_normal_points_elsewhere() -> None:
    pipe = RunPipeline(16)
    launch(pipe, 16, host_of(8))
    pipe.check_heartbeats(T0, beats(T0, 16, hot=set()))
    base = healthy(16, seed=11)

    def busy(s: int, r: int) -> tuple[float, float]:
        fwd, data = base(s, r)
        return (fwd * 1.6 if r == 5 and 100 <= s < 220 else fwd), data
    got = run_steps(pipe, 16, range(300), busy)
    opened = next(a for a in got if a.kind == "straggler")
    assert "SM clock" not in opened.message
    assert opened.evidence["gpu"]["text"] == ("rank 5's GPU looks like the others' (SM clock 1,980 MHz, 64 °C, no "
                                              "throttle reason of its own): the cause is elsewhere (the host, data "
                                              "loading, the network)")


def test_a_slow_node_with_hot_gpus_names_the_node() -> None:
    pipe = RunPipeline(32)
    launch(pipe, 32, host_of(8))
    pipe.check_heartbeats(T0, beats(T0, 32, hot=set(range(8, 16))))
    base = healthy(32, seed=12)

    def busy(s: int, r: int) -> tuple[float, float]:
        fwd, data = base(s, r)
        return (fwd * 1.5 if 8 <= r < 16 and 100 <= s < 220 else fwd), data
    got = run_steps(pipe, 32, range(300), busy)
    node = next(a for a in got if a.kind == "slow_node")
    assert node.hosts == ("node-b",)
    assert node.message.endswith("; node-b's ranks 8–15: SM clock 1,210 MHz vs 1,980 MHz on the others, held down by "
                                 "thermal slowdown (hardware), 88 °C (others 64 °C)")
