"""Parity: does a strategy train what one device trains?

``stnb.parity(build, strategies=[...], num_processes=2)`` trains the same recipe or build function on one
device with the global batch (``num_processes`` x the per-device batch), again with each batch's rows in
reverse order (the same training, summed in another order: how far rounding alone moves each tensor), and
under each strategy with the same global batch, seed and data, dropout off (or kept, and said so). Then it
compares every trained tensor -- the model's and the loss's own (SoftmaxLoss's classifier, a learnable
temperature) -- with where the one-device run left it:

    apart <= max(tolerance x moved, ROUNDING_FACTOR x rounding)

``moved``: how far one device's training moved the tensor; ``apart``: how far the strategy ended from
it; ``rounding``: how far the reversed run did (used only when that run is the same training overall).
A tensor past that fails, named. Verification (``RunResult.verified``) asks whether the ranks agree with
each other; parity asks whether they agree with one device (docs/parity.md).

How the weights come back: every run is a plain ``stnb.run`` of a build function that wraps yours
(``_recorded``): in rank 0 it saves the untrained model (``model.save``) and the loss's own parameters
before the strategy is applied, and the loss's own parameters again when training ends (they are whole
on every rank; stnb keeps them in sync). The trained model comes from ``save_to``, which gathers a
sharded model and checks that the saved folder reloads as the trained weights. Everything is written to
a temporary folder, read back here and removed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import tempfile

from .config import TrainConfig
from .errors import ConfigError, StnbError
from .hardware import rank_gpu
from .strategies import option_owners

DEFAULT_TOLERANCE = 1e-2  # of how far training moved the tensor (docs/parity.md: what reordered sums give)
ROUNDING_FACTOR = 10  # x how far the same training, summed in another order, ended (docs/parity.md)
DROPOUT = ("off", "keep")
_INITIAL, _TRAINED = "initial", "model"
_LOSS_INITIAL, _LOSS_TRAINED = "loss_initial.pt", "loss_trained.pt"


@dataclasses.dataclass
class Parity:
    """What ``stnb.parity`` found. ``table``: one row per run (``role``: the one-device ``reference``, the
    ``rounding`` run, then each ``strategy``); ``parameters``: one row per run and trained tensor;
    ``passed``: the reference and every strategy asked ran, were verified, started from the same weights
    and ended within what is allowed (``tolerance`` x how far the reference moved each tensor, or
    ``ROUNDING_FACTOR`` x how far the rounding run ended from it)."""

    table: object
    parameters: object
    tolerance: float
    dropout: str
    global_batch_size: int | None
    results: dict
    passed: bool

    def failures(self):
        """The parameters above the tolerance, worst first."""
        p = self.parameters
        return p[~p["within"]].sort_values("relative", ascending=False, na_position="first") if len(p) else p

    def __repr__(self) -> str:
        cols = ["strategy", "verified", "parameters", "over_tolerance", "overall", "worst_parameter",
                "max_relative", "allowed", "loss_apart", "passed"]
        lines = [f"stnb.parity: {'PASSED' if self.passed else 'FAILED'} (tolerance {self.tolerance:g} relative to "
                 f"how far one device moved each tensor; global batch {self.global_batch_size}; dropout "
                 f"{self.dropout})", self.table[cols].to_string(index=False)]
        reasons = self.table[self.table["reason"].astype(bool)]
        lines += [f"{r.strategy}: {r.reason}" for r in reasons.itertuples()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.__repr__())}</pre>"


def parity(build_or_config, strategies=None, num_processes: int = 2, tolerance: float = DEFAULT_TOLERANCE,
           dropout: str = "off", echo: bool = False, **options) -> Parity:
    """Train once on one device with the global batch and once under each strategy; compare every trained
    parameter (model and loss) with the one-device run. Returns a ``Parity`` (``.table``, ``.passed``).

    build_or_config: your build function (as for ``stnb.run(build, ...)``; its per-device batch is the
        strategies' per-device batch, the one-device run gets ``num_processes`` times it) or a TrainConfig
        of stnb's recipe (``batch_size`` per device likewise; its strategy and num_processes are ignored).
    strategies: names from ``stnb.strategies.names()`` that start one process per device; default every
        such strategy runnable here.
    tolerance: the largest relative difference a tensor may end at (see the module's docstring).
    dropout: "off" (every ``nn.Dropout`` set to p=0 in model and loss: ranks draw other masks than one
        device) or "keep" (then differences from dropout are part of what is measured).
    options: launch options passed to every ``stnb.run`` (device, threads_per_rank, timeout,
        start_method...); not strategy, num_processes or save_to, which parity sets.
    """
    from . import strategies as registry

    if dropout not in DROPOUT:
        raise ConfigError(f"dropout={dropout!r}: choose 'off' (set every nn.Dropout to p=0) or 'keep'")
    if not isinstance(num_processes, int) or num_processes < 2:
        raise ConfigError(f"num_processes={num_processes!r}: parity compares N >= 2 processes with one device")
    if not (isinstance(tolerance, (int, float)) and tolerance > 0):
        raise ConfigError(f"tolerance={tolerance!r}: a positive relative difference, e.g. {DEFAULT_TOLERANCE}")
    taken = sorted(set(options) & {"strategy", "num_processes", "save_to", "build"})
    if taken:
        raise ConfigError(f"parity sets {', '.join(taken)} itself for every run; leave {'it' if len(taken) == 1 else 'them'} out")
    share = bool(options.get("share_gpus", getattr(build_or_config, "share_gpus", False)))
    names = list(strategies) if strategies is not None else _runnable(options.get("device", "auto"), share)
    if not names:
        raise ConfigError("no strategy to compare with one device: name some in strategies=[...] "
                          f"({', '.join(registry.distributed_names())})")
    for name in names:
        if not registry.get(name).distributed:
            raise ConfigError(f"strategy {name!r} runs in one process; parity compares a strategy with one process "
                              f"per device ({', '.join(registry.distributed_names())}) with one device")
    build, inner, launch_opts = _as_build(build_or_config, options)
    unused = sorted(k for k in launch_opts if option_owners(k) and not set(option_owners(k)) & set(names))
    if unused:
        raise ConfigError("; ".join(f"{k} is an option of {' / '.join(option_owners(k))}" for k in unused)
                          + f", none of the strategies asked ({', '.join(names)}): add one or leave it out")
    baseline = registry.baseline_name()
    root = tempfile.mkdtemp(prefix="stnb-parity-")
    try:
        one = functools.partial(_train, build, inner, baseline, None, root, dropout, echo, launch_opts)
        ref = one(batch=num_processes)
        # the same training summed in another order: how far rounding alone moves each tensor (with dropout
        # kept it would draw other masks too, so then there is no such allowance)
        rounding = (one(batch=num_processes, reverse=True, label=f"{baseline}, rows reversed")
                    if dropout == "off" else _Run(f"{baseline}, rows reversed",
                                                  reason="not run: dropout kept (no rounding allowance)"))
        runs = [ref, rounding] + [_train(build, inner, n, num_processes, root, dropout, echo, launch_opts)
                                  for n in names]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _verdict(runs, tolerance, dropout)


def _verdict(runs: list, tolerance: float, dropout: str) -> Parity:
    """The ``Parity`` of ``runs``: the one-device reference, the rounding run, then each strategy's run."""
    import pandas as pd

    ref, rounding = runs[0], runs[1]
    # rounding may excuse a tensor only when the reversed run is the same training: with itself as the allowance
    # it passes (verified, the same start, batch and tensors, no NaN), and overall it ended within the tolerance
    own, _ = _compare(rounding, ref, rounding, tolerance)
    overall = _overall(rounding, ref)
    same = own["passed"] and overall <= tolerance
    if not own["passed"]:
        rounding.reason = own["reason"]
    elif not same:
        rounding.reason = (f"ended {overall:.2g} of how far training moved the model from the one-device run, "
                           "overall, with only the order of each batch's rows reversed: the loss depends on the "
                           "order of the rows, so rounding cannot be told apart; no rounding allowance")
    rows, params = [], []
    for run in runs:
        role = "reference" if run is ref else "rounding" if run is rounding else "strategy"
        row, per_param = _compare(run, ref, rounding if same else None, tolerance)
        row["overall"] = _overall(run, ref)
        if role == "rounding":  # judged as a whole: its single tensors are the allowance itself
            row["passed"], row["reason"] = same, rounding.reason
        rows.append({"role": role, **row})
        params += per_param
    table = pd.DataFrame(rows)
    parameters = pd.DataFrame(params, columns=["strategy", "parameter", "owner", "moved", "apart", "rounding",
                                                    "relative", "allowed", "within"])
    return Parity(table=table, parameters=parameters, tolerance=float(tolerance), dropout=dropout,
                  global_batch_size=ref.result.global_batch_size if ref.result is not None else None,
                  results={r.name: r.result for r in runs},
                  passed=bool(table[table["role"] != "rounding"]["passed"].all()))


def _runnable(device: str, share_gpus: bool = False) -> list:
    """Every strategy with one process per device that can run here (``share_gpus``: on GPUs several ranks share)."""
    from . import strategies as registry
    from .hardware import strategy_availability

    here = strategy_availability(None if device == "auto" else device, share_gpus)
    return [n for n in registry.distributed_names() if here[n]["runnable"]]


def _as_build(build_or_config, options: dict):
    """(the build function every run trains, the function whose code is read for refusals, launch options)."""
    if isinstance(build_or_config, TrainConfig):
        from .config import launch_fields
        from .models import resolve_model

        config = build_or_config.replace(**options) if options else build_or_config
        config.check_recipe_options()
        defaults = TrainConfig()
        launch = {k: getattr(config, k) for k in launch_fields()
                  if k not in ("strategy", "num_processes", "save_to") and getattr(config, k) != getattr(defaults, k)}
        build = functools.partial(recipe_build, dataclasses.replace(config, save_to=None), resolve_model(config.model))
        return build, build, launch
    from .runner import check_build

    return check_build(build_or_config), build_or_config, dict(options)


def _options_for(name: str, options: dict) -> dict:
    """The launch options for one run: every other strategy's own options left out."""
    return {k: v for k, v in options.items() if not option_owners(k) or name in option_owners(k)}


def recipe_build(config: TrainConfig, model_path: str):
    """In a rank: the trainer of stnb's recipe for ``config`` (what ``stnb.run(config)`` trains), for
    parity, which trains every run through a build function."""
    import torch
    import torch.distributed as dist

    from . import strategies
    from .recipe import build_trainer

    use_cuda = torch.cuda.is_available() and config.device != "cpu"
    distributed = dist.is_available() and dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{rank_gpu(local_rank)}" if use_cuda and distributed else ("cuda" if use_cuda else "cpu")
    trainer = build_trainer(config, model_path, device, use_cuda, distributed)
    strategies.freeze_unused_pooler(trainer.model)
    trainer.add_callback(_at_train_end(functools.partial(shutil.rmtree, trainer.args.output_dir, ignore_errors=True)))
    return trainer


@dataclasses.dataclass
class _Run:
    name: str
    result: object = None
    reason: str = ""
    initial: dict | None = None   # {tensor name: tensor} before training
    trained: dict | None = None   # after training
    owners: dict | None = None    # {tensor name: "model" | "loss"}


def _train(build, inner, name, num_processes, root, dropout, echo, options, batch=1, reverse=False,
           label=None) -> _Run:
    """One ``stnb.run`` of ``build`` under ``name``, recorded (see ``_recorded``: the per-device batch times
    ``batch``, each batch's rows in reverse order with ``reverse``); its weights read back."""
    from . import strategies as registry
    from .buildsource import read_objects
    from .runner import run

    label = label or name
    build = _under(build, name)
    refusal = registry.get(name).build_refusal(read_objects(inner))
    if refusal:
        return _Run(label, reason=f"refused before launch: {refusal}")
    out = tempfile.mkdtemp(prefix="run-", dir=root)
    recorder = functools.partial(_recorded, build, out, batch, reverse, dropout)
    try:
        result = run(recorder, strategy=name, num_processes=num_processes, save_to=os.path.join(out, _TRAINED),
                     echo=echo, **_options_for(name, options))
    except StnbError as e:
        return _Run(label, reason=f"{type(e).__name__}: {e}")
    run_ = _Run(label, result=result)
    if not result.verified:
        run_.reason = f"not verified: {result.reason}"
    if not os.path.isdir(os.path.join(out, _TRAINED)):
        run_.reason = run_.reason or "the trained model was not saved"
        return run_
    import torch

    loss_initial = torch.load(os.path.join(out, _LOSS_INITIAL))
    loss_trained = torch.load(os.path.join(out, _LOSS_TRAINED))
    model_initial, model_trained = _tensors(os.path.join(out, _INITIAL)), _tensors(os.path.join(out, _TRAINED))
    run_.initial = {**model_initial, **loss_initial}
    run_.trained = {**model_trained, **loss_trained}
    run_.owners = {**{n: "model" for n in model_initial}, **{n: "loss" for n in loss_initial}}
    return run_


def _under(build, name: str):
    """stnb's recipe (``recipe_build``) as the run under strategy ``name`` trains it: with that strategy's training
    arguments (DeepSpeed's config, accelerate's CPU mode off), not those of the strategy the config names. A user's
    build function is what it is."""
    if not (isinstance(build, functools.partial) and build.func is recipe_build):
        return build
    config, *rest = build.args
    own = {k: v for k, v in config.strategy_options.items() if name in option_owners(k)}
    return functools.partial(recipe_build, dataclasses.replace(config, strategy=name, strategy_options=own), *rest)


def _tensors(folder: str) -> dict:
    """Every tensor of a saved sentence-transformers model: {"<module folder>/<tensor>": tensor}."""
    from safetensors.torch import load_file

    out = {}
    for here, _, files in sorted(os.walk(folder)):
        for f in sorted(files):
            if f.endswith(".safetensors"):
                rel = os.path.relpath(here, folder)
                prefix = "" if rel == "." else rel + "/"
                out.update({prefix + k: v.float() for k, v in load_file(os.path.join(here, f)).items()})
    return out


def _compare(run: _Run, ref: _Run, rounding: _Run, tolerance: float):
    """(the run's table row, its per-tensor rows) against the one-device run ``ref``. A tensor is within
    when it ended no further from ``ref`` than ``tolerance`` x how far ``ref`` moved it, or than
    ROUNDING_FACTOR x how far ``rounding`` (the same training, summed in another order) ended from it."""
    row = {"strategy": run.name, "verified": bool(run.result is not None and run.result.verified),
           "world_size": run.result.world_size if run.result is not None else None,
           "global_batch_size": run.result.global_batch_size if run.result is not None else None,
           "parameters": 0, "over_tolerance": 0, "max_relative": math.nan, "allowed": math.nan,
           "worst_parameter": None,
           "loss_apart": _loss_apart(run, ref), "reason": run.reason, "passed": False}
    if run.trained is None or ref.trained is None:
        row["reason"] = row["reason"] or f"the one-device run gave nothing to compare with: {ref.reason}"
        return row, []
    problems = [row["reason"]] if row["reason"] else []
    if set(run.trained) != set(ref.trained):
        problems.append(f"other tensors than the one-device run: {sorted(set(run.trained) ^ set(ref.trained))[:5]}")
    if run.result.global_batch_size != ref.result.global_batch_size:
        problems.append(f"global batch {row['global_batch_size']}, not the one-device run's "
                        f"{ref.result.global_batch_size}")
    per_param = []
    for name in sorted(set(run.trained) & set(ref.trained)):
        start, end = ref.initial[name], ref.trained[name]
        if not (run.initial.get(name) is not None and run.initial[name].shape == start.shape
                and bool((run.initial[name] == start).all())):
            problems.append(f"{name} did not start from the one-device run's values")
        moved = float((end - start).norm())
        apart = float((run.trained[name] - end).norm())
        noise = (float((rounding.trained[name] - end).norm())
                 if rounding is not None and rounding.trained and name in rounding.trained else 0.0)
        allowed = max(tolerance * moved, ROUNDING_FACTOR * noise)
        per_param.append({"strategy": run.name, "parameter": name, "owner": ref.owners[name],
                          "moved": moved, "apart": apart, "rounding": noise, "relative": _ratio(apart, moved),
                          "allowed": _ratio(allowed, moved), "within": apart <= allowed})
    over = [p for p in per_param if not p["within"]]
    # the tensor closest to failing: the largest share of what it is allowed (a NaN first: it failed)
    worst = max(per_param, key=lambda p: _worse(_ratio(p["relative"], p["allowed"]))) if per_param else None
    row.update(parameters=len(per_param), over_tolerance=len(over),
               max_relative=worst["relative"] if worst else math.nan,
               allowed=worst["allowed"] if worst else math.nan,
               worst_parameter=worst["parameter"] if worst else None)
    if over:
        named = []
        for owner in ("loss", "model"):  # the loss's own first: the few tensors stnb itself keeps in sync
            mine = sorted((p for p in over if p["owner"] == owner), key=lambda p: -_worse(p["relative"]))
            if mine:
                named.append(f"{owner}: " + ", ".join(f"{p['parameter']} ({p['relative']:.2g})" for p in mine[:5])
                             + (f" and {len(mine) - 5} more" if len(mine) > 5 else ""))
        problems.append(f"{len(over)} parameter(s) ended further from one device than {tolerance:g} of how far "
                        f"training moved them (and than {ROUNDING_FACTOR:g} x rounding): " + "; ".join(named))
    row["reason"] = "; ".join(dict.fromkeys(problems))
    row["passed"] = not problems
    return row, per_param


def _overall(run: _Run, ref: _Run):
    """How far ``run`` ended from ``ref`` over all tensors together, as a share of how far ``ref`` moved them
    (None when either has nothing to compare)."""
    if not run.trained or not ref.trained or set(run.trained) != set(ref.trained):
        return None
    apart = sum(float((run.trained[n] - ref.trained[n]).norm()) ** 2 for n in ref.trained)
    moved = sum(float((ref.trained[n] - ref.initial[n]).norm()) ** 2 for n in ref.trained)
    return _ratio(apart ** 0.5, moved ** 0.5)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (0.0 if a == 0 else math.inf)


def _worse(x: float) -> float:
    """``x`` ranked as a difference: NaN (a tensor or a loss that is not a number) above every number."""
    return math.inf if math.isnan(x) else x


def _loss_apart(run: _Run, ref: _Run):
    """The largest relative difference of the logged losses from the one-device run's (None when either
    logged none or they logged different steps)."""
    a = getattr(run.result, "losses", None) or []
    b = getattr(ref.result, "losses", None) or []
    if not a or len(a) != len(b):
        return None
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), key=_worse)


