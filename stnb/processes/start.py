"""Starting the ranks and waiting for them to end.

Several ranks start as accelerate's ``notebook_launcher`` starts them (torch elastic, static
rendezvous: ``start_ranks``); one rank is started here (``start_one``), never inside the kernel as
``notebook_launcher`` would. ``run_ranks`` does either, with the ranks' environment set and torch
elastic's logs and signal handlers kept out of the notebook, and returns an ``Outcome``. Either way
every rank begins in ``rank.rank_main(channel, options)``, forked or spawned (``hardware.start_method``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field

from .channel import Channel
from .rank import RankOptions, rank_main

LOCALHOST = ("127.0.0.1", "localhost", "::1")


@dataclass
class Outcome:
    """How the launcher call ended: cleanly, with an exception, or interrupted (Ctrl-C / SIGINT)."""

    failure: BaseException | None = None
    interrupted: bool = False
    exit_codes: dict = field(default_factory=dict)  # {local rank: exit code} of the failed launch
    # the launcher's rendezvous store could not bind its port (another program holds it): no rank started
    port_taken: bool = False


def run_ranks(ch: Channel, opts: RankOptions, *, master_addr: str, port: int, node_rank: int, num_nodes: int,
              mixed_precision: str, echo: bool) -> Outcome:
    """Start this node's ranks, wait until they end; never raises what the launcher raises."""
    try:
        with rank_environment(num_nodes, master_addr, node_gpus(opts.device, opts.nproc, num_nodes, node_rank,
                                                                master_addr)), \
                quiet_elastic_logs(), kept_signal_handlers():
            if opts.nproc == 1:
                # notebook_launcher runs a 1-process "launch" inside this process (the kernel) even
                # with num_nodes > 1; fork the rank here instead, as global rank node_rank
                start_one(ch, opts, master_addr, port, rank=node_rank)
            else:
                if echo:
                    print(f"stnb: launching {opts.nproc} rank(s) on {opts.device} ({opts.backend}), "
                          f"{master_addr}:{port}" + (", spawn" if opts.start_method == "spawn" else ""), flush=True)
                start_ranks(ch, opts, master_addr=master_addr, port=port, node_rank=node_rank,
                            num_nodes=num_nodes, mixed_precision=mixed_precision)
    except KeyboardInterrupt:
        return Outcome(interrupted=True)
    except Exception as e:  # ChildFailedError, SignalException, RuntimeError from the launcher...
        if getattr(e, "sigval", None) in (signal.SIGINT, int(signal.SIGINT)):  # elastic's SignalException
            return Outcome(interrupted=True)
        return Outcome(failure=e, exit_codes=exit_codes(e), port_taken=store_port_taken(e))
    return Outcome()


def store_port_taken(e: BaseException) -> bool:
    """True for the error elastic's agent raises, in this process and before it starts any rank, when
    its rendezvous store cannot bind the port (ranks that fail are reported as ChildFailedError)."""
    return type(e).__name__ == "DistNetworkError" and ("EADDRINUSE" in str(e) or "address already in use" in str(e))


def start_ranks(ch: Channel, opts: RankOptions, *, master_addr: str, port: int, node_rank: int = 0,
                num_nodes: int = 1, mixed_precision: str = "no") -> None:
    """Start ``opts.nproc`` ranks running ``rank_main(ch, opts)`` and wait for them: accelerate
    ``notebook_launcher``'s multi-process branch, with ``opts.start_method``. Raises what torch's
    elastic launcher raises (ChildFailedError, SignalException...)."""
    from accelerate.utils import check_cuda_p2p_ib_support, patch_environment
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from torch.numa.binding import AffinityMode, NumaOptions

    nproc = opts.nproc
    env = dict(nproc=nproc, node_rank=node_rank, world_size=num_nodes * nproc, master_addr=master_addr,
               master_port=str(port), mixed_precision=mixed_precision)
    if not check_cuda_p2p_ib_support():  # nvidia-smi only; consumer GPUs without P2P/IB support
        env["nccl_p2p_disable"] = "1"
        env["nccl_ib_disable"] = "1"
    config = LaunchConfig(
        min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=nproc, run_id="none",
        rdzv_endpoint=f"{master_addr}:{port}", rdzv_backend="static", rdzv_configs={"rank": node_rank},
        max_restarts=0, monitor_interval=0.1, start_method=opts.start_method,
        # LaunchConfig picks NUMA options itself when numa_options is None, asking
        # torch.cuda.is_available(), which starts the driver in this process; as notebook_launcher
        # does, give it a value and take it back (no NUMA binding)
        numa_options=NumaOptions(AffinityMode.NODE),
        # elastic's per-rank folders inside the launch's own, removed with it (by default each launch left a
        # /tmp/torchelastic_* folder behind: thousands on a machine that ran the tests)
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(ch.dir, "elastic")))
    config.numa_options = None
    # elastic's launch writes TORCHELASTIC_SIGNALS_TO_HANDLE into this process's environment and leaves it there
    with patch_environment(**env, torchelastic_signals_to_handle=config.signals_to_handle):
        elastic_launch(config=config, entrypoint=rank_main)(ch, opts)


