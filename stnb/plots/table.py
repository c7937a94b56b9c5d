"""The normalised comparison table behind every figure of ``stnb.plots``.

``comparison_table`` turns a results table (or RunResults / dicts) into one row per run with the
columns the figures use (source, devices, label, speedup, efficiency, baseline, hover);
``reference_frame`` holds the sentence-transformers docs' published numbers in the same shape.
Also the constants that name the two sources, and ``esc`` / ``is_num``, which the traces and figures share.
"""

from __future__ import annotations

from html import escape as _escape
import math

from .. import reference
from .. import strategies
from ..models import display_name

OURS = "this machine"
REFERENCE_SOURCE = reference.SOURCE
REFERENCE_URL = reference.URL
MIB = 2**20


# ---- the published reference ----------------------------------------------------------------

def reference_frame():
    """Throughput published in the sentence-transformers documentation ("Distributed Training"),
    from ``stnb.reference``: their setup (``reference.CONDITIONS``), *their* numbers on *their*
    hardware (source column), shown for comparison, never as ours.
    """
    import pandas as pd

    rows = []
    for r in reference.rows():
        strategy, devices = r["strategy"], r["devices"]
        batch = reference.PER_DEVICE_BATCH_SIZE
        rows.append(dict(
            strategy=strategy, world_size=reference.world_size(strategy), devices=devices,
            per_device_batch_size=batch, global_batch_size=batch * devices, gradient_accumulation_steps=1,
            samples_per_second=r["samples_per_second"], published_speedup=r["published_speedup"],
            model=reference.MODEL, device=f"cuda ({reference.GPUS}x V100, p3.8xlarge)",
            max_seq_length=reference.MAX_SEQ_LENGTH,
            status="ok", reason="", verified=None, steps=None, losses=[], peak_memory_bytes=[],
            memory_breakdown=[], local_param_count=[], total_param_count=reference.MODEL_PARAMETERS, run_id="",
            launcher="published", loss="as in the sentence-transformers docs",
            source=REFERENCE_SOURCE, url=REFERENCE_URL))
    return pd.DataFrame(rows)


# ---- the normalised table ---------------------------------------------------------------------

def comparison_table(df, reference: bool = False):
    """A copy of the results table with the columns the figures use: source, devices, label,
    speedup, efficiency, baseline, hover. Accepts a DataFrame, RunResults or dicts."""
    import pandas as pd

    from ..results import RunResult, results_frame

    if isinstance(df, RunResult):
        df = [df]
    if isinstance(df, (list, tuple)):
        df = results_frame(df)
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"expected a results DataFrame (stnb.results_frame / stnb.load_results), "
                        f"got {type(df).__name__}")
    df = df.copy().reset_index(drop=True)
    if "source" in df.columns:
        df = df[df["source"].fillna(OURS) != REFERENCE_SOURCE] if reference else df
    if reference:
        df = pd.concat([df, reference_frame()], ignore_index=True)
    df = df.reset_index(drop=True)
    defaults = {"strategy": "?", "source": OURS, "status": "ok", "reason": "", "model": "?", "device": "?", "world_size": 1,
                "per_device_batch_size": None, "global_batch_size": None, "gradient_accumulation_steps": 1,
                "samples_per_second": None, "losses": None, "peak_memory_bytes": None, "memory_breakdown": None,
                "local_param_count": None, "total_param_count": None, "verified": None, "run_id": "",
                "steps": None, "launcher": "stnb"}
    for col, val in defaults.items():
        if col not in df.columns:
            df[col] = val
        df[col] = df[col].where(df[col].notna(), val) if val is not None else df[col]
    df["model_name"] = df["model"].map(display_name)   # shown: 'minilm', not the bundled model's install path
    for col in ("losses", "peak_memory_bytes", "memory_breakdown", "local_param_count"):
        df[col] = df[col].map(lambda v: list(v) if isinstance(v, (list, tuple)) else [])
    cfg = df["config"] if "config" in df.columns else pd.Series([{}] * len(df))
    for key in (*strategies.options(), "mixed_precision", "loss", "max_seq_length", "threads_per_rank"):
        from_cfg = cfg.map(lambda c, k=key: c.get(k) if isinstance(c, dict) else None)
        df[key] = df[key].where(df[key].notna(), from_cfg) if key in df.columns else from_cfg
    if "devices" not in df.columns:
        df["devices"] = None
    df["devices"] = [d if d == d and d is not None else _devices(r) for d, (_, r) in zip(df["devices"], df.iterrows())]
    df["label"] = _labels(df)
    _add_ratios(df)
    df["hover"] = [_hover(r) for _, r in df.iterrows()]
    return df


