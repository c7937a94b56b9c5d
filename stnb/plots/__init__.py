"""Plotly figures from a results table (``stnb.results_frame([...])`` or ``stnb.load_results(path)``).

Every function takes the table and returns a ``plotly.graph_objects.Figure``; no widgets needed.
Hovering a bar or line shows its numbers and the configuration of that run (strategy, ranks,
per-device and global batch, model, device, DDP options, ...). Runs that could not run on this
machine (status 'not runnable here') appear as hatched, empty placeholder bars whose hover
text gives the reason.

    throughput(df)      samples per second of every run
    speedup(df)         throughput over the 'single' run of the same model, with the ideal (= devices)
    efficiency(df)      speedup / devices, against the ideal 1.0
    memory(df)          peak memory per rank, and params / grads / optimizer state per rank
    loss_curves(df)     training loss per step, one line per run
    dashboard(df)       the four above in one figure
    knobs(summary)      DDP knob variants' scaling efficiency, from a ``stnb.bench`` summary

``reference_frame()`` holds the numbers published in the sentence-transformers documentation
(``stnb.reference``: 4x V100, microsoft/mpnet-base). ``throughput(df, reference=True)``, ``speedup(..., reference=True)``
and ``with_reference(df_or_fig)`` show them beside ours, labelled as theirs.
"""

from __future__ import annotations

from html import escape as _escape
import math

from .. import reference
from ..strategy_table import DISTRIBUTED, ONE_PROCESS

OURS = "this machine"
REFERENCE_SOURCE = reference.SOURCE
REFERENCE_URL = reference.URL

STRATEGY_COLORS = {"single": "#7f7f7f", "dp": "#ff7f0e", "ddp": "#1f77b4", "fsdp": "#2ca02c"}
PART_COLORS = {"params": "#4c78a8", "grads": "#f58518", "optimizer_state": "#54a24b"}
GHOST_COLOR = "rgba(160, 160, 160, 0.18)"
MIB = 2**20

# columns of the normalised table (comparison_table) kept in a figure's layout.meta so that
# with_reference(fig) can rebuild it
_META_COLUMNS = (
    "source", "label", "strategy", "world_size", "devices", "per_device_batch_size", "global_batch_size",
    "gradient_accumulation_steps", "steps", "samples_per_second", "speedup", "efficiency", "baseline",
    "model", "device", "status", "reason", "verified", "run_id", "losses", "peak_memory_bytes",
    "memory_breakdown", "local_param_count", "total_param_count", "comm_hook", "gradient_as_bucket_view",
    "static_graph", "bucket_cap_mb", "mixed_precision", "loss", "max_seq_length", "threads_per_rank",
    "launcher", "hover",
)


# ---- the published reference ----------------------------------------------------------------

def reference_frame():
    """Throughput published in the sentence-transformers documentation ("Distributed Training"),
    from ``stnb.reference``: their setup (``reference.CONDITIONS``), *their* numbers on *their*
    hardware (source column), shown for comparison, never as ours.
    """
    import pandas as pd

    rows = []
    for r in reference.rows():
        strategy, devices = r["strategy"], r["devices"]
        batch = reference.PER_DEVICE_BATCH_SIZE
        rows.append(dict(
            strategy=strategy, world_size=reference.world_size(strategy), devices=devices,
            per_device_batch_size=batch, global_batch_size=batch * devices, gradient_accumulation_steps=1,
            samples_per_second=r["samples_per_second"], published_speedup=r["published_speedup"],
            model=reference.MODEL, device=f"cuda ({reference.GPUS}x V100, p3.8xlarge)",
            max_seq_length=reference.MAX_SEQ_LENGTH,
            status="ok", reason="", verified=None, steps=None, losses=[], peak_memory_bytes=[],
            memory_breakdown=[], local_param_count=[], total_param_count=reference.MODEL_PARAMETERS, run_id="",
            launcher="published", loss="as in the sentence-transformers docs",
            source=REFERENCE_SOURCE, url=REFERENCE_URL))
    return pd.DataFrame(rows)


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
        for t in _throughput_traces(ours):
            fig.add_trace(t, row=1, col=1)
        for t in _throughput_traces(theirs, name=f"published: {REFERENCE_SOURCE}"):
            fig.add_trace(t, row=1, col=2)
        fig.update_yaxes(title_text="samples / second", row=1, col=1)
        fig.update_yaxes(title_text="samples / second (their GPUs)", row=1, col=2)
    else:
        fig = go.Figure(_throughput_traces(ours))
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
    fig = go.Figure(list(_ratio_traces(data, metric)))
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
    for t in _peak_traces(ours):
        fig.add_trace(t, row=1, col=1)
    for t in _state_traces(ours):
        fig.add_trace(t, row=1, col=2)
    fig.update_yaxes(title_text="MiB", row=1, col=1)
    fig.update_yaxes(title_text="MiB", row=1, col=2)
    fig.update_layout(title="Memory per rank (CPU: growth of each rank's resident memory; "
                            "CUDA: torch.cuda.max_memory_allocated)", barmode="stack", bargap=0.3)
    return _finish(fig, "memory", data)


