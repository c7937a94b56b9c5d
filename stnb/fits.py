"""What fits: the largest per-device batch each strategy trains under a per-rank memory budget (``stnb.fits``).

    stnb.fits(stnb.TrainConfig(model="minilm", num_processes=2), budget_gib=2.5)
    stnb.fits(build, budget_gib=2.5, strategies=["ddp", "fsdp"])      # your own trainer

For each strategy, first the prediction: a budget below the model state one rank holds
(``stnb.budget.refusal``, from ``stnb.memory.predict``) is that strategy's answer, with the strategies that
would fit it, and nothing starts. Then short real runs under the budget (``memory_budget_gib``, ``steps``
steps each, no evaluation): batch 1, then ``PROBE`` (8); from these two the predicted largest batch (where
what a rank holds after batch 1, plus what each sample adds at the steps' peak, meets the budget); then
the prediction and its neighbour, doubling while the batch trains and halving the gap once one fails, until
a batch that trains and the next one that runs out of memory (``LaunchError`` kind ``out_of_memory``) have
both been seen. The table's answer is what was observed, never extrapolated: ``largest`` trained, ``failed_at``
(``largest + 1``) did not, or ``largest`` is ``max_batch`` (nothing larger was tried).

What a rank holds is what the budget counts (``stnb.budget``: CPU, the rank process's VmData; GPU, the
allocator's reserve), read when the rank finished; what a sample adds is the growth of the steps' measured
peak (CPU: resident high-water mark; GPU: max allocated) between the two probe batches.
"""

from __future__ import annotations

from .config import TrainConfig
from .errors import ConfigError, LaunchError

#: the second probe batch: far enough from batch 1 for the peak's growth per sample to rise above the noise
PROBE = 8
MIB = 2**20
COLUMNS = ["strategy", "ranks", "largest", "global_batch", "failed_at", "predicted", "held_mib", "budget_mib",
           "state_mib", "samples_per_second", "runs", "note"]


