"""ddp: DistributedDataParallel, one process per device, gradients all-reduced.

The Trainer wraps the model through accelerate; stnb hands accelerate its DDP knobs
(``DistributedDataParallelKwargs``) and then checks the wrapper holds them (observed, not assumed).

Its options (``DDP_OPTIONS``, zero1's too): bucket_cap_mb, gradient_as_bucket_view, static_graph,
broadcast_buffers, comm_hook. ``broadcast_buffers``: sentence-transformers' training arguments force ``ddp_broadcast_buffers=False``
(its comment: some BERT models hit an in-place RuntimeError when buffers are broadcast at every
forward), so the default here is False, what really runs; ``broadcast_buffers=True`` is applied to DDP
(``forward_sync_buffers``) and checked on the wrapper.
"""

from __future__ import annotations

from .base import Option, Strategy
from .stepcost import buckets, pipeline, step

COMM_HOOKS = ("none", "fp16", "bf16", "embedding_rows")
DDP_OPTIONS = {
    "comm_hook": Option(
        "none", "str", "DDP's communication hook: none, fp16, bf16 (NCCL only) or embedding_rows (all-reduce only "
        "the embedding rows some rank used; exact, stnb.embedding_rows_hook)", choices=COMM_HOOKS, label="hook {}",
        lever="comm_hook='fp16' (half the bytes on the wire)", wire=lambda hook: (
            {"grad_element_bytes": 2, "grad_how": f"the {hook} hook"} if hook in ("fp16", "bf16") else {})),
    "gradient_as_bucket_view": Option(False, "bool", "DDP: gradients are views into the buckets (no copy of each)"),
    "static_graph": Option(False, "bool", "DDP: the same graph every step (not with gradient_accumulation_steps > 1)"),
    "bucket_cap_mb": Option(None, "float | None", "DDP: the gradient bucket size in MiB (default: DDP's 25)",
                            positive=True, unset="default (25)", lever="another bucket_cap_mb",
                            wire=lambda mb: {"bucket_bytes": float(mb) * 2**20} if mb else {}),  # else Measured's 25
    "broadcast_buffers": Option(
        False, "bool", "DDP: broadcast rank 0's buffers at every forward, a sync point (sentence-transformers turns "
        "it off, so False is what runs by default; BERT-style buffers never change)"),
}
# sentence-transformers turns DDP's buffer broadcast off, so that is the default; the tunings that say "no
# broadcast" spell it out, and "buffer broadcast on" measures what it would cost
_NO_BROADCAST = {"broadcast_buffers": False}
DDP_TUNINGS = {
    "buffer broadcast on": {"broadcast_buffers": True},
    "bucket 100 MB (one bucket)": {"bucket_cap_mb": 100},
    "static_graph + bucket view": {"static_graph": True, "gradient_as_bucket_view": True},
    "fp16 hook": {"comm_hook": "fp16"},
    "bf16 hook": {"comm_hook": "bf16"},
    "tuned: static + view + 100 MB + no broadcast": {"static_graph": True, "gradient_as_bucket_view": True,
                                                     "bucket_cap_mb": 100, **_NO_BROADCAST},
    "embedding rows hook": {"comm_hook": "embedding_rows"},
}
# under accumulation: no static_graph (it breaks under no_sync, pytorch/pytorch#143580; TrainConfig refuses it)
DDP_TUNINGS_ACCUMULATING = {
    "embedding rows hook": {"comm_hook": "embedding_rows"},
    "no broadcast": _NO_BROADCAST,
    "embedding rows hook + no broadcast": {"comm_hook": "embedding_rows", **_NO_BROADCAST},
    "fp16 hook": {"comm_hook": "fp16"},
    "view + 100 MB + no broadcast": {"gradient_as_bucket_view": True, "bucket_cap_mb": 100, **_NO_BROADCAST},
}
# (stnb.run knob, SentenceTransformerTrainingArguments field)
DDP_ARGS = (("bucket_cap_mb", "ddp_bucket_cap_mb"), ("broadcast_buffers", "ddp_broadcast_buffers"),
            ("static_graph", "ddp_static_graph"))


class TakesDDPOptions:
    """What a strategy whose gradients go through a DDP wrapper (ddp, zero1) takes from DDP: its options, the
    refusal of a hook CPU ranks cannot run, and the hook the time split registers."""

    options = DDP_OPTIONS

    def check_device(self, config, device):
        """torch's bf16 compression hook is NCCL's alone: refused for CPU ranks (gloo), before any process starts."""
        from ..errors import ConfigError

        if config.comm_hook == "bf16" and device == "cpu":
            raise ConfigError("comm_hook='bf16' needs CUDA GPUs: DDP accepts torch's bf16_compress_hook only with "
                              "NCCL, not with gloo (CPU); on CPU use comm_hook='fp16' or 'none'")

    def ddp_hook(self, config):
        return config.comm_hook, torch_hook(config.comm_hook)

    def bucket_copy(self, options=None):
        """No copy when the gradients are views into the buckets."""
        return not (options or {}).get("gradient_as_bucket_view", DDP_OPTIONS["gradient_as_bucket_view"].default)


