"""``trainhealth follow``: tail a training job's log into Redis live, so a job is monitored without touching its
code (Megatron, NeMo, DeepSpeed, llm.c, nanoGPT, mmengine, HF Trainer stdout, LLaMA-Factory, torchrun's agent)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from trainhealth.collectors.environment import settings_from
from trainhealth.collectors.importers import FORMATS, detect, read_items
from trainhealth.collectors.importers.runs import log_stem
from trainhealth.collectors.importers.tail import Follow, check_followable, following, line_start, wait_for
from trainhealth.collectors.monitor import Monitor
from trainhealth.commands._shared import command, interrupt_on_signals, parse_map, resolve, with_url
from trainhealth.exceptions import ConfigError, InputFormatError
from trainhealth.keys import validate_run_id
from trainhealth.logpoint import LogEvent, LogPoint

log = logging.getLogger(__name__)

#: Formats a follow reads, with how many passes their reader makes over the file (the last one follows; a first
#: pass scans what is written so far: the JSON-lines columns, the HF stdout training bar). Left out: whole-file
#: JSON (``trainer_state.json``, golden values, profiler traces: rewritten, not appended), TensorBoard event files,
#: CSV (Lightning's CSVLogger rewrites its file when a new column appears), and per-rank logs.
FOLLOW_PASSES: dict[str, int] = {
    "megatron": 1, "nanogpt": 1, "modded_nanogpt": 1, "word_lm": 1, "llmc": 1, "mmengine": 1, "text_kv": 1,
    "hf_stdout": 2, "llamafactory": 2, "wandb_jsonl": 2, "jsonl": 2, "nccl_watchdog": 1, "torchelastic": 1,
}
#: Formats written whole again at each save (``trainer_state.json``; Lightning's CSVLogger when a column appears;
#: W&B and other CSV exports) or appended in records a line reader cannot take (TensorBoard event files): re-read
#: whole when the file changes, and only the steps beyond the last one sent go out (a rewrite that goes back, as a
#: job resumed from a checkpoint writes, is followed from where it went back). At most :data:`REREAD_MAX_BYTES`.
REREAD_FORMATS = ("hf_trainer_state", "lightning_csv", "wandb_csv", "csv", "tensorboard")
#: Largest file re-read whole on each change (bytes); a larger one is refused (replay it once it is complete).
REREAD_MAX_BYTES = 256 << 20
#: Shortest interval between two re-reads of a whole-file format (s): a file rewritten many times a second is
#: read at most this often.
REREAD_EVERY_S = 2.0
#: Every format a follow takes.
FOLLOWED = (*FOLLOW_PASSES, *REREAD_FORMATS)
#: Events a followed log reports that go to Redis as they are (checkpoint saves go through checkpoint_saved()).
FORWARDED_EVENTS = ("collective_timeout", "worker_restart")


def default_run_id(path: Path) -> str:
    """The run id a follow uses without ``--run``: the launcher's job id (``TORCHELASTIC_RUN_ID``,
    ``SLURM_JOB_ID``) when set, as ``<id>``, else ``follow-<log name>``.

    >>> import os; os.environ.pop("TORCHELASTIC_RUN_ID", None); os.environ.pop("SLURM_JOB_ID", None)
    >>> default_run_id(Path("/runs/gpt3/train.log"))
    'follow-train'
    """
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        v = os.environ.get(var, "").strip()
        if v and v != "none":
            return v
    return "follow-" + log_stem(path)


def _eval_sets(p: LogPoint) -> tuple[str, ...]:
    """The eval sets an evaluation entry reports (their loss names): one HF log entry per set at the same step."""
    return tuple(name for name, _ in p.eval_losses)


class Follower:
    """Push what a growing log reports through one :class:`~trainhealth.collectors.Monitor` (rank 0 of 1).

    A step is stamped when its line is read (the record's ``t``) and carries the log's own time per step as
    ``step_s`` when the log gives one, so the timing detectors judge the job's clock, not the arrival of lines
    (a job writing to a file through a block buffer delivers them in bursts: run it with ``PYTHONUNBUFFERED=1``
    or ``python -u``). Evaluations become ``badput("evaluation")`` and ``log_eval`` of their losses, checkpoint
    saves ``checkpoint_saved``, NCCL watchdog timeouts and worker-group restarts their events. The Monitor's
    heartbeat says the follower is alive and which step the log last reached, so a job whose log stops is a hang for
    the detector service.

    Parameters
    ----------
    path : Path
        The log file (it may not exist yet).
    fmt : str
        One of :data:`FOLLOWED`: a line format is followed line by line, one of :data:`REREAD_FORMATS` re-read whole
        when it changes.
    monitor : Monitor
        Where the records go.
    mapping : dict | None
        Field → column mapping for JSON-lines logs (``--map``).
    from_start : bool
        Read what the file already holds first (stamped as it arrives: use ``replay`` for a finished log).
    poll_s : float
        Seconds between looks at a quiet file.
    stop : Callable[[], bool]
        True ends the follow (checked at every look).
    """

    def __init__(self, path: Path, fmt: str, monitor: Monitor, *, mapping: dict[str, str | None] | None = None,
                 from_start: bool = False, poll_s: float = 0.5, stop: Callable[[], bool] = lambda: False) -> None:
        self.path = path
        self.fmt = fmt
        self.monitor = monitor
        self.mapping = mapping
        self.from_start = from_start
        self.poll_s = poll_s
        self.stop = stop
        self.steps = 0
        self.events = 0
        self.follow: Follow | None = None

    def run(self) -> None:
        """Follow until :attr:`stop` says so. Raises :class:`InputFormatError` for a log its reader refuses."""
        if self.fmt in REREAD_FORMATS:
            self._reread()
            return
        start = lines = 0
        if not self.from_start and self.path.exists():
            start, lines = line_start(self.path, self.path.stat().st_size)
        passes = FOLLOW_PASSES[self.fmt]
        if passes > 1 and not wait_for(self.path, self.stop, self.poll_s):
            return  # a scanning reader needs the file's first lines
        self.follow = Follow(self.path, start=start, start_line=lines, passes=passes, poll_s=self.poll_s,
                             stop=self.stop)
        token = following.set(self.follow)
        try:
            for item in read_items(self.path, self.fmt, self.mapping):
                self._push(item)
        finally:
            following.reset(token)

    def _reread(self) -> None:
        """A whole-file format: read it again each time it changes (size, time or inode), send what is new."""
        seen: tuple[int, int, int] | None = None
        last: int | None = None  # the newest train step sent
        last_eval: int | None = None  # the newest evaluation step sent,
        sent_at_last: set[tuple[str, ...]] = set()  # and the eval sets sent at it (one entry per set in HF's file)
        first = True
        while not self.stop():
            ident = _identity(self.path)
            if ident is not None and ident != seen and ident[1] > 0:
                if ident[1] > REREAD_MAX_BYTES:
                    raise InputFormatError(f"{self.path}: {ident[1]:,} bytes is too large to re-read at every change "
                                           f"(at most {REREAD_MAX_BYTES:,}); replay it once it is complete")
                try:
                    items = list(read_items(self.path, self.fmt, self.mapping))
                except InputFormatError:
                    items = None  # caught mid-write (a JSON cut short, a CSV row half written): read it next time
                if items is not None:
                    seen = ident
                    points = [p for p in items if isinstance(p, LogPoint) and not p.is_eval]
                    newest = max((p.step for p in points), default=None)
                    if first and not self.from_start:
                        last = newest  # from the end: what the file holds already is not sent
                        last_eval = max((p.step for p in items if isinstance(p, LogPoint) and p.is_eval),
                                        default=None)
                        sent_at_last = {_eval_sets(p) for p in items
                                        if isinstance(p, LogPoint) and p.is_eval and p.step == last_eval}
                    else:
                        if newest is not None and last is not None and newest < last:
                            last = max((p.step for p in points if p.step < newest), default=None)  # went back
                        for item in items:
                            step = getattr(item, "step", None)
                            if isinstance(item, LogPoint) and item.is_eval:
                                sets = _eval_sets(item)
                                if last_eval is None or (step is not None and step > last_eval):
                                    self._push(item)
                                    last_eval, sent_at_last = step, {sets}
                                elif step == last_eval and sets not in sent_at_last:
                                    self._push(item)  # another eval set of the same evaluation
                                    sent_at_last.add(sets)
                            elif last is None or (step is not None and step > last):
                                self._push(item)
                                if isinstance(item, LogPoint):
                                    last = step
                    first = False
            time.sleep(max(self.poll_s, REREAD_EVERY_S if seen is not None else self.poll_s))

    def _push(self, item: LogPoint | LogEvent) -> None:
        mon = self.monitor
        if isinstance(item, LogEvent):
            if item.kind == "checkpoint_save" and item.step is not None:
                mon.checkpoint_saved(item.step, item.seconds if item.seconds is not None else 0.0)
            elif item.kind in FORWARDED_EVENTS:
                mon.log_event(item.kind, step=item.step, seconds=item.seconds, rank=item.rank, **dict(item.fields))
            else:
                return
            self.events += 1
            return
        if item.is_eval:
            mon.badput("evaluation", item.eval_seconds or 0.0, step=item.step)
            for name, loss in item.eval_losses:  # each eval set's loss, for the over-fitting detector
                mon.log_eval(item.step, loss, name=name)
            return
        mon.log_step(item.step, loss=item.loss, grad_norm=item.grad_norm, lr=item.lr, tokens=item.tokens,
                     consumed_samples=item.consumed_samples, skipped=bool(item.skipped) if item.skipped is not None
                     else None, step_s=item.step_seconds, loss_missing=item.loss_missing or None)
        self.steps += 1


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What tells a change of ``path``: (inode, size, mtime) of a file; for a directory (a TensorBoard run's),
    (its files, their total size, the newest mtime). None when it does not exist."""
    try:
        if path.is_dir():
            files = [p.stat() for p in path.iterdir() if p.is_file()]
            return (len(files), sum(f.st_size for f in files), max((f.st_mtime_ns for f in files), default=0))
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


# -- the command ---------------------------------------------------------------------------------
def register(sub: Any) -> None:
    """Add ``follow`` to the ``trainhealth`` sub-parsers."""
    f = with_url(command(sub, "follow", "Tail a training job's log file into Redis as it is written, so the "
                                        "detectors and the dashboard act on it live, without touching the job's "
                                        "code. Survives rotation and truncation. Formats (detected, or --format): "
                                        + ", ".join(FOLLOWED) + " (the last five re-read whole when they change)."))
    f.add_argument("path", metavar="PATH", help="the log file (it may not exist yet)")
    f.add_argument("--format", choices=list(FOLLOWED), help="the log's format (default: detected from its "
                   "name and content; a file not written yet is waited for)")
    f.add_argument("--map", action="append", metavar="FIELD=COLUMN",
                   help="map one of our fields (step, loss, grad_norm, lr, tokens, step_seconds, ...) to a field "
                        "of a JSON-lines log; repeatable")
    f.add_argument("--run", help="run id (default: $TORCHELASTIC_RUN_ID or $SLURM_JOB_ID, else follow-<file name>)")
    f.add_argument("--from-start", action="store_true",
                   help="read what the file already holds first, stamped as it is read (default: only what is "
                        "written from now on; `trainhealth replay` places a finished log on its own timeline)")
    f.add_argument("--poll", type=float, default=0.5, metavar="SECONDS",
                   help="seconds between looks at a quiet file (default 0.5)")
    f.add_argument("--gpu-hour-usd", type=float,
                   help="price of one GPU-hour, for the cost figures (default $TRAINHEALTH_GPU_HOUR_USD)")
    f.set_defaults(func=run, extra=None)


def run(args: argparse.Namespace) -> int:
    """Follow ``args.path`` until Ctrl-C or SIGTERM; 0 (the run is then marked ``stopped``)."""
    from trainhealth.connection import connect

    path = Path(args.path)
    why = check_followable(path)
    if why is not None and not (path.is_dir() and (args.format or "tensorboard") == "tensorboard"):
        raise ConfigError(why)  # a directory only as a TensorBoard run's (detected as such below, or refused)
    if not 0.01 <= args.poll <= 60:
        raise ConfigError(f"--poll={args.poll!r} must be between 0.01 and 60 seconds")
    fmt = args.format
    interrupt_on_signals()
    # A file not written yet when the follow starts: everything it will hold is new (read from its start).
    fresh = not path.exists() or (path.is_file() and path.stat().st_size == 0)
    if fmt is None and fresh:
        # Started before the job writes its log (the usual order): its format is known from its first lines.
        print(f"waiting for {path} to be written, to detect its format (--format skips this)", flush=True)
        try:
            wait_for(path, lambda: False, args.poll)
        except KeyboardInterrupt:
            return 130
        time.sleep(min(2.0, 10 * args.poll))  # a few lines, not a first half-line
    if fmt is None:
        fmt = detect(path)
    if fmt not in FOLLOWED:
        raise ConfigError(f"{path}: a {FORMATS[fmt][2]} ({fmt}) cannot be followed: it is written once, complete "
                          "(a test's golden values, a profiler trace, a benchmark's output); use `trainhealth "
                          f"replay`. Followed formats: {', '.join(FOLLOWED)}")
    run_id = args.run if args.run is not None else default_run_id(path)
    try:
        validate_run_id(run_id)
    except ConfigError as exc:
        raise ConfigError("--run " + str(exc).removeprefix("run=")) from None
    mapping = parse_map(args.map)
    url, _ = resolve(args)
    client: redis.Redis = connect(url)
    price = args.gpu_hour_usd if args.gpu_hour_usd is not None else settings_from(os.environ).get("gpu_hour_usd")
    try:
        mon = Monitor(run_id, client=client, rank=0, world_size=1, gpu_hour_usd=price)
    except ConfigError as exc:
        raise ConfigError(f"--gpu-hour-usd / TRAINHEALTH_GPU_HOUR_USD: {exc}") from None
    client.hset(mon.keys.meta, mapping={"source": f"follow:{path.name}"})
    stopping = False

    def stop() -> bool:
        return stopping

    follower = Follower(path, fmt, mon, mapping=mapping, from_start=args.from_start or fresh, poll_s=args.poll,
                        stop=stop)
    where = " from its start" if args.from_start else " (new: all of it)" if fresh else " from its end"
    print(f"following {path} ({fmt}) as run {run_id!r}{where}; Ctrl-C stops", flush=True)
    status = "stopped"
    try:
        follower.run()
    except KeyboardInterrupt:
        stopping = True
    except InputFormatError:
        status = "failed"
        raise
    finally:
        ok = mon.close(status)
        print(f"trainhealth follow: {follower.steps:,} steps and {follower.events:,} events of {path} sent as run "
              f"{run_id!r}" + ("" if ok else " (NOT all delivered)") + f"; run marked {status!r}",
              file=sys.stderr, flush=True)
    return 0
