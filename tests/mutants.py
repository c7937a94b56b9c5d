"""``make mutants``: mutmut over the modules whose logic decides what users are told, with a survival
rate per module and no unexplained survivor.

mutmut (``[tool.mutmut]`` in pyproject.toml) copies ``stnb`` and ``stnblab`` into ``mutants/``, makes every small
fault it knows in the modules below (an operator, a constant, a condition, a returned value, an
argument dropped...) and runs, for each mutant, only the tests that called the mutated function in
one recorded run of the fast tests listed there. A mutant the tests do not fail is a survivor. Every
survivor must either be killed by a test stating behaviour a user relies on, or be listed in
``tests/mutants_equivalent.toml`` with the reason it cannot be observed; a survivor that is neither,
a mutant no test reaches, or a list entry that matches no mutant any more makes this exit 1.

    python tests/mutants.py                      # every module below (see docs/testing.md for the time)
    python tests/mutants.py results checks       # some modules
    python tests/mutants.py --changed main       # the modules that differ from git ref ``main``
    python tests/mutants.py --report-only        # the table of the last run, without running again

Equivalents are matched by the mutated function and the changed lines (not by mutmut's numbering,
which moves whenever a function gains a line), so the list stays valid while the code around moves.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EQUIVALENT_FILE = os.path.join(ROOT, "tests", "mutants_equivalent.toml")
MUTANTS_DIR = os.path.join(ROOT, "mutants")


@dataclass(frozen=True)
class Module:
    name: str
    path: str            # the file mutmut mutates
    functions: tuple = ("*",)  # the functions (mutmut's mangled names) whose mutants count here

    @property
    def dotted(self) -> str:
        """mutmut's module name: a package's ``__init__.py`` is the package (``stnb.strategies``)."""
        return self.path[:-3].replace("/", ".").removesuffix(".__init__")

    @property
    def globs(self) -> list:
        return [f"{self.dotted}.{f}__mutmut_*" for f in self.functions]


MODULES = (
    # merge and throughput: what a run's result says (the JSONL file's locking and atomic writes are
    # checked by the slow tests, faults injected there: several processes racing, a process killed)
    Module("results", "stnb/results.py", ("x_merge", "x_cross_rank_checks", "xǁRunResultǁto_row",
                                          "xǁRunResultǁunavailable", "x_results_frame")),
    # what a result's config and an exported script say of what was trained (stnb's recipe, a user's function)
    Module("builds", "stnb/builds.py", ("xǁRecipeBuildǁresult_config", "xǁRecipeBuildǁunavailable_row",
                                        "xǁRecipeBuildǁscript", "xǁUserBuildǁresult_config",
                                        "xǁUserBuildǁunavailable_row", "xǁUserBuildǁscript", "x_dict_literal")),
    Module("processes/channel", "stnb/processes/channel.py"),
    Module("export", "stnb/export.py"),
    Module("buildsource", "stnb/buildsource.py"),
    Module("checks", "stnb/checks.py"),
    # the prediction and its comparison with the measurement (how the process's peak is read from
    # the OS, PeakMemory and friends, is checked against a real run by the slow test_memory tests)
    Module("memory", "stnb/memory.py", ("x_predict", "x_predict_table", "x_model_shape", "x_optimizer_kind",
                                        "x_measure", "x_compare", "x__row", "x__as_dict", "x__first",
                                        "x__check_count")),
    Module("columns", "stnb/columns.py"),
    # the strategies' verification: the registry's (world size, every strategy's checks, the replicated
    # tensors across ranks) and the tensor facts it reads (each strategy's own checks run in training)
    Module("strategies.verify", "stnb/strategies/__init__.py", ("x_verify_prepared", "x_verify_ranks", "x_verify")),
    Module("strategies.tensors", "stnb/strategies/tensors.py", ("x_param_counts", "x_local_numel",
                                                                "x_shard_problems")),
    Module("plots/table", "stnb/plots/table.py"),
    # which checkpoint a run resumes from and every refusal before a rank starts (issue 48). Left out: to_model
    # (reads a model into torch; the slow test_checkpoints runs open a 2-rank FSDP checkpoint on one device)
    Module("checkpoints", "stnb/checkpoints.py", ("x_complete", "x_partial", "x_resume_point", "x_find",
                                                  "x__is_checkpoint", "x_step_of", "x_check_serves", "x_check_recipe",
                                                  "x_batch_of", "x__check_batch")),
    # ---- issue 33 item 3, part B: where the time and the memory went, and the predictor ----
    # the time split: one step's marks turned into parts that add up to the step, the wait split off the
    # exposed communication, the problems and the per-rank table; the readings' bookkeeping (forward
    # calls, bytes per bucket, gradient groups). Left out: attach (wires the readings into a real trainer
    # and DDP/FSDP: only a launch reaches it; the slow tests/test_timesplit.py runs check what it feeds),
    # the clocks (perf_counter; CUDA events need a GPU); own_cost, the timer's overhead, is a bench figure in the lab
    Module("timesplit", "stnb/timesplit.py", ("xǁStepTimerǁ__init__", "xǁStepTimerǁ_reset", "xǁStepTimerǁtimed",
                                              "xǁStepTimerǁ_hook_gradients", "xǁStepTimerǁ_grad_ready", "xǁStepTimerǁ_prune",
                                              "xǁStepTimerǁ_forward_pre", "xǁStepTimerǁ_gather_start",
                                              "xǁStepTimerǁ_gather_end", "xǁStepTimerǁon_step_begin",
                                              "xǁStepTimerǁon_pre_optimizer_step", "xǁStepTimerǁon_optimizer_step",
                                              "xǁStepTimerǁon_step_end", "xǁStepTimerǁresume",
                                              "xǁStepTimerǁ_split",
                                              "xǁStepTimerǁsummary",
                                              "x__union", "x_combine", "x_problems", "x_table")),
    # the memory split: the parts that add up to the peak, the marks, the activations counted, the largest
    # rank and its sentence. Left out: allocator_free and resident (what glibc and the OS report; the slow
    # tests/test_memory.py runs check the split of real ranks adds up)
    Module("memsplit", "stnb/memsplit.py", ("xǁMemorySplitǁ__init__", "xǁMemorySplitǁmark",
                                            "xǁMemorySplitǁremember_built", "xǁMemorySplitǁunsharded_alive",
                                            "xǁMemorySplitǁwatch_activations", "xǁMemorySplitǁ_counted",
                                            "xǁMemorySplitǁsummary", "x_weight_copy", "x_largest_rank", "x_advice",
                                            # the activations of dp's replica threads (issue 32 item 4.3)
                                            "xǁMemorySplitǁdevice", "xǁSavedTensorsǁ__init__", "xǁSavedTensorsǁpack",
                                            "xǁSavedTensorsǁcounting", "x__unpack", "xǁ_CountedReplicaǁ__init__",
                                            "xǁ_CountedReplicaǁ__call__", "x_in_replica_threads", "x_parameter",
                                            "x_replicated")),
    # the predictor: the table (samples/s, interval, speed-up, dominant input), the inputs read from a run
    # (measured or assumed, said so), the refusals, the verdict. Left out: Prediction._ipython_display_
    # (shows the table, the figure and the assumptions: display glue)
    Module("scaling", "stnb/scaling/__init__.py", ("xǁPredictionǁrow", "x_known", "x_predict", "x__uncertain",
                                                   "x__with_host_fraction", "x_assumptions", "x_compare", "x_verdict",
                                                   "x__model", "x__check_strategies", "x__check_devices", "x__ms",
                                                   "x__on_shared_cores", "x__check_threads", "x__computing")),
    Module("scaling.inputs", "stnb/scaling/inputs.py", ("x_from_result", "x_text_columns", "x_uncertain_from_result",
                                                        "x__threads")),
    Module("scaling.model", "stnb/scaling/model.py"),
    Module("scaling.interval", "stnb/scaling/interval.py"),
    Module("scaling.links", "stnb/scaling/links.py"),
    # the loopback link's fit (what the 'loopback' link's bandwidth and latency are). Left out: loopback,
    # measure_all_reduce, time_all_reduce (2 ranks timing gloo: a launch; test_scaling's slow measured run), and
    # the cores' probe sharing / measure_sharing / time_compute (ranks timing a layer: test_scaling's slow probe test)
    Module("scaling.calibrate", "stnb/scaling/calibrate.py", ("x_fit",)),
    # the sentence under the time split (what dominates a step, the knob that shrinks it) and the means it
    # reads. Left out: split_bars, timeline and their helpers (the figures: plotting; sends: stnb.stepparts')
    Module("plots/timesplit", "stnb/plots/timesplit.py", ("x_means", "x_knob_hints", "x_advice")),
    # what fits (issue 45): the search for the largest batch, and its figure's labels and numbers. Left out: fits'
    # runs under the budget (_Trials: launches, the slow tests/test_fits.py runs check them), what a run held
    # (_held, _peak), and the figure's drawing (plots.fits.fits: names, colours; tests/test_plots_fits.py checks
    # its bars, labels and budget line)
    Module("fits", "stnb/fits.py", ("x__search",)),
    # a rank's verification record, composed from its instruments' parts, and their order (issue 44 item 3).
    # Left out: reach, whole_rank, training, attach (the rank's wiring: what they make is what the real runs
    # check, tests/test_instrument_order.py's made-up instrument among them)
    Module("instruments", "stnb/instruments/base.py", ("x_record", "x_reports")),
    Module("instruments.order", "stnb/instruments/__init__.py", ("x_order",)),
    Module("plots/fits", "stnb/plots/fits.py", ("x__said", "x__num")),
    # the memory budget (issue 45): the refusal before launch and the strategies it offers, what a rank that ran
    # out says and what it offers, what counts as running out, the model folder's count, the limit applied and
    # taken back in this process (tests/test_budget_words.py). Left out: _apply_cuda (the allocator's fraction:
    # needs a GPU), the rank's wiring (instruments/budget.py: the real 2-rank runs of tests/test_memory_budget.py)
    Module("budget", "stnb/budget.py", ("x__mib", "x_limit_bytes", "x_shape_from_files", "x_predicted", "x__others",
                                        "x_refusal", "x__ranks_that_fit", "x_refuse", "x_out_of_memory", "x__asked",
                                        "xǁBudgetǁ__init__", "xǁBudgetǁenforced", "xǁBudgetǁ_apply",
                                        "xǁBudgetǁ_held", "xǁBudgetǁreport", "xǁBudgetǁcheck_model",
                                        "xǁBudgetǁexplain", "xǁBudgetǁ_fixes")),
    # ---- issue 33 item 3 (part A): what decides whether a run is reported verified -------------------
    # each strategy's own checks and refusals. Left out as wiring or as the predictor's: prepare /
    # apply_ddp / ddp_handler / shard_fsdp / prefetch / keep_shards_apart / on_first_step / full_model
    # (they hand torch and accelerate the strategy; what they produce is what the checks below observe),
    # step_time and the *_step cost models (the predictor's, checked by test_scaling), the facts
    # (available, held, rank_env, trainer_arguments: a run's setup, checked by the launch tests)
    Module("strategies.base", "stnb/strategies/base.py", ("x_replicated_check", "x_mixed_precision",
                                                          "xǁStrategyǁworld_refusal")),
    Module("strategies.ddp", "stnb/strategies/ddp.py", (
        "xǁDistributedDataParallelǁvalidate", "xǁDistributedDataParallelǁrefusals",
        "xǁDistributedDataParallelǁcheck_prepared", "xǁDistributedDataParallelǁcheck_ranks",
        "x_check_ddp_wrapper", "x_every_parameter_used_by_design", "x_ddp_kwargs", "x_torch_hook")),
    Module("strategies.zero1", "stnb/strategies/zero1.py", (
        "xǁZero1ǁvalidate", "xǁZero1ǁrefusals", "xǁZero1ǁcheck_prepared", "xǁZero1ǁcheck_step",
        "xǁZero1ǁcheck_ranks")),
    # zero2 is fsdp's checks with reshard_after_forward off: its one decision is that
    Module("strategies.zero2", "stnb/strategies/zero2.py", ("xǁZero2ǁreshard_after_forward",)),
    Module("strategies.fsdp", "stnb/strategies/fsdp.py", (
        "xǁFullyShardedDataParallelǁreshard_after_forward", "xǁFullyShardedDataParallelǁvalidate",
        "xǁFullyShardedDataParallelǁrefusals", "xǁFullyShardedDataParallelǁcheck_prepared",
        "xǁFullyShardedDataParallelǁcheck_step", "xǁFullyShardedDataParallelǁcheck_ranks",
        "x_reshard_plan", "x_watch_after_forward", "x_same_start")),
    Module("strategies.deepspeed", "stnb/strategies/deepspeed.py", (
        "x_stage_of", "x_contradictions", "xǁDeepSpeedǁvalidate", "xǁDeepSpeedǁcheck_recipe",
        "xǁDeepSpeedǁbuild_refusal", "xǁDeepSpeedǁrefusals", "xǁDeepSpeedǁcheck_prepared",
        "xǁDeepSpeedǁcheck_step", "xǁDeepSpeedǁcheck_ranks")),
    Module("strategies.deepspeed_engine", "stnb/strategies/deepspeed_engine.py", ("x_stage3_partitions",)),
    # the loss's own parameters: broadcast from rank 0, gradients averaged over the ranks
    Module("strategies.loss_sync", "stnb/strategies/loss_sync.py"),
    # the saved model: refused target, reloaded weights compared with the trained and initial ones
    Module("saving", "stnb/saving.py"),
    # a user's trainer: what is refused, what is overridden (and said), the loss rebound to the wrapper, the
    # facts the result's config reports (drop_autocast left out: accelerate's extract_model_from_parallel does
    # the work; test_mixed_precision_save checks its effect on a real bf16 save)
    Module("prepare", "stnb/prepare.py", ("x_describe", "x_training_facts", "x__rows", "x_call_build",
                                          "x_check_trainer", "x_refusals", "x_own_display", "x_apply_overrides",
                                          "x_rebind_loss_model", "x__model_refs")),
    # ---- issue 33 item 3: the launch's error and stall paths (tests/test_diagnose_rules.py) ----------
    # which error a user is told after a failed launch: every rule, the rank named, the kind
    Module("processes/diagnose", "stnb/processes/diagnose.py"),
    # which rank's failure is the origin. Left out: nccl_env, collective_timeout, open_wait_group,
    # wait_for_all (process-group settings handed to torch.distributed in the ranks: the slow launch tests)
    Module("processes/peerfail", "stnb/processes/peerfail.py", ("x_is_secondary", "x_origin")),
    # when a launch is declared stalled, not started, timed out, or ended by a silent rank. Left out:
    # run / finish / __enter__ (the thread's start, loop and stop), dump_stacks and kill_ranks (signals
    # sent to real ranks), _report_progress (a callback guard): plumbing the slow launch tests exercise
    Module("processes/watchdog", "stnb/processes/watchdog.py", ("xǁWatchdogǁ_tick", "xǁWatchdogǁ_track_ended",
                                                                "xǁWatchdogǁ_halt")),
    # ---- issue 33 item 3: the TP/PP demonstrations' comparison with one process (the lab; tests/test_parallel_compare.py)
    # the tolerance check that raises. Left out: tensor_parallel / pipeline_parallel (launch ranks: the slow
    # tests/test_parallel.py), check_layout_request (refusals, tests/test_parallel.py)
    Module("stnblab/parallel/runs", "stnblab/parallel/runs.py", ("x__within",)),
    # one run's differences from every rank's view, and the table's row. Left out: what runs in a rank (the
    # stage, the schedule, the timed step: tests/test_parallel.py), timeline (a figure's frame)
    Module("stnblab/parallel/pp", "stnblab/parallel/pp.py", ("x_per_job", "x_idle_fraction", "x_summary")),
    # the largest difference. Left out: the reference run itself, the batches, the loss (tests/test_parallel.py
    # compares the loss with sentence-transformers' own, and every parallel run with the reference)
    Module("stnblab/parallel/single", "stnblab/parallel/single.py", ("x_max_diff",)),
    # the slice of the reference's gradient a shard is compared with. Left out: the layout's application and
    # check, the collectives' counter, rank_main (in the ranks: tests/test_parallel.py)
    Module("stnblab/parallel/tp", "stnblab/parallel/tp.py", ("x_local_part",)),
    # ---- issue 49 item 2: behaviours users rely on that no test pinned -----------------------------------
    # what a cluster run's error says from the run folder (a rank that raised, never arrived at the rendezvous,
    # vanished), and the host of a Ray worker that never arrived. Left out: the ranks' side (arrive, the reports,
    # the progress feed: the slow cluster tests), Ray's start (a real Ray cluster: tests/test_cluster_ray.py)
    Module("launchers/rundir", "stnb/launchers/rundir.py", ("x_failure", "x__ranks")),
    Module("launchers/ray", "stnb/launchers/ray.py", ("x__hosts",)),
    # whether notebook 05's saved baseline stands for this notebook's (profile, model, device, steps, batch,
    # cores), and what 08 compares with when it measured again (the baseline beside its runs, how far the machine
    # moved). Left out: the measurement (the bench: tests/test_bench.py), the verdict's wording
    Module("stnblab/bench/shared_baseline", "stnblab/bench/shared_baseline.py", ("x_wanted_key", "x_mismatch",
                                                                                "xǁBaselineǁremeasured",
                                                                                "xǁBaselineǁdrift")),
    # gpu-check's verdict, its counts and its exit status (a planned check that did not run is a failure).
    # Left out: the speed-up rows and the table's layout
    Module("stnblab/gpucheck/report", "stnblab/gpucheck/report.py", ("x_build", "x_exit_code")),
    # ---- issue 49 item 4: parity's verdict (tests/test_parity_verdicts.py) ----------------------------
    # whether a strategy trained what one device trains: each tensor against the tolerance and the rounding
    # allowance, the overall share, the losses apart, every reason a run fails, the table and its repr. Left
    # out: parity's runs and what runs in the ranks (_train, _recorded, recipe_build; the slow test_parity.py)
    Module("parity", "stnb/parity.py", ("x__verdict", "x__compare", "x__overall", "x__ratio", "x__worse",
                                        "x__loss_apart", "xǁParityǁfailures", "xǁParityǁ__repr__",
                                        "xǁParityǁ_repr_html_")),
)

# Functions that run inside the ranks of a launch: mutmut records which tests call a function in the
# test process only, so a mutant of these that its fast tests leave alive is tried once more against
# the 2-rank tests that exercise it in the ranks (with the mutant active there: ranks inherit it).
_FSDP_RANKS = ("tests/test_verification.py::test_fsdp_shards_are_exactly_the_pieces_their_layout_gives_each_rank",)
_DIGEST_RANKS = ("tests/test_verification.py::test_weights_check_names_the_tensor_rank_1_changed",)
_WORLD_RANKS = ("tests/test_verification.py::test_world_size_requested_is_compared_with_the_group_each_rank_is_in",)
_LAUNCH_RANKS = ("tests/test_launch.py::test_progress_shows_each_rank_its_own_step",
                 "tests/test_launch.py::test_rank_raises_launch_error_others_stopped_no_children")
RANK_TESTS = {
    "stnb.checks.x_observe_world": _WORLD_RANKS, "stnb.checks.x_world_problems": _WORLD_RANKS,
    "stnb.checks.x_gather_digests": _DIGEST_RANKS, "stnb.checks.x_tensor_digests": _DIGEST_RANKS,
    "stnb.checks.x_shard_problems": _FSDP_RANKS, "stnb.checks.x_expected_local_numel": _FSDP_RANKS,
    "stnb.strategies.x_verify": _FSDP_RANKS, "stnb.strategies.x_verify_prepared": _FSDP_RANKS,
    "stnb.strategies.tensors.x_param_counts": _FSDP_RANKS, "stnb.strategies.tensors.x_local_numel": _FSDP_RANKS,
    "stnb.strategies.tensors.x_shard_problems": _FSDP_RANKS,
    # the limit under a hard limit an administrator set: applied in a forked process (it cannot be raised again)
    "stnb.budget.xǁBudgetǁ_apply": ("tests/test_budget_words.py::test_a_lower_hard_limit_is_the_one_applied",),
    **{f"stnb.processes.channel.xǁChannelǁ{m}": _LAUNCH_RANKS
       for m in ("check_in", "set_up", "set_state", "bump", "report", "write_result", "write_error",
                 "mark_progress")},
}
RANK_TEST_TIMEOUT_S = 300

# mutmut's exit-code statuses, grouped as this report counts them
CAUGHT = {"killed", "timeout", "caught by type check", "segfault"}


def load_equivalents(path: str = EQUIVALENT_FILE) -> list:
    """The listed equivalent mutants: [{function, before, after, reason}, ...]; every one needs all four."""
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("equivalent", [])
    for i, e in enumerate(entries):
        missing = [k for k in ("function", "before", "after", "reason") if not str(e.get(k, "")).strip()]
        if missing:
            raise SystemExit(f"{path}: entry {i + 1} lacks {', '.join(missing)} (every equivalent needs its reason)")
    return entries


def changed_lines(diff: str) -> tuple:
    """(removed lines, added lines) of a mutant's diff, stripped: what identifies it across renumbering."""
    lines = diff.splitlines()
    body = [ln for ln in lines if not ln.startswith(("---", "+++", "@@"))]
    before = "\n".join(ln[1:].strip() for ln in body if ln.startswith("-"))
    after = "\n".join(ln[1:].strip() for ln in body if ln.startswith("+"))
    return before, after


