"""Where a rank's peak memory went (stnb.memsplit), in one process: the marks against this process's resident
size, the storages kept alive after "sharding", the tensors a forward saves for its backward, the parts adding
up to the peak, the largest rank and its sentence. Real 2-rank runs (tests/test_memory.py, slow) check the
split of real ranks."""

import contextlib
import gc
from types import SimpleNamespace

import psutil
import pytest
import torch

from stnb.memory import PeakMemory
from stnb.memsplit import FACTS, LABELS, SPLIT, MemorySplit, advice, allocator_free, largest_rank

MIB = 2**20


def test_marks_are_resident_growth_over_the_ranks_beginning():
    split = MemorySplit(PeakMemory(False))
    assert split.base > 0 and not split.cuda and split.free_base >= 0
    split.base = psutil.Process().memory_info().rss - 64 * MIB  # as if the rank began 64 MiB ago
    split.mark("built")
    assert 32 * MIB < split.marks["built"] < 128 * MIB  # what grew since (64 MiB, give or take the allocator)
    assert set(split.marks) == {"built"}  # no other mark taken
    split.free_base = allocator_free() + 10**15  # freed heap it already held when it began does not count
    split.mark("train_start")
    assert split.marks["allocator_free"] == 0
    split.free_base = -10**9
    split.mark("train_start")
    assert split.marks["allocator_free"] >= 10**9


def test_on_cuda_the_marks_are_the_allocators_and_no_heap_is_counted():
    split = MemorySplit(SimpleNamespace(cuda=True, base=12345))
    assert split.cuda and split.base == 0 and split.free_base == 0
    assert split.marks == {} and split.built_params == [] and split.activations == split.saved_params == 0
    assert split.forwards_counted == 0


def test_the_models_storages_still_alive_after_preparing_are_counted_once_then_forgotten():
    split = MemorySplit(PeakMemory(False))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    whole = sum(p.numel() * 4 for p in model.parameters())
    split.remember_built(model)
    assert split.unsharded_alive() == whole
    kept = model[0].weight.data  # someone keeps one tensor of the model as built
    del model
    gc.collect()
    split.mark("prepared")
    assert split.marks["unsharded_params_alive"] == kept.numel() * 4
    assert split.built_params == []  # remembered only until the strategy prepared the model


def test_activations_are_the_tensors_a_training_forward_saves_parameters_apart():
    split = MemorySplit(PeakMemory(False))
    trainer = SimpleNamespace(compute_loss_context_manager=contextlib.ExitStack)
    split.watch_activations(trainer, forwards=2)
    w = torch.nn.Parameter(torch.ones(10, 10))
    x = torch.ones(100, requires_grad=True)

    def forward(n):
        with trainer.compute_loss_context_manager():
            a = x[:n] * 2          # mul by a number saves nothing of x
            b = torch.sin(a)       # saves a: n floats (a storage of its own)
            c = torch.sin(w[0])    # saves a view of the parameter: the parameter's storage, counted apart
            d = torch.cos(b)       # saves b
            return d.sum() + c.sum()

    forward(50).backward()
    assert split.forwards_counted == 1
    assert split.activations == 2 * 50 * 4 and split.saved_params == 100 * 4
    forward(10)  # smaller: the largest stays
    assert split.forwards_counted == 2 and split.activations == 2 * 50 * 4
    forward(100)  # past the forwards watched: not counted
    assert split.forwards_counted == 2 and split.activations == 2 * 50 * 4
    other = MemorySplit(PeakMemory(False))
    other.watch_activations(trainer)
    with torch.no_grad():  # evaluation: nothing saved, nothing counted
        with trainer.compute_loss_context_manager():
            torch.sin(x)
    assert other.forwards_counted == 0
    for _ in range(3):
        with trainer.compute_loss_context_manager():
            torch.sin(x * 2)
    assert other.forwards_counted == 3 and other.activations == 100 * 4  # the default: 3 forwards
    with trainer.compute_loss_context_manager():
        torch.sin(x * 3)
    assert other.forwards_counted == 3


