"""dp: torch.nn.DataParallel in one process over every visible GPU.

The HF Trainer wraps the model itself when it sees ``n_gpu > 1``. It then skips accelerate's
``prepare``, where autocast lives, so stnb gives the replicas their autocast (``autocast_data_parallel``).
"""

from __future__ import annotations

import functools

from .base import Strategy, mixed_precision
from .stepcost import infeasible, step


class DataParallel(Strategy):
    name = "dp"
    label = "DataParallel"
    summary = "torch.nn.DataParallel: one process, the batch split across its GPUs"
    color = "#ff7f0e"
    distributed = False
    min_gpus = 2
    order = 20
    bench = True
    gpu_check = True
    miss_term = "host_fraction"

    def step_time(self, m, fab, n, host_fraction=None):
        """torch.nn.DataParallel, one process: every step it broadcasts the parameters from GPU 0 (replicate),
        runs the replicas side by side, reduces the gradients to GPU 0 and steps the optimizer there once; the
        one process loads n batches. All devices must be in one node. The GIL serialises the replicas' Python
        work: ``host_fraction`` (the share of a step the host is busy launching, e.g. 1 - GPU busy time from a
        trace) adds (n-1) x that share of forward+backward; None leaves it out (said in the assumptions).
        Every call of the model (``m.forward_calls``: one per text column the loss embeds) replicates the
        parameters again, and its backward reduces the gradients again."""
        per_node = fab.link.per_node
        if per_node is None or n > per_node:
            where = ("needs GPUs in one machine" if per_node is None
                     else f"holds at most {per_node} devices on {fab.link.name}")
            return infeasible(f"DataParallel is one process: it {where}")
        calls = m.forward_calls
        replicate, reduce = calls * fab.broadcast(m.param_bytes, n), calls * fab.broadcast(m.grad_bytes, n)
        host = 0.0 if host_fraction is None else (n - 1) * host_fraction * (m.forward + m.backward)
        seconds = replicate + m.forward + m.backward + reduce + host + m.optimizer + m.other * n
        return step(seconds, replicate + reduce, replicate + reduce)

    def devices(self, n_gpu):
        return max(1, n_gpu)

    def available(self, device, n_gpu, max_ranks, backend):
        if n_gpu >= self.min_gpus:
            return True, f"torch.nn.DataParallel over {n_gpu} GPUs in one process"
        return False, (f"DataParallel needs at least {self.min_gpus} CUDA GPUs in one process; "
                       f"this machine has {n_gpu}")

    def prepare(self, trainer, config, device_type, world):
        precision = mixed_precision(trainer.args)
        original = trainer._wrap_model

        def wrap_model(model, training=True, dataloader=None):
            wrapped = original(model, training=training, dataloader=dataloader)
            if wrapped is not model:  # newly wrapped here: the Trainer's DP path
                wrapped = feature_data_parallel(wrapped, precision)
            return wrapped

        trainer._wrap_model = wrap_model
        return {"info": {"dp_autocast": precision}, "overridden": {}}

    def check_prepared(self, trainer, world_size):
        import torch

        wrapped = trainer.model_wrapped
        if not isinstance(wrapped, torch.nn.DataParallel):
            return {}, [f"expected torch.nn.DataParallel, the trainer used {type(wrapped).__name__}"]
        problems = []
        if len(wrapped.device_ids) < 2:
            problems.append(f"DataParallel over {len(wrapped.device_ids)} device(s); needs >= 2")
        return {"device_ids": list(wrapped.device_ids)}, problems

    def check_ranks(self, rank_results, world_size):
        return {}, []


def gather_features(outputs, output_device, dim: int = 0):
    """DataParallel's gather of the replicas' outputs, keeping the values that are not tensors.

    sentence-transformers (6.2) passes ``modality`` (a str) and, with a prompt, ``prompt_length`` (an int)
    through the forward's feature dict. torch's ``gather`` treats any other value as a sequence: a str comes
    back as ``'<map object ...>'``, an int raises ``TypeError: 'int' object is not iterable``. Here a value
    that is not a tensor, the same on every replica (the batch's modality, its prompt's length), is kept
    as it is; tensors go through torch's own gather; replicas that disagree raise naming the key."""
    from torch.nn.parallel.scatter_gather import gather

    def walk(items, where):
        first = items[0]
        if isinstance(first, dict):
            return type(first)((k, walk([o[k] for o in items], f"{where}[{k!r}]")) for k in first)
        if isinstance(first, (list, tuple)) and not hasattr(first, "_fields") and not isinstance(first, str):
            return type(first)(walk(list(parts), f"{where}[{i}]") for i, parts in enumerate(zip(*items)))
        if first is None or _is_tensor(first) or hasattr(first, "_fields"):
            return gather(items, output_device, dim)
        if any(o != first for o in items):
            raise ValueError(f"DataParallel replicas returned different values for {where or 'the output'}: "
                             f"{items!r}; a value that is not a tensor must be the same on every replica")
        return first

    return walk(list(outputs), "")


