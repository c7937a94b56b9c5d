"""Where the peak memory went, drawn: a stacked bar per run (``RunResult.memory_split``, ``stnb.memsplit``).

    memory_split(results)   one stacked bar per run, the rank with the highest peak: model state
                            (params, grads, optimizer state), activations, what the allocator held
                            free, and the two residuals; the measured peak as a marker; a sentence
                            under it (``stnb.memsplit.advice``)
"""

from __future__ import annotations

import textwrap

from ..memsplit import LABELS, SPLIT, advice, largest_rank

PART_COLORS = {"params": "#4c78a8", "grads": "#72b7b2", "optimizer_state": "#54a24b", "activations": "#f58518",
               "allocator_free": "#bab0ac", "before_steps_other": "#d3d3d3", "during_steps_other": "#e45756"}


def memory_split(results, names=None):
    """A stacked bar per run (MiB, the rank with the highest peak), the parts adding up to the peak."""
    import plotly.graph_objects as go

    rows = [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in results]
    names = names or [f"{r['strategy']} x{r['world_size']}" for r in rows]
    picked = [largest_rank(r) for r in rows]
    names = [n if p is None else f"{n} (rank {p[0]})" for n, p in zip(names, picked)]
    fig = go.Figure()
    for part in SPLIT:
        ys = [p[1][part] / 2**20 if p else 0.0 for p in picked]
        if any(ys):
            fig.add_trace(go.Bar(x=names, y=ys, name=LABELS[part], marker_color=PART_COLORS[part],
                                 hovertemplate=f"{LABELS[part]}: %{{y:.0f}} MiB<extra>%{{x}}</extra>"))
    peaks = [p[2] / 2**20 if p else None for p in picked]
    fig.add_trace(go.Scatter(x=names, y=peaks, mode="markers", name="measured peak",
                             marker={"symbol": "line-ew-open", "size": 30, "color": "black", "line": {"width": 3}},
                             hovertemplate="measured peak: %{y:.0f} MiB<extra>%{x}</extra>"))
    lines = [line for n, r in zip(names, rows) for line in textwrap.wrap(f"{n}: {advice(r)}", 110)]
    fig.update_layout(barmode="relative", title="Where the peak memory goes (highest rank)",
                      yaxis_title="MiB (growth over the rank's start)", height=420 + 18 * len(lines),
                      margin={"b": 60 + 18 * len(lines)},
                      annotations=[{"text": "<br>".join(lines), "xref": "paper", "yref": "paper", "x": 0, "y": -0.15,
                                    "yanchor": "top", "showarrow": False, "align": "left", "font": {"size": 11}}])
    return fig
