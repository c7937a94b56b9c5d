"""Each strategy's own checks and refusals in this process, in seconds (issue 33: ``make mutants`` over
the functions that decide whether a run is reported verified): what a user reads, word for word, and
the numbers the checks compare, from real torch objects (DistributedDataParallel, ZeroRedundancyOptimizer,
FSDP2's fully_shard on a world of one gloo process, the tiny SentenceTransformer and its SoftmaxLoss).

Where a check only acts with two ranks (rank 0's weights broadcast, gradients averaged), this process is
rank 0 of a 2-rank gloo group and a forked process is rank 1 (``peer``), so that the check runs here.
The same checks in real launches: test_verification.py, test_zero.py, test_loss_params.py.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from stnb import strategies
from stnb.config import TrainConfig
from stnb.errors import ConfigError
from stnb.rankreport import RankReport
from trainfns import st_args


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))  # 18 + 8 = 26 values


def _ranks(*verifications, digests=None) -> list:
    return [RankReport(rank=i, device="cpu", global_batch_size=8, step_times=[], losses=[], verification=v,
                       peak_memory_bytes=0, weight_digests=(digests or {}).get(i, {}))
            for i, v in enumerate(verifications)]


@pytest.fixture
def peer(tmp_path):
    """``peer(fn, *args)``: this process joins a 2-rank gloo group as rank 0 and a forked process as rank 1,
    which runs ``fn(*args)`` and sends back what it returns; returns a function that collects that. After
    the test the group is gone and rank 1 too, whatever the test did."""
    import torch.distributed as dist

    ctx = multiprocessing.get_context("fork")
    started = []

    def start(fn, *args):
        receive, send = ctx.Pipe(duplex=False)  # a pipe, not a Queue: its send is done when os._exit comes
        store = f"file://{tmp_path / 'store2'}"

        def rank_1():
            try:
                dist.init_process_group("gloo", init_method=store, rank=1, world_size=2)
                # by value (plain pickle): a Pipe's own pickler passes a tensor as a file descriptor that this
                # process must still hold when rank 0 reads it, and this process exits at once (EOFError seen)
                send.send_bytes(pickle.dumps(fn(*args)))
                dist.destroy_process_group()
            except BaseException as e:  # noqa: BLE001 - sent to rank 0's test
                send.send_bytes(pickle.dumps(e))
            finally:
                os._exit(0)

        proc = ctx.Process(target=rank_1)
        proc.start()
        started.append(proc)
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=2)

        def collect():
            if not receive.poll(60):
                raise TimeoutError("rank 1 sent nothing in 60 s")
            got = pickle.loads(receive.recv_bytes())
            if isinstance(got, BaseException):
                raise got
            return got

        return collect

    yield start
    for proc in started:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- shared: the replicated tensors compared across ranks, the precision, the one-GPU refusal ----------

def test_replicated_weights_differing_on_one_rank_are_named():
    same = {"a": "1", "b": "2"}
    info, problems = strategies.base.replicated_check(_ranks({}, {}, digests={0: same, 1: same}))
    assert problems == [] and info["weights_identical_across_ranks"] is True
    assert info["weights_tensors_compared"] == 2 and info["weights_differing"] == []
    assert len(info["weights_checksums"]) == 2 and info["weights_checksums"][0] == info["weights_checksums"][1]
    info, problems = strategies.base.replicated_check(_ranks({}, {}, {}, digests={0: same, 1: same,
                                                                                 2: {"a": "1", "b": "3"}}))
    assert problems == ["weights differ across ranks in 1 of 2 tensor(s), first 'b' (ranks [2])"]
    assert info["weights_identical_across_ranks"] is False and info["weights_differing"] == [
        {"tensor": "b", "ranks": [2]}]
    # one rank has nothing to compare with; every tensor sharded leaves nothing replicated
    assert strategies.base.replicated_check(_ranks({}, digests={0: same})) == ({}, [])
    assert strategies.base.replicated_check(_ranks({}, {})) == ({"weights_tensors_compared": 0}, [])


def test_replicated_check_names_at_most_ten_differing_tensors():
    mine = {f"t{i:02d}": "0" for i in range(12)}
    info, problems = strategies.base.replicated_check(_ranks({}, {}, digests={0: mine, 1: {k: "1" for k in mine}}))
    assert len(info["weights_differing"]) == 10 and info["weights_differing"][0]["tensor"] == "t00"
    assert problems == ["weights differ across ranks in 12 of 12 tensor(s), first 't00' (ranks [1])"]


def test_mixed_precision_is_what_the_arguments_ask():
    mp = strategies.base.mixed_precision
    assert mp(SimpleNamespace(bf16=True, fp16=False)) == "bf16"
    assert mp(SimpleNamespace(bf16=False, fp16=True)) == "fp16"
    assert mp(SimpleNamespace(bf16=False, fp16=False)) == "no"


def test_one_gpu_under_a_ddp_wrapper_strategy_is_refused_with_the_fix():
    for name in ("ddp", "zero1"):
        s = strategies.get(name)
        assert s.world_refusal("cuda", 1) == (
            f"strategy {name!r} with one process on a GPU: accelerate does not wrap a single CUDA process in "
            f"DistributedDataParallel, so there would be no {s.label} to verify; use strategy='single' for one "
            "GPU, or num_processes >= 2 (one GPU each)")
        assert s.world_refusal("cpu", 1) == "" and s.world_refusal("cuda", 2) == ""
    assert strategies.get("fsdp").world_refusal("cuda", 1) == ""  # no DDP wrapper to verify


# ---- ddp -------------------------------------------------------------------------------------------------

def test_ddp_refuses_static_graph_with_accumulation_before_and_in_the_rank(tmp_path):
    ddp = strategies.get("ddp")
    with pytest.raises(ConfigError) as e:
        ddp.validate(TrainConfig(strategy="ddp", static_graph=True, gradient_accumulation_steps=2))
    assert str(e.value) == ("static_graph=True cannot be combined with gradient_accumulation_steps > 1: DDP's static "
                            "graph breaks under no_sync() (pytorch/pytorch#143580: an INTERNAL ASSERT on the first "
                            "backward); use static_graph=False when accumulating gradients")
    ddp.validate(TrainConfig(strategy="ddp", static_graph=True, gradient_accumulation_steps=1))
    ddp.validate(TrainConfig(strategy="ddp", static_graph=False, gradient_accumulation_steps=4))

    refused = ["DDP's static_graph cannot be combined with gradient_accumulation_steps > 1 "
               "(pytorch/pytorch#143580); drop static_graph or the accumulation"]

    def refusals(config, **args):
        return ddp.refusals(SimpleNamespace(args=st_args(str(tmp_path), **args)), config)

    asked, left = TrainConfig(strategy="ddp", static_graph=True), TrainConfig(strategy="ddp")
    assert refusals(asked, gradient_accumulation_steps=2) == refused
    assert refusals(asked, gradient_accumulation_steps=1) == []
    # the user's own ddp_static_graph counts where stnb.run's knob was left at its default
    assert refusals(left, gradient_accumulation_steps=2, ddp_static_graph=True) == refused
    assert refusals(left, gradient_accumulation_steps=1, ddp_static_graph=True) == []
    assert refusals(left, gradient_accumulation_steps=2, ddp_static_graph=False) == []
    assert refusals(left, gradient_accumulation_steps=2) == []  # ddp_static_graph None: the trainer's default


def test_ddp_kwargs_are_the_knobs_asked():
    from accelerate.utils import DDPCommunicationHookType

    assert strategies.ddp_kwargs(TrainConfig(strategy="ddp")) == {
        "find_unused_parameters": False, "broadcast_buffers": False, "gradient_as_bucket_view": False,
        "static_graph": False, "comm_hook": DDPCommunicationHookType.NO}
    kw = strategies.ddp_kwargs(TrainConfig(strategy="ddp", bucket_cap_mb=25.0, broadcast_buffers=True,
                                           gradient_as_bucket_view=True, static_graph=True, comm_hook="fp16",
                                           extra={"find_unused_parameters": True}))
    # stnb registers the comm hook itself, timed, at the first step: accelerate gets none
    assert kw == {"find_unused_parameters": True, "broadcast_buffers": True, "gradient_as_bucket_view": True,
                  "static_graph": True, "comm_hook": DDPCommunicationHookType.NO, "bucket_cap_mb": 25}
    assert type(kw["bucket_cap_mb"]) is int
    half = strategies.ddp_kwargs(TrainConfig(strategy="ddp", bucket_cap_mb=2.5))["bucket_cap_mb"]
    assert half == 2.5 and type(half) is float


def test_ddp_wrapper_settings_are_compared_with_what_was_asked(world_of_one):
    from stnb.strategies.ddp import check_ddp_wrapper

    ddp = strategies.get("ddp")
    plain = _model()
    assert ddp.check_prepared(SimpleNamespace(model=plain, model_wrapped=plain), 1) == (
        {}, ["expected DistributedDataParallel, the trainer used Sequential"])

    w = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=2, static_graph=True,
                                                  gradient_as_bucket_view=True)
    seen = {"bucket_cap_mb": 2.0, "find_unused_parameters": False, "broadcast_buffers": w.forward_sync_buffers,
            "static_graph": True, "gradient_as_bucket_view": True}
    asked = {"broadcast_buffers": w.forward_sync_buffers, "static_graph": True, "gradient_as_bucket_view": True,
             "bucket_cap_mb": 2}
    trainer = SimpleNamespace(model=w.module, model_wrapped=w, stnb_ddp_asked=asked)
    assert ddp.check_prepared(trainer, 1) == ({"ddp_settings": seen}, [])
    # each knob the wrapper does not hold is named, with both values
    for knob, value, words in (("broadcast_buffers", not w.forward_sync_buffers, f"holds {w.forward_sync_buffers!r}"),
                               ("static_graph", False, "holds True"),
                               ("gradient_as_bucket_view", False, "holds True"),
                               ("bucket_cap_mb", 25, "holds 2.0")):
        trainer.stnb_ddp_asked = dict(asked, **{knob: value})
        assert check_ddp_wrapper(trainer)[1] == [f"DDP {knob}={value!r} was asked, the wrapper holds "
                                                 + words.removeprefix("holds ")], knob
    # a knob not asked (None) or not recorded is not compared
    trainer.stnb_ddp_asked = dict(asked, bucket_cap_mb=None)
    assert check_ddp_wrapper(trainer)[1] == []
    trainer.stnb_ddp_asked = {"bucket_cap_mb": 25, "static_graph": False}
    assert len(check_ddp_wrapper(trainer)[1]) == 2
    del trainer.stnb_ddp_asked
    assert check_ddp_wrapper(trainer) == ({"ddp_settings": seen}, [])
    assert ddp.check_ranks(_ranks({}, {}), 2) == ({}, [])  # the replicated check (base) is every strategy's


def test_a_cross_encoder_uses_every_parameter_by_design():
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.cross_encoder import CrossEncoder

    from stnb.models import tiny_path
    from stnb.strategies.ddp import every_parameter_used_by_design

    assert every_parameter_used_by_design(CrossEncoder(tiny_path(), num_labels=1, device="cpu")) is True
    assert every_parameter_used_by_design(SentenceTransformer(tiny_path(), device="cpu")) is False
    assert every_parameter_used_by_design(_model()) is False  # no model type stnb knows


# ---- zero1 -----------------------------------------------------------------------------------------------

def test_zero1_refuses_embedding_rows_and_what_it_cannot_shard(tmp_path):
    z = strategies.get("zero1")
    with pytest.raises(ConfigError, match=r"^comm_hook='embedding_rows' sends sparse embedding gradients, which "
                                          r"ZeroRedundancyOptimizer's partition cannot take; use strategy='ddp'"):
        z.validate(TrainConfig(strategy="zero1", comm_hook="embedding_rows"))
    z.validate(TrainConfig(strategy="zero1", comm_hook="fp16"))

    cfg = TrainConfig(strategy="zero1")
    ready = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert z.refusals(SimpleNamespace(args=st_args(str(tmp_path)), optimizer=None), cfg) == []
    assert z.refusals(SimpleNamespace(args=st_args(str(tmp_path), optim="sgd"), optimizer=None), cfg) == []
    as_text = st_args(str(tmp_path))
    as_text.optim = "adafactor"  # set after construction: a plain string, not transformers' enum
    assert z.refusals(SimpleNamespace(args=as_text, optimizer=None), cfg)[0].startswith("optim='adafactor': ")
    assert z.refusals(SimpleNamespace(args=st_args(str(tmp_path), optim="adafactor"), optimizer=ready), cfg) == [
        "your trainer came with a ready optimizer (SGD); zero1 builds the optimizer itself to shard its state: "
        "pass optim=... in the training arguments instead of optimizers=(...)",
        "optim='adafactor': ZeroRedundancyOptimizer shards an elementwise torch optimizer (adamw_torch, "
        "adamw_torch_fused, adam, adamw, sgd, adagrad, rmsprop); use one of them, or strategy='ddp'"]


def test_zero1_step_check_reads_the_local_partition_of_a_real_zero_optimizer(world_of_one):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    z = strategies.get("zero1")
    m = _model()
    extra = torch.nn.Parameter(torch.zeros(4))  # a loss's own parameter: in the optimizer, not in the model
    opt = ZeroRedundancyOptimizer([*m.parameters(), extra], optimizer_class=torch.optim.AdamW, lr=1e-2)
    trainer = SimpleNamespace(model=m, model_wrapped=m, optimizer=SimpleNamespace(optimizer=opt))  # accelerate's wrapper
    before, problems = z.check_step(trainer, 1)
    assert problems == [] and before["optimizer_state_params"] == 0  # no step yet: no state
    m(torch.ones(2, 5)).sum().backward()
    extra.grad = torch.ones(4)
    opt.step()
    details, problems = z.check_step(trainer, 1)
    assert problems == []
    assert details == {"optimizer_partition": ["0.bias", "0.weight", "1.bias", "1.weight", "?"],
                       "optimizer_partition_numel": 30, "optimizer_state_params": 5, "largest_param_numel": 15,
                       "optimizer_all_numel": 30}
    assert z.check_step(SimpleNamespace(model=m, optimizer=opt), 1)[0] == details  # not wrapped
    plain = torch.optim.AdamW(m.parameters())
    assert z.check_step(SimpleNamespace(model=m, optimizer=plain), 1) == (
        {}, ["the trainer's optimizer is AdamW, not a ZeroRedundancyOptimizer"])
    assert z.check_prepared(SimpleNamespace(model=m, model_wrapped=m), 1)[1] == [
        "expected DistributedDataParallel, the trainer used Sequential"]


def _z1(parts, held, total=26, largest=2, state=3) -> dict:
    return {"optimizer_partition": parts, "optimizer_partition_numel": held, "optimizer_all_numel": total,
            "largest_param_numel": largest, "optimizer_state_params": state}


def test_zero1_partitions_must_be_disjoint_cover_the_model_and_be_about_one_nth():
    z = strategies.get("zero1")
    info, problems = z.check_ranks(_ranks(_z1(["a", "b"], 16), _z1(["c"], 10)), 2)
    assert problems == [] and info == {"optimizer_partition_fractions": [16 / 26, 10 / 26]}
    assert z.check_ranks(_ranks(_z1(["a", "b"], 16), _z1(["b"], 10)), 2)[1] == [
        "1 parameter(s) are in the optimizer partition of more than one rank"]
    assert z.check_ranks(_ranks(_z1(["a"], 16), _z1(["b"], 16)), 2)[1] == [
        "the ranks' optimizer partitions cover 32 parameter values, the optimizer updates 26"]
    # about 1/N: at most the ideal share plus the largest parameter (+1) on one rank
    assert z.check_ranks(_ranks(_z1(["a"], 17), _z1(["b"], 9)), 2)[1] == [
        "a rank's optimizer partition holds 17 of 26 values; over 2 ranks it should hold about 13"]
    assert z.check_ranks(_ranks(_z1(["a"], 17, largest=3), _z1(["b"], 9, largest=1)), 2)[1] == []
    assert z.check_ranks(_ranks(_z1(["a"], 26)), 1)[1] == []  # one rank holds all of it
    assert z.check_ranks(_ranks(_z1(["a"], 17, largest=None), _z1(["b"], 9, largest=3)), 2)[1] == []
    # a rank that recorded no largest parameter counts 0: the margin is the ideal share + 1
    unrecorded = {"optimizer_partition": ["b"], "optimizer_partition_numel": 11, "optimizer_state_params": 1}
    assert z.check_ranks(_ranks(_z1(["a"], 15, largest=None), unrecorded), 2)[1] == [
        "a rank's optimizer partition holds 15 of 26 values; over 2 ranks it should hold about 13"]
    assert z.check_ranks(_ranks(_z1(["a"], 14, largest=None), dict(unrecorded, optimizer_partition_numel=12)),
                         2)[1] == []
    assert z.check_ranks(_ranks(_z1(["a"], 16), _z1(["b"], 10, state=0)), 2)[1] == [
        "a rank holds no optimizer state after the first step"]
    assert z.check_ranks(_ranks({"optimizer_state_params": 1}, _z1(None, None, total=None)), 2) == (
        {"optimizer_partition_fractions": [None, None]}, [])


# ---- fsdp and zero2 ---------------------------------------------------------------------------------------

def test_fsdp_and_zero2_refuse_one_process_and_an_old_transformers(monkeypatch):
    from stnb.strategies import fsdp

    for name in ("fsdp", "zero2"):
        s = strategies.get(name)
        with pytest.raises(ConfigError, match=rf"^{name} with num_processes=1 shards nothing; use num_processes >= 2 "
                                              r"or strategy='single'$"):
            s.validate(TrainConfig(strategy=name, num_processes=1))
        monkeypatch.setattr(fsdp, "installed_transformers", lambda: "5.18.9")
        with pytest.raises(ConfigError) as e:
            s.validate(TrainConfig(strategy=name, num_processes=2))
        assert str(e.value) == (f"strategy {name!r} needs transformers >= 5.19 (installed: 5.18.9): an older Trainer "
                                "wraps the model stnb sharded before training in DDP again, which fails on its sharded "
                                "parameters; pip install 'transformers>=5.19', or use strategy='ddp' or 'zero1'")
        monkeypatch.setattr(fsdp, "installed_transformers", lambda: "5.19.0")
        s.validate(TrainConfig(strategy=name, num_processes=2))
        s.validate(TrainConfig(strategy=name))  # num_processes left to the machine


def test_fsdp_checkpoints_a_loss_with_its_own_parameters_and_resumes_it_on_its_own_layout_only(tmp_path,
                                                                                                monkeypatch):
    """Issue 48: the trainer's checkpoints are written sharded, a loss's own parameters too (save_strategy='steps',
    'epoch', 'best' are never refused); a checkpoint holding them resumes on its own layout only (another layout
    reads the model's parameters by name), refused before any process starts with the fix."""
    from stnb.strategies import loss_sync, tensors

    owned = [(f"p{i}", None) for i in range(4)]
    monkeypatch.setattr(tensors, "loss_owned_parameters", lambda trainer: owned)
    as_text = st_args(str(tmp_path))
    as_text.save_strategy = "epoch"  # set after construction: a plain string, not transformers' enum
    for name in ("fsdp", "zero2"):
        s = strategies.get(name)
        for args in (st_args(str(tmp_path), save_strategy="steps"), as_text):
            assert s.refusals(SimpleNamespace(args=args), None) == []
        written = {"strategy": name, "format": "dcp", "world_size": 2}
        assert s.unreadable(str(tmp_path), written) == ""
        (tmp_path / loss_sync.LOSS_PARAMETERS).write_bytes(b"")
        assert s.unreadable(str(tmp_path), written) == (
            "it holds a loss's own parameters and their optimizer state (loss-parameters.pt), which another layout "
            f"does not read (it reads the model's, by name); resume it with strategy={name!r} and num_processes=2")
        assert s.loads(str(tmp_path), written, 2, s) == ""  # its own layout
        assert s.loads(str(tmp_path), written, 3, s) == s.unreadable(str(tmp_path), written)
        (tmp_path / loss_sync.LOSS_PARAMETERS).unlink()


def test_reshard_plan_keeps_the_last_block_whole_and_zero2_every_block():
    from stnb.strategies.fsdp import reshard_plan

    assert reshard_plan(3, True) == [True, True, False]
    assert reshard_plan(3, False) == [False, False, False]
    assert reshard_plan(1, True) == [False] and reshard_plan(0, True) == []
    assert strategies.get("fsdp").reshard_after_forward(TrainConfig(reshard_after_forward=True)) is True
    assert strategies.get("fsdp").reshard_after_forward(TrainConfig(reshard_after_forward=False)) is False
    assert strategies.get("zero2").reshard_after_forward(TrainConfig(reshard_after_forward=True)) is False


def test_fsdp_shards_must_add_up_to_the_model():
    f = strategies.get("fsdp")
    assert f.check_ranks(_ranks({"local_param_count": 13, "total_param_count": 26},
                                {"local_param_count": 13, "total_param_count": 26}), 2) == ({"shards_add_up": True}, [])
    assert f.check_ranks(_ranks({"local_param_count": 26, "total_param_count": 26},
                                {"local_param_count": 26, "total_param_count": 26}), 2) == (
        {"shards_add_up": False}, ["the ranks' local shards hold 52 parameter values, the model has 26"])
    assert f.check_ranks(_ranks({"local_param_count": 26, "total_param_count": 26}, {"total_param_count": 26}), 2) == (
        {"shards_add_up": True}, [])
    # the model's size is rank 0's count
    assert f.check_ranks(_ranks({"local_param_count": 13, "total_param_count": 26},
                                {"local_param_count": 13, "total_param_count": 30}), 2) == ({"shards_add_up": True}, [])


def _tiny_sharded(reshard: bool):
    from sentence_transformers import SentenceTransformer

    from stnb.models import tiny_path
    from stnb.strategies.fsdp import shard_fsdp

    torch.manual_seed(0)
    model = SentenceTransformer(tiny_path(), device="cpu")
    shard_fsdp(model, "cpu", 1, None, reshard, "no")
    return model


def _train_step(model):
    features = model.tokenize(["cats purr softly", "rockets reach orbit"])
    model(features)["sentence_embedding"].sum().backward()


@pytest.mark.parametrize("name, sharded, watched, words", [
    ("fsdp", True, True, None),
    ("zero2", False, False, None),
    # zero2 whose blocks were resharded after forward (the fault of test_injected_faults' zero2 test)
    ("zero2", True, False, "the first block's parameters were resharded after its forward; zero2 with "
                           "reshard_after_forward=False keeps them whole"),
    ("fsdp", False, True, "the first block's parameters were whole after its forward; fsdp with "
                          "reshard_after_forward=True keeps them sharded"),
])
def test_fsdp_step_check_observes_the_gradient_shards_and_the_first_blocks_forward(world_of_one, name, sharded,
                                                                                   watched, words):
    from stnb.strategies.fsdp import watch_after_forward

    model = _tiny_sharded(sharded)
    seen = watch_after_forward(model, watched)
    assert seen == {"whole": None, "forwards_inside_backward": 0, "expected_whole": not watched}
    with torch.no_grad():
        model(model.tokenize(["not a training forward"]))
    assert seen["whole"] is None
    _train_step(model)
    assert seen["whole"] is (not sharded)
    _train_step(model)  # the hook observed the first training forward only
    config = TrainConfig(strategy=name, reshard_after_forward=watched)
    trainer = SimpleNamespace(model=model, stnb_after_forward=seen, stnb_config=config)
    details, problems = strategies.get(name).check_step(trainer, 1)
    with_grad = [p for p in model.parameters() if p.grad is not None]
    numel = sum(p.numel() for p in with_grad)
    assert len(with_grad) > 10 and all(type(p.grad).__name__ == "DTensor" for p in with_grad)
    assert details == {"grad_local_count": numel, "grad_expected_local_count": numel,
                       "grads_checked": len(with_grad), "params_whole_after_forward": not sharded}
    assert problems == ([words] if words else [])


def test_fsdp_step_check_needs_gradients_and_an_observed_forward(world_of_one):
    from stnb.strategies.fsdp import watch_after_forward

    f = strategies.get("fsdp")
    model = _tiny_sharded(True)
    seen = watch_after_forward(model, True)
    trainer = SimpleNamespace(model=model, stnb_after_forward=seen, stnb_config=TrainConfig(strategy="fsdp"))
    details, problems = f.check_step(trainer, 1)
    assert problems == ["no gradient existed after the first backward",
                        "no training forward of a sharded block was observed"]
    assert details == {"grad_local_count": 0, "grad_expected_local_count": 0, "grads_checked": 0,
                       "params_whole_after_forward": None}
    # a forward recomputed inside the backward (gradient-cache losses) tells nothing and is counted apart
    first = [m for m in model.modules() if m is not model and hasattr(m, "reshard")][0]
    hidden = torch.ones(1, 2, 64, requires_grad=True)

    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            with torch.enable_grad():
                first(hidden)
            return grad

    Recompute.apply(torch.ones(3, requires_grad=True)).sum().backward()
    Recompute.apply(torch.ones(3, requires_grad=True)).sum().backward()
    assert seen["forwards_inside_backward"] == 2 and seen["whole"] is None
    assert f.check_step(trainer, 1)[1] == ["no gradient existed after the first backward"]
    # a frozen parameter has no gradient and is not missed; a plain (whole) gradient is named
    for p in model.parameters():
        p.requires_grad_(False)
    assert f.check_step(SimpleNamespace(model=model, stnb_config=TrainConfig()), 1)[1] == [
        "no training forward of a sharded block was observed"]


def test_watching_a_model_without_sharded_blocks_sees_nothing():
    from stnb.strategies.fsdp import watch_after_forward

    m = _model()
    assert watch_after_forward(m, True) == {"whole": None, "forwards_inside_backward": 0, "expected_whole": None}


def _peers_model(seed, bump):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    if bump:
        with torch.no_grad():
            m[1].running_mean.add_(1.0)  # a buffer differs too
    return m


def _same_start_peer(seed):
    from stnb.checks import tensor_digests
    from stnb.strategies.fsdp import same_start

    m = _peers_model(seed, False)
    return same_start(m), tensor_digests(m), m[1].running_mean.clone()


# the parameters are compared (2 differ with another seed); when they differ, buffers are broadcast too
@pytest.mark.parametrize("peer_seed, bump, differing", [(0, False, 0), (0, True, 0), (1, True, 2)])
def test_fsdp_ranks_start_from_rank_0s_weights(peer, peer_seed, bump, differing):
    from stnb.checks import tensor_digests
    from stnb.strategies.fsdp import same_start

    collect = peer(_same_start_peer, peer_seed)
    m = _peers_model(0, bump)
    own = tensor_digests(m)
    mine = same_start(m)
    assert tensor_digests(m) == own  # rank 0's weights are the ones every rank starts from
    theirs, their_digests, their_mean = collect()
    assert mine == theirs == {"tensors_differing_before": differing, "broadcast": bool(differing), "identical": True}
    assert their_digests == tensor_digests(m)  # rank 1 holds rank 0's weights now
    assert torch.equal(their_mean, m[1].running_mean) is (bump is False or bool(differing))


def test_one_rank_has_nothing_to_broadcast(world_of_one):
    from stnb.strategies.fsdp import same_start

    assert same_start(_model()) == {"tensors_differing_before": 0, "broadcast": False, "identical": True}


# ---- the loss's own parameters ------------------------------------------------------------------------------

def _softmax_trainer(seed):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.losses import SoftmaxLoss

    from stnb.models import tiny_path

    model = SentenceTransformer(tiny_path(), device="cpu")
    torch.manual_seed(seed)  # each rank's classifier starts its own way, as in plain sentence-transformers
    loss = SoftmaxLoss(model, model.get_embedding_dimension(), num_labels=3)
    loss.scale = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))  # a bf16 one: its gradient stays bf16
    return SimpleNamespace(model=model, model_wrapped=model, loss=loss)


