"""``TimeSplit``: where each training step's time goes (data, forward, backward compute, communication,
optimizer), measured by ``stnb.timesplit.StepTimer`` (its docstring has the method).

At the first step's begin the timer attaches to the module that trains (forward hooks, the backward
wrapped, DDP's communication hook timed; a barrier every rank leaves together is its origin). It reads the
steps' begin and end from the rank's step clock (``StepLog``), so the split adds up to the step times; after an
evaluation between steps the next step begins where the evaluation ended, as ``StepLog`` times it.
"""

from __future__ import annotations

from ..timesplit import StepTimer
from .base import Instrument


class TimeSplit(Instrument):
    """Per-step phase readings of this rank (``StepTimer``), reported as ``time_split``."""

    after = ("StepLog",)  # its phases are read on StepLog's clock: the step's begin and end as step_times

    def __init__(self, trainer, steps, ddp_hook: tuple = ("none", None)):
        self.trainer = trainer
        self.steps = steps            # the StepLog: its clock times the steps
        self.ddp_hook = ddp_hook      # (name, torch hook): the DDP communication hook the run asks for (Strategy.ddp_hook)
        self.timer = StepTimer()
        self.attached = False

    @classmethod
    def for_rank(cls, rank):
        return cls(rank.trainer, rank.made["StepLog"], rank.strategy.ddp_hook(rank.config))

    def timed(self, hook):
        """``hook`` (a DDP communication hook a strategy registers itself) timed like the built-in ones."""
        return self.timer.timed(hook)

    def on_step_begin(self, args, state, control, **kw):
        if not self.attached:
            self.attached = True
            self.timer.attach(self.trainer, self.ddp_hook)  # registers DDP's comm hook, timed
            self.timer.on_step_begin(self.steps.began)  # steps timed as step_times are

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.timer.on_pre_optimizer_step()

    def on_optimizer_step(self, args, state, control, **kw):
        self.timer.on_optimizer_step()

    def on_step_end(self, args, state, control, **kw):
        self.timer.on_step_end(self.steps.last_end)

    def on_evaluate(self, args, state, control, **kw):
        self.timer.resume(self.steps.last_end)  # the next step begins where the evaluation ended

    on_save = on_evaluate  # and where a checkpoint ended

    def report(self) -> dict:
        return {"time_split": self.timer.summary()}
