"""fsdp (ZeRO stage 3): FSDP2 ``fully_shard``, parameters, gradients and optimizer state sharded.

Each transformer block and then the root are sharded by stnb *before* the Trainer sees the model.
accelerate ignores FSDP settings on CPU and silently runs DDP; stnb does not rely on them. The model
is marked as owning its placement and gradient reduction (``is_distributed_loading_by_transformers``),
the Trainer's contract for models sharded before training, so the Trainer neither moves nor re-wraps
it. Verified: every parameter is a DTensor whose local shard has exactly the shape its placements
give this rank (the last rank's piece is smaller when a dimension does not divide), every gradient
after the first backward likewise, and the ranks' shards add up to the model.

``zero2`` (``stnb.strategies.zero2``) is the same machinery with ``reshard_after_forward=False``.

Laid out for speed where it costs no peak memory (issue 20, measured in docs/scaling.md): the root and the
last block keep their gathered parameters for the backward that needs them first, each unit prefetches the
next block's all-gather, and on CPU the all-gathers are asynchronous (``shard_fsdp``).

A trainer's ``fp16`` / ``bf16`` mean what they mean under ``single`` on CPU (the trainer's autocast over float32
parameters, no param_dtype); on GPUs FSDP2's half-precision parameters, said in ``overridden_args``
(``precision_policy``).
"""

from __future__ import annotations

from .base import (Option, Strategy, load_scheduler, mixed_precision, rebuild_optimizer, save_scheduler,
                   torch_optimizer)
from .stepcost import pipeline, step

# The Trainer's contract for a model sharded before training (``is_distributed_loading_by_transformers``:
# it neither moves nor re-wraps the model) came in transformers 5.19 (5.18's Trainer does not read it); an
# older Trainer hands the sharded model to accelerate, which wraps it in DDP and fails on its DTensor
# parameters (seen with 5.17: "Operator c10d.broadcast_.default does not have a sharding strategy").
NEEDS_TRANSFORMERS = "5.19"


def installed_transformers() -> str:
    from importlib.metadata import version

    return version("transformers")


FSDP_OPTIONS = {
    "reshard_after_forward": Option(
        True, "bool", "FSDP: free the gathered parameters after forward, gathering them again in backward "
        "(--no-reshard-after-forward keeps them: zero2's layout)",
        lever="reshard_after_forward=False (no second all-gather in backward)",
        wire=lambda reshard: {"gathers_again": bool(reshard)}),
    "fsdp_layer_cls": Option(None, "str | None", "FSDP: the module class to shard separately (default: the "
                                                 "model's transformer block)", unset="its transformer block"),
}


