"""Six of sentence-transformers' own example training scripts, run as a user would under every strategy (issue 48).

``examples/st_examples/`` holds offline, small copies of training_stsbenchmark.py (CosineSimilarityLoss),
training_nli_v2.py (MNRL with hard negatives), matryoshka_nli.py (MatryoshkaLoss), model_distillation.py
(EmbedDistillLoss with a projection), training_gooaq_bce.py (a reranker on mined hard negatives) and
train_splade_nq.py (SPLADE), each changed only to run offline and small (each says what changed): their own
training arguments kept, checkpoints every 2 steps, ``load_best_model_at_end`` where the original has it, and the
original's precision flag (fp16=True, or bf16=True with the use_cpu=True transformers asks for on CPU). Each
script's ``build()`` runs unchanged under single and under ddp, zero1, zero2, fsdp and deepspeed on 2 ranks;
``OUTCOMES`` is what happens, measured: verified, or refused (in the ranks, right after the build, before the
first step: a user's arguments exist only there) with the reason and the fix. Then the fixes the refusals name
are applied the way a user would, and those runs are verified too.

Real runs: 2 gloo ranks on CPU (single: one process), the tiny BERT, 6 steps; about 4 s each.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys

import pytest

import procs
import stnb
from stnb import checkpoints
from stnb.strategies.loss_sync import LOSS_PARAMETERS
from trainfns import FAST

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "st_examples")
SCRIPTS = ["training_stsbenchmark", "training_nli_v2", "matryoshka_nli", "model_distillation", "training_gooaq_bce",
           "train_splade_nq"]
STRATEGIES = ["single", "ddp", "zero1", "zero2", "fsdp", "deepspeed"]
# the scripts that keep the original's load_best_model_at_end=True: the class of their model, their metric
BEST = {"model_distillation": ("SentenceTransformer", "eval_sts-dev_spearman_cosine"),
        "training_gooaq_bce": ("CrossEncoder", "eval_gooaq-dev_ndcg@10"),
        "train_splade_nq": ("SparseEncoder", "eval_nq-dev_dot_ndcg@10")}

# what each refusal says: the reason and the fix, as stnb words them
FP16_ON_CPU = ["cannot train this trainer under strategy 'deepspeed'", "fp16=True on CPU",
               "DeepSpeed's fp16 engine would compute in float16", "remove fp16=True"]
BF16_ON_CPU = ["cannot train this trainer under strategy 'deepspeed'", "use_cpu=True in your arguments",
               "accelerate refuses DeepSpeed in its CPU mode", "remove use_cpu",
               "DeepSpeed cannot train bf16 on CPU", "use strategy='zero1', 'zero2' or 'fsdp'"]
LOSS_PARAMETERS_REFUSED = ["your loss has its own trainable parameters (loss.projection.weight, loss.projection.bias)",
                           "use strategy='zero1' or 'ddp', which keep them in sync"]
PROJECTION = ["loss.projection.weight", "loss.projection.bias"]  # the distillation's loss's own parameters


# (script, strategy) -> None: verified; a list: refused, the message holding every string of it
OUTCOMES = {(script, strategy): None for script in SCRIPTS for strategy in STRATEGIES}
OUTCOMES.update({(script, "deepspeed"): FP16_ON_CPU for script in SCRIPTS[:3]})
OUTCOMES.update({("model_distillation", "deepspeed"): FP16_ON_CPU + LOSS_PARAMETERS_REFUSED,
                 ("training_gooaq_bce", "deepspeed"): BF16_ON_CPU, ("train_splade_nq", "deepspeed"): BF16_ON_CPU})


def _script(name: str):
    """The example script as a module (its folder on sys.path, as `python examples/st_examples/<name>.py` has)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    return importlib.import_module(name)


def _run(script: str, strategy: str, out, build=None, **kw):
    ranks = {"num_processes": None} if strategy == "single" else {}
    build = build or _script(script).build
    return stnb.run(functools.partial(build, str(out)), strategy=strategy, echo=False, **{**FAST, **ranks, **kw})


def torch_load(path: str) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def _weights(path: str, model_class: str, saved: str) -> dict:
    """Every tensor of the model a folder holds: a saved model or a trainer-format checkpoint, or the shards of a
    sharded one (fsdp, zero2) read into the architecture of the model saved in ``saved``."""
    import sentence_transformers

    cls = getattr(sentence_transformers, model_class)
    if os.path.isdir(os.path.join(path, "dcp-model")):
        return checkpoints.to_model(path, like=cls(saved, device="cpu")).state_dict()
    return cls(path, device="cpu").state_dict()


