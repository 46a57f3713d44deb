"""The head of every run page: the run's state in one line, then one card per active incident.

An on-call engineer opening any page must see first whether the run is healthy and, if not, what is wrong, where,
since when, what it costs and what to do (issue "incident first"). :func:`header` draws, as one live fragment:

1. the job banner while the detector service judges the job hung, crashed or just restarted (:func:`job_banner_text`);
2. the state line (:func:`run_health`): **critical** while the job is hung or crashed or a critical incident is
   active, **degraded** while a warning incident is, else **healthy** — an ``info`` incident (a slow step) costs too
   little to page anyone, so it does not degrade the run;
3. a card per active critical or warning incident (:func:`card`): what (the kind in words and the incident's title),
   where (ranks, hosts), since when (step and time), what it costs (badput so far and per hour, in job time,
   GPU-hours and USD) and its one recommendation with the lifecycle buttons (:func:`trainhealth.dashboard.cards.card`);
   a recommendation already decided is named with who decided and why; the memory and GPU health of its first
   ranks from their newest heartbeats (:func:`rank_evidence`: "rank 3: 71.2 of 80.0 GiB allocated, +1.10 GiB/h over
   the last 60.0 min"; the SM clock, temperature, power and throttle reasons);
4. the other incidents (info, resolved) in one collapsed table, so a finished run still tells what happened.

Incidents are read from ``th:{run}:incidents`` (:func:`trainhealth.dashboard.data.incidents`), the grouping of the
detector service (:mod:`trainhealth.detectors.incidents`). A recommendation no incident names (stored by a service
older than the incidents) is still shown as a card of its own.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import redis
import streamlit as st

from trainhealth.dashboard import cards, data
from trainhealth.dashboard.common import (
    FOCUS_MAX_RANKS,
    URL_KEY,
    Focus,
    client,
    get_client,
    kind_words,
    markdown_table,
    show_problems,
    to_datetime,
    viewer_tz,
)
from trainhealth.defaults import DASHBOARD_REFRESH_S, MEMORY_HISTORY_S
from trainhealth.job import JobState
from trainhealth.text import fmt_bytes, fmt_cost, fmt_duration, fmt_gpu_hours, fmt_int, plural

#: Run states, their badge colour and icon.
LEVELS = {"critical": ("red", ":material/error:"), "degraded": ("orange", ":material/warning:"),
          "healthy": ("green", ":material/check_circle:")}
SEVERITY_COLORS = {"critical": "red", "warning": "orange", "info": "gray"}
#: Severities that get a card while active; an info incident goes to the table (see the module doc).
CARD_SEVERITIES = ("critical", "warning")
#: Titles named in the state line before "and N more".
LINE_TITLES = 2
NOUNS = {"incident": "incidents", "anomaly": "anomalies"}
#: Job states the detector service judges over the ranks' own ``status`` (trainhealth/job.py).
JUDGED = ("hung", "crashed", "restarted")
#: Ranks of an incident whose memory and GPU a card shows (its first ones; "and N more"): a bounded read (``HMGET`` of
#: their heartbeats) at 1,024 ranks too.
EVIDENCE_RANKS = 4
#: NVML clock-event reasons that explain nothing (an idle GPU waits for the others).
_BENIGN_THROTTLE = frozenset({"idle", "display clock setting"})


# --- the job banner (hung, crashed, restarted) -------------------------------------------------------------

def _at_step(step: int | None) -> str:
    return f"at step {fmt_int(step)}" if step is not None else "before the first step"


def _dash(message: str) -> str:
    """`` — message`` (its trailing full stop dropped: a sentence follows), or nothing."""
    message = message.strip().rstrip(".")
    return f" — {message}" if message else ""


def _lead(head: str, state: JobState) -> str:
    """``head — message``; a message that starts with the state's own word (the service's ``crashed at step 190,
    rank 1 first (host n1, pid 7): …``) already says what the head would, so it leads alone, capitalised."""
    message = state.message.strip().rstrip(".")
    if message.lower().startswith(state.state + " "):
        return message[0].upper() + message[1:]
    return head + _dash(message)


def job_banner_text(state: JobState | None, now: float) -> str | None:
    """The banner for a hung, crashed or restarted job (:func:`trainhealth.dashboard.data.job_state`), else None."""
    if state is None or state.state not in JUDGED:
        return None
    c = state.culprit
    age = fmt_duration(now - state.since)
    if state.state == "hung":
        # Always our own head: the hang detector's message ("rank 2 has not completed a step for 300 s") has no age.
        text = f"Hung for {age} {_at_step(state.step)}{_dash(state.message)}."
        if c is not None:
            why = c.why.strip().rstrip(".")
            text += f" Culprit: {c.name()} stopped first" + (f": {why}." if why else ".")
            if c.pid is not None:
                where = f"host {c.host}" if c.host else "its host"
                text += f" See where it is stuck: `py-spy dump --pid {c.pid}` on {where}."
        return text
    if state.state == "crashed":
        first = (f", rank {c.rank} first" + (f" (host {c.host})" if c.host else "")) if c is not None else ""
        return _lead(f"Crashed {_at_step(state.step)}{first}", state) + f". Last heard from {age} ago."
    gen = f" (restart generation {state.gen})" if state.gen else ""
    head = f"Restarted at step {fmt_int(state.step)}" if state.step is not None else "Restarted"
    return _lead(head, state) + f". It came back {age} ago{gen}."


def job_banner(state: JobState | None) -> None:
    """A red banner while the job is hung or crashed, a yellow one for a while after it restarted."""
    text = job_banner_text(state, time.time())
    if text is None:
        return
    if state is not None and state.state == "restarted":
        st.warning(text, icon=":material/restart_alt:")
    else:
        st.error(text, icon=":material/error:")


def shown_status(meta: Mapping[str, Any], state: JobState | None) -> str:
    """The run's status: the detector service's judgement (hung, crashed, restarted, finished) over the meta's.

    The meta's ``status`` is what the ranks said (``running`` from their start until ``Monitor.close()``), so a
    hung or crashed job still says ``running`` there. A job state of ``running`` does not override the meta: a
    ``close(status=...)`` the service has not judged yet is newer.
    """
    if state is not None and state.state != "running":
        return state.state
    return str(meta.get("status") or "unknown")


# --- the state line ------------------------------------------------------------------------------------------

def run_health(incidents: Sequence[Mapping[str, Any]], state: JobState | None) -> str:
    """``critical``, ``degraded`` or ``healthy`` (the module doc says when)."""
    active = [i for i in incidents if i.get("status") == "active"]
    if (state is not None and state.state in ("hung", "crashed")) or any(
            i.get("severity") == "critical" for i in active):
        return "critical"
    return "degraded" if any(i.get("severity") == "warning" for i in active) else "healthy"


def state_line(incidents: Sequence[Mapping[str, Any]], state: JobState | None, meta: Mapping[str, Any],
               noun: str = "incident") -> str:
    """The one line: ``:orange-badge[…degraded] · running · 1 active incident: Rank 5 (demo-node-1) is a straggler,
    costing throughput · 2 resolved``.

    >>> incs = [{"status": "active", "severity": "warning", "title": "Rank 5 (n1) is a straggler"},
    ...         {"status": "active", "severity": "info", "title": "Slow step at step 90"},
    ...         {"status": "resolved", "severity": "warning", "title": "Loss spike at step 450"}]
    >>> print(state_line(incs, None, {"status": "running"}))
    :orange-badge[:material/warning: degraded] · running · 1 active incident: Rank 5 (n1) is a straggler · 1 minor \
