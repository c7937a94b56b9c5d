"""single: one device, no wrapper (the baseline every other strategy is compared with)."""

from __future__ import annotations

from .base import Strategy
from .stepcost import step


class Single(Strategy):
    name = "single"
    label = "single device"
    summary = "one device, no wrapper"
    color = "#7f7f7f"
    distributed = False
    baseline = True
    order = 10
    bench = True

    def step_time(self, m, fab, n, host_fraction=None):
        """The measured step (n = 1)."""
        return step(m.step, 0.0, 0.0)

    def check_prepared(self, trainer, world_size):
        import torch

        wrapped = trainer.model_wrapped
        problems = []
        if isinstance(wrapped, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            problems.append(f"single run was wrapped in {type(wrapped).__name__}")
        return {}, problems

    def check_ranks(self, rank_results, world_size):
        return {}, []