def _sync_peer():
    from stnb.strategies import LossParameterSync

    trainer = _softmax_trainer(1)
    sync = LossParameterSync(trainer)
    w, b = trainer.loss.classifier.weight, trainer.loss.classifier.bias
    start = w.detach().clone()
    w.grad = torch.full_like(w, 3.0)  # rank 0 sends 1.0: the mean is 2.0
    b.grad = None  # this rank's loss did not reach the bias: rank 0's alone, halved
    trainer.loss.scale.grad = torch.full((2,), 0.5, dtype=torch.bfloat16)
    sync.sync_grads()
    return start, w.grad.clone(), b.grad.clone()


def test_the_loss_parameters_start_from_rank_0s_and_their_gradients_are_averaged(peer):
    from stnb.strategies import LossParameterSync

    collect = peer(_sync_peer)
    trainer = _softmax_trainer(0)
    w, b = trainer.loss.classifier.weight, trainer.loss.classifier.bias
    own = w.detach().clone()
    sync = LossParameterSync(trainer)
    assert torch.equal(w.detach(), own)  # rank 0's classifier is the one every rank starts from
    names = ["loss.scale", "loss.classifier.weight", "loss.classifier.bias"]
    assert sync.names() == names
    w.grad = torch.full_like(w, 1.0)
    b.grad = torch.full_like(b, 4.0)
    scale = trainer.loss.scale
    scale.grad = torch.full((2,), 1.5, dtype=torch.bfloat16)
    sync.sync_grads()
    assert scale.grad.dtype == torch.bfloat16 and torch.equal(scale.grad, torch.ones(2, dtype=torch.bfloat16))
    start, their_w, their_b = collect()
    assert torch.equal(start, w.detach())  # rank 1 started from rank 0's classifier
    assert torch.equal(w.grad, torch.full_like(w, 2.0)) and torch.equal(their_w, w.grad)  # a mean, not a sum
    assert torch.equal(b.grad, torch.full_like(b, 2.0)) and torch.equal(their_b, b.grad)
    assert w.grad.dtype == w.dtype
    assert sync.describe() == {"loss_parameters": names, "synced": True, "steps_synced": 1}


