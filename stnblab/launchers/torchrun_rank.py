"""One rank of the bench's ``torchrun`` comparison (``python -m stnblab.bench worker``): stnb's External
launcher (train here, gather to rank 0, rank 0 merges and shares the RunResult), its clock started when the
bench called torchrun, so the time to the first step counts torchrun's own start."""

from __future__ import annotations

from stnb.launchers import Plan
from stnb.launchers.external import External


class TorchrunRank(External):
    """External, with the run's start at ``launch_time`` (seconds since the epoch) instead of this process's."""

    def __init__(self, launch_time: float):
        super().__init__()
        self.launch_time = launch_time

    def check(self, plan: Plan) -> None:
        super().check(plan)
        plan.t0 = self.launch_time
