"""Leaving the notebook: the same run under torchrun / accelerate launch, on one node or many.

A notebook run (``stnb.run``) starts its own ranks with ``stnb.launch``. When a job outgrows
one machine, the same training is started by an outside launcher instead, and stnb notices:

* ``python -m stnb run ...`` (or a script calling ``stnb.run``) started by
  ``torchrun --nproc_per_node=N`` or ``accelerate launch --multi_gpu --num_processes N``
  finds WORLD_SIZE / RANK / LOCAL_RANK in its environment (and not STNB_LAUNCH=1, which
  ``stnb.launch`` sets in its own ranks), so it does not launch again: ``stnb.run`` picks the
  ``External`` launcher (``stnb.launchers.external``), which runs ``training.train_rank`` in this
  process, gathers every rank's measurements to rank 0 (``dist.all_gather_object``) and merges
  them into the same RunResult a notebook run gives, with ``launcher='torchrun'`` or ``'accelerate'``.
  (``accelerate launch --cpu --num_processes N`` starts only ONE process unless given an MPI
  hostfile; stnb then starts the ranks itself, launcher 'stnb', and says so.)
* ``stnb.export_script(config, "train.py")`` (``stnb/export.py``) writes such a script for a
  notebook's configuration and prints the commands for one node and for several nodes.
* ``stnb.launch(fn, num_processes=..., num_nodes=2, node_rank=i, master_addr=..., master_port=...)``
  runs a notebook cell's function across machines: every node runs the same call with its
  own ``node_rank``.

The launcher decides the number of processes: ``config.num_processes`` is replaced by the
launch's WORLD_SIZE (rank 0 prints a note when they differ), and hardware is checked per
node (LOCAL_WORLD_SIZE ranks on this node's cores or GPUs). On CPU each rank uses one thread
unless ``threads_per_rank`` or OMP_NUM_THREADS says otherwise. stnb's stall watchdog,
``timeout`` and ``start_method`` belong to ``stnb.launch``; under torchrun, torchrun starts and
supervises the ranks.
"""

from __future__ import annotations

import os
import sys

__all__ = ["inside_external_launch", "launcher_name", "external_rank", "is_main_process"]

def inside_external_launch(environ=None) -> bool:
    """True when this process is a rank started by torchrun, accelerate launch (or another
    launcher that sets WORLD_SIZE and RANK), and not by ``stnb.launch``."""
    env = os.environ if environ is None else environ
    if env.get("STNB_LAUNCH") == "1":
        return False
    inside = "WORLD_SIZE" in env and "RANK" in env
    if not inside and environ is None:
        _note_accelerate_cpu()
    return inside


_NOTED = False


def _note_accelerate_cpu() -> None:
    """`accelerate launch --cpu --num_processes N` starts ONE process (several CPU processes need
    an MPI hostfile); stnb then starts the ranks itself. Say so once, so nobody is surprised."""
    global _NOTED
    env = os.environ
    if _NOTED or env.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1") or "MASTER_ADDR" not in env:
        return
    _NOTED = True
    print("stnb: accelerate launch --cpu started one process (accelerate starts several CPU processes only "
          "with --mpirun_hostfile); stnb starts the ranks itself (launcher 'stnb'). For accelerate-started "
          "ranks use: accelerate launch --multi_gpu --num_processes N ...", file=sys.stderr, flush=True)


def launcher_name(environ=None) -> str:
    """'accelerate' (accelerate launch), 'torchrun' (torchrun / torch elastic) or 'external'."""
    env = os.environ if environ is None else environ
    if "ACCELERATE_MIXED_PRECISION" in env or "ACCELERATE_DYNAMO_BACKEND" in env:
        return "accelerate"  # accelerate launch sets these in every process it starts
    if "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env:
        return "torchrun"
    return "external"  # e.g. srun / mpirun that set WORLD_SIZE and RANK


def external_rank(environ=None) -> int:
    """This process's global rank in an outside launch (0 when not inside one)."""
    env = os.environ if environ is None else environ
    return int(env.get("RANK", "0")) if inside_external_launch(env) else 0


def is_main_process(environ=None) -> bool:
    """True on rank 0 of an outside launch, and always outside one (a notebook, ``python -m stnb``).

    Scripts use it to print the RunResult once: ``if stnb.scaleout.is_main_process(): print(...)``.
    """
    return external_rank(environ) == 0

