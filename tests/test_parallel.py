"""Tensor and pipeline parallelism (stnblab.parallel) on 2 CPU gloo ranks, against one process.

The tiny random BERT (2 layers, 2 heads, hidden 64) keeps these fast; notebook 08 runs the same
code on MiniLM. Tolerances are stnblab.parallel.TOLERANCE (fp32: the measured differences are ~1e-7).
"""

from __future__ import annotations

import pytest

import procs
import torch

import stnb
from stnb.errors import ConfigError, VerificationError
from stnblab.parallel import TOLERANCE, pipeline_parallel, plans, tensor_parallel
from stnblab.parallel.single import load, make_batches, mnrl
from stnb.models import resolve_model

PAIRS, STEPS = 8, 3


@pytest.fixture(scope="module")
def tiny():
    path = resolve_model("tiny")
    return path, plans.model_shape(path)


def test_mnrl_is_sentence_transformers_loss(tiny):
    """The loss the parallel runs compute on embeddings is MultipleNegativesRankingLoss itself."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    path, _ = tiny
    model = load(path)
    features = make_batches(path, PAIRS, 1)[0]
    anchors = {k: v[:PAIRS] for k, v in features.items()}
    positives = {k: v[PAIRS:] for k, v in features.items()}
    theirs = MultipleNegativesRankingLoss(model)([anchors, positives], None)
    emb = model(dict(features))["sentence_embedding"]
    ours = mnrl(emb[:PAIRS], emb[PAIRS:])
    assert theirs.item() > 0.1
    assert abs(ours.item() - theirs.item()) < 1e-5


def assert_training_moved(losses):
    """The optimizer steps change the last batch's loss far more than the tolerance, so a run whose
    ranks skipped or botched a step could not match the reference's later losses."""
    path = resolve_model("tiny")
    with torch.no_grad():
        emb = load(path)(dict(make_batches(path, PAIRS, STEPS)[-1]))["sentence_embedding"]
    untrained = mnrl(emb[:PAIRS], emb[PAIRS:]).item()
    assert abs(untrained - losses[-1]) > 100 * TOLERANCE["loss"], (untrained, losses)


def test_tensor_parallel_matches_one_process(tiny):
    _, shape = tiny
    r = tensor_parallel("tiny", degree=2, pairs=PAIRS, steps=STEPS)
    assert r.embedding_diff <= TOLERANCE["embeddings"] and r.grad_diff <= TOLERANCE["grads"]
    assert r.loss_diff <= TOLERANCE["loss"]
    assert len(r.ranks[0]["losses"]) == STEPS
    assert_training_moved(r.reference["losses"])
    for rank in r.ranks:  # each rank holds less than the model: the layers' Linear weights are halved
        assert rank["local_params"] < rank["total_params"]
        assert rank["grads_compared"] == len(r.reference["grads"])
    # per layer: forward 2 all-reduces (attention output, MLP output), backward 4 (inputs of Q, K, V, MLP)
    comm = r.comm()
    assert comm["counts"] == {"all_reduce": 6 * shape.layers}, comm
    rows, tokens = r.reference["embeddings"].shape[0], make_batches(resolve_model("tiny"), PAIRS, 1)[0]["input_ids"].shape[1]
    assert comm["bytes"]["all_reduce"] == 6 * shape.layers * rows * tokens * shape.hidden * 4


@pytest.mark.parametrize("override, expected", [
    ({"1.*": None}, "layer 1 attention.self.query: not sharded"),
    ({"0.intermediate.dense": "rowwise"}, "layer 0 intermediate.dense: split as [Shard(dim=1)]"),
], ids=["layer-left-whole", "wrong-dimension"])
def test_a_broken_tensor_parallel_plan_is_reported(override, expected):
    with pytest.raises(VerificationError) as e:
        tensor_parallel("tiny", degree=2, pairs=PAIRS, steps=1, plan=override)
    assert "not the plan" in str(e.value) and expected in str(e.value), str(e.value)


def test_pipeline_parallel_matches_one_process(tiny):
    _, shape = tiny
    r = pipeline_parallel("tiny", stages=2, pairs=PAIRS, steps=STEPS)
    assert r.layers == [[0], [1]]
    table = r.table()
    assert list(zip(table.schedule, table.microbatches)) == [("gpipe", 1), ("gpipe", 2), ("gpipe", 4),
                                                             ("1f1b", 2), ("1f1b", 4)]
    assert (table.loss_diff <= TOLERANCE["loss"]).all() and (table.grad_diff <= TOLERANCE["grads"]).all()
    assert (table.embedding_diff <= TOLERANCE["embeddings"]).all()
    for run in r.runs:
        assert run["grads_compared"] == run["grads_expected"] > 0
        assert len(run["losses"]) == STEPS
        # every stage ran one forward and one backward per microbatch in the step it timed
        for stage in run["stages"]:
            kinds = sorted((k, c) for k, c, _t0, _t1 in stage["events"])
            assert kinds == sorted([("B", c) for c in range(run["microbatches"])]
                                   + [("F", c) for c in range(run["microbatches"])])
    assert ((table.idle_stage0 > 0) & (table.idle_stage0 < 1)).all()
    assert_training_moved(r.references[1]["losses"])
    assert table.bubble_formula.tolist() == [1 / 2, 1 / 3, 1 / 5, 1 / 3, 1 / 5]


