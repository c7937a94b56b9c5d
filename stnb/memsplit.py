"""Where a rank's peak memory goes: ``memory_split``, measured in the rank, per rank in ``RunResult``.

A rank's peak (``PeakMemory``: CPU, the growth of its resident high-water mark over the resident size
when the rank began; CUDA, ``max_memory_allocated``) is split into parts that add up to it exactly.
Each part is either counted from tensors or the allocator, or a *residual* (what is left of a measured
amount once the counted parts are taken out); the residuals say so in their names (``_other``).

==========================  ===================================================================
key (bytes)                 what it is, how it is measured
==========================  ===================================================================
params                      the rank's parameters (a DTensor counts its local shard), counted
                            from the tensors after the first optimizer step (``memory.measure``)
grads                       their ``.grad`` tensors, same moment
optimizer_state             every tensor in the optimizer's state, same moment
allocator_free              memory glibc malloc holds *free* when training starts (``mallinfo2``
                            ``fordblks``) beyond what it held free when the rank began (a forked
                            rank inherits its parent's free heap): freed blocks kept for reuse,
                            e.g. a model freed after sharding. 0 where there is no glibc (or on CUDA)
before_steps_other          residual: resident growth when training starts minus ``params`` and
                            ``allocator_free``: the trainer, tokenizer, data, libraries loaded
                            since the rank began, DDP's buckets, anything else alive
activations                 tensors saved for the backward during one training forward (the largest
                            over the first steps), counted by ``saved_tensors_hooks``, one count per
                            storage, parameters (and gathered parameters, DataParallel's replicas of
                            them) and autocast's copies of them left out; DataParallel's replica
                            threads count too (``in_replica_threads``), on the peak's device only
during_steps_other          residual: the steps' peak minus what was resident when training started,
                            minus ``grads``, ``optimizer_state`` and ``activations``: communication
                            buffers (all-gathers, reduce-scatters, buckets), temporaries of the
                            forward, backward and optimizer, allocator fragmentation. Negative when
                            the steps reused memory that was resident (and free) before them
==========================  ===================================================================

Facts beside the split (not in the sum): ``baseline_rss`` (CPU: the resident size when the rank began,
Python + torch + the process group; the peak is growth over it), ``built`` (resident growth once the
trainer and the whole model were built), ``prepared`` (once the strategy prepared it: sharded, wrapped),
``unsharded_params_alive`` (bytes of the storages of the model's parameters as built that are still alive
once it was prepared, through weak references to the storages: a sharding strategy that keeps the model
as built alive shows it here, whatever holds it; DDP trains those very tensors),
``saved_params`` (the parameters and gathered parameters the forward saved for its backward),
``autocast_weight_copies`` (the low-precision copies of parameters autocast made and the forward saved for
its backward, under bf16 / fp16: memory the steps hold, in ``during_steps_other``, not activations).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from contextlib import contextmanager

SPLIT = ("params", "allocator_free", "before_steps_other", "grads", "optimizer_state", "activations",
         "during_steps_other")
RESIDUALS = ("before_steps_other", "during_steps_other")
FACTS = ("baseline_rss", "built", "prepared", "unsharded_params_alive", "saved_params", "autocast_weight_copies")
LABELS = {"params": "parameters", "grads": "gradients", "optimizer_state": "optimizer state",
          "allocator_free": "freed, kept by the allocator", "before_steps_other": "other, before the steps (residual)",
          "activations": "activations (saved for backward)",
          "during_steps_other": "other, during the steps (residual): buffers, temporaries"}


class mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def allocator_free() -> int:
    """Bytes glibc malloc holds free (``mallinfo2().fordblks``, every arena); 0 without glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return 0
    fn.restype = mallinfo2
    return int(fn().fordblks)


def resident(cuda: bool) -> int:
    import torch

    if cuda:
        return int(torch.cuda.memory_allocated())
    import psutil

    return psutil.Process().memory_info().rss


