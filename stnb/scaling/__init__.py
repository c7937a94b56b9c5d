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
back; ``Prediction.assumptions`` says which inputs were measured and which assumed). ``inputs`` reads them from
the run, ``links`` holds the presets (bus bandwidth ranges with their sources) and the collective costs,
``model`` what a step model takes (each strategy has its own, ``Strategy.step_time``, asked of the registry),
``interval`` the ranges' combinations and the suspect flags, ``calibrate`` measures this machine's loopback
(the 'loopback' link).
The predictor checked on two published tables from their 1-GPU rows (the sentence-transformers docs' 4x
V100; DeepLearningExamples' BERT-large on a DGX-1) is the lab's: ``stnblab.scaling``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from .. import strategies as registry  # ``predict`` takes an argument named strategies
from .inputs import HOST_PER_COLLECTIVE, MIN_STEADY_STEPS, SAME_SPEED, collective_host, from_result, uncertain_from_result
from .links import KNOWN as LINKS, PRESETS, Fabric, Link, custom, fabric
from .model import Measured, Range, Uncertain
from ..strategies import stepcost

SHARED = "a rank's compute among n ranks on this machine's cores"

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

