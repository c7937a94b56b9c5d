"""``python -m stnb split``: the time split's benchmarks (numbers printed, never asserted).

    python -m stnb split --comm-share     DDP with fp32 gradients, the fp16 hook, and small buckets:
                                          communication's share of the step, and the bytes sent
    python -m stnb split --overhead       throughput with the split on and off (STNB_TIME_SPLIT=off),
                                          alternated, medians of repeats
    python -m stnb split --fsdp           DDP, FSDP and FSDP without resharding after forward, side by side
    python -m stnb split --hooks          the gradient-ready hooks' cost: a backward with none, with one per
                                          parameter (the first step), with one per gradient group (the rest)
    python -m stnb split --show RESULTS   the split of every run in a results file

Each run is a real 2-rank gloo run of stnb's recipe (``--model``, default the bundled MiniLM).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

STRATEGY = "ddp"  # what every run here is unless a variant says otherwise


def share_variants() -> tuple:
    """The comm-share runs: fp32 all-reduce (the defaults), the strategy's fp16 hook (``Strategy.tunings``),
    and buckets of 1 MiB (many all-reduces, each overlapping backward)."""
    from stnb import strategies

    return (("fp32 all-reduce", {}), ("fp16 hook", dict(strategies.get(STRATEGY).tunings["fp16 hook"])),
            ("fp32, 1 MiB buckets", {"bucket_cap_mb": 1}))


def fsdp_variants() -> tuple:
    """``--fsdp``: the DDP runs' baseline, then every strategy that shards the parameters and declares
    tunings (fsdp), with its defaults and each tuning."""
    from stnb import strategies

    out = [(STRATEGY, {})]
    for s in strategies.all_strategies():
        if "params" in s.sharded and s.tunings:
            out += [(s.name, {"strategy": s.name}),
                    *((f"{s.name}, {name}", {"strategy": s.name, **values}) for name, values in s.tunings.items())]
    return tuple(out)


def summarize(result) -> dict:
    """Medians over the steady steps of every rank: each phase in ms, and communication's shares."""
    warm = int((result.config or {}).get("warmup_steps_excluded", 2))
    steps = [st for r in result.time_split for st in r["steps"][warm:]]
    keys = [k for k in ("step", "data", "forward", "backward_compute", "comm_exposed", "wait", "optimizer", "other",
                        "comm_total", "comm_overlapped") if any(st.get(k) is not None for st in steps)]
    out = {k: statistics.median(st[k] for st in steps if st.get(k) is not None) * 1e3 for k in keys}
    if "comm_total" in out:
        out["comm_share"] = out["comm_total"] / out["step"]
        out["comm_exposed_share"] = (out["comm_exposed"] + out.get("wait", 0.0)) / out["step"]
        sent = [st["comm_bytes"] for st in steps if st.get("comm_bytes") is not None]
        if sent:
            out["comm_mib_per_step"] = statistics.median(sent) / 2**20
    out["samples_per_second"] = result.samples_per_second
    return out


def comm_share(model: str = "minilm", steps: int = 10, batch: int = 16, repeats: int = 1,
               variants=None) -> list:
    """Each variant (DDP on 2 ranks, with the knobs given) ``repeats`` times, interleaved (the machine's
    load drifts alike for all); per variant the medians over its runs of ``summarize``. ``variants``: (label,
    overrides) pairs; default ``share_variants()``."""
    from stnb.config import TrainConfig
    from stnb.runner import run

    variants = share_variants() if variants is None else variants
    seen = {label: [] for label, _ in variants}
    for _ in range(repeats):
        for label, knobs in variants:
            r = run(TrainConfig(**{"strategy": STRATEGY, "num_processes": 2, "model": model, "steps": steps,
                                   "per_device_batch_size": batch, "evaluate": False, "device": "cpu", **knobs}),
                    echo=False)
            seen[label].append(summarize(r))
    return [{"variant": label, "runs": len(runs),
             **{k: statistics.median(run[k] for run in runs) for k in runs[0]}} for label, runs in seen.items()]