def loss_curves(df):
    """Training loss per step, one line per run."""
    import plotly.graph_objects as go

    data = comparison_table(df)
    ours, _ = _split(data)
    fig = go.Figure(_loss_traces(ours))
    fig.update_layout(title="Training loss", xaxis_title="step", yaxis_title="loss", xaxis_tickformat="d")
    _note_unrunnable(fig, ours)
    return _finish(fig, "loss_curves", data)


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
    for t in _throughput_traces(ours):
        fig.add_trace(t, row=1, col=1)
    for t in _ratio_traces(data, "speedup"):
        fig.add_trace(t, row=1, col=2)
    for t in _peak_traces(ours):
        fig.add_trace(t, row=2, col=1)
    for t in _loss_traces(ours):
        fig.add_trace(t, row=2, col=2)
    fig.update_xaxes(title_text="step", tickformat="d", row=2, col=2)
    fig.update_layout(title="stnb runs", barmode="overlay", bargap=0.3, height=750)
    return _finish(fig, "dashboard", data)


def knobs(summary, target: float | None = 0.95):
    """DDP knob comparison from a bench summary (``stnb.bench.bench(...).summary``): scaling efficiency
    of every variant (samples/s over N x the matching single-device run), with the target and the ideal.
    Hover shows samples/s, the baseline it is compared with and how many repeats it is the median of."""
    import plotly.graph_objects as go

    section = summary.get("sections", {}).get("knobs") if isinstance(summary, dict) else None
    if not section:
        raise ValueError("this bench summary has no 'knobs' section; run stnb.bench with sections=('knobs',)")
    rows = [r for r in section["variants"] if r.get("efficiency") is not None]
    hover = [f"samples/s: {r['samples_per_second']:,.1f} (median of {r['ok']} run(s))<br>"
             f"compared with: {_esc(r['baseline'])}<br>vs DDP defaults: "
             + (f"{r['vs_defaults']:.3f}" if r.get("vs_defaults") is not None else "-") for r in rows]
    colors = [STRATEGY_COLORS["ddp"] if r["variant"].startswith("ddp") else STRATEGY_COLORS["single"] for r in rows]
    fig = go.Figure(go.Bar(x=[r["variant"] for r in rows], y=[r["efficiency"] for r in rows], marker_color=colors,
                           hovertext=hover, texttemplate="%{y:.3f}", textposition="outside", name="efficiency",
                           hovertemplate="<b>%{x}</b><br>efficiency: %{y:.3f}<br>%{hovertext}<extra></extra>"))
    if target is not None:
        fig.add_hline(y=target, line_dash="dash", annotation_text=f"target {target:g}")
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="N x 1 device (ideal)")
    top = max([1.0] + [r["efficiency"] for r in rows])
    fig.update_layout(title="DDP knobs: scaling efficiency (samples/s over N x the matching 1-device run)",
                      yaxis_title="efficiency", yaxis_range=[0, top * 1.15], template="plotly_white",
                      meta={"stnb_kind": "knobs", "stnb_rows": rows}, hoverlabel=dict(align="left"))
    return fig


