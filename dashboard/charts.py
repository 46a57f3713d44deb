"""Plotly figures of the dashboard, built from :mod:`trainhealth.dashboard.data` frames (no Redis, no Streamlit)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from trainhealth.text import category_label

#: Colour of an anomaly by severity (Grafana-like: red critical, orange warning, blue info).
SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
#: Most heatmap cells sent to the browser; wider matrices are averaged over step bins
#: (1,024 ranks × 2,000 steps = 2 M cells would be ~20 MB of JSON every refresh). 65,536: at 1,024 ranks 64 columns
#: of ~14 px on a wide screen, each rank a row (sent as float32: ~350 kB; 250,000 float64 cells were ~2.3 MB a refresh
#: and drew the Ranks page's first chart at 2.1x a one-chart page).
HEATMAP_MAX_CELLS = 65_536
#: Anomalies about the curves themselves: their step range is shaded on the loss/grad-norm panels.
SHADED_KINDS = frozenset({"nan_inf", "loss_spike", "divergence"})
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
#: The shaded throughput-goodput gap on the goodput chart.
BADPUT_FILL = "rgba(214,39,40,0.18)"
#: Its legend entry: what the gap between the token curves is (docs/goodput.md, Rates).
GAP_LEGEND = "gap = discarded tokens + pauses"
#: A fixed colour per goodput ledger category, the same on every chart: productive green, every
#: badput category its own hue (none green), so a band or bar keeps its colour as others come and go.
CATEGORY_COLORS = {
    "productive": "#2ca02c",
    "program_startup": "#9467bd",
    "data_loading": "#1f77b4",
    "straggler_wait": "#ff7f0e",
    "communication": "#bcbd22",
    "skipped_steps": "#e377c2",
    "checkpoint_save": "#17becf",
    "checkpoint_restore": "#9edae5",
    "wasted_progress_from_disruption": "#d62728",
    "wasted_progress_from_rollback": "#ff9896",
    "infrastructure_recovery_from_disruption": "#8c564b",
    "custom": "#e7ba52",
    "hang": "#393b79",
    "idle": "#b0b0b0",
    "unobserved": "#e3e3e3",  # lighter than idle: time nobody saw
}
#: Colour of a category the ledger added after this dashboard was written.
OTHER_CATEGORY_COLOR = "#7f7f7f"
#: Names of the rolling-rate windows of a ledger snapshot, for legends.
WINDOW_NAMES = {"60s": "1 min", "600s": "10 min", "3600s": "1 h"}
_LANES = ["anomaly", "checkpoint", "restart"]
#: Event-lane markers besides anomalies (triangles in the severity colour): symbol and colour.
_LANE_STYLE = {"restart": ("x", SEVERITY_COLORS["warning"]), "checkpoint save": ("square", "#2ca02c"),
               "checkpoint load": ("diamond", "#17becf")}
#: Points drawn per step curve at most (a longer series is reduced by :func:`reduce_line`): about one per pixel
#: column of a full-width chart on a 1,920 px screen (~1,800 px of plot in the wide layout), so the reduced curve
#: draws as the full one would; 2,000 points are ~40 kB of chart JSON a curve, sent on every 2 s refresh.
MAX_POINTS = 2_000
#: MinMaxLTTB preselects the min and max of ``MAX_POINTS * ratio / 2`` bins before LTTB picks one point per
#: bucket among them (tsdownsample's default; the paper's recommendation, arXiv:2305.00332).
MINMAX_RATIO = 4
#: The NaN/inf loss markers, and the two runs of :func:`run_comparison`.
NONFINITE_COLOR = "#d62728"
COMPARE_COLORS = ("#1f77b4", "#ff7f0e")


def label(category: str) -> str:
    """``checkpoint_save`` → ``checkpoint save`` (:func:`trainhealth.text.category_label`)."""
    return category_label(category)


def _finite(s: pd.Series) -> pd.Series:
    x = pd.to_numeric(s, errors="coerce").astype("float64")
    return x.where(np.isfinite(x))


def _anomaly_span(a: Any, last_step: float) -> tuple[float, float]:
    start = float(a.step)
    end = float(a.end_step) if not pd.isna(a.end_step) else (last_step if a.status == "active" else start)
    return start - 0.5, max(end, start) + 0.5


def nonfinite_runs(x: np.ndarray, nonfinite: np.ndarray, max_points: int | None = None) -> np.ndarray:
    """Indices where a run of consecutive True ``nonfinite`` points starts (over ascending ``x``), at most one per
    ``1 / max_points`` of the ``x`` span (one per pixel column: a run a million steps long is one marker)."""
    starts = np.flatnonzero(nonfinite & ~np.concatenate(([False], nonfinite[:-1])))
    if max_points is None or len(starts) <= max_points or x[-1] <= x[0]:
        return starts
    column = np.floor((x[starts] - x[0]) / (x[-1] - x[0]) * (max_points - 1)).astype(np.int64)
    return starts[np.unique(column, return_index=True)[1]]


def reduce_line(x: np.ndarray, y: np.ndarray, max_points: int, nonfinite: np.ndarray | None = None) -> np.ndarray:
    """Indices (ascending) of the points of a curve to draw: ``y`` over ascending ``x``.

    The finite points: all when they are at most ``max_points``, else the ``max_points`` that tsdownsample's
    MinMaxLTTB selects (the first, the last, and per bucket the point of largest triangle area among each bin's
    min and max), so a one-step spike is kept; when spikes crowd (hundreds in 2,000 buckets) LTTB drops some,
    each measured within two buckets (two pixel columns) of a kept one. Then the first point of each run of
    points stored as NaN/±inf (``nonfinite``; by default every non-finite ``y``), so the line keeps its gap there
    at any reduction; the other non-finite points (absent values) are left out, the line joins across them.
    """
    finite = np.isfinite(y)
    nonfinite = ~finite if nonfinite is None else np.asarray(nonfinite, dtype=bool) & ~finite
    keep = np.flatnonzero(finite)
    if len(keep) > max(max_points, 3):  # LTTB needs at least 3 points out
        from tsdownsample import MinMaxLTTBDownsampler  # imported here: analyze's HTML report never reduces

        xs = np.ascontiguousarray(x[keep])
        picked = MinMaxLTTBDownsampler().downsample(xs, np.ascontiguousarray(y[keep], dtype=np.float64),
                                                    n_out=max(max_points, 3), minmax_ratio=MINMAX_RATIO)
        keep = keep[picked.astype(np.int64)]
    considered = finite | nonfinite
    idx = np.flatnonzero(considered)
    gaps = idx[nonfinite_runs(x[idx], nonfinite[idx], max_points)] if idx.size else idx
    return np.union1d(keep, gaps)


def _sorted_by_step(part: pd.DataFrame) -> pd.DataFrame:
    steps = part["step"].to_numpy("float64")
    return part if (np.diff(steps) >= 0).all() else part.sort_values("step", kind="stable")


def _nonfinite_markers(parts: list[pd.DataFrame], max_points: int | None) -> go.Scatter | None:
    """One marker per run of steps whose loss was stored as NaN/±inf (``loss_nonfinite``), on the loss panel at
    the last finite loss before it (else the next one): the loss of a diverged step has no y of its own."""
    xs: list[int] = []
    ys: list[float] = []
    texts: list[str] = []
    for part in parts:
        if "loss_nonfinite" not in part or not part["loss_nonfinite"].any():
            continue
        x = part["step"].to_numpy("int64")
        raw = part["loss"].to_numpy("float64")
        bad = part["loss_nonfinite"].to_numpy(bool)
        known = np.isfinite(raw) | bad
        idx = np.flatnonzero(known)
        x, raw, bad = x[idx], raw[idx], bad[idx]
        near = pd.Series(np.where(np.isfinite(raw), raw, np.nan)).ffill().bfill().fillna(0.0).to_numpy()
        ends = np.flatnonzero(bad & ~np.concatenate((bad[1:], [False])))
        for i in nonfinite_runs(x, bad, max_points):
            last = ends[np.searchsorted(ends, i)]
            what = "NaN" if np.isnan(raw[i]) else f"{raw[i]:+g}".replace("+", "")
            span = f"step {x[i]}" if last == i else f"steps {x[i]}–{x[last]}"
            xs.append(int(x[i]))
            ys.append(float(near[i]))
            texts.append(f"<b>loss {what}</b> at {span}")
    if not xs:
        return None
    return go.Scatter(x=xs, y=ys, mode="markers", name="loss NaN/inf", hovertext=texts, hoverinfo="text",
                      marker={"symbol": "x", "size": 10, "color": NONFINITE_COLOR, "line": {"width": 1}})


def training_curves(steps: pd.DataFrame, anomalies: pd.DataFrame, checkpoints: pd.DataFrame,
                    max_points: int | None = None) -> go.Figure:
    """Loss and grad norm (log) vs step, with anomaly, checkpoint and restart markers.

    Three stacked panels sharing the step axis: loss; grad norm on a log axis; an event lane
    whose markers carry the hover text (anomaly message, checkpoint seconds) and whose bars
    show each anomaly's step range in its severity colour. Loss-related anomalies (NaN/inf,
    spike, divergence) also shade their range on the curves; restarts draw a dashed line.
    One line per restart generation, so replayed steps after a rollback show as a second
    curve over the first. NaN/inf values leave gaps (the ``nan_inf`` anomaly marks them).

    With ``max_points``, each curve longer than that is reduced by :func:`reduce_line` (the title says
    so), and a frame with ``loss_nonfinite`` (a :class:`trainhealth.dashboard.data.StepSeries` frame) gets a
    ``loss NaN/inf`` marker per run of such steps, after the curves.
    """
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        row_heights=[0.52, 0.34, 0.14])
    if not steps.empty:
        steps = steps.assign(gen=steps["gen"].fillna(0))  # an entry without gen counts as the first launch
    gens = sorted(int(g) for g in steps["gen"].unique()) if not steps.empty else []
    palette = ["#1f77b4", "#9467bd", "#2ca02c", "#8c564b", "#e377c2", "#17becf"]
    parts = []
    reduced = False
    for i, gen in enumerate(gens):
        part = _sorted_by_step(steps[steps["gen"] == gen])
        parts.append(part)
        # Group a generation's two curves only when there are several (a group stacks its legend items).
        group = f"g{gen}" if len(gens) > 1 else None
        name = f"gen {gen}" if len(gens) > 1 else "loss"
        color = palette[i % len(palette)]
        x = part["step"].to_numpy("int64")
        loss = _finite(part["loss"]).to_numpy()
        gn = _finite(part["grad_norm"])
        gn = gn.where(gn > 0).to_numpy()
        lx, ly, gx, gy = x, loss, x, gn
        if max_points is not None:
            li = reduce_line(x, loss, max_points, part.get("loss_nonfinite"))
            gi = reduce_line(x, gn, max_points, part.get("grad_norm_nonfinite"))
            reduced = reduced or len(li) < len(x) or len(gi) < len(x)
            lx, ly, gx, gy = x[li], loss[li], x[gi], gn[gi]
        fig.add_trace(go.Scatter(x=lx, y=ly, mode="lines",
                                 name=name, legendgroup=group, line={"color": color, "width": 1.5},
                                 hovertemplate="step %{x}<br>loss %{y:.4g}<extra>" + name + "</extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=gx, y=gy, mode="lines",
                                 name=f"grad norm · {name}" if len(gens) > 1 else "grad norm",
                                 legendgroup=group, showlegend=len(gens) == 1,
                                 line={"color": color if len(gens) > 1 else "#ff7f0e", "width": 1},
                                 hovertemplate="step %{x}<br>grad norm %{y:.4g}<extra>" + name + "</extra>"),
                      row=2, col=1)
    markers = _nonfinite_markers(parts, max_points)
    if markers is not None:
        fig.add_trace(markers, row=1, col=1)
    first = float(steps["step"].min()) if not steps.empty else -math.inf
    last = float(steps["step"].max()) if not steps.empty else math.inf
    if not steps.empty:
        # An invisible point at each end of the event lane: Plotly draws no axis for a subplot without
        # data, and the lane carries the shared step axis (a run without anomalies or checkpoints
        # would otherwise show no step numbers at all).
        fig.add_trace(go.Scatter(x=[first, last], y=["anomaly", "anomaly"], mode="markers", name="step axis",
                                 showlegend=False, hoverinfo="skip", marker={"opacity": 0}), row=3, col=1)

    # Event-lane markers, one trace per legend entry (in this order); each point carries its hover text.
    markers: dict[str, tuple[list[float], list[str], list[str]]] = {}
    spans: dict[str, tuple[list[float | None], list[str | None]]] = {}
    for a in anomalies.itertuples(index=False) if not anomalies.empty else []:
        if pd.isna(a.step):
            continue
        x0, x1 = _anomaly_span(a, last)
        if x1 < first or x0 > last:
            continue  # outside the window shown: would only stretch the axis
        color = SEVERITY_COLORS.get(a.severity, "#7f7f7f")
        where = f" ranks {_short_list(a.ranks)}" if a.ranks else ""
        text = f"<b>{a.severity} {label(a.kind)}</b> ({a.status}){where}<br>{a.message}"
        if a.kind == "restart":
            fig.add_vline(x=float(a.step), line={"color": color, "dash": "dash", "width": 1.5}, row="all", col=1,
                          exclude_empty_subplots=False)
            group = "restart"
        else:
            if a.kind in SHADED_KINDS:
                fig.add_vrect(x0=x0, x1=x1, fillcolor=color, opacity=0.13, line_width=0, layer="below",
                              row="all", col=1, exclude_empty_subplots=False)
            # Every anomaly's step range as a bar in the lane; rank-level ones (straggler, hang)
            # only there, so a long-lived straggler does not tint the whole loss curve.
            xs, ys = spans.setdefault(a.severity, ([], []))
            xs.extend([max(x0, first - 0.5), min(x1, last + 0.5), None])
            ys.extend(["anomaly", "anomaly", None])
            group = f"{a.severity} anomaly"
        gx, gtext, gcolor = markers.setdefault(group, ([], [], []))
        gx.append(float(a.step))
        gtext.append(text)
        gcolor.append(color)
    for severity in sorted(spans, key=lambda sv: SEVERITY_ORDER.get(sv, 9)):
        xs, ys = spans[severity]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"{severity} span", showlegend=False,
                                 hoverinfo="skip", opacity=0.35,
                                 line={"color": SEVERITY_COLORS.get(severity, "#7f7f7f"), "width": 6}),
                      row=3, col=1)
    for c in checkpoints.itertuples(index=False) if not checkpoints.empty else []:
        if c.step < first or c.step > last:
            continue
        blocked = "" if pd.isna(c.seconds) else f", blocked {c.seconds:.1f} s"
        ranks = f"{c.n_ranks} rank" + ("" if c.n_ranks == 1 else "s")
        gx, gtext, gcolor = markers.setdefault(label(c.kind), ([], [], []))
        gx.append(float(c.step))
        gtext.append(f"<b>{label(c.kind)}</b> of step {c.step}{blocked} ({ranks})")
        gcolor.append(_LANE_STYLE[label(c.kind)][1])
    order = [f"{sv} anomaly" for sv in SEVERITY_ORDER] + list(_LANE_STYLE)
    for group in sorted(markers, key=lambda g: order.index(g) if g in order else len(order)):
        gx, gtext, gcolor = markers[group]
        lane = "anomaly" if group.endswith(" anomaly") else group.split()[0]
        symbol = "triangle-down" if lane == "anomaly" else _LANE_STYLE[group][0]
        fig.add_trace(go.Scatter(x=gx, y=[lane] * len(gx), mode="markers", name=group, legend="legend2",
                                 marker={"color": gcolor, "symbol": symbol, "size": 11},
                                 hovertext=gtext, hoverinfo="text+x"), row=3, col=1)

    fig.update_yaxes(title_text="loss", row=1, col=1)
    # "complete": label minor log ticks 20, 50 rather than a bare 2, 5.
    fig.update_yaxes(title_text="grad norm", type="log", minorloglabels="complete", row=2, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=_LANES, fixedrange=True, row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_layout(height=560, margin={"l": 10, "r": 10, "t": 30, "b": 10}, hovermode="closest",
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.01, "x": 0,
                              "title": {"text": "restart generation:" if len(gens) > 1 else "", "side": "left"}},
                      # The event lane's markers get their own legend, top right.
                      legend2={"orientation": "h", "yanchor": "bottom", "y": 1.01, "x": 1, "xanchor": "right"},
                      title={"text": "Loss and grad norm per step" + (
                          f" ({len(steps):,} steps, each curve reduced to {max_points:,} points keeping its extremes)"
                          if reduced else ""), "x": 0, "y": 0.995, "font": {"size": 14}})
    return fig


#: x axis of :func:`run_comparison` per alignment: the column of a ``progress`` frame, its title, its hover.
ALIGNMENTS = {"step": ("step", "step", "step %{x}"),
              "tokens": ("tokens_seen", "tokens trained (kept steps)", "%{x:,.0f} tokens")}


def run_comparison(runs: list[tuple[str, pd.DataFrame]], align: str = "step",
                   max_points: int | None = MAX_POINTS) -> go.Figure:
    """Loss and throughput of runs overlaid, aligned by step or by tokens trained.

    ``runs`` are ``(name, frame)`` with :func:`trainhealth.dashboard.data.progress` frames (one row per kept
    step). Two panels sharing the x axis: loss, and tokens/s per step. ``align`` ``"step"`` puts each point at
    its step, ``"tokens"`` at the tokens the run had trained on through that step (``tokens_seen``; steps
    without a token count are left out), so runs of different batch sizes line up by data seen. Each curve is
    reduced to ``max_points`` as :func:`reduce_line` does; NaN losses leave gaps.
    """
    column, title, hover_x = ALIGNMENTS[align]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06, row_heights=[0.55, 0.45])
    for i, (name, prog) in enumerate(runs):
        color = COMPARE_COLORS[i % len(COMPARE_COLORS)]
        part = prog[np.isfinite(prog[column].to_numpy("float64"))]
        x = part[column].to_numpy("int64" if column == "step" else "float64")
        for row, value, unit in ((1, "loss", "loss %{y:.4g}"), (2, "tok_s", "%{y:,.0f} tokens/s")):
            y = _finite(part[value]).to_numpy()
            idx = reduce_line(x, y, max_points) if max_points is not None else np.arange(len(x))
            fig.add_trace(go.Scatter(x=x[idx], y=y[idx], mode="lines", name=name, legendgroup=name,
                                     showlegend=row == 1, line={"color": color, "width": 1.5 if row == 1 else 1},
                                     hovertemplate=f"{hover_x}<br>{unit}<extra>{name}</extra>"), row=row, col=1)
    fig.update_yaxes(title_text="loss", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text=title, row=2, col=1)
    fig.update_layout(height=420, margin={"l": 10, "r": 10, "t": 40, "b": 10}, hovermode="closest",
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.01, "x": 1, "xanchor": "right"},
                      title={"text": f"Loss and throughput by {'step' if align == 'step' else 'tokens trained'}",
                             "x": 0, "font": {"size": 14}})
    return fig


def _short_list(values: list[Any], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", … (+{len(values) - limit})" if len(values) > limit else "")


def _local_times(t: pd.Series, tz: str | None) -> pd.Series:
    # Plotly draws wall-clock strings; convert to the viewer's zone and drop it.
    return pd.to_datetime(t, unit="s", utc=True).dt.tz_convert(tz or "UTC").dt.tz_localize(None)


def goodput_over_time(history: pd.DataFrame, tz: str | None = None, rate_window: str | None = None) -> go.Figure:
    """Throughput and goodput (tokens/s, cumulative since the run started) over wall-clock time.

    From ``ledger_history``. Throughput = all tokens / seconds spent inside steps (what the
    framework prints); goodput = tokens of the steps that count / wall seconds. The shaded
    gap between them is tokens recomputed or discarded plus time outside steps (start-up,
    checkpoints, restarts, hangs, idle), so goodput is at most throughput; badput inside steps
    (straggler wait, data loading) lowers both alike and is not in the gap. Goodput is drawn
    last and narrower, so where the two coincide (no gap yet) it shows on top of the wider
    throughput line instead of under it. The time axis is in ``tz`` (IANA name; UTC if None).

    With ``rate_window`` (``"60s"``, ``"600s"``, ``"3600s"``) the ledger's rolling rates over
    that window are drawn too, as thin dotted lines in the same colours (what the job does
    *now*; the since-start lines move slowly in a long run), and the names say which is which.
    """
    fig = go.Figure()
    rate_col = f"rate.{rate_window}." if rate_window else None
    since = " · since start" if rate_col else ""
    if not history.empty:
        x = _local_times(history["t"], tz)
        mode = "lines" if len(history) > 1 else "lines+markers"  # a single snapshot: a line would be invisible
        fig.add_trace(go.Scatter(x=x, y=history["throughput_tok_s"], name="throughput" + since, mode=mode,
                                 line={"color": "#1f77b4", "width": 4},
                                 hovertemplate="%{y:,.0f} tokens/s<extra>throughput" + since + "</extra>"))
        fig.add_trace(go.Scatter(x=x, y=history["goodput_tok_s"], name="goodput" + since, mode=mode,
                                 fill="tonexty", fillcolor=BADPUT_FILL, line={"color": "#2ca02c", "width": 2},
                                 hovertemplate="%{y:,.0f} tokens/s<extra>goodput" + since + "</extra>"))
        # Legend entry for the shaded band only (no data of its own). Not "badput": straggler wait,
        # often the largest, slows both curves and never shows in this gap.
        fig.add_trace(go.Scatter(x=[None], y=[None], name=GAP_LEGEND, mode="lines", fill="toself",
                                 fillcolor=BADPUT_FILL, line={"width": 0}, hoverinfo="skip"))
        if rate_col and f"{rate_col}throughput_tok_s" in history:
            span = WINDOW_NAMES.get(str(rate_window), str(rate_window))
            for what, color in (("throughput", "#1f77b4"), ("goodput", "#2ca02c")):
                name = f"{what} · last {span}"
                fig.add_trace(go.Scatter(x=x, y=history[f"{rate_col}{what}_tok_s"], name=name, mode=mode,
                                         line={"color": color, "width": 1.5, "dash": "dot"},
                                         hovertemplate="%{y:,.0f} tokens/s<extra>" + name + "</extra>"))
    if rate_col:
        # Five entries, and the rolling lines reach every corner: the legend goes under the plot, below the time
        # axis' two-line labels (time, and the date under the first).
        legend = {"orientation": "h", "yanchor": "top", "y": -0.26, "x": 0, "traceorder": "normal"}
    else:
        # Inside the plot, bottom right: the y axis starts at 0, so that corner is empty.
        legend = {"orientation": "h", "yanchor": "bottom", "y": 0.02, "x": 0.99, "xanchor": "right",
                  "bgcolor": "rgba(255,255,255,0.7)", "traceorder": "normal"}
    fig.update_layout(height=380 if rate_col else 340, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      hovermode="x unified",
                      title={"text": "Throughput vs goodput (tokens/s" + (")" if rate_col else ", since start)"),
                             "x": 0, "font": {"size": 14}},
                      legend=legend, xaxis_title=None if rate_col else f"time ({tz or 'UTC'})",
                      yaxis_title="tokens/s", yaxis_rangemode="tozero")
    return fig


def ledger_categories(history: pd.DataFrame) -> list[str]:
    """The ledger categories of ``ledger_history`` columns that were above 0 s in any snapshot:
    ``productive`` first, then the badput categories in the ledger's order (added ones last)."""
    cats = [c[len("seconds."):] for c in history.columns if c.startswith("seconds.")]
    return [c for c in cats if (pd.to_numeric(history[f"seconds.{c}"], errors="coerce") > 0).any()]


