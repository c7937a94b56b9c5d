"""The real cluster engines the cluster tests run on, each started once per test session and stopped as soon
as its tests are done (module scope: each engine's tests are one module, so the daemons do not stay up
through the rest of ``make test``).

``slurm_cluster``: a one-node SLURM cluster on this machine (``tests/cluster/slurm_up.sh``: munged,
slurmctld, slurmd, generated munge key and slurm.conf), ``SLURM_CONF`` set for this process and the
jobs it submits. ``ray_cluster``: a Ray cluster of two raylets on this machine
(``ray.cluster_utils.Cluster``, one CPU each), this process connected to it. Both check at the end
that nothing they started is left running. Neither is a mock: the tests submit real jobs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@contextlib.contextmanager
def _env(**values):
    """Set environment variables for the engine's lifetime, then put back what was there."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _shared_imports() -> str:
    """A PYTHONPATH with which jobs and workers import stnb and the tests' build functions as this process
    does (on a real cluster: stnb installed on every node)."""
    paths = [str(ROOT), str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(paths))


def _wait_gone(procs, seconds: float = 30) -> list:
    """The processes of ``procs`` still alive after ``seconds``."""
    _, alive = psutil.wait_procs([p for p in procs if p.is_running()], timeout=seconds)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _matching(text: str) -> list:
    out = []
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            if text in " ".join(p.info["cmdline"] or []) or text == p.info["name"]:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.fixture(scope="module")
def slurm_cluster():
    """SLURM_CONF of a running one-node cluster; stopped (and checked stopped) after the module's tests."""
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.fail("slurmctld / munged not found: the cluster tests need Debian's slurm-wlm and munge. "
                    "Run `make cluster-deps` (make test does)")
    folder = tempfile.mkdtemp(prefix="stnb-slurm-")
    up = subprocess.run([str(HERE / "cluster" / "slurm_up.sh"), folder], capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, f"the SLURM test cluster did not start:\n{up.stdout}\n{up.stderr}"
        with _env(SLURM_CONF=os.path.join(folder, "slurm.conf"), PYTHONPATH=_shared_imports()):
            yield os.environ["SLURM_CONF"]
    finally:
        daemons = _matching(folder)
        down = subprocess.run([str(HERE / "cluster" / "slurm_down.sh"), folder], capture_output=True, text=True,
                              timeout=120)
        left = _wait_gone(daemons + _matching("slurmstepd"), 30)
        for p in left:  # reported below, and stopped: a later run on this machine must not find them (a job's
            with contextlib.suppress(psutil.Error):  # steps outlive slurmd when a test was stopped mid-job)
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)
        assert down.returncode == 0 and not left, \
            f"SLURM processes left running: {[(p.pid, p.name()) for p in left]}\n{down.stderr}"


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray cluster of two raylets (one CPU each) this process is connected to; shut down (and checked
    gone) after the module's tests."""
    with _env(PYTHONPATH=_shared_imports()):  # the raylets start their workers with this environment
        yield from _ray_cluster()


def _ray_cluster():
    import ray

    started_before = set(p.pid for p in psutil.Process().children(recursive=True))
    cluster = None
    try:
        cluster = _start_ray(started_before)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        yield cluster
    finally:
        ours = [p for p in psutil.Process().children(recursive=True) if p.pid not in started_before]
        if ray.is_initialized():  # the session's processes that are not this process's children (workers)
            session = ray._private.worker._global_node.get_session_dir_path()
            ours += [p for p in _matching(session) if p.pid not in {q.pid for q in ours}]
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        left = _wait_gone(ours, 30)
        assert not left, f"Ray processes left running: {[(p.pid, p.name()) for p in left]}"


def _start_ray(started_before: set, attempts: int = 3):
    """The two raylets started; started again (up to ``attempts`` times) when one did not register with the GCS
    within the 30 s Ray allows (``ray/_private/node.py``): seen with the machine loaded (two busy loops beside
    three test workers), where nothing was wrong but the wait."""
    from ray.cluster_utils import Cluster

    for attempt in range(1, attempts + 1):
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
            cluster.add_node(num_cpus=1)
            return cluster
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            print(f"ray_cluster: {e} (attempt {attempt} of {attempts}); starting it again", file=sys.stderr)
            if cluster is not None:
                cluster.shutdown()
            for p in psutil.Process().children(recursive=True):
                if p.pid not in started_before:
                    with contextlib.suppress(psutil.Error):
                        p.kill()


def wait_for(check, what: str, seconds: float = 180, poll: float = 0.2):
    """Poll ``check()`` until it returns something truthy (returned); fail naming ``what`` after ``seconds``."""
    end = time.time() + seconds
    while time.time() < end:
        got = check()
        if got:
            return got
        time.sleep(poll)
    pytest.fail(f"timed out waiting for {what}")


def kill_rank_when_training(folder_of, rank: int, seconds: float = 540) -> int:
    """SIGKILL ``rank``'s process once it has reported a training step (its pid from the run folder's
    arrived file; ``folder_of()`` gives the folder once it exists). Returns the pid killed. ``seconds``: as long
    as the test may run (pytest's 600 s): under load Ray's workers took more than 240 s to train a first step, and
    the run then trained to its end unkilled."""
    import json
    import signal

    def ready():
        folder = folder_of()
        if not folder:
            return None
        try:
            with open(os.path.join(folder, f"progress-{rank}.json")) as f:
                if json.load(f)["step"] < 1:
                    return None
            with open(os.path.join(folder, f"arrived-{rank}.json")) as f:
                return json.load(f)["pid"]
        except (OSError, ValueError, KeyError):
            return None

    pid = wait_for(ready, f"rank {rank} to train a step", seconds)
    os.kill(pid, signal.SIGKILL)
    return pid


def in_thread(fn) -> tuple:
    """``fn()`` started in a daemon thread; returns (thread, errors): what ``fn`` raised (a killer that timed out
    waiting) is in ``errors``, for the test to report instead of a run that was never stopped."""
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - pytest.fail's Failed is a BaseException
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


__all__ = ["slurm_cluster", "ray_cluster", "wait_for", "kill_rank_when_training", "in_thread"]
