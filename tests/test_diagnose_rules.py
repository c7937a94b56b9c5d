"""Which error a user is told after a failed launch, rule by rule, in the test process (fast).

The evidence is real: a stnb Channel written the way ranks write it (``check_in``, ``write_error`` with
the record ``rank.rank_main`` writes, ``write_result``), ranks that really ended (forked children that
check in and exit or are killed, left as zombies the way torch elastic leaves them for the watchdog to
read), an unstarted Watchdog carrying the findings its thread records (reason, stalled ranks, stacks,
ended ranks) and the launcher's Outcome. The slow tests/test_faults.py and tests/fault_matrix.py reach
the same rules through real launches; these state each rule's decision so mutation testing
(``make mutants``) can hold it.

The watchdog's decisions (``_tick``: stalled / not started / timed out; ``_track_ended``: a rank that
ended silently) are driven with a controllable clock: the module's ``time`` is replaced (monkeypatch)
by one whose ``time()`` the test sets. Stopping the ranks (dump_stacks, kill_ranks: signals to real
pids, plumbing checked by the slow tests) is recorded instead, since the "ranks" here are this process.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time

import pytest

from stnb.errors import LaunchError
from stnb.processes import watchdog as watchdog_mod
from stnb.processes.channel import DONE, Channel
from stnb.processes.diagnose import diagnose
from stnb.processes.peerfail import is_secondary, origin
from stnb.processes.start import Outcome
from stnb.processes.watchdog import EXIT_GRACE_S, MIN_START_S, Watchdog

T0 = 1_000_000.0


class Clock:
    def __init__(self, now=T0):
        self.now = now

    def time(self):
        return self.now

    def sleep(self, s):
        self.now += s


class Recorded(Watchdog):
    """The watchdog with its two signal-sending steps recorded instead of sent (the ranks are this process)."""

    def dump_stacks(self):
        return {r: f"stack of local rank {r}" for r in self.ch.pids()}

    def kill_ranks(self):
        self.killed = sorted(self.ch.pids())


@pytest.fixture
def ch():
    c = Channel(3)  # the tests use 2 or 3 of its rows
    yield c
    c.cleanup()


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(watchdog_mod, "time", c)
    return c


_children = []


def ended_rank(ch, r, how):
    """A real rank process: checks in (as rank_main does) and ends by ``how`` (an exit code or a signal
    name); left a zombie, as torch elastic leaves a rank until it reaps it."""
    pid = os.fork()
    if pid == 0:
        ch.check_in(r)
        if isinstance(how, str):
            faulthandler.disable()  # (pytest's would print this child's stack on SIGSEGV)
            os.kill(os.getpid(), getattr(signal, how))
        os._exit(how)
    _children.append(pid)
    deadline = time.time() + 10
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        assert time.time() < deadline
        time.sleep(0.005)
    return pid


@pytest.fixture(autouse=True)
def reap():
    yield
    while _children:
        os.waitpid(_children.pop(), 0)


def error(ch, r, typ, message, t, base=0):
    if not ch.started(r):
        ch.check_in(r)
    ch.write_error(r, {"rank": base + r, "local_rank": r, "type": typ, "message": message,
                       "traceback": f"Traceback of {typ} in rank {base + r}", "time": t})


def wd_of(ch, nproc=2, **found):
    wd = Watchdog(ch, nproc, timeout=found.pop("timeout", None), stall_timeout=found.pop("stall_timeout", 30.0),
                  on_progress=None, echo=False)
    for k, v in found.items():
        setattr(wd, k, v)
    return wd


def told(ch, wd, outcome=None, nproc=2, node_rank=0, start_method="fork"):
    err = diagnose(ch, wd, outcome or Outcome(), nproc, node_rank, start_method)
    assert isinstance(err, LaunchError), err
    return err


# ---- peerfail: the origin --------------------------------------------------------------------

def test_what_a_peer_failure_makes_a_rank_raise_is_secondary():
    assert is_secondary({"type": "DistBackendError", "message": "x"})
    assert is_secondary({"type": "RuntimeError", "message": "gloo: Connection closed by peer [x]"})
    assert not is_secondary({"type": "RuntimeError", "message": "shape mismatch"})
    assert not is_secondary({"type": "ValueError", "message": None})


def test_origin_is_the_earliest_own_error_else_the_earliest():
    assert origin([]) is None
    peer = {"type": "DistNetworkError", "message": "", "time": 1.0}
    own_late = {"type": "ValueError", "message": "bad", "time": 3.0}
    own_early = {"type": "KeyError", "message": "k", "time": 2.0}
    assert origin([peer, own_late, own_early]) is own_early
    peer2 = {"type": "RuntimeError", "message": "Broken pipe", "time": 0.5}
    assert origin([peer, peer2]) is peer2


# ---- diagnose: each rule ---------------------------------------------------------------------

def test_every_rank_returned_is_no_error(ch):
    for r in range(2):
        ch.check_in(r)
        ch.write_result(r, b"x")
    assert diagnose(ch, wd_of(ch), Outcome(), 2, 0) is None


def test_interrupted_is_a_keyboard_interrupt(ch):
    err = diagnose(ch, wd_of(ch, reason="timeout", timeout=5.0), Outcome(interrupted=True), 2, 0)
    assert type(err) is KeyboardInterrupt and "interrupted" in str(err)


def test_timed_out_names_every_rank_of_the_node_with_their_stacks(ch):
    wd = wd_of(ch, reason="timeout", timeout=2.5, stacks={1: "B", 0: "  "})
    err = told(ch, wd, node_rank=1)
    assert str(err).startswith("launch timed out after 2.5 s; all 2 ranks were stopped. Raise timeout=...")
    assert (err.ranks, err.rank, err.kind) == ([2, 3], None, "timeout")
    assert err.rank_traceback == "--- stack of rank 2 ---\n(no stack captured)\n--- stack of rank 3 ---\nB"


@pytest.mark.parametrize("method,limit,why", [("fork", 10.0, "forked while another thread held a lock"),
                                              ("spawn", 90.0, "raise stall_timeout=...")])
def test_not_started_names_the_ranks_and_the_limit(ch, method, limit, why):
    ch.check_in(0)
    err = told(ch, wd_of(ch, reason="not started", stalled=[1], stall_timeout=limit), start_method=method)
    assert str(err).startswith(f"rank(s) 1 did not start within {max(limit, MIN_START_S):g} s after the launch "
                               f"began ({method}); all ranks were stopped.")
    assert why in str(err)
    assert (err.ranks, err.kind) == ([1], "stalled")


def test_spawned_rank_that_died_before_stnb_ran_names_it(ch):
    ch.check_in(0)
    out = Outcome(failure=RuntimeError("elastic"), exit_codes={0: -15, 1: 1, 2: 1})
    err = told(ch, wd_of(ch, 3), out, nproc=3, start_method="spawn")
    assert str(err).startswith("rank 1 exited (exit code 1) while its new Python process was starting")
    assert (err.rank, err.ranks, err.kind) == (1, [1, 2], "exited")
    # forked ranks run stnb's code at once: the rule is spawn's
    assert "new Python process" not in str(told(ch, wd_of(ch, 3), out, nproc=3, start_method="fork"))


def test_a_rank_raised_then_its_peers_stalled_names_the_raiser(ch):
    error(ch, 0, "ValueError", "bad batch", T0)
    ch.check_in(1)
    err = told(ch, wd_of(ch, reason="stalled", stalled=[1], stall_timeout=12.0, stacks={1: "S"}))
    assert str(err).startswith("rank 0 raised ValueError: bad batch (rank(s) 1 then waited for it with no "
                               "progress for 12 s and all ranks were stopped)")
    assert (err.rank, err.ranks, err.kind) == (0, [0, 1], "raised")
    assert err.rank_traceback.startswith("--- traceback of rank 0 ---\nTraceback of ValueError in rank 0\n"
                                         "--- stack of rank 1 ---\nS")


def test_stalled_ranks_named_one_is_the_rank_several_none(ch):
    for r in range(2):
        ch.check_in(r)
    err = told(ch, wd_of(ch, reason="stalled", stalled=[0, 1], stall_timeout=7.0), node_rank=1)
    assert str(err).startswith("rank(s) 2, 3 stalled: no progress for 7 s")
    assert (err.rank, err.ranks, err.kind) == (None, [2, 3], "stalled")
    # ... with node_rank 1: global ranks; one stalled rank is the rank
    err = told(ch, wd_of(ch, reason="stalled", stalled=[1], stall_timeout=7.0), node_rank=0)
    assert (err.rank, err.ranks) == (1, [1])
    # a peer's consequence (secondary) is not the raiser: the stall is told
    error(ch, 0, "DistBackendError", "Connection closed by peer", T0)
    err = told(ch, wd_of(ch, reason="stalled", stalled=[1], stall_timeout=7.0))
    assert (err.rank, err.kind) == (1, "stalled")


@pytest.mark.parametrize("how,why,kind", [
    ("SIGKILL", "was killed by SIGKILL (from outside, or by the out-of-memory killer: try a smaller batch size)",
     "killed"),
    ("SIGSEGV", "was killed by SIGSEGV;", "killed"),
    (3, "exited (exit code 3) without returning a result or raising an exception", "exited"),
])
def test_a_rank_that_ended_silently_is_named_with_how(ch, how, why, kind):
    ended_rank(ch, 1, how)
    ch.check_in(0)
    wd = wd_of(ch)
    wd._track_ended(time.time())
    assert list(wd.ended) == [1]
    wd.reason, wd.stalled = "exited", [1]
    err = told(ch, wd)
    assert str(err).startswith(f"rank 1 {why}"), str(err)
    assert (err.rank, err.ranks, err.kind) == (1, [1], kind)


def test_a_rank_killed_then_its_peer_complaining_names_the_killed_one(ch):
    ended_rank(ch, 1, "SIGKILL")
    wd = wd_of(ch)
    wd._track_ended(T0)
    error(ch, 0, "RuntimeError", "Connection closed by peer\nmore", T0 + 0.5)
    wd.returned_at = T0 + 1
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: -9}))
    assert str(err).startswith("rank 1 was killed by SIGKILL")
    assert " Rank 0 then raised RuntimeError: Connection closed by peer (a consequence)." in str(err)
    assert (err.rank, err.ranks, err.kind) == (1, [1], "killed")
    assert "--- traceback of rank 0 ---\nTraceback of RuntimeError in rank 0" in err.rank_traceback


def test_exit_code_unknown_to_the_watchdog_is_taken_from_the_launcher(ch):
    ended_rank(ch, 1, 0)
    wd = wd_of(ch)
    wd.ended = {1: (T0, None)}
    wd.returned_at = T0 + 1
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={1: -9}))
    assert str(err).startswith("rank 1 was killed by SIGKILL") and err.kind == "killed"


def test_a_peer_that_never_joined_the_collective_is_named(ch):
    ended_rank(ch, 0, 1)
    wd = wd_of(ch, 3)
    wd._track_ended(T0)
    error(ch, 0, "DistBackendError", "Connection reset by peer", T0 + 0.1)
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1}), nproc=3)
    assert str(err).startswith("rank(s) 1, 2 never joined the collective rank 0 waited in: rank 0 raised "
                               "DistBackendError: Connection reset by peer (a consequence).")
    assert (err.rank, err.ranks, err.kind) == (None, [0, 1, 2], "stalled")


def test_raised_names_the_origin_and_lists_the_others(ch):
    error(ch, 0, "RuntimeError", "Broken pipe", T0)  # a consequence, though earlier
    error(ch, 1, "ValueError", "bad label", T0 + 1)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: 1}))
    assert str(err).startswith("rank 1 raised ValueError: bad label (rank(s) 0 failed too)")
    assert (err.rank, err.ranks, err.kind) == (1, [0, 1], "raised")
    assert err.rank_traceback == "--- traceback of rank 1 ---\nTraceback of ValueError in rank 1"


def test_raised_alone_says_nothing_of_others_and_collateral_is_not_an_origin(ch):
    error(ch, 0, "KeyboardInterrupt", "", T0)
    error(ch, 1, "ValueError", "bad", T0 + 1)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: 1}))
    assert str(err).split("\n")[0] == "rank 1 raised ValueError: bad"
    assert (err.rank, err.ranks) == (1, [1])


def test_a_rank_out_of_memory_is_told_as_out_of_memory_and_its_peer_as_a_consequence(ch):
    """A rank past its memory budget (stnb's OutOfMemory; torch's CUDA OutOfMemoryError, Python's MemoryError alike)
    is the origin, kind 'out_of_memory'; the peer that lost it in a collective is listed, not blamed."""
    error(ch, 0, "RuntimeError", "gloo: Connection closed by peer [x]", T0 + 1)
    error(ch, 1, "OutOfMemory", "rank 1 ran out of its memory budget", T0 + 2)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: 1}))
    assert str(err).startswith("rank 1 raised OutOfMemory: rank 1 ran out of its memory budget (rank(s) 0 failed too)")
    assert (err.rank, err.ranks, err.kind) == (1, [0, 1], "out_of_memory")


def test_sys_exit_in_a_rank_is_told_as_such(ch):
    error(ch, 1, "SystemExit", "3", T0 + 1)
    error(ch, 0, "SystemExit", "2", T0 + 2)
    ch.write_result(0, b"x")
    err = told(ch, wd_of(ch))
    assert str(err).startswith("rank 1 raised SystemExit: 3 (sys.exit() ends a rank without a result")
    assert (err.rank, err.ranks, err.kind) == (1, [0, 1], "exited")
    # a failed launch: only the ranks the launcher saw fail count
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 2, 1: 0}))
    assert (err.rank, err.ranks) == (0, [0])


def test_exit_code_without_an_exception_is_told(ch):
    error(ch, 1, "KeyboardInterrupt", "", T0)
    error(ch, 0, "SignalException", "", T0)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 0, 1: 4}))
    assert str(err).split("\n")[0] == "rank 1 exited with code 4 without raising a Python exception; " \
                                      "the other ranks were stopped."
    assert (err.rank, err.ranks, err.kind) == (1, [1], "exited")
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={1: -11, 0: -15}), node_rank=2)
    assert str(err).split("\n")[0] == "rank 4 was killed by SIGTERM; the other ranks were stopped."
    assert (err.rank, err.ranks, err.kind) == (4, [4, 5], "killed")


def test_only_stopped_ranks_name_the_first_stop(ch):
    error(ch, 1, "KeyboardInterrupt", "stop", T0 + 1)
    error(ch, 0, "SignalException", "got 15", T0 + 2)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={}))
    assert str(err).startswith("rank 1 raised KeyboardInterrupt: stop")
    assert (err.rank, err.ranks, err.kind) == (1, [0, 1], "raised")


def test_launcher_failure_before_any_rank_reported(ch):
    err = told(ch, wd_of(ch), Outcome(failure=OSError("no port")))
    assert str(err).startswith("the launch failed before any rank reported an error: OSError: no port")
    assert (err.rank, err.ranks, err.kind) == (None, [], "exited")
    assert "OSError: no port" in err.rank_traceback


# ---- the watchdog's decisions ------------------------------------------------------------------

def running(ch, r, t):
    """A rank that checked in, joined its world and runs the function (as rank_main: check_in, set_up),
    its last progress at ``t``."""
    ch.check_in(r)
    ch.set_up(r)
    ch.mark_progress(r, t)


def setting_up(ch, r, t):
    """A rank that checked in and is still joining its world (rank_main between check_in and set_up)."""
    ch.check_in(r)
    ch.mark_progress(r, t)


def test_stalled_only_when_every_running_rank_stopped_progressing(ch, clock):
    wd = Recorded(ch, 2, timeout=None, stall_timeout=10.0, on_progress=None, echo=False)
    wd.start_time = T0
    for r in range(2):
        running(ch, r, T0)
    clock.now = T0 + 10.0  # exactly the limit: not yet
    wd._tick()
    assert wd.reason is None
    ch.mark_progress(1, T0 + 9.0)  # rank 1 progresses, rank 0 is slow
    clock.now = T0 + 15.0
    wd._tick()
    assert wd.reason is None
    clock.now = T0 + 19.5
    wd._tick()
    assert (wd.reason, wd.stalled, wd.killed) == ("stalled", [0, 1], [0, 1])
    assert wd.stacks == {0: "stack of local rank 0", 1: "stack of local rank 1"}


def test_a_rank_done_is_not_waited_on_for_progress(ch, clock):
    wd = Recorded(ch, 2, timeout=None, stall_timeout=10.0, on_progress=None, echo=False)
    for r in range(2):
        running(ch, r, T0)
    ch.set_state(0, DONE)
    ch.mark_progress(0, T0 + 100)  # irrelevant: it is done
    clock.now = T0 + 11
    wd._tick()
    assert (wd.reason, wd.stalled) == ("stalled", [1])


def test_no_stall_limit_no_stall_and_the_overall_timeout(ch, clock):
    wd = Recorded(ch, 2, timeout=None, stall_timeout=None, on_progress=None, echo=False)
    wd.start_time = T0
    clock.now = T0 + 1e6
    wd._tick()
    assert wd.reason is None
    wd = Recorded(ch, 2, timeout=50.0, stall_timeout=1.0, on_progress=None, echo=False)
    wd.start_time = T0
    clock.now = T0 + 50.0
    wd._tick()
    assert wd.reason is None  # (not started yet, and the start limit is MIN_START_S)
    clock.now = T0 + 50.5
    wd._tick()
    assert (wd.reason, wd.stalled) == ("timeout", [])


def test_ranks_not_started_within_the_start_limit(ch, clock):
    ch.check_in(0)
    ch.mark_progress(0, T0 + 1e5)
    for limit in (10.0, MIN_START_S + 40):
        wd = Recorded(ch, 2, timeout=None, stall_timeout=limit, on_progress=None, echo=False)
        wd.start_time = T0
        clock.now = T0 + max(limit, MIN_START_S)
        wd._tick()
        assert wd.reason is None and not wd._checked_in
        clock.now += 0.5
        wd._tick()
        assert (wd.reason, wd.stalled) == ("not started", [1])


def test_progress_is_reported_every_half_second_once_all_started(ch, clock):
    seen = []
    wd = Recorded(ch, 2, timeout=None, stall_timeout=None, on_progress=seen.append, echo=False)
    ch.check_in(0)
    clock.now = T0
    wd._tick()
    assert seen == []
    ch.check_in(1)
    wd._tick()
    assert len(seen) == 1 and [s.state for s in seen[0]][:2] == ["setting up", "setting up"]
    clock.now = T0 + 0.4
    wd._tick()
    assert len(seen) == 1
    clock.now = T0 + 0.5
    wd._tick()
    assert len(seen) == 2


def test_ended_ranks_are_tracked_and_a_silent_one_stops_the_launch_after_the_grace(ch):
    ended_rank(ch, 1, 7)
    ch.check_in(0)
    wd = Recorded(ch, 2, timeout=None, stall_timeout=None, on_progress=None, echo=False)
    wd._track_ended(T0)
    assert wd.ended == {1: (T0, 7)}
    wd._track_ended(T0 + 1.0)
    assert wd.ended == {1: (T0, 7)}  # seen once: the first time counts
    wd._track_ended(T0 + EXIT_GRACE_S)
    assert wd.reason is None
    wd._track_ended(T0 + EXIT_GRACE_S + 0.1)
    assert (wd.reason, wd.stalled, wd.stacks) == ("exited", [1], {})


def test_an_ended_rank_that_left_an_error_or_result_is_not_silent(ch):
    ended_rank(ch, 1, 0)
    ended_rank(ch, 0, 1)
    ch.write_result(1, b"x")
    error(ch, 0, "ValueError", "v", T0)
    wd = Recorded(ch, 2, timeout=None, stall_timeout=None, on_progress=None, echo=False)
    wd._track_ended(T0)
    wd._track_ended(T0 + 10)
    assert wd.reason is None and sorted(wd.ended) == [0, 1]


def test_ended_ranks_are_not_tracked_after_the_launcher_returned(ch):
    ended_rank(ch, 1, 0)
    wd = Recorded(ch, 2, timeout=None, stall_timeout=None, on_progress=None, echo=False)
    wd.returned_at = T0
    wd._track_ended(T0 + 10)
    assert wd.ended == {} and wd.reason is None


# ---- what travels with the error: the rank's last output, every rank's logs, the tracebacks ------

def write_log(ch, wd, r, lines):
    """A rank's output file, as a rank's redirected stdout/stderr fills it; the watchdog relays it."""
    with open(ch.path("log", r), "w") as f:
        f.write("".join(f"{line}\n" for line in lines))
    wd.relay.relay(final=True)


def test_a_killed_rank_comes_with_its_last_20_lines_of_output_and_every_log(ch):
    ended_rank(ch, 1, "SIGKILL")
    ch.check_in(0)
    wd = wd_of(ch)
    wd._track_ended(time.time())
    wd.reason, wd.stalled = "exited", [1]
    write_log(ch, wd, 0, ["rank 0 says"])
    write_log(ch, wd, 1, [f"line {i}" for i in range(25)])
    err = told(ch, wd, node_rank=1)
    assert err.rank_traceback == "--- last output of rank 3 ---\n" + "\n".join(f"line {i}" for i in range(5, 25))
    assert err.logs[0] == "rank 0 says\n" and err.logs[1].startswith("line 0\n")


def test_exit_code_comes_with_the_ranks_last_output(ch):
    error(ch, 0, "KeyboardInterrupt", "", T0)
    ch.write_result(1, b"x")
    wd = wd_of(ch)
    write_log(ch, wd, 1, ["one", "two"])
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={1: 4}))
    assert err.rank_traceback == "--- last output of rank 1 ---\none\ntwo"
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={1: 4}))
    assert err.rank_traceback == ""  # no output: nothing shown


def test_stopped_only_carries_the_traceback(ch):
    error(ch, 1, "KeyboardInterrupt", "stop", T0 + 1)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic")))
    assert err.rank_traceback == "--- traceback of rank 1 ---\nTraceback of KeyboardInterrupt in rank 1"


def test_a_signal_without_a_name_is_told_by_number(ch):
    error(ch, 0, "KeyboardInterrupt", "", T0)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: -40}))
    assert str(err).split("\n")[0] == "rank 0 was killed by signal 40; the other ranks were stopped."


def test_a_peer_error_without_a_message_is_named_with_an_empty_first_line(ch):
    ended_rank(ch, 0, 1)
    wd = wd_of(ch)
    wd._track_ended(T0)
    error(ch, 0, "DistBackendError", "", T0 + 0.1)
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1}))
    assert "rank 0 raised DistBackendError:  (a consequence)." in str(err)


def test_the_launchers_own_failure_is_shown_whole():
    def fail():
        e = OSError("no port")
        e.add_note("tried 29500")
        raise e
    try:
        fail()
    except OSError as e:
        failure = e
    c = Channel(2)
    try:
        err = told(c, wd_of(c), Outcome(failure=failure))
    finally:
        c.cleanup()
    assert str(err).split("\n")[0] == "the launch failed before any rank reported an error: OSError: no port"
    assert str(err).split("\n")[1] == "tried 29500"
    lines = err.rank_traceback.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[-2:] == ["OSError: no port", "tried 29500"]
    assert all(ln.startswith(("Traceback", "  ", "OSError", "tried")) for ln in lines), lines


def test_the_one_rank_that_never_joined_is_the_rank_with_its_output(ch):
    ended_rank(ch, 0, 1)
    wd = wd_of(ch, 3)
    wd._track_ended(T0)
    error(ch, 0, "DistBackendError", "Connection reset by peer", T0 + 0.1, base=3)
    ch.write_result(2, b"x")  # rank 2 returned: it joined
    write_log(ch, wd, 1, ["busy elsewhere"])
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1}), nproc=3, node_rank=1)
    assert str(err).startswith("rank(s) 4 never joined the collective rank 3 waited in")
    assert (err.rank, err.ranks, err.kind) == (4, [3, 4], "stalled")
    assert err.rank_traceback == ("--- last output of rank 4 ---\nbusy elsewhere\n"
                                  "--- traceback of rank 3 ---\nTraceback of DistBackendError in rank 3")


def test_sys_exit_carries_its_traceback(ch):
    error(ch, 1, "SystemExit", "3", T0)
    err = told(ch, wd_of(ch))
    assert err.rank_traceback == "--- traceback of rank 1 ---\nTraceback of SystemExit in rank 1"


def silent_ended(ch, wd, r, t, code):
    """A rank that checked in and ended without a result or an error record, as the watchdog noted it."""
    ch.check_in(r)
    wd.ended[r] = (t, code)


@pytest.mark.parametrize("returned,blamed", [(T0 + 5, True), (T0 + 4.9, False)])
def test_a_silent_rank_is_blamed_only_if_it_ended_before_the_launcher_returned(ch, returned, blamed):
    wd = wd_of(ch)
    silent_ended(ch, wd, 1, T0 + 5, -9)
    wd.returned_at = returned
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic")))
    first = str(err).split("\n")[0]
    assert first.startswith("rank 1 was killed by SIGKILL" if blamed else "the launch failed before"), first


@pytest.mark.parametrize("ended_after,blamed", [(1.0, True), (1.5, False)])
def test_a_silent_rank_is_the_cause_only_if_it_ended_within_a_second_of_the_error(ch, ended_after, blamed):
    error(ch, 0, "ValueError", "bad", T0)
    wd = wd_of(ch)
    wd.ended[0] = (T0 + 0.2, 1)
    silent_ended(ch, wd, 1, T0 + ended_after, -9)
    wd.returned_at = T0 + 3
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: -9}))
    first = str(err).split("\n")[0]
    if blamed:
        assert first.startswith("rank 1 was killed by SIGKILL") and "Rank 0 then raised ValueError: bad" in first
    else:
        assert first == "rank 0 raised ValueError: bad"


def test_a_rank_sigtermed_before_the_raiser_ended_is_not_taken_as_stopped_by_elastic(ch):
    """The raiser (rank 0) ended last: only a SIGTERM after it ended is elastic stopping a peer."""
    error(ch, 0, "ValueError", "bad", T0)
    wd = wd_of(ch, 3)
    wd.ended[0] = (T0 + 1.0, 1)
    silent_ended(ch, wd, 2, T0, -9)
    silent_ended(ch, wd, 1, T0 + 0.5, -15)
    wd.returned_at = T0 + 3
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: -15, 2: -9}), nproc=3)
    assert str(err).startswith("rank 1 was killed by SIGTERM")
    assert err.ranks == [1, 2]


def test_exit_codes_blame_the_silent_rank_that_failed_not_the_one_that_exited_0(ch):
    for r in range(2):
        ch.check_in(r)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 0, 1: 3}))
    assert str(err).startswith("rank 1 exited (exit code 3) without returning a result or raising an exception")
    assert (err.rank, err.ranks, err.kind) == (1, [1], "exited")


@pytest.mark.parametrize("code", [-9, 3])
def test_a_silent_rank_unseen_by_the_watchdog_is_not_blamed_for_another_ranks_own_error(ch, code):
    error(ch, 0, "ValueError", "bad", T0)
    ch.check_in(1)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: code}))
    assert str(err).split("\n")[0] == "rank 0 raised ValueError: bad"


def test_a_rank_killed_unseen_by_the_watchdog_is_the_cause_of_a_peers_complaint(ch):
    error(ch, 0, "RuntimeError", "Connection closed by peer", T0)
    ch.check_in(1)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: -9}))
    assert str(err).startswith("rank 1 was killed by SIGKILL") and err.kind == "killed"


def test_the_watchdogs_exit_code_wins_over_the_launchers(ch):
    wd = wd_of(ch)
    silent_ended(ch, wd, 1, T0, -9)
    wd.returned_at = T0 + 1
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={1: 1}))
    assert str(err).startswith("rank 1 was killed by SIGKILL")


def test_the_peer_that_left_no_trace_is_the_cause(ch):
    error(ch, 0, "RuntimeError", "Connection closed by peer", T0)
    ch.check_in(1)
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: 0}))
    assert str(err).startswith("rank 1 exited (exit code 0) without returning a result")
    assert (err.rank, err.ranks) == (1, [1])


def test_seen_ending_together_the_sigkilled_rank_is_named_not_the_sigtermed_one(ch):
    """The watchdog saw both end in one poll and could not read rank 1's code (reaped): the launcher's
    -9 makes rank 1 the failure and rank 0's SIGTERM elastic stopping it."""
    wd = wd_of(ch)
    silent_ended(ch, wd, 0, T0, -15)  # (noted in rank order, as _track_ended walks the ranks)
    silent_ended(ch, wd, 1, T0, None)
    wd.returned_at = T0 + 1
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={1: -9, 0: -15}))
    assert str(err).startswith("rank 1 was killed by SIGKILL")
    assert err.ranks == [1]