def category_color(category: str) -> str:
    """The fixed colour of a ledger category (:data:`CATEGORY_COLORS`)."""
    return CATEGORY_COLORS.get(category, OTHER_CATEGORY_COLOR)


def wall_time_shares(history: pd.DataFrame) -> pd.DataFrame:
    """Per snapshot, each category's share (%) of the wall time since the run started.

    Columns = :func:`ledger_categories` (those at 0 s in every snapshot are omitted); the
    shares of a snapshot sum to 100 (the categories sum to the wall time by construction;
    should ``wall_s`` be missing, their sum is used).
    """
    cats = ledger_categories(history)
    secs = history[[f"seconds.{c}" for c in cats]].astype("float64").fillna(0.0)
    secs.columns = cats
    wall = pd.to_numeric(history["wall_s"], errors="coerce").astype("float64")
    wall = wall.where(np.isfinite(wall) & (wall > 0), secs.sum(axis=1))
    return secs.div(wall.where(wall > 0), axis=0) * 100.0


def share_axis_floor(shares: pd.DataFrame) -> float:
    """Where the % axis of :func:`wall_time_breakdown` starts: 0, or, when productive stays above 40 %
    all along, 10 points below its lowest share rounded down to 10 (so thin badput bands get room)."""
    if "productive" not in shares or shares.empty:
        return 0.0
    low = float(shares["productive"].min(skipna=True))
    if not math.isfinite(low) or low < 40.0:
        return 0.0
    return max(0.0, math.floor(low / 10.0) * 10.0 - 10.0)


