"""``Monitor``: the handle a training loop uses on every rank.

Hot path (``step``, ``section``, ``log_step``): builds a small dict and appends it to a
bounded deque; nothing else. A daemon :class:`~trainhealth.collectors.sender.Sender` batches the
records into Redis. Redis being away, bad values, or a bug here never raise into the
training loop: they are logged once and counted.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

import redis

from trainhealth import config, connection, defaults, tuning
from trainhealth.collectors import ranks
from trainhealth.collectors.cuda_timing import GpuTimer, torch_event_factory
from trainhealth.collectors.gpu_health import GpuHealthSampler
from trainhealth.collectors.memory import MemorySampler
from trainhealth.collectors.sender import Sender
from trainhealth.collectors.spill import Spill
from trainhealth.collectors.spill import default_directory as default_spill_directory
from trainhealth.exceptions import ConfigError
from trainhealth.keys import run_keys
from trainhealth.text import show
from trainhealth.warn_once import WarnOnce
from trainhealth.wire import Heartbeat

#: Section that :meth:`Monitor.step`'s ``data_from`` fills (the first of ``defaults.DATA_SECTIONS``).
DATA_SECTION = defaults.DATA_SECTIONS[0]
#: A ``data_from`` older than this (s) is taken for a wrong clock, not a data-loader wait.
_MAX_DATA_WAIT_S = 3600
#: Largest float: a setting beyond it (``inf``, ``10**400``) is no number of anything.
_FLOAT_MAX = sys.float_info.max

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[Monitor] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) is not a rank: its copy of the monitor goes quiet.
    for mon in list(_LIVE):
        mon._off = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Section:
    """Times one named section; reused for every entry of that name (no allocation per step)."""

    __slots__ = ("_mon", "_name", "_t0")

    def __init__(self, mon: Monitor, name: str) -> None:
        self._mon = mon
        self._name = name
        self._t0 = 0.0

    def __enter__(self) -> _Section:
        self._t0 = perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        dt = perf_counter() - self._t0
        sec = self._mon._sections
        # Repeated entries in one step (gradient accumulation) add up.
        sec[self._name] = sec.get(self._name, 0.0) + dt


class _NullSection:
    """What :meth:`Monitor.section` returns for a name it cannot use: times nothing."""

    __slots__ = ()

    def __enter__(self) -> _NullSection:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


_NULL_SECTION = _NullSection()


class _CudaSection(_Section):
    """A section timed on the CPU and, with CUDA events, on the GPU (resolved later)."""

    __slots__ = ("_start",)

    def __enter__(self) -> _CudaSection:
        self._start = self._mon._gpu.start()  # type: ignore[union-attr]
        self._t0 = perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        _Section.__exit__(self, *exc)
        self._mon._gpu.stop(self._name, self._start)  # type: ignore[union-attr]


class _Step:
    """Times one training step; see :meth:`Monitor.step`."""

    __slots__ = ("_data_from", "_mon", "_t0", "metrics", "step")

    def __init__(self, mon: Monitor, step: int, data_from: float | None = None) -> None:
        self._mon = mon
        self.step = step
        self.metrics: dict[str, Any] | None = None
        self._t0 = 0.0
        self._data_from = data_from

    def __enter__(self) -> _Step:
        mon = self._mon
        if mon._held is not None:
            try:
                mon._emit_held()
            except Exception:  # never into the training loop
                mon._internal_error()
        mon._cur = self
        now = self._t0 = perf_counter()
        since = self._data_from
        if since is not None:
            wait = now - since
            if 0.0 <= wait < _MAX_DATA_WAIT_S:  # the batch's wait is part of the step, as data loading
                self._t0 = since
                sec = mon._sections
                sec[DATA_SECTION] = sec.get(DATA_SECTION, 0.0) + wait
            else:
                mon._warn_once("data_from_range", "step(data_from=%s): not a time.perf_counter() of the last %d s; "
                               "ignored", show(since), _MAX_DATA_WAIT_S)
        return self

    def __exit__(self, *exc: object) -> None:
        dur = perf_counter() - self._t0
        mon = self._mon
        mon._cur = None
        try:
            mon._finish_step(self, dur)
        except Exception:  # never into the training loop
            mon._internal_error()


class _Phase:
    """Marks a blocking non-training phase (checkpoint save/load, evaluation) and times it."""

    __slots__ = ("_kind", "_mon", "_name", "_step", "_t0")

    def __init__(self, mon: Monitor, kind: str, step: int | None, name: str | None = None) -> None:
        self._mon, self._kind, self._step, self._name = mon, kind, step, name
        self._t0 = 0.0

    def __enter__(self) -> _Phase:
        self._mon._phase = self._kind
        self._t0 = perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        seconds = perf_counter() - self._t0
        mon = self._mon
        mon._phase = "train"
        if exc[0] is not None:
            return
        if self._kind == "checkpoint_save":
            mon.checkpoint_saved(self._step, seconds)  # type: ignore[arg-type]
        elif self._kind == "checkpoint_load":
            mon.checkpoint_loaded(self._step, seconds)  # type: ignore[arg-type]
        else:
            mon.badput(self._name or self._kind, seconds, step=self._step)


def _ignore(*_: Any) -> None:
    return None


class _NullSender:
    """The sender of a Monitor made with ``enabled=False``: nothing queued, nothing sent, nothing running."""

    connected = False
    pending = overflowed = dropped_total = 0

    @staticmethod
    def is_alive() -> bool:
        return False


_NULL_SENDER = _NullSender()


class Monitor:
    """Per-rank training-health collector.

    Create one per process at start-up, after the process group is set up, on **every** rank::

        mon = Monitor("llama-8b-pretrain", gpu_hour_usd=2.5)
        for step in range(start, total):
            with mon.step(step):
                with mon.section("data"):
                    batch = next(loader)
                with mon.section("forward"):
                    loss = model(batch).loss
                loss.backward()  # under DDP/FSDP it overlaps the all-reduce: not a section
                with mon.section("optimizer"):
                    gn = clip_grad_norm_(model.parameters(), 1.0); opt.step()
            mon.log_step(step, loss=loss.item(), grad_norm=gn.item(), lr=sched.get_last_lr()[0],
                         tokens=batch_tokens)
            if step % 500 == 0:
                with mon.checkpoint_save(step):
                    save(...)
        mon.close()

    Time the work a rank does **on its own**: the collective makes every rank's whole step
    equally long, so a slow rank shows only in its own sections. Under DDP/FSDP the gradient
    all-reduce overlaps backward, so backward includes waiting for the slowest rank: time
    ``forward``, not ``forward_backward``. Sections should not nest (their sum is the rank's
    busy time).

    Parameters
    ----------
    run : str
        Run id shared by all ranks (letters, digits, ``.``, ``_``, ``-``).
    redis_url : str, optional
        ``redis://``, ``rediss://`` or ``unix://`` URL; default ``$TRAINHEALTH_REDIS_URL``,
        then the embedded server started by ``trainhealth serve``.
    client : redis.Redis, optional
        A client to use instead of a URL (its connection pool must be thread-safe, as redis-py's is).
    rank, world_size : int, optional
        Default from the launcher's environment (see :func:`trainhealth.collectors.ranks.detect`).
    host : str, optional
        Node name; default ``socket.gethostname()``.
    gpu_hour_usd : float, optional
        Price of one GPU-hour, for the ledger's cost figures (rank 0's value is stored).
    run_config : dict, optional
        Hyper-parameters etc., stored with the run start event (JSON-serialisable).
    detector_settings : dict, optional
        This run's own detector parameters, detector -> {parameter: value}, e.g. ``{"memory_growth":
        {"min_span_s": 60, "bucket_s": 5}}``: what may be tuned is :data:`trainhealth.tuning.TUNABLE`. Checked
        here; rank 0's are stored in the run's meta and the detector service builds the run's detectors with them
        (``TRAINHEALTH_DETECTOR_SETTINGS`` with :func:`trainhealth.init`).
    buffer_records : int
        Bound of the in-memory buffer; beyond it the oldest records are dropped and counted.
    heartbeat_interval : float
        Seconds between heartbeats (sent by the background thread).
    retention : int
        Step records kept in the run's step stream (``$TRAINHEALTH_RETENTION``, default 1,000,000), registered in
        the run's meta: the detector service trims the entries it has read to it (or to its own, when smaller).
        The collectors' own ``XADD MAXLEN`` is a backstop for when no service reads: as many entries as records.
    retention_bytes : int
        And at most about this many bytes of records (their JSON text; ``$TRAINHEALTH_RETENTION_BYTES``, default
        512 MiB): the trim keeps the fewer records of the two bounds.
    started_at : float, optional
        Unix time this process started (default now); for replaying old logs.
    spill_dir : path or False, optional
        Where records go when Redis is away and the buffer is half full: default
        ``$TRAINHEALTH_SPILL_DIR`` or ``~/.trainhealth/spill``; ``False`` disables spilling.
        Everything is delivered in order after reconnecting.
    spill_bytes : int
        Bound of the spill on disk (bytes); beyond it the oldest records are dropped and counted.
    sample_indices_max : int
        Most sample indices :meth:`log_step` records for one step (1 to ``defaults.SAMPLE_INDICES_MAX`` = 16,384,
        what the detector service takes); a step's indices beyond it are not recorded, with one warning.
    enabled : bool
        False: the arguments are checked, then nothing starts, nothing is sent and every method returns at once
        (``TRAINHEALTH_MODE=disabled`` with :func:`trainhealth.init`).

    Raises
    ------
    ConfigError
        At construction only, for a bad argument (run id, rank, world size, URL, a number out of
        its range...), naming it and its value. After that no method raises: errors are logged
        (``collectors`` logger) and counted.
    """

    def __init__(
        self,
        run: str,
        *,
        redis_url: str | None = None,
        client: redis.Redis | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        host: str | None = None,
        gpu_hour_usd: float | None = None,
        run_config: dict[str, Any] | None = None,
        detector_settings: Mapping[str, Mapping[str, float]] | None = None,
        buffer_records: int = defaults.COLLECTOR_BUFFER_RECORDS,
        batch_records: int = defaults.COLLECTOR_BATCH_RECORDS,
        flush_interval: float = defaults.COLLECTOR_FLUSH_INTERVAL_S,
        heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL_S,
        retention: int | None = None,
        retention_bytes: int | None = None,
        close_timeout: float = defaults.CLOSE_TIMEOUT_S,
        started_at: float | None = None,
        spill_dir: str | os.PathLike[str] | bool | None = None,
        spill_bytes: int = defaults.COLLECTOR_SPILL_BYTES,
        sample_indices_max: int = defaults.SAMPLE_INDICES_MAX,
        enabled: bool = True,
    ) -> None:
        self.keys = run_keys(run)
        self.run = run
        # Everything is checked here, before anything starts: a bad value found later would only
        # show as a sender that never delivers, blamed on Redis.
        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool):  # an int to isinstance(), but never a rank
                raise ConfigError(f"{name}={value!r} must be an integer, not a bool")
        self.rank, self.world_size, self.local_rank = ranks.detect(rank, world_size)
        if host is not None and not isinstance(host, str):
            raise ConfigError(f"host={show(host)} must be a string (the node name)")
        self.host = host or ranks.hostname()
        if client is not None and not callable(getattr(client, "pipeline", None)):
            raise ConfigError(f"client={show(client)} is not a redis-py client")
        for name, value, low in (("buffer_records", buffer_records, 1), ("batch_records", batch_records, 1),
                                 ("spill_bytes", spill_bytes, 1), ("retention", retention, 1),
                                 ("sample_indices_max", sample_indices_max, 1),
                                 ("retention_bytes", retention_bytes, 1)):
            if value is None and name in ("retention", "retention_bytes"):
                continue
            if type(value) is not int or not low <= value <= sys.maxsize:  # not bool; within a C size
                raise ConfigError(f"{name}={show(value)} must be an integer >= {low}"
                                  + (" (bytes)" if name.endswith("_bytes") else ""))
        if sample_indices_max > defaults.SAMPLE_INDICES_MAX:
            raise ConfigError(f"sample_indices_max={sample_indices_max} must be at most {defaults.SAMPLE_INDICES_MAX} "
                              "(the detector service refuses a step record with more)")
        self._indices_max = sample_indices_max
        for name, value in (("flush_interval", flush_interval), ("heartbeat_interval", heartbeat_interval),
                            ("close_timeout", close_timeout)):
            # Finite and within what threading's waits take: inf or 1e300 would kill the sender thread.
            if not _is_number(value) or not 0 < value <= threading.TIMEOUT_MAX:
                raise ConfigError(f"{name}={show(value)} must be a finite number of seconds > 0")
        if gpu_hour_usd is not None and (not _is_number(gpu_hour_usd) or not 0 <= gpu_hour_usd <= _FLOAT_MAX):
            raise ConfigError(f"gpu_hour_usd={show(gpu_hour_usd)} must be a number >= 0 (finite; USD per GPU-hour)")
        if started_at is not None and (not _is_number(started_at) or not 0 <= started_at <= _FLOAT_MAX):
            raise ConfigError(f"started_at={show(started_at)} must be a finite unix time in seconds >= 0")
        if not (spill_dir is None or isinstance(spill_dir, (bool, str, os.PathLike))):
            raise ConfigError(f"spill_dir={show(spill_dir)} must be a path, True or False")
        if run_config is not None:
            try:
                config_json = json.dumps(run_config, default=str)
            except Exception as exc:  # TypeError/ValueError, or whatever a value's __str__ raises
                raise ConfigError(f"run_config is not JSON-serialisable: {exc}") from None
        else:
            config_json = None
        tuned = tuning.validate(detector_settings) if detector_settings is not None else {}
        if client is None and enabled:
            url = config.redis_url(redis_url)
            if url is None:
                log.warning(
                    "trainhealth collector: no Redis configured (TRAINHEALTH_REDIS_URL unset and no "
                    "embedded server running); buffering up to %d records", buffer_records,
                )
        self.close_timeout = close_timeout
        # Incarnation: a new value per process start tells the service of restarts.
        self.inc = time.time() if started_at is None else float(started_at)
        self._sections: dict[str, float] = {}
        self._section_cache: dict[tuple[str, bool], _Section] = {}
        self._gpu: GpuTimer | None = None
        self._cur: _Step | None = None
        self._held: dict[str, Any] | None = None
        self._last_step: int | None = None
        self._last_step_t: float | None = None
        self._phase = "train"
        self._memory = MemorySampler(self.local_rank)
        self._gpu_health = GpuHealthSampler(self.local_rank)
        self._off = False
        self._closed = False
        self._exit_said = False  # rank_exit sent (at most once)
        self._errors = 0
        self._lock = threading.Lock()
        if not enabled:  # switched off (TRAINHEALTH_MODE=disabled): every call returns at once, nothing starts
            self._off = True
            self._sender = _NULL_SENDER  # type: ignore[assignment]
            self._put = self._put_rec = _ignore  # type: ignore[assignment]
            return

        def connect() -> redis.Redis:
            if client is not None:
                return client
            url = config.redis_url(redis_url)
            if url is None:
                raise redis.ConnectionError("no Redis URL configured")
            return connection.connect(url, socket_timeout=5, socket_connect_timeout=2)

        retention = retention or config.retention_records()
        retention_bytes = retention_bytes or config.retention_bytes()
        # The bound is the run's: the service trims the raw stream to it once it has read the entries (the
        # collectors' own trim is only a backstop, see collectors/sender.py).
        registry: dict[str, Any] = {"_rank": self.rank, "_inc": repr(self.inc), "status": "running",
                                    "world_size": self.world_size, "updated_at": repr(self.inc),
                                    "retention_records": retention, "retention_bytes": retention_bytes}
        if tuned:
            # Every rank's (a job gives them all the same): the rank that registers the run first carries them, so
            # the service builds the run's detectors with them from the start. A dict: stored as its JSON text.
            registry[tuning.META_FIELD] = tuned
        if self.rank == 0:
            registry.update(name=run, started_at=self.inc)
            if gpu_hour_usd is not None:
                registry["gpu_hour_usd"] = repr(float(gpu_hour_usd))
        spill = None
        if spill_dir is not False:
            directory = Path(spill_dir) if spill_dir not in (None, True) else default_spill_directory()
            try:
                spill = Spill(directory, f"{run}-r{self.rank}-p{os.getpid()}", spill_bytes)
            except OSError as exc:
                log.warning("trainhealth collector: no spill directory %s (%s); records beyond the "
                            "buffer will be dropped while Redis is away", directory, exc)
        self._sender = Sender(
            connect, self.keys, buffer_records, self._heartbeat_body, registry,
            batch=batch_records, flush_interval=flush_interval, heartbeat_interval=heartbeat_interval,
            retention=retention, retention_bytes=retention_bytes, spill=spill,
        )
        self._put = self._sender.put  # events
        self._put_rec = self._sender.put_step  # the hot path's one call: bound once, no lookup per record
        self._event("run_start", host=self.host, pid=os.getpid(), world_size=self.world_size,
                    local_rank=self.local_rank, config=config_json, t=self.inc)
        self._sender.start()
        _LIVE.add(self)
        atexit.register(self._atexit)
        _install_sigterm_word()

    # -- hot path ------------------------------------------------------------------------------
    def _put_step(self, rec: dict[str, Any]) -> None:
        gpu = self._gpu
        if gpu is None:
            self._put_rec(rec)
            return
        # Records wait, in order, until the CUDA events of their sections have completed.
        for ready in gpu.submit(rec, rec.pop("_gpu", None) or []):
            self._put_rec(ready)

    def step(self, step: int, data_from: float | None = None) -> _Step:
        """Context manager timing one training step on this rank.

        Metrics given to :meth:`log_step` for the same step, inside the block or right after
        it, go into the same record. Sections timed since the previous step belong to it.

        ``data_from``: a :func:`time.perf_counter` value (seconds) when the step started waiting
        for its batch, for loops that fetch the batch before the block is entered (framework
        callbacks: the Trainer fetches, then calls the hook that opens the step). The step then
        starts there, and the wait until the block is entered is added to its ``data`` section,
        which the goodput ledger counts as data loading instead of idle time between steps. A
        value that is not a perf_counter() of the last hour is ignored with one warning. Do not
        also time the same wait with ``section("data")``: both would count.
        """
        if data_from is not None and type(data_from) is not float:
            try:
                data_from = float(data_from)
            except Exception:  # TypeError/ValueError, OverflowError (a huge int), a foreign __float__'s error
                self._warn_once("data_from", "step(data_from=%s): not a time.perf_counter() value; ignored",
                                show(data_from))
                data_from = None
        return _Step(self, step, data_from)

    def add_section(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to section ``name`` of the current step, timed elsewhere.

        For time measured between two framework hooks (e.g. the data fetch between two
        micro-batches of a step). Seconds add up with :meth:`section`'s. Never raises: a value
        that is not a finite number of seconds >= 0 is dropped with one warning.
        """
        try:
            try:
                v = float(seconds)
            except Exception:  # TypeError/ValueError, OverflowError (a huge int), a foreign __float__'s error
                v = math.nan
            key = str(name)
            if not 0.0 <= v < math.inf:
                self._warn_once(f"add_section:{key}", "add_section(%s, %s): not a duration >= 0 s; dropped",
                                show(name), show(seconds))
                return
            sec = self._sections
            sec[key] = sec.get(key, 0.0) + v
        except Exception:  # a name without a str(): never into the training loop
            self._internal_error()

    def section(self, name: str, cuda: bool = False) -> _Section:
        """Context manager timing a named part of the step (``data``, ``forward_backward``, ...).

        Seconds add up if the same name is entered several times in one step. Names in
        :data:`trainhealth.defaults.DATA_SECTIONS` count as data-loading wait in the ledger.
        With ``cuda=True`` and a CUDA device, the section is also timed on the GPU with CUDA
        events, resolved asynchronously (no ``synchronize()`` in the loop; see
        :mod:`trainhealth.collectors.cuda_timing`) and sent as ``gpu.<name>`` seconds; without CUDA it is
        CPU-timed only, with one warning.
        """
        key = (name, cuda)
        try:
            s = self._section_cache.get(key)
            if s is None:
                if cuda and self._gpu is None:
                    self._enable_gpu()
                cls = _CudaSection if cuda and self._gpu is not None else _Section
                s = self._section_cache[key] = cls(self, str(name))
        except Exception:  # unhashable name or flag (a list), a name without a str()
            self._warn_once("section", "section(%s, cuda=%s): not a section name; not timed", show(name), show(cuda))
            return _NULL_SECTION  # type: ignore[return-value]
        return s

    def _enable_gpu(self, factory: Any = None) -> None:
        try:
            self._gpu = GpuTimer(factory or torch_event_factory())
        except Exception as exc:  # no CUDA (RuntimeError), or a broken torch install
            self._warn_once("cuda", "section(cuda=True): %s; timing on the CPU only", exc)

    def log_step(
        self,
        step: int,
        loss: float | None = None,
        grad_norm: float | None = None,
        lr: float | None = None,
        tokens: int | None = None,
        samples: int | None = None,
        consumed_samples: int | None = None,
        batch_index: int | None = None,
        skipped: bool | None = None,
        timestamp: float | None = None,
        step_s: float | None = None,
        loss_missing: bool | None = None,
        loss_scale: float | None = None,
        sample_indices: Sequence[int] | None = None,
        **unknown: Any,
    ) -> None:
        """Record a step's metrics: loss, global grad norm, learning rate, tokens and samples on this rank.

        ``consumed_samples`` (global samples consumed so far, as Megatron counts them) and/or
        ``batch_index`` (the data loader's batch index) give the **data position** after this
        step, so a rollback recommendation can name the exact batches to skip. ``skipped=True``
        marks an optimizer step skipped by the loss scaler (fp16 overflow); ``loss_scale`` is the scaler's scale
        after the step (``GradScaler.get_scale()``, DeepSpeed's), which halves at each overflow.

        ``sample_indices`` are the indices of the samples (documents, instances) **this rank** consumed in the step,
        in order: what OLMo's data loader knows, or a sampler's indices for the step's batches (a ``range``, a list,
        a numpy array; a tensor is read with ``tolist()``, so pass a CPU one). With them, an incident says which
        samples its onset step trained on, and a rollback's export lists the exact samples to skip. At most
        ``sample_indices_max`` (default and most 16,384) per rank per step: beyond it the step's indices are not
        recorded, with one warning. The training thread only checks the length and copies them (a ``range`` is kept
        as it is); the sender thread encodes them, each run of equally spaced indices as one range.

        ``timestamp`` (unix s) overrides when the step ended, for replaying logs; default now.
        ``step_s`` is the step's duration in seconds as the job itself measured it (a framework's
        iteration timer, a log's time per iteration), for steps not timed with :meth:`step`: the
        timing detectors (``throughput_drop``, ``slow_step``) use it when there is no ``step()``
        time; untimed steps are never judged on the gaps between them.
        Values are recorded as given (NaN/Inf included in the float fields). An unknown keyword is
        ignored with one warning; a value that is not a number, an integer field's value that is
        not a finite integer within ±2**63, or a float field's value too large for a float is not
        recorded, with one warning per field; a record without a valid ``step`` is dropped and
        counted in :attr:`dropped_total`. A ``timestamp`` that is not a finite unix time is
        replaced by now, with one warning. Never raises.
        """
        if self._off:
            return
        try:
            if unknown:
                self._warn_once(f"unknown:{sorted(unknown)}",
                                "log_step() got unknown keyword(s) %s; ignored", sorted(unknown))
            metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens, "samples": samples,
                       "consumed_samples": consumed_samples, "batch_index": batch_index, "skipped": skipped,
                       "step_s": step_s}
            if loss_scale is not None:
                metrics["loss_scale"] = loss_scale  # only mixed-precision jobs have one
            if loss_missing:
                metrics["loss_missing"] = 1  # only replayed logs set it: live records keep their fields
            if sample_indices is not None:
                indices = self._indices(step, sample_indices)
                if indices is not None:
                    metrics["sample_indices"] = indices
            cur = self._cur
            if cur is not None and cur.step == step:
                cur.metrics = metrics
                return
            held = self._held
            if held is not None and held["step"] == step:
                held.update(metrics)
                self._held = None
                self._put_step(held)
                return
            if held is not None:
                self._emit_held()
            t = time.time() if timestamp is None else self._timestamp(timestamp, "log_step")
            rec = {"rank": self.rank, "step": step, "inc": self.inc, "t": t, **metrics}
            if self._sections:
                self._attach_sections(rec)
            self._put_step(rec)
            self._progress(step, t)
        except Exception:
            self._internal_error()

    def _indices(self, step: int, values: Any) -> Any:
        """A snapshot of ``log_step``'s ``sample_indices`` for the sender to encode (it checks the values), or None
        (with one warning) when there are too many or they are no sequence. O(1) for a ``range``, a C-speed copy
        otherwise: a caller reusing its list must not change what was logged."""
        try:
            n = len(values)
        except Exception:
            self._warn_once("sample_indices", "log_step(sample_indices=%s): not a sequence of indices; not recorded",
                            show(values))
            return None
        if n > self._indices_max:
            self._warn_once("sample_indices_max", "log_step(step=%s, sample_indices=...): %d indices, more than the "
                            "%d a rank logs per step (sample_indices_max); not recorded for this step and further "
                            "ones this large", show(step), n, self._indices_max)
            return None
        if type(values) is range:
            return values
        return values.tolist() if hasattr(values, "tolist") else tuple(values)

    def _progress(self, step: int, t: float) -> None:
        last = self._last_step
        try:
            back = last is not None and step < last
        except Exception:  # not a step number: its record is dropped by the sender, with a warning
            return
        if back:
            # The same process went back (rolled back to a checkpoint): say so explicitly.
            self._event("resume", step=step, from_step=last)
        self._last_step, self._last_step_t = step, t

    def _finish_step(self, st: _Step, dur: float) -> None:
        t = time.time()
        rec: dict[str, Any] = {"rank": self.rank, "step": st.step, "inc": self.inc, "t": t, "dur": dur}
        if self._sections:
            self._attach_sections(rec)
        if self._off:
            return
        self._progress(st.step, t)
        if self._gpu is not None:
            rec["_gpu"] = self._gpu.take_pending()  # this step's event pairs
        if st.metrics is not None:
            rec.update(st.metrics)
            self._put_step(rec)
        else:
            self._held = rec  # wait for log_step() of this step, sent at the next step otherwise

    def _timestamp(self, value: Any, where: str) -> float:
        """``value`` as a unix time (s), or now (with one warning) when it is not a finite number."""
        try:
            t = float(value)
        except Exception:
            t = math.nan
        if math.isfinite(t):
            return t
        self._warn_once(f"timestamp:{where}", "%s(timestamp=%s): not a finite unix time; now used instead",
                        where, show(value))
        return time.time()

    def _drain_gpu(self) -> None:
        if self._gpu is not None:
            try:
                for rec in self._gpu.drain():
                    self._put_rec(rec)
            except Exception:
                self._internal_error()

    def _attach_sections(self, rec: dict[str, Any]) -> None:
        sec, self._sections = self._sections, {}
        for name, secs in sec.items():
            rec["sec." + name] = secs

    def _emit_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._put_step(held)

    # -- events ------------------------------------------------------------------------------------
    def _event(self, kind: str, step: int | None = None, seconds: float | None = None, **extra: Any) -> None:
        if self._off:
            return
        try:
            fields = {"kind": kind, "rank": self.rank, "t": time.time(), "inc": self.inc,
                      "step": step, "seconds": seconds}
            fields.update(extra)
            if fields["t"] is None:
                fields["t"] = time.time()
            self._put("events", fields)
        except Exception:
            self._internal_error()

    def checkpoint_saved(self, step: int, seconds: float) -> None:
        """Record a checkpoint of ``step`` saved, which blocked training for ``seconds``.

        Report it from the ranks that blocked (usually all). Save outside ``step()`` blocks,
        so the ledger counts the time once, as checkpoint badput.
        """
        if _negative_or_nan(seconds):
            self._warn_once("ckpt_seconds", "checkpoint_saved(): seconds=%s is not a duration >= 0; "
                            "recorded as given", show(seconds))
        self._event("checkpoint_save", step=step, seconds=seconds)

    #: Events :meth:`log_event` sends: what a log reader or launcher wrapper reports for the job.
    LOGGED_EVENTS = ("collective_timeout", "worker_restart")

    def log_event(self, kind: str, step: int | None = None, seconds: float | None = None, rank: int | None = None,
                  **fields: Any) -> None:
        """Record an event a log reports (``trainhealth follow``, a launcher wrapper): a ``collective_timeout``
        (a rank's NCCL watchdog: ``op``, ``seq``, ``timeout_s``, ``last_enqueued``, ``last_completed``, ``pg``;
        ``seconds`` waited) or a ``worker_restart`` (torchelastic: ``restart_count``, ``failed_rank``, …).

        ``rank`` is the rank the log names (default this Monitor's); ``fields`` go as they are (numbers as text on
        the wire, see docs/architecture.md, the events stream). Another ``kind`` is not sent, with one warning.
        Never raises.
        """
        if kind not in self.LOGGED_EVENTS:
            self._warn_once(f"log_event:{show(kind)}", "log_event(%s): not one of %s; not sent", show(kind),
                            ", ".join(self.LOGGED_EVENTS))
            return
        if rank is not None:
            fields["rank"] = rank
        self._event(kind, step=step, seconds=seconds, **fields)

    def log_eval(self, step: int, loss: float, name: str = "eval", timestamp: float | None = None) -> None:
        """Record an evaluation's loss on a held-out set after ``step`` (an ``eval`` event).

        ``name`` names the eval set, as the job's logger does: ``eval`` (HF Trainer's ``eval_loss``, W&B's
        ``eval/loss``), ``eval_<set>`` for each of several sets (HF's ``eval_<set>_loss``), ``val``. Call it from one
        rank (the loss is the job's, as rank 0 logs it). The detector service compares each set's eval losses with
        the training loss: an eval loss rising while the training loss falls is over-fitting (docs/anomalies.md).
        The time the evaluation took is :meth:`timed_badput` / :meth:`badput`'s, not this.

        ``loss`` is sent as a float (a tensor or numpy scalar is converted; NaN/Inf as given). A ``loss`` that is not
        a number, a ``name`` that is not a non-empty string of at most 64 characters, or a ``step`` that is not an
        integer is not sent, with one warning each. Never raises.
        """
        if self._off:
            return
        try:
            try:
                value = float(loss)
            except Exception:
                self._warn_once("log_eval:loss", "log_eval(loss=%s): not a number; not sent", show(loss))
                return
            if not isinstance(name, str) or not 0 < len(name) <= 64:
                self._warn_once("log_eval:name", "log_eval(name=%s): not a string of 1-64 characters; not sent",
                                show(name))
                return
            if isinstance(step, bool) or not isinstance(step, int):
                try:
                    step = step.__index__()
                except Exception:
                    self._warn_once("log_eval:step", "log_eval(step=%s): not an integer; not sent", show(step))
                    return
            t = None if timestamp is None else self._timestamp(timestamp, "log_eval")
            self._event("eval", step=step, name=name, loss=value, t=t)
        except Exception:
            self._internal_error()

    def checkpoint_loaded(self, step: int, seconds: float | None = None) -> None:
        """Record that training resumed from the checkpoint of ``step`` (restore took ``seconds``)."""
        self._event("checkpoint_load", step=step, seconds=seconds)

    def checkpoint_save(self, step: int) -> _Phase:
        """Context manager: time a checkpoint save and record it with :meth:`checkpoint_saved`.

        While inside, heartbeats carry ``phase=checkpoint_save`` so the hang detector waits longer.
        """
        return _Phase(self, "checkpoint_save", step)

    def checkpoint_load(self, step: int) -> _Phase:
        """Context manager: time a checkpoint restore and record it with :meth:`checkpoint_loaded`."""
        return _Phase(self, "checkpoint_load", step)

    def badput(self, name: str, seconds: float, step: int | None = None, timestamp: float | None = None) -> None:
        """Record a custom unproductive interval (``evaluation``, ``profiling``...) of ``seconds``.

        ``timestamp`` (unix s) overrides when it ended, for replaying logs; default now.
        """
        if timestamp is not None:
            timestamp = self._timestamp(timestamp, "badput")
        self._event("badput", step=step, seconds=seconds, name=name, t=timestamp)

    def timed_badput(self, name: str, step: int | None = None) -> _Phase:
        """Context manager timing a custom unproductive interval; see :meth:`badput`."""
        return _Phase(self, "badput", step, name)

    # -- heartbeat, flush, close ---------------------------------------------------------------
    def _heartbeat_body(self) -> tuple[int, str]:
        # Built in the sender thread: the memory sample (a /proc read and the CUDA allocator's counters) never
        # costs the training thread anything.
        try:
            mem = self._memory.sample()
        except Exception:
            mem = None
        try:
            gpu = self._gpu_health.sample()
        except Exception:
            gpu = None
        body: Heartbeat = {
            "t": time.time(), "step": self._last_step, "step_t": self._last_step_t, "phase": self._phase,
            "host": self.host, "pid": os.getpid(), "inc": self.inc, "mem": mem, "gpu": gpu,
        }
        return self.rank, json.dumps(body, default=_json_number)  # a step given as a numpy or tensor integer

    def goodput_metrics(self, prefix: str = "trainhealth/") -> dict[str, float]:
        """The run's goodput as the detector service last booked it, as flat metrics to log where the team reads its
        curves (``wandb.log``, a Lightning logger, TensorBoard): ``{prefix}goodput_pct`` (% of the wall time
        productive), ``{prefix}goodput_tokens_pct`` (% of the tokens kept, when counted), ``{prefix}throughput_tok_s``
        and ``{prefix}goodput_tok_s`` (tokens/s), ``{prefix}badput_s/<cause>`` (seconds, each cause that cost time)
        and ``{prefix}badput_usd`` (when priced), ``{prefix}incidents_active`` and ``{prefix}incidents_critical``
        (counts; :meth:`incidents` gives their titles).

        No I/O here: the sender thread reads ``th:{run}:ledger:latest`` with each heartbeat once this was called,
        so the first call returns ``{}`` and later ones the snapshot of at most one heartbeat ago (also ``{}``
        before the service wrote one). Never raises.
        """
        try:
            self._sender.want_ledger = True
            snap = getattr(self._sender, "ledger", None)
            if not isinstance(snap, dict):
                return {}
            out: dict[str, float] = {}
            for key, name in (("goodput_pct", "goodput_pct"), ("throughput_tok_s", "throughput_tok_s"),
                              ("goodput_tok_s", "goodput_tok_s"), ("badput_cost_usd", "badput_usd")):
                v = snap.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    out[prefix + name] = float(v)
            total, good = snap.get("tokens_total"), snap.get("tokens_good")
            if isinstance(total, (int, float)) and total > 0 and isinstance(good, (int, float)):
                out[prefix + "goodput_tokens_pct"] = 100.0 * good / total
            seconds = snap.get("seconds")
            if isinstance(seconds, dict):
                for cause, v in seconds.items():
                    if cause not in ("productive", "unobserved") and isinstance(v, (int, float)) and v > 0:
                        out[f"{prefix}badput_s/{cause}"] = float(v)
            incidents = getattr(self._sender, "incidents", [])
            out[prefix + "incidents_active"] = float(len(incidents))
            out[prefix + "incidents_critical"] = float(sum(d.get("severity") == "critical" for d in incidents))
            return out
        except Exception:  # never into the training loop
            self._internal_error()
            return {}

    def incidents(self) -> list[dict[str, Any]]:
        """The run's active incidents as the detector service last wrote them (``th:{run}:incidents``: ``title``,
        ``severity``, ``onset_step``, ``ranks``, ``hosts``, ``badput_s``…), critical first; read with the goodput
        (:meth:`goodput_metrics` must have been called once). Never raises."""
        try:
            self._sender.want_ledger = True
            return list(getattr(self._sender, "incidents", []))
        except Exception:
            return []

    @property
    def connected(self) -> bool:
        """Whether the last attempt to reach Redis succeeded."""
        return self._sender.connected

    @property
    def buffered(self) -> int:
        """Records waiting to be sent (in the buffer, the batch being retried, or the spill)."""
        return self._sender.pending

    @property
    def dropped(self) -> int:
        """Records the in-memory buffer dropped because it was full (part of :attr:`dropped_total`)."""
        return self._sender.overflowed

    @property
    def dropped_total(self) -> int:
        """Records lost so far: buffer overflow, spill bound exceeded or spill write failures."""
        return self._sender.dropped_total

    def flush(self, timeout: float | None = None) -> bool:
        """Send what is buffered; wait at most ``timeout`` seconds (default ``close_timeout``; a value
        that is not a number of seconds is replaced by the default, with one warning). True when all
        was sent. Never raises."""
        wait = self.close_timeout
        if timeout is not None:
            try:
                wait = float(timeout)
            except Exception:
                wait = math.nan
            if wait != wait:  # NaN, or not a number: a wait of NaN seconds would never end
                self._warn_once("flush_timeout", "flush(timeout=%s): not a number of seconds; %s s used",
                                show(timeout), self.close_timeout)
                wait = self.close_timeout
        try:
            if self._held is not None:
                self._emit_held()
            self._drain_gpu()
            if self._off or not self._sender.is_alive():
                return False
            return self._sender.flush(wait)
        except Exception:  # never into the training loop
            self._internal_error()
            return False

    def close(self, status: str = "finished") -> bool:
        """Record the clean end of this rank, flush (within ``close_timeout``) and stop.

        ``status`` ("finished", "failed", "stopped") is stored on the run by rank 0.
        Returns True when everything was delivered. Safe to call twice.
        """
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        if self._off:
            return False
        if not isinstance(status, str):
            self._warn_once("status", "close(status=%s): not a string; stored as its str()", show(status))
            try:
                status = str(status)
            except Exception:
                status = "finished"
        if self._held is not None:
            try:
                self._emit_held()
            except Exception:  # never into the training loop
                self._internal_error()
        self._drain_gpu()
        self._event("run_end", status=status)
        if self.rank == 0:
            self._sender._registry["status"] = status
        ok = self._sender.stop(self.close_timeout)
        if ok and self.rank == 0:
            try:
                c = self._sender._connect()
                c.hset(self.keys.meta, mapping={"status": status, "ended_at": repr(time.time())})
            except Exception as exc:
                log.warning("trainhealth collector: could not store run status: %s", exc)
        if not ok:
            n = self._sender.pending  # the buffer, the batch in flight and the spill
            spill = self._sender._spill
            log.warning("trainhealth collector: %d record%s not delivered at close%s", n, "" if n == 1 else "s",
                        f" ({len(spill)} kept in the spill at {spill.directory})" if spill is not None and len(spill)
                        else "")
        _LIVE.discard(self)
        return ok

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close("finished" if exc_type is None else "failed")

    def _atexit(self) -> None:
        """At interpreter exit without :meth:`close`: send a ``rank_exit`` event, then flush.

        The event is the rank's last word: it tells the detector service that this process saw its
        own end (an unhandled exception, such as the ``DistBackendError`` the survivors raise when a
        peer was killed, ``sys.exit()``, or the script's end) rather than going silent (SIGKILL, OOM
        kill, segfault, node loss). Fields besides the common ones:

        - ``reason``: ``"exception"`` when an unhandled exception ends the interpreter
          (``sys.last_exc`` / ``sys.last_value``, set by CPython when it prints the traceback),
          ``"exit"`` otherwise.
        - ``error``: for an exception, ``"TypeName: message"`` on one line (the type with its
          module unless builtins or ``__main__``, as a traceback shows it), at most 500
          characters, each URL's ``user:password@`` replaced by ``***@``.
        - ``exit_code``: only when a ``SystemExit`` with an int code is found there, which CPython
          itself never stores: ``sys.exit(n)`` reads as ``reason="exit"`` without ``exit_code``, as
          the code cannot be known without replacing ``sys.exit``/``sys.excepthook``, which a
          collector must not do.
        - ``step``: the last step the rank recorded, when there was one (a ``step()`` block that
          raised counts: its time was spent); ``phase``: the phase the rank was in (``train``,
          ``checkpoint_save``...; an exception raised inside a ``checkpoint_save()`` block has
          left it by then, so it reads ``train``).

        Nothing when :meth:`close` already ran or the monitor is off (a forked child); at most one
        per Monitor; bounded by ``close_timeout`` (the flush). No run_end: the exit may be a crash,
        so an unclosed run shows up as stopped, not finished. ``sys.last_value`` is also left set by
        an exception an interactive session printed and survived: a REPL that exits normally after
        one reads as ``"exception"``. Never raises.
        """
        if self._closed or self._off:
            return
        # Set when CPython prints an unhandled exception's traceback: 3.12+ sys.last_exc, 3.11 last_value.
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        self._last_word(**_exit_fields(exc))
        self.flush(self.close_timeout)  # never raises

    def _last_word(self, **fields: Any) -> None:
        """Send this rank's ``rank_exit`` event with ``fields`` (at most one per Monitor; never after close())."""
        if self._closed or self._off:
            return
        try:
            # Bounded: the lock only guards flags; a thread stuck holding it must not hold the exit.
            if self._lock.acquire(timeout=1.0):
                try:
                    say = not self._closed and not self._exit_said
                    self._exit_said = True
                finally:
                    self._lock.release()
                if say:
                    if self._held is not None:
                        self._emit_held()  # the last step's record goes before the event, as at close()
                    self._drain_gpu()
                    self._event("rank_exit", step=self._last_step, phase=self._phase, **fields)
        except Exception:  # never into the interpreter's exit or the signal's
            self._internal_error()

    # -- errors ----------------------------------------------------------------------------------------
    @property
    def _warn_once(self) -> WarnOnce:
        # Made on first use: the constructor's own validation warns before the other attributes exist.
        warn = self.__dict__.get("_warn")
        if warn is None:
            warn = self.__dict__["_warn"] = WarnOnce(log, "trainhealth collector: ")
        return warn

    def _internal_error(self) -> None:
        self._errors += 1
        if self._errors == 1:
            log.exception("trainhealth collector: internal error (training continues; further ones counted)")