def fits(config=None, *, budget_gib: float, strategies=None, steps: int = 4,
         max_batch: int = 512, echo: bool = True, **overrides):
    """A pandas DataFrame, one row per strategy (``COLUMNS``): the largest per-device batch that trained under
    ``budget_gib`` per rank and the next one that did not, the global batch, the predicted largest batch, what a
    rank held at the largest (MiB, what the budget counts) against the budget, the model state a rank held
    there (counted from its tensors), samples/s at the largest, how many runs it took, and why (a refusal, batch 1
    not fitting). ``config``: a TrainConfig (keyword overrides applied; ``steps`` steps, no evaluation,
    ``train_size`` raised to what the batch needs) or your build function (``overrides`` are then run options; the
    batch is set through ``override_args``, the steps are your arguments'). ``strategies``: by default every
    multi-rank strategy that runs here (``stnb.hardware``).
    ``DataFrame.attrs["trials"]``: {strategy: {batch: 'trained' | 'out of memory'}}, every run made;
    ``attrs["errors"]``: {strategy: {batch: what the rank that ran out of memory said}}."""
    import pandas as pd

    if not isinstance(budget_gib, (int, float)) or isinstance(budget_gib, bool) or budget_gib <= 0:
        raise ConfigError(f"budget_gib must be a number of GiB > 0, got {budget_gib!r}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ConfigError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if strategies is None:
        strategies = _runnable(config, overrides)
    rows, trials, errors = [], {}, {}
    for name in strategies:
        trial = _Trials(config, name, budget_gib, steps, overrides, echo)
        rows.append(trial.row(*_search(trial, max_batch)))
        trials[name] = {b: "out of memory" if r is None else "trained" for b, r in sorted(trial.seen.items())}
        errors[name] = dict(sorted(trial.errors.items()))
    table = pd.DataFrame(rows, columns=COLUMNS).astype({"ranks": "Int64", "failed_at": "Int64", "predicted": "Int64"})
    table.attrs["trials"], table.attrs["errors"] = trials, errors
    return table


class _Trials:
    """The runs of one strategy under the budget, by per-device batch: a RunResult, or None (out of memory)."""

    def __init__(self, config, strategy, budget_gib, steps, overrides, echo):
        self.config, self.strategy, self.budget_gib, self.steps = config, strategy, budget_gib, steps
        self.overrides, self.echo, self.seen, self.refused, self.errors = overrides, echo, {}, "", {}

    def __call__(self, batch: int):
        if batch not in self.seen:
            self.seen[batch] = self._run(batch)
        return self.seen[batch]

    def _run(self, batch: int):
        from .runner import run

        asked = dict(self.overrides, strategy=self.strategy, memory_budget_gib=self.budget_gib, echo=False)
        if self.config is None or isinstance(self.config, TrainConfig):
            base = (self.config or TrainConfig()).replace(**{k: v for k, v in asked.items() if k != "echo"})
            world = base.world_size()
            target, asked = base.replace(per_device_batch_size=batch, steps=self.steps, evaluate=False,
                                         train_size=max(base.train_size, batch * world * (self.steps + 1))), {}
            args = dict(echo=False)
        else:  # the user's function (its own steps: keep them few): the batch through override_args
            given = dict(asked.pop("override_args", None) or {})
            target, args = self.config, dict(asked, override_args={**given, "per_device_train_batch_size": batch})
        try:
            r = run(target, **args)
        except LaunchError as e:
            if e.kind != "out_of_memory":
                raise
            self.errors[batch] = str(e).split("\n")[0]
            self._say(batch, "out of memory")
            return None
        held = _held(r)
        self._say(batch, f"trained, a rank held {held / MIB:,.0f} MiB of {self.budget_gib * 1024:,.0f}")
        return r

    def _say(self, batch, what):
        if self.echo:
            print(f"stnb.fits: {self.strategy} per-device batch {batch}: {what}", flush=True)

    def predicted(self) -> int | None:
        """Where what a rank held after batch 1, plus what each sample adds at the steps' peak, meets the budget;
        None without both probes trained (or no growth seen)."""
        one, probe = self.seen.get(1), self.seen.get(PROBE)
        if one is None or probe is None:
            return None
        per_sample = (_peak(probe) - _peak(one)) / (PROBE - 1)
        if per_sample <= 0:
            return None
        return max(1, int((self.budget_gib * 2**30 - _held(one)) // per_sample))

    def row(self, largest, failed_at) -> dict:
        best = self.seen.get(largest)
        state = None
        if best is not None:
            state = max(b.get("total", 0) for b in best.memory_breakdown) if best.memory_breakdown else None
        return {"strategy": self.strategy, "ranks": best.world_size if best else None, "largest": largest,
                "global_batch": best.global_batch_size if best else 0, "failed_at": failed_at,
                "predicted": self.predicted(), "held_mib": round(_held(best) / MIB, 1) if best else None,
                "budget_mib": round(self.budget_gib * 1024, 1),
                "state_mib": round(state / MIB, 1) if state else None,
                "samples_per_second": best.samples_per_second if best else None, "runs": len(self.seen),
                "note": self.refused or ("" if largest else "batch 1 ran out of memory: the runtime and "
                                         "activations need more than the budget" if failed_at == 1 else "")}


def _runnable(config, overrides) -> list:
    """Every strategy with more than one rank that can run on the run's device here."""
    from . import strategies
    from .hardware import strategy_availability

    recipe = config is None or isinstance(config, TrainConfig)
    asked = (config or TrainConfig()).replace(**overrides) if recipe else TrainConfig.for_build(**overrides)
    runnable = strategy_availability(asked.resolved_device(), asked.share_gpus)
    return [name for name in strategies.names() if strategies.get(name).distributed and runnable[name]["runnable"]]


def _search(trial: _Trials, max_batch: int) -> tuple:
    """(largest batch that trained, the next one, which ran out of memory, or None at ``max_batch``)."""
    try:
        if trial(1) is None:
            return 0, 1
    except (ConfigError, LaunchError) as e:  # refused (before launch: the model state over the budget; or by the
        trial.refused = str(e).split("\n")[0]  # ranks: this trainer under this strategy), with the reason
        return 0, None
    lo, hi = 1, None
    if max_batch >= PROBE:
        if trial(PROBE) is not None:
            lo = PROBE
        else:
            hi = PROBE
    guess = trial.predicted()
    if hi is None and guess and lo < guess <= max_batch:  # the prediction, then its neighbour
        if trial(guess) is not None:
            lo = guess
            if guess < max_batch:
                lo, hi = (guess + 1, None) if trial(guess + 1) is not None else (guess, guess + 1)
        else:
            hi = guess
            if guess - 1 > lo:
                lo, hi = (guess - 1, guess) if trial(guess - 1) is not None else (lo, guess - 1)
    while hi is None and lo < max_batch:  # up, doubling
        b = min(max_batch, 2 * lo)
        if trial(b) is not None:
            lo = b
        else:
            hi = b
    while hi is not None and hi - lo > 1:  # between a batch that trained and one that did not
        mid = (lo + hi) // 2
        if trial(mid) is not None:
            lo = mid
        else:
            hi = mid
    return lo, hi


def _held(r) -> int:
    """What a rank held when it finished, as the budget counts it (the most of any rank)."""
    return max(v.get("memory_budget", {}).get("held_at_end", 0) for v in r.verification.get("ranks", [{}]))


def _peak(r) -> int:
    return max(r.peak_memory_bytes) if r.peak_memory_bytes else 0
