"""Per-run detector settings: the parameters a job may tune for its own run, and their check.

A job passes ``Monitor(..., detector_settings={"memory_growth": {"min_span_s": 60}})`` (or ``trainhealth.init()``
reads ``TRAINHEALTH_DETECTOR_SETTINGS``, a JSON object); rank 0's collector stores them in the run's meta
(``th:{run}:meta`` field ``detector_settings``, JSON) and the detector service builds that run's detectors with
them — the parameters of an alert rule, set per job (as a Prometheus rule's ``for:`` or a W&B alert's threshold):
a short job judged on shorter evidence, a noisy one on a looser threshold. What may be tuned is :data:`TUNABLE`;
anything else is refused, naming the field and its value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainhealth import defaults
from trainhealth.exceptions import ConfigError

#: The run's meta field (``th:{run}:meta``) holding its settings, a JSON object.
META_FIELD = "detector_settings"
#: The environment variable ``trainhealth.init()`` reads them from.
ENV = "TRAINHEALTH_DETECTOR_SETTINGS"


@dataclass(frozen=True)
class Tunable:
    """One tunable parameter: ``kind`` (``int`` or ``float``), the allowed range ``[low, high]`` (in the
    parameter's unit), its ``default`` (from :mod:`trainhealth.defaults`) and a ``doc`` line with the unit."""

    kind: type
    low: float
    high: float
    default: float
    doc: str


_DAY = 86400.0
#: detector (its anomaly kind) -> parameter (the detector's constructor argument) -> :class:`Tunable`.
TUNABLE: dict[str, dict[str, Tunable]] = {
    "memory_growth": {
        "window_s": Tunable(float, 10.0, 7 * _DAY, defaults.MEMORY_WINDOW_S, "window of the memory trend (s)"),
        "min_span_s": Tunable(float, 5.0, 7 * _DAY, defaults.MEMORY_MIN_SPAN_S,
                              "shortest span of samples judged (s); at most window_s"),
        "min_samples": Tunable(int, 3, 100_000, defaults.MEMORY_MIN_SAMPLES, "fewest samples judged"),
        "bucket_s": Tunable(float, 0.5, _DAY, defaults.MEMORY_BUCKET_S,
                            "seconds of samples whose lowest is one point of the trend (s)"),
        "min_growth_frac": Tunable(float, 1e-4, 1.0, defaults.MEMORY_GROWTH_FRAC,
                                   "growth over the window, as a fraction of the device's or host's memory"),
    },
    "plateau": {
        "min_steps": Tunable(int, 10, 10**9, defaults.PLATEAU_MIN_STEPS, "fewest steps in the stretch (steps)"),
        "min_points": Tunable(int, 9, defaults.PLATEAU_MAX_POINTS, defaults.PLATEAU_MIN_POINTS,
                              "fewest logged points in the stretch"),
        "run_fraction": Tunable(float, 0.01, 1.0, defaults.PLATEAU_RUN_FRACTION,
                                "the stretch judged, as a fraction of the steps since the first logged one"),
        "min_gain": Tunable(float, 1e-4, 0.5, defaults.PLATEAU_MIN_GAIN,
                            "relative loss improvement over the stretch below which it is no progress"),
    },
    "straggler": {
        "threshold": Tunable(float, 0.05, 0.99, defaults.STRAGGLER_THRESHOLD,
                             "relative score (fastest rank's median section time / the rank's) below which a "
                             "rank is slow; the slow node's too"),
        "window": Tunable(int, 4, 10_000, defaults.STRAGGLER_WINDOW_STEPS,
                          "steps per window (steps); the slow node's too"),
        "min_windows": Tunable(int, 1, 1000, defaults.STRAGGLER_MIN_WINDOWS, "windows in a row that open it"),
    },
    "hang": {
        "floor_s": Tunable(float, 1.0, 7 * _DAY, defaults.HANG_FLOOR_S,
                           "shortest progress timeout (s): no step completed for this long at the least"),
    },
}

#: Settings as checked: detector -> parameter -> value.
Settings = dict[str, dict[str, float | int]]


def validate(settings: Any, where: str = "detector_settings") -> Settings:
    """``settings`` checked against :data:`TUNABLE`: a new dict, detector -> parameter -> value (floats as
    ``float``). ``where`` names the settings in messages (an argument, a meta field).

    Raises
    ------
    ConfigError
        Not a mapping of mappings, an unknown detector or parameter, a value of the wrong type (an ``int``
        parameter given 2.5, a bool, a string), out of its range, or settings that can never fire
        (memory_growth's ``min_span_s`` above its ``window_s``), naming the field and its value.

    Examples
    --------
    >>> validate({"memory_growth": {"min_span_s": 60, "bucket_s": 5}})
    {'memory_growth': {'min_span_s': 60.0, 'bucket_s': 5.0}}
    >>> try:
    ...     validate({"plateau": {"min_steps": 2.5}})
    ... except ConfigError as exc:
    ...     print(exc)  # doctest: +NORMALIZE_WHITESPACE
    detector_settings["plateau"]["min_steps"]=2.5 must be an integer in [10, 1000000000]
    (fewest steps in the stretch (steps))
    """
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{where}={settings!r} must be a mapping: detector -> {{parameter: value}}")
    out: Settings = {}
    for det, params in settings.items():
        table = TUNABLE.get(det) if isinstance(det, str) else None
        if table is None:
            raise ConfigError(f"{where}[{_key(det)}] is not a detector with tunable settings (one of "
                              f"{', '.join(sorted(TUNABLE))})")
        if not isinstance(params, Mapping):
            raise ConfigError(f"{where}[{_key(det)}]={params!r} must be a mapping: parameter -> value")
        got: dict[str, float | int] = {}
        for name, value in params.items():
            field = f"{where}[{_key(det)}][{_key(name)}]"
            spec = table.get(name) if isinstance(name, str) else None
            if spec is None:
                raise ConfigError(f"{field} is not a tunable parameter of {det} (tunable: "
                                  f"{', '.join(table)})")
            got[name] = _value(field, spec, value)
        if got:
            out[det] = got
    mem = out.get("memory_growth", {})
    span = mem.get("min_span_s", TUNABLE["memory_growth"]["min_span_s"].default)
    window = mem.get("window_s", TUNABLE["memory_growth"]["window_s"].default)
    if span > window:
        raise ConfigError(f"{where}[\"memory_growth\"]: min_span_s={span:g} is above window_s={window:g}: the "
                          "trend could never be judged")
    return out


def _key(k: Any) -> str:
    return json.dumps(k) if isinstance(k, str) else repr(k)


def _value(field: str, spec: Tunable, value: Any) -> float | int:
    noun = "an integer" if spec.kind is int else "a number"
    rng = f"in [{spec.low:g}, {spec.high:g}]" if spec.kind is float else f"in [{int(spec.low)}, {int(spec.high)}]"
    ok = (type(value) is int if spec.kind is int else type(value) in (int, float) and math.isfinite(value))
    if not ok or not spec.low <= value <= spec.high:
        raise ConfigError(f"{field}={value!r} must be {noun} {rng} ({spec.doc})")
    return spec.kind(value)


def parse(raw: str, where: str) -> Settings:
    """Settings from their JSON text (the environment variable, the meta field): :func:`validate` of the object.

    Raises :class:`ConfigError` naming ``where`` when the text is not JSON, or as :func:`validate`.

    >>> parse('{"hang": {"floor_s": 45}}', "TRAINHEALTH_DETECTOR_SETTINGS")
    {'hang': {'floor_s': 45.0}}
    """
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{where}={raw!r} is not JSON ({exc})") from None
    return validate(doc, where)


def describe(settings: Settings) -> str:
    """One line of ``detector.parameter=value`` (default ``d``) for a log.

    >>> describe({"memory_growth": {"min_span_s": 60.0}, "hang": {"floor_s": 30.0}})
    'memory_growth.min_span_s=60 (default 600), hang.floor_s=30 (default 30)'
    """
    return ", ".join(f"{det}.{name}={v:g} (default {TUNABLE[det][name].default:g})"
                     for det, params in settings.items() for name, v in params.items())
