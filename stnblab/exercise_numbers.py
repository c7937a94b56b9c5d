"""Checkers for the course's exercises that compute a number stnb reports (notebooks 01, 04 and 05), run in
this process (``stnblab.exercises`` re-exports them beside the checkers that run in ranks):

    check_samples_per_second(fn, result=None)   fn(step_times, global_batch, warmup) -> samples per second, as
                                                RunResult.samples_per_second counts them (01)
    check_zero_bytes(fn)                        fn(n_params, world, stage) -> bytes one rank holds of the fp32
                                                parameters, gradients and AdamW's two states (04)
    check_overall(fn)                           fn(trained, reference, initial) -> how far a run ended from the
                                                one-device run, stnb.parity's "overall" column (05)

Each runs ``fn`` on cases where a usual slip gives another answer (the warm-up steps counted, a stage that
divides the wrong part, a norm per tensor instead of over all of them) and returns a Verdict naming the first
case that differs, with what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Verdict:
    """What a checker found: ``passed``, and one line per world it ran (shown as the checker's answer)."""

    exercise: str
    passed: bool
    lines: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        head = f"{self.exercise}: {'PASSED' if self.passed else 'FAILED'}"
        return "\n".join([head] + [f"  {line}" for line in self.lines])

    __repr__ = __str__


#: how close an answer must be (relative): these are sums and quotients of a few floats
REL = 1e-9


def _verdict(exercise: str, cases: list, fn) -> "Verdict":
    """``cases``: ``(description, args, expected, hint)``; the first case whose answer differs (or raises)
    fails the verdict."""
    for description, args, expected, hint in cases:
        try:
            got = fn(*args)
        except Exception as e:  # noqa: BLE001 - the student's error, shown with the case
            return Verdict(exercise, False, [f"{description}: raised {type(e).__name__}: {e}"])
        try:
            ok = math.isclose(float(got), expected, rel_tol=REL, abs_tol=1e-12) or got == expected
        except (TypeError, ValueError):
            return Verdict(exercise, False, [f"{description}: returned {got!r}, not a number"])
        if not ok:
            return Verdict(exercise, False, [f"{description}: {float(got):,.6g}, expected {expected:,.6g} ({hint})"])
    return Verdict(exercise, True, [f"{len(cases)} cases, each as stnb computes it"])


# ------------------------------------------------------------------------------------------ samples/s --

def check_samples_per_second(fn, result=None) -> "Verdict":
    """``fn(step_times, global_batch, warmup)``: the samples of the measured steps over their seconds, the first
    ``warmup`` steps left out (they load and compile). With ``result`` (a one-device RunResult), also its own
    step times against its ``samples_per_second``."""
    hint = "the global batch times the steps after the warm-up, over those steps' seconds"
    cases = [(f"step times {times}, global batch {batch}, warm-up {warm}", (times, batch, warm),
              batch * (len(times) - warm) / sum(times[warm:]), hint)
             for times, batch, warm in [([2.0, 0.5, 0.5, 0.5], 8, 1), ([3.0, 1.0, 0.25, 0.75], 32, 2),
                                        ([0.4, 0.6, 0.5], 16, 0)]]
    if result is not None:
        warm = min(result.config.get("warmup_steps_excluded", 0), max(0, len(result.step_times) - 1))
        cases.append((f"this run ({result.steps} steps, global batch {result.global_batch_size}, warm-up {warm})",
                      (list(result.step_times), result.global_batch_size, warm), result.samples_per_second,
                      "result.samples_per_second"))
    return _verdict("samples per second", cases, fn)


# ------------------------------------------------------------------------------------------- ZeRO bytes --

def zero_parts(n_params: int) -> dict:
    """Bytes of the fp32 model state, whole: parameters, gradients, AdamW's two states."""
    return {"parameters": 4 * n_params, "gradients": 4 * n_params, "optimizer": 8 * n_params}


#: which parts each stage divides by the number of ranks (stage 0: DDP, every part whole on every rank)
SHARDED = {0: (), 1: ("optimizer",), 2: ("optimizer", "gradients"), 3: ("optimizer", "gradients", "parameters")}


def check_zero_bytes(fn) -> "Verdict":
    """``fn(n_params, world, stage)``: the bytes one rank holds of the fp32 parameters (4 a value), gradients (4)
    and AdamW's two states (8), at ZeRO stage 0 (DDP) to 3, with every divided part split evenly."""
    cases = []
    for n, world in [(1_200, 2), (22_713_216, 4), (1_000, 8)]:
        for stage, divided in SHARDED.items():
            parts = zero_parts(n)
            expected = sum(b / world if p in divided else b for p, b in parts.items())
            kept = ", ".join(p for p in parts if p not in divided) or "nothing"
            cases.append((f"stage {stage}, {world} ranks, {n:,} parameters", (n, world, stage), expected,
                          f"stage {stage} divides {', '.join(divided) or 'nothing'} by {world}; each rank keeps "
                          f"{kept} whole"))
    return _verdict("ZeRO bytes per rank", cases, fn)


# ---------------------------------------------------------------------------------------------- overall --

def check_overall(fn) -> "Verdict":
    """``fn(trained, reference, initial)`` (three ``{name: tensor}`` dicts): the distance between the run's
    and the one-device run's weights over all tensors together, as a share of how far the one-device run moved
    them from the initial weights: stnb.parity's own ``overall``."""
    from types import SimpleNamespace

    import torch

    from stnb.parity import _overall  # the module (stnb.parity, the name, is the function)

    g = torch.Generator().manual_seed(5)
    shapes = {"encoder.weight": (6, 4), "encoder.bias": (6,), "head.weight": (1, 6)}
    initial = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    reference = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in initial.items()}
    close = {n: t + 1e-4 * torch.randn(t.shape, generator=g) for n, t in reference.items()}
    one_off = {**reference, "head.weight": reference["head.weight"] + 0.05}
    hint = "the norm of (run - one device) over every tensor together, over the norm of (one device - initial)"
    cases = []
    for description, trained in [("a run a little apart", close), ("one tensor apart", one_off),
                                 ("the same weights", reference)]:
        want = _overall(SimpleNamespace(trained=trained), SimpleNamespace(trained=reference, initial=initial))
        cases.append((description, (trained, reference, initial), want, hint))
    return _verdict("overall", cases, fn)
