"""What fits under a memory budget, drawn: ``stnb.fits``'s table as one bar per strategy.

    fits(table)   per strategy, what a rank held at the largest batch that trained: the model state counted
                  from its tensors, and the rest (the runtime, activations, buffers); its label names that
                  batch and the next one, which ran out of memory, where it was tried; the budget as a line;
                  a strategy that trained nothing is a label at the budget line, never a bar
"""

from __future__ import annotations

from .traces import strategy_color

STATE_COLOR, REST_COLOR = "#4c78a8", "#bab0ac"


def fits(table):
    """A plotly Figure of ``stnb.fits(...)``'s table (MiB per rank, the budget as a dashed line)."""
    import plotly.graph_objects as go

    rows = table.to_dict(orient="records")
    names = [r["strategy"] for r in rows]
    trained = [bool(r["largest"]) for r in rows]
    state = [_num(r["state_mib"]) if ok else None for r, ok in zip(rows, trained)]
    rest = [_num(r["held_mib"]) - (s or 0.0) if ok else None for r, s, ok in zip(rows, state, trained)]
    text = [_said(r) if ok else "" for r, ok in zip(rows, trained)]
    fig = go.Figure([
        go.Bar(x=names, y=state, name="model state (params, grads, optimizer)", marker_color=STATE_COLOR,
               hovertemplate="model state: %{y:,.0f} MiB<extra>%{x}</extra>"),
        go.Bar(x=names, y=rest, name="the rest (runtime, activations, buffers)", marker_color=REST_COLOR,
               text=text, textposition="outside", hovertemplate="the rest: %{y:,.0f} MiB<extra>%{x}</extra>"),
    ])
    budget = max((_num(r["budget_mib"]) for r in rows), default=0.0)
    fig.add_hline(y=budget, line_dash="dash", line_color="black", annotation_text=f"budget {budget:,.0f} MiB",
                  annotation_position="top left")
    for r, ok in zip(rows, trained):
        if not ok:
            why = "out of memory at batch 1" if r["failed_at"] == 1 else "refused"
            fig.add_annotation(x=r["strategy"], y=budget, text=why, showarrow=False, yshift=-14,
                               font={"color": strategy_color(r["strategy"])})
    fig.update_layout(barmode="stack", bargap=0.35, template="plotly_white",
                      title="What a rank held at the largest batch that trained, under one budget per rank",
                      yaxis_title="MiB per rank (what the budget counts)", yaxis_range=[0, budget * 1.15],
                      legend=dict(orientation="h", yanchor="top", y=-0.12, x=0), margin=dict(t=80, b=100))
    return fig


def _said(r) -> str:
    """The bar's label: the batch that trained and, where one was tried, the next one that did not."""
    import pandas as pd

    failed = r["failed_at"]
    return f"batch {int(r['largest'])} trained" + ("" if pd.isna(failed) else f", {int(failed)} did not")


def _num(v) -> float:
    import pandas as pd

    return 0.0 if pd.isna(v) else float(v)
