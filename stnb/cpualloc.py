"""Keep freed CPU memory for reuse inside a training process (glibc ``mallopt``).

glibc hands every allocation above its mmap threshold (dynamic, at most 32 MB) to the kernel as a fresh
mapping and unmaps it on free. A transformer's word-embedding gradient is such a block (MiniLM:
30,522 x 384 floats = 47 MB) and the embedding backward makes a new one for every forward pass, so each
one is page-faulted in again, 11,000 faults of 4 KiB, and zero-filled: on this project's 2-core VM that
was 36,000-50,000 page faults per second per DDP rank and about 10 % of the step time.

``reuse_freed_memory()`` raises the mmap threshold to 1 GiB and the trim threshold to 2 GiB, so large
blocks come from the heap and freed ones are reused by the next allocation. The price: a process keeps
its peak memory until it exits. stnb applies it inside training processes only (``TrainConfig.
reuse_freed_memory``, default True, CPU runs), never in the notebook kernel. Other C libraries (musl,
macOS) have no ``mallopt``: nothing is changed there and the result says so.

``return_freed_memory()`` does the opposite, for a rank under a CPU memory budget (``memory_budget_gib``): a fixed
mmap threshold of ``RETURN_THRESHOLD`` (1 MiB, no dynamic raise), so every block above it is its own mapping, unmapped
on free. The budget counts the process's mapped private memory (``VmData``), and a heap that keeps its freed blocks
counts them as held: measured on mpnet-base's shape (110M parameters, 2 CPU ranks, batch 1), what an FSDP rank held
at the end went from 4.0-5.0 GiB (kept blocks, more than DDP's 3.9-4.0) to 2.3-2.7 GiB (DDP 3.3) with it.

``release_freed_memory()`` (glibc ``malloc_trim``) gives the freed pages back to the kernel. A strategy that
gathers parameters during its steps (FSDP, ZeRO-2) allocates and frees blocks of many sizes every step (the
all-gather outputs, the unsharded parameters and gradients, the reduce-scatter buffers, activations whose
size follows each batch's padded length): on the bundled MiniLM the heap's free part grew from 390 to
815 MiB over four FSDP steps while the memory in use stayed at 320 MiB (DDP: free levels off at 310 MiB).
stnb calls it at every step's end in those runs (``stnb.instruments.AllocatorRelease``, ``release_each_step``; ``STNB_RELEASE_FREED=off``
turns it off: faster steps, a higher peak); docs/memory.md has the numbers.
"""

from __future__ import annotations

import ctypes
import os
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1


#: ``return_freed_memory``'s fixed mmap and trim threshold: blocks above it are mapped apart and unmapped on free
RETURN_THRESHOLD = 1 << 20


def reuse_freed_memory() -> dict:
    """Tune glibc malloc in this process to keep freed large blocks; returns {'applied': bool, 'reason': str}."""
    return _thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)


def return_freed_memory() -> dict:
    """Tune glibc malloc in this process to give freed blocks above 1 MiB back at once (a CPU memory budget counts
    what the process maps); returns {'applied': bool, 'reason': str}."""
    return _thresholds(RETURN_THRESHOLD, RETURN_THRESHOLD)


def _thresholds(mmap: int, trim: int) -> dict:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as e:
        return {"applied": False, "reason": f"no glibc mallopt here ({e.__class__.__name__}); allocator unchanged"}
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = mallopt(M_MMAP_THRESHOLD, mmap) == 1 and mallopt(M_TRIM_THRESHOLD, trim) == 1
    return {"applied": ok, "reason": "" if ok else "mallopt refused the thresholds; allocator unchanged"}


#: ``STNB_RELEASE_FREED=off`` keeps a gathering strategy's freed heap pages (faster on CPU, higher peak)
RELEASE_ENV = "STNB_RELEASE_FREED"


def release_each_step(device_type: str, gathers_during_step: bool) -> bool:
    """Whether a rank gives freed heap pages back at every step's end: CPU runs of a strategy that
    gathers parameters during its steps (their free heap grows step over step otherwise, docs/memory.md),
    unless ``STNB_RELEASE_FREED=off`` (measured on MiniLM, 2 CPU ranks: FSDP's peak about 760 instead of
    about 1,070 MiB per rank, its samples/s about a quarter lower at low load)."""
    return device_type == "cpu" and gathers_during_step and os.environ.get(RELEASE_ENV, "on") != "off"


def release_freed_memory() -> int:
    """Give glibc's free heap pages back to the kernel (``malloc_trim(0)``); returns the resident bytes
    released (measured), 0 where there is no glibc."""
    import psutil

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return 0
    before = psutil.Process().memory_info().rss
    trim(0)
    return max(0, before - psutil.Process().memory_info().rss)
