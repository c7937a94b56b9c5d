"""Parameters a loss owns (SoftmaxLoss's classifier, a learnable temperature) stay identical on every
rank under stnb, are listed in the result, and a run where they differ is not verified. Plain
sentence-transformers lets them drift apart (reproduced here): only the model is wrapped in DDP.

Real runs: 2 gloo ranks, the tiny model, a few steps.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch

import stnb
from stnb.models import tiny_path
from trainfns import FAST, st_args as _args, words as _words

SIX_STEPS = dict(max_steps=6, learning_rate=5e-2)


def _nli(n=48):
    """NLI-shaped pairs: premise, hypothesis, a class label 0/1/2."""
    from datasets import Dataset

    return Dataset.from_dict({"premise": [_words(i) for i in range(n)],
                              "hypothesis": [_words(i * 7 + 1) for i in range(n)],
                              "label": [i % 3 for i in range(n)]})


def _sts(n=48):
    from datasets import Dataset

    return Dataset.from_dict({"sentence1": [_words(i) for i in range(n)], "sentence2": [_words(i + 1) for i in range(n)],
                              "score": [((i * 37) % 100) / 100 for i in range(n)]})


def build_softmax(out: str):
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import SoftmaxLoss

    model = SentenceTransformer(tiny_path(), device="cpu")
    loss = SoftmaxLoss(model, model.get_sentence_embedding_dimension(), num_labels=3)
    return SentenceTransformerTrainer(model=model, args=_args(out, **SIX_STEPS), train_dataset=_nli(), loss=loss)


class LearnableTemperatureLoss(torch.nn.Module):
    """A user's in-batch-negatives loss with a learnable log-temperature (as a notebook cell defines it)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.log_scale = torch.nn.Parameter(torch.tensor(math.log(20.0)))

    def forward(self, features, labels):
        a, b = (self.model(f)["sentence_embedding"] for f in features)
        scores = torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T
        return torch.nn.functional.cross_entropy(scores * self.log_scale.exp(), torch.arange(len(a)))


def build_temperature(out: str):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    model = SentenceTransformer(tiny_path(), device="cpu")
    data = Dataset.from_dict({"anchor": [f"about {_words(i)}" for i in range(48)],
                              "positive": [_words(i) for i in range(48)]})
    return SentenceTransformerTrainer(model=model, args=_args(out, **SIX_STEPS), train_dataset=data,
                                      loss=LearnableTemperatureLoss(model))


def build_multi_dataset(out: str):
    """The seeds' benchmark recipe in small: NLI pairs with SoftmaxLoss and STS pairs with
    CosineSimilarityLoss, trained together (dicts of datasets and losses)."""
    from datasets import DatasetDict
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss, SoftmaxLoss

    model = SentenceTransformer(tiny_path(), device="cpu")
    losses = {"nli": SoftmaxLoss(model, model.get_sentence_embedding_dimension(), num_labels=3),
              "sts": CosineSimilarityLoss(model)}
    return SentenceTransformerTrainer(model=model, args=_args(out, **SIX_STEPS),
                                      train_dataset=DatasetDict({"nli": _nli(), "sts": _sts()}), loss=losses)


def _classifier_names(result) -> list:
    return result.verification["ranks"][0]["trained_parameters"]["loss"]


def test_softmax_classifier_identical_on_every_rank(tmp_path):
    r = stnb.run(functools.partial(build_softmax, str(tmp_path)), strategy="ddp", **FAST)
    assert r.verified, r.reason
    names = _classifier_names(r)
    assert names == ["loss.classifier.weight", "loss.classifier.bias"]
    assert r.verification["weights_identical_across_ranks"] is True
    # the classifier trained (the same on both ranks, and not its starting value): its digest is compared
    # across ranks with the model's, and the run is verified only because they agree
    assert r.verification["ranks"][0]["trained_parameters"]["loss_parameters_synced"] is True


def test_cell_defined_learnable_temperature_identical_on_every_rank(tmp_path):
    r = stnb.run(functools.partial(build_temperature, str(tmp_path)), strategy="ddp", **FAST)
    assert r.verified, r.reason
    assert _classifier_names(r) == ["loss.log_scale"]


def test_multi_dataset_softmax_and_cosine_one_classifier(tmp_path):
    r = stnb.run(functools.partial(build_multi_dataset, str(tmp_path)), strategy="ddp", **FAST)
    assert r.verified, r.reason
    assert _classifier_names(r) == ["loss[nli].classifier.weight", "loss[nli].classifier.bias"]
    assert r.config["train_size"] == len(_nli()) + len(_sts())  # the rows of both datasets, not 2 (the dict's keys)


def test_zero_stages_keep_the_loss_parameters_in_sync_too(tmp_path):
    for strategy in ("zero1", "zero2", "fsdp"):
        r = stnb.run(functools.partial(build_softmax, str(tmp_path / strategy)), strategy=strategy, **FAST)
        assert r.verified, (strategy, r.reason)
        assert _classifier_names(r) == ["loss.classifier.weight", "loss.classifier.bias"]
        # under fsdp the model's parameters are shards; the classifier is replicated and compared
        assert r.verification["weights_tensors_compared"] >= 2


def _plain_st_classifier_digest(out: str) -> str:
    """In a rank: plain sentence-transformers (no stnb strategy), SoftmaxLoss, 6 steps; the classifier's digest."""
    trainer = build_softmax(out)
    trainer.train()
    w = trainer.loss.classifier.weight.detach().contiguous()
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()


def test_plain_sentence_transformers_lets_the_classifier_drift(tmp_path):
    """The upstream trap stnb closes: the same training without stnb's strategy ends with a different
    classifier on each rank (the model itself is DDP-wrapped and stays identical)."""
    digests = stnb.launch(_plain_st_classifier_digest, str(tmp_path), num_processes=2, device="cpu",
                          threads_per_rank=1, echo=False, timeout=300)
    assert digests[0] != digests[1]
