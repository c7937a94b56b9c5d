"""Summary: what a bench's rows say, as numbers and as plain-text tables (no I/O).

``summarize`` takes the plan's items and the latest row of each and gives, per section, the medians (pandas)
per variant, the launcher ratios and knob efficiencies (medians of per-repeat ratios), the verdict
on each performance target (``TARGETS``) and notes. ``format_summary`` prints it; ``knobs_frame``
gives the knob comparison as a DataFrame.
"""

from __future__ import annotations

import pandas as pd

from stnb.errors import ConfigError
from .load import NOISY
from .options import BenchOptions
from .planning import is_concurrent

#: performance targets: (key, label, comparison, threshold)
TARGETS = {
    "stnb_vs_raw": ("stnb DDP / raw notebook_launcher DDP (samples/s)", ">=", 0.98),
    "stnb_vs_torchrun": ("stnb DDP / torchrun DDP (samples/s)", ">=", 1.00),
    "overhead": ("stnb launch overhead: result channel, watchdog, per-rank logs", "<=", 0.02),
    "efficiency_default": ("scaling efficiency, DDP defaults (vs N x 1 device)", ">=", 0.95),
    "efficiency_best": ("scaling efficiency, best DDP knobs (vs N x 1 device)", ">=", 0.95),
}


#: what a variant's row gives as the median over its repeats (``DataFrame.median``)
MEDIANS = ["samples_per_second", "time_to_first_step_s", "step_s", "mfu", "tokens_per_sample", "other_load"]


def bench_tag(row) -> dict:
    """The bench's bookkeeping of a result row (``config.extra['bench']``: section, name, key...)."""
    return ((row.get("config") or {}).get("extra") or {}).get("bench") or {}


def _median(xs):
    """The median of the numbers in ``xs`` (None and NaN left out); None when there are none."""
    return _number(pd.Series([x if isinstance(x, (int, float)) else None for x in xs], dtype=float).median())


def _number(v):
    return None if pd.isna(v) else float(v)


def _steady_step_s(row) -> float | None:
    st = row.get("step_times") or []
    warm = (row.get("config") or {}).get("warmup_steps_excluded", 0)
    return _median(st[warm:])


