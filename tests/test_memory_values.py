"""stnb.memory, value by value: what ``predict`` accepts and refuses (word for word), the optimizer names it
knows, what ``model_shape`` and ``measure`` read from a real (small) torch model and optimizer, and what
``compare`` reports per part: predicted bytes, measured bytes, the ratio, MiB and the note. Expected
values are worked out here from the inputs (4 B per fp32 number, Adam's two moments), not read back."""

from __future__ import annotations

import pytest

import stnb
from stnb import ConfigError, RunResult
from stnb import memory

MIB = 2**20


# ---- predict: its arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(param_count=-1), "param_count must be an integer >= 0, got -1"),
    (dict(param_count=1.5), "param_count must be an integer >= 0, got 1.5"),
    (dict(param_count=True), "param_count must be an integer >= 0, got True"),
    (dict(param_count=10, world_size=0), "world_size must be an integer >= 1, got 0"),
    (dict(param_count=10, bytes_per_param=0), "bytes_per_param must be an integer >= 1, got 0"),
    (dict(param_count=10, trainable_param_count=-1), "trainable_param_count must be an integer >= 0, got -1"),
    (dict(param_count=10, trainable_param_count=11), "trainable_param_count=11 is larger than param_count=10"),
    (dict(param_count=10, optimizer="lion"),
     "unknown optimizer 'lion'; choose one of 'adamw', 'adam', 'sgd', 'sgd_momentum', 'adafactor'"),
])
def test_predict_refuses_bad_arguments_word_for_word(kwargs, message):
    with pytest.raises(ConfigError) as e:
        memory.predict("single", **kwargs)
    assert str(e.value) == message


def test_predict_takes_the_edges_of_what_it_accepts():
    assert memory.predict("single", 0)["total"] == 0                      # an empty model
    assert memory.predict("single", 10, bytes_per_param=1)["params"] == 10
    frozen = memory.predict("single", 10, trainable_param_count=0)       # everything frozen
    assert (frozen["params"], frozen["grads"], frozen["optimizer_state"]) == (40, 0, 0)
    assert memory.predict("single", 10, trainable_param_count=10) == memory.predict("single", 10)
    assert memory.predict("ddp", 10, world_size=1)["ddp_buckets"] == 40
    assert memory.predict("fsdp", 10) == memory.predict("single", 10)     # the default world is one rank
    assert memory.predict("single", 10, optimizer="AdamW")["optimizer_state"] == 80   # case does not matter
    assert memory.predict("single", 10, optimizer="adafactor")["optimizer_state"] == 40
    assert memory.predict("single", 10, optimizer="adam")["optimizer_state"] == 80


def test_predict_accepts_numpy_integers_and_returns_python_ints():
    import numpy as np

    p = memory.predict("fsdp", np.int64(10), world_size=np.int64(3), trainable_param_count=np.int32(9))
    assert (p["params"], p["grads"], p["optimizer_state"]) == (14, 12, 24)   # ceil(40/3), ceil(36/3), ceil(72/3)
    assert all(type(v) is int for v in p.values())


def test_deepspeed_keeps_an_fp32_master_copy_in_its_optimizer_partition():
    """DeepSpeed's optimizer partition holds Adam's two moments and its own fp32 copy of the weights:
    3 x 4 B per trainable parameter, divided by the ranks at every stage."""
    for stage, (params, grads) in {1: (400, 400), 2: (400, 100), 3: (100, 100)}.items():
        p = memory.predict("deepspeed", 100, world_size=4, stage=stage)
        assert (p["params"], p["grads"], p["optimizer_state"]) == (params, grads, 3 * 4 * 100 // 4), stage
        assert p["total"] == sum(v for k, v in p.items() if k != "total")


def test_predict_table_for_the_strategies_asked_in_mib():
    t = memory.predict_table(2**20, world_size=4, strategies=["fsdp", "single"])
    assert list(t.strategy) == ["fsdp", "single"] and list(t.world_size) == [4, 1]
    assert list(t.total_mib) == [4.0, 16.0]          # (4 + 4 + 8) B x 2**20 / 4 ranks; the whole on one
    assert list(t.params_mib) == [1.0, 4.0] and list(t.optimizer_state_mib) == [2.0, 8.0]


# ---- the optimizer's name ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, kind", [
    ("adamw_torch_fused", "adamw"), ("adamw_torch", "adamw"), ("ADAMW", "adamw"), ("adam_beta", "adam"),
    ("adam", "adam"), ("sgd", "sgd"), ("sgd_momentum", "sgd_momentum"), ("adafactor", "adafactor"),
])
def test_optimizer_kind_of_the_trainers_names(name, kind):
    assert memory.optimizer_kind(name) == kind


