"""The exercises of notebooks 00, 01, 04 and 05 (stnblab.exercises): each checker passes the reference solution
(tests/exercise_solutions.py) and fails each wrong attempt there, naming the case and what was expected. The
number checkers run in this process; 00's rank maximum runs in 2 and 3 real ranks (slow)."""

from __future__ import annotations

import pytest

import exercise_solutions as sol
from stnblab import exercises


def test_samples_per_second_passes_the_reference_and_fails_each_slip():
    assert exercises.check_samples_per_second(sol.samples_per_second).passed
    warm = exercises.check_samples_per_second(sol.samples_per_second_with_warmup)
    assert not warm.passed and warm.lines == [
        "step times [2.0, 0.5, 0.5, 0.5], global batch 8, warm-up 1: 9.14286, expected 16 (the global batch times "
        "the steps after the warm-up, over those steps' seconds)"], warm
    mean = exercises.check_samples_per_second(sol.mean_of_step_rates)
    assert not mean.passed and mean.lines[0].startswith("step times [3.0, 1.0, 0.25, 0.75], global batch 32, "
                                                        "warm-up 2: 85.3333, expected 64"), mean


def test_samples_per_second_checks_against_a_real_runs_own_figure():
    """A one-device run's RunResult (its own step times, global batch and warm-up) against its samples_per_second:
    the formula the exercise asks for is the one stnb reports."""
    from types import SimpleNamespace

    times = [1.5, 0.25, 0.5, 0.25]
    run = SimpleNamespace(step_times=times, global_batch_size=8, steps=4, config={"warmup_steps_excluded": 1},
                          samples_per_second=8 * 3 / 1.0)
    assert exercises.check_samples_per_second(sol.samples_per_second, run).passed
    run.samples_per_second = 8 * 4 / 2.5  # a result whose figure counted the warm-up: the check says so
    verdict = exercises.check_samples_per_second(sol.samples_per_second, run)
    assert not verdict.passed and verdict.lines[0].startswith("this run (4 steps, global batch 8, warm-up 1): 24, "
                                                              "expected 12.8"), verdict


@pytest.mark.slow
def test_samples_per_second_on_a_real_run(tmp_path):
    import stnb

    run = stnb.run(stnb.TrainConfig(strategy="single", model="tiny", steps=5, per_device_batch_size=4,
                                    train_size=64, evaluate=False, warmup_steps_excluded=2), echo=False)
    verdict = exercises.check_samples_per_second(sol.samples_per_second, run)
    assert verdict.passed and verdict.lines == ["4 cases, each as stnb computes it"], verdict
    assert not exercises.check_samples_per_second(sol.samples_per_second_with_warmup, run).passed


def test_zero_bytes_passes_the_reference_and_fails_each_slip():
    verdict = exercises.check_zero_bytes(sol.zero_bytes)
    assert verdict.passed and verdict.lines == ["12 cases, each as stnb computes it"], verdict
    two = exercises.check_zero_bytes(sol.zero_bytes_stage2_shards_parameters)
    assert two.lines == ["stage 2, 2 ranks, 1,200 parameters: 9,600, expected 12,000 (stage 2 divides optimizer, "
                         "gradients by 2; each rank keeps parameters whole)"], two
    adam = exercises.check_zero_bytes(sol.zero_bytes_one_adam_state)
    assert not adam.passed and adam.lines[0].startswith("stage 0, 2 ranks, 1,200 parameters: 14,400, expected 19,200")


def test_overall_passes_the_reference_and_fails_the_worst_tensor():
    assert exercises.check_overall(sol.overall).passed
    worst = exercises.check_overall(sol.overall_worst_tensor)
    assert not worst.passed and worst.lines[0].startswith("a run a little apart: ")
    assert worst.lines[0].endswith("(the norm of (run - one device) over every tensor together, over the norm of "
                                   "(one device - initial))")


def test_an_answer_that_raises_or_is_not_a_number_fails_with_the_case():
    def broken(*args):
        raise KeyError("encoder.bias")

    assert exercises.check_overall(broken).lines == ["a run a little apart: raised KeyError: 'encoder.bias'"]
    assert exercises.check_zero_bytes(lambda *a: "lots").lines == [
        "stage 0, 2 ranks, 1,200 parameters: returned 'lots', not a number"]


@pytest.mark.slow
def test_rank_max_passes_in_2_and_3_ranks_and_a_sum_fails():
    verdict = exercises.check_rank_max(sol.rank_max)
    assert verdict.passed and verdict.lines == [f"{w} ranks: every rank holds the element-wise maximum over the ranks"
                                                for w in (2, 3)], verdict
    wrong = exercises.check_rank_max(sol.rank_sum, worlds=(2,))
    assert not wrong.passed and wrong.lines[0].startswith("2 ranks: rank 0: element "), wrong
    assert "torch.distributed.all_reduce(op=MAX) gives" in wrong.lines[0], wrong
