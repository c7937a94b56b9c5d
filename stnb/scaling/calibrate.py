"""This machine's loopback link, measured: all-reduces of growing size on 2 gloo ranks.

``measure_all_reduce()`` starts 2 ranks (``stnb.launch``), times ``dist.all_reduce`` of fp32
tensors from 4 KiB to 32 MiB (median of repeats, after a warm-up) and returns the times;
``fit(times)`` turns them into the alpha-beta link (least squares on t = 2(n-1) alpha +
2(n-1)/n S / B); ``loopback()`` does both once per process and returns the Link.
"""

from __future__ import annotations

import functools
import statistics

SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20)
REPEATS = 7


def time_all_reduce(sizes=SIZES, repeats=REPEATS) -> dict:
    """Inside a rank: {bytes: median seconds} of all_reduce over the world (a barrier before each)."""
    import time

    import torch
    import torch.distributed as dist

    out = {}
    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        dist.all_reduce(t)  # warm-up: buffers and connections
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        out[size] = statistics.median(times)
    return out


def measure_all_reduce(num_processes: int = 2, sizes=SIZES, repeats=REPEATS) -> dict:
    """{bytes: seconds} of an all-reduce on ``num_processes`` gloo ranks here (the slowest rank's)."""
    from ..processes import launch

    per_rank = launch(time_all_reduce, sizes, repeats, num_processes=num_processes, device="cpu",
                      threads_per_rank=1, echo=False, timeout=300)
    return {"world_size": num_processes,
            "seconds": {s: max(r[s] for r in per_rank) for s in sizes}}


def fit(measured: dict):
    """(latency per ring step, bandwidth in bytes/s) from ``measure_all_reduce``'s times: a least-squares
    fit of t = a + b x (x = 2(n-1)/n S) weighted by 1/t^2, so small and large sizes count alike."""
    n = measured["world_size"]
    xs = [2 * (n - 1) / n * s for s in measured["seconds"]]
    ys = list(measured["seconds"].values())
    w = [1 / y ** 2 for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sum(wi * (x - mx) ** 2
                                                                             for wi, x in zip(w, xs))
    intercept = max(my - slope * mx, 0.0)
    return intercept / (2 * (n - 1)), 1.0 / slope


@functools.lru_cache(maxsize=1)
def loopback() -> tuple:
    """This machine's loopback, measured on 2 gloo ranks once per process:
    (latency per ring step, bandwidth in bytes/s, how it was measured)."""
    measured = measure_all_reduce()
    latency, bandwidth = fit(measured)
    sizes = ", ".join(f"{s >> 10} KiB: {t * 1e3:.2f} ms" for s, t in measured["seconds"].items())
    return latency, bandwidth, f"measured here: gloo all-reduce on 2 CPU ranks ({sizes}), weighted least squares"