#: Seconds a SIGTERM waits for the last word to reach Redis before the process dies of the signal.
_SIGTERM_FLUSH_S = 1.0
_sigterm_installed = False


def _install_sigterm_word() -> None:
    """Let a SIGTERM leave a last word: a ``rank_exit`` event (``reason="signal"``, ``signal="SIGTERM"``), flushed
    within ``_SIGTERM_FLUSH_S``, after which the process dies of the signal as before (default action restored and
    the signal raised again).

    A launcher tearing a group down (torchrun after another rank failed, Slurm or Kubernetes preempting) sends
    SIGTERM: with it the detector service tells the ranks it stopped from the one that died first. Installed only
    from the main thread and only while SIGTERM has its default action, so a framework's own handler (Lightning's,
    a job's checkpoint-on-preemption) is never replaced; a handler installed after ours replaces it. Python runs the
    handler between bytecodes of the main thread: a rank blocked inside a C call (a NCCL wait) dies silently as
    before, when the launcher's SIGKILL follows.
    """
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
        _sigterm_installed = True
    except (ValueError, OSError, AttributeError):  # no signals here (an embedded interpreter)
        pass


def _on_sigterm(signum: int, frame: object) -> None:
    # The handler runs between two bytecodes of the main thread, which may be inside the sender's flush() holding
    # an Event's lock (a SIGTERM during close() or the exit's flush): nothing here may take a lock without a timeout
    # — wait_sent() takes none — or the process would wait on itself for ever instead of dying.
    for mon in list(_LIVE):  # a forked child's monitors are off: it just dies of the signal
        try:
            mon._last_word(reason="signal", signal="SIGTERM")
            if not mon._off:
                mon._sender.wait_sent(_SIGTERM_FLUSH_S)
        except Exception:
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _exit_fields(exc: object) -> dict[str, Any]:
    r"""``reason`` and ``error`` or ``exit_code`` of a ``rank_exit`` event, from the exception the
    interpreter is exiting on (``None`` for none; see :meth:`Monitor._atexit`).

    >>> _exit_fields(ValueError("bad\n  value")), _exit_fields(None)
    ({'reason': 'exception', 'error': 'ValueError: bad value'}, {'reason': 'exit'})
    >>> _exit_fields(SystemExit(3)), _exit_fields(SystemExit("usage"))
    ({'reason': 'exit', 'exit_code': 3}, {'reason': 'exit'})
    """
    if isinstance(exc, SystemExit):  # not stored by CPython, but a clean exit whoever stored it
        code = exc.code
        return {"reason": "exit", "exit_code": code} if type(code) is int else {"reason": "exit"}
    if isinstance(exc, BaseException):
        return {"reason": "exception", "error": _error_text(exc)}
    return {"reason": "exit"}


