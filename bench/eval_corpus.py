"""The labelled corpus of the detection evaluation: seeded synthetic runs with exact ground truth, and real logs.

Used by ``bench/detection_eval.py``. Two kinds of :class:`Source`:

* **synthetic** scenarios (:data:`SCENARIOS`), each a generator of the records a real job's collectors would
  send — per-rank :class:`~trainhealth.wire.StepRecord` with sections, ``run_start`` / checkpoint / badput
  :class:`~trainhealth.wire.Event` and heartbeat snapshots (the ``th:{run}:hb`` hash the service reads,
  checked every 5 s of simulated time) — together with the exact labels of what was injected. Each scenario
  runs under several seeds: :data:`DEV_SEEDS` are the seeds the detectors may be developed and tuned on,
  :data:`HELDOUT_SEEDS` are reported separately and must never be tuned on (a generalisation check).
* **real** logs from ``shared/real_logs``, labelled by hand in ``bench/labels.toml`` (each label explained there).

Labels
------
A :class:`Label` is a kind, a step range ``[start, end]`` and a tolerance ``(before, after)`` in steps: a
detection matches when its onset step falls in ``[start - before, end + after]``. ``ignore=True`` marks an
ambiguous stretch (a noise excursion as large as a small spike, a warm-up step): detections there count neither
as hits nor as false alarms. Rank-scoped labels name ``ranks`` (and ``hosts``).

Ground-truth conventions of the synthetic runs (what a person reading the curves would call an anomaly; step
counts are those of the full-length runs, 2000-3000 steps for one rank, 1200 for 16 ranks):

* a **loss spike** is at least +25 % and at least 10 noise SDs (in log-loss) above the curve; shapes: one step,
  a plateau of 3-30 steps, a jump decaying back with a time constant of 10-40 steps (labelled until the excess
  is within 3 noise SDs);
* with the loss spikes the grad norm is either not logged (one run in three) or rises with the loss,
  x(loss factor)^k, k ~ U[1.5, 4] (labelled ``grad_norm_spike`` where >= 4x, ignored where 1.5-4x);
* a spike that **never recovers** is labelled twice: ``loss_spike`` at the jump and ``divergence`` from the jump
  to the end; a **slow divergence** (log-loss rising linearly, +50 % over 200-1000 steps) is ``divergence`` only;
* a **grad-norm spike** is at least 4x (and 10 noise SDs) the run's level; an **explosion** grows the grad norm
  exponentially (x1000 over 50-250 steps) until the loss turns NaN;
* **skipped steps** are runs of 10-100 consecutive fp16 overflow skips (loss-scale collapse) or bursts where
  30-60 % of 100-300 steps are skipped; one isolated skip every 1000-3000 steps is normal fp16 operation (PyTorch
  ``GradScaler`` doubles the scale every ``growth_interval=2000`` clean steps and the next overflow halves it
  again): an ``info`` ``skipped_steps`` there is allowed (``max_severity``), a warning is a false alarm;
* a **slow step** is at least 3x the typical step time; hiccups up to 1.6x, a periodic slow step (every 10th step
  4-5.5x, as the real modded-nanogpt log shows), the first steps after a (re)start (compilation, warm-up) and the
  step that contained a hang are not labelled slow steps (the last two are ``ignore``);
* a **throughput drop** is a step-time level shift of x1.15-2 lasting 330-650 steps;
* a **straggler** is one rank whose own sections take 1.3-2x longer for 130-260 steps; a **slow node** is every
  rank of one host 1.3-1.8x slower for 400-600 steps; a **rank outlier** is one rank whose data loading takes
  5-15x longer and whose forward time turns erratic (log-SD 0.25) for 300-400 steps; a **hang** is every rank
  stuck for 300-1500 s with live heartbeats (onset = the last completed step); a **dead rank** stops its records
  and heartbeats while the others block in the collective until the NCCL timeout (600 s) kills the job, which
  then restarts from its last checkpoint (its onset may be named from its last heartbeat, up to 5 s old: the
  tolerance before covers the steps of 5 s);
* checkpoint saves (120-1500 s, heartbeats ``phase=checkpoint_save``) and evaluations (60-600 s, heartbeats
  ``phase=badput`` as ``Monitor.timed_badput`` sets it) are healthy: they are the ledger's badput, not anomalies;
* while every process of a crashed job is gone, a ``hang`` or ``dead_rank`` saying "process or node down" is
  ``ignore``: true, but the crash is scored as ``restart`` when the job comes back.
"""

from __future__ import annotations

import math
import os
import random
import re
import sys
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainhealth.anomaly import SEVERITIES
from trainhealth.wire import Event, StepRecord

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
LABELS_PATH = Path(__file__).resolve().parent / "labels.toml"

#: Seeds the detectors may be developed (and tuned) on.
DEV_SEEDS = (0, 1, 2)
#: Seeds reported separately and never used for tuning.
HELDOUT_SEEDS = (1000, 1001, 1002)
#: ``--quick``: one seed of each split, runs shortened by this factor.
QUICK_SEEDS = ((0,), (1000,))
QUICK_SCALE = 0.25

#: Seconds between the collectors' heartbeats (``trainhealth.defaults.HEARTBEAT_INTERVAL_S``) and between the
#: simulated service's hang checks.
HB_INTERVAL_S = 5.0
#: PyTorch's NCCL process-group timeout (``torch.distributed`` default for NCCL, 10 min): how long the surviving
#: ranks block in the collective after a rank died before the job is torn down.
NCCL_TIMEOUT_S = 600.0
#: The step span of an ``anywhere`` label (a log without training steps): any step.
ANYWHERE = 2**62
#: Kinds whose labels' ``ranks`` decide a match (the detection must blame those ranks and no other); on other
#: kinds (a job-wide hang naming the ranks that reported it) the ranks are information only.
RANK_SCOPED = frozenset({"straggler", "slow_node", "rank_outlier", "dead_rank"})

Item = tuple  # ("step", StepRecord) | ("event", Event) | ("hb", now, {rank: heartbeat dict})


@dataclass(frozen=True)
class Label:
    """One labelled condition (or an ambiguous stretch with ``ignore=True``).

    Attributes
    ----------
    kind : str
        Anomaly kind (``trainhealth.anomaly.KINDS``).
    start, end : int
        First and last step of the condition (inclusive).
    before, after : int
        Tolerance in steps: a detection's onset may fall in ``[start - before, end + after]``.
    ranks, hosts : tuple
        Ranks / hosts concerned (empty: the whole job).
    ignore : bool
        Ambiguous: detections here are neither credited nor counted as false alarms.
    why : str
        Explanation.
    severity : str | None
        The severity the condition deserves (``labels.toml``'s ``severity``), when stated.
    max_severity : str | None
        On an ambiguous stretch: a detection there louder than this is a false alarm after all.
    """

    kind: str
    start: int
    end: int
    before: int = 0
    after: int = 0
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    ignore: bool = False
    why: str = ""
    severity: str | None = None
    max_severity: str | None = None

    @property
    def lo(self) -> int:
        return self.start - self.before

    @property
    def hi(self) -> int:
        return self.end + self.after


