"""The offline mpnet-base presets (stnb.models) and the FLOPs / MFU accounting (stnb.mfu).

The FLOPs formula is checked against an independent count: torch's FlopCounterMode over a real
forward + backward. Nothing here needs the network: the build runs with sockets refused.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import math
import socket

import pytest
import torch

import stnb
from stnb import mfu, models

torch.set_num_threads(1)


def mpnet_params_from_config(c: dict) -> int:
    """MPNetModel's parameter count, written out from the config (embeddings, layers, bias, pooler)."""
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    emb = c["vocab_size"] * h + c["max_position_embeddings"] * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    return emb + L * layer + c["relative_attention_num_buckets"] * c["num_attention_heads"] + (h * h + h)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """'mpnet-mini-random' built into a fresh cache with every network connection refused."""
    cache = tmp_path_factory.mktemp("stnb_cache")
    real_connect = socket.socket.connect
    attempts = []

    def refuse(self, address):
        attempts.append(address)
        raise OSError(f"network refused by the test: {address}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STNB_CACHE", str(cache))
        mp.setattr(socket.socket, "connect", refuse)
        path = models.built_path(models.MPNET_MINI)
        model = models.load_model(models.MPNET_MINI, max_seq_length=32)
    assert socket.socket.connect is real_connect
    assert attempts == [], f"the build tried the network: {attempts}"
    return {"cache": cache, "path": path, "model": model}


def test_full_mpnet_base_config_implies_110m_parameters():
    from transformers import MPNetConfig, MPNetModel

    cfg = models.mpnet_config()
    with torch.device("meta"):
        model = MPNetModel(MPNetConfig(**cfg))
    n = sum(p.numel() for p in model.parameters())
    assert n == mpnet_params_from_config(cfg)
    assert 105e6 < n < 115e6, n  # microsoft/mpnet-base: ~110M parameters
    tok = models.load_model("minilm").tokenizer
    assert len(tok) <= cfg["vocab_size"], "every token id of the shipped tokenizer needs an embedding row"


def test_mpnet_mini_is_the_mpnet_architecture_built_offline(mini, monkeypatch):
    monkeypatch.setenv("STNB_CACHE", str(mini["cache"]))
    from transformers import MPNetModel

    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    model = mini["model"]
    assert os.path.basename(mini["path"]) == "mpnet-mini-random-v2"
    inner = model[0].auto_model
    assert isinstance(inner, MPNetModel)
    c = inner.config.to_dict()
    expected = models.mpnet_config(**models.MPNET_MINI_OVERRIDES)
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "max_position_embeddings", "relative_attention_num_buckets"):
        assert c[k] == expected[k], k
    assert c["pad_token_id"] == model.tokenizer.pad_token_id == 0  # the trainer has nothing to align (and warn of)
    assert models.count_parameters(model) == mpnet_params_from_config(expected)
    assert isinstance(model[1], Pooling) and model[1].pooling_mode == "mean"
    assert not any(isinstance(m, Normalize) for m in model), "mpnet-base as sentence-transformers builds it"
    assert [c.__name__ for c in models.layer_classes(model)] == ["MPNetLayer"]  # FSDP can wrap it
    assert models.resolve_model(models.MPNET_MINI) == mini["path"]  # cached: no second build


def test_mpnet_mini_trains_on_cpu(mini, monkeypatch):
    monkeypatch.setenv("STNB_CACHE", str(mini["cache"]))
    res = stnb.run(stnb.TrainConfig(strategy="single", model=models.MPNET_MINI, device="cpu", steps=4,
                                    warmup_steps_excluded=1, per_device_batch_size=4, max_seq_length=32,
                                    train_size=64, dev_size=16, learning_rate=1e-3), echo=False)
    assert res.status == "ok" and res.verified and res.steps == 4
    assert all(math.isfinite(x) for x in res.losses) and len(set(res.losses)) > 1
    assert res.total_param_count == models.count_parameters(mini["model"])
    assert res.mfu["flops_per_sample"] > 0 and res.mfu["mfu"] is None


