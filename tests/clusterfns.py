"""A user's build functions for the cluster tests: the tasks / workers import this module (tests/ is on
their PYTHONPATH, as a user's package is installed on every node)."""

from __future__ import annotations

import os

from trainfns import st_args, words


def _pairs(n: int = 32):
    from datasets import Dataset

    return Dataset.from_dict({"anchor": [f"what about {words(i)}" for i in range(n)],
                              "positive": [words(i) for i in range(n)]})


def build(steps: int = 3):
    """A user's trainer: the tiny model, MultipleNegativesRankingLoss, ``steps`` steps."""
    import tempfile

    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses

    from stnb.models import tiny_path

    model = SentenceTransformer(tiny_path(), device="cpu")
    # nothing is saved (save_strategy="no"): one shared folder, not a new one left behind by every rank of every run
    out = os.path.join(tempfile.gettempdir(), "stnb-cluster-build")
    return SentenceTransformerTrainer(model=model, args=st_args(out, max_steps=steps), train_dataset=_pairs(),
                                      loss=losses.MultipleNegativesRankingLoss(model))


def build_long():
    """Long enough to be killed or cancelled while it trains."""
    return build(steps=400)


def build_rank1_raises():
    """Rank 1 fails on purpose; rank 0 would train."""
    if os.environ.get("RANK") == "1":
        raise ValueError("rank 1 fails on purpose")
    return build()


def build_checkpointed(out: str, steps: int = 120, every: int = 10, slow_s: float = 0.0):
    """A user's trainer that checkpoints every ``every`` steps into ``out`` (the same folder in every attempt of
    a job); ``slow_s`` seconds more per step in a SLURM job's first attempt only (SLURM_RESTART_COUNT unset or 0):
    a long run cut short by a requeue, whose next attempt then finishes in seconds."""
    import time

    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import losses
    from transformers import TrainerCallback

    from stnb.models import tiny_path

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            time.sleep(slow_s)

    model = SentenceTransformer(tiny_path(), device="cpu")
    trainer = SentenceTransformerTrainer(
        model=model, args=st_args(out, max_steps=steps, save_strategy="steps", save_steps=every),
        train_dataset=_pairs(), loss=losses.MultipleNegativesRankingLoss(model))
    if slow_s and not int(os.environ.get("SLURM_RESTART_COUNT") or 0):
        trainer.add_callback(Slow())
    return trainer
