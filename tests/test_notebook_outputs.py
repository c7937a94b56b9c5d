"""The committed notebook outputs are one complete, current workshop-profile run (``make notebooks``):
every code cell executed, none failed unexpectedly, the profile the first cell printed is 'workshop',
and no code cell changed since (tests/notebook_outputs.py)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

import notebook_outputs

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("0*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_outputs_are_a_current_workshop_run(path):
    nb = nbformat.read(path, as_version=4)
    assert notebook_outputs.problems(nb) == []


def test_an_edited_code_cell_makes_the_outputs_stale():
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code" and "stnb.launch" in c.source)
    code.source += "\nprint('edited after the run')"
    assert "a code cell changed after the committed run: run `make notebooks`" in notebook_outputs.problems(nb)


def test_outputs_of_another_profile_are_refused():
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    for o in first.outputs:
        if o.output_type == "stream":
            o.text = o.text.replace("stnb profile: workshop", "stnb profile: ci")
    assert any("from profile 'ci'" in p for p in notebook_outputs.problems(nb))


def test_install_paths_of_the_machine_that_ran_it_are_refused_and_redacted():
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    first.outputs.append(nbformat.v4.new_output(
        "stream", name="stderr", text="/home/me/.venv/lib/python3.11/site-packages/torch/x.py:1: UserWarning: w\n"))
    assert any("absolute path of the machine that ran it" in p for p in notebook_outputs.problems(nb))
    notebook_outputs.redact_install_paths(nb)
    assert first.outputs[-1].text == "<site-packages>/torch/x.py:1: UserWarning: w\n"
    assert notebook_outputs.problems(nb) == []


def test_a_figure_without_its_png_is_refused():
    """GitHub's notebook view shows nothing for plotly's JSON: each committed figure carries a PNG of itself."""
    path = next(p for p in NOTEBOOKS if "application/vnd.plotly.v1+json" in p.read_text())
    nb = nbformat.read(path, as_version=4)
    assert notebook_outputs.problems(nb) == []
    figure = next(o for c in nb.cells if c.cell_type == "code" for o in c.outputs
                  if "application/vnd.plotly.v1+json" in o.get("data", {}))
    assert figure.data["image/png"]
    del figure.data["image/png"]
    assert any("plotly figure without its PNG" in p for p in notebook_outputs.problems(nb))
