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

Each instrument's ``report()`` returns its RankReport fields and ``verification()`` its entries of the
rank's verification record with the problems it found; ``FirstStepChecks.record`` composes the record.
Callbacks run in the order they were added: ``attach`` adds them to the trainer in the order of ``ORDER``.
"""

from __future__ import annotations

__all__ = ["Instrument", "attach", "reports", "Flops", "StepLog", "TimeSplit", "MemoryUse", "FirstStepChecks",
           "AllocatorRelease", "LossInputs", "Collectives", "OutsideSteps", "Checkpoints", "ORDER"]

from .base import Instrument, reports
from .allocator import AllocatorRelease
from .checkpoints import Checkpoints
from .checks import FirstStepChecks
from .collectives import Collectives
from .flops import Flops
from .loss_inputs import LossInputs
from .memsplit import MemoryUse
from .outside import OutsideSteps
from .steps import StepLog
from .timesplit import TimeSplit

#: the order train_rank attaches them (callbacks run in this order at every event): the FLOP count starts
#: first; the step clock reads the time before the time split uses it; at the first optimizer step the
#: time split marks the step's end, then the memory is measured, then the strategy's step check runs; the
#: collectives of a step are counted after the first step's verification and the time split's barrier
ORDER = (Flops, StepLog, TimeSplit, MemoryUse, FirstStepChecks, AllocatorRelease, Collectives, OutsideSteps,
         LossInputs, Checkpoints)


def attach(trainer, instruments) -> list:
    """Add ``instruments`` to the trainer's callbacks in ``ORDER`` (one of each kind); returns them in that order."""
    ordered = sorted(instruments, key=lambda i: ORDER.index(type(i)))
    kinds = [type(i) for i in ordered]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"one instrument of each kind, got {[k.__name__ for k in kinds]}")
    for instrument in ordered:
        trainer.add_callback(instrument)
    return ordered
