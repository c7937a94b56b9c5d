"""One training run, from the notebook: stnb's recipe or your own trainer -> RunResult.

``run(config)`` validates the config in the notebook process, then starts the ranks through
``stnb.launch`` (ddp/fsdp: N ranks; single/dp: one child process, so CUDA never touches the
kernel), forked or spawned (``config.start_method``). Every rank runs ``training.train_rank`` and returns its measurements; ``run`` merges them
(``results.merge``). ``run(build, strategy=...)`` does the same with the SentenceTransformerTrainer
your function ``build()`` returns in each rank.
"""

from __future__ import annotations

import time

from .config import TrainConfig
from .errors import ConfigError
from .launch import launch
from .results import RunResult, append_result, check_writable, merge
from .saving import check_target
from .training import train_rank


def run(config=None, *, results_file=None, on_progress=None, echo: bool = True, **overrides) -> RunResult:
    """Train once and return a verified, measured RunResult.

    config: a TrainConfig (stnb's recipe; keyword overrides are applied to it:
        ``run(strategy="ddp", steps=5)``), or your function that builds and returns a
        SentenceTransformerTrainer (``run(build, strategy="fsdp", num_processes=2)``). stnb calls it
        with no arguments in every rank, applies the strategy to the trainer and trains it. With a
        function, only the options in ``config.LAUNCH_FIELDS`` apply (strategy, num_processes,
        device, timeout, stall_timeout, threads_per_rank, save_to, the DDP / FSDP knobs,
        override_args); the recipe's (model, data, loss, steps, batch size...) belong in your
        function and are refused, naming where they go. RunResult.overridden_args lists the training
        arguments stnb replaced, and why: those the strategy must own, and those you asked it to
        replace with ``override_args={"per_device_train_batch_size": 8}``.
    results_file: a JSONL file the result is appended to (atomically) as soon as it exists.
    on_progress: callback receiving per-rank progress (see ``stnb.launch``).
    """
    from .hardware import gpu_count, start_method as resolve_start_method
    from .models import resolve_model

    build = None
    if config is not None and not isinstance(config, TrainConfig):
        build = check_build(config)
        config = TrainConfig.for_build(**overrides)
        check_build_for(build, config)
    else:
        config = (config or TrainConfig()).replace(**overrides) if overrides else (config or TrainConfig())
    from . import scaleout

    if scaleout.inside_external_launch():  # a rank of torchrun / accelerate launch: don't launch again
        return scaleout.run_here(config, results_file=results_file, build=build)
    if build is None:
        config.check_recipe_options()
        config.validate()
    else:  # the model and data are the function's: check the options and this machine
        config.validate(check_resources=False)
        config.check_hardware()
    if results_file is not None:
        check_writable(results_file)
    check_target(config.save_to)
    model_path = resolve_model(config.model) if build is None else None  # builds 'tiny' once, here
    method = resolve_start_method(config.start_method)
    if method == "fork":
        preimport_training_stack()
    device = config.resolved_device()
    ws = config.world_size()
    env = {}
    if device == "cuda" and config.strategy_object().pinned_to_one_gpu():
        from .hardware import single_gpu_env

        env = single_gpu_env()
    env.update(config.strategy_object().rank_env(config, device))
    config.strategy_object().before_launch(config, device)
    t0 = time.time()
    bars = None
    if on_progress is None and echo:
        bars = StepBars(config.strategy)
        on_progress = bars.update
    try:
        # the requested world size travels as an argument, apart from the environment the launcher sets
        rank_results = launch(train_rank, config, model_path, t0, ws, build, num_processes=ws,
                              timeout=config.timeout, stall_timeout=config.stall_timeout, device=device,
                              threads_per_rank=config.threads_per_rank, on_progress=on_progress, echo=echo,
                              distributed=config.strategy_object().distributed, env=env, start_method=method)
    finally:
        if bars is not None:
            bars.close()
    result = merge(config, rank_results, device=device, n_gpu=gpu_count(), wall_time_s=time.time() - t0)
    if results_file is not None:
        append_result(results_file, result)
    return result


def check_build(build):
    """``build`` is a function stnb can call with no arguments in every rank (ConfigError otherwise)."""
    import inspect

    try:
        from transformers import Trainer

        if isinstance(build, Trainer):
            raise ConfigError("stnb.run got a trainer built in this process; pass the function that builds it "
                              "instead (stnb.run(build, ...), not stnb.run(build())): each rank builds its own "
                              "trainer, and a trainer made here holds state forked ranks cannot use")
    except ImportError:  # pragma: no cover
        pass
    if not callable(build):
        raise ConfigError(f"stnb.run takes a TrainConfig or a function returning a SentenceTransformerTrainer; "
                          f"got {type(build).__name__}")
    if inspect.iscoroutinefunction(build) or inspect.isgeneratorfunction(build):
        raise ConfigError("the build function must return the trainer (not be async or a generator)")
    try:
        sig = inspect.signature(build)
    except (TypeError, ValueError):
        return build
    required = [p.name for p in sig.parameters.values() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ConfigError(f"stnb calls your build function with no arguments, but {getattr(build, '__name__', build)}"
                          f"() requires {', '.join(required)}; give them defaults, or bind them with "
                          f"functools.partial(build, {required[0]}=...)")
    from .buildsource import global_objects
    from .model_types import trainer_problem

    problem = trainer_problem(global_objects(build))
    if problem:
        raise ConfigError(problem)
    return build


def check_build_for(build, config) -> None:
    """ConfigError when ``config``'s strategy cannot train what ``build`` reads (seen before any process
    starts: ``Strategy.build_refusal``)."""
    from .buildsource import read_objects

    problem = config.strategy_object().build_refusal(read_objects(build))
    if problem:
        raise ConfigError(f"strategy {config.strategy!r}: {problem}")


def preimport_training_stack() -> None:
    """Import the training stack once in this process: forked ranks inherit it instead of each
    importing it again (6-8 CPU seconds per rank). None of it initialises CUDA."""
    import sentence_transformers  # noqa: F401
    import sentence_transformers.sentence_transformer.losses  # noqa: F401
    import sentence_transformers.sentence_transformer.evaluation  # noqa: F401
    import transformers.trainer  # noqa: F401


class StepBars:
    """Default live progress for ``run``: one tqdm bar per rank (a widget in Jupyter, text elsewhere),
    fed from the launch's progress relay in this process: ranks never draw bars themselves."""

    def __init__(self, label: str):
        self.label = label
        self.bars = {}

    def update(self, states) -> None:
        from tqdm.auto import tqdm

        for st in states:
            if st.total <= 0:
                continue
            bar = self.bars.get(st.rank)
            if bar is None:
                bar = self.bars[st.rank] = tqdm(total=st.total, desc=f"{self.label} rank {st.rank}",
                                                unit="step", leave=True, mininterval=0.5)
            if st.step > bar.n:
                bar.update(st.step - bar.n)
            if st.loss is not None:
                bar.set_postfix(loss=f"{st.loss:.4f}", refresh=False)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
