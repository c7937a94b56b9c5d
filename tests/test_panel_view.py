"""The Panel's parts without a kernel: the HTML view (pure functions of the results), the recipe and
build modes kept apart, the strategies' knobs from the registry (a made-up strategy brings its own,
DeepSpeed's ZeRO stage reaches run_config), and the time-split sentence for each of its branches.
The real 2-rank run behind the time split is in test_widgets (the Run button's test)."""

from __future__ import annotations

import re
from html import unescape

import pytest

import stnb
from stnb import strategies
from stnb.config import TrainConfig
from stnb.plots.timesplit import advice
from stnb.results import RunResult
from stnb.strategies import Option, Strategy
from stnb.widgets import Panel, view
from stnb.widgets.modes import BuildMode, RecipeMode

SMALL = dict(train_size=64, dev_size=16)


def _result(strategy="ddp", world_size=2, sps=100.0, verified=True, peaks=(300, 310), losses=(0.9, 0.5),
            steps=None, status="ok", reason="", warmup=0, **knobs):
    cfg = TrainConfig(strategy=strategy, model="tiny", num_processes=world_size if world_size > 1 else None,
                      warmup_steps_excluded=warmup, **knobs).to_dict()
    return RunResult(strategy=strategy, world_size=world_size, per_device_batch_size=4,
                     global_batch_size=4 * world_size, steps=len(losses), samples_per_second=sps,
                     step_times=[0.1] * len(losses), losses=list(losses),
                     peak_memory_bytes=[p * 2**20 for p in peaks], local_param_count=[1000] * world_size,
                     total_param_count=1000, verified=verified, verification={}, model="tiny", device="cpu",
                     versions={}, config=cfg, status=status, reason=reason,
                     time_split=[{"steps": [dict(s) for s in steps]} for _ in range(world_size)] if steps else [],
                     run_id=f"{strategy}{world_size}{sps}")


def _rows(html: str) -> list:
    """The results table as dicts keyed by its column names, text unescaped."""
    heads = [unescape(h) for h in re.findall(r"<th[^>]*>(.*?)</th>", html)]
    return [dict(zip(heads, (unescape(c) for c in re.findall(r"<td>(.*?)</td>", tr))))
            for tr in re.findall(r"<tr class=\"stnb-[a-z]+\">(.*?)</tr>", html)]


def _step(step=0.1, **parts):
    out = {"step": step, "data": 0.0, "forward": 0.0, "backward_compute": 0.0, "comm_exposed": 0.0,
           "optimizer": 0.0, "wait": 0.0, "comm_total": 0.0, "comm_overlapped": 0.0}
    out.update(parts)
    out["other"] = step - sum(out[p] for p in ("data", "forward", "backward_compute", "comm_exposed", "optimizer",
                                               "wait"))
    return out


# ---- the view: pure functions ----------------------------------------------------------------


def test_the_results_table_says_what_the_results_say():
    single = _result("single", 1, sps=50.0, peaks=(200,), losses=(0.8, 0.61))
    ddp = _result("ddp", 2, sps=1234.5, verified=False, peaks=(300, 357), losses=(0.9, 0.4321))
    gone = _result("dp", 1, sps=None, status="not runnable here", reason="needs 2 CUDA GPUs", peaks=())
    html = view.results_table([single, ddp, gone])
    rows = _rows(html)
    assert [r["strategy"] for r in rows] == ["single", "ddp", "dp"]
    assert rows[0]["verified"] == "True" and rows[1]["verified"] == "False"
    assert rows[1]["samples/s"] == "1,234.5" and rows[1]["speedup"] == f"{1234.5 / 50.0:.2f}x"
    assert rows[1]["peak MiB"] == "357" and rows[1]["final loss"] == "0.4321"
    assert (rows[1]["ranks"], rows[1]["global batch"]) == ("2", "8")
    assert rows[2]["status"] == "not runnable here: needs 2 CUDA GPUs" and rows[2]["samples/s"] == "–"
    assert html.count('class="stnb-unrunnable"') == 1
    assert view.results_table([]) == view.EMPTY_TABLE


def test_the_time_split_view_gives_each_parts_share_and_the_advice():
    steps = [_step(0.1, forward=0.02, backward_compute=0.03, comm_exposed=0.04, optimizer=0.005, data=0.005)] * 3
    r = _result(steps=steps)
    html = view.time_split_html(r)
    assert "ddp ×2, 100.0 ms per step" in html
    assert "forward (+ loss) 20%" in html and "communication, exposed 40%" in html and "backward compute 30%" in html
    assert unescape(html).endswith(advice(r)) and "Exposed communication takes 40%" in html
    assert view.has_time_split(r) and not view.has_time_split(_result())
    assert "No time split in this run" in view.time_split_html(_result())


