"""The course's HTML pages (docs/course/, ``make html``, tests/course_html.py): every notebook has its page, each
page shows its figures as images and its answers collapsed, no page shows a test check or a machine's path,
the index links every page in reading order, and the pages are current: built from the notebooks as they are (the
pages are not committed: with them the code and the GPU kit no longer fit the 64 MiB that travels to the GPU
machine), byte for byte the same from build to build, and a notebook edited after a build is seen."""

from __future__ import annotations

import os
import re
import shutil
from html.parser import HTMLParser
import subprocess
from pathlib import Path

import nbformat
import pytest

import course_html

ROOT = course_html.ROOT
COURSE = course_html.OUT
NOTEBOOKS = course_html.notebook_files()


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    out = tmp_path_factory.mktemp("course") / "course"
    course_html.build(out)
    return out


def _page(built: Path, path: Path) -> str:
    return (built / course_html.page_name(path)).read_text()


@pytest.mark.slow  # two builds of every page: seconds, not milliseconds
def test_two_builds_give_the_same_pages(rebuilt, tmp_path):
    """No date, path or random id of the build in a page: `make html` twice gives the same bytes (so a page that
    differs says its notebook changed)."""
    again = tmp_path / "course"
    course_html.build(again)
    assert course_html.differences(again, rebuilt) == []


@pytest.mark.slow
def test_a_markdown_edit_without_a_rebuild_is_caught(rebuilt, tmp_path):
    """The deliberate break: one notebook's markdown edited after the pages were built. Only its page differs:
    every other page, built twice, came out byte for byte the same (no date, path or random id of the build
    in a page; otherwise the comparison above would mean nothing)."""
    notebooks = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", notebooks)
    edited = notebooks / NOTEBOOKS[3].name
    nb = nbformat.read(edited, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and "## Summary" in c.source)
    cell.source = cell.source.replace("## Summary", "## Summary\n\nA sentence added after the last build.")
    nbformat.write(nb, edited)
    out = tmp_path / "course"
    course_html.build(out, notebooks)
    assert course_html.differences(out, rebuilt) == [f"{course_html.page_name(edited)}: differs"]


def test_every_notebook_has_its_page_and_the_index_links_them_in_reading_order(rebuilt):
    COURSE = rebuilt
    index = (COURSE / "index.html").read_text()
    links = re.findall(r'<td><a href="([^"]+\.html)">', index)
    assert links == [course_html.page_name(p) for p in NOTEBOOKS]
    assert all((COURSE / link).is_file() for link in links)
    pages = sorted(p.name for p in COURSE.glob("*.html"))
    assert pages == sorted(["index.html"] + [course_html.page_name(p) for p in NOTEBOOKS]), pages


class _Table(HTMLParser):
    """The index's table as rows of cell texts (header row first), read from the HTML as a browser would."""

    def __init__(self):
        super().__init__()
        self.rows, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append(" ".join(self._cell.split()))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _markdown_text(cell: str) -> str:
    """A README table cell as the text a reader sees: links and code marks gone."""
    return " ".join(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell).replace("`", "").replace("**", "").split())