def test_autocasts_copies_of_the_weights_are_not_activations():
    """Issue 32 item 4.3: under bf16 / fp16 autocast casts each weight to a low-precision copy and the forward
    saves it (as a transposed view) for the input's gradient; it was counted as activations. Two 512 x 512
    layers, one input row: the activations are a few rows, the copy of the second layer's weight 512 KiB."""
    split = MemorySplit(PeakMemory(False))

    def autocast_stack():
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        return stack

    trainer = SimpleNamespace(compute_loss_context_manager=autocast_stack)
    split.watch_activations(trainer)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    with trainer.compute_loss_context_manager():
        model(torch.ones(1, 512)).float().sum().backward()
    assert split.weight_copies == 512 * 512 * 2  # the second layer's weight, in bf16 (the first's: input needs no grad)
    assert split.activations == 2 * 512 * 2  # the two layers' inputs, one bf16 row each
    assert split.saved_params == 0
    # without autocast: the weights themselves are saved (parameters), no copy; the second layer's input came
    # from the first layer's addmm, whose first input is a parameter (the bias): an activation all the same
    fp32 = MemorySplit(PeakMemory(False))
    trainer = SimpleNamespace(compute_loss_context_manager=contextlib.ExitStack)
    fp32.watch_activations(trainer)
    with trainer.compute_loss_context_manager():
        model(torch.ones(1, 512)).sum().backward()
    assert (fp32.weight_copies, fp32.activations, fp32.saved_params) == (0, 2 * 512 * 4, 512 * 512 * 4)


def test_a_tensor_saved_on_another_device_is_not_in_this_ranks_split():
    """Under dp on CUDA the peak split is GPU 0's (``max_memory_allocated`` of the current device): what a replica
    saves on another GPU is not in it. The meta device stands for the other GPU here."""
    split = MemorySplit(PeakMemory(False))
    trainer = SimpleNamespace(compute_loss_context_manager=contextlib.ExitStack)
    split.watch_activations(trainer)
    with trainer.compute_loss_context_manager():
        torch.sin(torch.ones(64, requires_grad=True) * 2)
        torch.sin(torch.ones(1000, device="meta", requires_grad=True) * 2)
    assert split.activations == 64 * 4


def test_on_cuda_the_activations_counted_are_those_on_the_current_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert MemorySplit(SimpleNamespace(cuda=True, base=0)).device() == torch.device("cuda", 1)
    assert MemorySplit(PeakMemory(False)).device() == torch.device("cpu")


def test_the_parts_add_up_to_the_peak_and_the_residuals_are_what_is_left():
    split = MemorySplit(SimpleNamespace(cuda=True, base=0))
    split.marks = {"built": 50, "prepared": 40, "unsharded_params_alive": 7, "train_start": 100, "allocator_free": 9}
    split.activations, split.saved_params, split.weight_copies = 30, 11, 5
    state = {"params": 60, "grads": 60, "optimizer_state": 120}
    out = split.summary(state, train_peak=400)
    assert sum(out[k] for k in SPLIT) == 400
    assert out["before_steps_other"] == 100 - 60 - 9  # resident at the start, less params and freed heap
    assert out["during_steps_other"] == 400 - 100 - 60 - 120 - 30
    assert (out["params"], out["grads"], out["optimizer_state"], out["activations"]) == (60, 60, 120, 30)
    assert out["allocator_free"] == 9
    assert {k: out[k] for k in FACTS} == {"baseline_rss": 0, "built": 50, "prepared": 40,
                                          "unsharded_params_alive": 7, "saved_params": 11,
                                          "autocast_weight_copies": 5}
    empty = MemorySplit(SimpleNamespace(cuda=True, base=0)).summary(None, train_peak=5)
    assert empty["during_steps_other"] == 5 and sum(empty[k] for k in SPLIT) == 5
    assert empty["built"] is None and empty["before_steps_other"] == 0


def _run(*ranks):
    return {"memory_split": [r[0] for r in ranks], "peak_memory_bytes": [r[1] for r in ranks]}


