"""Where a rank's step time goes, measured: data, forward, backward compute, communication, optimizer, wait.

``StepTimer`` lives inside a rank (the ``stnb.instruments.TimeSplit`` callback calls it). Its clock readings:

* a forward pre-hook and hook on the module that trains (the first forward of each micro-batch
  starts the forward; the loss runs until backward starts, so ``forward`` includes the loss);
* ``accelerator.backward`` wrapped: backward's start and end (for DDP its end waits for the last
  bucket's all-reduce);
* DDP: a communication hook that wraps the hook the run asked for (the strategy's ``comm_hook``: torch's
  ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, or stnb's embedding-rows hook)
  and reads the clock when DDP hands it a bucket and when that bucket's future completes (for gloo
  on the thread that completes it). The last bucket handed over marks the end of backward compute;
  what backward spends after it is exposed communication; the part of the buckets' communication
  before it overlapped with backward compute;
* the trainer's callbacks: optimizer step begin/end and step end.

Per step (seconds): ``data`` (from the previous step's end to the first forward: data loading,
the trainer's logging), ``forward``, ``backward_compute``, ``comm_exposed``, ``optimizer`` (gradient
clipping and ``optimizer.step``), ``other`` (scheduler, zero_grad, between micro-batches: what no
reading attributes); they add up to ``step``. Besides: ``comm_total`` (time some bucket was in
flight), ``comm_overlapped``, ``comm_bytes`` (what the hook sends: 2-byte elements for fp16/bf16),
``buckets``. ``combine(per_rank)`` (after training, all ranks' summaries) splits ``wait`` off the
exposed communication: a rank that handed its last bucket over before the slowest rank waited for
it (readings are relative to a barrier all ranks left together).

Measured beside the phases, per step: ``forward_calls`` and ``backward_calls`` (a loss calls the model once
per text column; a cached loss twice per mini-batch), ``backward`` (in full), ``optimizer_step``
(``optimizer.step()`` alone, between the trainer's pre- and post-step callbacks) and ``clip`` (backward's
end to it: clipping, gradient norms; the two make ``optimizer``), ``data_wait`` (host seconds in the
trainer's ``get_batch_samples``: loading and collating the step's batches), ``grad_ready`` (per group of
``grad_groups``, ``stnb.modelparts.grad_group``: when its last gradient was accumulated, a fraction of the
step's last backward; post-accumulate-grad hooks) and, on CUDA, ``host`` (host seconds of forward,
backward, ``optimizer.step`` and the step beside the device's events; ``host_clock`` says which).

FSDP (``fully_shard``) all-gathers a unit's parameters in its own forward pre-hook: two more pre-hooks
around it (one before, one after FSDP's) time each unit's forward all-gather, blocking on CPU, so it
counts as exposed communication. On CUDA those marks are the compute stream's wait for a gather FSDP2
issued (prefetched) on its own stream: exposed, while ``comm_total`` and ``comm_overlapped`` are None
(not measured), never 0. Backward's all-gathers and reduce-scatters run in autograd hooks
stnb does not reach: they stay in ``backward_compute``, and ``comm`` says so.

The readings are marks of a clock: on CPU ``time.perf_counter`` (what the CPU does is what gloo
does); on CUDA a ``torch.cuda.Event`` recorded on the current stream at the same places, so a mark
is when the GPU got there, not when Python launched the kernels (a bucket's completion is marked in
its future's callback, on a stream that waits for the collective). A step's marks are turned into
seconds once its last event has completed (no synchronisation per step; ``summary`` waits for the
rest). ``method`` says which clock measured the run.
"""

from __future__ import annotations

import os
import time

from .modelparts import fsdp_units, grad_group, model_units  # noqa: F401 (stnb.timesplit's names before)

PHASES = ("data", "forward", "backward_compute", "comm_exposed", "optimizer", "other")
WIRE_BYTES = {"none": None, "fp16": 2, "bf16": 2, "embedding_rows": None}  # element size on the wire


class HostClock:
    """Marks are ``time.perf_counter`` readings (seconds)."""

    method = "clock readings (CPU)"

    def mark(self, host: float | None = None) -> float:
        return time.perf_counter() if host is None else host

    def done(self, mark) -> bool:
        return True

    def settle(self) -> None:
        pass

    def seconds(self, mark, origin) -> float:
        return mark - origin


