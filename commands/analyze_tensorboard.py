"""``trainhealth analyze --tensorboard DIR``: the findings as TensorBoard scalars and text, beside the curves people
already read there.

Per analysed file, one run directory ``DIR/<run>/`` with one event file:

- ``trainhealth/anomaly/<kind>``: a scalar at each anomaly's onset step — its severity, 1 info, 2 warning,
  3 critical — so the anomalies show as points on TensorBoard's step axis beside the loss;
- ``trainhealth/anomalies``: the same as text (Markdown) at each onset step: severity, kind, steps, the message;
- ``trainhealth/advice``: each recommendation's summary and reasoning, at its onset step;
- at the last step, when the report estimates goodput (the log times its steps; else ``trainhealth/goodput`` says
  why not, as text): ``trainhealth/goodput_time_pct`` and ``trainhealth/goodput_tokens_pct`` (when the log counts
  tokens), ``trainhealth/throughput_tok_s`` and ``trainhealth/goodput_tok_s``, ``trainhealth/badput_seconds/<cause>``
  for each cause that cost time, ``trainhealth/gpu_hours_lost`` and ``trainhealth/cost_usd_lost`` when priced, and
  ``trainhealth/report``: the text report of the file.

Written with TensorBoard's own event writer and summary metadata (the ``logs`` extra), no TensorFlow; TensorBoard's
own reader reads them back (tests/test_analyze_tensorboard.py).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from trainhealth.anomaly import SEVERITIES

SEVERITY_LEVEL = {s: i + 1 for i, s in enumerate(SEVERITIES)}  # info 1, warning 2, critical 3
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _scalar(tag: str, value: float) -> Any:
    from tensorboard.compat.proto import summary_pb2

    return summary_pb2.Summary.Value(tag=tag, simple_value=float(value))


def _text(tag: str, markdown: str) -> Any:
    import numpy as np
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.text import metadata
    from tensorboard.util import tensor_util

    return summary_pb2.Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(display_name=tag,
                                                                                         description=""),
                                     tensor=tensor_util.make_tensor_proto(np.array([markdown], dtype=object)))


def write(reports: list[Any], directory: str | Path, report_text: Any = None) -> list[Path]:
    """Write one run directory per report (a :class:`~trainhealth.commands.analyze_report.FileReport` that parsed)
    under ``directory``; return the event files written. ``report_text(rep)`` gives a file's text report lines.

    Raises :class:`OSError` when the directory cannot be written.
    """
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    out = []
    now = time.time()
    for rep in reports:
        if rep.error is not None:
            continue
        logdir = Path(directory) / (_SAFE.sub("_", rep.run) or "run")
        logdir.mkdir(parents=True, exist_ok=True)
        writer = EventFileWriter(str(logdir))
        events: list[tuple[int, list[Any]]] = []
        for a in sorted(rep.anomalies, key=lambda a: (a.step, a.kind)):
            steps = f"step {a.step:,}" if a.end_step in (None, a.step) else f"steps {a.step:,}–{a.end_step:,}"
            events.append((a.step, [_scalar(f"trainhealth/anomaly/{a.kind}", SEVERITY_LEVEL.get(a.severity, 0)),
                                    _text("trainhealth/anomalies", f"**{a.severity.upper()} {a.kind}** ({steps}, "
                                                                   f"{a.status}): {a.message}")]))
        for rec in rep.recommendations:
            body = "\n".join(f"- {line}" for line in rec.reasoning)
            events.append((rec.onset_step, [_text("trainhealth/advice", f"**{rec.summary}**\n\n{body}")]))
        last = rep.last_step if rep.last_step is not None else 0
        final: list[Any] = []
        good = rep.goodput()  # as the text and JSON reports say it: no figures on an assumed timeline
        snap = good["ledger"] or {}
        if good["ledger"] is None:
            final.append(_text("trainhealth/goodput", f"goodput {good['note']}"))
        seconds = snap.get("seconds") or {}
        if isinstance(snap.get("goodput_pct"), (int, float)):
            final.append(_scalar("trainhealth/goodput_time_pct", snap["goodput_pct"]))
        if snap.get("tokens_total"):
            final.append(_scalar("trainhealth/goodput_tokens_pct",
                                 100.0 * (snap.get("tokens_good") or 0) / snap["tokens_total"]))
        for name in ("throughput_tok_s", "goodput_tok_s"):
            if snap.get("tokens_total") and isinstance(snap.get(name), (int, float)):
                final.append(_scalar(f"trainhealth/{name}", snap[name]))
        for cause, s in seconds.items():
            if cause != "productive" and s and s > 0:
                final.append(_scalar(f"trainhealth/badput_seconds/{cause}", s))
        gpu_hours = snap.get("gpu_hours") or {}
        lost = sum(v for k, v in gpu_hours.items() if k != "productive" and v)
        if gpu_hours:
            final.append(_scalar("trainhealth/gpu_hours_lost", lost))
        if isinstance(snap.get("badput_cost_usd"), (int, float)):
            final.append(_scalar("trainhealth/cost_usd_lost", snap["badput_cost_usd"]))
        if report_text is not None:
            final.append(_text("trainhealth/report", "```\n" + "\n".join(report_text(rep)) + "\n```"))
        events.append((last, final))
        for step, values in events:
            if values:
                writer.add_event(event_pb2.Event(wall_time=now, step=int(step),
                                                 summary=summary_pb2.Summary(value=values)))
        before = set(logdir.glob("events.out.tfevents.*"))
        writer.close()
        out += sorted(set(logdir.glob("events.out.tfevents.*")) - before) or sorted(before)[-1:]
    return out
