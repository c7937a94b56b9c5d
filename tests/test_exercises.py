"""The "implement it yourself" checkers (stnblab.exercises, notebooks 03 and 09): each passes the reference
solution (tests/exercise_solutions.py) in 2 and 3 real ranks and fails each wrong attempt with a verdict
naming the rank and the first wrong element. 3 ranks on a 2-core machine start through torchrun (stnb.launch
gives each gloo rank a core), so these are multi-process runs of 10-30 s each: marked slow."""

from __future__ import annotations

import re

import pytest

import exercise_solutions as sol
import procs
from stnblab import exercises

pytestmark = pytest.mark.slow


def _line(verdict, world: int) -> str:
    return next(line for line in verdict.lines if line.startswith(f"{world} ranks"))


# ------------------------------------------------------------------------------------ ring all-reduce --

def test_a_ring_all_reduce_passes_in_2_and_3_ranks():
    verdict = exercises.check_ring_all_reduce(sol.ring_all_reduce)
    assert verdict.passed and bool(verdict), verdict
    assert str(verdict).startswith("ring all-reduce: PASSED")
    assert [ln.split(",")[0] for ln in verdict.lines] == ["2 ranks", "3 ranks"]
    assert all(n % w for n in exercises.RING_LENGTHS for w in exercises.WORLDS)  # lengths no world divides


def test_a_sum_returned_as_a_new_tensor_passes_too():
    assert exercises.check_ring_all_reduce(sol.returns_a_new_tensor, worlds=(2,)).passed


def test_a_neighbour_swap_passes_on_2_ranks_and_fails_on_3():
    """Why 3 ranks are checked: swapping with one neighbour is the sum for 2 ranks only."""
    verdict = exercises.check_ring_all_reduce(sol.neighbour_swap)
    assert not verdict.passed
    assert "every rank holds the sum" in _line(verdict, 2)
    assert re.fullmatch(r"3 ranks: rank \d: element \d+ of 7 is -?\d+, torch\.distributed\.all_reduce gives -?\d+ "
                        r"\(\d+ of 7 values differ\)", _line(verdict, 3)), verdict


def test_the_reduce_scatter_without_its_all_gather_fails_naming_an_unchanged_element():
    verdict = exercises.check_ring_all_reduce(sol.ring_without_all_gather, worlds=(2,))
    assert not verdict.passed
    assert re.match(r"2 ranks: rank 0: element 0 of 7 is -?\d+ \(unchanged from before the call\), "
                    r"torch\.distributed\.all_reduce gives -?\d+", _line(verdict, 2)), verdict


def test_an_average_is_not_the_all_reduces_sum():
    verdict = exercises.check_ring_all_reduce(sol.ring_average, worlds=(2,))
    assert not verdict.passed and "torch.distributed.all_reduce gives" in _line(verdict, 2), verdict


def test_calling_the_library_collective_is_refused():
    verdict = exercises.check_ring_all_reduce(sol.library_all_reduce, worlds=(2,))
    assert not verdict.passed
    assert "called dist.all_reduce; the exercise builds the all-reduce from point-to-point messages" in verdict.lines[0]


def test_an_attempt_that_raises_is_reported_with_its_rank_and_error():
    """Equal chunks (t.view(N, -1)) break on a length the world size does not divide."""
    verdict = exercises.check_ring_all_reduce(sol.equal_chunks, worlds=(2,))
    assert not verdict.passed
    assert verdict.lines == ["2 ranks: rank 0: raised RuntimeError: shape '[2, -1]' is invalid for input of size 7 "
                             "(tensor of 7 elements)"]


def _stray_ranks() -> set:
    """Rank processes of either way of starting them still alive: children of this process (stnb.launch) or
    torchrun's workers started from this process."""
    return procs.oversubscribed_ranks() | {c.pid for c in procs.children()}


# the attempts below wait for a partner forever: each rank gives up after QUICK_LIMIT_S seconds here (a student's
# attempt gets exercises.LIMIT_S, 20 s)
QUICK_LIMIT_S = 4


