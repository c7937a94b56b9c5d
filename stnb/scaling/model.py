"""What the predictor's step models take: ``Measured``, one device's step, split into forward, backward
compute, optimizer and the rest (data loading, logging), with the bytes the collectives move.

Each strategy's model is its own: ``Strategy.step_time(m, fabric, n, host_fraction)`` in its module of
``stnb/strategies/`` (its docstring says what it counts), built from ``stnb.strategies.stepcost``
(units pipelined on one compute stream and one communication channel). ``stnb.scaling.predict`` asks
the registry for every strategy that has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Range:
    """One uncertain input of a prediction: its low, mid and high value, what it is and where it comes from.
    ``stnb.scaling.interval`` predicts at every combination of the ends (and all mids) of an input's ranges."""
    name: str                  # a key the predictor knows (``interval.KNOBS``)
    low: float
    mid: float
    high: float
    label: str = ""            # shown in the table (e.g. "link bus bandwidth")
    source: str = ""

    def __post_init__(self):
        if not self.low <= self.mid <= self.high:
            raise ValueError(f"range {self.name}: low <= mid <= high needed, got {self.low}, {self.mid}, {self.high}")

    def describe(self, fmt="{:.3g}") -> str:
        vals = fmt.format(self.mid) if self.low == self.high else " / ".join(fmt.format(v) for v in
                                                                             (self.low, self.mid, self.high))
        return f"{self.label or self.name}: {vals}{' (low / mid / high)' if self.low != self.high else ''}" + \
            (f" ({self.source})" if self.source else "")


@dataclass(frozen=True)
class Uncertain:
    """A step whose inputs carry ranges: ``build(values)`` gives the Measured step for one value of each of
    ``ranges`` (a dict name -> value), e.g. the published single row split with one optimizer cost."""
    ranges: tuple
    build: object              # callable(dict) -> Measured

    def mid(self):
        return self.build({r.name: r.mid for r in self.ranges})


@dataclass(frozen=True)
class Measured:
    """One device's optimizer step, measured (seconds), and what the collectives move (bytes)."""
    batch: int                 # samples per device per optimizer step
    forward: float
    backward: float            # backward compute (without exposed communication)
    optimizer: float
    other: float               # data loading, logging, the rest of the step
    grad_bytes: float          # gradients all-reduced / reduce-scattered per step
    param_bytes: float         # parameters all-gathered (ZeRO-1's updated shards) or broadcast (DP): fp32
    gather_bytes: float | None = None  # FSDP's all-gathers: parameters in its MixedPrecisionPolicy's param_dtype
                                       # (2 B under bf16 / fp16); None: param_bytes
    bucket_bytes: float = 25 * 2**20
    layers: int = 12           # FSDP units besides the root
    root_fraction: float = 0.25  # parameters outside the layers (embeddings): gathered first, reduced last
    gathers_again: bool = True  # FSDP frees gathered parameters after forward and gathers them again in backward
    forward_calls: float = 1.0  # calls of the model per step (one per text column the loss embeds)
    step_spread: float = 0.0    # standard deviation of a rank's step (s): the slowest of n ranks sets the pace
    fits: bool = True           # the whole model trained on one device (the input run did not shard it)
    collective_host: float = 0.0  # host seconds per collective of FSDP's wrapper (copy-in/out, hooks, bookkeeping),
                                  # exposed: measured with a one-rank FSDP run (``scaling.collective_host``); 0: not
    threads: int = 0            # a CPU run's torch threads per process (0: not a CPU run): the loopback link's
                                # prediction measures ranks sharing this machine's cores against it
    # measured gradient readiness: ((fraction of backward when ready, share of the gradient bytes), ...) in the
    # order the groups were ready (``stnb.stepparts.grad_ready``); empty: the layers in proportion to
    # backward's progress and the root (``root_fraction``) at its end
    ready: tuple = ()
    inputs: tuple = ()          # (input, "measured" | "assumed", how) for each input the prediction rests on
    source: str = ""
    notes: tuple = field(default_factory=tuple)

    @property
    def step(self) -> float:
        return self.forward + self.backward + self.optimizer + self.other