def _split(**parts):
    base = dict.fromkeys(SPLIT, 0)
    base.update(parts)
    return base


def test_the_largest_rank_is_the_highest_peak_among_those_with_a_split():
    a, b, c = _split(params=1), _split(params=2), _split(params=3)
    assert largest_rank(_run((a, 10), (b, 30), (c, 20))) == (1, b, 30)
    assert largest_rank(_run((a, 10), ({}, 99), (c, 20))) == (2, c, 20)  # a rank without a split is skipped
    assert largest_rank(_run(({}, 5), (None, 7))) is None
    assert largest_rank({}) is None

    class Result:
        def to_dict(self):
            return _run((a, 3))

    assert largest_rank(Result()) == (0, a, 3)


@pytest.mark.parametrize("top,fix", [
    ("activations", "a smaller batch per device or shorter sequences (or activation checkpointing)"),
    ("allocator_free", "returning freed memory to the system before training (malloc_trim)"),
    ("before_steps_other", "a smaller dataset or tokenizer cache in the rank"),
    ("during_steps_other", "fewer or smaller communication buffers and temporaries (fewer blocks gathered at once, "
                           "gradient_as_bucket_view for DDP)"),
])
def test_advice_names_the_largest_part_besides_the_model_state_and_its_fix(top, fix):
    parts = {"params": 100 * MIB, "grads": 100 * MIB, "optimizer_state": 200 * MIB,
             "activations": 50 * MIB, "allocator_free": 40 * MIB, "before_steps_other": 30 * MIB,
             "during_steps_other": 20 * MIB}
    parts[top] = 500 * MIB  # the largest of the rest, still below the model state's 400 MiB + it
    peak = sum(parts.values())
    small = _split(params=MIB)
    sentence = advice(_run((small, 2 * MIB), (_split(**parts), peak)))
    assert sentence == (f"Peak {peak / MIB:,.0f} MiB: model state (parameters, gradients, optimizer) 400 MiB "
                        f"({400 * MIB / peak:.0%}); the largest other part is {LABELS[top]}, 500 MiB: {fix} "
                        "would shrink it.")


def test_advice_without_a_split_or_a_peak_says_so():
    assert advice({"memory_split": [], "peak_memory_bytes": []}).startswith("No memory split in this run")
    assert advice(_run((_split(params=1), 0))) == "The run measured no peak."
    one = advice(_run((_split(params=3 * MIB, activations=MIB), 4 * MIB)))
    assert one.startswith("Peak 4 MiB: model state (parameters, gradients, optimizer) 3 MiB (75%)")
    assert "activations (saved for backward), 1 MiB" in one


def test_a_storage_saved_twice_counts_once():
    split = MemorySplit(PeakMemory(False))
    trainer = SimpleNamespace(compute_loss_context_manager=contextlib.ExitStack)
    split.watch_activations(trainer)
    x = torch.ones(64, requires_grad=True)
    with trainer.compute_loss_context_manager():
        a = x * 2
        torch.sin(a) + torch.cos(a) + torch.exp(a * 3)  # a saved by sin and by cos; exp saves its output
    assert split.activations == 2 * 64 * 4


def test_a_rank_on_cuda_marks_the_allocators_bytes_and_no_freed_heap():
    split = MemorySplit(SimpleNamespace(cuda=True, base=12345))
    split.mark("built")
    split.mark("train_start")
    assert split.marks == {"built": torch.cuda.memory_allocated(), "train_start": torch.cuda.memory_allocated(),
                           "allocator_free": 0}
    cpu = MemorySplit(PeakMemory(False))
    assert cpu.free_base > 0  # the heap glibc already held free when the rank began


def test_parameters_without_a_storage_of_their_own_are_skipped_not_the_rest():
    split = MemorySplit(PeakMemory(False))
    model = torch.nn.Module()
    model.sparse = torch.nn.Parameter(torch.sparse_coo_tensor([[0]], [1.0], (3,)))  # no storage to remember
    model.dense = torch.nn.Parameter(torch.ones(5))
    split.remember_built(model)
    assert split.unsharded_alive() == 5 * 4
