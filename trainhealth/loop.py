"""What every Redis loop of the project shares: the reconnect backoff and the lease scripts.

The collectors' sender, the detector service and the alert worker each keep working through a Redis
outage: they wait :class:`Backoff` between attempts, and the two services hold a lease (a key with a
TTL renewed while alive) so that several processes split the work without two owning the same thing.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

from trainhealth import defaults

#: Renew the lease ``KEYS[1]`` if ``ARGV[1]`` holds it, else take it when free, for ``ARGV[2]`` seconds.
#: Returns 1 when ``ARGV[1]`` holds it afterwards, else 0 (one key: Redis Cluster safe).
LEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) and 1 or 0
"""
#: Extend the lease ``KEYS[1]`` to ``ARGV[2]`` seconds only if ``ARGV[1]`` holds it; never takes a free one.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
#: Delete the lease ``KEYS[1]`` only if ``ARGV[1]`` holds it (a clean exit hands it over at once).
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
#: Membership of ``KEYS[1]`` (a sorted set scored by Redis server time): adds ``ARGV[1]`` now unless it is empty,
#: forgets members older than ``ARGV[3]`` seconds, and returns those heard from in the last ``ARGV[2]`` seconds.
#: The server's clock, not each host's, decides who is live (no clock skew between hosts). One key.
MEMBERS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now, ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
return redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[2]), '+inf')
"""


class Backoff:
    """Capped exponential delay between reconnect attempts: ``base``, then doubling up to ``cap`` (seconds).

    Call :meth:`failed` after each failed attempt (it returns the seconds to wait before the next one)
    and :meth:`reset` after a success. The defaults are
    :data:`~trainhealth.defaults.RECONNECT_BACKOFF_S` and :data:`~trainhealth.defaults.RECONNECT_BACKOFF_MAX_S`
    (the schedule of rq's worker and redis-py's ``ExponentialBackoff``, without jitter: each process
    reconnects to one server, so there is no herd to spread).

    >>> b = Backoff(0.5, 4.0)
    >>> [b.failed() for _ in range(5)], b.delay
    ([0.5, 1.0, 2.0, 4.0, 4.0], 4.0)
    >>> b.reset(); b.delay
    0.0
    """

    def __init__(self, base: float = defaults.RECONNECT_BACKOFF_S, cap: float = defaults.RECONNECT_BACKOFF_MAX_S,
                 ) -> None:
        self.base = base
        self.cap = cap
        self._delay = 0.0

    @property
    def delay(self) -> float:
        """The current wait (s); 0.0 before the first failure and after a success."""
        return self._delay

    def failed(self) -> float:
        """Record a failed attempt; returns the seconds to wait before the next one."""
        self._delay = min(self.cap, max(self.base, self._delay * 2))
        return self._delay

    def reset(self) -> None:
        """Record a success: the next failure waits ``base`` again."""
        self._delay = 0.0


def stop_on_signals(stop: Callable[[], None], logger: logging.Logger, what: str) -> None:
    """SIGTERM and SIGINT stop a loop in two stages, as rq's worker does (main thread only).

    The first signal calls ``stop()`` (a warm stop: finish the current batch, acknowledge it, hand the leases
    over) and says so; a second one exits at once (``SystemExit(1)``), for a loop that is far behind and a
    supervisor that will not wait. Nothing is lost by the cold stop: entries not acknowledged stay pending in
    their consumer group and are processed again.
    """
    signals = 0

    def handle(signum: int, _frame: Any) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            logger.warning("%s: second %s, stopping now", what, signal.Signals(signum).name)
            raise SystemExit(1)
        logger.info("%s: %s, stopping after the current batch (send it again to stop now)", what,
                    signal.Signals(signum).name)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
