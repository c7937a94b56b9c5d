"""The comparison table's rows: what ``RunResult.to_row`` puts in each column of a real-shaped run, the row
of a strategy that cannot run here (and its reason), and ``results_frame`` over runs and JSONL dicts.

Fast: no process starts; each expected value is worked out here from the run's own numbers.
"""

from __future__ import annotations

import dataclasses
import json

import pandas as pd

import stnb
from stnb import RunResult, TrainConfig
from stnb.builds import UserBuild
from stnb.config import launch_fields
from stnb.strategies import options

# the config fields a row shows as columns of its own (the knobs the comparison table and plots group by)
CONFIG_COLUMNS = ("loss", "learning_rate", "threads_per_rank", "gradient_accumulation_steps", "gather_across_devices",
                  "reuse_freed_memory", *options())  # and every strategy's own options
DERIVED = ("peak_memory_max_bytes", "local_param_fraction", "final_loss")
NOT_RUNNABLE = "not runnable here"


def _config() -> TrainConfig:
    """A 3-rank FSDP config whose every knob differs from its default (a column that shows the default
    instead of the run's value, or another knob's value, is told apart)."""
    return TrainConfig(strategy="fsdp", num_processes=3, model="tiny", loss="mnrl", learning_rate=3e-4,
                       comm_hook="fp16", gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=7.5,
                       threads_per_rank=2, gradient_accumulation_steps=4, gather_across_devices=True,
                       broadcast_buffers=True, reuse_freed_memory=False, device="cpu", per_device_batch_size=4,
                       reshard_after_forward=False, fsdp_layer_cls="BertLayer", stage=3, deepspeed_config={"a": 1})


def _fsdp_run(**changes) -> RunResult:
    cfg = _config()
    fields = dict(
        strategy="fsdp", world_size=3, per_device_batch_size=4, global_batch_size=48, steps=3,
        samples_per_second=120.0, step_times=[0.5, 0.4, 0.4], losses=[2.0, 1.5, 1.25],
        peak_memory_bytes=[300 * 2**20, 700 * 2**20, 500 * 2**20],  # the largest rank is not rank 0 or the last
        local_param_count=[330, 340, 330], total_param_count=1000, verified=True,
        verification={"world_size_requested": 3}, model="tiny", device="cpu", versions={"torch": "2"},
        config=cfg.to_dict(), run_id="fsdp3")
    fields.update(changes)
    return RunResult(**fields)


def test_a_runs_row_has_every_field_the_largest_rank_peak_and_share_the_last_loss_and_the_config_knobs():
    run = _fsdp_run()
    row = run.to_row()
    cfg = _config()
    # every field of the run keeps its value, and the derived and config columns are added: no other column
    names = [f.name for f in dataclasses.fields(RunResult)]
    spearman = ("spearman_before", "spearman_after")  # the dev metric's, when it is a Spearman: a column, not a field
    assert set(row) == set(names) | set(DERIVED) | set(CONFIG_COLUMNS) | set(spearman)
    assert [row[k] for k in spearman] == [None, None]  # this run has no dev metric
    for name in names:
        assert row[name] == getattr(run, name), name
    assert row["peak_memory_max_bytes"] == 700 * 2**20      # rank 1's, the largest
    assert row["local_param_fraction"] == 340 / 1000         # the rank holding the most, of the whole model
    assert row["final_loss"] == 1.25                         # the last step's, not the first or one before
    for name in CONFIG_COLUMNS:
        assert row[name] == getattr(cfg, name), name
        assert row[name] != getattr(TrainConfig(), name), name  # the run's value, not a default's


def test_a_row_without_measurements_leaves_them_empty_and_a_run_without_config_has_no_knobs():
    empty = _fsdp_run(peak_memory_bytes=[], local_param_count=[], total_param_count=0, losses=[], config={})
    row = empty.to_row()
    assert [row[k] for k in DERIVED] == [None, None, None]
    assert [row[k] for k in CONFIG_COLUMNS] == [None] * len(CONFIG_COLUMNS)
    # a share needs both the ranks' counts and the model's: one without the other is no share (nor an error)
    assert _fsdp_run(local_param_count=[], total_param_count=1000).to_row()["local_param_fraction"] is None
    assert _fsdp_run(local_param_count=[500, 500], total_param_count=0).to_row()["local_param_fraction"] is None
    one = _fsdp_run(peak_memory_bytes=[42], losses=[0.75], local_param_count=[1000], total_param_count=1000).to_row()
    assert (one["peak_memory_max_bytes"], one["final_loss"], one["local_param_fraction"]) == (42, 0.75, 1.0)