def test_per_microbatch_loss_is_a_smaller_batch(tiny):
    """The pipeline's own loss sees B/m pairs per softmax: a different loss from full-batch MNRL."""
    r = pipeline_parallel("tiny", stages=2, runs=[("gpipe", 4)], pairs=PAIRS, steps=2, loss="per_microbatch")
    run = r.runs[0]
    assert run["loss_diff"] <= TOLERANCE["loss"]                      # equals its own reference
    full, per_mb = r.references[1]["losses"][0], r.references[4]["losses"][0]
    assert per_mb < full - 0.1, (per_mb, full)                      # 1 of 2 is easier than 1 of 8


def _refused(call, match):
    before = stnb.last_launch()
    with pytest.raises(ConfigError, match=match):
        call()
    assert stnb.last_launch() is before, "a process was started before the input was refused"


def test_bad_input_is_refused_before_any_process_starts():
    _refused(lambda: tensor_parallel("tiny", degree=3), r"TP degree 3 does not divide the model's attention heads \(2\)")
    _refused(lambda: tensor_parallel("mpnet-mini-random", degree=2),
             r"does not know model_type 'mpnet'.*attention\.self\.query")
    _refused(lambda: tensor_parallel("tiny", plan={"9.*": None}), r"matches no module")
    _refused(lambda: tensor_parallel("tiny", plan={"0.output.dense": "sideways"}), r"style 'sideways'")
    _refused(lambda: pipeline_parallel("tiny", stages=3), r"3 pipeline stages for a model of 2 layers")
    _refused(lambda: pipeline_parallel("tiny", runs=[("gpipe", 3)], pairs=8), r"3 microbatches do not divide")
    _refused(lambda: pipeline_parallel("tiny", runs=[("1f1b", 1)]), r"Schedule1F1B needs at least as many")
    _refused(lambda: pipeline_parallel("tiny", loss="whole"), r"loss 'whole'")
    _refused(lambda: pipeline_parallel("tiny", data_parallel=3), r"data_parallel=3 must be a positive divisor")
    if stnb.hardware.cpu_cores() < 4:
        _refused(lambda: pipeline_parallel("tiny", data_parallel=2), r"= 4 ranks: .*oversubscribe=True")
        _refused(lambda: tensor_parallel("minilm", degree=4), r"degree=4 is more than this machine supports")


def test_layers_split_evenly():
    assert plans.split_layers(6, 2) == [range(0, 3), range(3, 6)]
    assert plans.split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert [len(r) for r in plans.split_layers(6, 4)] == [2, 2, 1, 1]



def test_3d_data_pipeline_tensor_parallel_matches_one_process():
    """2 pipelines x 2 stages x 2 tensor shards = 8 ranks, oversubscribed on a small machine (torchrun).
    Each pipeline trains on its half of the pairs (its own in-batch negatives, as DDP does); the
    gradients are averaged across pipelines, so the reference is the mean MNRL over the two halves."""
    r = pipeline_parallel("tiny", stages=2, runs=[("gpipe", 2)], pairs=PAIRS, steps=2, data_parallel=2,
                          tensor_parallel=2, oversubscribe=True)
    run = r.runs[0]
    assert r.layout.world == 8 and len(run["stages"]) == 2
    assert run["grads_compared"] == run["grads_expected"] > 0
    assert run["loss_diff"] <= TOLERANCE["loss"] and run["grad_diff"] <= TOLERANCE["grads"]
    assert run["embedding_diff"] <= TOLERANCE["embeddings"]
    assert r.references[2]["losses"][0] != r.references[1]["losses"][0]   # two halves: not the full-batch loss
    total = sum(p.numel() for p in load(resolve_model("tiny")).parameters())
    assert sum(s["local_params"] for s in run["stages"]) < total   # TP halves every stage's layer weights


def test_an_oversubscribed_rank_that_fails_is_reported_and_nothing_is_left(monkeypatch):
    import os
    from pathlib import Path

    import rankfns
    from stnb.errors import LaunchError
    from stnblab.parallel.oversubscribe import launch_oversubscribed

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(LaunchError, match=r"(?s)3 oversubscribed ranks failed.*deliberate failure in rank 1"):
        launch_oversubscribed(rankfns.raise_on, 1, None, 120.0, num_processes=3, timeout=120)
    assert procs.children() == []


def test_oversubscribed_ranks_that_hang_are_stopped_with_their_torchrun(monkeypatch):
    """torchrun starts each rank in a session of its own: at the timeout its ranks are stopped with it (a SIGKILL
    to torchrun's group alone left them running, and the launch waiting on their output forever)."""
    import os
    from pathlib import Path

    import rankfns
    from stnb.errors import LaunchError
    from stnblab.parallel.oversubscribe import launch_oversubscribed

    before = procs.oversubscribed_ranks()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(LaunchError, match=r"3 oversubscribed ranks did not finish in 20 s"):
        launch_oversubscribed(rankfns.sleep_silent, 600.0, num_processes=3, timeout=20)
    assert procs.oversubscribed_ranks() - before == set()
