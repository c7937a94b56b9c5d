"""What a bench run is asked to do: the presets, the sections, ``BenchOptions`` and the device it runs on.

Nothing here starts a process. ``check_preset`` refuses a preset this machine cannot run before
anything else happens; ``bench_device`` says where the runs will go (and why, on one GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from stnb import reference
from stnb.errors import ConfigError

SECTIONS = ("sweep", "launchers", "knobs", "checkpoints")

# every preset's sweep runs the strategies that ask for a bench row (``Strategy.bench``: single, dp, ddp,
# fsdp), asked of the registry when the options are made (``bench_strategies``)
PRESETS = {
    # this machine, CPU or GPU: the bundled MiniLM at sequence length 64
    "default": dict(model="minilm", max_seq_length=64, data="synthetic", loss="cosine",
                    batch_sizes=(8, 16, 32), batch_size=16, steps=40, warmup=3, repeats=3, sweep_repeats=1,
                    train_size=4000),
    # a smoke test of every section: random tiny BERT, a few steps, one repeat (about a minute on 2 cores)
    "quick": dict(model="tiny", max_seq_length=64, data="synthetic", loss="cosine",
                  batch_sizes=(16,), batch_size=16, steps=8, warmup=2, repeats=1, sweep_repeats=1, train_size=400),
    # the sentence-transformers docs' setting (stnb.reference: 4x V100 there): mpnet-base, length 384,
    # 32 per device, offline: the mpnet-base architecture with random weights (models 'mpnet-base-random')
    # and the docs' recipe, NLI pairs with SoftmaxLoss + STS pairs with CosineSimilarityLoss in one
    # multi-dataset run (stnb.seed_recipe), on synthetic stand-ins of those shapes (5749 rows in all, as
    # many as STS-B's training pairs, split evenly between the two)
    "st-docs": dict(model="mpnet-base-random", max_seq_length=reference.MAX_SEQ_LENGTH, data="synthetic",
                    loss="softmax+cosine", batch_sizes=(reference.PER_DEVICE_BATCH_SIZE,),
                    batch_size=reference.PER_DEVICE_BATCH_SIZE, steps=60, warmup=5, repeats=3, sweep_repeats=1,
                    train_size=5749),
}

#: presets that measure GPUs: with device 'auto' they run on the GPU(s) even where DDP cannot (1 GPU)
GPU_PRESETS = ("st-docs",)

ST_DOCS_NOTE = (f"sentence-transformers docs, 'Distributed Training' comparison: {reference.MODEL}, "
                f"max_seq_length {reference.MAX_SEQ_LENGTH}, {reference.PER_DEVICE_BATCH_SIZE} per device, "
                "single / DP / DDP (FSDP added here); they trained "
                f"{reference.TRAINING_DATA}. stnb runs offline: the "
                "mpnet-base architecture built from its config with random weights ('mpnet-base-random', "
                "same shapes, so the same cost per step) and trains the seed's shape: NLI pairs with "
                "SoftmaxLoss and STS pairs with CosineSimilarityLoss in one multi-dataset run (loss "
                "'softmax+cosine'), on synthetic stand-ins of the same shapes (NOT MultiNLI, SNLI or STSB; "
                "--data hub trains the real ones where the hub is reachable), and reports samples/s and MFU. "
                "Batches are padded to their longest text, so the short synthetic sentences run far below "
                f"{reference.MAX_SEQ_LENGTH} tokens (see tokens/sample)")


def bench_strategies() -> tuple:
    """The strategies the bench's sweep runs unless told otherwise: those whose ``bench`` is set."""
    from stnb import strategies

    return tuple(s.name for s in strategies.all_strategies() if s.bench)