def test_a_peer_elastic_stopped_before_the_watchdog_saw_it_is_not_the_cause(ch):
    error(ch, 0, "RuntimeError", "Connection closed by peer", T0)
    wd = wd_of(ch)
    wd.ended[0] = (T0, 1)
    ch.check_in(1)
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: -15}))
    assert str(err).startswith("rank(s) 1 never joined the collective rank 0 waited in")


def test_the_watchdogs_silent_rank_is_named_even_long_after_another_ranks_error(ch):
    """Rank 0 raised and hangs; rank 1 ended silently 5 s later: the watchdog stopped the launch for it."""
    error(ch, 0, "ValueError", "bad", T0)
    wd = wd_of(ch, reason="exited", stalled=[1])
    silent_ended(ch, wd, 1, T0 + 5, 0)
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={1: 0}))
    assert str(err).split("\n")[0] == (
        "rank 1 exited (exit code 0) without returning a result or raising an exception (did the function call "
        "os._exit()/sys.exit(), or did a library end the process?); the other ranks were stopped. "
        "Rank 0 then raised ValueError: bad (a consequence).")
    assert (err.rank, err.ranks, err.kind) == (1, [1], "exited")


def test_the_watchdogs_cause_is_named_not_a_rank_it_killed_itself(ch):
    wd = wd_of(ch, reason="exited", stalled=[1])
    silent_ended(ch, wd, 1, T0, 0)
    silent_ended(ch, wd, 0, T0 + 2.05, -9)  # killed by the watchdog's stop
    err = told(ch, wd)
    assert str(err).startswith("rank 1 exited (exit code 0)") and err.ranks == [0, 1]


