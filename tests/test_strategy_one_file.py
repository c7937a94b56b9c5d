"""A strategy is one file: ``HalfBytes``, made up in this file alone (DDP under another name, with its own
colour, bench and GPU-check rows, its own step-cost model: half DDP's all-reduced bytes, and an option of its
own, ``half_level``), registered, is in ``stnb.run`` (a real 2-rank run, verified, its option reaching the
ranks), the Panel's strategy picker and option widgets, the command line's options, ``stnb.predict`` on that
run (table and figure), the bench's plan and the GPU check's plan; unregistered, it is in none of them and its
option is refused. No other file knows it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import stnb
from stnb import ConfigError, strategies
from stnblab.bench import BenchOptions, plan as bench_plan
from stnblab.gpucheck import plan as gpu_plan
from stnblab.gpucheck.planning import Machine
from stnb.strategies import Option
from stnb.strategies.ddp import DDP_OPTIONS, DistributedDataParallel, ddp_step

NAME = "half-ddp"
RUN = dict(num_processes=2, model="tiny", per_device_batch_size=4, steps=5, warmup_steps_excluded=1,
           evaluate=False, threads_per_rank=1, timeout=300, device="cpu")
H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2 ** 30, "compute_capability": [9, 0]}
TWO_GPUS = Machine(gpus=[dict(H100, index=i) for i in range(2)], torch_cuda="12.8", arch_list=["sm_90"],
                   notebook="nb.ipynb")


class HalfBytes(DistributedDataParallel):
    """DDP that trains as DDP, predicted as if its gradients travelled in half the bytes (a made-up model)."""
    name = NAME
    label = "DDP, half the bytes"
    summary = "DDP under another name whose cost model all-reduces half the gradient bytes (a test's strategy)"
    color = "#123456"
    bench = True
    gpu_check = True
    options = {**DDP_OPTIONS, "half_level": Option(1, "int", "a made-up level each rank reports", choices=(1, 2, 3))}

    def prepare(self, trainer, config, device_type, world):
        out = super().prepare(trainer, config, device_type, world)
        return dict(out, info={**out["info"], "half_level": config.half_level})  # what this rank was given

    def step_time(self, m, fab, n, host_fraction=None):
        r = ddp_step(replace(m, grad_bytes=m.grad_bytes / 2), fab, n)
        return dict(r, note="gradients in half the bytes")


def _cli(*argv):
    import argparse

    from stnb.cli_options import add_run_options, config_from_args

    parser = argparse.ArgumentParser()
    add_run_options(parser)
    return config_from_args(parser.parse_args(list(argv)))


def _everywhere(result) -> dict:
    """Where the strategy shows, each place asked the way a user or the lab asks it (``result``: a run to
    predict from)."""
    from stnb.widgets import Panel

    panel = Panel(train_size=64, dev_size=16)
    return {"panel": NAME in dict(panel.strategy.options).values(), "option widget": "half_level" in panel.knobs,
            "predictor": NAME in set(stnb.predict(result, devices=[2], link="pcie4").table["strategy"]),
            "bench": any(it.config.strategy == NAME for it in bench_plan(BenchOptions.from_preset("quick"))),
            "gpu-check": any(c.params.get("strategy") == NAME for c in gpu_plan(TWO_GPUS)),
            "option": "half_level" in stnb.strategies.options()}


def test_a_made_up_strategy_in_one_file_is_in_run_panel_predictor_bench_and_gpu_check():
    strategies.register(HalfBytes)
    try:
        r = stnb.run(stnb.TrainConfig(strategy=NAME, half_level=3, **RUN), echo=False)
        assert r.verified, r.reason
        assert (r.strategy, r.world_size, r.config["half_level"]) == (NAME, 2, 3)
        assert [v["half_level"] for v in r.verification["ranks"]] == [3, 3]  # each rank was given the option
        assert _everywhere(r) == {"panel": True, "option widget": True, "predictor": True, "bench": True,
                                  "gpu-check": True, "option": True}

        # its option is declared once, in its class, and everything that offers options offers it
        cli = _cli("--strategy", NAME, "--half-level", "2")
        assert (cli.strategy, cli.half_level, cli.strategy_options) == (NAME, 2, {"half_level": 2})
        assert _cli().half_level == 1  # its declared default
        from stnb.widgets import Panel

        panel = Panel(train_size=64, dev_size=16)
        panel.strategy.value = NAME
        panel.knobs["half_level"].widget.value = 2
        assert panel.knobs["half_level"].widget.layout.display is None  # shown beside DDP's options
        assert panel.run_config().half_level == 2
        with pytest.raises(ConfigError, match="unknown half_level 5; choose one of 1, 2, 3"):
            stnb.TrainConfig(strategy=NAME, half_level=5).validate(check_resources=False)
        with pytest.raises(ConfigError, match=f"half_level=2 is an option of {NAME}, not of strategy 'ddp'"):
            stnb.TrainConfig(strategy="ddp", half_level=2).validate(check_resources=False)

        # the predictor used its model, not DDP's: the same ring all-reduce over half the bytes
        pred = stnb.predict(r, devices=[2, 4], link="pcie4")
        mine, ddp = pred.row(NAME, 4), pred.row("ddp", 4)
        fab, grad = pred.fabric, pred.measured.grad_bytes
        assert ddp["comm_ms"] == pytest.approx(1e3 * fab.all_reduce(grad, 4))
        assert mine["comm_ms"] == pytest.approx(1e3 * fab.all_reduce(grad / 2, 4))
        assert mine["comm_ms"] < ddp["comm_ms"]
        assert mine["note"] == "gradients in half the bytes" and ddp["note"] == ""
        line = next(t for t in pred.figure.data if t.name == NAME)
        assert line.line.color == HalfBytes.color

        # the bench's sweep and the GPU check give it the rows a distributed strategy gets
        sweep = [it.name for it in bench_plan(BenchOptions.from_preset("quick", sections=("sweep",)))]
        assert f"{NAME} x2 b16" in sweep
        rows = {c.name: c for c in gpu_plan(TWO_GPUS)}
        assert rows[f"{NAME} x2 bf16"].params["num_processes"] == 2
        assert rows[f"{NAME} x1 nccl bf16"].skip  # one rank is never wrapped in DDP (as for ddp)
        assert {f"{NAME} x2 bf16 hook {h}" for h in ("fp16", "bf16", "embedding_rows")} <= set(rows)
    finally:
        strategies.unregister(NAME)
    # the same run, read as the DDP run it was (its own name is unknown now, so nothing predicts from it)
    assert _everywhere(dict(r.to_dict(), strategy="ddp")) == {"panel": False, "option widget": False,
                                                              "predictor": False, "bench": False,
                                                              "gpu-check": False, "option": False}
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['half_level'\]"):
        stnb.TrainConfig(strategy="ddp", half_level=2)
    with pytest.raises(ConfigError, match=f"unknown strategy '{NAME}'"):
        stnb.predict(r, devices=[2], link="pcie4")
    with pytest.raises(ConfigError, match=f"unknown strategy '{NAME}'"):
        stnb.TrainConfig(strategy=NAME, **RUN).validate(check_resources=False)


def test_the_registry_finds_a_strategy_by_its_module(tmp_path, monkeypatch):
    """What the registry does with stnb/strategies/ at import, on a package made here: a module defining a
    strategy class is found (imported names and helpers are not), in ``order`` (not the modules' order); the
    built-ins are exactly the classes stnb/strategies/ defines, in the registry's order."""
    import sys

    pkg = tmp_path / "madeup_strategies"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a_late.py").write_text(
        "from stnb.strategies.ddp import DistributedDataParallel\n"        # imported: not this module's
        "class Late(DistributedDataParallel):\n    name, order = 'late', 90\n"
        "class Helper(DistributedDataParallel):\n    pass\n")                # no name of its own
    (pkg / "b_early.py").write_text(
        "from stnb.strategies.single import Single\n"
        "class Early(Single):\n    name, order = 'early', 5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = strategies.find_strategies([str(pkg)], "madeup_strategies")
        assert [c.name for c in found] == ["early", "late"]
    finally:
        for m in [m for m in sys.modules if m.startswith("madeup_strategies")]:
            del sys.modules[m]
    builtins = strategies.find_strategies(strategies.__path__, strategies.__name__)
    assert [c.name for c in builtins] == list(strategies.names())
    assert [type(s) for s in strategies.all_strategies()] == builtins
    orders = [s.order for s in strategies.all_strategies()]
    assert orders == sorted(orders) and strategies.names()[0] == strategies.baseline_name()
