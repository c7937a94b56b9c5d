"""Checkpoints that survive a stop, and a run resumed from one (``TrainConfig(checkpoint_every=..., keep=...,
checkpoint_dir=..., resume="latest" | "auto" | path)``; a user's trainer: its own ``save_strategy`` / ``save_steps`` /
``save_total_limit`` and ``stnb.run(build, resume=...)``).

The trainer writes the checkpoint (``Trainer._save_checkpoint``: the model, the optimizer and scheduler, every
rank's RNG state, the trainer state with the data position); the strategy says how its state is written
(``Strategy.checkpoint_format``, ``Strategy.saving``: the trainer's own files, or each rank writing only its
shard); this module makes it safe to stop at any moment:

- **whole or absent.** Every rank writes into ``<output_dir>/.stnb-partial/checkpoint-N``; when all ranks have
  finished (a barrier), rank 0 writes the manifest (``stnb-checkpoint.json``: step, strategy, world size, bytes
  each rank wrote, seconds) and renames the folder to ``<output_dir>/checkpoint-N`` (one ``rename``, atomic).
  So every ``checkpoint-N`` is complete, for stnb's ``resume="latest"`` and for transformers'
  ``get_last_checkpoint`` alike; a rank killed while writing leaves the previous one as the latest.
- **keep never deletes the only whole one.** stnb takes over the trainer's ``save_total_limit`` and rotates
  (transformers' own ``rotate_checkpoints``, which keeps the best model's) only after the new checkpoint is
  complete.
- **only the ranks that should write, write.** sentence-transformers' ``_save`` lacks the trainer's
  ``should_save`` check, so without stnb every DDP rank writes the same model files.
- **resumed means resumed.** ``find`` refuses, before any rank starts where it can, a path with no checkpoint,
  a half-written one, or one written by a strategy or a world size this run cannot load; in the ranks
  ``Checkpoints`` checks that training really began at the checkpoint's step (``RunResult.resumed_from``).
- **one folder.** Every rank writes its part into the trainer's ``output_dir`` and looks there for ``latest``:
  ``one_folder`` refuses, before training, ranks whose ``output_dir`` differ (``tempfile.mkdtemp()`` inside a build
  function makes one per rank), which would leave every sharded checkpoint without the other ranks' parts.
"""

from __future__ import annotations

import json
import os
import re

from .errors import BuildError, CheckpointError, ConfigError
from .files import MANIFEST, manifest

PARTIAL = ".stnb-partial"
PREFIX = "checkpoint-"           # transformers' PREFIX_CHECKPOINT_DIR
TRAINER_STATE = "trainer_state.json"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")
#: resume= besides a checkpoint's path: LATEST, the newest complete checkpoint (refused when there is none); AUTO,
#: the newest if there is one, else step 0 (what a script that may be requeued asks)
LATEST, AUTO = "latest", "auto"


# ---- reading what is on disk --------------------------------------------------------------------
def complete(folder) -> list:
    """[(step, path)] of the complete checkpoints in ``folder``, oldest first: ``checkpoint-N`` folders holding
    the trainer's state (stnb's are renamed there only once every rank finished writing)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        m = _STEP.match(name)
        path = os.path.join(folder, name)
        if m and _is_checkpoint(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def partial(folder) -> list:
    """Paths of the half-written checkpoints in ``folder`` (a stop while every rank was writing)."""
    root = os.path.join(os.fspath(folder), PARTIAL)
    return sorted(os.path.join(root, n) for n in os.listdir(root)) if os.path.isdir(root) else []


def one_folder(args, resume, distributed: bool) -> str | None:
    """The trainer's ``output_dir`` (``args``: its training arguments) made absolute, checked, when the run uses it
    (the trainer saves checkpoints, or ``resume`` looks for the latest one there), to be the same folder on every
    rank (a collective: every rank calls it): each rank writes its part of every checkpoint there (its shard, its RNG
    state), and rank 0 completes it. BuildError on every rank, naming each rank's folder, when they differ."""
    folder = os.path.abspath(os.path.expanduser(os.fspath(args.output_dir))) if args.output_dir else None
    if not distributed:
        return folder
    import torch.distributed as dist

    from .strategies import save_strategy

    uses = save_strategy(args) != "no" or resume in (LATEST, AUTO)

    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (folder, uses))
    if any(u for _, u in seen) and len({f for f, _ in seen}) > 1:
        where = ", ".join(f"rank {r}: {f}" for r, (f, _) in enumerate(seen))
        raise BuildError(f"your trainer's output_dir is a different folder on each rank ({where}), and this run "
                         "saves checkpoints or resumes from the latest one there: each rank would write its part of "
                         "every checkpoint into its own folder, and none would be whole. Give output_dir one path "
                         "every rank shares (a fixed path, or a plain value made once in the notebook: "
                         "tempfile.mkdtemp() inside the build function makes a new folder in every rank)")
    return folder


