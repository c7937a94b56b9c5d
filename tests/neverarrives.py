"""A user's build function whose module makes rank 1's Python exit before it arrives at the rendezvous, as a node
whose Python cannot start the job would (a broken environment, an interpreter killed while it starts). The cluster
tests use it for a rank that never arrives.

On SLURM, the task with ``SLURM_PROCID`` 1 exits as soon as it imports this module (srun sets the variable before
Python starts; submitit imports the module when it unpickles the job's function, before stnb's rank code runs). A
Ray Train worker imports it before Ray tells it its rank, so there the module makes the worker of rank 1 exit at
the moment stnb's rank code would say it arrived (``RunDir.arrive``, the first thing that code does), once rank 0
has arrived. The test
process imports it without either and goes on.
"""

from __future__ import annotations

import os

EXIT_STATUS = 3


def _in_a_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray._private.worker.global_worker.mode == ray.WORKER_MODE
    except Exception:
        return False


def _exit_instead_of_arriving(rank_that_exits: int = 1) -> None:
    from stnb.launchers import rundir

    arrive = rundir.RunDir.arrive

    def arrive_or_exit(self, rank, **facts):
        if rank == rank_that_exits:
            # once rank 0 has arrived (up to 5 minutes): Ray Train ends the other workers when one exits, and
            # under load it ended rank 0 before rank 0 arrived (seen in CI: "none arrived")
            import time

            deadline = time.time() + 300
            while time.time() < deadline and 0 not in self.arrived(1):
                time.sleep(0.2)
            os._exit(EXIT_STATUS)
        return arrive(self, rank, **facts)

    rundir.RunDir.arrive = arrive_or_exit


if os.environ.get("SLURM_PROCID") == "1":
    os._exit(EXIT_STATUS)
elif _in_a_ray_worker():
    _exit_instead_of_arriving()


def build():
    """Ranks other than 1 get clusterfns' trainer (the tiny model, 3 steps)."""
    import clusterfns

    return clusterfns.build()
