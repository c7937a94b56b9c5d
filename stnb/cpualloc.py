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
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1


def reuse_freed_memory() -> dict:
    """Tune glibc malloc in this process; returns {'applied': bool, 'reason': str}."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as e:
        return {"applied": False, "reason": f"no glibc mallopt here ({e.__class__.__name__}); allocator unchanged"}
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return {"applied": ok, "reason": "" if ok else "mallopt refused the thresholds; allocator unchanged"}