@dataclass
class Source:
    """One run of the corpus: a synthetic scenario under one seed, or one real log.

    Attributes
    ----------
    name : str
        ``scenario@seed`` or the log's file name.
    split : str
        ``dev``, ``heldout`` or ``real``.
    family : str
        Scenario name (``real`` for logs).
    labels : list[Label]
        Filled by the generator as it runs (complete once :meth:`items` is exhausted).
    world_size : int
        Ranks.
    items : Callable[[], Iterator[Item]] | None
        Synthetic / parsed multi-rank input, in time order.
    path : Path | None
        A real log for ``trainhealth.detectors.offline.OfflineRun``.
    note : str
        What the source is.
    """

    name: str
    split: str
    family: str
    labels: list[Label] = field(default_factory=list)
    world_size: int = 1
    items: Callable[[], Iterator[Item]] | None = None
    path: Path | None = None
    note: str = ""


# ---------------------------------------------------------------------------------------------------------------
# Simulation engine
# ---------------------------------------------------------------------------------------------------------------
class _Cluster:
    """A simulated job: a clock, ranks on hosts, their heartbeats and the service's periodic heartbeat check.

    Every method is a generator of items in time order (``yield from``). The live ranks step together, so one
    timeline of their shared state (last completed step, when, phase) serves all of them; a heartbeat carries
    that state as it was when the rank's heartbeat thread last wrote it (every ``HB_INTERVAL_S`` from a
    per-rank offset), as ``trainhealth.Monitor`` does. A new process reports no step until its first one.
    """

    def __init__(self, rng: random.Random, world: int = 1, ranks_per_host: int = 4, heartbeats: bool = False,
                 t0: float = 1.7e9) -> None:
        self.rng = rng
        self.world = world
        self.hosts = {r: f"node-{r // ranks_per_host}" for r in range(world)}
        self.t = t0
        self.inc = dict.fromkeys(range(world), t0)
        self.alive = set(range(world))
        self.heartbeats = heartbeats
        self._off = {r: rng.uniform(0.0, HB_INTERVAL_S) for r in range(world)}
        self._frozen: dict[int, dict[str, Any]] = {}
        self._next_check = t0 + HB_INTERVAL_S
        # (time of change, last step, its end time, phase), newest last.
        self._states: deque[tuple[float, int | None, float | None, str]] = deque([(t0, None, None, "train")],
                                                                                  maxlen=256)

    def _set(self, t: float, **kw: Any) -> None:
        _, step, step_t, phase = self._states[-1]
        new = (t, kw.get("step", step), kw.get("step_t", step_t), kw.get("phase", phase))
        self._states.append(new)

    def start(self) -> Iterator[Item]:
        for r in range(self.world):
            yield ("event", Event("run_start", r, self.t, self.inc[r], extra={"host": self.hosts[r]}))

    def _hb(self, r: int, now: float) -> dict[str, Any]:
        t = max(now - ((now - self._off[r]) % HB_INTERVAL_S), self.inc[r])  # the newest write
        state = self._states[0]
        for s in reversed(self._states):
            if s[0] <= t:
                state = s
                break
        return {"t": t, "step": state[1], "step_t": state[2], "phase": state[3]}

    def advance(self, until: float) -> Iterator[Item]:
        """Let time pass to ``until``, running the service's heartbeat checks on the way."""
        while self.heartbeats and self._next_check <= until:
            now = self._next_check
            snap = {r: self._hb(r, now) for r in self.alive}
            snap.update(self._frozen)
            yield ("hb", now, snap)
            self._next_check += HB_INTERVAL_S
        self.t = max(self.t, until)

    def step(self, step: int, dur: float, busy: list[dict[str, float]] | None = None, **metrics: Any) -> Iterator[Item]:
        """Every live rank completes ``step`` after ``dur`` seconds; ``busy[r]`` are rank r's sections."""
        end = self.t + dur
        yield from self.advance(end)
        for r in sorted(self.alive):
            yield ("step", StepRecord(rank=r, step=step, inc=self.inc[r], t=end, dur=dur,
                                      sections=busy[r] if busy else {}, **metrics))
        self._set(end, step=step, step_t=end)

    def pause(self, seconds: float, phase: str = "train") -> Iterator[Item]:
        """No step completes for ``seconds`` (heartbeats carry ``phase`` meanwhile)."""
        self._set(self.t, phase=phase)
        yield from self.advance(self.t + seconds)
        self._set(self.t, phase="train")

    def kill(self, ranks: list[int]) -> None:
        """These ranks' processes die now: no more records, heartbeats frozen at their last write."""
        for r in ranks:
            if r in self.alive:
                self._frozen[r] = self._hb(r, self.t)
                self.alive.discard(r)

    def relaunch(self, resume_step: int, load_s: float) -> Iterator[Item]:
        """New processes on every rank (new incarnation), loading the checkpoint before ``resume_step``."""
        inc = self.t
        self._frozen.clear()
        self.alive = set(range(self.world))
        self._set(inc, step=None, step_t=None)
        for r in range(self.world):
            self.inc[r] = inc
            yield ("event", Event("run_start", r, inc, inc, extra={"host": self.hosts[r]}))
        yield from self.pause(load_s, "checkpoint_load")
        for r in range(self.world):
            yield ("event", Event("checkpoint_load", r, self.t, inc, step=resume_step - 1, seconds=load_s))


