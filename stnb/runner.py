"""One training run: model + data + loss -> SentenceTransformerTrainer -> RunResult.

``run(config)`` validates the config in the notebook process, then starts the ranks through
``stnb.launch`` (ddp/fsdp: N ranks; single/dp: one child process, so CUDA never touches the
kernel). Every rank runs ``train_rank`` and returns its measurements; ``run`` merges them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid

from .config import TrainConfig
from .errors import ConfigError
from .launch import launch, rank_context, report_progress
from .results import RunResult, append_result, check_writable


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
        from .hardware import single_gpu_env

        env = single_gpu_env()
    t0 = time.time()
    bars = None
    if on_progress is None and echo:
        bars = StepBars(config.strategy)
        on_progress = bars.update
    try:
        rank_results = launch(train_rank, config.to_dict(), model_path, t0, num_processes=ws,
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


def merge(config: TrainConfig, rank_results: list, device: str, n_gpu: int = 0,
          wall_time_s: float | None = None, launcher: str = "stnb") -> RunResult:
    """Combine every rank's measurements into one RunResult."""
    from .hardware import versions

    r0 = rank_results[0]
    n_steps = min(len(r["step_times"]) for r in rank_results)
    step_times = [max(r["step_times"][i] for r in rank_results) for i in range(n_steps)]
    warm = min(config.warmup_steps_excluded, max(0, n_steps - 1))
    gbs = r0["global_batch_size"]
    # the slowest rank's own time for the measured steps (the sum of per-step maxima would also add
    # the ranks' timing jitter, which is not time the job spent)
    span = max(sum(r["step_times"][warm:n_steps]) for r in rank_results)
    sps = gbs * (n_steps - warm) / span if n_steps > warm and span > 0 else None
    verification = {
        "ranks": [r["verification"] for r in rank_results],
        "world_size_seen": sorted({r["verification"]["world_size_seen"] for r in rank_results}),
    }
    ok = all(r["verification"].get("ok") for r in rank_results)
    if config.strategy in ("ddp",) and len(rank_results) > 1:
        sums = [r["weights_checksum"] for r in rank_results]
        same = max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0]))
        verification["weights_identical_across_ranks"] = same
        verification["weights_checksums"] = sums
        ok = ok and same
    if r0.get("saved_to"):
        verification["saved_model_reloads"] = r0.get("saved_model_reloads")
        ok = ok and bool(r0.get("saved_model_reloads"))
    return RunResult(
        strategy=config.strategy,
        world_size=len(rank_results) if config.strategy in ("ddp", "fsdp") else 1,
        per_device_batch_size=config.per_device_batch_size,
        global_batch_size=gbs,
        steps=n_steps,
        samples_per_second=sps,
        step_times=step_times,
        losses=r0["losses"],
        peak_memory_bytes=[r["peak_memory_bytes"] for r in rank_results],
        peak_memory_run_bytes=[r.get("peak_memory_run_bytes") for r in rank_results],
        local_param_count=[r["verification"]["local_param_count"] for r in rank_results],
        total_param_count=r0["verification"]["total_param_count"],
        verified=ok,
        verification=verification,
        model=config.model,
        device=r0["device"],
        versions=versions(),
        memory_breakdown=[r["memory_breakdown"] for r in rank_results],
        spearman_before=r0.get("spearman_before"),
        spearman_after=r0.get("spearman_after"),
        time_to_first_step_s=max(r["time_to_first_step_s"] for r in rank_results),
        wall_time_s=wall_time_s,
        launcher=launcher,
        saved_to=r0.get("saved_to"),
        config=config.to_dict(),
        run_id=uuid.uuid4().hex[:12],
    )


# ---------------------------------------------------------------------------------------
# inside a rank


