"""Where Redis is, and other settings read from the environment (standard library + redis-py).

Resolution order for the Redis URL: an explicit argument, then ``TRAINHEALTH_REDIS_URL``,
then the embedded server started by ``trainhealth serve``/``demo`` (its ``server.json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainhealth import defaults
from trainhealth.exceptions import ConfigError

_SCHEMES = ("redis://", "rediss://", "unix://")


def home_dir() -> Path:
    """trainhealth's home: ``$TRAINHEALTH_HOME`` or ``~/.trainhealth`` (created on use)."""
    return Path(os.environ.get(defaults.HOME_ENV) or defaults.HOME_DIR).expanduser()


def validate_url(url: str, field: str = "redis_url") -> str:
    """Return ``url`` when it is a ``redis://``, ``rediss://`` or ``unix://`` URL, else raise ConfigError."""
    if not isinstance(url, str) or not url.startswith(_SCHEMES):
        raise ConfigError(f"{field}={url!r} is not a Redis URL: expected redis://, rediss:// or unix://")
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


def retention_entries() -> int:
    """Step-stream retention (entries): ``$TRAINHEALTH_RETENTION`` or the default."""
    raw = os.environ.get(defaults.RETENTION_ENV)
    if not raw:
        return defaults.STEPS_RETENTION_ENTRIES
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1000:
        raise ConfigError(f"{defaults.RETENTION_ENV}={raw!r} must be an integer >= 1000 (stream entries)")
    return n
