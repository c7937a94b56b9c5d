"""The notebooks' committed outputs: one workshop-profile run, stamped so a test can tell it is current.

A reader sees results without running anything (fastbook commits its outputs). ``make notebooks``
executes every notebook in place with ``STNB_PROFILE=workshop`` and then stamps each one:

    python tests/notebook_outputs.py --stamp notebooks/0*.ipynb

The stamp (``metadata["stnb"]``) records the profile the run used (as its first cell,
``stnb.setup()``, printed it), when and where the run happened, how long its cells took (the README's
table lists it), and a sha256 of the code cells'
sources. Paths into the Python environment that ran it (warnings name the library file that
raised them) are written as ``<site-packages>/...``: they describe that machine, not the notebook.
``tests/test_notebook_outputs.py`` recomputes that digest: a code cell edited after the run makes
it red until ``make notebooks`` runs again (markdown edits do not: they change no output).

The first code cell, the install cell, is the exception that needs no rerun when only its install lines
changed (the address it installs from, what it says where stnb is missing): they do not run where the
notebooks are executed, stnb being installed there. ``--first-cell`` runs that cell alone in a new kernel
with the workshop profile and records the new digest only when it prints what the committed run printed:

    python tests/notebook_outputs.py --first-cell notebooks/[0-9]*.ipynb
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
import re
import sys

import nbformat

PROFILE = "workshop"
#: an absolute path into an installed package, e.g. /home/me/.venv/lib/python3.11/site-packages/torch/...
INSTALL_PATH = re.compile(r"/[^\s'\"]*/site-packages/")


def code_digest(nb) -> str:
    """sha256 over the sources of the notebook's code cells, in order."""
    sources = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def _redacted(value):
    """``value`` (an output's text, or its JSON data: a plotly figure's hover texts too) with every
    absolute path into installed packages written as ``<site-packages>/``."""
    if isinstance(value, str):
        return INSTALL_PATH.sub("<site-packages>/", value)
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    return value


def redact_install_paths(nb) -> None:
    """In every output, and in the saved widget state (the Panel's figures live there)."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(_redacted(o)) for o in cell.outputs]
    if "widgets" in nb.metadata:
        nb.metadata["widgets"] = nbformat.from_dict(_redacted(nb.metadata["widgets"]))


def run_seconds(nb) -> int | None:
    """How long the committed run took, from its own cells' execution times: the first cell's start to
    the last cell's end (the kernel's start-up not included). None when a cell has no timing."""
    starts, ends = [], []
    for cell in nb.cells:
        if cell.cell_type == "code":
            timing = cell.metadata.get("execution", {})
            if "iopub.execute_input" not in timing or "shell.execute_reply" not in timing:
                return None
            starts.append(datetime.datetime.fromisoformat(timing["iopub.execute_input"].replace("Z", "+00:00")))
            ends.append(datetime.datetime.fromisoformat(timing["shell.execute_reply"].replace("Z", "+00:00")))
    return round((max(ends) - min(starts)).total_seconds()) if starts else None


def profile_seen(nb) -> str | None:
    """The profile the run used, from what its first code cell (``stnb.setup()``) printed."""
    first = next((c for c in nb.cells if c.cell_type == "code"), None)
    text = "".join(o.get("text", "") for o in (first.outputs if first else []) if o.output_type == "stream")
    m = re.search(r"^stnb profile: (\w+)", text, re.M)
    return m.group(1) if m else None


def problems(nb) -> list:
    """Why the notebook's committed outputs are not one complete, current workshop run (empty: they are)."""
    stamp = nb.metadata.get("stnb") or {}
    if not stamp:
        return ["no outputs stamp: run `make notebooks`"]
    out = []
    seen = profile_seen(nb)
    if seen != PROFILE or stamp.get("profile") != seen:
        out.append(f"the outputs are from profile {seen!r} (stamped {stamp.get('profile')!r}), not {PROFILE!r}: "
                   f"run `make notebooks`")
    if stamp.get("code_sha256") != code_digest(nb):
        out.append("a code cell changed after the committed run: run `make notebooks`")
    widgets = nb.metadata.get("widgets")
    if widgets is not None and _redacted(widgets) != widgets:
        out.append("the saved widget state shows an absolute path of the machine that ran it: stamp the notebook "
                   "(python tests/notebook_outputs.py --stamp NOTEBOOK)")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.execution_count is None:
            out.append(f"cell {i} was never executed")
        if any(_redacted(o) != o for o in cell.outputs):
            out.append(f"cell {i} shows an absolute path of the machine that ran it: stamp the notebook "
                       "(python tests/notebook_outputs.py --stamp NOTEBOOK)")
        if any("application/vnd.plotly.v1+json" in o.get("data", {}) and "image/png" not in o.get("data", {})
               for o in cell.outputs):
            out.append(f"cell {i} shows a plotly figure without its PNG, so GitHub shows nothing there: "
                       "run `make notebooks` (STNB_STATIC_FIGURES=1)")
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if errors and not {"raises-exception", "nbval-raises-exception"} & set(cell.metadata.get("tags", [])):
            out.append(f"cell {i} raised {errors[0].ename}: {errors[0].evalue}"[:300])
    return out


