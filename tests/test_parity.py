"""``stnb.parity``: every distributed strategy trains what one device trains with the global batch, the
loss's own parameters included, and a run whose ranks agree with each other but not with one device
fails it, naming the parameter.

Real runs: one process with the global batch, then 2 gloo ranks per strategy, the tiny model, 6 steps.
The deliberate breaks patch ``LossParameterSync.sync_grads`` in this process; the ranks are forked from
it (``start_method="fork"``), so the break runs in them.
"""

from __future__ import annotations

import functools

import pytest
import torch

import stnb
from stnb.models import tiny_path
from stnb.strategies.loss_sync import LossParameterSync
from test_loss_params import _nli, _sts
from trainfns import st_args

OPTIONS = dict(device="cpu", threads_per_rank=1, timeout=300, start_method="fork")
CLASSIFIER = ["loss/loss.classifier.bias", "loss/loss.classifier.weight"]


def _with_dropout(model, p=0.1):
    """The tiny model is built without dropout; a user's model has it (BERT: 0.1)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
    return model


def build_softmax(out: str, optim: str = "adamw_torch"):
    """SoftmaxLoss (a classifier the loss owns) on NLI-shaped pairs, per-device batch 4, dropout 0.1."""
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import SoftmaxLoss

    model = _with_dropout(SentenceTransformer(tiny_path(), device="cpu"))
    loss = SoftmaxLoss(model, model.get_sentence_embedding_dimension(), num_labels=3)
    args = st_args(out, max_steps=6, learning_rate=5e-2, optim=optim)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=_nli(), loss=loss)


def build_cosine(out: str):
    """CosineSimilarityLoss (no parameters of its own) on scored pairs: what DeepSpeed can train."""
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss

    model = _with_dropout(SentenceTransformer(tiny_path(), device="cpu"))
    args = st_args(out, max_steps=6, learning_rate=5e-2)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=_sts(), loss=CosineSimilarityLoss(model))


def test_every_strategy_trains_what_one_device_trains_loss_parameters_included(tmp_path):
    p = stnb.parity(functools.partial(build_softmax, str(tmp_path)),
                    strategies=["ddp", "zero1", "zero2", "fsdp", "deepspeed"], **OPTIONS)
    rows = p.table.set_index("strategy")
    for name in ("ddp", "zero1", "zero2", "fsdp"):
        assert rows.loc[name, "passed"], (name, rows.loc[name, "reason"])
        assert rows.loc[name, "verified"] and rows.loc[name, "global_batch_size"] == 8
        mine = p.parameters[p.parameters["strategy"] == name]
        # every trained tensor compared, the loss's classifier among them, each within the tolerance
        assert set(CLASSIFIER) <= set(mine["parameter"]) and len(mine) == rows.loc[name, "parameters"] > 30
        assert mine["within"].all() and (mine["relative"] <= mine["allowed"]).all()
        assert (mine[mine["owner"] == "loss"]["relative"] <= p.tolerance).all()  # the classifier: no rounding slack needed
        assert rows.loc[name, "loss_apart"] < 1e-4  # each step's loss: the same samples in every step
    # the one-device reference took the global batch: 2 ranks x 4
    assert rows.loc["single", "global_batch_size"] == 8 and rows.loc["single", "world_size"] == 1
    # DeepSpeed cannot train a loss's own parameters (its ZeRO optimizer maps only its module's): refused,
    # and a refusal is not a pass
    assert not rows.loc["deepspeed", "passed"] and "own trainable parameters" in rows.loc["deepspeed", "reason"]
    assert not p.passed and "deepspeed" in repr(p)


def test_deepspeed_trains_what_one_device_trains(tmp_path):
    p = stnb.parity(functools.partial(build_cosine, str(tmp_path)), strategies=["deepspeed"], stage=2, **OPTIONS)
    assert p.passed, repr(p)
    assert p.table.set_index("strategy").loc["deepspeed", "parameters"] > 30


def build_weight_decay(out: str):
    """CosineSimilarityLoss with weight_decay=0.1: mean pooling never uses the BERT pooler, so it gets no
    gradient, and one device (torch's AdamW skips a parameter without one) leaves it where it was."""
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss

    model = _with_dropout(SentenceTransformer(tiny_path(), device="cpu"))
    args = st_args(out, max_steps=6, learning_rate=5e-2, weight_decay=0.1)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=_sts(), loss=CosineSimilarityLoss(model))


