"""stnb's own ranks (``stnb.launch`` from this process) without ``TrainConfig.validate``: the GPU check runs
what validate refuses users, fsdp with ONE NCCL rank (a 1-rank fsdp "shards nothing"), to exercise NCCL's
start, FSDP2's sharding and the trainer on one GPU. Only the model and the device are resolved."""

from __future__ import annotations

from stnb.launchers import Plan
from stnb.launchers.local import Local


class Unchecked(Local):
    """Local's start, with a check that resolves the model and the device and refuses nothing."""

    def check(self, plan: Plan) -> None:
        from stnb.hardware import start_method

        plan.build.check_inputs(plan.config)  # the recipe's model resolved (and its data checked)
        plan.device = plan.config.resolved_device()
        self.method = start_method(plan.config.start_method)