def resume_point(resume, folder, restarted: bool = False) -> str | None:
    """The checkpoint a run continues from (None: step 0), in the rank, once its ``folder`` (the trainer's
    output_dir) is known. ``restarted``: the engine restarted this very run (a requeued SLURM job): the newest
    complete checkpoint in ``folder`` wins over ``resume`` (it is further along the same run)."""
    found = complete(folder) if folder else []
    if found and (restarted or resume == AUTO):
        return found[-1][1]
    if resume in (None, "", AUTO):
        return None
    return find(resume, folder)


def find(resume, folder) -> str:
    """The checkpoint ``resume`` names: 'latest' (the newest complete one in ``folder``), a run folder (its
    newest), or a checkpoint folder. CheckpointError naming what is there instead."""
    where = folder
    if resume != LATEST:
        path = os.path.abspath(os.fspath(resume))
        if not os.path.exists(path):
            raise CheckpointError(f"resume={resume!r}: no such folder; give 'latest', a run's checkpoint folder or "
                                  "one of its checkpoint-N folders")
        if PARTIAL in (os.path.basename(path), os.path.basename(os.path.dirname(path))):
            raise CheckpointError(f"resume={resume!r} is a half-written checkpoint (not every rank finished writing "
                                  f"it); resume from {os.path.dirname(os.path.dirname(path))!r} ('latest' there) "
                                  "instead")
        if _is_checkpoint(path):
            return os.fspath(resume)
        if not os.path.isdir(path):
            raise CheckpointError(f"resume={resume!r} holds no {TRAINER_STATE}: not a trainer checkpoint")
        where = resume  # a run folder: its newest
    found = complete(where) if where else []
    if found:
        return found[-1][1]
    half = partial(where) if where else []
    raise CheckpointError(
        f"resume={resume!r}: no complete checkpoint in {where!r}"
        + (f" (half-written, never completed by every rank: {', '.join(map(os.path.basename, half))})" if half else "")
        + "; train with checkpoint_every=N (your trainer: save_strategy='steps', save_steps=N) first, or leave "
          "resume out (or resume='auto': the newest if there is one) to start from step 0")


def _is_checkpoint(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), TRAINER_STATE))


def step_of(path) -> int:
    """The optimizer step a checkpoint was written after (its trainer state's ``global_step``)."""
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return int(json.load(f)["global_step"])


def check_serves(path, strategy, world: int, batch: dict | None = None, config=None) -> dict:
    """The checkpoint's manifest; CheckpointError when this run (``strategy`` on ``world`` ranks, with the
    options of ``config``) cannot load what it holds (``strategy.loads`` says which layouts it reads: its own, or
    another whose writer can be read by parameter name, ``stnb.strategies.layouts``), or would train on with
    another global batch (``batch``: this run's, ``batch_of``; None: not known here)."""
    written = manifest(path)
    if not written:
        return {}  # a checkpoint of the trainer without stnb: the trainer's own format
    from .strategies import owner

    why = strategy.loads(path, written, world, owner(written.get("format", "trainer")), config)
    if why:
        raise CheckpointError(f"{path} was written by {written.get('world_size')} rank(s) of strategy "
                              f"{written.get('strategy')!r} ({written.get('format', 'trainer')} format); strategy "
                              f"{strategy.name!r} on {world} rank(s) cannot resume it: {why}")
    if batch is not None:
        _check_batch(path, written, world, batch)
    return written


