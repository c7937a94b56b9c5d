"""Which rank torch elastic's own "first failure" names, with no stnb in the way (issue 44, item 4's question: could
``stnb/processes/diagnose.py`` give way to ``ChildFailedError.get_first_failure()``?).

Two ranks on gloo; rank 1 fails (raises, or is SIGKILLed) while rank 0 waits for it in an all_reduce, so rank 1 is
the rank to name and rank 0's "Connection closed by peer" is the consequence. Each trial launches through
``elastic_launch`` with ``@record`` (elastic's error files) and prints the rank elastic's first failure names:

    .venv/bin/python tests/elastic_first_failure.py [--trials 3]

A probe, not a test: what it measures is torch's behaviour, which stnb's fault tests do not depend on.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import tempfile
import time

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


@record
def rank_fn(fault: str) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        time.sleep(0.5)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("the real failure")
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    return 0


def trial(start_method: str, fault: str) -> int | None:
    """The local rank elastic's first failure names (None: the launch did not fail)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="probe", rdzv_backend="static",
                          rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0}, max_restarts=0,
                          monitor_interval=0.1, start_method=start_method,
                          logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="elastic-probe-")))
    try:
        elastic_launch(config, rank_fn)(fault)
    except ChildFailedError as e:
        return e.get_first_failure()[0]
    return None


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    a = ap.parse_args()
    for method in ("fork", "spawn"):
        for fault in ("raise", "kill"):
            named = [trial(method, fault) for _ in range(a.trials)]
            right = sum(r == 1 for r in named)
            print(f"{method:5} rank 1 {fault:5}: elastic named the failed rank in {right} of {a.trials} "
                  f"(named: {named})", flush=True)
