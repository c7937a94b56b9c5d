"""This test process's descendants, as the tests that check "nothing left running" count them."""

from __future__ import annotations

import os

import psutil


def _resource_tracker(p) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def children() -> list:
    """Running descendants of this process, except multiprocessing's resource tracker: Python starts it once
    for the whole process the first time anything needs it (a spawn-started launch, a semaphore in an earlier
    test) and it lives until the process ends; it is not a rank and no launch started it for itself."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not _resource_tracker(p):
                out.append(p)
        except psutil.Error:
            pass
    return out


def oversubscribed_ranks() -> set:
    """Pids of torchrun's ranks (stnblab.parallel.oversubscribe) that this pytest process started, alive or not yet
    reaped: they run in sessions of their own (not children once torchrun is gone), so they are found by command
    line, and told from another xdist worker's (whose torchrun runs at the same time) by the worker name their
    inherited environment carries."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    out = set()
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if (p.info["status"] != psutil.STATUS_ZOMBIE
                    and "stnblab.parallel.oversubscribe" in " ".join(p.info["cmdline"] or [])
                    and p.environ().get("PYTEST_XDIST_WORKER") == worker):
                out.add(p.pid)
        except psutil.Error:
            continue
    return out