def wall_time_breakdown(history: pd.DataFrame, tz: str | None = None,
                        custom_names: list[str] | None = None) -> go.Figure:
    """Stacked area of where the wall time went, as a share of wall time since the run started.

    From ``ledger_history``: one band per ledger category that was ever above 0 s, productive
    at the bottom in green (its top edge is the goodput % at that time), the badput bands above
    it in their fixed colours (:data:`CATEGORY_COLORS`), stacked to 100 %. Each snapshot is
    cumulative, so a band that widens is a cause that is costing time now; a re-attribution
    (steps lost to a restart move from productive to wasted progress) shows as a step. Hover
    gives each category's share and seconds. The % axis starts at :func:`share_axis_floor`
    (said in the axis title when above 0). ``custom_names`` (the snapshot's
    ``custom_by_name`` keys) name the custom band.
    """
    fig = go.Figure()
    floor = 0.0
    if not history.empty:
        shares = wall_time_shares(history)
        floor = share_axis_floor(shares)
        x = _local_times(history["t"], tz)
        single = len(history) == 1
        for cat in shares.columns:
            seconds = history[f"seconds.{cat}"].astype("float64").fillna(0.0)
            name = label(cat) + (f" ({', '.join(custom_names)})" if cat == "custom" and custom_names else "")
            fig.add_trace(go.Scatter(
                x=x, y=shares[cat], name=name, stackgroup="ledger", mode="lines+markers" if single else "lines",
                line={"width": 0.5, "color": category_color(cat)}, fillcolor=category_color(cat),
                customdata=seconds, hovertemplate="%{y:.1f}% · %{customdata:,.0f} s<extra>" + name + "</extra>"))
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 40, "b": 10}, hovermode="x unified",
                      title={"text": "Where the wall time went (share of wall time since start, by cause)", "x": 0,
                             "font": {"size": 14}},
                      # Top band first, as stacked; productive (the bottom band) last.
                      legend={"traceorder": "reversed", "title": {"text": ""}},
                      xaxis_title=f"time ({tz or 'UTC'})",
                      yaxis={"title": "% of wall time" + (f" (axis from {floor:g} %)" if floor else ""),
                             "range": [floor, 100], "ticksuffix": "%"})
    return fig


