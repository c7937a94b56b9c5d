"""More ranks than cores, to see a layout run (DP+PP on 4 ranks, 3D on 8) on a small machine.

``stnb.launch`` gives every gloo rank a core of its own and refuses more ranks than cores: its
timings mean something. This launcher does not: it starts ``num_processes`` ranks with torchrun
(``python -m torch.distributed.run``), one torch thread each, on however many cores there are. The
results are correct and checked; the timings only say that the ranks took turns on the cores.

Each rank unpickles ``(fn, args)`` from a scratch folder, runs it with torch.distributed initialised
(gloo), and pickles its result there; a failed rank's output is raised in a ``LaunchError``. The
ranks run in their own process group (session), killed as a whole on timeout.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile

from stnb.errors import LaunchError

TAIL = 4000  # characters of a failed run's output in the error


def launch_oversubscribed(fn, *args, num_processes: int, timeout: float = 600, **_ignored) -> list:
    """``fn(*args)`` in ``num_processes`` CPU gloo ranks whatever the core count; their results by rank.
    (Keyword arguments of ``stnb.launch`` such as ``device`` or ``echo`` are accepted and have no effect.)"""
    with tempfile.TemporaryDirectory(prefix="stnb-oversubscribed-") as work:
        with open(os.path.join(work, "call.pkl"), "wb") as f:
            pickle.dump((fn, args), f)
        # --standalone: torchrun's rendezvous store binds a port the OS picks as it binds (localhost:0), so
        # no other process can take it first, as one could a port found free a moment before
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_processes}",
               "-m", __name__, work]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            output = _stop(proc)
            raise LaunchError(f"{num_processes} oversubscribed ranks did not finish in {timeout} s:\n"
                              f"{output[-TAIL:]}") from None
        if proc.returncode != 0:
            raise LaunchError(f"{num_processes} oversubscribed ranks failed (torchrun exit {proc.returncode}):\n"
                              f"{output[-TAIL:]}")
        results = []
        for rank in range(num_processes):
            with open(os.path.join(work, f"result.{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _stop(proc, grace: float = 30.0) -> str:
    """Stop torchrun and its ranks; what they printed. torchrun starts each rank in a session of its own, so a
    SIGKILL to torchrun's group would leave the ranks running (and holding the output pipe open: reading it
    would never end). SIGTERM lets torchrun stop them first; SIGKILL only after ``grace`` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=grace)[0] or ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            return proc.communicate(timeout=10)[0] or ""
        except subprocess.TimeoutExpired:  # a rank outlived torchrun: stop reading its output
            proc.stdout.close()
            proc.wait()
            return ""


def _rank(work: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    with open(os.path.join(work, "call.pkl"), "rb") as f:
        fn, args = pickle.load(f)
    result = fn(*args)
    tmp = os.path.join(work, f"result.{dist.get_rank()}.pkl.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, tmp[:-4])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank(sys.argv[1])
