"""What a cluster launcher (SLURM, Ray) says from the run folder its ranks leave (stnb.launchers.rundir.failure),
with no engine: the folder is written the way the ranks write it."""

from __future__ import annotations

from stnb.launchers.rundir import RunDir, failure


def _folder(tmp_path, arrived=(0, 1), reports=(), errors=()):
    (tmp_path / "stnb").mkdir(parents=True)
    run = RunDir(tmp_path / "stnb")
    for r in arrived:
        run.arrive(r)
    for r in reports:
        run.write_report(r, {"rank": r})
    for r, exc in errors:
        try:
            raise exc
        except type(exc) as e:
            run.write_error(r, e)
    return run


def test_of_two_ranks_that_vanished_the_one_the_engine_saw_fail_is_named(tmp_path):
    """Ray Train ends the other workers once one died (seen here under load: both then leave neither a report
    nor an error); its WorkerGroupError names the one that failed, and that rank is the one named."""
    run = _folder(tmp_path)
    named = failure("Ray Train", 2, run, {0: "rank 0's log", 1: "rank 1's log"}, {}, failed_first=(1,))
    assert (named.rank, named.kind, named.ranks) == (1, "killed", [0, 1])
    assert "rank 1 on " in str(named) and "ended without a result or an error" in str(named)
    assert "rank 1's log" in named.rank_traceback
    # without the engine's word the lowest rank is named, as before
    assert failure("Ray Train", 2, run, {}, {}).rank == 0
    # a rank the engine names that did not vanish (it left its report) is not taken
    run.write_report(1, {"rank": 1})
    assert failure("Ray Train", 2, run, {}, {}, failed_first=(1,)).rank == 0


def test_a_rank_that_raised_comes_before_the_ranks_that_vanished(tmp_path):
    run = _folder(tmp_path, arrived=(0, 1, 2), reports=(2,), errors=[(0, ValueError("rank 0 gives up"))])
    named = failure("SLURM job 7", 3, run, {}, {}, failed_first=(1,))
    assert (named.rank, named.kind) == (0, "raised") and "raised ValueError: rank 0 gives up" in str(named)
    assert failure("SLURM job 7", 1, _folder(tmp_path / "done", arrived=(0,), reports=(0,)), {}, {}) is None


def test_a_progress_display_that_stops_itself_ends_the_feed_not_the_job(tmp_path):
    """A cluster run's progress callback (in the feed's thread; the cell returned long ago) that raises
    KeyboardInterrupt ends the feed quietly, the interrupt kept in ``feed.error``: no thread dies with an
    unhandled exception, and the job is left to ``handle.cancel()``."""
    import threading

    from stnb.launchers.rundir import ProgressFeed

    run, seen, unhandled = _folder(tmp_path), [], []

    def stop(states):
        seen.append([s.rank for s in states])
        raise KeyboardInterrupt

    hook, threading.excepthook = threading.excepthook, unhandled.append
    try:
        feed = ProgressFeed(run, 2, stop, interval=0.01).start()
        feed._thread.join(timeout=10)
    finally:
        threading.excepthook = hook
    assert not feed._thread.is_alive() and not unhandled
    assert seen == [[0, 1]] and isinstance(feed.error, KeyboardInterrupt)


def test_a_rank_that_never_arrived_is_a_rendezvous_failure_even_when_the_others_vanished(tmp_path):
    """Rank 2 never arrived; ranks 0 and 1 did, then the engine ended them (no report, no error; Ray Train names
    rank 2 among its worker failures, or nothing). That is the rendezvous's failure, naming the rank that never
    arrived and its node as the engine says; no rank was killed by a signal or the out-of-memory killer."""
    run = _folder(tmp_path, arrived=(0, 1))
    for failed_first in ((), (2,), (0,)):
        e = failure("Ray Train", 3, run, {2: ""}, {2: "node-b"}, failed_first=failed_first)
        assert (e.kind, e.rank, e.ranks) == ("rendezvous", 2, [2])
        host = run.arrived(3)[0]["host"]
        assert str(e).startswith(f"Ray Train: the rendezvous did not complete: rank(s) 0 ({host}), 1 ({host}) "
                                 "arrived, rank(s) 2 never started (nodes: node-b)")
        assert "killed" not in str(e) and "signal" not in str(e) and "out-of-memory" not in str(e)
        assert "last lines of rank 2's log (on node-b)" in e.rank_traceback
    # a peer's failure seen at the rendezvous (the store's timeout) does not hide it either
    run.write_error(0, type("DistStoreError", (RuntimeError,), {})("Timed out after 30 seconds waiting for clients"))
    assert failure("SLURM job 7", 3, run, {}, {2: "node-b"}).kind == "rendezvous"


