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
