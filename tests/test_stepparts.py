"""The single run's parts the predictor starts from (stnb.stepparts, issue 31 item 1), measured in a real
2-rank gloo DDP run of a user's trainer: model calls and backward calls per step, optimizer.step apart from
clipping, the data wait, each gradient group's ready time, the step spread, evaluation and checkpoint saves
between steps with their frequency; and the predictor taking them instead of its guesses."""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import pytest

import stnb
from stnb import scaling, stepparts
from stnb.models import tiny_path
from stnb.strategies.ddp import ddp_step
from trainfns import FAST, st_args, words

ACCUMULATION, EVAL_EVERY, SAVE_EVERY, STEPS = 2, 2, 3, 6


def build_pairs(outdir: str):
    """MNRL on (anchor, positive) pairs, accumulating 2 micro-batches a step, evaluated every 2 steps and
    saved every 3."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import evaluation, losses

    model = SentenceTransformer(tiny_path(), device="cpu")
    train = Dataset.from_dict({"anchor": [f"what about {words(i)}" for i in range(64)],
                               "positive": [words(i) for i in range(64)]})
    dev = evaluation.EmbeddingSimilarityEvaluator([words(i) for i in range(8)], [words(i + 1) for i in range(8)],
                                                  [i / 8 for i in range(8)], name="dev", show_progress_bar=False)
    args = st_args(os.path.join(outdir, "out"), max_steps=STEPS, gradient_accumulation_steps=ACCUMULATION,
                   eval_strategy="steps", eval_steps=EVAL_EVERY, save_strategy="steps", save_steps=SAVE_EVERY)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=train, eval_dataset=None,
                                      loss=losses.MultipleNegativesRankingLoss(model), evaluator=dev)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pairs")
    return stnb.run(functools.partial(build_pairs, str(out)), strategy="ddp", echo=False, **FAST)


def test_the_steps_parts_are_fields_of_the_result(run):
    assert run.verified, run.reason
    for rank in range(2):
        split = run.time_split[rank]
        assert split["host_clock"] == "the same clock (CPU)"
        names = [g["name"] for g in split["grad_groups"]]
        assert names[0] == "embeddings" and "layer 0" in names and "layer 1" in names
        for st in split["steps"][1:]:
            assert st["forward_calls"] == 2 * ACCUMULATION  # two text columns, each micro-batch
            assert st["backward_calls"] == ACCUMULATION
            assert 0 < st["optimizer_step"] <= st["optimizer"] and st["clip"] >= 0
            assert st["optimizer_step"] + st["clip"] == pytest.approx(st["optimizer"], rel=1e-9)
            assert st["backward"] >= st["backward_compute"] > 0
            assert st["data_wait"] is not None and 0 <= st["data_wait"] <= st["data"] + 1e-9
            assert "host" not in st  # CPU: one clock
            ready = dict(zip(names, st["grad_ready"]))
            assert all(0 <= f <= 1 for f in ready.values() if f is not None)
            # backward runs from the last layer to the first: layer 1's gradients are ready before layer 0's
            assert ready["layer 1"] <= ready["layer 0"] <= ready["embeddings"]
        outside = run.outside_steps[rank]
        assert outside["spread"]["steps"] == STEPS - run.config.get("warmup_steps_excluded", 2)
        assert outside["spread"]["p50"] <= outside["spread"]["p90"]
        work = outside["work"]
        assert work["evaluate"]["after_steps"] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
        assert work["evaluate"]["every_steps"] == EVAL_EVERY
        assert work["save"]["after_steps"] == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
        assert all(s > 0 for s in work["evaluate"]["seconds"] + work["save"]["seconds"])


def test_the_prediction_takes_the_measured_parts(run):
    m = scaling.from_result(run)
    parts = stepparts.parts(run)
    assert m.forward_calls == parts["forward_calls"] == 2 * ACCUMULATION
    assert m.step_spread == pytest.approx(parts["spread"]["std"])
    assert [f for f, _ in m.ready] == sorted(f for f, _ in m.ready) and len(m.ready) == 3
    groups = run.time_split[0]["grad_groups"]
    unused = sum(g["numel"] for g in groups if g["name"] == "other") / sum(g["numel"] for g in groups)
    assert 0 < unused < 0.01  # the pooler: no gradient, never ready
    assert sum(share for _, share in m.ready) == pytest.approx(1 - unused)
    said = dict((name, how) for name, how, _ in m.inputs)
    for name in ("optimizer", "model calls per step", "gradient readiness (DDP's buckets)", "step spread",
                 "evaluate between steps", "save between steps", "data loading"):
        assert said[name] == "measured", name
    assert said["host vs device"] == "assumed"
    pred = scaling.predict(run, devices=[2, 4], link="nvlink-v100", strategies=["ddp"])
    assert any(a.startswith("MEASURED: gradient readiness") for a in pred.assumptions)
    assert any(a.startswith("ASSUMED: link bandwidth") for a in pred.assumptions)


def test_a_result_without_the_parts_is_predicted_from_assumptions(run):
    old = run.to_dict()
    old.pop("collectives"), old.pop("outside_steps")
    for split in old["time_split"]:
        split.pop("grad_groups")
        for st in split["steps"]:
            for k in ("forward_calls", "optimizer_step", "clip", "grad_ready", "data_wait"):
                st.pop(k)
    m = scaling.from_result(stnb.RunResult.from_dict(old))
    said = dict((name, how) for name, how, _ in m.inputs)
    assert said["model calls per step"] == "assumed" and m.forward_calls == 2  # the data's two text columns
    assert said["gradient readiness (DDP's buckets)"] == "assumed" and m.ready == ()


def test_ddp_exposes_what_is_ready_only_at_backwards_end():
    base = scaling.Measured(batch=16, forward=0.01, backward=0.02, optimizer=0.005, other=0.001,
                            grad_bytes=400e6, param_bytes=400e6, bucket_bytes=25 * 2**20)
    fab = scaling.fabric("nvlink-v100", "100gbps")
    late = ddp_step(replace(base, ready=((1.0, 1.0),)), fab, 4)      # every gradient ready at the end
    early = ddp_step(replace(base, ready=((0.1, 0.5), (0.6, 0.5))), fab, 4)  # half early, half at 60%
    whole = fab.all_reduce(base.grad_bytes / len(range(16)), 4) * 16  # 16 buckets of 25 MiB
    assert late["comm_exposed"] == pytest.approx(late["comm"]) and late["comm"] == pytest.approx(whole, rel=0.01)
    assert early["comm_exposed"] < late["comm_exposed"]


def test_the_collectives_sentence_counts_whole_calls_a_range_where_steps_differ():
    """What a step sends, said in whole calls: an FSDP run whose steps gathered 23, 22 and 23 times reads
    '22 to 23 all_gather', never the mean 22.6667 (issue 46: '30.6667 collectives'); the warm-up step is left out."""
    from stnb import stepparts

    def step(gathers, reduce=0):
        return {"all_gather_into_tensor": {"count": gathers, "bytes": 2**20},
                **({"all_reduce": {"count": reduce, "bytes": None}} if reduce else {}),
                "reduce_scatter_tensor": {"count": 7, "bytes": 2**20}}

    result = {"config": {"warmup_steps_excluded": 1},
              "collectives": [{"steps": [step(40), step(23), step(22), step(23, reduce=1)]}]}
    assert stepparts.sentence(result) == ("29 to 31 collectives a step per rank (22 to 23 all_gather_into_tensor, "
                                          "7 reduce_scatter_tensor, 0 to 1 all_reduce; 2.0 MiB handed over)")
    same = {"config": {"warmup_steps_excluded": 0}, "collectives": [{"steps": [step(22), step(22)]}]}
    assert stepparts.sentence(same).startswith("29 collectives a step per rank (22 all_gather_into_tensor, 7 ")
    assert stepparts.sentence({"collectives": [{"steps": [{}, {}]}]}) == "no collective in a step"
    assert stepparts.sentence({}) == ""