@pytest.mark.parametrize("parts, words", [
    (dict(wait=0.03, forward=0.03, backward_compute=0.03), ("Waiting for the slowest rank takes 30%", "fewer ranks")),
    (dict(comm_exposed=0.05, forward=0.02, backward_compute=0.02), ("Exposed communication takes 50%",
                                                                    "gradient accumulation", "bucket_cap_mb",
                                                                    "comm_hook='fp16'")),
    (dict(data=0.04, forward=0.03, backward_compute=0.03), ("Data loading and logging take 40%", "loader workers")),
    (dict(optimizer=0.03, forward=0.03, backward_compute=0.03), ("The optimizer takes 30%", "bigger batch")),
    (dict(forward=0.04, backward_compute=0.05, comm_exposed=0.01), ("Compute dominates (90%", "exposed communication 10%")),
])
def test_advice_names_what_dominates_and_what_to_change(parts, words):
    text = advice(_result(steps=[_step(0.1, **parts)] * 2))
    for w in words:
        assert w in text, text


def test_advice_names_the_knobs_of_the_runs_own_strategy():
    unseen = [{k: v for k, v in _step(0.1, forward=0.04, backward_compute=0.05).items()
               if k not in ("comm_total", "comm_overlapped")}] * 2  # collectives inside forward and backward
    fsdp = advice(_result("fsdp", steps=unseen))
    assert "Forward and backward take 90%" in fsdp and "reshard_after_forward=False" in fsdp
    assert "bucket_cap_mb" not in fsdp and "ZeRO stage" not in fsdp
    ds3 = advice(_result("deepspeed", steps=unseen, stage=3))
    assert "a lower ZeRO stage" in ds3 and "reshard_after_forward" not in ds3
    assert "ZeRO stage" not in advice(_result("deepspeed", steps=unseen, stage=1))  # already the lowest
    comm = [_step(0.1, comm_exposed=0.05, forward=0.02, backward_compute=0.02)] * 2
    assert "reshard_after_forward=False" in advice(_result("fsdp", steps=comm))
    assert "comm_hook" not in advice(_result("fsdp", steps=comm))
    assert advice(_result("ddp", steps=comm)).endswith("(half the bytes on the wire), or another bucket_cap_mb would help.")
    assert advice(_result("single", 1, steps=comm)).endswith("(fewer collectives per sample) would help.")
    assert advice(_result()).startswith("No time split")


def test_the_warmup_steps_are_left_out_of_the_split():
    slow, steady = _step(1.0, data=0.9), _step(0.1, forward=0.04, backward_compute=0.05)
    assert "Compute dominates (90%" in advice(_result(steps=[slow, steady, steady], warmup=1))
    assert "Data loading" in advice(_result(steps=[slow, steady, steady], warmup=0))


def test_the_settings_lines_name_the_strategy_its_knobs_and_the_batch():
    c = TrainConfig(strategy="deepspeed", stage=3, num_processes=2, per_device_batch_size=5, model="tiny", steps=7)
    assert unescape(view.recipe_ready(c)).startswith('<span style="color:#2e7d32">deepspeed (stage=3) on 2 rank(s) × 5 per '
                                                     "device = global batch 10 · model tiny · 7 steps")
    b = TrainConfig.for_build(strategy="ddp", num_processes=2)
    assert "ddp on 2 rank(s) × 3 per device (override) = global batch 6 · mine()" in view.build_ready(b, "mine", 3)
    assert "your per_device_train_batch_size per device" in view.build_ready(b, "mine", None)
    assert "&lt;b&gt;" in view.problem_html("<b>x</b>")


def test_errors_show_their_kind_first_line_and_the_rest_folded_away():
    e = stnb.LaunchError("rank 1 raised <RuntimeError>: boom\nsecond line", rank=1, ranks=[1],
                         logs={0: "", 1: "\n".join(f"line {i}" for i in range(40))})
    html = view.error_html(e)
    assert "<b>LaunchError</b>: rank 1 raised &lt;RuntimeError&gt;: boom<details>" in html
    assert "second line" in html and "--- rank 1 (last lines) ---" in html and "--- rank 0" not in html
    assert "line 39" in html and "line 24" not in html  # the last 15 lines
    try:
        raise ValueError("a bug")
    except ValueError as bug:
        assert "Traceback" in view.error_html(bug) and "test_panel_view.py" in view.error_html(bug)
    assert "<details>" not in view.error_html(stnb.ConfigError("bad input"))
    logs = view.rank_logs({1: "\n".join(f"r1 {i}" for i in range(50)), 0: "only\n\n"})
    assert logs.index("[rank 0]") < logs.index("[rank 1]") and "r1 49" in logs and "r1 19" not in logs
    assert view.rank_logs({0: "  \n"}) == ""


# ---- the modes -------------------------------------------------------------------------------


def _build():
    raise AssertionError("not called: the Panel only checks and names it")


def test_recipe_mode_owns_model_steps_and_batch_and_hides_the_override():
    panel = Panel(**SMALL)
    assert isinstance(panel.mode, RecipeMode)
    assert panel.batch_override.layout.display == "none" and not panel.steps.disabled and not panel.batch.disabled
    panel.steps.value, panel.batch.value, panel.model.value = 9, 3, "tiny"
    c = panel.run_config()
    assert (c.steps, c.per_device_batch_size, c.model, c.override_args) == (9, 3, "tiny", None)