def check_preset(name: str, device: str = "auto") -> None:
    """Raise ConfigError when preset ``name`` cannot run on this machine; nothing runs before this.

    'st-docs' needs no network (the model is built locally, the data is synthetic). It measures
    GPUs: on a machine without one it refuses unless ``device='cpu'`` is asked for explicitly (a
    smoke test, e.g. with ``--model mpnet-mini-random``). On 1 GPU it runs the single-GPU row and
    lists dp / ddp / fsdp as not runnable here, with the reason.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(map(repr, PRESETS))}")
    if name not in GPU_PRESETS or device == "cpu":
        return
    from stnb.hardware import gpu_count

    n = gpu_count()
    if n == 0:
        raise ConfigError(
            "preset 'st-docs' cannot run here: it measures GPUs (the sentence-transformers docs' multi-GPU "
            f"benchmark: mpnet-base, max_seq_length {reference.MAX_SEQ_LENGTH}, "
            f"{reference.PER_DEVICE_BATCH_SIZE} per device) and this machine has {n} CUDA GPUs; "
            "it does not substitute the CPU silently. Run it on a GPU machine (1 GPU: the single row; 2+: "
            "dp/ddp/fsdp too), add --device cpu for a CPU smoke test (e.g. --model mpnet-mini-random "
            "--max-seq-length 32 --batch-sizes 4), or run `python -m stnb bench` (MiniLM on this machine).")


@dataclass
class BenchOptions:
    """What to run. ``BenchOptions.from_preset('default' | 'quick' | 'st-docs', **overrides)``."""

    preset: str = "default"
    model: str = "minilm"
    max_seq_length: int = 64
    data: str = "synthetic"
    loss: str = "cosine"
    strategies: tuple | None = None      # sweep; None: every strategy with a bench row (``bench_strategies``)
    batch_sizes: tuple = (8, 16, 32)     # sweep
    nprocs: tuple | None = None          # sweep; None: 2 .. every device
    batch_size: int = 16                 # per-device batch of the launcher / knob comparisons
    comparison_nproc: int | None = None  # ranks of the comparisons; None: every device (2 on 2 cores)
    steps: int = 40
    warmup: int = 3
    repeats: int = 3
    sweep_repeats: int = 1
    train_size: int = 4000
    device: str = "auto"
    sections: tuple = SECTIONS
    knobs: tuple | None = None           # knob variant names; None: all for this device
    accumulate: int | None = None        # micro-batches of the 'accumulate A' knob variants (None: 4, quick 2)
    whole_machine: bool = False          # knobs, CPU: also one process with every core at DDP's global batch
    results: str | None = None
    report: str | None = None
    run_timeout: float = 900.0
    quiet_wait: float = 0.0              # before each run, wait up to this long for other processes to calm down
    echo: bool = True
    doc: str | None = None               # a benchmarks document (markdown) to write this run's tables into
    command: str | None = None           # the command line that asked for this run (recorded in the document)

    def __post_init__(self):
        if self.strategies is None:
            self.strategies = bench_strategies()

    @classmethod
    def from_preset(cls, preset: str = "default", **overrides) -> "BenchOptions":
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(map(repr, PRESETS))}")
        base = dict(PRESETS[preset])
        if preset == "st-docs":
            base["sections"] = ("sweep",)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(preset=preset, **base)

    def results_path(self) -> Path:
        return Path(self.results or os.path.join("artifacts", "bench", f"{self.preset}.jsonl"))

    def checkpoint_root(self) -> Path:
        """Where the checkpoints section's runs write their checkpoints (one folder per strategy, emptied before
        each run and removed after it: only their cost is kept)."""
        return self.results_path().with_name(self.results_path().stem + "-checkpoints")

    def report_path(self) -> Path:
        if self.report:
            return Path(self.report)
        return self.results_path().with_suffix(".html")


def bench_device(opts: BenchOptions) -> tuple:
    """(device, note): the device the bench runs on. With device 'auto' and a single GPU, DDP/FSDP
    (2 ranks, one per GPU) cannot run there, so the comparisons run on CPU ranks, as the notebooks do;
    the note says so. device='cuda' runs what the GPUs allow and marks the rest not runnable, and so
    does a preset that measures GPUs (``GPU_PRESETS``: 'st-docs') with device 'auto'."""
    from stnb.hardware import default_device, device_for_ranks, gpu_count

    if opts.device != "auto":
        return opts.device, ""
    if opts.preset in GPU_PRESETS:  # it measures GPUs: on 1 GPU the single row, the rest not runnable
        return default_device(), ""
    device = device_for_ranks(2)
    if device != default_device():
        return device, (f"{gpu_count()} GPU: DDP/FSDP need 2 ranks (one per GPU), so the bench compares on "
                        f"CPU ranks; pass device='cuda' to run the GPU rows one GPU allows")
    return device, ""