(info) · 1 resolved
    >>> print(state_line(incs[2:], None, {"status": "finished"}))
    :green-badge[:material/check_circle: healthy] · finished · no active incident · 1 resolved

    ``noun`` names what ``incidents`` are: ``anomaly`` for a run whose service stored anomalies but no incidents
    (one older than them), whose anomalies then stand in.
    """
    level = run_health(incidents, state)
    color, icon = LEVELS[level]
    bits = [f":{color}-badge[{icon} {level}]", shown_status(meta, state)]
    active = [i for i in incidents if i.get("status") == "active"]
    major = [i for i in active if i.get("severity") in CARD_SEVERITIES]
    if major:
        titles = "; ".join(str(i.get("title") or kind_words(i.get("kind"))) for i in major[:LINE_TITLES])
        more = f" and {len(major) - LINE_TITLES} more" if len(major) > LINE_TITLES else ""
        crit = sum(i.get("severity") == "critical" for i in major)
        count = plural(len(major), f"active {noun}", f"active {NOUNS[noun]}")
        if crit and len(major) > 1:
            count += f" ({crit} critical)"
        bits.append(f"{count}: {titles}{more}")
    else:
        bits.append(f"no active {noun}")
    if len(active) > len(major):
        bits.append(f"{len(active) - len(major)} minor (info)")
    resolved = len(incidents) - len(active)
    if resolved:
        bits.append(f"{resolved} resolved")
    return " · ".join(bits)


# --- one incident ----------------------------------------------------------------------------------------------

def where_text(inc: Mapping[str, Any]) -> str:
    """``rank 5 on demo-node-1``, ``ranks 0–3, 8 on n1, n2``, ``the whole job``.

    >>> where_text({"ranks": [0, 1, 2, 3, 8], "hosts": ["n1", "n2"]})
    'ranks 0–3, 8 on n1, n2'
    """
    ranks, hosts = list(inc.get("ranks") or []), list(inc.get("hosts") or [])
    if not ranks and not hosts:
        return "the whole job"
    text = (("rank " if len(ranks) == 1 else "ranks ") + data.rank_ranges(ranks)) if ranks else "hosts"
    if hosts:
        shown = ", ".join(hosts[:4]) + (f" and {len(hosts) - 4} more" if len(hosts) > 4 else "")
        text += f" on {shown}" if ranks else f" {shown}"
    return text


def since_text(inc: Mapping[str, Any], tz: str, now: float) -> str:
    """``step 240 · 11:10:02 UTC (12 min ago)``; with its end once resolved."""
    bits = [f"step {fmt_int(inc.get('onset_step'))}" if inc.get("onset_step") is not None else "step unknown"]
    t = inc.get("onset_t")
    if isinstance(t, (int, float)) and math.isfinite(t):
        bits.append(f"{to_datetime(float(t), tz):%H:%M:%S} {tz} ({fmt_duration(max(0.0, now - t))} ago)")
    text = " · ".join(bits)
    if inc.get("status") != "active" and inc.get("end_step") is not None:
        text += f", until step {fmt_int(inc['end_step'])}"
    return text


def _gpu_cost(seconds: float, world_size: int | None, price: float | None) -> str:
    """`` (3.38 GPU-h · $8.44)`` for ``seconds`` of the whole job's time, or nothing without the world size."""
    if not world_size:
        return ""
    gh = seconds * world_size / 3600.0
    return f" ({fmt_cost({'gpu_hours': gh, 'usd': gh * price if price else None}, unit='GPU-h', sep=' · ')})"