POOLER = ["0.model.pooler.dense.bias", "0.model.pooler.dense.weight"]
WHOLE_ON_EVERY_RANK = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}  # every ZeRO-3 parameter
# partitioned (the tiny pooler is otherwise under the threshold: kept whole, gathered again after each step)


@pytest.mark.parametrize("stage, extra, kept", [(1, {}, True), (2, {}, True), (3, {}, True),
                                                (3, {"deepspeed_config": WHOLE_ON_EVERY_RANK}, True),
                                                (2, {}, False)],
                         ids=["stage1", "stage2", "stage3", "stage3-partitioned", "stage2-not-kept"])
def test_deepspeed_leaves_a_parameter_without_gradient_where_one_device_does(tmp_path, monkeypatch, stage, extra,
                                                                              kept):
    """DeepSpeed's flat partitions hold zeros for the pooler's gradient and its AdamW decays it; stnb puts back
    what the step wrote for a parameter no rank gave a gradient. The break: the step left as DeepSpeed's."""
    from stnb.strategies.deepspeed_nograd import KeepWithoutGradient

    if not kept:
        monkeypatch.setattr(KeepWithoutGradient, "step", lambda self, original, *a, **kw: original(*a, **kw))
    p = stnb.parity(functools.partial(build_weight_decay, str(tmp_path)), strategies=["deepspeed"], stage=stage,
                    **extra, **OPTIONS)
    row = p.table.set_index("strategy").loc["deepspeed"]
    assert row["verified"], row["reason"]  # the ranks agree with each other either way
    if not kept:
        assert not p.passed and set(p.failures()["parameter"]) == {"pooler.dense.weight"}, repr(p)
        return
    assert p.passed, repr(p)
    pooler = p.parameters.set_index(["strategy", "parameter"]).loc[("deepspeed", "pooler.dense.weight")]
    assert pooler["moved"] == 0 and pooler["apart"] == 0  # exactly where one device left it
    for rank in p.results["deepspeed"].verification["ranks"]:  # said, with the steps it was kept in
        assert rank["without_gradient"] == {"steps": 6, "kept": dict.fromkeys(POOLER, 6)}


def test_dropout_kept_is_measured_not_hidden(tmp_path):
    """With dropout on, each rank draws other masks than one device: parity says so, naming tensors."""
    p = stnb.parity(functools.partial(build_softmax, str(tmp_path)), strategies=["ddp"], dropout="keep", **OPTIONS)
    assert not p.passed and p.dropout == "keep"
    assert len(p.failures()) > 0 and "ended further from one device" in p.table.set_index("strategy").loc["ddp", "reason"]


def _summed(original):
    def sync_grads(self):  # the loss's gradients summed over the ranks instead of averaged
        world, self.world = self.world, 1
        try:
            original(self)
        finally:
            self.world = world
    return sync_grads


def _rank0_only(original):
    def sync_grads(self):  # every rank takes rank 0's gradient: the ranks agree, one device does not
        if not self.active:
            return
        import torch.distributed as dist

        for _, prm in self.named:
            if prm.grad is not None:
                dist.broadcast(prm.grad, src=0)
        self.steps_synced += 1
    return sync_grads


@pytest.mark.parametrize("break_, optim", [(None, "sgd"), (_summed, "sgd"), (_rank0_only, "adamw_torch")],
                         ids=["sgd-unbroken", "sgd-summed", "adamw-rank0-gradient"])
