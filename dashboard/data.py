"""Every Redis read of the dashboard, as plain functions returning pandas objects or dicts.

No Streamlit here: each function takes a ``redis.Redis`` client (``decode_responses`` on or
off) and a run id, and returns a DataFrame with fixed columns even when the key is missing,
so the pages never special-case "no data yet" beyond ``frame.empty``.

Cost per call is bounded: streams are read newest-first with ``XREVRANGE … COUNT`` (never
whole), hashes are small (one field per anomaly, per rank or per meta field).

Numbers in Redis are decimal strings; ``"nan"``, ``"inf"``, ``"-inf"`` come back as floats,
JSON ``null`` and empty strings as NaN/None. Times are unix seconds, durations seconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd
import redis

from trainhealth import defaults, goodput, samples
from trainhealth.anomaly import ALL_KINDS
from trainhealth.exceptions import ConfigError
from trainhealth.job import Culprit, JobState
from trainhealth.keys import RUNS, SERVICE_HEARTBEAT_PATTERN, run_keys, validate_run_id
from trainhealth.text import fmt_ranks, plural
from trainhealth.wire import MEMORY_FIELDS, decode_event

#: Runs listed in the picker (newest first); older ones are reachable by ``?run=`` links.
RUNS_LIMIT = 200
#: Newest entries of the events stream scanned for checkpoint markers and hosts. Every rank
#: reports each checkpoint, so at 1,024 ranks this covers the last ~10 checkpoints.
EVENTS_SCAN_ENTRIES = 10_000
#: Oldest events scanned as well for ``run_start`` hosts (the first launch's are at the head).
EVENTS_HEAD_ENTRIES = 4_096
#: Events read per round trip when looking for the ranks' ``run_start`` (newest first, until every rank has one).
HOSTS_PAGE_ENTRIES = 2_048
#: Ledger snapshots shown: one per 2 s, so 1,800 ≈ the last hour.
LEDGER_HISTORY_ENTRIES = 1_800

RUN_COLUMNS = ["run", "started_at", "name", "status", "world_size", "gpu_hour_usd", "updated_at",
               "ended_at", "source"]
STEP_COLUMNS = ["step", "gen", "t_start", "t_end", "dur", "step_s", "loss", "grad_norm", "lr", "tokens", "samples",
                "n_ranks", "data_s"]
_STEP_INTS = ("step", "gen", "tokens", "samples", "n_ranks")
EVENT_COLUMNS = ["kind", "step", "t", "seconds", "n_ranks"]
CHECKPOINT_KINDS = ("checkpoint_save", "checkpoint_load")
HOST_COLUMNS = ["rank", "host"]
ANOMALY_COLUMNS = ["id", "kind", "severity", "status", "step", "end_step", "ranks", "hosts", "message",
                   "first_seen", "last_seen", "evidence"]
SEVERITIES = ("critical", "warning", "info")
ANOMALY_KINDS = ALL_KINDS  # the stable kinds, one list
ANOMALY_STATUSES = ("active", "resolved")
LEDGER_COLUMNS = ["t", "started_at", "wall_s", "world_size", "gpu_hour_usd", "last_step", "steps_done",
                  "steps_good", "restarts", "tokens_total", "tokens_good", "throughput_tok_s",
                  "goodput_tok_s", "goodput_pct", "badput_cost_usd"]
#: Goodput ledger categories (seconds of wall time), in docs/goodput.md's order; everything but
#: :data:`NOT_BADPUT` is badput. Categories a snapshot adds beyond these are shown too.
LEDGER_CATEGORIES = goodput.CATEGORIES
#: Categories that are not badput: productive time, and ``unobserved`` time (steps the records do not cover: records
#: lost, a log's skipped stretches), which is not known to be lost (docs/goodput.md).
NOT_BADPUT = goodput.NOT_BADPUT
#: Windows of the ledger's rolling rates (``rates`` keys) and the history columns they fill:
#: ``rate.<window>.throughput_tok_s`` and ``rate.<window>.goodput_tok_s``.
RATE_WINDOWS = ("60s", "600s", "3600s")
RATE_COLUMNS = [f"rate.{w}.{v}" for w in RATE_WINDOWS for v in ("throughput_tok_s", "goodput_tok_s")]
#: Columns of :func:`badput_by_cause`.
CAUSE_COLUMNS = ["category", "ledger_category", "seconds", "gpu_hours", "cost_usd"]
#: Recommendation statuses that still ask for a decision (shown as a card).
OPEN_RECOMMENDATION_STATUSES = ("proposed", "acknowledged")
RANK_SUMMARY_COLUMNS = ["rank", "host", "median_busy_s", "ratio", "score", "steps"]
#: Steps the rank table summarises: recent enough that a new straggler is not diluted by the
#: run's healthy history (the straggler detector itself scores 20-step windows).
RANK_TABLE_STEPS = 100
#: A detector service whose newest heartbeat (``th:service:*``, refreshed about every second)
#: is older than this (s) counts as not running.
SERVICE_STALE_S = 10.0
#: The ranks' newest completed step (their heartbeats) may be ahead of the newest aggregate by
#: this much (s) before the dashboard says steps arrive but are not processed.
PROCESSING_LAG_S = 60.0
#: ``SCAN … COUNT`` hint when looking for service heartbeats.
SERVICE_SCAN_COUNT = 1_000


# --- decoding ----------------------------------------------------------------------------

def _s(v: Any) -> str:
    # errors="replace": bytes that are not UTF-8 (garbage in Redis) must not raise in a page.
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _num(v: Any) -> float:
    """A Redis number string as a float: ``nan``/``inf`` kept, missing/empty/``null`` → NaN."""
    if v is None:
        return math.nan
    if isinstance(v, (int, float)):
        return float(v)
    text = _s(v).strip()
    if text == "" or text.lower() in ("none", "null"):
        return math.nan
    try:
        return float(text)
    except ValueError:
        return math.nan


def _opt_num(v: Any) -> float | None:
    x = _num(v)
    return None if math.isnan(x) else x


def _decode_map(fields: Mapping[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in fields.items()}


def _json(v: Any) -> Any:
    # Python's json writes NaN/Infinity and reads them back, which is what the service emits.
    return json.loads(_s(v))


# --- what could not be read ----------------------------------------------------------------
# Garbage in Redis (a hand-edited key, an old or foreign writer) must never break a page: each
# reader below keeps what it can read and, given a ``problems`` list, appends one sentence per
# key saying what it left out or blanked (key, entry/field, value), which the pages show.

#: Largest integer a step/token count may be: beyond 2**53 a float (as JSON numbers are) is inexact.
MAX_INT = 2**53
#: Unix times pandas can represent (datetime64[ns] ends in 2262).
MAX_TIME = 9e9
#: Most ranks a busy list may have (the service's rank limit is 1,048,575).
MAX_RANKS = 1_048_576


def show_value(v: Any, limit: int = 40) -> str:
    """``repr`` of a stored value, cut to ``limit`` characters (for messages)."""
    if isinstance(v, bytes):
        v = v.decode(errors="replace")
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def unreadable(key: str, noun: str, nouns: str, bad: list[str], partly: bool = False) -> str:
    """``2 anomalies in th:{r}:anomalies are unreadable (first: field 'x:1': not JSON)``; with
    ``partly``: entries shown with some values blank."""
    n = len(bad)
    what = f"{n} {noun if n == 1 else nouns} in {key} "
    if partly:
        what += ("has" if n == 1 else "have") + " unreadable values, shown as missing"
    else:
        what += "is unreadable" if n == 1 else "are unreadable"
    return what + (f" ({bad[0]})" if n == 1 else f" (first: {bad[0]})")


def _report(problems: list[str] | None, text: str) -> None:
    if problems is not None:
        problems.append(text)


def _strict_num(v: Any) -> float:
    """A stored number (JSON number or decimal string; ``nan``/``inf`` kept); ValueError if it is none."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str, bytes)):
        raise ValueError
    if isinstance(v, (int, float)):
        return float(v)
    return float(_s(v).strip())


def _get_num(d: Mapping[str, Any], name: str, bad: list[str], finite: bool = False, bound: float = math.inf,
             integral: bool = False) -> float:
    """``d[name]`` as a float, NaN when absent/null; a value that is no such number is NaN and noted in ``bad``."""
    v = d.get(name)
    if v is None or (isinstance(v, (str, bytes)) and _s(v).strip().lower() in ("", "none", "null")):
        return math.nan
    try:
        x = _strict_num(v)
    except (TypeError, ValueError, OverflowError):
        bad.append(f"{name} {show_value(v)} is not a number")
        return math.nan
    if math.isnan(x) and not (finite or integral):
        return x
    if math.isfinite(x):
        ok = abs(x) <= bound and (not integral or x == round(x))
    else:
        ok = not (finite or integral) and bound == math.inf
    if not ok:
        kind = "a unix time" if bound == MAX_TIME else "a whole number" if integral else "a finite number"
        bad.append(f"{name} {show_value(v)} is not {kind}")
        return math.nan
    return x


def _get_str(d: Mapping[str, Any], name: str, bad: list[str]) -> str | None:
    v = d.get(name)
    if v is None or isinstance(v, str):
        return v
    bad.append(f"{name} {show_value(v)} is not a string")
    return None


# --- runs --------------------------------------------------------------------------------

def _typed_meta(raw: Mapping[str, str], bad: list[str] | None = None) -> dict[str, Any]:
    bad = [] if bad is None else bad
    out: dict[str, Any] = dict(raw)
    if "world_size" in raw:
        ws = _get_num(raw, "world_size", bad, bound=MAX_RANKS, integral=True)
        out["world_size"] = int(ws) if math.isfinite(ws) else None
    for name in ("started_at", "updated_at", "ended_at"):
        if name in raw:
            out[name] = _opt_num(_get_num(raw, name, bad, finite=True, bound=MAX_TIME))
    if "gpu_hour_usd" in raw:
        out["gpu_hour_usd"] = _opt_num(_get_num(raw, "gpu_hour_usd", bad, finite=True))
    return out


def run_meta(client: redis.Redis, run: str, problems: list[str] | None = None) -> dict[str, Any]:
    """The run's ``meta`` hash with typed values, or ``{}`` when the run has none.

    ``world_size`` is an int; ``started_at``, ``updated_at``, ``ended_at`` (unix s) and
    ``gpu_hour_usd`` (USD per GPU-hour) are floats or None; other fields stay strings. A value
    that is not such a number is None and, with ``problems``, reported there.
    """
    key = run_keys(run).meta
    bad: list[str] = []
    meta = _typed_meta(_decode_map(client.hgetall(key)), bad)
    if bad:
        _report(problems, f"{key} has unreadable fields, shown as missing: {'; '.join(bad)}")
    return meta


def list_runs(client: redis.Redis, limit: int = RUNS_LIMIT, problems: list[str] | None = None) -> pd.DataFrame:
    """Runs of the ``th:runs`` registry, newest first (by start time), with their meta.

    Returns one row per run with columns :data:`RUN_COLUMNS`: ``run`` (id), ``started_at``
    (the registry score, unix s), ``name``, ``status``, ``world_size``, ``gpu_hour_usd``,
    ``updated_at``, ``ended_at``, ``source`` (None where the meta hash lacks the field).
    Reads one ``ZREVRANGE`` and one pipelined ``HGETALL`` per run (at most ``limit``).
    Members that are not valid run ids are skipped (as the detector service does) and, with
    ``problems``, named there.
    """
    valid = registry(client, limit, problems)
    if not valid:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in RUN_COLUMNS})
    pipe = client.pipeline(transaction=False)
    runs = [run for run, _ in valid]
    for run in runs:
        pipe.hgetall(run_keys(run).meta)
    metas = pipe.execute()
    rows = []
    for (run, score), raw in zip(valid, metas, strict=True):
        meta = _typed_meta(_decode_map(raw))
        rows.append({
            "run": run, "started_at": float(score), "name": meta.get("name"), "status": meta.get("status"),
            "world_size": meta.get("world_size"), "gpu_hour_usd": meta.get("gpu_hour_usd"),
            "updated_at": meta.get("updated_at"), "ended_at": meta.get("ended_at"),
            "source": meta.get("source"),
        })
    frame = pd.DataFrame(rows, columns=RUN_COLUMNS)
    for c in ("run", "name", "status", "source"):
        # pandas 3 infers a string dtype whose missing value is NaN (truthy): keep None for "absent".
        frame[c] = pd.Series([v if isinstance(v, str) else None for v in frame[c]], index=frame.index, dtype=object)
    # Likewise a run without (or with an unreadable) world_size beside one with it: None, not a truthy NaN.
    frame["world_size"] = pd.Series([row["world_size"] for row in rows], index=frame.index, dtype=object)
    return frame


def run_exists(client: redis.Redis, run: str) -> bool:
    """True when ``run`` is in the ``th:runs`` registry (so a ``?run=`` link can open it)."""
    return client.zscore(RUNS, run) is not None


# --- the job's state ------------------------------------------------------------------------

def job_state(client: redis.Redis, run: str, problems: list[str] | None = None) -> JobState | None:
    """The job's state as the detector service judges it (``state``), or None when it wrote none yet.

    A :class:`trainhealth.job.JobState`: ``state`` (one of ``running``, ``hung``, ``crashed``,
    ``restarted``, ``finished``), ``since`` (unix s the job entered it; NaN when unreadable),
    ``step`` (int or None), ``culprit`` (:class:`trainhealth.job.Culprit`: ``rank`` int, ``host``
    str or None, ``pid`` int or None, ``step`` int or None, ``why`` str; None when not known),
    ``message`` (one line) and ``gen`` (restart generation). One ``GET``. A value that is not such
    a record (not JSON, no ``state``/``since``, an unknown state) gives None; a ``since``, ``step``,
    ``culprit.host``/``pid``/``step`` of the wrong type is blanked. With ``problems``, either is
    reported there.
    """
    key = run_keys(run).state
    raw = client.get(key)
    if raw is None:
        return None
    try:
        state = JobState.from_json(_s(raw))  # text: its messages quote the value without a b'' around it
    except ValueError as exc:
        _report(problems, f"{key} is unreadable: {exc}")
        return None
    bad: list[str] = []
    since = _get_num(vars(state), "since", bad, finite=True, bound=MAX_TIME)
    step = _get_num(vars(state), "step", bad, integral=True, bound=MAX_INT)
    culprit = state.culprit
    if culprit is not None:
        n = len(bad)
        host = _get_str(vars(culprit), "host", bad)
        pid = _get_num(vars(culprit), "pid", bad, integral=True, bound=MAX_INT)
        c_step = _get_num(vars(culprit), "step", bad, integral=True, bound=MAX_INT)
        bad[n:] = [f"culprit.{b}" for b in bad[n:]]  # name the object the field is in
        culprit = Culprit(culprit.rank, host, None if math.isnan(pid) else int(pid),
                          None if math.isnan(c_step) else int(c_step), culprit.why)
    if bad:
        _report(problems, f"{key} has unreadable values, shown as missing: {'; '.join(bad)}")
    return JobState(state.state, since, None if math.isnan(step) else int(step), culprit, state.message, state.gen)


# --- per-step aggregates -----------------------------------------------------------------

def _empty_steps() -> pd.DataFrame:
    frame = pd.DataFrame({c: pd.Series(dtype="float64") for c in STEP_COLUMNS})
    for c in _STEP_INTS:
        frame[c] = frame[c].astype("Int64")
    frame["busy"] = pd.Series(dtype=object)
    return frame


try:  # the server extra's msgspec: a 1,024-rank busy list in ~25 us instead of ~190 us (json), to the same floats
    from msgspec import DecodeError as _DecodeError
    from msgspec.json import Decoder as _Decoder

    _decode_seconds: Any = _Decoder(list[float]).decode
except ImportError:  # the standard library decides every list
    _decode_seconds, _DecodeError = None, ValueError


