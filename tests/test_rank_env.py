"""One rank set-up for every launcher (issue 44): what a rank's environment says about its device comes from
``hardware.device_env``, with the strategy's variables over it (``launchers.base.rank_env``), whether its ranks are
stnb.launch's, torchrun's / accelerate's, SLURM tasks or Ray workers.

That the set-up reaches each launcher's ranks is pinned by their real runs: the tests' user trainers pass no
``use_cpu=True``, so without ``ACCELERATE_USE_CPU`` each rank would train alone and the run would not be verified
(tests/test_own_training.py, test_scaleout.py, test_cluster_slurm.py, test_cluster_ray.py); DeepSpeed's CPU runs
need the strategy's ``ACCELERATE_USE_CPU=false`` over it (test_deepspeed.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rankfns
import stnb
from stnb.config import TrainConfig
from stnb.hardware import device_env
from stnb.launchers.base import rank_env
from stnb.strategies.base import Strategy

STNB = Path(stnb.__file__).resolve().parent
DEVICE_VARS = ("ACCELERATE_USE_CPU", "OMP_NUM_THREADS", "DS_ACCELERATOR")


def test_a_cpu_rank_sees_no_gpu_and_runs_accelerate_and_deepspeed_on_cpu_with_its_threads():
    assert device_env("cpu", 3) == {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true",
                                    "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "3"}
    assert "OMP_NUM_THREADS" not in device_env("cpu")  # unset: the launcher's own default stays (torchrun: 1)
    assert device_env("cuda", 3) == {}


def test_the_strategys_variables_go_over_the_devices(monkeypatch):
    cfg = TrainConfig(strategy="ddp", model="tiny", threads_per_rank=2)
    assert rank_env(cfg, "cpu") == device_env("cpu", 2)
    monkeypatch.setattr(Strategy, "rank_env", lambda self, config, device: {"ACCELERATE_USE_CPU": "false", "X": "1"})
    env = rank_env(cfg, "cpu")
    assert env["ACCELERATE_USE_CPU"] == "false" and env["X"] == "1" and env["OMP_NUM_THREADS"] == "2"


def test_stnb_launchs_ranks_start_with_the_devices_environment():
    """stnb.launch's own ranks (the notebook's raw launcher too): the device's variables, a caller's env over them."""
    out = stnb.launch(rankfns.read_env, DEVICE_VARS + ("CUDA_VISIBLE_DEVICES",), num_processes=2, device="cpu",
                      threads_per_rank=1, env={"DS_ACCELERATOR": "mine"}, timeout=120)
    assert out == [{"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "mine",
                    "CUDA_VISIBLE_DEVICES": ""}] * 2


def _sets_environ(path: Path) -> set:
    """The DEVICE_VARS a module names as a string literal in code (docstrings and comments aside)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docs
            and n.value in DEVICE_VARS}


@pytest.mark.parametrize("launcher", ["local", "external", "slurm", "ray"])
def test_no_launcher_sets_up_a_rank_by_hand(launcher):
    path = STNB / "launchers" / f"{launcher}.py"
    # external reads torchrun's OMP_NUM_THREADS (threads_per_rank's default there); it sets none
    assert _sets_environ(path) <= ({"OMP_NUM_THREADS"} if launcher == "external" else set())
    tree = ast.parse(path.read_text())
    imported = any(isinstance(n, ast.ImportFrom) and n.module == "base" and n.level == 1
                   and "rank_env" in {a.name for a in n.names} for n in ast.walk(tree))
    called = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "rank_env"
                 for n in ast.walk(tree))  # launchers.base.rank_env itself, not a strategy's method
    assert imported and called


def test_deepspeed_on_cpu_turns_accelerates_cpu_mode_off_over_the_devices_variables(monkeypatch, tmp_path):
    from stnb.strategies import deepspeed_ops
    from stnb.strategies.deepspeed import DeepSpeed

    monkeypatch.setattr(deepspeed_ops, "launch_copy", lambda: str(tmp_path))  # the op's copy: test_deepspeed.py

    ds = TrainConfig(strategy="deepspeed", model="tiny", threads_per_rank=1)
    own = DeepSpeed().rank_env(ds, "cpu")
    env = rank_env(ds, "cpu")
    assert own["ACCELERATE_USE_CPU"] == "false" and "DS_ACCELERATOR" not in own  # the device's, not its own
    assert (env["ACCELERATE_USE_CPU"], env["DS_ACCELERATOR"], env["ACCELERATE_USE_DEEPSPEED"]) == ("false", "cpu", "true")
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


def test_only_the_device_and_the_strategies_name_the_rank_variables():
    """Besides the device's and DeepSpeed's: external reads torchrun's thread count, and scaleout reads
    accelerate launch's CPU mode (to recognise ``accelerate launch --cpu``)."""
    named = {str(p.relative_to(STNB)) for p in STNB.rglob("*.py") if _sets_environ(p)}
    assert named == {"hardware.py", "strategies/deepspeed.py", "launchers/external.py", "scaleout.py"}, named
