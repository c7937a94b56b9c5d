"""Which rank really failed: the origin, told apart from the ranks that failed because of it.

When one rank fails, its peers fail too, inside the collective they were waiting in: gloo says its
peer closed the connection, NCCL's watchdog reports a timeout or an aborted communicator. Those are
consequences. The origin is the earliest error that is not such a consequence; a peer's
consequence alone points at the ranks that never joined the collective.

NCCL process groups get settings that make a peer *fail* instead of hanging for NCCL's default 10
minutes: asynchronous error handling (the watchdog aborts the communicator and ends the process) and
a bounded collective timeout (gloo groups get the same bound). Waiting for rank 0's evaluation and
save is not such a collective: ``wait_for_all`` waits on a gloo group of its own, made when the rank
joins (``open_wait_group``), which that bound does not cut short.
"""

from __future__ import annotations

import datetime

__all__ = ["SECONDARY_MESSAGES", "is_secondary", "origin", "nccl_env", "collective_timeout", "open_wait_group",
           "wait_for_all"]

#: what a collective raises in a rank whose peer died, hung or aborted (gloo, then NCCL / c10d)
SECONDARY_MESSAGES = (
    "Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe",
    "NCCL error", "NCCL communicator was aborted", "Watchdog caught collective operation timeout",
    "ProcessGroupNCCL", "Connection closed by remote peer", "remote process exited or there was a network error",
    "NCCL communicator encountered error", "Some NCCL operations have failed or timed out",
)
SECONDARY_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")

#: NCCL collectives wait at most this long (or twice the stall timeout, if longer): rank 0 may
#: evaluate or save while the others wait in a barrier; the stall watchdog catches real hangs sooner
MIN_COLLECTIVE_TIMEOUT_S = 300.0
#: how long ranks wait for each other in ``wait_for_all`` (rank 0 evaluating / saving a large model);
#: a real hang is ended sooner by the stall watchdog (no rank moves) or the launch's timeout
WAIT_TIMEOUT_S = 24 * 3600.0

_WAIT_GROUP = None  # set in a rank by open_wait_group


def is_secondary(record: dict) -> bool:
    """The error record (type, message) is what a peer's failure makes a rank raise."""
    message = record.get("message") or ""
    return record.get("type") in SECONDARY_TYPES or any(m in message for m in SECONDARY_MESSAGES)


def origin(records: list) -> dict | None:
    """The earliest error that is not a consequence of another rank's failure (else the earliest)."""
    if not records:
        return None
    primary = [r for r in records if not is_secondary(r)]
    return min(primary or records, key=lambda r: r["time"])


def nccl_env() -> dict:
    """Environment for NCCL ranks: the watchdog aborts a failed or timed-out collective and ends the
    process (torchelastic's own default too; set here for ranks stnb forks itself). A value the user
    set is kept."""
    import os

    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


def collective_timeout(stall_timeout: float | None) -> datetime.timedelta:
    """The process-group timeout for NCCL ranks."""
    seconds = max(MIN_COLLECTIVE_TIMEOUT_S, 2 * stall_timeout) if stall_timeout else 600.0
    return datetime.timedelta(seconds=seconds)


def open_wait_group() -> None:
    """In every rank, right after ``init_process_group``: the gloo group ``wait_for_all`` waits on."""
    global _WAIT_GROUP
    import torch.distributed as dist

    _WAIT_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=WAIT_TIMEOUT_S))


def wait_for_all() -> None:
    """Every rank waits here until all have arrived, however long rank 0 takes to evaluate or save: on
    the wait group (a barrier on the default group is a collective, which the collective timeout,
    300 s, would abort after training finished). Outside stnb.launch: a barrier on the default group."""
    import torch.distributed as dist

    dist.barrier(group=_WAIT_GROUP)