def _none_peer():
    from stnb.strategies import LossParameterSync

    trainer = _softmax_trainer(0)
    sync = LossParameterSync(trainer)
    trainer.loss.classifier.weight.grad = torch.ones_like(trainer.loss.classifier.weight)
    sync.callback().on_pre_optimizer_step(None, None, None)
    sync.sync_grads()
    return trainer.loss.classifier.bias.grad, sync.steps_synced


def test_a_gradient_no_rank_produced_stays_none_and_the_callback_syncs(peer):
    from stnb.strategies import LossParameterSync

    collect = peer(_none_peer)
    trainer = _softmax_trainer(0)
    sync = LossParameterSync(trainer)
    trainer.loss.classifier.weight.grad = torch.ones_like(trainer.loss.classifier.weight)
    sync.callback().on_pre_optimizer_step(None, None, None)
    sync.sync_grads()
    their_bias, their_steps = collect()
    assert trainer.loss.classifier.bias.grad is None and their_bias is None
    assert torch.equal(trainer.loss.classifier.weight.grad, torch.ones_like(trainer.loss.classifier.weight))
    assert sync.steps_synced == their_steps == 2


def test_one_rank_or_no_loss_parameter_syncs_nothing(world_of_one):
    from stnb.strategies import LossParameterSync

    trainer = _softmax_trainer(0)
    sync = LossParameterSync(trainer)
    w = trainer.loss.classifier.weight
    w.grad = torch.full_like(w, 3.0)
    sync.sync_grads()
    assert torch.equal(w.grad, torch.full_like(w, 3.0))
    assert sync.describe() == {"loss_parameters": ["loss.scale", "loss.classifier.weight", "loss.classifier.bias"],
                               "synced": False, "steps_synced": 0}
    plain = SimpleNamespace(model=trainer.model, model_wrapped=trainer.model, loss=torch.nn.MSELoss())
    assert LossParameterSync(plain).describe() == {"loss_parameters": [], "synced": False, "steps_synced": 0}


