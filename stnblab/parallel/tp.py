"""Tensor parallelism (TP) inside each rank: shard every encoder layer, check the shards, train.

Megatron-LM's layout, applied with ``torch.distributed.tensor.parallel.parallelize_module``:

* attention: Q, K and V column-wise (rank r computes heads r*H/N .. (r+1)*H/N - 1 on the full
  input), the output projection row-wise (each rank multiplies its heads' slice; one all-reduce
  sums the partial results);
* MLP: the first projection column-wise (a slice of the 4x-wide intermediate), the second
  row-wise (one all-reduce).

So a layer costs two all-reduces of the activations (batch x tokens x hidden) forward and two
backward, whatever the model's size. The attention module must also learn that it now holds H/N heads.

``check_layout`` compares what each rank really holds with the architecture's plan (not with the
plan that was asked for), so a layer left whole or split on the wrong dimension is reported.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from .plans import COLWISE, ROWWISE, Shape, architecture
from .single import encode, load, max_diff, mnrl

_DIM = {COLWISE: 0, ROWWISE: 1}  # a Linear's weight is (out_features, in_features)


def styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}


def apply(model, mesh, shape: Shape, plan: dict) -> None:
    """Shard the SentenceTransformer's encoder in place: ``plan`` is {'<layer>.<module>': style}."""
    from torch.distributed.tensor.parallel import parallelize_module

    arch = architecture(shape)
    encoder = model[0].auto_model
    layers = encoder.get_submodule(arch["layers"])
    make = styles()
    for i, layer in enumerate(layers):
        mine = {name.split(".", 1)[1]: make[style]() for name, style in plan.items()
                if style and name.split(".", 1)[0] == str(i)}
        if mine:
            parallelize_module(layer, mesh, mine)
        attention = layer.get_submodule(arch["attention"])
        if all(plan.get(f"{i}.{arch['attention']}.{qkv}") == COLWISE for qkv in ("query", "key", "value")):
            attention.num_attention_heads //= mesh.size()   # this rank's heads
            attention.all_head_size //= mesh.size()


def check_layout(model, shape: Shape, degree: int, layers=None) -> list[str]:
    """What is wrong with this rank's shards against the architecture's plan (empty: nothing).
    layers: the indices to check (default: all; a pipeline stage checks its own)."""
    from torch.distributed.tensor import DTensor, Shard

    arch = architecture(shape)
    encoder_layers = model[0].auto_model.get_submodule(arch["layers"])
    problems = []
    for i in (range(len(encoder_layers)) if layers is None else layers):
        layer = encoder_layers[i]
        for name, style in arch["plan"].items():
            w = layer.get_submodule(name).weight
            dim = _DIM[style]
            where = f"layer {i} {name}"
            if not isinstance(w, DTensor):
                problems.append(f"{where}: not sharded (this rank holds the whole {tuple(w.shape)} weight); "
                                f"the plan splits it {style} (dim {dim})")
                continue
            if list(w.placements) != [Shard(dim)]:
                problems.append(f"{where}: split as {list(w.placements)}, the plan splits it {style} (Shard({dim}))")
            elif w.to_local().shape[dim] * degree != w.shape[dim]:
                problems.append(f"{where}: holds {w.to_local().shape[dim]} of {w.shape[dim]} along dim {dim}, "
                                f"expected 1/{degree}")
        heads = layer.get_submodule(arch["attention"]).num_attention_heads
        if heads * degree != shape.heads:
            problems.append(f"layer {i}: the attention module counts {heads} heads on this rank, expected "
                            f"{shape.heads}/{degree}")
    return problems


def comm_counter():
    """A CommDebugMode that also adds up the bytes each collective is given (this rank's payload)."""
    from torch.distributed.tensor.debug import CommDebugMode

    class CommBytes(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.bytes = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = getattr(func, "_overloadpacket", None)
            if out is not NotImplemented and packet in self.comm_registry:
                first = args[0] if args else None
                tensors = first if isinstance(first, (list, tuple)) else [first]
                self.bytes[str(packet).split(".")[-1]] += sum(t.numel() * t.element_size() for t in tensors
                                                              if isinstance(t, torch.Tensor))
            return out

    return CommBytes()


def local_part(full: torch.Tensor, grad, rank: int, degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's gradient, the matching slice of the reference's full gradient)."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(grad, DTensor):
        placement = grad.placements[0]
        if isinstance(placement, Shard):
            return grad.to_local(), full.chunk(degree, dim=placement.dim)[rank]
        grad = grad.full_tensor()
    return grad, full


def rank_main(path: str, shape: Shape, plan: dict, batches: list, ref: dict, lr: float) -> dict:
    """Inside each rank: load, shard, check, then train one step per batch against the reference."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, degree = dist.get_rank(), dist.get_world_size()
    model = load(path)
    total = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (degree,))
    apply(model, mesh, shape, plan)
    problems = check_layout(model, shape, degree)
    local = sum(getattr(p, "to_local", lambda: p)().numel() for p in model.parameters())
    out = dict(rank=rank, problems=problems, local_params=local, total_params=total)
    if problems:  # fail closed: a wrong layout is reported, never trained
        return out
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    losses, step_s, comm = [], [], None
    for i, features in enumerate(batches):
        counter = comm_counter() if i == 0 else contextlib.nullcontext()  # the collectives are the same every step
        t0 = time.perf_counter()
        with counter:
            emb = encode(model, features)
            loss = mnrl(emb[:len(emb) // 2], emb[len(emb) // 2:])
            loss.backward()
        step_s.append(time.perf_counter() - t0)
        if i == 0:
            comm = dict(counts={str(k).split(".")[-1]: v for k, v in counter.get_comm_counts().items()},
                        bytes=dict(counter.bytes))
            out["embedding_diff"] = max_diff(emb, ref["embeddings"])
            out["grad_diff"] = max(max_diff(*local_part(ref["grads"][n], p.grad, rank, degree))
                                   for n, p in model.named_parameters() if p.grad is not None)
            out["grads_compared"] = sum(p.grad is not None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(out, losses=losses, step_s=step_s, comm=comm)
