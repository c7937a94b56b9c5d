"""What this machine has, and which strategies can run here (with reasons).

Nothing here initialises CUDA: device counts come from torch.cuda.device_count(),
which uses NVML and leaves the process fork-safe for stnb.launch.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

STRATEGIES = ("single", "dp", "ddp", "fsdp")


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset / cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    import torch

    if os.environ.get("STNB_FORCE_CPU") == "1":
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - broken driver
        return 0


def default_device() -> str:
    return "cuda" if gpu_count() > 0 else "cpu"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def max_processes(device: str) -> int:
    """Most ranks one node supports for this device: one per GPU (NCCL), one per core (gloo)."""
    return gpu_count() if device == "cuda" else cpu_cores()


@dataclass
class HardwareReport:
    cpu_cores: int
    gpus: list = field(default_factory=list)
    device: str = "cpu"
    backend: str = "gloo"
    max_processes: int = 1
    strategies: dict = field(default_factory=dict)  # name -> {"runnable": bool, "reason": str}
    versions: dict = field(default_factory=dict)

    def runnable(self, strategy: str) -> bool:
        return self.strategies[strategy]["runnable"]

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        lines = [
            f"CPU cores: {self.cpu_cores}",
            f"GPUs: {len(self.gpus)}" + (" (" + ", ".join(self.gpus) + ")" if self.gpus else ""),
            f"default device: {self.device}  backend: {self.backend}  max processes: {self.max_processes}",
            "strategies:",
        ]
        for name, info in self.strategies.items():
            mark = "yes" if info["runnable"] else "no "
            lines.append(f"  {name:<7} {mark}  {info['reason']}")
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()))
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


def strategy_availability(device: str | None = None) -> dict:
    """{strategy: {"runnable": bool, "reason": str}} for this machine."""
    import torch.distributed as dist

    device = device or default_device()
    n_gpu = gpu_count()
    nmax = max_processes(device)
    unit = "GPU" if device == "cuda" else "CPU core"
    out = {"single": {"runnable": True, "reason": f"one process on {device}"}}
    if n_gpu >= 2:
        out["dp"] = {"runnable": True, "reason": f"torch.nn.DataParallel over {n_gpu} GPUs in one process"}
    else:
        out["dp"] = {"runnable": False,
                     "reason": f"DataParallel needs at least 2 CUDA GPUs in one process; this machine has {n_gpu}"}
    if not dist.is_available():
        for s in ("ddp", "fsdp"):
            out[s] = {"runnable": False, "reason": "this torch build has no torch.distributed"}
        return out
    if nmax >= 2:
        out["ddp"] = {"runnable": True,
                      "reason": f"up to {nmax} ranks, one per {unit}, backend {backend_for(device)}"}
        out["fsdp"] = {"runnable": True,
                       "reason": f"FSDP2 fully_shard over up to {nmax} ranks, backend {backend_for(device)}"}
    else:
        why = f"needs at least 2 ranks (one per {unit}); this machine has {nmax} {unit}(s)"
        out["ddp"] = {"runnable": False, "reason": why}
        out["fsdp"] = {"runnable": False, "reason": why}
    return out


def _gpu_names() -> list:
    """GPU names from nvidia-smi; torch.cuda.get_device_name would initialise CUDA and break fork."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # pragma: no cover
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def report(device: str | None = None) -> HardwareReport:
    device = device or default_device()
    n = gpu_count()
    gpus = _gpu_names()[:n] if n else []
    gpus += [f"cuda:{i}" for i in range(len(gpus), n)]
    return HardwareReport(
        cpu_cores=cpu_cores(),
        gpus=gpus,
        device=device,
        backend=backend_for(device),
        max_processes=max_processes(device),
        strategies=strategy_availability(device),
        versions=versions(),
    )


class _CallableModule(__import__("types").ModuleType):
    """``stnb.hardware()`` returns the report, while ``stnb.hardware`` stays this module
    (``import stnb.hardware as hw``, monkeypatching its functions in tests)."""

    def __call__(self, device: str | None = None) -> HardwareReport:
        return report(device)


__import__("sys").modules[__name__].__class__ = _CallableModule
