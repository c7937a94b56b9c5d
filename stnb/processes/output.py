"""Per-rank output capture: each rank writes to its own log, the parent prints whole lines.

In the rank, ``redirect_output`` points stdout and stderr (Python and C level) at the rank's log
file, so ranks never interleave and never write to the kernel's sockets. In the parent,
``OutputRelay`` reads what each log gained, prints complete lines prefixed ``[rank N]`` and keeps
every rank's full output for ``LaunchInfo.logs`` and ``LaunchError.logs``.
"""

from __future__ import annotations

import os
import sys


def redirect_output(path: str) -> None:
    """Send this rank's stdout/stderr (Python and C level) to its own log file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush() if hasattr(sys.stdout, "flush") else None
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr


class OutputRelay:
    """Relays the ranks' logs to this process's stdout as whole, prefixed lines."""

    def __init__(self, log_path, nproc: int, rank_offset: int = 0, echo: bool = True):
        self.log_path = log_path  # local rank -> path of its log
        self.nproc, self.rank_offset, self.echo = nproc, rank_offset, echo
        self.logs = {r: "" for r in range(nproc)}
        self._offsets = {r: 0 for r in range(nproc)}
        self._partial = {r: "" for r in range(nproc)}

    def any_output(self) -> bool:
        return any(os.path.exists(self.log_path(r)) for r in range(self.nproc))

    def relay(self, final: bool = False) -> None:
        """Print the complete lines every rank wrote since the last call (with ``final``, the
        incomplete last line too)."""
        for r in range(self.nproc):
            try:
                with open(self.log_path(r), "rb") as f:
                    f.seek(self._offsets[r])
                    chunk = f.read()
            except OSError:
                continue
            if not chunk and not (final and self._partial[r]):
                continue
            self._offsets[r] += len(chunk)
            text = self._partial[r] + chunk.decode("utf-8", errors="replace")
            self.logs[r] += chunk.decode("utf-8", errors="replace")
            lines = text.split("\n")
            self._partial[r] = "" if final else lines.pop()
            if final and lines and lines[-1] == "":
                lines.pop()
            if self.echo:
                self._print(r, lines)

    def _print(self, r: int, lines: list) -> None:
        out = []
        for line in lines:
            line = line.rstrip("\r").rsplit("\r", 1)[-1]  # a progress bar's last state
            if line.strip():
                out.append(f"[rank {self.rank_offset + r}] {line}\n")
        if out:
            sys.stdout.write("".join(out))
            sys.stdout.flush()
