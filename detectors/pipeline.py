"""One run's detection pipeline, without I/O: records in, aggregates, anomalies, incidents and ledger out.

The service (:mod:`trainhealth.detectors.service`) feeds it from Redis; ``trainhealth replay`` and the
tests feed it directly. Everything here is deterministic given the same input order, which
is what lets the service rebuild its state by replaying the streams after a restart.
"""

from __future__ import annotations

import json
import logging
import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

from trainhealth import defaults
from trainhealth.anomaly import RESOLVED, Anomaly
from trainhealth.defaults import INCIDENT_SAMPLE_INDICES_BYTES
from trainhealth.detectors.advisor import Checkpoint, RollbackAdvisor
from trainhealth.detectors.aggregate import StepAggregate, StepAggregator
from trainhealth.detectors.base import StepDetector
from trainhealth.detectors.collective_timeout import CollectiveTimeoutDetector
from trainhealth.detectors.culprit import LastWord, judge
from trainhealth.detectors.dead_rank import DeadRankDetector
from trainhealth.detectors.divergence import DivergenceDetector
from trainhealth.detectors.gpu_health import explain as explain_gpu
from trainhealth.detectors.grad_norm_explosion import GradNormExplosionDetector
from trainhealth.detectors.grad_norm_spike import GradNormSpikeDetector
from trainhealth.detectors.hang import HangDetector, read_beats
from trainhealth.detectors.incidents import INCIDENT_KINDS, JOB_KINDS, DataPosition, Incident, IncidentGrouper
from trainhealth.detectors.job_state import JobStateTracker
from trainhealth.detectors.ledger import GoodputLedger
from trainhealth.detectors.loss_collapse import LossCollapseDetector
from trainhealth.detectors.loss_spike import LossSpikeDetector
from trainhealth.detectors.memory_growth import MemoryGrowthDetector
from trainhealth.detectors.memory_imbalance import MemoryImbalanceDetector
from trainhealth.detectors.memory_pressure import MemoryHistory, MemoryVerdict
from trainhealth.detectors.nan_inf import NanInfDetector
from trainhealth.detectors.network import NetworkDetector
from trainhealth.detectors.overfitting import OverfittingDetector
from trainhealth.detectors.plateau import PlateauDetector
from trainhealth.detectors.rank_outlier import RankOutlierDetector
from trainhealth.detectors.recovery_advisor import RecoveryAdvisor
from trainhealth.detectors.restart import RestartDetector
from trainhealth.detectors.restart_storm import RestartStormDetector
from trainhealth.detectors.skipped_steps import SkippedStepsDetector
from trainhealth.detectors.slow_node import SlowNodeDetector
from trainhealth.detectors.slow_step import SlowStepDetector
from trainhealth.detectors.straggler import StragglerDetector
from trainhealth.detectors.throughput import ThroughputDropDetector, step_seconds
from trainhealth.detectors.worker_restart import WorkerRestartDetector
from trainhealth.job import Culprit, JobState
from trainhealth.recommendations import Recommendation
from trainhealth.text import fmt_ranks
from trainhealth.wire import ROW_DATA, ROW_SOURCE, ROW_STEP, Event, StepRecord, row_record

log = logging.getLogger(__name__)

#: A failing detector's traceback is logged on its first error and then on every this-many-th.
ERROR_LOG_EVERY = 1000
#: Of the loss family (:data:`~trainhealth.detectors.incidents.INCIDENT_KINDS`: anomalies whose onsets are close are
#: one incident, :meth:`RunPipeline._incident`), the ones showing the loss itself moved (a grad-norm spike in their
#: incident is a warning, not info).
LOSS_MOVED_KINDS = frozenset({"loss_spike", "divergence", "loss_collapse"})
#: Steps whose end time is kept (an incident's onset time, :class:`StepTimes`): an onset is found at most a few
#: hundred steps back (a divergence's rise, a throughput drop's change point).
STEP_TIMES = 4096
#: Steps whose sample indices an incident can carry inline (at most ``defaults.INCIDENT_SAMPLE_INDICES_BYTES`` each):
#: a loss incident's onset is found within a few hundred steps (a divergence's 100); older onsets name the
#: ``th:{run}:samples`` entry instead.
SAMPLE_BODIES_KEPT = 1024
#: Events that declare a pause in training (a checkpoint save or load, an evaluation or other badput): the
#: first step after the step they name is a pause step (:attr:`StepAggregate.pause`).
PAUSE_EVENTS = ("checkpoint_save", "checkpoint_load", "badput")
#: Pause events kept waiting for their step (a bound: events naming steps that never come are dropped).
MAX_PENDING_PAUSES = 64


@dataclass
class Output:
    """What one input produced: completed step aggregates and changed anomaly states."""

    aggs: list[StepAggregate] = field(default_factory=list)
    anomalies: list[Anomaly] = field(default_factory=list)
    #: Recommendations (re)computed, by anomaly id: only each incident's one (:attr:`Incident.recommendation`).
    recommendations: dict[str, Recommendation] = field(default_factory=dict)
    #: The job's new state, when a heartbeat check changed it.
    job: JobState | None = None
    #: Incidents that changed, by id (:mod:`trainhealth.detectors.incidents`); None for one removed (a throughput
    #: drop that moved into the incident of the slow rank that caused it).
    incidents: dict[str, Incident | None] = field(default_factory=dict)
    #: The completed steps whose ranks logged sample indices, as ``th:{run}:samples`` stores them: ``(gen, step,
    #: ranks that reported the step, JSON of rank -> compact indices)``.
    samples: list[tuple[int, int, int, str]] = field(default_factory=list)

    def extend(self, other: Output) -> None:
        self.aggs += other.aggs
        self.samples += other.samples
        self.anomalies += other.anomalies
        self.recommendations.update(other.recommendations)
        self.incidents.update(other.incidents)


