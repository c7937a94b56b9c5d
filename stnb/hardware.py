"""What this machine has, and which strategies can run here (with reasons).

Nothing here initialises the CUDA driver: ranks are forked from this process (on Linux), and a forked
child cannot use a driver its parent initialised ("Cannot re-initialize CUDA in forked
subprocess"). ``torch.cuda.is_available()`` and ``torch.cuda.device_count()`` may call
``cudaGetDeviceCount`` (which runs ``cuInit``), so GPUs are counted and described from NVML
(torch's own NVML reader, which honours CUDA_VISIBLE_DEVICES) and ``nvidia-smi`` instead.

``gpus()`` is the hardware API: one dict per visible GPU,
``{"index", "name", "memory_bytes", "compute_capability", "uuid"}`` (index: the CUDA ordinal a
rank sees; compute_capability: ``(major, minor)``; fields nvidia-smi could not give are None).
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
import warnings

from dataclasses import asdict, dataclass, field

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: native bf16 matmuls; below it torch emulates bf16, slowly


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset / cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _cuda_build() -> bool:
    import torch

    return os.environ.get("STNB_FORCE_CPU") != "1" and torch.version.cuda is not None


def gpu_count() -> int:
    """Visible CUDA GPUs (CUDA_VISIBLE_DEVICES honoured), counted without initialising the driver."""
    if not _cuda_build():
        return 0
    import torch

    nvml = getattr(torch.cuda, "_device_count_nvml", None)  # what torch.cuda.device_count() uses first
    if nvml is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Can't initialize NVML": nvidia-smi is asked next
            try:
                n = nvml()
            except Exception:  # noqa: BLE001 - a broken NVML is a missing NVML
                n = -1
        if n >= 0:
            return n
    return len(gpus())


@functools.lru_cache(maxsize=8)
def _smi_rows(path_env: str | None) -> tuple:
    """Every GPU nvidia-smi lists (physical order), or () without nvidia-smi. Never touches CUDA."""
    exe = shutil.which("nvidia-smi", path=path_env)
    if not exe:
        return ()
    fields = ["index", "name", "memory.total", "uuid", "compute_cap"]
    for query in (fields, fields[:-1]):  # compute_cap needs driver >= 510
        try:
            out = subprocess.run([exe, f"--query-gpu={','.join(query)}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return ()
        if out.returncode == 0:
            break
    else:
        return ()
    rows = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        cc = None
        if len(parts) > 4 and parts[4].replace(".", "", 1).isdigit():
            major, _, minor = parts[4].partition(".")
            cc = (int(major), int(minor or 0))
        mem = int(float(parts[2]) * 2**20) if parts[2].replace(".", "", 1).isdigit() else None
        rows.append({"index": int(parts[0]), "name": parts[1], "memory_bytes": mem,
                     "compute_capability": cc, "uuid": parts[3]})
    return tuple(rows)


def _visible(rows: list) -> list:
    """The rows CUDA_VISIBLE_DEVICES selects, in the order CUDA numbers them (ordinals or UUID prefixes)."""
    var = os.environ.get("CUDA_VISIBLE_DEVICES")
    if var is None:
        return list(rows)
    out = []
    for item in (x.strip() for x in var.split(",")):
        if item.startswith(("GPU-", "MIG-")):
            match = [r for r in rows if str(r["uuid"]).startswith(item)]
            if item.startswith("MIG-"):  # a MIG slice: the count is right, the details are its parent's
                match = rows[len(out):len(out) + 1]
        else:
            digits = item.lstrip("+")
            match = [r for r in rows if digits.isdigit() and r["index"] == int(digits)]
        if len(match) != 1 or match[0] in out:  # CUDA stops at the first invalid entry
            break
        out.append(match[0])
    return out


def gpus() -> list:
    """One dict per visible GPU: index (CUDA ordinal), name, memory_bytes, compute_capability (major,
    minor), uuid; read from nvidia-smi (NVML), never from the CUDA runtime. [] without a CUDA build."""
    if not _cuda_build():
        return []
    rows = _visible(list(_smi_rows(os.environ.get("PATH"))))
    if not rows:
        import torch

        nvml = getattr(torch.cuda, "_device_count_nvml", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                n = max(0, nvml()) if nvml is not None else 0
            except Exception:  # noqa: BLE001
                n = 0
        return [{"index": i, "name": f"cuda:{i}", "memory_bytes": None, "compute_capability": None, "uuid": None}
                for i in range(n)]
    return [dict(r, index=i) for i, r in enumerate(rows)]


def torch_arch_list() -> list:
    """GPU architectures this torch build ships kernels for, asked in a child process (cached).

    Not in this process: ``torch.cuda.get_arch_list()`` asks ``is_available()`` first, which runs
    ``cudaGetDeviceCount`` and so ``cuInit``, and ``torch._C._cuda_getArchFlags()`` marks forked children
    as forked from a CUDA parent ("Cannot re-initialize CUDA in forked subprocess"); both seen on an H200
    with torch 2.11, where every rank gpu-check forked after this call was refused or failed."""
    if not _cuda_build():
        return []
    return list(_arch_list_of(sys.executable))


@functools.lru_cache(maxsize=2)
def _arch_list_of(python: str) -> tuple:
    code = "import torch; print(' '.join(torch.cuda.get_arch_list()))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(out.stdout.split()) if out.returncode == 0 else ()


def arch_supported(capability, arch_list) -> bool:
    """True when a GPU of this compute capability can run this torch build's kernels: a cubin for
    sm_XY runs on the same major version with minor >= Y, PTX (compute_XY) JIT-compiles for any
    capability >= XY. Unknown capability or arch list: assumed supported."""
    if capability is None or not arch_list:
        return True
    cc = capability[0] * 10 + capability[1]
    for arch in arch_list:
        kind, _, ver = arch.partition("_")
        ver = ver.rstrip("af")
        if not ver.isdigit():
            continue
        code = int(ver)
        if kind == "sm" and code // 10 == capability[0] and code <= cc:
            return True
        if kind == "compute" and code <= cc:
            return True
    return False


def gpu_problems(mixed_precision: str = "no") -> list:
    """Why the visible GPUs cannot run stnb with this precision, each with its fix ([] when they can); GPUs of
    one model share one line ("GPUs 0, 1 (Tesla T4) are 7.5"), not the same line once per GPU."""
    archs = torch_arch_list()
    models = {}  # (name, compute capability) -> its GPUs' indices, in the order they are seen
    for g in gpus():
        cc = g["compute_capability"]
        models.setdefault((g["name"], tuple(cc) if cc is not None else None), []).append(g["index"])
    problems = []
    for (name, cc), indices in models.items():
        which, are = ((f"GPU {indices[0]}", "is") if len(indices) == 1 else
                      (f"GPUs {', '.join(str(i) for i in indices)}", "are"))
        if not arch_supported(cc, archs):
            problems.append(
                f"{which} ({name}, compute capability {cc[0]}.{cc[1]}) {'has' if are == 'is' else 'have'} no "
                f"kernels in this torch build (it ships {' '.join(archs)}). Fix: install a torch build whose "
                f"torch.cuda.get_arch_list() includes sm_{cc[0]}{cc[1]} (an older CUDA wheel, see "
                "https://pytorch.org/get-started/locally/), or use device='cpu'")
        elif mixed_precision == "bf16" and cc is not None and cc < BF16_MIN_CAPABILITY:
            problems.append(
                f"mixed_precision='bf16' needs compute capability >= 8.0 (Ampere or newer); {which} "
                f"({name}) {are} {cc[0]}.{cc[1]}, where bf16 is emulated and slow. "
                f"Fix: use mixed_precision='fp16' (or 'no') on {'this GPU' if are == 'is' else 'these GPUs'}")
    return problems


def usable_gpu_count() -> int:
    """Visible GPUs this torch build can run on (0 when any visible GPU has no kernels in it)."""
    n = gpu_count()
    if n and any(not arch_supported(g["compute_capability"], torch_arch_list()) for g in gpus()):
        return 0
    return n


def single_gpu_env() -> dict:
    """The environment that pins a one-process run to the first visible GPU (set in the child before
    CUDA starts there: this is why the notebook process must never start the driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"CUDA_VISIBLE_DEVICES": visible.split(",")[0].strip() if visible else "0"}


