"""A checkpoint resumed on another layout: another number of ranks, or another strategy's format
(``Strategy.loads`` says which pairs a strategy takes; ``stnb.checkpoints.check_serves`` refuses the others before
any process starts).

Every format stnb writes can be read whole, by parameter name, in any process: the trainer's files (the model,
and ``optimizer.pt`` with the names of its parameters, ``optimizer-params.json``), zero1's optimizer partitions
(each with its names), the DCP shards of fsdp / zero2 (``torch.distributed.checkpoint`` reads every rank's).
That whole state, in the form of ``torch.distributed.checkpoint.state_dict``'s full state dicts (tensors keyed by
the model's parameter names), is what a run on another layout loads: ``set_model_state_dict`` /
``set_optimizer_state_dict`` place each tensor, or the rank's piece of it, where this run keeps it (a plain
model, a DTensor shard, a ZeroRedundancyOptimizer partition). A DCP checkpoint resumed by fsdp / zero2 on another
number of ranks is DCP's own resharding instead (each rank reads only its pieces).

Checked, not assumed: after each load, in every rank, every tensor this rank holds of the model and of the
optimizer state (and each parameter group's hyperparameters) is compared with the same tensor read from the
checkpoint, the rank's piece of a DTensor cut at its own offset; a difference stops the run before its first
step (VerificationError). What is not carried: the RNG states (one per rank of the writing run; on another
layout every rank continues from the run's seed) - ``RunResult.resumed_from['loaded']`` says so.
"""

from __future__ import annotations

import json
import os
import warnings

from ..errors import CheckpointError
from ..files import manifest

SCHEDULER = "scheduler.pt"  # transformers' SCHEDULER_NAME: the scheduler's file in a checkpoint

NAMES = "optimizer-params.json"  # the trainer format's optimizer parameters by name, in the optimizer's order


def optimizer_names(trainer, optimizer) -> list | None:
    """The names of ``optimizer``'s parameters, one list per parameter group, as the model names them; None when
    it updates one the model does not own (a loss's own parameters)."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    groups = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    return None if any(n is None for g in groups for n in g) else groups


def write_names(path: str, groups) -> None:
    with open(path, "w") as f:
        json.dump({"groups": groups}, f)


def read_names(path: str) -> list:
    with open(path) as f:
        return json.load(f)["groups"]


def by_name(saved: dict, groups: list) -> dict:
    """A torch optimizer's state dict (parameters numbered in its groups' order) keyed by parameter name instead,
    ``groups`` naming them (``optimizer_names``): the full optimizer state dict of ``torch.distributed.checkpoint``."""
    if len(saved["param_groups"]) != len(groups):
        raise CheckpointError(f"the optimizer state has {len(saved['param_groups'])} parameter group(s) and its names "
                              f"{len(groups)}")
    state, out = {}, []
    for group, names in zip(saved["param_groups"], groups):
        if len(group["params"]) != len(names):
            raise CheckpointError(f"a parameter group holds {len(group['params'])} parameters and its names "
                                  f"{len(names)}")
        for index, name in zip(group["params"], names):
            if index in saved["state"]:
                state[name] = saved["state"][index]
        out.append({**group, "params": list(names)})
    return {"state": state, "param_groups": out}


def merged(parts: list) -> dict:
    """One full optimizer state dict from several ranks' (each a partition of the parameters, the same groups)."""
    state, groups = {}, [dict(g, params=[]) for g in parts[0]["param_groups"]]
    for part in parts:
        state.update(part["state"])
        for group, mine in zip(groups, part["param_groups"]):
            group["params"] += mine["params"]
    return {"state": state, "param_groups": groups}


def read_dcp(folder: str) -> dict:
    """Every tensor of a DCP checkpoint folder, whole, in this process (a collective in a process group: every
    rank reads it)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is unavailable ...": one process is the intent here
        return _load_state_dict_from_keys(checkpoint_id=folder)


def plain_class(model):
    """The model's own class (FSDP2 makes a subclass of it when it shards the root)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def read_saved_model(checkpoint: str, like) -> dict:
    """The model a trainer-format checkpoint holds (a saved sentence-transformers model), whole, by name."""
    return plain_class(like)(checkpoint, device="cpu").state_dict()


