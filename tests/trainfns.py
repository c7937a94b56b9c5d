"""What the tests' build functions share: short distinct sentences, and a user's training arguments
(few steps, no checkpoints, every step logged)."""

from __future__ import annotations

FAST = dict(num_processes=2, device="cpu", threads_per_rank=1, timeout=300)


def words(i: int) -> str:
    topics = ["cats purr softly", "rockets reach orbit", "bread rises slowly", "rivers cut valleys",
              "chess needs patience", "violins need rosin", "glaciers move slowly", "bees make honey"]
    return f"{topics[i % len(topics)]} {i}"


def st_args(out: str, **kw):
    from sentence_transformers import SentenceTransformerTrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, logging_steps=1,
                report_to="none", save_strategy="no", seed=7)
    base.update(kw)
    return SentenceTransformerTrainingArguments(**base)
