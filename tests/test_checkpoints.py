"""Checkpoints and resuming (``stnb.checkpoints``, ``stnb.instruments.checkpoints``): a run stopped by a rank killed
mid-step after a checkpoint, resumed with ``resume='latest'``, ends with the weights and the per-step losses of
the same run that never stopped (bit for bit: on CPU the run is deterministic); a rank killed while a checkpoint
is written leaves the previous one as the latest; ``keep`` rotates only complete ones; only the ranks that should
write, write; bad ``resume=`` input is refused before any rank starts.

The faults are made by patching transformers' Trainer in this process, which the forked ranks inherit (as
tests/test_injected_faults.py does), never by editing stnb.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

import stnb
from stnb import checkpoints
from stnb.checkpoints import CheckpointError
from stnb.errors import ConfigError
from stnb.strategies import layouts

RUN = dict(num_processes=2, model="tiny", per_device_batch_size=4, steps=6, train_size=64, evaluate=False,
           threads_per_rank=1, timeout=300, warmup_steps_excluded=1, checkpoint_every=2)
STRATEGIES = ["single", "ddp", "zero1", "zero2", "fsdp", "deepspeed"]
# (strategy, its options): each strategy at its default, and DeepSpeed's other ZeRO stages (its default is 2)
LAYOUTS_OF_EACH = ([pytest.param(s, {}, id=s) for s in STRATEGIES]
                   + [pytest.param("deepspeed", {"stage": n}, id=f"deepspeed-stage{n}") for n in (1, 3)])


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _config(strategy, folder, **kw):
    ranks = {"num_processes": None} if strategy == "single" else {}
    return stnb.TrainConfig(**{**RUN, **ranks, "strategy": strategy, "checkpoint_dir": str(folder), **kw})


def _weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _kill(monkeypatch, method: str, when, rank: int):
    """Rank ``rank`` kills itself (SIGKILL: no clean-up, as the OOM killer does) inside Trainer.``method`` when
    ``when(trainer)`` holds."""
    from transformers import Trainer

    real = getattr(Trainer, method)

    def dying(self, *a, **kw):
        if _rank() == rank and when(self):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *a, **kw)

    monkeypatch.setattr(Trainer, method, dying)


def _stopped_then_resumed(monkeypatch, tmp_path, strategy, broken=None, **options):
    """(the uninterrupted run, the resumed run, their saved models' folders): the second run is killed in its
    4th step (after checkpoint-2), then resumed from 'latest'; ``broken``: a fault patched in for the resume;
    ``options``: the strategy's own (TrainConfig's stage=...)."""
    never = stnb.run(_config(strategy, tmp_path / "never", save_to=str(tmp_path / "never-model"), **options),
                     echo=False)
    with monkeypatch.context() as m:
        _kill(m, "training_step", lambda t: t.state.global_step == 3, rank=1 if strategy != "single" else 0)
        with pytest.raises(stnb.LaunchError) as stopped:
            stnb.run(_config(strategy, tmp_path / "stopped", **options), echo=False)
    assert stopped.value.kind == "killed", str(stopped.value)
    assert [s for s, _ in checkpoints.complete(tmp_path / "stopped")] == [2]
    with monkeypatch.context() as m:
        if broken:
            broken(m)
        resumed = stnb.run(_config(strategy, tmp_path / "stopped", resume="latest",
                                   save_to=str(tmp_path / "resumed-model"), **options), echo=False)
    return never, resumed, tmp_path / "never-model", tmp_path / "resumed-model"


@pytest.mark.slow
@pytest.mark.parametrize("strategy,options", LAYOUTS_OF_EACH)
def test_a_run_killed_mid_step_resumes_to_the_weights_and_losses_of_the_run_that_never_stopped(
        monkeypatch, tmp_path, strategy, options):
    never, resumed, a, b = _stopped_then_resumed(monkeypatch, tmp_path, strategy, **options)
    assert never.verified and resumed.verified, (never.reason, resumed.reason)
    assert resumed.resumed_from["step"] == 2 and resumed.resumed_from["started_at_step"] == 2
    assert resumed.resumed_from["written_strategy"] == strategy
    assert len(resumed.losses) == 4
    assert resumed.losses == never.losses[2:]  # every step after the checkpoint, exactly
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    differing = [k for k in wa if not (wa[k] == wb[k]).all()]
    assert not differing, f"{len(differing)} tensor(s) differ, e.g. {differing[:3]}"
    assert [c["step"] for c in resumed.checkpoints] == [4, 6]  # it went on checkpointing
    from sentence_transformers import SentenceTransformer

    last = checkpoints.to_model(tmp_path / "stopped").state_dict()  # checkpoint-6, an ordinary model on one device
    trained = SentenceTransformer(str(b), device="cpu").state_dict()
    assert last.keys() == trained.keys() and all((last[k] == trained[k]).all() for k in trained)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["build-fsdp", "recipe-ddp"])
def test_a_run_whose_rank_0_is_killed_leaves_nothing_in_the_temporary_folder(what, monkeypatch, tmp_path):
    """Rank 0's scratch folders: a user's model as built, saved under a sharding strategy to make the trained one
    whole from its shards at the end (8 MB for the tiny BERT, the model's size for a real one; stnb's recipe has
    its own saved copy), and the recipe's trainer folder when it keeps no checkpoints. A killed rank runs no
    clean-up (SIGKILL, as the out-of-memory killer sends): they were left in /tmp. They live in the launch's
    own folder, which the launcher removes however the ranks end."""
    import functools
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # the forked ranks' temporary folder too
    _kill(monkeypatch, "training_step", lambda t: t.state.global_step == 3, rank=0)
    with pytest.raises(stnb.LaunchError) as stopped:
        if what == "build-fsdp":
            stnb.run(functools.partial(build_with_dropout, str(tmp_path / "stopped")), strategy="fsdp",
                     num_processes=2, device="cpu", threads_per_rank=1, timeout=300, echo=False)
        else:
            stnb.run(stnb.TrainConfig(**{**RUN, "checkpoint_every": 0, "strategy": "ddp"}), echo=False)
    assert stopped.value.kind == "killed", str(stopped.value)
    # torch's compiler cache (torchinductor_<user>) is shared by every run and kept, as torch means it to be
    assert sorted(p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")) == []


def _tiny_with_dropout():
    """The tiny BERT with dropout 0.1: its training steps draw from the RNG, so a resume must restore every rank's."""
    from sentence_transformers import SentenceTransformer

    from stnb.models import tiny_path

    model = SentenceTransformer(tiny_path(), device="cpu")
    for module in model.modules():
        if type(module).__name__ == "Dropout":
            module.p = 0.1
    return model


def build_with_dropout(out: str, keep=None, best=False):
    """A user's trainer that checkpoints the way Hugging Face users do (save_strategy='steps', save_steps=2), on a
    tiny BERT with dropout 0.1: the training steps draw from the RNG, so a resume must restore every rank's."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import evaluation, losses

    from trainfns import st_args, words

    model = _tiny_with_dropout()
    n = 64
    train = Dataset.from_dict({"sentence1": [words(i) for i in range(n)], "sentence2": [words(i + 1) for i in range(n)],
                               "score": [float(i % 3) / 2 for i in range(n)]})
    dev = evaluation.EmbeddingSimilarityEvaluator([words(i) for i in range(8)], [words(i + 3) for i in range(8)],
                                                  [0.9, 0.1] * 4, name="dev", show_progress_bar=False)
    extra = dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                 metric_for_best_model="dev_spearman_cosine") if best else {}
    return SentenceTransformerTrainer(
        model=model,
        args=st_args(out, max_steps=6, save_strategy="steps", save_steps=2, save_total_limit=keep, **extra),
        train_dataset=train, loss=losses.CosineSimilarityLoss(model), evaluator=dev if best else None)


def _user_run(folder, best=False, keep=None, **kw):
    import functools

    return stnb.run(functools.partial(build_with_dropout, str(folder), keep, best), strategy="ddp", num_processes=2,
                    device="cpu", threads_per_rank=1, timeout=300, **kw)


def build_in_a_folder_per_rank(parent: str):
    """A user's checkpointing trainer whose output_dir is ``tempfile.mkdtemp()`` made inside the build function, as
    examples often write it: a new folder in every rank."""
    import tempfile

    return build_with_dropout(tempfile.mkdtemp(prefix="rank-", dir=parent))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_whose_output_dirs_differ_are_refused_before_training(tmp_path, strategy):
    """Each rank writes its part of a checkpoint into its own output_dir: under fsdp, rank 0's checkpoint-N looked
    whole (the run verified, every save listed) while rank 1's shards and RNG state stayed in its own .stnb-partial,
    so no checkpoint could be resumed; under ddp 'latest' is looked up in a different folder on each rank. Refused
    on every rank before the first step, naming each rank's folder; nothing written."""
    import functools
    from pathlib import Path

    with pytest.raises(stnb.LaunchError) as e:
        stnb.run(functools.partial(build_in_a_folder_per_rank, str(tmp_path)), strategy=strategy, num_processes=2,
                 device="cpu", threads_per_rank=1, timeout=300, echo=False)
    message, folders = str(e.value).splitlines()[0], sorted(str(p) for p in tmp_path.iterdir())
    assert len(folders) == 2 and "raised BuildError: your trainer's output_dir is a different folder on each rank" \
        in message and "one path every rank shares" in message, message
    assert sorted(re.findall(r"rank [01]: (\S+?)[,)]", message)) == folders, message
    assert [p for f in folders for p in Path(f).rglob("*")] == []  # refused before the first step: nothing written


