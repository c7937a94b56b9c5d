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
import signal

import pytest

import stnb
from stnb import checkpoints
from stnb.checkpoints import CheckpointError

RUN = dict(num_processes=2, model="tiny", per_device_batch_size=4, steps=6, train_size=64, evaluate=False,
           threads_per_rank=1, timeout=300, warmup_steps_excluded=1, checkpoint_every=2)
STRATEGIES = ["single", "ddp", "zero1", "zero2", "fsdp", "deepspeed"]


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


def _stopped_then_resumed(monkeypatch, tmp_path, strategy, broken=None):
    """(the uninterrupted run, the resumed run, their saved models' folders): the second run is killed in its
    4th step (after checkpoint-2), then resumed from 'latest'; ``broken``: a fault patched in for the resume."""
    never = stnb.run(_config(strategy, tmp_path / "never", save_to=str(tmp_path / "never-model")), echo=False)
    with monkeypatch.context() as m:
        _kill(m, "training_step", lambda t: t.state.global_step == 3, rank=1 if strategy != "single" else 0)
        with pytest.raises(stnb.LaunchError) as stopped:
            stnb.run(_config(strategy, tmp_path / "stopped"), echo=False)
    assert stopped.value.kind == "killed", str(stopped.value)
    assert [s for s, _ in checkpoints.complete(tmp_path / "stopped")] == [2]
    with monkeypatch.context() as m:
        if broken:
            broken(m)
        resumed = stnb.run(_config(strategy, tmp_path / "stopped", resume="latest",
                                   save_to=str(tmp_path / "resumed-model")), echo=False)
    return never, resumed, tmp_path / "never-model", tmp_path / "resumed-model"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_run_killed_mid_step_resumes_to_the_weights_and_losses_of_the_run_that_never_stopped(
        monkeypatch, tmp_path, strategy):
    never, resumed, a, b = _stopped_then_resumed(monkeypatch, tmp_path, strategy)
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


def build_with_dropout(out: str, keep=None, best=False):
    """A user's trainer that checkpoints the way Hugging Face users do (save_strategy='steps', save_steps=2), on a
    tiny BERT with dropout 0.1: the training steps draw from the RNG, so a resume must restore every rank's."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import evaluation, losses

    from stnb.models import tiny_path
    from trainfns import st_args, words

    model = SentenceTransformer(tiny_path(), device="cpu")
    for module in model.modules():
        if type(module).__name__ == "Dropout":
            module.p = 0.1
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


def test_a_checkpoint_of_another_strategy_or_rank_count_is_refused(tmp_path):
    from stnb import strategies

    _fake_checkpoint(tmp_path / "checkpoint-2", 2, strategy="zero1", format="zero1-shards", world_size=2)
    path = str(tmp_path / "checkpoint-2")
    with pytest.raises(CheckpointError, match="strategy='zero1'"):
        checkpoints.check_serves(path, strategies.get("ddp"), 2)
    with pytest.raises(CheckpointError, match="num_processes=2"):
        checkpoints.check_serves(path, strategies.get("zero1"), 3)
    assert checkpoints.check_serves(path, strategies.get("zero1"), 2)["world_size"] == 2


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