def test_an_unrunnable_recipe_config_is_a_row_with_its_reason_and_the_batch_it_would_have_had():
    cfg = TrainConfig(strategy="ddp", num_processes=3, model="tiny", per_device_batch_size=4,
                      gradient_accumulation_steps=2, device="cpu")
    reason = "ddp needs 3 CPU cores, this machine has 2; use num_processes=2"
    r = RunResult.unavailable(cfg, reason)
    assert (r.strategy, r.world_size, r.per_device_batch_size, r.global_batch_size) == ("ddp", 3, 4, 4 * 3 * 2)
    assert (r.status, r.reason, r.model, r.device, r.build) == (NOT_RUNNABLE, reason, "tiny", "cpu", None)
    assert r.config == cfg.to_dict()
    # nothing was measured, and nothing is claimed verified
    assert (r.steps, r.samples_per_second, r.total_param_count, r.verified, r.verification) == (0, None, 0, False, {})
    assert r.step_times == r.losses == r.peak_memory_bytes == r.local_param_count == []
    assert set(r.versions) >= {"stnb", "torch"}
    row = r.to_row()
    assert (row["status"], row["reason"], row["final_loss"], row["peak_memory_max_bytes"]) == (
        NOT_RUNNABLE, reason, None, None)
    assert row["learning_rate"] == cfg.learning_rate and row["gradient_accumulation_steps"] == 2
    # the table keeps it when the runs are written and read back
    back = RunResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert (back.status, back.reason) == (NOT_RUNNABLE, reason)


def my_build():  # never called: the row is made before any rank runs
    raise AssertionError("not called")


def test_an_unrunnable_build_function_is_named_with_its_launch_options_and_the_batch_it_overrides():
    cfg = TrainConfig.for_build(strategy="ddp", num_processes=2, device="cpu", timeout=90.0,
                                override_args={"per_device_train_batch_size": 3})
    build = UserBuild(my_build)
    assert build.name == f"{__name__}.my_build"  # prepare.describe: the function's module and name
    r = RunResult.unavailable(cfg, "no gloo here", build=build)
    assert (r.model, r.build, r.reason, r.status) == (build.name, build.name, "no gloo here", NOT_RUNNABLE)
    assert (r.world_size, r.per_device_batch_size, r.global_batch_size) == (2, 3, 6)
    # the row's config: the launch options given (not the recipe's fields, which a build does not use)
    assert r.config == {**{k: getattr(cfg, k) for k in launch_fields()}, "build": build.name}
    assert "model" not in r.config and "learning_rate" not in r.config and r.config["timeout"] == 90.0
    # without an override the batch is the user's trainer's, unknown before it runs
    plain = RunResult.unavailable(TrainConfig.for_build(strategy="ddp", num_processes=2, device="cpu"), "why",
                                  build=build)
    assert (plain.per_device_batch_size, plain.global_batch_size) == (0, 0)


def test_results_frame_makes_one_row_per_run_from_runs_and_from_the_dicts_a_results_file_holds():
    runs = [_fsdp_run(), RunResult.unavailable(TrainConfig(strategy="dp", model="tiny", device="cuda"), "no GPU")]
    line = json.loads(json.dumps({**_fsdp_run(run_id="from-file", samples_per_second=99.0).to_dict(),
                                  "a_field_of_a_newer_stnb": 1}))  # read from a JSONL file: dropped, not an error
    frame = stnb.results_frame(runs + [line])
    assert isinstance(frame, pd.DataFrame) and len(frame) == 3
    assert list(frame["run_id"]) == ["fsdp3", runs[1].run_id, "from-file"]
    assert list(frame["status"]) == ["ok", NOT_RUNNABLE, "ok"]
    assert frame["samples_per_second"].iloc[2] == 99.0 and frame["reason"].iloc[1] == "no GPU"
    assert frame["peak_memory_max_bytes"].iloc[0] == 700 * 2**20 and frame["final_loss"].iloc[2] == 1.25
    assert "a_field_of_a_newer_stnb" not in frame.columns
    assert len(stnb.results_frame([])) == 0
