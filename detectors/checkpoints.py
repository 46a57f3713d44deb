"""The checkpoint saves and loads of a run, merged over its ranks: the markers of the dashboard's whole-run charts.

Every rank reports each checkpoint (``checkpoint_save`` / ``checkpoint_load`` events), so at 1,024 ranks a save is
1,024 events, and the events stream (``defaults.EVENTS_RETENTION_ENTRIES``) holds the last ~100 of them: finding a
run's checkpoints there means reading and decoding its newest ~10,000 events (~1.3 MB) on every chart refresh, and
the older ones are gone. The detector service instead folds each report into one mark per checkpoint and keeps the
newest :data:`~trainhealth.defaults.CHECKPOINTS_KEPT` in ``th:{run}:checkpoints`` (docs/architecture.md), a few
kilobytes the dashboard reads whole. Pure logic, no I/O: :class:`CheckpointLog` takes events and returns the marks
they changed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from trainhealth.defaults import CHECKPOINTS_KEPT
from trainhealth.wire import Event

#: The event kinds that are checkpoints.
CHECKPOINT_KINDS = ("checkpoint_save", "checkpoint_load")
#: Checkpoints whose reporting ranks are remembered (as a set, to count each rank once): the newest by step. A
#: rank's report arrives within seconds of the others', long before this many more checkpoints are saved.
RANK_SETS_KEPT = 8



def _order(key: tuple[str, int]) -> tuple[int, str]:
    """(kind, step) keys by step."""
    return key[1], key[0]


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint save or load of a run, over the ranks that reported it.

    Attributes
    ----------
    kind : str
        ``checkpoint_save`` or ``checkpoint_load``.
    step : int
        The step it saved (or that a load restored).
    t : float
        Unix s of the earliest report.
    seconds : float or None
        The longest a rank was blocked by it (s); None when no rank said.
    n_ranks : int
        Ranks that reported it.
    """

    kind: str
    step: int
    t: float
    seconds: float | None
    n_ranks: int

    @property
    def field(self) -> str:
        """Its field in ``th:{run}:checkpoints``: ``<kind>:<step>``."""
        return f"{self.kind}:{self.step}"

    def to_json(self) -> str:
        """The stored JSON (keys sorted, so an unchanged mark is the same text)."""
        return json.dumps({"kind": self.kind, "step": self.step, "t": self.t, "seconds": self.seconds,
                           "n_ranks": self.n_ranks}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Checkpoint:
        """A stored mark; ``ValueError`` naming the field when it is not one."""
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError(f"checkpoint {raw!r} is not a JSON object")
        kind, step, t, seconds, n = (d.get(k) for k in ("kind", "step", "t", "seconds", "n_ranks"))
        if kind not in CHECKPOINT_KINDS:
            raise ValueError(f"kind {kind!r} is not a checkpoint kind")
        for name, v in (("step", step), ("n_ranks", n)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} {v!r} is not a whole number")
        if not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"t {t!r} is not a time")
        if seconds is not None and not (isinstance(seconds, (int, float)) and math.isfinite(seconds)):
            raise ValueError(f"seconds {seconds!r} is not a duration")
        return cls(kind, step, float(t), None if seconds is None else float(seconds), n)


class CheckpointLog:
    """Merges a run's checkpoint events into one :class:`Checkpoint` per (kind, step), the newest ``kept`` by step.

    Parameters
    ----------
    kept : int
        Marks kept; beyond, the oldest by step are dropped (and named by :meth:`update`, to be deleted).

    Examples
    --------
    >>> log = CheckpointLog(kept=2)
    >>> log.update(Event("checkpoint_save", 0, 100.0, 0.0, step=999, seconds=1.5))
    ([Checkpoint(kind='checkpoint_save', step=999, t=100.0, seconds=1.5, n_ranks=1)], [])
    >>> log.update(Event("checkpoint_save", 1, 99.5, 0.0, step=999, seconds=2.0))[0]
    [Checkpoint(kind='checkpoint_save', step=999, t=99.5, seconds=2.0, n_ranks=2)]
    >>> log.update(Event("checkpoint_save", 1, 99.6, 0.0, step=999, seconds=1.0))  # rank 1 again: nothing new
    ([], [])
    >>> log.update(Event("checkpoint_save", 0, 200.0, 0.0, step=1999))[0][0].seconds is None
    True
    >>> log.update(Event("checkpoint_save", 0, 300.0, 0.0, step=2999))[1]  # the oldest goes
    ['checkpoint_save:999']

    References
    ----------
    The markers of the whole-run charts (issue 16); the events: docs/architecture.md (``th:{run}:events``).
    """

    def __init__(self, kept: int = CHECKPOINTS_KEPT) -> None:
        self.kept = kept
        self._reset()

    def _reset(self) -> None:
        self._marks: dict[tuple[str, int], Checkpoint] = {}
        self._ranks: dict[tuple[str, int], set[int]] = {}

    @property
    def marks(self) -> list[Checkpoint]:
        """The marks kept, by step."""
        return [self._marks[k] for k in sorted(self._marks, key=_order)]

    def load(self, mark: Checkpoint) -> None:
        """Start from a stored mark (a restarted service): the events replayed then merge into it, so a mark whose
        reports were partly trimmed from the events stream keeps its stored count."""
        self._marks[(mark.kind, mark.step)] = mark

    def update(self, ev: Event) -> tuple[list[Checkpoint], list[str]]:
        """Fold one event in. Returns the marks it changed (none for another kind, an event without a step, or a
        rank's report seen before) and the fields of the marks dropped to keep :attr:`kept`."""
        if ev.kind not in CHECKPOINT_KINDS or ev.step is None:
            return [], []
        key = (ev.kind, ev.step)
        old = self._marks.get(key)
        ranks = self._ranks.get(key)
        if ranks is None:
            if old is not None and len(self._ranks) >= RANK_SETS_KEPT and \
                    _order(key) < min(map(_order, self._ranks)):
                return [], []  # a late report of a checkpoint older than those whose ranks are remembered
            ranks = self._ranks[key] = set()
            while len(self._ranks) > RANK_SETS_KEPT:
                del self._ranks[min(self._ranks, key=_order)]
        if ev.rank in ranks:
            return [], []
        ranks.add(ev.rank)
        if old is None:
            new = Checkpoint(ev.kind, ev.step, ev.t, ev.seconds, len(ranks))
        else:
            seconds = old.seconds if ev.seconds is None else ev.seconds if old.seconds is None else max(
                old.seconds, ev.seconds)
            new = Checkpoint(ev.kind, ev.step, min(old.t, ev.t), seconds, max(old.n_ranks, len(ranks)))
        dropped: list[str] = []
        if new != old:
            self._marks[key] = new
        while len(self._marks) > self.kept:
            oldest = min(self._marks, key=_order)
            dropped.append(self._marks.pop(oldest).field)
            self._ranks.pop(oldest, None)
        return ([new] if new != old and key in self._marks else []), dropped
