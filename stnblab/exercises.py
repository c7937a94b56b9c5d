"""Checkers for the course's "implement it yourself" exercises (notebooks 00, 03 and 09 here; 01, 04 and 05's,
which compute a number in this process, in stnblab/exercise_numbers.py, re-exported here).

A student writes a function; a checker runs it in real ranks (2 and 3 gloo processes on CPU, with
tensors whose length the world size does not divide), compares what every rank ends with against
torch's own answer, and returns a :class:`Verdict` naming the first rank and element that differ:

    check_rank_max(fn)          fn(t) leaves (or returns) the element-wise maximum of t over the ranks; compared
                                with torch.distributed.all_reduce(op=MAX)
    check_ring_all_reduce(fn)   fn(t) sums t over the ranks with point-to-point sends only, in place
                                (or returning the result); compared with torch.distributed.all_reduce
    check_zero1_step(fn)        fn(params, lr) takes one AdamW step keeping optimizer state for this
                                rank's slice only and returns its optimizer; compared with one AdamW
                                step on the full parameters and the averaged gradients

Ranks start with ``stnb.launch`` (forked: the function defined in the notebook cell runs as is). A
world larger than this machine's cores (3 ranks on a 2-core laptop, which ``stnb.launch`` refuses
because its timings would mean nothing) starts with torchrun instead
(:func:`stnblab.parallel.oversubscribe.launch_oversubscribed`), the function sent by value. The
reference solutions are not here (the notebooks would give them away): tests/exercise_solutions.py.
"""

from __future__ import annotations

import contextlib
import math
import re

from .exercise_numbers import (
    Verdict, check_overall, check_samples_per_second, check_zero_bytes)  # noqa: F401 - the course's

#: the worlds every exercise runs in, and the tensor lengths: none divisible by 2 or by 3
WORLDS = (2, 3)
RING_LENGTHS = (7, 11)
#: how long a rank may run the attempt before it gives up (a receive whose send never comes waits forever):
#: the rank itself says so and exits, before stnb.launch's stall limit (STALL_S) or torchrun's (TIMEOUT_S)
LIMIT_S = 20
STALL_S = 60
TIMEOUT_S = 180
#: the model whose parameters the ZeRO-1 step updates: 4x4 + 4 + 4x1 + 1 = 25 values
ZERO1_SHAPES = ((4, 4), (4,), (1, 4), (1,))
ZERO1_LR = 0.01

#: the collectives a ring all-reduce may not call: it is built from send / recv
_COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
                "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
                "broadcast", "gather", "scatter")


class _Refused(RuntimeError):
    """Raised in a rank when the attempt calls what the exercise builds itself."""


# ------------------------------------------------------------------------------------------ rank max --

def check_rank_max(fn, worlds=WORLDS, limit_s: float = LIMIT_S) -> Verdict:
    """Run ``fn(t)`` in every rank of each world (``t``: this rank's own whole numbers) and compare every rank's
    result (``t`` after the call, or what ``fn`` returned) with ``torch.distributed.all_reduce(op=MAX)``."""
    lines, passed = [], True
    for world in worlds:
        outcome = _in_ranks(_max_rank, world, limit_s, fn)
        bad = outcome if isinstance(outcome, str) else _worst(outcome)
        if isinstance(bad, dict):
            bad = f"rank {bad['rank']}: {bad['problem']}"
        passed = passed and bad is None
        lines.append(f"{world} ranks: {bad or 'every rank holds the element-wise maximum over the ranks'}")
    return Verdict("rank maximum", passed, lines)


def _max_rank(fn):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), 5
    t = torch.randint(-9, 10, (n,), generator=torch.Generator().manual_seed(rank)).float()
    given, expected = t.clone(), t.clone()
    dist.all_reduce(expected, op=dist.ReduceOp.MAX)
    try:
        out = fn(t)
    except Exception as e:  # noqa: BLE001 - the student's error, reported with its rank
        return _said({"rank": rank, "problem": f"raised {type(e).__name__}: {e}", "first": not _peer_gone(e)})
    got = out if isinstance(out, torch.Tensor) else t
    return {"rank": rank, "problem": _first_difference(got, expected, given, n, exact=True,
                                                        reference="torch.distributed.all_reduce(op=MAX)")}


# ------------------------------------------------------------------------------------ ring all-reduce --

