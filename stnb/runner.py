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
        # the requested world size travels as an argument, apart from the environment the launcher sets
        rank_results = launch(train_rank, config.to_dict(), model_path, t0, ws, num_processes=ws,
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
    from .mfu import summarize as mfu_summary

    mfu = mfu_summary(rank_results, warm, n_steps, span, gbs * (n_steps - warm),
                      devices=max(1, n_gpu) if config.strategy == "dp" else 1)
    verification, problems = _cross_rank_checks(config, rank_results)
    ok = not problems
    spearman = (r0.get("dev_metric") or "").endswith("spearman_cosine")
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
        local_param_count=[r["verification"].get("local_param_count") for r in rank_results],
        total_param_count=r0["verification"].get("total_param_count") or 0,
        verified=ok,
        verification=verification,
        reason="" if ok else "not verified: " + "; ".join(problems),
        model=config.model,
        device=r0["device"],
        versions=versions(),
        memory_breakdown=[r["memory_breakdown"] for r in rank_results],
        spearman_before=r0.get("dev_metric_before") if spearman else None,
        spearman_after=r0.get("dev_metric_after") if spearman else None,
        dev_metric=r0.get("dev_metric"),
        dev_metric_before=r0.get("dev_metric_before"),
        dev_metric_after=r0.get("dev_metric_after"),
        time_to_first_step_s=max((r["time_to_first_step_s"] for r in rank_results
                                  if r["time_to_first_step_s"] is not None), default=None),
        wall_time_s=wall_time_s,
        launcher=launcher,
        mfu=mfu,
        saved_to=(r0.get("saved_model") or {}).get("saved_to"),
        config=config.to_dict(),
        run_id=uuid.uuid4().hex[:12],
    )


def _cross_rank_checks(config: TrainConfig, rank_results: list) -> tuple:
    """(verification dict, problems): every rank's own verification, plus what needs all ranks:
    the number of ranks against the requested world size, per-tensor identical weights (ddp),
    shards adding up to the model (fsdp), and the saved model's check (rank 0)."""
    from .checks import compare_digests

    requested = config.world_size()
    ranks = [r["verification"] for r in rank_results]
    verification = {"ranks": ranks, "world_size_requested": requested,
                    "world_size_seen": sorted({v.get("world_size_seen") for v in ranks}, key=str),
                    "model_shape": rank_results[0].get("model_shape"),
                    "peak_memory_method": rank_results[0].get("peak_memory_method")}
    never = "no training step began, so the prepared model was never verified"
    problems = [f"rank {i}: " + "; ".join(v.get("problems") or [never]) for i, v in enumerate(ranks) if not v.get("ok")]
    if config.strategy in ("ddp", "fsdp") and len(rank_results) != requested:
        problems.append(f"{requested} ranks were requested, {len(rank_results)} returned a result")
    if config.strategy == "ddp" and len(rank_results) > 1:
        same = compare_digests([r["weight_digests"] for r in rank_results])
        verification["weights_identical_across_ranks"] = same["identical"]
        verification["weights_checksums"] = same["model_digests"]  # sha256 over every tensor, per rank
        verification["weights_differing"] = same["differing"][:10]
        verification["weights_tensors_compared"] = same["tensors"]
        if not same["identical"]:
            problems.append(f"weights differ across ranks in {len(same['differing'])} of {same['tensors']} "
                            f"tensor(s), first {same['first_differing']!r} (ranks {same['differing'][0]['ranks']})")
    if config.strategy == "fsdp":
        held = sum(v.get("local_param_count") or 0 for v in ranks)
        total = ranks[0].get("total_param_count")
        verification["shards_add_up"] = held == total
        if held != total:
            problems.append(f"the ranks' local shards hold {held} parameter values, the model has {total}")
    saved = rank_results[0].get("saved_model")
    if saved is not None:
        verification["saved_model"] = saved
        problems += [f"save_to: {p}" for p in saved.get("problems") or []]
    # the data reached the loss whole: every text column as an input, the score as the label
    from .columns import LABEL_COLUMNS

    cols = rank_results[0].get("data_columns")
    if cols is not None:  # train_rank always reports them; hand-built results may not
        expected = {"texts": len([c for c in cols if c not in LABEL_COLUMNS]),
                    "label": any(c in LABEL_COLUMNS for c in cols)}
        seen = [r.get("loss_inputs") for r in rank_results]
        verification["data_columns"] = cols
        verification["loss_inputs"] = seen
        verification["loss_received_all_columns"] = all(x == expected for x in seen)
        if not verification["loss_received_all_columns"]:
            problems.append(f"the loss received {seen[0]} but the data has columns {cols} (expected {expected})")
    verification["problems"] = problems
    return verification, problems