def test_build_mode_disables_the_recipes_controls_and_ignores_them():
    panel = Panel(build=_build)
    assert isinstance(panel.mode, BuildMode) and "_build" in panel.build_info.value
    for w in (panel.steps, panel.model):
        assert w.disabled and w.layout.display == "none"
    assert panel.batch.disabled and panel.batch_override.layout.display != "none"
    panel.steps.value = 99  # hidden: even if set, a build function's run does not take it
    c = panel.run_config()
    assert c.steps == TrainConfig().steps and c.override_args is None
    panel.batch_override.value = True
    assert not panel.batch.disabled and panel.steps.disabled


# ---- the strategies' knobs -------------------------------------------------------------------


class Knobbed(Strategy):
    """A strategy made up here, with two options of its own that no other strategy has: a flag, and one with
    the values it takes (``choices``); verified trivially."""
    name = "knobbed"
    label = "made up, with knobs"
    summary = "a test strategy with two options of its own"
    options = {"knob_flag": Option(True, "bool", "a made-up flag"),
               "knob_level": Option(None, "int | None", "a made-up level", choices=(1, 2))}

    def check_prepared(self, trainer, world_size):
        return {}, []

    def check_ranks(self, rank_results, world_size):
        return {}, []


def _visible(panel) -> list:
    return [name for name, k in panel.knobs.items() if k.widget.layout.display != "none"]


def test_a_strategy_added_to_the_registry_appears_in_the_picker_with_its_knobs():
    assert "knob_flag" not in Panel(**SMALL).knobs
    strategies.register(Knobbed)
    try:
        panel = Panel(**SMALL)
        assert dict(panel.strategy.options)["knobbed · made up, with knobs"] == "knobbed"
        panel.strategy.value = "knobbed"
        assert _visible(panel) == ["knob_flag", "knob_level"]
        assert "a test strategy with two options of its own" in panel.strategy_help.value
        box, level = panel.knobs["knob_flag"].widget, panel.knobs["knob_level"].widget
        assert box.value is True and "stnb-knob-knob_flag" in box._dom_classes and box.tooltip == "a made-up flag"
        assert [v for _, v in level.options] == [None, 1, 2]
        box.value, level.value = False, 2
        c = panel.run_config()
        assert (c.knob_flag, c.knob_level, c.strategy_options) == (False, 2, {"knob_flag": False, "knob_level": 2})
        assert "knobbed (knob_flag=False, knob_level=2)" in panel.validation.value
        panel.strategy.value = "ddp"  # another strategy: its knobs hidden, and not applied
        assert "knob_level" not in _visible(panel)
        assert (panel.run_config().knob_flag, panel.run_config().knob_level) == (True, None)
        with pytest.raises(stnb.ConfigError, match="knob_level=2 is an option of knobbed, not of strategy 'ddp'"):
            stnb.TrainConfig(strategy="ddp", knob_level=2).validate(check_resources=False)
    finally:
        strategies.unregister("knobbed")
    assert "knobbed" not in dict(Panel(**SMALL).strategy.options).values()
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['knob_level'\]"):
        stnb.TrainConfig(knob_level=2)


def test_the_deepspeed_stage_control_reaches_run_config():
    panel = Panel(**SMALL)
    panel.strategy.value = "deepspeed"
    assert _visible(panel) == ["stage", "deepspeed_config"]
    stage = panel.knobs["stage"].widget
    assert [v for _, v in stage.options] == [None, 1, 2, 3] and stage.value is None
    assert panel.run_config().stage is None
    stage.value = 3
    assert panel.run_config().stage == 3 and panel.run_config().strategy == "deepspeed"
    panel.knobs["deepspeed_config"].widget.value = '{"zero_optimization": {"stage": 3}}'
    assert panel.run_config().deepspeed_config == {"zero_optimization": {"stage": 3}}
    panel.knobs["deepspeed_config"].widget.value = "{not json"
    with pytest.raises(stnb.ConfigError, match="deepspeed_config='{not json' is not a dict"):
        panel.run_config()
    panel.knobs["deepspeed_config"].widget.value = ""
    panel.strategy.value = "zero1"  # the stage stays in its widget, and out of zero1's config
    assert panel.run_config().stage is None and "comm_hook" in _visible(panel)
    assert Panel(strategy="deepspeed", stage=1, **SMALL).knobs["stage"].widget.value == 1
    with pytest.raises(stnb.ConfigError, match="stage=5: choose one of 1, 2, 3"):
        Panel(stage=5, **SMALL)


def test_a_knob_typed_in_wrong_is_shown_and_run_stays_off():
    panel = Panel(**SMALL)
    panel.strategy.value = "ddp"
    panel.knobs["bucket_cap_mb"].widget.value = "lots"
    assert panel.run_button.disabled and "bucket_cap_mb=&#x27;lots&#x27; is not a float" in panel.validation.value
    panel.knobs["bucket_cap_mb"].widget.value = "2.5"
    assert panel.run_config().bucket_cap_mb == 2.5
    panel.knobs["comm_hook"].widget.value = "fp16"
    assert panel.run_config().comm_hook == "fp16"
    assert [v for _, v in panel.knobs["comm_hook"].widget.options] == ["none", "fp16", "bf16", "embedding_rows"]