def check_ring_all_reduce(fn, worlds=WORLDS, lengths=RING_LENGTHS, limit_s: float = LIMIT_S) -> Verdict:
    """Run ``fn(t)`` in every rank of each world, for float32 tensors of each length, and compare every
    rank's result (``t`` after the call, or what ``fn`` returned) with ``torch.distributed.all_reduce``
    (a sum). The values are whole numbers, so the comparison is exact whatever order the ring adds in.
    ``fn`` must build the sum from point-to-point messages (``dist.isend`` / ``dist.irecv``,
    ``dist.send`` / ``dist.recv``): a call to a collective is refused. A rank still running the attempt after
    ``limit_s`` seconds gives up and says so."""
    lines, passed = [], True
    for world in worlds:
        outcome = _in_ranks(_ring_rank, world, limit_s, fn, tuple(lengths))
        if isinstance(outcome, str):
            lines.append(f"{world} ranks: {outcome}")
            passed = False
            continue
        bad = _worst(outcome)
        if bad is None:
            lines.append(f"{world} ranks, lengths {', '.join(map(str, lengths))}: every rank holds the sum "
                         "torch.distributed.all_reduce gives")
        else:
            passed = False
            lines.append(f"{world} ranks: rank {bad['rank']}: {bad['problem']}")
    return Verdict("ring all-reduce", passed, lines)


def _ring_rank(fn, lengths):
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for n in lengths:
        g = torch.Generator().manual_seed(1000 * world + 10 * n + rank)
        t = torch.randint(-9, 10, (n,), generator=g).float()
        given = t.clone()
        expected = t.clone()
        dist.all_reduce(expected)
        try:
            with _collectives_refused(dist):
                out = fn(t)
        except _Refused as e:
            return _said({"rank": rank, "problem": str(e), "first": True})
        except Exception as e:  # noqa: BLE001 - the student's error, reported with its rank
            return _said({"rank": rank, "problem": f"raised {type(e).__name__}: {e} (tensor of {n} elements)",
                          "first": not _peer_gone(e)})
        got = out if isinstance(out, torch.Tensor) else t
        problem = _first_difference(got, expected, given, n, exact=True, reference="torch.distributed.all_reduce")
        try:
            stop = _any_rank(problem)  # every rank stops at the same length: none waits for a partner that left
        except Exception as e:  # noqa: BLE001 - another rank left (its own attempt raised): its error is shown
            return {"rank": rank, "problem": f"raised {type(e).__name__}: {e}", "first": False}
        if stop:
            return {"rank": rank, "problem": problem}
    return {"rank": rank, "problem": None}


@contextlib.contextmanager
def _collectives_refused(dist):
    """torch.distributed's collectives raise while the attempt runs (point-to-point calls still work)."""
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def refuse(name):
        def refused(*args, **kwargs):
            raise _Refused(f"called dist.{name}; the exercise builds the all-reduce from point-to-point "
                           "messages (dist.isend / dist.irecv, or dist.send / dist.recv)")
        return refused

    for name in saved:
        setattr(dist, name, refuse(name))
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(dist, name, f)


# ----------------------------------------------------------------------------------------- ZeRO-1 step --

def check_zero1_step(fn, worlds=WORLDS, limit_s: float = LIMIT_S) -> Verdict:
    """Run ``opt = fn(params, lr)`` in every rank of each world: ``params`` are a small model's parameters
    (25 values, equal on every rank), each with ``.grad`` holding this rank's own gradient. Afterwards
    every rank's parameters must equal one ``torch.optim.AdamW(lr=lr)`` step on the full parameters with
    the gradients averaged over the ranks, and the returned optimizer must keep state for this rank's
    slice only: the ranks' states together cover the 25 values once."""
    lines, passed = [], True
    total = sum(math.prod(s) for s in ZERO1_SHAPES)
    for world in worlds:
        outcome = _in_ranks(_zero1_rank, world, limit_s, fn)
        if isinstance(outcome, str):
            lines.append(f"{world} ranks: {outcome}")
            passed = False
            continue
        bad = _worst(outcome)
        kept = [r["state"] for r in outcome]
        if bad is None and sum(kept) != total:
            bad = {"rank": max(range(world), key=lambda r: kept[r]),
                   "problem": f"the ranks' AdamW states cover {' + '.join(map(str, kept))} = {sum(kept)} values, "
                              f"the parameters have {total}: each rank keeps state for its own slice only, "
                              "and the slices cover every value once"}
        if bad is None:
            lines.append(f"{world} ranks: every rank's parameters are one AdamW step on the full parameters "
                         f"(averaged gradients); optimizer state per rank {', '.join(map(str, kept))} of {total}")
        else:
            passed = False
            lines.append(f"{world} ranks: rank {bad['rank']}: {bad['problem']}")
    return Verdict("ZeRO-1 step", passed, lines)


