"""``launch()``: the orchestration, and what it checks before anything starts.

validate -> fork: check the process is fit to fork / spawn: pack the function by value -> open the
channel, start the watchdog -> start the ranks and wait -> diagnose a failure -> collect the results.
Also the record of the last launch (``last_launch``) and the rendezvous port (``free_port``).
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from ..errors import ConfigError, LaunchError
from .byvalue import pack
from .channel import Channel
from .diagnose import diagnose
from .forksafe import check_fork_safe, fork_ready
from .rank import RankOptions, launcher_token
from .start import LOCALHOST, Outcome, keep_spawn_helper, node_gpus, run_ranks
from .supervise import tracked_children
from .watchdog import Watchdog

_LOCK = threading.Lock()
_LAST: "LaunchInfo | None" = None


@dataclass
class LaunchInfo:
    """Details of the last launch in this process: ``stnb.last_launch()``."""

    num_processes: int
    port: int  # the rendezvous port; 0 for a world of one process, whose store binds any free port
    device: str
    backend: str
    logs: dict = field(default_factory=dict)
    wall_time_s: float = 0.0
    start_time: float = 0.0
    error: str | None = None
    start_method: str = "fork"


def last_launch() -> LaunchInfo | None:
    return _LAST


def launch(fn, *args, num_processes: int = 2, timeout: float | None = None, stall_timeout: float | None = 30.0,
           device: str = "auto", threads_per_rank: int | None = None, num_nodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", master_port: int | None = None, mixed_precision: str = "no",
           on_progress=None, echo: bool = True, distributed: bool = True, env: dict | None = None,
           start_method: str = "auto", share_gpus: bool = False, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` in ``num_processes`` ranks; return their results ordered by rank.

    Every rank starts with torch.distributed initialised (gloo on CPU, NCCL on GPU) with
    world size ``num_processes * num_nodes``. Inside a rank, ``stnb.rank_context()`` tells its
    rank. Output of each rank is printed with a ``[rank N]`` prefix.

    timeout: seconds for the whole launch (None: no limit).
    stall_timeout: stop when no running rank made progress (its Python stack did not move and
        it called no ``stnb.heartbeat``) for this many seconds; the error carries each rank's stack.
    num_nodes / node_rank / master_addr / master_port: multi-node; every node runs the same call.
        On one node stnb binds to 127.0.0.1 and picks a free port.
    on_progress: called in the parent, about twice a second, with a list of ``RankState``.
    distributed: with num_processes=1, False runs the rank without a process group (stnb's
        'single' and 'dp' strategies: the child keeps CUDA out of the kernel).
    env: environment variables set in every rank before anything else runs there.
    start_method: 'fork' (ranks are copies of this process: Linux), 'spawn' (fresh interpreters: the
        function and its arguments are pickled, by value when defined in a notebook cell; the
        default on macOS / Windows) or 'auto' ($STNB_START_METHOD, else the platform's).
    share_gpus: on CUDA, allow more ranks than GPUs: rank i uses GPU i % GPUs (``hardware.rank_gpu``) and the
        ranks talk over gloo (NCCL takes one GPU per rank).

    Raises ConfigError before anything starts for bad arguments; LaunchError when a rank
    fails, stalls or the timeout passes (other ranks are stopped, no process is left).
    """
    from ..hardware import backend_for, cpu_cores, start_method as resolve_start_method

    device = check_arguments(fn, num_processes, timeout, stall_timeout, device, threads_per_rank, num_nodes,
                             node_rank, master_addr, master_port, share_gpus)
    method = resolve_start_method(start_method)
    if method == "fork":
        call = dict(fn=fn, args=args, kwargs=kwargs)
        check_fork_safe()
    else:  # a fresh interpreter: the function travels by value, checked here before anything starts
        call = dict(fn=None, args=(), kwargs={}, packed=pack(fn, args, kwargs))
        keep_spawn_helper()
    nproc, world_size = num_processes, num_processes * num_nodes
    # a world of one process needs no agreed port: its store binds whichever is free (0) as it starts
    port = master_port or (free_port(master_addr) if world_size > 1 else 0)
    with _one_launch_at_a_time(), Channel(nproc) as ch:
        opts = RankOptions(**call, device=device, backend=backend_for(device, nproc),
                           threads=threads_per_rank or max(1, cpu_cores() // nproc), nproc=nproc,
                           world_size=world_size, launch_time=time.time(),
                           init_distributed=distributed or world_size > 1, env=dict(env or {}),
                           stall_timeout=stall_timeout, start_method=method, launcher_token=launcher_token())
        info = _record(LaunchInfo(num_processes=nproc, port=port, device=device, backend=opts.backend,
                                  start_time=opts.launch_time, start_method=method))
        watchdog = Watchdog(ch, nproc, timeout, stall_timeout, on_progress, echo, rank_offset=node_rank * nproc)
        with watchdog, tracked_children(), (fork_ready() if method == "fork" else nullcontext()):
            outcome = _run_on_a_free_port(ch, opts, info, picked=master_port is None, master_addr=master_addr,
                                          node_rank=node_rank, num_nodes=num_nodes,
                                          mixed_precision=mixed_precision, echo=echo)
            watchdog.launcher_returned()
        info.logs, info.wall_time_s = dict(watchdog.logs), time.time() - opts.launch_time
        error = diagnose(ch, watchdog, outcome, nproc, node_rank, method)
        if error is not None:
            info.error = "interrupted" if isinstance(error, KeyboardInterrupt) else str(error)
            raise error
        return collect_results(ch, nproc, node_rank, info.logs)


PORT_TRIES = 3


def _run_on_a_free_port(ch: Channel, opts: RankOptions, info: LaunchInfo, picked: bool, **where) -> Outcome:
    """``run_ranks`` on ``info.port``. A port stnb picked was only free when ``free_port`` looked, and
    another process can take it before the rendezvous store binds it; no rank has started then, so stnb
    picks another and starts again (a port the caller gave is never changed)."""
    for _ in range(PORT_TRIES):
        outcome = run_ranks(ch, opts, port=info.port, **where)
        if not (picked and outcome.port_taken):
            break
        info.port = free_port(where["master_addr"])
    return outcome


def collect_results(ch: Channel, nproc: int, node_rank: int, logs: dict) -> list:
    """Every local rank's returned value, in rank order."""
    results = []
    for r in range(nproc):
        try:
            results.append(ch.read_result(r))
        except FileNotFoundError:
            rank = node_rank * nproc + r
            raise LaunchError(
                f"rank {rank} exited without returning a result (did the function call sys.exit()/os._exit(), "
                "or was the process ended from outside?)", rank=rank, ranks=[rank], kind="exited",
                logs=logs) from None
    return results


@contextmanager
def _one_launch_at_a_time():
    if not _LOCK.acquire(blocking=False):
        raise LaunchError("another stnb.launch is already running in this process; wait for it to finish "
                          "(one launch at a time per kernel)", kind="busy")
    try:
        yield
    finally:
        _LOCK.release()


def _record(info: LaunchInfo) -> LaunchInfo:
    global _LAST
    _LAST = info
    return info


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when binding host:port fails the way the rendezvous store's bind would (SO_REUSEADDR
    set, so a port merely in TIME_WAIT after an earlier launch counts as free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_arguments(fn, num_processes, timeout, stall_timeout, device, threads_per_rank, num_nodes, node_rank,
                    master_addr, master_port, share_gpus=False) -> str:
    """Refuse bad arguments before anything starts; return the device ('cpu' or 'cuda') to use."""
    from ..hardware import capacity_problem, default_device

    if not callable(fn):
        raise ConfigError(f"launch needs a callable as its first argument, got {type(fn).__name__}")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ConfigError(f"num_processes must be an integer >= 1, got {num_processes!r}")
    for name, v in (("timeout", timeout), ("stall_timeout", stall_timeout)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ConfigError(f"{name} must be a positive number of seconds or None, got {v!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if threads_per_rank is not None and (not isinstance(threads_per_rank, int) or threads_per_rank < 1):
        raise ConfigError(f"threads_per_rank must be an integer >= 1, got {threads_per_rank!r}")
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
    if not isinstance(node_rank, int) or not 0 <= node_rank < num_nodes:
        raise ConfigError(f"node_rank must be in [0, num_nodes={num_nodes}), got {node_rank!r}")
    if device == "auto":  # what hardware_report() says: a GPU this torch build has no kernels for is not one
        device = default_device()
    problem = capacity_problem(device, num_processes, share_gpus=bool(share_gpus))
    if problem:
        raise ConfigError(problem)
    _check_rendezvous(num_nodes, master_addr, master_port)
    node_gpus(device, num_processes, num_nodes, node_rank, master_addr)  # "nodes" on one machine: a GPU per rank
    return device


def _check_rendezvous(num_nodes: int, master_addr: str, master_port: int | None) -> None:
    if num_nodes == 1 and master_port is None and master_addr not in LOCALHOST:
        raise ConfigError("master_addr other than localhost only makes sense with num_nodes > 1")
    if num_nodes > 1 and master_port is None:
        raise ConfigError("multi-node launches need an agreed master_port on every node; pass master_port=...")
    if master_port is not None and num_nodes == 1 and port_in_use(master_addr, master_port):
        raise ConfigError(f"master_port={master_port} is already in use on {master_addr} (another launch, a "
                          "Jupyter server or some other program holds it); leave master_port=None and stnb "
                          "picks a free port, or choose another port")
