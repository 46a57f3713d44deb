"""Delivery from the Redis outbox to a real local HTTP server: retries with exponential backoff and jitter on a
controllable clock, Retry-After on 429, dead letters and requeue, order within a group, and a crash between
sending and acknowledging (the receiver de-duplicates on the idempotency key). Real redis-server throughout."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import httpx
import pytest
import redis
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from trainhealth import alert_store as store
from trainhealth.alerts.config import DeliveryConfig
from trainhealth.alerts.notification import Alert, Notification
from trainhealth.alerts.outbox import Deliverer, backoff_delay, enqueue
from trainhealth.alerts.secrets import Secret
from trainhealth.alerts.signing import verify
from trainhealth.alerts.sinks import SlackSink, WebhookSink
from trainhealth.alerts.sinks.base import parse_retry_after
from trainhealth.keys import ALERTS_ATTEMPTS, ALERTS_DEAD, ALERTS_OUTBOX, ALERTS_RETRY, ALERTS_SENT

T = 1_800_000_000.0
SECRET = b"whsec-delivery"
POLICY = DeliveryConfig(max_attempts=4, backoff_base=1.0, backoff_max=300.0, jitter=0.5, retry_after_max=3600.0)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Receiver:
    """A webhook receiver that verifies signatures and remembers idempotency keys, as docs/alerts.md says. Every
    payload it receives is validated against docs/schemas/webhook-payload.json after the test (``_payloads``)."""

    #: The receivers of the running test.
    made: ClassVar[list[Receiver]] = []

    def __init__(self, statuses: list[int] | None = None, headers: dict[str, str] | None = None) -> None:
        self.statuses = list(statuses or [])
        self.headers = headers or {}
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.seen: dict[str, dict[str, Any]] = {}
        Receiver.made.append(self)

    def __call__(self, req: Request) -> Response:
        body = req.get_data()
        verify(body, req.headers.get("X-Trainhealth-Signature"), SECRET, now=T + 10_000, tolerance_s=1e9)
        key = req.headers["Idempotency-Key"]
        self.requests.append((key, json.loads(body)))
        status = self.statuses.pop(0) if self.statuses else 200
        if status < 300:
            self.seen.setdefault(key, json.loads(body))  # a repeated key is acknowledged, not processed again
        return Response("ok" if status < 300 else "nope", status, self.headers if status == 429 else {})


@pytest.fixture(autouse=True)
def _payloads(valid) -> Iterator[None]:
    """Every payload a receiver got is a document of the published schema."""
    Receiver.made.clear()
    yield
    for receiver in Receiver.made:
        for _, payload in receiver.requests:
            valid("webhook-payload", payload)
    Receiver.made.clear()


def note(seq: int = 1, group: str = 'root:{run="r1",kind="straggler"}', sinks: tuple[str, ...] = ("bot",),
         resolved: bool = False) -> Notification:
    """A straggler's alert, its anomaly as the detector service stores it."""
    a = Alert.from_transition("r1", "resolved" if resolved else "opened", {
        "id": "straggler:5:250:0", "kind": "straggler", "severity": "warning",
        "status": "resolved" if resolved else "active", "step": 250, "end_step": 300 if resolved else None,
        "ranks": [5], "hosts": ["n0"], "evidence": {"score": 0.6}, "message": "rank 5 is slow", "gen": 0,
        "first_seen": T, "last_seen": T})
    return Notification(group_key=group, route="root", receivers=sinks, group_labels={"run": "r1"}, seq=seq,
                        at=T + 30 * seq, reason="resolved" if resolved else "new",
                        firing=() if resolved else (a,), resolved=(a,) if resolved else (), group_started=T)


def put(r: redis.Redis, sinks: dict[str, Any], *notes: Notification) -> None:
    pipe = r.pipeline(transaction=True)
    for n in notes:
        enqueue(pipe, n, sinks, T)
    pipe.execute()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client() as c:
        yield c


def webhook(httpserver: HTTPServer, receiver: Receiver, path: str = "/hook", name: str = "bot") -> WebhookSink:
    httpserver.expect_request(path, method="POST").respond_with_handler(receiver)
    return WebhookSink(name, Secret(httpserver.url_for(path)), secret=Secret(SECRET.decode()), timeout=1.0)