def device_env(device: str, threads: int | None = None) -> dict:
    """What a rank's environment says about its device, set before it imports torch or accelerate, under every
    launcher (stnb.launch's ranks, torchrun / accelerate launch, SLURM tasks, Ray workers). On CPU: no GPU seen;
    accelerate in CPU mode (a user's TrainingArguments without ``use_cpu=True`` would otherwise set up no
    distribution, each rank training alone); DeepSpeed's CPU accelerator (it would probe for a GPU and warn);
    ``threads`` torch threads, which accelerate reads too. A strategy's own variables go over these
    (``Strategy.rank_env``: DeepSpeed turns accelerate's CPU mode off)."""
    if device != "cpu":
        return {}
    env = {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true", "DS_ACCELERATOR": "cpu"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def default_device() -> str:
    """'cuda' when a GPU this torch build can use is visible, else 'cpu' (``report()`` says why)."""
    return "cuda" if usable_gpu_count() > 0 else "cpu"


def device_for_ranks(n: int = 2) -> str:
    """The device for an ``n``-rank run: the default device when it has ``n`` (one rank per GPU),
    else 'cpu' (one GPU: DDP/FSDP compare on CPU ranks, as the notebooks do)."""
    device = default_device()
    return device if max_processes(device) >= n else "cpu"


#: what a refusal offers when ranks outnumber the GPUs and sharing them would let the run go on
SHARE_GPUS_FIX = "share_gpus=True runs several gloo ranks on each GPU (to learn and to test: slower than a GPU per rank)"


def capacity_problem(device: str, processes: int, option: str = "num_processes",
                     share_gpus: bool | None = None) -> str | None:
    """Why ``processes`` ranks cannot run on this machine's ``device`` (NCCL: one GPU per rank; gloo:
    one CPU core per rank), with the fix naming ``option`` (how the caller set the number); None when
    they can. ``share_gpus``: True lets several gloo ranks use each GPU (``max_processes``); False: not
    asked, and the fix offers it; None: the caller cannot share GPUs (the fix does not offer it). The one
    capacity check: TrainConfig, stnb.launch, torchrun ranks and the Panel ask it."""
    if device == "cuda" and gpu_count() == 0:
        return "device='cuda' but no CUDA GPU is visible; use device='cpu' or 'auto'"
    most = max_processes(device, share_gpus=bool(share_gpus))
    if processes <= most:
        return None
    if device == "cuda" and share_gpus:
        return (f"{option}={processes} is more than this machine supports with share_gpus=True ({gpu_count()} "
                f"GPU(s), {cpu_cores()} CPU cores: at most one gloo rank per core); use {option} <= {most}")
    unit = "GPU(s)" if device == "cuda" else "CPU cores"
    fix = f"use {option} <= {most}"
    if device == "cuda":
        fix += (f"; {SHARE_GPUS_FIX}" if share_gpus is False else "") + "; or device='cpu' to run gloo ranks on CPU cores"
    return (f"{option}={processes} is more than this machine supports for {device} ({most} {unit}; "
            f"{backend_for(device)} needs one per rank); {fix}")


def backend_for(device: str, processes: int = 1) -> str:
    """The process group's backend for ``processes`` ranks on this node's ``device``: NCCL on GPUs, one rank
    per GPU; gloo on CPU, and on GPUs shared by several ranks (``share_gpus``: NCCL refuses two ranks on one
    device, gloo moves CUDA tensors through host memory)."""
    return "nccl" if device == "cuda" and processes <= max(gpu_count(), 1) else "gloo"


def rank_gpu(local_rank: int, gpus: int | None = None) -> int:
    """The GPU index a rank uses: its local rank modulo the GPUs it sees (``gpus``: torch's count, asked in the
    rank), accelerate's rule. One rank per GPU: GPU ``local_rank``; ranks sharing GPUs (``share_gpus``) go round
    them. Every place a rank picks its GPU asks this (the launch, training, parity, the examples)."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    return local_rank % max(gpus, 1)


#: how ranks start: "fork" copies the launching process (the notebook), "spawn" starts fresh interpreters
START_METHODS = ("auto", "fork", "spawn")


def start_method(requested: str = "auto") -> str:
    """The start method a launch uses here: 'fork' or 'spawn' (ConfigError for one this platform lacks).

    'auto' is $STNB_START_METHOD when set, else fork on Linux (ranks inherit the notebook: a function
    defined in a cell, its data and the imported training stack, nothing pickled) and spawn elsewhere:
    macOS, where a forked process that used Apple's system frameworks can crash (Python's own default
    there since 3.8), and Windows, which has no fork. Spawned ranks receive the function by value."""
    import multiprocessing
    import sys

    from .errors import ConfigError

    asked = requested
    if requested == "auto":
        env = os.environ.get("STNB_START_METHOD", "").strip().lower()
        requested = env or ("fork" if sys.platform.startswith("linux") else "spawn")
        asked = f"STNB_START_METHOD={env!r}" if env else requested
    if requested not in START_METHODS[1:]:
        raise ConfigError(f"unknown start method {asked!r}; choose 'fork' (Linux) or 'spawn' (any platform), "
                          "or 'auto'")
    if requested not in multiprocessing.get_all_start_methods():
        raise ConfigError(f"start_method={asked!r} is not available on {sys.platform}; use 'spawn' (or 'auto')")
    return requested


def max_processes(device: str, share_gpus: bool = False) -> int:
    """Most ranks one node supports for this device: one per GPU (NCCL), one per core (gloo); with
    ``share_gpus``, GPUs shared by gloo ranks, one per core (at least one per GPU)."""
    if device == "cuda":
        return max(gpu_count(), cpu_cores()) if share_gpus and gpu_count() else gpu_count()
    return cpu_cores()


@dataclass
class HardwareReport:
    cpu_cores: int
    gpus: list = field(default_factory=list)
    device: str = "cpu"
    backend: str = "gloo"
    max_processes: int = 1
    strategies: dict = field(default_factory=dict)  # name -> {"runnable": bool, "reason": str}
    versions: dict = field(default_factory=dict)
    gpu_details: list = field(default_factory=list)  # gpus(): index, name, memory_bytes, compute_capability
    warnings: list = field(default_factory=list)     # GPUs this torch build cannot use, with the fix
    start_method: str = "fork"                       # how stnb.launch starts ranks here (start_method())

    def runnable(self, strategy: str) -> bool:
        return self.strategies[strategy]["runnable"]

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        lines = [
            f"CPU cores: {self.cpu_cores}",
            f"GPUs: {len(self.gpus)}" + (" (" + ", ".join(self.gpus) + ")" if self.gpus else ""),
            f"default device: {self.device}  backend: {self.backend}  max processes: {self.max_processes}  "
            f"ranks start by: {self.start_method}",
            "strategies:",
        ]
        for name, info in self.strategies.items():
            mark = "yes" if info["runnable"] else "no "
            lines.append(f"  {name:<7} {mark}  {info['reason']}")
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()))
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)

    def short(self) -> str:
        """Two lines (``stnb.setup()``'s banner, after the profile): the device, and which strategies run here; warnings, when
        there are any, follow in full. ``str(report)`` is the whole report."""
        runs = [n for n, info in self.strategies.items() if info["runnable"]]
        not_here = [n for n, info in self.strategies.items() if not info["runnable"]]
        gpus = f"{len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}" + (f" ({self.gpus[0]})" if self.gpus else "")
        lines = [f"{self.device}: {self.cpu_cores} CPU cores, {gpus}, backend {self.backend}, up to "
                 f"{self.max_processes} ranks",
                 f"runs here: {', '.join(runs) or 'none'}" + (f"; not here: {', '.join(not_here)}" if not_here else "")
                 + " (why, and the versions: print(stnb.hardware_report()))"]
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "sentence-transformers", "transformers", "accelerate", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "missing"
    try:
        out["stnb"] = md.version("stnb")
    except md.PackageNotFoundError:
        out["stnb"] = "source"
    return out


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def strategy_availability(device: str | None = None, share_gpus: bool = False) -> dict:
    """{strategy: {"runnable": bool, "reason": str}} for this machine (each strategy says why); ``share_gpus``:
    with GPUs shared by several gloo ranks."""
    import torch.distributed as dist

    from .strategies import availability

    device = device or default_device()

    def on(shared: bool) -> dict:
        most = max_processes(device, shared)
        return availability(device, gpu_count(), most, backend_for(device, most), dist.is_available())

    out = on(share_gpus)
    if device == "cuda" and not share_gpus:  # what sharing the GPUs would make runnable says so
        shared = on(True)
        for name, a in out.items():
            if not a["runnable"] and shared[name]["runnable"]:
                a["reason"] += f"; {SHARE_GPUS_FIX}"
    return out


def report(device: str | None = None) -> HardwareReport:
    device = device or default_device()
    details = gpus()
    return HardwareReport(
        cpu_cores=cpu_cores(),
        gpus=[g["name"] for g in details],
        device=device,
        backend=backend_for(device),
        max_processes=max_processes(device),
        strategies=strategy_availability(device),
        versions=versions(),
        gpu_details=details,
        warnings=gpu_problems(),
        start_method=start_method(),
    )