# ---------------------------------------------------------------------------------------
# inside a rank


def _make_callback(trainer_ref: dict, cfg: dict, state: dict):
    from transformers import TrainerCallback

    from . import memory, strategies

    class StnbCallback(TrainerCallback):
        """Times every step, keeps losses, verifies the prepared model, measures memory."""

        def on_step_begin(self, args, st, control, **kw):
            state["flops"].start_step()  # evaluation forwards before this step do not count
            if state["t_first_begin"] is None:
                tr = trainer_ref["trainer"]
                if (cfg.get("comm_hook") == "embedding_rows" and cfg["strategy"] == "ddp"
                        and state["process_group_size"] > 1):
                    from . import rowsync  # before the first backward, as DDP requires

                    state["rowsync"] = rowsync.register(tr.model_wrapped)
                state["t_first_begin"] = time.perf_counter()
                state["verification"] = strategies.verify(
                    cfg["strategy"], tr.model_wrapped, tr.model, state["world_size_requested"], state["n_gpu"])
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


def train_rank(cfg: dict, model_path: str, launch_time: float | None = None,
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
    peak_memory = memory.PeakMemory(use_cuda)
    requested = world_size if world_size is not None else TrainConfig.from_dict(cfg).world_size()

    torch.manual_seed(cfg["seed"])
    model = load_model(model_path, device=device, max_seq_length=cfg["max_seq_length"])
    train, dev = load_pairs(cfg["data"], cfg["train_size"], cfg["dev_size"], cfg["seed"], cfg["loss"],
                            cfg.get("columns"))
    evaluator = _evaluator(dev) if cfg["evaluate"] else None

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
    loss = _make_loss(cfg, model)  # train holds exactly the columns this loss reads (data.load_pairs)
    _record_loss_inputs(loss, state)
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
    model_shape["optimizer"] = memory.optimizer_kind(args.optim)
    trainer_ref["trainer"] = trainer
    # the peak of the training steps alone: rank 0's evaluation, FSDP's gathered full copy and the
    # save/reload come after training and are in the whole-run peak only
    peak_memory.start_phase()
    trainer.train()
    train_peak = peak_memory.phase_peak()
    if state["verification"] is not None:
        state["verification"]["frozen_unused"] = frozen
        state["verification"]["reuse_freed_memory"] = allocator
        if state.get("rowsync") is not None:
            state["verification"]["embedding_rows"] = state["rowsync"].stats()

    losses = state["losses"]
    digests = checks.tensor_digests(trainer.model)
    saved = None
    dev_after = None
    final_model = _full_model_on_rank0(cfg, trainer.model, model_path, device, rank)
    if rank == 0:
        if evaluator is not None:
            dev_after = _dev_metric(evaluator, final_model)
        if cfg.get("save_to"):
            from .models import load_model
            from .saving import save_checked

            initial = checks.state_of(load_model(model_path, device="cpu", max_seq_length=cfg["max_seq_length"]))
            saved = save_checked(final_model, cfg["save_to"], device, checks.state_of(final_model), initial)
    if distributed:
        dist.barrier()
    shutil.rmtree(out_dir, ignore_errors=True)

    run_peak = peak_memory.peak()
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
        "model_shape": model_shape,
        "peak_memory_bytes": int(train_peak),
        "peak_memory_run_bytes": int(run_peak),
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
        "peak": device_peak(device, cfg.get("mixed_precision", "no")),
    }


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
