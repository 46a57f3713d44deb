"""The rollback recommendation card: what the advisor proposes, what it costs, and its lifecycle buttons.

Shown inside its incident's card at the head of every page (:mod:`trainhealth.dashboard.incidents`) while it waits
for a decision (``proposed`` or ``acknowledged``); one that no incident names (stored by a service older than
incidents) as a card of its own there (:func:`render`), newest first.
The buttons move it through its lifecycle with :func:`trainhealth.recommendations.set_status`
(``by=`` the logged-in user, else the OS user running the dashboard plus ``(no login)``:
:func:`trainhealth.dashboard.common.actor`); the fragment the card is in then re-runs and re-reads
Redis, so an applied or dismissed recommendation disappears at once. A read-only dashboard
(``--read-only``) shows the cards without the buttons. See docs/advisor.md and docs/security.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import time
from collections.abc import Mapping
from typing import Any

import redis
import streamlit as st

from trainhealth import recommendations as recommendation_store
from trainhealth.dashboard import data
from trainhealth.dashboard.common import actor, client, read_only, to_datetime, viewer_tz
from trainhealth.exceptions import ConfigError
from trainhealth.recommendations import Recommendation
from trainhealth.text import fmt_cost, fmt_duration, fmt_gpu_hours, fmt_int, fmt_usd, plural

#: How each action is headed: title, badge colour, icon.
ACTIONS = {
    "rollback": ("Roll back", "red", ":material/history:"),
    "wait": ("Wait", "orange", ":material/hourglass_top:"),
    "none_possible": ("No checkpoint", "red", ":material/block:"),
    "dump_stacks": ("Dump stacks", "red", ":material/bug_report:"),
    "check_process": ("Check process", "red", ":material/search:"),
    "restart": ("Restart", "red", ":material/restart_alt:"),
    "replace_node": ("Replace node", "orange", ":material/swap_horiz:"),
    "keep": ("Keep", "gray", ":material/check:"),
}
#: Actions of the recovery advisor (detectors/recovery_advisor.py): a stop or a slow rank, not a loss incident.
RECOVERY_ACTIONS = frozenset({"dump_stacks", "check_process", "restart", "replace_node", "keep"})
STATUS_COLORS = {"proposed": "blue", "acknowledged": "violet", "applied": "green", "dismissed": "gray"}
KIND_NAMES = {"loss_spike": "Loss spike", "divergence": "Divergence", "nan_inf": "NaN/Inf loss", "hang": "Hang",
              "dead_rank": "Dead rank", "straggler": "Straggler", "slow_node": "Slow node"}
#: The buttons: label, status they set, icon, help.
BUTTONS = (
    ("Acknowledge", "acknowledged", ":material/visibility:",
     "Someone is on it: keeps the card, marked acknowledged."),
    ("Mark applied", "applied", ":material/check_circle:",
     "The advice was carried out (rolled back / waited): closes the card."),
    ("Dismiss", "dismissed", ":material/close:", "Not acting on this advice: closes the card."),
)
#: Height (px) of the Megatron arguments box (it scrolls beyond).
MEGATRON_HEIGHT_PX = 120
_DONE = {"acknowledged": "acknowledged", "applied": "marked applied", "dismissed": "dismissed"}
#: Session-state key of the outcome of the last button click, shown (once) on the next run.
_FLASH = "th_rec_flash"


def _steps(a: int, b: int) -> str:
    return f"{fmt_int(a)}–{fmt_int(b)}"


def _cost_line(cost: Mapping[str, Any]) -> str:
    """``26.8 GPU-h · $67.11`` (GPU-hours only without a price; "step time unknown" without them)."""
    if cost.get("gpu_hours") is None:
        return "step time unknown"
    # The advisor's own formatter: the same figures as in the card's headline (its summary).
    return fmt_cost(cost, unit="GPU-h", sep=" · ")


def _per_hour(gpu_hours: float, usd: float | None) -> str:
    """``64 GPU-h · $160``: the burn rate of the whole job (GPU-hours and USD per hour)."""
    gh = f"{gpu_hours:,.0f}" if float(gpu_hours).is_integer() else fmt_gpu_hours(gpu_hours)
    if usd is None:
        return f"{gh} GPU-h"
    return f"{gh} GPU-h · " + (f"${usd:,.0f}" if abs(usd) >= 100 else fmt_usd(usd))


def recovery_facts(rec: Mapping[str, Any]) -> list[str]:
    """The four fact columns of a recovery card (a hang, a dead rank, a crash, a slow rank), as markdown: the
    checkpoint to restart from, what to run, the restart's cost, the cost of waiting or keeping it."""
    ckpt = rec.get("checkpoint_step")
    first = ("**Restart from**  \ncheckpoint of step " + fmt_int(ckpt)) if ckpt is not None else (
        "**Restart from**  \nno checkpoint reported")
    if rec.get("deadline_s") is not None:
        first += f"  \nrestart if no progress {fmt_duration(rec['deadline_s'])} after the onset"
    if rec.get("exclude_hosts"):
        first += "  \nexclude " + ", ".join(rec["exclude_hosts"])
    commands = rec.get("commands") or []
    run = ["**Run**", *(f"`{c}`" for c in commands[:4])] if commands else ["**Run**", "nothing to run by hand"]
    cost = rec.get("cost") or {}
    steps = cost.get("steps", rec.get("recompute_steps"))
    restart = ["**Restarting costs**", (f"{plural(steps, 'step')} recomputed" if steps is not None
                                        else "recomputed steps unknown"), _cost_line(cost)]
    cont = rec.get("continue_cost") or {}
    keep = ["**Waiting costs**" if rec.get("kind") in ("hang", "dead_rank") else "**Keeping it costs**",
            _cost_line(cont) + " so far"]
    if cont.get("gpu_hours_per_hour") is not None:
        keep.append(f"then {_per_hour(cont['gpu_hours_per_hour'], cont.get('usd_per_hour'))} per hour")
    return [first, "  \n".join(run), "  \n".join(restart), "  \n".join(keep)]


