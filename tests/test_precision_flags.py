"""A user's precision flags (``fp16=True``, ``bf16=True``, neither) mean the same computation under every
strategy on the same device as under ``single``, or stnb refuses them, or says what they become in
``overridden_args`` (issue 49 item 3).

On CPU the trainer (accelerate) autocasts bf16 over float32 parameters and leaves fp16=True without effect
(float32). fsdp / zero2 once turned fp16=True into FSDP2's ``param_dtype=float16`` there (the forward in
float16, a loss's own float32 projection failing with "mat1 and mat2 must have the same dtype"), and bf16=True
into ``param_dtype=bfloat16`` (norms and residual adds in bfloat16, which autocast keeps in float32). The
real runs below observe, with forward hooks inside the ranks, the dtypes the first training forward ran in
(a Linear's and a LayerNorm's input, weight and output, autocast on or off, the embeddings the loss
received) and compare them with single's for the same flags; the loss carries its own float32 projection
(trainable, as in sentence-transformers' distillation example's MSELoss with a projection), which must train.

Real runs: 2 gloo ranks (single: one process), the tiny model, 3 steps.
"""

from __future__ import annotations

import functools
import json
import os
from types import SimpleNamespace

import pytest
import torch

import stnb
from stnb import strategies
from stnb.errors import ConfigError, LaunchError
from stnb.models import tiny_path
from trainfns import FAST, st_args, words

FLAGS = (None, "fp16", "bf16")


class ProjectedMSELoss(torch.nn.Module):
    """MSE between the embeddings through the loss's own float32 projection and the label vectors."""

    def __init__(self, model, dim: int = 8):
        super().__init__()
        self.model = model
        self.projection = torch.nn.Linear(model.get_sentence_embedding_dimension(), dim, bias=False)

    def forward(self, features, labels):
        embeddings = self.model(features[0])["sentence_embedding"]
        self.model_embeddings_dtype = str(embeddings.dtype)
        return torch.nn.functional.mse_loss(self.projection(embeddings), labels.float())


def _observe(model, loss, out: str) -> None:
    """Forward hooks on the model's first Linear and first LayerNorm: at the first training forward, what each
    ran in, written to ``out/seen-<rank>.json`` with the dtype of the embeddings the loss received."""
    seen = {}

    def hook(name):
        def record(module, args, output):
            if name in seen or not torch.is_grad_enabled():
                return
            seen[name] = {"input": str(args[0].dtype), "weight": str(module.weight.dtype), "output": str(output.dtype),
                          "autocast": torch.is_autocast_enabled("cpu")}
        return record

    def loss_input(module, args, output):
        embeddings = getattr(module, "model_embeddings_dtype", None)
        if embeddings is not None and "loss_received" not in seen:
            seen["loss_received"] = embeddings
            seen["stnb"] = stnb.__file__
            with open(os.path.join(out, f"seen-{os.environ.get('RANK', '0')}.json"), "w") as f:
                json.dump(seen, f)

    for kind in (torch.nn.Linear, torch.nn.LayerNorm):
        next(m for m in model.modules() if isinstance(m, kind)).register_forward_hook(hook(kind.__name__))
    loss.register_forward_hook(loss_input)


def build(out: str, flag: str | None):
    """A user's trainer: the tiny model, ProjectedMSELoss, ``flag``=True (bf16 on CPU: with use_cpu=True, which
    transformers asks for it)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    model = SentenceTransformer(tiny_path(), device="cpu")
    loss = ProjectedMSELoss(model)
    _observe(model, loss, out)
    targets = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"text": [words(i) for i in range(32)], "label": targets})
    kw = {flag: True, "use_cpu": flag == "bf16"} if flag else {}
    return SentenceTransformerTrainer(model=model, args=st_args(os.path.join(out, "out"), **kw), train_dataset=data,
                                      loss=loss)


def _run(out, strategy: str, flag: str | None):
    """The run and every rank's observations."""
    os.makedirs(out, exist_ok=True)
    options = dict(FAST, num_processes=None) if strategy == "single" else FAST
    r = stnb.run(functools.partial(build, str(out), flag), strategy=strategy, echo=False, **options)
    seen = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.startswith("seen-")]
    return r, seen


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """single's observations per flag (each run once)."""
    done = {}

    def observed(flag):
        if flag not in done:
            r, seen = _run(tmp_path_factory.mktemp(f"single-{flag}"), "single", flag)
            assert r.verified, r.reason
            done[flag] = seen[0]
        return done[flag]
    return observed


