"""``Flops``: the FLOPs and tokens of every training forward, per step, and the device's peak FLOP/s, for
the run's MFU (``stnb.mfu``: the formula, the meter, the peaks)."""

from __future__ import annotations

from ..mfu import FlopMeter, device_peak
from ..strategies import mixed_precision
from .base import Instrument


class Flops(Instrument):
    """Counts the training forwards' FLOPs (``FlopMeter``: a forward pre-hook on the model's first module,
    registered at construction); evaluation forwards between steps do not count."""

    made_at = "built"  # its hook goes on the model as built, before the strategy wraps it

    def __init__(self, model, device: str):
        self.meter = FlopMeter(model)
        self.device = device
        self.args = None

    @classmethod
    def for_rank(cls, rank):
        return cls(rank.trainer.model, rank.here.device)

    def on_train_begin(self, args, state, control, **kw):
        self.args = args  # the precision the run trains in, for the device's peak

    def on_step_begin(self, args, state, control, **kw):
        self.meter.start_step()  # evaluation forwards before this step do not count

    def on_step_end(self, args, state, control, **kw):
        self.meter.end_step()

    def report(self) -> dict:
        return {"train_flops": self.meter.per_step, "train_tokens": self.meter.tokens,
                "flops_shape": self.meter.shape, "peak": device_peak(self.device, mixed_precision(self.args))}
