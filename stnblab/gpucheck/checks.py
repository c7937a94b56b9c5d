"""RUN: one function per kind of check; each returns an ``Outcome`` and never raises.

This process is the parent of every rank (like a notebook kernel): it never touches CUDA itself.
GPU work happens in stnb.launch / stnb.run children, in a plain script subprocess, or in the
Jupyter kernel that runs notebook 00. A check's ``params['device']`` (default 'cuda') lets the
tests run the same functions with gloo ranks on CPU.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
import traceback

from stnb.strategies import baseline_name, is_distributed
from stnb.timesplit import problems as split_problems

from ..splitbench import time_split
from .gpubound import check_mfu, check_shared, plain_run
from .planning import BUDGET_OVER_RUNTIME, BUDGET_OVER_STATE, BUDGET_ROOMY_GIB, FAULT_STALL_S, FAULT_TO_ERROR_S
from .ranks import raise_after_collective, rank_pids, sigkill_after_collective, stall_in_collective
from .report import Outcome


def _result_metrics(res, gpus: int) -> dict:
    """The numbers the table shows, from a RunResult."""
    mfu = res.mfu or {}
    cfg = res.config or {}
    return {"samples_per_second": res.samples_per_second, "mfu": mfu.get("mfu"),
            "achieved_tflops": mfu.get("achieved_tflops"), "peak_tflops": mfu.get("peak_tflops"),
            "peak_source": mfu.get("peak_source"), "tokens_per_sample": mfu.get("tokens_per_sample"),
            "peak_memory_bytes": max(res.peak_memory_bytes) if res.peak_memory_bytes else None,
            "wall_time_s": res.wall_time_s, "strategy": res.strategy, "gpus": gpus,
            "precision": cfg.get("mixed_precision"), "device": res.device, "verified": res.verified,
            "final_loss": res.losses[-1] if res.losses else None}


def _dev(check) -> str:
    return check.params.get("device", "cuda")


def _judge_training(res, check) -> list:
    """Why a finished training run does not count as a pass on the GPU (empty: it passes)."""
    problems = []
    device = _dev(check)
    if res.status != "ok":
        problems.append(f"status {res.status}: {res.reason}")
    if not res.verified:
        problems.append(f"not verified: {json.dumps(res.verification, default=str)[:300]}")
    if res.device != device:
        problems.append(f"ran on {res.device}, not on {device}")
    if not res.samples_per_second:
        problems.append("no measured samples/s")
    if not res.losses or not all(math.isfinite(x) for x in res.losses):
        problems.append(f"losses not finite: {res.losses[-3:] if res.losses else res.losses}")
    if check.params.get("strategy") and is_distributed(check.params["strategy"]):
        backends = {r.get("backend") for r in res.verification.get("ranks", [])}
        want = "nccl" if device == "cuda" else "gloo"
        if backends != {want}:
            problems.append(f"process group backend {sorted(map(str, backends))}, expected {want}")
    if device == "cuda" and res.status == "ok":  # the split on NCCL ranks: CUDA events that add up
        methods = {(s or {}).get("method") for s in res.time_split or [None]}
        if methods != {"CUDA events"}:
            problems.append(f"time split measured by {sorted(map(str, methods))}, expected CUDA events")
        problems.extend(f"time split: {p}" for p in split_problems(res))
    return problems


def train_config(params: dict):
    """The TrainConfig a training row runs (device cuda unless the row says otherwise)."""
    from stnb.config import TrainConfig

    keep = {k: v for k, v in params.items() if k not in ("goal", "repeats", "build", "long_words")}
    keep.setdefault("device", "cuda")
    return TrainConfig(**keep)


def check_hardware(check, machine) -> Outcome:
    import torch

    from stnb.hardware import gpu_count, report

    problems = []
    if check.params.get("unsupported"):
        problems.append(f"this torch build ({torch.__version__}, {' '.join(machine.arch_list)}) has no kernels for "
                        f"{', '.join(check.params['unsupported'])}: install a torch build for it, or use another GPU")
    n = gpu_count()
    if n != len(machine.gpus):
        problems.append(f"hardware.gpu_count() = {n} but {len(machine.gpus)} GPU(s) were listed")
    rep = report()
    if rep.device != "cuda" or rep.backend != "nccl":
        problems.append(f"stnb.hardware_report() says device {rep.device}, backend {rep.backend}")
    if torch.cuda.is_initialized():
        problems.append("CUDA got initialised in this (parent) process: forked ranks would fail")
    names = ", ".join(f"{g['name']} (cc {'.'.join(map(str, g['compute_capability'] or ['?']))})" for g in machine.gpus)
    return Outcome(check.name, check.kind, "failed" if problems else "passed", detail=names,
                   error="; ".join(problems))


def check_allreduce(check, machine) -> Outcome:
    from stnb import examples
    from stnb.processes import last_launch, launch

    n = check.params["nproc"]
    sums = launch(examples.allreduce_check, num_processes=n, device=_dev(check), timeout=120, echo=False)
    bad = [s for s in sums if s["sum"] != s["expected"]]
    backend = last_launch().backend
    ok = not bad and len(sums) == n and backend == ("nccl" if _dev(check) == "cuda" else "gloo")
    return Outcome(check.name, check.kind, "passed" if ok else "failed",
                   detail=f"{n} rank(s), backend {backend}, sum {sums[0]['sum']:g}",
                   error="" if ok else f"unexpected: {sums}, backend {backend}")


def check_train(check, machine) -> Outcome:
    """One training row; ``save_to: True`` saves into a temporary folder (stnb's save check runs)."""
    import dataclasses

    from stnb.runner import run

    cfg = train_config(check.params)
    with tempfile.TemporaryDirectory(prefix="stnb-gpucheck-save-") as tmp:
        if check.params.get("save_to") is True:
            cfg = dataclasses.replace(cfg, save_to=os.path.join(tmp, "model"))
        res = run(cfg, echo=False)
        problems = _judge_training(res, check) + _save_problems(res, check)
    gpus = check.gpus
    return Outcome(check.name, check.kind, "failed" if problems else "passed", metrics=_result_metrics(res, gpus),
                   detail=f"{res.strategy} x{res.world_size}, {res.steps} steps, loss {res.losses[0]:.4f} -> "
                          f"{res.losses[-1]:.4f}" if res.losses else "", error="; ".join(problems))


def _save_problems(res, check) -> list:
    if not check.params.get("save_to"):
        return []
    saved = (res.verification or {}).get("saved_model") or {}
    if not saved.get("saved_to") or not os.path.isdir(saved["saved_to"]):
        return [f"save_to: nothing saved ({json.dumps(saved, default=str)[:200]})"]
    return []


def check_train_build(check, machine) -> Outcome:
    """A CrossEncoder / SparseEncoder row: stnb.run(build) with sentence-transformers' own trainer for it."""
    import functools

    from stnb.models import resolve_model
    from stnb.runner import run
    from .builds import BUILDS

    p = check.params
    with tempfile.TemporaryDirectory(prefix="stnb-gpucheck-build-") as tmp:
        build = functools.partial(BUILDS[p["build"]], os.path.join(tmp, "out"), resolve_model(p["model"]), p)
        res = run(build, strategy=p["strategy"], device=_dev(check), timeout=p["timeout"],
                  stall_timeout=p["stall_timeout"], save_to=os.path.join(tmp, "model"), echo=False)
        problems = _judge_training(res, check) + _save_problems(res, dict_check(check, save_to=True))
    return Outcome(check.name, check.kind, "failed" if problems else "passed", metrics=_result_metrics(res, 1),
                   detail=f"{p['build']}: {res.dev_metric} {res.dev_metric_before} -> {res.dev_metric_after}, saved and reloaded"
                   if not problems else "", error="; ".join(problems))


def dict_check(check, **params):
    from .planning import Check

    return Check(check.name, check.kind, dict(check.params, **params), check.gpus, check.skip)


def check_train_direct(check, machine) -> Outcome:
    """fsdp with ONE NCCL rank. TrainConfig.validate refuses it for users (a 1-rank fsdp "shards
    nothing"; stnb.hardware lists ddp/fsdp as needing 2 ranks), so this runs what stnb.run would run
    after validation, through the same pipeline (``stnb.launchers.execute``) with the ``Unchecked`` launcher:
    stnb.launch(training.train_rank, ...) on 1 GPU with a process group, then ``finish``. It exercises NCCL
    init, FSDP2's sharding and the trainer on CUDA. (The plan does not run 1-rank ddp: planning.ONE_RANK_DDP.)"""
    from stnb.builds import RecipeBuild
    from stnb.launchers import Plan, execute

    from ..launchers import Unchecked

    res = execute(Plan(train_config(check.params), RecipeBuild(), echo=False), Unchecked())
    problems = _judge_training(res, check)
    wrapper = res.verification["ranks"][0].get("wrapper")
    return Outcome(check.name, check.kind, "failed" if problems else "passed", metrics=_result_metrics(res, 1),
                   detail=f"wrapper {wrapper}, backend {res.verification['ranks'][0].get('backend')}",
                   error="; ".join(problems))


_FAULTS = {"raise": (raise_after_collective, "raised"), "kill": (sigkill_after_collective, "killed"),
           "stall": (stall_in_collective, "stalled")}


def _descendants() -> set:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def check_fault(check, machine) -> Outcome:
    """Provoke one fault in NCCL ranks (gloo ranks sharing a GPU with ``share_gpus``); the error must name it
    within seconds and leave no process."""
    import psutil

    from stnb.errors import LaunchError
    from stnb.processes import launch

    fn, kind = _FAULTS[check.params["fault"]]
    n = check.params["nproc"]
    bad = min(1, n - 1)
    limit = FAULT_STALL_S if kind == "stalled" else 0.0
    with tempfile.TemporaryDirectory(prefix="stnb-gpucheck-") as tmp:
        mark = os.path.join(tmp, "fault.mark")
        before = _descendants()
        t_call = time.time()
        error = None
        try:
            launch(fn, mark, num_processes=n, device=_dev(check), echo=False, timeout=120,
                   stall_timeout=FAULT_STALL_S if kind == "stalled" else 60.0,
                   share_gpus=check.params.get("share_gpus", False))
        except BaseException as e:  # noqa: BLE001 - the error is what is measured
            error = e
        t_err = time.time()
        try:
            with open(mark) as f:
                t_fault = float(f.read())
        except (OSError, ValueError):
            t_fault = None
        left = sorted(_descendants() - before)
        pids = rank_pids(mark)
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    problems = []
    if error is None:
        problems.append("the launch returned normally: the fault went unnoticed")
    elif not isinstance(error, LaunchError):
        problems.append(f"raised {type(error).__name__} instead of LaunchError: {error}")
    else:
        if error.kind != kind:
            problems.append(f"error kind {error.kind!r}, expected {kind!r}")
        if kind != "stalled" and error.rank != bad:
            problems.append(f"the error names rank {error.rank}, but rank {bad} faulted")
    to_error = None if t_fault is None else round(t_err - t_fault - limit, 2)
    if t_fault is None:
        problems.append("the faulting rank never reached its fault (no mark)")
    elif to_error > FAULT_TO_ERROR_S:
        problems.append(f"the error came {to_error} s after the fault{' and the stall limit' if limit else ''} "
                        f"(limit {FAULT_TO_ERROR_S:g} s)")
    if left or alive:
        problems.append(f"processes left behind: descendants {left}, rank pids alive {alive}")
    if len(pids) != n:
        problems.append(f"{len(pids)} of {n} rank(s) started")
    first = str(error).splitlines()[0] if error is not None else ""
    return Outcome(check.name, check.kind, "failed" if problems else "passed",
                   metrics={"time_to_error_s": to_error, "processes_left": len(left) + len(alive),
                            "launch_s": round(t_err - t_call, 2)},
                   detail=f"{to_error} s fault -> error{' (after the stall limit)' if limit else ''}, "
                          f"0 processes left: {first[:160]}" if not problems else first[:200],
                   error="; ".join(problems))


def _budget_records(res) -> list:
    """Each rank's ``memory_budget`` record (a one-process run's verification is its rank's)."""
    return [(v or {}).get("memory_budget") or {} for v in (res.verification.get("ranks") or [res.verification])]


def check_budget(check, machine) -> Outcome:
    """A memory budget per rank (``memory_budget_gib``, stnb.budget): with room the run trains verified, the limit
    in every rank's record; under a budget that holds the model state but not the training a rank fails as out of
    memory, named, and no process is left. On a GPU the allocator's fraction enforces it and the tight budget is
    ``BUDGET_OVER_STATE`` times the model state the prediction counts (activations do not fit beside it); on CPU
    (RLIMIT_DATA, the whole process) it is ``BUDGET_OVER_RUNTIME`` over what a rank's runtime held when its limit
    was applied (tests/test_memory_budget.py's rule)."""
    from stnb import budget
    from stnb.errors import LaunchError
    from stnb.runner import run

    cuda = _dev(check) == "cuda"
    roomy = train_config(dict(check.params, memory_budget_gib=BUDGET_ROOMY_GIB))
    res = run(roomy, echo=False)
    problems = _judge_training(res, check)
    records = _budget_records(res)
    if [r.get("limit_bytes") for r in records] != [int(BUDGET_ROOMY_GIB * 2**30)] * len(records):
        problems.append(f"with room, the ranks' budget records are {records}, not the limit asked")
    if problems:
        return Outcome(check.name, check.kind, "failed", error="; ".join(problems))
    if cuda:
        # the refusal's own prediction (the config's options counted), so the tight budget is never refused
        tight = BUDGET_OVER_STATE * budget.predicted(roomy, res.verification["model_shape"], roomy.strategy,
                                                     res.world_size)["total"]
    else:
        tight = max(r["held_at_start"] for r in records) + BUDGET_OVER_RUNTIME
    gib = math.ceil(tight / 2**30 * 1e4) / 1e4  # never below what was asked: under the model state it is refused
    before = _descendants()
    error = None
    try:
        run(train_config(dict(check.params, memory_budget_gib=gib)), echo=False)
        problems.append(f"trained under memory_budget_gib={gib:g}: the budget was not enforced")
    except LaunchError as e:
        error = e
        if e.kind != "out_of_memory" or "ran out of its memory budget" not in str(e):
            problems.append(f"failed as {e.kind!r}, not as running out of its budget: {str(e)[:300]}")
    except Exception as e:  # noqa: BLE001 - a refusal or a crash is the finding
        problems.append(f"raised {type(e).__name__} instead of LaunchError: {str(e)[:300]}")
    left = sorted(_descendants() - before)
    if left:
        problems.append(f"processes left behind: {left}")
    first = str(error).splitlines()[0] if error is not None else ""
    return Outcome(check.name, check.kind, "failed" if problems else "passed",
                   metrics={"budget_gib": gib, "processes_left": len(left)},
                   detail=f"trained under {BUDGET_ROOMY_GIB:g} GiB, the limit in every rank; under {gib:g} GiB: "
                          f"{first[:200]}", error="; ".join(problems))


def check_notebook(check, machine) -> Outcome:
    """Every cell of notebook 00 in a fresh Jupyter kernel (nbclient), as nbval runs it in the tests."""
    import nbformat
    from nbclient import NotebookClient

    path = check.params["path"]
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(path)}})
    client.execute()  # raises CellExecutionError naming the cell that failed
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    backend = "nccl" if any("nccl" in "".join(o.get("text", "")) for c in code for o in c.get("outputs", [])) else "?"
    return Outcome(check.name, check.kind, "failed" if errors else "passed",
                   detail=f"{len(code)} code cells ran (backend seen in outputs: {backend})",
                   error="; ".join(f"{e['ename']}: {e['evalue']}" for e in errors))