def badput_cost_bar(causes: pd.DataFrame, priced: bool, wall_s: float | None = None) -> go.Figure:
    """Horizontal bars of what each cause of badput cost, largest on top
    (:func:`trainhealth.dashboard.data.badput_by_cause`).

    USD when the run has a GPU-hour price (``priced``), else GPU-hours; each bar in its
    category's colour (the custom names in the colour of ``custom``), labelled with USD and
    GPU-hours; hover adds seconds and the share of wall time.
    """
    value = "cost_usd" if priced else "gpu_hours"
    frame = causes.sort_values(value, ascending=False, kind="stable").iloc[::-1]  # first bar is drawn at the bottom
    text = [(f"{_usd(c)} · " if priced else "") + f"{_gpuh(g)} GPU-h"
            for c, g in zip(frame["cost_usd"], frame["gpu_hours"], strict=True)]
    hover = [f"{s:,.0f} s" + (f" ({s / wall_s * 100:.1f}% of wall time)" if wall_s else "") + f" · {t}"
             for s, t in zip(frame["seconds"], text, strict=True)]
    fig = go.Figure(go.Bar(
        x=frame[value], y=[label(c) for c in frame["category"]], orientation="h",
        marker_color=[category_color(c) for c in frame["ledger_category"]], text=text, textposition="auto",
        insidetextanchor="end", hovertext=hover, hoverinfo="text+y", cliponaxis=False))
    top = float(frame[value].max()) if len(frame) else 0.0
    title = "Money lost per cause (USD since start)" if priced else "GPU-hours lost per cause (no GPU-hour price set)"
    fig.update_layout(height=max(200, min(380, 90 + 30 * len(frame))), margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      title={"text": title, "x": 0, "font": {"size": 14}},
                      # Headroom so a short bar's label, drawn outside it, is not cut at the right edge.
                      xaxis={"title": "USD" if priced else "GPU-hours", "rangemode": "tozero",
                             **({"range": [0, top * 1.35]} if top > 0 else {}),
                             **({"tickprefix": "$"} if priced else {})},
                      yaxis={"automargin": True})
    return fig


