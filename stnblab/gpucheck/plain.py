"""A plain sentence-transformers training script: the baseline stnb's single-GPU throughput is held to.

    python -m stnblab.gpucheck.plain --model PATH --batch-size 32 --steps 150 --warmup 10 \\
        --max-seq-length 128 --mixed-precision bf16 --train-size 2000 --seed 42

What a user writes without stnb: SentenceTransformer + CosineSimilarityLoss +
SentenceTransformerTrainer. Only the data comes from stnb (the same synthetic pairs stnb.run trains
on). ``--logging-steps`` (the trainer's default: 500) is given stnb's own (``recipe.LOGGING_STEPS``,
every step) by the gpu-check, so both pay the same per-step loss read and logging path. Each step is
timed like stnb's RunResult (from the end of the step before to the end of this one); samples/s is
batch x measured steps over the time from the end of the last warm-up step to the end of the last
step. Prints one JSON line: samples_per_second, step_times (the measured steps), logged_steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stnblab.gpucheck.plain")
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--mixed-precision", default="no", choices=("no", "bf16", "fp16"))
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--dev-size", type=int, default=64, help="as stnb.run's config: the same split of the same pairs")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--logging-steps", type=int, default=500, help="the trainer's default unless given")
    a = p.parse_args(argv)

    import torch
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss
    from transformers import TrainerCallback

    from stnb.data import load_pairs

    ends = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    torch.manual_seed(a.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = SentenceTransformer(a.model, device=device)
    model.max_seq_length = a.max_seq_length
    train, _ = load_pairs("synthetic", a.train_size, max(1, a.dev_size), a.seed)  # stnb.run's train pairs
    args = SentenceTransformerTrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="stnb-plain-"), per_device_train_batch_size=a.batch_size,
        max_steps=a.steps, learning_rate=a.lr, seed=a.seed, report_to="none", save_strategy="no",
        disable_tqdm=True, bf16=a.mixed_precision == "bf16", fp16=a.mixed_precision == "fp16",
        use_cpu=device == "cpu", logging_steps=a.logging_steps)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train,
                                         loss=CosineSimilarityLoss(model), callbacks=[StepClock()])
    trainer.train()
    measured = len(ends) - a.warmup
    span = ends[-1] - ends[a.warmup - 1] if measured > 0 and a.warmup >= 1 else None
    step_times = [b - e for e, b in zip(ends[a.warmup - 1:], ends[a.warmup:])] if a.warmup >= 1 else []
    logged = sum(1 for entry in trainer.state.log_history if "loss" in entry)
    print(json.dumps({"samples_per_second": a.batch_size * measured / span if span else None, "steps": len(ends),
                      "step_times": step_times, "logged_steps": logged, "logging_steps": args.logging_steps,
                      "device": device, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
