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


#: warnings every rank would print that say nothing the user can act on, each filtered by its exact text
#: (a notebook showed ten of them in one cell); anything else still prints
HARMLESS_WARNINGS = (
    # torch's DataLoader on a CPU-only run: pinning host memory only helps copies to a GPU, and there is none
    (r"'pin_memory' argument is set as true but no accelerator is found", UserWarning),
    # sentence-transformers' gather_across_devices calls a torch function torch 2.13 deprecates; the user
    # has nothing to change (their code does not call it)
    (r"torch\.distributed\.nn\.functional\.all_gather is deprecated", FutureWarning),
)
#: sentence-transformers logs this under DDP and then sets drop_last itself: a note on what it did
DROP_LAST_NOTE = "When using DistributedDataParallel (DDP), it is recommended to set `dataloader_drop_last=True`"
#: DeepSpeed logs this on import when it finds no GPU ("... If you have GPU or other accelerator, we were unable to
#: detect it."); stnb imports it that way only with a CPU build of torch (forksafe), where there is none to find
DEEPSPEED_CPU_NOTE = "Setting accelerator to CPU."


def _not_drop_last_note(record) -> bool:
    return not str(record.msg).startswith(DROP_LAST_NOTE)


def not_deepspeed_cpu_note(record) -> bool:
    """A filter for DeepSpeed's logger ("DeepSpeed"): False for its CPU note above."""
    return not str(record.msg).startswith(DEEPSPEED_CPU_NOTE)


def _not_new_head_report(record) -> bool:
    """False for transformers' LOAD REPORT when its only rows are a classification head the checkpoint does
    not have (``classifier.*`` MISSING): a CrossEncoder built from a SentenceTransformer checkpoint gets a
    new head by design, and the report (ANSI escapes included) says only that. Any other report stays."""
    msg = str(record.msg)
    if "LOAD REPORT" not in msg:
        return True
    rows = [ln.split("|") for ln in msg.splitlines() if ln.count("|") >= 2]
    rows = [(key.strip(), status.strip()) for key, status, *_ in rows if key.strip() not in ("Key", "")]
    rows = [(k, s) for k, s in rows if not set(k) <= set("-+")]
    return not rows or not all(k.startswith("classifier.") and "MISSING" in s for k, s in rows)


def quiet_known_harmless() -> None:
    """In a rank: leave out the known-harmless warnings above, by their own text and logger; nothing else."""
    import logging
    import warnings

    for message, category in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    logging.getLogger("sentence_transformers.base.training_args").addFilter(_not_drop_last_note)
    logging.getLogger("transformers.modeling_utils").addFilter(_not_new_head_report)
