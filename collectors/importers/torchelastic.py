"""``torch.distributed.elastic`` agent logs (``torchrun``): restarts of the worker group, and why.

The agent (``torch/distributed/elastic/agent/server/api.py``) logs, when a worker fails and restarts
remain (``--max-restarts``)::

    [default] Worker group FAILED. 3/3 attempts left; will restart worker group
    [default] Rendezvous complete for workers. Result:
      restart_count=1
      master_addr=127.0.0.1
      ...
      local_ranks=[0, 1, 2, 3]
      global_ranks=[0, 1, 2, 3]

``restart_count`` is ``max_restarts - remaining``: 0 at the first start, ``k`` after the ``k``-th
restart. Before the ``FAILED`` line, ``torch/distributed/elastic/multiprocessing/api.py`` names the
first worker that failed: ``failed (exitcode: -9) local_rank: 1 (pid: 1234) of binary: /usr/bin/python``
(``of fn: …`` for ``start_method=spawn``). The launcher's final failure (no restart left) is the
``ChildFailedError`` summary (``multiprocessing/errors/__init__.py``), whose ``Root Cause (first
observed failure):`` entry reads ``rank : 1 (local_rank: 1)``, ``exitcode : -9 (pid: 1234)``,
``traceback : Signal 9 (SIGKILL) received by PID 1234``.

One :class:`~trainhealth.logpoint.LogEvent` of kind ``worker_restart`` per restart, yielded at
the ``restart_count=k`` line of the rendezvous after it (``source_line``; or at the next ``FAILED``
line or the end of the file when that rendezvous is not in the log, ``restart_count`` then being
``max_restarts - attempts left + 1``). Its fields, as the log gives them: ``restart_count``,
``attempts_left`` and ``max_restarts`` (of the ``FAILED`` line: the attempts left *before* this
restart), ``state`` (``FAILED`` / ``UNHEALTHY``), ``role``, and of the failure that caused it:
``failed_rank`` (global; from the ``local_rank`` and the previous rendezvous' ``local_ranks`` /
``global_ranks`` when only the local rank is logged), ``failed_local_rank``, ``exitcode``, ``signal``
(a negative exit code is the signal that killed the worker: ``-9`` → ``SIGKILL``), ``pid``, ``host``.
``rank`` is None: the agent, not a rank, reports it.

A rendezvous with ``restart_count=k`` and no ``FAILED`` line before it yields a restart when ``k``
is above the last one seen (the ``FAILED`` line is before the excerpt); ``restart_count=0`` (the first
start) and a ``k`` already seen (a membership change re-forms the group without counting a restart)
yield none, and do not confirm a restart decided by a ``FAILED`` line. A failure not followed by a
restart — the job's final ``ChildFailedError`` — yields no event: a final failure is not a restart. A
``… attempts left; will restart worker group`` or ``restart_count=`` line that does not parse is
skipped, with one warning for all; a file with no restart is an error.
"""

from __future__ import annotations

import ast
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainhealth.collectors.importers._common import BadLines, read_lines, show
from trainhealth.logpoint import LogEvent

KIND = "worker_restart"
WILL_RESTART = "attempts left; will restart worker group"
FAILED_GROUP = re.compile(r"\[(?P<role>[^\]]+)\] Worker group (?P<state>[A-Z]+)[.,][^/]*?(?P<left>\d{1,9})/"
                          r"(?P<max>\d{1,9}) ?attempts left; will restart worker group")
FAILED_PROC = re.compile(r"failed \(exitcode: (?P<code>-?\d{1,9})\) local_rank: (?P<local>\d{1,9}) \(pid: "
                         r"(?P<pid>\d{1,12})\) of (?:binary|fn):")
RESULT_HEAD = "Rendezvous complete for workers. Result:"
RESULT_KEY = re.compile(r"^\s*(?P<key>restart_count|local_ranks|global_ranks)=(?P<value>.*?)\s*$")
RESULT_LINE = re.compile(r"^\s+\w+=")
RESTART_COUNT = re.compile(r"^\s*restart_count=")
ROOT_CAUSE = "Root Cause (first observed failure):"
TABLE_KEY = re.compile(r"^\s*(?P<key>rank|exitcode|traceback|host)\s*:\s*(?P<value>.*?)\s*$")
TABLE_RANK = re.compile(r"^(\d{1,9}) \(local_rank: (\d{1,9})\)")
TABLE_EXIT = re.compile(r"^(-?\d{1,9}) \(pid: (\d{1,12})\)")
TABLE_SIGNAL = re.compile(r"^Signal \d+ \((SIG\w+)\)")
SNIFF = re.compile(r"Worker group [A-Z]+[.,].*attempts left; will restart worker group|"
                   r"Rendezvous complete for workers\. Result:|^\s*restart_count=\d+\s*$|"
                   r"failed \(exitcode: -?\d+\) local_rank: \d+ \(pid: \d+\) of (?:binary|fn):")


def sniff_line(line: str) -> bool:
    return SNIFF.search(line) is not None


