"""A DeepSpeed checkpoint resumed on another number of ranks or by another strategy: through DeepSpeed's
universal checkpoint.

The engine's own checkpoint (``global_step<N>/``) holds each rank's flat ZeRO partition, which only the same
number of ranks can load. DeepSpeed's ``ds_to_universal`` rewrites it by parameter name (``zero/<name>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``), and an engine with ``checkpoint.load_universal`` set cuts each of
those into its own partition, on any number of ranks. stnb runs both (``universal_loading``): rank 0 converts the
checkpoint once, into ``<checkpoint>/.stnb-universal`` (whole or absent: written beside, then renamed; later
resumes reuse it), every rank waits for it, and each engine loads it with the flag set for that load only.

Checked, not assumed: after the load, every parameter the optimizer trains, its fp32 master copy and its
``exp_avg`` / ``exp_avg_sq`` (DeepSpeed's ``safe_get_full_*``: the values gathered from every rank's partition,
a collective) are compared with the converted files, the module's own weights (at stage 3 this rank's piece)
with the fp32 copy, and each parameter group's hyperparameters with the checkpoint's; a difference stops the run
before its first step. The RNG states of the writing ranks are not carried (every rank continues from the run's
seed), as on any other layout (``stnb.strategies.layouts``).

Another strategy reads the same universal form whole, by parameter name (``read_model``, ``read_optimizer``: the
form ``stnb.strategies.layouts`` puts in place and checks for every strategy).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil

UNIVERSAL = ".stnb-universal"  # inside the checkpoint: DeepSpeed's universal form of its global_step<N>/
STATES = ("exp_avg", "exp_avg_sq")  # AdamW's moments, as DeepSpeed's universal checkpoint names them


def universal_folder(checkpoint: str) -> str:
    """The checkpoint's universal form (``latest_universal`` and ``global_step<N>_universal/``), made by rank 0 the
    first time it is needed; every rank returns once it is there (a collective when distributed)."""
    import torch.distributed as dist

    target = os.path.join(checkpoint, UNIVERSAL)
    distributed = dist.is_available() and dist.is_initialized()
    if (not distributed or dist.get_rank() == 0) and not os.path.isfile(os.path.join(target, "latest_universal")):
        convert(checkpoint, target)
    if distributed:
        from ..processes import wait_for_all

        wait_for_all()
    return target


def convert(checkpoint: str, target: str) -> None:
    """``ds_to_universal`` of the checkpoint's ``global_step<N>/`` into ``target``, in this process (no worker
    processes), written beside and renamed into place. Its progress output is kept out of the rank's log unless
    it fails."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main

    with open(os.path.join(checkpoint, "latest")) as f:
        tag = f.read().strip()
    for stale in glob.glob(f"{glob.escape(target)}.partial-*"):  # a conversion stopped half-way (rank 0 killed)
        shutil.rmtree(stale, ignore_errors=True)
    staging = f"{target}.partial-{os.getpid()}"
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            main(argparse.Namespace(input_folder=os.path.join(checkpoint, tag),
                                    output_folder=os.path.join(staging, f"{tag}_universal"),
                                    num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                    strict=True, inject_missing_state=True))
    except BaseException:
        print(said.getvalue())
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)  # an older conversion without its latest_universal: unfinished
    os.replace(staging, target)


def install(trainer) -> None:
    """The engine the trainer prepares loads a checkpoint of another number of ranks from its universal form
    (``universal_loading``): the trainer calls the engine's ``load_checkpoint`` itself, inside ``train()``."""
    from deepspeed import DeepSpeedEngine

    accelerator, loaded = trainer.accelerator, trainer.stnb_loaded
    prepare = accelerator.prepare

    def prepared(*args, **kwargs):
        out = prepare(*args, **kwargs)
        for engine in out if isinstance(out, tuple) else (out,):
            if isinstance(engine, DeepSpeedEngine):
                universal_loading(engine, trainer.args.world_size, loaded)
        return out

    accelerator.prepare = prepared


