"""What a strategy is: one class, one object, registered once (``stnb.strategies.registry``).

A strategy answers every question the rest of stnb has about it, so nothing outside
``stnb/strategies/`` compares a strategy's name:

- facts: ``name``, ``label``, ``summary``, ``color``, ``aka`` (the ZeRO stage it is), ``distributed``
  (one process per device), ``min_gpus``, ``min_ranks`` and ``options`` (its own options: name -> ``Option``, with
  default, type, help and the values it takes; TrainConfig takes them as flat keywords);
- memory: ``sharded`` says which parts of the model state a rank holds only 1/N of (``held``);
- availability on this hardware, with the reason (``available``);
- config validation before any process starts (``validate``);
- in each rank: refusals of what the user's trainer asks (``refusals``), preparing the trainer and the
  model (``prepare``), and, at the first step, checking the prepared model (``check_prepared``);
- after the run, what needs every rank (``check_ranks``);
- the predictor's cost of one optimizer step on n devices (``step_time``, None: no model), and the rows
  it brings to the lab: the bench presets' sweep (``bench``) and the GPU check (``gpu_check``).

The registry finds every strategy class a module of ``stnb/strategies/`` defines (with its own ``name``),
in ``order``, so adding a strategy is adding its module.

Verification fails closed: ``check_prepared`` and ``check_ranks`` are abstract, so a class that does
not implement both cannot be instantiated, and the registry refuses it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

from .layouts import SCHEDULER, load_scheduler, save_scheduler, torch_optimizer  # noqa: F401 - re-exported

PARTS = ("params", "grads", "optimizer_state")


@dataclasses.dataclass(frozen=True)
class Option:
    """One of a strategy's own options, declared in the strategy's module (``Strategy.options``): a flat
    keyword of ``TrainConfig`` / ``stnb.run`` (``TrainConfig(bucket_cap_mb=100)``) that only the strategies
    declaring it take; set away from its default under another strategy it is refused, naming its owners. The
    config, the CLI (``--bucket-cap-mb``, with ``help``), the Panel's widgets and the results read it from here.

    type: its annotation, as a TrainConfig field's ('float | None'; the CLI's and the widgets' type);
    choices: the values it takes where it has a fixed set (the Panel's drop-down; anything else refused);
    positive: a number, when given, must be > 0;
    unset: how a value of None reads in the comparison's hover (what the library then uses);
    label: how runs that differ in it are told apart in the comparison's labels ('hook {}'; '': not used);
    lever: what setting it does to the step's communication (the time split's advice; '': nothing);
    wire: what a value changes about what the collectives move, for the predictor (``stnb.scaling``): a function
    of the value returning fields of ``stnb.scaling.Measured`` ('bucket_bytes', 'gathers_again') or the bytes
    of one gradient element on the wire ('grad_element_bytes', with 'grad_how': a few words saying why), or
    None."""

    default: Any
    type: str
    help: str
    choices: tuple = ()
    positive: bool = False
    unset: str = "default"
    label: str = ""
    lever: str = ""
    wire: Any = None

    def check(self, name: str, value) -> None:
        """Raise ConfigError for a value its declared rules refuse (``choices``, ``positive``)."""
        from ..errors import check_positive, unknown_choice

        if self.choices and value not in self.choices:
            raise unknown_choice(name, value, self.choices)
        if self.positive and value is not None:
            check_positive(name, value)


class Strategy(abc.ABC):
    name: ClassVar[str]
    label: ClassVar[str]
    summary: ClassVar[str]
    color: ClassVar[str] = "#8c564b"
    aka: ClassVar[str] = ""            # e.g. "ZeRO stage 3"
    distributed: ClassVar[bool] = True  # one process per device in a process group
    min_gpus: ClassVar[int] = 0        # GPUs needed at all (dp: 2, in one process)
    min_ranks: ClassVar[int] = 1       # a sharding strategy needs 2 ranks to shard over
    options: ClassVar[dict] = {}       # its own options: name -> Option (TrainConfig's flat keywords)
    #: sets of its options worth measuring against its defaults (the lab's benches): name -> options; and those
    #: measured under gradient accumulation too
    tunings: ClassVar[dict] = {}
    tunings_accumulating: ClassVar[dict] = {}
    sharded: ClassVar[frozenset] = frozenset()  # parts of PARTS each rank holds 1/N of
    # parameters whole in memory during forward and backward, beyond the rank's own shard:
    # 'all' (zero2: gathered for the whole step), 'layer' (fsdp: one block at a time), '' (none)
    gathered_during_step: ClassVar[str] = ""
    ddp_buckets: ClassVar[bool] = False  # a DDP wrapper copies every gradient into its buckets
    env: ClassVar[dict] = {}           # environment the ranks need (set before they import anything)
    owns_deepspeed: ClassVar[bool] = False  # the trainer's own deepspeed=... argument belongs to it
    master_weights: ClassVar[bool] = False  # the optimizer keeps its own fp32 copy of the (partitioned) weights
    #: how its checkpoints hold the training state (``stnb.checkpoints``): 'trainer' (the trainer's own files:
    #: whole model, optimizer, scheduler, each rank's RNG) or another format a strategy writes itself (``saving``)
    checkpoint_format: ClassVar[str] = "trainer"
    #: its own loading reads its format on another number of ranks (DCP's resharding, DeepSpeed's universal
    #: checkpoint); otherwise a checkpoint of another layout is loaded through the whole state by name
    #: (``stnb.strategies.layouts``), and checked there against it
    reshards: ClassVar[bool] = False
    #: ... and checks what it loaded itself (DeepSpeed: its engine's partitions, which layouts cannot read)
    checks_own_resharding: ClassVar[bool] = False

    baseline: ClassVar[bool] = False   # the one every other strategy is compared with (single)
    order: ClassVar[int] = 1000        # place in the registry's order (the Panel's list, tables); built-ins 10..70

    # ---- the predictor and the lab's rows ---------------------------------------------------
    #: the predicted step on n devices, a method ``step_time(m, fab, n, host_fraction=None) -> dict``
    #: (``stnb.strategies.stepcost``: m a ``stnb.scaling.Measured``, fab a ``stnb.scaling.Fabric``);
    #: None: the predictor has no model for this strategy and refuses it
    step_time = None
    #: the term the published-reference check (``stnblab.scaling.seed.would_match``) solves for to explain a
    #: miss: 'bw' (the link's bandwidth) or 'host_fraction' (dp's single-process host share)
    miss_term: ClassVar[str] = "bw"
    bench: ClassVar[bool] = False      # a row of the bench presets' strategy sweep (``stnblab.bench``)
    gpu_check: ClassVar[bool] = False  # trained by the GPU check (``python -m stnb gpu-check``), its own rows

    # ---- facts ------------------------------------------------------------------------------
    def pinned_to_one_gpu(self) -> bool:
        """One process driving one device (on a GPU machine it is pinned to the first usable GPU)."""
        return not self.distributed and self.devices(2) == 1

    def several_devices_per_process(self) -> bool:
        """One process drives several devices (dp): its devices follow from the batch it splits."""
        return self.devices(2) > 1

    def title(self) -> str:
        """Name and what it is, e.g. "fsdp (ZeRO stage 3): FSDP2 fully_shard ..." (Panel, CLI, docs)."""
        return f"{self.name}{f' ({self.aka})' if self.aka else ''}: {self.summary}"

    def held(self, world_size: int, options: dict | None = None) -> dict:
        """Fraction of each model-state part one rank holds at rest (the memory prediction's shape).
        ``options``: its own options as a run sets them (``own``; a missing one is at its default)."""
        return {part: (1.0 / world_size if part in self.sharded else 1.0) for part in PARTS}

    def bucket_copy(self, options: dict | None = None) -> bool:
        """A DDP wrapper copies every gradient into its buckets, with its own options ``options``."""
        return self.ddp_buckets

    def own(self, values: dict) -> dict:
        """Its own options among ``values`` (a flat dict: a result's config, keyword arguments)."""
        return {name: values[name] for name in self.options if name in values}

    def shards_params(self, config) -> bool:
        """Each rank holds only a piece of the parameters (the trained model must be gathered)."""
        return "params" in self.sharded

    def world_size(self, requested: int | None, default: int) -> int:
        """Processes this strategy runs (one-process strategies: 1)."""
        if not self.distributed:
            return 1
        return requested if requested is not None else default

    def devices(self, n_gpu: int) -> int:
        """Devices one process drives (dp: every visible GPU; the others: one)."""
        return 1

    def available(self, device: str, n_gpu: int, max_ranks: int, backend: str) -> tuple[bool, str]:
        """(runnable here, why): the default for a distributed strategy needs min_ranks ranks."""
        unit = "GPU" if device == "cuda" else "CPU core"
        if not self.distributed:
            return True, f"one process on {device}"
        need = max(2, self.min_ranks)
        if max_ranks >= need:
            per = f"sharing {n_gpu} GPU(s)" if device == "cuda" and max_ranks > n_gpu else f"one per {unit}"
            return True, f"up to {max_ranks} ranks, {per}, backend {backend}"
        return False, f"needs at least {need} ranks (one per {unit}); this machine has {max_ranks} {unit}(s)"

    def given(self, config) -> dict:
        """Its options ``config`` sets away from their defaults: what the run asked of it."""
        return {name: getattr(config, name) for name, o in self.options.items() if getattr(config, name) != o.default}

    def levers(self, config: dict) -> list:
        """What its options would change about the step's communication (``Option.lever``), for a run whose
        config is ``config`` (a result's config dict): the time split's advice."""
        return [o.lever for o in self.options.values() if o.lever]

    # ---- before any process starts --------------------------------------------------------
    def validate(self, config) -> None:
        """Raise ConfigError for a config this strategy cannot run (beyond the registry's generic checks)."""

    def check_device(self, config, device: str) -> None:
        """Raise ConfigError for what its options ask that ranks on ``device`` ('cpu', 'cuda') cannot do."""

    def world_refusal(self, device: str, world: int) -> str:
        """Before any process starts: why this strategy cannot run ``world`` processes on ``device`` ('' when it
        can). A strategy whose gradients go through a DDP wrapper needs one to verify: accelerate wraps one
        process on CPU (gloo) but not one CUDA process (``Accelerator.multi_device`` needs 2)."""
        if self.ddp_buckets and device == "cuda" and world == 1:
            return (f"strategy {self.name!r} with one process on a GPU: accelerate does not wrap a single CUDA process "
                    f"in DistributedDataParallel, so there would be no {self.label} to verify; use strategy='single' "
                    "for one GPU, or num_processes >= 2 (one GPU each)")
        return ""

    def check_recipe(self, config) -> None:
        """ConfigError for what stnb's recipe (not a user's trainer) cannot run with this strategy."""

    def build_refusal(self, objects: dict) -> str:
        """Before any process starts: why this strategy cannot train what a user's build function reads
        (``objects``: ``buildsource.read_objects``), with the fix; '' when nothing is seen. The ranks
        check the trainer itself again (``refusals``)."""
        return ""

    def rank_env(self, config, device: str) -> dict:
        """Environment every rank needs, set before it imports anything (the runner merges it in); asked
        once per launch in the notebook process (once per rank under SLURM, Ray and torchrun), after
        validation, so it may prepare what the ranks load (DeepSpeed's CPU op)."""
        return dict(self.env)

    def trainer_arguments(self, config, device: str) -> dict:
        """Training arguments stnb's recipe passes at construction for this strategy (deepspeed=...)."""
        return {}

    # ---- in each rank ----------------------------------------------------------------------
    def refusals(self, trainer, config) -> list:
        """What the trainer's own arguments ask that this strategy cannot honour (problem strings)."""
        return []

    def prepare(self, trainer, config, device_type: str, world: int) -> dict:
        """Apply the strategy to the trainer before ``train()``. Returns {"info": ..., "overridden": ...}."""
        return {"info": {}, "overridden": {}}

    def ddp_hook(self, config) -> tuple:
        """(name, torch's DDP communication hook) the run asks for, registered by the time split, timed, on a DDP
        wrapper: ('none', None) unless the strategy's options choose one (ddp's ``comm_hook``); a hook of None is
        one that registers itself (stnb's embedding-rows hook)."""
        return "none", None

    def saving(self, trainer) -> None:
        """Make the trainer write and read this strategy's state in its checkpoints (``checkpoint_format``),
        in every rank, before training: the default leaves the trainer's own saving and loading as they are and
        writes the names of the optimizer's parameters beside ``optimizer.pt`` (``layouts.NAMES``, what another
        layout reads it by). Every strategy's checkpoints hold the loss's own parameters (``loss_sync``: the
        model's files do not) beside the optimizer's state. A strategy that writes its own format calls this
        last: every strategy loads a checkpoint of another layout that ``loads`` accepts (``layouts.install``)."""
        import os

        from .layouts import NAMES, install, optimizer_names, write_names
        from .loss_sync import load_loss_parameters, save_loss_parameters

        save, load = trainer._save_optimizer_and_scheduler, trainer._load_optimizer_and_scheduler

        def save_state(output_dir):
            save(output_dir)
            save_loss_parameters(trainer, output_dir)
            if self.checkpoint_format == "trainer" and trainer.args.should_save:
                groups = optimizer_names(trainer, torch_optimizer(trainer))
                if groups is not None:
                    write_names(os.path.join(output_dir, NAMES), groups)

        def load_state(checkpoint):
            load(checkpoint)
            if checkpoint is not None:
                load_loss_parameters(trainer, checkpoint)

        trainer._save_optimizer_and_scheduler, trainer._load_optimizer_and_scheduler = save_state, load_state
        install(trainer, self)

    # ---- resuming on another layout (``stnb.strategies.layouts``) -------------------------------
    def checkpoint_layout(self, config) -> dict:
        """What its checkpoints record of the run's own options that a run resuming them must share (beside the
        manifest's strategy, format and ranks; DeepSpeed: the ZeRO stage); {} by default."""
        return {}

    def loads(self, path: str, written: dict, world: int, writer, config=None) -> str:
        """Why this strategy on ``world`` ranks cannot resume the checkpoint at ``path`` (``written``: its
        manifest; ``writer``: the strategy whose format it is, ``strategies.owner``; ``config``: the resuming
        run's, None where not known), with the fix; '' when it can: its own format on its own number of ranks, or
        any checkpoint whose writer can be read whole by parameter name (``unreadable``) on any number of ranks.
        Asked before any process starts (``stnb.checkpoints.check_serves``)."""
        fmt = written.get("format", "trainer")
        if fmt == self.checkpoint_format and written.get("world_size") == world:
            return ""
        if writer is None:
            return f"no strategy here reads its format {fmt!r}"
        return writer.unreadable(path, written)

    def unreadable(self, path: str, written: dict) -> str:
        """Why a checkpoint this strategy wrote (at ``path``) cannot be read whole by parameter name on another
        layout ('' when it can): the trainer's format needs the names of its optimizer's parameters."""
        import os

        from .layouts import NAMES

        if os.path.isfile(os.path.join(path, NAMES)):
            return ""
        return (f"its optimizer state is numbered, without the names of its parameters ({NAMES}: written by stnb "
                "since resuming on another layout exists, and only when the model owns every parameter the optimizer "
                f"updates, not a loss's own); resume it with strategy={written.get('strategy')!r} and "
                f"num_processes={written.get('world_size')}")

    def read_model(self, checkpoint: str, like) -> dict:
        """The model a checkpoint this strategy wrote holds, whole, by parameter name (``like``: a model of its
        kind); on another layout, in every rank."""
        from .layouts import read_saved_model

        return read_saved_model(checkpoint, like)

    def read_optimizer(self, checkpoint: str) -> dict:
        """The optimizer state a checkpoint this strategy wrote holds, whole, by parameter name (the full optimizer
        state dict of ``torch.distributed.checkpoint.state_dict``)."""
        import os

        import torch

        from .layouts import NAMES, by_name, read_names

        saved = torch.load(os.path.join(checkpoint, "optimizer.pt"), map_location="cpu", weights_only=True)
        return by_name(saved, read_names(os.path.join(checkpoint, NAMES)))

    def local_optimizer(self, trainer):
        """The torch optimizer holding this rank's optimizer state (ZeroRedundancyOptimizer: its partition's)."""
        return torch_optimizer(trainer)

    def on_first_step(self, trainer, config, world: int, timed=None) -> dict:
        """Called at the first step's begin, before verification (e.g. a DDP comm hook; ``timed`` wraps a
        comm hook so that stnb.timesplit times it). Returns ``{name: observer}``: after training, each
        observer's ``stats()`` goes into the rank's verification record under its name."""
        return {}

    @abc.abstractmethod
    def check_prepared(self, trainer, world_size: int) -> tuple[dict, list]:
        """At the first step, in every rank: (details, problems) comparing what the strategy promises
        with the prepared model, observed (wrapper type, shards, optimizer partition...)."""

    def check_step(self, trainer, world_size: int) -> tuple[dict, list]:
        """After the first backward, before the optimizer step (gradients exist): (details, problems)."""
        return {}, []

    def held_bytes(self, trainer) -> dict:
        """Bytes per part a rank holds that its model's and optimizer's tensors do not show
        (``memory.measure`` adds them): e.g. DeepSpeed's partitions and fp32 master copy."""
        return {}

    @abc.abstractmethod
    def check_ranks(self, rank_results: list, world_size: int) -> tuple[dict, list]:
        """After the run, with every rank's ``rankreport.RankReport``: (details, problems) of what needs
        all ranks (each rank's own verification record is ``report.verification``)."""

    def after_training(self, trainer) -> None:
        """The trained model back in the state the strategy keeps between steps, before it is checked and
        gathered (called in every rank right after ``trainer.train()``)."""

    def full_model(self, model, rank: int):
        """The trained model whole, on rank 0 (None on the others; a collective where sharded).
        Returns (module_or_state_dict, is_state_dict)."""
        return (model if rank == 0 else None), False


def replicated_check(rank_results: list) -> tuple[dict, list]:
    """Every replicated tensor identical across ranks (sha256 per tensor; a mismatch names it)."""
    from ..checks import compare_digests

    if len(rank_results) < 2:
        return {}, []
    same = compare_digests([r.weight_digests or {} for r in rank_results])
    if not same["tensors"]:
        return {"weights_tensors_compared": 0}, []  # nothing replicated (every parameter sharded)
    info = {"weights_identical_across_ranks": same["identical"], "weights_checksums": same["model_digests"],
            "weights_differing": same["differing"][:10], "weights_tensors_compared": same["tensors"]}
    problems = []
    if not same["identical"]:
        problems.append(f"weights differ across ranks in {len(same['differing'])} of {same['tensors']} "
                        f"tensor(s), first {same['first_differing']!r} (ranks {same['differing'][0]['ranks']})")
    return info, problems


def mixed_precision(args) -> str:
    """'bf16', 'fp16' or 'no', as a trainer's training arguments ask."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "no"


def save_strategy(args) -> str:
    """'no', 'steps', 'epoch' or 'best', as a trainer's training arguments ask (transformers' enum, or a plain string
    set after construction)."""
    return str(getattr(args.save_strategy, "value", args.save_strategy))








def rebuild_optimizer(trainer, rebuild) -> None:
    """After the trainer builds its optimizer, ``rebuild(built, defaults)`` may return another one (``built``
    to keep it); ``defaults`` are the built optimizer's defaults its class's constructor takes (torch's
    AdamW records one, ``decoupled_weight_decay``, that its constructor refuses). The trainer keeps the
    returned one."""
    import inspect

    original = trainer.create_optimizer

    def create_optimizer(model=None):
        built = original(model) if model is not None else original()
        accepted = inspect.signature(type(built).__init__).parameters
        trainer.optimizer = rebuild(built, {k: v for k, v in built.defaults.items() if k in accepted})
        return trainer.optimizer

    trainer.create_optimizer = create_optimizer
