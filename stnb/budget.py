"""A memory budget per rank (``memory_budget_gib``): no rank can use more, and a rank that needs more fails as out
of memory, named, with what would fit.

What the budget covers:

- **CPU**: the whole rank process, the runtime included (Python, torch, every library, the process group): its
  private writable memory, what the kernel counts as ``VmData`` (the heap, anonymous mappings, thread stacks) and
  ``RLIMIT_DATA`` limits (Linux >= 4.7). The rank sets it as its own soft limit (no root needed) before it builds
  its trainer; an allocation past it fails (torch's CPU allocator, Python's ``MemoryError``). A forked rank
  begins with what it inherited from the launching process, counted like the rest. ``RLIMIT_AS`` is not used: it
  counts address space torch and its thread pools reserve and never touch (docs/memory.md measures both).
- **GPU**: what torch's caching allocator may take of the rank's device
  (``torch.cuda.set_per_process_memory_fraction``: the budget over the device's total); the CUDA context and
  NCCL's buffers are outside it.

``refusal`` (before launch for stnb's recipe, from the model folder's tensor headers; in the rank for a user's
build function, once its model is built): a budget below the model state the prediction says one rank holds
(``stnb.memory.predict``), with the strategies that would fit it. ``Budget`` in the rank (``instruments.MemoryBudget``): ``enforced()`` applies
the limit while the rank trains and takes it back after; an allocation past it is raised as ``OutOfMemory`` naming
the rank, the budget, the prediction, what the rank held and its measured peak, and what would fit.
"""

from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager

from . import memory, strategies
from .errors import OUT_OF_MEMORY, ConfigError, OutOfMemory

GIB, MIB = 2**30, 2**20
#: the most ranks ``refusal`` looks at for a strategy that would fit the budget
MAX_RANKS = 1024
#: what an out-of-memory failure says when it is not one of the errors ``errors.OUT_OF_MEMORY`` names: torch's CPU
#: allocator, a C++ allocation, a thread whose stack could not be mapped, ENOMEM
OOM_MESSAGES = ("can't allocate memory", "out of memory", "bad_alloc", "Cannot allocate memory",
                "can't start new thread")
#: an error raised while the rank holds this close to its budget is taken for running out of it: a C extension that
#: could not allocate may raise anything (a SystemError "error return without exception set" was seen)
NEAR = 64 * MIB
#: RLIMIT_DATA counts every private writable mapping, so it applies to torch's CPU allocator (Linux >= 4.7)
HOW = {"cpu": "the whole rank process: its private writable memory (VmData), limited by RLIMIT_DATA",
       "cuda": "torch's caching allocator on the rank's GPU (torch.cuda.set_per_process_memory_fraction)"}


def _mib(n) -> str:
    return f"{n / MIB:,.1f} MiB"


def limit_bytes(gib: float) -> int:
    return int(gib * GIB)


