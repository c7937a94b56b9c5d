"""The strategies stnb knows: one module and one object each, and the registry everything else asks.

=========  =================  ===============================================================
name       ZeRO stage         module
=========  =================  ===============================================================
single     -                  ``single.py``   one device, no wrapper
dp         -                  ``dp.py``       torch.nn.DataParallel over the GPUs of one process
ddp        -                  ``ddp.py``      DistributedDataParallel, gradients all-reduced
zero1      1 (optimizer)      ``zero1.py``    DDP + ZeroRedundancyOptimizer
zero2      2 (+ gradients)    ``zero2.py``    FSDP2, reshard_after_forward=False
fsdp       3 (+ parameters)   ``fsdp.py``     FSDP2 fully_shard
deepspeed  1, 2 or 3          ``deepspeed.py`` the trainer's own DeepSpeed integration
=========  =================  ===============================================================

The registry finds them itself: every class a module of this package defines with its own ``name``
is registered, in the order of their ``order``, when the package is imported; adding a strategy is
adding its module. ``get(name)`` returns the strategy object (an unknown name is a ConfigError listing
the known ones); ``register(cls)`` adds one from elsewhere (a user's, a test's), refusing a class that
does not implement its verification (``Strategy.check_prepared`` and ``check_ranks`` are abstract).
Nothing outside this package names a strategy (no comparison, no key, no list of names): it asks the
objects (``distributed``, ``options``, ``held``, ``available``, ``step_time``, ``bench``, ``gpu_check``, ...).

A strategy's own options (``Strategy.options``: name -> ``Option``) are declared in its module alone;
``options()`` gathers them for TrainConfig (flat keywords), the CLI, the Panel and the results. Two strategies
may share an option (zero1 takes DDP's) only as the same declaration; ``reserve`` keeps the names TrainConfig's
own fields use out of them.
"""

from __future__ import annotations

import inspect

from ..errors import ConfigError, VerificationError
from .base import PARTS, Option, Strategy, mixed_precision, replicated_check, save_strategy, torch_optimizer
from .dp import autocast_data_parallel
from .ddp import ddp_kwargs
from .fsdp import shard_fsdp
from .loss_sync import LossParameterSync
from .tensors import (freeze_unused_pooler, local_numel, loss_owned_parameters, optimizer_parameter_names,
                      param_counts, shard_problems, tensor_bytes)

_REGISTRY: dict = {}
_RESERVED: set = set()  # TrainConfig's own field names (``reserve``): no strategy option may take one


def register(cls) -> Strategy:
    """Add a strategy class to the registry and return its object. Refused (TypeError): not a Strategy,
    a name already taken, or verification not implemented (an abstract ``check_prepared``/``check_ranks``)."""
    if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
        raise TypeError(f"{cls!r} is not a stnb.strategies.Strategy subclass")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise TypeError(f"strategy class {cls.__name__} cannot be registered: it does not implement its "
                        f"verification ({', '.join(missing)}); a strategy that cannot verify itself cannot run")
    for attr in ("name", "label", "summary"):
        if not isinstance(getattr(cls, attr, None), str) or not getattr(cls, attr):
            raise TypeError(f"strategy class {cls.__name__} needs a non-empty {attr}")
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise TypeError(f"a strategy named {cls.name!r} is registered already ({type(_REGISTRY[cls.name]).__name__})")
    _check_options(cls)
    _REGISTRY[cls.name] = cls()
    return _REGISTRY[cls.name]


def _check_options(cls) -> None:
    """TypeError for options a strategy cannot declare: not ``Option``s, a name TrainConfig's own fields use, a
    default outside its choices, or a name another strategy declares differently; or a tuning that sets
    something other than its own options."""
    declared = options()
    for name, o in cls.options.items():
        why = ("it is not a stnb.strategies.Option" if not isinstance(o, Option) else
               "TrainConfig has a field of that name" if name in _RESERVED or not name.isidentifier() else
               f"its default {o.default!r} is not one of its choices" if o.choices and o.default not in (*o.choices, None) else
               f"strategy {' / '.join(option_owners(name))} declares it differently (share its Option)"
               if name in declared and declared[name] != o else "")
        if why:
            raise TypeError(f"strategy class {cls.__name__} cannot declare option {name!r}: {why}")
    for name, values in {**cls.tunings, **cls.tunings_accumulating}.items():
        foreign = [k for k in values if k not in cls.options]
        if foreign:
            raise TypeError(f"strategy class {cls.__name__}'s tuning {name!r} sets {', '.join(foreign)}, which "
                            f"{'is not an option' if len(foreign) == 1 else 'are not options'} of its own")


