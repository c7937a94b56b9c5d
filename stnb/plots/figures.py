"""The figure functions of ``stnb.plots`` (throughput, speedup, efficiency, memory, loss_curves,
dashboard, knobs) and ``with_reference``, which rebuilds a figure from the rows kept in its
``layout.meta``. The index of figures is in the package docstring (``help(stnb.plots)``).
"""

from __future__ import annotations

import math
import textwrap

from .table import OURS, REFERENCE_SOURCE, comparison_table, esc, reference_frame
from .traces import (dev_traces, loss_traces, note_coinciding, note_unrunnable, peak_traces, ratio_traces,
                     state_traces, throughput_traces, variant_color)

# columns of the normalised table (comparison_table) kept in a figure's layout.meta so that
# with_reference(fig) can rebuild it
_META_COLUMNS = (
    "source", "label", "strategy", "world_size", "devices", "per_device_batch_size", "global_batch_size",
    "gradient_accumulation_steps", "steps", "samples_per_second", "speedup", "efficiency", "baseline",
    "model", "device", "status", "reason", "verified", "run_id", "losses", "peak_memory_bytes",
    "memory_breakdown", "local_param_count", "total_param_count", "mixed_precision", "loss", "max_seq_length",
    "threads_per_rank", "launcher", "hover",
)  # and every strategy's own options (``_meta_columns``)


def _meta_columns() -> tuple:
    from .. import strategies

    return (*_META_COLUMNS, *strategies.options())


def with_reference(obj):
    """Add the sentence-transformers docs numbers to a results table or to an stnb figure.

    A DataFrame gets the reference rows appended (column ``source`` tells ours from theirs);
    a figure made by this module is rebuilt with the reference shown beside our runs.
    """
    import pandas as pd

    if isinstance(obj, pd.DataFrame) or isinstance(obj, (list, tuple)):
        ours = comparison_table(obj)
        ours = ours[ours["source"] != REFERENCE_SOURCE]
        return comparison_table(pd.concat([ours, reference_frame()], ignore_index=True))
    meta = _fig_meta(obj)
    if meta is None:
        raise TypeError("with_reference needs a results DataFrame or a figure made by stnb.plots "
                        f"(throughput, speedup, efficiency, dashboard); got {type(obj).__name__}")
    kind = meta["stnb_kind"]
    if kind not in ("throughput", "speedup", "efficiency", "dashboard"):
        raise ValueError(f"the reference has no numbers for a {kind!r} figure; use throughput, speedup or efficiency")
    rows = pd.DataFrame(meta["stnb_rows"])
    return _KINDS[kind](rows, reference=True)


# ---- figures ----------------------------------------------------------------------------------

def throughput(df, reference: bool = False):
    """Samples per second of every run (bars). reference=True adds the docs' numbers in a second panel."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    data = comparison_table(df, reference)
    ours, theirs = _split(data)
    if len(theirs):
        fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.12,
                            subplot_titles=[f"ours: {OURS}", f"theirs: {REFERENCE_SOURCE}"])
        for t in throughput_traces(ours):
            fig.add_trace(t, row=1, col=1)
        for t in throughput_traces(theirs, name=f"published: {REFERENCE_SOURCE}"):
            fig.add_trace(t, row=1, col=2)
        fig.update_yaxes(title_text="samples / second", row=1, col=1)
        fig.update_yaxes(title_text="samples / second (their GPUs)", row=1, col=2)
    else:
        fig = go.Figure(throughput_traces(ours))
        fig.update_yaxes(title_text="samples / second")
    fig.update_layout(title="Training throughput (higher is better)", barmode="overlay", bargap=0.3)
    return _finish(fig, "throughput", data)


def speedup(df, reference: bool = False):
    """Throughput divided by the 'single' run of the same model and device; ideal = number of devices."""
    return _ratio_figure(df, reference, "speedup", "Speedup over one process (ideal = number of devices)",
                         "speedup (x)")


def efficiency(df, reference: bool = False):
    """Scaling efficiency: speedup / devices (1.0 = perfect linear scaling)."""
    return _ratio_figure(df, reference, "efficiency", "Scaling efficiency: speedup / devices (ideal 1.0)",
                         "efficiency")


def _ratio_figure(df, reference: bool, metric: str, title: str, yaxis_title: str):
    import plotly.graph_objects as go

    data = comparison_table(df, reference)
    fig = go.Figure(list(ratio_traces(data, metric)))
    fig.update_layout(title=title, barmode="overlay", bargap=0.3, yaxis_title=yaxis_title)
    return _finish(fig, metric, data)


def memory(df):
    """Left: measured peak memory of each rank. Right: params / grads / optimizer state per rank
    (stacked, measured after the first optimizer step) with stnb.memory's prediction as markers."""
    from plotly.subplots import make_subplots

    data = comparison_table(df)
    ours, _ = _split(data)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=["peak memory per rank", "model state per rank: params / grads / optimizer"])
    for t in peak_traces(ours):
        fig.add_trace(t, row=1, col=1)
    for t in state_traces(ours):
        fig.add_trace(t, row=1, col=2)
    # short title (a 1000 px PNG shows it whole); what "peak" means on each device is the axis' title
    fig.update_yaxes(title_text="MiB (CPU: RSS growth; CUDA: max allocated)", row=1, col=1)
    fig.update_yaxes(title_text="MiB", row=1, col=2)
    fig.update_layout(title="Memory per rank", barmode="stack", bargap=0.3)
    return _finish(fig, "memory", data)