def deliverer(r: redis.Redis, sinks: dict[str, Any], clock: Clock, http: httpx.Client, consumer: str = "d1",
              policy: DeliveryConfig = POLICY) -> Deliverer:
    return Deliverer(r, sinks, policy, consumer=consumer, clock=clock, rand=lambda: 0.5, http=http)


def scores(r: redis.Redis) -> list[float]:
    return [s for _, s in r.zrange(ALERTS_RETRY, 0, -1, withscores=True)]


def test_backoff_is_exponential_capped_and_jittered() -> None:
    assert [backoff_delay(n, 1.0, 300.0, 0.5, 0.5) for n in range(1, 12)] == [
        0.75, 1.5, 3.0, 6.0, 12.0, 24.0, 48.0, 96.0, 192.0, 225.0, 225.0]
    assert [backoff_delay(3, 1.0, 300.0, j, 0.999) for j in (0.0, 1.0)] == [4.0, pytest.approx(0.004)]


def test_500s_are_retried_with_backoff_then_delivered_once(r: redis.Redis, httpserver: HTTPServer,
                                                             http: httpx.Client) -> None:
    rx = Receiver([500, 500, 503])
    sinks = {"bot": webhook(httpserver, rx)}
    put(r, sinks, note())
    clock = Clock(T + 100)
    d = deliverer(r, sinks, clock, http)
    assert d.run_once() == 1 and scores(r) == [T + 100.75]  # 1 s x (1 - 0.5 x 0.5)
    assert d.run_once() == 0  # not due yet
    for expect_next in (T + 100.75 + 1.5, T + 102.25 + 3.0):
        clock.t = scores(r)[0]
        assert d.run_once() == 1 and scores(r) == [expect_next]
    book = json.loads(r.hget(ALERTS_ATTEMPTS, r.zrange(ALERTS_RETRY, 0, 0)[0]))
    assert (book["attempts"], book["last_status"], book["last_error"]) == (3, 503, "HTTP 503: nope")
    clock.t = scores(r)[0]
    assert d.run_once() == 1
    assert scores(r) == [] and r.hlen(ALERTS_ATTEMPTS) == 0 and r.llen(ALERTS_DEAD) == 0
    assert r.xpending(ALERTS_OUTBOX, "th-alerts-delivery")["pending"] == 0
    assert len(rx.requests) == 4 and len({k for k, _ in rx.requests}) == 1 and len(rx.seen) == 1
    assert {json.dumps(b, sort_keys=True) for _, b in rx.requests} == {json.dumps(rx.requests[0][1], sort_keys=True)}
    (_, sent), = r.xrange(ALERTS_SENT)
    assert (sent[b"attempts"], sent[b"http_status"], sent[b"status"], sent[b"sink"]) == (b"4", b"200", b"firing",
                                                                                           b"bot")
    state = store.sink_states(r)["bot"]
    assert (state["delivered"], state["consecutive_failures"], state["failed_attempts"], state["last_ok_at"]) == (
        1, 0, 3, T + 105.25)


def test_dead_letter_after_max_attempts_and_requeue_keeps_the_key(r: redis.Redis, httpserver: HTTPServer,
                                                                    http: httpx.Client) -> None:
    rx = Receiver([500] * 4)
    sinks = {"bot": webhook(httpserver, rx)}
    put(r, sinks, note())
    clock = Clock(T)
    d = deliverer(r, sinks, clock, http)
    for _ in range(4):
        d.run_once()
        clock.t = scores(r)[0] if scores(r) else clock.t
    assert scores(r) == [] and r.xpending(ALERTS_OUTBOX, "th-alerts-delivery")["pending"] == 0
    (letter,) = store.dead_letters(r)
    assert (letter["sink"], letter["attempts"], letter["status"], letter["error"], letter["seq"]) == (
        "bot", 4, 500, "gave up after 4 tries: HTTP 500: nope", "1")
    assert letter["notification"]["group_key"] == 'root:{run="r1",kind="straggler"}'
    assert store.sink_states(r)["bot"]["dead"] == 1
    assert store.requeue_dead(r) == 1 and store.dead_letters(r) == []
    assert d.run_once() == 1  # the receiver is back (no more scripted 500s)
    assert len(rx.requests) == 5 and len({k for k, _ in rx.requests}) == 1 == len(rx.seen)
    assert store.recent_notifications(r)[0]["attempts"] == 1