class DistributedDataParallel(TakesDDPOptions, Strategy):
    name = "ddp"
    label = "DDP"
    summary = "DistributedDataParallel: one process per device, gradients all-reduced"
    color = "#1f77b4"
    ddp_buckets = True
    order = 30
    tunings = DDP_TUNINGS
    tunings_accumulating = DDP_TUNINGS_ACCUMULATING
    bench = True
    gpu_check = True

    def step_time(self, m, fab, n, host_fraction=None):
        return ddp_step(m, fab, n)

    def validate(self, config):
        from ..errors import ConfigError

        if config.static_graph and config.gradient_accumulation_steps > 1:
            raise ConfigError("static_graph=True cannot be combined with gradient_accumulation_steps > 1: DDP's "
                              "static graph breaks under no_sync() (pytorch/pytorch#143580: an INTERNAL ASSERT on "
                              "the first backward); use static_graph=False when accumulating gradients")

    def refusals(self, trainer, config):
        args = trainer.args
        static = config.static_graph or (args.ddp_static_graph and "static_graph" not in self.given(config))
        if static and args.gradient_accumulation_steps > 1:
            return ["DDP's static_graph cannot be combined with gradient_accumulation_steps > 1 "
                    "(pytorch/pytorch#143580); drop static_graph or the accumulation"]
        return []

    def prepare(self, trainer, config, device_type, world):
        kw, overridden = apply_ddp(trainer, config)
        return {"info": {"ddp_asked": dict(kw)}, "overridden": overridden}

    def on_first_step(self, trainer, config, world, timed=None):
        if config.comm_hook == "embedding_rows" and world > 1:
            from .. import embedding_rows_hook  # before the first backward, as DDP requires

            return {"embedding_rows": embedding_rows_hook.register(trainer.model_wrapped, wrap=timed)}
        return {}

    def check_prepared(self, trainer, world_size):
        return check_ddp_wrapper(trainer)

    def check_ranks(self, rank_results, world_size):
        return {}, []  # every replicated tensor identical: checked for every strategy (base.replicated_check)


