"""A memory budget per rank (``memory_budget_gib``, stnb.budget): refused before any rank starts when it cannot hold
the predicted model state; enforced in every rank (CPU: RLIMIT_DATA), a rank past it failing as out of memory,
named with the budget, the prediction, what it measured and what would fit, and nothing left running."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

import procs
import stnb
from stnb import ConfigError, LaunchError, TrainConfig, budget, memory
from stnb.errors import OutOfMemory, failure_kind

MIB = 2**20
#: spawned ranks: what a rank holds when its budget is applied is then its own runtime's, not also whatever this
#: test process had mapped before forking (which depends on the tests that ran before in it)
TINY = dict(model="tiny", num_processes=2, steps=4, train_size=64, dev_size=16, evaluate=False, stall_timeout=60.0,
            start_method="spawn")


def _mib(n):
    return f"{n / MIB:,.1f} MiB"


@pytest.fixture(scope="module")
def tiny_params():
    """The tiny model's parameter count, counted from the model as sentence-transformers loads it."""
    from sentence_transformers import SentenceTransformer

    from stnb.models import resolve_model

    model = SentenceTransformer(resolve_model("tiny"), device="cpu")
    return sum(p.numel() for p in model.parameters())


def test_the_budget_is_a_positive_number_of_gib():
    for bad in (0, -1.0, "2", True):
        with pytest.raises(ConfigError, match=r"memory_budget_gib must be a number > 0, got "):
            TrainConfig(memory_budget_gib=bad).validate(check_resources=False)
    assert TrainConfig(memory_budget_gib=0.5).validate(check_resources=False).memory_budget_gib == 0.5
    assert "memory_budget_gib" in TrainConfig.for_build(memory_budget_gib=1).to_dict()  # a build function takes it


def test_the_command_line_takes_it():
    import argparse

    from stnb.cli_options import add_run_options, config_from_args

    parser = argparse.ArgumentParser()
    add_run_options(parser)
    assert config_from_args(parser.parse_args(["--memory-budget-gib", "1.5"])).memory_budget_gib == 1.5
    assert config_from_args(parser.parse_args([])).memory_budget_gib is None


def test_the_model_folder_gives_the_prediction_without_loading_it(tiny_params):
    from stnb.models import resolve_model

    shape = budget.shape_from_files(resolve_model("tiny"))
    assert shape == {"param_count": tiny_params, "trainable_param_count": tiny_params, "bytes_per_param": 4,
                     "optimizer": "adamw"}


def test_a_budget_below_the_model_state_is_refused_before_any_rank_starts_word_for_word(tiny_params):
    """ddp's state on 2 ranks does not fit 0.02 GiB; fsdp's (every part halved) does, and the refusal says so."""
    ddp = memory.predict("ddp", tiny_params, 2)
    fsdp = memory.predict("fsdp", tiny_params, 2)["total"]
    limit = int(0.02 * 2**30)
    assert fsdp <= limit < ddp["total"]  # the case this test is about
    fits = [(name, memory.predict(name, tiny_params, 2)["total"]) for name in ("zero1", "zero2", "fsdp", "deepspeed")
            if stnb.hardware.strategy_availability("cpu")[name]["runnable"]
            and memory.predict(name, tiny_params, 2)["total"] <= limit]
    before = procs.children()
    with pytest.raises(ConfigError) as e:
        stnb.run(TrainConfig(strategy="ddp", memory_budget_gib=0.02, **TINY), echo=False)
    assert str(e.value) == (
        f"memory_budget_gib=0.02 ({_mib(limit)} per rank) is below the model state one rank holds under strategy "
        f"'ddp' on 2 rank(s): stnb.memory.predict says {_mib(ddp['total'])} (params {_mib(ddp['params'])}, grads "
        f"{_mib(ddp['grads'])}, optimizer_state {_mib(ddp['optimizer_state'])}, ddp_buckets "
        f"{_mib(ddp['ddp_buckets'])}), and activations and the runtime (Python, torch) come on top. It fits under "
        + ", ".join(f"strategy={name!r} ({_mib(t)} per rank on 2)" for name, t in fits)
        + "; or raise memory_budget_gib.")
    assert ("fsdp", fsdp) in fits
    assert procs.children() == before  # nothing started


