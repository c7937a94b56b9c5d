"""``StepLog``: every training step's time and logged loss, the time to the first step, and the progress the
notebook shows per rank (``stnb.report_progress``).

A step is timed from its begin callback to its end callback; the next one from there (so the data loading
between steps counts in the step), or from the end of an evaluation or a checkpoint the trainer ran between
them (``on_evaluate``: eval_strategy='steps', the dev curve; ``on_save``: a checkpoint): both are timed apart
(``OutsideSteps``), never in a step. ``began`` and ``last_end`` are the clock other instruments share
(``TimeSplit`` splits the same steps): this instrument runs before them at each event.
"""

from __future__ import annotations

import time

from ..processes import report_progress
from .base import Instrument


class StepLog(Instrument):
    """Step times (``time.perf_counter``), losses, and the wall time from launch to the first step's end."""

    made_at = "start"  # the clock the instruments made later read (TimeSplit, OutsideSteps)

    def __init__(self, launch_time: float):
        self.launch_time = launch_time
        self.step_times: list = []
        self.losses: list = []
        self.began: float | None = None       # perf_counter at the first step's begin (None: no step began)
        self.last_end: float | None = None    # perf_counter at the last step's end
        self.first_step_wall: float | None = None  # time.time() at the first step's end

    @classmethod
    def for_rank(cls, rank):
        return cls(rank.here.launch_time)

    def on_step_begin(self, args, state, control, **kw):
        if self.began is None:
            self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        self.step_times.append(now - (self.last_end if self.last_end is not None else self.began))
        if self.last_end is None:
            self.first_step_wall = time.time()
        self.last_end = now
        report_progress(state.global_step, state.max_steps)  # the step's loss follows in on_log

    def on_evaluate(self, args, state, control, **kw):
        if self.last_end is not None:  # between two steps: the next one is timed from here
            self.last_end = time.perf_counter()

    on_save = on_evaluate  # a checkpoint, like an evaluation, is timed apart (``OutsideSteps``)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            report_progress(state.global_step, state.max_steps, float(logs["loss"]))

    def report(self) -> dict:
        first = self.first_step_wall - self.launch_time if self.first_step_wall else None
        return {"step_times": self.step_times, "losses": self.losses, "time_to_first_step_s": first}
