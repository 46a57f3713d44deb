"""The Prometheus exporter: what the detector service stored in Redis, read at scrape time as Prometheus metrics.

A custom collector, as prometheus_client recommends for values that live elsewhere ("Custom Collectors",
prometheus.github.io/client_python/collector/custom): nothing is kept between scrapes, every scrape reads Redis
anew, so the exporter can run anywhere (inside ``trainhealth serve --metrics-port``, or alone as ``trainhealth
exporter``) and any number of them agree. :class:`ExporterCollector` does the reading (:meth:`~ExporterCollector.read`,
a fixed number of round trips whatever the number of ranks) and :func:`families` turns what was read into metric
families. Every metric is listed in docs/metrics.md.

What one scrape reads, per run it exports: the meta's status and end time (``HMGET``), the ledger's newest snapshot
(``GET th:{run}:ledger:latest``), the job's state (``GET``), and one script (:data:`RUN_LUA`) that answers from
inside Redis with a few numbers: the newest aggregate's step and end, the consumer group's backlog and lag, the k
slowest ranks of the newest step and the active incidents by kind and severity. No per-rank list, no stream and no
incident crosses the network: a scrape's size depends on the runs, not on their ranks or their history.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trainhealth import defaults, goodput
from trainhealth.job import STATES
from trainhealth.keys import RUNS, SERVICES, run_keys
from trainhealth.warn_once import WarnOnce
from trainhealth.wire import DROP_CAUSES

log = logging.getLogger(__name__)

#: Meta statuses of a run still going (as the detector service's ``LIVE_STATUSES``): exported whatever its age.
LIVE_STATUSES = ("running", "crashed")
#: Drop causes of the ledger's ``records_dropped`` (trainhealth.wire.DROP_CAUSES, and ``unknown`` for collectors
#: that did not say): each exported from 0, so ``rate()`` sees a drop's first increase.
DROP_CAUSE_LABELS = (*DROP_CAUSES, "unknown")
#: Ledger categories that are not badput: ``productive``, and ``unobserved`` (time the records do not cover, in
#: ledgers that book it: neither productive nor badput), each exported as a metric of its own.
NOT_BADPUT = goodput.NOT_BADPUT
#: The ``window`` label of the whole run's token rates, beside the ledger's rolling windows (``60s``, ...).
WHOLE_RUN = "all"
#: The most ranks ``slowest_ranks`` may ask for: the per-rank series stay few per run.
MAX_SLOWEST_RANKS = 100
#: Runs read per pipeline: Redis runs a pipeline's scripts back to back, so the collectors' and the service's
#: commands wait at most this many runs' scripts (about 0.5 ms each at 1,024 ranks, bench/exporter_scrape.py).
RUNS_PER_ROUND_TRIP = 10

#: One run's readings from inside Redis, in one call (its keys share the run's hash tag: Redis Cluster safe).
#: KEYS: agg, steps, events, incidents. ARGV: consumer group, k.
#: Returns three arrays of strings. First: the newest aggregate's ``step``, ``t_end``; the age (ms, Redis clock) of
#: the oldest input entry the group has not finished (not yet delivered, or delivered and not acknowledged), 0 when
#: none; the entries not yet delivered of ``steps`` and of ``events`` (Redis 7's group ``lag``; on 6.2 only 0 when
#: none, else ''); the fastest busy seconds of the newest step. Second: rank, busy seconds of the newest step's k
#: slowest ranks, slowest first (ties: lower rank first). Floats as ``%.17g``, which reads back as the same double.
#: Third: kind, severity, active count of the incidents, per kind and severity any incident has, so a run's many
#: resolved incidents never cross the network. A resolved incident is only searched for its ``"kind": "…"``,
#: ``"severity"`` and ``"status"`` as the service writes them (``json.dumps``); an active one, or one written
#: otherwise, is decoded with cjson (an incident that is not a JSON object with both is left out).
RUN_LUA = r"""
local k = tonumber(ARGV[2])
local out = {'', '', '0', '', '', ''}
local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local busy
if newest[1] then
  local f = newest[1][2]
  for j = 1, #f, 2 do
    if f[j] == 'step' then out[1] = f[j + 1]
    elseif f[j] == 't_end' then out[2] = f[j + 1]
    elseif f[j] == 'busy' then busy = f[j + 1] end
  end
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local oldest = nil
for i = 2, 3 do
  local key = KEYS[i]
  local start, backlog, pending = '-', nil, nil
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      local d = {}
      for j = 1, #g, 2 do d[g[j]] = g[j + 1] end
      if d['name'] == ARGV[1] then
        start = '(' .. d['last-delivered-id']
        if d['lag'] then backlog = d['lag'] end
        if tonumber(d['pending']) > 0 then
          pending = redis.call('XPENDING', key, ARGV[1])[2]
        end
      end
    end
    if start == '-' then backlog = redis.call('XLEN', key) end
  else
    backlog = 0
  end
  local first = nil
  if backlog ~= 0 then
    local e = redis.call('XRANGE', key, start, '+', 'COUNT', 1)
    if e[1] then first = e[1][1] else backlog = 0 end
  end
  out[i + 2] = backlog and tostring(backlog) or ''
  for _, id in ipairs({first or false, pending or false}) do
    if id then
      local ms = tonumber(string.match(id, '^(%d+)'))
      if oldest == nil or ms < oldest then oldest = ms end
    end
  end
