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

    def stats(self) -> dict:
        saved = 1.0 - self.sent_elements / self.dense_elements if self.dense_elements else 0.0
        return {"bucket_calls": self.calls, "dense_elements": self.dense_elements,
                "sent_elements": self.sent_elements, "traffic_saved": round(saved, 4)}


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
    picked, at = [], 0
    for _, g in rows_of:
        idx = masks[at:at + g.shape[0]].nonzero().squeeze(1)
        at += g.shape[0]
        picked.append(idx)

    # 2. everything that has to travel: the dense gradients (in place, as contiguous runs) and the rows
    futures = []
    for s, e in _merge_runs(dense):
        part = buf[s:e].div_(world)
        state.sent_elements += part.numel()
        futures.append(dist.all_reduce(part, group=group, async_op=True).get_future())
    compact = torch.cat([g.index_select(0, idx).reshape(-1) for (_, g), idx in zip(rows_of, picked)])
    compact.div_(world)
    state.sent_elements += compact.numel()
    futures.append(dist.all_reduce(compact, group=group, async_op=True).get_future())

    def finish(_):
        for f in futures:
            f.wait()  # re-raises a failed all-reduce
        at = 0
        for (_, g), idx in zip(rows_of, picked):
            n = idx.numel() * g.shape[1]
            if n:
                g.index_copy_(0, idx, compact[at:at + n].view(idx.numel(), g.shape[1]))
            at += n
        return buf

    return torch.futures.collect_all(futures).then(finish)


def _merge_runs(spans: list) -> list:
    """Join adjacent (start, end) spans so each contiguous run is one all-reduce."""
    runs = []
    for s, e in sorted(spans):
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], e)
        else:
            runs.append((s, e))
    return runs
