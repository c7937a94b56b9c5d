"""The course as HTML pages, for readers without Jupyter: ``docs/course/``, built from the committed notebooks.

    python tests/course_html.py [--out docs/course]      (what ``make html`` and ``make notebooks`` run)

Nothing is executed: each page shows a notebook's committed outputs (one stamped workshop-profile run,
tests/notebook_outputs.py), converted with nbconvert's ``basic`` template into a small page of our own (one
shared ``style.css``, no script, nothing fetched from the network). ``index.html`` lists the notebooks in
order with every column of the README's notebook table (what it covers, needs, core or optional path, the workshop
run's compute and the reading time). What a page shows of each output is chosen here, not left to the exporter's defaults:

- a plotly figure: its static PNG (every committed figure carries one, tests/notebook_outputs.py), written to
  ``figures/`` and shown as an image with the figure's title as its text; plotly's JSON is left out (the
  interactive figure needs plotly.js, megabytes that an offline page cannot fetch);
- a widget (stnb's progress bars, the Panel): left out; the bars end as a printed text line, and a cell whose
  only output was a widget says that it is interactive in Jupyter;
- everything else: the richest of HTML, Markdown, an image, plain text (application/* data is left out).

Cells lose their metadata (nbval's tags, execution timings), and links relative to ``notebooks/`` are
rewritten to work from ``docs/course/`` (a notebook's link to another notebook goes to its page). The pages
carry no date or path of the machine that built them: building twice gives the same bytes, so
tests/test_course_html.py can rebuild them into a temporary folder and compare with the committed ones
(under CI's versions of nbconvert, mistune and Pygments: constraints/ci.txt). ``docs/course/`` holds only
what this writes; a build replaces it.
"""

from __future__ import annotations

import argparse
import base64
import copy
import html
import json
import os
import re
import shutil
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
OUT = ROOT / "docs" / "course"
FIGURES = "figures"
#: the output kinds a page may show, richest first (nbconvert picks the first one present)
SHOWN = ("text/html", "text/markdown", "image/svg+xml", "image/png", "image/jpeg", "text/latex", "text/plain")
WIDGET = "application/vnd.jupyter.widget-view+json"
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET_NOTE = ('<p class="note">An interactive widget: it appears when the notebook runs in Jupyter '
               '(<code>make lab</code>).</p>')

STYLE = """\
/* docs/course/style.css: written by tests/course_html.py (make html); edit it there */
body { margin: 0; font: 16px/1.55 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328; }
nav, main, footer { max-width: 1040px; margin: 0 auto; padding: 0 1.25rem; }
nav { display: flex; justify-content: space-between; gap: 1rem; padding-top: .8rem; padding-bottom: .8rem;
      border-bottom: 1px solid #d0d7de; font-size: .95rem; }
footer { margin-top: 3rem; padding-top: 1rem; padding-bottom: 2rem; border-top: 1px solid #d0d7de;
         color: #57606a; font-size: .9rem; }
a { color: #0969da; }
h1, h2, h3 { line-height: 1.25; margin: 1.6em 0 .6em; }
.anchor-link { visibility: hidden; margin-left: .3em; text-decoration: none; }
h1:hover .anchor-link, h2:hover .anchor-link, h3:hover .anchor-link { visibility: visible; }
code, pre { font: 13.5px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
:not(pre) > code { background: #eff1f3; padding: .1em .3em; border-radius: 4px; }
pre { overflow-x: auto; margin: 0; padding: .7em .9em; }
.cell { margin: .9rem 0; }
.input_area pre { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; }
.text_cell_render pre { background: #f6f8fa; border-radius: 6px; }
.output_subarea { margin-top: .4rem; overflow-x: auto; }
.output_text pre, .output_error pre { background: #fff; border-left: 3px solid #d0d7de; white-space: pre-wrap; }
.output_stderr pre { border-left-color: #d4a72c; }
.output_subarea img { max-width: 100%; height: auto; }
table { border-collapse: collapse; margin: .6em 0; font-size: .92rem; }
th, td { border: 1px solid #d0d7de; padding: .3em .6em; text-align: left; vertical-align: top; }
.dataframe td, .dataframe th { text-align: right; }
details { margin: .3em 0 .8em; padding: .3em .8em; border: 1px solid #d0d7de; border-radius: 6px; background: #f6f8fa; }
summary { cursor: pointer; color: #0969da; }
.note { color: #57606a; font-style: italic; }
.highlight .k, .highlight .kn, .highlight .kc, .highlight .kd, .highlight .ow { color: #cf222e; }
.highlight .s, .highlight .s1, .highlight .s2, .highlight .sa, .highlight .si, .highlight .sd { color: #0a3069; }
.highlight .c, .highlight .c1, .highlight .cm { color: #6e7781; font-style: italic; }
.highlight .mi, .highlight .mf, .highlight .m { color: #0550ae; }
.highlight .nf, .highlight .nc, .highlight .fm { color: #8250df; }
.highlight .nb, .highlight .bp { color: #953800; }
.highlight .o { color: #cf222e; }
"""