def cost_text(inc: Mapping[str, Any], world_size: int | None, price: float | None) -> str:
    """What the incident costs, as markdown lines: so far, then per hour while it lasts (job time, GPU-hours = job
    time × ranks, USD = GPU-hours × ``price``); the incident grouping's :func:`~trainhealth.detectors.incidents.badput`.

    >>> cost_text({"badput_s": 16.2, "badput_s_per_hour": 1527.1, "status": "active"}, 8, 2.5).splitlines()
    ['16 s of the job so far (0.04 GPU-h · $0.09)  ', 'then 25.5 min per hour (3.39 GPU-h · $8.48 per hour)']
    """
    so_far, rate = inc.get("badput_s"), inc.get("badput_s_per_hour")
    lines = []
    if so_far is None:
        lines.append("not measured from its evidence")
    else:
        lines.append(f"{fmt_duration(so_far)} of the job so far{_gpu_cost(so_far, world_size, price)}")
    if rate is not None and inc.get("status") == "active":
        per_h = _gpu_cost(rate, world_size, price)
        lines.append(f"then {fmt_duration(rate)} per hour" + (f"{per_h[:-1]} per hour)" if per_h else ""))
    return "  \n".join(lines)


def card_key(where: str, inc_id: str) -> str:
    """Key of an incident card's container (its CSS class ``st-key-<key>``), as :func:`cards.card_key` builds."""
    digest = hashlib.sha1(inc_id.encode()).hexdigest()[:8]
    return f"inc-card-{where}-{re.sub(r'[^A-Za-z0-9_-]+', '_', inc_id)}-{digest}"