# ---- trace builders ---------------------------------------------------------------------------

def _throughput_traces(rows, name=None):
    import plotly.graph_objects as go

    ok = rows[_measured(rows, "samples_per_second")]
    traces = []
    if len(ok):
        source = ok["source"].iloc[0]
        traces.append(go.Bar(
            x=list(ok["label"]), y=list(ok["samples_per_second"]), name=name or f"samples/s ({source})",
            marker=_marker(ok), hovertext=list(ok["hover"]), texttemplate="%{y:,.1f}", textposition="outside",
            hovertemplate="<b>%{x}</b><br>samples/s: %{y:,.1f}<br>%{hovertext}<extra></extra>",
            cliponaxis=False, legendgroup=source))
    ghost = _ghost(rows[~_measured(rows, "samples_per_second")], _max(ok["samples_per_second"]) if len(ok) else 1.0)
    if ghost is not None:
        traces.append(ghost)
    return traces


def _ratio_traces(rows, column):
    """Bars of speedup or efficiency for every source, the ideal, and placeholders."""
    import plotly.graph_objects as go

    traces, ideal_x, ideal_y, ideal_text = [], [], [], []
    ok_all = rows[_measured(rows, column)]
    if column == "speedup":
        top = max([_max(ok_all[column])] + [float(d) for d in ok_all["devices"] if _is_num(d)])
    else:
        top = max(1.0, _max(ok_all[column]))
    fmt = "%{y:.2f}x" if column == "speedup" else "%{y:.2f}"
    for source, group in rows.groupby("source", sort=False):
        ok = group[_measured(group, column)]
        theirs = source == REFERENCE_SOURCE
        if len(ok):
            traces.append(go.Bar(
                x=list(ok["label"]), y=list(ok[column]),
                name=f"{column} (published: {source})" if theirs else f"{column} ({source})",
                marker=_marker(ok, hatched=theirs), hovertext=list(ok["hover"]), texttemplate=fmt,
                textposition="outside", cliponaxis=False, legendgroup=source,
                hovertemplate=f"<b>%{{x}}</b><br>{column}: {fmt}<br>%{{hovertext}}<extra></extra>"))
            ideal_x += list(ok["label"])
            ideal_y += [float(d) if column == "speedup" else 1.0 for d in ok["devices"]]
            ideal_text += [f"ideal for {int(d)} device(s): {float(d) if column == 'speedup' else 1.0:.2f}"
                           for d in ok["devices"]]
        missing = group[~_measured(group, column)]
        ghost = _ghost(missing, top)
        if ghost is not None:
            traces.append(ghost)
    if ideal_x:
        if column == "speedup":
            traces.append(go.Scatter(
                x=ideal_x, y=ideal_y, mode="markers", name="ideal (= number of devices)",
                marker=dict(symbol="line-ew-open", size=34, color="black", line=dict(width=3, color="black")),
                hovertext=ideal_text, hovertemplate="%{hovertext}<extra></extra>"))
        else:
            traces.append(go.Scatter(
                x=ideal_x, y=ideal_y, mode="lines", name="ideal (1.0)", line=dict(dash="dash", color="black"),
                hovertext=ideal_text, hovertemplate="%{hovertext}<extra></extra>"))
    return traces


