"""Chaos: a scripted job run twice, once clean (the reference) and once with faults; exact counts compared.

Run: ``.venv/bin/python bench/chaos.py`` (about 70 s on 2 cores; ``--help`` for the sizes; ``--json`` prints
the whole result). Everything is real and local: password-protected redis-server processes (AOF on,
``appendfsync always``, so one SIGKILLed restarts with every write it acknowledged), ``trainhealth serve``
and ``trainhealth alerts --config FILE`` processes, the job's ranks as processes with real
:class:`~trainhealth.Monitor` s, and an HTTP receiver (``http.server`` in a thread) whose webhook URLs carry a
secret token.

The job (``chaos-job``, 2 ranks by default, one step every ``--step-s`` seconds): rank 1 is slow (its
``forward`` section twice rank 0's: a straggler from step 0), the loss spikes for a few steps at 45 % of
the run and is NaN for a few steps at 60 %. A second run (``chaos-lossy``, 1 rank) logs alongside with a
16-record buffer and no spill. Each phase starts its own redis-server, serve, alert worker and receiver.

Phase ``reference``: nothing goes wrong; the receiver answers 200.

Phase ``chaos``, the same job with, in order:

1. ``trainhealth serve`` SIGKILLed at 15 % of the run and started again at once (same ``--consumer``):
   seconds until the run is processed again.
2. The receiver answers the first requests 500, 500, then 429 with ``Retry-After: 1``, then 200; it holds
   the first request of the loss spike's notification until the alert worker has been SIGKILLed (the
   request is then answered 503, to nobody), and the worker is started again (same ``--consumer``, so it
   takes its lease back at once).
3. The redis-server SIGKILLed at 75 % of the run for ``--outage-s`` seconds, then restarted on the same
   port and data: the job's ranks spill to disk (32-record buffer, spill on), the lossy run drops
   records (counted). Every ``log_step`` call of every rank is timed (``time.perf_counter_ns``, CLOCK_MONOTONIC
   on Linux, as the parent's clock): the longest during the outage is a figure.
4. After the job: a fast job (``chaos-fast``, 1 rank) logs as fast as it can for ``--fast-s`` seconds
   (retention 100,000 records) while serve runs: its heartbeat must keep updating and no critical anomaly
   may name it; Redis ``used_memory`` at the end is the memory figure.

Checks (all exact): per rank, records logged = records stored in Redis + records dropped (by cause), records
the sender counted as sent = records stored, no step stored twice, in order, and the ``collector_drops``
events and the ledger add up to the counted drops; the anomalies (id, kind, severity, step, status) equal the
reference's; each anomaly opened exactly once; every idempotency key the outbox holds answered 2xx exactly
once, and the notifications received are exactly those the anomaly logs imply (one ``firing`` per anomaly,
one ``resolved`` per resolved one, per sink the route gives: every alert to ``hook``, criticals to ``page``
as well); no dead_rank, hang or other critical page for a live rank; no secret (Redis password, webhook
token, HMAC key) in any captured log (stdout and stderr of every serve, alerts and rank process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from trainhealth.embedded_redis import find_redis_server, free_port  # noqa: E402

JOB, LOSSY, FAST = "chaos-job", "chaos-lossy", "chaos-fast"
SERVE_NAME, ALERTS_NAME = "chaos-svc", "chaos-alerts"
#: The secrets that must never appear in a log.
PASSWORD = "pw-secret-5b1e0c"
TOKEN = "s3cr3t-tok-9f27d4"
HMAC_KEY = "whsec-chaos-c0ffee"
#: Steps the loss spike and the NaN last.
SPIKE_STEPS, NAN_STEPS = 6, 6
#: The receiver's answers to its first requests (the rest get 200, except the held one).
SCRIPT = (500, 500, 429)
#: Buffers: the job's ranks (spill on) and the lossy run's (no spill).
JOB_BUFFER, LOSSY_BUFFER = 32, 16
FAST_RETENTION = 100_000
_PY = sys.executable


# -- small helpers --------------------------------------------------------------------------------------------
def _wait(pred: Callable[[], Any], timeout: float, what: str, poll: float = 0.05) -> float:
    """Seconds until ``pred()`` is truthy (a Redis error counts as not yet); TimeoutError after ``timeout``."""
    t0 = time.monotonic()
    while True:
        try:
            if pred():
                return time.monotonic() - t0
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def _last_step(r: redis.Redis, run: str) -> int:
    """The newest step in the run's aggregate stream (-1 for none)."""
    last = r.xrevrange(f"th:{{{run}}}:agg", count=1)
    return int(last[0][0].decode().split("-")[1]) if last else -1


def _serving(r: redis.Redis) -> bool:
    """serve has processed a batch (its heartbeat's ``progress_t``): past its start-up imports. Its heartbeat
    alone is written before them, and a job logged meanwhile is read as one backlog."""
    raw = r.get(f"th:service:{SERVE_NAME}")
    return bool(raw) and json.loads(raw).get("progress_t") is not None


