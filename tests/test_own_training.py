"""A user's own sentence-transformers training under stnb's strategies: stnb.run(build, strategy=...).

Every run is real: 2 gloo ranks on CPU (or one process for 'single'), the tiny model, a few steps.
The build functions live here, as a user writes them in a notebook cell.
"""

from __future__ import annotations

import functools
import json
import os

import psutil
import pytest

import procs
import torch
from transformers import TrainerCallback

import stnb
from stnb.models import tiny_path
from trainfns import FAST, st_args as _args, words as _words



def _triplets(n=32):
    from datasets import Dataset

    return Dataset.from_dict({"anchor": [f"what about {_words(i)}" for i in range(n)],
                              "positive": [_words(i) for i in range(n)],
                              "negative": [_words(i + 3) for i in range(n)]})


class StepCounter(TrainerCallback):
    """A user's callback: counts the steps it sees in this rank and leaves the count in a file."""

    def __init__(self, outdir):
        self.outdir, self.steps = outdir, 0

    def on_step_end(self, args, state, control, **kw):
        self.steps += 1

    def on_train_end(self, args, state, control, **kw):
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(self.outdir, f"steps-rank{rank}.json"), "w") as f:
            json.dump({"steps": self.steps, "pid": os.getpid()}, f)


def build_mnrl_negatives(outdir: str, bucket_cap_mb=None):
    """MultipleNegativesRankingLoss with hard negatives, an IR evaluator, a callback of the user's."""
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import evaluation, losses

    model = SentenceTransformer(tiny_path(), device="cpu")
    train = _triplets()
    n = 8
    ir = evaluation.InformationRetrievalEvaluator(
        {f"q{i}": f"what about {_words(i)}" for i in range(n)}, {f"d{i}": _words(i) for i in range(n)},
        {f"q{i}": {f"d{i}"} for i in range(n)}, name="mine", show_progress_bar=False, write_csv=False)
    kw = {} if bucket_cap_mb is None else {"ddp_bucket_cap_mb": bucket_cap_mb}
    return SentenceTransformerTrainer(model=model, args=_args(os.path.join(outdir, "out"), **kw), train_dataset=train,
                                      loss=losses.MultipleNegativesRankingLoss(model), evaluator=ir,
                                      callbacks=[StepCounter(outdir)])


