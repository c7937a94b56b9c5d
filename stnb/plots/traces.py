"""Plotly trace builders for the figures of ``stnb.plots``: bars of throughput, speedup and
efficiency, per-rank memory, loss lines, and the hatched placeholders (with their reasons) for
runs that have no number. Each takes rows of ``comparison_table`` and returns a list of traces.
"""

from __future__ import annotations

from .. import strategies
from .table import MIB, REFERENCE_SOURCE, esc, is_num

# each strategy's own colour (``Strategy.color``), as registered when plots was imported
STRATEGY_COLORS = {s.name: s.color for s in strategies.all_strategies()}


def strategy_color(name) -> str:
    """The strategy's colour (one registered after import too); a name stnb does not know: brown."""
    return strategies.get(name).color if name in strategies.names() else "#8c564b"


def variant_color(variant: str) -> str:
    """The colour of the first strategy a bench variant's name names ('ddp defaults', '2 x single at
    once'); the baseline's when it names none."""
    words = variant.split()
    return strategy_color(next((w for w in words if w in strategies.names()), strategies.baseline_name()))


PART_COLORS = {"params": "#4c78a8", "grads": "#f58518", "optimizer_state": "#54a24b"}


# ---- trace builders ---------------------------------------------------------------------------

def throughput_traces(rows, name=None):
    """Bars of samples/s for the measured runs of one source, and placeholders for the others."""
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
    ghost = _ghost(rows[~_measured(rows, "samples_per_second")])
    if ghost is not None:
        traces.append(ghost)
    return traces


def ratio_traces(rows, column):
    """Bars of speedup or efficiency for every source, the ideal, and placeholders."""
    import plotly.graph_objects as go

    traces, ideal_x, ideal_y, ideal_text = [], [], [], []
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
        ghost = _ghost(missing)
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


def peak_traces(rows):
    """Bars of peak memory per rank (grouped by run), and placeholders for runs without it."""
    import plotly.graph_objects as go

    x0, x1, y, hover = [], [], [], []
    for _, r in rows.iterrows():
        peaks = r["peak_memory_bytes"] if isinstance(r["peak_memory_bytes"], list) else []
        if r["status"] != "ok" or not peaks:
            continue
        for rank, b in enumerate(peaks):
            x0.append(r["label"])
            x1.append(_rank_tick(rank))
            y.append(b / MIB)
            hover.append(r["hover"])
    traces = []
    if y:
        traces.append(go.Bar(x=[x0, x1], y=y, name="peak memory", marker_color="#9467bd", hovertext=hover,
                             hovertemplate="<b>%{x}</b><br>peak: %{y:,.1f} MiB<br>%{hovertext}<extra></extra>"))
    missing = rows[(rows["status"] != "ok") | rows["peak_memory_bytes"].map(lambda p: not p)]
    ghost = _ghost(missing, multicategory=True)
    if ghost is not None:
        traces.append(ghost)
    return traces


def state_traces(rows):
    """Stacked bars of params / grads / optimizer state per rank, with stnb.memory's prediction as markers."""
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
            x1.append(_rank_tick(rank))
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


def _per_step_line(r, steps, values, what: str):
    """A run's line over its steps (``what``: the quantity's name in the hover), in its strategy's colour."""
    import plotly.graph_objects as go

    return go.Scatter(
        x=steps, y=values, mode="lines+markers", name=r["label"],
        line=dict(color=strategy_color(r["strategy"])), hovertext=[r["hover"]] * len(steps),
        hovertemplate=f"<b>{esc(r['label'])}</b><br>step %{{x}}: {what} %{{y:.4f}}<br>%{{hovertext}}<extra></extra>")


def loss_traces(rows):
    """One line of training loss per step for every run that recorded losses."""
    traces = []
    for _, r in rows.iterrows():
        losses = r["losses"] if isinstance(r["losses"], list) else []
        if r["status"] != "ok" or not losses:
            continue
        traces.append(_per_step_line(r, list(range(1, len(losses) + 1)), losses, "loss"))
    return traces


def dev_traces(rows):
    """One line of the dev metric per step (``RunResult.dev_curve``: before, during, after training) for every
    run that has a curve."""
    traces = []
    for _, r in rows.iterrows():
        curve = r["dev_curve"] if "dev_curve" in r and isinstance(r["dev_curve"], list) else []
        if r["status"] != "ok" or not curve:
            continue
        traces.append(_per_step_line(r, [p[0] for p in curve], [p[1] for p in curve], esc(r["dev_metric"])))
    return traces