def text_only(before: str, after: str) -> bool:
    """True when a mutant changed nothing but the text inside string literals (a message's words,
    a label): the report counts these apart from changes to logic."""
    import io
    import tokenize

    def tokens(code):
        try:
            return [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(code + "\n").readline)
                    if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                      tokenize.ENDMARKER, tokenize.COMMENT)]
        except (tokenize.TokenError, SyntaxError, IndentationError):
            return None

    a, b = tokens(before), tokens(after)
    if a is None or b is None or len(a) != len(b) or a == b:
        return False
    # every difference is inside a string literal holding words (a space): not a key or a name
    return all(x == y or (x[0] == y[0] == tokenize.STRING and " " in x[1]) for x, y in zip(a, b))


def function_of(mutant: str) -> str:
    """'stnb.results.x_merge__mutmut_3' -> 'stnb.results.x_merge'."""
    return mutant.partition("__mutmut_")[0]


def _results() -> dict:
    """{mutant name: status} from mutmut's files under mutants/."""
    from mutmut.stats import status_by_exit_code

    out = {}
    packages = sorted({m.path.split("/")[0] for m in MODULES})  # stnb, and the lab (stnblab)
    for base, _, files in (w for p in packages for w in os.walk(os.path.join(MUTANTS_DIR, p))):
        for name in files:
            if name.endswith(".py.meta"):
                with open(os.path.join(base, name)) as f:
                    meta = json.load(f)
                for key, code in meta["exit_code_by_key"].items():
                    out[key] = status_by_exit_code[code]
    return out