def _zero1_rank(fn):
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same parameters on every rank
    start = [torch.randn(s) for s in ZERO1_SHAPES]
    g = torch.Generator().manual_seed(100 * world + rank)  # this rank's own gradients
    local = [torch.randn(s, generator=g) for s in ZERO1_SHAPES]

    reference = [p.clone().requires_grad_() for p in start]
    for p, lg in zip(reference, local):
        p.grad = lg.clone()
        dist.all_reduce(p.grad)
        p.grad /= world
    torch.optim.AdamW(reference, lr=ZERO1_LR).step()

    params = [p.clone().requires_grad_() for p in start]
    for p, lg in zip(params, local):
        p.grad = lg.clone()
    try:
        opt = fn(params, ZERO1_LR)
    except Exception as e:  # noqa: BLE001 - the student's error, reported with its rank
        return _said({"rank": rank, "problem": f"raised {type(e).__name__}: {e}", "state": 0,
                      "first": not _peer_gone(e)})
    if not isinstance(opt, torch.optim.Optimizer):
        return {"rank": rank, "state": 0,
                "problem": f"returned {type(opt).__name__}, not the torch.optim.Optimizer that took the step"}
    state = sum(s["exp_avg"].numel() for s in opt.state.values() if "exp_avg" in s)
    flat = lambda ts: torch.cat([t.detach().flatten() for t in ts])  # noqa: E731
    problem = _first_difference(flat(params), flat(reference), flat(start), flat(start).numel(), exact=False,
                                reference="one AdamW step on the full parameters", shapes=ZERO1_SHAPES)
    if not problem and state == 0:
        problem = "its optimizer keeps no AdamW state (exp_avg): did it take the step?"
    return {"rank": rank, "problem": problem, "state": state}


# -------------------------------------------------------------------------------------------- shared --

#: how a rank whose attempt raised says so in its output: its partners may still wait for it (a receive with no
#: send), so the launch can end stopped, without any rank's result, and the verdict reads the rank's words there
SAID = "stnblab.exercises: rank "


def _said(result: dict) -> dict:
    _say(result["rank"], result["problem"])
    return result


def _say(rank, words: str) -> None:
    """One line of a rank's output, in one write: ranks share the launch's output, and ``print`` writes the text
    and its newline apart, so an unbuffered rank's line could end inside another's."""
    import os
    import sys

    line = f"{SAID}{rank}: {words}\n"
    sys.stdout.flush()
    try:
        os.write(sys.stdout.fileno(), line.encode())
    except (AttributeError, OSError, ValueError):  # a stream with no file behind it (a captured one)
        sys.stdout.write(line)
        sys.stdout.flush()


GAVE_UP = "did not finish in"


