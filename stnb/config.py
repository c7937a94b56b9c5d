"""TrainConfig: everything one training run needs, validated before any process starts."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

from . import configcheck, strategies
from .configcheck import check_int
from .errors import ConfigError

# A TrainConfig is two parts, each a type of its own (below): the ``Recipe`` (what stnb's recipe trains: model, data,
# loss, steps, batch...; for a user's trainer it lives in the user's code, and each of its fields says where) and
# the ``RunOptions`` (what every run takes, stnb's recipe or ``stnb.run(build, ...)``: where and how the ranks run,
# and the strategy's own options). TrainConfig keeps one flat constructor and takes each field's declaration from
# its part; ``config.recipe`` and ``config.run_options`` are its two parts as values. The strategies' own options
# (``bucket_cap_mb``, ``stage``...) are declared by the strategies (``stnb.strategies.options()``), not here:
# both classes take them as flat keywords and attributes, held in ``strategy_options`` (``takes_strategy_options``).

# Training arguments of a user's trainer that ``override_args`` may replace in every rank (read when
# train() starts, so setting them on the built trainer takes effect), and what each changes.
OVERRIDABLE_ARGS = {
    "per_device_train_batch_size": "the per-device batch (the train dataloader and the global batch follow it)",
}
_ARGS = "your SentenceTransformerTrainingArguments"
_KIND = "stnb_kind"


def run_option(default=dataclasses.MISSING, **kw):
    """A field of ``RunOptions``: every run takes it (stnb's recipe and ``stnb.run(build, ...)``)."""
    return field(default=default, metadata={_KIND: "run"}, **kw)


def recipe_field(where: str, default=dataclasses.MISSING, **kw):
    """A field of ``Recipe``; ``where``: where it belongs in a user's own code."""
    return field(default=default, metadata={_KIND: "recipe", "where": where}, **kw)


def takes_strategy_options(cls):
    """Class decorator (under ``@dataclass``): the strategies' own options (``stnb.strategies.options()``) as flat
    keywords of the constructor and as attributes, held in the field ``strategy_options``: only those given away
    from their defaults, so two configs that ask the same compare equal. A name neither a field nor an option is a
    TypeError naming the closest, as a dataclass's own constructor does."""
    fields_init, own = cls.__init__, cls.__dataclass_fields__

    def __init__(self, *args, **kw):
        declared = strategies.options()
        given = dict(kw.pop("strategy_options", None) or {})
        given.update({name: kw.pop(name) for name in [k for k in kw if k not in own]})
        unknown = sorted(set(given) - set(declared))
        if unknown:
            raise TypeError(f"{cls.__name__} got unknown option(s) {unknown}{_did_you_mean(unknown, [*own, *declared])}"
                            f"; strategy options: {', '.join(declared)} (stnb.strategies.options())")
        kept = {k: v for k, v in given.items() if not _is_default(v, declared[k].default)}
        fields_init(self, *args, strategy_options=kept, **kw)

    def __getattr__(self, name):  # only for names that are not attributes: a strategy's option
        given = self.__dict__.get("strategy_options")
        if given is None or name.startswith("__"):
            raise AttributeError(name)
        if name in given:
            return given[name]
        o = strategies.options().get(name)
        if o is None:
            raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}")
        return o.default

    sig = inspect.signature(fields_init)  # what Jupyter's tooltip shows: the fields, then every option by name
    __init__.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *(
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.type)
        for name, o in strategies.options().items())])
    cls.__init__, cls.__getattr__ = __init__, __getattr__
    if not cls.__dataclass_params__.frozen:
        def __setattr__(self, name, value):
            o = None if name in own else strategies.options().get(name)
            if o is not None:
                given = dict(self.strategy_options)
                given.pop(name, None)
                if not _is_default(value, o.default):
                    given[name] = value
                name, value = "strategy_options", given
            object.__setattr__(self, name, value)

        cls.__setattr__ = __setattr__
    return cls


def _is_default(value, default) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def _did_you_mean(unknown, known) -> str:
    """' (did you mean 'x' -> 'y'?)' for the names in ``unknown`` that are close to one in ``known``; '' if none."""
    import difflib

    hints = [f"{u!r} -> {m[0]!r}" for u in unknown for m in [difflib.get_close_matches(u, known, n=1)] if m]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _keywords(cls) -> set:
    """What ``cls`` (TrainConfig) takes by name: its fields and every registered strategy's options."""
    return {f.name for f in dataclasses.fields(cls)} | set(strategies.options())