def _peak_traces(rows):
    import plotly.graph_objects as go

    x0, x1, y, hover = [], [], [], []
    for _, r in rows.iterrows():
        peaks = r["peak_memory_bytes"] if isinstance(r["peak_memory_bytes"], list) else []
        if r["status"] != "ok" or not peaks:
            continue
        for rank, b in enumerate(peaks):
            x0.append(r["label"])
            x1.append(f"rank {rank}")
            y.append(b / MIB)
            hover.append(r["hover"])
    traces = []
    if y:
        traces.append(go.Bar(x=[x0, x1], y=y, name="peak memory", marker_color="#9467bd", hovertext=hover,
                             hovertemplate="<b>%{x}</b><br>peak: %{y:,.1f} MiB<br>%{hovertext}<extra></extra>"))
    missing = rows[(rows["status"] != "ok") | rows["peak_memory_bytes"].map(lambda p: not p)]
    ghost = _ghost(missing, max(y) if y else 1.0, multicategory=True)
    if ghost is not None:
        traces.append(ghost)
    return traces


def _state_traces(rows):
    import plotly.graph_objects as go

    from .. import memory as mem

    x0, x1 = [], []
    parts = {k: [] for k in PART_COLORS}
    hover, pred_y, pred_hover = [], [], []
    for _, r in rows.iterrows():
        breakdown = r["memory_breakdown"] if isinstance(r["memory_breakdown"], list) else []
        if r["status"] != "ok" or not breakdown:
            continue
        try:
            cmp = mem.compare(r)
        except Exception:
            cmp = None
        for rank, b in enumerate(breakdown):
            b = b or {}
            x0.append(r["label"])
            x1.append(f"rank {rank}")
            for k in parts:
                parts[k].append((b.get(k) or 0) / MIB)
            hover.append(r["hover"])
            if cmp is not None:
                t = cmp[(cmp["rank"] == rank) & (cmp["component"] == "total")]
                pred_y.append(float(t["predicted_bytes"].iloc[0]) / MIB if len(t) else None)
                buckets = cmp[(cmp["rank"] == rank) & (cmp["component"] == "ddp_buckets")]
                extra = (f"<br>+ DDP gradient buckets (not measured): "
                         f"{float(buckets['predicted_bytes'].iloc[0]) / MIB:,.1f} MiB" if len(buckets) else "")
                pred_hover.append(f"predicted by stnb.memory: {pred_y[-1]:,.1f} MiB{extra}")
            else:
                pred_y.append(None)
                pred_hover.append("no prediction")
    traces = []
    names = {"params": "params", "grads": "grads", "optimizer_state": "optimizer state"}
    for k, ys in parts.items():
        if ys:
            traces.append(go.Bar(x=[x0, x1], y=ys, name=names[k], marker_color=PART_COLORS[k], hovertext=hover,
                                 hovertemplate=f"<b>%{{x}}</b><br>{names[k]}: %{{y:,.2f}} MiB<br>%{{hovertext}}"
                                               "<extra></extra>"))
    if any(v is not None for v in pred_y):
        traces.append(go.Scatter(x=[x0, x1], y=pred_y, mode="markers", name="predicted (stnb.memory)",
                                 marker=dict(symbol="line-ew-open", size=30, color="black", line=dict(width=3, color="black")),
                                 hovertext=pred_hover, hovertemplate="%{hovertext}<extra></extra>"))
    return traces


def _loss_traces(rows):
    import plotly.graph_objects as go

    traces = []
    for _, r in rows.iterrows():
        losses = r["losses"] if isinstance(r["losses"], list) else []
        if r["status"] != "ok" or not losses:
            continue
        steps = list(range(1, len(losses) + 1))
        traces.append(go.Scatter(
            x=steps, y=losses, mode="lines+markers", name=r["label"],
            line=dict(color=STRATEGY_COLORS.get(r["strategy"])), hovertext=[r["hover"]] * len(steps),
            hovertemplate=f"<b>{_esc(r['label'])}</b><br>step %{{x}}: loss %{{y:.4f}}<br>"
                          "%{hovertext}<extra></extra>"))
    return traces


