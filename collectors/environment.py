"""``trainhealth.init()``: a collector configured from the launcher's and the cluster's environment.

One line in the training script — ``mon = trainhealth.init()`` — and nothing else to choose: the run id the
launcher already gives every rank of a job, the rank and world size (:mod:`trainhealth.collectors.ranks`), the
Redis URL and the settings from ``TRAINHEALTH_*`` variables a cluster sets once for every job (a SLURM prolog, a
Kubernetes ConfigMap), and ``TRAINHEALTH_MODE=disabled`` to switch it off without a code change.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from trainhealth import defaults, tuning
from trainhealth.collectors import ranks
from trainhealth.collectors.monitor import Monitor
from trainhealth.exceptions import ConfigError
from trainhealth.keys import validate_run_id

log = logging.getLogger(__name__)

#: Where the run id comes from, in order: ours, then the launchers'. torchrun gives every rank of a job the same
#: ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; a fresh UUID with ``--standalone``; ``none`` when unset), SLURM its
#: ``SLURM_JOB_ID`` (an array task: ``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>``, as ``squeue`` shows it).
RUN_ID_VARS = ("TRAINHEALTH_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
#: ``online`` (default) sends; ``disabled`` (also ``off``) checks the settings and sends nothing (as W&B's
#: ``WANDB_MODE=disabled``).
MODES = ("online", "disabled", "off")
#: Settings read from the environment: variable → (Monitor argument, the function reading its text).
ENV_SETTINGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "TRAINHEALTH_GPU_HOUR_USD": ("gpu_hour_usd", float),
    "TRAINHEALTH_HEARTBEAT_INTERVAL": ("heartbeat_interval", float),
    "TRAINHEALTH_BUFFER_RECORDS": ("buffer_records", int),
    "TRAINHEALTH_CLOSE_TIMEOUT": ("close_timeout", float),
    tuning.ENV: ("detector_settings", json.loads),
}

_lock = threading.Lock()
_current: Monitor | None = None


def run_id_from(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(variable, run id)`` of the first of :data:`RUN_ID_VARS` that is set (None when none is).

    >>> run_id_from({"SLURM_JOB_ID": "48213", "SLURM_ARRAY_JOB_ID": "48200", "SLURM_ARRAY_TASK_ID": "13"})
    ('SLURM_JOB_ID', '48200_13')
    >>> run_id_from({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7"})
    ('SLURM_JOB_ID', '7')
    """
    for var in RUN_ID_VARS:
        raw = (env.get(var) or "").strip()
        if not raw or (var == "TORCHELASTIC_RUN_ID" and raw == "none"):
            continue
        if var == "SLURM_JOB_ID" and env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            raw = f"{env['SLURM_ARRAY_JOB_ID'].strip()}_{env['SLURM_ARRAY_TASK_ID'].strip()}"
        return var, raw
    return None


def settings_from(env: Mapping[str, str]) -> dict[str, Any]:
    """The Monitor arguments the ``TRAINHEALTH_*`` variables of :data:`ENV_SETTINGS` set.

    Raises :class:`ConfigError` naming the variable and its value when one is not a number
    (``TRAINHEALTH_DETECTOR_SETTINGS``: not JSON; :class:`Monitor` checks what it holds).

    >>> settings_from({"TRAINHEALTH_GPU_HOUR_USD": "2.5", "TRAINHEALTH_BUFFER_RECORDS": "50000"})
    {'gpu_hour_usd': 2.5, 'buffer_records': 50000}
    """
    out: dict[str, Any] = {}
    for var, (arg, kind) in ENV_SETTINGS.items():
        raw = env.get(var)
        if raw is None or not raw.strip():
            continue
        try:
            out[arg] = kind(raw.strip())
        except ValueError as exc:
            if kind is json.loads:
                raise ConfigError(f"environment {var}={raw!r} is not JSON ({exc})") from None
            noun = "an integer" if kind is int else "a number"
            raise ConfigError(f"environment {var}={raw!r} is not {noun} ({arg})") from None
    return out


