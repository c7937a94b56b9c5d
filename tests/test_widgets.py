"""stnb.widgets.Panel in plain Python: set the widgets, press Run (the real callback), check the panel."""

from __future__ import annotations

import html
import sys

import pytest

import stnb
from stnb import widgets
from stnb.hardware import strategy_availability
from stnb.plots.timesplit import advice

SMALL = dict(train_size=64, dev_size=16)


def _only_dp_unavailable(device=None, share_gpus=False):
    out = dict(strategy_availability(device, share_gpus))
    out["dp"] = {"runnable": False, "reason": "DataParallel needs at least 2 CUDA GPUs (test)"}
    return out


@pytest.fixture
def no_dp(monkeypatch):
    """dp unavailable whatever this machine has: the panel and stnb.run both see it."""
    monkeypatch.setattr(sys.modules["stnb.widgets.panel"], "strategy_availability", _only_dp_unavailable)
    # sys.modules: the attribute stnb.hardware is the report function, not the module
    monkeypatch.setattr(sys.modules["stnb.hardware"], "strategy_availability", _only_dp_unavailable)


def test_defaults_come_from_the_current_profile():
    prof = stnb.current_profile()
    panel = widgets.Panel()
    cfg = panel.run_config()
    assert (cfg.model, cfg.steps, cfg.per_device_batch_size) == (prof.model, prof.steps, prof.per_device_batch_size)
    assert cfg.train_size == prof.train_size
    assert "stnb-panel" in panel._dom_classes
    for w, cls in ((panel.run_button, "stnb-run"), (panel.table, "stnb-results"), (panel.plot, "stnb-plot"),
                   (panel.error, "stnb-error"), (panel.progress, "stnb-progress")):
        assert cls in w._dom_classes
    assert "no runs yet" in panel.table.value and len(panel.results) == 0


def test_unrunnable_strategy_is_marked_and_disables_run(no_dp):
    panel = widgets.Panel(**SMALL)
    labels = dict((v, k) for k, v in panel.strategy.options)
    assert labels["dp"] == "dp · DataParallel (not runnable here: DataParallel needs at least 2 CUDA GPUs (test))"
    assert labels["single"] == "single · single device" and labels["fsdp"] == "fsdp · FSDP (ZeRO-3)"
    panel.strategy.value = "dp"
    assert panel.run_button.disabled
    assert "dp cannot run here" in panel.validation.value and "2 CUDA GPUs" in panel.validation.value
    panel.strategy.value = "single"
    assert not panel.run_button.disabled and panel.processes.disabled


def test_run_config_follows_the_widgets():
    panel = widgets.Panel(**SMALL)
    panel.strategy.value = "fsdp"
    panel.processes.value = 2
    panel.batch.value = 5
    panel.steps.value = 7
    panel.model.value = "minilm"
    cfg = panel.run_config()
    assert (cfg.strategy, cfg.num_processes, cfg.per_device_batch_size, cfg.steps, cfg.model) == \
        ("fsdp", 2, 5, 7, "minilm")
    panel.strategy.value = "single"
    assert panel.run_config().num_processes is None  # processes only mean something for ddp/fsdp
    panel.model.value = "  "
    assert panel.run_config().model == stnb.current_profile().model


def test_run_button_trains_ddp_and_adds_a_row_with_live_progress():
    panel = widgets.Panel(**SMALL)
    panel.strategy.value = "ddp"
    panel.processes.value = 2
    panel.batch.value = 4
    panel.steps.value = 3
    panel.model.value = "tiny"
    assert not panel.run_button.disabled, panel.validation.value
    panel.run_button.click()  # the real on_click handler, synchronously
    assert panel.error.value == "", panel.error.value
    df = panel.results
    assert len(df) == 1
    row = df.iloc[0]
    assert (row["strategy"], row["world_size"], row["per_device_batch_size"], row["global_batch_size"]) == \
        ("ddp", 2, 4, 8)
    assert row["status"] == "ok" and row["verified"] and row["samples_per_second"] > 0
    # progress: one bar per rank, driven from the launch's watchdog thread, finished
    assert len(panel.progress_bars) == 2
    assert [b.value for b in panel.progress_bars] == [3, 3]
    assert all("done" in lab.value and "step 3/3" in lab.value for lab in panel.progress_labels)
    assert "stnb-watchdog" in panel.progress_threads and panel.progress_updates >= 2
    # the table and the plot were updated, and the panel is ready again
    assert "<td>ddp ×2</td>" in panel.table.value
    (out,) = panel.plot.outputs
    assert "application/vnd.plotly.v1+json" in out["data"]
    assert panel.figure is not None and any(t.name == "samples/s (this machine)" for t in panel.figure.data)
    assert not panel.run_button.disabled and panel.run_button.description == "Run"
    assert "done" in panel.status.value
    # where the time went: the measured split of both ranks as a stacked bar, and the sentence whose
    # share is the one the ranks measured (worked out here from the raw per-step readings)
    res = panel.last_result
    warm = res.config["warmup_steps_excluded"]
    steady = [st for split in res.time_split for st in split["steps"][warm:]]
    assert len(res.time_split) == 2 and steady
    step = sum(st["step"] for st in steady)
    share = {p: sum(st.get(p) or 0.0 for st in steady) / step for p in
             ("data", "forward", "backward_compute", "comm_exposed", "wait", "optimizer")}
    sentence = advice(res)
    named = {"Waiting": share["wait"], "Exposed": share["comm_exposed"], "Data": share["data"],
             "The optimizer": share["optimizer"], "Forward and": share["forward"] + share["backward_compute"],
             "Compute": share["forward"] + share["backward_compute"]}
    first = next(v for k, v in named.items() if sentence.startswith(k))
    assert f"{first:.0%}" in sentence, (sentence, share)
    assert "Where the time went</b> (ddp ×2" in panel.advice.value and html.escape(sentence) in panel.advice.value
    assert f"forward (+ loss) {share['forward']:.0%}" in panel.advice.value
    bars = {t.name: t for t in panel.split_figure.data if t.type == "bar"}
    assert bars["forward (+ loss)"].y[0] == pytest.approx(1e3 * sum(st["forward"] for st in steady) / len(steady))
    assert "application/vnd.plotly.v1+json" in panel.split_plot.outputs[0]["data"]


