"""Functions the launch / fault / kernel tests run inside ranks.

They live in an importable module (not in test closures) so they work with any start
method and read like the teaching code in ``stnb`` itself. Every function that provokes a
fault first writes the wall-clock time of the fault to ``mark`` (a file path) when given,
so a test can measure "time from the fault to the error".
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _mark(mark: str | None) -> None:
    if mark:
        tmp = f"{mark}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(repr(time.time()))
        os.replace(tmp, mark)


def _pid(mark: str | None) -> None:
    """Every rank leaves its pid next to the mark, so a test can check the process is gone."""
    if mark:
        with open(f"{mark}.pid{_rank()}", "w") as f:
            f.write(str(os.getpid()))


def rank_pids(mark: str) -> list:
    """The pids the ranks of the last launch (and processes they started) left next to ``mark``,
    written while they ran: the set a cleanup check compares with, collected before any kill."""
    import glob

    return [int(open(p).read()) for p in sorted(glob.glob(f"{glob.escape(mark)}.pid*"))]


def _idle(seconds: float) -> None:
    """Sleep in small steps, heartbeating, so the stall watchdog never fires on an idle rank."""
    import stnb

    end = time.time() + seconds
    while time.time() < end:
        stnb.heartbeat()
        time.sleep(0.05)


# ---- healthy ranks ------------------------------------------------------------------------

def collect_garbage() -> int:
    """Run this rank's garbage collector over everything it holds; returns the rank's pid."""
    import gc

    gc.collect()
    return os.getpid()


def inherited_modules(*names: str) -> dict:
    """Which of ``names`` this rank holds before it has imported anything itself, and its pid."""
    return {"pid": os.getpid(), "held": {n: n in sys.modules for n in names}}


def read_env(names) -> dict:
    """The values of environment variables ``names`` in this rank (None: unset)."""
    return {k: os.environ.get(k) for k in names}


def info(tag: str = "ok") -> dict:
    """What a rank sees: its rank, the world, an all_reduce over every rank, its pid."""
    import torch
    import torch.distributed as dist

    import stnb

    ctx = stnb.rank_context()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # sum of 1..N when every rank takes part
    gathered = [None] * world
    dist.all_gather_object(gathered, os.getpid())
    return {"tag": tag, "rank": rank, "world_size": world, "initialized": dist.is_initialized(),
            "backend": dist.get_backend(), "all_reduce": t.item(), "pid": os.getpid(), "ppid": os.getppid(),
            "pids": gathered, "ctx_rank": ctx.rank if ctx else None,
            "master_port": os.environ.get("MASTER_PORT")}


def rank_value(scale: int = 10) -> int:
    """Returns something different per rank (and after a short rank-dependent delay, so a
    launcher that collected results in completion order would be caught)."""
    r = _rank()
    time.sleep(0.3 * (1 - min(r, 1)))  # rank 0 finishes last
    return r * scale


def report_own_step(total: int = 50) -> int:
    """Each rank reports a step, total and loss of its own (rank r: step 3 + 4r, loss r + 0.25), so
    the parent's per-rank progress shows whether it reads every rank's row or one rank's for all."""
    import stnb

    r = _rank()
    stnb.report_progress(3 + 4 * r, total + r, r + 0.25)
    _idle(0.8)  # long enough for the watchdog's twice-a-second on_progress call while running
    return r


def sleep_then_return(seconds: float = 3.0) -> int:
    _idle(seconds)
    return _rank()


def sleep_long(seconds: float = 120.0) -> int:
    """A long, healthy-looking run (heartbeats) for interrupt / timeout / busy tests."""
    print(f"rank {_rank()} sleeping {seconds} s", flush=True)
    _idle(seconds)
    return _rank()


def sleep_silent(seconds: float = 120.0, mark: str | None = None) -> int:
    """A long run whose stack does move (a Python loop) but which never heartbeats."""
    _pid(mark)
    _mark(mark)
    end = time.time() + seconds
    n = 0
    while time.time() < end:
        n += 1
        time.sleep(0.01)
    return n


def sleep_silent_then_rank(seconds: float = 3.0, mark: str | None = None) -> int:
    """Marks that it runs, works (a moving Python loop) for ``seconds``, returns its rank."""
    sleep_silent(seconds, mark)
    return _rank()


