"""Per-rank memory: what each strategy should need, and what a run measured.

The model *state* of a training rank has up to four parts:

==================  ==================  ==============  ==============  ==============
part                single / dp / ddp   zero1           zero2           fsdp (zero3)
==================  ==================  ==============  ==============  ==============
params              4 B x P             4 B x P         4 B x P / N     4 B x P / N
grads               4 B x T             4 B x T         4 B x T / N     4 B x T / N
optimizer_state     8 B x T (AdamW)     8 B x T / N     8 B x T / N     8 B x T / N
ddp_buckets         ddp: 4 B x T        4 B x T         -               -
gathered_params     -                   -               4 B x P (1-1/N) one block
==================  ==================  ==============  ==============  ==============

Each strategy says which parts it shards (``Strategy.sharded``, ``Strategy.held``) and whether it
gathers whole parameters during the step (``gathered_during_step``: zero2 keeps every parameter whole
from its forward through its backward; fsdp gathers one block at a time, which the prediction leaves
out); nothing here knows a strategy by name.

P is the number of parameters, T the number of *trainable* ones (stnb freezes BERT's unused
pooler, so T is a little smaller than P), 4 B is one fp32 number. AdamW keeps two moments
per trainable parameter (``exp_avg`` and ``exp_avg_sq``), hence 8 B; it also keeps a
one-number ``step`` per tensor, a few hundred bytes that the prediction leaves out.

DDP copies every gradient into communication buckets for the all-reduce, so it holds the
gradients twice unless ``gradient_as_bucket_view=True`` makes ``.grad`` a view into the
bucket. FSDP divides all three parts by the world size: that is the whole point of sharding.
DP (``torch.nn.DataParallel``) keeps the full state on GPU 0 and short-lived replicas of the
parameters on the other GPUs; the prediction is GPU 0's.

Activations (which grow with batch size and sequence length), the CUDA context, allocator
caches and, on CPU, the Python process itself come on top: a run's *peak* memory is always
above the predicted model state. ``measure(model, optimizer)`` counts what a rank holds from its
tensors, ``PeakMemory`` reads its peak from the allocator or the kernel, and ``compare(result)``
puts the prediction (from ``model_shape``) next to what a run measured for every rank.
"""

from __future__ import annotations

import math
import numbers

from .errors import ConfigError, unknown_choice
from . import strategies

COMPONENTS = ("params", "grads", "optimizer_state", "ddp_buckets", "gathered_params")

# optimizer state per trainable parameter, in units of bytes_per_param
OPTIMIZER_SLOTS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "adafactor": 1}



def predict(strategy: str, param_count: int, world_size: int = 1, trainable_param_count: int | None = None,
            bytes_per_param: int = 4, optimizer: str = "adamw", **options) -> dict:
    """Predicted model-state bytes held by *one* rank.

    strategy: a registered strategy's name (``stnb.strategies.names()``).
    param_count: all parameters of the model (P).
    world_size: ranks (a strategy's sharded parts are divided by it).
    trainable_param_count: parameters that get gradients and optimizer state (T; default P).
    bytes_per_param: 4 for fp32 weights (mixed precision still keeps fp32 master weights).
    optimizer: 'adamw'/'adam' (2 states per parameter), 'sgd_momentum' (1), 'sgd' (0).
    options: the strategy's own options that change what a rank holds, as ``TrainConfig`` takes them (DDP's
    ``gradient_as_bucket_view=True``: gradients live in the buckets, no copy; DeepSpeed's ``stage=1``, 2, 3); an
    option of another strategy is refused.

    Returns ``{"params", "grads", "optimizer_state", "ddp_buckets", "gathered_params", "total"}`` in bytes.

    >>> predict("ddp", 1_000_000, world_size=2)["total"]
    20000000
    >>> predict("fsdp", 1_000_000, world_size=2)["total"]
    8000000
    """
    s = strategies.get(strategy)
    for name, value in options.items():
        if name not in s.options:
            raise ConfigError(f"{name}={value!r} is not an option of strategy {s.name!r}; its options: "
                              f"{', '.join(s.options) or 'none'}")
        s.options[name].check(name, value)
    _check_count("param_count", param_count, 0)
    _check_count("world_size", world_size, 1)
    _check_count("bytes_per_param", bytes_per_param, 1)
    trainable = param_count if trainable_param_count is None else trainable_param_count
    _check_count("trainable_param_count", trainable, 0)
    param_count, world_size, trainable, bytes_per_param = map(int, (param_count, world_size, trainable,
                                                                   bytes_per_param))
    if trainable > param_count:
        raise ConfigError(f"trainable_param_count={trainable} is larger than param_count={param_count}")
    key = str(optimizer).lower()
    if key not in OPTIMIZER_SLOTS:
        raise unknown_choice("optimizer", optimizer, OPTIMIZER_SLOTS)

    held = s.held(world_size, options)
    params = math.ceil(bytes_per_param * param_count * held["params"])
    grads = math.ceil(bytes_per_param * trainable * held["grads"])
    slots = OPTIMIZER_SLOTS[key] + (1 if s.master_weights else 0)  # DeepSpeed: + its fp32 master partition
    optimizer_state = math.ceil(slots * bytes_per_param * trainable * held["optimizer_state"])
    ddp_buckets = bytes_per_param * trainable if s.bucket_copy(options) else 0
    gathered = bytes_per_param * param_count - params if s.gathered_during_step == "all" else 0
    out = {"params": params, "grads": grads, "optimizer_state": optimizer_state, "ddp_buckets": ddp_buckets,
           "gathered_params": gathered}
    out["total"] = sum(out.values())
    return out