def _devices(r) -> int:
    s = strategies.get(r.get("strategy"))
    if s.distributed:
        return int(r.get("world_size") or 1)
    if s.several_devices_per_process():
        pdb, gbs = r.get("per_device_batch_size"), r.get("global_batch_size")
        acc = r.get("gradient_accumulation_steps") or 1
        if pdb and gbs and gbs == gbs:
            return max(1, int(round(gbs / (pdb * acc))))
    return 1


def _labels(df) -> list:
    base = []
    for _, r in df.iterrows():
        d = int(r["devices"]) if r["devices"] == r["devices"] else 1
        one = d == 1 and not strategies.get(r["strategy"]).distributed
        lab = r["strategy"] if one else f"{r['strategy']} ×{d}"
        if r["source"] == REFERENCE_SOURCE:
            lab += " (docs)"
        base.append(lab)
    # make labels unique: within each group of equal labels, add what differs (model, batch size, a strategy
    # option that has a label (DDP's hook), precision), then a counter for true repeats
    out = list(base)
    rows = [r for _, r in df.iterrows()]
    extras = (("model", lambda r: str(r["model_name"])), ("per_device_batch_size", lambda r: f"b{r['per_device_batch_size']}"),
              *((name, lambda r, n=name, o=o: o.label.format(_as_set(r.get(n), o.unset)))
                for name, o in strategies.options().items() if o.label),
              ("mixed_precision", lambda r: str(r.get("mixed_precision"))))
    for _col, fn in extras:
        groups = {}
        for i, lab in enumerate(out):
            groups.setdefault(lab, []).append(i)
        for lab, idx in groups.items():
            if len(idx) > 1 and len({fn(rows[i]) for i in idx}) > 1:
                for i in idx:
                    out[i] = f"{lab} · {fn(rows[i])}"
    seen = {}
    final = []
    for lab in out:
        seen[lab] = seen.get(lab, 0) + 1
        final.append(lab if seen[lab] == 1 else f"{lab} #{seen[lab]}")
    return final


def _as_set(value, unset: str):
    """An option's value as a run set it: ``unset`` for None or the NaN a results frame holds where a run's config
    did not set it; a whole number the frame's column made a float (1.0) as the int it was."""
    if value is None or value != value:
        return unset
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _add_ratios(df) -> None:
    speed, eff, base, why = [], [], [], []
    ok = df[(df["status"] == "ok") & df["samples_per_second"].map(is_num)]
    baseline = strategies.baseline_name()
    singles = ok[ok["strategy"] == baseline]
    for _, r in df.iterrows():
        if r["status"] != "ok" or not is_num(r["samples_per_second"]):
            speed.append(None), eff.append(None), base.append(""), why.append("")
            continue
        cands = singles[(singles["source"] == r["source"]) & (singles["model"] == r["model"])
                        & (singles["device"] == r["device"])]
        same_batch = cands[cands["per_device_batch_size"] == r["per_device_batch_size"]]
        cands = same_batch if len(same_batch) else cands
        if r["strategy"] == baseline and r.name in cands.index:
            b = r
        elif len(cands):
            b = cands.iloc[-1]
        else:
            speed.append(None), eff.append(None), base.append("")
            why.append(f"no {baseline!r} run of model {r['model']} on {r['device']} to compare with")
            continue
        s = float(r["samples_per_second"]) / float(b["samples_per_second"])
        d = float(r["devices"] or 1)
        speed.append(s)
        eff.append(s / d)
        base.append(f"{b['label']} ({float(b['samples_per_second']):,.1f} samples/s)")
        why.append("")
    df["speedup"], df["efficiency"], df["baseline"], df["baseline_reason"] = speed, eff, base, why
    for col in ("speedup", "efficiency"):
        df[col] = df[col].astype(float)