def spam(lines: int = 400, width: int = 60) -> int:
    """Print many lines as fast as possible, stdout and stderr, with partial writes."""
    r = _rank()
    body = ("x" * width)
    for i in range(lines):
        stream = sys.stdout if i % 2 == 0 else sys.stderr
        # write in pieces so a per-write relay would split the line
        stream.write(f"spam r{r} i{i:04d} ")
        stream.write(body)
        stream.write(f" end r{r} i{i:04d}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, f"spam r{r} c-level line end r{r}\n".encode())  # C-level write to fd 1
    return lines


def chatty(lines: int = 200) -> dict:
    """A notebook-style rank: prints a lot, shows tqdm.auto bars, builds an ipywidgets widget."""
    import ipywidgets
    from tqdm.auto import tqdm, trange

    r = _rank()
    for i in range(lines):
        print(f"chatty r{r} line {i:04d} " + "y" * 40)
    for _ in tqdm(range(50), desc=f"bar r{r}", mininterval=0):
        time.sleep(0.002)
    for _ in trange(20, desc=f"trange r{r}", mininterval=0):
        pass
    w = ipywidgets.IntProgress(value=3, max=10, description=f"r{r}")
    try:
        from IPython.display import display

        display(w)  # must not reach the kernel's sockets from a fork
    except Exception as e:  # pragma: no cover - display is optional here
        print(f"display failed: {e!r}")
    print(f"chatty r{r} done", flush=True)
    return {"rank": r, "widget_value": w.value, "tqdm_class": tqdm.__module__}


# ---- faults -------------------------------------------------------------------------------

def _strike(bad_rank: int, mark: str | None, fault, announce: str | None = None) -> int:
    """The start every fault function shares: note this rank's pid, and in ``bad_rank`` wait a moment,
    say ``announce``, mark the time and call ``fault(rank)``. Returns this rank (for the others)."""
    r = _rank()
    _pid(mark)
    if r == bad_rank:
        time.sleep(0.5)
        if announce:
            print(f"rank {r} {announce}", flush=True)
        _mark(mark)
        fault(r)
    return r


def raise_on(bad_rank: int = 1, mark: str | None = None, others_sleep: float = 120.0) -> int:
    """``bad_rank`` raises after a short delay; the others would run for minutes."""
    r = _strike(bad_rank, mark, _fail_here, "about to fail")
    _idle(others_sleep)
    return r


def _fail_here(r: int):
    raise ValueError(f"deliberate failure in rank {r}")


def _sigkill_self(r: int):
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_silently(r: int):
    os._exit(0)


def sigkill_on(bad_rank: int = 1, mark: str | None = None, others_sleep: float = 120.0) -> int:
    r = _strike(bad_rank, mark, _sigkill_self, "about to be SIGKILLed")
    _idle(others_sleep)
    return r


def exit_without_return(bad_rank: int = 1, mark: str | None = None, others_sleep: float = 0.0) -> int:
    """``bad_rank`` leaves with os._exit(0): a clean exit code but no result."""
    r = _strike(bad_rank, mark, _exit_silently)
    _idle(others_sleep)
    return r


def exit_then_collective(bad_rank: int = 1, mark: str | None = None) -> int:
    """``bad_rank`` leaves with os._exit(0) while the others wait for it in a collective."""
    import torch.distributed as dist

    r = _strike(bad_rank, mark, _exit_silently)
    dist.barrier()
    return r


def hang_in_collective(mark: str | None = None) -> int:
    """Rank 0 waits in all_reduce for a rank that waits in a barrier: a classic mismatch."""
    import torch
    import torch.distributed as dist

    r = _rank()
    _pid(mark)
    _mark(mark)
    if r == 0:
        t = torch.ones(4)
        dist.all_reduce(t)  # HANG-HERE-ALLREDUCE
    else:
        dist.barrier()  # HANG-HERE-BARRIER
    return r


def hang_forever(mark: str | None = None) -> int:
    """Every rank blocks in one C call (its Python stack never moves)."""
    _pid(mark)
    _mark(mark)
    time.sleep(3600)  # HANG-HERE-SLEEP
    return _rank()


def unpicklable():
    return lambda: None


def sys_exit_on(bad_rank: int = 1, code=0, mark: str | None = None) -> int:
    """``bad_rank`` calls sys.exit(code) (SystemExit, a BaseException) instead of returning."""
    return _strike(bad_rank, mark, lambda r: sys.exit(code))


def _sleeping_child(pid_file: str, daemon: bool) -> int:
    """Fork a process that records its pid in ``pid_file`` and sleeps for an hour. ``daemon``: the
    classic double fork (fork, setsid, fork, the middle process exits), so the sleeper is re-parented
    at once and sits in a session of its own, out of the rank's process group."""
    child = os.fork()
    if child == 0:
        try:
            if daemon:
                os.setsid()
                if os.fork() != 0:
                    os._exit(0)
            with open(pid_file + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pid_file + ".tmp", pid_file)
            time.sleep(3600)
        finally:
            os._exit(0)
    if daemon:
        os.waitpid(child, 0)  # the middle process exits at once
    end = time.time() + 30
    while not os.path.exists(pid_file) and time.time() < end:
        time.sleep(0.01)
    return child


def children_then_sigkill(bad_rank: int = 1, mark: str | None = None, others_sleep: float = 120.0) -> int:
    """``bad_rank`` starts a sleeping child and a double-forked sleeping daemon, records their pids
    next to the mark (``rank_pids`` lists them with the ranks'), and is then SIGKILLed."""

    def start_then_die(r):
        _sleeping_child(f"{mark}.pid-child{r}", daemon=False)
        _sleeping_child(f"{mark}.pid-daemon{r}", daemon=True)
        _sigkill_self(r)

    r = _strike(bad_rank, mark, start_then_die, "starts two processes, then is SIGKILLed")
    _idle(others_sleep)
    return r


def sigkill_in_collective(bad_rank: int = 1, mark: str | None = None) -> int:
    """``bad_rank`` is SIGKILLed while the other ranks wait for it in an all_reduce."""
    import torch
    import torch.distributed as dist

    r = _strike(bad_rank, mark, _sigkill_self)
    t = torch.ones(2)
    dist.all_reduce(t)
    return r


def torch_work(n: int = 20) -> float:
    """Parallel CPU kernels (OpenMP) in the rank, e.g. after the parent ran some itself."""
    import torch

    x = torch.randn(256, 4096)
    s = 0.0
    for _ in range(n):
        s += float(torch.nn.functional.layer_norm(x, (4096,)).sum())
    return s


def embedding_rows_exactness(bucket_cap_mb: float = 25.0, view: bool = False, accumulate: int = 1) -> dict:
    """DDP on a toy model with a big embedding, once with DDP's default all-reduce and once with
    stnb.embedding_rows_hook's hook, from the same weights and the same per-rank token ids. The ranks touch
    overlapping and disjoint rows. Returns both final parameter sets (as lists) and the hook's stats."""
    import torch
    import torch.distributed as dist

    from stnb import embedding_rows_hook

    torch.manual_seed(0)
    rank = dist.get_rank()

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.words = torch.nn.Embedding(5000, 32, padding_idx=0)
            self.pos = torch.nn.Embedding(16, 32)
            self.mix = torch.nn.Linear(32, 32)
            self.out = torch.nn.Linear(32, 1)

        def forward(self, ids):
            h = self.words(ids) + self.pos(torch.arange(ids.shape[1]))
            return self.out(torch.tanh(self.mix(h))).mean()

    start = Toy().state_dict()
    finals, stats = {}, None
    for mode in ("default", "rows"):
        model = Toy()
        model.load_state_dict(start)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb,
                                                        gradient_as_bucket_view=view)
        state = embedding_rows_hook.register(ddp) if mode == "rows" else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(3):
            for micro in range(accumulate):
                # rank 0 uses ids < 3000, rank 1 ids >= 2000: shared and private rows; 0 is padding
                lo = 0 if rank == 0 else 2000
                ids = torch.randint(lo, lo + 3000, (4, 16), generator=g)
                ids[:, -2:] = 0
                last = micro == accumulate - 1
                if last:
                    ddp(ids).backward()
                else:
                    with ddp.no_sync():
                        ddp(ids).backward()
            opt.step()
            opt.zero_grad(set_to_none=not view)
        finals[mode] = {k: v.detach().clone().tolist() for k, v in model.state_dict().items()}
        if state is not None:
            stats = state.stats()
    return {"default": finals["default"], "rows": finals["rows"], "stats": stats}


