"""stnb.run(..., cluster=stnb.Slurm(...)) on a real one-node SLURM cluster (tests/cluster/slurm_up.sh,
started once per session by the ``slurm_cluster`` fixture): every job is submitted with submitit, runs 2
tasks with stnb's rank code and comes back as a verified RunResult, or as the LaunchError that says
which rank failed, on which node, with its log tail. No mock of the scheduler anywhere."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

import stnb
from cluster_engines import kill_rank_when_training, wait_for
from stnb import checkpoints
from stnb.errors import ConfigError, LaunchError

pytestmark = pytest.mark.cluster

RECIPE = dict(model="tiny", steps=3, train_size=64, dev_size=16, evaluate=False, per_device_batch_size=4, timeout=300)


def _slurm(tmp_path, **kw):
    return stnb.Slurm(tasks_per_node=2, folder=str(tmp_path / "runs"), time_min=10, **kw)


def _progress():
    seen = {}

    def on_progress(states):
        for st in states:
            seen[st.rank] = (st.step, st.total, st.state)
    return seen, on_progress


# with tests/test_cluster_ray.py's pair, every one of recipe / build function x ddp / fsdp runs on a cluster engine,
# and each engine runs both strategies and both inputs (each run costs 20-40 s of this machine's 2 cores)
@pytest.mark.parametrize("what,strategy", [("recipe", "ddp"), ("build", "fsdp")])
def test_a_slurm_job_trains_verified_and_returns_at_once(slurm_cluster, tmp_path, what, strategy):
    import clusterfns

    seen, on_progress = _progress()
    results = tmp_path / "results.jsonl"
    if what == "recipe":
        job = stnb.run(strategy=strategy, **RECIPE, cluster=_slurm(tmp_path), on_progress=on_progress,
                       results_file=results)
    else:
        job = stnb.run(clusterfns.build, strategy=strategy, cluster=_slurm(tmp_path), on_progress=on_progress,
                       results_file=results)
    # the cell got the handle back before any task trained
    assert isinstance(job, stnb.launchers.slurm.SlurmJob) and job.job_id.isdigit()
    assert job.rundir.reports(2) == {} and not results.exists()
    assert set(job.paths) == {0, 1} and job.paths[1]["stdout"].endswith(f"{job.job_id}_1_log.out")
    res = job.result(timeout=600)
    assert res.verified, res.reason
    assert (res.launcher, res.world_size, res.strategy) == ("slurm", 2, strategy)
    host = socket.gethostname()
    assert res.cluster["job_id"] == job.job_id and res.cluster["nodes"] == [host]
    assert res.cluster["ranks"] == {0: host, 1: host} and res.cluster["state"] == "COMPLETED"
    assert res.build == (None if what == "recipe" else "clusterfns.build")
    # every rank's progress came into this process while the job ran, up to its last step
    assert {r: (s[0], s[1]) for r, s in seen.items()} == {0: (res.steps, res.steps), 1: (res.steps, res.steps)}
    assert stnb.load_results(results)["run_id"].tolist() == [res.run_id]
    assert job.state == "COMPLETED" and job.result() is res


def test_a_task_that_raises_is_named_with_its_node_and_log(slurm_cluster, tmp_path):
    import clusterfns

    job = stnb.run(clusterfns.build_rank1_raises, strategy="ddp", cluster=_slurm(tmp_path))
    with pytest.raises(LaunchError) as info:
        job.result(timeout=600)
    e = info.value
    assert e.rank == 1 and e.kind == "raised", str(e)
    assert (f"rank 1 on {socket.gethostname()} raised BuildError: your build function "
            "clusterfns.build_rank1_raises() raised ValueError: rank 1 fails on purpose") in str(e)
    assert "rank 1 fails on purpose" in e.rank_traceback and "last lines of rank 1's log" in e.rank_traceback
    assert job.state == "FAILED"


def test_a_killed_task_is_named_and_the_job_ends(slurm_cluster, tmp_path):
    import clusterfns

    job = stnb.run(clusterfns.build_long, strategy="ddp", cluster=_slurm(tmp_path), echo=False)
    kill_rank_when_training(lambda: job.folder, 1)
    with pytest.raises(LaunchError) as info:
        job.result(timeout=600)
    e = info.value
    assert e.rank == 1 and e.kind == "killed", str(e)
    assert f"rank 1 on {socket.gethostname()} ended without a result or an error" in str(e)


def test_a_task_that_never_arrives_is_a_rendezvous_failure_not_a_kill(slurm_cluster, tmp_path):
    """Task 1's Python exits before stnb's rank code runs (tests/neverarrives.py); task 0 arrived and waits at the
    rendezvous until SLURM ends it or its timeout. The error is the rendezvous's: the rank that never arrived, and
    on which node, the rank that did; never that a rank was killed by a signal or the out-of-memory killer."""
    import neverarrives

    host = socket.gethostname()
    job = stnb.run(neverarrives.build, strategy="ddp", cluster=_slurm(tmp_path, rendezvous_timeout_s=30), echo=False)
    with pytest.raises(LaunchError) as info:
        job.result(timeout=600)
    e = info.value
    assert (e.kind, e.rank, e.ranks) == ("rendezvous", 1, [1]), str(e)
    assert f"the rendezvous did not complete: rank(s) 0 ({host}) arrived, rank(s) 1 never started (nodes: {host})" \
        in str(e), str(e)
    assert "killed" not in str(e) and "out-of-memory" not in str(e) and "signal" not in str(e)
    assert job.state == "FAILED"


def test_a_job_cancelled_from_the_handle(slurm_cluster, tmp_path):
    import clusterfns

    job = stnb.run(clusterfns.build_long, strategy="ddp", cluster=_slurm(tmp_path), echo=False)
    wait_for(lambda: len(job.rundir.arrived(2)) == 2, "both tasks to start")
    job.cancel()
    with pytest.raises(LaunchError) as info:
        job.result(timeout=300)
    assert info.value.kind == "cancelled" and "the job ended (cancelled)" in str(info.value), str(info.value)
    assert job.state == "CANCELLED"
    pids = [a["pid"] for a in job.rundir.arrived(2).values()]
    wait_for(lambda: not any(_alive(p) for p in pids), "the cancelled tasks' processes to end", 60)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- a job SLURM stops and starts again continues from its newest checkpoint --------------------------------

REQUEUED_STEPS = 200  # enough for the first attempt to be cut short; the next one trains the rest in seconds


@pytest.fixture(scope="module")
def never_requeued(slurm_cluster, tmp_path_factory):
    """The same user trainer (clusterfns.build_checkpointed) run locally on 2 ranks without a stop: the run a
    requeued job must continue exactly."""
    import clusterfns

    out = tmp_path_factory.mktemp("never-requeued")
    return stnb.run(functools.partial(clusterfns.build_checkpointed, str(out), REQUEUED_STEPS), strategy="ddp",
                    num_processes=2, device="cpu", threads_per_rank=1, timeout=600, echo=False)


def _start_requeued(job, time_min: int | None = None) -> None:
    """SLURM holds a requeued job back until its BeginTime (a minute or two from now); start it now, as an
    operator would (``scontrol update``), once the job waits for it; ``time_min``: the next attempt's time limit."""
    def held():
        info = job._scontrol() or {}
        return info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"

    wait_for(held, f"job {job.job_id} to be requeued (PENDING, BeginTime)", 300)
    limit = [] if time_min is None else [f"TimeLimit={time_min}"]
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now", *limit], check=True, timeout=30)


