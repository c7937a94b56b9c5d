"""Each strategy's own cross-rank check compares what the ranks held with what was asked, at exactly the
tolerance docs/strategies.md states: a partition at the bound passes, one value past it fails, naming the
values. (A check that compared an observation with itself, or a tolerance loosened, passes the second.)

In-process: ``check_ranks`` reads only each rank's verification record."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stnb import strategies


def _ranks(*records):
    return [SimpleNamespace(verification=r) for r in records]


@pytest.mark.parametrize("extra, ok", [(0, True), (1, False)])
def test_zero1_a_rank_holds_at_most_1_over_n_plus_the_largest_tensor_plus_one(extra, ok):
    total, largest = 1000, 10
    bound = total // 2 + largest + 1  # docs: fails above total / N + largest + 1
    held = [bound + extra, total - bound - extra]

    def rec(names, numel):
        return {"optimizer_partition": names, "optimizer_partition_numel": numel, "optimizer_all_numel": total,
                "largest_param_numel": largest, "optimizer_state_params": len(names)}

    info, problems = strategies.get("zero1").check_ranks(_ranks(rec(["a"], held[0]), rec(["b"], held[1])), 2)
    assert info["optimizer_partition_fractions"] == [h / total for h in held]
    assert (problems == []) is ok, problems
    if not ok:
        assert problems == [f"a rank's optimizer partition holds {held[0]} of {total} values; over 2 ranks it "
                            f"should hold about {total / 2:.0f}"]


@pytest.mark.parametrize("extra, ok", [(0, True), (1, False)])
def test_deepspeed_each_partition_within_one_percent_plus_64_of_1_over_n(extra, ok):
    total = 100_000
    bound = total // 2 + int(0.01 * total) + 64  # docs: within 1 % of the total plus 64 values of total / N
    held = [bound + extra, total - bound - extra]
    padding = 7  # the flat partition's padding is not a parameter value: subtracted before comparing

    def rec(numel):
        return {"trainable_numel": total, "partition_numel": numel + padding, "partition_padding": padding}

    info, problems = strategies.get("deepspeed").check_ranks(_ranks(rec(held[0]), rec(held[1])), 2)
    assert info["optimizer_partition_fractions"] == [h / total for h in held]
    assert (problems == []) is ok, problems
    if not ok:
        assert problems == [f"the ranks' optimizer partitions hold {held} of {total} values; over 2 ranks each "
                            f"should hold about {total / 2:.0f}"]


def test_deepspeed_partitions_must_cover_every_trained_value():
    rec = [{"trainable_numel": 1000, "partition_numel": 500, "partition_padding": 0},
           {"trainable_numel": 1000, "partition_numel": 499, "partition_padding": 0}]
    _, problems = strategies.get("deepspeed").check_ranks(_ranks(*rec), 2)
    assert problems == ["the ranks' optimizer partitions cover 999 parameter values, the optimizer updates 1000"]


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_sharded_parameters_add_up_exactly(strategy):
    s = strategies.get(strategy)
    whole = {"local_param_count": 500, "total_param_count": 1000}
    assert s.check_ranks(_ranks(whole, whole), 2)[1] == []
    short = {"local_param_count": 499, "total_param_count": 1000}
    info, problems = s.check_ranks(_ranks(whole, short), 2)
    assert info["shards_add_up"] is False and problems == ["the ranks' local shards hold 999 parameter values, "
                                                           "the model has 1000"]
