"""What fits (``stnb.fits``): the largest per-device batch each strategy trains under a per-rank memory budget, found
by real runs under the budget and reported with the next batch that ran out of memory; a budget below the model
state refused before any process starts, naming the strategies that would fit it."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pandas as pd
import pytest

import procs
import stnb
from stnb import ConfigError, LaunchError, TrainConfig, fits
from stnb.fits import PROBE, _search


class Made:
    """A strategy whose runs train up to ``limit`` (a made-up RunResult-like record) and run out of memory above
    it, with what a rank holds growing by ``per_sample`` bytes: the search's own logic, in process."""

    def __init__(self, limit, per_sample=2**20, base=2**30, budget_gib=2.0):
        self.limit, self.per_sample, self.base, self.budget_gib = limit, per_sample, base, budget_gib
        self.seen, self.refused = {}, ""

    def __call__(self, batch):
        if batch not in self.seen:
            self.seen[batch] = None if batch > self.limit else batch
        return self.seen[batch]

    def predicted(self):
        return None if self.seen.get(PROBE) is None else self.limit


@pytest.mark.parametrize("limit", [0, 1, 2, 7, 8, 9, 13, 100, 511, 512, 1000])
def test_the_search_ends_on_a_batch_that_trained_and_the_next_that_did_not(limit):
    t = Made(limit)
    largest, failed_at = _search(t, 512)
    if limit >= 512:  # nothing larger than max_batch is tried
        assert (largest, failed_at) == (512, None) and t.seen[512] == 512
    else:
        assert (largest, failed_at) == (limit, limit + 1)
        assert t.seen[failed_at] is None and (largest == 0 or t.seen[largest] == largest)
    assert all((b <= limit) == (r is not None) for b, r in t.seen.items())


def test_a_right_prediction_takes_few_runs_and_a_wrong_one_is_corrected_by_runs():
    right = Made(100)
    assert _search(right, 512) == (100, 101) and sorted(right.seen) == [1, PROBE, 100, 101]
    for guess in (300, 40, 101, 99):  # over, under, just over and just under: the runs bring it back
        wrong = Made(100)
        wrong.predicted = lambda: guess
        assert _search(wrong, 512) == (100, 101), guess
        assert guess in wrong.seen and len(wrong.seen) <= 14


class Ordered(Made):
    """Made, keeping the order of the runs, with a prediction given by the test (None: Made's, right)."""

    def __init__(self, limit, guess=None):
        super().__init__(limit)
        self.order, self.guess = [], guess

    def __call__(self, batch):
        if batch not in self.seen:
            self.order.append(batch)
        return super().__call__(batch)

    def predicted(self):
        return super().predicted() if self.guess is None else self.guess


@pytest.mark.parametrize("limit, guess, max_batch, runs", [
    (100, None, 512, [1, 8, 100, 101]),                       # batch 1, the probe, the prediction and its neighbour
    (100, 101, 512, [1, 8, 101, 100]),                        # one over: its neighbour below trained
    (100, 99, 512, [1, 8, 99, 100, 200, 150, 125, 112, 106, 103, 101]),   # one under, then up and halving the gap
    (100, 40, 512, [1, 8, 40, 41, 82, 164, 123, 102, 92, 97, 99, 100, 101]),
    (100, 300, 512, [1, 8, 300, 299, 153, 80, 116, 98, 107, 102, 100, 101]),  # over: its neighbour, then halving
    (100, 2, 512, [1, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101]),  # a prediction at or below the probe: unused
    (100, 512, 512, [1, 8, 512, 511, 259, 133, 70, 101, 85, 93, 97, 99, 100]),
    (5, None, 512, [1, 8, 4, 6, 5]),                          # the probe failed: between 1 and 8
    (0, None, 512, [1]),                                      # batch 1 failed: nothing more
    (600, None, 512, [1, 8, 16, 32, 64, 128, 256, 512]),      # a prediction past max_batch: doubling up to it
    (100, 102, 512, [1, 8, 102, 101, 54, 77, 89, 95, 98, 99, 100]),  # two over: both fail, then halving below them
    (100, 8, 512, [1, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101]),  # the probe itself: nothing new to try
    (8, 9, 512, [1, 8, 9]),                                   # one over the probe, which trained: the answer
    (100, None, 8, [1, 8]), (100, None, 4, [1, 2, 4]), (3, None, 4, [1, 2, 4, 3]), (100, None, 1, [1]),
])
def test_the_runs_follow_the_documented_plan(limit, guess, max_batch, runs):
    """Each run costs a launch: batch 1, the probe (when max_batch reaches it), the prediction and its neighbour,
    then doubling while batches train and halving the gap once one failed, in that order, and nothing twice."""
    t = Ordered(limit, guess)
    largest, failed_at = _search(t, max_batch)
    assert t.order == runs
    assert (largest, failed_at) == ((min(limit, max_batch), None) if limit >= max_batch else (limit, limit + 1))


def test_a_refusal_is_the_strategys_answer_with_the_first_line_of_its_reason():
    class Refused(Made):
        def __call__(self, batch):
            raise ConfigError("memory_budget_gib=0.02 is below the model state\n\nmore lines of detail")

    t = Refused(100)
    assert _search(t, 512) == (0, None)
    assert t.refused == "memory_budget_gib=0.02 is below the model state"


