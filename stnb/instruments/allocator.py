"""``AllocatorRelease``: how this rank's CPU allocator keeps and gives back freed memory (``stnb.cpualloc``).

Made at the rank's start: on CPU (``TrainConfig.reuse_freed_memory``, default True) glibc keeps large
freed blocks for reuse (``reuse_freed_memory``: this process only, never the notebook kernel). A rank under a
CPU memory budget (``memory_budget_gib``) gives freed blocks back at once instead (``return_freed_memory``): the
budget counts what the process maps, so kept free blocks would count as held. As a callback, in CPU runs of a
strategy that gathers parameters during its steps, it gives the freed heap pages back at every step's end
(``release_each_step``; ``STNB_RELEASE_FREED=off`` turns it off).
"""

from __future__ import annotations

from .. import cpualloc
from .base import Instrument


#: why a rank under a CPU memory budget does not keep freed blocks (its verification's ``reuse_freed_memory``)
BUDGET_REASON = ("memory_budget_gib: freed blocks above 1 MiB go back to the kernel at once, so the budget counts "
                 "memory in use, not the blocks glibc would keep")


class AllocatorRelease(Instrument):
    """Applies the allocator setting at construction; reports it and what each step's end gave back."""

    after = ("StepLog", "MemoryUse")  # memory goes back after the step's clock stopped and its peak was read
    made_at = "start"  # before anything is built: the allocator keeps (or gives back) the rank's freed memory

    def __init__(self, reuse_freed_memory: bool, cuda: bool, gathers_during_step: bool, budget: bool = False):
        self.reuse = {"applied": False, "reason": "GPU run" if cuda else "off (reuse_freed_memory=False)"}
        if not cuda and budget:  # this process only: a rank, never the notebook kernel
            self.reuse = {"applied": False, "reason": BUDGET_REASON, "returned": cpualloc.return_freed_memory()}
        elif not cuda and reuse_freed_memory:
            self.reuse = cpualloc.reuse_freed_memory()
        # CPU, a strategy that gathers parameters in its steps: freed memory goes back at each step's end
        self.each_step = cpualloc.release_each_step("cuda" if cuda else "cpu", gathers_during_step)
        self.released: list = []     # what each step's end gave back (bytes)

    @classmethod
    def for_rank(cls, rank):
        config = rank.config
        return cls(config.reuse_freed_memory, rank.here.cuda, bool(rank.strategy.gathered_during_step),
                   budget=config.memory_budget_gib is not None)

    def on_step_end(self, args, state, control, **kw):
        if self.each_step:
            self.released.append(cpualloc.release_freed_memory())

    def verification(self) -> tuple[dict, list]:
        return {"reuse_freed_memory": self.reuse, "released_each_step": self.released if self.each_step else None}, []
