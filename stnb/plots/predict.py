"""The scaling predictor's figure (``stnb.predict`` is ``stnb.scaling.predict`` plus this plot).

``figure(prediction)`` draws predicted samples/s against the device count (log axes), one line per
strategy (the all-mid prediction) inside a filled band (its interval: every input's range, low to high),
a suspect row's marker as an x, the ideal (n x one device) dashed, and the link and the main assumptions
under it.
"""

from __future__ import annotations

import math
import textwrap

from .traces import strategy_color


def figure(pred):
    import plotly.graph_objects as go

    t = pred.table
    m = pred.measured
    single = m.batch / m.step  # the all-mid single step
    fig = go.Figure()
    ns = sorted(set(t["devices"]) | {1})
    fig.add_trace(go.Scatter(x=ns, y=[single * n for n in ns], name="ideal (n x one device)", mode="lines",
                             line={"dash": "dash", "color": "#999"}, hoverinfo="skip"))
    for s, rows in t[t["samples_per_second"].notna()].groupby("strategy", sort=False):
        rows = rows.sort_values("devices")
        color = strategy_color(s)
        fig.add_trace(go.Scatter(  # the band: high forward, low back, filled
            x=list(rows["devices"]) + list(rows["devices"])[::-1], y=list(rows["high"]) + list(rows["low"])[::-1],
            name=f"{s} interval", legendgroup=s, showlegend=False, mode="lines", fill="toself", fillcolor=color,
            opacity=0.18, line={"width": 0, "color": color}, hoverinfo="skip"))
        fig.add_trace(go.Scatter(
            x=list(rows["devices"]), y=list(rows["samples_per_second"]), name=s, legendgroup=s, mode="lines+markers",
            line={"color": color},
            marker={"symbol": ["x" if flag else "circle" for flag in rows["suspect"]], "size": 8},
            customdata=list(zip(rows["efficiency"], rows["step_ms"], rows["comm_exposed_ms"], rows["low"],
                                rows["high"], rows["dominant"], rows["suspect"])),
            hovertemplate=(f"<b>{s}</b> on %{{x}} devices<br>%{{y:,.0f}} samples/s (%{{customdata[3]:,.0f}} to "
                           "%{customdata[4]:,.0f}; widest input: %{customdata[5]})<br>efficiency %{customdata[0]:.2f}"
                           "<br>step %{customdata[1]:.1f} ms, exposed comm %{customdata[2]:.1f} ms"
                           "<br>%{customdata[6]}<extra></extra>")))
    notes = [line for a in pred.assumptions[1:3] for line in textwrap.wrap(a, 150, break_on_hyphens=False)]
    ys = [single * n for n in ns] + list(t["low"].dropna()) + list(t["high"].dropna())
    low, high = min(ys) / 1.15, max(ys) * 1.15
    ticks = log_ticks(low, high)
    title = textwrap.wrap(f"Predicted samples/s on {pred.fabric.link.name} (from {m.source})", 95)
    fig.update_layout(
        title="<br>".join(title), xaxis={"title": "devices", "type": "log", "tickvals": ns},
        yaxis={"title": "samples/s", "type": "log", "range": [math.log10(low), math.log10(high)], "tickvals": ticks,
               "ticktext": [f"{v:,.0f}" if v >= 1 else f"{v:g}" for v in ticks]},
        margin={"b": 110 + 14 * len(notes)}, height=480 + 14 * len(notes),
        annotations=[{"text": "<br>".join(notes), "xref": "paper", "yref": "paper", "x": 0, "y": -0.2,
                      "yanchor": "top", "showarrow": False, "align": "left", "font": {"size": 10}}])
    return fig


def log_ticks(low: float, high: float) -> list:
    """Labels for a log axis from ``low`` to ``high``: 1, 2, 3 and 5 times the powers of ten between them, fewer
    as the range widens (plotly's own labels a short log range with each minor digit: '3 4 5 6 7 8 9 100 2 3')."""
    if not 0 < low <= high:
        return []
    decades = math.log10(high / low)
    steps = (1, 2, 3, 5) if decades <= 1.5 else (1, 2, 5) if decades <= 2.5 else (1, 3) if decades <= 4 else (1,)
    return [m * 10.0 ** k for k in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
            for m in steps if low <= m * 10.0 ** k <= high]
