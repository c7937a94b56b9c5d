"""The result channel between the launching process and its ranks.

Per rank, a temporary folder holds its output log, its result (pickled), its error record (JSON) and its
stack dump; a lock-free shared-memory array holds its live numbers (pid, state, last progress, heartbeats,
step, total, loss), one row per rank, written one double at a time (a rank killed mid-write blocks no one)
and read by the parent's watchdog. ``RankState`` is one rank's row as ``on_progress`` receives it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawArray

from ..files import write_atomic

# one row of the shared array per rank
_BEAT, _STEP, _TOTAL, _LOSS, _STATE, _PID, _BEATS = range(7)
_SLOTS = 7

#: SETTING_UP: checked in, joining the process group (on GPUs: the CUDA context, NCCL's communicator), not yet
#: running the function; the stall limit does not count there (a first NCCL collective can take longer)
STARTING, RUNNING, DONE, FAILED, SETTING_UP = 0.0, 1.0, 2.0, 3.0, 4.0
_STATE_NAMES = {STARTING: "starting", RUNNING: "running", DONE: "done", FAILED: "failed", SETTING_UP: "setting up"}


@dataclass
class RankState:
    """One rank's progress as seen from the parent (passed to ``on_progress``)."""

    rank: int
    state: str
    step: int
    total: int
    loss: float | None
    seconds_since_progress: float


class Channel:
    """Where ranks leave their output, result, error and progress for the parent to read.

    A context manager: the temporary folder is removed on exit."""

    def __init__(self, nproc: int):
        self.nproc = nproc
        self.dir = tempfile.mkdtemp(prefix="stnb-launch-")
        self.shm = RawArray("d", nproc * _SLOTS)
        for r in range(nproc):
            self._set(r, _LOSS, float("nan"))

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, kind: str, rank: int) -> str:
        """The file of ``kind`` ('log', 'result', 'error', 'stack') for local rank ``rank``."""
        return os.path.join(self.dir, f"{kind}-{rank}")

    def _set(self, rank: int, slot: int, value: float) -> None:
        self.shm[rank * _SLOTS + slot] = value

    def _get(self, rank: int, slot: int) -> float:
        return self.shm[rank * _SLOTS + slot]

    # rank side ---------------------------------------------------------------------------
    def check_in(self, rank: int) -> None:
        """The rank is alive and setting up: its pid, and progress as of now."""
        self._set(rank, _PID, os.getpid())
        self._set(rank, _BEAT, time.time())
        self._set(rank, _STATE, SETTING_UP)

    def set_up(self, rank: int) -> None:
        """The rank joined its world and runs the function: the stall limit counts from now."""
        self._set(rank, _BEAT, time.time())
        self._set(rank, _STATE, RUNNING)

    def set_state(self, rank: int, state: float) -> None:
        self._set(rank, _STATE, state)

    def bump(self, rank: int) -> None:
        """One heartbeat."""
        self._set(rank, _BEATS, self._get(rank, _BEATS) + 1.0)

    def heartbeats(self, rank: int) -> float:
        return self._get(rank, _BEATS)

    def mark_progress(self, rank: int, when: float) -> None:
        self._set(rank, _BEAT, when)

    def report(self, rank: int, step: int, total: int | None, loss: float | None) -> None:
        self._set(rank, _STEP, step)
        if total is not None:
            self._set(rank, _TOTAL, total)
        if loss is not None:
            self._set(rank, _LOSS, float(loss))
        self.bump(rank)

    def write_result(self, rank: int, data: bytes) -> None:
        write_atomic(self.path("result", rank), data, 0o600)

    def write_error(self, rank: int, record: dict) -> None:
        write_atomic(self.path("error", rank), json.dumps(record).encode(), 0o600)

    # parent side -------------------------------------------------------------------------
    def state(self, rank: int) -> float:
        return self._get(rank, _STATE)

    def last_progress(self, rank: int) -> float:
        return self._get(rank, _BEAT)

    def started(self, rank: int) -> bool:
        return self._get(rank, _PID) > 0

    def pids(self) -> dict:
        """{local rank: pid} of the ranks that have started."""
        return {r: int(self._get(r, _PID)) for r in range(self.nproc) if self.started(r)}

    def states(self) -> list:
        """Every rank's ``RankState`` now."""
        now = time.time()
        out = []
        for r in range(self.nproc):
            beat, loss = self._get(r, _BEAT), self._get(r, _LOSS)
            out.append(RankState(rank=r, state=_STATE_NAMES.get(self.state(r), "?"),
                                 step=int(self._get(r, _STEP)), total=int(self._get(r, _TOTAL)),
                                 loss=None if loss != loss else loss,  # NaN until a loss is reported
                                 seconds_since_progress=(now - beat) if beat else 0.0))
        return out

    def has_result(self, rank: int) -> bool:
        return os.path.exists(self.path("result", rank))

    def read_result(self, rank: int):
        """The rank's returned value; FileNotFoundError when it returned none."""
        with open(self.path("result", rank), "rb") as f:
            return pickle.load(f)

    def read_error(self, rank: int) -> dict | None:
        try:
            with open(self.path("error", rank)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def read_stack(self, rank: int) -> str:
        try:
            with open(self.path("stack", rank)) as f:
                return f.read()
        except OSError:
            return ""

    def is_silent(self, rank: int) -> bool:
        """The rank left neither a result nor an error record."""
        return not self.has_result(rank) and self.read_error(rank) is None
