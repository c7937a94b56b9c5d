"""stnb.memory: predicted per-rank bytes (pure arithmetic) and predicted-vs-measured for a real run."""

from __future__ import annotations

import os

import pytest

import stnb
from stnb import ConfigError, RunResult, TrainConfig
from stnb import memory

P = 1_000_000


def test_single_and_dp_hold_the_full_state():
    for strategy in ("single", "dp"):
        p = memory.predict(strategy, P, world_size=4)
        assert p == {"params": 4 * P, "grads": 4 * P, "optimizer_state": 8 * P, "ddp_buckets": 0, "gathered_params": 0, "total": 16 * P}


def test_ddp_adds_gradient_buckets_unless_bucket_view():
    p = memory.predict("ddp", P, world_size=2)
    assert p["ddp_buckets"] == 4 * P and p["total"] == 20 * P
    v = memory.predict("ddp", P, world_size=2, gradient_as_bucket_view=True)
    assert v["ddp_buckets"] == 0 and v["total"] == 16 * P
    # world size does not change what one DDP rank holds
    assert memory.predict("ddp", P, world_size=8) == p


def test_fsdp_divides_every_part_by_world_size_rounding_up():
    p = memory.predict("fsdp", P, world_size=4)
    assert p == {"params": P, "grads": P, "optimizer_state": 2 * P, "ddp_buckets": 0, "gathered_params": 0, "total": 4 * P}
    odd = memory.predict("fsdp", 7, world_size=2)
    assert odd["params"] == 14 and odd["grads"] == 14 and odd["optimizer_state"] == 28
    three = memory.predict("fsdp", 10, world_size=3)
    assert three["params"] == 14  # ceil(40 / 3)


def test_zero_stages_shard_optimizer_then_gradients_then_parameters():
    """ZeRO-1 divides the optimizer state, ZeRO-2 also the gradients (its parameters are whole during the
    step: gathered_params), ZeRO-3 (fsdp) everything; each strategy's own ``held`` says so."""
    z1, z2, z3 = (memory.predict(s, P, world_size=4) for s in ("zero1", "zero2", "fsdp"))
    assert (z1["params"], z1["grads"], z1["optimizer_state"], z1["ddp_buckets"]) == (4 * P, 4 * P, 2 * P, 4 * P)
    assert (z2["grads"], z2["optimizer_state"], z2["gathered_params"]) == (P, 2 * P, 3 * P)
    assert z2["params"] + z2["gathered_params"] == 4 * P  # whole from its forward through its backward
    assert (z3["params"], z3["grads"], z3["optimizer_state"], z3["gathered_params"]) == (P, P, 2 * P, 0)
    for name in ("zero1", "zero2", "fsdp"):
        held = stnb.strategies.get(name).held(4)
        assert held["optimizer_state"] == 0.25
    assert stnb.strategies.get("zero1").held(4)["grads"] == 1.0
    assert stnb.strategies.get("zero2").held(4)["grads"] == 0.25


