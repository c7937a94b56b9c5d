"""The command line: ``python -m stnb bench ...`` (registered by ``stnb/__main__.py`` through ``add_cli``).

``add_cli`` defines the options, ``options_from_args`` turns them into ``BenchOptions`` (refusing bad
values before anything runs) and ``cmd_bench`` runs the bench and gives the exit status: 1 when a run
crashed, 0 otherwise (timing targets never change it). ``command_line`` spells the parsed command
back out (the benchmarks document records it).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from stnb.errors import ConfigError
from .document import DEFAULT_DOC
from .options import PRESETS, BenchOptions, check_preset
from .planning import knob_names
from .session import bench


def _csv(kind):
    def parse(s):
        parts = [p.strip() for p in s.split(",") if p.strip()]
        try:
            return tuple(kind(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {s!r}")
    return parse


def add_cli(subparsers) -> None:
    """Register ``bench`` on an argparse subparsers object (``python -m stnb bench``)."""
    p = subparsers.add_parser(
        "bench", help="sweep + launcher and DDP-knob comparisons; results persisted run by run",
        description="Sweep (strategies x batch sizes x processes), launcher comparison (stnb.launch / raw "
                    "notebook_launcher / torchrun / single process) and DDP knobs, each run appended to a JSONL "
                    "results file as soon as it finishes. Re-running the same command resumes (runs already in the "
                    "file are skipped); an HTML report and a summary table with PASS/BELOW per target follow.",
        epilog="DDP knob variants (--knobs): " + "; ".join(knob_names("cpu")) + ".\n"
               "Full measurement on a quiet machine: python -m stnb bench --quiet-wait 300",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = []

    def arg(*flags, **kw):
        actions.append(p.add_argument(*flags, **kw))

    arg("--quick", action="store_true", help="smoke test of every section (tiny model, ~1 minute)")
    arg("--preset", default=None, choices=[k for k in PRESETS if k != "quick"],
        help="default: MiniLM on this machine; st-docs: the sentence-transformers docs' multi-GPU "
             "setting, offline (random-weight mpnet-base; NLI + STS stand-ins with SoftmaxLoss + CosineSimilarityLoss "
             "in one run; needs a GPU, or --device cpu)")
    arg("--sweep", action="store_true", help="run the sweep section (default: every section)")
    arg("--launchers", action="store_true", help="run the launcher comparison section")
    arg("--ddp-knobs", action="store_true", help="run the DDP knobs section")
    arg("--checkpoints", action="store_true", help="run the checkpoint cost section (seconds and bytes per rank "
                                                   "of a checkpoint, every strategy)")
    arg("--knobs", type=_csv(str), default=None, help="only these knob variants (comma-separated)")
    arg("--accumulate", type=int, default=None, metavar="A",
        help="micro-batches per optimizer step in the 'accumulate A ...' knob variants (default 4)")
    arg("--model", default=None, help="minilm, tiny, a hub id or a local path")
    arg("--max-seq-length", type=int, default=None)
    arg("--data", default=None)
    arg("--strategies", type=_csv(str), default=None, help="sweep strategies, e.g. single,ddp,fsdp")
    arg("--batch-sizes", type=_csv(int), default=None, help="sweep per-device batch sizes, e.g. 8,16,32")
    arg("--nprocs", type=_csv(int), default=None, help="sweep process counts for ddp/fsdp, e.g. 2")
    arg("--batch-size", type=int, default=None, help="per-device batch of the comparisons")
    arg("--nproc", type=int, default=None, dest="comparison_nproc", metavar="N",
        help="ranks in the comparisons (default: every core / GPU)")
    arg("--steps", type=int, default=None)
    arg("--warmup", type=int, default=None, help="steps excluded from samples/s")
    arg("--repeats", type=int, default=None, help="interleaved repeats of the comparisons")
    arg("--sweep-repeats", type=int, default=None)
    arg("--train-size", type=int, default=None)
    arg("--device", default=None, choices=("auto", "cpu", "cuda"))
    arg("--results", default=None, help="JSONL results file (default artifacts/bench/<preset>.jsonl)")
    arg("--report", default=None, help="HTML report (default: next to the results file)")
    arg("--run-timeout", type=float, default=None, help="seconds per run before it is stopped")
    arg("--quiet-wait", type=float, default=None,
        help="before each run, wait up to this many seconds until other processes use < 10%% of "
             "the CPUs (default 0: do not wait)")
    arg("--write-doc", nargs="?", const=DEFAULT_DOC, default=None, dest="doc", metavar="PATH",
        help=f"write this run's measured tables, the machine and this command into a markdown "
             f"benchmarks document (default {DEFAULT_DOC} in the current folder), replacing only the "
             f"sections of this kind of run (preset, device, section) and keeping everything else")
    arg("--json", action="store_true", help="print the summary as JSON on the last line")
    p.set_defaults(func=cmd_bench, bench_actions=tuple(actions))


def options_from_args(a) -> BenchOptions:
    if a.quick and a.preset not in (None, "default"):
        raise ConfigError(f"--quick is its own preset; drop --preset {a.preset} or --quick")
    preset = "quick" if a.quick else (a.preset or "default")
    check_preset(preset, a.device or "auto")  # before anything else: st-docs refuses here with its reasons
    sections = tuple(s for s, on in (("sweep", a.sweep), ("launchers", a.launchers), ("knobs", a.ddp_knobs),
                                     ("checkpoints", a.checkpoints)) if on)
    for name in ("steps", "warmup", "repeats", "sweep_repeats", "batch_size", "comparison_nproc", "train_size"):
        v = getattr(a, name)
        if v is not None and v < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}, got {v}")
    if a.accumulate is not None and a.accumulate < 2:
        raise ConfigError(f"--accumulate must be >= 2 (1 is the 'defaults' variant), got {a.accumulate}")
    over = dict(model=a.model, max_seq_length=a.max_seq_length, data=a.data, strategies=a.strategies,
                batch_sizes=a.batch_sizes, nprocs=a.nprocs, batch_size=a.batch_size,
                comparison_nproc=a.comparison_nproc, steps=a.steps, warmup=a.warmup, repeats=a.repeats,
                sweep_repeats=a.sweep_repeats, train_size=a.train_size, device=a.device, results=a.results,
                report=a.report, run_timeout=a.run_timeout, knobs=a.knobs, accumulate=a.accumulate,
                sections=sections or None, quiet_wait=a.quiet_wait, doc=a.doc)
    opts = BenchOptions.from_preset(preset, **over)
    if opts.steps <= opts.warmup:
        raise ConfigError(f"--steps {opts.steps} leaves no measured step after --warmup {opts.warmup}; "
                          f"use --steps >= {opts.warmup + 1}")
    return opts


def command_line(a) -> str:
    """The parsed ``bench`` command spelled back out: ``python -m stnb bench`` and every option that
    was given, in the parser's order (re-running it asks for the same runs)."""
    parts = ["python", "-m", "stnb", "bench"]
    for action in getattr(a, "bench_actions", ()):
        value = getattr(a, action.dest, None)
        if value is None or value is False:
            continue
        parts.append(action.option_strings[-1])
        if value is True and action.nargs == 0:
            continue
        parts.append(",".join(map(str, value)) if isinstance(value, tuple) else f"{value:g}"
                     if isinstance(value, float) else str(value))
    return shlex.join(parts)


def cmd_bench(a) -> int:
    opts = options_from_args(a)
    opts.echo = not a.json
    opts.command = command_line(a)
    rep = bench(opts)
    if a.json:
        print(json.dumps({"summary": rep.summary, "results": rep.results_path, "report": rep.report_path,
                          "doc": rep.doc_path,
                          "ran": rep.ran, "skipped": rep.skipped, "failed": rep.failed,
                          "failed_runs": [{"run": n, "reason": r} for n, r in rep.failed_runs]}, default=str))
    if rep.failed:
        print(f"error: {rep.failed} run(s) failed:", file=sys.stderr)
        for name, reason in rep.failed_runs:
            print(f"  {name}: {reason}", file=sys.stderr)
    return 1 if rep.failed else 0