def test_without_a_process_group_the_loss_parameters_are_this_process_alone():
    from stnb.strategies import LossParameterSync

    sync = LossParameterSync(_softmax_trainer(0))
    assert sync.world == 1 and sync.describe()["synced"] is False


def test_without_a_process_group_fsdp_has_nothing_to_broadcast():
    from stnb.strategies.fsdp import same_start

    assert same_start(_model()) == {"tensors_differing_before": 0, "broadcast": False, "identical": True}


def _broadcast_lost_peer():
    from stnb.errors import VerificationError
    from stnb.strategies.fsdp import same_start

    try:
        same_start(_peers_model(1, False))
    except VerificationError as e:
        return str(e)
    return "no error"


def test_weights_still_differing_after_the_broadcast_stop_the_run(peer, monkeypatch):
    import torch.distributed as dist

    from stnb.errors import VerificationError
    from stnb.strategies.fsdp import same_start

    monkeypatch.setattr(dist, "broadcast", lambda *a, **kw: None)  # a broadcast that sends nothing (both ranks)
    collect = peer(_broadcast_lost_peer)
    with pytest.raises(VerificationError) as e:
        same_start(_peers_model(0, False))
    assert str(e.value) == collect() == ("after broadcasting rank 0's weights, 2 tensor(s) still differ across ranks, "
                                         "first '0.weight'")


