"""What a rank measures and checks while it trains: its instruments, each a ``transformers.TrainerCallback``
in its own module, attached to the trainer by ``stnb.training.train_rank`` and asked after training for its
own part of the rank's one record (``stnb.rankreport.RankReport``).

======================  =================  ========================================================================
instrument              module             what it reports (RankReport fields; entries of the verification record)
======================  =================  ========================================================================
``Flops``               ``flops``          ``train_flops``, ``train_tokens``, ``flops_shape``, ``peak`` (``stnb.mfu``)
``StepLog``             ``steps``          ``step_times``, ``losses``, ``time_to_first_step_s``; the notebook's
                                           per-rank progress
``TimeSplit``           ``timesplit``      ``time_split``: where each step's time goes (``stnb.timesplit``)
``MemoryUse``           ``memsplit``       ``peak_memory_bytes`` (the training steps), ``peak_memory_run_bytes``,
                                           ``peak_memory_method``, ``memory_breakdown``, ``memory_split``
                                           (``stnb.memsplit``), ``model_shape`` (the prediction's inputs)
``MemoryBudget``        ``budget``         verification: ``memory_budget`` (``stnb.budget``: the limit the rank
                                           runs inside, the model checked against it once built)
``FirstStepChecks``     ``checks``         the verification record: the prepared model at the first step
                                           (``strategies.verify_prepared``), the strategy's first-step hooks and
                                           step check, the loss's model, the parameters the optimizer updates
``AllocatorRelease``    ``allocator``      verification: ``reuse_freed_memory``, ``released_each_step``
                                           (``stnb.cpualloc``)
``LossInputs``          ``loss_inputs``    ``loss_inputs``, ``data_columns``; verification: ``batch_override``
``Collectives``         ``collectives``    ``collectives``: every collective call per step, its kind and bytes
``OutsideSteps``        ``outside``        ``outside_steps``: the step times' spread; evaluation and checkpoint
                                           saves between steps, timed, with their frequency
``Checkpoints``         ``checkpoints``    ``checkpoints``, ``resumed_from``; verification: ``resumed_at_step``
                                           (``stnb.checkpoints``: whole or absent, rotated after, resumed)
======================  =================  ========================================================================

The rank (``training.train_rank``) names none of them: it reaches its moments (``reach``: "start", "built",
"prepared"; ``MOMENTS``), and at each every registered instrument made at that moment is made (``made_at``,
``for_rank``) and those made before are told (``on_built``, ``on_prepared``); it runs inside their contexts
(``whole_rank``, ``training``), attaches them, and after training asks each for its part. Each instrument's
``report()`` returns its RankReport fields and ``verification()`` its entries of the rank's verification record
with the problems it found; ``record`` composes the record. Callbacks run in the order they were added:
``attach`` adds them in the order ``order`` gives, which only the instruments' own ``after`` declarations decide
(what each needs to have run before it, with the reason beside it); instruments that declare nothing about each
other come in the order of their names. Adding one: its own module (a subclass of ``Instrument``) and one line
below that imports it.
"""

from __future__ import annotations

__all__ = ["Instrument", "Rank", "MOMENTS", "reach", "whole_rank", "training", "attach", "reports", "record",
           "Flops", "StepLog", "TimeSplit", "MemoryUse", "MemoryBudget", "FirstStepChecks", "AllocatorRelease",
           "LossInputs", "Collectives", "OutsideSteps", "Checkpoints", "order", "BUILT_IN"]

from contextlib import ExitStack, contextmanager

from .base import MOMENTS, Instrument, Rank, record, reports
from .allocator import AllocatorRelease
from .budget import MemoryBudget
from .checkpoints import Checkpoints
from .checks import FirstStepChecks
from .collectives import Collectives
from .flops import Flops
from .loss_inputs import LossInputs
from .memsplit import MemoryUse
from .outside import OutsideSteps
from .steps import StepLog
from .timesplit import TimeSplit

#: stnb's own instruments, as the imports above registered them (one made later, a test's, is not among them)
BUILT_IN = tuple(Instrument.registered.values())


def order(kinds) -> list:
    """The instrument classes ``kinds`` in an order where each runs after those its ``after`` names (among
    ``kinds``); ties by class name. ValueError on a name no instrument has, or on a cycle."""
    kinds = sorted(set(kinds), key=lambda k: k.__name__)
    names = {k.__name__ for k in kinds}
    for k in kinds:
        unknown = [n for n in k.after if n not in Instrument.registered]
        if unknown:
            raise ValueError(f"{k.__name__}.after names {unknown}: no instrument has that name")
    out, placed = [], set()
    while len(out) < len(kinds):
        ready = [k for k in kinds if k.__name__ not in placed and all(n in placed or n not in names for n in k.after)]
        if not ready:
            raise ValueError(f"the instruments' 'after' declarations form a cycle among "
                             f"{sorted(n for n in names if n not in placed)}")
        out.append(ready[0])
        placed.add(ready[0].__name__)
    return out


def reach(moment: str, rank: Rank) -> None:
    """The rank reached ``moment`` (``MOMENTS``, in their order): every instrument made before it is told
    (``on_built`` / ``on_prepared``), then every registered instrument made at it is made (``for_rank``), in
    ``order``, each seeing those made before it in ``rank.made``."""
    if moment not in MOMENTS:
        raise ValueError(f"a rank's moments are {MOMENTS}, not {moment!r}")
    if moment != MOMENTS[0]:
        for instrument in list(rank.made.values()):
            getattr(instrument, f"on_{moment}")(rank)
    for kind in order(Instrument.registered.values()):
        if kind.made_at == moment:
            instrument = kind.for_rank(rank)
            if instrument is not None:
                rank.made[kind.__name__] = instrument


@contextmanager
def _inside(contexts):
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def whole_rank(rank: Rank):
    """The context the rest of the rank runs inside: each instrument's ``whole_rank()``, in their order."""
    return _inside([i.whole_rank() for i in rank.made.values()])


def training(rank: Rank):
    """The context ``trainer.train()`` runs inside: each instrument's ``training()``, in their order."""
    return _inside([i.training() for i in rank.made.values()])


def attach(trainer, instruments) -> list:
    """Add ``instruments`` to the trainer's callbacks in ``order`` (one of each kind); returns them in that order."""
    kinds = [type(i) for i in instruments]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"one instrument of each kind, got {[k.__name__ for k in kinds]}")
    ranked = order(kinds)
    ordered = sorted(instruments, key=lambda i: ranked.index(type(i)))
    for instrument in ordered:
        trainer.add_callback(instrument)
    return ordered
