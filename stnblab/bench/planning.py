"""Planning: every run a ``BenchOptions`` asks for, as ``Item``s in execution order.

Owns the items (one planned run each, with a stable key for resuming), the DDP knob variants and
their matching single-device baselines, and the interleaving of repeats. Nothing runs here: a
configuration this machine cannot run is planned with the reason (``Item.unavailable``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass

from stnb.errors import ConfigError, StrategyUnavailable
from stnb import strategies as registry
from .options import BenchOptions, bench_device


@dataclass
class Item:
    """One planned run."""

    section: str
    name: str                 # variant, e.g. "ddp stnb.launch"
    launcher: str             # stnb | notebook_launcher | torchrun | concurrent
    config: object            # TrainConfig (tagged with config.extra['bench'])
    repeat: int = 0
    baseline: str | None = None   # knobs: the single-device variant it is compared with
    unavailable: str | None = None
    key: str = ""

    def label(self) -> str:
        return f"{self.section}: {self.name}" + (f" (repeat {self.repeat + 1})" if self.section != "sweep" or
                                                  self.repeat else "")


def _key(section, name, launcher, repeat, cfg_dict) -> str:
    """A key over the whole measurement (not process control): the same run has the same key."""
    cfg = json.loads(json.dumps(cfg_dict, sort_keys=True, default=str))
    cfg.get("extra", {}).pop("bench", None)
    for k in ("timeout", "stall_timeout"):  # process control, not the measurement
        cfg.pop(k, None)
    blob = json.dumps({"section": section, "name": name, "launcher": launcher, "repeat": repeat, "config": cfg},
                      sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _tagged(cfg, section, name, launcher, repeat, baseline=None):
    key = _key(section, name, launcher, repeat, cfg.to_dict())
    extra = dict(cfg.extra)
    extra["bench"] = {"section": section, "name": name, "launcher": launcher, "repeat": repeat, "key": key,
                      "baseline": baseline}
    return cfg.replace(extra=extra), key


def _rotate(seq, k):
    seq = list(seq)
    if not seq:
        return seq
    k %= len(seq)
    return seq[k:] + seq[:k]


KNOBS = "ddp"  # the strategy whose tunings the knobs section measures


def _knob_variants(device: str, threads: int, quick: bool, accumulate: int | None = None) -> list:
    """(name, TrainConfig overrides, accumulation of the matching baseline): the knobs section's strategy's
    tunings (``Strategy.tunings``, declared by the strategy) against its defaults, then under accumulation."""
    a = accumulate or (2 if quick else 4)
    s = registry.get(KNOBS)
    v = [("defaults", {}, 1), ("system allocator (page faults)", {"reuse_freed_memory": False}, 1),
         *((name, dict(options), 1) for name, options in s.tunings.items()),
         (f"accumulate {a} (no_sync)", {"gradient_accumulation_steps": a}, a),
         *((f"accumulate {a} + {name}", {"gradient_accumulation_steps": a, **options}, a)
           for name, options in s.tunings_accumulating.items())]
    if device == "cpu":
        v.append((f"{threads * 2} threads/rank (oversubscribed)", {"threads_per_rank": threads * 2}, 1))
    if quick:
        keep = {"defaults", "embedding rows hook", "tuned: static + view + 100 MB + no broadcast",
                f"accumulate {a} + embedding rows hook"}
        v = [x for x in v if x[0] in keep]
    return v


def _accumulating(cfg, a: int):
    """The config with ``a`` micro-batches per optimizer step, measuring about as many samples."""
    if a <= 1:
        return cfg
    warm = max(1, math.ceil(cfg.warmup_steps_excluded / a))
    return cfg.replace(gradient_accumulation_steps=a, warmup_steps_excluded=warm,
                       steps=warm + max(2, math.ceil((cfg.steps - cfg.warmup_steps_excluded) / a)))


def whole_machine_name(cores: int) -> str:
    """The knobs section's variant of one process with every core (``BenchOptions.whole_machine``)."""
    return f"single {cores} threads (whole machine)"


_CONCURRENT = " x single at once (no communication)"


def concurrent_name(n: int) -> str:
    """The knobs section's variant of ``n`` independent single runs side by side (CPU only): DDP's ceiling."""
    return f"{n}{_CONCURRENT}"


def is_concurrent(text: str) -> bool:
    """Whether ``text`` is that variant's name, or a note that begins with it."""
    return re.match(rf"\d+{re.escape(_CONCURRENT)}", text) is not None


def knob_names(device: str = "cpu", quick: bool = False) -> list:
    return [n for n, _, _ in _knob_variants(device, 1, quick)]


