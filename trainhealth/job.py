"""The job's state as the detector service judges it: the record of ``th:{run}:state``.

The service writes it (:class:`~trainhealth.detectors.job_state.JobStateTracker`); the dashboard, ``trainhealth
doctor`` and the alerts read it. States:

* ``running`` — ranks are heard from and steps complete;
* ``hung`` — ranks are heard from (or some are), but no step completed for longer than the progress timeout;
* ``crashed`` — every rank's heartbeat is gone and no relaunch came within the grace period; the ledger stops at
  the crash and books the gap as recovery if the job comes back;
* ``restarted`` — the job came back (new processes or a rollback) less than ``RESTARTED_HOLD_S`` ago;
* ``finished`` — every rank ended cleanly (``Monitor.close()``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

#: Job states, in the order a run usually meets them.
State = Literal["running", "hung", "crashed", "restarted", "finished"]
STATES: tuple[str, ...] = get_args(State)


@dataclass(frozen=True)
class Culprit:
    """The rank that stopped first, and what makes it the culprit.

    Attributes
    ----------
    rank : int
        Global rank.
    host, pid : str | None, int | None
        Where it ran, from its heartbeat (``py-spy dump --pid`` on that host).
    step : int | None
        Its last completed step (None before its first).
    why : str
        The evidence, in words (``"its heartbeat stopped while the others' continued"``...).
    """

    rank: int
    host: str | None = None
    pid: int | None = None
    step: int | None = None
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Culprit | None:
        """The culprit of a decoded record (None for None)."""
        if not d:
            return None
        return cls(int(d["rank"]), d.get("host"), d.get("pid"), d.get("step"), str(d.get("why") or ""))

    def name(self) -> str:
        """``rank 2 (host node-7, pid 4242)``."""
        where = ", ".join(x for x in (f"host {self.host}" if self.host else "",
                                      f"pid {self.pid}" if self.pid is not None else "") if x)
        return f"rank {self.rank}" + (f" ({where})" if where else "")


@dataclass(frozen=True)
class JobState:
    """One judgement of the job.

    Attributes
    ----------
    state : str
        One of :data:`STATES`.
    since : float
        Unix time (s) the job entered this state (for ``crashed``: when its last rank was last heard from).
    step : int | None
        The step the state is about: the last step completed before a hang or crash, the resume step of a restart,
        the last step of a finished run.
    culprit : Culprit | None
        For ``hung`` and ``crashed`` (and ``restarted`` when known): the rank that stopped first.
    message : str
        One line for people: ``"crashed at step 190, rank 1 first (host node-3): ..."``.
    gen : int
        Restart generation.
    """

    state: State
    since: float
    step: int | None = None
    culprit: Culprit | None = None
    message: str = ""
    gen: int = 0

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state={self.state!r} is not one of {', '.join(STATES)}")

    def to_json(self) -> str:
        """The JSON stored in ``th:{run}:state``."""
        d = asdict(self)
        d["culprit"] = self.culprit.to_dict() if self.culprit else None
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobState:
        """Decode a stored record; raises ``ValueError`` naming the field for a malformed one."""
        try:
            d = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"job state is not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ValueError(f"job state is not a JSON object: {str(raw)[:80]!r}")
        try:
            return cls(str(d["state"]), float(d["since"]), d.get("step"), Culprit.from_dict(d.get("culprit")),
                       str(d.get("message") or ""), int(d.get("gen") or 0))
        except KeyError as exc:
            raise ValueError(f"job state has no field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"job state has a bad field: {exc}") from None