def _assert_the_best_checkpoint_was_loaded(out: str, saved: str, script: str) -> None:
    """The checkpoint load_best_model_at_end loaded is the one the metric chose: the trainer's best step is the
    first evaluation that reached the best value of metric_for_best_model in the run's log, its checkpoint is
    complete and kept by the rotation, and the model saved at the end (save_to) holds its weights."""
    model_class, metric = BEST[script]
    final = os.path.join(out, "checkpoint-6")
    with open(os.path.join(final, checkpoints.TRAINER_STATE)) as f:
        state = json.load(f)
    evals = [(e["step"], e[metric]) for e in state["log_history"] if metric in e]
    assert [s for s, _ in evals] == [2, 4, 6], state["log_history"]
    best_value = max(v for _, v in evals)
    assert state["best_metric"] == best_value
    assert state["best_global_step"] == next(s for s, v in evals if v == best_value)
    best = os.path.join(out, f"checkpoint-{state['best_global_step']}")
    assert state["best_model_checkpoint"] == best
    assert state["best_global_step"] in [s for s, _ in checkpoints.complete(out)]
    wbest, wsaved = _weights(best, model_class, saved), _weights(saved, model_class, saved)
    assert wbest.keys() == wsaved.keys()
    assert all((wbest[k] == wsaved[k]).all() for k in wbest), "the saved model is not the best checkpoint's"
    if state["best_global_step"] != 6:  # the comparison can fail: the last step's weights are other weights
        wlast = _weights(final, model_class, saved)
        assert any(not (wlast[k] == wsaved[k]).all() for k in wlast)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_example_script_runs_unchanged_under_every_strategy_or_is_refused_with_the_fix(tmp_path, script,
                                                                                             strategy):
    """The script's build() under the strategy, as OUTCOMES says: verified, with a checkpoint every 2 steps (and
    the best checkpoint loaded at the end where the script asks for it), or refused before the first step with the
    message naming the reason and the fix, no checkpoint written and no process left behind."""
    out = tmp_path / "out"
    expected = OUTCOMES[script, strategy]
    if expected is None:
        r = _run(script, strategy, out, save_to=str(tmp_path / "model") if script in BEST else None)
        assert r.verified, r.reason
        assert [c["step"] for c in r.checkpoints] == [2, 4, 6]
        if script in BEST:
            _assert_the_best_checkpoint_was_loaded(str(out), str(tmp_path / "model"), script)
        if script == "model_distillation":  # its loss's projection trained, and in every checkpoint
            assert r.verification["ranks"][0]["trained_parameters"]["loss"] == PROJECTION
            kept = checkpoints.complete(out)
            assert kept and all(sorted(torch_load(os.path.join(path, LOSS_PARAMETERS))) == sorted(PROJECTION)
                                for _, path in kept)
    else:
        with pytest.raises(stnb.LaunchError) as refused:
            _run(script, strategy, out)
        message = str(refused.value)
        assert all(part in message for part in expected), message
        assert not checkpoints.complete(out)
    assert not procs.children()


def _without_precision_flags(monkeypatch) -> None:
    """What the deepspeed refusals ask for, as a user would do it (remove fp16=True; remove bf16 and use_cpu): every
    training argument built from now on, in this process and in the ranks forked from it, has neither."""
    from transformers import TrainingArguments

    real = TrainingArguments.__post_init__

    def without(self):
        self.fp16 = self.bf16 = self.use_cpu = False
        return real(self)

    monkeypatch.setattr(TrainingArguments, "__post_init__", without)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_under_deepspeed_each_script_trains_once_its_precision_flag_is_removed(monkeypatch, tmp_path, script):
    """The fix deepspeed's precision refusal names (remove fp16=True; remove use_cpu and bf16), applied: every
    script is verified with its checkpoints (the best one loaded where asked), except the distillation, whose loss's
    projection DeepSpeed's ZeRO optimizer cannot train: refused with the strategies that keep it in sync."""
    _without_precision_flags(monkeypatch)
    out = tmp_path / "out"
    if script == "model_distillation":
        with pytest.raises(stnb.LaunchError) as refused:
            _run(script, "deepspeed", out)
        message = str(refused.value)
        assert all(part in message for part in LOSS_PARAMETERS_REFUSED) and "fp16" not in message, message
    else:
        r = _run(script, "deepspeed", out, save_to=str(tmp_path / "model") if script in BEST else None)
        assert r.verified, r.reason
        assert [c["step"] for c in r.checkpoints] == [2, 4, 6]
        if script in BEST:
            _assert_the_best_checkpoint_was_loaded(str(out), str(tmp_path / "model"), script)
    assert not procs.children()
