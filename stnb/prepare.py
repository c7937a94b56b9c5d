"""Applying a strategy to a built SentenceTransformerTrainer, inside a rank.

The trainer comes from stnb's recipe (``stnb.recipe``) or from a user's build function
(``stnb.run(build, strategy=...)``). Either way ``stnb.training.train_rank`` hands it here before
training. What the strategy owns, and nothing else, is changed; every change is recorded as
``{argument: {"from", "to", "why"}}`` (``RunResult.overridden_args``):

ddp_bucket_cap_mb, ddp_broadcast_buffers, ddp_static_graph
    The user's values are kept; a DDP knob given to ``stnb.run`` (bucket_cap_mb, broadcast_buffers,
    static_graph) replaces the argument's value. gradient_as_bucket_view and comm_hook have no
    argument: they come from ``stnb.run``. ddp_find_unused_parameters is the trainer's own rule
    (the user's value, else True for a SentenceTransformer); stnb's recipe sets False and freezes
    the unused pooler. These reach accelerate as the accelerator's DistributedDataParallelKwargs.
per_device_train_batch_size
    Only when asked: ``stnb.run(build, override_args={"per_device_train_batch_size": 8})``, or the
    Panel's batch widget (why: "set in the Panel"). The first batch the loss receives is checked
    against it (``batch_override`` in the verification).
disable_tqdm
    stnb shows every rank's progress in the notebook; the trainer's tqdm bar (ProgressCallback) and
    log printer (PrinterCallback) inside the ranks are removed.

Refused with the reason and the fix (``BuildError``): a trainer that is not a
SentenceTransformerTrainer, a model_init, ``fsdp`` / ``deepspeed`` in the arguments (stnb shards
the model itself: accelerate's FSDP on CPU silently becomes DDP), ``use_cpu=True`` on a CUDA run,
FSDP with checkpoints that hold optimizer state (the trainer's own rule for pre-sharded models), and
DDP's static_graph with gradient accumulation.

FSDP: the ranks start from rank 0's weights (broadcast when a build made different ones, as DDP does
when it wraps), ``strategies.shard_fsdp`` shards the model in place, and the trainer is told the model
owns its placement and gradient reduction (``is_distributed_loading_by_transformers``).

The loss holds the model: ``rebind_loss_model`` points every reference the loss holds to the
trainer's model at the model that trains (DDP / DataParallel wrapper) before the first step
(sentence-transformers issue #3023); the callback then checks that the first step's loss really
called it.
"""

from __future__ import annotations

import dataclasses

from .config import TrainConfig
from .errors import BuildError, VerificationError

# (stnb.run knob, SentenceTransformerTrainingArguments field)
DDP_ARGS = (("bucket_cap_mb", "ddp_bucket_cap_mb"), ("broadcast_buffers", "ddp_broadcast_buffers"),
            ("static_graph", "ddp_static_graph"))


def describe(obj) -> str:
    """'module.qualname' of a function (a functools.partial: of the function it wraps)."""
    import functools

    while isinstance(obj, functools.partial):
        obj = obj.func
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    module = getattr(obj, "__module__", None)
    return f"{module}.{name}" if module and module not in ("__main__", "builtins") else name


def call_build(build):
    """``build()`` in this rank; its trainer, or BuildError naming the fix."""
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    name = describe(build)
    try:
        trainer = build()
    except Exception as e:
        raise BuildError(f"your build function {name}() raised {type(e).__name__}: {e}. stnb calls it once in "
                         "every rank; fix the function (try it in a cell with a smaller dataset) and run again") from e
    if not isinstance(trainer, SentenceTransformerTrainer):
        hint = (" (it returned the result of trainer.train(): return the trainer itself and let stnb train it)"
                if type(trainer).__name__ == "TrainOutput" else "")
        raise BuildError(f"your build function {name}() returned {type(trainer).__name__}, not a "
                         f"SentenceTransformerTrainer{hint}; end it with `return SentenceTransformerTrainer(model=..., "
                         "args=..., train_dataset=..., loss=...)`")
    if getattr(trainer, "model_init", None) is not None:
        raise BuildError(f"{name}() returned a trainer with model_init: the trainer would build a new model in "
                         "train(), after stnb applied the strategy to this one; pass model=... instead")
    if not isinstance(trainer.model, SentenceTransformer):
        raise BuildError(f"{name}() returned a trainer whose model is a {type(trainer.model).__name__}; stnb.run "
                         "trains SentenceTransformer models")
    return trainer


