"""Where a step's time went (stnb.timesplit), in one process: a StepTimer attached to a real torch model whose
forward, backward, data loading, optimizer and DDP buckets each take a known number of *simulated* seconds
(tests/simsteps.py: the clock is the test's, every mark reads it, the stand-in work advances it), so each part
of the split has a value the timeline implies. The real multi-rank runs (tests/test_timesplit.py, slow) check the same split on
gloo's clock."""

import pytest
import torch

from simsteps import (BUCKET, CLIP, FETCH, FORWARD, GRAD_STEP, OPT_STEP, REST, TAIL, Bucket, DeviceSimClock, Net,
                      SimClock, Takes, attached, ddp_timer, one_step, pending)
from stnb.timesplit import PHASES, WIRE_BYTES, StepTimer, _union, combine, problems, table


def test_a_ddp_step_splits_into_the_parts_its_timeline_took():
    clock = SimClock()
    clock.now = 5.0
    timer, tr, model = ddp_timer(clock)
    assert timer.method == "simulated clock" and timer.origin == 5.0 and timer.enabled
    clock.advance(1.0)
    timer.on_step_begin(clock.now)
    begin = clock.now
    one_step(timer, tr, model)
    (st,) = timer.steps
    backward = 4 * GRAD_STEP + TAIL
    want = {"data": FETCH, "forward": 2 * FORWARD, "backward_compute": 4 * GRAD_STEP, "comm_exposed": TAIL,
            "optimizer": CLIP + OPT_STEP, "other": REST}
    assert {p: st[p] for p in PHASES} == pytest.approx(want)
    assert st["step"] == pytest.approx(FETCH + 2 * FORWARD + backward + CLIP + OPT_STEP + REST)
    assert sum(st[p] for p in PHASES) == pytest.approx(st["step"])
    assert st["start"] == pytest.approx(begin - 5.0)  # seconds from the origin every rank shares
    assert st["backward"] == pytest.approx(backward)
    assert st["optimizer_step"] == pytest.approx(OPT_STEP) and st["clip"] == pytest.approx(CLIP)
    assert st["forward_calls"] == 2 and st["backward_calls"] == 1
    assert st["data_wait"] is not None and st["data_wait"] >= 0  # host seconds in get_batch_samples
    assert "host" not in st  # the CPU clock is the host's: no second reading
    # the buckets: A in flight GRAD_STEP beside backward's compute, B (the last) exposed for TAIL
    bwd0 = begin - 5.0 + FETCH + 2 * FORWARD
    assert st["buckets"] == 2 and st["comm_bytes"] == 2 * BUCKET * 4
    assert [x for span in st["comm_spans"] for x in span] == pytest.approx(
        [bwd0 + 2 * GRAD_STEP, bwd0 + 3 * GRAD_STEP, bwd0 + 4 * GRAD_STEP, bwd0 + backward])
    assert st["comm_total"] == pytest.approx(GRAD_STEP + TAIL)
    assert st["comm_overlapped"] == pytest.approx(GRAD_STEP)
    assert st["backward_compute_end"] == pytest.approx(bwd0 + 4 * GRAD_STEP)
    # each gradient group ready as a fraction of the step's backward, in the groups' order
    names = [g["name"] for g in timer.groups]
    assert names == ["embeddings", "layer 0", "layer 1", "other"]
    assert [(g["params"], g["numel"]) for g in timer.groups] == [(2, 16), (2, 20), (2, 20), (1, 4)]
    done = {"other": 1, "layer 1": 2, "layer 0": 3, "embeddings": 4}  # head first, embeddings last
    assert st["grad_ready"] == pytest.approx([done[n] * GRAD_STEP / backward for n in names])


def test_the_next_step_begins_where_the_last_ended_and_summary_hands_every_step():
    clock = SimClock()
    timer, tr, model = ddp_timer(clock)
    timer.on_step_begin(clock.now)
    one_step(timer, tr, model)
    first_end = clock.now
    timer.on_step_begin(123.0)  # later steps begin where the previous one ended, whatever the begin says
    clock.advance(0.5)  # logging between the steps: the next step's data part
    one_step(timer, tr, model, calls=1)
    first, second = timer.steps
    assert second["start"] == pytest.approx(first_end)
    assert second["data"] == pytest.approx(0.5 + FETCH) and second["forward"] == pytest.approx(FORWARD)
    assert second["forward_calls"] == 1 and first["forward_calls"] == 2
    s = timer.summary()
    assert s["steps"] == [first, second] and s["method"] == "simulated clock" and s["hook"] == "none"
    assert s["comm"] == "DDP bucket hooks" and s["note"] is None and s["grad_groups"] == timer.groups
    assert s["units"] is None  # a model stnb knows no layer classes of: no FSDP units to report
    assert s["host_clock"] == "the same clock (CPU)"