def _continued(res, never) -> None:
    """``res`` ran again after SLURM requeued it and continued ``never``'s run from its newest checkpoint."""
    assert res.verified, res.reason
    assert res.cluster["restarts"] == 1 and res.cluster["state"] == "COMPLETED"
    step = res.resumed_from["step"]
    assert step >= 10 and step % 10 == 0 and res.resumed_from["started_at_step"] == step, res.resumed_from
    assert res.losses == never.losses[step:]  # every step after the checkpoint, exactly as the run that never stopped
    assert res.checkpoints[-1]["step"] == REQUEUED_STEPS


def test_a_job_requeued_mid_run_continues_from_its_newest_checkpoint(slurm_cluster, tmp_path, never_requeued):
    """``scontrol requeue`` (what an operator or a preemption in requeue mode does): SLURM kills the tasks and
    starts the job again under the same id; the handle follows it and its result is the continued run."""
    import clusterfns

    out = tmp_path / "checkpoints"
    job = stnb.run(functools.partial(clusterfns.build_checkpointed, str(out), REQUEUED_STEPS, 10, 0.1),
                   strategy="ddp", threads_per_rank=1, cluster=_slurm(tmp_path), echo=False)
    wait_for(lambda: checkpoints.complete(out), "the job's first checkpoint", 300)
    subprocess.run(["scontrol", "requeue", job.job_id], check=True, timeout=30)
    _start_requeued(job)
    _continued(job.result(timeout=600), never_requeued)