def _busy_list(v: Any) -> list[float]:
    """A ``busy`` field (JSON list of seconds per rank, null = missing rank); ValueError if it is none."""
    if _decode_seconds is not None:
        try:  # the fast path: a list of numbers without nulls, as the service writes a full step
            values = _decode_seconds(v if isinstance(v, (bytes, str)) else str(v))
            if len(values) <= MAX_RANKS:
                return values
        except _DecodeError:
            pass  # nulls, NaN tokens or garbage: read as below
    try:
        values = _json(v)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"busy {show_value(v)} is not JSON") from exc
    if not isinstance(values, list) or len(values) > MAX_RANKS:
        raise ValueError(f"busy {show_value(v)} is not a list of seconds per rank")
    try:  # the fast path: numbers and nulls, as the service writes them
        return [math.nan if x is None else float(x) for x in values]
    except (TypeError, ValueError):
        return [math.nan if x is None else _num(x) for x in values]


def recent_steps(client: redis.Redis, run: str, count: int = defaults.DASHBOARD_STEPS,
                 with_busy: bool = True, problems: list[str] | None = None) -> pd.DataFrame:
    """The newest ``count`` entries of the run's ``agg`` stream, oldest first (stream order).

    One ``XREVRANGE … COUNT count``. Columns :data:`STEP_COLUMNS` plus ``busy``:

    - ``step``, ``gen`` (restart generation), ``tokens``, ``samples`` (sums over ranks),
      ``n_ranks``: nullable ints (``step`` never missing);
    - ``t_start``, ``t_end`` (unix s), ``dur``, ``step_s`` (the job's own step time), ``data_s`` (s),
      ``loss``, ``grad_norm``, ``lr``:
      floats, NaN/±inf kept;
    - ``busy``: list of per-rank busy seconds (index = rank, NaN = rank missing); an empty
      list for every row when ``with_busy`` is False (skips decoding world-size floats per step).

    After a restart a step can appear twice (once per generation); both rows are kept. An entry
    without a readable ``step`` is skipped; other unreadable values are NaN (an empty ``busy``);
    with ``problems``, both are reported there.
    """
    key = run_keys(run).agg
    rows = _step_rows(reversed(client.xrevrange(key, count=count)), with_busy)
    _report_rows(problems, key, rows)
    return _steps_frame([row for row, _ in rows if row is not None])


#: One :func:`_step_rows` row: the parsed entry (None when skipped: no readable step) and what in it cannot be read.
_StepRow = tuple[dict[str, Any] | None, str | None]


def _report_rows(problems: list[str] | None, key: str, rows: Iterable[_StepRow]) -> None:
    """Report the rows' unreadable entries (skipped ones, then the partly read) as :func:`recent_steps` does."""
    rows = list(rows)
    skipped = [why for row, why in rows if row is None and why]
    partly = [why for row, why in rows if row is not None and why]
    if skipped:
        _report(problems, unreadable(key, "entry", "entries", skipped))
    if partly:
        _report(problems, unreadable(key, "entry", "entries", partly, partly=True))


def _step_rows(entries: Iterable[tuple[Any, Any]], with_busy: bool) -> list[_StepRow]:
    """:func:`recent_steps`' rows of ``agg`` entries, each with what in it cannot be read (``entry <id>: …``, None
    when all can)."""
    out: list[_StepRow] = []
    for entry_id, fields in entries:
        d = _decode_map(fields)
        bad: list[str] = []
        row: dict[str, Any] = {}
        for c in STEP_COLUMNS:
            if c in _STEP_INTS:
                row[c] = _get_num(d, c, bad, bound=MAX_INT, integral=True)
            elif c in ("t_start", "t_end"):
                row[c] = _get_num(d, c, bad, finite=True, bound=MAX_TIME)
            else:
                row[c] = _get_num(d, c, bad)
        if math.isnan(row["step"]):
            # Every chart and matrix is indexed by step: an entry without one cannot be placed.
            why = bad[0] if bad and bad[0].startswith("step ") else "no step"
            out.append((None, f"entry {_s(entry_id)}: {why}"))
            continue
        row["busy"] = []
        if with_busy and "busy" in d:
            try:
                row["busy"] = _busy_list(d["busy"])
            except ValueError as exc:
                bad.append(str(exc))
        out.append((row, f"entry {_s(entry_id)}: {'; '.join(bad)}" if bad else None))
    return out


def _steps_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    if not rows:
        return _empty_steps()
    frame = pd.DataFrame(rows, columns=[*STEP_COLUMNS, "busy"])
    for c in _STEP_INTS:
        # Float → nullable int: NaN (missing field) becomes <NA>, not a bogus number.
        frame[c] = frame[c].where(np.isfinite(frame[c])).round().astype("Int64")
    return frame


#: Newest entries of the ``agg`` stream (KEYS[1]) for :class:`RankWindow`: ``XREVRANGE + - COUNT ARGV[1]``, of which
#: the newest ARGV[2] are returned and, older, only those whose ``step`` field is a multiple of ARGV[3] (the stride),
#: oldest first, each as its id and flat fields. The entries passed over never leave Redis. Read-only.
RANK_WINDOW_SCRIPT = """
local entries = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', tonumber(ARGV[1]))
local full, stride = tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i = #entries, 1, -1 do
  local e = entries[i]
  local keep = i <= full or stride <= 1
  if not keep then
    local f = e[2]
    for j = 1, #f, 2 do
      if f[j] == 'step' then
        local step = tonumber(f[j + 1])
        keep = step ~= nil and step % stride == 0
        break
      end
    end
  end
  if keep then out[#out + 1] = e end
end
return out
"""