class CudaEvents:
    """Marks are CUDA events recorded on the current stream; seconds from ``origin``'s event."""

    method = "CUDA events"

    def __init__(self):
        import torch

        self.cuda = torch.cuda

    def mark(self, host: float | None = None):
        event = self.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, mark) -> bool:
        return mark.query()

    def settle(self) -> None:
        self.cuda.synchronize()

    def seconds(self, mark, origin) -> float:
        return origin.elapsed_time(mark) / 1e3


class StepTimer:
    """Per-step phase readings of one rank. ``attach(trainer, ddp_hook)`` once (first step begin; ``ddp_hook``:
    the strategy's ``(name, torch hook)``, ``Strategy.ddp_hook``),
    then ``on_step_begin`` / ``on_pre_optimizer_step`` / ``on_optimizer_step`` / ``on_step_end(now)``;
    ``summary()`` returns plain data."""

    def __init__(self, clock=None, enabled: bool | None = None):
        self.clock = clock or HostClock()  # attach picks CudaEvents when the model is on a CUDA device
        # STNB_TIME_SPLIT=off measures nothing (the bench compares throughput with and without)
        self.enabled = os.environ.get("STNB_TIME_SPLIT", "on") != "off" if enabled is None else enabled
        self.steps = []
        self.origin = None          # a mark taken after a barrier every rank left together
        self.method = None
        self.hook = None
        self.units = None
        self.comm_note = None
        self.comm = None            # what the comm fields measure
        self._prev_end = None
        self._prev_host = self._fwd_host = self._opt_host = None  # perf_counter readings beside the marks
        self._data_wait = None      # host seconds the trainer waited for this step's batches (get_batch_samples)
        self.groups = []            # gradient groups: {"name", "params", "numel"} (``grad_ready`` per step)
        self._pending = []          # steps whose marks are not all resolved into seconds yet (CUDA)
        self._grad_hooks = []       # the post-accumulate-grad hooks' handles, one per trainable parameter
        self._seen = {}             # parameter index -> group, in the order their gradients arrived (None: pruned)
        self._reset()

    def _reset(self):
        self._fwd_start = None      # first forward of the current micro-batch
        self._marks = {"forward": [], "backward": [], "first_forward": None, "bwd_end": None,
                       "opt_start": None, "opt_end": None}
        self._host = {"forward": 0.0, "backward": 0.0, "optimizer_step": 0.0}  # perf_counter spans (CUDA)
        self._calls = 0             # forwards of the module that trains in this step (a loss: one per column)
        self._ready = {}            # gradient group -> mark of its last gradient accumulated (latest backward)
        self._bwd_start = None      # the latest backward's start mark
        self._buckets = []          # [handed over, completed, bytes]
        self._gathers = []          # FSDP forward all-gathers: (start, end)
        self._gather_from = None

    # ---- attaching ---------------------------------------------------------------------------

    def attach(self, trainer, ddp_hook: tuple = ("none", None)) -> None:
        import torch
        import torch.distributed as dist

        name, hook = ddp_hook  # the hook the run asked for (None: one that registers itself, timed)
        wrapped = trainer.model_wrapped
        is_ddp = isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        device = next(wrapped.parameters()).device.type
        if not self.enabled or device not in ("cpu", "cuda"):
            self.method = ("off (STNB_TIME_SPLIT=off)" if not self.enabled else
                           f"not measured on {device} (clock readings would time kernel launches); use the profiler")
            if is_ddp and name != "none" and hook is not None:
                wrapped.register_comm_hook(None, hook)  # the hook asked for, untimed
            return
        if device == "cuda":
            self.clock = CudaEvents()
        self.method = self.clock.method
        wrapped.register_forward_pre_hook(self._forward_pre, prepend=True)  # before FSDP's root all-gather
        for unit in fsdp_units(wrapped):  # around FSDP's own pre-forward hook: the unit's all-gather
            unit.register_forward_pre_hook(self._gather_start, prepend=True)
            unit.register_forward_pre_hook(self._gather_end)
            self.comm = "FSDP forward all-gathers (backward's all-gathers and reduce-scatters stay in backward)" + (
                "; on CUDA the compute stream's wait for them only (FSDP runs them on its own stream: their time "
                "in flight and overlap are not measured)" if device == "cuda" else "")
        backward = trainer.accelerator.backward

        def timed_backward(loss, **kw):
            h0 = time.perf_counter()
            self._bwd_start = start = self.clock.mark(h0)
            if self._fwd_start is not None:
                self._marks["forward"].append((self._fwd_start, start))
                self._host["forward"] += h0 - self._fwd_host
                self._fwd_start = None
            backward(loss, **kw)
            h1 = time.perf_counter()
            self._marks["bwd_end"] = end = self.clock.mark(h1)
            self._host["backward"] += h1 - h0
            self._marks["backward"].append((start, end))

        trainer.accelerator.backward = timed_backward
        fetch = trainer.get_batch_samples

        def timed_fetch(*args, **kw):  # the batches of the next step: loading and collation (host clock)
            h0 = time.perf_counter()
            try:
                return fetch(*args, **kw)
            finally:
                self._data_wait = (self._data_wait or 0.0) + time.perf_counter() - h0

        trainer.get_batch_samples = timed_fetch
        self._hook_gradients(trainer.model)
        if is_ddp:
            self.hook, self.comm = name, "DDP bucket hooks"
            if hook is not None:  # stnb's embedding-rows hook registers itself, with ``timed``
                try:
                    wrapped.register_comm_hook(None, self.timed(hook))
                except RuntimeError as e:  # DDP takes one hook: someone registered theirs first
                    self.hook = self.comm = None
                    self.comm_note = f"not measured: a communication hook was registered before stnb's ({e})"
        self.units = model_units(trainer.model)
        if dist.is_initialized():
            dist.barrier()
        self.clock.settle()
        self.origin = self.clock.mark()

    def timed(self, hook):
        """``hook`` (a DDP communication hook) with a mark at hand-over and at completion."""
        if not self.enabled:
            return hook

        def timed_hook(state, bucket):
            buf = bucket.buffer()
            wire = WIRE_BYTES.get(self.hook)
            rec = [self.clock.mark(), None, buf.numel() * (wire or buf.element_size())]
            self._buckets.append(rec)
            if hasattr(state, "sent_elements"):  # stnb's embedding-rows hook counts what it sends
                before = state.sent_elements
                fut = hook(state, bucket)
                rec[2] = (state.sent_elements - before) * buf.element_size()
            else:
                fut = hook(state, bucket)

            def done(f):  # on CUDA this runs on a stream that waits for the collective
                rec[1] = self.clock.mark()
                return f.value()

            return fut.then(done)

        return timed_hook

    def _hook_gradients(self, model) -> None:
        """A post-accumulate-grad hook on every trainable parameter: the mark of each group's last gradient
        (groups: the embeddings, each layer, the rest), the order DDP's buckets fill in. After the first
        step whose gradients arrived, only the parameter each group saw last keeps its hook (``_prune``):
        a mark costs host time (on CUDA an event), and a model has hundreds of parameters but ~14 groups."""
        groups: dict = {}
        for name, p in model.named_parameters():
            if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                key = grad_group(name)
                g = groups.setdefault(key, {"name": key, "params": 0, "numel": 0})
                g["params"] += 1
                g["numel"] += p.numel()
                i = len(self._grad_hooks)
                self._grad_hooks.append(p.register_post_accumulate_grad_hook(
                    lambda _p, key=key, i=i: self._grad_ready(key, i)))
        self.groups = list(groups.values())

    def _grad_ready(self, key, i) -> None:
        self._ready[key] = self.clock.mark()
        if self._seen is not None:  # until pruned: the parameters whose gradients came, the latest last
            self._seen.pop(i, None)
            self._seen[i] = key

    def _prune(self) -> None:
        """After a step whose gradients arrived: keep the hook of each group's last parameter to get its
        gradient (its mark overwrote the others'); a parameter whose gradient never came keeps its hook."""
        last = {key: i for i, key in self._seen.items()}  # insertion order: the last index per group wins
        for i, key in self._seen.items():
            if last[key] != i:
                self._grad_hooks[i].remove()
        self._seen = None

    def _forward_pre(self, module, args):
        if module.training:
            self._calls += 1
        if module.training and self._fwd_start is None:  # evaluation's forwards are not a training step's
            self._fwd_host = time.perf_counter()
            self._fwd_start = self.clock.mark(self._fwd_host)
            if self._marks["first_forward"] is None:
                self._marks["first_forward"] = self._fwd_start

    def _gather_start(self, module, args):
        if module.training:
            self._gather_from = self.clock.mark()

    def _gather_end(self, module, args):
        if module.training and self._gather_from is not None:
            self._gathers.append((self._gather_from, self.clock.mark()))
            self._gather_from = None

    # ---- the trainer's callbacks -------------------------------------------------------------

    def on_step_begin(self, start: float) -> None:
        """The first step's begin (``start``, the clock of stnb's step times); later steps begin where
        the previous one ended."""
        if self._prev_end is None:
            self._prev_end = self.clock.mark(start)
            self._prev_host = start

    def resume(self, now: float) -> None:
        """Work between two steps that is no part of either (an evaluation) ended at ``now``: the next step
        begins here."""
        if self._prev_end is not None:
            self._prev_end, self._prev_host = self.clock.mark(now), now

    def on_pre_optimizer_step(self) -> None:
        self._opt_host = time.perf_counter()
        self._marks["opt_start"] = self.clock.mark(self._opt_host)

    def on_optimizer_step(self) -> None:
        now = time.perf_counter()
        self._marks["opt_end"] = self.clock.mark(now)
        self._host["optimizer_step"] += now - self._opt_host

    def on_step_end(self, now: float) -> None:
        end = self.clock.mark(now)  # CPU: stnb's own step clock, so the split adds up to its step times
        if self.origin is None:
            self._prev_end, self._prev_host = end, now
            return
        counts = {"forward_calls": self._calls, "data_wait": self._data_wait,
                  "host": dict(self._host, step=now - self._prev_host) if self._prev_host is not None else None,
                  "ready": (self._bwd_start, dict(self._ready))}
        self._pending.append((self._prev_end, end, self._marks, self._buckets, self._gathers, counts))
        if self._seen:  # the first step whose gradients arrived: one hook per gradient group from here on
            self._prune()
        self._prev_end, self._prev_host, self._data_wait = end, now, None
        self._reset()
        while self._pending and self.clock.done(self._pending[0][1]):  # CUDA: steps the GPU has finished
            self.steps.append(self._split(*self._pending.pop(0)))

    def _split(self, begin, end, m, buckets, gathers, counts=None) -> dict:
        """One step's marks turned into seconds (from ``origin``, the clock every rank shares)."""
        def sec(mark):
            return self.clock.seconds(mark, self.origin) if mark is not None else None

        begin, end, bwd_end = sec(begin), sec(end), sec(m["bwd_end"])
        step = end - begin
        buckets = [(sec(b[0]), sec(b[1]), b[2]) for b in buckets]
        last_ready = max((b[0] for b in buckets), default=None)
        backward = sum(sec(e) - sec(s) for s, e in m["backward"])
        exposed = max(0.0, bwd_end - last_ready) if last_ready is not None and bwd_end is not None else 0.0
        opt = (sec(m["opt_end"]) - bwd_end) if m["opt_end"] is not None and bwd_end is not None else 0.0
        first = sec(m["first_forward"])
        rec = {"step": step, "data": first - begin if first is not None else 0.0,
               "forward": sum(sec(e) - sec(s) for s, e in m["forward"]),
               "backward_compute": backward - exposed, "comm_exposed": exposed, "optimizer": opt}
        rec["other"] = step - sum(rec[p] for p in PHASES if p != "other")
        rec["start"] = begin
        if m["opt_start"] is not None and m["opt_end"] is not None:  # measured: optimizer.step alone
            rec["optimizer_step"] = sec(m["opt_end"]) - sec(m["opt_start"])
            rec["clip"] = rec["optimizer"] - rec["optimizer_step"]  # backward's end to the step: clipping, norms
        rec["backward"] = backward
        if counts is not None:
            rec["forward_calls"], rec["backward_calls"] = counts["forward_calls"], len(m["backward"])
            rec["data_wait"] = counts["data_wait"]
            if not isinstance(self.clock, HostClock) and counts["host"] is not None:
                rec["host"] = counts["host"]  # CUDA: what Python took to issue them (device time above)
            start, ready = counts["ready"]
            if ready and start is not None and bwd_end is not None and bwd_end > sec(start):
                b0, length = sec(start), bwd_end - sec(start)
                rec["grad_ready"] = [None if g["name"] not in ready else
                                     min(1.0, max(0.0, (sec(ready[g["name"]]) - b0) / length)) for g in self.groups]
        if self.comm is not None and self.hook is None:  # FSDP: its forward all-gathers (blocking on CPU)
            spans = [(sec(b), sec(e)) for b, e in gathers]
            gathered = sum(e - b for b, e in spans)
            rec["forward"] -= gathered
            rec["comm_exposed"] += gathered
            # CPU: the gather ran inside the span. CUDA: the span is the compute stream's wait for a gather FSDP2
            # ran (prefetched) on its own stream: its time in flight, and so its overlap, was not measured
            on_host = isinstance(self.clock, HostClock)
            rec["comm_total"], rec["comm_overlapped"] = (gathered, 0.0) if on_host else (None, None)
            rec["comm_spans"] = spans
            rec["gathers"] = len(spans)
        if self.hook is not None:
            done = [(b[0], b[1]) for b in buckets if b[1] is not None]
            rec["comm_spans"] = done
            rec["comm_total"] = _union(done)
            rec["comm_overlapped"] = _union([(b, min(e, last_ready)) for b, e in done if b < (last_ready or 0)])
            rec["comm_bytes"] = sum(b[2] for b in buckets)
            rec["buckets"] = len(buckets)
            rec["backward_compute_end"] = last_ready
        return rec

    def summary(self) -> dict:
        if self._pending:
            self.clock.settle()  # the GPU finishes the last steps; their events can then be read
            self.steps.extend(self._split(*p) for p in self._pending)
            self._pending = []
        return {"method": self.method, "hook": self.hook, "units": self.units, "steps": self.steps,
                "comm": self.comm, "note": self.comm_note, "grad_groups": self.groups,
                "host_clock": "the same clock (CPU)" if isinstance(self.clock, HostClock) else
                "host seconds (time.perf_counter) beside the device's CUDA events: steps' 'host'"}


