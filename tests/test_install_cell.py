"""Every notebook's first code cell, the install cell (CONVENTIONS.md), run here in IPython's own shell, each
way it can go: in a clone (`make lab`: stnb importable) it installs nothing; on Colab / Kaggle (stnb missing) it
installs stnb from the one address pyproject.toml names (`[project.urls] Source`) with `%pip`; while that
address is the placeholder, it says in one line what to do instead and stops the notebook there, without a
traceback. `%pip` is recorded, never run; stnb is hidden (`import stnb` fails, as where it is not installed) or
stood in for by a module whose `setup()` returns a marker."""

from __future__ import annotations

import json
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
#: the line of the cell that names the address
ADDRESS = re.compile(r'^    SOURCE = "([^"]*)"', re.M)
PLACEHOLDER = "https://github.com/OWNER/stnb"
PUBLIC = "https://github.com/someone/stnb"
PROFILE = object()  # what the stand-in stnb's setup() returns


def source() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Source"]


def install_cell(path: Path) -> str:
    nb = json.loads(path.read_text())
    return "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])


def with_address(cell: str, address: str) -> str:
    assert len(ADDRESS.findall(cell)) == 1, cell
    return ADDRESS.sub(f'    SOURCE = "{address}"', cell)


def standin() -> types.ModuleType:
    module = types.ModuleType("stnb")
    module.setup = lambda: PROFILE
    return module


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """IPython's shell (its `%` line transformer, a magic's `{variable}` expansion, the error display), with
    `%pip` recorded: the argument line IPython passed it, after expansion; the "install" puts the stand-in
    stnb in place."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])  # the shell puts its own there
    config = Config()
    config.HistoryManager.enabled = False
    sh = InteractiveShell(config=config)
    sh.pip_lines = []

    def pip(line):
        sh.pip_lines.append(line)
        monkeypatch.setitem(sys.modules, "stnb", standin())

    sh.register_magic_function(pip, "line", "pip")
    return sh


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_installs_from_the_address_pyproject_names(path):
    """docs/gpu.md: when the repository gets its address, it goes in pyproject.toml and in these cells."""
    cell = install_cell(path)
    assert ADDRESS.findall(cell) == [source()]
    assert [ln.strip() for ln in cell.splitlines() if ln.strip().startswith("%")] == \
        ['%pip install -q "stnb @ git+{SOURCE}"']


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_in_a_clone_the_cell_installs_nothing(path, shell, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "stnb", standin())
    result = shell.run_cell(install_cell(path))
    assert result.success, result.error_in_exec
    assert shell.pip_lines == [] and shell.user_ns["prof"] is PROFILE
    assert capsys.readouterr().out == ""


def test_while_the_address_is_the_placeholder_the_cell_says_what_to_do_in_one_line_and_stops(shell, monkeypatch,
                                                                                            capsys):
    """Nothing installed, one line printed (no traceback), and the cell fails, so that "Run all" stops there
    instead of failing at the next cell on a name the first never defined."""
    monkeypatch.setitem(sys.modules, "stnb", None)
    result = shell.run_cell(with_address(install_cell(NOTEBOOKS[0]), PLACEHOLDER))
    out = capsys.readouterr().out
    assert shell.pip_lines == []
    assert result.error_in_exec is not None and "prof" not in shell.user_ns
    assert out == ("stnb has no public address yet: clone or upload its repository, run `%pip install -q ./stnb` "
                   "here and this cell again (or `make lab` in the clone)\n")


def test_with_a_public_address_the_cell_installs_stnb_from_it(shell, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "stnb", None)
    result = shell.run_cell(with_address(install_cell(NOTEBOOKS[0]), PUBLIC))
    assert result.success, result.error_in_exec
    assert shell.pip_lines == [f'install -q "stnb @ git+{PUBLIC}"']
    assert shell.user_ns["prof"] is PROFILE and capsys.readouterr().out == ""
