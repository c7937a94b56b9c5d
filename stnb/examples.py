"""Small functions the notebooks launch in every rank: ``stnb.launch(examples.hello, num_processes=2)``.

They live in the package, so the same functions also run from a script under torchrun (a
function defined in a cell runs in forked and spawned ranks too: notebook 00). Each
returns plain data (numbers, lists, dicts) that ``stnb.launch`` brings back to the notebook.
All of them work on CPU (gloo) and on GPUs (NCCL: tensors go to the rank's own GPU).
"""

from __future__ import annotations

import os
import socket

from .hardware import rank_gpu

__all__ = ["hello", "allreduce_check", "batch_shards", "inbatch_negatives", "fail_on"]


def _rank_world_device():
    import torch
    import torch.distributed as dist

    from .processes import rank_context

    ctx = rank_context()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = ctx.local_rank if ctx is not None else int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = ctx is not None and ctx.device == "cuda" and torch.cuda.is_available()
    return rank, world, torch.device(f"cuda:{rank_gpu(local)}" if on_gpu else "cpu")


def hello() -> dict:
    """Who am I? Every rank prints one line and returns what it knows about the launch."""
    import torch.distributed as dist

    from .processes import rank_context

    ctx = rank_context()
    rank, world, device = _rank_world_device()
    print(f"hello from rank {rank} of {world} (pid {os.getpid()}, device {device})")
    return {"rank": rank, "world_size": world, "local_rank": ctx.local_rank if ctx else 0,
            "device": str(device), "backend": dist.get_backend() if dist.is_initialized() else None,
            "pid": os.getpid(), "host": socket.gethostname(), "threads": ctx.threads if ctx else None}


def allreduce_check() -> dict:
    """Rank r contributes r + 1; after ``all_reduce(SUM)`` every rank holds 1 + 2 + ... + N."""
    import torch
    import torch.distributed as dist

    rank, world, device = _rank_world_device()
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return {"rank": rank, "contributed": rank + 1, "sum": t.item(), "expected": world * (world + 1) / 2}


def batch_shards(dataset_size: int = 16, per_device_batch_size: int = 4, seed: int = 0, steps: int = 2) -> dict:
    """Which samples this rank trains on in the first ``steps`` steps.

    Uses accelerate's ``BatchSamplerShard``, which is how the Hugging Face Trainer (and so the
    sentence-transformers trainer) splits batches between ranks: one shuffled order of the data
    is cut into batches of ``per_device_batch_size``; in every step rank r takes the r-th of the
    next N batches. Together the ranks see one global batch of N x per_device_batch_size samples.
    """
    import torch
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, RandomSampler

    rank, world, _ = _rank_world_device()
    order = RandomSampler(range(dataset_size), generator=torch.Generator().manual_seed(seed))
    batches = BatchSampler(order, per_device_batch_size, drop_last=True)
    shard = BatchSamplerShard(batches, num_processes=world, process_index=rank)
    mine = []
    for i, batch in enumerate(shard):
        if i == steps:
            break
        mine.append([int(j) for j in batch])
    return {"rank": rank, "batches": mine}


def inbatch_negatives(per_device_batch_size: int = 4, dim: int = 8, gather: bool = False, seed: int = 0) -> dict:
    """The score matrix MultipleNegativesRankingLoss builds on this rank, with and without gathering.

    Each rank embeds its own (anchor, positive) pairs. Without gathering, every anchor is scored
    against this rank's positives only: a (B, B) matrix, B - 1 negatives per anchor. With
    ``gather=True`` the positives of every rank are all-gathered first (sentence-transformers'
    ``all_gather_with_grad``, what ``gather_across_devices=True`` does): (B, N*B), N*B - 1 negatives.
    """
    import torch
    import torch.distributed as dist

    rank, world, device = _rank_world_device()
    gen = torch.Generator().manual_seed(seed + rank)
    anchors = torch.randn(per_device_batch_size, dim, generator=gen).to(device)
    positives = torch.randn(per_device_batch_size, dim, generator=gen).to(device).requires_grad_()
    candidates = positives
    if gather and dist.is_initialized():
        import warnings

        import torch.distributed.nn  # all_gather that keeps gradients, as sentence-transformers uses

        with warnings.catch_warnings():  # torch 2.13 marks it deprecated; sentence-transformers still uses it
            warnings.simplefilter("ignore", FutureWarning)
            candidates = torch.cat(torch.distributed.nn.all_gather(positives), dim=0)
    scores = anchors @ candidates.T
    return {"rank": rank, "scores_shape": list(scores.shape), "negatives_per_anchor": scores.shape[1] - 1}


def fail_on(rank_to_fail: int = 1) -> dict:
    """Raise on one rank (to see how stnb.launch reports a failing rank); the others return."""
    rank, world, _ = _rank_world_device()
    if rank == rank_to_fail:
        raise ValueError(f"rank {rank} was asked to fail")
    return {"rank": rank, "world_size": world}