def init(run: str | None = None, *, env: Mapping[str, str] | None = None, **kwargs: Any) -> Monitor:
    """The :class:`~trainhealth.collectors.Monitor` of this process, made from the environment on the first call.

    ``env`` replaces ``os.environ`` for every variable read here and for the rank, world size and Redis URL (for
    tests and for launchers that hand a job its environment as a mapping).

    ``run`` defaults to the first of :data:`RUN_ID_VARS` that is set, so every rank of a torchrun or SLURM job
    names the same run without a line of configuration. Settings: the Redis URL from
    ``TRAINHEALTH_REDIS_URL`` (else the embedded server), the retention bounds and spill directory from their
    variables (as Monitor reads them), :data:`ENV_SETTINGS` from theirs; ``kwargs`` (any Monitor argument) win
    over the environment. ``TRAINHEALTH_MODE=disabled`` returns a Monitor that checks its settings and does
    nothing else (no thread, no connection, every call returns at once).

    A second call returns the same Monitor (a library and the script may both call it); one naming another run
    raises. After :meth:`Monitor.close`, the next call makes a new one.

    Raises
    ------
    ConfigError
        No run id (none given and none of :data:`RUN_ID_VARS` set), an invalid one (naming its variable), a
        ``TRAINHEALTH_MODE`` not in :data:`MODES`, a setting that is not a number, a second call naming another
        run, or any argument Monitor refuses.

    Examples
    --------
    >>> mon = init(env={"TORCHELASTIC_RUN_ID": "gpt-7b-0412", "TRAINHEALTH_MODE": "disabled"})
    >>> mon.run, mon.connected, mon.buffered
    ('gpt-7b-0412', False, 0)
    >>> mon.log_step(1, loss=2.5)  # does nothing
    >>> mon.close()
    False
    """
    global _current
    env = os.environ if env is None else env
    mode = (env.get(defaults.MODE_ENV) or "online").strip().lower()
    if mode not in MODES:
        raise ConfigError(f"environment {defaults.MODE_ENV}={env.get(defaults.MODE_ENV)!r} is not one of "
                          f"{', '.join(MODES)}")
    if run is None:
        found = run_id_from(env)
        if found is None:
            raise ConfigError("no run id: pass init(run=...) or set one of " + ", ".join(RUN_ID_VARS)
                              + " (torchrun and SLURM set theirs for every rank)")
        var, run = found
        try:
            validate_run_id(run)
        except ConfigError as exc:
            raise ConfigError(f"environment {var}: {exc}") from None
    with _lock:
        cur = _current
        if cur is not None and not cur._closed:
            if cur.run != run:
                raise ConfigError(f"init(run={run!r}): this process already monitors run {cur.run!r}; close() it "
                                  "first")
            return cur
        args: dict[str, Any] = settings_from(env)
        if env is not os.environ:  # a mapping given for the launcher's variables: the rank and URL come from it too
            rank, world, _ = ranks.detect(kwargs.get("rank"), kwargs.get("world_size"), env)
            args.update(rank=rank, world_size=world)
            if env.get(defaults.REDIS_URL_ENV) and "client" not in kwargs:
                args["redis_url"] = env[defaults.REDIS_URL_ENV]
        args.update(kwargs)
        try:
            _current = Monitor(run, enabled=mode == "online", **args)
        except ConfigError as exc:
            # A value the environment gave: name its variable, not only the Monitor argument it became.
            var = next((v for v, (arg, _) in ENV_SETTINGS.items()
                        if arg not in kwargs and env.get(v) and str(exc).startswith((f"{arg}=", f"{arg}["))), None)
            raise ConfigError(f"environment {var}={env[var]!r}: {exc}" if var else str(exc)) from None
        if mode != "online":
            log.info("trainhealth: %s=%s: the collector of run %s sends nothing", defaults.MODE_ENV, mode, run)
        return _current
