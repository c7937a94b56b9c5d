"""The same ``training.train_rank`` under raw accelerate ``notebook_launcher`` (no ``stnb.launch``), as a user
would write it: every rank leaves its RankReport in a file, the output goes to a log."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import time

from stnb.files import write_atomic
from stnb.launchers import Launcher, Plan
from stnb.processes.supervise import children_now, kill_new_children

from .logs import output_to, tail


class RawNotebookLauncher(Launcher):
    """Ranks started by ``accelerate.notebook_launcher`` (launcher 'notebook_launcher'); ``timeout`` seconds
    after the start, the ranks still running are stopped."""

    name = "notebook_launcher"

    def __init__(self, timeout: float):
        self.timeout = timeout

    def check(self, plan: Plan) -> None:
        from stnb.processes import check_fork_safe

        plan.config.validate()
        check_fork_safe()
        plan.build.check_inputs(plan.config)  # stnb's recipe: its model resolved once, its data checked
        plan.device = plan.config.resolved_device()

    def start(self, plan: Plan) -> list:
        from accelerate import notebook_launcher

        from stnb.processes import free_port

        ws = plan.config.world_size()
        outdir = tempfile.mkdtemp(prefix="stnb-bench-raw-")
        log = os.path.join(outdir, "output.log")
        before = children_now()
        # kill only: notebook_launcher still joins its processes (a reaped one breaks that join)
        timer = threading.Timer(self.timeout, kill_new_children, args=(before,), kwargs={"reap": False})
        timer.daemon = True
        try:
            plan.t0 = time.time()
            timer.start()
            with output_to(log):
                notebook_launcher(raw_rank, args=(plan.config, plan.build, plan.t0, outdir), num_processes=ws,
                                  use_port=str(free_port()))
            reports = []
            for r in range(ws):
                p = os.path.join(outdir, f"rank-{r}.pkl")
                if not os.path.exists(p):
                    raise RuntimeError(f"raw notebook_launcher: rank {r} left no result; its output ends with:\n"
                                       f"{tail(log)}")
                with open(p, "rb") as f:
                    reports.append(pickle.load(f))
            return reports
        except Exception as e:
            if not isinstance(e, RuntimeError) or "left no result" not in str(e):
                raise RuntimeError(f"raw notebook_launcher failed ({type(e).__name__}: {e}); output ends with:\n"
                                   f"{tail(log)}") from e
            raise
        finally:
            timer.cancel()
            kill_new_children(before, reap=False)
            shutil.rmtree(outdir, ignore_errors=True)


def raw_rank(cfg, build, launch_time: float, outdir: str) -> None:
    """What a user writes for raw notebook_launcher: train, then leave the result in a file."""
    from stnb.training import train_rank

    res = train_rank(cfg, build, launch_time)
    rank = int(os.environ.get("RANK", "0"))
    write_atomic(os.path.join(outdir, f"rank-{rank}.pkl"), pickle.dumps(res))
