"""nbval runs each notebook's checks (tests/notebook_checks.py) in the notebook's kernel, right after the
cell each one checks: the notebooks themselves hold no assert (GitHub's viewer would show them)."""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path

import pytest


def _checks():
    spec = importlib.util.spec_from_file_location("notebook_checks", Path(__file__).parent / "tests" / "notebook_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.hookimpl(tryfirst=True)  # after tests/conftest.py marks the cells (slow, their xdist group), before xdist
def pytest_collection_modifyitems(session, config, items):
    try:
        from nbval.plugin import IPyNbCell
    except ImportError:  # no nbval: no notebook items either
        return
    cells = [it for it in items if isinstance(it, IPyNbCell)]
    if not cells:
        return
    checks = _checks()
    by_file = collections.defaultdict(list)
    for it in cells:
        by_file[it.parent].append(it)
    for parent, file_items in by_file.items():
        name = Path(str(parent.fspath)).name
        sources = [c.source for c in parent.nb.cells if c.cell_type == "code"]
        for index, check in reversed(checks.anchored(name, sources)):
            after = next((it for it in file_items if it.cell_num == index), None)
            if after is None:  # that cell was deselected: its check cannot run without it
                continue
            import nbformat

            item = IPyNbCell.from_parent(parent, name=f"Cell {index} checks", cell_num=index,
                                         cell=nbformat.v4.new_code_cell(check),
                                         options=collections.defaultdict(bool, check=False))
            for mark in after.own_markers:  # slow, and the xdist group: the check runs in its cell's kernel
                item.add_marker(getattr(pytest.mark, mark.name)(*mark.args, **mark.kwargs))
            items.insert(items.index(after) + 1, item)