def _usd(x: float) -> str:
    if x is None or not math.isfinite(float(x)):
        return "—"
    # As trainhealth.dashboard.common.fmt_usd (charts import no Streamlit module).
    return f"${x / 1e3:,.0f}k" if abs(x) >= 1e5 else f"${x:,.0f}" if abs(x) >= 1e3 else f"${x:,.2f}"


def _gpuh(x: float) -> str:
    if x is None or not math.isfinite(float(x)):
        return "—"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:,.1f}" if abs(x) >= 10 else f"{x:,.2f}"


def badput_bar(breakdown: pd.DataFrame, wall_s: float | None = None) -> go.Figure:
    """Horizontal bar of badput seconds per category (from :func:`trainhealth.dashboard.data.badput_seconds`).

    The largest category is on top; hover adds the share of wall time and USD when priced. The
    height follows the number of bars (200-340 px).
    """
    frame = breakdown.iloc[::-1]  # plotly draws the first bar at the bottom
    share = (frame["seconds"] / wall_s * 100) if wall_s else frame["seconds"] * math.nan
    cost = frame["cost_usd"]
    hover = [
        f"{s:,.1f} s" + (f" · {p:.1f}% of wall time" if not math.isnan(p) else "")
        + (f" · ${c:,.2f}" if not math.isnan(c) else "")
        for s, p, c in zip(frame["seconds"], share, cost, strict=True)
    ]
    fig = go.Figure(go.Bar(x=frame["seconds"], y=[label(c) for c in frame["category"]], orientation="h",
                           marker_color="#d62728", text=[f"{s:,.1f} s" for s in frame["seconds"]],
                           textposition="auto", hovertext=hover, hoverinfo="text+y"))
    # About 30 px a bar (a run with two causes of badput should not get two giant bars), at most 340.
    fig.update_layout(height=max(200, min(340, 90 + 30 * len(frame))), margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      title={"text": "Badput by category (seconds of wall time)", "x": 0, "font": {"size": 14}},
                      xaxis_title="seconds", yaxis={"automargin": True})
    return fig


