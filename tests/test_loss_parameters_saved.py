"""A loss's own parameters in a checkpoint (stnb.strategies.loss_sync: save_loss_parameters, load_loss_parameters,
named_with_loss), in this process on made-up trainers: what the checkpoint tests' real runs rely on, and what the
mutation run's fast selection reaches (the runs that resume a SoftmaxLoss are in tests/test_checkpoints.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from stnb.errors import CheckpointError
from stnb.strategies.loss_sync import LOSS_PARAMETERS, load_loss_parameters, named_with_loss, save_loss_parameters


class _Loss(torch.nn.Module):
    def __init__(self, model, seed):
        super().__init__()
        self.model = model  # a sentence-transformers loss holds the model: its parameters are not the loss's own
        torch.manual_seed(seed)
        self.classifier = torch.nn.Linear(3, 2)


def _trainer(seed=0, loss=True, should_save=True):
    torch.manual_seed(100)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    return SimpleNamespace(model=model, model_wrapped=model, loss=_Loss(model, seed) if loss else torch.nn.MSELoss(),
                           args=SimpleNamespace(should_save=should_save))


def test_the_loss_parameters_go_into_the_checkpoint_and_come_back_in_another_run(tmp_path):
    writer, reader = _trainer(seed=1), _trainer(seed=2)
    assert not torch.equal(writer.loss.classifier.weight, reader.loss.classifier.weight)
    save_loss_parameters(writer, str(tmp_path))
    saved = torch.load(tmp_path / LOSS_PARAMETERS, weights_only=True)
    assert sorted(saved) == ["loss.classifier.bias", "loss.classifier.weight"]  # the loss's own, not the model's
    load_loss_parameters(reader, str(tmp_path))
    assert torch.equal(reader.loss.classifier.weight, writer.loss.classifier.weight)
    assert torch.equal(reader.loss.classifier.bias, writer.loss.classifier.bias)


def test_only_the_writing_rank_writes_and_a_loss_without_parameters_writes_nothing(tmp_path):
    save_loss_parameters(_trainer(should_save=False), str(tmp_path))
    save_loss_parameters(_trainer(loss=False), str(tmp_path))
    assert os.listdir(tmp_path) == []
    load_loss_parameters(_trainer(loss=False), str(tmp_path))  # nothing saved, nothing owned: nothing to do


def test_a_checkpoint_of_another_loss_is_refused_word_for_word(tmp_path):
    with pytest.raises(CheckpointError) as none:
        load_loss_parameters(_trainer(), str(tmp_path))
    assert str(none.value) == (
        f"{tmp_path} holds the loss parameters none and this run's loss has ['loss.classifier.bias', "
        "'loss.classifier.weight']: it was written by a run with another loss (or before stnb saved a loss's own "
        "parameters); resume with the loss that wrote it, or start from step 0 (the model it holds: "
        "stnb.checkpoints.to_model)")
    save_loss_parameters(_trainer(), str(tmp_path))
    with pytest.raises(CheckpointError, match=r"holds the loss parameters \['loss.classifier.bias', "
                                              r"'loss.classifier.weight'\] and this run's loss has none"):
        load_loss_parameters(_trainer(loss=False), str(tmp_path))


def test_the_optimizer_names_the_models_parameters_as_the_model_does_and_the_losss_by_their_names():
    plain = _trainer(loss=False)
    assert named_with_loss(plain) is plain.model
    trainer = _trainer()
    named = dict(named_with_loss(trainer).named_parameters())
    assert list(named) == ["0.weight", "0.bias", "loss.classifier.weight", "loss.classifier.bias"]
    assert named["0.weight"] is trainer.model[0].weight  # the same tensors, nothing copied
    assert named["loss.classifier.bias"] is trainer.loss.classifier.bias
