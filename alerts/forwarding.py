"""Alertmanager sinks: which alerts each Alertmanager must know (:class:`ForwardState`), and telling it
(:class:`Forwarder`).

Alertmanager groups, waits (``group_wait`` / ``group_interval`` / ``repeat_interval``), silences and inhibits the
alerts it is sent, and expects every active alert to be sent again and again: one not re-sent expires at its
``endsAt``. The worker's own notifications are the output of the same kind of engine
(:mod:`trainhealth.alerts.grouping`); fed to Alertmanager they would go through two engines in a row, each
delaying and dropping what the other must see (an alert a worker silence stopped re-sending would expire in
Alertmanager, which then tells everyone it resolved). So an ``alertmanager`` sink is sent the alerts themselves,
the way Prometheus sends its rule alerts:

- **Which alerts** (:class:`ForwardState`, in the intake): an alert goes to an ``alertmanager`` sink when a route that
  takes it lists the sink among its receivers: the routing tree, its matchers and ``continue`` decide, as for every
  sink. Nothing else of the worker's applies to it: not the route's ``group_by`` and timers, not the worker's
  silences, inhibition, flapping suppression or catch-up window. Alertmanager's own route, silences and
  ``inhibit_rules`` do that (docs/alerts.md gives the built-in inhibition as Alertmanager rules). An alert of a run
  that is over (:attr:`~trainhealth.alerts.grouping.Grouper.ended_runs`: its job ended and it fires on, like the
  divergence of a finished run) is closed, as the worker stops paging it. A stale point event (``restart``) is
  dropped, as the worker drops it.
- **Labels** are fixed when an alert is first forwarded (an anomaly's rank set can grow; a changed label would be
  another alert), except ``severity``, which only goes up: an escalated alert is another Alertmanager alert, and the
  less severe one is closed. Annotations follow every change.
- **State in Redis**: ``th:{alerts}:forward:<sink>``, a hash of label fingerprint -> JSON
  :class:`~trainhealth.alerts.sinks.alertmanager.AmAlert`, written by the intake in the same ``MULTI/EXEC`` as its
  cursors, so a crash neither loses nor repeats a change. A firing alert stays while it fires; a closed one (ended,
  routed elsewhere, its run over, replaced by a more severe one) until it was sent once, or until Alertmanager's copy
  has expired by itself (``closed_at + validity``): then there is nothing left to tell.
- **Sending** (:class:`Forwarder`, a thread of its own in the worker): the alerts that changed within a second of
  the change, and every ``resend_interval`` (60 s) all of a sink's alerts, firing ones valid for four intervals, in
  batches of 64 (Prometheus's notifier). The periodic sync carries the whole state, so a failure needs no queue
  and no dead letter: after one, the whole state is sent again after the delivery backoff (capped at the resend
  interval) or a 429's ``Retry-After``; three failed re-sends in a row still leave every alert active. Closed
  alerts leave the hash once a sync carried them (a compare-and-delete: a change the intake wrote meanwhile stays);
  with nothing to tell, the periodic sync POSTs an empty list, so a wrong URL or password shows before an alert.
  The sink's state (``th:{alerts}:sinks``: last success, failures in a row, last error with secrets removed) is
  what ``trainhealth doctor`` and the dashboard show.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx
import redis

from trainhealth import defaults
from trainhealth.alerts.config import AlertsConfig, DeliveryConfig
from trainhealth.alerts.notification import FIRING, RESOLVED, Alert, dashboard_link
from trainhealth.alerts.outbox import SinkState, backoff_delay
from trainhealth.alerts.routing import Route
from trainhealth.alerts.sinks.alertmanager import (
    AlertmanagerSink,
    AmAlert,
    alert_annotations,
    alert_labels,
    higher_severity,
)
from trainhealth.keys import ALERTS_SINKS, alerts_forward

log = logging.getLogger(__name__)

#: Delete a hash field only if it still holds the value that was sent (the intake may have changed it since).
DELETE_IF_UNCHANGED_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def alertmanager_sinks(config: AlertsConfig) -> dict[str, AlertmanagerSink]:
    """The config's ``alertmanager`` sinks by name."""
    return {name: s for name, s in config.sinks.items() if isinstance(s, AlertmanagerSink)}


