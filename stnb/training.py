"""Inside a rank: build the trainer, apply the strategy, verify, train, measure (``train_rank``).

Every rank of a run executes ``train_rank``: started by ``stnb.run`` through ``stnb.launch``
(notebook side, ``stnb.runner``), or by torchrun / accelerate launch (``stnb.scaleout.run_here``).
The trainer comes from stnb's recipe (``stnb.recipe``, from the TrainConfig) or from the user's
build function; ``stnb.prepare`` applies the strategy to it the same way in both cases. The
configuration arrives as a ``TrainConfig``; the rank returns a ``RankReport`` (``stnb.rankreport``),
which ``stnb.results.merge`` combines with the other ranks' into one RunResult.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from . import cpualloc
from .config import TrainConfig
from .launch import rank_context, report_progress, wait_for_all
from .rankreport import RankReport


def train_rank(config: TrainConfig, model_path: str | None = None, launch_time: float | None = None,
               world_size: int | None = None, build=None) -> RankReport:
    """Runs in every rank: build, prepare, verify, train, measure. Returns this rank's RankReport.

    model_path: the model of stnb's recipe (``models.resolve_model(config.model)``); None with ``build``.
    world_size: the world size the caller requested (default: the config's); verification
        compares it with the process group this rank is in.
    build: a user's function returning a SentenceTransformerTrainer (``stnb.run(build, ...)``);
        None trains stnb's recipe for ``config``.
    """
    import torch
    import torch.distributed as dist
    import transformers

    from . import checks, memory, prepare, strategies
    from .memsplit import MemorySplit
    from .mfu import FlopMeter, device_peak
    from .timesplit import StepTimer

    strategy = strategies.get(config.strategy)

    transformers.logging.disable_progress_bar()  # the parent shows per-rank progress instead
    ctx = rank_context()
    launch_time = launch_time or (ctx.launch_time if ctx else time.time())
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # started by another launcher (torchrun, accelerate launch, raw notebook_launcher):
        # accelerate initialises the process group from its environment (gloo on CPU, NCCL on GPU)
        from accelerate import PartialState

        PartialState(cpu=config.resolved_device() == "cpu")  # "auto" on a CPU-only node: gloo too
    use_cuda = torch.cuda.is_available() and config.device != "cpu"
    if config.threads_per_rank and not use_cuda:
        torch.set_num_threads(config.threads_per_rank)
    allocator = {"applied": False, "reason": "GPU run" if use_cuda else "off (reuse_freed_memory=False)"}
    if not use_cuda and config.reuse_freed_memory:
        from .cpualloc import reuse_freed_memory

        allocator = reuse_freed_memory()  # this process only: a rank, never the notebook kernel
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local_rank}" if use_cuda and distributed else ("cuda" if use_cuda else "cpu")
    n_gpu = torch.cuda.device_count() if use_cuda else 0
    peak_memory = memory.PeakMemory(use_cuda)
    memory_split = MemorySplit(peak_memory)  # where the peak goes (stnb.memsplit)
    requested = world_size if world_size is not None else config.world_size()

    torch.manual_seed(config.seed)
    if build is None:
        from .recipe import build_trainer

        trainer = build_trainer(config, model_path, device, use_cuda, distributed)
    else:
        trainer = prepare.call_build(build)
    prepare.refusals(trainer, config, use_cuda)
    memory_split.mark("built")
    memory_split.remember_built(trainer.model)
    model, evaluator = trainer.model, trainer.evaluator
    overridden, removed = prepare.own_display(trainer)
    overridden.update(prepare.apply_overrides(trainer, config))
    kept = [type(c).__name__ for c in trainer.callback_handler.callbacks]

    metric, dev_before = _dev_metric(evaluator, model) if evaluator is not None and rank == 0 else (None, None)
    initial_path, scratch = model_path, None
    if build is not None and rank == 0 and (strategy.shards_params(config) or config.save_to):
        # the untrained model, to rebuild an unsharded copy (sharded parameters) and to check the saved one against
        scratch = initial_path = tempfile.mkdtemp(prefix="stnb-initial-")
        model.save(scratch)
    if distributed:
        wait_for_all()  # rank 0 evaluated (and saved the initial model)

    frozen = strategies.freeze_unused_pooler(model) if build is None else []
    model_shape = memory.model_shape(model)  # before sharding and training: the prediction's inputs
    # counts the tokens of every training forward (stnb.mfu); where each step's time goes (stnb.timesplit)
    seen = Observed(world_size_requested=requested, process_group_size=world, flops=FlopMeter(model), timer=StepTimer(),
                    # CPU, a strategy that gathers parameters in its steps: freed memory goes back at each step's end
                    release_each_step=cpualloc.release_each_step("cuda" if use_cuda else "cpu",
                                                                 bool(strategy.gathered_during_step)))
    _record_loss_inputs(trainer.loss, seen)
    trainer.stnb_config = config
    prepared = strategy.prepare(trainer, config, "cuda" if use_cuda else "cpu", world)
    prep = prepared["info"]
    memory_split.mark("prepared")
    memory_split.watch_activations(trainer)
    overridden.update(prepared["overridden"])
    seen.loss_sync = strategies.LossParameterSync(trainer)  # a collective: rank 0's loss parameters
    callbacks = {"kept": kept, "removed": removed, "added": "StnbCallback"}
    trainer.add_callback(_make_callback(trainer, strategy, config, seen))
    model_shape["optimizer"] = memory.optimizer_kind(trainer.args.optim)
    precision = prepare.mixed_precision(trainer.args)
    try:
        # the peak of the training steps alone: rank 0's evaluation, FSDP's gathered full copy and
        # the save/reload come after training and are in the whole-run peak only
        memory_split.mark("train_start")
        peak_memory.start_phase()
        trainer.train()
        train_peak = peak_memory.phase_peak()
        prepare.drop_autocast(trainer.model)  # evaluated and saved below as before training: full precision
        after = {"frozen_unused": frozen, "reuse_freed_memory": allocator,
                 "released_each_step": seen.released_bytes if seen.release_each_step else None,
                 **{name: watched.stats() for name, watched in seen.strategy_watch.items()}}
        if "per_device_train_batch_size" in overridden:
            after["batch_override"] = _batch_override(seen, trainer, config)
        verification = verification_record(seen, prep, callbacks, after)

        digests = checks.replicated_digests(trainer.model, strategies.loss_owned_parameters(trainer))
        saved = dev_after = None
        max_len = trainer.model.max_seq_length
        final_model = _full_model_on_rank0(strategy, trainer.model, initial_path, device, rank, max_len)
        if rank == 0:
            if evaluator is not None:
                metric, dev_after = _dev_metric(evaluator, final_model)
            if config.save_to:
                from .model_types import load_like
                from .saving import save_checked

                initial = checks.state_of(load_like(final_model, initial_path, device="cpu", max_seq_length=max_len))
                saved = save_checked(final_model, config.save_to, device, checks.state_of(final_model), initial)
        if distributed:
            wait_for_all()  # rank 0 evaluated and saved: not bounded by the collective timeout
    finally:
        if build is None:
            shutil.rmtree(trainer.args.output_dir, ignore_errors=True)  # the recipe's scratch folder
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    run_peak = peak_memory.peak()
    args = trainer.args
    per_device_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    gbs = per_device_step * (world if distributed else strategy.devices(n_gpu))
    train_columns = getattr(trainer.train_dataset, "column_names", None)
    return RankReport(
        rank=rank,
        device=device.split(":")[0],
        global_batch_size=gbs,
        step_times=seen.step_times,
        losses=seen.losses,
        verification=verification,
        memory_breakdown=seen.memory_breakdown or {},
        model_shape=model_shape,
        peak_memory_bytes=int(train_peak),
        peak_memory_run_bytes=int(run_peak),
        peak_memory_method=peak_memory.method,
        memory_split=memory_split.summary(seen.memory_breakdown, train_peak),
        weight_digests=digests,
        dev_metric=metric,
        dev_metric_before=dev_before,
        dev_metric_after=dev_after,
        # a dict of datasets (one per loss): {dataset: its columns}
        data_columns=train_columns if isinstance(train_columns, (list, dict)) else None,
        loss_inputs=seen.loss_inputs,
        time_to_first_step_s=(seen.first_step_wall - launch_time) if seen.first_step_wall else None,
        saved_model=saved,
        time_split=seen.timer.summary(),
        train_flops=seen.flops.per_step,
        train_tokens=seen.flops.tokens,
        flops_shape=seen.flops.shape,
        peak=device_peak(device, precision),
        overridden_args=overridden,
        build=None if build is None else prepare.describe(build),
        # how this rank was started, observed in it (None under torchrun / accelerate launch)
        start_method=ctx.start_method if ctx else None,
        start_method_requested=ctx.start_method_requested if ctx else None,
        training=_training_facts(trainer, precision) if build is not None else None,
    )


def _training_facts(trainer, precision: str) -> dict:
    """What a user's trainer trains with, for the result's config (its TrainConfig fields do not apply)."""
    from .prepare import describe

    args, model = trainer.args, trainer.model
    loss = trainer.loss
    name = (getattr(model.model_card_data, "base_model", None)
            or getattr(getattr(model[0], "auto_model", None), "name_or_path", None) or type(model).__name__)
    return {"model": str(name),
            "loss": ", ".join(sorted({type(v).__name__ for v in loss.values()})) if isinstance(loss, dict)
            else type(loss).__name__,
            "per_device_batch_size": args.per_device_train_batch_size, "steps": args.max_steps,
            "learning_rate": args.learning_rate, "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "seed": args.seed, "mixed_precision": precision, "max_seq_length": model.max_seq_length,
            "evaluator": describe(type(trainer.evaluator)) if trainer.evaluator is not None else None,
            "train_size": _rows(trainer.train_dataset)}


def _rows(dataset):
    """Rows of a dataset; of a dict of datasets, the sum over them; None when it has no length."""
    if isinstance(dataset, dict):
        counts = [_rows(d) for d in dataset.values()]
        return None if None in counts else sum(counts)
    return len(dataset) if hasattr(dataset, "__len__") else None


@dataclass
class Observed:
    """What a rank observes while it trains, filled in by its ``StnbCallback`` and the loss's hooks; read
    after training for its ``RankReport`` and, by ``verification_record``, its verification record."""

    world_size_requested: int            # the world the caller asked for (compared with the process group)
    process_group_size: int
    flops: object                        # mfu.FlopMeter: the training forwards' FLOPs and tokens, per step
    timer: object                        # timesplit.StepTimer: where each step's time goes
    loss_sync: object = None             # strategies.LossParameterSync: the loss's own parameters across ranks
    step_times: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    t_first_begin: float | None = None   # perf_counter at the first step's begin (None: no step began)
    t_last_end: float | None = None
    first_step_wall: float | None = None  # time.time() at the first step's end
    strategy_watch: dict = field(default_factory=dict)  # strategy.on_first_step's {name: observer with .stats()}
    prepared: dict | None = None         # strategies.verify_prepared at the first step (None: never verified)
    loss_model: dict | None = None       # the module the loss calls: {"trains", "rebound", "calls_in_first_step", "ok"}
    loss_model_calls: int = 0            # forwards of the training module during the first step
    loss_model_hook: object = None
    step_check: tuple | None = None      # after the first optimizer step: (the strategy's details, problems)
    trained_parameters: dict | None = None  # what the optimizer updates: the model's and the loss's own
    memory_breakdown: dict | None = None  # memory.measure after the first optimizer step
    loss_inputs: dict | None = None      # what the loss received at its first call ({dataset: that} per loss)
    first_batch_rows: int | None = None  # rows of the loss's first input at its first call
    release_each_step: bool = False      # give freed heap pages back at each step's end (cpualloc)
    released_bytes: list = field(default_factory=list)  # what each step's end gave back

    def count_loss_model_call(self, *_) -> None:
        self.loss_model_calls += 1


def verification_record(seen: Observed, prepare_info: dict, callbacks: dict, after: dict) -> dict:
    """The rank's verification record, composed here only: ``verify_prepared``'s world and counts at the
    first step, the strategy's ``prepare`` details, the trainer's callbacks, the loss's model, the first
    optimizer step's checks, then ``after`` (what training showed: the frozen pooler, the allocator, the
    strategy's observers, the batch override). ``ok`` is True when no check found a problem; empty when
    no training step began (the report then merges as never verified)."""
    if seen.prepared is None:
        return {}
    v = {**seen.prepared, **prepare_info, "callbacks": callbacks, "loss_model": seen.loss_model}
    problems = list(seen.prepared["problems"])
    if seen.step_check is not None:
        info, step_problems = seen.step_check
        v.update(info)
        v["trained_parameters"] = seen.trained_parameters
        problems += step_problems
    if seen.loss_model.get("ok") is False:  # checked at the first step's end
        problems.append(f"the loss never called the {seen.loss_model['trains']} that trains in the first step: "
                        "it holds its own reference to the model; store the model as `self.model` in the loss")
    v.update(after)
    batch = after.get("batch_override")
    if batch is not None and not batch["ok"]:
        problems.append(f"per_device_train_batch_size was overridden to {batch['asked']}, but the loss's first "
                        f"batch had {batch['first_batch_rows']} rows")
    v["problems"] = problems
    v["ok"] = not problems
    return v


def _make_callback(trainer, strategy, config: TrainConfig, seen: Observed):
    from transformers import TrainerCallback

    from . import memory, prepare, strategies

    class StnbCallback(TrainerCallback):
        """Times every step, keeps losses, verifies the prepared model and the loss's model, measures memory."""

        def on_step_begin(self, args, st, control, **kw):
            seen.flops.start_step()  # evaluation forwards before this step do not count
            if seen.t_first_begin is None:
                tr = trainer
                # before the first backward: a strategy's own DDP comm hook (embedding rows), timed
                seen.strategy_watch = strategy.on_first_step(tr, config, seen.process_group_size, timed=seen.timer.timed)
                seen.t_first_begin = time.perf_counter()
                seen.timer.attach(tr, config.comm_hook)  # registers DDP's comm hook, timed
                seen.prepared = strategies.verify_prepared(strategy, tr, seen.world_size_requested)
                # the loss must call the module that trains (sentence-transformers #3023)
                rebound = prepare.rebind_loss_model(tr)
                seen.loss_model = {"trains": type(tr.model_wrapped).__name__, "rebound": rebound}
                seen.loss_model_hook = tr.model_wrapped.register_forward_pre_hook(seen.count_loss_model_call)
                seen.timer.on_step_begin(seen.t_first_begin)  # steps timed as step_times are

        def on_optimizer_step(self, args, st, control, optimizer=None, model=None, **kw):
            seen.timer.on_optimizer_step()
            if seen.memory_breakdown is None:
                seen.memory_breakdown = memory.measure(trainer.model, optimizer, strategy.held_bytes(trainer))
                if seen.prepared is not None:
                    _check_first_step(trainer, strategy, seen, optimizer)

        def on_pre_optimizer_step(self, args, st, control, **kw):
            seen.timer.on_pre_optimizer_step()
            seen.loss_sync.sync_grads()  # the loss's own parameters: mean gradient over the ranks

        def on_step_end(self, args, st, control, **kw):
            now = time.perf_counter()
            seen.timer.on_step_end(now)
            if seen.release_each_step:
                from .cpualloc import release_freed_memory

                seen.released_bytes.append(release_freed_memory())
            seen.flops.end_step()
            prev = seen.t_last_end if seen.t_last_end is not None else seen.t_first_begin
            seen.step_times.append(now - prev)
            if seen.t_last_end is None:
                seen.first_step_wall = time.time()
                seen.loss_model_hook.remove()  # did the loss call the module that trains? (forward hook)
                seen.loss_model.update(calls_in_first_step=seen.loss_model_calls, ok=seen.loss_model_calls > 0)
            seen.t_last_end = now
            report_progress(st.global_step, st.max_steps)  # the step's loss follows in on_log

        def on_log(self, args, st, control, logs=None, **kw):
            if logs and "loss" in logs:
                seen.losses.append(float(logs["loss"]))
                report_progress(st.global_step, st.max_steps, float(logs["loss"]))

    return StnbCallback()


def _check_first_step(trainer, strategy, seen: Observed, optimizer) -> None:
    """After the first optimizer step: the strategy's own check of gradients / optimizer state, and every
    parameter the optimizer updates named (the model's or the loss's: the replicated ones are compared
    across ranks after training, the sharded ones by the strategy's shard checks)."""
    from . import strategies

    info, problems = strategy.check_step(trainer, seen.world_size_requested)
    names, unnamed = strategies.optimizer_parameter_names(trainer, optimizer)
    sync = seen.loss_sync
    seen.trained_parameters = {"optimizer_updates": len(names) + unnamed, "model": len(names) - len(sync.names()),
                               "loss": sync.names(), "loss_parameters_synced": sync.active}
    if unnamed:
        problems.append(f"the optimizer updates {unnamed} parameter(s) that neither the model nor the loss own, "
                        "so stnb cannot check them across ranks")
    seen.step_check = (info, problems)


def _dev_metric(evaluator, model) -> tuple:
    """(primary metric name, value): the evaluator's own primary metric (some name it while evaluating)."""
    scores = evaluator(model)
    name = evaluator.primary_metric
    return name, float(scores[name])


def _record_loss_inputs(loss, seen: Observed) -> None:
    """Note what the loss really receives at its first call: how many text inputs, and a label or not
    (and, in ``first_batch_rows``, how many rows its first input has). A dict of losses (one per
    dataset): ``{dataset: that}`` for each loss that ran."""
    def hook(name, module, args):
        if not args or (seen.loss_inputs is not None and (name is None or name in seen.loss_inputs)):
            return
        first = not seen.loss_inputs  # nothing recorded yet: this call's batch is the first one
        features = list(args[0])
        labels = args[1] if len(args) > 1 else None
        observed = {"texts": len(features), "label": labels is not None}
        if name is None:
            seen.loss_inputs = observed
        else:
            seen.loss_inputs = {**(seen.loss_inputs or {}), name: observed}
        if first:
            tensors = [v for v in (features[0].values() if features and isinstance(features[0], dict) else [])
                       if hasattr(v, "shape") and len(v.shape) >= 1]
            seen.first_batch_rows = int(tensors[0].shape[0]) if tensors else None

    for name, one in (loss.items() if isinstance(loss, dict) else [(None, loss)]):
        one.register_forward_pre_hook(functools.partial(hook, name))


def _batch_override(seen: Observed, trainer, config: TrainConfig) -> dict:
    """An overridden per-device batch: the loss's first batch must have had the rows asked for
    (observed by the loss's hook), unless the data has fewer rows than one batch."""
    # per device, times the GPUs under dp (where the loss sees the whole batch)
    asked = config.arg_overrides()["per_device_train_batch_size"][0] * max(1, trainer.args.n_gpu)
    rows = len(trainer.train_dataset) if hasattr(trainer.train_dataset, "__len__") else None
    got = seen.first_batch_rows
    return {"asked": asked, "first_batch_rows": got, "ok": got == asked or (rows is not None and got == rows < asked)}


def _full_model_on_rank0(strategy, model, initial_path, device, rank, max_seq_length):
    """An ordinary model of the trained one's type with the trained weights, on rank 0 (None elsewhere).

    A sharding strategy gathers the full state (a collective: every rank takes part), loaded here into
    a fresh, unsharded copy of the model (from ``initial_path``).
    """
    full, is_state = strategy.full_model(model, rank)
    if not is_state or rank != 0:
        return full
    from .model_types import load_like

    plain = load_like(model, initial_path, device=device, max_seq_length=max_seq_length)
    plain.load_state_dict(full, strict=True)  # raises if any key is missing or unexpected
    return plain
