"""What a step sends (stnb.instruments.collectives): every collective call per step and rank, by kind and bytes,
counted in real 2-rank gloo DDP runs of the tiny model with a cached loss (sentence-transformers #4027: a
cached loss with gathered negatives sends collectives per mini-batch)."""

from __future__ import annotations

import functools
import math
import os

import pytest

import stnb
from stnb import stepparts
from stnb.models import tiny_path
from trainfns import FAST, st_args, words

BATCH, MINI, ROWS = 8, 2, 48
COLUMNS = ("anchor", "positive", "negative")


def build_cached(outdir: str, gather: bool):
    """CachedMultipleNegativesRankingLoss: mini-batches of MINI rows of a batch of BATCH, negatives gathered
    across the ranks or not."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses

    model = SentenceTransformer(tiny_path(), device="cpu")
    train = Dataset.from_dict({"anchor": [f"what about {words(i)}" for i in range(ROWS)],
                               "positive": [words(i) for i in range(ROWS)],
                               "negative": [words(i + 3) for i in range(ROWS)]})
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI, gather_across_devices=gather)
    args = st_args(os.path.join(outdir, "out"), per_device_train_batch_size=BATCH, max_steps=5)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    out = tmp_path_factory.mktemp("cached")
    return stnb.run(functools.partial(build_cached, str(out), True), strategy="ddp", echo=False, **FAST)


@pytest.fixture(scope="module")
def cached_alone(tmp_path_factory):
    out = tmp_path_factory.mktemp("alone")
    return stnb.run(functools.partial(build_cached, str(out), False), strategy="ddp", echo=False, **FAST)


def _dim():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(tiny_path(), device="cpu").get_embedding_dimension()


def test_a_cached_loss_with_gathered_negatives_sends_what_its_setup_implies(cached):
    """Per step and rank: DDP's buckets all-reduced once (the loss replays its mini-batches under no_sync and
    synchronises the last), every gradient once; one all-gather per column; and, per mini-batch, each
    gathered column's backward: gloo emulates the all-gather's backward (a reduce-scatter) with a scatter
    from every rank."""
    assert cached.verified, cached.reason
    chunks, world = math.ceil(BATCH / MINI), 2
    trainable = cached.verification["model_shape"]["trainable_param_count"]
    row = 4 * _dim()  # one embedding, float32
    for rank in range(world):
        split = cached.time_split[rank]["steps"]
        steps = cached.collectives[rank]["steps"]
        assert len(steps) == cached.steps == len(split)
        for st, sent in zip(split[1:], steps[1:]):  # after the first step (DDP rebuilds its buckets)
            assert set(sent) == {"all_reduce", "all_gather", "scatter"}, sent
            assert sent["all_reduce"] == {"count": st["buckets"], "bytes": 4 * trainable}  # the hook's buckets
            assert sent["all_gather"] == {"count": len(COLUMNS), "bytes": len(COLUMNS) * BATCH * row}
            assert sent["scatter"]["count"] == chunks * len(COLUMNS) * world
            assert st["forward_calls"] == 2 * chunks * len(COLUMNS)  # a pass without gradients, then the replay
            assert st["backward_calls"] == 1
        # what no step holds: the first step's verification (an object gather), the time split's barrier,
        # the trainer's loss gathers for logging (logging_steps=1: one per step)
        outside = cached.collectives[rank]["outside_steps"]
        assert outside["barrier"]["count"] == 1 and outside["all_gather_object"]["bytes"] is None
    per = stepparts.collectives(cached)
    assert per[0]["scatter"]["count"] == chunks * len(COLUMNS) * world  # the steady steps' mean, most first
    assert list(per[0]) == ["scatter", "all_gather", "all_reduce"]
    assert f"{chunks * len(COLUMNS) * world + len(COLUMNS) + split[-1]['buckets']:g} collectives a step" \
        in stepparts.sentence(cached)


def test_without_gathering_only_the_buckets_go_out(cached_alone, cached):
    assert cached_alone.verified, cached_alone.reason
    trainable = cached_alone.verification["model_shape"]["trainable_param_count"]
    for rank in range(2):
        for st, sent in list(zip(cached_alone.time_split[rank]["steps"], cached_alone.collectives[rank]["steps"]))[1:]:
            assert sent == {"all_reduce": {"count": st["buckets"], "bytes": 4 * trainable}}


def test_the_time_split_figure_says_what_a_step_sends(cached):
    from stnb.plots.timesplit import split_bars

    fig = split_bars([cached], names=["cached"])
    text = fig.layout.annotations[0].text
    assert "collectives a step per rank" in text and "scatter" in text and "all_reduce" in text


def test_collectives_are_put_back_after_training(cached):
    import torch.distributed as dist

    assert not hasattr(dist.all_reduce, "__stnb_counted__")  # the notebook's process was never wrapped
    from stnb.instruments import Collectives

    c = Collectives()
    c.start()
    assert hasattr(dist.all_reduce, "__stnb_counted__") and hasattr(dist.all_gather_into_tensor, "__stnb_counted__")
    c.stop()
    assert not hasattr(dist.all_reduce, "__stnb_counted__")


def test_fsdp_sends_its_gathers_and_reduce_scatters():
    """FSDP2 (``fully_shard``, torch 2.13: ``dist.all_gather_single`` / ``reduce_scatter_single``), 2 ranks, the
    recipe's CosineSimilarityLoss (two model calls a step): per step and rank, every unit gathered for the
    first call, the layers again for the second (the root stays gathered) and again in backward (resharded
    after forward); one reduce-scatter per unit, every gradient once; the gradient norm's all-reduce."""
    run = stnb.run(stnb.TrainConfig(strategy="fsdp", num_processes=2, model="tiny", steps=5, train_size=128,
                                    dev_size=16, evaluate=False), echo=False)
    assert run.verified, run.reason
    layers = run.verification["ranks"][0]["wrapped_layers"]
    trainable = run.verification["model_shape"]["trainable_param_count"]
    for rank in range(2):
        for st, sent in list(zip(run.time_split[rank]["steps"], run.collectives[rank]["steps"]))[1:]:
            calls = st["forward_calls"]
            assert calls == 2
            assert sent["all_gather_into_tensor"]["count"] == (layers + 1) + layers * (calls - 1) + layers
            assert sent["reduce_scatter_tensor"] == {"count": layers + 1, "bytes": 4 * trainable}
            assert sent["all_reduce"]["count"] == 1  # clip_grad_norm_'s total norm over the shards