def _decided(rec: Mapping[str, Any], tz: str) -> str:
    """``Advice: Replace node — dismissed by trainhealth 11:12:32 (the straggler is over (step 798))``."""
    title = cards.ACTIONS.get(str(rec.get("action")), (str(rec.get("action")),))[0]
    last = (rec.get("history") or [{}])[-1]
    who = f" by {last['by']}" if last.get("by") else ""
    when = last.get("t")
    at = f" {to_datetime(float(when), tz):%H:%M:%S}" if isinstance(when, (int, float)) and math.isfinite(when) else ""
    note = f" ({last['note']})" if last.get("note") else ""
    return f"Advice: {title} — {rec.get('status')}{who}{at}{note}"


def evidence_focus(inc: Mapping[str, Any]) -> Focus:
    """The focus an incident's "Evidence" link opens: its onset step and its ranks (none beyond
    :data:`~trainhealth.dashboard.common.FOCUS_MAX_RANKS`); the Anomalies page selects its root anomaly there.

    >>> evidence_focus({"onset_step": 40, "ranks": [2]}).params()
    {'step': '40', 'rank': '2'}
    """
    ranks = tuple(inc.get("ranks") or ())
    step = inc.get("onset_step")
    return Focus(step_from=step, step_to=step, ranks=ranks if len(ranks) <= FOCUS_MAX_RANKS else ())


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def memory_words(hb: Mapping[str, Any]) -> str | None:
    """A heartbeat's memory in words: ``71.2 of 80.0 GiB allocated (peak 74.0 GiB, 75.0 GiB reserved)``, else the
    host's ``host RSS 3.00 GiB of 512 GiB``; None without a sample.

    >>> GiB = 2**30
    >>> memory_words({"mem": {"rss": 3 * GiB, "host_total": 512 * GiB,
    ...                       "cuda": {"total": 80 * GiB, "alloc": 71.2 * GiB, "alloc_peak": 74 * GiB,
    ...                                "reserved": 75 * GiB}}})
    '71.2 of 80.0 GiB allocated (peak 74.0 GiB, 75.0 GiB reserved)'
    >>> memory_words({"mem": {"rss": 3 * GiB, "host_total": 512 * GiB, "cuda_absent": "no CUDA device"}})
    'host RSS 3.00 GiB of 512 GiB'
    """
    mem = hb.get("mem")
    if not isinstance(mem, Mapping):
        return None
    cuda = mem.get("cuda")
    if isinstance(cuda, Mapping) and _number(cuda.get("alloc")) is not None and _number(cuda.get("total")):
        total = float(cuda["total"])
        text = f"{float(cuda['alloc']) / 2**30:.1f} of {fmt_bytes(total)} allocated"
        more = [f"peak {fmt_bytes(cuda['alloc_peak'])}"] if _number(cuda.get("alloc_peak")) is not None else []
        if _number(cuda.get("reserved")) is not None:
            more.append(f"{fmt_bytes(cuda['reserved'])} reserved")
        return text + (f" ({', '.join(more)})" if more else "")
    rss = _number(mem.get("rss"))
    if rss is None:
        return None
    limit = _number(mem.get("host_total"))
    return f"host RSS {fmt_bytes(rss)}" + (f" of {fmt_bytes(limit)}" if limit else "")