#: Longest ``error`` of a ``rank_exit`` event (characters).
_ERROR_CHARS = 500
#: Characters of an exception's message read at most: a huge message must not make the exit slow.
_ERROR_SCAN_CHARS = 100_000


def _error_text(exc: BaseException) -> str:
    r"""``exc`` as ``"module.TypeName: message"`` on one line, credentials of URLs hidden, at most
    :data:`_ERROR_CHARS` characters. The module is left out for builtins and ``__main__``, as in a traceback.

    >>> _error_text(RuntimeError("boom with redis://user:secret@host:6379/0\nsecond line"))
    'RuntimeError: boom with redis://***@host:6379/0 second line'
    >>> _error_text(KeyboardInterrupt())
    'KeyboardInterrupt'
    """
    cls = type(exc)
    name = getattr(cls, "__qualname__", None) or getattr(cls, "__name__", "?")
    module = getattr(cls, "__module__", None)
    if isinstance(module, str) and module not in ("builtins", "__main__"):
        name = f"{module}.{name}"
    try:
        msg = str(exc)
    except Exception:  # a broken __str__
        msg = "<exception str() failed>"
    cut = len(msg) > _ERROR_SCAN_CHARS
    words = msg[:_ERROR_SCAN_CHARS].split()
    if cut and words:
        words.pop()  # maybe a URL cut before its "@": never shown half-redacted
    # Redacted word by word, before the truncation: a cut must not leave a password un-hidden.
    text = " ".join(map(_hide_userinfo, words))
    return (f"{name}: {text}" if text else name)[:_ERROR_CHARS]


