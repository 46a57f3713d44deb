"""Silences: mute alerts matching label matchers for a time window (Alertmanager's silences).

A silence is active for ``starts_at <= t < ends_at`` (unix seconds); expiring one sets ``ends_at`` to
now, as Alertmanager does. Silences are stored in the Redis hash ``th:{alerts}:silences`` by
:mod:`trainhealth.alert_store` (CLI ``trainhealth silence``, dashboard Alerts page); this module is the pure model.
A silence needs at least one matcher, so that one cannot mute everything by accident.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainhealth.matchers import Matcher, MatcherError, match_all


@dataclass(frozen=True)
class Silence:
    """One silence.

    Attributes
    ----------
    id : str
        Stable id (hex), see :func:`silence_id`.
    matchers : tuple[Matcher, ...]
        All must match an alert's labels for the silence to mute it (at least one).
    starts_at, ends_at : float
        Unix seconds; active while ``starts_at <= t < ends_at``.
    created_by, comment : str
        Who and why (shown in the dashboard and ``trainhealth silence list``).
    created_at : float
        Unix seconds.
    """

    id: str
    matchers: tuple[Matcher, ...]
    starts_at: float
    ends_at: float
    created_by: str = ""
    comment: str = ""
    created_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.matchers:
            raise MatcherError("a silence needs at least one matcher (e.g. run, kind or rank)")
        if not self.ends_at > self.starts_at:
            raise MatcherError(f"a silence must end after it starts (starts_at={self.starts_at}, "
                               f"ends_at={self.ends_at})")

    def active(self, t: float) -> bool:
        """True while the silence mutes alerts at unix time ``t``."""
        return self.starts_at <= t < self.ends_at

    def matches(self, labels: Mapping[str, str]) -> bool:
        return match_all(self.matchers, labels)

    def mutes(self, labels: Mapping[str, str], t: float) -> bool:
        """Active at ``t`` and matching ``labels``."""
        return self.active(t) and self.matches(labels)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "matchers": [str(m) for m in self.matchers], "starts_at": self.starts_at,
                "ends_at": self.ends_at, "created_by": self.created_by, "comment": self.comment,
                "created_at": self.created_at}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Silence:
        """Inverse of :meth:`to_dict`; raises :class:`MatcherError`/``KeyError`` on a malformed record."""
        return cls(id=str(d["id"]), matchers=tuple(Matcher.parse(m) for m in d["matchers"]),
                   starts_at=float(d["starts_at"]), ends_at=float(d["ends_at"]),
                   created_by=str(d.get("created_by", "")), comment=str(d.get("comment", "")),
                   created_at=float(d.get("created_at", 0.0)))


def silence_id(matchers: Iterable[Matcher], created_at: float, created_by: str) -> str:
    """A short stable id: sha256 of the matchers, creation time and author (16 hex digits)."""
    text = "\n".join([*sorted(str(m) for m in matchers), repr(created_at), created_by])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def muted_by(silences: Iterable[Silence], labels: Mapping[str, str], t: float) -> Silence | None:
    """The first silence muting ``labels`` at ``t``, or None."""
    for s in silences:
        if s.mutes(labels, t):
            return s
    return None
