"""This process is one rank of torchrun / accelerate launch (or srun, mpirun setting WORLD_SIZE and RANK).

The outer launcher started the ranks and decides the world size; every rank checks the plan for
its node, trains here (``training.train_rank``), and the ranks gather their reports to rank 0, which
merges them and shares the RunResult (or its failure) with the others. ``stnb.scaleout`` says how
such a launch is recognised and how a notebook run leaves for one.
"""

from __future__ import annotations

import os
import sys
import time

from ..errors import ConfigError
from .base import Launcher, Plan, check_plan, finish, rank_env, refuse_shared_gpus

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE")


class External(Launcher):
    """Train as one rank of an outer launch; rank 0 merges (launcher 'torchrun' / 'accelerate' / 'external')."""

    def __init__(self, environ=None):
        from ..scaleout import launcher_name

        self.env = os.environ if environ is None else environ
        self.name = launcher_name(self.env)

    def check(self, plan: Plan) -> None:
        env = self.env
        self.world, self.rank, local_world = _world(env)
        plan.t0 = _process_start_time()
        config = plan.config
        if config.strategy_object().distributed and config.num_processes not in (None, self.world):
            if self.rank == 0:
                print(f"stnb: {self.name} started {self.world} process(es); using world size {self.world} "
                      f"instead of num_processes={config.num_processes}", file=sys.stderr, flush=True)
        if config.strategy_object().distributed:
            config = config.replace(num_processes=self.world)
        config = config.replace(threads_per_rank=_threads(config, env))
        check_plan(plan, config, machine=lambda c: check_here(c, self.world, local_world, self.name),
                   writes=self.rank == 0)  # rank 0 writes the results file and the model

    def start(self, plan: Plan) -> list:
        import torch.distributed as dist

        from ..training import train_rank

        config, env = plan.config, self.env
        env.update(rank_env(config, plan.device))  # what every launcher sets in its ranks
        if env.get("MASTER_ADDR", "") in _LOOPBACK and "GLOO_SOCKET_IFNAME" not in env:
            env["GLOO_SOCKET_IFNAME"] = "lo"  # every rank is on this machine: keep gloo on loopback
        if self.world == 1 and not config.strategy_object().distributed:
            # one process: a plain single-process run, as in the notebook (with the launcher's
            # variables in place, accelerate would wrap the model in a 1-rank DDP)
            for k in _LAUNCH_VARS:
                env.pop(k, None)
        self.had_group = dist.is_available() and dist.is_initialized()
        try:
            mine = train_rank(config, plan.build, plan.t0)
            self.grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            if self.grouped:
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, mine)
            else:
                gathered = [mine]
        except BaseException:
            self._leave()
            raise
        return sorted(gathered, key=lambda d: d.rank)

    def deliver(self, plan: Plan, reports: list):
        """Rank 0 merges and tells the other ranks the RunResult, or why it could not merge."""
        import torch.distributed as dist

        from ..results import RunResult

        try:
            payload = [None, None]  # [RunResult dict, error message] decided on rank 0
            if self.rank == 0:
                try:
                    payload[0] = finish(plan, reports, self.name).to_dict()
                except Exception as e:  # tell the other ranks instead of leaving them waiting
                    payload[1] = f"{type(e).__name__}: {e}"
                    if not self.grouped:
                        raise
            if self.grouped:
                dist.broadcast_object_list(payload, src=0)
            if payload[1] is not None:
                raise RuntimeError(f"rank 0 could not merge the ranks' results: {payload[1]}")
            return RunResult.from_dict(payload[0])
        finally:
            self._leave()

    def _leave(self) -> None:
        """The process group is destroyed before returning, unless it existed before the run."""
        if not self.had_group:
            destroy_group()


def _world(env) -> tuple[int, int, int]:
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env["RANK"])
        local_world = int(env.get("LOCAL_WORLD_SIZE") or world)
    except ValueError as e:
        raise ConfigError(f"WORLD_SIZE/RANK/LOCAL_WORLD_SIZE in the environment are not integers ({e}); "
                          "start the script with torchrun or accelerate launch") from None
    return world, rank, local_world


def check_here(config, world: int, local_world: int, launcher: str) -> None:
    """The hardware check for ranks started from outside (after the config's validation): the world comes
    from the launcher, and the check is per node (this node's ranks on this node's cores or GPUs)."""
    from ..hardware import capacity_problem

    refuse_shared_gpus(config, launcher)
    strategy = config.strategy_object()
    if not strategy.distributed and world > 1:
        raise ConfigError(
            f"strategy {config.strategy!r} runs in one process, but {launcher} started {world} processes "
            f"(WORLD_SIZE={world}); use --strategy ddp or fsdp, or start one process "
            "(python -m stnb run ..., without a launcher)")
    device = config.resolved_device()
    if strategy.min_gpus:  # GPUs in this one process
        from ..errors import StrategyUnavailable
        from ..hardware import strategy_availability

        avail = strategy_availability(device)[strategy.name]
        if not avail["runnable"]:
            raise StrategyUnavailable(strategy.name, avail["reason"])
    if device == "cpu" and config.mixed_precision == "fp16":
        raise ConfigError("mixed_precision='fp16' needs a GPU; on CPU use 'bf16' or 'no'")
    problem = capacity_problem(device, local_world, option="--nproc_per_node")
    if problem:  # per node: this node's ranks on this node's cores or GPUs
        raise ConfigError(f"{launcher} started {local_world} processes on this node: {problem}")


def _threads(config, env) -> int | None:
    """CPU ranks: threads_per_rank, else OMP_NUM_THREADS, else 1 (torchrun's own default)."""
    if config.resolved_device() != "cpu":
        return config.threads_per_rank
    if config.threads_per_rank:
        return config.threads_per_rank
    try:
        return max(1, int(env.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def _process_start_time() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # pragma: no cover
        return time.time()


def destroy_group() -> None:
    """Destroy the process group train_rank created, and forget accelerate's state of it, so a
    second ``stnb.run`` in the same script starts clean."""
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() > 1:
                # leave together: a rank that tears its gloo connections down while a peer is still
                # finishing the last collective can make that peer abort
                dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
    try:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    except Exception:
        pass
