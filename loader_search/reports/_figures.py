"""The report's figures: one plotly figure per plot of the page, drawn from a `ReportData`.

Nothing is computed here that a test would need to check (`loader_search.reports._collect` does
that), and nothing here knows the page around the figures (`loader_search.reports._html`).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from loader_search.reports._data import ReportData, ReportTrial
from loader_search.study import TrialPoint, above_ceiling, efficiency_text

_TEMPLATE = "plotly_white"
_COLORS = {
    "pareto": "#1f77b4",
    "dominated": "#9aa5b1",
    "infeasible": "#ff7f0e",
    "failed": "#d62728",
    "baseline": "#2ca02c",
    "recommended": "#9467bd",
    "input": "#ff7f0e",
    "compute": "#1f77b4",
}
_MIB = 1024 * 1024


def figures(data: ReportData) -> dict[str, go.Figure]:
    """Every figure of the report, by the id of its place on the page, in page order."""
    return {
        "plot-pareto": pareto_figure(data),
        "plot-hypervolume": hypervolume_figure(data),
        "plot-importances": importances_figure(data),
        "plot-throughput-grid": throughput_grid_figure(data),
        "plot-data-wait": data_wait_figure(data),
        "plot-efficiency": efficiency_figure(data),
        "plot-memory": memory_figure(data),
    }


def _label(row: ReportTrial) -> str:
    parts = [f"trial #{row.number}" + (" (baseline)" if row.is_baseline else "")]
    if row.params is not None:
        parts.append(row.params.describe())
    if row.throughput is not None and row.val_loss is not None:
        parts.append(f"{row.throughput:,.0f} samples/s, val_loss {row.val_loss:.4f}")
    if row.failure_reason:
        parts.append(f"{row.status}: {row.failure_reason}")
    if row.failure_message:
        parts.append(html.escape(row.failure_message[:120]))
    return "<br>".join(parts)


def pareto_figure(data: ReportData) -> go.Figure:
    """The front as `best` states it: one point per setting, at the median of its readings
    (the line and the star sit where the text says); every single reading faint behind it.
    Below, on their own axis (trial number), the trials that have no objective values to
    plot, infeasible and failed ones, when there are any."""
    unplotted = [t for t in data.trials if t.status in ("infeasible", "failed")]
    rows = 2 if unplotted else 1
    fig = make_subplots(
        rows=rows,
        cols=1,
        row_heights=[0.82, 0.18] if unplotted else [1.0],
        vertical_spacing=0.14,
        subplot_titles=("", "not on the front: infeasible and failed trials, by trial number")
        if unplotted
        else None,
    )
    readings = [t for t in data.trials if t.throughput is not None]
    _scatter(
        fig,
        readings,
        "single readings",
        dict(color=_COLORS["dominated"], size=6, opacity=0.45),
    )
    front = {p.params for p in data.summary.pareto}
    dominated = [p for p in data.points if p.params not in front]
    _points(fig, dominated, "dominated settings", dict(color=_COLORS["dominated"], size=10))
    line = sorted(data.summary.pareto, key=lambda p: p.throughput)
    fig.add_trace(
        go.Scatter(
            x=[p.throughput for p in line],
            y=[p.val_loss for p in line],
            mode="lines+markers",
            line=dict(shape="hv", color=_COLORS["pareto"], dash="dot"),
            marker=dict(color=_COLORS["pareto"], size=11),
            name="Pareto front (medians)",
            text=[_point_label(p) for p in line],
            hoverinfo="text",
        ),
        row=1,
        col=1,
    )
    base = data.summary.baseline
    if base is not None:
        marker = dict(color=_COLORS["baseline"], size=16, symbol="square-open", line=dict(width=3))
        _points(fig, [base], "baseline", marker)
    rec = data.summary.recommended
    # The star follows the verdict: none on a candidate it rejects (keep the baseline).
    chosen = rec.recommended_point if rec is not None else None
    if chosen is not None:
        marker = dict(
            color=_COLORS["recommended"], size=22, symbol="star-open", line=dict(width=3)
        )
        _points(fig, [chosen], "recommended", marker)
    for status, symbol in (("infeasible", "x"), ("failed", "triangle-down")):
        rows_ = [t for t in unplotted if t.status == status]
        if not rows_:
            continue
        fig.add_trace(
            go.Scatter(
                x=[t.number for t in rows_],
                y=[status] * len(rows_),
                mode="markers",
                marker=dict(color=_COLORS[status], size=12, symbol=symbol),
                name=f"{status} ({len(rows_)})",
                text=[_label(t) for t in rows_],
                hoverinfo="text",
            ),
            row=2,
            col=1,
        )
    fig.update_xaxes(title_text="throughput (samples/s, higher is better)", row=1, col=1)
    fig.update_yaxes(title_text="val_loss (lower is better)", row=1, col=1)
    if unplotted:
        fig.update_xaxes(title_text="trial number", row=2, col=1)
        fig.update_yaxes(type="category", categoryarray=["failed", "infeasible"], row=2, col=1)
    fig.update_layout(
        height=620 if unplotted else 520,
        template=_TEMPLATE,
        legend=dict(orientation="h", y=1.08),
    )
    return fig


def _point_label(point: TrialPoint) -> str:
    readings = (
        f"median of {len(point.measurements)} readings" if point.measurements else "one reading"
    )
    return "<br>".join(
        [
            f"trial #{point.number}" + (" (baseline)" if point.is_baseline else ""),
            point.params.describe(),
            f"{point.throughput:,.0f} samples/s ({readings}), val_loss {point.val_loss:.4f}",
        ]
    )


def _points(
    fig: go.Figure, points: Sequence[TrialPoint], name: str, marker: dict[str, Any]
) -> None:
    """Settings at their medians, on the front's axes."""
    labels = [_point_label(p) for p in points]
    _markers(fig, [(p.throughput, p.val_loss) for p in points], labels, name, marker)


