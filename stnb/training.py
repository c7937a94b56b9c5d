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
    requested = world_size if world_size is not None else config.world_size()

    torch.manual_seed(config.seed)
    if build is None:
        from .recipe import build_trainer

        trainer = build_trainer(config, model_path, device, use_cuda, distributed)
    else:
        trainer = prepare.call_build(build)
    prepare.refusals(trainer, config, use_cuda)
    model, evaluator = trainer.model, trainer.evaluator
    overridden, removed = prepare.own_display(trainer)
    overridden.update(prepare.apply_overrides(trainer, config))
    kept = [type(c).__name__ for c in trainer.callback_handler.callbacks]

    state = {"t_first_begin": None, "t_last_end": None, "step_times": [], "losses": [], "verification": None,
             "memory_breakdown": None, "world_size_requested": requested, "process_group_size": world,
             "n_gpu": n_gpu, "first_step_wall": None}
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
    state["flops"] = FlopMeter(model)  # counts the tokens of every training forward (stnb.mfu)
    state["timer"] = StepTimer()  # where each step's time goes (stnb.timesplit)
    _record_loss_inputs(trainer.loss, state)
    trainer.stnb_config = config
    prepared = strategy.prepare(trainer, config, "cuda" if use_cuda else "cpu", world)
    prep = prepared["info"]
    overridden.update(prepared["overridden"])
    state["loss_sync"] = strategies.LossParameterSync(trainer)  # a collective: rank 0's loss parameters
    state["prepare_info"] = prep
    state["callbacks"] = {"kept": kept, "removed": removed, "added": "StnbCallback"}
    trainer_ref = {"trainer": trainer}
    trainer.add_callback(_make_callback(trainer_ref, config, state))
    model_shape["optimizer"] = memory.optimizer_kind(trainer.args.optim)
    precision = prepare.mixed_precision(trainer.args)
    try:
        # the peak of the training steps alone: rank 0's evaluation, FSDP's gathered full copy and
        # the save/reload come after training and are in the whole-run peak only
        peak_memory.start_phase()
        trainer.train()
        train_peak = peak_memory.phase_peak()
        if state["verification"] is not None:
            state["verification"]["frozen_unused"] = frozen
            state["verification"]["reuse_freed_memory"] = allocator
            if state.get("embedding_rows") is not None:
                state["verification"]["embedding_rows"] = state["embedding_rows"].stats()
            if "per_device_train_batch_size" in overridden:
                _check_batch_override(state, trainer, config)

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
        step_times=state["step_times"],
        losses=state["losses"],
        verification=state["verification"] or {},
        memory_breakdown=state["memory_breakdown"] or {},
        model_shape=model_shape,
        peak_memory_bytes=int(train_peak),
        peak_memory_run_bytes=int(run_peak),
        peak_memory_method=peak_memory.method,
        weight_digests=digests,
        dev_metric=metric,
        dev_metric_before=dev_before,
        dev_metric_after=dev_after,
        # a dict of datasets (one per loss): {dataset: its columns}
        data_columns=train_columns if isinstance(train_columns, (list, dict)) else None,
        loss_inputs=state.get("loss_inputs"),
        time_to_first_step_s=(state["first_step_wall"] - launch_time) if state["first_step_wall"] else None,
        saved_model=saved,
        time_split=state["timer"].summary(),
        train_flops=state["flops"].per_step,
        train_tokens=state["flops"].tokens,
        flops_shape=state["flops"].shape,
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


def _make_callback(trainer_ref: dict, config: TrainConfig, state: dict):
    import torch
    from transformers import TrainerCallback

    from . import memory, prepare, strategies

    class StnbCallback(TrainerCallback):
        """Times every step, keeps losses, verifies the prepared model and the loss's model, measures memory."""

        def on_step_begin(self, args, st, control, **kw):
            state["flops"].start_step()  # evaluation forwards before this step do not count
            if state["t_first_begin"] is None:
                tr = trainer_ref["trainer"]
                strategy = strategies.get(config.strategy)
                # before the first backward: a strategy's own DDP comm hook (embedding rows), timed
                state.update(strategy.on_first_step(tr, config, state["process_group_size"], timed=state["timer"].timed))
                state["t_first_begin"] = time.perf_counter()
                state["timer"].attach(tr, config.comm_hook)  # registers DDP's comm hook, timed
                state["verification"] = strategies.verify_prepared(strategy, tr, state["world_size_requested"])
                state["verification"].update(state.get("prepare_info", {}))
                state["verification"]["callbacks"] = state["callbacks"]
                # the loss must call the module that trains (sentence-transformers #3023)
                rebound = prepare.rebind_loss_model(tr)
                calls = state["loss_model_calls"] = [0]
                state["loss_model_hook"] = tr.model_wrapped.register_forward_pre_hook(
                    lambda *_: calls.__setitem__(0, calls[0] + 1))
                state["verification"]["loss_model"] = {"trains": type(tr.model_wrapped).__name__,
                                                       "rebound": rebound}
                state["timer"].on_step_begin(state["t_first_begin"])  # steps timed as step_times are

        def on_optimizer_step(self, args, st, control, optimizer=None, model=None, **kw):
            state["timer"].on_optimizer_step()
            if state["memory_breakdown"] is None:
                tr = trainer_ref["trainer"]
                held = strategies.get(config.strategy).held_bytes(tr)
                state["memory_breakdown"] = memory.measure(tr.model, optimizer, held)
                _check_first_step(tr, config, state, optimizer)

        def on_pre_optimizer_step(self, args, st, control, **kw):
            state["timer"].on_pre_optimizer_step()
            state["loss_sync"].sync_grads()  # the loss's own parameters: mean gradient over the ranks

        def on_step_end(self, args, st, control, **kw):
            now = time.perf_counter()
            state["timer"].on_step_end(now)
            state["flops"].end_step()
            prev = state["t_last_end"] if state["t_last_end"] is not None else state["t_first_begin"]
            state["step_times"].append(now - prev)
            if state["t_last_end"] is None:
                state["first_step_wall"] = time.time()
                _check_loss_model(state)
            state["t_last_end"] = now
            report_progress(st.global_step, st.max_steps)  # the step's loss follows in on_log

        def on_log(self, args, st, control, logs=None, **kw):
            if logs and "loss" in logs:
                state["losses"].append(float(logs["loss"]))
                report_progress(st.global_step, st.max_steps, float(logs["loss"]))

    return StnbCallback()


