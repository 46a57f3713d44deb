"""Alerting: anomaly transitions → grouped, silenced, inhibited, routed notifications → Slack, webhooks, PagerDuty.

Two stages, both in the alert worker (``trainhealth alerts --config alerts.toml``), never in the detector
service:

1. **Intake** (:mod:`detectors.alerts.intake`): reads every run's ``th:{run}:anomaly_log`` with the consumer
   group ``th-alerts``, feeds the pure grouping engine (:mod:`detectors.alerts.grouping`, Alertmanager's
   group_wait / group_interval / repeat_interval) and commits the engine's state together with the due
   notifications, one outbox entry per sink, in one ``MULTI/EXEC``.
2. **Delivery** (:mod:`detectors.alerts.outbox`): reads the outbox with the consumer group
   ``th-alerts-delivery`` and sends through the sinks (:mod:`detectors.alerts.sinks`) with retries,
   exponential backoff with jitter, ``Retry-After`` on 429, a dead-letter list, and an idempotency key.

Module map: :mod:`~detectors.alerts.matchers` (label matchers), :mod:`~detectors.alerts.routing`,
:mod:`~detectors.alerts.silences`, :mod:`~detectors.alerts.inhibition`,
:mod:`~detectors.alerts.notification`, :mod:`~detectors.alerts.grouping`, :mod:`~detectors.alerts.config`,
:mod:`~detectors.alerts.secrets`, :mod:`~detectors.alerts.signing`, :mod:`~detectors.alerts.sinks`,
:mod:`~detectors.alerts.outbox`, :mod:`~detectors.alerts.intake`, :mod:`~detectors.alerts.watchdog`,
:mod:`~detectors.alerts.worker`, :mod:`~detectors.alerts.store` (reads/writes for CLI and dashboard),
:mod:`~detectors.alerts.health` (``trainhealth doctor``), :mod:`~detectors.alerts.preview` (Slack-like HTML).
See ``docs/alerts.md``.
"""

from __future__ import annotations
