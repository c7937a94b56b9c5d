"""The versions stnb runs with (issue 32 item 1): pyproject.toml's ranges, the exact versions of the leg
that runs (constraints/ci.txt for make test, constraints/oldest.txt for make test-oldest), what the oldest
versions refuse, and a pip install that keeps the torch an environment already has."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from standin import clean_env, copy_of

import stnb
from stnb import TrainConfig
from stnb.errors import ConfigError
from stnb.strategies import fsdp

ROOT = Path(__file__).resolve().parents[1]


def _constraints(name: str) -> dict:
    """{canonical name: version} of a constraints file's ``name==version`` lines."""
    out = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            out[canonicalize_name(req.name)] = spec.version
    return out


def test_the_installed_versions_are_the_legs_constraints():
    """make test runs on constraints/ci.txt's versions, make test-oldest on constraints/oldest.txt's (it sets
    STNB_CONSTRAINTS): a leg that drifted from its file would test other versions than it says."""
    name = os.environ.get("STNB_CONSTRAINTS", "constraints/ci.txt").removeprefix("constraints/")
    wrong = []
    for pkg, want in _constraints(name).items():
        have = importlib.metadata.version(pkg)
        # ==2.13.0 takes a local build such as 2.13.0+cpu, as pip does
        if not Requirement(f"{pkg}=={want}").specifier.contains(have, prereleases=True):
            wrong.append(f"{pkg}: {have}, {name} says {want}")
    assert not wrong, "\n".join(wrong)


def test_the_oldest_leg_runs_on_the_lower_bounds():
    """constraints/oldest.txt holds exactly the lower bound of each ranged dependency of stnb and its test
    extra (torch excepted: its CPU wheel, 2.13, is the oldest that installs here; the file says so)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    bounds = {}
    for r in reqs:
        lower = [s.version for s in r.specifier if s.operator == ">="]
        assert not [s for s in r.specifier if s.operator == "=="], f"{r}: a range, not an exact pin"
        if lower:
            bounds[canonicalize_name(r.name)] = lower[0]
    oldest = _constraints("oldest.txt")
    assert set(oldest) == set(bounds), set(oldest) ^ set(bounds)
    differ = {p: (bounds[p], v) for p, v in oldest.items() if Version(v) != Version(bounds[p])}
    assert differ == {"torch": ("2.11", "2.13.0")}, differ
    for core in ("torch", "transformers", "sentence-transformers", "accelerate", "pandas", "plotly"):
        assert core in bounds, f"{core} has no tested lower bound"


def test_fsdp_and_zero2_refuse_a_transformers_without_the_presharded_model_contract(monkeypatch):
    monkeypatch.setattr(fsdp, "installed_transformers", lambda: "5.18.0")
    for strategy in ("fsdp", "zero2"):
        with pytest.raises(ConfigError, match=r"needs transformers >= 5\.19 \(installed: 5\.18\.0\).*"
                                              r"pip install 'transformers>=5\.19'"):
            TrainConfig(strategy=strategy, num_processes=2, model="tiny").validate(check_resources=False)
    monkeypatch.setattr(fsdp, "installed_transformers", lambda: "5.19.0")
    for strategy in ("fsdp", "zero2"):
        TrainConfig(strategy=strategy, num_processes=2, model="tiny").validate(check_resources=False)


@pytest.mark.slow
def test_fsdp_on_the_installed_transformers_runs_or_is_refused_before_any_process_starts(tmp_path):
    """On the oldest leg (transformers 5.17) a fsdp run is refused before it launches; on CI's it trains."""
    config = TrainConfig(strategy="fsdp", num_processes=2, model="tiny", steps=2, train_size=64, dev_size=16,
                         evaluate=False, warmup_steps_excluded=0, per_device_batch_size=4)
    if Version(fsdp.installed_transformers()) < Version(fsdp.NEEDS_TRANSFORMERS):
        with pytest.raises(ConfigError, match="needs transformers >= 5.19"):
            stnb.run(config, results_file=str(tmp_path / "runs.jsonl"), echo=False)
        assert not (tmp_path / "runs.jsonl").exists(), "nothing ran"
    else:
        r = stnb.run(config, echo=False)
        assert r.verified, r.reason


@pytest.mark.slow
def test_pip_install_keeps_the_torch_the_environment_has(tmp_path):
    """A fresh environment that already holds a supported torch other than CI's (2.11.0+cu130, the GPU image's;
    its metadata stands in for the gigabytes): pip's resolver installs stnb and its dependencies around it
    and leaves torch alone (an exact pin of torch 2.13 would have replaced it)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3.*")) / "site-packages"
    info = site / "torch-2.11.0+cu130.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    report = tmp_path / "report.json"
    # this environment's pip, installing into the venv (pip --python): the venv needs no pip of its own
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                           "--dry-run", "--quiet", "--report", str(report), str(ROOT)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    installs = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]}
    assert "stnb" in installs and "transformers" in installs and "sentence-transformers" in installs, installs
    assert "torch" not in installs, f"pip would replace the environment's torch 2.11.0+cu130 by {installs['torch']}"


def _installed(py: str) -> dict:
    """{package: version} in the environment of ``py`` alone: no PYTHONPATH, and run from / (``python -c``
    puts the working folder on sys.path, and pip's build leaves stnb.egg-info in the checkout)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([py, "-c", "import json, importlib.metadata as m; print(json.dumps("
                                    "{d.metadata['Name'].lower(): d.version for d in m.distributions()}))"],
                         capture_output=True, text=True, check=True, env=env, cwd="/")
    return {canonicalize_name(k): v for k, v in json.loads(out.stdout).items()}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_install_cell_keeps_the_runtimes_torch(tmp_path, image_runtime):
    """Every notebook's first cell, on a runtime that already holds torch and the libraries Colab ships (a
    fresh venv, tests/standin.py): its `%pip install` line (IPython runs `python -m pip ...`), with this
    checkout in place of the git URL, installs stnb and replaces nothing the runtime had, torch first
    (the versions of every package before and after)."""
    import shlex

    nb = json.loads((ROOT / "notebooks" / "00_setup_and_hardware.ipynb").read_text())
    cell = "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])
    line = next(ln.strip() for ln in cell.splitlines() if ln.strip().startswith("%pip install"))
    args = shlex.split(line.removeprefix("%pip "))
    source = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Source"]
    assert args[-1] == "stnb @ git+{SOURCE}" and f'SOURCE = "{source}"' in cell, (args, source)
    args[-1] = f"stnb @ {ROOT.as_uri()}"   # this checkout instead of the repository's address

    py = copy_of(image_runtime, tmp_path / "runtime")
    env = clean_env()
    before = _installed(py)
    assert "stnb" not in before and "datasets" not in before
    done = subprocess.run([py, "-m", "pip", *args], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    after = _installed(py)
    assert "stnb" in after and "datasets" in after and "plotly" in after, sorted(after)
    changed = {name: (version, after.get(name)) for name, version in before.items() if after.get(name) != version}
    assert changed == {}, f"the install cell replaced what the runtime had: {changed}"
    imported = subprocess.run([py, "-c", "import stnb, torch; print(torch.__version__)"], capture_output=True,
                              text=True, timeout=300, env=dict(env, STNB_PROFILE="ci"), cwd="/")
    assert imported.returncode == 0 and imported.stdout.strip() == before["torch"], imported.stderr[-2000:]
