"""stnb.run(..., cluster=stnb.Ray(...)) on a real Ray cluster of two raylets on this machine
(``ray.cluster_utils.Cluster``, one CPU each; the ``ray_cluster`` fixture starts it once per session):
Ray Train's TorchTrainer places one worker per node, every worker runs stnb's rank code, and the
per-rank reports it leaves under the storage path merge into a verified RunResult that names both nodes.
No mock of Ray anywhere."""

from __future__ import annotations

import glob
import json
import os
import socket
import sys

import pytest

import stnb
from cluster_engines import in_thread, kill_rank_when_training, wait_for
from stnb.errors import ConfigError, LaunchError

pytestmark = pytest.mark.cluster

RECIPE = dict(model="tiny", steps=3, train_size=64, dev_size=16, evaluate=False, per_device_batch_size=4, timeout=300)


# with tests/test_cluster_slurm.py's pair (recipe-ddp, build-fsdp), every one of recipe / build function x ddp / fsdp
# runs on a cluster engine, and each engine runs both strategies and both inputs (a Ray run costs 40-70 s here)
@pytest.mark.parametrize("what,strategy", [("recipe", "fsdp"), ("build", "ddp")])
def test_ray_workers_on_two_nodes_train_verified(ray_cluster, tmp_path, what, strategy):
    import clusterfns

    seen = {}

    def on_progress(states):
        for st in states:
            seen[st.rank] = (st.step, st.total)

    ray_nodes = sorted(n["NodeID"] for n in __import__("ray").nodes() if n["Alive"])
    cluster = stnb.Ray(num_workers=2, storage_path=str(tmp_path))
    if what == "recipe":
        res = stnb.run(strategy=strategy, **RECIPE, cluster=cluster, on_progress=on_progress)
    else:
        res = stnb.run(clusterfns.build, strategy=strategy, cluster=cluster, on_progress=on_progress)
    assert res.verified, res.reason
    assert (res.launcher, res.world_size, res.strategy) == ("ray", 2, strategy)
    # one worker per node: the two raylets have one CPU each
    assert res.cluster["nodes"] == ray_nodes and len(ray_nodes) == 2
    assert sorted(res.cluster["ranks"].values()) == ray_nodes
    assert res.cluster["folder"].startswith(str(tmp_path)) and os.path.isdir(res.cluster["ray_logs"])
    assert sorted(glob.glob(os.path.join(res.cluster["folder"], "report-*.pkl"))) == \
        [os.path.join(res.cluster["folder"], f"report-{r}.pkl") for r in (0, 1)]
    assert seen == {0: (res.steps, res.steps), 1: (res.steps, res.steps)}


def test_a_worker_that_raises_is_named(ray_cluster, tmp_path):
    import clusterfns

    with pytest.raises(LaunchError) as info:
        stnb.run(clusterfns.build_rank1_raises, strategy="ddp", cluster=stnb.Ray(num_workers=2, storage_path=str(tmp_path)))
    e = info.value
    assert e.rank == 1 and e.kind == "raised", str(e)
    assert (f"rank 1 on {socket.gethostname()} raised BuildError: your build function "
            "clusterfns.build_rank1_raises() raised ValueError: rank 1 fails on purpose") in str(e), str(e)
    assert "last lines of rank 1's log" in e.rank_traceback


def test_a_killed_worker_is_named(ray_cluster, tmp_path):
    import clusterfns

    def folder():
        found = glob.glob(os.path.join(str(tmp_path), "stnb-*", "stnb"))
        return found[0] if found else None

    killer, failed = in_thread(lambda: kill_rank_when_training(folder, 1))
    try:
        stnb.run(clusterfns.build_long, strategy="ddp", cluster=stnb.Ray(num_workers=2, storage_path=str(tmp_path)),
                 echo=False)
    except LaunchError as raised:
        e = raised
    else:
        pytest.fail(f"the run was not stopped: the killer {failed or 'did not kill rank 1'}")
    killer.join(timeout=10)
    assert not failed, failed
    assert e.rank == 1 and e.kind == "killed", str(e)
    assert f"rank 1 on {socket.gethostname()} ended without a result or an error" in str(e)


