"""Ranks as the workers of Ray Train's TorchTrainer (``stnb.Ray``).

``stnb.run(..., cluster=stnb.Ray(address="auto", num_workers=4, use_gpu=True, storage_path=...))`` checks the
plan against the Ray cluster (``ray.cluster_resources()``) and runs one TorchTrainer: Ray places the
workers, sets up torch's process group (gloo on CPU, NCCL on GPU) and calls stnb's rank code in each
(``rundir.train_in_rank``: ``training.train_rank`` finds the group already initialised and joins no
other, the same verification as a local run). Ray reports only rank 0's metrics and not the function's
value, so every worker leaves its RankReport, progress, errors and output in the run's folder under
``storage_path``; stnb merges them into the RunResult (launcher 'ray', ``cluster``: nodes and workers
seen, the run's folder, where Ray keeps its own logs).

Failures: ``FailureConfig(max_failures=...)`` (default 0). With 0, a worker that raises or dies ends
the run: Ray stops the other workers, and stnb raises the LaunchError naming the worker that failed
first, its node and its log tail. With N > 0, Ray restarts the whole worker group up to N times and the
run continues from the last checkpoint reported to Ray Train: every rank reports each complete checkpoint
(``ray.train.report``; rank 0 with a small pointer checkpoint naming stnb's checkpoint folder, so Ray copies
a few bytes, not the model), and a restarted worker resumes from ``ray.train.get_checkpoint()``'s. A run
without checkpoints starts over; the RunResult is the last attempt's (``resumed_from`` says where it began).

Address: None uses the Ray this process is connected to (``ray.init`` done already), else starts a
local one for this run and shuts it down afterwards; "auto" or "host:port" connects to a running
cluster. Ray Client (``ray://``) is refused: Ray advises against it for Ray Train; run the notebook on
the head node, or submit a script with Ray Jobs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid

from ..errors import ConfigError, LaunchError
from .base import Launcher, Plan, finish, rank_env
from .rundir import (ProgressFeed, RunDir, check_cluster_plan, check_int, check_shared_checkpoints,
                     check_shared_folder, failure)

INSTALL = 'pip install "stnb[ray]"'
#: the file of the checkpoint rank 0 reports to Ray Train: where stnb's checkpoint is, and its step
POINTER = "stnb-checkpoint-pointer.json"
#: seconds to reach a Ray cluster's address before it counts as unreachable
CONNECT_TIMEOUT_S = 5


class Ray(Launcher):
    """Run the ranks as Ray Train workers (TorchTrainer).

    address: None (this process's Ray, else a local one for this run), "auto" (the running cluster this
        machine belongs to) or "host:port" (its GCS); not "ray://" (Ray Client).
    num_workers: ranks (the world size). use_gpu: one GPU per worker (NCCL), else CPU (gloo).
    cpus_per_worker: CPU cores Ray reserves per worker (its torch threads on CPU).
    storage_path: where the run's folder goes (default ~/stnb-ray); on a multi-node cluster, a folder
        every node sees. max_failures: Ray's FailureConfig (see the module's doc).
    """

    name = "ray"

    def __init__(self, address: str | None = None, num_workers: int = 2, use_gpu: bool = False,
                 cpus_per_worker: int = 1, storage_path=None, max_failures: int = 0, timeout_s: float = 300):
        self.address, self.num_workers, self.use_gpu = address, num_workers, use_gpu
        self.cpus_per_worker, self.storage_path, self.max_failures = cpus_per_worker, storage_path, max_failures
        self.timeout_s = timeout_s
        self._started_ray = False

    def __repr__(self) -> str:
        return f"Ray(address={self.address!r}, num_workers={self.num_workers}, use_gpu={self.use_gpu})"

    # -- before starting ------------------------------------------------------------------------
    def check(self, plan: Plan) -> None:
        for name, lo in (("num_workers", 1), ("cpus_per_worker", 1), ("max_failures", 0)):
            check_int("Ray", name, getattr(self, name), lo)
        try:
            import ray  # noqa: F401
            import ray.train.torch  # noqa: F401
        except ImportError:
            raise ConfigError(f"stnb.Ray runs Ray Train, which is not installed; {INSTALL}") from None
        device = "cuda" if self.use_gpu else "cpu"
        check_cluster_plan(plan, "Ray", self.num_workers, device, "num_workers", self.cpus_per_worker)
        self._connect()
        try:
            nodes = self._check_resources()
            here = _node_ip()
            multi = any(n["NodeManagerAddress"] != here for n in nodes)  # a node that is another machine
            self.storage = check_shared_folder(self.storage_path or "~/stnb-ray", "Ray(storage_path=...)", multi)
            check_shared_checkpoints(plan.config, multi)
        except BaseException:
            self._disconnect()
            raise

    def _connect(self) -> None:
        import ray

        address = self.address
        if isinstance(address, str) and address.startswith("ray://"):
            raise ConfigError(f"address={address!r} is Ray Client, which Ray advises against for Ray Train (workers "
                              "lose their connection with the client); run the notebook on the cluster's head node "
                              "with address='auto', or submit a script with Ray Jobs")
        if address not in (None, "auto"):
            host, _, port = str(address).rpartition(":")
            try:
                with socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S):
                    pass
            except (OSError, ValueError) as e:
                raise ConfigError(f"no Ray cluster answers at address={address!r} ({e}); tried a TCP connection "
                                  f"for {CONNECT_TIMEOUT_S} s. Start one (`ray start --head`) or pass its GCS "
                                  "address host:port, or address='auto' on a node of the cluster") from None
        if ray.is_initialized():
            current = ray.get_runtime_context().gcs_address
            if address not in (None, "auto") and address != current:
                raise ConfigError(f"this process is connected to the Ray cluster at {current}, not address={address!r}; "
                                  "leave address out to use it, or call ray.shutdown() first")
            return
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=address is not None,
                     logging_level="WARNING")
        except (ConnectionError, RuntimeError, ValueError) as e:
            tried = ("ray.init(address='auto'): a running Ray cluster on this machine (RAY_ADDRESS, "
                     "/tmp/ray/ray_current_cluster)" if address == "auto" else f"ray.init(address={address!r})")
            raise ConfigError(f"could not connect to Ray: tried {tried}: {e}") from None
        self._started_ray = address is None

    def _disconnect(self) -> None:
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def _check_resources(self) -> list:
        """The live nodes; ConfigError when the cluster has fewer CPUs or GPUs than the workers need."""
        import ray

        have = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cpus, gpus = have.get("CPU", 0), have.get("GPU", 0)
        said = f"the Ray cluster has {cpus:g} CPU(s) and {gpus:g} GPU(s) on {len(nodes)} node(s)"
        if self.num_workers * self.cpus_per_worker > cpus:
            raise ConfigError(f"num_workers={self.num_workers} x cpus_per_worker={self.cpus_per_worker} CPUs is more "
                              f"than {said}; use num_workers <= {int(cpus // self.cpus_per_worker)}")
        if self.use_gpu and self.num_workers > gpus:
            raise ConfigError(f"num_workers={self.num_workers} with use_gpu=True needs a GPU each: more than {said}")
        return nodes

    # -- running ----------------------------------------------------------------------------------
    def start(self, plan: Plan) -> list:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from .bars import StepBars

        name = "stnb-" + time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        run = RunDir(os.path.join(self.storage, name, "stnb"))
        os.makedirs(run.path)
        plan.t0 = time.time()
        resources = {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}
        trainer = TorchTrainer(
            ray_worker,
            train_loop_config={"folder": run.path, "config": plan.config, "build": plan.build, "t0": plan.t0},
            scaling_config=ScalingConfig(num_workers=self.num_workers, use_gpu=self.use_gpu,
                                         resources_per_worker=resources),
            run_config=RunConfig(name=name, storage_path=self.storage,
                                 failure_config=FailureConfig(max_failures=self.max_failures)),
            torch_config=TorchConfig(backend="nccl" if self.use_gpu else "gloo", timeout_s=int(self.timeout_s)))
        on_progress, bars = plan.on_progress, None
        if on_progress is None and plan.echo:
            bars = StepBars(f"{plan.config.strategy} (Ray)")
            on_progress = bars.update
        feed = ProgressFeed(run, self.num_workers, on_progress).start() if on_progress is not None else None
        ray_error = None
        try:
            logs_at = _ray_logs()
            try:
                trainer.fit()
            except Exception as e:  # Ray's TrainingFailedError / WorkerGroupError: the ranks' files say more
                ray_error = e
        finally:
            if feed is not None:
                feed.stop()
            if bars is not None:
                bars.close()
            self._disconnect()
        world = self.num_workers
        logs = {r: _read(run.file("rank", r, "log")) for r in range(world)}
        # Ray Train's WorkerGroupError maps each worker it saw fail to its error; the workers it then ended
        # as a consequence are not in it (both vanish from the run folder's point of view)
        failures = getattr(ray_error, "worker_failures", None) or {}
        error = failure("Ray Train", world, run, logs, _hosts(failures),
                        hint=f" (run folder {run.path}; Ray's logs in {logs_at})", failed_first=tuple(failures))
        if error is not None:
            raise error from ray_error
        if ray_error is not None:
            raise LaunchError(f"Ray Train: every worker left its report, but the run failed: {ray_error}",
                              kind="raised", logs=logs) from ray_error
        arrived = run.arrived(world)
        ranks = {r: arrived[r].get("node_id") for r in range(world)}
        self.seen = {"engine": "ray", "nodes": sorted(set(ranks.values())), "ranks": ranks,
                     "hosts": {r: arrived[r].get("host") for r in range(world)}, "folder": run.path,
                     "storage_path": self.storage, "ray_logs": logs_at, "max_failures": self.max_failures}
        reports = run.reports(world)
        return [reports[r] for r in range(world)]

    def deliver(self, plan: Plan, reports: list):
        return finish(plan, reports, self.name, n_gpu=1 if self.use_gpu else 0, cluster=self.seen)


def ray_worker(cfg: dict) -> None:
    """What every Ray Train worker runs: its output to its own log in the run's folder, then stnb's rank
    code in the process group Ray set up. The report goes to the run's folder (Ray keeps only rank 0's metrics)."""
    import ray
    import ray.train

    from ..instruments.checkpoints import set_checkpoint_sink
    from ..processes.output import redirect_output
    from .rundir import train_in_rank

    ctx = ray.train.get_context()
    rank, world, local_rank = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank()
    run = RunDir(cfg["folder"])
    redirect_output(run.file("rank", rank, "log"))
    config = cfg["config"]
    device = config.resolved_device()
    os.environ.update(rank_env(config, device))
    reported = ray.train.get_checkpoint()  # Ray restarted the workers: the last checkpoint reported to it
    if reported is not None:
        with reported.as_directory() as folder, open(os.path.join(folder, POINTER)) as f:
            config = config.replace(resume=json.load(f)["path"])
    set_checkpoint_sink(lambda path, step: _report_checkpoint(rank, path, step))
    try:
        train_in_rank(run, rank, world, config, cfg["build"], cfg["t0"],
                      node_id=ray.get_runtime_context().get_node_id(), ip=_node_ip(), local_rank=local_rank)
    finally:
        set_checkpoint_sink(None)


def _report_checkpoint(rank: int, path: str, step: int) -> None:
    """Tell Ray Train about a complete checkpoint (every rank reports; rank 0 with the pointer to it)."""
    import tempfile

    import ray.train

    if rank != 0:
        ray.train.report({"step": step})
        return
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, POINTER), "w") as f:
            json.dump({"path": path, "step": step}, f)
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(folder))


def _hosts(worker_failures: dict) -> dict:
    """{rank: host} of the workers Ray Train saw fail, from the worker info its errors print (``hostname='...'``):
    a worker that never reached stnb's rank code left no file saying where it ran. Ranks without it are left out."""
    import re

    found = {r: re.search(r"hostname='([^']+)'", str(e)) for r, e in worker_failures.items()}
    return {r: m.group(1) for r, m in found.items() if m}


def _node_ip() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


def _ray_logs() -> str | None:
    """Where Ray keeps this session's logs (its workers', the controller's)."""
    try:
        import ray

        return ray._private.worker._global_node.get_logs_dir_path()
    except Exception:
        return None


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
