"""Every Redis client of trainhealth, from one URL: one server, a Sentinel-managed primary, or a Redis Cluster.

:func:`connect` is the only place a client is made (collectors, the detector service, the alert worker, the
dashboard and the commands all call it), so each part reaches the three topologies the same way, with
redis-py's own classes: ``redis.Redis.from_url`` for one server, ``redis.sentinel.Sentinel(...).master_for(...)``
for Sentinel, ``redis.cluster.RedisCluster`` for a cluster. The URL forms are in
:func:`trainhealth.config.parse_redis_url`.

On a cluster every key of a run shares its slot (the ``{run}`` hash tag, :mod:`trainhealth.keys`) and so do the
alert worker's (``{alerts}``): transactions and scripts stay within one slot. What spans runs is read per slot:
:func:`read_groups` replaces one ``XREADGROUP`` over many runs' streams, ``scan_iter`` walks every primary
(redis-py's ``RedisCluster.scan_iter``). docs/architecture.md ("Redis") says which key lives where.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis
import redis.exceptions

from trainhealth import config, defaults
from trainhealth.exceptions import RedisUnavailableError

try:  # redis-py 5.1+
    from redis.cluster import RedisCluster
except ImportError:  # pragma: no cover - redis-py without cluster support
    RedisCluster = None  # type: ignore[assignment,misc]

#: Raised by a cluster client when no node of the cluster answers (redis-py 5.3+); not a ``redis.RedisError``.
_CLUSTER_UNREACHABLE: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(redis.exceptions, "RedisClusterUnreachableError", None),) if e is not None)
#: Errors that mean Redis is away (a server down, a failover under way, a cluster with no reachable node): loops
#: back off and retry; collectors keep their records.
REDIS_DOWN: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, RedisUnavailableError,
                                               *_CLUSTER_UNREACHABLE)

#: Seconds a pooled connection may sit idle before it is checked with a PING on its next use (redis-py's
#: ``health_check_interval``): a connection a server or a load balancer dropped meanwhile fails that check and is
#: made anew, instead of failing the command.
HEALTH_CHECK_S = 30

#: Client types :func:`connect` returns (a Sentinel primary is a ``redis.Redis``).
Client = Any


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client (commands over several runs' keys must then go one slot at a time)."""
    return RedisCluster is not None and isinstance(client, RedisCluster)


def connect(url: str, *, field: str = "redis_url", **options: Any) -> Client:
    """A redis-py client for ``url``: ``redis.Redis`` for one server or a Sentinel-managed primary,
    ``redis.cluster.RedisCluster`` for a cluster.

    Parameters
    ----------
    url : str
        ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` or ``redis+cluster://`` (and their ``rediss+``
        TLS forms); see :func:`trainhealth.config.parse_redis_url`.
    field : str
        Name of the setting the URL came from, for error messages.
    **options
        redis-py connection options the caller wants by default (``socket_timeout`` in seconds, ...); the URL's
        own query options win, as with redis-py's ``from_url``. ``health_check_interval`` is
        :data:`HEALTH_CHECK_S` unless given (a cluster node's client does not take it: redis-py drops it there).

    Raises
    ------
    ConfigError
        For a URL that does not parse, naming ``field`` and the URL with its password hidden.
    RedisUnavailableError
        For a cluster none of whose seed nodes answers (a cluster client learns its slots when made; a single
        server's or Sentinel's client connects on first use instead).
    """
    target = config.parse_redis_url(url, field)
    options.setdefault("health_check_interval", HEALTH_CHECK_S)
    if target.kind == "server":
        return redis.Redis.from_url(url, **options)
    opts: dict[str, Any] = {**options, **target.options}
    sentinel_auth = {k[len("sentinel_"):]: opts.pop(k) for k in ("sentinel_username", "sentinel_password") if k in opts}
    auth = {k: v for k, v in (("username", target.username), ("password", target.password)) if v is not None}
    if target.tls:
        opts["ssl"] = True
    if target.kind == "cluster":
        from redis.cluster import ClusterNode

        try:
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes], **auth, **opts)
        except (redis.exceptions.RedisClusterException, redis.RedisError) as exc:
            raise RedisUnavailableError(f"{field}={config.redact_url(url)!r}: no node of the Redis Cluster answered "
                                        f"({config.redact_url(str(exc))})") from None
    from redis.sentinel import Sentinel

    # The Sentinels get the socket and TLS options, and their own credentials when the URL gives them.
    sentinel_kwargs = {k: v for k, v in opts.items() if k.startswith(("socket_", "ssl"))} | sentinel_auth
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs, **opts)
    return sentinel.master_for(target.service, db=target.db, **auth)


def read_groups(client: Client, group: str, consumer: str, streams: Mapping[str, str], *, count: int,
                block_ms: int | None, poll_s: float = defaults.CLUSTER_POLL_S) -> list[Any]:
    """``XREADGROUP`` over ``streams`` (``{stream: id}``) that works on a cluster too; the reply as redis-py's.

    One server (or a Sentinel primary) answers one ``XREADGROUP`` over all the streams, blocking up to
    ``block_ms``. A cluster refuses a command whose keys are in several slots, so there the streams are read one
    slot at a time (a run's streams share one): streams of one slot in one blocking read; of several, non-blocking
    reads of every slot in one pipeline, again every ``poll_s`` seconds until something comes or ``block_ms`` has
    passed (the added latency is at most ``poll_s``; the reads go to each node in one round trip).
    """
    if not is_cluster(client):
        return client.xreadgroup(group, consumer, dict(streams), count=count, block=block_ms or None) or []
    by_slot: dict[int, dict[str, str]] = {}
    for stream, start in streams.items():
        by_slot.setdefault(client.keyslot(stream), {})[stream] = start
    if len(by_slot) == 1:
        return client.xreadgroup(group, consumer, dict(streams), count=count, block=block_ms or None) or []
    deadline = time.monotonic() + (block_ms or 0) / 1000.0
    while True:
        pipe = client.pipeline(transaction=False)
        for part in by_slot.values():
            pipe.xreadgroup(group, consumer, part, count=count)
        reply = [item for r in pipe.execute() for item in (r or [])]
        left = deadline - time.monotonic()
        if reply or left <= 0:
            return reply
        time.sleep(min(poll_s, left))
