"""The measured parts of a run's steps, read back from a RunResult: what the predictor takes and the time
split shows besides its phases.

    parts(result)         {name: mean over the steady steps of every rank} of the measured fields: forward
                          calls, backward calls, backward, optimizer.step, clipping, data wait, host seconds
                          (CUDA), the step spread (std, p50, p90), evaluation / saving between steps
    collectives(result)   per rank, {kind: {"count", "bytes"}} per steady step (``instruments.collectives``)
    grad_ready(result)    per gradient group: its share of the gradients and when (a fraction of backward)
                          its last gradient was ready, the mean over the steady steps of every rank
    sentence(result)      one line: the collectives a step sends per rank, the most frequent kind first

Where each comes from: ``stnb.timesplit.StepTimer`` (per step: ``forward_calls``, ``backward_calls``,
``backward``, ``optimizer_step``, ``clip``, ``data_wait``, ``host``, ``grad_ready``), ``stnb.instruments``'
``Collectives`` (``RunResult.collectives``) and ``OutsideSteps`` (``RunResult.outside_steps``). A result of an
older stnb lacks them: each function then returns what it has (empty, None).
"""

from __future__ import annotations

import statistics

STEP_FIELDS = ("forward_calls", "backward_calls", "backward", "optimizer_step", "clip", "data_wait")
#: where the work between steps lands in the step times: a save in the next step's, an evaluation in none (the
#: step clock resumes at its end: ``instruments.StepLog``)
OUTSIDE_STEPS = {"evaluate": "outside the step times (timed apart)",
                 "save": "in the data part of the next step: per device, not divided by the devices"}


def _as_dict(result) -> dict:
    return result.to_dict() if hasattr(result, "to_dict") else dict(result)


def _warm(r: dict) -> int:
    return int((r.get("config") or {}).get("warmup_steps_excluded", 2))


def _steady(r: dict) -> list:
    warm = _warm(r)
    return [st for split in r.get("time_split") or [] for st in (split or {}).get("steps", [])[warm:]]


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None


def parts(result) -> dict:
    """The measured fields' means over the steady steps of every rank (None where not measured)."""
    r = _as_dict(result)
    steps = _steady(r)
    out = {k: _mean(st.get(k) for st in steps) for k in STEP_FIELDS}
    hosts = [st["host"] for st in steps if st.get("host")]
    out["host"] = {k: _mean(h.get(k) for h in hosts) for k in hosts[0]} if hosts else None
    spreads = [(o or {}).get("spread") for o in r.get("outside_steps") or []]
    spreads = [s for s in spreads if s]
    out["spread"] = {k: _mean(s[k] for s in spreads) for k in ("std", "p50", "p90", "mean")} if spreads else None
    work = {}
    for o in r.get("outside_steps") or []:
        for kind, w in ((o or {}).get("work") or {}).items():
            cur = work.setdefault(kind, {"calls": 0, "seconds": 0.0, "every_steps": w.get("every_steps"), "ranks": 0})
            cur["calls"] = max(cur["calls"], w["calls"])
            cur["seconds"] = max(cur["seconds"], sum(w["seconds"]) / max(1, w["calls"]))  # per call, slowest rank
            cur["ranks"] += 1
    out["outside_steps"] = work
    return out


def collectives(result) -> list:
    """Per rank: {kind: {"count", "bytes"}}, the mean per steady step (bytes None where a call's size is
    not known: the object collectives)."""
    r = _as_dict(result)
    warm, out = _warm(r), []
    for rec in r.get("collectives") or []:
        steps = ((rec or {}).get("steps") or [])[warm:]
        per: dict = {}
        for st in steps:
            for kind, c in st.items():
                o = per.setdefault(kind, {"count": 0.0, "bytes": 0.0})
                o["count"] += c["count"] / len(steps)
                o["bytes"] = None if c["bytes"] is None or o["bytes"] is None else o["bytes"] + c["bytes"] / len(steps)
        out.append(dict(sorted(per.items(), key=lambda kv: -kv[1]["count"])))
    return out


def grad_ready(result) -> list:
    """[{"name", "share" (of the trainable numel), "ready" (fraction of backward)}] in the order the groups'
    last gradients were ready; groups never ready (no gradient) left out."""
    r = _as_dict(result)
    warm, rows = _warm(r), {}
    for split in r.get("time_split") or []:
        groups = (split or {}).get("grad_groups") or []
        total = sum(g["numel"] for g in groups) or 1
        for st in (split or {}).get("steps", [])[warm:]:
            for g, f in zip(groups, st.get("grad_ready") or []):
                if f is not None:
                    rows.setdefault(g["name"], {"name": g["name"], "share": g["numel"] / total, "ready": []})
                    rows[g["name"]]["ready"].append(f)
    out = [dict(v, ready=statistics.fmean(v["ready"])) for v in rows.values()]
    return sorted(out, key=lambda g: g["ready"])


def sentence(result) -> str:
    """The collectives a step sends, per rank (the first rank's; '' when not counted): whole calls, as a range
    where the steady steps differ (an FSDP step that evaluates gathers more), never a mean like 30.6667."""
    r = _as_dict(result)
    recs = r.get("collectives") or []
    if not recs:
        return ""
    steps = ((recs[0] or {}).get("steps") or [])[_warm(r):]
    kinds = sorted({k for st in steps for k in st}, key=lambda k: -sum(st.get(k, {}).get("count", 0) for st in steps))
    if not kinds:
        return "no collective in a step"
    counts = {k: [st.get(k, {}).get("count", 0) for st in steps] for k in kinds}
    size = sum(c["bytes"] or 0 for c in collectives(result)[0].values())
    total = _calls([sum(c[i] for c in counts.values()) for i in range(len(steps))])
    listed = ", ".join(f"{_calls(c)} {k}" for k, c in counts.items())
    return f"{total} collectives a step per rank ({listed}; {size / 2**20:.1f} MiB handed over)"


def _calls(per_step: list) -> str:
    """Whole calls in a step: '22', or '22 to 23' where the steps differ."""
    low, high = int(min(per_step)), int(max(per_step))
    return f"{low}" if low == high else f"{low} to {high}"
