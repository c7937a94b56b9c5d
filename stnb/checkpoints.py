"""Checkpoints that survive a stop, and a run resumed from one (``TrainConfig(checkpoint_every=..., keep=...,
checkpoint_dir=..., resume="latest" | path)``; a user's trainer: its own ``save_strategy`` / ``save_steps`` /
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
"""

from __future__ import annotations

import json
import os
import re

from .errors import ConfigError

MANIFEST = "stnb-checkpoint.json"
PARTIAL = ".stnb-partial"
PREFIX = "checkpoint-"           # transformers' PREFIX_CHECKPOINT_DIR
TRAINER_STATE = "trainer_state.json"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from: missing, half-written, or not one this run can load."""


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


def manifest(path) -> dict:
    """The manifest stnb wrote beside a checkpoint ({} for one written without stnb)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def find(resume, folder) -> str:
    """The checkpoint ``resume`` names: 'latest' (the newest complete one in ``folder``), a run folder (its
    newest), or a checkpoint folder. CheckpointError naming what is there instead."""
    where = folder
    if resume != "latest":
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
          "resume out to start from step 0")


def _is_checkpoint(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), TRAINER_STATE))


def step_of(path) -> int:
    """The optimizer step a checkpoint was written after (its trainer state's ``global_step``)."""
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return int(json.load(f)["global_step"])


def check_serves(path, strategy, world: int) -> dict:
    """The checkpoint's manifest; CheckpointError when this run (``strategy`` on ``world`` ranks) cannot load
    what it holds: another format (a sharded checkpoint into replicated training, or the reverse), or a
    sharded one written by another number of ranks."""
    written = manifest(path)
    if not written:
        return {}  # a checkpoint of the trainer without stnb: the trainer's own format
    fmt, mine = written.get("format", "trainer"), strategy.checkpoint_format
    if fmt != mine:
        raise CheckpointError(
            f"{path} was written by strategy {written.get('strategy')!r} ({fmt} format) and strategy "
            f"{strategy.name!r} loads the {mine} format; resume it with strategy={written.get('strategy')!r}")
    if written.get("world_size") != world:
        raise CheckpointError(
            f"{path} was written by {written.get('world_size')} rank(s) of {written.get('strategy')!r}; this run has "
            f"{world}: resume it with num_processes={written.get('world_size')} (another number of ranks changes the "
            "global batch and the data each rank reads)")
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
    if config.resume:
        path = find(config.resume, os.path.expanduser(folder))
        check_serves(path, config.strategy_object(), config.world_size())
        step = step_of(path)
        if step >= config.steps:
            raise CheckpointError(f"{path} is at step {step} and this run ends at steps={config.steps}: nothing is "
                                  f"left to train; ask for more steps (steps > {step})")
    elif every and (found := complete(os.path.expanduser(folder))):
        latest = os.path.basename(found[-1][1])
        raise ConfigError(f"checkpoint_dir={folder!r} already holds another run's checkpoints (latest {latest}); "
                          "resume='latest' continues that run, or choose a new folder (stnb never mixes two runs' "
                          "checkpoints)")


def to_model(checkpoint, like=None, device: str = "cpu"):
    """The model a checkpoint holds, as an ordinary sentence-transformers model on one device. A checkpoint in
    the trainer's format is a saved model already (``SentenceTransformer(checkpoint)``); a sharded one is read
    by the strategy that wrote it into ``like`` (the untrained model or its path; default: the manifest's
    ``base_model``, stnb's recipe records it), whatever number of ranks wrote it."""
    from . import strategies

    checkpoint = find(checkpoint, None)  # a checkpoint, or a run folder: its newest
    written = manifest(checkpoint)
    fmt = written.get("format", "trainer")
    writer = next((s for s in strategies.all_strategies()
                   if s.checkpoint_format == fmt and hasattr(s, "checkpoint_model")), None)
    if writer is None:
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(checkpoint, device=device)
    like = like or written.get("base_model")
    if like is None:
        raise CheckpointError(f"{checkpoint} holds shards ({fmt}); pass like= the untrained model (or its path) to "
                              "read them into")
    return writer.checkpoint_model(checkpoint, like, device)
