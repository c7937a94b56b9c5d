"""Leaving the notebook: the same run under torchrun / accelerate launch, on one node or many.

A notebook run (``stnb.run``) starts its own ranks with ``stnb.launch``. When a job outgrows
one machine, the same training is started by an outside launcher instead, and stnb notices:

* ``python -m stnb run ...`` (or a script calling ``stnb.run``) started by
  ``torchrun --nproc_per_node=N`` or ``accelerate launch --multi_gpu --num_processes N``
  finds WORLD_SIZE / RANK / LOCAL_RANK in its environment (and not STNB_LAUNCH=1, which
  ``stnb.launch`` sets in its own ranks), so it does not launch again: :func:`run_here`
  runs ``training.train_rank`` in this process, gathers every rank's measurements to rank 0
  (``dist.all_gather_object``) and merges them into the same RunResult a notebook run
  gives, with ``launcher='torchrun'`` or ``'accelerate'``.
  (``accelerate launch --cpu --num_processes N`` starts only ONE process unless given an MPI
  hostfile; stnb then starts the ranks itself, launcher 'stnb', and says so.)
* ``stnb.export_script(config, "train.py")`` (``stnb/export.py``) writes such a script for a
  notebook's configuration and prints the commands for one node and for several nodes.
* ``stnb.launch(fn, num_processes=..., num_nodes=2, node_rank=i, master_addr=..., master_port=...)``
  runs a notebook cell's function across machines: every node runs the same call with its
  own ``node_rank``.

The launcher decides the number of processes: ``config.num_processes`` is replaced by the
launch's WORLD_SIZE (rank 0 prints a note when they differ), and hardware is checked per
node (LOCAL_WORLD_SIZE ranks on this node's cores or GPUs). On CPU each rank uses one thread
unless ``threads_per_rank`` or OMP_NUM_THREADS says otherwise. stnb's stall watchdog,
``timeout`` and ``start_method`` belong to ``stnb.launch``; under torchrun, torchrun starts and
supervises the ranks.
"""

from __future__ import annotations

import os
import sys
import time

from .errors import ConfigError
from .saving import check_target

__all__ = ["inside_external_launch", "launcher_name", "external_rank", "is_main_process", "run_here"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE")


def inside_external_launch(environ=None) -> bool:
    """True when this process is a rank started by torchrun, accelerate launch (or another
    launcher that sets WORLD_SIZE and RANK), and not by ``stnb.launch``."""
    env = os.environ if environ is None else environ
    if env.get("STNB_LAUNCH") == "1":
        return False
    inside = "WORLD_SIZE" in env and "RANK" in env
    if not inside and environ is None:
        _note_accelerate_cpu()
    return inside


_NOTED = False


def _note_accelerate_cpu() -> None:
    """`accelerate launch --cpu --num_processes N` starts ONE process (several CPU processes need
    an MPI hostfile); stnb then starts the ranks itself. Say so once, so nobody is surprised."""
    global _NOTED
    env = os.environ
    if _NOTED or env.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1") or "MASTER_ADDR" not in env:
        return
    _NOTED = True
    print("stnb: accelerate launch --cpu started one process (accelerate starts several CPU processes only "
          "with --mpirun_hostfile); stnb starts the ranks itself (launcher 'stnb'). For accelerate-started "
          "ranks use: accelerate launch --multi_gpu --num_processes N ...", file=sys.stderr, flush=True)


def launcher_name(environ=None) -> str:
    """'accelerate' (accelerate launch), 'torchrun' (torchrun / torch elastic) or 'external'."""
    env = os.environ if environ is None else environ
    if "ACCELERATE_MIXED_PRECISION" in env or "ACCELERATE_DYNAMO_BACKEND" in env:
        return "accelerate"  # accelerate launch sets these in every process it starts
    if "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env:
        return "torchrun"
    return "external"  # e.g. srun / mpirun that set WORLD_SIZE and RANK


def external_rank(environ=None) -> int:
    """This process's global rank in an outside launch (0 when not inside one)."""
    env = os.environ if environ is None else environ
    return int(env.get("RANK", "0")) if inside_external_launch(env) else 0


def is_main_process(environ=None) -> bool:
    """True on rank 0 of an outside launch, and always outside one (a notebook, ``python -m stnb``).

    Scripts use it to print the RunResult once: ``if stnb.scaleout.is_main_process(): print(...)``.
    """
    return external_rank(environ) == 0


def _world(env) -> tuple[int, int, int]:
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env["RANK"])
        local_world = int(env.get("LOCAL_WORLD_SIZE") or world)
    except ValueError as e:
        raise ConfigError(f"WORLD_SIZE/RANK/LOCAL_WORLD_SIZE in the environment are not integers ({e}); "
                          "start the script with torchrun or accelerate launch") from None
    return world, rank, local_world