def _make_callback(trainer_ref: dict, cfg: dict, state: dict):
    from transformers import TrainerCallback

    from . import strategies

    class StnbCallback(TrainerCallback):
        """Times every step, keeps losses, verifies the prepared model, measures memory."""

        def on_step_begin(self, args, st, control, **kw):
            if state["t_first_begin"] is None:
                tr = trainer_ref["trainer"]
                if cfg.get("comm_hook") == "embedding_rows" and cfg["strategy"] == "ddp" and state["world_size"] > 1:
                    from . import rowsync  # before the first backward, as DDP requires

                    state["rowsync"] = rowsync.register(tr.model_wrapped)
                state["t_first_begin"] = time.perf_counter()
                state["verification"] = strategies.verify(
                    cfg["strategy"], tr.model_wrapped, tr.model, state["world_size"], state["n_gpu"])
                state["verification"].update(state.get("prepare_info", {}))

        def on_optimizer_step(self, args, st, control, optimizer=None, model=None, **kw):
            if state["memory_breakdown"] is None:
                state["memory_breakdown"] = _memory_breakdown(trainer_ref["trainer"].model, optimizer)

        def on_step_end(self, args, st, control, **kw):
            now = time.perf_counter()
            prev = state["t_last_end"] if state["t_last_end"] is not None else state["t_first_begin"]
            state["step_times"].append(now - prev)
            if state["t_last_end"] is None:
                state["first_step_wall"] = time.time()
            state["t_last_end"] = now
            report_progress(st.global_step, st.max_steps)  # the step's loss follows in on_log

        def on_log(self, args, st, control, logs=None, **kw):
            if logs and "loss" in logs:
                state["losses"].append(float(logs["loss"]))
                report_progress(st.global_step, st.max_steps, float(logs["loss"]))

    return StnbCallback()


def _memory_breakdown(model, optimizer) -> dict:
    import torch

    from .strategies import tensor_bytes

    params = sum(tensor_bytes(p) for p in model.parameters())
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = getattr(optimizer, "optimizer", optimizer)
    ostate = 0
    if opt is not None:
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    ostate += tensor_bytes(v)
    return {"params": params, "grads": grads, "optimizer_state": ostate,
            "total": params + grads + ostate}


def trainer_class(cfg: dict):
    """The sentence-transformers trainer class stnb trains with, for this run's config."""
    from sentence_transformers import SentenceTransformerTrainer

    class StnbTrainer(SentenceTransformerTrainer):
        """The sentence-transformers trainer, with stnb's DDP knobs passed to accelerate, and the
        mixed precision the Trainer's own DataParallel path leaves out (strategies.autocast_data_parallel)."""

        def _wrap_model(self, model, training=True, dataloader=None):
            from .strategies import autocast_data_parallel

            wrapped = super()._wrap_model(model, training=training, dataloader=dataloader)
            if wrapped is not model:  # newly wrapped here: the Trainer's DP path (args.n_gpu > 1)
                wrapped = autocast_data_parallel(wrapped, cfg.get("mixed_precision", "no"))
            return wrapped

        def _build_accelerator_args(self, **kwargs):
            from accelerate.utils import DistributedDataParallelKwargs

            from .strategies import ddp_kwargs

            args = super()._build_accelerator_args(**kwargs)
            args["kwargs_handlers"] = [DistributedDataParallelKwargs(**ddp_kwargs(cfg))]
            return args

    return StnbTrainer


def _evaluator(dev, name="dev"):
    from .data import has_scores

    if dev is None or len(dev) == 0 or not has_scores(dev):
        return None
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    return EmbeddingSimilarityEvaluator(dev["sentence1"], dev["sentence2"], dev["score"], name=name,
                                        show_progress_bar=False)


def _spearman(evaluator, model) -> float | None:
    if evaluator is None:
        return None
    scores = evaluator(model)
    return float(scores[evaluator.primary_metric])