def reserve(names) -> None:
    """TrainConfig's own field names: refused as strategy options (TypeError when a registered one has one)."""
    names = set(names)
    taken = sorted(names & set(options()))
    if taken:
        raise TypeError(f"strategy options {taken} have the names of TrainConfig fields; rename them")
    _RESERVED.update(names)


def options() -> dict:
    """Every registered strategy's own options, name -> ``Option``, in the registry's order."""
    out = {}
    for s in _REGISTRY.values():
        for name, o in s.options.items():
            out.setdefault(name, o)
    return out


def option_owners(name: str) -> list:
    """The registered strategies that take option ``name``."""
    return [s.name for s in _REGISTRY.values() if name in s.options]


def unregister(name: str) -> None:
    """Remove a strategy (tests that add a made-up one)."""
    _REGISTRY.pop(name, None)


def get(name) -> Strategy:
    """The strategy object for ``name``; ConfigError naming the known ones otherwise."""
    if isinstance(name, Strategy):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        same = alias_of(name)
        hint = f" ({name} is strategy {same.name!r}: {same.aka})" if same else ""
        raise ConfigError(f"unknown strategy {name!r}{hint}; choose one of {', '.join(map(repr, names()))}") from None


def alias_of(name) -> Strategy | None:
    """The strategy another name spells by its ``aka`` ('zero3' is fsdp, "ZeRO stage 3"), else None."""
    key = str(name).lower().replace("-", "")
    return next((s for s in _REGISTRY.values() if s.aka and key in
                 (s.aka.lower().replace(" stage ", ""), s.aka.lower().replace(" ", ""))), None)


def names() -> tuple:
    return tuple(_REGISTRY)


def all_strategies() -> tuple:
    return tuple(_REGISTRY.values())


def owner(fmt: str):
    """The strategy whose checkpoints are in format ``fmt`` (``Strategy.checkpoint_format``; None: none here)."""
    return next((s for s in _REGISTRY.values() if s.checkpoint_format == fmt), None)


def is_distributed(name) -> bool:
    return get(name).distributed


def baseline_name() -> str:
    """The strategy every other one is compared with (speed-ups, efficiency): 'single'."""
    return next(n for n, s in _REGISTRY.items() if s.baseline)


def distributed_names() -> tuple:
    return tuple(n for n, s in _REGISTRY.items() if s.distributed)


# ---- before any process starts ---------------------------------------------------------------

def validate_config(config) -> None:
    """Generic checks every strategy gets (an option set away from its default must be one of the chosen
    strategy's; one-process strategies take no num_processes), then the strategy's own ``validate``, then its
    options' declared rules (``Option.choices``, ``Option.positive``)."""
    s = get(config.strategy)
    foreign = [k for k, o in options().items() if k not in s.options and getattr(config, k) != o.default]
    if foreign:
        raise ConfigError("; ".join(f"{k}={getattr(config, k)!r} is an option of {' / '.join(option_owners(k))}"
                                    for k in foreign)
                          + f", not of strategy {s.name!r}: use one of those strategies or leave "
                          + ("it" if len(foreign) == 1 else "them") + " at the default")
    if not s.distributed and config.num_processes not in (None, 1):
        raise ConfigError(
            f"strategy {s.name!r} runs in one process, got num_processes={config.num_processes}; use a strategy "
            f"with one process per device ({', '.join(distributed_names())}) or drop num_processes")
    if s.distributed:
        refused = s.world_refusal(config.resolved_device(), config.world_size())
        if refused:
            raise ConfigError(refused)
    s.validate(config)
    for name, value in s.given(config).items():  # its options' declared rules, after its own checks
        s.options[name].check(name, value)