def plan(opts: BenchOptions) -> list:
    """Every run the options ask for, in execution order (interleaved repeats)."""
    from stnb.config import TrainConfig
    from stnb.hardware import cpu_cores, max_processes

    device = bench_device(opts)[0]
    nmax = max_processes(device)
    base = TrainConfig(model=opts.model, data=opts.data, loss=opts.loss, max_seq_length=opts.max_seq_length,
                       steps=opts.steps, warmup_steps_excluded=opts.warmup, train_size=opts.train_size, dev_size=16,
                       evaluate=False, device=device, timeout=opts.run_timeout,
                       stall_timeout=max(60.0, opts.run_timeout / 5))
    items: list[Item] = []

    def add(section, name, launcher, cfg, repeat, baseline=None, unavailable=None):
        cfg, key = _tagged(cfg, section, name, launcher, repeat, baseline)
        items.append(Item(section, name, launcher, cfg, repeat, baseline, unavailable, key))


    # -- sweep
    if "sweep" in opts.sections:
        nprocs = list(opts.nprocs) if opts.nprocs else sorted({2, nmax}) if nmax >= 2 else [2]
        for rep in range(opts.sweep_repeats):
            for strategy in opts.strategies:
                for b in opts.batch_sizes:
                    several = registry.is_distributed(strategy)
                    for n in (nprocs if several else [1]):
                        cfg = base.replace(strategy=strategy, per_device_batch_size=b,
                                           num_processes=n if several else None)
                        name = f"{strategy} x{n} b{b}" if several else f"{strategy} b{b}"
                        add("sweep", name, "stnb", cfg, rep, unavailable=_unavailable(cfg, device, nmax))

    n = opts.comparison_nproc or (nmax if device == "cuda" else min(nmax, cpu_cores()))
    n = max(n, 2)
    threads = max(1, cpu_cores() // n) if device == "cpu" else None
    ddp = base.replace(strategy="ddp", num_processes=n, per_device_batch_size=opts.batch_size,
                       threads_per_rank=threads)
    one = base.replace(strategy=registry.baseline_name(), per_device_batch_size=opts.batch_size,
                       threads_per_rank=threads)
    dev1 = f"single 1 device ({threads} thread{'s' if (threads or 1) > 1 else ''})" if device == "cpu" \
        else "single 1 GPU"

    # -- launchers
    if "launchers" in opts.sections:
        variants = [(dev1, "stnb", one), ("ddp stnb.launch", "stnb", ddp),
                    ("ddp notebook_launcher", "notebook_launcher", ddp), ("ddp torchrun", "torchrun", ddp)]
        if device == "cpu" and cpu_cores() > (threads or 1):
            variants.append((f"single {cpu_cores()} threads (whole machine)", "stnb",
                             one.replace(threads_per_rank=cpu_cores())))
        why = {name: _unavailable(cfg, device, nmax) for name, _, cfg in variants}
        for rep in range(opts.repeats):
            for name, launcher, cfg in _rotate(variants, rep):
                add("launchers", name, launcher, cfg, rep, unavailable=why[name])

    # -- knobs
    if "knobs" in opts.sections:
        quick = opts.preset == "quick"
        knobs = _knob_variants(device, threads or 1, quick, opts.accumulate)
        if opts.knobs:
            wanted = set(opts.knobs)
            unknown = wanted - {k for k, _, _ in knobs}
            if unknown:
                raise ConfigError(f"unknown knob variant(s) {sorted(unknown)}; choose from "
                                  f"{', '.join(k for k, _, _ in knobs)}")
            knobs = [k for k in knobs if k[0] in wanted or k[0] == "defaults"]
        # every DDP variant is compared with a single device that accumulates and allocates the same way
        def baseline(a, reuse):
            return (dev1 + (f", accumulate {a}" if a > 1 else "") + ("" if reuse else ", system allocator"),
                    _accumulating(one, a).replace(reuse_freed_memory=reuse))

        variants = []
        for a, reuse in sorted({(a, over.get("reuse_freed_memory", True)) for _, over, a in knobs},
                               key=lambda x: (x[0], not x[1])):
            bname, bcfg = baseline(a, reuse)
            variants.append((bname, "stnb", bcfg, None))
        for name, over, a in knobs:
            bname = baseline(a, over.get("reuse_freed_memory", True))[0]
            over = {k: v for k, v in over.items() if k != "gradient_accumulation_steps"}
            variants.append((f"ddp {name}", "stnb", _accumulating(ddp.replace(**over), a), bname))
        if device == "cpu":
            variants.append((concurrent_name(n), "concurrent",
                             one.replace(extra={"concurrent_runs": n}), dev1))
        if device == "cpu" and opts.whole_machine and cpu_cores() > (threads or 1):
            # what one would run without ranks: one process, every core, DDP's global batch (same optimizer steps)
            variants.append((whole_machine_name(cpu_cores()), "stnb",
                             one.replace(threads_per_rank=cpu_cores(), per_device_batch_size=opts.batch_size * n),
                             None))
        for rep in range(opts.repeats):
            for name, launcher, cfg, bname in _rotate(variants, rep):
                add("knobs", name, launcher, cfg, rep, baseline=bname,
                    unavailable=_unavailable(cfg.replace(strategy="ddp", num_processes=n)
                                             if launcher == "concurrent" else cfg, device, nmax))
    # -- checkpoints: every strategy's checkpoint cost (seconds of the slowest rank, bytes each rank wrote)
    if "checkpoints" in opts.sections:
        every = checkpoint_interval(opts.steps)
        for rep in range(opts.repeats if opts.preset != "quick" else 1):
            for s in _rotate([s.name for s in registry.all_strategies()], rep):
                several = registry.is_distributed(s)
                cfg = (ddp if several else one).replace(strategy=s, num_processes=n if several else None,
                                                        checkpoint_every=every,
                                                        checkpoint_dir=str(opts.checkpoint_root() / s))
                add("checkpoints", f"{s} x{n}" if several else s, "stnb", cfg, rep,
                    unavailable=_unavailable(cfg, device, nmax))
    return items


#: checkpoints a run of the checkpoints section writes (every steps // this many steps)
CHECKPOINTS_A_RUN = 4


def checkpoint_interval(steps: int) -> int:
    """The checkpoints section's checkpoint_every for a run of ``steps`` steps."""
    return max(1, steps // CHECKPOINTS_A_RUN)


def _unavailable(cfg, device, nmax) -> str | None:
    """Why this configuration cannot run on this machine (None when it can). Bad values raise."""
    cfg.validate(check_resources=False)
    try:
        cfg.check_hardware()
    except StrategyUnavailable as e:
        return e.reason
    except ConfigError as e:
        return str(e)
    return None