def train_rank(cfg: dict, model_path: str, launch_time: float | None = None) -> dict:
    """Runs in every rank: build, prepare, verify, train, measure. Returns plain data."""
    import torch
    import torch.distributed as dist
    from transformers.trainer_callback import PrinterCallback

    from . import strategies
    from .data import load_pairs
    from .hardware import gpu_count
    from .models import load_model

    import transformers

    transformers.logging.disable_progress_bar()  # the parent shows per-rank progress instead
    ctx = rank_context()
    t_start = time.time()
    launch_time = launch_time or (ctx.launch_time if ctx else t_start)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # started by another launcher (torchrun, accelerate launch, raw notebook_launcher):
        # accelerate initialises the process group from its environment (gloo on CPU, NCCL on GPU)
        from accelerate import PartialState

        PartialState(cpu=cfg["device"] == "cpu")
    on_cpu = not (cfg["device"] != "cpu" and torch.cuda.is_available())
    if cfg.get("threads_per_rank") and on_cpu:
        torch.set_num_threads(cfg["threads_per_rank"])
    allocator = {"applied": False, "reason": "off (reuse_freed_memory=False)" if on_cpu else "GPU run"}
    if on_cpu and cfg.get("reuse_freed_memory", True):
        from .cpualloc import reuse_freed_memory

        allocator = reuse_freed_memory()  # this process only: a rank, never the notebook kernel
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = cfg["device"] != "cpu" and torch.cuda.is_available()
    device = f"cuda:{local_rank}" if use_cuda and distributed else ("cuda" if use_cuda else "cpu")
    n_gpu = torch.cuda.device_count() if use_cuda else 0
    if use_cuda:
        torch.cuda.reset_peak_memory_stats()

    torch.manual_seed(cfg["seed"])
    model = load_model(model_path, device=device, max_seq_length=cfg["max_seq_length"])
    train, dev = load_pairs(cfg["data"], cfg["train_size"], cfg["dev_size"], cfg["seed"])
    evaluator = _evaluator(dev) if cfg["evaluate"] else None

    state = {"t_first_begin": None, "t_last_end": None, "step_times": [], "losses": [], "verification": None,
             "memory_breakdown": None, "world_size": world, "n_gpu": n_gpu, "first_step_wall": None}
    spearman_before = None
    if evaluator is not None and rank == 0:
        spearman_before = _spearman(evaluator, model)
    if distributed:
        dist.barrier()

    frozen = strategies.freeze_unused_pooler(model)
    loss = _make_loss(cfg, model)
    if cfg["loss"] == "mnrl" and "score" in train.column_names:
        train = train.remove_columns("score")
    if cfg["strategy"] == "fsdp":
        state["prepare_info"] = strategies.shard_fsdp(
            model, "cuda" if use_cuda else "cpu", world, cfg.get("fsdp_layer_cls"),
            cfg.get("reshard_after_forward", True), cfg.get("mixed_precision", "no"))

    from sentence_transformers import SentenceTransformerTrainingArguments

    out_dir = tempfile.mkdtemp(prefix="stnb-trainer-")
    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=cfg["per_device_batch_size"],
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"],
        max_steps=cfg["steps"],
        learning_rate=cfg["learning_rate"],
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=cfg["seed"],
        data_seed=cfg["seed"],
        dataloader_num_workers=0,
        dataloader_drop_last=distributed,
        dataloader_pin_memory=use_cuda,
        use_cpu=not use_cuda,
        bf16=cfg.get("mixed_precision") == "bf16",
        fp16=cfg.get("mixed_precision") == "fp16",
    )
    trainer_ref = {}
    trainer = trainer_class(cfg)(model=model, args=args, train_dataset=train, loss=loss,
                                       callbacks=[_make_callback(trainer_ref, cfg, state)])
    trainer.remove_callback(PrinterCallback)
    trainer_ref["trainer"] = trainer
    # the peak of the training steps alone: rank 0's evaluation, FSDP's gathered full copy and the
    # save/reload come after training and are in the whole-run peak only
    if use_cuda:
        peak_before_training = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    elif ctx is not None:
        peak_before_training = ctx.peak_rss
        ctx.peak_rss = _rss_now()
    trainer.train()
    if use_cuda:
        train_peak = torch.cuda.max_memory_allocated()
    else:
        train_peak = max(0, max(ctx.peak_rss, _rss_now()) - ctx.start_rss) if ctx else 0
        if ctx is not None:
            ctx.peak_rss = max(ctx.peak_rss, peak_before_training)
    if state["verification"] is not None:
        state["verification"]["frozen_unused"] = frozen
        state["verification"]["reuse_freed_memory"] = allocator
        if state.get("rowsync") is not None:
            state["verification"]["embedding_rows"] = state["rowsync"].stats()

    losses = state["losses"]
    checksum = strategies.weights_checksum(trainer.model)
    saved_to = reloads = None
    spearman_after = None
    final_model = _full_model_on_rank0(cfg, trainer.model, model_path, device, rank)
    if rank == 0:
        if evaluator is not None:
            spearman_after = _spearman(evaluator, final_model)
        if cfg.get("save_to"):
            saved_to, reloads = _save_atomically(final_model, cfg["save_to"], device)
    if distributed:
        dist.barrier()
    shutil.rmtree(out_dir, ignore_errors=True)

    if use_cuda:
        run_peak = max(peak_before_training, torch.cuda.max_memory_allocated())
    else:
        if ctx is not None:
            ctx.peak_rss = max(ctx.peak_rss, _rss_now())
        run_peak = ctx.peak_rss_growth() if ctx else 0
    verification = state["verification"] or {}
    per_device_step = cfg["per_device_batch_size"] * cfg["gradient_accumulation_steps"]
    gbs = per_device_step * (world if distributed else max(1, n_gpu if cfg["strategy"] == "dp" else 1))
    return {
        "rank": rank,
        "device": device.split(":")[0],
        "global_batch_size": gbs,
        "step_times": state["step_times"],
        "losses": losses,
        "verification": verification,
        "memory_breakdown": state["memory_breakdown"] or {},
        "peak_memory_bytes": int(train_peak),
        "peak_memory_run_bytes": int(run_peak),
        "weights_checksum": checksum,
        "spearman_before": spearman_before,
        "spearman_after": spearman_after,
        "time_to_first_step_s": (state["first_step_wall"] - launch_time) if state["first_step_wall"] else None,
        "saved_to": saved_to,
        "saved_model_reloads": reloads,
    }


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _make_loss(cfg, model):
    from sentence_transformers.sentence_transformer import losses

    if cfg["loss"] == "cosine":
        return losses.CosineSimilarityLoss(model)
    return losses.MultipleNegativesRankingLoss(model, gather_across_devices=cfg["gather_across_devices"])


