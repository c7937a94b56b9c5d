"""``MemoryUse``: a rank's peak memory, the training steps apart from the whole run, and where it goes.

Made at the rank's start (the peak is growth over the resident size then; ``stnb.memory.PeakMemory``): told
when the trainer is built and prepared, it marks both (``stnb.memsplit.MemorySplit``), and the rank trains
inside ``training()``, so rank 0's evaluation, FSDP's gathered full copy and the save/reload count in
the whole run's peak only, and so does an evaluation the trainer runs between two steps (the dev curve: from
a step's end that asks for one to the evaluation's end). As a callback it measures the model's and optimizer's
tensors after the first optimizer step (``memory.measure``) and counts the activations of the first training forwards.
"""

from __future__ import annotations

from contextlib import contextmanager

from .. import memory
from ..memsplit import MemorySplit
from .base import Instrument, step_was_skipped


class MemoryUse(Instrument):
    """The rank's peaks, the split of the training peak (``memsplit``), and the memory prediction's inputs
    (``model_shape``: the model as built, before sharding)."""

    after = ("TimeSplit",)  # at the first optimizer step the time split marks the optimizer's end first: measuring
    # the tensors takes time that is not the step's
    made_at = "start"

    def __init__(self, cuda: bool, strategy):
        self.strategy = strategy     # what it holds beyond the model's and optimizer's tensors (held_bytes)
        self.peak = memory.PeakMemory(cuda)
        self.split = MemorySplit(self.peak)
        self.trainer = None
        self.model_shape = None
        self.breakdown = None        # memory.measure after the first optimizer step
        self.train_peak = None

    @classmethod
    def for_rank(cls, rank):
        return cls(rank.here.cuda, rank.strategy)

    def on_built(self, rank) -> None:
        """The trainer and the whole model are built (the model as the prediction sees it: before sharding)."""
        trainer = rank.trainer
        self.split.mark("built")
        self.split.remember_built(trainer.model)
        self.model_shape = memory.model_shape(trainer.model)

    def on_prepared(self, rank) -> None:
        """The strategy prepared the trainer (sharded, wrapped): count the activations from here on."""
        self.trainer = trainer = rank.trainer
        self.split.mark("prepared")
        self.split.watch_activations(trainer)
        self.model_shape["optimizer"] = memory.optimizer_kind(trainer.args.optim)

    @contextmanager
    def training(self):
        """The peak of what runs inside: the training steps alone."""
        self.split.mark("train_start")
        self.peak.start_phase()
        yield
        self.train_peak = self.peak.phase_peak()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        if self.breakdown is None and not step_was_skipped(self.trainer):  # a skipped step made no optimizer state
            self.breakdown = memory.measure(self.trainer.model, optimizer, self.strategy.held_bytes(self.trainer))

    def on_step_end(self, args, state, control, **kw):
        if control.should_evaluate or control.should_save:  # the trainer evaluates or saves next
            self.peak.pause_phase()                          # (transformers' flow callback runs first)

    def on_evaluate(self, args, state, control, **kw):
        if not control.should_save:  # a checkpoint follows the evaluation: still paused
            self.peak.resume_phase()

    def on_save(self, args, state, control, **kw):
        self.peak.resume_phase()

    def on_step_begin(self, args, state, control, **kw):
        self.peak.resume_phase()  # an evaluation asked for and not run (another callback took it back)

    def report(self) -> dict:
        return {"peak_memory_bytes": int(self.train_peak), "peak_memory_run_bytes": int(self.peak.peak()),
                "peak_memory_method": self.peak.method, "memory_breakdown": self.breakdown or {},
                "memory_split": self.split.summary(self.breakdown, self.train_peak), "model_shape": self.model_shape}