def _guarded(limit_s, rank_fn, fn, *args):
    """``rank_fn(fn, *args)`` in this rank, which gives up after ``limit_s`` seconds: it says so and exits (the
    other ranks, waiting for it, then fail or give up too)."""
    import os
    import threading

    import torch.distributed as dist

    rank = dist.get_rank()

    def give_up():
        _say(rank, f"{GAVE_UP} {limit_s:g} s")
        os._exit(3)

    timer = threading.Timer(limit_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        return rank_fn(fn, *args)
    finally:
        timer.cancel()


def _from_output(text: str) -> str | None:
    """Why a launch stopped without results, from what its ranks said: an attempt that raised (its partners
    then wait for it), or ranks that gave up waiting."""
    said = dict(re.findall(re.escape(SAID) + r"(\d+): (.*?)(?=" + re.escape(SAID) + "|$)", text, re.M))
    gave_up = sorted((r for r, why in said.items() if why.startswith(GAVE_UP)), key=int)
    raised = {r: why for r, why in said.items() if r not in gave_up and not _peer_gone(why)}
    if raised:  # its own attempt failed; the others only lost it
        rank = min(raised, key=int)
        return f"rank {rank}: {raised[rank]}; the other ranks waited for it until they were stopped"
    if gave_up:
        return (f"rank(s) {', '.join(gave_up)} {said[gave_up[0]]}: a receive whose send never comes (or a "
                "blocking send that no rank receives) waits forever")
    return None


def _any_rank(problem) -> bool:
    """True on every rank when any rank found a problem (an all-reduce of one flag)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if problem else 0.0])
    dist.all_reduce(flag)
    return bool(flag.item())


def _peer_gone(e: Exception) -> bool:
    """The error a rank gets when another rank left in the middle of an exchange (that rank's error is the
    one to show)."""
    text = str(e).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "peer"))


def _worst(outcome: list):
    """The rank to name: one whose own attempt failed before one that only lost its partner."""
    bad = [r for r in outcome if r["problem"]]
    return next((r for r in bad if r.get("first", True)), bad[0] if bad else None)


def _first_difference(got, expected, given, n, *, exact, reference, shapes=None) -> str | None:
    """None when ``got`` matches ``expected``; else a sentence naming the first element that differs."""
    import torch

    if tuple(got.shape) != tuple(expected.shape):
        return f"the result has shape {tuple(got.shape)}, {reference} gives {tuple(expected.shape)}"
    close = got == expected if exact else torch.isclose(got, expected, rtol=1e-5, atol=1e-6)
    if bool(close.all()):
        return None
    wrong = (~close).nonzero().flatten().tolist()
    i = wrong[0]
    where = f"element {i} of {n}" if shapes is None else _where(i, shapes)
    unchanged = " (unchanged from before the call)" if bool(got[i] == given[i]) else ""
    return (f"{where} is {got[i].item():.6g}{unchanged}, {reference} gives {expected[i].item():.6g} "
            f"({len(wrong)} of {n} values differ)")


def _where(i: int, shapes) -> str:
    """'element 13 of the flattened parameters (parameter 1 of shape (4,), index 1)'."""
    start = 0
    for k, shape in enumerate(shapes):
        size = math.prod(shape)
        if i < start + size:
            index = tuple(int(x) for x in _unravel(i - start, shape))
            return (f"element {i} of the {sum(math.prod(s) for s in shapes)} flattened parameters "
                    f"(parameter {k} of shape {tuple(shape)}, index {index if len(index) > 1 else index[0]})")
        start += size
    return f"element {i}"


def _unravel(i: int, shape) -> list:
    out = []
    for dim in reversed(shape):
        out.append(i % dim)
        i //= dim
    return list(reversed(out))


def _in_ranks(rank_fn, world: int, limit_s: float, fn, *args):
    """``rank_fn(fn, *args)`` in ``world`` CPU ranks: their results, or a sentence saying why there are none."""
    from stnb.errors import LaunchError
    from stnb.hardware import capacity_problem

    try:
        if capacity_problem("cpu", world) is None:
            import stnb

            return stnb.launch(_guarded, limit_s, rank_fn, fn, *args, num_processes=world, device="cpu",
                               echo=False, stall_timeout=STALL_S, timeout=TIMEOUT_S)
        from .parallel.oversubscribe import launch_oversubscribed

        return launch_oversubscribed(_by_value, _packed(limit_s, rank_fn, fn, args), num_processes=world,
                                     timeout=TIMEOUT_S)
    except LaunchError as e:
        logs = getattr(e, "logs", None) or {}
        said = _from_output("\n".join([str(e)] + [str(v) for _, v in sorted(logs.items())]))
        if said:
            return said
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"the ranks did not finish ({first[:300]}): a send with no matching receive waits forever"


def _packed(limit_s, rank_fn, fn, args) -> bytes:
    """The call, ``fn`` by value: defined in a notebook cell (``__main__``, which torchrun's ranks do not
    have) or in a module a fresh interpreter may not find (a test module)."""
    import sys

    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", None) or "__main__")
    by_module = module is not None and module.__name__ != "__main__"
    if by_module:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps((limit_s, rank_fn, fn, args))
    finally:
        if by_module:
            cloudpickle.unregister_pickle_by_value(module)


def _by_value(packed: bytes):
    import pickle

    limit_s, rank_fn, fn, args = pickle.loads(packed)
    return _guarded(limit_s, rank_fn, fn, *args)
