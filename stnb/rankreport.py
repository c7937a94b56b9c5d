"""What one rank reports after training: ``RankReport``, the value ``training.train_rank`` returns.

Every rank of a run returns one; ``stnb.results.merge`` combines them into the one RunResult a user
reads. A report crosses the process boundary pickled (``stnb.launch`` forked or spawned,
torchrun's ``all_gather_object``, bench's raw ``notebook_launcher`` files); it is a class of the
package, so a spawned rank and the notebook both find it by name. Results files hold the merged
RunResult only, never a report, so the report's shape is free to change without breaking them.

The fields are typed and required where a rank always knows them: a report without its
verification record cannot be built, and ``merge`` refuses anything that is not a RankReport
(``check_reports``), so a half-filled record never merges as verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RankReport", "check_reports"]


@dataclass(frozen=True)
class RankReport:
    """One rank's measurements and observations (``training.train_rank``): the rank's own facts, and each of its
    instruments' part (``stnb.instruments``: which instrument reports which field).

    rank: this rank's global rank.
    device: "cpu" or "cuda" (without the index).
    global_batch_size: samples per optimizer step over every device of the run.
    step_times: seconds per training step, as this rank timed them.
    losses: the losses the trainer logged (every logging step).
    verification: this rank's verification record (``strategies.verify_prepared`` at the first step,
        then the strategy's step check, the loss's model, the trained parameters...): ``ok`` and
        ``problems`` among its keys; empty when no training step began (never verified).
    peak_memory_bytes: the peak over the training steps alone (CUDA: max allocated; CPU: RSS growth).
    weight_digests: {tensor name: sha256} of every replicated tensor after training (compared across ranks).
    """

    rank: int
    device: str
    global_batch_size: int
    step_times: list
    losses: list
    verification: dict
    peak_memory_bytes: int
    weight_digests: dict
    memory_breakdown: dict = field(default_factory=dict)  # measured bytes per part (``memory.measure``)
    model_shape: dict | None = None      # the memory prediction's inputs, before sharding (``memory.model_shape``)
    peak_memory_run_bytes: int | None = None  # the whole run's peak (evaluation, gathering, saving too)
    peak_memory_method: str | None = None     # how the peaks were read (``memory.PeakMemory.method``)
    dev_metric: str | None = None        # the dev evaluator's primary metric's name (rank 0)
    dev_metric_before: float | None = None
    dev_metric_after: float | None = None
    dev_curve: list = field(default_factory=list)  # [(step, value)]: 0 = before ... last = after (rank 0)
    data_columns: list | dict | None = None  # the training data's columns; a dict of datasets: {name: columns}
    loss_inputs: dict | None = None      # what the loss received at its first call ({name: that} per dataset)
    time_to_first_step_s: float | None = None  # launch to the end of the first step
    saved_model: dict | None = None      # ``saving.save_checked``'s record (rank 0, with ``save_to``)
    memory_split: dict | None = None     # where the peak goes, parts adding up to it (``memsplit``)
    time_split: dict | None = None       # where each step's time went (``timesplit.StepTimer.summary``)
    train_flops: list = field(default_factory=list)   # per step, the training forwards' FLOPs (``mfu.FlopMeter``)
    train_tokens: list = field(default_factory=list)  # per step, the tokens those forwards saw
    flops_shape: dict | None = None      # the shape the FLOPs were counted from
    peak: dict | None = None             # the device's peak FLOP/s (``mfu.device_peak``); None on CPU
    overridden_args: dict = field(default_factory=dict)  # {argument: {"from", "to", "why"}} stnb set
    build: str | None = None             # the user's build function (``prepare.describe``); None: the recipe
    start_method: str | None = None      # how this rank was started, observed in it (None: another launcher)
    start_method_requested: str | None = None
    training: dict | None = None         # what a user's trainer trains with (None: stnb's recipe)
    collectives: dict | None = None      # collective calls per step: kind -> count, bytes (``instruments.collectives``)
    outside_steps: dict | None = None    # the step spread; evaluation / saves between steps (``instruments.outside``)
    checkpoints: list = field(default_factory=list)  # every checkpoint saved: step, path, seconds, bytes per rank
    resumed_from: dict | None = None     # the checkpoint this run resumed from (``instruments.checkpoints``)

    def __post_init__(self):
        if not isinstance(self.verification, dict):
            raise TypeError(f"RankReport.verification is a rank's verification record (a dict; empty when no "
                            f"step began), not {type(self.verification).__name__}")


def check_reports(reports) -> list:
    """``reports`` as a list of RankReports; TypeError naming the first item that is not one (a dict of
    an older stnb, a rank's own return value): it would merge with fields missing."""
    reports = list(reports)
    if not reports:
        raise ValueError("no rank reported: there is nothing to merge")
    for i, r in enumerate(reports):
        if not isinstance(r, RankReport):
            raise TypeError(f"item {i} of the ranks' results is a {type(r).__name__}, not a stnb.rankreport.RankReport: "
                            "merge combines what training.train_rank returns in each rank")
    return reports
