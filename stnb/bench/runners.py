"""Runners: executing one planned item, under the launcher it names.

stnb            ``stnb.run`` (which launches through ``stnb.launch``)
notebook_launcher   the same ``training.train_rank`` under raw accelerate ``notebook_launcher``, as a
                user would write it (results left in files, output to a log)
torchrun        the same ``train_rank`` under ``torchrun --standalone`` (a subprocess whose ranks run
                ``python -m stnb.bench worker``: ``torchrun_worker``)
concurrent      N independent single-device runs side by side (no communication)

``execute`` turns every outcome into a RunResult: ok, not runnable here, or failed with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

from ..errors import ConfigError, ResultsFileError, StrategyUnavailable
from ..launch.supervise import children_now, kill_tree
from ..files import write_atomic
from .options import BenchOptions
from .planning import Item


def execute(item: Item, opts: BenchOptions):
    """Run one planned item; returns a RunResult (status ok / not runnable here / failed)."""
    from ..results import RunResult

    cfg = item.config
    if item.unavailable:
        return RunResult.unavailable(cfg, item.unavailable)
    try:
        if item.launcher == "stnb":
            from ..runner import run

            res = run(cfg, echo=False)
        elif item.launcher == "notebook_launcher":
            res = _run_notebook_launcher(cfg, opts.run_timeout)
        elif item.launcher == "torchrun":
            res = _run_torchrun(cfg, opts.run_timeout)
        elif item.launcher == "concurrent":
            res = _run_concurrent(cfg, opts.run_timeout)
        else:  # pragma: no cover - plan() only makes the four above
            raise ConfigError(f"unknown launcher {item.launcher!r}")
    except StrategyUnavailable as e:
        return RunResult.unavailable(cfg, e.reason)
    except (KeyboardInterrupt, ResultsFileError):
        raise
    except Exception as e:  # noqa: BLE001 - a crashed run is recorded and the sweep goes on
        r = RunResult.unavailable(cfg, "")
        r.status = "failed"
        msg = f"{type(e).__name__}: {e}"
        r.reason = msg if len(msg) <= 6000 else msg[:2000] + "\n[...]\n" + msg[-4000:]
        r.launcher = item.launcher
        return r
    res.config = cfg.to_dict()  # keep the bench tag (merge stores the config it was given)
    if res.status == "ok" and not res.verified:  # its numbers are not a measurement of what was asked
        res.status = "failed"
        res.reason = res.reason or "not verified (no reason recorded)"
    return res


def _model_path(cfg) -> str:
    from ..models import resolve_model

    return resolve_model(cfg.model)


def _raw_rank(cfg, model_path: str, launch_time: float, outdir: str) -> None:
    """What a user writes for raw notebook_launcher: train, then leave the result in a file."""
    from ..builds import RecipeBuild
    from ..training import train_rank

    res = train_rank(cfg, RecipeBuild(model_path), launch_time)
    rank = int(os.environ.get("RANK", "0"))
    write_atomic(os.path.join(outdir, f"rank-{rank}.pkl"), pickle.dumps(res))


@contextlib.contextmanager
def _output_to(path: str):
    """Send this process's (and its forked children's) stdout/stderr to ``path`` for a while."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for x in (fd, *saved):
            os.close(x)