def _alerting(r: redis.Redis) -> bool:
    """The alert worker leads and both its loops ran."""
    raw = r.get(f"th:{{alerts}}:worker:{ALERTS_NAME}")
    if not raw:
        return False
    hb = json.loads(raw)
    return hb.get("role") == "leader" and hb.get("intake_ok_at") is not None and hb.get("delivery_ok_at") is not None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pct(values: list[int], q: float) -> int:
    if not values:
        return 0
    v = sorted(values)
    return v[min(len(v) - 1, int(q / 100 * len(v)))]


@dataclass
class Plan:
    """Where things happen, in steps of the job."""

    steps: int
    step_s: float
    ranks: int
    outage_s: float
    fast_s: float

    @property
    def serve_kill(self) -> int:
        return int(self.steps * 0.15)

    @property
    def spike(self) -> int:
        return int(self.steps * 0.45)

    @property
    def nan(self) -> int:
        return int(self.steps * 0.60)

    @property
    def outage(self) -> int:
        return int(self.steps * 0.75)


# -- the ranks (run in their own processes: ``chaos.py --rank SPEC.json``) ---------------------------------------
def _noise(s: int) -> float:
    """Batch-to-batch noise in [0, 0.01): a multiplicative hash of the step, the same on every run."""
    return ((s * 2654435761) % 1000) / 1e5


def _loss(spec: dict[str, Any], s: int) -> float:
    if spec["spike"] <= s < spec["spike"] + SPIKE_STEPS:
        return 9.0 + 10 * _noise(s)  # not one frozen value (that is a loss_collapse)
    if spec["nan"] <= s < spec["nan"] + NAN_STEPS:
        return math.nan
    return 3.0 - 0.5 * s / max(1, spec["steps"]) + _noise(s + spec["rank"])