def test_of_silent_ranks_the_one_with_a_known_exit_code_is_named(ch):
    wd = wd_of(ch)
    silent_ended(ch, wd, 0, T0 - 0.5, None)
    silent_ended(ch, wd, 1, T0, -9)
    wd.returned_at = T0 + 1
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic")))
    assert str(err).startswith("rank 1 was killed by SIGKILL") and err.ranks == [0, 1]


def test_a_silent_rank_without_an_exit_code_was_killed_from_outside(ch):
    wd = wd_of(ch)
    silent_ended(ch, wd, 1, T0, None)
    wd.returned_at = T0 + 1
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic")))
    assert str(err).startswith("rank 1 ended without returning a result or raising an exception (killed from "
                               "outside, e.g. SIGKILL or the out-of-memory killer")
    assert err.kind == "killed"


# ---- a rank still setting up (checked in, joining the process group): the start limit, and told so ----

def test_a_rank_setting_up_gets_the_start_limit_not_the_stall_limit(ch, clock):
    wd = Recorded(ch, 2, timeout=None, stall_timeout=10.0, on_progress=None, echo=False)
    for r in range(2):
        setting_up(ch, r, T0)
    clock.now = T0 + MIN_START_S  # far past the stall limit, exactly the start limit: not yet
    wd._tick()
    assert wd.reason is None and wd.setting_up == [] and wd.setup_limit is None
    clock.now = T0 + MIN_START_S + 0.5
    wd._tick()
    assert (wd.reason, wd.stalled, wd.setting_up, wd.setup_limit) == ("stalled", [0, 1], [0, 1], MIN_START_S)
    assert wd.killed == [0, 1] and wd.stacks == {0: "stack of local rank 0", 1: "stack of local rank 1"}