@pytest.mark.timeout(900)
def test_a_job_at_its_time_limit_is_requeued_and_continues(slurm_cluster, tmp_path, never_requeued):
    """requeue=True: SLURM signals the job signal_delay_s before its 4-minute limit, submitit's handler requeues it
    (its checkpoint protocol), and the next attempt continues from the newest checkpoint."""
    import clusterfns

    out = tmp_path / "checkpoints"
    # signalled about 90 s into the first attempt (SLURM checks its timers every 30 s or so), which is still
    # training then: 0.7 s a step slower, 140 s for its 200 steps
    job = stnb.run(functools.partial(clusterfns.build_checkpointed, str(out), REQUEUED_STEPS, 10, 0.7),
                   strategy="ddp", threads_per_rank=1, echo=False,
                   cluster=stnb.Slurm(tasks_per_node=2, folder=str(tmp_path / "runs"), time_min=4, requeue=True,
                                      signal_delay_s=150))
    # the next attempt gets 10 minutes, or it too is signalled 90 s in: on a busy machine (CI's notebooks training
    # beside it) its start-up and the rest of the steps took longer, and it was requeued again and again
    _start_requeued(job, time_min=10)
    res = job.result(timeout=600)
    _continued(res, never_requeued)
    # submitit's handler did it, not the time limit killing the job (its 'Requeued job' line, written after scontrol
    # requeue returns, can be lost to the kill that requeue sends: seen under load)
    assert "this job is timed-out" in job.logs()[0] and "Calling checkpoint method." in job.logs()[0]


def test_requeue_without_checkpoints_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"Slurm\(requeue=True\) continues a requeued job from its newest checkpoint, "
                                          r"and this run writes none: set checkpoint_every=N"):
        stnb.run(strategy="ddp", **RECIPE, cluster=_slurm(tmp_path, requeue=True))
    with pytest.raises(ConfigError, match=r"Slurm\(requeue=...\) takes True or False, got 'yes'"):
        stnb.run(strategy="ddp", **RECIPE, cluster=_slurm(tmp_path, requeue="yes"))


# ---- refused before submitting ------------------------------------------------------------------------

def test_no_slurm_commands_names_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"no SLURM commands on this machine: looked for sbatch, sinfo.*missing"):
        stnb.run(strategy="ddp", **RECIPE, cluster=_slurm(tmp_path))


