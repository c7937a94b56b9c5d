"""``python -m stnb gpu-check`` (``make gpu-check``): run every GPU code path the visible GPUs allow.

PLAN (``planning.plan``, a pure function of the machine) -> RUN (``checks.run_all``) -> REPORT
(``report.build``: JSON + a short table). Without a GPU it says why, runs nothing, marks nothing
passed and exits 0. Otherwise the exit status is 1 when any planned check failed.

1 GPU: hardware report, an NCCL all_reduce, ``single`` in bf16 and fp16, ``fsdp`` with one NCCL rank
(``ddp`` with one rank is listed as not run: accelerate wraps DDP only with 2+ processes), the launch fault matrix on NCCL ranks (a rank raises / is SIGKILLed / stalls in a
collective: the error arrives in seconds and no process is left), notebook 00's cells, plain
sentence-transformers vs ``stnb.run(strategy="single")`` (goal stnb >= 0.98 of plain) and the
``bench --preset st-docs`` single-GPU row. 2+ GPUs add ``dp``, ``ddp``/``fsdp`` over every GPU, the
fp16 / bf16 / embedding_rows comm hooks and the speed-up table, in bf16 (fp16 on GPUs without bf16: T4). Under 8 minutes on one GPU.
"""

from __future__ import annotations

import os
import sys
import time

from .planning import BUDGET_S, GPU_BOUND_BUDGET_S, Check, Machine, cpu_plan, detect, plan
from .report import Outcome, build, exit_code, plan_table, table, write

__all__ = ["Check", "Machine", "Outcome", "build", "detect", "exit_code", "gpu_check", "plan", "plan_table", "table",
           "write"]

DEFAULT_REPORT = os.path.join("artifacts", "gpu-check", "report.json")


def only(checks: list, names) -> list:
    """The planned checks whose name contains one of ``names`` (case-insensitive), and the hardware row;
    every check when ``names`` is empty."""
    if not names:
        return checks
    want = [n.lower() for n in names]
    return [c for c in checks if c.kind == "hardware" or any(n in c.name.lower() for n in want)]


def gpu_check(report_path: str = DEFAULT_REPORT, budget_s: float | None = None, echo: bool = True,
              cpu: bool = False, rows=(), gpu_bound: bool = False) -> dict:
    """PLAN, RUN, REPORT; returns the report (also written to ``report_path``). ``cpu``: the CPU rows
    (``planning.cpu_plan``: gloo ranks, the tiny model) instead of the GPU plan; they say nothing about a GPU."""
    import torch  # noqa: F401  (imported first, so stnb notes whichever call starts CUDA in this process:

    from stnb.processes.forksafe import watch_cuda_start

    watch_cuda_start()  # a refusal to fork then names it; on the first GPU run nothing was watched)
    say = print if echo else None
    started = time.time()
    machine = detect()
    checks = only(cpu_plan(machine) if cpu else plan(machine, gpu_bound), rows)
    if budget_s is None:
        budget_s = BUDGET_S + (GPU_BOUND_BUDGET_S if gpu_bound else 0.0)
    if say and rows:
        say(f"stnb gpu-check --only {' '.join(rows)}: {len(checks)} row(s)", flush=True)
    if say and cpu:
        say(f"stnb gpu-check --cpu: {len(checks)} CPU rows (gloo ranks, tiny model), no GPU used", flush=True)
    if say and machine.gpus:
        say(f"stnb gpu-check: {len(machine.gpus)} GPU(s); {len(checks)} checks planned, "
            f"{sum(1 for c in checks if c.skip)} not applicable here; budget {budget_s:g} s", flush=True)
    outcomes = []
    if checks:
        from .checks import run_all

        outcomes = run_all(checks, machine, deadline=started + budget_s,
                           echo=(lambda line: print(line, flush=True)) if say else None,
                           after=lambda done: write(build(machine, checks, done, started, time.time()), report_path))
    rep = build(machine, checks, outcomes, started, time.time())
    if cpu:
        c = rep["counts"]
        rep["verdict"] = (f"CPU rows (no GPU used): {c['passed']} passed, {c['failed'] + len(rep['not_run'])} failed, "
                          f"{c['skipped']} not run" + (" -- FAILED" if exit_code(rep) else ""))
    rep["report_path"] = os.path.abspath(report_path)
    write(rep, report_path)
    return rep


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("gpu-check", help="run every GPU code path the visible GPUs allow; JSON report + table",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--report", default=DEFAULT_REPORT, help=f"JSON report path (default {DEFAULT_REPORT})")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds after which no further check starts (those fail as not started); default "
                        f"{BUDGET_S:g}, {BUDGET_S + GPU_BOUND_BUDGET_S:g} with --gpu-bound")
    p.add_argument("--gpu-bound", action="store_true",
                   help="add the GPU-bound rows: plain sentence-transformers vs stnb on mpnet-base's shape at seq 256 "
                        "(5 interleaved runs each), and the MFU of what the stack offers (about 10 minutes on an H200)")
    p.add_argument("--plan", action="store_true", help="print the rows this machine would run (and why any would "
                   "not), run nothing")
    p.add_argument("--cpu", action="store_true", help="run the CPU rows instead (gloo ranks, the tiny model, a few "
                   "steps): the same checks' code in this environment, e.g. after installing the GPU kit")
    p.add_argument("--only", nargs="+", default=(), metavar="TEXT",
                   help="run only the rows whose name contains one of these (and the hardware row)")
    p.set_defaults(func=cmd_gpu_check)


def cmd_gpu_check(a) -> int:
    if a.plan:
        machine = detect()
        print(plan_table(machine, only(cpu_plan(machine) if a.cpu else plan(machine, a.gpu_bound), a.only)))
        return 0
    rep = gpu_check(a.report, a.budget, cpu=a.cpu, rows=a.only, gpu_bound=a.gpu_bound)
    print(table(rep))
    print(f"report: {rep['report_path']}")
    sys.stdout.flush()
    return exit_code(rep)