def test_a_stall_limit_longer_than_the_start_limit_holds_for_a_rank_setting_up_too(ch, clock):
    limit = MIN_START_S + 40
    wd = Recorded(ch, 2, timeout=None, stall_timeout=limit, on_progress=None, echo=False)
    for r in range(2):
        setting_up(ch, r, T0)
    clock.now = T0 + limit
    wd._tick()
    assert wd.reason is None
    clock.now = T0 + limit + 0.5
    wd._tick()
    assert (wd.reason, wd.setting_up, wd.setup_limit) == ("stalled", [0, 1], limit)


def test_a_running_rank_and_a_rank_setting_up_each_get_their_own_limit(ch, clock):
    """Rank 0 runs (stall limit 10 s), rank 1 still joins (start limit): the launch stalls only when both
    are past their own limit, and only rank 1 is named setting up."""
    wd = Recorded(ch, 2, timeout=None, stall_timeout=10.0, on_progress=None, echo=False)
    running(ch, 0, T0)
    setting_up(ch, 1, T0)
    clock.now = T0 + 30.0  # rank 0 past 10 s, rank 1 within MIN_START_S
    wd._tick()
    assert wd.reason is None
    ch.mark_progress(1, T0 + 20.0)
    clock.now = T0 + MIN_START_S + 10.0  # rank 1: 60 s since its progress, exactly its limit
    wd._tick()
    assert wd.reason is None
    clock.now = T0 + MIN_START_S + 20.5
    wd._tick()
    assert (wd.reason, wd.stalled, wd.setting_up, wd.setup_limit) == ("stalled", [0, 1], [1], MIN_START_S)


