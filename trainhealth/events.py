"""Record types carried by the streams, and their stream-field encoding (standard library only).

Collectors encode; the detector service and the dashboard decode. Field names and units
are the documented wire format (``docs/architecture.md``); floats are written with
``repr`` so NaN and ±Inf travel faithfully as ``nan``/``inf``/``-inf``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Event kinds written by collectors into ``th:{run}:events``.
EVENT_KINDS = (
    "run_start",        # a rank's Monitor started: host, pid, inc, world_size, config
    "run_end",          # a rank's Monitor closed cleanly
    "checkpoint_save",  # step, seconds the save blocked training
    "checkpoint_load",  # step, seconds the restore blocked training
    "badput",           # a custom unproductive interval: name, seconds (e.g. evaluation)
    "collector_drops",  # count of records the collector dropped while Redis was away
    "resume",           # the same process went back to an earlier step (in-process rollback): from_step
)

SECTION_PREFIX = "sec."
GPU_PREFIX = "gpu."

_STEP_FLOATS = ("t", "dur", "loss", "grad_norm", "lr")
_STEP_INTS = ("tokens", "samples", "consumed_samples", "batch_index", "skipped")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class StepRecord:
    """One rank's record of one step (a record in a ``th:{run}:steps`` entry's ``recs`` list).

    Attributes
    ----------
    rank, step : int
        Global rank and training step (optimizer step) number.
    inc : float
        Incarnation: the unix time (s) the rank's Monitor started; a new value for a rank
        means that rank's process restarted.
    t : float
        Unix time (s) the step ended on this rank.
    dur : float | None
        Step wall time on this rank (s), when the step was timed.
    loss, grad_norm, lr : float | None
        As logged; NaN/Inf kept as is.
    tokens, samples : int | None
        Tokens and samples this rank processed in the step.
    consumed_samples, batch_index : int | None
        Data position after the step (global samples consumed; data-loader batch index).
    skipped : int | None
        1 when the optimizer skipped this step (fp16 loss-scale overflow).
    sections : dict[str, float]
        Seconds per named section (``data``, ``forward_backward``, ...) before the collective.
    gpu : dict[str, float]
        GPU seconds of sections timed with CUDA events (``section(name, cuda=True)``).
    """

    rank: int
    step: int
    inc: float
    t: float
    dur: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int | None = None
    samples: int | None = None
    consumed_samples: int | None = None
    batch_index: int | None = None
    skipped: int | None = None
    sections: dict[str, float] = field(default_factory=dict)
    gpu: dict[str, float] = field(default_factory=dict)

    @property
    def busy_s(self) -> float | None:
        """Seconds this rank spent in its own sections: GPU time of CUDA-timed sections where
        there is one (the CPU only launched those kernels), CPU time of the others; None when
        nothing was timed."""
        if not self.sections and not self.gpu:
            return None
        return sum(self.gpu.values()) + sum(v for k, v in self.sections.items() if k not in self.gpu)


def step_record(d: Mapping[str, Any]) -> StepRecord:
    """Build a :class:`StepRecord` from one decoded record; raises ``KeyError``/``ValueError`` naming the field."""
    kw: dict[str, Any] = {}
    for name in _STEP_FLOATS:
        v = d.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"field {name!r} has non-numeric value {v!r}")
            kw[name] = float(v)
    for name in _STEP_INTS:
        v = d.get(name)
        if v is not None:
            if not isinstance(v, (int, float)):
                raise ValueError(f"field {name!r} has non-numeric value {v!r}")
            kw[name] = int(v)
    sections = {k[len(SECTION_PREFIX):]: float(v) for k, v in d.items() if k.startswith(SECTION_PREFIX)}
    gpu = {k[len(GPU_PREFIX):]: float(v) for k, v in d.items() if k.startswith(GPU_PREFIX)}
    for name in ("rank", "step", "inc"):
        if name not in d:
            raise KeyError(f"record has no {name!r} field")
    return StepRecord(rank=int(d["rank"]), step=int(d["step"]), inc=float(d["inc"]), sections=sections, gpu=gpu,
                      **kw)


def decode_steps(fields: Mapping[Any, Any]) -> list[StepRecord]:
    """Decode a ``th:{run}:steps`` entry (one rank's batch: ``rank``, ``n``, ``recs`` JSON list).

    Raises ``KeyError``/``ValueError`` naming the field for a malformed entry.

    >>> [r.step for r in decode_steps({b"rank": b"0", b"n": b"2",
    ...   b"recs": b'[{"rank":0,"step":5,"inc":1.0,"t":2.0,"loss":NaN},{"rank":0,"step":6,"inc":1.0,"t":3.0}]'})]
    [5, 6]
    """
    d = {_s(k): v for k, v in fields.items()}
    if "recs" not in d:
        raise KeyError("entry has no 'recs' field")
    try:
        recs = json.loads(d["recs"])
    except ValueError:
        raise ValueError("field 'recs' is not a JSON list of records") from None
    if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
        raise ValueError("field 'recs' is not a JSON list of records")
    return [step_record(r) for r in recs]


@dataclass(frozen=True)
class Event:
    """One entry of ``th:{run}:events``.

    ``kind`` is one of :data:`EVENT_KINDS`; ``t`` unix seconds; ``step`` and ``seconds``
    where the kind has them; everything else in ``extra`` (strings).
    """

    kind: str
    rank: int
    t: float
    inc: float
    step: int | None = None
    seconds: float | None = None
    extra: dict[str, str] = field(default_factory=dict)


def decode_event(fields: Mapping[Any, Any]) -> Event:
    """Decode a ``th:{run}:events`` entry; raises ``KeyError``/``ValueError`` naming the field."""
    d = {_s(k): _s(v) for k, v in fields.items()}
    step = d.pop("step", None)
    seconds = d.pop("seconds", None)
    return Event(
        kind=d.pop("kind"),
        rank=int(d.pop("rank")),
        t=float(d.pop("t")),
        inc=float(d.pop("inc", "0")),
        step=int(step) if step not in (None, "") else None,
        seconds=float(seconds) if seconds not in (None, "") else None,
        extra=d,
    )


def finite(x: float | None) -> bool:
    """True when ``x`` is a real number (not None, NaN or ±Inf)."""
    return x is not None and math.isfinite(x)