def summarize(items, latest: dict, opts: BenchOptions) -> dict:
    """Medians per variant, per-repeat ratios and their medians, and the targets (no I/O)."""
    by = {}  # (section, name) -> {repeat: row}
    for it in items:
        row = latest.get(it.key)
        if row is not None:
            by.setdefault((it.section, it.name), {})[it.repeat] = row
    baseline_of = {(it.section, it.name): it.baseline for it in items}
    out = {"sections": {}, "targets": [], "notes": []}

    def ok(row):
        return row is not None and row.get("status") == "ok" and row.get("samples_per_second")

    def variant_stats(section, name):
        reps = by.get((section, name), {})
        good = [r for r in reps.values() if ok(r)]
        measured = pd.DataFrame(
            [{"samples_per_second": r["samples_per_second"], "time_to_first_step_s": r.get("time_to_first_step_s"),
              "step_s": _steady_step_s(r), "mfu": (r.get("mfu") or {}).get("mfu"),
              "tokens_per_sample": (r.get("mfu") or {}).get("tokens_per_sample"),
              "other_load": bench_tag(r).get("foreign_cpu_share")} for r in good],
            columns=MEDIANS, dtype=float)
        st = {"variant": name, "runs": len(reps), "ok": len(good),
              **{k: _number(v) for k, v in measured.median().items()},  # each column's median over the repeats
              "min": _number(measured["samples_per_second"].min()), "max": _number(measured["samples_per_second"].max()),
              "global_batch_size": good[0]["global_batch_size"] if good else None,
              "world_size": good[0]["world_size"] if good else None,
              "launcher": good[0].get("launcher") if good else None,
              "verified": all(r.get("verified") for r in good) if good else None,
              "status": "ok" if good else next((r.get("status") for r in reps.values()), "missing"),
              "reason": "" if good else next((r.get("reason", "") for r in reps.values()), "")}
        return st

    def ratio(section, a, b, factor=1.0):
        """median over repeats of sps(a, r) / (factor * sps(b, r)) (pairs from the same repeat)."""
        ra, rb = by.get((section, a), {}), by.get((section, b), {})
        vals = [ra[k]["samples_per_second"] / (factor * rb[k]["samples_per_second"])
                for k in ra if k in rb and ok(ra[k]) and ok(rb[k])]
        return (_median(vals), vals)

    names_in = {}
    for it in items:
        names_in.setdefault(it.section, [])
        if it.name not in names_in[it.section]:
            names_in[it.section].append(it.name)

    if "sweep" in names_in:
        out["sections"]["sweep"] = [variant_stats("sweep", n) for n in names_in["sweep"]]

    if "launchers" in names_in:
        names = names_in["launchers"]
        rows = [variant_stats("launchers", n) for n in names]
        dev1 = names[0] if names[0].startswith("single 1") else next((n for n in names if n.startswith("single")),
                                                                    None)
        nproc = next((r["world_size"] for r in rows if r["variant"] == "ddp stnb.launch" and r["world_size"]), None)
        nproc = nproc or opts.comparison_nproc or 2
        ratios = {}
        ratios["stnb_vs_raw"] = ratio("launchers", "ddp stnb.launch", "ddp notebook_launcher")
        ratios["stnb_vs_torchrun"] = ratio("launchers", "ddp stnb.launch", "ddp torchrun")
        ratios["raw_vs_torchrun"] = ratio("launchers", "ddp notebook_launcher", "ddp torchrun")
        if dev1:
            ratios["efficiency_stnb"] = ratio("launchers", "ddp stnb.launch", dev1, nproc)
            ratios["efficiency_raw"] = ratio("launchers", "ddp notebook_launcher", dev1, nproc)
            ratios["efficiency_torchrun"] = ratio("launchers", "ddp torchrun", dev1, nproc)
        whole = next((n for n in names if "whole machine" in n), None)
        if whole:
            ratios["ddp_vs_single_whole_machine"] = ratio("launchers", "ddp stnb.launch", whole)
        out["sections"]["launchers"] = {"variants": rows, "ratios": {k: v[0] for k, v in ratios.items()},
                                        "ratio_samples": {k: v[1] for k, v in ratios.items()},
                                        "nproc": nproc, "baseline": dev1}
        out["notes"].append(
            "time to first step: stnb.launch and notebook_launcher fork this process, which has already imported "
            "torch / transformers / sentence-transformers (like a notebook kernel that has trained once); torchrun "
            "starts fresh interpreters that import them, which is part of its time to the first step.")
        r = out["sections"]["launchers"]["ratios"]
        out["targets"].append(target_verdict("stnb_vs_raw", r.get("stnb_vs_raw")))
        out["targets"].append(target_verdict("stnb_vs_torchrun", r.get("stnb_vs_torchrun")))
        ov = None if r.get("stnb_vs_raw") is None else 1.0 - r["stnb_vs_raw"]
        out["targets"].append(target_verdict("overhead", ov))
        out["targets"].append(target_verdict("efficiency_default", r.get("efficiency_stnb")))

    if "knobs" in names_in:
        names = names_in["knobs"]
        rows = []
        for nme in names:
            st = variant_stats("knobs", nme)
            b = baseline_of.get(("knobs", nme))
            st["baseline"] = b
            st["efficiency"] = None
            if b:
                world = st["world_size"] if nme.startswith("ddp") else None
                if nme.startswith("ddp"):
                    factor = world or opts.comparison_nproc or 2
                else:  # N x single at once: samples/s summed over N runs
                    factor = _concurrent_n(by.get(("knobs", nme), {})) or 2
                st["efficiency"] = ratio("knobs", nme, b, factor)[0]
            st["vs_defaults"] = ratio("knobs", nme, "ddp defaults")[0] if nme.startswith("ddp") else None
            rows.append(st)
        out["sections"]["knobs"] = {"variants": rows}
        ddp_rows = [r for r in rows if r["variant"].startswith("ddp") and r["efficiency"] is not None]
        best = max(ddp_rows, key=lambda r: r["efficiency"], default=None)
        out["sections"]["knobs"]["best"] = best["variant"] if best else None
        t = target_verdict("efficiency_best", best["efficiency"] if best else None)
        if best:
            t["label"] += f": {best['variant'][4:]}"
        out["targets"].append(t)
        dflt = next((r for r in rows if r["variant"] == "ddp defaults"), None)
        conc = next((r for r in rows if is_concurrent(r["variant"])), None)
        if conc and conc["efficiency"] is not None:
            out["notes"].append(
                f"{conc['variant']}: {conc['efficiency']:.3f} of the N x 1-device limit. That is what sharing "
                "the machine costs with no communication at all (memory bandwidth, caches, clocks); the rest of "
                "DDP's gap is all-reduce and synchronisation.")
        if dflt and dflt["efficiency"] is not None and "launchers" not in names_in:
            out["targets"].insert(0, target_verdict("efficiency_default", dflt["efficiency"]))
    if "checkpoints" in names_in:
        out["sections"]["checkpoints"] = [
            _checkpoint_cost(variant_stats("checkpoints", n), [r for r in by.get(("checkpoints", n), {}).values()
                                                               if ok(r)])
            for n in names_in["checkpoints"]]
    shares = [(bench_tag(r).get("foreign_cpu_share"), key) for key, reps in by.items() for r in reps.values()
              if ok(r) and key[0] != "sweep"]
    noisy = [x for x in shares if x[0] is not None and x[0] > NOISY]
    if noisy:
        out["notes"].append(
            f"{len(noisy)} of {len(shares)} compared runs shared the machine with other work (other processes used "
            f"more than {NOISY:.0%} of the CPUs, up to {max(x[0] for x in noisy):.0%}); their timings are not "
            "trustworthy. Re-run on a quiet machine (--quiet-wait 300 waits for one before each run).")
    if opts.preset == "quick":
        out["notes"].append("quick mode: tiny random model and a few steps. It checks that every section runs; "
                            "its timings are not the measurement (run the bench without --quick for that).")
    out["notes"].append("Raw DDP on a 2-core CPU machine was measured at 0.80-0.88 of the 2-core limit "
                        "(issue); the limit is 2 x a 1-thread single process, measured in the same repeat.")
    return out


