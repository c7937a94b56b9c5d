"""Exact checks: what was asked for against what was observed.

world size   the world the caller requested against the process group each rank is in, and the
             processes that actually answer a collective in it (counted by pid, not read back
             from the launcher's environment);
shards       every FSDP parameter's local shard holds exactly the elements its layout gives this rank
             (placements, global shape, mesh coordinate: torch.chunk's split, so the last rank's
             piece is smaller, or empty, when a dimension does not divide), on a mesh of the
             requested world size;
weights      per-tensor sha256 of every parameter's bytes, compared across ranks: one flipped
             bit, one swapped row or one weight off by 3e-4 is a mismatch, named by tensor;
saved model  the reloaded weights equal the trained ones bit for bit, and differ from the
             initial (untrained) ones.

Every function returns plain data (lists of problems, dicts of names); the callers decide what
a problem means (strategies.verify raises, results.merge marks the result unverified).
"""

from __future__ import annotations

import hashlib

# ---- world size ---------------------------------------------------------------------------


def observe_world(group=None) -> dict:
    """What this rank's process group is, observed from inside it.

    A collective when a process group exists (every rank of ``group`` must call it): each rank
    contributes (host, pid, rank) to an all-gather, so ``processes`` counts the processes that
    answered, independently of the WORLD_SIZE the launcher put in the environment.
    """
    import os
    import socket

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {"process_group_size": 1, "processes": 1, "ranks": [0]}
    size = dist.get_world_size(group)
    me = (socket.gethostname(), os.getpid(), dist.get_rank(group))
    everyone = [None] * size
    dist.all_gather_object(everyone, me, group=group)
    return {"process_group_size": size, "processes": len({(h, p) for h, p, _ in everyone}),
            "ranks": sorted(r for _, _, r in everyone)}


def world_problems(requested: int, observed: dict) -> list:
    """Problems (empty: none) between the requested world size and ``observe_world()``'s."""
    problems = []
    size, procs = observed["process_group_size"], observed["processes"]
    if size != requested:
        problems.append(f"world size {requested} was requested, but the process group has {size} rank(s)")
    if procs != requested:
        problems.append(f"world size {requested} was requested, but {procs} process(es) answered in the group")
    if observed["ranks"] != list(range(size)):
        problems.append(f"the group's ranks are {observed['ranks']}, not 0..{size - 1}")
    return problems


# ---- FSDP shards: the exact local size ---------------------------------------------------------