def _diff(mutant: str) -> str:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    module = function_of(mutant).rsplit(".", 1)[0]
    path = next(m.path for m in MODULES if m.dotted == module)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return get_diff_for_mutant(mutant, path=path)
    finally:
        os.chdir(cwd)


def mutant_names(modules) -> list:
    """Every mutant mutmut makes in ``modules`` (the functions that count), by name, without running any."""
    from pathlib import Path

    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    cwd = os.getcwd()
    os.chdir(ROOT)  # mutmut reads its configuration from pyproject.toml here
    try:
        names = []
        for m in modules:
            with open(m.path) as f:
                made = mutate_file_contents(m.path, f.read()).mutant_names
            names += [n for n in (get_mutant_name(Path(m.path), k) for k in made)
                      if any(fnmatch.fnmatch(n, g) for g in m.globs)]
        return sorted(names)
    finally:
        os.chdir(cwd)


def _run_mutmut(modules, max_children: int, selectors: list) -> float:
    """Run mutmut on the mutants ``selectors`` (names or globs) pick (a fresh mutants/ folder). Returns
    the seconds it took."""
    shutil.rmtree(MUTANTS_DIR, ignore_errors=True)
    # exists before Python starts: an import path that does not exist yet would be cached as empty,
    # and ranks (forked or spawned) must import the mutated stnb too
    os.makedirs(MUTANTS_DIR)
    env = dict(os.environ, PYTHONPATH=MUTANTS_DIR, STNB_PROFILE="ci", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    mutmut = os.path.join(os.path.dirname(sys.executable), "mutmut")
    start = time.time()
    proc = subprocess.run([mutmut, "run", "--max-children", str(max_children), *selectors], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.time() - start
    tail = proc.stdout[-3000:].replace("\r", "\n")
    if proc.returncode != 0:
        print(tail)
        raise SystemExit(f"mutmut run exited {proc.returncode} (its output's end is above)")
    with open(os.path.join(MUTANTS_DIR, "make-mutants.json"), "w") as f:
        json.dump({"modules": [m.name for m in modules], "selectors": selectors, "seconds": seconds,
                   "max_children": max_children}, f)
    return seconds


_RETRIES = os.path.join(MUTANTS_DIR, "rank-retries.json")  # {mutant: killed}, for --report-only
RETRY_SECONDS = [0.0]


RANK_RETRIES = [True]  # --no-rank-retries: such survivors stay unexplained (faster, and said so)


def killed_in_ranks(mutant: str) -> bool:
    """Run the 2-rank tests of ``mutant``'s function (RANK_TESTS) with the mutant active; True when they fail."""
    tests = RANK_TESTS.get(function_of(mutant))
    if not tests or not RANK_RETRIES[0]:
        return False
    done = json.load(open(_RETRIES)) if os.path.exists(_RETRIES) else {}
    if mutant not in done:
        start = time.time()
        done[mutant] = _run_rank_tests(mutant, tests)
        RETRY_SECONDS[0] += time.time() - start
        with open(_RETRIES, "w") as f:
            json.dump(done, f)
    return done[mutant]


def _run_rank_tests(mutant: str, tests) -> bool:
    env = dict(os.environ, PYTHONPATH=MUTANTS_DIR, MUTANT_UNDER_TEST=mutant, STNB_PROFILE="ci", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=MUTANTS_DIR, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=RANK_TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return True  # the mutant made the ranks hang: caught by the launch's limits
    return proc.returncode == 1


@dataclass
class Row:
    module: str
    mutants: int = 0
    caught: int = 0
    survived: int = 0
    equivalent: int = 0
    no_tests: int = 0
    text: int = 0  # unexplained survivors that changed only a message's words
    in_ranks: int = 0  # caught by the 2-rank tests of RANK_TESTS
    not_run: int = 0  # mutants the run did not reach (stopped early): no result either way

    @property
    def unexplained(self) -> int:
        return self.survived - self.equivalent + self.no_tests

    def rate(self) -> str:
        done = self.mutants - self.not_run
        return f"{100.0 * self.survived / done:.1f}%" if done else "-"


def report(modules, seconds: float | None, selectors: list | None = None) -> int:
    """Print the table; return the exit code (1: an unexplained survivor, an unreached mutant, a stale entry).
    selectors: the names or globs that were run (None: every mutant of ``modules``); a stale entry is
    only looked for when every mutant of the modules ran."""
    statuses = _results()
    if selectors is not None:
        statuses = {k: v for k, v in statuses.items() if any(k == p or fnmatch.fnmatch(k, p) for p in selectors)}
    whole = selectors is None or all("*" in p for p in selectors)
    equivalents = load_equivalents()
    used = set()
    rows, unexplained = [], []
    for m in modules:
        row = Row(m.name)
        names = sorted(k for k in statuses if any(fnmatch.fnmatch(k, g) for g in m.globs))
        for name in names:
            status = statuses[name]
            row.mutants += 1
            if status in CAUGHT:
                row.caught += 1
                continue
            if status == "not checked":  # the run stopped before this mutant: no result
                row.not_run += 1
                continue
            before, after = changed_lines(_diff(name))
            hit = next((i for i, e in enumerate(equivalents) if e["function"] == function_of(name)
                        and e["before"].strip() == before and e["after"].strip() == after), None)
            if status in ("survived", "no tests") and hit is None and killed_in_ranks(name):
                row.caught += 1
                row.in_ranks += 1
                continue
            if status == "no tests" and hit is None:
                row.no_tests += 1
                unexplained.append((name, "no test reaches it"))
                continue
            if status not in ("survived", "no tests"):  # suspicious, skipped, interrupted: not a result
                row.no_tests += 1
                unexplained.append((name, status))
                continue
            row.survived += 1
            if hit is None:
                unexplained.append((name, "survived"))
                row.text += text_only(before, after)
            else:
                used.add(hit)
                row.equivalent += 1
        rows.append(row)
    ran = {m.dotted for m in modules}
    complete = whole and not any(r.not_run for r in rows)
    stale = [e for i, e in enumerate(equivalents) if complete and i not in used and e["function"].rsplit(".", 1)[0] in ran]

    total = Row("total", *(sum(getattr(r, k) for r in rows) for k in ("mutants", "caught", "survived", "equivalent",
                                                                         "no_tests", "text", "in_ranks", "not_run")))
    print(f"{'module':<20}{'mutants':>8}{'not run':>8}{'caught':>8}{'(in ranks)':>11}{'survived':>9}{'rate':>7}"
          f"{'equivalent':>11}{'unexplained':>12}{'(text only)':>12}")
    for r in rows + [total]:
        print(f"{r.module:<20}{r.mutants:>8}{r.not_run:>8}{r.caught:>8}{r.in_ranks:>11}{r.survived:>9}{r.rate():>7}"
              f"{r.equivalent:>11}{r.unexplained:>12}{r.text:>12}")
    print("caught: a test failed (in ranks: one of the 2-rank tests of RANK_TESTS); rate: survivors / mutants run "
          "(listed equivalents included); unexplained: survivors not listed as equivalent, and mutants no test "
          "reaches; (text only): of those, the ones that changed only the words of a message")
    if seconds is not None:
        print(f"time: {seconds:.0f} s mutmut, {RETRY_SECONDS[0]:.0f} s of 2-rank retries")
    if not RANK_RETRIES[0]:
        print("2-rank retries were skipped (--no-rank-retries): survivors of functions that run in ranks "
              "count as unexplained")
    if unexplained:
        print(f"\n{len(unexplained)} unexplained mutant(s) (see one with: mutmut show NAME):")
        for name, why in unexplained:
            print(f"  {name}: {why}")
            if why == "survived":
                before, after = changed_lines(_diff(name))
                print("    - " + before.replace("\n", "\n    - ") + "\n    + " + after.replace("\n", "\n    + "))
    if stale:
        print(f"\n{len(stale)} entr(y/ies) of {os.path.relpath(EQUIVALENT_FILE, ROOT)} match no surviving mutant "
              "(the code changed, or a test now kills it): remove or update them")
        for e in stale:
            print(f"  {e['function']}: {e['before']!r} -> {e['after']!r}")
    if total.not_run:
        print(f"\n{total.not_run} mutant(s) were not run (the run stopped early): the table is incomplete")
    if not any(r.mutants - r.not_run for r in rows):
        print("no mutant was run: nothing is checked")
        return 1
    empty = [r.module for r in rows if whole and not r.mutants]
    if empty:  # its functions were renamed or moved: the module would pass unchecked
        print(f"\nno mutant matched the functions listed for {', '.join(empty)} (MODULES in tests/mutants.py): "
              "rename them there")
    return 1 if unexplained or stale or total.not_run or empty else 0


def changed_modules(base: str) -> list:
    out = subprocess.run(["git", "diff", "--name-only", base, "--"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [m for m in MODULES if m.path in out]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modules", nargs="*", help=f"modules to run (default: all): {', '.join(m.name for m in MODULES)}")
    p.add_argument("--changed", metavar="GIT_REF", help="only the modules whose file differs from GIT_REF")
    p.add_argument("--report-only", action="store_true", help="print the last run's table, run nothing")
    p.add_argument("--sample", type=int, metavar="N", help="run N mutants drawn from the modules' (with --seed)")
    p.add_argument("--seed", type=int, default=19, help="seed of the --sample draw (default 19)")
    p.add_argument("--no-rank-retries", action="store_true",
                   help="do not try survivors of functions that run in ranks against their 2-rank tests")
    p.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    a = p.parse_args(argv)
    RANK_RETRIES[0] = not a.no_rank_retries
    by_name = {m.name: m for m in MODULES}
    unknown = [n for n in a.modules if n not in by_name]
    if unknown:
        p.error(f"unknown module(s) {unknown}; choose from {list(by_name)}")
    modules = [by_name[n] for n in a.modules] or list(MODULES)
    if a.changed:
        modules = [m for m in changed_modules(a.changed) if m in modules]
        if not modules:
            print(f"no listed module differs from {a.changed}: nothing to mutate")
            return 0
    if a.report_only:
        with open(os.path.join(MUTANTS_DIR, "make-mutants.json")) as f:
            last = json.load(f)
        modules = [by_name[n] for n in last["modules"] if n in by_name and by_name[n] in modules]
        return report(modules, last["seconds"], last["selectors"])
    selectors = [g for m in modules for g in m.globs]
    if a.sample:
        import random

        every = mutant_names(modules)
        selectors = sorted(random.Random(a.seed).sample(every, min(a.sample, len(every))))
        print(f"{len(selectors)} of {len(every)} mutants, drawn with seed {a.seed}")
    seconds = _run_mutmut(modules, a.max_children, selectors)
    return report(modules, seconds, selectors)


if __name__ == "__main__":
    sys.exit(main())
