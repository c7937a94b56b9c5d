"""The benchmarks document (BENCHMARKS.md): the measured tables of bench runs, kept section by section.

``python -m stnb bench ... --write-doc [PATH]`` (``BenchOptions.doc``) writes each section of the run
(sweep, launchers, knobs, checkpoints) between markers named after the kind of run, preset/device/section:

    <!-- stnb-bench:quick/cpu/sweep -->  ...  <!-- /stnb-bench:quick/cpu/sweep -->

A run replaces only its own sections; every other section and all text outside the markers stay
as they were, so runs of several presets, devices and sections accumulate in one file. Each section
names the machine (CPU, cores, GPUs, library versions), when its runs were measured and the command
that produced them. The sentence-transformers docs' numbers (``stnb.reference``) have their own
section, labelled as theirs. The file is replaced atomically, and a damaged one (a marker without
its partner) is refused before any run starts.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from stnb import reference
from stnb.files import write_atomic
from stnb.errors import ConfigError
from .options import BenchOptions, bench_device
from .planning import checkpoint_interval, is_concurrent

DEFAULT_DOC = "BENCHMARKS.md"
REFERENCE_SECTION = "reference"
_MARK = re.compile(r"^<!-- (/?)stnb-bench:(\S+) -->$", re.MULTILINE)  # a marker is a line of its own

HEADER = """# stnb benchmarks

Measured numbers of `python -m stnb bench`. Each section between a pair of `stnb-bench` markers
(HTML comments, invisible when rendered) is written by `python -m stnb bench ... --write-doc` and
replaced when the same kind of run (preset, device, section) writes again; text outside the markers
is kept as it is. Every section names the machine, when it was measured and the command that
produced it: re-run the command to check a number.
"""


def section_name(preset: str, device: str, section: str) -> str:
    """The marker name of one kind of run, e.g. 'quick/cpu/sweep'."""
    return f"{preset}/{device}/{section}"


def parse_sections(text: str, where: str = "the document") -> dict:
    """{name: (start, end)}: the span of each marked section, markers included. Raises ConfigError
    when a marker has no partner, sections nest or a name appears twice."""
    spans, open_name, open_at = {}, None, 0
    for m in _MARK.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        if not closing:
            if open_name is not None:
                raise ConfigError(f"{where}: section {name!r} starts inside section {open_name!r}; "
                                  f"close {open_name!r} with <!-- /stnb-bench:{open_name} --> first")
            if name in spans:
                raise ConfigError(f"{where}: section {name!r} appears twice; delete one of them")
            open_name, open_at = name, m.start()
        elif name != open_name:
            raise ConfigError(f"{where}: <!-- /stnb-bench:{name} --> closes a section that was not opened")
        else:
            spans[name] = (open_at, m.end())
            open_name = None
    if open_name is not None:
        raise ConfigError(f"{where}: section {open_name!r} has no end marker <!-- /stnb-bench:{open_name} -->; "
                          "add it (or delete the section) and run again")
    return spans


def check_document(path) -> None:
    """Refuse (ConfigError), before any run, a document whose markers are damaged or whose folder
    cannot be written."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(f"cannot write the benchmarks document {path}: {folder} is not a writable folder")
    if path.exists():
        parse_sections(path.read_text(), str(path))


def replace_sections(text: str, blocks: dict) -> str:
    """``text`` with each {name: body} block put between its markers: in place where the section
    exists, otherwise after the last marked section (at the end when there is none)."""
    for name, body in blocks.items():
        block = f"<!-- stnb-bench:{name} -->\n{body.strip()}\n<!-- /stnb-bench:{name} -->"
        spans = parse_sections(text)
        if name in spans:
            start, end = spans[name]
            text = text[:start] + block + text[end:]
        else:
            at = max((e for _, e in spans.values()), default=len(text.rstrip()))
            text = text[:at].rstrip("\n") + "\n\n" + block + "\n" + text[at:].lstrip("\n")
            if not text[at:].strip():
                text = text.rstrip("\n") + "\n"
    return text


def write_document(path, summary: dict, opts: BenchOptions, rows=(), device: str | None = None) -> Path:
    """Write the sections of this run (and the reference) into the document at ``path``."""
    path = Path(path)
    device = device or bench_device(opts)[0]
    old = path.read_text() if path.exists() else HEADER
    facts = _run_facts(opts, rows, device)
    blocks = {REFERENCE_SECTION: reference_markdown()}
    for section in _SECTIONS:
        if section in summary["sections"]:
            blocks[section_name(opts.preset, device, section)] = _SECTIONS[section](summary, opts, device, facts)
    write_atomic(path, replace_sections(old, blocks), 0o644)
    return path


