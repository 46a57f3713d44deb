"""Where Redis is, and other settings read from the environment (standard library + redis-py).

Resolution order for the Redis URL: an explicit argument, then ``TRAINHEALTH_REDIS_URL``,
then the embedded server started by ``trainhealth serve``/``demo`` (its ``server.json``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from trainhealth import defaults
from trainhealth.exceptions import ConfigError

#: One server (redis-py's own ``from_url`` schemes).
SERVER_SCHEMES = ("redis://", "rediss://", "unix://")
#: A primary found through Sentinel: ``redis+sentinel://[user:pass@]host[:port][,host[:port]…]/service[/db][?opts]``.
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
#: A Redis Cluster from seed nodes: ``redis+cluster://[user:pass@]host[:port][,host[:port]…][/0][?opts]``.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
_SCHEMES = SERVER_SCHEMES + SENTINEL_SCHEMES + CLUSTER_SCHEMES
_EXPECTED = ("expected redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://, redis+cluster:// or "
             "rediss+cluster://")
#: Default ports of a Sentinel and of a cluster node when a host of the list names none.
SENTINEL_PORT, CLUSTER_PORT = 26379, 6379
#: Query options of a Sentinel or Cluster URL that are strings (redis-py's typed ones come from its own parsers).
_STRING_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "client_name",
                   "sentinel_username", "sentinel_password")


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
    >>> redact_url("redis+sentinel://:pw@s1:26379,s2:26379/mymaster/0?sentinel_password=spw")
    'redis+sentinel://:***@s1:26379,s2:26379/mymaster/0?sentinel_password=***'
    """
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    url = _PASSWORD_PARAM.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if sep and "," in netloc and "@" in netloc:  # a Sentinel or Cluster URL's list of hosts: no port to parse
        userinfo, _, hosts = netloc.rpartition("@")
        return f"{scheme}://{userinfo.partition(':')[0]}:***@{hosts}{rest[len(netloc):]}"
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


_PASSWORD_PARAM = re.compile(r"([?&](?:sentinel_)?password=)[^&#]*", re.IGNORECASE)


@dataclass(frozen=True)
class RedisTarget:
    """Where one Redis URL points (:func:`parse_redis_url`); the secrets are left out of its ``repr``.

    ``kind`` is ``server`` (one Redis: redis-py's ``from_url`` reads the URL itself), ``sentinel`` (the primary
    the Sentinels at ``nodes`` name for ``service``, database ``db``) or ``cluster`` (a Redis Cluster found from
    the seed ``nodes``). ``tls`` for a ``rediss+`` scheme; ``username`` / ``password`` those of the data nodes;
    ``options`` the query's redis-py connection options, typed, with ``sentinel_username`` /
    ``sentinel_password`` for Sentinels that require their own.
    """

    kind: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)


def parse_redis_url(url: Any, field: str = "redis_url") -> RedisTarget:
    """Parse a Redis URL into a :class:`RedisTarget`, or raise :class:`ConfigError` naming ``field`` and the URL
    with its password hidden (:func:`redact_url`).

    Three topologies, one URL each (the Sentinel form is the one redis-sentinel-url and Prefect's docket read;
    the Cluster form is the same with a list of seed nodes):

    - one server: ``redis://[user:pass@]host[:port][/db]``, ``rediss://…`` (TLS), ``unix:///path.sock``;
    - Sentinel: ``redis+sentinel://[user:pass@]host[:port][,host[:port]…]/service_name[/db][?options]``
      (Sentinels default to port 26379; ``sentinel_username`` / ``sentinel_password`` options when the Sentinels
      have credentials of their own; ``rediss+sentinel://`` for TLS to all of them);
    - Cluster: ``redis+cluster://[user:pass@]host[:port][,host[:port]…][?options]`` (any reachable nodes of
      the cluster; port 6379 by default; database 0 only, as Redis Cluster has no other).

    Options are redis-py's connection options (``socket_timeout=5``, ``ssl_ca_certs=/etc/ca.pem``, …); an
    unknown one is refused, not ignored.

    >>> t = parse_redis_url("redis+sentinel://:pw@s1,s2:26380/mymaster/2?socket_timeout=5")
    >>> t.kind, t.nodes, t.service, t.db, t.password, dict(t.options)
    ('sentinel', (('s1', 26379), ('s2', 26380)), 'mymaster', 2, 'pw', {'socket_timeout': 5.0})
    >>> parse_redis_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    RedisTarget(kind='cluster', nodes=(('10.0.0.1', 7000), ('10.0.0.2', 7000)), service='', db=0, tls=False, \
username=None)
    """
    if not isinstance(url, str) or not url.lower().startswith(_SCHEMES):
        # Without a scheme, a host[:port] is shown (the usual slip: localhost:6379); anything else may be a password
        # pasted in the wrong place: not echoed whole.
        host_like = isinstance(url, str) and _HOST_LIKE.match(url) is not None
        shown = (repr(redact_url(url)) if not isinstance(url, str) or "://" in url or host_like
                 else f"{url[:3]!r}… ({len(url)} characters)" if len(url) > 3 else repr(url))
        raise ConfigError(f"{field}={shown} is not a Redis URL: {_EXPECTED}")

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{field}={redact_url(url)!r} is not a Redis URL: {why}")

    scheme = url[:url.index("://")].lower()
    if scheme + "://" in SERVER_SCHEMES:
        try:
            urlsplit(url).port  # noqa: B018 - parsing it raises for a port that is no number or out of range
        except ValueError as exc:
            raise bad(str(exc)) from None
        _check_options(url, bad)
        return RedisTarget("server")
    kind = "sentinel" if scheme + "://" in SENTINEL_SCHEMES else "cluster"
    rest = url[len(scheme) + 3:]
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    tail = urlsplit("x://h" + rest[len(netloc):])
    userinfo, at, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if at else ("", "", "")
    nodes = tuple(_host_port(h, SENTINEL_PORT if kind == "sentinel" else CLUSTER_PORT, bad) for h in hosts.split(","))
    segments = [unquote(s) for s in tail.path.split("/") if s]
    options = _options(tail.query, bad)
    db = options.pop("db", None)
    service = ""
    if kind == "sentinel":
        if not segments or len(segments) > 2:
            raise bad("a Sentinel URL names the service and optionally the database: /<service_name>[/<db>]")
        service = segments[0]
        if len(segments) == 2:
            if not segments[1].isdigit():
                raise bad(f"database {segments[1]!r} is not a number")
            db = int(segments[1]) if db is None else db
    elif segments not in ([], ["0"]) or db not in (None, 0):
        raise bad("Redis Cluster has only database 0")
    return RedisTarget(kind, nodes, service, int(db or 0), scheme.startswith("rediss"), unquote(username) or None,
                       unquote(password) if password else None, options)


