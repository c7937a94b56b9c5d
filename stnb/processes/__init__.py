"""Run a function on N processes from a notebook cell, and get every rank's result back.

Ranks are started the way accelerate's ``notebook_launcher`` starts them (torch elastic; forked on
Linux, spawned on macOS / Windows or when asked), but never run inside the kernel, as
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
  while the launch runs, see ``child_subreaper``);
* spawned ranks get a function defined in a notebook cell by value (cloudpickle), and anything
  it reads that cannot be pickled is refused, named, before a process starts.

The package, along the way one launch goes:

    launcher   launch(): validate, then the steps below in order; last_launch(), free_port()
    forksafe   is this process fit to fork (CUDA driver, accelerate state), and keeping it so
    byvalue    spawn: the function and its arguments pickled by value, or what cannot be
    channel    the result channel: per-rank files + shared progress numbers; RankState
    watchdog   the parent's thread: output relay, progress, timeout / stall / silent-exit limits
    start      starting the ranks (torch elastic, or one process of its own) and waiting for them
    rank       what runs in each rank: rank_context(), heartbeat(), report_progress(), scratch_folder(); how it started
    output     per-rank output capture (rank side) and the [rank N] relay (parent side)
    detach     a forked rank leaves the Jupyter kernel's sockets alone (a spawned one never had them)
    supervise  process-tree cleanup: child_subreaper, kill_tree, children_now
    diagnose   one function per failure kind: which rank failed, and how
    peerfail   which errors are a peer's failure seen from another rank (gloo / NCCL)

``stnb.launch`` is the ``launch`` function, exported from this package (``stnb.processes``: the processes
a launch starts and stops), whose name no longer hides a package of the same name.
"""

from __future__ import annotations

from .channel import RankState
from .forksafe import check_fork_safe
from .launcher import LaunchInfo, free_port, last_launch, launch
from .peerfail import wait_for_all
from .rank import RankContext, heartbeat, rank_context, report_progress, scratch_folder
from .supervise import child_subreaper

__all__ = ["launch", "wait_for_all", "heartbeat", "report_progress", "rank_context", "scratch_folder", "last_launch",
           "free_port", "check_fork_safe", "child_subreaper", "LaunchInfo", "RankContext", "RankState"]
