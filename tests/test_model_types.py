"""Every sentence-transformers model type under stnb's strategies: a reranker (CrossEncoder, binary
cross-entropy with hard negatives), SPLADE (SparseEncoder, SpladeLoss over a sparse in-batch-negatives
loss with its regularisers) and a multi-vector encoder, each with its own evaluator before and after,
verified like a bi-encoder, saved and reloaded as its own type. Refusals name the types stnb knows.

Real runs: 2 gloo ranks, the tiny random BERT (with a random MLM head for SPLADE), a few steps.
"""

from __future__ import annotations

import functools

import pytest

import stnb
from stnb import model_types
from stnb.models import tiny_path
from trainfns import FAST, words as _words

N = 32


def _common(out: str) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, logging_steps=1,
                report_to="none", save_strategy="no", seed=7)


def build_reranker(out: str):
    """A reranker: (query, passage, label) rows, a positive and a hard negative per query."""
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    model = CrossEncoder(tiny_path(), num_labels=1, device="cpu")
    rows = {"query": [], "passage": [], "label": []}
    for i in range(N // 2):
        for passage, label in ((_words(i), 1.0), (_words(i + 1), 0.0)):  # the neighbour is the hard negative
            rows["query"].append(f"what about {_words(i)}")
            rows["passage"].append(passage)
            rows["label"].append(label)
    dev = CrossEncoderRerankingEvaluator(
        [{"query": f"what about {_words(i)}", "positive": [_words(i)], "negative": [_words(i + 1), _words(i + 2)]}
         for i in range(8)], name="dev", write_csv=False)
    return CrossEncoderTrainer(model=model, args=CrossEncoderTrainingArguments(**_common(out)),
                               train_dataset=Dataset.from_dict(rows), loss=BinaryCrossEntropyLoss(model),
                               evaluator=dev)


def build_splade(out: str):
    from datasets import Dataset
    from sentence_transformers.sparse_encoder import SparseEncoder, SparseEncoderTrainer, SparseEncoderTrainingArguments
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    model = SparseEncoder(modules=[MLMTransformer(tiny_path()), SpladePooling(pooling_strategy="max")], device="cpu")
    data = Dataset.from_dict({"anchor": [f"what about {_words(i)}" for i in range(N)],
                              "positive": [_words(i) for i in range(N)]})
    loss = SpladeLoss(model, loss=SparseMultipleNegativesRankingLoss(model), query_regularizer_weight=5e-5,
                      document_regularizer_weight=3e-5)
    dev = SparseInformationRetrievalEvaluator(
        queries={f"q{i}": f"what about {_words(i)}" for i in range(8)},
        corpus={f"d{i}": _words(i) for i in range(16)}, relevant_docs={f"q{i}": {f"d{i}"} for i in range(8)},
        name="dev", write_csv=False)
    return SparseEncoderTrainer(model=model, args=SparseEncoderTrainingArguments(**_common(out)), train_dataset=data,
                                loss=loss, evaluator=dev)


def build_multi_vector(out: str):
    from datasets import Dataset
    from sentence_transformers.multi_vector_encoder import (MultiVectorEncoder, MultiVectorEncoderTrainer,
                                                            MultiVectorEncoderTrainingArguments)
    from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    model = MultiVectorEncoder(tiny_path(), device="cpu")
    data = Dataset.from_dict({"anchor": [f"what about {_words(i)}" for i in range(N)],
                              "positive": [_words(i) for i in range(N)]})
    dev = MultiVectorInformationRetrievalEvaluator(
        queries={f"q{i}": f"what about {_words(i)}" for i in range(8)},
        corpus={f"d{i}": _words(i) for i in range(16)}, relevant_docs={f"q{i}": {f"d{i}"} for i in range(8)},
        name="dev", write_csv=False)
    return MultiVectorEncoderTrainer(model=model, args=MultiVectorEncoderTrainingArguments(**_common(out)),
                                     train_dataset=data, loss=MultiVectorMultipleNegativesRankingLoss(model),
                                     evaluator=dev)


def _check(r, strategy):
    assert r.verified, (strategy, r.reason)
    assert r.dev_metric and r.dev_metric_before is not None and r.dev_metric_after is not None
    assert r.mfu["flops_per_sample"] > 0  # counted for every model type (CPU: no peak, so no MFU)
    v = r.verification
    assert v["loss_received_all_columns"] is True
    if strategy == "ddp":
        assert v["weights_identical_across_ranks"] is True
    else:
        assert v["shards_add_up"] is True
    return v


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_reranker_trains_verified_and_saves_as_a_cross_encoder(tmp_path, strategy):
    from sentence_transformers.cross_encoder import CrossEncoder

    target = tmp_path / "reranker"
    r = stnb.run(functools.partial(build_reranker, str(tmp_path / "out")), strategy=strategy,
                 save_to=str(target), **FAST)
    _check(r, strategy)
    assert r.dev_metric.endswith("ndcg@10") or "map" in r.dev_metric or "mrr" in r.dev_metric
    saved = r.verification["saved_model"]
    assert saved["equals_trained"] and saved["differs_from_initial"] and saved["encodes_the_same"]
    assert isinstance(model_types.load_like(CrossEncoder(str(target)), str(target)), CrossEncoder)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_splade_trains_verified(tmp_path, strategy):
    r = stnb.run(functools.partial(build_splade, str(tmp_path)), strategy=strategy, **FAST)
    v = _check(r, strategy)
    assert "ndcg@10" in r.dev_metric
    # the MLM head (vocabulary x hidden, tied to the embeddings) is counted in the FLOPs
    shape = r.verification.get("model_shape")
    assert shape and shape["param_count"] > 2_000_000
    assert v["ranks"][0]["trained_parameters"]["optimizer_updates"] > 0


def test_multi_vector_trains_verified(tmp_path):
    r = stnb.run(functools.partial(build_multi_vector, str(tmp_path)), strategy="ddp", **FAST)
    _check(r, "ddp")


def test_mlm_head_counts_in_the_flops():
    """A sparse encoder's MLM decoder is a matmul of vocabulary x hidden per token even though its
    weight is the word embeddings' (tied): it counts."""
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    from stnb.mfu import flops_shape

    dense = flops_shape(stnb.models.load_model("tiny"))
    sparse = flops_shape(SparseEncoder(modules=[MLMTransformer(tiny_path()), SpladePooling("max")], device="cpu"))
    assert sparse["matmul_params"] - dense["matmul_params"] >= 30522 * 64


def build_plain_transformers_trainer():
    from transformers import Trainer

    return Trainer(model=None)


def test_an_unknown_trainer_is_refused_before_any_process_starts():
    with pytest.raises(stnb.ConfigError, match="CrossEncoderTrainer, SparseEncoderTrainer, MultiVectorEncoderTrainer"):
        stnb.run(build_plain_transformers_trainer, strategy="ddp", **FAST)


def test_a_wrong_return_names_the_trainer_for_the_model_type(tmp_path):
    """Inside the rank (what the function returns is only known there): a CrossEncoder handed to the
    wrong trainer is named with the trainer its type needs."""
    from sentence_transformers.cross_encoder import CrossEncoder

    from stnb.errors import BuildError
    from stnb.prepare import check_trainer

    class NotATrainer:
        model = CrossEncoder(tiny_path(), num_labels=1, device="cpu")

    with pytest.raises(BuildError, match=r"CrossEncoderTrainer\(model=model"):
        check_trainer(NotATrainer(), "build")