def test_an_unreachable_controller_is_refused(slurm_cluster, tmp_path, monkeypatch):
    conf = tmp_path / "slurm.conf"
    text = open(slurm_cluster).read().splitlines()
    conf.write_text("\n".join("SlurmctldPort=9" if ln.startswith("SlurmctldPort=") else ln for ln in text) + "\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(ConfigError, match=r"`sinfo .*` (failed|did not answer).*(controller)"):
        stnb.run(strategy="ddp", **RECIPE, cluster=_slurm(tmp_path))


def test_more_than_the_partition_has_is_refused_with_what_it_has(slurm_cluster, tmp_path):
    host = socket.gethostname()
    with pytest.raises(ConfigError, match=rf"tasks_per_node=3 x cpus_per_task=1 CPUs is more than a node has: "
                                          rf"partition 'debug' has 1 node\(s\) \({host}: 2 CPUs, 0 GPUs"):
        stnb.run(strategy="ddp", **RECIPE, cluster=stnb.Slurm(tasks_per_node=3, folder=str(tmp_path)))
    shared = tempfile.mkdtemp(prefix=".stnb-test-", dir=os.path.expanduser("~"))  # a 2-node job refuses /tmp first
    try:
        with pytest.raises(ConfigError, match=r"nodes=2 is more than partition 'debug' has 1 node"):
            stnb.run(strategy="ddp", **RECIPE, cluster=stnb.Slurm(nodes=2, tasks_per_node=1, folder=shared))
    finally:
        shutil.rmtree(shared)
    with pytest.raises(ConfigError, match=r"gpus_per_node=2 is more than a node has"):
        stnb.run(strategy="ddp", **RECIPE, cluster=stnb.Slurm(tasks_per_node=2, gpus_per_node=2,
                                                              folder=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"partition 'gpu' is not on this cluster; sinfo lists debug"):
        stnb.run(strategy="ddp", **RECIPE, cluster=_slurm(tmp_path, partition="gpu"))


def test_a_multi_node_log_folder_under_tmp_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"Slurm\(folder=...\) '/tmp/.*' is on this machine's own disk \(under /tmp\)"
                                          r".*other nodes could not write"):
        stnb.run(strategy="ddp", **RECIPE, cluster=stnb.Slurm(nodes=2, tasks_per_node=1, folder="/tmp/stnb-x"))


def test_a_multi_node_checkpoint_dir_under_tmp_is_refused(slurm_cluster, tmp_path):
    """Each node's ranks would write their parts of every checkpoint to their own machine's /tmp: none whole, and a
    requeued job would find none. Refused before submitting; one node keeps its /tmp."""
    shared = tempfile.mkdtemp(prefix=".stnb-test-", dir=os.path.expanduser("~"))  # the log folder passes
    try:
        with pytest.raises(ConfigError, match=r"checkpoint_dir '/tmp/stnb-ck' is on this machine's own disk \(under "
                                              r"/tmp\): the ranks on the other nodes could not write their parts of "
                                              r"each checkpoint there"):
            stnb.run(strategy="ddp", **RECIPE, checkpoint_every=2, checkpoint_dir="/tmp/stnb-ck",
                     cluster=stnb.Slurm(nodes=2, tasks_per_node=1, folder=shared, requeue=True))
        with pytest.raises(ConfigError, match=r"nodes=2 is more than partition 'debug' has 1 node"):  # past it
            stnb.run(strategy="ddp", **RECIPE, checkpoint_every=2, checkpoint_dir=os.path.join(shared, "ck"),
                     cluster=stnb.Slurm(nodes=2, tasks_per_node=1, folder=shared, requeue=True))
    finally:
        shutil.rmtree(shared)
    assert not os.path.exists("/tmp/stnb-ck")


def test_a_strategy_that_cannot_span_tasks_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"strategy 'dp' trains in one process, so SLURM cannot spread it"):
        stnb.run(strategy="dp", **RECIPE, cluster=_slurm(tmp_path))
    with pytest.raises(ConfigError, match=r"num_processes=4 but the SLURM job has 2 ranks"):
        stnb.run(strategy="ddp", num_processes=4, **RECIPE, cluster=_slurm(tmp_path))


def test_without_submitit_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "submitit", None)
    with pytest.raises(ConfigError, match=r'pip install "stnb\[slurm\]"'):
        stnb.run(strategy="ddp", **RECIPE, cluster=_slurm(tmp_path))


def test_cluster_takes_a_launcher_only():
    with pytest.raises(ConfigError, match=r"cluster= takes stnb.Slurm\(...\) or stnb.Ray\(...\); got str"):
        stnb.run(strategy="ddp", **RECIPE, cluster="slurm")