def test_optimizer_kind_reads_an_enums_value():
    from transformers.training_args import OptimizerNames

    assert memory.optimizer_kind(OptimizerNames.ADAMW_TORCH_FUSED) == "adamw"
    assert memory.optimizer_kind(OptimizerNames.SGD) == "sgd"
    assert memory.optimizer_kind(OptimizerNames.ADAFACTOR) == "adafactor"


# ---- what a model and an optimizer hold -------------------------------------------------------------------

def _small_model():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4))   # 35 + 24 parameters
    model[1].bias.requires_grad_(False)                                           # 4 frozen
    return model


def test_model_shape_counts_parameters_trainable_ones_and_their_element_size():
    import torch

    model = _small_model()
    assert memory.model_shape(model) == {"param_count": 59, "trainable_param_count": 55, "bytes_per_param": 4,
                                         "optimizer": "adamw"}
    assert memory.model_shape(model, optimizer="sgd_momentum")["optimizer"] == "sgd_momentum"
    model[0].half()                                   # 35 fp16 numbers against 24 fp32: most are 2 bytes
    assert memory.model_shape(model)["bytes_per_param"] == 2
    # the element size held by the most numbers, summed over tensors (not the last tensor's count):
    # 35 fp16 numbers in two tensors against one fp32 tensor of 20
    mixed = torch.nn.Sequential(torch.nn.Linear(6, 5).half(), torch.nn.Linear(5, 4, bias=False))
    assert memory.model_shape(mixed)["bytes_per_param"] == 2
    assert memory.model_shape(torch.nn.Module()) == {"param_count": 0, "trainable_param_count": 0,
                                                     "bytes_per_param": 4, "optimizer": "adamw"}


def _after_one_step(model, opt):
    import torch

    model(torch.ones(3, 6)).sum().backward()
    opt.step()


def test_measure_counts_parameters_gradients_and_optimizer_state_from_the_tensors():
    import torch

    model = _small_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    assert memory.measure(model, opt) == {"params": 59 * 4, "grads": 0, "optimizer_state": 0, "total": 59 * 4}
    _after_one_step(model, opt)
    m = memory.measure(model, opt)
    steps = sum(torch.as_tensor(s["step"]).numel() * torch.as_tensor(s["step"]).element_size()
                for s in opt.state.values() if torch.is_tensor(s["step"]))
    assert (m["params"], m["grads"]) == (59 * 4, 55 * 4)                 # the frozen bias has no .grad
    assert m["optimizer_state"] == 2 * 55 * 4 + steps                     # exp_avg, exp_avg_sq, step
    assert m["total"] == m["params"] + m["grads"] + m["optimizer_state"]
    extra = memory.measure(model, opt, held_elsewhere={"params": 1, "grads": 10, "optimizer_state": 100})
    assert (extra["params"], extra["grads"], extra["optimizer_state"]) == (m["params"] + 1, m["grads"] + 10,
                                                                           m["optimizer_state"] + 100)
    assert extra["total"] == m["total"] + 111
    assert memory.measure(model, None) == {"params": 59 * 4, "grads": 55 * 4, "optimizer_state": 0,
                                           "total": 59 * 4 + 55 * 4}


def test_measure_looks_inside_the_wrappers_that_hold_the_optimizer():
    """accelerate's AcceleratedOptimizer keeps the torch optimizer as ``.optimizer``; ZeroRedundancyOptimizer
    keeps this rank's own as ``.optim``: the state is counted either way, once."""
    import torch

    model = _small_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    _after_one_step(model, opt)
    direct = memory.measure(model, opt)
    assert direct["optimizer_state"] == 55 * 4                            # one momentum buffer per parameter

    class Accelerated:
        optimizer = opt

    class Zero:
        optim = opt

    class AcceleratedZero:
        optimizer = Zero()

    for wrapped in (Accelerated(), Zero(), AcceleratedZero()):
        assert memory.measure(model, wrapped) == direct


# ---- compare: what it reads from a run ------------------------------------------------------------------

