"""One training run: model + data + loss -> SentenceTransformerTrainer -> RunResult.

``run(config)`` validates the config in the notebook process, then starts the ranks through
``stnb.launch`` (ddp/fsdp: N ranks; single/dp: one child process, so CUDA never touches the
kernel). Every rank runs ``train_rank`` and returns its measurements; ``run`` merges them.
"""

from __future__ import annotations

import os
import time

from .config import TrainConfig
from .errors import ConfigError
from .launch import launch
from .results import RunResult, append_result, check_writable, merge
from .training import train_rank


def run(config: TrainConfig | None = None, *, results_file=None, on_progress=None, echo: bool = True,
        **overrides) -> RunResult:
    """Train once with ``config`` and return a verified, measured RunResult.

    results_file: a JSONL file the result is appended to (atomically) as soon as it exists.
    on_progress: callback receiving per-rank progress (see ``stnb.launch``).
    Keyword overrides are applied to the config: ``run(strategy="ddp", steps=5)``.
    """
    from .hardware import gpu_count
    from .models import resolve_model

    config = (config or TrainConfig()).replace(**overrides) if overrides else (config or TrainConfig())
    from . import scaleout

    if scaleout.inside_external_launch():  # a rank of torchrun / accelerate launch: don't launch again
        return scaleout.run_here(config, results_file=results_file)
    config.validate()
    if results_file is not None:
        check_writable(results_file)
    if config.save_to:
        target = os.path.abspath(os.path.expanduser(config.save_to))
        if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
            raise ConfigError(f"save_to={config.save_to!r} already exists and is not empty; stnb never "
                              "overwrites a saved model. Choose a new folder or remove the old one.")
    model_path = resolve_model(config.model)  # builds 'tiny' once, here, so ranks never race
    _preimport()
    device = config.resolved_device()
    ws = config.world_size()
    env = {}
    if device == "cuda" and config.strategy == "single":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[0] if visible else "0"
    t0 = time.time()
    bars = None
    if on_progress is None and echo:
        bars = StepBars(config.strategy)
        on_progress = bars.update
    try:
        # the requested world size travels as an argument, apart from the environment the launcher sets
        rank_results = launch(train_rank, config, model_path, t0, ws, num_processes=ws,
                              timeout=config.timeout, stall_timeout=config.stall_timeout, device=device,
                              threads_per_rank=config.threads_per_rank, on_progress=on_progress, echo=echo,
                              distributed=config.strategy in ("ddp", "fsdp"), env=env)
    finally:
        if bars is not None:
            bars.close()
    result = merge(config, rank_results, device=device, n_gpu=gpu_count(), wall_time_s=time.time() - t0)
    if results_file is not None:
        append_result(results_file, result)
    return result


def _preimport() -> None:
    """Import the training stack once in this process: forked ranks inherit it instead of each
    importing it again (6-8 CPU seconds per rank). None of it initialises CUDA."""
    import sentence_transformers  # noqa: F401
    import sentence_transformers.sentence_transformer.losses  # noqa: F401
    import sentence_transformers.sentence_transformer.evaluation  # noqa: F401
    import transformers.trainer  # noqa: F401


class StepBars:
    """Default live progress for ``run``: one tqdm bar per rank (a widget in Jupyter, text elsewhere),
    fed from the launch's progress relay in this process: ranks never draw bars themselves."""

    def __init__(self, label: str):
        self.label = label
        self.bars = {}

    def update(self, states) -> None:
        from tqdm.auto import tqdm

        for st in states:
            if st.total <= 0:
                continue
            bar = self.bars.get(st.rank)
            if bar is None:
                bar = self.bars[st.rank] = tqdm(total=st.total, desc=f"{self.label} rank {st.rank}",
                                                unit="step", leave=True, mininterval=0.5)
            if st.step > bar.n:
                bar.update(st.step - bar.n)
            if st.loss is not None:
                bar.set_postfix(loss=f"{st.loss:.4f}", refresh=False)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