def test_a_rank_that_joined_is_held_to_the_stall_limit_again(ch, clock):
    wd = Recorded(ch, 1, timeout=None, stall_timeout=10.0, on_progress=None, echo=False)
    setting_up(ch, 0, T0)
    clock.now = T0 + 30.0
    wd._tick()
    assert wd.reason is None
    ch.set_up(0)  # joined: its progress counts from now, against the stall limit
    ch.mark_progress(0, T0 + 30.0)
    clock.now = T0 + 40.5
    wd._tick()
    assert (wd.reason, wd.stalled, wd.setting_up) == ("stalled", [0], [])


def test_a_stalled_launch_with_ranks_setting_up_says_so_with_the_start_limit(ch, clock):
    """The watchdog's finding as diagnose tells it: the ranks still setting up are named, with the limit
    they were given; every stalled rank is listed; the stacks follow."""
    wd = Recorded(ch, 2, timeout=None, stall_timeout=10.0, on_progress=None, echo=False)
    running(ch, 0, T0)
    setting_up(ch, 1, T0)
    clock.now = T0 + MIN_START_S + 1
    wd._tick()
    err = told(ch, wd, node_rank=1)
    assert said(err) == (
        f"rank(s) 3 stalled while setting up (joining the process group; on GPUs starting CUDA and NCCL's "
        f"communicator): no progress for {MIN_START_S:g} s. All ranks were stopped; each rank's stack follows. "
        "A peer that never joined, an unreachable MASTER_ADDR or a blocked port are the usual causes.")
    assert (err.rank, err.ranks, err.kind) == (None, [2, 3], "stalled")
    assert err.rank_traceback == ("--- stack of rank 2 ---\nstack of local rank 0\n"
                                  "--- stack of rank 3 ---\nstack of local rank 1")


