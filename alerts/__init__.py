"""Alerting: anomaly transitions → grouped, silenced, inhibited, routed notifications → Slack, webhooks, PagerDuty.

Two stages, both in the alert worker (``trainhealth alerts --config alerts.toml``), never in the detector
service:

1. **Intake** (:mod:`trainhealth.alerts.intake`): reads every run's ``th:{run}:anomaly_log`` with the consumer
   group ``th-alerts``, feeds the pure grouping engine (:mod:`trainhealth.alerts.grouping`, Alertmanager's
   group_wait / group_interval / repeat_interval) and commits the engine's state together with the due
   notifications, one outbox entry per sink, in one ``MULTI/EXEC``.
2. **Delivery** (:mod:`trainhealth.alerts.outbox`): reads the outbox with the consumer group
   ``th-alerts-delivery`` and sends through the sinks (:mod:`trainhealth.alerts.sinks`) with retries,
   exponential backoff with jitter, ``Retry-After`` on 429, a dead-letter list, and an idempotency key.

An ``alertmanager`` sink takes neither path: the intake keeps each alert's state for it and the forwarder
(:mod:`trainhealth.alerts.forwarding`, a third thread) sends the alerts themselves to Alertmanager's API,
re-sent while active, since Alertmanager groups, silences and inhibits by itself.

Module map: :mod:`~trainhealth.matchers` (label matchers), :mod:`~trainhealth.alerts.routing`,
:mod:`~trainhealth.silences`, :mod:`~trainhealth.alerts.inhibition`,
:mod:`~trainhealth.alerts.notification`, :mod:`~trainhealth.alerts.grouping`, :mod:`~trainhealth.alerts.config`,
:mod:`~trainhealth.alerts.secrets`, :mod:`~trainhealth.alerts.signing`, :mod:`~trainhealth.alerts.sinks`,
:mod:`~trainhealth.alerts.outbox`, :mod:`~trainhealth.alerts.forwarding`, :mod:`~trainhealth.alerts.intake`,
:mod:`~trainhealth.alerts.watchdog`,
:mod:`~trainhealth.alerts.worker`, :mod:`~trainhealth.alert_store` (reads/writes for CLI and dashboard),
:mod:`~trainhealth.alerts.health` (``trainhealth doctor``), :mod:`~trainhealth.alerts.preview` (Slack-like HTML).
See ``docs/alerts.md``.
"""

from __future__ import annotations