class MemorySplit:
    """Marks taken while a rank runs (``built``, ``prepared``, ``train_start``), the parameters' storages as
    built (``unsharded_params_alive``) and the activations of the training forwards."""

    def __init__(self, peak):
        self.peak = peak  # memory.PeakMemory: its base is the resident size when the rank began
        self.cuda = peak.cuda
        self.base = 0 if self.cuda else peak.base
        # free heap the rank already held when it began (a forked rank inherits its parent's, resident
        # or not): only what was freed since counts, like the resident size, as growth
        self.free_base = 0 if self.cuda else allocator_free()
        self.marks = {}
        self.built_params = []
        self.activations = 0
        self.saved_params = 0
        self.weight_copies = 0
        self.forwards_counted = 0

    def mark(self, name: str) -> None:
        self.marks[name] = resident(self.cuda) - self.base
        if name == "prepared":
            self.marks["unsharded_params_alive"] = self.unsharded_alive()
            self.built_params = []
        if name == "train_start":
            self.marks["allocator_free"] = 0 if self.cuda else max(0, allocator_free() - self.free_base)

    def remember_built(self, model) -> None:
        """Weak references to the storages of the parameters as built: after sharding, those still alive
        (held by any tensor: a parameter, a ``.data``, a view) are a full copy kept by someone."""
        from torch.multiprocessing.reductions import StorageWeakRef

        self.built_params = []
        for p in model.parameters():
            try:
                st = p.untyped_storage()
                self.built_params.append((StorageWeakRef(st), st.nbytes()))
            except (RuntimeError, NotImplementedError):  # already sharded (a DTensor) or without storage (meta)
                continue

    def unsharded_alive(self) -> int:
        """Bytes (as built) of the remembered storages that are still alive."""
        return sum(n for ref, n in self.built_params if not ref.expired())

    def watch_activations(self, trainer, forwards: int = 3) -> None:
        """Count the tensors saved for the backward in the first ``forwards`` training forwards."""
        import torch

        original = trainer.compute_loss_context_manager
        split = self

        def counting():
            stack = original()
            if split.forwards_counted >= forwards or not torch.is_grad_enabled():
                return stack
            count = SavedTensors(split.device())
            stack.enter_context(count.counting())
            stack.callback(split._counted, count.counts)
            return stack

        trainer.compute_loss_context_manager = counting

    def device(self):
        """The device whose memory the peak measures (CUDA: the current GPU, GPU 0 under dp), where the
        activations counted must lie."""
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")

    def _counted(self, counts: dict) -> None:
        self.forwards_counted += 1
        self.activations = max(self.activations, counts["activations"])
        self.saved_params = max(self.saved_params, counts["params"])
        self.weight_copies = max(self.weight_copies, counts["weight_copies"])

    def summary(self, state: dict, train_peak: int) -> dict:
        """The split (``SPLIT``: adds up to ``train_peak``) and the facts (``FACTS``), in bytes."""
        state = state or {}
        start = self.marks.get("train_start", 0)
        free = self.marks.get("allocator_free", 0)
        params, grads, opt = (int(state.get(k, 0)) for k in ("params", "grads", "optimizer_state"))
        out = {"params": params, "allocator_free": free, "before_steps_other": start - params - free,
               "grads": grads, "optimizer_state": opt, "activations": self.activations,
               "during_steps_other": train_peak - start - grads - opt - self.activations}
        out.update({"baseline_rss": self.base, "built": self.marks.get("built"),
                    "prepared": self.marks.get("prepared"),
                    "unsharded_params_alive": self.marks.get("unsharded_params_alive"),
                    "saved_params": self.saved_params, "autocast_weight_copies": self.weight_copies})
        return out


_this_thread = threading.local()  # .count: the SavedTensors counting the forward this thread runs, if any


class SavedTensors:
    """The bytes of the tensors one training forward saves for its backward, by kind (``counts``: activations,
    parameters, autocast's copies of parameters), one count per storage, on the device whose peak the split
    splits (a tensor on another GPU, a DataParallel replica's, is not in it).

    ``counting()`` enters the saved-tensor hook in this thread. The hooks are state of the thread that entered
    them, and torch.nn.DataParallel runs every replica's forward in a thread of its own: ``in_replica_threads``
    gives those threads the same count (so ``pack`` takes a lock)."""

    def __init__(self, device):
        self.device = device
        self.counts = {"activations": 0, "params": 0, "weight_copies": 0}
        self.seen = set()
        self.lock = threading.Lock()

    def pack(self, t):
        st = t.untyped_storage()
        if t.device == self.device and st.nbytes():
            kind = "params" if parameter(t) else "weight_copies" if weight_copy(t) else "activations"
            with self.lock:
                if st.data_ptr() not in self.seen:
                    self.seen.add(st.data_ptr())
                    self.counts[kind] += st.nbytes()
        return t

    @contextmanager
    def counting(self):
        """This thread's forward saves through ``pack``; ``in_replica_threads`` called here finds this count."""
        import torch

        outer = getattr(_this_thread, "count", None)
        _this_thread.count = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
                yield self
        finally:
            _this_thread.count = outer