def _user_stopped_then_resumed(monkeypatch, tmp_path, broken=None):
    never = _user_run(tmp_path / "never", save_to=str(tmp_path / "never-model"))
    with monkeypatch.context() as m:
        _kill(m, "training_step", lambda t: t.state.global_step == 3, rank=1)
        with pytest.raises(stnb.LaunchError):
            _user_run(tmp_path / "stopped")
    with monkeypatch.context() as m:
        if broken:
            broken(m)
        resumed = _user_run(tmp_path / "stopped", resume="latest", save_to=str(tmp_path / "resumed-model"))
    return never, resumed, _weights(tmp_path / "never-model"), _weights(tmp_path / "resumed-model")


@pytest.mark.slow
def test_a_users_trainer_with_dropout_resumes_to_the_run_that_never_stopped(monkeypatch, tmp_path):
    never, resumed, wa, wb = _user_stopped_then_resumed(monkeypatch, tmp_path)
    assert never.verified and resumed.verified, (never.reason, resumed.reason)
    assert resumed.resumed_from["step"] == 2 and resumed.losses == never.losses[2:]
    assert not [k for k in wa if not (wa[k] == wb[k]).all()]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["rng", "optimizer"])
def test_a_resume_that_drops_state_is_caught_by_the_same_comparison(monkeypatch, tmp_path, fault):
    """The comparison above fails when the resume loses the RNG states (dropout draws other masks) or the
    optimizer's moments (AdamW restarts): the equality is not true by construction."""
    from transformers import Trainer

    method = {"rng": "_load_rng_state", "optimizer": "_load_optimizer_and_scheduler"}[fault]
    never, resumed, wa, wb = _user_stopped_then_resumed(
        monkeypatch, tmp_path, broken=lambda m: m.setattr(Trainer, method, lambda self, *a, **kw: None))
    assert any(not (wa[k] == wb[k]).all() for k in wa), f"dropping the {fault} state changed nothing"
    assert resumed.losses != never.losses[2:]