def harmless_and_other_warnings() -> int:
    """The known-harmless warnings of a CPU run from their real sources (torch's DataLoader with
    pin_memory; the messages sentence-transformers and transformers log, from their own loggers), and
    ones that are not harmless, which must still print (stnb.processes.output.quiet_known_harmless)."""
    import logging
    import warnings

    import torch

    list(torch.utils.data.DataLoader(list(range(4)), batch_size=2, pin_memory=True))
    logging.getLogger("sentence_transformers.base.training_args").warning(
        "When using DistributedDataParallel (DDP), it is recommended to set `dataloader_drop_last=True` to "
        "avoid hanging issues with an uneven last batch. Setting `dataloader_drop_last=True`.")
    head = ("\x1b[1mBertForSequenceClassification LOAD REPORT\x1b[0m from: model\nKey               | Status  | \n"
            "------------------+---------+-\nclassifier.weight | MISSING | \nclassifier.bias   | MISSING | \n")
    transformers_log = logging.getLogger("transformers.modeling_utils")
    transformers_log.warning(head)
    transformers_log.warning(head.replace("BertForSequenceClassification", "OtherModel")
                             + "encoder.layer.0.weight | UNEXPECTED | \n")
    warnings.warn("a warning stnb knows nothing about", UserWarning)
    logging.getLogger("sentence_transformers.base.training_args").warning("another note of theirs")
    return _rank()


def draws_a_bar(steps: int = 3) -> int:
    """Draws a tqdm bar (as a trainer, a dataset map or a model card does) and returns the steps it counted."""
    from tqdm import tqdm

    return sum(1 for _ in tqdm(range(steps)))