def gpu_words(hb: Mapping[str, Any]) -> str | None:
    """A heartbeat's GPU health in words: ``SM clock 1,210 of 1,980 MHz, 87 °C, 350 of 400 W, held down by thermal
    slowdown (hardware)``; None without an NVML sample.

    >>> gpu_words({"gpu": {"sm_clock_mhz": 1210, "sm_clock_max_mhz": 1980, "temp_c": 87, "power_w": 350.4,
    ...                    "power_limit_w": 400, "throttle": ["idle", "thermal slowdown (hardware)"],
    ...                    "ecc_uncorrected": 2}})
    'SM clock 1,210 of 1,980 MHz, 87 °C, 350 of 400 W, held down by thermal slowdown (hardware), 2 uncorrected ECC \
errors'
    """
    gpu = hb.get("gpu")
    if not isinstance(gpu, Mapping) or "absent" in gpu:
        return None
    parts = []
    clock, top = _number(gpu.get("sm_clock_mhz")), _number(gpu.get("sm_clock_max_mhz"))
    if clock is not None:
        parts.append(f"SM clock {clock:,.0f}" + (f" of {top:,.0f}" if top else "") + " MHz")
    if _number(gpu.get("temp_c")) is not None:
        parts.append(f"{gpu['temp_c']:.0f} °C")
    power, limit = _number(gpu.get("power_w")), _number(gpu.get("power_limit_w"))
    if power is not None:
        parts.append(f"{power:,.0f}" + (f" of {limit:,.0f}" if limit else "") + " W")
    reasons = [str(x) for x in gpu.get("throttle") or () if str(x) not in _BENIGN_THROTTLE]
    if reasons:
        parts.append("held down by " + ", ".join(reasons))
    ecc = _number(gpu.get("ecc_uncorrected"))
    if ecc:
        parts.append(f"{ecc:.0f} uncorrected ECC error{'s' if ecc != 1 else ''}")
    return ", ".join(parts) or None


def rank_evidence(ranks: Sequence[int], beats: Mapping[int, Mapping[str, Any]],
                  rates: Mapping[int, tuple[float, float]]) -> list[str]:
    """What the newest heartbeats of an incident's first :data:`EVIDENCE_RANKS` ranks show: a line of memory per rank
    (with how fast it moved, ``rates``: :func:`trainhealth.dashboard.data.memory_rates`) and one of its GPU when NVML
    sent one; "and N more ranks" after them. Empty when none of them sent a sample.

    >>> GiB = 2**30
    >>> hb = {"mem": {"cuda": {"total": 80 * GiB, "alloc": 71.2 * GiB}}, "gpu": {"sm_clock_mhz": 1980, "temp_c": 64}}
    >>> for line in rank_evidence([3, 5, 6, 7, 9], {3: hb}, {3: (1.1 * GiB, 3600.0)}):
    ...     print(line)
    rank 3: 71.2 of 80.0 GiB allocated, +1.10 GiB/h over the last 60.0 min
    rank 3 GPU: SM clock 1,980 MHz, 64 °C
    and 1 more rank
    """
    lines = []
    for r in ranks[:EVIDENCE_RANKS]:
        hb = beats.get(r)
        if hb is None:
            continue
        mem = memory_words(hb)
        if mem is not None:
            rate = rates.get(r)
            if rate is not None:
                sign = "+" if rate[0] >= 0 else "−"
                mem += f", {sign}{fmt_bytes(abs(rate[0]))}/h over the last {fmt_duration(rate[1])}"
            lines.append(f"rank {r}: {mem}")
        gpu = gpu_words(hb)
        if gpu is not None:
            lines.append(f"rank {r} GPU: {gpu}")
    if lines and len(ranks) > EVIDENCE_RANKS:
        lines.append(f"and {plural(len(ranks) - EVIDENCE_RANKS, 'more rank')}")
    return lines


def evidence_ranks(incidents: Sequence[Mapping[str, Any]]) -> list[int]:
    """The ranks whose heartbeats the cards of ``incidents`` show (:data:`EVIDENCE_RANKS` of each carded one)."""
    return sorted({int(r) for i in incidents if i.get("status") == "active" and i.get("severity") in CARD_SEVERITIES
                   for r in list(i.get("ranks") or [])[:EVIDENCE_RANKS]})