def test_invalid_config_shows_the_error_and_the_panel_stays_usable(tmp_path):
    results_file = tmp_path / "runs.jsonl"
    panel = widgets.Panel(results_file=str(results_file), **SMALL)
    panel.strategy.value = "ddp"
    panel.processes.value = 64
    assert panel.run_button.disabled and "processes=64" in panel.validation.value
    assert panel.run() is None  # what a click does, even past the disabled button
    assert "ConfigError" in panel.error.value and "num_processes=64" in panel.error.value
    assert isinstance(panel.last_error, stnb.ConfigError)
    assert len(panel.results) == 0 and not results_file.exists()
    # still usable: fix the setting and run
    panel.strategy.value = "single"
    panel.batch.value = 4
    panel.steps.value = 3
    assert not panel.run_button.disabled
    panel.run_button.click()
    assert panel.error.value == ""
    assert list(panel.results["strategy"]) == ["single"]
    assert len(stnb.load_results(results_file)) == 1
    # a new panel on the same file starts with that run
    again = widgets.Panel(results_file=str(results_file), **SMALL)
    assert list(again.results["strategy"]) == ["single"] and "<td>single</td>" in again.table.value


def test_strategy_unavailable_adds_a_not_runnable_row(no_dp, tmp_path):
    results_file = tmp_path / "runs.jsonl"
    panel = widgets.Panel(results_file=str(results_file), **SMALL)
    panel.strategy.value = "dp"
    panel.run_button.click()
    assert "StrategyUnavailable" in panel.error.value and "2 CUDA GPUs (test)" in panel.error.value
    row = panel.results.iloc[0]
    assert row["status"] == "not runnable here" and "2 CUDA GPUs" in row["reason"]
    assert "not runnable here: DataParallel" in panel.table.value
    assert stnb.load_results(results_file).iloc[0]["status"] == "not runnable here"
    assert panel.plot.outputs  # the comparison shows the placeholder


def test_launch_errors_are_shown(monkeypatch):
    def boom(config, **kw):
        raise stnb.LaunchError("rank 1 raised RuntimeError: boom", rank=1, ranks=[1],
                               rank_traceback="--- traceback of rank 1 ---\nRuntimeError: boom",
                               logs={0: "fine\n", 1: "Traceback...\nRuntimeError: boom\n"})

    monkeypatch.setattr("stnb.runner.run", boom)
    panel = widgets.Panel(**SMALL)
    assert panel.run() is None
    assert "LaunchError" in panel.error.value and "rank 1 raised RuntimeError: boom" in panel.error.value
    assert "<details>" in panel.error.value and "traceback of rank 1" in panel.error.value
    assert not panel.run_button.disabled


def test_a_second_run_while_one_is_running_is_refused():
    panel = widgets.Panel(**SMALL)
    panel._running = True
    assert panel.run() is None
    assert "already in progress" in panel.error.value


# ---- the Panel with a user's build function ------------------------------------------------------


