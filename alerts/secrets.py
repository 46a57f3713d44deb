"""Secrets (webhook URLs, signing keys, routing keys): read from the environment or a file, never shown.

A :class:`Secret` prints as ``***`` (``str``, ``repr``, f-strings, logging), so passing one to a log call
or an exception message cannot leak it; only :meth:`Secret.reveal` returns the value, and only the HTTP
layer calls it. :func:`redact` scrubs secret values out of any text (an error message quoting a URL)
before it is logged or stored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from trainhealth.exceptions import ConfigError


class Secret:
    """A secret string that never prints itself.

    >>> s = Secret("https://hooks.slack.com/services/T0/B0/xyz", "env TH_SLACK_URL")
    >>> str(s), repr(s), f"{s}"
    ('***', "Secret('***' from env TH_SLACK_URL)", '***')
    >>> s.reveal()[-3:]
    'xyz'
    """

    __slots__ = ("_source", "_value")

    def __init__(self, value: str, source: str = "") -> None:
        self._value = value
        self._source = source

    def reveal(self) -> str:
        """The secret value (for the HTTP request only)."""
        return self._value

    @property
    def source(self) -> str:
        """Where it came from, e.g. ``env TH_SLACK_URL`` or ``file /run/secrets/slack`` (safe to print)."""
        return self._source

    def __str__(self) -> str:
        return "***"

    def __repr__(self) -> str:
        return f"Secret('***' from {self._source})" if self._source else "Secret('***')"

    def __format__(self, spec: str) -> str:
        return "***"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __reduce__(self) -> tuple:  # pickling would be a way out
        raise TypeError("a Secret cannot be pickled")


def from_env(var: str, where: str) -> Secret:
    """The secret in environment variable ``var``.

    Raises
    ------
    ConfigError
        When ``var`` is unset or empty; the message names ``where`` (file and key) and the variable, never a value.
    """
    value = os.environ.get(var, "")
    if not value.strip():
        raise ConfigError(f"{where}: environment variable {var} is not set (or empty)")
    return Secret(value.strip(), f"env {var}")


def from_file(path: str, where: str, base: Path | None = None) -> Secret:
    """The secret in file ``path`` (relative paths against ``base``, the config file's directory), stripped.

    Raises
    ------
    ConfigError
        When the file cannot be read or is empty; names ``where`` and the path, never the content.
    """
    p = Path(path).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    try:
        value = p.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read secret file {str(p)!r} ({exc.strerror or exc})") from None
    if not value:
        raise ConfigError(f"{where}: secret file {str(p)!r} is empty")
    return Secret(value, f"file {p}")


def redact(text: str, secrets: Iterable[Secret | None]) -> str:
    """``text`` with every secret value (and a URL secret's path/query) replaced by ``***``.

    >>> redact("POST https://h/x?token=abc failed", [Secret("https://h/x?token=abc")])
    'POST *** failed'
    """
    for s in secrets:
        if s is None:
            continue
        value = s.reveal()
        if value and value in text:
            text = text.replace(value, "***")
        if "://" in value:  # a URL may be quoted without its scheme or with a trailing part only
            rest = value.split("://", 1)[1]
            if rest and rest in text:
                text = text.replace(rest, "***")
    return text


#: Loggers of the HTTP stack that name every request's full URL at INFO (a Slack webhook URL is itself the
#: secret): kept at WARNING in a process holding secrets.
CHATTY_LOGGERS = ("httpx", "httpcore")


class RedactingFilter(logging.Filter):
    """A logging filter that replaces every secret value in a record's message and traceback by ``***``.

    Attached to the handlers of the root logger by :func:`protect_logs`, so it applies to every record a
    process writes, whichever library logs it.

    >>> f = RedactingFilter([Secret("https://h/x?token=abc")])
    >>> rec = logging.LogRecord("httpx", logging.INFO, "", 0, "HTTP Request: POST %s", ("https://h/x?token=abc",), None)
    >>> f.filter(rec), rec.getMessage()
    (True, 'HTTP Request: POST ***')
    """

    def __init__(self, secrets: Iterable[Secret | None]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s is not None and s.reveal()]

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        msg = record.getMessage()
        clean = redact(msg, self.secrets)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self.secrets)
        return True


def protect_logs(secrets: Iterable[Secret | None]) -> RedactingFilter:
    """Keep ``secrets`` out of this process's logs: quiet :data:`CHATTY_LOGGERS` to WARNING and put a
    :class:`RedactingFilter` on every handler of the root logger (call after logging is configured).
    Returns the filter."""
    flt = RedactingFilter(secrets)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(flt)
    return flt
