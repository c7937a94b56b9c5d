"""The instruments' common shape: a TrainerCallback, made by the rank at the moment it declares, that reports
its own part of the rank's record."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

from transformers import TrainerCallback

#: the moments of a rank an instrument is made at and told of, in their order: "start" (before anything is
#: built), "built" (the trainer and its whole model, before the strategy), "prepared" (the strategy applied)
MOMENTS = ("start", "built", "prepared")


@dataclass
class Rank:
    """What an instrument may ask of the rank it runs in (``training.train_rank`` fills it in as the rank goes).

    ``trainer`` from "built" on; ``overridden`` (the arguments stnb set, ``{name: {"from", "to", "why"}}``),
    ``loss_sync`` (``strategies.LossParameterSync``) and ``resume`` (the checkpoint training resumes from, or
    None) from "prepared" on; ``made``: the rank's instruments so far, by class name, in the order they were
    made (``instruments.order``)."""

    config: object
    strategy: object
    here: object                # training.Here: the process group, the device, how the rank was started
    build: object               # builds.RecipeBuild / UserBuild
    trainer: object = None
    overridden: dict = field(default_factory=dict)
    loss_sync: object = None
    resume: str | None = None
    made: dict = field(default_factory=dict)


class Instrument(TrainerCallback):
    """A TrainerCallback that reports its own part of the rank's record (``stnb.instruments``).

    ``after``: the instruments (class names) whose callbacks must run before this one's at every event, each
    for a reason the subclass states beside it; ``stnb.instruments.order`` sorts by these declarations alone,
    and the rank makes its instruments in that order too (one made later may ask ``rank.made`` for one before).
    ``made_at``: the moment (``MOMENTS``) the rank makes it, with ``for_rank``; one made earlier is told of the
    later moments (``on_built``, ``on_prepared``). Defining a subclass registers it (``Instrument.registered``):
    an instrument is its own file, plus the line in ``stnb/instruments/__init__.py`` that imports it."""

    after: tuple = ()
    made_at: str = "prepared"
    registered: dict = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.made_at not in MOMENTS:
            raise TypeError(f"{cls.__name__}.made_at is {cls.made_at!r}; a rank makes instruments at one of {MOMENTS}")
        Instrument.registered[cls.__name__] = cls

    @classmethod
    def for_rank(cls, rank: Rank) -> "Instrument | None":
        """This instrument in ``rank``, at its moment (``made_at``); None: it has nothing to do in this run."""
        return cls()

    def whole_rank(self):
        """A context the rest of the rank runs inside (an instrument made at "start"; none by default)."""
        return nullcontext()

    def on_built(self, rank: Rank) -> None:
        """The rank built its trainer (``rank.trainer``: the whole model, before the strategy)."""

    def on_prepared(self, rank: Rank) -> None:
        """The strategy prepared the trainer (wrapped, sharded): the rank trains next."""

    def training(self):
        """A context ``trainer.train()`` runs inside (none by default)."""
        return nullcontext()

    def report(self) -> dict:
        """This instrument's RankReport fields (after training)."""
        return {}

    def verification(self) -> tuple[dict, list] | None:
        """(entries of the rank's verification record, problems found) (after training); None: nothing was
        verified (no training step began), so the rank's record is empty (``instruments.record``)."""
        return {}, []


def step_was_skipped(trainer) -> bool:
    """Whether the optimizer step that just ran updated nothing: under fp16 the loss scaler (torch's GradScaler
    through accelerate, DeepSpeed's own) found inf/nan gradients and skipped it, as it does on the first steps
    while the scale comes down (``Accelerator.optimizer_step_was_skipped``)."""
    return bool(getattr(getattr(trainer, "accelerator", None), "optimizer_step_was_skipped", False))


def reports(instruments) -> dict:
    """Every instrument's RankReport fields, in one dict; ValueError when two report the same field."""
    out = {}
    for instrument in instruments:
        part = instrument.report()
        twice = sorted(out.keys() & part.keys())
        if twice:
            raise ValueError(f"{type(instrument).__name__} reports {twice}, already reported by another instrument")
        out.update(part)
    return out


def record(instruments, facts: dict) -> dict:
    """The rank's verification record, composed here only: ``facts`` (the strategy's ``prepare`` details, the
    trainer's callbacks, ...), then each instrument's entries and problems, in the order given (the rank's: the
    order it made them in). ``problems`` lists what the checks found, ``ok`` is True when they found nothing.
    Empty when an instrument says nothing was verified (no training step began): it then merges as never
    verified. ValueError when two parts give the same entry."""
    v, problems = dict(facts), []
    for instrument in instruments:
        part = instrument.verification()
        if part is None:
            return {}
        entries, found = part
        twice = sorted(v.keys() & entries.keys())
        if twice:
            raise ValueError(f"{type(instrument).__name__} gives the verification entries {twice}, already given")
        v.update(entries)
        problems += found
    v["problems"] = problems
    v["ok"] = not problems
    return v