def _result(strategy="single", world_size=1, breakdown=None, shape=None, **kw):
    part = {"params": 4000, "grads": 4000, "optimizer_state": 8000}
    shape = shape or {"param_count": 1000, "trainable_param_count": 1000, "bytes_per_param": 4, "optimizer": "adamw"}
    return RunResult(strategy=strategy, world_size=world_size, per_device_batch_size=4,
                     global_batch_size=4 * world_size, steps=3, samples_per_second=10.0, step_times=[1.0] * 3,
                     losses=[1.0], peak_memory_bytes=kw.pop("peaks", [0] * world_size),
                     local_param_count=[1000] * world_size, total_param_count=1000, verified=True,
                     verification={"model_shape": shape, "world_size_requested": world_size}, model="tiny",
                     device="cpu", versions={}, memory_breakdown=breakdown or [dict(part) for _ in range(world_size)],
                     **kw)


def _by(df):
    return {(r["rank"], r["component"]): r for r in df.to_dict("records")}


def test_compare_reads_a_run_its_dict_or_its_row_and_refuses_anything_else():
    r = _result()
    frames = [memory.compare(x) for x in (r, r.to_dict(), stnb.results_frame([r]).iloc[0])]
    for df in frames:
        assert list(df.component) == ["params", "grads", "optimizer_state", "total"]
        assert list(df.predicted_bytes) == [4000, 4000, 8000, 16000]
    with pytest.raises(ConfigError) as e:
        memory.compare(["not", "a", "run"])
    assert str(e.value) == "compare needs a RunResult, its dict or a results_frame row; got list"


def test_compare_predicts_from_the_recorded_shape_bytes_and_optimizer():
    shape = {"param_count": 1000, "trainable_param_count": 600, "bytes_per_param": 2, "optimizer": "sgd_momentum"}
    part = {"params": 2000, "grads": 1200, "optimizer_state": 1200}
    df = _by(memory.compare(_result(breakdown=[part], shape=shape)))
    assert [df[(0, c)]["predicted_bytes"] for c in ("params", "grads", "optimizer_state", "total")] == \
        [2 * 1000, 2 * 600, 2 * 600, 2 * 1000 + 2 * 600 + 2 * 600]
    assert df[(0, "optimizer_state")]["note"] == "sgd_momentum: 1 states per trainable parameter"
    assert df[(0, "grads")]["note"] == "400 frozen parameters (requires_grad=False) have no gradient"
    assert df[(0, "params")]["note"] == "" and df[(0, "total")]["note"] == "params + grads + optimizer_state"
    nothing_frozen = _by(memory.compare(_result()))
    assert nothing_frozen[(0, "grads")]["note"] == ""              # no '0 frozen parameters' line
    # the optimizer asked for here wins over the recorded one; a shape without bytes or optimizer: fp32 AdamW
    asked = _by(memory.compare(_result(breakdown=[part], shape=shape), optimizer="adamw_torch"))
    assert asked[(0, "optimizer_state")]["predicted_bytes"] == 2 * 2 * 600
    assert asked[(0, "optimizer_state")]["note"] == "adamw: 2 states per trainable parameter"
    bare = _by(memory.compare(_result(shape={"param_count": 1000, "trainable_param_count": 1000})))
    assert [bare[(0, c)]["predicted_bytes"] for c in ("params", "grads", "optimizer_state")] == [4000, 4000, 8000]


def test_compare_ratio_is_measured_over_predicted_and_mib_are_2_to_the_20_bytes():
    shape = {"param_count": MIB, "trainable_param_count": MIB, "bytes_per_param": 4, "optimizer": "adamw"}
    part = {"params": 2 * MIB, "grads": 4 * MIB, "optimizer_state": 12 * MIB}
    frame = memory.compare(_result(breakdown=[part], shape=shape, peaks=[48 * MIB]))
    assert list(frame.columns) == ["rank", "component", "predicted_bytes", "measured_bytes", "measured_over_predicted",
                                   "predicted_mib", "measured_mib", "note"]
    df = _by(frame)
    want = {"params": (4, 2), "grads": (4, 4), "optimizer_state": (8, 12), "total": (16, 18), "peak": (16, 48)}
    for comp, (predicted, measured) in want.items():
        r = df[(0, comp)]
        assert (r["predicted_bytes"], r["measured_bytes"]) == (predicted * MIB, measured * MIB), comp
        assert (r["predicted_mib"], r["measured_mib"]) == (predicted, measured), comp
        assert r["measured_over_predicted"] == measured / predicted, comp


