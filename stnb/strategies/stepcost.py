"""What every strategy's step-cost model (``Strategy.step_time``) is built from: one compute stream and one
communication channel, run unit after unit (``pipeline``), and the dict a model returns (``step``).

A model takes ``m`` (``stnb.scaling.Measured``: one device's step split into forward, backward compute,
optimizer and the rest, with the bytes the collectives move), ``fab`` (``stnb.scaling.Fabric``: the
collectives' alpha-beta costs on the link, ``overlap`` whether communication hides behind compute) and
``n`` devices, and returns ``{"step", "comm", "comm_exposed", "feasible", "note"}`` in seconds. Each
strategy's own model is in its module (single, dp, ddp, zero1, zero2, fsdp); ``stnb.scaling`` asks the
registry for them.
"""

from __future__ import annotations

import math


def pipeline(units, overlap: bool) -> tuple:
    """(end time, communication time) of units run in order: each is (comm before, compute, comm after).

    One compute stream and one communication channel (first issued, first served). The next unit's
    comm-before is issued when this unit's compute starts (prefetch of one); comm-after when its
    compute ends. Without overlap everything runs one after another."""
    comm = sum(u[0] + u[2] for u in units)
    if not overlap:
        return sum(sum(u) for u in units), comm
    chan = units[0][0] if units else 0.0
    ready = [0.0] * len(units)
    ready[0] = chan
    t = 0.0
    for i, (_, work, after) in enumerate(units):
        start = max(t, ready[i])
        if i + 1 < len(units):
            chan = max(chan, start) + units[i + 1][0]
            ready[i + 1] = chan
        t = start + work
        if after:
            chan = max(chan, t) + after
    return max(t, chan), comm


def buckets(m) -> list:
    """DDP's gradient buckets: ``m.grad_bytes`` in pieces of at most ``m.bucket_bytes``."""
    k = max(1, math.ceil(m.grad_bytes / m.bucket_bytes))
    return [m.grad_bytes / k] * k


def slowest_of(n: int) -> float:
    """E[max of n standard normal draws]: how many standard deviations of a rank's step the slowest of n
    ranks adds to every synchronised step (0 for one). Numerical integration of n x phi(x) Phi(x)^(n-1)."""
    if n <= 1:
        return 0.0
    h, total = 0.01, 0.0
    for i in range(-800, 801):
        x = i * h
        total += x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
    return total * h


def step(seconds, comm, exposed, note="") -> dict:
    """A feasible prediction: the step, its communication and the part of it compute does not hide."""
    return {"step": seconds, "comm": comm, "comm_exposed": max(0.0, exposed), "feasible": True, "note": note}


def infeasible(note: str) -> dict:
    """A configuration the strategy cannot run (the note says why)."""
    return {"step": None, "comm": None, "comm_exposed": None, "feasible": False, "note": note}
