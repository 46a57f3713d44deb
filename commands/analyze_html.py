"""The standalone HTML report of ``trainhealth analyze --html FILE``.

One self-contained file that works offline: plotly.js is embedded once (from the installed
``plotly`` package, never a CDN), each figure's data inline. Per file: the run summary, the
anomalies with their messages and evidence, the rollback recommendations, and Plotly charts —
loss and grad norm with the anomalies marked (:func:`trainhealth.dashboard.charts.training_curves`, the
dashboard's own figure), the step time where the log has one, and where the wall time went.
The series are the bounded, decimated ones of :class:`trainhealth.commands.analyze.ChartSeries`, so the
page stays a few MB (mostly plotly.js) for any length of log.
"""

from __future__ import annotations

import html
import json
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from trainhealth import __version__
from trainhealth.commands.analyze_report import SCHEMA_VERSION, FileReport, exit_status
from trainhealth.dashboard.charts import SEVERITY_COLORS, category_color, label, training_curves

#: Anomaly kinds about step time: their ranges are shaded on the step-time chart.
TIMING_KINDS = frozenset({"slow_step", "throughput_drop", "straggler", "slow_node", "hang", "rank_outlier"})
#: Plotly config of every chart: no "produced with Plotly" logo, resizes with the window.
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#222;
padding:0 16px}
h1{font-size:22px}h2{font-size:18px;margin-top:36px;border-bottom:1px solid #ddd;padding-bottom:4px;
word-break:break-all}
table{border-collapse:collapse;margin:8px 0 16px;font-size:14px}td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f6f6f6}
.sev{font-weight:600;color:#fff;border-radius:3px;padding:1px 6px;font-size:12px}
.note{color:#555;font-size:14px}.error{color:#d62728;font-weight:600}
pre{white-space:pre-wrap;font-size:12px;margin:0}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def steps_frame(rep: FileReport) -> pd.DataFrame:
    """The decimated rows as a step frame (``step``, ``gen``, ``loss``, ``grad_norm``, ``step_seconds``)."""
    rows = rep.chart.rows() if rep.chart is not None else []
    return pd.DataFrame(rows, columns=["gen", "step", "loss", "grad_norm", "step_seconds"], dtype="float64")


def anomalies_frame(rep: FileReport) -> pd.DataFrame:
    """The anomalies as the dashboard's anomaly frame (the columns :func:`training_curves` reads)."""
    cols = ["id", "kind", "severity", "status", "step", "end_step", "ranks", "message"]
    return pd.DataFrame([{c: getattr(a, c) for c in cols} for a in rep.anomalies], columns=cols)


def curves_figure(rep: FileReport, steps: pd.DataFrame) -> go.Figure:
    """Loss and grad norm with anomaly markers: the dashboard's figure on the decimated series."""
    checkpoints = pd.DataFrame(columns=["step", "kind", "seconds", "n_ranks"])
    fig = training_curves(steps.astype({"step": "int64", "gen": "int64"}), anomalies_frame(rep), checkpoints)
    shown = len(steps)
    if rep.chart is not None and shown < rep.chart.points:
        fig.update_layout(title_text=f"Loss and grad norm per step ({shown:,} of {rep.chart.points:,} logged steps "
                                     "drawn: min/max per bucket, anomaly steps kept)")
    return fig


def step_time_figure(rep: FileReport, steps: pd.DataFrame) -> go.Figure | None:
    """Seconds per step as logged (None when the log has no step times), timing anomalies shaded."""
    timed = steps[steps["step_seconds"].notna()]
    if timed.empty:
        return None
    fig = go.Figure()
    for gen, part in timed.groupby("gen"):
        fig.add_trace(go.Scatter(x=part["step"].astype("int64"), y=part["step_seconds"], mode="lines",
                                 name=f"gen {int(gen)}" if timed["gen"].nunique() > 1 else "s per step",
                                 line={"width": 1, "color": "#1f77b4"},
                                 hovertemplate="step %{x}<br>%{y:.4g} s per step<extra></extra>"))
    for a in rep.anomalies:
        if a.kind in TIMING_KINDS:
            end = a.end_step if a.end_step is not None else int(timed["step"].max())
            fig.add_vrect(x0=a.step - 0.5, x1=end + 0.5, fillcolor=SEVERITY_COLORS.get(a.severity, "#7f7f7f"),
                          opacity=0.15, line_width=0, annotation_text=label(a.kind), annotation_position="top left")
    fig.update_layout(height=300, margin={"l": 10, "r": 10, "t": 40, "b": 10}, showlegend=timed["gen"].nunique() > 1,
                      title={"text": "Step time (seconds per step, as logged)", "x": 0, "font": {"size": 14}},
                      xaxis_title="step", yaxis={"title": "s per step", "rangemode": "tozero"})
    return fig


def goodput_figure(rep: FileReport) -> go.Figure | None:
    """Where the wall time went: one bar per ledger category above 0 s (None on an assumed timeline)."""
    snap = rep.ledger
    if snap is None or rep.timeline == "assumed":
        return None
    wall = snap["wall_s"] or 1.0
    cats = sorted(((k, v) for k, v in snap["seconds"].items() if v > 0), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(
        x=[v for _, v in cats], y=[label(k) for k, _ in cats], orientation="h",
        marker_color=[category_color(k) for k, _ in cats], text=[f"{100 * v / wall:.1f}%" for _, v in cats],
        textposition="auto", hovertemplate="%{y}: %{x:,.1f} s<extra></extra>"))
    title = f"Where the wall time went: goodput {snap['goodput_pct']:.1f}% of {wall:,.0f} s productive"
    unobserved = snap["seconds"].get("unobserved", 0.0)
    if unobserved > 0 and wall > unobserved:  # the log skips stretches: say what the time it covers gave
        title += (f"<br><sup>{unobserved:,.0f} s unobserved (steps the log does not cover); "
                  f"{100 * snap['seconds']['productive'] / (wall - unobserved):.1f}% of the rest productive</sup>")
    top = 60 if "<br>" in title else 40
    fig.update_layout(height=max(180, min(420, 90 + 32 * len(cats))), margin={"l": 10, "r": 10, "t": top, "b": 10},
                      title={"text": title, "x": 0, "font": {"size": 14}},
                      xaxis={"title": "seconds", "rangemode": "tozero"}, yaxis={"automargin": True})
    return fig


def _div(fig: go.Figure, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=PLOTLY_CONFIG)


def _summary_table(rep: FileReport) -> str:
    span = f"{rep.first_step:,} – {rep.last_step:,}" if rep.first_step is not None else "—"
    metrics = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in rep.metrics.items() if v) or "none"
    timing = {"logged": "every logged step has its step time",
              "partial": f"{rep.timed_steps:,} of {rep.steps:,} logged steps have a step time; the others are "
                         f"assumed at {rep.step_seconds:g} s per step",
              "assumed": f"no step times in the log: timeline assumed at {rep.step_seconds:g} s per step"}[rep.timeline]
    rows = [("format", rep.format or "—"), ("training steps logged", f"{rep.steps:,}"), ("step range", span),
            ("evaluations", f"{rep.evals:,}"), ("metrics (steps carrying them)", metrics), ("timings", timing)]
    if rep.events:
        rows.insert(4, ("events", ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in rep.events.items())))
    if not rep.steps:  # a log of events only
        rows = [r for r in rows if r[0] in ("format", "training steps logged", "events")]
    if any(rep.non_finite.values()):
        rows.append(("non-finite", ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in rep.non_finite.items() if v)))
    for w in rep.warnings:
        rows.append(("warning", w))
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows) + "</table>"