def build_cosent(outdir: str):
    """CoSENTLoss on scored pairs, on a model assembled from modules (Transformer + Pooling + Normalize)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import evaluation, losses, modules

    word = modules.Transformer(tiny_path(), max_seq_length=32)
    model = SentenceTransformer(modules=[word, modules.Pooling(word.get_embedding_dimension(), "mean"),
                                         modules.Normalize()], device="cpu")
    n = 32
    train = Dataset.from_dict({"sentence1": [_words(i) for i in range(n)],
                               "sentence2": [_words(i + i % 2) for i in range(n)],
                               "score": [1.0 if i % 2 == 0 else 0.2 for i in range(n)]})
    dev = evaluation.EmbeddingSimilarityEvaluator([_words(i) for i in range(8)], [_words(i + 1) for i in range(8)],
                                                  [0.5] * 4 + [0.1] * 4, name="sts", show_progress_bar=False)
    return SentenceTransformerTrainer(model=model, args=_args(os.path.join(outdir, "out"), disable_tqdm=False),
                                      train_dataset=train, loss=losses.CoSENTLoss(model), evaluator=dev)


def build_matryoshka_and_triplet(outdir: str, which: str = "matryoshka"):
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses

    model = SentenceTransformer(tiny_path(), device="cpu")
    dim = model.get_embedding_dimension()
    loss = (losses.MatryoshkaLoss(model, losses.MultipleNegativesRankingLoss(model), [dim, dim // 2])
            if which == "matryoshka" else losses.TripletLoss(model))
    return SentenceTransformerTrainer(model=model, args=_args(os.path.join(outdir, "out")), train_dataset=_triplets(),
                                      loss=loss)


class EncoderLoss(torch.nn.Module):
    """A user's own loss that keeps the model under another name than ``model`` (sentence-transformers
    only rebinds ``model``): under DDP it must still call the DDP wrapper, or the ranks drift apart."""

    def __init__(self, model):
        super().__init__()
        self.encoder = model

    def forward(self, features, labels):
        a, p = (self.encoder(f)["sentence_embedding"] for f in features[:2])
        scores = a @ p.T
        return torch.nn.functional.cross_entropy(scores, torch.arange(len(a)))


def build_encoder_loss(outdir: str):
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    model = SentenceTransformer(tiny_path(), device="cpu")
    return SentenceTransformerTrainer(model=model, args=_args(os.path.join(outdir, "out"),
                                                              ddp_find_unused_parameters=True),
                                      train_dataset=_triplets().remove_columns("negative"), loss=EncoderLoss(model))


# ---- runs ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnrl_runs(tmp_path_factory):
    out = {}
    for strategy in ("ddp", "fsdp"):
        d = str(tmp_path_factory.mktemp(f"mnrl-{strategy}"))
        build = functools.partial(build_mnrl_negatives, d, bucket_cap_mb=5 if strategy == "ddp" else None)
        opts = dict(FAST, bucket_cap_mb=10) if strategy == "ddp" else dict(FAST)
        out[strategy] = (stnb.run(build, strategy=strategy, echo=False, **opts), d)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_mnrl_with_hard_negatives_trains_verified(mnrl_runs, strategy):
    res, d = mnrl_runs[strategy]
    v = res.verification
    assert res.verified, res.reason
    assert res.build.endswith("build_mnrl_negatives") and res.strategy == strategy and res.world_size == 2
    # all three columns reached the loss, and the loss called the module that trains
    assert v["data_columns"] == ["anchor", "positive", "negative"]
    assert v["loss_inputs"] == [{"texts": 3, "label": False}] * 2 and v["loss_received_all_columns"]
    for rank in v["ranks"]:
        assert rank["loss_model"]["ok"] and rank["loss_model"]["calls_in_first_step"] >= 1
    # the user's evaluator, before and after, under its own primary metric
    assert res.dev_metric == "mine_cosine_ndcg@10"
    assert res.dev_metric_before is not None and res.dev_metric_after is not None
    assert res.steps == 3 and len(res.losses) == 3 and res.samples_per_second > 0
    assert res.per_device_batch_size == 4 and res.global_batch_size == 8
    assert res.config["loss"] == "MultipleNegativesRankingLoss" and res.config["steps"] == 3
    assert "model" not in res.config or res.config["model"] != "minilm"
    # the user's callback ran in both ranks, for every step
    counts = [json.load(open(os.path.join(d, f"steps-rank{r}.json"))) for r in (0, 1)]
    assert [c["steps"] for c in counts] == [3, 3] and counts[0]["pid"] != counts[1]["pid"]
    assert "StepCounter" in v["ranks"][0]["callbacks"]["kept"]
    # a results file, the frame and the plots take it
    path = os.path.join(d, "results.jsonl")
    stnb.append_result(path, res)
    df = stnb.load_results(path)
    assert df.loc[0, "build"] == res.build and df.loc[0, "final_loss"] == res.losses[-1]
    assert df.loc[0, "loss"] == "MultipleNegativesRankingLoss"
    assert len(stnb.plots.dashboard(df).data) > 0 and len(stnb.plots.loss_curves(df).data) == 1


def test_ddp_wraps_and_keeps_weights_identical_and_reports_overrides(mnrl_runs):
    res, _ = mnrl_runs["ddp"]
    v = res.verification
    assert {r["wrapper"] for r in v["ranks"]} == {"DistributedDataParallel"}
    assert v["weights_identical_across_ranks"] and len(set(v["weights_checksums"])) == 1
    assert all(r["loss_model"]["trains"] == "DistributedDataParallel" for r in v["ranks"])
    # the user asked ddp_bucket_cap_mb=5, stnb.run was given bucket_cap_mb=10: overridden, and said so
    assert res.overridden_args["ddp_bucket_cap_mb"]["from"] == 5
    assert res.overridden_args["ddp_bucket_cap_mb"]["to"] == 10
    assert "bucket_cap_mb" in res.overridden_args["ddp_bucket_cap_mb"]["why"]
    assert {r["ddp_settings"]["bucket_cap_mb"] for r in v["ranks"]} == {10}  # what DDP itself holds
    assert "disable_tqdm" in res.overridden_args  # the user's default False: stnb shows progress instead


def test_fsdp_really_shards_the_users_model(mnrl_runs):
    res, _ = mnrl_runs["fsdp"]
    v = res.verification
    assert v["shards_add_up"]
    for rank in v["ranks"]:
        assert rank["wrapper"] != "DistributedDataParallel"
        assert rank["local_param_fraction"] <= 0.5 + 0.05 and rank["wrapped_layers"] >= 1
        assert rank["initial_weights"]["tensors_differing_before"] == 0  # same file, same weights
    assert res.dev_metric_after is not None  # evaluated on the gathered full model
    assert "ddp_bucket_cap_mb" not in res.overridden_args


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "single"])
def test_cosent_on_scored_pairs_with_a_model_built_from_modules(tmp_path, strategy):
    opts = dict(FAST) if strategy != "single" else dict(device="cpu", timeout=300)
    res = stnb.run(functools.partial(build_cosent, str(tmp_path)), strategy=strategy, echo=False, **opts)
    v = res.verification
    assert res.verified, res.reason
    assert v["loss_inputs"][0] == {"texts": 2, "label": True} and v["loss_received_all_columns"]
    assert res.dev_metric == "sts_spearman_cosine" and res.spearman_after is not None
    assert res.config["loss"] == "CoSENTLoss"
    assert res.overridden_args["disable_tqdm"] == {"from": False, "to": True, "why": res.overridden_args[
        "disable_tqdm"]["why"]}
    assert "ProgressCallback" in v["ranks"][0]["callbacks"]["removed"]
    if strategy == "fsdp":
        assert v["shards_add_up"] and v["ranks"][0]["local_param_fraction"] <= 0.55
    if strategy == "ddp":
        assert v["weights_identical_across_ranks"]
    if strategy == "single":
        assert res.world_size == 1 and v["ranks"][0]["wrapper"] == "SentenceTransformer"


@pytest.mark.parametrize("which,strategy", [("matryoshka", "ddp"), ("matryoshka", "fsdp"), ("triplet", "ddp")])
def test_matryoshka_and_triplet_losses(tmp_path, which, strategy):
    res = stnb.run(functools.partial(build_matryoshka_and_triplet, str(tmp_path), which), strategy=strategy,
                   echo=False, **FAST)
    assert res.verified, res.reason
    assert res.config["loss"] == ("MatryoshkaLoss" if which == "matryoshka" else "TripletLoss")
    assert res.verification["loss_received_all_columns"]
    assert res.dev_metric is None and res.dev_metric_before is None  # no evaluator given: none invented


def test_a_loss_that_keeps_the_model_under_another_name_still_trains_the_ddp_wrapper(tmp_path):
    res = stnb.run(functools.partial(build_encoder_loss, str(tmp_path)), strategy="ddp", echo=False, **FAST)
    v = res.verification
    assert res.verified, res.reason
    assert v["ranks"][0]["loss_model"]["rebound"] == ["encoder"]
    assert v["weights_identical_across_ranks"]
    assert "ddp_find_unused_parameters" not in res.overridden_args  # the user's True is kept
    assert v["ranks"][0]["ddp_settings"]["find_unused_parameters"] is True


def test_fsdp_ranks_start_from_rank0_weights(tmp_path):
    """A build that makes different random weights in each rank: FSDP would shard a chimera; stnb
    broadcasts rank 0's weights first (as DDP does) and says how many tensors differed."""
    res = stnb.run(functools.partial(build_random_dense, str(tmp_path)), strategy="fsdp", echo=False, **FAST)
    assert res.verified, res.reason
    assert res.verification["ranks"][0]["initial_weights"]["tensors_differing_before"] >= 2
    assert res.verification["ranks"][0]["initial_weights"]["broadcast"]