def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def feature_data_parallel(dp, mixed_precision: str = "no"):
    """The trainer's torch.nn.DataParallel as stnb trains it: over the same module and devices, gathering
    the feature dict's non-tensor values (``gather_features``) and, for fp16 / bf16, with autocast in every
    replica (``autocast_data_parallel``)."""
    import torch

    if not isinstance(dp, torch.nn.DataParallel):
        return dp
    if mixed_precision in ("fp16", "bf16"):
        return autocast_data_parallel(dp, mixed_precision)
    return _rewrap(dp, _feature_dp_class())


def _rewrap(dp, cls):
    if not dp.device_ids:  # no accelerator: DataParallel just calls the module
        return cls(dp.module)
    return cls(dp.module, device_ids=dp.device_ids, output_device=dp.output_device, dim=dp.dim)


@functools.lru_cache(maxsize=None)
def _feature_dp_class():
    import torch

    from ..memsplit import in_replica_threads

    class FeatureDataParallel(torch.nn.DataParallel):
        """DataParallel that gathers sentence-transformers' feature dicts whole (``gather_features``), and whose
        replicas, each in a thread of its own, count what they save into the memory split's activations
        (``memsplit.in_replica_threads``: saved-tensor hooks are per thread)."""

        def gather(self, outputs, output_device):
            return gather_features(outputs, output_device, dim=getattr(self, "dim", 0))  # no devices: no dim

        def parallel_apply(self, replicas, inputs, kwargs):
            return super().parallel_apply(in_replica_threads(replicas), inputs, kwargs)

    return FeatureDataParallel


def autocast_data_parallel(dp, mixed_precision: str):
    """Give a torch.nn.DataParallel the autocast that the HF Trainer's DP path never applies.

    Why it is missing (transformers 5.23, accelerate 1.15): ``Trainer._wrap_model`` wraps the model
    in ``nn.DataParallel`` itself when ``args.n_gpu > 1``; the model is then "already wrapped", so
    ``_inner_training_loop`` skips ``accelerator.prepare(model)``, which is where accelerate patches
    autocast into ``model.forward``; and ``Trainer.autocast_smart_context_manager`` is a no-op
    ("We rely on accelerate for autocast"). So fp16/bf16 computed in fp32. An autocast around
    DataParallel's forward is not enough either: each replica runs in its own thread, where
    ``parallel_apply`` re-enters autocast without a dtype, and the autocast dtype is per thread
    (a bf16 run would compute in fp16). The replicas are therefore called inside their own autocast.
    Returns an AutocastDataParallel over the same module and devices (``dp`` itself without mixed precision)."""
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision)
    if dtype is None or not isinstance(dp, torch.nn.DataParallel):
        return dp
    wrapped = _rewrap(dp, _autocast_dp_class())
    wrapped.autocast_dtype = dtype
    return wrapped


@functools.lru_cache(maxsize=None)
def _autocast_dp_class():
    import torch

    class _AutocastReplica:
        def __init__(self, replica, device_type, dtype):
            self.replica, self.device_type, self.dtype = replica, device_type, dtype

        def __call__(self, *args, **kwargs):
            with torch.autocast(device_type=self.device_type, dtype=self.dtype):
                return self.replica(*args, **kwargs)

    class AutocastDataParallel(_feature_dp_class()):
        """DataParallel whose forward, and every replica in its worker thread, runs under autocast."""

        def _device_type(self):
            return self.src_device_obj.type if self.device_ids else "cpu"

        def forward(self, *inputs, **kwargs):
            with torch.autocast(device_type=self._device_type(), dtype=self.autocast_dtype):
                return super().forward(*inputs, **kwargs)

        def parallel_apply(self, replicas, inputs, kwargs):
            wrapped = [_AutocastReplica(r, self._device_type(), self.autocast_dtype) for r in replicas]
            return super().parallel_apply(wrapped, inputs, kwargs)

    return AutocastDataParallel