def check_ratio(check, machine) -> Outcome:
    """Plain sentence-transformers and stnb.run(strategy='single'), same model, data, batch, precision
    and logging (every step, as stnb's recipe logs), interleaved (plain, stnb, stnb without its time split,
    then the reverse order). The ratio is that of the median step times, pooled over the measured steps of
    every repeat (a median is not moved by the odd slow step: a collection, a first-time kernel). The third
    arm (``STNB_TIME_SPLIT=off``) says how much of a gap the time split's marks and hooks make.
    ``long_words``: every arm trains on texts of that many words (``gpubound.long_pairs_file``), so each
    sequence fills max_seq_length: the GPU-bound row; each arm's MFU is reported (the median of its runs)."""
    with tempfile.TemporaryDirectory(prefix="stnb-gpucheck-ratio-") as tmp:
        if check.params.get("long_words"):
            from .gpubound import long_pairs_file

            data = long_pairs_file(tmp, check.params["train_size"] + check.params["dev_size"], check.params["long_words"])
            check = dict_check(check, data=data)
        return _ratio(check)


def _ratio(check) -> Outcome:
    from stnb.models import resolve_model
    from stnb.runner import run

    p = check.params
    cfg = train_config(p)
    model_path = resolve_model(cfg.model)
    warm = p["warmup_steps_excluded"]
    runs, steps, logged = ({k: [] for k in RATIO_ARMS} for _ in range(3))
    last, methods, levels, mfus = None, {}, {k: [] for k in RATIO_ARMS}, {k: [] for k in RATIO_ARMS}
    tokens = {}  # padded tokens a sample, per arm (the long texts fill max_seq_length in every arm)
    for i in range(p["repeats"]):
        for who in (RATIO_ARMS if i % 2 == 0 else RATIO_ARMS[::-1]):
            if who == "plain":
                data = plain_run(p, model_path)
                runs[who].append(data["samples_per_second"])
                steps[who] += data["step_times"]
                logged[who].append(data["logged_steps"])
                levels[who].append(statistics.median(data["step_times"]))
                mfus[who].append(data.get("mfu"))
                tokens[who] = data.get("tokens_per_sample")
                continue
            with time_split(who == "stnb"):
                result = run(cfg, echo=False)
            problems = _judge_training(result, check) if who == "stnb" else []
            if problems:
                return Outcome(check.name, check.kind, "failed", error="stnb run: " + "; ".join(problems))
            last = result if who == "stnb" else last
            methods[who] = (result.time_split[0] or {}).get("method") if result.time_split else None
            runs[who].append(result.samples_per_second)
            steps[who] += result.step_times[warm:]
            levels[who].append(statistics.median(result.step_times[warm:]))
            logged[who].append(len(result.losses))
            mfus[who].append((result.mfu or {}).get("mfu"))
            tokens[who] = (result.mfu or {}).get("tokens_per_sample")
    batch = p["per_device_batch_size"]
    arm_mfu = {k: statistics.median(v) if v and None not in v else None for k, v in mfus.items()}
    sps = {k: batch / statistics.median(v) for k, v in steps.items()}
    ratio = sps["stnb"] / sps["plain"]
    metrics = dict(_result_metrics(last, 1), samples_per_second=sps["stnb"], ratio=ratio,
                   plain_samples_per_second=sps["plain"], split_off_samples_per_second=sps["stnb_split_off"],
                   split_off_ratio=sps["stnb_split_off"] / sps["plain"], stnb_runs=runs["stnb"],
                   plain_runs=runs["plain"], split_off_runs=runs["stnb_split_off"],
                   measured_steps={k: len(v) for k, v in steps.items()}, logged_steps=logged,
                   time_split_methods=methods, run_median_steps=levels, noise=ratio_noise(levels),
                   arm_mfu=arm_mfu, run_mfu=mfus, arm_tokens_per_sample=tokens, pair_ratios=pair_ratios(levels),
                   split_off_pair_ratios=pair_ratios(levels, "stnb_split_off"))
    status, error = ratio_verdict(ratio, metrics["noise"], p["goal"], metrics["pair_ratios"])
    noise = "unknown (one run per arm)" if metrics["noise"] is None else f"{metrics['noise']:.1%}"
    if len(metrics["pair_ratios"]) >= PAIRED_MIN:
        noise += (f"; {len(metrics['pair_ratios'])} interleaved pairs: "
                  f"{min(metrics['pair_ratios']):.3f}-{max(metrics['pair_ratios']):.3f}")
    return Outcome(check.name, check.kind, status, metrics=metrics,
                   detail=f"stnb / plain = {ratio:.3f} (goal >= {p['goal']}; median step of {len(steps['stnb'])} / "
                          f"{len(steps['plain'])} measured steps: {sps['stnb']:.1f} vs {sps['plain']:.1f} samples/s; "
                          f"time split off: {metrics['split_off_ratio']:.3f}; run-to-run noise {noise}"
                          + (f"; MFU plain {arm_mfu['plain']:.1%}, stnb {arm_mfu['stnb']:.1%}, split off "
                             f"{arm_mfu['stnb_split_off']:.1%}" if None not in arm_mfu.values() else "") + ")",
                   error=error)


