"""Recovery advisor: what to do about a hang, a dead rank, a straggler or a slow node, and what each option costs.

The :class:`~trainhealth.detectors.advisor.RollbackAdvisor` handles the loss; this advisor handles the incidents
that are about the machines: it names the process to inspect and the command to inspect it with, the checkpoint
to restart from, the node to leave out, and puts GPU-hours (and dollars) on waiting, keeping and restarting.
Pure logic on numbers, like the rollback advisor: the pipeline gives it the anomaly, the checkpoints seen, the
run's step time, size, price and measured relaunch time; it returns one
:class:`~trainhealth.recommendations.Recommendation` per incident (id ``rec:<anomaly id>``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from trainhealth import defaults
from trainhealth.anomaly import Anomaly
from trainhealth.detectors.advisor import Checkpoint
from trainhealth.job import Culprit
from trainhealth.recommendations import Recommendation
from trainhealth.text import fmt_cost, fmt_duration, fmt_gpu_hours, fmt_pct, fmt_usd, plural

#: Kinds of a failed job (a stall, a rank gone) and of a slow one (a rank or a node slower than the others, or a
#: node whose collectives are: its network).
FAILURE_KINDS = ("hang", "dead_rank")
SLOW_KINDS = ("straggler", "slow_node", "network_slow")

#: Every training process of the user on a host, when the culprit's pid is not known.
_ALL_PIDS = 'for p in $(pgrep -u "$USER" python); do py-spy dump --pid "$p"; done'


class RecoveryAdvisor:
    """Turns a hang, a dead rank, a straggler, a slow node or a node's slow network into a costed recommendation.

    * **hang** → ``dump_stacks``: ``py-spy dump --pid P`` of the culprit on its host (of every training
      process without a pid), then restart from the newest checkpoint if nothing moved ``restart_after_s``
      after the onset (``deadline_s``); once the stall is older than that, ``restart`` (dump the stacks
      first, for the post-mortem). Waiting burns ``world_size`` GPU-hours per hour; a restart costs the
      steps since the checkpoint plus the relaunch, on every GPU. A culprit whose host failed in an
      earlier incident also gets ``exclude_hosts`` (as for a dead rank).
    * **dead_rank** → ``restart`` from the newest checkpoint (the job cannot finish a synchronous step
      without the rank); when an earlier incident of the run (``history``, an older generation or one
      resolved before this onset) had its culprit on the same host, also ``exclude_hosts`` that host.
      A culprit still alive but stuck (in ``stuck_ranks``, not gone) gets ``dump_stacks`` as a hang.
    * **straggler**, **slow_node** → ``replace_node`` when a restart without it pays for itself within
      ``break_even_h`` hours of the time it costs, else ``keep``. The time it costs is the part of each
      step the job waits for it: (its median section time − a typical rank's) / the step time (/ its
      section time when the step time is unknown: an upper bound; ``1 − score`` without medians).
    * **network_slow** → the same choice for the node whose ranks' collectives take longer than the other
      nodes': every rank waits for the slowest collective, so the job loses (its collective's median seconds −
      the other nodes') / the step time.

    Parameters
    ----------
    restart_after_s : float
        Seconds after a hang's onset after which the advice is to restart (PyTorch's default NCCL
        watchdog timeout, 600 s: the job aborts by itself then).
    default_restart_s : float
        Seconds a relaunch takes (startup + checkpoint restore) when the run measured none.
    break_even_h : float
        Hours within which replacing a slow rank's node must pay for its restart.

    Examples
    --------
    Rank 2 of a 64-GPU job (30 s steps, $2.50 per GPU-hour) stopped at step 66; nothing moved for 4 min:

    >>> culprit = {"rank": 2, "host": "node-7", "pid": 4242, "step": 66, "why": "its heartbeat stopped first"}
    >>> hang = Anomaly("hang", "critical", 66, "no progress for 240 s", ranks=tuple(range(64)),
    ...                evidence={"culprit": culprit, "stalled_s": 240.0, "timeout_s": 120.0})
    >>> adv = RecoveryAdvisor()
    >>> rec = adv.advise(hang, run="r", checkpoints=[Checkpoint(29), Checkpoint(59)], current_step=66, step_s=30.0,
    ...                  world_size=64, gpu_hour_usd=2.5, history=[hang])
    >>> rec.action, rec.commands, rec.deadline_s, rec.checkpoint_step, rec.recompute_steps
    ('dump_stacks', ['py-spy dump --pid 4242'], 600.0, 59, 7)
    >>> print(rec.summary)
    Dump the stacks of rank 2: `py-spy dump --pid 4242` on host node-7 (stopped at step 66); if there is no
    progress by 10.0 min after the onset, restart from the checkpoint of step 59: recomputes 7 steps (9.07
    GPU-hours, $22.67 with the 5.0 min relaunch, 8.5 min of the run's time)
    >>> round(rec.continue_cost["gpu_hours"], 2), rec.continue_cost["gpu_hours_per_hour"]
    (4.27, 64.0)

    Rank 5 of the same job is a straggler: its sections take 38 s against 30 s on a typical rank, in 40 s
    steps, so the job loses 20 % of its time (12.8 GPU-hours per hour); a restart without its node (7 steps
    and the relaunch: 580 s of the whole job) pays back in 580 s / 20 % = 0.81 h:

    >>> slow = Anomaly("straggler", "warning", 60, "rank 5 is a straggler", ranks=(5,), hosts=("node-3",),
    ...                evidence={"score": 0.76, "rank_median_s": 38.0, "best_median_s": 29.0,
    ...                          "typical_median_s": 30.0})
    >>> rec = adv.advise(slow, run="r", checkpoints=[Checkpoint(59)], current_step=66, step_s=40.0,
    ...                  world_size=64, gpu_hour_usd=2.5, history=[slow])
    >>> rec.action, rec.exclude_hosts, rec.continue_cost["gpu_hours_per_hour"], rec.cost["break_even_h"]
    ('replace_node', ['node-3'], 12.8, 0.81)
    >>> print(rec.summary)
    Replace rank 5 on node-3: it costs 20.0% of the job's time (12.8 GPU-hours per hour, $32.00/h); a restart
    without it from the checkpoint of step 59 recomputes 7 steps (10.3 GPU-hours, $25.78 with the 5.0 min
    relaunch, 9.7 min of the run's time) and pays back in 0.81 h (< 1 h). Drain it (Slurm: `scontrol update
    nodename=node-3 state=drain reason="trainhealth: straggler"`) and relaunch with `sbatch --exclude=node-3`.
    >>> rec.commands[1]
    'sbatch --exclude=node-3 <job script>  # Slurm: relaunch'

    References
    ----------
    PyTorch ``torch.distributed.init_process_group`` ``timeout`` and
    ``torch.distributed.constants.default_pg_nccl_timeout`` (10 min: the NCCL watchdog aborts a collective
    stuck that long); py-spy (``py-spy dump --pid``, ``--native``), github.com/benfred/py-spy; Google's
    ml-goodput-measurement (cloud_tpu_goodput: the startup, training-preparation and lost-progress badput of a
    restart); NVIDIA Resiliency Extension (fault tolerance: hang detection from heartbeats and an in-job
    restart of the workload; straggler detection).
    """

    def __init__(
        self,
        restart_after_s: float = defaults.HANG_RESTART_AFTER_S,
        default_restart_s: float = defaults.RESTART_OVERHEAD_S,
        break_even_h: float = defaults.REPLACE_NODE_BREAK_EVEN_H,
    ) -> None:
        self.restart_after_s = restart_after_s
        self.default_restart_s = default_restart_s
        self.break_even_h = break_even_h

    @staticmethod
    def concerns(a: Anomaly) -> bool:
        """Whether the advisor has something to say about ``a``: an active hang, dead rank, straggler, slow node
        or a node's slow network.

        ``rank_outlier`` is left out: it flags a rank unlike the others in several ways (variability, data
        loading, missing steps), not a slowdown of the job that a replacement would buy back; once such a rank
        slows the job, the straggler detector reports it.
        """
        return a.active and a.kind in FAILURE_KINDS + SLOW_KINDS

    def advise(
        self,
        anomaly: Anomaly,
        *,
        run: str,
        checkpoints: Iterable[Checkpoint],
        current_step: int,
        step_s: float | None,
        world_size: int,
        gpu_hour_usd: float | None,
        history: Iterable[Anomaly],
        restart_s: float | None = None,
        now: float | None = None,
    ) -> Recommendation | None:
        """The recommendation for ``anomaly`` now, or None when :meth:`concerns` is False.

        Parameters
        ----------
        anomaly : Anomaly
            The incident (evidence fields as documented by the hang, dead-rank, straggler and slow-node
            detectors; every one is optional).
        run : str
            The run's name.
        checkpoints : iterable of Checkpoint
            Checkpoints seen; the restart uses the newest at or before ``current_step``.
        current_step : int
            The run's last completed step (steps).
        step_s : float | None
            The run's median step time (s); None when unknown (recomputation then uncosted).
        world_size : int
            GPUs of the job (every one idles in a hang and redoes the recomputed steps).
        gpu_hour_usd : float | None
            Price of a GPU-hour (USD); None: GPU-hours only.
        history : iterable of Anomaly
            Every anomaly of the run (an earlier failure on the same host makes it excluded).
        restart_s : float | None
            Measured seconds a relaunch took in this run (startup + checkpoint restore); None:
            ``default_restart_s``.
        now : float | None
            Unix time (s) of the advice: the hang's restart deadline is also given as a UTC time.

        Returns
        -------
        Recommendation | None
            ``action`` one of ``dump_stacks``, ``restart``, ``replace_node``, ``keep``; ``cost`` the restart
            (``steps``, ``recompute_s``, ``restart_s``, ``wall_hours``, ``gpu_hours``, ``usd``,
            ``restart_gpu_hours``, ``restart_usd``; ``break_even_h`` for a slow rank or node) and
            ``continue_cost`` not acting (GPU-hours lost so far and per hour).
        """
        if not self.concerns(anomaly):
            return None
        measured = restart_s is not None and math.isfinite(restart_s) and restart_s >= 0
        ctx = _Context(
            anomaly=anomaly, run=run, current_step=current_step,
            step_s=step_s if step_s is not None and math.isfinite(step_s) and step_s > 0 else None,
            world=max(int(world_size), 0),
            price=gpu_hour_usd if gpu_hour_usd is not None and math.isfinite(gpu_hour_usd) else None,
            restart_s=float(restart_s) if measured else float(self.default_restart_s), measured=measured,
            history=list(history), now=now,
        )
        eligible = [c for c in checkpoints if c.step <= current_step]
        ctx.checkpoint = max(eligible, key=lambda c: c.step) if eligible else None
        ctx.cost = _restart_cost(ctx)
        if anomaly.kind == "hang":
            return self._dump_stacks(ctx, _num(anomaly.evidence.get("stalled_s")))
        if anomaly.kind == "dead_rank":
            return self._dead_rank(ctx)
        return self._slow(ctx)

    # --- hang -------------------------------------------------------------------------------------------

    def _dump_stacks(self, ctx: _Context, stalled_s: float | None) -> Recommendation:
        a, ev = ctx.anomaly, ctx.anomaly.evidence
        culprit = _culprit(ev)
        if culprit is not None and culprit.pid is not None:
            commands = [f"py-spy dump --pid {culprit.pid}"]
            where = f"`{commands[0]}`" + (f" on host {culprit.host}" if culprit.host else "")
        else:
            host = culprit.host if culprit is not None else None
            commands = [_ALL_PIDS + (f"  # on host {host}" if host else "  # on every host of the job")]
            where = f"`{_ALL_PIDS}` on " + (f"host {host}" if host else "every host of the job")
        if culprit is not None:
            at = f"stopped at step {culprit.step}" if culprit.step is not None else "before its first step"
            who = f"rank {culprit.rank}: {where} ({at}" + ("; no pid reported)" if culprit.pid is None else ")")
        else:
            who = f"every rank (no culprit named): {where}"
        past = stalled_s is not None and stalled_s >= self.restart_after_s
        deadline = fmt_duration(self.restart_after_s)
        if past:
            action = "restart"
            summary = (f"No progress for {fmt_duration(stalled_s)}, past the {deadline} NCCL watchdog timeout: "
                       f"{_restart_from(ctx)}: {_restart_phrase(ctx.cost)}; first dump the stacks of "
                       f"{who} for the post-mortem")
        else:
            action = "dump_stacks"
            summary = (f"Dump the stacks of {who}; if there is no progress by {deadline} after the onset, "
                       f"{_restart_from(ctx)}: {_restart_phrase(ctx.cost)}")
        repeat = _earlier_failure(a, culprit.host if culprit else None, ctx.history)
        if repeat is not None and culprit is not None and culprit.host:
            summary += f"; exclude {culprit.host} from the relaunch (it failed before at step {repeat.step})"
        reasoning = [f"{a.kind} since step {a.step} (now step {ctx.current_step}): {a.message}"]
        reasoning.append(_culprit_line(culprit) if culprit else
                         "no culprit named: every rank stopped without one standing out, so dump all of them")
        waiting = ev.get("waiting_ranks")
        if isinstance(waiting, list) and waiting:
            reasoning.append(f"{plural(len(waiting), 'rank')} alive and waiting ({_ranks(waiting)}): their stacks "
                             "would show them blocked in a collective, waiting for the culprit")
        silent = ev.get("silent_ranks") if isinstance(ev.get("silent_ranks"), list) else []
        if culprit is not None and culprit.rank in silent:
            reasoning.append(f"rank {culprit.rank}'s heartbeat is gone too: if its process died, py-spy finds nothing; "
                             "read its log and the host's kernel log (`dmesg -T | grep -iE 'oom|xid'`"
                             + (f" on {culprit.host}" if culprit.host else "") + ") instead")
        pid = culprit.pid if culprit is not None and culprit.pid is not None else "PID"
        reasoning.append("py-spy prints every thread's Python stack without stopping the process; "
                         f"`py-spy dump --native --pid {pid}` adds the C/C++ frames (NCCL, CUDA) a collective "
                         "blocks in; it needs ptrace rights on the host (root, or CAP_SYS_PTRACE in a container)")
        line = (f"restart if nothing moved {deadline} after the onset: PyTorch's default NCCL watchdog timeout "
                "(the job aborts its collectives by itself then)")
        if stalled_s is not None:
            left = self.restart_after_s - stalled_s
            line += f"; stalled {fmt_duration(stalled_s)} so far, " + (
                f"{fmt_duration(left)} left" if left > 0 else "the deadline has passed")
            if ctx.now is not None and left > 0:
                line += time.strftime(" (at %H:%M:%S UTC)", time.gmtime(ctx.now + left))
        reasoning.append(line)
        continue_cost = _burn(ctx, stalled_s)
        reasoning.append(_waiting_line(ctx, continue_cost, stalled_s))
        reasoning.append(_restart_line(ctx))
        exclude: list[str] = []
        if repeat is not None and culprit is not None and culprit.host:
            exclude = [culprit.host]
            reasoning.append(_repeat_line(culprit.host, repeat))
        return _rec(ctx, action, summary, reasoning, continue_cost, commands, exclude, self.restart_after_s)

    # --- dead rank --------------------------------------------------------------------------------------

    def _dead_rank(self, ctx: _Context) -> Recommendation:
        a, ev = ctx.anomaly, ctx.anomaly.evidence
        culprit = _culprit(ev)
        state = ev.get("job_state")
        stuck = ev.get("stuck_ranks") if isinstance(ev.get("stuck_ranks"), list) else []
        silent = ev.get("silent_ranks") if isinstance(ev.get("silent_ranks"), list) else []
        if culprit is not None and state != "crashed" and culprit.rank in stuck and culprit.rank not in silent:
            # Alive but not stepping: its process is there to inspect, as in a hang.
            return self._dump_stacks(ctx, _num(ev.get("idle_s")))
        host = culprit.host if culprit is not None and culprit.host else (a.hosts[0] if len(a.hosts) == 1 else None)
        repeat = _earlier_failure(a, host, ctx.history)
        summary = f"{_restart_from(ctx).capitalize()}: {_restart_phrase(ctx.cost)}"
        commands: list[str] = []
        exclude: list[str] = []
        if repeat is not None and host:
            exclude = [host]
            summary += (f"; exclude {host} (it failed before at step {repeat.step}): e.g. `sbatch --exclude={host}`, "
                        "or drain it")
            commands = [_drain(host, "failed twice"), f"sbatch --exclude={host} <job script>  # Slurm: relaunch"]
        if state != "crashed" and culprit is not None and culprit.pid is not None:
            # Heartbeat lost while the others live: first see whether the process is still there (stopped, in the
            # kernel) or gone (killed: the OOM killer leaves a line in the kernel log).
            where = f"ssh {culprit.host} " if culprit.host else ""
            commands = [f"{where}ps -o pid,stat,etime,cmd -p {culprit.pid}  # T: stopped (kill -CONT {culprit.pid}), "
                        "D: stuck in the kernel, nothing: it died",
                        f"{where}dmesg -T | grep -i -E 'killed process|out of memory' | tail -3", *commands]
        reasoning = [f"{a.kind} since step {a.step} (now step {ctx.current_step}): {a.message}"]
        if culprit is not None:
            reasoning.append(_culprit_line(culprit))
        elif a.ranks:
            reasoning.append(f"dead: {_ranks(a.ranks)} (no culprit named)")
        victims = ev.get("victims")
        if isinstance(victims, list) and victims:
            reasoning.append(f"{_ranks(victims)} stopped after it: victims waiting on it, not causes")
        name = f"rank {culprit.rank}" if culprit is not None else "the dead rank"
        if state == "crashed":
            reasoning.append("the job crashed (every rank's heartbeat is gone): only a relaunch brings it back")
        else:
            reasoning.append(f"{name}'s heartbeat stopped: its process was stopped (SIGSTOP, a debugger), is stuck in "
                             "the kernel, was killed (the OOM killer) or lost its node — `ps` on its host tells which; "
                             "the others wait for it in a collective (their stacks would only show them waiting) and "
                             "cannot finish a step without it")
        silent_s = _num(ev.get("silent_s"))
        continue_cost = _burn(ctx, silent_s)
        if state == "crashed":
            reasoning.append(
                f"down for {fmt_duration(silent_s)}: every hour without a relaunch delays the run by an hour "
                f"(and burns up to {ctx.world:,} GPU-hours per hour while the allocation is still held)")
        else:
            reasoning.append(_waiting_line(ctx, continue_cost, silent_s))
        reasoning.append(_restart_line(ctx))
        if repeat is not None and host:
            reasoning.append(_repeat_line(host, repeat))
        elif host:
            reasoning.append(f"no earlier failure on {host} in this run: no reason to exclude it yet")
        check = state != "crashed" and culprit is not None and culprit.pid is not None
        if check:
            # The process may still be there (a stopped or stuck one resumes without losing a step): look first,
            # restart when nothing moved by the deadline.
            at = f"host {culprit.host}" if culprit.host else "its host"
            summary = (f"Check rank {culprit.rank}'s process on {at}: `ps -o pid,stat,etime,cmd -p {culprit.pid}` "
                       f"(T: stopped — `kill -CONT {culprit.pid}`; D: stuck in the kernel; nothing: it died — see the "
                       f"kernel log); if nothing moved {fmt_duration(self.restart_after_s)} after the onset, "
                       + summary[0].lower() + summary[1:])
            reasoning.append(f"restart if nothing moved {fmt_duration(self.restart_after_s)} after the onset: "
                             "PyTorch's default NCCL watchdog timeout (the others abort their collectives by then)")
        return _rec(ctx, "check_process" if check else "restart", summary, reasoning, continue_cost, commands, exclude,
                    self.restart_after_s if check else None)

    # --- straggler, slow node ---------------------------------------------------------------------------

    def _slow(self, ctx: _Context) -> Recommendation:
        a, ev = ctx.anomaly, ctx.anomaly.evidence
        net = a.kind == "network_slow"
        node = a.kind == "slow_node" or net
        host = (a.scope or None) if node else None
        host = host or (a.hosts[0] if len(a.hosts) == 1 else None)
        if net:  # its collectives against the other nodes' (detectors/network.py's evidence)
            mine, best, ref, score = _num(ev.get("node_comm_s")), None, _num(ev.get("others_comm_s")), None
        else:
            mine = _num(ev.get("node_median_s" if node else "rank_median_s"))
            best = _num(ev.get("best_median_s"))
            ref = _num(ev.get("typical_median_s"))
            ref = ref if ref is not None else best
            score = _num(ev.get("node_score" if node else "score"))
        if node:
            subject = f"node {host}" if host else "the slow node"
            subject += f" ({plural(len(a.ranks), 'rank')})" if a.ranks else ""
        else:
            r = a.ranks[0] if a.ranks else "?"
            subject = f"rank {r}" + (f" on {host}" if host else "")
        reasoning = [f"{a.kind} since step {a.step} (now step {ctx.current_step}): {a.message}"]
        fraction: float | None = None
        step_s = ctx.step_s or (_num(ev.get("step_s")) if net else None)  # the detector's window's median step
        if mine and ref is not None and mine > 0:
            saved = max(0.0, mine - ref)
            denom = max(step_s, mine) if step_s else mine
            fraction = min(saved / denom, 1.0)
            reasoning.append(
                (f"{subject}: its ranks' collectives take {_ms(mine)} (median) vs {_ms(ref)} on the other nodes; "
                 "every rank waits for the slowest collective" if net else
                 f"{subject}: sections take {_ms(mine)} (median) vs {_ms(ref)} on a typical rank")
                + (f" (fastest {_ms(best)})" if best is not None else "") + (f", score {score:.2f}" if score else "")
                + "; a node " + ("whose network is as fast as the others'" if net else "as fast as a typical one")
                + f" saves {_ms(saved)} of each "
                + (f"{_ms(denom)} step" if step_s else f"{_ms(denom)} of sections (step time unknown: the "
                   "share of the step is at most this)")
                + f" = {fmt_pct(fraction * 100)} of the job's time")
        elif score is not None and 0 < score <= 1:
            fraction = 1.0 - score
            reasoning.append(f"{subject}: score {score:.2f} (fastest rank's time / its time): about "
                             f"{fmt_pct(fraction * 100)} of its sections' time lost (no medians on the anomaly)")
        if fraction is None:
            reasoning.append("no timing figures on the anomaly: its cost cannot be estimated")
            summary = (f"Keep {subject} for now: no timing figures to cost it; drain it if it stays slow"
                       + (f" (Slurm: `{_drain(host, a.kind, comment=False)}`)" if host else ""))
            return _rec(ctx, "keep", summary, reasoning, {}, [], [], None)
        if fraction < defaults.SLOW_RANK_MIN_LOSS:
            return None  # keeping it is the obvious answer: a card saying so is noise
        per_h = fraction * ctx.world
        elapsed_h = (ctx.current_step - a.step) * step_s / 3600.0 if step_s else None
        lost_h = fraction * elapsed_h if elapsed_h is not None else None
        continue_cost = {
            "lost_fraction": fraction,
            "wall_hours": lost_h,
            "gpu_hours": lost_h * ctx.world if lost_h is not None else None,
            "usd": lost_h * ctx.world * ctx.price if lost_h is not None and ctx.price is not None else None,
            "gpu_hours_per_hour": per_h,
            "usd_per_hour": per_h * ctx.price if ctx.price is not None else None,
        }
        rate = f"{fmt_gpu_hours(per_h)} GPU-hours per hour" + (
            f", {fmt_usd(continue_cost['usd_per_hour'])}/h" if ctx.price is not None else "")
        reasoning.append(f"keeping it costs {fmt_pct(fraction * 100)} of {ctx.world:,} GPUs: {rate}"
                         + (f"; lost since step {a.step}: {fmt_cost(continue_cost)}"
                            if continue_cost["gpu_hours"] is not None else ""))
        cost = ctx.cost
        known = cost["gpu_hours"] is not None
        wall_s = cost["wall_hours"] * 3600.0 if known else cost["restart_s"]
        be = wall_s / 3600.0 / fraction if fraction > 0 else math.inf
        cost["break_even_h"] = round(be, 2) if math.isfinite(be) else None
        reasoning.append(_restart_line(ctx))
        at_least = "" if known else "at least "
        verdict = "under" if be < self.break_even_h else "not under"
        reasoning.append(
            f"break-even: the restart's {fmt_duration(wall_s)} of the whole job / {fmt_pct(fraction * 100)} lost = "
            f"{at_least}{_hours(be)}, {verdict} the {self.break_even_h:g} h threshold (a restart that pays back "
            "only after days is noise: the run may end or the node recover first)")
        if known and cost["steps"]:
            reasoning.append(f"right after the next checkpoint save the restart costs only the relaunch: break-even "
                             f"{_hours(cost['restart_s'] / 3600.0 / fraction) if fraction > 0 else '—'}")
        reasoning.append("assumes a spare node as fast as a typical one (or a relaunch on fewer nodes) and that the "
                         "run trains for longer than the break-even")
        if be < self.break_even_h:
            commands = ([_drain(host, a.kind), f"sbatch --exclude={host} <job script>  # Slurm: relaunch"]
                        if host else [])
            how = (f" Drain it (Slurm: `{_drain(host, a.kind, comment=False)}`) and relaunch with "
                   f"`sbatch --exclude={host}`." if host else " Its host is unknown: find it from the rank's logs.")
            when = "" if known else "; do it right after a checkpoint save, when only the relaunch is lost"
            summary = (f"Replace {subject}: it costs {fmt_pct(fraction * 100)} of the job's time ({rate}); a "
                       f"restart without it {_from(ctx)} {_restart_phrase(cost)} and pays back in "
                       f"{at_least}{_hours(be)} (< {self.break_even_h:g} h){when}.{how}")
            if host:
                reasoning.append(f"Slurm: `{_drain(host, a.kind, comment=False)}` (operator rights) keeps new jobs "
                                 f"off it; `sbatch --exclude={host}` relaunches without it")
            return _rec(ctx, "replace_node", summary, reasoning, continue_cost, commands, [host] if host else [], None)
        summary = (f"Keep {subject} for now: it costs {fmt_pct(fraction * 100)} of the job's time ({rate}), but a "
                   f"restart without it {_from(ctx)} {_restart_phrase(cost)} and would "
                   + (f"pay back only after {at_least}{_hours(be)} (≥ {self.break_even_h:g} h)" if math.isfinite(be)
                      else "never pay back")
                   + "; leave it out at the next planned restart")
        return _rec(ctx, "keep", summary, reasoning, continue_cost, [], [], None)


class _Context:
    """The inputs of one piece of advice, cleaned (unknowns as None)."""

    def __init__(self, *, anomaly: Anomaly, run: str, current_step: int, step_s: float | None, world: int,
                 price: float | None, restart_s: float, measured: bool, history: list[Anomaly],
                 now: float | None) -> None:
        self.anomaly = anomaly
        self.run = run
        self.current_step = current_step
        self.step_s = step_s
        self.world = world
        self.price = price
        self.restart_s = restart_s
        self.measured = measured
        self.history = history
        self.now = now
        self.checkpoint: Checkpoint | None = None
        self.cost: dict[str, Any] = {}


def _num(x: Any) -> float | None:
    """A finite non-negative number from the evidence, else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        return None
    return float(x)


def _culprit(ev: Mapping[str, Any]) -> Culprit | None:
    d = ev.get("culprit")
    if not isinstance(d, Mapping):
        return None
    try:
        return Culprit.from_dict(d)
    except (KeyError, TypeError, ValueError):
        return None


def _restart_cost(ctx: _Context) -> dict[str, Any]:
    """The restart: ``steps`` since the checkpoint (None: no checkpoint) x ``step_s`` + the relaunch, on every GPU."""
    steps = max(0, ctx.current_step - ctx.checkpoint.step) if ctx.checkpoint is not None else None
    recompute_s = None if steps is None else (steps * ctx.step_s if ctx.step_s else (0.0 if steps == 0 else None))
    wall_s = None if recompute_s is None else recompute_s + ctx.restart_s
    price = ctx.price

    def gpu(s: float | None) -> tuple[float | None, float | None]:
        if s is None:
            return None, None
        g = s / 3600.0 * ctx.world
        return g, g * price if price is not None else None

    gh, usd = gpu(wall_s)
    rgh, rusd = gpu(ctx.restart_s)
    return {"steps": steps, "recompute_s": recompute_s, "restart_s": ctx.restart_s,
            "wall_hours": wall_s / 3600.0 if wall_s is not None else None, "gpu_hours": gh, "usd": usd,
            "restart_gpu_hours": rgh, "restart_usd": rusd}


def _burn(ctx: _Context, lost_s: float | None) -> dict[str, Any]:
    """What waiting costs: every GPU of the job idles (``gpu_hours`` lost so far, then per hour)."""
    gh = lost_s / 3600.0 * ctx.world if lost_s is not None else None
    return {"stalled_s": lost_s, "wall_hours": lost_s / 3600.0 if lost_s is not None else None,
            "gpu_hours": gh, "usd": gh * ctx.price if gh is not None and ctx.price is not None else None,
            "gpu_hours_per_hour": float(ctx.world),
            "usd_per_hour": ctx.world * ctx.price if ctx.price is not None else None}


def _restart_from(ctx: _Context) -> str:
    return "restart " + _from(ctx)


def _from(ctx: _Context) -> str:
    if ctx.checkpoint is None:
        return "from the newest checkpoint your job has (none was reported to trainhealth)"
    return f"from the checkpoint of step {ctx.checkpoint.step}"


def _restart_phrase(c: Mapping[str, Any]) -> str:
    """``recomputes 7 steps (9.07 GPU-hours, $22.67 with the 5.0 min relaunch, 8.5 min of the run's time)``."""
    relaunch = f"the {fmt_duration(c['restart_s'])} relaunch"
    if c["gpu_hours"] is not None:
        return (f"recomputes {plural(c['steps'], 'step')} ({fmt_cost(c)} with {relaunch}, "
                f"{fmt_duration(c['wall_hours'] * 3600.0)} of the run's time)")
    what = ("recomputes an unknown number of steps" if c["steps"] is None
            else f"recomputes {plural(c['steps'], 'step')} at an unknown step time")
    return f"{what} ({relaunch} alone: {fmt_cost({'gpu_hours': c['restart_gpu_hours'], 'usd': c['restart_usd']})})"


def _restart_line(ctx: _Context) -> str:
    c = ctx.cost
    src = "measured in this run" if ctx.measured else "assumed: no relaunch measured in this run yet"
    ck = (f"the newest checkpoint is step {ctx.checkpoint.step}" if ctx.checkpoint is not None
          else "no checkpoint was reported to trainhealth, so the steps to recompute are unknown")
    steps = "" if c["steps"] is None else (
        f"; {plural(c['steps'], 'step')} x {ctx.step_s:.3g} s = {fmt_duration(c['recompute_s'])}"
        if ctx.step_s else f"; {plural(c['steps'], 'step')} x unknown step time")
    return (f"restarting: {ck}{steps}, plus a {fmt_duration(c['restart_s'])} relaunch ({src}), on {ctx.world:,} "
            f"GPUs: {_restart_phrase(c)}")


def _waiting_line(ctx: _Context, cont: Mapping[str, Any], lost_s: float | None) -> str:
    rate = f"{ctx.world:,} GPU-hours per hour" + (f" ({fmt_usd(cont['usd_per_hour'])}/h)" if ctx.price else "")
    so_far = (f"; lost so far: {fmt_duration(lost_s)} x {ctx.world:,} GPUs = {fmt_cost(cont)}"
              if cont["gpu_hours"] is not None else "; time lost so far unknown")
    return f"waiting burns {rate}: every GPU idles{so_far}"


def _culprit_line(c: Culprit) -> str:
    at = f", last step {c.step}" if c.step is not None else ", no step completed"
    return f"culprit: {c.name()}{at}" + (f": {c.why}" if c.why else "")


def _earlier_failure(a: Anomaly, host: str | None, history: Iterable[Anomaly]) -> Anomaly | None:
    """The first hang or dead rank of an earlier incident (an older generation, or one resolved before ``a``'s onset)
    whose culprit ran on ``host``: a second failure of that node."""
    if not host:
        return None
    found = []
    for h in history:
        if h.kind not in FAILURE_KINDS or h.id == a.id:
            continue
        earlier = h.gen < a.gen or (h.gen == a.gen and h.end_step is not None and h.end_step < a.step)
        if not earlier:
            continue
        c = _culprit(h.evidence)
        if (c is not None and c.host == host) or (c is None and h.kind == "dead_rank" and h.hosts == (host,)):
            found.append(h)
    return min(found, key=lambda h: (h.gen, h.step)) if found else None


def _repeat_line(host: str, earlier: Anomaly) -> str:
    return (f"{host} failed before ({earlier.kind} at step {earlier.step}, generation {earlier.gen}): a second failure "
            f"of the same node points at the node, not the job; relaunch without it (Slurm: `sbatch "
            f"--exclude={host}`, or `{_drain(host, 'failed twice', comment=False)}` with operator rights)")


def _drain(host: str, why: str, comment: bool = True) -> str:
    cmd = f'scontrol update nodename={host} state=drain reason="trainhealth: {why}"'
    return cmd + "  # Slurm (operator rights)" if comment else cmd


def _rec(ctx: _Context, action: str, summary: str, reasoning: list[str], continue_cost: dict[str, Any],
         commands: list[str], exclude: list[str], deadline_s: float | None) -> Recommendation:
    a = ctx.anomaly
    return Recommendation(
        id=f"rec:{a.id}", run=ctx.run, anomaly_id=a.id, kind=a.kind, action=action, onset_step=a.step,
        current_step=ctx.current_step, checkpoint_step=ctx.checkpoint.step if ctx.checkpoint is not None else None,
        recompute_steps=ctx.cost.get("steps"), cost=ctx.cost, continue_cost=continue_cost, reasoning=reasoning,
        summary=summary, commands=commands, exclude_hosts=exclude, deadline_s=deadline_s,
    )


def _ranks(ranks: Iterable[Any]) -> str:
    rs = list(ranks)
    shown = ", ".join(str(r) for r in rs[:8]) + (f" and {len(rs) - 8} more" if len(rs) > 8 else "")
    return ("rank " if len(rs) == 1 else "ranks ") + shown


def _ms(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.3g} s"


def _hours(h: float) -> str:
    if not math.isfinite(h):
        return "never"
    return f"{h:.2f} h" if h < 10 else f"{h:.1f} h" if h < 48 else f"{h / 24:.1f} days"