def shape_from_files(path: str) -> dict | None:
    """The prediction's inputs (``memory.model_shape``'s keys) read from a model folder's safetensors headers,
    without loading the model: every stored tensor counted as a trainable fp32 parameter, as stnb's recipe trains
    them (stnb freezes BERT's unused pooler, so this is at most a few tenths of a percent above the trained
    model's). None for a folder without safetensors files (.bin weights), a file or a hub id (no folder: nothing
    found under it)."""
    import glob
    import json
    import struct

    files = glob.glob(os.path.join(path, "**", "*.safetensors"), recursive=True)
    if not files:
        return None
    count = 0
    for name in files:
        with open(name, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        count += sum(math.prod(t["shape"]) for key, t in header.items() if key != "__metadata__")
    return {"param_count": count, "trainable_param_count": count, "bytes_per_param": 4, "optimizer": "adamw"}


def predicted(config, shape: dict, strategy: str, world: int) -> dict:
    """``memory.predict`` of ``strategy`` for ``shape`` on ``world`` ranks (1 for a one-process strategy), with the
    options the config sets where it is the config's strategy."""
    s = strategies.get(strategy)
    own = s.given(config) if strategy == config.strategy else {}
    return memory.predict(strategy, shape["param_count"], world if s.distributed else 1,
                          shape["trainable_param_count"], bytes_per_param=shape["bytes_per_param"],
                          optimizer=shape["optimizer"], **own)


def _others(config, world: int, device: str) -> list:
    """(strategy, ranks) of every other strategy that shards part of the model state and can run here, on
    ``world`` ranks (2 when the run has one)."""
    from .hardware import strategy_availability

    runnable = strategy_availability(device)
    out = []
    for name in strategies.names():
        s = strategies.get(name)
        if name != config.strategy and s.sharded and runnable[name]["runnable"]:
            out.append((name, max(world, 2, s.min_ranks)))
    return out


def refusal(config, shape: dict | None, world: int, device: str) -> str | None:
    """Why the budget cannot hold the model state one rank of this run holds (None: it can, or no budget, or
    nothing to predict from), and which strategies would fit it."""
    if config.memory_budget_gib is None or not shape:
        return None
    limit = limit_bytes(config.memory_budget_gib)
    own = predicted(config, shape, config.strategy, world)
    if own["total"] <= limit:
        return None
    parts = ", ".join(f"{k} {_mib(v)}" for k, v in own.items() if k != "total" and v)
    fit = [(name, n, t) for name, n in _others(config, world, device)
           if (t := predicted(config, shape, name, n)["total"]) <= limit]
    if fit:
        fix = "It fits under " + ", ".join(f"strategy={name!r} ({_mib(t)} per rank on {n})" for name, n, t in fit)
    else:
        # this strategy on more ranks first (its own options: deepspeed's stage shards), then the others; one that
        # shards nothing (ddp) never fits on more ranks and is not named
        more = [(name, n) for name in [config.strategy] + [name for name, _ in _others(config, world, device)]
                if (n := _ranks_that_fit(config, shape, name, world, limit))]
        fix = (f"No strategy fits it on {world} rank(s); with more ranks, " + ", ".join(
            f"strategy={name!r} from num_processes={n}" for name, n in more) if more
            else f"No strategy fits it on up to {MAX_RANKS} ranks")
    return (f"memory_budget_gib={config.memory_budget_gib:g} ({_mib(limit)} per rank) is below the model state one "
            f"rank holds under strategy {config.strategy!r} on {world} rank(s): stnb.memory.predict says "
            f"{_mib(own['total'])} ({parts}), and activations and the runtime (Python, torch) come on top. {fix}; "
            f"or raise memory_budget_gib.")


def _ranks_that_fit(config, shape, strategy, world, limit) -> int | None:
    for n in range(world + 1, MAX_RANKS + 1):
        if predicted(config, shape, strategy, n)["total"] <= limit:
            return n
    return None


def refuse(config, shape: dict | None, world: int, device: str) -> None:
    """ConfigError when ``refusal`` says why."""
    problem = refusal(config, shape, world, device)
    if problem:
        raise ConfigError(problem)


def out_of_memory(e: BaseException | None) -> bool:
    """Whether ``e`` (or an exception it was raised from) says memory ran out."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError) or type(e).__name__ in OUT_OF_MEMORY:
            return True
        if isinstance(e, (RuntimeError, OSError)) and any(m in str(e) for m in OOM_MESSAGES):
            return True
        e = e.__cause__ or e.__context__
    return False


def _asked(e: BaseException) -> str:
    """The allocation that failed, as torch's message says it ('' when it does not)."""
    m = re.search(r"[Tt]ried to allocate ([\d.]+) ?(bytes|[KMG]iB)", str(e))
    if not m:
        return ""
    n = float(m.group(1)) * {"bytes": 1, "KiB": 2**10, "MiB": MIB, "GiB": GIB}[m.group(2)]
    return f"an allocation of {_mib(n)} failed"


class Budget:
    """The budget in one rank (``train_rank``): applied while the rank trains, an allocation past it raised as
    ``OutOfMemory``. ``memory`` is the rank's ``instruments.MemoryUse``: the model's shape once built, its peak."""

    def __init__(self, config, here, memory_use, recipe: bool):
        self.config, self.here, self.memory, self.recipe = config, here, memory_use, recipe
        self.bytes = None if config.memory_budget_gib is None else limit_bytes(config.memory_budget_gib)
        self.record: dict = {}

    @contextmanager
    def enforced(self):
        """The limit applied for the block (none without a budget), taken back after; out of memory inside it
        raises ``OutOfMemory``."""
        if self.bytes is None:
            yield
            return
        held = self._held()  # read before the limit: past it, even reading /proc raises MemoryError (seen in CI)
        if held >= self.bytes - NEAR:  # the rank's runtime alone holds the budget: under it every allocation fails,
            # Python's own too (a rank died unreported there, SIGSEGV formatting its traceback); said now, unapplied
            self.record = {"limit_bytes": self.bytes, "how": HOW[self.here.device_type], "held_at_start": held}
            raise OutOfMemory(self.explain(MemoryError("the rank's runtime already holds the budget")))
        undo = self._apply(held)
        try:
            yield
        except BaseException as e:
            undo()  # before anything else allocates: the checks and the report need memory of their own (under
            undo = None  # the limit, out_of_memory's own set failed to allocate and the rank then died unreported)
            if isinstance(e, ConfigError) or not (out_of_memory(e) or self._held() >= self.bytes - NEAR):
                raise  # (near the budget, any allocation fails; a refusal, check_model's, stays one)
            raise OutOfMemory(self.explain(e)) from e
        finally:
            if undo is not None:
                undo()

    def _apply(self, held: int):
        """Apply the limit; returns what takes it back."""
        if self.here.cuda:
            return self._apply_cuda(held)
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = self.bytes if hard == resource.RLIM_INFINITY else min(self.bytes, hard)
        self.record = {"limit_bytes": limit, "how": HOW["cpu"], "held_at_start": held}
        # everything the way back needs is made before the limit: past it (a budget below what the rank already
        # holds) even the undo's closure failed to allocate, before enforced() could catch anything, and the rank
        # ended with no error record (seen in CI once the rank's objects before it had grown)
        undo, limits = (lambda: resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))), (limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, limits)
        return undo

    def _apply_cuda(self, held: int):
        import torch

        devices = [torch.cuda.current_device()] if self.here.distributed else list(range(self.here.n_gpu))
        for d in devices:
            total = torch.cuda.get_device_properties(d).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.bytes / total), d)
        self.record = {"limit_bytes": self.bytes, "how": HOW["cuda"], "held_at_start": held}
        return lambda: [torch.cuda.set_per_process_memory_fraction(1.0, d) for d in devices]

    def _held(self) -> int:
        """What the budget counts now: CPU, the process's VmData; GPU, what torch's allocator reserved."""
        if self.here.cuda:
            import torch

            return int(torch.cuda.memory_reserved())
        return memory.proc_status("VmData") or 0

    def report(self) -> dict:
        """The verification record's entry: the limit, how it is enforced, what the rank held when it was applied
        and now (after training); {} without a budget."""
        return {**self.record, "held_at_end": self._held()} if self.record else {}

    def check_model(self) -> None:
        """Once the model is built (a user's build function: the first moment its size is known), ConfigError when
        the budget is below its predicted model state."""
        refuse(self.config, self.memory.model_shape, self.here.world, self.here.device_type)

    def explain(self, e: BaseException) -> str:
        """What the rank says when it ran out: the rank, the budget, the prediction, what it held and its measured
        peak, what would fit."""
        config, here, shape = self.config, self.here, self.memory.model_shape
        asked = _asked(e)
        failed = (f"{asked} while it held {_mib(self._held())}" if asked else f"it held {_mib(self._held())}") + (
            f" ({_mib(self.record['held_at_start'])} already when the budget was applied, before its model was built: "
            "the runtime)")
        peak = self.memory.peak
        resident = peak.peak() if peak.cuda else peak.peak() + peak.base  # CPU: growth over the rank's start, whole
        if shape:
            own = predicted(config, shape, config.strategy, here.world)["total"]
            prediction = (f"the prediction (stnb.memory.predict) for strategy {config.strategy!r} on {here.world} "
                          f"rank(s) is {_mib(own)} of model state per rank, activations and the runtime on top")
        else:
            own, prediction = None, "it ran out before its model was built, so there is no prediction"
        return (f"rank {here.rank} ran out of its memory budget, memory_budget_gib={config.memory_budget_gib:g} "
                f"({_mib(self.bytes)}, {HOW[here.device_type]}): {failed}; {prediction}; its measured peak was "
                f"{_mib(resident)} ({peak.method.split(' growth')[0]}). What would fit: "
                + "; ".join(self._fixes(shape, own)) + ".")

    def _fixes(self, shape, own) -> list:
        trainer = self.memory.trainer
        batch = trainer.args.per_device_train_batch_size if trainer is not None else (
            self.config.per_device_batch_size if self.recipe else None)
        out = []
        if batch and batch > 1:
            smaller = (f"per_device_batch_size={batch // 2}" if self.recipe
                       else f"override_args={{'per_device_train_batch_size': {batch // 2}}}")
            out.append(f"a smaller per-device batch, {smaller} (activations grow with the batch)")
        if shape:
            less = sorted((t, name, n) for name, n in _others(self.config, self.here.world, self.here.device_type)
                          if (t := predicted(self.config, shape, name, n)["total"]) < own)
            if less:
                out.append("a strategy that holds less model state per rank: " + ", ".join(
                    f"strategy={name!r} ({_mib(t)} on {n} rank(s))" for t, name, n in less))
        out.append("a larger memory_budget_gib")
        return out
