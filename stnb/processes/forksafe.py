"""Fork safety: the launching process must be fit to fork ranks, and stay so while they start.

* ``check_fork_safe`` refuses a process that started the CUDA driver (after ``cuInit`` a forked child
  cannot use CUDA; the driver itself is asked, since ``torch.cuda.is_available()`` starts it and leaves
  ``torch.cuda.is_initialized()`` False) or holds accelerate state (an Accelerator, a Trainer), and says
  where the driver was first started (``watch_cuda_start``);
* ``fork_ready`` keeps what the ranks inherit harmless while they start: garbage collected and the heap
  frozen (a rank must never run destructors of objects it inherited), GNU OpenMP's pool ended, and what
  every rank would import imported once, here.

None of this applies to spawned ranks (``start_method='spawn'``): fresh interpreters inherit nothing.
"""

from __future__ import annotations

import ctypes
import gc
import os
from contextlib import contextmanager
from unittest import mock

from ..errors import ConfigError
from .output import not_deepspeed_cpu_note

__all__ = ["check_fork_safe", "cuda_driver_initialised", "first_cuda_start", "fork_ready",
           "import_what_every_rank_imports", "release_openmp_threads", "watch_cuda_start"]

_CUDA_ERROR_NOT_INITIALIZED = 3
# torch's ways into the CUDA driver from Python: is_available() / device_count() (the device count), and the
# lazy initialisation every tensor or module moved to a GPU goes through (torch's C++ calls it by name)
_CUDA_ENTRY_POINTS = (("torch._C", "_cuda_getDeviceCount"), ("torch._C", "_cuda_init"), ("torch.cuda", "_lazy_init"))
_watch = {"on": False, "first": None, "before": False}