@dataclass(frozen=True)
class Recipe:
    """What stnb's recipe trains (``stnb.recipe``): the model, the data, the loss, the training arguments. A user's
    own trainer (``stnb.run(build, ...)``) has all of it in the user's code: each field says where (``where``)."""

    model: str = recipe_field("build your SentenceTransformer in the function", "minilm")
    data: str = recipe_field("pass train_dataset=... (and eval_dataset=...) to your trainer", "synthetic")
    columns: dict | None = recipe_field(
        "give your datasets the columns your loss reads (dataset.rename_column / select_columns)", None)
    loss: str = recipe_field("pass loss=... to your trainer", "cosine")
    gather_across_devices: bool = recipe_field(
        "pass it to your loss: MultipleNegativesRankingLoss(model, gather_across_devices=True)", False)
    per_device_batch_size: int = recipe_field(f"per_device_train_batch_size in {_ARGS}", 16)
    steps: int = recipe_field(f"max_steps in {_ARGS}", 20)
    learning_rate: float = recipe_field(f"learning_rate in {_ARGS}", 2e-5)
    max_seq_length: int | None = recipe_field("set model.max_seq_length in your function", 64)
    seed: int = recipe_field(f"seed in {_ARGS}", 42)
    train_size: int = recipe_field("select the rows in your function (dataset.select(range(n)))", 2000)
    dev_size: int = recipe_field("select the rows in your function (dataset.select(range(n)))", 200)
    warmup_steps_excluded: int = recipe_field("stnb leaves the first 2 steps out of the throughput of your trainer", 2)
    evaluate: bool = recipe_field("pass evaluator=... to your trainer (or leave it out)", True)
    dev_points: int = recipe_field(
        f"eval_strategy='steps' and eval_steps=... in {_ARGS}, with evaluator=... (stnb reads the dev curve from "
        "the trainer's log_history)", 0)
    mixed_precision: str = recipe_field(f"bf16=True or fp16=True in {_ARGS}", "no")
    gradient_accumulation_steps: int = recipe_field(f"gradient_accumulation_steps in {_ARGS}", 1)
    checkpoint_every: int = recipe_field(f"save_strategy='steps' and save_steps=... in {_ARGS}", 0)
    keep: int | None = recipe_field(f"save_total_limit in {_ARGS}", None)
    checkpoint_dir: str | None = recipe_field(f"output_dir in {_ARGS}", None)
    extra: dict = recipe_field("stnb's recipe only", default_factory=dict)

    @classmethod
    def where(cls, name: str) -> str:
        """Where the field ``name`` belongs in a user's own code."""
        return cls.__dataclass_fields__[name].metadata["where"]

    def check_inputs(self) -> str:
        """The model resolved (the local path the recipe trains from, returned) and the data checked."""
        from .models import resolve_model
        from .data import check_data
        from . import seed_recipe

        path = resolve_model(self.model)
        if self.loss == seed_recipe.NAME:  # two datasets, one loss each
            seed_recipe.check(self.data, self.columns)
        else:
            check_data(self.data, self.loss, self.columns)
        return path


@takes_strategy_options
@dataclass(frozen=True)
class RunOptions:
    """What every run takes, stnb's recipe or a user's own trainer (``stnb.run(build, ...)``): where and how the
    ranks run, the strategy and its knobs, process control, and the arguments stnb replaces in a user's trainer."""

    strategy: str = run_option("ddp")
    num_processes: int | None = run_option(None)
    save_to: str | None = run_option(None)
    device: str = run_option("auto")
    share_gpus: bool = run_option(False)  # several gloo ranks on each GPU (hardware.rank_gpu)
    start_method: str = run_option("auto")
    threads_per_rank: int | None = run_option(None)
    reuse_freed_memory: bool = run_option(True)  # CPU: glibc reuses freed large blocks (stnb.cpualloc)
    memory_budget_gib: float | None = run_option(None)  # the most memory one rank may use (stnb.budget)
    # the strategy's own options given away from their defaults, {name: value}; each also a flat keyword and an
    # attribute (config.bucket_cap_mb), declared by its strategy (stnb.strategies.options())
    strategy_options: dict = run_option(default_factory=dict)
    # process control
    timeout: float | None = run_option(None)
    stall_timeout: float | None = run_option(60.0)
    # continue a stopped run: 'latest', 'auto' (step 0 when there is none) or a checkpoint's path (stnb.checkpoints)
    resume: str | None = run_option(None)
    # a user's trainer (stnb.run(build, ...)): training arguments stnb replaces, reported as overridden
    override_args: dict | None = run_option(None)