def predict_table(param_count: int, world_size: int = 2, trainable_param_count: int | None = None,
                  strategies=None, **kwargs):
    """``predict`` for several strategies side by side: a DataFrame, one row per strategy, in MiB. A strategy's
    own option among ``kwargs`` applies to the strategies that take it."""
    import pandas as pd

    from . import strategies as registry

    shared = {k: kwargs[k] for k in ("bytes_per_param", "optimizer") if k in kwargs}  # every row's
    unknown = [k for k in kwargs if k not in shared and k not in registry.options()]
    if unknown:
        raise ConfigError(f"predict_table got {', '.join(unknown)}: neither bytes_per_param, optimizer nor a "
                          f"strategy's option ({', '.join(registry.options())})")
    rows = []
    for name in (strategies or registry.names()):
        s = registry.get(name)
        ws = world_size if s.distributed else 1
        p = predict(name, param_count, ws, trainable_param_count, **shared, **s.own(kwargs))
        rows.append({"strategy": name, "world_size": ws, **{f"{k}_mib": v / 2**20 for k, v in p.items()}})
    return pd.DataFrame(rows)


def model_shape(model, optimizer: str = "adamw") -> dict:
    """What a prediction needs, read from the model itself (before it is sharded or trained).

    param_count: every parameter's numel; trainable_param_count: those with ``requires_grad``;
    bytes_per_param: the element size most parameters have; optimizer: passed through.
    """
    from collections import Counter

    total = trainable = 0
    sizes = Counter()
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
        sizes[p.element_size()] += p.numel()
    return {"param_count": total, "trainable_param_count": trainable,
            "bytes_per_param": sizes.most_common(1)[0][0] if sizes else 4, "optimizer": optimizer_kind(optimizer)}


def optimizer_kind(name) -> str:
    """The OPTIMIZER_SLOTS key of an optimizer name ('adamw_torch_fused' -> 'adamw')."""
    key = str(getattr(name, "value", name)).lower()
    for kind in ("adafactor", "sgd_momentum", "adamw", "adam", "sgd"):
        if key.startswith(kind):
            return kind
    raise ConfigError(f"no memory prediction for optimizer {name!r}; stnb knows {', '.join(OPTIMIZER_SLOTS)}")


def measure(model, optimizer, held_elsewhere: dict | None = None) -> dict:
    """Bytes a rank holds, counted from the tensors themselves (a DTensor counts its local shard):
    the parameters, their ``.grad`` tensors and every tensor in the optimizer's state, plus what the
    strategy holds where these do not show it (``Strategy.held_bytes``: DeepSpeed's partitions)."""
    import torch

    from .strategies import tensor_bytes

    params = sum(tensor_bytes(p) for p in model.parameters())
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: this rank's own optimizer holds its state
    ostate = 0
    if opt is not None:
        for st in opt.state.values():
            ostate += sum(tensor_bytes(v) for v in st.values() if torch.is_tensor(v))
    extra = held_elsewhere or {}
    params, grads, ostate = (params + extra.get("params", 0), grads + extra.get("grads", 0),
                             ostate + extra.get("optimizer_state", 0))
    return {"params": params, "grads": grads, "optimizer_state": ostate, "total": params + grads + ostate}