def _union(spans) -> float:
    total, end = 0.0, None
    for s, e in sorted(spans):
        if e <= s:
            continue
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def combine(per_rank: list) -> list:
    """All ranks' summaries with ``wait`` split off ``comm_exposed`` (DDP: how long after this rank the
    slowest rank handed over its last bucket, at most the exposed communication); ``wait`` is None
    where it cannot be told apart."""
    per_rank = [dict(r, steps=[dict(s) for s in r.get("steps") or []]) for r in per_rank if r]
    n = min((len(r["steps"]) for r in per_rank), default=0)
    for i in range(n):
        ends = [r["steps"][i].get("backward_compute_end") for r in per_rank]
        for r, end in zip(per_rank, ends):
            st = r["steps"][i]
            if None in ends:
                st["wait"] = None
                continue
            st["wait"] = min(max(ends) - end, st["comm_exposed"])
            st["comm_exposed"] -= st["wait"]
    return per_rank


def problems(result, tolerance: float = 0.05, warmup: int | None = None) -> list:
    """Why ``result``'s time split does not account for its steps (empty: it does): every rank measured,
    no part negative, forward and backward seen, and what no mark attributes (``other``) under
    ``tolerance`` of the steady steps. ``make gpu-check`` asks this of every CUDA run."""
    r = result.to_dict() if hasattr(result, "to_dict") else dict(result)
    warm = int((r.get("config") or {}).get("warmup_steps_excluded", 2)) if warmup is None else warmup
    found = []
    for rank, split in enumerate(r.get("time_split") or []):
        steps = (split or {}).get("steps", [])[warm:]
        if not steps:
            found.append(f"rank {rank}: no steady step measured ({(split or {}).get('method')})")
            continue
        for i, st in enumerate(steps):
            negative = [p for p in (*PHASES, "wait") if (st.get(p) or 0.0) < -1e-6 * st["step"]]
            if negative:
                found.append(f"rank {rank} step {warm + i}: negative {', '.join(negative)}")
            if not (st["forward"] > 0 and st["backward_compute"] > 0):
                found.append(f"rank {rank} step {warm + i}: no forward or backward measured")
        other = sum(st["other"] for st in steps) / sum(st["step"] for st in steps)
        if other > tolerance:
            found.append(f"rank {rank}: {other:.1%} of the step is attributed to nothing (limit {tolerance:.0%})")
    if not r.get("time_split"):
        found.append("no time split in the result")
    return found


def table(result, warmup: int | None = None):
    """A pandas DataFrame, one row per rank: each part's mean over the steady steps, in ms (the parts
    that add up to ``step`` first, then ``comm_total`` and ``comm_overlapped`` where measured, then the
    measured parts inside them: ``optimizer_step``, ``clip`` and ``data_wait``)."""
    import pandas as pd

    r = result.to_dict() if hasattr(result, "to_dict") else dict(result)
    warm = int((r.get("config") or {}).get("warmup_steps_excluded", 2)) if warmup is None else warmup
    cols = ("step", *PHASES, "wait", "comm_total", "comm_overlapped", "optimizer_step", "clip", "data_wait")
    rows = []
    for rank, split in enumerate(r.get("time_split") or []):
        steps = (split or {}).get("steps", [])[warm:]
        row = {"rank": rank}
        for c in cols:
            vals = [st[c] for st in steps if st.get(c) is not None]
            if vals:
                row[f"{c}_ms"] = 1e3 * sum(vals) / len(vals)
        rows.append(row)
    return pd.DataFrame(rows).set_index("rank") if rows else pd.DataFrame()
