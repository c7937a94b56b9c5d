"""One training run, from the notebook: stnb's recipe or your own trainer -> RunResult.

``run(config)`` turns the input into a plan and picks one launcher (``stnb.launchers.choose``): ranks
started from this process through ``stnb.launch`` (ddp/fsdp: N ranks; single/dp: one child process, so
CUDA never touches the kernel), forked or spawned (``config.start_method``); this process as a rank of
torchrun / accelerate launch; or a cluster's tasks (``cluster=stnb.Slurm(...)`` / ``stnb.Ray(...)``).
The launcher checks the plan before anything starts, every rank runs ``training.train_rank``, and
``launchers.finish`` merges their measurements (``results.merge``). ``run(build, strategy=...)`` does
the same with the SentenceTransformerTrainer your function ``build()`` returns in each rank.
"""

from __future__ import annotations

from .builds import check_build  # noqa: F401  (stnb.run's check of a build function, kept importable here)
from .config import TrainConfig
from .launchers.bars import StepBars  # noqa: F401  (the default progress display, kept importable here)
from .launchers.local import preimport_training_stack  # noqa: F401  (stnblab.bench pre-imports with it)


def run(config=None, *, results_file=None, on_progress=None, echo: bool = True, cluster=None, **overrides):
    """Train once and return a verified, measured RunResult.

    config: a TrainConfig (stnb's recipe; keyword overrides are applied to it:
        ``run(strategy="ddp", steps=5)``), or your function that builds and returns a
        SentenceTransformerTrainer (``run(build, strategy="fsdp", num_processes=2)``). stnb calls it
        with no arguments in every rank, applies the strategy to the trainer and trains it. With a
        function, only the ``config.RunOptions`` apply (strategy, num_processes,
        device, timeout, stall_timeout, threads_per_rank, save_to, the DDP / FSDP knobs,
        override_args); the recipe's (model, data, loss, steps, batch size...) belong in your
        function and are refused, naming where they go. RunResult.overridden_args lists the training
        arguments stnb replaced, and why: those the strategy must own, and those you asked it to
        replace with ``override_args={"per_device_train_batch_size": 8}``.
    results_file: a JSONL file the result is appended to (atomically) as soon as it exists.
    on_progress: callback receiving per-rank progress (see ``stnb.launch``).
    cluster: where the ranks run (``stnb.launchers``): None, this machine (``stnb.launch``, or the outer
        torchrun / accelerate launch this process is a rank of); ``stnb.Slurm(...)`` / ``stnb.Ray(...)``
        a cluster's tasks / workers (docs/cluster.md).
    """
    from .builds import RecipeBuild, UserBuild
    from .launchers import Plan, choose, execute

    if config is not None and not isinstance(config, TrainConfig):  # the user's function, wrapped
        build = UserBuild(check_build(config))
        config = TrainConfig.for_build(**overrides)
    else:
        build = RecipeBuild()
        config = (config or TrainConfig()).replace(**overrides) if overrides else (config or TrainConfig())
    launcher = choose(cluster)
    return execute(Plan(config, build, results_file, on_progress, echo), launcher)
