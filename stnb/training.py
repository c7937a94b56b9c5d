"""Inside a rank: build the trainer, apply the strategy, attach the instruments, train, report (``train_rank``).

Every rank of a run executes ``train_rank``: started by ``stnb.run`` through ``stnb.launch``
(notebook side, ``stnb.runner``), or by torchrun / accelerate launch (``stnb.launchers.external``).
The trainer comes from the run's build object (``stnb.builds``): stnb's recipe (``stnb.recipe``, from the
TrainConfig's ``Recipe``) or the user's build function, asked the same things; ``stnb.prepare`` makes it
ready and the strategy object applies itself to it the same way in both cases. What the rank measures and checks while it trains are its instruments
(``stnb.instruments``: TrainerCallbacks, each reporting its own part); the rank returns one
``RankReport`` (``stnb.rankreport``), which ``stnb.results.merge`` combines with the other ranks' into
one RunResult.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

from . import checkpoints, checks, prepare, strategies
from .config import TrainConfig
from .hardware import rank_gpu
from .processes import rank_context, scratch_folder, wait_for_all
from .model_types import load_like
from .rankreport import RankReport
from .saving import save_checked


def train_rank(config: TrainConfig, build, launch_time: float | None = None,
               world_size: int | None = None, restarted: bool = False) -> RankReport:
    """Runs in every rank: build, apply the strategy, attach the instruments, train, report (its RankReport).

    build: what the rank trains (``stnb.builds``): stnb's recipe for ``config`` (``RecipeBuild(model_path)``) or
        a user's function returning a SentenceTransformerTrainer (``UserBuild(fn)``); the rank asks either the
        same things.
    world_size: the world size the caller requested (default: the config's); verification
        compares it with the process group this rank is in.
    restarted: the engine restarted this run (a requeued SLURM job): it continues from its newest checkpoint.
    """
    from . import instruments as ins

    here = Here.join(config, launch_time, world_size)  # the process group (an outer launcher's too), the device
    rank = ins.Rank(config, config.strategy_object(), here, build)
    ins.reach("start", rank)  # the instruments made first: the memory peak is growth from here on, the budget
    with ins.whole_rank(rank):  # memory_budget_gib: the rank cannot use more; past it, OutOfMemory names what fits
        return _train(rank, restarted)


def _train(rank, restarted: bool) -> RankReport:
    """``train_rank`` inside what its instruments made at its start hold it in (the memory budget)."""
    import torch

    from . import instruments as ins

    config, build, here, strategy = rank.config, rank.build, rank.here, rank.strategy
    torch.manual_seed(config.seed)
    # build: stnb's recipe or the user's function, checked and made ready (stnb's display, the overrides)
    trainer = rank.trainer = build.build(config, here.device, here.distributed)
    prepare.refusals(trainer, config, here.cuda)
    ins.reach("built", rank)  # the model as built: the memory prediction's inputs, checked against the budget
    overridden, callbacks = prepare.own_display(trainer)  # {"kept": the trainer's callbacks, "removed": ...}
    overridden.update(prepare.apply_overrides(trainer, config))
    outcome = Outcome.before_training(trainer, config, strategy, build.initial_path, here)  # rank 0
    # apply the strategy, and keep the loss's own parameters equal on every rank (a collective)
    trainer.stnb_config = config
    prepared = strategy.prepare(trainer, config, here.device_type, here.world)
    overridden.update(prepared["overridden"])
    rank.overridden, rank.loss_sync = overridden, strategies.LossParameterSync(trainer)
    trainer.add_callback(rank.loss_sync.callback())
    folder = checkpoints.one_folder(trainer.args, config.resume, here.distributed)  # a collective
    rank.resume = checkpoints.resume_point(config.resume, folder, restarted)
    ins.reach("prepared", rank)  # the resume point checked against this run
    attached = ins.attach(trainer, rank.made.values())
    try:
        with ins.training(rank):
            trainer.train(resume_from_checkpoint=rank.resume)
        strategy.after_training(trainer)  # the model as the strategy keeps it between steps (sharded)
        prepare.drop_autocast(trainer.model)  # evaluated and saved below as before training: full precision
        digests = checks.replicated_digests(trainer.model, strategies.loss_owned_parameters(trainer))
        outcome.after_training(trainer, config, strategy, here)  # rank 0 evaluates and saves
    finally:
        outcome.clean_up()
        build.clean_up(trainer)
    # report: each instrument its own part, the verification record composed from them
    callbacks["added"] = [type(c).__name__ for c in trainer.callback_handler.callbacks[len(callbacks["kept"]):]]
    verification = ins.record(attached, {**prepared["info"], "callbacks": callbacks, "frozen_unused": build.frozen})
    return RankReport(**here.report(), global_batch_size=here.global_batch(trainer.args, strategy),
                      verification=verification, weight_digests=digests, overridden_args=overridden,
                      **outcome.report(), **ins.reports(attached), **build.facts(trainer))


@dataclass(frozen=True)
class Here:
    """This rank in its run: its process group, its device, how it was started."""

    ctx: object                 # launch.RankContext inside an stnb launch; None under torchrun / accelerate launch
    launch_time: float
    requested: int              # the world size the caller asked for (compared with the process group)
    cuda: bool
    distributed: bool
    rank: int
    world: int
    device: str                 # "cpu", "cuda" or "cuda:<local rank>"
    n_gpu: int

    @classmethod
    def join(cls, config: TrainConfig, launch_time: float | None, world_size: int | None) -> "Here":
        """Join the run: the process group (started by another launcher: from its environment), this
        process's threads, its device."""
        import torch
        import torch.distributed as dist
        import transformers

        transformers.logging.disable_progress_bar()  # the parent shows per-rank progress instead
        ctx = rank_context()
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # started by another launcher (torchrun, accelerate launch, raw notebook_launcher):
            # accelerate initialises the process group from its environment (gloo on CPU, NCCL on GPU)
            from accelerate import PartialState

            PartialState(cpu=config.resolved_device() == "cpu")  # "auto" on a CPU-only node: gloo too
        cuda = torch.cuda.is_available() and config.device != "cpu"
        if config.threads_per_rank and not cuda:
            torch.set_num_threads(config.threads_per_rank)
        distributed = dist.is_initialized()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return cls(ctx=ctx, launch_time=launch_time or (ctx.launch_time if ctx else time.time()),
                   requested=world_size if world_size is not None else config.world_size(), cuda=cuda,
                   distributed=distributed, rank=dist.get_rank() if distributed else 0,
                   world=dist.get_world_size() if distributed else 1,
                   device=f"cuda:{rank_gpu(local_rank)}" if cuda and distributed else ("cuda" if cuda else "cpu"),
                   n_gpu=torch.cuda.device_count() if cuda else 0)

    @property
    def device_type(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def global_batch(self, args, strategy) -> int:
        """Samples per optimizer step over every device of the run."""
        per_device_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        return per_device_step * (self.world if self.distributed else strategy.devices(self.n_gpu))

    def report(self) -> dict:
        # how this rank was started, observed in it (None under torchrun / accelerate launch)
        return {"rank": self.rank, "device": self.device_type,
                "start_method": self.ctx.start_method if self.ctx else None,
                "start_method_requested": self.ctx.start_method_requested if self.ctx else None}


class Outcome:
    """What training achieved, on rank 0: the dev metric before and after training, the dev curve between
    them (the trainer's own evaluations during training, read from its log_history), and the saved model
    checked against the trained one and the initial one."""

    def __init__(self, evaluator, initial_path: str | None, scratch: str | None):
        self.evaluator = evaluator
        self.initial_path = initial_path  # the untrained model (stnb's recipe: its model_path)
        self.scratch = scratch            # a folder this rank made for it (removed after training)
        self.metric = self.before = self.after = self.saved = None
        self.curve: list = []

    @classmethod
    def before_training(cls, trainer, config, strategy, initial_path, here: Here) -> "Outcome":
        """Rank 0 evaluates the model as built and, where no saved copy of it exists (``initial_path`` None: a
        user's model), saves it where it is needed again: to rebuild an unsharded copy (sharded parameters)
        and to check the saved one against."""
        outcome = cls(trainer.evaluator, initial_path, None)
        if outcome.evaluator is not None and here.rank == 0:
            outcome.metric, outcome.before = _dev_metric(outcome.evaluator, trainer.model)
        if initial_path is None and here.rank == 0 and (strategy.shards_params(config) or config.save_to):
            outcome.scratch = outcome.initial_path = scratch_folder("stnb-initial-")
            trainer.model.save(outcome.scratch)
        if here.distributed:
            wait_for_all()  # rank 0 evaluated (and saved the initial model)
        return outcome

    def after_training(self, trainer, config, strategy, here: Here) -> None:
        """The trained model, whole on rank 0 (a sharding strategy gathers it: every rank takes part),
        evaluated there and saved (``save_to``); every rank waits for rank 0."""
        initial_path, device, max_len = self.initial_path, here.device, trainer.model.max_seq_length
        final_model = _full_model_on_rank0(strategy, trainer.model, initial_path, device, here.rank, max_len)
        if here.rank == 0:
            if self.evaluator is not None:
                self.metric, self.after = _dev_metric(self.evaluator, final_model)
                self.curve = dev_curve(self.metric, self.before, self.after, trainer.state)
            if config.save_to:
                initial = checks.state_of(load_like(final_model, initial_path, device="cpu", max_seq_length=max_len))
                self.saved = save_checked(final_model, config.save_to, device, checks.state_of(final_model), initial)
        if here.distributed:
            wait_for_all()  # rank 0 evaluated and saved: not bounded by the collective timeout

    def clean_up(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def report(self) -> dict:
        return {"dev_metric": self.metric, "dev_metric_before": self.before, "dev_metric_after": self.after,
                "dev_curve": self.curve, "saved_model": self.saved}


def _dev_metric(evaluator, model) -> tuple:
    """(primary metric name, value): the evaluator's own primary metric (some name it while evaluating)."""
    scores = evaluator(model)
    name = evaluator.primary_metric
    return name, float(scores[name])


def dev_curve(metric: str, before: float, after: float, state) -> list:
    """[(0, before), (step, value)..., (last step, after)]: the values between are the trainer's own
    evaluations during training (eval_strategy='steps'; sentence-transformers logs the evaluator's metrics
    with the prefix 'eval_'), the last point the trained model evaluated after training (an evaluation the
    trainer itself ran at its last step is that point's, so it is left out)."""
    key = metric if metric.startswith("eval_") else f"eval_{metric}"
    last = state.global_step
    during = {int(e["step"]): float(e[key]) for e in state.log_history if key in e and 0 < e.get("step", 0) < last}
    return [(0, before), *sorted(during.items()), (last, after)]


def _full_model_on_rank0(strategy, model, initial_path, device, rank, max_seq_length):
    """An ordinary model of the trained one's type with the trained weights, on rank 0 (None elsewhere).

    A sharding strategy gathers the full state (a collective: every rank takes part), loaded here into
    a fresh, unsharded copy of the model (from ``initial_path``).
    """
    full, is_state = strategy.full_model(model, rank)
    if not is_state or rank != 0:
        return full
    plain = load_like(model, initial_path, device=device, max_seq_length=max_seq_length)
    plain.load_state_dict(full, strict=True)  # raises if any key is missing or unexpected
    return plain
