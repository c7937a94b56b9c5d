"""``Checkpoints``: in every rank of a run whose trainer saves checkpoints, each one written whole or not at all,
rotated only once it is complete, written only by the ranks that should, timed and measured (bytes each rank
wrote, seconds); and a resumed run checked to begin at its checkpoint's step (``stnb.checkpoints`` says how).

Reports ``checkpoints`` (every save: step, path, seconds, bytes written per rank) and ``resumed_from`` (the
checkpoint, its step, who wrote it, the step training began after); verification: ``resumed_at_step`` against
``resume_checkpoint_step``.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from ..checkpoints import MANIFEST, PARTIAL, PREFIX, TRAINER_STATE, batch_of, check_serves, step_of
from ..strategies import owner, save_strategy
from .base import Instrument


_SINK = None  # a launcher that tells its engine about every complete checkpoint (Ray Train): fn(path, step)


def set_checkpoint_sink(sink) -> None:
    """Call ``sink(path, step)`` in every rank once each checkpoint is complete (None: nobody)."""
    global _SINK
    _SINK = sink


def bytes_written() -> int | None:
    """Bytes this process has written so far (Linux: /proc/self/io's wchar; None elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Checkpoints(Instrument):
    """In every rank of a run whose trainer saves checkpoints: each save written whole or not at all, rotated
    after it is complete, written only by the ranks that should, timed and measured; the resume checked."""

    def __init__(self, trainer, strategy, rank: int, world: int, distributed: bool, base_model: str | None = None):
        self.trainer, self.strategy, self.base_model = trainer, strategy, base_model
        self.rank, self.world, self.distributed = rank, world, distributed
        self.saves: list = []
        self.resumed: dict | None = None
        args = trainer.args
        self.keep = args.save_total_limit  # stnb rotates, once the new checkpoint is complete
        strategy.saving(trainer)  # how this strategy's state is written and read (the trainer's own by default)
        if save_strategy(args) != "no":
            args.save_total_limit = None
            self._wrap()

    @classmethod
    def for_rank(cls, rank):
        """Made once the strategy prepared the trainer: the checkpoint ``rank.resume`` checked against this run."""
        here = rank.here
        saves = cls(rank.trainer, rank.strategy, here.rank, here.world, here.distributed, rank.build.initial_path)
        saves.resume_from(rank.resume)
        return saves

    def _wrap(self) -> None:
        trainer = self.trainer
        save_checkpoint, output_dir_of, save = trainer._save_checkpoint, trainer._get_output_dir, trainer._save
        inside = {"on": False}

        def get_output_dir(*a, **kw):
            run_dir = output_dir_of(*a, **kw)
            return os.path.join(run_dir, PARTIAL) if inside["on"] else run_dir

        def _save(output_dir=None, state_dict=None):
            # sentence-transformers' _save writes from every rank; the trainer's own writes from should_save only
            if trainer.args.should_save or getattr(trainer, "is_distributed_loading_by_transformers", False):
                return save(output_dir, state_dict=state_dict)
            return None

        def checkpoint(model, trial, *a, **kw):
            run_dir = output_dir_of(trial=trial)
            before, start = bytes_written(), time.perf_counter()
            inside["on"] = True
            try:
                out = save_checkpoint(model, trial, *a, **kw)
            finally:
                inside["on"] = False
            wrote = None if before is None else bytes_written() - before
            self._complete(run_dir, wrote, time.perf_counter() - start)
            return out

        trainer._get_output_dir, trainer._save, trainer._save_checkpoint = get_output_dir, _save, checkpoint

    def _complete(self, run_dir: str, wrote: int | None, seconds: float) -> None:
        """Every rank finished writing: rank 0 writes the manifest and renames the folder into place, then
        rotates; the trainer's pointer to the best checkpoint follows the rename on every rank."""
        import torch.distributed as dist

        step = self.trainer.state.global_step
        name = f"{PREFIX}{step}"
        written = [wrote]
        if self.distributed:
            written = [None] * self.world
            dist.all_gather_object(written, wrote)  # also the barrier: every rank finished writing
        staged, final = os.path.join(run_dir, PARTIAL, name), os.path.join(run_dir, name)
        state = self.trainer.state
        best = state.best_model_checkpoint
        if best and os.path.dirname(best) == os.path.join(run_dir, PARTIAL):  # the trainer named it while staged
            state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
        if self.rank == 0:
            record = {"step": step, "strategy": self.strategy.name, "format": self.strategy.checkpoint_format,
                      **self.strategy.checkpoint_layout(self.trainer.stnb_config), "world_size": self.world,
                      **self._batch(), "bytes_written": written, "written_at": time.time(),
                      "base_model": self.base_model}
            with open(os.path.join(staged, MANIFEST), "w") as f:
                json.dump(record, f, indent=1)
            state.save_to_json(os.path.join(staged, TRAINER_STATE))  # the best checkpoint's final path
            if os.path.exists(final):  # an older run's checkpoint of the same step, in the same folder
                shutil.rmtree(final)
            os.replace(staged, final)
            try:
                os.rmdir(os.path.dirname(staged))  # the staging folder, once empty
            except OSError:
                pass
            if self.keep:
                from transformers.trainer_utils import rotate_checkpoints

                rotate_checkpoints(output_dir=run_dir, save_total_limit=self.keep,
                                   best_model_checkpoint=state.best_model_checkpoint, use_mtime=False)
        self.saves.append({"step": step, "path": final, "seconds": seconds, "bytes_written": written})
        if self.distributed:
            from ..processes import wait_for_all

            wait_for_all()  # no rank goes on before the checkpoint is in place (a stop now keeps it)
        if _SINK is not None:
            _SINK(final, step)

    # ---- resuming ---------------------------------------------------------------------------
    def resume_from(self, path: str | None) -> str | None:
        """``path`` checked against this run before training (every rank); remembered to check the start."""
        if path is None:
            return None
        written = check_serves(path, self.strategy, self.world, self._batch(), self.trainer.stnb_config)
        self.trainer.stnb_checkpoint_writer = owner(written.get("format", "trainer"))  # reads it on another layout
        self.resumed = {"path": path, "step": step_of(path), "written_by": written.get("world_size"),
                        "written_strategy": written.get("strategy"), "read_by": self.world,
                        "read_strategy": self.strategy.name, "started_at_step": None}
        return path

    def on_step_begin(self, args, state, control, **kw):
        if self.resumed is not None and self.resumed["started_at_step"] is None:
            self.resumed["started_at_step"] = state.global_step  # the step before the first one this run takes

    def verification(self) -> tuple[dict, list]:
        if self.resumed is None:
            return {}, []
        r = self.resumed
        problems = []
        if r["started_at_step"] is not None and r["started_at_step"] != r["step"]:
            problems.append(f"resumed from {os.path.basename(r['path'])} (step {r['step']}) but training began after "
                            f"step {r['started_at_step']}")
        return {"resumed_at_step": r["started_at_step"], "resume_checkpoint_step": r["step"]}, problems

    def _batch(self) -> dict:
        args = self.trainer.args
        return batch_of(args.per_device_train_batch_size, args.gradient_accumulation_steps, self.world,
                        max(1, args.n_gpu))

    def report(self) -> dict:
        loaded = getattr(self.trainer, "stnb_loaded", None)  # another layout: how, tensors checked, RNG
        if self.resumed is not None and loaded:
            self.resumed["loaded"] = dict(loaded)
        return {"checkpoints": self.saves, "resumed_from": self.resumed}