def test_an_evaluation_between_steps_is_in_neither_step():
    clock = SimClock()
    timer, tr, model = ddp_timer(clock)
    timer.resume(clock.now)  # before any step: nothing began, nothing moves
    assert timer._prev_end is None
    timer.on_step_begin(clock.now)
    one_step(timer, tr, model)
    clock.advance(3.0)  # the trainer evaluates (the dev curve): the step clock resumes at its end
    timer.resume(clock.now)
    resumed = clock.now
    clock.advance(0.5)  # logging, the next batch's wait: the next step's data part
    one_step(timer, tr, model, calls=1)
    first, second = timer.steps
    assert second["start"] == pytest.approx(resumed) and second["data"] == pytest.approx(0.5 + FETCH)
    assert second["step"] == pytest.approx(first["step"] - FORWARD + 0.5)  # one forward fewer, 0.5 s of logging


def test_a_step_before_the_origin_only_moves_the_step_clock():
    clock = SimClock()
    timer = StepTimer(clock=clock, enabled=True)
    timer.on_step_begin(1.0)
    clock.now = 2.0
    timer.on_step_end(2.0)  # not attached yet: nothing to split
    assert timer.steps == [] and timer._pending == []
    timer.origin = 0.0
    clock.now = 3.0
    timer.on_step_end(3.0)
    assert [st["step"] for st in timer.steps] == [1.0]  # measured from the previous step's end


def test_wire_bytes_follow_the_hook_and_the_embedding_rows_hook_counts_what_it_sends():
    clock = SimClock()
    for name, size in (("none", 4), ("fp16", 2), ("bf16", 2)):
        timer = StepTimer(clock=clock, enabled=True)
        timer.hook = name
        timer.timed(lambda state, bucket: _done(bucket))(None, Bucket())
        assert timer._buckets[-1][2] == BUCKET * size, name
    assert WIRE_BYTES["embedding_rows"] is None
    timer = StepTimer(clock=clock, enabled=True)
    timer.hook = "embedding_rows"

    class RowsState:  # stnb's embedding-rows hook counts the elements it sends
        sent_elements = 7

    def rows_hook(state, bucket):
        state.sent_elements += 300
        return _done(bucket)

    fut = timer.timed(rows_hook)(RowsState(), Bucket())
    assert timer._buckets[-1][2] == 300 * 4
    assert torch.equal(fut.wait(), torch.zeros(BUCKET))  # the hook's result, handed on
    untimed = StepTimer(clock=clock, enabled=False)
    assert untimed.timed(rows_hook) is rows_hook


