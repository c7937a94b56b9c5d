"""Functions the gpu-check runs inside ranks: NCCL collectives on the rank's own GPU, then a fault.

Each fault function first runs one all_reduce on the GPU (the NCCL communicator really exists),
notes its pid in ``<mark>.pid<rank>`` and, in the faulting rank, writes the wall-clock time of the
fault to ``mark`` just before it (so the check measures "fault -> error in the notebook").
With one rank the fault has no peer to wait for it, so the rank faults after its collective;
with two or more, the other ranks wait for the faulting one inside an NCCL collective, the case
in which NCCL itself would hang for its watchdog timeout (minutes).
"""

from __future__ import annotations

import os
import signal
import time

from stnb.files import write_atomic
from stnb.hardware import rank_gpu


def _device():
    import torch

    from stnb.processes import rank_context

    ctx = rank_context()
    local = ctx.local_rank if ctx is not None else int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(f"cuda:{rank_gpu(local)}" if torch.cuda.is_available() and (ctx is None or ctx.device == "cuda")
                        else "cpu")


def _mark(mark: str) -> None:
    write_atomic(mark, repr(time.time()))


def _start(mark: str):
    """All-reduce once on this rank's device; leave this rank's pid next to the mark."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    with open(f"{mark}.pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    t = torch.ones(4, device=_device())
    dist.all_reduce(t)
    assert t[0].item() == dist.get_world_size(), f"all_reduce gave {t[0].item()}"
    return rank, dist.get_world_size()


def _wait_in_collective() -> None:
    """Block in an NCCL all_reduce that the faulting rank never joins (.item() waits for it)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4, device=_device())
    dist.all_reduce(t)
    t.sum().item()


def rank_pids(mark: str) -> list:
    import glob

    return [int(open(p).read()) for p in sorted(glob.glob(f"{glob.escape(mark)}.pid*"))]


def raise_after_collective(mark: str, bad_rank: int = 1) -> int:
    """``bad_rank`` (the last rank when there are fewer) raises; the others wait for it in all_reduce."""
    rank, world = _start(mark)
    bad = min(bad_rank, world - 1)
    if rank == bad:
        time.sleep(0.5)
        _mark(mark)
        raise ValueError(f"deliberate failure in rank {rank} (gpu-check)")
    _wait_in_collective()
    return rank


def sigkill_after_collective(mark: str, bad_rank: int = 1) -> int:
    """``bad_rank`` is SIGKILLed (like the OOM killer would); the others wait for it in all_reduce."""
    rank, world = _start(mark)
    bad = min(bad_rank, world - 1)
    if rank == bad:
        time.sleep(0.5)
        print(f"rank {rank} about to be SIGKILLed", flush=True)
        _mark(mark)
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_in_collective()
    return rank


def stall_in_collective(mark: str, bad_rank: int = 1) -> int:
    """``bad_rank`` blocks in one long GPU kernel it waits for (its Python stack never moves); with
    peers, they wait for it in all_reduce. Nobody heartbeats: stnb's stall watchdog must fire."""
    import torch

    rank, world = _start(mark)
    bad = min(bad_rank, world - 1)
    _mark(mark)
    if rank == bad:
        if _device().type == "cuda":
            torch.cuda._sleep(2 ** 62)  # a GPU spin loop far longer than any stall limit  # STALL-HERE
            torch.cuda.synchronize()
        else:  # gloo ranks (the CPU tests of this check): one blocking C call
            time.sleep(3600)  # STALL-HERE
    else:
        _wait_in_collective()
    return rank