end
if oldest then out[3] = tostring(math.max(0, now_ms - oldest)) end
local slowest, counts, order = {}, {}, {}
local function field(v, name)
  local at = string.find(v, '"' .. name .. '": "', 1, true)
  if at then
    local from = at + #name + 5
    return string.sub(v, from, string.find(v, '"', from, true) - 1)
  end
end
for _, v in ipairs(redis.call('HVALS', KEYS[4])) do
  local kind, severity, status = field(v, 'kind'), field(v, 'severity'), field(v, 'status')
  if not (kind and severity and status) or status == 'active' then
    local ok, inc = pcall(cjson.decode, v)
    if ok and type(inc) == 'table' then kind, severity, status = inc['kind'], inc['severity'], inc['status'] end
  end
  if type(kind) == 'string' and type(severity) == 'string' then
    local key = kind .. '\n' .. severity
    if counts[key] == nil then
      counts[key] = 0
      order[#order + 1] = {kind, severity, key}
    end
    if status == 'active' then counts[key] = counts[key] + 1 end
  end
end
local incidents = {}
for _, e in ipairs(order) do
  incidents[#incidents + 1] = e[1]
  incidents[#incidents + 1] = e[2]
  incidents[#incidents + 1] = tostring(counts[e[3]])
end
if busy and k > 0 then
  local ok, list = pcall(cjson.decode, busy)
  if ok and type(list) == 'table' then
    local best, top = nil, {}
    for i = 1, #list do
      local v = list[i]
      if type(v) == 'number' and v > 0 and v < math.huge then
        if best == nil or v < best then best = v end
        if #top < k or v > top[#top][2] then
          local pos = #top + 1
          while pos > 1 and top[pos - 1][2] < v do pos = pos - 1 end
          table.insert(top, pos, {i - 1, v})
          if #top > k then table.remove(top) end
        end
      end
    end
    if best then
      out[6] = string.format('%.17g', best)
      for _, rv in ipairs(top) do
        slowest[#slowest + 1] = tostring(rv[1])
        slowest[#slowest + 1] = string.format('%.17g', rv[2])
      end
    end
  end
end
return {out, slowest, incidents}
"""


@dataclass
class RunReading:
    """What one scrape read of one run (None: not stored, or unreadable).

    ``ledger`` is the newest ledger snapshot (docs/goodput.md); ``incidents`` the active incidents
    (``th:{run}:incidents``) per ``(kind, severity)`` any incident of the run has; ``job_state`` the job's state
    (``running``, ``hung``, ...); ``step`` and ``step_t`` the newest aggregated step and its end (unix s); ``lag_s``
    the age of the oldest input entry the detector service has not finished (s, Redis clock; 0 caught up);
    ``backlog`` the entries of each input stream not yet read by the service; ``fastest_busy_s`` and ``slowest`` the
    newest step's shortest busy seconds and the ``(rank, busy seconds)`` of its slowest ranks, slowest first.
    """

    run: str
    ledger: dict[str, Any] | None = None
    incidents: dict[tuple[str, str], int] = field(default_factory=dict)
    job_state: str | None = None
    step: int | None = None
    step_t: float | None = None
    lag_s: float | None = None
    backlog: dict[str, int] = field(default_factory=dict)
    fastest_busy_s: float | None = None
    slowest: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Scrape:
    """One scrape's readings: ``runs`` in registry order; ``services`` the detector services heard from in the
    last ``SERVICE_LIVE_S`` seconds; ``redis_up`` False when Redis could not be read (then nothing else is);
    ``seconds`` how long the reading took."""

    runs: list[RunReading] = field(default_factory=list)
    services: int | None = None
    redis_up: bool = True
    seconds: float = 0.0


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _num(v: Any) -> float | None:
    """A finite float from a stored number (bytes, str, int, float), else None."""
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(_s(v)) if isinstance(v, (bytes, str)) else float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


class ExporterCollector:
    """A prometheus_client collector of every run's health, read from Redis at each scrape.

    Register it in a ``CollectorRegistry`` and serve that (``start_http_server(port, addr, registry)``). Redis
    being away is a metric (``trainhealth_exporter_redis_up 0``), not an HTTP error, so Prometheus keeps scraping
    the exporter's own series and an alert can say which is down.

    Parameters
    ----------
    client : redis.Redis
        Where the detector service writes (bytes or ``decode_responses=True`` replies alike). Used from the HTTP
        server's threads: redis-py clients are thread-safe.
    slowest_ranks : int
        k: per run, the straggler score of the newest step's k slowest ranks (``0`` exports none). At most
        :data:`MAX_SLOWEST_RANKS`; raises ValueError outside ``0..MAX_SLOWEST_RANKS``.
    ended_keep_s : float
        An ended run (meta ``status`` not ``running`` or ``crashed``) is exported for this many seconds after it
        ended (``ended_at``, else ``updated_at``; Redis clock), so its last values reach Prometheus, then left out.
        Raises ValueError when negative or not finite.
    group : str
        The detector service's consumer group (its lag is the detector lag).

    Examples
    --------
    >>> from prometheus_client import CollectorRegistry
    >>> client = redis.Redis(port=1)  # redis-py connects on the first command: none is sent here
    >>> ExporterCollector(client, slowest_ranks=101)
    Traceback (most recent call last):
    ...
    ValueError: slowest_ranks=101 is not in 0..100
    >>> registry = CollectorRegistry()
    >>> registry.register(ExporterCollector(client))  # describe() is empty: Redis is not read at registration
    >>> [m.samples[0].value for m in registry.collect() if m.name == "trainhealth_exporter_redis_up"]
    [0.0]

    References
    ----------
    prometheus_client, "Custom Collectors" (``GaugeMetricFamily``, ``CounterMetricFamily``) and "Exporting"
    (``start_http_server``); Prometheus, "Metric and label naming" and "Writing exporters" (prometheus.io/docs/
    practices/naming, /docs/instrumenting/writing_exporters: base units, ``_total`` for counters, an ``up``-style
    metric for the exporter's own failures, no timestamps on samples).
    """

    def __init__(self, client: redis.Redis, slowest_ranks: int = defaults.EXPORTER_SLOWEST_RANKS,
                 ended_keep_s: float = defaults.EXPORTER_ENDED_KEEP_S, group: str = defaults.CONSUMER_GROUP) -> None:
        if isinstance(slowest_ranks, bool) or not isinstance(slowest_ranks, int) \
                or not 0 <= slowest_ranks <= MAX_SLOWEST_RANKS:
            raise ValueError(f"slowest_ranks={slowest_ranks!r} is not in 0..{MAX_SLOWEST_RANKS}")
        if not (isinstance(ended_keep_s, (int, float)) and math.isfinite(ended_keep_s) and ended_keep_s >= 0):
            raise ValueError(f"ended_keep_s={ended_keep_s!r} is not a number of seconds >= 0")
        self.client = client
        self.slowest_ranks = slowest_ranks
        self.ended_keep_s = float(ended_keep_s)
        self.group = group
        self._script = client.register_script(RUN_LUA)
        self._warn = WarnOnce(log, prefix="trainhealth exporter: ")

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not read Redis (the registry calls ``collect`` otherwise)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Read Redis (:meth:`read`) and yield the metric families (:func:`families`)."""
        yield from families(self.read())

    def read(self) -> Scrape:
        """Read every run to export: the registry and Redis' clock; each run's meta and the live services; each
        exported run's ledger, state and :data:`RUN_LUA`, :data:`RUNS_PER_ROUND_TRIP` runs at a time. Redis errors
        give a :class:`Scrape` with ``redis_up`` False (logged once per distinct error)."""
        started = time.perf_counter()
        try:
            scrape = self._read()
        except (redis.RedisError, OSError) as exc:
            self._warn(f"redis:{type(exc).__name__}:{exc}", "cannot read Redis (%s); exporting "
                       "trainhealth_exporter_redis_up 0", exc)
            scrape = Scrape(redis_up=False)
        scrape.seconds = time.perf_counter() - started
        return scrape

    def _read(self) -> Scrape:
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(RUNS, 0, -1)
        (sec, usec), registry = pipe.execute()
        now = sec + usec / 1e6
        runs = []
        for raw in registry:
            try:
                runs.append(run_keys(_s(raw)))
            except ValueError:
                self._warn(f"id:{_s(raw)}", "ignoring run with invalid id %r in %s", _s(raw), RUNS)
        pipe = self.client.pipeline(transaction=False)
        for keys in runs:
            pipe.hmget(keys.meta, ("status", "ended_at", "updated_at"))
        pipe.zcount(SERVICES, now - defaults.SERVICE_LIVE_S, "+inf")
        *metas, services = pipe.execute()
        chosen = [keys for keys, meta in zip(runs, metas, strict=True) if self._exported(meta, now)]
        readings = []
        for start in range(0, len(chosen), RUNS_PER_ROUND_TRIP):
            part = chosen[start:start + RUNS_PER_ROUND_TRIP]
            pipe = self.client.pipeline(transaction=False)
            for keys in part:
                pipe.get(keys.ledger_latest)
                pipe.get(keys.state)
                self._script(keys=[keys.agg, keys.steps, keys.events, keys.incidents],
                             args=[self.group, self.slowest_ranks], client=pipe)
            replies = pipe.execute(raise_on_error=False)
            for i, keys in enumerate(part):
                ledger, state, script = (self._answer(keys.run, what, reply) for what, reply in
                                         zip(("ledger:latest", "state", "the run script"), replies[3 * i:3 * i + 3],
                                             strict=True))
                readings.append(self._reading(keys.run, ledger, state, script or [[""] * 6, [], []]))
        return Scrape(runs=readings, services=int(services))

    def _exported(self, meta: list[Any], now: float) -> bool:
        status, ended_at, updated_at = meta
        if status is None or _s(status) in LIVE_STATUSES:
            return True
        ended = _num(ended_at)
        ended = _num(updated_at) if ended is None else ended
        return ended is None or now - ended <= self.ended_keep_s

    def _answer(self, run: str, what: str, reply: Any) -> Any:
        """``reply``, or None when Redis answered this command with an error (a key of the wrong type, a script
        refused): that run's record is left out, logged once; the scrape and the other runs go on. A lost
        connection raises, so the whole scrape reports Redis down."""
        if isinstance(reply, (redis.ConnectionError, redis.TimeoutError)):
            raise reply
        if isinstance(reply, Exception):
            self._warn(f"{run}:{what}:{reply}", "run %s: reading %s failed (%s); left out", run, what, reply)
            return None
        return reply

    def _json(self, run: str, what: str, raw: Any) -> Any:
        try:
            return json.loads(raw)
        except (TypeError, ValueError) as exc:
            self._warn(f"{run}:{what}", "run %s: %s is not JSON (%s); left out", run, what, exc)
            return None

    def _reading(self, run: str, ledger: Any, state: Any, script: list[Any]) -> RunReading:
        out = RunReading(run)
        if ledger is not None:
            snap = self._json(run, "ledger:latest", ledger)
            out.ledger = snap if isinstance(snap, dict) else None
        if state is not None:
            job = self._json(run, "state", state)
            if isinstance(job, dict) and job.get("state") in STATES:
                out.job_state = job["state"]
        head, slow, incidents = ([_s(v) for v in part] for part in script)
        step, step_t, lag_ms, steps_backlog, events_backlog, fastest = head
        step_n = _num(step)
        out.step = int(step_n) if step_n is not None else None
        out.step_t = _num(step_t)
        lag = _num(lag_ms)
        out.lag_s = lag / 1000.0 if lag is not None else None
        for name, n in (("steps", steps_backlog), ("events", events_backlog)):
            if _num(n) is not None:
                out.backlog[name] = int(n)
        out.fastest_busy_s = _num(fastest)
        out.slowest = [(int(slow[i]), float(slow[i + 1])) for i in range(0, len(slow) - 1, 2)]
        out.incidents = {(incidents[i], incidents[i + 1]): int(incidents[i + 2])
                         for i in range(0, len(incidents) - 2, 3)}
        return out


def families(scrape: Scrape) -> list[Metric]:
    """The metric families of one scrape, every one present even when it has no sample (docs/metrics.md).

    Values are as stored: ratios in 0..1 (the ledger's ``goodput_pct`` / 100), seconds, tokens, US dollars,
    unix seconds. Families whose source a run lacks (no ledger yet, no price, no timed sections) have no sample
    for that run.
    """
    def g(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"trainhealth_{name}", doc, labels=["run", *labels])

    def c(name: str, doc: str, *labels: str) -> CounterMetricFamily:
        return CounterMetricFamily(f"trainhealth_{name}", doc, labels=["run", *labels])

    up = GaugeMetricFamily("trainhealth_exporter_redis_up", "1 when this scrape read Redis, 0 when it could not "
                           "(then no run's series are exported).", value=1.0 if scrape.redis_up else 0.0)
    took = GaugeMetricFamily("trainhealth_exporter_scrape_duration_seconds", "Seconds this scrape spent reading "
                             "Redis.", value=scrape.seconds)
    out: list[Metric] = [up, took]
    if not scrape.redis_up:
        return out
    out.append(GaugeMetricFamily("trainhealth_exporter_runs", "Runs this scrape exported (live, or ended less than "
                                 "--keep-ended seconds ago).", value=float(len(scrape.runs))))
    out.append(GaugeMetricFamily("trainhealth_detector_services", "Detector services (trainhealth serve) heard "
                                 "from in the last 6 s; 0 means no run is being processed.",
                                 value=float(scrape.services or 0)))
    fam = {
        "step": g("step", "Newest step the detector service aggregated over all ranks."),
        "step_t": g("last_step_timestamp_seconds", "Unix time the newest aggregated step ended (its last rank)."),
        "world": g("world_size", "Ranks of the job (the ledger's world size)."),
        "wall": g("wall_seconds", "Wall-clock seconds the goodput ledger covers (run start to its newest snapshot)."),
        "productive": g("productive_seconds", "Productive seconds of the ledger (steps kept in the final lineage, "
                        "minus the badput inside them)."),
        "unobserved": g("unobserved_seconds", "Seconds the run's records do not cover (a jump in the step numbers): "
                        "neither productive nor badput; only from ledgers that book them."),
        "badput": g("badput_seconds", "Seconds lost, by cause (the ledger's badput categories; a gauge: a crash "
                    "moves steps already counted into wasted progress).", "cause"),
        "badput_gpu": g("badput_gpu_seconds", "GPU-seconds lost, by cause: badput seconds x world size (/ 3600 for "
                        "GPU-hours).", "cause"),
        "badput_usd": g("badput_cost_usd", "US dollars lost, by cause: GPU-hours x the run's GPU-hour price (runs "
                        "with a price only).", "cause"),
        "price": g("gpu_hour_price_usd", "The run's price of one GPU-hour, US dollars (runs with a price only)."),
        "goodput_time": g("goodput_time_ratio", "Goodput (time): productive seconds / wall seconds, whole run."),
        "goodput_tokens": g("goodput_tokens_ratio", "Goodput (tokens): tokens of steps kept / tokens processed, "
                            "whole run."),
        "throughput_rate": g("throughput_tokens_per_second", "Throughput: tokens processed per second inside steps, "
                             "over the ledger's rolling window or the whole run (window=all).", "window"),
        "goodput_rate": g("goodput_tokens_per_second", "Goodput: tokens of kept steps per wall-clock second, over "
                          "the ledger's rolling window or the whole run (window=all).", "window"),
        "progress_gpu": g("loss_drop_per_gpu_hour", "Learning progress: the loss decrease (loss units; negative: it "
                          "rose) per GPU-hour over the kept steps, over the ledger's rolling window or the whole run "
                          "(window=all); only where the window holds enough finite losses.", "window"),
        "progress_tok": g("loss_drop_per_billion_tokens", "Learning progress: the loss decrease per billion kept "
                          "tokens, over the ledger's rolling window or the whole run (window=all).", "window"),
        "tokens": c("tokens_processed", "Tokens processed by every step attempt (redone steps included)."),
        "tokens_kept": g("tokens_kept", "Tokens of the steps kept in the final lineage (falls when a rollback "
                         "discards steps)."),
        "steps": c("steps_completed", "Step attempts completed (redone steps included)."),
        "steps_kept": g("steps_kept", "Steps kept in the final lineage."),
        "restarts": c("restarts", "Restarts of the job (new processes, or a rollback) the ledger counted."),
        "dropped": c("records_dropped", "Records lost before the detector service read them, by cause (buffer, "
                     "spill, unencodable, trimmed, unknown).", "cause"),
        "partial": c("steps_partial", "Steps closed without every rank's record."),
        "coverage": g("rank_coverage_ratio", "Rank records the steps were built from / records there should have "
                      "been (a lower bound)."),
        "ledger_t": g("ledger_timestamp_seconds", "Unix time of the ledger's newest snapshot (the detector service "
                      "writes one every 2 s while the run is live)."),
        "incidents": g("incidents_active", "Active incidents (one per root cause), by the root cause's kind and "
                       "the incident's severity; 0 for a kind and severity whose incidents all resolved.",
                       "kind", "severity"),
        "job": g("job_state", "1 for the job's state as the detector service judges it (running, hung, crashed, "
                 "restarted, finished), 0 for the others.", "state"),
        "lag": g("detector_lag_seconds", "Age of the oldest step or event record the detector service has not "
                 "finished processing (Redis clock); 0 when caught up."),
        "backlog": g("detector_backlog_entries", "Entries of an input stream (steps, events) the detector service "
                     "has not read yet.", "stream"),
        "score": g("rank_straggler_score", "Straggler score of the newest step's slowest ranks (k per run): the "
                   "fastest rank's busy seconds / this rank's (1 = as fast as the fastest).", "rank"),
        "busy": g("rank_busy_seconds", "Busy seconds (time in its own sections) of the newest step's slowest ranks.",
                  "rank"),
    }
    for r in scrape.runs:
        _add_run(fam, r)
    return out + list(fam.values())


def _add_run(fam: Mapping[str, Any], r: RunReading) -> None:
    run = r.run
    if r.step is not None:
        fam["step"].add_metric([run], float(r.step))
    if r.step_t is not None:
        fam["step_t"].add_metric([run], r.step_t)
    if r.lag_s is not None:
        fam["lag"].add_metric([run], r.lag_s)
    for stream, n in r.backlog.items():
        fam["backlog"].add_metric([run, stream], float(n))
    if r.fastest_busy_s is not None:
        for rank, busy in r.slowest:
            fam["score"].add_metric([run, str(rank)], r.fastest_busy_s / busy)
            fam["busy"].add_metric([run, str(rank)], busy)
    if r.job_state is not None:
        for state in STATES:
            fam["job"].add_metric([run, state], 1.0 if state == r.job_state else 0.0)
    for (kind, severity), n in sorted(r.incidents.items()):
        fam["incidents"].add_metric([run, kind, severity], float(n))
    if r.ledger is not None:
        _add_ledger(fam, run, r.ledger)


def _add_ledger(fam: Mapping[str, Any], run: str, snap: Mapping[str, Any]) -> None:
    """The ledger snapshot's figures (docs/goodput.md); a field missing or not a finite number is left out."""
    def put(name: str, value: Any, *labels: str) -> None:
        x = _num(value)
        if x is not None:
            fam[name].add_metric([run, *labels], x)

    put("world", snap.get("world_size"))
    put("wall", snap.get("wall_s"))
    put("ledger_t", snap.get("t"))
    put("price", snap.get("gpu_hour_usd"))
    seconds = snap.get("seconds") if isinstance(snap.get("seconds"), dict) else {}
    cost = snap.get("cost_usd") if isinstance(snap.get("cost_usd"), dict) else {}
    world = _num(snap.get("world_size"))
    put("productive", seconds.get("productive"))
    put("unobserved", seconds.get("unobserved"))
    for cause in seconds:
        if cause not in NOT_BADPUT:
            put("badput", seconds[cause], cause)
            lost = _num(seconds[cause])
            if lost is not None and world is not None:  # the ledger's GPU-hours x 3600, without the round trip
                fam["badput_gpu"].add_metric([run, cause], lost * world)
            put("badput_usd", cost.get(cause), cause)
    pct = _num(snap.get("goodput_pct"))
    if pct is not None:
        fam["goodput_time"].add_metric([run], pct / 100.0)
    tokens, kept = _num(snap.get("tokens_total")), _num(snap.get("tokens_good"))
    if tokens and kept is not None:
        fam["goodput_tokens"].add_metric([run], kept / tokens)
    put("tokens", tokens)
    put("tokens_kept", kept)
    put("throughput_rate", snap.get("throughput_tok_s"), WHOLE_RUN)
    put("goodput_rate", snap.get("goodput_tok_s"), WHOLE_RUN)
    rates = snap.get("rates") if isinstance(snap.get("rates"), dict) else {}
    for window, rate in rates.items():
        if isinstance(rate, dict):
            put("throughput_rate", rate.get("throughput_tok_s"), window)
            put("goodput_rate", rate.get("goodput_tok_s"), window)
            put("progress_gpu", rate.get("loss_drop_per_gpu_hour"), window)
            put("progress_tok", rate.get("loss_drop_per_btok"), window)
    progress = snap.get("progress") if isinstance(snap.get("progress"), dict) else {}
    put("progress_gpu", progress.get("loss_drop_per_gpu_hour"), WHOLE_RUN)
    put("progress_tok", progress.get("loss_drop_per_btok"), WHOLE_RUN)
    put("steps", snap.get("steps_done"))
    put("steps_kept", snap.get("steps_good"))
    put("restarts", snap.get("restarts"))
    dropped = snap.get("records_dropped") if isinstance(snap.get("records_dropped"), dict) else {}
    for cause in dict.fromkeys([*DROP_CAUSE_LABELS, *dropped]):
        if cause not in ("total", "by_rank"):
            put("dropped", dropped.get(cause, 0), cause)
    put("partial", snap.get("steps_partial"))
    coverage = _num(snap.get("coverage_pct"))
    if coverage is not None:
        fam["coverage"].add_metric([run], coverage / 100.0)
