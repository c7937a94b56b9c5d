"""The rank side: what runs in every rank, from its start to its exit.

``rank_main`` is where every rank starts: it checks in on the channel, sends its output to its own log,
leaves the notebook kernel behind, joins the process group and checks the world there, runs the user's
function and leaves its result or its error record on the channel. Inside the function
``rank_context()``, ``heartbeat()`` and ``report_progress()`` talk to the parent's watchdog; a thread in
the rank counts a moving Python stack as progress too.
"""

from __future__ import annotations

import faulthandler
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..errors import LaunchError
from ..hardware import device_env, rank_gpu
from .byvalue import result_bytes, unpack
from .channel import DONE, FAILED, Channel
from .detach import detach_from_kernel
from .output import quiet_known_harmless, redirect_output
from .peerfail import collective_timeout, nccl_env, open_wait_group

_CTX: "RankContext | None" = None  # set inside a rank
_LAUNCHER_TOKEN: "str | None" = None  # made in the launching process; a forked rank inherits it
_PROGRESS_SINK = None  # outside stnb.launch: where report_progress goes (a cluster rank's progress file)

#: seconds a failing rank waits for ``destroy_process_group`` before it leaves without it
DESTROY_GRACE_S = 2.0


@dataclass
class RankContext:
    """What a rank knows about its launch. ``stnb.rank_context()`` returns it inside a rank."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: str
    backend: str
    launch_time: float
    channel: Channel
    threads: int
    start_method: str = "fork"            # how this rank was started, as observed inside it
    start_method_requested: str = "fork"  # what the launch asked for


def rank_context() -> RankContext | None:
    """The current rank's context, or None outside an stnb launch."""
    return _CTX


def scratch_folder(prefix: str) -> str:
    """A new folder for a rank's files during its run: inside an stnb launch, in the launch's own folder
    (removed however the rank ends); elsewhere in the system's temporary folder, removed by whoever made it."""
    import tempfile

    return tempfile.mkdtemp(prefix=prefix, dir=_CTX.channel.dir if _CTX is not None else None)


def heartbeat() -> None:
    """Tell the stall watchdog this rank is making progress (cheap; no-op outside a launch)."""
    ctx = _CTX
    if ctx is not None:
        ctx.channel.bump(ctx.local_rank)


def report_progress(step: int, total: int | None = None, loss: float | None = None) -> None:
    """Publish training progress for the parent's per-rank display (and count as a heartbeat)."""
    ctx = _CTX
    if ctx is not None:
        ctx.channel.report(ctx.local_rank, step, total, loss)
    elif _PROGRESS_SINK is not None:
        _PROGRESS_SINK(step, total, loss)


def set_progress_sink(sink) -> None:
    """In a rank another launcher started (SLURM, Ray): ``sink(step, total, loss)`` receives what
    ``report_progress`` publishes (None: nothing does)."""
    global _PROGRESS_SINK
    _PROGRESS_SINK = sink


def launcher_token() -> str:
    """A token of the launching process: a rank holding it is a fork of that process (``started_as``)."""
    global _LAUNCHER_TOKEN
    if _LAUNCHER_TOKEN is None:
        _LAUNCHER_TOKEN = secrets.token_hex(8)
    return _LAUNCHER_TOKEN


def started_as(opts: "RankOptions") -> str:
    """'fork' when this process is a copy of the launching one (it holds its token), else 'spawn': observed."""
    return "fork" if _LAUNCHER_TOKEN is not None and _LAUNCHER_TOKEN == opts.launcher_token else "spawn"


@dataclass
class RankOptions:
    """Everything a rank needs from ``launch``: inherited through fork, pickled for spawn (the function
    and its arguments then travel by value in ``packed``, and ``fn`` is None)."""

    fn: object
    args: tuple
    kwargs: dict
    device: str
    backend: str
    threads: int
    nproc: int
    world_size: int
    launch_time: float
    init_distributed: bool = True
    env: dict = field(default_factory=dict)
    stall_timeout: float | None = None
    start_method: str = "fork"
    packed: bytes | None = None  # spawn: byvalue.pack(fn, args, kwargs)
    launcher_token: str = ""

    def call(self):
        """The user's ``fn(*args, **kwargs)``, unpacked first when it travelled by value."""
        fn, args, kwargs = unpack(self.packed) if self.packed is not None else (self.fn, self.args, self.kwargs)
        return fn(*args, **kwargs)


