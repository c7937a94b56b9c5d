"""The committed notebook outputs are one complete, current workshop-profile run (``make notebooks``):
every code cell executed, none failed unexpectedly, the profile the first cell printed is 'workshop',
and no code cell changed since (tests/notebook_outputs.py)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

import notebook_outputs

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))  # "0*" left 10 out


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


# ---- readable wherever the notebook is opened (issue 30): what GitHub's viewer shows of the JSON ----------

import base64  # noqa: E402
import re  # noqa: E402

import notebook_checks  # noqa: E402

#: what a reader must not see in a committed output: a machine's folders and terminal colour codes
MACHINE_TEXT = ("/tmp/", "/work/", "/root/", "\x1b[")
#: a stnb progress display's last line (stnb/launchers/bars.py): what a viewer without widgets shows
PROGRESS_LINE = re.compile(r"^\S.*: (\d+)/(\d+) steps, \d+ ranks?, \d+ s", re.M)


def _texts(output) -> list:
    """Every text a viewer may show of one output: streams, plain text, HTML, an error's traceback."""
    out = [output.get("text", "")] + list(output.get("traceback", []))
    for kind, value in output.get("data", {}).items():
        if kind.startswith("text/"):
            out.append(value if isinstance(value, str) else "".join(value))
    return out


def _code(path):
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_show_no_machine_paths_or_escape_codes(path):
    found = [(i, bad) for i, cell in enumerate(_code(path)) for o in cell.outputs for text in _texts(o)
             for bad in MACHINE_TEXT if bad in text]
    assert found == [], f"{path.name}: (code cell, text) {found[:5]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_static_figures_are_about_1000_px_wide(path):
    """Each PNG's width, read from its header (IHDR: bytes 16-20): ~1000 px, so titles and labels fit."""
    widths = [int.from_bytes(base64.b64decode(o.data["image/png"])[16:24][:4], "big")
              for cell in _code(path) for o in cell.outputs if "image/png" in o.get("data", {})]
    assert all(950 <= w <= 1400 for w in widths), f"{path.name}: PNG widths {widths}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_facet_labels_fit_beside_their_panels(path):
    """A facet row's label is written sideways beside its panel: longer than the panel is tall, it runs into the
    next row's (seen in 10: "schedule=gpipe, 4 microbatches" over "schedule=1f1b, ..."). About 7 px a character at
    plotly's 12 px font; the panels share the figure's height less its title and axis (about 160 px)."""
    too_long = []
    for i, cell in enumerate(_code(path)):
        for o in cell.outputs:
            fig = o.get("data", {}).get("application/vnd.plotly.v1+json")
            if not fig:
                continue
            rows = [a for a in fig.get("layout", {}).get("annotations", []) if a.get("textangle") == 90]
            room = ((fig["layout"].get("height") or 500) - 160) / max(1, len(rows))
            too_long += [(i, a["text"]) for a in rows if 7 * len(a["text"]) > room]
    assert too_long == [], f"{path.name}: (code cell, facet label longer than its panel) {too_long}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_progress_bars_end_as_a_text_line(path):
    """A cell with stnb's per-rank bars (a widget) also prints the run's last line, e.g. 'ddp: 30/30 steps,
    2 ranks, 41 s'; and each bar's saved text, what a viewer without widgets shows (GitHub, nbconvert's
    HTML), is the bar as it ended (stnb.launchers.bars updates it on close), never the 0 % it started at."""
    for i, cell in enumerate(_code(path)):
        bars = [o for o in cell.outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
                and re.search(r" rank \d+:", o.data.get("text/plain", ""))]
        lines = PROGRESS_LINE.findall("".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"))
        if bars:
            assert lines, f"{path.name} code cell {i}: {len(bars)} progress bar(s), no text line saying how they ended"
        stuck = [o.data["text/plain"] for o in bars if re.search(r"\b0/\d+ ", o.data["text/plain"])]
        assert not stuck, f"{path.name} code cell {i}: bars saved as they started: {stuck}; re-stamp it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_check_follows_one_cell(path):
    """tests/notebook_checks.py: each check's anchor matches exactly one code cell of the notebook."""
    sources = [c.source for c in _code(path)]
    hits = notebook_checks.anchored(path.name, sources)
    assert len(hits) == len(notebook_checks.CHECKS.get(path.name, []))


def test_a_check_whose_cell_is_gone_is_an_error():
    path = next(p for p in NOTEBOOKS if p.name in notebook_checks.CHECKS)
    sources = [c.source for c in _code(path)]
    anchor = notebook_checks.CHECKS[path.name][0][0]
    with pytest.raises(ValueError, match="matches 0 code cells"):
        notebook_checks.anchored(path.name, [s for s in sources if not s.startswith(anchor)])


def _parity_rows(text: str) -> dict:
    """{strategy: (verified, overall, passed)} from a printed ``Parity.table``'s columns (strategy,
    verified, parameters, over_tolerance, overall, passed)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\s*(.+?)\s+(True|False)\s+(\d+)\s+(\d+)\s+(\S+)\s+(True|False)\s*$", line)
        if m:
            rows[m.group(1)] = (m.group(2) == "True", float(m.group(5)), m.group(6) == "True")
    return rows


def test_05_shows_the_strategies_equal_without_dropout_and_apart_with_it():
    """05's committed (workshop, MiniLM) run: with dropout off, DDP, ZeRO-1, ZeRO-2 and FSDP end within
    1 % of how far training moved the weights from one device; with dropout kept, DDP does not."""
    path = next(p for p in NOTEBOOKS if p.name.startswith("05_"))
    cells = _code(path)
    printed = {c.source.split("\n")[0]: "".join(o.get("text", "") for o in c.outputs) for c in cells}
    off = next(t for s, t in printed.items() if s.startswith("strategies = ["))
    kept = next(t for s, t in printed.items() if s.startswith("kept = stnb.parity("))
    assert off.startswith("dropout off: PASSED"), off
    rows = _parity_rows(off)
    assert {"ddp", "zero1", "zero2", "fsdp"} <= set(rows), off
    for name in ("ddp", "zero1", "zero2", "fsdp"):
        verified, overall, passed = rows[name]
        assert verified and passed and overall < 0.01, (name, off)
    assert re.match(r"dropout 0\.1: FAILED", kept), kept
    verified, overall, passed = _parity_rows(kept)["ddp"]
    assert verified and not passed and overall > 10 * rows["ddp"][1], kept


def test_first_cell_restamp_refuses_a_notebook_with_another_code_cell_changed(tmp_path):
    """``--first-cell`` records a new digest without rerunning only when the first code cell alone changed since
    the committed (HEAD) notebook; any other code cell edited needs ``make notebooks``, before any kernel starts."""
    import shutil
    import subprocess

    path = tmp_path / NOTEBOOKS[0].name
    shutil.copy(NOTEBOOKS[0], path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(git + ["add", path.name], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-qm", "run"], cwd=tmp_path, check=True)
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    code[0].source += "\n"
    code[1].source += "\nprint('edited after the run')"
    nbformat.write(nb, path)
    with pytest.raises(SystemExit, match="more than its first code cell changed since a current committed run: "
                                         "run `make notebooks`"):
        notebook_outputs.restamp_first_cell(str(path))
    assert nbformat.read(path, as_version=4).metadata["stnb"] == nb.metadata["stnb"]   # nothing recorded
