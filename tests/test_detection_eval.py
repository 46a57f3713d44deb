"""The detection evaluation (bench/detection_eval.py): scoring, peer rules, labels, corpus, and the script."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import detection_eval as de  # noqa: E402
import eval_corpus as ec  # noqa: E402
import eval_peers as ep  # noqa: E402

from trainhealth.anomaly import KINDS  # noqa: E402

L = ec.Label
D = de.Det


# -- scoring ----------------------------------------------------------------------------------------------------
def test_score_counts_hits_duplicates_ignored_and_false_alarms_exactly() -> None:
    labels = [
        L("loss_spike", 100, 104, 0, 2),
        L("loss_spike", 300, 300, 0, 2),
        L("loss_spike", 500, 500, 0, 2),                 # never detected: a miss
        L("divergence", 700, 799),                       # a loss spike here is accepted, not a false alarm
        L("loss_spike", 900, 900, ignore=True),          # ambiguous
    ]
    dets = [D("loss_spike", 101), D("loss_spike", 103), D("loss_spike", 302), D("loss_spike", 600),
            D("loss_spike", 750), D("loss_spike", 900), D("loss_spike", 950), D("divergence", 701)]
    sc = de.score(dets, labels, list(range(1000)), "loss_spike")
    assert (sc.labels, sc.tp, sc.fn, sc.fa, sc.dup, sc.ignored) == (3, 2, 1, 2, 1, 2)
    assert sc.delays == [1, 2] and sc.delay_median == 1.5 and sc.delay_p90 == 2
    assert sc.precision == 0.5 and sc.recall == pytest.approx(2 / 3) and sc.f1 == pytest.approx(4 / 7)
    # Healthy: 1000 steps minus [100, 106], [300, 302], [500, 502], [700, 799], [900, 900] = 886.
    assert sc.healthy == 886 and sc.fa_per_10k == pytest.approx(2e4 / 886)
    assert sc.fa_steps == [600, 950] and [m.start for m in sc.missed] == [500]
    div = de.score(dets, labels, list(range(1000)), "divergence")
    assert (div.tp, div.fa, div.delays, div.healthy) == (1, 0, [1], 900)


def test_score_rank_scoped_labels_need_the_right_rank() -> None:
    labels = [L("straggler", 200, 400, 40, 0, ranks=(5,))]
    dets = [D("straggler", 180, (3,)), D("straggler", 170, (5,)), D("straggler", 210, (5,))]
    sc = de.score(dets, labels, list(range(600)), "straggler")
    assert (sc.tp, sc.fa, sc.dup, sc.delays) == (1, 1, 1, [-30])
    assert de.score(dets, labels, list(range(600)), "straggler", covered=False).healthy == 0


def test_score_sums_and_reports_none_without_labels() -> None:
    total = de.Score()
    total.add(de.score([D("hang", 10)], [], list(range(100)), "hang"))
    total.add(de.score([], [L("hang", 50, 50, 1, 1)], list(range(100)), "hang"))
    assert (total.labels, total.tp, total.fa, total.healthy) == (1, 0, 1, 197)
    assert total.f1 == 0.0 and total.precision == 0.0
    assert de.score([], [], list(range(10)), "hang").f1 is None


# -- peer rules -------------------------------------------------------------------------------------------------
def _flags(peer, losses, grad_norms=None, step_s=None) -> list[tuple[int, list[str]]]:
    out = []
    for i, x in enumerate(losses):
        k = peer.feed(i, i, x, grad_norms[i] if grad_norms else None, step_s[i] if step_s else None)
        if k:
            out.append((i, k))
    return out


def test_llm_foundry_rule_flags_the_fifth_consecutive_outlier_and_persistent_high_loss() -> None:
    # 100 losses of 1.0 fill the window; 3.0 >= 2 x mean from step 150: outliers 150..154, the 5th (> patience 4)
    # is the spike, and every further outlier too.
    losses = [3.0 if 150 <= i < 160 else 1.0 for i in range(170)]
    assert _flags(ep.LlmFoundryPeer(), losses) == [(i, ["loss_spike"]) for i in range(154, 160)]
    # Losses of 12 > loss_cap 10 from the start: from step 2 x window = 200 half the window is above the cap.
    high = _flags(ep.LlmFoundryPeer(), [12.0] * 205)
    assert high[0] == (200, ["divergence"]) and len(high) == 5


def test_wandb_zscore_flags_exactly_above_three_population_sds() -> None:
    base = [1.0, 2.0, 3.0] * 10                       # mean 2, population SD sqrt(2/3)
    sd = math.sqrt(2 / 3)
    series = [*base, 2.0 + 3.01 * sd]                  # z = 3.01 at index 30
    assert _flags(ep.WandbZScorePeer(), series) == [(30, ["loss_spike"])]
    assert _flags(ep.WandbZScorePeer(), [*base, 2.0 + 2.99 * sd]) == []
    # grad norm and step time are watched the same way, under their own kinds
    assert _flags(ep.WandbZScorePeer(), [1.0] * 31, [*base, 10.0], [*base, 10.0]) == [
        (30, ["grad_norm_spike", "slow_step"])]


def test_trainpulse_monitor_defaults() -> None:
    # Loss > 5 x the rolling mean of 50 (window full from step 50); grad norm > 100; step time > 3 x mean of 20.
    losses = [1.0] * 70
    losses[40], losses[60] = 9.0, 6.0  # at 40 the window is not full yet; at 60 its mean is 1.16
    gn = [1.0] * 70
    gn[65] = 101.0
    st = [0.5] * 70
    st[25] = 1.6
    assert _flags(ep.TrainpulsePeer(), losses, gn, st) == [(25, ["slow_step"]), (60, ["loss_spike"]),
                                                          (65, ["grad_norm_explosion"])]
    assert _flags(ep.TrainpulsePeer(), [1.0, float("nan")]) == [(1, ["nan_inf"])]


def test_lightning_spike_detection_real_rule_and_fast_running_mean_agree() -> None:
    rng = random.Random(5)
    losses = []
    for i in range(1500):
        x = (3 * math.exp(-i / 300) + 1) * math.exp(0.3 * rng.gauss(0, 1))
        losses.append(x * 5 if i in (400, 1000) else float("nan") if i == 1200 else x)
    real = _flags(ep.LightningPeer(fast=False), losses)
    assert real == _flags(ep.LightningPeer(fast=True), losses)
    assert (1000, ["loss_spike"]) in real and (1200, ["loss_spike"]) in real
    # warm-up 1: the second loss is judged against the first; 3.0 >= 1.0 + 2 x 1.0 is a spike, 2.9 is not
    assert _flags(ep.LightningPeer(), [1.0, 3.0]) == [(1, ["loss_spike"])]
    assert _flags(ep.LightningPeer(), [1.0, 2.9]) == []


def test_peer_alerts_on_consecutive_points_are_one_detection() -> None:
    from trainhealth.detectors.aggregate import StepAggregate

    fd = de._Feeder(peers=False)
    fd.peers = [ep.LlmFoundryPeer()]
    fd.peer_dets = {"llm-foundry": []}
    for i, x in enumerate([1.0] * 100 + [3.0] * 10 + [1.0] * 20 + [3.0] * 6):
        fd.agg(StepAggregate(i, 0, 0.0, None, float(i), x, None, None, None, None, 1, (None,), 0.0), None)
    assert fd.peer_dets["llm-foundry"] == [D("loss_spike", 104), D("loss_spike", 134)]


# -- labels and corpus ------------------------------------------------------------------------------------------
def test_labels_file_parses_and_every_file_exists(real_logs: Path) -> None:
    entries = ec.load_labels()
    listed = {e["path"] for e in entries}
    on_disk = {p.name for p in real_logs.iterdir() if p.name != "MANIFEST.md"}
    assert listed == on_disk
    for e in entries:
        assert (real_logs / e["path"]).exists(), e["path"]
        assert e["status"] in ("labelled", "healthy", "excluded") and e.get("note")
        labels = ec.labels_of(e)
        assert all(lab.kind in KINDS and lab.start <= lab.end and lab.why for lab in labels)
        assert bool([lab for lab in labels if not lab.ignore]) == (e["status"] == "labelled"), e["path"]
    assert len(ec.real_sources(real_logs)) == len(entries) - 2  # the two Kineto traces are excluded


def test_allreduce_bench_log_parses_into_16_ranks_of_5_iterations(real_logs: Path) -> None:
    per, hosts = ec.parse_allreduce_bench(real_logs / "allreduce_bench_16ranks.log")
    assert sorted(per) == list(range(16)) and {len(v) for v in per.values()} == {5}
    # Ranks 0 and 11 print their headers before both durations; the importer gives each the nearest one.
    assert per[6][0] == 2.1418 and (per[0][0], per[11][0]) == (1.8093, 1.0927)
    assert max(max(v[1:]) for v in per.values()) == 0.7107
    assert hosts[0] == "r6i6n4" and len(set(hosts.values())) == 4


def test_synthetic_labels_are_where_the_anomalies_were_injected() -> None:
    src = next(s for s in ec.synthetic_sources(quick=True, only="^spikes_one_step$") if s.split == "dev")
    losses = {it[1].step: it[1].loss for it in src.items() if it[0] == "step"}
    spikes = [lab for lab in src.labels if lab.kind == "loss_spike" and not lab.ignore]
    assert spikes
    for lab in spikes:
        before = statistics.median(losses[s] for s in range(lab.start - 20, lab.start))
        assert losses[lab.start] >= 1.15 * before
    # same seed, same run
    again = next(s for s in ec.synthetic_sources(quick=True, only="^spikes_one_step$") if s.split == "dev")
    assert {it[1].step: it[1].loss for it in again.items() if it[0] == "step"} == losses


# -- the script -------------------------------------------------------------------------------------------------
def test_quick_json_run_has_rows_for_every_kind() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "detection_eval.py"), "--quick", "--json"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=900)
    doc = json.loads(out.stdout)
    rows = {(r["split"], r["kind"], r["system"]) for r in doc["rows"]}
    for kind in KINDS:
        for split in de.SPLITS:
            assert (split, kind, "ours") in rows, (split, kind)
    assert ("real", "loss_spike", "lightning") in rows and ("all", "divergence", "llm-foundry") in rows
    assert {t["kind"] for t in doc["targets"]} >= set(KINDS)
    assert doc["meta"]["runs_by_split"]["real"] == 22


# -- leave-one-file-out (bench/lofo.py) ---------------------------------------------------------------------------
def test_lofo_sets_parameters_on_nested_detectors_too() -> None:
    import lofo

    from trainhealth.detectors.pipeline import RunPipeline

    pipe = RunPipeline()
    lofo.setter({("LossSpikeDetector", "z_open"): 9.5, ("SlowStepDetector", "ratio"): 3.0})(pipe)
    spikes = [d for d in lofo.detectors_of(pipe) if type(d).__name__ == "LossSpikeDetector"]
    assert len(spikes) == 2 and {d.z_open for d in spikes} == {9.5}  # the pipeline's and the divergence's own
    assert [d.ratio for d in lofo.detectors_of(pipe) if type(d).__name__ == "SlowStepDetector"] == [3.0]
    with pytest.raises(AttributeError, match="LossSpikeDetector has no parameter 'nope'"):
        lofo.setter({("LossSpikeDetector", "nope"): 1.0})(pipe)


def test_lofo_chooses_on_the_other_files_only() -> None:
    import lofo

    t = lofo.Tunable("loss_spike", "LossSpikeDetector", "z_open", (5.0, 6.5, 8.0))
    hit, miss, fa = de.Score(labels=1, tp=1), de.Score(labels=1), de.Score(fa=1, healthy=1000)
    # file 0 favours 5.0 (its label is found only there); files 1 and 2 favour 8.0 (5.0 false-alarms on them)
    per_value = {5.0: [hit, fa, fa], 6.5: [miss, de.Score(), de.Score()], 8.0: [miss, de.Score(), de.Score()]}
    assert lofo.choose(t, per_value, leave_out=0, default=6.5) == 6.5  # tie of 6.5 and 8.0: nearest the default
    assert lofo.choose(t, per_value, leave_out=1, default=6.5) == 5.0  # F1 on files 0 and 2: 5.0 finds file 0's label
    per_value[8.0] = [hit, de.Score(), de.Score()]
    assert lofo.choose(t, per_value, leave_out=1, default=6.5) == 8.0  # finds file 0's label without the alarm