def test_a_broken_loss_parameter_average_fails_parity_naming_the_classifier(tmp_path, monkeypatch, break_, optim):
    """The ranks still agree with each other (the run is verified); only the comparison with one device
    tells. Summing is invisible under Adam (its update divides out a constant scale), hence SGD there."""
    if break_ is not None:
        monkeypatch.setattr(LossParameterSync, "sync_grads", break_(LossParameterSync.sync_grads))
    p = stnb.parity(functools.partial(build_softmax, str(tmp_path), optim=optim), strategies=["ddp"], **OPTIONS)
    ddp = p.table.set_index("strategy").loc["ddp"]
    assert ddp["verified"], ddp["reason"]  # cross-rank verification cannot see it
    if break_ is None:
        assert p.passed, repr(p)
        return
    assert not p.passed
    failed = set(p.failures()["parameter"])
    assert "loss/loss.classifier.weight" in failed, repr(p)
    assert "loss: loss/loss.classifier." in ddp["reason"] and "loss/loss.classifier.weight" in ddp["reason"], ddp["reason"]


def test_refuses_what_it_cannot_compare():
    build = functools.partial(build_cosine, "/tmp")
    with pytest.raises(stnb.ConfigError, match="one process"):
        stnb.parity(build, strategies=["single"])
    with pytest.raises(stnb.ConfigError, match="save_to"):
        stnb.parity(build, strategies=["ddp"], save_to="/tmp/x")
    with pytest.raises(stnb.ConfigError, match="stage is an option of deepspeed"):
        stnb.parity(build, strategies=["ddp"], stage=2)
    with pytest.raises(stnb.ConfigError, match="dropout"):
        stnb.parity(build, strategies=["ddp"], dropout="maybe")
    with pytest.raises(stnb.ConfigError, match="no strategy to compare"):
        stnb.parity(build, strategies=[])
    with pytest.raises(stnb.ConfigError, match="num_processes"):
        stnb.parity(build, strategies=["ddp"], num_processes=1)


def test_stnb_recipe_as_a_train_config():
    """A TrainConfig trains stnb's recipe in every run (its strategy and num_processes are parity's)."""
    config = stnb.TrainConfig(model="tiny", loss="cosine", steps=4, per_device_batch_size=4, evaluate=False,
                              strategy="fsdp", num_processes=2, **OPTIONS)
    p = stnb.parity(config, strategies=["ddp"])
    assert p.passed, repr(p)
    assert list(p.table["role"]) == ["reference", "rounding", "strategy"]
    assert p.global_batch_size == 8 and p.table.set_index("strategy").loc["ddp", "overall"] <= p.tolerance


def test_a_sampler_that_depends_on_the_split_is_not_the_same_training():
    """The seeds' recipe trains two datasets, each batch drawn from one of them: one device with the
    global batch takes 8 rows of one dataset per step, 2 ranks take 4 of each. Not the same training:
    ddp fails, naming the classifier (the rounding run, the same batches with their rows reversed, is)."""
    config = stnb.TrainConfig(model="tiny", loss="softmax+cosine", steps=4, per_device_batch_size=4,
                              evaluate=False, **OPTIONS)
    p = stnb.parity(config, strategies=["ddp"])
    rows = p.table.set_index("role")
    assert not p.passed and rows.loc["rounding", "passed"] and rows.loc["rounding", "overall"] <= p.tolerance
    assert rows.loc["strategy", "overall"] > 10 * p.tolerance
    assert "loss/loss[nli].classifier.weight" in rows.loc["strategy", "reason"]


def build_mnrl(out: str, gather: bool):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from trainfns import words

    model = SentenceTransformer(tiny_path(), device="cpu")
    data = Dataset.from_dict({"anchor": [f"about {words(i)}" for i in range(48)],
                              "positive": [words(i) for i in range(48)]})
    return SentenceTransformerTrainer(model=model, args=st_args(out, max_steps=6, learning_rate=5e-2), train_dataset=data,
                                      loss=MultipleNegativesRankingLoss(model, gather_across_devices=gather))


