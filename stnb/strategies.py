"""How each strategy prepares the model, and how each is verified after preparation.

single  one device, no wrapper.
dp      torch.nn.DataParallel in one process over every visible GPU (the HF Trainer wraps
        the model itself when it sees n_gpu > 1).
ddp     DistributedDataParallel, one process per device (the Trainer wraps it through
        accelerate); stnb passes its DDP knobs through accelerate's DistributedDataParallelKwargs.
fsdp    FSDP2 ``fully_shard``: each transformer block and then the root are sharded by stnb
        *before* the Trainer sees the model. accelerate ignores FSDP settings on CPU and
        silently runs DDP; stnb does not rely on them. The model is marked as owning its
        placement and gradient reduction (``is_distributed_loading_by_transformers``), the
        Trainer's contract for models sharded before training, so the Trainer neither moves
        nor re-wraps it. Verification checks every parameter is a shard of about 1/N.
"""

from __future__ import annotations

import functools

from .errors import VerificationError

FSDP_SHARD_TOLERANCE = 0.05  # local fraction may exceed 1/N by this much (uneven splits)


def local_numel(p) -> int:
    from torch.distributed.tensor import DTensor

    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def tensor_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def param_counts(model) -> tuple[int, int]:
    """(local, total) parameter counts; they differ only when the model is sharded."""
    total = local = 0
    for p in model.parameters():
        total += p.numel()
        local += local_numel(p)
    return local, total


def shard_fsdp(model, device: str, world_size: int, layer_cls: str | None = None,
               reshard_after_forward: bool = True, mixed_precision: str = "no") -> dict:
    """Apply FSDP2 fully_shard to each transformer block, then to the root. Returns details."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .models import layer_classes

    classes = tuple(layer_classes(model, layer_cls))
    mesh = init_device_mesh(device, (world_size,))
    mp = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mixed_precision == "fp16":
        mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    wrapped = 0
    for m in list(model.modules()):
        if isinstance(m, classes):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
            wrapped += 1
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # Trainer contract for models that own their placement and gradient reduction
    model.is_distributed_loading_by_transformers = True
    return {"wrapped_layer_class": [c.__name__ for c in classes], "wrapped_layers": wrapped,
            "reshard_after_forward": reshard_after_forward}


def verify(strategy: str, wrapped, model, world_size_expected: int, n_gpu: int = 0, world: dict | None = None) -> dict:
    """Check that the prepared model is what `strategy` promises. Raises VerificationError.

    world_size_expected: the world size the caller *requested* (num_processes x num_nodes, passed
    in from the config, never read back from the launcher's environment). It is compared with
    ``world``, this rank's process group as observed from inside (``checks.observe_world()``; a
    collective, so every rank calls verify at the same point). FSDP fractions come from each
    parameter's local shard (``DTensor.to_local()``).
    """
    import torch
    import torch.distributed as dist

    from .checks import observe_world, world_problems

    world = world if world is not None else observe_world()
    local, total = param_counts(model)
    info = {
        "wrapper": type(wrapped).__name__,
        "world_size_requested": world_size_expected,
        "world_size_seen": world["process_group_size"],
        "processes_seen": world["processes"],
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "local_param_count": local,
        "total_param_count": total,
        "local_param_fraction": local / total if total else None,
    }
    problems = world_problems(world_size_expected, world)
    if strategy == "single":
        if isinstance(wrapped, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            problems.append(f"single run was wrapped in {type(wrapped).__name__}")
    elif strategy == "dp":
        if not isinstance(wrapped, torch.nn.DataParallel):
            problems.append(f"expected torch.nn.DataParallel, the trainer used {type(wrapped).__name__}")
        else:
            info["device_ids"] = list(wrapped.device_ids)
            if len(wrapped.device_ids) < 2:
                problems.append(f"DataParallel over {len(wrapped.device_ids)} device(s); needs >= 2")
    elif strategy == "ddp":
        if not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            problems.append(f"expected DistributedDataParallel, the trainer used {type(wrapped).__name__}")
    elif strategy == "fsdp":
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            problems.append("the model was wrapped in DistributedDataParallel: FSDP silently became DDP")
        if not isinstance(model, FSDPModule):
            problems.append(f"root module is {type(model).__name__}, not an FSDP2 module (fully_shard)")
        not_sharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        if not_sharded:
            problems.append(f"{len(not_sharded)} parameter(s) are not sharded, e.g. {not_sharded[:3]}")
        ideal = 1.0 / world_size_expected
        info["ideal_fraction"] = ideal
        if total and local / total > ideal + FSDP_SHARD_TOLERANCE:
            problems.append(f"rank holds {local / total:.3f} of the parameters; sharded over "
                            f"{world_size_expected} ranks it should hold about {ideal:.3f}")
    info["problems"] = problems
    info["ok"] = not problems
    if problems:
        raise VerificationError(f"strategy {strategy!r} failed verification: " + "; ".join(problems))
    return info


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
    if not dp.device_ids:  # no accelerator: DataParallel just calls the module
        wrapped = _autocast_dp_class()(dp.module)
    else:
        wrapped = _autocast_dp_class()(dp.module, device_ids=dp.device_ids, output_device=dp.output_device,
                                       dim=dp.dim)
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

    class AutocastDataParallel(torch.nn.DataParallel):
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


def freeze_unused_pooler(model) -> list:
    """Freeze the HF pooler layer that sentence-transformers never uses.

    BertModel computes a [CLS] pooler output, but sentence-transformers pools token
    embeddings itself, so the pooler's weights never get a gradient. DDP without
    find_unused_parameters then fails ("Expected to have finished reduction..."), and with
    it pays a graph traversal every step. Freezing the pooler changes nothing in training
    and lets every strategy run the same model. Returns the frozen modules' names.
    """
    import torch

    frozen = []
    for name, module in model.named_modules():
        pooler = getattr(module, "pooler", None)
        if isinstance(pooler, torch.nn.Module) and any(p.requires_grad for p in pooler.parameters()):
            for p in pooler.parameters():
                p.requires_grad_(False)
            frozen.append(f"{name}.pooler" if name else "pooler")
    return frozen


def ddp_kwargs(config) -> dict:
    """accelerate DistributedDataParallelKwargs from a TrainConfig's DDP knobs."""
    from accelerate.utils import DDPCommunicationHookType

    kw = {
        "find_unused_parameters": bool(config.extra.get("find_unused_parameters", False)),
        # broadcast_buffers=False skips DDP's broadcast of module buffers from rank 0 at every
        # forward (a collective, and a point where the ranks wait for each other, per micro-batch).
        # BERT's buffers (position_ids, token_type_ids) never change, so skipping it changes nothing else.
        "broadcast_buffers": bool(config.broadcast_buffers),
        "gradient_as_bucket_view": bool(config.gradient_as_bucket_view),
        "static_graph": bool(config.static_graph),
        # 'embedding_rows' is stnb's own hook (stnb.embedding_rows_hook), registered on the prepared model by the runner
        # stnb registers config.comm_hook itself, timed (stnb.timesplit), at the first step
        "comm_hook": DDPCommunicationHookType.NO,
    }
    if config.bucket_cap_mb:
        cap = config.bucket_cap_mb
        kw["bucket_cap_mb"] = int(cap) if float(cap).is_integer() else cap
    return kw
