"""Step time of each strategy on n devices, from one device's measured step and a link model.

``Measured`` is one device's step, split into forward, backward compute, optimizer and the rest
(data loading, logging), with the bytes the collectives move. ``STEP_MODELS[strategy](m, fabric, n)``
returns the predicted step on n devices:

single  the measured step (n = 1).
ddp     forward; backward with the gradient buckets (``bucket_bytes`` each) all-reduced as they fill
        (ready in proportion to backward progress, one collective at a time); the last bucket's
        all-reduce is exposed, and all of them when the link cannot overlap (CPU); optimizer; rest.
fsdp    (= zero3) per unit (each transformer layer, and the root holding the embeddings): all-gather
        the parameters before its forward and again before its backward (unless
        ``reshard_after_forward`` is off: the gathered parameters stay), reduce-scatter its
        gradients after; the next unit's all-gather is prefetched during this unit's compute. The
        optimizer updates 1/n of the parameters.
zero1   DDP + torch's ZeroRedundancyOptimizer (stnb's zero1): DDP's all-reduce, the optimizer on 1/n,
        then the updated shards all-gathered, exposed.
zero2   FSDP2 with ``reshard_after_forward=False`` (stnb's zero2): one all-gather per unit in forward,
        reduce-scatters in backward, the optimizer on 1/n.
dp      torch.nn.DataParallel, one process: every step it broadcasts the parameters from GPU 0
        (replicate), runs the replicas side by side, reduces the gradients to GPU 0 and steps the
        optimizer there once; the one process loads n batches. All devices must be in one node.
        The GIL serialises the replicas' Python work: ``host_fraction`` (the share of a step the
        host is busy launching, e.g. 1 - GPU busy time from a trace) adds (n-1) x that share of
        forward+backward; None leaves it out (said in the assumptions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Measured:
    """One device's optimizer step, measured (seconds), and what the collectives move (bytes)."""
    batch: int                 # samples per device per optimizer step
    forward: float
    backward: float            # backward compute (without exposed communication)
    optimizer: float
    other: float               # data loading, logging, the rest of the step
    grad_bytes: float          # gradients all-reduced / reduce-scattered per step
    param_bytes: float         # parameters all-gathered (FSDP/ZeRO) or broadcast (DP)
    bucket_bytes: float = 25 * 2**20
    layers: int = 12           # FSDP units besides the root
    root_fraction: float = 0.25  # parameters outside the layers (embeddings): gathered first, reduced last
    reshard_after_forward: bool = True  # FSDP frees gathered parameters after forward: gathers again in backward
    source: str = ""
    notes: tuple = field(default_factory=tuple)

    @property
    def step(self) -> float:
        return self.forward + self.backward + self.optimizer + self.other


def pipeline(units, overlap: bool) -> tuple:
    """(end time, communication time) of units run in order: each is (comm before, compute, comm after).

    One compute stream and one communication channel (first issued, first served). The next unit's
    comm-before is issued when this unit's compute starts (prefetch of one); comm-after when its
    compute ends. Without overlap everything runs one after another."""
    comm = sum(u[0] + u[2] for u in units)
    if not overlap:
        return sum(sum(u) for u in units), comm
    chan = units[0][0] if units else 0.0
    ready = [0.0] * len(units)
    ready[0] = chan
    t = 0.0
    for i, (_, work, after) in enumerate(units):
        start = max(t, ready[i])
        if i + 1 < len(units):
            chan = max(chan, start) + units[i + 1][0]
            ready[i + 1] = chan
        t = start + work
        if after:
            chan = max(chan, t) + after
    return max(t, chan), comm


def _buckets(m: Measured) -> list:
    k = max(1, math.ceil(m.grad_bytes / m.bucket_bytes))
    return [m.grad_bytes / k] * k


def _result(step, comm, exposed, note=""):
    return {"step": step, "comm": comm, "comm_exposed": max(0.0, exposed), "feasible": True, "note": note}


def single(m: Measured, fab, n: int, host_fraction=None) -> dict:
    return _result(m.step, 0.0, 0.0)


def ddp(m: Measured, fab, n: int, host_fraction=None) -> dict:
    sizes = _buckets(m)
    units = [(0.0, m.backward / len(sizes), fab.all_reduce(s, n)) for s in sizes]
    backward, comm = pipeline(units, fab.overlap)
    return _result(m.forward + backward + m.optimizer + m.other, comm, backward - m.backward)


def fsdp(m: Measured, fab, n: int, host_fraction=None) -> dict:
    root = m.root_fraction
    shares = [root] + [(1 - root) / m.layers] * m.layers
    work_f = [0.0] + [m.forward / m.layers] * m.layers
    work_b = [0.0] + [m.backward / m.layers] * m.layers
    fwd = [(fab.all_gather(s * m.param_bytes, n), w, 0.0) for s, w in zip(shares, work_f)]
    regather = 1.0 if m.reshard_after_forward else 0.0
    bwd = [(regather * fab.all_gather(s * m.param_bytes, n), w, fab.reduce_scatter(s * m.grad_bytes, n))
           for s, w in reversed(list(zip(shares, work_b)))]
    t_f, c_f = pipeline(fwd, fab.overlap)
    t_b, c_b = pipeline(bwd, fab.overlap)
    exposed = t_f - m.forward + t_b - m.backward
    return _result(t_f + t_b + m.optimizer / n + m.other, c_f + c_b, exposed)


def zero1(m: Measured, fab, n: int, host_fraction=None) -> dict:
    """DDP's all-reduce, the optimizer on 1/n of the parameters, then every rank's updated shard sent to
    the others (torch's ZeroRedundancyOptimizer: an all-gather of the parameters), exposed."""
    r = ddp(m, fab, n)
    gather = fab.all_gather(m.param_bytes, n)
    return _result(r["step"] - m.optimizer + m.optimizer / n + gather, r["comm"] + gather,
                   r["comm_exposed"] + gather)


def zero2(m: Measured, fab, n: int, host_fraction=None) -> dict:
    """FSDP that keeps the gathered parameters from forward to backward (``reshard_after_forward=False``)."""
    from dataclasses import replace

    return fsdp(replace(m, reshard_after_forward=False), fab, n)


def dp(m: Measured, fab, n: int, host_fraction=None) -> dict:
    per_node = fab.link.per_node
    if per_node is None or n > per_node:
        where = "needs GPUs in one machine" if per_node is None else f"holds at most {per_node} devices on {fab.link.name}"
        return {"step": None, "comm": None, "comm_exposed": None, "feasible": False,
                "note": f"DataParallel is one process: it {where}"}
    replicate, reduce = fab.broadcast(m.param_bytes, n), fab.broadcast(m.grad_bytes, n)
    host = 0.0 if host_fraction is None else (n - 1) * host_fraction * (m.forward + m.backward)
    step = replicate + m.forward + m.backward + reduce + host + m.optimizer + m.other * n
    return _result(step, replicate + reduce, replicate + reduce)


# what a row would need to match a published number (seed.would_match): DP's host share, else the link
MISS_TERM = {"dp": "host_fraction"}

STEP_MODELS = {"single": single, "dp": dp, "ddp": ddp, "fsdp": fsdp, "zero1": zero1, "zero2": zero2,
               "zero3": fsdp}
