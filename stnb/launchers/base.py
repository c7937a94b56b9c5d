"""The run pipeline, and the one interface every way of starting ranks implements.

``stnb.run`` turns the user's input into a :class:`Plan`, picks one :class:`Launcher` (``choose``), and
hands both to :func:`execute`: the launcher checks the plan (refusing before anything starts), starts the
ranks, and the ranks' RankReports are merged here, in :func:`finish`, the one place a run's RunResult is
decided. A launcher is one file in this package:

    local     ranks forked or spawned from this process (``stnb.launch``): a notebook, a script
    external  this process is one rank of torchrun / accelerate launch: train here, gather to rank 0
    slurm     ranks as tasks of a SLURM job (submitit); ``start`` returns a job handle at once
    ray       ranks as Ray Train workers (TorchTrainer)

A launcher whose ranks finish later (a cluster job) returns a handle from ``start``; the handle calls
:func:`finish` with the reports when they are there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Plan", "Launcher", "check_plan", "execute", "finish", "rank_env", "refuse_shared_gpus"]


@dataclass
class Plan:
    """One run, as the launcher receives it: the user's input, and what the checks resolved."""

    config: object                  # a TrainConfig
    build: object                   # what the ranks train (stnb.builds): RecipeBuild() or UserBuild(fn)
    results_file: object = None     # a JSONL file the RunResult is appended to
    on_progress: object = None      # callback receiving per-rank progress (a list of RankState)
    echo: bool = True               # print the ranks' output and default progress bars
    device: str | None = None       # 'cpu' / 'cuda', set by the launcher's check
    t0: float = field(default_factory=time.time)  # the run's start (its wall time counts from here)


def check_plan(plan: Plan, config, device: str | None = None, *, machine=None, writes: bool = True) -> None:
    """The checks every launcher makes, in this one order, once it has settled the world and the device in
    ``config``: the options the build takes (stnb's recipe, or a build function), the config itself, ``machine(config)``
    (the launcher's check of what its ranks get: this machine's cores or GPUs, a cluster job's device), the
    build's inputs (stnb's recipe: its model resolved once, its data checked), then the files the run writes,
    where this process writes them (``writes``). Completes ``plan.config`` and ``plan.device`` (``device``:
    the config's resolved device unless the launcher gives it)."""
    from ..results import check_writable
    from ..saving import check_target

    plan.build.check(config)
    config.validate(check_resources=False)  # the hardware is the launcher's to check, just below
    if machine is not None:
        machine(config)
    plan.build.check_inputs(config)
    if writes:
        if plan.results_file is not None:
            check_writable(plan.results_file)
        check_target(config.save_to)
    plan.config, plan.device = config, device or config.resolved_device()


def refuse_shared_gpus(config, launcher: str) -> None:
    """ConfigError for ``share_gpus=True`` under a launcher that gives each rank a GPU of its own (torchrun,
    SLURM, Ray): only stnb's own launcher puts several ranks on one GPU."""
    from ..errors import ConfigError

    if config.share_gpus:
        raise ConfigError(f"share_gpus=True puts several ranks on each GPU, which only stnb's own launcher does "
                          f"(stnb.run / stnb.launch on this machine); under {launcher} each rank gets a GPU of its "
                          "own: leave share_gpus out, or run the ranks from a notebook or a script without a launcher")


def rank_env(config, device: str) -> dict:
    """The environment every launcher sets in a rank before it imports torch or accelerate: the device's
    (``hardware.device_env``, with the config's threads per rank) and the strategy's over it."""
    from ..hardware import device_env

    return {**device_env(device, config.threads_per_rank), **config.strategy_object().rank_env(config, device)}


class Launcher:
    """A way of starting a run's ranks. Subclasses set ``name`` and implement ``check`` and ``start``."""

    #: what RunResult.launcher says for runs it started
    name = "?"

    def check(self, plan: Plan) -> None:
        """Refuse the plan (ConfigError, StrategyUnavailable, ResultsFileError) before anything starts,
        naming the cause and the fix; complete what the plan leaves open for this launcher (device, the build's model)."""
        raise NotImplementedError

    def start(self, plan: Plan):
        """Start the ranks: return their RankReports in rank order, or a handle whose ``result()``
        gives the RunResult later (a cluster job)."""
        raise NotImplementedError

    def deliver(self, plan: Plan, reports: list):
        """The RunResult of ``reports`` (``finish``) for this process. An outer launcher's ranks
        override it: rank 0 decides, the others receive its result."""
        return finish(plan, reports, self.name)

    def n_gpu(self, plan: Plan) -> int:
        """GPUs per node, as merge counts devices for a strategy (this machine's, by default)."""
        from ..hardware import gpu_count

        return gpu_count()


def execute(plan: Plan, launcher: Launcher):
    """check -> start -> merge: a RunResult (or, from a launcher whose ranks finish later, its handle)."""
    launcher.check(plan)
    started = launcher.start(plan)
    if not isinstance(started, list):  # a job handle: its result() finishes the run
        return started
    return launcher.deliver(plan, started)


def finish(plan: Plan, reports: list, launcher: str, *, n_gpu: int | None = None, cluster: dict | None = None,
           wall_time_s: float | None = None, independent: bool = False):
    """Merge the ranks' reports into the RunResult (``results.merge``) and append it to the results file.

    independent: each report is a run of its own (N single-device runs side by side, no communication):
    each is merged alone and the RunResult is their sum (``results.side_by_side``)."""
    from ..hardware import gpu_count
    from ..results import append_result, merge, side_by_side

    how = dict(device=plan.device, n_gpu=gpu_count() if n_gpu is None else n_gpu,
               wall_time_s=time.time() - plan.t0 if wall_time_s is None else wall_time_s, launcher=launcher,
               cluster=cluster, build=plan.build)
    if independent:
        result = side_by_side([merge(plan.config, [report], **how) for report in reports])
    else:
        result = merge(plan.config, reports, **how)
    if plan.results_file is not None:
        append_result(plan.results_file, result)
    return result