def refusals(trainer, config: TrainConfig, use_cuda: bool) -> None:
    """Raise BuildError for arguments no strategy can honour as given (checked before training)."""
    args = trainer.args
    problems = []
    if args.fsdp:
        problems.append(f"fsdp={args.fsdp!r} asks accelerate to shard the model, and on CPU accelerate silently "
                        "runs DDP instead; stnb shards it itself (FSDP2): remove fsdp/fsdp_config from your "
                        "arguments and call stnb.run(build, strategy='fsdp')")
    if args.deepspeed:
        problems.append("deepspeed is not one of stnb's strategies; remove deepspeed=... from your arguments "
                        "and choose strategy='ddp' or 'fsdp'")
    if use_cuda and args.use_cpu:
        problems.append("use_cpu=True in your arguments, but this run is on CUDA; remove use_cpu, or run on CPU "
                        "with stnb.run(build, device='cpu')")
    save = str(getattr(args.save_strategy, "value", args.save_strategy))
    if config.strategy == "fsdp" and save != "no":
        # the trainer saves at the end of training too, and its save_pretrained (save_only_model
        # included) cannot write the sharded model stnb's FSDP trains
        problems.append(f"save_strategy={save!r} with FSDP: the trainer's checkpoints (at least one, at the end of "
                        "training) cannot save a model sharded before training; set save_strategy='no' in your "
                        "arguments, and stnb.run(build, save_to=...) saves the trained model, gathered and checked")
    static = config.static_graph or (args.ddp_static_graph and config.static_graph == _default("static_graph"))
    if config.strategy == "ddp" and static and args.gradient_accumulation_steps > 1:
        problems.append("DDP's static_graph cannot be combined with gradient_accumulation_steps > 1 "
                        "(pytorch/pytorch#143580); drop static_graph or the accumulation")
    if problems:
        raise BuildError("cannot train this trainer under strategy " f"{config.strategy!r}: " + "; ".join(problems))


def _default(name: str):
    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}[name]


def apply_dp_precision(trainer) -> str:
    """Give the Trainer's DataParallel path the autocast it leaves out (``strategies.autocast_data_parallel``
    says why): ``trainer._wrap_model`` wraps ``nn.DataParallel`` itself when ``args.n_gpu > 1`` and then
    skips accelerate's ``prepare``, where autocast lives. Returns the precision applied."""
    from .strategies import autocast_data_parallel

    precision = mixed_precision(trainer.args)
    if precision == "no":
        return precision
    original = trainer._wrap_model

    def wrap_model(model, training=True, dataloader=None):
        wrapped = original(model, training=training, dataloader=dataloader)
        if wrapped is not model:  # newly wrapped here: the Trainer's DP path
            wrapped = autocast_data_parallel(wrapped, precision)
        return wrapped

    trainer._wrap_model = wrap_model
    return precision


def mixed_precision(args) -> str:
    """'bf16', 'fp16' or 'no', as the training arguments ask."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "no"


def own_display(trainer) -> tuple[dict, list]:
    """stnb shows progress: (overridden, removed callbacks)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    overridden = {}
    if not trainer.args.disable_tqdm:
        overridden["disable_tqdm"] = {"from": False, "to": True,
                                      "why": "stnb shows every rank's progress in the notebook; a tqdm bar inside "
                                             "each rank would only fill the rank logs"}
        trainer.args.disable_tqdm = True
    removed = []
    for cls in (ProgressCallback, PrinterCallback):
        if trainer.pop_callback(cls) is not None:
            removed.append(cls.__name__)
    return overridden, removed


def apply_overrides(trainer, config: TrainConfig) -> dict:
    """The training arguments ``config.override_args`` replaces (the Panel's batch, or given to
    ``stnb.run``). Returns {argument: {"from", "to", "why"}} for each value that changed."""
    overridden = {}
    for name, (value, why) in config.arg_overrides().items():
        theirs = getattr(trainer.args, name)
        if theirs != value:
            overridden[name] = {"from": theirs, "to": value, "why": why}
            setattr(trainer.args, name, value)
    if "per_device_train_batch_size" in overridden:
        # the Trainer copies the batch at construction; train() passes the copy to its inner loop, which
        # computes the total batch and the state's train_batch_size from it (as transformers does itself
        # when a hyperparameter search changes the batch)
        trainer._train_batch_size = trainer.args.train_batch_size
    return overridden