@st.cache_data(ttl=MEMORY_HISTORY_S / 3, show_spinner=False)
def _rates(url: str, run: str, ranks: tuple[int, ...]) -> dict[int, tuple[float, float]]:
    return data.memory_rates(get_client(url), run, ranks)


def card(inc: Mapping[str, Any], recs: Mapping[str, Mapping[str, Any]], run: str, where: str,
         meta: Mapping[str, Any], tz: str, now: float, evidence: Sequence[str] = ()) -> None:
    """One active incident as a bordered card (see the module doc); ``recs`` are the run's recommendations by id,
    ``evidence`` the lines of its ranks' memory and GPUs (:func:`rank_evidence`)."""
    iid = str(inc.get("id"))
    sev = str(inc.get("severity") or "?")
    with st.container(border=True, key=card_key(where, iid)):
        st.markdown(f":{SEVERITY_COLORS.get(sev, 'gray')}-badge[{sev}] "
                    f":gray-badge[{kind_words(inc.get('kind'))}] **{inc.get('title') or iid}**")
        world, price = meta.get("world_size"), meta.get("gpu_hour_usd")
        for col, text in zip(st.columns([2, 2, 3]), (
                f"**Where**  \n{where_text(inc)}",
                f"**Since**  \n{since_text(inc, tz, now)}",
                f"**Costs**  \n{cost_text(inc, world, price)}"), strict=True):
            col.markdown(text)
        if evidence:
            st.markdown("**Memory and GPUs** (newest heartbeats)  \n" + "  \n".join(evidence))
        members = list(inc.get("anomalies") or [])
        row = st.container(horizontal=True, gap="small", vertical_alignment="center")
        # A link, not a button that switches pages from this fragment: a switch from inside a live fragment
        # raced the page's other fragments and could leave the browser on a blank page under load.
        row.page_link("pages/anomalies.py", label="Evidence", icon=":material/manage_search:",
                      help="Open the Anomalies page on this incident's onset and ranks.",
                      query_params={"run": run, **evidence_focus(inc).params()})
        row.caption(f"{plural(len(members), 'anomaly', 'anomalies')} grouped as one root cause · `{iid}`")
        rid = inc.get("recommendation")
        rec = recs.get(rid) if rid else None
        if rec is None:
            st.caption("No recommendation: the detectors propose no action for this kind." if not rid else
                       f"Recommendation `{rid}` is not stored (yet).")
        elif rec.get("status") in data.OPEN_RECOMMENDATION_STATUSES:
            cards.card(rec, run, where, tz, now)
        else:
            st.caption(_decided(rec, tz))


#: Rows of the "Other incidents" table; the rest are counted under it (the Anomalies page lists every anomaly).
OTHERS_ROWS = 50
OTHERS_COLUMNS = ("status", "severity", "incident", "where", "steps", "badput", "GPU-h", "advice", "onset")


def others_table(incidents: Sequence[Mapping[str, Any]], recs: Mapping[str, Mapping[str, Any]],
                 world_size: int | None, tz: str, limit: int = OTHERS_ROWS) -> str:
    """The incidents without a card (info ones, resolved ones) as a markdown table, one row each in
    :func:`data.incidents` order (``limit`` rows, then a line counting the rest); columns :data:`OTHERS_COLUMNS`,
    onset in ``tz``.

    A markdown table, not ``st.dataframe``: see :func:`~trainhealth.dashboard.common.markdown_table`."""
    rows = []
    for i in incidents[:limit]:
        rec = recs.get(i.get("recommendation") or "")
        lo, hi = i.get("onset_step"), i.get("end_step")
        badput = i.get("badput_s")
        onset = to_datetime(float(i["onset_t"]), tz) if i.get("onset_t") is not None else None  # None for NaN
        advice = f"{cards.ACTIONS.get(str(rec.get('action')), (rec.get('action'),))[0]} · {rec.get('status')}" \
            if rec else ""
        cells = (
            i.get("status") or "", i.get("severity") or "", i.get("title") or i.get("id") or "", where_text(i),
            (f"{fmt_int(lo)}–{fmt_int(hi)}" if hi is not None and hi != lo else fmt_int(lo)) if lo is not None else "",
            fmt_duration(badput) if badput is not None else "",
            fmt_gpu_hours(badput * world_size / 3600.0) if badput is not None and world_size else "",
            advice,
            f"{onset:%m-%d %H:%M:%S}" if onset is not None else "",
        )
        rows.append(cells)
    text = markdown_table(OTHERS_COLUMNS, rows, right=[c in ("steps", "badput", "GPU-h") for c in OTHERS_COLUMNS])
    more = len(incidents) - limit
    return text + (f"\n\n{plural(more, 'more incident')}: the Anomalies page lists every anomaly." if more > 0 else "")


