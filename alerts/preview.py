"""See a Slack notification without Slack: Block Kit → a Slack-styled HTML page → a PNG (headless Chromium).

:func:`slack_html` renders the blocks the Slack sink sends (header, section with text and fields,
divider, context, actions) and Slack's mrkdwn (``*bold*``, ``_italic_``, ``~strike~``, ```code```,
``<url|label>`` links, ``<!date^…|fallback>`` dates, ``>`` quotes, the emoji codes the sink uses) in the
look of a Slack channel. :func:`screenshot` photographs it with Playwright driving a Chromium binary.
:func:`example_notifications` are the notifications shown in ``docs/alerts.md``; regenerate its picture with::

    python -m trainhealth.alerts.preview --png docs/alerts_slack.png --json docs/alerts_slack_example.json
"""

from __future__ import annotations

import argparse
import html
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainhealth.alerts.notification import Alert, Notification
from trainhealth.alerts.sinks.slack import render_slack

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
_EMOJI = {
    "red_circle": '<span class="dot" style="background:#e01e5a"></span>',
    "large_orange_circle": '<span class="dot" style="background:#f2952f"></span>',
    "large_blue_circle": '<span class="dot" style="background:#1d9bd1"></span>',
    "white_check_mark": '<span class="check">&#10003;</span>',
    "rewind": '<span class="rew">&#8634;</span>',
}
_CSS = """
body { margin: 0; background: #fff; font-family: Lato, 'Liberation Sans', 'DejaVu Sans', Arial, sans-serif;
       color: #1d1c1d; font-size: 15px; line-height: 1.4667; }
.chan { border-bottom: 1px solid #e2e2e2; padding: 12px 20px; font-weight: 900; font-size: 18px; }
.chan small { font-weight: 400; color: #616061; font-size: 13px; margin-left: 8px; }
.msg { display: flex; padding: 10px 20px 12px; }
.msg:hover { background: #f8f8f8; }
.avatar { width: 36px; height: 36px; border-radius: 6px; background: #2e7d5b; color: #fff; font-weight: 900;
          font-size: 14px; display: flex; align-items: center; justify-content: center; margin-right: 8px;
          flex: none; }
.body { flex: 1; min-width: 0; max-width: 720px; }
.who b { font-weight: 900; } .app { background: #e8e8e8; color: #616061; font-size: 10px; font-weight: 700;
        padding: 1px 3px; border-radius: 2px; margin: 0 4px; vertical-align: 1px; }
.time { color: #616061; font-size: 12px; }
.header { font-size: 18px; font-weight: 900; margin: 4px 0 6px; }
.section { margin: 4px 0; word-wrap: break-word; }
.fields { display: grid; grid-template-columns: 1fr 1fr; gap: 6px 16px; margin: 6px 0; }
.divider { border: 0; border-top: 1px solid #dddddd; margin: 10px 0; }
.context { color: #616061; font-size: 12.5px; margin: 6px 0; }
code { color: #c01343; background: #f6f6f6; border: 1px solid #dddddd; border-radius: 3px; padding: 0 3px;
       font-family: Monaco, Menlo, 'DejaVu Sans Mono', monospace; font-size: 12px; }
a { color: #1264a3; text-decoration: none; }
.dot { display: inline-block; width: 13px; height: 13px; border-radius: 50%; vertical-align: -1px; }
.check { display: inline-block; width: 15px; height: 15px; border-radius: 3px; background: #2eb67d; color: #fff;
         font-size: 12px; line-height: 15px; text-align: center; font-weight: 900; vertical-align: 0; }
.rew { color: #1264a3; font-weight: 900; }
.btn { display: inline-block; border: 1px solid #bbbbbb; border-radius: 4px; padding: 3px 12px; font-weight: 700;
       font-size: 13px; margin-right: 8px; color: #1d1c1d; }
"""


def _inline(text: str) -> str:
    """mrkdwn inline styles of entity-escaped text (Slack escapes ``&<>`` itself, as HTML does)."""
    parts = text.split("`")
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 1 and i < len(parts) - 1:
            out.append(f"<code>{part}</code>")
            continue
        if i % 2 == 1:  # an unmatched backtick
            part = "`" + part
        part = part.replace('"', "&quot;")
        part = re.sub(r"(?<![\w*])\*([^*\n]+)\*(?![\w*])", r"<b>\1</b>", part)
        part = re.sub(r"(?<![\w_])_([^_\n]+)_(?![\w_])", r"<i>\1</i>", part)
        part = re.sub(r"(?<![\w~])~([^~\n]+)~(?![\w~])", r"<s>\1</s>", part)
        part = re.sub(r":([a-z0-9_+-]+):", lambda m: _EMOJI.get(m.group(1), m.group(0)), part)
        out.append(part)
    return "".join(out)