def test_ranks_setting_up_are_each_named_and_one_stalled_rank_is_the_rank(ch):
    for r in range(3):
        ch.check_in(r)
    wd = wd_of(ch, 3, reason="stalled", stalled=[0, 1, 2], setting_up=[0, 2], setup_limit=75.0, stall_timeout=5.0)
    err = told(ch, wd, nproc=3, node_rank=1)
    assert said(err).startswith("rank(s) 3, 5 stalled while setting up (") and "no progress for 75 s." in said(err)
    assert (err.rank, err.ranks) == (None, [3, 4, 5])
    err = told(ch, wd_of(ch, reason="stalled", stalled=[1], setting_up=[1], setup_limit=60.0), node_rank=2)
    assert said(err).startswith("rank(s) 5 stalled while setting up") and (err.rank, err.ranks) == (5, [5])


# ---- every rule's message, word for word (what a user reads first) ----------------------------------

def said(err) -> str:
    """The message a user reads above the traceback."""
    return str(err).split("\n\n")[0]


def test_interrupted_says_all_ranks_were_stopped(ch):
    err = diagnose(ch, wd_of(ch), Outcome(interrupted=True), 2, 0)
    assert str(err) == "stnb.launch interrupted; all ranks were stopped"


def test_timed_out_word_for_word(ch):
    err = told(ch, wd_of(ch, reason="timeout", timeout=2.5))  # before any rank started
    assert "all 2 ranks were stopped. Rank(s) 0, 1 had not even started: creating" in said(err)
    err = told(ch, wd_of(ch, reason="timeout", timeout=2.5), node_rank=1)  # the second node's: global ranks
    assert "Rank(s) 2, 3 had not even started" in said(err) and "--- stack of rank 3 ---\n(had not" in err.rank_traceback
    ch.check_in(0)
    wd = wd_of(ch, reason="timeout", timeout=2.5, stacks={0: "S0"})
    err = told(ch, wd)
    assert said(err) == ("launch timed out after 2.5 s; all 2 ranks were stopped. Rank(s) 1 had not even started: "
                         "creating the processes took longer than the timeout (a busy machine, a slow import). Raise "
                         "timeout=... or make the run shorter.")
    assert err.rank_traceback == ("--- stack of rank 0 ---\nS0\n--- stack of rank 1 ---\n(had not started: the "
                                  "process was still being created, no stack to ask for)")
    ch.check_in(1)  # checked in after the watchdog asked for the stacks: started, no stack, not named as late
    err = told(ch, wd)
    assert said(err).endswith("ranks were stopped. Raise timeout=... or make the run shorter.")
    assert err.rank_traceback == "--- stack of rank 0 ---\nS0"
    wd.stacks[1] = ""
    err = told(ch, wd)
    assert said(err) == "launch timed out after 2.5 s; all 2 ranks were stopped. Raise timeout=... or make the " \
                        "run shorter."
    assert err.rank_traceback == "--- stack of rank 0 ---\nS0\n--- stack of rank 1 ---\n(no stack captured)"


