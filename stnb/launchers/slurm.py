"""Ranks as the tasks of a SLURM job, submitted with submitit from this process (``stnb.Slurm``).

``stnb.run(..., cluster=stnb.Slurm(nodes=2, tasks_per_node=4, gpus_per_node=4, folder=...))`` checks the
plan against the cluster (``sinfo``) before submitting, submits one job of ``nodes * tasks_per_node``
tasks, and returns a :class:`SlurmJob` at once: the cell is free while the job waits and trains. Every
task exports torch's rendezvous variables from SLURM's (submitit's ``TorchDistributedEnvironment``:
the first node is MASTER_ADDR), joins the process group with a bounded timeout, and runs stnb's own rank
code (``rundir.train_in_rank``: ``training.train_rank``, the same verification as a local run), leaving
its report, progress and errors in the run's folder. ``SlurmJob.result()`` merges the reports into the
RunResult (launcher 'slurm', ``cluster``: job id, nodes and ranks seen, restarts, logs) or raises the
LaunchError that explains the job.

Requeued jobs: a job SLURM starts again (``scontrol requeue``, a preemption that requeues, or, with
``requeue=True``, submitit's requeue before the time limit: SLURM signals the job ``signal_delay_s`` before it,
submitit's handler on rank 0 requeues it) continues from the run's newest complete checkpoint
(``checkpoints.resume_point``, ``restarted``); the steps after it are trained again. The job keeps its id, so
the handle follows it; ``result()`` is the resumed run's (``RunResult.resumed_from``).

Submitting from a machine outside the cluster is out of scope: run the notebook on a login node (or a node
of an interactive allocation) that has the SLURM commands.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

from ..errors import ConfigError, LaunchError
from ..files import shown
from .base import Launcher, Plan, finish, rank_env
from .rundir import (ProgressFeed, RunDir, check_cluster_plan, check_int, check_shared_checkpoints,
                     check_shared_folder, failure)

INSTALL = 'pip install "stnb[slurm]"'
COMMANDS = ("sbatch", "sinfo", "squeue", "scontrol", "scancel")
#: seconds a SLURM command may take before the cluster counts as unreachable
COMMAND_TIMEOUT_S = 15
#: JobState values after which nothing more happens, and how a LaunchError names them
ENDED = {"CANCELLED": ("cancelled", "cancelled"), "TIMEOUT": ("timeout", "out of its time limit"),
         "DEADLINE": ("timeout", "past its deadline"), "NODE_FAIL": ("node_fail", "a node failed"),
         "OUT_OF_MEMORY": ("out_of_memory", "out of memory"), "PREEMPTED": ("preempted", "preempted"),
         "BOOT_FAIL": ("node_fail", "a node failed to boot")}
FINAL = {"COMPLETED", "FAILED", *ENDED}


class Slurm(Launcher):
    """Run the ranks as the tasks of one SLURM job (submitit). ``stnb.run(..., cluster=stnb.Slurm(...))``
    returns a :class:`SlurmJob` at once.

    nodes, tasks_per_node: the job's shape; the world size is ``nodes * tasks_per_node`` (one rank per task).
    gpus_per_node: GPUs per node (0: CPU ranks, gloo); with GPUs, one per task (``tasks_per_node``).
    cpus_per_task: CPU cores per task (its torch threads on CPU).
    partition: the partition (None: the cluster's default). time_min: the job's time limit in minutes.
    folder: the run's folder (a new sub-folder per run holds the tasks' logs, progress and reports); for a
        multi-node job it must be on the cluster's shared filesystem (not /tmp).
    rendezvous_timeout_s: how long the tasks that started wait for the others to join the process group.
    requeue: requeue the job when SLURM signals its time limit or a preemption (submitit's checkpoint protocol;
        at most ``max_num_timeout=`` times for time limits, submitit's default 3); the requeued job continues
        from the newest checkpoint, so the run must write them (``checkpoint_every=`` / your trainer's
        ``save_strategy``). Signalled ``signal_delay_s=`` seconds (default 90) before the limit.
    slurm_params: any other submitit SLURM parameter without its ``slurm_`` prefix (``qos=``, ``account=``,
        ``constraint=``, ``mem=``, ``additional_parameters={...}`` for sbatch options submitit lacks).
    """

    name = "slurm"

    def __init__(self, nodes: int = 1, tasks_per_node: int = 1, gpus_per_node: int = 0, cpus_per_task: int = 1,
                 partition: str | None = None, folder="stnb-slurm", time_min: int = 60,
                 rendezvous_timeout_s: float = 300, job_name: str = "stnb", requeue: bool = False, **slurm_params):
        self.nodes, self.tasks_per_node, self.gpus_per_node = nodes, tasks_per_node, gpus_per_node
        self.requeue = requeue
        self.cpus_per_task, self.partition, self.folder, self.time_min = cpus_per_task, partition, folder, time_min
        self.rendezvous_timeout_s, self.job_name, self.slurm_params = rendezvous_timeout_s, job_name, slurm_params

    def __repr__(self) -> str:
        return (f"Slurm(nodes={self.nodes}, tasks_per_node={self.tasks_per_node}, gpus_per_node={self.gpus_per_node}, "
                f"partition={self.partition!r}, folder={self.folder!r})")

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    # -- before submitting ------------------------------------------------------------------
    def check(self, plan: Plan) -> None:
        for name in ("nodes", "tasks_per_node", "cpus_per_task", "time_min"):
            check_int("Slurm", name, getattr(self, name), 1)
        check_int("Slurm", "gpus_per_node", self.gpus_per_node, 0)
        if not isinstance(self.requeue, bool):
            raise ConfigError(f"Slurm(requeue=...) takes True or False, got {self.requeue!r}")
        if self.requeue and plan.build.checkpoints(plan.config) is False:
            raise ConfigError("Slurm(requeue=True) continues a requeued job from its newest checkpoint, and this run "
                              "writes none: set checkpoint_every=N and checkpoint_dir=... (a folder every node sees), "
                              "or leave requeue out")
        if not isinstance(self.rendezvous_timeout_s, (int, float)) or self.rendezvous_timeout_s <= 0:
            raise ConfigError(f"Slurm(rendezvous_timeout_s=...) must be a positive number, got {self.rendezvous_timeout_s!r}")
        try:
            import submitit  # noqa: F401
        except ImportError:
            raise ConfigError(f"stnb.Slurm submits with submitit, which is not installed; {INSTALL}") from None
        missing = [c for c in COMMANDS if shutil.which(c) is None]
        if missing:
            raise ConfigError(
                f"no SLURM commands on this machine: looked for {', '.join(COMMANDS)} on PATH "
                f"({os.environ.get('PATH', '')}), missing {', '.join(missing)}. stnb.Slurm submits from a machine of "
                "the cluster (a login node); submitting from a notebook outside the cluster is not supported")
        device = "cuda" if self.gpus_per_node else "cpu"
        if self.gpus_per_node and self.gpus_per_node != self.tasks_per_node:
            raise ConfigError(f"gpus_per_node={self.gpus_per_node} but tasks_per_node={self.tasks_per_node}: each "
                              "task is one rank driving one GPU; set them equal")
        check_cluster_plan(plan, "SLURM", self.world, device, "nodes * tasks_per_node", self.cpus_per_task)
        root = check_shared_folder(self.folder, "Slurm(folder=...)", self.nodes > 1, create=False)
        check_shared_checkpoints(plan.config, self.nodes > 1)
        self.partition = self._check_partition()
        self.root = check_shared_folder(root, "Slurm(folder=...)", self.nodes > 1)  # created once the cluster answered
        self._executor(self.root)  # submitit's own check of the parameters, before submitting

    def _check_partition(self) -> str:
        """The partition, checked against what ``sinfo`` says it has; refuses what it cannot hold."""
        out = _command(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%G|%t"])
        nodes: dict = {}
        default = None
        for line in out.splitlines():
            if line.count("|") != 4:
                continue
            node, part, cpus, gres, state = line.split("|")
            if part.endswith("*"):
                part = default = part[:-1]
            nodes.setdefault(part, {})[node] = (_int(cpus), _gpus(gres), state)
        if not nodes:
            raise ConfigError(f"sinfo lists no partition on this cluster (it printed {out.strip()!r})")
        part = self.partition or default
        if part is None:
            raise ConfigError(f"the cluster has no default partition; pass partition= one of {', '.join(sorted(nodes))}")
        if part not in nodes:
            raise ConfigError(f"partition {part!r} is not on this cluster; sinfo lists {', '.join(sorted(nodes))}")
        have = nodes[part]
        cpus = min(c for c, _, _ in have.values())
        gpus = min(g for _, g, _ in have.values())
        said = (f"partition {part!r} has {len(have)} node(s) ({', '.join(f'{n}: {c} CPUs, {g} GPUs, {s}' for n, (c, g, s) in sorted(have.items()))})")
        if self.nodes > len(have):
            raise ConfigError(f"nodes={self.nodes} is more than {said}; use nodes <= {len(have)}")
        if self.tasks_per_node * self.cpus_per_task > cpus:
            raise ConfigError(f"tasks_per_node={self.tasks_per_node} x cpus_per_task={self.cpus_per_task} CPUs is more "
                              f"than a node has: {said}")
        if self.gpus_per_node > gpus:
            raise ConfigError(f"gpus_per_node={self.gpus_per_node} is more than a node has: {said}")
        return part

    def _executor(self, folder: str):
        import submitit

        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        params = dict(nodes=self.nodes, tasks_per_node=self.tasks_per_node, cpus_per_task=self.cpus_per_task,
                      timeout_min=self.time_min, name=self.job_name, slurm_partition=self.partition)
        if self.gpus_per_node:
            params["gpus_per_node"] = self.gpus_per_node
        params.update({f"slurm_{k}": v for k, v in self.slurm_params.items()})
        try:
            executor.update_parameters(**params)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"submitit refused the SLURM parameters: {e}") from None
        return executor

    # -- submitting ---------------------------------------------------------------------------
    def start(self, plan: Plan) -> "SlurmJob":
        from .bars import StepBars

        run = RunDir(os.path.join(self.root, time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]))
        os.makedirs(run.path)
        plan.t0 = time.time()
        task = RequeuedTask() if self.requeue else slurm_task
        job = self._executor(run.path).submit(task, run.path, plan.config, plan.build, plan.t0,
                                              self.rendezvous_timeout_s)
        on_progress, bars = plan.on_progress, None
        if on_progress is None and plan.echo:
            bars = StepBars(f"{plan.config.strategy} (SLURM {job.job_id})")
            on_progress = bars.update
        handle = SlurmJob(self, plan, job, run, None, bars)
        if on_progress is not None:  # ends with the job, whether or not result() is called
            handle.feed = ProgressFeed(run, self.world, on_progress, ended=handle.done,
                                       on_end=bars.close if bars is not None else None).start()
        if plan.echo:
            print(f"stnb: submitted SLURM job {job.job_id} ({self.world} task(s) on {self.nodes} node(s), partition "
                  f"{self.partition!r}); logs and progress in {shown(run.path)}. job.result() gives the RunResult.",
                  file=sys.stderr, flush=True)
        return handle


class SlurmJob:
    """A submitted stnb run on SLURM: ``job_id``, ``state``, ``paths``, ``cancel()``, ``result()``.

    Progress: while the job runs, a thread of this process feeds the ranks' progress files to the run's
    ``on_progress`` (by default one bar per rank, as a local run shows), so the cell returns at once and
    the kernel stays usable; ``wait()`` blocks until the job ended. ``result()`` waits too, then gives the
    RunResult (launcher 'slurm') or raises the LaunchError naming the rank, its node and its log tail."""

    def __init__(self, launcher: Slurm, plan: Plan, job, rundir: RunDir, feed, bars):
        self.launcher, self.plan, self.job, self.rundir, self.feed, self.bars = launcher, plan, job, rundir, feed, bars
        self.job_id = str(job.job_id)
        self.world = launcher.world
        self._result = self._error = None
        self._state = "PENDING"

    def __repr__(self) -> str:
        return f"<SlurmJob {self.job_id} {self.state}: {self.world} rank(s), folder {shown(self.rundir.path)}>"

    @property
    def folder(self) -> str:
        return self.rundir.path

    @property
    def paths(self) -> dict:
        """{rank: {'stdout': path, 'stderr': path}} of every task's log (SLURM task id = rank)."""
        return {r: {k: os.path.join(self.rundir.path, f"{self.job_id}_{r}_log.{ext}")
                    for k, ext in (("stdout", "out"), ("stderr", "err"))} for r in range(self.world)}

    @property
    def state(self) -> str:
        """SLURM's JobState ('PENDING', 'RUNNING', 'COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', ...)."""
        if self._state in FINAL:
            return self._state
        info = self._scontrol()
        if info is None:  # the controller forgot the job (MinJobAge): it ended; the run's folder says how
            self._state = "COMPLETED" if len(self.rundir.reports(self.world)) == self.world else "FAILED"
        else:
            self._state = info.get("JobState", "UNKNOWN")
        return self._state

    def _scontrol(self) -> dict | None:
        try:
            out = _command(["scontrol", "show", "job", "-o", self.job_id])
        except ConfigError as e:
            if "Invalid job id" in str(e):
                return None
            raise
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def nodes(self) -> dict:
        """{rank: the node SLURM put it on} (block distribution: tasks_per_node consecutive ranks per node)."""
        info = self._scontrol() or {}
        listed = info.get("NodeList", "")
        hosts = _command(["scontrol", "show", "hostnames", listed]).split() if listed and listed != "(null)" else []
        per = self.launcher.tasks_per_node
        return {r: hosts[r // per] for r in range(self.world) if r // per < len(hosts)}

    def logs(self) -> dict:
        """{rank: its stdout and stderr so far}."""
        out = {}
        for r, p in self.paths.items():
            text = ""
            for k in ("stdout", "stderr"):
                try:
                    with open(p[k], errors="replace") as f:
                        text += f.read()
                except OSError:
                    pass
            out[r] = text
        return out

    def done(self) -> bool:
        return self.state in FINAL

    def cancel(self) -> None:
        """Cancel the job (``scancel``); ``result()`` then raises LaunchError(kind='cancelled')."""
        _command(["scancel", self.job_id])

    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> str:
        """Block until the job ended (or ``timeout`` seconds passed); return its state."""
        end = None if timeout is None else time.time() + timeout
        while not self.done():
            if end is not None and time.time() > end:
                break
            time.sleep(poll_s)
        return self.state

    def result(self, timeout: float | None = None):
        """The RunResult once the job ended (blocks); LaunchError when it did not give every rank's report."""
        if self._result is not None:
            return self._result
        if self._error is not None:
            raise self._error
        state = self.wait(timeout)
        if state not in FINAL:
            raise TimeoutError(f"SLURM job {self.job_id} is still {state} after {timeout:g} s; call result() again")
        if state == "COMPLETED":  # a shared filesystem may show the last files a moment later
            deadline = time.time() + 10
            while len(self.rundir.reports(self.world)) < self.world and time.time() < deadline:
                time.sleep(0.5)
        if self.feed is not None:
            self.feed.stop()
        if self.bars is not None:
            self.bars.close()
        where = self.nodes()
        error = failure(f"SLURM job {self.job_id}", self.world, self.rundir, self.logs(), where,
                        ended=ENDED.get(state), hint=f" (job state {state}; logs in {self.rundir.path})")
        if error is not None:
            self._error = error
            raise error
        reports = self.rundir.reports(self.world)
        arrived = self.rundir.arrived(self.world)
        ranks = {r: arrived.get(r, {}).get("host") or where.get(r) for r in range(self.world)}
        cluster = {"engine": "slurm", "job_id": self.job_id, "state": state, "partition": self.launcher.partition,
                   "restarts": max((a.get("restarts") or 0 for a in arrived.values()), default=0),
                   "nodes": sorted({h for h in ranks.values() if h}), "ranks": ranks, "folder": self.rundir.path,
                   "logs": {r: p["stdout"] for r, p in self.paths.items()}}
        self._result = finish(self.plan, [reports[r] for r in range(self.world)], self.launcher.name,
                              n_gpu=self.launcher.gpus_per_node, cluster=cluster)
        return self._result


class RequeuedTask:
    """``slurm_task`` as submitit's checkpointable callable: when SLURM signals the time limit or a preemption,
    submitit (on rank 0) calls ``checkpoint`` and requeues the job with what it returns, the same task. Nothing
    is saved then: the trainer's checkpoints are on disk, and the requeued job continues from the newest."""

    def __call__(self, *args) -> None:
        slurm_task(*args)

    def checkpoint(self, *args):
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args)


def slurm_task(folder: str, config, build, t0: float, rendezvous_timeout_s: float) -> None:
    """What every task of the job runs (submitit calls it there): torch's rendezvous from SLURM's
    variables, then stnb's rank code. The report goes to the run's folder, not through submitit."""
    import datetime
    import socket

    import submitit
    import torch.distributed as dist

    from ..hardware import backend_for
    from .external import destroy_group
    from .rundir import train_in_rank

    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    device = config.resolved_device()
    os.environ.update(rank_env(config, device))

    def join():
        dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=rendezvous_timeout_s))

    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)  # SLURM started this job again (requeued)
    try:
        train_in_rank(RunDir(folder), env.rank, env.world_size, config, build, t0, join=join, restarted=restarts > 0,
                      node=socket.gethostname(), local_rank=env.local_rank, master=f"{env.master_addr}:{env.master_port}",
                      job_id=os.environ.get("SLURM_JOB_ID"), restarts=restarts)
    finally:
        destroy_group()


def _command(argv: list) -> str:
    """Run a SLURM command; ConfigError naming it when it fails or the controller does not answer."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"`{' '.join(argv)}` did not answer in {COMMAND_TIMEOUT_S} s: the SLURM controller is "
                          "unreachable from this machine") from None
    except OSError as e:
        raise ConfigError(f"`{' '.join(argv)}` could not run: {e}") from None
    if proc.returncode != 0:
        raise ConfigError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                          f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc.stdout


def _int(text: str) -> int:
    m = re.match(r"\d+", text)
    return int(m.group()) if m else 0


def _gpus(gres: str) -> int:
    """GPUs in a node's GRES ('gpu:4', 'gpu:a100:8(S:0-1)', '(null)')."""
    return sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,(]+)?:(\d+)", gres))
