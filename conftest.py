"""nbval runs each notebook's checks (tests/notebook_checks.py) in the notebook's kernel, right after the
cell each one checks: the notebooks themselves hold no assert (GitHub's viewer would show them). After a
notebook's last cell, its kernel removes its temporary folders, as a kernel stopped from Jupyter does
(``STOPPED``): nbval kills the kernel, and every run left notebook 06's checkpoints (about 114 MB) in /tmp."""

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


#: what a kernel stopped from Jupyter runs at its exit for the notebook's ``tempfile.TemporaryDirectory`` folders
#: (their finalizers): every live one, whether a variable, a list or an object holds it; nbval's kernel is killed
#: instead, so the item after a notebook's last cell runs it
STOPPED = """import gc as _gc
import tempfile as _tempfile

# type(), not isinstance(): isinstance asks a weak proxy whose object is gone for its class, and raises
for _folder in [o for o in _gc.get_objects() if issubclass(type(o), _tempfile.TemporaryDirectory)]:
    _folder.cleanup()"""


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
            items.insert(items.index(after) + 1, _kernel_item(parent, after, f"Cell {index} checks", check))
        last = max(i for i, it in enumerate(items) if isinstance(it, IPyNbCell) and it.parent is parent)  # checks too
        items.insert(last + 1, _kernel_item(parent, items[last], "kernel stopped", STOPPED))


def _kernel_item(parent, after, name: str, source: str):
    """An item that runs ``source`` in the notebook's kernel right after the cell item ``after``."""
    import nbformat
    from nbval.plugin import IPyNbCell

    item = IPyNbCell.from_parent(parent, name=name, cell_num=after.cell_num, cell=nbformat.v4.new_code_cell(source),
                                 options=collections.defaultdict(bool, check=False))
    for mark in after.own_markers:  # slow, and the xdist group: it runs in its cell's kernel
        item.add_marker(getattr(pytest.mark, mark.name)(*mark.args, **mark.kwargs))
    return item