def chunk_size(n: int, chunks: int, index: int) -> int:
    """Length of piece ``index`` when ``n`` is split into ``chunks`` as ``torch.chunk`` (and DTensor's
    ``Shard``) split it: pieces of ceil(n / chunks), the last non-empty one shorter, any after it empty."""
    full = -(-n // chunks)  # ceil
    start = min(full * index, n)
    return min(n, start + full) - start


def shard_numel(shape, placements, coordinate, mesh_shape) -> int:
    """Elements one rank holds of a tensor of global ``shape`` laid out by ``placements`` (one per mesh
    dimension: Shard(dim) splits ``dim`` among that mesh dimension's ranks; Replicate and Partial keep
    it whole) at mesh ``coordinate``. ValueError for a placement whose layout this does not know."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    local = list(shape)
    for placement, index, size in zip(placements, coordinate, mesh_shape):
        if type(placement) is Shard:
            local[placement.dim] = chunk_size(local[placement.dim], size, index)
        elif not isinstance(placement, (Replicate, Partial)):
            raise ValueError(f"no exact size known for placement {placement!r}")
    numel = 1
    for d in local:
        numel *= d
    return numel


def expected_local_numel(param) -> int:
    """Elements this rank should hold of ``param``: the whole tensor unless it is a DTensor, whose
    placements, global shape and this rank's mesh coordinate give its shard exactly."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.numel()
    mesh = param.device_mesh
    return shard_numel(param.shape, param.placements, mesh.get_coordinate(), mesh.shape)


def shard_problems(model, world_size: int) -> list:
    """Problems (empty: none) with this rank's shards of ``model``'s DTensor parameters: a mesh other
    than ``world_size`` ranks, a parameter no mesh dimension shards (each rank holds it whole), or a
    local shard that is not exactly ``expected_local_numel``."""
    from torch.distributed.tensor import DTensor, Shard

    wrong_mesh, wrong_size, unknown, whole = [], [], [], []
    held = expected = 0
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        if not any(isinstance(pl, Shard) for pl in p.placements):
            whole.append(name)
        if p.device_mesh.size() != world_size:
            wrong_mesh.append(f"{name} ({p.device_mesh.size()})")
        try:
            want = expected_local_numel(p)
        except ValueError as e:
            unknown.append(f"{name}: {e}")
            continue
        have = p.to_local().numel()
        held, expected = held + have, expected + want
        if have != want:
            wrong_size.append(f"{name} holds {have}, its shard is {want}")
    problems = []
    if wrong_mesh:
        problems.append(f"{len(wrong_mesh)} parameter(s) are sharded over a mesh other than the {world_size} ranks "
                        f"requested, e.g. {wrong_mesh[:3]}")
    if whole:
        problems.append(f"{len(whole)} parameter(s) are not split by any placement (every rank holds them "
                        f"whole), e.g. {whole[:3]}")
    if wrong_size:
        problems.append(f"rank holds {held} parameter values where its shards hold exactly {expected}: "
                        f"{len(wrong_size)} parameter(s) differ, e.g. {wrong_size[:3]}")
    if unknown:
        problems.append(f"{len(unknown)} parameter(s) have a layout stnb cannot check, e.g. {unknown[:3]}")
    return problems


# ---- weights identical across ranks ---------------------------------------------------------


def tensor_digests(model) -> dict:
    """{parameter name: sha256 of its bytes} (a DTensor contributes its local shard)."""
    return digests_of(model.named_parameters())


def digests_of(named) -> dict:
    """{name: sha256 of the tensor's dtype, shape and bytes} for (name, tensor) pairs (a DTensor: its local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    with torch.no_grad():
        for name, p in named:
            t = p.to_local() if isinstance(p, DTensor) else p
            t = t.detach().to("cpu").contiguous()
            h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            out[name] = h.hexdigest()
    return out


def replicated_digests(model, extra=()) -> dict:
    """Digests of the tensors every rank must hold identically: the model's parameters that are not sharded
    (a DTensor sharded by its placements is left to the strategy's shard checks) and the ``extra``
    (name, parameter) pairs, e.g. the parameters a loss owns."""
    from torch.distributed.tensor import DTensor, Replicate

    kept = [(n, p) for n, p in model.named_parameters() if not hasattr(p, "ds_tensor")  # ZeRO-3 partitioned
            and (not isinstance(p, DTensor) or all(isinstance(pl, Replicate) for pl in p.placements))]
    return digests_of(kept + list(extra))


def model_digest(digests: dict) -> str:
    """One sha256 over a model's per-tensor digests (in name order): equal iff every tensor is."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name].encode() + b"\0")
    return h.hexdigest()


def gather_digests(model, group=None) -> list:
    """Every rank's ``tensor_digests``, ordered by rank (a collective; one rank: a list of one)."""
    import torch.distributed as dist

    mine = tensor_digests(model)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [mine]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def compare_digests(per_rank: list) -> dict:
    """Compare ranks' ``tensor_digests``: identical only if every tensor's bytes match rank 0's.

    Returns {"identical", "tensors", "differing": [{"tensor", "ranks"}...] (rank 0 order),
    "first_differing", "model_digests"} ("ranks": the ranks whose tensor differs from rank 0's;
    a tensor missing on a rank differs).
    """
    ref = per_rank[0]
    names = list(ref) + sorted({n for d in per_rank[1:] for n in d} - set(ref))
    differing = []
    for name in names:
        ranks = [r for r, d in enumerate(per_rank) if r and d.get(name) != ref.get(name)]
        if ranks:
            differing.append({"tensor": name, "ranks": ranks})
    return {"identical": not differing, "tensors": len(names), "differing": differing,
            "first_differing": differing[0]["tensor"] if differing else None,
            "model_digests": [model_digest(d) for d in per_rank]}


# ---- saved model ---------------------------------------------------------------------------------


def state_of(model) -> dict:
    """A CPU copy of a model's state dict (the reference a saved model is checked against)."""
    return {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}


def differing_tensors(a: dict, b: dict) -> list:
    """Names of tensors of two state dicts that are not bit-identical (missing on one side included)."""
    import torch

    out = []
    for name in list(a) + [n for n in b if n not in a]:
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            out.append(name)
    return out


def saved_model_problems(reloaded: dict, trained: dict, initial: dict) -> tuple:
    """(problems, details) for a saved model: reloaded == trained exactly, and != initial."""
    not_trained = differing_tensors(reloaded, trained)
    changed = [n for n in differing_tensors(reloaded, initial) if n in initial]
    details = {"tensors": len(trained), "differing_from_trained": not_trained[:10],
               "equals_trained": not not_trained, "changed_from_initial": len(changed),
               "differs_from_initial": bool(changed)}
    problems = []
    if not_trained:
        problems.append(f"the saved model's weights are not the trained ones: {len(not_trained)} tensor(s) differ, "
                        f"first {not_trained[0]!r}")
    if not changed:
        problems.append("the saved model's weights equal the initial (untrained) model's: nothing shows that "
                        "training changed it (was the untrained model saved, or did training change no weight?)")
    return problems, details