def _scatter(
    fig: go.Figure, rows: Sequence[ReportTrial], name: str, marker: dict[str, Any]
) -> None:
    """Single trials at their own readings, on the front's axes."""
    xy = [(t.throughput, t.val_loss) for t in rows]
    _markers(fig, xy, [_label(t) for t in rows], name, marker)


def _markers(
    fig: go.Figure,
    xy: Sequence[tuple[float | None, float | None]],
    labels: Sequence[str],
    name: str,
    marker: dict[str, Any],
) -> None:
    fig.add_trace(
        go.Scatter(
            x=[x for x, _ in xy],
            y=[y for _, y in xy],
            mode="markers",
            marker=marker,
            name=name,
            text=list(labels),
            hoverinfo="text",
        ),
        row=1,
        col=1,
    )


def hypervolume_figure(data: ReportData) -> go.Figure:
    points = data.hypervolume.points
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("against trial number", "against time spent in trials")
    )
    common = dict(mode="lines+markers", line=dict(shape="hv", color=_COLORS["pareto"]))
    fig.add_trace(
        go.Scatter(
            x=[p.number for p in points],
            y=[p.hypervolume for p in points],
            name="by trial",
            **common,
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=[p.elapsed_s / 60 for p in points],
            y=[p.hypervolume for p in points],
            name="by time",
            **common,
        ),
        row=1,
        col=2,
    )
    fig.update_xaxes(title_text="trial number", row=1, col=1)
    fig.update_xaxes(
        title_text="cumulative trial time (min), failed trials included", row=1, col=2
    )
    fig.update_yaxes(title_text="hypervolume", row=1, col=1)
    fig.update_layout(height=380, template=_TEMPLATE, showlegend=False)
    return fig


def importances_figure(data: ReportData) -> go.Figure:
    titles = [i.objective for i in data.importances] or ["importances"]
    fig = make_subplots(rows=1, cols=max(1, len(titles)), subplot_titles=titles)
    for col, item in enumerate(data.importances, start=1):
        pairs = list(reversed(item.values))  # largest on top
        fig.add_trace(
            go.Bar(
                x=[v for _, v in pairs],
                y=[k for k, _ in pairs],
                orientation="h",
                marker_color=_COLORS["pareto"] if col == 1 else _COLORS["recommended"],
                text=[f"{v:.2f}" for _, v in pairs],
                textposition="auto",
                name=item.objective,
            ),
            row=1,
            col=col,
        )
        if not item.values:
            _empty_note(fig, item.note, col)
        fig.update_xaxes(title_text="importance (sums to 1)", range=[0, 1], row=1, col=col)
    fig.update_layout(height=340, template=_TEMPLATE, showlegend=False)
    return fig


