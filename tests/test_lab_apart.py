"""The core apart from the lab: ``stnb`` (what a notebook user imports) never imports ``stnblab`` (the bench,
the GPU check, the TP/PP demonstrations, the predictor's published-table checks), not even lazily inside a
function; the lab imports the core. ``python -m stnb`` finds the lab's subcommands through the ``stnb.cli``
entry point group instead (docs/architecture.md)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAB = "stnblab"


def _names_the_lab(name) -> bool:
    return isinstance(name, str) and (name == LAB or name.startswith(LAB + "."))


def lab_imports(source: str) -> list:
    """Line numbers where ``source`` imports the lab: an import statement (at any depth, in a function too),
    or ``importlib.import_module`` / ``__import__`` / ``find_spec`` given the lab's name."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(_names_the_lab(a.name) for a in node.names):
            hits.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _names_the_lab(node.module):
            hits.append(node.lineno)
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and _names_the_lab(a.value)
                                                for a in node.args):
            hits.append(node.lineno)
    return hits


def test_no_core_module_imports_the_lab():
    found = {str(p.relative_to(ROOT)): lab_imports(p.read_text()) for p in sorted((ROOT / "stnb").rglob("*.py"))}
    assert len(found) > 50, "the core's modules were not found"
    bad = {p: lines for p, lines in found.items() if lines}
    assert not bad, f"core modules import the lab (stnblab), lines: {bad}; the lab imports the core, never the reverse"


def test_the_ast_check_sees_a_lazy_import_in_a_function():
    """The check itself: an import inside a function, a from-import and a dynamic import are each seen."""
    assert lab_imports("def f():\n    from stnblab import bench\n    return bench\n") == [2]
    assert lab_imports("def f():\n    import stnblab.gpucheck\n") == [2]
    assert lab_imports("import importlib\nimportlib.import_module('stnblab.bench')\n") == [2]
    assert lab_imports("from stnb import bench_frame\nimport stnbx\n") == []


def test_importing_the_core_loads_no_lab_module():
    """``import stnb`` and then every core module: none of the lab's modules is in sys.modules."""
    code = """
import importlib, json, pkgutil, sys
import stnb
after_import = sorted(m for m in sys.modules if m == "stnblab" or m.startswith("stnblab."))
failed = {}
for info in pkgutil.walk_packages(stnb.__path__, "stnb."):
    if info.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as e:  # an optional engine not installed here (deepspeed, submitit, ray)
        failed[info.name] = str(e)
print(json.dumps({"after_import": after_import, "failed": failed,
                  "core": sorted(m for m in sys.modules if m.startswith("stnb.")),
                  "lab": sorted(m for m in sys.modules if m == "stnblab" or m.startswith("stnblab."))}))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == [], f"import stnb loaded lab modules: {seen['after_import']}"
    assert len(seen["core"]) > 50, seen["core"]
    assert not seen["failed"], f"core modules that could not be imported here: {seen['failed']}"
    assert seen["lab"] == [], f"importing the core loaded lab modules: {seen['lab']}"


def test_the_cli_finds_the_labs_subcommands_through_the_entry_point():
    """``python -m stnb``'s parser has the lab's subcommands (bench, gpu-check, predict, split) as users call
    them, registered through the ``stnb.cli`` group that pyproject.toml declares."""
    import tomllib

    from stnb.__main__ import GROUP, extensions

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][GROUP]
    assert declared == {"lab": "stnblab:add_cli"}
    import stnblab

    assert stnblab.add_cli in extensions()
    out = subprocess.run([sys.executable, "-m", "stnb", "--help"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("run", "hardware", "export", "bench", "gpu-check", "predict", "split"):
        assert command in out.stdout.split("positional arguments:")[1], (command, out.stdout)


def sizes() -> dict:
    """Lines and modules of the core, of what a bare ``import stnb`` loads, of the lab, and of ``stnb/processes/``
    (``stnb.launch``'s package, issue 44's "lighter processes/")."""
    code = """
import json, pathlib, sys
import stnb
files = [m.__file__ for n, m in list(sys.modules.items()) if (n == "stnb" or n.startswith("stnb.")) and getattr(m, "__file__", None)]
print(json.dumps(files))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = [Path(f) for f in json.loads(out.stdout.strip().splitlines()[-1])]

    def count(paths):
        paths = sorted(set(paths))
        return sum(len(p.read_text().splitlines()) for p in paths), len(paths)

    return {"core-lines": count((ROOT / "stnb").rglob("*.py")), "import-lines": count(loaded),
            "lab-lines": count((ROOT / LAB).rglob("*.py")),
            "processes-lines": count((ROOT / "stnb" / "processes").rglob("*.py"))}


def stating(lines: int, modules: int) -> str:
    """How the page states a size: lines to the nearest hundred (a one-line edit does not make the page
    wrong), modules exactly."""
    return f"about {round(lines, -2):,} lines in {modules} modules"


SLACK = 150  # lines: the page's rounding (50) plus small edits since it was written


def test_architecture_page_states_the_sizes_as_they_are():
    """docs/architecture.md states the core's size in lines (all of it, and what ``import stnb`` loads) and
    the lab's; each number is recounted here: the module counts exactly, the lines within SLACK."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    stated = dict(re.findall(r"<!-- ([a-z-]+) -->(.*?)<!-- /\1 -->", text))
    now = sizes()
    assert set(stated) == set(now), (stated, now)
    for key, (lines, modules) in now.items():
        found = re.fullmatch(r"about ([\d,]+) lines in (\d+) modules", stated[key])
        assert found, (key, stated[key])
        said_lines, said_modules = int(found[1].replace(",", "")), int(found[2])
        assert said_modules == modules and abs(said_lines - lines) <= SLACK, (
            f"docs/architecture.md's {key} says {stated[key]!r}, the code has {stating(lines, modules)!r}; "
            "python tests/test_lab_apart.py --write updates it")


if __name__ == "__main__":  # python tests/test_lab_apart.py [--write]: print the sizes [and write them into the doc]
    import re

    now = {key: stating(*size) for key, size in sizes().items()}
    print(now)
    if "--write" in sys.argv:
        doc = ROOT / "docs" / "architecture.md"
        doc.write_text(re.sub(r"<!-- ([a-z-]+) -->(.*?)<!-- /\1 -->",
                              lambda m: f"<!-- {m[1]} -->{now[m[1]]}<!-- /{m[1]} -->", doc.read_text()))