def check_recipe(config) -> None:
    """stnb's recipe, before any process starts: its checkpoint options hang together, the checkpoint to resume
    from exists, is complete and is one this run can load, and checkpoints never land among another run's."""
    every, folder, keep = config.checkpoint_every, config.checkpoint_dir, config.keep
    asked = [f"{name}={value!r}" for name, value in (("checkpoint_every", every), ("keep", keep),
                                                     ("resume", config.resume)) if value]
    if asked and not folder:
        raise ConfigError(f"{', '.join(asked)} needs checkpoint_dir=... (the folder the checkpoints go to and "
                          "resume='latest' reads them from)")
    if keep and not every:
        raise ConfigError(f"keep={keep} keeps checkpoints, and checkpoint_every=0 writes none: set checkpoint_every=N")
    path = config.resume and resume_point(config.resume, os.path.expanduser(folder))
    if path:
        check_serves(path, config.strategy_object(), config.world_size(),
                     batch_of(config.per_device_batch_size, config.gradient_accumulation_steps, config.world_size(),
                              config.devices_per_process()), config)
        step = step_of(path)
        if step >= config.steps:
            raise CheckpointError(f"{path} is at step {step} and this run ends at steps={config.steps}: nothing is "
                                  f"left to train; ask for more steps (steps > {step})")
    elif every and (found := complete(os.path.expanduser(folder))):  # (resume='auto' found none there)
        latest = os.path.basename(found[-1][1])
        raise ConfigError(f"checkpoint_dir={folder!r} already holds another run's checkpoints (latest {latest}); "
                          "resume='latest' (or 'auto') continues that run, or choose a new folder (stnb never mixes two runs' "
                          "checkpoints)")


def to_model(checkpoint, like=None, device: str = "cpu"):
    """The model a checkpoint holds, as an ordinary sentence-transformers model on one device. A checkpoint in
    the trainer's format is a saved model already (``SentenceTransformer(checkpoint)``); a sharded one is read
    by the strategy that wrote it into ``like`` (the untrained model or its path; default: the manifest's
    ``base_model``, stnb's recipe records it), whatever number of ranks wrote it."""
    from .strategies import owner

    checkpoint = find(checkpoint, None)  # a checkpoint, or a run folder: its newest
    written = manifest(checkpoint)
    fmt = written.get("format", "trainer")
    writer = owner(fmt)
    if not hasattr(writer, "checkpoint_model"):
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(checkpoint, device=device)
    like = like or written.get("base_model")
    if like is None:
        raise CheckpointError(f"{checkpoint} holds shards ({fmt}); pass like= the untrained model (or its path) to "
                              "read them into")
    return writer.checkpoint_model(checkpoint, like, device)


# ---- the global batch a resumed run keeps ------------------------------------------------------------
def batch_of(per_device: int, accumulation: int, world: int, devices: int = 1) -> dict:
    """A run's batch as a checkpoint's manifest records it: the samples of one optimizer step over every rank
    (``devices``: those one process drives, dp's GPUs)."""
    return {"per_device_batch_size": per_device, "gradient_accumulation_steps": accumulation,
            "devices_per_rank": devices, "global_batch": per_device * devices * accumulation * world}


def _check_batch(path, written: dict, world: int, batch: dict) -> None:
    """CheckpointError when the run resuming ``written`` would take other batches than the run that wrote it: the
    data position (batches skipped) and the optimizer's steps count batches of the global batch."""
    had, have = written.get("global_batch"), batch["global_batch"]
    if had is None:
        if written.get("world_size") != world:
            raise CheckpointError(f"{path} does not record its global batch (written before stnb recorded it): on "
                                  f"{world} rank(s) it cannot be kept; resume it with "
                                  f"num_processes={written.get('world_size')}")
        return
    if had == have:
        return
    p, a, d = batch["per_device_batch_size"], batch["gradient_accumulation_steps"], batch.get("devices_per_rank", 1)
    fixes = []
    if had % (world * a * d) == 0:
        fixes.append(f"per_device_batch_size={had // (world * a * d)} (your own trainer: per_device_train_batch_size)")
    if had % (world * p * d) == 0 and had // (world * p * d) != a:
        fixes.append(f"gradient_accumulation_steps={had // (world * p * d)}")
    fix = (" or ".join(fixes) if fixes
           else f"a number of ranks that divides it (num_processes={written.get('world_size')})")
    raise CheckpointError(
        f"{path} was written by a run whose optimizer step took {had} samples ({written.get('world_size')} rank(s) x "
        f"{written.get('per_device_batch_size')} per device x {written.get('gradient_accumulation_steps')} "
        f"accumulated); this run's takes {have} ({world} rank(s) x {p} x {a}): the data position and the optimizer's "
        f"steps count batches of {had} samples. Keep it with {fix}")