def test_trainable_count_bytes_and_optimizer():
    p = memory.predict("single", P, trainable_param_count=P // 2, bytes_per_param=2, optimizer="sgd")
    assert p == {"params": 2 * P, "grads": P, "optimizer_state": 0, "ddp_buckets": 0, "gathered_params": 0, "total": 3 * P}
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
    assert list(t["strategy"]) == list(stnb.strategies.names())
    assert t.set_index("strategy").loc["fsdp", "total_mib"] == pytest.approx(8 * P / 2**20)


def test_predict_table_rows_are_predict_for_each_strategy_and_its_world():
    """Each row is ``predict`` for that strategy, with the world size it runs in (one process for
    single / dp), the trainable count and options passed through; the default world is 2."""
    t = memory.predict_table(P, world_size=4, trainable_param_count=P // 2, optimizer="sgd_momentum")
    assert list(t["world_size"]) == [1 if not stnb.strategies.is_distributed(s) else 4 for s in stnb.strategies.names()]
    assert list(t["world_size"])[:3] == [1, 1, 4]  # single, dp, ddp
    for row in t.to_dict("records"):
        want = memory.predict(row["strategy"], P, row["world_size"], P // 2, optimizer="sgd_momentum")
        assert {k: row[f"{k}_mib"] for k in want} == pytest.approx({k: v / 2**20 for k, v in want.items()})
    assert list(memory.predict_table(P)["world_size"]) == [1 if not stnb.strategies.is_distributed(s) else 2 for s in stnb.strategies.names()]


def _shape(total=1000, trainable=None):
    return {"param_count": total, "trainable_param_count": total if trainable is None else trainable,
            "bytes_per_param": 4, "optimizer": "adamw"}


def _fake_result(strategy, world_size, breakdown, total=1000, local=None, trainable=None, **kw):
    return RunResult(strategy=strategy, world_size=world_size, per_device_batch_size=4,
                     global_batch_size=4 * world_size, steps=3, samples_per_second=10.0, step_times=[1.0] * 3,
                     losses=[1.0, 0.9, 0.8], peak_memory_bytes=[10**6] * world_size,
                     local_param_count=local or [total] * world_size, total_param_count=total, verified=True,
                     verification={"model_shape": _shape(total, trainable), "world_size_requested": world_size},
                     model="tiny", device="cpu", versions={}, memory_breakdown=breakdown, **kw)


def test_compare_fsdp_predicts_from_the_recorded_shape_and_requested_world():
    # 1000 params, 10 frozen: each of 2 ranks holds 500 params, 495 grads, 990 Adam numbers
    shard = {"params": 2000, "grads": 1980, "optimizer_state": 3960, "total": 7940}
    df = memory.compare(_fake_result("fsdp", 2, [shard, shard], local=[500, 500], trainable=990))
    assert sorted(df["rank"].unique()) == [0, 1]
    row = df[(df["rank"] == 1) & (df["component"] == "grads")].iloc[0]
    assert row["predicted_bytes"] == 1980 and row["measured_bytes"] == 1980
    assert row["measured_over_predicted"] == pytest.approx(1.0)
    assert "ddp_buckets" not in set(df["component"])


def test_compare_an_fsdp_row_whose_ranks_hold_unsharded_state_is_not_1():
    """Ranks that report the full model under 'fsdp' measure twice the 2-rank prediction."""
    full = {"params": 4000, "grads": 3960, "optimizer_state": 7920, "total": 15880}
    df = memory.compare(_fake_result("fsdp", 2, [full, full], trainable=990)).set_index(["rank", "component"])
    for rank in (0, 1):
        for part in ("params", "grads", "optimizer_state", "total"):
            assert df.loc[(rank, part), "measured_over_predicted"] == pytest.approx(2.0, rel=1e-3)


def test_compare_needs_the_recorded_shape():
    full = {"params": 4000, "grads": 4000, "optimizer_state": 8000, "total": 16000}
    old = _fake_result("single", 1, [full])
    old.verification = {}
    with pytest.raises(ConfigError, match="recorded no model shape"):
        memory.compare(old)


def _frozen_tiny_after_one_adamw_step():
    """The tiny BERT with everything but its last encoder layer frozen, after one real AdamW step."""
    import torch

    from stnb.models import load_model, tiny_path

    model = load_model(tiny_path())
    last = max(int(n.split("encoder.layer.")[1].split(".")[0]) for n, _ in model.named_parameters()
               if "encoder.layer." in n)
    for n, p in model.named_parameters():
        p.requires_grad_(f"encoder.layer.{last}." in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    features = model.tokenize(["a frozen model still trains its last layer", "and only that layer"])
    model(features)["sentence_embedding"].pow(2).sum().backward()
    opt.step()
    return model, opt


def test_frozen_model_prediction_and_measurement_are_independent():
    """T << P: grads and Adam state follow requires_grad. A measurement that counted every parameter
    as having a gradient, or a prediction that ignored requires_grad, no longer compares as 1.000."""
    model, opt = _frozen_tiny_after_one_adamw_step()
    shape = memory.model_shape(model)
    measured = memory.measure(model, opt)
    P, T = shape["param_count"], shape["trainable_param_count"]
    assert T < P / 3, (T, P)
    assert measured["params"] == 4 * P and measured["grads"] == 4 * T  # counted from the tensors
    assert 8 * T <= measured["optimizer_state"] < 8 * T + 1024  # + one 'step' number per tensor

    def ratios(breakdown, shape):
        r = _fake_result("single", 1, [breakdown], total=P)
        r.verification = {"model_shape": shape, "world_size_requested": 1}
        return memory.compare(r).set_index("component")["measured_over_predicted"]

    honest = ratios(measured, shape)
    assert honest["params"] == 1.0 and honest["grads"] == 1.0
    assert honest["optimizer_state"] == pytest.approx(1.0, abs=1e-3)
    every_param_has_a_grad = ratios(dict(measured, grads=measured["params"]), shape)
    assert every_param_has_a_grad["grads"] == pytest.approx(P / T) and P / T > 3
    ignores_requires_grad = ratios(measured, dict(shape, trainable_param_count=P))
    assert ignores_requires_grad["grads"] == pytest.approx(T / P)
    assert ignores_requires_grad["optimizer_state"] == pytest.approx(T / P, rel=1e-3)


def test_peak_memory_comes_from_the_process():
    """CPU: the kernel's resident high-water mark, reset at the start: it forgets a 256 MiB spike from
    before the start and sees one after it, though both are freed before the peak is read."""
    import torch

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("the peak reset needs Linux (/proc/self/clear_refs)")
    spike = torch.ones(64 * 2**20)  # 256 MiB, every page touched
    del spike
    pm = memory.PeakMemory(cuda=False)
    assert pm.reset and pm.peak() < 128 * 2**20, "the earlier spike must not count"
    spike = torch.ones(64 * 2**20)
    del spike
    assert pm.peak() >= 250 * 2**20


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
    from stnb.models import load_model, tiny_path
    from stnb.strategies import freeze_unused_pooler

    result = stnb.run(TrainConfig(strategy="single", model="tiny", steps=3, per_device_batch_size=4,
                                  train_size=64, dev_size=16), echo=False)
    model = load_model(tiny_path())
    freeze_unused_pooler(model)  # what every stnb run does before training
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # counted here, not by stnb
    assert trainable < result.total_param_count
    assert result.verification["model_shape"]["trainable_param_count"] == trainable
    measured = result.memory_breakdown[0]
    assert measured["params"] == 4 * result.total_param_count and measured["grads"] == 4 * trainable
    df = memory.compare(result)
    state = df[df["component"].isin(["params", "grads", "optimizer_state", "total"])]
    assert state["measured_over_predicted"].between(0.99, 1.01).all(), df
    assert result.verification["peak_memory_method"].startswith("resident high-water mark")
    assert result.peak_memory_bytes[0] > 0


def test_compare_rows_in_mib_with_their_notes():
    """Every row of one rank, word for word: bytes, the ratio, MiB, and the note a reader sees."""
    part = {"params": 2 * 2**20, "grads": 2**20, "optimizer_state": 2 * 2**20}
    r = _fake_result("ddp", 2, [part, part], total=2**19, trainable=2**18)
    r.verification["model_shape"]["optimizer"] = "sgd_momentum"
    r.peak_memory_bytes = [8 * 2**20, None]
    df = memory.compare(r)
    rows = {(x["rank"], x["component"]): x for x in df.to_dict("records")}
    assert [c for (rank, c) in rows if rank == 0] == ["params", "grads", "optimizer_state", "ddp_buckets", "total",
                                                      "peak"]
    assert [c for (rank, c) in rows if rank == 1] == ["params", "grads", "optimizer_state", "ddp_buckets", "total"]
    p = rows[(0, "params")]
    assert (p["predicted_bytes"], p["measured_bytes"], p["predicted_mib"], p["measured_mib"]) == (2**21, 2**21, 2.0, 2.0)
    assert rows[(0, "grads")]["measured_over_predicted"] == pytest.approx(1.0)
    assert rows[(0, "grads")]["note"] == "262144 frozen parameters (requires_grad=False) have no gradient"
    assert rows[(0, "optimizer_state")]["predicted_mib"] == 1.0  # one momentum per trainable parameter
    assert rows[(0, "optimizer_state")]["note"] == "sgd_momentum: 1 states per trainable parameter"
    assert rows[(0, "total")]["note"] == "params + grads + optimizer_state (ddp_buckets not included)"
    assert rows[(0, "total")]["predicted_mib"] == 4.0 and rows[(0, "total")]["measured_mib"] == 5.0
    peak = rows[(0, "peak")]
    assert peak["predicted_mib"] == 5.0 and peak["measured_mib"] == 8.0  # model state + buckets vs the peak
    assert peak["note"] == "measured peak includes activations and the runtime; predicted: model state only"


def test_compare_takes_the_requested_world_and_the_runs_bucket_view():
    full = {"params": 4000, "grads": 4000, "optimizer_state": 8000}
    r = _fake_result("fsdp", 2, [full, full])
    r.verification["world_size_requested"] = 4  # predicted for the world asked for, not the ranks that answered
    assert memory.compare(r).set_index(["rank", "component"]).loc[(0, "params"), "predicted_bytes"] == 1000
    del r.verification["world_size_requested"]
    assert memory.compare(r).set_index(["rank", "component"]).loc[(0, "params"), "predicted_bytes"] == 2000
    d = _fake_result("ddp", 2, [full, full]).to_dict()
    d["config"] = {"gradient_as_bucket_view": True}
    b = memory.compare(d).set_index(["rank", "component"]).loc[(0, "ddp_buckets")]
    assert b["predicted_bytes"] == 0 and b["note"] == "gradient_as_bucket_view=True: gradients are the buckets, no copy"
    d["gradient_as_bucket_view"] = float("nan")  # a results_frame cell without a value: the config decides
    assert memory.compare(d).set_index(["rank", "component"]).loc[(0, "ddp_buckets"), "predicted_bytes"] == 0
    d["gradient_as_bucket_view"] = False  # the run's own field wins over its config
    assert memory.compare(d).set_index(["rank", "component"]).loc[(0, "ddp_buckets"), "predicted_bytes"] == 4000


def test_compare_refusals_name_the_run():
    full = {"params": 4000, "grads": 4000, "optimizer_state": 8000}
    old = _fake_result("single", 1, [full])
    old.verification = {}
    with pytest.raises(ConfigError) as e:
        memory.compare(old)
    assert str(e.value) == ("run 'single' recorded no model shape (parameter and trainable counts), so there is "
                            "nothing to predict from; it was recorded by an older stnb: run it again")
    empty = _fake_result("ddp", 2, [{}, {}]).to_dict()
    del empty["status"]
    with pytest.raises(ConfigError) as e:
        memory.compare(empty)
    assert str(e.value) == ("run 'ddp' (status 'ok') has no memory measurement to compare: the run recorded no "
                            "memory breakdown")
    with pytest.raises(ConfigError) as e:
        memory.optimizer_kind("lion")
    assert str(e.value) == f"no memory prediction for optimizer 'lion'; stnb knows {', '.join(memory.OPTIMIZER_SLOTS)}"
    assert "adamw, adam, sgd" in str(e.value)


# ---- where the peak goes (stnb.memsplit), real 2-rank runs of the tiny model -----------------------------

SPLIT_RUN = dict(num_processes=2, model="tiny", per_device_batch_size=4, steps=4, evaluate=False, threads_per_rank=1,
                 timeout=300, warmup_steps_excluded=1, train_size=64)


@pytest.fixture(scope="module")
def split_runs():
    return {s: stnb.run(TrainConfig(strategy=s, **SPLIT_RUN), echo=False) for s in ("ddp", "fsdp")}


def test_memory_split_parts_add_up_to_the_measured_peak(split_runs):
    """Every rank's parts add up to the peak the run reports (peak_memory_bytes), each counted part (tensors,
    the allocator's free bytes) fits inside the peak, and the residual before the steps is not negative
    beyond 4 MiB (the resident size when training starts holds at least the parameters and the free heap)."""
    from stnb.memsplit import RESIDUALS, SPLIT

    for name, r in split_runs.items():
        assert r.status == "ok" and r.verified, (name, r.reason)
        assert len(r.memory_split) == 2
        for rank, (split, peak) in enumerate(zip(r.memory_split, r.peak_memory_bytes)):
            assert sum(split[k] for k in SPLIT) == peak, (name, rank, split)
            counted = [k for k in SPLIT if k not in RESIDUALS]
            assert all(0 <= split[k] <= peak for k in counted), (name, rank, split)
            assert split["before_steps_other"] >= -4 * 2**20, (name, rank, split)
            assert split["activations"] > 0 and split["baseline_rss"] > 0
            for part in ("params", "grads", "optimizer_state"):  # the tensors counted after the first step
                assert split[part] == r.memory_breakdown[rank][part]


def test_fsdp_model_state_is_half_of_ddps_and_its_activations_are_not(split_runs):
    """Model state halves under FSDP on 2 ranks; the activations (same batch, same data) do not, which also
    says the gathered parameters FSDP saves for the backward are not counted as activations."""
    ddp, fsdp = (split_runs[s].memory_split[0] for s in ("ddp", "fsdp"))
    state = lambda s: s["params"] + s["grads"] + s["optimizer_state"]  # noqa: E731
    assert 0.45 < state(fsdp) / state(ddp) < 0.56
    assert 0.8 < fsdp["activations"] / ddp["activations"] < 1.25
    assert fsdp["saved_params"] > 0  # FSDP's unsharded block weights were saved, and kept apart


def test_sharding_frees_the_model_as_built(split_runs):
    """The parameters as built are gone once FSDP sharded the model (a reference kept anywhere shows here);
    DDP trains those very tensors, so all of them are alive."""
    ddp, fsdp = split_runs["ddp"], split_runs["fsdp"]
    for rank in range(2):
        assert fsdp.memory_split[rank]["unsharded_params_alive"] == 0
        assert ddp.memory_split[rank]["unsharded_params_alive"] == 4 * ddp.total_param_count


def test_freed_memory_goes_back_at_each_step_end_where_parameters_are_gathered(split_runs):
    for rank in range(2):
        released = split_runs["fsdp"].verification["ranks"][rank]["released_each_step"]
        assert isinstance(released, list) and len(released) == SPLIT_RUN["steps"] and all(b >= 0 for b in released)
        assert split_runs["ddp"].verification["ranks"][rank]["released_each_step"] is None


def test_memory_split_plot_and_sentence(split_runs):
    from stnb.memsplit import SPLIT, advice

    runs = [split_runs["ddp"], split_runs["fsdp"]]
    fig = stnb.plots.memory_split(runs)
    bars = [t for t in fig.data if t.type == "bar"]
    peak = next(t for t in fig.data if t.type == "scatter")
    for i, r in enumerate(runs):
        top = max(r.peak_memory_bytes)
        assert sum(t.y[i] for t in bars) == pytest.approx(top / 2**20)
        assert peak.y[i] == pytest.approx(top / 2**20)
    assert {t.name for t in bars} <= {stnb.memsplit.LABELS[k] for k in SPLIT}
    sentence = advice(runs[1])
    assert f"{max(runs[1].peak_memory_bytes) / 2**20:,.0f} MiB" in sentence
    assert "older stnb" in advice({"strategy": "fsdp", "memory_split": [], "peak_memory_bytes": []})


def test_freed_memory_is_released_each_step_only_where_it_grows_and_can_be_turned_off(monkeypatch):
    """CPU runs of a strategy that gathers parameters during its steps release freed heap pages at each
    step's end; GPU runs and DDP-like strategies never do; STNB_RELEASE_FREED=off trades the peak for speed."""
    from stnb import strategies
    from stnb.cpualloc import RELEASE_ENV, release_each_step

    monkeypatch.delenv(RELEASE_ENV, raising=False)
    gathers = {name: bool(strategies.get(name).gathered_during_step) for name in ("ddp", "zero1", "zero2", "fsdp")}
    assert gathers == {"ddp": False, "zero1": False, "zero2": True, "fsdp": True}
    assert [release_each_step("cpu", g) for g in gathers.values()] == [False, False, True, True]
    assert not release_each_step("cuda", True)
    monkeypatch.setenv(RELEASE_ENV, "off")
    assert not release_each_step("cpu", True)


def test_predict_takes_the_strategys_own_options_and_refuses_what_it_would_drop():
    """A strategy's option changes the prediction where it changes what a rank holds; an option of another
    strategy, a value its declaration refuses, or a name no strategy has is refused, not ignored."""
    assert memory.predict("deepspeed", 100, world_size=4, stage=3)["params"] == 100
    assert memory.predict("deepspeed", 100, world_size=4, stage=1)["params"] == 400
    with pytest.raises(ConfigError, match="stage=2 is not an option of strategy 'ddp'; its options: comm_hook"):
        memory.predict("ddp", 100, world_size=2, stage=2)
    with pytest.raises(ConfigError, match="unknown stage 5; choose one of 1, 2, 3"):
        memory.predict("deepspeed", 100, world_size=2, stage=5)
    table = memory.predict_table(2**20, 2, gradient_as_bucket_view=True, strategies=["ddp", "zero1", "fsdp"])
    assert table.set_index("strategy")["ddp_buckets_mib"].to_dict() == {"ddp": 0.0, "zero1": 0.0, "fsdp": 0.0}
    assert memory.predict_table(2**20, 2, strategies=["ddp"])["ddp_buckets_mib"].iloc[0] == 4.0
    with pytest.raises(ConfigError, match="predict_table got no_such_option"):
        memory.predict_table(100, 2, no_such_option=1)
