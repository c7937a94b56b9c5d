"""A TrainConfig checked before any process starts (``TrainConfig.validate``, ``check_hardware``,
``check_device``): every field's type and range, the combinations that cannot run, the strategy's own rules
(``strategies.validate_config``), this machine's devices. Each refusal names the fix."""

from __future__ import annotations

import os

from . import strategies
from .errors import ConfigError, StrategyUnavailable, check_positive, unknown_choice
from .hardware import START_METHODS, start_method as resolve_start_method

LOSSES = ("cosine", "mnrl", "softmax+cosine")  # softmax+cosine: stnb.seed_recipe (NLI + STS, one run)
PRECISIONS = ("no", "fp16", "bf16")
DEVICES = ("auto", "cpu", "cuda")


def check_choice(name, value, choices):
    if value not in choices:
        raise unknown_choice(name, value, choices)


def check_int(name, value, lo):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r} ({type(value).__name__})")
    if value < lo:
        raise ConfigError(f"{name} must be >= {lo}, got {value}")


def validate(config, check_resources: bool = True) -> None:
    """``TrainConfig.validate``: raise ConfigError / StrategyUnavailable naming the fix.

    check_resources also resolves the model and data (exists, non-empty) and checks
    the hardware. Nothing here starts a process or initialises CUDA.
    """
    strategies.get(config.strategy)  # an unknown name: ConfigError listing the known ones
    check_choice("loss", config.loss, LOSSES)
    check_choice("mixed_precision", config.mixed_precision, PRECISIONS)
    check_choice("device", config.device, DEVICES)
    check_choice("start_method", config.start_method, START_METHODS)
    resolve_start_method(config.start_method)  # one this platform has
    check_int("per_device_batch_size", config.per_device_batch_size, 1)
    check_int("steps", config.steps, 1)
    check_int("train_size", config.train_size, 2)
    check_int("dev_size", config.dev_size, 0)
    check_int("seed", config.seed, 0)
    check_int("warmup_steps_excluded", config.warmup_steps_excluded, 0)
    check_int("dev_points", config.dev_points, 0)
    check_int("gradient_accumulation_steps", config.gradient_accumulation_steps, 1)
    check_int("checkpoint_every", config.checkpoint_every, 0)
    if config.keep is not None:
        check_int("keep", config.keep, 1)
    if config.resume is not None and (not isinstance(config.resume, (str, os.PathLike)) or not str(config.resume)):
        raise ConfigError(f"resume takes 'latest', 'auto' or a checkpoint's path, got {config.resume!r}")
    if config.threads_per_rank is not None:
        check_int("threads_per_rank", config.threads_per_rank, 1)
    if config.max_seq_length is not None:
        check_int("max_seq_length", config.max_seq_length, 8)
    if config.num_processes is not None:
        check_int("num_processes", config.num_processes, 1)
    check_positive("learning_rate", config.learning_rate)
    for name in ("timeout", "stall_timeout", "memory_budget_gib"):
        v = getattr(config, name)
        if v is not None:
            check_positive(name, v)
    if not isinstance(config.model, str) or not config.model.strip():
        raise ConfigError(f"model must be 'minilm', 'tiny', a hub id or a local path; got {config.model!r}")
    if not isinstance(config.data, str) or not config.data.strip():
        raise ConfigError(f"data must be 'synthetic', a .csv/.jsonl path or a hub dataset; got {config.data!r}")
    from .columns import check_mapping

    check_mapping(config.columns)
    config.arg_overrides()
    if config.steps <= config.warmup_steps_excluded:
        raise ConfigError(
            f"steps={config.steps} leaves no measured step after warmup_steps_excluded={config.warmup_steps_excluded}; "
            f"use steps >= {config.warmup_steps_excluded + 1} or lower warmup_steps_excluded")
    strategies.validate_config(config)  # the knobs it owns, one process or several, its own rules
    if config.loss != "mnrl" and config.gather_across_devices:
        raise ConfigError(f"gather_across_devices only applies to loss='mnrl' (in-batch negatives), not "
                          f"loss={config.loss!r}; set loss='mnrl' or gather_across_devices=False")
    if config.gather_across_devices and not config.strategy_object().distributed:
        raise ConfigError(f"gather_across_devices gathers in-batch negatives from the other ranks; "
                          f"strategy {config.strategy!r} runs one process, so there is nothing to gather. "
                          "Use strategy='ddp' or set gather_across_devices=False")
    if config.loss == "mnrl" and config.per_device_batch_size < 2 and config.world_size() < 2:
        raise ConfigError("loss='mnrl' needs at least 2 samples per batch for in-batch negatives; "
                          "use per_device_batch_size >= 2")
    if config.dev_size == 0 and config.evaluate:
        raise ConfigError("evaluate=True needs dev pairs; set dev_size > 0 or evaluate=False")
    if config.dev_points and not config.evaluate:
        raise ConfigError(f"dev_points={config.dev_points} evaluates the dev evaluator during training, and "
                          "evaluate=False turns it off; set evaluate=True or dev_points=0")
    if config.dev_points >= config.steps:
        raise ConfigError(f"dev_points={config.dev_points} evaluations between step 0 and step {config.steps} need "
                          f"more steps: use dev_points <= {config.steps - 1} or steps >= {config.dev_points + 1}")
    if check_resources:
        config.check_hardware()
        config.check_inputs()


def check_device(config, device: str) -> None:
    """What only a GPU does, refused for ranks on ``device`` 'cpu' (ConfigError)."""
    if config.mixed_precision == "fp16" and device == "cpu":
        raise ConfigError("mixed_precision='fp16' needs a GPU; on CPU use 'bf16' or 'no'")
    config.strategy_object().check_device(config, device)


def check_hardware(config) -> None:
    """This machine can run the strategy with this many processes (ConfigError / StrategyUnavailable)."""
    from .hardware import capacity_problem, gpu_count, gpu_problems, strategy_availability

    device = config.resolved_device()
    if device == "cuda" and gpu_count() == 0:  # before the strategy's own availability says less
        raise ConfigError(capacity_problem(device, config.world_size()))
    if device == "cuda":
        problems = gpu_problems(config.mixed_precision)
        if problems:
            raise ConfigError("; ".join(problems))
    config.check_device(device)
    avail = strategy_availability(device, config.share_gpus)[config.strategy]
    if not avail["runnable"]:
        raise StrategyUnavailable(config.strategy, avail["reason"])
    ws = config.world_size()
    problem = capacity_problem(device, ws, share_gpus=config.share_gpus)
    if problem:
        raise ConfigError(problem)
    need = config.strategy_object().min_ranks
    if ws < need:
        raise ConfigError(f"{config.strategy} needs at least {need} ranks to shard over; use num_processes >= {need}")
