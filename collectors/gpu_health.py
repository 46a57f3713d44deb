"""The health of this rank's GPU, from NVML (``nvidia-ml-py``, optional): clocks, power, temperature, why the clocks
are held down, ECC errors. Sampled in the sender thread with each heartbeat (every 5 s): NVML queries take
microseconds and never touch the job's CUDA stream. Without the package, the driver's library, or a device, the
sample says why it is absent; nothing raises.

A straggler or a slow node then explains itself: "rank 13: SM clock 1,210 MHz vs 1,980 MHz on the others, held
down by thermal slowdown (hardware), 87 °C" (:mod:`trainhealth.detectors.gpu_health`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from trainhealth.wire import GpuSample

#: NVML's clock event ("throttle") reason bits, as ``nvml.h`` defines them, with their names in words.
THROTTLE_REASONS = {
    0x1: "idle",
    0x2: "application clock setting",
    0x4: "power cap (software)",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "thermal slowdown (software)",
    0x40: "thermal slowdown (hardware)",
    0x80: "power brake (hardware)",
    0x100: "display clock setting",
    0x200: "board limit",
    0x400: "reliability",
}


def throttle_names(bits: int) -> list[str]:
    """The reasons set in an NVML clock-event bit mask, in words.

    >>> throttle_names(0x44)
    ['power cap (software)', 'thermal slowdown (hardware)']
    """
    return [name for bit, name in THROTTLE_REASONS.items() if bits & bit]


_init_lock = threading.Lock()
_nvml: Any = None
_nvml_error: str | None = None


def _load() -> Any:
    """The initialised ``pynvml`` module, or None with the reason in ``_nvml_error`` (tried once per process)."""
    global _nvml, _nvml_error
    with _init_lock:
        if _nvml is not None or _nvml_error is not None:
            return _nvml
        try:
            import pynvml
        except ImportError:
            _nvml_error = "nvidia-ml-py not installed"
            return None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded / NoPermission ...
            _nvml_error = f"NVML unavailable: {exc}"
            return None
        _nvml = pynvml
        return _nvml


def visible_device(local_rank: int, env: dict[str, str] | None = None) -> str | int:
    """The NVML device of this rank: ``CUDA_VISIBLE_DEVICES``' entry ``local_rank`` (modulo its length) — an index or a
    UUID, as CUDA numbers the visible devices and NVML does not — else the index ``local_rank``.

    >>> visible_device(1, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}), visible_device(0, {"CUDA_VISIBLE_DEVICES": "GPU-9f2c"})
    (5, 'GPU-9f2c')
    >>> visible_device(3, {})
    3
    """
    env = os.environ if env is None else env
    raw = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not raw:
        return local_rank
    d = raw[local_rank % len(raw)]
    return int(d) if d.isdigit() else d


class GpuHealthSampler:
    """One sample of this rank's GPU per call (see the module doc).

    Parameters
    ----------
    local_rank : int
        The rank's index on its node (its device: :func:`visible_device`).

    Examples
    --------
    >>> s = GpuHealthSampler(0).sample()
    >>> "absent" in s or {"sm_clock_mhz", "sm_clock_max_mhz", "temp_c"} <= s.keys()
    True
    """

    def __init__(self, local_rank: int = 0) -> None:
        self.local_rank = local_rank
        self._handle: Any = None

    def sample(self) -> GpuSample:
        """``{"device", "sm_clock_mhz", "sm_clock_max_mhz", "power_w", "power_limit_w", "temp_c", "util_pct",
        "throttle": [reasons], "throttle_bits", "ecc_uncorrected"}`` (each part left out when the device does not
        report it), or ``{"absent": why}``."""
        nvml = _load()
        if nvml is None:
            return {"absent": _nvml_error or "NVML unavailable"}
        try:
            if self._handle is None:
                dev = visible_device(self.local_rank)
                if isinstance(dev, str):
                    self._handle = nvml.nvmlDeviceGetHandleByUUID(dev)
                else:
                    n = nvml.nvmlDeviceGetCount()
                    if n < 1:
                        return {"absent": "no GPU"}
                    self._handle = nvml.nvmlDeviceGetHandleByIndex(dev % n)
                self._device = dev
        except Exception as exc:
            return {"absent": f"NVML device unavailable: {exc}"}
        h = self._handle
        out: GpuSample = {"device": self._device}
        reads = (
            ("sm_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
            ("sm_clock_max_mhz", lambda: nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)),
            ("power_w", lambda: round(nvml.nvmlDeviceGetPowerUsage(h) / 1000.0, 1)),
            ("power_limit_w", lambda: round(nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, 1)),
            ("temp_c", lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            ("util_pct", lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            ("throttle_bits", lambda: int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))),
            ("ecc_uncorrected", lambda: nvml.nvmlDeviceGetTotalEccErrors(
                h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)),
        )
        for name, read in reads:
            try:
                out[name] = read()
            except Exception:  # NVML_ERROR_NOT_SUPPORTED on this device (ECC off, a consumer card): left out
                continue
        if "throttle_bits" in out:
            out["throttle"] = throttle_names(out["throttle_bits"])
        return out
