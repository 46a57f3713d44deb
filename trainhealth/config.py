"""Where Redis is, and other settings read from the environment (standard library + redis-py).

Resolution order for the Redis URL: an explicit argument, then ``TRAINHEALTH_REDIS_URL``,
then the embedded server started by ``trainhealth serve``/``demo`` (its ``server.json``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from trainhealth import defaults
from trainhealth.exceptions import ConfigError

_SCHEMES = ("redis://", "rediss://", "unix://")


def home_dir() -> Path:
    """trainhealth's home: ``$TRAINHEALTH_HOME`` or ``~/.trainhealth`` (created on use)."""
    return Path(os.environ.get(defaults.HOME_ENV) or defaults.HOME_DIR).expanduser()


def redact_url(url: Any) -> str:
    """A URL for display, its password hidden: ``redis://user:secret@host:6379/0`` → ``redis://user:***@host:6379/0``.

    Never raises: a URL that does not parse (a port that is no number, no ``://``) keeps only what follows its
    last ``@``; a ``password=`` query parameter (redis-py reads one) is hidden too; anything else is shown as
    its type.

    >>> redact_url("redis://:s3cret@db.example:6380/2"), redact_url("redis://u:pw@h:99999999/0")
    ('redis://:***@db.example:6380/2', 'redis://***@h:99999999/0')
    >>> redact_url("redis://127.0.0.1:6390/0"), redact_url("rediss//:pw@h"), redact_url("redis://h/0?password=pw")
    ('redis://127.0.0.1:6390/0', '***@h', 'redis://h/0?password=***')
    """
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    url = _PASSWORD_PARAM.sub(r"\1***", url)
    try:
        parts = urlsplit(url)
        if "://" not in url:
            raise ValueError("no scheme")
        if parts.password is None and "@" not in parts.netloc:
            return url
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, f"{parts.username or ''}:***@{host}", parts.path, parts.query,
                           parts.fragment))
    except ValueError:  # a port out of range, no scheme: keep what follows the credentials
        scheme, sep, rest = url.rpartition("://") if "://" in url else ("", "", url)
        return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else url


_PASSWORD_PARAM = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def validate_url(url: str, field: str = "redis_url") -> str:
    """Return ``url`` when it is a ``redis://``, ``rediss://`` or ``unix://`` URL with a valid port, else raise
    :class:`ConfigError` naming ``field`` and the URL with its password hidden (:func:`redact_url`)."""
    if not isinstance(url, str) or not url.startswith(_SCHEMES):
        raise ConfigError(f"{field}={redact_url(url)!r} is not a Redis URL: expected redis://, rediss:// or unix://")
    try:
        urlsplit(url).port  # noqa: B018 - parsing it raises for a port that is no number or out of range
    except ValueError as exc:
        raise ConfigError(f"{field}={redact_url(url)!r} is not a Redis URL: {exc}") from None
    return url


def embedded_server_file() -> Path:
    """JSON file the embedded server's owner writes: ``{"url", "pid", "port", "dir"}``."""
    return home_dir() / "redis" / "server.json"


def embedded_url() -> str | None:
    """URL of the embedded server recorded in :func:`embedded_server_file`, or None."""
    try:
        return json.loads(embedded_server_file().read_text())["url"]
    except (OSError, ValueError, KeyError):
        return None


def redis_url(explicit: str | None = None) -> str | None:
    """The Redis URL to use without starting anything, or None when none is configured."""
    if explicit:
        return validate_url(explicit)
    env = os.environ.get(defaults.REDIS_URL_ENV)
    if env:
        return validate_url(env, defaults.REDIS_URL_ENV)
    return embedded_url()


def retention_records() -> int:
    """Step-stream retention (records): ``$TRAINHEALTH_RETENTION`` or the default."""
    raw = os.environ.get(defaults.RETENTION_ENV)
    if not raw:
        return defaults.STEPS_RETENTION_RECORDS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1000:
        raise ConfigError(f"{defaults.RETENTION_ENV}={raw!r} must be an integer >= 1000 (records)")
    return n


def retention_bytes() -> int:
    """Step-stream retention (bytes of records): ``$TRAINHEALTH_RETENTION_BYTES`` or the default."""
    raw = os.environ.get(defaults.RETENTION_BYTES_ENV)
    if not raw:
        return defaults.STEPS_RETENTION_BYTES
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 2**20:
        raise ConfigError(f"{defaults.RETENTION_BYTES_ENV}={raw!r} must be an integer >= 1048576 (bytes)")
    return n