class _Curve:
    """A healthy run's loss, grad norm and learning rate, step by step.

    Loss follows a power law in the *cumulative learning rate* (so it falls slowly during the linear LR
    warm-up and flattens under the cosine decay), times multiplicative noise ``exp(noise x eps)``; eps is
    standard normal, or Student-t with ``df`` degrees of freedom for the heavy-tailed per-batch losses of small
    batches. The grad norm falls from ~3x to its level with log-normal noise.
    """

    def __init__(self, rng: random.Random, total: int, noise: float, df: float | None = None) -> None:
        self.rng, self.total, self.noise, self.df = rng, total, noise, df
        self.warmup = max(50, int(0.02 * total))
        self.l_inf = rng.uniform(1.6, 2.4)
        self.amp = rng.uniform(5.0, 8.0)
        self.alpha = rng.uniform(0.3, 0.6)
        self.tau0 = rng.uniform(50.0, 200.0)
        self.tau = 0.0
        self.level = 1.0
        self.g0 = rng.uniform(0.3, 3.0)
        self.g_noise = rng.uniform(0.08, 0.15)
        self.last_eps = 0.0

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return 3e-4 * (step + 1) / self.warmup
        frac = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 3e-4 * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))

    def advance(self, step: int, skipped: bool = False) -> None:
        if not skipped:
            self.tau += self.lr(step) / 3e-4

    def clean(self) -> float:
        return (self.l_inf + self.amp * (1.0 + self.tau / self.tau0) ** -self.alpha) * self.level

    def eps(self) -> float:
        z = self.rng.gauss(0.0, 1.0)
        if self.df:
            z /= math.sqrt(self.rng.gammavariate(self.df / 2, 2.0) / self.df)
        self.last_eps = z
        return z

    def loss(self) -> float:
        return self.clean() * math.exp(self.noise * self.eps())

    def grad_norm(self) -> float:
        return self.g0 * (1.0 + 2.0 * math.exp(-self.tau / (3 * self.tau0))) * math.exp(
            self.g_noise * self.rng.gauss(0.0, 1.0))


def _n(base: int, scale: float) -> int:
    return max(500, int(base * scale))


