"""Tensor facts the strategies verify with: local shard sizes (exact, from each DTensor's placements),
bytes held, parameter counts, and the parameters a run trains (the model's and the loss's own)."""

from __future__ import annotations


def local_numel(p) -> int:
    """Elements this rank holds of ``p`` (a DTensor: its local shard; DeepSpeed ZeRO-3: its partition)."""
    from torch.distributed.tensor import DTensor

    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel()
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
        total += getattr(p, "ds_numel", None) or p.numel()  # ZeRO-3 keeps an empty tensor between gathers
        local += local_numel(p)
    return local, total


def shard_problems(named_tensors, what: str = "parameter") -> tuple[int, list]:
    """(elements expected on this rank, problems) for (name, tensor) pairs that must be DTensor shards: each
    local shard holds exactly the elements its placements and global shape give this rank
    (``checks.expected_local_numel``); a plain tensor is reported as not sharded."""
    from torch.distributed.tensor import DTensor

    from ..checks import expected_local_numel

    expected_total, problems, plain = 0, [], []
    for name, t in named_tensors:
        if not isinstance(t, DTensor):
            plain.append(name)
            continue
        want, have = expected_local_numel(t), t.to_local().numel()
        expected_total += want
        if have != want:
            problems.append(f"{what} {name!r}: this rank holds {have} values, its shard ({list(t.placements)} of "
                            f"global shape {list(t.shape)}) holds {want}")
    if plain:
        problems.insert(0, f"{len(plain)} {what}(s) are not sharded, e.g. {plain[:3]}")
    return expected_total, problems


def loss_modules(trainer) -> list:
    """[(prefix, loss module)] of a trainer: 'loss' or 'loss[<dataset>]' for a dict of losses."""
    import torch

    loss = trainer.loss
    items = [(f"loss[{k}]", v) for k, v in loss.items()] if isinstance(loss, dict) else [("loss", loss)]
    return [(prefix, m) for prefix, m in items if isinstance(m, torch.nn.Module)]


def loss_owned_parameters(trainer) -> list:
    """[(name, parameter)] the losses own beyond the model (SoftmaxLoss's classifier, a learnable
    temperature...), trainable ones only, each once. sentence-transformers puts them in the optimizer
    (its ``get_optimizer_cls_and_kwargs``), but DDP only wraps the model."""
    model = trainer.model
    inner = getattr(trainer, "model_wrapped", model)
    in_model = {id(p) for p in model.parameters()} | {id(p) for p in inner.parameters()}
    seen, out = set(in_model), []
    for prefix, loss in loss_modules(trainer):
        for name, p in loss.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((f"{prefix}.{name}", p))
    return out


_MAKES_PARAMETERS = ("Parameter", "Linear", "Bilinear")


def loss_classes_with_parameters(objects: dict) -> list:
    """Names of the loss classes among ``objects`` (the build function's, ``buildsource.read_objects``)
    whose ``__init__`` always makes trainable parameters: a ``nn.Parameter`` / ``nn.Linear`` /
    ``nn.Bilinear`` call in a statement of its own body, not under a condition (SoftmaxLoss's classifier,
    a learnable temperature; not MSELoss's optional projection). Seen before any instance exists; a loss
    that gets parameters any other way is found in the ranks (``loss_owned_parameters``). A loss class:
    a ``torch.nn.Module`` named ``*Loss`` or defined in a ``losses`` module."""
    import torch

    found = set()
    for obj in objects.values():
        if (isinstance(obj, type) and issubclass(obj, torch.nn.Module)
                and (obj.__name__.endswith("Loss") or ".losses" in (obj.__module__ or ""))
                and _init_makes_parameters(obj)):
            found.add(obj.__name__)
    return sorted(found)


def _init_makes_parameters(cls) -> bool:
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return False
    init = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    for statement in init.body if init is not None else []:
        if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.Expr)):
            for node in ast.walk(statement):
                func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
                if getattr(func, "attr", getattr(func, "id", None)) in _MAKES_PARAMETERS:
                    return True
    return False


def optimizer_parameter_names(trainer, optimizer) -> tuple[list, int]:
    """(names, unnamed): every parameter the optimizer updates, named as the model or the loss names it
    (the optimizer itself only holds tensors). ``unnamed`` counts those neither owns."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    names.update({id(p): n for n, p in loss_owned_parameters(trainer)})
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
    # DeepSpeed ZeRO updates flat partitions; the parameters they hold are its bit16 (1/2) / fp16 (3) groups
    groups = getattr(opt, "bit16_groups", None) or getattr(opt, "fp16_groups", None)
    groups = [{"params": g} for g in groups] if groups else opt.param_groups
    out, unnamed = [], 0
    for group in groups:
        for p in group["params"]:
            if id(p) in names:
                out.append(names[id(p)])
            else:
                unnamed += 1
    return out, unnamed


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
