"""Exact DDP gradient all-reduce that skips the embedding rows no rank touched.

A transformer's word-embedding matrix is often the largest tensor it has (all-MiniLM-L6-v2: 30,522 x 384,
11.7M of its 22.7M parameters), yet a batch only produces gradient in the rows of the tokens it contains:
a few hundred rows out of 30,522. DDP's default hook still all-reduces the whole matrix every step, and on
CPU (gloo over loopback, ranks owning every core) that traffic is what keeps DDP below the machine's limit.

``register(ddp_model)`` installs a DDP communication hook that, for each gradient bucket:

1. finds the rows of every ``nn.Embedding`` weight in the bucket whose gradient is not zero on this rank,
2. takes the union of those rows across ranks (one small all-reduce of a row mask),
3. all-reduces the union's rows and the bucket's other (dense) gradients, averaged like DDP's default hook.

Rows outside the union are zero on every rank, so their average is zero: the result is the same as DDP's
default all-reduce (for 2 ranks bit for bit; tests/test_run.py checks the weights). torch ships no such
hook: ``nn.Embedding(sparse=True)`` makes sparse gradients, but AdamW refuses those, and the compression
hooks (fp16/bf16/PowerSGD) shrink every element instead of skipping the zero rows.

Works with gloo and NCCL, with ``gradient_as_bucket_view`` and with gradient accumulation (``no_sync``: the
accumulated gradient is what reaches the hook). Measured on CPU only (see README, "Measured here").

Cost on CUDA: how many rows travel is data the host must read, so each bucket holding embedding matrices
makes one host synchronisation per embedding width (one ``nonzero()``; a BERT-like model's embeddings share
one width), counted in ``stats()['host_syncs']``. Those buckets are the last of each backward pass (the
embeddings' gradients are computed last), so no backward compute is left to overlap with: the host waits for
the GPU to finish the backward, then queues the row all-reduce (tests/test_embedding_rows_hook.py counts the
syncing aten ops on CPU).
"""

from __future__ import annotations

import torch


class RowSyncState:
    """What the hook needs: the process group, which parameters are embedding matrices, and counters."""

    def __init__(self, process_group, embedding_ptrs: set[int]):
        self.process_group = process_group
        self.embedding_ptrs = embedding_ptrs
        self.calls = 0
        self.dense_elements = 0  # what DDP's default hook would have all-reduced
        self.sent_elements = 0  # what this hook all-reduced
        self.host_syncs = 0  # nonzero() calls: on CUDA each makes the host wait for the GPU mid-backward

    def stats(self) -> dict:
        saved = 1.0 - self.sent_elements / self.dense_elements if self.dense_elements else 0.0
        return {"bucket_calls": self.calls, "dense_elements": self.dense_elements,
                "sent_elements": self.sent_elements, "traffic_saved": round(saved, 4),
                "host_syncs": self.host_syncs}


def embedding_weights(model) -> list:
    """The trainable ``nn.Embedding`` weights of ``model`` (word, position, token-type embeddings)."""
    return [m.weight for m in model.modules()
            if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad and not m.sparse]


def register(ddp_model, process_group=None, wrap=None) -> RowSyncState:
    """Install the hook on a ``DistributedDataParallel`` model, before its first backward.
    wrap: applied to the hook first (``stnb.timesplit.StepTimer.timed`` times each bucket)."""
    inner = getattr(ddp_model, "module", ddp_model)
    state = RowSyncState(process_group, {w.data_ptr() for w in embedding_weights(inner)})
    ddp_model.register_comm_hook(state, wrap(embedding_rows_hook) if wrap else embedding_rows_hook)
    return state


def embedding_rows_hook(state: RowSyncState, bucket):
    import torch.distributed as dist

    group = state.process_group or dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    base = buf.storage_offset()
    state.calls += 1
    state.dense_elements += buf.numel()

    rows_of = []  # (gradient view, 2-D) for the embedding matrices in this bucket
    dense = []  # (start, end) of the other gradients in the flat buffer
    same_storage = buf.untyped_storage().data_ptr()
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        if g.untyped_storage().data_ptr() != same_storage:  # not a view of the bucket: be DDP's default
            rows_of, dense = [], []
            break
        start = g.storage_offset() - base
        if p.data_ptr() in state.embedding_ptrs and g.dim() == 2:
            rows_of.append((start, g.view(g.shape[0], -1)))
        else:
            dense.append((start, start + g.numel()))

    if not rows_of:  # DDP's default: average the whole bucket
        state.sent_elements += buf.numel()
        return dist.all_reduce(buf.div_(world), group=group, async_op=True).get_future().then(
            lambda fut: fut.value()[0])

    # 1. the union of touched rows across ranks (a mask: one byte per row)
    masks = torch.cat([g.ne(0).any(dim=1) for _, g in rows_of]).to(torch.uint8)
    dist.all_reduce(masks, op=dist.ReduceOp.MAX, group=group)
    # the union's rows as element offsets into the bucket, one group per embedding width: one nonzero()
    # (the only host synchronisation: on CUDA the host waits there for the GPU) per width, not per matrix
    picked = _picked_elements(rows_of, masks)
    state.host_syncs += len(picked)

    # 2. everything that has to travel: the dense gradients (in place, as contiguous runs) and the rows
    futures = []
    for s, e in _merge_runs(dense):
        part = buf[s:e].div_(world)
        state.sent_elements += part.numel()
        futures.append(dist.all_reduce(part, group=group, async_op=True).get_future())
    elements = torch.cat(picked)
    compact = buf.index_select(0, elements).div_(world)
    state.sent_elements += compact.numel()
    futures.append(dist.all_reduce(compact, group=group, async_op=True).get_future())

    def finish(_):
        for f in futures:
            f.wait()  # re-raises a failed all-reduce
        buf.index_copy_(0, elements, compact)
        return buf

    return torch.futures.collect_all(futures).then(finish)


def _picked_elements(rows_of: list, masks) -> list:
    """For each embedding width in the bucket: the flat-buffer offsets of every element of the rows the
    union ``masks`` marks (rows_of: (start, 2-D gradient view); masks: one entry per row, in order).
    Row ``r`` of a gradient view starting at ``start`` with width ``d`` holds elements start + r*d ..
    start + r*d + d - 1. Everything stays on the device except each width's nonzero() size."""
    device = masks.device
    bounds, at = [], 0
    for start, g in rows_of:
        bounds.append((at, at + g.shape[0], start, g.shape[1]))
        at += g.shape[0]
    out = []
    for d in sorted({b[3] for b in bounds}):
        mine = [b for b in bounds if b[3] == d]
        mask = torch.cat([masks[lo:hi] for lo, hi, _, _ in mine])
        row_start = torch.cat([start + torch.arange(hi - lo, device=device) * d for lo, hi, start, _ in mine])
        rows = mask.nonzero().squeeze(1)
        out.append((row_start.index_select(0, rows)[:, None] + torch.arange(d, device=device)).reshape(-1))
    return out


def _merge_runs(spans: list) -> list:
    """Join adjacent (start, end) spans so each contiguous run is one all-reduce."""
    runs = []
    for s, e in sorted(spans):
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], e)
        else:
            runs.append((s, e))
    return runs