class PeakMemory:
    """A rank's peak memory from the allocator (CUDA: ``max_memory_allocated``) or from the kernel
    (CPU: the process's resident high-water mark, VmHWM, reset when a measurement starts; its
    growth over the resident size when the rank began).

    ``PeakMemory(cuda)`` starts the whole-run measurement; ``start_phase()`` / ``phase_peak()``
    measure the training steps alone (rank 0's evaluation, FSDP's gathered full copy and the
    save/reload come after training and count in ``peak()``, the whole run, only); ``pause_phase()`` /
    ``resume_phase()`` leave work between two steps out of the phase (the trainer's evaluation: the dev
    curve), in the whole run's peak only."""

    def __init__(self, cuda: bool):
        import torch

        self.cuda = cuda
        self._before_phase = 0  # the whole run's peak before the phase's reset (absolute)
        self._phase_kept = 0    # the phase's peak before its pauses (absolute)
        self._paused = False
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            self.method = "cuda max_memory_allocated"
            return
        self.reset = _reset_high_water()
        self.base = _rss()
        self.method = ("resident high-water mark (VmHWM) growth" if self.reset
                       else "resident high-water mark (ru_maxrss) growth, not reset: may include earlier peaks")

    def _current_peak(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated()) if self.cuda else _high_water()

    def start_phase(self) -> None:
        """Remember the run's peak so far, then reset the counter: ``phase_peak`` sees this phase only."""
        self._before_phase = max(self._before_phase, self._current_peak())
        self._phase_kept, self._paused = 0, False
        self._reset()

    def _reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_high_water()

    def pause_phase(self) -> None:
        """Work that is no part of the phase follows (an evaluation between steps): the phase's peak so far kept."""
        if not self._paused:
            self._phase_kept, self._paused = max(self._phase_kept, self._current_peak()), True
            self._reset()

    def resume_phase(self) -> None:
        """The phase goes on: what the pause reached counts in the whole run's peak only."""
        if self._paused:
            self._before_phase, self._paused = max(self._before_phase, self._current_peak()), False
            self._reset()

    def phase_peak(self) -> int:
        """Peak since ``start_phase``, pauses left out (CPU: as growth over the rank's starting resident size)."""
        return self._growth(max(self._phase_kept, 0 if self._paused else self._current_peak()))

    def peak(self) -> int:
        """Peak over the whole run, phases included."""
        return self._growth(max(self._before_phase, self._phase_kept, self._current_peak()))

    def _growth(self, value: int) -> int:
        return value if self.cuda else max(0, value - self.base)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_high_water() -> bool:
    try:  # Linux >= 4.0: "5" resets the peak resident set size of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_status(key: str) -> int | None:
    """Bytes of one of this process's ``/proc/self/status`` sizes ('VmHWM', 'VmData', ...); None without it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _high_water() -> int:
    hwm = proc_status("VmHWM")
    if hwm is not None:
        return hwm
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def compare(result, optimizer: str | None = None):
    """Predicted vs measured model-state memory of every rank of a run.

    ``result`` is a RunResult (or its dict / a row of ``stnb.results_frame``). The two sides are
    independent and meet only here:

    - the prediction (``predict``) comes from the model's shape as the run recorded it before
      training (``verification['model_shape']``: parameter count, trainable count from
      ``requires_grad``, bytes per parameter, optimizer), the strategy and the *requested* world size;
    - the measurement is what each rank counted from its own tensors after the first optimizer
      step (``memory_breakdown``: parameters, ``.grad`` tensors, optimizer state tensors; DTensors
      count their local shard). DDP's gradient buckets live inside its reducer and are not measured.

    Returns a DataFrame with columns rank, component, predicted_bytes, measured_bytes,
    measured_over_predicted, predicted_mib, measured_mib, note. The 'peak' row puts the run's
    measured peak (CUDA: max_memory_allocated; CPU: growth of the rank's resident high-water mark)
    next to the predicted model state: the difference is activations and everything else.
    """
    import pandas as pd

    r = _as_dict(result)
    status = r.get("status", "ok")
    breakdown = r.get("memory_breakdown") or []
    if status != "ok" or not breakdown or not any(breakdown):
        why = r.get("reason") or "the run recorded no memory breakdown"
        raise ConfigError(f"run {r.get('strategy')!r} (status {status!r}) has no memory measurement to compare: {why}")
    verification = r.get("verification") or {}
    shape = verification.get("model_shape")
    if not shape:
        raise ConfigError(f"run {r.get('strategy')!r} recorded no model shape (parameter and trainable counts), "
                          "so there is nothing to predict from; it was recorded by an older stnb: run it again")
    strategy = r["strategy"]
    world_size = int(verification.get("world_size_requested") or r.get("world_size") or 1)
    total_params, trainable = int(shape["param_count"]), int(shape["trainable_param_count"])
    optimizer = optimizer_kind(optimizer or shape.get("optimizer") or "adamw")
    s = strategies.get(strategy)
    # its own options as the run set them: the result's row first, then its config (None, NaN: not recorded)
    own = {k: v for source in (r.get("config") or {}, r) for k, v in s.own(source).items() if v is not None and v == v}
    pred = predict(strategy, total_params, world_size if s.distributed else 1, trainable,
                   bytes_per_param=int(shape.get("bytes_per_param") or 4), optimizer=optimizer, **own)
    asked = ", ".join(f"{k}={v!r}" for k, v in own.items() if v != s.options[k].default)
    peaks = r.get("peak_memory_bytes") or []
    rows = []
    for rank, meas in enumerate(breakdown):
        meas = meas or {}
        for comp in COMPONENTS:
            if comp == "ddp_buckets" and not s.ddp_buckets:
                continue
            if comp == "gathered_params" and not s.gathered_during_step:
                continue
            m = meas.get(comp)
            note = ""
            if comp == "gathered_params":
                m = None
                note = ("not measured apart: whole parameters from the forward through the backward, in the peak"
                        if pred[comp] else "one block gathered at a time (in the peak, not predicted)")
            elif comp == "ddp_buckets":
                m = None
                note = ("not measured: the buckets live inside DDP's reducer"
                        if pred[comp] else f"{asked}: gradients are the buckets, no copy")
            elif comp == "optimizer_state":
                note = f"{optimizer}: {OPTIMIZER_SLOTS[optimizer]} states per trainable parameter"
            elif comp == "grads" and trainable < total_params:
                note = f"{total_params - trainable} frozen parameters (requires_grad=False) have no gradient"
            rows.append(_row(rank, comp, pred[comp], m, note))
        measured_state = sum(meas.get(c, 0) for c in ("params", "grads", "optimizer_state"))
        predicted_state = pred["params"] + pred["grads"] + pred["optimizer_state"]
        rows.append(_row(rank, "total", predicted_state, measured_state,
                         "params + grads + optimizer_state" + (" (ddp_buckets not included)"
                                                              if s.ddp_buckets else "")))
        if rank < len(peaks) and peaks[rank]:
            rows.append(_row(rank, "peak", pred["total"], peaks[rank],
                             "measured peak includes activations and the runtime; predicted: model state only"))
    df = pd.DataFrame(rows, columns=["rank", "component", "predicted_bytes", "measured_bytes",
                                     "measured_over_predicted", "predicted_mib", "measured_mib", "note"])
    df["measured_bytes"] = df["measured_bytes"].astype("Int64")
    df["measured_over_predicted"] = df["measured_over_predicted"].astype(float)
    df["measured_mib"] = df["measured_mib"].astype(float)
    return df


# ---- helpers ---------------------------------------------------------------------------------

def _row(rank, comp, predicted, measured, note):
    ratio = (measured / predicted) if (measured is not None and predicted) else None
    return {"rank": rank, "component": comp, "predicted_bytes": int(predicted),
            "measured_bytes": None if measured is None else int(measured),
            "measured_over_predicted": ratio, "predicted_mib": predicted / 2**20,
            "measured_mib": None if measured is None else measured / 2**20, "note": note}


def _as_dict(result) -> dict:
    if hasattr(result, "to_dict") and not hasattr(result, "index"):  # RunResult
        return result.to_dict()
    if hasattr(result, "to_dict"):  # pandas Series (a results_frame row)
        return dict(result.to_dict())
    if isinstance(result, dict):
        return result
    raise ConfigError(f"compare needs a RunResult, its dict or a results_frame row; got {type(result).__name__}")


def _check_count(name, value, lo):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")


def stage_table(results):
    """Each run's model state per rank, measured from its tensors, as a fraction of the whole model's,
    beside the fraction its strategy predicts (``Strategy.held``): the ZeRO stages side by side.

    ``results``: RunResults (or their dicts) of the same model. Returns a DataFrame, one row per run and
    part (params, grads, optimizer_state): strategy, world_size, part, measured_fraction (the largest
    rank's bytes over the whole part's, from the run's own model shape), predicted_fraction, measured_mib.
    """
    import pandas as pd

    rows = []
    for res in results:
        r = _as_dict(res)
        shape = (r.get("verification") or {}).get("model_shape")
        breakdown = [b for b in (r.get("memory_breakdown") or []) if b]
        if not shape or not breakdown:
            raise ConfigError(f"run {r.get('strategy')!r} has no memory measurement (status {r.get('status', 'ok')!r})")
        s = strategies.get(r["strategy"])
        ws = int(r.get("world_size") or 1)
        whole = predict(strategies.baseline_name(), int(shape["param_count"]), 1, int(shape["trainable_param_count"]),
                        bytes_per_param=int(shape.get("bytes_per_param") or 4),
                        optimizer=optimizer_kind(shape.get("optimizer") or "adamw"))
        held = s.held(ws)
        for part in ("params", "grads", "optimizer_state"):
            biggest = max(b.get(part, 0) for b in breakdown)
            rows.append({"strategy": r["strategy"], "world_size": ws, "part": part,
                         "measured_fraction": biggest / whole[part] if whole[part] else None,
                         "predicted_fraction": held[part], "measured_mib": biggest / 2**20})
    return pd.DataFrame(rows)