def _unpack(t):
    return t


class _CountedReplica:
    """A replica's forward, run in its own thread, counted by the count of the thread that started it."""

    def __init__(self, replica, count: SavedTensors):
        self.replica, self.count = replica, count

    def __call__(self, *args, **kwargs):
        with self.count.counting():
            return self.replica(*args, **kwargs)


def in_replica_threads(replicas) -> list:
    """The replicas torch.nn.DataParallel is about to run in threads of their own (``parallel_apply``), each
    made to count what its forward saves into the forward this thread is counting (saved-tensor hooks are
    per thread: the replicas' were not counted at all); the replicas as they are when none is counted."""
    count = getattr(_this_thread, "count", None)
    return list(replicas) if count is None else [_CountedReplica(r, count) for r in replicas]


def parameter(t) -> bool:
    """Whether ``t`` (a tensor saved for backward) is a parameter, views one, or is a DataParallel replica's
    copy of one (``replicate`` broadcasts the parameters to the replicas: torch's ``Broadcast`` made it)."""
    import torch

    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or replicated(base.grad_fn)


def replicated(fn) -> bool:
    """Whether an autograd node is torch.nn.DataParallel's ``Broadcast`` of the parameters to its replicas."""
    from torch.nn.parallel._functions import Broadcast

    return getattr(type(fn), "_forward_cls", None) is Broadcast


def weight_copy(t) -> bool:
    """Whether ``t`` (a tensor saved for backward) is, or views, a copy autocast made of a parameter: its
    storage's tensor came from a dtype cast (``ToCopyBackward0``) of a parameter (its ``AccumulateGrad``)."""
    import torch

    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return False
    source = fn.next_functions[0][0]  # the parameter's AccumulateGrad, or a replica's Broadcast of it
    return isinstance(getattr(source, "variable", None), torch.nn.Parameter) or replicated(source)


def largest_rank(result) -> tuple | None:
    """(rank, its split, its peak) of the rank with the highest training peak; None without a split."""
    r = result.to_dict() if hasattr(result, "to_dict") else dict(result)
    ranked = [(rank, split, peak) for rank, (split, peak) in
              enumerate(zip(r.get("memory_split") or [], r.get("peak_memory_bytes") or [])) if split]
    return max(ranked, key=lambda x: x[2]) if ranked else None


def advice(result) -> str:
    """One sentence: what the highest rank's peak is made of, and what would shrink its largest part."""
    picked = largest_rank(result)
    if picked is None:
        return "No memory split in this run (recorded by an older stnb, or the run failed)."
    _, split, peak = picked
    mib = 2**20
    state = split["params"] + split["grads"] + split["optimizer_state"]
    rest = {k: split[k] for k in ("activations", "allocator_free", "before_steps_other", "during_steps_other")}
    top = max(rest, key=rest.get)
    fix = {"activations": "a smaller batch per device or shorter sequences (or activation checkpointing)",
           "allocator_free": "returning freed memory to the system before training (malloc_trim)",
           "before_steps_other": "a smaller dataset or tokenizer cache in the rank",
           "during_steps_other": "fewer or smaller communication buffers and temporaries (fewer blocks gathered at once, "
                                 "gradient_as_bucket_view for DDP)"}[top]
    return (f"Peak {peak / mib:,.0f} MiB: model state (parameters, gradients, optimizer) {state / mib:,.0f} MiB "
            f"({state / peak:.0%}); the largest other part is {LABELS[top]}, {rest[top] / mib:,.0f} MiB: {fix} "
            "would shrink it.") if peak else "The run measured no peak."