def _hover(r) -> str:
    def fmt(v, spec=""):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "–"
        return format(v, spec) if spec else esc(str(v))

    theirs = r["source"] == REFERENCE_SOURCE
    lines = [f"source: {esc(str(r['source']))}" + (" (published, not measured here)" if theirs else "")]
    lines.append(f"strategy: {r['strategy']} · world size: {fmt(r['world_size'])} · devices: {fmt(r['devices'])}")
    pdb, gbs = r["per_device_batch_size"], r["global_batch_size"]
    lines.append(f"batch: {fmt(pdb)} per device, {fmt(gbs)} global"
                 + (f" (accumulation {r['gradient_accumulation_steps']})"
                    if (r["gradient_accumulation_steps"] or 1) > 1 else ""))
    lines.append(f"model: {fmt(r['model_name'])} · device: {fmt(r['device'])}"
                 + (f" · seq ≤ {int(r['max_seq_length'])}" if is_num(r.get("max_seq_length")) else ""))
    if not theirs:
        lines.append(f"steps: {fmt(r['steps'])} · loss: {fmt(r.get('loss'))} · mixed precision: "
                     f"{fmt(r.get('mixed_precision'))}" + (f" · threads/rank: {int(r['threads_per_rank'])}"
                                                            if is_num(r.get("threads_per_rank")) else ""))
    own = strategies.get(r["strategy"]).options
    recorded = [v for name in own for v in [r.get(name)] if v is not None and v == v]
    if recorded and not theirs:  # the strategy's own options, as the run had them (None: what the library then uses)
        lines.append(" · ".join(f"{name}: {fmt(v) if v is not None and v == v else o.unset}"
                                for name, o in own.items() for v in [r.get(name)]))
    nums = []
    if is_num(r["samples_per_second"]):
        nums.append(f"samples/s: {float(r['samples_per_second']):,.1f}")
    if is_num(r.get("speedup")):
        nums.append(f"speedup: {r['speedup']:.2f}x over {r['baseline']}")
        nums.append(f"efficiency: {r['efficiency']:.2f}")
    if nums:
        lines.append(" · ".join(nums[:1]) + ("<br>" + " · ".join(nums[1:]) if nums[1:] else ""))
    peaks = r["peak_memory_bytes"]
    if peaks:
        lines.append("peak memory per rank: " + ", ".join(f"{p / MIB:,.0f} MiB" for p in peaks))
    if r["losses"]:
        lines.append(f"final loss: {r['losses'][-1]:.4f}")
    if not theirs:
        lines.append(f"verified: {fmt(r['verified'])} · run {fmt(r['run_id'])}")
    if r["status"] != "ok":
        lines.append(f"status: {esc(str(r['status']))}: {esc(str(r['reason']))}")
    if theirs:
        lines.append(f"from {REFERENCE_URL}")
    return "<br>".join(lines)


# ---- small helpers ----------------------------------------------------------------------------

def esc(text) -> str:
    """Escape <, > and & for plotly's HTML-like hover text (quotes stay readable)."""
    return _escape(str(text), quote=False)


def is_num(v) -> bool:
    """True for a number that is not NaN (None, NaN and non-numbers are not)."""
    try:
        return v is not None and not math.isnan(float(v))
    except (TypeError, ValueError):
        return False