class StepTimes:
    """When each of the newest ``size`` step numbers ended (unix s), in a fixed ring: 12 bytes a step.

    >>> times = StepTimes(4)
    >>> for step in range(10):
    ...     times.note(step, 100.0 + step)
    >>> times.get(9), times.get(6), times.get(5), times.get(-1)
    (109.0, 106.0, None, None)
    """

    def __init__(self, size: int = STEP_TIMES) -> None:
        self._steps = array("q", [-1]) * size
        self._t = array("d", [0.0]) * size

    def note(self, step: int, t: float) -> None:
        if step >= 0:
            i = step % len(self._steps)
            self._steps[i], self._t[i] = step, t

    def get(self, step: int) -> float | None:
        i = step % len(self._steps)
        return self._t[i] if step >= 0 and self._steps[i] == step else None


class RunPipeline:
    """Aggregator, detectors and ledger of one run.

    Parameters
    ----------
    world_size : int
        Ranks per step.
    gpu_hour_usd : float | None
        Price per GPU-hour for the ledger.
    hang : HangDetector | None
        Override the hang detector's settings (e.g. a shorter floor for the demo).
    settings : mapping, optional
        The run's own detector parameters (:func:`trainhealth.tuning.validate`'d: detector -> {parameter: value},
        ``th:{run}:meta`` field ``detector_settings``); the detectors named are built with them, over the
        defaults (and over ``hang``'s floor).
    """

    def __init__(self, world_size: int = 1, gpu_hour_usd: float | None = None,
                 hang: HangDetector | None = None, run: str = "",
                 settings: Mapping[str, Mapping[str, float]] | None = None) -> None:
        #: The run's own detector parameters the detectors were built with (empty: the defaults).
        self.settings: dict[str, dict[str, float]] = {k: dict(v) for k, v in (settings or {}).items()}
        tuned = self.settings.get
        self.aggregator = StepAggregator(world_size)
        self.hang = hang or HangDetector()
        if tuned("hang"):
            h = self.hang
            self.hang = HangDetector(**{"floor_s": h.floor_s, "step_multiple": h.step_multiple,
                                        "checkpoint_s": h.checkpoint_s, "heartbeat_interval": h.heartbeat_interval,
                                        "missed_intervals": h.missed_intervals, "initial_s": h.initial_s,
                                        "update_s": h.update_s, **tuned("hang", {})})
        # One progress timeout for the hang and dead-rank detectors and the ledger: they agree on what a hang is.
        self.ledger = GoodputLedger(world_size, gpu_hour_usd, progress=self.hang.progress)
        self.job = JobStateTracker()
        #: rank -> its last word (a ``rank_exit`` event) of its latest incarnation.
        self.last_words: dict[int, LastWord] = {}
        self._restart: tuple[float, int] | None = None  # (unix s, resume step) of the newest restart
        # (rank, inc) of the run_start events seen; (step, t) of the first records of the incarnations seen
        # before the history was judged (once, by check_history).
        self._started: set[tuple[int, float]] = set()
        self._unstarted: dict[tuple[int, float], tuple[int, float]] = {}
        self._history_reported = False
        self.silent_since: float | None = None
        # The newest hang/dead-rank incident: (its id, its generation, whether a member is still open).
        self._job_incident: tuple[str, int, bool] | None = None
        #: rank -> host, from run_start events.
        self.hosts: dict[int, str] = {}
        # Rank family: a slow node is one slow_node anomaly, not a straggler per rank (the straggler
        # detector skips its ranks); a rank outlier is a rank neither explains (docs/anomalies.md).
        # A slow node is judged on the straggler's score and windows: tuned with it.
        self.slow_node = SlowNodeDetector(self.hosts, **{k: v for k, v in tuned("straggler", {}).items()
                                                         if k in ("window", "threshold")})
        self.straggler = StragglerDetector(exclude=self.slow_node.covered_ranks, **tuned("straggler", {}))
        self.rank_outlier = RankOutlierDetector(
            exclude=lambda: self.slow_node.covered_ranks() | self.straggler.open_ranks)
        # A node whose ranks spend more of the step in their collective than the other nodes' (straggler wait left
        # out: a slow rank is the straggler's, a rise on every node the throughput detector's).
        self.network = NetworkDetector(self.hosts)
        self.throughput = ThroughputDropDetector()
        self.dead_rank = DeadRankDetector(self.hang.checkpoint_s, self.hang.heartbeat_interval,
                                          self.hang.missed_intervals)
        # Memory, from the heartbeats' samples: a rank whose memory keeps growing, and whether a death was out of
        # memory (the dead rank's and the restart's evidence; rank -> the verdict frozen when it was found dead).
        #: rank -> its latest GPU health sample (a heartbeat's ``gpu``), to explain a slow rank or node.
        self.gpu: dict[int, dict] = {}
        self.memory = MemoryHistory()
        self.memory_growth = MemoryGrowthDetector(**tuned("memory_growth", {}))
        # One rank's peak far above the others' (rank -> (sample time, peak allocated bytes, device bytes)).
        self.memory_imbalance = MemoryImbalanceDetector()
        self._peaks: dict[int, tuple[float, float, float]] = {}
        self._death_memory: dict[int, MemoryVerdict] = {}
        # What the job's own logs report (events): a collective timeout is a hang, a launcher restart a restart.
        self.collective_timeout = CollectiveTimeoutDetector()
        self.worker_restart = WorkerRestartDetector()
        # Fed the training loss with every step and each evaluation's loss (``eval`` events).
        self.overfitting = OverfittingDetector()
        # Prices what a plateau's stretch cost (the ledger's GPU-hour price).
        self.plateau = PlateauDetector(gpu_hour_usd=gpu_hour_usd, **tuned("plateau", {}))
        #: ``eval`` events whose loss was not a number (left out).
        self.bad_evals = 0
        self.step_detectors: list[StepDetector] = [
            NanInfDetector(), RestartDetector(), LossSpikeDetector(), GradNormSpikeDetector(), DivergenceDetector(),
            GradNormExplosionDetector(), SkippedStepsDetector(), LossCollapseDetector(), self.plateau,
            self.overfitting,
            self.slow_node, self.straggler, self.rank_outlier, self.network, RestartStormDetector(), self.throughput,
            SlowStepDetector(), self.collective_timeout]  # a step completed after a collective timeout ends it
        self.ended_ranks: set[int] = set()
        self.run = run
        self.advisor = RollbackAdvisor()
        self.recovery = RecoveryAdvisor()
        #: Latest state of every anomaly, by id (the advisor's history).
        self.anomalies: dict[str, Anomaly] = {}
        self.checkpoints: dict[int, Checkpoint] = {}
        # step -> (consumed_samples, batch_index) after it; the newest 100,000 steps.
        self.positions: OrderedDict[int, tuple[int | None, int | None]] = OrderedDict()
        # step -> (generation, JSON of its ranks' sample indices) for the newest STEP_TIMES steps that logged them:
        # what an incident's onset step consumed. The JSON only for the newest SAMPLE_BODIES_KEPT of them and when
        # small enough for an incident to carry (else None: the incident names the th:{run}:samples entry).
        self.sample_steps: OrderedDict[int, tuple[int, str | None]] = OrderedDict()
        self._sample_bodies: deque[int] = deque()
        self.current_step = 0
        #: The first step seen (None before any): a condition from there on had no healthy state before it.
        self.first_step: int | None = None
        self._resumed = False  # the first step followed a checkpoint load: not the start of training
        self._last_advice = -(10**9)
        self._prev_end: tuple[int, float, int] | None = None
        # Incidents (docs/anomalies.md): anomaly id -> its incident's id; and the open incidents of the recent steps,
        # [incident id, generation, first onset, last onset, whether the loss moved in it, member ids].
        self._incident_of: dict[str, str] = {}
        self._incidents: list[list] = []
        self._gap = 1  # steps between the last two logged steps (the log's interval: the incident window's floor)
        # Declared pauses waiting for the step they fall in: step named by the event -> the pause's name.
        self._pauses: dict[int, str] = {}
        #: Exceptions raised by a detector (or the advisor), by its class name. A bug in one detector must
        #: not stop the others, the ledger, or the service (which would crash again on the same entry
        #: when it replays the stream after a restart): the step is skipped for that detector only.
        self.detector_errors: dict[str, int] = {}
        #: When the newest steps ended, and the run's incidents (:mod:`trainhealth.detectors.incidents`).
        self.step_times = StepTimes()
        self.incidents = IncidentGrouper(self.step_times.get, self.position_before)

    def position_before(self, step: int) -> DataPosition | None:
        """The data position when ``step`` began — the consumed samples and batch index after the last step before
        it that logged one — and the sample indices each rank consumed in ``step`` (inline when small, else the
        ``th:{run}:samples`` entry holding them); None when neither was logged (:class:`DataPosition`)."""
        where: tuple[int | None, int | None, int | None] = (None, None, None)
        for s in reversed(self.positions):
            if s < step:
                where = (s, *self.positions[s])
                break
        logged = self.sample_steps.get(step)
        if where[0] is None and logged is None:
            return None
        return {"step": where[0], "consumed_samples": where[1], "batch_index": where[2],
                "sample_indices": json.loads(logged[1]) if logged is not None and logged[1] is not None else None,
                "samples_entry": f"{logged[0] + 1}-{step}" if logged is not None else None}

    @property
    def world_size(self) -> int:
        return self.aggregator.world_size

    def set_world_size(self, n: int) -> None:
        """Update the expected ranks per step (from the run's metadata)."""
        if n >= 1:
            self.aggregator.world_size = n
            self.ledger.world_size = n

    def set_gpu_hour_usd(self, price: float | None) -> None:
        """The price of one GPU-hour (USD, from the run's metadata) for the ledger's costs and a plateau's."""
        self.ledger.gpu_hour_usd = price
        self.plateau.gpu_hour_usd = price

    def feed_step(self, rec: StepRecord) -> Output:
        """Feed one rank's step record."""
        return self._with_incidents(self._steps(self._add(rec)))

    def _add(self, rec: StepRecord | tuple) -> list[StepAggregate]:
        # Per-record work goes here: :meth:`feed` (the service) calls this, not feed_step.
        agg = self.aggregator
        if type(rec) is tuple:  # a row (trainhealth.wire.decode_step_rows), as the service feeds them
            rank = rec[12]
            if rank >= agg.world_size:
                self.set_world_size(rank + 1)
            src = rec[ROW_SOURCE]
            if type(src) is not StepRecord and self.rank_outlier.data_sections is agg.data_sections:
                # A plain (or typed) record's row holds the data-loading sum observe() would compute.
                self.rank_outlier.observe_data(rank, rec[ROW_DATA], rec[ROW_STEP])
            else:
                self.rank_outlier.observe(row_record(src))
            out = agg.add_row(rec)
            if agg.first_rows:
                self._first_rows()
            return out
        if rec.rank >= agg.world_size:
            self.set_world_size(rec.rank + 1)
        self.rank_outlier.observe(rec)
        out = agg.add(rec)
        if agg.first_rows:
            self._first_rows()
        return out

    def _first_rows(self) -> None:
        # A rank incarnation's first record: judged by check_history once the events stream caught up with it.
        for rank, inc, step, t in self.aggregator.first_rows:
            if not self._history_reported:
                self._unstarted.setdefault((rank, inc), (step, t))
        self.aggregator.first_rows.clear()

    def check_history(self) -> Output:
        """Judge the rank incarnations whose first record came without their ``run_start`` event (call it once the
        events up to those records were fed: the service does when its read of the events stream caught up).

        A collector sends ``run_start`` before any record, so a first record of a later step without it means the
        history before it is not in Redis (Redis restarted without its data, or trimmed it): one ``data_loss``
        (info, a point event) names the step and the ranks, and the ledger starts at the first step seen instead
        of booking the unknown time as start-up. Not judged for a run that resumed from a checkpoint load seen.
        """
        out = Output()
        first = dict(self._unstarted)
        self._unstarted.clear()
        if self._history_reported or not first:
            return out
        # Only the run's first records tell: a relaunch later on without its run_start (an older collector, a
        # replay) follows history that is there. Judged once, on the first check that has records.
        self._history_reported = True
        lost = {k: v for k, v in first.items() if k not in self._started}
        if not lost or len(lost) < len(first):
            return out
        step = min(s for s, _ in lost.values())
        if step <= 0:
            return out
        ranks = sorted({r for r, _ in lost})
        t = min(t for _, t in lost.values())
        if all(self.ledger.drops_of(r) for r in ranks):
            # Those ranks' collectors reported drops (sent with the records that survived): they lost the start
            # themselves, and the drops are shown as such. Not a Redis data loss.
            self.ledger.note_lost_history(step, t, ranks, cause="collector")
            return out
        self.ledger.note_lost_history(step, t, ranks)
        a = Anomaly(kind="data_loss", severity="info", step=step, end_step=step, status=RESOLVED,
                    gen=self.aggregator.generation, ranks=tuple(ranks),
                    evidence={"before_step": step, "ranks": ranks, "first_seen_t": round(t, 3)},
                    message=(f"the run's history before step {step} is not in Redis (rank"
                             f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:16]))} sent records of "
                             f"step {step} on, but their start is missing): Redis restarted without its data or "
                             "trimmed it; the figures cover the run from there"))
        self.anomalies[a.id] = a
        out.anomalies.append(a)
        return self._with_incidents(out)

    def feed(self, items: Iterable[StepRecord | tuple | Event]) -> Iterator[Output]:
        """Feed records (or their rows, :func:`trainhealth.wire.decode_step_rows`) and events in order;
        yield the non-empty outputs, each before the next item is fed.

        The same as :meth:`feed_step` / :meth:`feed_event` on each item, without building an empty
        :class:`Output` for each of the ``world_size - 1`` records of a step that complete nothing
        (the service's hot path).
        """
        add = self._add
        for item in items:
            if type(item) is tuple or isinstance(item, StepRecord):
                aggs = add(item)
                if aggs:
                    yield self._with_incidents(self._steps(aggs))
            else:
                out = self.feed_event(item)
                if out.aggs or out.anomalies or out.recommendations or out.job is not None or out.incidents:
                    yield out

    def feed_event(self, ev: Event) -> Output:
        """Feed one event (run start/end, checkpoints, custom badput, a collective timeout, a worker restart)."""
        return self._with_incidents(self._event(ev))

    def _event(self, ev: Event) -> Output:
        if ev.kind in ("collective_timeout", "worker_restart"):
            det = self.collective_timeout if ev.kind == "collective_timeout" else self.worker_restart
            try:
                found = det.report(ev, self.current_step, self.aggregator.generation)
            except Exception:  # see detector_errors
                self._failed(det, self.current_step)
                return Output()
            out = Output(anomalies=[self._with_hosts(a) for a in found])
            for a in out.anomalies:
                self.anomalies[a.id] = a
            return out
        if ev.kind == "eval":
            return self._evaluated(ev)
        if ev.kind == "rank_exit":
            self.last_words[ev.rank] = LastWord(ev.t, ev.extra.get("reason", ""),
                                                ev.extra.get("error") or ev.extra.get("signal", ""), ev.inc)
            self.ledger.add_event(ev)
            return Output()
        if ev.kind == "run_start":
            self._started.add((ev.rank, ev.inc))
            host = ev.extra.get("host")
            if host:
                self.hosts[ev.rank] = host
            self.ended_ranks.discard(ev.rank)
        elif ev.kind == "run_end":
            self.ended_ranks.add(ev.rank)
            if self.ended_ranks >= set(range(self.world_size)):
                self.ledger.add_event(ev)
                return self._run_ended(ev.t)
        elif ev.kind == "checkpoint_load" and self.first_step is None:
            self._resumed = True
        elif ev.kind == "checkpoint_save" and ev.step is not None and ev.step not in self.checkpoints:
            pos = self.positions.get(ev.step, (None, None))
            self.checkpoints[ev.step] = Checkpoint(ev.step, *pos)
        if ev.kind in PAUSE_EVENTS:
            self._note_pause(ev)
        self.ledger.add_event(ev)
        return Output()

    def _evaluated(self, ev: Event) -> Output:
        """An evaluation's loss (``eval`` event: ``name``, ``loss``, ``step``; the newest step when it names none) for
        the over-fitting detector. A loss that is not a number is left out (logged once per run)."""
        try:
            loss = float(ev.extra.get("loss", ""))
        except ValueError:
            if not self.bad_evals:
                log.warning("run %s: eval event of rank %d has loss %r, not a number; left out", self.run, ev.rank,
                            ev.extra.get("loss"))
            self.bad_evals += 1
            return Output()
        step = ev.step if ev.step is not None else self.current_step
        try:
            found = self.overfitting.evaluate(step, ev.extra.get("name") or "eval", loss, self.aggregator.generation)
        except Exception:  # see detector_errors
            self._failed(self.overfitting, step)
            return Output()
        out = Output(anomalies=[self._with_hosts(a) for a in found])
        for a in out.anomalies:
            self.anomalies[a.id] = a
        return out

    def _note_pause(self, ev: Event) -> None:
        """A checkpoint save or load, an evaluation or other badput: it falls in the first step after the step
        it names (the save of step 12999 in step 13000), else after the last completed step."""
        after = ev.step if ev.step is not None else self.current_step
        name = (ev.extra.get("name") or "badput") if ev.kind == "badput" else ev.kind
        self._pauses.setdefault(after, name)  # every rank reports the same checkpoint
        if len(self._pauses) > MAX_PENDING_PAUSES:
            del self._pauses[min(self._pauses)]

    def _paused(self, agg: StepAggregate) -> StepAggregate:
        """``agg`` as a pause step when a declared pause fell between the previous step of its generation and
        it; the pauses it passes are used up (one naming a step already followed by another was late)."""
        prev = self._prev_end[2] if self._prev_end is not None and self._prev_end[0] == agg.gen else None
        hit = None
        for after in [s for s in self._pauses if s < agg.step]:
            name = self._pauses.pop(after)
            if hit is None and (prev is None or after >= prev):
                hit = name
        return replace(agg, pause=hit) if hit is not None else agg

    def _run_ended(self, t: float) -> Output:
        out = self._live_conditions_end()
        out.job = self.job.finish(t, self.current_step, self.aggregator.generation)
        return out

    def _live_conditions_end(self) -> Output:
        # Conditions of a live job (slowness) cannot be observed once every rank has ended or the job crashed: left
        # active they would keep firing for a job that is gone. Loss findings (divergence, NaN) stay: they describe
        # the model.
        out = self._unsaid()
        out.extend(self._from_each(lambda det: det.finish(self.current_step)))
        for a in [*self.memory_growth.finish(self.current_step), *self.memory_imbalance.finish(self.current_step)]:
            self.anomalies[a.id] = a
            out.anomalies.append(a)
        self._peaks.clear()
        return out

    def _incident(self, a: Anomaly) -> list[Anomaly]:
        """``a`` with its incident id in ``evidence["incident"]`` (and the states it changes in its incident).

        One root cause is one incident: a loss spike, its grad-norm spike and the divergence that follows, a NaN
        grad norm and the collapse it comes with. Anomalies of :data:`INCIDENT_KINDS` of one generation whose
        onsets are within ``max(defaults.INCIDENT_STEPS, the log's interval)`` steps of a member's onset share the
        id of the first of them (its anomaly id); every later state of a member carries it. A grad-norm spike is
        ``info`` alone and ``warning`` once a loss anomaly (:data:`LOSS_MOVED_KINDS`, or a non-finite or missing
        loss) is in its incident: the state of a grad-norm spike raised by a newer member is returned after ``a``.
        """
        if a.kind not in INCIDENT_KINDS:
            return [a]
        inc = self._incident_of.get(a.id)
        moved = a.kind in LOSS_MOVED_KINDS or (a.kind == "nan_inf" and a.evidence.get("reason") in
                                               ("loss", "loss_missing"))
        group = None
        if inc is None:
            reach = max(defaults.INCIDENT_STEPS, self._gap)
            for g in self._incidents:
                if g[1] == a.gen and g[2] - reach <= a.step <= g[3] + reach:
                    group = g
                    break
            if group is None:
                group = [a.id, a.gen, a.step, a.step, False, []]
                self._incidents.append(group)
                del self._incidents[:-100]  # the recent ones: an incident spans a few steps
            group[2], group[3] = min(group[2], a.step), max(group[3], a.step)
            group[5].append(a.id)
            inc = self._incident_of[a.id] = group[0]
        else:
            group = next((g for g in self._incidents if g[0] == inc), None)
        raised = []
        if moved and group is not None and not group[4]:
            group[4] = True
            for other in group[5]:
                b = self.anomalies.get(other)
                if b is not None and b.kind == "grad_norm_spike" and other != a.id:
                    raised.append(_loss_moved(b, True))
        if a.kind == "grad_norm_spike":
            a = _loss_moved(a, group is not None and group[4])
        a = replace(a, evidence={**a.evidence, "incident": inc})
        for b in (a, *raised):  # stored at once: a later anomaly of the same step may raise a grad-norm spike
            self.anomalies[b.id] = b
        return [a, *raised]

    def flush_stale(self, now: float) -> Output:
        """Close steps still missing ranks after the aggregator's stale timeout."""
        return self._with_incidents(self._steps(self.aggregator.flush_stale(now)))

    def flush(self) -> Output:
        """Close every pending step (end of a replayed file), and say what grew since it was last said."""
        out = self._steps(self.aggregator.flush())
        out.extend(self._unsaid())
        return self._with_incidents(out)

    def _unsaid(self) -> Output:
        return self._from_each(lambda det: det.unsaid())

    def _from_each(self, call: Callable[[StepDetector], list[Anomaly]]) -> Output:
        """What ``call`` returns for each step detector, with hosts and incidents, stored; a detector that raises is
        set aside (``_failed``) and the others go on."""
        out = Output()
        for det in self.step_detectors:
            try:
                found = call(det)
            except Exception:
                self._failed(det, self.current_step)
                continue
            for a in found:
                for b in self._incident(self._with_hosts(a)):
                    self.anomalies[b.id] = b
                    out.anomalies.append(b)
        return out

    def check_heartbeats(self, now: float, heartbeats: Mapping[int, Mapping[str, Any]]) -> Output:
        """Hang, dead-rank and job-state checks at unix time ``now``; ranks that ended cleanly are left out.

        Returns the anomaly states that changed (with their advice) and the job's state when it changed; a job that
        crashed has its pending steps closed with the ranks they have (no record of it is coming any more).
        """
        live = {r: hb for r, hb in heartbeats.items() if r not in self.ended_ranks}
        # A rank's records (flushed every second) are newer than its heartbeat (every 5 s): a step they show
        # completed counts as its last, so a hang resolves, and a crash is dated, by the newest evidence.
        for r, (step, t) in self.aggregator.last_records().items():
            hb = live.get(r)
            if hb is not None and (hb.get("step") is None or step > hb["step"]) and t <= now:
                live[r] = {**hb, "step": step, "step_t": t}
        out = Output()
        found: list[Anomaly] = self._memory_samples(live)
        hang = self.hang
        silence = hang.missed_intervals * hang.heartbeat_interval
        try:
            beats = read_beats(now, live)
            verdict = judge(beats, hang.timeout_s, silence, self.aggregator.last_steps(), self.last_words)
        except Exception:
            self._failed(self.dead_rank, self.current_step)
            return out
        try:
            found += hang.check(now, live, verdict.culprit)
        except Exception:
            self._failed(hang, self.current_step)
        state = self.job.state.state if self.job.state is not None else "running"
        try:
            found += self.dead_rank.check(now, live, hang.timeout_s, self.aggregator.generation, verdict,
                                          job_state=state, current_step=self.current_step)
        except Exception:
            self._failed(self.dead_rank, self.current_step)
        #: When no rank is heard from any more (None while one is): the newest heartbeat heard, unix s. The ledger
        #: does not run on past it, also before the job is called crashed.
        self.silent_since = (max((float(hb["t"]) for hb in live.values()), default=now)
                             if live and not verdict.alive else None)
        try:
            newest = max((float(hb["t"]) for hb in live.values()), default=now)
            out.job = self.job.update(now, verdict, newest_hb_t=newest, silence_s=silence, hang=hang.open,
                                      finished=bool(heartbeats) and not live, gen=self.aggregator.generation,
                                      current_step=self.current_step, restart=self._restart)
        except Exception:
            self._failed(self.job, self.current_step)
        if out.job is not None and out.job.state == "crashed":
            # Nothing more comes from this launch: its pending steps close with the ranks they have, the conditions
            # of a live job (stragglers, slowdowns) end as at a run's end, and the dead-rank anomaly says it crashed.
            out.extend(self._steps(self.aggregator.flush()))
            out.extend(self._live_conditions_end())
            try:
                found += self.dead_rank.check(now, live, hang.timeout_s, self.aggregator.generation, verdict,
                                              job_state="crashed", current_step=self.current_step)
            except Exception:
                self._failed(self.dead_rank, self.current_step)
        for a in found:
            a = self._in_job_incident(self._with_memory(self._with_hosts(a)))
            self.anomalies[a.id] = a
            out.anomalies.append(a)
            if RecoveryAdvisor.concerns(a) and self._incident_root(a):
                rec = self._advise_recovery(a, now)
                if rec is not None:
                    out.recommendations[a.id] = rec
        return self._with_incidents(out)

    def _with_incidents(self, out: Output) -> Output:
        """``out`` with the incidents its anomalies and recommendations changed, and without the recommendations
        an incident does not give: one per incident, its latest stage's (the divergence's rollback, not the
        spike's before it), so the earlier one is neither refreshed nor proposed again."""
        if not out.anomalies and not out.recommendations:
            return out
        t = self._prev_end[1] if self._prev_end is not None else None
        out.incidents.update(self.incidents.update(out.anomalies, out.recommendations.values(), t))
        for aid, rec in list(out.recommendations.items()):
            inc = self.incidents.incident_of(aid)
            if inc is not None and inc.recommendation != rec.id:
                del out.recommendations[aid]
        return out

    def _in_job_incident(self, a: Anomaly) -> Anomaly:
        """A hang, dead-rank or restart anomaly with the id of its job incident in ``evidence["incident"]``.

        One stop of the job is one incident: a rank dies, the others hang on it, the launcher restarts them. Its id
        is its first anomaly's; a hang or dead rank opening while one of the same generation is open joins it, and
        the restart that ends the generation joins the incident of that generation's stop.
        """
        if a.kind not in JOB_KINDS:
            return a
        inc = self._incident_of.get(a.id)
        if inc is None:
            open_inc = self._job_incident
            if a.kind == "restart":
                inc = open_inc[0] if open_inc is not None and open_inc[1] == a.gen - 1 else a.id
            else:
                inc = open_inc[0] if open_inc is not None and open_inc[1] == a.gen and open_inc[2] else a.id
                self._job_incident = (inc, a.gen, True)
            self._incident_of[a.id] = inc
        if a.kind != "restart" and self._job_incident is not None and self._job_incident[0] == inc:
            active = any(b is not None and b.active for b in (self.hang.open, self.dead_rank.open))
            self._job_incident = (inc, self._job_incident[1], active)
        return replace(a, evidence={**a.evidence, "incident": inc})

    def _restarted(self, a: Anomaly, agg: StepAggregate) -> Anomaly:
        """A restart, naming the rank that stopped first before it: the culprit of the hang or crash seen, else the
        ranks of the old launch that left no last word while the others died of a communication error (a launcher
        that relaunches in seconds replaces the heartbeats before a silence shows)."""
        self._restart = (agg.t_end, agg.step)
        culprit = self.job.last_culprit
        if culprit is None:
            old = {r: w for r, w in self.last_words.items() if w.inc < agg.inc}
            quiet = sorted(r for r in range(self.world_size) if not (r in old and old[r].victim))
            if old and 0 < len(quiet) < self.world_size:
                r = quiet[0]
                culprit = Culprit(r, self.hosts.get(r), None, a.evidence.get("last_step"),
                                  "no last word (killed, crashed or lost its node) while the others exited with a "
                                  "communication error")
        self.job.last_culprit, self.job.restart_culprit = None, culprit
        if culprit is None:
            return a
        where = f" (host {culprit.host})" if culprit.host else ""
        return replace(a, ranks=(culprit.rank,), evidence={**a.evidence, "culprit": culprit.to_dict()},
                       message=a.message + f"; rank {culprit.rank}{where} stopped first: {culprit.why}")

    @staticmethod
    def _incident_root(a: Anomaly) -> bool:
        """Whether ``a`` is its incident's first anomaly: one recommendation per incident (the hang that follows a
        dead rank is in the dead rank's)."""
        return a.evidence.get("incident", a.id) == a.id

    def _advise_recovery(self, a: Anomaly, now: float) -> Recommendation | None:
        try:
            return self.recovery.advise(
                a, run=self.run, checkpoints=self.checkpoints.values(), current_step=self.current_step,
                step_s=self.hang.median_step_s, world_size=self.world_size, gpu_hour_usd=self.ledger.gpu_hour_usd,
                history=self.anomalies.values(), restart_s=self.ledger.restart_s, now=now)
        except Exception:
            self._failed(self.recovery, self.current_step)
            return None

    def _failed(self, who: object, step: int) -> None:
        name = type(who).__name__
        n = self.detector_errors[name] = self.detector_errors.get(name, 0) + 1
        if n == 1 or n % ERROR_LOG_EVERY == 0:
            log.exception("run %s: %s failed at step %d (error %d); the other detectors go on", self.run, name,
                          step, n)

    def _steps(self, aggs: list[StepAggregate]) -> Output:
        out = Output()
        for agg in aggs:
            if self._pauses:
                agg = self._paused(agg)
            out.aggs.append(agg)
            self.ledger.add_step(agg)
            self.step_times.note(agg.step, agg.t_end)
            # The step's own time (timed by the ranks, else the job's own step_s), the one the timing
            # detectors judge; an untimed step without one lasted since the previous step ended, per step
            # (a log written every N steps must not make the hang timeout and advice costs N times too long).
            dur = step_seconds(agg)
            prev = self._prev_end
            if dur is None and prev is not None and prev[0] == agg.gen:
                dur = (agg.t_end - prev[1]) / max(agg.step - prev[2], 1)
            self.hang.observe_step(dur, agg.gen, agg.step, agg.t_end)
            if prev is not None and prev[0] == agg.gen and agg.step > prev[2]:
                self._gap = agg.step - prev[2]
            self._prev_end = (agg.gen, agg.t_end, agg.step)
            self.current_step = agg.step
            if self.first_step is None:
                self.first_step = agg.step
            if agg.consumed_samples is not None or agg.batch_index is not None:
                self.positions[agg.step] = (agg.consumed_samples, agg.batch_index)
                if len(self.positions) > 100_000:
                    self.positions.popitem(last=False)
            if agg.sample_indices:
                body = json.dumps({str(r): v for r, v in sorted(agg.sample_indices.items())}, separators=(",", ":"))
                out.samples.append((agg.gen, agg.step, agg.n_ranks, body))
                small = len(body) <= INCIDENT_SAMPLE_INDICES_BYTES
                self.sample_steps[agg.step] = (agg.gen, body if small else None)
                self.sample_steps.move_to_end(agg.step)
                if len(self.sample_steps) > STEP_TIMES:
                    self.sample_steps.popitem(last=False)
                if small:
                    self._sample_bodies.append(agg.step)
                    if len(self._sample_bodies) > SAMPLE_BODIES_KEPT:  # at most ~4 MiB a run
                        old = self._sample_bodies.popleft()
                        kept = self.sample_steps.get(old)
                        if kept is not None and kept[1] is not None and old not in self._sample_bodies:
                            self.sample_steps[old] = (kept[0], None)
            changed = []
            for det in self.step_detectors:
                try:
                    found = det.update(agg)
                except Exception:  # see detector_errors
                    self._failed(det, agg.step)
                    continue
                for a in found:
                    if a.kind == "restart":
                        a = self._in_job_incident(self._with_memory(self._restarted(a, agg)))
                    changed += self._incident(self._with_gpu(self._with_hosts(a)))
            out.anomalies += changed
            for a in changed:
                self.anomalies[a.id] = a
            # Advice on changes, and every 10 steps for open ones (a "wait" turns into "rollback").
            due = agg.step - self._last_advice >= 10
            candidates = {a.id: a for a in changed}
            if due:
                candidates.update((i, a) for i, a in self.anomalies.items() if a.active)
            for a in candidates.values():
                rec = None
                if RollbackAdvisor.concerns(a):
                    rec = self._advise(a)
                elif RecoveryAdvisor.concerns(a) and self._incident_root(a):
                    rec = self._advise_recovery(a, agg.t_end)
                if rec is not None:
                    out.recommendations[a.id] = rec
            if due:
                self._last_advice = agg.step
                # An open straggler or throughput drop costs more with every step: its incident says so.
                out.incidents.update(self.incidents.advance(agg.step))
        return out

    def _advise(self, a: Anomaly) -> Recommendation | None:
        try:
            return self.advisor.advise(
                a, run=self.run, checkpoints=self.checkpoints.values(), current_step=self.current_step,
                step_s=self.hang.median_step_s, world_size=self.world_size, gpu_hour_usd=self.ledger.gpu_hour_usd,
                data_positions=self.positions, history=self.anomalies.values(),
                first_step=None if self._resumed else self.first_step,
            )
        except Exception:
            self._failed(self.advisor, self.current_step)
            return None

    def _memory_samples(self, beats: Mapping[int, Mapping[str, Any]]) -> list[Anomaly]:
        """Keep each rank's new memory sample (a heartbeat's ``mem``), feed the growth detector with it and judge the
        ranks' peaks side by side (the imbalance detector)."""
        out: list[Anomaly] = []
        for r, hb in beats.items():
            gpu = hb.get("gpu")
            if isinstance(gpu, dict) and "absent" not in gpu:
                self.gpu[r] = gpu
            mem, t = hb.get("mem"), hb.get("t")
            if not isinstance(mem, dict) or not isinstance(t, (int, float)):
                continue
            inc = hb.get("inc") if isinstance(hb.get("inc"), (int, float)) else None
            step = hb.get("step") if isinstance(hb.get("step"), int) else self.current_step
            host = self.hosts.get(r) or (hb.get("host") if isinstance(hb.get("host"), str) else None)
            gen = self.aggregator.generation
            try:
                self.memory.add(r, float(t), mem, inc)
                cuda = mem.get("cuda")
                if isinstance(cuda, dict) and isinstance(cuda.get("alloc_peak"), (int, float)) and isinstance(
                        cuda.get("total"), (int, float)):
                    self._peaks[r] = (float(t), float(cuda["alloc_peak"]), float(cuda["total"]))
                if isinstance(cuda, dict) and isinstance(cuda.get("alloc"), (int, float)):
                    out += self.memory_growth.update(r, host, float(t), step=step, inc=inc or 0.0, metric="cuda",
                                                     value=float(cuda["alloc"]), capacity=cuda.get("total"), gen=gen)
                if isinstance(mem.get("rss_anon"), (int, float)):
                    out += self.memory_growth.update(r, host, float(t), step=step, inc=inc or 0.0, metric="host",
                                                     value=float(mem["rss_anon"]), capacity=mem.get("host_total"),
                                                     gen=gen)
            except Exception:  # see detector_errors
                self._failed(self.memory_growth, self.current_step)
        if beats and self._peaks:
            try:
                out += self.memory_imbalance.update(self._peaks, step=self.current_step,
                                                    gen=self.aggregator.generation, hosts=self.hosts)
            except Exception:  # see detector_errors
                self._failed(self.memory_imbalance, self.current_step)
        return out

    def _with_gpu(self, a: Anomaly) -> Anomaly:
        """A straggler, slow node, rank outlier or node with a slow network with what its GPUs show beside the
        others' (``evidence["gpu"]``, :func:`~trainhealth.detectors.gpu_health.explain`), and the finding in its
        message when they show one."""
        if a.kind not in ("straggler", "slow_node", "rank_outlier", "network_slow") or not a.active or not self.gpu \
                or not a.ranks:
            return a
        who = (f"rank {a.ranks[0]}" if len(a.ranks) == 1 else f"ranks {fmt_ranks(a.ranks)}")
        if a.kind in ("slow_node", "network_slow") and a.hosts:
            who = f"{a.hosts[0]}'s {who}"
        found = explain_gpu(a.ranks, self.gpu, who)
        if found is None:
            return a
        msg = f"{a.message}; {found['text']}" if found["abnormal"] else a.message
        return replace(a, evidence={**a.evidence, "gpu": found}, message=msg)

    def _with_memory(self, a: Anomaly) -> Anomaly:
        """A dead rank or restart whose culprit died near its memory's limit, with ``evidence["memory"]`` (the
        :class:`~trainhealth.detectors.memory_pressure.MemoryVerdict`) and "likely out of memory" in its message."""
        if a.kind not in ("dead_rank", "restart") or (a.kind == "dead_rank" and not a.active) or "memory" in a.evidence:
            return a  # a restart is a point event, created resolved
        culprit = a.evidence.get("culprit")
        ranks = [culprit["rank"]] if isinstance(culprit, dict) and isinstance(culprit.get("rank"), int) else a.ranks
        for r in ranks:
            if a.kind == "dead_rank":
                v = self.memory.verdict(r)
                if v is not None:
                    self._death_memory[r] = v
            else:
                v = self._death_memory.pop(r, None) or self.memory.verdict(r, previous=True)
            if v is not None:
                return replace(a, evidence={**a.evidence, "memory": {"rank": r, **v.to_dict()}},
                               message=f"{a.message}; likely out of memory on rank {r}: {v.why}")
        return a

    def _with_hosts(self, a: Anomaly) -> Anomaly:
        hosts = tuple(sorted({self.hosts[r] for r in a.ranks if r in self.hosts}))
        return replace(a, hosts=hosts) if hosts != a.hosts else a


