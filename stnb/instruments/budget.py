"""``MemoryBudget``: the rank's memory budget (``memory_budget_gib``; ``stnb.budget`` says how it is enforced).

Made first thing in the rank: the rest of the rank runs inside the limit (``whole_rank``), where an allocation
past it fails as ``OutOfMemory`` that names what fits; once the trainer is built (a user's model: the first
moment its size is known) the model state it predicts is checked against the budget. Verification:
``memory_budget`` (the limit, how it is enforced, what the rank held at its start and its end; {} without one).
"""

from __future__ import annotations

from ..budget import Budget
from .base import Instrument


class MemoryBudget(Instrument):
    """``stnb.budget.Budget`` in the rank: applied around it, the built model checked, reported."""

    after = ("MemoryUse",)  # the model's shape as MemoryUse measured it when built, and its peak, explain an
    # out-of-memory failure
    made_at = "start"

    def __init__(self, budget: Budget):
        self.budget = budget

    @classmethod
    def for_rank(cls, rank):
        return cls(Budget(rank.config, rank.here, rank.made["MemoryUse"], recipe=rank.build.name is None))

    def whole_rank(self):
        return self.budget.enforced()

    def on_built(self, rank) -> None:
        self.budget.check_model()  # a budget below the model state it predicts (a user's model: known only now)

    def verification(self) -> tuple[dict, list]:
        return {"memory_budget": self.budget.report()}, []
