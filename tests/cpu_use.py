"""``--cpu-use=FILE``: where a test run's CPU time goes (docs/testing.md, "Where the CPU goes").

On 2 cores ``make test``'s slow step is CPU-bound, so its wall time follows the CPU-seconds its tests use, not
their wall times. Each test appends one JSON line to FILE: the CPU-seconds of its own process and of the
children it reaped while it ran (forked and spawned ranks, the CLI, torchrun, kernels), its wall time and its
worker. Processes that are nobody's reaped children (Ray's and SLURM's daemons and actors) are in no line; the
summary at the end puts the recorded total beside the machine's busy CPU-seconds over the same time
(``/proc/stat``), so what ran outside the tests' process trees shows as the difference. Used as
``make test PYTEST_ARGS="--cpu-use=artifacts/cpu-use.jsonl"`` (both steps append; each prints its own summary).
"""

from __future__ import annotations

import json
import os
import resource
import time
import uuid

import pytest

SESSION_ENV = "STNB_CPU_USE_SESSION"  # the controller's session token, inherited by xdist's workers


def pytest_addoption(parser):
    parser.addoption("--cpu-use", metavar="FILE", default=None,
                     help="append each test's CPU-seconds (its process and the children it reaped) to FILE as "
                          "JSON lines; print the machine's busy CPU-seconds and the files that used most")


def tree_cpu() -> tuple:
    """(this process's CPU-seconds, its reaped children's CPU-seconds)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def machine_busy() -> float | None:
    """CPU-seconds every core of this machine spent busy since boot (the bench's reading of /proc/stat,
    imported only when --cpu-use is given); None where there is no /proc/stat."""
    from stnblab.bench.load import machine_busy as sample

    got = sample()
    return None if got is None else got[0]


def pytest_configure(config):
    if config.getoption("cpu_use") and not hasattr(config, "workerinput"):  # the controller (or no xdist)
        os.environ[SESSION_ENV] = uuid.uuid4().hex
        config._cpu_use_start = (time.monotonic(), machine_busy())
        os.makedirs(os.path.dirname(os.path.abspath(config.getoption("cpu_use"))), exist_ok=True)  # before workers


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("cpu_use")
    if not path:
        yield
        return
    own0, kids0 = tree_cpu()
    t0 = time.monotonic()
    yield
    own1, kids1 = tree_cpu()
    line = {"session": os.environ.get(SESSION_ENV), "test": item.nodeid, "file": item.nodeid.split("::")[0],
            "own": round(own1 - own0, 3), "children": round(kids1 - kids0, 3), "wall": round(time.monotonic() - t0, 3),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(path, "a") as f:  # one short write per line: workers appending at once do not interleave
        f.write(json.dumps(line) + "\n")


def summary(path: str, session: str | None, wall: float, busy: float | None, cores: int, top: int = 15) -> list:
    """The summary's lines: the machine's busy CPU-seconds over ``wall``, what the tests' lines of ``session``
    add up to, and the ``top`` files by CPU-seconds."""
    import pandas as pd

    with open(path) as f:
        rows = [r for r in map(json.loads, f) if r["session"] == session]
    if not rows:
        return [f"cpu use: no test recorded in {path}"]
    frame = pd.DataFrame(rows)
    frame["cpu"] = frame["own"] + frame["children"]
    recorded = frame["cpu"].sum()
    out = [f"cpu use: {len(frame)} tests, {recorded:,.0f} CPU-s in their process trees over {wall:,.0f} s ({path})"]
    if busy is not None:
        out.append(f"cpu use: the machine was busy {busy:,.0f} CPU-s ({busy / wall / cores:.0%} of {cores} cores); "
                   f"{max(busy - recorded, 0):,.0f} CPU-s outside the tests' trees (collection, imports, daemons)")
    by_file = frame.groupby("file").agg(cpu=("cpu", "sum"), wall=("wall", "sum"), tests=("test", "count"))
    by_file = by_file.sort_values("cpu", ascending=False).head(top).round(0).astype(int)
    out += ["cpu use: " + line for line in by_file.to_string().splitlines()]
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path, start = config.getoption("cpu_use"), getattr(config, "_cpu_use_start", None)
    if not path or start is None or not os.path.exists(path):
        return
    t0, busy0 = start
    busy1 = machine_busy()
    busy = busy1 - busy0 if busy0 is not None and busy1 is not None else None
    for line in summary(path, os.environ.get(SESSION_ENV), time.monotonic() - t0, busy, os.cpu_count() or 1):
        terminalreporter.write_line(line)
