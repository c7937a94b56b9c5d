"""This test process's descendants, as the tests that check "nothing left running" count them."""

from __future__ import annotations

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
