"""stnb.plots: figures from hand-made RunResults (no training), checked trace by trace."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

import stnb
from stnb import RunResult, TrainConfig
from stnb import plots, reference

DP_REASON = "DataParallel needs at least 2 CUDA GPUs in one process; this machine has 0"


def _run(strategy, world_size, sps, model="tiny", per_device=4, losses=(0.5, 0.4, 0.3), **cfg):
    devices = world_size
    state = {"params": 4000, "grads": 4000, "optimizer_state": 8000, "total": 16000}
    if strategy == "fsdp":
        state = {k: v // world_size for k, v in state.items()}
    config = TrainConfig(strategy=strategy, model=model, per_device_batch_size=per_device,
                         num_processes=world_size if strategy in ("ddp", "fsdp") else None, **cfg).to_dict()
    return RunResult(
        strategy=strategy, world_size=world_size, per_device_batch_size=per_device,
        global_batch_size=per_device * devices, steps=len(losses), samples_per_second=sps,
        step_times=[0.1] * len(losses), losses=list(losses), peak_memory_bytes=[(100 + r) * 2**20 for r in range(world_size)],
        local_param_count=[1000 // (world_size if strategy == "fsdp" else 1)] * world_size, total_param_count=1000,
        verified=True, model=model, device="cpu", versions={},
        verification={"model_shape": {"param_count": 1000, "trainable_param_count": 1000, "bytes_per_param": 4,
                                      "optimizer": "adamw"}, "world_size_requested": world_size},
        memory_breakdown=[dict(state) for _ in range(world_size)], config=config, run_id=f"{strategy}{world_size}{model}")


def _unrunnable():
    return RunResult.unavailable(TrainConfig(strategy="dp", model="tiny", per_device_batch_size=4), DP_REASON)


@pytest.fixture
def df():
    return stnb.results_frame([
        _run("single", 1, 100.0),
        _run("ddp", 2, 160.0, comm_hook="fp16", gradient_as_bucket_view=True),
        _run("fsdp", 2, 120.0),
        _unrunnable(),
        _run("ddp", 2, 50.0, model="minilm"),  # no single minilm run: no speedup
    ])


def _trace(fig, name_part):
    found = [t for t in fig.data if name_part in (t.name or "")]
    assert found, f"no trace named like {name_part!r}: {[t.name for t in fig.data]}"
    return found[0]


def test_throughput_bars_and_hover_show_numbers_and_configuration(df):
    fig = plots.throughput(df)
    assert isinstance(fig, go.Figure)
    bars = _trace(fig, "samples/s")
    assert list(bars.x) == ["single", "ddp ×2 · tiny", "fsdp ×2", "ddp ×2 · minilm"]
    assert list(bars.y) == [100.0, 160.0, 120.0, 50.0]
    hover = bars.hovertext[1]
    for text in ("strategy: ddp", "world size: 2", "4 per device, 8 global", "model: tiny", "device: cpu",
                 "comm_hook: fp16", "gradient_as_bucket_view: True", "samples/s: 160.0", "speedup: 1.60x"):
        assert text in hover, (text, hover)
    assert "comm_hook" not in bars.hovertext[2]  # DDP options only on DDP runs
    assert "samples/s: %{y" in bars.hovertemplate
    json.loads(fig.to_json())  # plain JSON: renders without widgets


def test_not_runnable_rows_appear_as_placeholders_with_the_reason(df):
    fig = plots.throughput(df)
    ghost = _trace(fig, "not runnable here")
    assert list(ghost.x) == ["dp"]
    assert ghost.text[0] == "not runnable here"
    assert DP_REASON in ghost.hovertext[0]
    # a label on the axis, not a bar: nothing with a height a reader could take for a measurement
    assert ghost.type == "scatter" and ghost.mode == "text" and list(ghost.y) == [0]
    assert not [t for t in fig.data if t.type == "bar" and "dp" in list(t.x)]


def test_speedup_over_single_of_the_same_model_with_ideal_line(df):
    fig = plots.speedup(df)
    bars = _trace(fig, "speedup (this machine)")
    assert list(bars.x) == ["single", "ddp ×2 · tiny", "fsdp ×2"]
    assert list(bars.y) == pytest.approx([1.0, 1.6, 1.2])
    ideal = _trace(fig, "ideal")
    assert dict(zip(ideal.x, ideal.y)) == {"single": 1.0, "ddp ×2 · tiny": 2.0, "fsdp ×2": 2.0}
    ghosts = _trace(fig, "not runnable here")
    missing = dict(zip(ghosts.x, ghosts.hovertext))
    assert DP_REASON in missing["dp"]
    assert "no 'single' run of model minilm" in missing["ddp ×2 · minilm"]


def test_efficiency_is_speedup_per_device_against_one(df):
    fig = plots.efficiency(df)
    bars = _trace(fig, "efficiency (this machine)")
    assert list(bars.y) == pytest.approx([1.0, 0.8, 0.6])
    ideal = _trace(fig, "ideal (1.0)")
    assert set(ideal.y) == {1.0}


def test_reference_is_shown_beside_ours_and_labelled_as_theirs(df):
    fig = plots.throughput(df, reference=True)
    theirs = _trace(fig, "published: sentence-transformers docs (4x V100)")
    assert theirs.xaxis == "x2"  # its own panel: V100 numbers would dwarf ours
    assert list(theirs.y) == list(reference.SAMPLES_PER_SECOND.values())
    assert "published, not measured here" in theirs.hovertext[0]
    titles = [a.text for a in fig.layout.annotations]
    assert any("theirs" in t for t in titles) and any("ours" in t for t in titles)

    sp = plots.speedup(df, reference=True)
    ref_bars = _trace(sp, "speedup (published")
    assert list(ref_bars.x) == ["single (docs)", "dp ×4 (docs)", "ddp ×4 (docs)", "fsdp ×4 (docs)"]
    assert list(ref_bars.y) == pytest.approx(list(reference.PUBLISHED_SPEEDUP.values()), abs=1e-3)
    assert ref_bars.marker.pattern.shape == "/"
    ideal = dict(zip(_trace(sp, "ideal").x, _trace(sp, "ideal").y))
    assert ideal["ddp ×4 (docs)"] == 4.0


def test_with_reference_on_a_frame_and_on_a_figure(df):
    both = plots.with_reference(df)
    assert set(both["source"]) == {"this machine", "sentence-transformers docs (4x V100)"}
    assert len(both) == len(df) + 4
    rebuilt = plots.with_reference(plots.speedup(df))
    assert any("published" in (t.name or "") for t in rebuilt.data)
    assert rebuilt.layout.meta["stnb_kind"] == "speedup" and rebuilt.layout.yaxis.title.text == "speedup (x)"
    assert plots.with_reference(plots.efficiency(df)).layout.meta["stnb_kind"] == "efficiency"
    # a frame that already carries the reference plots it without asking again
    assert any("published" in (t.name or "") for t in plots.throughput(both).data)
    with pytest.raises(ValueError, match="no numbers"):
        plots.with_reference(plots.loss_curves(df))


def test_hover_text_escapes_what_the_user_wrote():
    """Plotly reads hover text as HTML: a model name or a reason with <, > or & shows as written."""
    frame = stnb.results_frame([_run("single", 1, 10.0, model="org/<tiny>&co"),
                                RunResult.unavailable(TrainConfig(strategy="dp", model="tiny", per_device_batch_size=4),
                                                      "needs <2 GPUs> & CUDA")])
    fig = plots.throughput(frame)
    assert "model: org/&lt;tiny&gt;&amp;co" in _trace(fig, "samples/s").hovertext[0]
    ghost = _trace(fig, "not runnable here").hovertext[0]
    assert ghost.startswith("not runnable here: needs &lt;2 GPUs&gt; &amp; CUDA") and "<2 GPUs>" not in ghost


def test_memory_peak_per_rank_and_stacked_state(df):
    fig = plots.memory(df)
    peak = _trace(fig, "peak memory")
    x = list(zip(*peak.x))
    assert ("ddp ×2 · tiny", "r1") in x and ("single", "r0") in x
    assert peak.y[x.index(("ddp ×2 · tiny", "r1"))] == pytest.approx(101.0)
    assert fig.layout.barmode == "stack"
    parts = [t for t in fig.data if t.name in ("params", "grads", "optimizer state")]
    assert [t.name for t in parts] == ["params", "grads", "optimizer state"]
    fsdp_at = list(zip(*parts[0].x)).index(("fsdp ×2", "r0"))
    assert parts[0].y[fsdp_at] == pytest.approx(2000 / 2**20)
    pred = _trace(fig, "predicted")
    assert pred.y[fsdp_at] == pytest.approx(8000 / 2**20)  # (4 + 4 + 8) B x 1000 / 2 ranks
    ghost = _trace(fig, "not runnable here")
    assert DP_REASON in ghost.hovertext[0]


def test_loss_curves_one_line_per_run(df):
    fig = plots.loss_curves(df)
    lines = [t for t in fig.data if t.type == "scatter"]
    assert [t.name for t in lines] == ["single", "ddp ×2 · tiny", "fsdp ×2", "ddp ×2 · minilm"]
    assert list(lines[0].x) == [1, 2, 3] and list(lines[0].y) == [0.5, 0.4, 0.3]
    assert "batch: 4 per device" in lines[1].hovertext[0]
    assert any("not runnable here" in a.text for a in fig.layout.annotations)


def test_lines_that_lie_on_each_other_are_named_and_dashed_apart():
    """04's four strategies drew one green line under four legend entries: lines within COINCIDE of the y range
    at every step get a dash each and are named under the title, with how far apart they are."""
    frame = stnb.results_frame([
        _run("single", 1, 100.0, losses=(0.5, 0.4, 0.3)),
        _run("ddp", 2, 160.0, losses=(0.5, 0.4, 0.3)),
        _run("fsdp", 2, 120.0, losses=(0.5, 0.4001, 0.3)),
        _run("zero1", 2, 120.0, losses=(0.5, 0.4, 0.31)),  # 1.4% of the range off at one step: its own line
        _run("ddp", 2, 50.0, model="minilm", losses=(0.9, 0.6, 0.2)),
        _run("zero2", 2, 50.0, model="minilm", losses=(0.9, 0.6, 0.2))])
    fig = plots.loss_curves(frame)
    assert fig.layout.title.text == ("Training loss<br><sup>single, ddp ×2 · tiny and fsdp ×2 lie on one line (at "
                                     "most 0.0001 apart); ddp ×2 · minilm and zero2 ×2 lie on one line (the same "
                                     "values)</sup>")
    assert [t.line.dash for t in fig.data] == ["solid", "dash", "dot", None, "solid", "dash"]
    apart = plots.loss_curves(stnb.results_frame([_run("single", 1, 100.0, losses=(0.5, 0.4, 0.3)),
                                                  _run("ddp", 2, 160.0, losses=(0.5, 0.4, 0.31))]))
    assert apart.layout.title.text == "Training loss" and {t.line.dash for t in apart.data} == {None}
    longer = plots.loss_curves(stnb.results_frame([_run("single", 1, 100.0, losses=(0.5, 0.4, 0.3)),
                                                   _run("ddp", 2, 160.0, losses=(0.5, 0.4, 0.3, 0.2))]))
    assert longer.layout.title.text == "Training loss"  # not the same steps: not one line


def test_the_dashboard_names_loss_lines_drawn_as_one(df):
    fig = plots.dashboard(df)  # every run of df lost 0.5, 0.4, 0.3
    assert fig.layout.title.text == ("stnb runs<br><sup>training loss: single, ddp ×2 · tiny, fsdp ×2 and ddp ×2 · "
                                     "minilm lie on one line (the same values)</sup>")
    assert [t.line.dash for t in fig.select_traces(row=2, col=2)] == ["solid", "dash", "dot", "dashdot"]


def test_dev_curves_one_line_per_run_with_a_curve():
    from dataclasses import replace

    curve = [(0, 0.40), (10, 0.55), (20, 0.61), (30, 0.64)]
    with_curve = replace(_run("ddp", 2, 160.0), dev_metric="dev_spearman_cosine", dev_curve=curve)
    frame = stnb.results_frame([_run("single", 1, 100.0), with_curve, _unrunnable()])
    fig = plots.dev_curves(frame)
    lines = [t for t in fig.data if t.type == "scatter"]
    assert [t.name for t in lines] == ["ddp ×2"]  # the single run has no curve: no line
    assert list(lines[0].x) == [0, 10, 20, 30] and list(lines[0].y) == [0.40, 0.55, 0.61, 0.64]
    assert fig.layout.yaxis.title.text == "dev_spearman_cosine" and "dev_spearman_cosine" in lines[0].hovertemplate
    assert len(plots.dev_curves(stnb.results_frame([])).data) == 0


def test_dashboard_puts_four_panels_together(df):
    fig = plots.dashboard(df, reference=True)
    axes = {t.xaxis for t in fig.data}
    assert axes == {"x", "x2", "x3", "x4"}
    names = [t.name for t in fig.data if t.showlegend is not False]
    assert len(names) == len(set(names))  # no repeated legend entries
    assert any("published" in (t.name or "") for t in fig.data)


def test_plots_accept_results_files_and_run_lists(tmp_path, df):
    path = tmp_path / "runs.jsonl"
    for r in (_run("single", 1, 10.0), _run("ddp", 2, 15.0), _unrunnable()):
        stnb.append_result(path, r)
    fig = plots.speedup(stnb.load_results(path))
    assert list(_trace(fig, "speedup (this machine)").y) == pytest.approx([1.0, 1.5])
    assert list(plots.throughput([_run("single", 1, 10.0)]).data[0].y) == [10.0]
    with pytest.raises(TypeError, match="results DataFrame"):
        plots.throughput("runs.jsonl")


def test_runs_apart_only_in_a_labelled_option_are_told_apart_by_it():
    """DeepSpeed's stage (notebook 09 ran stage 1 and 2 side by side: their curves were 'deepspeed ×2' and
    'deepspeed ×2 #2'); a stage left unset reads as what DeepSpeed then uses."""
    frame = stnb.results_frame([_run("deepspeed", 2, 10.0, stage=1), _run("deepspeed", 2, 11.0, stage=3),
                                _run("deepspeed", 2, 12.0)])
    assert list(plots.throughput(frame).data[0].x) == ["deepspeed ×2 · stage 1", "deepspeed ×2 · stage 3",
                                                       "deepspeed ×2 · stage default (2)"]


def test_duplicate_configurations_get_distinct_labels():
    frame = stnb.results_frame([_run("single", 1, 10.0, per_device=4), _run("single", 1, 12.0, per_device=8),
                                _run("single", 1, 11.0, per_device=8)])
    x = list(plots.throughput(frame).data[0].x)
    assert x == ["single · b4", "single · b8", "single · b8 #2"]
    # speedup of a batch-8 run is measured against a batch-8 single run
    assert list(plots.speedup(frame).data[0].y) == pytest.approx([1.0, 1.0, 1.0])
    assert isinstance(plots.reference_frame(), pd.DataFrame)


def test_empty_and_unrunnable_only_tables_still_plot():
    empty = stnb.results_frame([])
    for fn in (plots.throughput, plots.speedup, plots.efficiency, plots.memory, plots.loss_curves, plots.dashboard):
        assert len(fn(empty).data) == 0
    only_dp = stnb.results_frame([_unrunnable()])
    fig = plots.throughput(only_dp)
    assert [t.name for t in fig.data] == ["not runnable here / no result"]
    assert len(plots.throughput(empty, reference=True).data) == 1  # theirs alone


def test_knobs_figure_from_a_bench_summary():
    variants = [
        {"variant": "single 1 device (1 thread)", "efficiency": None, "samples_per_second": 30.0},
        {"variant": "ddp defaults", "efficiency": 0.8, "samples_per_second": 48.0, "ok": 3,
         "baseline": "single 1 device (1 thread)", "vs_defaults": 1.0},
        {"variant": "ddp embedding rows hook", "efficiency": 0.9, "samples_per_second": 54.0, "ok": 3,
         "baseline": "single 1 device (1 thread)", "vs_defaults": 1.125},
        {"variant": "2 x single at once (no communication)", "efficiency": 0.99, "samples_per_second": 59.4,
         "ok": 3, "baseline": "single 1 device (1 thread)", "vs_defaults": None},
    ]
    fig = stnb.plots.knobs({"sections": {"knobs": {"variants": variants}}})
    bar = fig.data[0]
    assert list(bar.x) == [v["variant"] for v in variants[1:]]  # variants without an efficiency are left out
    assert list(bar.y) == [0.8, 0.9, 0.99]
    assert "samples/s: 54.0 (median of 3 run(s))" in bar.hovertext[1] and "vs DDP defaults: 1.125" in bar.hovertext[1]
    assert "vs DDP defaults: -" in bar.hovertext[2]
    lines = sorted(s.y0 for s in fig.layout.shapes)
    assert lines == [0.95, 1.0]
    # the lines' names at the left, apart (at the right they overlapped each other and the last bar's number)
    assert sorted((a.text, a.x, a.yanchor) for a in fig.layout.annotations) == [
        ("N x 1 device (ideal)", 0, "bottom"), ("target 0.95", 0, "top")]
    # long names wrapped under their bars, level (rotated, the last one ran off the figure's right edge)
    assert fig.layout.xaxis.tickangle == 0 and list(fig.layout.xaxis.tickvals) == list(bar.x)
    assert list(fig.layout.xaxis.ticktext) == ["ddp defaults", "ddp embedding rows<br>hook",
                                               "2 x single at once<br>(no communication)"]
    with pytest.raises(ValueError, match="no 'knobs' section"):
        stnb.plots.knobs({"sections": {}})


def test_reference_numbers_agree_with_each_other():
    """stnb.reference holds the docs' table: each published speed-up is its samples/s over single's
    (the docs print them rounded), and the DDP/FSDP rows ran on every GPU."""
    single = reference.SAMPLES_PER_SECOND["single"]
    for strategy, sps in reference.SAMPLES_PER_SECOND.items():
        assert sps / single == pytest.approx(reference.PUBLISHED_SPEEDUP[strategy], abs=1e-3), strategy
    assert [r["devices"] for r in reference.rows()] == [1, reference.GPUS, reference.GPUS, reference.GPUS]
    frame = plots.reference_frame()
    assert list(frame.samples_per_second) == list(reference.SAMPLES_PER_SECOND.values())
    assert set(frame.source) == {reference.SOURCE}


def test_a_bundled_models_folder_is_shown_by_its_name_in_labels_hovers_and_the_panel_table():
    """A build function's model arrives as the bundled MiniLM's install path; readers see 'minilm'."""
    from stnb.models import minilm_path

    path = minilm_path()
    runs = [_run("single", 1, 100.0, model=path), _run("ddp", 2, 160.0, model=path), _run("ddp", 2, 90.0)]
    table = plots.comparison_table(runs)
    assert list(table.model_name) == ["minilm", "minilm", "tiny"]
    assert list(table.model) == [path, path, "tiny"]          # the run's own record is untouched
    assert list(table.label) == ["single", "ddp ×2 · minilm", "ddp ×2 · tiny"]
    assert "model: minilm ·" in table.hover[1] and f"model: {path}" not in table.hover[1]
    assert table.speedup[1] == pytest.approx(1.6)              # compared with the single run of the same model

    html = stnb.widgets.view.results_table(runs)
    assert "<td>minilm</td>" in html and path not in html


def test_static_figures_are_asked_for_by_make_notebooks_and_refused_with_the_fix_when_kaleido_is_missing(monkeypatch):
    import sys

    from stnb.errors import ConfigError
    from stnb.profiles import STATIC_FIGURES_ENV, figure_renderer

    monkeypatch.delenv(STATIC_FIGURES_ENV, raising=False)
    assert figure_renderer() == "plotly_mimetype"                 # JSON only: what `make lab` users get
    monkeypatch.setenv(STATIC_FIGURES_ENV, "1")
    monkeypatch.setitem(sys.modules, "kaleido", None)             # as if kaleido were not installed
    with pytest.raises(ConfigError, match="pip install kaleido==1.5.0 and Chromium \\(make browser\\)"):
        figure_renderer()
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert f"{STATIC_FIGURES_ENV}=1" in makefile.split("NOTEBOOK_ENV :=", 1)[1].split("\n\n", 1)[0]
