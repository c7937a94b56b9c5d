"""This machine's loopback link, measured: all-reduces of growing size on 2 gloo ranks; and how much slower a
rank computes when n ranks share this machine's CPU cores.

``measure_all_reduce()`` starts 2 ranks (``stnb.launch``), times ``dist.all_reduce`` of fp32
tensors from 4 KiB to 32 MiB (median of repeats, after a warm-up) and returns the times;
``fit(times)`` turns them into the alpha-beta link (least squares on t = 2(n-1) alpha +
2(n-1)/n S / B); ``loopback()`` does both once per process and returns the Link.

``measure_sharing(n, alone_threads, rank_threads)`` starts n ranks and times a transformer layer's forward and
backward (MiniLM's shape) on rank 0 alone with the single run's threads, then on every rank at once with each rank's
threads: a rank's slowdown against the single run, the cores' sharing (and whatever else runs here) included.
``sharing(devices, ...)`` does it for each device count at each prediction: (n, low, mid, high) over the ranks and
repeats.
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


# one transformer encoder layer of MiniLM's shape (hidden 384, 12 heads, feed-forward 1536), forward and backward on
# 16 sequences of 32 tokens: a training step's mix of matmuls, softmax, norms and memory traffic (a lone matmul loop
# measured twice the slowdown the ranks' training showed here: 2.0x against 1.1-1.3x)
PROBE = (384, 12, 1536, 16, 32)
PROBE_ITERATIONS = 4
PROBE_REPEATS = 5


def time_compute(alone_threads: int, iterations=PROBE_ITERATIONS, repeats=PROBE_REPEATS) -> dict:
    """Inside a rank: seconds of ``iterations`` forward + backward passes of PROBE's layer, ``repeats`` times: rank 0
    alone with ``alone_threads`` torch threads while the others wait at a barrier ('alone'), then every rank at once
    with its own threads ('shared')."""
    import time

    import torch
    import torch.distributed as dist

    hidden, heads, ffn, batch, tokens = PROBE
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, batch_first=True)
    x = torch.randn(batch, tokens, hidden)

    def once():
        start = time.perf_counter()
        for _ in range(iterations):
            layer(x).sum().backward()
        return time.perf_counter() - start

    mine = torch.get_num_threads()
    once()  # warm-up
    alone, shared = [], []
    for _ in range(repeats):
        dist.barrier()
        if dist.get_rank() == 0:
            torch.set_num_threads(alone_threads)
            alone.append(once())
            torch.set_num_threads(mine)
        dist.barrier()
        shared.append(once())
    return {"alone": alone, "shared": shared}


def measure_sharing(num_processes: int, alone_threads: int, rank_threads: int, repeats=PROBE_REPEATS) -> tuple:
    """(low, mid, high) of a rank's compute slowdown among ``num_processes`` CPU ranks of ``rank_threads`` threads
    each, against one process alone with ``alone_threads``: every rank's shared time of every repeat over rank 0's
    alone time of the same repeat (the machine's other load moves both); the lowest, the median, the highest."""
    from ..processes import launch

    per_rank = launch(time_compute, alone_threads, PROBE_ITERATIONS, repeats, num_processes=num_processes,
                      device="cpu", threads_per_rank=rank_threads, echo=False, timeout=300)
    alone = per_rank[0]["alone"]
    factors = sorted(t / a for r in per_rank for t, a in zip(r["shared"], alone))
    return factors[0], statistics.median(factors), factors[-1]


def sharing(devices: tuple, alone_threads: int, rank_threads: tuple) -> tuple:
    """This machine's CPU cores shared by n ranks, for each n of ``devices`` (``rank_threads``: each n's threads
    per rank), measured at each call (unlike the loopback: the machine's other load changes from minute to minute
    and takes the ranks' cores): ((n, low, mid, high), ...) and how it was measured."""
    rows = tuple((n, *measure_sharing(n, alone_threads, t)) for n, t in zip(devices, rank_threads))
    how = (f"measured here: a transformer layer (hidden {PROBE[0]}, {PROBE[1]} heads, feed-forward {PROBE[2]}) forward "
           f"+ backward on {PROBE[3]}x{PROBE[4]} tokens, {PROBE_ITERATIONS} a repeat, {PROBE_REPEATS} repeats: one "
           f"process alone with {alone_threads} thread(s) (the run's) against "
           "every rank at once (" + ", ".join(f"{n} ranks x {t} thread(s)" for n, t in zip(devices, rank_threads))
           + f") on {_cores()} core(s)")
    return rows, how


def _cores() -> int:
    from ..hardware import cpu_cores

    return cpu_cores()
