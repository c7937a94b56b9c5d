"""Inside a rank: build, prepare, verify, train, measure (``train_rank``).

Every rank of a run executes ``train_rank``: started by ``stnb.run`` through ``stnb.launch``
(notebook side, ``stnb.runner``), or by torchrun / accelerate launch (``stnb.scaleout.run_here``).
It returns plain data; ``stnb.results.merge`` combines the ranks into one RunResult.
The configuration arrives as a ``TrainConfig``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from .config import TrainConfig
from .launch import rank_context, report_progress


def _make_callback(trainer_ref: dict, config: TrainConfig, state: dict):
    from transformers import TrainerCallback

    from . import memory, strategies

    class StnbCallback(TrainerCallback):
        """Times every step, keeps losses, verifies the prepared model, measures memory."""

        def on_step_begin(self, args, st, control, **kw):
            state["flops"].start_step()  # evaluation forwards before this step do not count
            if state["t_first_begin"] is None:
                tr = trainer_ref["trainer"]
                if (config.comm_hook == "embedding_rows" and config.strategy == "ddp"
                        and state["process_group_size"] > 1):
                    from . import rowsync  # before the first backward, as DDP requires

                    state["rowsync"] = rowsync.register(tr.model_wrapped)
                state["t_first_begin"] = time.perf_counter()
                state["verification"] = strategies.verify(
                    config.strategy, tr.model_wrapped, tr.model, state["world_size_requested"], state["n_gpu"])
                state["verification"].update(state.get("prepare_info", {}))

        def on_optimizer_step(self, args, st, control, optimizer=None, model=None, **kw):
            if state["memory_breakdown"] is None:
                state["memory_breakdown"] = memory.measure(trainer_ref["trainer"].model, optimizer)

        def on_step_end(self, args, st, control, **kw):
            now = time.perf_counter()
            state["flops"].end_step()
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


def _make_trainer_class(config: TrainConfig):
    from sentence_transformers import SentenceTransformerTrainer

    class StnbTrainer(SentenceTransformerTrainer):
        """The sentence-transformers trainer, with stnb's DDP knobs passed to accelerate."""

        def _build_accelerator_args(self, **kwargs):
            from accelerate.utils import DistributedDataParallelKwargs

            from .strategies import ddp_kwargs

            args = super()._build_accelerator_args(**kwargs)
            args["kwargs_handlers"] = [DistributedDataParallelKwargs(**ddp_kwargs(config))]
            return args

    return StnbTrainer


def _evaluator(dev, name="dev"):
    """The dev evaluator that fits the dev rows: scored pairs -> Spearman (EmbeddingSimilarityEvaluator),
    (anchor, positive, negative...) -> TripletEvaluator accuracy (one triplet per negative),
    unscored pairs -> InformationRetrievalEvaluator NDCG@10 (each anchor's own positive among all)."""
    from .columns import text_columns
    from .data import has_scores

    if dev is None or len(dev) == 0:
        return None
    from sentence_transformers.sentence_transformer import evaluation

    texts = text_columns(dev)
    col = {c: list(dev[c]) for c in dev.column_names}
    if has_scores(dev):
        return evaluation.EmbeddingSimilarityEvaluator(col[texts[0]], col[texts[1]], col["score"], name=name,
                                                       show_progress_bar=False)
    if len(texts) > 2:
        anchors, positives = col[texts[0]], col[texts[1]]
        negatives = [col[c] for c in texts[2:]]
        return evaluation.TripletEvaluator(anchors * len(negatives), positives * len(negatives),
                                           [n for col in negatives for n in col], name=name,
                                           show_progress_bar=False, write_csv=False)
    queries = {f"q{i}": q for i, q in enumerate(col[texts[0]])}
    corpus = {f"d{i}": d for i, d in enumerate(col[texts[1]])}
    return evaluation.InformationRetrievalEvaluator(queries, corpus, {f"q{i}": {f"d{i}"} for i in range(len(dev))},
                                                    name=name, show_progress_bar=False, write_csv=False)


def _dev_metric(evaluator, model) -> float | None:
    if evaluator is None:
        return None
    scores = evaluator(model)
    return float(scores[evaluator.primary_metric])


def _record_loss_inputs(loss, state: dict) -> None:
    """Note what the loss really receives at its first call: how many text inputs, and a label or not."""
    def hook(module, args):
        if state.get("loss_inputs") is None and args:
            features = list(args[0])
            labels = args[1] if len(args) > 1 else None
            state["loss_inputs"] = {"texts": len(features), "label": labels is not None}

    loss.register_forward_pre_hook(hook)


