"""The scaling predictor's figure (``stnb.predict`` is ``stnb.scaling.predict`` plus this plot).

``figure(prediction)`` draws predicted samples/s against the device count (log axes), one line per
strategy (the all-mid prediction) inside a filled band (its interval: every input's range, low to high),
a suspect row's marker as an x, the ideal (n x one device) dashed, and the link and the main assumptions
under it.
"""

from __future__ import annotations

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
    notes = "<br>".join(a if len(a) < 150 else a[:147] + "..." for a in pred.assumptions[1:3])
    fig.update_layout(
        title=f"Predicted samples/s on {pred.fabric.link.name} (from {m.source[:40]})",
        xaxis={"title": "devices", "type": "log", "tickvals": ns}, yaxis={"title": "samples/s", "type": "log"},
        margin={"b": 150}, height=480,
        annotations=[{"text": notes, "xref": "paper", "yref": "paper", "x": 0, "y": -0.32, "showarrow": False,
                      "align": "left", "font": {"size": 10}}])
    return fig