def universal_loading(engine, world: int, loaded: dict):
    """``engine.load_checkpoint``, wrapped: a checkpoint stnb wrote with DeepSpeed on another number of ranks is
    loaded from its universal form and checked (``loaded``: how, and the tensors checked); one written on
    ``world`` ranks as before."""
    from ..files import manifest

    own = engine.load_checkpoint

    def load_checkpoint(load_dir, *args, **kwargs):
        written = manifest(load_dir)
        if not written or written.get("world_size") == world:
            return own(load_dir, *args, **kwargs)
        folder = universal_folder(load_dir)
        engine._config.load_universal_checkpoint = True  # what `checkpoint: {load_universal: true}` sets
        try:
            out = own(folder, *args, **kwargs)
        finally:
            engine._config.load_universal_checkpoint = False
        tag = _tag(folder)
        saved = group_settings(_saved_optimizer(tag))
        own_step_counters(engine.optimizer)
        own_group_settings(engine.optimizer, saved)
        loaded["how"] = (f"deepspeed of {written.get('world_size')} rank(s) -> deepspeed on {world}: DeepSpeed's "
                         f"universal checkpoint ({UNIVERSAL} in the checkpoint), each rank cutting its partition")
        count, problems = compare(engine, os.path.join(tag, "zero"), saved)
        loaded["model_tensors_checked"], loaded["optimizer_tensors_checked"] = count
        if problems:
            from ..errors import VerificationError

            raise VerificationError(f"the state DeepSpeed loaded differs from the checkpoint's: "
                                    f"{'; '.join(problems[:5])}")
        return out

    engine.load_checkpoint = load_checkpoint


def own_step_counters(zero_optimizer) -> None:
    """Give each optimizer state its own ``step`` tensor. DeepSpeed 0.19's ZeRO-3 universal loading puts one tensor
    object into every sub-group's state (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``), and torch's AdamW
    counts steps in place: with two groups each optimizer step counted twice, and the bias correction drifted
    (measured on the tiny BERT, 2 ranks resumed as 1: losses 3e-5 off the run that never stopped by step 6)."""
    import torch

    seen = set()
    for state in getattr(getattr(zero_optimizer, "optimizer", None), "state", {}).values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(state["step"]))


def own_group_settings(zero_optimizer, saved: list) -> None:
    """Give each parameter group its own hyperparameters back (``saved``: ``group_settings``). DeepSpeed 0.19's
    ZeRO-3 universal loading sets every group's from the first group's ("Generally, the hyperparameters of each
    parameter should be the same"): the trainer's second group, the biases and LayerNorm weights it keeps out of
    weight decay, was decayed."""
    groups = zero_optimizer.optimizer.param_groups
    if len(groups) == len(saved):
        for group, want in zip(groups, saved):
            group.update(want)


def compare(engine, zero: str, saved: list) -> tuple[tuple[int, int], list]:
    """((model tensors, optimizer tensors) compared, problems): what every trained parameter holds after the load
    (gathered from every rank's partition: a collective, in the module's order on every rank) against the universal
    checkpoint's files in ``zero``, and each parameter group's hyperparameters against ``saved``."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from .layouts import plain

    problems, model, optimizer = [], 0, 0
    module = engine.module.state_dict()  # stage 3: placeholders; each parameter's piece is its ds_tensor
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        held = {"fp32": safe_get_full_fp32_param(p), **{k: safe_get_full_optimizer_state(p, k) for k in STATES}}
        for key, value in held.items():
            want = _load(zero, name, key).flatten().float()
            optimizer += 1
            if value is None or not torch.equal(value.detach().float().cpu().flatten(), want):
                problems.append(f"{name}[{key}]")
            if key == "fp32":  # the module's weights: the fp32 copy in the module's precision
                model += 1
                if not torch.equal(module_piece(p, module.get(name)), own_piece(p, want).to(p.dtype).float()):
                    problems.append(f"{name} (the module's weights)")
    problems = [f"{len(problems)} tensor(s) differ, e.g. {problems[:3]}"] if problems else []
    groups = engine.optimizer.optimizer.param_groups
    settings = [[(k, g.get(k), want[k]) for k in sorted(want) if plain(g.get(k)) != plain(want[k])]
                for g, want in zip(groups, saved)]
    if len(groups) != len(saved) or any(settings):
        problems.append(f"the optimizer's {len(groups)} parameter group(s) against the checkpoint's {len(saved)}: "
                        + "; ".join(f"group {i}: " + ", ".join(f"{k} {a!r} vs {b!r}" for k, a, b in off)
                                    for i, off in enumerate(settings) if off))
    return (model, optimizer), problems


def module_piece(p, weights):
    """The module's weights this rank holds of parameter ``p``, flat: stage 3 its partition (``ds_tensor``), else
    the whole tensor."""
    held = p.ds_tensor if hasattr(p, "ds_tensor") else weights
    return held.detach().float().cpu().flatten()


def own_piece(p, whole):
    """The same part of ``whole`` (flat): ZeRO-3 cuts each parameter into ceil(numel / world) pieces, the last
    padded with zeros, and rank r holds piece r."""
    if not hasattr(p, "ds_tensor"):
        return whole
    import torch
    import torch.distributed as dist

    n = p.ds_tensor.numel()
    rank = dist.get_rank() if dist.is_initialized() else 0
    padded = torch.cat([whole, whole.new_zeros(max(0, n * (rank + 1) - whole.numel()))])
    return padded[n * rank:n * (rank + 1)]


# ---- the universal checkpoint's files ----------------------------------------------------------------
def _tag(folder: str) -> str:
    """The universal checkpoint's own folder (``global_step<N>_universal``), which ``latest_universal`` names."""
    with open(os.path.join(folder, "latest_universal")) as f:
        return os.path.join(folder, f.read().strip())