def _ghost(rows, height, multicategory=False):
    """Hatched, empty placeholder bars for runs without a number; the hover gives the reason."""
    import plotly.graph_objects as go

    if rows is None or not len(rows):
        return None
    height = height if height and height == height and height > 0 else 1.0
    labels = list(rows["label"])
    texts = [_why_missing(r) for _, r in rows.iterrows()]
    short = [_short_reason(r) for _, r in rows.iterrows()]
    x = [labels, ["n/a"] * len(labels)] if multicategory else labels
    return go.Bar(
        x=x, y=[height] * len(labels), name="not runnable here / no result", text=short,
        textposition="inside", insidetextanchor="middle", textangle=-90, textfont=dict(color="#555"),
        marker=dict(color=GHOST_COLOR, line=dict(color="#999", width=1), pattern=dict(shape="/", fgcolor="#bbb")),
        hovertext=[f"{t}<br>{h}" for t, h in zip(texts, rows["hover"])],
        hovertemplate="<b>%{x}</b><br>%{hovertext}<extra></extra>", legendgroup="ghost")


def _why_missing(r) -> str:
    status = r.get("status") or "ok"
    reason = _esc(str(r.get("reason") or ""))
    if status == "not runnable here":
        return f"not runnable here: {reason}"
    if status != "ok":
        return f"{status}: {reason}"
    if r.get("baseline_reason"):
        return f"no baseline: {_esc(r['baseline_reason'])}"
    return "no measurement: the run recorded no number for this"


def _short_reason(r) -> str:
    status = r.get("status") or "ok"
    if status != "ok":
        return status
    if r.get("baseline_reason"):
        return "no 'single' run to compare with"
    return "no measurement"


def _note_unrunnable(fig, rows):
    missing = rows[rows["status"] != "ok"]
    if not len(missing):
        return
    text = "<br>".join(f"{_esc(r['label'])}: {_why_missing(r)}" for _, r in missing.iterrows())
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0, y=1.0, xanchor="left", yanchor="bottom",
                       showarrow=False, align="left", font=dict(size=11, color="#666"))


# ---- the normalised table ---------------------------------------------------------------------

def comparison_table(df, reference: bool = False):
    """A copy of the results table with the columns the figures use: source, devices, label,
    speedup, efficiency, baseline, hover. Accepts a DataFrame, RunResults or dicts."""
    import pandas as pd

    from ..results import RunResult, results_frame

    if isinstance(df, RunResult):
        df = [df]
    if isinstance(df, (list, tuple)):
        df = results_frame(df)
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"expected a results DataFrame (stnb.results_frame / stnb.load_results), "
                        f"got {type(df).__name__}")
    df = df.copy().reset_index(drop=True)
    if "source" in df.columns:
        df = df[df["source"].fillna(OURS) != REFERENCE_SOURCE] if reference else df
    if reference:
        df = pd.concat([df, reference_frame()], ignore_index=True)
    df = df.reset_index(drop=True)
    defaults = {"strategy": "?", "source": OURS, "status": "ok", "reason": "", "model": "?", "device": "?", "world_size": 1,
                "per_device_batch_size": None, "global_batch_size": None, "gradient_accumulation_steps": 1,
                "samples_per_second": None, "losses": None, "peak_memory_bytes": None, "memory_breakdown": None,
                "local_param_count": None, "total_param_count": None, "verified": None, "run_id": "",
                "steps": None, "launcher": "stnb"}
    for col, val in defaults.items():
        if col not in df.columns:
            df[col] = val
        df[col] = df[col].where(df[col].notna(), val) if val is not None else df[col]
    for col in ("losses", "peak_memory_bytes", "memory_breakdown", "local_param_count"):
        df[col] = df[col].map(lambda v: list(v) if isinstance(v, (list, tuple)) else [])
    cfg = df["config"] if "config" in df.columns else pd.Series([{}] * len(df))
    for key in ("comm_hook", "gradient_as_bucket_view", "static_graph", "bucket_cap_mb", "mixed_precision",
                "loss", "max_seq_length", "threads_per_rank"):
        from_cfg = cfg.map(lambda c, k=key: c.get(k) if isinstance(c, dict) else None)
        df[key] = df[key].where(df[key].notna(), from_cfg) if key in df.columns else from_cfg
    if "devices" not in df.columns:
        df["devices"] = None
    df["devices"] = [d if d == d and d is not None else _devices(r) for d, (_, r) in zip(df["devices"], df.iterrows())]
    df["label"] = _labels(df)
    _add_ratios(df)
    df["hover"] = [_hover(r) for _, r in df.iterrows()]
    return df


