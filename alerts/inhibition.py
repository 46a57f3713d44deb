"""Inhibition: a firing alert mutes other alerts it explains (Alertmanager's ``inhibit_rules``).

A rule has source matchers, target matchers and ``equal`` labels
(https://prometheus.io/docs/alerting/latest/configuration/#inhibit_rule): while an alert matching the
source matchers fires, alerts matching the target matchers whose ``equal`` labels have the same values
are muted. An alert never inhibits itself. As in Alertmanager, a silenced source still inhibits.

:data:`DEFAULT_RULES` (used when the config has no ``inhibit_rules`` key):

- a ``dead_rank`` of a run inhibits that run's ``hang`` (the other ranks wait in a collective for the
  dead one: the dead rank is the cause to act on) and its slowness alerts;
- a ``hang`` inhibits that run's slowness alerts (``straggler``, ``slow_node``, ``network_slow``, ``rank_outlier``,
  ``throughput_drop``, ``slow_step``): a hung job makes every rank look slow;
- a critical ``nan_inf`` (the loss itself is NaN/Inf) inhibits that run's ``loss_spike``,
  ``grad_norm_spike``, ``divergence`` and ``grad_norm_explosion`` alerts. A warning ``nan_inf`` (grad
  norm only: an fp16 overflow skip) does not;
- a ``restart_storm`` inhibits that run's single ``restart`` alerts (the storm says it all);
- a ``straggler``, ``slow_node`` or ``network_slow`` inhibits that run's ``throughput_drop`` and ``slow_step``: the
  slow rank or node is the cause to act on, the job-wide slowdown its symptom.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from trainhealth.matchers import Matcher, match_all, parse_all


@dataclass(frozen=True)
class InhibitRule:
    """One inhibition rule (all three parts as in Alertmanager)."""

    source_matchers: tuple[Matcher, ...]
    target_matchers: tuple[Matcher, ...]
    equal: tuple[str, ...] = ("run",)

    def inhibits(self, source: Mapping[str, str], target: Mapping[str, str]) -> bool:
        """True when ``source`` (a firing alert's labels) mutes ``target`` under this rule."""
        return (match_all(self.target_matchers, target) and match_all(self.source_matchers, source)
                and all(source.get(lb, "") == target.get(lb, "") for lb in self.equal))


#: Kinds a stalled or dead rank makes fire as a side effect, and the loss kinds a NaN loss explains.
SLOWNESS_KINDS = "straggler|slow_node|network_slow|rank_outlier|throughput_drop|slow_step"
LOSS_KINDS = "loss_spike|grad_norm_spike|divergence|grad_norm_explosion"

DEFAULT_RULES = (
    InhibitRule(parse_all(['kind="dead_rank"']), parse_all([f'kind=~"hang|{SLOWNESS_KINDS}"']), ("run",)),
    InhibitRule(parse_all(['kind="hang"']), parse_all([f'kind=~"{SLOWNESS_KINDS}"']), ("run",)),
    InhibitRule(parse_all(['kind="nan_inf"', 'severity="critical"']),
                parse_all([f'kind=~"{LOSS_KINDS}"']), ("run",)),
    InhibitRule(parse_all(['kind="restart_storm"']), parse_all(['kind="restart"']), ("run",)),
    InhibitRule(parse_all(['kind=~"straggler|slow_node|network_slow"']),
                parse_all(['kind=~"throughput_drop|slow_step"']), ("run",)),
)


def inhibited(rules: Iterable[InhibitRule], key: str, labels: Mapping[str, str],
              firing: Iterable[tuple[str, Mapping[str, str]]]) -> str | None:
    """The key of a firing alert inhibiting the alert ``key`` with ``labels``, or None.

    ``firing`` is every firing alert as ``(key, labels)``; the alert itself is skipped.
    """
    rules = tuple(rules)
    if not rules:
        return None
    for src_key, src in firing:
        if src_key == key:
            continue
        if any(rule.inhibits(src, labels) for rule in rules):
            return src_key
    return None