def test_ray_names_the_host_of_a_worker_it_saw_fail_from_its_worker_info():
    """A Ray Train worker that never reached stnb's rank code left no file saying where it ran: its host is the one
    Ray Train's error prints in the worker's info (ray 2.60's WorkerHealthCheckFailedError, abridged)."""
    from stnb.launchers.ray import _hosts

    info = ("A worker health check failed.\nWorker info: Worker(\n  actor=Actor(RayTrainWorker, ef1a),\n  metadata="
            "ActorMetadata(\n    hostname='node-b',\n    node_id='a7d2',\n    node_ip='192.0.2.2',\n    pid=14268,\n  ),")
    assert _hosts({1: RuntimeError(info), 0: RuntimeError("no worker info")}) == {1: "node-b"}
    assert _hosts({}) == {}


def test_each_way_a_cluster_run_fails_is_told_whole_with_its_ranks_nodes_and_log_tail(tmp_path):
    """failure()'s words, kind, ranks and log tail for each way a run ends without every report: the engine
    ended the job; a rank raised by itself (its peers' failures listed, not named); only peers' failures (the
    earliest named); a rank that never arrived where the engine does not say the node ('?')."""
    import socket

    host = socket.gethostname()
    logs = {0: "older line\nrank 0's last line", 1: "rank 1's last line", 2: ""}
    run = _folder(tmp_path / "ended", arrived=(0, 1, 2), reports=(0,))
    e = failure("SLURM job 7", 3, run, logs, {}, ended=("timeout", "out of its time limit"), hint=" (job state X)")
    assert str(e).split("\n\n")[0] == (f"SLURM job 7: the job ended (out of its time limit) before every rank "
                                        f"finished: rank(s) 1 ({host}), 2 ({host}) left no result (job state X)")
    assert (e.kind, e.rank, e.ranks, e.logs) == ("timeout", 1, [1, 2], logs)
    assert e.rank_traceback == f"--- last lines of rank 1's log (on {host}) ---\nrank 1's last line"

    run = _folder(tmp_path / "raised", arrived=(0, 1, 2), reports=(2,),
                  errors=[(0, RuntimeError("gloo/transport/tcp: read error")), (1, ValueError("a bad batch"))])
    e = failure("Ray Train", 3, run, logs, {})
    assert str(e).split("\n\n")[0] == f"Ray Train: rank 1 on {host} raised ValueError: a bad batch"
    assert (e.kind, e.rank, e.ranks) == ("raised", 1, [0, 1])
    assert e.rank_traceback.startswith("Traceback (most recent call last):") and "ValueError: a bad batch\n" in \
        e.rank_traceback and e.rank_traceback.endswith(f"\n--- last lines of rank 1's log (on {host}) ---\n"
                                                       "rank 1's last line")

    run = _folder(tmp_path / "peers", arrived=(0, 1),
                  errors=[(0, RuntimeError("Connection closed by peer")),
                          (1, RuntimeError("Connection reset by peer"))])
    e = failure("Ray Train", 2, run, {}, {})
    assert str(e).split("\n\n")[0] == f"Ray Train: rank 0 on {host} raised RuntimeError: Connection closed by peer"
    assert (e.kind, e.rank, e.ranks) == ("raised", 0, [0, 1])
    assert e.rank_traceback.startswith("Traceback (most recent call last):") and e.rank_traceback.endswith(
        f"RuntimeError: Connection closed by peer\n\n--- last lines of rank 0's log (on {host}) ---\n(no output)")

    run = _folder(tmp_path / "nowhere", arrived=())
    e = failure("Ray Train", 2, run, {}, {})
    assert str(e).split("\n\n")[0] == ("Ray Train: the rendezvous did not complete: rank(s) none arrived, rank(s) "
                                        "0, 1 never started (nodes: ?); check that every node of the job can start "
                                        "Python with stnb installed and reach the first node's MASTER_PORT")
    assert (e.kind, e.rank, e.ranks) == ("rendezvous", 0, [0, 1])
    assert e.rank_traceback == "--- last lines of rank 0's log (on ?) ---\n(no output)"
    assert "never started (nodes: node-a, node-b);" in str(failure("Ray Train", 2, run, {}, {1: "node-b", 0: "node-a"}))


def test_a_cluster_rank_out_of_memory_is_told_as_out_of_memory(tmp_path):
    """A cluster rank that raised stnb's OutOfMemory (past its memory budget) is named with kind 'out_of_memory', the
    same kind SLURM's OUT_OF_MEMORY job state gives."""
    from stnb.errors import OutOfMemory

    run = _folder(tmp_path, errors=((1, OutOfMemory("rank 1 ran out of its memory budget")),))
    e = failure("SLURM job 7", 2, run, {}, {})
    assert (e.kind, e.rank) == ("out_of_memory", 1)
    assert str(e).startswith(f"SLURM job 7: rank 1 on {run.arrived(2)[1]['host']} raised OutOfMemory: rank 1 ran out")