def test_a_budget_no_strategy_fits_on_these_ranks_names_how_many_would(tiny_params):
    limit = int(0.005 * 2**30)
    with pytest.raises(ConfigError) as e:
        stnb.run(TrainConfig(strategy="fsdp", memory_budget_gib=0.005, **TINY), echo=False)
    msg = str(e.value)
    assert "No strategy fits it on 2 rank(s); with more ranks, " in msg
    assert msg.endswith("; or raise memory_budget_gib.")
    n = int(msg.split("strategy='fsdp' from num_processes=")[1].split(",")[0].split(";")[0])
    fsdp = [memory.predict("fsdp", tiny_params, k)["total"] for k in (n - 1, n)]
    assert fsdp[1] <= limit < fsdp[0]  # the fewest ranks it fits on


def test_what_counts_as_running_out_of_memory():
    assert budget.out_of_memory(MemoryError())
    assert budget.out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: "
                                             "can't allocate memory: you tried to allocate 1048576 bytes."))
    try:
        try:
            raise MemoryError()
        except MemoryError:
            raise ValueError("a library's own error while handling it")
    except ValueError as e:
        assert budget.out_of_memory(e)  # raised while handling one
    assert not budget.out_of_memory(RuntimeError("shape mismatch"))
    assert budget._asked(RuntimeError("you tried to allocate 1048576 bytes.")) == "an allocation of 1.0 MiB failed"
    assert budget._asked(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")) == \
        "an allocation of 20.0 MiB failed"
    assert [failure_kind(t) for t in ("OutOfMemory", "OutOfMemoryError", "MemoryError", "RuntimeError")] == \
        ["out_of_memory"] * 3 + ["raised"]
    assert isinstance(OutOfMemory("x"), MemoryError)


# ---- real runs: 2 gloo ranks of the tiny model -------------------------------------------------------------

@pytest.fixture(scope="module")
def roomy():
    """A run under a budget far above what a rank uses: its record says what each rank held."""
    return stnb.run(TrainConfig(strategy="ddp", memory_budget_gib=16.0, **TINY), echo=False)


def test_under_the_budget_the_run_trains_verified_with_the_limit_in_every_rank(roomy):
    assert roomy.verified, roomy.reason
    for v in roomy.verification["ranks"]:
        b = v["memory_budget"]
        assert b["limit_bytes"] == 16 * 2**30 and "RLIMIT_DATA" in b["how"]
        assert 0 < b["held_at_start"] < b["limit_bytes"] and 0 < b["held_at_end"] < b["limit_bytes"]
    assert not procs.children()


def test_a_tight_budget_that_still_holds_the_run_trains(roomy):
    """A budget with room for what each rank held at its end and as much again: trains, verified."""
    held = max(v["memory_budget"]["held_at_end"] for v in roomy.verification["ranks"])
    start = min(v["memory_budget"]["held_at_start"] for v in roomy.verification["ranks"])
    gib = (held + (held - start)) / 2**30
    r = stnb.run(TrainConfig(strategy="ddp", memory_budget_gib=gib, **TINY), echo=False)
    assert r.verified, r.reason
    assert all(v["memory_budget"]["held_at_end"] <= v["memory_budget"]["limit_bytes"]
               for v in r.verification["ranks"])
    assert not procs.children()


def test_over_the_budget_a_rank_fails_as_out_of_memory_named_and_nothing_is_left_running(roomy, tiny_params):
    """A budget 16 MiB above what a rank held when the budget was applied (its runtime): too little to build and
    train even the tiny model (an unlimited run's ranks grew by far more), so the rank fails, as out of memory.
    (Halfway to what the unlimited run held at its end was not enough: with room, the allocator keeps more.)"""
    ranks = roomy.verification["ranks"]
    start = max(v["memory_budget"]["held_at_start"] for v in ranks)
    end = min(v["memory_budget"]["held_at_end"] for v in ranks)
    assert end - start > 4 * 16 * 2**20, (start, end)  # the unlimited run grew well past the budget's room
    gib = round((start + 16 * 2**20) / 2**30, 4)
    with pytest.raises(LaunchError) as e:
        stnb.run(TrainConfig(strategy="ddp", memory_budget_gib=gib, **TINY), echo=False)
    err = e.value
    assert err.kind == "out_of_memory", str(err)
    assert err.rank in (0, 1)
    msg = str(err)
    assert f"rank {err.rank} raised OutOfMemory: rank {err.rank} ran out of its memory budget, " \
           f"memory_budget_gib={gib:g} ({_mib(int(gib * 2**30))}, the whole rank process" in msg
    said = msg.split("What would fit: ")[0]
    if "before its model was built" not in said:  # the prediction, when the model was built
        assert f"is {_mib(memory.predict('ddp', tiny_params, 2)['total'])} of model state per rank" in said
    assert "its measured peak was " in said
    assert "What would fit: " in msg and "a larger memory_budget_gib" in msg
    if "before its model was built" not in said:  # sharding is offered where the prediction says it fits
        assert "strategy='fsdp'" in msg
    assert not procs.children()


def test_a_budget_below_what_the_runtime_holds_fails_as_out_of_memory_saying_so(roomy):
    """The budget covers the whole rank process, the runtime included: half of what a rank held when the budget was
    applied (Python, torch, the libraries; far above the tiny model's state, so not refused before launch)."""
    start = min(v["memory_budget"]["held_at_start"] for v in roomy.verification["ranks"])
    gib = round(start / 2 / 2**30, 4)
    with pytest.raises(LaunchError) as e:
        stnb.run(TrainConfig(strategy="ddp", memory_budget_gib=gib, **TINY), echo=False)
    assert e.value.kind == "out_of_memory" and e.value.rank in (0, 1), str(e.value)
    assert f"memory_budget_gib={gib:g}" in str(e.value)
    assert "already when the budget was applied, before its model was built: the runtime" in str(e.value)
    assert not procs.children()


def build_tiny():
    """A user's own trainer: the tiny model, 64 scored pairs, batch 16, 4 steps."""
    import tempfile

    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses
    from sentence_transformers.training_args import SentenceTransformerTrainingArguments

    from stnb.models import resolve_model

    model = SentenceTransformer(resolve_model("tiny"), device="cpu")
    data = Dataset.from_dict({"sentence1": [f"a sentence {i}" for i in range(64)],
                              "sentence2": [f"another sentence {i}" for i in range(64)],
                              "score": [(i % 5) / 4 for i in range(64)]})
    # nothing is saved (each run left a 12 MB checkpoint in /tmp): the folder is one, shared by every run
    args = SentenceTransformerTrainingArguments(output_dir=os.path.join(tempfile.gettempdir(), "stnb-budget"),
                                                max_steps=4, per_device_train_batch_size=16, report_to=[],
                                                use_cpu=True, save_strategy="no")
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                      loss=losses.CosineSimilarityLoss(model))


def test_a_build_function_over_its_budget_fails_as_out_of_memory_and_under_it_trains(roomy):
    """The budget applies to a user's own trainer too (stnb.run(build, memory_budget_gib=...)): half the runtime
    fails as out of memory, 16 GiB trains verified with the limit in every rank."""
    start = min(v["memory_budget"]["held_at_start"] for v in roomy.verification["ranks"])
    gib = round(start / 2 / 2**30, 4)
    with pytest.raises(LaunchError) as e:
        stnb.run(build_tiny, strategy="ddp", num_processes=2, memory_budget_gib=gib, echo=False)
    assert e.value.kind == "out_of_memory", str(e.value)
    assert f"ran out of its memory budget, memory_budget_gib={gib:g}" in str(e.value)
    assert not procs.children()
    r = stnb.run(build_tiny, strategy="ddp", num_processes=2, memory_budget_gib=16.0, echo=False)
    assert r.verified, r.reason
    assert all(v["memory_budget"]["limit_bytes"] == 16 * 2**30 for v in r.verification["ranks"])
