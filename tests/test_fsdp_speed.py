"""FSDP's layout for speed (issue 20: act on the time split), observed in a real 2-rank gloo launch.

What ``shard_fsdp`` promises and a revert would break: every all-gather is issued with
``async_op=True`` on CPU (gloo blocks the rank otherwise, and prefetching would gain nothing); each
block's all-gather is issued before the forward of the block in front of it (forward prefetch);
backward's all-gather of a block is issued before the block after it runs its backward (prefetch);
after a training forward the root and the last block keep their parameters whole (backward needs them
first), the other blocks are resharded; zero2 keeps every block whole. The all-gathers are counted at
``torch.distributed.all_gather_single``, the function FSDP2's default all-gather calls.
"""

from __future__ import annotations

import stnb
from stnb import strategies
from stnb.models import load_model, tiny_path


def layout_rank(model_path: str, reshard_after_forward: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    gathers = []  # async_op of every all-gather, in the order issued
    original = dist.all_gather_single

    def counted(*args, **kwargs):
        gathers.append(bool(kwargs.get("async_op", False)))
        return original(*args, **kwargs)

    model = load_model(model_path)
    info = strategies.shard_fsdp(model, "cpu", 2, reshard_after_forward=reshard_after_forward)
    blocks = list(model[0].auto_model.encoder.layer)
    before_forward, before_backward, whole_after_forward = {}, {}, {}

    def at_forward(i):
        def hook(module, args):
            before_forward.setdefault(i, len(gathers))  # returns None: the block's inputs stay as they are
        return hook

    def note_backward(i):
        before_backward.setdefault(i, len(gathers) - forward_total[0])  # returns None: the gradient stays

    def after_forward(i):
        def hook(module, args, output):
            whole_after_forward[i] = not any(isinstance(p, DTensor) for p in module.parameters())
            out = output[0] if isinstance(output, tuple) else output
            # registered after FSDP's own backward hook on this output: runs once FSDP has gathered this
            # block (and prefetched the one before it) for its backward
            out.register_hook(lambda grad: note_backward(i))
        return hook

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(at_forward(i), prepend=True)  # before FSDP's own pre-forward
        block.register_forward_hook(after_forward(i))
    model.train()
    features = model.tokenize(["a short sentence", "another sentence that is a little longer"])
    forward_total = [None]
    dist.all_gather_single = counted
    try:
        embedding = model(dict(features))["sentence_embedding"]
        root_whole = not any(isinstance(p, DTensor) for p in model[0].auto_model.embeddings.parameters())
        forward_total[0] = len(gathers)
        embedding.pow(2).sum().backward()
    finally:
        dist.all_gather_single = original
    return {"info": info, "blocks": len(blocks), "gathers": gathers, "forward_gathers": forward_total[0],
            "before_forward": [before_forward[i] for i in range(len(blocks))],
            "before_backward": [before_backward[i] for i in range(len(blocks))],
            "whole_after_forward": [whole_after_forward[i] for i in range(len(blocks))], "root_whole": root_whole,
            "grads": all(p.grad is not None for b in blocks for p in b.parameters())}


def _launch(reshard_after_forward: bool) -> list:
    return stnb.launch(layout_rank, tiny_path(), reshard_after_forward, num_processes=2, device="cpu", timeout=180,
                       echo=False)


def test_fsdp_prefetches_asynchronously_and_reshards_only_where_memory_gains():
    for rank in _launch(True):
        n = rank["blocks"]
        assert n >= 2 and rank["grads"]
        # every all-gather asynchronous (CPU), forward and backward
        assert rank["gathers"] and all(rank["gathers"]), rank["gathers"]
        # forward: when block i starts, the root's and blocks 0..i+1's all-gathers are out (i + 2): each block's
        # gather was issued while the unit before it computed; each unit gathered once
        assert rank["before_forward"] == [i + 2 for i in range(n)], rank["before_forward"]
        assert rank["forward_gathers"] == n + 1
        # backward: the last block and the root are still whole (no gather); when block i is about to run its
        # backward, blocks n-2 .. i-1 have been gathered (block i-1 prefetched): n - i, and n - 1 for block 0
        assert rank["before_backward"] == [n - max(i, 1) for i in range(n)], rank["before_backward"]
        # resharded after forward: every block but the last; the root kept
        assert rank["whole_after_forward"] == [False] * (n - 1) + [True]
        assert rank["root_whole"] is True
        info = rank["info"]
        assert info["blocks_resharded_after_forward"] == n - 1 and info["async_all_gather"] is True


def test_zero2_keeps_every_block_whole_and_gathers_each_unit_once():
    for rank in _launch(False):
        n = rank["blocks"]
        assert rank["whole_after_forward"] == [True] * n and rank["root_whole"] is True
        assert rank["forward_gathers"] == n + 1 and len(rank["gathers"]) == n + 1  # nothing gathered again
        assert all(rank["gathers"]) and rank["grads"]
