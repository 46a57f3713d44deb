"""What every sink shares: the request it builds, the HTTP POST, and how a response is classified.

Classification (the delivery loop acts on it, see :mod:`trainhealth.alerts.outbox`):

- 2xx: delivered.
- 408, 425, 429 and 5xx, timeouts, connection errors: retryable; a ``Retry-After`` header (seconds or an
  HTTP date, RFC 9110 §10.2.3) is passed on. Slack answers 429 with ``Retry-After`` when a webhook posts
  more than about one message a second (https://api.slack.com/docs/rate-limits); PagerDuty's Events API v2
  says to retry 429 and 5xx and not 400 (https://developer.pagerduty.com/docs/events-api-v2/overview/).
- Any other status (400 bad payload, 403/404/410 revoked webhook or archived channel, 3xx): not
  retryable, the notification goes to the dead-letter list at once.

Error texts are scrubbed of the sink's secrets (:func:`~trainhealth.alerts.secrets.redact`) before anyone
logs or stores them.
"""

from __future__ import annotations

import dataclasses
import email.utils
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from trainhealth import __version__, defaults
from trainhealth.alerts.notification import Notification, json_safe
from trainhealth.alerts.secrets import Secret, redact

USER_AGENT = f"trainhealth/{__version__}"
RETRYABLE_STATUS = frozenset({408, 425, 429})
_DIGITS = re.compile(r"[0-9]+")
#: Bytes of an error response read for the error text; the rest is never downloaded (a 50 MB error page).
MAX_ERROR_BODY = 4096


@dataclass(frozen=True)
class Request:
    """One HTTP POST: ``url`` (a :class:`Secret`: webhook URLs are credentials), JSON ``body`` bytes, headers."""

    url: Secret
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SendResult:
    """Outcome of one delivery attempt.

    Attributes
    ----------
    ok : bool
        2xx received.
    status : int | None
        HTTP status, None when no response arrived (timeout, connection error).
    retryable : bool
        Worth trying again later.
    retry_after : float | None
        Seconds the server asked to wait (``Retry-After``), if it did.
    error : str
        Short description, secrets removed ("" when ok).
    """

    ok: bool
    status: int | None = None
    retryable: bool = False
    retry_after: float | None = None
    error: str = ""


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds or an HTTP date; None when absent/bad.

    >>> parse_retry_after("30"), parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0)
    (30.0, 10.0)
    """
    if value is None:
        return None
    try:
        value = value.strip()
        # delay-seconds is 1*DIGIT, ASCII only: str.isdigit() also accepts "²" or "١", which float() refuses.
        if _DIGITS.fullmatch(value):
            return float(value)
        when = email.utils.parsedate_to_datetime(value)
        now = time.time() if now is None else now
        return max(0.0, when.timestamp() - now)
    except (TypeError, ValueError, IndexError, OverflowError, AttributeError):  # garbage: the normal backoff
        return None


def dumps(payload: Mapping[str, Any]) -> bytes:
    """Compact UTF-8 JSON with NaN/Inf as strings (strict JSON), keys in insertion order."""
    return json.dumps(json_safe(payload), separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


class Sink:
    """Base class of the sinks. Subclasses set :attr:`type`, :attr:`OPTIONS` and implement :meth:`payload`.

    Parameters
    ----------
    name : str
        The sink's name in the config (``[sinks.<name>]``), used by routes.
    url : Secret
        Where to POST.
    send_resolved : bool
        Also notify when alerts resolve (Alertmanager's ``send_resolved``; default true).
    timeout : float
        Seconds for the HTTP request (connect, read, write each).
    dashboard_url : str
        Base URL of the dashboard for links.
    """

    type: ClassVar[str] = ""
    #: Optional keys of ``[sinks.<name>]`` besides ``type``, ``send_resolved``, ``timeout`` and the secrets.
    OPTIONS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, url: Secret, *, send_resolved: bool = True,
                 timeout: float = defaults.ALERT_HTTP_TIMEOUT_S, dashboard_url: str = defaults.ALERT_DASHBOARD_URL,
                 **options: Any) -> None:
        self.name = name
        self.url = url
        self.send_resolved = send_resolved
        self.timeout = timeout
        self.dashboard_url = dashboard_url
        self.options = options

    def secrets(self) -> tuple[Secret, ...]:
        """Every secret this sink holds (for :func:`~trainhealth.alerts.secrets.redact`)."""
        return (self.url,)

    def visible(self, n: Notification) -> Notification | None:
        """``n`` as this sink sees it: without resolved alerts unless ``send_resolved``; None if nothing is left."""
        if self.send_resolved:
            return n
        if not n.firing:
            return None
        return dataclasses.replace(n, resolved=())

    def payload(self, n: Notification, key: str) -> dict[str, Any]:
        """The JSON document for notification ``n`` with idempotency key ``key``."""
        raise NotImplementedError

    def headers(self, body: bytes, key: str, now: float) -> dict[str, str]:
        """HTTP headers for ``body`` (subclasses add signatures)."""
        return {"Content-Type": "application/json; charset=utf-8", "User-Agent": USER_AGENT}

    def request(self, n: Notification, key: str, now: float) -> Request:
        """The POST for notification ``n`` at unix time ``now``."""
        body = dumps(self.payload(n, key))
        return Request(self.url, body, self.headers(body, key, now))

    def describe(self) -> dict[str, Any]:
        """Safe-to-print summary (no secret values, only where they come from)."""
        return {"name": self.name, "type": self.type, "send_resolved": self.send_resolved, "timeout_s": self.timeout,
                "secrets": {"url": self.url.source}}

    def send(self, client: httpx.Client, req: Request, now: float | None = None) -> SendResult:
        """POST ``req`` with ``client``; never raises for HTTP or network trouble (see the module doc)."""
        secrets = self.secrets()
        try:
            # Streamed: a 2xx body is never read, an error body only up to MAX_ERROR_BODY bytes.
            with client.stream("POST", req.url.reveal(), content=req.body, headers=req.headers,
                               timeout=httpx.Timeout(self.timeout)) as resp:
                status = resp.status_code
                if 200 <= status < 300:
                    return SendResult(True, status)
                head = b""
                for chunk in resp.iter_bytes():
                    head += chunk
                    if len(head) >= MAX_ERROR_BODY:
                        break
                retry_after = parse_retry_after(resp.headers.get("Retry-After"), now)
        except httpx.TimeoutException as exc:
            return SendResult(False, None, True, None, f"timeout after {self.timeout:g} s ({type(exc).__name__})")
        except httpx.TransportError as exc:
            return SendResult(False, None, True, None, redact(f"{type(exc).__name__}: {exc}", secrets))
        except Exception as exc:  # malformed URL and the like: retrying will not help
            return SendResult(False, None, False, None, redact(f"{type(exc).__name__}: {exc}", secrets))
        snippet = " ".join(head[:MAX_ERROR_BODY].decode("utf-8", "replace")[:200].split())
        error = redact(f"HTTP {status}" + (f": {snippet}" if snippet else ""), secrets)
        retryable = status in RETRYABLE_STATUS or status >= 500
        return SendResult(False, status, retryable, retry_after, error)
