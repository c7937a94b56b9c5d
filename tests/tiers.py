"""The order ``make test`` runs the tests in, and which are ``slow`` (docs/testing.md, "Tiers").

* tier 0, unmarked: in-process tests (seconds in all; ``pytest -m "not slow"`` runs only these);
* tier 1, ``slow``: a test that starts processes: it calls (outside a ``pytest.raises`` of a refusal such as
  ``ConfigError``, raised before any process starts; ``LaunchError`` counts) ``stnb.run``, ``stnb.launch``, ``subprocess``,
  ``multiprocessing``, DeepSpeed's op ``prebuild`` or ``launch_copy`` (a compiler) or the Panel's run button, itself, through
  a fixture it uses, or through a function of the tests it calls (read from their source, three calls
  deep): real multi-process training, torchrun, the CLI;
* tier 2, ``slow``: the notebooks (nbval), the browser, real Jupyter kernels, the SLURM and Ray clusters,
  the GPU kit and the pip resolver: minutes each, and what a change to one module rarely breaks first.

Within a tier the collection order is kept, so a module's tests stay together (its module-scoped runs
are made once). A test marked ``slow`` by hand stays slow.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import textwrap

import pytest

STARTS_PROCESSES = re.compile(
    # stnb's and torch's entry points that start ranks, and processes started directly
    r"\bstnb\.(run|launch|parity|fits)\(|(?<!def )\bfits\("
    r"|\b(cpu_)?launch(_oversubscribed)?\(|\belastic_launch\(|\bnotebook_launcher\("
    r"|\bsubprocess\.|\bPopen\(|\bmultiprocessing\b|\bmp\.Process\("
    # the lab's runs: the bench (also through the CLI), the GPU check's runners, the TP/PP demos
    r"|\bbench\.\w+\(|\[\s*\"(bench|run)\"|\bRUNNERS\[|\b(pipeline|tensor)_parallel\("
    # a compiler (DeepSpeed's ops), the Panel's run button, a real Jupyter kernel
    r"|\b(prebuild|launch_copy)\(|\.run_button\.click\(|\bnbclient\b|\bNotebookClient\(|\bKernelManager\(")
LAST = {"test_browser.py", "test_kernel.py", "test_spawn.py", "test_cluster_slurm.py", "test_cluster_ray.py",
        "test_gpu_kit.py", "test_notebook_outputs.py"}
TESTS = os.path.dirname(os.path.abspath(__file__))


def _source(obj) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return ""


def _called_test_functions(src: str, namespace: dict) -> list:
    """Functions of the tests' own modules that ``src`` calls (by name, from ``namespace``)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                obj = namespace.get(f.id)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):  # module.function(...)
                obj = getattr(namespace.get(f.value.id), f.attr, None)
            else:
                continue
            obj = inspect.unwrap(getattr(obj, "func", obj))  # functools.partial, lru_cache, wraps
            if inspect.isfunction(obj) and os.path.dirname(os.path.abspath(inspect.getfile(obj))) == TESTS:
                out.append(obj)
    return out


# what a launch raises once ranks ran; any other exception a test expects (ConfigError, ValueError, a
# parametrized one...) is a refusal, raised before any process starts
AFTER_RANKS_RAN = {"LaunchError", "VerificationError", "KeyboardInterrupt", "Exception", "BaseException"}


def _without_refusals(src: str) -> str:
    """``src`` without its ``with pytest.raises(ConfigError ...)`` blocks: a call refused before any process
    starts (stnb's refusals) starts none; ``pytest.raises(LaunchError)`` blocks stay (ranks ran)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return src
    lines = src.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, ast.With):
            continue
        for item in node.items:
            call = item.context_expr
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "raises"
                    and call.args):
                kinds = call.args[0].elts if isinstance(call.args[0], ast.Tuple) else [call.args[0]]
                names = {k.id if isinstance(k, ast.Name) else getattr(k, "attr", "") for k in kinds}
                if not names & AFTER_RANKS_RAN:
                    for i in range(node.lineno - 1, node.end_lineno):
                        lines[i] = "\n"
    return "".join(lines)


def _starts_processes(fn, namespace: dict, depth: int = 3, seen=None) -> bool:
    seen = set() if seen is None else seen
    if fn in seen:
        return False
    seen.add(fn)
    src = _without_refusals(_source(fn))
    if STARTS_PROCESSES.search(src):
        return True
    if depth:
        for g in _called_test_functions(src, {**namespace, **getattr(fn, "__globals__", {})}):
            if _starts_processes(g, g.__globals__, depth - 1, seen):
                return True
    return False


def tier(item) -> int:
    path = str(getattr(item, "path", item.fspath))
    if path.endswith(".ipynb") or os.path.basename(path) in LAST or item.get_closest_marker("cluster"):
        return 2
    fn = getattr(item, "function", None)
    if item.get_closest_marker("slow"):
        return 1
    if fn is None:
        return 0
    namespace = getattr(item.module, "__dict__", {})
    fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs
                if os.path.dirname(os.path.abspath(inspect.getfile(d.func))) == TESTS]
    if any(_starts_processes(f, namespace) for f in [fn, *fixtures]):
        return 1
    return 0


# Under pytest-xdist (make test: the slow tiers on 2 workers, --dist loadgroup) a test module runs in one worker,
# so its module-scoped runs and clusters are made once; these modules share one worker, in turn: what one holds
# (port 29500; the one-node SLURM cluster and munge's socket), the others must not hold at the same time. (The
# image stand-in of test_gpu_kit / test_versions is built once for all workers, under a file lock: standin.py.)
SHARED_WORKER = {
    "test_launch.py": "port-29500", "test_injected_faults.py": "port-29500", "test_faults.py": "port-29500",
    "test_cluster_slurm.py": "slurm", "06_scaling_out.ipynb": "slurm",
}


def worker_group(item) -> str:
    """The xdist group of ``item``: its file (a notebook's cells run in order in one kernel), or the group its
    file shares (SHARED_WORKER)."""
    name = os.path.basename(str(getattr(item, "path", item.fspath)))
    return SHARED_WORKER.get(name, name)


def order_and_mark(items: list) -> None:
    tiers = {id(item): tier(item) for item in items}
    for item in items:
        if tiers[id(item)] and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        item.add_marker(pytest.mark.xdist_group(worker_group(item)))
    items.sort(key=lambda item: tiers[id(item)])  # stable: the collection order within a tier