class FullyShardedDataParallel(Strategy):
    name = "fsdp"
    label = "FSDP (ZeRO-3)"
    aka = "ZeRO stage 3"
    summary = "FSDP2 fully_shard: one process per device, parameters, gradients and optimizer state sharded"
    color = "#2ca02c"
    min_ranks = 2
    options = FSDP_OPTIONS
    tunings = {"no reshard": {"reshard_after_forward": False}}
    sharded = frozenset({"params", "grads", "optimizer_state"})
    gathered_during_step = "layer"
    order = 60
    bench = True
    gpu_check = True

    def step_time(self, m, fab, n, host_fraction=None):
        """Per unit (each transformer layer, and the root holding the embeddings): all-gather the parameters
        before its forward and again before its backward (unless ``m.gathers_again`` is off: the
        gathered parameters stay), reduce-scatter its gradients after; the next unit's all-gather is
        prefetched during this unit's compute. The optimizer updates 1/n of the parameters."""
        return fsdp_step(m, fab, n, m.gathers_again)

    def reshard_after_forward(self, config) -> bool:
        return bool(config.reshard_after_forward)

    def validate(self, config):
        from ..errors import ConfigError

        if config.num_processes == 1:
            raise ConfigError(f"{self.name} with num_processes=1 shards nothing; use num_processes >= 2 or "
                              "strategy='single'")
        from packaging.version import Version

        have = installed_transformers()
        if Version(have) < Version(NEEDS_TRANSFORMERS):
            raise ConfigError(f"strategy {self.name!r} needs transformers >= {NEEDS_TRANSFORMERS} (installed: {have}): "
                              "an older Trainer wraps the model stnb sharded before training in DDP again, which "
                              f"fails on its sharded parameters; pip install 'transformers>={NEEDS_TRANSFORMERS}', "
                              "or use strategy='ddp' or 'zero1'")

    checkpoint_format = "dcp"
    reshards = True  # torch.distributed.checkpoint reads shards written by any number of ranks into this run's
    DCP_MODEL, DCP_OPTIMIZER = "dcp-model", "dcp-optimizer"  # a checkpoint's folders of shards (every rank's)

    def saving(self, trainer):
        """Each rank writes and reads only its shards with ``torch.distributed.checkpoint`` (the model in
        ``dcp-model/``, the optimizer in ``dcp-optimizer/``; ``get_state_dict`` / ``set_state_dict``): a model
        sharded before training has no whole copy to ``save_pretrained``. The optimizer's state of a loss's own
        parameters (replicated, not sharded) is in ``dcp-optimizer/`` too, by their names (``named_with_loss``),
        written once; their values beside (``Strategy.saving``). Rank 0 writes the scheduler; the RNG states and
        the trainer state are the trainer's. ``stnb.checkpoints.to_model`` opens the model on one device, whatever
        number of ranks wrote it."""
        import os

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict as sd

        from .loss_sync import named_with_loss

        def save_model(output_dir=None, state_dict=None):
            dcp.save(sd.get_model_state_dict(trainer.model), checkpoint_id=os.path.join(output_dir, self.DCP_MODEL))

        def save_optimizer_and_scheduler(output_dir):
            dcp.save(sd.get_optimizer_state_dict(named_with_loss(trainer), torch_optimizer(trainer)),
                     checkpoint_id=os.path.join(output_dir, self.DCP_OPTIMIZER))
            save_scheduler(trainer, output_dir)

        def load_model(checkpoint, model=None):
            state = sd.get_model_state_dict(trainer.model)
            dcp.load(state, checkpoint_id=os.path.join(checkpoint, FullyShardedDataParallel.DCP_MODEL))
            sd.set_model_state_dict(trainer.model, state)

        def load_optimizer_and_scheduler(checkpoint):
            if checkpoint is None:
                return
            named, folder = named_with_loss(trainer), os.path.join(checkpoint, self.DCP_OPTIMIZER)
            state = sd.get_optimizer_state_dict(named, torch_optimizer(trainer))  # every parameter's, initialised
            # a trainable parameter that had no gradient before the checkpoint (a user's model's unused pooler) has
            # no state in it, and keeps none (seen: "Missing key in checkpoint state_dict: state.0.model.pooler...")
            saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
            state["state"] = {n: v for n, v in state["state"].items() if any(f"state.{n}.{k}" in saved for k in v)}
            dcp.load(state, checkpoint_id=folder)
            sd.set_optimizer_state_dict(named, torch_optimizer(trainer), state,
                                        options=sd.StateDictOptions(strict=False))
            load_scheduler(trainer, checkpoint)

        trainer._save, trainer._save_optimizer_and_scheduler = save_model, save_optimizer_and_scheduler
        trainer._load_from_checkpoint, trainer._load_optimizer_and_scheduler = load_model, load_optimizer_and_scheduler
        super().saving(trainer)  # a checkpoint of another layout (stnb.strategies.layouts)

    def unreadable(self, path, written):
        """DCP names every tensor, and any process reads the shards of every rank; but a loss's own parameters
        are not the model's, which is all another layout reads by name."""
        import os

        from .loss_sync import LOSS_PARAMETERS

        if not os.path.isfile(os.path.join(path, LOSS_PARAMETERS)):
            return ""
        return (f"it holds a loss's own parameters and their optimizer state ({LOSS_PARAMETERS}), which another "
                "layout does not read (it reads the model's, by name); resume it with "
                f"strategy={written.get('strategy')!r} and num_processes={written.get('world_size')}")

    def read_model(self, checkpoint, like):
        import os

        from .layouts import read_dcp

        return read_dcp(os.path.join(checkpoint, self.DCP_MODEL))

    def read_optimizer(self, checkpoint):
        import os

        from .layouts import read_dcp

        return read_dcp(os.path.join(checkpoint, self.DCP_OPTIMIZER))

    @staticmethod
    def checkpoint_model(checkpoint, like, device: str = "cpu"):
        """The model in a checkpoint this strategy wrote, as an ordinary model on one device: ``like`` (the
        untrained model, a path) loaded, then its tensors read from the shards (DCP reshards from any number of
        ranks to this one process)."""
        import os

        import torch.distributed.checkpoint as dcp

        if isinstance(like, str):
            from sentence_transformers import SentenceTransformer

            like = SentenceTransformer(like, device=device)
        model = like
        state = model.state_dict()
        dcp.load(state, checkpoint_id=os.path.join(checkpoint, FullyShardedDataParallel.DCP_MODEL))
        model.load_state_dict(state, strict=True)
        return model

    def prepare(self, trainer, config, device_type, world):
        info = {"initial_weights": same_start(trainer.model)}
        precision = mixed_precision(trainer.args)
        info.update(shard_fsdp(trainer.model, device_type, world, config.fsdp_layer_cls,
                               self.reshard_after_forward(config), precision))
        trainer.stnb_after_forward = watch_after_forward(trainer.model, self.reshard_after_forward(config))
        keep_shards_apart(trainer)
        # the trainer reads this at construction; the model was sharded after it (the same contract)
        trainer.is_distributed_loading_by_transformers = True
        trainer.place_model_on_device = False
        return {"info": info, "overridden": precision_policy(precision, device_type)[2]}

    def check_prepared(self, trainer, world_size):
        import torch
        from torch.distributed.fsdp import FSDPModule

        from torch.distributed.tensor import DTensor

        from .. import checks

        model, wrapped = trainer.model, trainer.model_wrapped
        problems = []
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            problems.append("the model was wrapped in DistributedDataParallel: FSDP silently became DDP")
        if not isinstance(model, FSDPModule):
            problems.append(f"root module is {type(model).__name__}, not an FSDP2 module (fully_shard)")
        plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        if plain:
            problems.append(f"{len(plain)} parameter(s) are not sharded, e.g. {plain[:3]}")
        problems += checks.shard_problems(model, world_size)  # exact local size per parameter, mesh, layout
        expected = sum(checks.expected_local_numel(p) for p in model.parameters())
        return {"expected_local_param_count": expected, "ideal_fraction": 1.0 / world_size}, problems

    def check_step(self, trainer, world_size):
        """After the first backward: every gradient is a DTensor shard of exactly this rank's size
        (reduce-scattered), never a whole gradient."""
        from .tensors import shard_problems

        grads = [(n, p.grad) for n, p in trainer.model.named_parameters() if p.requires_grad and p.grad is not None]
        missing = [n for n, p in trainer.model.named_parameters() if p.requires_grad and p.grad is None]
        expected, problems = shard_problems(grads, what="gradient")
        if missing and not grads:
            problems.append("no gradient existed after the first backward")
        held = sum(g.to_local().numel() if hasattr(g, "to_local") else g.numel() for _, g in grads)
        # parameters after a block's training forward: whole (kept for the backward) or resharded, observed
        watched = getattr(trainer, "stnb_after_forward", {})
        seen, asked = watched.get("whole"), watched.get("expected_whole")
        if seen is None and not watched.get("forwards_inside_backward"):
            problems.append("no training forward of a sharded block was observed")
        elif seen is not None and seen != asked:
            raf = self.reshard_after_forward(trainer.stnb_config)
            problems.append(f"the first block's parameters were {'whole' if seen else 'resharded'} after its "
                            f"forward; {self.name} with reshard_after_forward={raf} keeps them "
                            f"{'whole' if asked else 'sharded'}")
        return {"grad_local_count": held, "grad_expected_local_count": expected, "grads_checked": len(grads),
                "params_whole_after_forward": seen}, problems

    def check_ranks(self, rank_results, world_size):
        ranks = [r.verification for r in rank_results]
        held = sum(v.get("local_param_count") or 0 for v in ranks)
        total = ranks[0].get("total_param_count")
        problems = [] if held == total else [f"the ranks' local shards hold {held} parameter values, "
                                             f"the model has {total}"]
        return {"shards_add_up": held == total}, problems

    def after_training(self, trainer):
        """Every FSDP unit resharded: an evaluation at the trainer's last step (eval_strategy='steps') ran a
        forward with no backward after it, so the units that keep their gathered parameters after a forward
        (the root; every unit under zero2) still hold them, whole, as plain tensors: the replicated
        digests would read them (making their storage unresizable, so that resharding them later fails)."""
        from torch.distributed.fsdp import FSDPModule

        for module in trainer.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def full_model(self, model, rank):
        """A FULL_STATE_DICT gathered to rank 0 (a collective: every rank takes part)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return (full if rank == 0 else None), True


def shard_fsdp(model, device: str, world_size: int, layer_cls: str | None = None,
               reshard_after_forward: bool = True, mixed_precision: str = "no") -> dict:
    """Apply FSDP2 fully_shard to each transformer block, then to the root. Returns details.

    What runs is laid out for speed where it costs no peak memory (``python -m stnb split --fsdp`` measures it):

    * the root (embeddings, head) keeps its gathered parameters from forward to backward, FSDP2's own
      default for the root: its backward hook would all-gather them again at the very start of backward;
    * with ``reshard_after_forward``, every block but the last reshards after its forward; the last block's
      backward runs first, so resharding it only to gather it again at once saves no peak memory;
    * each unit's forward all-gathers the next block's parameters (explicit forward prefetch); backward
      prefetches the previous block (FSDP2's default);
    * on CPU the gathers are issued asynchronously (``async_op=True``): gloo has no streams, so FSDP2's
      default (a synchronous all-gather on the side stream it uses on GPUs) blocks the rank and makes
      prefetching useless there; on GPUs FSDP2's streams overlap them already.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..errors import ConfigError
    from ..models import layer_classes

    try:
        classes = tuple(layer_classes(model, layer_cls))
    except ConfigError as e:  # named as the user gives it
        raise ConfigError(f"fsdp_layer_cls {layer_cls!r}: {e}" if layer_cls is not None else
                          f"{e}; e.g. TrainConfig(fsdp_layer_cls='ClassName')") from None
    mesh = init_device_mesh(device, (world_size,))
    blocks_mp, root_mp, _ = precision_policy(mixed_precision, device.split(":")[0])
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    plan = reshard_plan(len(blocks), reshard_after_forward)
    def policy(dtypes: dict):  # precision_policy's {field: dtype name} as FSDP2's policy
        return MixedPrecisionPolicy(**{k: getattr(torch, v) for k, v in dtypes.items()})

    mp = policy(blocks_mp)
    units = [fully_shard(m, mesh=mesh, reshard_after_forward=r, mp_policy=mp) for m, r in zip(blocks, plan)]
    # the root is gathered again by its backward hook as soon as backward starts; kept, it costs no peak memory
    # (a CrossEncoder's BatchEncoding output, which torch's pytree cannot look into, needs it kept anyway)
    fully_shard(model, mesh=mesh, reshard_after_forward=False,
                mp_policy=policy(root_mp))
    prefetch(model, units, asynchronous=device == "cpu")
    # Trainer contract for models that own their placement and gradient reduction
    model.is_distributed_loading_by_transformers = True
    return {"wrapped_layer_class": [c.__name__ for c in classes], "wrapped_layers": len(units),
            "reshard_after_forward": reshard_after_forward, "blocks_resharded_after_forward": sum(plan),
            "root_reshard_after_forward": False, "forward_prefetch": len(units) > 0,
            "async_all_gather": device == "cpu", "mixed_precision_policy": root_mp}


def precision_policy(mixed_precision: str, device_type: str) -> tuple[dict, dict, dict]:
    """What a trainer's precision flag (``mixed_precision``: 'bf16', 'fp16' or 'no') makes of FSDP2 on
    ``device_type``: (the blocks' MixedPrecisionPolicy, the root's, both as {field: torch dtype name}; the
    ``overridden_args`` entry, {} when fsdp computes as ``single`` does).

    Under single and ddp the flag means accelerate's autocast around the model's forward over float32
    parameters, its outputs handed back in float32: bf16 on CPU and GPUs, fp16 on GPUs only (on CPU
    accelerate leaves fp16=True without effect: float32). On CPU fsdp adds nothing to it, no param_dtype:
    the same computation as single, and a loss's own float32 parameters (a projection) meet float32
    embeddings. On a GPU fsdp gathers and computes the parameters in the flag's dtype (FSDP2's
    param_dtype, as accelerate's FSDP2 and torchtitan apply it: half the all-gather bytes), reduces the
    gradients in float32 and hands the root's output back in float32; norms, residual adds and pooling then
    run in that dtype too, which autocast keeps in float32: said in ``overridden_args``."""
    if mixed_precision not in ("bf16", "fp16") or device_type == "cpu":
        return {}, {}, {}
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[mixed_precision]
    blocks = {"param_dtype": dtype, "reduce_dtype": "float32"}
    root = {**blocks, "output_dtype": "float32"}
    policy = ", ".join(f"{k}={v}" for k, v in root.items())
    why = (f"single and ddp autocast the forward over float32 parameters; fsdp on a GPU gathers the parameters in "
           f"{dtype} and computes in it, norms, residual adds and pooling too (FSDP2's mixed precision, as "
           "accelerate's FSDP2 applies it: half the all-gather bytes); gradients are reduced and the embeddings "
           f"reach the loss in float32. single's computation with {mixed_precision}=True: strategy='ddp' or 'zero1'")
    return blocks, root, {mixed_precision: {"from": True, "to": f"MixedPrecisionPolicy({policy}) + autocast",
                                            "why": why}}


def reshard_plan(blocks: int, reshard_after_forward: bool) -> list[bool]:
    """``reshard_after_forward`` per block: asked for, every block but the last (the first one backward needs)."""
    return [reshard_after_forward and i < blocks - 1 for i in range(blocks)]


def prefetch(root, units: list, asynchronous: bool) -> None:
    """The root prefetches the first block's all-gather in its forward, each block the next one's;
    ``asynchronous``: FSDP2 issues its all-gathers with ``async_op=True`` (CPU: gloo blocks otherwise)."""
    for unit, following in zip([root, *units], units):
        unit.set_modules_to_forward_prefetch([following])
    if asynchronous:
        # FSDP2's switch for async pre-forward/pre-backward all-gathers (torch names it with an underscore;
        # documented on FSDPModule)
        root._set_unshard_async_op(True)


def keep_shards_apart(trainer) -> None:
    """The optimizer gets the sharded parameters (DTensors) and the loss's own replicated ones (plain
    tensors) in separate param groups: a fused/foreach update cannot mix them ("got mixed torch.Tensor and
    DTensor"). sentence-transformers builds its groups from the loss (its classifier included), so the
    trainer's own split by mesh does not apply; the groups are split here after the optimizer is built."""
    def split_groups(built, defaults):
        from torch.distributed.tensor import DTensor

        groups = []
        for g in built.param_groups:
            for kind in (True, False):
                params = [p for p in g["params"] if isinstance(p, DTensor) is kind]
                if params:
                    groups.append({**g, "params": params})
        return built if len(groups) == len(built.param_groups) else type(built)(groups, **defaults)

    rebuild_optimizer(trainer, split_groups)


def watch_after_forward(model, reshard_after_forward: bool) -> dict:
    """Observe, at the first training forward of the first sharded block, whether its parameters are whole
    after the forward (FSDP2 swaps a block's DTensor shards for plain tensors while it is unsharded);
    ``expected_whole``: what ``reshard_plan`` asked of that block."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    seen = {"whole": None, "forwards_inside_backward": 0,
            "expected_whole": not reshard_plan(len(blocks), reshard_after_forward)[0] if blocks else None}
    if not blocks:
        return seen
    task_id = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside a backward pass

    def hook(module, args, output):
        if seen["whole"] is not None or not torch.is_grad_enabled():
            return
        if task_id is not None and task_id() != -1:
            # a forward recomputed inside the backward (gradient-cache losses): FSDP keeps it whole for
            # the backward running now, whatever reshard_after_forward says, so it tells nothing
            seen["forwards_inside_backward"] += 1
            return
        seen["whole"] = not any(isinstance(p, DTensor) for p in module.parameters())
        handle.remove()

    handle = blocks[0].register_forward_hook(hook)
    return seen


def same_start(model) -> dict:
    """Sharding splits each rank's own copy: make every rank start from rank 0's weights (DDP does the
    same when it wraps). A collective. Returns {"tensors_differing_before", "broadcast", "identical"}."""
    import torch
    import torch.distributed as dist

    from ..checks import compare_digests, gather_digests
    from ..errors import VerificationError

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {"tensors_differing_before": 0, "broadcast": False, "identical": True}
    same = compare_digests(gather_digests(model))
    n = len(same["differing"])
    if not n:
        return {"tensors_differing_before": 0, "broadcast": False, "identical": True}
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    after = compare_digests(gather_digests(model))  # observed again, not assumed
    if not after["identical"]:
        raise VerificationError(f"after broadcasting rank 0's weights, {len(after['differing'])} tensor(s) still "
                                f"differ across ranks, first {after['first_differing']!r}")
    return {"tensors_differing_before": n, "broadcast": True, "identical": True}


def collectives_per_step(m, reshard_after_forward: bool) -> float:
    """FSDP's collectives a step: every unit (the layers and the root) all-gathered before each call's forward,
    again before its backward when resharded after forward, and reduce-scattered once."""
    calls = m.forward_calls if reshard_after_forward else 1.0
    regather = m.forward_calls if reshard_after_forward else 0.0
    return (m.layers + 1) * (calls + regather + 1)


def fsdp_step(m, fab, n: int, reshard_after_forward: bool) -> dict:
    """FSDP's step on n devices (``FullyShardedDataParallel.step_time``): units pipelined, forward then backward;
    its wrapper's host work per collective (``m.collective_host``, measured with one rank) adds to the step."""
    root = m.root_fraction
    shares = [root] + [(1 - root) / m.layers] * m.layers
    work_f = [0.0] + [m.forward / m.layers] * m.layers
    work_b = [0.0] + [m.backward / m.layers] * m.layers
    # each call of the model (one per text column) gathers every unit again when it was resharded after
    # the previous call's forward, and its backward gathers again; kept parameters are gathered once
    calls = m.forward_calls if reshard_after_forward else 1.0
    gathered = m.param_bytes if m.gather_bytes is None else m.gather_bytes  # in the training precision
    fwd = [(calls * fab.all_gather(s * gathered, n), w, 0.0) for s, w in zip(shares, work_f)]
    regather = m.forward_calls if reshard_after_forward else 0.0
    bwd = [(regather * fab.all_gather(s * gathered, n), w, fab.reduce_scatter(s * m.grad_bytes, n))
           for s, w in reversed(list(zip(shares, work_b)))]
    t_f, c_f = pipeline(fwd, fab.overlap)
    t_b, c_b = pipeline(bwd, fab.overlap)
    host = m.collective_host * collectives_per_step(m, reshard_after_forward)
    exposed = t_f - m.forward + t_b - m.backward + host
    return step(t_f + t_b + host + m.optimizer / n + m.other, c_f + c_b + host, exposed)