def _more_severe(a: AmAlert, b: AmAlert) -> bool:
    sa, sb = a.labels.get("severity", ""), b.labels.get("severity", "")
    return sa != sb and higher_severity(sb, sa) == sa


class ForwardState:
    """What each ``alertmanager`` sink must know, kept by the intake (see the module doc). Pure but for
    :meth:`load` and :meth:`write`, which take a Redis client / pipeline.

    Parameters
    ----------
    root : Route
        The routing tree (an alert goes to the ``alertmanager`` receivers of the routes that take it).
    sinks : mapping of name to AlertmanagerSink
    dashboard_url : str
        Base of the deep links.
    """

    def __init__(self, root: Route, sinks: Mapping[str, AlertmanagerSink], dashboard_url: str) -> None:
        self.root = root
        self.sinks = dict(sinks)
        self.dashboard_url = dashboard_url
        #: sink -> alert key -> the firing alert as last written.
        self.firing: dict[str, dict[str, AmAlert]] = {name: {} for name in self.sinks}
        self._writes: dict[tuple[str, str], AmAlert] = {}

    @property
    def pending(self) -> int:
        """Changes not yet written."""
        return len(self._writes)

    def load(self, client: redis.Redis) -> None:
        """Reload the firing alerts from Redis (a new leader, or after an error); unreadable records are logged."""
        self._writes.clear()
        for name in self.sinks:
            self.firing[name] = {}
            for fp, raw in client.hgetall(alerts_forward(name)).items():
                try:
                    am = AmAlert.from_json(raw)
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("sink %s: ignoring unreadable forwarded alert %s: %s", name, _s(fp), exc)
                    continue
                if not am.firing:
                    continue  # the forwarder's to send; the intake has nothing more to do with it
                old = self.firing[name].get(am.key)
                # One firing record per alert is ever written; should two be found, the more severe one holds.
                if old is None or _more_severe(am, old):
                    self.firing[name][am.key] = am

    def _put(self, name: str, am: AmAlert) -> None:
        self._writes[(name, am.fp)] = am

    def _targets(self, alert: Alert) -> set[str]:
        return {r for route in self.root.match(alert.labels) for r in route.receivers if r in self.sinks}

    def observe(self, alert: Alert, t: float, *, stale: bool = False, over: bool = False) -> None:
        """Apply one alert state at unix s ``t``.

        Parameters
        ----------
        alert : Alert
            The alert's new state.
        t : float
            When (the transition's time, not after the worker's clock).
        stale : bool
            Read in the catch-up at start (:mod:`~trainhealth.alerts.intake`): a point event is dropped.
        over : bool
            Its run is over: a firing alert is closed, not forwarded.
        """
        if not self.sinks:
            return
        targets = set() if over else self._targets(alert)
        for name, sink in self.sinks.items():
            cur = self.firing[name].get(alert.key)
            if alert.point:
                if name in targets and not stale:  # sent once as firing for `validity`, then Alertmanager resolves it
                    am = self._alert(alert, sink, None, t)
                    self._put(name, AmAlert(am.key, am.labels, am.annotations, am.starts_at,
                                            ends_at=max(t, am.starts_at) + sink.validity, closed_at=t,
                                            generator_url=am.generator_url))
                continue
            if alert.status == FIRING and name in targets:
                new = self._alert(alert, sink, cur, t)
                if cur is not None and cur.fp != new.fp:  # escalated (or the sink's labels changed): another alert
                    self._put(name, cur.closed(t))
                if new != cur:
                    self._put(name, new)
                    self.firing[name][alert.key] = new
            elif cur is not None:  # resolved, routed elsewhere, or its run is over
                end = alert.ends_at if alert.status == RESOLVED and alert.ends_at is not None else t
                notes = alert_annotations(alert, self.dashboard_url) if alert.status == RESOLVED else None
                self._put(name, cur.closed(min(end, t), notes))
                del self.firing[name][alert.key]

    def _alert(self, alert: Alert, sink: AlertmanagerSink, cur: AmAlert | None, t: float) -> AmAlert:
        severity = alert.severity if cur is None else higher_severity(cur.labels.get("severity", ""), alert.severity)
        labels = alert_labels(alert, sink.labels, severity)
        if cur is not None:  # rank and host as first forwarded (see the module doc)
            for k in ("rank", "host"):
                labels.pop(k, None)
                if k in cur.labels:
                    labels[k] = cur.labels[k]
        start = alert.starts_at if alert.starts_at is not None else t
        link = dashboard_link(self.dashboard_url, alert.run, alert.anomaly) if alert.run != "*" else ""
        return AmAlert(alert.key, labels, alert_annotations(alert, self.dashboard_url), min(start, t),
                       generator_url=link)

    def close_runs(self, runs: Iterable[str], t: float) -> None:
        """Close the firing alerts of ``runs`` (runs found over) at unix s ``t``."""
        runs = set(runs)
        for name in self.sinks:
            for key, am in list(self.firing[name].items()):
                if am.run in runs:
                    self._put(name, am.closed(t))
                    del self.firing[name][key]

    def write(self, pipe: Any) -> int:
        """Queue the pending changes on ``pipe`` (the intake's ``MULTI/EXEC``); returns how many."""
        n = len(self._writes)
        for (name, fp), am in self._writes.items():
            pipe.hset(alerts_forward(name), fp, am.to_json())
        self._writes.clear()
        return n