def _tail(path: str, n: int = 25) -> str:
    """The last ``n`` lines of a log, preceded by its first error lines (the cause, not the echo)."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    keys = ("Error", "error:", "Traceback", "terminate called", "what():", "Abort", "Exception")
    first = [ln for ln in lines[:-n] if any(k in ln for k in keys)][:12]
    return "\n".join(first + (["..."] if first else []) + lines[-n:])


def _kill_new_children(before: set) -> None:
    extra = list(children_now() - before)
    if extra:
        kill_tree(extra)


def _run_notebook_launcher(cfg, timeout: float):
    """The same train_rank under raw accelerate notebook_launcher (no stnb.launch)."""
    import threading

    from accelerate import notebook_launcher

    from ..hardware import gpu_count
    from ..launch import check_fork_safe, free_port
    from ..results import merge

    cfg.validate()
    check_fork_safe()
    model_path = _model_path(cfg)
    ws = cfg.world_size()
    outdir = tempfile.mkdtemp(prefix="stnb-bench-raw-")
    log = os.path.join(outdir, "output.log")
    before = children_now()
    timer = threading.Timer(timeout, _kill_new_children, args=(before,))
    timer.daemon = True
    try:
        t0 = time.time()
        timer.start()
        with _output_to(log):
            notebook_launcher(_raw_rank, args=(cfg, model_path, t0, outdir), num_processes=ws,
                              use_port=str(free_port()))
        wall = time.time() - t0
        results = []
        for r in range(ws):
            p = os.path.join(outdir, f"rank-{r}.pkl")
            if not os.path.exists(p):
                raise RuntimeError(f"raw notebook_launcher: rank {r} left no result; its output ends with:\n"
                                   f"{_tail(log)}")
            with open(p, "rb") as f:
                results.append(pickle.load(f))
        return merge(cfg, results, device=cfg.resolved_device(), n_gpu=gpu_count(), wall_time_s=wall,
                     launcher="notebook_launcher")
    except Exception as e:
        if not isinstance(e, RuntimeError) or "left no result" not in str(e):
            raise RuntimeError(f"raw notebook_launcher failed ({type(e).__name__}: {e}); output ends with:\n"
                               f"{_tail(log)}") from e
        raise
    finally:
        timer.cancel()
        _kill_new_children(before)
        import shutil

        shutil.rmtree(outdir, ignore_errors=True)


def _run_torchrun(cfg, timeout: float):
    """The same train_rank under ``torchrun --standalone --nproc_per_node=N`` (a subprocess)."""
    from ..results import RunResult

    cfg.validate()
    model_path = _model_path(cfg)
    ws = cfg.world_size()
    outdir = tempfile.mkdtemp(prefix="stnb-bench-torchrun-")
    cfg_path, out_path, log = (os.path.join(outdir, n) for n in ("config.json", "result.json", "output.log"))
    with open(cfg_path, "w") as f:
        json.dump(cfg.to_dict(), f)
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("STNB_LAUNCH", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ws}",
           "-m", "stnb.bench", "worker", cfg_path, model_path, "LAUNCH_TIME", out_path]
    try:
        with open(log, "wb") as lf:
            t0 = time.time()
            cmd[cmd.index("LAUNCH_TIME")] = repr(t0)
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise RuntimeError(f"torchrun did not finish within {timeout:g} s; output ends with:\n{_tail(log)}")
            wall = time.time() - t0
        if rc != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"torchrun exited with code {rc}; output ends with:\n{_tail(log)}")
        with open(out_path) as f:
            res = RunResult.from_dict(json.load(f))
        res.wall_time_s = wall
        return res
    finally:
        import shutil

        shutil.rmtree(outdir, ignore_errors=True)


def _kill_group(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def torchrun_worker(argv) -> int:
    """``python -m stnb.bench worker CONFIG.json MODEL_PATH LAUNCH_TIME OUT.json``: one torchrun rank.

    Runs training.train_rank, gathers every rank's measurements on rank 0 (all_gather_object),
    which merges them into a RunResult (launcher 'torchrun'), writes it to OUT.json and prints it.
    """
    import torch.distributed as dist

    from ..config import TrainConfig
    from ..hardware import gpu_count
    from ..results import merge
    from ..builds import RecipeBuild
    from ..training import train_rank

    cfg_path, model_path, launch_time, out_path = argv
    with open(cfg_path) as f:
        config = TrainConfig.from_dict(json.load(f))
    launch_time = float(launch_time)
    res = train_rank(config, RecipeBuild(model_path), launch_time)
    gathered = [res]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res)
    if int(os.environ.get("RANK", "0")) == 0:
        gathered.sort(key=lambda d: d.rank)
        result = merge(config, gathered, device=config.resolved_device(), n_gpu=gpu_count(),
                       wall_time_s=time.time() - launch_time, launcher="torchrun")
        data = json.dumps(result.to_dict())
        write_atomic(out_path, data)
        print(data, flush=True)
    if dist.is_initialized():  # (a failing rank exits instead; torchrun then stops the others)
        dist.barrier()  # leave together: no rank tears down its connections while rank 0 merges
        dist.destroy_process_group()
    return 0


def _concurrent_rank(cfg, model_path: str, launch_time: float) -> dict:
    """One of N independent single-device runs started together (no process group while training)."""
    import torch.distributed as dist

    from ..builds import RecipeBuild
    from ..training import train_rank

    if dist.is_initialized():
        dist.barrier()  # start together
        dist.destroy_process_group()
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
              "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    return train_rank(cfg, RecipeBuild(model_path), launch_time)


def _run_concurrent(cfg, timeout: float):
    """N single-device runs at the same time (one per device): the machine's limit with no communication."""
    from ..hardware import cpu_cores, gpu_count
    from ..launch import launch
    from ..results import merge

    cfg.validate()
    n = int(cfg.extra.get("concurrent_runs") or (cpu_cores() if cfg.resolved_device() == "cpu" else gpu_count()))
    model_path = _model_path(cfg)
    t0 = time.time()
    parts = launch(_concurrent_rank, cfg, model_path, t0, num_processes=n, timeout=timeout,
                   stall_timeout=cfg.stall_timeout, device=cfg.resolved_device(),
                   threads_per_rank=cfg.threads_per_rank, echo=False)
    wall = time.time() - t0
    merged = [merge(cfg, [p], device=cfg.resolved_device(), n_gpu=gpu_count(), wall_time_s=wall, launcher="stnb")
              for p in parts]
    res = merged[0]
    res.samples_per_second = sum(m.samples_per_second or 0.0 for m in merged)
    res.world_size = 1
    res.global_batch_size = sum(m.global_batch_size for m in merged)
    res.verification = {"independent_runs": [m.samples_per_second for m in merged],
                        "ranks": [m.verification.get("ranks", [{}])[0] for m in merged]}
    res.verified = all(m.verified for m in merged)
    res.peak_memory_bytes = [m.peak_memory_bytes[0] for m in merged]
    res.peak_memory_run_bytes = [m.peak_memory_run_bytes[0] for m in merged]
    res.launcher = "concurrent"
    return res

