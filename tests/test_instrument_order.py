"""The instruments' order (stnb.instruments.order): decided by what each declares it needs to run after, never
by a list kept by hand; a new instrument is one file whose class says its needs (and the import line that
registers it). The relations below are the contract the time split, the memory peak and the collective count
rely on: each fails when one declaration is dropped (they are then ordered by name)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from stnb import instruments
from stnb.instruments import Instrument

KINDS = list(instruments.BUILT_IN)


def _position() -> dict:
    return {k.__name__: i for i, k in enumerate(instruments.order(KINDS))}


@pytest.mark.parametrize("first, then, why", [
    ("StepLog", "TimeSplit", "the time split reads the step clock's begin and end"),
    ("TimeSplit", "MemoryUse", "the optimizer phase ends before the tensors are measured"),
    ("MemoryUse", "FirstStepChecks", "the step check's reads do not count in the measured peak"),
    ("FirstStepChecks", "Collectives", "the first step's checks' calls are not the step's collectives"),
    ("TimeSplit", "Collectives", "the step's collective count closes after the time split's step end"),
    ("StepLog", "AllocatorRelease", "memory goes back after the step's clock stopped"),
    ("MemoryUse", "AllocatorRelease", "and after its peak was read"),
])
def test_each_instrument_runs_after_what_it_needs(first, then, why):
    at = _position()
    assert at[first] < at[then], f"{first} must run before {then}: {why}"


def test_every_instrument_is_ordered_once():
    assert sorted(k.__name__ for k in instruments.order(KINDS)) == sorted(k.__name__ for k in KINDS)
    assert len(KINDS) == 10


def test_a_new_instrument_is_one_file_that_declares_its_needs(tmp_path):
    """A made-up instrument written as its own module: defining it registers it, and attach puts it after what
    it names, with no list edited anywhere."""
    path = tmp_path / "stnb_made_up_instrument.py"
    path.write_text(textwrap.dedent('''
        from stnb.instruments import Instrument

        class TokenCounter(Instrument):
            after = ("StepLog", "Collectives")  # counts a step once it is timed and its calls counted
            def report(self):
                return {"tokens_seen": 0}
    '''))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert Instrument.registered["TokenCounter"] is module.TokenCounter

    class Trainer:
        def __init__(self):
            self.callbacks = []

        def add_callback(self, cb):
            self.callbacks.append(cb)

    made = [module.TokenCounter(), instruments.StepLog(0.0), instruments.Collectives()]
    trainer = Trainer()
    assert instruments.attach(trainer, made) == trainer.callbacks
    # Collectives needs only instruments not attached here: by name, first
    assert [type(c).__name__ for c in trainer.callbacks] == ["Collectives", "StepLog", "TokenCounter"]
    assert instruments.reports(trainer.callbacks[2:]) == {"tokens_seen": 0}


def test_a_cycle_or_an_unknown_name_is_refused():
    class Egg(Instrument):
        after = ("Hen",)

    class Hen(Instrument):
        after = ("Egg",)

    with pytest.raises(ValueError, match=r"form a cycle among \['Egg', 'Hen'\]"):
        instruments.order([Egg, Hen])

    class Lost(Instrument):
        after = ("NoSuchInstrument",)

    with pytest.raises(ValueError, match=r"Lost.after names \['NoSuchInstrument'\]: no instrument has that name"):
        instruments.order([Lost])


def test_two_of_a_kind_are_refused():
    with pytest.raises(ValueError, match="one instrument of each kind"):
        instruments.attach(None, [instruments.Collectives(), instruments.Collectives()])