def _per_step_figure(df, name: str, traces_of, title: str, y_title):
    """A line per run over its training steps (``traces_of(rows)``); ``y_title(rows)`` names the y axis."""
    import plotly.graph_objects as go

    data = comparison_table(df)
    ours, _ = _split(data)
    fig = go.Figure(traces_of(ours))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title=y_title(ours), xaxis_tickformat="d")
    note_unrunnable(fig, ours)
    note_coinciding(fig, fig.data)
    return _finish(fig, name, data)


def loss_curves(df):
    """Training loss per step, one line per run."""
    return _per_step_figure(df, "loss_curves", loss_traces, "Training loss", lambda rows: "loss")


def dev_curves(df):
    """The held-out dev metric per step (``RunResult.dev_curve``: ``TrainConfig(dev_points=...)``), one line per
    run: step 0 is the model before training, the last step the trained one."""
    def metric_names(rows):
        return ", ".join(sorted({m for m in rows.get("dev_metric", []) if isinstance(m, str)})) or "dev metric"

    return _per_step_figure(df, "dev_curves", dev_traces, "Dev metric (held-out rows) during training", metric_names)


def dashboard(df, reference: bool = False):
    """Throughput, speedup (with the ideal), peak memory per rank and loss curves in one figure.
    reference=True adds the docs' speedups to the speedup panel."""
    from plotly.subplots import make_subplots

    data = comparison_table(df, reference)
    ours, theirs = _split(data)
    fig = make_subplots(rows=2, cols=2, vertical_spacing=0.16, horizontal_spacing=0.1,
                        subplot_titles=["throughput (samples/s)",
                                        "speedup over one process" + (" (hatched: theirs)" if len(theirs) else ""),
                                        "peak memory per rank (MiB)", "training loss"])
    for t in throughput_traces(ours):
        fig.add_trace(t, row=1, col=1)
    for t in ratio_traces(data, "speedup"):
        fig.add_trace(t, row=1, col=2)
    for t in peak_traces(ours):
        fig.add_trace(t, row=2, col=1)
    for t in loss_traces(ours):
        fig.add_trace(t, row=2, col=2)
    fig.update_xaxes(title_text="step", tickformat="d", row=2, col=2)
    fig.update_layout(title="stnb runs", barmode="overlay", bargap=0.3, height=750)
    note_coinciding(fig, list(fig.select_traces(row=2, col=2)), "training loss: ")
    return _finish(fig, "dashboard", data)


def knobs(summary, target: float | None = 0.95):
    """DDP knob comparison from a bench summary (``stnblab.bench.bench(...).summary``): scaling efficiency
    of every variant (samples/s over N x the matching single-device run), with the target and the ideal.
    Hover shows samples/s, the baseline it is compared with and how many repeats it is the median of."""
    import plotly.graph_objects as go

    section = summary.get("sections", {}).get("knobs") if isinstance(summary, dict) else None
    if not section:
        raise ValueError("this bench summary has no 'knobs' section; run stnblab.bench with sections=('knobs',)")
    rows = [r for r in section["variants"] if r.get("efficiency") is not None]
    hover = [f"samples/s: {r['samples_per_second']:,.1f} (median of {r['ok']} run(s))<br>"
             f"compared with: {esc(r['baseline'])}<br>vs DDP defaults: "
             + (f"{r['vs_defaults']:.3f}" if r.get("vs_defaults") is not None else "-") for r in rows]
    colors = [variant_color(r["variant"]) for r in rows]
    fig = go.Figure(go.Bar(x=[r["variant"] for r in rows], y=[r["efficiency"] for r in rows], marker_color=colors,
                           hovertext=hover, texttemplate="%{y:.3f}", textposition="outside", name="efficiency",
                           hovertemplate="<b>%{x}</b><br>efficiency: %{y:.3f}<br>%{hovertext}<extra></extra>"))
    # the lines' names at the left, one under its line and one over it (at the right they sat on the last bars'
    # numbers and on each other); the variants' long names wrapped under their bars, none cut at the edge
    if target is not None:
        fig.add_hline(y=target, line_dash="dash", annotation_text=f"target {target:g}",
                      annotation_position="bottom left")
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="N x 1 device (ideal)", annotation_position="top left")
    names = [r["variant"] for r in rows]
    fig.update_xaxes(tickangle=0, tickvals=names, ticktext=["<br>".join(textwrap.wrap(n, 18)) for n in names])
    top = max([1.0] + [r["efficiency"] for r in rows])
    fig.update_layout(title="DDP knobs: scaling efficiency",
                      yaxis_title="efficiency (samples/s ÷ N × its 1-device run)", yaxis_range=[0, top * 1.15], template="plotly_white",
                      meta={"stnb_kind": "knobs", "stnb_rows": rows}, hoverlabel=dict(align="left"))
    return fig


# ---- small helpers ----------------------------------------------------------------------------

def _split(data):
    theirs = data["source"] == REFERENCE_SOURCE
    return data[~theirs], data[theirs]


def _fig_meta(fig):
    meta = getattr(getattr(fig, "layout", None), "meta", None)
    if isinstance(meta, dict) and "stnb_kind" in meta:
        return meta
    return None


def _finish(fig, kind, data):
    seen = set()
    for t in fig.data:  # one legend entry per name (subplots repeat the placeholders)
        if t.name in seen:
            t.showlegend = False
        seen.add(t.name)
    rows = []
    for rec in data[[c for c in _meta_columns() if c in data.columns]].to_dict(orient="records"):
        rows.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()})
    fig.update_layout(meta={"stnb_kind": kind, "stnb_rows": rows}, template="plotly_white",
                      legend=dict(orientation="h", yanchor="top", y=-0.18, x=0),
                      hoverlabel=dict(align="left"), margin=dict(t=80, b=120))
    return fig


_KINDS = {"throughput": throughput, "speedup": speedup, "efficiency": efficiency, "dashboard": dashboard}
