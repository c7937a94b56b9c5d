"""Run a function on N processes from a notebook cell, and get every rank's result back.

Ranks are forked the way accelerate's ``notebook_launcher`` forks them (torch elastic, fork
start method; ``stnb.forksafe.start_ranks``), but never run inside the kernel, as
``notebook_launcher`` does in Colab. stnb adds what the launcher lacks:

* a result channel: ``launch`` returns ``[result_of_rank_0, result_of_rank_1, ...]``;
* torch.distributed initialised in every rank (gloo on CPU, NCCL on GPU) and the world
  size verified inside each rank;
* a free port chosen per launch (a busy 29500 does not matter);
* per-rank output capture: each rank writes to its own log, the parent prints complete
  lines prefixed ``[rank N]``, so ranks never interleave and never write to the kernel's
  sockets (no "attempted to send message from fork");
* error propagation: a rank that raises gives ``LaunchError`` naming the rank, with that
  rank's traceback, and the other ranks are stopped;
* a watchdog: overall ``timeout`` and a stall detector (no rank's Python stack moved and
  no heartbeat for ``stall_timeout`` seconds) that dumps every rank's stack and stops them;
* cleanup: no process the launch started survives success, failure, timeout or KeyboardInterrupt,
  including what a rank started itself (its children are re-parented to the launching process
  while the launch runs, see ``child_subreaper``).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

from .errors import ConfigError, LaunchError
from .forksafe import check_fork_safe, start_ranks
from .peerfail import collective_timeout, is_secondary, nccl_env, origin

__all__ = ["launch", "heartbeat", "report_progress", "rank_context", "last_launch", "free_port"]

# shared-memory slots per rank
_BEAT, _STEP, _TOTAL, _LOSS, _STATE, _PID, _BEATS, _T0 = range(8)
_SLOTS = 8
_STARTING, _RUNNING, _DONE, _FAILED = 0.0, 1.0, 2.0, 3.0

_LAUNCH_LOCK = threading.Lock()
_LAST: "LaunchInfo | None" = None
_CTX: "RankContext | None" = None  # set inside a rank


# ---------------------------------------------------------------------------------------
# public helpers usable inside ranks


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
    channel: "_Channel"
    threads: int
    peak_rss: int = 0
    start_rss: int = 0

    def peak_rss_growth(self) -> int:
        return max(0, self.peak_rss - self.start_rss)


def rank_context() -> RankContext | None:
    """The current rank's context, or None outside an stnb launch."""
    return _CTX


def heartbeat() -> None:
    """Tell the stall watchdog this rank is making progress (cheap; no-op outside a launch)."""
    ctx = _CTX
    if ctx is not None:
        ctx.channel.bump(ctx.local_rank)


def report_progress(step: int, total: int | None = None, loss: float | None = None) -> None:
    """Publish training progress for the parent's per-rank display (and count as a heartbeat)."""
    ctx = _CTX
    if ctx is None:
        return
    ch, r = ctx.channel, ctx.local_rank
    ch.set(r, _STEP, step)
    if total is not None:
        ch.set(r, _TOTAL, total)
    if loss is not None:
        ch.set(r, _LOSS, float(loss))
    ch.bump(r)


@dataclass
class RankState:
    """One rank's progress as seen from the parent (passed to ``on_progress``)."""

    rank: int
    state: str
    step: int
    total: int
    loss: float | None
    seconds_since_progress: float


@dataclass
class LaunchInfo:
    """Details of the last launch in this process: ``stnb.last_launch()``."""

    num_processes: int
    port: int
    device: str
    backend: str
    logs: dict = field(default_factory=dict)
    wall_time_s: float = 0.0
    start_time: float = 0.0
    error: str | None = None


def last_launch() -> LaunchInfo | None:
    return _LAST


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
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


# ---------------------------------------------------------------------------------------
# the channel between parent and ranks: a temp folder + a fork-inherited shared array


