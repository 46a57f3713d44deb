"""Run the live detection pipeline over a parsed log, without Redis.

``trainhealth analyze`` and ``bench/detection_eval.py`` use this; ``trainhealth replay`` places the
points on the same :mod:`trainhealth.timeline`, so a log analysed offline and the same log replayed
into the live service see the same steps at the same (synthetic) times and produce the same anomalies.

The items are a log's :class:`LogPoint` s and, from :func:`trainhealth.collectors.importers.read_items`, its
:class:`LogEvent` s (a collective timeout, a restart of the worker group): an event is placed on the
timeline where it is in the file — at the end of the point before it (the run's start before any) —
and fed as the wire :class:`~trainhealth.wire.Event` a collector would send.
"""

from __future__ import annotations

from collections.abc import Iterable

from trainhealth.anomaly import Anomaly
from trainhealth.detectors.incidents import Incident
from trainhealth.detectors.pipeline import Output, RunPipeline
from trainhealth.logpoint import LogEvent, LogPoint
from trainhealth.timeline import Arranged, TimedPoint, arrange, check_step_seconds
from trainhealth.wire import Event, StepRecord, encode_value


def wire_event(ev: LogEvent, t: float, inc: float) -> Event:
    """The :class:`~trainhealth.wire.Event` a collector would send for ``ev`` at unix time ``t``: ``rank``
    the event's (0 when it names none, as the single stream of a log), ``step`` and ``seconds`` as
    they are, every field in ``extra`` as text (:func:`trainhealth.wire.encode_value`, then Redis's text), as
    the detector service decodes them.

    >>> wire_event(LogEvent("collective_timeout", rank=4, seconds=600.067, fields=(("op", "ALLREDUCE"),
    ...            ("seq", 1580), ("timeout_s", 600.0))), 10.0, 0.0)
    Event(kind='collective_timeout', rank=4, t=10.0, inc=0.0, step=None, seconds=600.067, \
extra={'op': 'ALLREDUCE', 'seq': '1580', 'timeout_s': '600.0'})
    """
    return Event(ev.kind, ev.rank or 0, t, inc, step=ev.step, seconds=ev.seconds,
                 extra={k: str(encode_value(v)) for k, v in ev.fields})


class OfflineRun:
    """Feed a log's points through a :class:`RunPipeline`: a one-rank run, or the ranks of a per-rank log.

    Each train point becomes the :class:`StepRecord` the collector's ``log_step`` would send
    (``t`` = start + offset, untimed; ``step_s`` = the log's seconds per step where it gave one;
    ``rank`` = the point's rank, 0 for a single stream; ``sections`` = its
    ``LogPoint.sections``), each evaluation a ``badput`` event named ``evaluation`` — what
    ``trainhealth replay`` pushes through Redis. Each :class:`LogEvent` becomes the
    :class:`~trainhealth.wire.Event` of its kind (:func:`wire_event`). For a per-rank log call
    :meth:`expect_ranks` first (:meth:`feed_all` does): the world size and the ranks' hosts.

    Parameters
    ----------
    run : str
        Run id put in anomalies and recommendations.
    step_seconds : float
        Assumed seconds per step where the log has no times.
    start : float
        Unix time of the run's start on the synthetic timeline.
    pipeline : RunPipeline | None
        A pipeline to feed (default: a fresh one-rank pipeline).

    Attributes
    ----------
    anomalies : dict[str, Anomaly]
        Latest state of every anomaly by id, in onset order.
    incidents : dict[str, Incident]
        Latest state of every incident (one per root cause: :mod:`trainhealth.detectors.incidents`) by id, in the
        order they opened.
    steps, evals : int
        Train points and evaluations fed.
    events : dict[str, int]
        Events fed (:class:`LogEvent` s of the log), by kind, in order of first appearance.
    timed_steps : int
        Train points whose step time the log gave.
    ranks : tuple[int, ...]
        The ranks of a per-rank log (empty for a single stream).
    """

    def __init__(self, run: str = "offline", step_seconds: float = 1.0, start: float = 0.0,
                 pipeline: RunPipeline | None = None) -> None:
        check_step_seconds(step_seconds)
        self.run = run
        self.step_seconds = step_seconds
        self.start = start
        self.pipeline = pipeline or RunPipeline(1, run=run)
        self.pipeline.ledger.note_start(start)
        self.anomalies: dict[str, Anomaly] = {}
        self.incidents: dict[str, Incident] = {}
        self.steps = self.evals = self.timed_steps = 0
        self.events: dict[str, int] = {}
        self.ranks: tuple[int, ...] = ()

    def expect_ranks(self, arranged: Arranged) -> None:
        """Set the world size (highest rank + 1) and hosts of a per-rank log; nothing for a single stream."""
        if arranged.ranks:
            self.ranks = arranged.ranks
            self.pipeline.set_world_size(arranged.world_size)
            self.pipeline.hosts.update(arranged.hosts)  # the slow-node detector's rank -> host map

    def feed(self, tp: TimedPoint) -> Output:
        """Feed one placed point or event; returns what the pipeline produced."""
        p, t = tp.point, self.start + tp.offset
        rank = p.rank or 0
        if isinstance(p, LogEvent):
            self.events[p.kind] = self.events.get(p.kind, 0) + 1
            return self._keep(self.pipeline.feed_event(wire_event(p, t, self.start)))
        if p.is_eval:
            self.evals += 1
            self.pipeline.feed_event(Event("badput", rank, t, self.start, step=p.step,
                                           seconds=p.eval_seconds or 0.0, extra={"name": "evaluation"}))
            out = Output()
            for name, loss in p.eval_losses:  # each set's loss, as Monitor.log_eval sends it
                out.extend(self._keep(self.pipeline.feed_event(
                    Event("eval", rank, t, self.start, step=p.step, extra={"name": name, "loss": repr(loss)}))))
            return out
        self.steps += 1
        self.timed_steps += tp.timed
        rec = StepRecord(rank=rank, step=p.step, inc=self.start, t=t, loss=p.loss, grad_norm=p.grad_norm, lr=p.lr,
                         tokens=p.tokens, consumed_samples=p.consumed_samples,
                         skipped=None if tp.skipped is None else int(tp.skipped),
                         loss_missing=1 if p.loss_missing else None,  # the log line left its loss out
                         sections=dict(p.sections),  # the rank's busy time for the rank-comparison detectors
                         step_s=tp.step_s)  # the log's own step time, never an assumed one
        return self._keep(self.pipeline.feed_step(rec))

    def feed_all(self, points: Iterable[LogPoint | LogEvent]) -> OfflineRun:
        """Place (:func:`arrange`) and feed every point and event, then close pending steps; returns self."""
        arranged = arrange(points, self.step_seconds)
        self.expect_ranks(arranged)
        for tp in arranged.points:
            self.feed(tp)
        self.finish()
        return self

    def finish(self) -> Output:
        """Close every pending step (the end of the file)."""
        return self._keep(self.pipeline.flush())

    def _keep(self, out: Output) -> Output:
        for a in out.anomalies:
            self.anomalies[a.id] = a
        for iid, inc in out.incidents.items():
            if inc is None:
                self.incidents.pop(iid, None)
            else:
                self.incidents[iid] = inc
        return out
