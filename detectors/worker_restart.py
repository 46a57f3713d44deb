"""Restarts the launcher reported: torchelastic restarting the worker group (``worker_restart`` events)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any

from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.wire import Event

_INTS = ("restart_count", "attempts_left", "max_restarts", "failed_rank", "failed_local_rank", "exitcode")
_TEXTS = ("state", "role", "signal", "host")


def _parse(ev: Event) -> dict[str, Any]:
    """The event's fields (text on the wire) as values; one that does not parse is unknown (None)."""
    out: dict[str, Any] = dict.fromkeys(_INTS + _TEXTS)
    for name in _INTS:
        text = ev.extra.get(name)
        if text is not None and len(text) <= 12:
            with contextlib.suppress(ValueError):
                out[name] = int(text)
    for name in _TEXTS:
        text = ev.extra.get(name)
        if text:
            out[name] = text[:100]
    return out


class WorkerRestartDetector:
    """A ``restart`` anomaly per restart of the worker group that the launcher reports.

    ``torchrun`` (the torch.distributed.elastic agent) restarts every worker of its node when one fails
    and restarts remain (``--max-restarts``); its log says so (``Worker group FAILED. 3/3 attempts left;
    will restart worker group``, then the rendezvous with ``restart_count=1``), and names the worker
    that failed (``failed (exitcode: -9) local_rank: 1 …``). Events of kind ``worker_restart`` (read by
    :mod:`trainhealth.collectors.importers.torchelastic`, or sent live by a launcher wrapper; fields as text:
    ``restart_count``, ``attempts_left``, ``max_restarts``, ``state``, ``role``, ``failed_rank``,
    ``failed_local_rank``, ``exitcode``, ``signal``, ``host``) each give one anomaly of kind
    ``restart``, severity ``warning`` and created ``resolved`` (a point event), as
    :class:`~trainhealth.detectors.restart.RestartDetector` reports a restart seen in the step records. Onset is the
    last completed step (0 in a log without steps); the id, ``restart:launcher-<restart_count>:…``, is
    the same when several nodes' agents report the same restart (their details are merged). Live, the
    step records of the new generation later give ``RestartDetector``'s own ``restart`` too (with the
    steps recomputed and the downtime): the launcher's says why, that one what it cost.

    Parameters
    ----------
    keep : int
        Restarts remembered to merge reports of the same restart from several agents.

    Evidence: ``source`` (``torchelastic``), ``restart_count``, ``max_restarts``, ``attempts_left``
    (before this restart, as the agent logs it), ``state``, ``role``, ``failed_rank``,
    ``failed_local_rank``, ``exitcode``, ``signal``, ``host`` (None when not reported).

    Examples
    --------
    >>> det = WorkerRestartDetector()
    >>> ev = Event("worker_restart", 0, 0.0, 0.0, extra={"restart_count": "1", "attempts_left": "3",
    ...            "max_restarts": "3", "state": "FAILED", "failed_rank": "1", "failed_local_rank": "1",
    ...            "exitcode": "-9", "signal": "SIGKILL"})
    >>> (a,) = det.report(ev, step=1200)
    >>> print(a.id, a.severity, a.status, a.ranks); print(a.message)
    restart:launcher-1:1200:0 warning resolved (1,)
    the launcher (torchelastic) restarted the worker group after it FAILED: restart 1 of at most 3; rank 1 (local \
rank 1) exited with code -9 (SIGKILL)

    References
    ----------
    PyTorch torch.distributed.elastic: "Elastic Agent" (``torch/distributed/elastic/agent/server/api.py``,
    ``SimpleElasticAgent._invoke_run``: ``max_restarts``, ``restart_count``) and "Error Propagation"
    (``torch/distributed/elastic/multiprocessing/errors``: ``ChildFailedError``, a negative exit code is
    the signal that killed the worker); ``torchrun --max-restarts``.
    """

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._seen: OrderedDict[int, Anomaly] = OrderedDict()  # restart_count -> its anomaly

    def report(self, ev: Event, step: int, gen: int = 0) -> list[Anomaly]:
        """Feed one ``worker_restart`` event, ``step`` being the last completed step and ``gen`` its
        generation; return the restart's anomaly when it is new or its details grew."""
        rep = _parse(ev)
        count = rep["restart_count"]
        if count is None:  # a wrapper that does not count: a restart after the last one seen
            count = rep["restart_count"] = max(self._seen, default=0) + 1
        old = self._seen.get(count)
        if old is not None:  # another agent's report of the same restart: fill in what it adds
            merged = {k: (v if v is not None else rep[k]) for k, v in old.evidence.items() if k in rep}
            rep, step, gen = merged, old.step, old.gen
        new = self._anomaly(rep, step, gen)
        if old is not None and (old.message, old.evidence, old.ranks) == (new.message, new.evidence, new.ranks):
            return []
        self._seen[count] = new
        self._seen.move_to_end(count)
        while len(self._seen) > self.keep:
            self._seen.popitem(last=False)
        return [new]

    @staticmethod
    def _anomaly(rep: dict[str, Any], step: int, gen: int) -> Anomaly:
        count, most = rep["restart_count"], rep["max_restarts"]
        after = f" after it {rep['state']}" if rep["state"] else ""
        msg = f"the launcher (torchelastic) restarted the worker group{after}: restart {count}" + (
            f" of at most {most}" if most is not None else "")
        rank, local, code, sig = rep["failed_rank"], rep["failed_local_rank"], rep["exitcode"], rep["signal"]
        if rank is not None or local is not None:
            who = (f"rank {rank}" + (f" (local rank {local})" if local is not None else "") if rank is not None
                   else f"local rank {local}") + (f" on {rep['host']}" if rep["host"] else "")
            how = (f" exited with code {code}" + (f" ({sig})" if sig else "") if code is not None else
                   f" was killed by {sig}" if sig else " failed")
            msg += f"; {who}{how}"
        else:
            msg += "; which rank failed, and how, is not in the log"
        ev = {"source": "torchelastic", **{k: rep[k] for k in ("restart_count", "max_restarts", "attempts_left",
                                                               "state", "role", "failed_rank", "failed_local_rank",
                                                               "exitcode", "signal", "host")}}
        return Anomaly(kind="restart", severity="warning", step=step, end_step=step, status=RESOLVED, gen=gen,
                       ranks=(rank,) if rank is not None else (), message=msg, evidence=ev,
                       scope=f"launcher-{count}")
