"""A plain sentence-transformers training script: the baseline stnb's single-GPU throughput is held to.

    python -m stnblab.gpucheck.plain --model PATH --batch-size 32 --steps 150 --warmup 10 \\
        --max-seq-length 128 --mixed-precision bf16 --train-size 2000 --seed 42

What a user writes without stnb: SentenceTransformer + CosineSimilarityLoss +
SentenceTransformerTrainer. Only the data comes from stnb (the same synthetic pairs stnb.run trains
on). ``--logging-steps`` (the trainer's default: 500) is given stnb's own (``recipe.LOGGING_STEPS``,
every step) by the gpu-check, so both pay the same per-step loss read and logging path. Each step is
timed like stnb's RunResult (from the end of the step before to the end of this one); samples/s is
batch x measured steps over the time from the end of the last warm-up step to the end of the last
step. Prints one JSON line: samples_per_second, step_times (the measured steps), logged_steps, and
on a GPU the MFU of the measured steps (``stnb.mfu``'s FLOP count of every forward, the chip's peak).

What the stack offers beyond the defaults (the GPU-bound MFU row tries them): ``--data`` a pairs file
(long texts), ``--attn`` the attention kernel (``eager``, ``sdpa``: transformers' ``attn_implementation``),
``--compile`` the transformer under ``torch.compile`` (the module stnb counts FLOPs on stays eager).
"""

from __future__ import annotations

import argparse
import json
import shutil
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
    p.add_argument("--data", default="synthetic", help="stnb.data.load_pairs' spec: 'synthetic' or a pairs file")
    p.add_argument("--attn", default=None, help="attention kernel (attn_implementation); default: the model's")
    p.add_argument("--compile", action="store_true", help="torch.compile the Hugging Face transformer")
    p.add_argument("--workers", type=int, default=0, help="dataloader worker processes: the collator tokenizes there, "
                   "beside the GPU's step, instead of in the training loop (0: the trainer's default)")
    a = p.parse_args(argv)

    import torch
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss
    from transformers import TrainerCallback

    from stnb.data import load_pairs
    from stnb.mfu import FlopMeter, device_peak

    import psutil

    ends, workers = [], []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            meter.start_step()

        def on_step_end(self, args, state, control, **kw):
            meter.end_step()
            ends.append(time.perf_counter())
            if len(ends) == 1:  # the dataloader's worker processes, as they are while training runs
                workers.append(len(psutil.Process().children()))

    torch.manual_seed(a.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = {"model_kwargs": {"attn_implementation": a.attn}} if a.attn else {}
    model = SentenceTransformer(a.model, device=device, **kwargs)
    model.max_seq_length = a.max_seq_length
    meter = FlopMeter(model)  # on model[0], outside what --compile compiles
    if a.compile:
        model[0].auto_model.compile()
    train, _ = load_pairs(a.data, a.train_size, max(1, a.dev_size), a.seed)  # stnb.run's train pairs
    args = SentenceTransformerTrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="stnb-plain-"), per_device_train_batch_size=a.batch_size,
        max_steps=a.steps, learning_rate=a.lr, seed=a.seed, report_to="none", save_strategy="no",
        disable_tqdm=True, bf16=a.mixed_precision == "bf16", fp16=a.mixed_precision == "fp16",
        use_cpu=device == "cpu", logging_steps=a.logging_steps, dataloader_num_workers=a.workers)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train,
                                         loss=CosineSimilarityLoss(model), callbacks=[StepClock()])
    trainer.train()
    shutil.rmtree(args.output_dir, ignore_errors=True)  # nothing saved in it (save_strategy='no'): scratch
    measured = len(ends) - a.warmup
    span = ends[-1] - ends[a.warmup - 1] if measured > 0 and a.warmup >= 1 else None
    step_times = [b - e for e, b in zip(ends[a.warmup - 1:], ends[a.warmup:])] if a.warmup >= 1 else []
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    logged = len(losses)
    flops = sum(meter.per_step[a.warmup:]) if span else 0.0
    peak = device_peak(device, a.mixed_precision)
    print(json.dumps({"samples_per_second": a.batch_size * measured / span if span else None, "steps": len(ends),
                      "step_times": step_times, "logged_steps": logged, "logging_steps": args.logging_steps,
                      "device": device, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
                      "achieved_tflops": flops / span / 1e12 if span else None,
                      "mfu": flops / span / peak["flops_per_s"] if span and peak else None,
                      "peak_tflops": peak["flops_per_s"] / 1e12 if peak else None,
                      "tokens_per_sample": sum(meter.tokens[a.warmup:]) / (a.batch_size * measured) if span else None,
                      "attn": model[0].auto_model.config._attn_implementation, "compiled": a.compile,
                      "dataloader_workers_seen": workers[0] if workers else None,
                      "final_loss": losses[-1] if losses else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
