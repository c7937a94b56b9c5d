"""DeepSpeed's CPU shared-memory communication op, built once per machine before any rank needs it.

On CPU, DeepSpeed's comm backend (``deepspeed.comm.torch.build_shm_op``) JIT-compiles a C++ op with
torch's extension builder on first use (about a minute of CPU, several under load), cached in torch's
extension folder (``~/.cache/torch_extensions/py311_cpu-env<hash>/deepspeed_shm_comm``). Built inside the ranks,
every rank waits on the builder's ``lock`` file and looks stalled to stnb's watchdog; a build killed
midway leaves that ``lock`` behind and every later run waits on it forever. So stnb builds it here:
``prebuild()`` before a CPU launch (``Strategy.rank_env``) and ``make install``
(``python -m stnb.strategies.deepspeed_ops``), in a child process, removing a stale lock first.

Two more things made ranks wait on that lock, both seen in CI and in loaded runs:

- torch's builder takes the ``lock`` in every process that loads the op, built or not (it runs ninja,
  which finds nothing to do). A rank stopped while it held it (a peer's refusal, the stall watchdog,
  the Stop button) left it behind, and every rank on the machine then waited on it: a fresh lock is
  not stale. So a launch's ranks load a copy of their own (``launch_copy``: ``$TORCH_EXTENSIONS_DIR``
  of that launch only); a lock they leave there holds nobody.
- torch names the folder after Python and the device only: two virtualenvs on one machine (a
  checkout and its copy, the oldest-versions venv) rebuilt each other's op in turn. stnb keeps one
  folder per environment (``build_root``) unless ``$TORCH_EXTENSIONS_DIR`` names one.

    python -m stnb.strategies.deepspeed_ops     # build (or find) the op; prints where
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

NAME = "deepspeed_shm_comm"
BUILD = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'; import deepspeed, deepspeed.ops; "
         "from deepspeed.accelerator import get_accelerator; "
         "b = get_accelerator().create_op_builder('ShareMemCommBuilder'); "
         "ok = b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False); "
         "b.load() if ok else None; print('built' if ok else 'not compatible')")
STALE_LOCK_S = 30.0
LAUNCH_COPIES = "stnb-deepspeed-op-launches"  # under the temp folder: one folder per launch
KEEP_LAUNCH_COPY_S = 6 * 3600.0  # ranks load the op as they start; older copies are removed
MADE = ".stnb-copy-made"  # in each launch's copy: when it was made (its mtime)


def build_root() -> str:
    """The ``$TORCH_EXTENSIONS_DIR`` the op is built in: the variable's own value when set, else the default
    root's ``py311_cpu`` (``_cu128``, ``_rocm..``) folder as torch names it, followed by this environment's
    tag (``-env<hash of sys.prefix>``), so that two virtualenvs never rebuild each other's op."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        flavour = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
                   f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        env = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
        root = os.path.join(get_default_build_root(), f"{python}_{flavour}-env{env}")
    return root


def build_dir() -> str:
    """torch's extension folder for the op: ``build_root()/deepspeed_shm_comm``."""
    return os.path.join(build_root(), NAME)


def built() -> bool:
    """The op is built for this environment (``why_not_built`` finds nothing)."""
    return not why_not_built()


def why_not_built() -> str:
    """Why torch's extension builder would build the op again here ('' when it would not). It does when
    the ``.so`` is missing, or when the ``build.ninja`` it writes now differs from the folder's (ninja then
    rebuilds: its log keys every output on its command) or a compiled source is newer than the ``.so``.
    That file names the environment it was written for: its torch's include folders
    (``cpp_extension.include_paths``), Python's include folder, its torch's ``lib`` folder and its
    DeepSpeed's sources; an op built by another virtualenv (another torch, another DeepSpeed) is not
    built for this one, however new its files are."""
    folder = build_dir()
    so = os.path.join(folder, f"{NAME}.so")
    if not os.path.exists(so):
        return f"{so} does not exist"
    try:
        with open(os.path.join(folder, "build.ninja")) as f:
            ninja = f.read()
    except OSError:
        return f"{folder} has no build.ninja (torch would write one, and ninja build again)"
    foreign = foreign_paths(ninja)
    if foreign:
        return f"it was built for another environment ({foreign[0]})"
    sources = [line.split()[-1] for line in ninja.splitlines() if line.startswith("build ") and ": compile " in line]
    newer = [src for src in sources if os.path.exists(src) and os.path.getmtime(src) > os.path.getmtime(so)]
    if newer:
        return f"{newer[0]} is newer than the built op"
    return ""


def foreign_paths(ninja: str) -> list:
    """What a ``build.ninja`` names that this environment's torch would not write: other system include
    folders than torch's and Python's here, no ``-L`` to this torch's ``lib``, sources or include folders
    outside this DeepSpeed."""
    import importlib.util
    import re
    import sysconfig

    from torch.utils.cpp_extension import TORCH_LIB_PATH, include_paths

    here = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    spec = importlib.util.find_spec("deepspeed")
    deepspeed = os.path.realpath(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
    found = []
    found += [f"-isystem {p}" for p in re.findall(r"-isystem (\S+)", ninja)
              if os.path.realpath(p) not in {os.path.realpath(h) for h in here}]
    if f"-L{TORCH_LIB_PATH}" not in ninja.split():
        found.append(f"not linked against {TORCH_LIB_PATH}")
    theirs = re.findall(r"-I(\S+)", ninja) + [line.split()[-1] for line in ninja.splitlines()
                                             if line.startswith("build ") and ": compile " in line]
    found += [p for p in theirs if deepspeed is None or not os.path.realpath(p).startswith(deepspeed + os.sep)]
    return found


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
    """Build the op unless it is built for this environment already (``why_not_built``); returns 'built',
    'was built' or 'not compatible'."""
    remove_stale_lock(echo)
    why = why_not_built()
    if not why:
        return "was built"
    echo(f"stnb: building DeepSpeed's CPU communication op once for this environment (about a minute; "
         f"cached in {build_dir()}): {why}")
    out = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": build_root()})
    if out.returncode != 0:
        from ..errors import ConfigError

        raise ConfigError(f"building DeepSpeed's CPU communication op ({NAME}) failed: "
                          f"{out.stderr.strip()[-1500:]}; it needs a C++ compiler and ninja (pip install ninja)")
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "built"


def launch_copy(echo=print) -> str:
    """The op built (``prebuild``) and ``build_root()`` copied, file times kept (ninja then finds nothing to
    do), into a folder of one launch's own; returns that folder, the ``$TORCH_EXTENSIONS_DIR`` its ranks get. Copies
    made more than 6 hours ago are removed first (the ranks loaded theirs as they started). A copy's age is its
    ``MADE`` file's, written before the copy starts: the folder itself takes the build's times with its files."""
    state = prebuild(echo)
    parent = os.path.join(tempfile.gettempdir(), LAUNCH_COPIES)
    os.makedirs(parent, exist_ok=True)
    for old in os.listdir(parent):
        path = os.path.join(parent, old)
        try:
            made = os.path.join(path, MADE)
            if time.time() - os.path.getmtime(made if os.path.exists(made) else path) > KEEP_LAUNCH_COPY_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # another launch removed it
    folder = tempfile.mkdtemp(prefix="launch-", dir=parent)
    open(os.path.join(folder, MADE), "w").close()
    if state != "not compatible":  # the whole root: other ops built there (a user's own) come along
        shutil.copytree(build_root(), folder, ignore=shutil.ignore_patterns("lock"), dirs_exist_ok=True)
    return folder


if __name__ == "__main__":
    print(f"{NAME}: {prebuild()} ({build_dir()})")