def _checkpoint_cost(st: dict, rows: list) -> dict:
    """A checkpoints-section variant's cost: seconds per checkpoint (the slowest rank's, median over every
    checkpoint of every repeat), each rank's bytes per checkpoint (median), their sum and the largest rank's share
    of it (1/n when every rank writes its part)."""
    saves = [c for r in rows for c in (r.get("checkpoints") or [])]
    world = max((len(c.get("bytes_written") or []) for c in saves), default=0)
    per_rank = [_median([(c.get("bytes_written") or [None] * world)[i] for c in saves]) for i in range(world)]
    total = sum(per_rank) if per_rank and None not in per_rank else None
    return {**st, "checkpoints": len(rows[0].get("checkpoints") or []) if rows else None,
            "seconds": _median([c.get("seconds") for c in saves]), "bytes_per_rank": per_rank, "bytes_total": total,
            "largest_share": max(per_rank) / total if total else None}


def _concurrent_n(reps: dict) -> int | None:
    for r in reps.values():
        runs = (r.get("verification") or {}).get("independent_runs")
        if runs:
            return len(runs)
    return None


def target_verdict(key, value) -> dict:
    """The verdict on performance target ``key`` (``TARGETS``) for ``value``: PASS, BELOW or n/a."""
    label, op, thr = TARGETS[key]
    if value is None:
        verdict = "n/a"
    elif op == ">=":
        verdict = "PASS" if value >= thr else "BELOW"
    else:
        verdict = "PASS" if value <= thr else "BELOW"
    return {"key": key, "label": label, "value": value, "op": op, "target": thr, "verdict": verdict}


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def _f(v, spec=".1f", dash="-"):
    return dash if v is None else format(v, spec)


def _table(rows: list, left: int = 1) -> list:
    """``rows`` (one dict per row, its columns in order) as text lines, aligned by pandas: the first ``left``
    columns (names) to the left, the rest (numbers) to the right; a column empty in every row (no run failed: no
    "why not") is left out."""
    import pandas as pd

    if not rows:
        return []
    frame = pd.DataFrame(rows).astype(str)
    frame = frame[[c for c in frame if (frame[c] != "").any()]]
    for c in list(frame)[:left]:  # padded to the column's width, header included, they read from the left
        width = max(len(c), frame[c].str.len().max())
        frame = frame.rename(columns={c: c.ljust(width)})
        frame[c.ljust(width)] = frame[c.ljust(width)].str.ljust(width)
    return frame.to_string(index=False).splitlines()


def _status(r: dict) -> str:
    return r["status"] if r["status"] == "ok" else r["status"] + ": " + r["reason"][:70]


