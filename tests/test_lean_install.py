"""`make lab`, the main job, installs what a student needs and nothing else (CONVENTIONS.md): stnb's dependencies
and its `lab` extra. The engines (DeepSpeed, submitit, Ray) and the developers' tools (Playwright, mutmut,
kaleido) come with `make test`'s `dev` extra, installed on top. Without an engine the course still runs: a
notebook cell that would use one says in a line that it is not installed and how to add it, checked here
with the engine's module hidden (docs/testing.md: the notebooks that touch an engine, run under nbval in a
venv made the way `make lab` makes it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
#: what the course does without: the engines and the developers' tools
NOT_FOR_STUDENTS = {"deepspeed", "ray", "submitit", "playwright", "mutmut", "kaleido"}

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def installs(extra: str | None) -> set:
    """The names pyproject.toml installs with stnb (and ``stnb[extra]``), stnb's own extras followed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names, todo, seen = set(), [Requirement(r) for r in project["dependencies"]], set()
    if extra:
        todo.append(Requirement(f"stnb[{extra}]"))
    while todo:
        req = todo.pop()
        if canonicalize_name(req.name) != "stnb":
            names.add(canonicalize_name(req.name))
            continue
        for name in sorted(req.extras - seen):
            seen.add(name)
            todo.extend(Requirement(r) for r in project["optional-dependencies"][name])
    return names


def test_make_labs_set_holds_no_engine_and_no_developer_tool():
    lab, dev = installs("lab"), installs("dev")
    assert "jupyterlab" in lab
    assert lab & NOT_FOR_STUDENTS == set()
    assert NOT_FOR_STUDENTS <= dev and lab <= dev   # make test: make lab's set and the rest


def test_installs_follows_stnbs_own_extras():
    assert {"pytest", "nbval", "jupyterlab", "deepspeed"} <= installs("dev")
    assert "pytest" not in installs("lab") and "jupyterlab" not in installs(None)


# ---------------------------------------------------------------------- the Makefile's two stamps --

def _make(target: str, venv: Path) -> list:
    """Runs ``make target`` for real against a stand-in venv whose python only logs its arguments:
    the install steps make runs, in order."""
    log = venv / "log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    done = subprocess.run(["make", "--no-print-directory", target, f"VENV={venv}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


@needs_make
def test_make_lab_installs_the_lab_set_and_make_test_adds_the_developers_tools_once(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {venv / "log"}\n')
    python.chmod(0o755)

    lab = _make("lab-install", venv)
    assert [ln.split(" -e ")[-1] for ln in lab if "-m pip install" in ln and " -e " in ln] == ['.[lab]']
    assert any('torch==' in ln for ln in lab) and not any("deepspeed" in ln for ln in lab), lab
    assert _make("lab-install", venv) == []            # once
    dev = _make("install", venv)                       # make test's install step, after make lab
    assert dev == ["-m pip install -c constraints/ci.txt -e .[dev]", "-m stnb.strategies.deepspeed_ops"]
    assert _make("install", venv) == [] and _make("lab-install", venv) == []


@needs_make
def test_make_lab_starts_jupyterlab_after_the_lab_set_only():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    out = subprocess.run(["make", "-n", "--no-print-directory", "lab", "VENV=/nonexistent-stnb-venv"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60).stdout
    assert '-e ".[lab]"' in out and "jupyter lab" in out
    assert ".[dev]" not in out and "deepspeed_ops" not in out, out


# ------------------------------------------------- the notebooks' cells that would use an engine --

def notebook_cell(name: str, starts: str) -> str:
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    found = ["".join(c["source"]) for c in nb["cells"]
             if c["cell_type"] == "code" and "".join(c["source"]).startswith(starts)]
    assert len(found) == 1, (name, starts)
    return found[0]


def test_without_deepspeed_notebook_09_says_it_is_not_installed_and_how_to_add_it(monkeypatch):
    import pandas as pd

    import stnb

    monkeypatch.setitem(sys.modules, "deepspeed", None)   # as where it is not installed
    cell = notebook_cell("09_zero_in_depth_and_deepspeed.ipynb", "ds_ok = stnb.hardware_report()")
    names = {"stnb": stnb, "pd": pd, "runs": {}, "base": None}
    exec(cell, names)
    assert names["runs"] == {}
    assert names["side"].to_dict("records") == [
        {"skipped": "deepspeed", "why": 'DeepSpeed is not installed: pip install "stnb[deepspeed]"'}]


def test_without_submitit_notebook_06_says_it_is_not_installed_and_how_to_add_it(monkeypatch, capsys):
    import stnb

    monkeypatch.setitem(sys.modules, "submitit", None)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))   # and no SLURM command: nothing is submitted
    cell = notebook_cell("06_scaling_out.ipynb", "from pathlib import Path\n\nslurm = stnb.Slurm(")
    names = {"stnb": stnb, "N": 2, "device": "cpu", "cli": "--strategy ddp",
             "cfg": stnb.TrainConfig(strategy="ddp", num_processes=2, model="tiny", steps=2, evaluate=False)}
    exec(cell, names)
    assert names["job"] is None
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ('No SLURM job from here: stnb.Slurm submits with submitit, which is not installed; '
                     'pip install "stnb[slurm]"')