def test_the_budget_and_max_batch_are_checked_before_any_run():
    for bad in (0, -1, "2", True):
        with pytest.raises(ConfigError, match="budget_gib must be a number of GiB > 0"):
            fits(TrainConfig(model="tiny"), budget_gib=bad)
    with pytest.raises(ConfigError, match="max_batch must be an int >= 1"):
        fits(TrainConfig(model="tiny"), budget_gib=1.0, max_batch=0)


# ---- real runs: 2 gloo ranks (forked) ----------------------------------------------------------------------------

def build_long():
    """A user's own trainer: the tiny model on texts of 256 tokens (its max_seq_length), 3 steps, so that what a rank
    holds grows with the batch (about 6 MiB a sample here, against a runtime of about 1.6 GiB)."""
    import tempfile

    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses
    from sentence_transformers.training_args import SentenceTransformerTrainingArguments

    from stnb.models import resolve_model

    model = SentenceTransformer(resolve_model("tiny"), device="cpu")
    model.max_seq_length = 256
    words = ["river", "stone", "light", "garden", "window", "music", "paper", "winter", "market", "forest"]

    def text(i, k):
        return " ".join(words[(i * 7 + j * k) % len(words)] for j in range(300))

    data = Dataset.from_dict({"sentence1": [text(i, 3) for i in range(1024)],
                              "sentence2": [text(i, 5) for i in range(1024)],
                              "score": [(i % 5) / 4 for i in range(1024)]})
    # each trial saved 25 MB that no one read, then left an empty folder: nothing is saved, in one folder
    args = SentenceTransformerTrainingArguments(output_dir=os.path.join(tempfile.gettempdir(), "stnb-fits"),
                                                max_steps=3, per_device_train_batch_size=4, report_to=[],
                                                use_cpu=True, save_strategy="no")
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                      loss=losses.CosineSimilarityLoss(model))


RUN = dict(strategy="ddp", num_processes=2, echo=False)


def _batch(n):
    return {"override_args": {"per_device_train_batch_size": n}}


def test_the_largest_batch_found_trains_and_the_next_ran_out_of_memory():
    """The budget: what a rank held after batch 1 with no limit, plus 300 MiB. The answer is observed (the largest
    trained, the next ran out of memory) and holds when checked apart from the search: half of it trains under the
    budget, twice the batch that failed runs out of memory, and nothing is left running."""
    one = stnb.run(build_long, memory_budget_gib=16.0, **RUN, **_batch(1))
    held = max(v["memory_budget"]["held_at_end"] for v in one.verification["ranks"])
    gib = (held + 300 * 2**20) / 2**30
    table = fits(build_long, budget_gib=gib, strategies=["ddp"], num_processes=2, echo=False)
    row = table.iloc[0].to_dict()
    trials = table.attrs["trials"]["ddp"]
    assert row["strategy"] == "ddp" and row["ranks"] == 2, row
    assert PROBE < row["largest"] and row["failed_at"] == row["largest"] + 1, (row, trials)
    assert row["global_batch"] == 2 * row["largest"]
    assert trials[row["largest"]] == "trained" and trials[row["failed_at"]] == "out of memory", trials
    assert not pd.isna(row["predicted"]) and row["held_mib"] <= row["budget_mib"]
    assert row["samples_per_second"] > 0 and row["runs"] == len(trials) and row["note"] == ""
    r = stnb.run(build_long, memory_budget_gib=gib, **RUN, **_batch(row["largest"] // 2))
    assert r.verified, r.reason
    with pytest.raises(LaunchError) as e:
        stnb.run(build_long, memory_budget_gib=gib, **RUN, **_batch(2 * row["failed_at"]))
    assert e.value.kind == "out_of_memory", str(e.value)
    assert not procs.children()


def test_a_budget_below_the_model_state_is_a_refusal_row_and_one_below_the_runtime_fails_at_batch_1():
    """0.02 GiB: ddp's model state on 2 ranks does not fit (refused before any process, naming fsdp, whose state
    fits); fsdp starts, and its batch 1 runs out of memory (the runtime alone is about 1.6 GiB)."""
    before = procs.children()
    table = fits(TrainConfig(model="tiny", num_processes=2, train_size=64, dev_size=16), budget_gib=0.02,
                 strategies=["ddp", "fsdp"], echo=False)
    ddp, fsdp = (table.iloc[i].to_dict() for i in range(2))
    assert (ddp["largest"], ddp["runs"]) == (0, 0) and pd.isna(ddp["failed_at"]), ddp
    assert "below the model state one rank holds under strategy 'ddp'" in ddp["note"]
    assert "strategy='fsdp'" in ddp["note"].split("It fits under ")[1], ddp["note"]
    assert (fsdp["largest"], fsdp["failed_at"], fsdp["runs"]) == (0, 1, 1), fsdp
    assert fsdp["note"].startswith("batch 1 ran out of memory")
    assert table.attrs["trials"] == {"ddp": {}, "fsdp": {1: "out of memory"}}
    said = table.attrs["errors"]["fsdp"][1]                           # what the rank that ran out said
    assert "ran out of its memory budget, memory_budget_gib=0.02" in said and not table.attrs["errors"]["ddp"], said
    assert procs.children() == before


def test_by_default_every_multi_rank_strategy_that_runs_here_is_tried():
    from stnb.fits import _runnable

    names = _runnable(TrainConfig(model="tiny"), {})
    assert {"ddp", "zero1", "zero2", "fsdp"} <= set(names) and not {"single", "dp"} & set(names)  # CPU: dp is not