def _full_model_on_rank0(cfg, model, model_path, device, rank):
    """An ordinary SentenceTransformer with the trained weights, on rank 0 (None elsewhere).

    For FSDP this gathers a FULL_STATE_DICT (a collective: every rank takes part) and loads it
    into a fresh, unsharded copy of the model.
    """
    if cfg["strategy"] != "fsdp":
        return model if rank == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from .models import load_model

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    plain = load_model(model_path, device=device, max_seq_length=cfg["max_seq_length"])
    plain.load_state_dict(full, strict=True)  # raises if any key is missing or unexpected
    return plain


def _save_atomically(model, target: str, device: str):
    """Save to a temporary sibling folder, check it reloads and encodes, then rename into place."""
    import numpy as np

    from .models import load_model

    target = os.path.abspath(os.path.expanduser(target))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".stnb-save-", dir=parent)
    try:
        model.save(tmp)
        probe = ["a quick check that the saved model encodes"]
        reloaded = load_model(tmp, device=device, max_seq_length=model.max_seq_length)
        same = bool(np.allclose(model.encode(probe), reloaded.encode(probe), atol=1e-5))
        if not same:
            raise RuntimeError("the saved model does not reproduce the trained model's embeddings")
        if os.path.isdir(target) and not os.listdir(target):
            os.rmdir(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target, same
