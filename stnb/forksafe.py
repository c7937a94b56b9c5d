"""Forking ranks from a notebook safely.

stnb forks its ranks from the notebook's own process. Two things must hold for that to work:

* the notebook process never started the CUDA driver: after ``cuInit`` a forked child cannot use
  CUDA ("Cannot re-initialize CUDA in forked subprocess"). ``check_fork_safe`` looks at the driver
  itself, not only at torch's ``torch.cuda.is_initialized()`` (``torch.cuda.is_available()`` starts
  the driver and leaves that flag False);
* every rank is a forked child, never the kernel itself. accelerate's ``notebook_launcher`` runs the
  function *inside* the kernel in Colab with fewer than 2 GPUs (and asks ``torch.cuda.is_available()``
  there, starting the driver). ``start_ranks`` forks the ranks with torch's elastic launcher the way
  ``notebook_launcher`` does on any other Jupyter, on every platform.
"""

from __future__ import annotations

import ctypes
import os

from .errors import ConfigError

__all__ = ["check_fork_safe", "cuda_driver_initialised", "start_ranks"]

_CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialised() -> bool:
    """True when this process has started the CUDA driver (or torch's CUDA state).

    The driver library is looked up only if it is already loaded (RTLD_NOLOAD), and asked for its
    device count: before ``cuInit`` every driver call but cuInit returns CUDA_ERROR_NOT_INITIALIZED.
    Nothing here initialises anything."""
    import torch

    if torch.cuda.is_initialized():
        return True
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:  # never loaded in this process: never initialised
        return False
    try:
        get_count = lib.cuDeviceGetCount
    except AttributeError:  # pragma: no cover - not a CUDA driver
        return False
    count = ctypes.c_int(0)
    return get_count(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED


def check_fork_safe() -> None:
    """Refuse to fork when the parent already holds device or accelerate state ranks can't inherit."""
    if cuda_driver_initialised():
        raise ConfigError(
            "CUDA is already initialised in this process (a tensor was moved to the GPU, a model was loaded on "
            "'cuda', or torch.cuda.is_available() / torch.cuda.device_count() / torch.cuda.get_device_name() "
            "was called in an earlier cell), and forked ranks cannot use an initialised CUDA driver. "
            "Fix: restart the kernel and keep all GPU work inside the launched function / stnb.run; "
            "stnb.hardware() tells what GPUs there are without starting the driver.")
    try:
        from accelerate.state import AcceleratorState

        if len(AcceleratorState._shared_state) > 0:
            raise ConfigError(
                "An accelerate Accelerator (or a Trainer) was created in this process before launching; "
                "forked ranks would inherit its single-process state. Fix: restart the kernel and create "
                "Accelerators/Trainers only inside the launched function.")
    except ImportError:  # pragma: no cover
        pass


def start_ranks(entry, nproc: int, *, master_addr: str, port: int, node_rank: int = 0, num_nodes: int = 1,
                mixed_precision: str = "no") -> None:
    """Fork ``nproc`` ranks running ``entry()`` and wait for them: accelerate ``notebook_launcher``'s
    multi-process branch (torch elastic, static rendezvous, fork), without its in-kernel branch.

    Raises what torch's elastic launcher raises (ChildFailedError, SignalException...)."""
    from accelerate.utils import check_cuda_p2p_ib_support, patch_environment
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from torch.numa.binding import AffinityMode, NumaOptions

    env = dict(nproc=nproc, node_rank=node_rank, world_size=num_nodes * nproc, master_addr=master_addr,
               master_port=str(port), mixed_precision=mixed_precision)
    if not check_cuda_p2p_ib_support():  # nvidia-smi only; consumer GPUs without P2P/IB support
        env["nccl_p2p_disable"] = "1"
        env["nccl_ib_disable"] = "1"
    with patch_environment(**env):
        config = LaunchConfig(
            min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=nproc, run_id="none",
            rdzv_endpoint=f"{master_addr}:{port}", rdzv_backend="static", rdzv_configs={"rank": node_rank},
            max_restarts=0, monitor_interval=0.1, start_method="fork",
            # LaunchConfig picks NUMA options itself when numa_options is None, asking
            # torch.cuda.is_available(), which starts the driver in this process; as notebook_launcher
            # does, give it a value and take it back (no NUMA binding)
            numa_options=NumaOptions(AffinityMode.NODE))
        config.numa_options = None
        elastic_launch(config=config, entrypoint=entry)()
