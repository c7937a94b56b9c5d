"""One bench invocation: ``bench()`` plans, resumes from the results file, runs what is missing,
summarizes, and writes the HTML report (and the benchmarks document when asked).

Every run is appended to the results file as soon as it finishes; runs already in the file
(verified, or not runnable here) are skipped, so the same call resumes where it stopped.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from .document import check_document, write_document
from .load import foreign_share, machine_busy, wait_until_quiet
from .options import BenchOptions, bench_device, check_preset
from .planning import plan
from .report import bench_frame, write_report
from .runners import execute
from .summary import bench_tag, format_summary, summarize


@dataclass
class BenchReport:
    """What ``bench()`` returns: the plan's rows, the summary, the files written."""

    summary: dict
    frame: object              # pandas DataFrame of this plan's rows (one per run)
    results_path: str
    report_path: str | None
    ran: int = 0
    skipped: int = 0
    failed: int = 0
    table: str = ""
    failed_runs: list = field(default_factory=list)  # [(run label, reason)] of this invocation
    doc_path: str | None = None  # the benchmarks document this run's tables went into

    def __str__(self) -> str:
        return self.table


def bench(opts: BenchOptions | None = None, **overrides) -> BenchReport:
    """Run (or resume) the benchmark described by ``opts``; returns a BenchReport."""
    from stnb.results import check_writable

    opts = opts or BenchOptions.from_preset("default")
    if overrides:
        opts = BenchOptions(**{**opts.__dict__, **overrides})
    check_preset(opts.preset, opts.device)
    path = opts.results_path()
    check_writable(path)  # a corrupted file raises ResultsFileError here, before any run
    if opts.doc:
        check_document(opts.doc)  # a damaged document is refused before any run, too
    items = plan(opts)
    done = _finished_keys(path)
    todo = [it for it in items if it.key not in done]
    if opts.echo:
        _announce(opts, path, len(items), len(todo))
    t_start = time.time()
    ran, failed_runs = _run_items(todo, opts, path)
    latest = _latest_rows(path)
    mine = [latest[it.key] for it in items if it.key in latest]
    summary = summarize(items, latest, opts)
    table, frame = format_summary(summary), bench_frame(mine)
    report = _html_report(opts, summary, frame)
    doc = str(write_document(opts.doc, summary, opts, mine)) if opts.doc else None
    if opts.echo:
        print()
        print(table)
        print(f"\nresults: {path}" + (f"\nreport:  {report}" if report else "") + (f"\ndoc:     {doc}" if doc else "")
              + f"\n{ran} run(s) now, {len(items) - len(todo)} resumed from the file, {len(failed_runs)} failed; "
              f"{time.time() - t_start:.0f} s", flush=True)
    return BenchReport(summary=summary, frame=frame, results_path=str(path), report_path=report, ran=ran,
                       skipped=len(items) - len(todo), failed=len(failed_runs), table=table,
                       failed_runs=failed_runs, doc_path=doc)


def _row_key(row: dict) -> str | None:
    return bench_tag(row).get("key")


def _finished_keys(path) -> set:
    """Keys of the runs already in the results file that need not run again."""
    from stnb.results import load_results

    rows = load_results(path, as_frame=False) if path.exists() else []
    return {_row_key(row) for row in rows if _row_key(row) and (
        row.get("status") == "not runnable here" or (row.get("status") == "ok" and row.get("verified")))}


def _latest_rows(path) -> dict:
    """{key: row}: the last row of each run in the file, an ok one preferred over a later failure."""
    from stnb.results import load_results

    latest = {}
    for row in load_results(path, as_frame=False):
        k = _row_key(row)
        if k is None:
            continue
        prev = latest.get(k)
        if prev is None or prev.get("status") != "ok" or row.get("status") == "ok":
            latest[k] = row
    return latest


def _announce(opts: BenchOptions, path, planned: int, to_run: int) -> None:
    print(f"stnb bench: preset {opts.preset}, model {opts.model}, max_seq_length {opts.max_seq_length}, "
          f"{opts.steps} steps ({opts.warmup} warm-up excluded), sections {', '.join(opts.sections)}")
    print(f"results: {path}  ({planned} runs planned, {planned - to_run} already there, "
          f"{to_run} to run)", flush=True)
    device, note = bench_device(opts)
    print(f"device: {device}" + (f" ({note})" if note else ""), flush=True)


def _run_items(todo: list, opts: BenchOptions, path) -> tuple:
    """Run each item, appending its result (with the machine's other load meanwhile) to ``path`` as
    soon as it finishes. Returns (runs done, [(label, reason)] of the failed ones)."""
    from stnb.results import append_result
    from stnb.runner import preimport_training_stack

    if todo:
        # forked ranks (stnb.launch, notebook_launcher) inherit the imported stack, as in a notebook
        # kernel that has trained before; torchrun ranks are new interpreters and import it themselves
        preimport_training_stack()
    echo, ran, failed_runs = opts.echo, 0, []
    try:
        for i, it in enumerate(todo, 1):
            if opts.quiet_wait and not it.unavailable:
                wait_until_quiet(opts.quiet_wait, echo=echo)
            t0, b0 = time.time(), machine_busy()
            res = execute(it, opts)
            share = foreign_share(b0, machine_busy(), time.time() - t0)
            tag = ((res.config or {}).get("extra") or {}).get("bench")
            if isinstance(tag, dict):
                tag["foreign_cpu_share"] = None if share is None else round(share, 4)
            append_result(path, res)
            ran += 1
            if res.status == "failed":
                failed_runs.append((it.label(), (res.reason or "").strip().splitlines()[0][:300]
                                    if res.reason else "no reason recorded"))
            if echo:
                print(f"[{i}/{len(todo)}] {it.label():<62} {_describe(res)}  ({time.time() - t0:.1f} s)", flush=True)
    except KeyboardInterrupt:
        if echo:
            print(f"interrupted: {ran} run(s) saved in {path}; run the same command again to resume", flush=True)
        raise
    return ran, failed_runs


def _html_report(opts: BenchOptions, summary: dict, frame) -> str | None:
    try:
        return str(write_report(opts.report_path(), summary, frame, opts))
    except Exception as e:  # noqa: BLE001 - a plotting problem never loses the measurements
        if opts.echo:
            print(f"warning: the HTML report could not be written ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def _describe(res) -> str:
    if res.status != "ok":
        return f"{res.status}: {res.reason.splitlines()[0][:120] if res.reason else ''}"
    sps = f"{res.samples_per_second:,.1f} samples/s" if res.samples_per_second else "n/a"
    ttfs = f", first step {res.time_to_first_step_s:.1f} s" if res.time_to_first_step_s else ""
    mfu = f", MFU {res.mfu['mfu']:.1%}" if (res.mfu or {}).get("mfu") is not None else ""
    return sps + mfu + ttfs + ("" if res.verified else " (NOT verified)")
