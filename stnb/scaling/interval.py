"""A prediction as an interval: every uncertain input at its low and high end, all combinations.

A prediction's inputs each carry a range (``stnb.scaling.Range``, or a link preset's bandwidth and
per-collective cost ranges): the link's bus bandwidth, the fixed cost per collective, a CPU rank's slowdown on
cores shared with the other ranks (the loopback link, measured), the optimizer's share of
a step that was not measured, the model calls per step, a rank's step spread (the slowest of n sets the
pace), DataParallel's host share, FSDP's host work per collective (a one-rank run against the single one).
``scenarios lists the all-mid point and every combination of the ends
(2^k for k inputs that have a width); the interval of a row is the lowest and highest samples/s over them.
``dominant`` names the input whose range alone (the others at their mids) moves the row the most: the
assumption to measure first. ``suspect`` flags a row that contradicts what a step model can honestly give:
faster than linear, or a strategy sharding the parameters ahead of one that replicates them on a model
that fits one device.
"""

from __future__ import annotations

from itertools import product

FABRIC_KNOBS = {"bandwidth": "link bus bandwidth", "launch": "per-collective fixed cost",
                "sharing": "CPU cores shared by the ranks"}
KNOBS = ("optimizer", "forward_calls", "spread", "host_fraction", "collective_host", *FABRIC_KNOBS)


def widths(ranges, fab) -> list:
    """The names of the inputs that have a width here (zero-width ranges add nothing)."""
    names = [r.name for r in ranges if r.low != r.high]
    link, net = fab.link, fab.network
    if link.bandwidth_range or link.tiers or (net.bandwidth_range and link.per_node):
        names.append("bandwidth")
    if len(set(link.launch)) > 1 or (link.per_node and len(set(net.launch)) > 1):
        names.append("launch")
    if any(lo != hi for _, lo, _, hi in link.sharing):
        names.append("sharing")
    return names


def scenarios(names) -> list:
    """The all-mid point first, then every combination of the low and high ends: dicts name -> end."""
    out = [{n: "mid" for n in names}]
    out += [dict(zip(names, ends)) for ends in product(("low", "high"), repeat=len(names))]
    return out


def one_at_a_time(names) -> list:
    """(name, end, scenario) with one input at an end and the others at their mids."""
    return [(n, e, {**{k: "mid" for k in names}, n: e}) for n in names for e in ("low", "high")]


def label(name: str, ranges) -> str:
    for r in ranges:
        if r.name == name:
            return r.label or r.name
    return FABRIC_KNOBS.get(name, name)


def suspects(rows: list, strategy_of) -> None:
    """Set each row's ``suspect`` (a reason, or ''): a speed-up above its device count (at the mid or the
    high end), or a parameter-sharding strategy ahead of the best replicating one at the same device count
    on a model that fits one device. ``strategy_of(name)`` is the registry's strategy for a row's name."""
    for r in rows:
        r.setdefault("suspect", "")
    best_replicated = {}
    for r in rows:
        s = strategy_of(r["strategy"])
        if r["samples_per_second"] and s.distributed and not s.sharded:
            n = r["devices"]
            if r["samples_per_second"] > best_replicated.get(n, (0, ""))[0]:
                best_replicated[n] = (r["samples_per_second"], r["strategy"])
    for r in rows:
        n, sps = r["devices"], r["samples_per_second"]
        if not sps or n < 2:
            continue
        why = []
        linear = n * (1 + 1e-9)
        if max(r["speedup"], r.get("speedup_high") or 0) > linear:  # the high end is at least the mid
            at = "mid" if r["speedup"] > linear else "high end"
            val = r["speedup"] if at == "mid" else r["speedup_high"]
            why.append(f"faster than linear ({val:.2f}x on {n} devices at its {at}): the model's per-device step is "
                       "shorter than one device's, which only the optimizer stepping 1/n of the parameters gives; "
                       "the single step's optimizer share decides it")
        s = strategy_of(r["strategy"])
        if "params" in s.sharded and r.get("fits", True) and n in best_replicated and sps > best_replicated[n][0]:
            other, name = best_replicated[n]
            why.append(f"ahead of {name} ({sps:,.0f} vs {other:,.0f} samples/s) on a model that fits one device: "
                       f"it moves more bytes per step than {name}; only its sharded optimizer puts it ahead")
        r["suspect"] = "; ".join(why)