def mrkdwn_html(text: str) -> str:
    """Slack mrkdwn → HTML (links, dates, styles, quotes, line breaks).

    >>> mrkdwn_html("*a* <https://x/y?a=1&amp;b=2|open ›> `k` 1 &lt; 2")
    '<b>a</b> <a href="https://x/y?a=1&amp;b=2">open ›</a> <code>k</code> 1 &lt; 2'
    """
    out, pos = [], 0
    for m in re.finditer(r"<([^<>\n]+)>", text):
        out.append(_inline(text[pos:m.start()]))
        inner = m.group(1)
        target, _, label = inner.partition("|")
        if target.startswith("!date^"):
            out.append(f'<span class="date">{label}</span>')
        elif target.startswith(("http://", "https://", "mailto:")):
            out.append(f'<a href="{target.replace(chr(34), "&quot;")}">{_inline(label or target)}</a>')
        else:
            out.append(_inline(f"&lt;{inner}&gt;"))
        pos = m.end()
    out.append(_inline(text[pos:]))
    lines = "".join(out).split("\n")
    lines = [f'<span style="border-left:4px solid #ddd;padding-left:8px">{ln[4:]}</span>'
             if ln.startswith("&gt; ") else ln for ln in lines]
    return "<br>".join(lines)


def _text(obj: dict[str, Any] | None) -> str:
    if not obj:
        return ""
    if obj.get("type") == "plain_text":
        t = html.escape(obj.get("text", ""), quote=False)
        return re.sub(r":([a-z0-9_+-]+):", lambda m: _EMOJI.get(m.group(1), m.group(0)), t) if obj.get("emoji") else t
    return mrkdwn_html(obj.get("text", ""))


def blocks_html(blocks: Sequence[dict[str, Any]]) -> str:
    """HTML of a list of Block Kit blocks (the types the sinks use; others are shown as their JSON)."""
    out = []
    for b in blocks:
        kind = b.get("type")
        if kind == "header":
            out.append(f'<div class="header">{_text(b.get("text"))}</div>')
        elif kind == "section":
            if b.get("text"):
                out.append(f'<div class="section">{_text(b["text"])}</div>')
            if b.get("fields"):
                cells = "".join(f"<div>{_text(f)}</div>" for f in b["fields"])
                out.append(f'<div class="fields">{cells}</div>')
        elif kind == "divider":
            out.append('<hr class="divider">')
        elif kind == "context":
            out.append('<div class="context">' + " ".join(_text(e) for e in b.get("elements", [])) + "</div>")
        elif kind == "actions":
            out.append('<div class="section">' + "".join(
                f'<a class="btn" href="{html.escape(e.get("url", "#"))}">{_text(e.get("text"))}</a>'
                for e in b.get("elements", [])) + "</div>")
        else:
            out.append(f"<pre>{html.escape(json.dumps(b, indent=1))}</pre>")
    return "".join(out)


def slack_html(messages: Sequence[dict[str, Any]], times: Sequence[float] | None = None,
               channel: str = "training-oncall", app: str = "trainhealth") -> str:
    """A Slack-channel-like HTML page showing each incoming-webhook ``message`` (its ``blocks``, else ``text``)."""
    rows = []
    for i, msg in enumerate(messages):
        when = time.strftime("%H:%M", time.gmtime(times[i])) if times else ""
        body = blocks_html(msg["blocks"]) if msg.get("blocks") else mrkdwn_html(msg.get("text", ""))
        rows.append(f'<div class="msg"><div class="avatar">th</div><div class="body"><div class="who"><b>{app}</b>'
                    f'<span class="app">APP</span><span class="time">{when}</span></div>{body}</div></div>')
    return (f'<!doctype html><html><head><meta charset="utf-8"><style>{_CSS}</style></head><body>'
            f'<div class="chan"># {html.escape(channel)}<small>training run alerts</small></div>{"".join(rows)}'
            "</body></html>")


def screenshot(page_html: str, png: str | Path, width: int = 860, executable: str = CHROMIUM) -> Path:
    """Render ``page_html`` in headless Chromium (via Playwright) and save a full-page PNG; returns its path."""
    from playwright.sync_api import sync_playwright

    out = Path(png)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": 600}, device_scale_factor=1)
            page.set_content(page_html, wait_until="load")
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    return out


