"""The instruments' order (stnb.instruments.order): decided by what each declares it needs to run after, never
by a list kept by hand; a new instrument is one file whose class says its needs (and the import line that
registers it). The relations below are the contract the time split, the memory peak and the collective count
rely on: each fails when one declaration is dropped (they are then ordered by name)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

import stnb
from stnb import instruments
from stnb.instruments import Instrument
from stnb.models import tiny_path
from stnb.results import merge

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
    assert len(KINDS) == 11
    # the rank makes them in that order too, at their moments: those made later may ask for those made before
    assert {k.__name__: k.made_at for k in KINDS if k.made_at != "prepared"} == {
        "StepLog": "start", "MemoryUse": "start", "AllocatorRelease": "start", "MemoryBudget": "start",
        "Flops": "built"}


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


MADE_UP = '''
from stnb.instruments import Instrument

class ModelWatch(Instrument):
    """Made once the trainer is built; told when the strategy prepared it; counts the steps it saw end."""
    made_at = "built"
    after = ("StepLog",)  # a step it counts is one StepLog timed

    def __init__(self, params, steps):
        self.params, self.steps, self.wrapper, self.ended = params, steps, None, 0

    @classmethod
    def for_rank(cls, rank):
        return cls(sum(p.numel() for p in rank.trainer.model.parameters()), rank.made["StepLog"])

    def on_prepared(self, rank):
        self.wrapper = type(rank.trainer.model_wrapped).__name__  # before train(): the trainer wraps later

    def on_step_end(self, args, state, control, **kw):
        self.ended += 1
        assert len(self.steps.step_times) == self.ended  # StepLog's callback ran first

    def verification(self):
        problems = [] if self.ended == {steps} else [f"ModelWatch saw {{self.ended}} steps end"]
        return {{"watched": {{"params": self.params, "steps": self.ended, "wrapper_when_prepared": self.wrapper}}}}, problems
'''


def _register_made_up(tmp_path, steps: int):
    path = tmp_path / "stnb_made_up_watch.py"
    path.write_text(MADE_UP.format(steps=steps))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defining it registers it (conftest takes it back after the test)
    return module.ModelWatch


def test_a_made_up_instrument_in_one_file_is_made_told_and_heard_in_real_ranks(tmp_path):
    """Item 3 of issue 44: train_rank names no instrument. A made-up one, written as its own module (here
    registered in the notebook's process, which the forked ranks inherit), is made by each rank of a real
    2-rank DDP run at the moment it declares, told of the later moment, runs after what it names, and its
    entries and problems reach every rank's verification record and the run's verdict."""
    from stnb.builds import RecipeBuild
    from stnb.training import train_rank

    cfg = stnb.TrainConfig(strategy="ddp", model="tiny", steps=3, per_device_batch_size=4, train_size=32,
                           dev_size=8, evaluate=False, device="cpu", warmup_steps_excluded=0)
    kind = _register_made_up(tmp_path, steps=3)
    assert instruments.order([kind, instruments.StepLog]) == [instruments.StepLog, kind]
    reports = stnb.launch(train_rank, cfg, RecipeBuild(tiny_path()), None, 2, num_processes=2, device="cpu",
                          start_method="fork", timeout=300, echo=False)
    for r in reports:
        watched = r.verification["watched"]
        assert watched["steps"] == 3 and watched["params"] > 0 and watched["wrapper_when_prepared"], watched
        assert "ModelWatch" in r.verification["callbacks"]["added"]
    res = merge(cfg, reports, device="cpu")
    assert res.verified, res.reason

    Instrument.registered.pop("ModelWatch")
    _register_made_up(tmp_path, steps=4)  # a check that fails: the run is not verified, and says why
    reports = stnb.launch(train_rank, cfg, RecipeBuild(tiny_path()), None, 2, num_processes=2, device="cpu",
                          start_method="fork", timeout=300, echo=False)
    res = merge(cfg, reports, device="cpu")
    assert not res.verified and "rank 0: ModelWatch saw 3 steps end" in res.reason, res.reason


def test_an_instrument_made_at_no_moment_is_refused():
    with pytest.raises(TypeError, match=r"Late.made_at is 'trained'; a rank makes instruments at one of"):
        class Late(Instrument):
            made_at = "trained"
    rank = instruments.Rank(config=None, strategy=None, here=None, build=None)
    with pytest.raises(ValueError, match="a rank's moments are"):
        instruments.reach("trained", rank)