def build_random_dense(outdir: str):
    import torch
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses, modules

    torch.manual_seed(int(os.environ.get("RANK", "0")) + 100)  # a different init in every rank
    word = modules.Transformer(tiny_path(), max_seq_length=32)
    dim = word.get_embedding_dimension()
    model = SentenceTransformer(modules=[word, modules.Pooling(dim, "mean"), modules.Dense(dim, 16)], device="cpu")
    return SentenceTransformerTrainer(model=model, args=_args(os.path.join(outdir, "out")), train_dataset=_triplets(),
                                      loss=losses.MultipleNegativesRankingLoss(model))


# ---- refusals ---------------------------------------------------------------------------------------


def build_raises():
    raise ValueError("my data file is missing")


def build_returns_a_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(tiny_path(), device="cpu")


def build_needs_arguments(path):
    return path


def test_a_build_that_raises_names_the_function_and_leaves_nothing_running():
    with pytest.raises(stnb.LaunchError, match=r"build_raises\(\) raised ValueError: my data file is missing"):
        stnb.run(build_raises, strategy="ddp", echo=False, **FAST)
    assert not procs.children()


def test_a_build_that_returns_no_trainer_is_refused_and_the_kernel_stays_usable(tmp_path):
    with pytest.raises(stnb.LaunchError, match="returned SentenceTransformer, not a SentenceTransformerTrainer"):
        stnb.run(build_returns_a_model, strategy="single", echo=False, device="cpu", timeout=300)
    assert not procs.children()
    # the kernel is still usable: the next launch in this process works
    assert stnb.launch(os.getpid, num_processes=2, device="cpu", echo=False, timeout=120)