def stamp(path: str) -> None:
    nb = nbformat.read(path, as_version=4)
    import stnb

    redact_install_paths(nb)
    nb.metadata["stnb"] = {
        "profile": profile_seen(nb),
        "code_sha256": code_digest(nb),
        "stamped": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "run_seconds": run_seconds(nb),
        "machine": f"{platform.machine()}, {stnb.hardware.cpu_cores()} CPU cores, "
                   f"GPUs: {', '.join(stnb.hardware_report().gpus) or 'none'}",
        "versions": stnb.hardware.versions(),
    }
    found = problems(nb)
    if found:
        raise SystemExit(f"{path}: {'; '.join(found)}")
    nbformat.write(nb, path)


def _shown(outputs) -> list:
    """What a list of outputs shows, consecutive streams of one name joined (a kernel may split them)."""
    out = []
    for o in outputs:
        if o.output_type == "stream" and out and out[-1][:2] == ("stream", o.name):
            out[-1] = ("stream", o.name, out[-1][2] + o.text)
        else:
            out.append((o.output_type, o.get("name"), o.get("text") or json.dumps(o.get("data"), sort_keys=True)))
    return _redacted(out)


def restamp_first_cell(path: str) -> None:
    """The notebook's first code cell, run alone in a new kernel as ``make notebooks`` runs it (the workshop
    profile, offline): when it shows what the committed run showed, the stamp takes the code's new digest and
    nothing else changes; otherwise the notebook needs ``make notebooks``."""
    import os
    from pathlib import Path

    from nbclient import NotebookClient

    import subprocess

    nb = nbformat.read(path, as_version=4)
    # the committed notebook (git's HEAD): a current run, whose other code cells are this one's
    shown = subprocess.run(["git", "show", f"HEAD:./{Path(path).name}"], cwd=Path(path).resolve().parent,
                           capture_output=True, text=True)
    if shown.returncode:
        raise SystemExit(f"{path}: no committed version to compare with ({shown.stderr.strip()})")
    committed = nbformat.reads(shown.stdout, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    if problems(committed) or code[1:] != [c.source for c in committed.cells if c.cell_type == "code"][1:]:
        raise SystemExit(f"{path}: more than its first code cell changed since a current committed run: "
                         "run `make notebooks`")
    first = next(c for c in nb.cells if c.cell_type == "code")
    alone = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(first.source)], metadata=nb.metadata)
    os.environ.update(STNB_PROFILE=PROFILE, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    NotebookClient(alone, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(Path(path).resolve().parent)}}).execute()
    if _shown(alone.cells[0].outputs) != _shown(first.outputs):
        raise SystemExit(f"{path}: the first cell now shows {_shown(alone.cells[0].outputs)}, the committed run "
                         f"{_shown(first.outputs)}: run `make notebooks`")
    nb.metadata["stnb"]["code_sha256"] = code_digest(nb)
    nbformat.write(nb, path)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2 or args[0] not in ("--stamp", "--first-cell"):
        raise SystemExit("usage: python tests/notebook_outputs.py --stamp|--first-cell NOTEBOOK.ipynb ...")
    for p in args[1:]:
        if args[0] == "--stamp":
            stamp(p)
            print(f"stamped {p}")
        else:
            restamp_first_cell(p)
            print(f"{p}: its first cell shows what the committed run showed; digest recorded")