class SingleRankFailed(Exception):
    """The one rank ``start_one`` forked ended with a non-zero exit code."""

    def __init__(self, exitcode):
        self.exitcode = exitcode
        super().__init__(f"rank 0 exited with code {exitcode}")


def start_one(ch: Channel, opts: RankOptions, master_addr: str, port: int, rank: int = 0) -> None:
    """Start one rank running ``rank_main(ch, opts)`` and wait for it; SingleRankFailed if it fails. With
    several nodes (one process each) it is global rank ``rank`` (= node_rank) of ``opts.world_size``."""
    env = {}
    if opts.init_distributed:
        env = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(opts.world_size),
               "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
               "MASTER_ADDR": master_addr, "MASTER_PORT": str(port)}
    proc = multiprocessing.get_context(opts.start_method).Process(target=one_rank, args=(ch, opts, env),
                                                                  name="stnb-rank-0")
    proc.start()
    while proc.is_alive():
        proc.join(0.1)
    if proc.exitcode != 0:
        raise SingleRankFailed(proc.exitcode)


def one_rank(ch: Channel, opts: RankOptions, env: dict) -> None:
    """The process ``start_one`` starts: the rank, then exit code 0 (ok) or 1 (failed), nothing else."""
    os.environ.update(env)
    try:
        rank_main(ch, opts)
    except BaseException:
        os._exit(1)
    os._exit(0)


def keep_spawn_helper() -> None:
    """Start multiprocessing's resource tracker now, before the launch notes which processes are its
    own: spawning starts it once per process, it lives as long as this one (its own cleanup), and
    the launch's cleanup must not take it for a rank's leftover."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def exit_codes(failure: BaseException) -> dict:
    """{local_rank: exitcode} from torchelastic's ChildFailedError or ``SingleRankFailed``."""
    if isinstance(failure, SingleRankFailed):
        return {0: failure.exitcode}
    cause = failure
    while cause is not None:
        failures = getattr(cause, "failures", None)
        if isinstance(failures, dict):
            return {f.local_rank: getattr(f, "exitcode", None) for f in failures.values()
                    if getattr(f, "local_rank", None) is not None}
        cause = cause.__cause__ or cause.__context__
    return {}


def node_gpus(device: str, nproc: int, num_nodes: int, node_rank: int, master_addr: str) -> str | None:
    """CUDA_VISIBLE_DEVICES for this node's ranks when several "nodes" run on this one machine on CUDA:
    node k gets the visible GPUs k*nproc .. (k+1)*nproc-1 (each node's ranks count LOCAL_RANK from 0, and
    without a slice of its own every node's rank 0 took GPU 0). None: nothing to change (one node, real
    nodes, CPU). ConfigError when this machine has too few GPUs for every node's ranks."""
    if device != "cuda" or num_nodes == 1 or master_addr not in LOCALHOST:
        return None
    from ..errors import ConfigError
    from ..hardware import gpu_count

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else [str(i) for i in range(gpu_count())]
    mine = ids[node_rank * nproc:(node_rank + 1) * nproc]
    if len(ids) < num_nodes * nproc:
        raise ConfigError(f"{num_nodes} nodes x {nproc} process(es) on this one machine (master_addr {master_addr}) "
                          f"need {num_nodes * nproc} GPUs, one per rank; {len(ids)} are visible "
                          f"({visible and 'CUDA_VISIBLE_DEVICES=' + visible or 'all'}). Use fewer nodes or "
                          "processes, or device='cpu'")
    return ",".join(mine)


def rank_environment(num_nodes: int, master_addr: str, gpus: str | None = None):
    """What the ranks inherit while they start (accelerate's ``patch_environment``, taken back after):
    STNB_LAUNCH (a rank knows stnb.launch started it), gloo on loopback when every rank is on this machine,
    and this node's own GPUs (``node_gpus``) as CUDA_VISIBLE_DEVICES."""
    from accelerate.utils import patch_environment

    local_only = num_nodes == 1 or master_addr in LOCALHOST
    env = {"STNB_LAUNCH": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo" if local_only else ""),
           "CUDA_VISIBLE_DEVICES": gpus}
    return patch_environment(**{k: v for k, v in env.items() if v})


@contextmanager
def kept_signal_handlers():
    """torch elastic installs its own SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers; give this process its
    own back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        yield
    finally:
        for s, h in saved.items():
            try:
                signal.signal(s, h)
            except (ValueError, TypeError):  # not main thread / None handler
                pass


_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing.spawn", "torch.distributed.launcher")


@contextmanager
def quiet_elastic_logs():
    """Mute torch elastic's loggers during a launch: stnb reports a failure once, as a LaunchError."""
    try:  # create the loggers now, so the ones below exist before they are muted
        import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401
        import torch.distributed.launcher.api  # noqa: F401
    except Exception:  # pragma: no cover
        pass
    # torchelastic gives every module its own logger with its own level (LOGLEVEL), so
    # muting the parent is not enough: mute every existing logger below these names
    names = [n for n in list(logging.Logger.manager.loggerDict)
             if any(n == p or n.startswith(p + ".") for p in _ELASTIC_LOGGERS)]
    levels = {n: logging.getLogger(n).level for n in sorted(set(names) | set(_ELASTIC_LOGGERS))}
    for n in levels:
        logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for n, lvl in levels.items():
            logging.getLogger(n).setLevel(lvl)
