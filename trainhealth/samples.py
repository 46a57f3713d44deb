"""Sample indices: what the detector service keeps of them, and the exact data a rollback skips, for a launcher.

A job logs the indices of the samples each rank consumed in a step (``log_step(sample_indices=)``); the service
keeps every rank's, per step, in ``th:{run}:samples`` (bounded in bytes, ``defaults.SAMPLE_INDICES_RETENTION_BYTES``;
docs/architecture.md). A rollback recommendation names a range of steps to skip; :func:`read_skip` turns it into a
:class:`SkipDocument` — the step, consumed-sample and batch-index ranges and the sample indices those steps
consumed, per rank and as one skip list — that ``trainhealth advise RUN --format skip-json`` prints and the
dashboard's recommendation card offers for download; :func:`skip_list` is the plain newline-separated list of
indices a data loader's skip list takes (``--format indices``). See docs/advisor.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, TypedDict

import redis

from trainhealth.keys import run_keys
from trainhealth.recommendations import Action
from trainhealth.wire import Indices, count_indices, expand_indices

#: The version of :class:`SkipDocument` this code writes.
SKIP_VERSION: Literal[1] = 1


class SkipDocument(TypedDict):
    """The exact data a rollback skips: ``trainhealth advise RUN --format skip-json`` and the dashboard card's
    ``skip.json`` (docs/advisor.md). Ranges are of the run as it ran: a relaunch with another world size consumes
    the same samples in another order, so skip by ``sample_indices``, ``skip_samples`` or ``skip_batches`` rather
    than per rank.

    Attributes
    ----------
    version : int
        1.
    run : str
        The run's id.
    recommendation : str
        The recommendation exported (``rec:<anomaly id>``, a field of ``th:{run}:recommendations``).
    action : str
        Its action: ``rollback``, ``wait`` (the rollback it would take) or ``none_possible`` (no checkpoint).
    resume_from_step : int | None
        The step whose checkpoint to load (null: none before the onset, restart from scratch).
    skip_steps : list[int]
        ``[first, last]``: the steps whose data to skip, inclusive (Megatron's ``--train-range-to-skip``).
    skip_samples : list[int] | None
        ``[first, end)``: the same as consumed samples (``log_step(consumed_samples=)``; extrapolated at the run's
        global batch beyond what was logged), null when the job logs none.
    skip_batches : list[int] | None
        ``[first, end)``: the same as the data loader's batch indices, null when unknown.
    indices_steps : list[int] | None
        ``[first, last]``: the steps of the skip the run reached (up to the newest it had when the advice was
        computed, or the newest with indices stored), whose sample indices are below; null when it reached none.
    sample_indices : list[int] | None
        Every sample index those steps consumed, of every rank, ascending and each once: the skip list. Null when
        no step of them logged indices (``log_step(sample_indices=)``).
    sample_indices_by_rank : dict[str, list[int]] | None
        Rank -> the sample indices it consumed in those steps, in the order consumed; null as ``sample_indices``.
    steps_without_indices : list[list[int]]
        ``[first, last]`` ranges (inclusive) of ``indices_steps`` whose indices are not all known: no rank logged
        any, a rank that reported the step logged none (more than ``defaults.SAMPLE_INDICES_MAX``, or none given),
        or the service's bound on ``th:{run}:samples`` trimmed them. Empty when the lists are complete.
    """

    version: Literal[1]
    run: str
    recommendation: str
    action: Action
    resume_from_step: int | None
    skip_steps: tuple[int, int]
    skip_samples: tuple[int, int] | None
    skip_batches: tuple[int, int] | None
    indices_steps: tuple[int, int] | None
    sample_indices: list[int] | None
    sample_indices_by_rank: dict[str, list[int]] | None
    steps_without_indices: list[tuple[int, int]]


#: One stored step: the ranks that reported it, and rank -> its compact indices.
Logged = tuple[int, dict[str, Indices]]


def entry_id(gen: int, step: int) -> str:
    """The id of the ``th:{run}:samples`` entry of ``step`` of restart generation ``gen``: ``<gen + 1>-<step>``."""
    return f"{gen + 1}-{step}"


def read_steps(client: redis.Redis, run: str, gen: int, first: int, last: int) -> dict[int, Logged]:
    """The stored sample indices of steps ``first``..``last`` (inclusive) of generation ``gen``: step -> (ranks that
    reported it, rank -> compact indices). A step missing here was not logged or was trimmed; an entry that is not
    what the service writes is left out (its step then counts as without indices)."""
    if last < first or first < 0:
        return {}
    out: dict[int, Logged] = {}
    for _, f in client.xrange(run_keys(run).samples, entry_id(gen, first), entry_id(gen, last)):
        try:
            fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in f.items()}
            ranks = json.loads(fields["ranks"])
            if not isinstance(ranks, dict):
                continue
            for v in ranks.values():
                count_indices(v)
            out[int(fields["step"])] = (int(fields["n_ranks"]), ranks)
        except (KeyError, ValueError, TypeError):
            continue
    return out


def _generation(anomaly_id: str) -> int:
    """The restart generation in an anomaly id (``kind:ranks:onset:gen``), 0 when it has none."""
    tail = anomaly_id.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _ranges(steps: list[int]) -> list[tuple[int, int]]:
    """Ascending steps as inclusive ``(first, last)`` runs of consecutive ones.

    >>> _ranges([3, 4, 5, 9, 11, 12])
    [(3, 5), (9, 9), (11, 12)]
    """
    out: list[tuple[int, int]] = []
    for s in steps:
        if out and out[-1][1] == s - 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _pair(v: Any) -> tuple[int, int] | None:
    return (int(v[0]), int(v[1])) if v else None


def skip_document(rec: Mapping[str, Any], logged: Mapping[int, Logged]) -> SkipDocument | None:
    """The :class:`SkipDocument` of recommendation ``rec`` (a stored recommendation's dict) given the sample indices
    ``logged`` of its steps (:func:`read_steps`); None when it has no skip range (a recovery advisor's restart).

    >>> rec = {"id": "rec:divergence:*:400:0", "run": "r", "action": "rollback", "checkpoint_step": 299,
    ...        "skip_steps": [300, 303], "skip_samples": [2400, 2432], "skip_batches": [300, 304], "current_step": 302}
    >>> doc = skip_document(rec, {300: (2, {"0": [[2400, 2404]], "1": [[2404, 2408]]}), 301: (2, {"0": [2409, 2408]})})
    >>> doc["indices_steps"], doc["sample_indices"], doc["sample_indices_by_rank"]["0"]
    ((300, 302), [2400, 2401, 2402, 2403, 2404, 2405, 2406, 2407, 2408, 2409], [2400, 2401, 2402, 2403, 2409, 2408])
    >>> doc["steps_without_indices"]  # rank 1 logged none at 301; nothing for 302
    [(301, 302)]
    """
    skip = rec.get("skip_steps")
    if not skip:
        return None
    first, last = int(skip[0]), int(skip[1])
    current = rec.get("current_step")
    reached = min(last, current) if isinstance(current, int) else last
    reached = max([reached, *(s for s in logged if first <= s <= last)])
    by_rank: dict[str, list[int]] = {}
    incomplete: list[int] = []
    for step in range(first, reached + 1):
        entry = logged.get(step)
        if entry is None:
            incomplete.append(step)
            continue
        n_ranks, ranks = entry
        if len(ranks) < n_ranks:
            incomplete.append(step)
        for rank, enc in ranks.items():
            by_rank.setdefault(rank, []).extend(expand_indices(enc))
    ordered = dict(sorted(by_rank.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else kv[0]))
    return {
        "version": SKIP_VERSION, "run": str(rec.get("run", "")), "recommendation": str(rec.get("id", "")),
        "action": rec.get("action"),  # type: ignore[typeddict-item]
        "resume_from_step": rec.get("checkpoint_step"), "skip_steps": (first, last),
        "skip_samples": _pair(rec.get("skip_samples")), "skip_batches": _pair(rec.get("skip_batches")),
        "indices_steps": (first, reached) if reached >= first else None,
        "sample_indices": sorted({i for v in ordered.values() for i in v}) if ordered else None,
        "sample_indices_by_rank": ordered or None,
        "steps_without_indices": _ranges(incomplete),
    }


def read_skip(client: redis.Redis, run: str, rec: Mapping[str, Any]) -> SkipDocument | None:
    """The :class:`SkipDocument` of stored recommendation ``rec`` of ``run``, its indices read from
    ``th:{run}:samples`` (one ``XRANGE`` over the skipped steps of the anomaly's generation); None when it has no
    skip range."""
    skip = rec.get("skip_steps")
    if not skip:
        return None
    logged = read_steps(client, run, _generation(str(rec.get("anomaly_id", ""))), int(skip[0]), int(skip[1]))
    return skip_document(rec, logged)


def any_logged(client: redis.Redis, run: str, rec: Mapping[str, Any]) -> bool:
    """Whether ``th:{run}:samples`` holds indices of any step ``rec`` skips (one ``XRANGE … COUNT 1``)."""
    skip = rec.get("skip_steps")
    if not skip or int(skip[1]) < max(int(skip[0]), 0):
        return False
    gen = _generation(str(rec.get("anomaly_id", "")))
    return bool(client.xrange(run_keys(run).samples, entry_id(gen, max(int(skip[0]), 0)), entry_id(gen, int(skip[1])),
                              count=1))


def dumps(doc: SkipDocument) -> str:
    """``doc`` as its file holds it: one key a line, each value compact (a list of 100,000 indices is one line, not
    100,000), a final newline."""
    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                              for k, v in doc.items()) + "\n}\n"


def skip_list(doc: SkipDocument) -> str | None:
    """The skip list: ``doc``'s sample indices, one a line (ascending, each once, a final newline), as a custom data
    loader or a sampler's exclusion list reads them; None when none were logged."""
    indices = doc["sample_indices"]
    if indices is None:
        return None
    return "".join(f"{i}\n" for i in indices)
