"""Exceptions raised by stnb. Every message names the cause and the fix."""

from __future__ import annotations


class StnbError(Exception):
    """Base class for stnb errors."""


class ConfigError(StnbError, ValueError):
    """A configuration or argument is invalid. Raised before any process starts."""


def unknown_choice(name: str, value, choices) -> ConfigError:
    """The ConfigError for a value outside a fixed set: it names the set."""
    return ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(map(repr, choices))}")


def check_positive(name: str, value) -> None:
    """Raise the ConfigError for a value that is not a number > 0 (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a number > 0, got {value!r}")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from: missing, half-written, or not one this run can load
    (``stnb.checkpoints``)."""


class StrategyUnavailable(StnbError):
    """The strategy cannot run on this hardware (e.g. DP without 2 GPUs)."""

    def __init__(self, strategy: str, reason: str):
        self.strategy = strategy
        self.reason = reason
        super().__init__(f"strategy {strategy!r} cannot run here: {reason}")


class VerificationError(StnbError):
    """A prepared strategy is not what it claims to be (e.g. FSDP that did not shard)."""


class ResultsFileError(StnbError):
    """A results file is unreadable, corrupted or not writable."""


class LaunchError(StnbError):
    """A launched job failed.

    Attributes:
        rank: the global rank that failed first (None when no single rank is to blame).
        ranks: every rank reported as failed or stalled.
        kind: 'raised', 'killed', 'exited', 'stalled', 'timeout', 'busy', 'interrupted', 'out_of_memory' (a rank
            raised ``OutOfMemory``, past its ``memory_budget_gib``, or torch's or Python's own out-of-memory error;
            a SLURM job SLURM ended for memory); a cluster job (``stnb.Slurm`` / ``stnb.Ray``) also 'cancelled',
            'rendezvous' (not every rank arrived), 'node_fail', 'preempted'.
        rank_traceback: the failing rank's formatted traceback (or stack dumps for a stall).
        logs: {rank: captured output} of every rank.
    """

    def __init__(self, message: str, *, rank: int | None = None, ranks=(), kind: str = "raised",
                 rank_traceback: str = "", logs: dict | None = None):
        self.rank = rank
        self.ranks = list(ranks)
        self.kind = kind
        self.rank_traceback = rank_traceback
        self.logs = logs or {}
        full = message
        if rank_traceback:
            full += "\n\n" + rank_traceback.rstrip()
        super().__init__(full)


class OutOfMemory(StnbError, MemoryError):
    """A rank needed more memory than its budget (``memory_budget_gib``, ``stnb.budget``) allowed. Raised inside
    the rank, naming it, the budget, the prediction, what it measured and what would fit; ``stnb.run`` reports it
    as a LaunchError of kind 'out_of_memory'."""


#: error types a rank raises when memory ran out: stnb's budget, torch's CUDA allocator, Python's own
OUT_OF_MEMORY = ("OutOfMemory", "OutOfMemoryError", "MemoryError")


def failure_kind(error_type: str) -> str:
    """A LaunchError's kind for a rank that raised an error of type ``error_type`` (its class name)."""
    return "out_of_memory" if error_type in OUT_OF_MEMORY else "raised"


class BuildError(StnbError):
    """A user's build function (``stnb.run(build, ...)``) raised, or returned something that is not a
    SentenceTransformerTrainer stnb can train. Raised inside the ranks; ``stnb.run`` reports it as a
    LaunchError carrying this message."""