def apply_ddp(trainer, config: TrainConfig) -> tuple[dict, dict]:
    """Set the accelerator's DDP kwargs (used when train() wraps the model). Returns (kwargs, overridden)."""
    from .strategies import ddp_kwargs

    kw = ddp_kwargs(config)
    own = getattr(trainer.accelerator, "ddp_handler", None)  # built from the trainer's arguments
    if own is not None:
        kw["find_unused_parameters"] = own.find_unused_parameters  # the trainer's own rule
    overridden = {}
    for knob, arg in DDP_ARGS:
        theirs, mine = getattr(trainer.args, arg), getattr(config, knob)
        if mine != _default(knob):  # given to stnb.run
            if theirs is not None and theirs != mine:
                overridden[arg] = {"from": theirs, "to": mine,
                                   "why": f"stnb.run(..., {knob}={mine!r}) was given; it decides DDP's {knob}"}
                setattr(trainer.args, arg, mine)
        elif theirs is not None:
            kw[knob] = theirs  # the user's value, kept
    trainer.accelerator.ddp_handler = ddp_handler(kw)
    return kw, overridden


def ddp_handler(kw: dict):
    """accelerate's DDP kwargs handler for ``kw``. torch 2.13 deprecates DDP's ``broadcast_buffers``
    for ``forward_sync_buffers`` (a FutureWarning in every rank of every DDP run, since
    sentence-transformers turns the broadcast off), and accelerate's handler does not know the new
    name yet: a subclass carries it. The only difference: buffers are still synced once, at wrap
    time, which is what DDP does with the parameters anyway."""
    import inspect
    from dataclasses import dataclass

    import torch
    from accelerate.utils import DistributedDataParallelKwargs

    kw = dict(kw)
    if "forward_sync_buffers" not in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters:
        return DistributedDataParallelKwargs(**kw)

    @dataclass
    class Handler(DistributedDataParallelKwargs):
        forward_sync_buffers: bool = True

    forward = kw.pop("broadcast_buffers", True)
    return Handler(**kw, forward_sync_buffers=forward)


def same_start(model) -> dict:
    """FSDP shards each rank's own copy: make every rank start from rank 0's weights (DDP does the same
    when it wraps). A collective. Returns {"tensors_differing_before", "broadcast", "identical"}."""
    import torch
    import torch.distributed as dist

    from .checks import compare_digests, gather_digests

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {"tensors_differing_before": 0, "broadcast": False, "identical": True}
    same = compare_digests(gather_digests(model))
    n = len(same["differing"])
    if not n:
        return {"tensors_differing_before": 0, "broadcast": False, "identical": True}
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    after = compare_digests(gather_digests(model))  # observed again, not assumed
    if not after["identical"]:
        raise VerificationError(f"after broadcasting rank 0's weights, {len(after['differing'])} tensor(s) still "
                                f"differ across ranks, first {after['first_differing']!r}")
    return {"tensors_differing_before": n, "broadcast": True, "identical": True}


def shard(trainer, config: TrainConfig, device_type: str, world: int) -> dict:
    """FSDP2: shard the trainer's model in place, and tell the trainer it is sharded already."""
    from .strategies import shard_fsdp

    info = shard_fsdp(trainer.model, device_type, world, config.fsdp_layer_cls, config.reshard_after_forward,
                      mixed_precision(trainer.args))
    # the trainer reads this at construction; the model was sharded after it (the same contract)
    trainer.is_distributed_loading_by_transformers = True
    trainer.place_model_on_device = False
    return info


def rebind_loss_model(trainer) -> list:
    """Point every reference the loss holds to the trainer's model at the module that trains
    (``trainer.model_wrapped``: DDP / DataParallel). sentence-transformers does this for a loss's
    ``model`` attribute (``override_model_in_loss``, also binding the methods losses call); any other
    attribute that holds the model is rebound here. Returns the attribute paths changed."""
    import torch

    model, wrapped = trainer.model, trainer.model_wrapped
    losses = trainer.loss.values() if isinstance(trainer.loss, dict) else [trainer.loss]
    if wrapped is model:
        return []
    changed = []
    for loss in losses:
        if not isinstance(loss, torch.nn.Module):
            continue
        before = {n: id(c) for n, c in _model_refs(loss, model, wrapped)}
        trainer.override_model_in_loss(loss, wrapped)
        for path, owner in [(n, m) for n, m in loss.named_modules(remove_duplicate=False)
                            if not isinstance(m, type(wrapped)) and m is not model]:
            for name, child in list(owner.named_children()):
                if child is model:
                    setattr(owner, name, wrapped)
        after = {n: id(c) for n, c in _model_refs(loss, model, wrapped)}
        changed += [n for n in after if before.get(n) != after[n]]
    return changed


def _model_refs(loss, model, wrapped):
    """(path, module) for every attribute of the loss's modules that holds ``model`` or ``wrapped``."""
    out = []
    for path, owner in loss.named_modules(remove_duplicate=False):
        if owner is model or owner is wrapped:
            continue
        for name, child in owner.named_children():
            if child is model or child is wrapped:
                out.append((f"{path}.{name}" if path else name, child))
    return out