def ratio_noise(levels: dict) -> float | None:
    """How far identical runs of one arm disagree: the largest (slowest / fastest) - 1 of the runs' median
    step times over the arms; None where an arm ran once (nothing to compare)."""
    if not levels or any(len(v) < 2 for v in levels.values()):
        return None
    return max(max(v) / min(v) - 1 for v in levels.values())


def ratio_verdict(ratio: float, noise: float | None, goal: float, pairs: list | None = None) -> tuple:
    """(status, error) of a speed ratio. With ``PAIRED_MIN`` or more interleaved pairs (``pair_ratios``:
    each repeat's stnb / plain, run next to each other), the pairs decide: passed when the slowest pair
    meets the goal, failed when even the fastest misses it, else inconclusive ([min, max] of 5 pairs holds
    the median pair's ratio with 1 - 2 / 2**5 = 94 % confidence, whatever their distribution). With fewer
    pairs, ``noise`` (``ratio_noise``) decides: passed when even a ratio ``noise`` lower meets the goal,
    failed when even one ``noise`` higher misses it, else inconclusive (fail closed: a ratio inside the
    noise is not a pass). Unknown noise decides only a goal of 0."""
    if goal <= 0:
        return "passed", ""
    if pairs and len(pairs) >= PAIRED_MIN:
        low, high = min(pairs), max(pairs)
        if low >= goal:
            return "passed", ""
        if high < goal:
            return "failed", f"stnb / plain = {ratio:.3f} < {goal}: all {len(pairs)} interleaved pairs missed it (best {high:.3f})"
        return "inconclusive", (f"stnb / plain = {ratio:.3f}, but its {len(pairs)} interleaved pairs range over "
                                f"{low:.3f}-{high:.3f}, across the goal ({goal}); rerun on an idle machine")
    if noise is None:
        return "inconclusive", f"stnb / plain = {ratio:.3f}: one run per arm, so its noise is unknown"
    if ratio / (1 + noise) >= goal:
        return "passed", ""
    if ratio * (1 + noise) < goal:
        return "failed", f"stnb / plain = {ratio:.3f} < {goal} (beyond the runs' noise of {noise:.1%})"
    return "inconclusive", (f"stnb / plain = {ratio:.3f}, but identical runs differed by {noise:.1%}: the goal "
                            f"({goal}) is inside the noise; rerun on an idle machine")


