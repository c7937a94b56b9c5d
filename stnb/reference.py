"""The sentence-transformers documentation's distributed-training numbers: the one place they live.

These are *their* numbers on *their* hardware, published in the "Distributed Training" page of the
sentence-transformers documentation, never measured by stnb. Everything that shows them (the
plots' reference traces, the bench's st-docs preset and its notes, BENCHMARKS.md, notebook 05)
reads them from here.

    SAMPLES_PER_SECOND   {strategy: samples/s} as published
    PUBLISHED_SPEEDUP    {strategy: speed-up over one GPU} as printed in the docs (rounded there)
    rows()               one dict per strategy: devices, samples/s, speed-up, scaling efficiency
    CONDITIONS           their setup in one sentence
"""

from __future__ import annotations

from .strategies import baseline_name, is_distributed

SOURCE = "sentence-transformers docs (4x V100)"
URL = "https://sbert.net/docs/sentence_transformer/training/distributed.html"
HARDWARE = "AWS p3.8xlarge, 4x V100"
GPUS = 4
MODEL = "microsoft/mpnet-base"
MODEL_PARAMETERS = 109_486_464
MAX_SEQ_LENGTH = 384
PER_DEVICE_BATCH_SIZE = 32
TRAINING_DATA = "MultiNLI + SNLI (SoftmaxLoss) and STSB (CosineSimilarityLoss)"

SAMPLES_PER_SECOND = {"single": 2724.0, "dp": 3675.0, "ddp": 6980.0, "fsdp": 5782.0}
ONE_GPU = SAMPLES_PER_SECOND["single"]  # their one-GPU row, the input of every prediction from it
PUBLISHED_SPEEDUP = {"single": 1.0, "dp": 1.349, "ddp": 2.562, "fsdp": 2.122}

CONDITIONS = (f"{HARDWARE}, {MODEL} (about {round(MODEL_PARAMETERS, -7) / 1e6:.0f}M parameters), max_seq_length "
              f"{MAX_SEQ_LENGTH}, batch size {PER_DEVICE_BATCH_SIZE} per device, trained on {TRAINING_DATA}")


def devices(strategy: str) -> int:
    """GPUs a strategy used in their runs: one for 'single', all four for the others."""
    return 1 if strategy == baseline_name() else GPUS


def world_size(strategy: str) -> int:
    """Processes of a strategy in their runs: DDP and FSDP one per GPU, single and DP one."""
    return GPUS if is_distributed(strategy) else 1


def rows() -> list:
    """One dict per strategy: strategy, devices, samples_per_second, published_speedup and
    efficiency (= published speed-up / devices)."""
    return [{"strategy": s, "devices": devices(s), "samples_per_second": sps,
             "published_speedup": PUBLISHED_SPEEDUP[s], "efficiency": PUBLISHED_SPEEDUP[s] / devices(s)}
            for s, sps in SAMPLES_PER_SECOND.items()]
