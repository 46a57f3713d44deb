"""Alert labels and label matchers, in Prometheus Alertmanager's matcher syntax.

Every alert (one anomaly of one run) carries the labels :data:`LABELS`: ``run``, ``kind``, ``severity``,
``rank`` and ``host``. ``rank`` and ``host`` are lists joined by commas (``"3,5"``; ``""`` when the whole
job is concerned). Matchers follow Alertmanager's ``matchers`` syntax
(https://prometheus.io/docs/alerting/latest/configuration/#matcher): ``label="value"``, ``label!="value"``,
``label=~"regex"``, ``label!~"regex"``; regexes are fully anchored, as in Alertmanager.

On the list-valued labels a matcher tests the members: ``rank="5"`` matches an anomaly that involves
rank 5 (among others), ``rank!="5"`` one that does not involve it, ``rank=~"1[0-9]"`` one involving any
of ranks 10-19. ``rank=""`` matches job-wide anomalies (no ranks), like an absent label in Alertmanager.

>>> m = Matcher.parse('rank="5"')
>>> m.matches({"rank": "3,5"}), m.matches({"rank": "15"})
(True, False)
>>> str(Matcher.parse("kind=~straggler|hang"))
'kind=~"straggler|hang"'
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, get_args

from trainhealth.anomaly import ALL_KINDS, SEVERITIES

#: Labels every alert has.
Label = Literal["run", "kind", "severity", "rank", "host"]
LABELS: tuple[str, ...] = get_args(Label)
#: Labels whose value is a comma-joined list; matchers test each member.
LIST_LABELS = ("rank", "host")
#: Kinds raised by the alert worker itself (not by a detector), see :mod:`trainhealth.alerts.watchdog`.
INTERNAL_KINDS = ("service_down",)
OPS = ("=", "!=", "=~", "!~")
_MATCHER = re.compile(r"^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*$")


class MatcherError(ValueError):
    """A matcher string does not parse or names an unknown label, kind or severity."""


class AlertLabels(TypedDict):
    """The labels of an alert (docs/alerts.md, "Alerts and labels"): what routes, groups, silences and inhibition
    rules match.

    Attributes
    ----------
    run : str
        Run id (``*`` for the alert worker's own ``service_down``).
    kind : str
        The anomaly's kind (docs/anomalies.md), or ``service_down``.
    severity : str
        ``info``, ``warning`` or ``critical``.
    rank : str
        The anomaly's ranks, comma-joined (``"3,5"``); empty when the whole job is concerned.
    host : str
        Its hosts, comma-joined.
    """

    run: str
    kind: str
    severity: str
    rank: str
    host: str


def labels_of(run: str, anomaly: Mapping[str, Any]) -> AlertLabels:
    """The labels of one anomaly (the JSON stored in ``th:{run}:anomalies``).

    >>> labels_of("r1", {"kind": "straggler", "severity": "warning", "ranks": [5], "hosts": ["n1"]})
    {'run': 'r1', 'kind': 'straggler', 'severity': 'warning', 'rank': '5', 'host': 'n1'}
    """
    return {
        "run": run,
        "kind": str(anomaly.get("kind", "")),
        "severity": str(anomaly.get("severity", "")),
        "rank": ",".join(str(x) for x in anomaly.get("ranks") or ()),
        "host": ",".join(str(x) for x in anomaly.get("hosts") or ()),
    }


@dataclass(frozen=True)
class Matcher:
    """One label matcher: ``label op value`` with ``op`` in ``=``, ``!=``, ``=~``, ``!~``.

    Build with :meth:`parse` (validates) or directly. Regexes are anchored at both ends.
    """

    label: str
    op: str
    value: str
    _re: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise MatcherError(f"operator {self.op!r} is not one of {', '.join(OPS)}")
        if self.label not in LABELS:
            raise MatcherError(f"label {self.label!r} is not an alert label (use one of {', '.join(LABELS)})")
        if self.op in ("=~", "!~"):
            try:
                object.__setattr__(self, "_re", re.compile(self.value))
            except re.error as exc:
                raise MatcherError(f"{self.value!r} is not a valid regular expression: {exc}") from None
        elif self.value:
            if self.label == "kind" and self.value not in ALL_KINDS + INTERNAL_KINDS:
                raise MatcherError(f"kind {self.value!r} is unknown (kinds: {', '.join(ALL_KINDS + INTERNAL_KINDS)})")
            if self.label == "severity" and self.value not in SEVERITIES:
                raise MatcherError(f"severity {self.value!r} is unknown (severities: {', '.join(SEVERITIES)})")

    @classmethod
    def parse(cls, text: str) -> Matcher:
        """Parse ``label="value"`` (quotes optional; a quoted value is a JSON string, so ``\\"`` escapes).

        Raises
        ------
        MatcherError
            When the text is not a matcher, the label is not in :data:`LABELS`, a regex does not compile,
            or an ``=``/``!=`` value of ``kind``/``severity`` is not a known one (catches typos).
        """
        if not isinstance(text, str):
            raise MatcherError(f"{text!r} is not a matcher string such as 'kind=\"hang\"'")
        m = _MATCHER.match(text)
        if not m:
            raise MatcherError(f"{text!r} is not a matcher: expected label=\"value\", label!=\"value\", "
                               "label=~\"regex\" or label!~\"regex\"")
        label, op, raw = m.groups()
        value = raw
        if raw.startswith('"'):
            try:
                value = json.loads(raw)
            except ValueError:
                raise MatcherError(f"{text!r}: the quoted value {raw} is not a valid double-quoted string") from None
            if not isinstance(value, str):
                raise MatcherError(f"{text!r}: the value must be a string")
        return cls(label, op, value)

    def _members(self, labels: Mapping[str, str]) -> list[str]:
        value = labels.get(self.label, "")
        if self.label in LIST_LABELS and value:
            return value.split(",")
        return [value]

    def matches(self, labels: Mapping[str, str]) -> bool:
        """True when ``labels`` satisfy this matcher (list labels: any member, see the module doc)."""
        members = self._members(labels)
        if self.op == "=":
            return self.value in members
        if self.op == "!=":
            return self.value not in members
        hit = any(self._re.fullmatch(v) for v in members)  # type: ignore[union-attr]
        return hit if self.op == "=~" else not hit

    def __str__(self) -> str:
        return f"{self.label}{self.op}{json.dumps(self.value)}"


def parse_all(texts: Iterable[str]) -> tuple[Matcher, ...]:
    """Parse several matchers; raises :class:`MatcherError` on the first bad one."""
    return tuple(Matcher.parse(t) for t in texts)


def match_all(matchers: Iterable[Matcher], labels: Mapping[str, str]) -> bool:
    """True when every matcher matches (an empty list matches everything)."""
    return all(m.matches(labels) for m in matchers)
