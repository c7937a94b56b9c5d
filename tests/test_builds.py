"""What a run trains is one object (``stnb.builds``): stnb's recipe (``RecipeBuild``) or a user's function
(``UserBuild``). Each question the pipeline used to answer with a ``build is None`` branch is asked of it:
the checks before launch, the model path, the result's ``config``, the exported script's source and the
Panel's mode. These run no process; the multi-process runs (tests/test_run.py, test_own_training.py,
test_export_*.py) train through the same objects."""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest

import stnb
from stnb.builds import RecipeBuild, UserBuild, build_of
from stnb.config import TrainConfig, flat
from stnb.rankreport import RankReport
from stnb.results import RunResult, merge
from stnb.widgets.modes import MODES, BuildMode, RecipeMode


def my_build():  # never called here: nothing trains in these tests
    raise AssertionError("not called")


def _report(build=None, training=None):
    return RankReport(rank=0, device="cpu", global_batch_size=4, step_times=[1.0, 1.0, 1.0], losses=[0.5] * 3,
                      verification={"ok": True, "world_size_seen": 1, "local_param_count": 10, "total_param_count": 10},
                      peak_memory_bytes=1, weight_digests={}, build=build, training=training)


def test_the_result_config_is_what_the_build_says_it_trained():
    """stnb's recipe: the whole TrainConfig; a user's function: the run options it was given, what its trainer
    trained with, and its name (the recipe's fields never applied to it)."""
    recipe_cfg = TrainConfig(strategy="single", steps=4, warmup_steps_excluded=1, model="tiny")
    res = merge(recipe_cfg, [_report()], device="cpu", build=RecipeBuild())
    assert res.config == recipe_cfg.to_dict() and res.build is None
    assert merge(recipe_cfg, [_report()], device="cpu").config == recipe_cfg.to_dict()  # the default: the recipe

    build = UserBuild(my_build)
    own_cfg = TrainConfig.for_build(strategy="single", timeout=30.0)
    trained = {"model": "my-model", "loss": "CosineSimilarityLoss", "per_device_batch_size": 4, "steps": 3}
    res = merge(own_cfg, [_report(build.name, trained)], device="cpu", build=build)
    assert res.config == {**flat(own_cfg.run_options), **trained, "build": build.name}
    assert "learning_rate" not in res.config and res.config["timeout"] == 30.0
    assert (res.model, res.per_device_batch_size, res.build) == ("my-model", 4, build.name)
    # the same config for the row of a run that could not start here
    row = RunResult.unavailable(own_cfg, "why", build=build)
    assert row.config == {**flat(own_cfg.run_options), "build": build.name} and row.model == build.name
    assert RunResult.unavailable(recipe_cfg, "why").config == recipe_cfg.to_dict()


def test_the_checks_before_launch_are_the_builds():
    """The recipe refuses options only a build function takes and resolves its model (the path travels with the
    object to the ranks); a build function's model and data are its own, and override_args applies to it."""
    cfg = TrainConfig(strategy="single", model="tiny", override_args={"per_device_train_batch_size": 2})
    with pytest.raises(stnb.ConfigError, match=r"override_args replaces training arguments of your own trainer"):
        RecipeBuild().check(cfg)
    UserBuild(my_build).check(TrainConfig.for_build(strategy="single",
                                                    override_args={"per_device_train_batch_size": 2}))
    recipe = RecipeBuild()
    recipe.check_inputs(TrainConfig(strategy="single", model="tiny"))
    assert recipe.initial_path and os.path.isdir(recipe.initial_path)  # the model the ranks train from
    with pytest.raises(stnb.ConfigError):  # its data is checked too
        RecipeBuild().check_inputs(TrainConfig(strategy="single", model="tiny", data="/nonexistent/pairs.csv"))
    own = UserBuild(my_build)
    own.check_inputs(TrainConfig.for_build(strategy="single"))
    assert own.initial_path is None  # the rank saves the user's untrained model where it needs one


def test_the_exported_script_describes_and_embeds_what_it_trains():
    cfg = TrainConfig(strategy="ddp", num_processes=2, steps=5, model="tiny")
    recipe = RecipeBuild().script(cfg, {}, "runs.jsonl")
    assert recipe["source"] == "a notebook configuration" and "builds the model, data, loss" in recipe["needs"]
    literal = recipe["body"].split("CONFIG = ", 1)[1].split("\n\n", 1)[0]
    assert ast.literal_eval(literal) == cfg.to_dict() and "RESULTS_FILE = 'runs.jsonl'" in recipe["body"]

    own = UserBuild(my_build).script(TrainConfig.for_build(strategy="ddp"), {"strategy": "ddp"}, None)
    assert own["source"] == "the build function my_build() of a notebook"
    assert "def my_build():" in own["body"] and "stnb.run(my_build, results_file=STNB_RESULTS_FILE" in own["body"]
    assert "Every rank calls\nmy_build()" in own["needs"]


def test_the_panel_mode_is_the_builds():
    assert isinstance(build_of(None), RecipeBuild) and isinstance(build_of(my_build), UserBuild)
    profile = stnb.current_profile()
    assert isinstance(RecipeBuild().panel_mode(MODES, profile, {}), RecipeMode)
    mode = UserBuild(my_build).panel_mode(MODES, profile, {"strategy": "single"})
    assert isinstance(mode, BuildMode) and mode.build is my_build and mode.build_name == UserBuild(my_build).name
    with pytest.raises(stnb.ConfigError, match="takes a TrainConfig or a function"):
        build_of(42)  # a build function is checked when it becomes one
