"""zero2 (ZeRO stage 2): gradients and optimizer state sharded, parameters whole during forward and backward.

FSDP2 ``fully_shard(reshard_after_forward=False)``: the parameters all-gathered for the forward stay whole
until the backward is done (no second all-gather in the backward, ZeRO-2's communication), the gradients
are reduce-scattered into 1/N shards and the optimizer updates only this rank's shard. Between steps FSDP2
keeps only the rank's parameter shard, so "whole parameters" is the step's peak, not the resting state.
Each unit's forward prefetches the next block's all-gather, asynchronous on CPU, as for fsdp (``shard_fsdp``).

Verified from the gradients' local shards after the first backward (exact sizes from their placements),
the parameters' shards, and the ranks' shards adding up to the model.
"""

from __future__ import annotations

from .fsdp import FSDP_OPTIONS, FullyShardedDataParallel, fsdp_step


class Zero2(FullyShardedDataParallel):
    name = "zero2"
    label = "ZeRO-2"
    aka = "ZeRO stage 2"
    summary = ("FSDP2 fully_shard(reshard_after_forward=False): gradients and optimizer state sharded, "
               "parameters whole during forward and backward")
    color = "#17becf"
    options = {"fsdp_layer_cls": FSDP_OPTIONS["fsdp_layer_cls"]}  # its parameters stay gathered: no resharding
    tunings = {}
    gathered_during_step = "all"
    order = 50
    bench = False
    gpu_check = False

    def step_time(self, m, fab, n, host_fraction=None):
        """FSDP that keeps the gathered parameters from forward to backward: one all-gather per unit in
        forward, reduce-scatters in backward, the optimizer on 1/n."""
        return fsdp_step(m, fab, n, reshard_after_forward=False)

    def reshard_after_forward(self, config) -> bool:
        return False
