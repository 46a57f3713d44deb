"""HMAC-SHA256 signatures of webhook bodies, and their verification (the receiver side).

Header (documented in ``docs/alerts.md``)::

    X-Trainhealth-Signature: t=<unix seconds, integer>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>

The signed message is the ASCII decimal timestamp, a dot, then the exact request body bytes. Signing
the timestamp lets a receiver reject replays older than a tolerance (default 5 minutes). The scheme is
Stripe's (``Stripe-Signature``); a receiver may see several ``v1=`` entries during a secret rotation
and must accept the request when any one verifies.

>>> header = sign(b'{"a":1}', b"s3cret", 1796000000)
>>> header
't=1796000000,v1=649ca62e19447ba11a46d1752a8e194c44ddd8c78dfd0b1c0c9c81710894705b'
>>> verify(b'{"a":1}', header, b"s3cret", now=1796000060)
1796000000
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "X-Trainhealth-Signature"
#: Seconds a signature stays acceptable to :func:`verify` by default.
TOLERANCE_S = 300


def signature(body: bytes, secret: bytes, t: int) -> str:
    """Hex HMAC-SHA256 of ``f"{t}."`` + ``body`` with key ``secret``."""
    return hmac.new(secret, f"{int(t)}.".encode() + body, hashlib.sha256).hexdigest()


def sign(body: bytes, secret: bytes, t: int) -> str:
    """The :data:`HEADER` value for ``body`` signed at unix time ``t`` (integer seconds)."""
    return f"t={int(t)},v1={signature(body, secret, t)}"


class SignatureError(ValueError):
    """The signature header is missing, malformed, too old, or does not match the body."""


def verify(body: bytes, header: str | None, secret: bytes, now: float | None = None,
           tolerance_s: float = TOLERANCE_S) -> int:
    """Check a :data:`HEADER` value against ``body``; returns the signed timestamp.

    Raises
    ------
    SignatureError
        Missing or malformed header, timestamp further than ``tolerance_s`` seconds from ``now``, or no
        ``v1`` entry equal (constant-time compare) to the expected HMAC.
    """
    if not header:
        raise SignatureError(f"missing {HEADER} header")
    t: int | None = None
    candidates: list[str] = []
    for part in header.split(","):
        k, _, v = part.strip().partition("=")
        if k == "t" and v.isdigit():
            t = int(v)
        elif k == "v1":
            candidates.append(v)
    if t is None or not candidates:
        raise SignatureError(f"malformed {HEADER} header (expected t=<unix>,v1=<hex>)")
    now = time.time() if now is None else now
    if abs(now - t) > tolerance_s:
        raise SignatureError(f"signature timestamp {t} is more than {tolerance_s:.0f} s from now ({now:.0f})")
    expected = signature(body, secret, t)
    if not any(hmac.compare_digest(expected, c) for c in candidates):
        raise SignatureError("signature does not match the body")
    return t