def _check_first_step(trainer, config, state: dict, optimizer) -> None:
    """After the first optimizer step: the strategy's own check of gradients / optimizer state, and every
    parameter the optimizer updates named (the model's or the loss's: the replicated ones are compared
    across ranks after training, the sharded ones by the strategy's shard checks)."""
    from . import strategies

    v = state["verification"]
    if v is None:
        return
    info, problems = strategies.get(config.strategy).check_step(trainer, state["world_size_requested"])
    v.update(info)
    names, unnamed = strategies.optimizer_parameter_names(trainer, optimizer)
    sync = state["loss_sync"]
    v["trained_parameters"] = {"optimizer_updates": len(names) + unnamed, "model": len(names) - len(sync.names()),
                               "loss": sync.names(), "loss_parameters_synced": sync.active}
    if unnamed:
        problems.append(f"the optimizer updates {unnamed} parameter(s) that neither the model nor the loss own, "
                        "so stnb cannot check them across ranks")
    if problems:
        v["problems"] += problems
        v["ok"] = False


def _check_loss_model(state: dict) -> None:
    """After the first step: did the loss call the module that trains? (observed by a forward hook)"""
    state.pop("loss_model_hook").remove()
    v = state["verification"]
    calls = state["loss_model_calls"][0]
    v["loss_model"]["calls_in_first_step"] = calls
    v["loss_model"]["ok"] = calls > 0
    if not calls:
        v["problems"].append(f"the loss never called the {v['loss_model']['trains']} that trains in the first step: "
                             "it holds its own reference to the model; store the model as `self.model` in the loss")
        v["ok"] = False


def _dev_metric(evaluator, model) -> tuple:
    """(primary metric name, value): the evaluator's own primary metric (some name it while evaluating)."""
    scores = evaluator(model)
    name = evaluator.primary_metric
    return name, float(scores[name])


def _record_loss_inputs(loss, state: dict) -> None:
    """Note what the loss really receives at its first call: how many text inputs, and a label or not
    (and, in ``first_batch_rows``, how many rows its first input has). A dict of losses (one per
    dataset): ``{dataset: that}`` for each loss that ran."""
    def hook(name, module, args):
        if args and (name is None and state.get("loss_inputs") is None
                     or name is not None and name not in state.setdefault("loss_inputs", {})):
            features = list(args[0])
            labels = args[1] if len(args) > 1 else None
            seen = {"texts": len(features), "label": labels is not None}
            if name is None:
                state["loss_inputs"] = seen
            else:
                state["loss_inputs"][name] = seen
            tensors = [v for v in (features[0].values() if features and isinstance(features[0], dict) else [])
                       if hasattr(v, "shape") and len(v.shape) >= 1]
            state.setdefault("first_batch_rows", int(tensors[0].shape[0]) if tensors else None)

    for name, one in (loss.items() if isinstance(loss, dict) else [(None, loss)]):
        one.register_forward_pre_hook(functools.partial(hook, name))


def _check_batch_override(state: dict, trainer, config: TrainConfig) -> None:
    """An overridden per-device batch: the loss's first batch must have had the rows asked for
    (observed by the loss's hook), unless the data has fewer rows than one batch."""
    v = state["verification"]
    # per device, times the GPUs under dp (where the loss sees the whole batch)
    asked = config.arg_overrides()["per_device_train_batch_size"][0] * max(1, trainer.args.n_gpu)
    seen = state.get("first_batch_rows")
    rows = len(trainer.train_dataset) if hasattr(trainer.train_dataset, "__len__") else None
    ok = seen == asked or (rows is not None and seen == rows < asked)
    v["batch_override"] = {"asked": asked, "first_batch_rows": seen, "ok": ok}
    if not ok:
        v["problems"].append(f"per_device_train_batch_size was overridden to {asked}, but the loss's first batch "
                             f"had {seen} rows")
        v["ok"] = False


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
