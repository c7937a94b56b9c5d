"""strategy='deepspeed''s own refusals and checks in this process, in seconds (``make mutants`` reaches them
here): the config contradictions, every refusal's words, and the engine checks read from real DeepSpeed
engines (ZeRO stage 1, 2 and 3 around a two-layer model) on a world of one gloo process. The real 2-rank
launches are in test_deepspeed.py.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from stnb import strategies
from stnb.config import TrainConfig
from stnb.errors import ConfigError
from stnb.rankreport import RankReport
from stnb.strategies import deepspeed as ds
from trainfns import st_args

pytest.importorskip("deepspeed", reason='the dev extra installs deepspeed (pip install "stnb[deepspeed]")')

DS = strategies.get("deepspeed")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))  # 18 + 8 = 26 values


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """{stage: a DeepSpeed engine} around _model() in a world of one (the ranks' environment DeepSpeed reads)."""
    import torch.distributed as dist

    env = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('ds') / 'store'}", rank=0,
                            world_size=1)
    import deepspeed
    import deepspeed.comm.comm
    import deepspeed.utils.groups

    # DeepSpeed keeps its communication backend and groups in module globals, made for this process group:
    # put back as they were, so that a later session in this process (mutmut runs several) makes its own
    kept = {mod: {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(mod).items()
                  if not k.startswith("__") and not callable(v) and not isinstance(v, type(os))}
            for mod in (deepspeed.comm.comm, deepspeed.utils.groups)}
    # a stage-3 engine replaces torch.nn.functional.linear with its own (zero3_linear_wrap) for the whole
    # process and never puts it back: later tests here would train through DeepSpeed's linear (seen: the
    # memory split's autocast test found no weight copy after these engines). Put torch's functions back
    kept[torch.nn.functional] = {k: v for k, v in vars(torch.nn.functional).items() if callable(v)}
    try:
        out = {}
        for stage in (1, 2, 3):
            m = _model()
            engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2), config={
                "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9})
            out[stage] = engine
        yield out
    finally:
        dist.destroy_process_group()
        for mod, state in kept.items():
            for k, v in state.items():
                setattr(mod, k, v)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _trainer(engine, stage, **kw):
    acc = SimpleNamespace(num_processes=1, process_index=0)  # accelerate's view of the data split
    return SimpleNamespace(model_wrapped=engine, model=engine.module, stnb_config=TrainConfig(strategy="deepspeed",
                                                                                              stage=stage),
                           accelerator=acc, **kw)


def _ranks(*verifications) -> list:
    return [RankReport(rank=i, device="cpu", global_batch_size=8, step_times=[], losses=[], verification=v,
                       peak_memory_bytes=0, weight_digests={}) for i, v in enumerate(verifications)]


# ---- before any process starts ------------------------------------------------------------------------

def test_the_stage_is_stage_else_the_configs_else_accelerates_default():
    def stage(**kw):
        return ds.stage_of(TrainConfig(strategy="deepspeed", **kw))

    assert stage(stage=3) == 3 and stage(stage=1, deepspeed_config={"zero_optimization": {"stage": 3}}) == 1
    assert stage(deepspeed_config={"zero_optimization": {"stage": 1}}) == 1
    assert stage(deepspeed_config={"zero_optimization": {"stage": 3}}) == 3
    assert stage(deepspeed_config={"zero_optimization": {"stage": 7}}) == 2
    assert stage(deepspeed_config={"zero_optimization": None}) == 2
    assert stage(deepspeed_config={}) == 2 and stage() == 2


def test_contradictions_name_the_key_both_values_and_the_side():
    def c(cfg, stage=2, batch=4, accumulation=1, precision="no"):
        return ds.contradictions(cfg, stage, batch, accumulation, precision, "here")

    assert c({"zero_optimization": {"stage": 3}}) == [
        "zero_optimization.stage=3 in the DeepSpeed config, but stage=2 was asked"]
    assert c({"zero_optimization": {"stage": 2}}) == [] and c({"zero_optimization": None}) == [] and c({}) == []
    assert c({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}) == [
        "train_micro_batch_size_per_gpu=8 in the DeepSpeed config, but the per-device batch is 4 (here)",
        "gradient_accumulation_steps=2 in the DeepSpeed config, but the gradient_accumulation_steps is 1 (here)"]
    assert c({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}) == []
    assert c({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}) == []
    assert c({"bf16": {"enabled": True}}) == [
        "bf16.enabled=True in the DeepSpeed config, but mixed precision is 'no' (here)"]
    assert c({"fp16": {"enabled": False}}, precision="fp16") == [
        "fp16.enabled=False in the DeepSpeed config, but mixed precision is 'fp16' (here)"]
    assert c({"bf16": {"enabled": True}, "fp16": {"enabled": False}}, precision="bf16") == []
    assert c({"bf16": {"enabled": "auto"}, "fp16": None}, precision="fp16") == []


def test_bad_deepspeed_options_are_refused_with_the_fix(monkeypatch):
    def refused(**kw) -> str:
        with pytest.raises(ConfigError) as e:
            DS.validate(TrainConfig(strategy="deepspeed", **kw))
        return str(e.value)

    assert refused(stage=4) == ("unknown DeepSpeed ZeRO stage 4; choose stage=1 (optimizer state sharded), "
                                "2 (+ gradients) or 3 (+ parameters)")
    assert refused(stage=True).startswith("unknown DeepSpeed ZeRO stage True;")
    assert refused(stage=0).startswith("unknown DeepSpeed ZeRO stage 0;")
    assert refused(deepspeed_config="ds.json") == "deepspeed_config must be a dict (a DeepSpeed config), got str"
    assert refused(deepspeed_config={"zero_optimization": {"stage": 5}}) == (
        "unknown DeepSpeed ZeRO stage 5 in deepspeed_config; choose 1, 2 or 3")
    for fine in (dict(stage=1), dict(stage=3), dict(), dict(deepspeed_config={"zero_optimization": {"stage": 3}}),
                 dict(stage=1, deepspeed_config={"zero_optimization": {"stage": 5}})):  # stage decides; see check_recipe
        DS.validate(TrainConfig(strategy="deepspeed", **fine))
    monkeypatch.setattr(ds, "installed", lambda: False)
    assert refused(stage=2) == ("strategy='deepspeed' needs DeepSpeed, which is not installed here: "
                                'pip install "stnb[deepspeed]" (or pip install deepspeed==0.19.8), then restart the kernel')


def test_stnbs_recipe_refuses_a_deepspeed_config_that_contradicts_the_run():
    def refused(**kw) -> str:
        with pytest.raises(ConfigError) as e:
            DS.check_recipe(TrainConfig(strategy="deepspeed", **kw))
        return str(e.value)

    assert refused(per_device_batch_size=8, deepspeed_config={"train_micro_batch_size_per_gpu": 4}) == (
        "the DeepSpeed config contradicts the run: train_micro_batch_size_per_gpu=4 in the DeepSpeed config, but the "
        "per-device batch is 8 (stnb.run's options). Leave these keys out of deepspeed_config (stnb fills them from "
        "the run) or make them agree")
    msg = refused(stage=1, gradient_accumulation_steps=2, mixed_precision="bf16",
                  deepspeed_config={"zero_optimization": {"stage": 5}, "gradient_accumulation_steps": 1,
                                    "bf16": {"enabled": False}})
    assert ("zero_optimization.stage=5 in the DeepSpeed config, but stage=1 was asked; gradient_accumulation_steps=1 "
            "in the DeepSpeed config, but the gradient_accumulation_steps is 2 (stnb.run's options); bf16.enabled=False "
            "in the DeepSpeed config, but mixed precision is 'bf16' (stnb.run's options)") in msg
    assert refused(stage=9).startswith("unknown DeepSpeed ZeRO stage 9")  # validated first
    from stnb.strategies.deepspeed import BF16_ON_CPU

    assert refused(mixed_precision="bf16", device="cpu") == (
        "mixed_precision='bf16' with strategy='deepspeed' on CPU: " + BF16_ON_CPU)
    DS.check_recipe(TrainConfig(strategy="deepspeed", per_device_batch_size=8, stage=3,
                                deepspeed_config={"train_micro_batch_size_per_gpu": 8}))


def test_a_build_using_a_loss_with_parameters_is_refused_before_any_process_starts():
    from sentence_transformers.sentence_transformer import losses

    assert DS.build_refusal({"losses.MultipleNegativesRankingLoss": losses.MultipleNegativesRankingLoss}) == ""
    assert DS.build_refusal({"losses.SoftmaxLoss": losses.SoftmaxLoss}) == (
        "your build function uses SoftmaxLoss, a loss with its own trainable parameters; " + ds.LOSS_PARAMETERS_FIX)

    class TemperatureLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = torch.nn.Parameter(torch.zeros(()))

    assert DS.build_refusal({"losses.SoftmaxLoss": losses.SoftmaxLoss, "TemperatureLoss": TemperatureLoss}).startswith(
        "your build function uses SoftmaxLoss, TemperatureLoss, a loss with")


# ---- in the rank --------------------------------------------------------------------------------------

def _user_trainer(tmp_path, loss=None, **args):
    m = _model()
    return SimpleNamespace(args=st_args(str(tmp_path), **args), model=m, model_wrapped=m, is_deepspeed_enabled=True,
                           loss=loss if loss is not None else torch.nn.MSELoss(), optimizer=None)


def test_a_users_trainer_is_refused_what_deepspeed_cannot_honour(tmp_path):
    cfg = TrainConfig(strategy="deepspeed", stage=2)
    t = _user_trainer(tmp_path)
    assert DS.refusals(t, cfg) == []
    t.is_deepspeed_enabled = False
    assert DS.refusals(t, cfg) == ["the trainer did not enable DeepSpeed (trainer.is_deepspeed_enabled is False)"]

    t = _user_trainer(tmp_path, use_cpu=True)
    t.is_deepspeed_enabled = False  # another problem already says why: not repeated
    assert DS.refusals(t, cfg) == [
        "use_cpu=True in your arguments: accelerate refuses DeepSpeed in its CPU mode (accelerate/state.py, "
        "AcceleratorState: `ACCELERATE_USE_DEEPSPEED == 'true' and not cpu`); remove use_cpu (stnb runs the ranks on "
        "CPU with DS_ACCELERATOR=cpu)"]

    # the user's own deepspeed=... must agree with the run: as given, or as the trainer parsed it
    t = _user_trainer(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    t.args.deepspeed = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 2, "bf16": {"enabled": True}}
    assert DS.refusals(t, cfg) == [
        "zero_optimization.stage=3 in the DeepSpeed config, but stage=2 was asked",
        "bf16.enabled=True in the DeepSpeed config, but mixed precision is 'no' (your training arguments)"]
    t.args.hf_deepspeed_config = SimpleNamespace(config={"train_micro_batch_size_per_gpu": 8})
    assert DS.refusals(t, cfg) == ["train_micro_batch_size_per_gpu=8 in the DeepSpeed config, but the per-device "
                                   "batch is 4 (your training arguments)"]
    t.args.hf_deepspeed_config = None
    t.args.deepspeed = "ds_config.json"  # a file the trainer reads itself
    assert DS.refusals(t, cfg) == []
    t.args.deepspeed, t.args.use_cpu = {"zero_optimization": {"stage": 3}}, True  # every problem, not the last
    assert [p[:30] for p in DS.refusals(t, cfg)] == ["use_cpu=True in your arguments", "zero_optimization.stage=3 in t"]

    class FourParameters(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (torch.nn.Parameter(torch.zeros(1)) for _ in range(4))

    many = _user_trainer(tmp_path, loss=FourParameters())
    assert DS.refusals(many, cfg)[0].startswith("your loss has its own trainable parameters (loss.a, loss.b, loss.c); ")


def test_a_loss_with_parameters_and_a_ready_optimizer_are_refused_in_the_rank(tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.losses import SoftmaxLoss

    from stnb.models import tiny_path

    model = SentenceTransformer(tiny_path(), device="cpu")
    loss = SoftmaxLoss(model, 64, num_labels=3)
    t = SimpleNamespace(args=st_args(str(tmp_path)), model=model, model_wrapped=model, is_deepspeed_enabled=True,
                        loss=loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert DS.refusals(t, TrainConfig(strategy="deepspeed")) == [
        "your loss has its own trainable parameters (loss.classifier.weight, loss.classifier.bias); "
        + ds.LOSS_PARAMETERS_FIX,
        "your trainer came with a ready optimizer (SGD); DeepSpeed partitions the optimizer the trainer builds: "
        "pass optim=... instead"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_engine_is_checked_against_the_stage_asked(engines, stage):
    import deepspeed

    engine = engines[stage]
    info, problems = DS.check_prepared(_trainer(engine, stage), 1)
    assert problems == []
    assert {k: info[k] for k in ("zero_stage_asked", "zero_stage_seen", "deepspeed_optimizer", "deepspeed_version")} == {
        "zero_stage_asked": stage, "zero_stage_seen": stage, "deepspeed_version": deepspeed.__version__,
        "deepspeed_optimizer": "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"}
    assert info.get("ds_partitioned_params") == (4 if stage == 3 else None)
    other = 1 if stage != 1 else 3
    assert DS.check_prepared(_trainer(engine, other), 1)[1] == [
        f"ZeRO stage {other} was asked, the DeepSpeed engine runs stage {stage}"]


def test_the_engine_must_train_the_trainers_model_on_the_groups_split(engines, monkeypatch):
    engine = engines[2]
    t = _trainer(engine, 2)
    t.model = _model()
    assert DS.check_prepared(t, 1)[1] == ["the DeepSpeed engine trains a module other than the trainer's model"]
    t = _trainer(engine, 2)
    t.accelerator = SimpleNamespace(num_processes=1, process_index=1)
    assert DS.check_prepared(t, 1)[1] == [
        "accelerate splits the data as rank 1 of 1, the process group has this rank as 0 of 1: every rank would "
        "train on the same batches"]
    t.accelerator = SimpleNamespace(num_processes=2, process_index=0)
    assert "as rank 0 of 2" in DS.check_prepared(t, 1)[1][0]
    m = _model()
    assert DS.check_prepared(SimpleNamespace(model_wrapped=m, model=m, stnb_config=TrainConfig(stage=3)), 1) == (
        {"zero_stage_asked": 3}, ["expected a DeepSpeedEngine, the trainer used Sequential"])
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # not importable in the rank
    info, problems = DS.check_prepared(_trainer(engine, 2), 1)
    assert info == {} and len(problems) == 1 and problems[0].startswith("deepspeed cannot be imported in the rank: ")


def test_zero3_partitions_are_each_ranks_ceil_share():
    engine_less = _model()
    assert ds.stage3_partitions(engine_less, 1) == ({"ds_partitioned_params": 0}, [
        f"parameter {n} is not partitioned by ZeRO-3 (no ds_tensor)" for n in ("0.weight", "0.bias", "1.weight",
                                                                              "1.bias")])


def test_zero3_partitions_read_from_a_real_engine(engines):
    module = engines[3].module
    assert ds.stage3_partitions(module, 1) == ({"ds_partitioned_params": 4}, [])
    # the same pieces over 2 ranks would be ceil(numel / 2): what this rank holds (all of it) is named
    assert ds.stage3_partitions(module, 2) == ({"ds_partitioned_params": 4}, [
        "parameter 0.weight: this rank holds 15 values, ZeRO-3 over 2 ranks gives 8",
        "parameter 0.bias: this rank holds 3 values, ZeRO-3 over 2 ranks gives 2",
        "parameter 1.weight: this rank holds 6 values, ZeRO-3 over 2 ranks gives 3",
        "parameter 1.bias: this rank holds 2 values, ZeRO-3 over 2 ranks gives 1"])
    many = torch.nn.Sequential(*[torch.nn.Linear(1, 1, bias=False) for _ in range(12)])
    assert len(ds.stage3_partitions(many, 1)[1]) == 10  # at most ten named


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_step_check_reads_the_partition_and_the_gradients_at_the_step(engines, stage):
    engine = engines[stage]
    t = _trainer(engine, stage)
    assert "the gradients at the first optimizer step were not observed" in DS.check_step(t, 1)[1]  # nothing watched
    DS.on_first_step(t, t.stnb_config, 1)
    before, problems = DS.check_step(t, 1)
    if stage != 3 or not before["state_numel"]:
        assert "the gradients at the first optimizer step were not observed" in problems
    engine.train()
    loss = engine(torch.ones(2, 5)).sum()
    engine.backward(loss)
    engine.step()
    details, problems = DS.check_step(t, 1)
    assert problems == []
    assert details["partition_numel"] == details["trainable_numel"] == 26 and details["partition_padding"] == 0
    assert details["state_numel"] == 52 and details["slots"] == 2  # AdamW's two moments over the partition
    assert details["partition_gradients"] is (stage >= 2)
    assert details["grads_whole_grad_numel"] == 0 and details["grads_partition_grad_numel"] == 26
    assert "grads_bytes" not in details

    # what ZeRO must not do, each named: whole gradients kept, state beyond the partition, the wrong reduction
    t.stnb_ds_grads = {"whole_grad_numel": 26, "partition_grad_numel": 26, "bytes": 0}
    assert DS.check_step(t, 1)[1] == [
        "at the optimizer step this rank held 26 gradient values of whole parameters and 26 in its partition of 26: "
        "ZeRO keeps only the partition"]
    t.stnb_ds_grads = {"whole_grad_numel": 0, "partition_grad_numel": 13, "bytes": 0}
    assert "held 0 gradient values of whole parameters and 13 in its partition" in DS.check_step(t, 1)[1][0]
    t.stnb_ds_grads = {}
    assert DS.check_step(t, 1)[1] == ["the gradients at the first optimizer step were not observed"]


def test_the_step_check_names_state_beyond_the_partition_and_the_wrong_reduction(engines):
    engine = engines[1]
    t = _trainer(engine, 1, stnb_ds_grads={"whole_grad_numel": 0, "partition_grad_numel": 26, "bytes": 0})
    opt = engine.optimizer
    state = next(iter(opt.optimizer.state.values()), None)
    if state is None:  # this engine has not stepped yet in this module
        engine(torch.ones(2, 5)).sum().backward()
        engine.step()
        state = next(iter(opt.optimizer.state.values()))
    state["extra"] = torch.zeros(100)
    try:
        assert DS.check_step(t, 1)[1] == [
            "the optimizer state holds 152 values for a partition of 26: not this rank's partition only"]
    finally:
        del state["extra"]
    opt.partition_gradients = True
    try:
        assert DS.check_step(t, 1)[1] == [
            "the ZeRO optimizer reduce-scatters gradients during the backward; stage 1 does not"]
    finally:
        opt.partition_gradients = False
    t2 = _trainer(engines[2], 2, stnb_ds_grads={"whole_grad_numel": 0, "partition_grad_numel": 26, "bytes": 0})
    engines[2].optimizer.partition_gradients = False
    try:
        problems = DS.check_step(t2, 1)[1]
        assert "the ZeRO optimizer all-reduces gradients during the backward; stage 2 does" in problems
    finally:
        engines[2].optimizer.partition_gradients = True
    saved = dict(opt.optimizer.state)
    opt.optimizer.state.clear()
    try:
        assert DS.check_step(t, 1)[1] == ["this rank holds no optimizer state after the first step"]
    finally:
        opt.optimizer.state.update(saved)


def _part(numel, padding=0, total=10_000, **kw) -> dict:
    return {"partition_numel": numel, "partition_padding": padding, "trainable_numel": total, **kw}


def test_the_ranks_partitions_must_cover_the_model_about_one_nth_each():
    info, problems = DS.check_ranks(_ranks(_part(5000), _part(5000)), 2)
    assert problems == [] and info == {"optimizer_partition_fractions": [0.5, 0.5]}
    assert DS.check_ranks(_ranks(_part(5001, padding=1), _part(5000)), 2) == (
        {"optimizer_partition_fractions": [0.5, 0.5]}, [])  # padding is not the model's
    assert DS.check_ranks(_ranks(_part(5000), _part(5001)), 2)[1] == [
        "the ranks' optimizer partitions cover 10001 parameter values, the optimizer updates 10000"]
    # about 1/N: within 1% of the model plus 64 values of the ideal share
    assert DS.check_ranks(_ranks(_part(5164), _part(4836)), 2)[1] == []
    assert DS.check_ranks(_ranks(_part(5165), _part(4835)), 2)[1] == [
        "the ranks' optimizer partitions hold [5165, 4835] of 10000 values; over 2 ranks each should hold about 5000"]
    assert DS.check_ranks(_ranks(_part(10_000)), 1)[1] == []
    assert DS.check_ranks(_ranks({"partition_numel": None}, {}), 2) == ({"optimizer_partition_fractions": [None, None]}, [])


def test_zero3_shards_add_up_to_the_model_with_each_parameters_padding():
    def z3(local, total=100, n=3, world=2):
        ranks = [_part(50, total=100, zero_stage_seen=3, total_param_count=total, local_param_count=local // 2,
                       ds_partitioned_params=n),
                 _part(50, total=100, local_param_count=local - local // 2)]
        return DS.check_ranks(_ranks(*ranks), world)

    assert z3(100) == ({"optimizer_partition_fractions": [0.5, 0.5], "shards_add_up": True}, [])
    assert z3(105)[0]["shards_add_up"] is True  # at most one padded value per parameter per rank: < 100 + 2 * 3
    assert z3(106) == ({"optimizer_partition_fractions": [0.5, 0.5], "shards_add_up": False},
                       ["the ranks' parameter partitions hold 106 values, the model has 100"])
    assert z3(99)[1] == ["the ranks' parameter partitions hold 99 values, the model has 100"]
    assert z3(101, n=None)[0]["shards_add_up"] is True and z3(102, n=None)[0]["shards_add_up"] is False
    unrecorded = [_part(50, total=100, zero_stage_seen=3, total_param_count=100, local_param_count=99,
                        ds_partitioned_params=3), _part(50, total=100)]
    assert DS.check_ranks(_ranks(*unrecorded), 2)[1] == ["the ranks' parameter partitions hold 99 values, the model "
                                                         "has 100"]  # a rank without a count holds nothing
    assert "shards_add_up" not in DS.check_ranks(_ranks(_part(50, total=100, local_param_count=1), _part(50, total=100)),
                                                 2)[0]