def _loss_moved(a: Anomaly, moved: bool) -> Anomaly:
    """A grad-norm spike's state with ``evidence["loss_moved"]``; an ``info`` one is a ``warning`` when the loss moved
    in its incident (see :meth:`RunPipeline._incident`)."""
    sev = "warning" if moved and a.severity == "info" else a.severity
    return replace(a, severity=sev, evidence={**a.evidence, "loss_moved": moved})


def agg_fields(agg: StepAggregate) -> dict[str, Any]:
    """Stream fields of a ``th:{run}:agg`` entry (see docs/architecture.md)."""
    d: dict[str, Any] = {
        "step": agg.step, "gen": agg.gen, "t_end": repr(agg.t_end), "n_ranks": agg.n_ranks,
        "data_s": repr(agg.data_s),
        "busy": json.dumps([None if b is None else round(b, 6) for b in agg.busy] if None in agg.busy else
                           list(map(round, agg.busy, repeat(6)))),
    }
    if agg.t_start is not None:
        d["t_start"] = repr(agg.t_start)
        d["dur"] = repr(agg.t_end - agg.t_start)
    if agg.step_s is not None:
        d["step_s"] = repr(agg.step_s)
    for name in ("loss", "grad_norm", "lr"):
        v = getattr(agg, name)
        if v is not None:
            d[name] = repr(float(v)) if math.isfinite(v) else str(v)
    for name in ("tokens", "samples", "consumed_samples", "batch_index"):
        v = getattr(agg, name)
        if v is not None:
            d[name] = v
    if agg.skipped:
        d["skipped"] = 1
    if agg.loss_missing:
        d["loss_missing"] = 1
    return d