def on_the_wire(values: dict) -> dict:
    """What the options among ``values`` (a run's config) change about what the collectives move: what their
    ``Option.wire`` gives (``stnb.scaling.Measured`` fields, and the bytes of a gradient element), merged; an
    option not in ``values`` counts at its default."""
    out = {}
    for name, o in options().items():
        if o.wire is not None:
            value = values.get(name)
            out.update(o.wire(o.default if value is None else value))
    return out


def availability(device: str, n_gpu: int, max_ranks: int, backend: str, has_distributed: bool = True) -> dict:
    """{name: {"runnable", "reason"}} for every registered strategy on this hardware."""
    out = {}
    for s in _REGISTRY.values():
        if s.distributed and not has_distributed:
            ok, why = False, "this torch build has no torch.distributed"
        else:
            ok, why = s.available(device, n_gpu, max_ranks, backend)
        out[s.name] = {"runnable": bool(ok), "reason": why}
    return out


# ---- in a rank -----------------------------------------------------------------------------------

def verify_prepared(strategy, trainer, world_size_expected: int, world: dict | None = None) -> dict:
    """At the first step, in every rank: the world the caller asked for against the process group observed
    (a collective), parameter counts, and the strategy's own ``check_prepared``. Raises VerificationError."""
    import torch.distributed as dist

    from ..checks import observe_world, world_problems

    s = get(strategy)
    world = world if world is not None else observe_world()
    local, total = param_counts(trainer.model)
    info = {"strategy": s.name, "wrapper": type(trainer.model_wrapped).__name__,
            "world_size_requested": world_size_expected, "world_size_seen": world["process_group_size"],
            "processes_seen": world["processes"], "backend": dist.get_backend() if dist.is_initialized() else None,
            "local_param_count": local, "total_param_count": total,
            "local_param_fraction": local / total if total else None}
    problems = world_problems(world_size_expected, world)
    own, own_problems = s.check_prepared(trainer, world_size_expected)
    info.update(own)
    problems += own_problems
    info["problems"] = problems
    info["ok"] = not problems
    if problems:
        raise VerificationError(f"strategy {s.name!r} failed verification: " + "; ".join(problems))
    return info


def verify(strategy, wrapped, model, world_size_expected: int, n_gpu: int = 0, world: dict | None = None) -> dict:
    """``verify_prepared`` for a bare (wrapped, model) pair, without a trainer."""
    from types import SimpleNamespace

    return verify_prepared(strategy, SimpleNamespace(model=model, model_wrapped=wrapped), world_size_expected, world)


# ---- after the run ----------------------------------------------------------------------------

def verify_ranks(strategy, rank_results: list, world_size: int) -> tuple[dict, list]:
    """What needs every rank: each replicated tensor (model and loss parameters alike) identical across
    ranks, whatever the strategy, then the strategy's own ``check_ranks``."""
    s = get(strategy)
    info, problems = replicated_check(rank_results)
    own, own_problems = s.check_ranks(rank_results, world_size)
    info.update(own)
    return info, problems + own_problems


def find_strategies(path, package: str) -> list:
    """The strategy classes the modules of a package define (each with its own ``name``, defined in that
    module, not imported into it), sorted by ``order``. ``path``: the package's ``__path__``."""
    import importlib
    import pkgutil

    found = []
    for info in pkgutil.iter_modules(path):
        module = importlib.import_module(f"{package}.{info.name}")
        found += [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, Strategy)
                  and c.__module__ == module.__name__ and "name" in vars(c)]
    return sorted(found, key=lambda c: (c.order, c.name))


def _register_builtins() -> None:
    """Register every strategy class this package's modules define: adding a strategy is adding its module."""
    for cls in find_strategies(__path__, __name__):
        register(cls)


_register_builtins()

__all__ = ["PARTS", "Option", "Strategy", "register", "unregister", "get", "options", "option_owners", "reserve", "alias_of", "find_strategies", "names", "owner",
           "all_strategies", "is_distributed", "distributed_names", "baseline_name", "validate_config", "availability",
           "verify_prepared", "verify", "verify_ranks", "autocast_data_parallel", "ddp_kwargs", "shard_fsdp",
           "freeze_unused_pooler", "local_numel", "loss_owned_parameters", "param_counts", "LossParameterSync",
           "optimizer_parameter_names", "shard_problems", "tensor_bytes", "mixed_precision", "save_strategy", "torch_optimizer"]
