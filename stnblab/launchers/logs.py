"""What the bench's launchers share: a log the ranks' output goes to and its telling tail."""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def output_to(path: str):
    """Send this process's (and its forked children's) stdout/stderr to ``path`` for a while."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for x in (fd, *saved):
            os.close(x)


def tail(path: str, n: int = 25) -> str:
    """The last ``n`` lines of a log, preceded by its first error lines (the cause, not the echo)."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    keys = ("Error", "error:", "Traceback", "terminate called", "what():", "Abort", "Exception")
    first = [ln for ln in lines[:-n] if any(k in ln for k in keys)][:12]
    return "\n".join(first + (["..."] if first else []) + lines[-n:])

