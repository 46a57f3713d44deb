"""Why a rank (or a node's ranks) is slow, from its GPUs' health beside the others': clocks held down, the reasons
NVML gives, heat, ECC errors (the samples of :mod:`trainhealth.collectors.gpu_health`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from statistics import median
from typing import Any

#: A rank's SM clock below this share of the others' median is held down.
CLOCK_RATIO = 0.9
#: Degrees Celsius above the others' median that make a GPU hot.
HOT_DELTA_C = 10.0
#: Reasons that explain nothing (an idle GPU waits for others; the display is not training).
_BENIGN = frozenset({"idle", "display clock setting"})


def explain(ranks: Iterable[int], samples: Mapping[int, Mapping[str, Any]], who: str) -> dict[str, Any] | None:
    """What the GPUs of ``ranks`` show beside the other ranks' (``samples``: rank → its latest GPU sample);
    None when either side has no sample.

    Returns ``{"text", "abnormal", "sm_clock_mhz", "others_sm_clock_mhz", "temp_c", "others_temp_c", "throttle",
    "ecc_uncorrected"}``: ``abnormal`` when the clocks are held below :data:`CLOCK_RATIO` of the others', a reason
    the others do not share holds them, the GPU runs :data:`HOT_DELTA_C` hotter, or it counts uncorrected ECC errors
    the others do not; ``text`` says it in words (``who`` names the ranks: "rank 13", "node-b's ranks 8-15"), or
    that the GPUs look like the others' — then the cause is elsewhere (the host, data loading, the network).

    Examples
    --------
    >>> ok = {"sm_clock_mhz": 1980, "temp_c": 64, "throttle": ["power cap (software)"], "ecc_uncorrected": 0}
    >>> hot = {"sm_clock_mhz": 1210, "temp_c": 87, "throttle": ["power cap (software)", "thermal slowdown (hardware)"],
    ...        "ecc_uncorrected": 0}
    >>> print(explain([13], {12: ok, 13: hot, 14: ok}, "rank 13")["text"])
    rank 13: SM clock 1,210 MHz vs 1,980 MHz on the others, held down by thermal slowdown (hardware), 87 °C
    (others 64 °C)
    >>> explain([12], {12: ok, 13: ok}, "rank 12")["text"]
    "rank 12's GPU looks like the others' (SM clock 1,980 MHz, 64 °C, no throttle reason of its own): the cause is \
elsewhere (the host, data loading, the network)"
    """
    mine = [samples[r] for r in ranks if r in samples and "sm_clock_mhz" in samples[r]]
    theirs = [s for r, s in samples.items() if r not in set(ranks) and "sm_clock_mhz" in s]
    if not mine or not theirs:
        return None
    clock = median(float(s["sm_clock_mhz"]) for s in mine)
    others_clock = median(float(s["sm_clock_mhz"]) for s in theirs)
    temps = [float(s["temp_c"]) for s in mine if "temp_c" in s]
    others_temps = [float(s["temp_c"]) for s in theirs if "temp_c" in s]
    temp = max(temps) if temps else None
    others_temp = median(others_temps) if others_temps else None
    common = {name for name in {n for s in theirs for n in s.get("throttle", ())}
              if sum(name in s.get("throttle", ()) for s in theirs) * 2 >= len(theirs)}
    reasons = sorted({n for s in mine for n in s.get("throttle", ())} - common - _BENIGN)
    ecc = max((int(s.get("ecc_uncorrected") or 0) for s in mine), default=0)
    others_ecc = median(int(s.get("ecc_uncorrected") or 0) for s in theirs)
    slow = clock < CLOCK_RATIO * others_clock
    hot = temp is not None and others_temp is not None and temp >= others_temp + HOT_DELTA_C
    bad_ecc = ecc > others_ecc
    parts = []
    if slow:
        parts.append(f"SM clock {clock:,.0f} MHz vs {others_clock:,.0f} MHz on the others")
    if reasons:
        parts.append("held down by " + ", ".join(reasons))
    if hot:
        parts.append(f"{temp:.0f} °C (others {others_temp:.0f} °C)")
    if bad_ecc:
        parts.append(f"{ecc} uncorrected ECC error{'s' if ecc != 1 else ''} (a failing GPU: drain the node)")
    abnormal = bool(parts)
    if abnormal:
        text = f"{who}: " + ", ".join(parts)
    else:
        t = f", {temp:.0f} °C" if temp is not None else ""
        text = (f"{who}'s GPU looks like the others' (SM clock {clock:,.0f} MHz{t}, no throttle reason of its own): "
                "the cause is elsewhere (the host, data loading, the network)")
    return {"text": text, "abnormal": abnormal, "sm_clock_mhz": clock, "others_sm_clock_mhz": others_clock,
            "temp_c": temp, "others_temp_c": others_temp, "throttle": reasons, "ecc_uncorrected": ecc}
