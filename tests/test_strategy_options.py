"""A strategy's own options are declared once, in its module (``Strategy.options``: ``stnb.strategies.Option``),
and TrainConfig takes them as flat keywords (issue 44): held in ``strategy_options`` (only what differs from the
default, so equal asks compare equal), read as attributes, written back flat by ``to_dict`` and read by
``from_dict``; the registry refuses a declaration that would be ambiguous; their declared rules are checked
before any process starts."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest

import stnb
from stnb import ConfigError, TrainConfig, strategies
from stnb.strategies import Option, Strategy
from stnb.strategies.ddp import DDP_OPTIONS


def _strategy(name: str, options: dict):
    tunings = options.pop("tunings", {})
    return type(f"S_{name.replace('-', '_')}", (Strategy,), {
        "name": name, "label": name, "summary": "a test's strategy", "options": options, "tunings": tunings,
        "check_prepared": lambda self, trainer, world_size: ({}, []),
        "check_ranks": lambda self, rank_results, world_size: ({}, [])})


def test_each_option_is_declared_by_its_strategies_alone():
    own = {s.name: set(s.options) for s in strategies.all_strategies()}
    assert own["ddp"] == own["zero1"] == {"bucket_cap_mb", "gradient_as_bucket_view", "static_graph",
                                          "broadcast_buffers", "comm_hook"}
    assert own["fsdp"] == {"reshard_after_forward", "fsdp_layer_cls"} and own["zero2"] == {"fsdp_layer_cls"}
    assert own["deepspeed"] == {"stage", "deepspeed_config"} and not own["single"] | own["dp"]
    assert strategies.get("zero1").options is DDP_OPTIONS  # shared as the same declarations
    assert set(strategies.options()) == set().union(*own.values())
    assert strategies.option_owners("fsdp_layer_cls") == ["zero2", "fsdp"]
    # none of them is a TrainConfig field: the config holds them apart, and its signature shows each
    import dataclasses

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not fields & set(strategies.options()) and "strategy_options" in fields
    params = inspect.signature(TrainConfig).parameters
    assert {n: params[n].default for n in strategies.options()} == {n: o.default for n, o in strategies.options().items()}


@pytest.mark.parametrize("options, why", [
    ({"steps": Option(1, "int", "clashes")}, "TrainConfig has a field of that name"),
    ({"comm_hook": Option("none", "str", "another help")}, "strategy ddp / zero1 declares it differently"),
    ({"level": 3}, "it is not a stnb.strategies.Option"),
    ({"level": Option(5, "int", "a level", choices=(1, 2))}, "its default 5 is not one of its choices"),
    ({"level": Option(1, "int", "a level"), "tunings": {"faster": {"level": 2, "comm_hook": "fp16"}}},
     "tuning 'faster' sets comm_hook, which is not an option of its own"),
])
def test_an_ambiguous_option_is_refused_at_registration(options, why):
    try:
        with pytest.raises(TypeError, match=why):
            strategies.register(_strategy("bad-options", options))
        assert "bad-options" not in strategies.names()
    finally:
        strategies.unregister("bad-options")


def test_the_config_holds_only_what_differs_from_the_default():
    asked = TrainConfig(strategy="ddp", comm_hook="fp16", bucket_cap_mb=None, static_graph=False)
    assert asked.strategy_options == {"comm_hook": "fp16"}
    assert asked == TrainConfig(strategy="ddp", strategy_options={"comm_hook": "fp16"})
    assert TrainConfig(comm_hook="none") == TrainConfig()
    assert (asked.comm_hook, asked.bucket_cap_mb, asked.reshard_after_forward) == ("fp16", None, True)
    asked.bucket_cap_mb = 50  # an attribute written goes where it is read from
    assert asked.strategy_options == {"comm_hook": "fp16", "bucket_cap_mb": 50}
    asked.comm_hook = "none"
    assert asked.strategy_options == {"bucket_cap_mb": 50} and "strategy_options={'bucket_cap_mb': 50}" in repr(asked)
    assert asked.replace(stage=None, bucket_cap_mb=25).strategy_options == {"bucket_cap_mb": 25}
    with pytest.raises(AttributeError, match="no attribute 'comm_hok'"):
        asked.comm_hok  # noqa: B018


def test_a_config_keeps_its_options_through_dict_pickle_and_copy():
    cfg = TrainConfig(strategy="deepspeed", stage=3, deepspeed_config={"gradient_clipping": 1.0})
    flat = cfg.to_dict()
    assert "strategy_options" not in flat and (flat["stage"], flat["comm_hook"]) == (3, "none")
    assert set(strategies.options()) <= set(flat)
    assert TrainConfig.from_dict(flat) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg and copy.deepcopy(cfg) == cfg
    assert pickle.loads(pickle.dumps(cfg.run_options)).stage == 3
    with pytest.raises(ConfigError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({**flat, "stagee": 2})
    with pytest.raises(TypeError, match=r"'stagee' -> 'stage'"):
        TrainConfig(stagee=2)


@pytest.mark.parametrize("value, message", [(0, "bucket_cap_mb must be a number > 0, got 0"),
                                            (-2.5, "bucket_cap_mb must be a number > 0, got -2.5"),
                                            ("25", "bucket_cap_mb must be a number > 0, got '25'"),
                                            (True, "bucket_cap_mb must be a number > 0, got True")])
def test_a_positive_option_is_refused_at_zero_or_below_or_not_a_number(value, message):
    for name in ("ddp", "zero1"):
        with pytest.raises(ConfigError, match=message):
            TrainConfig(strategy=name, bucket_cap_mb=value, device="cpu").validate(check_resources=False)
    TrainConfig(strategy="ddp", bucket_cap_mb=2.5, device="cpu").validate(check_resources=False)


def test_what_only_a_gpu_does_is_refused_for_cpu_ranks_by_the_strategy_that_owns_it():
    for name in ("ddp", "zero1"):
        with pytest.raises(ConfigError, match="comm_hook='bf16' needs CUDA GPUs"):
            TrainConfig(strategy=name, comm_hook="bf16").check_device("cpu")
        TrainConfig(strategy=name, comm_hook="bf16").check_device("cuda")
    TrainConfig(strategy=name, comm_hook="fp16").check_device("cpu")


def test_stnb_run_with_a_build_takes_the_options_and_says_so():
    with pytest.raises(ConfigError, match="it takes .*bucket_cap_mb.*deepspeed_config"):
        TrainConfig.for_build(no_such_option=1)
    assert TrainConfig.for_build(strategy="zero1", comm_hook="fp16").comm_hook == "fp16"
    assert stnb.strategies.options()["comm_hook"].choices == ("none", "fp16", "bf16", "embedding_rows")


# the names issue 44 counts: the strategies' options outside the module that declares them
COUNTED = ("comm_hook", "reshard_after_forward", "deepspeed_config", "bucket_cap_mb", "static_graph",
           "gradient_as_bucket_view", "broadcast_buffers", "fsdp_layer_cls")
#: the most uses in code outside stnb/strategies/ (issue 44 asks for at most 10, in at most 2 files): a ratchet,
#: lowered as the strategies take over what they know; what remains is listed in docs/architecture.md
MOST = 2
MOST_FILES = 2


def option_uses() -> dict:
    """{file: uses} of the COUNTED names in the code of stnb/ and stnblab/ outside stnb/strategies/: names,
    attributes, keywords, parameters and string constants (docstrings and comments aside)."""
    import ast
    import re
    from pathlib import Path

    root = Path(stnb.__file__).resolve().parent.parent
    pattern = re.compile(r"\b(" + "|".join(COUNTED) + r")\b")
    uses = {}
    for path in [*(root / "stnb").rglob("*.py"), *(root / "stnblab").rglob("*.py")]:
        if (root / "stnb" / "strategies") in path.parents:
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        n = 0
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                n += len(pattern.findall(node.value))
            else:
                name = getattr(node, "attr", None) or getattr(node, "id", None) or getattr(node, "arg", None)
                n += isinstance(node, (ast.Attribute, ast.Name, ast.keyword, ast.arg)) and name in COUNTED
        if n:
            uses[str(path.relative_to(root))] = n
    return uses


def test_the_option_names_outside_the_strategies_do_not_grow():
    uses = option_uses()
    assert "stnb/config.py" not in uses and "stnb/cli_options.py" not in uses and "stnb/results.py" not in uses
    assert sum(uses.values()) <= MOST, f"{sum(uses.values())} uses of a strategy's option outside stnb/strategies/ " \
                                       f"(at most {MOST}): {uses}"
    assert len(uses) <= MOST_FILES, uses


if __name__ == "__main__":  # python tests/test_strategy_options.py: the count, file by file
    found = option_uses()
    print(sum(found.values()), "in", len(found), "files:", dict(sorted(found.items(), key=lambda kv: -kv[1])))