def test_compare_a_part_measured_as_zero_or_predicted_as_zero():
    shape = {"param_count": 1000, "trainable_param_count": 0, "bytes_per_param": 4, "optimizer": "adamw"}
    df = _by(memory.compare(_result(breakdown=[{"params": 4000, "grads": 0, "optimizer_state": 0}], shape=shape)))
    g = df[(0, "grads")]
    assert (g["predicted_bytes"], g["measured_bytes"], g["measured_mib"]) == (0, 0, 0.0)
    import math

    assert math.isnan(g["measured_over_predicted"])          # nothing predicted: no ratio, not a division by 0
    assert df[(0, "params")]["measured_over_predicted"] == 1.0


def test_compare_a_rank_that_recorded_nothing_counts_as_zero_and_peaks_only_where_recorded():
    part = {"params": 4000, "grads": 4000, "optimizer_state": 8000}
    r = _result("ddp", 3, breakdown=[part, None, {"params": 4000}], peaks=[10**6, 0])
    df = _by(memory.compare(r))
    assert df[(1, "params")]["measured_bytes"] is None
    assert df[(1, "total")]["measured_bytes"] == 0 and df[(2, "total")]["measured_bytes"] == 4000
    assert df[(0, "total")]["measured_bytes"] == 16000
    assert [k for k in df if k[1] == "peak"] == [(0, "peak")]            # rank 1's 0 and rank 2's missing peak
    assert df[(0, "peak")]["predicted_bytes"] == 20000                   # model state + DDP's buckets
    assert df[(0, "ddp_buckets")]["note"] == "not measured: the buckets live inside DDP's reducer"


def test_compare_refuses_a_run_without_a_measurement_with_its_reason():
    failed = _result(status="failed", reason="rank 1 ran out of memory")
    with pytest.raises(ConfigError) as e:
        memory.compare(failed)
    assert str(e.value) == ("run 'single' (status 'failed') has no memory measurement to compare: "
                            "rank 1 ran out of memory")
    for empty in ([], [{}], [None, {}]):
        r = _result()
        r.memory_breakdown = empty
        with pytest.raises(ConfigError, match="has no memory measurement to compare: the run recorded no memory"):
            memory.compare(r)


def test_compare_world_size_from_the_request_else_the_run_else_one():
    r = _result("fsdp", 2).to_dict()
    r["verification"]["world_size_requested"] = None
    assert _by(memory.compare(r))[(0, "params")]["predicted_bytes"] == 2000
    r["world_size"] = None
    assert _by(memory.compare(r))[(0, "params")]["predicted_bytes"] == 4000
    single = _result("single", 1).to_dict()
    single["verification"]["world_size_requested"] = 4    # a one-process strategy holds the whole model anyway
    assert _by(memory.compare(single))[(0, "params")]["predicted_bytes"] == 4000


def test_compare_zero2_says_its_whole_parameters_are_in_the_peak_and_fsdp_its_blocks():
    z2 = _by(memory.compare(_result("zero2", 2)))
    g = z2[(0, "gathered_params")]
    assert (g["predicted_bytes"], g["measured_bytes"]) == (2000, None)
    assert g["note"] == "not measured apart: whole parameters from the forward through the backward, in the peak"
    assert z2[(0, "total")]["note"] == "params + grads + optimizer_state"
    fsdp = _by(memory.compare(_result("fsdp", 2)))
    g = fsdp[(0, "gathered_params")]
    assert g["predicted_bytes"] == 0 and g["note"] == "one block gathered at a time (in the peak, not predicted)"
    assert (0, "ddp_buckets") not in fsdp and (0, "gathered_params") not in _by(memory.compare(_result("ddp", 2)))


def test_compare_bucket_view_from_the_run_its_config_or_the_default():
    d = _result("ddp", 2).to_dict()
    d["config"] = {}
    d.pop("gradient_as_bucket_view", None)
    assert _by(memory.compare(d))[(0, "ddp_buckets")]["predicted_bytes"] == 4000   # TrainConfig's default: False
    d["config"] = {"gradient_as_bucket_view": None}
    d["gradient_as_bucket_view"] = True
    assert _by(memory.compare(d))[(0, "ddp_buckets")]["predicted_bytes"] == 0


def test_compare_passes_the_deepspeed_stage_from_the_config():
    shape = {"param_count": 1000, "trainable_param_count": 1000, "bytes_per_param": 4, "optimizer": "adamw"}
    for stage, grads in ((1, 4000), (2, 2000)):
        r = _result("deepspeed", 2, shape=shape).to_dict()
        r["config"] = {"stage": stage}
        assert _by(memory.compare(r))[(0, "grads")]["predicted_bytes"] == grads, stage