def train_rank(config: TrainConfig, model_path: str, launch_time: float | None = None,
               world_size: int | None = None) -> dict:
    """Runs in every rank: build, prepare, verify, train, measure. Returns plain data.

    world_size: the world size the caller requested (default: the config's); verification
    compares it with the process group this rank is in."""
    import torch
    import torch.distributed as dist
    from transformers.trainer_callback import PrinterCallback

    from . import checks, memory, strategies
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

        PartialState(cpu=config.device == "cpu")
    on_cpu = not (torch.cuda.is_available() and config.device != "cpu")
    if config.threads_per_rank and on_cpu:
        torch.set_num_threads(config.threads_per_rank)
    allocator = {"applied": False, "reason": "off (reuse_freed_memory=False)" if on_cpu else "GPU run"}
    if on_cpu and config.reuse_freed_memory:
        from .cpualloc import reuse_freed_memory

        allocator = reuse_freed_memory()  # this process only: a rank, never the notebook kernel
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and config.device != "cpu"
    device = f"cuda:{local_rank}" if use_cuda and distributed else ("cuda" if use_cuda else "cpu")
    n_gpu = torch.cuda.device_count() if use_cuda else 0
    peak_memory = memory.PeakMemory(use_cuda)
    requested = world_size if world_size is not None else config.world_size()

    torch.manual_seed(config.seed)
    model = load_model(model_path, device=device, max_seq_length=config.max_seq_length)
    train, dev = load_pairs(config.data, config.train_size, config.dev_size, config.seed, config.loss,
                            config.columns)
    evaluator = _evaluator(dev) if config.evaluate else None

    state = {"t_first_begin": None, "t_last_end": None, "step_times": [], "losses": [], "verification": None,
             "memory_breakdown": None, "world_size_requested": requested, "process_group_size": world,
             "n_gpu": n_gpu, "first_step_wall": None}
    dev_before = None
    if evaluator is not None and rank == 0:
        dev_before = _dev_metric(evaluator, model)
    if distributed:
        dist.barrier()

    frozen = strategies.freeze_unused_pooler(model)
    model_shape = memory.model_shape(model)  # before sharding and training: the prediction's inputs
    from .mfu import FlopMeter, device_peak

    state["flops"] = FlopMeter(model)  # counts the tokens of every training forward (stnb.mfu)
    loss = _make_loss(config, model)  # train holds exactly the columns this loss reads (data.load_pairs)
    _record_loss_inputs(loss, state)
    if config.strategy == "fsdp":
        state["prepare_info"] = strategies.shard_fsdp(
            model, "cuda" if use_cuda else "cpu", world, config.fsdp_layer_cls,
            config.reshard_after_forward, config.mixed_precision)

    from sentence_transformers import SentenceTransformerTrainingArguments

    out_dir = tempfile.mkdtemp(prefix="stnb-trainer-")
    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=config.per_device_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        max_steps=config.steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=config.seed,
        data_seed=config.seed,
        dataloader_num_workers=0,
        dataloader_drop_last=distributed,
        dataloader_pin_memory=use_cuda,
        use_cpu=not use_cuda,
        bf16=config.mixed_precision == "bf16",
        fp16=config.mixed_precision == "fp16",
    )
    trainer_ref = {}
    trainer = _make_trainer_class(config)(model=model, args=args, train_dataset=train, loss=loss,
                                       callbacks=[_make_callback(trainer_ref, config, state)])
    trainer.remove_callback(PrinterCallback)
    model_shape["optimizer"] = memory.optimizer_kind(args.optim)
    trainer_ref["trainer"] = trainer
    trainer.train()
    if state["verification"] is not None:
        state["verification"]["frozen_unused"] = frozen
        state["verification"]["reuse_freed_memory"] = allocator
        if state.get("rowsync") is not None:
            state["verification"]["embedding_rows"] = state["rowsync"].stats()

    losses = state["losses"]
    digests = checks.tensor_digests(trainer.model)
    saved = None
    dev_after = None
    final_model = _full_model_on_rank0(config, trainer.model, model_path, device, rank)
    if rank == 0:
        if evaluator is not None:
            dev_after = _dev_metric(evaluator, final_model)
        if config.save_to:
            from .models import load_model
            from .saving import save_checked

            initial = checks.state_of(load_model(model_path, device="cpu", max_seq_length=config.max_seq_length))
            saved = save_checked(final_model, config.save_to, device, checks.state_of(final_model), initial)
    if distributed:
        dist.barrier()
    shutil.rmtree(out_dir, ignore_errors=True)

    peak = peak_memory.peak()
    verification = state["verification"] or {}
    per_device_step = config.per_device_batch_size * config.gradient_accumulation_steps
    gbs = per_device_step * (world if distributed else max(1, n_gpu if config.strategy == "dp" else 1))
    return {
        "rank": rank,
        "device": device.split(":")[0],
        "global_batch_size": gbs,
        "step_times": state["step_times"],
        "losses": losses,
        "verification": verification,
        "memory_breakdown": state["memory_breakdown"] or {},
        "model_shape": model_shape,
        "peak_memory_bytes": int(peak),
        "peak_memory_method": peak_memory.method,
        "weight_digests": digests,
        "dev_metric": evaluator.primary_metric if evaluator is not None else None,
        "dev_metric_before": dev_before,
        "dev_metric_after": dev_after,
        "data_columns": train.column_names,
        "loss_inputs": state.get("loss_inputs"),
        "time_to_first_step_s": (state["first_step_wall"] - launch_time) if state["first_step_wall"] else None,
        "saved_model": saved,
        "train_flops": state["flops"].per_step,
        "train_tokens": state["flops"].tokens,
        "flops_shape": state["flops"].shape,
        "peak": device_peak(device, config.mixed_precision),
    }


def _make_loss(config, model):
    from sentence_transformers.sentence_transformer import losses

    if config.loss == "cosine":
        return losses.CosineSimilarityLoss(model)
    return losses.MultipleNegativesRankingLoss(model, gather_across_devices=config.gather_across_devices)


def _full_model_on_rank0(config, model, model_path, device, rank):
    """An ordinary SentenceTransformer with the trained weights, on rank 0 (None elsewhere).

    For FSDP this gathers a FULL_STATE_DICT (a collective: every rank takes part) and loads it
    into a fresh, unsharded copy of the model.
    """
    if config.strategy != "fsdp":
        return model if rank == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from .models import load_model

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    plain = load_model(model_path, device=device, max_seq_length=config.max_seq_length)
    plain.load_state_dict(full, strict=True)  # raises if any key is missing or unexpected
    return plain
