"""The parts of a model the time split groups by: FSDP's units, the transformer layers and the share of
parameters outside them (what the predictor's FSDP model needs), and each parameter's gradient group
(the embeddings, each layer, the rest: the order DDP's buckets fill)."""

from __future__ import annotations


def grad_group(name: str) -> str:
    """A parameter's gradient group: 'layer <i>' for a transformer block's, 'embeddings', or 'other'."""
    import re

    hit = re.search(r"\.(?:layer|layers|h|block|blocks)\.(\d+)\.", f".{name}")
    if hit:
        return f"layer {int(hit.group(1))}"
    return "embeddings" if "embed" in name else "other"


def fsdp_units(model) -> list:
    """The modules FSDP2's ``fully_shard`` made units of (each all-gathers its parameters before its forward)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def model_units(model) -> dict | None:
    """The FSDP units the predictor needs: transformer layers, and the share of parameters outside them."""
    from .errors import ConfigError
    from .models import layer_classes

    sharded = [m for m in fsdp_units(model) if m is not model]
    if sharded:  # FSDP's own units (the model is the root)
        layers = sharded
    else:
        try:
            classes = tuple(layer_classes(model))
        except (ConfigError, AttributeError, TypeError):
            return None
        layers = [m for m in model.modules() if isinstance(m, classes)]
    total = sum(p.numel() for p in model.parameters())
    inside = sum(p.numel() for m in layers for p in m.parameters())
    return {"layers": len(layers), "root_fraction": 1 - inside / total if total else None}