def check_ddp_wrapper(trainer) -> tuple[dict, list]:
    """The trainer trains a DDP wrapper, and it holds the settings stnb asked accelerate for."""
    import torch

    w = trainer.model_wrapped
    if not isinstance(w, torch.nn.parallel.DistributedDataParallel):
        return {}, [f"expected DistributedDataParallel, the trainer used {type(w).__name__}"]
    seen = {"bucket_cap_mb": w.bucket_bytes_cap / 2**20, "find_unused_parameters": w.find_unused_parameters,
            "broadcast_buffers": getattr(w, "forward_sync_buffers", getattr(w, "broadcast_buffers", None)),
            "static_graph": w.static_graph, "gradient_as_bucket_view": w.gradient_as_bucket_view}
    asked = getattr(trainer, "stnb_ddp_asked", None) or {}
    problems = []
    for knob in ("broadcast_buffers", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb"):
        if knob in asked and asked[knob] is not None and float(asked[knob]) != float(seen[knob]):
            problems.append(f"DDP {knob}={asked[knob]!r} was asked, the wrapper holds {seen[knob]!r}")
    return {"ddp_settings": seen}, problems


def every_parameter_used_by_design(model) -> bool:
    """A reranker (CrossEncoder): one forward through the transformer and its classifier uses every parameter."""
    from ..model_types import of_model

    kind = of_model(model)
    return kind is not None and kind.kind == "reranker"


def torch_hook(name: str):
    """torch's DDP hook for a ``comm_hook`` name ('none' is the all-reduce DDP does by default); None for stnb's
    own hooks (they register themselves, timed: ``embedding_rows``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook}
    return hooks.get(name)


def ddp_kwargs(config) -> dict:
    """accelerate DistributedDataParallelKwargs from a TrainConfig's DDP knobs."""
    from accelerate.utils import DDPCommunicationHookType

    kw = {
        "find_unused_parameters": bool(config.extra.get("find_unused_parameters", False)),
        "broadcast_buffers": bool(config.broadcast_buffers),
        "gradient_as_bucket_view": bool(config.gradient_as_bucket_view),
        "static_graph": bool(config.static_graph),
        # stnb registers config.comm_hook itself at the first step, timed (stnb.timesplit); 'embedding_rows'
        # is stnb's own hook (stnb.embedding_rows_hook), registered by the strategy's on_first_step
        "comm_hook": DDPCommunicationHookType.NO,
    }
    if config.bucket_cap_mb:
        cap = config.bucket_cap_mb
        kw["bucket_cap_mb"] = int(cap) if float(cap).is_integer() else cap
    return kw


def apply_ddp(trainer, config) -> tuple[dict, dict]:
    """Set the accelerator's DDP kwargs (used when train() wraps the model). Returns (kwargs, overridden).

    A knob given to stnb.run (not at its default) decides, and replaces the trainer's argument (reported
    in ``overridden``); a knob left at its default keeps the trainer's own value. sentence-transformers
    sets ``ddp_broadcast_buffers=False`` itself, so that is what runs unless broadcast_buffers=True is asked."""
    kw = ddp_kwargs(config)
    own = getattr(trainer.accelerator, "ddp_handler", None)  # built from the trainer's arguments
    overridden = {}
    if own is not None:
        kw["find_unused_parameters"] = own.find_unused_parameters  # the trainer's own rule
        if own.find_unused_parameters and trainer.args.ddp_find_unused_parameters is None \
                and every_parameter_used_by_design(trainer.model):
            kw["find_unused_parameters"] = False
            overridden["ddp_find_unused_parameters"] = {
                "from": None, "to": False,
                "why": "the trainer's default (True) makes DDP fail on a CrossEncoder's float32 classifier head "
                       "('marked as ready twice', sentence-transformers 6.2); every parameter of a CrossEncoder is "
                       "used in its forward, so False is exact (set ddp_find_unused_parameters to choose)"}
    for knob, arg in DDP_ARGS:
        theirs, mine = getattr(trainer.args, arg), getattr(config, knob)
        if mine != DDP_OPTIONS[knob].default:  # given to stnb.run
            if theirs is not None and theirs != mine:
                overridden[arg] = {"from": theirs, "to": mine,
                                   "why": f"stnb.run(..., {knob}={mine!r}) was given; it decides DDP's {knob}"}
                setattr(trainer.args, arg, mine)
        elif theirs is not None:
            kw[knob] = theirs  # the user's value, kept
    trainer.accelerator.ddp_handler = ddp_handler(kw)
    trainer.stnb_ddp_asked = {k: kw.get(k) for k in ("broadcast_buffers", "static_graph", "gradient_as_bucket_view",
                                                      "bucket_cap_mb")}
    return kw, overridden


def ddp_handler(kw: dict):
    """accelerate's DDP kwargs handler for ``kw``. torch 2.13 deprecates DDP's ``broadcast_buffers``
    for ``forward_sync_buffers`` (a FutureWarning in every rank of every DDP run, since
    sentence-transformers turns the broadcast off), and accelerate's handler does not know the new
    name yet: a subclass carries it. The only difference: buffers are still synced once, at wrap
    time, which is what DDP does with the parameters anyway."""
    import inspect
    from dataclasses import dataclass

    import torch
    from accelerate.utils import DistributedDataParallelKwargs

    kw = dict(kw)
    if "forward_sync_buffers" not in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters:
        return DistributedDataParallelKwargs(**kw)

    @dataclass
    class Handler(DistributedDataParallelKwargs):
        forward_sync_buffers: bool = True

    forward = kw.pop("broadcast_buffers", True)
    return Handler(**kw, forward_sync_buffers=forward)


def ddp_step(m, fab, n: int) -> dict:
    """Forward (``m.forward_calls`` calls, one all-reduce all the same: autograd sums each parameter's gradient
    before DDP's hook sees it); backward with the gradient buckets (``bucket_bytes`` each) all-reduced as they
    fill, one collective at a time. Where the run measured when each gradient group was ready (``m.ready``), a
    bucket is ready when the group that fills it is; else the layers' gradients are ready in proportion to
    backward's progress and the root's (the embeddings, ``m.root_fraction`` of the bytes) only at its end, so
    their all-reduce is exposed. All of it is exposed when the link cannot overlap (CPU); optimizer; rest."""
    sizes = buckets(m)
    if m.ready:
        return ddp_step_measured(m, fab, n, sizes)
    layer_bytes = (1 - m.root_fraction) * m.grad_bytes
    per_byte = m.backward / layer_bytes if layer_bytes > 0 else 0.0
    units, filled = [], 0.0
    for s in sizes:  # reverse parameter order: the last layer's gradients first, the embeddings' last
        in_layers = max(0.0, min(filled + s, layer_bytes) - filled)
        units.append((0.0, in_layers * per_byte, fab.all_reduce(s, n)))
        filled += s
    if layer_bytes <= 0:
        units[0] = (0.0, m.backward, units[0][2])
    backward, comm = pipeline(units, fab.overlap)
    return step(m.forward + backward + m.optimizer + m.other, comm, backward - m.backward)


def ddp_step_measured(m, fab, n: int, sizes) -> dict:
    """``ddp_step`` with the buckets' ready times from the measured gradient readiness: the groups fill the
    buckets in the order they were ready; a bucket is ready at its last byte's group's time; backward's
    compute after the last bucket is ready runs with nothing left to send."""
    ready = sorted(m.ready)
    total = sum(share for _, share in ready) or 1.0
    units, t, filled, gi, acc = [], 0.0, 0.0, 0, ready[0][1] / total
    for s in sizes:
        filled += s / m.grad_bytes
        while acc < filled - 1e-9 and gi + 1 < len(ready):
            gi += 1
            acc += ready[gi][1] / total
        at = ready[gi][0] * m.backward
        units.append((0.0, max(0.0, at - t), fab.all_reduce(s, n)))
        t = max(t, at)
    units.append((0.0, max(0.0, m.backward - t), 0.0))
    backward, comm = pipeline(units, fab.overlap)
    return step(m.forward + backward + m.optimizer + m.other, comm, backward - m.backward)
