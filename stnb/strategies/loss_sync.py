"""Parameters a loss owns (SoftmaxLoss's classifier, a learnable temperature, a projection head) kept in
sync across ranks.

sentence-transformers puts them in the optimizer (``get_optimizer_cls_and_kwargs``, #2872), but only the
model is wrapped in DDP / sharded by FSDP, so their gradients are never all-reduced and every rank trains
its own copy: plain sentence-transformers lets them drift apart. stnb starts every rank from rank 0's
values and, before every optimizer step (after the trainer clipped the model's gradients, which never
included them), replaces each of their gradients by its mean over the ranks, as DDP does for the model's.
A gradient no rank produced in a step (a loss that did not run in it) stays None. The replicated-weights
check then compares their bytes across ranks after training, with the model's.

In a checkpoint (every strategy, ``Strategy.saving``): being equal on every rank, their values are written once,
by the rank that writes the trainer's files (``loss-parameters.pt``, by name), and read back by every rank; their
optimizer state goes with the rest of the optimizer's (a sharded one names it by these names, ``named_with_loss``).
"""

from __future__ import annotations

from .tensors import loss_owned_parameters

LOSS_PARAMETERS = "loss-parameters.pt"  # a checkpoint's file of the loss's own parameters, by name


class LossParameterSync:
    """``LossParameterSync(trainer)`` broadcasts rank 0's loss parameters (a collective); ``sync_grads()``
    averages their gradients over the ranks (a collective, before every optimizer step)."""

    def __init__(self, trainer):
        import torch
        import torch.distributed as dist

        self.named = loss_owned_parameters(trainer)
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.active = bool(self.named) and self.world > 1
        self.steps_synced = 0
        if self.active:
            with torch.no_grad():
                for _, p in self.named:
                    dist.broadcast(p.data, src=0)

    def names(self) -> list:
        return [n for n, _ in self.named]

    def sync_grads(self) -> None:
        if not self.active:
            return
        import torch
        import torch.distributed as dist

        params = [p for _, p in self.named]
        flat = torch.cat([torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float(),
                                     torch.ones(1, device=p.device) * (p.grad is not None)]) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            mean, produced = flat[offset:offset + n] / self.world, flat[offset + n] > 0
            offset += n + 1
            if produced:
                p.grad = mean.view_as(p).to(p.dtype)
        self.steps_synced += 1

    def callback(self):
        """A ``transformers.TrainerCallback`` that calls ``sync_grads()`` before every optimizer step (the
        trainer's ``on_pre_optimizer_step``); added to the trainer where the strategy is applied."""
        from transformers import TrainerCallback

        sync = self

        class LossParameterSyncCallback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kw):
                sync.sync_grads()  # the loss's own parameters: mean gradient over the ranks

        return LossParameterSyncCallback()

    def describe(self) -> dict:
        return {"loss_parameters": self.names(), "synced": self.active, "steps_synced": self.steps_synced}


def save_loss_parameters(trainer, folder: str) -> None:
    """The loss's own parameters into a checkpoint (the writing rank only: they are equal on every rank)."""
    import os

    import torch

    owned = loss_owned_parameters(trainer)
    if owned and trainer.args.should_save:
        torch.save({n: p.detach().cpu() for n, p in owned}, os.path.join(folder, LOSS_PARAMETERS))


def load_loss_parameters(trainer, folder: str) -> None:
    """The loss's own parameters back from a checkpoint (every rank); CheckpointError when the loss has some and
    the checkpoint holds other ones, or none."""
    import os

    import torch

    from ..errors import CheckpointError

    owned = dict(loss_owned_parameters(trainer))
    path = os.path.join(folder, LOSS_PARAMETERS)
    saved = torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else {}
    if set(saved) != set(owned):
        raise CheckpointError(f"{folder} holds the loss parameters {sorted(saved) or 'none'} and this run's loss has "
                              f"{sorted(owned) or 'none'}: it was written by a run with another loss (or before stnb "
                              "saved a loss's own parameters); resume with the loss that wrote it, or start from step "
                              "0 (the model it holds: stnb.checkpoints.to_model)")
    with torch.no_grad():
        for name, p in owned.items():
            p.copy_(saved[name])


def named_with_loss(trainer):
    """The module naming every parameter the optimizer updates, for ``torch.distributed.checkpoint.state_dict``'s
    optimizer state: the model, or, when the loss owns parameters, a module naming the model's parameters as the
    model does and the loss's by their names (``loss.projection.weight``): the same tensors, nothing copied."""
    owned = loss_owned_parameters(trainer)
    if not owned:
        return trainer.model
    import torch

    root = torch.nn.Module()
    for name, p in [*trainer.model.named_parameters(), *owned]:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, p)
    return root
