"""Recovery advisor: exact advice for hangs, dead ranks, stragglers and slow nodes, and the stored record."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.detectors.advisor import Checkpoint
from trainhealth.detectors.recovery_advisor import RecoveryAdvisor
from trainhealth.recommendations import Recommendation

CKPTS = [Checkpoint(29), Checkpoint(59), Checkpoint(99)]  # 99 is after the current step: never chosen
CULPRIT = {"rank": 2, "host": "node-7", "pid": 4242, "step": 66,
           "why": "its heartbeat stopped while the others' went on"}
LOOP = 'for p in $(pgrep -u "$USER" python); do py-spy dump --pid "$p"; done'


def advise(anomaly: Anomaly, *, checkpoints=CKPTS, current: int = 66, step_s: float | None = 30.0, world: int = 64,
           price: float | None = 2.5, history: list[Anomaly] | None = None, **kw) -> Recommendation:
    rec = RecoveryAdvisor().advise(anomaly, run="r", checkpoints=checkpoints, current_step=current, step_s=step_s,
                                   world_size=world, gpu_hour_usd=price,
                                   history=history if history is not None else [anomaly], **kw)
    assert rec is not None
    return rec


def hang(culprit: dict | None = CULPRIT, stalled_s: float = 240.0, **ev) -> Anomaly:
    return Anomaly("hang", "critical", 66, "no step completed for 240 s", ranks=tuple(range(8)), scope="*",
                   evidence={"culprit": culprit, "stalled_s": stalled_s, "timeout_s": 120.0, **ev})


# 7 steps x 30 s + 300 s relaunch = 510 s on 64 GPUs = 9.0667 GPU-hours, x $2.5
RESTART_7 = {"steps": 7, "recompute_s": 210.0, "restart_s": 300.0, "wall_hours": 510 / 3600,
             "gpu_hours": 510 / 3600 * 64, "usd": 510 / 3600 * 64 * 2.5, "restart_gpu_hours": 300 / 3600 * 64,
             "restart_usd": 300 / 3600 * 64 * 2.5}


def test_defaults_are_the_documented_values() -> None:
    adv = RecoveryAdvisor()
    assert (adv.restart_after_s, adv.default_restart_s, adv.break_even_h) == (600.0, 300.0, 1.0)
    assert (defaults.HANG_RESTART_AFTER_S, defaults.RESTART_OVERHEAD_S, defaults.REPLACE_NODE_BREAK_EVEN_H) == (
        600.0, 300.0, 1.0)


def test_hang_with_a_culprit_pid_dumps_its_stack_then_restarts() -> None:
    a = hang(waiting_ranks=[0, 1, 3, 4, 5, 6, 7])
    rec = advise(a, now=1_700_000_000.0)
    assert (rec.id, rec.anomaly_id, rec.kind, rec.onset_step, rec.current_step) == (
        "rec:hang:*:66:0", "hang:*:66:0", "hang", 66, 66)
    assert (rec.action, rec.commands, rec.deadline_s, rec.exclude_hosts) == (
        "dump_stacks", ["py-spy dump --pid 4242"], 600.0, [])
    assert (rec.checkpoint_step, rec.recompute_steps) == (59, 7)
    assert rec.summary == (
        "Dump the stacks of rank 2: `py-spy dump --pid 4242` on host node-7 (stopped at step 66); if there is no "
        "progress by 10.0 min after the onset, restart from the checkpoint of step 59: recomputes 7 steps (9.07 "
        "GPU-hours, $22.67 with the 5.0 min relaunch, 8.5 min of the run's time)")
    assert rec.cost == pytest.approx(RESTART_7)
    # waiting: 240 s x 64 GPUs = 4.27 GPU-hours lost, then 64 GPU-hours ($160) per hour
    assert rec.continue_cost == pytest.approx({"stalled_s": 240.0, "wall_hours": 240 / 3600,
                                               "gpu_hours": 240 / 3600 * 64, "usd": 240 / 3600 * 64 * 2.5,
                                               "gpu_hours_per_hour": 64.0, "usd_per_hour": 160.0})
    assert rec.reasoning[1] == "culprit: rank 2 (host node-7, pid 4242), last step 66: its heartbeat stopped while " \
                               "the others' went on"
    assert rec.reasoning[2].startswith("7 ranks alive and waiting (ranks 0, 1, 3, 4, 5, 6, 7)")
    assert "`py-spy dump --native --pid 4242`" in rec.reasoning[3]
    # 1_700_000_000 + 360 s left = 2023-11-14 22:19:20 UTC
    assert rec.reasoning[4].endswith("stalled 4.0 min so far, 6.0 min left (at 22:19:20 UTC)")
    assert rec.reasoning[5] == ("waiting burns 64 GPU-hours per hour ($160.00/h): every GPU idles; lost so far: "
                                "4.0 min x 64 GPUs = 4.27 GPU-hours, $10.67")
    assert rec.reasoning[6] == (
        "restarting: the newest checkpoint is step 59; 7 steps x 30 s = 3.5 min, plus a 5.0 min relaunch (assumed: "
        "no relaunch measured in this run yet), on 64 GPUs: recomputes 7 steps (9.07 GPU-hours, $22.67 with the "
        "5.0 min relaunch, 8.5 min of the run's time)")


def test_hang_without_a_pid_dumps_every_process_of_the_host() -> None:
    rec = advise(hang({**CULPRIT, "pid": None}))
    assert (rec.action, rec.commands) == ("dump_stacks", [LOOP + "  # on host node-7"])
    assert rec.summary.startswith(f"Dump the stacks of rank 2: `{LOOP}` on host node-7 (stopped at step 66; no pid "
                                  "reported); if there is no progress by 10.0 min after the onset")
    assert "`py-spy dump --native --pid PID`" in rec.reasoning[2]


def test_hang_without_a_culprit_dumps_every_rank() -> None:
    rec = advise(hang(None))
    assert (rec.action, rec.commands) == ("dump_stacks", [LOOP + "  # on every host of the job"])
    assert rec.summary.startswith(f"Dump the stacks of every rank (no culprit named): `{LOOP}` on every host of the "
                                  "job; if there is no progress")
    assert rec.reasoning[1].startswith("no culprit named")


def test_hang_past_the_watchdog_timeout_restarts_with_the_measured_relaunch() -> None:
    rec = advise(hang(stalled_s=700.0, silent_ranks=[2]), restart_s=120.0)
    assert (rec.action, rec.commands, rec.deadline_s, rec.checkpoint_step) == (
        "restart", ["py-spy dump --pid 4242"], 600.0, 59)
    # 210 s recompute + 120 s measured relaunch = 330 s x 64 GPUs = 5.87 GPU-hours
    assert rec.cost["gpu_hours"] == pytest.approx(330 / 3600 * 64) and rec.cost["restart_s"] == 120.0
    assert rec.summary == (
        "No progress for 11.7 min, past the 10.0 min NCCL watchdog timeout: restart from the checkpoint of step 59: "
        "recomputes 7 steps (5.87 GPU-hours, $14.67 with the 2.0 min relaunch, 5.5 min of the run's time); first "
        "dump the stacks of rank 2: `py-spy dump --pid 4242` on host node-7 (stopped at step 66) for the post-mortem")
    assert any("heartbeat is gone too" in line for line in rec.reasoning)
    assert any("(measured in this run)" in line for line in rec.reasoning)
    assert any(line.endswith("stalled 11.7 min so far, the deadline has passed") for line in rec.reasoning)


def dead(gen: int = 1, state: str = "crashed", step: int = 66, **ev) -> Anomaly:
    return Anomaly("dead_rank", "critical", step, "rank 2 went silent", ranks=(2,), hosts=("node-7",), gen=gen,
                   evidence={"culprit": {**CULPRIT, "step": step}, "job_state": state, "silent_s": 90.0, **ev})


def test_dead_rank_crashed_on_a_host_that_failed_before_restarts_without_it() -> None:
    earlier = Anomaly("dead_rank", "critical", 40, "rank 2 went silent", ranks=(2,), hosts=("node-7",), gen=0,
                      end_step=40, status=RESOLVED, evidence={"culprit": {**CULPRIT, "step": 40}})
    a = dead(victims=[3, 5])
    same_incident = replace(hang(), gen=1)  # the hang the dead rank caused: same culprit, not an earlier failure
    rec = advise(a, history=[earlier, same_incident, a])
    assert (rec.id, rec.action, rec.checkpoint_step, rec.recompute_steps, rec.deadline_s) == (
        "rec:dead_rank:2:66:1", "restart", 59, 7, None)
    assert rec.exclude_hosts == ["node-7"]
    assert rec.commands == [
        'scontrol update nodename=node-7 state=drain reason="trainhealth: failed twice"  # Slurm (operator rights)',
        "sbatch --exclude=node-7 <job script>  # Slurm: relaunch"]
    assert rec.summary == (
        "Restart from the checkpoint of step 59: recomputes 7 steps (9.07 GPU-hours, $22.67 with the 5.0 min "
        "relaunch, 8.5 min of the run's time); exclude node-7 (it failed before at step 40): e.g. "
        "`sbatch --exclude=node-7`, or drain it")
    assert rec.cost == pytest.approx(RESTART_7)
    assert rec.reasoning[2] == "ranks 3, 5 stopped after it: victims waiting on it, not causes"
    assert rec.reasoning[3] == "the job crashed (every rank's heartbeat is gone): only a relaunch brings it back"
    assert rec.reasoning[-1].startswith("node-7 failed before (dead_rank at step 40, generation 0)")


def test_dead_rank_first_failure_is_not_excluded() -> None:
    a = dead(gen=0, state="hung")
    rec = advise(a, history=[hang(), a])  # the hang of the same incident does not count
    # Its heartbeat is gone while the others live: first see whether the process is stopped, stuck or dead.
    assert (rec.action, rec.deadline_s, rec.exclude_hosts, rec.commands) == ("check_process", 600.0, [], [
        "ssh node-7 ps -o pid,stat,etime,cmd -p 4242  # T: stopped (kill -CONT 4242), D: stuck in the kernel, "
        "nothing: it died",
        "ssh node-7 dmesg -T | grep -i -E 'killed process|out of memory' | tail -3"])
    assert rec.summary == ("Check rank 2's process on host node-7: `ps -o pid,stat,etime,cmd -p 4242` (T: stopped — "
                           "`kill -CONT 4242`; D: stuck in the kernel; nothing: it died — see the kernel log); if "
                           "nothing moved 10.0 min after the onset, restart from the checkpoint of step 59: "
                           "recomputes 7 steps (9.07 GPU-hours, $22.67 with the 5.0 min relaunch, 8.5 min of the run's "
                           "time)")
    assert rec.reasoning[2].startswith("rank 2's heartbeat stopped: its process was stopped (SIGSTOP, a debugger)")
    assert rec.reasoning[-2] == "no earlier failure on node-7 in this run: no reason to exclude it yet"
    assert rec.continue_cost == pytest.approx({"stalled_s": 90.0, "wall_hours": 0.025, "gpu_hours": 1.6, "usd": 4.0,
                                               "gpu_hours_per_hour": 64.0, "usd_per_hour": 160.0})


def test_dead_rank_alive_but_stuck_gets_its_stack_dumped() -> None:
    a = dead(gen=0, state="running", stuck_ranks=[2], silent_ranks=[], idle_s=150.0)
    rec = advise(a, current=80)
    assert (rec.action, rec.commands, rec.deadline_s, rec.recompute_steps) == (
        "dump_stacks", ["py-spy dump --pid 4242"], 600.0, 21)
    assert rec.continue_cost["stalled_s"] == 150.0


def straggler(rank_median_s: float, step: int = 60) -> Anomaly:
    return Anomaly("straggler", "warning", step, "rank 5 is a straggler", ranks=(5,), hosts=("node-3",),
                   evidence={"score": 0.1 / rank_median_s, "rank_median_s": rank_median_s, "best_median_s": 0.1,
                             "typical_median_s": 0.102, "windows": 3})


def test_straggler_worth_replacing() -> None:
    # 0.2 s of each 1 s step lost to rank 5 (0.302 - 0.102) = 20 % of 512 GPUs = 102.4 GPU-hours per hour;
    # restart: 7 steps x 1 s + 300 s = 307 s of the whole job -> break-even 307 / 3600 / 0.2 = 0.43 h
    rec = advise(straggler(0.302), step_s=1.0, world=512, price=2.0)
    assert (rec.action, rec.checkpoint_step, rec.exclude_hosts, rec.deadline_s) == (
        "replace_node", 59, ["node-3"], None)
    assert rec.commands == [
        'scontrol update nodename=node-3 state=drain reason="trainhealth: straggler"  # Slurm (operator rights)',
        "sbatch --exclude=node-3 <job script>  # Slurm: relaunch"]
    assert rec.cost["break_even_h"] == 0.43
    assert rec.cost["gpu_hours"] == pytest.approx(307 / 3600 * 512)
    assert rec.continue_cost == pytest.approx({"lost_fraction": 0.2, "wall_hours": 0.2 * 6 / 3600,
                                               "gpu_hours": 0.2 * 6 / 3600 * 512, "usd": 0.2 * 6 / 3600 * 1024,
                                               "gpu_hours_per_hour": 102.4, "usd_per_hour": 204.8})
    assert rec.summary == (
        "Replace rank 5 on node-3: it costs 20.0% of the job's time (102.4 GPU-hours per hour, $204.80/h); a restart "
        "without it from the checkpoint of step 59 recomputes 7 steps (43.7 GPU-hours, $87.32 with the 5.0 min "
        "relaunch, 5.1 min of the run's time) and pays back in 0.43 h (< 1 h). Drain it (Slurm: `scontrol update "
        "nodename=node-3 state=drain reason=\"trainhealth: straggler\"`) and relaunch with `sbatch --exclude=node-3`.")
    assert rec.reasoning[1] == (
        "rank 5 on node-3: sections take 302.0 ms (median) vs 102.0 ms on a typical rank (fastest 100.0 ms), score "
        "0.33; a node as fast as a typical one saves 200.0 ms of each 1 s step = 20.0% of the job's time")


def test_straggler_not_worth_a_restart_is_kept() -> None:
    # 26 ms of 1 s = 2.6 %: 13.3 GPU-hours per hour on 512 GPUs; 601 steps + 300 s = 901 s -> 9.63 h to break even
    rec = advise(straggler(0.128), checkpoints=[Checkpoint(999)], current=1600, step_s=1.0, world=512, price=2.0)
    assert (rec.action, rec.commands, rec.exclude_hosts, rec.recompute_steps) == ("keep", [], [], 601)
    assert rec.cost["break_even_h"] == 9.63
    assert rec.continue_cost["gpu_hours_per_hour"] == pytest.approx(13.312)
    assert rec.summary == (
        "Keep rank 5 on node-3 for now: it costs 2.6% of the job's time (13.3 GPU-hours per hour, $26.62/h), but a "
        "restart without it from the checkpoint of step 999 recomputes 601 steps (128.1 GPU-hours, $256.28 with the "
        "5.0 min relaunch, 15.0 min of the run's time) and would pay back only after 9.63 h (≥ 1 h); leave it out "
        "at the next planned restart")
    assert ("right after the next checkpoint save the restart costs only the relaunch: break-even 3.21 h"
            in rec.reasoning)


def test_slow_node_without_checkpoint_step_time_or_price() -> None:
    a = Anomaly("slow_node", "warning", 40, "node node-b is slow", ranks=tuple(range(8, 16)), hosts=("node-b",),
                scope="node-b", evidence={"node_score": 0.66, "node_median_s": 0.15, "best_median_s": 0.1,
                                          "typical_median_s": 0.1, "slow_ranks": 8, "n_ranks": 8})
    rec = advise(a, checkpoints=[], current=100, step_s=None, world=16, price=None)
    # 50 ms of 150 ms of sections = 1/3 (an upper bound without the step time): 5.33 GPU-hours per hour;
    # the relaunch alone: 300 s of the job / (1/3) = at least 0.25 h
    assert (rec.id, rec.action, rec.checkpoint_step, rec.recompute_steps, rec.exclude_hosts) == (
        "rec:slow_node:node-b:40:0", "replace_node", None, None, ["node-b"])
    assert rec.cost == pytest.approx({"steps": None, "recompute_s": None, "restart_s": 300.0, "wall_hours": None,
                                      "gpu_hours": None, "usd": None, "restart_gpu_hours": 300 / 3600 * 16,
                                      "restart_usd": None, "break_even_h": 0.25})
    assert rec.continue_cost == pytest.approx({"lost_fraction": 1 / 3, "wall_hours": None, "gpu_hours": None,
                                               "usd": None, "gpu_hours_per_hour": 16 / 3, "usd_per_hour": None})
    assert rec.summary.startswith(
        "Replace node node-b (8 ranks): it costs 33.3% of the job's time (5.33 GPU-hours per hour); a restart without "
        "it from the newest checkpoint your job has (none was reported to trainhealth) recomputes an unknown number "
        "of steps (the 5.0 min relaunch alone: 1.33 GPU-hours) and pays back in at least 0.25 h (< 1 h); do it right "
        "after a checkpoint save, when only the relaunch is lost.")
    assert "$" not in rec.summary


def test_a_nodes_slow_network_is_costed_by_its_collective() -> None:
    # node-b's collectives take 0.402 s vs 0.102 s on node-a (tests/test_network.py's run): every rank waits for
    # them, 0.3 s of each 1.258 s step (the detector's window median; the run's step time unknown) = 23.8 % of 16
    # GPUs = 3.82 GPU-hours per hour; the relaunch alone: 300 s / 0.2385 = at least 0.35 h to break even.
    ev = {"node_share": 0.3196, "others_share": 0.0811, "excess_share": 0.2385, "node_comm_s": 0.402,
          "others_comm_s": 0.102, "step_s": 1.258, "high_ranks": 8, "n_ranks": 8, "timed_ranks": 8}
    a = Anomaly("network_slow", "warning", 40, "node-b: 32.0% of step time in communication", scope="node-b",
                ranks=tuple(range(8, 16)), hosts=("node-b",), evidence=ev)
    rec = advise(a, checkpoints=[], current=100, step_s=None, world=16, price=None)
    assert (rec.id, rec.action, rec.exclude_hosts) == ("rec:network_slow:node-b:40:0", "replace_node", ["node-b"])
    assert rec.continue_cost == pytest.approx({"lost_fraction": 0.3 / 1.258, "wall_hours": 60 * 1.258 / 3600 * (
        0.3 / 1.258), "gpu_hours": 60 * 0.3 / 3600 * 16, "usd": None, "gpu_hours_per_hour": 16 * 0.3 / 1.258,
                                               "usd_per_hour": None})
    assert rec.cost["break_even_h"] == 0.35
    assert rec.reasoning[1] == (
        "node node-b (8 ranks): its ranks' collectives take 402.0 ms (median) vs 102.0 ms on the other nodes; every "
        "rank waits for the slowest collective; a node whose network is as fast as the others' saves 300.0 ms of each "
        "1.26 s step = 23.8% of the job's time")
    assert rec.commands == [
        'scontrol update nodename=node-b state=drain reason="trainhealth: network_slow"  # Slurm (operator rights)',
        "sbatch --exclude=node-b <job script>  # Slurm: relaunch"]
    assert RecoveryAdvisor.concerns(a) and not RecoveryAdvisor.concerns(replace(a, status=RESOLVED))


def test_no_checkpoint_keeps_the_other_figures() -> None:
    rec = advise(hang(), checkpoints=[])
    assert (rec.action, rec.checkpoint_step, rec.recompute_steps) == ("dump_stacks", None, None)
    assert rec.summary.endswith(
        "restart from the newest checkpoint your job has (none was reported to trainhealth): recomputes an unknown "
        "number of steps (the 5.0 min relaunch alone: 5.33 GPU-hours, $13.33)")
    assert rec.continue_cost["gpu_hours"] == pytest.approx(240 / 3600 * 64)


def test_no_step_time() -> None:
    rec = advise(dead(gen=0), step_s=None)
    assert (rec.action, rec.recompute_steps, rec.cost["gpu_hours"], rec.cost["recompute_s"]) == (
        "restart", 7, None, None)
    assert rec.cost["restart_gpu_hours"] == pytest.approx(300 / 3600 * 64)
    assert rec.summary == ("Restart from the checkpoint of step 59: recomputes 7 steps at an unknown step time (the "
                           "5.0 min relaunch alone: 5.33 GPU-hours, $13.33)")


def test_no_price() -> None:
    rec = advise(hang(), price=None)
    assert (rec.cost["usd"], rec.cost["restart_usd"], rec.continue_cost["usd"], rec.continue_cost["usd_per_hour"]) == (
        None, None, None, None)
    assert rec.cost["gpu_hours"] == pytest.approx(RESTART_7["gpu_hours"])
    assert "$" not in rec.summary and "(9.07 GPU-hours with the 5.0 min relaunch" in rec.summary


def test_only_active_machine_incidents_concern_it() -> None:
    concerns = RecoveryAdvisor.concerns
    assert all(concerns(Anomaly(k, "critical", 1, "m")) for k in ("hang", "dead_rank", "straggler", "slow_node"))
    assert not concerns(Anomaly("hang", "critical", 1, "m", status=RESOLVED))
    assert not any(concerns(Anomaly(k, "warning", 1, "m")) for k in ("rank_outlier", "loss_spike", "throughput_drop"))
    assert RecoveryAdvisor().advise(Anomaly("loss_spike", "warning", 1, "m"), run="r", checkpoints=[], current_step=1,
                                    step_s=1.0, world_size=1, gpu_hour_usd=None, history=[]) is None


def test_missing_or_malformed_evidence_degrades() -> None:
    bare = Anomaly("hang", "critical", 66, "stalled", evidence={"culprit": {"host": "node-7"}, "stalled_s": "soon"})
    rec = advise(bare)
    assert (rec.action, rec.commands[0]) == ("dump_stacks", LOOP + "  # on every host of the job")
    assert rec.continue_cost["gpu_hours"] is None
    slow = advise(Anomaly("straggler", "warning", 60, "slow", ranks=(5,), evidence={"score": 0.75}), step_s=1.0)
    assert slow.continue_cost["lost_fraction"] == pytest.approx(0.25) and slow.commands == []
    nothing = advise(Anomaly("straggler", "warning", 60, "slow", ranks=(5,)))
    assert (nothing.action, nothing.continue_cost) == ("keep", {})


def test_round_trip_and_old_records() -> None:
    recs = [advise(hang()), advise(dead(), history=[dead(gen=0, step=40), dead()]),
            advise(straggler(0.302), step_s=1.0, world=512)]
    for rec in recs:
        assert Recommendation.from_dict(rec.to_dict()) == rec
        assert Recommendation.from_dict(json.loads(rec.to_json())) == rec
    d = recs[1].to_dict()
    assert (d["commands"][1], d["exclude_hosts"], d["deadline_s"]) == (
        "sbatch --exclude=node-7 <job script>  # Slurm: relaunch", ["node-7"], None)
    assert recs[0].to_dict()["deadline_s"] == 600.0
    old = {"id": "rec:divergence:*:400:0", "run": "r", "anomaly_id": "divergence:*:400:0", "kind": "divergence",
           "action": "rollback", "onset_step": 400, "current_step": 550, "checkpoint_step": 299,
           "skip_steps": [300, 600], "skip_samples": None, "skip_batches": None, "recheck_step": None,
           "recompute_steps": 251, "cost": {}, "continue_cost": {}, "options": [], "reasoning": [], "summary": "s",
           "status": "proposed", "history": []}
    loaded = Recommendation.from_dict(old)
    assert (loaded.commands, loaded.exclude_hosts, loaded.deadline_s, loaded.skip_steps) == ([], [], None, (300, 600))


def test_straggler_costing_under_one_percent_gets_no_card() -> None:
    def rec(rank_median_s: float) -> Recommendation | None:
        return RecoveryAdvisor().advise(straggler(rank_median_s), run="r", checkpoints=CKPTS, current_step=80,
                                        step_s=0.2, world_size=64, gpu_hour_usd=2.5, history=[])
    # 0.1035 s against a typical 0.102 s in 0.2 s steps: 0.75 % of the job's time; keeping it needs no advice.
    assert rec(0.1035) is None
    assert rec(0.105).continue_cost["lost_fraction"] == pytest.approx(0.015)  # 1.5 %: costed
