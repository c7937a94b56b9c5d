"""Project-level checks: dependency ranges and CI's constraints, environment.yml, Makefile, CI entry point, README."""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

# Dependencies without a lower bound (any version does). Everything else names the oldest tested one.
UNBOUNDED_OK = {"tqdm", "psutil", "pytest-timeout", "pyyaml"}
# Exact pins in pyproject.toml, each for a known break (the comment beside it says which).
EXACT_OK = {"mutmut"}

TOKEN_DISABLERS = (
    "--ServerApp.token=''",
    '--ServerApp.token=""',
    "--ServerApp.token= ",
    "--NotebookApp.token",
    "--IdentityProvider.token=''",
    '--IdentityProvider.token=""',
    "--IdentityProvider.token= ",
    "--ServerApp.password",
    "--ServerApp.disable_check_xsrf",
)


# ------------------------------------------------------------------ helpers --

def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _requirements() -> list[Requirement]:
    """stnb's dependencies and its lab, test and dev extras (not the extras' reference to stnb itself)."""
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    reqs = list(project["dependencies"]) + list(extras["lab"]) + list(extras["test"]) + list(extras["dev"])
    return [Requirement(r) for r in reqs if canonicalize_name(Requirement(r).name) != "stnb"]


def _pin(req: Requirement) -> str | None:
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator == "==":
        return specs[0].version
    return None