def test_a_worker_that_never_arrives_is_a_rendezvous_failure_not_a_kill(ray_cluster, tmp_path):
    """Rank 1's worker process exits before stnb's rank code runs (tests/neverarrives.py); Ray Train then ends rank
    0, which had arrived. The error is the rendezvous's: the rank that never arrived, and on which node, the rank
    that did; never that a rank was killed by a signal or the out-of-memory killer."""
    import neverarrives

    with pytest.raises(LaunchError) as info:
        stnb.run(neverarrives.build, strategy="ddp", cluster=stnb.Ray(num_workers=2, storage_path=str(tmp_path)),
                 echo=False)
    e = info.value
    host = socket.gethostname()
    assert (e.kind, e.rank, e.ranks) == ("rendezvous", 1, [1]), str(e)
    assert f"the rendezvous did not complete: rank(s) 0 ({host}) arrived, rank(s) 1 never started (nodes: {host})" \
        in str(e), str(e)
    assert f"last lines of rank 1's log (on {host})" in e.rank_traceback
    assert "killed" not in str(e) and "out-of-memory" not in str(e) and "signal" not in str(e)


def test_a_killed_worker_with_max_failures_continues_from_the_checkpoint_reported_to_ray(ray_cluster, tmp_path):
    """max_failures=1: a worker killed once Ray Train holds a reported checkpoint; Ray restarts the workers, which
    continue from that checkpoint, and the run ends as the same run that never stopped (compared step by step)."""
    run = dict(strategy="ddp", model="tiny", steps=120, train_size=64, evaluate=False, per_device_batch_size=4,
               timeout=300, threads_per_rank=1, checkpoint_every=10)
    # the uninterrupted run, on the same engine (a local launch from this process would leave multiprocessing's
    # helper process behind, or fork Ray's threads)
    never = stnb.run(**run, checkpoint_dir=str(tmp_path / "never"), echo=False,
                     cluster=stnb.Ray(num_workers=2, storage_path=str(tmp_path / "never-ray")))
    storage = tmp_path / "ray"

    def reported_then_kill():
        def registered():  # Ray Train's own record of the checkpoints it holds
            found = glob.glob(os.path.join(str(storage), "stnb-*", "checkpoint_manager_snapshot.json"))
            try:
                return found and json.load(open(found[0]))["checkpoint_results"]
            except (OSError, ValueError):
                return None
        wait_for(registered, "Ray Train to hold a reported checkpoint", 240)
        kill_rank_when_training(lambda: glob.glob(os.path.join(str(storage), "stnb-*", "stnb"))[0], 1)

    killer, failed = in_thread(reported_then_kill)
    res = stnb.run(**run, checkpoint_dir=str(tmp_path / "checkpoints"), echo=False,
                   cluster=stnb.Ray(num_workers=2, storage_path=str(storage), max_failures=1))
    killer.join(timeout=10)
    assert not killer.is_alive() and not failed, failed
    assert res.verified, res.reason
    step = res.resumed_from["step"]
    assert step >= 10 and step % 10 == 0 and res.resumed_from["started_at_step"] == step, res.resumed_from
    assert res.losses == never.losses[step:]
    assert res.checkpoints[-1]["step"] == 120


# ---- refused before starting ------------------------------------------------------------------------

def test_more_workers_than_the_ray_cluster_has_is_refused_with_what_it_has(ray_cluster, tmp_path):
    with pytest.raises(ConfigError, match=r"num_workers=3 x cpus_per_worker=1 CPUs is more than the Ray cluster has "
                                          r"2 CPU\(s\) and 0 GPU\(s\) on 2 node\(s\)"):
        stnb.run(strategy="ddp", **RECIPE, cluster=stnb.Ray(num_workers=3, storage_path=str(tmp_path)))


def test_unreachable_and_client_addresses_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"no Ray cluster answers at address='127.0.0.1:1'.*tried a TCP connection"):
        stnb.run(strategy="ddp", **RECIPE, cluster=stnb.Ray(address="127.0.0.1:1", storage_path=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"Ray Client, which Ray advises against for Ray Train"):
        stnb.run(strategy="ddp", **RECIPE, cluster=stnb.Ray(address="ray://head:10001", storage_path=str(tmp_path)))


def test_a_one_process_strategy_and_a_missing_extra_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"strategy 'single' trains in one process, so Ray cannot spread it"):
        stnb.run(strategy="single", **RECIPE, cluster=stnb.Ray(storage_path=str(tmp_path)))
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r'pip install "stnb\[ray\]"'):
        stnb.run(strategy="ddp", **RECIPE, cluster=stnb.Ray(storage_path=str(tmp_path)))
