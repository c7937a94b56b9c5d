"""Mixed precision with ``save_to`` (issue 32 item 4.1, issue 33 item 4): accelerate wraps the trained
model's ``forward`` in autocast. The save check and the dev metric after training must see the trained
model as it is saved (full precision), as the dev metric before training did; the run trains, verifies
and saves. CPU bf16 takes the same branch as a GPU's."""

import functools

import pytest

import stnb
from stnb import TrainConfig

SMALL = dict(model="tiny", steps=4, train_size=64, dev_size=32, warmup_steps_excluded=1, learning_rate=5e-3,
             per_device_batch_size=4)


def _dev_metric_of(path, config: TrainConfig) -> float:
    """The recipe's dev metric of the model saved at ``path``, in this process, in full precision."""
    from sentence_transformers import SentenceTransformer

    from stnb import seed_recipe
    from stnb.data import load_pairs
    from stnb.recipe import dev_evaluator

    load = seed_recipe.load if config.loss == seed_recipe.NAME else functools.partial(load_pairs, loss=config.loss)
    _, dev = load(config.data, config.train_size, config.dev_size, config.seed, columns=config.columns)
    evaluator = dev_evaluator(dev)
    return float(evaluator(SentenceTransformer(str(path), device="cpu"))[evaluator.primary_metric])


@pytest.mark.parametrize("strategy,n", [("single", None), ("ddp", 2)])
def test_bf16_trains_verified_and_saves_the_trained_model(tmp_path, strategy, n):
    target = tmp_path / "model"
    config = TrainConfig(strategy=strategy, num_processes=n, mixed_precision="bf16", save_to=str(target), **SMALL)
    r = stnb.run(config, echo=False)
    saved = r.verification["saved_model"]
    assert saved["encodes_the_same"], saved
    assert r.verified, r.reason
    assert saved["ok"] and saved["equals_trained"] and saved["differs_from_initial"]
    assert r.saved_to == str(target) and target.is_dir()
    # the dev metric after training is the saved model's, evaluated as the one before training was:
    # in full precision, not under the autocast accelerate left on the trained model
    assert r.dev_metric_after == pytest.approx(_dev_metric_of(target, config), abs=1e-9)


def test_drop_autocast_gives_back_the_full_precision_forward():
    """The unwrapping itself, on a model accelerate prepared for bf16 in this process."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from stnb.models import load_model, resolve_model
    from stnb.prepare import drop_autocast

    model = load_model(resolve_model("tiny"), device="cpu", max_seq_length=32)
    features = model.tokenize(["a sentence to embed", "and another, a little longer than the first"])

    def embed():
        with torch.no_grad():
            return model(dict(features))["sentence_embedding"].clone()

    full = embed()
    try:
        Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)
        assert not torch.equal(embed(), full), "accelerate's autocast wrapper is on: bf16 matmuls"
        assert drop_autocast(model) is True
        assert torch.equal(embed(), full)
        assert drop_autocast(model) is False, "nothing left to take off"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