# ------------------------------------------------------------------------------------------ the syllabus --

def readme_rows(readme: Path | None = None) -> dict:
    """{notebook file name: {column header: cell}} from the README's notebook table (markdown cells), every column
    the README has, named by its header ("What it covers", "Needs", "Path", "Compute", "Reading")."""
    text = (readme or ROOT / "README.md").read_text()
    header, rows = None, {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")] if line.startswith("| ") else None
        if cells and cells[0] == "Notebook":
            header = cells
        elif cells and header and (m := re.match(r"^\[`notebooks/([^`]+\.ipynb)`\]", cells[0])):
            if len(cells) != len(header):
                raise SystemExit(f"the README's row for {m.group(1)} has {len(cells)} cells, its header "
                                 f"{len(header)}: {line}")
            rows[m.group(1)] = dict(zip(header[1:], cells[1:]))
    return rows


def notebook_files(notebooks: Path = NOTEBOOKS) -> list:
    return sorted(notebooks.glob("[0-9][0-9]_*.ipynb"))


def page_name(notebook: Path | str) -> str:
    return Path(notebook).stem + ".html"


def title(nb) -> str:
    """The notebook's first heading, e.g. '03 · DDP from a notebook'."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^# (.+)$", cell.source, re.M)
            if m:
                return m.group(1).strip()
    return "untitled"


# ------------------------------------------------------------------------------------------- the outputs --

def figure_title(output) -> str:
    layout = output.get("data", {}).get(PLOTLY, {}).get("layout", {})
    t = layout.get("title", "")
    return (t.get("text", "") if isinstance(t, dict) else str(t)) or "figure"


def for_reading(nb, stem: str) -> tuple:
    """A copy of ``nb`` with what a page shows of each output (module docstring), and the figures as
    {file name: PNG bytes}."""
    nb = copy.deepcopy(nb)
    nb.metadata = nbformat.from_dict({k: v for k, v in nb.metadata.items() if k in ("kernelspec", "language_info")})
    figures = {}
    for cell in nb.cells:
        cell.metadata = nbformat.from_dict({})
        cell.pop("attachments", None)
        if cell.cell_type != "code":
            continue
        kept, widgets = [], 0
        for output in cell.outputs:
            data = output.get("data")
            if data is None:  # a stream or an error
                kept.append(output)
                continue
            if WIDGET in data:
                widgets += 1
                continue
            if "image/png" in data and PLOTLY in data:
                name = f"{stem[:2]}-{len(figures) + 1}.png"
                figures[name] = base64.b64decode(data["image/png"])
                img = (f'<img src="{FIGURES}/{name}" alt="{html.escape(figure_title(output))}" '
                       f'title="{html.escape(figure_title(output))}">')
                output.data = nbformat.from_dict({"text/html": f'<div class="figure">{img}</div>'})
            else:
                output.data = nbformat.from_dict({k: data[k] for k in SHOWN if k in data})
            output.metadata = nbformat.from_dict({})
            kept.append(output)
        if widgets and not kept:
            kept.append(nbformat.v4.new_output("display_data", data={"text/html": WIDGET_NOTE}))
        cell.outputs = kept
    return nb, figures


# --------------------------------------------------------------------------------------------- the pages --

def _exporter():
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    config = Config()
    config.HTMLExporter.exclude_input_prompt = True
    config.HTMLExporter.exclude_output_prompt = True
    return HTMLExporter(config=config, template_name="basic")


def _relinked(body: str, pages: set) -> str:
    """Links relative to notebooks/ made relative to docs/course/, where the pages live (whatever folder this
    build writes to: a build elsewhere is compared with them); a link to a notebook goes to its page."""

    def fix(m):
        target = html.unescape(m.group(2))
        if re.match(r"^([a-z]+:|#|/)", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        if Path(path).name in pages or path.endswith(".ipynb"):
            new = page_name(path)
        else:
            new = os.path.relpath(os.path.normpath(os.path.join("notebooks", path)), os.path.join("docs", "course"))
            new = new.replace(os.sep, "/")
        return f'{m.group(1)}"{html.escape(new + ("#" + anchor if anchor else ""))}"'

    return re.sub(r'(href=)"([^"]*)"', fix, body)


def _markdown_inline(text: str) -> str:
    """A README table cell (markdown) as HTML, without the paragraph around it."""
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    return re.sub(r"^<p>|</p>\s*$", "", markdown2html_mistune(text).strip())


def _page(head_title: str, nav: str, body: str, footer: str) -> str:
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{html.escape(head_title)}</title>\n<link rel=\"stylesheet\" href=\"style.css\">\n</head>\n"
            f"<!-- written by make html (tests/course_html.py) from the committed notebooks: edit those, then rebuild -->\n"
            f"<body>\n<nav>{nav}</nav>\n<main>\n{body.strip()}\n</main>\n<footer>{footer}</footer>\n</body>\n</html>\n")


def build(out: Path = OUT, notebooks: Path = NOTEBOOKS, readme: Path | None = None) -> list:
    """Write every page, the index, the figures and the stylesheet into ``out`` (replacing what was there);
    return the files written, relative to ``out``."""
    files = notebook_files(notebooks)
    if not files:
        raise SystemExit(f"no notebooks in {notebooks}")
    rows = readme_rows(readme)
    missing = [f.name for f in files if f.name not in rows]
    if missing:
        raise SystemExit(f"the README's notebook table misses {missing}: the index takes each notebook's "
                         "'what it covers' from there")
    exporter = _exporter()
    pages = {f.name for f in files}
    loaded = [nbformat.read(f, as_version=4) for f in files]
    titles = [title(nb) for nb in loaded]
    written = {}
    for i, (path, nb) in enumerate(zip(files, loaded)):
        shown, figures = for_reading(nb, path.stem)
        body, _ = exporter.from_notebook_node(shown)
        body = _relinked(body, pages)
        prev = (f'<a href="{page_name(files[i - 1])}" rel="prev">← {html.escape(titles[i - 1])}</a>'
                if i else "<span></span>")
        nxt = (f'<a href="{page_name(files[i + 1])}" rel="next">{html.escape(titles[i + 1])} →</a>'
               if i + 1 < len(files) else "<span></span>")
        nav = f'{prev}<a href="index.html">The course</a>{nxt}'
        stamp = nb.metadata.get("stnb", {})
        footer = (f"<code>notebooks/{html.escape(path.name)}</code> with its committed outputs: one "
                  f"<code>{html.escape(str(stamp.get('profile', '?')))}</code>-profile run, stamped "
                  f"{html.escape(str(stamp.get('stamped', '?')))}, {html.escape(str(stamp.get('run_seconds', '?')))} s "
                  f"of cells ({html.escape(str(stamp.get('machine', '?')))}). Nothing on this page ran to build it.")
        written[page_name(path)] = _page(f"{titles[i]} · stnb course", nav, body, footer)
        for name, png in figures.items():
            written[f"{FIGURES}/{name}"] = png
    written["index.html"] = _index(files, titles, rows)
    written["style.css"] = STYLE
    if out.exists():
        shutil.rmtree(out)
    for rel, content in written.items():
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    return sorted(written)


def _index(files, titles, rows) -> str:
    lines = ["<h1>stnb: distributed sentence-transformers training, the course</h1>",
             "<p>The notebooks of <code>notebooks/</code>, in reading order, as pages: each with the outputs of "
             "its committed <code>workshop</code>-profile run, so you can read the results without Jupyter and "
             "without running anything. Figures are the static images stored with each plot; widgets (progress "
             "bars, the Panel) work only in Jupyter, and each run's progress ends as a printed line. To run the "
             "notebooks yourself: <code>make lab</code> (the README's quick start).</p>",
             "<table>"]
    columns = list(next(iter(rows.values())))
    lines.append("<thead><tr><th>Notebook</th>" + "".join(f"<th>{html.escape(c)}</th>" for c in columns)
                 + "</tr></thead>")
    lines.append("<tbody>")
    for path, name in zip(files, titles):
        lines.append(f'<tr><td><a href="{page_name(path)}">{html.escape(name)}</a></td>'
                     + "".join(f"<td>{_markdown_inline(rows[path.name][c])}</td>" for c in columns) + "</tr>")
    lines += ["</tbody>", "</table>",
              "<p>Built by <code>make html</code> from the committed notebooks (<code>make notebooks</code> reruns "
              "them and rebuilds these pages); <code>tests/test_course_html.py</code> checks they are current.</p>"]
    nav = '<span></span><a href="index.html">The course</a>' + \
          f'<a href="{page_name(files[0])}" rel="next">{html.escape(titles[0])} →</a>'
    return _page("stnb course", nav, "\n".join(lines), "stnb · the course's notebooks as pages")


# ----------------------------------------------------------------------------- what tests/ check of them --

#: what no page may show: a machine's folders (tests/test_notebook_outputs.py's list, and a home folder)
MACHINE_TEXT = ("/tmp/", "/work/", "/root/", "/home/", "/Users/", "site-packages/torch", "\x1b[")


def checks_shown(text: str) -> list:
    """Traces of the tests in a page: an assert statement in a code cell, nbval's markers or checks."""
    found = []
    if re.search(r'<span class="k">assert</span>', text):
        found.append("an assert statement")
    for word in ("nbval", "NBVAL", "celltag_"):
        if word in text:
            found.append(word)
    return found


def differences(built: Path, committed: Path) -> list:
    """Files that differ between two builds (relative paths, each with why); empty when they are equal."""
    a = {p.relative_to(built).as_posix() for p in built.rglob("*") if p.is_file()}
    b = {p.relative_to(committed).as_posix() for p in committed.rglob("*") if p.is_file()} if committed.exists() else set()
    out = [f"{rel}: not in the committed pages" for rel in sorted(a - b)]
    out += [f"{rel}: committed but no longer built" for rel in sorted(b - a)]
    out += [f"{rel}: differs" for rel in sorted(a & b) if (built / rel).read_bytes() != (committed / rel).read_bytes()]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder to write (default: docs/course)")
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help="folder of the notebooks (default: notebooks)")
    args = parser.parse_args(argv)
    written = build(args.out.resolve(), args.notebooks.resolve())
    pages = [w for w in written if w.endswith(".html")]
    size = sum((args.out / w).stat().st_size for w in written)
    print(f"wrote {len(pages)} pages and {len(written) - len(pages) - 1} figures to {args.out} "
          f"({size / 2**20:.1f} MiB); open {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
