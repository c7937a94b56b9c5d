"""Where the step time went, drawn: a stacked bar per run and a per-rank timeline of a few steps.

    split_bars(results)     one stacked bar per run: data, forward, backward compute, exposed
                            communication, wait, optimizer, other (they add up to the step), with the
                            communication that overlapped backward as a marker; a sentence under it
    timeline(result)        per rank, a compute lane and a communication lane for a few steps, the
                            wait for the slowest rank visible; a sentence under it
    advice(result)          that sentence: what dominates and what to change (the knobs named are the
                            ones the run's strategy owns: ``knob_hints``)
    sends(result)           the next: the collectives a step sends per rank (count and kind), the model
                            calls and the optimizer step, the step spread, evaluation and saves between
                            steps (``stnb.stepparts``)

Each reads ``RunResult.time_split`` (``stnb.timesplit``); means over the steady steps of every rank.
"""

from __future__ import annotations

LEGEND_ROW_PX = 29  # one vertical legend entry at plotly's default font
PARTS = ("data", "forward", "backward_compute", "comm_exposed", "wait", "optimizer", "other")
PART_COLORS = {"data": "#bab0ac", "forward": "#4c78a8", "backward_compute": "#72b7b2", "comm_exposed": "#e45756",
               "wait": "#f2cf5b", "optimizer": "#54a24b", "other": "#d3d3d3", "comm": "#e45756"}
LABELS = {"data": "data, logging", "forward": "forward (+ loss)", "backward_compute": "backward compute",
          "comm_exposed": "communication, exposed", "wait": "wait for the slowest rank", "optimizer": "optimizer",
          "other": "other"}


def _as_dict(result) -> dict:
    return result.to_dict() if hasattr(result, "to_dict") else dict(result)


def means(result) -> dict:
    """{part: mean seconds per step} over the steady steps of every rank, plus comm_total / comm_overlapped."""
    r = _as_dict(result)
    warm = int((r.get("config") or {}).get("warmup_steps_excluded", 2))
    steps = [st for split in r.get("time_split") or [] for st in (split or {}).get("steps", [])[warm:]]
    out = {}
    for k in (*PARTS, "step", "comm_total", "comm_overlapped"):
        vals = [st[k] for st in steps if st.get(k) is not None]
        out[k] = sum(vals) / len(vals) if vals else None
    return out


def knob_hints(r: dict) -> list:
    """What the run's strategy's own options would change about its communication (``Strategy.levers``; none
    for a strategy not registered here)."""
    from ..errors import ConfigError
    from ..strategies import get

    try:
        return get(r.get("strategy")).levers(r.get("config") or {})
    except ConfigError:
        return []


def advice(result) -> str:
    """One sentence: which part dominates the step, and the knob that would shrink it."""
    m = means(result)
    if not m.get("step"):
        return "No time split in this run (measured on CPU ranks; on CUDA use the profiler)."
    step = m["step"]
    share = {k: (m.get(k) or 0.0) / step for k in PARTS}
    compute = share["forward"] + share["backward_compute"]
    comm = share["comm_exposed"]
    if share["wait"] > 0.15:
        return (f"Waiting for the slowest rank takes {share['wait']:.0%} of each step: the ranks are uneven "
                "(other work on the machine, uneven batches); fewer ranks, or one per free core/GPU, would help.")
    hints = knob_hints(_as_dict(result))
    if comm > 0.2:
        ways = ["a bigger batch per device or gradient accumulation (fewer collectives per sample)", *hints]
        return (f"Exposed communication takes {comm:.0%} of each step: {', '.join(ways[:-1])}"
                f"{', or ' if len(ways) > 1 else ''}{ways[-1]} would help.")
    if share["data"] > 0.15:
        return f"Data loading and logging take {share['data']:.0%} of each step: more loader workers, or log less often."
    if share["optimizer"] > 0.2:
        return (f"The optimizer takes {share['optimizer']:.0%} of each step: a bigger batch per step (or accumulation) "
                "spreads it over more samples; sharding (FSDP) divides it by the ranks.")
    unseen = m.get("comm_total") is None and int(_as_dict(result).get("world_size") or 1) > 1
    if unseen:
        return (f"Forward and backward take {compute:.0%} of each step, this strategy's own collectives inside them "
                f"(not separated without the profiler): compare with DDP's split{''.join(', or ' + h for h in hints)}.")
    return (f"Compute dominates ({compute:.0%} of each step, exposed communication {comm:.0%}): communication does "
            "not hold this run back; more devices add throughput only where each brings its own compute (ranks "
            "sharing CPU cores do not: compare samples/s with one device's).")


