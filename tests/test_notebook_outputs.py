"""The committed notebook outputs are one complete, current workshop-profile run (``make notebooks``):
every code cell executed, none failed unexpectedly, the profile the first cell printed is 'workshop',
and no code cell changed since (tests/notebook_outputs.py)."""

from __future__ import annotations

import json
import re
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


def _figures(path):
    """(code cell, plotly figure JSON) for every figure the notebook's outputs hold."""
    for i, cell in enumerate(_code(path)):
        for o in cell.outputs:
            fig = o.get("data", {}).get("application/vnd.plotly.v1+json")
            if fig:
                yield i, fig


def _texts(fig) -> list:
    layout = fig.get("layout", {})
    texts = [a.get("text") or "" for a in layout.get("annotations", [])]
    for key, value in layout.items():
        if key == "title" or key.startswith(("xaxis", "yaxis")):
            title = value.get("title") if key != "title" else value
            texts.append((title.get("text") if isinstance(title, dict) else title) or "")
    return texts


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_text_on_a_figure_is_cut(path):
    """A note or title cut to fit ('... (measured here: gloo al...' under 06's prediction, 'means of 6 ste)' in its
    title) is wrapped onto more lines instead: no line of a figure's text ends cut with '...' or an ellipsis."""
    cut = [(i, t) for i, fig in _figures(path) for t in _texts(fig)
           if re.search(r"\w(\.\.\.|\u2026)\)?(<br>|$)", t)]
    assert cut == [], f"{path.name}: (code cell, text cut short) {cut}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_vertical_legends_fit_beside_their_plot(path):
    """plotly scrolls a vertical legend taller than the plot area and a PNG shows its top only (05's timeline lost
    'other' and 'communication in flight'): entries x LEGEND_ROW_PX fit the figure's height less its margins."""
    from stnb.plots.timesplit import LEGEND_ROW_PX

    cut = []
    for i, fig in _figures(path):
        layout = fig.get("layout", {})
        legend = layout.get("legend", {})
        entries = [t for t in fig.get("data", []) if t.get("showlegend", True) and t.get("name")]
        if layout.get("showlegend") is False or legend.get("orientation") == "h" or len(entries) < 2:
            continue
        margin = {"t": 100, "b": 80, **layout.get("margin", {})}
        room = (layout.get("height") or 450) - margin["t"] - margin["b"]
        rows = len(entries) + bool((legend.get("title") or {}).get("text"))
        if rows * LEGEND_ROW_PX > room:
            cut.append((i, f"{rows} entries in {room} px"))
    assert cut == [], f"{path.name}: (code cell, legend taller than its plot) {cut}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_log_axes_carry_their_own_labels(path):
    """A log axis over less than a few decades is labelled by plotly with each minor digit ('3 4 5 6 7 8 9 100 2 3',
    06's prediction): stnb's log axes set their tick values and texts (stnb.plots.predict.log_ticks)."""
    bare = [(i, key) for i, fig in _figures(path) for key, axis in fig.get("layout", {}).items()
            if key.startswith(("xaxis", "yaxis")) and axis.get("type") == "log"
            and not (axis.get("tickvals") and (axis.get("ticktext") or key.startswith("xaxis")))]
    assert bare == [], f"{path.name}: (code cell, log axis without its own labels) {bare}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_lines_drawn_on_each_other_are_named(path):
    """04's four strategies drew one line under four legend entries and nothing said why: in stnb's per-step figures
    (and the dashboard's loss panel) every group of lines that lie on each other (stnb.plots.traces.coinciding's
    rule) is named under the title. A notebook's own figures say it in their prose (06's resumed run)."""
    import plotly.graph_objects as go

    from stnb.plots.traces import coinciding

    panels = {"loss_curves": lambda t: True, "dev_curves": lambda t: True, "dashboard": lambda t: t.xaxis == "x4"}
    silent = []
    for i, fig in _figures(path):
        layout = fig.get("layout", {})
        kind = (layout.get("meta") or {}).get("stnb_kind")
        if kind not in panels:
            continue
        said = coinciding([t for t in go.Figure(fig).data if panels[kind](t)])
        if said and said not in (layout.get("title") or {}).get("text", ""):
            silent.append((i, said))
    assert silent == [], f"{path.name}: (code cell, lines drawn as one and not named) {silent}"


def test_log_ticks_follow_the_range():
    from stnb.plots.predict import log_ticks

    assert log_ticks(25, 260) == [30, 50, 100, 200]  # a short range: 1, 2, 3, 5 per decade
    assert log_ticks(2000, 20_000) == [2000, 3000, 5000, 10_000, 20_000]
    assert log_ticks(150, 30_000) == [200, 500, 1000, 2000, 5000, 10_000, 20_000]  # 2.3 decades: 1, 2, 5
    assert log_ticks(2000, 1.5e6) == [3000, 10_000, 30_000, 100_000, 300_000, 1_000_000]  # 2.9 decades: 1, 3
    assert log_ticks(1, 1e6) == [1, 10, 100, 1000, 10_000, 100_000, 1_000_000]
    assert log_ticks(0, 10) == [] and log_ticks(10, 5) == []


def test_the_timeline_is_tall_enough_for_its_legend():
    """Two ranks' four lanes need less height than the eight parts' legend; the figure grows to hold it."""
    from stnb.plots import timesplit as pt

    step = {part: 0.01 for part in pt.PARTS} | {"start": 0.0, "comm_spans": [[0.02, 0.03]]}
    r = {"strategy": "ddp", "world_size": 2, "config": {"warmup_steps_excluded": 0},
         "time_split": [{"steps": [step]}, {"steps": [step]}]}
    fig = pt.timeline(r, steps=1)
    entries = [t for t in fig.data if t.showlegend is not False]
    assert len(entries) == len(pt.PARTS) + 1  # and communication in flight
    room = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    assert len(entries) * pt.LEGEND_ROW_PX <= room
    one = pt.timeline(dict(r, world_size=1, time_split=[{"steps": [{"start": 0.0, "forward": 0.01}]}]), steps=1)
    assert one.layout.height < fig.layout.height  # one part, one rank: no room kept for a legend it lacks


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


def test_a_notebooks_temporary_folders_go_when_nbval_stops_its_kernel(tmp_path):
    """nbval kills a notebook's kernel, so the kernel's exit never removes its ``TemporaryDirectory`` folders (each
    run of notebook 06 left 114 MB in /tmp); the item the repository's conftest.py runs after the last cell removes
    them, as a kernel stopped from Jupyter does. A notebook of one cell, run by nbval with that conftest."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    folder = f"tempfile.TemporaryDirectory(dir={str(scratch)!r})"
    cell = (f"import tempfile\n\nkept = {folder}\nopen(kept.name + '/a', 'w').close()\n"
            f"held = {{'inside': [{folder}]}}")  # one a variable holds, one inside other objects
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)]), tmp_path / "one.ipynb")
    out = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "one.ipynb",
                          "-p", "conftest", "-p", "no:cacheprovider", "-v"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0 and "one.ipynb::kernel stopped PASSED" in out.stdout, out.stdout + out.stderr
    assert list(scratch.iterdir()) == []


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