def signal_name(exitcode: int) -> str | None:
    """The signal a negative exit code stands for (``-9`` → ``SIGKILL``), as torchelastic names it; else None."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _int_list(text: str) -> list[int] | None:
    try:
        value = ast.literal_eval(text) if len(text) < 100_000 else None
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, list) and all(type(v) is int for v in value) else None


def read(path: str | Path) -> Iterator[LogEvent]:
    """Yield one ``worker_restart`` event per restart of the worker group, in file order.

    Examples
    --------
    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    >>> _ = f.write("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 1 "
    ...             "(pid: 4242) of binary: /usr/bin/python3\\n"
    ...             "INFO:torch.distributed.elastic.agent.server.api:[default] Worker group FAILED. 3/3 attempts "
    ...             "left; will restart worker group\\n"
    ...             "INFO:torch.distributed.elastic.agent.server.api:[default] Rendezvous complete for workers. "
    ...             "Result:\\n  restart_count=1\\n  master_addr=127.0.0.1\\n"); f.close()
    >>> for ev in read(f.name):
    ...     print(ev.kind, ev.source_line, ev.fields)
    worker_restart 4 (('restart_count', 1), ('attempts_left', 3), ('max_restarts', 3), ('state', 'FAILED'), \
('role', 'default'), ('failed_local_rank', 1), ('exitcode', -9), ('signal', 'SIGKILL'), ('pid', 4242))
    >>> os.unlink(f.name)

    Raises
    ------
    InputFormatError
        When the file cannot be read or holds no restart of the worker group.
    """
    path = Path(path)
    bad = BadLines(path, "torchelastic worker group restart")
    good = 0
    last_count = 0
    decided: dict[str, Any] | None = None  # the FAILED line's restart, until its rendezvous
    failure: dict[str, Any] = {}  # the latest worker failure, for the next restart
    ranks: dict[int, int] = {}  # local rank -> global rank, from the latest rendezvous
    in_result = in_table = False
    result_local: list[int] | None = None

    def restart(fields: dict[str, Any], line: int) -> LogEvent:
        nonlocal good, last_count
        good += 1
        last_count = max(last_count, fields["restart_count"])
        merged = dict(fields)
        local = merged.get("failed_local_rank")
        if "failed_rank" not in merged and local is not None and local in ranks:
            merged["failed_rank"] = ranks[local]
        order = ("restart_count", "attempts_left", "max_restarts", "state", "role", "failed_rank", "failed_local_rank",
                 "exitcode", "signal", "pid", "host")
        return LogEvent(KIND, fields=tuple((k, merged[k]) for k in order if k in merged), source_line=line)

    def planned(d: dict[str, Any]) -> dict[str, Any]:
        return {"restart_count": d["max_restarts"] - d["attempts_left"] + 1, **d}

    for lineno, text in read_lines(path):
        if in_result:
            m = RESULT_KEY.match(text)
            if m is None and not RESULT_LINE.match(text):
                in_result = False
            elif m is None:
                continue  # master_addr=…, group_rank=…
            elif m.group("key") != "restart_count":
                values = _int_list(m.group("value"))
                if m.group("key") == "local_ranks":
                    result_local = values
                elif values is not None and result_local is not None and len(values) == len(result_local):
                    ranks = dict(zip(result_local, values, strict=True))
                continue
        if in_table:
            m = TABLE_KEY.match(text)
            if m is not None:
                key, value = m.group("key", "value")
                if key == "rank" and (r := TABLE_RANK.match(value)):
                    failure.update(failed_rank=int(r.group(1)), failed_local_rank=int(r.group(2)))
                elif key == "exitcode" and (e := TABLE_EXIT.match(value)):
                    failure.update(exitcode=int(e.group(1)), pid=int(e.group(2)))
                    if (name := signal_name(int(e.group(1)))) is not None:
                        failure["signal"] = name
                elif key == "traceback" and (s := TABLE_SIGNAL.match(value)):
                    failure["signal"] = s.group(1)
                elif key == "host" and value:
                    failure["host"] = value
                continue
            if text.strip().startswith("="):
                in_table = False
        if RESULT_HEAD in text:
            in_result, result_local = True, None
            continue
        if ROOT_CAUSE in text:
            in_table, failure = True, {}
            if decided is not None:  # the job's final failure, after a restart whose rendezvous is not in the log
                yield restart(planned(decided), decided.pop("line"))
                decided = None
            continue
        if RESTART_COUNT.match(text):
            m = RESULT_KEY.match(text)
            count = int(m.group("value")) if m is not None and re.fullmatch(r"\d{1,9}", m.group("value")) else None
            if count is None:
                bad.add(lineno, f"restart_count is not a count: {show(text.strip(), 60)}")
            elif decided is not None and count > last_count:
                yield restart({**decided, "restart_count": count}, lineno)
                decided = None
            elif decided is not None:
                pass  # a count already seen: not the rendezvous of the restart decided
            elif count > last_count:  # the FAILED line is not in the log
                yield restart({"restart_count": count, **failure}, lineno)
                failure = {}
            continue
        m = FAILED_PROC.search(text)
        if m is not None:
            code = int(m.group("code"))
            failure = {"failed_local_rank": int(m.group("local")), "exitcode": code, "pid": int(m.group("pid"))}
            if (name := signal_name(code)) is not None:
                failure["signal"] = name
            continue
        if WILL_RESTART in text:
            m = FAILED_GROUP.search(text)
            if m is None or int(m.group("left")) > int(m.group("max")):
                at = text.find("Worker group")
                at = max(text.rfind("[", 0, at), 0) if at >= 0 else 0
                bad.add(lineno, f"not '[role] Worker group STATE. N/M attempts left; will restart worker group': "
                                f"{show(text[at:].strip(), 100)}")
                continue
            if decided is not None:  # its rendezvous is not in the log
                yield restart(planned(decided), decided.pop("line"))
            decided = {"attempts_left": int(m.group("left")), "max_restarts": int(m.group("max")),
                       "state": m.group("state"), "role": m.group("role"), "line": lineno, **failure}
            failure = {}
    if decided is not None:
        yield restart(planned(decided), decided.pop("line"))
    bad.finish(good)