def _ci_constraints() -> dict:
    """{canonical name: version} of constraints/ci.txt (CI's exact versions, make install's -c)."""
    out = {}
    for line in (ROOT / "constraints" / "ci.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert _pin(req), f"constraints/ci.txt: {line!r} is not name==version"
            out[canonicalize_name(req.name)] = _pin(req)
    return out


def _torch_pin() -> str:
    """The torch CI installs (the Makefile's TORCH_VERSION), inside pyproject.toml's torch range."""
    torch = [r for r in _requirements() if canonicalize_name(r.name) == "torch"]
    assert len(torch) == 1, "pyproject.toml must name torch exactly once"
    version = _makefile_default("TORCH_VERSION")
    assert torch[0].specifier.contains(version), f"TORCH_VERSION={version} is outside pyproject.toml's {torch[0]}"
    return version


def _makefile() -> str:
    return (ROOT / "Makefile").read_text()


def _makefile_default(var: str) -> str:
    m = re.search(rf"^{var}\s*\??=\s*(\S+)\s*$", _makefile(), re.M)
    assert m, f"Makefile must define a default for {var}"
    return m.group(1)


def _recipe(target: str) -> str:
    """The recipe lines (tab-indented) of a Makefile rule whose targets include `target`."""
    lines = _makefile().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^([^\t#=:][^=:]*):(?!=)", line)
        if m and target in m.group(1).split():
            body = []
            for nxt in lines[i + 1:]:
                if nxt.startswith("\t"):
                    body.append(nxt[1:])
                elif nxt.strip() == "" or nxt.lstrip().startswith("#"):
                    continue
                else:
                    break
            return "\n".join(body)
    raise AssertionError(f"Makefile has no rule for {target!r}")


def _env_yml() -> dict:
    with open(ROOT / "environment.yml") as f:
        return yaml.safe_load(f)


def _env_pip_entries() -> list[str]:
    deps = _env_yml()["dependencies"]
    pip_sections = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1, "environment.yml needs exactly one pip: section"
    return [str(e).strip() for e in pip_sections[0]]


def _make_dry_run(target: str) -> str:
    # A VENV that does not exist makes make print the install steps too, but runs nothing.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", target, "VENV=/nonexistent-stnb-venv"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


# ------------------------------------------------------ (a) environment.yml --

def test_environment_yml_installs_project_with_dev_extras():
    env = _env_yml()
    assert env["name"] == "stnb"
    assert "conda-forge" in env["channels"]
    entries = [re.sub(r"\s+", " ", e).replace('"', "").replace("'", "") for e in _env_pip_entries()]
    assert "-e .[dev]" in entries, f"environment.yml must pip install '-e .[dev]', has {entries}"


def test_environment_yml_torch_matches_pyproject_and_makefile():
    torch = [e for e in _env_pip_entries() if re.match(r"^torch\s*==", e)]
    assert len(torch) == 1, "environment.yml must name torch==<version> once in its pip section"
    env_version = torch[0].split("==", 1)[1].strip()
    assert env_version == _torch_pin(), "environment.yml torch differs from the Makefile's TORCH_VERSION"
    assert "-c constraints/ci.txt" in _env_pip_entries(), "environment.yml installs CI's versions too"


def test_environment_yml_does_not_repeat_versions():
    """pyproject.toml is the single source of truth: only python, pip, torch and the project."""
    deps = _env_yml()["dependencies"]
    conda_names = sorted(re.split(r"[=<>!~ ]", d, maxsplit=1)[0] for d in deps if isinstance(d, str))
    assert conda_names == ["pip", "python"], f"unexpected conda dependencies {conda_names}"
    python = [d for d in deps if isinstance(d, str) and d.startswith("python")][0]
    m = re.match(r"python\s*=+\s*(\d+)\.(\d+)", python)
    assert m and (int(m.group(1)), int(m.group(2))) >= (3, 10), python
    for entry in _env_pip_entries():
        assert entry.startswith(("-e", "-c constraints/", "torch==")), f"environment.yml repeats a dependency: {entry!r}"


# ------------------------------------------ (b) the ranges and CI's versions --

def test_every_dependency_is_a_range_with_a_tested_lower_bound():
    """Ranges, so that an environment's own torch, transformers, pandas... stay (issue 32); the lower bounds
    are what make test-oldest runs (tests/test_versions.py)."""
    exact = [str(r) for r in _requirements() if _pin(r) and canonicalize_name(r.name) not in EXACT_OK]
    assert not exact, f"exact pins in pyproject.toml belong in constraints/ci.txt: {exact}"
    unbounded = [str(r) for r in _requirements() if canonicalize_name(r.name) not in UNBOUNDED_OK | EXACT_OK
                 and not any(s.operator == ">=" for s in r.specifier)]
    assert not unbounded, f"name the oldest tested version (>=) of: {unbounded}"


def test_allow_lists_are_only_the_small_utilities():
    names = {canonicalize_name(r.name) for r in _requirements()}
    assert UNBOUNDED_OK | EXACT_OK <= names, f"allow-list names missing from pyproject.toml: {(UNBOUNDED_OK | EXACT_OK) - names}"


def test_ci_constraints_pin_every_dependency_inside_its_range():
    """constraints/ci.txt (make install's -c) holds one exact version of every dependency but torch (the
    Makefile's TORCH_VERSION), each inside pyproject.toml's range."""
    ci = _ci_constraints()
    problems = []
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name not in ci, "torch is the Makefile's TORCH_VERSION, not a constraint"
        elif name not in ci:
            problems.append(f"{req.name}: not in constraints/ci.txt")
        elif not req.specifier.contains(ci[name], prereleases=True):
            problems.append(f"{req}: constraints/ci.txt says {ci[name]}")
    assert not problems, "\n".join(problems)
    assert "stnb" not in ci


def test_pins_resolve_together_and_match_installed():
    """What pip resolved lies inside every range pyproject.toml declares."""
    problems = []
    for req in _requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            installed = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req.name}: not installed")
            continue
        # Specifier matching: ==2.13.0 accepts local builds such as 2.13.0+cpu / +cu128.
        if not req.specifier.contains(installed, prereleases=True):
            problems.append(f"{req}: installed {installed}")
    assert not problems, "installed versions outside pyproject.toml's ranges:\n" + "\n".join(problems)


def test_requires_python_and_readme():
    project = _pyproject()["project"]
    assert project["requires-python"] == ">=3.10"
    assert (ROOT / project["readme"]).is_file()


# ------------------------------------------------------ (c) CI and README --

def test_ci_run_calls_make_test():
    ci = ROOT / ".ci" / "run"
    assert ci.is_file()
    assert os.access(ci, os.X_OK), ".ci/run must be executable"
    text = ci.read_text()
    assert text.startswith("#!"), ".ci/run needs a shebang"
    assert "set -euo pipefail" in text
    code = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert "make test" in code, ".ci/run must run exactly `make test` (the README's test command)"
    assert "make mutants-sample" in code, ".ci/run runs the fixed-seed mutation sample (issue 19, docs/testing.md)"
    assert "make test-oldest" in code, ".ci/run runs the oldest-versions leg (issue 32, docs/testing.md)"
    assert code[-3:] == ['[ "$status" -eq 0 ] || exit "$status"', '[ "$oldest_status" -eq 0 ] || exit "$oldest_status"',
                         'exit "$mutants_status"'], \
        ".ci/run must fail when make test, the oldest-versions leg or the mutation sample fails"


def test_readme_quick_start_has_the_two_commands_in_one_block():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    commands = [
        {ln.split("#", 1)[0].strip() for ln in block.splitlines()} for block in blocks
    ]
    assert any({"make lab", "make test"} <= cmds for cmds in commands), \
        "README needs one fenced code block containing `make lab` and `make test`"


def test_measured_numbers_live_in_the_benchmarks_document():
    """The README points to BENCHMARKS.md, which holds sections written by `python -m stnb bench --write-doc`."""
    text = (ROOT / "README.md").read_text()
    assert re.search(r"^## Benchmarks\s*$", text, re.M) and "(BENCHMARKS.md)" in text
    doc = (ROOT / "BENCHMARKS.md").read_text()
    sections = re.findall(r"^<!-- stnb-bench:([^ ]+) -->$", doc, re.M)
    assert "reference" in sections and any(s.endswith("/sweep") for s in sections), sections



def test_readme_is_a_first_page():
    """A newcomer sees Python early, every notebook with its measured workshop time (the committed run's,
    from the notebook's stamp), and working links to the rest (docs/, CONTRIBUTING.md)."""
    import json

    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    first_python = next(i for i, ln in enumerate(lines, 1) if ln.strip() == "```python")
    assert first_python <= 40, f"the README's first Python block starts at line {first_python}"
    assert len(lines) <= 150, f"the README has {len(lines)} lines: move details to docs/"
    for name in NOTEBOOKS:
        row = next((ln for ln in lines if ln.startswith("|") and f"notebooks/{name}" in ln), None)
        assert row, f"the README's notebook table misses {name}"
        stamped = json.loads((ROOT / "notebooks" / name).read_text())["metadata"].get("stnb", {}).get("run_seconds")
        assert stamped is not None, f"{name}: no run time in its stamp: run `make notebooks NB={name[:2]}`"
        assert f"| {stamped} s |" in row, f"the README's time for {name} is not its committed run's ({stamped} s): {row}"
    targets = re.findall(r"\]\(([^)#]+)\)", text)
    local = [t for t in targets if "://" not in t]
    assert {"CONTRIBUTING.md", "BENCHMARKS.md", "docs/testing.md", "docs/gpu.md"} <= set(local), local
    for target in local:
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    for page in [ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"

# The course's core path for a three-hour workshop (issue 30): setup, the baseline, DDP, the ZeRO ladder
# (ZeRO-1 -> 2 -> 3 = FSDP), the comparison; the rest is the optional track. Reading time: 200 words a minute of prose
# and 6 s a line of the code a reader sees (a technical reading pace; the folded answers count too).
CORE_PATH = ("00", "01", "03", "04", "05")
WORDS_PER_MINUTE, SECONDS_PER_CODE_LINE = 200, 6


def reading_minutes(nb: dict) -> int:
    words = sum(len("".join(c["source"]).split()) for c in nb["cells"] if c["cell_type"] == "markdown")
    lines = sum(len("".join(c["source"]).splitlines()) for c in nb["cells"] if c["cell_type"] == "code")
    return math.ceil(words / WORDS_PER_MINUTE + lines * SECONDS_PER_CODE_LINE / 60)


def core_path_line(notebooks: dict) -> str:
    """The README's sentence on the core path, from each notebook's stamp (compute) and text (reading)."""
    core = [notebooks[n] for n in sorted(notebooks) if n[:2] in CORE_PATH]
    compute = sum(nb["metadata"]["stnb"]["run_seconds"] for nb in core)
    reading = sum(reading_minutes(nb) for nb in core)
    total = math.ceil(compute / 60) + reading
    return (f"**Core path** ({' → '.join(CORE_PATH)}, about {total // 60} h {total % 60:02d} min: "
            f"{math.ceil(compute / 60)} min of compute in the committed runs, {reading} min of reading)")


def test_readme_states_the_core_path_with_compute_and_reading_times():
    """Every notebook's row says whether it is on the core path and its reading time; the core path's sentence
    is computed from the notebooks as committed, and the core path fits a three-hour workshop."""
    import json

    text = (ROOT / "README.md").read_text()
    notebooks = {name: json.loads((ROOT / "notebooks" / name).read_text()) for name in NOTEBOOKS}
    for name, nb in notebooks.items():
        row = next(ln for ln in text.splitlines() if ln.startswith("|") and f"notebooks/{name}" in ln)
        path = "core" if name[:2] in CORE_PATH else "optional"
        assert f"| {path} |" in row, f"{name}: the README's row does not say '{path}': {row}"
        assert row.endswith(f"| {reading_minutes(nb)} min |"), \
            f"{name}: the README's reading time is not {reading_minutes(nb)} min: {row}"
    line = core_path_line(notebooks)
    assert line in text, f"the README should say: {line}"
    hours, minutes = re.search(r"about (\d+) h (\d+) min", line).groups()
    assert int(hours) * 60 + int(minutes) <= 180, line


#: docs/teaching.md's three-hour plan: the core path in order, each notebook's planned exercise minutes (the
#: teacher's estimate, said as such on the page), a break after 03; compute and reading come from the notebooks
WORKSHOP_EXERCISES = {"00": 5, "01": 5, "03": 15, "04": 10, "05": 10}
WORKSHOP_BREAK_AFTER, WORKSHOP_BREAK = "03", 10


def workshop_schedule(notebooks: dict) -> str:
    """docs/teaching.md's schedule table: start time, notebook, compute (its committed run's, rounded up to a
    minute), reading, exercises (planned), the block's minutes; then the time left of three hours."""
    rows, t = ["| starts | block | compute | reading | exercises (planned) | minutes |",
               "| --- | --- | ---: | ---: | ---: | ---: |"], 0
    for name in sorted(n for n in notebooks if n[:2] in CORE_PATH):
        nb = notebooks[name]
        compute, reading = math.ceil(nb["metadata"]["stnb"]["run_seconds"] / 60), reading_minutes(nb)
        minutes = compute + reading + WORKSHOP_EXERCISES[name[:2]]
        rows.append(f"| {t // 60}:{t % 60:02d} | `{name}` | {compute} min | {reading} min | "
                    f"{WORKSHOP_EXERCISES[name[:2]]} min | {minutes} |")
        t += minutes
        if name[:2] == WORKSHOP_BREAK_AFTER:
            rows.append(f"| {t // 60}:{t % 60:02d} | break | | | | {WORKSHOP_BREAK} |")
            t += WORKSHOP_BREAK
    rows.append(f"| {t // 60}:{t % 60:02d} | questions, then one optional notebook's section (below) | | | | "
                f"{180 - t} |")
    return "\n".join(rows)


def test_the_teachers_page_plans_three_hours_from_the_measured_minutes():
    """docs/teaching.md's schedule is computed from the committed notebooks (their stamps and text) and fits three
    hours with time left; a re-stamped or edited notebook whose row was not updated fails, printing the table."""
    import json

    notebooks = {name: json.loads((ROOT / "notebooks" / name).read_text()) for name in NOTEBOOKS}
    table = workshop_schedule(notebooks)
    assert table in (ROOT / "docs" / "teaching.md").read_text(), f"docs/teaching.md should hold:\n{table}"
    left = int(table.splitlines()[-1].split("|")[-2])
    assert left >= 15, f"the core path leaves {left} min of three hours: too tight for a workshop"


def test_the_schedule_moves_with_a_notebooks_measured_time():
    import json

    notebooks = {name: json.loads((ROOT / "notebooks" / name).read_text()) for name in NOTEBOOKS}
    before = workshop_schedule(notebooks)
    notebooks["01_single_device_baseline.ipynb"]["metadata"]["stnb"]["run_seconds"] += 120
    after = workshop_schedule(notebooks)
    assert before != after and int(after.splitlines()[-1].split("|")[-2]) == \
        int(before.splitlines()[-1].split("|")[-2]) - 2


def test_reading_time_counts_prose_and_code():
    nb = {"cells": [{"cell_type": "markdown", "source": ["word " * 400]},
                    {"cell_type": "code", "source": ["x = 1\n" * 10]}]}
    assert reading_minutes(nb) == 3  # 400 words: 2 min; 10 lines: 1 min
    nb["cells"][0]["source"] = ["word " * 401]
    assert reading_minutes(nb) == 4  # rounded up


def test_makefile_test_target_runs_tests_and_notebooks():
    recipe = _recipe("test")
    assert "-m pytest tests --nbval-lax --nbval-current-env notebooks -m slow" in recipe
    assert '-m pytest tests -m "not slow"' in recipe
    prereqs = re.search(r"^test:(.*)$", _makefile(), re.M).group(1).split()
    assert {"install", "browser"} <= set(prereqs)
    test_env = _makefile()
    for var in ("STNB_PROFILE=ci", "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1",
                "HF_DATASETS_OFFLINE=1", "TOKENIZERS_PARALLELISM=false", "PYTHONUNBUFFERED=1"):
        assert var in test_env, f"make test must export {var}"


@needs_make
def test_make_test_dry_run():
    out = _make_dry_run("test")
    pytest_lines = [ln for ln in out.splitlines() if "-m pytest" in ln]
    # two steps that together run every test: the in-process tier, then the slow tiers and the notebooks
    assert len(pytest_lines) == 2, out
    fast, slow = pytest_lines
    for line in pytest_lines:
        assert "STNB_PROFILE=ci" in line and "HF_HUB_OFFLINE=1" in line
    assert "-m pytest tests -m \"not slow\"" in fast and "notebooks" not in fast
    assert "tests --nbval-lax --nbval-current-env notebooks -m slow" in slow
    assert "-n 3 --dist loadgroup" in slow  # a test file stays in one worker (tests/tiers.py)
    # torch first, explicitly, then the project with dev extras
    lines = out.splitlines()
    torch_at = [i for i, ln in enumerate(lines) if "pip install" in ln and f'"torch=={_torch_pin()}"' in ln]
    project_at = [i for i, ln in enumerate(lines) if 'pip install -c constraints/ci.txt -e ".[dev]"' in ln]
    assert torch_at and project_at and torch_at[0] < project_at[0], out



@needs_make
def test_make_notebooks_reruns_all_or_the_one_named_by_nb():
    every = _make_dry_run("notebooks")
    assert all(f"notebooks/{name}" in every for name in NOTEBOOKS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    one = subprocess.run(["make", "-n", "--no-print-directory", "notebooks", "NB=03", "VENV=/nonexistent-stnb-venv"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert one.returncode == 0, one.stderr
    assert "STNB_PROFILE=workshop" in one.stdout and "--stamp notebooks/03_ddp_from_a_notebook.ipynb" in one.stdout
    assert [n for n in NOTEBOOKS if f"notebooks/{n}" in one.stdout] == ["03_ddp_from_a_notebook.ipynb"]
    none = subprocess.run(["make", "-n", "--no-print-directory", "notebooks", "NB=99", "VENV=/nonexistent-stnb-venv"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert none.returncode != 0 and "no notebook matches NB=99" in none.stderr

# ---------------------------------------------------- (d) lab keeps a token --

def test_lab_keeps_token_auth_and_binds_localhost():
    recipe = _recipe("lab")
    assert "jupyter lab" in recipe
    assert "--ip=127.0.0.1" in recipe
    assert "--notebook-dir=notebooks" in recipe
    for bad in TOKEN_DISABLERS + ("0.0.0.0", "--ip=*", "--ip='*'"):
        assert bad not in recipe, f"lab target must not use {bad!r}"
    for bad in TOKEN_DISABLERS:
        assert bad not in _makefile(), f"Makefile must not use {bad!r}"


@needs_make
def test_lab_dry_run_keeps_token_auth():
    out = _make_dry_run("lab")
    lab = [ln for ln in out.splitlines() if "jupyter lab" in ln and not ln.lstrip().startswith("echo")]
    assert len(lab) == 1, out
    line = lab[0]
    assert "--ip=127.0.0.1" in line and "--no-browser" in line
    assert "token" not in line.lower() and "password" not in line.lower()
    assert ("--allow-root" in line) == (os.geteuid() == 0)


# ------------------------------------------------------------ (d) notebooks --

# The syllabus, in reading order: a new notebook is added here (and to the README's table).
NOTEBOOKS = (
    "00_setup_and_hardware.ipynb",
    "01_single_device_baseline.ipynb",
    "02_data_parallel.ipynb",
    "03_ddp_from_a_notebook.ipynb",
    "04_zero_ladder.ipynb",
    "05_compare_strategies.ipynb",
    "06_scaling_out.ipynb",
    "07_bring_your_own_training.ipynb",
    "08_tuning_ddp.ipynb",
    "09_zero_in_depth_and_deepspeed.ipynb",
    "10_beyond_data_parallelism.ipynb",
)


def test_the_notebook_list_is_the_notebooks_folder():
    assert sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")) == list(NOTEBOOKS)


def first_screen_line(name: str, nb: dict, needs: str) -> str:
    """The line a notebook's first cell ends with: core path or optional, its workshop run's compute (the stamp),
    its reading time, what it needs (the README's column), so a student or teacher sees them on the first screen."""
    path = "Core path" if name[:2] in CORE_PATH else "Optional track"
    return (f"*{path} · {nb['metadata']['stnb']['run_seconds']} s of compute (the committed workshop run) + "
            f"{reading_minutes(nb)} min of reading · needs: {needs}*")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_notebook_says_on_its_first_screen_its_path_minutes_and_needs(name):
    """The first cell (the title) ends with first_screen_line: computed here from the stamp, the text and the
    README's row, so a re-stamped or edited notebook whose line was not updated fails, naming the line to write."""
    import json

    import course_html

    nb = json.loads((ROOT / "notebooks" / name).read_text())
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown", f"{name}: the first cell is not the title"
    want = first_screen_line(name, nb, course_html.readme_rows()[name]["Needs"])
    last = "".join(first["source"]).rstrip().splitlines()[-1]
    assert last == want, f"{name}: the first cell should end with the line\n{want}\nnot\n{last}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_follows_the_conventions(name):
    """CONTRIBUTING.md ("Notebook conventions"): the same first cell, the opening and closing sections,
    numbered exercises. (The committed outputs are one stamped workshop run: tests/test_notebook_outputs.py.)"""
    import json

    nb = json.loads((ROOT / "notebooks" / name).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    first = "".join(code[0]["source"])
    assert first == FIRST_CELL, first
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    for heading in ("What you will learn", "What you need", "Summary", "Exercises"):
        assert re.search(rf"^## {heading}\s*$", text, re.M), f"{name}: no '## {heading}'"
    assert re.search(r"^## Exercises\s*\n+1\. ", text, re.M), f"{name}: exercises are not numbered"


def question_problems(nb: dict) -> list:
    """Why the notebook's closing questionnaire is not as CONTRIBUTING.md asks: a `## Questions` markdown cell
    after the exercises, 4-6 numbered questions, each followed by its answer folded in a
    `<details><summary>Answer</summary>` block whose text has a blank line on either side (without them
    CommonMark, as GitHub and JupyterLab read it, shows the answer's markdown as raw text)."""
    cells = [("".join(c["source"]), c["cell_type"]) for c in nb["cells"]]
    exercises = next((i for i, (s, t) in enumerate(cells) if t == "markdown" and re.search(r"^## Exercises", s, re.M)), None)
    found = [i for i, (s, t) in enumerate(cells) if t == "markdown" and re.search(r"^## Questions\s*$", s, re.M)]
    if len(found) != 1:
        return [f"{len(found)} '## Questions' cells (one after the exercises)"]
    if exercises is None or found[0] <= exercises:
        return ["'## Questions' comes before '## Exercises'"]
    text = cells[found[0]][0]
    items = re.split(r"^(?=\d+\. )", text.split("## Questions", 1)[1], flags=re.M)[1:]
    out = [] if 4 <= len(items) <= 6 else [f"{len(items)} questions (4-6)"]
    for k, item in enumerate(items, 1):
        if not item.startswith(f"{k}. "):
            out.append(f"question {k} is numbered {item.split('.', 1)[0]}")
        if not re.search(r"\n\n   <details><summary>Answer</summary>\n\n   \S.*?\n\n   </details>\s*$", item, re.S):
            out.append(f"question {k}: its answer is not a <details><summary>Answer</summary> block with a blank "
                       "line on either side of the answer, indented under the question")
    return out


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_closes_with_recall_questions(name):
    import json

    assert question_problems(json.loads((ROOT / "notebooks" / name).read_text())) == []


def test_a_questionnaire_out_of_shape_is_found():
    import json

    nb = json.loads((ROOT / "notebooks" / NOTEBOOKS[0]).read_text())
    cell = next(c for c in nb["cells"] if "".join(c["source"]).startswith("## Questions"))
    text = "".join(cell["source"])
    cell["source"] = [text.replace("<details><summary>Answer</summary>\n\n", "<details><summary>Answer</summary>\n", 1)]
    assert question_problems(nb) == ["question 1: its answer is not a <details><summary>Answer</summary> block with "
                                     "a blank line on either side of the answer, indented under the question"]
    cell["source"] = [re.split(r"^3\. ", text, flags=re.M)[0]]
    assert question_problems(nb) == ["2 questions (4-6)"]
    nb["cells"].remove(cell)
    assert question_problems(nb) == ["0 '## Questions' cells (one after the exercises)"]


def cell_ast(source: str):
    """A code cell's source parsed by ast, IPython's line magics (%pip) read as the comments they are to Python."""
    import ast

    return ast.parse("\n".join("#" + ln if ln.lstrip().startswith("%") else ln for ln in source.split("\n")))


def _reader_problems(nb: dict) -> list:
    """Cells that put the notebook's checks in the reader's way, read as GitHub's viewer reads the JSON:
    every code cell's source is shown (it ignores ``source_hidden`` and the ``hide-input`` tag), so any
    ``assert`` statement in a code cell is one the reader sees; and an nbval marker (`# NBVAL_...`) as
    a cell's first line (a cell tag does the same job). The checks live in tests/notebook_checks.py."""
    import ast

    found = []
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if not source.strip():
            found.append(f"cell {i} is empty: a reader sees a blank cell; a check needs no cell of its own "
                         "(tests/notebook_checks.py anchors it after the cell it checks)")
            continue
        if cell["cell_type"] != "code":
            continue
        if source.lstrip().startswith("# NBVAL_"):
            found.append(f"cell {i} starts with an nbval marker: use the cell tag "
                         f"{source.split()[1].lower().replace('_', '-')!r} instead")
        asserts = [n.lineno for n in ast.walk(cell_ast(source)) if isinstance(n, ast.Assert)]
        if asserts:
            found.append(f"cell {i} shows an assert (line {asserts[0]}) on GitHub, hidden or not: move the check "
                         "to tests/notebook_checks.py (nbval runs it right after this cell)")
    return found


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_checks_stay_out_of_the_readers_way(name):
    """A reader sees narrative, tables and plots wherever the notebook is opened; the asserts that keep a
    notebook honest are in tests/notebook_checks.py, and nbval's markers are cell tags (CONTRIBUTING.md)."""
    import json

    nb = json.loads((ROOT / "notebooks" / name).read_text())
    assert _reader_problems(nb) == []


def test_an_assert_cell_hidden_or_not_and_an_nbval_marker_are_found():
    import json

    nb = json.loads((ROOT / "notebooks" / NOTEBOOKS[0]).read_text())
    hidden = nbformat_cell("assert hw.cpu_cores >= 1", hidden=True)
    nb["cells"].insert(3, hidden)
    mixed = next(c for c in nb["cells"] if c["cell_type"] == "code" and "hardware_report" in "".join(c["source"]))
    mixed["source"] = list(mixed["source"]) + ["\nif hw.gpus:\n    assert hw.device == 'cuda'"]
    tagged = next(c for c in nb["cells"] if "nbval-check-output" in c.get("metadata", {}).get("tags", []))
    tagged["source"] = ["# NBVAL_CHECK_OUTPUT\n"] + list(tagged["source"])
    nb["cells"].insert(5, nbformat_cell("\n"))
    found = _reader_problems(nb)
    assert len(found) == 4, found
    assert any(f.startswith("cell 5 is empty") for f in found), found
    assert sum("shows an assert" in f for f in found) == 2, found
    assert any("'nbval-check-output'" in f for f in found), found


def leftover_folders(nb: dict) -> list:
    """Code cells that make a folder nothing removes (``tempfile.mkdtemp``): every run of the notebook would leave
    it in /tmp (13 a run of 07 did). A notebook's files go in a ``tempfile.TemporaryDirectory``, removed when the
    kernel stops (under nbval: the ``kernel stopped`` item, docs/testing.md)."""
    import ast

    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        calls = [n for n in ast.walk(cell_ast("".join(cell["source"]))) if isinstance(n, ast.Call)]
        if any(getattr(c.func, "attr", getattr(c.func, "id", None)) == "mkdtemp" for c in calls):
            found.append(f"cell {i} calls mkdtemp: a folder every run leaves behind; use a "
                         "tempfile.TemporaryDirectory the notebook keeps (removed when the kernel stops)")
    return found


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_notebook_leaves_no_folder_behind(name):
    import json

    assert leftover_folders(json.loads((ROOT / "notebooks" / name).read_text())) == []


def test_a_cell_that_makes_a_folder_nothing_removes_is_found():
    nb = {"cells": [{"cell_type": "code", "source": ["import tempfile\nkept = tempfile.TemporaryDirectory()"]},
                    {"cell_type": "markdown", "source": ["not code: tempfile.mkdtemp()"]},
                    {"cell_type": "code", "source": ["%pip list\nout = Path(tempfile.mkdtemp(prefix='x')) / 'r.jsonl'"]},
                    {"cell_type": "code", "source": ["from tempfile import mkdtemp\nf(output_dir=mkdtemp())"]}]}
    assert [f.split(" calls")[0] for f in leftover_folders(nb)] == ["cell 2", "cell 3"]


def by_hand_problems(nb: dict) -> list:
    """Sections whose heading says "by hand" but whose first code cell calls into stnb (CONVENTIONS.md: "No stnb
    helper hides the mechanism a cell shows"): a name from ``stnb`` / ``stnblab`` (``stnb.x``, or a name the
    notebook imported from them) in that cell."""
    import ast

    imported = {"stnb", "stnblab", "prof"}  # prof = stnb.setup(), the first cell's
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            for node in ast.walk(cell_ast("".join(cell["source"]))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("stnb", "stnblab"):
                    imported |= {a.asname or a.name for a in node.names}
    found, heading = [], None
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            headings = re.findall(r"^#+ (.*)$", source, re.M)
            heading = headings[-1] if headings else heading
        elif heading and "by hand" in heading.lower():
            names = {n.id for n in ast.walk(cell_ast(source)) if isinstance(n, ast.Name)}
            if names & imported:
                found.append(f"cell {i}, the first under '{heading}', calls {sorted(names & imported)}: show the "
                             "mechanism in plain torch there, or do not call the section by hand")
            heading = None
    return found


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_section_called_by_hand_shows_the_mechanism_not_a_call_into_stnb(name):
    import json

    assert by_hand_problems(json.loads((ROOT / "notebooks" / name).read_text())) == []


def test_a_by_hand_section_that_calls_into_stnb_is_found():
    nb = {"cells": [{"cell_type": "code", "source": ["from stnb import examples\n"]},
                    {"cell_type": "markdown", "source": ["## All-reduce by hand\n", "text"]},
                    {"cell_type": "code", "source": ["examples.allreduce_check(2)"]},
                    {"cell_type": "markdown", "source": ["## DDP by hand"]},
                    {"cell_type": "code", "source": ["import torch\nt = torch.ones(2)\ndist.all_reduce(t)"]},
                    {"cell_type": "code", "source": ["stnb.launch(f, num_processes=2)"]}]}
    found = by_hand_problems(nb)
    assert len(found) == 1 and found[0].startswith("cell 2, the first under 'All-reduce by hand', calls ['examples']"), found


#: the longest code cell a reader sees (CONVENTIONS.md, "by hand first": the mechanism in a cell of at most
#: ~15 lines); GitHub's viewer shows every code cell, hidden or not, so every one counts
MAX_CELL_LINES = 15


def long_cells(nb: dict) -> list:
    """Code cells over ``MAX_CELL_LINES`` lines, as "cell i: n lines"."""
    out = []
    for i, cell in enumerate(nb["cells"]):
        n = len("".join(cell["source"]).splitlines())
        if cell["cell_type"] == "code" and n > MAX_CELL_LINES:
            out.append(f"cell {i}: {n} lines")
    return out


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_code_cell_is_short_enough_to_read_by_hand(name):
    """Split a longer cell where its steps are (a sentence of narrative between them); don't pack it into
    longer lines."""
    import json

    assert long_cells(json.loads((ROOT / "notebooks" / name).read_text())) == []


def test_a_long_cell_hidden_or_not_is_found():
    import json

    nb = json.loads((ROOT / "notebooks" / NOTEBOOKS[0]).read_text())
    at = len(nb["cells"])
    nb["cells"] += [nbformat_cell("\n".join(["x = 1"] * MAX_CELL_LINES)),
                    nbformat_cell("\n".join(["x = 1"] * (MAX_CELL_LINES + 1)), hidden=True),
                    {"cell_type": "markdown", "metadata": {}, "source": ["text\n"] * 40}]
    assert long_cells(nb) == [f"cell {at + 1}: {MAX_CELL_LINES + 1} lines"]


def nbformat_cell(source: str, hidden: bool = False) -> dict:
    meta = {"jupyter": {"source_hidden": True}, "tags": ["hide-input"]} if hidden else {}
    return {"cell_type": "code", "execution_count": None, "metadata": meta, "outputs": [], "source": [source]}


#: every notebook's first code cell (CONVENTIONS.md): does nothing in `make lab` (a clone: stnb is installed);
#: on Colab / Kaggle installs stnb from pyproject.toml's Source (pip keeps the runtime's torch, stnb's
#: requirements being ranges), and while that address is a placeholder says in one line what to do instead
#: (tests/test_install_cell.py runs it each way)
FIRST_CELL = """try:
    import stnb                                  # make lab: installed already, nothing to do
except ImportError:                              # Colab, Kaggle: install stnb; the runtime's torch stays
    SOURCE = "https://github.com/OWNER/stnb"     # pyproject.toml's [project.urls] Source
    if "/OWNER/" in SOURCE:                      # no public address yet: say what to do instead, and stop
        class NotPublished(Exception):
            def _render_traceback_(self): return [str(self)]   # IPython shows the message, no traceback
        raise NotPublished("stnb has no public address yet: clone or upload its repository, run "
                           "`%pip install -q ./stnb` here and this cell again (or `make lab` in the clone)")
    %pip install -q "stnb @ git+{SOURCE}"
    import stnb
prof = stnb.setup()"""