# ---- in the ranks --------------------------------------------------------------------------------

def _recorded(build, out: str, batch: int, reverse: bool, dropout: str):
    """The trainer ``build()`` returns, recorded for parity: the per-device batch times ``batch`` (the
    one-device run takes the global batch), each batch's rows reversed with ``reverse`` (the rounding run:
    the same training, summed in another order), dropout off when asked, and rank 0 saves the
    untrained weights now and the loss's own parameters when training ends (a ``TrainerCallback``)."""
    import torch
    import torch.distributed as dist

    from .prepare import apply_overrides, call_build
    from .strategies import loss_owned_parameters

    trainer = call_build(build)
    if batch != 1:
        rows = trainer.args.per_device_train_batch_size * batch
        apply_overrides(trainer, TrainConfig.for_build(override_args={"per_device_train_batch_size": rows}))
    if reverse:
        _reverse_rows(trainer.data_collator)
    if dropout == "off":
        for part in [trainer.model, *(trainer.loss.values() if isinstance(trainer.loss, dict) else [trainer.loss])]:
            for m in part.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        trainer.model.save(os.path.join(out, _INITIAL))
        torch.save(_loss_state(loss_owned_parameters(trainer)), os.path.join(out, _LOSS_INITIAL))
        path = os.path.join(out, _LOSS_TRAINED)
        trainer.add_callback(_at_train_end(lambda: torch.save(_loss_state(loss_owned_parameters(trainer)), path)))
    return trainer


def _reverse_rows(collator) -> None:
    """Make ``collator`` (the trainer's, with the attributes the trainer reads) collate every batch with its
    rows in reverse order: the same training in exact arithmetic (a loss is a mean over rows; in-batch
    negatives see the same rows), summed in another order."""
    cls = type(collator)
    collator.__class__ = type(f"RowsReversed{cls.__name__}", (cls,),
                              {"__call__": lambda self, rows: cls.__call__(self, list(rows)[::-1])})


def _loss_state(named) -> dict:
    return {f"loss/{n}": p.detach().float().cpu().clone() for n, p in named}


def _at_train_end(action):
    """A TrainerCallback that calls ``action()`` when training ends."""
    from transformers import TrainerCallback

    class AtTrainEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kw):
            action()

    return AtTrainEnd()