def _rank_tick(rank: int) -> str:
    """A rank's tick under its strategy's group label: short ("r0"), so the ticks stay horizontal and the
    group labels (the strategies) keep their room in a 1000 px PNG (with "rank 0" they were dropped)."""
    return f"r{rank}"


def _ghost(rows, multicategory=False):
    """A label, not a bar, for each run without a number (e.g. "not runnable here"), on the axis where its bar
    would stand: nothing with a height a reader could take for a measurement; the hover gives the reason."""
    import plotly.graph_objects as go

    if rows is None or not len(rows):
        return None
    labels = list(rows["label"])
    texts = [_why_missing(r) for _, r in rows.iterrows()]
    short = [_short_reason(r) for _, r in rows.iterrows()]
    x = [labels, ["n/a"] * len(labels)] if multicategory else labels
    return go.Scatter(
        x=x, y=[0] * len(labels), mode="text", name="not runnable here / no result", text=short,
        textposition="top center", textfont=dict(color="#555"), cliponaxis=False,
        hovertext=[f"{t}<br>{h}" for t, h in zip(texts, rows["hover"])],
        hovertemplate="<b>%{x}</b><br>%{hovertext}<extra></extra>", legendgroup="ghost")


def _why_missing(r) -> str:
    status = r.get("status") or "ok"
    reason = esc(str(r.get("reason") or ""))
    if status == "not runnable here":
        return f"not runnable here: {reason}"
    if status != "ok":
        return f"{status}: {reason}"
    if r.get("baseline_reason"):
        return f"no baseline: {esc(r['baseline_reason'])}"
    return "no measurement: the run recorded no number for this"


def _short_reason(r) -> str:
    status = r.get("status") or "ok"
    if status != "ok":
        return status
    if r.get("baseline_reason"):
        return "no 'single' run to compare with"
    return "no measurement"


def note_unrunnable(fig, rows):
    """Write the runs that did not run, and why, above the plot (for figures without bars to hatch)."""
    missing = rows[rows["status"] != "ok"]
    if not len(missing):
        return
    text = "<br>".join(f"{esc(r['label'])}: {_why_missing(r)}" for _, r in missing.iterrows())
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0, y=1.0, xanchor="left", yanchor="bottom",
                       showarrow=False, align="left", font=dict(size=11, color="#666"))


COINCIDE = 0.005  # of the figure's y range: lines closer than this draw as one at any figure size
DASHES = ("solid", "dash", "dot", "dashdot")


def coinciding(lines) -> str:
    """Lines that lie on each other (the same steps, values within ``COINCIDE`` of their y range) show as one: give
    each a dash of its own; the sentence that says which they are and how far apart ('' if none do)."""
    lines = [t for t in lines if t.y is not None and len(t.y)]
    ys = [v for t in lines for v in t.y if v is not None]
    if len(lines) < 2 or not ys:
        return ""
    tol = COINCIDE * ((max(ys) - min(ys)) or abs(max(ys)) or 1.0)
    groups = []
    for t in lines:
        same = next((g for g in groups if list(g[0].x) == list(t.x)
                     and max(abs(a - b) for a, b in zip(g[0].y, t.y)) <= tol), None)
        if same is None:
            groups.append([t])
        else:
            same.append(t)
    said = []
    for g in (g for g in groups if len(g) > 1):
        for i, t in enumerate(g):
            t.line.dash = DASHES[i % len(DASHES)]
        apart = max(abs(a - b) for t in g[1:] for a, b in zip(g[0].y, t.y))
        how = "the same values" if apart == 0 else f"at most {apart:.2g} apart"
        names = [t.name for t in g]
        said.append(f"{', '.join(names[:-1])} and {names[-1]} lie on one line ({how})")
    return "; ".join(said)


def note_coinciding(fig, lines, where: str = "") -> str:
    """``coinciding(lines)``, said under the figure's title (after ``where``, the panel's name); the sentence."""
    sentence = coinciding(lines)
    if sentence:
        fig.update_layout(title_text=f"{fig.layout.title.text}<br><sup>{esc(where + sentence)}</sup>")
    return sentence


# ---- small helpers ----------------------------------------------------------------------------

def _measured(rows, column):
    return (rows["status"] == "ok") & rows[column].map(is_num)


def _marker(rows, hatched=False) -> dict:
    m = dict(color=[strategy_color(s) for s in rows["strategy"]])
    if hatched:
        m.update(opacity=0.55, pattern=dict(shape="/", fgcolor="white"), line=dict(color="#333", width=1))
    return m