def cuda_driver_initialised() -> bool:
    """True when this process has started the CUDA driver (or torch's CUDA state).

    The driver library is looked up only if it is already loaded (RTLD_NOLOAD), and asked for its
    device count: before ``cuInit`` every driver call but cuInit returns CUDA_ERROR_NOT_INITIALIZED.
    Nothing here initialises anything."""
    import torch

    if torch.cuda.is_initialized():
        return True
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:  # never loaded in this process: never initialised
        return False
    try:
        get_count = lib.cuDeviceGetCount
    except AttributeError:  # pragma: no cover - not a CUDA driver
        return False
    count = ctypes.c_int(0)
    return get_count(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED


def watch_cuda_start() -> None:
    """From now on, note where this process first starts the CUDA driver (``first_cuda_start``): torch's
    entry points into it are wrapped until the first call that leaves the driver started, then given back.
    ``import stnb`` (when torch is already imported) and ``stnb.setup()`` call this; it changes no result."""
    import importlib
    import sys

    if _watch["on"] or "torch" not in sys.modules:
        return
    _watch["on"] = True
    if cuda_driver_initialised():
        _watch["before"] = True
        return
    originals = []

    def give_back(seen: dict) -> None:
        _watch["first"] = seen
        for o, n, f in originals:
            if getattr(o, n, None) is by_name[(o.__name__, n)]:
                setattr(o, n, f)

    def wrapped(owner, name, original):
        def call(*args, **kwargs):
            if _watch["first"] is None and cuda_driver_initialised():  # started by a way not watched here
                give_back({"entry": None, "where": None, "code": None})
            frames = sys._getframe(1)
            out = original(*args, **kwargs)
            if _watch["first"] is None and cuda_driver_initialised():
                give_back(_caller(frames, f"{owner.__name__}.{name}"))
            return out
        return call

    by_name = {}
    for module, name in _CUDA_ENTRY_POINTS:
        owner = importlib.import_module(module)
        original = getattr(owner, name, None)
        if original is not None:
            originals.append((owner, name, original))
            by_name[(owner.__name__, name)] = wrapped(owner, name, original)
            setattr(owner, name, by_name[(owner.__name__, name)])


def _caller(frame, entry: str) -> dict:
    """The code that started CUDA: the innermost frame that is neither a library's nor the standard
    library's (a notebook cell, a script), with the cell's number when it runs in IPython."""
    import linecache
    import sysconfig

    libraries = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # stnb itself
    while frame is not None:
        path = frame.f_code.co_filename
        if not (os.path.abspath(path).startswith(libraries + (here,)) or path.startswith("<frozen")):
            break
        frame = frame.f_back
    if frame is None:
        return {"entry": entry, "where": None, "code": None}
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    where = f"{frame.f_code.co_filename}, line {frame.f_lineno}"
    try:
        from IPython import get_ipython

        shell = get_ipython()
        cells = os.path.dirname(shell.compile.get_code_name("", "", 0)) if shell is not None else None
    except Exception:  # no IPython, or one without the cell compiler
        shell, cells = None, None
    if shell is not None and (frame.f_code.co_filename.startswith("<ipython-input-")
                              or (cells and os.path.dirname(frame.f_code.co_filename) == cells)):
        # IPython counts the running cell before running it: its In [n] is one less
        where = f"cell [{shell.execution_count - 1}], line {frame.f_lineno}"
    return {"entry": entry, "where": where, "code": line}


def first_cuda_start() -> dict | None:
    """Where this process first started the CUDA driver since ``watch_cuda_start``: {"entry" (torch's call),
    "where" (e.g. "cell [3], line 2", or a file and line), "code" (that line)}; {"before": True} when it
    had started before stnb watched; None when it has not (or nothing watched)."""
    if _watch["before"]:
        return {"before": True}
    return _watch["first"]


def _who_started_cuda() -> str:
    seen = first_cuda_start()
    if seen is None:
        return ""
    if seen.get("before"):
        return " It was started before stnb was imported (or stnb.setup() ran)."
    if seen["entry"] is None:
        return " It was started by a call stnb does not watch (torch's device count and lazy initialisation are)."
    if seen["where"] is None:
        return f" It was started by {seen['entry']}, called from library code."
    return f" It was first started by {seen['where']}: `{seen['code']}` (through {seen['entry']})."


def check_fork_safe() -> None:
    """Refuse to fork when the parent already holds device or accelerate state ranks can't inherit."""
    if cuda_driver_initialised():
        raise ConfigError(
            "CUDA is already initialised in this process (a tensor was moved to the GPU, a model was loaded on "
            "'cuda', or torch.cuda.is_available() / torch.cuda.device_count() / torch.cuda.get_device_name() "
            f"was called in an earlier cell), and forked ranks cannot use an initialised CUDA driver.{_who_started_cuda()} "
            "Fix: restart the kernel and keep all GPU work inside the launched function / stnb.run "
            "(stnb.hardware_report() tells what GPUs there are without starting the driver), or launch "
            "with start_method='spawn': spawned ranks are fresh processes and inherit no driver.")
    try:
        from accelerate.state import AcceleratorState

        if len(AcceleratorState._shared_state) > 0:
            raise ConfigError(
                "An accelerate Accelerator (or a Trainer) was created in this process before launching; "
                "forked ranks would inherit its single-process state. Fix: restart the kernel and create "
                "Accelerators/Trainers only inside the launched function.")
    except ImportError:  # pragma: no cover
        pass


@contextmanager
def fork_ready():
    """Keep this process fit to fork while the block runs: garbage collected, the rest frozen (a rank that
    ran the destructor of an inherited object, e.g. torch elastic's TCPStore left in a cycle by an earlier
    failed launch, crashed with SIGSEGV; the collection also spares a launcher that does not freeze, such as
    accelerate's own ``notebook_launcher``), what every rank imports imported, the OpenMP pool ended."""
    import_what_every_rank_imports()
    gc.collect()
    gc.freeze()
    try:
        release_openmp_threads()
        yield
    finally:
        gc.unfreeze()


def import_what_every_rank_imports() -> None:
    """Import DeepSpeed here, once, when it is installed and torch is a CPU build: every Trainer's
    ``unwrap_model`` imports it, and after a fork that import is paid in every rank of every launch (about
    0.8 CPU-seconds a rank on a 2-core machine). Not with a CUDA or ROCm build: its import starts the CUDA
    driver, which forked ranks cannot inherit. A failed import is left to the ranks, whose error names it;
    its note "Setting accelerator to CPU..." is left out (a CPU build has no GPU to detect)."""
    import logging

    import torch

    if torch.version.cuda or torch.version.hip:
        return
    ds_logger = logging.getLogger("DeepSpeed")  # the logger deepspeed.utils configures on import
    ds_logger.addFilter(not_deepspeed_cpu_note)
    try:
        from accelerate.utils import is_deepspeed_available

        if is_deepspeed_available():
            # its import sets PYTORCH_NVML_BASED_CUDA_CHECK=1 for the whole process (the notebook's
            # torch.cuda.is_available() would then ask NVML): the user's environment is given back as it was
            with mock.patch.dict(os.environ):
                import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - the rank's own import reports it
        pass
    finally:
        ds_logger.removeFilter(not_deepspeed_cpu_note)


def release_openmp_threads() -> None:
    """End this thread's GNU OpenMP worker pool before forking (the next parallel op restarts it): a forked
    rank inherits libgomp's bookkeeping but not its threads, and its first multi-threaded op (layer_norm)
    waited for them forever. Intel's and LLVM's OpenMP runtimes handle fork themselves."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return
    for path in sorted(libs):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        pause(2)  # omp_pause_hard