def _devices(r) -> int:
    s = r.get("strategy")
    if s in DISTRIBUTED:
        return int(r.get("world_size") or 1)
    if s == "dp":
        pdb, gbs = r.get("per_device_batch_size"), r.get("global_batch_size")
        acc = r.get("gradient_accumulation_steps") or 1
        if pdb and gbs and gbs == gbs:
            return max(1, int(round(gbs / (pdb * acc))))
    return 1


def _labels(df) -> list:
    base = []
    for _, r in df.iterrows():
        d = int(r["devices"]) if r["devices"] == r["devices"] else 1
        lab = r["strategy"] if d == 1 and r["strategy"] in ONE_PROCESS else f"{r['strategy']} ×{d}"
        if r["source"] == REFERENCE_SOURCE:
            lab += " (docs)"
        base.append(lab)
    # make labels unique: within each group of equal labels, add what differs (model, batch
    # size, DDP hook, precision), then a counter for true repeats
    out = list(base)
    rows = [r for _, r in df.iterrows()]
    extras = (("model", lambda r: str(r["model"])), ("per_device_batch_size", lambda r: f"b{r['per_device_batch_size']}"),
              ("comm_hook", lambda r: f"hook {r.get('comm_hook')}"),
              ("mixed_precision", lambda r: str(r.get("mixed_precision"))))
    for _col, fn in extras:
        groups = {}
        for i, lab in enumerate(out):
            groups.setdefault(lab, []).append(i)
        for lab, idx in groups.items():
            if len(idx) > 1 and len({fn(rows[i]) for i in idx}) > 1:
                for i in idx:
                    out[i] = f"{lab} · {fn(rows[i])}"
    seen = {}
    final = []
    for lab in out:
        seen[lab] = seen.get(lab, 0) + 1
        final.append(lab if seen[lab] == 1 else f"{lab} #{seen[lab]}")
    return final


def _add_ratios(df) -> None:
    speed, eff, base, why = [], [], [], []
    ok = df[(df["status"] == "ok") & df["samples_per_second"].map(_is_num)]
    singles = ok[ok["strategy"] == "single"]
    for _, r in df.iterrows():
        if r["status"] != "ok" or not _is_num(r["samples_per_second"]):
            speed.append(None), eff.append(None), base.append(""), why.append("")
            continue
        cands = singles[(singles["source"] == r["source"]) & (singles["model"] == r["model"])
                        & (singles["device"] == r["device"])]
        same_batch = cands[cands["per_device_batch_size"] == r["per_device_batch_size"]]
        cands = same_batch if len(same_batch) else cands
        if r["strategy"] == "single" and r.name in cands.index:
            b = r
        elif len(cands):
            b = cands.iloc[-1]
        else:
            speed.append(None), eff.append(None), base.append("")
            why.append(f"no 'single' run of model {r['model']} on {r['device']} to compare with")
            continue
        s = float(r["samples_per_second"]) / float(b["samples_per_second"])
        d = float(r["devices"] or 1)
        speed.append(s)
        eff.append(s / d)
        base.append(f"{b['label']} ({float(b['samples_per_second']):,.1f} samples/s)")
        why.append("")
    df["speedup"], df["efficiency"], df["baseline"], df["baseline_reason"] = speed, eff, base, why
    for col in ("speedup", "efficiency"):
        df[col] = df[col].astype(float)