def format_summary(s: dict) -> str:
    """The summary as plain-text tables."""
    lines = []
    sw = s["sections"].get("sweep")
    if sw:
        lines.append("== sweep (stnb.run) ==")
        lines += _table([{"run": r["variant"], "samples/s": _f(r["samples_per_second"]), "MFU": _f(r.get("mfu"), ".1%"),
                          "tokens/sample": _f(r.get("tokens_per_sample")), "step s": _f(r["step_s"], ".3f"),
                          "global batch": _f(r["global_batch_size"], "d"),
                          "first step s": _f(r["time_to_first_step_s"]), "status": _status(r)} for r in sw])
        lines.append("")
    la = s["sections"].get("launchers")
    if la:
        lines.append(f"== launchers: the same DDP train_rank, {la['nproc']} ranks (median of repeats) ==")
        lines += _table([{"variant": r["variant"], "samples/s": _f(r["samples_per_second"]),
                          "[min - max]": f"[{_f(r['min'])} - {_f(r['max'])}]" if r["ok"] else r["status"],
                          "step s": _f(r["step_s"], ".3f"), "first step s": _f(r["time_to_first_step_s"]),
                          "runs": f"{r['ok']}/{r['runs']}", "other load": _pct(r["other_load"]),
                          "why not": "" if r["ok"] or not r["reason"] else r["reason"].splitlines()[0][:110]}
                         for r in la["variants"]])
        names = {"stnb_vs_raw": "stnb / notebook_launcher", "stnb_vs_torchrun": "stnb / torchrun",
                 "raw_vs_torchrun": "notebook_launcher / torchrun",
                 "efficiency_stnb": f"efficiency stnb = DDP / ({la['nproc']} x {la['baseline']})",
                 "efficiency_raw": "efficiency notebook_launcher", "efficiency_torchrun": "efficiency torchrun",
                 "ddp_vs_single_whole_machine": "DDP / single process on every core"}
        lines.append("ratios (median of the per-repeat ratios):")
        lines += _table([{"ratio": names[k], "value": _f(v, ".3f"), "repeats": len(la["ratio_samples"].get(k) or [])}
                         for k, v in la["ratios"].items() if k in names])
        lines.append("")
    kn = s["sections"].get("knobs")
    if kn:
        lines.append("== DDP knobs (stnb.launch), efficiency = samples/s / (N x matching 1-device baseline) ==")
        lines += _table([{"variant": r["variant"], "samples/s": _f(r["samples_per_second"]),
                          "step s": _f(r["step_s"], ".3f"), "efficiency": _f(r["efficiency"], ".3f"),
                          "vs defaults": _f(r["vs_defaults"], ".3f"), "runs": f"{r['ok']}/{r['runs']}",
                          "other load": _pct(r["other_load"]),
                          "why not": "" if r["ok"] or not r["reason"] else
                          f"{r['status']}: {r['reason'].splitlines()[0][:110]}"} for r in kn["variants"]])
        lines.append("")
    ck = s["sections"].get("checkpoints")
    if ck:
        lines.append("== checkpoints: seconds (slowest rank) and MB each rank wrote, per checkpoint (medians) ==")
        lines += _table([{"strategy": r["variant"], "checkpoints": _f(r["checkpoints"], "d"),
                          "s each": _f(r["seconds"], ".2f"),
                          "MB per rank": " / ".join(_f(b / 1e6 if b is not None else None)
                                                    for b in r["bytes_per_rank"]) or "-",
                          "MB all": _f(r["bytes_total"] / 1e6 if r["bytes_total"] else None),
                          "largest rank": _pct(r["largest_share"]), "step s": _f(r["step_s"], ".3f"),
                          "status": _status(r)} for r in ck])
        lines.append("")
    if s["targets"]:
        lines.append("== targets ==")
        lines += _table([{"verdict": t["verdict"], "target": t["label"],
                          "value": "-" if t["value"] is None else (f"{t['value'] * 100:.1f} %" if t["key"] == "overhead"
                                                                   else f"{t['value']:.3f}"),
                          "asked": f"{t['op']} " + (f"{t['target'] * 100:.0f} %" if t["key"] == "overhead"
                                                    else f"{t['target']:.2f}")} for t in s["targets"]], left=2)
        lines.append("")
    for n in s.get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines).rstrip()


def knobs_frame(report) -> "object":
    """The DDP-knob comparison of a BenchReport (or its summary) as a DataFrame, one row per variant:
    samples/s (median of repeats), scaling efficiency against N x the matching single-device run,
    ratio to DDP defaults, the baseline used, and whether every run verified."""
    import pandas as pd

    summary = report.summary if hasattr(report, "summary") else report
    section = summary.get("sections", {}).get("knobs")
    if not section:
        raise ConfigError("this bench ran no DDP-knob comparison; run it with sections=('knobs',) "
                          "(CLI: --ddp-knobs)")
    cols = ["variant", "samples_per_second", "efficiency", "vs_defaults", "baseline", "verified", "ok", "runs",
            "status", "reason"]
    return pd.DataFrame([{c: r.get(c) for c in cols} for r in section["variants"]], columns=cols)

