"""Report: the standalone HTML page of a bench (summary table and plotly figures) and the table of
its rows (``bench_frame``: one row per run, with section / variant / repeat columns).

The sweep is drawn with ``stnb.plots`` figures (plain plotly when they cannot draw it), the launcher
comparison as bars with min-max whiskers, the DDP knobs with ``stnb.plots.knobs``.
"""

from __future__ import annotations

from pathlib import Path

from stnb.files import write_atomic
from .options import ST_DOCS_NOTE, BenchOptions
from .summary import TARGETS, bench_tag, format_summary


def bench_frame(rows):
    """The result rows as a DataFrame (``stnb.results_frame``) plus the bench's section, variant
    and repeat of each run."""
    import pandas as pd

    from stnb.results import results_frame

    if not rows:
        return pd.DataFrame()
    df = results_frame(rows)
    tags = [bench_tag(r) for r in rows]
    df["section"] = [t.get("section") for t in tags]
    df["variant"] = [t.get("name") for t in tags]
    df["repeat"] = [t.get("repeat") for t in tags]
    return df


def write_report(path, summary: dict, frame, opts: BenchOptions) -> Path:
    """A standalone HTML page: the summary table, stnb.plots figures for the sweep (plain plotly
    figures when stnb.plots is missing), and the launcher / knob comparisons."""
    import html as _html

    import plotly.graph_objects as go

    path = Path(path)
    figs = []
    sweep = frame[frame["section"] == "sweep"] if len(frame) else frame
    if len(sweep):
        figs.extend(_sweep_figures(sweep))
    la = summary["sections"].get("launchers")
    if la and any(r["ok"] for r in la["variants"]):
        rows = [r for r in la["variants"] if r["ok"]]
        fig = go.Figure(go.Bar(x=[r["variant"] for r in rows], y=[r["samples_per_second"] for r in rows],
                               error_y=dict(type="data", symmetric=False,
                                            array=[r["max"] - r["samples_per_second"] for r in rows],
                                            arrayminus=[r["samples_per_second"] - r["min"] for r in rows]),
                               name="samples/s (median, min-max)"))
        fig.update_layout(title="Launchers: global samples/s (median of repeats, whiskers min-max)",
                          yaxis_title="samples / second", template="plotly_white")
        figs.append(fig)
        fig = go.Figure(go.Bar(x=[r["variant"] for r in rows], y=[r["time_to_first_step_s"] for r in rows]))
        fig.update_layout(title="Time from the call to the first optimizer step (median)",
                          yaxis_title="seconds", template="plotly_white")
        figs.append(fig)
    kn = summary["sections"].get("knobs")
    if kn and any(r["efficiency"] is not None for r in kn["variants"]):
        from stnb.plots import knobs

        figs.append(knobs(summary, TARGETS["efficiency_best"][2]))
    parts = [f"<h1>stnb bench: preset {_html.escape(opts.preset)}</h1>",
             f"<p>model {_html.escape(opts.model)}, max_seq_length {opts.max_seq_length}, {opts.steps} steps "
             f"({opts.warmup} warm-up steps excluded from samples/s), {opts.repeats} interleaved repeat(s). "
             f"Results file: {_html.escape(str(opts.results_path()))}.</p>"]
    if opts.preset == "st-docs":
        parts.append(f"<p>{_html.escape(ST_DOCS_NOTE)}</p>")
    parts.append("<pre>" + _html.escape(format_summary(summary)) + "</pre>")
    for i, fig in enumerate(figs):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>stnb bench</title></head><body>"
            + "\n".join(parts) + "</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, page, 0o644)
    return path


def _sweep_figures(sweep) -> list:
    try:
        from stnb import plots
    except ImportError:
        plots = None
    if plots is not None:
        try:
            return [plots.dashboard(sweep), plots.efficiency(sweep)]
        except Exception:  # noqa: BLE001 - fall back to plain plotly express below
            pass
    import plotly.express as px

    ok = sweep[sweep["status"] == "ok"]
    figs = []
    if len(ok):
        figs.append(px.bar(ok, x="variant", y="samples_per_second", color="strategy",
                           title="Sweep: samples/s", labels={"samples_per_second": "samples / second"}))
    return figs

