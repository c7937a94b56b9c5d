"""Benchmarks: ``python -m stnb bench``. Sweeps and side-by-side comparisons, persisted run by run.

Sections (all run unless some are named with --sweep / --launchers / --ddp-knobs):

sweep       strategies x per-device batch sizes x processes, each through ``stnb.run``.
launchers   the same DDP training (``training.train_rank``) under ``stnb.launch``, under raw
            accelerate ``notebook_launcher`` and under ``torchrun`` (a subprocess), plus the
            single-process baselines (one device = one core on CPU: 1 thread; and, on CPU, one
            process with every core). Repeats are interleaved (the order rotates every repeat).
            Reports global samples/s, the launcher ratios (median of the per-repeat ratios), the
            time from the call to the first optimizer step, and the scaling efficiency
            DDP samples/s / (N x single-device samples/s).
knobs       DDP options (bucket size, gradient_as_bucket_view, static_graph, fp16/bf16 compression
            hooks, gradient accumulation with no_sync, threads per rank) against the N x
            single-device limit, with matching single-device baselines (same accumulation), and
            "N x single at once": N independent single-device runs side by side, no
            communication, which separates the cost of sharing the machine (memory bandwidth,
            caches) from the cost of DDP's all-reduce.

Every run is appended to the results file (JSONL of RunResult, ``stnb.append_result``, atomic)
as soon as it finishes; the bench's bookkeeping lives in ``config.extra['bench']`` (section,
variant, repeat and a key over the whole configuration). Re-running the same command skips every
run already in the file (resume); a corrupted results file is reported and never overwritten.
At the end an HTML report (plotly; ``stnb.plots`` figures when available) is written and a
summary table is printed, with PASS/BELOW for each performance target. Timing targets never
change the exit status; a run that crashes does (exit 1, after everything else has run).
``--write-doc [BENCHMARKS.md]`` also writes the measured tables into a markdown benchmarks
document, replacing only this kind of run's sections (``document``).

Measured numbers are only as good as the machine is quiet. Each run records the share of the CPUs
that other processes used meanwhile (the "other load" column; runs above 5 % are flagged), and
``--quiet-wait S`` waits up to S seconds for a quiet machine before each run. The full measurement:
``python -m stnb bench --quiet-wait 300`` (sections can also be run one at a time into the same file).

The package, by seam (one way: cli -> session -> runners / summary / report / document -> planning ->
options):

options     presets, sections, ``BenchOptions``, ``check_preset``, ``bench_device``
planning    ``Item``, knob variants and their baselines, ``plan()``
runners     executing one item: stnb, raw notebook_launcher, torchrun (and its rank: ``torchrun_worker``),
            N single runs at once
load        how busy the machine is with other work: ``wait_until_quiet``, ``foreign_share``
summary     ``summarize``, ``format_summary``, ``knobs_frame``, ``TARGETS``
report      the HTML report and ``bench_frame``
document    the markdown benchmarks document (BENCHMARKS.md)
session     ``bench()``: plan, resume, run, summarize, report
shared_baseline ``baseline()``: notebook 05's side-by-side baseline, measured once and saved; 06 and 08 reuse it
cli         ``add_cli``, ``options_from_args``, ``cmd_bench``
"""

from .shared_baseline import Baseline, baseline
from .cli import add_cli, cmd_bench, command_line, options_from_args
from .document import DEFAULT_DOC, check_document, write_document
from .load import NOISY, foreign_share, machine_busy, wait_until_quiet
from .options import PRESETS, SECTIONS, ST_DOCS_NOTE, BenchOptions, bench_device, check_preset
from .planning import Item, knob_names, plan
from .report import bench_frame, write_report
from .session import BenchReport, bench
from .summary import TARGETS, format_summary, knobs_frame, summarize, target_verdict

__all__ = ["BenchOptions", "BenchReport", "bench", "baseline", "Baseline", "plan", "summarize", "check_preset", "add_cli",
           "TARGETS"]