# ---- loading in the ranks -----------------------------------------------------------------------
def install(trainer, strategy) -> None:
    """Make the trainer load a checkpoint of another layout (``Strategy.loads`` accepted it) through the whole
    state by name, checked; one of this run's own layout it loads as before. Every rank, before training."""
    own_model, own_optimizer, own_rng = (trainer._load_from_checkpoint, trainer._load_optimizer_and_scheduler,
                                         trainer._load_rng_state)
    loaded = trainer.stnb_loaded = {}

    def other(checkpoint):
        written = manifest(checkpoint) if checkpoint else {}
        same = (written.get("format", "trainer") == strategy.checkpoint_format
                and written.get("world_size") == trainer.args.world_size)
        return None if not written or same else written

    def resharded_by_own_loading(written) -> bool:
        return written.get("format") == strategy.checkpoint_format and strategy.reshards

    def how(written, by: str) -> str:
        return (f"{written.get('format')} of {written.get('world_size')} rank(s) -> {strategy.checkpoint_format} on "
                f"{trainer.args.world_size}: {by}")

    def load_model(checkpoint, *a, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        written = other(checkpoint)
        if written is None:
            return own_model(checkpoint, *a, **kw)
        whole = trainer.stnb_checkpoint_writer.read_model(checkpoint, trainer.model)
        if resharded_by_own_loading(written):
            own_model(checkpoint, *a, **kw)
            loaded["how"] = how(written, "resharded by its own loading")
        else:
            # a copy: torch puts the DTensor pieces it makes into the dict it is given
            set_model_state_dict(trainer.model, dict(whole), options=StateDictOptions(full_state_dict=True))
            loaded["how"] = how(written, "the whole state read by parameter name")
        checked("model", compare_model(trainer.model, whole))
        return None

    def load_optimizer(checkpoint):
        written = other(checkpoint)
        if written is None or (resharded_by_own_loading(written) and strategy.checks_own_resharding):
            return own_optimizer(checkpoint)
        whole = trainer.stnb_checkpoint_writer.read_optimizer(checkpoint)
        mine = strategy.local_optimizer(trainer)
        if resharded_by_own_loading(written):
            own_optimizer(checkpoint)
        else:
            set_optimizer(trainer.model, mine, whole)
            load_scheduler(trainer, checkpoint)
        set_hyperparameters(trainer.model, torch_optimizer(trainer), whole)
        checked("optimizer", compare_optimizer(trainer.model, mine, torch_optimizer(trainer), whole))
        return None

    def load_rng(checkpoint):
        written = other(checkpoint)
        if written is None:
            return own_rng(checkpoint)
        loaded["rng"] = (f"not restored: the checkpoint holds the RNG states of {written.get('world_size')} rank(s) "
                         f"of {written.get('strategy')!r}; every rank continues from the run's seed")
        return None

    def checked(part, result):
        count, problems = result
        loaded[f"{part}_tensors_checked"] = count
        if problems:
            from ..errors import VerificationError

            raise VerificationError(f"the {part} state loaded on rank {trainer.args.process_index} differs from the "
                                    f"checkpoint's: {'; '.join(problems[:5])}")

    trainer._load_from_checkpoint, trainer._load_optimizer_and_scheduler = load_model, load_optimizer
    trainer._load_rng_state = load_rng


def set_optimizer(model, optimizer, whole: dict) -> None:
    """Put the whole optimizer state ``whole`` (by parameter name) into ``optimizer``: its DTensor shards cut by
    ``set_optimizer_state_dict``, a plain one's (a ZeroRedundancyOptimizer partition's, whose groups may be empty,
    which that refuses) by its own ``load_state_dict``, numbered in its own groups' order."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(isinstance(p, DTensor) for p in params):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # a copy: torch puts what it makes into the dicts it is given
        copy = {"state": {k: dict(v) for k, v in whole["state"].items()},
                "param_groups": [dict(g) for g in whole["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, copy, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    names, group_of = _by_name(model, whole)
    own = optimizer.state_dict()  # its groups, parameters numbered in their order
    state, groups = {}, []
    for index, p in enumerate(params):
        if names.get(id(p)) in whole["state"]:
            state[index] = whole["state"][names[id(p)]]
    for group, numbers in zip(optimizer.param_groups, own["param_groups"]):
        source = _source_group(group, names, group_of) or {}
        groups.append({**numbers, **{k: v for k, v in source.items() if k in numbers and k != "params"}})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _by_name(model, whole: dict) -> tuple[dict, dict]:
    """({id(parameter): its name in ``model``}, {parameter name: the group of ``whole``, a full optimizer state dict,
    that holds it})."""
    return ({id(p): n for n, p in model.named_parameters()},
            {n: g for g in whole["param_groups"] for n in g["params"]})


def _source_group(group, names: dict, group_of: dict):
    """The checkpoint's group holding one of ``group``'s parameters (None: it holds none of them)."""
    return next((group_of[names[id(p)]] for p in group["params"] if names.get(id(p)) in group_of), None)


def set_hyperparameters(model, optimizer, whole: dict) -> None:
    """Each of ``optimizer``'s parameter groups takes the hyperparameters (the learning rate the schedule had
    reached...) of the checkpoint's group holding its parameters. ZeroRedundancyOptimizer copies its own groups'
    into its local optimizer at every step, so they must be right there too."""
    names, group_of = _by_name(model, whole)
    for group in optimizer.param_groups:
        source = _source_group(group, names, group_of)
        if source is not None:
            group.update({k: v for k, v in source.items() if k != "params" and k in group})


# ---- checked tensor by tensor -------------------------------------------------------------------
def piece(held, whole):
    """(what this rank holds, the same part of ``whole``): a DTensor's local shard and the slice of the whole
    tensor at the shard's global offset; a plain tensor and the whole one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(held, DTensor):
        return held, whole
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(held.shape, held.device_mesh, held.placements)
    return held.to_local(), whole[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def same(held, whole) -> bool:
    import torch

    if not isinstance(held, torch.Tensor):
        return plain(held) == plain(whole)
    mine, theirs = piece(held, whole)
    return mine.shape == theirs.shape and torch.equal(mine.detach().cpu(), theirs.cpu())


def plain(value):
    """A hyperparameter as JSON would hold it (a tuple read back from a checkpoint may be a list)."""
    return list(value) if isinstance(value, tuple) else value


def compare_model(model, whole: dict) -> tuple[int, list]:
    """(tensors compared, problems): every tensor of the model's state this rank holds against the checkpoint's."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    held = get_model_state_dict(model)
    problems = [f"{len(set(held) ^ set(whole))} tensor name(s) in one and not the other, e.g. "
                f"{sorted(set(held) ^ set(whole))[:3]}"] if set(held) != set(whole) else []
    differing = [k for k in held if k in whole and not same(held[k], whole[k])]
    if differing:
        problems.append(f"{len(differing)} tensor(s) differ, e.g. {differing[:3]}")
    return len(held), problems


def compare_optimizer(model, mine, optimizer, whole: dict) -> tuple[int, list]:
    """(tensors compared, problems): the optimizer state of every parameter this rank's optimizer ``mine``
    updates against the checkpoint's (present exactly where the checkpoint has it), and the hyperparameters of
    ``optimizer``'s groups (the one the trainer steps) against the checkpoint's group of each parameter."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    held = get_optimizer_state_dict(model, mine)
    names, group_of = _by_name(model, whole)
    params = [names.get(id(p)) for g in mine.param_groups for p in g["params"]]
    problems, count = [], 0
    unloaded = [n for n in params if n in whole["state"] and n not in held["state"]]
    extra = [n for n in held["state"] if n not in whole["state"]]
    if unloaded:
        problems.append(f"{len(unloaded)} parameter(s) without the state the checkpoint holds, e.g. {unloaded[:3]}")
    if extra:
        problems.append(f"{len(extra)} parameter(s) with state the checkpoint does not hold, e.g. {extra[:3]}")
    differing = []
    for name, state in held["state"].items():
        for key, value in state.items():
            count += 1
            if name in whole["state"] and not same(value, whole["state"][name].get(key)):
                differing.append(f"{name}[{key}]")
    if differing:
        problems.append(f"{len(differing)} optimizer tensor(s) differ, e.g. {differing[:3]}")
    for group in optimizer.param_groups:
        for p in group["params"]:
            want = group_of.get(names.get(id(p)))
            off = want and [k for k in want if k != "params" and k in group and plain(group[k]) != plain(want[k])]
            if off:
                problems.append(f"{names[id(p)]}: hyperparameter(s) {off} differ ({[group[k] for k in off]} vs "
                                f"{[want[k] for k in off]})")
                break
    return count, problems


# ---- the optimizer and scheduler in a checkpoint (helpers of every strategy's saving) ----------------
def save_scheduler(trainer, folder: str) -> None:
    """The learning-rate scheduler into a checkpoint, as the trainer writes it (the writing rank only): for a
    strategy that writes the optimizer itself (``Strategy.saving``)."""
    import torch

    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(folder, SCHEDULER))


def load_scheduler(trainer, folder: str) -> None:
    """The learning-rate scheduler back from a checkpoint ``save_scheduler`` wrote (every rank)."""
    import torch

    trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(folder, SCHEDULER), weights_only=True))


def torch_optimizer(trainer):
    """The trainer's torch optimizer (accelerate's AcceleratedOptimizer wraps it once training is prepared)."""
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)