class RankWindow:
    """The newest ``count`` entries of a run's ``agg`` stream with their per-rank ``busy`` lists, kept between
    refreshes (the Ranks page keeps one per session): a refresh reads only the entries added since the last.

    At 1,024 ranks an entry's ``busy`` list is ~13 kB of JSON, so re-reading 500 steps every 2 s moved ~6 MB per
    refresh; this reads them once, then the few new entries. With a budget of ``values`` busy values, a window
    larger than that at the run's ranks keeps every one of its newest ``full`` entries but, older, only those whose
    step is a multiple of :attr:`stride` (chosen so that the window holds about ``values`` values): at 1,024 ranks
    the 500-step window is ~2 MB read once instead of ~6.5 MB, its newest 100 steps (the rank table's) whole.

    Attributes
    ----------
    frame : pandas.DataFrame
        :func:`recent_steps`' frame of the entries held, oldest first.
    last_id : str or None
        The newest entry id read.
    stride : int
        1: every entry of the window is held; else only every ``stride``-th step older than the newest ``full``.
    reads : list of (str, str, int)
        ``(start, end, entries returned)`` of each read of the last :meth:`refresh` (none when nothing was new).
    """

    def __init__(self, run: str, count: int = defaults.DASHBOARD_STEPS, full: int = RANK_TABLE_STEPS,
                 values: int | None = None) -> None:
        self.run, self.count, self.full, self.values = run, count, full, values
        self.key = run_keys(run).agg
        self.reads: list[tuple[str, str, int]] = []
        self._clear()

    def _clear(self) -> None:
        self._rows: list[_StepRow] = []  # the window's entries, oldest first, with what in each cannot be read
        self.frame = _empty_steps()
        self.last_id: str | None = None
        self.stride = 1
        self._matrix: pd.DataFrame | None = None

    def _stride(self, n_ranks: Any) -> int:
        """The stride that keeps the window within :attr:`values` busy values at ``n_ranks`` ranks (1: no budget)."""
        ranks = _num(n_ranks)
        if self.values is None or not math.isfinite(ranks) or ranks * self.count <= self.values:
            return 1
        older = self.count - self.full  # entries beyond the newest `full`, and room for them within the budget
        room = max(1, int(self.values // max(1.0, ranks)) - self.full)
        return max(1, math.ceil(older / room))

    def _read_window(self, client: redis.Redis) -> list[tuple[Any, Any]]:
        """The window's entries as :data:`RANK_WINDOW_SCRIPT` reads them (every one when :attr:`stride` is 1)."""
        if self.stride <= 1:
            return list(reversed(client.xrevrange(self.key, count=self.count)))
        got = client.register_script(RANK_WINDOW_SCRIPT)(keys=[self.key], args=[self.count, self.full, self.stride])
        return [(entry_id, dict(zip(flat[::2], flat[1::2], strict=True))) for entry_id, flat in got]

    def _thin(self) -> None:
        """Past the newest :attr:`full`, keep only the rows of steps that are multiples of :attr:`stride`, within
        the window's newest :attr:`count` steps."""
        if self.stride <= 1 or len(self._rows) <= self.full:
            return
        newest = max(row["step"] for row, _ in self._rows[-self.full:] if row is not None) \
            if any(row is not None for row, _ in self._rows[-self.full:]) else math.inf
        older = [(row, why) for row, why in self._rows[:-self.full]
                 if row is None or (row["step"] % self.stride == 0 and row["step"] > newest - self.count)]
        self._rows = older + self._rows[-self.full:]

    def refresh(self, client: redis.Redis, problems: list[str] | None = None) -> RankWindow:
        """Bring the window up to date: the newest entry's id and ranks (:func:`project`: no ``busy`` list) and, when
        it is newer than :attr:`last_id`, ``XRANGE (last_id newest COUNT count`` (the first time, or when more than
        ``count`` entries are new or the stream went back: the window read anew, ``XREVRANGE … COUNT count`` or,
        with a stride, :data:`RANK_WINDOW_SCRIPT`). Unreadable entries of the window are reported in ``problems``
        on every call."""
        self.reads = []
        ids, values = project(client, self.run, ("n_ranks",), count=1, newest_first=True)
        if not ids:
            self._clear()
            return self
        tail = ids[0]
        if self.last_id is not None and _entry_id(tail) < _entry_id(self.last_id):
            self._clear()  # the stream was deleted and written again
        fresh = False
        if self.last_id is None:
            fresh = True
        elif tail != self.last_id:
            entries = client.xrange(self.key, "(" + self.last_id, tail, count=self.count)
            self.reads.append(("(" + self.last_id, tail, len(entries)))
            fresh = len(entries) >= self.count
        else:
            entries = []
        if fresh:
            self.stride = self._stride(values[0][0])
            entries = self._read_window(client)
            self.reads.append(("+", "-", len(entries)))
            self._rows = []
        if entries:
            self._rows = (self._rows + _step_rows(entries, True))[-self.count:]
            self._thin()
            self.frame = _steps_frame([row for row, _ in self._rows if row is not None])
            self.last_id = _s(entries[-1][0])
            self._matrix = None
        _report_rows(problems, self.key, self._rows)
        return self

    @property
    def matrix(self) -> pd.DataFrame:
        """:func:`busy_matrix` of the window (made once per change of the window)."""
        if self._matrix is None:
            self._matrix = busy_matrix(self.frame)
        return self._matrix


def busy_matrix(steps: pd.DataFrame) -> pd.DataFrame:
    """Rank × step matrix of busy seconds from :func:`recent_steps`' ``busy`` lists.

    Index ``rank`` (0..max world size seen − 1), columns ``step`` (ascending), float seconds,
    NaN where a rank did not report. A step present twice (replayed after a restart) keeps
    its newest entry, i.e. the generation that counted.
    """
    if steps.empty:
        return pd.DataFrame(index=pd.Index([], name="rank", dtype="int64"),
                            columns=pd.Index([], name="step", dtype="int64"), dtype="float64")
    latest = steps.drop_duplicates("step", keep="last").sort_values("step")
    width = max((len(b) for b in latest["busy"]), default=0)
    values = np.full((width, len(latest)), np.nan)
    for j, busy in enumerate(latest["busy"]):
        values[: len(busy), j] = busy
    return pd.DataFrame(values, index=pd.Index(range(width), name="rank"),
                        columns=pd.Index(latest["step"].astype("int64").to_numpy(), name="step"))


def rank_matrix(client: redis.Redis, run: str, count: int = defaults.DASHBOARD_STEPS,
                problems: list[str] | None = None) -> pd.DataFrame:
    """Rank × step DataFrame of busy seconds over the newest ``count`` aggregated steps.

    See :func:`busy_matrix` for the shape; one ``XREVRANGE`` of the ``agg`` stream
    (unreadable entries reported in ``problems``, as :func:`recent_steps` does).
    """
    return busy_matrix(recent_steps(client, run, count, problems=problems))


def rank_summary(matrix: pd.DataFrame, hosts: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per-rank median busy seconds and its ratio to the median rank's, slowest first.

    ``matrix`` is a :func:`busy_matrix`; ``hosts`` a :func:`rank_hosts` frame. Columns
    :data:`RANK_SUMMARY_COLUMNS`: ``rank``, ``host`` (None if unknown), ``median_busy_s``
    (s), ``ratio`` (rank median / median of all rank medians; 1.0 = typical, 1.5 = 50 %
    slower), ``score`` (the straggler detector's NVRx relative score: fastest rank's median /
    this rank's; 1.0 = as fast as the fastest, flagged below ``STRAGGLER_THRESHOLD``), ``steps`` (steps the rank
    reported). Ranks that never reported are dropped.
    """
    if matrix.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in RANK_SUMMARY_COLUMNS})
    med = matrix.median(axis=1, skipna=True)
    n = matrix.notna().sum(axis=1)
    typical = float(med.median(skipna=True))
    ratio = med / typical if typical > 0 else med * math.nan
    best = float(med[n > 0].min()) if (n > 0).any() else math.nan
    score = best / med.where(med > 0)
    out = pd.DataFrame({"rank": matrix.index.astype("int64"), "median_busy_s": med.to_numpy(),
                        "ratio": ratio.to_numpy(), "score": score.to_numpy(), "steps": n.to_numpy().astype("int64")})
    by_rank = pd.Series(dtype=object) if hosts is None or hosts.empty else hosts.set_index("rank")["host"]
    host = out["rank"].map(by_rank).astype(object)
    out["host"] = host.where(host.notna(), None)
    out = out[out["steps"] > 0]
    out = out.sort_values(["ratio", "rank"], ascending=[False, True], kind="stable").reset_index(drop=True)
    return out[RANK_SUMMARY_COLUMNS]


# --- events ------------------------------------------------------------------------------

def _read_events(client: redis.Redis, run: str, count: int, head: int = 0) -> list[tuple[str, Any]]:
    key = run_keys(run).events
    tail = client.xrevrange(key, count=count)
    entries = {_s(i): f for i, f in tail}
    if head:
        for i, f in client.xrange(key, count=head):
            entries.setdefault(_s(i), f)
    # Stream ids are "<ms>-<seq>": order numerically, not as strings.
    return sorted(entries.items(), key=lambda kv: tuple(int(p) for p in kv[0].split("-")))


def events(client: redis.Redis, run: str, count: int = EVENTS_SCAN_ENTRIES) -> pd.DataFrame:
    """Checkpoint save/load markers among the newest ``count`` events, one row per checkpoint.

    Every rank reports the same checkpoint, so rows are merged per (``kind``, ``step``):
    ``t`` is the earliest report (unix s), ``seconds`` the longest block over ranks (s, NaN
    when not reported), ``n_ranks`` how many ranks reported it. Columns :data:`EVENT_COLUMNS`,
    sorted by ``t``. One ``XREVRANGE … COUNT``; malformed entries are skipped.
    """
    rows = []
    for _id, fields in _read_events(client, run, count):
        kind = _s(fields.get(b"kind", fields.get("kind", "")))
        if kind not in CHECKPOINT_KINDS:
            continue
        try:
            ev = decode_event(fields)
        except (KeyError, ValueError):
            continue
        if ev.step is None:
            continue
        rows.append({"kind": ev.kind, "step": ev.step, "t": ev.t,
                     "seconds": math.nan if ev.seconds is None else ev.seconds, "rank": ev.rank})
    if not rows:
        frame = pd.DataFrame({c: pd.Series(dtype="float64") for c in EVENT_COLUMNS})
        return frame.astype({"kind": object, "step": "int64", "n_ranks": "int64"})
    raw = pd.DataFrame(rows)
    out = (raw.groupby(["kind", "step"], as_index=False)
              .agg(t=("t", "min"), seconds=("seconds", "max"), n_ranks=("rank", "nunique")))
    return out.sort_values(["t", "kind"], kind="stable").reset_index(drop=True)[EVENT_COLUMNS]


def checkpoints(client: redis.Redis, run: str, problems: list[str] | None = None) -> pd.DataFrame:
    """The run's checkpoint saves and loads as the detector service merged them over ranks (``checkpoints`` hash,
    detectors/checkpoints.py): one row per checkpoint, as :func:`events` gives them, without reading the events.

    Columns :data:`EVENT_COLUMNS`: ``kind``, ``step``, ``t`` (the earliest report, unix s), ``seconds`` (the longest
    block over ranks, s, NaN when not reported), ``n_ranks``; sorted by ``t``. One ``HGETALL`` of a few kB (the
    newest ``CHECKPOINTS_KEPT``). A mark that cannot be read is left out and, with ``problems``, reported.
    """
    key = run_keys(run).checkpoints
    rows, bad = [], []
    for name, raw in sorted((_s(f), v) for f, v in client.hgetall(key).items()):
        where = f"field {name!r}: "
        try:
            d = _json(raw)
        except (TypeError, ValueError):
            bad.append(f"{where}not JSON ({show_value(raw)})")
            continue
        if not isinstance(d, dict):
            bad.append(f"{where}not a JSON object but {show_value(d)}")
            continue
        why: list[str] = []
        kind = d.get("kind")
        if kind not in CHECKPOINT_KINDS:
            why.append(f"kind {show_value(kind)} is not a checkpoint kind")
        row = {"kind": kind, "step": _get_num(d, "step", why, bound=MAX_INT, integral=True),
               "t": _get_num(d, "t", why, finite=True, bound=MAX_TIME),
               "seconds": _get_num(d, "seconds", why, finite=True) if d.get("seconds") is not None else math.nan,
               "n_ranks": _get_num(d, "n_ranks", why, bound=MAX_RANKS, integral=True)}
        if why or any(math.isnan(row[c]) for c in ("step", "t", "n_ranks")):
            bad.append(where + ("; ".join(why) or f"incomplete ({show_value(raw)})"))
            continue
        rows.append(row)
    if bad:
        _report(problems, unreadable(key, "checkpoint", "checkpoints", bad))
    if not rows:
        frame = pd.DataFrame({c: pd.Series(dtype="float64") for c in EVENT_COLUMNS})
        return frame.astype({"kind": object, "step": "int64", "n_ranks": "int64"})
    out = pd.DataFrame(rows, columns=EVENT_COLUMNS).astype({"step": "int64", "n_ranks": "int64"})
    return out.sort_values(["t", "kind"], kind="stable").reset_index(drop=True)


def rank_hosts(client: redis.Redis, run: str, count: int = EVENTS_SCAN_ENTRIES,
               head: int = EVENTS_HEAD_ENTRIES, page: int = HOSTS_PAGE_ENTRIES) -> pd.DataFrame:
    """Host of each rank, from its newest ``run_start`` event (``host`` field).

    Reads the events newest first, ``page`` at a time, until every rank of the run (``world_size`` of the meta,
    and the ranks of the ``hb`` hash) has its ``run_start`` or ``count`` events were read; then, for ranks still
    without one, the oldest ``head`` events (the first launch's ``run_start`` records sit at the head of the
    stream). Only ``run_start`` entries are decoded (the ``kind`` field is compared as stored). Ranks without a
    ``run_start`` in that window fall back to the ``host`` of their heartbeat (``hb`` hash). Columns
    :data:`HOST_COLUMNS`, sorted by rank. The first page, the meta's ``world_size`` and the heartbeats are one
    pipelined round trip.
    """
    keys = run_keys(run)
    pipe = client.pipeline(transaction=False)
    pipe.hget(keys.meta, "world_size")
    pipe.hgetall(keys.heartbeats)
    pipe.xrevrange(keys.events, count=min(page, count))
    world, beats, entries = pipe.execute()
    beat_hosts: dict[int, str] = {}
    for rank, beat in beats.items():
        try:
            r, info = int(_s(rank)), _json(beat)
        except (TypeError, ValueError):
            continue
        if isinstance(info, dict) and info.get("host"):
            beat_hosts[r] = str(info["host"])
    ws = _num(world)
    wanted = set(beat_hosts) | (set(range(int(ws))) if math.isfinite(ws) and 0 < ws <= MAX_RANKS else set())
    hosts: dict[int, str] = {}

    def take(batch: list[tuple[Any, Any]]) -> None:  # newest first: a rank's first start seen is its newest
        for _id, fields in batch:
            if fields.get(b"kind", fields.get("kind")) not in (b"run_start", "run_start"):
                continue
            d = _decode_map(fields)
            try:
                rank = int(d["rank"])
            except (KeyError, ValueError):
                continue
            if d.get("host") and rank not in hosts:
                hosts[rank] = d["host"]

    read = len(entries)
    take(entries)
    while entries and len(entries) == page and read < count and (not wanted or wanted - hosts.keys()):
        entries = client.xrevrange(keys.events, max=_before(_s(entries[-1][0])), count=min(page, count - read))
        read += len(entries)
        take(entries)
    if head and (not wanted or wanted - hosts.keys()):
        take(list(reversed(client.xrange(keys.events, count=head))))
    for r, host in beat_hosts.items():
        hosts.setdefault(r, host)
    frame = pd.DataFrame(sorted(hosts.items()), columns=HOST_COLUMNS)
    return frame.astype({"rank": "int64", "host": object})


def _before(entry_id: str) -> str:
    """The stream id right before ``entry_id`` (``XREVRANGE``'s exclusive ``(`` needs Redis 6.2)."""
    ms, _, seq = entry_id.partition("-")
    if int(seq or 0) > 0:
        return f"{ms}-{int(seq) - 1}"
    return f"{int(ms) - 1}-{2**64 - 1}" if int(ms) > 0 else "0-0"


# --- anomalies ---------------------------------------------------------------------------

def _anomaly_row(field: str, a: Mapping[str, Any], bad: list[str]) -> dict[str, Any]:
    """One :func:`anomalies` row; values of the wrong type are left blank and noted in ``bad``."""
    ranks = a.get("ranks") or []
    if not (isinstance(ranks, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in ranks)):
        bad.append(f"ranks {show_value(ranks)} is not a list of rank numbers")
        ranks = []
    hosts = a.get("hosts") or []
    if not isinstance(hosts, list):
        bad.append(f"hosts {show_value(hosts)} is not a list")
        hosts = []
    evidence = a.get("evidence") or {}
    if not isinstance(evidence, dict):
        bad.append(f"evidence {show_value(evidence)} is not an object")
        evidence = {}
    ident = a.get("id")
    if isinstance(ident, bool) or (ident is not None and not isinstance(ident, (str, int))):
        bad.append(f"id {show_value(ident)} is not a string")
        ident = None
    return {
        "id": field if ident is None else str(ident), "kind": _get_str(a, "kind", bad),
        "severity": _get_str(a, "severity", bad), "status": _get_str(a, "status", bad),
        "step": _get_num(a, "step", bad, bound=MAX_INT, integral=True),
        "end_step": _get_num(a, "end_step", bad, bound=MAX_INT, integral=True),
        "ranks": ranks, "hosts": [str(x) for x in hosts], "message": _get_str(a, "message", bad) or "",
        "first_seen": _get_num(a, "first_seen", bad, finite=True, bound=MAX_TIME),
        "last_seen": _get_num(a, "last_seen", bad, finite=True, bound=MAX_TIME), "evidence": evidence,
    }


def _hash_objects(client: redis.Redis, key: str) -> tuple[list[tuple[str, dict]], list[str]]:
    """The JSON objects of hash ``key`` by field (in field order), and why the other fields were skipped."""
    objects: list[tuple[str, dict]] = []
    skipped: list[str] = []
    for field, raw in sorted((_s(f), v) for f, v in client.hgetall(key).items()):
        try:
            d = _json(raw)
        except (TypeError, ValueError):
            skipped.append(f"field {field!r}: not JSON")
            continue
        if not isinstance(d, dict):
            skipped.append(f"field {field!r}: not a JSON object but {show_value(d)}")
            continue
        objects.append((field, d))
    return objects, skipped


def anomalies(client: redis.Redis, run: str, problems: list[str] | None = None) -> pd.DataFrame:
    """All anomalies of the run (``anomalies`` hash): active first, then by severity (critical,
    warning, info), then newest first.

    Columns :data:`ANOMALY_COLUMNS`: ``step`` / ``end_step`` nullable ints (``end_step`` is
    set once resolved), ``ranks`` list[int], ``hosts`` list[str], ``evidence`` dict,
    ``first_seen`` / ``last_seen`` unix s. "Newest" orders by ``first_seen`` descending (the
    id breaks ties, so the order is deterministic). Values that are not a JSON object are
    skipped, values of the wrong type within one are blank (None/NaN/empty); with ``problems``,
    both are reported there (by hash field, in field order).
    """
    key = run_keys(run).anomalies
    rows = []
    partly: list[str] = []
    objects, skipped = _hash_objects(client, key)
    for field, a in objects:
        bad: list[str] = []
        rows.append(_anomaly_row(field, a, bad))
        if bad:
            partly.append(f"field {field!r}: {'; '.join(bad)}")
    if skipped:
        _report(problems, unreadable(key, "anomaly", "anomalies", skipped))
    if partly:
        _report(problems, unreadable(key, "anomaly", "anomalies", partly, partly=True))
    # Active first, then the most severe (a slow step, info, must not push a loss spike out of view), newest (a
    # missing first_seen last), the id breaking ties: sorted here, a few rows, before the frame is made.
    def order(row: dict[str, Any]) -> tuple:
        seen = _num(row["first_seen"])
        return (row["status"] != "active", _SEVERITY_ORDER.get(row["severity"], 3), math.isnan(seen),
                -seen if not math.isnan(seen) else 0.0, str(row["id"]))

    frame = pd.DataFrame(sorted(rows, key=order), columns=ANOMALY_COLUMNS)
    for c in ("step", "end_step"):
        frame[c] = pd.to_numeric(frame[c]).astype("float64")
        frame[c] = frame[c].where(np.isfinite(frame[c])).round().astype("Int64")
    for c in ("first_seen", "last_seen"):
        frame[c] = frame[c].astype("float64")
    return frame


# --- incidents -------------------------------------------------------------------------

#: Incident fields that are lists, and of what.
_INC_LISTS = {"ranks": int, "hosts": str, "anomalies": str}


def _incident(field: str, d: Mapping[str, Any], bad: list[str]) -> dict[str, Any]:
    """One :func:`incidents` dict; a field of the wrong type is blank and noted in ``bad``."""
    out: dict[str, Any] = {"id": field}
    for name in ("kind", "title", "severity", "status", "recommendation"):
        out[name] = _get_str(d, name, bad)
    for name in ("onset_step", "end_step", "gen"):
        x = _get_num(d, name, bad, bound=MAX_INT, integral=True)
        out[name] = int(x) if math.isfinite(x) else None
    for name in ("onset_t", "first_seen", "last_seen"):
        out[name] = _opt_num(_get_num(d, name, bad, finite=True, bound=MAX_TIME))
    for name in ("badput_s", "badput_s_per_hour"):
        x = _get_num(d, name, bad, finite=True)
        out[name] = x if math.isfinite(x) and x >= 0 else None
    for name, typ in _INC_LISTS.items():
        v = d.get(name) or []
        if not (isinstance(v, list) and all(isinstance(x, typ) and not isinstance(x, bool) for x in v)):
            bad.append(f"{name} {show_value(v)} is not a list of {'rank numbers' if typ is int else 'strings'}")
            v = []
        out[name] = list(v)
    out["gen"] = out["gen"] or 0
    return out


def incidents(client: redis.Redis, run: str, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """Every incident of the run (``th:{run}:incidents``, one ``HGETALL``): active first, then by severity
    (critical, warning, info), then the newest onset first.

    The dicts as the service stores them (:meth:`trainhealth.detectors.incidents.Incident.to_dict` plus
    ``first_seen``/``last_seen``, unix s): ``onset_step``/``end_step`` int or None, ``gen`` int, ``ranks``
    list[int], ``hosts`` and ``anomalies`` list[str], ``badput_s`` (seconds of the job's time so far) and
    ``badput_s_per_hour`` (seconds of it per hour while it lasts) float or None. A value that is not a JSON object
    is skipped; a field of the wrong type is blank; with ``problems`` both are reported there. An incident
    without ``status`` or ``severity`` is kept, last.
    """
    key = run_keys(run).incidents
    objects, skipped = _hash_objects(client, key)
    out, partly = [], []
    for field, d in objects:
        bad: list[str] = []
        out.append(_incident(field, d, bad))
        if bad:
            partly.append(f"field {field!r}: {'; '.join(bad)}")
    if skipped:
        _report(problems, unreadable(key, "incident", "incidents", skipped))
    if partly:
        _report(problems, unreadable(key, "incident", "incidents", partly, partly=True))

    def order(i: dict[str, Any]) -> tuple:
        t = i["onset_t"] if i["onset_t"] is not None else (i["first_seen"] or 0.0)
        return (i["status"] != "active", _SEVERITY_ORDER.get(i["severity"] or "", 3), -t,
                -(i["onset_step"] or 0), i["id"])

    return sorted(out, key=order)


# --- goodput ledger ----------------------------------------------------------------------

#: Snapshot keys that are numbers (None = not known), and those of them that are whole numbers.
_SNAP_NUMBERS = ("t", "started_at", "wall_s", "world_size", "gpu_hour_usd", "last_step", "steps_done", "steps_good",
                 "restarts", "tokens_total", "tokens_good", "step_s", "throughput_tok_s", "goodput_tok_s",
                 "goodput_pct", "badput_cost_usd")
_SNAP_INTS = ("world_size", "last_step", "steps_done", "steps_good", "restarts", "tokens_total", "tokens_good")
#: Snapshot keys that map names to numbers (``cost_usd`` is None without a price).
_SNAP_MAPS = ("seconds", "gpu_hours", "cost_usd", "custom_by_name")


def clean_snapshot(snap: Mapping[str, Any], bad: list[str]) -> dict[str, Any]:
    """A ledger snapshot with every value the dashboard reads of the documented type.

    A value of the wrong type is dropped (read as "not known") and noted in ``bad``; whole
    numbers become ints, other numbers floats; keys the dashboard does not read are kept as they are.
    """
    out: dict[str, Any] = dict(snap)
    for name in _SNAP_NUMBERS:
        if snap.get(name) is None:
            continue
        integral = name in _SNAP_INTS
        times = name in ("t", "started_at")
        n = len(bad)
        x = _get_num(snap, name, bad, finite=integral or times, integral=integral,
                     bound=MAX_TIME if times else MAX_INT if integral else math.inf)
        if len(bad) > n:
            del out[name]
        else:
            out[name] = int(x) if integral else x
    for name in _SNAP_MAPS:
        value = snap.get(name)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            bad.append(f"{name} {show_value(value)} is not an object")
            del out[name]
            continue
        entries: dict[str, float] = {}
        for k in value:
            n = len(bad)
            x = _get_num(value, k, bad)
            if len(bad) > n:
                bad[-1] = f"{name}.{bad[-1]}"  # name the map the entry is in
            else:
                entries[str(k)] = x
        out[name] = entries
    rates = snap.get("rates")
    if rates is not None:
        clean: dict[str, dict[str, float]] = {}
        if not isinstance(rates, Mapping):
            bad.append(f"rates {show_value(rates)} is not an object")
        else:
            for w, rate in rates.items():
                if not isinstance(rate, Mapping):
                    bad.append(f"rates.{w} {show_value(rate)} is not an object")
                    continue
                clean[str(w)] = {}
                for k in rate:
                    n = len(bad)
                    x = _get_num(rate, k, bad)
                    if len(bad) > n:
                        bad[-1] = f"rates.{w}.{bad[-1]}"
                    else:
                        clean[str(w)][str(k)] = x
        out["rates"] = clean
    return out


def ledger_latest(client: redis.Redis, run: str, problems: list[str] | None = None) -> dict[str, Any] | None:
    """The newest goodput ledger snapshot (``ledger:latest``) as a dict, or None if none yet.

    Keys as documented: ``t``/``started_at`` (unix s), ``wall_s`` (s), ``throughput_tok_s`` and
    ``goodput_tok_s`` (tokens/s since start), ``goodput_pct`` (% of wall time productive),
    ``seconds`` / ``gpu_hours`` / ``cost_usd`` per category, ``badput_cost_usd`` (None when no
    GPU-hour price is set). Values of the wrong type are dropped (:func:`clean_snapshot`); with
    ``problems``, a snapshot that is not a JSON object (None is returned) or such values are
    reported there.
    """
    key = run_keys(run).ledger_latest
    raw = client.get(key)
    if raw is None:
        return None
    try:
        snap = _json(raw)
    except (TypeError, ValueError):
        _report(problems, f"{key} is unreadable: not JSON ({show_value(raw)})")
        return None
    if not isinstance(snap, dict):
        _report(problems, f"{key} is unreadable: not a JSON object but {show_value(snap)}")
        return None
    bad: list[str] = []
    snap = clean_snapshot(snap, bad)
    if bad:
        _report(problems, f"{key} has unreadable values, shown as missing: {'; '.join(bad)}")
    return snap


def history_row(snap: Mapping[str, Any]) -> dict[str, Any]:
    """One :func:`ledger_history` row from a ledger snapshot dict (floats, NaN where absent).

    Also a ``seconds.<name>`` entry for every category the snapshot has beyond
    :data:`LEDGER_CATEGORIES` (a category added to the ledger later).
    """
    row: dict[str, Any] = {c: _num(snap.get(c)) for c in LEDGER_COLUMNS}
    seconds = snap.get("seconds") or {}
    if not isinstance(seconds, Mapping):
        seconds = {}
    row.update({f"seconds.{c}": _num(seconds.get(c)) for c in LEDGER_CATEGORIES})
    row.update({f"seconds.{c}": _num(v) for c, v in seconds.items() if c not in LEDGER_CATEGORIES})
    rates = snap.get("rates") or {}
    for w in RATE_WINDOWS:
        rate = rates.get(w) if isinstance(rates, Mapping) else None
        rate = rate if isinstance(rate, Mapping) else {}
        for v in ("throughput_tok_s", "goodput_tok_s"):
            row[f"rate.{w}.{v}"] = _num(rate.get(v))
    return row


def _history_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    base = [*LEDGER_COLUMNS, *(f"seconds.{c}" for c in LEDGER_CATEGORIES), *RATE_COLUMNS]
    extra = sorted({k for row in rows for k in row if k not in base})
    frame = pd.DataFrame(rows, columns=[*base, *extra], dtype="float64")
    return frame.fillna({c: 0.0 for c in extra})  # an added category was 0 s before it existed


def _thin(n: int, max_points: int | None) -> list[int]:
    """Indices of ``n`` items to keep: all, or ``max_points`` evenly spaced with the first and last."""
    if max_points is None or n <= max_points:
        return list(range(n))
    if max_points < 2:
        return [n - 1]
    return sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})


#: What a ledger snapshot's history row is made of (:func:`history_row`): every path of the snapshot a history
#: frame has. A page that draws less passes its own paths (``("t", "throughput_tok_s", "goodput_tok_s")``).
HISTORY_PATHS = (*LEDGER_COLUMNS, "seconds", "rates")

#: Samples a ledger stream (KEYS[1]) in Redis and sends only the parts of each sampled snapshot the charts draw.
#: ARGV: ``whole`` or ``newest``, the most points, the newest entries (``newest`` only), then the snapshot paths to
#: keep (``t``, ``seconds``: the whole map, ``rates.60s``: one window). ``whole``: a stream of at most that many
#: entries whole, else the first entry at or after each of that many evenly spaced times (entry ids, ms) from the
#: oldest to the newest, and the newest. ``newest``: the newest entries, thinned to that many evenly spaced (the
#: oldest and the newest kept). Python's rounding (half to even) places the samples, so both read the same
#: entries. Per entry kept, oldest first: its id and its ``json`` field's paths as a JSON object (numbers as
#: ``%.17g``, the double exactly; NaN and infinities as Python's json writes them), or, for an entry without a
#: ``json`` field, ``!`` alone, and for a ``json`` that is no JSON object, ``!`` and the field. Read-only.
LEDGER_SAMPLE_SCRIPT = """
local mode, points = ARGV[1], tonumber(ARGV[2])
local function round(x)  -- half to even, as Python's round()
  local r = math.floor(x + 0.5)
  if r - x == 0.5 and r % 2 == 1 then r = r - 1 end
  return r
end
local entries = {}
if mode == 'whole' then
  if redis.call('XLEN', KEYS[1]) <= points then
    entries = redis.call('XRANGE', KEYS[1], '-', '+')
  else
    local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
    local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
    local t0 = tonumber(string.match(first[1], '^(%d+)'))
    local t1 = tonumber(string.match(last[1], '^(%d+)'))
    local seen = nil
    for i = 0, points - 2 do
      local at = round(t0 + (t1 - t0) * i / math.max(1, points - 1))
      local got = redis.call('XRANGE', KEYS[1], string.format('%.0f', at), '+', 'COUNT', 1)[1]
      if got and got[1] ~= seen then entries[#entries + 1] = got; seen = got[1] end
    end
    if last[1] ~= seen then entries[#entries + 1] = last end
  end
elseif mode == 'newest' then
  local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', tonumber(ARGV[3]))
  local n = #newest
  local keep, last = {}, -1
  if n <= points then
    for i = 0, n - 1 do keep[#keep + 1] = i end
  elseif points < 2 then
    keep[1] = n - 1
  else
    for i = 0, points - 1 do
      local j = round(i * (n - 1) / (points - 1))
      if j ~= last then keep[#keep + 1] = j; last = j end
    end
  end
  for _, j in ipairs(keep) do entries[#entries + 1] = newest[n - j] end
else
  return redis.error_reply('whole or newest only')
end

local function num(v)
  if v ~= v then return 'NaN' elseif v == math.huge then return 'Infinity' elseif v == -math.huge then
    return '-Infinity' end
  return string.format('%.17g', v)
end
local encode
encode = function(v)
  local kind = type(v)
  if kind == 'number' then return num(v) end
  if kind == 'string' or kind == 'boolean' then return cjson.encode(v) end
  if kind ~= 'table' then return 'null' end  -- cjson.null
  local parts = {}
  if #v > 0 then
    for _, x in ipairs(v) do parts[#parts + 1] = encode(x) end
    return '[' .. table.concat(parts, ',') .. ']'
  end
  for k, x in pairs(v) do parts[#parts + 1] = cjson.encode(tostring(k)) .. ':' .. encode(x) end
  return '{' .. table.concat(parts, ',') .. '}'
end

local out = {}
for _, e in ipairs(entries) do
  local body = nil
  local f = e[2]
  for j = 1, #f, 2 do if f[j] == 'json' then body = f[j + 1] end end
  out[#out + 1] = e[1]
  if body == nil then
    out[#out + 1] = '!'
  else
    local ok, snap = pcall(cjson.decode, body)
    if not ok or type(snap) ~= 'table' or (#snap > 0) or next(snap) == nil and string.match(body, '^%s*%[') then
      out[#out + 1] = '!' .. body
    else
      local kept = {}
      for i = 4, #ARGV do
        local path, src, dst, name = ARGV[i], snap, kept, nil
        for part in string.gmatch(path, '[^.]+') do
          if name ~= nil then
            if type(src) ~= 'table' then src = nil; break end
            if type(dst[name]) ~= 'table' then dst[name] = {} end
            dst = dst[name]
          end
          src, name = src[part], part
          if src == nil then break end
        end
        if src ~= nil and name ~= nil then dst[name] = src end
      end
      out[#out + 1] = encode(kept)
    end
  end
end
return out
"""


def _ledger_sample(client: redis.Redis, run: str, mode: str, points: int, count: int,
                   paths: Iterable[str], problems: list[str] | None) -> pd.DataFrame:
    """One :data:`LEDGER_SAMPLE_SCRIPT` call, as a :func:`ledger_history` frame (what cannot be read reported)."""
    key = run_keys(run).ledger
    flat = client.register_script(LEDGER_SAMPLE_SCRIPT)(keys=[key], args=[mode, points, count, *paths])
    entries = []
    for entry_id, body in zip(flat[::2], flat[1::2], strict=True):
        body = _s(body)
        entries.append((entry_id, {} if body == "!" else {"json": body[1:]} if body.startswith("!") else
                        {"json": body}))
    return _ledger_frame(key, entries, problems)


def ledger_history(client: redis.Redis, run: str, count: int = LEDGER_HISTORY_ENTRIES,
                   max_points: int | None = None, problems: list[str] | None = None,
                   paths: Iterable[str] = HISTORY_PATHS) -> pd.DataFrame:
    """The newest ``count`` ledger snapshots (``ledger`` stream, field ``json``), oldest first.

    Columns :data:`LEDGER_COLUMNS` (floats; NaN where a snapshot lacks the value), one
    ``seconds.<category>`` column (s of wall time, cumulative since the run started) per
    category of :data:`LEDGER_CATEGORIES` and any category a snapshot adds, and
    :data:`RATE_COLUMNS` (the rolling 1 min / 10 min / 1 h rates, tokens/s).

    One :data:`LEDGER_SAMPLE_SCRIPT` call: with ``max_points``, a longer history is thinned in Redis to that many
    evenly spaced snapshots (the oldest and the newest always kept): the snapshots are cumulative, so dropping some
    loses resolution, not totals. Only the snapshot ``paths`` are sent (the others' columns are NaN): a page that
    draws three numbers reads three numbers of each snapshot, not its ~2 kB. Entries that are not a JSON object are
    skipped, values of the wrong type are NaN; with ``problems``, both are reported there.
    """
    points = count if max_points is None else min(max_points, count)
    return _ledger_sample(client, run, "newest", max(1, points), count, paths, problems)


def _ledger_frame(key: str, entries: list[tuple[Any, Any]], problems: list[str] | None) -> pd.DataFrame:
    """The :func:`ledger_history` frame of ledger stream ``entries`` (oldest first)."""
    rows = []
    skipped: list[str] = []
    partly: list[str] = []
    for entry_id, fields in entries:
        d = {_s(k): v for k, v in fields.items()}
        where = f"entry {_s(entry_id)}"
        if "json" not in d:
            skipped.append(f"{where}: no json field")
            continue
        try:
            snap = _json(d["json"])
        except (TypeError, ValueError):
            skipped.append(f"{where}: not JSON ({show_value(d['json'])})")
            continue
        if not isinstance(snap, dict):
            skipped.append(f"{where}: not a JSON object but {show_value(snap)}")
            continue
        bad: list[str] = []
        rows.append(history_row(clean_snapshot(snap, bad)))
        if bad:
            partly.append(f"{where}: {'; '.join(bad)}")
    if skipped:
        _report(problems, unreadable(key, "snapshot", "snapshots", skipped))
    if partly:
        _report(problems, unreadable(key, "snapshot", "snapshots", partly, partly=True))
    return _history_frame(rows)


def with_latest(history: pd.DataFrame, snap: Mapping[str, Any] | None) -> pd.DataFrame:
    """``history`` with the snapshot ``snap`` (``ledger:latest``) appended when it is newer than its last row.

    Lets a page read the (slow, cached) history less often than the latest snapshot and
    still end its charts at the KPIs' values.
    """
    if not snap:
        return history
    t = _num(snap.get("t"))
    if not math.isfinite(t) or (not history.empty and t <= history["t"].iloc[-1]):
        return history
    return _history_frame([*history.to_dict("records"), history_row(snap)])


def badput_by_cause(snapshot: Mapping[str, Any] | None) -> pd.DataFrame:
    """What each cause of badput cost: one row per badput category of a ledger snapshot (all but :data:`NOT_BADPUT`).

    Columns :data:`CAUSE_COLUMNS`: ``category`` (the row's name), ``ledger_category`` (the
    ledger category it belongs to: ``custom`` for the custom names), ``seconds`` (s of wall
    time), ``gpu_hours`` (``seconds × world_size / 3600``, from the snapshot's ``gpu_hours``),
    ``cost_usd`` (USD, NaN when no price is set); sorted by seconds descending, categories
    absent from the snapshot at 0 s. The ``custom`` category is split by the names in
    ``custom_by_name`` (the names given to ``Monitor.badput``: ``evaluation``,
    ``profiling``…), one row each, named ``custom: <name>`` only when the name collides with a
    category; custom seconds no name covers stay a ``custom`` row, and GPU-hours and cost are
    split in proportion to the seconds.
    """
    if not snapshot:
        return pd.DataFrame({c: pd.Series(dtype=object if c in ("category", "ledger_category") else "float64")
                             for c in CAUSE_COLUMNS})
    seconds = snapshot.get("seconds") or {}
    costs = snapshot.get("cost_usd") or {}
    hours = snapshot.get("gpu_hours") or {}
    by_name = snapshot.get("custom_by_name") or {}
    names: Iterable[str] = [c for c in LEDGER_CATEGORIES if c not in NOT_BADPUT]
    names = [*names, *sorted(k for k in seconds if k not in LEDGER_CATEGORIES)]
    world = _num(snapshot.get("world_size"))

    def gpu_hours(c: str, sec: float) -> float:
        # Written by the ledger; recomputed for a snapshot without them (same definition).
        return _num(hours[c]) if c in hours else sec * world / 3600.0

    rows = []
    for c in names:
        sec = _num(seconds.get(c, 0.0))
        rows.append({"category": c, "ledger_category": c, "seconds": sec, "gpu_hours": gpu_hours(c, sec),
                     "cost_usd": _num(costs.get(c))})
    if isinstance(by_name, Mapping) and by_name:
        custom = rows.pop(names.index("custom"))
        total = custom["seconds"]

        def part(sec: float) -> dict[str, float]:
            share = sec / total if total > 0 else math.nan
            return {"seconds": sec, "gpu_hours": custom["gpu_hours"] * share, "cost_usd": custom["cost_usd"] * share}

        named = 0.0
        for name, v in by_name.items():
            sec = _num(v)
            if not math.isfinite(sec):
                continue
            named += sec
            label = f"custom: {name}" if name in names else str(name)
            rows.append({"category": label, "ledger_category": "custom", **part(sec)})
        if total - named > 1e-3:  # custom seconds without a name (rounding stays far below a ms)
            rows.append({"category": "custom", "ledger_category": "custom", **part(total - named)})
    out = pd.DataFrame(rows, columns=CAUSE_COLUMNS)
    return out.sort_values("seconds", ascending=False, kind="stable").reset_index(drop=True)


def badput_seconds(snapshot: Mapping[str, Any] | None) -> pd.DataFrame:
    """Badput breakdown of a ledger snapshot: :func:`badput_by_cause` with columns ``category``,
    ``seconds`` (s of wall time) and ``cost_usd`` (USD or NaN when no price is set)."""
    return badput_by_cause(snapshot)[["category", "seconds", "cost_usd"]]


def has_token_counts(snapshot: Mapping[str, Any] | None) -> bool:
    """False when the run reported no tokens (``tokens_total`` 0, e.g. a log without token counts):
    throughput and goodput in tokens/s mean nothing then."""
    if not snapshot:
        return True  # nothing known yet: the KPIs show "—"
    tokens = _num(snapshot.get("tokens_total"))
    return not (math.isfinite(tokens) and tokens <= 0)


# --- rollback recommendations ----------------------------------------------------------------

#: Fields of a stored recommendation the card reads, by type (each may also be null).
_REC_STRINGS = ("id", "action", "status", "kind", "summary")
_REC_INTS = ("checkpoint_step", "recheck_step", "onset_step", "current_step", "recompute_steps")
_REC_RANGES = ("skip_steps", "skip_samples", "skip_batches")
_REC_COSTS = ("cost", "continue_cost")
_REC_COST_NUMBERS = ("gpu_hours", "usd", "wall_hours", "gpu_hours_per_hour", "usd_per_hour", "wasted_steps_so_far")
#: Longest skip range a card shows: Megatron's ``--iterations-to-skip`` lists every step of it.
MAX_SKIP_STEPS = 1_000_000


def recommendation_problems(d: Mapping[str, Any]) -> list[str]:
    """What in a stored recommendation is not of the type the card needs (empty when it can be shown)."""
    bad: list[str] = []
    for name in _REC_STRINGS:
        _get_str(d, name, bad)
    for name in _REC_INTS:
        if d.get(name) is not None and not (isinstance(d[name], int) and not isinstance(d[name], bool)):
            bad.append(f"{name} {show_value(d[name])} is not a whole number")
    for name in ("created_at", "updated_at"):
        if d.get(name) is not None and (isinstance(d[name], bool) or not isinstance(d[name], (int, float))):
            bad.append(f"{name} {show_value(d[name])} is not a number")
    for name in _REC_RANGES:
        v = d.get(name)
        if v is None:
            continue
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                and v[0] <= v[1] and (name != "skip_steps" or v[1] - v[0] < MAX_SKIP_STEPS)):
            bad.append(f"{name} {show_value(v)} is not a range [first, last]")
    for name in _REC_COSTS:
        v = d.get(name)
        if v is None:
            continue
        if not isinstance(v, Mapping):
            bad.append(f"{name} {show_value(v)} is not an object")
            continue
        for k in _REC_COST_NUMBERS:
            x = v.get(k)
            if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
                bad.append(f"{name}.{k} {show_value(x)} is not a number")
    history = d.get("history")
    if history is not None and not (isinstance(history, list) and all(
            isinstance(h, Mapping) and (h.get("t") is None or isinstance(h["t"], (int, float))) for h in history)):
        bad.append(f"history {show_value(history)} is not a list of status changes")
    for name in ("reasoning", "options"):
        v = d.get(name)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            bad.append(f"{name} {show_value(v)} is not a list of strings")
    return bad


def recommendations(client: redis.Redis, run: str, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """Every stored recommendation of the run (``recommendations`` hash), newest update first.

    The dicts as the service stores them (``Recommendation.to_dict()`` plus ``status``,
    ``history``, ``created_at``, ``updated_at``); one ``HGETALL``. Values that are not a JSON
    object, or whose fields are not of the documented types (:func:`recommendation_problems`),
    are skipped and, with ``problems``, reported there; the others are still returned.
    """
    key = run_keys(run).recommendations
    recs = []
    objects, skipped = _hash_objects(client, key)
    for field, d in objects:
        bad = recommendation_problems(d)
        if bad:
            skipped.append(f"field {field!r}: {'; '.join(bad)}")
            continue
        recs.append(d)
    if skipped:
        _report(problems, unreadable(key, "recommendation", "recommendations", skipped))
    return sorted(recs, key=lambda d: d.get("updated_at") or 0.0, reverse=True)


def skip_export(client: redis.Redis, run: str, rec: Mapping[str, Any]) -> str | None:
    """The text of recommendation ``rec``'s ``skip.json`` (:func:`trainhealth.samples.dumps` of its
    :class:`~trainhealth.samples.SkipDocument`: one ``XRANGE`` of ``th:{run}:samples`` over the skipped steps), None
    without a skip range."""
    doc = samples.read_skip(client, run, rec)
    return None if doc is None else samples.dumps(doc)


def skip_indices_export(client: redis.Redis, run: str, rec: Mapping[str, Any]) -> str | None:
    """The sample indices recommendation ``rec`` skips, one a line (:func:`trainhealth.samples.skip_list`), None when
    none were logged."""
    doc = samples.read_skip(client, run, rec)
    return None if doc is None else samples.skip_list(doc)


def skip_indices_logged(client: redis.Redis, run: str, rec: Mapping[str, Any]) -> bool:
    """Whether any step recommendation ``rec`` skips has sample indices stored (one ``XRANGE … COUNT 1``)."""
    return samples.any_logged(client, run, rec)


def open_recommendations(recs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The recommendations still waiting for a decision (``proposed`` or ``acknowledged``), newest
    proposal first (by ``created_at``; the service bumps ``updated_at`` whenever it refreshes the figures)."""
    active = [dict(d) for d in recs if d.get("status") in OPEN_RECOMMENDATION_STATUSES]

    def created(d: Mapping[str, Any]) -> float:
        t = _num(d.get("created_at"))
        return t if math.isfinite(t) else -math.inf

    return sorted(active, key=created, reverse=True)


# --- which steps the rank table summarises ---------------------------------------------------

def rank_table_window(matrix: pd.DataFrame, anomalies: pd.DataFrame | None = None,
                      steps: int = RANK_TABLE_STEPS) -> tuple[pd.DataFrame, int | None]:
    """The recent columns of a :func:`busy_matrix` that the rank table summarises.

    The last ``steps`` steps, or fewer: when an active straggler began inside that span, only
    the steps since its onset (the newest onset if several), so its slowdown is not averaged
    with the healthy steps before it. Returns the sub-matrix and the onset step used (None
    when the window is simply the last ``steps``).
    """
    if matrix.shape[1] == 0:
        return matrix, None
    recent = matrix.iloc[:, -steps:]
    onset = None
    if anomalies is not None and not anomalies.empty:
        active = anomalies[(anomalies["status"] == "active") & (anomalies["kind"] == "straggler")]
        onsets = [int(s) for s in active["step"] if pd.notna(s)]
        if onsets and max(onsets) > int(recent.columns[0]) and max(onsets) <= int(recent.columns[-1]):
            onset = max(onsets)
            recent = recent.loc[:, recent.columns >= onset]
    return recent, onset


def has_rank_timings(matrix: pd.DataFrame) -> bool:
    """True when at least one rank reported section (busy) time in the matrix's steps."""
    return bool(matrix.size) and bool(np.isfinite(matrix.to_numpy(dtype="float64")).any())


# --- detector service health -----------------------------------------------------------------

def service_heartbeats(client: redis.Redis) -> list[dict[str, Any]]:
    """Heartbeats of the detector services (``th:service:*``), newest first.

    Each a dict ``consumer`` (the key's suffix), ``t`` (unix s, NaN if missing), ``host``,
    ``pid``, ``runs``, ``processed`` as the service wrote them. One ``SCAN`` walk over the
    keyspace with ``MATCH th:service:*`` (every primary's, on Redis Cluster) and one pipeline of
    ``GET``s (not ``MGET``: the keys are in many slots); keys that expired in between or do not
    decode are skipped.
    """
    keys = list(client.scan_iter(match=SERVICE_HEARTBEAT_PATTERN, count=SERVICE_SCAN_COUNT))
    if not keys:
        return []
    out = []
    prefix = len(SERVICE_HEARTBEAT_PATTERN) - 1
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    for key, raw in zip(keys, pipe.execute(), strict=True):
        if raw is None:
            continue
        try:
            beat = _json(raw)
        except (TypeError, ValueError):
            continue
        if not isinstance(beat, dict):
            continue
        out.append({**beat, "consumer": _s(key)[prefix:], "t": _num(beat.get("t"))})
    return sorted(out, key=lambda b: -b["t"] if math.isfinite(b["t"]) else math.inf)


def service_running(heartbeats: list[dict[str, Any]], now: float, stale_s: float = SERVICE_STALE_S) -> bool:
    """True when the newest service heartbeat is at most ``stale_s`` seconds old at ``now``."""
    ts = [b["t"] for b in heartbeats if math.isfinite(b.get("t", math.nan))]
    return bool(ts) and now - max(ts) <= stale_s


def detector_errors(heartbeats: list[dict[str, Any]], run: str, now: float,
                    stale_s: float = SERVICE_STALE_S) -> dict[str, int]:
    """Exceptions raised by ``run``'s detectors, by detector class name, as the live services report them.

    From the ``detector_errors`` field (``{run: {name: count}}``) of the heartbeats at most
    ``stale_s`` seconds old at ``now``; counts of several services (a run handed over) are summed.
    Malformed fields are skipped.
    """
    out: dict[str, int] = {}
    for beat in heartbeats:
        if not (math.isfinite(beat.get("t", math.nan)) and now - beat["t"] <= stale_s):
            continue
        per_run = beat.get("detector_errors")
        errors = per_run.get(run) if isinstance(per_run, dict) else None
        if not isinstance(errors, dict):
            continue
        for name, n in errors.items():
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                out[str(name)] = out.get(str(name), 0) + n
    return out


#: The banner's reduction of a run's heartbeats (``hb`` hash, KEYS[1]) and newest aggregate (``agg`` stream,
#: KEYS[2]), in Redis: the highest ``step`` and ``step_t`` and the lowest ``inc`` over the heartbeats that are JSON
#: objects (finite numbers, or strings of them, as :func:`_num` reads them; anything else is passed over), each as a
#: decimal string (``%.17g``: the double exactly) or nil when none, then the newest ``agg`` entry's ``step`` and
#: ``t_end`` as stored (nil when absent). So the dashboard receives ~100 bytes, not every rank's heartbeat (~180 B a
#: rank) nor the newest entry's ``busy`` list (~10 kB at 1,024 ranks). Read-only.
PROCESSING_STATE_SCRIPT = """
local function finite(v)
  if type(v) == 'string' then v = tonumber(v) end
  if type(v) ~= 'number' or v ~= v or v == math.huge or v == -math.huge then return nil end
  return v
end
local step, step_t, inc = nil, nil, nil
for _, raw in ipairs(redis.call('HVALS', KEYS[1])) do
  local ok, beat = pcall(cjson.decode, raw)
  if ok and type(beat) == 'table' then
    local s, st, i = finite(beat['step']), finite(beat['step_t']), finite(beat['inc'])
    if s and (step == nil or s > step) then step = s end
    if st and (step_t == nil or st > step_t) then step_t = st end
    if i and (inc == nil or i < inc) then inc = i end
  end
end
local function text(v) if v == nil then return false end return string.format('%.17g', v) end
local agg_step, agg_t_end = false, false
local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
if newest then
  local f = newest[2]
  for j = 1, #f, 2 do
    if f[j] == 'step' then agg_step = f[j + 1] elseif f[j] == 't_end' then agg_t_end = f[j + 1] end
  end
end
return {text(step), text(step_t), text(inc), agg_step, agg_t_end}
"""


def processing_state(client: redis.Redis, run: str) -> dict[str, Any]:
    """How far the run's aggregates trail its ranks: newest completed step per heartbeats vs aggregates.

    Returns ``hb_step`` / ``hb_step_t`` (the highest step any rank's heartbeat reports and the
    newest time a rank completed a step, unix s; None when no heartbeat names a step),
    ``agg_step`` / ``agg_t_end`` (the newest aggregate's step and end, None when none) and
    ``inc`` (the earliest process start among the heartbeats). One :data:`PROCESSING_STATE_SCRIPT` call: the
    heartbeats are reduced in Redis, which sends five numbers whatever the number of ranks.
    """
    keys = run_keys(run)
    reply = client.register_script(PROCESSING_STATE_SCRIPT)(keys=[keys.heartbeats, keys.agg])
    hb_step, hb_step_t, inc, step, t_end = (_num(v) for v in (list(reply) + [None] * 5)[:5])
    finite = lambda x: x if math.isfinite(x) else None  # noqa: E731
    return {"hb_step": None if finite(hb_step) is None else int(hb_step), "hb_step_t": finite(hb_step_t),
            "agg_step": None if finite(step) is None else int(step), "agg_t_end": finite(t_end), "inc": finite(inc)}


def unprocessed_lag(state: Mapping[str, Any], min_lag_s: float = PROCESSING_LAG_S) -> float | None:
    """Seconds by which the ranks' newest completed step is ahead of the newest aggregate.

    From :func:`processing_state`: None unless the heartbeats report a step beyond the newest
    aggregated one (or any step when nothing is aggregated) that completed more than
    ``min_lag_s`` after the newest aggregate ended (after the ranks started, when none).
    """
    hb_step, hb_t = state.get("hb_step"), state.get("hb_step_t")
    if hb_step is None or hb_t is None:
        return None
    agg_step = state.get("agg_step")
    if agg_step is not None and hb_step <= agg_step:
        return None
    ref = state.get("agg_t_end") if agg_step is not None else state.get("inc")
    if ref is None:
        return None
    lag = float(hb_t) - float(ref)
    return lag if lag > min_lag_s else None


# --- how a replayed run was timed --------------------------------------------------------

#: ``timeline`` values ``trainhealth replay`` stores in the meta (``trainhealth.commands.replay.TIMELINES``).
REPLAY_TIMELINES = ("logged", "partly assumed", "assumed")


def replay_info(client: redis.Redis, run: str) -> dict[str, Any] | None:
    """How ``trainhealth replay`` paced and timed the run, from its meta; None for a live run (or a
    replay made before these fields were written).

    Returns ``source`` (the file name(s), without ``replay:``), ``speed`` (the pace factor, float;
    0 = pushed at once), ``timeline`` (one of :data:`REPLAY_TIMELINES`, None when absent or unknown)
    and ``assumed_step_s`` (the assumed seconds per step, float or None). One ``HMGET``.
    """
    source, speed, timeline, step_s = (
        None if v is None else _s(v)
        for v in client.hmget(run_keys(run).meta, ["source", "replay_speed", "timeline", "assumed_step_s"]))
    if not (source or "").startswith("replay:") or (speed is None and timeline is None):
        return None
    pace = _opt_num(speed)
    return {"source": source.removeprefix("replay:"),  # type: ignore[union-attr]
            "speed": pace if pace is not None and math.isfinite(pace) and pace >= 0 else 0.0,
            "timeline": timeline if timeline in REPLAY_TIMELINES else None,
            "assumed_step_s": _opt_num(step_s)}


# --- the charts' step series: the whole run, read once, then only the new entries ---------------
# The Overview draws every step of the run (reduced to the plot's width in charts.py), so it cannot re-read a
# 100,000-entry stream every 2 s, nor ship each entry's per-rank ``busy`` list to draw a loss curve. A
# :class:`StepSeries` holds the drawn fields of the entries read so far; :meth:`StepSeries.refresh` reads the
# newest entry (one small call) and, when it is new, only the entries after the last one read.

#: Fields of an ``agg`` entry the step charts draw. :data:`PROJECT_SCRIPT` returns only these, so an entry's
#: ``busy`` list (about 9 kB at 1,024 ranks: nearly all of the entry) never leaves Redis.
SERIES_FIELDS = ("step", "gen", "loss", "grad_norm", "tokens", "dur", "step_s")
_SERIES_INTS = ("step", "gen", "tokens")
#: Columns of :attr:`StepSeries.frame`: the fields, and whether ``loss``/``grad_norm`` was stored as NaN or ±inf
#: (a gap and a marker on the chart), which the float columns alone cannot tell from a value never logged.
SERIES_COLUMNS = [*SERIES_FIELDS, "loss_nonfinite", "grad_norm_nonfinite"]
#: Fields of the newest entry, for the status line (read on every refresh).
TAIL_FIELDS = ("step", "gen", "t_end", "n_ranks")
#: Entries per script call: bounds what one call holds in Redis (1,000 entries of a 1,024-rank run are ~9 MB
#: inside the script, a few ms) and in one reply.
SERIES_CHUNK = 1_000
#: The whole-run charts read the rollup (``agg:rollup``, per-100-step buckets) once it covers this many steps: ten
#: times the points a curve is drawn with, so below it every step is read and drawn as such.
ROLLUP_FROM_STEPS = 20_000
#: Rollup entries per ``XRANGE``.
ROLLUP_CHUNK = 5_000
#: A step range is read with one ``XRANGE`` per restart generation (entry ids are ``<gen + 1>-<step>``); a
#: stream whose ids are not (more generations than this) is read whole and filtered instead.
MAX_RANGE_GENERATIONS = 1_000
_MAX_SEQ = 2**64 - 1

#: ``XRANGE``/``XREVRANGE KEYS[1] ARGV[2] ARGV[3] COUNT ARGV[4]``, each entry returned as its id and the values
#: of the fields ARGV[5…] (nil where the entry lacks one), one flat array. Read-only.
PROJECT_SCRIPT = """
local cmd = ARGV[1]
if cmd ~= 'XRANGE' and cmd ~= 'XREVRANGE' then return redis.error_reply('XRANGE or XREVRANGE only') end
local entries = redis.call(cmd, KEYS[1], ARGV[2], ARGV[3], 'COUNT', ARGV[4])
local slot, n = {}, #ARGV - 4
for i = 1, n do slot[ARGV[4 + i]] = i end
local out, base = {}, 0
for _, e in ipairs(entries) do
  out[base + 1] = e[1]
  for i = 2, n + 1 do out[base + i] = false end
  local f = e[2]
  for j = 1, #f, 2 do
    local i = slot[f[j]]
    if i then out[base + 1 + i] = f[j + 1] end
  end
  base = base + n + 1
end
return out
"""


def _entry_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


#: Entries as read by :func:`project`: their ids, and per field the stored values (None where absent).
Entries = tuple[list[str], list[list[Any]]]


def project(client: redis.Redis, run: str, fields: Iterable[str], start: str = "-", end: str = "+",
            count: int = SERIES_CHUNK, newest_first: bool = False) -> Entries:
    """The ``agg`` entries from ``start`` to ``end`` (ids; ``(`` for exclusive; swapped with ``newest_first``), at
    most ``count``, with only ``fields``: one :data:`PROJECT_SCRIPT` call."""
    fields = list(fields)
    script = client.register_script(PROJECT_SCRIPT)
    command, lo, hi = ("XREVRANGE", end, start) if newest_first else ("XRANGE", start, end)
    flat = script(keys=[run_keys(run).agg], args=[command, lo, hi, count, *fields])
    width = len(fields) + 1
    return [_s(i) for i in flat[::width]], [flat[j::width] for j in range(1, width)]


def _take(entries: Entries, keep: Iterable[int]) -> Entries:
    ids, cols = entries
    keep = list(keep)
    return [ids[i] for i in keep], [[col[i] for i in keep] for col in cols]


def _extend(entries: Entries, more: Entries) -> Entries:
    """``entries`` with ``more`` appended (in place)."""
    entries[0].extend(more[0])
    for col, add in zip(entries[1], more[1], strict=True):
        col.extend(add)
    return entries


def _empty_series() -> pd.DataFrame:
    frame = pd.DataFrame({c: pd.Series(dtype="float64") for c in SERIES_FIELDS})
    for c in _SERIES_INTS:
        frame[c] = frame[c].astype("Int64")
    return frame.assign(loss_nonfinite=pd.Series(dtype=bool), grad_norm_nonfinite=pd.Series(dtype=bool))


def _number_column(name: str, values: list[Any], integral: bool, bad: dict[int, list[str]]) -> np.ndarray:
    """``values`` (stored strings, None where absent) as floats, as :func:`_get_num` reads each; the messages of
    those that are no such number go to ``bad[row]``."""
    try:  # the fast path: numbers, "nan", "inf" and absent values, as the service writes them
        out = np.array(values, dtype=np.float64)
        if not integral:
            return out
        with np.errstate(invalid="ignore"):
            wrong = ~np.isfinite(out) | (out != np.round(out)) | (np.abs(out) > MAX_INT)
        suspect = np.flatnonzero(wrong & np.array([v is not None for v in values], dtype=bool)).tolist()
    except (TypeError, ValueError):
        out = np.full(len(values), math.nan)
        suspect = range(len(values))
    for i in suspect:
        msgs: list[str] = []
        out[i] = _get_num({name: values[i]}, name, msgs, bound=MAX_INT if integral else math.inf, integral=integral)
        if msgs:
            bad.setdefault(i, []).extend(msgs)
    return out


def _stored_nonfinite(values: list[Any], numbers: np.ndarray) -> np.ndarray:
    """True where a value was stored as NaN or ±inf (not where it is absent, empty or unreadable)."""
    out = np.zeros(len(values), dtype=bool)
    for i in np.flatnonzero(~np.isfinite(numbers)):
        try:
            x = float(values[i])
        except (TypeError, ValueError):  # absent (None), empty or unreadable
            continue
        out[i] = not math.isfinite(x)
    return out


def _series_rows(entries: Entries, skipped: list[str], partly: list[str]) -> pd.DataFrame:
    """The :data:`SERIES_COLUMNS` frame of :data:`SERIES_FIELDS` ``entries``; entries without a readable step are
    left out (reported in ``skipped``), unreadable values are NaN (reported in ``partly``)."""
    ids, values = entries
    if not ids:
        return _empty_series()
    bad: dict[int, list[str]] = {}
    cols: dict[str, Any] = {}
    for name, column in zip(SERIES_FIELDS, values, strict=True):
        cols[name] = _number_column(name, column, name in _SERIES_INTS, bad)
        if name in ("loss", "grad_norm"):
            cols[f"{name}_nonfinite"] = _stored_nonfinite(column, cols[name])
    has_step = np.isfinite(cols["step"])
    for i in np.flatnonzero(~has_step):
        why = bad.get(i, [""])[0]
        skipped.append(f"entry {ids[i]}: " + (why if why.startswith("step ") else "no step"))
    for i in sorted(bad):
        if has_step[i]:
            partly.append(f"entry {ids[i]}: {'; '.join(bad[i])}")
    frame = pd.DataFrame(cols, columns=SERIES_COLUMNS)[has_step].reset_index(drop=True)
    for c in _SERIES_INTS:
        frame[c] = frame[c].where(np.isfinite(frame[c])).round().astype("Int64")
    return frame


class StepSeries:
    """The drawn fields (:data:`SERIES_FIELDS`) of a run's ``agg`` entries in one step range, read so far.

    ``step_from``/``step_to`` bound the steps (inclusive; None: the run's first/newest step). :meth:`refresh`
    reads what is new; a page keeps the object between refreshes (``st.session_state``).

    Attributes
    ----------
    frame : pandas.DataFrame
        :data:`SERIES_COLUMNS`, stream order (a step replayed after a restart appears once per generation):
        ``step``, ``gen``, ``tokens`` nullable ints; ``loss``, ``grad_norm``, ``dur``, ``step_s`` (s) floats
        with NaN/±inf kept; ``loss_nonfinite``/``grad_norm_nonfinite`` True where the value was stored as NaN/±inf.
    tail : dict or None
        The stream's newest entry (of any step): ``id``, ``step``, ``gen``, ``n_ranks`` (int or None) and
        ``t_end`` (unix s, NaN when unreadable); None while the stream is empty.
    last_id : str or None
        The newest entry id covered (read, or outside the range); None before the first read.
    reads : list of (str, str, int)
        ``(start, end, entries returned)`` of each ``XRANGE`` of the last :meth:`refresh` (none when nothing
        was new: that refresh read the newest entry only).
    """

    def __init__(self, run: str, step_from: int | None = None, step_to: int | None = None) -> None:
        self.run, self.step_from, self.step_to = run, step_from, step_to
        self.key = run_keys(run).agg
        self._reset()

    def _reset(self) -> None:
        self.frame = _empty_series()
        #: The newest step drawn from the rollup (``agg:rollup``) rather than step by step; None when none is.
        self.rolled_steps: int | None = None
        self._rollup_bad: list[str] = []  # the rollup's unreadable entries, reported with the rest
        self.tail: dict[str, Any] | None = None
        self.last_id: str | None = None
        self.reads: list[tuple[str, str, int]] = []
        self._skipped: list[str] = []
        self._partly: list[str] = []
        self._tail_bad: list[str] = []

    @property
    def whole_run(self) -> bool:
        return self.step_from is None and self.step_to is None

    def refresh(self, client: redis.Redis, problems: list[str] | None = None) -> StepSeries:
        """Read the entries added since the last call (all of the range on the first) and append them.

        One call for the newest entry; when it is newer than :attr:`last_id`, ``XRANGE (last_id newest`` in
        chunks of :data:`SERIES_CHUNK` (the first time, the range: ``- newest`` for the whole run, else one
        ``XRANGE <gen + 1>-<step_from> <gen + 1>-<step_to>`` per generation). A stream whose newest id went back
        (deleted and written again) is read afresh. Unreadable entries are reported in ``problems`` as
        :func:`recent_steps` reports them, on every call.
        """
        self.reads = []
        newest_ids, newest_values = project(client, self.run, TAIL_FIELDS, count=1, newest_first=True)
        if not newest_ids:
            if self.last_id is not None:
                self._reset()
            self._report(problems)
            return self
        tail_id = newest_ids[0]
        if self.last_id is not None and _entry_id(tail_id) < _entry_id(self.last_id):
            self._reset()
        if self.last_id is None:
            entries = self._read_range(client, tail_id)
        elif tail_id != self.last_id:
            entries = self._in_range(self._read(client, "(" + self.last_id, tail_id))
        else:
            entries = ([], [])
        self.last_id = tail_id
        self._set_tail(tail_id, [col[0] for col in newest_values])
        if entries[0]:
            new = _series_rows(entries, self._skipped, self._partly)
            self.frame = new if self.frame.empty else pd.concat([self.frame, new], ignore_index=True)
        self._report(problems)
        return self

    def _read(self, client: redis.Redis, start: str, end: str) -> Entries:
        entries: Entries = ([], [[] for _ in SERIES_FIELDS])
        while True:
            got = project(client, self.run, SERIES_FIELDS, start, end)
            self.reads.append((start, end, len(got[0])))
            _extend(entries, got)
            if len(got[0]) < SERIES_CHUNK:
                return entries
            start = "(" + got[0][-1]

    def _read_range(self, client: redis.Redis, tail_id: str) -> Entries:
        if self.whole_run:
            # A long run: its rollup up to its newest bucket, the per-step entries after it.
            rolled = self._read_rollup(client)
            return self._read(client, "-" if rolled is None else "(" + rolled, tail_id)
        newest_gen, newest_step = _entry_id(tail_id)
        if newest_gen > MAX_RANGE_GENERATIONS:
            return self._in_range(self._read(client, "-", tail_id))
        lo = max(self.step_from or 0, 0)
        hi = _MAX_SEQ if self.step_to is None else self.step_to
        entries: Entries = ([], [[] for _ in SERIES_FIELDS])
        for g in range(1, newest_gen + 1) if lo <= hi else ():
            end = tail_id if g == newest_gen and newest_step < hi else f"{g}-{hi}"
            _extend(entries, self._in_range(self._read(client, f"{g}-{lo}", end)))
        return entries

    def _read_rollup(self, client: redis.Redis) -> str | None:
        """With a rollup of :data:`ROLLUP_FROM_STEPS` steps' worth of buckets: its buckets as :attr:`frame` (see
        :func:`rollup_rows`), and the newest bucket's entry id; else None (the run is read step by step)."""
        key = run_keys(self.run).agg_rollup
        # Its buckets hold up to ROLLUP_STEPS steps each, over every generation: one XLEN says whether it is worth it.
        if client.xlen(key) * defaults.ROLLUP_STEPS < ROLLUP_FROM_STEPS:
            return None
        entries: list[tuple[Any, Any]] = []
        start = "-"
        while True:
            got = client.xrange(key, start, "+", count=ROLLUP_CHUNK)
            self.reads.append((f"rollup {start}", "+", len(got)))
            entries += got
            if len(got) < ROLLUP_CHUNK:
                break
            start = "(" + _s(got[-1][0])
        bad: list[str] = []
        self.frame = rollup_rows(entries, bad)
        if bad:
            self._rollup_bad = [unreadable(key, "entry", "entries", bad)]
        self.rolled_steps = int(self.frame["step"].max()) if not self.frame.empty else None
        return _s(entries[-1][0]) if entries else None

    def _in_range(self, entries: Entries) -> Entries:
        """The entries whose step is in the range, by the ``step`` field (the ids of another writer may not say
        it); those whose step is unreadable are kept, to be reported."""
        if self.whole_run:
            return entries
        lo = -math.inf if self.step_from is None else self.step_from
        hi = math.inf if self.step_to is None else self.step_to
        steps = [_num(v) for v in entries[1][0]]
        return _take(entries, (i for i, x in enumerate(steps) if math.isnan(x) or lo <= x <= hi))

    def _set_tail(self, tail_id: str, values: list[Any]) -> None:
        d = dict(zip(TAIL_FIELDS, values, strict=True))
        bad: list[str] = []
        step = _get_num(d, "step", bad, bound=MAX_INT, integral=True)
        gen = _get_num(d, "gen", bad, bound=MAX_INT, integral=True)
        n_ranks = _get_num(d, "n_ranks", bad, bound=MAX_RANKS, integral=True)
        t_end = _get_num(d, "t_end", bad, finite=True, bound=MAX_TIME)
        self._tail_bad = [f"entry {tail_id}: {'; '.join(bad)}"] if bad else []
        as_int = lambda x: None if math.isnan(x) else int(x)  # noqa: E731
        self.tail = {"id": tail_id, "step": as_int(step), "gen": as_int(gen), "n_ranks": as_int(n_ranks),
                     "t_end": t_end}

    def _report(self, problems: list[str] | None) -> None:
        for text in self._rollup_bad:
            _report(problems, text)
        if self._skipped:
            _report(problems, unreadable(self.key, "entry", "entries", self._skipped))
        partly = self._partly + [b for b in self._tail_bad if b not in self._partly]
        if partly:
            _report(problems, unreadable(self.key, "entry", "entries", partly, partly=True))


def rollup_rows(entries: Iterable[tuple[Any, Any]], partly: list[str] | None = None) -> pd.DataFrame:
    """:data:`SERIES_COLUMNS` rows of ``agg:rollup`` entries (detectors/rollup.py), for the whole-run charts.

    Per bucket a row at its first and one at its last step: the loss's and the grad norm's two extremes, each in
    the order they happened (so MinMaxLTTB, fed the rows, keeps every spike and dip a bucket saw), and half of its
    tokens and of its seconds each (their sums, and so the tokens/s, are the bucket's); a row at the first NaN/inf
    step when the bucket had one (a gap and a marker, as on the steps themselves). A bucket of one step is one
    row. An entry without a readable ``first``/``last`` is left out (noted in ``partly``).
    """
    rows: list[dict[str, Any]] = []
    for entry_id, fields in entries:
        d = _decode_map(fields)
        try:
            gen, first, last = int(d.get("gen", "0")), int(d["first"]), int(d["last"])
        except (KeyError, ValueError):
            if partly is not None:
                partly.append(f"entry {_s(entry_id)}: no first/last step")
            continue
        tokens = int(d["tokens"]) if "tokens" in d else None
        dur = float(d["dur_s"]) if "dur_s" in d else math.nan
        halves = (tokens // 2, tokens - tokens // 2) if tokens is not None else (None, None)
        a: dict[str, Any] = {"step": first, "gen": gen, "tokens": halves[0], "dur": dur / 2, "step_s": math.nan,
                             "loss_nonfinite": False, "grad_norm_nonfinite": False}
        b = {**a, "step": last, "tokens": halves[1]}
        for name in ("loss", "grad_norm"):
            lo, hi = _num(d.get(f"{name}_min")), _num(d.get(f"{name}_max"))
            lo_step, hi_step = _num(d.get(f"{name}_min_step")), _num(d.get(f"{name}_max_step"))
            first_value, second_value = (lo, hi) if not lo_step > hi_step else (hi, lo)
            a[name], b[name] = first_value, second_value
        bucket = [a] if first == last else [a, b]
        for name in ("loss", "grad_norm"):
            bad_step = _num(d.get(f"{name}_nonfinite_step"))
            if math.isfinite(bad_step):
                mark = {**a, "step": int(bad_step), "tokens": 0, "dur": 0.0, "loss": a["loss"],
                        "grad_norm": a["grad_norm"], name: math.nan, f"{name}_nonfinite": True}
                bucket.append(mark)
        # A mark at a bucket end's step goes first: a step seen twice keeps its last row (progress), the one with
        # the tokens.
        rows += sorted(bucket, key=lambda row: (row["step"], not (row["loss_nonfinite"] or row["grad_norm_nonfinite"])))
    frame = pd.DataFrame(rows, columns=SERIES_COLUMNS)
    for c in _SERIES_INTS:
        frame[c] = pd.to_numeric(frame[c]).astype("Float64").round().astype("Int64")
    for c in ("loss", "grad_norm", "dur", "step_s"):
        frame[c] = frame[c].astype("float64")
    for c in ("loss_nonfinite", "grad_norm_nonfinite"):
        frame[c] = frame[c].astype(bool)
    return frame


def progress(frame: pd.DataFrame) -> pd.DataFrame:
    """The run's kept trajectory from a :attr:`StepSeries.frame`: one row per step, ascending.

    A step replayed after a restart keeps its newest entry (the generation that counted, as
    :func:`busy_matrix` does). Columns ``step`` (int64), ``loss``, ``tokens_seen`` (tokens of the kept steps up to
    and including this one; NaN where the step has no token count), ``tok_s`` (the step's tokens / its
    seconds: the job's own ``step_s`` when it reported one, else ``dur``; NaN without both).
    """
    cols = ["step", "loss", "tokens_seen", "tok_s"]
    if frame.empty:
        return pd.DataFrame({c: pd.Series(dtype="int64" if c == "step" else "float64") for c in cols})
    kept = frame.drop_duplicates("step", keep="last").sort_values("step", kind="stable")
    tokens = kept["tokens"].astype("float64")
    secs = kept["step_s"].where(kept["step_s"] > 0, kept["dur"]).astype("float64")
    with np.errstate(all="ignore"):
        tok_s = (tokens / secs.where(secs > 0)).where(np.isfinite(tokens))
    return pd.DataFrame({"step": kept["step"].astype("int64").to_numpy(), "loss": kept["loss"].to_numpy("float64"),
                         "tokens_seen": tokens.cumsum().where(tokens.notna()).to_numpy("float64"),
                         "tok_s": tok_s.to_numpy("float64")})


def ledger_history_whole(client: redis.Redis, run: str, max_points: int = 600,
                         problems: list[str] | None = None, paths: Iterable[str] = HISTORY_PATHS) -> pd.DataFrame:
    """The whole retained ledger stream as at most ``max_points`` snapshots evenly spaced in time, oldest first.

    A :func:`ledger_history` frame of the snapshot ``paths``. A stream of at most ``max_points`` entries is read
    whole; a longer one is sampled: the first entry at or after each of ``max_points`` evenly spaced times between
    the oldest and the newest entry id (unix ms), so the bytes read do not grow with the run (the ledger keeps
    ``LEDGER_RETENTION_ENTRIES`` snapshots, ~11 h at 2 s). Both in Redis, one :data:`LEDGER_SAMPLE_SCRIPT` call,
    which sends only the ``paths`` of the sampled snapshots.
    Sampling, not reducing by extremes: each snapshot is cumulative since the run started, so the since-start
    curves move by at most (gap / age) of their range between two samples; the rolling-rate columns are the
    sampled snapshots' own.
    """
    return _ledger_sample(client, run, "whole", max(1, max_points), 0, paths, problems)


# --- the Runs page, deep links and the rank drill-down (issue 16) --------------------------------

def registry(client: redis.Redis, limit: int = RUNS_LIMIT,
             problems: list[str] | None = None) -> list[tuple[str, float]]:
    """``(run, start time)`` of the ``th:runs`` registry, newest first, at most ``limit``: one ``ZREVRANGE``.

    Members that are not valid run ids are skipped (as the detector service does) and, with ``problems``,
    named there.
    """
    members = client.zrevrange(RUNS, 0, limit - 1, withscores=True)
    valid, invalid = [], []
    for m, score in members:
        try:
            valid.append((validate_run_id(m.decode() if isinstance(m, bytes) else m), float(score)))
        except (ConfigError, UnicodeDecodeError):
            invalid.append(show_value(m))
    if invalid:
        _report(problems, f"{RUNS} lists {len(invalid)} invalid run "
                          f"{'id' if len(invalid) == 1 else 'ids'}, skipped: {', '.join(invalid[:5])}"
                          + (", …" if len(invalid) > 5 else ""))
    return valid


#: Columns of :func:`run_board`.
BOARD_COLUMNS = ["run", "status", "step", "throughput_tok_s", "goodput_pct", "active_incidents", "active_anomalies",
                 "worst_severity", "heartbeat_t", "started_at", "world_size", "name"]
#: Job states (``th:{run}:state``) shown over the meta's ``status``, which says ``running`` through them.
JUDGED_STATES = ("hung", "crashed", "restarted")
#: The newest ``t`` of a run's heartbeats (``hb`` hash, KEYS[2]) as a decimal string, nil when none has one. It
#: runs in Redis so that a 1,024-rank run's heartbeats (~130 kB) are not sent for one number, and only for a
#: run whose meta (KEYS[1]) says it is live (``running``, ``crashed`` or no status: docs/architecture.md; an
#: ended run's collectors are gone), so a board of many ended runs costs Redis nothing. Read-only.
NEWEST_BEAT_SCRIPT = """
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= 'running' and status ~= 'crashed' then return false end
local newest = nil
for _, beat in ipairs(redis.call('HVALS', KEYS[2])) do
  local t = tonumber(string.match(beat, '"t"%s*:%s*([-+%d.eE]+)'))
  if t and (newest == nil or t > newest) then newest = t end
end
if newest == nil then return false end
return string.format('%.17g', newest)
"""
_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def _reply(value: Any, key: str, bad: list[str]) -> Any:
    """A pipeline reply, None (and the error noted in ``bad``) when the command failed (a key of another type)."""
    if isinstance(value, Exception):
        bad.append(f"{key}: {value}")
        return None
    return value


def _board_snapshot(raw: Any, key: str, bad: list[str]) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        snap = _json(raw)
    except (TypeError, ValueError):
        bad.append(f"{key}: not JSON")
        return {}
    if not isinstance(snap, dict):
        bad.append(f"{key}: not a JSON object")
        return {}
    wrong: list[str] = []
    snap = clean_snapshot(snap, wrong)
    if wrong:
        bad.append(f"{key}: {'; '.join(wrong)}")
    return snap


def _board_state(raw: Any, key: str, bad: list[str]) -> str | None:
    if raw is None:
        return None
    try:
        return JobState.from_json(_s(raw)).state
    except ValueError as exc:
        bad.append(f"{key}: {exc}")
        return None


def _board_anomalies(values: Any, key: str, bad: list[str]) -> tuple[int, str | None]:
    """(active anomalies, the worst severity among them) of an ``anomalies`` hash's values."""
    active, worst = 0, None
    skipped = 0
    for raw in values or []:
        try:
            a = _json(raw)
        except (TypeError, ValueError):
            skipped += 1
            continue
        if not isinstance(a, dict):
            skipped += 1
            continue
        if a.get("status") != "active":
            continue
        active += 1
        sev = a.get("severity")
        if sev in _SEVERITY_ORDER and (worst is None or _SEVERITY_ORDER[sev] < _SEVERITY_ORDER[worst]):
            worst = sev
    if skipped:
        bad.append(f"{key}: {skipped} {'anomaly is' if skipped == 1 else 'anomalies are'} not a JSON object")
    return active, worst


def _board_incidents(values: Any, key: str, bad: list[str]) -> int:
    """Active incidents among an ``incidents`` hash's values (one that is not a JSON object is noted in ``bad``)."""
    active = skipped = 0
    for raw in values or []:
        try:
            d = _json(raw)
        except (TypeError, ValueError):
            d = None
        if not isinstance(d, dict):
            skipped += 1
        elif d.get("status") == "active":
            active += 1
    if skipped:
        bad.append(f"{key}: {skipped} {'incident is' if skipped == 1 else 'incidents are'} not a JSON object")
    return active


def run_board(client: redis.Redis, limit: int = RUNS_LIMIT, problems: list[str] | None = None) -> pd.DataFrame:
    """One row per run of the registry (newest first, at most ``limit``): what the Runs page shows.

    Columns :data:`BOARD_COLUMNS`: ``run``; ``status`` (the detector service's ``hung``/``crashed``/``restarted``
    from ``th:{run}:state``, else the meta's ``status``, else None); ``step`` (the ledger's ``last_step``, nullable
    int); ``throughput_tok_s`` (whole run, tokens/s; NaN without token counts) and ``goodput_pct`` (% of wall
    time), from ``ledger:latest``; ``active_incidents`` (int: root causes, :mod:`trainhealth.detectors.incidents`),
    ``active_anomalies`` (int) and ``worst_severity`` (of the active anomalies, None when none); ``heartbeat_t``
    (unix s of the newest rank heartbeat, NaN when none or the run ended: :data:`NEWEST_BEAT_SCRIPT`);
    ``started_at`` (registry score, unix s); ``world_size`` (nullable int); ``name``.

    Two round trips whatever the number of runs: the ``ZREVRANGE`` (:func:`registry`) and one pipeline of, per
    run, ``HGETALL meta``, ``GET ledger:latest``, ``GET state``, ``HVALS anomalies``, ``HVALS incidents`` and the
    heartbeat script.
    What cannot be read is blank and, with ``problems``, reported (one sentence for all runs).
    """
    runs = registry(client, limit, problems)
    if not runs:
        frame = pd.DataFrame({c: pd.Series(dtype=object) for c in BOARD_COLUMNS})
        return frame.astype({"step": "Int64", "world_size": "Int64", "active_anomalies": "int64",
                             "active_incidents": "int64",
                             "throughput_tok_s": "float64", "goodput_pct": "float64", "heartbeat_t": "float64",
                             "started_at": "float64"})
    pipe = client.pipeline(transaction=False)
    for run, _ in runs:
        k = run_keys(run)
        pipe.hgetall(k.meta)
        pipe.get(k.ledger_latest)
        pipe.get(k.state)
        pipe.hvals(k.anomalies)
        pipe.hvals(k.incidents)
        # EVAL as a plain command: a cluster's pipeline has no eval(); both keys are in the run's slot.
        pipe.execute_command("EVAL", NEWEST_BEAT_SCRIPT, 2, k.meta, k.heartbeats)
    replies = pipe.execute(raise_on_error=False)
    rows, bad = [], []
    for i, (run, started) in enumerate(runs):
        k = run_keys(run)
        keys = (k.meta, k.ledger_latest, k.state, k.anomalies, k.incidents, k.heartbeats)
        raw_meta, raw_snap, raw_state, raw_anomalies, raw_incidents, raw_beat = (
            _reply(v, key, bad) for v, key in zip(replies[6 * i: 6 * i + 6], keys, strict=True))
        meta = _typed_meta(_decode_map(raw_meta or {}))
        snap = _board_snapshot(raw_snap, k.ledger_latest, bad)
        state = _board_state(raw_state, k.state, bad)
        active, worst = _board_anomalies(raw_anomalies, k.anomalies, bad)
        status = meta.get("status")
        rows.append({
            "run": run, "status": state if state in JUDGED_STATES else (status if isinstance(status, str) else None),
            "step": snap.get("last_step"),
            "throughput_tok_s": snap.get("throughput_tok_s") if has_token_counts(snap) else None,
            "goodput_pct": snap.get("goodput_pct"),
            "active_incidents": _board_incidents(raw_incidents, k.incidents, bad),
            "active_anomalies": active, "worst_severity": worst,
            "heartbeat_t": _num(raw_beat), "started_at": started, "world_size": meta.get("world_size"),
            "name": meta.get("name") if isinstance(meta.get("name"), str) else None,
        })
    if bad:
        _report(problems, f"Some runs' keys are unreadable, shown as missing ({len(bad)}; first: {bad[0]})")
    frame = pd.DataFrame(rows, columns=BOARD_COLUMNS)
    for c in ("step", "world_size"):
        frame[c] = pd.to_numeric(frame[c], errors="coerce").astype("float64").round().astype("Int64")
    for c in ("throughput_tok_s", "goodput_pct", "heartbeat_t", "started_at"):
        frame[c] = pd.to_numeric(frame[c]).astype("float64")
    for c in ("status", "worst_severity", "name"):
        frame[c] = pd.Series([v if isinstance(v, str) else None for v in frame[c]], index=frame.index, dtype=object)
    return frame


# --- which anomaly a link points at ---------------------------------------------------------------

def names_ranks(frame: pd.DataFrame, ranks: Iterable[int]) -> pd.Series:
    """Per anomaly of an :func:`anomalies` frame: True when its ``ranks`` include any of ``ranks``."""
    wanted = list(ranks)
    exploded = frame["ranks"].explode()
    return exploded.isin(wanted).groupby(level=0).any().reindex(frame.index, fill_value=False)


def match_anomaly(frame: pd.DataFrame, step_from: int | None, step_to: int | None,
                  ranks: Iterable[int] = ()) -> str | None:
    """The id of the anomaly of an :func:`anomalies` frame a link's steps and ranks point at, or None.

    With steps ``step_from``–``step_to`` (None: open), the candidates are the anomalies whose span (onset to
    ``end_step``, open while active) meets them; best first, one naming a linked rank, then onset and end as
    given (an alert's link), the onset, any overlap, then the frame's order (active, severity, newest). Without
    steps, the first anomaly naming a linked rank.

    >>> frame = pd.DataFrame({"id": ["a", "b"], "step": [10, 40], "end_step": [50, None], "ranks": [[3], [1]]})
    >>> match_anomaly(frame, 40, 40, []), match_anomaly(frame, 40, 40, [3]), match_anomaly(frame, None, None, [1])
    ('b', 'a', 'b')
    """
    ranks = list(ranks)
    if frame.empty or (step_from is None and step_to is None and not ranks):
        return None
    named = names_ranks(frame, ranks) if ranks else pd.Series(True, index=frame.index)
    if step_from is None and step_to is None:
        hits = frame.index[named.to_numpy()]
        return None if hits.empty else str(frame.loc[hits[0], "id"])
    onset = pd.to_numeric(frame["step"], errors="coerce").astype("float64")
    end = pd.to_numeric(frame["end_step"], errors="coerce").astype("float64").fillna(math.inf)
    lo = -math.inf if step_from is None else float(step_from)
    hi = math.inf if step_to is None else float(step_to)
    meets = (onset <= hi) & (end >= lo)
    at_onset = onset == lo
    exact = at_onset & ((end == hi) | (lo == hi) | (hi == math.inf))
    rank = pd.Series(np.select([exact, at_onset, meets], [0, 1, 2], default=3), index=frame.index)
    order = pd.DataFrame({"rank": rank, "miss": (~named).astype(int), "pos": np.arange(len(frame))})
    order = order[order["rank"] < 3].sort_values(["miss", "rank", "pos"], kind="stable")
    return None if order.empty else str(frame.loc[order.index[0], "id"])


# --- the detectors' verdict on ranks and nodes -----------------------------------------------------

#: Anomaly kinds whose verdict is "this rank is slow": a rank is **flagged** while an active one names it.
FLAGGED_KINDS = ("straggler", "slow_node", "rank_outlier")
VERDICT_COLUMNS = ["rank", "kinds"]
NODE_COLUMNS = ["host", "ranks", "rank_list", "median_busy_s", "ratio", "slowest_rank", "flagged_ranks", "slow_node"]


def rank_verdicts(anomalies: pd.DataFrame) -> pd.DataFrame:
    """The flagged ranks: one row per rank an active :data:`FLAGGED_KINDS` anomaly names, with ``kinds`` (the
    tuple of those anomalies' kinds, in :data:`FLAGGED_KINDS` order). Columns :data:`VERDICT_COLUMNS`."""
    empty = pd.DataFrame({"rank": pd.Series(dtype="int64"), "kinds": pd.Series(dtype=object)})
    if anomalies.empty:
        return empty
    active = anomalies[(anomalies["status"] == "active") & anomalies["kind"].isin(FLAGGED_KINDS)]
    pairs = active[["kind", "ranks"]].explode("ranks").dropna(subset=["ranks"])
    if pairs.empty:
        return empty
    pairs = pairs.assign(rank=pairs["ranks"].astype("int64"),
                         order=pairs["kind"].map({k: i for i, k in enumerate(FLAGGED_KINDS)}))
    pairs = pairs.drop_duplicates(["rank", "kind"]).sort_values(["rank", "order"], kind="stable")
    kinds = pairs.groupby("rank", sort=True)["kind"].agg(tuple)
    return pd.DataFrame({"rank": kinds.index.astype("int64"), "kinds": kinds.to_numpy()})


#: ``[0, 1, 2, 3, 8]`` → ``0–3, 8`` (the one formatter of rank lists, :func:`trainhealth.text.fmt_ranks`).
rank_ranges = fmt_ranks


def node_summary(summary: pd.DataFrame, anomalies: pd.DataFrame) -> pd.DataFrame:
    """The ranks of a :func:`rank_summary` grouped by host, slowest node first.

    Columns :data:`NODE_COLUMNS`: ``host``; ``ranks`` (how many reported) and ``rank_list`` (``0–7``);
    ``median_busy_s`` (the median of its ranks' medians, s) and ``ratio`` (that / the median node's); the
    ``slowest_rank``; ``flagged_ranks`` (how many of its ranks are flagged, :func:`rank_verdicts`); ``slow_node``
    (True while an active ``slow_node`` anomaly names the host: the detector's verdict on the node). Ranks of
    unknown host are left out.
    """
    known = summary[summary["host"].notna()] if not summary.empty else summary
    if known.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in NODE_COLUMNS})
    flagged = rank_verdicts(anomalies)["rank"]
    known = known.assign(flagged=known["rank"].isin(flagged), busy=known["median_busy_s"].astype("float64"))
    by_host = known.groupby("host", sort=False)
    nodes = by_host.agg(ranks=("rank", "size"), median_busy_s=("busy", "median"), flagged_ranks=("flagged", "sum"))
    # Each host's ranks in words: one sort and a split (a grouped Python call per host took ~15 ms at 128 hosts).
    ordered = known.sort_values(["host", "rank"], kind="stable")
    hosts, starts = np.unique(ordered["host"].to_numpy(dtype=object), return_index=True)
    ranks = ordered["rank"].to_numpy(dtype="int64")
    ends = [*starts[1:], len(ranks)]
    nodes["rank_list"] = pd.Series({h: rank_ranges(ranks[a:b].tolist()) for h, a, b in zip(hosts, starts, ends,
                                                                                          strict=True)})
    slowest = by_host["busy"].idxmax()
    nodes["slowest_rank"] = known.loc[slowest.dropna().to_numpy(), "rank"].set_axis(slowest.dropna().index)
    typical = float(nodes["median_busy_s"].median())
    nodes["ratio"] = nodes["median_busy_s"] / typical if typical > 0 else math.nan
    slow_hosts: set[str] = set()
    if not anomalies.empty:
        slow = anomalies[(anomalies["status"] == "active") & (anomalies["kind"] == "slow_node")]
        slow_hosts = {str(h) for hosts in slow["hosts"] for h in hosts}
    nodes = nodes.reset_index()
    nodes["slow_node"] = nodes["host"].isin(slow_hosts)
    nodes = nodes.sort_values(["ratio", "host"], ascending=[False, True], kind="stable", na_position="last")
    return nodes[NODE_COLUMNS].reset_index(drop=True).astype({"ranks": "int64", "flagged_ranks": "int64"})


# --- steps by number: a link's step on a time axis, one rank's timeline around it --------------------
# ``agg`` entry ids are ``<gen + 1>-<step>`` (docs/architecture.md), so the entries of steps lo..hi are one
# ``XRANGE <g>-<lo> <g>-<hi>`` per generation g: a step of long ago costs no more to read than a recent one.

#: Most steps the rank drill-down reads around a linked step.
DRILL_MAX_STEPS = 401


def _generations(client: redis.Redis, key: str) -> int:
    """The newest entry's generation + 1 (its id's first part); 0 for an empty stream."""
    newest = client.xrevrange(key, count=1)
    return int(_s(newest[0][0]).partition("-")[0]) if newest else 0


def _entries_of_steps(client: redis.Redis, key: str, step_from: int, step_to: int,
                      first_last: bool = False) -> list[tuple[Any, dict[str, str]]]:
    """The ``agg`` entries of steps ``step_from``–``step_to`` (decoded fields), generation by generation: one
    pipelined ``XRANGE`` per generation, or with ``first_last`` only the first and last entry of each. A stream
    whose ids are not ``<gen + 1>-<step>`` (another writer's: more generations than
    :data:`MAX_RANGE_GENERATIONS`) gives the steps among its newest :data:`~trainhealth.defaults.DASHBOARD_STEPS`
    entries."""
    gens = _generations(client, key)
    if not gens:
        return []
    if gens > MAX_RANGE_GENERATIONS:
        raw = list(reversed(client.xrevrange(key, count=defaults.DASHBOARD_STEPS)))
    else:
        pipe = client.pipeline(transaction=False)
        for g in range(1, gens + 1):
            lo, hi = f"{g}-{step_from}", f"{g}-{step_to}"
            if first_last:
                pipe.xrange(key, min=lo, max=hi, count=1)
                pipe.xrevrange(key, max=hi, min=lo, count=1)
            else:
                pipe.xrange(key, min=lo, max=hi)
        raw = [entry for got in pipe.execute() for entry in got]
    out = []
    for entry_id, fields in raw:
        d = _decode_map(fields)
        step = _get_num(d, "step", [], bound=MAX_INT, integral=True)
        if math.isfinite(step) and step_from <= step <= step_to:
            out.append((entry_id, d))
    return out


def step_times(client: redis.Redis, run: str, step_from: int, step_to: int) -> tuple[float, float] | None:
    """(start of the first, end of the last) aggregated step in ``step_from``–``step_to`` over every generation
    (unix s), or None when the run has none there. One ``XREVRANGE … COUNT 1`` and one pipeline of two
    ``COUNT 1`` reads per generation (:func:`_entries_of_steps`)."""
    entries = _entries_of_steps(client, run_keys(run).agg, step_from, step_to, first_last=True)
    starts = [_get_num(d, "t_start", [], finite=True, bound=MAX_TIME) for _id, d in entries]
    ends = [_get_num(d, "t_end", [], finite=True, bound=MAX_TIME) for _id, d in entries]
    starts, ends = [t for t in starts if math.isfinite(t)], [t for t in ends if math.isfinite(t)]
    if not starts and not ends:
        return None
    return min(starts or ends), max(ends or starts)


def busy_around(client: redis.Redis, run: str, step_from: int, step_to: int,
                problems: list[str] | None = None) -> pd.DataFrame:
    """A :func:`busy_matrix` of the aggregated steps ``step_from``–``step_to`` (at most :data:`DRILL_MAX_STEPS`
    from ``step_from``), every generation's (a step replayed after a restart keeps the newest): one pipelined
    ``XRANGE`` per generation (:func:`_entries_of_steps`). Entries whose ``busy`` cannot be read are left out and,
    with ``problems``, reported."""
    key = run_keys(run).agg
    step_to = min(step_to, step_from + DRILL_MAX_STEPS - 1)
    rows, bad = [], []
    for entry_id, d in _entries_of_steps(client, key, step_from, step_to) if step_to >= step_from else []:
        try:
            rows.append({"step": int(_num(d["step"])), "busy": _busy_list(d["busy"]) if "busy" in d else []})
        except ValueError as exc:
            bad.append(f"entry {_s(entry_id)}: {exc}")
    if bad:
        _report(problems, unreadable(key, "entry", "entries", bad, partly=True))
    return busy_matrix(pd.DataFrame(rows, columns=["step", "busy"]) if rows else _empty_steps())


TIMELINE_COLUMNS = ["step", "busy_s", "median_s", "fastest_s"]


def rank_timeline(matrix: pd.DataFrame, rank: int) -> pd.DataFrame:
    """One rank's section seconds per step of a :func:`busy_matrix` beside the step's median and fastest rank.

    Columns :data:`TIMELINE_COLUMNS` (``step`` ascending; seconds, NaN where the rank did not report).
    """
    if matrix.shape[1] == 0 or rank not in matrix.index:
        return pd.DataFrame({c: pd.Series(dtype="int64" if c == "step" else "float64") for c in TIMELINE_COLUMNS})
    return pd.DataFrame({"step": matrix.columns.astype("int64"), "busy_s": matrix.loc[rank].to_numpy("float64"),
                         "median_s": matrix.median(axis=0).to_numpy("float64"),
                         "fastest_s": matrix.min(axis=0).to_numpy("float64")})


# --- memory per rank (th:{run}:mem, the heartbeats) --------------------------------------------------------------
#: The memory lists of a ``th:{run}:mem`` entry the Ranks page can draw (:data:`trainhealth.wire.MEMORY_FIELDS`).
MEMORY_METRICS = tuple(MEMORY_FIELDS)
#: Columns (samples in time) the memory heatmap draws at most: a 24-h window is thinned in Redis to this many.
MEMORY_COLUMNS = 120
#: The newest ``ARGV[1]`` entries of the ``mem`` stream (KEYS[1]), every ``stride``-th of them (the newest always)
#: so that at most ``ARGV[2]`` come back, oldest first, each as ``[id, t, step, the ARGV[3] list]``: only the one
#: list drawn crosses the network (at 1,024 ranks ~6 kB an entry, not the entry's ~20 kB).
MEMORY_WINDOW_SCRIPT = """
local entries = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', tonumber(ARGV[1]))
local n, cols, name = #entries, tonumber(ARGV[2]), ARGV[3]
local stride = math.max(1, math.ceil(n / cols))
local out = {}
for i = n, 1, -1 do
  if (i - 1) % stride == 0 then
    local f, t, step, v = entries[i][2], false, false, false
    for j = 1, #f, 2 do
      local k = f[j]
      if k == 't' then t = f[j + 1] elseif k == 'step' then step = f[j + 1] elseif k == name then v = f[j + 1] end
    end
    out[#out + 1] = {entries[i][1], t, step, v}
  end
end
return out
"""


def _mib_list(raw: Any) -> list[float] | None:
    """A ``th:{run}:mem`` list (JSON, MiB by rank, null where missing) as floats (NaN where missing), None when it is
    not one."""
    try:
        values = json.loads(_s(raw))
    except (ValueError, TypeError):
        return None
    if not isinstance(values, list) or len(values) > MAX_RANKS:
        return None
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
            out.append(float(v))
        else:
            return None
    return out


def memory_matrix(client: redis.Redis, run: str, metric: str = "alloc", count: int = defaults.MEMORY_HISTORY_ENTRIES,
                  columns: int = MEMORY_COLUMNS, problems: list[str] | None = None) -> pd.DataFrame:
    """Rank × time matrix of one memory list of the newest ``count`` entries of ``th:{run}:mem``, at most
    ``columns`` of them (evenly thinned in Redis: :data:`MEMORY_WINDOW_SCRIPT`).

    Index ``rank`` (0..widest list − 1), columns the entries' ``t`` (unix s, ascending), values **GiB** (NaN where a
    rank sent none); ``attrs["steps"]`` holds each column's step. Unreadable entries are left out and named in
    ``problems``. Raises ``ValueError`` for a ``metric`` not in :data:`MEMORY_METRICS`.
    """
    if metric not in MEMORY_METRICS:
        raise ValueError(f"metric={metric!r} is not a memory list of th:{{run}}:mem (one of {MEMORY_METRICS})")
    key = run_keys(run).memory
    got = client.register_script(MEMORY_WINDOW_SCRIPT)(keys=[key], args=[count, columns, metric])
    ts, steps, cols, bad = [], [], [], []
    for entry_id, t, step, raw in got:
        values = _mib_list(raw) if raw else None
        tt, ss = _opt_num(t), _opt_num(step)
        if values is None or tt is None or not math.isfinite(tt):
            bad.append(_s(entry_id))
            continue
        ts.append(tt)
        steps.append(int(ss) if ss is not None and math.isfinite(ss) else -1)
        cols.append(values)
    if bad:
        _report(problems, f"{key}: {plural(len(bad), 'entry', 'entries')} unreadable ({', '.join(bad[:3])}"
                          f"{', …' if len(bad) > 3 else ''}), left out")
    width = max((len(c) for c in cols), default=0)
    values = np.full((width, len(cols)), np.nan)
    for j, c in enumerate(cols):
        values[: len(c), j] = c
    frame = pd.DataFrame(values / 1024.0, index=pd.Index(range(width), name="rank"),
                         columns=pd.Index(ts, name="t", dtype="float64"))
    frame.attrs["steps"] = steps
    return frame


def rank_heartbeats(client: redis.Redis, run: str, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The newest heartbeat of each of ``ranks`` (``HMGET`` of those fields of ``th:{run}:hb`` only), as dicts; ranks
    without one, or with one that is not a JSON object, left out."""
    ranks = sorted({int(r) for r in ranks})
    if not ranks:
        return {}
    out = {}
    for r, raw in zip(ranks, client.hmget(run_keys(run).heartbeats, [str(r) for r in ranks]), strict=True):
        hb = _json(raw) if raw is not None else None
        if isinstance(hb, dict):
            out[r] = hb
    return out


def memory_rates(client: redis.Redis, run: str, ranks: Iterable[int], span_s: float = 3600.0,
                 min_span_s: float = defaults.MEMORY_MIN_SPAN_S) -> dict[int, tuple[float, float]]:
    """How fast each of ``ranks``' memory moved over the last ``span_s`` seconds of ``th:{run}:mem``: rank ->
    ``(bytes per hour, seconds between the two entries)``, from the oldest entry within the span and the newest
    (two entries read); CUDA allocated where the rank reports it, else host RSS. Ranks without both values, and
    every rank when the entries are less than ``min_span_s`` apart (a warm-up is not a trend), left out."""
    key = run_keys(run).memory
    newest = client.xrevrange(key, count=1)
    if not newest:
        return {}
    ms = _entry_id(_s(newest[0][0]))[0]
    oldest = client.xrange(key, f"{max(0, ms - int(span_s * 1000))}", "+", count=1)
    if not oldest:  # trimmed between the two reads
        return {}
    (_, new), (_, old) = newest[0], oldest[0]
    new, old = _decode_map(new), _decode_map(old)
    t_new, t_old = _opt_num(new.get("t")), _opt_num(old.get("t"))
    if t_new is None or t_old is None or not t_new - t_old >= min_span_s:
        return {}
    out = {}
    lists = {(m, which): _mib_list(d.get(m, "null")) or [] for m in ("alloc", "rss") for which, d in
             (("new", new), ("old", old))}
    for r in sorted(set(ranks)):
        for m in ("alloc", "rss"):
            a, b = lists[(m, "old")], lists[(m, "new")]
            if r < len(a) and r < len(b) and math.isfinite(a[r]) and math.isfinite(b[r]):
                out[r] = ((b[r] - a[r]) * 2**20 * 3600.0 / (t_new - t_old), t_new - t_old)
                break
    return out