def _check_here(config, world: int, local_world: int, launcher: str, recipe: bool = True) -> None:
    """Validation for ranks started from outside: the world comes from the launcher, and the
    hardware check is per node (this node's ranks on this node's cores or GPUs)."""
    from .hardware import capacity_problem

    strategy = config.strategy_object()
    if not strategy.distributed and world > 1:
        raise ConfigError(
            f"strategy {config.strategy!r} runs in one process, but {launcher} started {world} processes "
            f"(WORLD_SIZE={world}); use --strategy ddp or fsdp, or start one process "
            "(python -m stnb run ..., without a launcher)")
    config.validate(check_resources=False)
    device = config.resolved_device()
    if strategy.min_gpus:  # GPUs in this one process
        from .errors import StrategyUnavailable
        from .hardware import strategy_availability

        avail = strategy_availability(device)[strategy.name]
        if not avail["runnable"]:
            raise StrategyUnavailable(strategy.name, avail["reason"])
    if device == "cpu" and config.mixed_precision == "fp16":
        raise ConfigError("mixed_precision='fp16' needs a GPU; on CPU use 'bf16' or 'no'")
    problem = capacity_problem(device, local_world, option="--nproc_per_node")
    if problem:  # per node: this node's ranks on this node's cores or GPUs
        raise ConfigError(f"{launcher} started {local_world} processes on this node: {problem}")
    if not recipe:  # a user's build function: its model and data are its own
        return
    from .data import check_data
    from .models import resolve_model

    resolve_model(config.model)
    check_data(config.data)


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


def run_here(config, *, results_file=None, build=None):
    """Train ``config`` (or the trainer ``build()`` returns) as one rank of torchrun / accelerate launch.

    Every rank calls this (``stnb.run`` does, when :func:`inside_external_launch` is true).
    Each rank runs ``training.train_rank``; the ranks gather their measurements to rank 0,
    which merges them (``launcher='torchrun'`` / ``'accelerate'``) and, with ``results_file``,
    appends the RunResult there. Every rank returns the same RunResult; print it on rank 0
    only (:func:`is_main_process`). The process group is destroyed before returning, unless
    it existed before this call.
    """
    import torch.distributed as dist

    from .hardware import gpu_count
    from .results import RunResult, append_result, check_writable, merge
    from .training import train_rank

    env = os.environ
    world, rank, local_world = _world(env)
    launcher = launcher_name(env)
    launch_time = _process_start_time()
    if config.strategy_object().distributed and config.num_processes not in (None, world):
        if rank == 0:
            print(f"stnb: {launcher} started {world} process(es); using world size {world} "
                  f"instead of num_processes={config.num_processes}", file=sys.stderr, flush=True)
    if config.strategy_object().distributed:
        config = config.replace(num_processes=world)
    config = config.replace(threads_per_rank=_threads(config, env))
    if build is None:
        config.check_recipe_options()
    _check_here(config, world, local_world, launcher, recipe=build is None)
    if results_file is not None and rank == 0:
        check_writable(results_file)
    if rank == 0:
        check_target(config.save_to)
    if config.threads_per_rank and config.resolved_device() == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(config.threads_per_rank))  # accelerate reads it too
    if config.resolved_device() == "cpu":
        # a user's TrainingArguments without use_cpu=True would set up accelerate for no distribution on a
        # CPU-only node (each rank training alone); stnb.launch's CPU ranks set the same
        env["ACCELERATE_USE_CPU"] = "true"
    # what the strategy's ranks need in their environment (stnb.launch sets the same in its ranks):
    # DeepSpeed's config for accelerate, and on CPU its CPU accelerator
    env.update(config.strategy_object().rank_env(config, config.resolved_device()))
    if int(env.get("LOCAL_RANK", "0")) == 0:  # once per node (DeepSpeed's CPU op is built here, not per rank)
        config.strategy_object().before_launch(config, config.resolved_device())
    if env.get("MASTER_ADDR", "") in _LOOPBACK and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # every rank is on this machine: keep gloo on loopback

    if world == 1 and not config.strategy_object().distributed:
        # one process: a plain single-process run, as in the notebook (with the launcher's
        # variables in place, accelerate would wrap the model in a 1-rank DDP)
        for k in _LAUNCH_VARS:
            env.pop(k, None)

    from .models import resolve_model

    model_path = resolve_model(config.model) if build is None else None
    had_group = dist.is_available() and dist.is_initialized()
    try:
        mine = train_rank(config, model_path, launch_time, build=build)
        grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if grouped:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        gathered.sort(key=lambda d: d.rank)
        payload = [None, None]  # [RunResult dict, error message] decided on rank 0
        if rank == 0:
            try:
                result = merge(config, gathered, device=config.resolved_device(), n_gpu=gpu_count(),
                               wall_time_s=time.time() - launch_time, launcher=launcher)
                if results_file is not None:
                    append_result(results_file, result)
                payload[0] = result.to_dict()
            except Exception as e:  # tell the other ranks instead of leaving them waiting
                payload[1] = f"{type(e).__name__}: {e}"
                if not grouped:
                    raise
        if grouped:
            dist.broadcast_object_list(payload, src=0)
        if payload[1] is not None:
            raise RuntimeError(f"rank 0 could not merge the ranks' results: {payload[1]}")
        return RunResult.from_dict(payload[0])
    finally:
        if not had_group:
            _destroy_group()


def _destroy_group() -> None:
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
