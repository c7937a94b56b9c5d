"""The strategies stnb knows, and the facts every other module asks about them (one table).

``distributed``: one process per device in a torch.distributed process group (ddp, fsdp);
the others run in one process (single, dp). ``min_gpus``: GPUs the strategy needs at all
(dp splits a batch across GPUs inside one process, so it needs at least 2). ``shards``:
each rank holds only part of the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    distributed: bool
    min_gpus: int
    shards: bool
    summary: str


TABLE = {s.name: s for s in (
    Strategy("single", distributed=False, min_gpus=0, shards=False, summary="one device, no wrapper"),
    Strategy("dp", distributed=False, min_gpus=2, shards=False,
             summary="torch.nn.DataParallel: one process, the batch split across its GPUs"),
    Strategy("ddp", distributed=True, min_gpus=0, shards=False,
             summary="DistributedDataParallel: one process per device, gradients all-reduced"),
    Strategy("fsdp", distributed=True, min_gpus=0, shards=True,
             summary="FSDP2 fully_shard: one process per device, parameters sharded"),
)}

STRATEGIES = tuple(TABLE)
DISTRIBUTED = tuple(name for name, s in TABLE.items() if s.distributed)   # ("ddp", "fsdp")
ONE_PROCESS = tuple(name for name, s in TABLE.items() if not s.distributed)  # ("single", "dp")


def is_distributed(strategy: str) -> bool:
    """True for the strategies that run one process per device (an unknown name: KeyError)."""
    return TABLE[strategy].distributed