def build_with_a_loss_that_owns_parameters(out: str):
    """A user's trainer whose loss has trainable parameters of its own (SoftmaxLoss's classifier, in the optimizer
    beside the model's), checkpointing every 2 steps, on the tiny BERT with dropout 0.1."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses

    from trainfns import st_args, words

    model = _tiny_with_dropout()
    n = 64
    train = Dataset.from_dict({"premise": [words(i) for i in range(n)], "hypothesis": [words(i + 1) for i in range(n)],
                               "label": [i % 3 for i in range(n)]})
    loss = losses.SoftmaxLoss(model, model.get_sentence_embedding_dimension(), num_labels=3)
    return SentenceTransformerTrainer(model=model, args=st_args(out, max_steps=6, save_strategy="steps", save_steps=2),
                                      train_dataset=train, loss=loss)


def _loss_run(strategy, folder, **kw):
    import functools

    return stnb.run(functools.partial(build_with_a_loss_that_owns_parameters, str(folder)), strategy=strategy,
                    num_processes=2, device="cpu", threads_per_rank=1, timeout=300, echo=False, **kw)


def _loss_parameters(checkpoint) -> dict:
    import torch

    from stnb.strategies.loss_sync import LOSS_PARAMETERS

    return torch.load(os.path.join(checkpoint, LOSS_PARAMETERS), weights_only=True)


def _loss_stopped_then_resumed(monkeypatch, tmp_path, strategy, broken=None, killed=True):
    """(the uninterrupted run, the resumed run, the final model weights and loss parameters of each): the second
    run killed in its 4th step (``killed``; else resumed from the first run's checkpoint-2), resumed from 'latest'."""
    never = _loss_run(strategy, tmp_path / "never", save_to=str(tmp_path / "never-model"))
    folder, resume = tmp_path / "never", str(tmp_path / "never" / "checkpoint-2")
    if killed:
        folder = resume = tmp_path / "stopped"
        with monkeypatch.context() as m:
            _kill(m, "training_step", lambda t: t.state.global_step == 3, rank=1)
            with pytest.raises(stnb.LaunchError) as stopped:
                _loss_run(strategy, folder)
        assert stopped.value.kind == "killed", str(stopped.value)
        assert [s for s, _ in checkpoints.complete(folder)] == [2]
        resume = "latest"
    with monkeypatch.context() as m:
        if broken:
            broken(m)
        resumed = _loss_run(strategy, folder if killed else tmp_path / "again", resume=resume,
                            save_to=str(tmp_path / "resumed-model"))
    end = tmp_path / ("stopped" if killed else "again")  # (not killed: a build writing to another folder)
    return (never, resumed, _weights(tmp_path / "never-model"), _weights(tmp_path / "resumed-model"),
            _loss_parameters(tmp_path / "never" / "checkpoint-6"), _loss_parameters(end / "checkpoint-6"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_a_loss_with_its_own_parameters_resumes_to_the_run_that_never_stopped(monkeypatch, tmp_path, strategy):
    """SoftmaxLoss's classifier (the loss's own parameters, replicated and kept in sync on every rank, their
    optimizer state beside the model's: under zero2 / fsdp in the sharded optimizer checkpoint, by their names)
    checkpointed and restored: killed mid-step after checkpoint-2 and resumed, the run ends with the model's and
    the loss's parameters bit-identical to the run that never stopped, and every step's loss equal."""
    never, resumed, wa, wb, la, lb = _loss_stopped_then_resumed(monkeypatch, tmp_path, strategy)
    assert never.verified and resumed.verified, (never.reason, resumed.reason)
    assert never.verification["ranks"][0]["trained_parameters"]["loss"] == ["loss.classifier.weight",
                                                                            "loss.classifier.bias"]
    assert resumed.resumed_from["step"] == resumed.resumed_from["started_at_step"] == 2
    assert resumed.losses == never.losses[2:]
    assert not [k for k in wa if not (wa[k] == wb[k]).all()]
    assert la.keys() == lb.keys() == {"loss.classifier.weight", "loss.classifier.bias"}
    assert all((la[k] == lb[k]).all() for k in la)


def _forget_the_loss_optimizer_state(m):
    """The loss's parameters restored, their optimizer state (AdamW's moments) dropped after loading."""
    from stnb.strategies import loss_sync
    from stnb.strategies.layouts import torch_optimizer

    real = loss_sync.load_loss_parameters

    def load_then_forget(trainer, folder):
        real(trainer, folder)
        for _, p in loss_sync.loss_owned_parameters(trainer):
            torch_optimizer(trainer).state.pop(p, None)

    m.setattr(loss_sync, "load_loss_parameters", load_then_forget)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
@pytest.mark.parametrize("fault", ["parameters", "optimizer"])
def test_a_resume_that_drops_the_loss_state_is_caught_by_the_same_comparison(monkeypatch, tmp_path, strategy, fault):
    """Not true by construction: resumed without the loss's own parameters (they restart from their initial
    values) or without their optimizer state (AdamW restarts their moments), the run ends elsewhere."""
    from stnb.strategies import loss_sync

    broken = {"parameters": lambda m: m.setattr(loss_sync, "load_loss_parameters", lambda *a: None),
              "optimizer": _forget_the_loss_optimizer_state}[fault]
    never, resumed, wa, wb, la, lb = _loss_stopped_then_resumed(monkeypatch, tmp_path, strategy, broken, killed=False)
    assert any(not (la[k] == lb[k]).all() for k in la), f"dropping the loss's {fault} changed nothing"
    assert resumed.losses != never.losses[2:]


@pytest.mark.slow
def test_the_best_checkpoint_is_loaded_at_the_end_and_kept_by_the_rotation(tmp_path):
    """load_best_model_at_end with save_total_limit=1 under ddp: the trainer's own best-model selection, the
    best checkpoint kept by stnb's rotation, and the model trained to the end replaced by the best one."""
    r = _user_run(tmp_path, best=True, keep=1, save_to=str(tmp_path / "model"))
    assert r.verified, r.reason
    with open(tmp_path / "checkpoint-6" / checkpoints.TRAINER_STATE) as f:
        state = json.load(f)
    best = state["best_model_checkpoint"]
    assert best == str(tmp_path / f"checkpoint-{state['best_global_step']}")  # the final path, not the staging one
    kept = [s for s, _ in checkpoints.complete(tmp_path)]
    assert state["best_global_step"] in kept and 6 in kept
    wbest, wsaved = _weights(best), _weights(tmp_path / "model")
    assert all((wbest[k] == wsaved[k]).all() for k in wbest)  # the saved model is the best checkpoint's


@pytest.mark.slow
def test_the_stop_button_keeps_the_last_checkpoint_and_spawned_ranks_continue_from_it(monkeypatch, tmp_path):
    """The notebook's Stop button is a SIGINT to the kernel's process: KeyboardInterrupt in the cell while forked
    ranks train. Every rank is stopped, the checkpoints completed before stay complete, and resume='latest' in
    spawned ranks continues to the losses and weights of the run that never stopped."""
    import threading
    import time

    from transformers import Trainer

    steps = dict(steps=12)
    never = stnb.run(_config("ddp", tmp_path / "never", **steps, save_to=str(tmp_path / "never-model")), echo=False)
    folder = tmp_path / "stopped"
    real = Trainer.training_step

    def slow_after_the_first_checkpoint(self, *a, **kw):  # time for the button to be pressed mid-run
        if self.state.global_step >= 2:
            time.sleep(0.3)
        return real(self, *a, **kw)

    monkeypatch.setattr(Trainer, "training_step", slow_after_the_first_checkpoint)

    def press_stop():
        end = time.time() + 240
        while not checkpoints.complete(folder) and time.time() < end:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # what Jupyter's Stop does to the kernel

    presser = threading.Thread(target=press_stop, daemon=True)
    presser.start()
    with pytest.raises(KeyboardInterrupt):
        stnb.run(_config("ddp", folder, **steps), echo=False)
    presser.join(timeout=5)
    kept = [s for s, _ in checkpoints.complete(folder)]
    assert kept and kept[-1] < 12, kept  # (one being written when the button was pressed stays half-written)
    monkeypatch.undo()
    resumed = stnb.run(_config("ddp", folder, **steps, resume="latest", start_method="spawn",
                               save_to=str(tmp_path / "resumed-model")), echo=False)
    assert resumed.verified, resumed.reason
    step = resumed.resumed_from["step"]
    assert step == kept[-1] and resumed.resumed_from["started_at_step"] == step
    assert resumed.losses == never.losses[step:]
    wa, wb = _weights(tmp_path / "never-model"), _weights(tmp_path / "resumed-model")
    assert all((wa[k] == wb[k]).all() for k in wa)


@pytest.mark.slow
def test_a_progress_callback_that_raises_keyboardinterrupt_stops_the_run_as_the_stop_button_does(tmp_path):
    """A display's own Stop (``on_progress`` raising KeyboardInterrupt, in the watchdog's thread) stops the cell
    with KeyboardInterrupt and every rank with it, not only the watchdog: the run does not train on to its last
    step unwatched, and the checkpoint completed before it stays complete."""
    import psutil

    folder, calls = tmp_path / "stopped", []

    def stop_once_a_checkpoint_is_complete(states):
        calls.append(len(states))
        if checkpoints.complete(folder):
            raise KeyboardInterrupt

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(KeyboardInterrupt):
        stnb.run(_config("ddp", folder, steps=200, train_size=2000), on_progress=stop_once_a_checkpoint_is_complete,
                 echo=False)
    kept = [s for s, _ in checkpoints.complete(folder)]
    assert calls and kept and kept[-1] < 200, kept  # stopped long before the last step
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, left


@pytest.mark.slow
def test_a_rank_killed_while_writing_a_checkpoint_leaves_the_previous_one_latest(monkeypatch, tmp_path):
    """Rank 1 dies writing its RNG state into checkpoint-4: rank 0 had written the model and the optimizer, yet
    checkpoint-4 never becomes a checkpoint; 'latest' is still checkpoint-2 (and keep=1 did not delete it).
    Rank 1 dies only once checkpoint-4 is in place or after 5 s: were it put in place before every rank
    finished writing, it would be there by then."""
    import time

    def finished_by_rank_0(trainer):
        if trainer.state.global_step != 4:
            return False
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not os.path.exists(tmp_path / "checkpoint-4"):
            time.sleep(0.05)
        return True

    _kill(monkeypatch, "_save_rng_state", finished_by_rank_0, rank=1)
    with pytest.raises(stnb.LaunchError) as stopped:
        stnb.run(_config("ddp", tmp_path, keep=1), echo=False)
    assert stopped.value.kind == "killed", str(stopped.value)
    assert [s for s, _ in checkpoints.complete(tmp_path)] == [2]
    assert checkpoints.find("latest", tmp_path).endswith("checkpoint-2")
    assert [os.path.basename(p) for p in checkpoints.partial(tmp_path)] == ["checkpoint-4"]


@pytest.mark.slow
def test_keep_rotates_only_complete_checkpoints_and_only_rank_0_writes_the_model(tmp_path):
    r = stnb.run(_config("ddp", tmp_path, keep=2), echo=False)
    assert r.verified, r.reason
    assert [s for s, _ in checkpoints.complete(tmp_path)] == [4, 6]
    assert checkpoints.partial(tmp_path) == []
    model_bytes = os.path.getsize(tmp_path / "checkpoint-6" / "model.safetensors")
    for c in r.checkpoints:
        rank0, rank1 = c["bytes_written"]
        assert rank0 > model_bytes  # the model, the optimizer, its RNG, the trainer state
        assert rank1 < model_bytes / 10, c  # its RNG state only: sentence-transformers' _save would write the model
        assert c["seconds"] > 0
    written = checkpoints.manifest(tmp_path / "checkpoint-6")
    assert written["step"] == 6 and written["world_size"] == 2 and written["strategy"] == "ddp"
    # checkpoint time is outside the steps, as evaluation is: timed apart by OutsideSteps
    assert r.outside_steps[0]["work"]["save"]["calls"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_a_sharded_checkpoint_is_written_in_parts_and_opens_on_one_device(tmp_path, strategy):
    """Each of 2 ranks writes about half of the state (torch.distributed.checkpoint: its own shards); the last
    checkpoint, opened in this process (no process group: DCP reshards 2 -> 1), holds the trained model."""
    r = stnb.run(_config(strategy, tmp_path, save_to=str(tmp_path / "model")), echo=False)
    assert r.verified, r.reason
    for c in r.checkpoints:
        rank0, rank1 = c["bytes_written"]
        assert max(rank0, rank1) < 0.7 * (rank0 + rank1), c  # neither rank writes the whole state
    from sentence_transformers import SentenceTransformer

    opened = checkpoints.to_model(tmp_path).state_dict()  # the run folder: its newest, checkpoint-6
    trained = SentenceTransformer(str(tmp_path / "model"), device="cpu").state_dict()
    assert opened.keys() == trained.keys()
    assert all((opened[k] == trained[k]).all() for k in trained)


@pytest.mark.slow
def test_a_deepspeed_stage3_checkpoint_is_written_in_parts_and_is_a_saved_model(tmp_path):
    """ZeRO-3 partitions the parameters too: each of 2 ranks writes its own partitions of the engine's state
    (parameters, fp32 master copy, AdamW's moments: about half each, measured as the bytes each rank wrote), rank 0
    the model's files beside them, from the parameters gathered for it; the checkpoint opens as an ordinary
    SentenceTransformer holding the trained weights."""
    from sentence_transformers import SentenceTransformer

    r = stnb.run(_config("deepspeed", tmp_path, stage=3, save_to=str(tmp_path / "model")), echo=False)
    assert r.verified, r.reason
    assert checkpoints.manifest(tmp_path / "checkpoint-6")["zero_stage"] == 3
    for c in r.checkpoints:
        folder = tmp_path / f"checkpoint-{c['step']}"
        if not folder.is_dir():
            continue
        engine = [sum(f.stat().st_size for f in folder.glob(f"global_step*/*zero_pp_rank_{rank}_*")) for rank in (0, 1)]
        model = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        rank0, rank1 = c["bytes_written"]
        assert min(engine) > 0.45 * sum(engine), engine  # each rank's partitions: about half of the engine's state
        # what each rank wrote: its own partitions (rank 0: and the model's files), not the other rank's; beyond them
        # only the gathering's traffic (/proc/self/io counts socket writes too): under the model's bytes on rank 1
        # (its half sent), under twice them on rank 0 (its half sent, the gathered tensors re-partitioned from it)
        assert engine[1] <= rank1 < engine[1] + model, (c, engine, model)
        assert engine[0] + model <= rank0 < engine[0] + 3 * model, (c, engine, model)
    opened = SentenceTransformer(str(tmp_path / "checkpoint-6"), device="cpu").state_dict()
    trained = SentenceTransformer(str(tmp_path / "model"), device="cpu").state_dict()
    assert opened.keys() == trained.keys()
    assert all((opened[k] == trained[k]).all() for k in trained), "the checkpoint's model is not the trained one"
    opened_by_stnb = checkpoints.to_model(tmp_path).state_dict()
    assert all((opened_by_stnb[k] == trained[k]).all() for k in trained)


# ---- resumed on another layout: another number of ranks, another strategy's format -------------------------
LAYOUTS = [  # (writer, its ranks, per device) -> (reader, its ranks, per device): the global batch kept
    ("ddp", 2, 4, "single", 1, 8),
    ("single", 1, 8, "ddp", 2, 4),
    ("fsdp", 2, 4, "single", 1, 8),     # DCP's shards read whole in one process
    ("single", 1, 8, "fsdp", 2, 4),     # the whole state cut into each rank's DTensor shards
    ("zero1", 2, 4, "zero1", 1, 8),     # the optimizer partitions re-partitioned
    ("fsdp", 2, 4, "zero1", 2, 4),
    ("zero1", 2, 4, "zero2", 2, 4),
    ("fsdp", 2, 6, "fsdp", 3, 4),       # DCP's own resharding (3 ranks on this 2-core machine)
    ("deepspeed", 2, 4, "deepspeed", 1, 8),  # DeepSpeed's universal checkpoint (ZeRO stage 2)
    ("deepspeed", 2, 4, "single", 1, 8),     # ... read whole, by name, by another strategy
    ("deepspeed", 2, 4, "zero1", 2, 4),
]


def _layout_run(strategy, ranks, per_device, folder, size, **kw):
    return stnb.run(stnb.TrainConfig(**{**RUN, "strategy": strategy, "num_processes": None if strategy == "single"
                                        else ranks, "per_device_batch_size": per_device, "train_size": size,
                                        "checkpoint_dir": str(folder), **kw}), echo=False)


def _written_then_resumed(monkeypatch, tmp_path, writer, w_ranks, w_batch, reader, r_ranks, r_batch, w_options=None,
                          **options):
    """(the run that wrote checkpoint-2 and went on to step 6, the run that resumed it on the other layout, the
    two trained models' weights); ``options``: both runs' strategy options (stage=...), ``w_options``: the
    writer's alone."""
    if max(w_ranks, r_ranks) > 2:
        monkeypatch.setattr(stnb.hardware, "cpu_cores", lambda: max(w_ranks, r_ranks))  # oversubscribed, forked
    size = w_ranks * w_batch * RUN["steps"]  # one epoch: no partial batch on either layout
    written = _layout_run(writer, w_ranks, w_batch, tmp_path / "w", size, save_to=str(tmp_path / "wm"),
                          **options, **(w_options or {}))
    resumed = _layout_run(reader, r_ranks, r_batch, tmp_path / "r", size, resume=str(tmp_path / "w" / "checkpoint-2"),
                          save_to=str(tmp_path / "rm"), **options)
    return written, resumed, _weights(tmp_path / "wm"), _weights(tmp_path / "rm")


@pytest.mark.slow
@pytest.mark.parametrize("writer,w_ranks,w_batch,reader,r_ranks,r_batch", LAYOUTS,
                         ids=[f"{w}{n}-to-{r}{m}" for w, n, _, r, m, _ in LAYOUTS])
def test_a_checkpoint_resumes_on_another_layout_its_tensors_checked_and_training_goes_on_as_it_would_have(
        monkeypatch, tmp_path, writer, w_ranks, w_batch, reader, r_ranks, r_batch):
    """Every rank compares each tensor it loaded (its piece of a sharded one) with the checkpoint's; then, with the
    global batch kept, every step takes the same samples as the run that never stopped: its losses and its final
    weights equal that run's up to float rounding (the gradient is averaged over other ranks, in another order;
    the RNG states are not carried, and this tiny BERT draws none)."""
    written, resumed, wa, wb = _written_then_resumed(monkeypatch, tmp_path, writer, w_ranks, w_batch, reader,
                                                     r_ranks, r_batch)
    assert written.verified and resumed.verified, (written.reason, resumed.reason)
    r = resumed.resumed_from
    assert (r["written_by"], r["written_strategy"], r["read_by"], r["read_strategy"]) == (w_ranks, writer, r_ranks,
                                                                                          reader)
    assert r["step"] == r["started_at_step"] == 2
    # rank 0's count (under zero1, the optimizer state of its partition only)
    assert r["loaded"]["model_tensors_checked"] > 30 and r["loaded"]["optimizer_tensors_checked"] >= 3, r["loaded"]
    assert r["loaded"]["rng"].startswith("not restored")
    assert ("resharded by its own loading" in r["loaded"]["how"]) == (writer == reader == "fsdp")
    assert resumed.losses == pytest.approx(written.losses[2:], rel=1e-5)
    assert wa.keys() == wb.keys()
    far = far_apart(wa, wb)
    assert not far, f"{len(far)} tensor(s) further apart than float rounding, e.g. {far[:3]}"
    assert [c["step"] for c in resumed.checkpoints] == [4, 6]


DEEPSPEED_RANKS = [  # (ZeRO stage, writer's ranks, per device, reader's ranks, per device); stage 2: LAYOUTS
    (1, 2, 4, 1, 8),
    (3, 2, 4, 1, 8),  # DeepSpeed's ZeRO-3 universal loading shares one step counter (deepspeed_resume)
    (3, 1, 8, 2, 4),  # each rank's piece of every parameter (ds_tensor) checked, at its own offset
]


@pytest.mark.slow
@pytest.mark.parametrize("stage,w_ranks,w_batch,r_ranks,r_batch", DEEPSPEED_RANKS,
                         ids=[f"stage{s}-{n}-to-{m}" for s, n, _, m, _ in DEEPSPEED_RANKS])
def test_a_deepspeed_checkpoint_resumes_on_another_number_of_ranks_through_the_universal_checkpoint(
        monkeypatch, tmp_path, stage, w_ranks, w_batch, r_ranks, r_batch):
    """The engine's checkpoint holds each rank's flat ZeRO partition; rank 0 converts it once into DeepSpeed's
    universal checkpoint (by parameter name, inside the checkpoint), every engine loads its own partition of it,
    and every rank compares the fp32 copy, exp_avg and exp_avg_sq of each parameter, and its piece of the
    module's weights, with the converted files. Training then goes on as the run that never stopped did."""
    written, resumed, wa, wb = _written_then_resumed(monkeypatch, tmp_path, "deepspeed", w_ranks, w_batch,
                                                     "deepspeed", r_ranks, r_batch, stage=stage)
    assert written.verified and resumed.verified, (written.reason, resumed.reason)
    r = resumed.resumed_from
    assert (r["written_by"], r["read_by"], r["step"], r["started_at_step"]) == (w_ranks, r_ranks, 2, 2)
    assert "universal checkpoint" in r["loaded"]["how"], r["loaded"]
    assert r["loaded"]["model_tensors_checked"] > 30, r["loaded"]
    assert r["loaded"]["optimizer_tensors_checked"] == 3 * r["loaded"]["model_tensors_checked"], r["loaded"]
    assert r["loaded"]["rng"].startswith("not restored")
    assert os.path.isfile(tmp_path / "w" / "checkpoint-2" / ".stnb-universal" / "latest_universal")
    assert resumed.losses == pytest.approx(written.losses[2:], rel=1e-5)
    far = far_apart(wa, wb)
    assert wa.keys() == wb.keys() and not far, f"{len(far)} tensor(s) further apart than float rounding: {far[:3]}"
    assert [c["step"] for c in resumed.checkpoints] == [4, 6]


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["fsdp", "zero2"])
def test_a_deepspeed_stage3_checkpoint_resumes_under_another_strategy_read_whole_by_name(monkeypatch, tmp_path,
                                                                                       reader):
    """ZeRO-3's checkpoint holds every parameter in partitions; its universal form, read by name (the fp32 copies
    over the saved model's tensors, AdamW's moments and step, each group's members and hyperparameters), is cut into
    the DTensor shards of fsdp / zero2 and checked there, and training goes on as the run that never stopped."""
    written, resumed, wa, wb = _written_then_resumed(monkeypatch, tmp_path, "deepspeed", 2, 4, reader, 2, 4,
                                                     w_options={"stage": 3})
    assert written.verified and resumed.verified, (written.reason, resumed.reason)
    r = resumed.resumed_from
    assert (r["written_strategy"], r["read_strategy"], r["started_at_step"]) == ("deepspeed", reader, 2)
    assert "the whole state read by parameter name" in r["loaded"]["how"], r["loaded"]
    assert r["loaded"]["model_tensors_checked"] > 30 and r["loaded"]["optimizer_tensors_checked"] > 30, r["loaded"]
    assert resumed.losses == pytest.approx(written.losses[2:], rel=1e-5)
    far = far_apart(wa, wb)
    assert wa.keys() == wb.keys() and not far, f"{len(far)} tensor(s) further apart than float rounding: {far[:3]}"


def build_with_weight_decay(out: str, per_device: int):
    """A user's checkpointing trainer with weight decay: the trainer makes two parameter groups, the biases and
    LayerNorm weights kept out of the decay."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses

    from stnb import models
    from trainfns import st_args, words

    model = SentenceTransformer(models.tiny_path(), device="cpu")
    n = 48
    train = Dataset.from_dict({"sentence1": [words(i) for i in range(n)], "sentence2": [words(i + 1) for i in range(n)],
                               "score": [float(i % 3) / 2 for i in range(n)]})
    args = st_args(out, max_steps=6, save_strategy="steps", save_steps=2, weight_decay=0.1,
                   per_device_train_batch_size=per_device)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=train,
                                      loss=losses.CosineSimilarityLoss(model))


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["deepspeed", "single"])
def test_a_users_deepspeed_stage3_checkpoint_resumes_on_one_rank_with_each_groups_own_weight_decay(tmp_path, reader):
    """A user's trainer (weight_decay=0.1: two parameter groups) checkpointed by 2 ZeRO-3 ranks, resumed by 1.
    DeepSpeed's ZeRO-3 universal loading gives every group the first group's hyperparameters (the decay-free group
    then decayed): stnb puts each group's back, and the check compares every group's with the checkpoint's. Read
    whole by another strategy, each parameter's group is the one the writing engine kept it in."""
    import functools

    def run(folder, strategy, ranks, per_device, **kw):
        return stnb.run(functools.partial(build_with_weight_decay, str(tmp_path / folder), per_device),
                        strategy=strategy, num_processes=ranks, device="cpu", threads_per_rank=1, timeout=300,
                        echo=False, **kw)

    written = run("w", "deepspeed", 2, 4, stage=3, save_to=str(tmp_path / "wm"))
    resumed = run("r", reader, 1, 8, resume=str(tmp_path / "w" / "checkpoint-2"), save_to=str(tmp_path / "rm"),
                  **({"stage": 3} if reader == "deepspeed" else {}))
    assert written.verified and resumed.verified, (written.reason, resumed.reason)
    how = resumed.resumed_from["loaded"]["how"]
    assert ("universal checkpoint" in how) == (reader == "deepspeed"), how
    assert resumed.losses == pytest.approx(written.losses[2:], rel=1e-5)
    # the losses barely see a LayerNorm weight decayed by 1e-4 a step; the weights do. The BERT pooler, which mean
    # pooling never uses, included: stnb keeps DeepSpeed from decaying a parameter without gradient, as torch's AdamW
    wa, wb = _weights(tmp_path / "wm"), _weights(tmp_path / "rm")
    far = far_apart(wa, wb)
    assert wa.keys() == wb.keys() and not far, f"{len(far)} tensor(s) further apart than float rounding: {far[:3]}"


@pytest.mark.slow
def test_a_wrong_deepspeed_load_on_another_number_of_ranks_is_caught(monkeypatch, tmp_path):
    """Not true by construction: an optimizer state the engine put in place wrong (one exp_avg doubled after
    DeepSpeed's own universal loading) stops the run at the check, before its first step."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    loading = DeepSpeedZeroOptimizer._load_universal_checkpoint

    def wrong(self, *a, **kw):
        out = loading(self, *a, **kw)
        next(iter(self.optimizer.state.values()))["exp_avg"].mul_(2)
        return out

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "_load_universal_checkpoint", wrong)
    with pytest.raises(stnb.LaunchError, match=r"the state DeepSpeed loaded differs from the checkpoint's: .*exp_avg"):
        _written_then_resumed(monkeypatch, tmp_path, "deepspeed", 2, 4, "deepspeed", 1, 8)


def torch_allclose(a, b) -> bool:
    import torch

    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


#: an attention key bias has no gradient in exact arithmetic (softmax ignores what adds the same score to every key
#: of a query): its float gradient is rounding alone, which AdamW's normalisation turns into steps of about the
#: learning rate, of either sign. Two summation orders (2 ranks, then 1) may end it apart by up to that much a step
#: (a fresh-clone CI saw layer 0's key bias alone apart, in the ZeRO-3 -> single resume); every other tensor is held
#: to float rounding
ROUNDING_ONLY = ".attention.self.key.bias"


def far_apart(wa: dict, wb: dict, lr: float = 1e-3, steps: int = 4) -> list:
    """The tensors of ``wa`` further from ``wb``'s than float rounding (a key bias: than ``lr`` a step, doubled,
    over the ``steps`` trained after the resume; trainfns.st_args' learning rate, steps 3 to 6)."""
    return [k for k in wa if not (torch_allclose(wa[k], wb[k]) or (
        k.endswith(ROUNDING_ONLY) and float((wa[k] - wb[k]).abs().max()) <= 2 * lr * steps))]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["optimizer-not-set", "optimizer-misnamed"])
def test_a_wrong_load_on_another_layout_is_caught(monkeypatch, tmp_path, fault):
    """Not true by construction: an optimizer state that is read but never put in place stops the run at the
    tensor check, before its first step; one put in place under the wrong names (two parameters of the same shape
    swapped: the check compares with what was read, so it passes) ends with other weights than the run that never
    stopped, which the comparison above catches."""
    if fault == "optimizer-not-set":
        monkeypatch.setattr(layouts, "set_optimizer", lambda *a, **kw: None)
        with pytest.raises(stnb.LaunchError, match="optimizer state loaded on rank 0 differs from the checkpoint's"):
            _written_then_resumed(monkeypatch, tmp_path, "ddp", 2, 4, "single", 1, 8)
        return
    by_name = layouts.by_name

    def misnamed(saved, groups):
        q, k = (f"0.model.encoder.layer.0.attention.self.{w}.weight" for w in ("query", "key"))
        swap = {q: k, k: q}
        return by_name(saved, [[swap.get(n, n) for n in g] for g in groups])

    monkeypatch.setattr(layouts, "by_name", misnamed)
    written, resumed, wa, wb = _written_then_resumed(monkeypatch, tmp_path, "ddp", 2, 4, "single", 1, 8)
    assert resumed.verified, resumed.reason
    moved = [k for k in wa if not torch_allclose(wa[k], wb[k])]
    assert any("layer.0.attention.self.query" in k for k in moved), f"the swap changed nothing there: {moved[:5]}"


# ---- refused before any rank starts (no process is started for these) ----------------------------------
def _fake_checkpoint(folder, step, **manifest):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, checkpoints.TRAINER_STATE), "w") as f:
        json.dump({"global_step": step}, f)
    if manifest:
        with open(os.path.join(folder, checkpoints.MANIFEST), "w") as f:
            json.dump(manifest, f)