def _without_origin(seen: dict) -> dict:
    return {k: v for k, v in seen.items() if k != "stnb"}


# ---- before training: what each strategy makes of the flags ----------------------------------------------------

def test_fsdp_on_cpu_adds_no_policy_to_the_trainers_precision():
    """On CPU, fsdp (and zero2, the same machinery) gathers and computes the parameters in float32 whatever the
    flag: the trainer's own autocast (bf16) or none (fp16 has no effect on CPU), as under single; nothing to say."""
    from stnb.strategies.fsdp import precision_policy

    for flag in ("no", "fp16", "bf16"):
        assert precision_policy(flag, "cpu") == ({}, {}, {})
    assert precision_policy("no", "cuda") == ({}, {}, {})


def test_fsdp_on_a_gpu_says_what_its_mixed_precision_policy_computes():
    """On a GPU fsdp keeps FSDP2's half-precision parameters (half the all-gather bytes) and says so in
    overridden_args: what the flag became, why it differs from single's autocast, and the strategies that don't."""
    from stnb.strategies.fsdp import precision_policy

    blocks, root, overridden = precision_policy("bf16", "cuda")
    assert blocks == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert root == {**blocks, "output_dtype": "float32"}  # a loss's own float32 parameters meet float32 embeddings
    assert overridden == {"bf16": {
        "from": True, "to": "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32, output_dtype=float32) "
                            "+ autocast",
        "why": "single and ddp autocast the forward over float32 parameters; fsdp on a GPU gathers the parameters in "
               "bfloat16 and computes in it, norms, residual adds and pooling too (FSDP2's mixed precision, as "
               "accelerate's FSDP2 applies it: half the all-gather bytes); gradients are reduced and the embeddings "
               "reach the loss in float32. single's computation with bf16=True: strategy='ddp' or 'zero1'"}}
    blocks, root, overridden = precision_policy("fp16", "cuda")
    assert blocks["param_dtype"] == "float16" and list(overridden) == ["fp16"]


def test_deepspeed_refuses_the_flags_it_would_compute_otherwise_on_cpu(tmp_path):
    """fp16=True on CPU: DeepSpeed's fp16 engine would compute in float16 where every other strategy computes in
    float32; refused in the rank before training, with the fix. bf16 on CPU cannot be built under DeepSpeed (use_cpu):
    the refusal says so and names the strategies that can; the recipe's is refused before any process starts."""
    from stnb import TrainConfig
    from stnb.strategies import deepspeed as ds

    def trainer(**args):
        model = torch.nn.Linear(2, 2)
        return SimpleNamespace(args=st_args(str(tmp_path), **args), model=model, model_wrapped=model,
                               is_deepspeed_enabled=True, loss=torch.nn.MSELoss(), optimizer=None)

    DS, cfg = strategies.get("deepspeed"), TrainConfig(strategy="deepspeed")
    assert DS.refusals(trainer(fp16=True), cfg) == [
        "fp16=True on CPU: under single and ddp the trainer leaves it without effect (accelerate autocasts fp16 only "
        "on GPUs) and computes in float32, while DeepSpeed's fp16 engine would compute in float16; remove fp16=True "
        "(float32, as under every other strategy), or run on a GPU"]
    assert DS.refusals(trainer(), cfg) == []
    assert DS.refusals(trainer(bf16=True, use_cpu=True), cfg)[0].endswith(
        "remove use_cpu (stnb runs the ranks on CPU with DS_ACCELERATOR=cpu); with bf16=True: " + ds.BF16_ON_CPU)
    with pytest.raises(ConfigError) as e:
        TrainConfig(strategy="deepspeed", mixed_precision="bf16", device="cpu").check_recipe_options()
    assert str(e.value) == "mixed_precision='bf16' with strategy='deepspeed' on CPU: " + ds.BF16_ON_CPU
    # on a GPU the engine's half precision is said in overridden_args
    assert ds.half_precision_engine("no") == {}
    assert ds.half_precision_engine("bf16")["bf16"]["to"] == (
        "DeepSpeed's bf16 engine: the model held and computed in bfloat16")


