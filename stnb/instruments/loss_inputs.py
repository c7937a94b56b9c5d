"""``LossInputs``: what the loss really receives at its first call, against the data's columns.

A forward pre-hook on the loss (on each loss of a dict of losses, one per dataset) notes how many text
inputs it got and whether a label came with them, and the rows of its first input. ``results.merge``
compares that with the training data's columns (``data_columns``); an overridden per-device batch
(``override_args``, the Panel) is checked here against the rows the loss's first batch had.
"""

from __future__ import annotations

import functools

from .base import Instrument


class LossInputs(Instrument):
    """Hooks the loss at construction; reports ``loss_inputs`` (``{dataset: that}`` for a dict of losses)
    and ``data_columns``; with ``batch_asked`` (the overridden per-device batch), checks the first batch."""

    @classmethod
    def for_rank(cls, rank):
        batch = rank.overridden.get("per_device_train_batch_size")  # asked: the loss's first batch is checked
        return cls(rank.trainer, batch and batch["to"])

    def __init__(self, trainer, batch_asked: int | None = None):
        self.trainer = trainer
        self.batch_asked = batch_asked
        self.loss_inputs: dict | None = None
        self.first_batch_rows: int | None = None  # rows of the loss's first input at its first call
        loss = trainer.loss
        for name, one in (loss.items() if isinstance(loss, dict) else [(None, loss)]):
            one.register_forward_pre_hook(functools.partial(self._hook, name))

    def _hook(self, name, module, args):
        if not args or (self.loss_inputs is not None and (name is None or name in self.loss_inputs)):
            return
        first = not self.loss_inputs  # nothing recorded yet: this call's batch is the first one
        features = list(args[0])
        labels = args[1] if len(args) > 1 else None
        observed = {"texts": len(features), "label": labels is not None}
        if name is None:
            self.loss_inputs = observed
        else:
            self.loss_inputs = {**(self.loss_inputs or {}), name: observed}
        if first:
            tensors = [v for v in (features[0].values() if features and isinstance(features[0], dict) else [])
                       if hasattr(v, "shape") and len(v.shape) >= 1]
            self.first_batch_rows = int(tensors[0].shape[0]) if tensors else None

    def report(self) -> dict:
        columns = getattr(self.trainer.train_dataset, "column_names", None)
        # a dict of datasets (one per loss): {dataset: its columns}
        return {"loss_inputs": self.loss_inputs, "data_columns": columns if isinstance(columns, (list, dict)) else None}

    def verification(self) -> tuple[dict, list]:
        """An overridden per-device batch: the loss's first batch must have had the rows asked for, unless
        the data has fewer rows than one batch."""
        if self.batch_asked is None:
            return {}, []
        # per device, times the GPUs under dp (where the loss sees the whole batch)
        asked = self.batch_asked * max(1, self.trainer.args.n_gpu)
        data = self.trainer.train_dataset
        rows = len(data) if hasattr(data, "__len__") else None
        got = self.first_batch_rows
        ok = got == asked or (rows is not None and got == rows < asked)
        batch = {"asked": asked, "first_batch_rows": got, "ok": ok}
        problems = [] if batch["ok"] else [f"per_device_train_batch_size was overridden to {asked}, but the loss's "
                                           f"first batch had {got} rows"]
        return {"batch_override": batch}, problems