def pair_ratios(levels: dict, arm: str = "stnb") -> list:
    """Each repeat's speed ratio ``arm`` / plain from the runs' median step times (``levels``: the runs
    of repeat i of every arm ran next to each other, interleaved): plain's step over the arm's."""
    return [p / s for p, s in zip(levels.get("plain", []), levels.get(arm, []))]


#: interleaved pairs from which the pairs alone decide the ratio row (``ratio_verdict``)
PAIRED_MIN = 5


#: the ratio row's arms: plain sentence-transformers, stnb, stnb with its time split off (STNB_TIME_SPLIT=off)
RATIO_ARMS = ("plain", "stnb", "stnb_split_off")


def st_docs_options(check, folder: str):
    """The bench options of the st-docs row: its single row, on the check's device (never 'auto': on
    one GPU, bench's 'auto' compares on CPU ranks), results kept in ``folder``."""
    from stnblab import bench

    opts = bench.BenchOptions.from_preset("st-docs", strategies=(baseline_name(),), steps=check.params["steps"],
                                          warmup=check.params["warmup"], device=_dev(check),
                                          results=os.path.join(folder, "r.jsonl"),
                                          report=os.path.join(folder, "r.html"))
    opts.echo = False
    return opts


def check_st_docs(check, machine) -> Outcome:
    """The sentence-transformers docs' benchmark setting, offline: bench --preset st-docs, single row."""
    from stnblab import bench
    from stnb.results import RunResult, load_results

    with tempfile.TemporaryDirectory(prefix="stnb-gpucheck-st-docs-") as tmp:
        rep = bench.bench(st_docs_options(check, tmp))
        rows = [RunResult.from_dict(r) for r in load_results(rep.results_path, as_frame=False)]
    if len(rows) != 1:
        return Outcome(check.name, check.kind, "failed", error=f"{len(rows)} result rows, expected 1")
    res = rows[0]
    problems = _judge_training(res, check)
    return Outcome(check.name, check.kind, "failed" if problems else "passed", metrics=_result_metrics(res, 1),
                   detail=f"{res.model}, max_seq_length {res.config.get('max_seq_length')}, batch "
                          f"{res.per_device_batch_size}, loss {res.config.get('loss')} on synthetic NLI + STS stand-ins "
                          "(not MultiNLI / SNLI / STSB)", error="; ".join(problems))


