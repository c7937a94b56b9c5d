"""A built SentenceTransformerTrainer made ready for stnb, inside a rank (the strategy itself is applied
by its own object, ``stnb.strategies``: ``Strategy.prepare``).

The trainer comes from the run's build object (``stnb.builds``: stnb's recipe or a user's build function,
``stnb.run(build, strategy=...)``). Either way ``stnb.training.train_rank`` hands it here before
training. What stnb owns, and nothing else, is changed; every change is recorded as
``{argument: {"from", "to", "why"}}`` (``RunResult.overridden_args``); a strategy's own changes
(DDP's knobs: ``stnb.strategies.ddp.apply_ddp``) are recorded the same way:

per_device_train_batch_size
    Only when asked: ``stnb.run(build, override_args={"per_device_train_batch_size": 8})``, or the
    Panel's batch widget (why: "set in the Panel"). The first batch the loss receives is checked
    against it (``batch_override`` in the verification).
disable_tqdm
    stnb shows every rank's progress in the notebook; the trainer's tqdm bar (ProgressCallback) and
    log printer (PrinterCallback) inside the ranks are removed.

Refused with the reason and the fix (``BuildError``): a trainer that is not a
SentenceTransformerTrainer, a model_init, ``fsdp`` in the arguments (stnb shards the model itself:
accelerate's FSDP on CPU silently becomes DDP), ``deepspeed`` in the arguments (choose
strategy='deepspeed'), ``use_cpu=True`` on a CUDA run, and whatever the chosen strategy refuses
(``Strategy.refusals``: DeepSpeed with a loss that has its own parameters, DDP's static_graph with
accumulation, ...).

The loss holds the model: ``rebind_loss_model`` points every reference the loss holds to the
trainer's model at the model that trains (DDP / DataParallel wrapper) before the first step
(sentence-transformers issue #3023); the first-step checks (``stnb.instruments.FirstStepChecks``)
then check that the first step's loss really called it.
"""

from __future__ import annotations

from .config import TrainConfig
from .errors import BuildError
from .strategies import mixed_precision



def describe(obj) -> str:
    """'module.qualname' of a function (a functools.partial: of the function it wraps)."""
    import functools

    while isinstance(obj, functools.partial):
        obj = obj.func
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    module = getattr(obj, "__module__", None)
    return f"{module}.{name}" if module and module not in ("__main__", "builtins") else name


def training_facts(trainer) -> dict:
    """What a user's trainer trains with, for the result's config (its TrainConfig recipe fields do not apply)."""
    args, model = trainer.args, trainer.model
    loss = trainer.loss
    name = (getattr(model.model_card_data, "base_model", None)
            or getattr(getattr(model[0], "auto_model", None), "name_or_path", None) or type(model).__name__)
    return {
        "model": str(name),
        "loss": ", ".join(sorted({type(v).__name__ for v in loss.values()})) if isinstance(loss, dict)
        else type(loss).__name__,
        "per_device_batch_size": args.per_device_train_batch_size, "steps": args.max_steps,
        "learning_rate": args.learning_rate, "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "seed": args.seed, "mixed_precision": mixed_precision(args), "max_seq_length": model.max_seq_length,
        "evaluator": describe(type(trainer.evaluator)) if trainer.evaluator is not None else None,
        "train_size": _rows(trainer.train_dataset)}


def _rows(dataset):
    """Rows of a dataset; of a dict of datasets, the sum over them; None when it has no length."""
    if isinstance(dataset, dict):
        counts = [_rows(d) for d in dataset.values()]
        return None if None in counts else sum(counts)
    return len(dataset) if hasattr(dataset, "__len__") else None


def call_build(build):
    """``build()`` in this rank; its trainer, or BuildError naming the fix."""
    name = describe(build)
    try:
        trainer = build()
    except Exception as e:
        raise BuildError(f"your build function {name}() raised {type(e).__name__}: {e}. stnb calls it once in "
                         "every rank; fix the function (try it in a cell with a smaller dataset) and run again") from e
    check_trainer(trainer, name)
    return trainer


def check_trainer(trainer, name: str = "build") -> None:
    """BuildError unless ``trainer`` is a sentence-transformers trainer stnb knows, holding its own model type."""
    from . import model_types

    kind = model_types.of_trainer(trainer)
    if kind is None:
        hint = (" (it returned the result of trainer.train(): return the trainer itself and let stnb train it)"
                if type(trainer).__name__ == "TrainOutput" else "")
        # a model returned instead of its trainer, or a trainer of the wrong family holding a known model
        fits = model_types.of_model(trainer) or model_types.of_model(getattr(trainer, "model", None))
        if fits is not None:
            raise BuildError(f"your build function {name}() returned {type(trainer).__name__}, not a {fits.trainer}"
                             f"{hint}; end it with `{fits.example}`")
        raise BuildError(f"your build function {name}() returned {type(trainer).__name__}{hint}; stnb trains the "
                         f"sentence-transformers trainers {model_types.known_trainers()}; end it with "
                         + " or ".join(f"`return {t.trainer}(...)`" for t in model_types.TYPES))
    if getattr(trainer, "model_init", None) is not None:
        raise BuildError(f"{name}() returned a trainer with model_init: the trainer would build a new model in "
                         "train(), after stnb applied the strategy to this one; pass model=... instead")
    if model_types.of_model(trainer.model) != kind:
        raise BuildError(f"{name}() returned a {type(trainer).__name__} whose model is a "
                         f"{type(trainer.model).__name__}; a {kind.trainer} trains a {kind.model}")


def refusals(trainer, config: TrainConfig, use_cuda: bool) -> None:
    """Raise BuildError for arguments no strategy can honour as given (checked before training)."""
    args = trainer.args
    problems = []
    if args.fsdp:
        problems.append(f"fsdp={args.fsdp!r} asks accelerate to shard the model, and on CPU accelerate silently "
                        "runs DDP instead; stnb shards it itself (FSDP2): remove fsdp/fsdp_config from your "
                        "arguments and call stnb.run(build, strategy='fsdp')")
    if args.deepspeed and not config.strategy_object().owns_deepspeed:
        problems.append("deepspeed=... in your arguments asks the trainer for DeepSpeed; with stnb choose "
                        "strategy='deepspeed' (stage=1, 2 or 3) and remove deepspeed=... from your arguments, "
                        "or remove it and choose another strategy")
    if use_cuda and args.use_cpu:
        problems.append("use_cpu=True in your arguments, but this run is on CUDA; remove use_cpu, or run on CPU "
                        "with stnb.run(build, device='cpu')")
    problems += config.strategy_object().refusals(trainer, config)
    if problems:
        raise BuildError("cannot train this trainer under strategy " f"{config.strategy!r}: " + "; ".join(problems))


def own_display(trainer) -> tuple[dict, dict]:
    """stnb shows progress: (overridden, {"removed": the callbacks taken off, "kept": the trainer's others})."""
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
    return overridden, {"kept": [type(c).__name__ for c in trainer.callback_handler.callbacks], "removed": removed}


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


def drop_autocast(model) -> bool:
    """After training: take off the autocast wrapper accelerate put on ``model.forward`` for mixed precision
    (``accelerate.utils.extract_model_from_parallel(keep_fp32_wrapper=False)``), so that what follows
    training, the dev metric and the save check, sees the model in its own precision, as it is saved and as
    the dev metric before training saw it. True when there was a wrapper to take off."""
    from accelerate.utils import extract_model_from_parallel

    wrapped = "_original_forward" in vars(model)
    extract_model_from_parallel(model, keep_fp32_wrapper=False)
    return wrapped


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