def facts(rec: Mapping[str, Any]) -> list[str]:
    """The four fact columns of a card, as markdown: checkpoint, data to skip, rollback cost, cost of continuing."""
    action = rec.get("action")
    if action in RECOVERY_ACTIONS:
        return recovery_facts(rec)
    ckpt = rec.get("checkpoint_step")
    if ckpt is None:
        first = "**Checkpoint**  \nnone before the onset"
    else:
        first = f"**Checkpoint**  \nload step {fmt_int(ckpt)}"
    if action == "wait" and rec.get("recheck_step") is not None:
        first += f"  \nre-check at step {fmt_int(rec['recheck_step'])}"

    skip = ["**Skip** (inclusive)"]
    if rec.get("skip_steps"):
        a, b = rec["skip_steps"]
        skip.append(f"steps {_steps(a, b)} ({fmt_int(b - a + 1)})")
    if rec.get("skip_samples"):
        a, b = rec["skip_samples"]
        skip.append(f"samples {_steps(a, b - 1)}")
    if rec.get("skip_batches"):
        a, b = rec["skip_batches"]
        skip.append(f"batches {_steps(a, b - 1)}")
    if len(skip) == 2:
        skip.append("no data positions recorded")

    cost = rec.get("cost") or {}
    head = "**If rolled back**" if action == "wait" else "**Rolling back costs**"
    rollback = [head, f"{plural(rec.get('recompute_steps', 0), 'step')} recomputed", _cost_line(cost)]
    if cost.get("wall_hours") is not None:
        rollback.append(f"{fmt_duration(cost['wall_hours'] * 3600.0)} of the run's time")  # as in the headline

    cont = rec.get("continue_cost") or {}
    keep = ["**Continuing costs**", f"{fmt_int(cont.get('wasted_steps_so_far', 0))} steps wasted so far",
            _cost_line(cont)]
    if cont.get("gpu_hours_per_hour") is not None:
        per_h = cont.get("usd_per_hour")
        keep.append(f"then {_per_hour(cont['gpu_hours_per_hour'], per_h)} per hour")
    return [first, "  \n".join(skip), "  \n".join(rollback), "  \n".join(keep)]


def _when(t: Any, tz: str) -> str:
    ts = to_datetime(float(t), tz) if isinstance(t, (int, float)) and math.isfinite(t) else None
    return f"{ts:%m-%d %H:%M:%S}" if ts is not None else "?"


