"""Run a function on N processes from a notebook cell, and get every rank's result back (``stnb.launch``).

Ranks start the way accelerate's ``notebook_launcher`` starts them (torch elastic; forked on Linux,
spawned on macOS / Windows or when asked), never inside the kernel. stnb adds a result channel,
torch.distributed set up and checked in every rank, a free port per launch, per-rank output printed
as whole ``[rank N]`` lines, errors that name the rank that really failed, a timeout and stall
watchdog, cleanup of every process the launch started, and a cell's function sent by value to
spawned ranks. The modules, along the way one launch goes:

    launcher   launch(): validate, then the steps below in order; last_launch(), free_port()
    forksafe   is this process fit to fork (CUDA driver, accelerate state), and keeping it so
    byvalue    spawn: the function and its arguments pickled by value, or what cannot be
    channel    the result channel: per-rank files + shared progress numbers; RankState
    watchdog   the parent's thread: output relay, progress, timeout / stall / silent-exit limits
    start      starting the ranks (torch elastic, or one process of its own) and waiting for them
    rank       what runs in each rank: rank_context(), heartbeat(), report_progress(), scratch_folder()
    output     per-rank output capture (rank side) and the [rank N] relay (parent side)
    detach     a forked rank leaves the Jupyter kernel's sockets alone
    supervise  process-tree cleanup: child_subreaper, kill_tree, children_now
    diagnose   one function per failure kind: which rank failed, and how
    peerfail   which errors are a peer's failure seen from another rank (gloo / NCCL)
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