def part(of, name: str):
    """TrainConfig's field ``name`` as its part ``of`` (Recipe or RunOptions) declares it: the same default and
    kind, so each default lives in one place."""
    f = of.__dataclass_fields__[name]
    return field(default=f.default, default_factory=f.default_factory, metadata=f.metadata)


@takes_strategy_options
@dataclass
class TrainConfig:
    """One training run.

    strategy: a name from ``stnb.strategies.names()``: 'single' (one device), 'dp' (torch.nn.DataParallel,
        needs >= 2 GPUs), 'ddp' (DistributedDataParallel, one process per device), 'zero1' (DDP with the
        optimizer state sharded), 'zero2' (gradients and optimizer state sharded), 'fsdp' (FSDP2
        fully_shard, ZeRO stage 3: everything sharded) or 'deepspeed' (DeepSpeed ZeRO, ``stage``).
    num_processes: ranks of a distributed strategy (default 2 on CPU, all GPUs on CUDA, at least 2 with
        share_gpus); always 1 for single/dp.
    model: 'minilm' (bundled all-MiniLM-L6-v2), 'tiny' (random BERT for tests), a hub id or a local path.
    data: 'synthetic' (built-in STS-style pairs), a .csv/.jsonl/.json/.parquet path, or a hub dataset name
        (loss='softmax+cosine': 'synthetic', 'hub' or 'nli_file+sts_file', see stnb.seed_recipe).
    loss: 'cosine' (CosineSimilarityLoss), 'mnrl' (MultipleNegativesRankingLoss) or 'softmax+cosine' (the
        sentence-transformers docs' benchmark recipe: NLI pairs with SoftmaxLoss and STS pairs with
        CosineSimilarityLoss in one multi-dataset run; train_size split evenly between them).
    columns: renames the data's columns to the inputs the loss reads, e.g. {'question': 'anchor',
        'answer': 'positive', 'hard': 'negative'}; {'id': None} drops a column explicitly. Every other
        column must be one the loss reads (stnb.columns), else the run is refused before it starts.
    per_device_batch_size: samples per device per step; global = per_device * processes * accumulation.
    evaluate: the dev evaluator (on dev_size held-out rows, never trained on) before and after training
        (RunResult.dev_metric_before / dev_metric_after, on rank 0).
    dev_points: evaluations of the dev evaluator during training besides before and after: the trainer's own
        eval_strategy='steps' with eval_steps = ceil(steps / (dev_points + 1)) (``dev_eval_steps``), so every
        rank takes part (a sharded model evaluates as it trains) and each value lands in the trainer's
        log_history; RunResult.dev_curve is [(0, before), (step, value)..., (steps, after)]. dev_points of
        them where steps divide evenly, else as many as fit before the last step. Default 0: an evaluation
        costs every rank wall time, most runs compare speed, and before/after already says whether the run
        learned; the notebooks that show learning ask for a curve. The evaluations are timed apart
        (RunResult.outside_steps): they are in neither the step times, samples/s nor the training peak.
    start_method: how the processes start: 'fork' (copies of the notebook's process; Linux), 'spawn'
        (fresh interpreters, the default on macOS / Windows: a build function defined in a cell is
        sent by value) or 'auto' ($STNB_START_METHOD, else the platform's). RunResult.start_method
        records the one the ranks observed.
    share_gpus: on GPUs, let more ranks than GPUs run (stnb's own launcher): rank i on GPU i % GPUs, the ranks
        talking over gloo (NCCL refuses two ranks on one device). For learning and testing several ranks on one
        GPU (a workshop's Colab, a laptop): slower than one rank per GPU, and the ranks share its memory. With
        no more ranks than GPUs it changes nothing (NCCL, a GPU each); on CPU it does nothing. Refused by the
        torchrun, SLURM and Ray launchers, which give each rank its own GPU.
    threads_per_rank: torch threads in each process (CPU default: cores / processes).
    reuse_freed_memory: CPU runs: glibc keeps freed large blocks for reuse instead of page-faulting a
        fresh mapping for every embedding gradient (stnb.cpualloc); processes keep their peak memory. Not
        under a CPU memory_budget_gib: a rank there gives freed blocks back at once (what the budget counts).
    memory_budget_gib: the most memory each rank may use, in GiB (None: no limit; ``stnb.budget``,
        docs/memory.md): on CPU the whole rank process's private writable memory (RLIMIT_DATA), on a GPU what
        torch's allocator may take of it (``torch.cuda.set_per_process_memory_fraction``). A rank that needs
        more fails as out of memory (LaunchError kind 'out_of_memory'); a budget below the predicted model
        state is refused before any rank starts. On CPU a rank under a budget gives freed blocks above 1 MiB
        back to the kernel at once (reuse_freed_memory does not apply): the budget counts memory in use.
    gradient_accumulation_steps: micro-batches per optimizer step (DDP: all-reduce once per optimizer step,
        under no_sync).
    strategy_options: the strategy's own options given, {name: value}; each is also a flat keyword
        (``TrainConfig(strategy='ddp', comm_hook='fp16')``) and an attribute. Only the chosen strategy's may be set
        away from their defaults. Declared by the strategies (``stnb.strategies.options()``), listed below.
    checkpoint_every, keep, checkpoint_dir, resume: a checkpoint every N steps into checkpoint_dir (the trainer's
        own, each complete or absent), the newest ``keep`` kept; resume='latest' (or 'auto': step 0
        when there is none) or a checkpoint's path continues from it (``stnb.checkpoints``, docs/checkpoints.md).
    override_args: only with your own build function (``stnb.run(build, override_args=...)``):
        training arguments of your trainer stnb replaces in every rank, ``{name: value}`` or
        ``{name: (value, why)}``; the names in ``OVERRIDABLE_ARGS`` (per_device_train_batch_size).
        Each one that changes a value is listed in RunResult.overridden_args with its reason
        (the Panel's batch widget sets it, "set in the Panel").
    """

    strategy: str = part(RunOptions, "strategy")
    num_processes: int | None = part(RunOptions, "num_processes")
    model: str = part(Recipe, "model")
    data: str = part(Recipe, "data")
    columns: dict | None = part(Recipe, "columns")
    loss: str = part(Recipe, "loss")
    gather_across_devices: bool = part(Recipe, "gather_across_devices")
    per_device_batch_size: int = part(Recipe, "per_device_batch_size")
    steps: int = part(Recipe, "steps")
    learning_rate: float = part(Recipe, "learning_rate")
    max_seq_length: int | None = part(Recipe, "max_seq_length")
    seed: int = part(Recipe, "seed")
    train_size: int = part(Recipe, "train_size")
    dev_size: int = part(Recipe, "dev_size")
    warmup_steps_excluded: int = part(Recipe, "warmup_steps_excluded")
    evaluate: bool = part(Recipe, "evaluate")
    dev_points: int = part(Recipe, "dev_points")
    save_to: str | None = part(RunOptions, "save_to")
    device: str = part(RunOptions, "device")
    share_gpus: bool = part(RunOptions, "share_gpus")
    start_method: str = part(RunOptions, "start_method")
    mixed_precision: str = part(Recipe, "mixed_precision")
    threads_per_rank: int | None = part(RunOptions, "threads_per_rank")
    reuse_freed_memory: bool = part(RunOptions, "reuse_freed_memory")
    memory_budget_gib: float | None = part(RunOptions, "memory_budget_gib")
    gradient_accumulation_steps: int = part(Recipe, "gradient_accumulation_steps")
    strategy_options: dict = part(RunOptions, "strategy_options")
    # process control
    timeout: float | None = part(RunOptions, "timeout")
    stall_timeout: float | None = part(RunOptions, "stall_timeout")
    # checkpoints and resuming (stnb.checkpoints)
    checkpoint_every: int = part(Recipe, "checkpoint_every")
    keep: int | None = part(Recipe, "keep")
    checkpoint_dir: str | None = part(Recipe, "checkpoint_dir")
    resume: str | None = part(RunOptions, "resume")
    # a user's trainer (stnb.run(build, ...)): training arguments stnb replaces, reported as overridden
    override_args: dict | None = part(RunOptions, "override_args")
    extra: dict = part(Recipe, "extra")

    # ---- its two parts ---------------------------------------------------------------
    @property
    def recipe(self) -> Recipe:
        """What stnb's recipe trains (model, data, loss, steps, batch...), as a ``Recipe``."""
        return Recipe(**{name: getattr(self, name) for name in Recipe.__dataclass_fields__})

    @property
    def run_options(self) -> RunOptions:
        """What every run takes (strategy, processes, device, timeouts, knobs...), as ``RunOptions``."""
        return RunOptions(**{name: getattr(self, name) for name in RunOptions.__dataclass_fields__})

    # ---- derived -----------------------------------------------------------------
    def resolved_device(self) -> str:
        from .hardware import default_device

        return default_device() if self.device == "auto" else self.device

    def strategy_object(self):
        """The strategy (``stnb.strategies.get``): everything stnb asks about it."""
        return strategies.get(self.strategy)

    def world_size(self) -> int:
        s = self.strategy_object()
        if not s.distributed:
            return 1
        if self.num_processes is not None:
            return self.num_processes
        from .hardware import gpu_count

        if self.resolved_device() != "cuda":
            return 2
        return max(gpu_count(), 2) if self.share_gpus else gpu_count()

    def devices_per_process(self) -> int:
        """Devices one process drives (dp: every visible GPU)."""
        from .hardware import gpu_count

        return self.strategy_object().devices(gpu_count())

    def dev_eval_steps(self) -> int | None:
        """The trainer's eval_steps for ``dev_points`` evaluations during training (None: none asked)."""
        if not self.dev_points:
            return None
        return -(-self.steps // (self.dev_points + 1))  # ceil: the multiples below steps are at most dev_points

    def global_batch_size(self) -> int:
        ws = self.world_size() * self.devices_per_process()
        return self.per_device_batch_size * ws * self.gradient_accumulation_steps

    def replace(self, **changes) -> "TrainConfig":
        names = _keywords(type(self))
        unknown = sorted(set(changes) - names)
        if unknown:  # dataclasses.replace would raise a bare TypeError
            raise ConfigError(f"unknown TrainConfig field(s) {unknown}{_did_you_mean(unknown, names)}"
                              f"; valid fields: {sorted(names)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field, with the strategies' options flat ({'bucket_cap_mb': None, ...}): what ``from_dict`` takes."""
        return flat(self)

    @classmethod
    def for_build(cls, **options) -> "TrainConfig":
        """The TrainConfig of a user's own trainer (``stnb.run(build, **options)``): only ``RunOptions``. A
        ``Recipe`` field is refused naming where it belongs in the user's code; a misspelt one is refused
        naming the closest field."""
        takes = launch_fields()
        misplaced = [k for k in options if k in Recipe.__dataclass_fields__]
        if misplaced:
            raise ConfigError(
                "stnb.run(build, ...) trains the trainer your function returns, so these options would not "
                "apply to it: " + "; ".join(f"{k}: {Recipe.where(k)}" for k in misplaced)
                + f". stnb.run(build, ...) takes {', '.join(takes)}")
        unknown = sorted(k for k in options if k not in takes and k != "strategy_options")
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown} for stnb.run(build, ...){_did_you_mean(unknown, takes)}"
                              f"; it takes {', '.join(takes)}")
        return cls(**options)

    def arg_overrides(self) -> dict:
        """``override_args`` checked and normalised: {name: (value, why)} (ConfigError naming the fix)."""
        if self.override_args is None:
            return {}
        if not isinstance(self.override_args, dict):
            raise ConfigError(f"override_args must be a dict like {{'per_device_train_batch_size': 8}}, "
                              f"got {type(self.override_args).__name__}")
        out = {}
        for name, given in self.override_args.items():
            if name not in OVERRIDABLE_ARGS:
                raise ConfigError(f"override_args cannot set {name!r}: stnb overrides only "
                                  f"{', '.join(OVERRIDABLE_ARGS)}; set {name} in your training arguments")
            value, why = given, "given to stnb.run(build, override_args=...)"
            if isinstance(given, (tuple, list)):
                if len(given) != 2 or not isinstance(given[1], str):
                    raise ConfigError(f"override_args[{name!r}] must be a value or (value, why), got {given!r}")
                value, why = given
            check_int(f"override_args[{name!r}]", value, 1)
            out[name] = (value, why)
        return out

    def check_recipe_options(self) -> None:
        """Options that only a user's build function takes are refused for stnb's recipe; its checkpoints
        checked (``stnb.checkpoints.check_recipe``)."""
        if self.override_args:
            raise ConfigError("override_args replaces training arguments of your own trainer "
                              "(stnb.run(build, override_args=...)); stnb's recipe takes per_device_batch_size")
        from .checkpoints import check_recipe

        check_recipe(self)
        self.strategy_object().check_recipe(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = _keywords(cls)
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown TrainConfig field(s) {sorted(unknown)}; valid fields: {sorted(names)}")
        return cls(**d)

    # ---- validation (stnb.configcheck) ----------------------------------------------
    def validate(self, check_resources: bool = True) -> "TrainConfig":
        """Raise ConfigError / StrategyUnavailable naming the fix; return self when fine.

        check_resources also resolves the model and data (exists, non-empty) and checks
        the hardware. Nothing here starts a process or initialises CUDA.
        """
        configcheck.validate(self, check_resources)
        return self

    def check_inputs(self) -> str:
        """stnb's recipe: its model resolved (the local path it trains from, returned) and its data checked."""
        return self.recipe.check_inputs()

    def check_device(self, device: str) -> None:
        """What only a GPU does, refused for ranks on ``device`` 'cpu' (ConfigError)."""
        configcheck.check_device(self, device)

    def check_hardware(self) -> None:
        """This machine can run the strategy with this many processes (ConfigError / StrategyUnavailable)."""
        configcheck.check_hardware(self)

def check_parts(cls=TrainConfig) -> None:
    """TypeError unless every field of ``cls`` is declared by exactly one of its parts (``part(Recipe, ...)`` or
    ``part(RunOptions, ...)``, the same name) and every field of the parts is one of its fields: nothing a part
    declares is dropped from the flat constructor, and ``stnb.run(build, ...)`` knows whether each applies."""
    parts = {**{n: "run" for n in RunOptions.__dataclass_fields__}, **{n: "recipe" for n in Recipe.__dataclass_fields__}}
    mine = {f.name: f.metadata.get(_KIND) for f in dataclasses.fields(cls)}
    wrong = sorted(n for n in set(mine) | set(parts) if mine.get(n) is None or mine.get(n) != parts.get(n))
    if wrong or len(parts) != len(RunOptions.__dataclass_fields__) + len(Recipe.__dataclass_fields__):
        raise TypeError(f"{cls.__name__} fields {wrong} are not declared as part(Recipe, name) or "
                        "part(RunOptions, name) of the part that holds them (or a part's field is missing): "
                        "declare each once, so that stnb.run(build, ...) knows whether it applies to a user's trainer")


check_parts()
strategies.reserve(f.name for f in dataclasses.fields(TrainConfig))  # no strategy option takes a field's name
TrainConfig.__doc__ = (TrainConfig.__doc__ or "") + "\n    The strategies' own options (``stnb.strategies.options()``, each declared in its strategy's module):\n" + \
    "".join(f"    {name} (default {o.default!r}; {', '.join(strategies.option_owners(name))}): {o.help}.\n"
            for name, o in strategies.options().items())


def flat(config) -> dict:
    """A TrainConfig or RunOptions as a flat dict: its fields, with every registered strategy's options at their
    values in place of ``strategy_options`` (options of a strategy no longer registered kept as given)."""
    d = dataclasses.asdict(config)
    given = d.pop("strategy_options")
    return {**d, **{name: o.default for name, o in strategies.options().items()}, **given}


def launch_fields() -> tuple:
    """What ``stnb.run(build, ...)`` takes: the ``RunOptions`` fields in their declaration's order, the strategies'
    options in place of ``strategy_options``."""
    names = [n for n in RunOptions.__dataclass_fields__ if n != "strategy_options"]
    return (*names, *strategies.options())
#: the recipe's fields, each with where it belongs in a user's own code (``Recipe.where``)
RECIPE_FIELDS = {name: Recipe.where(name) for name in Recipe.__dataclass_fields__}