def test_fsdp_prepared_details_are_the_exact_local_count_and_the_ideal_share(world_of_one):
    from torch.distributed.fsdp import fully_shard

    m = _model()
    fully_shard(m)
    details, problems = strategies.get("fsdp").check_prepared(SimpleNamespace(model=m, model_wrapped=m), 2)
    assert details == {"expected_local_param_count": 26, "ideal_fraction": 0.5}
    assert problems  # a mesh of one where 2 ranks were asked: named by shard_problems


def test_fsdp_step_check_counts_each_gradients_local_shard(world_of_one):
    """A gradient shard smaller than its layout gives this rank (2 of 3 rows where a mesh of one holds all 3):
    the count is of the local shard, and the check names it as a gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    m = _model()
    w = m[0].weight  # (3, 5)
    m[0].weight = torch.nn.Parameter(DTensor.from_local(w[:2].detach().clone(), mesh, [Shard(0)], run_check=False,
                                                        shape=w.shape, stride=w.stride()))
    m[0].weight.grad = DTensor.from_local(torch.ones(2, 5), mesh, [Shard(0)], run_check=False, shape=w.shape,
                                          stride=w.stride())
    m[1].weight.grad = torch.ones(2, 3)  # a whole (plain) gradient
    trainer = SimpleNamespace(model=m, stnb_after_forward={"whole": False, "expected_whole": False})
    details, problems = strategies.get("fsdp").check_step(trainer, 1)
    assert details == {"grad_local_count": 16, "grad_expected_local_count": 15, "grads_checked": 2,
                       "params_whole_after_forward": False}
    assert problems == ["1 gradient(s) are not sharded, e.g. ['1.weight']",
                        "gradient '0.weight': this rank holds 10 values, its shard ([Shard(dim=0)] of global shape "
                        "[3, 5]) holds 15"]