def test_a_refused_notification_is_dead_at_once(r: redis.Redis, httpserver: HTTPServer, http: httpx.Client) -> None:
    rx = Receiver([400])
    sinks = {"bot": webhook(httpserver, rx)}
    put(r, sinks, note())
    d = deliverer(r, sinks, Clock(T), http)
    assert d.run_once() == 1
    (letter,) = store.dead_letters(r)
    assert (letter["attempts"], letter["status"], letter["error"]) == (1, 400, "HTTP 400: nope")


def test_429_retry_after_pauses_the_sink_and_is_capped(r: redis.Redis, httpserver: HTTPServer,
                                                        http: httpx.Client) -> None:
    rx = Receiver([429], headers={"Retry-After": "30"})
    other_rx = Receiver()
    sinks = {"bot": webhook(httpserver, rx), "other": webhook(httpserver, other_rx, "/other", "other")}
    put(r, sinks, note(sinks=("bot", "other")), note(group='root:{run="r2",kind="hang"}'))
    clock = Clock(T)
    d = deliverer(r, sinks, clock, http)
    assert d.run_once() == 2  # bot: 429; other: delivered; bot's second notification waits for the pause
    assert len(rx.requests) == 1 and len(other_rx.requests) == 1
    assert scores(r) == [T + 30, T + 30]
    assert store.sink_states(r)["bot"]["paused_until"] == T + 30
    clock.t = T + 29.9
    assert d.run_once() == 0
    clock.t = T + 30
    assert d.run_once() == 2 and len(rx.seen) == 2
    # a Retry-After beyond retry_after_max is capped
    rx.statuses, rx.headers = [429], {"Retry-After": "99999"}
    put(r, sinks, note(seq=2, sinks=("bot",)))
    d.run_once()
    assert scores(r) == [T + 30 + 3600]


def test_notifications_of_one_group_are_delivered_in_order(r: redis.Redis, httpserver: HTTPServer,
                                                           http: httpx.Client) -> None:
    rx = Receiver([500])
    sinks = {"bot": webhook(httpserver, rx)}
    put(r, sinks, note(seq=1), note(seq=2, resolved=True))
    clock = Clock(T)
    d = deliverer(r, sinks, clock, http)
    assert d.run_once() == 1  # seq 1 fails; seq 2 must not overtake it
    assert [b["sequence"] for _, b in rx.requests] == [1]
    clock.t = T + 0.75
    assert d.run_once() == 2
    assert [(b["sequence"], b["status"]) for _, b in rx.requests] == [(1, "firing"), (1, "firing"), (2, "resolved")]


