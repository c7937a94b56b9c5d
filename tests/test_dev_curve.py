"""The dev curve (issue 30: learning visible and honest): ``TrainConfig.dev_points`` evaluations of the held-out
dev evaluator during training, by the trainer itself (eval_strategy='steps') on every rank, read back into
``RunResult.dev_curve`` from ``(0, before)`` to ``(steps, after)``; the evaluations stay out of what stnb
measures (step times, the loss per step, the training peak); old results files without a curve still load."""

from __future__ import annotations

import functools
import json
import os
import time
from types import SimpleNamespace

import pytest

import stnb
from stnb import ConfigError
from stnb.memory import PeakMemory
from stnb.models import tiny_path
from stnb.results import append_result, load_results
from stnb.training import dev_curve
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator
from trainfns import FAST, st_args, words

CI = dict(model="tiny", steps=6, per_device_batch_size=8, train_size=400, dev_size=64)


# ---- in process ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps, points, every, at", [(6, 2, 2, [2, 4]), (20, 3, 5, [5, 10, 15]), (30, 2, 10, [10, 20]),
                                                      (4, 3, 1, [1, 2, 3]), (7, 4, 2, [2, 4, 6])])
def test_the_trainers_eval_steps_give_at_most_dev_points_before_the_last_step(steps, points, every, at):
    cfg = stnb.TrainConfig(steps=steps, dev_points=points)
    assert cfg.dev_eval_steps() == every
    assert [s for s in range(1, steps) if s % every == 0] == at and len(at) <= points
    assert stnb.TrainConfig(steps=steps).dev_eval_steps() is None  # default 0: none


def test_dev_points_refused_where_they_cannot_apply():
    with pytest.raises(ConfigError, match="evaluate=False turns it off"):
        stnb.TrainConfig(dev_points=2, evaluate=False).validate(check_resources=False)
    with pytest.raises(ConfigError, match="use dev_points <= 5 or steps >= 7"):
        stnb.TrainConfig(steps=6, dev_points=6).validate(check_resources=False)
    with pytest.raises(ConfigError, match="dev_points must be >= 0"):
        stnb.TrainConfig(dev_points=-1).validate(check_resources=False)
    with pytest.raises(ConfigError, match="dev_points: eval_strategy='steps' and eval_steps="):
        stnb.TrainConfig.for_build(dev_points=2)  # a user's trainer: where it belongs in the user's code
    stnb.TrainConfig(steps=6, dev_points=5).validate(check_resources=False)


def test_the_curve_runs_from_before_to_after_with_the_trainers_evaluations_between():
    history = [{"loss": 1.0, "step": 1}, {"eval_dev_spearman_cosine": 0.3, "eval_runtime": 0.1, "step": 2},
               {"loss": 0.9, "step": 3}, {"eval_dev_spearman_cosine": 0.4, "step": 4},
               {"eval_dev_spearman_cosine": 0.45, "step": 6}, {"train_runtime": 1.0, "step": 6}]
    state = SimpleNamespace(global_step=6, log_history=history)
    # the trainer's own evaluation at the last step is the after's point: the trained model, once
    assert dev_curve("dev_spearman_cosine", 0.1, 0.5, state) == [(0, 0.1), (2, 0.3), (4, 0.4), (6, 0.5)]
    assert dev_curve("dev_other", 0.1, 0.5, state) == [(0, 0.1), (6, 0.5)]  # no evaluation during training


def test_an_old_results_file_without_a_curve_still_loads(tmp_path):
    path = tmp_path / "runs.jsonl"
    res = stnb.RunResult(strategy="ddp", world_size=2, per_device_batch_size=8, global_batch_size=16, steps=6,
                         samples_per_second=10.0, step_times=[0.1] * 6, losses=[1.0] * 6, peak_memory_bytes=[1, 1],
                         local_param_count=[1, 1], total_param_count=1, verified=True, verification={},
                         model="tiny", device="cpu", versions={}, dev_metric="dev_spearman_cosine",
                         dev_metric_before=0.1, dev_metric_after=0.5, dev_curve=[(0, 0.1), (2, 0.3), (6, 0.5)])
    old = res.to_dict()
    old.pop("dev_curve")
    path.write_text(json.dumps(old) + "\n")
    append_result(path, res)
    rows = load_results(path, as_frame=False)
    assert "dev_curve" not in rows[0] and rows[1]["dev_curve"] == [[0, 0.1], [2, 0.3], [6, 0.5]]
    back = [stnb.RunResult.from_dict(r) for r in rows]
    assert back[0].dev_curve == [] and back[1].dev_curve == res.dev_curve
    assert list(load_results(path)["dev_curve"]) == [[], [[0, 0.1], [2, 0.3], [6, 0.5]]]  # the frame: as JSON