# -- the documented example ---------------------------------------------------------------------------------
T0 = 1796036590.0  # 2026-11-30 11:03:10 UTC
RUN = "llama-8b-pretrain"
DASHBOARD = "https://trainhealth.example.com"


def _alert(transition: str, **anomaly: Any) -> Alert:
    return Alert.from_transition(RUN, transition, {"run": RUN, **anomaly})


def example_notifications() -> list[Notification]:
    """Three notifications of one run, as the Slack sink receives them: a critical loss spike with the
    rollback advisor's recommendation, a straggler, and the straggler's resolve."""
    spike = _alert("updated", id="loss_spike:*:4410:0", kind="loss_spike", severity="critical", status="active",
                   step=4410, end_step=None, ranks=[], hosts=[],
                   evidence={"loss": 7.912, "baseline": 2.214, "z": 14.3, "peak": 7.912, "peak_step": 4410,
                             "recovery_steps": None, "recovered": False},
                   message="loss 7.912 at step 4410 is 3.57x the expected 2.214 (14.3 robust SDs); did not recover",
                   recommendation={"id": "rec:loss_spike:*:4410:0", "action": "rollback", "checkpoint_step": 4000,
                                   "skip_steps": [4310, 4610],
                                   "summary": "Roll back to the checkpoint of step 4000 and skip the batches of "
                                              "steps 4310-4610: recomputes 520 steps (118.6 GPU-h, $296)"},
                   first_seen=T0, last_seen=T0 + 95.0)
    strag = dict(id="straggler:5:3900:0", kind="straggler", severity="warning", step=3900, ranks=[5],
                 hosts=["gpu-node-07"],
                 evidence={"score": 0.62, "rank_median_s": 0.2431, "best_median_s": 0.1507,
                           "typical_median_s": 0.1522, "windows": 3},
                 message="rank 5 is a straggler: its sections take 243.1 ms (median) vs 150.7 ms on the fastest "
                         "rank (score 0.62 < 0.8) since step 3900; every rank waits for it at the all-reduce",
                 first_seen=T0 - 600.0)
    firing = _alert("opened", status="active", end_step=None, last_seen=T0 - 600.0, **strag)
    over = _alert("resolved", **{**strag, "status": "resolved", "end_step": 4380, "last_seen": T0 + 840.0,
                                 "message": "rank 5 was a straggler from step 3900 to 4380; back to score 0.97",
                                 "evidence": {**strag["evidence"], "score": 0.97}})
    common = {"route": "page", "receivers": ("oncall-slack",)}
    return [
        Notification(group_key=f'page:{{run="{RUN}",kind="loss_spike"}}', group_labels={"run": RUN,
                                                                                      "kind": "loss_spike"},
                     seq=2, at=T0 + 100.0, reason="update", firing=(spike,), group_started=T0 - 20.0, **common),
        Notification(group_key=f'root:{{run="{RUN}",kind="straggler"}}', group_labels={"run": RUN,
                                                                                     "kind": "straggler"},
                     seq=1, at=T0 - 570.0, reason="new", firing=(firing,), group_started=T0 - 600.0, **common),
        Notification(group_key=f'root:{{run="{RUN}",kind="straggler"}}', group_labels={"run": RUN,
                                                                                     "kind": "straggler"},
                     seq=2, at=T0 + 1030.0, reason="resolved", resolved=(over,), group_started=T0 - 600.0, **common),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render the documented example Slack notifications.")
    p.add_argument("--png", help="write a screenshot (needs Playwright and Chromium)")
    p.add_argument("--html", help="write the HTML page")
    p.add_argument("--json", help="write the Slack messages (JSON list)")
    p.add_argument("--chromium", default=CHROMIUM, help=f"Chromium binary (default {CHROMIUM})")
    args = p.parse_args(argv)
    notes = example_notifications()
    messages = [render_slack(n, DASHBOARD) for n in notes]
    page = slack_html(messages, [n.at for n in notes])
    if args.html:
        Path(args.html).write_text(page)
    if args.json:
        Path(args.json).write_text(json.dumps(messages, indent=2, ensure_ascii=False) + "\n")
    if args.png:
        screenshot(page, args.png, executable=args.chromium)
    if not (args.html or args.json or args.png):
        print(json.dumps(messages[0], indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