@pytest.mark.parametrize("preset", ["tiny", models.MPNET_MINI])
def test_flops_formula_against_flop_counter(preset, mini, monkeypatch):
    """FlopCounterMode counts every matmul of a real forward + backward; the formula must agree within
    1 % (the one thing it leaves out is the pooler's forward matmul, ~0.2 % here). The attention term
    is ~4.5 % of the total at this length, so a formula without it fails."""
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setenv("STNB_CACHE", str(mini["cache"]))
    model = models.load_model(preset, max_seq_length=32)
    if preset == "tiny":
        # BERT uses SDPA, whose CPU kernel FlopCounterMode has no formula for: count its eager matmuls
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(models.resolve_model(preset), model_kwargs={"attn_implementation": "eager"})
    model.train()
    texts = ["a short sentence", "another rather longer sentence about cats, dogs and birds", "x"] * 2
    feats = model.preprocess(texts)
    b, t = feats["input_ids"].shape
    meter = mfu.FlopMeter(model)
    with FlopCounterMode(display=False) as counter:
        model(dict(feats))["sentence_embedding"].pow(2).sum().backward()
    meter.end_step()
    expected = mfu.train_flops(mfu.flops_shape(model), b, t)
    assert abs(counter.get_total_flops() / expected - 1) < 0.01, (counter.get_total_flops(), expected)
    assert meter.per_step == [expected] and meter.tokens == [b * t]


def test_flop_meter_forgets_evaluation_forwards(mini):
    model = mini["model"]
    meter = mfu.FlopMeter(model)
    try:
        with torch.no_grad():
            model.encode(["an evaluation forward before the step"])
        meter.start_step()
        feats = model.preprocess(["one", "two words", "three words here"])
        model(dict(feats))
        model(dict(feats))  # two micro-batches in one optimizer step
        meter.end_step()
    finally:
        meter.remove()
    b, t = feats["input_ids"].shape
    assert meter.per_step == [2 * mfu.train_flops(meter.shape, b, t)]


def test_peak_table_lookup():
    assert mfu.known_gpu("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert mfu.known_gpu("NVIDIA H100 PCIe") == "H100 PCIe"
    assert mfu.known_gpu("NVIDIA H200") == "H200"
    assert mfu.known_gpu("NVIDIA A100-SXM4-80GB") == "A100"
    assert mfu.known_gpu("NVIDIA L4") == "L4" and mfu.known_gpu("NVIDIA L40S") is None
    assert mfu.known_gpu("Tesla T4") == "T4" and mfu.known_gpu("Tesla V100-PCIE-32GB") == "V100 PCIe"
    assert mfu.table_peak("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert mfu.table_peak("Tesla T4", "bf16") is None  # no bf16 tensor cores: measured instead
    assert mfu.table_peak("Some Future GPU", "fp16") is None
    with pytest.raises(ValueError):
        mfu.table_peak("NVIDIA L4", "int8")


def test_peak_of_an_h200_nvl_and_of_a_mig_slice():
    """The H200 NVL (PCIe card, lower clocks) is not the H200 SXM; a MIG slice has a fraction of its GPU's
    SMs, so the datasheet of the whole GPU would understate its MFU: it is measured instead."""
    assert mfu.known_gpu("NVIDIA H200 NVL") == "H200 NVL"
    assert mfu.table_peak("NVIDIA H200 NVL", "bf16") < mfu.table_peak("NVIDIA H200", "bf16")
    for name in ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA A100-SXM4-40GB MIG 3g.20gb"):
        assert mfu.known_gpu(name) is None and mfu.table_peak(name, "bf16") is None, name


def test_summarize_mfu_from_rank_results():
    peak = {"gpu": "NVIDIA L4", "precision": "bf16", "flops_per_s": 121e12, "source": "datasheet"}
    from dataclasses import replace

    from stnb.rankreport import RankReport

    def report(rank, train_flops):
        return RankReport(rank=rank, device="cuda", global_batch_size=64, step_times=[1.0] * 3, losses=[],
                          verification={"ok": True}, peak_memory_bytes=1, weight_digests={},
                          train_flops=train_flops, train_tokens=[10, 20, 30], peak=peak)

    ranks = [report(0, [9e12, 1e12, 2e12]), report(1, [9e12, 3e12, 2e12])]
    out = mfu.summarize(ranks, warm=1, n_steps=3, span=0.5, samples=64, devices=1)
    assert out["achieved_tflops"] == pytest.approx(8e12 / 0.5 / 1e12)
    assert out["mfu"] == pytest.approx(16e12 / (2 * 121e12))
    assert out["tokens_per_sample"] == pytest.approx(100 / 64)
    cpu = mfu.summarize([replace(r, peak=None) for r in ranks], 1, 3, 0.5, 64, 1)
    assert cpu["mfu"] is None and "CPU" in cpu["peak_source"]


def test_measure_peak_runs_a_real_matmul():
    assert mfu.measure_peak("cpu", "fp32", n=128, iters=2) > 0
