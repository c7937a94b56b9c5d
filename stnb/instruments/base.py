"""The instruments' common shape: a TrainerCallback that reports its own part of the rank's record."""

from __future__ import annotations

from transformers import TrainerCallback


class Instrument(TrainerCallback):
    """A TrainerCallback that reports its own part of the rank's record (``stnb.instruments``).

    ``after``: the instruments (class names) whose callbacks must run before this one's at every event, each
    for a reason the subclass states beside it; ``stnb.instruments.order`` sorts by these declarations alone.
    Defining a subclass registers it (``Instrument.registered``): an instrument is its own file, plus the line
    in ``stnb/instruments/__init__.py`` that imports it."""

    after: tuple = ()
    registered: dict = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        Instrument.registered[cls.__name__] = cls

    def report(self) -> dict:
        """This instrument's RankReport fields (after training)."""
        return {}

    def verification(self) -> tuple[dict, list]:
        """(entries of the rank's verification record, problems found) (after training)."""
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
