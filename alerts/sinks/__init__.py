"""Sinks: where notifications go. One module per sink type.

================  ===========================================  ==============================================
``type``          module                                       secrets
================  ===========================================  ==============================================
``slack``         :mod:`trainhealth.alerts.sinks.slack`        ``url`` (incoming webhook URL)
``webhook``       :mod:`trainhealth.alerts.sinks.webhook`      ``secret`` (HMAC key); ``url`` may be plain
``pagerduty``     :mod:`trainhealth.alerts.sinks.pagerduty`    ``routing_key``; ``url`` may be plain
``alertmanager``  :mod:`trainhealth.alerts.sinks.alertmanager` ``password`` or ``bearer_token`` (optional);
                                                               ``url`` may be plain
================  ===========================================  ==============================================

The first three are sent the worker's grouped notifications through the outbox; ``alertmanager`` is sent the alerts
themselves by :mod:`trainhealth.alerts.forwarding` (Alertmanager groups, silences and inhibits by itself).
"""

from __future__ import annotations

from trainhealth.alerts.sinks.alertmanager import AlertmanagerSink
from trainhealth.alerts.sinks.base import Request, SendResult, Sink
from trainhealth.alerts.sinks.pagerduty import PagerDutySink
from trainhealth.alerts.sinks.slack import SlackSink
from trainhealth.alerts.sinks.webhook import WebhookSink

#: Sink classes by config ``type``.
SINK_TYPES: dict[str, type[Sink]] = {"slack": SlackSink, "webhook": WebhookSink, "pagerduty": PagerDutySink,
                                     "alertmanager": AlertmanagerSink}

__all__ = ["SINK_TYPES", "AlertmanagerSink", "PagerDutySink", "Request", "SendResult", "Sink", "SlackSink",
           "WebhookSink"]
