"""Process-tree cleanup: no process a launch started survives it.

torch elastic stops the rank processes it started (SIGTERM, then SIGKILL) but not what they started.
``tracked_children`` makes this process the child subreaper while a launch runs (an orphan of a rank,
or a daemon that double-forked, stays a descendant) and kills every descendant that appeared meanwhile.
``kill_tree`` is how (the watchdog stops ranks with it too); ``process_ended`` reads a rank's exit
status without reaping it.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import psutil


def children_now() -> set:
    """The pids of every descendant of this process right now."""
    return {c.pid for c in psutil.Process().children(recursive=True)}


def kill_tree(pids) -> None:
    """SIGKILL the given processes and all their descendants; wait until they are dead, not reaped: the
    ranks are children of multiprocessing / torch elastic, which collect their exit status themselves
    (reaped here, multiprocessing got ECHILD and took a rank for alive forever)."""
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [*p.children(recursive=True), p]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    end = time.time() + 5
    while procs and time.time() < end:
        procs = [p for p in procs if _alive(p)]
        if procs:
            time.sleep(0.02)


def _alive(p) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def child_subreaper(on: bool) -> bool | None:
    """Make this process the child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``) or stop being one: while a
    launch runs, a process whose parent (a rank) dies is re-parented here instead of to init, so the
    cleanup finds it. Returns the previous setting, or None where the call is unavailable (not Linux)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prev = ctypes.c_int(0)
        if libc.prctl(37, ctypes.byref(prev), 0, 0, 0) != 0:  # PR_GET_CHILD_SUBREAPER
            return None
        if libc.prctl(36, 1 if on else 0, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
            return None
        return bool(prev.value)
    except (OSError, AttributeError):
        return None


@contextmanager
def tracked_children():
    """Every process started inside the block (and every orphan of one) is stopped when it ends."""
    before = children_now()
    was_subreaper = child_subreaper(True)
    try:
        yield
    finally:
        kill_new_children(before)
        if was_subreaper is False:
            child_subreaper(False)


def kill_new_children(before: set, wait_s: float = 10.0, reap: bool = True) -> None:
    """Kill every descendant not in ``before`` and reap them. A killed rank's child can come back to this
    process as a zombie a moment after a first round of reaping (seen under load), so reaping goes on until
    none of them is left below this process (at most ``wait_s``). ``reap=False`` only kills: for a launcher
    that still joins its own processes (accelerate's ``notebook_launcher``)."""
    killed = children_now() - before
    if not killed:
        return
    kill_tree(list(killed))
    end = time.time() + wait_s
    while reap:
        for pid in killed:
            try:
                os.waitpid(pid, os.WNOHANG)
            except OSError:  # not our child (yet: an orphan comes back a moment later), or reaped
                pass
        if not (children_now() & killed) or time.time() >= end:
            return
        time.sleep(0.02)


def process_ended(pid: int) -> tuple:
    """(ended, exit code) of a rank process: a zombie or gone is ended. A zombie's exit status is read from
    /proc without reaping it (multiprocessing still has to join it); negative = killed by that signal."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True, None
    except (OSError, IndexError):
        return False, None
    if fields[0] not in ("Z", "X"):
        return False, None
    try:
        status = int(fields[49])  # field 52, exit_code (Linux >= 3.5)
    except (IndexError, ValueError):
        return True, None
    return True, (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