def _grid(rng: random.Random, n: int, k: int, gap: int) -> list[int]:
    """``k`` event steps after the first eighth of the run (at least 150 steps: the detectors' warm-up), one per
    equal segment, at least ``gap`` steps from the next segment."""
    first = max(150, n // 8)
    seg = (n - first) // max(k, 1)
    return [first + i * seg + rng.randrange(0, max(1, seg - gap)) for i in range(k)]


def _spike_height(rng: random.Random, noise: float, lo: float = 1.25, hi: float = 2.0, sds: float = 10.0) -> float:
    return max(rng.uniform(lo, hi), math.exp(rng.uniform(sds, 2 * sds) * noise))


def _warmup_labels(labels: list[Label], first: int, why: str = "first steps after a (re)start: compilation and "
                   "warm-up make them slow, which is normal") -> None:
    for kind in ("slow_step", "throughput_drop"):
        labels.append(Label(kind, first, first + 4, ignore=True, why=why))


# ---------------------------------------------------------------------------------------------------------------
# Single-rank scenarios (loss family and timing)
# ---------------------------------------------------------------------------------------------------------------
def _single(rng: random.Random, n: int, labels: list[Label], *, noise: float | None = None, df: float | None = None,
            loss_mult: Callable[[int], float] | None = None, gn_mult: Callable[[int], float] | None = None,
            time_mult: Callable[[int], float] | None = None, nan: Callable[[int], bool] | None = None,
            skipped: Callable[[int], bool] | None = None, epoch_len: int | None = None,
            periodic: tuple[int, float, float] | None = None, evals: int | None = None,
            ckpt: int | None = None, grad_norm: bool = True) -> Iterator[Item]:
    """One rank, timed steps. ``*_mult(step)`` multiply the healthy values; ``nan(step)`` makes loss and grad
    norm NaN; ``skipped(step)`` marks an fp16 overflow skip (no progress, grad norm repeated as Megatron logs it);
    ``grad_norm=False``: the log has no grad norm."""
    noise = rng.choice((0.01, 0.03, 0.06)) if noise is None else noise
    cur = _Curve(rng, n, noise, df)
    t0 = rng.uniform(0.2, 2.0)
    jitter = rng.choice((0.02, 0.05))
    tokens = rng.choice((4096, 8192, 16384)) * 8
    drop = rng.uniform(0.85, 0.93)
    cl = _Cluster(rng)
    yield from cl.start()
    _warmup_labels(labels, 0)
    last_gn = cur.g0
    next_skip = rng.randint(1000, 3000)
    for s in range(n):
        if epoch_len and s and s % epoch_len == 0:
            cur.level *= drop  # a new epoch over the same data: the loss drops (memorisation), healthy
        skip = bool(skipped and skipped(s))
        if s == next_skip:  # the normal fp16 overflow every ~2000 clean steps
            skip = True
            next_skip = s + rng.randint(1000, 3000)
            labels.append(Label("skipped_steps", s, s, 0, 1, ignore=True, max_severity="info",
                                why="one fp16 overflow skip: the loss scaler at work, worth an info at most "
                                    "(shared/real_logs MANIFEST: deepspeed_overflow_tqdm_hf.log, one skipped "
                                    "step, info)"))
        cur.advance(s, skip)
        loss = cur.loss() * (loss_mult(s) if loss_mult else 1.0)
        if abs(cur.last_eps) >= 6.0 and math.exp(noise * cur.last_eps) >= 1.15:
            labels.append(Label("loss_spike", s, s, 0, 1, ignore=True,
                                why="heavy-tailed noise excursion as large as a small spike (>= +15 %, >= 6 SDs)"))
        gn = cur.grad_norm() * (gn_mult(s) if gn_mult else 1.0)
        if skip:
            gn = last_gn
        last_gn = gn
        if nan and nan(s):
            loss = gn = float("nan")
            skip = True
        if not grad_norm:
            gn = None
        dt = t0 * math.exp(jitter * rng.gauss(0.0, 1.0))
        if rng.random() < 0.005:
            dt *= rng.uniform(1.1, 1.6)  # healthy hiccup
        if s == 0:
            dt *= rng.uniform(5.0, 30.0)
        if periodic and s % periodic[0] == 1:
            dt *= rng.uniform(periodic[1], periodic[2])
        if time_mult:
            dt *= time_mult(s)
        yield from cl.step(s, dt, loss=loss, grad_norm=gn, lr=cur.lr(s), tokens=tokens, skipped=int(skip))
        if evals and s and s % evals == 0:
            sec = rng.uniform(30.0, 120.0)
            yield from cl.pause(sec, "badput")
            yield ("event", Event("badput", 0, cl.t, cl.inc[0], step=s, seconds=sec, extra={"name": "evaluation"}))
        if ckpt and s and s % ckpt == 0:
            sec = rng.uniform(20.0, 200.0)
            yield from cl.pause(sec, "checkpoint_save")
            yield ("event", Event("checkpoint_save", 0, cl.t, cl.inc[0], step=s, seconds=sec))


def sc_healthy_smooth(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Healthy: smooth curve (noise 0.5 %, like Megatron golden values), warm-up + cosine LR."""
    yield from _single(rng, _n(3000, scale), labels, noise=0.005)


def sc_healthy_noisy(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Healthy: noisy curve (6-10 % per-step noise, small-batch fine-tuning)."""
    yield from _single(rng, _n(3000, scale), labels, noise=rng.uniform(0.06, 0.10))


def sc_healthy_epochs(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Healthy: multi-epoch fine-tune whose loss drops 7-15 % at each epoch boundary (the real LLaMA-Factory log)."""
    n = _n(3000, scale)
    yield from _single(rng, n, labels, noise=0.03, epoch_len=n // 4)


def sc_healthy_heavy_tail(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Healthy: heavy-tailed per-batch losses (Student-t, 4 dof, scale 2 %; the real modded-nanogpt log)."""
    yield from _single(rng, _n(3000, scale), labels, noise=0.02, df=4.0)


def sc_healthy_periodic(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Healthy timing: every 10th step 4-5.5x slower (periodic optimizer work, as in the modded-nanogpt log),
    evaluations and checkpoint saves between steps."""
    n = _n(3000, scale)
    yield from _single(rng, n, labels, noise=0.02, periodic=(10, 4.0, 5.5), evals=n // 3, ckpt=n // 2)


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive steps in a sorted list, as ``(first, last)``."""
    out: list[tuple[int, int]] = []
    for t in steps:
        if out and t == out[-1][1] + 1:
            out[-1] = (out[-1][0], t)
        else:
            out.append((t, t))
    return out


def _partner(rng: random.Random, labels: list[Label], mult: dict[int, float]) -> Callable[[int], float] | None:
    """How the grad norm goes with injected loss spikes: not logged in one run in three (as in the Megatron golden
    values and modded-nanogpt logs), else rising with the loss, x(loss factor)^k with k ~ U[1.5, 4] for the run
    (a high-loss batch has large gradients: the BLOOM and TrOCR logs). Where that reaction is at least 4x it is
    labelled a grad-norm spike, where it is 1.5-4x it is ignored for grad-norm kinds. Returns the grad-norm
    multiplier, or None for "not logged"."""
    if rng.random() < 1 / 3:
        return None
    k = rng.uniform(1.5, 4.0)
    gm = {t: f ** k for t, f in mult.items()}
    strong = sorted(t for t, g in gm.items() if g >= 4.0)
    for first, last in _runs(strong):
        peak = max(gm[t] for t in range(first, last + 1))
        labels.append(Label("grad_norm_spike", first, last, 0, 2,
                            why=f"grad norm rising with the loss spike, up to x{peak:.1f}"))
    for t, g in gm.items():
        if 1.5 <= g < 4.0:
            labels.append(Label("grad_norm_spike", t, t, 0, 1, ignore=True,
                                why="grad norm 1.5-4x with a loss spike: a bump, not labelled"))
    return lambda t: gm.get(t, 1.0)


def _spikes(rng: random.Random, scale: float, labels: list[Label], shape: str) -> Iterator[Item]:
    n = _n(2000, scale)
    noise = rng.choice((0.01, 0.03, 0.06))
    mult: dict[int, float] = {}
    for s in _grid(rng, n, max(1, n // 600), 150):
        h = _spike_height(rng, noise)
        if shape == "one":
            mult[s] = h
            labels.append(Label("loss_spike", s, s, 0, 2, why=f"one-step loss spike x{h:.2f}"))
        elif shape == "plateau":
            d = rng.randint(3, 30)
            mult.update(dict.fromkeys(range(s, s + d), h))
            labels.append(Label("loss_spike", s, s + d - 1, 0, 2, why=f"{d}-step plateau spike x{h:.2f}"))
        else:
            tau = rng.uniform(10.0, 40.0)
            # Labelled until the excess is within 3 noise SDs of the curve.
            span = int(tau * math.log((h - 1) / (3 * noise))) + 1 if h - 1 > 3 * noise else 1
            for t in range(s, s + int(8 * tau)):
                mult[t] = 1.0 + (h - 1.0) * math.exp(-(t - s) / tau)
            labels.append(Label("loss_spike", s, s + span, 0, 2,
                                why=f"spike x{h:.2f} recovering with time constant {tau:.0f} steps"))
    gn = _partner(rng, labels, mult)
    yield from _single(rng, n, labels, noise=noise, loss_mult=lambda s: mult.get(s, 1.0), gn_mult=gn,
                       grad_norm=gn is not None)


def sc_spikes_one_step(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """One-step loss spikes at noise 1 %, 3 % or 6 %."""
    yield from _spikes(rng, scale, labels, "one")


def sc_spikes_plateau(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Loss spikes that stay up for 3-30 steps, then drop back."""
    yield from _spikes(rng, scale, labels, "plateau")


def sc_spikes_slow_recovery(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Loss spikes decaying back exponentially (time constant 10-40 steps)."""
    yield from _spikes(rng, scale, labels, "slow")


def sc_spike_no_recovery(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """A loss jump that never comes back down (the real 104B log at step 17062): spike, then divergence."""
    n = _n(2000, scale)
    noise = rng.choice((0.01, 0.03))
    s = int(n * rng.uniform(0.45, 0.6))
    h = _spike_height(rng, noise, 1.3, 2.0)
    labels.append(Label("loss_spike", s, s, 0, 2, why=f"jump x{h:.2f} that never recovers"))
    labels.append(Label("divergence", s, n - 1, why=f"loss stays x{h:.2f} above its curve from step {s} to the end"))
    gn = _partner(rng, labels, dict.fromkeys(range(s, s + 3), h))
    if gn is not None:
        labels.append(Label("grad_norm_spike", s + 3, n - 1, ignore=True,
                            why="grad norm raised with the diverged loss"))
    yield from _single(rng, n, labels, noise=noise, loss_mult=lambda t: h if t >= s else 1.0,
                       gn_mult=None if gn is None else lambda t: gn(t) if t < s + 3 else (h if t >= s else 1.0),
                       grad_norm=gn is not None)


def sc_slow_divergence(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Log-loss rising linearly from an onset (+50 % over 200-1000 steps, capped at x3): slow divergence."""
    n = _n(2500, scale)
    noise = rng.choice((0.01, 0.03))
    s = int(n * rng.uniform(0.4, 0.5))
    d = rng.randint(200, 1000)
    r = math.log(1.5) / d
    labels.append(Label("divergence", s, n - 1, why=f"loss rising +50 % per {d} steps from step {s}"))
    yield from _single(rng, n, labels, noise=noise,
                       loss_mult=lambda t: min(3.0, math.exp(r * (t - s))) if t >= s else 1.0)


def sc_gradnorm_spikes(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Grad-norm spikes (x4-30, 1-3 steps); half followed 1-5 steps later by a one-step loss spike (BLOOM),
    half with no loss reaction (the real T5 log)."""
    n = _n(2000, scale)
    noise = rng.choice((0.01, 0.03))
    gmult: dict[int, float] = {}
    lmult: dict[int, float] = {}
    for i, s in enumerate(_grid(rng, n, max(1, n // 500), 100)):
        d = rng.randint(1, 3)
        h = max(rng.uniform(4.0, 30.0), math.exp(10 * 0.15))
        gmult.update(dict.fromkeys(range(s, s + d), h))
        labels.append(Label("grad_norm_spike", s, s + d - 1, 0, 2, why=f"grad norm x{h:.1f} for {d} steps"))
        if i % 2 == 0:
            k = rng.randint(1, 5)
            lh = _spike_height(rng, noise)
            lmult[s + k] = lh
            labels.append(Label("loss_spike", s + k, s + k, 0, 2,
                                why=f"loss spike x{lh:.2f} {k} steps after the grad-norm spike"))
    yield from _single(rng, n, labels, noise=noise, loss_mult=lambda t: lmult.get(t, 1.0),
                       gn_mult=lambda t: gmult.get(t, 1.0))


def sc_gradnorm_explosion(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """The grad norm grows exponentially (x1000 over 50-250 steps) until loss and grad norm turn NaN."""
    n = _n(2000, scale)
    e = int(n * rng.uniform(0.45, 0.55))
    L = rng.randint(50, min(250, n - e - 40))
    r = math.log(1000.0) / L
    nan_at = e + L
    labels.append(Label("grad_norm_explosion", e, nan_at - 1, why=f"grad norm x1000 over {L} steps"))
    labels.append(Label("nan_inf", nan_at, n - 1, 0, 1, why="loss and grad norm NaN after the explosion"))
    yield from _single(rng, n, labels, noise=0.02, gn_mult=lambda t: math.exp(r * min(t - e, L)) if t >= e else 1.0,
                       nan=lambda t: t >= nan_at)


def sc_nan_runs(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """NaN loss (and grad norm) for 1, 2, 5 or 20 steps, the steps skipped by the job's NaN guard, then healthy."""
    n = _n(2000, scale)
    bad: set[int] = set()
    for s in _grid(rng, n, max(1, n // 500), 100):
        ln = rng.choice((1, 2, 5, 20))
        bad.update(range(s, s + ln))
        labels.append(Label("nan_inf", s, s + ln - 1, 0, 1, why=f"{ln} NaN step(s)"))
    yield from _single(rng, n, labels, noise=0.03, nan=bad.__contains__)


def sc_skipped_runs(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """fp16: isolated overflow skips every 1000-3000 steps (healthy) plus runs of 10-100 consecutive skips
    (loss-scale collapse) and bursts where 30-60 % of 100-300 steps are skipped."""
    n = _n(2500, scale)
    skip: set[int] = set()
    for i, s in enumerate(_grid(rng, n, max(2, n // 800), 320)):
        if i % 2 == 0:
            ln = rng.randint(10, 100)
            skip.update(range(s, s + ln))
            labels.append(Label("skipped_steps", s, s + ln - 1, 0, 20, why=f"{ln} consecutive skipped steps"))
        else:
            ln, p = min(rng.randint(100, 300), n - s - 10), rng.uniform(0.3, 0.6)
            hit = [t for t in range(s, s + ln) if rng.random() < p]
            skip.update(hit)
            labels.append(Label("skipped_steps", hit[0], hit[-1], 0, 20,
                                why=f"{len(hit)} of {ln} steps skipped ({p:.0%})"))
    yield from _single(rng, n, labels, noise=0.02, skipped=skip.__contains__)


def sc_throughput_drop(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Step time shifts up x1.15-2 for a quarter to half of a segment of the run, then back (two episodes)."""
    n = _n(3000, scale)
    eps: list[tuple[int, int, float]] = []
    first = max(150, n // 8)
    seg = (n - first) // 2
    for i in range(2):
        s = first + i * seg + rng.randrange(0, seg // 4)
        ln, f = rng.randint(seg // 4, seg // 2), rng.uniform(1.15, 2.0)
        eps.append((s, s + ln - 1, f))
        labels.append(Label("throughput_drop", s, s + ln - 1, 20, 0, why=f"step time x{f:.2f} for {ln} steps"))
        labels.append(Label("slow_step", s, s + ln - 1, ignore=True, why="inside a throughput drop"))

    def mult(t: int) -> float:
        return next((f for a, b, f in eps if a <= t <= b), 1.0)

    yield from _single(rng, n, labels, noise=0.02, time_mult=mult)


def sc_slow_steps(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Isolated steps 3-20x slower (GC pause, file-system stall)."""
    n = _n(2000, scale)
    slow: dict[int, float] = {}
    for s in _grid(rng, n, max(1, n // 250), 60):
        slow[s] = rng.uniform(3.0, 20.0)
        labels.append(Label("slow_step", s, s, 0, 1, why=f"one step x{slow[s]:.1f}"))
    yield from _single(rng, n, labels, noise=0.02, time_mult=lambda t: slow.get(t, 1.0))


# ---------------------------------------------------------------------------------------------------------------
# Multi-rank scenarios (16 ranks on 4 hosts, heartbeats)
# ---------------------------------------------------------------------------------------------------------------
class _Job:
    """16 data-parallel ranks on 4 hosts: per-rank sections, an all-reduce, heartbeats, checkpoints, restarts."""

    WORLD, PER_HOST = 16, 4

    def __init__(self, rng: random.Random, labels: list[Label]) -> None:
        self.rng, self.labels = rng, labels
        self.cl = _Cluster(rng, self.WORLD, self.PER_HOST, heartbeats=True)
        self.curve = _Curve(rng, 10_000, 0.02)
        self.f0 = rng.uniform(0.15, 0.6)                                        # forward seconds
        # Steps one heartbeat interval spans (a step takes ~3.1 x f0): a dead rank's last heartbeat, the evidence
        # of its death, may name a step up to this many steps before the last one it completed.
        self.hb_steps = math.ceil(HB_INTERVAL_S / (3.1 * self.f0)) + 1
        self.spread = [math.exp(rng.gauss(0.0, 0.02)) for _ in range(self.WORLD)]  # per-GPU speed differences
        self.slow: Callable[[int, int], float] = lambda step, rank: 1.0        # forward multiplier
        #: (first step, last step, rank, data multiplier) of a rank-outlier episode.
        self.outlier: tuple[int, int, int, float] | None = None
        self.tokens = 8192
        self.ckpt_every = 500
        self.ckpt_s: tuple[float, float] = (20.0, 90.0)
        self.last_ckpt = 0
        self.ckpt_tau = 0.0  # training progress saved in the last checkpoint

    def host_ranks(self, h: int) -> tuple[int, ...]:
        return tuple(range(h * self.PER_HOST, (h + 1) * self.PER_HOST))

    def step(self, s: int, extra_s: float = 0.0) -> Iterator[Item]:
        rng = self.rng
        busy = []
        for r in range(self.WORLD):
            f = self.f0 * self.spread[r] * math.exp(0.03 * rng.gauss(0.0, 1.0)) * self.slow(s, r)
            if rng.random() < 0.001:
                f *= rng.uniform(1.5, 3.0)  # a one-step hiccup on one rank: healthy
            data = 0.01 * math.exp(0.3 * rng.gauss(0.0, 1.0))
            if self.outlier and self.outlier[2] == r and self.outlier[0] <= s <= self.outlier[1]:
                data *= self.outlier[3]
                f *= math.exp(0.25 * rng.gauss(0.0, 1.0))
            busy.append({"data": data, "forward": f, "optimizer": 0.05 * self.f0})
        longest = max(sum(b.values()) for b in busy)
        dur = longest + 2.0 * self.f0 * math.exp(0.02 * rng.gauss(0.0, 1.0)) + extra_s  # backward + all-reduce
        if s == 0:
            dur *= rng.uniform(5.0, 30.0)
        self.curve.advance(s)
        yield from self.cl.step(s, dur, busy, loss=self.curve.loss(), grad_norm=self.curve.grad_norm(),
                                lr=self.curve.lr(s), tokens=self.tokens, skipped=0)

    def checkpoint(self, s: int, lo: float | None = None, hi: float | None = None) -> Iterator[Item]:
        sec = self.rng.uniform(lo or self.ckpt_s[0], hi or self.ckpt_s[1])
        yield from self.cl.pause(sec, "checkpoint_save")
        for r in sorted(self.cl.alive):
            yield ("event", Event("checkpoint_save", r, self.cl.t, self.cl.inc[r], step=s, seconds=sec))
        self.last_ckpt, self.ckpt_tau = s, self.curve.tau

    def run(self, first: int, last: int, hook: Callable[[int], Iterator[Item] | None] | None = None) -> Iterator[Item]:
        """Steps ``first..last``; ``hook(step)`` may yield extra items after a step (and checkpoints are taken)."""
        for s in range(first, last + 1):
            yield from self.step(s)
            if hook:
                more = hook(s)
                if more is not None:
                    yield from more
            if s and s % self.ckpt_every == 0:
                yield from self.checkpoint(s)

    def crash(self, s: int, downtime: float, why: str) -> Iterator[Item]:
        """Every process dies after step ``s``; relaunched after ``downtime`` from the last checkpoint."""
        self.cl.kill(list(range(self.WORLD)))
        for kind in ("hang", "dead_rank"):
            self.labels.append(Label(kind, s, s, self.hb_steps, 1, ignore=True,
                                     why="every process is gone: 'process or node down' is true, the crash is "
                                         "scored as restart"))
        yield from self.cl.advance(self.cl.t + downtime)
        resume = self.last_ckpt + 1
        self.curve.tau = self.ckpt_tau  # the model is back at its checkpoint
        yield from self.cl.relaunch(resume, self.rng.uniform(10.0, 60.0))
        self.labels.append(Label("restart", resume, resume, 0, 1, why=why))
        _warmup_labels(self.labels, resume)
        return resume


def _job(rng: random.Random, labels: list[Label]) -> _Job:
    job = _Job(rng, labels)
    _warmup_labels(labels, 0)
    return job


def sc_multi_healthy(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Healthy 16-rank job: per-GPU speed spread (2 %), one-step rank hiccups, checkpoints every 500 steps."""
    job = _job(rng, labels)
    yield from job.cl.start()
    yield from job.run(0, _n(1200, scale))


def sc_multi_straggler(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Two straggler episodes on two ranks (forward x1.3-2 for a quarter to half of a segment of the run), each
    appearing and disappearing."""
    job = _job(rng, labels)
    n = _n(1200, scale)
    eps = []
    first = max(150, n // 8)
    seg = (n - first) // 2
    for i, r in enumerate(rng.sample(range(job.WORLD), 2)):
        s = first + i * seg + rng.randrange(0, seg // 4)
        ln, f = rng.randint(seg // 4, seg // 2), rng.uniform(1.3, 2.0)
        eps.append((s, s + ln - 1, r, f))
        labels.append(Label("straggler", s, s + ln - 1, 40, 0, ranks=(r,), why=f"rank {r} forward x{f:.2f}"))
        for k in ("throughput_drop", "slow_step"):
            labels.append(Label(k, s, s + ln - 1, 20, 0, ignore=True, why="the straggler slows every step"))
    job.slow = lambda step, rank: next((f for a, b, r, f in eps if rank == r and a <= step <= b), 1.0)
    yield from job.cl.start()
    yield from job.run(0, n)


def sc_multi_slow_node(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Every rank of one host x1.3-1.8 slower for a third to half of the run (thermal throttling, a bad NIC)."""
    job = _job(rng, labels)
    n = _n(1200, scale)
    s = rng.randint(max(150, n // 8), n // 3)
    ln, f, h = rng.randint(n // 3, n // 2), rng.uniform(1.3, 1.8), rng.randrange(4)
    ranks = job.host_ranks(h)
    labels.append(Label("slow_node", s, s + ln - 1, 40, 0, ranks=ranks, hosts=(f"node-{h}",),
                        why=f"every rank of node-{h} x{f:.2f} for {ln} steps"))
    for k in ("throughput_drop", "slow_step"):
        labels.append(Label(k, s, s + ln - 1, 20, 0, ignore=True, why="the slow node slows every step"))
    job.slow = lambda step, rank: f if rank in ranks and s <= step < s + ln else 1.0
    yield from job.cl.start()
    yield from job.run(0, n)


def sc_multi_rank_outlier(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """One rank unlike the others for a third of the run: its data loading 5-15x longer and its forward
    erratic (log-SD 0.25), though its median is within 10 % (a failing local disk, a throttled data worker)."""
    job = _job(rng, labels)
    n = _n(1200, scale)
    s = rng.randint(max(150, n // 8), n // 3)
    ln, r, dmult = rng.randint(n // 4, n // 3), rng.randrange(job.WORLD), rng.uniform(5.0, 15.0)
    labels.append(Label("rank_outlier", s, s + ln - 1, 40, 0, ranks=(r,),
                        why=f"rank {r}: data x{dmult:.1f}, forward erratic"))
    for k in ("throughput_drop", "slow_step"):
        labels.append(Label(k, s, s + ln - 1, 20, 0, ignore=True, why="the outlier rank makes steps erratic"))
    job.outlier = (s, s + ln - 1, r, dmult)
    yield from job.cl.start()
    yield from job.run(0, n)


def sc_multi_hang(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Every rank stuck for 300-1500 s (a collective or a file-system stall) with live heartbeats, then resumes."""
    job = _job(rng, labels)
    n = _n(1200, scale)
    stall: dict[int, float] = {}
    for s in _grid(rng, n, 2, 100):
        stall[s + 1] = rng.uniform(300.0, 1500.0)
        labels.append(Label("hang", s, s, 1, 1, why=f"no rank completes step {s + 1} for {stall[s + 1]:.0f} s"))
        for k in ("slow_step", "throughput_drop"):
            labels.append(Label(k, s + 1, s + 1, 0, 1, ignore=True, why="the step that contained the hang"))
    yield from job.cl.start()
    for s in range(n + 1):
        if s in stall:
            yield from job.cl.pause(stall[s])
            job.cl.t -= stall[s]  # the stalled time belongs to this step's duration
            yield from job.step(s, extra_s=stall[s])
        else:
            yield from job.step(s)
        if s and s % job.ckpt_every == 0:
            yield from job.checkpoint(s)


def sc_multi_checkpoint(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Healthy: checkpoint saves of 120-1500 s every 300 steps (heartbeats say checkpoint_save): not hangs."""
    job = _job(rng, labels)
    job.ckpt_s, job.ckpt_every = (120.0, 1500.0), 300
    yield from job.cl.start()
    yield from job.run(0, _n(1200, scale))


def sc_multi_eval(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Healthy: evaluations of 60-600 s every 400 steps (heartbeats say badput, as ``timed_badput`` sets)."""
    job = _job(rng, labels)

    def ev(s: int) -> Iterator[Item] | None:
        return _eval(job, s) if s and s % 400 == 0 else None

    yield from job.cl.start()
    yield from job.run(0, _n(1200, scale), ev)


def _eval(job: _Job, s: int) -> Iterator[Item]:
    sec = job.rng.uniform(60.0, 600.0)
    yield from job.cl.pause(sec, "badput")
    for r in sorted(job.cl.alive):
        yield ("event", Event("badput", r, job.cl.t, job.cl.inc[r], step=s, seconds=sec, extra={"name": "evaluation"}))


def sc_multi_dead_rank(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """One rank's process dies; the others block in the all-reduce until the NCCL timeout (600 s) ends the job,
    which restarts from its last checkpoint."""
    job = _job(rng, labels)
    n = _n(1200, scale)
    s = rng.randint(n // 3, 2 * n // 3)
    r = rng.randrange(job.WORLD)
    labels.append(Label("dead_rank", s, s + 1, job.hb_steps, 1, ranks=(r,), why=f"rank {r} dies after step {s}"))
    labels.append(Label("hang", s, s, job.hb_steps, 1, why=f"the other ranks wait in the collective for rank {r}"))
    yield from job.cl.start()
    yield from job.run(0, s)
    job.cl.kill([r])
    yield from job.cl.pause(NCCL_TIMEOUT_S)
    resume = yield from job.crash(s, rng.uniform(60.0, 180.0), f"relaunch after rank {r} died")
    yield from job.run(resume, n)


def sc_multi_restarts(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Two crashes (node failure, OOM): every process exits, relaunched after 60-600 s from the last checkpoint."""
    job = _job(rng, labels)
    n = _n(1200, scale)
    yield from job.cl.start()
    s = 0
    for c in _grid(rng, n, 2, 100):
        yield from job.run(s, c)
        s = yield from job.crash(c, rng.uniform(60.0, 600.0), f"relaunch after a crash at step {c}")
    yield from job.run(s, n)


def sc_multi_restart_storm(rng: random.Random, scale: float, labels: list[Label]) -> Iterator[Item]:
    """Five crash-relaunch cycles within minutes (each attempt dies after 5-40 steps), then a stable run."""
    job = _job(rng, labels)
    n = _n(1200, scale)
    at = rng.randint(n // 4, n // 3)
    yield from job.cl.start()
    yield from job.run(0, at)
    s = yield from job.crash(at, rng.uniform(30.0, 120.0), "first relaunch of the storm")
    first = s
    for i in range(4):
        end = s + rng.randint(5, 40)
        yield from job.run(s, end)
        s = yield from job.crash(end, rng.uniform(30.0, 120.0), f"relaunch {i + 2} of the storm")
    labels.append(Label("restart_storm", first, first + 40, 0, 10, why="5 relaunches within minutes"))
    yield from job.run(s, n)


#: name -> (generator, family). The family (loss, timing, rank) says which detectors the scenario is about.
SCENARIOS: dict[str, tuple[Callable[[random.Random, float, list[Label]], Iterator[Item]], str]] = {
    "healthy_smooth": (sc_healthy_smooth, "loss"),
    "healthy_noisy": (sc_healthy_noisy, "loss"),
    "healthy_epochs": (sc_healthy_epochs, "loss"),
    "healthy_heavy_tail": (sc_healthy_heavy_tail, "loss"),
    "spikes_one_step": (sc_spikes_one_step, "loss"),
    "spikes_plateau": (sc_spikes_plateau, "loss"),
    "spikes_slow_recovery": (sc_spikes_slow_recovery, "loss"),
    "spike_no_recovery": (sc_spike_no_recovery, "loss"),
    "slow_divergence": (sc_slow_divergence, "loss"),
    "gradnorm_spikes": (sc_gradnorm_spikes, "loss"),
    "gradnorm_explosion": (sc_gradnorm_explosion, "loss"),
    "nan_runs": (sc_nan_runs, "loss"),
    "skipped_runs": (sc_skipped_runs, "loss"),
    "healthy_periodic": (sc_healthy_periodic, "timing"),
    "throughput_drop": (sc_throughput_drop, "timing"),
    "slow_steps": (sc_slow_steps, "timing"),
    "multi_healthy": (sc_multi_healthy, "rank"),
    "multi_straggler": (sc_multi_straggler, "rank"),
    "multi_slow_node": (sc_multi_slow_node, "rank"),
    "multi_rank_outlier": (sc_multi_rank_outlier, "rank"),
    "multi_hang": (sc_multi_hang, "rank"),
    "multi_checkpoint": (sc_multi_checkpoint, "rank"),
    "multi_eval": (sc_multi_eval, "rank"),
    "multi_dead_rank": (sc_multi_dead_rank, "rank"),
    "multi_restarts": (sc_multi_restarts, "rank"),
    "multi_restart_storm": (sc_multi_restart_storm, "rank"),
}


def seed_rng(name: str, seed: int) -> random.Random:
    """The scenario's generator: a stable function of its name and seed (not of Python's hash salt)."""
    return random.Random(zlib.crc32(f"{name}@{seed}".encode()))


def synthetic_sources(quick: bool = False, only: str | None = None) -> list[Source]:
    """Every scenario under the dev and held-out seeds (``--quick``: one seed each, shortened)."""
    dev, held = QUICK_SEEDS if quick else (DEV_SEEDS, HELDOUT_SEEDS)
    scale = QUICK_SCALE if quick else 1.0
    out = []
    for name, (fn, family) in SCENARIOS.items():
        if only and not re.search(only, name):
            continue
        for split, seeds in (("dev", dev), ("heldout", held)):
            for seed in seeds:
                src = Source(f"{name}@{seed}", split, name, note=(fn.__doc__ or "").split("\n")[0],
                             world_size=_Job.WORLD if family == "rank" else 1)
                src.items = _bind(fn, name, seed, scale, src.labels)
                out.append(src)
    return out


def _bind(fn: Callable, name: str, seed: int, scale: float, labels: list[Label]) -> Callable[[], Iterator[Item]]:
    def items() -> Iterator[Item]:
        labels.clear()
        return fn(seed_rng(name, seed), scale, labels)
    return items


# ---------------------------------------------------------------------------------------------------------------
# Real logs
# ---------------------------------------------------------------------------------------------------------------
def real_logs_dir() -> Path:
    """``$TRAINHEALTH_REAL_LOGS`` or ``shared/real_logs`` beside the repository (as ``tests/conftest.py``)."""
    return Path(os.environ.get("TRAINHEALTH_REAL_LOGS") or ROOT.parent / "shared" / "real_logs")


def load_labels(path: Path = LABELS_PATH) -> list[dict[str, Any]]:
    """Parse ``labels.toml``: one table per file, with ``label`` and ``ignore`` arrays.

    Raises
    ------
    ValueError
        Naming the file and field for a malformed entry.
    """
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    files = doc.get("file", [])
    for entry in files:
        if "path" not in entry or "status" not in entry:
            raise ValueError(f"{path}: every [[file]] needs 'path' and 'status'")
        for lab in entry.get("label", []) + entry.get("ignore", []):
            if "kind" not in lab or "why" not in lab or not ("steps" in lab or "at" in lab or lab.get("anywhere")):
                raise ValueError(f"{path}: {entry['path']}: every label needs kind, steps (or at, or anywhere) and "
                                 "why")
            for name in ("severity", "max_severity"):
                if lab.get(name, "info") not in SEVERITIES:
                    raise ValueError(f"{path}: {entry['path']}: {name}={lab[name]!r} is not one of "
                                     f"{', '.join(SEVERITIES)}")
    return files


def labels_of(entry: dict[str, Any]) -> list[Label]:
    """The :class:`Label` objects of one ``[[file]]`` entry."""
    out = []
    for lab, ignore in [(x, False) for x in entry.get("label", [])] + [(x, True) for x in entry.get("ignore", [])]:
        tol = lab.get("tolerance", 0)
        before, after = (tol, tol) if isinstance(tol, int) else tuple(tol)
        if lab.get("anywhere"):  # a log without training steps: found once, at whatever step
            ranges = [(-ANYWHERE, ANYWHERE)]
        else:
            ranges = [tuple(lab["steps"])] if "steps" in lab else [(s, s) for s in lab["at"]]
        for a, b in ranges:
            ranks = tuple(lab.get("ranks", ())) if lab["kind"] in RANK_SCOPED else ()
            out.append(Label(lab["kind"], int(a), int(b), int(before), int(after), ranks=ranks,
                             ignore=ignore, why=lab["why"], severity=lab.get("severity"),
                             max_severity=lab.get("max_severity")))
    return out


def real_sources(directory: Path | None = None) -> list[Source]:
    """The labelled real logs (``status = "excluded"`` entries are listed in the report, not run)."""
    directory = directory or real_logs_dir()
    out = []
    for entry in load_labels():
        if entry["status"] == "excluded":
            continue
        path = directory / entry["path"]
        if path.is_dir():
            path = sorted(p for p in path.iterdir() if p.is_file())[0]
        src = Source(entry["path"], "real", "real", labels=labels_of(entry), path=path, note=entry.get("note", ""))
        if entry.get("parser") == "allreduce_bench":
            recs, hosts = parse_allreduce_bench(path)
            src.world_size = len(hosts)
            src.items = _allreduce_items(recs, hosts)
            src.path = None
        out.append(src)
    return out


def excluded_logs() -> list[tuple[str, str]]:
    """``(file, reason)`` of the logs left out of the evaluation."""
    return [(e["path"], e.get("note", "")) for e in load_labels() if e["status"] == "excluded"]


_RANK_LINE = re.compile(r"^(\d+):$")
_DUR_LINE = re.compile(r"^\s*duration: ([\d.]+) sec")
_HOST_LINE = re.compile(r"^([\w.-]+):\d+:\d+ \[\d+\] NCCL INFO comm \S+ rank (\d+) nranks (\d+)")


def parse_allreduce_bench(path: Path) -> tuple[dict[int, list[float]], dict[int, str]]:
    """Per-rank iteration durations (s) and rank -> host of the BigScience all-reduce benchmark log,
    read with the product's own importer (:mod:`trainhealth.collectors.importers.allreduce_bench`).

    Raises
    ------
    InputFormatError
        When the file has no iteration.
    """
    from trainhealth.collectors.importers import allreduce_bench

    per: dict[int, list[float]] = {}
    hosts: dict[int, str] = {}
    for p in allreduce_bench.read(path):
        per.setdefault(p.rank, []).append(p.step_seconds)
        if p.host:
            hosts[p.rank] = p.host
    return per, hosts


def _allreduce_items(per: dict[int, list[float]], hosts: dict[int, str]) -> Callable[[], Iterator[Item]]:
    def items() -> Iterator[Item]:
        t0 = 1.7e9
        for r in sorted(per):
            yield ("event", Event("run_start", r, t0, t0, extra={"host": hosts.get(r, "")}))
        n = max(len(v) for v in per.values())
        ends = dict.fromkeys(per, t0)
        for i in range(n):
            for r in sorted(per):
                if i < len(per[r]):
                    d = per[r][i]
                    ends[r] += d
                    # The whole iteration is this rank's all-reduce: the only per-rank time the log has.
                    yield ("step", StepRecord(rank=r, step=i + 1, inc=t0, t=ends[r], dur=d, sections={"trial": d}))
    return items