class _Channel:
    def __init__(self, nproc: int):
        self.nproc = nproc
        self.dir = tempfile.mkdtemp(prefix="stnb-launch-")
        self.shm = multiprocessing.get_context("fork").Array("d", nproc * _SLOTS, lock=False)
        for r in range(nproc):
            self.shm[r * _SLOTS + _LOSS] = float("nan")

    def path(self, kind: str, rank: int) -> str:
        return os.path.join(self.dir, f"{kind}-{rank}")

    def set(self, rank: int, slot: int, value: float) -> None:
        self.shm[rank * _SLOTS + slot] = value

    def get(self, rank: int, slot: int) -> float:
        return self.shm[rank * _SLOTS + slot]

    def bump(self, rank: int) -> None:
        self.shm[rank * _SLOTS + _BEATS] += 1.0

    def write_atomic(self, kind: str, rank: int, data: bytes) -> None:
        tmp = self.path(kind, rank) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path(kind, rank))

    def read_error(self, rank: int) -> dict | None:
        try:
            with open(self.path("error", rank)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def read_log(self, rank: int) -> str:
        try:
            with open(self.path("log", rank), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def pids(self) -> dict:
        return {r: int(self.get(r, _PID)) for r in range(self.nproc) if self.get(r, _PID) > 0}

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# rank side


def _frame_signature(frame) -> tuple:
    sig = []
    depth = 0
    while frame is not None and depth < 64:
        sig.append((id(frame.f_code), frame.f_lineno))
        frame = frame.f_back
        depth += 1
    return tuple(sig)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _progress_thread(ctx: RankContext, main_ident: int, stop: threading.Event) -> None:
    """Marks progress when the main thread's Python stack moves or a heartbeat arrives."""
    ch, r = ctx.channel, ctx.local_rank
    last_sig, last_beats = None, -1.0
    while not stop.wait(0.25):
        frame = sys._current_frames().get(main_ident)
        sig = _frame_signature(frame)
        beats = ch.get(r, _BEATS)
        if sig != last_sig or beats != last_beats:
            ch.set(r, _BEAT, time.time())
            last_sig, last_beats = sig, beats
        ctx.peak_rss = max(ctx.peak_rss, _rss_bytes())
        del frame


def _detach_from_kernel() -> None:
    """A forked rank must never use the Jupyter kernel's sockets.

    In a kernel, IPython's shell, ipywidgets and tqdm.auto's notebook bar all send messages
    on the kernel's ZMQ sockets; from a fork ipykernel drops them and logs
    "attempted to send message from fork". So the rank stops being "in a notebook": the
    shell singleton is cleared (IPython.get_ipython() -> None), tqdm.auto becomes the text
    bar, and transformers' notebook progress callback becomes the text one. Progress is
    relayed to the notebook by the parent instead.
    """
    try:
        from IPython.core.interactiveshell import InteractiveShell

        if InteractiveShell.initialized():
            inst = InteractiveShell.instance()
            type(inst).clear_instance()
            InteractiveShell.clear_instance()
    except Exception:
        pass
    comm = sys.modules.get("comm")
    if comm is not None and hasattr(comm, "_create_comm") and hasattr(comm, "_get_comm_manager"):
        # ipykernel points comm.create_comm at kernel comms, which send "comm_open" on the
        # kernel's sockets (an ipywidgets widget does on creation); in a rank they must be inert
        comm.create_comm = comm._create_comm
        comm.get_comm_manager = comm._get_comm_manager
    if "tqdm" in sys.modules:
        try:
            import tqdm.std

            # tqdm's monitor thread does not exist in the fork, but the lock it may have held at
            # fork time was copied locked: give the rank fresh locks.
            tqdm.std.TqdmDefaultWriteLock.th_lock = threading.RLock()
            tqdm.std.tqdm.__dict__.get("_lock") is not None and delattr(tqdm.std.tqdm, "_lock")
            tqdm.std.tqdm.monitor = None

            std, std_range = tqdm.std.tqdm, tqdm.std.trange
            notebook_classes = []
            for name in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook"):
                mod = sys.modules.get(name)
                if mod is not None and getattr(mod, "tqdm", None) is not std:
                    notebook_classes.append(getattr(mod, "tqdm"))
            notebook_ranges = [getattr(sys.modules.get(n), "trange", None)
                               for n in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook")]
            for mod in list(sys.modules.values()):
                d = getattr(mod, "__dict__", None)
                if not d:
                    continue
                for attr in ("tqdm", "trange"):
                    val = d.get(attr)
                    if val is not None and (val in notebook_classes or (attr == "trange" and val in notebook_ranges
                                                                          and val is not std_range)):
                        d[attr] = std if attr == "tqdm" else std_range
            for name in ("tqdm.auto", "tqdm.autonotebook"):
                mod = sys.modules.get(name)
                if mod is not None:
                    mod.tqdm, mod.trange = std, std_range
        except Exception:
            pass
    tr = sys.modules.get("transformers.trainer")
    if tr is not None:
        try:
            from transformers.trainer_callback import ProgressCallback

            tr.DEFAULT_PROGRESS_CALLBACK = ProgressCallback
        except Exception:
            pass


def _redirect_output(path: str) -> None:
    """Send this rank's stdout/stderr (Python and C level) to its own log file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush() if hasattr(sys.stdout, "flush") else None
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr


@dataclass
class _Options:
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


def _rank_main(ch: _Channel, opts: _Options) -> None:
    """Entry point of every rank (runs in the forked child)."""
    global _CTX
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ.get("RANK", str(local_rank)))
    ch.set(local_rank, _PID, os.getpid())
    ch.set(local_rank, _BEAT, time.time())
    ch.set(local_rank, _STATE, _RUNNING)
    os.environ.update(opts.env)
    _redirect_output(ch.path("log", local_rank))
    stack_file = open(ch.path("stack", local_rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _detach_from_kernel()
    if opts.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["ACCELERATE_USE_CPU"] = "true"
    import torch

    if opts.device == "cpu":
        torch.set_num_threads(opts.threads)
        os.environ["OMP_NUM_THREADS"] = str(opts.threads)
    ctx = RankContext(rank=rank, local_rank=local_rank, world_size=opts.world_size,
                      local_world_size=opts.nproc, device=opts.device, backend=opts.backend,
                      launch_time=opts.launch_time, channel=ch, threads=opts.threads)
    ctx.start_rss = ctx.peak_rss = _rss_bytes()
    _CTX = ctx
    stop = threading.Event()
    watcher = threading.Thread(target=_progress_thread, args=(ctx, threading.get_ident(), stop),
                               name="stnb-progress", daemon=True)
    watcher.start()
    import torch.distributed as dist

    from .checks import observe_world, world_problems

    try:
        if opts.init_distributed and not dist.is_initialized():
            kw = {}
            if opts.backend == "nccl":  # a peer that fails ends NCCL collectives instead of hanging them
                os.environ.update(nccl_env())
                kw["timeout"] = collective_timeout(opts.stall_timeout)
            if opts.device == "cuda":
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend=opts.backend, **kw)
            # the world the caller asked for (opts, not the environment the group was built from)
            # against the processes that answer in the group
            problems = world_problems(opts.world_size, observe_world())
            if problems:
                raise LaunchError(f"rank {rank}: " + "; ".join(problems))
            if opts.backend == "gloo":
                # gloo connects every pair inside init_process_group; a rank that finished a short
                # function and destroyed its group while a slower peer was still connecting made
                # that peer fail with "connectFullMesh failed ... Connection closed by peer".
                # Nobody leaves before everybody is connected.
                dist.barrier()
        result = opts.fn(*opts.args, **opts.kwargs)
        try:
            data = pickle.dumps(result)
        except Exception as e:
            raise LaunchError(f"rank {rank} returned a value that cannot be pickled ({type(result).__name__}: {e}); "
                              "return plain data (numbers, lists, dicts, tensors moved to CPU)") from e
        ch.write_atomic("result", local_rank, data)
        ch.set(local_rank, _STATE, _DONE)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # leave together: tearing gloo connections down while a peer is still finishing the
            # last collective can make that peer abort. If a peer failed instead, the barrier
            # fails too; this rank's result stands and the peer's own error is what is reported.
            try:
                dist.barrier()
            except Exception:
                pass
    except BaseException as e:
        ch.set(local_rank, _STATE, _FAILED)
        record = {"rank": rank, "local_rank": local_rank, "type": type(e).__name__, "message": str(e),
                  "traceback": traceback.format_exc(), "time": time.time()}
        ch.write_atomic("error", local_rank, json.dumps(record).encode())
        # the full traceback travels in the error record (LaunchError shows it once)
        print(f"[stnb] rank {rank} stopped by {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        raise
    finally:
        stop.set()
        try:
            if dist.is_initialized() and ch.get(local_rank, _STATE) != _FAILED:
                dist.destroy_process_group()
            elif dist.is_initialized():
                _leave_group_failing()
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()


_DESTROY_GRACE_S = 2.0


def _leave_group_failing() -> None:
    """Tear the process group down in a failing rank without ever blocking there.

    Destroying it closes the connections, so gloo peers fail at once instead of waiting; but under
    NCCL destroy_process_group can block (it waits for collectives the peers never finish), and a
    rank that never exits leaves its peers hanging. So it runs in a thread, given a moment; if it is
    still blocked, the rank leaves without it (its error record is written; exit code 1)."""
    import torch.distributed as dist

    t = threading.Thread(target=dist.destroy_process_group, name="stnb-destroy-group", daemon=True)
    t.start()
    t.join(_DESTROY_GRACE_S)
    if t.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


# ---------------------------------------------------------------------------------------
# parent side


class _Watchdog(threading.Thread):
    """Parent thread: relays rank output, reports progress, enforces timeout and stall limits."""

    rank_offset = 0  # global rank of this node's local rank 0 (node_rank * nproc)

    def __init__(self, ch: _Channel, nproc: int, timeout, stall_timeout, on_progress, echo: bool):
        super().__init__(name="stnb-watchdog", daemon=True)
        self.ch, self.nproc = ch, nproc
        self.timeout, self.stall_timeout = timeout, stall_timeout
        self.on_progress, self.echo = on_progress, echo
        self.start_time = time.time()
        self.stop_event = threading.Event()
        self.reason: str | None = None  # 'timeout' | 'stalled'
        self.stalled: list = []
        self.stacks: dict = {}
        self.logs = {r: "" for r in range(nproc)}
        self._offsets = {r: 0 for r in range(nproc)}
        self._partial = {r: "" for r in range(nproc)}
        self._checked_in = False
        self._last_progress_call = 0.0
        self.killed: set = set()
        # ranks whose process ended while the launch ran: {local_rank: (time seen, exit code or None)}
        self.ended: dict = {}
        self.returned_at: float | None = None  # set when the launcher call returned

    # output relay ------------------------------------------------------------------------
    def _relay(self, final: bool = False) -> None:
        for r in range(self.nproc):
            path = self.ch.path("log", r)
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[r])
                    chunk = f.read()
            except OSError:
                continue
            if not chunk and not (final and self._partial[r]):
                continue
            self._offsets[r] += len(chunk)
            text = self._partial[r] + chunk.decode("utf-8", errors="replace")
            self.logs[r] += chunk.decode("utf-8", errors="replace")
            lines = text.split("\n")
            self._partial[r] = "" if final else lines.pop()
            if final and lines and lines[-1] == "":
                lines.pop()
            if self.echo:
                out = []
                for line in lines:
                    line = line.rstrip("\r").rsplit("\r", 1)[-1]  # a progress bar's last state
                    if line.strip():
                        out.append(f"[rank {self.rank_offset + r}] {line}\n")
                if out:
                    sys.stdout.write("".join(out))
                    sys.stdout.flush()

    def states(self) -> list:
        now = time.time()
        names = {_STARTING: "starting", _RUNNING: "running", _DONE: "done", _FAILED: "failed"}
        out = []
        for r in range(self.nproc):
            beat = self.ch.get(r, _BEAT)
            loss = self.ch.get(r, _LOSS)
            out.append(RankState(rank=r, state=names.get(self.ch.get(r, _STATE), "?"),
                                 step=int(self.ch.get(r, _STEP)), total=int(self.ch.get(r, _TOTAL)),
                                 loss=None if loss != loss else loss,  # NaN until a loss is reported
                                 seconds_since_progress=(now - beat) if beat else 0.0))
        return out

    # stopping -----------------------------------------------------------------------------
    def dump_stacks(self) -> dict:
        pids = self.ch.pids()
        for r, pid in pids.items():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        stacks = {}
        for r in pids:
            try:
                with open(self.ch.path("stack", r)) as f:
                    stacks[r] = f.read()
            except OSError:
                stacks[r] = ""
        return stacks

    def kill_ranks(self) -> None:
        _kill_tree(list(self.ch.pids().values()))

    def _halt(self, reason: str, stalled=()) -> None:
        self.reason = reason
        self.stalled = list(stalled)
        self.stacks = self.dump_stacks() if reason != "exited" else {}
        self.kill_ranks()

    def _track_ended(self, now: float) -> None:
        """Note ranks whose process has ended. A rank that ends with exit code 0 but without a
        result (os._exit(0), a C library calling exit()) is never reported by torchelastic, whose
        other ranks then wait for it forever; stop such a launch after _EXIT_GRACE seconds."""
        if self.returned_at is not None:
            return
        for r, pid in self.ch.pids().items():
            if r not in self.ended:
                ended, code = _process_ended(pid)
                if ended:
                    self.ended[r] = (now, code)
        silent = [r for r, (t, _) in self.ended.items()
                  if now - t > _EXIT_GRACE and _silent(self.ch, r)]
        if silent:
            self._halt("exited", stalled=sorted(silent))

    def run(self) -> None:
        n = 0
        while not self.stop_event.wait(0.02):
            try:
                # ended ranks are looked for every 20 ms: torchelastic reaps a dead rank within its
                # 0.1 s monitor interval, and only a rank seen dead can be blamed for what follows
                self._track_ended(time.time())
                n += 1
                if not self.reason and n % 5 == 0:
                    self._tick()
            except Exception:  # never let the watchdog die silently
                traceback.print_exc()
            if self.reason:
                return

    def _tick(self) -> None:
        now = time.time()
        if not self._checked_in:
            # print nothing until every rank has started: a write in the parent while a
            # fork happens could leave a lock held in the child.
            self._checked_in = all(self.ch.get(r, _PID) > 0 for r in range(self.nproc))
        if self._checked_in:
            self._relay()
            if self.on_progress is not None and now - self._last_progress_call >= 0.5:
                self._last_progress_call = now
                try:
                    self.on_progress(self.states())
                except Exception:
                    traceback.print_exc()
        if self.timeout is not None and now - self.start_time > self.timeout:
            self._halt("timeout")
            return
        if self.stall_timeout is not None and not self._checked_in:
            missing = [r for r in range(self.nproc) if self.ch.get(r, _PID) <= 0]
            if now - self.start_time > max(self.stall_timeout, 60.0):
                self._halt("not started", stalled=missing)
                return
        if self.stall_timeout is not None and self._checked_in:
            running = [r for r in range(self.nproc) if self.ch.get(r, _STATE) == _RUNNING]
            if running:
                ages = {r: now - self.ch.get(r, _BEAT) for r in running}
                if all(a > self.stall_timeout for a in ages.values()):
                    self._halt("stalled", stalled=sorted(running))

    def finish(self) -> None:
        self.stop_event.set()
        if self.is_alive():
            self.join(timeout=5)
        if self._checked_in or any(os.path.exists(self.ch.path("log", r)) for r in range(self.nproc)):
            self._relay(final=True)
        if self.on_progress is not None:
            try:
                self.on_progress(self.states())
            except Exception:
                traceback.print_exc()


def _kill_tree(pids) -> None:
    """SIGKILL the given processes and all their descendants; wait until they are dead.

    Dead, not reaped: the ranks are children of multiprocessing / torchelastic, which must
    collect their exit status themselves. (psutil.wait_procs reaped them; multiprocessing then
    got ECHILD, believed the rank alive forever, and a 1-rank launch hung after a stall.)"""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        psutil = None
    procs = []
    for pid in pids:
        if psutil is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            continue
        try:
            p = psutil.Process(pid)
            procs.extend(p.children(recursive=True))
            procs.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    end = time.time() + 5
    while procs and time.time() < end:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        procs = alive
        if procs:
            time.sleep(0.02)


def _release_openmp_threads() -> None:
    """End this thread's GNU OpenMP worker pool before forking (the next parallel op restarts it).

    libgomp keeps a pool per thread that ran a parallel region; a forked rank inherits the
    pool's bookkeeping but not its threads, so the rank's first multi-threaded torch op (e.g.
    layer_norm) waits for them forever. That hung every rank with more than one thread after
    the notebook had run any torch code itself. omp_pause_resource_all (OpenMP 5.0) ends the
    pool cleanly. Intel's and LLVM's OpenMP runtimes handle fork themselves.
    """
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return
    for path in sorted(libs):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        pause(2)  # omp_pause_hard


_EXIT_GRACE = 2.0  # seconds a silently ended rank may take to be noticed by torchelastic


def _process_ended(pid: int) -> tuple:
    """(ended, exit code) of a rank process: a zombie or gone is ended. A zombie's exit status is
    read from /proc without reaping it (multiprocessing still has to join it); negative = signal."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True, None
    except (OSError, IndexError):
        return False, None
    if fields[0] not in ("Z", "X"):
        return False, None
    try:
        status = int(fields[49])  # field 52, exit_code (Linux >= 3.5)
    except (IndexError, ValueError):
        return True, None
    return True, (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _silent(ch, r: int) -> bool:
    """The rank left neither a result nor an error record."""
    return not os.path.exists(ch.path("result", r)) and ch.read_error(r) is None


def _children_now() -> set:
    import psutil

    try:
        return {c.pid for c in psutil.Process().children(recursive=True)}
    except psutil.NoSuchProcess:  # pragma: no cover
        return set()


def child_subreaper(on: bool) -> bool | None:
    """Make this process the child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``) or stop being one.

    While a launch runs, a process its ranks started whose parent dies (a killed rank's child, a
    daemon that double-forked and called setsid) is re-parented to this process instead of to init,
    so it stays a descendant: the cleanup after the launch finds and stops every process the
    launch started, not only those still hanging below a living rank. Returns the previous setting,
    or None where the call is unavailable (not Linux), where only descendants are found."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prev = ctypes.c_int(0)
        if libc.prctl(37, ctypes.byref(prev), 0, 0, 0) != 0:  # PR_GET_CHILD_SUBREAPER
            return None
        if libc.prctl(36, 1 if on else 0, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
            return None
        return bool(prev.value)
    except (OSError, AttributeError):
        return None


def _reap_new_children(before: set) -> None:
    """Kill any descendant of this process that appeared during the launch and is still alive
    (with ``child_subreaper`` set, that includes orphans the ranks left behind)."""
    import psutil

    extra = [pid for pid in _children_now() - before]
    if not extra:
        return
    _kill_tree(extra)
    for pid in extra:  # reap zombies so they don't linger in the kernel's process table
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        except OSError:
            pass
    del psutil


def _validate(fn, num_processes, timeout, stall_timeout, device, threads_per_rank, num_nodes, node_rank):
    from .hardware import cpu_cores, gpu_count

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
    n_gpu = gpu_count()
    if device == "auto":
        device = "cuda" if n_gpu else "cpu"
    if device == "cuda":
        if n_gpu == 0:
            raise ConfigError("device='cuda' but no CUDA GPU is visible; use device='cpu' or 'auto'")
        if num_processes > n_gpu:
            raise ConfigError(
                f"num_processes={num_processes} but NCCL needs one GPU per rank and this machine has {n_gpu}; "
                f"use num_processes <= {n_gpu}, or device='cpu' to run gloo ranks on CPU cores")
    else:
        cores = cpu_cores()
        if num_processes > cores:
            raise ConfigError(
                f"num_processes={num_processes} but this machine has {cores} CPU core(s) and each gloo rank "
                f"needs one; use num_processes <= {cores}")
    return device


def launch(fn, *args, num_processes: int = 2, timeout: float | None = None, stall_timeout: float | None = 30.0,
           device: str = "auto", threads_per_rank: int | None = None, num_nodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", master_port: int | None = None, mixed_precision: str = "no",
           on_progress=None, echo: bool = True, distributed: bool = True, env: dict | None = None,
           **kwargs) -> list:
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

    Raises ConfigError before anything starts for bad arguments; LaunchError when a rank
    fails, stalls or the timeout passes (other ranks are stopped, no process is left).
    """
    global _LAST
    device = _validate(fn, num_processes, timeout, stall_timeout, device, threads_per_rank, num_nodes, node_rank)
    check_fork_safe()
    if num_nodes == 1 and master_port is None and master_addr not in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError("master_addr other than localhost only makes sense with num_nodes > 1")
    if num_nodes > 1 and master_port is None:
        raise ConfigError("multi-node launches need an agreed master_port on every node; pass master_port=...")
    if not _LAUNCH_LOCK.acquire(blocking=False):
        raise LaunchError("another stnb.launch is already running in this process; wait for it to finish "
                          "(one launch at a time per kernel)", kind="busy")
    try:
        return _launch_locked(fn, args, kwargs, num_processes, timeout, stall_timeout, device,
                              threads_per_rank, num_nodes, node_rank, master_addr, master_port,
                              mixed_precision, on_progress, echo, distributed, dict(env or {}))
    finally:
        _LAUNCH_LOCK.release()


def _launch_locked(fn, args, kwargs, nproc, timeout, stall_timeout, device, threads_per_rank, num_nodes,
                   node_rank, master_addr, master_port, mixed_precision, on_progress, echo, distributed, env):
    global _LAST
    from .hardware import backend_for, cpu_cores

    backend = backend_for(device)
    if master_port is not None and num_nodes == 1 and _port_in_use(master_addr, master_port):
        raise ConfigError(f"master_port={master_port} is already in use on {master_addr} (another launch, a "
                          "Jupyter server or some other program holds it); leave master_port=None and stnb "
                          "picks a free port, or choose another port")
    port = master_port or free_port(master_addr)
    threads = threads_per_rank or max(1, cpu_cores() // nproc)
    world_size = nproc * num_nodes
    t0 = time.time()
    ch = _Channel(nproc)
    opts = _Options(fn=fn, args=args, kwargs=kwargs, device=device, backend=backend, threads=threads,
                    nproc=nproc, world_size=world_size, launch_time=t0,
                    init_distributed=distributed or world_size > 1, env=env, stall_timeout=stall_timeout)
    info = LaunchInfo(num_processes=nproc, port=port, device=device, backend=backend, start_time=t0)
    _LAST = info
    before = _children_now()
    watchdog = _Watchdog(ch, nproc, timeout, stall_timeout, on_progress, echo)
    watchdog.rank_offset = node_rank * nproc  # output is prefixed with global ranks
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    failure: BaseException | None = None
    interrupted = False
    # gloo on loopback when every rank is on this machine (one node, or "nodes" on localhost)
    local_only = num_nodes == 1 or master_addr in ("127.0.0.1", "localhost", "::1")
    env = {"STNB_LAUNCH": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo" if local_only else "")}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if v})
    quiet = _QuietElasticLogs()
    # Collect this process's garbage now and freeze the rest until the launch returns: a forked
    # rank must never run destructors of objects it inherited (e.g. torchelastic's TCPStore left
    # in a reference cycle by an earlier failed launch); that crashed ranks with SIGSEGV.
    gc.collect()
    gc.freeze()
    _release_openmp_threads()
    was_subreaper = child_subreaper(True)  # orphans of the ranks come back to this process
    watchdog.start()
    try:
        quiet.__enter__()
        if nproc == 1:
            # notebook_launcher runs a 1-process "launch" inside this process (the kernel) even
            # with num_nodes > 1; fork the rank here instead, as global rank node_rank
            _run_single(ch, opts, master_addr, port, rank=node_rank)
        else:
            if echo:
                print(f"stnb: launching {nproc} rank(s) on {device} ({backend}), {master_addr}:{port}", flush=True)
            # never notebook_launcher itself: in Colab it runs the function inside the kernel
            start_ranks(_entry(ch, opts), nproc, master_addr=master_addr, port=port, node_rank=node_rank,
                        num_nodes=num_nodes, mixed_precision=mixed_precision)
    except KeyboardInterrupt:
        interrupted = True
    except Exception as e:  # ChildFailedError, SignalException, RuntimeError from the launcher...
        if _is_sigint(e):
            interrupted = True
        else:
            failure = e
    finally:
        watchdog.returned_at = time.time()
        gc.unfreeze()
        quiet.__exit__()
        for s, h in saved.items():
            try:
                signal.signal(s, h)
            except (ValueError, TypeError):  # not main thread / None handler
                pass
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        watchdog.kill_ranks()
        _reap_new_children(before)
        if was_subreaper is False:
            child_subreaper(False)
        watchdog.finish()
        info.logs = dict(watchdog.logs)
        info.wall_time_s = time.time() - t0
    try:
        if interrupted:
            info.error = "interrupted"
            raise KeyboardInterrupt("stnb.launch interrupted; all ranks were stopped")
        err = _launch_error(ch, watchdog, failure, nproc, node_rank)
        if err is not None:
            info.error = str(err)
            raise err
        results = []
        for r in range(nproc):
            try:
                with open(ch.path("result", r), "rb") as f:
                    results.append(pickle.load(f))
            except FileNotFoundError:
                raise LaunchError(
                    f"rank {node_rank * nproc + r} exited without returning a result (did the function call "
                    "sys.exit()/os._exit(), or was the process ended from outside?)",
                    rank=node_rank * nproc + r, ranks=[node_rank * nproc + r], kind="exited",
                    logs=info.logs) from None
        return results
    finally:
        ch.cleanup()


def _entry(ch, opts):
    """The function handed to the elastic launcher (which calls it with no arguments)."""

    def stnb_rank(*_ignored):
        _rank_main(ch, opts)

    stnb_rank.__name__ = f"stnb_rank[{getattr(opts.fn, '__name__', 'fn')}]"
    return stnb_rank


class _QuietElasticLogs:
    """torchelastic logs each rank failure at length in the parent; stnb reports it once, as
    LaunchError with the failing rank's traceback, so its loggers are muted during a launch."""

    NAMES = ("torch.distributed.elastic", "torch.multiprocessing.spawn", "torch.distributed.launcher")

    def __enter__(self):
        import logging

        try:  # create the loggers now, so the ones below exist before they are muted
            import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401
            import torch.distributed.launcher.api  # noqa: F401
        except Exception:  # pragma: no cover
            pass
        # torchelastic gives every module its own logger with its own level (LOGLEVEL), so
        # muting the parent is not enough: mute every existing logger below these names
        names = [n for n in list(logging.Logger.manager.loggerDict)
                 if any(n == p or n.startswith(p + ".") for p in self.NAMES)]
        names = sorted(set(names) | set(self.NAMES))
        self._levels = {n: logging.getLogger(n).level for n in names}
        for n in names:
            logging.getLogger(n).setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        import logging

        for n, lvl in getattr(self, "_levels", {}).items():
            logging.getLogger(n).setLevel(lvl)


def _run_single(ch, opts, master_addr, port, rank: int = 0) -> None:
    """One rank on this node: fork it ourselves (notebook_launcher would run it inside the kernel).

    With several nodes (one process each) it is global rank ``rank`` (= node_rank) of
    ``opts.world_size``."""
    env = {}
    if opts.init_distributed:
        env = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(opts.world_size),
               "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
               "MASTER_ADDR": master_addr, "MASTER_PORT": str(port)}

    def target():
        os.environ.update(env)
        try:
            _rank_main(ch, opts)
        except BaseException:
            os._exit(1)
        os._exit(0)

    proc = multiprocessing.get_context("fork").Process(target=target, name="stnb-rank-0")
    proc.start()
    while proc.is_alive():
        proc.join(0.1)
    if proc.exitcode != 0:
        raise _SingleFailed(proc.exitcode)


class _SingleFailed(Exception):
    def __init__(self, exitcode):
        self.exitcode = exitcode
        super().__init__(f"rank 0 exited with code {exitcode}")


def _is_sigint(e: BaseException) -> bool:
    sigval = getattr(e, "sigval", None)
    return sigval in (signal.SIGINT, int(signal.SIGINT))


def _exit_codes(failure) -> dict:
    """{local_rank: exitcode} from torchelastic's ChildFailedError or our single-rank failure."""
    if isinstance(failure, _SingleFailed):
        return {0: failure.exitcode}
    out = {}
    cause = failure
    while cause is not None:
        failures = getattr(cause, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                lr = getattr(f, "local_rank", None)
                if lr is not None:
                    out[lr] = getattr(f, "exitcode", None)
            break
        cause = cause.__cause__ or cause.__context__
    return out


def _launch_error(ch, watchdog, failure, nproc, node_rank) -> LaunchError | None:
    logs = dict(watchdog.logs)
    base = node_rank * nproc
    if watchdog.reason == "timeout":
        ranks = [base + r for r in range(nproc)]
        return LaunchError(f"launch timed out after {watchdog.timeout:g} s; all {nproc} ranks were stopped. "
                           "Raise timeout=... or make the run shorter.", ranks=ranks, kind="timeout",
                           rank_traceback=_format_stacks(watchdog.stacks, base), logs=logs)
    if watchdog.reason == "not started":
        ranks = [base + r for r in watchdog.stalled]
        return LaunchError(
            f"rank(s) {', '.join(map(str, ranks))} did not start within {max(watchdog.stall_timeout, 60.0):g} s "
            "after the fork; all ranks were stopped. This usually means the process forked while another "
            "thread held a lock; run the launch again, and report it if it repeats.",
            ranks=ranks, kind="stalled", rank_traceback=_format_stacks(watchdog.stacks, base), logs=logs)
    errors = [e for e in (ch.read_error(r) for r in range(nproc)) if e is not None]
    collateral = ("KeyboardInterrupt", "SystemExit", "SignalException")
    real = [e for e in errors if e["type"] not in collateral]
    first = origin(real)  # the earliest error that is not a consequence of another rank's failure
    if watchdog.reason == "stalled" and first is not None and not is_secondary(first):
        # the rank that raised never exited (e.g. blocked tearing NCCL down), so its peers waited for it
        stalled = [base + r for r in watchdog.stalled]
        return LaunchError(
            f"rank {first['rank']} raised {first['type']}: {first['message']} (rank(s) {', '.join(map(str, stalled))} "
            f"then waited for it with no progress for {watchdog.stall_timeout:g} s and all ranks were stopped)",
            rank=first["rank"], ranks=sorted({first["rank"], *stalled}), kind="raised",
            rank_traceback=(f"--- traceback of rank {first['rank']} ---\n{first['traceback']}\n"
                            + _format_stacks(watchdog.stacks, base)), logs=logs)
    if watchdog.reason == "stalled":
        ranks = [base + r for r in watchdog.stalled]
        return LaunchError(
            f"rank(s) {', '.join(map(str, ranks))} stalled: no progress for {watchdog.stall_timeout:g} s "
            "(e.g. waiting in a collective another rank never entered). All ranks were stopped; each "
            "rank's stack at the time of the stall follows. Raise stall_timeout=... (or None) if the work "
            "is legitimately long, or call stnb.heartbeat() in long loops.",
            rank=ranks[0] if len(ranks) == 1 else None, ranks=ranks, kind="stalled",
            rank_traceback=_format_stacks(watchdog.stacks, base), logs=logs)
    codes = _exit_codes(failure) if failure is not None else {}
    # A rank that ended without a result or an error record (SIGKILL, os._exit) is the cause of
    # what the others then report ("Connection closed by peer", SignalException): blame it.
    returned = watchdog.returned_at or time.time()
    silent = {}
    for r, (t, code) in watchdog.ended.items():
        if t <= returned and (first is None or t <= first["time"] + 1.0) and _silent(ch, r):
            silent[r] = code
    for r, code in codes.items():
        # (a rank killed by a signal after another rank's own error is a consequence: NCCL's watchdog
        # aborts the process of a peer left waiting)
        if code not in (0, None) and _silent(ch, r) and (r in silent or first is None
                                                         or (code < 0 and is_secondary(first))):
            silent[r] = code if silent.get(r) is None else silent[r]
    if first is not None and not silent and is_secondary(first):
        # the rank that raised says its peer went away; the peer that left no trace is the cause
        silent = {r: codes.get(r) for r in range(nproc) if _silent(ch, r) and ch.get(r, _PID) > 0}
    if watchdog.reason == "exited" or silent:
        # the watchdog stopped the launch for the ranks it saw end silently; the others it killed itself
        cause = watchdog.stalled if watchdog.reason == "exited" else (silent or watchdog.stalled)
        r = min(cause, key=lambda x: (silent.get(x) is None, x))
        code = silent.get(r, codes.get(r))
        if code is None and r in silent:
            why = ("ended without returning a result or raising an exception (killed from outside, e.g. "
                   "SIGKILL or the out-of-memory killer - try a smaller batch size - or os._exit())")
            kind = "killed"
        elif code is None or code >= 0:
            why = (f"exited (exit code {code if code is not None else 'unknown'}) without returning a result "
                   "or raising an exception (did the function call os._exit()/sys.exit(), or did a library "
                   "end the process?)")
            kind = "exited"
        else:
            why = f"was killed by {_signame(-code)}"
            if -code == signal.SIGKILL:
                why += " (from outside, or by the out-of-memory killer: try a smaller batch size)"
            kind = "killed"
        also = ""
        if first is not None:
            also = (f" Rank {first['rank']} then raised {first['type']}: "
                    f"{first['message'].splitlines()[0] if first['message'] else ''} (a consequence).")
        log_tail = "\n".join(logs.get(r, "").splitlines()[-20:])
        tb = f"--- last output of rank {base + r} ---\n{log_tail}" if log_tail else ""
        if first is not None:
            tb += f"\n--- traceback of rank {first['rank']} ---\n{first['traceback']}"
        ranks = sorted({base + x for x in silent} | {base + x for x in watchdog.stalled})
        return LaunchError(f"rank {base + r} {why}; the other ranks were stopped.{also}", rank=base + r,
                           ranks=ranks, kind=kind, rank_traceback=tb.strip(), logs=logs)
    failed = {e["local_rank"] for e in real}
    absent = [r for r in range(nproc) if r not in failed and not os.path.exists(ch.path("result", r))]
    if real and is_secondary(first) and absent:
        # a peer gave up waiting in a collective (NCCL's watchdog timeout...) for ranks that never joined it
        tails = "\n".join(f"--- last output of rank {base + r} ---\n" + "\n".join(logs.get(r, "").splitlines()[-20:])
                          for r in absent)
        names = ", ".join(str(base + r) for r in absent)
        return LaunchError(
            f"rank(s) {names} never joined the collective rank {first['rank']} waited in: rank {first['rank']} "
            f"raised {first['type']}: {first['message'].splitlines()[0] if first['message'] else ''} (a "
            f"consequence). Rank(s) {names} were busy elsewhere or hung and were stopped; their last output "
            "follows.", rank=base + absent[0] if len(absent) == 1 else None,
            ranks=sorted({base + r for r in absent} | {first["rank"]}), kind="stalled",
            rank_traceback=f"{tails}\n--- traceback of rank {first['rank']} ---\n{first['traceback']}", logs=logs)
    if real:
        others = sorted({e["rank"] for e in real} - {first["rank"]})
        also = f" (rank(s) {', '.join(map(str, others))} failed too)" if others else ""
        return LaunchError(f"rank {first['rank']} raised {first['type']}: {first['message']}{also}",
                           rank=first["rank"], ranks=sorted({e["rank"] for e in real}), kind="raised",
                           rank_traceback=f"--- traceback of rank {first['rank']} ---\n{first['traceback']}",
                           logs=logs)
    bad = {r: c for r, c in codes.items() if c not in (0, None)}
    exits = [e for e in errors if e["type"] == "SystemExit" and (failure is None or e["local_rank"] in bad)]
    if exits:  # sys.exit() in a rank: it raised SystemExit instead of returning
        e = min(exits, key=lambda x: x["time"])
        return LaunchError(f"rank {e['rank']} raised SystemExit: {e['message']} (sys.exit() ends a rank without a "
                           "result; return a value from the function instead)", rank=e["rank"],
                           ranks=sorted({x["rank"] for x in exits}), kind="exited",
                           rank_traceback=f"--- traceback of rank {e['rank']} ---\n{e['traceback']}", logs=logs)
    if failure is None:
        return None
    if bad:
        r, code = min(bad.items())
        if code is not None and code < 0:
            why = f"was killed by {_signame(-code)}"
            if -code == signal.SIGKILL:
                why += " (from outside, or by the out-of-memory killer: try a smaller batch size)"
        else:
            why = f"exited with code {code} without raising a Python exception"
        log_tail = "\n".join(logs.get(r, "").splitlines()[-20:])
        return LaunchError(f"rank {base + r} {why}; the other ranks were stopped.", rank=base + r,
                           ranks=[base + x for x in sorted(bad)], kind="killed" if (code or 0) < 0 else "exited",
                           rank_traceback=f"--- last output of rank {base + r} ---\n{log_tail}" if log_tail else "",
                           logs=logs)
    if errors:  # only KeyboardInterrupt / SystemExit / SignalException were recorded
        e = min(errors, key=lambda x: x["time"])
        return LaunchError(f"rank {e['rank']} raised {e['type']}: {e['message']}", rank=e["rank"],
                           ranks=sorted({x["rank"] for x in errors}), kind="raised",
                           rank_traceback=f"--- traceback of rank {e['rank']} ---\n{e['traceback']}", logs=logs)
    msg = "".join(traceback.format_exception_only(type(failure), failure)).strip()
    return LaunchError(f"the launch failed before any rank reported an error: {msg}", kind="exited",
                       rank_traceback="".join(traceback.format_exception(failure)), logs=logs)


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _format_stacks(stacks: dict, base: int) -> str:
    parts = []
    for r in sorted(stacks):
        parts.append(f"--- stack of rank {base + r} ---\n{stacks[r].strip() or '(no stack captured)'}")
    return "\n".join(parts)
