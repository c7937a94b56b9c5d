"""Machine load: how much of the CPUs other processes used while a run measured.

Measured numbers are only as good as the machine is quiet. ``machine_busy`` samples /proc/stat
and this process's CPU time; ``foreign_share`` turns two samples into the share of the machine
that *other* work used in between (a run's "other load"); ``wait_until_quiet`` waits for a quiet
machine before a run. Runs above ``NOISY`` are flagged in the summary.
"""

from __future__ import annotations

import os
import time

NOISY = 0.05  # other processes' share of the CPUs above which a run's timing is flagged


def machine_busy() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its reaped children)."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()[1:]
        vals = [int(x) for x in parts]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    busy = (sum(vals[:8]) - idle) / hz                  # user..steal, without guest (counted in user)
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system


def foreign_share(before, after, wall: float) -> float | None:
    """Fraction of the machine's CPU capacity used by *other* processes between two samples."""
    from stnb.hardware import cpu_cores

    if before is None or after is None or wall <= 0:
        return None
    ncpu = os.cpu_count() or cpu_cores()
    other = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, min(1.0, other / (wall * ncpu)))


def wait_until_quiet(max_wait: float, threshold: float = 0.10, window: float = 2.0, echo: bool = True) -> float | None:
    """Wait (up to ``max_wait`` s) until other processes use less than ``threshold`` of the CPUs
    over ``window`` seconds. Returns the last measured share (None where /proc/stat is missing)."""
    deadline = time.time() + max_wait
    told = False
    while True:
        a, t0 = machine_busy(), time.time()
        time.sleep(window)
        share = foreign_share(a, machine_busy(), time.time() - t0)
        if share is None or share < threshold or time.time() >= deadline:
            return share
        if echo and not told:
            print(f"    waiting for a quiet machine: other processes use {share:.0%} of the CPUs "
                  f"(up to {max_wait:.0f} s)", flush=True)
            told = True

