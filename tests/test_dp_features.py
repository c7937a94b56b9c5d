"""dp with sentence-transformers' feature dicts (issue 32 item 4.10).

sentence-transformers 6.2 passes ``modality`` (a str) and, with a prompt, ``prompt_length`` (an int)
through the forward. torch.nn.DataParallel.gather treats every value that is not a tensor as a sequence:
the str comes back as '<map object ...>', the int raises. The DataParallel stnb trains with keeps them.

On CPU only the CUDA copy of torch's gather is replaced (by a concatenation on the CPU, what ``Gather``
computes on a GPU); the replicas' outputs are the real model's, on two halves of one batch.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import scatter_gather

from stnb import strategies
from stnb.strategies import dp as dp_module


class _CpuGather:
    """torch.nn.parallel._functions.Gather on CPU tensors: concatenated along dim (0-d ones as vectors)."""

    @staticmethod
    def apply(target_device, dim, *tensors):
        return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in tensors], dim)


@pytest.fixture
def replica_outputs(monkeypatch):
    from sentence_transformers import SentenceTransformer

    from stnb.models import tiny_path

    monkeypatch.setattr(scatter_gather, "Gather", _CpuGather)
    model = SentenceTransformer(tiny_path(), device="cpu")
    features = model.preprocess(["a query about cats", "dogs", "fish swim", "birds fly high"], prompt="query: ")
    outs = []
    with torch.no_grad():  # DataParallel's scatter: tensors split along dim 0, other values given to every replica
        for half in (slice(0, 2), slice(2, 4)):
            outs.append(model({k: v[half] if isinstance(v, torch.Tensor) else v for k, v in features.items()}))
    return model, outs


def _trainer_dp(model, precision):
    """What the Trainer's DP path hands to stnb's dp strategy: an nn.DataParallel, rewrapped by prepare's hook."""
    from types import SimpleNamespace

    plain = torch.nn.DataParallel(model)
    trainer = SimpleNamespace(args=SimpleNamespace(fp16=precision == "fp16", bf16=precision == "bf16"),
                              _wrap_model=lambda m, training=True, dataloader=None: plain)
    strategies.get("dp").prepare(trainer, None, "cpu", 1)
    return trainer._wrap_model(model)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_dp_gathers_the_features_that_are_not_tensors(replica_outputs, precision):
    model, outs = replica_outputs
    assert isinstance(outs[0]["modality"], str) and isinstance(outs[0]["prompt_length"], int)
    # torch's own gather (nn.DataParallel.gather calls it) loses them: this is what stnb's dp replaces
    with pytest.raises(TypeError, match="not iterable"):
        scatter_gather.gather(outs, "cpu")
    assert scatter_gather.gather([{"modality": "text"}] * 2, "cpu")["modality"].startswith("<map object")
    wrapped = _trainer_dp(model, precision)
    assert isinstance(wrapped, torch.nn.DataParallel)
    got = wrapped.gather(outs, "cpu")
    assert got["modality"] == outs[0]["modality"] == "text"
    assert got["prompt_length"] == outs[0]["prompt_length"]
    assert torch.equal(got["sentence_embedding"], torch.cat([o["sentence_embedding"] for o in outs]))
    assert got["sentence_embedding"].shape[0] == 4


def test_replicas_that_disagree_on_a_value_are_an_error(replica_outputs):
    _, outs = replica_outputs
    outs[1] = dict(outs[1], prompt_length=outs[1]["prompt_length"] + 1)
    with pytest.raises(ValueError, match="prompt_length"):
        dp_module.gather_features(outs, "cpu")