def _host_port(text: str, default: int, bad: Any) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` of a URL's list of hosts."""
    host, port = text, ""
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        port = port[1:] if port.startswith(":") else port
    elif ":" in text:
        host, _, port = text.rpartition(":")
    if not host:
        raise bad(f"host {text!r} of the list has no name")
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise bad(f"host {text!r} has no valid port (1-65535)")
    return host, int(port) if port else default


def _options(query: str, bad: Any) -> dict[str, Any]:
    """The query options of a Sentinel or Cluster URL, typed with redis-py's own parsers."""
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS

    out: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        parse = URL_QUERY_ARGUMENT_PARSERS.get(name)
        if name in _STRING_OPTIONS:
            out[name] = value
        elif parse is None or name == "timeout":
            raise bad(f"unknown option {name!r}")
        else:
            try:
                out[name] = parse(value)
            except (TypeError, ValueError):
                raise bad(f"option {name}={value!r} is not valid") from None
    return out


#: A host name or address with a port (and maybe a database): ``localhost:6379``, ``10.0.0.5:6380/2``.
_HOST_LIKE = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}(/\d+)?$")


def _check_options(url: str, bad: Any) -> None:
    """The URL's query options as redis-py reads them (``?socket_timeout=3``), checked now: redis-py would raise
    for a bad value or an option its connection does not take only on the first command — inside a collector's
    sender thread, every retry, with every record lost. No connection is opened."""
    import redis

    try:
        pool = redis.ConnectionPool.from_url(url)
        pool.make_connection()
    except (ValueError, TypeError) as exc:
        raise bad(f"option: {redact_url(str(exc))}") from None


def validate_url(url: str, field: str = "redis_url") -> str:
    """Return ``url`` when it is a Redis URL :func:`parse_redis_url` reads (one server, Sentinel or Cluster), else
    raise :class:`ConfigError` naming ``field`` and the URL with its password hidden (:func:`redact_url`)."""
    parse_redis_url(url, field)
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
    return _env_bytes(defaults.RETENTION_BYTES_ENV, defaults.STEPS_RETENTION_BYTES)


def service_retention_bytes() -> dict[str, int]:
    """Byte bounds of the streams the detector service writes, by stream (``agg``, ``ledger``, ``anomaly_log``):
    ``$TRAINHEALTH_AGG_RETENTION_BYTES``, ``$TRAINHEALTH_LEDGER_RETENTION_BYTES``,
    ``$TRAINHEALTH_ANOMALY_LOG_RETENTION_BYTES`` or the defaults. Raises :class:`ConfigError` naming the variable
    and its value when one is not an integer of at least 1 MiB."""
    return {"agg": _env_bytes(defaults.AGG_RETENTION_BYTES_ENV, defaults.AGG_RETENTION_BYTES),
            "ledger": _env_bytes(defaults.LEDGER_RETENTION_BYTES_ENV, defaults.LEDGER_RETENTION_BYTES),
            "anomaly_log": _env_bytes(defaults.ANOMALY_LOG_RETENTION_BYTES_ENV, defaults.ANOMALY_LOG_RETENTION_BYTES)}


def _env_bytes(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 2**20:
        raise ConfigError(f"{name}={raw!r} must be an integer >= 1048576 (bytes)")
    return n