def test_every_config_field_is_a_field_of_its_recipe_or_of_its_run_options():
    """TrainConfig is two types: ``Recipe`` (stnb's recipe only; each field says where it belongs in a user's code)
    and ``RunOptions`` (every run). Every TrainConfig field is declared by exactly one of them, with its default;
    ``config.recipe`` / ``config.run_options`` are those parts as values; ``for_build`` takes every run option
    and refuses every recipe field with its hint; a class with a field declared by neither is refused."""
    import dataclasses
    import re

    from stnb import config as c

    names = [f.name for f in dataclasses.fields(c.TrainConfig)]
    recipe = [f.name for f in dataclasses.fields(c.Recipe)]
    run = [f.name for f in dataclasses.fields(c.RunOptions)]
    assert sorted(recipe + run) == sorted(names) and not set(recipe) & set(run)
    assert set(run) == {
        "strategy", "num_processes", "device", "start_method", "timeout", "stall_timeout", "threads_per_rank",
        "reuse_freed_memory", "save_to", "strategy_options", "resume", "override_args", "memory_budget_gib",
        "share_gpus"}
    # what stnb.run(build, ...) takes: the run options, each strategy's own options in place of strategy_options
    assert c.launch_fields() == (*[n for n in names if n in run and n != "strategy_options"],
                                 *stnb.strategies.options())
    assert all(isinstance(c.Recipe.where(n), str) and c.Recipe.where(n) for n in recipe)
    cfg = c.TrainConfig(strategy="zero1", steps=7, model="tiny", stall_timeout=9.0, columns={"a": "anchor"},
                        comm_hook="fp16")
    assert cfg.recipe == c.Recipe(steps=7, model="tiny", columns={"a": "anchor"})
    assert cfg.run_options == c.RunOptions(strategy="zero1", stall_timeout=9.0, comm_hook="fp16")
    assert cfg.run_options.comm_hook == "fp16" and cfg.run_options.strategy_options == {"comm_hook": "fp16"}
    assert {**dataclasses.asdict(cfg.recipe), **c.flat(cfg.run_options)} == cfg.to_dict()
    assert c.TrainConfig() == c.TrainConfig(**dataclasses.asdict(c.Recipe()), **dataclasses.asdict(c.RunOptions()))
    defaults = c.TrainConfig()
    assert c.TrainConfig.for_build(**dataclasses.asdict(defaults.run_options)) == defaults
    for name in recipe:
        with pytest.raises(stnb.ConfigError, match=re.escape(f"{name}: {c.Recipe.where(name)}")):
            c.TrainConfig.for_build(**{name: getattr(defaults, name)})

    @dataclasses.dataclass
    class Undeclared:
        strategy: str = c.part(c.RunOptions, "strategy")
        b: int = 2

    with pytest.raises(TypeError, match=r"fields \[.*'b'.*\] are not declared as part\(Recipe, name\)"):
        c.check_parts(Undeclared)
    c.check_parts(c.TrainConfig)  # TrainConfig itself passes (checked at import too)


