"""stnb.memory: predicted per-rank bytes (pure arithmetic) and predicted-vs-measured for a real run."""

from __future__ import annotations

import pytest

import stnb
from stnb import ConfigError, RunResult, TrainConfig
from stnb import memory

P = 1_000_000


def test_single_and_dp_hold_the_full_state():
    for strategy in ("single", "dp"):
        p = memory.predict(strategy, P, world_size=4)
        assert p == {"params": 4 * P, "grads": 4 * P, "optimizer_state": 8 * P, "ddp_buckets": 0, "total": 16 * P}


def test_ddp_adds_gradient_buckets_unless_bucket_view():
    p = memory.predict("ddp", P, world_size=2)
    assert p["ddp_buckets"] == 4 * P and p["total"] == 20 * P
    v = memory.predict("ddp", P, world_size=2, gradient_as_bucket_view=True)
    assert v["ddp_buckets"] == 0 and v["total"] == 16 * P
    # world size does not change what one DDP rank holds
    assert memory.predict("ddp", P, world_size=8) == p


def test_fsdp_divides_every_part_by_world_size_rounding_up():
    p = memory.predict("fsdp", P, world_size=4)
    assert p == {"params": P, "grads": P, "optimizer_state": 2 * P, "ddp_buckets": 0, "total": 4 * P}
    odd = memory.predict("fsdp", 7, world_size=2)
    assert odd["params"] == 14 and odd["grads"] == 14 and odd["optimizer_state"] == 28
    three = memory.predict("fsdp", 10, world_size=3)
    assert three["params"] == 14  # ceil(40 / 3)


def test_trainable_count_bytes_and_optimizer():
    p = memory.predict("single", P, trainable_param_count=P // 2, bytes_per_param=2, optimizer="sgd")
    assert p == {"params": 2 * P, "grads": P, "optimizer_state": 0, "ddp_buckets": 0, "total": 3 * P}
    assert memory.predict("single", P, optimizer="sgd_momentum")["optimizer_state"] == 4 * P


@pytest.mark.parametrize("kwargs, match", [
    (dict(strategy="zero3", param_count=P), "unknown strategy"),
    (dict(strategy="ddp", param_count=-1), "param_count"),
    (dict(strategy="ddp", param_count=P, world_size=0), "world_size"),
    (dict(strategy="ddp", param_count=P, trainable_param_count=P + 1), "larger than"),
    (dict(strategy="ddp", param_count=P, optimizer="lion"), "unknown optimizer"),
])
def test_bad_arguments_name_the_problem(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        memory.predict(**kwargs)


def test_predict_table_has_one_row_per_strategy():
    t = memory.predict_table(P, world_size=2)
    assert list(t["strategy"]) == ["single", "dp", "ddp", "fsdp"]
    assert t.set_index("strategy").loc["fsdp", "total_mib"] == pytest.approx(8 * P / 2**20)


def _fake_result(strategy, world_size, breakdown, total=1000, local=None, **kw):
    return RunResult(strategy=strategy, world_size=world_size, per_device_batch_size=4,
                     global_batch_size=4 * world_size, steps=3, samples_per_second=10.0, step_times=[1.0] * 3,
                     losses=[1.0, 0.9, 0.8], peak_memory_bytes=[10**6] * world_size,
                     local_param_count=local or [total] * world_size, total_param_count=total, verified=True,
                     verification={}, model="tiny", device="cpu", versions={}, memory_breakdown=breakdown, **kw)


def test_compare_fsdp_reads_the_trainable_count_from_sharded_grads():
    # 1000 params, 10 frozen: each of 2 ranks holds 500 params, 495 grads, 990 Adam numbers
    shard = {"params": 2000, "grads": 1980, "optimizer_state": 3960, "total": 7940}
    df = memory.compare(_fake_result("fsdp", 2, [shard, shard], local=[500, 500]))
    assert sorted(df["rank"].unique()) == [0, 1]
    row = df[(df["rank"] == 1) & (df["component"] == "grads")].iloc[0]
    assert row["predicted_bytes"] == 1980 and row["measured_bytes"] == 1980
    assert row["measured_over_predicted"] == pytest.approx(1.0)
    assert "ddp_buckets" not in set(df["component"])


def test_compare_ddp_marks_buckets_as_not_measured():
    full = {"params": 4000, "grads": 4000, "optimizer_state": 8000, "total": 16000}
    df = memory.compare(_fake_result("ddp", 2, [full, full]))
    b = df[(df["rank"] == 0) & (df["component"] == "ddp_buckets")].iloc[0]
    assert b["predicted_bytes"] == 4000 and b["measured_bytes"] is __import__("pandas").NA
    assert "not measured" in b["note"]
    tot = df[(df["rank"] == 0) & (df["component"] == "total")].iloc[0]
    assert tot["predicted_bytes"] == tot["measured_bytes"] == 16000


def test_compare_accepts_a_results_frame_row_and_refuses_unrunnable_rows():
    full = {"params": 4000, "grads": 4000, "optimizer_state": 8000, "total": 16000}
    row = stnb.results_frame([_fake_result("single", 1, [full])]).iloc[0]
    assert len(memory.compare(row)) == 5  # params, grads, optimizer_state, total, peak
    unrunnable = _fake_result("dp", 1, [], status="not runnable here", reason="needs 2 GPUs")
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        memory.compare(unrunnable)


def test_prediction_matches_a_real_single_process_run():
    result = stnb.run(TrainConfig(strategy="single", model="tiny", steps=3, per_device_batch_size=4,
                                  train_size=64, dev_size=16), echo=False)
    measured = result.memory_breakdown[0]
    trainable = measured["grads"] // 4  # the unused pooler is frozen: no grad, no Adam state
    pred = memory.predict("single", result.total_param_count, 1, trainable_param_count=trainable)
    assert pred["params"] == pytest.approx(measured["params"], rel=0.01)
    assert pred["optimizer_state"] == pytest.approx(measured["optimizer_state"], rel=0.01)
    df = memory.compare(result)
    state = df[df["component"].isin(["params", "grads", "optimizer_state", "total"])]
    assert state["measured_over_predicted"].between(0.99, 1.01).all(), df