def test_an_attempt_that_waits_forever_is_stopped_and_leaves_no_process():
    """Every rank waits to receive and none sends: each rank gives up after ``limit_s`` seconds and says so, in
    forked ranks (2) and torchrun's (3); no rank is left running."""
    before = _stray_ranks()
    verdict = exercises.check_ring_all_reduce(sol.receive_only, limit_s=QUICK_LIMIT_S)
    assert not verdict.passed
    for world in (2, 3):  # which ranks give up first depends on the timing: those left lose their partner
        assert re.fullmatch(rf"{world} ranks: rank\(s\) [0-2](, [0-2])* did not finish in {QUICK_LIMIT_S} s: a "
                            r"receive whose send never comes \(or a blocking send that no rank receives\) waits "
                            r"forever", _line(verdict, world)), verdict
    assert _stray_ranks() - before == set()


def test_a_rank_whose_attempt_raises_is_named_though_its_partner_waits_for_it():
    verdict = exercises.check_ring_all_reduce(sol.fails_on_rank_1, limit_s=QUICK_LIMIT_S)
    for world in (2, 3):
        assert _line(verdict, world) == (f"{world} ranks: rank 1: raised ValueError: rank 1 gave up (tensor of 7 "
                                         "elements); the other ranks waited for it until they were stopped"), verdict


# ----------------------------------------------------------------------------------------- ZeRO-1 step --

def test_a_zero1_step_passes_in_2_and_3_ranks():
    verdict = exercises.check_zero1_step(sol.zero1_step)
    assert verdict.passed, verdict
    assert "optimizer state per rank 13, 12 of 25" in _line(verdict, 2)
    assert "optimizer state per rank 9, 8, 8 of 25" in _line(verdict, 3)


def test_one_devices_step_on_the_local_gradients_fails():
    verdict = exercises.check_zero1_step(sol.plain_adamw, worlds=(2,))
    assert not verdict.passed
    assert re.match(r"2 ranks: rank 0: element \d+ of the 25 flattened parameters \(parameter \d of shape \(.*\), "
                    r"index .*\) is -?[\d.]+, one AdamW step on the full parameters gives -?[\d.]+", verdict.lines[0])


def test_right_values_with_the_whole_state_on_every_rank_fail():
    verdict = exercises.check_zero1_step(sol.unsharded_adamw, worlds=(2,))
    assert not verdict.passed
    assert "the ranks' AdamW states cover 25 + 25 = 50 values, the parameters have 25" in verdict.lines[0]


def test_a_step_without_the_all_gather_leaves_the_other_slices_unchanged():
    verdict = exercises.check_zero1_step(sol.zero1_without_all_gather, worlds=(3,))
    assert not verdict.passed
    assert "(unchanged from before the call), one AdamW step on the full parameters gives" in verdict.lines[0]


def test_the_optimizer_must_be_returned():
    verdict = exercises.check_zero1_step(sol.zero1_returns_nothing, worlds=(2,))
    assert verdict.lines == ["2 ranks: rank 0: returned NoneType, not the torch.optim.Optimizer that took the step"]


def test_ranks_saying_why_at_once_each_write_whole_lines(tmp_path):
    """Ranks share the launch's output and run unbuffered (torchrun's): print() writes a line and its newline
    apart, so one rank's line could end inside another's (a CI run read 'did not finish in 4 sstnblab.exercises:
    rank 1: ...'). Three processes say 2,000 lines each at once; every line is whole, and the verdict reads a
    broken line too."""
    import subprocess
    import sys

    out = tmp_path / "out.txt"
    code = ("import sys; from stnblab.exercises import _say, GAVE_UP\n"
            "for _ in range(2000): _say(sys.argv[1], f'{GAVE_UP} 4 s')")
    with open(out, "ab") as shared:
        procs = [subprocess.Popen([sys.executable, "-u", "-c", code, str(r)], stdout=shared) for r in range(3)]
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    lines = out.read_text().splitlines()
    assert len(lines) == 6000
    assert [ln for ln in lines if not re.fullmatch(r"stnblab\.exercises: rank [0-2]: did not finish in 4 s", ln)] == []
    broken = f"{exercises.SAID}0: {exercises.GAVE_UP} 4 s{exercises.SAID}1: {exercises.GAVE_UP} 4 s\n"
    assert exercises._from_output(broken).startswith("rank(s) 0, 1 did not finish in 4 s: a receive whose")