def sends(result) -> str:
    """What a step sends per rank (``stnb.stepparts.sentence``), and the parts measured beside the phases."""
    from .. import stepparts

    p = stepparts.parts(result)
    said = [stepparts.sentence(result)]
    if p.get("forward_calls") is not None:
        said.append(f"{p['forward_calls']:g} model call(s) and {p['backward_calls']:g} backward(s) a step")
    if p.get("optimizer_step") is not None:
        said.append(f"optimizer.step {1e3 * p['optimizer_step']:.1f} ms, clipping {1e3 * p['clip']:.1f} ms")
    if p.get("spread"):
        said.append(f"step spread: std {1e3 * p['spread']['std']:.1f} ms, p90 {1e3 * p['spread']['p90']:.1f} ms")
    for kind, w in (p.get("outside_steps") or {}).items():
        every = f" every {w['every_steps']} steps" if w.get("every_steps") else ""
        said.append(f"{kind} between steps: {w['calls']} call(s){every}, {w['seconds']:.2f} s each")
    said = [s for s in said if s]
    return (". ".join(said) + ".") if said else ""


def split_bars(results, names=None):
    """A stacked bar per run (ms per step) with the overlapped communication as a marker."""
    import plotly.graph_objects as go

    results = list(results)
    rows = [_as_dict(r) for r in results]
    names = names or [f"{r['strategy']} x{r['world_size']}" for r in rows]
    ms = [means(r) for r in rows]
    fig = go.Figure()
    for part in PARTS:
        ys = [1e3 * (m.get(part) or 0.0) for m in ms]
        if any(ys):
            fig.add_trace(go.Bar(x=names, y=ys, name=LABELS[part], marker_color=PART_COLORS[part],
                                 hovertemplate=f"{LABELS[part]}: %{{y:.1f}} ms<extra>%{{x}}</extra>"))
    over = [1e3 * m["comm_overlapped"] if m.get("comm_overlapped") is not None else None for m in ms]
    if any(v is not None for v in over):
        fig.add_trace(go.Scatter(x=names, y=over, mode="markers", name="communication overlapped with backward",
                                 marker={"symbol": "line-ew-open", "size": 30, "color": "#e45756", "line": {"width": 3}},
                                 hovertemplate="overlapped with backward: %{y:.1f} ms<extra>%{x}</extra>"))
    lines = [line for n, r in zip(names, rows) for line in _wrap(f"{n}: {advice(r)} {sends(r)}".strip())]
    fig.update_layout(barmode="stack", title="Where each step's time goes (steady steps, every rank)",
                      yaxis_title="ms per step", height=420 + 18 * len(lines), margin={"b": 60 + 18 * len(lines)},
                      annotations=[_under("<br>".join(lines), len(lines))])
    return fig


def timeline(result, steps: int = 3):
    """Per rank: a compute lane (the parts in order) and a communication lane (the DDP buckets in flight),
    for ``steps`` steady steps; the wait for the slowest rank shows as its own colour."""
    import plotly.graph_objects as go

    r = _as_dict(result)
    warm = int((r.get("config") or {}).get("warmup_steps_excluded", 2))
    fig = go.Figure()
    seen = set()
    for rank, split in enumerate(r.get("time_split") or []):
        chosen = (split or {}).get("steps", [])[warm:warm + steps]
        t = chosen[0].get("start", 0.0) if chosen else 0.0
        for st in chosen:
            t = st.get("start", t)
            for part in PARTS:
                d = st.get(part) or 0.0
                if d > 0:
                    _bar(fig, f"rank {rank} compute", t, d, part, seen)
                t += d
            for s, e in st.get("comm_spans") or []:
                _bar(fig, f"rank {rank} comm", s, e - s, "comm", seen)
    lanes = 70 + 60 * len(r.get("time_split") or [])  # px: two lanes a rank
    plot = max(lanes, LEGEND_ROW_PX * len(seen) + 10)  # plotly cuts a legend taller than the plot at its foot
    fig.update_layout(barmode="overlay", title=f"{r['strategy']} x{r['world_size']}: {steps} steps per rank",
                      xaxis_title="seconds", height=100 + plot + 130, margin={"t": 100, "b": 130},
                      annotations=[_under("<br>".join(_wrap(advice(r))), 4, y=-60 / plot)])
    fig.update_yaxes(autorange="reversed")
    return fig


def _bar(fig, lane, start, width, part, seen):
    import plotly.graph_objects as go

    name = "communication in flight" if part == "comm" else LABELS[part]
    fig.add_trace(go.Bar(y=[lane], x=[width], base=[start], orientation="h", marker_color=PART_COLORS[part],
                         name=name, legendgroup=part, showlegend=part not in seen,
                         hovertemplate=f"{name}: %{{x:.3f}} s<extra>{lane}</extra>"))
    seen.add(part)


def _wrap(text: str, width: int = 110) -> list:
    import textwrap

    return textwrap.wrap(text, width)


def _under(text: str, lines: int, y: float = -0.15) -> dict:
    """An annotation under the plot (below the x axis title), anchored at its top."""
    return {"text": text, "xref": "paper", "yref": "paper", "x": 0, "y": y, "yanchor": "top", "showarrow": False,
            "align": "left", "font": {"size": 11}}
