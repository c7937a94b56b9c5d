"""Runners: executing one planned item, under the launcher it names. Each goes through stnb's pipeline
(``stnb.launchers.execute``: check, start, ``finish`` merges), with the lab's launchers (``stnblab.launchers``):

stnb            ``stnb.run`` (which launches through ``stnb.launch``)
notebook_launcher   the same ``training.train_rank`` under raw accelerate ``notebook_launcher``, as a
                user would write it (results left in files, output to a log): ``RawNotebookLauncher``
torchrun        the same ``train_rank`` under ``torchrun --standalone`` (a subprocess whose ranks run
                ``python -m stnblab.bench worker``: ``torchrun_worker``, the ``TorchrunRank`` launcher)
concurrent      N independent single-device runs side by side (no communication): ``Concurrent``

``execute`` turns every outcome into a RunResult: ok, not runnable here, or failed with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from stnb.errors import ConfigError, ResultsFileError, StrategyUnavailable
from stnb.files import write_atomic
from stnb.builds import RecipeBuild
from stnb.launchers import Plan
from stnb.launchers import execute as run_plan

from ..launchers import Concurrent, RawNotebookLauncher, TorchrunRank
from ..launchers.logs import tail
from .options import BenchOptions
from .planning import Item


def execute(item: Item, opts: BenchOptions):
    """Run one planned item; returns a RunResult (status ok / not runnable here / failed)."""
    from stnb.results import RunResult

    cfg = item.config
    if item.unavailable:
        return RunResult.unavailable(cfg, item.unavailable)
    if cfg.checkpoint_dir:  # the checkpoints section: a fresh folder each run, removed after (its cost is kept)
        shutil.rmtree(cfg.checkpoint_dir, ignore_errors=True)
    try:
        if item.launcher == "stnb":
            from stnb.runner import run

            res = run(cfg, echo=False)
        elif item.launcher == "notebook_launcher":
            res = run_plan(Plan(cfg, RecipeBuild(), echo=False), RawNotebookLauncher(opts.run_timeout))
        elif item.launcher == "torchrun":
            res = _run_torchrun(cfg, opts.run_timeout)
        elif item.launcher == "concurrent":
            res = run_plan(Plan(cfg, RecipeBuild(), echo=False), Concurrent(opts.run_timeout))
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
    finally:
        if cfg.checkpoint_dir:
            shutil.rmtree(cfg.checkpoint_dir, ignore_errors=True)
    res.config = cfg.to_dict()  # keep the bench tag (merge stores the config it was given)
    if res.status == "ok" and not res.verified:  # its numbers are not a measurement of what was asked
        res.status = "failed"
        res.reason = res.reason or "not verified (no reason recorded)"
    return res


def _run_torchrun(cfg, timeout: float):
    """The same train_rank under ``torchrun --standalone --nproc_per_node=N`` (a subprocess)."""
    from stnb.results import RunResult

    cfg.validate()
    ws = cfg.world_size()
    outdir = tempfile.mkdtemp(prefix="stnb-bench-torchrun-")
    cfg_path, out_path, log = (os.path.join(outdir, n) for n in ("config.json", "result.json", "output.log"))
    with open(cfg_path, "w") as f:
        json.dump(cfg.to_dict(), f)
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("STNB_LAUNCH", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ws}",
           "-m", "stnblab.bench", "worker", cfg_path, "LAUNCH_TIME", out_path]
    try:
        with open(log, "wb") as lf:
            t0 = time.time()
            cmd[cmd.index("LAUNCH_TIME")] = repr(t0)
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise RuntimeError(f"torchrun did not finish within {timeout:g} s; output ends with:\n{tail(log)}")
            wall = time.time() - t0
        if rc != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"torchrun exited with code {rc}; output ends with:\n{tail(log)}")
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
    """``python -m stnblab.bench worker CONFIG.json LAUNCH_TIME OUT.json``: one torchrun rank.

    Runs the plan through stnb's pipeline with the ``TorchrunRank`` launcher (train here, gather to rank 0,
    which merges the RunResult, launcher 'torchrun'); rank 0 writes it to OUT.json and prints it.
    """
    from stnb.config import TrainConfig

    cfg_path, launch_time, out_path = argv
    with open(cfg_path) as f:
        config = TrainConfig.from_dict(json.load(f))
    result = run_plan(Plan(config, RecipeBuild(), echo=False), TorchrunRank(float(launch_time)))
    if int(os.environ.get("RANK", "0")) == 0:
        data = json.dumps(result.to_dict())
        write_atomic(out_path, data)
        print(data, flush=True)
    return 0