def test_not_started_word_for_word_with_the_stacks(ch):
    ch.check_in(0)
    wd = wd_of(ch, reason="not started", stalled=[1], stall_timeout=10.0, stacks={0: "S0"})
    err = told(ch, wd, node_rank=1)
    assert said(err) == (
        f"rank(s) 3 did not start within {MIN_START_S:g} s after the launch began (fork); all ranks were stopped. "
        "This usually means the process forked while another thread held a lock; run the launch again, and "
        "report it if it repeats.")
    assert err.rank_traceback == ("--- stack of rank 2 ---\nS0\n--- stack of rank 3 ---\n(had not started: the process "
                                  "was still being created, no stack to ask for)")
    err = told(ch, wd, start_method="spawn")
    assert said(err).endswith(
        "after the launch began (spawn); all ranks were stopped. Spawned ranks import torch and the training "
        "stack themselves, which a busy machine slows down; raise stall_timeout=..., or run the launch again.")


def test_spawned_rank_never_ran_word_for_word(ch):
    out = Outcome(failure=RuntimeError("elastic"), exit_codes={0: 0, 1: 2})
    err = told(ch, wd_of(ch), out, start_method="spawn", node_rank=1)
    assert said(err) == (
        "rank 3 exited (exit code 2) while its new Python process was starting, before stnb's code ran in it "
        "(start_method='spawn'); the other ranks were stopped. A spawned rank first imports the script that "
        "launched it: in a script, call stnb.launch / stnb.run under `if __name__ == \"__main__\":`. The rank's "
        "own error is on this process's stderr.")
    assert (err.rank, err.ranks, err.kind) == (3, [3], "exited")


def test_a_spawned_rank_killed_before_it_ran_is_not_taken_for_a_script_without_the_guard(ch):
    """Killed by a signal (a negative code) is not the interpreter failing to start: told as killed."""
    err = told(ch, wd_of(ch), Outcome(failure=RuntimeError("elastic"), exit_codes={1: -9}), start_method="spawn")
    assert said(err).startswith("rank 1 was killed by SIGKILL") and err.kind == "killed"


def test_stalled_word_for_word_with_the_stacks(ch):
    for r in range(2):
        ch.check_in(r)
    wd = wd_of(ch, reason="stalled", stalled=[0, 1], stall_timeout=7.5, stacks={0: "S0\n", 1: "S1"})
    err = told(ch, wd)
    assert said(err) == (
        "rank(s) 0, 1 stalled: no progress for 7.5 s (e.g. waiting in a collective another rank never entered). "
        "All ranks were stopped; each rank's stack at the time of the stall follows. Raise stall_timeout=... "
        "(or None) if the work is legitimately long, or call stnb.heartbeat() in long loops.")
    assert err.rank_traceback == "--- stack of rank 0 ---\nS0\n--- stack of rank 1 ---\nS1"


def test_raised_then_peers_stalled_word_for_word(ch):
    error(ch, 1, "ValueError", "bad batch\nsecond line", T0, base=2)
    ch.check_in(0)
    wd = wd_of(ch, reason="stalled", stalled=[0], stall_timeout=12.0, stacks={0: "S0"})
    err = told(ch, wd, node_rank=1)
    assert said(err) == ("rank 3 raised ValueError: bad batch\nsecond line (rank(s) 2 then waited for it with no "
                         "progress for 12 s and all ranks were stopped)")
    assert (err.rank, err.ranks, err.kind) == (3, [2, 3], "raised")
    assert err.rank_traceback == ("--- traceback of rank 3 ---\nTraceback of ValueError in rank 3\n"
                                  "--- stack of rank 2 ---\nS0")