# ---- real runs: the dtypes the forward ran in, observed in the ranks ----------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_the_forward_runs_in_singles_dtypes_and_a_float32_loss_projection_trains(tmp_path, single, strategy, flag):
    """Every rank's first training forward ran in the dtypes single's did for the same flag (fp16 on CPU: float32;
    bf16: autocast over float32 parameters, Linear outputs bfloat16, LayerNorms float32); the loss's own float32
    projection trained, the run verified, and no flag is listed as overridden (it means what it means under
    single)."""
    r, seen = _run(tmp_path, strategy, flag)
    assert r.verified, r.reason
    assert len(seen) == 2 and seen[0]["stnb"] == stnb.__file__, seen  # both ranks ran this checkout's stnb
    for rank in seen:
        assert _without_origin(rank) == _without_origin(single(flag)), (strategy, flag, rank, single(flag))
    assert r.verification["ranks"][0]["trained_parameters"]["loss"] == ["loss.projection.weight"]
    assert not {"fp16", "bf16"} & set(r.overridden_args), r.overridden_args


@pytest.mark.slow
def test_what_single_runs_in_on_cpu(single):
    """The reference itself, as the trainer makes it on CPU: fp16=True changes nothing, bf16=True autocasts."""
    float32 = {"input": "torch.float32", "weight": "torch.float32", "output": "torch.float32", "autocast": False}
    assert _without_origin(single(None)) == {"Linear": float32, "LayerNorm": float32, "loss_received": "torch.float32"}
    assert single("fp16") == single(None)
    assert _without_origin(single("bf16")) == {
        "Linear": {**float32, "output": "torch.bfloat16", "autocast": True},
        "LayerNorm": {**float32, "autocast": True}, "loss_received": "torch.float32"}


def build_without_loss_parameters(out: str, flag: str | None):
    """``build`` with the projection frozen: DeepSpeed refuses a loss's trainable parameters for another reason."""
    trainer = build(out, flag)
    trainer.loss.projection.requires_grad_(False)
    return trainer


@pytest.mark.slow
def test_deepspeed_runs_in_singles_dtypes_and_refuses_fp16_on_cpu(tmp_path, single):
    """DeepSpeed without a flag ran in single's dtypes; fp16=True on CPU is refused in the ranks, before training."""
    os.makedirs(tmp_path / "no")
    r = stnb.run(functools.partial(build_without_loss_parameters, str(tmp_path / "no"), None), strategy="deepspeed",
                 echo=False, **FAST)
    assert r.verified, r.reason
    seen = [json.load(open(tmp_path / "no" / f)) for f in sorted(os.listdir(tmp_path / "no")) if f.startswith("seen-")]
    assert [_without_origin(s) for s in seen] == [_without_origin(single(None))] * 2
    with pytest.raises(LaunchError) as e:
        stnb.run(functools.partial(build_without_loss_parameters, str(tmp_path / "fp16"), "fp16"),
                 strategy="deepspeed", echo=False, **FAST)
    assert "fp16=True on CPU: under single and ddp the trainer leaves it without effect" in str(e.value)