def _hide_userinfo(word: str) -> str:
    """``word`` with the ``user:password@`` of each URL in it replaced by ``***@``.

    Everything from ``://`` to the last ``@`` before the next URL goes, the user name too (it can be
    a token) and a path holding an ``@``: hiding too much beats showing a password with an unescaped
    ``/`` or ``@`` in it. Linear in the word's length.

    >>> _hide_userinfo("(redis://u:p@ss@h:1/0,rediss://:pw@h2)"), _hide_userinfo("http://h/a")
    ('(redis://***@h:1/0,rediss://***@h2)', 'http://h/a')
    """
    if "@" not in word or "://" not in word:
        return word
    parts = word.split("://")
    for i in range(1, len(parts)):
        at = parts[i].rfind("@")
        if at >= 0:
            parts[i] = "***" + parts[i][at:]
    return "://".join(parts)


def _negative_or_nan(x: Any) -> bool:
    try:
        return not float(x) >= 0
    except Exception:  # not a number (or a huge int): the sender leaves it out, with its own warning
        return False


def _is_number(x: Any) -> bool:
    """A real number as a setting: int or float (numpy's included), not bool; NaN/Inf are left to the caller."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _json_number(x: Any) -> int | float | None:
    """``json.dumps`` default for the heartbeat: numpy/tensor scalars as numbers, anything else null."""
    try:
        return x.__index__()
    except Exception:
        pass
    try:
        return float(x)
    except Exception:
        return None