def rank_main(ch: Channel, opts: RankOptions) -> None:
    """Entry point of every rank (torch elastic, or ``start.one_rank``, calls it in the child)."""
    global _CTX
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ.get("RANK", str(local_rank)))
    # the watchdog asks a checked-in rank for its stack (SIGUSR1, whose default action ends the process): the
    # handler is in place before the rank checks in
    stack_file = open(ch.path("stack", local_rank), "w")
    if hasattr(faulthandler, "register"):  # POSIX: the watchdog asks for every thread's stack
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    ch.check_in(local_rank)
    # a forked rank inherits elastic's Python SIGTERM handler, which a rank blocked in a CUDA / NCCL wait
    # never runs (elastic's SIGKILL then comes 30 s later): SIGTERM kills
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.update({**device_env(opts.device, opts.threads), **opts.env})  # the launcher's over the device's
    redirect_output(ch.path("log", local_rank))
    quiet_known_harmless()
    detach_from_kernel()
    import torch

    if opts.device == "cpu":
        torch.set_num_threads(opts.threads)
    ctx = RankContext(rank=rank, local_rank=local_rank, world_size=opts.world_size,
                      local_world_size=opts.nproc, device=opts.device, backend=opts.backend,
                      launch_time=opts.launch_time, channel=ch, threads=opts.threads,
                      start_method=started_as(opts), start_method_requested=opts.start_method)
    _CTX = ctx
    stop = threading.Event()
    watcher = threading.Thread(target=_progress_thread, args=(ctx, threading.get_ident(), stop),
                               name="stnb-progress", daemon=True)
    watcher.start()
    import torch.distributed as dist

    try:
        if opts.init_distributed and not dist.is_initialized():
            _join_world(opts, rank, local_rank)
        ch.set_up(local_rank)
        result = opts.call()
        try:
            data = result_bytes(result, spawned=ctx.start_method == "spawn")
        except Exception as e:
            raise LaunchError(f"rank {rank} returned a value that cannot be pickled ({type(result).__name__}: {e}); "
                              "return plain data (numbers, lists, dicts, tensors moved to CPU)") from e
        ch.write_result(local_rank, data)
        ch.set_state(local_rank, DONE)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # leave together (tearing gloo down while a peer finishes the last collective can abort it); if a
            # peer failed, the barrier fails too: this rank's result stands, the peer's error is reported
            try:
                dist.barrier()
            except Exception:
                pass
    except BaseException as e:
        ch.set_state(local_rank, FAILED)
        ch.write_error(local_rank, {"rank": rank, "local_rank": local_rank, "type": type(e).__name__,
                                    "message": str(e), "traceback": traceback.format_exc(), "time": time.time()})
        # the full traceback travels in the error record (LaunchError shows it once)
        print(f"[stnb] rank {rank} stopped by {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        if isinstance(e, Exception):
            # ends the rank with exit code 1 all the same; an exception raised on would have torch.multiprocessing
            # pickle its traceback into a /tmp/pytorch-errorfile-* that nothing removes
            sys.exit(1)
        raise
    finally:
        stop.set()
        try:
            if dist.is_initialized() and ch.state(local_rank) != FAILED:
                dist.destroy_process_group()
            elif dist.is_initialized():
                _leave_group_failing()
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()


def _join_world(opts: RankOptions, rank: int, local_rank: int) -> None:
    """Initialise torch.distributed and check the world against the one the caller asked for."""
    import torch
    import torch.distributed as dist

    from ..checks import observe_world, world_problems

    if opts.backend == "nccl":  # a peer that fails ends NCCL collectives instead of hanging them
        os.environ.update(nccl_env())
    if opts.device == "cuda":
        torch.cuda.set_device(rank_gpu(local_rank))
    dist.init_process_group(backend=opts.backend, timeout=collective_timeout(opts.stall_timeout))
    open_wait_group()  # waiting for rank 0's evaluation / save is not bounded by that timeout
    # the world the caller asked for (opts, not the environment the group was built from)
    # against the processes that answer in the group
    problems = world_problems(opts.world_size, observe_world())
    if problems:
        raise LaunchError(f"rank {rank}: " + "; ".join(problems))
    if opts.backend == "gloo":
        # nobody leaves before everybody is connected: a rank that destroyed its group while a slower peer
        # was still connecting made it fail ("connectFullMesh failed ... Connection closed by peer")
        dist.barrier()


def _leave_group_failing() -> None:
    """Tear the process group down in a failing rank without blocking: destroying it makes gloo peers fail
    at once instead of waiting, but under NCCL it can wait for collectives the peers never finish. So it
    runs in a thread for a moment; still blocked, the rank leaves without it (exit code 1)."""
    import torch.distributed as dist

    t = threading.Thread(target=dist.destroy_process_group, name="stnb-destroy-group", daemon=True)
    t.start()
    t.join(DESTROY_GRACE_S)
    if t.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _progress_thread(ctx: RankContext, main_ident: int, stop: threading.Event) -> None:
    """Marks progress when the main thread's Python stack moves or a heartbeat arrives."""
    ch, r = ctx.channel, ctx.local_rank
    last_sig, last_beats = None, -1.0
    while not stop.wait(0.25):
        frame = sys._current_frames().get(main_ident)
        sig = _frame_signature(frame)
        beats = ch.heartbeats(r)
        if sig != last_sig or beats != last_beats:
            ch.mark_progress(r, time.time())
            last_sig, last_beats = sig, beats
        del frame


def _frame_signature(frame) -> tuple:
    sig = []
    depth = 0
    while frame is not None and depth < 64:
        sig.append((id(frame.f_code), frame.f_lineno))
        frame = frame.f_back
        depth += 1
    return tuple(sig)

