"""What a DeepSpeed rank holds, observed on its engine (``stnb.strategies.deepspeed`` checks and measures with these):
the gradients at the optimizer step, the ZeRO optimizer's partition and its state, ZeRO-3's parameter partitions,
and the bytes beyond what ``memory.measure`` counts."""

from __future__ import annotations


def _tensors(x) -> list:
    import torch

    if x is None:
        return []
    if torch.is_tensor(x):
        return [x]
    return [t for one in (x.values() if isinstance(x, dict) else x) for t in _tensors(one)]


def held_gradients(module, opt) -> dict:
    """Gradient values this rank holds at the optimizer step: on whole parameters (``.grad``) and in the
    ZeRO optimizer's own partition (``averaged_gradients``, stage 1/2; the flat partition's grads, stage 3)."""
    whole = [p.grad for p in module.parameters() if p.grad is not None and p.grad.numel()]
    partition = _tensors(getattr(opt, "averaged_gradients", None))
    partition += [f.grad for f in getattr(opt, "fp32_partitioned_groups_flat", None) or [] if f.grad is not None]
    return {"whole_grad_numel": sum(t.numel() for t in whole), "partition_grad_numel": sum(t.numel() for t in partition),
            "bytes": sum(t.numel() * t.element_size() for t in whole + partition)}


def optimizer_partition(opt) -> dict:
    """This rank's ZeRO optimizer partition, observed: the fp32 master partition it updates (padding
    included, and the padding apart), AdamW's state tensors over it, and the trainable values in all."""
    import torch

    flats = list(getattr(opt, "single_partition_of_fp32_groups", None) or []) or \
        list(getattr(opt, "fp32_partitioned_groups_flat", None) or [])
    groups = getattr(opt, "bit16_groups", None) or getattr(opt, "fp16_groups", None) or []
    trainable = sum((getattr(p, "ds_numel", None) or p.numel()) for g in groups for p in g)
    state = getattr(getattr(opt, "optimizer", None), "state", {}) or {}
    tensors = [v for st in state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    partition = sum(f.numel() for f in flats)
    slots = len(tensors) // max(1, len(flats)) if flats else 0
    padding = [x for g in getattr(opt, "groups_padding", None) or [] for x in (g if isinstance(g, list) else [g])]
    return {"partition_numel": partition, "partition_padding": sum(padding),  # stage 3: per parameter
            "state_numel": sum(t.numel() for t in tensors), "slots": slots, "trainable_numel": trainable,
            "master_bytes": sum(f.numel() * f.element_size() for f in flats)}


def stage3_partitions(module, world_size) -> tuple[dict, list]:
    """ZeRO-3: every parameter partitioned, this rank's piece ceil(numel / N) (DeepSpeed pads the last)."""
    problems, names = [], []
    for name, p in module.named_parameters():
        if not hasattr(p, "ds_tensor"):
            problems.append(f"parameter {name} is not partitioned by ZeRO-3 (no ds_tensor)")
            continue
        want = -(-p.ds_numel // world_size)
        if p.ds_tensor.numel() != want:
            problems.append(f"parameter {name}: this rank holds {p.ds_tensor.numel()} values, ZeRO-3 over "
                            f"{world_size} ranks gives {want}")
        names.append(name)
    return {"ds_partitioned_params": len(names)}, problems[:10]


def held_bytes(trainer) -> dict:
    """What a DeepSpeed rank holds beyond the tensors ``memory.measure`` counts: ZeRO-3's parameter
    partitions, the gradients seen at the step, the fp32 master partition (optimizer state)."""
    engine = trainer.model_wrapped
    opt = getattr(engine, "optimizer", None)
    out = {"optimizer_state": optimizer_partition(opt)["master_bytes"] if opt is not None else 0}
    out["params"] = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in trainer.model.parameters()
                        if hasattr(p, "ds_tensor"))
    out["grads"] = getattr(trainer, "stnb_ds_grads", {}).get("bytes", 0)
    return out
