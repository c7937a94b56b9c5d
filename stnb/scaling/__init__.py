"""Predict before you buy: samples/s of N devices from one measured run and a link model, as an interval.

    pred = stnb.predict(result, devices=[2, 4, 8, 64, 512], link="nvlink-v100")
    pred.table          one row per strategy and device count: low, samples/s (all inputs at their mids),
                        high, speed-up, efficiency, step split, the dominant input, a suspect flag
    pred.assumptions    what the numbers rest on (the link's sources, the split's origin, every range)
    pred.figure         predicted samples/s per device count, each interval a band (``stnb.predict`` adds it)

``stnb.scaling.predict`` is the pure computation (no plot); ``stnb.predict`` adds the figure.
The run's measured time split (``RunResult.time_split``) gives forward, backward compute, optimizer
(``optimizer.step`` and clipping, each measured) and the rest; its model shape gives the bytes; each rank's
step spread (``RunResult.outside_steps``) the slowest-of-n wait; the forwards it counted the model calls
per step; each gradient group's ready time the order DDP's buckets fill (``stnb.stepparts`` reads them
back; ``Prediction.assumptions`` says which inputs were measured and which assumed). ``links`` holds the
presets (bus bandwidth ranges with their sources) and the collective costs, ``model`` what a step model
takes (each strategy has its own, ``Strategy.step_time``, asked of the registry), ``interval`` the ranges'
combinations and the suspect flags, ``calibrate`` measures this machine's loopback (the 'loopback' link).
The predictor checked on two published tables from their 1-GPU rows (the sentence-transformers docs' 4x
V100; DeepLearningExamples' BERT-large on a DGX-1) is the lab's: ``stnblab.scaling``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from .. import stepparts
from .. import strategies as registry  # ``predict`` takes an argument named strategies
from .links import KNOWN as LINKS, PRESETS, Fabric, Link, custom, fabric
from .model import Measured, Range, Uncertain
from ..strategies import stepcost

MIN_STEADY_STEPS = 3
SAME_SPEED = "every added device computes as fast"
HOST_PER_COLLECTIVE = "FSDP's host work per collective"
SHARED = "a rank's compute among n ranks on this machine's cores"
PHASES = ("forward", "backward_compute", "optimizer", "data", "other")

__all__ = ["predict", "compare", "verdict", "Prediction", "Measured", "Link", "Fabric", "custom", "fabric", "from_result",
           "LINKS", "PRESETS", "known", "MIN_STEADY_STEPS", "Range", "Uncertain"]


@dataclass
class Prediction:
    table: object                  # pandas DataFrame
    assumptions: list
    measured: Measured
    fabric: Fabric
    figure: object = None
    extra: dict = field(default_factory=dict)

    def row(self, strategy: str, devices: int) -> dict:
        t = self.table
        hit = t[(t["strategy"] == strategy) & (t["devices"] == devices)]
        if hit.empty:
            raise KeyError(f"no prediction for {strategy!r} on {devices} devices")
        return hit.iloc[0].to_dict()

    def _ipython_display_(self):
        from IPython.display import Markdown, display

        cols = ["strategy", "devices", "low", "samples_per_second", "high", "speedup", "efficiency", "step_ms",
                "comm_exposed_ms", "dominant", "suspect", "note"]
        display(self.table[cols].round(2))
        if self.figure is not None:
            display(self.figure)
        display(Markdown("**Assumptions**\n\n" + "\n".join(f"- {a}" for a in self.assumptions)))


def known() -> tuple:
    """The strategies the predictor has a step model for (``Strategy.step_time``): those the bench measures
    (``Strategy.bench``: the published comparison's single, dp, ddp, fsdp) first, then the others, each
    group in the registry's order."""
    return tuple(s.name for s in sorted(registry.all_strategies(), key=lambda s: not s.bench)
                 if s.step_time is not None)


def predict(result, devices=(2, 4, 8), link="loopback", strategies=None, network="100gbps",
            host_fraction=None, measured=None, threads_per_rank=None, one_rank=None) -> Prediction:
    """Predicted samples/s on each device count for each strategy, as an interval (a Prediction, no figure).

    strategies: names (or one name); None: every strategy with a step model (``known()``). A name its
        strategy's ``aka`` spells (e.g. 'zero3' for fsdp) is that strategy's model, shown under that name.
    result: a RunResult (or its dict) measured with stnb; its time split, model shape, step spread and
        text columns are the inputs. None with ``measured`` (a Measured, or an ``Uncertain`` whose inputs
        carry ranges, e.g. ``stnblab.scaling.seed.measured()``).
    link: a preset name (``stnb.scaling.LINKS``; 'loopback' is measured here) or a ``Link``.
    network: the link between nodes when devices exceed what one node holds on ``link``.
    host_fraction: DataParallel's single-process limit (see ``stnb.strategies.dp``): a share, a
        (low, mid, high) range, or None (left out).
    threads_per_rank: on 'loopback' from a CPU run, the torch threads each of the n ranks would get (default
        cores / n, what ``stnb.run`` gives them): n ranks share this machine's cores, and how much slower each
        computes than the run did is measured here (``calibrate.sharing``), one more range of the prediction.
    one_rank: a one-rank FSDP run of the same settings (``stnblab.scaling.one_rank``): its step beyond the single
        run's, over the collectives it would send, is FSDP's host work per collective (``collective_host``).

    The table's ``samples_per_second`` is the all-mid prediction; ``low`` and ``high`` the interval over
    every combination of the inputs' ends (``stnb.scaling.interval``); ``dominant`` the input whose range
    moves the row most; ``suspect`` a reason the row is not to be trusted, or ''.
    """
    from . import interval

    strategies = _check_strategies(strategies)
    devices = _check_devices(devices)
    if threads_per_rank is not None:
        _check_threads(threads_per_rank)
    if not isinstance(link, Link) and link not in LINKS:
        fabric(link, network)  # refuses an unknown link with the list
    unc = _uncertain(measured if measured is not None else uncertain_from_result(result))  # refuses a short run first
    unc, hf_range = _with_host_fraction(unc, host_fraction)
    if one_rank is not None:
        unc = _with_collective_host(unc, collective_host(result, one_rank))
    fab = fabric(link, network)  # 'loopback' is measured here (once per process)
    fab = _on_shared_cores(fab, link, unc.mid().threads, devices, threads_per_rank)
    names = interval.widths(unc.ranges, fab)
    base_model = _model(registry.baseline_name())

    def evaluate(ends):
        values = {r.name: getattr(r, ends.get(r.name, "mid")) for r in unc.ranges}
        m = unc.build(values)
        f = fab.at(bandwidth=ends.get("bandwidth", "mid"), launch=ends.get("launch", "mid"),
                   sharing=ends.get("sharing", "mid"))
        hf = values.get("host_fraction", host_fraction if hf_range is None else None)
        base = base_model.step_time(m, f, 1)["step"]
        out = {}
        for s in strategies:
            model = _model(s)
            for n in ([1] if model.pinned_to_one_gpu() else devices):
                r = model.step_time(_computing(m, f.compute_factor(n)), f, n, hf)
                if r["feasible"]:
                    r = dict(r, step=r["step"] + m.step_spread * stepcost.slowest_of(n))
                out[s, n] = (r, n * m.batch / r["step"] if r["feasible"] else None, base, m)
        return out

    mid = evaluate({k: "mid" for k in names})
    corners = [evaluate(e) for e in interval.scenarios(names)[1:]]
    alone = [(name, evaluate(e)) for name, _, e in interval.one_at_a_time(names)]
    rows = []
    for (s, n), (r, sps, base, m) in mid.items():
        row = {"strategy": s, "devices": n, "link": fab.link.name, "samples_per_second": sps,
               "low": None, "high": None, "speedup": sps * base / m.batch if sps else None,
               "efficiency": sps * base / m.batch / n if sps else None,
               "step_ms": _ms(r["step"]), "comm_ms": _ms(r["comm"]), "comm_exposed_ms": _ms(r["comm_exposed"]),
               "dominant": "", "suspect": "", "fits": m.fits, "note": r["note"]}
        if sps:
            every = [c[s, n][1] for c in corners] + [sps]
            row["low"], row["high"] = min(every), max(every)
            # the highest speed-up over the scenarios (each against its own single step)
            row["speedup_high"] = max([c[s, n][1] * c[s, n][2] / c[s, n][3].batch for c in corners] + [row["speedup"]])
            swing = {}
            for name, res in alone:
                swing.setdefault(name, []).append(res[s, n][1])
            if swing:
                name = max(swing, key=lambda k: max(swing[k]) - min(swing[k]))
                if max(swing[name]) > min(swing[name]):
                    row["dominant"] = interval.label(name, unc.ranges)
        rows.append(row)
    interval.suspects(rows, _model)
    import pandas as pd

    m = unc.mid()
    return Prediction(pd.DataFrame(rows).drop(columns=["fits"]), assumptions(m, fab, host_fraction, unc.ranges),
                      m, fab, extra={"ranges": unc.ranges, "inputs": names})


def _with_collective_host(unc: Uncertain, r: Range) -> Uncertain:
    """FSDP's host work per collective as one more range of the prediction."""
    return Uncertain(unc.ranges + (r,), lambda values, build=unc.build: replace(build(values),
                                                                                collective_host=values[r.name]))


def _on_shared_cores(fab: Fabric, link, threads: int, devices, threads_per_rank) -> Fabric:
    """The loopback link from a CPU run (``threads``: its threads per process): n ranks share this machine's cores,
    each with ``threads_per_rank`` threads (default cores / n); their slowdown against the run, measured here with
    as many ranks as stnb starts here (one per core at most). Beyond the cores: machines like this one, each full."""
    if link != "loopback" or not threads:
        return fab
    from .. import hardware
    from . import calibrate

    cores = hardware.cpu_cores()
    here = tuple(sorted({min(n, cores) for n in devices}))
    measured, how = calibrate.sharing(here, threads, tuple(threads_per_rank or max(1, cores // k) for k in here))
    by = {n: ends for n, *ends in measured}
    if max(devices) > cores:
        how += f"; beyond {cores} ranks: machines like this one, {cores} ranks each (its {cores}-rank probe)"
    rows = tuple((n, *by[min(n, cores)]) for n in devices)
    return replace(fab, link=replace(fab.link, sharing=rows, sharing_source=how))


def _check_threads(threads) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads_per_rank must be a whole number >= 1 (got {threads!r})")


def _computing(m: Measured, factor: float) -> Measured:
    """One rank's step when it computes ``factor`` times slower than the measured run (CPU ranks sharing cores:
    every part of a CPU step is the cores' work)."""
    if factor == 1.0:
        return m
    return replace(m, forward=m.forward * factor, backward=m.backward * factor, optimizer=m.optimizer * factor,
                   other=m.other * factor)


def _uncertain(m) -> Uncertain:
    """A Measured as an Uncertain with no ranges (or the Uncertain as it is)."""
    if isinstance(m, Uncertain):
        return m
    return Uncertain((), lambda values, m=m: m)


def _with_host_fraction(unc: Uncertain, host_fraction):
    """host_fraction given as (low, mid, high): one more range of the prediction."""
    if host_fraction is None or isinstance(host_fraction, (int, float)):
        return unc, None
    lo, mid, hi = host_fraction
    r = Range("host_fraction", lo, mid, hi, "DataParallel's host share", "given")
    return Uncertain(unc.ranges + (r,), unc.build), r


def assumptions(m: Measured, fab: Fabric, host_fraction=None, ranges=()) -> list:
    hf = host_fraction if host_fraction is None or isinstance(host_fraction, (int, float)) else host_fraction[1]
    out = [f"one device's step ({m.source}), at the mids: forward {m.forward * 1e3:.1f} ms "
           f"({m.forward_calls:g} call(s) of the model), backward {m.backward * 1e3:.1f} ms, "
           f"optimizer {m.optimizer * 1e3:.1f} ms, rest {m.other * 1e3:.1f} ms for {m.batch} samples; "
           + ("each of n ranks computes slower on this machine's shared cores (below)" if fab.link.sharing else
              "every added device computes as fast"),
           f"link inside a node: {fab.link.describe()}",
           f"between nodes ({fab.link.per_node} devices per node): {fab.network.describe()}"
           if fab.link.per_node else "the link is a network: any number of devices, one per node",
           f"collectives: ring costs (nccl-tests doc/PERFORMANCE.md), latency + size / bus bandwidth; gradients "
           f"{m.grad_bytes / 2**20:.0f} MiB in {m.bucket_bytes / 2**20:.0f} MiB buckets ("
           + ("each ready when the measured gradient group filling it was" if m.ready else
              f"the root's {m.root_fraction:.0%}, the embeddings, ready only at backward's end") + "), parameters "
           f"{m.param_bytes / 2**20:.0f} MiB (FSDP gathers {(m.gather_bytes or m.param_bytes) / 2**20:.0f} MiB); FSDP units: "
           f"{m.layers} layers + the root",
           "communication overlaps compute" if fab.overlap else
           "communication counts in full (CPU: gloo's thread reduces on the cores the ranks compute on, so what "
           "overlaps slows compute as much)",
           "DataParallel: the GIL's serialisation of the replicas is left out (host_fraction=None)"
           if hf is None else f"DataParallel: host busy {hf:.0%} of a step at the mid, serialised "
                              "across the replicas by the GIL",
           "DataParallel's scatter of the inputs and gather of the outputs (tokens and embeddings: kilobytes "
           "against the parameters' megabytes) are left out",
           f"stragglers: every synchronised step waits for the slowest of n ranks, E[max of n normals] x a rank's "
           f"step spread ({m.step_spread * 1e3:.2f} ms at the mid)"]
    if fab.link.sharing:
        out.append("CPU cores shared: a rank's compute x " + ", ".join(
            f"{lo:.2f} / {mid:.2f} / {hi:.2f} on {n} ranks" for n, lo, mid, hi in fab.link.sharing)
            + " (low / mid / high) against the run")
    out += [f"range: {r.describe()}" for r in ranges]
    inputs = list(m.inputs)
    if any(r.name == "collective_host" for r in ranges):  # measured: its range line above says how
        inputs = [i for i in inputs if i[0] != HOST_PER_COLLECTIVE]
    if fab.link.sharing:
        inputs = [i for i in inputs if i[0] != SAME_SPEED] + [(SHARED, "measured", fab.link.sharing_source)]
    if inputs:
        out += [f"{how.upper()}: {name}" + (f" ({what})" if what else "") for name, how, what in inputs]
    return out + list(m.notes)


def compare(pred: Prediction, measured) -> dict:
    """A prediction against a measured run of the same strategy and device count: both samples/s and
    the error (predicted / measured - 1)."""
    m = measured.to_dict() if hasattr(measured, "to_dict") else dict(measured)
    row = pred.row(m["strategy"], int(m["world_size"]))
    return {"strategy": m["strategy"], "devices": int(m["world_size"]), "predicted": row["samples_per_second"],
            "measured": m["samples_per_second"], "error": row["samples_per_second"] / m["samples_per_second"] - 1}


def verdict(pred: Prediction, strategy: str = "ddp", devices: int = 2) -> str:
    """One sentence: what ``devices`` devices would give under ``strategy``, and what limits it."""
    row = pred.row(strategy, devices)
    if row["samples_per_second"] is None or row["samples_per_second"] != row["samples_per_second"]:
        return f"{strategy} on {devices} devices: not possible ({row['note']})."
    eff, link = row["efficiency"], pred.fabric.link.name
    head = (f"{strategy.upper()} on {devices} devices over {link}: {row['speedup']:.2f}x one device "
            f"({row['samples_per_second']:,.1f} samples/s, efficiency {eff:.2f}), ")
    share = row["comm_exposed_ms"] / row["step_ms"]
    if eff >= 0.85:
        return head + f"so the extra devices pay off (exposed communication: {share:.0%} of each step)."
    return head + (f"held back by exposed communication ({share:.0%} of each step): a faster link, a bigger "
                   "batch per device or gradient accumulation (fewer all-reduces per sample) would help.")


# ---- inputs from a run ------------------------------------------------------------------------

def from_result(result) -> Measured:
    """One device's Measured step from a RunResult: the time split's means over the steady steps (as samples/s averages them)."""
    r = result.to_dict() if hasattr(result, "to_dict") else dict(result)
    if r.get("status", "ok") != "ok" or not r.get("samples_per_second"):
        raise ConfigError(f"cannot predict from a run that did not train ({r.get('status')}: {r.get('reason')}); "
                          "give a run that finished")
    cfg = r.get("config") or {}
    warm = int(cfg.get("warmup_steps_excluded", 2))
    steady = int(r.get("steps") or 0) - warm
    if steady < MIN_STEADY_STEPS:
        raise ConfigError(f"this run has {max(steady, 0)} steady step(s) after its {warm} warm-up step(s); "
                          f"the prediction needs at least {MIN_STEADY_STEPS}: run at least "
                          f"{warm + MIN_STEADY_STEPS} steps")
    shape = (r.get("verification") or {}).get("model_shape") or {}
    if not shape.get("param_count"):
        raise ConfigError("this run has no model shape (verification['model_shape']); run it again with stnb")
    accumulation = int(cfg.get("gradient_accumulation_steps") or 1)
    batch = int(r["per_device_batch_size"]) * accumulation
    notes, inputs = [], []
    split = [s for s in (r.get("time_split") or []) if s.get("steps")]
    units = (split[0].get("units") if split else None) or {}
    measured = stepparts.parts(r)
    if split:
        med = {p: statistics.fmean(statistics.fmean(st.get(p) or 0.0 for st in s["steps"][warm:]) for s in split)
               for p in PHASES}
        fwd, bwd, opt, rest = med["forward"], med["backward_compute"], med["optimizer"], med["data"] + med["other"]
        source = (f"{r['strategy']} run on {r['world_size']} {r.get('device')} rank(s), means of "
                  f"{steady} steady steps of its measured time split")
        inputs += [("forward, backward compute, data + rest", "measured", "the time split's phases")]
        if measured["optimizer_step"] is not None:
            inputs.append(("optimizer", "measured", f"optimizer.step {measured['optimizer_step'] * 1e3:.2f} ms + "
                           f"clipping {measured['clip'] * 1e3:.2f} ms, between the trainer's callbacks"))
        else:
            inputs.append(("optimizer", "measured", "backward's end to the optimizer step's end (an older stnb)"))
        if "params" in registry.get(r["strategy"]).sharded:
            notes.append("the run is sharded (FSDP): its backward includes its all-gathers and reduce-scatters "
                         "(stnb times only the forward all-gathers), so the prediction counts those twice and is low")
    else:
        step = statistics.fmean(r["step_times"][warm:])
        fwd, bwd, opt, rest = step / 3, 2 * step / 3, 0.0, 0.0
        source = f"{r['strategy']} run, median step {step * 1e3:.1f} ms (no time split in this result)"
        notes.append("no time split in this result: forward:backward taken as 1:2 (their FLOPs), optimizer "
                     "and data inside them")
        inputs.append(("forward, backward, optimizer", "assumed", "1:2 of the step, optimizer inside them"))
    if int(r.get("world_size") or 1) > 1:
        notes.append(f"the compute was measured in a {r['world_size']}-rank {r['strategy']} run, not on one device")
    wire = {"grad_element_bytes": 4, "grad_how": "fp32", **registry.on_the_wire(cfg)}  # what the options change
    grad_size = wire["grad_element_bytes"]
    # FSDP's MixedPrecisionPolicy, as fsdp itself decides it (on GPUs parameters gathered in the training precision,
    # on CPU in fp32: the trainer's autocast only, as under single); gradients reduced in fp32; DDP's gradients are
    # the fp32 parameters' (2 B only with an fp16 / bf16 hook)
    from ..strategies.fsdp import precision_policy

    low = "param_dtype" in precision_policy(cfg.get("mixed_precision"), str(r.get("device")).split(":")[0])[0]
    inputs.append(("bytes on the wire", "from the run's settings",
                   f"gradients {grad_size} B each ({wire['grad_how']}), "
                   f"FSDP's gathered parameters {2 if low else 4} B each "
                   f"({cfg['mixed_precision'] + ' param_dtype' if low else 'fp32'}), its reduce-scatters fp32"))
    layers, root = units.get("layers"), units.get("root_fraction")
    if not layers:
        layers, root = 12, 0.25
        notes.append("FSDP units not recorded in this result: 12 layers + a root of 25% of the parameters assumed")
        inputs.append(("FSDP units", "assumed", "12 layers + a root of 25% of the parameters"))
    ready = tuple((g["ready"], g["share"]) for g in stepparts.grad_ready(r))
    inputs.append(("gradient readiness (DDP's buckets)", "measured", "each group's last gradient, as a fraction "
                   "of backward: " + ", ".join(f"{g['name']} {g['ready']:.2f}" for g in stepparts.grad_ready(r)))
                  if ready else ("gradient readiness (DDP's buckets)", "assumed", f"the layers' in proportion to "
                                 f"backward, the root ({root:.0%}) at its end"))
    if measured["spread"]:
        spread = measured["spread"]["std"]
        inputs.append(("step spread", "measured", f"std of each rank's own steady steps, {spread * 1e3:.2f} ms "
                       f"(p50 {measured['spread']['p50'] * 1e3:.1f}, p90 {measured['spread']['p90'] * 1e3:.1f} ms)"))
    else:
        steady_times = list(r.get("step_times") or [])[warm:]
        spread = statistics.pstdev(steady_times) if len(steady_times) > 1 else 0.0
        inputs.append(("step spread", "measured", "std of the run's steady steps (the slowest rank's per step)"))
    calls = measured["forward_calls"]
    if calls is not None:
        inputs.append(("model calls per step", "measured", f"{calls:g} forward(s) of the module that trains"))
    else:
        calls = text_columns((r.get("verification") or {}).get("data_columns"))
        if calls is None:
            notes.append("the run did not record its data's columns: the model calls per step (one per text column) "
                         "taken as 1 to 3")
            inputs.append(("model calls per step", "assumed", "1 to 3"))
        else:
            inputs.append(("model calls per step", "assumed", "one per text column of the data"))
    for kind, w in measured["outside_steps"].items():
        inputs.append((f"{kind} between steps", "measured", f"{w['calls']} call(s), {w['seconds']:.2f} s each, "
                       + stepparts.OUTSIDE_STEPS.get(kind, stepparts.OUTSIDE_STEPS["save"])))
    if measured["data_wait"] is not None:
        inputs.append(("data loading", "measured", f"{measured['data_wait'] * 1e3:.2f} ms a step waiting for "
                       "batches (inside the data part)"))
    inputs.append(("host vs device", "measured" if measured["host"] else "assumed",
                   "host seconds beside the CUDA events" if measured["host"] else
                   "the same clock (CPU): host work is the step"))
    inputs += [("link bandwidth and per-collective cost", "assumed", "the link preset's range (or this machine's "
                "loopback, measured by a sweep)"),
               (HOST_PER_COLLECTIVE, "assumed", "0: give a one-rank FSDP run (one_rank=) to measure it"),
               (SAME_SPEED, "assumed", "")]
    return Measured(batch=batch, forward=fwd, backward=bwd, optimizer=opt, other=rest,
                    forward_calls=float(calls or 2), step_spread=spread,
                    fits="params" not in registry.get(r["strategy"]).sharded,
                    grad_bytes=grad_size * shape.get("trainable_param_count", shape["param_count"]),
                    param_bytes=4 * shape["param_count"], gather_bytes=(2 if low else 4) * shape["param_count"],
                    layers=int(layers), root_fraction=float(root), source=source,
                    threads=_threads(r, cfg),
                    notes=tuple(notes), ready=ready, inputs=tuple(inputs),
                    **{k: v for k, v in wire.items() if k in Measured.__dataclass_fields__})


def collective_host(single, one_rank) -> Range:
    """FSDP's host work per collective (s), exposed: a one-rank FSDP run's mean steady step beyond the single run's
    (same model, batch and device; one rank sends nothing, so the difference is the wrapper's own work: copies
    in and out, hooks, bookkeeping), over the collectives FSDP sends a step (``fsdp.collectives_per_step``). The
    range: the difference +- 2 standard errors of the two means, never below 0."""
    from ..strategies.fsdp import collectives_per_step

    one, base = (x.to_dict() if hasattr(x, "to_dict") else dict(x) for x in (one_rank, single))
    sharded = "params" in registry.get(one.get("strategy", "")).sharded if one.get("strategy") in registry.names() \
        else False
    if not sharded or int(one.get("world_size") or 0) != 1:
        raise ConfigError(f"one_rank must be a one-rank run of a strategy that shards the parameters (fsdp), got "
                          f"{one.get('strategy')!r} on {one.get('world_size')} rank(s); stnblab.scaling.one_rank "
                          "makes one")
    for what, key in (("model", None), ("batch per device", "per_device_batch_size"), ("device", "device")):
        a, b = ((((x.get("verification") or {}).get("model_shape") or {}).get("param_count") if key is None
                 else x.get(key)) for x in (one, base))
        if a != b:
            raise ConfigError(f"one_rank's {what} ({a}) is not the single run's ({b}): run both with the same settings")
    m = from_result(one)  # refuses a run too short, like the single run
    from_result(base)
    means = []
    for r in (one, base):
        warm = int((r.get("config") or {}).get("warmup_steps_excluded", 2))
        steady = list(r["step_times"])[warm:]
        means.append((statistics.fmean(steady), statistics.pstdev(steady) / len(steady) ** 0.5))
    (t1, e1), (t0, e0) = means
    count = collectives_per_step(m, m.gathers_again)
    d, err = t1 - t0, 2 * (e1 ** 2 + e0 ** 2) ** 0.5
    return Range("collective_host", max(0.0, d - err) / count, max(0.0, d) / count, max(0.0, d + err) / count,
                 HOST_PER_COLLECTIVE + " (s)",
                 f"measured: a one-rank {one['strategy']} run's mean step {t1 * 1e3:.1f} ms against the single run's "
                 f"{t0 * 1e3:.1f} ms, over the {count:g} collectives FSDP sends a step, +- 2 standard errors")


def _threads(r: dict, cfg: dict) -> int:
    """A one-process CPU run's torch threads: its threads_per_rank, else what stnb gave it (the cores here); 0 for
    a run on another device or of several ranks (their compute already shared the cores)."""
    if r.get("device") != "cpu" or int(r.get("world_size") or 1) > 1:
        return 0
    from .. import hardware

    return int(cfg.get("threads_per_rank") or hardware.cpu_cores())


def text_columns(columns):
    """Model calls per step from the training data's columns (one per text column the loss embeds; a dict of
    datasets: their mean, one dataset a step); None when the run did not record them."""
    from ..columns import LABEL_COLUMNS

    if isinstance(columns, dict):
        counts = [text_columns(c) for c in columns.values()]
        return None if not counts or None in counts else statistics.fmean(counts)
    if isinstance(columns, (list, tuple)):
        return max(1, len([c for c in columns if c not in LABEL_COLUMNS]))
    return None


def uncertain_from_result(result) -> Uncertain:
    """``from_result``'s step with the ranges a run leaves open: the slowest-of-n wait between identical ranks
    (0) and independent draws with the run's measured step spread (mid: half of it), and the model calls per
    step when the run neither counted them nor recorded its columns (1 to 3)."""
    m = from_result(result)
    r = result.to_dict() if hasattr(result, "to_dict") else dict(result)
    ranges = [Range("spread", 0.0, m.step_spread / 2, m.step_spread, "a rank's step spread (s)",
                    "0: ranks identical; the run's measured standard deviation of its steady steps")]
    columns = (r.get("verification") or {}).get("data_columns")
    if stepparts.parts(r)["forward_calls"] is None and text_columns(columns) is None:
        ranges.append(Range("forward_calls", 1.0, 2.0, 3.0, "model calls per step", "not recorded by the run"))

    def build(values, m=m):
        return replace(m, step_spread=values["spread"], forward_calls=values.get("forward_calls", m.forward_calls))

    return Uncertain(tuple(ranges), build)


def _model(name):
    """The strategy whose step model predicts ``name`` (its own name, or one its ``aka`` spells), or None."""
    s = registry.alias_of(name) if name not in registry.names() else registry.get(name)
    return s if s is not None and s.step_time is not None else None


def _check_strategies(names) -> tuple:
    names = known() if names is None else (names,) if isinstance(names, str) else tuple(names)
    bad = [s for s in names if _model(s) is None]
    if bad or not names:
        aliases = [f"{a!r} ({s.name})" for s in map(registry.get, known())
                   for a in [s.aka.lower().replace(" stage ", "")] if s.aka and a not in registry.names()]
        raise ConfigError(f"no scaling model for strategy {', '.join(map(repr, bad)) or '(none given)'}; "
                          f"the predictor knows {', '.join(map(repr, known()))}"
                          + (f" and {', '.join(aliases)}" if aliases else ""))
    return names


def _check_devices(devices) -> list:
    devices = [devices] if isinstance(devices, int) else list(devices)
    if not devices or any(isinstance(d, bool) or not isinstance(d, int) or d < 2 for d in devices):
        raise ConfigError(f"devices={devices!r}: give device counts of at least 2, e.g. [2, 4, 8]")
    return sorted(set(devices))


def _ms(seconds):
    return None if seconds is None else seconds * 1e3

