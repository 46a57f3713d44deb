"""The alert worker process (``trainhealth alerts --config alerts.toml``), built like rq's worker.

- **One leader at a time.** Workers on one Redis compete for the lease ``th:{alerts}:leader`` (``SET NX EX``,
  renewed every second); the holder does the work, the others stand by and take over when it expires
  (15 s after the leader died). A new leader reloads all state from Redis first.
- **Two loops, two threads.** The intake (:mod:`trainhealth.alerts.intake`, anomaly logs → grouping →
  outbox) and the delivery (:mod:`trainhealth.alerts.outbox`, outbox → HTTP) run in their own threads, so a
  slow sink never delays grouping. The detector service does no HTTP at all; it only writes the logs. With
  ``alertmanager`` sinks a third thread, the forwarder (:mod:`trainhealth.alerts.forwarding`), sends them the
  alerts, woken by the intake after each change.
- **Catch-up window** (``catch_up``, ``--catch-up``, default 10 min): at start, anomaly transitions written
  longer ago are tracked but not notified, and runs that are over are not paged
  (:mod:`trainhealth.alerts.intake`).
- **Heartbeat with TTL**: ``th:{alerts}:worker:<consumer>`` (30 s) with the role, counters and sink names,
  for ``trainhealth doctor`` and the dashboard; removed on a clean stop.
- **Dead-man's switch**: with ``[deadman]``, a POST to an external URL every ``interval`` while both loops
  are healthy and the detector service is up (:mod:`trainhealth.alerts.watchdog`).
- **SIGTERM / SIGINT** stop the loops after their current iteration; the lease is released at once so a
  standby worker takes over without waiting for it to expire.
- **Redis errors** back off exponentially, capped (0.5 s doubling to 30 s), then state is reloaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import redis

from trainhealth import __version__, defaults
from trainhealth.alerts.config import AlertsConfig
from trainhealth.alerts.forwarding import Forwarder, alertmanager_sinks
from trainhealth.alerts.intake import Intake
from trainhealth.alerts.outbox import Deliverer
from trainhealth.alerts.secrets import redact
from trainhealth.connection import REDIS_DOWN
from trainhealth.keys import ALERTS_LEADER, alerts_worker_heartbeat
from trainhealth.loop import LEASE_LUA, RELEASE_LUA, Backoff, stop_on_signals

log = logging.getLogger(__name__)

_REDIS_ERRORS = (*REDIS_DOWN, OSError)


class AlertWorker:
    """Leader election, the intake and delivery threads, heartbeat, dead-man ping, signals.

    Parameters
    ----------
    client : redis.Redis
    config : AlertsConfig
    consumer : str, optional
        Name in the consumer groups and the heartbeat key; default ``<host>-<pid>``.
    clock, rand : callable
        Unix time and a uniform [0, 1) source (tests pass fakes).
    http : httpx.Client, optional
        For the sinks (tests may pass one with a short timeout).
    block_ms : int
        Longest blocking read of each loop (milliseconds).
    lease_s : int
        Seconds the leadership lease lasts without renewal.
    catch_up : float
        Catch-up window in seconds (``--catch-up``): at start, transitions written longer ago are tracked but
        not notified, and runs that are over are not paged (:mod:`trainhealth.alerts.intake`); 0 turns it off.
    """

    def __init__(self, client: redis.Redis, config: AlertsConfig, *, consumer: str | None = None,
                 clock: Callable[[], float] = time.time, rand: Callable[[], float] = random.random,
                 http: httpx.Client | None = None, block_ms: int = 1000, lease_s: int = defaults.ALERT_LEASE_S,
                 catch_up: float = defaults.ALERT_CATCHUP_S) -> None:
        self.client = client
        self.config = config
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.clock = clock
        self.block_ms = block_ms
        self.lease_s = lease_s
        self.intake = Intake(client, config, consumer=self.consumer, clock=clock, catch_up=catch_up)
        self.delivery = Deliverer(client, config.sinks, config.delivery, consumer=self.consumer, clock=clock,
                                  rand=rand, http=http)
        am = alertmanager_sinks(config)
        #: Sends the ``alertmanager`` sinks their alerts; None without one.
        self.forwarder = Forwarder(client, am, config.delivery, clock=clock, rand=rand, http=http) if am else None
        if self.forwarder is not None:
            self.intake.on_forward = self.forwarder.wake.set
        self._lease = client.register_script(LEASE_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._stop = threading.Event()
        self._leader = threading.Event()
        self._errors: dict[str, str] = {}
        self._last_ping: float = -1e18
        self.last_ping_ok: bool | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask every loop to stop after its current iteration."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """Stop cleanly on SIGTERM and SIGINT, at once on a second one (:func:`trainhealth.loop.stop_on_signals`;
        main thread only)."""
        stop_on_signals(self.stop, log, f"alert worker {self.consumer}")

    @property
    def is_leader(self) -> bool:
        return self._leader.is_set()

    def run_forever(self) -> None:
        """Run until :meth:`stop`: lease and heartbeat here, intake and delivery in two threads."""
        log.info("alert worker %s started (%d sinks: %s; catch-up window %s)", self.consumer, len(self.config.sinks),
                 ", ".join(self.config.sinks) or "none",
                 f"{self.intake.catch_up:g} s" if self.intake.catch_up > 0 else "off")
        threads = [threading.Thread(target=self._loop, args=("intake", self._intake_once), name="alerts-intake",
                                    daemon=True),
                   threading.Thread(target=self._loop, args=("delivery", self._delivery_once),
                                    name="alerts-delivery", daemon=True)]
        if self.forwarder is not None:
            threads.append(threading.Thread(target=self._loop, args=("forward", self._forward_once),
                                            name="alerts-forward", daemon=True))
        for t in threads:
            t.start()
        backoff = Backoff()
        cold = True  # until the loop ends by itself: a second signal's SystemExit skips the threads' wind-down
        try:
            while not self._stop.is_set():
                try:
                    self.tick()
                    backoff.reset()
                    self._stop.wait(1.0)
                except _REDIS_ERRORS as exc:
                    wait = backoff.failed()
                    log.warning("Redis unreachable (%s); retrying in %.1f s", exc, wait)
                    self._stop.wait(wait)
            cold = False
        finally:
            self._stop.set()
            if not cold:
                for t in threads:
                    t.join(timeout=max(5.0, self.block_ms / 1000 + 5.0) + self._http_timeout())
            with contextlib.suppress(redis.RedisError, OSError):  # cold or warm: no live-looking heartbeat left
                self.client.delete(alerts_worker_heartbeat(self.consumer))
                self._release(keys=[ALERTS_LEADER], args=[self.consumer])
        self.delivery.close()
        if self.forwarder is not None:
            self.forwarder.close()
        log.info("alert worker %s stopped (%d notifications enqueued, %d delivered)", self.consumer,
                 self.intake.enqueued, self.delivery.sent)

    def _http_timeout(self) -> float:
        return max((s.timeout for s in self.config.sinks.values()), default=0.0)

    def tick(self) -> None:
        """Renew or take the lease, write the heartbeat, ping the dead-man's switch when due."""
        now = self.clock()
        held = bool(self._lease(keys=[ALERTS_LEADER], args=[self.consumer, self.lease_s]))
        if held and not self._leader.is_set():
            log.info("alert worker %s is now the leader: loading state", self.consumer)
            self.intake.ready = False
            self.delivery.ready = False
            if self.forwarder is not None:
                self.forwarder.ready = False
            self._leader.set()
        elif not held and self._leader.is_set():
            log.warning("alert worker %s lost the leadership lease; standing by", self.consumer)
            self._leader.clear()
        if self.config.deadman is not None and now - self._last_ping >= self.config.deadman.interval:
            self._ping(now)
        self.client.set(alerts_worker_heartbeat(self.consumer), json.dumps(self.status(now)),
                        ex=defaults.ALERT_WORKER_HEARTBEAT_TTL_S)

    def status(self, now: float) -> dict[str, Any]:
        """The heartbeat's JSON (no secrets)."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "t": now, "version": __version__,
                "role": "leader" if self.is_leader else "standby", "config": self.config.path,
                "sinks": {n: s.type for n, s in self.config.sinks.items()},
                "intake_ok_at": self.intake.last_ok, "delivery_ok_at": self.delivery.last_loop_ok,
                "groups": len(self.intake.grouper.groups), "enqueued": self.intake.enqueued,
                "skipped_entries": self.intake.skipped, "stale_entries": self.intake.stale,
                "catch_up_s": self.intake.catch_up,
                "delivered": self.delivery.sent, "service_down": self.intake.service_down,
                "forward_ok_at": self.forwarder.last_loop_ok if self.forwarder is not None else None,
                "forwarded": self.forwarder.sent if self.forwarder is not None else 0,
                "errors": dict(self._errors), "deadman_ok": self.last_ping_ok}

    def healthy(self, now: float) -> bool:
        """Leader with both loops having completed an iteration recently, and the detector service up."""
        recent = max(10.0, 3 * self.block_ms / 1000 + self._http_timeout())
        fwd = self.forwarder
        return (self.is_leader and not self.intake.service_down and self.intake.last_ok is not None
                and now - self.intake.last_ok < recent and self.delivery.last_loop_ok is not None
                and now - self.delivery.last_loop_ok < recent
                and (fwd is None or (fwd.last_loop_ok is not None and now - fwd.last_loop_ok < recent)))

    def _ping(self, now: float) -> None:
        dm = self.config.deadman
        assert dm is not None
        self._last_ping = now
        if not self.healthy(now):
            log.warning("not pinging the dead-man's switch: worker or detector service unhealthy")
            self.last_ping_ok = False
            return
        try:
            # Short enough that the lease (renewed by this thread) never lapses while a ping hangs.
            resp = httpx.post(dm.url.reveal(), json={"worker": self.consumer, "t": now},
                              timeout=min(dm.timeout, self.lease_s / 3))
            self.last_ping_ok = resp.status_code < 400
            if not self.last_ping_ok:
                log.warning("dead-man's switch answered HTTP %d", resp.status_code)
        except httpx.HTTPError as exc:
            self.last_ping_ok = False
            log.warning("dead-man's switch unreachable: %s", redact(f"{type(exc).__name__}: {exc}", [dm.url]))

    # -- the two loops ------------------------------------------------------------------------------------
    def _intake_once(self) -> int:
        self.intake.run_once(self.block_ms)
        return self.intake.last_work

    def _delivery_once(self) -> int:
        self.delivery.run_once(self.block_ms)
        return self.delivery.last_work

    def _forward_once(self) -> int:
        assert self.forwarder is not None
        return self.forwarder.run_once(self.block_ms)

    def _loop(self, name: str, once: Callable[[], int]) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            if not self._leader.is_set():
                self._stop.wait(0.2)
                continue
            try:
                t0 = time.monotonic()
                work = once()
                backoff.reset()
                self._errors.pop(name, None)
                if not work and time.monotonic() - t0 < 0.05:  # nothing to do and nothing to block on
                    self._stop.wait(0.1)
            except Exception as exc:
                wait = backoff.failed()
                self._errors[name] = redact(f"{type(exc).__name__}: {exc}", self.config.secrets())
                if isinstance(exc, _REDIS_ERRORS):
                    log.warning("%s: Redis unreachable (%s); retrying in %.1f s", name, exc, wait)
                else:
                    log.exception("%s: unexpected error; retrying in %.1f s", name, wait)
                # Reload everything from Redis before going on: local state may be ahead of what was committed.
                self.intake.ready = self.intake.ready and name != "intake"
                self.delivery.ready = self.delivery.ready and name != "delivery"
                if self.forwarder is not None:
                    self.forwarder.ready = self.forwarder.ready and name != "forward"
                self._stop.wait(wait)
