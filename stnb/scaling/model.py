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
class Measured:
    """One device's optimizer step, measured (seconds), and what the collectives move (bytes)."""
    batch: int                 # samples per device per optimizer step
    forward: float
    backward: float            # backward compute (without exposed communication)
    optimizer: float
    other: float               # data loading, logging, the rest of the step
    grad_bytes: float          # gradients all-reduced / reduce-scattered per step
    param_bytes: float         # parameters all-gathered (FSDP/ZeRO) or broadcast (DP)
    bucket_bytes: float = 25 * 2**20
    layers: int = 12           # FSDP units besides the root
    root_fraction: float = 0.25  # parameters outside the layers (embeddings): gathered first, reduced last
    reshard_after_forward: bool = True  # FSDP frees gathered parameters after forward: gathers again in backward
    source: str = ""
    notes: tuple = field(default_factory=tuple)

    @property
    def step(self) -> float:
        return self.forward + self.backward + self.optimizer + self.other