def _hover(r) -> str:
    def fmt(v, spec=""):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "–"
        return format(v, spec) if spec else _esc(str(v))

    theirs = r["source"] == REFERENCE_SOURCE
    lines = [f"source: {_esc(str(r['source']))}" + (" (published, not measured here)" if theirs else "")]
    lines.append(f"strategy: {r['strategy']} · world size: {fmt(r['world_size'])} · devices: {fmt(r['devices'])}")
    pdb, gbs = r["per_device_batch_size"], r["global_batch_size"]
    lines.append(f"batch: {fmt(pdb)} per device, {fmt(gbs)} global"
                 + (f" (accumulation {r['gradient_accumulation_steps']})"
                    if (r["gradient_accumulation_steps"] or 1) > 1 else ""))
    lines.append(f"model: {fmt(r['model'])} · device: {fmt(r['device'])}"
                 + (f" · seq ≤ {fmt(r['max_seq_length'])}" if r.get("max_seq_length") is not None else ""))
    if not theirs:
        lines.append(f"steps: {fmt(r['steps'])} · loss: {fmt(r.get('loss'))} · mixed precision: "
                     f"{fmt(r.get('mixed_precision'))}" + (f" · threads/rank: {fmt(r.get('threads_per_rank'))}"
                                                            if r.get("threads_per_rank") else ""))
    if r["strategy"] == "ddp" and not theirs:
        cap = r.get("bucket_cap_mb")
        lines.append(f"comm_hook: {fmt(r.get('comm_hook'))} · gradient_as_bucket_view: "
                     f"{fmt(r.get('gradient_as_bucket_view'))} · static_graph: {fmt(r.get('static_graph'))} · "
                     f"bucket_cap_mb: {fmt(cap) if cap is not None and cap == cap else 'default (25)'}")
    nums = []
    if _is_num(r["samples_per_second"]):
        nums.append(f"samples/s: {float(r['samples_per_second']):,.1f}")
    if _is_num(r.get("speedup")):
        nums.append(f"speedup: {r['speedup']:.2f}x over {r['baseline']}")
        nums.append(f"efficiency: {r['efficiency']:.2f}")
    if nums:
        lines.append(" · ".join(nums[:1]) + ("<br>" + " · ".join(nums[1:]) if nums[1:] else ""))
    peaks = r["peak_memory_bytes"]
    if peaks:
        lines.append("peak memory per rank: " + ", ".join(f"{p / MIB:,.0f} MiB" for p in peaks))
    if r["losses"]:
        lines.append(f"final loss: {r['losses'][-1]:.4f}")
    if not theirs:
        lines.append(f"verified: {fmt(r['verified'])} · run {fmt(r['run_id'])}")
    if r["status"] != "ok":
        lines.append(f"status: {_esc(str(r['status']))}: {_esc(str(r['reason']))}")
    if theirs:
        lines.append(f"from {REFERENCE_URL}")
    return "<br>".join(lines)


# ---- small helpers ----------------------------------------------------------------------------

def _esc(text) -> str:
    """Escape <, > and & for plotly's HTML-like hover text (quotes stay readable)."""
    return _escape(str(text), quote=False)


def _is_num(v) -> bool:
    try:
        return v is not None and not math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def _measured(rows, column):
    return (rows["status"] == "ok") & rows[column].map(_is_num)


def _max(series) -> float:
    vals = [float(v) for v in series if _is_num(v)]
    return max(vals) if vals else 1.0


def _split(data):
    theirs = data["source"] == REFERENCE_SOURCE
    return data[~theirs], data[theirs]


def _marker(rows, hatched=False) -> dict:
    m = dict(color=[STRATEGY_COLORS.get(s, "#8c564b") for s in rows["strategy"]])
    if hatched:
        m.update(opacity=0.55, pattern=dict(shape="/", fgcolor="white"), line=dict(color="#333", width=1))
    return m


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
    for rec in data[[c for c in _META_COLUMNS if c in data.columns]].to_dict(orient="records"):
        rows.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()})
    fig.update_layout(meta={"stnb_kind": kind, "stnb_rows": rows}, template="plotly_white",
                      legend=dict(orientation="h", yanchor="top", y=-0.18, x=0),
                      hoverlabel=dict(align="left"), margin=dict(t=80, b=120))
    return fig


_KINDS = {"throughput": throughput, "speedup": speedup, "efficiency": efficiency, "dashboard": dashboard}