def downsample_steps(matrix: pd.DataFrame, max_cells: int = HEATMAP_MAX_CELLS) -> pd.DataFrame:
    """Average consecutive step columns so ``ranks × columns <= max_cells``.

    Each kept column is labelled by the last step of its bin; ranks are never merged (a
    single slow rank must stay visible).
    """
    n_ranks, n_steps = matrix.shape
    if n_ranks == 0 or n_ranks * n_steps <= max_cells:
        return matrix
    bins = math.ceil(n_steps / max(1, max_cells // n_ranks))
    groups = np.arange(n_steps) // bins
    values = matrix.to_numpy()
    out_cols = []
    out_vals = []
    with np.errstate(all="ignore"):
        for g in np.unique(groups):
            sel = groups == g
            out_cols.append(matrix.columns[sel][-1])
            block = values[:, sel]
            counts = np.sum(~np.isnan(block), axis=1)
            sums = np.nansum(block, axis=1)
            out_vals.append(np.where(counts > 0, sums / np.maximum(counts, 1), np.nan))
    return pd.DataFrame(np.column_stack(out_vals), index=matrix.index,
                        columns=pd.Index(out_cols, name=matrix.columns.name))


def rank_heatmap(matrix: pd.DataFrame, relative: bool = False, highlight: list[int] | None = None) -> go.Figure:
    """Per-rank busy-time heatmap: rank on y, step on x, one ``go.Heatmap`` trace.

    ``relative`` colours each cell by its ratio to that step's median rank (1.0 = typical)
    instead of seconds. Wide matrices are step-binned by :func:`downsample_steps`.
    ``highlight`` ranks (active stragglers) get an outline.
    """
    shown = downsample_steps(matrix)
    z = shown.to_numpy(dtype="float64")
    if relative and z.size:
        with np.errstate(all="ignore"):
            med = np.nanmedian(z, axis=0)
            z = z / np.where(med > 0, med, np.nan)
    unit = "× step median" if relative else "s"
    binned = shown.shape[1] < matrix.shape[1]
    scale: dict[str, Any] = {"zmid": 1.0} if relative else {}
    finite = z[np.isfinite(z)]
    if relative and finite.size:
        # At least 0.5x-1.5x of the step median: a fitted range would paint 2 % timer jitter as
        # saturated red and blue; a real straggler (flagged below a 0.8 score) still stands out.
        lo, hi = np.percentile(finite, [0.5, 99.5]) if finite.size > 100 else (finite.min(), finite.max())
        scale = {"zmid": 1.0, "zmin": float(min(lo, 0.5)), "zmax": float(max(hi, 1.5))}
    elif finite.size:
        # From 0 s: busy seconds are a magnitude, so ranks within jitter of each other look alike.
        # The top is clipped at p99.5 (with >100 cells) so one slow step (a GC pause, a checkpoint)
        # does not wash every other cell into the same colour; hover still shows the real value.
        hi = float(np.percentile(finite, 99.5)) if finite.size > 100 else float(finite.max())
        if hi > 0:
            scale = {"zmin": 0.0, "zmax": hi}
    fig = go.Figure(go.Heatmap(
        z=z.astype("float32"), x=[int(c) for c in shown.columns], y=[int(r) for r in shown.index],
        colorscale="RdBu_r" if relative else "Viridis", colorbar={"title": {"text": unit}},
        hovertemplate="rank %{y}<br>step %{x}<br>busy %{z:.3f} " + unit + "<extra></extra>", **scale,
    ))
    for rank in highlight or []:
        fig.add_shape(type="rect", xref="paper", x0=0, x1=1, y0=rank - 0.5, y1=rank + 0.5,
                      line={"color": "#d62728", "width": 2}, fillcolor="rgba(0,0,0,0)")
    n_ranks = matrix.shape[0]
    title = "Busy time per rank and step" + (" (ratio to the step's median rank)" if relative else " (s)")
    if binned:
        title += f" — averaged over bins of {math.ceil(matrix.shape[1] / shown.shape[1])} steps"
    fig.update_layout(height=min(900, max(320, 120 + 14 * n_ranks)), margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      title={"text": title, "x": 0, "font": {"size": 14}}, xaxis_title="step",
                      yaxis={"title": "rank", "autorange": "reversed", **({"dtick": 1} if n_ranks <= 32 else {})})
    return fig


def memory_heatmap(matrix: pd.DataFrame, label: str, tz: str) -> go.Figure:
    """Memory per rank over time: rank on y, sample time on x (in ``tz``), GiB as colour (from 0: a magnitude); one
    ``go.Heatmap`` trace of :func:`trainhealth.dashboard.data.memory_matrix` (at most its 120 columns)."""
    z = matrix.to_numpy(dtype="float64")
    times = pd.to_datetime(pd.Series(matrix.columns, dtype="float64"), unit="s", utc=True).dt.tz_convert(tz)
    finite = z[np.isfinite(z)]
    scale = {"zmin": 0.0, "zmax": float(finite.max())} if finite.size and finite.max() > 0 else {}
    steps = matrix.attrs.get("steps") or [-1] * matrix.shape[1]
    custom = np.broadcast_to(np.array(steps, dtype="int64"), z.shape)
    fig = go.Figure(go.Heatmap(
        z=z.astype("float32"), x=list(times), y=[int(r) for r in matrix.index], customdata=custom,
        colorscale="Viridis", colorbar={"title": {"text": "GiB"}}, **scale,
        hovertemplate="rank %{y}<br>%{x}<br>step %{customdata}<br>" + label + " %{z:.1f} GiB<extra></extra>"))
    n_ranks = matrix.shape[0]
    fig.update_layout(height=min(900, max(320, 120 + 14 * n_ranks)), margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      title={"text": f"{label[0].upper()}{label[1:]} per rank (GiB)", "x": 0, "font": {"size": 14}},
                      xaxis_title=f"time ({tz})",
                      yaxis={"title": "rank", "autorange": "reversed", **({"dtick": 1} if n_ranks <= 32 else {})})
    return fig


def rank_memory_figure(matrix: pd.DataFrame, rank: int, label: str, tz: str) -> go.Figure:
    """One rank's memory over time (GiB) beside the median and the highest of the other ranks (lines)."""
    times = list(pd.to_datetime(pd.Series(matrix.columns, dtype="float64"), unit="s", utc=True).dt.tz_convert(tz))
    mine = matrix.loc[rank].to_numpy(dtype="float64")
    others = matrix.drop(index=rank).to_numpy(dtype="float64")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a column no other rank reported: NaN, drawn as a gap
        med = np.nanmedian(others, axis=0) if others.size else np.full(len(times), np.nan)
        top = np.nanmax(others, axis=0) if others.size else np.full(len(times), np.nan)
    fig = go.Figure([
        go.Scatter(x=times, y=mine, name=f"rank {rank}", mode="lines", line={"color": "#d62728", "width": 2},
                   hovertemplate=f"rank {rank}: %{{y:.1f}} GiB<extra></extra>"),
        go.Scatter(x=times, y=med, name="median of the others", mode="lines", line={"color": "#1f77b4", "width": 2},
                   hovertemplate="median: %{y:.1f} GiB<extra></extra>"),
        go.Scatter(x=times, y=top, name="highest of the others", mode="lines",
                   line={"color": "#2ca02c", "width": 1, "dash": "dot"},
                   hovertemplate="highest other: %{y:.1f} GiB<extra></extra>"),
    ])
    fig.update_layout(height=280, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      title={"text": f"Rank {rank}: {label} (GiB)", "x": 0, "font": {"size": 14}},
                      xaxis_title=f"time ({tz})", yaxis_title="GiB", yaxis_rangemode="tozero",
                      legend={"orientation": "h", "y": 1.14, "x": 1, "xanchor": "right"})
    return fig