def _anomaly_table(rep: FileReport) -> str:
    if not rep.anomalies:
        return "<p>No anomalies.</p>"
    head = "<tr><th>severity</th><th>kind</th><th>onset step</th><th>end step</th><th>status</th><th>message</th>" \
           "<th>evidence</th></tr>"
    body = []
    for a in rep.anomalies:
        color = SEVERITY_COLORS.get(a.severity, "#7f7f7f")
        ev = json.dumps(a.evidence, indent=1, sort_keys=True, allow_nan=True, default=str)
        body.append(f"<tr><td><span class='sev' style='background:{color}'>{_e(a.severity)}</span></td>"
                    f"<td>{_e(a.kind)}</td><td>{a.step}</td><td>{'' if a.end_step is None else a.end_step}</td>"
                    f"<td>{_e(a.status)}</td><td>{_e(a.message)}</td>"
                    f"<td><details><summary>numbers</summary><pre>{_e(ev)}</pre></details></td></tr>")
    return f"<table>{head}{''.join(body)}</table>"


def _recommendations(rep: FileReport) -> str:
    if not rep.recommendations:
        return ""
    items = []
    for r in rep.recommendations:
        reasons = "".join(f"<li>{_e(x)}</li>" for x in [*r.reasoning, *r.options])
        items.append(f"<li><b>{_e(r.action)}</b> — {_e(r.kind)} at step {r.onset_step}: {_e(r.summary)}"
                     f"<details><summary>reasoning</summary><ul>{reasons}</ul></details></li>")
    note = (" <span class='note'>(costs use the assumed timeline)</span>" if rep.timeline == "assumed" else "")
    return f"<h3>Rollback recommendations{note}</h3><ul>{''.join(items)}</ul>"


def _section(rep: FileReport, i: int) -> str:
    parts = [f"<section><h2>{_e(rep.path)}</h2>"]
    if rep.error:
        parts.append(f"<p class='error'>{_e(rep.error)}</p>")
    if not rep.steps and not rep.events:
        return "".join(parts) + "</section>"
    parts += [_summary_table(rep), f"<h3>Anomalies ({len(rep.anomalies)}, {rep.critical} critical)</h3>",
              _anomaly_table(rep), _recommendations(rep)]
    if not rep.steps:  # events only: no curve to draw
        return "".join(parts) + "</section>"
    steps = steps_frame(rep)
    parts.append(_div(curves_figure(rep, steps), f"curves-{i}"))
    st = step_time_figure(rep, steps)
    if st is not None:
        parts.append(_div(st, f"steptime-{i}"))
    gp = goodput_figure(rep)
    parts.append("<h3>Goodput</h3><p class='note'>" + _e(rep.goodput()["note"]) + "</p>")
    if gp is not None:
        parts.append(_div(gp, f"goodput-{i}"))
    parts.append("</section>")
    return "".join(parts)


def render(reports: list[FileReport]) -> str:
    """The whole report as one HTML document (plotly.js embedded: no network needed to view it)."""
    n_anom = sum(len(r.anomalies) for r in reports)
    crit = sum(r.critical for r in reports)
    status = exit_status(reports)
    head = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>trainhealth analyze: {len(reports)} file(s)</title><style>{_CSS}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>")
    intro = (f"<h1>trainhealth analyze</h1><p>{len(reports)} file(s), {n_anom} anomal"
             f"{'y' if n_anom == 1 else 'ies'}, {crit} critical — exit status {status}. "
             f"<span class='note'>trainhealth {_e(__version__)}, report schema {SCHEMA_VERSION}.</span></p>")
    return head + intro + "".join(_section(r, i) for i, r in enumerate(reports)) + "</body></html>\n"