def test_in_batch_negatives_match_one_device_only_when_gathered(tmp_path):
    """MultipleNegativesRankingLoss: each rank's anchors see only its own 4 candidates, one device's see 8,
    unless the ranks gather their candidates (``gather_across_devices=True``, sentence-transformers #3453)."""
    alone = stnb.parity(functools.partial(build_mnrl, str(tmp_path), False), strategies=["ddp"], **OPTIONS)
    assert not alone.passed and alone.table.set_index("role").loc["strategy", "overall"] > 10 * alone.tolerance
    gathered = stnb.parity(functools.partial(build_mnrl, str(tmp_path), True), strategies=["ddp"], **OPTIONS)
    assert gathered.passed, repr(gathered)


class RowOrderLoss(torch.nn.Module):
    """A loss that weighs rows by their place in the batch: reversing the rows changes the training."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, features, labels):
        a, b = (self.model(f)["sentence_embedding"] for f in features)
        err = (torch.nn.functional.cosine_similarity(a, b) - labels) ** 2
        return (err * torch.linspace(1.0, 3.0, len(err))).mean()


def build_row_order(out: str):
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    model = SentenceTransformer(tiny_path(), device="cpu")
    args = st_args(out, max_steps=6, learning_rate=5e-2)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=_sts(), loss=RowOrderLoss(model))


def test_no_rounding_allowance_when_row_order_changes_the_training(tmp_path):
    p = stnb.parity(functools.partial(build_row_order, str(tmp_path)), strategies=["ddp"], **OPTIONS)
    rows = p.table.set_index("role")
    assert not rows.loc["rounding", "passed"] and "no rounding allowance" in rows.loc["rounding", "reason"]
    ddp = p.parameters[p.parameters["strategy"] == "ddp"]
    assert (ddp["allowed"] <= p.tolerance).all()  # judged against the tolerance alone (0 where nothing moved)
    assert not p.passed


class RecordingCosineLoss(torch.nn.Module):
    """CosineSimilarityLoss that appends each batch's scores (unique per row here) to a file per rank."""

    def __init__(self, model, folder):
        super().__init__()
        from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss

        self.model, self.inner, self.folder = model, CosineSimilarityLoss(model), folder

    def forward(self, features, labels):
        import json
        import os

        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.path.join(self.folder, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(sorted(round(float(x) * 1000) for x in labels)) + "\n")
        return self.inner(features, labels)


def build_recording(out: str, folder: str):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    from trainfns import words

    model = SentenceTransformer(tiny_path(), device="cpu")
    data = Dataset.from_dict({"sentence1": [words(i) for i in range(48)], "sentence2": [words(i + 1) for i in range(48)],
                              "score": [i / 1000 for i in range(48)]})
    return SentenceTransformerTrainer(model=model, args=st_args(out, max_steps=5), train_dataset=data,
                                      loss=RecordingCosineLoss(model, folder))


def test_each_step_sees_the_rows_one_device_sees_with_the_global_batch(tmp_path):
    """What parity rests on, observed: step k of 2 ranks with batch 4 covers exactly the rows of one
    device's step k with batch 8 (the trainer hands rank r every 2nd batch of the same sampler)."""
    import json

    def rows(folder, name):
        with open(folder / name) as f:
            return [json.loads(line) for line in f]

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    single = stnb.run(functools.partial(build_recording, str(tmp_path / "o1"), str(one)), strategy="single",
                      override_args={"per_device_train_batch_size": 8}, echo=False, **OPTIONS)
    ddp = stnb.run(functools.partial(build_recording, str(tmp_path / "o2"), str(two)), strategy="ddp",
                   num_processes=2, echo=False, **OPTIONS)
    assert single.verified and ddp.verified, (single.reason, ddp.reason)
    steps = rows(one, "rank0.jsonl")
    r0, r1 = rows(two, "rank0.jsonl"), rows(two, "rank1.jsonl")
    assert len(steps) == len(r0) == len(r1) == 5 and all(len(s) == 8 for s in steps)
    assert [sorted(a + b) for a, b in zip(r0, r1)] == steps
    assert len({x for s in steps for x in s}) == 40  # 5 steps x 8 distinct rows: none repeated, none lost