def test_a_pause_keeps_work_between_steps_out_of_the_phase_peak_and_in_the_runs():
    import numpy as np

    mib = 2**20
    peak = PeakMemory(cuda=False)
    if not peak.reset:
        pytest.skip("this kernel cannot reset the resident high-water mark")
    peak.start_phase()
    block = np.ones(40 * mib // 8)  # 40 MiB touched in a training step
    del block
    peak.pause_phase()
    block = np.ones(96 * mib // 8)  # 96 MiB touched while paused: an evaluation between steps
    del block
    peak.resume_phase()
    assert 32 * mib <= peak.phase_peak() < 64 * mib and peak.peak() >= 80 * mib
    peak.pause_phase()
    block = np.ones(96 * mib // 8)
    assert 32 * mib <= peak.phase_peak() < 64 * mib  # paused at the end: the phase ended before it


# ---- real 2-rank runs ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def curve_run():
    return stnb.run(stnb.TrainConfig(strategy="ddp", dev_points=2, learning_rate=1e-3, **CI), **FAST, echo=False)


def test_a_two_rank_run_gives_the_curve_at_the_trainers_eval_steps(curve_run):
    r = curve_run
    assert r.verified, r.reason
    assert [s for s, _ in r.dev_curve] == [0, 2, 4, 6]
    assert r.dev_curve[0] == (0, r.dev_metric_before) and r.dev_curve[-1] == (6, r.dev_metric_after)
    assert len({v for _, v in r.dev_curve}) > 1  # it moves (learning rate 1e-3)
    assert len(r.losses) == len(r.step_times) == 6  # one loss per step: no evaluation logged as one
    for rank in range(2):  # every rank evaluated at steps 2 and 4; the trained model once, after training
        assert r.outside_steps[rank]["work"]["evaluate"]["after_steps"] == [2, 4]
    again = stnb.RunResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again.dev_curve == r.dev_curve


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_a_sharded_model_is_evaluated_by_every_rank_during_training(strategy, curve_run):
    r = stnb.run(stnb.TrainConfig(strategy=strategy, dev_points=2, learning_rate=1e-3, **CI), **FAST, echo=False)
    assert r.verified, r.reason
    assert [s for s, _ in r.dev_curve] == [0, 2, 4, 6] and len(r.losses) == 6
    # the same data, seed and global batch as DDP: the same model at every point
    assert [v for _, v in r.dev_curve] == pytest.approx([v for _, v in curve_run.dev_curve], abs=1e-6)


class SlowHungryEvaluator(EmbeddingSimilarityEvaluator):
    """A user's evaluator that takes ``seconds`` and ``mib`` of memory each time it runs."""

    def __init__(self, *args, seconds: float, mib: int, **kw):
        super().__init__(*args, **kw)
        self.seconds, self.mib = seconds, mib

    def __call__(self, model, *args, **kw):
        import numpy as np

        block = np.ones(self.mib * 2**20 // 8)  # touched: resident
        time.sleep(self.seconds)
        del block
        return super().__call__(model, *args, **kw)


def build_evaluating(seconds: float, mib: int):
    """A user's trainer evaluating every 2 of its 6 steps (and, transformers' way, at the last one)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses

    model = SentenceTransformer(tiny_path(), device="cpu")
    train = Dataset.from_dict({"anchor": [f"what about {words(i)}" for i in range(64)],
                               "positive": [words(i) for i in range(64)]})
    dev = SlowHungryEvaluator([words(i) for i in range(8)], [words(i + 1) for i in range(8)], [i / 8 for i in range(8)],
                              name="mine", show_progress_bar=False, seconds=seconds, mib=mib)
    args = st_args(os.path.join(os.environ.get("TMPDIR", "/tmp"), "stnb-dev-curve"), max_steps=6,
                   eval_strategy="steps", eval_steps=2)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=train,
                                      loss=losses.MultipleNegativesRankingLoss(model),
                                      evaluator=dev)


def test_a_users_evaluations_stay_out_of_the_steps_times_and_peak():
    """Rank 0 runs the evaluator (sentence-transformers has the other ranks encode their share and wait); its
    1.5 s and 512 MiB are in no step's time and not in the training peak, only in the run's. glibc keeps
    freed blocks for reuse by default on CPU (``reuse_freed_memory``): a block the evaluator freed would stay
    resident, and so in the training steps' memory; off here, the evaluator's block goes back when freed."""
    seconds, mib = 1.5, 512
    r = stnb.run(functools.partial(build_evaluating, seconds, mib), strategy="ddp", reuse_freed_memory=False,
                 **FAST, echo=False)
    assert r.verified, r.reason
    assert r.dev_metric == "mine_spearman_cosine" and [s for s, _ in r.dev_curve] == [0, 2, 4, 6]
    assert r.dev_curve[0][1] == r.dev_metric_before and r.dev_curve[-1][1] == r.dev_metric_after
    assert len(r.losses) == 6
    for rank in range(2):
        work = r.outside_steps[rank]["work"]["evaluate"]
        assert work["after_steps"] == [2, 4, 6] and min(work["seconds"]) >= seconds
        split = r.time_split[rank]["steps"]
        assert max(st["data"] for st in split) < seconds  # the evaluation is in no step's data part
    assert max(r.step_times) < seconds  # ... nor in any step's time (the slowest rank's)
    assert r.peak_memory_bytes[0] < mib * 2**20 <= r.peak_memory_run_bytes[0]  # the run's peak only


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_a_sharded_users_trainer_that_evaluates_at_its_last_step_is_gathered_and_verified(strategy):
    """transformers evaluates at the last step too: a forward with no backward after it, which leaves the units
    that keep their gathered parameters after a forward holding them whole; the strategy reshards them
    after training (the digests and the gather to rank 0 failed on them: "Trying to resize storage that is
    not resizable")."""
    r = stnb.run(functools.partial(build_evaluating, 0.0, 1), strategy=strategy, **FAST, echo=False)
    assert r.verified, r.reason
    assert [s for s, _ in r.dev_curve] == [0, 2, 4, 6]
    assert r.outside_steps[0]["work"]["evaluate"]["after_steps"] == [2, 4, 6]
