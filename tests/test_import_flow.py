"""Imports flow one way: no two modules of ``stnb`` or ``stnblab`` import each other, directly or round a longer
loop, counting every import (a lazy one inside a function too: it ties the two files together all the same)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("stnb", "stnblab")


def modules() -> dict:
    """{dotted name: (path, is a package)} of every module of PACKAGES."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imports(name: str, source: str, is_package: bool, known) -> set:
    """The modules among ``known`` that module ``name`` imports (the nearest known module above a name that is
    not a module itself: ``from .a import f`` -> ``a``; ``from . import a`` -> ``a`` where ``a`` is a module)."""
    package = name if is_package else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    found = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def loop(graph: dict) -> list | None:
    """One loop of ``graph`` ({module: modules it imports}): the modules round it, each importing the next (the
    first again at the end), or None. The standard library's topological sorter finds it (it lists a loop from
    importer back to importer, the other way round)."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1][::-1]
    return None


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    assert len(known) > 100, "the packages' modules were not found"
    graph = {name: imports(name, path.read_text(), is_package, known) for name, (path, is_package) in known.items()}
    found = loop(graph)
    assert found is None, f"modules that import each other (round a loop): {' -> '.join(found)}; move what both " \
                          "need into the lower one, or into a module of its own"


def test_the_check_sees_a_lazy_import_that_closes_a_loop():
    """The check itself, on a made-up package: a function-level import back is a loop; one way is none."""
    known = {"p": None, "p.a": None, "p.b": None, "p.c": None}
    a_imports_b = imports("p.a", "from .b import f\n", False, known)
    b_back = imports("p.b", "def g():\n    from .a import h\n", False, known)
    c_from_package = imports("p.c", "from . import a\nimport p.b\n", False, known)
    assert (a_imports_b, b_back, c_from_package) == ({"p.b"}, {"p.a"}, {"p.a", "p.b"})
    assert sorted(set(loop({"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}))) == ["p.a", "p.b"]
    assert loop({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}) in (["p.a", "p.b", "p.c", "p.a"],
                                                                      ["p.b", "p.c", "p.a", "p.b"],
                                                                      ["p.c", "p.a", "p.b", "p.c"])
    assert loop({"p.a": {"p.b"}, "p.b": set(), "p.c": {"p.a", "p.b"}}) is None
