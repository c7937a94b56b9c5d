"""deepspeed (ZeRO stage 1, 2 or 3): DeepSpeed's engine through the trainer's own integration.

stnb gives the trainer a DeepSpeed config (``ds_config``: the ZeRO ``stage``, the batch, accumulation,
clipping and precision left ``"auto"`` so the trainer fills them from its own arguments, no ``optimizer``
section so the trainer's own torch AdamW is the one DeepSpeed partitions: the same optimizer zero1 and
zero2 run). stnb's recipe passes it as ``deepspeed=...`` in its training arguments; a user's trainer
gets it the way ``accelerate launch --use_deepspeed`` hands it over, through the ranks' environment
(``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_DEEPSPEED_CONFIG_FILE``: a base64 JSON accelerate's
``HfDeepSpeedConfig`` reads), unless the user's arguments carry ``deepspeed=...`` themselves, which must
then agree with the run (checked in the rank).

On CPU the ranks need ``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator, gloo) and
``ACCELERATE_USE_CPU=false``: accelerate 1.15 refuses DeepSpeed in CPU mode (``accelerate/state.py``,
``AcceleratorState.__init__``: ``elif os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and not cpu``), so
``use_cpu=True`` in the training arguments is refused too. DeepSpeed's CPU communication JIT-compiles a
shared-memory op once per environment (``deepspeed_ops.prebuild``, run before the ranks start and by
``make install``); each launch's ranks load it from a copy of their own (``deepspeed_ops.launch_copy``).

Verified the way the native stage of the same number is: the trainer trains a ``DeepSpeedEngine``
around its own model with ``zero_optimization_stage()`` equal to the stage asked; stage 1/2: weights
identical across ranks (every parameter of the engine's module digested), each rank's fp32 partition
and optimizer state about 1/N, disjoint partitions adding up to the trainable parameters; stage 2:
the gradients a rank holds at the optimizer step are its partition only (observed before the engine's
step); stage 3: every parameter is partitioned (``ds_tensor``) into this rank's ceil(numel/N) piece,
the pieces add up to the model.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import json

from .base import Option, Strategy, mixed_precision
from .deepspeed_engine import held_bytes, held_gradients, optimizer_partition, stage3_partitions
from .deepspeed_nograd import KeepWithoutGradient

STAGES = (1, 2, 3)
DEFAULT_STAGE = 2  # accelerate's default (ACCELERATE_DEEPSPEED_ZERO_STAGE)
INSTALL = 'pip install "stnb[deepspeed]"'
SHARDED_BY_STAGE = {1: ("optimizer_state",), 2: ("optimizer_state", "grads"),
                    3: ("optimizer_state", "grads", "params")}


def installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def stage_of(config) -> int:
    """The ZeRO stage a config asks: ``stage``, else its deepspeed_config's, else accelerate's default (2)."""
    if config.stage is not None:
        return config.stage
    given = ((config.deepspeed_config or {}).get("zero_optimization") or {}).get("stage")
    return given if given in STAGES else DEFAULT_STAGE


def ds_config(config) -> dict:
    """The DeepSpeed config of a run: stnb's (the stage, the rest "auto" for the trainer to fill) with the
    user's ``deepspeed_config`` merged over it (``validate`` refused any value that contradicts the run)."""
    stage = stage_of(config)
    # stage 3: the trainer gathers the partitioned parameters to write a checkpoint's model (``DeepSpeed.saving``)
    out = {"zero_optimization": {"stage": stage, **({"stage3_gather_16bit_weights_on_model_save": True}
                                                    if stage == 3 else {})},
           "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto",
           "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "steps_per_print": 10**9}
    return overlay(out, config.deepspeed_config or {})


def half_precision_engine(precision: str) -> dict:
    """The ``overridden_args`` entry of a precision flag under DeepSpeed ({} for none): its bf16 / fp16 engine
    (the trainer fills the config's "auto" from the flag) converts the whole model, where single and ddp
    autocast the forward over float32 parameters. Only on a GPU: on CPU the flags are refused (``refusals``,
    ``check_recipe``)."""
    if precision not in HALF_ENGINE:
        return {}
    dtype = HALF_ENGINE[precision]
    return {precision: {"from": True, "to": f"DeepSpeed's {precision} engine: the model held and computed in {dtype}",
                        "why": f"single and ddp autocast the forward over float32 parameters; DeepSpeed converts the "
                               f"model to {dtype} (norms, residual adds and pooling too; float32 master weights in "
                               "its optimizer), as accelerate launch --use_deepspeed does, and its embeddings reach "
                               f"the loss in {dtype}. single's computation with {precision}=True: strategy='ddp' or "
                               "'zero1'"}}


def overlay(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = overlay(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def contradictions(cfg: dict, stage: int, batch: int, accumulation: int, precision: str, where: str) -> list:
    """Values of a DeepSpeed config that contradict the run (``where`` names the run's side)."""
    problems = []
    seen = (cfg.get("zero_optimization") or {}).get("stage")
    if seen is not None and seen != stage:
        problems.append(f"zero_optimization.stage={seen!r} in the DeepSpeed config, but stage={stage} was asked")
    for key, ours, name in (("train_micro_batch_size_per_gpu", batch, "per-device batch"),
                            ("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")):
        theirs = cfg.get(key, "auto")
        if theirs != "auto" and theirs != ours:
            problems.append(f"{key}={theirs!r} in the DeepSpeed config, but the {name} is {ours} ({where})")
    for kind in ("bf16", "fp16"):
        on = (cfg.get(kind) or {}).get("enabled", "auto")
        if on != "auto" and bool(on) != (precision == kind):
            problems.append(f"{kind}.enabled={on!r} in the DeepSpeed config, but mixed precision is {precision!r} "
                            f"({where})")
    return problems


BF16_ON_CPU = ("transformers accepts bf16 without a GPU only with use_cpu=True, which accelerate refuses under "
               "DeepSpeed, so DeepSpeed cannot train bf16 on CPU; use strategy='zero1', 'zero2' or 'fsdp' (ZeRO stages "
               "1, 2 and 3 without DeepSpeed: bf16 autocast on CPU, as under single), or train without bf16")
FP16_ON_CPU = ("fp16=True on CPU: under single and ddp the trainer leaves it without effect (accelerate autocasts "
               "fp16 only on GPUs) and computes in float32, while DeepSpeed's fp16 engine would compute in float16; "
               "remove fp16=True (float32, as under every other strategy), or run on a GPU")
HALF_ENGINE = {"bf16": "bfloat16", "fp16": "float16"}

LOSS_PARAMETERS_FIX = ("DeepSpeed's ZeRO optimizer handles only its engine's module's parameters (deepspeed 0.19.8 "
                       "fails on a loss's own at every stage), so it cannot train them: use strategy='zero1' or "
                       "'ddp', which keep them in sync")


class DeepSpeed(Strategy):
    name = "deepspeed"
    label = "DeepSpeed ZeRO"
    aka = "ZeRO stage 1, 2 or 3"
    summary = ("DeepSpeed's engine through the trainer's own integration: ZeRO stage 1 (optimizer state), "
               "2 (+ gradients) or 3 (+ parameters) sharded")
    color = "#e377c2"
    min_ranks = 1
    options = {
        "stage": Option(None, "int | None", "deepspeed: the ZeRO stage, 1 (optimizer state), 2 (+ gradients) or 3 "
                        "(+ parameters); default 2, accelerate's", choices=STAGES, unset=f"default ({DEFAULT_STAGE})",
                        label="stage {}", lever="a lower ZeRO stage (fewer collectives)"),
        "deepspeed_config": Option(
            None, "dict | None", "deepspeed: a DeepSpeed config merged over stnb's (JSON on the command line, e.g. "
            '\'{"zero_optimization": {"stage": 2}}\'); a value contradicting the run is refused'),
    }
    owns_deepspeed = True
    checkpoint_format = "deepspeed"  # the engine's own: each rank writes its ZeRO partition (global_step<N>/)
    reshards = checks_own_resharding = True  # on another number of ranks: the universal checkpoint (deepspeed_resume)
    master_weights = True  # ZeRO keeps an fp32 copy of this rank's parameter partition for the optimizer
    order = 70

    def levers(self, config):
        """No lower stage to advise at stage 1."""
        return [o.lever for name, o in self.options.items() if o.lever and not (name == "stage" and
                                                                                  config.get("stage") == 1)]

    def shards_params(self, config):
        return stage_of(config) == 3

    def held(self, world_size, options=None):
        stage = (options or {}).get("stage")
        sharded = SHARDED_BY_STAGE[stage if stage in STAGES else DEFAULT_STAGE]
        return {part: (1.0 / world_size if part in sharded else 1.0) for part in ("params", "grads",
                                                                                  "optimizer_state")}

    def available(self, device, n_gpu, max_ranks, backend):
        if not installed():
            return False, f"DeepSpeed is not installed: {INSTALL}"
        return super().available(device, n_gpu, max_ranks, backend)

    # ---- before any process starts ------------------------------------------------------------
    def validate(self, config):
        from ..errors import ConfigError

        if not installed():
            raise ConfigError(f"strategy='deepspeed' needs DeepSpeed, which is not installed here: {INSTALL} "
                              "(or pip install deepspeed==0.19.8), then restart the kernel")
        if config.stage is not None and (isinstance(config.stage, bool) or config.stage not in STAGES):
            raise ConfigError(f"unknown DeepSpeed ZeRO stage {config.stage!r}; choose stage=1 (optimizer state "
                              "sharded), 2 (+ gradients) or 3 (+ parameters)")
        given = config.deepspeed_config
        if given is not None and not isinstance(given, dict):
            raise ConfigError(f"deepspeed_config must be a dict (a DeepSpeed config), got {type(given).__name__}")
        inner = ((given or {}).get("zero_optimization") or {}).get("stage")
        if config.stage is None and inner is not None and inner not in STAGES:
            raise ConfigError(f"unknown DeepSpeed ZeRO stage {inner!r} in deepspeed_config; choose 1, 2 or 3")

    def check_recipe(self, config):
        """stnb's recipe trains with the config's batch, accumulation and precision: the DeepSpeed config
        must agree (a user's trainer is checked in the rank, against its own arguments), and bf16 is refused on
        CPU (``BF16_ON_CPU``; fp16 on CPU the config refuses for every strategy)."""
        from ..errors import ConfigError

        self.validate(config)
        problems = contradictions(ds_config(config), stage_of(config), config.per_device_batch_size,
                                  config.gradient_accumulation_steps, config.mixed_precision, "stnb.run's options")
        if problems:
            raise ConfigError("the DeepSpeed config contradicts the run: " + "; ".join(problems)
                              + ". Leave these keys out of deepspeed_config (stnb fills them from the run) or make "
                                "them agree")
        if config.mixed_precision == "bf16" and config.resolved_device() == "cpu":
            raise ConfigError(f"mixed_precision='bf16' with strategy='deepspeed' on CPU: {BF16_ON_CPU}")

    def rank_env(self, config, device):
        env = {"ACCELERATE_USE_DEEPSPEED": "true",
               "ACCELERATE_DEEPSPEED_CONFIG_FILE": base64.urlsafe_b64encode(
                   json.dumps(ds_config(config)).encode()).decode()}
        if device == "cpu":
            from .deepspeed_ops import launch_copy

            # over the device's variables (hardware.device_env: DeepSpeed's CPU accelerator, gloo): accelerate
            # refuses DeepSpeed in its CPU mode (state.py); the CPU op built once per environment and loaded by
            # this launch from a copy of its own
            env.update({"ACCELERATE_USE_CPU": "false", "TORCH_EXTENSIONS_DIR": launch_copy()})
        return env

    # ---- resuming (stnb.strategies.layouts) ----------------------------------------------------------
    def checkpoint_layout(self, config):
        return {"zero_stage": stage_of(config)}

    def loads(self, path, written, world, writer, config=None):
        """DeepSpeed's engine loads its own checkpoints only, at the ZeRO stage that wrote them; on another number
        of ranks through DeepSpeed's universal checkpoint (``deepspeed_resume``)."""
        fmt = written.get("format", "trainer")
        had = written.get("zero_stage")  # None: written before stnb recorded it
        if fmt == self.checkpoint_format and None not in (had, config) and had != stage_of(config):
            return (f"it holds ZeRO stage {had}'s partitions, and this run asks stage {stage_of(config)}: DeepSpeed's "
                    "engine reads a checkpoint at the stage that wrote it (stage 3 partitions the parameters too, "
                    f"stages 1 and 2 keep the whole model); resume it with stage={had}, or start a new run from the "
                    "model it holds (stnb.checkpoints.to_model(<checkpoint>) opens it)")
        if fmt == self.checkpoint_format:
            return ""
        return (f"DeepSpeed's engine loads only its own checkpoints (global_step<N>/), and this one is in the "
                f"{fmt!r} format; resume it with strategy={written.get('strategy')!r}, or start a new run from the "
                "model it holds (stnb.checkpoints.to_model(<checkpoint>) opens it)")

    def unreadable(self, path, written):
        return ""  # by parameter name, on any layout: through DeepSpeed's universal checkpoint (deepspeed_resume)

    def read_model(self, checkpoint, like):
        from .deepspeed_resume import read_model

        return read_model(checkpoint, like)

    def read_optimizer(self, checkpoint):
        from .deepspeed_resume import read_optimizer

        return read_optimizer(checkpoint)

    def saving(self, trainer):
        """The engine writes its own checkpoint (``global_step<N>/``, each rank its ZeRO partitions), the trainer
        the model's files beside it, so that every checkpoint is a saved model. At stage 3 the model's parameters
        are this rank's partitions: the trainer gathers them (``ds_config``: stage3_gather_16bit_weights_on_model_save)
        and hands them to ``_save``, which sentence-transformers' ignores (it would write the empty partitions, or,
        without the gathering, no weights at all): rank 0 writes the model with the gathered tensors in place, and
        its model card without the usage snippet's similarities (computing them runs a forward, whose ZeRO-3 hooks
        gather parameters from ranks that are not saving: observed, both ranks stalled)."""
        save = trainer._save

        def save_gathered(output_dir=None, state_dict=None):
            if not state_dict or not any(hasattr(p, "ds_tensor") for p in trainer.model.parameters()):
                return save(output_dir, state_dict=state_dict)
            card = getattr(trainer.model, "model_card_data", None)
            widgets = getattr(card, "generate_widget_examples", None)
            with gathered_in_place(trainer.model, state_dict):
                try:
                    if widgets is not None:
                        card.generate_widget_examples = False
                    return save(output_dir, state_dict=state_dict)
                finally:
                    if widgets is not None:
                        card.generate_widget_examples = widgets

        trainer._save = save_gathered
        super().saving(trainer)
        from .deepspeed_resume import install

        install(trainer)  # on another number of ranks: its universal checkpoint

    def trainer_arguments(self, config, device):
        return {"deepspeed": ds_config(config), "use_cpu": False}

    def build_refusal(self, objects):
        from .tensors import loss_classes_with_parameters

        owned = loss_classes_with_parameters(objects)
        if not owned:
            return ""
        return (f"your build function uses {', '.join(owned)}, a loss with its own trainable parameters; "
                f"{LOSS_PARAMETERS_FIX}")

    # ---- in each rank -------------------------------------------------------------------------
    def refusals(self, trainer, config):
        from .tensors import loss_owned_parameters

        args, problems = trainer.args, []
        stage = stage_of(config)
        if args.use_cpu:
            problems.append("use_cpu=True in your arguments: accelerate refuses DeepSpeed in its CPU mode "
                            "(accelerate/state.py, AcceleratorState: `ACCELERATE_USE_DEEPSPEED == 'true' and not cpu`); "
                            "remove use_cpu (stnb runs the ranks on CPU with DS_ACCELERATOR=cpu)"
                            + (f"; with bf16=True: {BF16_ON_CPU}" if args.bf16 else ""))
        if args.fp16 and args.device.type == "cpu":
            problems.append(FP16_ON_CPU)
        if args.deepspeed:
            theirs = getattr(args, "hf_deepspeed_config", None)
            cfg = theirs.config if theirs is not None else args.deepspeed
            if isinstance(cfg, dict):
                problems += contradictions(cfg, stage, args.per_device_train_batch_size,
                                           args.gradient_accumulation_steps, mixed_precision(args),
                                           "your training arguments")
        if not getattr(trainer, "is_deepspeed_enabled", False) and not problems:
            problems.append("the trainer did not enable DeepSpeed (trainer.is_deepspeed_enabled is False)")
        owned = loss_owned_parameters(trainer)
        if owned:
            problems.append(f"your loss has its own trainable parameters ({', '.join(n for n, _ in owned[:3])}); "
                            f"{LOSS_PARAMETERS_FIX}")
        if trainer.optimizer is not None:
            problems.append(f"your trainer came with a ready optimizer ({type(trainer.optimizer).__name__}); "
                            "DeepSpeed partitions the optimizer the trainer builds: pass optim=... instead")
        return problems

    def prepare(self, trainer, config, device_type, world):
        return {"info": {"data_split": split_data_across_ranks(trainer)},
                "overridden": half_precision_engine(mixed_precision(trainer.args))}

    def on_first_step(self, trainer, config, world, timed=None):
        """Before the engine's first optimizer step, note the gradients this rank holds (the engine's
        step frees them before any trainer callback runs); and from the first step on, keep a parameter that
        got no gradient as torch's optimizers keep it (``deepspeed_nograd``)."""
        engine = trainer.model_wrapped
        opt = getattr(engine, "optimizer", None)
        if opt is None or not hasattr(opt, "step"):
            return {}
        kept = KeepWithoutGradient(engine)  # every step: a parameter no rank gave a gradient is left as it was
        seen = trainer.stnb_ds_grads = {}
        original = opt.step

        def step(*a, **kw):
            seen.update(held_gradients(engine.module, opt))
            opt.step = original
            return original(*a, **kw)

        opt.step = step
        return {"without_gradient": kept}

    def check_prepared(self, trainer, world_size):
        try:
            from deepspeed import DeepSpeedEngine
        except ImportError as e:
            return {}, [f"deepspeed cannot be imported in the rank: {e}"]
        engine = trainer.model_wrapped
        asked = stage_of(trainer.stnb_config)
        if not isinstance(engine, DeepSpeedEngine):
            return {"zero_stage_asked": asked}, [f"expected a DeepSpeedEngine, the trainer used {type(engine).__name__}"]
        seen = engine.zero_optimization_stage()
        problems = []
        if seen != asked:
            problems.append(f"ZeRO stage {asked} was asked, the DeepSpeed engine runs stage {seen}")
        if engine.module is not trainer.model:
            problems.append("the DeepSpeed engine trains a module other than the trainer's model")
        import torch.distributed as dist

        acc = trainer.accelerator
        if (acc.num_processes, acc.process_index) != (dist.get_world_size(), dist.get_rank()):
            problems.append(f"accelerate splits the data as rank {acc.process_index} of {acc.num_processes}, the "
                            f"process group has this rank as {dist.get_rank()} of {dist.get_world_size()}: every rank "
                            "would train on the same batches")
        info = {"zero_stage_asked": asked, "zero_stage_seen": seen, "deepspeed_optimizer": type(engine.optimizer).__name__,
                "deepspeed_version": __import__("deepspeed").__version__}
        if seen == 3:
            info_3, problems_3 = stage3_partitions(engine.module, world_size)
            info.update(info_3)
            problems += problems_3
        return info, problems

    def check_step(self, trainer, world_size):
        """After the first optimizer step: this rank's partition of the optimizer (fp32 master copy and
        AdamW's moments) about 1/N, and, at stage 2 and 3, the gradients it held at the step its partition only."""
        engine = trainer.model_wrapped
        opt = engine.optimizer
        stage = engine.zero_optimization_stage()
        part = optimizer_partition(opt)
        grads = getattr(trainer, "stnb_ds_grads", {})
        problems = []
        if not part["state_numel"]:
            problems.append("this rank holds no optimizer state after the first step")
        elif part["state_numel"] != part["slots"] * part["partition_numel"]:
            problems.append(f"the optimizer state holds {part['state_numel']} values for a partition of "
                            f"{part['partition_numel']}: not this rank's partition only")
        if not grads:
            problems.append("the gradients at the first optimizer step were not observed")
        elif grads["whole_grad_numel"] or grads["partition_grad_numel"] != part["partition_numel"]:
            # every stage reduces the gradients into this rank's partition before its step (stage 1 after the
            # backward, stage 2 and 3 bucket by bucket during it) and frees the whole ones
            problems.append(f"at the optimizer step this rank held {grads['whole_grad_numel']} gradient values of "
                            f"whole parameters and {grads['partition_grad_numel']} in its partition of "
                            f"{part['partition_numel']}: ZeRO keeps only the partition")
        reduces = bool(getattr(opt, "partition_gradients", stage == 3))
        if reduces != (stage >= 2):
            problems.append(f"the ZeRO optimizer {'reduce-scatters' if reduces else 'all-reduces'} gradients during "
                            f"the backward; stage {stage} {'does not' if stage < 2 else 'does'}")
        return {**part, "partition_gradients": reduces,
                **{f"grads_{k}": v for k, v in grads.items() if k != "bytes"}}, problems

    def held_bytes(self, trainer):
        return held_bytes(trainer)

    def check_ranks(self, rank_results, world_size):
        ranks = [r.verification for r in rank_results]
        problems = []
        total = ranks[0].get("trainable_numel") or 0
        held = [(v.get("partition_numel") or 0) - (v.get("partition_padding") or 0) for v in ranks]
        if sum(held) != total:
            problems.append(f"the ranks' optimizer partitions cover {sum(held)} parameter values, the optimizer "
                            f"updates {total}")
        ideal = total / max(1, world_size)
        if total and any(abs(h - ideal) > 0.01 * total + 64 for h in held):
            problems.append(f"the ranks' optimizer partitions hold {held} of {total} values; over {world_size} ranks "
                            f"each should hold about {ideal:.0f}")
        info = {"optimizer_partition_fractions": [h / total if total else None for h in held]}
        if ranks[0].get("zero_stage_seen") == 3:
            local = sum(v.get("local_param_count") or 0 for v in ranks)
            want = ranks[0].get("total_param_count")
            # each parameter's last piece is padded up to ceil(numel / N)
            info["shards_add_up"] = want <= local < want + world_size * (ranks[0].get("ds_partitioned_params") or 1)
            if not info["shards_add_up"]:
                problems.append(f"the ranks' parameter partitions hold {local} values, the model has {want}")
        return info, problems

    def full_model(self, model, rank):
        """Stage 3 gathers every partition (a collective) into rank 0's state dict; stage 1/2 hold it whole."""
        if not any(hasattr(p, "ds_tensor") for p in model.parameters()):
            return super().full_model(model, rank)
        import deepspeed
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        full = {}
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if rank == 0:
                    full[name] = p.detach().clone().cpu()
        # training is over: rank 0 alone now loads a plain copy to put these in, and while the trainer's ZeRO-3
        # config is registered transformers builds every model under deepspeed.zero.Init, which broadcasts each
        # parameter to ranks that never enter it (observed: rank 0 stuck in _zero_init_param, rank 1 at the barrier)
        unset_hf_deepspeed_config()
        if rank != 0:
            return None, True
        persistent = set(model.state_dict())  # keys only: ZeRO-3's parameters are empty here
        full.update({name: b.detach().clone().cpu() for name, b in model.named_buffers() if name in persistent})
        return full, True


@contextlib.contextmanager
def gathered_in_place(model, state_dict: dict):
    """Every ZeRO-3 parameter of ``model`` (an empty placeholder beside this rank's partition) holds its whole
    tensor from ``state_dict`` (gathered, by name) for the time of the block, then its placeholder again."""
    params = dict(model.named_parameters())
    placeholders = {}
    try:
        for name, p in params.items():
            if name in state_dict:
                placeholders[name], p.data = p.data, state_dict[name]
        yield
    finally:
        for name, data in placeholders.items():
            params[name].data = data


def split_data_across_ranks(trainer) -> dict:
    """Make accelerate split the batches over the ranks, as it does under DDP.

    On a CPU machine accelerate's state under DeepSpeed says one process: ``PartialState.__init__``
    (accelerate 1.15, state.py) gets no backend from ``_prepare_backend`` (not ``cpu``, and no CUDA/XPU/...
    device), so it sets ``num_processes = 1``, ``process_index = 0`` and only then turns the distributed
    type into DEEPSPEED. The engine still partitions over the whole process group, but the dataloader is not
    sharded: every rank trains on the same batches (observed: both ranks' first batches identical). The
    shared state is set from the process group before ``train()`` builds the dataloader; ``check_prepared``
    checks it."""
    import os

    import torch.distributed as dist

    state = trainer.accelerator.state  # AcceleratorState copies PartialState's fields: both are set
    from accelerate.state import PartialState

    before = {"num_processes": state.num_processes, "process_index": state.process_index}
    if dist.is_available() and dist.is_initialized() and state.num_processes != dist.get_world_size():
        seen = dict(num_processes=dist.get_world_size(), process_index=dist.get_rank(),
                    local_process_index=int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        for one in (PartialState(), state):
            one.__dict__.update(seen)
        return {"accelerate_saw": before, "set_to": {"num_processes": trainer.accelerator.num_processes,
                                                     "process_index": trainer.accelerator.process_index}}
    return {"accelerate_saw": before, "set_to": None}