def test_options_that_belong_in_the_users_code_are_refused_before_anything_starts():
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(stnb.ConfigError, match=r"steps: max_steps in your SentenceTransformerTrainingArguments"):
        stnb.run(build_raises, strategy="ddp", steps=5)
    with pytest.raises(stnb.ConfigError, match=r"loss: pass loss=\.\.\. to your trainer"):
        stnb.run(build_raises, loss="mnrl", model="tiny")
    with pytest.raises(stnb.ConfigError, match="did you mean 'num_process' -> 'num_processes'"):
        stnb.run(build_raises, num_process=2)
    with pytest.raises(stnb.ConfigError, match=r"requires path; give them defaults, or bind them with functools"):
        stnb.run(build_needs_arguments)
    with pytest.raises(stnb.ConfigError, match="more than this machine supports"):
        stnb.run(build_raises, strategy="ddp", num_processes=64, device="cpu")
    with pytest.raises(stnb.ConfigError, match="TrainConfig or a function"):
        stnb.run("tiny")
    assert set(psutil.Process().children(recursive=True)) == before


def test_fsdp_arguments_of_accelerate_are_refused_with_the_fix(tmp_path):
    def build():
        trainer = build_matryoshka_and_triplet(str(tmp_path), "triplet")
        trainer.args.fsdp = "full_shard"
        return trainer

    with pytest.raises(stnb.LaunchError, match="stnb.run\\(build, strategy='fsdp'\\)"):
        stnb.run(build, strategy="fsdp", echo=False, **FAST)
    assert not procs.children()


def test_fsdp_trains_a_users_trainer_that_checkpoints_and_writes_the_shards(tmp_path):
    """Issue 48: the trainer's own save_strategy='steps' under fsdp (refused before, as save_pretrained cannot write
    a model sharded before training): each checkpoint holds the model's shards (torch.distributed.checkpoint)."""
    def build():
        trainer = build_matryoshka_and_triplet(str(tmp_path), "triplet")
        trainer.args.save_strategy, trainer.args.save_steps = "steps", 2
        return trainer

    r = stnb.run(build, strategy="fsdp", echo=False, **FAST)
    assert r.verified, r.reason
    assert [c["step"] for c in r.checkpoints] == [2, 3]  # every 2 steps, and the last
    assert os.path.isdir(os.path.join(r.checkpoints[-1]["path"], "dcp-model"))
    assert not procs.children()


def build_cached_mnrl_with_prompts(outdir: str):
    """CachedMultipleNegativesRankingLoss gathering in-batch negatives from every rank, with prompts."""
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses

    model = SentenceTransformer(tiny_path(), device="cpu")
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, gather_across_devices=True)
    args = _args(os.path.join(outdir, "out"), prompts={"anchor": "query: ", "positive": "passage: "})
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=_triplets().remove_columns("negative"),
                                      loss=loss)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cached_mnrl_gathering_across_ranks_with_prompts(tmp_path, strategy):
    res = stnb.run(functools.partial(build_cached_mnrl_with_prompts, str(tmp_path)), strategy=strategy, echo=False,
                   **FAST)
    assert res.verified, res.reason
    assert res.config["loss"] == "CachedMultipleNegativesRankingLoss" and len(res.losses) == 3
    assert all(r["loss_model"]["ok"] for r in res.verification["ranks"])


def build_first_step_overflows(outdir: str):
    """fp16's first steps: the loss scaler finds inf gradients and skips the update. accelerate keeps no scaler on
    CPU, so torch's CPU GradScaler stands in where accelerate keeps it (the trainer's optimizer and backward use
    it), and the loss is inf at the first step, as an fp16 loss under too high a scale overflows."""
    import torch
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses

    class FirstCallInf(losses.MultipleNegativesRankingLoss):
        calls = 0

        def forward(self, features, labels):
            self.calls += 1
            loss = super().forward(features, labels)
            return loss * float("inf") if self.calls == 1 else loss

    model = SentenceTransformer(tiny_path(), device="cpu")
    trainer = SentenceTransformerTrainer(model=model, args=_args(os.path.join(outdir, "out")), train_dataset=_triplets(),
                                         loss=FirstCallInf(model))
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    return trainer


def test_a_first_step_the_loss_scaler_skipped_is_not_the_step_checked(tmp_path):
    """Issue 32 item 4.2: under fp16 the first steps can overflow and be skipped; zero1's check then found "no
    optimizer state after the first step". The step check runs at the first step that updated something."""
    res = stnb.run(functools.partial(build_first_step_overflows, str(tmp_path)), strategy="zero1", echo=False, **FAST)
    assert res.verified, res.reason
    assert [v["steps_skipped_before_step_check"] for v in res.verification["ranks"]] == [1, 1]
    assert all(v["optimizer_state_params"] > 0 for v in res.verification["ranks"])