def overhead(model: str = "minilm", steps: int = 10, batch: int = 16, repeats: int = 3) -> dict:
    from stnb.config import TrainConfig
    from stnb.runner import run

    cfg = TrainConfig(strategy=STRATEGY, num_processes=2, model=model, steps=steps, per_device_batch_size=batch,
                      evaluate=False, device="cpu")
    seen, steps, buckets = {"on": [], "off": []}, [], 1
    for _ in range(repeats):
        for mode in ("off", "on"):  # alternated: the machine's load drifts alike for both
            with time_split(mode == "on"):
                r = run(cfg, echo=False)
            seen[mode].append(r.samples_per_second)
            if mode == "on":
                steps.append(statistics.median(r.step_times[cfg.warmup_steps_excluded:]))
                buckets = max(st.get("buckets", 1) for st in r.time_split[0]["steps"])
    on, off = statistics.median(seen["on"]), statistics.median(seen["off"])
    cost = own_cost(buckets=buckets)
    return {"on": seen["on"], "off": seen["off"], "median_on": on, "median_off": off, "overhead": 1 - on / off,
            "own_cost_s": cost, "buckets": buckets, "median_step_s": statistics.median(steps),
            "own_share": cost / statistics.median(steps)}


@contextlib.contextmanager
def time_split(on: bool):
    """STNB_TIME_SPLIT (what ``stnb.timesplit.StepTimer`` reads in the ranks) for the runs inside, put back after."""
    before = os.environ.get("STNB_TIME_SPLIT")
    os.environ["STNB_TIME_SPLIT"] = "on" if on else "off"
    try:
        yield
    finally:
        os.environ.pop("STNB_TIME_SPLIT") if before is None else os.environ.__setitem__("STNB_TIME_SPLIT", before)


def own_cost(buckets: int = 4, forwards: int = 2, repeats: int = 2000, device: str = "cpu") -> float:
    """Seconds the timer's own code takes per step (median of ``repeats`` simulated steps): ``forwards``
    forward pre-hooks, the backward wrapper, ``buckets`` timed comm hooks with their completion
    callbacks, the optimizer readings and ``on_step_end``. The rest of a real step is left out, so this
    is the split's overhead on its own, free of the run-to-run noise a throughput comparison has.
    ``device="cuda"``: with the CUDA events a GPU run marks (each mark records an event)."""
    import torch

    from stnb.timesplit import CudaEvents, HostClock, StepTimer

    class Bucket:  # what DDP hands a hook, reduced to what ``timed`` reads
        def __init__(self):
            self.tensor = torch.zeros(1024, device=device)

        def buffer(self):
            return self.tensor

    def ready(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    class Module(torch.nn.Module):
        pass

    timer = StepTimer(clock=CudaEvents() if device == "cuda" else HostClock(), enabled=True)
    module, bucket = Module(), Bucket()
    timer.method, timer.hook, timer.origin = timer.clock.method, "none", timer.clock.mark()
    hook = timer.timed(ready)
    timer.on_step_begin(timer.clock.mark())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(forwards):
            timer._forward_pre(module, ())
        bwd_start = timer.clock.mark()  # what the backward wrapper marks around backward
        for _ in range(buckets):
            hook(None, bucket).wait()
        timer._marks["bwd_end"] = bwd_end = timer.clock.mark()
        timer._marks["backward"].append((bwd_start, bwd_end))
        timer.on_pre_optimizer_step()
        timer.on_optimizer_step()
        timer.on_step_end(timer.clock.mark())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hook_cost(layers: int = 12, linears: int = 8, repeats: int = 400) -> dict:
    """Median seconds of one backward of a stack of ``layers`` x ``linears`` tiny Linear layers (named as an
    encoder's, so each layer is one gradient group) without the time split's gradient hooks, with one per
    parameter, and after ``StepTimer._prune`` (one per group): the hooks' own host cost, on this process's
    clock (a CUDA run adds an event record per mark)."""
    import torch

    from stnb.timesplit import HostClock, StepTimer

    def stack():
        m = torch.nn.Module()
        m.encoder = torch.nn.Module()
        m.encoder.layer = torch.nn.ModuleList(
            [torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(linears)]) for _ in range(layers)])
        return m

    def backward(m):
        h = torch.ones(1, 2)
        for layer in m.encoder.layer:
            h = layer(h)
        h.sum().backward()

    plain, every, pruned = stack(), stack(), stack()
    timers = [StepTimer(clock=HostClock(), enabled=True) for _ in range(2)]
    for timer, m in zip(timers, (every, pruned)):
        timer._hook_gradients(m)
    backward(pruned)
    timers[1]._prune()  # what the first step's end does
    times = {"none_s": [], "every_parameter_s": [], "one_per_group_s": []}
    for _ in range(repeats):  # interleaved: the machine's drift falls on all three alike
        for key, m in zip(times, (plain, every, pruned)):
            start = time.perf_counter()
            backward(m)
            times[key].append(time.perf_counter() - start)
    return {"parameters": sum(1 for _ in every.parameters()), "groups": len(timers[0].groups),
            "hooks_left": sum(len(p._post_accumulate_grad_hooks or {}) for p in pruned.parameters()),
            **{k: statistics.median(v) for k, v in times.items()}}


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("split", help="the time split's benchmarks: communication share, overhead")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--comm-share", action="store_true")
    what.add_argument("--overhead", action="store_true")
    what.add_argument("--fsdp", action="store_true", help="DDP, FSDP and FSDP without resharding, split side by side")
    what.add_argument("--hooks", action="store_true", help="the gradient-ready hooks' cost per backward")
    what.add_argument("--show", metavar="RESULTS")
    p.add_argument("--model", default="minilm")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(func=cmd_split)