def reference_markdown() -> str:
    lines = ["## Reference: the sentence-transformers documentation (not measured here)", "",
             f"These are **the sentence-transformers documentation's** numbers, not stnb's: {reference.CONDITIONS} "
             f"([source]({reference.URL})). They live in `stnb.reference`; `python -m stnb bench --preset st-docs` "
             "runs the same setting offline on your GPUs: the same model shapes and the same two losses in one "
             "multi-dataset run, on synthetic stand-ins of their data.", "",
             "| strategy | GPUs | samples/s | speed-up vs one GPU | scaling efficiency |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in reference.rows():
        lines.append(f"| {r['strategy']} | {r['devices']} | {r['samples_per_second']:.0f} | "
                     f"{r['published_speedup']:.3f}x | {r['efficiency']:.2f} |")
    return "\n".join(lines)


# ---- the measured sections ---------------------------------------------------------------------

def _run_facts(opts: BenchOptions, rows, device: str) -> list:
    """The lines every measured section starts with: when, what machine, which command."""
    from stnb.hardware import cpu_cores, cpu_name, gpus, versions

    stamps = [r.get("timestamp") for r in rows if r.get("timestamp")]
    when = (_date(min(stamps)) + (f" to {_date(max(stamps))}" if _date(max(stamps)) != _date(min(stamps)) else "")
            if stamps else _date(time.time()))
    vers = next((r.get("versions") for r in rows if r.get("versions")), None) or versions()
    gpu_list = gpus()
    gpu_text = ", ".join(g["name"] for g in gpu_list) if gpu_list else "no GPU"
    return [f"- measured: {when} (UTC), on {device}",
            f"- machine: {cpu_name()}, {cpu_cores()} cores available; {gpu_text}",
            "- versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
            f"- command: `{opts.command or _api_call(opts)}`",
            f"- settings: model {opts.model}, max_seq_length {opts.max_seq_length}, data {opts.data}, loss {opts.loss}, "
            f"{opts.steps} steps ({opts.warmup} warm-up steps excluded from samples/s); results file "
            f"`{opts.results_path()}`"]


def _sweep(summary, opts, device, facts) -> str:
    rows = summary["sections"]["sweep"]
    mfu = device == "cuda" or any(r.get("mfu") is not None for r in rows)
    head = ["run", "samples/s"] + (["MFU"] if mfu else []) + ["tokens/sample", "step s", "global batch",
                                                            "first step s", "status"]
    body = [[r["variant"], _n(r["samples_per_second"])] + ([_n(r.get("mfu"), ".1%")] if mfu else []) +
            [_n(r.get("tokens_per_sample")), _n(r["step_s"], ".3f"), _n(r["global_batch_size"], "d"),
             _n(r["time_to_first_step_s"]), _status(r)] for r in rows]
    return "\n".join([f"## Sweep: preset {opts.preset}, {device}", "", *facts, "",
                      "Each strategy through `stnb.run`; samples/s is the median over "
                      f"{opts.sweep_repeats} repeat(s).", "", *_table(head, body), *_notes(summary, "sweep")])


def _launchers(summary, opts, device, facts) -> str:
    la = summary["sections"]["launchers"]
    head = ["variant", "samples/s", "min", "max", "step s", "first step s", "runs ok", "other load", "status"]
    body = [[r["variant"], _n(r["samples_per_second"]), _n(r["min"]), _n(r["max"]), _n(r["step_s"], ".3f"),
             _n(r["time_to_first_step_s"]), f"{r['ok']}/{r['runs']}", _n(r["other_load"], ".0%"), _status(r)]
            for r in la["variants"]]
    ratios = [[name, _n(la["ratios"].get(key), ".3f"), str(len(la["ratio_samples"].get(key) or []))]
              for key, name in _RATIO_NAMES.items() if key in la["ratios"]]
    return "\n".join([f"## Launchers: preset {opts.preset}, {device}", "", *facts, "",
                      f"The same DDP `train_rank` under each launcher, {la['nproc']} ranks, per-device batch "
                      f"{opts.batch_size}; medians of {opts.repeats} interleaved repeat(s).", "", *_table(head, body),
                      "", "Ratios (median of the per-repeat ratios; baseline for efficiency: "
                      f"{la['nproc']} x {la['baseline']}):", "", *_table(["ratio", "value", "repeats"], ratios),
                      *_targets(summary, "launchers"), *_notes(summary, "launchers")])


def _knobs(summary, opts, device, facts) -> str:
    kn = summary["sections"]["knobs"]
    head = ["variant", "samples/s", "efficiency", "vs defaults", "baseline", "runs ok", "other load", "status"]
    body = [[r["variant"], _n(r["samples_per_second"]), _n(r["efficiency"], ".3f"), _n(r["vs_defaults"], ".3f"),
             r.get("baseline") or "-", f"{r['ok']}/{r['runs']}", _n(r["other_load"], ".0%"), _status(r)]
            for r in kn["variants"]]
    return "\n".join([f"## DDP knobs: preset {opts.preset}, {device}", "", *facts, "",
                      "Efficiency = samples/s / (N x the matching single-device run: same accumulation and "
                      f"allocator, same repeat); medians of {opts.repeats} interleaved repeat(s). Best DDP variant: "
                      f"{kn.get('best') or '-'}.", "", *_table(head, body), *_targets(summary, "knobs"),
                      *_notes(summary, "knobs")])


def _checkpoints(summary, opts, device, facts) -> str:
    rows = summary["sections"]["checkpoints"]
    head = ["strategy", "checkpoints", "s each", "MB per rank", "MB all ranks", "largest rank's share", "step s",
            "status"]
    body = [[r["variant"], _n(r["checkpoints"], "d"), _n(r["seconds"], ".2f"),
             " / ".join(_n(b / 1e6 if b is not None else None) for b in r["bytes_per_rank"]) or "-",
             _n(r["bytes_total"] / 1e6 if r["bytes_total"] else None), _n(r["largest_share"], ".0%"),
             _n(r["step_s"], ".3f"), _status(r)] for r in rows]
    return "\n".join([f"## Checkpoints: preset {opts.preset}, {device}", "", *facts, "",
                      "Each strategy through `stnb.run` with `checkpoint_every` (a checkpoint every "
                      f"{checkpoint_interval(opts.steps)} steps), per-device batch {opts.batch_size}: the "
                      "seconds of a checkpoint (the slowest rank's, from the trainer's save to every rank's file in "
                      "place; outside the step times) and the bytes each rank wrote (/proc/self/io), medians over "
                      "every checkpoint of every repeat. The largest rank's share is 1/n where every rank writes an "
                      "equal part of the state, 100% where rank 0 writes it all.", "", *_table(head, body),
                      *_notes(summary, "checkpoints")])


_SECTIONS = {"sweep": _sweep, "launchers": _launchers, "knobs": _knobs, "checkpoints": _checkpoints}
_RATIO_NAMES = {"stnb_vs_raw": "stnb / notebook_launcher", "stnb_vs_torchrun": "stnb / torchrun",
                "raw_vs_torchrun": "notebook_launcher / torchrun", "efficiency_stnb": "efficiency, stnb.launch",
                "efficiency_raw": "efficiency, notebook_launcher", "efficiency_torchrun": "efficiency, torchrun",
                "ddp_vs_single_whole_machine": "DDP / single process on every core"}


def _targets(summary, section) -> list:
    """The targets this section measured: the knob section owns the best variant's efficiency (and the
    defaults' when no launcher comparison ran); the launcher section owns the rest."""
    knob_keys = {"efficiency_best"} | ({"efficiency_default"} if "launchers" not in summary["sections"] else set())
    mine = [t for t in summary["targets"] if (t["key"] in knob_keys) == (section == "knobs")]
    if not mine:
        return []
    rows = [[t["label"], _n(t["value"], ".3f"), f"{t['op']} {t['target']:g}", t["verdict"]] for t in mine]
    return ["", "Targets (timings never change the exit status):", "",
            *_table(["target", "value", "goal", "verdict"], rows)]


def _notes(summary, section) -> list:
    """The summary's notes that concern ``section`` (the quick-mode warning concerns every one)."""
    def not_quick(n):
        return not n.startswith("quick mode")

    elsewhere = {"sweep": not_quick, "launchers": is_concurrent,
                 "knobs": lambda n: n.startswith("time to first step"), "checkpoints": not_quick}[section]
    notes = [n for n in summary.get("notes", []) if not elsewhere(n)]
    return ["", "Notes:", "", *(f"- {n}" for n in notes)] if notes else []


def _table(head: list, body: list) -> list:
    """A markdown table; columns of numbers (or '-') are right-aligned."""
    def numeric(col):
        return all(_is_number(row[col]) for row in body) and any(row[col] != "-" for row in body)

    align = ["---:" if body and numeric(c) else "---" for c in range(len(head))]
    return ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"] + \
        ["| " + " | ".join(_cell(c) for c in row) + " |" for row in body]


def _is_number(cell) -> bool:
    try:
        float(str(cell).rstrip("x%").replace("/", ""))
        return True
    except ValueError:
        return cell == "-"


def _cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _n(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def _status(r) -> str:
    return "ok" if r["status"] == "ok" else f"{r['status']}: {(r.get('reason') or '').strip()[:100]}"


def _date(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))


def _api_call(opts: BenchOptions) -> str:
    """``stnblab.bench.bench(...)`` with the options that differ from the preset's (for runs not started
    from the command line)."""
    base = BenchOptions.from_preset(opts.preset)
    skip = {"echo", "command", "preset"}
    diff = [f"{k}={v!r}" for k, v in vars(opts).items() if k not in skip and getattr(base, k) != v]
    return f"stnblab.bench.bench(stnblab.bench.BenchOptions.from_preset({opts.preset!r}{''.join(', ' + d for d in diff)}))"
