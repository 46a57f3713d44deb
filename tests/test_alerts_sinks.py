"""Sinks against a real local HTTP server (pytest-httpserver): payload shapes, signatures checked with the
documented algorithm, and how 2xx, 4xx, 429 with Retry-After, 5xx, timeouts and refused connections are read."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from pathlib import Path

import httpx
import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from trainhealth.alerts.notification import Alert, Notification
from trainhealth.alerts.preview import DASHBOARD, example_notifications, mrkdwn_html, slack_html
from trainhealth.alerts.secrets import Secret
from trainhealth.alerts.signing import SignatureError, verify
from trainhealth.alerts.sinks import PagerDutySink, SlackSink, WebhookSink
from trainhealth.alerts.sinks.pagerduty import dedup_key, pagerduty_event
from trainhealth.alerts.sinks.slack import render_slack
from trainhealth.alerts.sinks.webhook import webhook_payload

ROOT = Path(__file__).resolve().parent.parent
SECRET = "whsec-test-123"


def straggler_notification() -> Notification:
    """First notification of a straggler group: rank 5 on node-0 since step 250 (a NaN in the evidence), its
    anomaly as the detector service stores it."""
    a = Alert.from_transition("r1", "opened", {
        "id": "straggler:5:250:0", "kind": "straggler", "severity": "warning", "status": "active",
        "step": 250, "end_step": None, "ranks": [5], "hosts": ["node-0"],
        "evidence": {"score": 0.62, "loss": float("nan")}, "message": "rank 5 is a straggler since step 250",
        "gen": 0, "first_seen": 1_800_000_000.0, "last_seen": 1_800_000_000.0})
    return Notification(group_key='root:{run="r1",kind="straggler"}', route="root", receivers=("bot",),
                        group_labels={"run": "r1", "kind": "straggler"}, seq=1, at=1_800_000_030.0, reason="new",
                        firing=(a,), group_started=1_800_000_000.0)


@pytest.fixture
def http() -> httpx.Client:
    with httpx.Client() as c:
        yield c


def test_slack_message_has_severity_run_kind_steps_ranks_evidence_link_and_recommendation() -> None:
    spike, strag, over = (render_slack(n, DASHBOARD) for n in example_notifications())
    blocks = spike["blocks"]
    assert [b["type"] for b in blocks] == ["header", "section", "section", "section", "section", "divider", "context"]
    assert blocks[0]["text"] == {"type": "plain_text", "text": ":red_circle: CRITICAL · loss_spike · run "
                                                               "llama-8b-pretrain", "emoji": True}
    assert spike["text"] == ("CRITICAL · loss_spike · run llama-8b-pretrain: loss 7.912 at step 4410 is 3.57x the "
                             "expected 2.214 (14.3 robust SDs); did not recover (from step 4410, all ranks)")
    assert blocks[1]["text"]["text"] == (
        ":red_circle: *loss 7.912 at step 4410 is 3.57x the expected 2.214 (14.3 robust SDs); did not recover*\n"
        "<https://trainhealth.example.com/anomalies?run=llama-8b-pretrain&step=4410|Open in dashboard: run "
        "llama-8b-pretrain, from step 4410 ›>")
    assert [f["text"] for f in blocks[2]["fields"]] == [
        "*Severity*\ncritical · firing since <!date^1796036590^{date_short_pretty} {time_secs}|2026-11-30 11:03:10 "
        "UTC>", "*Run*\n`llama-8b-pretrain`", "*Kind*\n`loss_spike`", "*Steps*\nfrom step 4410 (ongoing)",
        "*Ranks / hosts*\nall ranks"]
    assert blocks[3]["text"]["text"] == ("*Evidence*\n`loss` 7.912  ·  `baseline` 2.214  ·  `z` 14.3  ·  `peak` "
                                         "7.912  ·  `peak_step` 4410  ·  `recovered` no")
    assert blocks[4]["text"]["text"] == (
        ":rewind: *Recommendation*\nRoll back to the checkpoint of step 4000 and skip the batches of steps "
        "4310-4610: recomputes 520 steps (118.6 GPU-h, $296)\nCosts and launcher arguments: "
        "`trainhealth advise llama-8b-pretrain --id rec:loss_spike:*:4410:0`")
    # the straggler: rank and host, link with step and rank; no recommendation block without one
    assert strag["blocks"][1]["text"]["text"].endswith(
        "<https://trainhealth.example.com/anomalies?run=llama-8b-pretrain&step=3900&rank=5|Open in dashboard: run "
        "llama-8b-pretrain, from step 3900, rank 5 ›>")
    assert strag["blocks"][2]["fields"][4]["text"] == "*Ranks / hosts*\nrank 5 on gpu-node-07"
    assert not any("Recommendation" in b.get("text", {}).get("text", "") for b in strag["blocks"])
    # the resolve: closed step range in the link
    assert over["blocks"][0]["text"]["text"] == ":white_check_mark: RESOLVED · straggler · run llama-8b-pretrain"
    assert "step=3900-4380&rank=5|" in over["blocks"][1]["text"]["text"]
    assert over["blocks"][2]["fields"][3]["text"] == "*Steps*\nsteps 3900–4380"


def test_slack_message_stays_within_block_kit_limits() -> None:
    run = "r" * 120
    alerts = tuple(Alert.from_transition(run, "opened", {
        "id": f"straggler:{r}:10:0", "kind": "straggler", "severity": "warning", "status": "active", "step": 10,
        "end_step": None, "ranks": [r], "hosts": ["h"], "evidence": {"score": 0.5}, "message": "<&>" * 2000,
        "first_seen": 0.0, "last_seen": 0.0}) for r in range(20))
    n = Notification(group_key="g", route="root", receivers=("s",), group_labels={"run": run}, seq=1, at=0.0,
                     reason="new", firing=alerts)
    msg = render_slack(n)
    assert len(msg["blocks"]) == 6 * 4 + 2 and len(msg["blocks"]) <= 50  # 6 alerts of 4 blocks, header, footer
    assert len(msg["blocks"][0]["text"]["text"]) == 150 and msg["blocks"][0]["text"]["text"].endswith("…")
    assert all(len(b["text"]["text"]) <= 3000 for b in msg["blocks"] if b["type"] == "section" and "text" in b)
    assert "&lt;&amp;&gt;" in msg["blocks"][1]["text"]["text"]  # mrkdwn escaping
    assert msg["blocks"][-1]["elements"][0]["text"] == "*…and 14 more alerts* (see the dashboard)"
    assert len(render_slack(n, max_alerts=7)["blocks"]) == 30


def test_docs_show_the_rendered_slack_message_and_its_picture() -> None:
    doc = (ROOT / "docs" / "alerts.md").read_text()
    start = doc.index("```json slack-example") + len("```json slack-example")
    shown = json.loads(doc[start:doc.index("```", start)])
    assert shown == render_slack(example_notifications()[0], DASHBOARD)
    assert (ROOT / "docs" / "alerts_slack.png").stat().st_size > 20_000
    page = slack_html([render_slack(n, DASHBOARD) for n in example_notifications()])
    assert page.count('class="msg"') == 3 and '<a href="https://trainhealth.example.com/anomalies?run=' in page
    assert mrkdwn_html("<!date^1^{date}|1970-01-01> ~x~ _y_") == (
        '<span class="date">1970-01-01</span> <s>x</s> <i>y</i>')


def test_the_documented_receiver_snippet_verifies_and_deduplicates() -> None:
    doc = (ROOT / "docs" / "alerts.md").read_text()
    start = doc.index("```python receiver-example") + len("```python receiver-example")
    scope: dict = {}
    exec(doc[start:doc.index("```", start)], scope)
    sink = WebhookSink("bot", Secret("https://h/x"), secret=Secret(SECRET))
    n = straggler_notification()
    req = sink.request(n, n.idempotency_key("bot"), time.time())
    assert scope["handle"](req.headers, req.body, SECRET.encode()) == 200
    assert scope["SEEN"] == {n.idempotency_key("bot")}
    assert scope["handle"](req.headers, req.body, SECRET.encode()) == 200  # the retry: acknowledged only
    assert scope["handle"](req.headers, req.body + b" ", SECRET.encode()) == 401
    old = sink.request(n, "k2", time.time() - 301)
    assert scope["handle"](old.headers, old.body, SECRET.encode()) == 400


def test_webhook_payload_headers_and_signature_verified_by_the_documented_algorithm(httpserver: HTTPServer,
                                                                                    http: httpx.Client,
                                                                                    valid) -> None:
    httpserver.expect_request("/hook", method="POST").respond_with_data("ok")
    sink = WebhookSink("bot", Secret(httpserver.url_for("/hook")), secret=Secret(SECRET),
                       dashboard_url="http://dash:8501")
    n = straggler_notification()
    key = n.idempotency_key("bot")
    now = 1_800_000_100.0
    result = sink.send(http, sink.request(n, key, now), now)
    assert (result.ok, result.status, result.error) == (True, 200, "")
    (req, _), = httpserver.log
    body = req.get_data()
    # the receiver's side, with nothing but the documented recipe: HMAC-SHA256(secret, "<t>." + raw body)
    header = req.headers["X-Trainhealth-Signature"]
    t, v1 = (p.split("=", 1)[1] for p in header.split(","))
    assert t == "1800000100"
    assert v1 == hmac.new(SECRET.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    assert verify(body, header, SECRET.encode(), now=now + 60) == 1_800_000_100
    with pytest.raises(SignatureError, match="does not match"):
        verify(body + b" ", header, SECRET.encode(), now=now)
    with pytest.raises(SignatureError, match="more than 300 s"):
        verify(body, header, SECRET.encode(), now=now + 301)
    assert req.headers["Idempotency-Key"] == key == n.idempotency_key("bot")
    assert req.headers["X-Trainhealth-Payload-Version"] == "1"
    assert req.headers["Content-Type"] == "application/json; charset=utf-8"
    assert req.headers["User-Agent"].startswith("trainhealth/")
    payload = valid("webhook-payload", body)
    a = n.firing[0]
    assert payload == {
        "version": "1", "idempotency_key": key, "receiver": "bot", "status": "firing", "reason": "new",
        "group_key": 'root:{run="r1",kind="straggler"}', "sequence": 1, "notified_at": 1_800_000_030.0,
        "group_labels": {"run": "r1", "kind": "straggler"},
        "common_labels": {"run": "r1", "kind": "straggler", "severity": "warning", "rank": "5", "host": "node-0"},
        "alerts": [{"key": "r1/straggler:5:250:0", "status": "firing", "point_event": False,
                    "labels": {"run": "r1", "kind": "straggler", "severity": "warning", "rank": "5", "host": "node-0"},
                    "starts_at": 1_800_000_000.0, "ends_at": None,
                    "dashboard_url": "http://dash:8501/anomalies?run=r1&step=250&rank=5",
                    "anomaly": {**a.anomaly, "evidence": {"score": 0.62, "loss": "nan"}}}]}
    assert webhook_payload(n, key, "bot", "http://dash:8501")["alerts"][0]["anomaly"]["evidence"]["loss"] != "nan"


def test_pagerduty_trigger_and_resolve_share_the_dedup_key(httpserver: HTTPServer, http: httpx.Client) -> None:
    httpserver.expect_request("/v2/enqueue", method="POST").respond_with_json(
        {"status": "success", "message": "Event processed", "dedup_key": "x"}, status=202)
    sink = PagerDutySink("pd", Secret(httpserver.url_for("/v2/enqueue")), routing_key=Secret("R" * 32),
                         dashboard_url="http://dash:8501")
    n = straggler_notification()
    assert sink.send(http, sink.request(n, "k", 0.0)).ok
    event = json.loads(httpserver.log[0][0].get_data())
    assert event == {
        "routing_key": "R" * 32, "dedup_key": 'root:{run="r1",kind="straggler"}', "event_action": "trigger",
        "payload": {"summary": "WARNING · straggler · run r1: rank 5 is a straggler since step 250 (from step 250, "
                               "rank 5 on node-0)",
                    "source": "node-0", "severity": "warning", "timestamp": "2027-01-15T08:00:30Z",
                    "component": "rank 5", "group": "r1", "class": "straggler",
                    "custom_details": {"group_labels": {"run": "r1", "kind": "straggler"}, "notification": 1,
                                       "reason": "new", "resolved": [],
                                       "firing": [{"status": "firing", "kind": "straggler", "severity": "warning",
                                                   "steps": "250–", "ranks": [5], "hosts": ["node-0"],
                                                   "message": "rank 5 is a straggler since step 250",
                                                   "evidence": {"score": 0.62, "loss": "nan"}}]}},
        "client": "trainhealth", "client_url": "http://dash:8501/anomalies?run=r1&step=250&rank=5",
        "links": [{"href": "http://dash:8501/anomalies?run=r1&step=250&rank=5",
                   "text": "Open in the trainhealth dashboard"}]}
    resolved = Notification(**{**n.__dict__, "seq": 2, "reason": "resolved", "firing": (), "resolved": n.firing})
    assert pagerduty_event(resolved, "R" * 32, "http://d") == {
        "routing_key": "R" * 32, "dedup_key": 'root:{run="r1",kind="straggler"}', "event_action": "resolve"}
    assert dedup_key("x" * 300) == hashlib.sha256(b"x" * 300).hexdigest()


def _sink(httpserver: HTTPServer, path: str, timeout: float = 2.0) -> SlackSink:
    return SlackSink("s", Secret(httpserver.url_for(path)), timeout=timeout)


def test_responses_are_classified_and_errors_carry_no_secret(httpserver: HTTPServer, http: httpx.Client) -> None:
    n = straggler_notification()
    cases = [
        ("/T0/B0/ok", Response("ok", 200), (True, 200, False, None, "")),
        ("/T0/B0/boom", Response("boom", 500), (False, 500, True, None, "HTTP 500: boom")),
        ("/T0/B0/bad", Response("invalid_payload", 400), (False, 400, False, None, "HTTP 400: invalid_payload")),
        ("/T0/B0/gone", Response("channel_is_archived", 410), (False, 410, False, None,
                                                               "HTTP 410: channel_is_archived")),
        ("/T0/B0/slow-down", Response('{"ok":false,"error":"ratelimited"}', 429, {"Retry-After": "7"}),
         (False, 429, True, 7.0, 'HTTP 429: {"ok":false,"error":"ratelimited"}')),
        ("/T0/B0/unavail", Response("later", 503, {"Retry-After": "Wed, 21 Oct 2015 07:28:10 GMT"}),
         (False, 503, True, 0.0, "HTTP 503: later")),
        ("/T0/B0/moved", Response("", 301, {"Location": "https://elsewhere/"}), (False, 301, False, None, "HTTP 301")),
    ]
    for path, response, _ in cases:
        httpserver.expect_request(path).respond_with_response(response)
    # a server that echoes the (secret) URL back must not leak it through our error text
    httpserver.expect_request("/T0/B0/SECRETPART").respond_with_handler(
        lambda req: Response(f"no such hook {req.url}", 404))
    for path, _, expected in cases:
        sink = _sink(httpserver, path)
        r = sink.send(http, sink.request(n, "k", 0.0), now=time.time())
        assert (r.ok, r.status, r.retryable, r.retry_after, r.error) == expected, path
    sink = _sink(httpserver, "/T0/B0/SECRETPART")
    r = sink.send(http, sink.request(n, "k", 0.0))
    assert (r.status, r.retryable, r.error) == (404, False, "HTTP 404: no such hook ***")


def test_timeouts_and_refused_connections_are_retryable(httpserver: HTTPServer, http: httpx.Client) -> None:
    def slow(_: Request) -> Response:
        time.sleep(0.6)
        return Response("ok")

    httpserver.expect_request("/slow").respond_with_handler(slow)
    sink = _sink(httpserver, "/slow", timeout=0.2)
    t0 = time.monotonic()
    r = sink.send(http, sink.request(straggler_notification(), "k", 0.0))
    assert time.monotonic() - t0 < 0.55
    assert (r.ok, r.status, r.retryable, r.error) == (False, None, True, "timeout after 0.2 s (ReadTimeout)")
    time.sleep(0.5)  # let the single-threaded test server finish the slow answer
    refused = SlackSink("s", Secret("http://127.0.0.1:9/hooks/SECRETPART"), timeout=1.0)
    r = refused.send(http, refused.request(straggler_notification(), "k", 0.0))
    assert (r.ok, r.status, r.retryable) == (False, None, True)
    assert r.error.startswith("ConnectError: ") and "SECRETPART" not in r.error


def test_send_resolved_false_drops_resolved_alerts() -> None:
    n = straggler_notification()
    sink = SlackSink("s", Secret("https://h/x"), send_resolved=False)
    only_resolved = Notification(**{**n.__dict__, "firing": (), "resolved": n.firing})
    assert sink.visible(only_resolved) is None
    mixed = Notification(**{**n.__dict__, "resolved": n.firing})
    assert sink.visible(mixed).resolved == () and sink.visible(mixed).firing == n.firing
    assert SlackSink("s", Secret("https://h/x")).visible(only_resolved) is only_resolved
