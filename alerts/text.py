"""Human-readable pieces of a notification, shared by the Slack and PagerDuty sinks and the dashboard.

>>> fmt_number(0.6234567), fmt_number(12), fmt_number(float("nan")), fmt_number(1234567.0)
('0.6235', '12', 'NaN', '1.235e+06')
>>> evidence_items({"score": 0.62, "rank_median_s": 0.1523, "windows": 3})
[('score', '0.62'), ('rank_median_s', '0.1523 s'), ('windows', '3')]
>>> recommendation_text(None) is None, recommendation_text("Roll back to step 400")
(True, 'Roll back to step 400')
>>> recommendation_text({"id": "rec:x", "action": "rollback", "checkpoint_step": 4000, "skip_steps": [4310, 4610]})
'Roll back to the checkpoint of step 4000 and skip the batches of steps 4310-4610'
>>> recommendation_text({"action": "drain", "node": "n3", "reason": "ECC errors"})
'drain · node n3 · reason: ECC errors'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from trainhealth.alerts.notification import FIRING, Alert, Notification

SEVERITY_ORDER = ("critical", "warning", "info")
#: Slack emoji short codes per severity / resolved (rendered by Slack; by :mod:`~trainhealth.alerts.preview` too).
EMOJI = {"critical": ":red_circle:", "warning": ":large_orange_circle:", "info": ":large_blue_circle:",
         "resolved": ":white_check_mark:"}
#: Evidence entries shown per alert (the payload of the JSON webhook always has all of them).
MAX_EVIDENCE = 8


def fmt_number(v: Any) -> str:
    """Compact number: 4 significant digits for floats, ints as is, NaN/Inf spelled out."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "Inf" if v > 0 else "-Inf"
        return f"{v:.4g}"
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return {"nan": "NaN", "inf": "Inf", "-inf": "-Inf"}[v]
    if isinstance(v, (list, tuple)):
        shown = ", ".join(fmt_number(x) for x in v[:8])
        return f"[{shown}{', …' if len(v) > 8 else ''}]"
    return str(v)


def evidence_items(evidence: Mapping[str, Any] | None, limit: int = MAX_EVIDENCE) -> list[tuple[str, str]]:
    """``(name, formatted value)`` of the evidence numbers; names ending in ``_s`` get `` s``."""
    out = []
    for k, v in [(k, v) for k, v in (evidence or {}).items() if v is not None][:limit]:
        text = fmt_number(v)
        if k.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool):
            text += " s"
        out.append((str(k), text))
    return out


def _skip(rec: Mapping[str, Any]) -> str:
    skip = rec.get("skip_steps")
    if isinstance(skip, (list, tuple)) and len(skip) == 2:
        return f"steps {skip[0]}-{skip[1]}"
    return ""


def recommendation_text(rec: Any) -> str | None:
    """The anomaly's ``recommendation`` as one line, or None when absent/empty.

    Accepts a string; the rollback advisor's dict (``docs/advisor.md``: ``action`` ``rollback``/``wait``/
    ``none_possible``, ``checkpoint_step``, ``skip_steps``, and ``summary`` when the alert worker found the
    stored recommendation; a ``summary``/``message``/``text`` wins); any other dict (``key value`` pairs);
    or a list of those.
    """
    if rec is None or rec == "" or rec == {} or rec == []:
        return None
    if isinstance(rec, str):
        return rec.strip() or None
    if isinstance(rec, Mapping):
        for k in ("summary", "message", "text"):
            if isinstance(rec.get(k), str) and rec[k].strip():
                return rec[k].strip()
        action, ck, skip = rec.get("action"), rec.get("checkpoint_step"), _skip(rec)
        if action == "rollback" and ck is not None:
            return f"Roll back to the checkpoint of step {ck}" + (f" and skip the batches of {skip}" if skip else "")
        if action == "wait":
            text = "Wait: the loss spike may still recover"
            if ck is not None:
                text += f"; if it does not, roll back to the checkpoint of step {ck}"
                text += f" and skip the batches of {skip}" if skip else ""
            return text
        if action == "none_possible":
            return ("No checkpoint before the onset: restart from scratch or from the earliest checkpoint"
                    + (f", skipping {skip}" if skip else ""))
        parts = [str(action)] if action else []
        parts += [f"{k} {fmt_number(v)}" for k, v in rec.items() if k not in ("action", "reason", "id")]
        if "reason" in rec:
            parts.append(f"reason: {rec['reason']}")
        return " · ".join(parts) or None
    if isinstance(rec, Sequence):
        items = [t for t in (recommendation_text(x) for x in rec) if t]
        return "; ".join(items) or None
    return str(rec)


def top_severity(alerts: Sequence[Alert]) -> str:
    """The most severe severity among ``alerts`` (``info`` when none)."""
    sev = {a.severity for a in alerts}
    return next((s for s in SEVERITY_ORDER if s in sev), "info")


def title(n: Notification, emoji: bool = True) -> str:
    """One-line title: ``:red_circle: CRITICAL · hang · run llama-8b`` / ``… RESOLVED · … (2 alerts)``."""
    common = n.common_labels()
    state = top_severity(n.firing).upper() if n.status == FIRING else "RESOLVED"
    icon = EMOJI[top_severity(n.firing)] if n.status == FIRING else EMOJI["resolved"]
    parts = [state, common.get("kind") or "alerts"]
    run = common.get("run")
    if run and run != "*":
        parts.append(f"run {run}")
    text = " · ".join(parts)
    count = len(n.firing) if n.status == FIRING else len(n.resolved)
    if count > 1:
        text += f" ({count} alerts)"
    return f"{icon} {text}" if emoji else text


def steps_words(anomaly: Mapping[str, Any]) -> str:
    """``steps 250–800`` / ``step 7`` / ``from step 4410`` (still open) / ``""``.

    >>> steps_words({"step": 4410, "end_step": None}), steps_words({"step": 250, "end_step": 800})
    ('from step 4410', 'steps 250–800')
    """
    start, end = anomaly.get("step"), anomaly.get("end_step")
    if start is None:
        return ""
    if end is None:
        return f"from step {start}"
    return f"step {start}" if end == start else f"steps {start}–{end}"


def where(alert: Alert) -> str:
    """``ranks 3, 5 on node-a`` / ``all ranks``."""
    ranks = alert.anomaly.get("ranks") or []
    hosts = alert.anomaly.get("hosts") or []
    text = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) if ranks else "all ranks"
    if hosts:
        text += " on " + ", ".join(map(str, hosts))
    return text


def summary(n: Notification, limit: int = 1024) -> str:
    """Plain one-liner (PagerDuty ``summary`` ≤ 1024 chars, Slack notification text)."""
    alerts = n.firing or n.resolved
    first = alerts[0] if alerts else None
    text = title(n, emoji=False)
    if first is not None:
        steps = steps_words(first.anomaly)
        text += f": {first.anomaly.get('message') or first.labels['kind']}"
        text += f" ({steps}, {where(first)})" if steps else f" ({where(first)})"
    return text if len(text) <= limit else text[: limit - 1] + "…"