def build_small(outdir: str):
    """A user's own training, as written in a notebook cell: MNRL on pairs, the user's IR evaluator,
    per_device_train_batch_size=4, 3 steps."""
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.sentence_transformer import evaluation, losses

    from stnb.models import tiny_path

    model = SentenceTransformer(tiny_path(), device="cpu")
    topics = ["cats purr", "rockets fly", "bread rises", "rivers flow", "bees hum", "chess waits"]
    n = 36
    train = Dataset.from_dict({"anchor": [f"about {topics[i % 6]} {i}" for i in range(n)],
                               "positive": [f"{topics[i % 6]} {i}" for i in range(n)]})
    ir = evaluation.InformationRetrievalEvaluator(
        {f"q{i}": f"about {topics[i]} {i}" for i in range(6)}, {f"d{i}": f"{topics[i]} {i}" for i in range(6)},
        {f"q{i}": {f"d{i}"} for i in range(6)}, name="own", show_progress_bar=False, write_csv=False)
    args = SentenceTransformerTrainingArguments(output_dir=outdir, per_device_train_batch_size=4, max_steps=3,
                                                learning_rate=1e-3, logging_steps=1, report_to="none",
                                                save_strategy="no", seed=3)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=train,
                                      loss=losses.MultipleNegativesRankingLoss(model), evaluator=ir)


def test_build_panel_hides_the_recipe_widgets_and_the_batch_is_the_users_unless_overridden(tmp_path):
    import functools

    build = functools.partial(build_small, str(tmp_path))
    panel = widgets.Panel(build=build, threads_per_rank=1)
    assert panel.steps.layout.display == "none" and panel.model.layout.display == "none"
    assert "build_small" in panel.build_info.value and "stnb-build" in panel.build_info._dom_classes
    # the batch is the function's own until "override" is ticked, and says where to change it
    assert panel.batch.disabled and not panel.batch_override.value
    assert "SentenceTransformerTrainingArguments" in panel.batch.tooltip
    assert panel.run_config().override_args is None and "your per_device_train_batch_size" in panel.validation.value
    panel.batch_override.value = True
    panel.batch.value = 2
    assert not panel.batch.disabled
    assert panel.run_config().override_args == {"per_device_train_batch_size": (2, "set in the Panel")}
    assert "2 per device (override) = global batch 4" in panel.validation.value
    panel.strategy.value = "single"
    assert panel.run_config().num_processes is None and panel.processes.disabled
    # recipe options have no place next to a build function
    with pytest.raises(stnb.ConfigError, match="steps: max_steps in your SentenceTransformerTrainingArguments"):
        widgets.Panel(build=build, steps=5)
    with pytest.raises(stnb.ConfigError, match="requires outdir; give them defaults"):
        widgets.Panel(build=build_small)


def test_build_panel_trains_the_users_trainer_with_the_panels_batch_and_reports_it(tmp_path, no_dp):
    import functools

    results_file = tmp_path / "runs.jsonl"
    panel = widgets.Panel(build=functools.partial(build_small, str(tmp_path / "out")), results_file=str(results_file),
                          threads_per_rank=1)
    panel.strategy.value = "ddp"
    panel.processes.value = 2
    panel.batch_override.value = True
    panel.batch.value = 2
    assert not panel.run_button.disabled, panel.validation.value
    panel.run_button.click()
    assert panel.error.value == "", panel.error.value
    res = panel.last_result
    assert res.verified, res.reason
    assert res.build == "test_widgets.build_small" and res.world_size == 2
    # the Panel's batch replaced the function's 4 in both ranks: reported, and observed by the loss
    assert res.overridden_args["per_device_train_batch_size"] == {"from": 4, "to": 2, "why": "set in the Panel"}
    assert res.per_device_batch_size == 2 and res.global_batch_size == 4
    assert [r["batch_override"] for r in res.verification["ranks"]] == [
        {"asked": 2, "first_batch_rows": 2, "ok": True}] * 2
    assert res.dev_metric == "own_cosine_ndcg@10" and res.dev_metric_after is not None
    # progress bars take the length from the trainer's max_steps
    assert [b.value for b in panel.progress_bars] == [3, 3] and [b.max for b in panel.progress_bars] == [3, 3]
    # the same table and plot as stnb's recipe
    row = panel.results.iloc[0]
    assert (row["strategy"], row["world_size"], row["per_device_batch_size"], row["status"]) == ("ddp", 2, 2, "ok")
    assert "<td>ddp ×2</td>" in panel.table.value and panel.plot.outputs
    # a strategy that cannot run here: a "not runnable here" row that names the function
    panel.strategy.value = "dp"
    panel.run()
    assert "StrategyUnavailable" in panel.error.value
    last = panel.results.iloc[-1]
    assert last["status"] == "not runnable here" and last["build"] == "test_widgets.build_small"
    assert last["per_device_batch_size"] == 2
    assert len(stnb.load_results(results_file)) == 2
    # without the override the function's own batch applies, and nothing is reported overridden
    panel.strategy.value = "single"
    panel.batch_override.value = False
    panel.run_button.click()
    assert panel.error.value == "", panel.error.value
    res = panel.last_result
    assert res.verified and res.per_device_batch_size == 4 and res.world_size == 1
    assert "per_device_train_batch_size" not in res.overridden_args
    assert "batch_override" not in res.verification["ranks"][0]
    assert len(panel.results) == 3