def status_line(rec: Mapping[str, Any], tz: str, now: float) -> str:
    """``Status **acknowledged** · proposed 11-30 00:53:20 → acknowledged by dashboard 11-30 01:05:00 (UTC) ·
    figures of step 300, updated 5 s ago``."""
    steps = [f"proposed {_when(rec.get('created_at'), tz)}"]
    for h in rec.get("history") or []:
        who = f" by {h['by']}" if h.get("by") else ""
        note = f" ({h['note']})" if h.get("note") else ""
        steps.append(f"{h.get('status', '?')}{who} {_when(h.get('t'), tz)}{note}")
    line = f"Status **{rec.get('status', '?')}** · " + " → ".join(steps) + f" ({tz})"
    updated = rec.get("updated_at")
    if isinstance(updated, (int, float)) and math.isfinite(updated):
        line += f" · figures of step {fmt_int(rec.get('current_step'))}, updated {fmt_duration(now - updated)} ago"
    return line


def skip_json(doc: Mapping[str, Any]) -> str:
    """``skip_batches.json`` one key a line, each range on its line (``indent=2`` puts every number on its own)."""
    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items()) + "\n}"


def exports(rec: Mapping[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """The Megatron arguments and the ``skip_batches.json`` document (None where not possible)."""
    try:
        r = Recommendation.from_dict(rec)
    except (TypeError, ValueError):
        return None, None
    return r.megatron_args(), r.lightning_skip()


def card_key(where: str, rec_id: str) -> str:
    """Key of a card's container, so also its CSS class ``st-key-<key>``: the page, the id in
    CSS-safe characters (``rec:loss_spike:*:250:0`` → ``rec_loss_spike_250_0``) and a short hash
    of the id, which keeps two ids that tidy to the same text apart."""
    digest = hashlib.sha1(rec_id.encode()).hexdigest()[:8]
    return f"rec-card-{where}-{re.sub(r'[^A-Za-z0-9_-]+', '_', rec_id)}-{digest}"


def button_key(where: str, status: str, rec_id: str) -> str:
    """Key of the button that moves ``rec_id`` to ``status`` on page ``where``."""
    return f"rec-{where}-{status}-{rec_id}"


def _set_status(run: str, rec_id: str, status: str) -> None:
    """Button callback: move the recommendation, remember the outcome for the next run."""
    if read_only():  # no button is drawn then; a click still queued from before must not write either
        st.session_state[_FLASH] = ("error", f"Not set `{rec_id}` to {status}: the dashboard is read-only.")
        return
    try:
        recommendation_store.set_status(client(), run, rec_id, status, by=actor())
    except (ConfigError, redis.RedisError) as exc:
        st.session_state[_FLASH] = ("error", f"Could not set `{rec_id}` to {status}: {exc}")
    else:
        st.session_state[_FLASH] = ("ok", f"Recommendation {_DONE[status]}.")


def card(rec: Mapping[str, Any], run: str, where: str, tz: str, now: float) -> None:
    """One recommendation as a bordered card (see the module doc)."""
    rec_id = str(rec.get("id", ""))
    title, color, icon = ACTIONS.get(str(rec.get("action")), (str(rec.get("action")), "gray", ":material/help:"))
    status = str(rec.get("status", "?"))
    kind = KIND_NAMES.get(str(rec.get("kind")), str(rec.get("kind")))
    with st.container(border=True, key=card_key(where, rec_id)):
        onset, now_step = fmt_int(rec.get("onset_step")), fmt_int(rec.get("current_step"))
        st.markdown(f":{color}-badge[{icon} {title}] :{STATUS_COLORS.get(status, 'gray')}-badge[{status}] "
                    f"**{kind} at step {onset}** · now step {now_step}")
        st.markdown(str(rec.get("summary") or ""))
        for col, text in zip(st.columns(4), facts(rec), strict=True):
            col.markdown(text)
        row = st.container(horizontal=True, gap="small", vertical_alignment="center")
        if not read_only():
            for label, target, bicon, help_text in BUTTONS:
                row.button(label, key=button_key(where, target, rec_id), icon=bicon, help=help_text,
                           type="primary" if target == "acknowledged" and status == "proposed" else "secondary",
                           disabled=target == status, on_click=_set_status, args=(run, rec_id, target))
        row.caption(status_line(rec, tz, now))
        why, export = st.columns(2)
        reasoning, options = rec.get("reasoning") or [], rec.get("options") or []
        with why.expander("Why: the reasoning" + (" and options" if options else ""), icon=":material/psychology:"):
            st.markdown("\n".join(f"{i}. {line}" for i, line in enumerate(reasoning, 1)) or "No reasoning recorded.")
            if options:
                st.markdown("**Options** (levers to consider, not part of the advice):\n\n"
                            + "\n".join(f"- {o.removeprefix('option: ')}" for o in options))
        megatron, skip = exports(rec)
        with export.expander("Export for the launcher", icon=":material/terminal:"):
            st.caption("Megatron arguments (`--train-range-to-skip` for Megatron-DeepSpeed, "
                       "`--iterations-to-skip` for Megatron-LM) and the checkpoint step to load:")
            if megatron:
                # --iterations-to-skip lists every step (301 numbers by default): scroll, do not sprawl.
                st.code(megatron, language="bash", wrap_lines=True, height=MEGATRON_HEIGHT_PX)
            else:
                st.markdown("No Megatron arguments: there is no checkpoint to load or no skip range.")
            st.caption("`skip_batches.json` for Lightning or a custom loop:")
            if skip:
                body = skip_json(skip)
                st.code(body, language="json")
                st.download_button("Download skip_batches.json", body, file_name="skip_batches.json",
                                   mime="application/json", on_click="ignore", icon=":material/download:",
                                   key=f"rec-{where}-download-{rec_id}")
                exact_skip(rec, run, where)
            else:
                st.markdown("No skip range.")


def exact_skip(rec: Mapping[str, Any], run: str, where: str) -> None:
    """The exact skip's downloads: ``skip.json`` (:class:`trainhealth.samples.SkipDocument`) and, when the job logged
    sample indices for the skipped steps, ``skip_indices.txt`` (one a line). Both are read from Redis only when
    clicked (Streamlit's deferred download: the indices of 300 steps of 1,024 ranks are megabytes); here one
    ``XRANGE … COUNT 1`` says whether there are indices."""
    rec_id, c, frozen = str(rec.get("id", "")), client(), dict(rec)
    st.caption("`skip.json`: the exact skip — steps, consumed samples, batches and the sample indices each rank "
               "consumed in the skipped steps (`log_step(sample_indices=)`):")
    st.download_button("Download skip.json", functools.partial(_text, data.skip_export, c, run, frozen),
                       file_name="skip.json", mime="application/json", on_click="ignore", icon=":material/download:",
                       key=f"rec-{where}-skip-json-{rec_id}")
    if data.skip_indices_logged(c, run, frozen):
        st.download_button("Download skip_indices.txt", functools.partial(_text, data.skip_indices_export, c, run,
                                                                          frozen),
                           file_name="skip_indices.txt", mime="text/plain", on_click="ignore",
                           icon=":material/download:", key=f"rec-{where}-skip-indices-{rec_id}")
        st.caption("`skip_indices.txt`: those sample indices, one a line, for a data loader's skip list.")
    else:
        st.caption("No sample indices logged for the skipped steps: pass `sample_indices=` to `log_step` to get the "
                   "exact samples.")


def _text(read: Any, c: redis.Redis, run: str, rec: Mapping[str, Any]) -> str:
    """A deferred download's body (run in Streamlit's download thread): ``read(c, run, rec)``, or the reason it
    failed, so a click never gives an empty file without saying why."""
    try:
        return read(c, run, rec) or ""
    except redis.RedisError as exc:
        return f"could not read the skip from Redis: {exc}\n"


def render(recs: list[dict[str, Any]], run: str, where: str) -> None:
    """The cards of the open ones among ``recs`` (:func:`trainhealth.dashboard.data.recommendations`), newest first,
    after the outcome of the last button click (a toast, or an error that says why it failed)."""
    flash = st.session_state.pop(_FLASH, None)
    if flash and flash[0] == "ok":
        st.toast(flash[1], icon=":material/check:")
    elif flash:
        st.error(flash[1], icon=":material/error:")
    tz, now = viewer_tz(), time.time()
    for rec in data.open_recommendations(recs):
        card(rec, run, where, tz, now)
