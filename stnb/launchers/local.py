"""Ranks forked or spawned from this process (a notebook kernel, a script): ``stnb.launch``.

ddp / fsdp start N ranks; single / dp one child process, so CUDA never touches the kernel. The
ranks run ``training.train_rank`` and their RankReports come back through ``stnb.launch``'s channel.
"""

from __future__ import annotations

import time

from .bars import StepBars
from .base import Launcher, Plan, check_plan, rank_env


class Local(Launcher):
    """The ranks on this machine, started by ``stnb.launch`` (launcher 'stnb')."""

    name = "stnb"

    def check(self, plan: Plan) -> None:
        from ..hardware import start_method as resolve_start_method

        check_plan(plan, plan.config, machine=lambda config: config.check_hardware())  # this machine's cores or GPUs
        self.method = resolve_start_method(plan.config.start_method)

    def start(self, plan: Plan) -> list:
        from ..processes import launch
        from ..training import train_rank

        config, device = plan.config, plan.device
        plan.t0 = time.time()  # the wall time counts from here, after the checks
        if self.method == "fork":
            preimport_training_stack()
        ws = config.world_size()
        strategy = config.strategy_object()
        env = {}
        if device == "cuda" and strategy.pinned_to_one_gpu():
            from ..hardware import single_gpu_env

            env = single_gpu_env()
        env.update(rank_env(config, device))
        on_progress, bars = plan.on_progress, None
        if on_progress is None and plan.echo:
            bars = StepBars(config.strategy)
            on_progress = bars.update
        try:
            # the requested world size travels as an argument, apart from the environment the launcher sets
            return launch(train_rank, config, plan.build, plan.t0, ws, num_processes=ws,
                          timeout=config.timeout, stall_timeout=config.stall_timeout, device=device,
                          threads_per_rank=config.threads_per_rank, on_progress=on_progress, echo=plan.echo,
                          distributed=strategy.distributed, env=env, start_method=self.method,
                          share_gpus=config.share_gpus)
        finally:
            if bars is not None:
                bars.close()


def preimport_training_stack() -> None:
    """Import the training stack once in this process: forked ranks inherit it instead of each
    importing it again (6-8 CPU seconds per rank). None of it initialises CUDA."""
    import sentence_transformers  # noqa: F401
    import sentence_transformers.sentence_transformer.losses  # noqa: F401
    import sentence_transformers.sentence_transformer.evaluation  # noqa: F401
    import transformers.trainer  # noqa: F401
