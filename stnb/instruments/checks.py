"""``FirstStepChecks``: the strategy verified in the rank at its first training step (the base of the rank's
verification record: without a first step, nothing was verified).

At the first step's begin (the trainer has wrapped the model): the strategy's own first-step hooks
(``Strategy.on_first_step``: a DDP communication hook, before the first backward), the prepared model
against what the strategy promises and the world asked for (``strategies.verify_prepared``, a
collective; it raises ``VerificationError``), and the loss pointed at the module that trains
(``prepare.rebind_loss_model``, sentence-transformers #3023), which the first step must then call. After
the first optimizer step that updated something (fp16's loss scaler skips the first steps whose gradients
overflow: ``steps_skipped_before_step_check`` counts them): the strategy's step check (gradients, optimizer
state) and every parameter the optimizer updates, named (the model's or the loss's).
"""

from __future__ import annotations

from .. import prepare, strategies
from .base import Instrument, step_was_skipped


class FirstStepChecks(Instrument):
    """The first step's checks of this rank."""

    after = ("MemoryUse",)  # the strategy's step check runs once the step's memory was measured: its reads
    # (gathers, state) would count in the peak

    def __init__(self, trainer, strategy, config, world_size_requested: int, process_group_size: int,
                 loss_sync, timed=None):
        self.trainer, self.strategy, self.config = trainer, strategy, config
        self.requested = world_size_requested   # the world the caller asked for (compared with the group)
        self.world = process_group_size
        self.loss_sync = loss_sync              # strategies.LossParameterSync: the loss's own parameters
        self.timed = timed                      # wraps a strategy's own comm hook for the time split
        self.watch: dict = {}                   # Strategy.on_first_step's {name: observer with .stats()}
        self.prepared: dict | None = None       # verify_prepared at the first step (None: never verified)
        self.device_seen: list | None = None    # device types of the first batch the trained module received
        self.loss_model: dict | None = None     # {"trains", "rebound", "calls_in_first_step", "ok"}
        self.loss_model_calls = 0               # forwards of the module that trains in the first step
        self._hook = None
        self.step_check: tuple | None = None    # after the first optimizer step: (details, problems)
        self.trained_parameters: dict | None = None  # what the optimizer updates: the model's and the loss's
        self.skipped_steps = 0                  # optimizer steps the loss scaler skipped before the step check

    @classmethod
    def for_rank(cls, rank):
        here = rank.here  # made after TimeSplit (it runs after MemoryUse, which runs after TimeSplit)
        return cls(rank.trainer, rank.strategy, rank.config, here.requested, here.world, rank.loss_sync,
                   rank.made["TimeSplit"].timed)

    def on_step_begin(self, args, state, control, **kw):
        if self.prepared is not None:
            return
        tr, config = self.trainer, self.config
        # before the first backward: a strategy's own DDP comm hook (embedding rows), timed
        self.watch = self.strategy.on_first_step(tr, config, self.world, timed=self.timed)
        self.prepared = strategies.verify_prepared(self.strategy, tr, self.requested)
        # the loss must call the module that trains (sentence-transformers #3023)
        rebound = prepare.rebind_loss_model(tr)
        self.loss_model = {"trains": type(tr.model_wrapped).__name__, "rebound": rebound}
        self._hook = tr.model_wrapped.register_forward_pre_hook(self._count_loss_model_call, with_kwargs=True)

    def _count_loss_model_call(self, _module, args, kwargs) -> None:
        self.loss_model_calls += 1
        if self.device_seen is None:  # the device the first step's batch reached the module on (observed, not
            # chosen; parameters offloaded to the host would mislead): results.cross_rank_checks compares it
            from torch import is_tensor
            from torch.utils._pytree import tree_leaves  # the tensors in nested args / kwargs / feature dicts

            self.device_seen = sorted({t.device.type for t in tree_leaves((args, kwargs)) if is_tensor(t)}) or None

    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        if self.step_check is None and self.prepared is not None:
            if step_was_skipped(self.trainer):  # fp16's loss scaler found inf/nan gradients: nothing updated yet
                self.skipped_steps += 1
                return
            self._check_first_step(optimizer)

    def _check_first_step(self, optimizer) -> None:
        """The strategy's own check of gradients / optimizer state, and every parameter the optimizer
        updates named (the model's or the loss's: the replicated ones are compared across ranks after
        training, the sharded ones by the strategy's shard checks)."""
        info, problems = self.strategy.check_step(self.trainer, self.requested)
        names, unnamed = strategies.optimizer_parameter_names(self.trainer, optimizer)
        sync = self.loss_sync
        self.trained_parameters = {"optimizer_updates": len(names) + unnamed, "model": len(names) - len(sync.names()),
                                   "loss": sync.names(), "loss_parameters_synced": sync.active}
        if unnamed:
            problems.append(f"the optimizer updates {unnamed} parameter(s) that neither the model nor the loss own, "
                            "so stnb cannot check them across ranks")
        self.step_check = (info, problems)

    def on_step_end(self, args, state, control, **kw):
        if self._hook is not None:  # the first step's end: did the loss call the module that trains?
            self._hook.remove()
            self._hook = None
            self.loss_model.update(calls_in_first_step=self.loss_model_calls, ok=self.loss_model_calls > 0)

    def verification(self) -> tuple[dict, list] | None:
        """``verify_prepared``'s world and counts at the first step, then this instrument's checks; None when no
        training step began (never verified)."""
        if self.prepared is None:
            return None
        v = {k: value for k, value in self.prepared.items() if k not in ("problems", "ok")}
        problems = list(self.prepared["problems"])
        v.update({"loss_model": self.loss_model, "device_seen": self.device_seen})
        v["steps_skipped_before_step_check"] = self.skipped_steps
        if self.step_check is not None:
            info, step_problems = self.step_check
            v.update(info)
            v["trained_parameters"] = self.trained_parameters
            problems += step_problems
        elif self.skipped_steps:
            problems.append(f"the loss scaler skipped every optimizer step ({self.skipped_steps}: inf/nan gradients "
                            "under fp16), so nothing was updated and the strategy's step check never ran; train "
                            "more steps, lower the learning rate, or use bf16")
        if (self.loss_model or {}).get("ok") is False:  # checked at the first step's end
            problems.append(f"the loss never called the {self.loss_model['trains']} that trains in the first step: "
                            "it holds its own reference to the model; store the model as `self.model` in the loss")
        v.update({name: watched.stats() for name, watched in self.watch.items()})
        return v, problems
