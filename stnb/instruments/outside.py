"""``OutsideSteps``: the spread of this rank's step times, and the work it does between training steps
(evaluation, checkpoint saving) with its frequency.

The trainer evaluates and saves after a step's end, before the next step begins. A save lands in the next
step's time (its ``data`` part) and in samples/s; an evaluation does not: the step clock (``StepLog``,
``TimeSplit``) resumes at its end and the training peak (``MemoryUse``) pauses for it, so a dev curve
(``TrainConfig.dev_points``) leaves the measurements as they were. Here each ``trainer.evaluate`` and
``trainer._save_checkpoint`` call is timed (host clock) with the step it followed. The evaluation
``stnb`` itself runs before and after training (rank 0, ``training.Outcome``) is outside the steps and
outside samples/s: not counted here.

``spread``: the rank's own steady step times (after ``warmup``): mean, standard deviation, p50 and p90,
what the slowest of n ranks waits for in a synchronised step.
"""

from __future__ import annotations

import functools
import statistics
import time

from .base import Instrument


def spread(times) -> dict | None:
    """mean, std, p50, p90 (seconds) of step times; None without two of them."""
    times = sorted(times)
    if len(times) < 2:
        return None

    def q(p):  # linear interpolation between the closest ranks
        x = p * (len(times) - 1)
        lo = int(x)
        return times[lo] + (times[min(lo + 1, len(times) - 1)] - times[lo]) * (x - lo)

    return {"steps": len(times), "mean": statistics.fmean(times), "std": statistics.pstdev(times),
            "p50": q(0.5), "p90": q(0.9)}


class OutsideSteps(Instrument):
    """Times the trainer's evaluations and checkpoint saves; reports them with the step spread."""

    @classmethod
    def for_rank(cls, rank):
        return cls(rank.trainer, rank.made["StepLog"])

    def __init__(self, trainer, steps, warmup: int | None = None):
        self.steps = steps                # the StepLog: its step times
        config = getattr(trainer, "stnb_config", None)  # steps left out of the spread: the run's warm-up
        self.warmup = warmup if warmup is not None else getattr(config, "warmup_steps_excluded", 2)
        self.state = None
        self.calls: dict = {"evaluate": [], "save": []}
        for kind, name in (("evaluate", "evaluate"), ("save", "_save_checkpoint")):
            method = getattr(trainer, name, None)
            if method is not None:
                setattr(trainer, name, self._timed(kind, method))

    def _timed(self, kind, method):
        @functools.wraps(method)
        def timed(*args, **kw):
            start = time.perf_counter()
            try:
                return method(*args, **kw)
            finally:
                step = self.state.global_step if self.state is not None else None
                self.calls[kind].append({"after_step": step, "seconds": time.perf_counter() - start})

        return timed

    def on_train_begin(self, args, state, control, **kw):
        self.state = state

    def report(self) -> dict:
        work = {}
        for kind, calls in self.calls.items():
            if not calls:
                continue
            steps = [c["after_step"] for c in calls if c["after_step"] is not None]
            gaps = sorted({b - a for a, b in zip(steps, steps[1:])})
            work[kind] = {"calls": len(calls), "seconds": [c["seconds"] for c in calls], "after_steps": steps,
                          "every_steps": gaps[0] if len(gaps) == 1 else None}
        return {"outside_steps": {"spread": spread(self.steps.step_times[self.warmup:]), "work": work}}