def test_the_index_table_has_the_readmes_columns_in_place(rebuilt):
    """Each column of the index under its own header, as the README's table has it: split here from the README's
    lines directly (not by course_html's parser), so a shifted column (a row read with fewer cells than the
    header) shows as a mismatch."""
    table = _Table()
    table.feed((rebuilt / "index.html").read_text())
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("| ")]
    header = next(ln for ln in lines if ln.startswith("| Notebook |"))
    readme = [[_markdown_text(c.strip()) for c in ln.strip().strip("|").split(" | ")]
              for ln in lines if ln.startswith("| [`notebooks/")]
    want = [_markdown_text(c.strip()) for c in header.strip().strip("|").split(" | ")]
    assert table.rows[0] == want, table.rows[0]
    assert len(table.rows[1:]) == len(NOTEBOOKS) == len(readme)
    for row, source in zip(table.rows[1:], readme):
        assert len(row) == len(want), row
        assert row[1:] == source[1:], (row, source)
        assert row[want.index("Path")] in ("core", "optional"), row


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_page_shows_its_figures_as_images(rebuilt, path):
    """Every plotly figure of the notebook is an <img> of its committed PNG (a file beside the page), with the
    figure's title as its text; no plotly JSON or script that would need plotly.js from the network."""
    nb = nbformat.read(path, as_version=4)
    figures = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if course_html.PLOTLY in o.get("data", {})]
    text = _page(rebuilt, path)
    tags = re.findall(r"<img [^>]*>", text)
    images = [(re.search(r'src="([^"]+)"', t).group(1), re.search(r'alt="([^"]*)"', t).group(1)) for t in tags]
    assert len(images) == len(figures), (path.name, images)
    for (src, alt), figure in zip(images, figures):
        assert (rebuilt / src).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", src
        assert course_html.html.unescape(alt) == course_html.figure_title(figure), (alt, src)
    assert "<script" not in text and "application/vnd.plotly" not in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_page_shows_a_check_or_a_machine_path(rebuilt, path):
    text = _page(rebuilt, path)
    assert course_html.checks_shown(text) == [], path.name
    assert [bad for bad in course_html.MACHINE_TEXT if bad in text] == [], path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_page_shows_the_questions_with_their_answers_collapsed(rebuilt, path):
    nb = nbformat.read(path, as_version=4)
    questions = next(c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## Questions"))
    asked = len(re.findall(r"^\d+\. ", questions, re.M))
    text = _page(rebuilt, path)
    section = text.split('id="Questions"', 1)[1]
    assert section.count("<details><summary>Answer</summary>") == asked
    assert len(re.findall(r"<details><summary>Answer</summary>\s*<p>.+?</p>\s*</details>", section, re.S)) == asked


def test_the_checks_see_what_they_look_for():
    """checks_shown finds an assert cell and nbval's tags when they reach a page."""
    assert course_html.checks_shown('<span class="k">assert</span> <span class="n">x</span>') == ["an assert statement"]
    assert course_html.checks_shown('<div class="cell celltag_nbval-check-output">') == ["nbval", "celltag_"]
    assert course_html.checks_shown("<p>all-reduce</p>") == []


def test_cell_tags_and_widgets_do_not_reach_a_page():
    """for_reading drops the cell metadata (nbval's tags) and the widgets, keeps the text line after them,
    and says where a cell's only output was a widget."""
    nb = nbformat.v4.new_notebook()
    bar = nbformat.v4.new_output("display_data", data={course_html.WIDGET: {"model_id": "x"}, "text/plain": "0%"})
    line = nbformat.v4.new_output("stream", text="ddp: 30/30 steps, 2 ranks, 41 s\n")
    run = nbformat.v4.new_code_cell("r = stnb.run(cfg)", outputs=[bar, line], metadata={"tags": ["nbval-skip"]})
    panel = nbformat.v4.new_code_cell("panel", outputs=[bar])
    nb.cells = [run, panel]
    shown, figures = course_html.for_reading(nb, "03_x")
    assert figures == {} and shown.cells[0].metadata == {} and shown.cells[0].outputs == [line]
    assert shown.cells[1].outputs[0].data == {"text/html": course_html.WIDGET_NOTE}


def test_links_from_notebooks_work_from_the_pages(rebuilt):
    text = _page(rebuilt, next(p for p in NOTEBOOKS if p.name.startswith("06_")))
    assert 'href="../cluster.md"' in text and (ROOT / "docs" / "cluster.md").is_file()  # from docs/course/


# ----------------------------------------------------------------------------------------- the commands --

def _make_n(*args) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    proc = subprocess.run(["make", "-n", "--no-print-directory", *args, "VENV=/nonexistent-stnb-venv"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_html_builds_the_pages_and_make_notebooks_rebuilds_them_after_stamping():
    assert "tests/course_html.py --out docs/course" in _make_n("html")
    lines = _make_n("notebooks", "NB=03").splitlines()
    stamp = next(i for i, ln in enumerate(lines) if "notebook_outputs.py --stamp" in ln)
    assert any("tests/course_html.py --out docs/course" in ln for ln in lines[stamp + 1:]), lines[stamp:]


def test_the_readme_and_contributing_point_to_the_pages():
    readme = (ROOT / "README.md").read_text()
    notebooks_section = readme.split("## Notebooks", 1)[1].split("\n## ", 1)[0]
    assert "docs/course/index.html" in notebooks_section and "make html" in notebooks_section
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert "make html" in contributing and "docs/course/" in contributing