def cmd_split(a) -> int:
    if a.comm_share:
        for row in comm_share(a.model, a.steps, a.batch, a.repeats):
            print(f"{row['variant']:>20} (median of {row['runs']}): step {row['step']:.0f} ms, comm in flight {row['comm_total']:.0f} ms "
                  f"({row['comm_share']:.0%} of the step; exposed + wait {row['comm_exposed_share']:.0%}), "
                  f"{row['comm_mib_per_step']:.1f} MiB sent per step, {row['samples_per_second']:.2f} samples/s")
    elif a.fsdp:
        for row in comm_share(a.model, a.steps, a.batch, a.repeats, fsdp_variants()):
            parts = ", ".join(f"{k} {row[k]:.0f}" for k in ("forward", "backward_compute", "comm_exposed", "wait",
                                                           "optimizer", "data") if row.get(k) is not None)
            print(f"{row['variant']:>18} (median of {row['runs']}): {row['samples_per_second']:.2f} samples/s, "
                  f"step {row['step']:.0f} ms = {parts} ms (+ other)")
    elif a.overhead:
        o = overhead(a.model, a.steps, a.batch, a.repeats)
        print(f"samples/s with the split off: {', '.join(f'{x:.2f}' for x in o['off'])} (median {o['median_off']:.2f})")
        print(f"samples/s with the split on:  {', '.join(f'{x:.2f}' for x in o['on'])} (median {o['median_on']:.2f})")
        print(f"overhead by throughput: {o['overhead']:+.1%} (run-to-run noise on a shared machine included)")
        print(f"the split's own code: {o['own_cost_s'] * 1e6:.0f} us per step ({o['buckets']} buckets), "
              f"{o['own_share']:.4%} of the median step ({o['median_step_s'] * 1e3:.0f} ms)")
    elif a.hooks:
        o = hook_cost()
        per = (o["every_parameter_s"] - o["none_s"]) / o["parameters"]
        print(f"backward of {o['parameters']} parameters in {o['groups']} gradient groups (median of 400): "
              f"{o['none_s'] * 1e6:.0f} us without hooks, {o['every_parameter_s'] * 1e6:.0f} us with one per parameter "
              f"({per * 1e6:+.2f} us a hook), {o['one_per_group_s'] * 1e6:.0f} us with one per group")
    else:
        from stnb.results import RunResult, load_results

        for row in load_results(a.show, as_frame=False):
            r = RunResult.from_dict(row)
            if r.time_split:
                print(r.strategy, r.world_size, {k: round(v, 3) for k, v in summarize(r).items()})
    return 0
