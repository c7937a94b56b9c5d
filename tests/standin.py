"""A stand-in for a runtime that already has PyTorch (the GPU image, a Colab runtime): a fresh venv holding
torch (this machine's CPU wheel) and the libraries such images ship, and nothing of stnb's. It is built once
per test session (make test's workers share it, under a file lock), and every test that installs into it gets
its own copy made of hard links: pip replaces files by removing them, so a test's install never reaches the
shared one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# what the GPU image holds (docs/gpu.md) and what Colab ships: torch, transformers 5.17, sentence-transformers
# 6.0.1, accelerate 1.15, pandas, numpy, tqdm, pytest (no datasets, plotly, ipywidgets, nbclient, MiniLM)
IMAGE = ["torch==2.13.0", "transformers==5.17.0", "sentence-transformers==6.0.1", "accelerate==1.15.0", "pandas",
         "numpy", "tqdm", "pytest"]


def clean_env() -> dict:
    """This environment without what would point pip or Python at the test's own environment."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}


def _shared_folder(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: one folder per worker


@pytest.fixture(scope="session")
def image_runtime(tmp_path_factory) -> Path:
    """The stand-in venv, built on first use (pip from the package registry, as the image got it)."""
    from filelock import FileLock

    shared = _shared_folder(tmp_path_factory)
    venv, done = shared / "image-runtime", shared / "image-runtime.done"
    with FileLock(str(shared / "image-runtime.lock")):
        if not done.exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *IMAGE],
                                 capture_output=True, text=True, timeout=900, env=clean_env())
            assert out.returncode == 0, f"the stand-in runtime did not install:\n{out.stderr[-3000:]}"
            done.touch()
    return venv


def copy_of(venv: Path, dest: Path) -> str:
    """A copy of ``venv`` at ``dest`` (hard links; a venv finds its prefix from where its python is);
    returns the copy's python."""
    subprocess.run(["cp", "-al", str(venv), str(dest)], check=True, timeout=300)
    return str(dest / "bin" / "python")
