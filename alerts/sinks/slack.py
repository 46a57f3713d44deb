"""Slack incoming webhook sink: one Block Kit message per notification.

Message shape (https://api.slack.com/messaging/webhooks, https://api.slack.com/reference/block-kit/blocks):
``{"text": <fallback, shown in the OS notification>, "blocks": [...]}``. Per alert: a section with the
anomaly's message and the dashboard link, a section of fields (severity/status, run, kind, steps,
ranks, hosts), a section with the evidence numbers, a section with the rollback recommendation when the
anomaly has one, then a divider. A header block starts the message, a context block ends it.

Limits kept (Block Kit reference): 50 blocks a message (at most
:data:`~trainhealth.defaults.ALERT_SLACK_MAX_ALERTS` alerts are detailed, the rest counted), header text
150 characters, section text 3,000, at most 10 fields of 2,000 each. Text is escaped for mrkdwn
(``&``, ``<``, ``>``). Slack offers no idempotency key: after a worker crash between sending and
acknowledging, a Slack channel may show one notification twice (the JSON webhook and PagerDuty do not).
"""

from __future__ import annotations

import time
from typing import Any

from trainhealth import defaults
from trainhealth.alerts.notification import FIRING, Alert, Notification, dashboard_link
from trainhealth.alerts.sinks.base import Sink
from trainhealth.alerts.text import EMOJI, evidence_items, recommendation_text, steps_words, summary, title, where

MAX_BLOCKS = 50
HEADER_MAX = 150
SECTION_MAX = 3000
FIELD_MAX = 2000


def esc(text: Any) -> str:
    """Escape ``&``, ``<``, ``>`` for Slack mrkdwn (https://api.slack.com/reference/surfaces/formatting#escaping)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _date(t: float | None) -> str:
    """Slack date token: the reader's local time, with a UTC fallback."""
    if t is None:
        return "—"
    fallback = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
    return f"<!date^{int(t)}^{{date_short_pretty}} {{time_secs}}|{fallback}>"


def _mrkdwn(text: str) -> dict[str, Any]:
    return {"type": "mrkdwn", "text": text}


def alert_blocks(alert: Alert, dashboard_url: str) -> list[dict[str, Any]]:
    """The blocks describing one alert (4-5 blocks, divider not included)."""
    a = alert.anomaly
    run = alert.run
    firing = alert.status == FIRING or alert.point
    icon = EMOJI[alert.severity] if firing and alert.severity in EMOJI else EMOJI["resolved"]
    message = esc(a.get("message") or alert.labels["kind"])
    text = f"{icon} *{message}*"
    if run and run != "*":
        link = dashboard_link(dashboard_url, run, a)
        steps = steps_words(a)
        label = f"Open in dashboard: run {run}" + (f", {steps}" if steps else "")
        ranks = a.get("ranks") or []
        if ranks:
            label += f", rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
        text += f"\n<{link}|{esc(label)} ›>"
    if alert.point:
        status = f"event at {_date(alert.ends_at or alert.starts_at)}"
    elif firing:
        status = f"firing since {_date(alert.starts_at)}"
    else:
        status = f"resolved at {_date(alert.ends_at)}"
    steps = steps_words(a) or "—"
    ongoing = " (ongoing)" if firing and not alert.point and a.get("end_step") is None and a.get("step") is not None \
        else ""
    fields = [
        f"*Severity*\n{esc(alert.severity)} · {status}",
        f"*Run*\n`{esc(run)}`",
        f"*Kind*\n`{esc(alert.labels['kind'])}`",
        f"*Steps*\n{esc(steps)}{ongoing}",
        f"*Ranks / hosts*\n{esc(where(alert))}",
    ]
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": _mrkdwn(_cut(text, SECTION_MAX))},
        {"type": "section", "fields": [_mrkdwn(_cut(f, FIELD_MAX)) for f in fields]},
    ]
    items = evidence_items(a.get("evidence"))
    if items:
        ev = "  ·  ".join(f"`{esc(k)}` {esc(v)}" for k, v in items)
        blocks.append({"type": "section", "text": _mrkdwn(_cut(f"*Evidence*\n{ev}", SECTION_MAX))})
    rec = recommendation_text(a.get("recommendation"))
    if rec:
        text = f":rewind: *Recommendation*\n{esc(rec)}"
        rec_id = a["recommendation"].get("id") if isinstance(a.get("recommendation"), dict) else None
        if rec_id and run != "*":
            text += f"\nCosts and launcher arguments: `trainhealth advise {esc(run)} --id {esc(rec_id)}`"
        blocks.append({"type": "section", "text": _mrkdwn(_cut(text, SECTION_MAX))})
    return blocks


def render_slack(n: Notification, dashboard_url: str = defaults.ALERT_DASHBOARD_URL,
                 max_alerts: int = defaults.ALERT_SLACK_MAX_ALERTS) -> dict[str, Any]:
    """The incoming-webhook JSON for notification ``n`` (see the module doc for the layout)."""
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": _cut(title(n), HEADER_MAX), "emoji": True}},
    ]
    alerts = list(n.firing) + list(n.resolved)
    shown = alerts[:max_alerts]
    for i, alert in enumerate(shown):
        if i and alert.status != FIRING and not alert.point and shown[i - 1].status == FIRING:
            blocks.append({"type": "section", "text": _mrkdwn(f"{EMOJI['resolved']} *Resolved since the last "
                                                              "notification*")})
        blocks += alert_blocks(alert, dashboard_url)
        blocks.append({"type": "divider"})
    footer = [f"trainhealth · notification #{n.seq} of group "
              f"`{esc(', '.join(f'{k}={v}' for k, v in n.group_labels.items()))}` ({esc(n.reason)}) · {_date(n.at)}"]
    if len(alerts) > len(shown):
        footer.insert(0, f"*…and {len(alerts) - len(shown)} more alerts* (see the dashboard)")
    blocks.append({"type": "context", "elements": [_mrkdwn(_cut(t, SECTION_MAX)) for t in footer]})
    if len(blocks) > MAX_BLOCKS:  # cannot happen with max_alerts <= 7; keep the header and footer regardless
        blocks = [*blocks[: MAX_BLOCKS - 1], blocks[-1]]
    return {"text": summary(n, limit=300), "blocks": blocks}


class SlackSink(Sink):
    """Posts :func:`render_slack` messages to a Slack incoming webhook URL (a secret: env or file only).

    Options: ``max_alerts`` (alerts detailed per message, default
    :data:`~trainhealth.defaults.ALERT_SLACK_MAX_ALERTS`, at most 7 to stay within 50 blocks).
    """

    type = "slack"
    OPTIONS = ("max_alerts",)

    def payload(self, n: Notification, key: str) -> dict[str, Any]:
        return render_slack(n, self.dashboard_url, int(self.options.get("max_alerts",
                                                                        defaults.ALERT_SLACK_MAX_ALERTS)))