def test_a_crash_between_send_and_ack_resends_the_same_key_once(r: redis.Redis, httpserver: HTTPServer,
                                                               http: httpx.Client,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    rx = Receiver()
    sinks = {"bot": webhook(httpserver, rx)}
    put(r, sinks, note())
    first = deliverer(r, sinks, Clock(T), http, consumer="dies")

    def die(*_: Any) -> None:
        raise KeyboardInterrupt("killed after the POST, before the acknowledging transaction")

    monkeypatch.setattr(first, "_done", die)
    with pytest.raises(KeyboardInterrupt):
        first.run_once()
    assert len(rx.requests) == 1 and r.xpending(ALERTS_OUTBOX, "th-alerts-delivery")["pending"] == 1
    second = deliverer(r, sinks, Clock(T + 60), http, consumer="takes-over")
    assert second.run_once() == 1  # claims the dead consumer's entry and sends it again
    assert len(rx.requests) == 2 and rx.requests[0][0] == rx.requests[1][0] and len(rx.seen) == 1
    assert r.xpending(ALERTS_OUTBOX, "th-alerts-delivery")["pending"] == 0 and scores(r) == []
    assert r.xlen(ALERTS_SENT) == 1


def test_slack_sink_end_to_end_and_send_resolved(r: redis.Redis, httpserver: HTTPServer, http: httpx.Client) -> None:
    httpserver.expect_request("/services/T/B/x", method="POST").respond_with_data("ok")
    sinks = {"slack": SlackSink("slack", Secret(httpserver.url_for("/services/T/B/x")), send_resolved=False)}
    put(r, sinks, note(sinks=("slack",)), note(seq=2, sinks=("slack",), resolved=True))
    assert r.xlen(ALERTS_OUTBOX) == 1  # no resolved notifications for this sink
    d = deliverer(r, sinks, Clock(T), http)
    assert d.run_once() == 1
    msg = json.loads(httpserver.log[0][0].get_data())
    assert msg["blocks"][0]["text"]["text"] == ":large_orange_circle: WARNING · straggler · run r1"


@pytest.mark.parametrize(("value", "expected"), [
    ("²", None), ("١٢", None), ("garbage", None), ("", None), ("-5", None), ("1.5", None), (" 30 ", 30.0),
    ("Wed, 21 Oct 2015 07:28:10 GMT", 10.0), ("Wed, 21 Oct 99999 07:28:10 GMT", None), (None, None)])
def test_parse_retry_after_is_total(value: str | None, expected: float | None) -> None:
    # RFC 9110 §10.2.3: delay-seconds is 1*DIGIT (ASCII) or an HTTP-date; anything else means "no advice"
    assert parse_retry_after(value, now=1445412480.0) == expected


def test_500_then_429_with_a_garbage_retry_after_falls_back_to_the_backoff(r: redis.Redis, httpserver: HTTPServer,
                                                                            http: httpx.Client) -> None:
    rx = Receiver([500, 429], headers={"Retry-After": "²"})
    sinks = {"bot": webhook(httpserver, rx)}
    put(r, sinks, note())
    clock = Clock(T)
    d = deliverer(r, sinks, clock, http)
    assert d.run_once() == 1 and scores(r) == [T + 0.75]
    clock.t = T + 0.75
    assert d.run_once() == 1 and scores(r) == [T + 0.75 + 1.5]  # the backoff of try 2, as without Retry-After
    st = store.sink_states(r)["bot"]
    assert (st["last_error"], st["last_status"], st["paused_until"]) == ("HTTP 429: nope", 429, T + 2.25)
    clock.t = T + 2.25
    assert d.run_once() == 1 and len(rx.seen) == 1 and r.zcard(ALERTS_RETRY) == 0


class _Misbehaving(BaseHTTPRequestHandler):
    """``/hang``: answers after 3 s; ``/huge``: HTTP 500 with a 50 MB body (bytes actually written are counted)."""

    written = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/hang":
            time.sleep(3.0)
            self.send_response(200)
            self.end_headers()
            return
        self.send_response(500)
        self.send_header("Content-Length", str(50 * 2**20))
        self.end_headers()
        chunk = b"x" * 2**16
        try:
            for _ in range(50 * 2**4):
                self.wfile.write(chunk)
                type(self).written += len(chunk)
        except OSError:  # the client hung up
            pass

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def misbehaving() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    server.daemon_threads = True
    _Misbehaving.written = 0
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_hanging_or_flooding_sink_is_recorded_and_other_sinks_keep_delivering(
        r: redis.Redis, httpserver: HTTPServer, http: httpx.Client, misbehaving: str) -> None:
    rx = Receiver()
    secret = Secret(SECRET.decode())
    sinks = {"hang": WebhookSink("hang", Secret(misbehaving + "/hang"), secret=secret, timeout=0.5),
             "huge": WebhookSink("huge", Secret(misbehaving + "/huge"), secret=secret, timeout=5.0),
             "bot": webhook(httpserver, rx)}
    put(r, sinks, note(sinks=("hang", "huge", "bot")))
    d = deliverer(r, sinks, Clock(T), http)
    t0 = time.monotonic()
    assert d.run_once() == 3
    assert time.monotonic() - t0 < 3.0 and len(rx.seen) == 1
    st = store.sink_states(r)
    assert (st["hang"]["last_error"], st["hang"]["last_status"]) == ("timeout after 0.5 s (ReadTimeout)", None)
    assert (st["huge"]["last_error"], st["huge"]["last_status"]) == ("HTTP 500: " + "x" * 200, 500)
    assert _Misbehaving.written < 10 * 2**20  # the 50 MB error page was not downloaded