def rank_main(spec_path: str) -> int:
    """One rank: a Monitor, ready/go handshake, the scripted (or fast) loop, close, a JSON of its counters."""
    from trainhealth.collectors import Monitor

    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mon = Monitor(spec["run"], rank=spec["rank"], world_size=spec["world"], host=f"node-{spec['rank']}",
                  buffer_records=spec["buffer"], spill_dir=spec["spill"] or False, flush_interval=0.05,
                  heartbeat_interval=spec["heartbeat_s"], close_timeout=60.0, retention=spec.get("retention"))
    Path(spec["ready"]).touch()
    go = Path(spec["go"])
    while not go.exists():
        time.sleep(0.005)
    t_go = float(go.read_text())
    clock = time.perf_counter_ns
    starts, durs = array("q"), array("q")
    busy = 0.08 if spec["slow"] else 0.04
    logged = 0
    if spec["mode"] == "fast":
        end = t_go + spec["seconds"]
        s = 0
        while time.time() < end:
            for _ in range(256):
                t0 = clock()
                mon.log_step(s, loss=2.0 + _noise(s), tokens=4096)
                durs.append(clock() - t0)
                s += 1
        logged = s
    else:
        step_s = spec["step_s"]
        for s in range(spec["steps"]):
            delay = t_go + s * step_s - time.time()
            if delay > 0:
                time.sleep(delay)
            mon.add_section("data", 0.004)
            mon.add_section("forward", busy)
            t0 = clock()
            mon.log_step(s, loss=_loss(spec, s), grad_norm=1.0, lr=1e-4, tokens=4096)
            t1 = clock()
            starts.append(t0)
            durs.append(t1 - t0)
        logged = spec["steps"]
    sender = mon._sender
    ok = mon.close()
    out = {"run": spec["run"], "rank": spec["rank"], "steps_logged": logged, "close_ok": ok,
           "sent": sender.sent, "dropped_total": mon.dropped_total, "drops_by_cause": sender.drops_by_cause(),
           "pending": sender.pending}
    if spec["mode"] == "fast":
        d = sorted(durs)
        out["calls"] = {"n": len(d), "p50": d[len(d) // 2] if d else 0, "p99": d[int(len(d) * 0.99)] if d else 0,
                        "max": d[-1] if d else 0}
    else:
        out["starts"], out["durs"] = list(starts), list(durs)
    tmp = Path(spec["result"] + ".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, spec["result"])
    return 0


# -- the processes the parent owns ----------------------------------------------------------------------------
class RedisProc:
    """A password-protected redis-server with AOF (``appendfsync always``), SIGKILLed and restarted on its port."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"
        self.conf = directory / "redis.conf"
        # The password in a file, not on a command line (ps shows those).
        self.conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {directory}\nappendonly yes\n"
                             f"appendfsync always\nsave \"\"\nrequirepass {PASSWORD}\n")
        self.proc: subprocess.Popen | None = None
        self.log = directory / "redis-server.log"

    def start(self) -> None:
        with self.log.open("a") as f:
            self.proc = subprocess.Popen([find_redis_server(), str(self.conf)], stdout=f, stderr=subprocess.STDOUT)
        client = self.client()
        _wait(client.ping, 20, "redis-server to answer PING")
        client.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10, socket_connect_timeout=2)


@dataclass
class Request:
    sink: str
    key: str
    status: int
    token_ok: bool
    signed: bool
    body: dict[str, Any]
    t: float


class Receiver:
    """A local HTTP receiver of the webhook sinks (``/hook``, ``/page``), answering from a script.

    ``script`` answers the first requests (whatever their sink); ``hold`` picks one request (after the
    scripted ones) whose answer waits until :attr:`release` is set, and is then 503 (the worker that sent it
    is dead by then). Every request is recorded with its ``Idempotency-Key`` and the answer given.
    """

    def __init__(self, script: tuple[int, ...] = (), hold: Callable[[dict[str, Any]], bool] | None = None) -> None:
        from trainhealth.alerts.signing import verify

        self.script = list(script)
        self.hold = hold
        self.requests: list[Request] = []
        self.held = threading.Event()  # the held request arrived
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._held_once = False
        recv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # no access log on stderr

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                parts = urlsplit(self.path)
                token_ok = parse_qs(parts.query).get("token") == [TOKEN]
                try:
                    verify(body, self.headers.get("X-Trainhealth-Signature", ""), HMAC_KEY.encode())
                    signed = True
                except Exception:
                    signed = False
                payload = json.loads(body or b"{}")
                hold = False
                with recv._lock:
                    n = len(recv.requests)
                    if not token_ok or not signed:
                        status = 403
                    elif n < len(recv.script):
                        status = recv.script[n]
                    elif recv.hold is not None and not recv._held_once and recv.hold(payload):
                        recv._held_once, hold, status = True, True, 503
                    else:
                        status = 200
                    req = Request(parts.path.strip("/"), self.headers.get("Idempotency-Key", ""), status, token_ok,
                                  signed, payload, time.monotonic())
                    recv.requests.append(req)
                if hold:
                    recv.held.set()
                    recv.release.wait(120)
                with contextlib.suppress(OSError):  # the held request's worker is gone
                    self.send_response(status)
                    if status == 429:
                        self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a connection the killed worker left (reset by peer): nothing to tell

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="receiver", daemon=True)
        self.thread.start()

    def url(self, sink: str) -> str:
        return f"http://127.0.0.1:{self.port}/{sink}?token={TOKEN}"

    def ok(self) -> list[Request]:
        """Requests answered 2xx, in arrival order."""
        with self._lock:
            return [r for r in self.requests if 200 <= r.status < 300]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


ALERTS_TOML = """
dashboard_url = "http://127.0.0.1:8501"
[route]
receivers = ["hook"]
group_wait = "0s"
group_interval = "1s"
[[route.routes]]
matchers = ['severity="critical"']
receivers = ["hook", "page"]
[sinks.hook]
type = "webhook"
url_env = "TH_CHAOS_HOOK_URL"
secret_env = "TH_CHAOS_HMAC"
timeout = "30s"
[sinks.page]
type = "webhook"
url_env = "TH_CHAOS_PAGE_URL"
secret_env = "TH_CHAOS_HMAC"
timeout = "30s"
[delivery]
backoff_base = "500ms"
jitter = 0
"""


@dataclass
class Phase:
    """One phase's processes, files and what was measured."""

    name: str
    plan: Plan
    directory: Path
    redis: RedisProc
    receiver: Receiver
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    starts: Counter = field(default_factory=Counter)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINHEALTH_")}
        env.update({"TRAINHEALTH_REDIS_URL": self.redis.url, "TRAINHEALTH_HOME": str(self.directory / "home"),
                    "TH_CHAOS_HOOK_URL": self.receiver.url("hook"), "TH_CHAOS_PAGE_URL": self.receiver.url("page"),
                    "TH_CHAOS_HMAC": HMAC_KEY, "PYTHONUNBUFFERED": "1"})
        return env

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with self.lock:
            self.starts[name] += 1
            log = self.directory / f"{name}-{self.starts[name]}.log"
            self.logs.append(log)
            with log.open("w") as f:
                p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=self.env(), cwd=ROOT)
            self.procs[name] = p
            return p

    def serve(self) -> subprocess.Popen:
        # The URL on the command line, with its password: serve must say it redacted (the ranks read it from
        # the environment).
        return self.spawn("serve", [_PY, "-m", "trainhealth", "serve", "--redis-url", self.redis.url,
                                    "--consumer", SERVE_NAME])

    def alerts(self) -> subprocess.Popen:
        cfg = str(self.directory / "alerts.toml")
        return self.spawn("alerts", [_PY, "-m", "trainhealth", "alerts", "--config", cfg, "--consumer", ALERTS_NAME,
                                     "--catch-up", "10m"])

    def kill(self, name: str) -> None:
        with self.lock:
            p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait(20)

    def stop_all(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        with self.lock:
            procs = dict(self.procs)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in procs.items():
            try:
                codes[name] = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait(10)
        return codes


def _rank_spec(ph: Phase, run: str, rank: int, world: int, mode: str, **extra: Any) -> dict[str, Any]:
    d = ph.directory
    tag = f"{run}-r{rank}"
    plan = ph.plan
    spec = {"run": run, "rank": rank, "world": world, "mode": mode, "steps": plan.steps, "step_s": plan.step_s,
            "spike": plan.spike if run == JOB else -10**9, "nan": plan.nan if run == JOB else -10**9,
            "slow": run == JOB and rank == 1, "buffer": JOB_BUFFER, "spill": str(d / f"spill-{tag}"),
            "heartbeat_s": 5.0, "ready": str(d / f"{tag}.ready"), "go": str(d / "go"),
            "result": str(d / f"{tag}.json")}
    spec.update(extra)
    path = d / f"{tag}.spec.json"
    path.write_text(json.dumps(spec))
    spec["path"] = str(path)
    return spec


def _go(ph: Phase, specs: list[dict[str, Any]], lead_s: float = 0.3) -> float:
    """Start the ranks, wait until every Monitor is built, then give them one start time; returns it (unix s)."""
    go = ph.directory / "go"
    go.unlink(missing_ok=True)
    for spec in specs:
        ph.spawn(f"{spec['run']}-r{spec['rank']}", [_PY, __file__, "--rank", spec["path"]])
    _wait(lambda: all(Path(s["ready"]).exists() for s in specs), 60, "the ranks' Monitors")
    t_go = time.time() + lead_s
    tmp = go.with_suffix(".tmp")
    tmp.write_text(repr(t_go))
    os.replace(tmp, go)
    return t_go


def _results(specs: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    _wait(lambda: all(Path(s["result"]).exists() for s in specs), timeout, "the ranks to finish", poll=0.2)
    return [json.loads(Path(s["result"]).read_text()) for s in specs]


# -- what Redis holds --------------------------------------------------------------------------------------------
def _stored(r: redis.Redis, run: str) -> dict[str, Any]:
    """Per rank: the steps stored (in stream order), and the events by kind; the collector_drops counts."""
    from trainhealth.wire import decode_event, decode_steps

    steps: dict[int, list[int]] = {}
    for _, f in r.xrange(f"th:{{{run}}}:steps"):
        for rec in decode_steps(f):
            steps.setdefault(rec.rank, []).append(rec.step)
    events: dict[int, Counter] = {}
    drops: dict[int, Counter] = {}
    for _, f in r.xrange(f"th:{{{run}}}:events"):
        e = decode_event(f)
        events.setdefault(e.rank, Counter())[e.kind] += 1
        if e.kind == "collector_drops":
            c = drops.setdefault(e.rank, Counter())
            c["count"] += int(e.extra.get("count", 0))
            for cause in ("buffer", "spill", "unencodable"):
                c[cause] += int(e.extra.get(cause, 0))
    return {"steps": steps, "events": events, "drops": drops}


def _anomalies(r: redis.Redis, run: str) -> dict[str, dict[str, Any]]:
    return {_s(k): json.loads(v) for k, v in r.hgetall(f"th:{{{run}}}:anomalies").items()}


def _anomaly_log(r: redis.Redis, run: str) -> list[tuple[str, dict[str, Any]]]:
    return [(_s(f[b"transition"]), json.loads(f[b"json"])) for _, f in r.xrange(f"th:{{{run}}}:anomaly_log")]


def _summary(anoms: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, int, str]]:
    return sorted((a["id"], a["kind"], a["severity"], a["step"], a["status"]) for a in anoms.values())


def _implied(r: redis.Redis, runs: list[str]) -> Counter:
    """The notifications the anomaly logs imply, as (sink, run, kind, status) -> count, for this config (groups
    of run and kind, ``group_wait`` 0): per anomaly one ``firing`` (an anomaly first written already over is a
    point event: that one only) and one ``resolved`` once it resolves; to ``hook``, and to ``page`` too when
    critical."""
    out: Counter = Counter()
    for run in runs:
        seen: dict[str, tuple[bool, bool, str, str]] = {}  # id -> (born resolved, resolved later, severity, kind)
        for transition, a in _anomaly_log(r, run):
            born, later, _, _ = seen.get(a["id"], (False, False, "", ""))
            if transition == "opened":
                born = a["status"] == "resolved"
            elif transition == "resolved":
                later = True
            seen[a["id"]] = (born, later, a["severity"], a["kind"])
        for born, later, sev, kind in seen.values():
            for sink in ("hook", "page") if sev == "critical" else ("hook",):
                out[(sink, run, kind, "firing")] += 1
                if later and not born:
                    out[(sink, run, kind, "resolved")] += 1
    return out


def _received(reqs: list[Request]) -> Counter:
    """(sink, run, kind, status) -> count of the notifications received."""
    return Counter((q.sink, q.body.get("group_labels", {}).get("run"), q.body.get("group_labels", {}).get("kind"),
                    q.body.get("status")) for q in reqs)


def _hot(results: list[dict[str, Any]], lo: int, hi: int) -> dict[str, int]:
    """``log_step`` call times (ns) of the job's ranks whose call started in [lo, hi] (perf_counter_ns)."""
    inside = [d for res in results if "starts" in res for s, d in zip(res["starts"], res["durs"], strict=True)
              if lo <= s <= hi]
    return {"calls": len(inside), "p50_ns": _pct(inside, 50), "p99_ns": _pct(inside, 99),
            "max_ns": max(inside, default=0)}


# -- one phase ---------------------------------------------------------------------------------------------------
def _phase(name: str, plan: Plan, base: Path, faults: bool) -> dict[str, Any]:
    directory = base / name
    directory.mkdir(parents=True)
    (directory / "home").mkdir()
    (directory / "alerts.toml").write_text(ALERTS_TOML)
    rp = RedisProc(directory)
    rp.start()
    hold = (lambda p: 'kind="loss_spike"' in p.get("group_key", "") and p.get("status") == "firing") if faults else None
    receiver = Receiver(SCRIPT if faults else (), hold)
    ph = Phase(name, plan, directory, rp, receiver)
    out: dict[str, Any] = {"phase": name}
    r = rp.client()
    watcher: threading.Thread | None = None
    try:
        ph.serve()
        ph.alerts()
        t0 = time.monotonic()
        _wait(lambda: _serving(r) and _alerting(r), 120, "serve and the alert worker to start")
        out["ready_s"] = round(time.monotonic() - t0, 2)
        specs = [_rank_spec(ph, JOB, k, plan.ranks, "job") for k in range(plan.ranks)]
        specs.append(_rank_spec(ph, LOSSY, 0, 1, "job", buffer=LOSSY_BUFFER, spill=None))
        alert_fault: dict[str, float] = {}
        if faults:
            def worker_fault() -> None:
                if not receiver.held.wait(plan.steps * plan.step_s + 120):
                    return
                t0 = time.monotonic()
                ph.kill("alerts")  # between sending and acknowledging: its entry stays pending
                receiver.release.set()
                alert_fault["killed_at"] = t0
                ph.alerts()  # same consumer: takes its lease back at once, claims the pending entry
                alert_fault["restarted_s"] = time.monotonic() - t0

            watcher = threading.Thread(target=worker_fault, name="alert-worker-fault", daemon=True)
            watcher.start()
        t_go = _go(ph, specs)
        at = lambda step: t_go + step * plan.step_s  # noqa: E731 - when a step is logged
        if faults:
            # 1. serve SIGKILLed, started again at once.
            time.sleep(max(0.0, at(plan.serve_kill) - time.time()))
            reached = _last_step(r, JOB)
            t0 = time.monotonic()
            ph.kill("serve")
            ph.serve()
            out["serve_restart_s"] = round(_wait(lambda: _last_step(r, JOB) > reached + 1, 60,
                                                 "the restarted serve to process the run"), 2)
            out["serve_killed_at_step"] = reached
            out["serve_behind_steps"] = round((time.time() - at(0)) / plan.step_s) - reached
            del t0
            # 3. Redis SIGKILLed for outage_s, restarted with its data.
            time.sleep(max(0.0, at(plan.outage) - time.time()))
            before = _last_step(r, JOB)
            r.close()
            k0 = time.perf_counter_ns()
            rp.kill()
            time.sleep(plan.outage_s)
            k1 = time.perf_counter_ns()
            rp.start()
            out["outage_s"] = round((k1 - k0) / 1e9, 2)
            logged_at_restart = round((time.time() - at(0)) / plan.step_s)
            out["redis_resumed_s"] = round(_wait(lambda: _last_step(r, JOB) >= min(logged_at_restart, plan.steps - 1),
                                                 60, "processing after the Redis restart"), 2)
            k2 = time.perf_counter_ns()
            out["outage_steps"] = [before, logged_at_restart]
            out["outage_window_ns"] = (k0, k1, k2)
        results = _results(specs, plan.steps * plan.step_s + 120)
        _wait(lambda: _last_step(r, JOB) == plan.steps - 1 and _last_step(r, LOSSY) == plan.steps - 1, 60,
              "every step aggregated")
        if watcher is not None:
            watcher.join(60)
            out["alerts_restart_s"] = round(alert_fault.get("restarted_s", math.nan), 2)
        # Settle: the anomaly logs stop changing, the intake read them all, every outbox entry is delivered and
        # the receiver got what they imply.
        runs = [JOB, LOSSY]

        def settled() -> bool:
            logs = [r.xlen(f"th:{{{run}}}:anomaly_log") for run in runs]
            pending = sum(r.xpending(f"th:{{{run}}}:anomaly_log", "th-alerts")["pending"] for run in runs)
            lag = []
            for run in runs:
                last = r.xrevrange(f"th:{{{run}}}:anomaly_log", count=1)
                read = [_s(g["last-delivered-id"]) for g in r.xinfo_groups(f"th:{{{run}}}:anomaly_log")
                        if _s(g["name"]) == "th-alerts"] if last else []
                if last and read != [_s(last[0][0])]:
                    lag.append(run)
            outbox_pending = r.xpending("th:{alerts}:outbox", "th-alerts-delivery")["pending"] \
                if r.exists("th:{alerts}:outbox") else 0
            groups_due = [json.loads(v) for v in r.hvals("th:{alerts}:groups")]
            done = (not pending and not lag and not outbox_pending and r.zcard("th:{alerts}:retry") == 0
                    and _implied(r, runs) == _received(receiver.ok())
                    and all(not any(a["status"] == "resolved" for a in g["alerts"]) for g in groups_due))
            if done and settled.logs == logs:
                return True
            settled.logs = logs  # type: ignore[attr-defined]
            return False

        settled.logs = None  # type: ignore[attr-defined]
        try:
            _wait(settled, 90, "the alerts to settle", poll=0.5)
            out["alerts_settled"] = True
        except TimeoutError:
            out["alerts_settled"] = False
        # -- the figures and checks of the run ------------------------------------------------------------
        out.update(_collectors(r, results))
        for run in runs:
            anoms = _anomalies(r, run)
            out.setdefault("anomalies", {})[run] = _summary(anoms)
            opened = Counter(a["id"] for t, a in _anomaly_log(r, run) if t == "opened")
            out.setdefault("opened_twice", {})[run] = sorted(k for k, v in opened.items() if v != 1)
            out.setdefault("transitions", {})[run] = [(t, a["id"]) for t, a in _anomaly_log(r, run)]
        lossy_ledger = json.loads(r.get(f"th:{{{LOSSY}}}:ledger:latest") or "{}")
        out["lossy_ledger_dropped"] = lossy_ledger.get("records_dropped")
        out["implied"] = sorted(_implied(r, runs).items())
        out["received_ok"] = sorted(_received(receiver.ok()).items())
        out.update(_deliveries(r, receiver))
        if faults:
            k0, k1, k2 = out.pop("outage_window_ns")
            out["hot_outage"] = _hot(results, k0, k1)
            out["hot_drain"] = _hot(results, k1, k2)
            out["hot_all"] = _hot(results, 0, 2**63 - 1)
            out["outage_records"] = out["hot_outage"]["calls"]
            out.update(_fast(ph, r))
        info = r.info("memory")
        out["used_memory"] = int(info["used_memory"])
        out["used_memory_peak"] = int(info["used_memory_peak"])
    finally:
        if watcher is not None:
            receiver.release.set()
        out["exit_codes"] = ph.stop_all()
        with contextlib.suppress(redis.RedisError):
            r.close()
        rp.stop()
        receiver.close()
    out["logs"] = _scan_logs(ph.logs)
    return out


def _collectors(r: redis.Redis, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank: logged, sent, stored, dropped by cause; the exact balances."""
    rows: dict[str, dict[str, Any]] = {}
    stored = {run: _stored(r, run) for run in {res["run"] for res in results}}
    for res in results:
        st = stored[res["run"]]
        rank = res["rank"]
        steps = st["steps"].get(rank, [])
        ev = st["events"].get(rank, Counter())
        own_events = ev["run_start"] + ev["run_end"]
        drops = st["drops"].get(rank, Counter())
        rows[f"{res['run']}/{rank}"] = {
            "logged": res["steps_logged"] + 2,  # the steps, run_start, run_end
            "steps_logged": res["steps_logged"], "stored": len(steps) + own_events, "steps_stored": len(steps),
            "sent": res["sent"], "dropped": res["dropped_total"], "drops_by_cause": res["drops_by_cause"],
            "drops_reported": dict(drops), "duplicates": len(steps) - len(set(steps)),
            "in_order": steps == sorted(steps), "close_ok": res["close_ok"],
            "last_step": steps[-1] if steps else None,
        }
    return {"collectors": rows}


def _deliveries(r: redis.Redis, receiver: Receiver) -> dict[str, Any]:
    """The outbox's keys against what the receiver answered."""
    keys = Counter(_s(f[b"key"]) for _, f in r.xrange("th:{alerts}:outbox"))
    ok = Counter(q.key for q in receiver.ok())
    with receiver._lock:
        reqs = list(receiver.requests)
    by_key = Counter(q.key for q in reqs)
    return {"outbox_keys": len(keys), "outbox_keys_once": all(v == 1 for v in keys.values()),
            "keys_ok_once": set(ok) == set(keys) and all(v == 1 for v in ok.values()),
            "requests": len(reqs), "answers": dict(sorted(Counter(q.status for q in reqs).items())),
            "resent_keys": sum(1 for v in by_key.values() if v > 1),
            "resends_identical": all(
                len({json.dumps(q.body, sort_keys=True) for q in reqs if q.key == k}) == 1
                for k, v in by_key.items() if v > 1),
            "unsigned_or_bad_token": sum(1 for q in reqs if not (q.signed and q.token_ok)),
            "pages": sorted((q.body.get("group_labels", {}).get("kind"), q.body.get("status")) for q in receiver.ok()
                            if q.sink == "page"),
            "dead_letters": r.llen("th:{alerts}:dead")}


def _fast(ph: Phase, r: redis.Redis) -> dict[str, Any]:
    """A fast job with serve running: heartbeat updates, no critical anomaly naming it, Redis memory."""
    plan = ph.plan
    spec = _rank_spec(ph, FAST, 0, 1, "fast", seconds=plan.fast_s, buffer=100_000, heartbeat_s=1.0,
                      retention=FAST_RETENTION)
    _go(ph, [spec], lead_s=0.1)
    beats: list[float] = []
    ages: list[float] = []
    end = time.monotonic() + plan.fast_s + 120
    result = Path(spec["result"])
    while not result.exists() and time.monotonic() < end:
        raw = r.hget(f"th:{{{FAST}}}:hb", "0")
        if raw:
            t = float(json.loads(raw)["t"])
            if not beats or t != beats[-1]:
                beats.append(t)
            ages.append(time.time() - t)
        time.sleep(0.2)
    (res,) = _results([spec], 60)
    _wait(lambda: _last_step(r, FAST) == res["steps_logged"] - 1, 120, "the fast run aggregated", poll=0.2)
    anoms = _anomalies(r, FAST)
    return {"fast": {"seconds": plan.fast_s, "logged": res["steps_logged"], "sent": res["sent"],
                     "dropped": res["dropped_total"], "drops_by_cause": res["drops_by_cause"],
                     "records_per_s": round(res["steps_logged"] / plan.fast_s), "calls": res["calls"],
                     "stream_entries": r.xlen(f"th:{{{FAST}}}:steps"), "heartbeats_seen": len(beats),
                     "heartbeat_max_age_s": round(max(ages, default=math.nan), 2),
                     "anomalies": _summary(anoms),
                     "critical": sorted(a["id"] for a in anoms.values() if a["severity"] == "critical"),
                     "close_ok": res["close_ok"]}}


def _scan_logs(logs: list[Path]) -> dict[str, Any]:
    leaks: dict[str, list[str]] = {}
    tracebacks: dict[str, int] = {}
    for path in logs:
        text = path.read_text(errors="replace") if path.exists() else ""
        found = [name for name, secret in (("password", PASSWORD), ("token", TOKEN), ("hmac", HMAC_KEY))
                 if secret in text]
        if found:
            leaks[path.name] = found
        if "Traceback" in text:
            tracebacks[path.name] = text.count("Traceback")
    return {"files": len(logs), "leaks": leaks, "tracebacks": tracebacks}


def run(steps: int = 300, step_s: float = 0.07, ranks: int = 2, outage_s: float = 3.0, fast_s: float = 4.0,
        log_dir: Path | None = None) -> dict[str, Any]:
    """Run the reference phase, then the chaos phase; return their figures and the checks.

    Returns a dict: ``reference`` and ``chaos`` (each: ``collectors`` per rank, ``anomalies`` and
    ``transitions`` per run, ``opened_twice``, ``implied`` and ``received_ok`` notifications, the outbox and
    receiver counts, ``used_memory``, ``logs`` (files scanned, secrets found, tracebacks), exit codes; the
    chaos phase also ``serve_restart_s``, ``outage_s``, ``redis_resumed_s``, ``alerts_restart_s``,
    ``hot_outage``/``hot_drain``/``hot_all`` (log_step ns), ``fast``), and ``checks`` (name -> bool).
    Raises TimeoutError when a phase does not reach a state within generous bounds.
    """
    plan = Plan(steps, step_s, ranks, outage_s, fast_s)
    base = log_dir or Path(tempfile.mkdtemp(prefix="th-chaos-"))
    t0 = time.monotonic()
    ref = _phase("reference", plan, base, faults=False)
    chaos = _phase("chaos", plan, base, faults=True)
    out = {"plan": {"steps": steps, "step_s": step_s, "ranks": ranks, "outage_s": outage_s, "fast_s": fast_s,
                    "serve_kill": plan.serve_kill, "spike": plan.spike, "nan": plan.nan, "outage": plan.outage},
           "reference": ref, "chaos": chaos, "seconds": round(time.monotonic() - t0, 1), "dir": str(base)}
    out["checks"] = checks(out)
    return out


def checks(out: dict[str, Any]) -> dict[str, bool]:
    """The exact checks of a :func:`run` result, by name."""
    ref, ch = out["reference"], out["chaos"]
    c: dict[str, bool] = {}
    for label, ph in (("reference", ref), ("chaos", ch)):
        rows = ph["collectors"].values()
        c[f"{label}: logged = stored + dropped"] = all(x["logged"] == x["stored"] + x["dropped"] for x in rows)
        c[f"{label}: sent = stored"] = all(x["sent"] == x["stored"] for x in rows)
        c[f"{label}: drops reported = counted"] = all(
            x["drops_reported"].get("count", 0) == x["dropped"] for x in rows)
        c[f"{label}: no duplicates, in order"] = all(x["duplicates"] == 0 and x["in_order"] for x in rows)
        c[f"{label}: each anomaly opened once"] = not any(ph["opened_twice"].values())
        c[f"{label}: notifications = implied"] = ph["implied"] == ph["received_ok"] and ph["alerts_settled"]
        c[f"{label}: each key answered 2xx once"] = ph["keys_ok_once"] and ph["outbox_keys_once"]
        c[f"{label}: no secret in logs"] = not ph["logs"]["leaks"]
        c[f"{label}: clean exits"] = all(v == 0 for v in ph["exit_codes"].values())
    c["anomalies identical"] = ref["anomalies"] == ch["anomalies"]
    c["job steps all stored"] = all(x["dropped"] == 0 and x["steps_stored"] == x["steps_logged"]
                                    for k, x in ch["collectors"].items() if k.startswith(JOB))
    c["lossy run dropped some, by the buffer"] = ch["collectors"][f"{LOSSY}/0"]["drops_by_cause"]["buffer"] > 0
    c["ledger counts the drops"] = (ch["lossy_ledger_dropped"] or {}).get("total") == \
        ch["collectors"][f"{LOSSY}/0"]["dropped"]
    kinds = {a[1] for ph in (ref, ch) for anoms in ph["anomalies"].values() for a in anoms}
    c["no dead_rank or hang"] = not kinds & {"dead_rank", "hang"} and not ch["fast"]["anomalies"]
    c["pages only for the NaN"] = all(kind == "nan_inf" for kind, _ in ch["pages"])
    c["fast job: heartbeat kept updating"] = ch["fast"]["heartbeats_seen"] >= 2
    c["fast job: no critical anomaly"] = not ch["fast"]["critical"]
    return c


def _print(out: dict[str, Any]) -> None:
    p, ch, ref = out["plan"], out["chaos"], out["reference"]
    print(f"job: {p['ranks']} ranks x {p['steps']} steps, a step every {p['step_s']} s; serve killed at step "
          f"{p['serve_kill']}, loss spike at {p['spike']}, NaN at {p['nan']}, Redis killed at {p['outage']} for "
          f"{p['outage_s']} s; fast job {p['fast_s']} s")
    print(f"serve SIGKILL -> processing again after {ch['serve_restart_s']:.2f} s")
    print(f"alert worker SIGKILL -> started again after {ch['alerts_restart_s']:.2f} s")
    print(f"Redis outage {ch['outage_s']:.2f} s ({ch['outage_records']} log_step calls during it); processing "
          f"again {ch['redis_resumed_s']:.2f} s after the restart")
    for label, h in (("during the outage", ch["hot_outage"]), ("restart to resumed", ch["hot_drain"]),
                     ("whole run", ch["hot_all"])):
        print(f"  log_step {label:>18}: {h['calls']:6d} calls, p50 {h['p50_ns'] / 1e3:7.1f} us, p99 "
              f"{h['p99_ns'] / 1e3:7.1f} us, max {h['max_ns'] / 1e3:8.1f} us")
    for key, x in ch["collectors"].items():
        print(f"  {key:14}: logged {x['logged']:5d} = stored {x['stored']:5d} + dropped {x['dropped']:3d} "
              f"{x['drops_by_cause']}; sent {x['sent']}; duplicates {x['duplicates']}, in order {x['in_order']}")
    print(f"notifications: reference {ref['received_ok']}; chaos {ch['received_ok']}")
    print(f"  chaos: {ch['requests']} requests, answers {ch['answers']}, {ch['outbox_keys']} keys, "
          f"{ch['resent_keys']} resent (identical {ch['resends_identical']}); pages {ch['pages']}")
    print(f"anomalies: {ch['anomalies'][JOB]}")
    f = ch["fast"]
    print(f"fast job: {f['logged']} records in {f['seconds']} s ({f['records_per_s']}/s), dropped {f['dropped']} "
          f"{f['drops_by_cause']}; log_step p50 {f['calls']['p50'] / 1e3:.1f} us, max {f['calls']['max'] / 1e3:.1f} "
          f"us; heartbeats seen {f['heartbeats_seen']}, oldest {f['heartbeat_max_age_s']} s; anomalies "
          f"{f['anomalies']}")
    print(f"Redis used_memory at the end {ch['used_memory'] / 2**20:.1f} MiB (peak {ch['used_memory_peak'] / 2**20:.1f}"
          f" MiB); reference {ref['used_memory'] / 2**20:.1f} MiB")
    print(f"logs scanned: {ch['logs']['files'] + ref['logs']['files']}, secrets found "
          f"{ch['logs']['leaks'] or ref['logs']['leaks'] or 'none'}; tracebacks {ch['logs']['tracebacks']}")
    for name, ok in out["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    print(f"{out['seconds']} s; files in {out['dir']}")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        return rank_main(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-s", type=float, default=0.07, help="seconds per step")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the job")
    p.add_argument("--outage-s", type=float, default=3.0, help="seconds Redis stays down")
    p.add_argument("--fast-s", type=float, default=4.0, help="seconds of the fast job")
    p.add_argument("--dir", type=Path, help="where the logs go (default: a new temporary directory)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = p.parse_args()
    out = run(args.steps, args.step_s, args.ranks, args.outage_s, args.fast_s, args.dir)
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        _print(out)
    return 0 if all(out["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
