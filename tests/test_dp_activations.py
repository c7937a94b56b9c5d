"""dp's replicas' activations in the memory split (issue 32 item 4.3, second half).

torch.nn.DataParallel runs each replica's forward in a thread of its own (``parallel_apply``), and autograd's
saved-tensor hooks (``saved_tensors_hooks``, what ``stnb.memsplit`` counts the activations with) are state of
the thread that entered them: the replicas' threads see none, so under ``dp`` the activations were not
counted at all.

On CPU DataParallel starts no threads (it just calls the module). Here torch's own DataParallel forward runs
with its threads: ``replicate``, ``parallel_apply`` and the feature gather are torch's and stnb's code; only
the copies between devices are replaced by copies on the CPU (``cpu_data_parallel``), and
``torch.accelerator`` answers "cpu" where ``parallel_apply`` asks for the accelerator.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from itertools import chain
from types import SimpleNamespace

import pytest
import torch
from torch.nn.parallel import _functions, comm, scatter_gather
from torch.nn.parallel.parallel_apply import parallel_apply as torch_parallel_apply

from stnb import strategies
from stnb.memory import PeakMemory
from stnb.memsplit import MemorySplit, in_replica_threads

# the module (torch.nn.parallel exports a function of that name)
data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")


def _broadcast_on_cpu(tensors, devices, buffer_size=None):
    """comm.broadcast_coalesced on the CPU: the first device's are the tensors themselves (as torch's are)."""
    return [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in devices[1:]]


def _broadcast_forward(ctx, target_gpus, *inputs):
    """torch.nn.parallel._functions.Broadcast.forward (torch 2.13) without its refusal of CPU tensors."""
    ctx.target_gpus, ctx.num_inputs, ctx.input_device = list(target_gpus), len(inputs), -1
    outputs = comm.broadcast_coalesced(inputs, ctx.target_gpus)
    ctx.mark_non_differentiable(*[out[i] for i, needs in enumerate(ctx.needs_input_grad[1:]) if not needs
                                  for out in outputs])
    return tuple(chain.from_iterable(outputs))


class _CpuScatter:
    """torch.nn.parallel._functions.Scatter on the CPU: the chunks as copies (one per device)."""

    @staticmethod
    def apply(target_gpus, chunk_sizes, dim, input):
        return tuple(c.clone() for c in input.chunk(len(target_gpus), dim))


class _CpuGather:
    @staticmethod
    def apply(target_device, dim, *tensors):
        return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in tensors], dim)


@pytest.fixture
def cpu_data_parallel(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "device_index", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(comm, "broadcast_coalesced", _broadcast_on_cpu)
    monkeypatch.setattr(_functions.Broadcast, "forward", staticmethod(_broadcast_forward))
    monkeypatch.setattr(scatter_gather, "Scatter", _CpuScatter)
    monkeypatch.setattr(scatter_gather, "Gather", _CpuGather)

    def over_two_devices(dp):
        """A DataParallel made without a GPU has no devices (and calls its module): set them as on 2 GPUs."""
        dp.device_ids, dp.output_device, dp.src_device_obj, dp.dim = [0, 1], 0, torch.device("cpu"), 0
        return dp

    return over_two_devices


def _counting(precision="no"):
    """A MemorySplit counting the activations of the forwards run inside ``trainer.compute_loss_context_manager``."""
    def stack():
        s = contextlib.ExitStack()
        if precision == "bf16":  # the Trainer's context, as accelerate's autocast would give it
            s.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        return s

    split = MemorySplit(PeakMemory(False))
    trainer = SimpleNamespace(compute_loss_context_manager=stack)
    split.watch_activations(trainer, forwards=10)
    return split, trainer


def test_saved_tensor_hooks_do_not_reach_dataparallels_replica_threads(cpu_data_parallel):
    """The prediction, with torch alone: hooks entered in this thread see what this thread's forward saves,
    nothing of a forward run in a ``threading.Thread`` or in ``parallel_apply``'s replica threads."""
    saved, threads = [], set()

    def pack(t):
        saved.append(t.numel())
        return t

    x = torch.ones(10, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.sin(x * 2)
        assert saved == [10]
        t = threading.Thread(target=lambda: torch.sin(x * 3))
        t.start()
        t.join()
        assert saved == [10]
        layer = torch.nn.Linear(4, 4)
        layer.register_forward_hook(lambda *a: threads.add(threading.current_thread()))
        out = torch_parallel_apply([layer, layer], [(torch.ones(2, 4),), (torch.ones(3, 4),)], None,
                                                  [0, 1])
        assert [o.shape[0] for o in out] == [2, 3]
        assert saved == [10]  # the two replicas each saved their input: neither seen
        assert len(threads) == 2 and threading.main_thread() not in threads
        torch_parallel_apply([layer], [(torch.ones(2, 4),)], None, [0])  # one replica: this thread
        assert saved == [10, 8]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _stnb_dp(dp, precision):
    """What stnb trains with under dp: the Trainer's DataParallel, rewrapped by the dp strategy's prepare."""
    trainer = SimpleNamespace(args=SimpleNamespace(fp16=False, bf16=precision == "bf16"),
                              _wrap_model=lambda m, training=True, dataloader=None: dp)
    strategies.get("dp").prepare(trainer, None, "cuda", 1)
    return trainer._wrap_model(dp.module)


def _one_thread(modules, inputs, kwargs_tup=None, devices=None):
    """torch's parallel_apply one replica at a time: each runs in the calling thread (its one-replica path)."""
    kwargs_tup = kwargs_tup or [{}] * len(modules)
    return [torch_parallel_apply([m], [i], [k], [d])[0]
            for m, i, k, d in zip(modules, inputs, kwargs_tup, devices)]


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_the_replicas_activations_are_counted_as_if_they_ran_in_one_thread(cpu_data_parallel, monkeypatch,
                                                                           precision):
    dp = cpu_data_parallel(_stnb_dp(cpu_data_parallel(torch.nn.DataParallel(_model())), precision))
    assert type(dp).__name__ == ("AutocastDataParallel" if precision == "bf16" else "FeatureDataParallel")
    x = torch.randn(6, 32)
    forwards = set()  # the threads the replicas' forwards ran in
    dp.module.register_forward_hook(lambda *a: forwards.add(threading.current_thread()))
    threaded, trainer = _counting(precision)
    with trainer.compute_loss_context_manager():
        out = dp(x)
    assert out.shape == (6, 8) and len(forwards) == 2 and threading.main_thread() not in forwards
    # the same DataParallel forward, its replicas run one after another in this thread
    monkeypatch.setattr(data_parallel, "parallel_apply", _one_thread)
    inline, trainer = _counting(precision)
    with trainer.compute_loss_context_manager():
        assert torch.allclose(dp(x), out)
    assert inline.activations > 6 * 64 * 2  # at least one hidden layer's output
    assert threaded.activations == inline.activations
    # the replicas' copies of the weights (torch's Broadcast, and autocast's casts of them) are not activations
    assert threaded.saved_params == inline.saved_params > 0
    assert threaded.weight_copies == inline.weight_copies
    assert (inline.weight_copies > 0) == (precision == "bf16")
    # and the count is what the module saves on the whole batch in one forward, but for the replicas' weights
    whole, trainer = _counting(precision)
    with trainer.compute_loss_context_manager():
        dp.module(x)
    assert whole.activations == inline.activations


def test_a_replica_run_in_this_thread_leaves_the_count_to_the_next_replicas():
    """One chunk (a batch smaller than the GPUs) runs its one replica in this thread, inside the forward counted
    here; the forward's next call of the model (a loss embeds each text column) still counts its replicas."""
    layer = torch.nn.Linear(4, 4)
    assert in_replica_threads([layer]) == [layer]  # no forward counted: the replicas as they are
    fresh = []  # in a thread that never counted one either
    t = threading.Thread(target=lambda: fresh.append(in_replica_threads([layer])))
    t.start()
    t.join()
    assert fresh == [[layer]]
    split, trainer = _counting()
    with trainer.compute_loss_context_manager():
        (first,) = in_replica_threads([layer])
        first(input=torch.ones(2, 4))  # DataParallel passes the scattered kwargs on
        (second,) = in_replica_threads([layer])
        assert second is not layer
        t = threading.Thread(target=second, kwargs={"input": torch.ones(3, 4)})
        t.start()
        t.join()
    assert split.activations == (2 + 3) * 4 * 4
    assert in_replica_threads([layer]) == [layer]  # the forward's count ends with it
