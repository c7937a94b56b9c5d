"""REPORT: the gpu-check's outcomes as one JSON document and a short table (pure functions)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

#: inconclusive: ran, but what it measured cannot tell pass from fail (a speed ratio inside the run-to-run
#: noise of its own repeats); never counted as passed, and gpu-check exits 1 on it (fail closed)
STATUSES = ("passed", "failed", "skipped", "inconclusive")


@dataclass
class Outcome:
    """What one check did. ``status``: passed | failed | skipped (not applicable here, with the reason) |
    inconclusive (it ran; its measurement cannot decide)."""

    name: str
    kind: str
    status: str
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)   # samples_per_second, mfu, peak_memory_bytes, ratio, ...
    detail: str = ""
    error: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def speedups(outcomes: list) -> list:
    """[{name, strategy, gpus, samples_per_second, speedup, efficiency}] of the passed multi-GPU
    training rows against the passed single-GPU row of the same precision."""
    from stnb.strategies import baseline_name

    base_name = baseline_name()
    singles = {o.metrics.get("precision"): o.metrics["samples_per_second"] for o in outcomes
               if o.status == "passed" and o.metrics.get("strategy") == base_name and o.metrics.get("samples_per_second")
               and o.kind == "train"}
    rows = []
    for o in outcomes:
        m = o.metrics
        if (o.status != "passed" or o.kind != "train" or m.get("strategy") in (None, base_name)
                or not m.get("samples_per_second") or (m.get("gpus") or 1) < 2):
            continue
        base = singles.get(m.get("precision"))
        rows.append({"name": o.name, "strategy": m["strategy"], "gpus": m["gpus"],
                     "samples_per_second": m["samples_per_second"],
                     "speedup": m["samples_per_second"] / base if base else None,
                     "efficiency": m["samples_per_second"] / base / m["gpus"] if base else None})
    return rows


def build(machine, checks: list, outcomes: list, started: float, finished: float) -> dict:
    """The report: the machine, the plan, every outcome, the speed-up table and the counts."""
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    planned = {c.name for c in checks}
    missing = sorted(planned - {o.name for o in outcomes})
    if not machine.gpus:
        verdict = f"no GPU: {machine.no_gpu_reason}. Nothing was run; no check passed."
    elif counts["failed"] or missing:
        verdict = f"{counts['failed'] + len(missing)} of {len(checks)} planned check(s) FAILED"
    elif counts["inconclusive"]:
        verdict = (f"{counts['passed']} check(s) passed, {counts['inconclusive']} INCONCLUSIVE (the measurement "
                   "could not decide: see its row)")
    else:
        verdict = (f"all {counts['passed']} runnable check(s) passed"
                   + (f" ({counts['skipped']} skipped, each with its reason)" if counts["skipped"] else ""))
    return {
        "stnb_gpu_check": 1,
        "machine": machine.to_dict(),
        "planned": [c.to_dict() for c in checks],
        "outcomes": [o.to_dict() for o in outcomes],
        "not_run": missing,
        "speedups": speedups(outcomes),
        "counts": counts,
        "verdict": verdict,
        "started": started,
        "seconds": round(finished - started, 1),
    }


def exit_code(report: dict) -> int:
    """1 when any planned check failed, did not run or could not decide; 0 otherwise (also without a GPU)."""
    counts = report["counts"]
    return 1 if counts["failed"] or counts.get("inconclusive") or report["not_run"] else 0


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def table(report: dict) -> str:
    """The short text table printed on stdout."""
    m = report["machine"]
    gpus = ", ".join(f"{g['name']}" for g in m["gpus"]) or "none"
    lines = [f"stnb gpu-check: GPUs: {gpus} (torch CUDA {m['torch_cuda'] or 'none: CPU-only build'})"]
    if report["outcomes"]:
        head = f"{'check':<46}{'status':<9}{'samples/s':>10}{'MFU':>7}{'peak GiB':>10}{'time s':>8}  note"
        lines += [head, "-" * len(head)]
        for o in report["outcomes"]:
            mt = o["metrics"]
            mfu = mt.get("mfu")
            peak = mt.get("peak_memory_bytes")
            note = o["error"] or o["detail"]
            note = note.splitlines()[0] if note else ""
            lines.append(f"{o['name'][:45]:<46}{o['status'].upper():<9}{_f(mt.get('samples_per_second'), '.1f'):>10}"
                         f"{'-' if mfu is None else format(mfu, '.1%'):>7}"
                         f"{'-' if peak is None else format(peak / 2 ** 30, '.2f'):>10}{o['seconds']:>8.1f}  {note[:110]}")
    for name in report["not_run"]:
        lines.append(f"{name[:45]:<46}{'FAILED':<9} not run")
    if report["speedups"]:
        lines.append("speed-up vs single GPU (same precision):")
        for r in report["speedups"]:
            lines.append(f"  {r['name']:<40} {r['samples_per_second']:>9.1f} samples/s  {_f(r['speedup'], '.2f')}x"
                         f"  efficiency {_f(r['efficiency'], '.2f')}")
    lines.append(f"verdict: {report['verdict']}  ({report['seconds']:.0f} s)")
    return "\n".join(lines)


def plan_table(machine, checks: list) -> str:
    """The plan, before anything runs: each row that will run (with its GPUs and precision) and each
    row that will not, with the reason (``python -m stnb gpu-check --plan``)."""
    gpus = ", ".join(g["name"] for g in machine.gpus) or "none"
    lines = [f"stnb gpu-check plan: GPUs: {gpus} (torch CUDA {machine.torch_cuda or 'none: CPU-only build'})"]
    if not checks:
        lines.append(f"nothing to run: {machine.no_gpu_reason or 'no GPU'}")
    width = max([46] + [len(c.name) + 1 for c in checks])
    for c in checks:
        precision = c.params.get("mixed_precision", "")
        lines.append(f"{c.name:<{width}}{'not run' if c.skip else 'runs':<9}{c.gpus:>2} GPU  {precision:<5}"
                     + (f"  {c.skip}" if c.skip else ""))
    run = sum(1 for c in checks if not c.skip)
    lines.append(f"{run} row(s) will run, {len(checks) - run} will not (each with its reason)")
    return "\n".join(lines)


def write(report: dict, path) -> str:
    """Write the report as JSON, atomically; returns the path."""
    from stnb.files import write_atomic

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(report, indent=2, default=str) + "\n", 0o644)
    return path
