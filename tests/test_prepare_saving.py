"""A user's trainer made ready for stnb (``stnb.prepare``) and the checked save (``stnb.saving``), in this
process, in seconds: every refusal's words, what is overridden and said so, the loss rebound to the
wrapper, and a save that lands at ``save_to`` only when the reloaded model is the trained one. Real
sentence-transformers trainers and models (the tiny BERT); the same steps in real launches are in
test_own_training.py, test_verification.py and test_injected_faults.py.
"""

from __future__ import annotations

import functools
import json
import os
from types import SimpleNamespace

import pytest
import torch

from stnb import checks, prepare, saving
from stnb.config import TrainConfig
from stnb.errors import BuildError, ConfigError
from stnb.models import load_model, tiny_path
from trainfns import st_args, words


@pytest.fixture(scope="module", autouse=True)
def no_accelerate_state_left():
    """The trainers built here make accelerate's process-wide state; a later test that forks ranks is refused
    while it exists (stnb.processes.forksafe), so it goes with this module."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory):
    return tmp_path_factory.mktemp("prepare")


def _trainer(out, loss=None, evaluator=None, train=None, **args):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses

    model = SentenceTransformer(tiny_path(), device="cpu")
    train = train if train is not None else Dataset.from_dict({"anchor": [words(i) for i in range(12)],
                                                               "positive": [words(i + 1) for i in range(12)]})
    return SentenceTransformerTrainer(model=model, args=st_args(str(out), **args), train_dataset=train,
                                      loss=(loss or losses.MultipleNegativesRankingLoss)(model), evaluator=evaluator)


# ---- what a build function returned ----------------------------------------------------------------------

def my_build():
    return None


def test_a_build_function_is_named_by_its_module_and_name():
    assert prepare.describe(my_build) == f"{__name__}.my_build"
    assert prepare.describe(functools.partial(functools.partial(my_build), 1)) == f"{__name__}.my_build"
    assert prepare.describe(len) == "len"  # builtins: the name alone
    assert prepare.describe(SimpleNamespace.__init__) == "SimpleNamespace.__init__"

    def inner():
        pass

    inner.__module__ = "__main__"  # a notebook cell's function
    assert prepare.describe(inner) == "test_a_build_function_is_named_by_its_module_and_name.<locals>.inner"

    class Callable:
        def __call__(self):
            pass

    obj = Callable()
    assert prepare.describe(obj) == f"{__name__}.Callable"  # an instance: its class's name
    assert prepare.describe(SimpleNamespace(__name__="build_it", __module__="mine")) == "mine.build_it"
    nameless = SimpleNamespace(__module__="mine")
    assert prepare.describe(nameless) == "mine.SimpleNamespace"


def test_a_build_that_raises_or_returns_the_wrong_thing_is_refused_with_the_fix(tmp_module):
    def broken():
        raise ValueError("no data here")

    with pytest.raises(BuildError) as e:
        prepare.call_build(broken)
    assert str(e.value) == (
        f"your build function {__name__}.test_a_build_that_raises_or_returns_the_wrong_thing_is_refused_with_the_fix"
        ".<locals>.broken() raised ValueError: no data here. stnb calls it once in every rank; fix the function (try "
        "it in a cell with a smaller dataset) and run again")
    assert isinstance(e.value.__cause__, ValueError)

    trainer = _trainer(tmp_module)
    assert prepare.call_build(lambda: trainer) is trainer

    with pytest.raises(BuildError, match=r"^your build function .*<lambda>\(\) returned int; stnb trains the "):
        prepare.call_build(lambda: 3)


def test_check_trainer_names_what_was_returned_and_what_to_return(tmp_module):
    from sentence_transformers.cross_encoder import CrossEncoder
    from transformers.trainer_utils import TrainOutput

    from stnb import model_types

    def refused(obj) -> str:
        with pytest.raises(BuildError) as e:
            prepare.check_trainer(obj, "build")
        return str(e.value)

    st = model_types.of_model(load_model(tiny_path()))
    assert refused(load_model(tiny_path())) == (f"your build function build() returned SentenceTransformer, not a "
                                                f"SentenceTransformerTrainer; end it with `{st.example}`")
    out = TrainOutput(global_step=1, training_loss=0.1, metrics={})
    assert refused(out) == (
        "your build function build() returned TrainOutput (it returned the result of trainer.train(): return the "
        "trainer itself and let stnb train it); stnb trains the sentence-transformers trainers "
        f"{model_types.known_trainers()}; end it with "
        + " or ".join(f"`return {t.trainer}(...)`" for t in model_types.TYPES))
    assert refused(7).startswith("your build function build() returned int; stnb trains the")

    class NotATrainer:  # another library's trainer holding a sentence-transformers model
        model = load_model(tiny_path())

    assert refused(NotATrainer()) == (f"your build function build() returned NotATrainer, not a "
                                      f"SentenceTransformerTrainer; end it with `{st.example}`")
    assert "(it returned the result" not in refused(7)

    trainer = _trainer(tmp_module)
    prepare.check_trainer(trainer)
    trainer.model_init = lambda: None
    assert refused(trainer) == ("build() returned a trainer with model_init: the trainer would build a new model in "
                                "train(), after stnb applied the strategy to this one; pass model=... instead")
    trainer.model_init = None
    own = trainer.model
    trainer.model = CrossEncoder(tiny_path(), num_labels=1, device="cpu")
    try:
        assert refused(trainer) == ("build() returned a SentenceTransformerTrainer whose model is a CrossEncoder; a "
                                    "SentenceTransformerTrainer trains a SentenceTransformer")
    finally:
        trainer.model = own


def test_training_facts_are_what_the_users_trainer_trains_with(tmp_module):
    from datasets import Dataset, IterableDataset
    from sentence_transformers.sentence_transformer import evaluation, losses

    dev = evaluation.EmbeddingSimilarityEvaluator(["a b", "c d"], ["b c", "d e"], [0.5, 0.1], name="sts",
                                                  show_progress_bar=False)
    t = _trainer(tmp_module, evaluator=dev, max_steps=5, learning_rate=2e-4, gradient_accumulation_steps=2, seed=11,
                 per_device_train_batch_size=3)
    facts = prepare.training_facts(t)
    assert facts == {"model": t.model[0].auto_model.name_or_path, "loss": "MultipleNegativesRankingLoss",
                     "per_device_batch_size": 3, "steps": 5, "learning_rate": 2e-4, "gradient_accumulation_steps": 2,
                     "seed": 11, "mixed_precision": "no", "max_seq_length": t.model.max_seq_length,
                     "evaluator": f"{type(dev).__module__}.EmbeddingSimilarityEvaluator", "train_size": 12}
    t.model.model_card_data.base_model = "my/base-model"
    t.loss = {"a": losses.CoSENTLoss(t.model), "b": losses.MultipleNegativesRankingLoss(t.model),
              "c": losses.CoSENTLoss(t.model)}
    t.train_dataset = {"a": Dataset.from_dict({"x": [1, 2]}), "b": Dataset.from_dict({"x": [1, 2, 3]})}
    t.evaluator = None
    facts = prepare.training_facts(t)
    assert facts["model"] == "my/base-model" and facts["loss"] == "CoSENTLoss, MultipleNegativesRankingLoss"
    assert facts["evaluator"] is None and facts["train_size"] == 5

    def rows():
        yield {"x": 1}

    t.train_dataset = {"a": Dataset.from_dict({"x": [1]}), "b": IterableDataset.from_generator(rows)}
    assert prepare.training_facts(t)["train_size"] is None  # a dataset without a length: not counted
    t.train_dataset = IterableDataset.from_generator(rows)
    assert prepare.training_facts(t)["train_size"] is None
    # no base model named and no folder it was loaded from: the model's class
    t.model.model_card_data.base_model = None
    t.model[0].auto_model.name_or_path = ""
    assert prepare.training_facts(t)["model"] == "SentenceTransformer"
    first = t.model._modules["0"]
    t.model._modules["0"] = torch.nn.Identity()  # a first module that is not a transformer
    try:
        assert prepare.training_facts(t)["model"] == "SentenceTransformer"
    finally:
        t.model._modules["0"] = first


# ---- refused, overridden ------------------------------------------------------------------------------

def test_arguments_no_strategy_honours_are_refused_with_the_fix(tmp_path):
    def refused(strategy="ddp", use_cuda=False, **set_args) -> str:
        args = st_args(str(tmp_path))
        for k, v in set_args.items():
            setattr(args, k, v)
        m = torch.nn.Linear(2, 2)
        trainer = SimpleNamespace(args=args, model=m, model_wrapped=m, loss=torch.nn.MSELoss(), optimizer=None,
                                  is_deepspeed_enabled=True)
        with pytest.raises(BuildError) as e:
            prepare.refusals(trainer, TrainConfig(strategy=strategy), use_cuda)
        return str(e.value)

    fsdp = ("fsdp='full_shard' asks accelerate to shard the model, and on CPU accelerate silently runs DDP instead; "
            "stnb shards it itself (FSDP2): remove fsdp/fsdp_config from your arguments and call "
            "stnb.run(build, strategy='fsdp')")
    ds = ("deepspeed=... in your arguments asks the trainer for DeepSpeed; with stnb choose strategy='deepspeed' "
          "(stage=1, 2 or 3) and remove deepspeed=... from your arguments, or remove it and choose another strategy")
    cpu = ("use_cpu=True in your arguments, but this run is on CUDA; remove use_cpu, or run on CPU with "
           "stnb.run(build, device='cpu')")
    assert refused(fsdp="full_shard") == f"cannot train this trainer under strategy 'ddp': {fsdp}"
    assert refused(deepspeed={"zero_optimization": {"stage": 2}}) == f"cannot train this trainer under strategy 'ddp': {ds}"
    assert refused(use_cuda=True, use_cpu=True) == f"cannot train this trainer under strategy 'ddp': {cpu}"
    assert refused(strategy="ddp", fsdp="full_shard", use_cuda=True, use_cpu=True, ddp_static_graph=True,
                   gradient_accumulation_steps=2) == (
        f"cannot train this trainer under strategy 'ddp': {fsdp}; {cpu}; DDP's static_graph cannot be combined with "
        "gradient_accumulation_steps > 1 (pytorch/pytorch#143580); drop static_graph or the accumulation")
    fine = st_args(str(tmp_path), use_cpu=True)
    prepare.refusals(SimpleNamespace(args=fine), TrainConfig(strategy="ddp"), False)  # use_cpu on a CPU run: fine
    # deepspeed=... is the deepspeed strategy's own to check (against the run's stage)
    fine.deepspeed, fine.use_cpu = {"zero_optimization": {"stage": 3}}, False
    assert "zero_optimization.stage=3 in the DeepSpeed config, but stage=2 was asked" in refused(
        strategy="deepspeed", deepspeed={"zero_optimization": {"stage": 3}})
    assert ds not in refused(strategy="deepspeed", deepspeed={"zero_optimization": {"stage": 3}})


def test_the_batch_override_replaces_the_argument_and_says_so(tmp_module):
    t = _trainer(tmp_module, per_device_train_batch_size=4)
    assert prepare.apply_overrides(t, TrainConfig()) == {}
    assert prepare.apply_overrides(t, TrainConfig(override_args={"per_device_train_batch_size": 4})) == {}
    assert t._train_batch_size == 4
    over = prepare.apply_overrides(t, TrainConfig(override_args={"per_device_train_batch_size": (6, "set in the Panel")}))
    assert over == {"per_device_train_batch_size": {"from": 4, "to": 6, "why": "set in the Panel"}}
    assert t.args.per_device_train_batch_size == 6 and t._train_batch_size == 6  # what train() reads


def test_stnb_takes_over_the_progress_display_and_says_so(tmp_module):
    t = _trainer(tmp_module, disable_tqdm=False)
    kept_before = [type(c).__name__ for c in t.callback_handler.callbacks]
    assert "ProgressCallback" in kept_before
    overridden, callbacks = prepare.own_display(t)
    assert overridden == {"disable_tqdm": {"from": False, "to": True,
                                           "why": "stnb shows every rank's progress in the notebook; a tqdm bar inside "
                                                  "each rank would only fill the rank logs"}}
    assert t.args.disable_tqdm is True and callbacks["removed"] == ["ProgressCallback"]
    assert callbacks["kept"] == [n for n in kept_before if n != "ProgressCallback"] and callbacks["kept"]
    t.add_callback(__import__("transformers").trainer_callback.PrinterCallback)
    assert prepare.own_display(t) == ({}, {"kept": callbacks["kept"], "removed": ["PrinterCallback"]})


def test_every_reference_the_loss_holds_to_the_model_is_rebound_to_the_wrapper(tmp_path):
    import torch.distributed as dist
    from sentence_transformers.sentence_transformer import losses

    class TwoRefs(torch.nn.Module):  # a user's loss keeping the model under another name too
        def __init__(self, model):
            super().__init__()
            self.model, self.encoder = model, model
            self.inner = torch.nn.ModuleDict({"m": model})
            self.shared = self.inner  # one holder under two names: both paths are named

    t = _trainer(tmp_path, loss=TwoRefs)
    assert prepare.rebind_loss_model(t) == []  # not wrapped: nothing to rebind
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        t.model_wrapped = torch.nn.parallel.DistributedDataParallel(t.model)
        changed = prepare.rebind_loss_model(t)
        # listed once per module holding it (encoder, the same child as model on the same owner, is rebound too)
        assert sorted(changed) == ["inner.m", "model", "shared.m"]
        assert t.loss.model is t.loss.encoder is t.loss.inner["m"] is t.model_wrapped
        assert prepare.rebind_loss_model(t) == []  # already the wrapper
        t.loss = {"c": "not a module", "a": losses.MultipleNegativesRankingLoss(t.model), "b": TwoRefs(t.model)}
        assert sorted(prepare.rebind_loss_model(t)) == ["inner.m", "model", "model", "shared.m"]
        assert t.loss["a"].model is t.model_wrapped and t.loss["b"].inner["m"] is t.model_wrapped
    finally:
        dist.destroy_process_group()


# ---- saving ----------------------------------------------------------------------------------------------

def test_save_to_that_holds_something_is_refused_before_any_process(tmp_path, monkeypatch):
    saving.check_target(None)
    saving.check_target("")
    saving.check_target(str(tmp_path / "new"))
    (tmp_path / "empty").mkdir()
    saving.check_target(str(tmp_path / "empty"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_text("x")
    (tmp_path / "file").write_text("x")
    for name in ("full", "file"):
        with pytest.raises(ConfigError) as e:
            saving.check_target(str(tmp_path / name))
        assert str(e.value) == (f"save_to={str(tmp_path / name)!r} already exists and is not empty; stnb never "
                                "overwrites a saved model. Choose a new folder or remove the old one.")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="save_to='~/full' already exists"):
        saving.check_target("~/full")
    saving.check_target("~/empty")


def _trained():
    initial_model = load_model(tiny_path())
    initial = checks.state_of(initial_model)
    model = load_model(tiny_path())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    return model, checks.state_of(model), initial


def test_the_model_is_written_to_a_hidden_sibling_and_moved_into_an_empty_target(tmp_path, monkeypatch):
    model, trained, initial = _trained()
    written = []
    real_save = model.save

    def save(path, *a, **kw):
        written.append(path)
        return real_save(path, *a, **kw)

    model.save = save
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models" / "empty").mkdir(parents=True)  # an empty folder made for it is taken
    out = saving.save_checked(model, "~/models/empty", "cpu", trained, initial)
    target = str(tmp_path / "models" / "empty")
    assert out["ok"] is True and out["saved_to"] == target and out["problems"] == []
    assert out["encodes_the_same"] is True and out["tensors"] == len(trained)
    assert os.path.dirname(written[0]) == str(tmp_path / "models")
    assert os.path.basename(written[0]).startswith(".stnb-save-")
    assert os.path.isfile(os.path.join(target, "config_sentence_transformers.json"))
    assert sorted(os.listdir(tmp_path / "models")) == ["empty"]
    # a parent that does not exist yet is made
    assert saving.save_checked(model, str(tmp_path / "a" / "b"), "cpu", trained, initial)["saved_to"] == str(
        tmp_path / "a" / "b")


def test_a_reload_that_encodes_otherwise_is_not_saved(tmp_path):
    model, trained, initial = _trained()
    real_save = model.save

    def save_with_cls_pooling(path, *a, **kw):  # the same weights; the pooling written differs
        real_save(path, *a, **kw)
        pooling = next(os.path.join(path, d, "config.json") for d in sorted(os.listdir(path)) if d.endswith("Pooling"))
        with open(pooling) as f:
            cfg = json.load(f)
        cfg["pooling_mode"] = "cls"
        with open(pooling, "w") as f:
            json.dump(cfg, f)

    model.save = save_with_cls_pooling
    out = saving.save_checked(model, str(tmp_path / "saved"), "cpu", trained, initial)
    assert out["equals_trained"] is True and out["encodes_the_same"] is False and out["ok"] is False
    assert out["problems"] == ["the reloaded model does not reproduce the saved model's embeddings"]
    assert out["saved_to"] is None and not (tmp_path / "saved").exists()
    assert os.listdir(tmp_path) == []  # the temporary folder is gone too
