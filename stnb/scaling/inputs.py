"""The predictor's inputs read from a run (``stnb.scaling.predict``): one device's ``Measured`` step from a
RunResult (``from_result``: the time split's means over the steady steps, the bytes from the model's shape and the
run's options, each input said measured or assumed), the ranges a run leaves open (``uncertain_from_result``),
and FSDP's host work per collective from a one-rank run (``collective_host``)."""

from __future__ import annotations

import statistics
from dataclasses import replace

from ..errors import ConfigError
from .. import stepparts
from .. import strategies as registry
from .model import Measured, Range, Uncertain

MIN_STEADY_STEPS = 3
SAME_SPEED = "every added device computes as fast"
HOST_PER_COLLECTIVE = "FSDP's host work per collective"
PHASES = ("forward", "backward_compute", "optimizer", "data", "other")


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
