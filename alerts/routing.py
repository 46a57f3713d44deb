"""The routing tree: which sinks get an alert, grouped how, on which timers.

Semantics of Prometheus Alertmanager's ``route`` (https://prometheus.io/docs/alerting/latest/configuration/#route):
an alert enters at the root; the child routes are tried in order and the alert goes to the first whose
matchers all match (recursively), or to every matching child up to and including the first one without
``continue = true``; when no child matches, the route itself takes it. Children inherit ``receivers``,
``group_by`` and the three timers from their parent unless they set them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainhealth.matchers import Matcher, match_all


@dataclass(frozen=True)
class Timers:
    """Alertmanager's grouping timers, in seconds.

    Attributes
    ----------
    group_wait : float
        Wait between the creation of a group and its first notification (Alertmanager default 30 s), so
        that alerts starting together go out together and an inhibiting alert can arrive first.
    group_interval : float
        Wait between two notifications of one group about changes (new alerts, resolved ones; default 5 min).
    repeat_interval : float
        Wait before re-sending a group whose firing alerts did not change (default 4 h).
    """

    group_wait: float
    group_interval: float
    repeat_interval: float


@dataclass(frozen=True)
class Route:
    """One node of the routing tree.

    Attributes
    ----------
    id : str
        ``name`` from the config, else the path (``root``, ``root.0``, ``root.0.1``); part of group keys.
    matchers : tuple[Matcher, ...]
        All must match (empty at the root).
    receivers : tuple[str, ...]
        Sink names (empty: the alerts are grouped but sent nowhere, like Alertmanager's null receiver).
    group_by : tuple[str, ...]
        Labels forming the group; ``("...",)`` groups by every label plus the anomaly id (one group per anomaly).
    timers : Timers
    continue_ : bool
        Keep matching later siblings after this route matched (Alertmanager's ``continue``).
    routes : tuple[Route, ...]
        Child routes.
    """

    id: str
    matchers: tuple[Matcher, ...]
    receivers: tuple[str, ...]
    group_by: tuple[str, ...]
    timers: Timers
    continue_: bool = False
    routes: tuple[Route, ...] = ()

    def match(self, labels: Mapping[str, str]) -> list[Route]:
        """The routes (leaf-most) that take an alert with ``labels``; empty when this route does not match."""
        if not match_all(self.matchers, labels):
            return []
        found: list[Route] = []
        for child in self.routes:
            sub = child.match(labels)
            if sub:
                found += sub
                if not child.continue_:
                    break
        return found or [self]

    def walk(self) -> list[Route]:
        """This route and all its descendants, depth first."""
        out = [self]
        for child in self.routes:
            out += child.walk()
        return out