def _prefetch_label(prefetch: int | None) -> str:
    return "no workers" if prefetch is None else f"prefetch {prefetch}"


def throughput_grid_figure(data: ReportData) -> go.Figure:
    batches = sorted({c.batch_size for c in data.throughput_grid})
    fig = make_subplots(
        rows=1,
        cols=max(1, len(batches)),
        subplot_titles=[f"batch_size {b}" for b in batches] or ["no feasible trial"],
        horizontal_spacing=0.06,
    )
    if not batches:
        _empty_note(fig, "no feasible trial yet", 1)
    top = max((c.throughput for c in data.throughput_grid), default=1.0)
    prefetches = sorted(
        {c.prefetch_factor for c in data.throughput_grid}, key=lambda p: -1 if p is None else p
    )
    workers = sorted({c.num_workers for c in data.throughput_grid})
    x_labels = [_prefetch_label(p) for p in prefetches]
    for col, batch in enumerate(batches, start=1):
        cells = {
            (c.num_workers, c.prefetch_factor): c
            for c in data.throughput_grid
            if c.batch_size == batch
        }
        z = [[_cell(cells, w, p, "value") for p in prefetches] for w in workers]
        text = [[_cell(cells, w, p, "text") for p in prefetches] for w in workers]
        hover = [[_cell(cells, w, p, "hover") for p in prefetches] for w in workers]
        fig.add_trace(
            go.Heatmap(
                x=x_labels,
                y=[f"{w} workers" for w in workers],
                z=z,
                text=text,
                customdata=hover,
                texttemplate="%{text}",
                textfont=dict(size=10),
                zmin=0,
                zmax=top,
                colorscale="Viridis",
                showscale=col == len(batches),
                colorbar=dict(title=dict(text="samples/s")),
                hovertemplate="batch %{meta}, %{y}, %{x}: %{customdata}<extra></extra>",
                meta=batch,
            ),
            row=1,
            col=col,
        )
    fig.update_xaxes(type="category", tickangle=-45)
    # Worker labels once, on the left: repeated beside every panel they ran into its cells.
    fig.update_yaxes(type="category", showticklabels=False)
    fig.update_yaxes(showticklabels=True, row=1, col=1)
    fig.update_layout(height=360, template=_TEMPLATE)
    return fig


def _cell(
    cells: dict[tuple[int, int | None], Any], workers: int, prefetch: int | None, what: str
) -> Any:
    cell = cells.get((workers, prefetch))
    if cell is None:
        return None if what == "value" else ""
    if what == "value":
        return cell.throughput
    if what == "text":
        return f"{cell.throughput:,.0f}"
    return f"{cell.throughput:,.0f} samples/s, median of {cell.n_trials} trial(s)"


def data_wait_figure(data: ReportData) -> go.Figure:
    fig = go.Figure()
    for bound in ("input", "compute"):
        rows = [t for t in data.trials if t.bound == bound]
        fig.add_trace(
            go.Bar(
                x=[t.number for t in rows],
                y=[t.data_wait_fraction for t in rows],
                name=f"{bound}-bound ({len(rows)})",
                marker_color=_COLORS[bound],
                text=[_label(t) for t in rows],
                hoverinfo="text",
                textposition="none",
            )
        )
    fig.add_hline(
        y=data.input_bound_threshold,
        line=dict(dash="dash", color="#555"),
        annotation_text=f"input-bound above {data.input_bound_threshold:.0%}",
    )
    fig.update_xaxes(title_text="trial number", dtick=1)
    fig.update_yaxes(title_text="data-wait fraction", range=[0, 1])
    fig.update_layout(height=340, template=_TEMPLATE, legend=dict(orientation="h", y=1.12))
    return fig


