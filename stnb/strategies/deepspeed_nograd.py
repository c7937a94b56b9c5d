"""Under DeepSpeed, a parameter that got no gradient is left as it is, as torch's optimizers leave it.

torch's AdamW skips a parameter whose ``.grad`` is None: no weight decay, no moment update. DeepSpeed's ZeRO
optimizers step flat partitions, where such a parameter holds zeros, so they decay it (and move it by its
moments, if it was trained before). A model with a parameter its loss never uses (the BERT pooler, under
mean pooling) then ends elsewhere under ``deepspeed`` than on one device: measured on the tiny BERT,
weight_decay 0.1, lr 5e-2, 6 steps, ``pooler.dense.weight`` 0.0225 apart (``stnb.parity`` failed it); every
other strategy leaves it exactly where it was.

``KeepWithoutGradient(engine)`` marks, by a hook on each trainable parameter, which ones got a gradient in
the backward passes of an optimizer step; at the step, one small all-reduce (MAX over the ranks: a parameter
used by any rank has a gradient on one device) names those that got none anywhere, and what the step writes
for them on this rank (the module's tensor or its ZeRO-3 piece, the fp32 master fragment, the optimizer's
moment fragments) is put back as it was. ``stats()`` goes into each rank's verification record.

What it cannot give back: torch counts AdamW's ``step`` per parameter, DeepSpeed per group, so a parameter
that is used only from some step on gets another bias correction than on one device (docs/parity.md).
"""

from __future__ import annotations

MOMENTS = ("exp_avg", "exp_avg_sq")


class KeepWithoutGradient:
    """Installed before the first forward (``DeepSpeed.on_first_step``); wraps ``engine.optimizer.step``."""

    def __init__(self, engine):
        self.engine = engine
        self.named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        self.got = [False] * len(self.named)
        self.handles = [p.register_hook(self._marker(i)) for i, (_, p) in enumerate(self.named)]
        self.steps = 0        # optimizer steps seen
        self.kept: dict = {}  # name -> steps in which no rank gave it a gradient (and stnb put it back)
        opt, original = engine.optimizer, engine.optimizer.step

        def step(*args, **kwargs):
            return self.step(original, *args, **kwargs)

        opt.step = step

    def _marker(self, i: int):
        def mark(grad):
            self.got[i] = True

        return mark

    def without_gradient(self) -> list:
        """Indices of the parameters no rank gave a gradient since the last step (a collective)."""
        import torch
        import torch.distributed as dist

        got = torch.tensor(self.got, dtype=torch.int32, device=self.engine.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(got, op=dist.ReduceOp.MAX)
        self.got = [False] * len(self.named)
        return [i for i, g in enumerate(got.tolist()) if not g]

    def step(self, original, *args, **kwargs):
        import torch

        self.steps += 1
        none = self.without_gradient()
        saved = [(put, read().clone()) for i in none for read, put in written(self.named[i][1])]
        out = original(*args, **kwargs)
        with torch.no_grad():
            for put, before in saved:
                put(before)
        for i in none:
            name = self.named[i][0]
            self.kept[name] = self.kept.get(name, 0) + 1
        return out

    def stats(self) -> dict:
        return {"steps": self.steps, "kept": dict(sorted(self.kept.items()))}


def written(p) -> list:
    """(read, write) for each tensor of ``p`` that DeepSpeed's optimizer step writes on this rank."""
    def live(attribute):  # read when used: ZeRO-3 gives a persistent parameter a new .data at each gather
        return (lambda: getattr(p, attribute)), (lambda v: getattr(p, attribute).copy_(v))

    def copier(t):
        return (lambda: t), t.copy_

    if hasattr(p, "ds_id"):  # ZeRO-3: this rank's piece of the module's tensor, the fp32 piece, the moments
        from deepspeed.utils import (safe_get_local_fp32_param, safe_get_local_optimizer_state,
                                     safe_set_local_fp32_param, safe_set_local_optimizer_state)

        out = [live("ds_tensor"),
               (lambda: safe_get_local_fp32_param(p), lambda v: safe_set_local_fp32_param(p, v))]
        if p.data.numel() == p.ds_numel:  # a persistent one (under stage3_param_persistence_threshold) is whole
            out.append(live("data"))  # on every rank, gathered again after each step
        for key in MOMENTS:
            try:
                safe_get_local_optimizer_state(p, key)
            except KeyError:  # no state before the first step
                continue
            out.append((lambda k=key: safe_get_local_optimizer_state(p, k),
                        lambda v, k=key: safe_set_local_optimizer_state(p, v, k)))
        return out
    # stage 1/2 (and DeepSpeed's bf16 optimizer): the whole module tensor on every rank, and this rank's
    # fragment of the fp32 master partition and of the moments, where the partition holds part of it
    out = [live("data")]
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is not None:
        out.append(copier(mapping.hp_fragment))
        out += [copier(t) for t in (getattr(mapping, "optim_fragment", None) or {}).values()]
    return out