def test_resume_latest_with_no_checkpoint_is_refused_naming_the_half_written_ones(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoints.find("latest", tmp_path)
    os.makedirs(tmp_path / checkpoints.PARTIAL / "checkpoint-4")
    with pytest.raises(CheckpointError, match="half-written.*checkpoint-4"):
        checkpoints.find("latest", tmp_path)
    with pytest.raises(CheckpointError, match="half-written"):
        checkpoints.find(str(tmp_path / checkpoints.PARTIAL / "checkpoint-4"), tmp_path)
    _fake_checkpoint(tmp_path / checkpoints.PARTIAL / "checkpoint-4", 4)  # rank 0 finished, another rank did not
    with pytest.raises(CheckpointError, match="half-written"):
        checkpoints.find(str(tmp_path / checkpoints.PARTIAL), tmp_path)  # the staging folder is no run folder
    with pytest.raises(CheckpointError, match="no such folder"):
        checkpoints.find(str(tmp_path / "nowhere"), tmp_path)


def test_latest_is_the_newest_complete_checkpoint_by_step_not_by_name(tmp_path):
    for step in (2, 10, 4):
        _fake_checkpoint(tmp_path / f"checkpoint-{step}", step)
    os.makedirs(tmp_path / "checkpoint-12")  # no trainer state: not a checkpoint
    assert checkpoints.find("latest", tmp_path) == str(tmp_path / "checkpoint-10")
    assert checkpoints.find(str(tmp_path), None) == str(tmp_path / "checkpoint-10")  # a run folder: its newest


def test_auto_resumes_the_newest_if_any_and_a_restarted_run_prefers_its_newest(tmp_path):
    """resume='auto': the newest complete checkpoint, else step 0 (None); a run the engine restarted (a requeued
    SLURM job) continues from its own newest checkpoint even when resume= named an older one."""
    run = tmp_path / "run"
    assert checkpoints.resume_point("auto", run) is None and checkpoints.resume_point(None, run) is None
    assert checkpoints.resume_point(None, run, restarted=True) is None  # restarted before its first checkpoint
    os.makedirs(run / checkpoints.PARTIAL / "checkpoint-6")  # half-written: never resumed from
    _fake_checkpoint(run / "checkpoint-2", 2)
    _fake_checkpoint(run / "checkpoint-4", 4)
    newest = str(run / "checkpoint-4")
    assert checkpoints.resume_point("auto", run) == newest
    assert checkpoints.resume_point(None, run) is None  # not asked, not restarted: step 0
    assert checkpoints.resume_point(str(run / "checkpoint-2"), run) == str(run / "checkpoint-2")
    assert checkpoints.resume_point(str(run / "checkpoint-2"), run, restarted=True) == newest
    assert checkpoints.resume_point(None, run, restarted=True) == newest
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoints.resume_point("latest", tmp_path / "empty")
    # the recipe: 'auto' into an empty folder trains from step 0; into a run's folder, it continues it
    cfg = dict(model="tiny", steps=6, checkpoint_every=2)
    checkpoints.check_recipe(stnb.TrainConfig(**cfg, checkpoint_dir=str(tmp_path / "empty"), resume="auto"))
    with pytest.raises(ConfigError, match="already holds another run's checkpoints"):
        checkpoints.check_recipe(stnb.TrainConfig(**cfg, checkpoint_dir=str(run)))
    with pytest.raises(CheckpointError, match="is at step 4 and this run ends at steps=4"):
        checkpoints.check_recipe(stnb.TrainConfig(**{**cfg, "steps": 4}, checkpoint_dir=str(run), resume="auto"))


def _written(folder, strategy, fmt, ranks, per_device, names=True, **extra):
    """A fake checkpoint of ``ranks`` ranks of ``strategy`` (``per_device`` samples each), with the names of its
    optimizer's parameters where its format has them (``names``)."""
    _fake_checkpoint(folder, 2, strategy=strategy, format=fmt, world_size=ranks,
                     **{**checkpoints.batch_of(per_device, 1, ranks), **extra})
    if names and fmt == "trainer":
        layouts.write_names(os.path.join(folder, layouts.NAMES), [["w"]])
    if names and fmt == "zero1-shards":
        for r in range(ranks):
            layouts.write_names(os.path.join(folder, f"optimizer.rank{r}-of-{ranks}.names.json"), [["w"]])
    return str(folder)


def test_each_strategy_declares_the_layouts_it_resumes_and_the_rest_is_refused_with_the_fix(tmp_path):
    """Before any process starts (``check_serves``): a checkpoint readable by parameter name resumes on any number
    of ranks and strategy (DeepSpeed's too, by DeepSpeed's universal checkpoint); DeepSpeed reads only its own; a
    numbered one (no names) only on its own layout."""
    from stnb import strategies

    def serves(path, strategy, ranks, per_device):
        batch = checkpoints.batch_of(per_device, 1, ranks)
        return checkpoints.check_serves(path, strategies.get(strategy), ranks, batch)

    ddp = _written(tmp_path / "ddp", "ddp", "trainer", 2, 4)
    assert serves(ddp, "single", 1, 8)["world_size"] == 2
    assert serves(ddp, "zero1", 1, 8) and serves(ddp, "fsdp", 2, 4)
    fsdp = _written(tmp_path / "fsdp", "fsdp", "dcp", 2, 4)
    assert serves(fsdp, "single", 1, 8) and serves(fsdp, "zero1", 2, 4) and serves(fsdp, "zero2", 2, 4)
    zero1 = _written(tmp_path / "zero1", "zero1", "zero1-shards", 2, 4)
    assert serves(zero1, "zero1", 1, 8) and serves(zero1, "ddp", 2, 4)
    numbered = _written(tmp_path / "numbered", "zero1", "zero1-shards", 2, 4, names=False)
    with pytest.raises(CheckpointError, match="without the names.*strategy='zero1' and num_processes=2"):
        serves(numbered, "zero1", 1, 8)
    assert serves(numbered, "zero1", 2, 4)  # its own layout: its own files
    numbered = _written(tmp_path / "numbered-ddp", "ddp", "trainer", 2, 4, names=False)
    with pytest.raises(CheckpointError, match="optimizer-params.json"):
        serves(numbered, "single", 1, 8)
    ds = _written(tmp_path / "ds", "deepspeed", "deepspeed", 2, 4)  # through DeepSpeed's universal checkpoint
    assert serves(ds, "deepspeed", 1, 8)["world_size"] == 2
    assert serves(ds, "single", 1, 8) and serves(ds, "fsdp", 2, 4) and serves(ds, "zero1", 1, 8)
    with pytest.raises(CheckpointError, match="DeepSpeed's engine loads only its own"):
        serves(ddp, "deepspeed", 2, 4)
    assert serves(ds, "deepspeed", 2, 4)["world_size"] == 2


def test_a_deepspeed_checkpoint_resumes_only_at_the_zero_stage_that_wrote_it(tmp_path):
    """The manifest records the ZeRO stage; another stage is refused before any process starts (stnb's recipe) and
    in the ranks (a user's trainer: its config), naming the stage that keeps it. A checkpoint written before the
    stage was recorded is the engine's to load, as before."""
    from stnb import strategies

    ds = strategies.get("deepspeed")

    def config(stage, resume=None):
        return stnb.TrainConfig(strategy="deepspeed", stage=stage, num_processes=2, model="tiny", steps=6,
                                evaluate=False, per_device_batch_size=4, checkpoint_dir=str(tmp_path / "next"),
                                checkpoint_every=2 if resume else 0, resume=resume)

    assert ds.checkpoint_layout(config(3)) == {"zero_stage": 3}
    assert strategies.get("fsdp").checkpoint_layout(config(3)) == {}
    three = _written(tmp_path / "three", "deepspeed", "deepspeed", 2, 4, zero_stage=3)
    why = ("it holds ZeRO stage 3's partitions, and this run asks stage {}: DeepSpeed's engine reads a checkpoint at "
           "the stage that wrote it (stage 3 partitions the parameters too, stages 1 and 2 keep the whole model); "
           "resume it with stage=3, or start a new run from the model it holds (stnb.checkpoints.to_model("
           "<checkpoint>) opens it)")
    for stage in (1, 2):
        assert _refusal(checkpoints.check_serves, three, ds, 2, checkpoints.batch_of(4, 1, 2), config(stage)) == (
            f"{three} was written by 2 rank(s) of strategy 'deepspeed' (deepspeed format); strategy 'deepspeed' on 2 "
            f"rank(s) cannot resume it: {why.format(stage)}")
        assert _refusal(checkpoints.check_recipe, config(stage, three)).endswith(why.format(stage))
    assert checkpoints.check_serves(three, ds, 2, checkpoints.batch_of(4, 1, 2), config(3))["zero_stage"] == 3
    checkpoints.check_recipe(config(3, three))
    assert checkpoints.check_serves(three, ds, 2)["zero_stage"] == 3  # the run's options not known: not checked
    older = _written(tmp_path / "older", "deepspeed", "deepspeed", 2, 4)  # no zero_stage recorded
    checkpoints.check_recipe(config(1, older))


def test_a_resume_that_would_change_the_global_batch_is_refused_naming_what_keeps_it(tmp_path):
    from stnb import strategies

    fsdp = _written(tmp_path / "fsdp", "fsdp", "dcp", 2, 4)
    with pytest.raises(CheckpointError, match=r"took 8 samples.*takes 4.*per_device_batch_size=8.*"
                                              r"gradient_accumulation_steps=2"):
        checkpoints.check_serves(fsdp, strategies.get("single"), 1, checkpoints.batch_of(4, 1, 1))
    with pytest.raises(CheckpointError, match="num_processes=2"):  # no per-device batch gives 8 on 3 ranks
        checkpoints.check_serves(fsdp, strategies.get("fsdp"), 3, checkpoints.batch_of(4, 1, 3))
    old = tmp_path / "old"
    _fake_checkpoint(old, 2, strategy="ddp", format="trainer", world_size=2)  # before the batch was recorded
    layouts.write_names(os.path.join(old, layouts.NAMES), [["w"]])
    with pytest.raises(CheckpointError, match="does not record its global batch"):
        checkpoints.check_serves(str(old), strategies.get("single"), 1, checkpoints.batch_of(8, 1, 1))
    # stnb's recipe: before any process starts
    cfg = dict(strategy="single", model="tiny", steps=6, evaluate=False, checkpoint_every=2,
               checkpoint_dir=str(tmp_path / "next"), resume=fsdp)
    with pytest.raises(CheckpointError, match="per_device_batch_size=8"):
        stnb.TrainConfig(**cfg, per_device_batch_size=4).check_recipe_options()
    stnb.TrainConfig(**cfg, per_device_batch_size=8).check_recipe_options()  # the global batch kept


def test_the_recipe_refuses_bad_checkpoint_options_before_launch(tmp_path):
    cfg = dict(strategy="ddp", num_processes=2, model="tiny", steps=6, evaluate=False)
    with pytest.raises(stnb.ConfigError, match="needs checkpoint_dir"):
        stnb.TrainConfig(**cfg, checkpoint_every=2).check_recipe_options()
    with pytest.raises(stnb.ConfigError, match="checkpoint_every=0 writes none"):
        stnb.TrainConfig(**cfg, keep=2, checkpoint_dir=str(tmp_path)).check_recipe_options()
    _fake_checkpoint(tmp_path / "checkpoint-4", 4, strategy="ddp", format="trainer", world_size=2)
    with pytest.raises(stnb.ConfigError, match="already holds another run's checkpoints"):
        stnb.TrainConfig(**cfg, checkpoint_every=2, checkpoint_dir=str(tmp_path)).check_recipe_options()
    with pytest.raises(CheckpointError, match="nothing is left to train"):
        stnb.TrainConfig(**{**cfg, "steps": 4}, resume="latest", checkpoint_dir=str(tmp_path)).check_recipe_options()
    stnb.TrainConfig(**cfg, resume="latest", checkpoint_dir=str(tmp_path)).check_recipe_options()  # fine


def test_a_user_build_takes_resume_but_not_the_recipes_checkpoint_options():
    with pytest.raises(stnb.ConfigError, match="save_strategy='steps'"):
        stnb.TrainConfig.for_build(checkpoint_every=2)
    assert stnb.TrainConfig.for_build(resume="latest").resume == "latest"


# ---- what each refusal says, word for word (the mutation run mutates stnb/checkpoints.py: a refusal's text is
# what the user reads, so a changed word must turn a test red) ---------------------------------------------
def _refusal(call, *args) -> str:
    with pytest.raises((CheckpointError, ConfigError)) as e:
        call(*args)
    return str(e.value)


def test_complete_and_partial_list_only_checkpoint_folders_oldest_step_first(tmp_path):
    assert checkpoints.complete(tmp_path / "nowhere") == [] and checkpoints.partial(tmp_path / "nowhere") == []
    for name in ("checkpoint-10", "checkpoint-9", "checkpoint-9-old", "my-checkpoint-3"):
        _fake_checkpoint(tmp_path / name, 1)
    (tmp_path / "checkpoint-11").write_text("a file, not a folder")
    assert checkpoints.complete(tmp_path) == [(9, str(tmp_path / "checkpoint-9")),
                                              (10, str(tmp_path / "checkpoint-10"))]
    for name in ("checkpoint-8", "checkpoint-12"):
        os.makedirs(tmp_path / checkpoints.PARTIAL / name)
    assert checkpoints.partial(tmp_path) == [str(tmp_path / checkpoints.PARTIAL / n) for n in ("checkpoint-12",
                                                                                                 "checkpoint-8")]
    assert checkpoints.step_of(tmp_path / "checkpoint-9") == 1
    _fake_checkpoint(tmp_path / "checkpoint-2", 2)  # three: the newest is the last, not the second
    assert checkpoints.resume_point("auto", tmp_path) == str(tmp_path / "checkpoint-10")
    assert checkpoints.resume_point("", tmp_path) is None and checkpoints.resume_point(None, None) is None


def test_find_says_what_is_there_instead_word_for_word(tmp_path):
    nowhere = str(tmp_path / "nowhere")
    assert _refusal(checkpoints.find, nowhere, None) == (
        f"resume={nowhere!r}: no such folder; give 'latest', a run's checkpoint folder or one of its checkpoint-N "
        "folders")
    half = tmp_path / "run" / checkpoints.PARTIAL / "checkpoint-4"
    os.makedirs(half)
    assert _refusal(checkpoints.find, str(half), None) == (
        f"resume={str(half)!r} is a half-written checkpoint (not every rank finished writing it); resume from "
        f"{str(tmp_path / 'run')!r} ('latest' there) instead")
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    assert _refusal(checkpoints.find, str(afile), None) == (
        f"resume={str(afile)!r} holds no trainer_state.json: not a trainer checkpoint")
    tail = ("; train with checkpoint_every=N (your trainer: save_strategy='steps', save_steps=N) first, or leave "
            "resume out (or resume='auto': the newest if there is one) to start from step 0")
    run = str(tmp_path / "run")
    os.makedirs(tmp_path / "run" / checkpoints.PARTIAL / "checkpoint-6")
    assert _refusal(checkpoints.find, "latest", run) == (
        f"resume='latest': no complete checkpoint in {run!r} (half-written, never completed by every rank: "
        f"checkpoint-4, checkpoint-6){tail}")
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert _refusal(checkpoints.find, empty, None) == f"resume={empty!r}: no complete checkpoint in {empty!r}{tail}"
    assert _refusal(checkpoints.find, "latest", None) == f"resume='latest': no complete checkpoint in None{tail}"
    _fake_checkpoint(tmp_path / "run" / "checkpoint-2", 2)
    given = os.path.relpath(tmp_path / "run" / "checkpoint-2")
    assert checkpoints.find(given, None) == given  # a checkpoint: the path as given


def test_check_serves_names_the_writer_the_reader_and_why(tmp_path):
    from stnb import strategies

    assert checkpoints.check_serves(str(tmp_path), strategies.get("single"), 1) == {}  # the trainer's own: no manifest
    ddp = _written(tmp_path / "ddp", "ddp", "trainer", 2, 4)
    why = strategies.get("deepspeed").loads(ddp, checkpoints.manifest(ddp), 2, strategies.owner("trainer"))
    assert why and _refusal(checkpoints.check_serves, ddp, strategies.get("deepspeed"), 2) == (
        f"{ddp} was written by 2 rank(s) of strategy 'ddp' (trainer format); strategy 'deepspeed' on 2 rank(s) "
        f"cannot resume it: {why}")
    ddp = _written(tmp_path / "ddp", "ddp", "trainer", 2, 4)
    assert checkpoints.check_serves(ddp, strategies.get("single"), 1)["global_batch"] == 8  # batch=None: not checked
    assert _refusal(checkpoints.check_serves, ddp, strategies.get("single"), 1, checkpoints.batch_of(4, 1, 1)
                    ).startswith(f"{ddp} was written by a run whose optimizer step took 8 samples")
    unknown = tmp_path / "unknown"
    _fake_checkpoint(unknown, 2, strategy="other", world_size=3)
    assert _refusal(checkpoints.check_serves, str(unknown), strategies.get("single"), 1).endswith(
        "(trainer format); strategy 'single' on 1 rank(s) cannot resume it: its optimizer state is numbered, without "
        "the names of its parameters (optimizer-params.json: written by stnb since resuming on another layout "
        "exists, and only when the model owns every parameter the optimizer updates, not a loss's own); resume it "
        "with strategy='other' and num_processes=3")


def test_the_global_batch_refusal_word_for_word_with_every_fix_it_can_offer(tmp_path):
    def refusal(written, world, batch):
        return _refusal(checkpoints._check_batch, "ck", written, world, batch)

    assert checkpoints.batch_of(4, 2, 3, 2) == {"per_device_batch_size": 4, "gradient_accumulation_steps": 2,
                                                "devices_per_rank": 2, "global_batch": 48}
    two = {"world_size": 2, **checkpoints.batch_of(4, 2, 2)}  # 16 samples a step
    checkpoints._check_batch("ck", two, 1, checkpoints.batch_of(8, 2, 1))  # kept: no refusal
    head = ("ck was written by a run whose optimizer step took 16 samples (2 rank(s) x 4 per device x 2 accumulated); "
            "this run's takes {have} ({world} rank(s) x {p} x {a}): the data position and the optimizer's steps count "
            "batches of 16 samples. Keep it with ")
    assert refusal(two, 1, checkpoints.batch_of(4, 2, 1)) == head.format(have=8, world=1, p=4, a=2) + (
        "per_device_batch_size=8 (your own trainer: per_device_train_batch_size) or gradient_accumulation_steps=4")
    assert refusal(two, 1, checkpoints.batch_of(16, 2, 1)) == head.format(have=32, world=1, p=16, a=2) + (
        "per_device_batch_size=8 (your own trainer: per_device_train_batch_size) or gradient_accumulation_steps=1")
    assert refusal(two, 1, checkpoints.batch_of(3, 2, 1)) == head.format(have=6, world=1, p=3, a=2) + (
        "per_device_batch_size=8 (your own trainer: per_device_train_batch_size)")  # 16 is no multiple of 3
    assert refusal(two, 4, checkpoints.batch_of(2, 1, 4)) == head.format(have=8, world=4, p=2, a=1) + (
        "per_device_batch_size=4 (your own trainer: per_device_train_batch_size) or gradient_accumulation_steps=2")
    assert refusal(two, 3, checkpoints.batch_of(4, 2, 3)) == head.format(have=24, world=3, p=4, a=2) + (
        "a number of ranks that divides it (num_processes=2)")
    dp = {"per_device_batch_size": 4, "gradient_accumulation_steps": 1, "global_batch": 8}  # no devices_per_rank
    assert refusal(two, 1, dp).endswith("Keep it with per_device_batch_size=16 (your own trainer: "
                                        "per_device_train_batch_size) or gradient_accumulation_steps=4")
    assert refusal(two, 1, checkpoints.batch_of(2, 1, 1, 2)).endswith(
        "Keep it with per_device_batch_size=8 (your own trainer: per_device_train_batch_size) or "
        "gradient_accumulation_steps=4")  # two devices a rank (dp)
    # two devices a rank and accumulation together: each fix divides by ranks x devices x the other factor
    small = {"world_size": 1, **checkpoints.batch_of(2, 1, 1)}  # 2 samples a step
    assert refusal(small, 1, checkpoints.batch_of(2, 2, 1, 2)).endswith(
        "Keep it with a number of ranks that divides it (num_processes=1)")  # 2 is no multiple of 4
    four = {"world_size": 1, **checkpoints.batch_of(4, 1, 1)}
    assert refusal(four, 1, checkpoints.batch_of(2, 4, 1, 2)).endswith("Keep it with gradient_accumulation_steps=1")
    old = {"world_size": 2}
    checkpoints._check_batch("ck", old, 2, checkpoints.batch_of(4, 1, 2))  # unrecorded, same ranks: kept
    assert refusal(old, 1, checkpoints.batch_of(8, 1, 1)) == (
        "ck does not record its global batch (written before stnb recorded it): on 1 rank(s) it cannot be kept; "
        "resume it with num_processes=2")


def test_the_recipes_checkpoint_refusals_word_for_word(monkeypatch, tmp_path):
    def refusal(**kw):
        return _refusal(checkpoints.check_recipe, stnb.TrainConfig(**{**cfg, **kw}))

    cfg = dict(strategy="single", model="tiny", steps=6, evaluate=False, per_device_batch_size=8)
    assert refusal(checkpoint_every=2, keep=3, resume="latest") == (
        "checkpoint_every=2, keep=3, resume='latest' needs checkpoint_dir=... (the folder the checkpoints go to and "
        "resume='latest' reads them from)")
    assert refusal(keep=3).startswith("keep=3 needs checkpoint_dir=...")
    assert refusal(keep=3, checkpoint_dir=str(tmp_path)) == (
        "keep=3 keeps checkpoints, and checkpoint_every=0 writes none: set checkpoint_every=N")
    monkeypatch.setenv("HOME", str(tmp_path))
    _fake_checkpoint(tmp_path / "run" / "checkpoint-4", 4, strategy="single", format="trainer", world_size=1,
                     **checkpoints.batch_of(8, 1, 1))
    assert refusal(checkpoint_every=2, checkpoint_dir="~/run") == (
        "checkpoint_dir='~/run' already holds another run's checkpoints (latest checkpoint-4); resume='latest' (or "
        "'auto') continues that run, or choose a new folder (stnb never mixes two runs' checkpoints)")
    path = str(tmp_path / "run" / "checkpoint-4")
    assert refusal(steps=4, checkpoint_dir="~/run", resume="latest") == (
        f"{path} is at step 4 and this run ends at steps=4: nothing is left to train; ask for more steps (steps > 4)")
    checkpoints.check_recipe(stnb.TrainConfig(**{**cfg, "steps": 5}, checkpoint_dir="~/run", resume="latest"))
    checkpoints.check_recipe(stnb.TrainConfig(**cfg, checkpoint_dir="~/new", checkpoint_every=2))  # a new folder
    assert "per_device_batch_size=8" in refusal(checkpoint_dir="~/run", resume="latest", per_device_batch_size=4)
    # the batch this run would take: ranks x per device x accumulation x devices a rank (dp's GPUs)
    _fake_checkpoint(tmp_path / "two" / "checkpoint-2", 2, strategy="ddp", format="trainer", world_size=2,
                     **checkpoints.batch_of(2, 2, 2))
    layouts.write_names(os.path.join(tmp_path / "two" / "checkpoint-2", layouts.NAMES), [["w"]])
    two = dict(checkpoint_dir="~/two", resume="latest", per_device_batch_size=2, gradient_accumulation_steps=2)
    checkpoints.check_recipe(stnb.TrainConfig(**{**cfg, **two, "strategy": "ddp", "num_processes": 2}))
    assert "this run's takes 16 (2 rank(s) x 4 x 2)" in refusal(**{**two, "per_device_batch_size": 4}, strategy="ddp",
                                                                 num_processes=2)
    monkeypatch.setattr("stnb.hardware.gpu_count", lambda: 2)  # dp drives two GPUs from one process
    checkpoints.check_recipe(stnb.TrainConfig(**{**cfg, **two, "strategy": "dp", "per_device_batch_size": 2,
                                                 "gradient_accumulation_steps": 2}))