ABOVE_CEILING = (
    "above the ceiling read for its batch size and threads: that reading was low (taken"
    " under load, or noise); later trials of the pair read it again"
)


def efficiency_figure(data: ReportData) -> go.Figure:
    """Loader efficiency per trial; a bar above the ceiling is drawn in the failure colour,
    with why in its hover text (see loader_search.study.work._plan)."""
    rows = [t for t in data.trials if t.loader_efficiency is not None]
    fig = go.Figure(
        go.Bar(
            x=[t.number for t in rows],
            y=[t.loader_efficiency for t in rows],
            marker_color=[
                _COLORS["failed"]
                if above_ceiling(t.loader_efficiency or 0)
                else _COLORS["baseline"]
                if t.is_baseline
                else _COLORS["compute"]
                for t in rows
            ],
            text=[
                _label(t)
                + (
                    f"<br>loader efficiency {efficiency_text(t.loader_efficiency)}"
                    + (f": {ABOVE_CEILING}" if above_ceiling(t.loader_efficiency) else "")
                    if t.loader_efficiency is not None
                    else ""
                )
                for t in rows
            ],
            hoverinfo="text",
            textposition="none",
        )
    )
    fig.add_hline(y=1.0, line=dict(dash="dash", color="#555"), annotation_text="the ceiling")
    fig.update_xaxes(title_text="trial number", dtick=1)
    fig.update_yaxes(title_text="loader efficiency", tickformat=".0%", rangemode="tozero")
    fig.update_layout(height=340, template=_TEMPLATE, showlegend=False)
    return fig


def memory_figure(data: ReportData) -> go.Figure:
    """Peak memory by batch size; trials without a memory measurement (failed or infeasible)
    sit on the batch-size axis with their own symbol; the out-of-memory boundary is shaded."""
    fig = go.Figure()
    with_params = [t for t in data.trials if t.params is not None]
    for status, symbol in (
        ("pareto", "circle"),
        ("dominated", "circle"),
        ("infeasible", "x"),
        ("failed", "triangle-down"),
    ):
        rows = [t for t in with_params if t.status == status]
        if not rows:
            continue
        fig.add_trace(
            go.Scatter(
                x=[t.params.batch_size for t in rows if t.params],
                y=[(t.peak_host_rss_bytes or 0) / _MIB for t in rows],
                mode="markers",
                marker=dict(color=_COLORS[status], size=11, symbol=symbol),
                name=f"host RSS, {status}",
                text=[_label(t) for t in rows],
                hoverinfo="text",
            )
        )
    gpu = [t for t in with_params if t.peak_gpu_bytes is not None]
    if gpu:
        fig.add_trace(
            go.Scatter(
                x=[t.params.batch_size for t in gpu if t.params],
                y=[(t.peak_gpu_bytes or 0) / _MIB for t in gpu],
                mode="markers",
                marker=dict(color="#17becf", size=10, symbol="diamond"),
                name="GPU memory",
                text=[_label(t) for t in gpu],
                hoverinfo="text",
            )
        )
    if data.memory.smallest_oom_batch_size is not None:
        fig.add_vline(
            x=data.memory.smallest_oom_batch_size,
            line=dict(color=_COLORS["failed"], dash="dash"),
            annotation_text=f"out of memory from batch {data.memory.smallest_oom_batch_size}",
        )
    if not with_params:
        _empty_note(fig, "no finished trial yet", None)
    sizes = sorted({t.params.batch_size for t in with_params if t.params})
    fig.update_xaxes(
        title_text="batch size", type="log", tickmode="array", tickvals=sizes, ticktext=sizes
    )
    fig.update_yaxes(title_text="peak memory (MiB)", rangemode="tozero")
    fig.update_layout(height=380, template=_TEMPLATE, legend=dict(orientation="h", y=1.12))
    return fig


def _empty_note(fig: go.Figure, text: str, col: int | None) -> None:
    ref = "" if col in (None, 1) else str(col)
    fig.add_annotation(
        text=html.escape(text),
        xref=f"x{ref} domain",
        yref=f"y{ref} domain",
        x=0.5,
        y=0.5,
        showarrow=False,
    )
