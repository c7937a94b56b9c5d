"""N independent single-device runs at the same time (one per device; one per core on CPU): the machine's
limit with no communication. Each rank leaves its process group before training; ``finish`` merges each
report as a run of its own and sums them (``independent=True``), so the RunResult is decided there."""

from __future__ import annotations

import os
import time

from stnb.launchers import Launcher, Plan, finish

_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE",
              "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Concurrent(Launcher):
    """``config.extra['concurrent_runs']`` (default: one per core on CPU, one per GPU) independent runs of
    ``config`` side by side, started through ``stnb.launch`` (launcher 'concurrent'); ``timeout`` in seconds."""

    name = "concurrent"

    def __init__(self, timeout: float):
        self.timeout = timeout

    def check(self, plan: Plan) -> None:
        from stnb.hardware import cpu_cores, gpu_count

        config = plan.config
        config.validate()
        plan.device = config.resolved_device()
        self.runs = int(config.extra.get("concurrent_runs") or (cpu_cores() if plan.device == "cpu" else gpu_count()))
        plan.build.check_inputs(config)  # stnb's recipe: its model resolved once, here, and its data checked

    def start(self, plan: Plan) -> list:
        from stnb.processes import launch

        config = plan.config
        plan.t0 = time.time()
        return launch(independent_rank, config, plan.build, plan.t0, num_processes=self.runs,
                      timeout=self.timeout, stall_timeout=config.stall_timeout, device=plan.device,
                      threads_per_rank=config.threads_per_rank, echo=False)

    def deliver(self, plan: Plan, reports: list):
        return finish(plan, reports, self.name, independent=True)


def independent_rank(cfg, build, launch_time: float):
    """One of N independent single-device runs started together (no process group while training)."""
    import torch.distributed as dist

    from stnb.training import train_rank

    if dist.is_initialized():
        dist.barrier()  # start together
        dist.destroy_process_group()
    for k in _RANK_VARS:
        os.environ.pop(k, None)
    return train_rank(cfg, build, launch_time)
