"""DeepSpeed's CPU shared-memory communication op, built once per machine before any rank needs it.

On CPU, DeepSpeed's comm backend (``deepspeed.comm.torch.build_shm_op``) JIT-compiles a C++ op with
torch's extension builder on first use (about a minute of CPU, several under load), cached in torch's
extension folder (``~/.cache/torch_extensions/py311_cpu/deepspeed_shm_comm``). Built inside the ranks,
every rank waits on the builder's ``lock`` file and looks stalled to stnb's watchdog; a build killed
midway leaves that ``lock`` behind and every later run waits on it forever. So stnb builds it here:
``prebuild()`` before a CPU launch (``Strategy.before_launch``) and ``make install``
(``python -m stnb.strategies.deepspeed_ops``), in a child process, removing a stale lock first.

    python -m stnb.strategies.deepspeed_ops     # build (or find) the op; prints where
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

NAME = "deepspeed_shm_comm"
BUILD = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'; import deepspeed, deepspeed.ops; "
         "from deepspeed.accelerator import get_accelerator; "
         "b = get_accelerator().create_op_builder('ShareMemCommBuilder'); "
         "ok = b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False); "
         "b.load() if ok else None; print('built' if ok else 'not compatible')")
STALE_LOCK_S = 30.0


def build_dir() -> str:
    """torch's extension folder for the op, as ``torch.utils.cpp_extension`` names it: ``$TORCH_EXTENSIONS_DIR``
    itself when set, else the default root's ``py311_cpu`` (``_cu128``, ``_rocm..``) folder."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        flavour = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
                   f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{flavour}")
    return os.path.join(root, NAME)


def built() -> bool:
    """The op is built and newer than every source its last build compiled (``build.ninja``'s
    ``compile`` lines): a reinstalled DeepSpeed brings sources with new times, and ninja would build
    again inside the ranks."""
    so = os.path.join(build_dir(), f"{NAME}.so")
    if not os.path.exists(so):
        return False
    try:
        with open(os.path.join(build_dir(), "build.ninja")) as f:
            sources = [line.split()[-1] for line in f if line.startswith("build ") and ": compile " in line]
    except OSError:
        return True
    newest = max((os.path.getmtime(src) for src in sources if os.path.exists(src)), default=0.0)
    return os.path.getmtime(so) >= newest


def remove_stale_lock(echo=print) -> bool:
    """A ``lock`` left by a killed build (no process works in the folder, older than 30 s): removed."""
    lock = os.path.join(build_dir(), "lock")
    if not os.path.exists(lock) or time.time() - os.path.getmtime(lock) < STALE_LOCK_S:
        return False
    import psutil

    here = os.path.realpath(build_dir())
    for proc in psutil.process_iter(["cwd"]):
        if proc.info.get("cwd") and os.path.realpath(proc.info["cwd"]) == here:
            return False  # a build is running (ninja / the compiler work in the folder)
    os.remove(lock)
    echo(f"stnb: removed a stale DeepSpeed build lock ({lock}): a killed build left it behind")
    return True


def prebuild(echo=print, timeout: float = 1800.0) -> str:
    """Build the op unless it is built already; returns 'built', 'was built' or 'not compatible'."""
    remove_stale_lock(echo)
    if built():
        return "was built"
    echo(f"stnb: building DeepSpeed's CPU communication op once for this machine (about a minute; "
         f"cached in {build_dir()})")
    out = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        from ..errors import ConfigError

        raise ConfigError(f"building DeepSpeed's CPU communication op ({NAME}) failed: "
                          f"{out.stderr.strip()[-1500:]}; it needs a C++ compiler and ninja (pip install ninja)")
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "built"


if __name__ == "__main__":
    print(f"{NAME}: {prebuild()} ({build_dir()})")