def render(incidents: list[dict[str, Any]], recs: list[dict[str, Any]], state: JobState | None,
           meta: Mapping[str, Any], run: str, where: str, loose: Sequence[Mapping[str, Any]] = (),
           beats: Mapping[int, Mapping[str, Any]] | None = None,
           rates: Mapping[int, tuple[float, float]] | None = None) -> None:
    """Everything :func:`header` draws, from what it read; ``loose`` are the run's anomalies as incident-like dicts
    (:func:`loose_anomalies`) when it has no incidents; ``beats`` and ``rates`` the newest heartbeats and memory
    rates of the carded incidents' ranks (:func:`evidence_ranks`)."""
    job_banner(state)
    st.markdown(state_line(incidents or loose, state, meta, "incident" if incidents or not loose else "anomaly"))
    tz, now = viewer_tz(), time.time()
    by_id = {str(r.get("id")): r for r in recs}
    carded = [i for i in incidents if i.get("status") == "active" and i.get("severity") in CARD_SEVERITIES]
    for inc in carded:
        card(inc, by_id, run, where, meta, tz, now,
             rank_evidence(list(inc.get("ranks") or []), beats or {}, rates or {}))
    # Advice no incident names or groups (a service older than incidents): a card of its own, as before.
    named = {i.get("recommendation") for i in incidents}
    members = {f"rec:{a}" for i in incidents for a in i.get("anomalies") or []}
    orphans = [r for r in recs if r.get("id") not in named and r.get("id") not in members]
    cards.render(orphans, run, where)
    others = [i for i in incidents if i not in carded]
    if others:
        with st.expander(f"Other incidents ({len(others)}: minor or resolved)", icon=":material/history:"):
            st.markdown(others_table(others, by_id, meta.get("world_size"), tz))


@st.fragment(run_every=DASHBOARD_REFRESH_S)
def header(run: str, where: str) -> None:
    """The run's state line and incident cards, live (a fragment of their own, four small reads per refresh:
    the incidents and recommendations hashes, the job state, the meta). ``where`` names the page: widget keys
    must differ between pages showing the same card."""
    problems: list[str] = []
    try:
        cl = client()
        incidents = data.incidents(cl, run, problems)
        recs = data.recommendations(cl, run, problems)
        state = data.job_state(cl, run, problems)
        meta = data.run_meta(cl, run)  # unreadable fields: the sidebar and the pages say so
        # No incident: a healthy run, or one whose service predates incidents; its anomalies then give the state.
        loose = [] if incidents else loose_anomalies(data.anomalies(cl, run))
        # The carded incidents' first ranks: their newest heartbeats (one HMGET), and how fast their memory moved
        # over the last hour (two entries of th:{run}:mem, cached for a third of its 30-s interval).
        ranks = evidence_ranks(incidents)
        beats = data.rank_heartbeats(cl, run, ranks) if ranks else {}
        rates = _rates(st.session_state.get(URL_KEY, ""), run, tuple(beats)) if beats else {}
    except redis.RedisError:
        return  # the page's own live reads say that Redis is unreachable
    show_problems(problems)
    render(incidents, recs, state, meta, run, where, loose, beats, rates)


def loose_anomalies(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of a :func:`trainhealth.dashboard.data.anomalies` frame as the dicts :func:`state_line` reads
    (``title`` = the message)."""
    return [{"id": r["id"], "kind": r["kind"], "severity": r["severity"], "status": r["status"],
             "title": r["message"]} for r in frame.to_dict("records")]
