"""Hangs the job itself reported: NCCL watchdog timeouts of a collective (``collective_timeout`` events)."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import Counter
from dataclasses import replace
from typing import Any

from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.aggregate import StepAggregate
from trainhealth.detectors.base import StepDetector
from trainhealth.wire import Event

#: A report's integer fields (``Event.extra`` carries them as text) and its float ones.
_INTS = ("seq", "numel_in", "numel_out", "last_enqueued", "last_completed")
_FLOATS = ("timeout_s",)


def ranks_text(ranks: list[int], limit: int = 16) -> str:
    """``rank 3`` / ``ranks 0, 2, 4`` / ``ranks 0–7, 9``: runs of 3 or more as ranges, at most ``limit`` parts.

    >>> ranks_text([3]), ranks_text([0, 2, 4]), ranks_text([0, 1, 2, 3, 9]), ranks_text(list(range(0, 64, 2)), 3)
    ('rank 3', 'ranks 0, 2, 4', 'ranks 0–3, 9', 'ranks 0, 2, 4, … (32 ranks)')
    """
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts: list[str] = []
    for _, grp in itertools.groupby(enumerate(ranks), lambda ir: ir[1] - ir[0]):
        run = [r for _, r in grp]
        parts += [f"{run[0]}–{run[-1]}"] if len(run) >= 3 else [str(r) for r in run]
    shown = ", ".join(parts[:limit]) + (f", … ({len(ranks)} ranks)" if len(parts) > limit else "")
    return f"ranks {shown}"


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def _parse(ev: Event) -> dict[str, Any]:
    """The report's fields, from the event's text fields; a value that does not parse is left out."""
    out: dict[str, Any] = {}
    for name in _INTS:
        text = ev.extra.get(name)
        if text is not None and len(text) <= 20:
            with contextlib.suppress(ValueError):
                out[name] = int(text)
    for name in _FLOATS:
        try:
            x = float(ev.extra.get(name, "nan"))
        except ValueError:
            continue
        if math.isfinite(x) and x >= 0:
            out[name] = x
    op = ev.extra.get("op")
    if op and op.replace("_", "").isalnum() and len(op) <= 40:
        out["op"] = op
    if ev.seconds is not None and math.isfinite(ev.seconds) and ev.seconds >= 0:
        out["waited_s"] = ev.seconds
    pg = ev.extra.get("pg") or None
    out["pg"] = pg
    # The group each part was reported in, as the line named it (a report merged into a group is not told so).
    if "op" in out:
        out["timeout_pg"] = pg
    if "last_enqueued" in out or "last_completed" in out:
        out["progress_pg"] = pg
    return out


class CollectiveTimeoutDetector(StepDetector):
    """One critical ``hang`` for the job when its ranks' NCCL watchdogs report a collective timeout.

    PyTorch's ``ProcessGroupNCCL`` watchdog aborts a collective that ran longer than the process group's
    timeout (10 min by default) and, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (default 3), takes the
    process down: every rank stuck in it logs the work (``WorkNCCL(SeqNum=…, OpType=…, Timeout(ms)=…)``,
    how long it ran) and its progress (last enqueued / last completed sequence number). The job has
    hung; the reports say where. Events of kind ``collective_timeout`` (read from logs by
    :mod:`trainhealth.collectors.importers.nccl_watchdog`, or sent live by a collector or launcher wrapper: fields
    ``op``, ``seq``, ``timeout_s``, ``numel_in``, ``numel_out``, ``last_enqueued``, ``last_completed``,
    ``pg`` as text, ``seconds`` = the wait) are merged per rank (and process group: a report naming
    none merges into the rank's report of the one group the incident names).

    The collective is the ``(op, SeqNum)`` the most ranks timed out on. The ranks are compared within
    their process group (sequence numbers count per group): a rank is **behind** when it timed out on a
    lower ``SeqNum`` than another rank, when its last completed work is below the others', or when it
    never enqueued the work the others are stuck in (its last enqueued is lower: it did not reach the
    collective — the culprit of a desync). When no rank is behind, the message says so: the log then
    names no straggler or culprit (every reporting rank waits on the same collective), and none is
    invented.

    The anomaly (id ``hang:collective:<step>:<generation>``, beside the heartbeat
    :class:`~trainhealth.detectors.hang.HangDetector`'s ``hang:*:…``) opens with the first report, onset at the last
    completed step (0 in a log without steps), and is updated as more ranks report; it resolves at the
    first step that ends after the latest report (the job resumed: a restart).

    Parameters
    ----------
    max_named : int
        Most rank numbers or ranges a message names (the evidence lists every rank).

    Evidence: ``source`` (``nccl_watchdog``), ``op``, ``seq``, ``pg`` (the process group id the timed-out
    reports name, None when they name none), ``timeout_s``, ``waited_s`` (longest wait reported, s), ``min_waited_s``,
    ``waited_s_by_rank`` (rank → s, the ranks whose wait is in the log), ``numel_in``, ``numel_out``,
    ``timed_out_ranks``, ``progress_ranks`` (ranks reporting last enqueued / completed),
    ``last_completed`` / ``last_enqueued`` (highest reported in the collective's group), ``behind_ranks``,
    ``behind`` (per finding: ``rank``, ``pg``, ``field`` — ``seq``, ``last_completed`` or
    ``last_enqueued`` —, ``value``, ``others``: the others' value, or the work never enqueued),
    ``other_timeouts`` (other collectives that timed out: ``pg``, ``op``, ``seq``, ``ranks``),
    ``reporting_ranks``.

    Examples
    --------
    >>> det = CollectiveTimeoutDetector()
    >>> def report(rank, seconds=None, **fields):
    ...     extra = {k: str(v) for k, v in fields.items()}  # as the events stream carries them
    ...     return det.report(Event("collective_timeout", rank, 0.0, 0.0, seconds=seconds, extra=extra), step=41)
    >>> for r, s in ((0, 600.06), (4, 600.067), (2, None)):
    ...     found = report(r, s, op="ALLREDUCE", seq=1580, timeout_s=600.0)
    >>> for r in (0, 3):
    ...     found = report(r, seq=1580, last_enqueued=1582, last_completed=1579, pg=1)
    >>> a = found[0]
    >>> print(a.kind, a.severity, a.id, a.ranks); print(a.message)
    hang critical hang:collective:41:0 (0, 2, 3, 4)
    ranks 0, 2, 4 timed out ALLREDUCE SeqNum 1580 after 600.1 s (timeout 600 s); last completed 1579, \
last enqueued 1582 on ranks 0, 3 (PG 1); no rank is behind (no straggler or culprit in the log: every reporting \
rank waits on the same collective with the same progress)

    A rank that completed less than the others is named:

    >>> print(report(3, seq=1580, last_enqueued=1582, last_completed=1577, pg=1)[0].message.split("; ")[-1])
    rank 3 is behind: last completed 1577 while the others completed 1579

    References
    ----------
    PyTorch ``ProcessGroupNCCL`` watchdog (``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``:
    ``WorkNCCL::checkTimeout``, ``watchdogHandler``; environment variables ``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
    ``TORCH_NCCL_DESYNC_DEBUG``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``: docs "PYTORCH ProcessGroupNCCL Environment
    Variables"); ``torch.distributed.init_process_group`` ``timeout`` (10 min for NCCL).
    """

    def __init__(self, max_named: int = 16) -> None:
        self.max_named = max_named
        self._reports: dict[int, list[dict[str, Any]]] = {}  # rank -> its reports (one per process group)
        self._open: Anomaly | None = None
        self._onset: tuple[int, int] = (0, 0)  # (generation, step) the incident opened at
        self._t = -math.inf  # time (unix s) of the latest report

    def report(self, ev: Event, step: int, gen: int = 0) -> list[Anomaly]:
        """Feed one ``collective_timeout`` event, ``step`` being the last completed step and ``gen`` its
        generation; return the hang's new state when it changed."""
        rep = _parse(ev)
        if not any(k in rep for k in ("op", "seq", "last_enqueued", "last_completed")):
            return []
        if not self._reports:
            self._onset = (gen, step)
        self._t = max(self._t, ev.t)
        self._merge(ev.rank, rep)
        new = self._anomaly()
        cur = self._open
        self._open = new
        if cur is not None and (cur.message, cur.evidence, cur.ranks) == (new.message, new.evidence, new.ranks):
            return []
        return [new]

    def update(self, agg: StepAggregate) -> list[Anomaly]:
        """Feed one completed step: the first one that ended after the latest report resolves the hang (a step
        closed late, by ranks that had completed it before the timeout, does not)."""
        cur = self._open
        if cur is None or not agg.t_end > self._t:
            return []
        self._open, self._reports, self._t = None, {}, -math.inf
        return [replace(cur, status=RESOLVED, end_step=agg.step)]

    # -- state -----------------------------------------------------------------------------------
    def _merge(self, rank: int, rep: dict[str, Any]) -> None:
        mine = self._reports.setdefault(rank, [])
        pg = rep["pg"]
        target = next((r for r in mine if r["pg"] == pg), None)
        if target is None and pg is not None:
            target = next((r for r in mine if r["pg"] is None), None)
        if target is None and pg is None and len(mine) == 1:
            target = mine[0]
        if target is None:
            mine.append(dict(rep))
            return
        target.update({k: v for k, v in rep.items() if v is not None})

    def _groups(self) -> dict[str | None, list[tuple[int, dict[str, Any]]]]:
        """Reports by process group, in order of appearance; a report naming no group joins the one group
        the others name (when they name exactly one)."""
        known = {r["pg"] for reps in self._reports.values() for r in reps if r["pg"] is not None}
        default = next(iter(known)) if len(known) == 1 else None
        groups: dict[str | None, list[tuple[int, dict[str, Any]]]] = {}
        for rank, reps in self._reports.items():
            for r in reps:
                groups.setdefault(r["pg"] if r["pg"] is not None else default, []).append((rank, r))
        return groups

    # -- the finding -----------------------------------------------------------------------------
    def _anomaly(self) -> Anomaly:
        groups = self._groups()
        collectives: list[tuple[str | None, str, int | None, list[int]]] = []  # (pg, op, seq, ranks)
        for pg, reps in groups.items():
            count = Counter((r["op"], r.get("seq")) for _, r in reps if "op" in r)
            for (op, seq), _ in sorted(count.items(), key=lambda kv: (-kv[1], kv[0][1] is None, kv[0][1] or 0)):
                ranks = sorted(rk for rk, r in reps if r.get("op") == op and r.get("seq") == seq)
                collectives.append((pg, op, seq, ranks))
        collectives.sort(key=lambda c: -len(c[3]))  # stable: the first group's most reported first
        if collectives:
            pg, op, seq, timed = collectives[0]
        else:  # only progress reports: the timed-out work's own line is not in the log
            pg, op, seq, timed = next(iter(groups)), None, None, []
        main = groups[pg]
        tos = [r for rk, r in main if rk in timed and r.get("op") == op and r.get("seq") == seq]
        named = {r.get("timeout_pg") for r in tos}
        pg = next(iter(named)) if len(named) == 1 else None  # as the timeout lines name it
        waits = {rk: r["waited_s"] for rk, r in main if rk in timed and r.get("op") == op and "waited_s" in r}
        timeouts = [r["timeout_s"] for r in tos if "timeout_s" in r]
        timeout_s = max(timeouts) if timeouts else None
        progress = [(rk, r) for rk, r in main if "last_completed" in r or "last_enqueued" in r]
        completed = [r["last_completed"] for _, r in progress if "last_completed" in r]
        enqueued = [r["last_enqueued"] for _, r in progress if "last_enqueued" in r]
        behind = [b for reps in groups.values() for b in self._behind(reps)]
        several = len(groups) > 1
        label = f" (PG {pg})" if pg is not None else ""
        parts: list[str] = []
        if op is not None:
            what = f"{op} SeqNum {seq}" if seq is not None else op
            wait = ""
            if waits:
                lo, hi = min(waits.values()), max(waits.values())
                wait = f" after {hi:.1f} s" if f"{lo:.1f}" == f"{hi:.1f}" else f" after {lo:.1f}–{hi:.1f} s"
            limit = f" (timeout {timeout_s:g} s)" if timeout_s is not None else ""
            parts.append(f"{ranks_text(timed, self.max_named)} timed out {what}{label}{wait}{limit}")
        named = {r.get("progress_pg") for _, r in progress}
        plabel = f" (PG {next(iter(named))})" if len(named) == 1 and None not in named else ""
        if op is None:
            works = sorted({r["seq"] for _, r in main if "seq" in r})
            at = f" at work {_span(works)}" if works else ""
            pg = next(iter(named)) if len(named) == 1 else None
            parts.append(f"{ranks_text([rk for rk, _ in main], self.max_named)} report a watchdog timeout or error"
                         f"{at}{plabel} (the timed-out collective's own line is not in the log)")
        elif progress:
            bits = ([f"last completed {_span(completed)}"] if completed else []) + (
                [f"last enqueued {_span(enqueued)}"] if enqueued else [])
            parts.append(f"{', '.join(bits)} on {ranks_text([rk for rk, _ in progress], self.max_named)}{plabel}")
        late = {b["rank"] for b in behind if b["field"] in ("seq", "op")}
        for opg, oop, oseq, oranks in collectives[1:]:
            if opg == collectives[0][0] and all(rk in late for rk in oranks):
                continue  # told below: the ranks behind
            olabel = f" (PG {opg})" if opg is not None else ""
            parts.append(f"also {ranks_text(oranks, self.max_named)} timed out {oop}"
                         + (f" SeqNum {oseq}" if oseq is not None else "") + olabel)
        parts += self._behind_text(behind, several)
        comparable = {rk for rk, r in main if any(k in r for k in ("seq", "last_completed", "last_enqueued"))}
        if not behind:
            if len(comparable) >= 2:
                parts.append("no rank is behind (no straggler or culprit in the log: every reporting rank waits on "
                             "the same collective with the same progress)")
            else:
                parts.append(f"only {ranks_text(sorted(comparable) or timed, self.max_named)} reported: the log does "
                             "not show which rank held the others up")
        reporting = sorted(self._reports)
        ev = {
            "source": "nccl_watchdog", "op": op, "seq": seq, "pg": pg, "timeout_s": timeout_s,
            "waited_s": max(waits.values()) if waits else None,
            "min_waited_s": min(waits.values()) if waits else None,
            "waited_s_by_rank": {str(rk): s for rk, s in sorted(waits.items())},
            "numel_in": next((r["numel_in"] for r in tos if "numel_in" in r), None),
            "numel_out": next((r["numel_out"] for r in tos if "numel_out" in r), None),
            "timed_out_ranks": timed, "progress_ranks": sorted(rk for rk, _ in progress),
            "last_completed": max(completed) if completed else None,
            "last_enqueued": max(enqueued) if enqueued else None,
            "behind_ranks": sorted({b["rank"] for b in behind}), "behind": behind,
            "other_timeouts": [{"pg": g, "op": o, "seq": s, "ranks": rs} for g, o, s, rs in collectives[1:]],
            "reporting_ranks": reporting,
        }
        gen, step = self._onset
        return Anomaly(kind="hang", severity="critical", step=step, gen=gen, ranks=tuple(reporting),
                       message="; ".join(parts), evidence=ev, scope="collective")

    @staticmethod
    def _behind(reps: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
        """The ranks of one process group that are behind the others, one entry per rank and field (``pg`` as
        the rank's line of that field named it)."""
        out: list[dict[str, Any]] = []
        mine = dict(reps)
        seqs = {rk: r["seq"] for rk, r in reps if "op" in r and "seq" in r}
        if seqs:
            top = max(seqs.values())
            out += [{"rank": rk, "pg": mine[rk].get("timeout_pg"), "field": "seq", "value": v, "others": top}
                    for rk, v in sorted(seqs.items()) if v < top]
            # At the same SeqNum, a rank in a different collective, or with other sizes, than most: a mismatch.
            for seq in sorted(set(seqs.values())):
                same = sorted((rk, mine[rk]) for rk, v in seqs.items() if v == seq)
                for field in ("op", "numel_in"):
                    values = Counter(r[field] for _, r in same if field in r)
                    if len(values) < 2:
                        continue
                    usual = max(values, key=lambda v: (values[v], -min(rk for rk, r in same if r.get(field) == v)))
                    out += [{"rank": rk, "pg": r.get("timeout_pg"), "field": field, "value": r[field], "others": usual,
                             "seq": seq} for rk, r in same if field in r and r[field] != usual]
        done = {rk: r["last_completed"] for rk, r in reps if "last_completed" in r}
        if done:
            top = max(done.values())
            out += [{"rank": rk, "pg": mine[rk].get("progress_pg"), "field": "last_completed", "value": v,
                     "others": top} for rk, v in sorted(done.items()) if v < top]
        stuck = max((r["seq"] for _, r in reps if "seq" in r), default=None)
        if stuck is not None:
            out += [{"rank": rk, "pg": r.get("progress_pg"), "field": "last_enqueued", "value": r["last_enqueued"],
                     "others": stuck} for rk, r in sorted(reps, key=lambda x: x[0])
                    if r.get("last_enqueued", stuck) < stuck]
        return out

    def _behind_text(self, behind: list[dict[str, Any]], several: bool) -> list[str]:
        out = []
        for (field, pg), items in itertools.groupby(sorted(behind, key=lambda b: (b["field"], str(b["pg"]))),
                                                    lambda b: (b["field"], b["pg"])):
            items = list(items)
            ranks = [b["rank"] for b in items]
            who = ranks_text(ranks, self.max_named) + (f" (PG {pg})" if several and pg is not None else "")
            verb = "is" if len(set(ranks)) == 1 else "are"
            by_value: dict[int, list[int]] = {}
            for b in items:
                by_value.setdefault(b["value"], []).append(b["rank"])
            vals = (str(next(iter(by_value))) if len(by_value) == 1 else
                    ", ".join(f"{v} ({ranks_text(rs, self.max_named)})" for v, rs in sorted(by_value.items())))
            others = items[0]["others"]
            if field == "seq":
                out.append(f"{who} {verb} behind: timed out at SeqNum {vals} while the others were at {others}")
            elif field == "op":
                out.append(f"{who} called a different collective at SeqNum {items[0]['seq']}: {vals} while the "
                           f"others {others} (the ranks' collectives do not match)")
            elif field == "numel_in":
                out.append(f"{who} passed other sizes at SeqNum {items[0]['seq']}: NumelIn {vals} while the others "
                           f"{others} (the ranks' tensor sizes do not match)")
            elif field == "last_completed":
                out.append(f"{who} {verb} behind: last completed {vals} while the others completed {others}")
            else:
                out.append(f"{who} {verb} behind: last enqueued {vals}, never reaching the work {others} the others "
                           "are stuck in")
        return out
