"""Process-tree cleanup: no process a launch started survives it.

torch elastic stops the rank processes it started when one of them fails (SIGTERM, then
SIGKILL); it does not look below them. stnb adds the rest of the tree: ``tracked_children``
makes this process the child subreaper while a launch runs (so a process a rank started and then
orphaned, or a daemon that double-forked, stays a descendant of this process) and, when the launch
ends, kills every descendant that appeared meanwhile. ``kill_tree`` is how (the watchdog uses it
to stop ranks too); ``process_ended`` reads a rank's exit status without reaping it.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager


def children_now() -> set:
    """The pids of every descendant of this process right now."""
    import psutil

    try:
        return {c.pid for c in psutil.Process().children(recursive=True)}
    except psutil.NoSuchProcess:  # pragma: no cover
        return set()


def kill_tree(pids) -> None:
    """SIGKILL the given processes and all their descendants; wait until they are dead.

    Dead, not reaped: the ranks are children of multiprocessing / torchelastic, which must
    collect their exit status themselves. (psutil.wait_procs reaped them; multiprocessing then
    got ECHILD, believed the rank alive forever, and a 1-rank launch hung after a stall.)"""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs.extend(p.children(recursive=True))
            procs.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    end = time.time() + 5
    while procs and time.time() < end:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        procs = alive
        if procs:
            time.sleep(0.02)


def child_subreaper(on: bool) -> bool | None:
    """Make this process the child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``) or stop being one.

    While a launch runs, a process its ranks started whose parent dies (a killed rank's child, a
    daemon that double-forked and called setsid) is re-parented to this process instead of to init,
    so it stays a descendant: the cleanup after the launch finds and stops every process the
    launch started, not only those still hanging below a living rank. Returns the previous setting,
    or None where the call is unavailable (not Linux), where only descendants are found."""
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
    was_subreaper = child_subreaper(True)  # orphans of the ranks come back to this process
    try:
        yield
    finally:
        kill_new_children(before)
        if was_subreaper is False:
            child_subreaper(False)


def kill_new_children(before: set, wait_s: float = 10.0, reap: bool = True) -> None:
    """Kill every descendant of this process not in ``before`` and reap the zombies among them
    (with ``child_subreaper`` set, that includes orphans the ranks left behind). A killed rank's child can
    outlive its parent by a moment and come back to this process as a zombie after a first round of
    reaping (seen under load: a zombie left after a launch), so the reaping goes on until none of the
    killed processes is left below this one (at most ``wait_s``). Processes started after the kill (a
    cluster engine replacing its workers) are not this call's. ``reap=False`` only kills: for a launcher
    that still joins its own processes (accelerate's ``notebook_launcher``; a reaped process breaks its
    join)."""
    killed = children_now() - before
    if not killed:
        return
    kill_tree(list(killed))
    if not reap:
        return
    end = time.time() + wait_s
    while True:
        for pid in killed:  # reap zombies so they don't linger in the kernel's process table
            try:
                os.waitpid(pid, os.WNOHANG)
            except OSError:  # not our child (yet: an orphan comes back to us a moment later), or already reaped
                pass
        if not (children_now() & killed) or time.time() >= end:
            return
        time.sleep(0.02)


def process_ended(pid: int) -> tuple:
    """(ended, exit code) of a rank process: a zombie or gone is ended. A zombie's exit status is
    read from /proc without reaping it (multiprocessing still has to join it); negative = signal."""
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