def _load(zero: str, name: str, key: str):
    """One tensor of parameter ``name`` (``fp32``, ``exp_avg``, ...): stages 1 / 2 keep {"param": the tensor},
    stage 3 the tensor flattened."""
    import torch

    value = torch.load(os.path.join(zero, name, f"{key}.pt"), map_location="cpu", weights_only=False)
    return value["param"] if isinstance(value, dict) else value


def _saved_optimizer(tag: str) -> dict:
    """The writing optimizer's state dict of hyperparameters (and at stage 3 its step), from
    ``zero/optimizer_state.pt`` (at stage 3 inside the optimizer's own state dict)."""
    import torch

    saved = torch.load(os.path.join(tag, "zero", "optimizer_state.pt"), map_location="cpu", weights_only=False)
    return saved.get("optimizer_state_dict", saved)


def group_settings(saved: dict) -> list:
    """Each of the writing run's parameter groups' hyperparameters (``params`` left out)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]


def _shapes(tag: str) -> list:
    """The writing engine's parameter groups as {name: shape}, in its order (stage 3: a file per rank, the same)."""
    import torch

    states = sorted(glob.glob(os.path.join(tag, "*model_states.pt")))[0]
    return torch.load(states, map_location="cpu", weights_only=False)["param_shapes"]


# ---- read whole, by parameter name, by another strategy -------------------------------------------
def read_model(checkpoint: str, like) -> dict:
    """The model a DeepSpeed checkpoint holds, whole, by name: the saved model's tensors (its buffers, what was not
    trained) with every trained parameter's fp32 copy from the universal checkpoint (under bf16 / fp16 the saved
    model holds its rounding)."""
    from .layouts import read_saved_model

    whole = read_saved_model(checkpoint, like)
    tag = _tag(universal_folder(checkpoint))
    for group in _shapes(tag):
        for name, shape in group.items():
            fp32 = _load(os.path.join(tag, "zero"), name, "fp32").reshape(shape)
            whole[name] = fp32.to(whole[name].dtype if name in whole else None)
    return whole


def read_optimizer(checkpoint: str) -> dict:
    """The optimizer state a DeepSpeed checkpoint holds, whole, by parameter name (the full optimizer state dict
    of ``torch.distributed.checkpoint.state_dict``): each parameter's AdamW moments and step from the universal
    checkpoint, its groups' hyperparameters and members as the writing engine kept them."""
    import torch

    tag = _tag(universal_folder(checkpoint))
    zero, saved = os.path.join(tag, "zero"), _saved_optimizer(tag)
    shared_step = (saved.get("state") or {}).get(0, {}).get("step")  # stage 3: one step for all; 1 / 2: per file
    state, groups = {}, []
    for settings, members in zip(group_settings(saved), _shapes(tag)):
        groups.append({**settings, "params": list(members)})
        for name, shape in members.items():
            step = shared_step if shared_step is not None else _load(zero, name, "step")
            state[name] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                           **{key: _load(zero, name, key).reshape(shape) for key in STATES}}
    return {"state": state, "param_groups": groups}