def test_a_rank_out_of_memory_whose_peers_then_stalled_is_told_as_out_of_memory(ch):
    """The mutation run: the kind of a raise whose peers then stalled was not checked (a rank past its memory budget,
    whose peer waited in a collective): 'out_of_memory', like the same raise without the stall."""
    error(ch, 1, "OutOfMemory", "rank 1 ran out of its memory budget", T0)
    ch.check_in(0)
    wd = wd_of(ch, reason="stalled", stalled=[0], stall_timeout=12.0, stacks={0: "S0"})
    err = told(ch, wd)
    assert said(err).startswith("rank 1 raised OutOfMemory: rank 1 ran out of its memory budget (rank(s) 0 then waited")
    assert (err.rank, err.ranks, err.kind) == (1, [0, 1], "out_of_memory")


def test_ended_silently_word_for_word(ch):
    wd = wd_of(ch)
    silent_ended(ch, wd, 1, T0, None)
    wd.returned_at = T0 + 1
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic")))
    assert said(err) == (
        "rank 1 ended without returning a result or raising an exception (killed from outside, e.g. SIGKILL or "
        "the out-of-memory killer - try a smaller batch size - or os._exit()); the other ranks were stopped.")
    # rank 0 returned and ended first; rank 1 ended silently after it, its exit code read by no one
    wd = wd_of(ch, reason="exited", stalled=[1])
    ch.write_result(0, b"x")
    wd.ended = {0: (T0, 0)}
    silent_ended(ch, wd, 1, T0 + 1, None)
    err = told(ch, wd)
    assert said(err) == (
        "rank 1 exited (exit code unknown) without returning a result or raising an exception (did the function "
        "call os._exit()/sys.exit(), or did a library end the process?); the other ranks were stopped.")
    assert err.kind == "exited"


def test_ended_silently_with_a_peers_error_shows_the_output_then_the_traceback(ch):
    ended_rank(ch, 1, "SIGKILL")
    wd = wd_of(ch)
    wd._track_ended(T0)
    error(ch, 0, "RuntimeError", "Connection closed by peer\nmore", T0 + 0.5, base=2)
    write_log(ch, wd, 1, ["step 3"])
    wd.returned_at = T0 + 1
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: -9}), node_rank=1)
    assert said(err) == ("rank 3 was killed by SIGKILL (from outside, or by the out-of-memory killer: try a smaller "
                         "batch size); the other ranks were stopped. Rank 2 then raised RuntimeError: Connection "
                         "closed by peer (a consequence).")
    assert err.rank_traceback == ("--- last output of rank 3 ---\nstep 3\n"
                                  "--- traceback of rank 2 ---\nTraceback of RuntimeError in rank 2")
    # without output: the traceback alone, no blank line before it
    wd.relay.logs.clear()
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: -9}), node_rank=1)
    assert err.rank_traceback == "--- traceback of rank 2 ---\nTraceback of RuntimeError in rank 2"


def test_never_joined_word_for_word(ch):
    ended_rank(ch, 0, 1)
    wd = wd_of(ch, 3)
    wd._track_ended(T0)
    error(ch, 0, "DistBackendError", "Connection reset by peer\ndetails", T0 + 0.1)
    write_log(ch, wd, 1, ["r1"])
    write_log(ch, wd, 2, ["r2"])
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1}), nproc=3)
    assert said(err) == (
        "rank(s) 1, 2 never joined the collective rank 0 waited in: rank 0 raised DistBackendError: Connection "
        "reset by peer (a consequence). Rank(s) 1, 2 were busy elsewhere or hung and were stopped; their last "
        "output follows.")
    assert err.rank_traceback == ("--- last output of rank 1 ---\nr1\n--- last output of rank 2 ---\nr2\n"
                                  "--- traceback of rank 0 ---\nTraceback of DistBackendError in rank 0")


def test_sys_exit_word_for_word(ch):
    error(ch, 1, "SystemExit", "3", T0)
    err = told(ch, wd_of(ch))
    assert said(err) == ("rank 1 raised SystemExit: 3 (sys.exit() ends a rank without a result; return a value "
                         "from the function instead)")


def test_raised_lists_every_other_rank_that_failed(ch):
    error(ch, 0, "RuntimeError", "Broken pipe", T0 + 2)
    error(ch, 1, "ValueError", "bad label", T0 + 1)
    error(ch, 2, "RuntimeError", "Connection closed by peer", T0)
    err = told(ch, wd_of(ch, 3), Outcome(failure=RuntimeError("elastic"), exit_codes={0: 1, 1: 1, 2: 1}), nproc=3)
    assert said(err) == "rank 1 raised ValueError: bad label (rank(s) 0, 2 failed too)"
    assert (err.rank, err.ranks, err.kind) == (1, [0, 1, 2], "raised")


def test_an_exit_code_0_the_watchdog_could_not_read_is_taken_from_the_launcher(ch):
    """Reaped before the watchdog read it: the launcher's 0 says the rank exited, not that it was killed."""
    wd = wd_of(ch)
    silent_ended(ch, wd, 1, T0, None)
    wd.returned_at = T0 + 1
    err = told(ch, wd, Outcome(failure=RuntimeError("elastic"), exit_codes={1: 0}))
    assert said(err).startswith("rank 1 exited (exit code 0) without returning a result") and err.kind == "exited"


def test_not_started_names_every_rank_that_did_not_start(ch):
    wd = wd_of(ch, 3, reason="not started", stalled=[1, 2], stall_timeout=10.0)
    err = told(ch, wd, nproc=3, node_rank=1)
    assert said(err).startswith(f"rank(s) 4, 5 did not start within {MIN_START_S:g} s")
    assert (err.ranks, err.kind) == ([4, 5], "stalled")


def test_a_raiser_whose_peers_stalled_names_every_stalled_peer(ch):
    error(ch, 0, "ValueError", "bad", T0)
    for r in (1, 2):
        ch.check_in(r)
    err = told(ch, wd_of(ch, 3, reason="stalled", stalled=[1, 2], stall_timeout=12.0), nproc=3)
    assert said(err) == ("rank 0 raised ValueError: bad (rank(s) 1, 2 then waited for it with no progress for 12 s "
                         "and all ranks were stopped)")
    assert err.ranks == [0, 1, 2]