RUNNERS = {"mfu": check_mfu, "shared": check_shared, "hardware": check_hardware, "allreduce": check_allreduce, "train": check_train,
           "train_direct": check_train_direct, "train_build": check_train_build, "fault": check_fault, "budget": check_budget,
           "notebook": check_notebook,
           "ratio": check_ratio, "st_docs": check_st_docs}


def run_all(checks: list, machine, deadline: float, echo=print, after=None) -> list:
    """Run the planned checks in order; a check not started before ``deadline`` fails as not started.
    ``after(outcomes)``: called after each check (gpu-check writes the report so far: a run stopped from
    outside keeps the rows it finished)."""
    outcomes = []
    for i, check in enumerate(checks, 1):
        t0 = time.time()
        if check.skip:
            out = Outcome(check.name, check.kind, "skipped", detail=check.skip)
        elif t0 > deadline:
            out = Outcome(check.name, check.kind, "failed", error="not started: the time budget was spent")
        else:
            try:
                out = RUNNERS[check.kind](check, machine)
            except BaseException as e:  # noqa: BLE001 - a crashed check is a failed row; Ctrl-C still stops
                if isinstance(e, KeyboardInterrupt):
                    raise
                out = Outcome(check.name, check.kind, "failed",
                              error=f"{type(e).__name__}: {e}".strip()[:3000],
                              detail=traceback.format_exc()[-3000:])
        out.seconds = round(time.time() - t0, 1)
        outcomes.append(out)
        if after:
            after(outcomes)
        if echo:
            echo(f"[{i}/{len(checks)}] {check.name:<46} {out.status.upper():<8} {out.seconds:6.1f} s  "
                 f"{(out.error or out.detail).splitlines()[0][:90] if (out.error or out.detail) else ''}")
    return outcomes