def _done(bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def test_the_hook_the_time_split_registers_is_the_strategys_torchs_or_none_for_stnbs_own():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d

    from stnb import TrainConfig, strategies

    for name in ("ddp", "zero1"):
        s = strategies.get(name)
        assert s.ddp_hook(TrainConfig(strategy=name)) == ("none", d.allreduce_hook)
        assert s.ddp_hook(TrainConfig(strategy=name, comm_hook="fp16")) == ("fp16", d.fp16_compress_hook)
        assert s.ddp_hook(TrainConfig(strategy=name, comm_hook="bf16")) == ("bf16", d.bf16_compress_hook)
        assert s.ddp_hook(TrainConfig(strategy=name, comm_hook="embedding_rows")) == ("embedding_rows", None)
    assert strategies.get("fsdp").ddp_hook(TrainConfig(strategy="fsdp")) == ("none", None)


def fsdp_step(clock, gather):
    """One step of a model whose layers are FSDP units: each unit's all-gather takes ``gather`` (timer, model, step)."""
    model = Net(clock)
    timer, tr = attached(model)
    for unit in model.encoder.layer:  # what attach registers on each FSDP unit
        unit.register_forward_pre_hook(timer._gather_start, prepend=True)
        unit.register_forward_pre_hook(lambda m, a: clock.advance(gather))  # FSDP's own all-gather
        unit.register_forward_pre_hook(timer._gather_end)
    timer.comm = "FSDP forward all-gathers"
    timer.on_step_begin(clock.now)
    one_step(timer, tr, model, calls=1)
    return timer, model, timer.steps[0]


def test_on_a_gpu_fsdps_gathers_in_flight_and_their_overlap_are_not_measured():
    """Issue 32 item 4.9: on CUDA the marks are events on the compute stream, so the span around a unit's
    all-gather is the stream's wait for it (exposed), while FSDP2 runs the gather itself, prefetched, on its own
    stream: comm_overlapped 0.0 (and comm_total = the wait) claimed what was not measured. On CPU the gather runs
    inside the span (0.0 overlapped is what happened)."""
    gather = 0.07
    _, _, st = fsdp_step(DeviceSimClock(), gather)
    assert st["comm_exposed"] == pytest.approx(2 * gather) and st["forward"] == pytest.approx(FORWARD)
    assert st["comm_total"] is None and st["comm_overlapped"] is None and st["gathers"] == 2
    assert sum(st[p] for p in PHASES) == pytest.approx(st["step"])
    _, _, host = fsdp_step(SimClock(), gather)
    assert host["comm_total"] == pytest.approx(2 * gather) and host["comm_overlapped"] == 0.0


def test_fsdp_forward_all_gathers_are_exposed_communication_not_forward():
    """FSDP: the unit's all-gather (between the two pre-hooks attach puts around FSDP's) leaves forward."""
    gather = 0.07
    timer, model, st = fsdp_step(SimClock(), gather)
    assert len(timer.steps) == 1
    assert st["gathers"] == 2 and st["comm_total"] == pytest.approx(2 * gather)
    assert st["forward"] == pytest.approx(FORWARD) and st["comm_exposed"] == pytest.approx(2 * gather)
    assert st["comm_overlapped"] == 0.0 and len(st["comm_spans"]) == 2
    assert st["backward_compute"] == pytest.approx(4 * GRAD_STEP)
    assert sum(st[p] for p in PHASES) == pytest.approx(st["step"])
    assert "buckets" not in st and "comm_bytes" not in st
    model.eval()  # evaluation's forwards are no training step's: no gather, no forward mark
    with torch.no_grad():
        model(torch.ones(2, 3))
    assert timer._gathers == [] and timer._fwd_start is None and timer._calls == 0


def test_a_single_device_step_has_no_communication_and_forward_ends_where_backward_starts():
    clock = SimClock()
    model = Net(clock)
    timer, tr = attached(model)
    assert timer.hook is None and timer.comm is None
    timer.on_step_begin(clock.now)
    tr.get_batch_samples()
    loss = model(torch.ones(2, 3)).sum()
    clock.advance(0.3)  # the loss after the model's forward: counted in forward
    tr.accelerator.backward(loss)
    clock.advance(REST)
    timer.on_step_end(clock.now)  # no optimizer callbacks (an older trainer)
    (st,) = timer.steps
    assert st["forward"] == pytest.approx(FORWARD + 0.3) and st["backward_compute"] == pytest.approx(4 * GRAD_STEP)
    assert st["comm_exposed"] == 0.0 and st["optimizer"] == 0.0 and st["other"] == pytest.approx(REST)
    assert "optimizer_step" not in st and "clip" not in st and "comm_total" not in st
    assert sum(st[p] for p in PHASES) == pytest.approx(st["step"])


def test_union_counts_overlapping_time_once():
    assert _union([]) == 0.0
    assert _union([(0.0, 1.0), (0.5, 2.0)]) == pytest.approx(2.0)
    assert _union([(3.0, 4.0), (0.0, 1.0)]) == pytest.approx(2.0)  # apart, in any order
    assert _union([(0.0, 2.0), (0.5, 1.0)]) == pytest.approx(2.0)  # one inside another
    assert _union([(0.0, 1.0), (1.0, 1.5)]) == pytest.approx(1.5)  # touching
    assert _union([(1.0, 1.0), (2.0, 1.5)]) == 0.0  # empty and reversed spans add nothing
    assert _union([(2.0, 1.5), (3.0, 4.0)]) == pytest.approx(1.0)  # ... and stop nothing after them
    assert _union([(0.0, 2.0), (1.0, 3.0), (2.5, 4.0)]) == pytest.approx(4.0)  # a chain of overlaps


def test_combine_needs_every_rank_and_keeps_the_steps_they_all_have():
    def rank(*ends):
        return {"steps": [{"backward_compute_end": e, "comm_exposed": 0.5, "step": 1.0} for e in ends]}

    a, b = combine([rank(1.0, 2.0, 3.0), rank(1.2, None), None, {}])
    assert [st.get("wait") for st in a["steps"]] == [pytest.approx(0.2), None, None]
    assert "wait" not in a["steps"][2]  # only the steps every rank measured
    assert b["steps"][0]["wait"] == 0.0 and b["steps"][1]["wait"] is None
    assert a["steps"][1]["comm_exposed"] == 0.5  # left whole where the wait cannot be told apart
    original = rank(1.0)
    combine([original, rank(2.0)])
    assert "wait" not in original["steps"][0]  # the summaries it was given are left as they were


def _result(steps_per_rank, warm=2):
    return {"config": {"warmup_steps_excluded": warm},
            "time_split": [{"method": "simulated clock", "steps": s} for s in steps_per_rank]}


def _step(step=1.0, other=0.0, **parts):
    st = {"step": step, "data": 0.1, "forward": 0.3, "backward_compute": 0.4, "comm_exposed": 0.1,
          "optimizer": 0.1 - other, "other": other, "wait": 0.0}
    st.update(parts)
    return st


def test_problems_name_the_rank_the_step_and_what_is_wrong():
    good = [_step() for _ in range(4)]
    assert problems(_result([good, good])) == []
    assert problems(_result([good]), warmup=4) == ["rank 0: no steady step measured (simulated clock)"]
    bad = [_step(), _step(), _step(forward=0.0, backward_compute=0.7), _step(wait=-0.01, optimizer=0.11)]
    found = problems(_result([good, bad]))
    assert found == ["rank 1 step 2: no forward or backward measured", "rank 1 step 3: negative wait"]
    assert problems(_result([[_step(backward_compute=0.0)] * 3]), warmup=0) == \
        [f"rank 0 step {i}: no forward or backward measured" for i in range(3)]
    # within a millionth of the step a negative part is a rounding error, not a fault
    assert problems(_result([[_step(data=-1e-7, forward=0.3000001)] * 3])) == []
    assert problems(_result([[_step(data=-2e-6)] * 3])) == ["rank 0 step 2: negative data"]
    unattributed = [_step(other=0.06) for _ in range(3)]
    assert problems(_result([unattributed])) == ["rank 0: 6.0% of the step is attributed to nothing (limit 5%)"]
    assert problems(_result([unattributed]), tolerance=0.06) == []
    assert problems(_result([[_step(other=0.05)] * 3])) == []  # at the limit
    assert problems({"time_split": []}) == ["no time split in the result"]
    assert problems({"time_split": [None]}) == ["rank 0: no steady step measured (None)"]
    assert problems({"time_split": [{"steps": [_step()] * 3}]}) == []  # the default warm-up: 2 steps


def test_problems_reads_a_run_result_and_its_warmup():
    class Run:
        def to_dict(self):
            return _result([[_step(forward=0.0), _step(forward=0.0, other=0.0), _step()]], warm=2)

    assert problems(Run()) == []
    assert problems(Run(), warmup=1) == ["rank 0 step 1: no forward or backward measured"]


def test_table_is_each_ranks_mean_over_the_steady_steps_in_ms():
    fast = [_step(forward=9.0), _step(forward=9.0), _step(forward=0.2), _step(forward=0.4)]
    slow = [_step(), _step(), _step(comm_total=0.2, optimizer_step=0.05, clip=0.01, data_wait=None),
            _step(comm_total=0.4, optimizer_step=0.07, clip=0.03, data_wait=0.02)]
    t = table(_result([fast, slow]))
    assert list(t.index) == [0, 1]
    assert t.loc[0, "forward_ms"] == pytest.approx(300.0)  # warm-up steps left out
    assert t.loc[1, "comm_total_ms"] == pytest.approx(300.0) and t.loc[1, "clip_ms"] == pytest.approx(20.0)
    assert t.loc[1, "optimizer_step_ms"] == pytest.approx(60.0) and t.loc[1, "data_wait_ms"] == pytest.approx(20.0)
    assert t.loc[0, "step_ms"] == pytest.approx(1000.0) and t.loc[1, "wait_ms"] == 0.0
    assert t.loc[0, ["comm_total_ms", "optimizer_step_ms"]].isna().all()  # not measured on rank 0
    assert "comm_overlapped_ms" not in t.columns
    assert table(_result([fast]), warmup=3).loc[0, "forward_ms"] == pytest.approx(400.0)
    assert table({"time_split": []}).empty and table({}).empty


# ---- the sentence under the split (stnb.plots.timesplit: means, knob_hints, advice) ------------------------

STEP = 2.0


def _run(strategy="ddp", world=2, config=None, **parts):
    """A run whose every steady step of every rank (STEP seconds) splits as ``parts`` say, in shares of the
    step (the rest: forward)."""
    st = {"data": 0.0, "backward_compute": 0.0, "comm_exposed": 0.0, "wait": 0.0, "optimizer": 0.0, "other": 0.0,
          "comm_total": 0.0, "comm_overlapped": 0.0}
    st.update(parts)
    st["forward"] = 1.0 - sum(v for k, v in st.items() if k in PHASES + ("wait",) and k != "forward")
    st = {k: (v * STEP if v is not None else None) for k, v in st.items()}
    st["step"] = STEP
    warm = {"step": 9.0, "forward": 9.0, "wait": 9.0}  # warm-up steps: left out
    return {"strategy": strategy, "world_size": world, "config": {"warmup_steps_excluded": 1, **(config or {})},
            "time_split": [{"steps": [warm, dict(st)]} for _ in range(world)]}


def test_means_are_over_the_steady_steps_of_every_rank():
    from stnb.plots.timesplit import means

    r = _run(data=0.1)
    r["time_split"][1]["steps"][1]["data"] = 0.3
    r["time_split"][1]["steps"][1]["comm_total"] = None
    r["time_split"][1]["steps"][1]["comm_overlapped"] = 0.4
    m = means(r)
    assert m["data"] == pytest.approx(0.25) and m["step"] == STEP and m["comm_total"] == 0.0
    assert m["forward"] == pytest.approx(0.9 * STEP) and m["wait"] == 0.0  # the warm-up step's 9 s left out
    assert m["comm_overlapped"] == pytest.approx(0.2)
    assert means({"time_split": [{"steps": []}], "config": {}})["step"] is None
    assert means({})["forward"] is None and means({"time_split": [{}, None]})["step"] is None
    steps = [{"step": 5.0}, {"step": 4.0}, {"step": 1.0}]
    assert means({"time_split": [{"steps": steps}]})["step"] == 1.0  # no config: 2 warm-up steps


def test_knob_hints_are_the_runs_strategys_own():
    from stnb.plots.timesplit import knob_hints
    from stnb.strategies import options

    lever = {name: o.lever for name, o in options().items()}
    assert knob_hints({"strategy": "ddp"}) == [lever["comm_hook"], lever["bucket_cap_mb"]]
    assert lever["comm_hook"] == "comm_hook='fp16' (half the bytes on the wire)"
    assert knob_hints({"strategy": "fsdp"}) == [lever["reshard_after_forward"]]
    assert knob_hints({"strategy": "zero2"}) == []  # fsdp's resharding is not its option
    assert knob_hints({"strategy": "deepspeed", "config": {"stage": 2}}) == [lever["stage"]]
    assert knob_hints({"strategy": "deepspeed", "config": {"stage": 1}}) == []  # the lowest stage already
    assert knob_hints({"strategy": "no-such-strategy"}) == [] and knob_hints({}) == []


def test_advice_names_what_dominates_each_step_and_the_knob_that_shrinks_it():
    from stnb.plots.timesplit import advice

    assert advice({}) == "No time split in this run (measured on CPU ranks; on CUDA use the profiler)."
    assert advice(_run(wait=0.16, comm_exposed=0.5)) == (
        "Waiting for the slowest rank takes 16% of each step: the ranks are uneven (other work on the machine, "
        "uneven batches); fewer ranks, or one per free core/GPU, would help.")
    assert advice(_run(wait=0.15, comm_exposed=0.21)) == (
        "Exposed communication takes 21% of each step: a bigger batch per device or gradient accumulation (fewer "
        "collectives per sample), comm_hook='fp16' (half the bytes on the wire), or another bucket_cap_mb would help.")
    assert advice(_run("single", 1, comm_exposed=0.3)) == (
        "Exposed communication takes 30% of each step: a bigger batch per device or gradient accumulation (fewer "
        "collectives per sample) would help.")
    assert advice(_run(comm_exposed=0.2, data=0.16)) == (
        "Data loading and logging take 16% of each step: more loader workers, or log less often.")
    assert advice(_run(data=0.15, optimizer=0.21)) == (
        "The optimizer takes 21% of each step: a bigger batch per step (or accumulation) spreads it over more "
        "samples; sharding (FSDP) divides it by the ranks.")
    fsdp = _run("fsdp", optimizer=0.2, backward_compute=0.5, comm_total=None)
    assert advice(fsdp) == (
        "Forward and backward take 80% of each step, this strategy's own collectives inside them (not separated "
        "without the profiler): compare with DDP's split, or reshard_after_forward=False (no second all-gather in "
        "backward).")
    assert advice(_run("single", 1, backward_compute=0.5, comm_total=None, comm_exposed=0.05)) == (
        "Compute dominates (95% of each step, exposed communication 5%): communication does not hold this run back; "
        "more devices add throughput only where each brings its own compute (ranks sharing CPU cores do not: "
        "compare samples/s with one device's).")
    assert advice(_run(backward_compute=0.5, comm_exposed=0.1)).startswith("Compute dominates (90% of each step, "
                                                                          "exposed communication 10%)")
    assert advice(_run("fsdp", comm_exposed=0.25)) == (
        "Exposed communication takes 25% of each step: a bigger batch per device or gradient accumulation (fewer "
        "collectives per sample), or reshard_after_forward=False (no second all-gather in backward) would help.")
    assert advice(_run("ddp", comm_total=None)) == (
        "Forward and backward take 100% of each step, this strategy's own collectives inside them (not separated "
        "without the profiler): compare with DDP's split, or comm_hook='fp16' (half the bytes on the wire), or "
        "another bucket_cap_mb.")
    unrecorded = _run("ddp", comm_total=None)
    unrecorded.pop("world_size")  # one rank unless the run says otherwise
    assert advice(unrecorded).startswith("Compute dominates (100% of each step")


def test_problems_and_table_take_the_runs_own_warmup_else_two_steps():
    bad, good = _step(forward=0.0), _step()

    class Run:
        def to_dict(self):
            return {"config": {"warmup_steps_excluded": 1}, "time_split": [{"method": "m", "steps": [bad, bad, good]}]}

    assert problems(Run()) == ["rank 0 step 1: no forward or backward measured"]
    assert problems(Run(), warmup=2) == []
    assert problems({"time_split": [{"steps": [bad, bad, good]}]}) == []  # no config: the default 2
    assert table(Run()).loc[0, "forward_ms"] == pytest.approx(150.0)
    assert table({"time_split": [{"steps": [bad, bad, good]}]}).loc[0, "forward_ms"] == pytest.approx(300.0)
    t = table({"time_split": [{}, {"steps": [good] * 3}]})  # a rank that recorded no steps: a row without values
    assert list(t.index) == [0, 1] and t.loc[0].isna().all() and t.loc[1, "step_ms"] == pytest.approx(1000.0)
    assert problems({"time_split": [{}, {"steps": [bad] * 3}]}) == [
        "rank 0: no steady step measured (None)", "rank 1 step 2: no forward or backward measured"]


def test_problems_weigh_negatives_and_the_unattributed_share_by_the_steps_length():
    two = [_step(step=2.0, other=0.12, optimizer=0.1, forward=1.1, data=0.2) for _ in range(5)]  # 6% unattributed, steps of 2 s
    assert problems(_result([two])) == ["rank 0: 6.0% of the step is attributed to nothing (limit 5%)"]
    assert problems(_result([[_step(step=2.0, data=-1e-6, forward=1.3)] * 3])) == []  # under a millionth of 2 s
    assert problems(_result([[_step(data=-1e-6, forward=0.300001)] * 3])) == []  # exactly a millionth: not yet
    assert problems(_result([[_step(data=-0.1, wait=-0.1, forward=0.5)] * 3])) == [
        "rank 0 step 2: negative data, wait"]


def test_table_has_the_overlapped_communication_where_measured():
    st = _step(comm_total=0.3, comm_overlapped=0.2)
    assert table(_result([[st] * 3])).loc[0, "comm_overlapped_ms"] == pytest.approx(200.0)



class SimEvents:
    """The device clock's interface (stnb.timesplit.CudaEvents) on simulated seconds: a mark is done once the
    test has "synchronised" past it; its host readings (time.perf_counter) read the same simulated clock."""

    method = "simulated events"

    def __init__(self, clock):
        self.clock, self.done_until = clock, -1.0

    def mark(self, host=None):
        return self.clock.now

    def done(self, mark):
        return mark <= self.done_until

    def settle(self):
        self.done_until = self.clock.now

    def seconds(self, mark, origin):
        return mark - origin


def test_on_a_device_clock_steps_wait_for_their_events_and_carry_the_host_seconds(monkeypatch):
    import stnb.timesplit as ts

    clock = SimClock()
    monkeypatch.setattr(ts.time, "perf_counter", lambda: clock.now)  # host readings on the simulated clock too
    events = SimEvents(clock)
    timer, tr, model = ddp_timer(clock)
    timer.clock = events  # what attach picks for a model on a CUDA device
    timer.method = events.method
    timer.origin = events.mark()
    timer.on_step_begin(clock.now)
    one_step(timer, tr, model)
    assert timer.steps == [] and len(timer._pending) == 1  # the device has not reached the step's end yet
    events.settle()
    clock.advance(1.0)  # the next step: the first one's events are done by now
    one_step(timer, tr, model, calls=1)
    assert len(timer.steps) == 1 and len(timer._pending) == 1
    s = timer.summary()  # waits for the device: every step resolved
    assert len(s["steps"]) == 2 and timer._pending == []
    assert s["host_clock"] == "host seconds (time.perf_counter) beside the device's CUDA events: steps' 'host'"
    first, second = s["steps"]
    backward = 4 * GRAD_STEP + TAIL
    assert first["host"] == pytest.approx({"forward": 2 * FORWARD, "backward": backward, "optimizer_step": OPT_STEP,
                                           "step": FETCH + 2 * FORWARD + backward + CLIP + OPT_STEP + REST})
    assert second["host"]["step"] == pytest.approx(1.0 + FETCH + FORWARD + backward + CLIP + OPT_STEP + REST)
    assert second["host"]["forward"] == pytest.approx(FORWARD)
    assert first["step"] == pytest.approx(first["host"]["step"])  # the device's marks: the same simulated seconds
    clock.advance(0.5)
    one_step(timer, tr, model)  # after a summary, steps go on being split
    assert len(timer.summary()["steps"]) == 3


def test_frozen_parameters_are_in_no_gradient_group():
    clock = SimClock()
    model = Net(clock)
    model.head.weight.requires_grad_(False)
    timer = StepTimer(clock=clock, enabled=True)
    timer._hook_gradients(model)
    assert [g["name"] for g in timer.groups] == ["embeddings", "layer 0", "layer 1"]


class Plain(torch.nn.Module):
    """A model whose backward takes no simulated time, with a parameter no forward uses (a pooler)."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.encoder = torch.nn.Module()
        self.encoder.layer = torch.nn.ModuleList([torch.nn.Linear(3, 1)])
        self.pooler = torch.nn.Linear(3, 3)

    def forward(self, x):
        self.clock.advance(FORWARD)
        return self.encoder.layer[0](x)


def test_readiness_needs_a_backward_that_took_time_and_a_group_never_ready_is_none():
    clock = SimClock()
    model = Plain(clock)
    timer, tr = attached(model)
    assert [g["name"] for g in timer.groups] == ["layer 0", "other"]
    timer.on_step_begin(clock.now)
    one_step(timer, tr, model, calls=1)  # backward: no simulated time
    assert "grad_ready" not in timer.steps[-1]
    model.encoder.layer[0].register_full_backward_hook(lambda *a: clock.advance(0.2))
    clock.advance(0.1)
    one_step(timer, tr, model, calls=1)
    assert timer.steps[-1]["grad_ready"] == [pytest.approx(1.0), None]  # the pooler: no gradient, never ready
    x = torch.ones(3, requires_grad=True)  # a backward that reaches no parameter of the model
    model(x)
    tr.accelerator.backward(Takes.apply(x * 2, lambda: clock.advance(0.3)).sum())
    timer.on_step_end(clock.now)
    assert "grad_ready" not in timer.steps[-1] and timer.steps[-1]["backward_calls"] == 1


def test_an_optimizer_step_begun_but_not_ended_is_not_reported():
    clock = SimClock()
    model = Plain(clock)
    timer, tr = attached(model)
    timer.on_step_begin(clock.now)
    model(torch.ones(3)).sum()
    tr.accelerator.backward(model(torch.ones(3)).sum())
    timer.on_pre_optimizer_step()
    clock.advance(OPT_STEP)
    timer.on_step_end(clock.now)  # no on_optimizer_step
    st = timer.steps[-1]
    assert "optimizer_step" not in st and "clip" not in st and st["optimizer"] == 0.0


def test_a_step_without_a_training_forward_has_no_data_part():
    clock = SimClock()
    timer = StepTimer(clock=clock, enabled=True)
    timer.origin = 0.0
    clock.now = 1.0
    timer.on_step_begin(1.0)
    clock.now = 1.5
    timer.on_step_end(1.5)
    st = timer.steps[-1]
    assert st["data"] == 0.0 and st["forward"] == 0 and st["other"] == pytest.approx(0.5)


def test_a_bucket_still_in_flight_at_the_steps_end_counts_its_bytes_not_its_time():
    clock = SimClock()
    timer, tr, model = ddp_timer(clock)
    timer.on_step_begin(clock.now)
    stuck = []
    model.during["embeddings"] = lambda: timer.timed(pending)(stuck, Bucket(numel=10))  # never completed
    one_step(timer, tr, model, calls=1)
    st = timer.steps[-1]
    assert st["buckets"] == 3 and st["comm_bytes"] == (2 * BUCKET + 10) * 4
    assert len(st["comm_spans"]) == 2 and st["comm_total"] == pytest.approx(GRAD_STEP + TAIL)


def test_the_split_is_on_unless_stnb_time_split_is_off(monkeypatch):
    monkeypatch.delenv("STNB_TIME_SPLIT", raising=False)
    assert StepTimer().enabled
    for value, on in (("off", False), ("on", True), ("anything", True)):
        monkeypatch.setenv("STNB_TIME_SPLIT", value)
        assert StepTimer().enabled is on
    assert StepTimer(enabled=True).enabled  # asked for explicitly: the environment does not matter
    monkeypatch.setenv("STNB_TIME_SPLIT", "on")
    assert StepTimer(enabled=False).enabled is False
    s = StepTimer().summary()  # never attached: nothing measured, nothing made up
    assert s == {"method": None, "hook": None, "units": None, "steps": [], "comm": None, "note": None,
                 "grad_groups": [], "host_clock": "the same clock (CPU)"}


def test_a_backward_stnb_did_not_wrap_is_not_timed():
    clock = SimClock()
    model = Net(clock)
    timer, tr = attached(model)
    timer.on_step_begin(clock.now)
    model(torch.ones(2, 3)).sum().backward()  # a training step calling backward itself, not the accelerator's
    clock.advance(REST)
    timer.on_step_end(clock.now)
    st = timer.steps[-1]
    assert st["backward"] == 0 and st["backward_calls"] == 0 and "grad_ready" not in st
    assert st["data_wait"] is None  # no batch fetched through the trainer either
    assert st["forward"] == 0 and st["other"] == pytest.approx(st["step"] - st["data"])


def test_combine_keeps_each_ranks_other_fields():
    a, b = combine([{"method": "clock readings (CPU)", "comm": "DDP bucket hooks",
                     "steps": [{"backward_compute_end": 1.0, "comm_exposed": 0.2}]},
                    {"method": "m", "steps": [{"backward_compute_end": 1.1, "comm_exposed": 0.2}]}])
    assert a["method"] == "clock readings (CPU)" and a["comm"] == "DDP bucket hooks" and b["method"] == "m"
    assert combine([]) == []


class Split(torch.nn.Module):
    """One layer whose two halves get their gradients GRAD_STEP apart: ``second``'s first, then ``first``'s."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.encoder = torch.nn.Module()
        self.encoder.layer = torch.nn.ModuleList([torch.nn.Module()])
        self.encoder.layer[0].first = torch.nn.Linear(3, 3)
        self.encoder.layer[0].second = torch.nn.Linear(3, 1)
        self.head = torch.nn.Linear(1, 1)
        self.head_only = False  # a step whose loss reaches the head alone (layer 0 gets no gradient)

    def forward(self, x):
        self.clock.advance(FORWARD)
        if self.head_only:
            return self.head(x[:, :1])
        layer = self.encoder.layer[0]
        h = Takes.apply(layer.first(x), lambda: self.clock.advance(GRAD_STEP))  # between the halves' gradients
        h = Takes.apply(layer.second(h), lambda: self.clock.advance(GRAD_STEP))  # after the head's
        return self.head(h)


def hooked(model) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_after_the_first_step_each_gradient_group_keeps_the_hook_of_its_last_parameter():
    clock = SimClock()
    model = Split(clock)
    timer, tr = attached(model)
    assert [(g["name"], g["params"]) for g in timer.groups] == [("layer 0", 4), ("other", 2)]
    assert hooked(model) == 6
    timer.on_step_begin(clock.now)
    one_step(timer, tr, model, calls=1)
    assert hooked(model) == 2  # one per group: a mark costs host time (a CUDA event on a GPU) at every step
    for _ in range(2):
        clock.advance(0.5)
        one_step(timer, tr, model, calls=1)
    first, *later = (st["grad_ready"] for st in timer.steps)
    # layer 0 is ready when `first`'s gradients come (its last), at the end of backward; the head at its start
    assert first == pytest.approx([1.0, 0.0])
    assert later == [pytest.approx(first)] * 2


def test_a_parameter_whose_gradient_never_came_keeps_its_hook():
    clock = SimClock()
    model = Split(clock)
    timer, tr = attached(model)
    timer.on_step_begin(clock.now)
    model.head_only = True
    one_step(timer, tr, model, calls=1)  # a step through the head alone: layer 0 got no gradient
    assert hooked(model) == 5  # the head's two parameters: one hook left; layer 0's four kept
    model.head_only = False
    clock.advance(0.5)
    one_step(timer, tr, model, calls=1)
    assert timer.steps[-1]["grad_ready"] == [pytest.approx(1.0), pytest.approx(0.0)]


def test_the_hook_benchmark_times_a_backward_with_every_parameter_hooked_and_one_per_group():
    from stnblab.splitbench import hook_cost, own_cost

    assert 0 < own_cost(buckets=2, repeats=5) < 1.0  # the timer's own code per simulated step (the bench's figure)

    o = hook_cost(layers=3, linears=2, repeats=3)
    assert (o["parameters"], o["groups"], o["hooks_left"]) == (12, 3, 3)
    assert min(o["none_s"], o["every_parameter_s"], o["one_per_group_s"]) > 0


def test_a_parameter_whose_gradient_comes_again_later_in_the_step_is_the_one_kept():
    """Two backwards in a step (gradient accumulation, a cached loss): the group's mark is its latest gradient,
    so the parameter kept is the one whose gradient came last in the step, not last in the first backward."""
    clock = SimClock()
    model = Split(clock)
    timer, tr = attached(model)
    second = model.encoder.layer[0].second

    def step():
        tr.get_batch_samples()
        tr.accelerator.backward(model(torch.ones(2, 3)).sum())  # layer 0: `second`'s gradient, then `first`'s
        part = Takes.apply(second(torch.ones(2, 3)), lambda: clock.advance(GRAD_STEP))
        tr.accelerator.backward(part.sum())  # `second`'s gradient again, at the end of this backward
        timer.on_pre_optimizer_step()
        timer.on_optimizer_step()
        timer.on_step_end(clock.now)

    timer.on_step_begin(clock.now)
    for _ in range(3):
        step()
        clock.advance(0.5)
    first, *later = (st["grad_ready"] for st in timer.steps)
    assert first == pytest.approx([1.0, 0.0])  # the latest backward's start: layer 0 ready at its end
    assert later == [pytest.approx(first)] * 2