class Forwarder:
    """Sends each ``alertmanager`` sink its alerts (see the module doc): at once after :attr:`wake` is set, and every
    ``resend_interval``.

    Parameters
    ----------
    client : redis.Redis
    sinks : mapping of name to AlertmanagerSink
    delivery : DeliveryConfig
        The backoff after a failed sync (capped at the sink's resend interval) and the ``Retry-After`` cap.
    clock, rand : callable
        Unix time and a uniform [0, 1) source for the jitter (tests pass fakes).
    http : httpx.Client, optional
        Reused for every request; one is created when omitted.
    batch : int
        Alerts per POST.
    """

    def __init__(self, client: redis.Redis, sinks: Mapping[str, AlertmanagerSink], delivery: DeliveryConfig, *,
                 clock: Callable[[], float] = time.time, rand: Callable[[], float] = random.random,
                 http: httpx.Client | None = None, batch: int = defaults.ALERT_AM_BATCH) -> None:
        self.client = client
        self.sinks = dict(sinks)
        self.cfg = delivery
        self.clock = clock
        self.rand = rand
        self.http = http or httpx.Client(follow_redirects=False)
        self.batch = batch
        #: Set by the intake after it wrote a change: sync at once.
        self.wake = threading.Event()
        self.ready = False
        #: sink -> unix s of its next sync.
        self.next_at: dict[str, float] = {}
        #: sink -> failed syncs in a row.
        self.failures: dict[str, int] = {}
        self.states: dict[str, SinkState] = {}
        #: sink -> fingerprint -> stored text of each firing alert as last sent successfully (what changed since).
        self._told: dict[str, dict[str, str]] = {}
        self._delete = client.register_script(DELETE_IF_UNCHANGED_LUA)
        #: Alerts sent in successful syncs, in total.
        self.sent = 0
        self.last_loop_ok: float | None = None
        #: POSTs made by the last :meth:`run_once`.
        self.last_work = 0

    def setup(self) -> None:
        """Load the sinks' states; every sink syncs at the next :meth:`run_once` (a new leader tells everything)."""
        raw = self.client.hmget(ALERTS_SINKS, list(self.sinks)) if self.sinks else []
        self.states = {name: SinkState.from_json(v) if v is not None else SinkState()
                       for name, v in zip(self.sinks, raw, strict=True)}
        self.next_at = {name: -math.inf for name in self.sinks}
        self.failures = {name: 0 for name in self.sinks}
        self._told = {}
        self.ready = True

    def run_once(self, block_ms: int = 0) -> int:
        """Sync every sink that is due (all its alerts), or woken and not backing off (the alerts that changed since
        it last told them); when no POST was made, wait up to ``block_ms`` for a wake-up or the next due time.
        Returns the POSTs made."""
        if not self.ready:
            self.setup()
        woke = self.wake.is_set()
        self.wake.clear()
        now = self.clock()
        posts = 0
        for name in self.sinks:
            if now >= self.next_at[name]:
                posts += self.sync(name)
            elif woke and not self.failures[name]:
                posts += self.sync(name, changed_only=True)
        self.last_loop_ok = self.clock()
        self.last_work = posts
        if not posts and block_ms > 0 and self.sinks:
            self.wake.wait(max(0.0, min(block_ms / 1000, min(self.next_at.values()) - self.clock())))
        return posts

    def sync(self, name: str, changed_only: bool = False) -> int:
        """Send sink ``name`` everything it must know now (only what changed since the last successful send with
        ``changed_only``: the others are still valid for three intervals); returns the POSTs made."""
        sink = self.sinks[name]
        key = alerts_forward(name)
        now = self.clock()
        told = self._told.setdefault(name, {})
        alerts: list[tuple[str, AmAlert]] = []  # (stored text, alert)
        drop: list[tuple[str, str]] = []  # (field, stored text) to delete unsent
        for fp_raw, raw in self.client.hgetall(key).items():
            fp, text = _s(fp_raw), _s(raw)
            try:
                am = AmAlert.from_json(text)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("sink %s: dropping unreadable forwarded alert %s: %s", name, fp, exc)
                drop.append((fp, text))
                continue
            if am.closed_at is not None and now >= am.closed_at + sink.validity:
                drop.append((fp, text))  # Alertmanager's copy has expired by itself: nothing left to tell
                continue
            if changed_only and told.get(fp) == text:
                continue
            alerts.append((text, am))
        alerts.sort(key=lambda x: x[1].fp)
        posts, status = 0, None
        # With nothing to tell, the periodic sync still POSTs an empty list: reachability and credentials are
        # checked (and shown by doctor) before the first alert needs them.
        for i in range(0, max(len(alerts), 0 if changed_only else 1), self.batch):
            chunk = [am for _, am in alerts[i:i + self.batch]]
            result = sink.post(self.http, chunk, now)
            posts, status = posts + 1, result.status
            if not result.ok:
                self._failed(name, sink, result, len(chunk))
                return posts
        for fp, text in drop + [(am.fp, text) for text, am in alerts if not am.firing]:
            self._delete(keys=[key], args=[fp, text])
        new = sorted(am.labels.get("alertname", "") for _, am in alerts if am.firing and am.fp not in told)
        ended = sum(1 for _, am in alerts if not am.firing)
        for fp, _ in drop:
            told.pop(fp, None)
        for text, am in alerts:
            if am.firing:
                told[am.fp] = text
            else:
                told.pop(am.fp, None)
        self.failures[name] = 0
        if not changed_only:
            self.next_at[name] = now + sink.resend_interval
        self.sent += len(alerts)
        if posts:
            st = self.states.setdefault(name, SinkState())
            st.type = sink.type
            st.last_attempt_at = st.last_ok_at = self.clock()
            st.last_status, st.consecutive_failures, st.delivered = status, 0, st.delivered + posts
            self.client.hset(ALERTS_SINKS, name, st.to_json())
        if new or ended:
            log.info("sink %s: told Alertmanager %d alert%s: %d newly firing (%s), %d ended", name, len(alerts),
                     "" if len(alerts) == 1 else "s", len(new), ", ".join(new) or "-", ended)
        elif alerts:
            log.debug("sink %s: sent %d active alerts to Alertmanager again", name, len(alerts))
        return posts

    def _failed(self, name: str, sink: AlertmanagerSink, result: Any, n: int) -> None:
        now = self.clock()
        self.failures[name] += 1
        fails = self.failures[name]
        if result.retry_after is not None:
            delay = min(max(0.0, result.retry_after), self.cfg.retry_after_max)
        else:
            delay = backoff_delay(fails, self.cfg.backoff_base, min(self.cfg.backoff_max, sink.resend_interval),
                                  self.cfg.jitter, self.rand())
        self.next_at[name] = now + delay
        st = self.states.setdefault(name, SinkState())
        st.type = sink.type
        st.last_attempt_at, st.last_status = now, result.status
        st.last_error_at, st.last_error = now, result.error
        st.consecutive_failures += 1
        st.failed_attempts += 1
        if result.status == 429:
            st.paused_until = max(st.paused_until, now + delay)
        self.client.hset(ALERTS_SINKS, name, st.to_json())
        log.warning("sink %s: sending %d alert%s to Alertmanager failed (%s; %d in a row); next try in %.1f s", name,
                    n, "" if n == 1 else "s", result.error, fails, delay)

    def close(self) -> None:
        self.http.close()
