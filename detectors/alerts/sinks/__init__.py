"""Sinks: where notifications go. One module per sink type.

=============  =========================================  =====================================
``type``       module                                     secrets
=============  =========================================  =====================================
``slack``      :mod:`detectors.alerts.sinks.slack`        ``url`` (incoming webhook URL)
``webhook``    :mod:`detectors.alerts.sinks.webhook`      ``secret`` (HMAC key); ``url`` may be plain
``pagerduty``  :mod:`detectors.alerts.sinks.pagerduty`    ``routing_key``; ``url`` may be plain
=============  =========================================  =====================================
"""

from __future__ import annotations

from detectors.alerts.sinks.base import Request, SendResult, Sink
from detectors.alerts.sinks.pagerduty import PagerDutySink
from detectors.alerts.sinks.slack import SlackSink
from detectors.alerts.sinks.webhook import WebhookSink

#: Sink classes by config ``type``.
SINK_TYPES: dict[str, type[Sink]] = {"slack": SlackSink, "webhook": WebhookSink, "pagerduty": PagerDutySink}

__all__ = ["SINK_TYPES", "PagerDutySink", "Request", "SendResult", "Sink", "SlackSink", "WebhookSink"]
