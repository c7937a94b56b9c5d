"""One validation for every launcher (issue 44): stnb.launch's, torchrun's / accelerate's, SLURM's and Ray's
checks each settle the world and the device, then run ``launchers.base.check_plan``: the options the build
takes, the config, the launcher's check of the hardware its ranks get, the build's inputs, the files the run
writes, in that one order. Each launcher's own parameters and its cluster are its own (tests/test_cluster_*.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stnb
from stnb.config import TrainConfig
from stnb.launchers import external, rundir
from stnb.launchers.base import Plan
from stnb.launchers.local import Local

STNB = Path(stnb.__file__).resolve().parent
ORDER = ["options", "config", "machine", "inputs", "results file", "save target"]


class RecordingBuild:
    def __init__(self, calls):
        self.calls = calls

    def check(self, config):
        self.calls.append("options")

    def check_inputs(self, config):
        self.calls.append("inputs")


@pytest.fixture
def calls(monkeypatch):
    out = []
    monkeypatch.setattr(TrainConfig, "validate", lambda self, **kw: out.append("config"))
    for name in ("check_hardware", "check_device"):
        monkeypatch.setattr(TrainConfig, name, lambda self, *a: out.append("machine"))
    monkeypatch.setattr(external, "check_here", lambda *a: out.append("machine"))
    monkeypatch.setattr("stnb.results.check_writable", lambda path: out.append("results file"))
    monkeypatch.setattr("stnb.saving.check_target", lambda target: out.append("save target"))
    return out


def _plan(calls, **kw):
    return Plan(TrainConfig(strategy="ddp", model="tiny", device="cpu", **kw), RecordingBuild(calls),
                results_file="results.jsonl")


def test_every_launcher_checks_a_plan_in_one_order(calls):
    Local().check(_plan(calls))
    assert calls == ORDER
    calls.clear()
    plan = _plan(calls, num_processes=2)
    rundir.check_cluster_plan(plan, "SLURM", 2, "cpu", "nodes * tasks_per_node", 1)  # SLURM's and Ray's
    assert calls == ORDER and (plan.device, plan.config.threads_per_rank) == ("cpu", 1)
    for rank, writes in ((0, ORDER), (1, ORDER[:4])):  # torchrun's rank 0 writes the files, the others do not
        calls.clear()
        env = {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        plan = _plan(calls)
        external.External(env).check(plan)
        assert calls == writes and plan.config.num_processes == 2 and plan.device == "cpu"


def test_no_launcher_validates_by_itself():
    """What check_plan does is called nowhere else in stnb/launchers/: a launcher cannot skip or reorder it."""
    for path in (STNB / "launchers").glob("*.py"):
        if path.name == "base.py":
            continue
        tree = ast.parse(path.read_text())
        called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
                  for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert not called & {"validate", "check_inputs", "check_writable", "check_target"}, path.name


def test_only_stnbs_own_launcher_puts_several_ranks_on_a_gpu():
    """share_gpus=True is refused by torchrun's and the clusters' checks, naming the launcher, before anything
    starts: their ranks get a GPU each, and a flag that means nothing there is not dropped silently."""
    from stnb.builds import RecipeBuild
    from stnb.errors import ConfigError

    def plan():
        return Plan(TrainConfig(strategy="ddp", model="tiny", device="cpu", share_gpus=True), RecipeBuild())

    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    launcher = external.External(env)
    with pytest.raises(ConfigError, match=f"share_gpus=True puts several ranks.*under {launcher.name}"):
        launcher.check(plan())
    for engine in ("SLURM", "Ray"):
        with pytest.raises(ConfigError, match=f"only stnb's own launcher.*under {engine} each rank"):
            rundir.check_cluster_plan(plan(), engine, 2, "cpu", "nodes * tasks_per_node", 1)
    Local().check(plan())  # on CPU a permission with nothing to share: the run goes on
